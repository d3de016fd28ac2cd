/* One cached K or V row (a token's values for one KV head) in each of the cache's formats, as
 * llmd.kernels.kv_format defines them: fp32, bf16, or int8 with an fp16 scale in the row's last two
 * bytes (value = q * scale, scale = amax / 127 rounded up to an fp16, q = round-half-even(x / scale) in
 * [-127, 127]).
 * The decode step writes rows here and the decode attention reads them back as fp32, bit for bit as
 * the torch reference quantises and dequantises.
 */
#ifndef LLMD_KV_ROW_H
#define LLMD_KV_ROW_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "scalar.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

enum llmd_cache_kind { LLMD_CACHE_F32 = 0, LLMD_CACHE_BF16 = 1, LLMD_CACHE_I8 = 2 };

/* Bytes of a row of D values. */
static inline int64_t llmd_kv_row_bytes(int kind, int64_t D) {
    return kind == LLMD_CACHE_I8 ? D + 2 : D * (kind == LLMD_CACHE_BF16 ? 2 : 4);
}

/* Store D fp32 values as a row of `kind`. */
static inline void llmd_kv_store_row(void *dst, const float *src, int64_t D, int kind) {
    if (kind == LLMD_CACHE_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)D);
    } else if (kind == LLMD_CACHE_BF16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < D; i++) d[i] = llmd_f32_to_bf16(src[i]);
    } else {
        int8_t *q = dst;
        float amax = 0.0f;
        for (int64_t i = 0; i < D; i++) amax = fmaxf(amax, fabsf(src[i]));
        const float want = amax / 127.0f;
        uint16_t half = llmd_f32_to_f16(want);
        if (llmd_f16_to_f32(half) < want) half++; /* rounded up: the next fp16 (positive: its bits count up) */
        const float s = llmd_f16_to_f32(half);
        for (int64_t i = 0; i < D; i++) {
            const float v = s > 0.0f ? nearbyintf(src[i] / s) : 0.0f;
            q[i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
        }
        memcpy(q + D, &half, sizeof half);
    }
}

/* A row as fp32: the cache itself when it is fp32, else widened (bf16) or dequantised (int8) into
 * `buf`. */
static inline const float *llmd_kv_load_row(const char *src, int kind, int64_t D, float *buf) {
    if (kind == LLMD_CACHE_F32) return (const float *)src;
    int64_t i = 0;
    if (kind == LLMD_CACHE_BF16) {
#if defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= D; i += 8) {
            const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * i)));
            _mm256_storeu_ps(buf + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
        }
#endif
        for (; i < D; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, sizeof h);
            buf[i] = llmd_bf16_to_f32(h);
        }
        return buf;
    }
    uint16_t half;
    memcpy(&half, src + D, sizeof half);
    const float s = llmd_f16_to_f32(half);
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vs = _mm256_set1_ps(s);
    for (; i + 8 <= D; i += 8) {
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
        _mm256_storeu_ps(buf + i, _mm256_mul_ps(_mm256_cvtepi32_ps(q), vs));
    }
#endif
    for (; i < D; i++) buf[i] = (float)(int8_t)src[i] * s;
    return buf;
}

#endif
