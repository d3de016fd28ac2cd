/* Decode-sized matmuls on torch's packed INT4 CPU layout with bf16 activations:
 * out[M, N] (bf16) = x[M, K] (bf16) @ W[N, K]^T, for the small batches of a decode step.
 *
 * The weights are the ones torch's kernel (_weight_int4pack_mm_for_cpu) multiplies by, bit for bit:
 * w = bf16(fma(q - 8, scale, zero)) with bf16 scales and zeros per group (see
 * llmd_int4pack_to_bf16_t in quant_gemm.c for the layout: per 64 output rows and per input k,
 * 32 bytes, byte r holding row r in its low nibble and row 32 + r in its high nibble).
 *
 * Why not torch's kernel: at 16 rows it takes ~1.6x the time of a dense bf16 matmul on this
 * project's machines. Here the weights of 64 rows are dequantised 32 inputs at a time into a buffer
 * in L1 and used by every activation row; with AVX512-BF16 the products are bf16 dot products
 * (two inputs per fp32 lane and instruction). The dequantisation (~0.4 cycles a weight, ~70 us for
 * a 3072x576 weight on two cores) is what torch's kernel beats at one row: llmd.kernels.quant_cpu
 * sends batches of GEMM_ROWS or more here.
 *
 * Order of additions, the same in every build and for every batch: out[m, n] is one fp32 chain over
 * the input pairs (0, 1), (2, 3), ...; within a pair the odd input's product is added first, then
 * the even one's (the order of the AVX512-BF16 dot product; each bf16 x bf16 product is exact in
 * fp32, so only the additions round), rounded to bf16 (nearest even) at the end. So a row's result
 * does not depend on the other rows of its batch or on the thread count, and the portable C build
 * gives the same bits as the vector build.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define I4P_AVX512 1
#endif

#define NB 64 /* output rows per packed block */
#define KC 32 /* inputs dequantised at a time (groups are multiples of 32) */
#define MT 4  /* activation rows per register tile */
#define MAX_M 1024 /* activation rows per call; the caller sends fewer (llmd.kernels.quant_cpu) */

int llmd_int4pack_gemm_vectorised(void) {
#ifdef I4P_AVX512
    return 1;
#else
    return 0;
#endif
}

static inline float i4p_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint32_t i4p_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

/* fp32 -> bf16 bits, nearest even (weights and sums here are finite or inf, never NaN: see below). */
static inline uint16_t i4p_round(float f) {
    uint32_t bits = i4p_bits(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#ifdef I4P_AVX512
/* The 64 rows' bf16 weights at two inputs k, k + 1 (``src``: the packed bytes of k; k + 1's follow),
 * as four vectors of 16 (k, k + 1) pairs, rows 16j..16j+15 in pairs[j]. */
static inline __attribute__((always_inline)) void dequant_pair(const uint8_t *src, const __m512 scale[4],
                                                               const __m512 zero[4], __m512 centred,
                                                               __m512i interleave, __m512i pairs[4]) {
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    __m512 w[2][4];
    for (int e = 0; e < 2; e++) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(src + e * 32));
        const __m256i lo = _mm256_and_si256(bytes, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
        const __m128i parts[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                                  _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
        for (int j = 0; j < 4; j++) {
            const __m512 q = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(parts[j]), centred);
            w[e][j] = _mm512_fmadd_ps(q, scale[j], zero[j]);
        }
    }
    /* to bf16, nearest even, as in i4p_round (no NaN or denormal: q is small, scales and zeros are
     * finite bf16, so a nonzero weight is far above the denormal range) */
    for (int j = 0; j < 4; j++)
        pairs[j] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(w[1][j], w[0][j]));
}

/* The group's scales and zeros of rows b * NB .. b * NB + 63, widened to fp32. */
static inline void load_scales(const uint16_t *sz, int64_t b, __m512 scale[4], __m512 zero[4]) {
    for (int j = 0; j < 4; j++) {
        const __m512i pairs = _mm512_loadu_si512((const void *)(sz + 2 * (b * NB + 16 * j)));
        scale[j] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        zero[j] = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
    }
}

#define CENTRED _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7) /* q - 8, q = 0..15 */
/* interleave two rows of 16 bf16: element 2r from the first (input k), 2r + 1 from the second (k + 1) */
#define INTERLEAVE _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, \
                                    23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0)
#endif

/* wbuf[p * NB + r]: the bf16 weights of row b * NB + r at inputs k0 + 2p (low half) and k0 + 2p + 1
 * (high half), for p < KC / 2. ``sz``: the group's [N, 2] scales and zeros. */
static void dequant_block(const uint8_t *packed, const uint16_t *sz, int64_t K, int64_t b, int64_t k0,
                          uint32_t *wbuf) {
#ifdef I4P_AVX512
    __m512 scale[4], zero[4];
    load_scales(sz, b, scale, zero);
    const __m512 centred = CENTRED;
    const __m512i interleave = INTERLEAVE;
    for (int p = 0; p < KC / 2; p++) {
        __m512i pairs[4];
        dequant_pair(packed + b * K * 32 + (k0 + 2 * p) * 32, scale, zero, centred, interleave, pairs);
        for (int j = 0; j < 4; j++) _mm512_storeu_si512((void *)(wbuf + p * NB + 16 * j), pairs[j]);
    }
#else
    for (int p = 0; p < KC / 2; p++) {
        uint16_t w[2][NB];
        for (int e = 0; e < 2; e++) {
            const uint8_t *src = packed + b * K * 32 + (k0 + 2 * p + e) * 32;
            for (int r = 0; r < NB; r++) {
                const int64_t n = b * NB + r;
                const int q = r < 32 ? src[r] & 0x0f : src[r - 32] >> 4;
                const float s = i4p_f32((uint32_t)sz[2 * n] << 16), z = i4p_f32((uint32_t)sz[2 * n + 1] << 16);
                w[e][r] = i4p_round(fmaf((float)q - 8.0f, s, z));
            }
        }
        for (int r = 0; r < NB; r++) wbuf[p * NB + r] = (uint32_t)w[0][r] | ((uint32_t)w[1][r] << 16);
    }
#endif
}

/* acc[m][0:NB] += the products of x[m] at inputs k0 .. k0 + KC - 1 and wbuf, pair by pair. */
static inline __attribute__((always_inline)) void accumulate(const uint16_t *x, int64_t K, int64_t k0,
                                                             const uint32_t *wbuf, float *acc, const int mt) {
#ifdef I4P_AVX512
    __m512 a[MT][4];
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < 4; j++) a[m][j] = _mm512_loadu_ps(acc + m * NB + 16 * j);
    for (int p = 0; p < KC / 2; p++) {
        __m512bh w[4];
        for (int j = 0; j < 4; j++) w[j] = (__m512bh)_mm512_loadu_si512((const void *)(wbuf + p * NB + 16 * j));
        for (int m = 0; m < mt; m++) {
            uint32_t pair;
            memcpy(&pair, x + m * K + k0 + 2 * p, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int j = 0; j < 4; j++) a[m][j] = _mm512_dpbf16_ps(a[m][j], xv, w[j]);
        }
    }
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + m * NB + 16 * j, a[m][j]);
#else
    for (int m = 0; m < mt; m++)
        for (int p = 0; p < KC / 2; p++) {
            const float x0 = i4p_f32((uint32_t)x[m * K + k0 + 2 * p] << 16);
            const float x1 = i4p_f32((uint32_t)x[m * K + k0 + 2 * p + 1] << 16);
            for (int r = 0; r < NB; r++) {
                const uint32_t wp = wbuf[p * NB + r];
                float s = acc[m * NB + r];
                s += x1 * i4p_f32(wp & 0xffff0000u); /* exact product, one rounding in the sum */
                s += x0 * i4p_f32(wp << 16);
                acc[m * NB + r] = s;
            }
        }
#endif
}


/* out [M, N] bf16 = x [M, K] bf16 @ W^T. N % 64 == 0, K % 32 == 0, group % 32 == 0, 1 <= M <= MAX_M.
 * Returns 0, or -1 for shapes it does not take or when memory runs out (out is then unspecified). */
int llmd_int4pack_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed,
                             const uint16_t *scales_zeros, int64_t N, int64_t group, uint16_t *out, int nthreads) {
    if (N % NB || K % KC || group % KC || M > MAX_M || M < 1) return -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint32_t wbuf[KC / 2 * NB] __attribute__((aligned(64)));
        float *acc = aligned_alloc(64, (size_t)(M * NB) * sizeof(float)); /* M x 64 sums (L2 at most) */
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < N / NB; b++) {
            if (!acc) continue;
            memset(acc, 0, (size_t)(M * NB) * sizeof(float));
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                dequant_block(packed, scales_zeros + (k0 / group) * N * 2, K, b, k0, wbuf);
                int64_t m0 = 0;
                for (; m0 + MT <= M; m0 += MT) accumulate(x + m0 * K, K, k0, wbuf, acc + m0 * NB, MT);
                switch (M - m0) {
                case 1: accumulate(x + m0 * K, K, k0, wbuf, acc + m0 * NB, 1); break;
                case 2: accumulate(x + m0 * K, K, k0, wbuf, acc + m0 * NB, 2); break;
                case 3: accumulate(x + m0 * K, K, k0, wbuf, acc + m0 * NB, 3); break;
                default: break;
                }
            }
            for (int64_t m = 0; m < M; m++)
                for (int r = 0; r < NB; r++) out[m * N + b * NB + r] = i4p_round(acc[m * NB + r]);
        }
        free(acc);
    }
    return failed ? -1 : 0;
}
