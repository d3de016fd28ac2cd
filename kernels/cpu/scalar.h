/* Scalar conversions the native kernels share: fp16 and bf16 to fp32 (exact), and fp32 to bf16
 * rounded to nearest even as torch rounds (NaN stays NaN). Every build computes the same values. */
#ifndef LLMD_SCALAR_H
#define LLMD_SCALAR_H

#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

static inline float llmd_f32_from_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint32_t llmd_f32_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

static inline float llmd_bf16_to_f32(uint16_t h) { return llmd_f32_from_bits((uint32_t)h << 16); }

static inline uint16_t llmd_f32_to_bf16(float f) {
    uint32_t bits = llmd_f32_bits(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float llmd_f16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h); /* the same value, one instruction */
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 113;
            while (!(mant & 0x400u)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    return llmd_f32_from_bits(bits);
#endif
}

/* fp32 to fp16, rounded to nearest even as torch rounds (overflow to inf, subnormals kept). */
static inline uint16_t llmd_f32_to_f16(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const uint32_t bits = llmd_f32_bits(f), sign = (bits >> 16) & 0x8000u, abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* NaN */
    if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
    if (abs < 0x38800000u) {                                   /* an fp16 subnormal, or zero */
        if (abs <= 0x33000000u) return (uint16_t)sign;         /* at most half the smallest subnormal: to even 0 */
        const uint32_t exp = abs >> 23, mant = (abs & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - exp; /* 14 .. 24 */
        uint32_t h = mant >> shift;
        const uint32_t rest = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = (abs >> 13) - (112u << 10);
    const uint32_t rest = abs & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* a carry into the exponent is right */
    return (uint16_t)(sign | h);
#endif
}

#endif
