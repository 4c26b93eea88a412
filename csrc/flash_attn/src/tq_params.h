// Parameters of the split-KV decode kernel over a packed K/V cache.
#pragma once

#include <cstdint>

namespace flash_tq {

// Shared memory a prefill CTA may use (PrefillTraits::kSmemBytes, every case, is checked against
// it): sm_80's 163 KB; devices that give a CTA less run the decode kernel instead.
constexpr int kPrefillSmemBudget = 163 * 1024;

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
    int meta_words;  // halves a token's metadata: 2 (scale, offset) or 1 (the scale; PackedKV<..., kScaleOnly>)

    const int *seqlens_k;        // [batch]: attend over keys [0, min(seqlens_k[b], max_seqlen_k))
    int max_seqlen_k;            // cache capacity a sequence (cols, or max_blocks * page size)
    const int *cache_batch_idx;  // [batch] or nullptr: cache row of each batch entry
    int cache_rows;              // rows cache_batch_idx may name: [0, cache_rows) (cache_row, tq_rows.h)
    const int *block_table;      // [batch, max_blocks] or nullptr
    int64_t block_table_batch_stride;
    int page_block_size, page_block_shift;  // a power of two and its log2

    // turbo: the sign vector of the randomized Hadamard rotation [d] (float); the kernel rotates q on
    // load and rotates the output back. nullptr: q and the codes share a domain (asym).
    const float *rot_signs;

    // key_center='rope' (tq_rope_center.h): the codes hold k - R(pos) c at pos = key index + rope_offset;
    // rope_center [b, h_k, d] (float, c of each batch entry and kv head; batch stride in floats) and
    // rope_inv_freq [d / 2] (the model's RoPE frequencies, rotate-half pairs). nullptr: no such term.
    const float *rope_center;
    int64_t rope_center_batch_stride;
    const float *rope_inv_freq;
    int rope_offset;
    // The prefill kernel's form of that term: H R(pos) c of every key position, in the codes' domain
    // and the loader's K slot order (rope_table_kernel), [b, h_k, rope_table_len, d] in q's dtype.
    const void *rope_table;
    int rope_table_len;

    // The 16-bit side of a packed cache (its sink tokens and recent-token ring, attended by the decode
    // kernel's side pass, tq_decode_kernel.h): side_k / side_v [rows, side_sinks + side_ring, h_k, d]
    // in q's dtype, row bc = cache_batch_idx[b] (or b); strides in elements. Key p < side_sinks is in
    // slot p, a key among the last side_ring in slot side_sinks + p % side_ring. nullptr: no side.
    const void *side_k, *side_v;
    int64_t side_batch_stride, side_row_stride, side_head_stride;
    int side_sinks, side_ring;
    // The codes' keys of a sequence of n keys: [side_sinks, n - codes_tail) (the tail: the recent
    // tokens another pass attends); causal alignment counts all n.
    int codes_tail;
    // The tail as a ring of window codes in the same launch (decode_ring_kernel): its split is the one
    // before the side's, and the ring's own params (the same but for the store) hold its codes as the
    // packed store and its size as side_ring.
    bool has_ring;
    // The side's split (num_splits - 1) was written by an earlier launch and the codes are one split:
    // the prefill kernel merges the side's partial rows into its output (no combine kernel).
    bool side_first;

    int b, seqlen_q, h, h_k, h_h_k_ratio;
    // One of two head groups attended by one launch (run_decode_pair): kv head hk of this group's
    // codes is the layer's kv head hk + head_base, plus head_skip from hk = head_skip_from on (the
    // other group's heads), which places its query rows in q, out and the split buffers (h: the
    // layer's heads). All zero: the codes hold every kv head.
    int head_base, head_skip_from, head_skip;
    float scale_softmax_log2;  // softmax_scale * log2(e)
    int num_splits;
    bool is_causal;
    bool use_wgmma;  // the prefill kernel's Hopper variant (an sm_90 device, sm_90a code built)
    // local attention: row i (bottom-right position pos = seqlen_k - seqlen_q + i) sees keys
    // [pos - window_left, pos + window_right]; -1: unbounded (the host sets window_right = 0 when causal)
    int window_left, window_right;
    const int *leftpad_k;  // [batch] or nullptr: keys before leftpad_k[b] are padding (upstream's cache_leftpad)
    float softcap_log2;    // 0: none; else scores s -> c tanh(s / c), c = softcap * log2(e) (scores are base 2)
    // a lower key bound or softcap: the kernels' kLocal variant (the others compile them out)
    bool local() const { return window_left >= 0 || leftpad_k != nullptr || softcap_log2 > 0.f; }
};

// Quantize-on-write (tq_pack_kernel.h).
// kTurboMean: turbo's uniform grid fitted around the rotated vector's mean (fit="mean" in
// flash_attn_tq/quantizers.py): (scale, offset) = (|r| / |c - mean(c)|, mean - scale * mean(c)).
enum class Quant { kTurboUniform = 0, kTurboLloyd = 1, kAsym = 2, kTurboMean = 3 };

// Error bits the pack kernel ORs into error_flags (the token is skipped, nothing is written for it).
enum PackError { kPackNonFinite = 1, kPackPosition = 2, kPackBatchIndex = 4, kPackBlock = 8 };

struct PackParams {
    const void *x;                      // [tokens, heads, d]
    int x_token_stride, x_head_stride;  // elements (x has < 2^31 elements, checked on the host)
    // Where token t goes: slot_mapping[t] (-1 skips it), or, without a slot mapping, position
    // start[i] + j of cache row batch_idx[i] (t = i * n_new + j; batch_idx nullptr: row i), through
    // block_table when paged. Slot = row * cols + col of the codes tensor.
    const int64_t *slot_mapping;
    const int *start, *batch_idx, *block_table;
    int n_new, block_table_stride, page_shift;
    int rows, cols, capacity;  // codes.shape[0], codes.shape[1], positions a sequence holds
    int batch_rows;            // sequences (codes rows, or block_table rows when paged)
    int *error_flags;          // [1] or nullptr: PackError bits
    uint8_t *codes;            // [rows, cols, heads, code_bytes], any strides (bytes) with a contiguous last dim
    uint16_t *meta;            // [rows, cols, heads, meta_words], strides in halves
    int meta_words;            // 2: (scale, offset); 1: the scale alone (turbo norm fit: offset = -mid * scale)
    int64_t codes_row_stride, codes_col_stride, codes_head_stride;
    int64_t meta_row_stride, meta_col_stride, meta_head_stride;
    const float *signs;    // [d] turbo sign vector
    const float *levels;   // [2^bits] Lloyd-Max levels (unit variance)
    float inv_step, step;  // uniform grid
    int tokens, heads;
    // Without a slot mapping, the append's bookkeeping in the same launch (each nullptr: not done):
    // - side [batch rows, side_sinks + side_ring + 1, heads, d] (x's dtype, strides in elements): the
    //   16-bit copy of the vector as given, sink p < side_sinks to slot p, a chunk's last side_ring
    //   tokens to slot side_sinks + p % side_ring (QuantizedKVCache.kv_side, one of K or V);
    // - rope_center [batch rows, heads, d] float32 (strides in floats), rope_inv_freq [d / 2]: the
    //   codes hold x - R(p + rope_offset) c, rounded to x's dtype (key_center='rope').
    void *side;
    int64_t side_batch_stride, side_slot_stride, side_head_stride;
    int side_sinks, side_ring;
    const float *rope_center, *rope_inv_freq;
    int64_t rc_batch_stride, rc_head_stride;
    int rope_offset;
    // - ring_codes [batch rows, ring, heads, ring code bytes] uint8 and ring_meta [..., meta_words] half
    //   (strides in bytes / halves): a chunk's last `ring` tokens also as ring_bits-wide codes on turbo's
    //   uniform grid (ring_inv_step), token p in slot p % ring (QuantizedKVCache's window codes, read by
    //   the decode kernel's ring split);
    uint8_t *ring_codes;
    uint16_t *ring_meta;
    int64_t ring_codes_batch_stride, ring_codes_slot_stride, ring_codes_head_stride;
    int64_t ring_meta_batch_stride, ring_meta_slot_stride, ring_meta_head_stride;
    int ring, ring_bits;
    float ring_inv_step;
    // - lengths [lengths_rows] (QuantizedKVCache.seqlens; may be start itself): once every CTA has
    //   placed its vectors, lengths[row of entry i] = start[i] + n_new, unless a CTA met an error
    //   (then no length moves); tally [1] counts the CTAs that finished, zero between launches.
    int *lengths;
    unsigned *tally;
    int lengths_rows;
};

}  // namespace flash_tq
