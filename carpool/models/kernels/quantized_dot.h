/* y = x @ W^T for a few rows of x, with W kept in its GGUF blocks of 32 weights
   along a row: a decode step then reads the file's bytes (5 bits a weight for
   Q4_1, 8.5 for Q8_0) instead of 32, and each weight is the float32 the file
   defines (scale * q + min). For many rows the float32 GEMM wins (see packed_linear.py).

   x: [rows, k] float32; y: [rows, n] float32; scales (and mins): [n, k / 32] float32
   q4_1: quants [n, k / 32, 16] uint8, weight j of a block in the low nibble of byte
         j, weight j + 16 in the high nibble; w = scale * q + min
   q8_0: quants [n, k / 32, 32] int8; w = scale * q
   q5_1: quants [n, k / 32, 20] uint8: Q4_1's 16 bytes of low nibbles, then 4 bytes
         (little-endian) whose bit j is weight j's fifth bit; w = scale * q + min
         (Q5_0, Q5_1 and Q5_K's sub-blocks of 32)
   q5_0: quants as q5_1's, scales [n, k / 32], no mins; w = scale * (q - 16): Q5_0,
         run as Q8_0 blocks of signed quants (-16 to 15) read from five bits
   q8_16: quants [n, k / 32, 32] int8; scales (and mins, or none) [n, k / 16]: one
         per 16 weights; w = scale * q (+ min): a fused projection's parts stacked
         where their layouts differ (Q5_K, Q5_1: a scale and a min, given per 16 here)
   q6_16: quants [n, k / 32, 24] uint8: Q4_1's 16 bytes of low nibbles, then two
         lanes of 4 bytes of the quants' bits 4 and 5 (weight 16h + 4i + b's at bits
         2i and 2i + 1 of lane h's byte b); scales [n, k / 16], no mins; w = scale *
         (q - 32): Q6_K in its file's 6 bits, run as Q8_16 blocks of signed quants
         (-32 to 31) read from six bits

   With int8_dots (opt-in: --weight-kernel native-int8, llama.cpp's way) each row of x
   is first rounded per block of 32 to int8 steps of amax / 127 (quantize_rows), and a
   block's dot product is integer arithmetic on both blocks' quants times both scales:
   about half the instructions a block of the float32 path takes, but x's rounding
   (up to half a step an element) stays in the result. Q4_1's mins still multiply the
   block's float32 sum of x. */

#ifndef CARPOOL_QUANTIZED_DOT_H
#define CARPOOL_QUANTIZED_DOT_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "work_share.h"
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; } /* built without OpenMP: one thread */
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define BLOCK 32
#define HALF 16 /* Q8_16's weights per scale */
#define Q5_BYTES 20 /* a Q5_1 block: 16 bytes of nibbles, 4 of fifth bits */
/* A Q4_1 (five_bits 0) or Q5_1 (1) block's bytes */
#define NIBBLE_BLOCK_BYTES(five_bits) ((five_bits) ? Q5_BYTES : BLOCK / 2)

/* The block kinds, as carpool/models/packed_linear.py and llama_stack.py number them
   (5-7 are interleaved.h's) */
enum { KIND_Q4_1 = 0, KIND_Q8_0 = 1, KIND_Q8_16 = 2, KIND_Q5_1 = 3, KIND_Q5_0 = 4, KIND_Q6_16 = 8 };
#define FEATURE_GROUP 4 /* features a one-row step computes at once (the *_features functions) */
#define PREFETCH_AHEAD (4 * FEATURE_GROUP) /* how many features ahead they prefetch */
/* A Q8_0 (five_bits 0) or Q5_0 (1) block's bytes */
#define SIGNED_BLOCK_BYTES(five_bits) ((five_bits) ? Q5_BYTES : BLOCK)
#define Q6_BYTES 24 /* a Q6_16 block: 16 bytes of nibbles, two lanes of bits 4 and 5 */
/* Whether the kind's blocks have a scale per 16 weights (Q8_16's and Q6_16's) */
static inline int scale_per_16(int64_t kind) { return kind == KIND_Q8_16 || kind == KIND_Q6_16; }
/* A Q8_16 (six_bits 0) or Q6_16 (1) block's bytes */
#define PER_16_BLOCK_BYTES(six_bits) ((six_bits) ? Q6_BYTES : BLOCK)

/* The 4 bytes at p as a word, little-endian on any machine (byte b its bits 8b on) */
static inline uint32_t little_word(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* A Q5_1 block's fifth bits (bytes 16-19, little-endian) */
static inline uint32_t fifth_bits(const uint8_t *q) { return little_word(q + 16); }

/* Weight j (0-31) of a Q4_1 block (bits 0) or of a Q5_1 block (bits: its fifth_bits) */
static inline int block_value(const uint8_t *q, uint32_t bits, int j) {
    const int nibble = j < 16 ? q[j] & 15 : q[j - 16] >> 4;
    return nibble | (int)((bits >> j) & 1) << 4;
}

/* Weight j of a Q8_0 block (five_bits 0) or of a Q5_0 block (1): its signed quant */
static inline int signed_value(const uint8_t *q, int five_bits, int j) {
    return five_bits ? block_value(q, fifth_bits(q), j) - 16 : (int)((const int8_t *)q)[j];
}

/* Weight j of a Q8_16 block (six_bits 0) or of a Q6_16 block (1): its signed quant */
static inline int per_16_value(const uint8_t *q, int six_bits, int j) {
    if (!six_bits) return (int)((const int8_t *)q)[j];
    const int h = j / 16, i = j % 16 / 4, b = j % 4;
    const int top = (q[16 + 4 * h + b] >> (2 * i)) & 3;
    return (block_value(q, 0, j) | top << 4) - 32;
}
/* inlined into each row count's copy (see FOR_EACH_ROW_COUNT) */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

#if defined(__AVX2__) && defined(__FMA__)
static inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum over blocks of min * (the block's sum of x): Q4_1's mins' share of a dot product */
static inline float min_share(const float *mins, const float *sums, int64_t groups) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(sums + g), acc);
    float share = horizontal_sum(acc);
    for (; g < groups; g++) share += mins[g] * sums[g];
    return share;
}

/* A Q4_1 block's 32 quants, from its 16 bytes: weights 0-15 (the low nibbles) in lo,
   16-31 (the high nibbles) in hi, one a byte */
static inline void split_nibbles(const uint8_t *q, __m128i *lo, __m128i *hi) {
    const __m128i low = _mm_set1_epi8(15), bytes = _mm_loadu_si128((const __m128i *)q);
    *lo = _mm_and_si128(bytes, low);
    *hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
}

static inline __m256 bytes_to_floats(__m128i bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

/* 32 bytes: byte j is 16 where bit j of bits is set, else 0 (each 128-bit lane
   spreads its bytes of bits over 8 bytes each, then tests one bit a byte) */
static inline __m256i sixteens_of_bits(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

/* A Q5_1 block's 32 quants, one a byte, in weight order */
static inline __m256i q5_bytes(const uint8_t *q) {
    __m128i lo, hi;
    split_nibbles(q, &lo, &hi);
    return _mm256_or_si256(_mm256_set_m128i(hi, lo), sixteens_of_bits(fifth_bits(q)));
}

/* A Q4_1 (five_bits 0) or Q5_1 block's 32 quants, one a byte, in weight order */
ALWAYS_INLINE __m256i block_bytes(const uint8_t *q, int five_bits) {
    if (five_bits) return q5_bytes(q);
    __m128i lo, hi;
    split_nibbles(q, &lo, &hi);
    return _mm256_set_m128i(hi, lo); /* weights 0-15, then 16-31 */
}

/* The same quants as four vectors of 8 floats, in weight order */
ALWAYS_INLINE void block_floats(const uint8_t *q, int five_bits, __m256 w[4]) {
    __m128i lo, hi;
    if (five_bits) {
        const __m256i bytes = q5_bytes(q);
        lo = _mm256_castsi256_si128(bytes);
        hi = _mm256_extracti128_si256(bytes, 1);
    } else {
        split_nibbles(q, &lo, &hi);
    }
    w[0] = bytes_to_floats(lo);
    w[1] = bytes_to_floats(_mm_srli_si128(lo, 8));
    w[2] = bytes_to_floats(hi);
    w[3] = bytes_to_floats(_mm_srli_si128(hi, 8));
}

/* A Q8_0 (five_bits 0) or Q5_0 block's 32 signed quants, one a byte, in weight order */
ALWAYS_INLINE __m256i signed_bytes(const uint8_t *q, int five_bits) {
    if (five_bits) return _mm256_sub_epi8(q5_bytes(q), _mm256_set1_epi8(16));
    return _mm256_loadu_si256((const __m256i *)q);
}

/* The same quants as four vectors of 8 floats, in weight order */
ALWAYS_INLINE void signed_floats(const uint8_t *q, int five_bits, __m256 w[4]) {
    const __m256i bytes = signed_bytes(q, five_bits);
    const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

/* A Q8_16 (six_bits 0) or Q6_16 block's 32 signed quants, one a byte, in weight order:
   a Q6_16 lane's 4 bytes go to each of 4 dwords, dword i shifted by 2i, so that byte
   4i + b holds lane byte b's bits 2i and 2i + 1 (weight 16h + 4i + b's) at its bottom */
ALWAYS_INLINE __m256i per_16_bytes(const uint8_t *q, int six_bits) {
    if (!six_bits) return _mm256_loadu_si256((const __m256i *)q);
    __m128i lo, hi;
    split_nibbles(q, &lo, &hi);
    const __m256i lanes = _mm256_permutevar8x32_epi32(
        _mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(q + 16))),
        _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    const __m256i spread = _mm256_srlv_epi32(lanes, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    const __m256i top = _mm256_slli_epi16(_mm256_and_si256(spread, _mm256_set1_epi8(3)), 4);
    const __m256i q6 = _mm256_or_si256(_mm256_set_m128i(hi, lo), top);
    return _mm256_sub_epi8(q6, _mm256_set1_epi8(32));
}

/* The same quants as four vectors of 8 floats, in weight order */
ALWAYS_INLINE void per_16_floats(const uint8_t *q, int six_bits, __m256 w[4]) {
    if (!six_bits) {
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * j))));
        return;
    }
    const __m256i bytes = per_16_bytes(q, 1);
    const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

/* out[r] = sum over blocks of scale * (q . x_r) + min * (the block's sum of x_r), for
   ROWS rows of x at once (sums: [rows, groups]), Q4_1 or Q5_1 blocks (five_bits, a
   constant in each inlined copy): each block is unpacked once for all */
#define ROWS 8

ALWAYS_INLINE void nibble_dot(const uint8_t *q, int five_bits, const float *scales,
                              const float *mins, const float *sums, const float *x, int64_t k,
                              int64_t rows, int64_t groups, float *out) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, q += NIBBLE_BLOCK_BYTES(five_bits)) {
        __m256 w[4];
        block_floats(q, five_bits, w);
        const __m256 scale = _mm256_set1_ps(scales[g]);
        for (int64_t r = 0; r < rows; r++) {
            const float *xg = x + r * k + g * BLOCK;
            __m256 dot = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
            dot = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), dot);
            dot = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), dot);
            dot = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), dot);
            acc[r] = _mm256_fmadd_ps(scale, dot, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        out[r] = horizontal_sum(acc[r]) + min_share(mins, sums + r * groups, groups);
}

/* Q8_0 blocks, or with five_bits Q5_0's (signed quants read from five bits) */
ALWAYS_INLINE void q8_0_dot(const uint8_t *q, int five_bits, const float *scales, const float *x,
                            int64_t k, int64_t rows, int64_t groups, float *out) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, q += SIGNED_BLOCK_BYTES(five_bits)) {
        __m256 w[BLOCK / 8];
        if (five_bits) {
            signed_floats(q, 1, w);
        } else { /* four 8-byte loads: faster here than one 32-byte load split in two */
            for (int j = 0; j < BLOCK / 8; j++)
                w[j] = _mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * j))));
        }
        const __m256 scale = _mm256_set1_ps(scales[g]);
        for (int64_t r = 0; r < rows; r++) {
            const float *xg = x + r * k + g * BLOCK;
            __m256 dot = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
            for (int j = 1; j < BLOCK / 8; j++)
                dot = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xg + 8 * j), dot);
            acc[r] = _mm256_fmadd_ps(scale, dot, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) out[r] = horizontal_sum(acc[r]);
}

/* 8 int32 sums of 4 products each of unsigned and signed bytes */
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    /* pairs of products fit in int16: 2 * 15 * 127 (Q4_1), 2 * 128 * 127 (Q8_0) */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* As nibble_dot, with scale * xscale * (q . xq_r) for rows of quantized x (xq: [rows,
   k] int8, xscales: [rows, groups]); pairs of products fit in int16: 2 * 31 * 127 */
ALWAYS_INLINE void nibble_dot_int8(const uint8_t *q, int five_bits, const float *scales,
                                   const float *mins, const float *sums, const int8_t *xq,
                                   const float *xscales, int64_t k, int64_t rows, int64_t groups,
                                   float *out) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, q += NIBBLE_BLOCK_BYTES(five_bits)) {
        const __m256i w = block_bytes(q, five_bits);
        for (int64_t r = 0; r < rows; r++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + r * k + g * BLOCK));
            const __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(w, a));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scales[g] * xscales[r * groups + g]), dot,
                                     acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        out[r] = horizontal_sum(acc[r]) + min_share(mins, sums + r * groups, groups);
}

ALWAYS_INLINE void q8_0_dot_int8(const uint8_t *q, int five_bits, const float *scales,
                                 const int8_t *xq, const float *xscales, int64_t k, int64_t rows,
                                 int64_t groups, float *out) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, q += SIGNED_BLOCK_BYTES(five_bits)) {
        const __m256i w = signed_bytes(q, five_bits);
        const __m256i magnitude = _mm256_abs_epi8(w); /* -128 becomes 128 as unsigned */
        for (int64_t r = 0; r < rows; r++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + r * k + g * BLOCK));
            /* |w| * (a with w's sign) = w * a */
            const __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(magnitude, _mm256_sign_epi8(a, w)));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scales[g] * xscales[r * groups + g]), dot,
                                     acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) out[r] = horizontal_sum(acc[r]);
}

/* One row against FEATURE_GROUP features' Q8_0 or Q5_0 blocks at once (a decode step
   of one sequence): each of x's blocks is loaded once for all of them, and their sums
   run as independent chains. The rows PREFETCH_AHEAD features on (contiguous after
   these) are prefetched as these are read, since four rows read side by side defeat
   the hardware's stream prefetch on a matrix that is not in the caches: without it
   an LM head (49152 x 576 Q8_0) took 1.7x as long on Zen 3, with the next group's
   rows prefetched 0.8-1.0x, four groups ahead 0.7-0.8x (one row, 2 threads). Feature f's blocks start at q + f *
   feature_bytes, its scales at scales + f * groups. Each feature's arithmetic is
   q8_0_dot's or q8_0_dot_int8's for one row, in the same order: the results are
   theirs, bit for bit. */

/* Prefetch block g's share of a group's rows from next (step bytes a block, 64 to 128;
   a prefetch past the end is harmless: it never faults). Always inlined: GCC sees no
   effect in a prefetch, so a call to this left out of line is deleted. */
ALWAYS_INLINE void prefetch_block(const char *next, int64_t g, int64_t step) {
    _mm_prefetch(next + g * step, _MM_HINT_T0);
    _mm_prefetch(next + g * step + 64, _MM_HINT_T0);
}
/* Block g of feature f as floats: nibbles (Q4_1, or Q5_1 with five_bits) or signed
   quants (Q8_0, or Q5_0 with five_bits), as the row functions convert them */
ALWAYS_INLINE void feature_floats(const uint8_t *q, int nibbles, int five_bits, __m256 w[4]) {
    if (nibbles)
        block_floats(q, five_bits, w);
    else
        signed_floats(q, five_bits, w);
}

/* The bytes a block of these kinds takes */
#define FEATURE_BLOCK_BYTES(nibbles, five_bits) \
    ((nibbles) ? NIBBLE_BLOCK_BYTES(five_bits) : SIGNED_BLOCK_BYTES(five_bits))

/* out[f] for the FEATURE_GROUP features whose blocks start at q + f * feature_bytes
   (scales, and for nibbles mins, at + f * groups; sums: x's block sums): q8_0_dot's
   or nibble_dot's arithmetic for one row */
ALWAYS_INLINE void dot_features(const uint8_t *q, int nibbles, int five_bits,
                                int64_t feature_bytes, const float *scales, const float *mins,
                                const float *sums, const float *x, int64_t groups, float *out) {
    const int64_t step = FEATURE_BLOCK_BYTES(nibbles, five_bits);
    __m256 acc[FEATURE_GROUP];
    for (int f = 0; f < FEATURE_GROUP; f++) acc[f] = _mm256_setzero_ps();
    const char *next = (const char *)(q + PREFETCH_AHEAD * feature_bytes);
    for (int64_t g = 0; g < groups; g++) {
        prefetch_block(next, g, FEATURE_GROUP * step);
        const float *xg = x + g * BLOCK;
        const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
        const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
        for (int f = 0; f < FEATURE_GROUP; f++) {
            __m256 w[4];
            feature_floats(q + f * feature_bytes + g * step, nibbles, five_bits, w);
            __m256 dot = _mm256_mul_ps(w[0], x0);
            dot = _mm256_fmadd_ps(w[1], x1, dot);
            dot = _mm256_fmadd_ps(w[2], x2, dot);
            dot = _mm256_fmadd_ps(w[3], x3, dot);
            acc[f] = _mm256_fmadd_ps(_mm256_set1_ps(scales[f * groups + g]), dot, acc[f]);
        }
    }
    for (int f = 0; f < FEATURE_GROUP; f++)
        out[f] = nibbles ? horizontal_sum(acc[f]) + min_share(mins + f * groups, sums, groups)
                         : horizontal_sum(acc[f]);
}

/* As dot_features with int8 rows xq (xscales: their steps): q8_0_dot_int8's or
   nibble_dot_int8's arithmetic for one row */
ALWAYS_INLINE void dot_int8_features(const uint8_t *q, int nibbles, int five_bits,
                                     int64_t feature_bytes, const float *scales,
                                     const float *mins, const float *sums, const int8_t *xq,
                                     const float *xscales, int64_t groups, float *out) {
    const int64_t step = FEATURE_BLOCK_BYTES(nibbles, five_bits);
    __m256 acc[FEATURE_GROUP];
    for (int f = 0; f < FEATURE_GROUP; f++) acc[f] = _mm256_setzero_ps();
    const char *next = (const char *)(q + PREFETCH_AHEAD * feature_bytes);
    for (int64_t g = 0; g < groups; g++) {
        prefetch_block(next, g, FEATURE_GROUP * step);
        const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + g * BLOCK));
        const float xscale = xscales[g];
        for (int f = 0; f < FEATURE_GROUP; f++) {
            const uint8_t *qb = q + f * feature_bytes + g * step;
            __m256i sums8;
            if (nibbles) {
                sums8 = dot_u8_s8(block_bytes(qb, five_bits), a);
            } else {
                const __m256i w = signed_bytes(qb, five_bits);
                sums8 = dot_u8_s8(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
            }
            acc[f] = _mm256_fmadd_ps(_mm256_set1_ps(scales[f * groups + g] * xscale),
                                     _mm256_cvtepi32_ps(sums8), acc[f]);
        }
    }
    for (int f = 0; f < FEATURE_GROUP; f++)
        out[f] = nibbles ? horizontal_sum(acc[f]) + min_share(mins + f * groups, sums, groups)
                         : horizontal_sum(acc[f]);
}

/* As q8_0_dot with the scale changing after 16 weights (Q8_16's mins are added by
   the caller); six_bits: Q6_16 blocks */
ALWAYS_INLINE void q8_16_dot(const uint8_t *q, int six_bits, const float *scales, const float *x,
                             int64_t k, int64_t rows, int64_t groups, float *out) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, q += PER_16_BLOCK_BYTES(six_bits)) {
        __m256 w[BLOCK / 8];
        per_16_floats(q, six_bits, w);
        const __m256 s0 = _mm256_set1_ps(scales[2 * g]), s1 = _mm256_set1_ps(scales[2 * g + 1]);
        for (int64_t r = 0; r < rows; r++) {
            const float *xg = x + r * k + g * BLOCK;
            __m256 d0 = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
            d0 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), d0);
            __m256 d1 = _mm256_mul_ps(w[2], _mm256_loadu_ps(xg + 16));
            d1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), d1);
            acc[r] = _mm256_fmadd_ps(s0, d0, acc[r]);
            acc[r] = _mm256_fmadd_ps(s1, d1, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) out[r] = horizontal_sum(acc[r]);
}

/* As q8_0_dot_int8 with the scale changing after 16 weights: the integer sums' lanes
   0-3 hold weights 0-15, lanes 4-7 weights 16-31 */
ALWAYS_INLINE void q8_16_dot_int8(const uint8_t *q, int six_bits, const float *scales,
                                  const int8_t *xq, const float *xscales, int64_t k, int64_t rows,
                                  int64_t groups, float *out) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, q += PER_16_BLOCK_BYTES(six_bits)) {
        const __m256i w = per_16_bytes(q, six_bits);
        const __m256i magnitude = _mm256_abs_epi8(w);
        const __m256 halves =
            _mm256_set_m128(_mm_set1_ps(scales[2 * g + 1]), _mm_set1_ps(scales[2 * g]));
        for (int64_t r = 0; r < rows; r++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + r * k + g * BLOCK));
            const __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(magnitude, _mm256_sign_epi8(a, w)));
            const __m256 scale = _mm256_mul_ps(halves, _mm256_set1_ps(xscales[r * groups + g]));
            acc[r] = _mm256_fmadd_ps(scale, dot, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) out[r] = horizontal_sum(acc[r]);
}

/* As dot_features for Q8_16 blocks (a scale per 16; the caller adds the mins):
   q8_16_dot's and q8_16_dot_int8's arithmetic for one row */
ALWAYS_INLINE void q8_16_dot_features(const uint8_t *q, int six_bits, const float *scales,
                                      const float *x, int64_t groups, float *out) {
    const int64_t step = PER_16_BLOCK_BYTES(six_bits);
    __m256 acc[FEATURE_GROUP];
    for (int f = 0; f < FEATURE_GROUP; f++) acc[f] = _mm256_setzero_ps();
    const char *next = (const char *)(q + PREFETCH_AHEAD * groups * step);
    for (int64_t g = 0; g < groups; g++) {
        prefetch_block(next, g, FEATURE_GROUP * step);
        const float *xg = x + g * BLOCK;
        const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
        const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
        for (int f = 0; f < FEATURE_GROUP; f++) {
            const float *sf = scales + f * 2 * groups;
            __m256 w[BLOCK / 8];
            per_16_floats(q + (f * groups + g) * step, six_bits, w);
            __m256 d0 = _mm256_mul_ps(w[0], x0);
            d0 = _mm256_fmadd_ps(w[1], x1, d0);
            __m256 d1 = _mm256_mul_ps(w[2], x2);
            d1 = _mm256_fmadd_ps(w[3], x3, d1);
            acc[f] = _mm256_fmadd_ps(_mm256_set1_ps(sf[2 * g]), d0, acc[f]);
            acc[f] = _mm256_fmadd_ps(_mm256_set1_ps(sf[2 * g + 1]), d1, acc[f]);
        }
    }
    for (int f = 0; f < FEATURE_GROUP; f++) out[f] = horizontal_sum(acc[f]);
}

ALWAYS_INLINE void q8_16_dot_int8_features(const uint8_t *q, int six_bits, const float *scales,
                                           const int8_t *xq, const float *xscales,
                                           int64_t groups, float *out) {
    const int64_t step = PER_16_BLOCK_BYTES(six_bits);
    __m256 acc[FEATURE_GROUP];
    for (int f = 0; f < FEATURE_GROUP; f++) acc[f] = _mm256_setzero_ps();
    const char *next = (const char *)(q + PREFETCH_AHEAD * groups * step);
    for (int64_t g = 0; g < groups; g++) {
        prefetch_block(next, g, FEATURE_GROUP * step);
        const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + g * BLOCK));
        const __m256 xscale = _mm256_set1_ps(xscales[g]);
        for (int f = 0; f < FEATURE_GROUP; f++) {
            const __m256i w = per_16_bytes(q + (f * groups + g) * step, six_bits);
            const float *sf = scales + f * 2 * groups;
            const __m256 halves = _mm256_set_m128(_mm_set1_ps(sf[2 * g + 1]), _mm_set1_ps(sf[2 * g]));
            const __m256 dot =
                _mm256_cvtepi32_ps(dot_u8_s8(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w)));
            acc[f] = _mm256_fmadd_ps(_mm256_mul_ps(halves, xscale), dot, acc[f]);
        }
    }
    for (int f = 0; f < FEATURE_GROUP; f++) out[f] = horizontal_sum(acc[f]);
}

#else
#define ROWS 8

static void nibble_dot(const uint8_t *q, int five_bits, const float *scales,
                       const float *mins, const float *sums, const float *x, int64_t k,
                       int64_t rows, int64_t groups, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *qb = q;
        float acc = 0.f;
        for (int64_t g = 0; g < groups; g++, qb += NIBBLE_BLOCK_BYTES(five_bits)) {
            const float *xg = x + r * k + g * BLOCK;
            const uint32_t bits = five_bits ? fifth_bits(qb) : 0;
            float dot = 0.f;
            for (int j = 0; j < BLOCK / 2; j++)
                dot += (float)block_value(qb, bits, j) * xg[j] +
                       (float)block_value(qb, bits, j + BLOCK / 2) * xg[j + BLOCK / 2];
            acc += scales[g] * dot + mins[g] * sums[r * groups + g];
        }
        out[r] = acc;
    }
}

static void q8_0_dot(const uint8_t *q, int five_bits, const float *scales, const float *x,
                     int64_t k, int64_t rows, int64_t groups, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + r * k + g * BLOCK;
            const uint8_t *qb = q + g * SIGNED_BLOCK_BYTES(five_bits);
            float dot = 0.f;
            for (int j = 0; j < BLOCK; j++) dot += (float)signed_value(qb, five_bits, j) * xg[j];
            acc += scales[g] * dot;
        }
        out[r] = acc;
    }
}

static void nibble_dot_int8(const uint8_t *q, int five_bits, const float *scales,
                            const float *mins, const float *sums, const int8_t *xq,
                            const float *xscales, int64_t k, int64_t rows, int64_t groups,
                            float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *qb = q;
        float acc = 0.f;
        for (int64_t g = 0; g < groups; g++, qb += NIBBLE_BLOCK_BYTES(five_bits)) {
            const int8_t *a = xq + r * k + g * BLOCK;
            const uint32_t bits = five_bits ? fifth_bits(qb) : 0;
            int32_t dot = 0;
            for (int j = 0; j < BLOCK / 2; j++)
                dot += block_value(qb, bits, j) * a[j] +
                       block_value(qb, bits, j + BLOCK / 2) * a[j + BLOCK / 2];
            acc += scales[g] * xscales[r * groups + g] * (float)dot +
                   mins[g] * sums[r * groups + g];
        }
        out[r] = acc;
    }
}

static void q8_0_dot_int8(const uint8_t *q, int five_bits, const float *scales,
                          const int8_t *xq, const float *xscales, int64_t k, int64_t rows,
                          int64_t groups, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; g++) {
            const int8_t *a = xq + r * k + g * BLOCK;
            const uint8_t *qb = q + g * SIGNED_BLOCK_BYTES(five_bits);
            int32_t dot = 0;
            for (int j = 0; j < BLOCK; j++) dot += signed_value(qb, five_bits, j) * a[j];
            acc += scales[g] * xscales[r * groups + g] * (float)dot;
        }
        out[r] = acc;
    }
}


static void q8_16_dot(const uint8_t *q, int six_bits, const float *scales, const float *x,
                      int64_t k, int64_t rows, int64_t groups, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int64_t h = 0; h < 2 * groups; h++) {
            const float *xh = x + r * k + h * HALF;
            const uint8_t *qb = q + h / 2 * PER_16_BLOCK_BYTES(six_bits);
            float dot = 0.f;
            for (int j = 0; j < HALF; j++)
                dot += (float)per_16_value(qb, six_bits, h % 2 * HALF + j) * xh[j];
            acc += scales[h] * dot;
        }
        out[r] = acc;
    }
}

static void q8_16_dot_int8(const uint8_t *q, int six_bits, const float *scales,
                           const int8_t *xq, const float *xscales, int64_t k, int64_t rows,
                           int64_t groups, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int64_t h = 0; h < 2 * groups; h++) {
            const int8_t *a = xq + r * k + h * HALF;
            const uint8_t *qb = q + h / 2 * PER_16_BLOCK_BYTES(six_bits);
            int32_t dot = 0;
            for (int j = 0; j < HALF; j++) dot += per_16_value(qb, six_bits, h % 2 * HALF + j) * a[j];
            acc += scales[h] * xscales[r * groups + h / 2] * (float)dot;
        }
        out[r] = acc;
    }
}

/* One row against FEATURE_GROUP features: the row functions, one feature at a time */
static void dot_features(const uint8_t *q, int nibbles, int five_bits, int64_t feature_bytes,
                         const float *scales, const float *mins, const float *sums,
                         const float *x, int64_t groups, float *out) {
    for (int f = 0; f < FEATURE_GROUP; f++) {
        const uint8_t *qf = q + f * feature_bytes;
        if (nibbles)
            nibble_dot(qf, five_bits, scales + f * groups, mins + f * groups, sums, x,
                       groups * BLOCK, 1, groups, out + f);
        else
            q8_0_dot(qf, five_bits, scales + f * groups, x, groups * BLOCK, 1, groups, out + f);
    }
}

static void dot_int8_features(const uint8_t *q, int nibbles, int five_bits, int64_t feature_bytes,
                              const float *scales, const float *mins, const float *sums,
                              const int8_t *xq, const float *xscales, int64_t groups,
                              float *out) {
    for (int f = 0; f < FEATURE_GROUP; f++) {
        const uint8_t *qf = q + f * feature_bytes;
        if (nibbles)
            nibble_dot_int8(qf, five_bits, scales + f * groups, mins + f * groups, sums, xq,
                            xscales, groups * BLOCK, 1, groups, out + f);
        else
            q8_0_dot_int8(qf, five_bits, scales + f * groups, xq, xscales, groups * BLOCK, 1,
                          groups, out + f);
    }
}

static void q8_16_dot_features(const uint8_t *q, int six_bits, const float *scales,
                               const float *x, int64_t groups, float *out) {
    for (int f = 0; f < FEATURE_GROUP; f++)
        q8_16_dot(q + f * groups * PER_16_BLOCK_BYTES(six_bits), six_bits,
                  scales + f * 2 * groups, x, groups * BLOCK, 1, groups, out + f);
}

static void q8_16_dot_int8_features(const uint8_t *q, int six_bits, const float *scales,
                                    const int8_t *xq, const float *xscales, int64_t groups,
                                    float *out) {
    for (int f = 0; f < FEATURE_GROUP; f++)
        q8_16_dot_int8(q + f * groups * PER_16_BLOCK_BYTES(six_bits), six_bits,
                       scales + f * 2 * groups, xq, xscales, groups * BLOCK, 1, groups, out + f);
}

#endif

/* Each dot product compiled for 1 to ROWS rows, so a row's accumulators stay in
   registers (a dynamic row count keeps them in memory, a store and a load per block):
   call(arg, n) for n the row count (up to ROWS) */
#define FOR_EACH_ROW_COUNT_WITH(call, arg) \
    switch (rows) {                        \
        case 1: call(arg, 1); break;       \
        case 2: call(arg, 2); break;       \
        case 3: call(arg, 3); break;       \
        case 4: call(arg, 4); break;       \
        case 5: call(arg, 5); break;       \
        case 6: call(arg, 6); break;       \
        case 7: call(arg, 7); break;       \
        default: call(arg, 8); break;      \
    }
#define CALL_WITH_ROWS(call, n) call(n)
/* call(n) for the row count */
#define FOR_EACH_ROW_COUNT(call) FOR_EACH_ROW_COUNT_WITH(CALL_WITH_ROWS, call)
/* call(flag, n) with the flag (0 or 1) and the row count each a constant in its copy */
#define FOR_EACH_FLAG_AND_ROW_COUNT(flag, call) \
    if (flag) {                                  \
        FOR_EACH_ROW_COUNT_WITH(call, 1)         \
    } else {                                     \
        FOR_EACH_ROW_COUNT_WITH(call, 0)         \
    }
#define FOR_EACH_FIVE_BITS_AND_ROW_COUNT(call) FOR_EACH_FLAG_AND_ROW_COUNT(five_bits, call)

/* A copy per kind too: five_bits is a constant in each */
static void nibble_dot_rows(const uint8_t *q, int five_bits, const float *scales,
                            const float *mins, const float *sums, const float *x, int64_t k,
                            int64_t rows, int64_t groups, float *out) {
#define CALL(bits, n) nibble_dot(q, bits, scales, mins, sums, x, k, n, groups, out)
    FOR_EACH_FIVE_BITS_AND_ROW_COUNT(CALL)
#undef CALL
}

static void q8_0_dot_rows(const uint8_t *q, int five_bits, const float *scales, const float *x,
                          int64_t k, int64_t rows, int64_t groups, float *out) {
#define CALL(bits, n) q8_0_dot(q, bits, scales, x, k, n, groups, out)
    FOR_EACH_FIVE_BITS_AND_ROW_COUNT(CALL)
#undef CALL
}

static void nibble_dot_int8_rows(const uint8_t *q, int five_bits, const float *scales,
                                 const float *mins, const float *sums, const int8_t *xq,
                                 const float *xscales, int64_t k, int64_t rows, int64_t groups,
                                 float *out) {
#define CALL(bits, n) nibble_dot_int8(q, bits, scales, mins, sums, xq, xscales, k, n, groups, out)
    FOR_EACH_FIVE_BITS_AND_ROW_COUNT(CALL)
#undef CALL
}

static void q8_0_dot_int8_rows(const uint8_t *q, int five_bits, const float *scales,
                               const int8_t *xq, const float *xscales, int64_t k, int64_t rows,
                               int64_t groups, float *out) {
#define CALL(bits, n) q8_0_dot_int8(q, bits, scales, xq, xscales, k, n, groups, out)
    FOR_EACH_FIVE_BITS_AND_ROW_COUNT(CALL)
#undef CALL
}

/* A copy per kind too: six_bits (Q6_16 blocks, else Q8_16's) is a constant in each */
static void q8_16_dot_rows(const uint8_t *q, int six_bits, const float *scales, const float *x,
                           int64_t k, int64_t rows, int64_t groups, float *out) {
#define CALL(bits, n) q8_16_dot(q, bits, scales, x, k, n, groups, out)
    FOR_EACH_FLAG_AND_ROW_COUNT(six_bits, CALL)
#undef CALL
}

static void q8_16_dot_int8_rows(const uint8_t *q, int six_bits, const float *scales,
                                const int8_t *xq, const float *xscales, int64_t k, int64_t rows,
                                int64_t groups, float *out) {
#define CALL(bits, n) q8_16_dot_int8(q, bits, scales, xq, xscales, k, n, groups, out)
    FOR_EACH_FLAG_AND_ROW_COUNT(six_bits, CALL)
#undef CALL
}

#define CHUNK 16 /* output features a thread claims at a time */
#define SUPER_BLOCK 8 /* a K-quant's blocks of 32 per super-block (256 weights) */

/* A K-quant matrix's scales as its file holds them, in its bits (packed_linear.py's
   KScales), from which its float32 scales and mins are made a few features at a time
   as a step reads them, instead of held beside the quants (4.5 bits a weight for Q4_K
   in Q4_1 blocks instead of 6). Q4_K and Q5_K (Q4_1 and Q5_1 blocks): supers float16
   [n, k / 256, 2] (d, -dmin), factors uint8 [n, k / 256, K_BYTES] (the 8 sc and 8 m
   in the file's 6 bits, k_factors): block g's scale is d * sc and its min -dmin * m.
   Q6_K (Q6_16 blocks, no mins): supers [n, k / 256, 1] (d), factors int8 [n, k / 16]
   (sc): half h's scale is d * sc. Each product is exact in float32 (a float16 times
   an integer below 128): the floats the file defines. */
typedef struct {
    const uint16_t *supers;
    const void *factors;
} KScaleRows;

#define K_BYTES 12 /* a Q4_K or Q5_K super-block's sc and m */

/* A Q4_K or Q5_K super-block's 8 sc and 8 m from its file's 12 bytes, as 4 words of 4
   bytes (byte b of a word its bits 8b on): sc 0-3, sc 4-7, m 0-3, m 4-7. Blocks 0-3's
   are bits 0-5 of bytes 0-3 (sc) and 4-7 (m); blocks 4-7's low four bits are bytes
   8-11 (sc in bits 0-3, m in 4-7), their top two bits 6-7 of bytes 0-3 (sc) and 4-7
   (m). Four at a time in a word: the masks keep each byte's own bits. */
static inline void k_factors(const uint8_t *q, uint32_t words[4]) {
    const uint32_t sc = little_word(q), m = little_word(q + 4), rest = little_word(q + 8);
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
    words[0] = sc & six;
    words[1] = (rest & four) | (sc >> 6 & two) << 4;
    words[2] = m & six;
    words[3] = (rest >> 4 & four) | (m >> 6 & two) << 4;
}

/* One super-block's 8 scales and 8 mins (Q4_K, Q5_K) from d, -dmin (float16) and its
   K_BYTES of sc and m; with AVX2 8 of each at once, the same products (k_factors'
   words kept in registers: bytes stored one by one and read back as a vector stall
   the load) */
static inline void k_super_block(const uint16_t *dm, const uint8_t *f, float *scales,
                                 float *mins) {
    const float d = half_to_float(dm[0]), dmin = half_to_float(dm[1]);
    uint32_t w[4];
    k_factors(f, w);
#if defined(__AVX2__) && defined(__FMA__)
    const __m128i sc = _mm_setr_epi32((int)w[0], (int)w[1], 0, 0);
    const __m128i m = _mm_setr_epi32((int)w[2], (int)w[3], 0, 0);
    _mm256_storeu_ps(scales, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc))));
    _mm256_storeu_ps(mins, _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m))));
#else
    for (int j = 0; j < SUPER_BLOCK; j++) {
        scales[j] = d * (float)(w[j / 4] >> 8 * (j % 4) & 255);
        mins[j] = dmin * (float)(w[2 + j / 4] >> 8 * (j % 4) & 255);
    }
#endif
}

/* One Q6_K super-block's 16 scales (one per 16 weights) from d and its 16 int8 sc */
static inline void six_bit_super_block(float d, const int8_t *sc, float *scales) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m128i bytes = _mm_loadu_si128((const __m128i *)sc);
    const __m256 dv = _mm256_set1_ps(d);
    _mm256_storeu_ps(scales, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))));
    const __m128i high = _mm_srli_si128(bytes, 8);
    _mm256_storeu_ps(scales + 8, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(high))));
#else
    for (int h = 0; h < 2 * SUPER_BLOCK; h++) scales[h] = d * (float)sc[h];
#endif
}

/* scales (and mins: Q4_K's and Q5_K's) [count, per_feature] of features o0 ... o0 +
   count - 1 from ks; six_bit: Q6_K's (a scale per 16, no mins) */
static void k_scales_of(const KScaleRows *ks, int six_bit, int64_t o0, int64_t count,
                        int64_t k, float *scales, float *mins) {
    const int64_t groups = k / BLOCK, supers = groups / SUPER_BLOCK;
    for (int64_t i = 0; i < count; i++) {
        const int64_t o = o0 + i;
        for (int64_t u = 0; u < supers; u++) {
            const int64_t g = u * SUPER_BLOCK;
            if (six_bit)
                six_bit_super_block(half_to_float(ks->supers[o * supers + u]),
                                    (const int8_t *)ks->factors + (o * groups + g) * 2,
                                    scales + (i * groups + g) * 2);
            else
                k_super_block(ks->supers + (o * supers + u) * 2,
                              (const uint8_t *)ks->factors + (o * supers + u) * K_BYTES,
                              scales + i * groups + g, mins + i * groups + g);
        }
    }
}

/* The scales, mins and quants a chunk of features [o0, o0 + count) is read with,
   indexed from its first feature: the caller's own arrays (ks NULL), or, for a
   K-quant matrix, scales and mins made from ks into buffer (2 * count *
   per_feature floats). */
typedef struct {
    const float *scales, *mins;
    const uint8_t *quants;
} ChunkScales;

static ChunkScales chunk_scales(const KScaleRows *ks, int six_bit, const void *quants,
                                const float *scales, const float *mins, int64_t row_bytes,
                                int64_t per_feature, int64_t o0, int64_t count, int64_t k,
                                float *buffer) {
    const uint8_t *q = (const uint8_t *)quants + o0 * row_bytes;
    if (ks == NULL) {
        const float *m = mins == NULL ? NULL : mins + o0 * per_feature;
        return (ChunkScales){scales + o0 * per_feature, m, q};
    }
    float *made_mins = six_bit ? NULL : buffer + count * per_feature;
    k_scales_of(ks, six_bit, o0, count, k, buffer, made_mins);
    return (ChunkScales){buffer, made_mins, q};
}

/* A thread's buffer for the scales chunk_scales makes from ks (floats of them), or
   NULL where ks is NULL; sets *failed when out of memory */
static float *scale_buffer(const KScaleRows *ks, int64_t floats, int *failed) {
    if (ks == NULL) return NULL;
    float *buffer = malloc(sizeof(float) * (size_t)floats);
    if (buffer == NULL) {
#pragma omp atomic write
        *failed = 1;
    }
    return buffer;
}

/* The next chunk of features for this thread (next_chunk's), or -1 when none is left
   or the thread has no buffer for the scales it must make */
static inline int64_t next_scaled_chunk(Share *shares, int count, int *victim,
                                        const KScaleRows *ks, const float *buffer) {
    if (ks != NULL && buffer == NULL) return -1;
    return next_chunk(shares, count, omp_get_thread_num(), victim);
}

/* x's rows with each block of 32 as int8 steps: quants [rows, k], scales and sums
   [rows, k / 32] (sums: the block's float32 sum, for Q4_1's mins) */
typedef struct {
    int8_t *quants;
    float *scales, *sums;
} QuantizedRows;

static void free_rows(QuantizedRows *rows) {
    free(rows->quants);
    free(rows->scales);
    free(rows->sums);
}

/* The sum of a block of 32, in one fixed order whatever the instruction set: the
   two halves added lane by lane, then halved again down to one (as 512-bit vectors
   reduce), so the vector and the portable builds agree bit for bit. */
static inline float block_sum(const float *xb) {
    float v[16];
    for (int i = 0; i < 16; i++) v[i] = xb[i] + xb[i + 16];
    for (int width = 8; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) v[i] = v[i] + v[i + width];
    return v[0];
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* A block's elements times inverse, rounded to nearest even (the default rounding
   mode, as nearbyintf); a NaN (a broken model's) becomes 0 */
static inline void round_block(const float *xb, float inverse, int8_t *quants) {
    const __m512 s = _mm512_set1_ps(inverse);
    const __m512 sa = _mm512_mul_ps(_mm512_loadu_ps(xb), s), sb = _mm512_mul_ps(_mm512_loadu_ps(xb + 16), s);
    const __m512i ia = _mm512_maskz_cvtps_epi32(_mm512_cmp_ps_mask(sa, sa, _CMP_ORD_Q), sa);
    const __m512i ib = _mm512_maskz_cvtps_epi32(_mm512_cmp_ps_mask(sb, sb, _CMP_ORD_Q), sb);
    _mm_storeu_si128((__m128i *)quants, _mm512_cvtsepi32_epi8(ia));
    _mm_storeu_si128((__m128i *)(quants + 16), _mm512_cvtsepi32_epi8(ib));
}

/* One block: its sum (block_sum's order), and with quants its step and int8 quants */
static inline void quantize_block(const float *xb, int with_quants, float *sum, float *step,
                                  int8_t *quants) {
    const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
    const __m512 v = _mm512_add_ps(a, b);
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), high);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    *sum = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
    if (!with_quants) return;
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    *step = amax / 127.f;
    round_block(xb, *step > 0.f ? 1.f / *step : 0.f, quants);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* round_block's portable C below, vectorized: the same rounding */
static inline void round_block(const float *xb, float inverse, int8_t *quants) {
    const __m256 s = _mm256_set1_ps(inverse);
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
        const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), s);
        /* nearest even, as nearbyintf in the default mode; a NaN becomes 0 */
        const __m256 rounded = _mm256_and_ps(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                             _mm256_cmp_ps(scaled, scaled, _CMP_ORD_Q));
        q[i] = _mm256_cvtps_epi32(rounded);
    }
    /* the packs work within 128-bit lanes: put the 32-bit groups back in order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)quants,
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* quantize_block's portable C below, vectorized: the same sum order (block_sum's), the
   same amax (a NaN skipped, as fmaxf skips it), the same rounding */
static inline void quantize_block(const float *xb, int with_quants, float *sum, float *step,
                                  int8_t *quants) {
    __m256 v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
    *sum = horizontal_sum(_mm256_add_ps(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3])));
    if (!with_quants) return;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) amax = _mm256_max_ps(_mm256_and_ps(v[i], magnitude), amax);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    *step = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))) / 127.f;
    round_block(xb, *step > 0.f ? 1.f / *step : 0.f, quants);
}
#else
static inline void round_block(const float *xb, float inverse, int8_t *quants) {
    for (int j = 0; j < BLOCK; j++) {
        const float v = xb[j] * inverse;
        /* a NaN (a broken model's) becomes 0: converting it to an integer is undefined */
        quants[j] = (int8_t)(v == v ? nearbyintf(v) : 0.f);
    }
}

static inline void quantize_block(const float *xb, int with_quants, float *sum, float *step,
                                  int8_t *quants) {
    *sum = block_sum(xb);
    if (!with_quants) return;
    float amax = 0.f;
    for (int j = 0; j < BLOCK; j++) amax = fmaxf(amax, fabsf(xb[j]));
    *step = amax / 127.f;
    round_block(xb, *step > 0.f ? 1.f / *step : 0.f, quants);
}
#endif

/* Each block's step is amax / 127, each element x / step rounded to nearest
   even (an all-zero block: step 0, quants 0); with_quants 0 computes the sums alone.
   Returns 1 when out of memory (nothing to free then). */
static int quantize_rows(const float *x, int64_t rows, int64_t k, int with_quants,
                         QuantizedRows *out) {
    const int64_t groups = k / BLOCK;
    out->quants = with_quants ? malloc((size_t)(rows * k)) : NULL;
    out->scales = with_quants ? malloc(sizeof(float) * (size_t)(rows * groups)) : NULL;
    out->sums = malloc(sizeof(float) * (size_t)(rows * groups));
    if (out->sums == NULL || (with_quants && (out->quants == NULL || out->scales == NULL))) {
        free_rows(out);
        return 1;
    }
    for (int64_t b = 0; b < rows * groups; b++)
        quantize_block(x + b * BLOCK, with_quants, out->sums + b,
                       with_quants ? out->scales + b : NULL,
                       with_quants ? out->quants + b * BLOCK : NULL);
    return 0;
}

/* y[0..FEATURE_GROUP) = features o ... of one row x (or its int8 rows xq) against Q4_1
   blocks, or Q5_1's with five_bits: a copy for each kind and arithmetic */
static void nibble_features_one_row(const uint8_t *quants, int five_bits, int int8_dots,
                                    int64_t o, const float *scales, const float *mins,
                                    const float *x, const QuantizedRows *xq, int64_t groups,
                                    float *y) {
    const int64_t bytes = groups * NIBBLE_BLOCK_BYTES(five_bits);
    const uint8_t *q = quants + o * bytes;
    const float *s = scales + o * groups, *m = mins + o * groups;
    if (int8_dots && five_bits)
        dot_int8_features(q, 1, 1, bytes, s, m, xq->sums, xq->quants, xq->scales, groups, y);
    else if (int8_dots)
        dot_int8_features(q, 1, 0, bytes, s, m, xq->sums, xq->quants, xq->scales, groups, y);
    else if (five_bits)
        dot_features(q, 1, 1, bytes, s, m, xq->sums, x, groups, y);
    else
        dot_features(q, 1, 0, bytes, s, m, xq->sums, x, groups, y);
}

/* Q4_1 blocks, or with five_bits Q5_1's (both a scale and a min per 32): scales and
   mins given, or made from ks (Q4_K's and Q5_K's own; then scales and mins are NULL) */
static int nibble_few_rows(const float *x, const uint8_t *quants, const float *scales,
                           const float *mins, const KScaleRows *ks, float *y, int64_t rows,
                           int64_t n, int64_t k, int int8_dots, int five_bits,
                           int num_threads) {
    const int64_t groups = k / BLOCK, chunks = (n + CHUNK - 1) / CHUNK;
    const int64_t block_size = NIBBLE_BLOCK_BYTES(five_bits);
    QuantizedRows xq;
    if (quantize_rows(x, rows, k, int8_dots, &xq)) return 1;
    Share *shares = new_shares(chunks, num_threads);
    if (shares == NULL) {
        free_rows(&xq);
        return 1;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *buffer = scale_buffer(ks, 2 * CHUNK * groups, &failed);
        int victim = 0;
        for (int64_t c; (c = next_scaled_chunk(shares, num_threads, &victim, ks, buffer)) >= 0;) {
            const int64_t o0 = c * CHUNK, end = n < o0 + CHUNK ? n : o0 + CHUNK;
            const ChunkScales cs = chunk_scales(ks, 0, quants, scales, mins, groups * block_size,
                                                groups, o0, end - o0, k, buffer);
            int64_t o = o0;
            if (rows == 1)
                for (; o + FEATURE_GROUP <= end; o += FEATURE_GROUP)
                    nibble_features_one_row(cs.quants, five_bits, int8_dots, o - o0, cs.scales,
                                            cs.mins, x, &xq, groups, y + o);
            for (; o < end; o++) {
                const uint8_t *qo = cs.quants + (o - o0) * groups * block_size;
                const float *so = cs.scales + (o - o0) * groups, *mo = cs.mins + (o - o0) * groups;
                for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
                    const int64_t count = rows - r0 < ROWS ? rows - r0 : ROWS;
                    float dots[ROWS];
                    const float *sums = xq.sums + r0 * groups;
                    if (int8_dots)
                        nibble_dot_int8_rows(qo, five_bits, so, mo, sums, xq.quants + r0 * k,
                                             xq.scales + r0 * groups, k, count, groups, dots);
                    else
                        nibble_dot_rows(qo, five_bits, so, mo, sums, x + r0 * k, k, count,
                                        groups, dots);
                    for (int64_t r = 0; r < count; r++) y[(r0 + r) * n + o] = dots[r];
                }
            }
        }
        free(buffer);
    }
    free_rows(&xq);
    free(shares);
    return failed;
}

/* y[0..FEATURE_GROUP) = features o ... of one row x (or its int8 rows xq) against Q8_0
   blocks, Q5_0's with five_bits, or Q8_16's with per_16 (without their mins), Q6_16's
   with six_bits too: a copy for each kind and arithmetic */
static void q8_features_one_row(const uint8_t *quants, int five_bits, int per_16, int six_bits,
                                int int8_dots, int64_t o, const float *scales, const float *x,
                                const QuantizedRows *xq, int64_t groups, float *y) {
    const int64_t bytes =
        groups * (per_16 ? PER_16_BLOCK_BYTES(six_bits) : SIGNED_BLOCK_BYTES(five_bits));
    const uint8_t *q = quants + o * bytes;
    const float *s = scales + o * groups * (per_16 ? 2 : 1);
    if (per_16 && int8_dots && six_bits)
        q8_16_dot_int8_features(q, 1, s, xq->quants, xq->scales, groups, y);
    else if (per_16 && int8_dots)
        q8_16_dot_int8_features(q, 0, s, xq->quants, xq->scales, groups, y);
    else if (per_16 && six_bits)
        q8_16_dot_features(q, 1, s, x, groups, y);
    else if (per_16)
        q8_16_dot_features(q, 0, s, x, groups, y);
    else if (int8_dots && five_bits)
        dot_int8_features(q, 0, 1, bytes, s, NULL, NULL, xq->quants, xq->scales, groups, y);
    else if (int8_dots)
        dot_int8_features(q, 0, 0, bytes, s, NULL, NULL, xq->quants, xq->scales, groups, y);
    else if (five_bits)
        dot_features(q, 0, 1, bytes, s, NULL, NULL, x, groups, y);
    else
        dot_features(q, 0, 0, bytes, s, NULL, NULL, x, groups, y);
}

/* sums[r * 2 * groups + h]: the sum of x's row r over weights 16h ... 16h + 15, in one
   fixed order (halves added lane by lane, then halved again), for Q8_16's mins; NULL
   when out of memory */
static float *half_sums(const float *x, int64_t rows, int64_t k) {
    const int64_t halves = k / HALF;
    float *sums = malloc(sizeof(float) * (size_t)(rows * halves));
    if (sums == NULL) return NULL;
    for (int64_t b = 0; b < rows * halves; b++) {
        const float *xb = x + b * HALF;
        float v[8];
        for (int i = 0; i < 8; i++) v[i] = xb[i] + xb[i + 8];
        for (int width = 4; width >= 1; width /= 2)
            for (int i = 0; i < width; i++) v[i] = v[i] + v[i + width];
        sums[b] = v[0];
    }
    return sums;
}

/* sum over the halves of min * (the half's sum of x) */
static inline float half_min_share(const float *mins, const float *sums, int64_t halves) {
    float share = 0.f;
    for (int64_t h = 0; h < halves; h++) share += mins[h] * sums[h];
    return share;
}

/* Q8_0 blocks (a scale per 32), with five_bits Q5_0's (the same, the signed quants
   read from five bits), or with per_16 Q8_16's (a scale per 16, and mins where they
   are not NULL), with six_bits too Q6_16's (no mins); Q6_16's scales may instead be
   made from ks (Q6_K's own: then scales and mins are NULL) */
static int q8_few_rows(const float *x, const void *quants, const float *scales,
                       const float *mins, const KScaleRows *ks, float *y, int64_t rows,
                       int64_t n, int64_t k, int int8_dots, int per_16, int five_bits,
                       int six_bits, int num_threads) {
    const int64_t groups = k / BLOCK, halves = k / HALF, chunks = (n + CHUNK - 1) / CHUNK;
    const int64_t per_feature = per_16 ? halves : groups; /* scales a feature has */
    const int64_t row_bytes =
        groups * (per_16 ? PER_16_BLOCK_BYTES(six_bits) : SIGNED_BLOCK_BYTES(five_bits));
    QuantizedRows xq = {NULL, NULL, NULL};
    if (int8_dots && quantize_rows(x, rows, k, 1, &xq)) return 1;
    float *sums = mins != NULL ? half_sums(x, rows, k) : NULL;
    Share *shares = new_shares(chunks, num_threads);
    if (shares == NULL || (mins != NULL && sums == NULL)) {
        free_rows(&xq);
        free(sums);
        free(shares);
        return 1;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *buffer = scale_buffer(ks, CHUNK * per_feature, &failed);
        int victim = 0;
        for (int64_t c; (c = next_scaled_chunk(shares, num_threads, &victim, ks, buffer)) >= 0;) {
            const int64_t o0 = c * CHUNK, end = n < o0 + CHUNK ? n : o0 + CHUNK;
            const ChunkScales cs = chunk_scales(ks, 1, quants, scales, mins, row_bytes,
                                                per_feature, o0, end - o0, k, buffer);
            int64_t o = o0;
            if (rows == 1)
                for (; o + FEATURE_GROUP <= end; o += FEATURE_GROUP) {
                    q8_features_one_row(cs.quants, five_bits, per_16, six_bits, int8_dots,
                                        o - o0, cs.scales, x, &xq, groups, y + o);
                    if (cs.mins != NULL)
                        for (int f = 0; f < FEATURE_GROUP; f++)
                            y[o + f] +=
                                half_min_share(cs.mins + (o - o0 + f) * halves, sums, halves);
                }
            for (; o < end; o++) {
                const uint8_t *qo = cs.quants + (o - o0) * row_bytes;
                const float *so = cs.scales + (o - o0) * per_feature;
                for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
                    const int64_t count = rows - r0 < ROWS ? rows - r0 : ROWS;
                    const int8_t *xq0 = xq.quants + r0 * k;
                    const float *xs0 = xq.scales + r0 * groups;
                    float dots[ROWS];
                    if (int8_dots && per_16)
                        q8_16_dot_int8_rows(qo, six_bits, so, xq0, xs0, k, count, groups, dots);
                    else if (int8_dots)
                        q8_0_dot_int8_rows(qo, five_bits, so, xq0, xs0, k, count, groups, dots);
                    else if (per_16)
                        q8_16_dot_rows(qo, six_bits, so, x + r0 * k, k, count, groups, dots);
                    else
                        q8_0_dot_rows(qo, five_bits, so, x + r0 * k, k, count, groups, dots);
                    for (int64_t r = 0; r < count; r++)
                        y[(r0 + r) * n + o] =
                            cs.mins == NULL
                                ? dots[r]
                                : dots[r] + half_min_share(cs.mins + (o - o0) * halves,
                                                           sums + (r0 + r) * halves, halves);
                }
            }
        }
        free(buffer);
    }
    free_rows(&xq);
    free(sums);
    free(shares);
    return failed;
}

#endif
