// Host-side launch of the quantize-on-write kernel for one (dtype, head_dim).
#pragma once

#include <algorithm>
#include <stdexcept>
#include <type_traits>

#include "tq_cases.h"
#include "tq_pack_kernel.h"

namespace flash_tq {

// 16 vectors a block-iteration; a grid of up to 16 blocks an SM strides over the rest (0: none)
inline unsigned pack_blocks(const PackParams &p) {
    const int64_t vectors = static_cast<int64_t>(p.tokens) * p.heads;
    int device = 0, num_sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
    return static_cast<unsigned>(std::min<int64_t>((vectors + 15) / 16, 16 * static_cast<int64_t>(num_sms)));
}

template <typename Elem, int kHeadDim, int kBits>
void launch_pack(const PackParams &p, int quant, cudaStream_t stream) {
    const unsigned blocks = pack_blocks(p);
    if (blocks == 0) return;
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

template <typename Elem, int kHeadDim, int kKBits, int kVBits>
void launch_pack_pair(const PackParams &k, const PackParams &v, cudaStream_t stream) {
    const unsigned blocks = pack_blocks(k);
    if (blocks == 0) return;
    pack_pair_kernel<Elem, kHeadDim, kKBits, kVBits, Quant::kTurboUniform><<<dim3(blocks, 2), 128, 0, stream>>>(k, v);
}

// An append's K (k_bits) and V (v_bits) over the same tokens and slots: one launch for the default
// quantizer and the bit pairs the decode kernel fuses (tq_cases.h), else a launch each.
template <typename Elem, int kHeadDim>
void run_pack_pair(const PackParams &k, const PackParams &v, int k_bits, int v_bits, int quant, cudaStream_t stream) {
    const bool uniform = quant == static_cast<int>(Quant::kTurboUniform);
    bool paired = false;
#define TQ_PACK_PAIR(E, D, KB, VB, S, P)                            \
    if constexpr (std::is_same_v<E, Elem> && D == kHeadDim) {       \
        if (uniform && !paired && k_bits == KB && v_bits == VB) {   \
            launch_pack_pair<Elem, kHeadDim, KB, VB>(k, v, stream); \
            paired = true;                                          \
        }                                                           \
    }
    TQ_FOR_EACH_PACKED_CASE(TQ_PACK_PAIR)
#undef TQ_PACK_PAIR
    if (!paired) {  // (the length update with the second launch, which the first's errors mark)
        PackParams first = k;
        first.lengths = nullptr;
        run_pack<Elem, kHeadDim>(first, k_bits, quant, stream);
        run_pack<Elem, kHeadDim>(v, v_bits, quant, stream);
    }
}

}  // namespace flash_tq
