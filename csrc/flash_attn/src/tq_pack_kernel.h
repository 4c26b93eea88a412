// Quantize-on-write: fp16/bf16 K or V vectors -> packed codes + float16 (scale, offset), written
// straight into cache slots (contiguous or paged: slot = row * cols + col of the codes tensor).
// One warp a vector; the arithmetic follows flash_attn_tq/quantizers.py step by step in float32
// with explicit round-to-nearest intrinsics (no FMA contraction, no fast-math division), so the
// codes match the PyTorch reference except where a value lands within rounding of a bin edge.
#pragma once

#include <cmath>
#include <cstdint>

#include "tq_format.h"
#include "tq_params.h"
#include "tq_utils.h"

namespace flash_tq {

// Lane and bit of element e's code (tq_format.h); spare: bit i of the code is bit 15 of lane + i.
template <int kBits, int kHeadDim>
__device__ __forceinline__ void code_position(int e, int &lane, int &bit, bool &spare) {
    const int k = 2 * (e / 16) + (e % 16) / 8;
    const int n = (e % 8) * (kHeadDim / 8) + k;
    spare = false;
    if constexpr (kBits == 3) {
        const int blk = n / 16, r = n % 16;
        spare = r == 15;
        lane = 3 * blk + (spare ? 0 : r / 5);
        bit = spare ? 15 : 3 * (r % 5);
    } else {
        constexpr int kPerLane = 16 / kBits;
        lane = n / kPerLane;
        bit = kBits * (n % kPerLane);
    }
}

__device__ __forceinline__ float warp_sum(float x) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) { x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, o)); }
    return x;
}
__device__ __forceinline__ float warp_min(float x) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) { x = fminf(x, __shfl_xor_sync(0xffffffffu, x, o)); }
    return x;
}
__device__ __forceinline__ float warp_max(float x) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) { x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o)); }
    return x;
}

template <typename Elem, int kHeadDim, int kBits, Quant kQuant>
__global__ void __launch_bounds__(128) pack_kv_kernel(const PackParams p) {
    constexpr int kPerLane = kHeadDim / 32;  // lane l holds elements l * kPerLane ... (contiguous)
    constexpr int kLevels = 1 << kBits;
    constexpr int kWords = CodeLayout<kBits, kHeadDim>::kWords;
    __shared__ uint32_t words_smem[4][kWords];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t vec = static_cast<int64_t>(blockIdx.x) * 4 + warp;
    if (vec >= static_cast<int64_t>(p.tokens) * p.heads) return;
    const int token = vec / p.heads, head = vec % p.heads;
    const int64_t slot = p.slot_mapping[token];
    if (slot < 0) return;
    uint32_t *words = words_smem[warp];
    for (int w = lane; w < kWords; w += 32) { words[w] = 0u; }

    const Elem *src = reinterpret_cast<const Elem *>(p.x) + token * p.x_token_stride + head * p.x_head_stride;
    float x[kPerLane];
    #pragma unroll
    for (int k = 0; k < kPerLane; ++k) { x[k] = to_float(src[lane * kPerLane + k]); }

    float scale_out, offset_out;
    float code[kPerLane];
    if constexpr (kQuant == Quant::kAsym) {
        float lo = x[0], hi = x[0];
        #pragma unroll
        for (int k = 1; k < kPerLane; ++k) { lo = fminf(lo, x[k]); hi = fmaxf(hi, x[k]); }
        const float vmin = warp_min(lo), vmax = warp_max(hi);
        float scale = __half2float(__float2half_rn(__fdiv_rn(__fsub_rn(vmax, vmin), static_cast<float>(kLevels - 1))));
        if (!(scale > 0.f)) scale = 1.f;
        const float zero = fminf(fmaxf(floorf(__fadd_rn(__fdiv_rn(-vmin, scale), 0.5f)), 0.f), kLevels - 1.f);
        #pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
            code[k] = fminf(fmaxf(floorf(__fadd_rn(__fadd_rn(__fdiv_rn(x[k], scale), zero), 0.5f)), 0.f), kLevels - 1.f);
        }
        scale_out = scale;
        offset_out = __fmul_rn(-scale, zero);
    } else {
        // randomized Hadamard: signs, then butterflies h = 1, 2, 4, ... (same order as the reference)
        #pragma unroll
        for (int k = 0; k < kPerLane; ++k) { x[k] = __fmul_rn(x[k], p.signs[lane * kPerLane + k]); }
        #pragma unroll
        for (int h = 1; h < kPerLane; h *= 2) {
            #pragma unroll
            for (int k = 0; k < kPerLane; ++k) {
                if ((k & h) == 0) {
                    const float a = x[k], b = x[k + h];
                    x[k] = __fadd_rn(a, b);
                    x[k + h] = __fsub_rn(a, b);
                }
            }
        }
        #pragma unroll
        for (int h = 1; h < 32; h *= 2) {  // partner lane ^ h holds the other half of each butterfly
            const bool upper = (lane & h) != 0;
            #pragma unroll
            for (int k = 0; k < kPerLane; ++k) {
                const float other = __shfl_xor_sync(0xffffffffu, x[k], h);
                x[k] = upper ? __fsub_rn(other, x[k]) : __fadd_rn(x[k], other);
            }
        }
        const float inv_sqrt_d = static_cast<float>(1.0 / sqrt(static_cast<double>(kHeadDim)));
        float ss = 0.f;
        #pragma unroll
        for (int k = 0; k < kPerLane; ++k) { x[k] = __fmul_rn(x[k], inv_sqrt_d); ss = __fadd_rn(ss, __fmul_rn(x[k], x[k])); }
        const float norm = __fsqrt_rn(warp_sum(ss));
        // the reference's sqrt(d) / norm is evaluated by torch as reciprocal(norm) * sqrt(d)
        const float inv = norm > 0.f ? __fmul_rn(__frcp_rn(norm), static_cast<float>(sqrt(static_cast<double>(kHeadDim)))) : 0.f;
        float lss = 0.f;
        #pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
            const float y = __fmul_rn(x[k], inv);
            float level;
            if constexpr (kQuant == Quant::kTurboUniform) {
                code[k] = fminf(fmaxf(floorf(__fadd_rn(__fadd_rn(__fmul_rn(y, p.inv_step), 0.5f * (kLevels - 1)), 0.5f)), 0.f), kLevels - 1.f);
                level = __fmul_rn(__fsub_rn(code[k], 0.5f * (kLevels - 1)), p.step);
            } else {
                int cnt = 0;  // number of bin edges strictly below y
                #pragma unroll
                for (int e = 0; e + 1 < kLevels; ++e) {
                    const float edge = __fmul_rn(__fadd_rn(p.levels[e + 1], p.levels[e]), 0.5f);
                    cnt += y > edge ? 1 : 0;
                }
                code[k] = static_cast<float>(cnt);
                level = p.levels[cnt];
            }
            lss = __fadd_rn(lss, __fmul_rn(level, level));
        }
        const float lnorm = __fsqrt_rn(warp_sum(lss));
        const float scale = lnorm > 0.f ? __fdiv_rn(norm, lnorm) : 0.f;
        if constexpr (kQuant == Quant::kTurboUniform) {
            scale_out = __half2float(__float2half_rn(__fmul_rn(scale, p.step)));
            offset_out = __fmul_rn(-scale_out, 0.5f * (kLevels - 1));
        } else {
            scale_out = scale;
            offset_out = 0.f;
        }
    }

    __syncwarp();
    #pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
        int lane_idx, bit;
        bool spare;
        code_position<kBits, kHeadDim>(lane * kPerLane + k, lane_idx, bit, spare);
        const uint32_t cv = static_cast<uint32_t>(code[k]);
        if (spare) {
            #pragma unroll
            for (int i = 0; i < 3; ++i) {
                const int l = lane_idx + i;
                atomicOr(&words[l / 2], ((cv >> i) & 1u) << (bit + 16 * (l % 2)));
            }
        } else {
            atomicOr(&words[lane_idx / 2], cv << (bit + 16 * (lane_idx % 2)));
        }
    }
    __syncwarp();
    uint32_t *dst = reinterpret_cast<uint32_t *>(p.codes + (slot * p.heads + head) * (kWords * 4));
    for (int w = lane; w < kWords; w += 32) { dst[w] = words[w]; }
    if (lane == 0) {
        p.meta[(slot * p.heads + head) * 2] = __half_as_ushort(__float2half_rn(scale_out));
        p.meta[(slot * p.heads + head) * 2 + 1] = __half_as_ushort(__float2half_rn(offset_out));
    }
}

}  // namespace flash_tq
