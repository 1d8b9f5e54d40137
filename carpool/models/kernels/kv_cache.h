/* The paged KV cache's elements: float32, or IEEE half precision (float16: half the
   memory and half the bytes a step reads, llama.cpp's default cache type). A cache
   is a plain array of either; `half` says which, and every reader or writer takes
   it as an argument, so where a caller passes a constant the compiler builds each
   kind's loop apart.

   Writing rounds and reading widens as half.h converts, eight values at a time
   where the compiler targets F16C (every AVX2 CPU has it). */

#ifndef CARPOOL_KV_CACHE_H
#define CARPOOL_KV_CACHE_H

#include <stdint.h>
#include <string.h>

#include "half.h"

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
