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
// With one code split the side goes first and the prefill kernel merges it (DecodeParams::side_first).
template <typename Elem, int kHeadDim, int kKBits, int kVBits, bool kScaleOnly>
void run_prefill(const DecodeParams &params, cudaStream_t stream) {
    using KV = PackedKV<kKBits, kVBits, kHeadDim, Elem, kScaleOnly>;
    const bool side = params.side_k != nullptr;
    const int code_splits = params.num_splits - (side ? 1 : 0);
    DecodeParams p = params;
    p.side_first = side && code_splits == 1;
    if (p.side_first) { launch_side_rows<Elem, kHeadDim>(p, stream); }
    // 8 warps of 32 rows, one CTA an SM (4 warps with two CTAs an SM: 153-166 TFLOP/s against 171-188 at
    // 16 rows a warp, H200)
    auto go = [&](auto wgmma) {
        using Traits = PrefillTraits<Elem, kHeadDim, kKBits, kVBits, 8, 2, kScaleOnly, decltype(wgmma)::value>;
        if (p.local()) {  // a lower key bound or softcap (tq_decode_launch.h)
            launch_split<Traits>(&prefill_split_kernel<Traits, true>, p, stream, code_splits);
        } else {
            launch_split<Traits>(&prefill_split_kernel<Traits, false>, p, stream, code_splits);
        }
    };
#ifdef FLASH_TQ_SM90A
    if (p.use_wgmma) {  // an sm_90 device and sm_90a code in this build (flash_api_tq.cpp)
        if (p.rope_center != nullptr) {  // (the host sends the RoPE center here only: no kLocal with it)
            using Traits = PrefillTraits<Elem, kHeadDim, kKBits, kVBits, 8, 2, kScaleOnly, true, true>;
            launch_rope_table<Elem, kHeadDim, KV, Traits::kTileN>(p, stream);
            launch_split<Traits>(&prefill_split_kernel<Traits, false>, p, stream, code_splits);
        } else {
            go(std::true_type{});
        }
    } else
#endif
    {
        go(std::false_type{});
    }
    if (!p.side_first) {
        if (side) { launch_side_rows<Elem, kHeadDim>(p, stream); }
        launch_combine<Elem, kHeadDim>(p, stream);
    }
}

}  // namespace flash_tq
