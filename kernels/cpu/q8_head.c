/* The LM head on Q8_0 weights: out[M, N] = x[M, K] @ W[N, K]^T in fp32, W = d * q with one fp16
 * scale d per 32 int8 weights q (GGUF Q8_0, held as llmd INT8 g32).
 *
 * Why: the head of a small model is a large share of a decode step (SmolLM2-135M: 49152 x 576,
 * 57 MB in bf16, read once per step). Q8_0 halves the bytes, and unlike a bf16 copy it keeps the
 * checkpoint's values exactly: d * q (11-bit by 8-bit mantissas) is exact in fp32, so the only
 * rounding left is the fp32 sum.
 *
 * Weight rows are dequantised ROWS at a time into a buffer and multiplied by every activation row,
 * so a batch pays the conversion once. Each dot product has one fixed order of additions in every
 * build: 16 lanes, lane j summing inputs j, j+16, j+32, ... with fused multiply-adds, then the
 * lanes added pairwise (j + 8, j + 4, j + 2, j + 1). So the AVX-512, AVX2 and portable builds give
 * the same bits, and a logit does not depend on the batch it is in, its place in the batch or the
 * thread count (threads split the rows).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "scalar.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define Q8H_AVX2 1
#endif
#if defined(Q8H_AVX2) && defined(__AVX512F__)
#define Q8H_AVX512 1
#endif

#define QK 32
#define LANES 16
#define MAX_K 8192 /* inputs; the caller checks (llmd.kernels.q8_head) */
#define ROWS 4     /* weight rows per tile */
#ifdef Q8H_AVX512
#define XROWS 2 /* activation rows per tile */
#else
#define XROWS 1
#endif

/* w[K] = d * q for one row (exact). */
static void dequant_row(const int8_t *q, const uint16_t *d, int64_t K, float *w) {
    for (int64_t g = 0; g < K / QK; g++) {
        const float s = llmd_f16_to_f32(d[g]);
        const int8_t *qg = q + g * QK;
        float *wg = w + g * QK;
#if defined(Q8H_AVX512)
        const __m512 vs = _mm512_set1_ps(s);
        for (int i = 0; i < QK; i += 16) {
            __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qg + i)));
            _mm512_storeu_ps(wg + i, _mm512_mul_ps(_mm512_cvtepi32_ps(v), vs));
        }
#elif defined(Q8H_AVX2)
        const __m256 vs = _mm256_set1_ps(s);
        for (int i = 0; i < QK; i += 8) {
            __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qg + i)));
            _mm256_storeu_ps(wg + i, _mm256_mul_ps(_mm256_cvtepi32_ps(v), vs));
        }
#else
        for (int i = 0; i < QK; i++) wg[i] = s * (float)qg[i];
#endif
    }
}

/* Add 16 lanes pairwise: lane j += lane j + 8, then j + 4, j + 2, j + 1. */
static inline float reduce16(float lane[LANES]) {
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int j = 0; j < width; j++) lane[j] += lane[j + width];
    return lane[0];
}

#ifdef Q8H_AVX2
/* reduce16 on lanes held as two 8-lane halves: the same additions in the same order. */
static inline float reduce16_avx(__m256 lo, __m256 hi) {
    __m256 a = _mm256_add_ps(lo, hi);                                               /* j + 8 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* j + 4 */
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));                                         /* j + 2 */
    b = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));                                     /* j + 1 */
    return _mm_cvtss_f32(b);
}
#endif

/* res[m * ROWS + r] = sum_i w[r * K + i] * x[m * K + i] for ROWS weight rows and xr <= XROWS
 * activation rows, each in the order described at the top. The chains run side by side so their
 * latencies overlap, and each load of w or x feeds several of them. Always inlined with a constant
 * xr, so each count gets its own unrolled loop. */
static inline __attribute__((always_inline)) void dot_tile(const float *w, const float *x, int64_t K, float *res,
                                                           const int xr) {
#if defined(Q8H_AVX512)
    __m512 acc[XROWS][ROWS];
    for (int m = 0; m < xr; m++)
        for (int r = 0; r < ROWS; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; i += LANES) {
        __m512 wv[ROWS];
        for (int r = 0; r < ROWS; r++) wv[r] = _mm512_loadu_ps(w + r * K + i);
        for (int m = 0; m < xr; m++) {
            const __m512 xv = _mm512_loadu_ps(x + m * K + i);
            for (int r = 0; r < ROWS; r++) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
        }
    }
    for (int m = 0; m < xr; m++)
        for (int r = 0; r < ROWS; r++)
            res[m * ROWS + r] = reduce16_avx(_mm512_castps512_ps256(acc[m][r]),
                                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m][r]), 1)));
#elif defined(Q8H_AVX2)
    __m256 lo[ROWS], hi[ROWS];
    (void)xr; /* XROWS is 1 */
    for (int r = 0; r < ROWS; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < K; i += LANES) {
        const __m256 xl = _mm256_loadu_ps(x + i), xh = _mm256_loadu_ps(x + i + 8);
        for (int r = 0; r < ROWS; r++) {
            lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * K + i), xl, lo[r]);
            hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * K + i + 8), xh, hi[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) res[r] = reduce16_avx(lo[r], hi[r]);
#else
    (void)xr; /* XROWS is 1 */
    for (int r = 0; r < ROWS; r++) {
        float lane[LANES] = {0};
        for (int64_t i = 0; i < K; i += LANES)
            for (int j = 0; j < LANES; j++) lane[j] = fmaf(w[r * K + i + j], x[i + j], lane[j]);
        res[r] = reduce16(lane);
    }
#endif
}

/* out[M, N] = x[M, K] @ (d * q)^T. K a multiple of 32, at most MAX_K; q [N, K] int8, d [N, K/32] fp16. */
void llmd_q8_head(const float *x, int64_t M, int64_t K, const int8_t *q, const uint16_t *d, int64_t N, float *out,
                  int nthreads) {
    if (K % QK || K > MAX_K) return;
    const int64_t tiles = (N + ROWS - 1) / ROWS;
#pragma omp parallel num_threads(nthreads)
    {
        float w[ROWS * MAX_K] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * ROWS, rows = N - n0 < ROWS ? N - n0 : ROWS;
            for (int64_t r = 0; r < ROWS; r++) { /* a short last tile repeats its last row */
                const int64_t n = n0 + (r < rows ? r : rows - 1);
                dequant_row(q + n * K, d + n * (K / QK), K, w + r * K);
            }
            for (int64_t m0 = 0; m0 < M; m0 += XROWS) {
                const int64_t xrows = M - m0 < XROWS ? M - m0 : XROWS;
                const float *xs = x + m0 * K;
                float res[XROWS * ROWS];
                switch (xrows) {
                case 1: dot_tile(w, xs, K, res, 1); break;
#if XROWS >= 2
                default: dot_tile(w, xs, K, res, XROWS); break;
#endif
                }
                for (int64_t m = 0; m < xrows; m++)
                    for (int64_t r = 0; r < rows; r++) out[(m0 + m) * N + n0 + r] = res[m * ROWS + r];
            }
        }
    }
}
