/* The quantized linear layer on its own (see quantized_dot.h), for carpool.models.packed_linear. */

#include "quantized_dot.h"

int q4_1_linear(const float *x, const uint8_t *quants, const float *scales, const float *mins,
                float *y, int64_t rows, int64_t n, int64_t k, int num_threads) {
    return q4_1_linear_impl(x, quants, scales, mins, y, rows, n, k, num_threads);
}

int q8_0_linear(const float *x, const int8_t *quants, const float *scales, float *y,
                int64_t rows, int64_t n, int64_t k, int num_threads) {
    return q8_0_linear_impl(x, quants, scales, y, rows, n, k, num_threads);
}
