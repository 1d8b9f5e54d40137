/* Decode attention for one query head of one sequence, straight off a paged KV
   cache: the sequence's keys and values are read in place from its blocks (no
   gather into a padded copy, which is what the torch path costs on a CPU).

   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32
   table:            the sequence's block ids (entries past its context unused)

   The softmax is in float32 with the row maximum subtracted; nothing depends on
   other sequences or heads, so a result does not depend on what else is batched. */

#ifndef CARPOOL_DECODE_ATTENTION_H
#define CARPOOL_DECODE_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} AttentionShape;

/* out_head = softmax(scale * q_head . K^T) V over the first len tokens of the
   sequence, for query head h (which reads kv head h / (num_heads / num_kv_heads));
   scores: scratch of at least len floats */
static void attend_head(const AttentionShape *a, const float *q_head, const float *k_cache,
                        const float *v_cache, const int64_t *table, int64_t len, int64_t h,
                        float *scores, float *out_head) {
    const int64_t d = a->head_dim, stride = a->num_kv_heads * d;
    const int64_t kv_offset = (h / (a->num_heads / a->num_kv_heads)) * d;
    float maximum = -INFINITY;
    for (int64_t t = 0; t < len; t++) {
        const float *kt =
            k_cache + (table[t / a->block_size] * a->block_size + t % a->block_size) * stride;
        const float *kh = kt + kv_offset;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; i++) dot += q_head[i] * kh[i];
        dot *= a->scale;
        scores[t] = dot;
        if (dot > maximum) maximum = dot;
    }
    float sum = 0.f;
    for (int64_t t = 0; t < len; t++) {
        const float e = expf(scores[t] - maximum);
        scores[t] = e;
        sum += e;
    }
    for (int64_t i = 0; i < d; i++) out_head[i] = 0.f;
    for (int64_t t = 0; t < len; t++) {
        const float *vt =
            v_cache + (table[t / a->block_size] * a->block_size + t % a->block_size) * stride;
        const float *vh = vt + kv_offset;
        const float p = scores[t];
#pragma omp simd
        for (int64_t i = 0; i < d; i++) out_head[i] += p * vh[i];
    }
    const float inverse = 1.f / sum;
    for (int64_t i = 0; i < d; i++) out_head[i] *= inverse;
}

/* Every head of every sequence: q, out [num_seqs, num_heads, head_dim];
   block_tables [num_seqs, max_blocks]; context_lens [num_seqs], each >= 1.
   Returns nonzero when scratch could not be allocated. */
static int attend_all(const AttentionShape *a, const float *q, const float *k_cache,
                      const float *v_cache, const int64_t *block_tables, int64_t max_blocks,
                      const int64_t *context_lens, int64_t num_seqs, float *out,
                      int num_threads) {
    int64_t longest = 1;
    for (int64_t s = 0; s < num_seqs; s++)
        if (context_lens[s] > longest) longest = context_lens[s];
    const int64_t items = num_seqs * a->num_heads, head_size = a->head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)longest);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (scores == NULL) continue;
            const int64_t s = item / a->num_heads, h = item % a->num_heads;
            const int64_t offset = (s * a->num_heads + h) * head_size;
            attend_head(a, q + offset, k_cache, v_cache, block_tables + s * max_blocks,
                        context_lens[s], h, scores, out + offset);
        }
        free(scores);
    }
    return failed;
}

#endif
