/* Rotary embedding for fp32 or bf16 rows, in place: one call per q or k instead of 6 torch ops.
 *
 * At batch 1 a decoder layer's math is tiny and torch's per-op dispatch (a few us an op) is much of
 * a decoded token's time. This computes in fp32 and rounds to the tensors' dtype where the torch
 * reference (llmd.daemon.models.layers.rope_torch) does, in the same order: its results are the
 * reference's, bit for bit.
 *
 * (An RMSNorm here was tried too: bit-equal needs torch's own summation order for the mean of
 * squares, which differs between its AVX2 and AVX-512 builds; taking that mean from torch left no
 * measurable gain, and a different order changed a knife-edge greedy token of the default model.)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "scalar.h"

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? llmd_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Round through the tensors' dtype (a no-op for fp32). */
static inline float round_to(float v, int bf16) {
    return bf16 ? llmd_bf16_to_f32(llmd_f32_to_bf16(v)) : v;
}

static inline void store(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = llmd_f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* Rotate-half RoPE in place on `heads` heads of every token row: x [T, heads, D] with a row stride
 * of `row_stride` elements (q and k are views into the fused qkv output); cos/sin [T, D]. */
void llmd_rope(void *x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t row_stride, const void *cos,
               const void *sin, int bf16, int nthreads) {
    const int64_t half = head_dim / 2;
    const size_t elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        const char *c = (const char *)cos + t * head_dim * elem, *s = (const char *)sin + t * head_dim * elem;
        for (int64_t h = 0; h < heads; h++) {
            char *v = (char *)x + (t * row_stride + h * head_dim) * elem;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = load(v, i, bf16), x2 = load(v, i + half, bf16);
                /* the reference: x * cos + cat(-x2, x1) * sin, each product rounded to the dtype */
                const float a1 = round_to(x1 * load(c, i, bf16), bf16), b1 = round_to(-x2 * load(s, i, bf16), bf16);
                const float a2 = round_to(x2 * load(c, i + half, bf16), bf16);
                const float b2 = round_to(x1 * load(s, i + half, bf16), bf16);
                store(v, i, a1 + b1, bf16);
                store(v, i + half, a2 + b2, bf16);
            }
        }
    }
}
