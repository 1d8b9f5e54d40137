/* exp over 8 floats at once (AVX2), for the softmax and SiLU of the decode kernels:
   glibc's expf is scalar, and it was a third of a 64-row fused decode step.

   Cephes' single-precision method, as torch's own vectorised exp on AVX2 uses a
   method of this class: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two
   for an exact reduction), a degree-5 polynomial for exp(r), and 2^n put into the
   exponent bits; within 2 ulp over the range where the result is a normal float.
   Inputs are clamped to +-88.376, where expf over- or underflows anyway. */

#ifndef CARPOOL_VECTOR_MATH_H
#define CARPOOL_VECTOR_MATH_H

#include <math.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    const __m256i exponent = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}
#endif

/* out[i] = exp(in[i] - shift) for i < count; returns their sum */
static inline float exp_shifted(const float *in, float shift, float *out, int64_t count) {
    int64_t i = 0;
    float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 sums = _mm256_setzero_ps();
    const __m256 s = _mm256_set1_ps(shift);
    for (; i + 8 <= count; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(in + i), s));
        _mm256_storeu_ps(out + i, e);
        sums = _mm256_add_ps(sums, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sums);
    for (int j = 0; j < 8; j++) sum += lanes[j];
#endif
    for (; i < count; i++) {
        out[i] = expf(in[i] - shift);
        sum += out[i];
    }
    return sum;
}

/* out[i] = g[i] / (1 + exp(-g[i])) * u[i] (SiLU(gate) * up) for i < count */
static inline void silu_times(const float *g, const float *u, float *out, int64_t count) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; i + 8 <= count; i += 8) {
        const __m256 gi = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(zero, gi));
        const __m256 silu = _mm256_div_ps(gi, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < count; i++) out[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* out[i] = GELU(g[i]) * u[i] for i < count, GELU's tanh form (torch's approximate=
   "tanh"): 0.5 g (1 + tanh(y)) with y = sqrt(2 / pi) (g + 0.044715 g^3), which is
   g / (1 + exp(-2y)) */
static inline void gelu_tanh_times(const float *g, const float *u, float *out, int64_t count) {
    const float c = 0.7978845608028654f, c3 = 0.7978845608028654f * 0.044715f;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.f), m2c = _mm256_set1_ps(-2.f * c);
    const __m256 m2c3 = _mm256_set1_ps(-2.f * c3);
    for (; i + 8 <= count; i += 8) {
        const __m256 gi = _mm256_loadu_ps(g + i);
        const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(gi, gi), gi);
        const __m256 minus_2y = _mm256_fmadd_ps(m2c3, g3, _mm256_mul_ps(m2c, gi));
        const __m256 gelu = _mm256_div_ps(gi, _mm256_add_ps(one, exp8(minus_2y)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < count; i++) {
        const float y = c * g[i] + c3 * g[i] * g[i] * g[i];
        out[i] = g[i] / (1.f + expf(-2.f * y)) * u[i];
    }
}

#endif
