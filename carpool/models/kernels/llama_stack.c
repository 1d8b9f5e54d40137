/* A whole Llama-family decoder stack for one engine step, in one call: decodes and
   prompt chunks alike are rows of a flat batch. Per layer RMSNorm, the fused QKV
   projection (+ bias), an RMSNorm over each head's query and key where the layer has
   them (Qwen3), rotary embedding, the new keys and values of every row written to
   their cache slots (rounded to halves where the cache holds them), then each row
   attending its sequence's cache up to its own position, within the layer's sliding
   window if it has one (prefill_attention.h), the output projection (normed where
   the layer has a norm after attention, Gemma 3) and residual,
   RMSNorm, the fused gate/up projection, SiLU(gate) * up (GELU's tanh form for
   Gemma 3), the down projection (normed where the layer has a norm after its MLP)
   and residual; after the last layer the final RMSNorm (final_norm: [hidden]), in place.
   Gemma 3's norms scale by 1 + weight: it hands over that sum. The
   same arithmetic as the per-operation path (carpool/models/llama.py with the
   quantized-linear and decode-attention kernels), without several hundred torch
   calls a step; only summation order may differ.

   x: [rows, hidden] float32, the residual stream, updated in place (normed at the end);
   step: where each row reads its rotary factors, writes its key and value and reads
   its sequence's cache (Step), every index checked before the first is followed. */

#include "abi.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "interleaved.h"
#include "kv_cache.h"
#include "prefill_attention.h"
#include "quantized_linear.h"
#include "vector_math.h"

/* One part of a matrix in the file's layout: its rows, n of them */
typedef struct {
    int64_t kind; /* KIND_Q4_1, KIND_Q8_0, KIND_Q8_16, KIND_Q5_1, KIND_Q5_0 or KIND_Q6_16 */
    const void *quants;
    const float *scales; /* NULL where k_supers and k_factors make them */
    const float *mins;   /* Q4_1's; Q8_16's where it has them; else NULL */
    /* a K-quant's own scales (quantized_dot.h's KScaleRows: Q4_K's and Q5_K's for Q4_1
       and Q5_1 blocks, Q6_K's for Q6_16), from which scales and mins are made; NULL:
       scales and mins are given */
    const uint16_t *k_supers;
    const void *k_factors;
    int64_t n;
} FilePart;

typedef struct {
    /* the file's layout: fparts parts (0 where the interleaved blocks alone hold the
       weights; then Dims.int8_dots is 1: the caller checks), each in its own layout
       (a fused projection whose parts differ: a Q4_K query and key beside a Q6_K
       value), their rows one after another */
    int64_t fparts;
    FilePart file[MAX_PARTS];
    const float *bias; /* NULL: none */
    int64_t n, k;
    /* the blocks interleaved (interleaved.h): iparts parts (0: none), each in its own
       layout, their rows one after another; with int8_dots every step's rows use them */
    int64_t iparts;
    InterleavedWeight interleaved[MAX_PARTS];
} Matrix;

typedef struct {
    const float *input_norm, *post_norm;
    const float *q_norm, *k_norm; /* [head_dim] each, or NULL: no per-head norm */
    /* [hidden] each, or NULL: a norm of the attention's and of the MLP's output */
    const float *attn_out_norm, *mlp_out_norm;
    Matrix qkv, o, gate_up, down;
    /* [num_blocks, block_size, num_kv_heads, head_dim]: floats, or halves where
       Dims.kv_half (kv_cache.h) */
    void *k_cache, *v_cache;
    int64_t window;           /* the sliding window (each row's last this-many keys); 0: none */
    int64_t local_rope;       /* 1: rotary factors from Step's local_cos / local_sin */
} Layer;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    int64_t int8_dots; /* 1: decode rows' dot products in int8 (quantized_dot.h) */
    int64_t gelu;      /* 1: GELU (tanh) gating; 0: SiLU */
    int64_t kv_half;   /* 1: the KV caches hold IEEE halves; 0: float32 */
} Dims;

/* A step's rows and what they index. */
typedef struct {
    const int64_t *positions; /* [rows], each row's position */
    /* rotary tables [rope_rows, head_dim / 2] (each angle once: carpool.models.rope),
       read at the positions;
       local_cos, local_sin: the second tables that layers with local_rope read (Gemma
       3's sliding layers), of local_rope_rows, or NULL where no layer does */
    const float *cos, *sin;
    int64_t rope_rows;
    const float *local_cos, *local_sin;
    int64_t local_rope_rows;
    /* slots: [rows], where each row's key and value go (block * block_size + offset);
       block_tables: [num_seqs, max_blocks], one per sequence of the step; num_blocks:
       the fewest blocks a cache they index holds */
    const int64_t *slots, *block_tables;
    int64_t num_seqs, max_blocks, num_blocks;
    /* where not NULL, the layers with a window write and read these instead (a hybrid
       model's windowed layers keep their KV in a pool of their own, with tables of
       their own: [num_seqs, window_max_blocks], into window_num_blocks) */
    const int64_t *window_slots, *window_block_tables;
    int64_t window_max_blocks, window_num_blocks;
    const int64_t *row_seqs;     /* [rows], each row's sequence */
    const int64_t *context_lens; /* [rows], each row's position + 1 */
} Step;

/* The sizes of the structs passed by pointer (0: Matrix, 1: Layer, 2: Dims, 3: Step; else
   -1), checked against their ctypes declarations in carpool/models/llama_stack.py. */
int64_t llama_stack_struct_size(int64_t which) {
    switch (which) {
        case 0: return (int64_t)sizeof(Matrix);
        case 1: return (int64_t)sizeof(Layer);
        case 2: return (int64_t)sizeof(Dims);
        case 3: return (int64_t)sizeof(Step);
        default: return -1;
    }
}

static int file_part_linear(const FilePart *part, const float *x, float *y, int64_t rows,
                            int64_t k, int64_t int8_dots, int threads) {
    const KScaleRows ks = {part->k_supers, part->k_factors};
    return quantized_linear(part->kind, x, part->quants, part->scales, part->mins,
                            part->k_supers == NULL ? NULL : &ks, y, rows, part->n, k, int8_dots,
                            threads);
}

/* y [rows, w->n] = x @ w^T (+ bias): on the interleaved blocks with int8_dots, else on
   the file's layout, part by part (each into a scratch [rows, its n], then into its
   columns of y). Non-zero when out of memory. */
static int linear(const Matrix *w, const float *x, float *y, int64_t rows, int64_t int8_dots,
                  int threads) {
    int failed = 0;
    if (int8_dots && w->iparts > 0)
        failed = interleaved_linear(w->interleaved, w->iparts, x, y, rows, w->k, threads);
    else if (w->fparts == 1)
        failed = file_part_linear(&w->file[0], x, y, rows, w->k, int8_dots, threads);
    else {
        int64_t widest = 0;
        for (int64_t p = 0; p < w->fparts; p++)
            widest = w->file[p].n > widest ? w->file[p].n : widest;
        float *part_y = malloc(sizeof(float) * (size_t)(rows * widest));
        if (part_y == NULL) return 1;
        for (int64_t p = 0, column = 0; p < w->fparts && !failed; column += w->file[p].n, p++) {
            const int64_t n = w->file[p].n;
            failed = file_part_linear(&w->file[p], x, part_y, rows, w->k, int8_dots, threads);
            for (int64_t r = 0; r < rows && !failed; r++)
                memcpy(y + r * w->n + column, part_y + r * n, sizeof(float) * (size_t)n);
        }
        free(part_y);
    }
    if (!failed && w->bias != NULL)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = 0; o < w->n; o++) y[r * w->n + o] += w->bias[o];
    return failed;
}

/* Element-wise work is split over the threads only for steps of this many rows or
   more (prompt chunks, many streams): for a few rows, waking the threads costs more
   than it saves. */
#define PARALLEL_ROWS 64
/* the same bound for element-wise loops, in values (PARALLEL_ROWS rows of 256) */
#define PARALLEL_VALUES (PARALLEL_ROWS * 256)

/* out = x / sqrt(mean(x^2) + eps) * weight, row by row (as torch's rms_norm) */
static void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t size,
                     float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * size;
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < size; i++) squares += xr[i] * xr[i];
        const float inverse = 1.f / sqrtf(squares / (float)size + eps);
        for (int64_t i = 0; i < size; i++) out[r * size + i] = xr[i] * inverse * weight[i];
    }
}

/* each of count heads of one row (in place) times weight over its RMS, as rms_norm;
   no threads of its own: it runs inside the per-row loop */
static void norm_heads(float *v, int64_t count, int64_t d, const float *weight, float eps) {
    for (int64_t h = 0; h < count; h++, v += d) {
        float squares = 0.f;
        for (int64_t i = 0; i < d; i++) squares += v[i] * v[i];
        const float inverse = 1.f / sqrtf(squares / (float)d + eps);
        for (int64_t i = 0; i < d; i++) v[i] = v[i] * inverse * weight[i];
    }
}

/* v * cos + rotate_half(v) * sin for each of count heads of one row; cos and sin
   [d / 2], the angles both halves of a head share */
static void rotate(float *v, int64_t count, int64_t d, const float *cos, const float *sin) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < count; h++, v += d)
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] + (-b) * sin[i];
            v[i + half] = b * cos[i] + a * sin[i];
        }
}

/* What llama_stack returns where an index points outside what it indexes (one per
   array, in the order they are checked; llama_stack.py names them) */
enum {
    BAD_POSITIONS = 2,
    BAD_SLOTS,
    BAD_BLOCK_TABLES,
    BAD_ROW_SEQS,
    BAD_CONTEXT_LENS,
    BAD_WINDOW_SLOTS,
    BAD_WINDOW_BLOCK_TABLES,
    BAD_WINDOW_CONTEXT_LENS,
};

static int all_within(const int64_t *values, int64_t count, int64_t low, int64_t high) {
    for (int64_t i = 0; i < count; i++)
        if (values[i] < low || values[i] > high) return 0;
    return 1;
}

/* 0 when every index of the step points inside what it indexes (a corrupted block
   table fails the step's requests, not the process), else which array does not */
static int check_step(const Step *s, int64_t rows, int64_t block_size) {
    if (!all_within(s->positions, rows, 0, s->rope_rows - 1) ||
        (s->local_cos != NULL && !all_within(s->positions, rows, 0, s->local_rope_rows - 1)))
        return BAD_POSITIONS;
    if (!all_within(s->slots, rows, 0, s->num_blocks * block_size - 1)) return BAD_SLOTS;
    if (!all_within(s->block_tables, s->num_seqs * s->max_blocks, 0, s->num_blocks - 1))
        return BAD_BLOCK_TABLES;
    if (!all_within(s->row_seqs, rows, 0, s->num_seqs - 1)) return BAD_ROW_SEQS;
    if (!all_within(s->context_lens, rows, 1, s->max_blocks * block_size)) return BAD_CONTEXT_LENS;
    if (s->window_slots == NULL) return 0;
    if (!all_within(s->window_slots, rows, 0, s->window_num_blocks * block_size - 1))
        return BAD_WINDOW_SLOTS;
    if (!all_within(s->window_block_tables, s->num_seqs * s->window_max_blocks, 0,
                    s->window_num_blocks - 1))
        return BAD_WINDOW_BLOCK_TABLES;
    if (!all_within(s->context_lens, rows, 1, s->window_max_blocks * block_size))
        return BAD_WINDOW_CONTEXT_LENS;
    return 0;
}

/* x += delta */
static void add_in_place(float *x, const float *delta, int64_t count, int threads) {
#pragma omp parallel for simd schedule(static) num_threads(threads) if (count >= PARALLEL_VALUES)
    for (int64_t i = 0; i < count; i++) x[i] = x[i] + delta[i];
}

/* Returns 0, 1 when out of memory, or check_step's code (nothing run) */
int llama_stack(const Layer *layers, int64_t num_layers, const Dims *dims, float *x,
                int64_t rows, const Step *step, const float *final_norm, int num_threads) {
    const int bad = check_step(step, rows, dims->block_size);
    if (bad) return bad;
    const int64_t hidden = dims->hidden, d = dims->head_dim;
    const int64_t q_size = dims->num_heads * d, kv_size = dims->num_kv_heads * d;
    const int64_t qkv_size = q_size + 2 * kv_size, inter = dims->intermediate;
    const AttentionShape shape = {dims->num_heads, dims->num_kv_heads, d, dims->block_size,
                                  dims->scale, dims->kv_half != 0};
    float *normed = malloc(sizeof(float) * (size_t)(rows * hidden));
    float *qkv = malloc(sizeof(float) * (size_t)(rows * qkv_size));
    float *queries = malloc(sizeof(float) * (size_t)(rows * q_size));
    float *attended = malloc(sizeof(float) * (size_t)(rows * q_size));
    float *gate_up = malloc(sizeof(float) * (size_t)(rows * 2 * inter));
    float *act = malloc(sizeof(float) * (size_t)(rows * inter));
    float *delta = malloc(sizeof(float) * (size_t)(rows * hidden));
    int failed = !normed || !qkv || !queries || !attended || !gate_up || !act || !delta;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const Layer *layer = layers + l;
        const float *layer_cos = layer->local_rope ? step->local_cos : step->cos;
        const float *layer_sin = layer->local_rope ? step->local_sin : step->sin;
        const int own_pool = layer->window > 0 && step->window_slots != NULL;
        const int64_t *layer_slots = own_pool ? step->window_slots : step->slots;
        const int64_t *tables = own_pool ? step->window_block_tables : step->block_tables;
        const int64_t width = own_pool ? step->window_max_blocks : step->max_blocks;
        if (layer_cos == NULL || layer_sin == NULL || tables == NULL) {
            failed = 1;
            break;
        }
        rms_norm(x, layer->input_norm, normed, rows, hidden, dims->eps, num_threads);
        failed |= linear(&layer->qkv, normed, qkv, rows, dims->int8_dots, num_threads);
        if (failed) break;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
        for (int64_t r = 0; r < rows; r++) {
            float *row = qkv + r * qkv_size;
            if (layer->q_norm != NULL && layer->k_norm != NULL) {
                norm_heads(row, dims->num_heads, d, layer->q_norm, dims->eps);
                norm_heads(row + q_size, dims->num_kv_heads, d, layer->k_norm, dims->eps);
            }
            const int64_t at = step->positions[r] * (d / 2);
            rotate(row, dims->num_heads + dims->num_kv_heads, d, layer_cos + at, layer_sin + at);
            for (int64_t i = 0; i < q_size; i++) queries[r * q_size + i] = row[i];
            const int64_t slot = layer_slots[r] * kv_size;
            kv_store(layer->k_cache, slot, row + q_size, kv_size, shape.kv_half);
            kv_store(layer->v_cache, slot, row + q_size + kv_size, kv_size, shape.kv_half);
        }
        failed |= attend_rows(&shape, queries, layer->k_cache, layer->v_cache, tables, width,
                              step->row_seqs, step->context_lens, layer->window, rows, attended,
                              num_threads);
        failed |= linear(&layer->o, attended, delta, rows, dims->int8_dots, num_threads);
        if (layer->attn_out_norm != NULL)
            rms_norm(delta, layer->attn_out_norm, delta, rows, hidden, dims->eps, num_threads);
        add_in_place(x, delta, rows * hidden, num_threads);
        rms_norm(x, layer->post_norm, normed, rows, hidden, dims->eps, num_threads);
        failed |= linear(&layer->gate_up, normed, gate_up, rows, dims->int8_dots, num_threads);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= PARALLEL_VALUES)
        for (int64_t r = 0; r < rows; r++) {
            const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
            if (dims->gelu)
                gelu_tanh_times(gate, up, act + r * inter, inter);
            else
                silu_times(gate, up, act + r * inter, inter);
        }
        failed |= linear(&layer->down, act, delta, rows, dims->int8_dots, num_threads);
        if (layer->mlp_out_norm != NULL)
            rms_norm(delta, layer->mlp_out_norm, delta, rows, hidden, dims->eps, num_threads);
        add_in_place(x, delta, rows * hidden, num_threads);
    }
    /* here, not in torch: after the weights' stream a torch call's code and data come
       from memory again (a 1.2B model's one stream: 0.1-0.3 ms for torch's norm) */
    if (!failed) rms_norm(x, final_norm, x, rows, hidden, dims->eps, num_threads);
    free(normed);
    free(qkv);
    free(queries);
    free(attended);
    free(gate_up);
    free(act);
    free(delta);
    return failed;
}
