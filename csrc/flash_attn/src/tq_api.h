// Host-side declarations of the kernel entry points; each is instantiated in its own .cu file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "tq_params.h"

namespace flash_tq {

// kScaleOnly: per-token metadata is the float16 scale alone (see PackedKV).
template <typename Elem, int kHeadDim, int kKBits, int kVBits, bool kScaleOnly>
void run_decode(const DecodeParams &p, cudaStream_t stream);

// Two head groups of a layer with different code widths in one launch (tq_decode_launch.h).
template <typename Elem, int kHeadDim, int kKBitsA, int kVBitsA, int kKBitsB, int kVBitsB, bool kScaleOnly>
void run_decode_pair(const DecodeParams &a, const DecodeParams &b, cudaStream_t stream);

// The codes, a ring of kRingBits-wide window codes (r: the same params but for the ring's store) and a
// 16-bit side in one launch (tq_decode_launch.h).
template <typename Elem, int kHeadDim, int kKBits, int kVBits, bool kScaleOnly, int kRingBits>
void run_decode_ring(const DecodeParams &p, const DecodeParams &r, cudaStream_t stream);

// Many query rows a kv head (chunked prefill): 256-row CTAs over tiles expanded once into shared memory.
// Devices that give a CTA less shared memory than kPrefillSmemBudget (tq_params.h) run the decode kernel.
template <typename Elem, int kHeadDim, int kKBits, int kVBits, bool kScaleOnly>
void run_prefill(const DecodeParams &p, cudaStream_t stream);

template <typename Elem, int kHeadDim>
void run_decode_fp16(const DecodeParams &p, cudaStream_t stream);

template <typename Elem, int kHeadDim>
void run_pack(const PackParams &p, int bits, int quant, cudaStream_t stream);

// K and V of one append (the same tokens and slots), in one launch where a paired kernel exists.
template <typename Elem, int kHeadDim>
void run_pack_pair(const PackParams &k, const PackParams &v, int k_bits, int v_bits, int quant, cudaStream_t stream);

}  // namespace flash_tq
