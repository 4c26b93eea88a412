// Host-side launch of the prefill kernel (+ the split combine) for one (dtype, head_dim, bits) case.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "tq_decode_launch.h"
#include "tq_prefill_kernel.h"
#include "tq_side_rows.h"

namespace flash_tq {

// The RoPE center's table (tq_rope_center.h) for the prefill kernel's tiles of kTileN: 32 positions a CTA.
template <typename Elem, int kHeadDim, typename KV, int kTileN>
void launch_rope_table(const DecodeParams &p, cudaStream_t stream) {
    dim3 grid((p.rope_table_len + 31) / 32, p.b * p.h_k);
    rope_table_kernel<Elem, kHeadDim, KV, kTileN><<<grid, 128, 0, stream>>>(p);
}

// The side of a chunk's rows (tq_side_rows.h) as the launch's last split.
template <typename Elem, int kHeadDim>
void launch_side_rows(const DecodeParams &p, cudaStream_t stream) {
    using T = SideRowsTraits<Elem, kHeadDim>;
    dim3 grid((p.h_h_k_ratio * p.seqlen_q + T::kRows - 1) / T::kRows, p.b * p.h_k);
    side_rows_kernel<T><<<grid, T::kNThreads, 0, stream>>>(p);
}

// The codes' splits (a 16-bit side: its own launch as the last split, launch_side_rows), then the combine.
// With one code split the side goes first and the prefill kernel merges it (DecodeParams::side_first):
// launched as the side's programmatic dependent, it runs its tiles while the side's last CTAs do and
// waits for them before the merge (the RoPE table, which it reads from the first tile, comes before both).
template <typename Elem, int kHeadDim, int kKBits, int kVBits, bool kScaleOnly>
void run_prefill(const DecodeParams &params, cudaStream_t stream) {
    using KV = PackedKV<kKBits, kVBits, kHeadDim, Elem, kScaleOnly>;
    const bool side = params.side_k != nullptr;
    const int code_splits = params.num_splits - (side ? 1 : 0);
    DecodeParams p = params;
    p.side_first = side && code_splits == 1;
    // 8 warps of 32 rows, one CTA an SM (4 warps with two CTAs an SM: 153-166 TFLOP/s against 171-188 at
    // 16 rows a warp, H200)
    auto go = [&](auto wgmma, auto rope) {
        constexpr bool kRope = decltype(rope)::value;
        using Traits = PrefillTraits<Elem, kHeadDim, kKBits, kVBits, 8, 2, kScaleOnly, decltype(wgmma)::value, kRope>;
        if constexpr (kRope) { launch_rope_table<Elem, kHeadDim, KV, Traits::kTileN>(p, stream); }
        if (p.side_first) { launch_side_rows<Elem, kHeadDim>(p, stream); }
        auto kernel = &prefill_split_kernel<Traits, false>;
        if constexpr (!kRope) {  // a lower key bound or softcap (tq_decode_launch.h); none with the RoPE center
            if (p.local()) { kernel = &prefill_split_kernel<Traits, true>; }
        }
        launch_split<Traits>(kernel, p, stream, code_splits, p.side_first);
    };
#ifdef FLASH_TQ_SM90A
    if (p.use_wgmma) {  // an sm_90 device and sm_90a code in this build (flash_api_tq.cpp)
        // (the host sends the RoPE center here only: no kLocal with it)
        p.rope_center != nullptr ? go(std::true_type{}, std::true_type{}) : go(std::true_type{}, std::false_type{});
    } else
#endif
    {
        go(std::false_type{}, std::false_type{});
    }
    if (!p.side_first) {
        if (side) { launch_side_rows<Elem, kHeadDim>(p, stream); }
        launch_combine<Elem, kHeadDim>(p, stream);
    }
}

}  // namespace flash_tq
