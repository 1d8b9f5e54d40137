/* y = x @ W^T with int8 dot products (--weight-kernel native-int8) over weights whose
   blocks are interleaved FEATURES output features at a time, for any number of rows.

   The file's layout (quantized_dot.h) keeps one feature's block of 32 weights
   together, so an integer dot product yields 8 partial sums of one block that must
   each be converted and scaled: ~5 instructions per row and block. Interleaved, one
   512-bit multiply-add of unsigned by signed bytes (AVX-512 VNNI vpdpbusd), four
   bytes of x broadcast, advances FEATURES features at once, eight of them finish a
   block, and one conversion and two multiply-adds scale it: ~12 instructions per row
   for FEATURES blocks. Unpacking the weights is shared by up to TILE_ROWS rows, so a
   step of a few rows (a speculative verification) costs little more than one row;
   prompt chunks run here too, so every row of every step gets the same arithmetic.

   Layouts (carpool/models/packed_linear.py Interleaved writes them), n a multiple of
   FEATURES, groups = k / 32, per strip of FEATURES features and block:
   Q4_1: quants [4][FEATURES][4] uint8: byte (j, f, b) holds weight 4j + b of feature
         f's block in its low nibble and weight 16 + 4j + b in its high nibble;
         extra: mins, float32 [FEATURES].
   Q8_0: quants [8][FEATURES][4] int8: byte (j, f, b) is weight 4j + b of feature f;
         extra: 128 * the sum of the block's quants, int32 [FEATURES] (vpdpbusd takes
         x + 128 as its unsigned bytes; this takes the 128s back out).
   scales: float32 [FEATURES].

   x's rows are rounded per block of 32 to int8 steps first (quantize_rows in
   quantized_dot.h). Each feature's result, per row, over blocks g in order:
       acc = fma((float)(q . xq) * xscale, scale, acc)   then for Q4_1
       acc = fma(xsum, min, acc)
   with the integer dot product exact; the portable C path computes the same (fmaf),
   so a row's result depends neither on the step's other rows nor on the threads. */

#ifndef CARPOOL_INTERLEAVED_H
#define CARPOOL_INTERLEAVED_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quantized_dot.h"
#include "work_share.h"

#define FEATURES 16
#define TILE_ROWS 8

typedef struct {
    int64_t kind_q8_0;
    const void *quants;
    const float *scales;
    const void *extra; /* Q4_1: mins (float); Q8_0: 128 * quant sums (int32) */
} InterleavedWeight;

/* bytes of one block of FEATURES features */
static inline int64_t tile_bytes(int64_t kind_q8_0) { return FEATURES * BLOCK / (kind_q8_0 ? 1 : 2); }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INTERLEAVED_VNNI 1

static inline __m512i broadcast4(const uint8_t *a) {
    int32_t v;
    memcpy(&v, a, sizeof v);
    return _mm512_set1_epi32(v);
}

/* x's rows as vpdpbusd's unsigned operand: Q4_1's weights are the unsigned bytes and
   x the signed ones; Q8_0's signed weights take x + 128 (xu) as the unsigned ones */
ALWAYS_INLINE void interleaved_tile(int64_t kind_q8_0, const uint8_t *q, const float *scales,
                                    const void *extra, const int8_t *xq, const uint8_t *xu,
                                    const float *xscales, const float *xsums, int64_t k,
                                    int64_t groups, int64_t rows, float *y, int64_t n) {
    __m512 acc[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    const int64_t bytes = tile_bytes(kind_q8_0);
    for (int64_t g = 0; g < groups; g++, q += bytes) {
        __m512i w[8];
        if (kind_q8_0) {
            for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(q + 64 * j));
        } else {
            for (int j = 0; j < 4; j++) {
                const __m512i packed = _mm512_loadu_si512((const void *)(q + 64 * j));
                w[j] = _mm512_and_si512(packed, low);
                w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            }
        }
        const __m512 scale = _mm512_loadu_ps(scales + g * FEATURES);
        for (int64_t r = 0; r < rows; r++) {
            __m512i dot;
            if (kind_q8_0) {
                const uint8_t *a = xu + r * k + g * BLOCK;
                dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), broadcast4(a), w[0]);
                for (int j = 1; j < 8; j++) dot = _mm512_dpbusd_epi32(dot, broadcast4(a + 4 * j), w[j]);
                dot = _mm512_sub_epi32(
                    dot, _mm512_loadu_si512((const void *)((const int32_t *)extra + g * FEATURES)));
            } else {
                const uint8_t *a = (const uint8_t *)(xq + r * k + g * BLOCK);
                dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], broadcast4(a));
                for (int j = 1; j < 8; j++)
                    dot = _mm512_dpbusd_epi32(dot, w[j], broadcast4(a + 4 * (j % 4) + 16 * (j / 4)));
            }
            const __m512 part =
                _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xscales[r * groups + g]));
            acc[r] = _mm512_fmadd_ps(part, scale, acc[r]);
            if (!kind_q8_0)
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsums[r * groups + g]),
                                         _mm512_loadu_ps((const float *)extra + g * FEATURES),
                                         acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(y + r * n, acc[r]);
}
#else
#define INTERLEAVED_VNNI 0

ALWAYS_INLINE void interleaved_tile(int64_t kind_q8_0, const uint8_t *q, const float *scales,
                                    const void *extra, const int8_t *xq, const uint8_t *xu,
                                    const float *xscales, const float *xsums, int64_t k,
                                    int64_t groups, int64_t rows, float *y, int64_t n) {
    (void)xu;
    const int64_t bytes = tile_bytes(kind_q8_0);
    for (int64_t r = 0; r < rows; r++)
        for (int f = 0; f < FEATURES; f++) {
            float acc = 0.f;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *t = q + g * bytes;
                const int8_t *a = xq + r * k + g * BLOCK;
                int32_t dot = 0;
                if (kind_q8_0) {
                    for (int j = 0; j < 8; j++)
                        for (int b = 0; b < 4; b++)
                            dot += (int8_t)t[(j * FEATURES + f) * 4 + b] * a[4 * j + b];
                } else {
                    for (int j = 0; j < 4; j++)
                        for (int b = 0; b < 4; b++) {
                            const uint8_t byte = t[(j * FEATURES + f) * 4 + b];
                            dot += (byte & 15) * a[4 * j + b] + (byte >> 4) * a[16 + 4 * j + b];
                        }
                }
                const float part = (float)dot * xscales[r * groups + g];
                acc = fmaf(part, scales[g * FEATURES + f], acc);
                if (!kind_q8_0)
                    acc = fmaf(xsums[r * groups + g], ((const float *)extra)[g * FEATURES + f], acc);
            }
            y[r * n + f] = acc;
        }
}
#endif

/* One copy per kind and row count, so the accumulators stay in registers */
static void interleaved_rows(int64_t kind_q8_0, const uint8_t *q, const float *scales,
                             const void *extra, const int8_t *xq, const uint8_t *xu,
                             const float *xscales, const float *xsums, int64_t k, int64_t groups,
                             int64_t rows, float *y, int64_t n) {
#define CALL_Q4_1(count) \
    interleaved_tile(0, q, scales, extra, xq, xu, xscales, xsums, k, groups, count, y, n)
#define CALL_Q8_0(count) \
    interleaved_tile(1, q, scales, extra, xq, xu, xscales, xsums, k, groups, count, y, n)
    if (kind_q8_0) {
        FOR_EACH_ROW_COUNT(CALL_Q8_0)
    } else {
        FOR_EACH_ROW_COUNT(CALL_Q4_1)
    }
#undef CALL_Q4_1
#undef CALL_Q8_0
}

/* Returns 1 when out of memory. */
static int interleaved_linear(const InterleavedWeight *w, const float *x, float *y, int64_t rows,
                              int64_t n, int64_t k, int num_threads) {
    const int64_t groups = k / BLOCK, strips = n / FEATURES, bytes = tile_bytes(w->kind_q8_0);
    QuantizedRows xq;
    if (quantize_rows(x, rows, k, 1, &xq)) return 1;
    uint8_t *xu = w->kind_q8_0 ? malloc((size_t)(rows * k)) : NULL;
    Share *shares = new_shares(strips, num_threads);
    if (shares == NULL || (w->kind_q8_0 && xu == NULL)) {
        free_rows(&xq);
        free(xu);
        free(shares);
        return 1;
    }
    for (int64_t i = 0; xu != NULL && i < rows * k; i++) xu[i] = (uint8_t)(xq.quants[i] ^ 0x80);
    const int64_t extra_size = w->kind_q8_0 ? sizeof(int32_t) : sizeof(float);
#pragma omp parallel num_threads(num_threads)
    {
        int victim = 0;
        for (int64_t s; (s = next_chunk(shares, num_threads, omp_get_thread_num(), &victim)) >= 0;)
            for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS)
                interleaved_rows(w->kind_q8_0, (const uint8_t *)w->quants + s * groups * bytes,
                                 w->scales + s * groups * FEATURES,
                                 (const char *)w->extra + s * groups * FEATURES * extra_size,
                                 xq.quants + r0 * k, xu == NULL ? NULL : xu + r0 * k,
                                 xq.scales + r0 * groups, xq.sums + r0 * groups, k, groups,
                                 rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS,
                                 y + r0 * n + s * FEATURES, n);
    }
    free_rows(&xq);
    free(xu);
    free(shares);
    return 0;
}

#endif
