/* y = x @ W^T for a few rows of x, with W kept in its GGUF blocks of 32 weights
   along a row: a decode step then reads the file's bytes (5 bits a weight for
   Q4_1, 8.5 for Q8_0) instead of 32, and each weight is the float32 the file
   defines (scale * q + min). For many rows the float32 GEMM wins (see packed_linear.py).

   x: [rows, k] float32; y: [rows, n] float32; scales (and mins): [n, k / 32] float32
   q4_1: quants [n, k / 32, 16] uint8, weight j of a block in the low nibble of byte
         j, weight j + 16 in the high nibble; w = scale * q + min
   q8_0: quants [n, k / 32, 32] int8; w = scale * q */

#ifndef CARPOOL_QUANTIZED_DOT_H
#define CARPOOL_QUANTIZED_DOT_H

#include <stdint.h>
#include <stdlib.h>

#include "work_share.h"
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; } /* built without OpenMP: one thread */
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define BLOCK 32

#if defined(__AVX2__) && defined(__FMA__)
static inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 bytes_to_floats(__m128i bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

/* out[r] = sum over blocks of scale * (q . x_r), for ROWS rows of x at once: each
   block is unpacked once for all of them; the mins' share is added by the caller */
#define ROWS 4

static void q4_1_dot(const uint8_t *q, const float *scales, const float *x, int64_t k,
                     int64_t rows, int64_t groups, float *out) {
    const __m128i low = _mm_set1_epi8(15);
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, q += BLOCK / 2) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
        const __m128i lo = _mm_and_si128(bytes, low);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        const __m256 w0 = bytes_to_floats(lo), w1 = bytes_to_floats(_mm_srli_si128(lo, 8));
        const __m256 w2 = bytes_to_floats(hi), w3 = bytes_to_floats(_mm_srli_si128(hi, 8));
        const __m256 scale = _mm256_set1_ps(scales[g]);
        for (int64_t r = 0; r < rows; r++) {
            const float *xg = x + r * k + g * BLOCK;
            __m256 dot = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
            dot = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), dot);
            dot = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), dot);
            dot = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), dot);
            acc[r] = _mm256_fmadd_ps(scale, dot, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) out[r] = horizontal_sum(acc[r]);
}

static void q8_0_dot(const int8_t *q, const float *scales, const float *x, int64_t k,
                     int64_t rows, int64_t groups, float *out) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, q += BLOCK) {
        __m256 w[BLOCK / 8];
        for (int j = 0; j < BLOCK / 8; j++)
            w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * j))));
        const __m256 scale = _mm256_set1_ps(scales[g]);
        for (int64_t r = 0; r < rows; r++) {
            const float *xg = x + r * k + g * BLOCK;
            __m256 dot = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
            for (int j = 1; j < BLOCK / 8; j++)
                dot = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xg + 8 * j), dot);
            acc[r] = _mm256_fmadd_ps(scale, dot, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) out[r] = horizontal_sum(acc[r]);
}
#else
#define ROWS 4

static void q4_1_dot(const uint8_t *q, const float *scales, const float *x, int64_t k,
                     int64_t rows, int64_t groups, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *qb = q;
        float acc = 0.f;
        for (int64_t g = 0; g < groups; g++, qb += BLOCK / 2) {
            const float *xg = x + r * k + g * BLOCK;
            float dot = 0.f;
            for (int j = 0; j < BLOCK / 2; j++)
                dot += (float)(qb[j] & 15) * xg[j] + (float)(qb[j] >> 4) * xg[j + BLOCK / 2];
            acc += scales[g] * dot;
        }
        out[r] = acc;
    }
}

static void q8_0_dot(const int8_t *q, const float *scales, const float *x, int64_t k,
                     int64_t rows, int64_t groups, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + r * k + g * BLOCK;
            float dot = 0.f;
            for (int j = 0; j < BLOCK; j++) dot += (float)q[g * BLOCK + j] * xg[j];
            acc += scales[g] * dot;
        }
        out[r] = acc;
    }
}
#endif

#define CHUNK 16 /* output features a thread claims at a time */

static int q4_1_few_rows(const float *x, const uint8_t *quants, const float *scales,
                         const float *mins, float *y, int64_t rows, int64_t n, int64_t k,
                         int num_threads) {
    const int64_t groups = k / BLOCK, chunks = (n + CHUNK - 1) / CHUNK;
    /* sums[r * groups + g]: the sum of row r's block g, which each min multiplies */
    float *sums = malloc(sizeof(float) * (size_t)(rows * groups));
    Share *shares = new_shares(chunks, num_threads);
    if (sums == NULL || shares == NULL) {
        free(sums);
        free(shares);
        return 1;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.f;
            for (int j = 0; j < BLOCK; j++) s += x[r * k + g * BLOCK + j];
            sums[r * groups + g] = s;
        }
#pragma omp parallel num_threads(num_threads)
    {
        int victim = 0;
        for (int64_t c; (c = next_chunk(shares, num_threads, omp_get_thread_num(), &victim)) >= 0;)
            for (int64_t o = c * CHUNK; o < n && o < (c + 1) * CHUNK; o++) {
                const float *mo = mins + o * groups;
                for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
                    const int64_t count = rows - r0 < ROWS ? rows - r0 : ROWS;
                    float dots[ROWS];
                    q4_1_dot(quants + o * groups * (BLOCK / 2), scales + o * groups, x + r0 * k,
                             k, count, groups, dots);
                    for (int64_t r = 0; r < count; r++) {
                        float total = dots[r];
                        for (int64_t g = 0; g < groups; g++)
                            total += mo[g] * sums[(r0 + r) * groups + g];
                        y[(r0 + r) * n + o] = total;
                    }
                }
            }
    }
    free(sums);
    free(shares);
    return 0;
}

static int q8_0_few_rows(const float *x, const int8_t *quants, const float *scales, float *y,
                         int64_t rows, int64_t n, int64_t k, int num_threads) {
    const int64_t groups = k / BLOCK, chunks = (n + CHUNK - 1) / CHUNK;
    Share *shares = new_shares(chunks, num_threads);
    if (shares == NULL) return 1;
#pragma omp parallel num_threads(num_threads)
    {
        int victim = 0;
        for (int64_t c; (c = next_chunk(shares, num_threads, omp_get_thread_num(), &victim)) >= 0;)
            for (int64_t o = c * CHUNK; o < n && o < (c + 1) * CHUNK; o++)
                for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
                    const int64_t count = rows - r0 < ROWS ? rows - r0 : ROWS;
                    float dots[ROWS];
                    q8_0_dot(quants + o * groups * BLOCK, scales + o * groups, x + r0 * k, k,
                             count, groups, dots);
                    for (int64_t r = 0; r < count; r++) y[(r0 + r) * n + o] = dots[r];
                }
    }
    free(shares);
    return 0;
}

#endif
