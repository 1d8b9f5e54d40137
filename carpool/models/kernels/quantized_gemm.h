/* y = x @ W^T for many rows of x, W in GGUF blocks (see quantized_dot.h for the
   layouts). With many rows the product is bound by arithmetic, not by reading W, so
   each strip of STRIP output features is dequantized once into float32 (exactly the
   weights the file defines: scale * q + min, rounded as torch rounds it) and then
   multiplied with every row: an outer-product kernel keeps a STRIP x LANES tile of
   sums in registers (12 AVX2 accumulators), reading x transposed, LANES rows at a
   time. Each sum runs over k in order, so a row's result does not depend on the
   other rows of the batch. */

#ifndef CARPOOL_QUANTIZED_GEMM_H
#define CARPOOL_QUANTIZED_GEMM_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quantized_dot.h" /* the block kinds */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define GEMM_BLOCK 32
#define STRIP 6  /* output features per tile */
#define LANES 16 /* rows per tile: two AVX2 vectors */

/* w[0..32) = the weights of one block: scale * q (+ min for Q4_1 and Q5_1, and for Q8_16
   where it has mins; Q8_16's and Q6_16's scale and min change after 16 weights; Q5_0's
   are scale * (q - 16), Q6_16's scale * (q - 32)). The product is rounded before the
   sum, as torch's and the gguf package's dequantization round it (the kernels are
   built with -ffp-contract=off, so no fused multiply-add). */
static void dequantize_block(int64_t kind, const void *quants, const float *scales,
                             const float *mins, int64_t index, float *w) {
    if (scale_per_16(kind)) {
        const int six_bits = kind == KIND_Q6_16;
        const uint8_t *q = (const uint8_t *)quants + index * PER_16_BLOCK_BYTES(six_bits);
        for (int half = 0; half < 2; half++) {
            const float scale = scales[2 * index + half];
            float *wh = w + half * (GEMM_BLOCK / 2);
            for (int j = 0; j < GEMM_BLOCK / 2; j++) {
                const float value = (float)per_16_value(q, six_bits, half * (GEMM_BLOCK / 2) + j);
                wh[j] = mins == NULL ? scale * value : scale * value + mins[2 * index + half];
            }
        }
        return;
    }
    const float scale = scales[index];
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 s = _mm256_set1_ps(scale);
    if (kind == KIND_Q8_0) {
        const int8_t *q = (const int8_t *)quants + index * GEMM_BLOCK;
        for (int j = 0; j < GEMM_BLOCK / 8; j++) {
            const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + 8 * j));
            _mm256_storeu_ps(w + 8 * j, _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))));
        }
        return;
    }
    if (kind == KIND_Q5_0) {
        const uint8_t *q = (const uint8_t *)quants + index * Q5_BYTES;
        const __m256 sixteen = _mm256_set1_ps(16.f);
        __m256 qf[4];
        block_floats(q, 1, qf);
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(w + 8 * j, _mm256_mul_ps(s, _mm256_sub_ps(qf[j], sixteen)));
        return;
    }
    /* Q4_1 or Q5_1 */
    const int five_bits = kind == KIND_Q5_1;
    const uint8_t *q = (const uint8_t *)quants + index * NIBBLE_BLOCK_BYTES(five_bits);
    const __m256 m = _mm256_set1_ps(mins[index]);
    __m256 qf[4];
    block_floats(q, five_bits, qf);
    for (int j = 0; j < 4; j++)
        _mm256_storeu_ps(w + 8 * j, _mm256_add_ps(_mm256_mul_ps(s, qf[j]), m));
#else
    if (kind == KIND_Q8_0) {
        const int8_t *q = (const int8_t *)quants + index * GEMM_BLOCK;
        for (int j = 0; j < GEMM_BLOCK; j++) w[j] = scale * (float)q[j];
        return;
    }
    if (kind == KIND_Q5_0) {
        const uint8_t *q = (const uint8_t *)quants + index * Q5_BYTES;
        for (int j = 0; j < GEMM_BLOCK; j++) w[j] = scale * (float)signed_value(q, 1, j);
        return;
    }
    /* Q4_1 or Q5_1 */
    const int five_bits = kind == KIND_Q5_1;
    const uint8_t *q = (const uint8_t *)quants + index * NIBBLE_BLOCK_BYTES(five_bits);
    const uint32_t bits = five_bits ? fifth_bits(q) : 0;
    for (int j = 0; j < GEMM_BLOCK; j++) w[j] = scale * (float)block_value(q, bits, j) + mins[index];
#endif
}

/* out[i * k + j] = weight (i, j) for i < count, as float32 (quants, scales and mins
   from the strip's first feature); zeros past count */
static void dequantize_strip(int64_t kind, const void *quants, const float *scales,
                             const float *mins, int64_t count, int64_t k, float *out) {
    const int64_t groups = k / GEMM_BLOCK;
    for (int64_t i = 0; i < count; i++)
        for (int64_t g = 0; g < groups; g++)
            dequantize_block(kind, quants, scales, mins, i * groups + g,
                             out + i * k + g * GEMM_BLOCK);
    memset(out + count * k, 0, sizeof(float) * (size_t)((STRIP - count) * k));
}

/* tile[i * LANES + r] = sum over j of w[i * k + j] * xt[j * LANES + r] */
static void strip_times_rows(const float *w, const float *xt, int64_t k, float *tile) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[STRIP][2];
    for (int i = 0; i < STRIP; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; j++) {
        const __m256 x0 = _mm256_loadu_ps(xt + j * LANES);
        const __m256 x1 = _mm256_loadu_ps(xt + j * LANES + 8);
        for (int i = 0; i < STRIP; i++) {
            const __m256 wi = _mm256_broadcast_ss(w + i * k + j);
            acc[i][0] = _mm256_fmadd_ps(wi, x0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(wi, x1, acc[i][1]);
        }
    }
    for (int i = 0; i < STRIP; i++) {
        _mm256_storeu_ps(tile + i * LANES, acc[i][0]);
        _mm256_storeu_ps(tile + i * LANES + 8, acc[i][1]);
    }
#else
    for (int i = 0; i < STRIP; i++)
        for (int r = 0; r < LANES; r++) {
            float sum = 0.f;
            for (int64_t j = 0; j < k; j++) sum += w[i * k + j] * xt[j * LANES + r];
            tile[i * LANES + r] = sum;
        }
#endif
}

/* A block's bytes in kind's layout (quantized_dot.h) */
static int64_t kind_block_bytes(int64_t kind) {
    if (kind == KIND_Q4_1 || kind == KIND_Q5_1) return NIBBLE_BLOCK_BYTES(kind == KIND_Q5_1);
    if (kind == KIND_Q6_16) return Q6_BYTES;
    return SIGNED_BLOCK_BYTES(kind == KIND_Q5_0);
}

/* ks: Q4_1's, Q5_1's or Q6_16's scales (and mins) made from a K-quant's own
   (quantized_dot.h's KScaleRows; then scales and mins are NULL), or NULL */
static int quantized_gemm(int64_t kind, const float *x, const void *quants,
                          const float *scales, const float *mins, const KScaleRows *ks,
                          float *y, int64_t rows, int64_t n, int64_t k, int num_threads) {
    const int64_t tiles = (rows + LANES - 1) / LANES, strips = (n + STRIP - 1) / STRIP;
    const int six_bit = scale_per_16(kind);
    const int64_t per_feature = k / (six_bit ? HALF : GEMM_BLOCK);
    /* xt[t][j][r]: row t * LANES + r of x at column j, zero past the last row */
    float *xt = malloc(sizeof(float) * (size_t)(tiles * k * LANES));
    if (xt == NULL) return 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t j = 0; j < k; j++)
                for (int64_t r = 0; r < LANES; r++) {
                    const int64_t row = t * LANES + r;
                    xt[(t * k + j) * LANES + r] = row < rows ? x[row * k + j] : 0.f;
                }
        float *w = malloc(sizeof(float) * (size_t)(STRIP * k));
        float *made = scale_buffer(ks, 2 * STRIP * per_feature, &failed);
        float tile[STRIP * LANES];
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t s = 0; s < strips; s++) {
            if (w == NULL || (ks != NULL && made == NULL)) continue;
            const int64_t o0 = s * STRIP, count = n - o0 < STRIP ? n - o0 : STRIP;
            const ChunkScales cs = chunk_scales(ks, six_bit, quants, scales, mins,
                                                k / GEMM_BLOCK * kind_block_bytes(kind), per_feature,
                                                o0, count, k, made);
            dequantize_strip(kind, cs.quants, cs.scales, cs.mins, count, k, w);
            for (int64_t t = 0; t < tiles; t++) {
                strip_times_rows(w, xt + t * k * LANES, k, tile);
                const int64_t r0 = t * LANES, valid = rows - r0 < LANES ? rows - r0 : LANES;
                for (int64_t r = 0; r < valid; r++)
                    for (int64_t i = 0; i < count; i++) y[(r0 + r) * n + o0 + i] = tile[i * LANES + r];
            }
        }
        free(w);
        free(made);
    }
    free(xt);
    return failed;
}

#endif
