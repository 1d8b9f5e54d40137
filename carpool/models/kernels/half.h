/* IEEE half precision (float16) and float32: widening, which is exact (every half is
   a float), and narrowing, rounded to the nearest half with ties to even (torch's
   `.to(torch.float16)`, F16C's `vcvtps2ph` with round-to-nearest). Where the compiler
   targets F16C one instruction converts; elsewhere the bit-level code gives the same
   bits. */

#ifndef CARPOOL_HALF_H
#define CARPOOL_HALF_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* the float a half's bits stand for: exact (every half is a float) */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1f) /* infinity, NaN */
        bits = sign | 0x7f800000u | (mantissa << 13);
    else if (exponent != 0) /* normal: rebias 15 -> 127 */
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    else { /* zero or subnormal: mantissa * 2^-24, exact in a float */
        const float magnitude = (float)mantissa * 0x1p-24f;
        return sign ? -magnitude : magnitude;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* f rounded to the nearest half, ties to even; past the largest half: infinity; a NaN
   stays a NaN (quiet, its top mantissa bits kept) */
static inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    bits &= 0x7fffffffu;
    if (bits > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((bits >> 13) & 0x3ffu);
    if (bits >= 0x477ff000u) return sign | 0x7c00u; /* >= 65520 rounds to infinity */
    if (bits < 0x38800000u) {
        /* below the smallest normal half (2^-14): in units of 2^-24, rounded by the
           float addition itself (ties to even in the default rounding mode): adding
           0.5 puts the unit at the float's last mantissa bit */
        float magnitude;
        memcpy(&magnitude, &bits, sizeof magnitude);
        magnitude += 0.5f;
        uint32_t rounded;
        memcpy(&rounded, &magnitude, sizeof rounded);
        return sign | (uint16_t)(rounded - 0x3f000000u);
    }
    /* normal: rebias 127 -> 15, then drop 13 mantissa bits rounding to even (a carry
       into the exponent is the right result, up to 65504's neighbour handled above) */
    const uint32_t odd = (bits >> 13) & 1u;
    return sign | (uint16_t)((bits - 0x38000000u + 0xfffu + odd) >> 13);
#endif
}

#endif
