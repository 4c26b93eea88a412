// Host-side launch of the prefill kernel (+ the split combine) for one (dtype, head_dim, bits) case.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "tq_decode_launch.h"
#include "tq_prefill_kernel.h"

namespace flash_tq {

template <typename Elem, int kHeadDim, int kKBits, int kVBits, bool kScaleOnly>
void run_prefill(const DecodeParams &p, cudaStream_t stream) {
    // 8 warps of 32 rows, one CTA an SM (4 warps with two CTAs an SM: 153-166 TFLOP/s against 171-188 at
    // 16 rows a warp, H200)
    auto go = [&](auto wgmma) {
        using Traits = PrefillTraits<Elem, kHeadDim, kKBits, kVBits, 8, 2, kScaleOnly, decltype(wgmma)::value>;
        if (p.local()) {  // a lower key bound or softcap (tq_decode_launch.h)
            launch_split<Traits>(&prefill_split_kernel<Traits, true>, p, stream);
        } else {
            launch_split<Traits>(&prefill_split_kernel<Traits, false>, p, stream);
        }
    };
#ifdef FLASH_TQ_SM90A
    if (p.use_wgmma) {  // an sm_90 device and sm_90a code in this build (flash_api_tq.cpp)
        go(std::true_type{});
    } else
#endif
    {
        go(std::false_type{});
    }
    launch_combine<Elem, kHeadDim>(p, stream);
}

}  // namespace flash_tq
