// Host-side launch of the quantize-on-write kernel for one (dtype, head_dim).
#pragma once

#include <stdexcept>

#include "tq_pack_kernel.h"

namespace flash_tq {

template <typename Elem, int kHeadDim, int kBits>
void launch_pack(const PackParams &p, int quant, cudaStream_t stream) {
    const int64_t vectors = static_cast<int64_t>(p.tokens) * p.heads;
    const unsigned blocks = static_cast<unsigned>((vectors + 3) / 4);  // 4 warps, one vector each
    if (blocks == 0) return;
    switch (static_cast<Quant>(quant)) {
        case Quant::kTurboUniform: pack_kv_kernel<Elem, kHeadDim, kBits, Quant::kTurboUniform><<<blocks, 128, 0, stream>>>(p); break;
        case Quant::kTurboLloyd: pack_kv_kernel<Elem, kHeadDim, kBits, Quant::kTurboLloyd><<<blocks, 128, 0, stream>>>(p); break;
        case Quant::kAsym: pack_kv_kernel<Elem, kHeadDim, kBits, Quant::kAsym><<<blocks, 128, 0, stream>>>(p); break;
        default: throw std::invalid_argument("unknown quantizer");
    }
}

template <typename Elem, int kHeadDim>
void run_pack(const PackParams &p, int bits, int quant, cudaStream_t stream) {
    switch (bits) {
        case 2: launch_pack<Elem, kHeadDim, 2>(p, quant, stream); break;
        case 3: launch_pack<Elem, kHeadDim, 3>(p, quant, stream); break;
        case 4: launch_pack<Elem, kHeadDim, 4>(p, quant, stream); break;
        default: throw std::invalid_argument("bits must be 2, 3 or 4");
    }
}

}  // namespace flash_tq
