// Host-side launch of the prefill kernel (+ the split combine) for one (dtype, head_dim, bits) case.
#pragma once

#include <cuda_runtime.h>

#include "tq_decode_launch.h"
#include "tq_prefill_kernel.h"

namespace flash_tq {

template <typename Traits>
void launch_prefill(const DecodeParams &p, cudaStream_t stream) {
    auto kernel = &prefill_split_kernel<Traits>;
    constexpr int smem = Traits::kSmemBytes;
    if constexpr (smem > 48 * 1024) {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    }
    const int rows = p.h_h_k_ratio * p.seqlen_q;
    dim3 grid(p.num_splits, p.b * p.h_k, (rows + Traits::kRows - 1) / Traits::kRows);
    kernel<<<grid, Traits::kNThreads, smem, stream>>>(p);
    launch_combine<typename Traits::Elem, Traits::kHeadDim>(p, stream);
}

template <typename Elem, int kHeadDim, int kKBits, int kVBits>
void run_prefill(const DecodeParams &p, cudaStream_t stream) {
    // 8 warps, one CTA an SM (4 warps with two CTAs an SM: 153-166 TFLOP/s against 171-188, H200)
    launch_prefill<PrefillTraits<Elem, kHeadDim, kKBits, kVBits, 8>>(p, stream);
}

}  // namespace flash_tq
