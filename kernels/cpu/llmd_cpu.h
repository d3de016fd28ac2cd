/* What the native CPU kernels share between files: the building blocks the fused decode step
 * (decode_step.c) strings together. Each body is an OpenMP worksharing loop without a parallel
 * region of its own ("orphaned"): called inside a parallel region, its iterations are split between
 * the region's threads and it ends with a barrier; called outside one, it runs on the caller's
 * thread. The public llmd_* entry points wrap each in a parallel region of their own.
 */
#ifndef LLMD_CPU_H
#define LLMD_CPU_H

#include <stdint.h>

#define LLMD_QK 32 /* activations are quantised per block of this many inputs */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* The sum of 8 fp32 lanes: halves, then pairs (one fixed order). */
static inline float llmd_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for 8 lanes (Cephes' expf: range reduction by ln 2 in two parts, a degree-6 polynomial;
 * within 2 ulp of expf over the clamped range). */
static inline __m256 llmd_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}
#endif

/* Weight layouts the quantised matmuls read (llmd.kernels.quant_cpu repacks llmd.quant's). */
enum llmd_weight_kind { LLMD_Q4X8 = 1, LLMD_Q8X8 = 2 };

/* x [M, K] fp32 -> xq [M, K] int8, xd [M, K/32] (scale of each block of 32), xm [M, K/32]
 * (xd * the block's sum of xq: what the int4 min term multiplies). */
void llmd_q8_quantize_body(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xm);
/* One row of K inputs, on the calling thread (the decode step fuses it into its per-row phases). */
void llmd_q8_quantize_row(const float *x, int64_t K, int8_t *xq, float *xd, float *xm);

/* out[m * ldo + n] = x[m] . W[n] for n < N, from activations quantised by llmd_q8_quantize_body.
 * Q4X8: w, scales, mins as laid out by llmd.kernels.quant_cpu.repack_q4x8 (mins NULL: symmetric,
 * each min -8 * its scale); Q8X8: mins is NULL. */
void llmd_qgemm_body(int kind, const int8_t *xq, const float *xd, const float *xm, int64_t M, int64_t K,
                     const uint8_t *w, const uint16_t *scales, const uint16_t *mins, int64_t N, int64_t group,
                     float *out, int64_t ldo);

/* Decode attention (paged_attention.c): q rows of stride ldq (floats), out [B, H * D]; caches of
 * rows of `cache_kind` (kv_row.h). `spans`: llmd_attention_spans_size(B) int64s that
 * llmd_attention_spans fills once per step (the groups of rows reading one context, the cells each
 * reads, the tasks); it returns their number. `partial`: llmd_attention_partial_floats(B, H, D)
 * floats of scratch. A row's keys are cut into at most LLMD_ATTN_MAX_CELLS cells. */
#define LLMD_ATTN_MAX_CELLS 16
int64_t llmd_attention_spans_size(int64_t B);
int64_t llmd_attention_spans(const int64_t *block_tables, int64_t max_blocks, const int32_t *seq_lens, int64_t B,
                             int64_t block_size, int64_t KVH, int64_t *spans);
int64_t llmd_attention_partial_floats(int64_t B, int64_t H, int64_t D);
void llmd_decode_attention_body(const float *q, int64_t ldq, const void *k_cache, const void *v_cache, int cache_kind,
                                const int64_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                                const int64_t *spans, int64_t num_spans, int64_t H, int64_t KVH, int64_t D,
                                int64_t block_size, int64_t window, float scale, float *partial, float *out);

#endif
