/* The quantized linear layer on its own (see quantized_linear.h), for
   carpool.models.packed_linear. */

#include "abi.h"

#include "interleaved.h"
#include "quantized_linear.h"

int q4_1_linear(const float *x, const uint8_t *quants, const float *scales, const float *mins,
                float *y, int64_t rows, int64_t n, int64_t k, int64_t int8_dots,
                int num_threads) {
    return quantized_linear(KIND_Q4_1, x, quants, scales, mins, NULL, y, rows, n, k, int8_dots,
                            num_threads);
}

int q8_0_linear(const float *x, const int8_t *quants, const float *scales, float *y,
                int64_t rows, int64_t n, int64_t k, int64_t int8_dots, int num_threads) {
    return quantized_linear(KIND_Q8_0, x, quants, scales, NULL, NULL, y, rows, n, k, int8_dots,
                            num_threads);
}

/* quants: [n, k / 32, 20] (quantized_dot.h's q5_1) */
int q5_1_linear(const float *x, const uint8_t *quants, const float *scales, const float *mins,
                float *y, int64_t rows, int64_t n, int64_t k, int64_t int8_dots,
                int num_threads) {
    return quantized_linear(KIND_Q5_1, x, quants, scales, mins, NULL, y, rows, n, k, int8_dots,
                            num_threads);
}

/* quants: [n, k / 32, 20] (quantized_dot.h's q5_0: Q5_1's bytes, no mins) */
int q5_0_linear(const float *x, const uint8_t *quants, const float *scales, float *y,
                int64_t rows, int64_t n, int64_t k, int64_t int8_dots, int num_threads) {
    return quantized_linear(KIND_Q5_0, x, quants, scales, NULL, NULL, y, rows, n, k, int8_dots,
                            num_threads);
}

/* scales and mins (NULL: none): [n, k / 16] */
int q8_16_linear(const float *x, const int8_t *quants, const float *scales, const float *mins,
                 float *y, int64_t rows, int64_t n, int64_t k, int64_t int8_dots,
                 int num_threads) {
    return quantized_linear(KIND_Q8_16, x, quants, scales, mins, NULL, y, rows, n, k, int8_dots,
                            num_threads);
}

/* quants: [n, k / 32, 24] (quantized_dot.h's q6_16: Q6_K's 6 bits); scales [n, k / 16] */
int q6_16_linear(const float *x, const uint8_t *quants, const float *scales, float *y,
                 int64_t rows, int64_t n, int64_t k, int64_t int8_dots, int num_threads) {
    return quantized_linear(KIND_Q6_16, x, quants, scales, NULL, NULL, y, rows, n, k, int8_dots,
                            num_threads);
}

/* Q4_1 or Q5_1 blocks with Q4_K's or Q5_K's own scales, or Q6_16 blocks with Q6_K's
   (kind: KIND_Q4_1, KIND_Q5_1 or KIND_Q6_16; supers and factors: quantized_dot.h's
   KScaleRows; k a multiple of 256, which the caller checks) */
int k_quant_linear(int64_t kind, const float *x, const void *quants, const uint16_t *supers,
                   const void *factors, float *y, int64_t rows, int64_t n, int64_t k,
                   int64_t int8_dots, int num_threads) {
    if ((kind != KIND_Q4_1 && kind != KIND_Q5_1 && kind != KIND_Q6_16) ||
        k % (SUPER_BLOCK * BLOCK))
        return 2;
    const KScaleRows ks = {supers, factors};
    return quantized_linear(kind, x, quants, NULL, NULL, &ks, y, rows, n, k, int8_dots,
                            num_threads);
}

/* The float32 rows ids[0..count) of W [n, k] in the file's blocks, each weight as
   dequantize_block makes it (an embedding's lookup: those rows alone are read): out
   [count, k]. kind as quantized_linear's; supers and factors: a K-quant's own scales
   (quantized_dot.h's KScaleRows, for Q4_1, Q5_1 and Q6_16 blocks; k a multiple of 256)
   that make the scales and mins, which are then NULL; or NULL. Returns 2 for another
   kind, k not whole blocks (super-blocks) or an id outside [0, n); 1 when out of
   memory. */
int packed_rows(int64_t kind, const void *quants, const float *scales, const float *mins,
                const uint16_t *supers, const void *factors, const int64_t *ids, int64_t count,
                int64_t n, int64_t k, float *out) {
    const int k_scaled = supers != NULL;
    if ((kind != KIND_Q4_1 && kind != KIND_Q8_0 && kind != KIND_Q8_16 && kind != KIND_Q5_1 &&
         kind != KIND_Q5_0 && kind != KIND_Q6_16) ||
        k % BLOCK ||
        (k_scaled && ((kind != KIND_Q4_1 && kind != KIND_Q5_1 && kind != KIND_Q6_16) ||
                      k % (SUPER_BLOCK * BLOCK))))
        return 2;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return 2;
    const KScaleRows ks = {supers, factors};
    const int six_bit = scale_per_16(kind);
    const int64_t per_feature = k / (six_bit ? HALF : BLOCK), groups = k / BLOCK;
    int failed = 0;
    float *made = scale_buffer(k_scaled ? &ks : NULL, 2 * per_feature, &failed);
    for (int64_t i = 0; i < count && !failed; i++) {
        const ChunkScales cs = chunk_scales(k_scaled ? &ks : NULL, six_bit, quants, scales, mins,
                                            groups * kind_block_bytes(kind), per_feature, ids[i],
                                            1, k, made);
        for (int64_t g = 0; g < groups; g++)
            dequantize_block(kind, cs.quants, cs.scales, cs.mins, g, out + i * k + g * BLOCK);
    }
    free(made);
    return failed;
}

/* The many-rows path alone, whatever the row count (for tests); kind as
   quantized_linear's. */
int quantized_gemm_rows(int64_t kind, const float *x, const void *quants, const float *scales,
                        const float *mins, float *y, int64_t rows, int64_t n, int64_t k,
                        int num_threads) {
    return quantized_gemm(kind, x, quants, scales, mins, NULL, y, rows, n, k, num_threads);
}

/* Blocks interleaved (interleaved.h), int8 dot products, any number of rows: y [rows,
   the parts' n summed] from count (1 to MAX_PARTS) parts, each its own kind
   (quantized_linear's Q4_1, Q8_0, Q5_1 or Q5_0, or interleaved.h's Q4_K, Q5_K and Q6_K),
   n a positive multiple of 16 (k of 256 for the last three) and the layouts
   interleaved.h's (the caller checks the tensors). Returns 1 when out of memory, 2 for
   another kind, a K-quant kind's k not whole super-blocks, or a bad count or n. */
int interleaved_int8_linear(const InterleavedWeight *parts, int64_t count, const float *x,
                            float *y, int64_t rows, int64_t k, int num_threads) {
    if (count < 1 || count > MAX_PARTS) return 2;
    for (int64_t p = 0; p < count; p++) {
        const int64_t kind = parts[p].kind;
        if (!interleaved_kind(kind) || (super_blocked(kind) && k % (SUPER_BLOCKS * BLOCK)) ||
            parts[p].n <= 0 || parts[p].n % FEATURES)
            return 2;
    }
    return interleaved_linear(parts, count, x, y, rows, k, num_threads);
}

/* The size of InterleavedWeight, checked against its ctypes declaration. */
int64_t interleaved_weight_size(void) { return (int64_t)sizeof(InterleavedWeight); }

/* How the interleaved kernel runs here: 3 with AMX tiles past TILE_ROWS rows (built for
   a CPU with AMX, or emulated, and Linux grants the tiles; AVX-512 VNNI up to that),
   2 with AVX-512 VNNI, 1 with AVX2, 0 its portable C. */
int64_t interleaved_vectorized(void) {
#if INTERLEAVED_AMX
    if (amx_permitted()) return 3;
#endif
    return INTERLEAVED_VECTORIZED;
}
