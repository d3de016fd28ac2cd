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
        int64_t i = 0;
        float amax = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 mx = _mm256_setzero_ps();
        for (; i + 8 <= D; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + i)));
        float lanes[8];
        _mm256_storeu_ps(lanes, mx);
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, lanes[j]); /* a max is exact in any order */
#endif
        for (; i < D; i++) amax = fmaxf(amax, fabsf(src[i]));
        const float want = amax / 127.0f;
        uint16_t half = llmd_f32_to_f16(want);
        if (llmd_f16_to_f32(half) < want) half++; /* rounded up: the next fp16 (positive: its bits count up) */
        const float s = llmd_f16_to_f32(half);
        memcpy(q + D, &half, sizeof half);
        if (s == 0.0f) { /* an all-zero row */
            memset(q, 0, (size_t)D);
            return;
        }
        i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        /* x / s (a division, as the reference: a reciprocal would round differently), to nearest even;
         * |x / s| <= 127 as s was rounded up, so no clamp is needed */
        const __m256 vs = _mm256_set1_ps(s);
        for (; i + 32 <= D; i += 32) {
            __m256i v[4];
            for (int j = 0; j < 4; j++)
                v[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(src + i + 8 * j), vs),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            /* packs work within 128-bit lanes: one permute restores the order */
            const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
#endif
        for (; i < D; i++) {
            const float v = nearbyintf(src[i] / s);
            q[i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
        }
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
