// Torch bindings of flash_attn_tq's CUDA kernels, registered as torch.library ops under
// flash_attn_tq:: (so they trace under torch.compile and can be captured in CUDA graphs).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cmath>
#include <functional>
#include <limits>
#include <type_traits>

#include "src/tq_api.h"
#include "src/tq_cases.h"
#include "src/tq_heuristics.h"

namespace flash_tq {
namespace {

// Messages are string literals only: on one device image a message formatted from numbers (an
// ostream << int inside TORCH_CHECK) crashed in the C++ runtime; the Python wrappers in
// flash_attn_tq/ops.py check arguments first and give the detailed errors.
#define TQ_CHECK(cond, msg) TORCH_CHECK(cond, "flash_attn_tq: " msg)

#define CHECK_CUDA(t) TQ_CHECK((t).is_cuda(), #t " must be a CUDA tensor")

// The launch a plan chose (decode_kvcache's `kernel`; flash_attn_tq/ops.py KERNEL_IDS).
enum class Kernel { kDecode = 0, kPrefill = 1, kPrefillWgmma = 2 };

template <typename Elem>
constexpr at::ScalarType scalar_type_of() {
    return std::is_same_v<Elem, __half> ? at::kHalf : at::kBFloat16;
}

// Whether the case table (tq_cases.h) has a prefill kernel for these codes; the others run the decode
// kernel for every row count.
bool has_prefill(at::ScalarType dtype, int d, int k_bits, int v_bits, bool scale_only) {
#define TQ_HAS_PREFILL(Elem, D, K, V, S, P) \
    if (dtype == scalar_type_of<Elem>() && d == D && k_bits == K && v_bits == V && scale_only == S) return P;
    TQ_FOR_EACH_PACKED_CASE(TQ_HAS_PREFILL)
#undef TQ_HAS_PREFILL
    return false;
}

template <typename Elem, int kHeadDim, int kKBits, int kVBits, bool kScaleOnly, bool kHasPrefill>
void run_packed_case(bool prefill, const DecodeParams &p, cudaStream_t stream) {
    if constexpr (kHasPrefill) {
        if (prefill) {
            run_prefill<Elem, kHeadDim, kKBits, kVBits, kScaleOnly>(p, stream);
            return;
        }
    }
    run_decode<Elem, kHeadDim, kKBits, kVBits, kScaleOnly>(p, stream);
}

// A packed cache: the case table's entry for (dtype, head dim, bits, metadata).
void dispatch_packed(at::ScalarType dtype, int d, int k_bits, int v_bits, bool scale_only, bool prefill,
                     const DecodeParams &p, cudaStream_t stream) {
#define TQ_RUN_PACKED(Elem, D, K, V, S, P)                                                            \
    if (dtype == scalar_type_of<Elem>() && d == D && k_bits == K && v_bits == V && scale_only == S) { \
        run_packed_case<Elem, D, K, V, S, P>(prefill, p, stream);                                     \
        return;                                                                                       \
    }
    TQ_FOR_EACH_PACKED_CASE(TQ_RUN_PACKED)
#undef TQ_RUN_PACKED
    TQ_CHECK(false, "no fused kernel for this dtype, head_dim, k_bits and v_bits (flash_attn_tq.kernel_cases)");
}

// A float16/bfloat16 cache: the Fp16KV loader.
void dispatch_kv16(at::ScalarType dtype, int d, const DecodeParams &p, cudaStream_t stream) {
#define TQ_RUN_KV16(Elem, D)                         \
    if (dtype == scalar_type_of<Elem>() && d == D) { \
        run_decode_fp16<Elem, D>(p, stream);         \
        return;                                      \
    }
    TQ_FOR_EACH_KV16_CASE(TQ_RUN_KV16)
#undef TQ_RUN_KV16
    TQ_CHECK(false, "no float16-cache kernel for this dtype and head_dim");
}

// Two head groups in one launch: the case table's pair entry for (dtype, head dim, both groups' bits).
bool has_pair(at::ScalarType dtype, int d, int ka, int va, int kb, int vb) {
#define TQ_HAS_PAIR(Elem, D, KA, VA, KB, VB) \
    if (dtype == scalar_type_of<Elem>() && d == D && ka == KA && va == VA && kb == KB && vb == VB) return true;
    TQ_FOR_EACH_PAIR_CASE(TQ_HAS_PAIR)
#undef TQ_HAS_PAIR
    return false;
}

void dispatch_pair(at::ScalarType dtype, int d, int ka, int va, int kb, int vb, const DecodeParams &a,
                   const DecodeParams &b, cudaStream_t stream) {
#define TQ_RUN_PAIR(Elem, D, KA, VA, KB, VB)                                                         \
    if (dtype == scalar_type_of<Elem>() && d == D && ka == KA && va == VA && kb == KB && vb == VB) { \
        run_decode_pair<Elem, D, KA, VA, KB, VB, true>(a, b, stream);                                \
        return;                                                                                      \
    }
    TQ_FOR_EACH_PAIR_CASE(TQ_RUN_PAIR)
#undef TQ_RUN_PAIR
    TQ_CHECK(false, "no two-group kernel for this dtype, head_dim and bits (flash_attn_tq.kernel_cases)");
}

// A ring of window codes in the launch: the case table's ring entry for (dtype, head dim, the codes' bits).
bool has_ring(at::ScalarType dtype, int d, int k_bits, int v_bits, int ring_bits) {
#define TQ_HAS_RING(Elem, D, K, V, R) \
    if (dtype == scalar_type_of<Elem>() && d == D && k_bits == K && v_bits == V && ring_bits == R) return true;
    TQ_FOR_EACH_RING_CASE(TQ_HAS_RING)
#undef TQ_HAS_RING
    return false;
}

void dispatch_ring(at::ScalarType dtype, int d, int k_bits, int v_bits, int ring_bits, const DecodeParams &p,
                   const DecodeParams &r, cudaStream_t stream) {
#define TQ_RUN_RING(Elem, D, K, V, R)                                                                \
    if (dtype == scalar_type_of<Elem>() && d == D && k_bits == K && v_bits == V && ring_bits == R) { \
        run_decode_ring<Elem, D, K, V, true, R>(p, r, stream);                                       \
        return;                                                                                      \
    }
    TQ_FOR_EACH_RING_CASE(TQ_RUN_RING)
#undef TQ_RUN_RING
    TQ_CHECK(false, "no ring kernel for this dtype, head_dim and bits (flash_attn_tq.kernel_cases)");
}

// What the K/V store holds: packed codes (PackedKV) or the float16/bfloat16 cache itself (Fp16KV).
enum class Store { kPacked, kFp16 };

// A second head group attended by the same launch (group 1's stores): its kv heads, where they sit
// among the layer's, its bits, and what sets its packed store on a copy of the params.
struct Pair {
    int h_k, head, k_bits, v_bits;
    std::function<void(DecodeParams &)> set_store;
};

// A ring of window codes attended by the same launch (a window store): what sets its store (and its
// size as side_ring) on a copy of the params.
struct Ring {
    int bits;
    std::function<void(DecodeParams &)> set_store;
};

// Everything but the K/V pointers and strides: q/out/lse, lengths, batch map, block table, signs,
// num_splits; then the launch (k_bits / v_bits: the packed store's; pair: a second head group).
std::tuple<at::Tensor, at::Tensor> run_decode_op(
    Store store, DecodeParams &p, const at::Tensor &q, const at::Tensor &k_store, const at::Tensor &seqlens_k,
    const std::optional<at::Tensor> &cache_batch_idx, const std::optional<at::Tensor> &block_table,
    const std::optional<at::Tensor> &rot_signs, int k_bits, int v_bits, double softmax_scale, bool is_causal,
    int64_t num_splits, int64_t window_left, int64_t window_right, const std::optional<at::Tensor> &cache_leftpad,
    double softcap, Kernel kernel, const Pair *pair = nullptr, const Ring *ring = nullptr) {
    CHECK_CUDA(seqlens_k);
    TQ_CHECK(seqlens_k.scalar_type() == at::kInt && seqlens_k.dim() == 1 && seqlens_k.is_contiguous(),
             "seqlens_k must be contiguous int32 [batch]");
    const int b = q.size(0), seqlen_q = q.size(1), h = q.size(2), d = q.size(3);
    const int h_k = k_store.size(2) + (pair != nullptr ? pair->h_k : 0);
    TQ_CHECK(h_k > 0 && h % h_k == 0, "q heads must be a multiple of kv heads");
    TQ_CHECK(seqlens_k.size(0) == b, "seqlens_k must have batch entries");
    auto opts = q.options();
    at::Tensor out = at::empty_like(q);
    at::Tensor lse = at::empty({b, h, seqlen_q}, opts.dtype(at::kFloat));
    p.q = q.data_ptr();
    p.out = out.data_ptr();
    p.softmax_lse = lse.data_ptr<float>();
    p.q_batch_stride = q.stride(0);
    p.q_row_stride = q.stride(1);
    p.q_head_stride = q.stride(2);
    p.o_batch_stride = out.stride(0);
    p.o_row_stride = out.stride(1);
    p.o_head_stride = out.stride(2);
    p.seqlens_k = seqlens_k.data_ptr<int>();
    if (cache_batch_idx.has_value()) {
        CHECK_CUDA(*cache_batch_idx);
        TQ_CHECK(cache_batch_idx->scalar_type() == at::kInt && cache_batch_idx->numel() == b &&
                     cache_batch_idx->is_contiguous(),
                 "cache_batch_idx must be contiguous int32 [batch]");
        p.cache_batch_idx = cache_batch_idx->data_ptr<int>();
    }
    int max_seqlen_k = k_store.size(1);
    if (block_table.has_value()) {
        CHECK_CUDA(*block_table);
        // (row b of the batch, or with cache_batch_idx row cache_batch_idx[b]: the sequences' rows)
        TQ_CHECK(block_table->scalar_type() == at::kInt && block_table->dim() == 2 &&
                     (block_table->size(0) == b || (cache_batch_idx.has_value() && block_table->size(0) > 0)) &&
                     block_table->stride(1) == 1,
                 "block_table must be int32 [sequences, max_blocks] with a contiguous last dim");
        p.block_table = block_table->data_ptr<int>();
        p.block_table_batch_stride = block_table->stride(0);
        p.page_block_size = k_store.size(1);
        TQ_CHECK((p.page_block_size & (p.page_block_size - 1)) == 0, "page size must be a power of two");
        while ((1 << p.page_block_shift) < p.page_block_size) { ++p.page_block_shift; }
        max_seqlen_k = block_table->size(1) * p.page_block_size;
    }
    if (rot_signs.has_value()) {
        CHECK_CUDA(*rot_signs);
        TQ_CHECK(rot_signs->scalar_type() == at::kFloat && rot_signs->numel() == d && rot_signs->is_contiguous(),
                 "rot_signs must be contiguous float32 [head_dim]");
        p.rot_signs = rot_signs->data_ptr<float>();
    }
    p.max_seqlen_k = max_seqlen_k;
    // the rows cache_batch_idx may name; the kernels read row 0 for others and write NaN rows (cache_row)
    p.cache_rows = block_table.has_value() ? block_table->size(0) : k_store.size(0);
    p.b = b;
    p.seqlen_q = seqlen_q;
    p.h = h;
    p.h_k = h_k;
    p.h_h_k_ratio = h / h_k;
    p.scale_softmax_log2 = static_cast<float>(softmax_scale * M_LOG2E);
    p.is_causal = is_causal && seqlen_q > 1;
    if (cache_leftpad.has_value()) {
        CHECK_CUDA(*cache_leftpad);
        TQ_CHECK(
            cache_leftpad->scalar_type() == at::kInt && cache_leftpad->numel() == b && cache_leftpad->is_contiguous(),
            "cache_leftpad must be contiguous int32 [batch]");
        p.leftpad_k = cache_leftpad->data_ptr<int>();
    }
    p.softcap_log2 = softcap > 0 ? static_cast<float>(softcap * M_LOG2E) : 0.f;
    // upstream's conventions: a window at least the cache is none; causal closes it on the right
    p.window_left = window_left >= max_seqlen_k ? -1 : static_cast<int>(std::max<int64_t>(window_left, -1));
    p.window_right =
        is_causal ? 0 : (window_right >= max_seqlen_k ? -1 : static_cast<int>(std::max<int64_t>(window_right, -1)));

    const int rows = p.h_h_k_ratio * seqlen_q;
    if (p.rope_center != nullptr) {  // (the kernels' RoPE-center variant: tq_decode_launch.h)
        TQ_CHECK(!p.local(), "rope_center does not combine with window_size, softcap or cache_leftpad");
        TQ_CHECK(p.block_table == nullptr || p.page_block_size >= 32, "rope_center needs pages of 32 tokens or more");
    }
    const bool side = p.side_k != nullptr;
    TQ_CHECK(!(side || p.codes_tail > 0) || !p.local(),
             "a 16-bit side or codes_tail does not combine with window_size, softcap or cache_leftpad");
    // the plan's kernel: what the stores and this device can run (the choice is flash_attn_tq.dispatch's)
    const bool prefill = kernel != Kernel::kDecode;
    if (prefill) {
        TQ_CHECK(store == Store::kPacked && pair == nullptr && ring == nullptr &&
                     has_prefill(q.scalar_type(), d, k_bits, v_bits, p.meta_words == 1),
                 "kernel: no prefill kernel for these stores (the decode kernel takes them)");
        int smem_optin = 0;
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, q.get_device()));
        TQ_CHECK(smem_optin >= kPrefillSmemBudget, "kernel: the prefill kernel's shared memory does not fit this device");
    }
    if (kernel == Kernel::kPrefillWgmma) {
#ifdef FLASH_TQ_SM90A
        int major = 0, minor = 0;
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.get_device()));
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q.get_device()));
        TQ_CHECK(major == 9 && minor == 0, "kernel: the prefill kernel's wgmma variant runs on sm_90 devices only");
#else
        TQ_CHECK(false, "kernel: the prefill kernel's wgmma variant needs an sm_90a build (FLASH_ATTN_TQ_CUDA_ARCHS=90a)");
#endif
    }
    TQ_CHECK(p.rope_center == nullptr || kernel != Kernel::kPrefill,
             "kernel: the prefill kernel's RoPE-center term runs in its wgmma variant only");
    p.use_wgmma = kernel == Kernel::kPrefillWgmma;
    at::Tensor rope_table;
    if (prefill && p.rope_center != nullptr) {  // v(p) / |c| of every position (rope_table_kernel), for this call
        rope_table = at::empty({b, h_k, max_seqlen_k, d}, q.options());
        p.rope_table = rope_table.data_ptr();
        p.rope_table_len = max_seqlen_k;
    }
    const int rows_per_cta = prefill ? kPrefillRowsPerCta : (rows <= 8 ? 8 : 16);
    // a prefill CTA (8 warps, one an SM) counts as two 4-warp decode CTAs in the split heuristic
    const int ctas = b * h_k * ((rows + rows_per_cta - 1) / rows_per_cta) * (prefill ? 2 : 1);
    int num_sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, q.get_device()));
    // keys a row can see at most: the local window's span when there is one
    const int span = p.window_left >= 0 ? std::min<int64_t>(max_seqlen_k, p.window_left + seqlen_q + 1) : max_seqlen_k;
    // (the decode kernel's side CTAs share its launch; the prefill kernel's side is a launch of its own)
    p.num_splits = num_splits > 0 ? static_cast<int>(num_splits)
                                  : side && !prefill ? choose_num_splits(ctas, span, num_sms, kSidePerSmX20, ctas)
                                                     : choose_num_splits(ctas, span, num_sms);
    // the side pass: one more split, merged by the combine kernel (prefill over one code split: by the
    // prefill kernel, run_prefill)
    const int pair_splits = pair == nullptr || num_splits > 0
                                ? p.num_splits
                                : pair_num_splits(p.num_splits, span, k_bits, v_bits, pair->k_bits, pair->v_bits);
    p.num_splits += (side ? 1 : 0) + (ring != nullptr ? 1 : 0);  // (the ring's split: decode_ring_kernel)
    p.has_ring = ring != nullptr;
    const int slots = std::max(p.num_splits, pair_splits + (side ? 1 : 0));  // (the split buffers' count)
    at::Tensor out_accum, lse_accum;
    if (slots > 1) {
        out_accum = at::empty({slots, b, h, seqlen_q, d}, opts.dtype(at::kFloat));
        lse_accum = at::empty({slots, b, h, seqlen_q}, opts.dtype(at::kFloat));
        p.out_accum = out_accum.data_ptr<float>();
        p.lse_accum = lse_accum.data_ptr<float>();
    }
    auto stream = c10::cuda::getCurrentCUDAStream().stream();
    if (pair != nullptr) {  // the layer's q, out and split buffers, each group's codes (DecodeParams::head_base)
        DecodeParams g = p;
        pair->set_store(g);
        g.h_k = pair->h_k;
        g.num_splits = pair_splits + 1;
        g.head_base = pair->head;
        p.h_k -= pair->h_k;
        p.head_skip_from = pair->head;
        p.head_skip = pair->h_k;
        dispatch_pair(q.scalar_type(), d, k_bits, v_bits, pair->k_bits, pair->v_bits, p, g, stream);
    } else if (ring != nullptr) {
        DecodeParams r = p;
        ring->set_store(r);
        dispatch_ring(q.scalar_type(), d, k_bits, v_bits, ring->bits, p, r, stream);
    } else if (store == Store::kFp16) {
        dispatch_kv16(q.scalar_type(), d, p, stream);
    } else {
        dispatch_packed(q.scalar_type(), d, k_bits, v_bits, p.meta_words == 1, prefill, p, stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {out, lse};
}

void check_query(const at::Tensor &q) {
    CHECK_CUDA(q);
    TQ_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, "q must be float16 or bfloat16");
    TQ_CHECK(q.dim() == 4 && q.stride(-1) == 1,
             "q must be [batch, seqlen_q, heads, head_dim] with a contiguous last dim");
    TQ_CHECK(q.size(3) == 64 || q.size(3) == 128, "head_dim must be 64 or 128 for the fused kernel");
    // rows are read and written d / 32 values a lane at a time
    const int64_t vec = q.size(3) / 32;
    TQ_CHECK(reinterpret_cast<uintptr_t>(q.data_ptr()) % (2 * vec) == 0 && q.stride(0) % vec == 0 &&
                 q.stride(1) % vec == 0 && q.stride(2) % vec == 0,
             "q rows must be aligned to head_dim / 16 bytes");
}

// the kernel multiplies token and block indices by 32-bit row / block strides
void check_strides_32bit(const at::Tensor &t, bool paged) {
    const int64_t int_max = std::numeric_limits<int>::max();
    TQ_CHECK(t.stride(1) * t.element_size() <= int_max && (!paged || t.stride(0) * t.element_size() <= int_max),
             "cache strides must fit in 32 bits");
}

// One head group's packed store: codes and metadata, its RoPE center, its 16-bit side (the arguments
// of decode_kvcache after v_bits; paged: the block table's rows are the side's).
void set_packed_store(DecodeParams &p, const at::Tensor &q, const at::Tensor &k_codes, const at::Tensor &k_meta,
                      const at::Tensor &v_codes, const at::Tensor &v_meta, int64_t k_bits, int64_t v_bits,
                      const std::optional<at::Tensor> &block_table, const std::optional<at::Tensor> &rope_center,
                      const std::optional<at::Tensor> &rope_inv_freq, int64_t rope_offset,
                      const std::optional<at::Tensor> &side_k, const std::optional<at::Tensor> &side_v,
                      int64_t side_sinks, int64_t side_ring, int64_t codes_tail) {
    CHECK_CUDA(k_codes);
    CHECK_CUDA(v_codes);
    CHECK_CUDA(k_meta);
    CHECK_CUDA(v_meta);
    TQ_CHECK(k_codes.scalar_type() == at::kByte && v_codes.scalar_type() == at::kByte, "k_codes/v_codes must be uint8");
    TQ_CHECK(k_meta.scalar_type() == at::kHalf && v_meta.scalar_type() == at::kHalf, "k_meta/v_meta must be float16");
    TQ_CHECK(k_codes.dim() == 4 && v_codes.dim() == 4 && k_meta.dim() == 4 && v_meta.dim() == 4,
             "codes/meta must be 4-D");
    TQ_CHECK(k_codes.stride(-1) == 1 && v_codes.stride(-1) == 1 && k_meta.stride(-1) == 1 && v_meta.stride(-1) == 1,
             "codes/meta need a contiguous last dim");
    const int d = q.size(3);
    TQ_CHECK(k_codes.size(3) == d * k_bits / 8 && v_codes.size(3) == d * v_bits / 8,
             "code bytes do not match head_dim and bits");
    TQ_CHECK(k_meta.size(3) == v_meta.size(3) && (k_meta.size(3) == 2 || k_meta.size(3) == 1),
             "k_meta/v_meta must both end in (scale, offset) or both in (scale)");
    // cp.async copies of whole code rows (16, 8 or 4 bytes a copy, as the row's bytes divide: the
    // loader's chunk()) need their alignment, at every row a stride reaches
    for (const auto &[t, row_bytes] : {std::pair<const at::Tensor *, int64_t>{&k_codes, d * k_bits / 8},
                                       std::pair<const at::Tensor *, int64_t>{&v_codes, d * v_bits / 8}}) {
        const int64_t chunk = row_bytes % 16 == 0 ? 16 : (row_bytes % 8 == 0 ? 8 : 4);
        TQ_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % chunk == 0 && t->stride(0) % chunk == 0 &&
                     t->stride(1) % chunk == 0 && t->stride(2) % chunk == 0,
                 "k_codes/v_codes rows must be aligned to their copy size (16, 8 or 4 bytes)");
    }
    for (const at::Tensor *t : {&k_codes, &v_codes, &k_meta, &v_meta}) {
        check_strides_32bit(*t, block_table.has_value());
    }
    p.k_codes = k_codes.data_ptr<uint8_t>();
    p.v_codes = v_codes.data_ptr<uint8_t>();
    p.k_meta = reinterpret_cast<const uint16_t *>(k_meta.data_ptr());
    p.v_meta = reinterpret_cast<const uint16_t *>(v_meta.data_ptr());
    p.kc_batch_stride = k_codes.stride(0);
    p.kc_row_stride = k_codes.stride(1);
    p.kc_head_stride = k_codes.stride(2);
    p.vc_batch_stride = v_codes.stride(0);
    p.vc_row_stride = v_codes.stride(1);
    p.vc_head_stride = v_codes.stride(2);
    p.km_batch_stride = k_meta.stride(0);
    p.km_row_stride = k_meta.stride(1);
    p.km_head_stride = k_meta.stride(2);
    p.vm_batch_stride = v_meta.stride(0);
    p.vm_row_stride = v_meta.stride(1);
    p.vm_head_stride = v_meta.stride(2);
    p.meta_words = static_cast<int>(k_meta.size(3));
    TQ_CHECK(rope_center.has_value() == rope_inv_freq.has_value(),
             "rope_center and rope_inv_freq must be given together");
    if (rope_center.has_value()) {
        CHECK_CUDA(*rope_center);
        CHECK_CUDA(*rope_inv_freq);
        TQ_CHECK(rope_center->scalar_type() == at::kFloat && rope_center->dim() == 3 &&
                     rope_center->size(0) == q.size(0) && rope_center->size(1) == k_codes.size(2) &&
                     rope_center->size(2) == d && rope_center->stride(2) == 1 && rope_center->stride(1) == d,
                 "rope_center must be float32 [batch, kv_heads, head_dim] with contiguous rows");
        TQ_CHECK(rope_inv_freq->scalar_type() == at::kFloat && rope_inv_freq->numel() == d / 2 &&
                     rope_inv_freq->is_contiguous(),
                 "rope_inv_freq must be contiguous float32 [head_dim / 2]");
        TQ_CHECK(std::abs(rope_offset) < (1 << 24), "rope_offset must be below 2^24 in magnitude");
        p.rope_center = rope_center->data_ptr<float>();
        p.rope_center_batch_stride = rope_center->stride(0);
        p.rope_inv_freq = rope_inv_freq->data_ptr<float>();
        p.rope_offset = static_cast<int>(rope_offset);
    }
    TQ_CHECK(side_k.has_value() == side_v.has_value(), "side_k and side_v must be given together");
    TQ_CHECK(side_sinks >= 0 && side_ring >= 0 && codes_tail >= 0, "side_sinks, side_ring and codes_tail must be >= 0");
    TQ_CHECK(side_k.has_value() || (side_sinks == 0 && side_ring == 0),
             "side_sinks / side_ring need side_k and side_v");
    if (side_k.has_value()) {
        for (const at::Tensor *t : {&*side_k, &*side_v}) {
            CHECK_CUDA(*t);
            TQ_CHECK(t->scalar_type() == q.scalar_type() && t->dim() == 4 && t->size(1) >= side_sinks + side_ring &&
                         side_sinks + side_ring > 0 && t->size(2) == k_codes.size(2) && t->size(3) == d,
                     "side_k/side_v must be [rows, >= side_sinks + side_ring > 0, kv_heads, head_dim] in q's dtype");
            TQ_CHECK(t->stride(3) == 1 && t->stride(2) % 8 == 0 && t->stride(1) % 8 == 0 && t->stride(0) % 8 == 0 &&
                         reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                     "side_k/side_v rows must be contiguous and 16-byte aligned");
            TQ_CHECK(t->stride(1) * t->element_size() <= std::numeric_limits<int>::max(),
                     "side strides must fit in 32 bits");
        }
        TQ_CHECK(side_k->strides() == side_v->strides() && side_k->sizes() == side_v->sizes(),
                 "side_k and side_v must share shape and strides");
        // rows: the cache's sequences (indexed like the codes or the block table, by cache_batch_idx)
        TQ_CHECK(side_k->size(0) >= (block_table.has_value() ? block_table->size(0) : k_codes.size(0)),
                 "side_k/side_v have too few rows");
        p.side_k = side_k->data_ptr();
        p.side_v = side_v->data_ptr();
        p.side_batch_stride = side_k->stride(0);
        p.side_row_stride = side_k->stride(1);
        p.side_head_stride = side_k->stride(2);
        p.side_sinks = static_cast<int>(side_sinks);
        p.side_ring = static_cast<int>(side_ring);
    }
    // (a ring of window codes, passed apart, leaves the side its sinks: side_ring 0)
    TQ_CHECK(side_ring == 0 || side_ring >= codes_tail,
             "side_ring must hold the recent window: side_ring >= codes_tail (or 0)");
    p.codes_tail = static_cast<int>(codes_tail);
}

// A call's K/V stores: the ops' `stores` and `layout` (six ints a store: kind, head group, K bits, V
// bits, a, b), as flash_attn_tq/ops.py flattens them. Kinds: a head group's codes (a: the tokens at the
// end that a side or a ring holds instead; b: a second group's first kv head among the layer's), its
// 16-bit side (a sinks, then b recent slots), a ring of window codes, a group's RoPE center, a
// float16/bfloat16 cache.
enum class StoreKind : int64_t { kCodes = 0, kSide = 1, kWindow = 2, kCenter = 3, kKv16 = 4 };
constexpr size_t kLayoutInts = 6;

struct StoreView {
    int index = -1, group = 0, k_bits = 0, v_bits = 0, a = 0, b = 0;  // (index: its place in the layout)
    std::vector<at::Tensor> t;  // its tensors (none: the call has no such store)
    bool present() const { return !t.empty(); }
    std::optional<at::Tensor> get(size_t i) const { return present() ? std::optional<at::Tensor>(t[i]) : std::nullopt; }
};

// The tensors a store of `kind` brings (a pack without v: the K half).
size_t store_tensors(StoreKind kind, bool with_v) {
    const size_t n = kind == StoreKind::kCenter ? 1 : (kind == StoreKind::kCodes || kind == StoreKind::kWindow ? 4 : 2);
    return with_v ? n : n / 2;
}

// The one unpacker of both ops: each store in its place, at most one of a kind a head group.
struct Stores {
    StoreView codes[2], side[2], center[2], window, kv16;
};

Stores unpack_stores(at::TensorList tensors, at::IntArrayRef layout, bool with_v) {
    TQ_CHECK(layout.size() % kLayoutInts == 0, "layout must hold six ints a store");
    Stores out;
    size_t used = 0;
    for (size_t i = 0; i < layout.size(); i += kLayoutInts) {
        const int64_t kind = layout[i], group = layout[i + 1];
        TQ_CHECK(kind >= 0 && kind <= 4, "layout: a store's kind must be 0 to 4 (flash_attn_tq.ops)");
        TQ_CHECK(group == 0 || group == 1, "layout: a store's head group must be 0 or 1");
        const auto k = static_cast<StoreKind>(kind);
        TQ_CHECK(group == 0 || k == StoreKind::kCodes || k == StoreKind::kSide || k == StoreKind::kCenter,
                 "layout: a ring or a 16-bit cache belongs to head group 0");
        StoreView *slot = k == StoreKind::kCodes    ? &out.codes[group]
                          : k == StoreKind::kSide   ? &out.side[group]
                          : k == StoreKind::kCenter ? &out.center[group]
                          : k == StoreKind::kWindow ? &out.window
                                                    : &out.kv16;
        TQ_CHECK(!slot->present(), "stores: at most one store of a kind a head group");
        const size_t n = store_tensors(k, with_v);
        TQ_CHECK(used + n <= tensors.size(), "stores: fewer tensors than the layout names");
        slot->t.assign(tensors.begin() + used, tensors.begin() + used + n);
        used += n;
        slot->index = static_cast<int>(i / kLayoutInts);
        slot->group = static_cast<int>(group);
        slot->k_bits = static_cast<int>(layout[i + 2]);
        slot->v_bits = static_cast<int>(layout[i + 3]);
        slot->a = static_cast<int>(layout[i + 4]);
        slot->b = static_cast<int>(layout[i + 5]);
    }
    TQ_CHECK(used == tensors.size(), "stores: more tensors than the layout names");
    return out;
}

// A float16/bfloat16 cache as the K/V store (the Fp16KV loader).
void set_kv16_store(DecodeParams &p, const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache,
                    bool paged) {
    CHECK_CUDA(k_cache);
    CHECK_CUDA(v_cache);
    TQ_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
             "k_cache/v_cache must have q's dtype");
    TQ_CHECK(
        k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == q.size(3),
        "k_cache/v_cache must be [rows, cols, kv_heads, head_dim] like q's head_dim");
    // 16-byte cp.async of every row: contiguous rows at 16-byte aligned addresses
    for (const at::Tensor *t : {&k_cache, &v_cache}) {
        TQ_CHECK(t->stride(3) == 1 && t->stride(2) % 8 == 0 && t->stride(1) % 8 == 0 && t->stride(0) % 8 == 0 &&
                     reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                 "k_cache/v_cache rows must be contiguous and 16-byte aligned");
        check_strides_32bit(*t, paged);
    }
    p.k_codes = reinterpret_cast<const uint8_t *>(k_cache.data_ptr());
    p.v_codes = reinterpret_cast<const uint8_t *>(v_cache.data_ptr());
    p.kc_batch_stride = 2 * k_cache.stride(0);
    p.kc_row_stride = 2 * k_cache.stride(1);
    p.kc_head_stride = 2 * k_cache.stride(2);
    p.vc_batch_stride = 2 * v_cache.stride(0);
    p.vc_row_stride = 2 * v_cache.stride(1);
    p.vc_head_stride = 2 * v_cache.stride(2);
}

// A head group's codes, RoPE center and 16-bit side (group g of the stores) into p.
void set_group(DecodeParams &p, const at::Tensor &q, const Stores &s, int g, const std::optional<at::Tensor> &block_table,
               const std::optional<at::Tensor> &rope_inv_freq, int64_t rope_offset) {
    const StoreView &c = s.codes[g], &side = s.side[g];
    set_packed_store(p, q, c.t[0], c.t[1], c.t[2], c.t[3], c.k_bits, c.v_bits, block_table, s.center[g].get(0),
                     s.center[g].present() ? rope_inv_freq : std::nullopt, rope_offset, side.get(0), side.get(1),
                     side.a, side.b, c.a);
}

std::tuple<at::Tensor, at::Tensor> decode_kvcache(
    const at::Tensor &q,          // [b, seqlen_q, h, d]
    const at::Tensor &seqlens_k,  // [b] int32
    const std::optional<at::Tensor> &cache_batch_idx, const std::optional<at::Tensor> &block_table,
    const std::optional<at::Tensor> &cache_leftpad,
    at::TensorList stores,   // the K/V stores (unpack_stores)
    at::IntArrayRef layout,  // six ints a store
    const std::optional<at::Tensor> &rot_signs,      // turbo: [d] float32 Hadamard signs (rotate q in, output out)
    const std::optional<at::Tensor> &rope_inv_freq,  // with RoPE centers: [d / 2] float32
    int64_t rope_offset,                             // a key's RoPE position = its index + rope_offset
    int64_t kernel_id, double softmax_scale, bool is_causal, int64_t num_splits, int64_t window_left,
    int64_t window_right, double softcap) {
    check_query(q);
    c10::cuda::CUDAGuard guard(q.device());
    TQ_CHECK(kernel_id >= 0 && kernel_id <= 2, "kernel must be 0 (decode), 1 (prefill) or 2 (prefill, wgmma)");
    const auto kernel = static_cast<Kernel>(kernel_id);
    const Stores s = unpack_stores(stores, layout, true);
    DecodeParams p{};
    if (s.kv16.present()) {
        TQ_CHECK(!s.codes[0].present() && !s.codes[1].present() && !s.side[0].present() && !s.side[1].present() &&
                     !s.center[0].present() && !s.center[1].present() && !s.window.present(),
                 "stores: a 16-bit cache is attended alone");
        TQ_CHECK(kernel == Kernel::kDecode && window_left < 0 && window_right < 0 && !cache_leftpad.has_value() &&
                     softcap == 0.0,
                 "a 16-bit cache takes the decode kernel without window_size, cache_leftpad or softcap");
        const at::Tensor &k = s.kv16.t[0];
        set_kv16_store(p, q, k, s.kv16.t[1], block_table.has_value());
        return run_decode_op(Store::kFp16, p, q, k, seqlens_k, cache_batch_idx, block_table, std::nullopt, 0, 0,
                             softmax_scale, is_causal, num_splits, -1, -1, std::nullopt, 0.0, kernel);
    }
    TQ_CHECK(s.codes[0].present(), "stores: the codes of head group 0 are missing");
    const StoreView &codes = s.codes[0];
    set_group(p, q, s, 0, block_table, rope_inv_freq, rope_offset);
    if (s.window.present()) {
        const StoreView &w = s.window;
        TQ_CHECK(!s.codes[1].present() && !block_table.has_value() && s.side[0].present() && s.side[0].b == 0,
                 "a ring of window codes takes one head group, a contiguous cache and a side of sinks alone");
        const at::Tensor &rk = w.t[0];
        TQ_CHECK(rk.dim() == 4 && rk.size(1) > 0 && rk.size(1) == codes.a && rk.size(0) >= codes.t[0].size(0) &&
                     rk.size(2) == codes.t[0].size(2),
                 "ring codes must be [rows, the codes' tail, kv_heads, bytes] beside the codes");
        const int ring_bits = w.k_bits;
        TQ_CHECK(w.v_bits == ring_bits && rk.size(3) * 8 == static_cast<int64_t>(q.size(3)) * ring_bits,
                 "ring codes must hold head_dim * bits / 8 bytes a vector, K and V at one width");
        TQ_CHECK(p.meta_words == 1 && has_ring(q.scalar_type(), q.size(3), codes.k_bits, codes.v_bits, ring_bits),
                 "no ring kernel for this dtype, head_dim, bits and metadata (flash_attn_tq.kernel_cases)");
        const Ring ring{ring_bits, [&](DecodeParams &r) {
                            set_packed_store(r, q, rk, w.t[1], w.t[2], w.t[3], ring_bits, ring_bits, block_table,
                                             s.center[0].get(0), s.center[0].present() ? rope_inv_freq : std::nullopt,
                                             rope_offset, s.side[0].get(0), s.side[0].get(1), s.side[0].a, 0, codes.a);
                            r.side_ring = static_cast<int>(rk.size(1));  // (the ring's slots map to positions as a side's)
                            TQ_CHECK(r.meta_words == 1, "ring metadata must be the scale alone, as the codes'");
                            for (const at::Tensor *t : {&rk, &w.t[2]}) {
                                TQ_CHECK(t->sizes() == rk.sizes() && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0 &&
                                             t->stride(0) % 16 == 0 && t->stride(1) % 16 == 0 && t->stride(2) % 16 == 0,
                                         "ring codes must be 16-byte aligned rows of one shape");
                            }
                            TQ_CHECK(w.t[1].size(0) == rk.size(0) && w.t[1].size(1) == rk.size(1) &&
                                         w.t[1].size(2) == rk.size(2) && w.t[3].sizes() == w.t[1].sizes(),
                                     "ring metadata must be [rows, R, kv_heads, 1] beside the ring codes");
                        }};
        TQ_CHECK(kernel == Kernel::kDecode, "kernel: a ring of window codes takes the decode kernel");
        return run_decode_op(Store::kPacked, p, q, codes.t[0], seqlens_k, cache_batch_idx, block_table, rot_signs,
                             codes.k_bits, codes.v_bits, softmax_scale, is_causal, num_splits, window_left,
                             window_right, cache_leftpad, softcap, kernel, nullptr, &ring);
    }
    if (!s.codes[1].present()) {
        TQ_CHECK(!s.side[1].present() && !s.center[1].present(), "stores: head group 1 has a side or center but no codes");
        return run_decode_op(Store::kPacked, p, q, codes.t[0], seqlens_k, cache_batch_idx, block_table, rot_signs,
                             codes.k_bits, codes.v_bits, softmax_scale, is_causal, num_splits, window_left,
                             window_right, cache_leftpad, softcap, kernel);
    }
    const StoreView &codes2 = s.codes[1];
    TQ_CHECK(kernel == Kernel::kDecode, "kernel: two head groups take the decode kernel");
    TQ_CHECK(s.center[1].present() == s.center[0].present() && s.side[1].present() && s.side[0].present(),
             "two head groups need a 16-bit side each and the RoPE center in both or neither");
    TQ_CHECK(s.side[1].a == s.side[0].a && s.side[1].b == s.side[0].b && codes2.a == codes.a,
             "two head groups' sides must hold as many sinks and recent slots");
    TQ_CHECK(!block_table.has_value(), "two head groups take contiguous caches");
    TQ_CHECK(p.meta_words == 1 && codes2.t[1].dim() == 4 && codes2.t[1].size(3) == 1,
             "two head groups take scale-only metadata");
    TQ_CHECK(codes2.t[0].dim() == 4 && codes2.t[0].size(0) == codes.t[0].size(0) &&
                 codes2.t[0].size(1) == codes.t[0].size(1),
             "both head groups' codes must hold the same rows and capacity");
    TQ_CHECK(has_pair(q.scalar_type(), q.size(3), codes.k_bits, codes.v_bits, codes2.k_bits, codes2.v_bits),
             "no two-group kernel for this dtype, head_dim and bits (flash_attn_tq.kernel_cases)");
    const int h_k = codes.t[0].size(2), h_k2 = codes2.t[0].size(2);
    TQ_CHECK(h_k2 > 0 && codes2.b >= 0 && codes2.b <= h_k,
             "the second group's first kv head must place its kv heads among the layer's");
    TQ_CHECK(q.size(2) % (h_k + h_k2) == 0 && (q.size(2) / (h_k + h_k2)) * q.size(1) < kPrefillMinRows,
             "two head groups take decode-sized calls (fewer query rows a kv head than the prefill kernel's)");
    const Pair pair{h_k2, codes2.b, codes2.k_bits, codes2.v_bits,
                    [&](DecodeParams &g) { set_group(g, q, s, 1, block_table, rope_inv_freq, rope_offset); }};
    return run_decode_op(Store::kPacked, p, q, codes.t[0], seqlens_k, cache_batch_idx, block_table, rot_signs,
                         codes.k_bits, codes.v_bits, softmax_scale, is_causal, num_splits, window_left, window_right,
                         cache_leftpad, softcap, kernel, &pair);
}

// The extension's build, for flash_attn_tq.dispatch: [sm_90a code built (the prefill kernel's wgmma
// variant), the prefill kernel's shared memory a CTA in bytes].
std::vector<int64_t> build_info() {
#ifdef FLASH_TQ_SM90A
    const int64_t sm90a = 1;
#else
    const int64_t sm90a = 0;
#endif
    return {sm90a, kPrefillSmemBudget};
}

// One pack's vectors and destination (x, codes, meta) and quantizer constants into p; the slots
// (start / slot_mapping, rows, cols) are the caller's.
void set_pack_vectors(PackParams &p, const at::Tensor &x, at::Tensor &codes, at::Tensor &meta, int64_t bits,
                      int64_t quant, const std::optional<at::Tensor> &signs, const std::optional<at::Tensor> &levels,
                      double step) {
    CHECK_CUDA(x);
    CHECK_CUDA(codes);
    CHECK_CUDA(meta);
    TQ_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, "x must be float16 or bfloat16");
    TQ_CHECK(x.dim() == 3 && x.stride(-1) == 1, "x must be [tokens, heads, head_dim] with a contiguous last dim");
    TQ_CHECK(x.stride(0) % 8 == 0 && x.stride(1) % 8 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
             "x rows must be 16-byte aligned (16-byte loads)");
    TQ_CHECK(x.numel() < std::numeric_limits<int>::max() && x.size(0) * x.stride(0) < std::numeric_limits<int>::max(),
             "x must have fewer than 2**31 elements (split the call)");
    const int d = x.size(2);
    TQ_CHECK(d == 64 || d == 128, "head_dim must be 64 or 128 for the pack kernel");
    // the kernel stores a thread's code run in 2-, 4-, 8- or 16-byte words and (scale, offset) as one 4-byte word
    const int64_t code_align = bits == 8 ? d / 8 : (bits == 4 ? 8 : (bits == 2 ? 4 : 2));
    TQ_CHECK(codes.stride(3) == 1 && codes.stride(0) % code_align == 0 && codes.stride(1) % code_align == 0 &&
                 codes.stride(2) % code_align == 0 && reinterpret_cast<uintptr_t>(codes.data_ptr()) % code_align == 0,
             "codes rows must be contiguous and aligned");
    const int meta_words = meta.dim() == 4 ? static_cast<int>(meta.size(3)) : 0;
    TQ_CHECK(meta.dim() == 4 && meta.stride(3) == 1 &&
                 (meta_words == 1 || (meta.stride(0) % 2 == 0 && meta.stride(1) % 2 == 0 && meta.stride(2) % 2 == 0 &&
                                      reinterpret_cast<uintptr_t>(meta.data_ptr()) % 4 == 0)),
             "meta rows must be contiguous (and 4-byte aligned for (scale, offset))");
    TQ_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 4 && codes.size(2) == x.size(1) &&
                 codes.size(3) == d * bits / 8,
             "codes must be uint8 [rows, cols, heads, head_dim * bits / 8]");
    TQ_CHECK(meta.scalar_type() == at::kHalf && meta.dim() == 4 && meta.size(0) == codes.size(0) &&
                 meta.size(1) == codes.size(1) && meta.size(2) == x.size(1) && (meta.size(3) == 2 || meta.size(3) == 1),
             "meta must be float16 [rows, cols, heads, 2 or 1]");
    TQ_CHECK(meta_words == 2 || quant == static_cast<int64_t>(Quant::kTurboUniform),
             "scale-only meta (last dim 1) needs turbo's uniform grid with the norm fit (offset = -mid * scale)");
    TQ_CHECK(quant >= 0 && quant <= 3,
             "quant must be 0 (turbo uniform), 1 (turbo Lloyd-Max), 2 (asym) or 3 (turbo, fit mean)");
    p.x = x.data_ptr();
    p.x_token_stride = static_cast<int>(x.stride(0));
    p.x_head_stride = static_cast<int>(x.stride(1));
    p.tokens = x.size(0);
    p.heads = x.size(1);
    p.codes = codes.data_ptr<uint8_t>();
    p.meta = reinterpret_cast<uint16_t *>(meta.data_ptr());
    p.codes_row_stride = codes.stride(0);
    p.codes_col_stride = codes.stride(1);
    p.codes_head_stride = codes.stride(2);
    p.meta_row_stride = meta.stride(0);
    p.meta_col_stride = meta.stride(1);
    p.meta_head_stride = meta.stride(2);
    p.meta_words = meta_words;
    if (quant != 2) {
        TQ_CHECK(signs.has_value() && signs->scalar_type() == at::kFloat && signs->numel() == d && signs->is_cuda(),
                 "turbo needs signs: float32 CUDA [head_dim]");
        p.signs = signs->data_ptr<float>();
    }
    if (quant == 1) {
        TQ_CHECK(levels.has_value() && levels->scalar_type() == at::kFloat && levels->numel() == (1 << bits) &&
                     levels->is_cuda(),
                 "Lloyd-Max needs levels: float32 CUDA [2**bits]");
        p.levels = levels->data_ptr<float>();
    }
    p.step = static_cast<float>(step);
    p.inv_step = static_cast<float>(1.0 / step);
}

// The ring of window codes x is also quantized into (after the slots are set: p.batch_rows): codes
// [batch rows, ring, heads, d * ring_bits / 8] uint8 and metadata [..., meta_words] half, a chunk's
// last `ring` tokens at slot p % ring.
void set_pack_ring(PackParams &p, const at::Tensor &x, const at::Tensor &codes, const at::Tensor &meta, int64_t quant,
                   int64_t ring_bits, double ring_step) {
    CHECK_CUDA(codes);
    CHECK_CUDA(meta);
    TQ_CHECK(p.slot_mapping == nullptr && p.block_table == nullptr,
             "a ring of window codes needs start and a contiguous cache (no slot_mapping, no block_table)");
    TQ_CHECK(quant == static_cast<int64_t>(Quant::kTurboUniform) && ring_bits == 4 && ring_step > 0.0,
             "a ring of window codes takes 4-bit codes on turbo's uniform grid");
    const int d = x.size(2);
    TQ_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 4 && codes.size(0) >= p.batch_rows &&
                 codes.size(1) > 0 && codes.size(2) == x.size(1) && codes.size(3) == d * ring_bits / 8 &&
                 codes.stride(3) == 1 && codes.stride(2) % 2 == 0 && codes.stride(1) % 2 == 0 &&
                 codes.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(codes.data_ptr()) % 2 == 0,
             "ring_codes must be uint8 [batch rows, ring, heads, head_dim * ring_bits / 8] with 2-byte aligned rows");
    TQ_CHECK(meta.scalar_type() == at::kHalf && meta.dim() == 4 && meta.size(0) == codes.size(0) &&
                 meta.size(1) == codes.size(1) && meta.size(2) == codes.size(2) && meta.size(3) == p.meta_words &&
                 meta.stride(3) == 1,
             "ring_meta must be float16 [batch rows, ring, heads, the codes' meta words]");
    p.ring_codes = codes.data_ptr<uint8_t>();
    p.ring_meta = reinterpret_cast<uint16_t *>(meta.data_ptr());
    p.ring_codes_batch_stride = codes.stride(0);
    p.ring_codes_slot_stride = codes.stride(1);
    p.ring_codes_head_stride = codes.stride(2);
    p.ring_meta_batch_stride = meta.stride(0);
    p.ring_meta_slot_stride = meta.stride(1);
    p.ring_meta_head_stride = meta.stride(2);
    p.ring = static_cast<int>(codes.size(1));
    p.ring_bits = static_cast<int>(ring_bits);
    p.ring_inv_step = static_cast<float>(1.0 / ring_step);
}

// The 16-bit side's half x is copied into (after the slots are set: p.batch_rows).
void set_pack_side(PackParams &p, const at::Tensor &x, const at::Tensor &side, int64_t side_sinks, int64_t side_ring,
                   bool slot_mapping) {
    CHECK_CUDA(side);
    TQ_CHECK(!slot_mapping, "side needs start (not slot_mapping)");
    TQ_CHECK(side.scalar_type() == x.scalar_type() && side.dim() == 4 && side.size(0) >= p.batch_rows &&
                 side.size(1) == side_sinks + side_ring + 1 && side.size(2) == x.size(1) && side.size(3) == x.size(2),
             "side must be [batch rows, side_sinks + side_ring + 1, heads, head_dim] in x's dtype");
    TQ_CHECK(side.stride(3) == 1 && side.stride(0) % 8 == 0 && side.stride(1) % 8 == 0 && side.stride(2) % 8 == 0 &&
                 reinterpret_cast<uintptr_t>(side.data_ptr()) % 16 == 0,
             "side rows must be contiguous and 16-byte aligned");
    TQ_CHECK(side_sinks >= 0 && side_ring >= 0, "side_sinks and side_ring must be >= 0");
    p.side = side.data_ptr();
    p.side_batch_stride = side.stride(0);
    p.side_slot_stride = side.stride(1);
    p.side_head_stride = side.stride(2);
    p.side_sinks = static_cast<int>(side_sinks);
    p.side_ring = static_cast<int>(side_ring);
}

// Quantize-on-write of x [tokens, heads, d] into codes/meta (pack_kv's stores, unpacked). Token t goes
// to slot_mapping[t] (as vLLM's reshape_and_cache; -1 skips), or, without one, to position start[i] + j
// of cache row batch_idx[i] (t = i * n + j, n = tokens / start.size(0)), through block_table when
// paged: the kernel resolves and range-checks the slots and ORs PackError bits into error_flags.
// Without a slot mapping it can also keep the append's books (PackParams): the 16-bit side copy of
// sinks and recent tokens (side [batch rows, side_sinks + side_ring + 1, heads, d], x's dtype), the
// RoPE center (rope_center [batch rows, heads, d] and rope_inv_freq [d / 2], float32) and a ring of
// window codes. With v (x's shape: the values of the same tokens, x the keys) v_codes / v_meta /
// v_side / v_ring_* receive v in the same launch. With lengths (int32 [rows]: the cache's seqlens;
// start may overlap them only where start[i] is the element lengths[row] itself) and tally (int32
// [1], zero between calls), the launch ends with lengths[row] = start[i] + n, unless it met an error.
void pack_into(const at::Tensor &x,                            // [tokens, heads, d] fp16/bf16
             const std::optional<at::Tensor> &slot_mapping,  // [tokens] int64
             const std::optional<at::Tensor> &start,         // [batch] int32
             const std::optional<at::Tensor> &batch_idx,     // [batch] int32
             const std::optional<at::Tensor> &block_table,   // [cache rows, max_blocks] int32
             at::Tensor &codes,  // [rows, cols, heads, bytes] uint8 (any strides, contiguous rows)
             at::Tensor &meta,   // [rows, cols, heads, 2] half
             const std::optional<at::Tensor> &error_flags,  // [1] int32
             int64_t capacity, int64_t bits, int64_t quant, const std::optional<at::Tensor> &signs,
             const std::optional<at::Tensor> &levels, double step, const std::optional<at::Tensor> &side,
             int64_t side_sinks, int64_t side_ring, const std::optional<at::Tensor> &rope_center,
             const std::optional<at::Tensor> &rope_inv_freq, int64_t rope_offset, const std::optional<at::Tensor> &v,
             const std::optional<at::Tensor> &v_codes, const std::optional<at::Tensor> &v_meta, int64_t v_bits,
             double v_step, const std::optional<at::Tensor> &v_signs, const std::optional<at::Tensor> &v_levels,
             const std::optional<at::Tensor> &v_side, const std::optional<at::Tensor> &lengths,
             const std::optional<at::Tensor> &tally, const std::optional<at::Tensor> &ring_codes,
             const std::optional<at::Tensor> &ring_meta, const std::optional<at::Tensor> &v_ring_codes,
             const std::optional<at::Tensor> &v_ring_meta, int64_t ring_bits, double ring_step) {
    TQ_CHECK(slot_mapping.has_value() != start.has_value(), "give either slot_mapping or start");
    c10::cuda::CUDAGuard guard(x.device());
    PackParams p{};
    set_pack_vectors(p, x, codes, meta, bits, quant, signs, levels, step);
    const int d = x.size(2);
    p.rows = codes.size(0);
    p.cols = codes.size(1);
    p.capacity = static_cast<int>(capacity);
    p.batch_rows = p.rows;
    if (slot_mapping.has_value()) {
        CHECK_CUDA(*slot_mapping);
        TQ_CHECK(slot_mapping->scalar_type() == at::kLong && slot_mapping->numel() == x.size(0) &&
                     slot_mapping->is_contiguous(),
                 "slot_mapping must be contiguous int64 [tokens]");
        p.slot_mapping = slot_mapping->data_ptr<int64_t>();
    } else {
        CHECK_CUDA(*start);
        TQ_CHECK(start->scalar_type() == at::kInt && start->dim() == 1 && start->is_contiguous() &&
                     start->numel() > 0 && x.size(0) % start->numel() == 0,
                 "start must be contiguous int32 [batch] with tokens a multiple of batch");
        p.start = start->data_ptr<int>();
        p.n_new = x.size(0) / start->numel();
        if (batch_idx.has_value()) {
            CHECK_CUDA(*batch_idx);
            TQ_CHECK(batch_idx->scalar_type() == at::kInt && batch_idx->numel() == start->numel() &&
                         batch_idx->is_contiguous(),
                     "batch_idx must be contiguous int32 [batch]");
            p.batch_idx = batch_idx->data_ptr<int>();
        }
        if (block_table.has_value()) {
            CHECK_CUDA(*block_table);
            TQ_CHECK(block_table->scalar_type() == at::kInt && block_table->dim() == 2 && block_table->stride(1) == 1,
                     "block_table must be int32 [rows, max_blocks] with a contiguous last dim");
            TQ_CHECK((p.cols & (p.cols - 1)) == 0, "page size must be a power of two");
            p.block_table = block_table->data_ptr<int>();
            p.block_table_stride = static_cast<int>(block_table->stride(0));
            p.batch_rows = block_table->size(0);
            while ((1 << p.page_shift) < p.cols) { ++p.page_shift; }
        }
    }
    if (error_flags.has_value()) {
        CHECK_CUDA(*error_flags);
        TQ_CHECK(error_flags->scalar_type() == at::kInt && error_flags->numel() >= 1, "error_flags must be int32 [1]");
        p.error_flags = error_flags->data_ptr<int>();
    }
    if (side.has_value()) { set_pack_side(p, x, *side, side_sinks, side_ring, slot_mapping.has_value()); }
    TQ_CHECK(ring_codes.has_value() == ring_meta.has_value() && v_ring_codes.has_value() == v_ring_meta.has_value(),
             "give ring codes and their meta together");
    if (ring_codes.has_value()) { set_pack_ring(p, x, *ring_codes, *ring_meta, quant, ring_bits, ring_step); }
    if (rope_center.has_value()) {
        CHECK_CUDA(*rope_center);
        TQ_CHECK(!slot_mapping.has_value(), "rope_center needs start (not slot_mapping)");
        TQ_CHECK(rope_center->scalar_type() == at::kFloat && rope_center->dim() == 3 &&
                     rope_center->size(0) >= p.batch_rows && rope_center->size(1) == x.size(1) &&
                     rope_center->size(2) == d && rope_center->stride(2) == 1,
                 "rope_center must be float32 [batch rows, heads, head_dim] with a contiguous last dim");
        TQ_CHECK(rope_inv_freq.has_value() && rope_inv_freq->is_cuda() && rope_inv_freq->scalar_type() == at::kFloat &&
                     rope_inv_freq->numel() == d / 2 && rope_inv_freq->is_contiguous(),
                 "rope_center needs rope_inv_freq: float32 CUDA [head_dim / 2]");
        p.rope_center = rope_center->data_ptr<float>();
        p.rc_batch_stride = rope_center->stride(0);
        p.rc_head_stride = rope_center->stride(1);
        p.rope_inv_freq = rope_inv_freq->data_ptr<float>();
        p.rope_offset = static_cast<int>(rope_offset);
    }
    TQ_CHECK(lengths.has_value() == tally.has_value(), "give lengths and tally together");
    if (lengths.has_value()) {
        CHECK_CUDA(*lengths);
        CHECK_CUDA(*tally);
        TQ_CHECK(!slot_mapping.has_value(), "lengths needs start (not slot_mapping)");
        TQ_CHECK(lengths->scalar_type() == at::kInt && lengths->dim() == 1 && lengths->is_contiguous(),
                 "lengths must be contiguous int32 [rows]");
        TQ_CHECK(tally->scalar_type() == at::kInt && tally->numel() >= 1, "tally must be int32 [1]");
        p.lengths = lengths->data_ptr<int>();
        p.lengths_rows = static_cast<int>(lengths->numel());
        p.tally = reinterpret_cast<unsigned *>(tally->data_ptr<int>());
    }
    auto stream = c10::cuda::getCurrentCUDAStream().stream();
    const bool half = x.scalar_type() == at::kHalf;
    if (!v.has_value()) {
        TQ_CHECK(!v_codes.has_value() && !v_meta.has_value() && !v_side.has_value() && !v_ring_codes.has_value(),
                 "v_codes, v_meta, v_side and v_ring_codes need v");
        if (d == 64) {
            half ? run_pack<__half, 64>(p, bits, quant, stream) : run_pack<__nv_bfloat16, 64>(p, bits, quant, stream);
        } else {
            half ? run_pack<__half, 128>(p, bits, quant, stream) : run_pack<__nv_bfloat16, 128>(p, bits, quant, stream);
        }
    } else {
        TQ_CHECK(v_codes.has_value() && v_meta.has_value(), "v needs v_codes and v_meta");
        TQ_CHECK(v->sizes() == x.sizes() && v->scalar_type() == x.scalar_type(), "v must match x's shape and dtype");
        TQ_CHECK(v_codes->dim() == 4 && v_codes->size(0) == p.rows && v_codes->size(1) == p.cols,
                 "v_codes must have the K codes' rows and columns");
        TQ_CHECK(v_side.has_value() == side.has_value(), "give side and v_side together");
        TQ_CHECK(v_ring_codes.has_value() == ring_codes.has_value(), "give ring_codes and v_ring_codes together");
        PackParams pv = p;
        pv.rope_center = nullptr;  // (the RoPE center is K's)
        pv.side = nullptr;
        pv.ring_codes = nullptr;
        at::Tensor vc = *v_codes, vm = *v_meta;
        set_pack_vectors(pv, *v, vc, vm, v_bits, quant, v_signs, v_levels, v_step);
        if (v_side.has_value()) { set_pack_side(pv, *v, *v_side, side_sinks, side_ring, false); }
        if (v_ring_codes.has_value()) {
            set_pack_ring(pv, *v, *v_ring_codes, *v_ring_meta, quant, ring_bits, ring_step);
        }
        const int kb = static_cast<int>(bits), vb = static_cast<int>(v_bits), qt = static_cast<int>(quant);
        if (d == 64) {
            half ? run_pack_pair<__half, 64>(p, pv, kb, vb, qt, stream)
                 : run_pack_pair<__nv_bfloat16, 64>(p, pv, kb, vb, qt, stream);
        } else {
            half ? run_pack_pair<__half, 128>(p, pv, kb, vb, qt, stream)
                 : run_pack_pair<__nv_bfloat16, 128>(p, pv, kb, vb, qt, stream);
        }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void pack_kv(const at::Tensor &k,                            // [tokens, heads, d] fp16/bf16
             const std::optional<at::Tensor> &v,             // the values of the same tokens
             const std::optional<at::Tensor> &slot_mapping,  // [tokens] int64
             const std::optional<at::Tensor> &start,         // [batch] int32
             const std::optional<at::Tensor> &batch_idx,     // [batch] int32
             const std::optional<at::Tensor> &block_table,   // [cache rows, max_blocks] int32
             at::TensorList stores,                          // the codes, a 16-bit side, a ring (unpack_stores)
             at::IntArrayRef layout, c10::ArrayRef<double> steps,  // a store's K and V grid steps
             const std::optional<at::Tensor> &k_signs, const std::optional<at::Tensor> &v_signs,
             const std::optional<at::Tensor> &k_levels, const std::optional<at::Tensor> &v_levels,
             const std::optional<at::Tensor> &rope_center, const std::optional<at::Tensor> &rope_inv_freq,
             int64_t rope_offset, const std::optional<at::Tensor> &error_flags,
             const std::optional<at::Tensor> &lengths, const std::optional<at::Tensor> &tally, int64_t capacity,
             int64_t quant) {
    const bool with_v = v.has_value();
    const Stores s = unpack_stores(stores, layout, with_v);
    TQ_CHECK(steps.size() * kLayoutInts == layout.size() * 2, "steps must hold two a store");
    TQ_CHECK(s.codes[0].present() && !s.codes[1].present() && !s.side[1].present() && !s.center[0].present() &&
                 !s.kv16.present(),
             "stores: a pack writes one group's codes, and its side and ring");
    auto step_of = [&](const StoreView &view, int i) { return view.present() ? steps[2 * view.index + i] : 1.0; };
    const StoreView &c = s.codes[0], &side = s.side[0], &w = s.window;
    at::Tensor codes = c.t[0], meta = c.t[1];
    const std::optional<at::Tensor> none;
    pack_into(k, slot_mapping, start, batch_idx, block_table, codes, meta, error_flags, capacity, c.k_bits, quant,
              k_signs, k_levels, step_of(c, 0), side.get(0), side.a, side.b, rope_center, rope_inv_freq, rope_offset,
              v, with_v ? c.get(2) : none, with_v ? c.get(3) : none, c.v_bits, step_of(c, 1), v_signs, v_levels,
              with_v ? side.get(1) : none, lengths, tally, w.get(0), w.get(1), with_v ? w.get(2) : none,
              with_v ? w.get(3) : none, w.k_bits, step_of(w, 0));
}

}  // namespace
}  // namespace flash_tq

TORCH_LIBRARY(flash_attn_tq, m) {
    m.def(
        "decode_kvcache(Tensor q, Tensor seqlens_k, Tensor? cache_batch_idx, Tensor? block_table, "
        "Tensor? cache_leftpad, Tensor[] stores, int[] layout, Tensor? rot_signs, Tensor? rope_inv_freq, "
        "int rope_offset, int kernel, float softmax_scale, bool is_causal, int num_splits, int window_left, "
        "int window_right, float softcap) -> (Tensor, Tensor)");
    m.def(
        "pack_kv(Tensor k, Tensor? v, Tensor? slot_mapping, Tensor? start, Tensor? batch_idx, Tensor? block_table, "
        "Tensor(a!)[] stores, int[] layout, float[] steps, Tensor? k_signs, Tensor? v_signs, Tensor? k_levels, "
        "Tensor? v_levels, Tensor? rope_center, Tensor? rope_inv_freq, int rope_offset, Tensor(b!)? error_flags, "
        "Tensor(c!)? lengths, Tensor(d!)? tally, int capacity, int quant) -> ()");
    m.def("build_info() -> int[]", &flash_tq::build_info);  // (no tensors: a catch-all kernel)
}

TORCH_LIBRARY_IMPL(flash_attn_tq, CUDA, m) {
    m.impl("decode_kvcache", &flash_tq::decode_kvcache);
    m.impl("pack_kv", &flash_tq::pack_kv);
}

// Built into another extension (upstream's flash_attn_2_cuda, see patches/), that one owns the module.
#ifndef FLASH_TQ_NO_PYBIND_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "flash_attn_tq CUDA kernels; the ops are registered as torch.ops.flash_attn_tq.*";
}
#endif
