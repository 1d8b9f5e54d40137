/* The quantized linear layer on its own (see quantized_linear.h), for
   carpool.models.packed_linear. */

#include "abi.h"

#include "quantized_linear.h"

int q4_1_linear(const float *x, const uint8_t *quants, const float *scales, const float *mins,
                float *y, int64_t rows, int64_t n, int64_t k, int64_t int8_dots,
                int num_threads) {
    return quantized_linear(0, x, quants, scales, mins, y, rows, n, k, int8_dots, num_threads);
}

int q8_0_linear(const float *x, const int8_t *quants, const float *scales, float *y,
                int64_t rows, int64_t n, int64_t k, int64_t int8_dots, int num_threads) {
    return quantized_linear(1, x, quants, scales, NULL, y, rows, n, k, int8_dots, num_threads);
}

/* The many-rows path alone, whatever the row count (for tests). */
int quantized_gemm_rows(int64_t kind_q8_0, const float *x, const void *quants,
                        const float *scales, const float *mins, float *y, int64_t rows,
                        int64_t n, int64_t k, int num_threads) {
    return quantized_gemm(kind_q8_0, x, quants, scales, mins, y, rows, n, k, num_threads);
}
