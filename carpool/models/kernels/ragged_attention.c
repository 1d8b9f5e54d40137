/* Bidirectional self-attention over a ragged batch (an encoder's: BERT), in one
   call: every sequence's tokens attend to all tokens of the same sequence, nothing
   else. Replaces a torch call per sequence per layer, which was a sixth of the
   embedding model's time on a batch of a hundred short sentences.

   qkv: [tokens, 3, num_heads, head_dim] float32 (a fused projection's output)
   offsets: [num_seqs + 1] int64, sequence s is tokens [offsets[s], offsets[s + 1])
   out: [tokens, num_heads, head_dim] float32

   Per (sequence, head, query): scores in float32, the row maximum subtracted, then
   the softmax-weighted sum of the values; nothing depends on other sequences. */

#include "abi.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

static void attend_query(const float *qkv, int64_t start, int64_t len, int64_t query,
                         int64_t h, int64_t heads, int64_t d, float scale, float *scores,
                         float *out) {
    const int64_t token = 3 * heads * d; /* one token's q, k and v */
    const float *q = qkv + (start + query) * token + h * d;
    float maximum = -INFINITY;
    for (int64_t j = 0; j < len; j++) {
        const float *k = qkv + (start + j) * token + heads * d + h * d;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; i++) dot += q[i] * k[i];
        dot *= scale;
        scores[j] = dot;
        if (dot > maximum) maximum = dot;
    }
    const float inverse = 1.f / exp_shifted(scores, maximum, scores, len);
    float *o = out + (start + query) * heads * d + h * d;
    for (int64_t i = 0; i < d; i++) o[i] = 0.f;
    for (int64_t j = 0; j < len; j++) {
        const float *v = qkv + (start + j) * token + 2 * heads * d + h * d;
        const float p = scores[j];
#pragma omp simd
        for (int64_t i = 0; i < d; i++) o[i] += p * v[i];
    }
    for (int64_t i = 0; i < d; i++) o[i] *= inverse;
}

int ragged_attention(const float *qkv, const int64_t *offsets, float *out, int64_t num_seqs,
                     int64_t num_heads, int64_t head_dim, float scale, int num_threads) {
    int64_t longest = 1;
    for (int64_t s = 0; s < num_seqs; s++)
        if (offsets[s + 1] - offsets[s] > longest) longest = offsets[s + 1] - offsets[s];
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)longest);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * num_heads; item++) {
            if (scores == NULL) continue;
            const int64_t s = item / num_heads, h = item % num_heads;
            const int64_t start = offsets[s], len = offsets[s + 1] - start;
            for (int64_t query = 0; query < len; query++)
                attend_query(qkv, start, len, query, h, num_heads, head_dim, scale, scores, out);
        }
        free(scores);
    }
    return failed;
}
