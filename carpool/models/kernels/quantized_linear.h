/* y = x @ W^T with W in GGUF blocks, for any number of rows of x: a few rows read
   the blocks directly (quantized_dot.h: bound by reading W), more rows multiply
   dequantized strips of W (quantized_gemm.h: bound by arithmetic). The crossover
   was measured with SmolLM2-135M's shapes on the 2-core CI machine: at 8 rows the
   direct path was ~1.2x faster, at 16 the strips ~2x. int8_dots (quantized_dot.h)
   applies to the direct path only: more rows stay exact. The fused stack and
   packed_linear.py run int8 on interleaved weights instead (interleaved.h), for any
   number of rows, where a weight has them. */

#ifndef CARPOOL_QUANTIZED_LINEAR_H
#define CARPOOL_QUANTIZED_LINEAR_H

#include "quantized_dot.h"
#include "quantized_gemm.h"

#define DIRECT_MAX_ROWS 8

/* kind: KIND_Q4_1, KIND_Q8_0, KIND_Q8_16, KIND_Q5_1, KIND_Q5_0 or KIND_Q6_16
   (quantized_dot.h); ks: the scales (and mins) made from a K-quant's own (Q4_1 and
   Q5_1: Q4_K's and Q5_K's; Q6_16: Q6_K's, without mins; quantized_dot.h's
   KScaleRows), scales and mins then NULL; or NULL, and scales and mins given */
static int quantized_linear(int64_t kind, const float *x, const void *quants,
                            const float *scales, const float *mins, const KScaleRows *ks,
                            float *y, int64_t rows, int64_t n, int64_t k, int64_t int8_dots,
                            int num_threads) {
    if (rows > DIRECT_MAX_ROWS)
        return quantized_gemm(kind, x, quants, scales, mins, ks, y, rows, n, k, num_threads);
    if (kind == KIND_Q8_0 || kind == KIND_Q8_16 || kind == KIND_Q5_0 || kind == KIND_Q6_16)
        return q8_few_rows(x, quants, scales, mins, ks, y, rows, n, k, int8_dots != 0,
                           scale_per_16(kind), kind == KIND_Q5_0, kind == KIND_Q6_16, num_threads);
    return nibble_few_rows(x, quants, scales, mins, ks, y, rows, n, k, int8_dots != 0,
                           kind == KIND_Q5_1, num_threads);
}

#endif
