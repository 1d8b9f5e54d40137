/* Decode attention for one query head of one sequence, straight off a paged KV
   cache: the sequence's keys and values are read in place from its blocks (no
   gather into a padded copy, which is what the torch path costs on a CPU).

   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32 or half
                     (kv_cache.h; AttentionShape.kv_half says which)
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

#include "kv_cache.h"
#include "vector_math.h"
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads(void) { return 1; } /* built without OpenMP */
#endif

typedef struct {
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int kv_half; /* 1: the caches hold halves, 0: floats (kv_cache.h) */
} AttentionShape;

/* The first token a row of context len attends (window 0: no window) */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* The cache rows of the sequence a thread attends next (its keys, then its values),
   asked for into L2 a few lines at a time while it attends the one before, so that
   their loads overlap that work. A layer of 64 streams' caches (SmolLM2-135M's heads,
   64-192 tokens, 2 threads, Zen 4) took 0.84-0.90 ms read from memory and 0.40 from
   cache; the next sequence asked for in one burst before each: 0.80; a few lines at
   a time: 0.59-0.62 (float16: 0.72 -> 0.36-0.38). */
typedef struct {
    const char *cache[2]; /* keys, values */
    const int64_t *table;
    int64_t first, end;   /* the tokens [first, end) */
    int64_t bs, row_bytes;
    int64_t per_call;     /* lines a call asks for: set by the sequence attended meanwhile */
    int64_t which, pos, offset; /* where it is: keys or values, token, byte of its run */
} Ahead;

/* p set to ask for the rows a sequence (its block table) attends at context len
   within window (window_start); returns p */
static inline Ahead *ahead_start(Ahead *p, const AttentionShape *a, const void *k_cache,
                                 const void *v_cache, const int64_t *table, int64_t len,
                                 int64_t window) {
    const int64_t first = window_start(len, window);
    *p = (Ahead){{(const char *)k_cache, (const char *)v_cache},
                 table,
                 first,
                 len,
                 a->block_size,
                 a->num_kv_heads * a->head_dim * kv_element_size(a->kv_half),
                 0,
                 0,
                 first,
                 0};
    return p;
}

/* The lines of the whole sequence, keys and values */
static inline int64_t ahead_lines(const Ahead *p) {
    return 2 * ((p->end - p->first) * p->row_bytes / 64 + 1);
}

/* Asks for the next per_call lines (none once every row is asked for; p may be NULL) */
static inline void ahead_some(Ahead *p) {
    if (p == NULL) return;
    for (int64_t asked = 0; asked < p->per_call && p->which < 2;) {
        if (p->pos >= p->end) {
            p->which++;
            p->pos = p->first;
            p->offset = 0;
            continue;
        }
        const int64_t within = p->pos % p->bs;
        const int64_t count = p->bs - within < p->end - p->pos ? p->bs - within : p->end - p->pos;
        const char *run =
            p->cache[p->which] + (p->table[p->pos / p->bs] * p->bs + within) * p->row_bytes;
        const int64_t bytes = count * p->row_bytes;
        for (; p->offset < bytes && asked < p->per_call; p->offset += 64, asked++)
            __builtin_prefetch(run + p->offset, 0, 2); /* into L2, as _MM_HINT_T1 */
        if (p->offset >= bytes) {
            p->pos += count;
            p->offset = 0;
        }
    }
}

/* out_head = softmax(scale * q_head . K^T) V over tokens [first, len) of the
   sequence, for query head h (which reads kv head h / (num_heads / num_kv_heads));
   scores: scratch of at least len - first floats. Caches of halves when half. */
static inline __attribute__((always_inline)) void attend_head_of(
    const AttentionShape *a, const float *q_head, const void *k_cache, const void *v_cache,
    const int64_t *table, int64_t first, int64_t len, int64_t h, float *scores, float *out_head,
    const int half) {
    const int64_t d = a->head_dim, stride = a->num_kv_heads * d;
    const int64_t kv_offset = (h / (a->num_heads / a->num_kv_heads)) * d;
    /* token t is row t % block_size of block table[t / block_size]: walked block by
       block, since a division per token cost more than the dot product */
    const int64_t bs = a->block_size, n = len - first;
    float maximum = -INFINITY;
    for (int64_t b = first / bs, i0 = first % bs, t = 0; t < n; b++, i0 = 0) {
        const int64_t kb = table[b] * bs * stride + kv_offset;
        for (int64_t i = i0; i < bs && t < n; i++, t++) {
            const int64_t kh = kb + i * stride;
            float dot = 0.f;
            /* in order, no simd reduction: the vectorizer may split a half cache's sum
               into other lanes than a float cache's (AVX2 code did, head_dim 12), and a
               half cache must give the bits its values widened give */
            for (int64_t j = 0; j < d; j++) dot += q_head[j] * kv_value(k_cache, kh + j, half);
            dot *= a->scale;
            scores[t] = dot;
            if (dot > maximum) maximum = dot;
        }
    }
    const float sum = exp_shifted(scores, maximum, scores, n);
    for (int64_t j = 0; j < d; j++) out_head[j] = 0.f;
    for (int64_t b = first / bs, i0 = first % bs, t = 0; t < n; b++, i0 = 0) {
        const int64_t vb = table[b] * bs * stride + kv_offset;
        for (int64_t i = i0; i < bs && t < n; i++, t++) {
            const int64_t vh = vb + i * stride;
            const float p = scores[t];
#pragma omp simd
            for (int64_t j = 0; j < d; j++) out_head[j] += p * kv_value(v_cache, vh + j, half);
        }
    }
    const float inverse = 1.f / sum;
    for (int64_t j = 0; j < d; j++) out_head[j] *= inverse;
}

static void attend_head(const AttentionShape *a, const float *q_head, const void *k_cache,
                        const void *v_cache, const int64_t *table, int64_t first, int64_t len,
                        int64_t h, float *scores, float *out_head) {
    if (a->kv_half)
        attend_head_of(a, q_head, k_cache, v_cache, table, first, len, h, scores, out_head, 1);
    else
        attend_head_of(a, q_head, k_cache, v_cache, table, first, len, h, scores, out_head, 0);
}

/* the largest of v[0..count) (exact in any order), NaNs passed over as a > comparison
   passes them */
static float maximum_of(const float *v, int64_t count) {
    float maximum = -INFINITY;
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 m = _mm256_set1_ps(-INFINITY);
    /* vmaxps returns its second operand where either is NaN: m's */
    for (; t + 8 <= count; t += 8) m = _mm256_max_ps(_mm256_loadu_ps(v + t), m);
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++)
        if (lanes[i] > maximum) maximum = lanes[i];
#endif
    for (; t < count; t++)
        if (v[t] > maximum) maximum = v[t];
    return maximum;
}

/* out[j] += sum over t < count of p[t] * element (v + t * stride + j) of the cache
   values, for j < d, t in order: each out[j] one chain of fused multiply-adds, 64
   dimensions at a time held in registers */
static inline __attribute__((always_inline)) void add_weighted_values(
    const float *p, const void *values, int64_t v, int64_t stride, int64_t count, int64_t d,
    float *out, const int half) {
    int64_t j0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; j0 + 64 <= d; j0 += 64) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_loadu_ps(out + j0 + 8 * i);
        for (int64_t t = 0; t < count; t++) {
            const __m256 pt = _mm256_set1_ps(p[t]);
            const int64_t vt = v + t * stride + j0;
            for (int i = 0; i < 8; i++)
                acc[i] = _mm256_fmadd_ps(pt, kv_load8(values, vt + 8 * i, half), acc[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + j0 + 8 * i, acc[i]);
    }
#endif
    for (int64_t t = 0; t < count; t++)
        for (int64_t j = j0; j < d; j++)
            out[j] = fmaf(p[t], kv_value(values, v + t * stride + j, half), out[j]);
}

#define MAX_HEADS 64
/* Tokens whose keys (then values) every head reads before the next ones: the span's
   rows of the cache (every kv head's, side by side) are asked for in order first, so
   memory streams them once, and stay in L2 while the heads take turns on them (a
   span's keys and values: 2 * SPAN * num_kv_heads * head_dim elements) */
#define SPAN 256

#if defined(__AVX2__) && defined(__FMA__)
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum8 of each of v[0..8), lane i holding v[i]'s: the same additions in the same
   order, eight at a time (a transpose folded into them) */
static inline __m256 sum8_each(const __m256 *v) {
    __m256 s[4], t[2];
    for (int i = 0; i < 4; i++)
        s[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[i], v[i + 4], 0x20),
                             _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
    for (int i = 0; i < 2; i++)
        t[i] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* scale * (q . key) of one head (d a multiple of 8) whose key is the cache's
   elements [key, key + d), summed in 8 lanes over the dimensions in order, then
   across them as sum8 does */
static inline __attribute__((always_inline)) float scaled_dot(const float *q, const void *keys,
                                                              int64_t key, int64_t d,
                                                              float scale, const int half) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), kv_load8(keys, key + j, half), acc);
    return sum8(acc) * scale;
}

/* scores[t] = scaled_dot(q, key t) for the count tokens whose keys are rows of
   stride elements of the cache from element key: eight at a time, each as
   scaled_dot computes it */
static inline __attribute__((always_inline)) void score_run(const float *q, const void *keys,
                                                            int64_t key, int64_t stride,
                                                            int64_t d, int64_t count,
                                                            float scale, float *scores,
                                                            const int half) {
    int64_t t = 0;
    for (; t + 8 <= count; t += 8) {
        const int64_t k0 = key + t * stride;
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j += 8) {
            const __m256 qj = _mm256_loadu_ps(q + j);
            for (int i = 0; i < 8; i++)
                acc[i] = _mm256_fmadd_ps(qj, kv_load8(keys, k0 + i * stride + j, half), acc[i]);
        }
        _mm256_storeu_ps(scores + t, _mm256_mul_ps(sum8_each(acc), _mm256_set1_ps(scale)));
    }
    for (; t < count; t++) scores[t] = scaled_dot(q, keys, key + t * stride, d, scale, half);
}

/* Asks for rows [row, row + count) of stride elements of a cache, in order (into L2) */
static inline void prefetch_rows(const void *cache, int64_t row, int64_t count, int64_t stride,
                                 int half) {
    const int64_t size = kv_element_size(half);
    const char *at = (const char *)cache + row * stride * size;
    const char *end = (const char *)cache + (row + count) * stride * size;
    for (; at < end; at += 64) _mm_prefetch(at, _MM_HINT_T1);
}
#endif

/* Calls run(row, t, count) for the runs of consecutive tokens [t0, t1) of a sequence
   whose tokens [first, ...) are the rows of its blocks (table): row is the cache row
   of the run's first token, t its index from first; a run ends at a block's end. */
#define FOR_EACH_RUN(table, bs, first, t0, t1, run)                                        \
    for (int64_t pos_ = (first) + (t0), end_ = (first) + (t1); pos_ < end_;) {             \
        const int64_t within_ = pos_ % (bs);                                               \
        const int64_t count_ = (bs) - within_ < end_ - pos_ ? (bs) - within_ : end_ - pos_; \
        run((table)[pos_ / (bs)] * (bs) + within_, pos_ - (first), count_);                \
        pos_ += count_;                                                                     \
    }

/* attend_head for heads [h0, h1) of one sequence. q_seq, out_seq: [num_heads, head_dim] (only
   those heads' parts of out_seq are written);
   scores: scratch of num_heads * (len - first) floats. Vectorised by hand where
   head_dim is a multiple of 8: the tokens in spans of SPAN, each span's keys scored by
   every head in turn (eight tokens at a time within a block), then its values weighed
   into every head's sums (add_weighted_values, a block's run at a time); each score
   summed as sum8 sums it and each output in token order, whatever the span or block.
   attend_head's order of operations per head otherwise. Caches of halves when half. */
#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void attend_sequence_of(
    const AttentionShape *a, const float *q_seq, const void *k_cache, const void *v_cache,
    const int64_t *table, int64_t first, int64_t len, int64_t h0, int64_t h1, float *scores,
    float *out_seq, Ahead *ahead, const int half) {
    const int64_t d = a->head_dim, heads = a->num_heads;
    const int64_t group = heads / a->num_kv_heads;
    const int64_t stride = a->num_kv_heads * d, bs = a->block_size, n = len - first;
    float sums[MAX_HEADS];
    /* one span: its values come in while the first head scores its keys */
    const int early_values = n <= SPAN;
    for (int64_t t0 = 0; t0 < n; t0 += SPAN) {
        const int64_t t1 = t0 + SPAN < n ? t0 + SPAN : n;
#define FETCH(row, t, count) prefetch_rows(k_cache, row, count, stride, half)
        FOR_EACH_RUN(table, bs, first, t0, t1, FETCH)
#undef FETCH
        for (int64_t h = h0; h < h1; h++) {
            const float *qh = q_seq + h * d;
            const int64_t kh = (h / group) * d;
#define SCORE(row, t, count)                                                                  \
    if (h == h0 && early_values) prefetch_rows(v_cache, row, count, stride, half);            \
    score_run(qh, k_cache, kh + (row) * stride, stride, d, count, a->scale, scores + h * n + (t), \
              half);                                                                        \
    ahead_some(ahead);
            FOR_EACH_RUN(table, bs, first, t0, t1, SCORE)
#undef SCORE
        }
    }
    for (int64_t h = h0; h < h1; h++) {
        float *sh = scores + h * n;
        sums[h] = exp_shifted(sh, maximum_of(sh, n), sh, n);
    }
    for (int64_t j = h0 * d; j < h1 * d; j++) out_seq[j] = 0.f;
    for (int64_t t0 = 0; t0 < n; t0 += SPAN) {
        const int64_t t1 = t0 + SPAN < n ? t0 + SPAN : n;
        if (!early_values) {
#define FETCH(row, t, count) prefetch_rows(v_cache, row, count, stride, half)
            FOR_EACH_RUN(table, bs, first, t0, t1, FETCH)
#undef FETCH
        }
        for (int64_t h = h0; h < h1; h++) {
            const int64_t vh = (h / group) * d;
            const float *ph = scores + h * n;
#define WEIGH(row, t, count)                                                              \
    add_weighted_values(ph + (t), v_cache, vh + (row) * stride, stride, count, d, out_seq + h * d, \
                        half);                                                                \
    ahead_some(ahead)
            FOR_EACH_RUN(table, bs, first, t0, t1, WEIGH)
#undef WEIGH
        }
    }
    for (int64_t h = h0; h < h1; h++) {
        const float inverse = 1.f / sums[h];
        for (int64_t j = 0; j < d; j++) out_seq[h * d + j] *= inverse;
    }
}
#endif

static void attend_sequence(const AttentionShape *a, const float *q_seq, const void *k_cache,
                            const void *v_cache, const int64_t *table, int64_t first,
                            int64_t len, int64_t h0, int64_t h1, float *scores, float *out_seq,
                            Ahead *ahead) {
    const int64_t d = a->head_dim, heads = a->num_heads;
#if defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0 && heads <= MAX_HEADS) {
        if (ahead != NULL) {
            /* every call of ahead_some below: each head's runs, keys and values */
            const int64_t calls = 2 * (h1 - h0) * ((len - first) / a->block_size + 2);
            /* all of it asked for by about halfway (finishing with the sequence was
               slower: 0.38 against 0.36 ms a layer, 64 streams of SmolLM2-135M) */
            ahead->per_call = 2 * ahead_lines(ahead) / calls + 1;
        }
        if (a->kv_half)
            attend_sequence_of(a, q_seq, k_cache, v_cache, table, first, len, h0, h1, scores,
                               out_seq, ahead, 1);
        else
            attend_sequence_of(a, q_seq, k_cache, v_cache, table, first, len, h0, h1, scores,
                               out_seq, ahead, 0);
        return;
    }
#endif
    for (int64_t h = h0; h < h1; h++)
        attend_head(a, q_seq + h * d, k_cache, v_cache, table, first, len, h, scores,
                    out_seq + h * d);
}

/* Every head of every sequence: q, out [num_seqs, num_heads, head_dim];
   block_tables [num_seqs, max_blocks]; context_lens [num_seqs], each >= 1; window:
   the layer's sliding window (0: none). Returns nonzero when scratch could not be
   allocated. */
static int attend_all(const AttentionShape *a, const float *q, const void *k_cache,
                      const void *v_cache, const int64_t *block_tables, int64_t max_blocks,
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
            /* the sequence this thread likely takes next, as the threads take turns */
            const int64_t n = s + omp_get_num_threads();
            Ahead next;
            Ahead *ahead = n < num_seqs ? ahead_start(&next, a, k_cache, v_cache,
                                                      block_tables + n * max_blocks,
                                                      context_lens[n], window)
                                        : NULL;
            attend_sequence(a, q + s * seq_size, k_cache, v_cache, block_tables + s * max_blocks,
                            window_start(context_lens[s], window), context_lens[s], 0,
                            a->num_heads, scores,
                            out + s * seq_size, ahead);
        }
        free(scores);
    }
    return failed;
}

#endif
