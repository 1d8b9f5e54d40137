/* Decode attention for one query head of one sequence, straight off a paged KV
   cache: the sequence's keys and values are read in place from its blocks (no
   gather into a padded copy, which is what the torch path costs on a CPU).

   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32
   table:            the sequence's block ids (entries past its context unused)

   A row attends tokens [first, len) of its sequence: first is 0, or len - window
   for a sliding-window layer (Mistral's, Gemma 3's local ones) whose window the
   context has outgrown (window_start).

   The softmax is in float32 with the row maximum subtracted; nothing depends on
   other sequences or heads, so a result does not depend on what else is batched. */

#ifndef CARPOOL_DECODE_ATTENTION_H
#define CARPOOL_DECODE_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

typedef struct {
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} AttentionShape;

/* The first token a row of context len attends (window 0: no window) */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* out_head = softmax(scale * q_head . K^T) V over tokens [first, len) of the
   sequence, for query head h (which reads kv head h / (num_heads / num_kv_heads));
   scores: scratch of at least len - first floats */
static void attend_head(const AttentionShape *a, const float *q_head, const float *k_cache,
                        const float *v_cache, const int64_t *table, int64_t first, int64_t len,
                        int64_t h, float *scores, float *out_head) {
    const int64_t d = a->head_dim, stride = a->num_kv_heads * d;
    const int64_t kv_offset = (h / (a->num_heads / a->num_kv_heads)) * d;
    /* token t is row t % block_size of block table[t / block_size]: walked block by
       block, since a division per token cost more than the dot product */
    const int64_t bs = a->block_size, n = len - first;
    float maximum = -INFINITY;
    for (int64_t b = first / bs, i0 = first % bs, t = 0; t < n; b++, i0 = 0) {
        const float *kb = k_cache + table[b] * bs * stride + kv_offset;
        for (int64_t i = i0; i < bs && t < n; i++, t++) {
            const float *kh = kb + i * stride;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < d; j++) dot += q_head[j] * kh[j];
            dot *= a->scale;
            scores[t] = dot;
            if (dot > maximum) maximum = dot;
        }
    }
    const float sum = exp_shifted(scores, maximum, scores, n);
    for (int64_t j = 0; j < d; j++) out_head[j] = 0.f;
    for (int64_t b = first / bs, i0 = first % bs, t = 0; t < n; b++, i0 = 0) {
        const float *vb = v_cache + table[b] * bs * stride + kv_offset;
        for (int64_t i = i0; i < bs && t < n; i++, t++) {
            const float *vh = vb + i * stride;
            const float p = scores[t];
#pragma omp simd
            for (int64_t j = 0; j < d; j++) out_head[j] += p * vh[j];
        }
    }
    const float inverse = 1.f / sum;
    for (int64_t j = 0; j < d; j++) out_head[j] *= inverse;
}

#define MAX_HEADS 64

#if defined(__AVX2__) && defined(__FMA__)
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* attend_head for every head of one sequence, in one pass over its cache: each
   token's keys (then values), all kv heads side by side, are read once and used by
   every query head (the cache comes from memory: that is what bounds a step of many
   sequences). q_seq, out_seq: [num_heads, head_dim]; scores: scratch of
   num_heads * (len - first) floats. Vectorised by hand where head_dim is a multiple of 8;
   attend_head's order of operations per head otherwise. */
static void attend_sequence(const AttentionShape *a, const float *q_seq, const float *k_cache,
                            const float *v_cache, const int64_t *table, int64_t first,
                            int64_t len, float *scores, float *out_seq) {
    const int64_t d = a->head_dim, heads = a->num_heads;
    const int64_t group = heads / a->num_kv_heads;
#if defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0 && heads <= MAX_HEADS) {
        const int64_t stride = a->num_kv_heads * d, bs = a->block_size, n = len - first;
        float maxima[MAX_HEADS], sums[MAX_HEADS];
        for (int64_t h = 0; h < heads; h++) maxima[h] = -INFINITY;
        for (int64_t b = first / bs, i0 = first % bs, t = 0; t < n; b++, i0 = 0) {
            const float *kb = k_cache + table[b] * bs * stride;
            for (int64_t i = i0; i < bs && t < n; i++, t++) {
                const float *kt = kb + i * stride;
                for (int64_t h = 0; h < heads; h++) {
                    const float *qh = q_seq + h * d, *kh = kt + (h / group) * d;
                    __m256 acc = _mm256_setzero_ps();
                    for (int64_t j = 0; j < d; j += 8)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + j), _mm256_loadu_ps(kh + j), acc);
                    const float dot = sum8(acc) * a->scale;
                    scores[h * n + t] = dot;
                    if (dot > maxima[h]) maxima[h] = dot;
                }
            }
        }
        for (int64_t h = 0; h < heads; h++)
            sums[h] = exp_shifted(scores + h * n, maxima[h], scores + h * n, n);
        for (int64_t j = 0; j < heads * d; j++) out_seq[j] = 0.f;
        for (int64_t b = first / bs, i0 = first % bs, t = 0; t < n; b++, i0 = 0) {
            const float *vb = v_cache + table[b] * bs * stride;
            for (int64_t i = i0; i < bs && t < n; i++, t++) {
                const float *vt = vb + i * stride;
                for (int64_t h = 0; h < heads; h++) {
                    const __m256 p = _mm256_set1_ps(scores[h * n + t]);
                    const float *vh = vt + (h / group) * d;
                    float *oh = out_seq + h * d;
                    for (int64_t j = 0; j < d; j += 8)
                        _mm256_storeu_ps(oh + j, _mm256_fmadd_ps(p, _mm256_loadu_ps(vh + j),
                                                                 _mm256_loadu_ps(oh + j)));
                }
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            const float inverse = 1.f / sums[h];
            for (int64_t j = 0; j < d; j++) out_seq[h * d + j] *= inverse;
        }
        return;
    }
#endif
    for (int64_t h = 0; h < heads; h++)
        attend_head(a, q_seq + h * d, k_cache, v_cache, table, first, len, h, scores,
                    out_seq + h * d);
}

/* Every head of every sequence: q, out [num_seqs, num_heads, head_dim];
   block_tables [num_seqs, max_blocks]; context_lens [num_seqs], each >= 1; window:
   the layer's sliding window (0: none). Returns nonzero when scratch could not be
   allocated. */
static int attend_all(const AttentionShape *a, const float *q, const float *k_cache,
                      const float *v_cache, const int64_t *block_tables, int64_t max_blocks,
                      const int64_t *context_lens, int64_t window, int64_t num_seqs,
                      float *out, int num_threads) {
    int64_t longest = 1;
    for (int64_t s = 0; s < num_seqs; s++)
        if (context_lens[s] > longest) longest = context_lens[s];
    const int64_t seq_size = a->num_heads * a->head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_seqs > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(a->num_heads * longest));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            if (scores == NULL) continue;
            attend_sequence(a, q + s * seq_size, k_cache, v_cache, block_tables + s * max_blocks,
                            window_start(context_lens[s], window), context_lens[s], scores,
                            out + s * seq_size);
        }
        free(scores);
    }
    return failed;
}

#endif
