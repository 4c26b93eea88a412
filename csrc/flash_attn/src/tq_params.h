// Parameters of the split-KV decode kernel over a packed K/V cache.
#pragma once

#include <cstdint>

namespace flash_tq {

struct DecodeParams {
    // q [batch, seqlen_q, h, d] (turbo: already rotated); out like q; softmax_lse [batch, h, seqlen_q]
    const void *q;
    void *out;
    float *softmax_lse;
    // split-KV partial results: out_accum [splits, batch, h, seqlen_q, d], lse_accum [splits, batch, h, seqlen_q]
    float *out_accum;
    float *lse_accum;

    // codes uint8 [rows, cols, h_k, bytes] and meta half [rows, cols, h_k, 2]; rows = batch (contiguous)
    // or blocks (paged), cols = max_seqlen or page size
    const uint8_t *k_codes, *v_codes;
    const uint16_t *k_meta, *v_meta;

    int64_t q_batch_stride, q_row_stride, q_head_stride;     // elements
    int64_t o_batch_stride, o_row_stride, o_head_stride;     // elements
    int64_t kc_batch_stride, kc_row_stride, kc_head_stride;  // bytes
    int64_t vc_batch_stride, vc_row_stride, vc_head_stride;  // bytes
    int64_t km_batch_stride, km_row_stride, km_head_stride;  // halves
    int64_t vm_batch_stride, vm_row_stride, vm_head_stride;  // halves

    const int *seqlens_k;        // [batch]: attend over keys [0, min(seqlens_k[b], max_seqlen_k))
    int max_seqlen_k;            // cache capacity a sequence (cols, or max_blocks * page size)
    const int *cache_batch_idx;  // [batch] or nullptr: cache row of each batch entry
    const int *block_table;      // [batch, max_blocks] or nullptr
    int64_t block_table_batch_stride;
    int page_block_size, page_block_shift;  // a power of two and its log2

    // turbo: the sign vector of the randomized Hadamard rotation [d] (float); the kernel rotates q on
    // load and rotates the output back. nullptr: q and the codes share a domain (asym).
    const float *rot_signs;

    int b, seqlen_q, h, h_k, h_h_k_ratio;
    float scale_softmax_log2;  // softmax_scale * log2(e)
    int num_splits;
    bool is_causal;
};

// Quantize-on-write (tq_pack_kernel.h).
enum class Quant { kTurboUniform = 0, kTurboLloyd = 1, kAsym = 2 };

struct PackParams {
    const void *x;                   // [tokens, heads, d]
    int64_t x_token_stride, x_head_stride;
    const int64_t *slot_mapping;     // [tokens]; -1 skips the token
    uint8_t *codes;                  // [slots, heads, code_bytes] (contiguous)
    uint16_t *meta;                  // [slots, heads, 2] (contiguous)
    const float *signs;              // [d] turbo sign vector
    const float *levels;             // [2^bits] Lloyd-Max levels (unit variance)
    float inv_step, step;            // uniform grid
    int tokens, heads;
};

}  // namespace flash_tq
