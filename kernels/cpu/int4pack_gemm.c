/* Matmuls on torch's packed INT4 CPU layout with bf16 activations, for decode steps and short
 * prompt chunks: out[M, N] (bf16) = x[M, K] (bf16) @ W[N, K]^T with W = (q - 8) * scale + zero.
 *
 * The layout is the one torch's kernel (_weight_int4pack_mm_for_cpu) reads (see
 * llmd_int4pack_to_bf16_t below): per 64 output rows and per input k, 32 bytes, byte r
 * holding row r in its low nibble and row 32 + r in its high nibble; bf16 scales and zeros
 * [K / group, N, 2].
 *
 * Why not torch's kernel: this one is ~1.6x as fast at one row and ~1.8x at 16 (measurements in
 * llmd.kernels.quant_cpu). The weights of 64 rows are unpacked 32 inputs at a time into a buffer in
 * L1 that every activation row then uses, and the scale and zero stay out of that unpacking
 * (which is what a decode step of one sequence waits on). Per 32 inputs (a chunk of a group) and row:
 *     P = sum over the chunk of x_k * (q_k - 8)     (q - 8 and x are exact in bf16: AVX512-BF16 dot
 *                                                    products, two inputs per lane and instruction)
 *     acc = fma(P, scale, acc);  acc = fma(X, zero, acc)    with X = sum over the chunk of x_k
 * so a weight costs a nibble, a table lookup and half a dot-product instruction, shared by every
 * activation row. Unlike torch's kernel the weights are never rounded to bf16. (A variant that
 * unpacked torch's bf16-rounded weights spent twice as long unpacking and ~15% less per extra row;
 * one kernel for every row count was kept: a row's result then never depends on its batch.)
 *
 * Order of additions, the same in every build, batch and thread count: P is one fp32 chain over the
 * input pairs (k0, k0 + 1), (k0 + 2, k0 + 3), ...; within a pair the odd input's product first (the
 * AVX512-BF16 dot product's order; the products are exact in fp32, so only the additions round); X
 * is a plain left-to-right fp32 sum; the chunks go in order; the result is rounded to bf16 (nearest
 * even). The portable C build gives the vector build's bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scalar.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define I4P_AVX512 1
#endif

#define NB 64 /* output rows per packed block */
#define KC 32 /* inputs unpacked at a time (groups are multiples of 32) */
#define MT 4  /* activation rows per register tile */
#define MAX_M 1024 /* activation rows per call; the caller sends fewer (llmd.kernels.quant_cpu) */

int llmd_int4pack_gemm_vectorised(void) {
#ifdef I4P_AVX512
    return 1;
#else
    return 0;
#endif
}

#ifdef I4P_AVX512
/* bf16 bits of q - 8 for q = 0..15 (words 16..31 unused) */
#define CENTRED_BF16 _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, \
    0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000, \
    (short)0xbf80, (short)0xc000, (short)0xc040, (short)0xc080, (short)0xc0a0, (short)0xc0c0, (short)0xc0e0, (short)0xc100)
/* two vectors of 32 rows' words (input k, then k + 1) -> (k, k + 1) pairs of rows 0-15 / 16-31 */
#define PAIRS_LOW _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, \
                                   39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0)
#define PAIRS_HIGH _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, \
                                    55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16)
#endif

/* wbuf[p * NB + r]: bf16 (q - 8) of row b * NB + r at inputs k0 + 2p (low half) and k0 + 2p + 1
 * (high half), for p < KC / 2. */
static void unpack_block(const uint8_t *packed, int64_t K, int64_t b, int64_t k0, uint32_t *wbuf) {
#ifdef I4P_AVX512
    const __m512i table = CENTRED_BF16, low_pairs = PAIRS_LOW, high_pairs = PAIRS_HIGH;
    const __m512i nibble = _mm512_set1_epi16(0x0f);
    for (int p = 0; p < KC / 2; p++) {
        const uint8_t *src = packed + b * K * 32 + (k0 + 2 * p) * 32;
        __m512i lo[2], hi[2];
        for (int e = 0; e < 2; e++) {
            const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + e * 32)));
            lo[e] = _mm512_permutexvar_epi16(_mm512_and_si512(words, nibble), table); /* rows 0-31 */
            hi[e] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);     /* rows 32-63 */
        }
        uint32_t *dst = wbuf + p * NB;
        _mm512_storeu_si512((void *)dst, _mm512_permutex2var_epi16(lo[0], low_pairs, lo[1]));
        _mm512_storeu_si512((void *)(dst + 16), _mm512_permutex2var_epi16(lo[0], high_pairs, lo[1]));
        _mm512_storeu_si512((void *)(dst + 32), _mm512_permutex2var_epi16(hi[0], low_pairs, hi[1]));
        _mm512_storeu_si512((void *)(dst + 48), _mm512_permutex2var_epi16(hi[0], high_pairs, hi[1]));
    }
#else
    for (int p = 0; p < KC / 2; p++) {
        uint16_t w[2][NB];
        for (int e = 0; e < 2; e++) {
            const uint8_t *src = packed + b * K * 32 + (k0 + 2 * p + e) * 32;
            for (int r = 0; r < NB; r++) {
                const int q = r < 32 ? src[r] & 0x0f : src[r - 32] >> 4;
                w[e][r] = (uint16_t)(llmd_f32_bits((float)(q - 8)) >> 16); /* exact in bf16 */
            }
        }
        for (int r = 0; r < NB; r++) wbuf[p * NB + r] = (uint32_t)w[0][r] | ((uint32_t)w[1][r] << 16);
    }
#endif
}

/* For activation rows m < mt: acc[m] (64 rows) += scale * P + zero * X over one chunk of KC inputs
 * (see the top). ``xsum``: X of each row for this chunk (stride ``xs_stride``); ``sz``: the
 * group's [N, 2] scales and zeros. */
static inline __attribute__((always_inline)) void accumulate(const uint16_t *x, int64_t K, int64_t k0,
                                                             const uint32_t *wbuf, const float *xsum,
                                                             int64_t xs_stride, const uint16_t *sz, int64_t b,
                                                             float *acc, const int mt) {
#ifdef I4P_AVX512
    __m512 part[MT][4];
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < 4; j++) part[m][j] = _mm512_setzero_ps();
    for (int p = 0; p < KC / 2; p++) {
        __m512bh w[4];
        for (int j = 0; j < 4; j++) w[j] = (__m512bh)_mm512_loadu_si512((const void *)(wbuf + p * NB + 16 * j));
        for (int m = 0; m < mt; m++) {
            uint32_t pair;
            memcpy(&pair, x + m * K + k0 + 2 * p, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int j = 0; j < 4; j++) part[m][j] = _mm512_dpbf16_ps(part[m][j], xv, w[j]);
        }
    }
    for (int j = 0; j < 4; j++) {
        const __m512i both = _mm512_loadu_si512((const void *)(sz + 2 * (b * NB + 16 * j)));
        const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
        const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(both, _mm512_set1_epi32((int)0xffff0000u)));
        for (int m = 0; m < mt; m++) {
            __m512 a = _mm512_loadu_ps(acc + m * NB + 16 * j);
            a = _mm512_fmadd_ps(part[m][j], scale, a);
            a = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * xs_stride]), zero, a);
            _mm512_storeu_ps(acc + m * NB + 16 * j, a);
        }
    }
#else
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < NB; r++) {
            float part = 0.0f;
            for (int p = 0; p < KC / 2; p++) {
                const uint32_t wp = wbuf[p * NB + r];
                part += llmd_f32_from_bits((uint32_t)x[m * K + k0 + 2 * p + 1] << 16) * llmd_f32_from_bits(wp & 0xffff0000u);
                part += llmd_f32_from_bits((uint32_t)x[m * K + k0 + 2 * p] << 16) * llmd_f32_from_bits(wp << 16);
            }
            const int64_t n = b * NB + r;
            float a = acc[m * NB + r];
            a = fmaf(part, llmd_f32_from_bits((uint32_t)sz[2 * n] << 16), a);
            a = fmaf(xsum[m * xs_stride], llmd_f32_from_bits((uint32_t)sz[2 * n + 1] << 16), a);
            acc[m * NB + r] = a;
        }
#endif
}

/* out [M, N] bf16 = x [M, K] bf16 @ W^T. N % 64 == 0, K % 32 == 0, group % 32 == 0, 1 <= M <= MAX_M.
 * Returns 0, or -1 for shapes it does not take or when memory runs out (out is then unspecified). */
int llmd_int4pack_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed,
                            const uint16_t *scales_zeros, int64_t N, int64_t group, uint16_t *out, int nthreads) {
    if (N % NB || K % KC || group % KC || M > MAX_M || M < 1) return -1;
    const int64_t chunks = K / KC;
    float *xsum = malloc((size_t)(M * chunks) * sizeof(float)); /* X per activation row and chunk */
    if (!xsum) return -1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < chunks; c++) {
            float sum = 0.0f;
            for (int64_t k = c * KC; k < (c + 1) * KC; k++) sum += llmd_f32_from_bits((uint32_t)x[m * K + k] << 16);
            xsum[m * chunks + c] = sum;
        }
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
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t k0 = c * KC;
                const uint16_t *sz = scales_zeros + (k0 / group) * N * 2;
                unpack_block(packed, K, b, k0, wbuf);
                int64_t m0 = 0;
                for (; m0 + MT <= M; m0 += MT)
                    accumulate(x + m0 * K, K, k0, wbuf, xsum + m0 * chunks + c, chunks, sz, b, acc + m0 * NB, MT);
                switch (M - m0) {
                case 1: accumulate(x + m0 * K, K, k0, wbuf, xsum + m0 * chunks + c, chunks, sz, b, acc + m0 * NB, 1); break;
                case 2: accumulate(x + m0 * K, K, k0, wbuf, xsum + m0 * chunks + c, chunks, sz, b, acc + m0 * NB, 2); break;
                case 3: accumulate(x + m0 * K, K, k0, wbuf, xsum + m0 * chunks + c, chunks, sz, b, acc + m0 * NB, 3); break;
                default: break;
                }
            }
            for (int64_t m = 0; m < M; m++)
                for (int r = 0; r < NB; r++) out[m * N + b * NB + r] = llmd_f32_to_bf16(acc[m * NB + r]);
        }
        free(acc);
    }
    free(xsum);
    return failed ? -1 : 0;
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
