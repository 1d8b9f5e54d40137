/* Decode attention on its own (see decode_attention.h), for
   carpool.models.decode_kernel: one query token per sequence.

   q, out:       [num_seqs, num_heads, head_dim], float32, contiguous
   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32, or
   IEEE half where kv_half is 1 (kv_cache.h)
   block_tables: [num_seqs, max_blocks], int64; context_lens: [num_seqs], int64, >= 1;
   window: a sliding-window layer's window, 0 for none */

#include "abi.h"

#include "decode_attention.h"

int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens,
                           float *out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t max_blocks, int64_t window, float scale, int64_t kv_half,
                           int num_threads) {
    const AttentionShape a = {num_heads, num_kv_heads, head_dim, block_size, scale, kv_half != 0};
    return attend_all(&a, q, k_cache, v_cache, block_tables, max_blocks, context_lens, window,
                      num_seqs, out, num_threads);
}
