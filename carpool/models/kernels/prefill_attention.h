/* Attention for every row of an engine step straight off the paged KV cache, as the
   fused stack needs it: single-token rows (decodes) with decode_attention.h, and the
   rows of each prompt chunk together, since they share their sequence's keys. The
   caches hold floats or halves (kv_cache.h: AttentionShape.kv_half); a chunk's
   gathered keys and values are floats.

   Per (chunk, kv head) the keys up to the chunk's last position are gathered once,
   transposed, so that the scores of one query against KEY_TILE keys are KEY_TILE / 8
   vector sums over the head's dimensions (no horizontal sum per key, which is what
   bounds the decode code), and the query heads that read the same kv head share each
   load of the keys. The chunk's rows are then attended in tiles of ROW_TILE rows (the
   work items), keys as the outer loop, so a tile of keys stays in cache while every
   row of the tile scores it.

   A row attends the first context_lens[r] tokens of its sequence, or in a sliding-
   window layer its last window of them (window_start); a chunk's keys are gathered
   from its first row's window on, so blocks behind it are never read. Each score is
   summed over the head dimension in order, then scaled; the softmax (maximum
   subtracted, float32) and the weighted sum of the values run over the keys in
   order. Nothing depends on the tile a row falls in or on the rest of the batch, so
   a prompt row's result is the same however its prompt is chunked (as long as its
   chunk has more than ROWWISE_CHUNK rows).

   A chunk of at most ROWWISE_CHUNK rows is attended row by row as decodes are
   (decode_attention.h, whose dot products sum in another order): a speculative
   verification's rows (the last token and its draft) then get the bits that
   decoding those tokens one at a time would, so greedy speculation keeps the tokens
   even where a last-bit difference would move an int8 rounding (native-int8). */

#ifndef CARPOOL_PREFILL_ATTENTION_H
#define CARPOOL_PREFILL_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "decode_attention.h"
#include "vector_math.h"

#define KEY_TILE 32 /* keys scored together: four AVX2 vectors */
#define ROW_TILE 16 /* rows of one chunk per work item */
#define HEAD_TILE 3 /* query heads scored together */
/* 1 + the most tokens a speculative draft has (carpool/engine/speculative.py) */
#define ROWWISE_CHUNK 17

typedef struct {
    const int64_t *table; /* its sequence's block table */
    int64_t start, len;   /* keys [start, len): its first row's first to its last row's last */
    int64_t width;        /* len - start rounded up to KEY_TILE */
    float *keys, *values; /* gathered: per kv head [d][width] keys, [width][d] values */
} Chunk;

typedef struct {
    int64_t first_row, rows; /* rows == 1 and chunk < 0: a single-token row (a decode) */
    /* a chunk's: its kv head; a single-token row's: the kv head whose query heads it
       attends, or -1 for all of them */
    int64_t chunk, kv_head;
} AttentionItem;

/* kt[j * width + t] = key start + t of kv head g at dimension j for start + t < len,
   zero up to width; v[t * d + j] = its value */
static void gather_head(const AttentionShape *a, const void *k_cache, const void *v_cache,
                        const int64_t *table, int64_t start, int64_t len, int64_t g,
                        int64_t width, float *kt, float *v) {
    const int64_t d = a->head_dim, stride = a->num_kv_heads * d, bs = a->block_size;
    const int half = a->kv_half;
    for (int64_t t = start; t < len; t++) {
        const int64_t at = (table[t / bs] * bs + t % bs) * stride + g * d;
        for (int64_t j = 0; j < d; j++) {
            kt[j * width + t - start] = kv_value(k_cache, at + j, half);
            v[(t - start) * d + j] = kv_value(v_cache, at + j, half);
        }
    }
    for (int64_t j = 0; j < d; j++)
        for (int64_t t = len - start; t < width; t++) kt[j * width + t] = 0.f;
}

/* scores[c * stride + i] = scale * (q_c . key i) for COUNT heads (q_c = q + c * d) and
   the KEY_TILE keys of kt (columns of [d][width]); each dot summed over j in order */
static inline __attribute__((always_inline)) void score_tile(int count, const float *q,
                                                             int64_t d, const float *kt,
                                                             int64_t width, float scale,
                                                             float *scores, int64_t stride) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[HEAD_TILE][4];
    for (int c = 0; c < count; c++)
        for (int i = 0; i < 4; i++) acc[c][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j++) {
        const float *row = kt + j * width;
        const __m256 k0 = _mm256_loadu_ps(row), k1 = _mm256_loadu_ps(row + 8);
        const __m256 k2 = _mm256_loadu_ps(row + 16), k3 = _mm256_loadu_ps(row + 24);
        for (int c = 0; c < count; c++) {
            const __m256 qc = _mm256_broadcast_ss(q + c * d + j);
            acc[c][0] = _mm256_fmadd_ps(qc, k0, acc[c][0]);
            acc[c][1] = _mm256_fmadd_ps(qc, k1, acc[c][1]);
            acc[c][2] = _mm256_fmadd_ps(qc, k2, acc[c][2]);
            acc[c][3] = _mm256_fmadd_ps(qc, k3, acc[c][3]);
        }
    }
    const __m256 s = _mm256_set1_ps(scale);
    for (int c = 0; c < count; c++)
        for (int i = 0; i < 4; i++)
            _mm256_storeu_ps(scores + c * stride + 8 * i, _mm256_mul_ps(acc[c][i], s));
#else
    for (int c = 0; c < count; c++)
        for (int64_t i = 0; i < KEY_TILE; i++) {
            float dot = 0.f;
            for (int64_t j = 0; j < d; j++) dot = fmaf(q[c * d + j], kt[j * width + i], dot);
            scores[c * stride + i] = dot * scale;
        }
#endif
}

/* Rows [first, first + count) of chunk c, the query heads of kv head g; a row of
   context len attends gathered keys [window_start(len, window) - c->start, len -
   c->start). Keys are the outer loop (a tile of them stays in cache while every row
   scores it); scores: scratch of count * group * c->width floats. */
static void attend_chunk_tile(const AttentionShape *a, const float *q, const Chunk *c,
                              const int64_t *context_lens, int64_t window, int64_t first,
                              int64_t count, int64_t g, float *scores, float *out) {
    const int64_t d = a->head_dim, heads = a->num_heads, width = c->width;
    const int64_t group = heads / a->num_kv_heads, row_size = heads * d;
    const float *kt = c->keys + g * d * width, *v = c->values + g * width * d;
    const int64_t last = context_lens[first + count - 1] - c->start;
    for (int64_t t0 = 0; t0 < last; t0 += KEY_TILE)
        for (int64_t r = 0; r < count; r++) {
            if (t0 >= context_lens[first + r] - c->start) continue;
            for (int64_t h = 0; h < group; h += HEAD_TILE) {
                const int64_t n = group - h < HEAD_TILE ? group - h : HEAD_TILE;
                const float *qh = q + (first + r) * row_size + (g * group + h) * d;
                float *sh = scores + (r * group + h) * width + t0;
                if (n == 3)
                    score_tile(3, qh, d, kt + t0, width, a->scale, sh, width);
                else if (n == 2)
                    score_tile(2, qh, d, kt + t0, width, a->scale, sh, width);
                else
                    score_tile(1, qh, d, kt + t0, width, a->scale, sh, width);
            }
        }
    float sums[ROW_TILE * MAX_HEADS];
    for (int64_t r = 0; r < count; r++)
        for (int64_t h = 0; h < group; h++) {
            const int64_t len = context_lens[first + r];
            const int64_t lo = window_start(len, window) - c->start, hi = len - c->start;
            float *p = scores + (r * group + h) * width;
            sums[r * group + h] = exp_shifted(p + lo, maximum_of(p + lo, hi - lo), p + lo, hi - lo);
            for (int64_t t = 0; t < lo; t++) p[t] = 0.f; /* behind the window */
            float *o = out + (first + r) * row_size + (g * group + h) * d;
            for (int64_t j = 0; j < d; j++) o[j] = 0.f;
        }
    for (int64_t t0 = 0; t0 < last; t0 += KEY_TILE)
        for (int64_t r = 0; r < count; r++) {
            const int64_t len = context_lens[first + r] - c->start;
            const int64_t n = len - t0 < KEY_TILE ? len - t0 : KEY_TILE;
            for (int64_t h = 0; h < group && n > 0; h++)
                add_weighted_values(scores + (r * group + h) * width + t0, v, t0 * d, d, n, d,
                                    out + (first + r) * row_size + (g * group + h) * d, 0);
        }
    for (int64_t r = 0; r < count; r++)
        for (int64_t h = 0; h < group; h++) {
            const float inverse = 1.f / sums[r * group + h];
            float *o = out + (first + r) * row_size + (g * group + h) * d;
            for (int64_t j = 0; j < d; j++) o[j] *= inverse;
        }
}

/* Every row of a step: q, out [rows, num_heads, head_dim]; row r belongs to the
   sequence with block table block_tables[row_seqs[r]] (of [num_seqs, max_blocks]) and
   attends its first context_lens[r] tokens, the last window of them where window > 0.
   A prompt chunk is a run of rows of one sequence at consecutive positions. Returns
   nonzero when memory ran out. */
static int attend_rows(const AttentionShape *a, const float *q, const void *k_cache,
                       const void *v_cache, const int64_t *block_tables, int64_t max_blocks,
                       const int64_t *row_seqs, const int64_t *context_lens, int64_t window,
                       int64_t rows, float *out, int num_threads) {
    const int64_t kv_heads = a->num_kv_heads, d = a->head_dim, row_size = a->num_heads * d;
    const int64_t group = a->num_heads / kv_heads;
    Chunk *chunks = malloc(sizeof(Chunk) * (size_t)rows);
    AttentionItem *items = malloc(sizeof(AttentionItem) * (size_t)(rows * kv_heads));
    int64_t num_chunks = 0, count = 0, longest = 1, widest = KEY_TILE, gathered = 0;
    /* A step of fewer rows than twice the threads (one stream, a few): each single-token
       row is one item per kv head (its query heads), so every thread has a share of
       the attention instead of one thread doing it while the rest wait. A head's
       arithmetic is the same either way. */
    const int split = rows < 2 * num_threads;
    for (int64_t r = 0; r < rows && chunks && items;) {
        int64_t end = r + 1;
        while (end < rows && row_seqs[end] == row_seqs[r] &&
               context_lens[end] == context_lens[end - 1] + 1)
            end++;
        const int64_t len = context_lens[end - 1];
        if (len > longest) longest = len;
        if (end - r <= ROWWISE_CHUNK) {
            for (int64_t row = r; row < end; row++)
                for (int64_t g = split ? 0 : -1; g < (split ? kv_heads : 0); g++)
                    items[count++] = (AttentionItem){row, 1, -1, g};
        } else {
            const int64_t start = window_start(context_lens[r], window);
            const int64_t width = (len - start + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
            if (width > widest) widest = width;
            const int64_t *table = block_tables + row_seqs[r] * max_blocks;
            chunks[num_chunks] = (Chunk){table, start, len, width, NULL, NULL};
            gathered += kv_heads * d * width;
            for (int64_t first = r; first < end; first += ROW_TILE)
                for (int64_t g = 0; g < kv_heads; g++)
                    items[count++] = (AttentionItem){
                        first, end - first < ROW_TILE ? end - first : ROW_TILE, num_chunks, g};
            num_chunks++;
        }
        r = end;
    }
    float *keys = malloc(sizeof(float) * (size_t)(2 * gathered + 1));
    int failed = !chunks || !items || !keys || group > MAX_HEADS;
    for (int64_t i = 0, offset = 0; i < num_chunks && !failed; i++) {
        chunks[i].keys = keys + offset;
        chunks[i].values = keys + gathered + offset;
        offset += kv_heads * d * chunks[i].width;
    }
    const int64_t score_size = a->num_heads * longest > ROW_TILE * group * widest
                                   ? a->num_heads * longest
                                   : ROW_TILE * group * widest;
    /* one item (a decode step of one sequence) runs on this thread: a team would wait */
#pragma omp parallel num_threads(num_threads) if (!failed && num_chunks * kv_heads + count > 1)
    {
        float *scores = failed ? NULL : malloc(sizeof(float) * (size_t)score_size);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_chunks * kv_heads; i++) {
            if (scores == NULL) continue;
            const Chunk *c = chunks + i / kv_heads;
            const int64_t g = i % kv_heads;
            gather_head(a, k_cache, v_cache, c->table, c->start, c->len, g, c->width,
                        c->keys + g * d * c->width, c->values + g * c->width * d);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++) {
            if (scores == NULL) continue;
            const AttentionItem it = items[i];
            if (it.chunk < 0) {
                const int64_t *table = block_tables + row_seqs[it.first_row] * max_blocks;
                const int64_t len = context_lens[it.first_row];
                /* the row this thread likely takes next, as the threads take turns */
                const int64_t n = i + omp_get_num_threads();
                const int64_t row = it.kv_head < 0 && n < count && items[n].chunk < 0
                                        ? items[n].first_row
                                        : -1;
                const int64_t h0 = it.kv_head < 0 ? 0 : it.kv_head * group;
                const int64_t h1 = it.kv_head < 0 ? a->num_heads : h0 + group;
                Ahead next;
                Ahead *ahead = row < 0 ? NULL
                                       : ahead_start(&next, a, k_cache, v_cache,
                                                     block_tables + row_seqs[row] * max_blocks,
                                                     context_lens[row], window);
                attend_sequence(a, q + it.first_row * row_size, k_cache, v_cache, table,
                                window_start(len, window), len, h0, h1, scores,
                                out + it.first_row * row_size, ahead);
            } else {
                attend_chunk_tile(a, q, chunks + it.chunk, context_lens, window, it.first_row,
                                  it.rows, it.kv_head, scores, out);
            }
        }
        free(scores);
    }
    free(chunks);
    free(items);
    free(keys);
    return failed;
}

#endif
