/* The paged KV cache's elements: float32, or IEEE half precision (float16: half the
   memory and half the bytes a step reads, llama.cpp's default cache type). A cache
   is a plain array of either; `half` says which, and every reader or writer takes
   it as an argument, so where a caller passes a constant the compiler builds each
   kind's loop apart.

   Writing rounds to the nearest half, ties to even (torch's `.to(torch.float16)`,
   F16C's `vcvtps2ph` with round-to-nearest); reading widens exactly. Where the
   compiler targets F16C (every AVX2 CPU has it) eight values convert in one
   instruction; elsewhere the bit-level conversions below give the same bits. */

#ifndef CARPOOL_KV_CACHE_H
#define CARPOOL_KV_CACHE_H

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

/* element i of a cache */
static inline float kv_value(const void *cache, int64_t i, int half) {
    return half ? half_to_float(((const uint16_t *)cache)[i]) : ((const float *)cache)[i];
}

/* cache elements [i, i + count) = values, rounded where the cache is half */
static inline void kv_store(void *cache, int64_t i, const float *values, int64_t count, int half) {
    if (!half) {
        memcpy((float *)cache + i, values, sizeof(float) * (size_t)count);
        return;
    }
    uint16_t *out = (uint16_t *)cache + i;
    int64_t j = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; j + 8 <= count; j += 8)
        _mm_storeu_si128((__m128i *)(out + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(values + j), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; j < count; j++) out[j] = float_to_half(values[j]);
}

/* the bytes of one element */
static inline int64_t kv_element_size(int half) { return half ? 2 : 4; }

#if defined(__AVX2__) && defined(__FMA__)
/* elements [i, i + 8) of a cache, as floats */
static inline __attribute__((always_inline)) __m256 kv_load8(const void *cache, int64_t i,
                                                             int half) {
    if (!half) return _mm256_loadu_ps((const float *)cache + i);
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + i)));
#else
    float v[8];
    for (int j = 0; j < 8; j++) v[j] = half_to_float(((const uint16_t *)cache)[i + j]);
    return _mm256_loadu_ps(v);
#endif
}
#endif

#endif
