// Host-side launch of the prefill kernel (+ the split combine) for one (dtype, head_dim, bits) case.
#pragma once

#include <cuda_runtime.h>

#include "tq_decode_launch.h"
#include "tq_prefill_kernel.h"

namespace flash_tq {

template <typename Elem, int kHeadDim, int kKBits, int kVBits>
void run_prefill(const DecodeParams &p, cudaStream_t stream) {
    using Traits = PrefillTraits<Elem, kHeadDim, kKBits, kVBits>;
    auto kernel = &prefill_split_kernel<Traits>;
    constexpr int smem = Traits::kSmemBytes;
    if constexpr (smem > 48 * 1024) {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    }
    const int rows = p.h_h_k_ratio * p.seqlen_q;
    dim3 grid(p.num_splits, p.b * p.h_k, (rows + Traits::kRows - 1) / Traits::kRows);
    kernel<<<grid, Traits::kNThreads, smem, stream>>>(p);
    launch_combine<Elem, kHeadDim>(p, stream);
}

}  // namespace flash_tq
