/* y = x @ W^T with int8 dot products (--weight-kernel native-int8) over weights whose
   blocks are interleaved FEATURES output features at a time, for any number of rows.

   The file's layout (quantized_dot.h) keeps one feature's block of 32 weights
   together, so an integer dot product yields 8 partial sums of one block that must
   each be converted and scaled: ~5 instructions per row and block. Interleaved, one
   multiply-add of unsigned by signed bytes, four bytes of x broadcast, advances
   several features at once (AVX-512 VNNI's vpdpbusd: 16; AVX2's vpmaddubsw: 8, its
   16-bit sums added up before one vpmaddwd widens them), eight of them finish a
   block, and one conversion and two multiply-adds scale it. Unpacking the weights is
   shared by up to TILE_ROWS rows, so a step of a few rows (a speculative
   verification) costs little more than one row; prompt chunks run here too, so every
   row of every step gets the same arithmetic. Past TILE_ROWS rows a CPU with AMX
   multiplies a block for 16 rows in one tile instruction (amx_tile below), the same
   integers scaled the same way.

   Layouts (carpool/models/packed_linear.py Interleaved writes them), n a multiple of
   FEATURES, groups = k / 32, per strip of FEATURES features and block:
   Q4_1: quants [4][FEATURES][4] uint8: byte (j, f, b) holds weight 4j + b of feature f's
         block in its low nibble and weight 16 + 4j + b in its high nibble;
         extra: mins, float16 [FEATURES].
   Q8_0: quants [8][FEATURES][4] int8: byte (j, f, b) is weight 4j + b of feature f;
         extra: the sum of the block's quants, int16 [FEATURES] (vpdpbusd takes x + 128
         as its unsigned bytes; 128 times this takes the 128s back out).
   Q5_1, Q5_0: quants [5][FEATURES][4] uint8: lanes 0-3 Q4_1's nibbles of the low four
         bits, then lane 4: byte (f, b)'s bit j is the fifth bit of weight 4j + b (the
         weight nibble lane j holds at byte b: j < 4 low nibbles, then high ones), so
         shifting that bit to bit 4 and or-ing it in gives lane j's quants (0-31);
         extra: Q5_1's mins, float16 [FEATURES]; Q5_0: none (its quants' 16 is taken
         out of the integer sum as 16 * the sum of x's block's int8 steps).
   Q4_K, Q5_K (kinds of this kernel only): Q4_1's and Q5_1's quants with a K-quant's
         scales as its file holds them (k a multiple of 256): per super-block of
         SUPER_BLOCKS blocks, scales of K_SCALE_BYTES uint8: each block's and feature's
         scale sc and min m in the file's 6 bits (unpack_k_scales has the order), and
         extra float16 [2][FEATURES] (the file's d, then -dmin); a block's scale is
         d * sc and its min -dmin * m: in 4.5 and 5.5 bits a weight, the files', instead
         of Q4_1's and Q5_1's 6 and 7.
   Q6_K (a kind of this kernel only; k a multiple of 256): quants [6][FEATURES][4]
         uint8 of q = the file's 6-bit quant (w = d * sc * (q - 32)): lanes 0-3 Q4_1's
         nibbles of q's low four bits, lane 4: byte (f, b)'s bits 2j and 2j + 1 are
         bits 4 and 5 of the weight lane j's low nibble holds at byte b (weight 4j + b),
         lane 5 the same for the high nibbles (weight 16 + 4j + b); scales int8
         [2][FEATURES]: each feature's sc for weights 0-15, then for 16-31; extra float16
         [FEATURES] per super-block (d): 6.5625 bits a weight, the file's.
   scales: float16 [FEATURES] a block (but Q4_K's, Q5_K's and Q6_K's): the file's own, as the mins
   (each a float32 exactly, so the same floats as the file layout's float32 scales, in
   2 bytes a block instead of 4: Q4_1 in 5 bits a weight, its file's, instead of 6).

   x's rows are rounded to int8 steps first (fill_rounded, quantize_block's rounding), each
   step within [-127, 127]: per block of 32 for Q4_1, Q8_0, Q5_1 and Q5_0, per super-block
   of 256 (one step, its blocks' largest, as llama.cpp's Q8_K) for the K-quants, so that
   their integer sub-block scales multiply integer sums; a call whose parts read both
   roundings makes both. Each feature's result, per row, over blocks g in order:
       acc = fma((float)(q . xq) * xscale, scale, acc)   then for Q4_1 and Q5_1
       acc = fma(xsum, min, acc)
   with the integer dot product exact (Q5_0's q - 16); the K-quants' per super-block,
   with 32-bit integer sums over its blocks (at most 8 * 63 * 32 * 31 * 127 < 2^31):
       Q4_K, Q5_K: acc = fma((float)sum(sc * (q . xq)), d * xscale, acc)
                   acc = fma((float)sum(m * sum(xq)), -dmin * xscale, acc)
       Q6_K:       acc = fma((float)sum(sc0 * (q - 32) . xq[0:16] + sc1 * (q - 32) . xq[16:32]),
                             d * xscale, acc)
   The portable C path computes the same (fmaf), so a row's result depends neither on
   the step's other rows, nor on the threads, nor on the instruction set. */

#ifndef CARPOOL_INTERLEAVED_H
#define CARPOOL_INTERLEAVED_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "quantized_dot.h"
#include "work_share.h"

#define FEATURES 16
#define TILE_ROWS 8
/* The AVX2 tiles take up to WIDE_ROWS rows a call (their sums live in memory either
   way: 16 registers hold no row's beside the weights), so that each block's weights
   are unpacked once for a step's rows, not once for every 8 */
#define WIDE_ROWS 64

typedef struct {
    /* KIND_Q4_1, KIND_Q8_0, KIND_Q5_1 or KIND_Q5_0 (quantized_dot.h), KIND_Q4_K, KIND_Q5_K
       or KIND_Q6_K */
    int64_t kind;
    const void *quants;
    const void *scales; /* float16, but the K-quants' (6-bit pairs; Q6_K's int8) */
    /* Q4_1, Q5_1: mins (float16); Q8_0: quant sums (int16); Q5_0: NULL; the K-quants:
       the super-blocks' d and -dmin (float16; Q6_K's d) */
    const void *extra;
    int64_t n; /* output features, a multiple of FEATURES */
} InterleavedWeight;

/* A fused projection's parts (its query, key and value; its gate and up), each in its
   own layout, their output features one after another */
#define MAX_PARTS 3

/* Interleaved-only kinds: Q4_1's and Q5_1's quants with the K-quants' scales */
enum { KIND_Q4_K = 5, KIND_Q5_K = 6, KIND_Q6_K = 7 };
#define SUPER_BLOCKS 8 /* blocks of 32 in a K-quant's super-block */

static inline int factored(int64_t kind) { return kind == KIND_Q4_K || kind == KIND_Q5_K; }
/* the layout of a kind's quants */
static inline int64_t quant_kind(int64_t kind) {
    return kind == KIND_Q4_K ? KIND_Q4_1 : kind == KIND_Q5_K ? KIND_Q5_1 : kind;
}
static inline int has_mins(int64_t kind) {
    return quant_kind(kind) == KIND_Q4_1 || quant_kind(kind) == KIND_Q5_1;
}

/* 32-bit lanes of one feature's block (4 bytes each), and bytes of one block of
   FEATURES features */
static inline int64_t tile_lanes(int64_t kind) {
    return quant_kind(kind) == KIND_Q4_1 ? 4 : kind == KIND_Q8_0 ? 8 : kind == KIND_Q6_K ? 6 : 5;
}
static inline int64_t tile_bytes(int64_t kind) { return FEATURES * 4 * tile_lanes(kind); }

static inline int interleaved_kind(int64_t kind) {
    return kind == KIND_Q4_1 || kind == KIND_Q8_0 || kind == KIND_Q5_1 || kind == KIND_Q5_0 ||
           factored(kind) || kind == KIND_Q6_K;
}

/* Kinds whose scales are per super-block of 256 weights (k a multiple of 256): their
   tiles read x rounded per super-block, so that their integer sub-block scales
   multiply integer sums */
static inline int super_blocked(int64_t kind) { return factored(kind) || kind == KIND_Q6_K; }

/* Bytes of Q4_K's and Q5_K's scales and mins per super-block of a strip: 6 bits each */
#define K_SCALE_BYTES (SUPER_BLOCKS * 2 * FEATURES * 6 / 8)

/* Bytes of scales and of extra per strip of FEATURES features */
static inline int64_t strip_scale_bytes(int64_t kind, int64_t groups) {
    if (factored(kind)) return groups / SUPER_BLOCKS * K_SCALE_BYTES;
    return groups * FEATURES * 2; /* two bytes a feature and block: a float16, Q6_K's pair */
}

/* A super-block's K_SCALE_BYTES of Q4_K's or Q5_K's scales and mins: byte 16j + f holds
   the low four bits of block j's sc (bits 0-3) and m (bits 4-7) of feature f; then two
   runs of 32 bytes, run p's byte i holding bits 4 and 5 of value i of block 4p + t
   (i < FEATURES: sc of feature i, else m of feature i - FEATURES) at bits 2t and 2t + 1.
   k_scale_at: value i of block j. */
static inline uint8_t k_scale_at(const uint8_t *packed, int j, int i) {
    const uint8_t low = packed[FEATURES * j + i % FEATURES];
    const int bits = (packed[SUPER_BLOCKS * FEATURES + 2 * FEATURES * (j / 4) + i] >> (2 * (j % 4))) & 3;
    return (uint8_t)((i < FEATURES ? low & 15 : low >> 4) | bits << 4);
}

/* Every value of a super-block's packed scales as a byte: out [SUPER_BLOCKS][2][FEATURES],
   block j's sc of each feature, then its m. The same bytes on every rung. */
static inline void unpack_k_scales(const uint8_t *packed, uint8_t *out) {
#if defined(__AVX2__) && defined(__FMA__)
    const uint8_t *high = packed + SUPER_BLOCKS * FEATURES;
    const __m128i nibble = _mm_set1_epi8(15);
    const __m256i two_bits = _mm256_set1_epi8(3);
    for (int j = 0; j < SUPER_BLOCKS; j++) {
        const __m128i low = _mm_loadu_si128((const __m128i *)(packed + FEATURES * j));
        const __m256i lows = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(low, 4), nibble),
                                              _mm_and_si128(low, nibble));
        const __m256i run = _mm256_loadu_si256((const __m256i *)(high + 2 * FEATURES * (j / 4)));
        /* 16-bit shifts: the mask keeps each byte's own two bits */
        const __m256i bits = _mm256_and_si256(_mm256_srl_epi16(run, _mm_cvtsi32_si128(2 * (j % 4))), two_bits);
        _mm256_storeu_si256((__m256i *)(out + 2 * FEATURES * j),
                            _mm256_or_si256(lows, _mm256_slli_epi16(bits, 4)));
    }
#else
    for (int j = 0; j < SUPER_BLOCKS; j++)
        for (int i = 0; i < 2 * FEATURES; i++) out[2 * FEATURES * j + i] = k_scale_at(packed, j, i);
#endif
}
static inline int64_t strip_extra_bytes(int64_t kind, int64_t groups) {
    if (super_blocked(kind))
        return groups / SUPER_BLOCKS * (kind == KIND_Q6_K ? 1 : 2) * FEATURES * 2; /* float16 */
    return groups * FEATURES * 2; /* float16 mins, int16 sums */
}

/* The x operands of one tile: its rows' int8 steps (xq), xq + 128 (xu: Q8_0's under
   VNNI, Q6_K's AVX2 code's past TILE_ROWS rows), the sums of each half block's steps
   (xhalfsums: Q5_0's, and Q6_K's vector code's), and per block the step (xscales) and the
   float32 sum (xsums); each [rows, k], [rows, 2 * groups] or [rows, groups] from the
   tile's row. */
typedef struct {
    const int8_t *xq;
    const uint8_t *xu;
    const int32_t *xhalfsums;
    const float *xscales, *xsums;
    /* Q4_K's and Q5_K's: per pair of blocks (2i, 2i + 1) the sums of their steps, the
       first's in the low 16 bits and the second's in the high (each within 32 * 127),
       [rows, groups / 2] */
    const int32_t *xpairsums;
} TileRows;

/* How far ahead of the block at hand a vector tile asks for its weights, into L2: one
   row then streams them from memory at 1.15-1.35x the rate (a Zen 4, 2 threads, one
   row over 157 MiB of Q4_K or 57 MiB of Q5_0 matrices; 2 KB ahead into L1 did not) */
#define TILE_PREFETCH_BYTES 8192

static inline void prefetch_ahead(const uint8_t *q, int64_t bytes) {
    /* an address, not a pointer: past the matrix's end there is no object to point into */
    const uintptr_t ahead = (uintptr_t)q + TILE_PREFETCH_BYTES;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const void *)(ahead + (uintptr_t)b), 0, 2);
}

/* The sum of row r's steps in block g, from xpairsums */
static inline int32_t block_steps_sum(const TileRows *x, int64_t groups, int64_t r, int64_t g) {
    const uint32_t pair = (uint32_t)x->xpairsums[(r * groups + g) / 2];
    return (int16_t)(uint16_t)(g % 2 == 0 ? pair : pair >> 16);
}

/* 16 times the sum of row r's steps in block g: Q5_0's quants' 16, taken out */
static inline int32_t q5_0_offset(const TileRows *x, int64_t groups, int64_t r, int64_t g) {
    const int32_t *halves = x->xhalfsums + (r * groups + g) * 2;
    return 16 * (halves[0] + halves[1]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INTERLEAVED_VECTORIZED 2

static inline __m512i broadcast4(const uint8_t *a) {
    int32_t v;
    memcpy(&v, a, sizeof v);
    return _mm512_set1_epi32(v);
}

/* FEATURES float16 as floats */
static inline __m512 halves_floats(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* The sum over a block of four-byte products of w[j] and x's bytes 4j to 4j + 3
   broadcast, in two chains of four (the second half's apart): 8 dependent
   vpdpbusd would wait on each other's latency. Integer sums: the order changes
   nothing. Q8_0 passes x + 128 as the unsigned bytes (unsigned_x). */
ALWAYS_INLINE __m512i block_dot(const __m512i *w, const uint8_t *a, int unsigned_x) {
    __m512i first = _mm512_setzero_si512(), second = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        if (unsigned_x) {
            first = _mm512_dpbusd_epi32(first, broadcast4(a + 4 * j), w[j]);
            second = _mm512_dpbusd_epi32(second, broadcast4(a + 16 + 4 * j), w[4 + j]);
        } else {
            first = _mm512_dpbusd_epi32(first, w[j], broadcast4(a + 4 * j));
            second = _mm512_dpbusd_epi32(second, w[4 + j], broadcast4(a + 16 + 4 * j));
        }
    }
    return _mm512_add_epi32(first, second);
}

/* A block of Q4_1's or Q5's quants (the layouts above) as each feature's unsigned
   weights 4j + b in w[j]: the nibbles, and Q5's fifth bits or-ed in */
ALWAYS_INLINE void unpack_nibbles(int64_t kind, const uint8_t *q, __m512i w[8]) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        const __m512i packed = _mm512_loadu_si512((const void *)(q + 64 * j));
        w[j] = _mm512_and_si512(packed, low);
        w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
    if (quant_kind(kind) == KIND_Q4_1) return;
    const __m512i fifth = _mm512_loadu_si512((const void *)(q + 256));
    for (int j = 0; j < 8; j++) {
        /* bit j of each byte to bit 4: the 16-bit shifts move no bit across a byte,
           since only bit j is left in each */
        const __m512i bit = _mm512_and_si512(fifth, _mm512_set1_epi8((char)(1 << j)));
        const __m512i sixteen = j < 4 ? _mm512_slli_epi16(bit, 4 - j) : _mm512_srli_epi16(bit, j - 4);
        w[j] = _mm512_or_si512(w[j], sixteen);
    }
}

/* Row r's acc past block g: the block's integer dot q . xq times x's step and the
   block's scale, and for Q4_1 and Q5_1 x's float sum times its min (the header's
   arithmetic). The VNNI and AMX tiles both end a block here: the same bits. */
ALWAYS_INLINE __m512 block_scaled(__m512i dot, const TileRows *x, int64_t groups, int64_t r, int64_t g,
                                  __m512 scale, __m512 min, int with_mins, __m512 acc) {
    const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(x->xscales[r * groups + g]));
    acc = _mm512_fmadd_ps(part, scale, acc);
    return with_mins ? _mm512_fmadd_ps(_mm512_set1_ps(x->xsums[r * groups + g]), min, acc) : acc;
}

/* Row r's acc past the K-quant super-block that ends with block g: its integer sum
   dots converted once and scaled by d (or -dmin) times x's step */
ALWAYS_INLINE __m512 super_scaled(__m512i dots, __m512 d, const TileRows *x, int64_t groups, int64_t r,
                                  int64_t g, __m512 acc) {
    const __m512 step = _mm512_set1_ps(x->xscales[r * groups + g]);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(d, step), acc);
}

/* x's rows as vpdpbusd's unsigned operand: Q4_1's and Q5's weights are the unsigned
   bytes and x the signed ones; Q8_0's signed weights take x + 128 (xu) as the unsigned
   ones */
ALWAYS_INLINE void interleaved_tile(int64_t kind, const uint8_t *q, const void *scales,
                                    const void *extra, const TileRows *x, int64_t k,
                                    int64_t groups, int64_t rows, float *y, int64_t n) {
    __m512 acc[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) acc[r] = _mm512_setzero_ps();
    const int64_t bytes = tile_bytes(kind);
    const int with_mins = has_mins(kind);
    for (int64_t g = 0; g < groups; g++, q += bytes) {
        prefetch_ahead(q, bytes);
        __m512i w[8];
        if (kind == KIND_Q8_0) {
            for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(q + 64 * j));
        } else {
            unpack_nibbles(kind, q, w);
        }
        const __m512 scale = halves_floats((const uint16_t *)scales + g * FEATURES);
        const __m512 min = with_mins ? halves_floats((const uint16_t *)extra + g * FEATURES) : _mm512_setzero_ps();
        /* Q8_0: 128 times the block's quant sums, which x + 128 added */
        const __m512i offsets =
            kind == KIND_Q8_0 ? _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256(
                                                      (const __m256i *)((const int16_t *)extra + g * FEATURES))),
                                                  7)
                              : _mm512_setzero_si512();
        for (int64_t r = 0; r < rows; r++) {
            __m512i dot;
            if (kind == KIND_Q8_0) {
                dot = block_dot(w, x->xu + r * k + g * BLOCK, 1);
                dot = _mm512_sub_epi32(dot, offsets);
            } else { /* Q4_1, Q5: w[j] holds weights 4j + b, unsigned */
                dot = block_dot(w, (const uint8_t *)(x->xq + r * k + g * BLOCK), 0);
                if (kind == KIND_Q5_0)
                    dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(q5_0_offset(x, groups, r, g)));
            }
            acc[r] = block_scaled(dot, x, groups, r, g, scale, min, with_mins, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(y + r * n, acc[r]);
}

/* Each feature's m of a super-block's blocks 2i (low 16 bits) and 2i + 1 in pairs[i],
   from unpack_k_scales' bytes */
ALWAYS_INLINE void k_min_pairs(const uint8_t *unpacked, __m512i pairs[SUPER_BLOCKS / 2]) {
    for (int i = 0; i < SUPER_BLOCKS / 2; i++) {
        const uint8_t *m = unpacked + 2 * i * 2 * FEATURES + FEATURES;
        const __m512i first = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)m));
        const __m512i second = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(m + 2 * FEATURES)));
        pairs[i] = _mm512_or_si512(first, _mm512_slli_epi32(second, 16));
    }
}

/* Row r's acc past the super-block that ends with block g: dots, the sum of its blocks'
   sc * (q . xq); the sums of x's steps times the blocks' m (vpdpwssd: two blocks of
   16-bit pairs at a time) the other sum; each converted once and scaled by d (or
   -dmin) times x's step */
ALWAYS_INLINE __m512 k_quant_super(__m512i dots, const __m512i min_pairs[SUPER_BLOCKS / 2], __m512 d,
                                   __m512 neg_dmin, const TileRows *x, int64_t groups, int64_t r,
                                   int64_t g, __m512 acc) {
    const int32_t *pairs = x->xpairsums + (r * groups + g + 1 - SUPER_BLOCKS) / 2;
    __m512i mins = _mm512_setzero_si512();
    for (int i = 0; i < SUPER_BLOCKS / 2; i++)
        mins = _mm512_dpwssd_epi32(mins, min_pairs[i], _mm512_set1_epi32(pairs[i]));
    return super_scaled(mins, neg_dmin, x, groups, r, g, super_scaled(dots, d, x, groups, r, g, acc));
}

/* Q4_K's and Q5_K's tile (the arithmetic in the header comment): a block's integer
   dot times its integer scale (vpmulld) adds up over the super-block; at its end the
   sums of x's steps times the blocks' mins m (vpdpwssd: two blocks of 16-bit pairs at
   a time) make the other sum, and each is converted once and scaled by d (or -dmin)
   times x's step. Only the dots are carried from block to block (with the float sums
   and a block's weights, 24 of the 32 registers). */
ALWAYS_INLINE void k_quant_tile(int64_t kind, const uint8_t *q, const uint8_t *scales,
                                const uint16_t *supers, const TileRows *x, int64_t k,
                                int64_t groups, int64_t rows, float *y, int64_t n) {
    __m512 acc[TILE_ROWS];
    __m512i dots[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) {
        acc[r] = _mm512_setzero_ps();
        dots[r] = _mm512_setzero_si512();
    }
    const int64_t bytes = tile_bytes(kind);
    uint8_t unpacked[SUPER_BLOCKS * 2 * FEATURES];
    for (int64_t g = 0; g < groups; g++, q += bytes) {
        prefetch_ahead(q, bytes);
        if (g % SUPER_BLOCKS == 0) unpack_k_scales(scales + g / SUPER_BLOCKS * K_SCALE_BYTES, unpacked);
        __m512i w[8];
        unpack_nibbles(kind, q, w);
        const uint8_t *sc = unpacked + g % SUPER_BLOCKS * 2 * FEATURES;
        const __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sc));
        for (int64_t r = 0; r < rows; r++) {
            const __m512i dot = block_dot(w, (const uint8_t *)(x->xq + r * k + g * BLOCK), 0);
            dots[r] = _mm512_add_epi32(dots[r], _mm512_mullo_epi32(dot, scale));
        }
        if (g % SUPER_BLOCKS != SUPER_BLOCKS - 1) continue;
        __m512i min_pairs[SUPER_BLOCKS / 2];
        k_min_pairs(unpacked, min_pairs);
        const uint16_t *super = supers + g / SUPER_BLOCKS * 2 * FEATURES;
        const __m512 d = halves_floats(super), neg_dmin = halves_floats(super + FEATURES);
        for (int64_t r = 0; r < rows; r++) {
            acc[r] = k_quant_super(dots[r], min_pairs, d, neg_dmin, x, groups, r, g, acc[r]);
            dots[r] = _mm512_setzero_si512();
        }
    }
    for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(y + r * n, acc[r]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INTERLEAVED_VECTORIZED 1

static inline __m256i broadcast4(const int8_t *a) {
    int32_t v;
    memcpy(&v, a, sizeof v);
    return _mm256_set1_epi32(v);
}

/* 8 float16 as floats */
static inline __m256 halves_floats(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* vpmaddwd's 16-bit pairs: each 32-bit lane lo's low 16 bits, then hi's */
static inline __m256i pairs16(__m256i lo, __m256i hi) {
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(hi, 16));
}

/* A running sum kept as it is: without it GCC reassociates a row's sums over the
   block's lanes into a tree whose products wait on the stack (with it the AVX2 tiles
   of Q4_1, Q5_0, Q8_0 and Q5_K, a half at a time then, took 0.90-0.95x the time, 64
   rows on a Zen 4) */
#define KEEP_SUM(v) __asm__("" : "+x"(v))

/* Q8_0's 8 features of half h (w its signed weights, wabs their magnitudes): |w|
   times x with w's sign (vpsignb), at most 2 * 128 * 127 a 16-bit sum of vpmaddubsw,
   so each is widened by vpmaddwd at once */
ALWAYS_INLINE __m256i q8_0_half_dot(const __m256i *w, const __m256i *wabs, const int8_t *a) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i dot = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const __m256i signed_x = _mm256_sign_epi8(broadcast4(a + 4 * j), w[j]);
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[j], signed_x), ones));
        KEEP_SUM(dot);
    }
    return dot;
}

/* Half h's features (8h on) of a block of Q4's quants (Q4_1's, Q4_K's; Q5's low four
   bits) as their unsigned weights 4j + b in w[j]: the low nibbles, then the high ones */
ALWAYS_INLINE void unpack_nibbles(const uint8_t *q, int h, __m256i w[8]) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(q + 64 * j + 32 * h));
        w[j] = _mm256_and_si256(packed, low);
        w[4 + j] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    }
}

/* Half h's features (8h on) of a block of Q5's quants (Q5_0's, Q5_1's, Q5_K's) as
   their unsigned weights 4j + b in w[j]: the nibbles, the fifth bits or-ed in */
ALWAYS_INLINE void unpack_five_bits(const uint8_t *q, int h, __m256i w[8]) {
    unpack_nibbles(q, h, w);
    const __m256i fifth = _mm256_loadu_si256((const __m256i *)(q + 256 + 32 * h));
    for (int j = 0; j < 8; j++) {
        /* bit j of each byte to bit 4 (see the AVX-512 code) */
        const __m256i bit = _mm256_and_si256(fifth, _mm256_set1_epi8((char)(1 << j)));
        const __m256i sixteen = j < 4 ? _mm256_slli_epi16(bit, 4 - j) : _mm256_srli_epi16(bit, j - 4);
        w[j] = _mm256_or_si256(w[j], sixteen);
    }
}

/* 16-bit sums widened by vpmaddwd times times (each 32-bit lane's 16-bit factor, the
   same in both halves), added to dot where add, else in its place */
ALWAYS_INLINE __m256i widened(__m256i dot, __m256i sums, __m256i times, int add) {
    const __m256i wide = _mm256_madd_epi16(sums, times);
    return add ? _mm256_add_epi32(dot, wide) : wide;
}

/* Rows at a time of nibble_rows_times (Q4_1's and Q4_K's tiles): their 16-bit sums
   (two a row) stay in registers beside four weight vectors and x's two broadcasts */
#define NIBBLE_ROWS 4

/* A block of Q4_1's quants q (both halves, 16 features) times count (at most
   NIBBLE_ROWS) rows of x's steps a (row r at a + r * k): vpmaddubsw multiplies the
   unsigned weights by signed x bytes into 16-bit sums of two products, 8 of them added
   up as 16-bit sums (at most 8 * 2 * 15 * 127), widened by vpmaddwd times (each 32-bit
   lane's 16-bit factor, the same in both halves: 1 for the plain dot, a K-quant block's
   scale; exact, at most 63 times a sum) into dots[r][h] (widened). Each weight vector is
   loaded and unpacked once for the rows and each broadcast of x multiplies both halves'
   weights: 0.83-0.87x the time of a half at a time (a 1.2B gate_up, 8 and 64 rows, AVX2
   code on a Zen 4) */
ALWAYS_INLINE void nibble_rows_times(const uint8_t *q, const int8_t *a, int64_t k, int count,
                                     const __m256i times[2], int add, __m256i dots[][2]) {
    const __m256i low = _mm256_set1_epi8(15);
    __m256i sums[NIBBLE_ROWS][2];
    for (int j = 0; j < 4; j++) {
        const __m256i packed0 = _mm256_loadu_si256((const __m256i *)(q + 64 * j));
        const __m256i packed1 = _mm256_loadu_si256((const __m256i *)(q + 64 * j + 32));
        const __m256i lo0 = _mm256_and_si256(packed0, low), lo1 = _mm256_and_si256(packed1, low);
        const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(packed0, 4), low);
        const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(packed1, 4), low);
        for (int r = 0; r < count; r++) {
            const __m256i first = broadcast4(a + r * k + 4 * j), second = broadcast4(a + r * k + 16 + 4 * j);
            const __m256i half0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, first), _mm256_maddubs_epi16(hi0, second));
            const __m256i half1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, first), _mm256_maddubs_epi16(hi1, second));
            sums[r][0] = j == 0 ? half0 : _mm256_add_epi16(sums[r][0], half0);
            sums[r][1] = j == 0 ? half1 : _mm256_add_epi16(sums[r][1], half1);
            KEEP_SUM(sums[r][0]);
            KEEP_SUM(sums[r][1]);
        }
    }
    for (int r = 0; r < count; r++)
        for (int h = 0; h < 2; h++)
            dots[r][h] = widened(dots[r][h], sums[r][h], times[h], add);
}

/* Row a's block times both halves' Q4 weights w[h][j] (unpack_nibbles' order, unpacked
   once for every row): per half one 16-bit sum of 8 vpmaddubsw (at most
   8 * 2 * 15 * 127), widened by vpmaddwd times times[h] into dot[h] (as
   nibble_rows_times') */
ALWAYS_INLINE void nibble_row_times(const __m256i w[2][8], const int8_t *a, const __m256i times[2], int add,
                                    __m256i dot[2]) {
    __m256i sums[2];
    for (int j = 0; j < 4; j++) {
        const __m256i first = broadcast4(a + 4 * j), second = broadcast4(a + 16 + 4 * j);
        for (int h = 0; h < 2; h++) {
            const __m256i pair =
                _mm256_add_epi16(_mm256_maddubs_epi16(w[h][j], first), _mm256_maddubs_epi16(w[h][4 + j], second));
            sums[h] = j == 0 ? pair : _mm256_add_epi16(sums[h], pair);
            KEEP_SUM(sums[h]);
        }
    }
    for (int h = 0; h < 2; h++) dot[h] = widened(dot[h], sums[h], times[h], add);
}

/* A block of Q4's quants q times rows rows of x's steps (a at row 0, row r at a + r * k),
   into dots (widened). Up to TILE_ROWS rows, NIBBLE_ROWS at a time in registers
   (nibble_rows_times); more (AVX2's wide calls, row_step), the block's weights unpacked
   once (they live on the stack: 16 registers hold no row's sums beside them) and each
   row's sums made from them (nibble_row_times): at 64 rows 0.85-0.89x the time of four
   rows at a time, which unpacks the weights 16 times (a 1.2B gate_up, Q4_K and Q4_1,
   AVX2 code on a Zen 4), but 1.25-1.3x at 1 and 4 rows */
ALWAYS_INLINE void nibble_block_times(const uint8_t *q, const int8_t *a, int64_t k, int64_t rows,
                                      const __m256i times[2], int add, __m256i dots[][2]) {
    if (rows > TILE_ROWS) {
        __m256i w[2][8];
        for (int h = 0; h < 2; h++) unpack_nibbles(q, h, w[h]);
        for (int64_t r = 0; r < rows; r++) nibble_row_times(w, a + r * k, times, add, dots[r]);
        return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += NIBBLE_ROWS)
        nibble_rows_times(q, a + r0 * k, k, rows - r0 < NIBBLE_ROWS ? (int)(rows - r0) : NIBBLE_ROWS, times,
                          add, dots + r0);
}

/* Row a's block times both halves' Q5 weights w[h][j] (q in [0, 31], unpacked once
   for all rows), each broadcast of x used by both halves: per half two 16-bit sums of
   4 vpmaddubsw each (at most 4 * 2 * 31 * 127), widened by vpmaddwd times times[h] as
   nibble_rows_times' */
ALWAYS_INLINE void five_bit_row(const __m256i w[2][8], const int8_t *a, const __m256i times[2], __m256i dot[2]) {
    __m256i first[2], second[2];
    for (int j = 0; j < 4; j++) {
        const __m256i low = broadcast4(a + 4 * j), high = broadcast4(a + 16 + 4 * j);
        for (int h = 0; h < 2; h++) {
            const __m256i f = _mm256_maddubs_epi16(w[h][j], low), s = _mm256_maddubs_epi16(w[h][4 + j], high);
            first[h] = j == 0 ? f : _mm256_add_epi16(first[h], f);
            second[h] = j == 0 ? s : _mm256_add_epi16(second[h], s);
            KEEP_SUM(first[h]);
            KEEP_SUM(second[h]);
        }
    }
    for (int h = 0; h < 2; h++)
        dot[h] = _mm256_add_epi32(_mm256_madd_epi16(first[h], times[h]), _mm256_madd_epi16(second[h], times[h]));
}

/* A block's integer dots for every row first (Q4_1: nibble_block_times; Q5: both
   halves' weights unpacked once; Q8_0: a half's 8 registers of weights at a time),
   then each row's floats. */
ALWAYS_INLINE void interleaved_tile(int64_t kind, const uint8_t *q, const void *scales,
                                    const void *extra, const TileRows *x, int64_t k,
                                    int64_t groups, int64_t rows, float *y, int64_t n) {
    __m256 acc[WIDE_ROWS][2];
    for (int64_t r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int64_t bytes = tile_bytes(kind);
    const int with_mins = has_mins(kind);
    const __m256i ones[2] = {_mm256_set1_epi16(1), _mm256_set1_epi16(1)};
    for (int64_t g = 0; g < groups; g++, q += bytes) {
        prefetch_ahead(q, bytes);
        __m256i dots[WIDE_ROWS][2];
        if (kind == KIND_Q4_1) {
            nibble_block_times(q, x->xq + g * BLOCK, k, rows, ones, 0, dots);
        } else if (kind == KIND_Q8_0) {
            for (int h = 0; h < 2; h++) {
                __m256i w[8], wabs[8]; /* features 8h on, bytes 4j on */
                for (int j = 0; j < 8; j++) {
                    w[j] = _mm256_loadu_si256((const __m256i *)(q + 64 * j + 32 * h));
                    wabs[j] = _mm256_abs_epi8(w[j]);
                }
                for (int64_t r = 0; r < rows; r++) dots[r][h] = q8_0_half_dot(w, wabs, x->xq + r * k + g * BLOCK);
            }
        } else {
            __m256i w[2][8];
            for (int h = 0; h < 2; h++) unpack_five_bits(q, h, w[h]);
            for (int64_t r = 0; r < rows; r++) {
                five_bit_row(w, x->xq + r * k + g * BLOCK, ones, dots[r]);
                if (kind == KIND_Q5_0) {
                    const __m256i offset = _mm256_set1_epi32(q5_0_offset(x, groups, r, g));
                    for (int h = 0; h < 2; h++) dots[r][h] = _mm256_sub_epi32(dots[r][h], offset);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const int64_t at = g * FEATURES + 8 * h;
            const __m256 scale = halves_floats((const uint16_t *)scales + at);
            const __m256 min = with_mins ? halves_floats((const uint16_t *)extra + at) : _mm256_setzero_ps();
            for (int64_t r = 0; r < rows; r++) {
                const __m256 part =
                    _mm256_mul_ps(_mm256_cvtepi32_ps(dots[r][h]), _mm256_set1_ps(x->xscales[r * groups + g]));
                acc[r][h] = _mm256_fmadd_ps(part, scale, acc[r][h]);
                if (with_mins)
                    acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(x->xsums[r * groups + g]), min, acc[r][h]);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        _mm256_storeu_ps(y + r * n, acc[r][0]);
        _mm256_storeu_ps(y + r * n + 8, acc[r][1]);
    }
}

/* Q4_K's and Q5_K's tile, the AVX-512 code's sums per half of 8 features: the scales
   multiply the 16-bit sums as vpmaddwd widens them (nibble_rows_times, five_bit_row:
   no vpmulld), and
   vpmaddwd makes the mins' pairs at the super-block's end */
ALWAYS_INLINE void k_quant_tile(int64_t kind, const uint8_t *q, const uint8_t *scales,
                                const uint16_t *supers, const TileRows *x, int64_t k,
                                int64_t groups, int64_t rows, float *y, int64_t n) {
    __m256 acc[WIDE_ROWS][2];
    __m256i dots[WIDE_ROWS][2];
    for (int64_t r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++) {
            acc[r][h] = _mm256_setzero_ps();
            dots[r][h] = _mm256_setzero_si256();
        }
    const int64_t bytes = tile_bytes(kind);
    uint8_t unpacked[SUPER_BLOCKS * 2 * FEATURES];
    for (int64_t g = 0; g < groups; g++, q += bytes) {
        prefetch_ahead(q, bytes);
        if (g % SUPER_BLOCKS == 0) unpack_k_scales(scales + g / SUPER_BLOCKS * K_SCALE_BYTES, unpacked);
        const int end = g % SUPER_BLOCKS == SUPER_BLOCKS - 1;
        const int64_t g0 = g + 1 - SUPER_BLOCKS;
        __m256i scale_pairs[2];
        for (int h = 0; h < 2; h++) {
            const uint8_t *sc = unpacked + g % SUPER_BLOCKS * 2 * FEATURES + 8 * h;
            const __m256i scale = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc));
            scale_pairs[h] = pairs16(scale, scale);
        }
        if (kind == KIND_Q4_K) {
            nibble_block_times(q, x->xq + g * BLOCK, k, rows, scale_pairs, 1, dots);
        } else {
            __m256i w[2][8];
            for (int h = 0; h < 2; h++) unpack_five_bits(q, h, w[h]);
            for (int64_t r = 0; r < rows; r++) {
                __m256i dot[2];
                five_bit_row(w, x->xq + r * k + g * BLOCK, scale_pairs, dot);
                for (int h = 0; h < 2; h++) dots[r][h] = _mm256_add_epi32(dots[r][h], dot[h]);
            }
        }
        if (!end) continue;
        for (int h = 0; h < 2; h++) {
            __m256i min_pairs[SUPER_BLOCKS / 2]; /* as the AVX-512 code's */
            for (int i = 0; i < SUPER_BLOCKS / 2; i++) {
                const uint8_t *m = unpacked + 2 * i * 2 * FEATURES + FEATURES + 8 * h;
                const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m));
                const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(m + 2 * FEATURES)));
                min_pairs[i] = pairs16(first, second);
            }
            const uint16_t *super = supers + g / SUPER_BLOCKS * 2 * FEATURES + 8 * h;
            const __m256 d = halves_floats(super), neg_dmin = halves_floats(super + FEATURES);
            for (int64_t r = 0; r < rows; r++) {
                const int32_t *pairs = x->xpairsums + (r * groups + g0) / 2;
                __m256i mins = _mm256_setzero_si256();
                for (int i = 0; i < SUPER_BLOCKS / 2; i++)
                    mins = _mm256_add_epi32(mins, _mm256_madd_epi16(min_pairs[i], _mm256_set1_epi32(pairs[i])));
                const __m256 step = _mm256_set1_ps(x->xscales[r * groups + g]);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r][h]), _mm256_mul_ps(d, step), acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(neg_dmin, step), acc[r][h]);
                dots[r][h] = _mm256_setzero_si256();
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        _mm256_storeu_ps(y + r * n, acc[r][0]);
        _mm256_storeu_ps(y + r * n + 8, acc[r][1]);
    }
}
#else
#define INTERLEAVED_VECTORIZED 0

/* Feature f's integer dot of a block of Q4_1's or Q5's quants t and x's steps a */
static inline int32_t tile_nibble_dot(int64_t kind, const uint8_t *t, int f, const int8_t *a) {
    int32_t dot = 0;
    for (int j = 0; j < 4; j++)
        for (int b = 0; b < 4; b++) {
            const uint8_t byte = t[(j * FEATURES + f) * 4 + b];
            /* Q5: the fifth bits of weights 4j + b and 16 + 4j + b */
            const uint8_t fifth = quant_kind(kind) == KIND_Q4_1 ? 0 : t[(4 * FEATURES + f) * 4 + b];
            const int low = (byte & 15) | ((fifth >> j) & 1) << 4;
            const int high = (byte >> 4) | ((fifth >> (4 + j)) & 1) << 4;
            dot += low * a[4 * j + b] + high * a[16 + 4 * j + b];
        }
    return dot;
}

ALWAYS_INLINE void interleaved_tile(int64_t kind, const uint8_t *q, const void *scales,
                                    const void *extra, const TileRows *x, int64_t k,
                                    int64_t groups, int64_t rows, float *y, int64_t n) {
    const int64_t bytes = tile_bytes(kind);
    for (int64_t r = 0; r < rows; r++)
        for (int f = 0; f < FEATURES; f++) {
            float acc = 0.f;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *t = q + g * bytes;
                const int8_t *a = x->xq + r * k + g * BLOCK;
                int32_t dot = 0;
                if (kind == KIND_Q8_0) {
                    for (int j = 0; j < 8; j++)
                        for (int b = 0; b < 4; b++)
                            dot += (int8_t)t[(j * FEATURES + f) * 4 + b] * a[4 * j + b];
                } else {
                    dot = tile_nibble_dot(kind, t, f, a);
                    if (kind == KIND_Q5_0) dot -= q5_0_offset(x, groups, r, g);
                }
                const float part = (float)dot * x->xscales[r * groups + g];
                acc = fmaf(part, half_to_float(((const uint16_t *)scales)[g * FEATURES + f]), acc);
                if (has_mins(kind))
                    acc = fmaf(x->xsums[r * groups + g], half_to_float(((const uint16_t *)extra)[g * FEATURES + f]),
                               acc);
            }
            y[r * n + f] = acc;
        }
}

ALWAYS_INLINE void k_quant_tile(int64_t kind, const uint8_t *q, const uint8_t *scales,
                                const uint16_t *supers, const TileRows *x, int64_t k,
                                int64_t groups, int64_t rows, float *y, int64_t n) {
    const int64_t bytes = tile_bytes(kind);
    for (int64_t r = 0; r < rows; r++)
        for (int f = 0; f < FEATURES; f++) {
            float acc = 0.f;
            int32_t dots = 0, mins = 0;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *packed = scales + g / SUPER_BLOCKS * K_SCALE_BYTES;
                const int j = (int)(g % SUPER_BLOCKS);
                dots += tile_nibble_dot(kind, q + g * bytes, f, x->xq + r * k + g * BLOCK) *
                        k_scale_at(packed, j, f);
                mins += block_steps_sum(x, groups, r, g) * k_scale_at(packed, j, FEATURES + f);
                if (g % SUPER_BLOCKS == SUPER_BLOCKS - 1) {
                    const uint16_t *super = supers + g / SUPER_BLOCKS * 2 * FEATURES;
                    const float step = x->xscales[r * groups + g];
                    acc = fmaf((float)dots, half_to_float(super[f]) * step, acc);
                    acc = fmaf((float)mins, half_to_float(super[FEATURES + f]) * step, acc);
                    dots = mins = 0;
                }
            }
            y[r * n + f] = acc;
        }
}
#endif

/* Q6_K's tile: the same arithmetic in the AVX-512 VNNI code, the AVX2 code and the
   portable C. */
#if INTERLEAVED_VECTORIZED == 2
/* A block of Q6_K's quants as each feature's weights 4j + b in w[j] (unpack_nibbles'
   order), q in [0, 63] unsigned as vpdpbusd takes them: the nibbles, and bits 4 and 5
   from the high lanes (16-bit shifts move bits across bytes, which the mask drops) */
ALWAYS_INLINE void unpack_q6(const uint8_t *q, __m512i w[8]) {
    const __m512i low = _mm512_set1_epi8(15), high = _mm512_set1_epi8(0x30);
    const __m512i bits[2] = {_mm512_loadu_si512((const void *)(q + 256)),
                             _mm512_loadu_si512((const void *)(q + 320))};
    for (int j = 0; j < 4; j++) {
        const __m512i packed = _mm512_loadu_si512((const void *)(q + 64 * j));
        const __m512i nibbles[2] = {_mm512_and_si512(packed, low),
                                    _mm512_and_si512(_mm512_srli_epi16(packed, 4), low)};
        for (int part = 0; part < 2; part++) {
            const __m512i top = j < 2 ? _mm512_slli_epi16(bits[part], 4 - 2 * j)
                                      : _mm512_srli_epi16(bits[part], 2 * j - 4);
            w[4 * part + j] = _mm512_or_si512(nibbles[part], _mm512_and_si512(top, high));
        }
    }
}

/* Each half block's sum q . x (at most 16 * 63 * 127) less 32 times the sum of its x
   steps is (q - 32) . x; times its int8 scale (vpmulld: at most 16 * 32 * 127 * 128
   each) the two add up to the portable code's integer. */
ALWAYS_INLINE void q6_k_tile(const uint8_t *q, const int8_t *scales, const uint16_t *supers,
                             const TileRows *x, int64_t k, int64_t groups, int64_t rows,
                             float *y, int64_t n) {
    __m512 acc[TILE_ROWS];
    __m512i dots[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) acc[r] = _mm512_setzero_ps(), dots[r] = _mm512_setzero_si512();
    __m512 d = _mm512_setzero_ps(); /* the super-block's, made once */
    for (int64_t g = 0; g < groups; g++, q += FEATURES * 4 * 6) {
        prefetch_ahead(q, FEATURES * 4 * 6);
        if (g % SUPER_BLOCKS == 0) d = halves_floats(supers + g / SUPER_BLOCKS * FEATURES);
        __m512i w[8];
        unpack_q6(q, w);
        const int8_t *sc = scales + g * 2 * FEATURES;
        const __m512i first_scale = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc));
        const __m512i second_scale =
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + FEATURES)));
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *a = (const uint8_t *)(x->xq + r * k + g * BLOCK);
            const int32_t *halves = x->xhalfsums + (r * groups + g) * 2;
            __m512i sums[2];
            for (int part = 0; part < 2; part++) {
                __m512i sum = _mm512_set1_epi32(-32 * halves[part]);
                for (int j = 0; j < 4; j++)
                    sum = _mm512_dpbusd_epi32(sum, w[4 * part + j], broadcast4(a + 16 * part + 4 * j));
                sums[part] = sum;
            }
            dots[r] = _mm512_add_epi32(dots[r], _mm512_add_epi32(_mm512_mullo_epi32(sums[0], first_scale),
                                                                 _mm512_mullo_epi32(sums[1], second_scale)));
            if (g % SUPER_BLOCKS == SUPER_BLOCKS - 1) {
                acc[r] = super_scaled(dots[r], d, x, groups, r, g, acc[r]);
                dots[r] = _mm512_setzero_si512();
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(y + r * n, acc[r]);
}
#elif INTERLEAVED_VECTORIZED == 1
/* 8 features' int8 scales, widened to 32 bits */
static inline __m256i q6_scales(const int8_t *sc) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc));
}

/* A row of x's steps a times a block's weights w (both halves' q in [0, 63], unpacked
   once for all rows), added to dots[h]: each 16-bit sum of two vpmaddubsw (at most
   4 * 63 * 127) widened and scaled by vpmaddwd, less 32 times both half blocks' step
   sums (halves) times their scales (offsets, one more vpmaddwd: each sum within
   16 * 127), so that a half block's q . x less 32 times its steps' sum is (q - 32) . x.
   Each broadcast of x multiplies both halves' weights (0.90-0.92x the time of a tile
   that broadcast it for each half). The integers are the portable code's. */
ALWAYS_INLINE void q6_row(const __m256i w[2][8], const __m256i scale[2][2], const __m256i offsets[2],
                          const int8_t *a, const int32_t *halves, __m256i dots[2]) {
    const __m256i both = _mm256_set1_epi32((int32_t)((uint32_t)(uint16_t)halves[0] | (uint32_t)(uint16_t)halves[1] << 16));
    __m256i dot[2];
    for (int h = 0; h < 2; h++) dot[h] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(offsets[h], both));
    for (int i = 0; i < 8; i += 2) {
        const __m256i first = broadcast4(a + 4 * i), second = broadcast4(a + 4 * i + 4);
        for (int h = 0; h < 2; h++) {
            const __m256i sum = _mm256_add_epi16(_mm256_maddubs_epi16(w[h][i], first),
                                                 _mm256_maddubs_epi16(w[h][i + 1], second));
            dot[h] = _mm256_add_epi32(dot[h], _mm256_madd_epi16(sum, scale[h][i / 4]));
        }
        KEEP_SUM(dot[0]);
        KEEP_SUM(dot[1]);
    }
    for (int h = 0; h < 2; h++) dots[h] = _mm256_add_epi32(dots[h], dot[h]);
}

/* q6_row for a wide call: x + 128 (a, unsigned) times the weights q - 32 (signed, in
   [-32, 31]; each 16-bit sum of two vpmaddubsw within 4 * 255 * 32), so that no row
   takes its steps' sums out: 128 times sum(sc * (q - 32)), the same for every row, is
   taken out once a super-block (q6_k_tile). The integers are q6_row's. */
ALWAYS_INLINE void q6_row_unsigned_x(const __m256i w[2][8], const __m256i scale[2][2], const uint8_t *a,
                                     __m256i dots[2]) {
    __m256i dot[2] = {dots[0], dots[1]};
    for (int i = 0; i < 8; i += 2) {
        const __m256i first = broadcast4((const int8_t *)a + 4 * i);
        const __m256i second = broadcast4((const int8_t *)a + 4 * i + 4);
        for (int h = 0; h < 2; h++) {
            const __m256i sum = _mm256_add_epi16(_mm256_maddubs_epi16(first, w[h][i]),
                                                 _mm256_maddubs_epi16(second, w[h][i + 1]));
            dot[h] = _mm256_add_epi32(dot[h], _mm256_madd_epi16(sum, scale[h][i / 4]));
        }
        KEEP_SUM(dot[0]);
        KEEP_SUM(dot[1]);
    }
    for (int h = 0; h < 2; h++) dots[h] = dot[h];
}

/* A wide call's weights q - 32 in place of q (w), and 128 times the block's
   sum(sc * (q - 32)) per feature added to added (what x + 128 adds to the rows' dots) */
ALWAYS_INLINE void q6_signed(__m256i w[2][8], const __m256i scale[2][2], __m256i added[2]) {
    const __m256i thirty_two = _mm256_set1_epi8(32), ones = _mm256_set1_epi8(1);
    for (int h = 0; h < 2; h++) {
        __m256i scaled[2];
        for (int part = 0; part < 2; part++) { /* weights 0-15 (sc0), then 16-31 (sc1) */
            __m256i sum = _mm256_setzero_si256();
            for (int j = 4 * part; j < 4 * part + 4; j++) {
                w[h][j] = _mm256_sub_epi8(w[h][j], thirty_two);
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(ones, w[h][j]));
            }
            scaled[part] = _mm256_madd_epi16(sum, scale[h][part]);
        }
        added[h] = _mm256_add_epi32(added[h], _mm256_slli_epi32(_mm256_add_epi32(scaled[0], scaled[1]), 7));
    }
}

/* Q6_K's tile: each block's weights, both halves, unpacked once (lane j's q in [0, 63],
   unsigned as vpmaddubsw takes them: the nibbles, and bits 4 and 5 from the high lanes;
   16-bit shifts move bits across bytes, which the mask drops), then every row's
   product (q6_row; past TILE_ROWS rows q6_row_unsigned_x, at 64 rows 0.85x the time, 16
   rows 0.91x: a 1.2B's down projection, AVX2 code on a Zen 4) */
ALWAYS_INLINE void q6_k_tile(const uint8_t *q, const int8_t *scales, const uint16_t *supers,
                             const TileRows *x, int64_t k, int64_t groups, int64_t rows,
                             float *y, int64_t n) {
    __m256 acc[WIDE_ROWS][2];
    __m256i dots[WIDE_ROWS][2];
    for (int64_t r = 0; r < rows; r++) {
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        dots[r][0] = dots[r][1] = _mm256_setzero_si256();
    }
    const __m256i low = _mm256_set1_epi8(15), high = _mm256_set1_epi8(0x30);
    __m256 d[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; /* the super-block's, made once */
    __m256i added[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}; /* q6_signed's */
    for (int64_t g = 0; g < groups; g++, q += FEATURES * 4 * 6) {
        prefetch_ahead(q, FEATURES * 4 * 6);
        __m256i w[2][8], scale[2][2], offsets[2];
        for (int h = 0; h < 2; h++) {
            if (g % SUPER_BLOCKS == 0) d[h] = halves_floats(supers + g / SUPER_BLOCKS * FEATURES + 8 * h);
            const __m256i bits[2] = {_mm256_loadu_si256((const __m256i *)(q + 256 + 32 * h)),
                                     _mm256_loadu_si256((const __m256i *)(q + 320 + 32 * h))};
            for (int j = 0; j < 4; j++) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(q + 64 * j + 32 * h));
                const __m256i nibbles[2] = {_mm256_and_si256(packed, low),
                                            _mm256_and_si256(_mm256_srli_epi16(packed, 4), low)};
                for (int part = 0; part < 2; part++) {
                    const __m256i top = j < 2 ? _mm256_slli_epi16(bits[part], 4 - 2 * j)
                                              : _mm256_srli_epi16(bits[part], 2 * j - 4);
                    w[h][4 * part + j] = _mm256_or_si256(nibbles[part], _mm256_and_si256(top, high));
                }
            }
            const int8_t *sc = scales + g * 2 * FEATURES + 8 * h;
            const __m256i first = q6_scales(sc), second = q6_scales(sc + FEATURES);
            scale[h][0] = pairs16(first, first);
            scale[h][1] = pairs16(second, second);
            /* 32 times both half blocks' scales (each within 32 * 128), the first's low */
            offsets[h] = pairs16(_mm256_slli_epi32(first, 5), _mm256_slli_epi32(second, 5));
        }
        if (rows > TILE_ROWS) {
            if (g % SUPER_BLOCKS == 0) added[0] = added[1] = _mm256_setzero_si256();
            q6_signed(w, scale, added);
            for (int64_t r = 0; r < rows; r++) q6_row_unsigned_x(w, scale, x->xu + r * k + g * BLOCK, dots[r]);
        } else {
            for (int64_t r = 0; r < rows; r++)
                q6_row(w, scale, offsets, x->xq + r * k + g * BLOCK, x->xhalfsums + (r * groups + g) * 2, dots[r]);
        }
        if (g % SUPER_BLOCKS != SUPER_BLOCKS - 1) continue;
        for (int64_t r = 0; r < rows; r++) {
            const __m256 step = _mm256_set1_ps(x->xscales[r * groups + g]);
            for (int h = 0; h < 2; h++) {
                if (rows > TILE_ROWS) dots[r][h] = _mm256_sub_epi32(dots[r][h], added[h]);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r][h]), _mm256_mul_ps(d[h], step), acc[r][h]);
                dots[r][h] = _mm256_setzero_si256();
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        _mm256_storeu_ps(y + r * n, acc[r][0]);
        _mm256_storeu_ps(y + r * n + 8, acc[r][1]);
    }
}
#else
ALWAYS_INLINE void q6_k_tile(const uint8_t *q, const int8_t *scales, const uint16_t *supers,
                             const TileRows *x, int64_t k, int64_t groups, int64_t rows,
                             float *y, int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        for (int f = 0; f < FEATURES; f++) {
            float acc = 0.f;
            int32_t super_dot = 0;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *t = q + g * FEATURES * 4 * 6;
                const int8_t *a = x->xq + r * k + g * BLOCK;
                int32_t dots[2] = {0, 0};
                for (int part = 0; part < 2; part++)
                    for (int j = 0; j < 4; j++)
                        for (int b = 0; b < 4; b++) {
                            const uint8_t byte = t[(j * FEATURES + f) * 4 + b];
                            const uint8_t top = t[((4 + part) * FEATURES + f) * 4 + b];
                            const int nibble = part ? byte >> 4 : byte & 15;
                            const int value = nibble | ((top >> (2 * j)) & 3) << 4;
                            dots[part] += (value - 32) * a[16 * part + 4 * j + b];
                        }
                const int8_t *sc = scales + g * 2 * FEATURES;
                super_dot += dots[0] * sc[f] + dots[1] * sc[FEATURES + f];
                if (g % SUPER_BLOCKS == SUPER_BLOCKS - 1) {
                    const float d = half_to_float(supers[g / SUPER_BLOCKS * FEATURES + f]);
                    acc = fmaf((float)super_dot, d * x->xscales[r * groups + g], acc);
                    super_dot = 0;
                }
            }
            y[r * n + f] = acc;
        }
}
#endif

/* AMX (a CPU with AMX-TILE and AMX-INT8; or the tests' emulation, amx_tiles.h): a call
   of more than TILE_ROWS rows takes up to AMX_ROWS rows a tile. A block's weights,
   unpacked once to signed bytes (Q5_0's q - 16, Q6_K's q - 32, Q4's and Q5's q: each
   within int8), are TDPBSSD's second operand as the interleaved layout holds them (row
   j: the strip's 16 features' weights 4j + b; Q8_0's quants are loaded as they are),
   x's steps of the block its first, one row each: the product is every row's integer
   dot q . xq of the block, the vector tiles' integers. The AVX-512 code then scales
   and sums them as the vector tiles do, the same float operations in the same order:
   the same bits. Up to SUPER_BLOCKS blocks at a time (a K-quant's super-block): their
   products to memory, then each row's sums over them. Q6_K's half blocks, each with
   its own scale, take a product each. */
#if INTERLEAVED_VECTORIZED == 2 && \
    ((defined(__AMX_TILE__) && defined(__AMX_INT8__)) || defined(CARPOOL_AMX_EMULATED))
#define INTERLEAVED_AMX 1
#include "amx_tiles.h"

#define AMX_ROWS AMX_MAX_ROWS
/* Tile registers: a block's products (Q6_K's first half's), x's steps, the weights;
   Q6_K's second half's products, and each half's x steps and weights */
#define TILE_DOTS 0
#define TILE_X 1
#define TILE_W 2
#define TILE_SECOND_DOTS 3
#define TILE_HALF_X 4
#define TILE_HALF_W 5
#define TILE_SECOND_X 6
#define TILE_SECOND_W 7

/* The row count the calling thread's tiles are shaped for (0: none) */
static __thread int64_t amx_shaped_rows;

/* The tiles shaped for rows rows (1 to AMX_ROWS), unless they are */
static inline void amx_shape_for(int64_t rows) {
    if (amx_shaped_rows == rows) return;
    AmxConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    amx_shape(&config, TILE_DOTS, rows, FEATURES * 4);
    amx_shape(&config, TILE_X, rows, BLOCK);
    amx_shape(&config, TILE_W, BLOCK / 4, FEATURES * 4);
    amx_shape(&config, TILE_SECOND_DOTS, rows, FEATURES * 4);
    for (int t = TILE_HALF_X; t <= TILE_SECOND_X; t += 2) {
        amx_shape(&config, t, rows, BLOCK / 2);
        amx_shape(&config, t + 1, BLOCK / 8, FEATURES * 4);
    }
    amx_load_config(&config);
    amx_shaped_rows = rows;
}

/* The calling thread's tiles given back (at the end of a call that used them) */
static inline void amx_done(void) {
    if (amx_shaped_rows == 0) return;
    amx_release();
    amx_shaped_rows = 0;
}

/* Products of up to SUPER_BLOCKS blocks: [block][half (Q6_K's; else the first)][row][feature] */
typedef int32_t AmxDots[SUPER_BLOCKS][2][AMX_ROWS][FEATURES];

/* Block g's products, for the rows the tiles are shaped for, into dots */
ALWAYS_INLINE void amx_block_dots(int64_t kind, const uint8_t *q, const TileRows *x, int64_t k, int64_t g,
                                  int32_t dots[2][AMX_ROWS][FEATURES]) {
    int8_t w[BLOCK / 4][FEATURES * 4] __attribute__((aligned(64)));
    if (kind != KIND_Q8_0) {
        __m512i v[8];
        if (kind == KIND_Q6_K)
            unpack_q6(q, v);
        else
            unpack_nibbles(kind, q, v);
        const __m512i offset = _mm512_set1_epi8(kind == KIND_Q6_K ? 32 : kind == KIND_Q5_0 ? 16 : 0);
        for (int j = 0; j < 8; j++) _mm512_store_si512((void *)w[j], _mm512_sub_epi8(v[j], offset));
    }
    const int8_t *a = x->xq + g * BLOCK;
    if (kind == KIND_Q6_K) {
        AMX_ZERO(TILE_DOTS);
        AMX_ZERO(TILE_SECOND_DOTS);
        AMX_LOAD(TILE_HALF_X, a, k);
        AMX_LOAD(TILE_HALF_W, w[0], FEATURES * 4);
        AMX_LOAD(TILE_SECOND_X, a + BLOCK / 2, k);
        AMX_LOAD(TILE_SECOND_W, w[BLOCK / 8], FEATURES * 4);
        AMX_DPBSSD(TILE_DOTS, TILE_HALF_X, TILE_HALF_W);
        AMX_DPBSSD(TILE_SECOND_DOTS, TILE_SECOND_X, TILE_SECOND_W);
        AMX_STORE(TILE_DOTS, dots[0], FEATURES * 4);
        AMX_STORE(TILE_SECOND_DOTS, dots[1], FEATURES * 4);
        return;
    }
    AMX_ZERO(TILE_DOTS);
    AMX_LOAD(TILE_X, a, k);
    if (kind == KIND_Q8_0)
        AMX_LOAD(TILE_W, q, FEATURES * 4);
    else
        AMX_LOAD(TILE_W, w, FEATURES * 4);
    AMX_DPBSSD(TILE_DOTS, TILE_X, TILE_W);
    AMX_STORE(TILE_DOTS, dots[0], FEATURES * 4);
}

/* Blocks g0 to g0 + count - 1 of Q4_1, Q8_0, Q5_1 or Q5_0 added to each row's acc
   (interleaved_tile's arithmetic) */
ALWAYS_INLINE void amx_block_sums(int64_t kind, const void *scales, const void *extra, const TileRows *x,
                                  int64_t groups, int64_t g0, int64_t count, int64_t rows, AmxDots dots,
                                  __m512 *acc) {
    const int with_mins = has_mins(kind);
    __m512 scale[SUPER_BLOCKS], min[SUPER_BLOCKS];
    for (int64_t b = 0; b < count; b++) {
        scale[b] = halves_floats((const uint16_t *)scales + (g0 + b) * FEATURES);
        min[b] = with_mins ? halves_floats((const uint16_t *)extra + (g0 + b) * FEATURES)
                           : _mm512_setzero_ps();
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < count; b++) {
            const __m512i dot = _mm512_load_si512((const void *)dots[b][0][r]);
            acc[r] = block_scaled(dot, x, groups, r, g0 + b, scale[b], min[b], with_mins, acc[r]);
        }
}

/* The super-block of Q4_K or Q5_K from block g0 added to each row's acc (k_quant_tile's
   arithmetic) */
ALWAYS_INLINE void amx_k_quant_sums(const uint8_t *scales, const uint16_t *supers, const TileRows *x,
                                    int64_t groups, int64_t g0, int64_t rows, AmxDots dots, __m512 *acc) {
    uint8_t unpacked[SUPER_BLOCKS * 2 * FEATURES];
    unpack_k_scales(scales + g0 / SUPER_BLOCKS * K_SCALE_BYTES, unpacked);
    __m512i scale[SUPER_BLOCKS], min_pairs[SUPER_BLOCKS / 2];
    for (int b = 0; b < SUPER_BLOCKS; b++)
        scale[b] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(unpacked + b * 2 * FEATURES)));
    k_min_pairs(unpacked, min_pairs);
    const uint16_t *super = supers + g0 / SUPER_BLOCKS * 2 * FEATURES;
    const __m512 d = halves_floats(super), neg_dmin = halves_floats(super + FEATURES);
    for (int64_t r = 0; r < rows; r++) {
        __m512i sum = _mm512_setzero_si512();
        for (int b = 0; b < SUPER_BLOCKS; b++)
            sum = _mm512_add_epi32(
                sum, _mm512_mullo_epi32(_mm512_load_si512((const void *)dots[b][0][r]), scale[b]));
        acc[r] = k_quant_super(sum, min_pairs, d, neg_dmin, x, groups, r, g0 + SUPER_BLOCKS - 1, acc[r]);
    }
}

/* The super-block of Q6_K from block g0 added to each row's acc (q6_k_tile's arithmetic) */
ALWAYS_INLINE void amx_q6_k_sums(const int8_t *scales, const uint16_t *supers, const TileRows *x,
                                 int64_t groups, int64_t g0, int64_t rows, AmxDots dots, __m512 *acc) {
    __m512i scale[SUPER_BLOCKS][2];
    for (int b = 0; b < SUPER_BLOCKS; b++)
        for (int h = 0; h < 2; h++)
            scale[b][h] = _mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(scales + (g0 + b) * 2 * FEATURES + h * FEATURES)));
    const __m512 d = halves_floats(supers + g0 / SUPER_BLOCKS * FEATURES);
    for (int64_t r = 0; r < rows; r++) {
        __m512i sum = _mm512_setzero_si512();
        for (int b = 0; b < SUPER_BLOCKS; b++)
            for (int h = 0; h < 2; h++)
                sum = _mm512_add_epi32(
                    sum, _mm512_mullo_epi32(_mm512_load_si512((const void *)dots[b][h][r]), scale[b][h]));
        acc[r] = super_scaled(sum, d, x, groups, r, g0 + SUPER_BLOCKS - 1, acc[r]);
    }
}

/* A strip's FEATURES features for up to AMX_ROWS rows of x */
ALWAYS_INLINE void amx_tile(int64_t kind, const uint8_t *q, const void *scales, const void *extra,
                            const TileRows *x, int64_t k, int64_t groups, int64_t rows, float *y, int64_t n) {
    amx_shape_for(rows);
    AmxDots dots __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS];
    for (int64_t r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const int64_t bytes = tile_bytes(kind);
    for (int64_t g0 = 0; g0 < groups; g0 += SUPER_BLOCKS) {
        const int64_t count = groups - g0 < SUPER_BLOCKS ? groups - g0 : SUPER_BLOCKS;
        for (int64_t b = 0; b < count; b++) {
            const uint8_t *block = q + (g0 + b) * bytes;
            prefetch_ahead(block, bytes);
            amx_block_dots(kind, block, x, k, g0 + b, dots[b]);
        }
        if (factored(kind))
            amx_k_quant_sums((const uint8_t *)scales, (const uint16_t *)extra, x, groups, g0, rows, dots,
                             acc);
        else if (kind == KIND_Q6_K)
            amx_q6_k_sums((const int8_t *)scales, (const uint16_t *)extra, x, groups, g0, rows, dots, acc);
        else
            amx_block_sums(kind, scales, extra, x, groups, g0, count, rows, dots, acc);
    }
    for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(y + r * n, acc[r]);
}

/* amx_tile, one copy per kind */
static void amx_rows(int64_t kind, const uint8_t *q, const void *scales, const void *extra, const TileRows *x,
                     int64_t k, int64_t groups, int64_t rows, float *y, int64_t n) {
#define AMX_CALL(kind_code) amx_tile(kind_code, q, scales, extra, x, k, groups, rows, y, n)
    switch (kind) {
        case KIND_Q6_K: AMX_CALL(KIND_Q6_K); break;
        case KIND_Q4_1: AMX_CALL(KIND_Q4_1); break;
        case KIND_Q8_0: AMX_CALL(KIND_Q8_0); break;
        case KIND_Q5_1: AMX_CALL(KIND_Q5_1); break;
        case KIND_Q4_K: AMX_CALL(KIND_Q4_K); break;
        case KIND_Q5_K: AMX_CALL(KIND_Q5_K); break;
        default: AMX_CALL(KIND_Q5_0); break;
    }
#undef AMX_CALL
}
#else
#define INTERLEAVED_AMX 0
#endif

/* A call's rows for a kind: AVX2's Q4, Q5 and Q6 tiles, which unpack a block's weights
   once for all of them, take up to WIDE_ROWS (at 64 rows Q5_K 0.82x the time, Q6_K
   0.90x, Q5_0 0.90-1.01x, Q4_K and Q4_1 0.85-0.89x: nibble_block_times); Q8_0's 8,
   whose x rows then stay in L1 (64 at once took 1.07-1.3x). Every AVX2 tile takes any
   row count up to WIDE_ROWS. */
static inline int64_t row_step(int64_t kind) {
    const int wide = kind != KIND_Q8_0;
    return INTERLEAVED_VECTORIZED == 1 && wide ? WIDE_ROWS : TILE_ROWS;
}

/* One copy per kind and row count up to TILE_ROWS, so the accumulators stay in
   registers where they can; more rows (AVX2's, up to WIDE_ROWS: row_step) one copy per
   kind */
static void interleaved_rows(int64_t kind, const uint8_t *q, const void *scales,
                             const void *extra, const TileRows *x, int64_t k, int64_t groups,
                             int64_t rows, float *y, int64_t n) {
#define CALL(kind_code, count) interleaved_tile(kind_code, q, scales, extra, x, k, groups, count, y, n)
#define CALL_Q6(unused, count) q6_k_tile(q, scales, extra, x, k, groups, count, y, n)
#define CALL_K(kind_code, count) k_quant_tile(kind_code, q, scales, extra, x, k, groups, count, y, n)
/* each(call, arg): the call for arg and the row count */
#define FOR_EACH_KIND(each)                              \
    switch (kind) {                                      \
        case KIND_Q6_K: each(CALL_Q6, 0) break;          \
        case KIND_Q4_1: each(CALL, KIND_Q4_1) break;     \
        case KIND_Q8_0: each(CALL, KIND_Q8_0) break;     \
        case KIND_Q5_1: each(CALL, KIND_Q5_1) break;     \
        case KIND_Q4_K: each(CALL_K, KIND_Q4_K) break;   \
        case KIND_Q5_K: each(CALL_K, KIND_Q5_K) break;   \
        default: each(CALL, KIND_Q5_0) break;            \
    }
#define ANY_ROW_COUNT(call, arg) call(arg, rows);
#if INTERLEAVED_VECTORIZED == 1
    if (rows > TILE_ROWS) {
        FOR_EACH_KIND(ANY_ROW_COUNT)
        return;
    }
#endif
    FOR_EACH_KIND(FOR_EACH_ROW_COUNT_WITH)
#undef CALL
#undef CALL_Q6
#undef CALL_K
#undef FOR_EACH_KIND
#undef ANY_ROW_COUNT
}

/* x's rows rounded once (per block, or per super-block), with the operands the tiles
   of the kinds that read this rounding need beside xq (see TileRows) */
typedef struct {
    QuantizedRows xq;
    uint8_t *xu;
    int32_t *xhalfsums, *xpairsums;
} RoundedRows;

static void free_rounded(RoundedRows *x) {
    free_rows(&x->xq);
    free(x->xu);
    free(x->xhalfsums);
    free(x->xpairsums);
}

/* Room for x rounded for the parts whose super_blocked is super, with the operands
   they read (the AMX tiles, amx, read neither xu nor xhalfsums); 1 when out of memory
   (nothing left to free then). */
static int alloc_rounded(const InterleavedWeight *parts, int64_t count, int super, int64_t rows,
                         int64_t k, int amx, RoundedRows *out) {
    int with_xu = 0, with_halves = 0, with_pairs = 0;
    for (int64_t p = 0; p < count; p++) {
        const int64_t kind = parts[p].kind;
        if (super_blocked(kind) != super) continue;
        with_xu |= (INTERLEAVED_VECTORIZED == 2 && kind == KIND_Q8_0 && !amx) ||
                   (INTERLEAVED_VECTORIZED == 1 && kind == KIND_Q6_K && rows > TILE_ROWS);
        with_halves |= (kind == KIND_Q5_0 || (INTERLEAVED_VECTORIZED > 0 && kind == KIND_Q6_K)) && !amx;
        with_pairs |= factored(kind);
    }
    const int64_t groups = rows * k / BLOCK;
    memset(out, 0, sizeof *out);
    out->xq.quants = malloc((size_t)(rows * k));
    out->xq.scales = malloc(sizeof(float) * (size_t)groups);
    out->xq.sums = malloc(sizeof(float) * (size_t)groups);
    out->xu = with_xu ? malloc((size_t)(rows * k)) : NULL;
    out->xhalfsums = with_halves ? malloc(sizeof(int32_t) * (size_t)(2 * groups)) : NULL;
    out->xpairsums = with_pairs ? malloc(sizeof(int32_t) * (size_t)(groups / 2)) : NULL;
    if (out->xq.quants == NULL || out->xq.scales == NULL || out->xq.sums == NULL ||
        (with_xu && out->xu == NULL) || (with_halves && out->xhalfsums == NULL) ||
        (with_pairs && out->xpairsums == NULL)) {
        free_rounded(out);
        memset(out, 0, sizeof *out);
        return 1;
    }
    return 0;
}

/* x rounded into out, a super-block (or a block) at a time over the threads of the
   enclosing parallel region (a work-sharing loop: every thread calls it): each
   block's step is amax / 127 (quantize_block's), or per super-block its blocks'
   largest, each element rounded to nearest even; then the operands beside. */
static void fill_rounded(RoundedRows *out, int super, const float *x, int64_t rows, int64_t k) {
    const int64_t per = super ? SUPER_BLOCKS : 1, units = rows * (k / BLOCK) / per;
    QuantizedRows *xq = &out->xq;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        const int64_t b0 = u * per;
        float step = 0.f;
        for (int64_t b = b0; b < b0 + per; b++) {
            quantize_block(x + b * BLOCK, 1, xq->sums + b, xq->scales + b, xq->quants + b * BLOCK);
            step = fmaxf(step, xq->scales[b]);
        }
        for (int64_t b = b0; per > 1 && b < b0 + per; b++) {
            xq->scales[b] = step;
            round_block(x + b * BLOCK, step > 0.f ? 1.f / step : 0.f, xq->quants + b * BLOCK);
        }
        const int8_t *quants = xq->quants + b0 * BLOCK;
        for (int64_t i = 0; out->xu != NULL && i < per * BLOCK; i++)
            out->xu[b0 * BLOCK + i] = (uint8_t)(quants[i] ^ 0x80);
        for (int64_t h = 0; out->xhalfsums != NULL && h < 2 * per; h++) {
            int32_t sum = 0;
            for (int j = 0; j < BLOCK / 2; j++) sum += quants[h * (BLOCK / 2) + j];
            out->xhalfsums[2 * b0 + h] = sum;
        }
        for (int64_t p = 0; out->xpairsums != NULL && p < per / 2; p++) {
            int32_t sums[2] = {0, 0};
            for (int j = 0; j < 2 * BLOCK; j++) sums[j / BLOCK] += quants[p * 2 * BLOCK + j];
            out->xpairsums[b0 / 2 + p] = (int32_t)((uint32_t)(uint16_t)sums[0] | (uint32_t)(uint16_t)sums[1] << 16);
        }
    }
}

/* The rows r0 on of x's rounding x */
static inline TileRows tile_rows(const RoundedRows *x, int64_t r0, int64_t k) {
    const int64_t groups = k / BLOCK;
    const TileRows tile = {x->xq.quants + r0 * k,
                           x->xu == NULL ? NULL : x->xu + r0 * k,
                           x->xhalfsums == NULL ? NULL : x->xhalfsums + r0 * groups * 2,
                           x->xq.scales + r0 * groups,
                           x->xq.sums + r0 * groups,
                           x->xpairsums == NULL ? NULL : x->xpairsums + r0 * groups / 2};
    return tile;
}

/* y [rows, the parts' n summed] = x @ the parts' rows^T: x rounded once for each
   rounding the parts' kinds read (so each part's features get the bits it alone
   gives), the strips of every part shared out over the threads together. count is 1
   to MAX_PARTS (the caller checks). Returns 1 when out of memory. */
static int interleaved_linear(const InterleavedWeight *parts, int64_t count, const float *x,
                              float *y, int64_t rows, int64_t k, int num_threads) {
    const int64_t groups = k / BLOCK;
    int64_t first[MAX_PARTS + 1] = {0}; /* each part's first strip, then the strips in all */
    int reads[2] = {0, 0};              /* whether a part reads x per block, per super-block */
    for (int64_t p = 0; p < count; p++) {
        first[p + 1] = first[p] + parts[p].n / FEATURES;
        reads[super_blocked(parts[p].kind)] = 1;
    }
    const int64_t strips = first[count], n = strips * FEATURES;
#if INTERLEAVED_AMX
    const int amx = rows > TILE_ROWS && amx_permitted();
#else
    const int amx = 0;
#endif
    RoundedRows rounded[2];
    memset(rounded, 0, sizeof rounded);
    int failed = 0;
    for (int super = 0; super < 2 && !failed; super++)
        if (reads[super]) failed = alloc_rounded(parts, count, super, rows, k, amx, rounded + super);
    Share *shares = failed ? NULL : new_shares(strips, num_threads);
    if (shares == NULL) {
        free_rounded(rounded);
        free_rounded(rounded + 1);
        return 1;
    }
#pragma omp parallel num_threads(num_threads)
    {
        /* every thread rounds a share of x, and waits for the rest at the loops' ends */
        for (int super = 0; super < 2; super++)
            if (reads[super]) fill_rounded(rounded + super, super, x, rows, k);
        int victim = 0;
        for (int64_t s; (s = next_chunk(shares, num_threads, omp_get_thread_num(), &victim)) >= 0;) {
            int64_t p = 0;
            while (s >= first[p + 1]) p++;
            const InterleavedWeight *w = parts + p;
            const RoundedRows *xr = rounded + super_blocked(w->kind);
            const int64_t local = s - first[p];
            const uint8_t *quants = (const uint8_t *)w->quants + local * groups * tile_bytes(w->kind);
            const void *scales = (const char *)w->scales + local * strip_scale_bytes(w->kind, groups);
            const void *extra =
                w->extra == NULL ? NULL : (const char *)w->extra + local * strip_extra_bytes(w->kind, groups);
#if INTERLEAVED_AMX
            const int64_t step = amx ? AMX_ROWS : row_step(w->kind);
#else
            const int64_t step = row_step(w->kind);
#endif
            for (int64_t r0 = 0; r0 < rows; r0 += step) {
                const TileRows tile = tile_rows(xr, r0, k);
                const int64_t chunk = rows - r0 < step ? rows - r0 : step;
                float *out = y + r0 * n + s * FEATURES;
#if INTERLEAVED_AMX
                if (amx) {
                    amx_rows(w->kind, quants, scales, extra, &tile, k, groups, chunk, out, n);
                    continue;
                }
#endif
                interleaved_rows(w->kind, quants, scales, extra, &tile, k, groups, chunk, out, n);
            }
        }
#if INTERLEAVED_AMX
        amx_done();
#endif
    }
    free_rounded(rounded);
    free_rounded(rounded + 1);
    free(shares);
    return 0;
}

#endif
