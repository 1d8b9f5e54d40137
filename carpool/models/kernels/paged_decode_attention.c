/* Decode attention straight off a paged KV cache: one query token per sequence,
   each sequence's keys and values read in place from its blocks (no gather into a
   padded copy, which is what the torch path costs on a CPU).

   q, out:           [num_seqs, num_heads, head_dim], float32, contiguous
   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32
   block_tables:     [num_seqs, max_blocks], int64 (entries past a context unused)
   context_lens:     [num_seqs], int64, >= 1

   Each sequence is computed alone (softmax in float32 with the row maximum
   subtracted), so its result does not depend on what else is in the batch. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens,
                           float *out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t max_blocks, float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = context_lens[s];
        const int64_t *table = block_tables + s * max_blocks;
        const float *qs = q + s * num_heads * head_dim;
        float *os = out + s * num_heads * head_dim;
        /* scores[h * len + t], then the row maxima and sums */
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * (len + 2)));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        float *maxima = scores + num_heads * len, *sums = maxima + num_heads;
        for (int64_t h = 0; h < num_heads; h++) maxima[h] = -INFINITY;
        for (int64_t t = 0; t < len; t++) {
            const float *kt =
                k_cache + (table[t / block_size] * block_size + t % block_size) * token_stride;
            for (int64_t h = 0; h < num_heads; h++) {
                const float *kh = kt + (h / group) * head_dim, *qh = qs + h * head_dim;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
                dot *= scale;
                scores[h * len + t] = dot;
                if (dot > maxima[h]) maxima[h] = dot;
            }
        }
        for (int64_t h = 0; h < num_heads; h++) {
            float sum = 0.f;
            for (int64_t t = 0; t < len; t++) {
                const float e = expf(scores[h * len + t] - maxima[h]);
                scores[h * len + t] = e;
                sum += e;
            }
            sums[h] = sum;
        }
        for (int64_t i = 0; i < num_heads * head_dim; i++) os[i] = 0.f;
        for (int64_t t = 0; t < len; t++) {
            const float *vt =
                v_cache + (table[t / block_size] * block_size + t % block_size) * token_stride;
            for (int64_t h = 0; h < num_heads; h++) {
                const float *vh = vt + (h / group) * head_dim;
                const float p = scores[h * len + t];
                float *oh = os + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) oh[d] += p * vh[d];
            }
        }
        for (int64_t h = 0; h < num_heads; h++) {
            const float inverse = 1.f / sums[h];
            for (int64_t d = 0; d < head_dim; d++) os[h * head_dim + d] *= inverse;
        }
        free(scores);
    }
    return failed;
}
