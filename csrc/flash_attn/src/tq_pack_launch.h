// Host-side launch of the quantize-on-write kernel for one (dtype, head_dim).
#pragma once

#include <algorithm>
#include <stdexcept>

#include "tq_pack_kernel.h"

namespace flash_tq {

template <typename Elem, int kHeadDim, int kBits>
void launch_pack(const PackParams &p, int quant, cudaStream_t stream) {
    const int64_t vectors = static_cast<int64_t>(p.tokens) * p.heads;
    if (vectors == 0) return;
    int device = 0, num_sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
    // 16 vectors a block-iteration; a grid of up to 16 blocks an SM strides over the rest
    const unsigned blocks =
        static_cast<unsigned>(std::min<int64_t>((vectors + 15) / 16, 16 * static_cast<int64_t>(num_sms)));
    switch (static_cast<Quant>(quant)) {
        case Quant::kTurboUniform:
            pack_kv_kernel<Elem, kHeadDim, kBits, Quant::kTurboUniform><<<blocks, 128, 0, stream>>>(p);
            break;
        case Quant::kTurboLloyd:  // (8 bits: 256 levels, not loaded by 128 threads; the reference refuses it too)
            if constexpr (kBits == 8) {
                throw std::invalid_argument("8-bit codes use the uniform grid");
            } else {
                pack_kv_kernel<Elem, kHeadDim, kBits, Quant::kTurboLloyd><<<blocks, 128, 0, stream>>>(p);
            }
            break;
        case Quant::kAsym:
            pack_kv_kernel<Elem, kHeadDim, kBits, Quant::kAsym><<<blocks, 128, 0, stream>>>(p);
            break;
        case Quant::kTurboMean:
            pack_kv_kernel<Elem, kHeadDim, kBits, Quant::kTurboMean><<<blocks, 128, 0, stream>>>(p);
            break;
        default:
            throw std::invalid_argument("unknown quantizer");
    }
}

template <typename Elem, int kHeadDim>
void run_pack(const PackParams &p, int bits, int quant, cudaStream_t stream) {
    switch (bits) {
        case 2:
            launch_pack<Elem, kHeadDim, 2>(p, quant, stream);
            break;
        case 3:
            launch_pack<Elem, kHeadDim, 3>(p, quant, stream);
            break;
        case 4:
            launch_pack<Elem, kHeadDim, 4>(p, quant, stream);
            break;
        case 8:
            launch_pack<Elem, kHeadDim, 8>(p, quant, stream);
            break;
        default:
            throw std::invalid_argument("bits must be 2, 3, 4 or 8");
    }
}

}  // namespace flash_tq
