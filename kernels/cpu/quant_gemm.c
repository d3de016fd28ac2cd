/* INT4 / INT8 weight-only matmuls on the CPU: out[M, N] = x[M, K] @ W[N, K]^T.
 *
 * The activations are first quantised to int8 per block of 32 (as llama.cpp's Q8 activations):
 * xd = amax / 127, xq = round(x / xd) (half to even), and xs = sum(xq) per block. Then a block's
 * product is an exact integer dot product scaled once:
 *     int4:  sum_b  w_scale * xd_b * dot(q_b, xq_b) + w_min * xd_b * xs_b
 *     int8:  sum_b  w_scale * xd_b * dot(q_b, xq_b)
 * where the weight's scale/min come from its group (32, 64 or 128 inputs; per channel for int8).
 * The integer parts are exact; only the float sum's order differs from the torch reference
 * (llmd.kernels.quant_cpu), so results agree within fp32 rounding.
 *
 * Weight layouts are llmd.quant's own: int4 two per byte (element 2i in the low nibble of byte i),
 * fp16 scales/mins [N, K/group]; int8 [N, K] with fp16 scales [N, K/group].
 *
 * Threads split the output rows (N); each thread unpacks a row once and multiplies it by every
 * activation row, so a batch pays the unpacking once per weight row. OpenMP here is the libgomp
 * torch already loaded (same soname), so these threads are torch's threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scalar.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLMD_AVX2 1
#endif

#define QK 32

int llmd_has_avx2(void) {
#ifdef LLMD_AVX2
    return 1;
#else
    return 0;
#endif
}

/* x [M, K] fp32 -> xq [M, K] int8, xd [M, K/32] fp32, xs [M, K/32] int32. K % 32 == 0. */
void llmd_quantize_q8(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, int32_t *xs, int nthreads) {
    const int64_t nb = K / QK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 65536)
    for (int64_t r = 0; r < M * nb; r++) {
        const float *src = x + r * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(src[i]));
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < QK; i++) {
            const int32_t v = (int32_t)nearbyintf(src[i] * id);
            xq[r * QK + i] = (int8_t)v;
            sum += v;
        }
        xd[r] = d;
        xs[r] = sum;
    }
}

#ifdef LLMD_AVX2
/* 8 partial int32 sums of u8 a[32] x s8 b[32]. maddubs saturates at int16, which these inputs
 * never reach: int4 values are <= 15, and int8 weights enter as |w| <= 128 against |x| <= 127. */
static inline __m256i dot_u8s8_32(__m256i a, __m256i b) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}

/* Lane j of the result: the sum of the 8 lanes of p[j]. */
static inline __m256i reduce8(const __m256i p[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    /* a holds blocks 0..3 as [s0 s1 s2 s3 | s0' s1' s2' s3'] (its two 128-bit halves), b 4..7. */
    const __m256i lo = _mm256_permute2x128_si256(a, b, 0x20), hi = _mm256_permute2x128_si256(a, b, 0x31);
    return _mm256_add_epi32(lo, hi);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* sum over nb blocks of 32 of ws[b] * xd[b] * dot(w block b, x block b); w holds unsigned values
 * (unpacked int4), or int8 weights when `signed_w`. */
static inline float block_dots(const uint8_t *w, int signed_w, const int8_t *x, const float *ws, const float *xd,
                               int64_t nb) {
    int64_t b = 0;
    float total = 0.0f;
#ifdef LLMD_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8) {
        __m256i p[8];
        for (int j = 0; j < 8; j++) {
            __m256i vw = _mm256_loadu_si256((const __m256i *)(w + (b + j) * QK));
            __m256i vx = _mm256_loadu_si256((const __m256i *)(x + (b + j) * QK));
            if (signed_w) { /* maddubs is u8 x s8: |w| against x carrying w's sign */
                vx = _mm256_sign_epi8(vx, vw);
                vw = _mm256_abs_epi8(vw);
            }
            p[j] = dot_u8s8_32(vw, vx);
        }
        const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(ws + b), _mm256_loadu_ps(xd + b));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(p)), scale, acc);
    }
    total = hsum8(acc);
#endif
    for (; b < nb; b++) {
        int32_t dot = 0;
        /* NOTE: two loops, not one with the sign test inside: gcc 12 -O3 vectorised that one
         * reading every weight as unsigned. */
        if (signed_w) {
            const int8_t *ws8 = (const int8_t *)w;
            for (int i = 0; i < QK; i++) dot += (int32_t)ws8[b * QK + i] * x[b * QK + i];
        } else {
            for (int i = 0; i < QK; i++) dot += (int32_t)w[b * QK + i] * x[b * QK + i];
        }
        total += ws[b] * xd[b] * (float)dot;
    }
    return total;
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef LLMD_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    total = hsum8(acc);
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* A row's fp16 per-group values, one float per block of 32. */
static void expand_groups(const uint16_t *src, int64_t nb, int64_t bpg, float *dst) {
    for (int64_t b = 0; b < nb; b++) dst[b] = llmd_f16_to_f32(src[b / bpg]);
}

/* Unpack one int4 row: packed byte i holds element 2i (low nibble) and 2i+1 (high nibble). */
static void unpack_int4_row(const uint8_t *packed, int64_t K, uint8_t *wq) {
    int64_t i = 0;
#ifdef LLMD_AVX2
    const __m128i lo_mask = _mm_set1_epi8(0x0f);
    for (; i + 16 <= K / 2; i += 16) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(packed + i));
        const __m128i lo = _mm_and_si128(v, lo_mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), lo_mask);
        _mm_storeu_si128((__m128i *)(wq + 2 * i), _mm_unpacklo_epi8(lo, hi));
        _mm_storeu_si128((__m128i *)(wq + 2 * i + 16), _mm_unpackhi_epi8(lo, hi));
    }
#endif
    for (; i < K / 2; i++) {
        wq[2 * i] = packed[i] & 0x0f;
        wq[2 * i + 1] = packed[i] >> 4;
    }
}

/* xq, xd: the quantised activations; xm [M, K/32] = xd * xs (the blocks' sums, scaled), which the
 * int4 min term needs. */
void llmd_int4_gemm(const int8_t *xq, const float *xd, const float *xm, int64_t M, int64_t K,
                    const uint8_t *packed, const uint16_t *scales, const uint16_t *mins, int64_t N,
                    int64_t group, float *out, int nthreads) {
    const int64_t nb = K / QK, ng = K / group, bpg = group / QK;
#pragma omp parallel num_threads(nthreads)
    {
        uint8_t *wq = malloc((size_t)K);
        float *ws = malloc(sizeof(float) * (size_t)nb), *wm = malloc(sizeof(float) * (size_t)nb);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            unpack_int4_row(packed + n * (K / 2), K, wq);
            expand_groups(scales + n * ng, nb, bpg, ws);
            expand_groups(mins + n * ng, nb, bpg, wm);
            for (int64_t m = 0; m < M; m++)
                out[m * N + n] = block_dots(wq, 0, xq + m * K, ws, xd + m * nb, nb) + dot_f32(wm, xm + m * nb, nb);
        }
        free(wq);
        free(ws);
        free(wm);
    }
}

void llmd_int8_gemm(const int8_t *xq, const float *xd, int64_t M, int64_t K, const int8_t *w,
                    const uint16_t *scales, int64_t N, int64_t group, float *out, int nthreads) {
    const int64_t nb = K / QK, ng = K / group, bpg = group / QK;
#pragma omp parallel num_threads(nthreads)
    {
        float *ws = malloc(sizeof(float) * (size_t)nb);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            expand_groups(scales + n * ng, nb, bpg, ws);
            for (int64_t m = 0; m < M; m++)
                out[m * N + n] = block_dots((const uint8_t *)(w + n * K), 1, xq + m * K, ws, xd + m * nb, nb);
        }
        free(ws);
    }
}

/* torch's CPU int4pack layout (torch._convert_weight_to_int4pack_for_cpu, AVX-512 builds) back to a
 * dense bf16 weight, transposed: out_t [K, N]. Row n of 64-row block b, input k, is nibble
 * n%64/32 (low, high) of byte b*K*32 + k*32 + n%32, and w = fma(q - 8, scale, zero) with
 * scales_zeros [K/group, N, 2] bf16, as torch's kernel computes it, rounded to bf16. Transposed
 * because then both the packed bytes and the output run along n. Prompt-sized batches multiply
 * faster as a dense bf16 matmul than through torch's int4 kernel; llmd.kernels.quant_cpu checks the
 * layout against torch's own kernel before trusting this (other builds pack differently). N % 64 == 0. */
void llmd_int4pack_to_bf16_t(const uint8_t *packed, const uint16_t *scales_zeros, int64_t N, int64_t K,
                             int64_t group, uint16_t *out_t, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t k = 0; k < K; k++) {
        const uint16_t *sz = scales_zeros + (k / group) * N * 2;
        uint16_t *dst = out_t + k * N;
        for (int64_t b = 0; b < N / 64; b++) {
            const uint8_t *src = packed + b * K * 32 + k * 32;
            /* two straight loops (low nibbles: rows 0-31, high: 32-63) that the compiler vectorises */
            for (int half = 0; half < 2; half++) {
                const int64_t n0 = b * 64 + half * 32;
                const int shift = half * 4;
                for (int64_t r = 0; r < 32; r++) {
                    const float q = (float)((src[r] >> shift) & 0x0f) - 8.0f;
                    const float w = fmaf(q, llmd_bf16_to_f32(sz[2 * (n0 + r)]), llmd_bf16_to_f32(sz[2 * (n0 + r) + 1]));
                    uint32_t bits;
                    memcpy(&bits, &w, sizeof bits);
                    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even (no NaN here) */
                    dst[n0 + r] = (uint16_t)(bits >> 16);
                }
            }
        }
    }
}
