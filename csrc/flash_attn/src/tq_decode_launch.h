// Host-side launch of the decode kernel (+ the split combine) for one (dtype, head_dim, loader) case.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <type_traits>
#include <utility>

#include "tq_decode_kernel.h"

namespace flash_tq {

// Whether `kernel`'s code on `device` was compiled for sm_90 or later, so that its griddepcontrol
// wait exists (a compute_80 PTX JIT-compiled on a newer GPU has none: it must launch plainly). Asked
// once a (kernel, device): cudaFuncGetAttributes costs host time.
inline bool has_dependency_wait(const void *kernel, int device) {
    static std::mutex mutex;
    static std::map<std::pair<const void *, int>, bool> known;
    std::lock_guard<std::mutex> lock(mutex);
    const auto key = std::make_pair(kernel, device);
    auto it = known.find(key);
    if (it == known.end()) {
        cudaFuncAttributes attr = {};
        const bool sm90 = cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.ptxVersion >= 90;
        it = known.emplace(key, sm90).first;
    }
    return it->second;
}

// A launch of `kernel`; `dependent`: as a programmatic dependent of the stream's previous kernel
// (Hopper and later, code compiled for them, unless FLASH_ATTN_TQ_PDL=0): it may start as that
// kernel's last CTAs run, and reads what that kernel writes only after pdl_wait (which returns at
// once after a plain launch).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, int threads, int smem, cudaStream_t stream, bool dependent,
            const Args &...args) {
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute attr;
    if (dependent) {
        int device = 0;
        cudaGetDevice(&device);
        const char *env = std::getenv("FLASH_ATTN_TQ_PDL");  // (read each launch: an A/B in one process)
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        config.attrs = &attr;
        const bool off = env != nullptr && env[0] == '0';
        config.numAttrs = !off && has_dependency_wait(reinterpret_cast<const void *>(kernel), device) ? 1 : 0;
    }
    cudaLaunchKernelEx(&config, kernel, args...);  // (errors: the caller's launch check)
}

// Merge the splits; nothing to do for one split. Many rows over at most 32 splits: a warp a row,
// else a CTA a row.
template <typename Elem, int kHeadDim>
void launch_combine(const DecodeParams &p, cudaStream_t stream) {
    if (p.num_splits > 1) {
        const int64_t rows = static_cast<int64_t>(p.b) * p.h * p.seqlen_q;
        if (rows >= 2048 && p.num_splits <= 32) {
            launch(combine_rows_kernel<Elem, kHeadDim>, dim3((rows + 3) / 4), 128, 0, stream, true, p);
        } else {
            launch(decode_combine_kernel<Elem, kHeadDim>, dim3(rows), 128, 0, stream, true, p);
        }
    }
}

// A split kernel over (split, batch * kv head, query-row blocks of Traits::kRows): the decode kernel
// or the prefill kernel (tq_prefill_launch.h).
// cudaFuncSetAttribute once a (kernel, device): the call costs tens of microseconds of host time
// (an eager decode call over 50 KB of shared memory took 60 us against 17 us replayed, H200).
inline void allow_smem(const void *kernel, int smem) {
    static std::mutex mutex;
    static std::set<std::pair<const void *, int>> done;
    int device = 0;
    cudaGetDevice(&device);
    std::lock_guard<std::mutex> lock(mutex);
    if (done.insert({kernel, device}).second) {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    }
}

template <typename Traits, bool kRope, bool kSide>
constexpr int split_smem_bytes() {
    if constexpr (kSide) {  // the side pass's CTAs run in the same launch (tq_decode_kernel.h)
        constexpr int main = split_smem_bytes<Traits, kRope, false>(), side = SideTraits<Traits>::kSmemBytes;
        return main > side ? main : side;
    } else if constexpr (kRope) {
        return Traits::kRopeSmemBytes;
    } else {
        return Traits::kSmemBytes;
    }
}

// splits: the grid's splits (0: p.num_splits; the prefill kernel leaves a side's split to launch_side_rows).
// dependent: a programmatic dependent of the stream's previous kernel (the decode kernels wait for it
// first thing: decode_split; for the prefill kernel see run_prefill).
template <typename Traits, bool kRope = false, bool kSide = false>
void launch_split(void (*kernel)(const DecodeParams), const DecodeParams &p, cudaStream_t stream, int splits = 0,
                  bool dependent = true) {
    constexpr int smem = split_smem_bytes<Traits, kRope, kSide>();
    if constexpr (smem > 48 * 1024) { allow_smem(reinterpret_cast<const void *>(kernel), smem); }
    const int rows = p.h_h_k_ratio * p.seqlen_q;
    dim3 grid(splits > 0 ? splits : p.num_splits, p.b * p.h_k, (rows + Traits::kRows - 1) / Traits::kRows);
    launch(kernel, grid, Traits::kNThreads, smem, stream, dependent, p);
}

// Contiguous and paged packed caches get their own kernels (no paging code in the former), and a
// lower key bound or softcap the kLocal variant: the common case runs none of their instructions.
// The RoPE center (packed caches: contiguous, or pages of 32 tokens or more; no kLocal, checked on
// the host) has its own variant too, and a 16-bit side (sinks and recent ring; no kLocal either)
// its own split.
template <typename Traits>
void launch_decode_split(const DecodeParams &p, cudaStream_t stream) {
    // non-local: with a side or without
    auto go_plain = [&](auto paging, auto rope) {
        constexpr Paging kP = decltype(paging)::value;
        constexpr bool kR = decltype(rope)::value;
        const bool side = p.side_k != nullptr;
        if constexpr (kR && Traits::kNT == 1) {  // (held to 3 CTAs an SM: tq_decode_kernel.h)
            side ? launch_split<Traits, true, true>(&decode_split_rope_kernel<Traits, kP, true>, p, stream)
                 : launch_split<Traits, true>(&decode_split_rope_kernel<Traits, kP, false>, p, stream);
        } else if (side) {
            launch_split<Traits, kR, true>(&decode_split_kernel<Traits, kP, false, kR, true>, p, stream);
        } else {
            launch_split<Traits, kR>(&decode_split_kernel<Traits, kP, false, kR>, p, stream);
        }
    };
    auto go = [&](auto paging) {
        if (p.local()) {
            launch_split<Traits>(&decode_split_kernel<Traits, decltype(paging)::value, true>, p, stream);
        } else {
            go_plain(paging, std::false_type{});
        }
    };
    using Rows = std::integral_constant<Paging, Paging::kRows>;
    using Rows16 = std::integral_constant<Paging, Paging::kRows16>;
    using NoPages = std::integral_constant<Paging, Paging::kNone>;
    if constexpr (Traits::kTileN != 32) {  // (wide_tiles: contiguous or pages of a tile or more, no kLocal)
        auto go_rope = [&](auto paging) {
            p.rope_center != nullptr ? go_plain(paging, std::true_type{}) : go_plain(paging, std::false_type{});
        };
        p.block_table != nullptr ? go_rope(Rows{}) : go_rope(NoPages{});
    } else if constexpr (Traits::KV::kAffine) {
        if (p.rope_center != nullptr) {
            p.block_table != nullptr ? go_plain(Rows{}, std::true_type{}) : go_plain(NoPages{}, std::true_type{});
        } else if (p.block_table != nullptr && p.page_block_size < Traits::KV::kTileN) {  // 16-token pages
            go(Rows16{});
        } else if (p.block_table != nullptr) {
            go(Rows{});
        } else {
            go(NoPages{});
        }
    } else {  // the FP16 cache (decode_kv16): one kernel for contiguous and paged, no side
        if (p.local()) {
            launch_split<Traits>(&decode_split_kernel<Traits, Paging::kRuntime, true>, p, stream);
        } else {
            launch_split<Traits>(&decode_split_kernel<Traits, Paging::kRuntime, false>, p, stream);
        }
    }
}

template <typename Elem, int kHeadDim, typename KV>
void run_decode_with(const DecodeParams &p, cudaStream_t stream) {
    if (p.h_h_k_ratio * p.seqlen_q <= 8) {
        launch_decode_split<DecodeTraits<Elem, kHeadDim, 1, KV>>(p, stream);
    } else {  // 16 rows a CTA; more rows take more CTAs along grid.z
        launch_decode_split<DecodeTraits<Elem, kHeadDim, 2, KV>>(p, stream);
    }
    launch_combine<Elem, kHeadDim>(p, stream);
}

// 64-token tiles at head_dim 64 where every warp gets several: a tile's fixed work (the softmax's
// row reductions, the dependent unpack -> MMA -> softmax chain) is the same as at head_dim 128 for
// half the bytes, so 32-token tiles left d 64 as slow as d 128 (8 x 32K: 91.5 us against 92.4; 64:
// 83.0). From kWideTileKeys keys a code split (1 x 4K, 128 a split: 64-token tiles 6% slower);
// contiguous caches or pages of 64 tokens or more (a tile in one page), one n8 tile of rows, no
// kLocal, 3- and 4-bit codes (8-bit ones would double a stage's shared memory).
constexpr int kWideTile = 64, kWideTileKeys = 1024;

template <int kHeadDim, int kKBits, int kVBits>
constexpr bool has_wide_tiles() {
    return kHeadDim == 64 && kKBits <= 4 && kVBits <= 4;
}

inline bool wide_tiles(const DecodeParams &p) {
    const int code_splits = p.num_splits - (p.side_k != nullptr ? 1 : 0) - (p.has_ring ? 1 : 0);
    return (p.block_table == nullptr || p.page_block_size >= kWideTile) && !p.local() &&
           p.h_h_k_ratio * p.seqlen_q <= 8 && p.max_seqlen_k >= static_cast<int64_t>(kWideTileKeys) * code_splits;
}

template <typename Elem, int kHeadDim, int kKBits, int kVBits, bool kScaleOnly>
void run_decode(const DecodeParams &p, cudaStream_t stream) {
    if constexpr (has_wide_tiles<kHeadDim, kKBits, kVBits>()) {
        if (wide_tiles(p)) {
            using KV = PackedKV<kKBits, kVBits, kHeadDim, Elem, kScaleOnly, 3, kWideTile>;
            launch_decode_split<DecodeTraits<Elem, kHeadDim, 1, KV>>(p, stream);
            launch_combine<Elem, kHeadDim>(p, stream);
            return;
        }
    }
    run_decode_with<Elem, kHeadDim, PackedKV<kKBits, kVBits, kHeadDim, Elem, kScaleOnly>>(p, stream);
}

// Group b's traits in a launch with group a: its codes' pipeline as deep as a's shared memory allows
// (every CTA of the launch gets the larger: K8V8's three stages beside K3V3 held the launch to one CTA
// an SM, 8 x 32K 204 us against 158 in two launches).
template <typename TA, int kKBits, int kVBits, bool kScaleOnly, bool kRope, int kStages = 3>
constexpr auto pair_traits() {
    using KV = PackedKV<kKBits, kVBits, TA::kHeadDim, typename TA::Elem, kScaleOnly, kStages>;
    using T = DecodeTraits<typename TA::Elem, TA::kHeadDim, TA::kNT, KV>;
    if constexpr (kStages > 1 && split_smem_bytes<T, kRope, true>() > split_smem_bytes<TA, kRope, true>()) {
        return pair_traits<TA, kKBits, kVBits, kScaleOnly, kRope, kStages - 1>();
    } else {
        return T{};
    }
}

// Two head groups in one launch (decode_pair_kernel; contiguous caches with a 16-bit side, no
// kLocal, each group's own split count): a's params name the layer's q, out and split buffers, and
// the combine merges the larger count of splits.
template <typename Elem, int kHeadDim, int kNT, typename KVA, int kKBitsB, int kVBitsB, bool kScaleOnly>
void launch_pair(const DecodeParams &a, const DecodeParams &b, cudaStream_t stream) {
    using TA = DecodeTraits<Elem, kHeadDim, kNT, KVA>;
    auto go = [&](auto rope) {
        constexpr bool kR = decltype(rope)::value;
        using TB = decltype(pair_traits<TA, kKBitsB, kVBitsB, kScaleOnly, kR>());
        constexpr int sa = split_smem_bytes<TA, kR, true>(), sb = split_smem_bytes<TB, kR, true>();
        constexpr int smem = sa > sb ? sa : sb;
        auto kernel = &decode_pair_kernel<TA, TB, kR>;
        if constexpr (smem > 48 * 1024) { allow_smem(reinterpret_cast<const void *>(kernel), smem); }
        const int rows = a.h_h_k_ratio * a.seqlen_q;
        dim3 grid(a.num_splits * a.b * a.h_k + b.num_splits * b.b * b.h_k, 1, (rows + TA::kRows - 1) / TA::kRows);
        launch(kernel, grid, TA::kNThreads, smem, stream, true, a, b);
    };
    a.rope_center != nullptr ? go(std::true_type{}) : go(std::false_type{});
}

template <typename Elem, int kHeadDim, int kKBitsA, int kVBitsA, int kKBitsB, int kVBitsB, bool kScaleOnly>
void run_decode_pair(const DecodeParams &a, const DecodeParams &b, cudaStream_t stream) {
    using A = PackedKV<kKBitsA, kVBitsA, kHeadDim, Elem, kScaleOnly>;
    auto rows_tiles = [&] {
        if (a.h_h_k_ratio * a.seqlen_q <= 8) {
            launch_pair<Elem, kHeadDim, 1, A, kKBitsB, kVBitsB, kScaleOnly>(a, b, stream);
        } else {
            launch_pair<Elem, kHeadDim, 2, A, kKBitsB, kVBitsB, kScaleOnly>(a, b, stream);
        }
    };
    if constexpr (has_wide_tiles<kHeadDim, kKBitsA, kVBitsA>()) {
        if (wide_tiles(a)) {  // group a's tiles as a launch of its own takes them (b's stages fit the wider pipeline)
            using AW = PackedKV<kKBitsA, kVBitsA, kHeadDim, Elem, kScaleOnly, 3, kWideTile>;
            launch_pair<Elem, kHeadDim, 1, AW, kKBitsB, kVBitsB, kScaleOnly>(a, b, stream);
        } else {
            rows_tiles();
        }
    } else {
        rows_tiles();
    }
    DecodeParams layer = a;
    layer.num_splits = a.num_splits > b.num_splits ? a.num_splits : b.num_splits;
    launch_combine<Elem, kHeadDim>(layer, stream);
}

// The codes, a ring of window codes and the 16-bit side (its sinks) in one launch (decode_ring_kernel;
// contiguous caches, no kLocal): p's num_splits counts the ring's split and the side's; r is p but
// for the store (the ring's codes, kRingBits wide) and side_ring (the ring's size).
template <typename Elem, int kHeadDim, int kKBits, int kVBits, bool kScaleOnly, int kRingBits>
void run_decode_ring(const DecodeParams &p, const DecodeParams &r, cudaStream_t stream) {
    auto go = [&](auto traits, auto rope) {
        using T = decltype(traits);
        constexpr bool kR = decltype(rope)::value;
        constexpr int main = split_smem_bytes<T, kR, true>();
        using RT = RingTraits<T, kRingBits>;
        constexpr int ring = kR ? RT::kRopeSmemBytes : RT::kSmemBytes;
        constexpr int smem = main > ring ? main : ring;
        auto kernel = &decode_ring_kernel<T, kRingBits, kR>;
        if constexpr (smem > 48 * 1024) { allow_smem(reinterpret_cast<const void *>(kernel), smem); }
        const int rows = p.h_h_k_ratio * p.seqlen_q;
        dim3 grid(p.num_splits, p.b * p.h_k, (rows + T::kRows - 1) / T::kRows);
        launch(kernel, grid, T::kNThreads, smem, stream, true, p, r);
    };
    auto go_rope = [&](auto traits) {
        p.rope_center != nullptr ? go(traits, std::true_type{}) : go(traits, std::false_type{});
    };
    using KV = PackedKV<kKBits, kVBits, kHeadDim, Elem, kScaleOnly>;
    bool wide = false;
    if constexpr (has_wide_tiles<kHeadDim, kKBits, kVBits>()) {
        wide = wide_tiles(p);
        if (wide) {
            go_rope(
                DecodeTraits<Elem, kHeadDim, 1, PackedKV<kKBits, kVBits, kHeadDim, Elem, kScaleOnly, 3, kWideTile>>{});
        }
    }
    if (!wide && p.h_h_k_ratio * p.seqlen_q <= 8) {
        go_rope(DecodeTraits<Elem, kHeadDim, 1, KV>{});
    } else if (!wide) {  // 16 rows a CTA; more rows take more CTAs along grid.z
        go_rope(DecodeTraits<Elem, kHeadDim, 2, KV>{});
    }
    launch_combine<Elem, kHeadDim>(p, stream);
}

template <typename Elem, int kHeadDim>
void run_decode_fp16(const DecodeParams &p, cudaStream_t stream) {
    run_decode_with<Elem, kHeadDim, Fp16KV<kHeadDim, Elem>>(p, stream);
}

}  // namespace flash_tq
