// Quantize-on-write: fp16/bf16 K or V vectors -> packed codes + float16 (scale, offset), written
// straight into cache slots (contiguous or paged: slot = row * cols + col of the codes tensor).
//
// Eight threads a vector (four vectors a warp, a grid-stride loop so the per-thread constants load
// once). Thread s of a vector loads elements [s*P, s*P + P) (P = d / 8) with 16-byte loads and runs
// the Walsh-Hadamard butterflies on those bits (h < P) in registers; a transpose through shared
// memory then gives thread t the elements e = 8j + t (j < P), whose butterflies (h >= P) are again
// in registers, in the reference's order h = 1, 2, 4, .... Elements 8j + t are exactly the codes at
// sequence positions t*P + j (tq_format.h), so each thread packs a contiguous run of the code row
// by itself: no atomics, no shuffles of codes (but for the half 3-bit block at d = 64).
//
// Arithmetic follows flash_attn_tq/quantizers.py in float32 with explicit round-to-nearest
// intrinsics; turbo folds the 1/sqrt(d) scale into the per-vector factor and evaluates the norm of
// the levels in integers, so a code can differ from the reference only where the value lands
// within float rounding of a bin edge (counted by the tests). asym matches bit for bit.
//
// Without a slot mapping the launch also keeps the append's books (PackParams::side, ::rope_center):
// the 16-bit side's copy of the vector and the RoPE center's x - R(p) c, so an append is one launch
// (pack_pair_kernel: K and V) and no PyTorch step.
#pragma once

#include <cmath>
#include <cstdint>

#include "tq_format.h"
#include "tq_params.h"
#include "tq_utils.h"

namespace flash_tq {

// Reductions over the 8 threads of a vector (lanes 8v .. 8v + 7).
__device__ __forceinline__ float group8_sum(float x) {
    #pragma unroll
    for (int o = 1; o < 8; o <<= 1) { x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, o)); }
    return x;
}
__device__ __forceinline__ float group8_min(float x) {
    #pragma unroll
    for (int o = 1; o < 8; o <<= 1) { x = fminf(x, __shfl_xor_sync(0xffffffffu, x, o)); }
    return x;
}
__device__ __forceinline__ float group8_max(float x) {
    #pragma unroll
    for (int o = 1; o < 8; o <<= 1) { x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o)); }
    return x;
}

// Pack kP codes (sequence positions first .. first + kP - 1) into the 16-bit lanes they occupy:
// out[i] is lane (first_lane + i) (fields of lanes shared with a neighbour thread are partial).
template <int kBits, int kP>
struct RunPacker {
    // 2 / 4 bits: whole lanes; 3 bits: kP = 16 is one whole block (3 lanes), kP = 8 half of one
    static constexpr int kLanes = kBits == 3 ? 3 : kP * kBits / 16;
    __device__ static void pack(const int (&code)[kP], int first, uint32_t (&out)[kLanes]) {
        #pragma unroll
        for (int i = 0; i < kLanes; ++i) { out[i] = 0u; }
        if constexpr (kBits == 3) {
            const int r0 = first % 16;  // 0, or 8 for the upper half of a block (kP = 8)
            #pragma unroll
            for (int j = 0; j < kP; ++j) {
                const uint32_t c = static_cast<uint32_t>(code[j]);
                if constexpr (kP == 16) {  // r = j: positions known at compile time
                    if (j == 15) {
                        #pragma unroll
                        for (int b = 0; b < 3; ++b) { out[b] |= ((c >> b) & 1u) << 15; }
                    } else {
                        out[j / 5] |= c << (3 * (j % 5));
                    }
                } else {
                    const int r = r0 + j;
                    if (r == 15) {
                        #pragma unroll
                        for (int b = 0; b < 3; ++b) { out[b] |= ((c >> b) & 1u) << 15; }
                    } else {
                        #pragma unroll
                        for (int l = 0; l < 3; ++l) { out[l] |= (r / 5 == l) ? c << (3 * (r % 5)) : 0u; }
                    }
                }
            }
        } else {
            constexpr int kPerLane = 16 / kBits;
            #pragma unroll
            for (int j = 0; j < kP; ++j) {
                out[j / kPerLane] |= static_cast<uint32_t>(code[j]) << (kBits * (j % kPerLane));
            }
        }
    }
};

// (row, col) of the codes tensor token t goes to; row -1: skipped (a bad position also flags an error).
__device__ __forceinline__ int2 pack_slot(const PackParams &p, int t) {
    if (p.slot_mapping != nullptr) {
        const int64_t slot = p.slot_mapping[t];
        if (slot < 0) return make_int2(-1, 0);
        if (slot >= static_cast<int64_t>(p.rows) * p.cols) {
            if (p.error_flags != nullptr) atomicOr(p.error_flags, kPackPosition);
            return make_int2(-1, 0);
        }
        const int row = static_cast<int>(slot / p.cols);
        return make_int2(row, static_cast<int>(slot - static_cast<int64_t>(row) * p.cols));
    }
    const int i = t / p.n_new, j = t - i * p.n_new;
    const int b = p.batch_idx != nullptr ? p.batch_idx[i] : i;
    const int pos = p.start[i] + j;
    int err = 0, row = b, col = pos;
    if (b < 0 || b >= p.batch_rows) err |= kPackBatchIndex;
    if (pos < 0 || pos >= p.capacity) err |= kPackPosition;
    if (err == 0 && p.block_table != nullptr) {
        row = p.block_table[static_cast<int64_t>(b) * p.block_table_stride + (pos >> p.page_shift)];
        col = pos & ((1 << p.page_shift) - 1);
        if (row < 0 || row >= p.rows) err |= kPackBlock;
    }
    if (err != 0) {
        if (p.error_flags != nullptr) atomicOr(p.error_flags, err);
        return make_int2(-1, 0);
    }
    return make_int2(row, col);
}

// The RoPE center: thread s's P elements of the vector (raw Elem words) become x - R(p') c, p' = pos +
// rope_offset, c = rope_center[seq, head], rounded to Elem, as QuantizedKVCache.transform_keys computes
// them in PyTorch: float32 products and differences, the angle p' * inv_freq in float32, its cosine
// and sine in double (correctly rounded to float; the fast intrinsics would be off by far more than
// float rounding at angles of 1e5). Rotate-half pairs (m, m + d/2): the thread's elements all lie in
// one half (P divides d / 2).
template <typename Elem, int kHeadDim>
__device__ __forceinline__ void rope_center_sub(const PackParams &p, int seq, int head, int pos, int s,
                                                uint4 (&raw)[kHeadDim / 64]) {
    constexpr int P = kHeadDim / 8, kHalf = kHeadDim / 2;
    static_assert(kHalf % P == 0, "a thread's elements lie in one half");
    const float *c = p.rope_center + seq * p.rc_batch_stride + head * p.rc_head_stride;
    const bool upper = s * P >= kHalf;
    const int m0 = (s * P) % kHalf;
    const float pf = __fadd_rn(static_cast<float>(pos), static_cast<float>(p.rope_offset));
    #pragma unroll
    for (int q = 0; q < P / 8; ++q) {
        uint32_t w[4] = {raw[q].x, raw[q].y, raw[q].z, raw[q].w};
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 x = unpack2<Elem>(w[i]);
            float y[2];
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int m = m0 + 8 * q + 2 * i + e;
                double sd, cd;
                sincos(static_cast<double>(__fmul_rn(pf, p.rope_inv_freq[m])), &sd, &cd);
                const float sn = static_cast<float>(sd), cs = static_cast<float>(cd), c1 = c[m], c2 = c[m + kHalf];
                const float rc = upper ? __fadd_rn(__fmul_rn(c2, cs), __fmul_rn(c1, sn))
                                       : __fsub_rn(__fmul_rn(c1, cs), __fmul_rn(c2, sn));
                y[e] = __fsub_rn(e == 0 ? x.x : x.y, rc);
            }
            w[i] = pack2<Elem>(y[0], y[1]);
        }
        raw[q] = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// Blocks `block` of `blocks` (a grid-stride loop over 16 vectors a block) of one pack: the body of
// pack_kv_kernel, and of each half of pack_pair_kernel. Returns whether the thread met an error
// (a vector it could not place or store).
// Turbo's uniform grid at kBits for this thread's elements x of the unnormalized transform (to_unit =
// sqrt(d) / |x|, norm = |x| / sqrt(d)): code = floor(y / step + levels / 2), clamped, and the scale
// (rounded to float16) that gives the levels (code - mid) * step the vector's norm; the norm of the
// levels is step / 2 * sqrt(sum (2 code - (levels - 1))^2), exact in integers. Every lane of the warp
// calls it (the vector's 8 lanes reduce by shuffles).
template <int kBits, int P>
__device__ __forceinline__ float uniform_codes(const float (&x)[P], float to_unit, float norm, float inv_step,
                                               int (&code)[P]) {
    constexpr int kLevels = 1 << kBits;
    const float to_grid = __fmul_rn(to_unit, inv_step);
    int lss = 0;
    #pragma unroll
    for (int k = 0; k < P; ++k) {
        code[k] = min(max(__float2int_rd(__fmaf_rn(x[k], to_grid, 0.5f * kLevels)), 0), kLevels - 1);
        const int twice = 2 * code[k] - (kLevels - 1);
        lss += twice * twice;
    }
    int tot = lss;
    #pragma unroll
    for (int o = 1; o < 8; o <<= 1) { tot += __shfl_xor_sync(0xffffffffu, tot, o); }
    // scale * step = norm / (step / 2 * sqrt(tot)) * step = 2 norm / sqrt(tot)
    return tot > 0 ? __half2float(__float2half_rn(__fdiv_rn(__fmul_rn(2.f, norm), __fsqrt_rn(static_cast<float>(tot)))))
                   : 0.f;
}

// A ring of kBits-wide window codes (PackParams::ring_codes): the vector's codes at that width, stored
// at slot pos % ring of cache row seq when `keep` (every lane calls it: uniform_codes' shuffles).
template <int kBits, int P>
__device__ __forceinline__ void store_ring(const PackParams &p, const float (&x)[P], float to_unit, float norm,
                                           bool keep, int seq, int pos, int head, int s) {
    int code[P];
    const float scale = uniform_codes<kBits, P>(x, to_unit, norm, p.ring_inv_step, code);
    using Packer = RunPacker<kBits, P>;
    static_assert(kBits != 3, "whole 16-bit lanes a thread");
    uint32_t lanes[Packer::kLanes];
    Packer::pack(code, s * P, lanes);
    if (!keep) return;
    const int slot = pos % p.ring;
    uint16_t *dst = reinterpret_cast<uint16_t *>(p.ring_codes + seq * p.ring_codes_batch_stride +
                                                 slot * p.ring_codes_slot_stride + head * p.ring_codes_head_stride) +
                    s * Packer::kLanes;
    #pragma unroll
    for (int i = 0; i < Packer::kLanes; ++i) { dst[i] = static_cast<uint16_t>(lanes[i]); }
    if (s == 0) {
        uint16_t *meta = p.ring_meta + seq * p.ring_meta_batch_stride + slot * p.ring_meta_slot_stride +
                         head * p.ring_meta_head_stride;
        const uint16_t scale_bits = __half_as_ushort(__float2half_rn(scale));
        meta[0] = scale_bits;
        if (p.meta_words == 2) {
            meta[1] = __half_as_ushort(__float2half_rn(__fmul_rn(-scale, 0.5f * ((1 << kBits) - 1))));
        }
    }
}

template <typename Elem, int kHeadDim, int kBits, Quant kQuant>
__device__ __forceinline__ bool pack_vectors(const PackParams &p, int block, int blocks) {
    constexpr int P = kHeadDim / 8;  // elements a thread
    constexpr int kLevels = 1 << kBits;
    constexpr int kPad = 8;  // floats between vectors in the transpose buffer: no bank conflicts
    constexpr bool kTurbo = kQuant != Quant::kAsym;
    __shared__ __align__(16) float xpose[4][4][kHeadDim + kPad];  // [warp][vector][element]
    __shared__ float edge_smem[kLevels], level_smem[kLevels];

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, vsub = lane / 8, s = lane % 8;
    if constexpr (kQuant == Quant::kTurboLloyd) {
        if (threadIdx.x < kLevels) {
            level_smem[threadIdx.x] = p.levels[threadIdx.x];
            edge_smem[threadIdx.x] = threadIdx.x + 1 < kLevels
                                         ? __fmul_rn(__fadd_rn(p.levels[threadIdx.x + 1], p.levels[threadIdx.x]), 0.5f)
                                         : INFINITY;
        }
        __syncthreads();
    }
    // sign bits of the rotation for this thread's loaded elements, as 16-bit sign masks of pairs
    uint32_t sign_mask[P / 2];
    #pragma unroll
    for (int k = 0; k < P / 2; ++k) {
        sign_mask[k] = 0u;
        if constexpr (kTurbo) {
            sign_mask[k] =
                (p.signs[s * P + 2 * k] < 0.f ? 0x8000u : 0u) | (p.signs[s * P + 2 * k + 1] < 0.f ? 0x80000000u : 0u);
        }
    }
    const float sqrt_d = static_cast<float>(sqrt(static_cast<double>(kHeadDim)));
    float *buf = xpose[warp][vsub];

    const int vectors = p.tokens * p.heads;  // < 2^31 (checked on the host)
    const int stride = blocks * 16;
    // 16-byte loads of this thread's P elements of vector `vec` (rows are 16-byte aligned, checked
    // on the host); the next iteration's are in flight while this one computes
    auto load = [&](int vec, uint4(&raw)[P / 8]) {
        const bool live = vec < vectors;
        const int token = live ? vec / p.heads : 0, head = live ? vec - token * p.heads : 0;
        const uint4 *src = reinterpret_cast<const uint4 *>(reinterpret_cast<const Elem *>(p.x) +
                                                           token * p.x_token_stride + head * p.x_head_stride + s * P);
        #pragma unroll
        for (int q = 0; q < P / 8; ++q) { raw[q] = live ? __ldg(src + q) : make_uint4(0u, 0u, 0u, 0u); }
    };
    uint4 next[P / 8];
    int base = block * 16 + warp * 4;
    load(base + vsub, next);
    bool bad = false;
    for (; base < vectors; base += stride) {
        const int vec = base + vsub;
        const bool live = vec < vectors;  // every lane runs (shuffles are warp-wide); only live ones store
        const int token = live ? vec / p.heads : 0, head = live ? vec - token * p.heads : 0;
        uint4 cur[P / 8];
        #pragma unroll
        for (int q = 0; q < P / 8; ++q) { cur[q] = next[q]; }
        load(base + stride + vsub, next);
        // one lane of the vector resolves the slot (checks + block table), the others read it
        int2 cell = make_int2(-1, 0);
        if (live && s == 0) { cell = pack_slot(p, token); }
        const int slot_row = __shfl_sync(0xffffffffu, cell.x, lane & ~7),
                  slot_col = __shfl_sync(0xffffffffu, cell.y, lane & ~7);
        bool store = slot_row >= 0;
        bad |= live && !store && p.slot_mapping == nullptr;  // (a slot mapping's -1 is a skip, not an error)
        // the append's bookkeeping (PackParams::side, ::rope_center): the token's cache row, position
        // and index in the chunk (without a slot mapping, checked on the host)
        const bool extras = p.side != nullptr || p.rope_center != nullptr || p.ring_codes != nullptr;
        const int chunk_i = extras ? token / p.n_new : 0, chunk_j = token - chunk_i * p.n_new;
        const int seq = !extras ? 0 : p.batch_idx != nullptr ? p.batch_idx[chunk_i] : chunk_i;
        const int pos = extras ? p.start[chunk_i] + chunk_j : 0;
        uint4 as_given[P / 8];  // the vector before the RoPE center: what the 16-bit side holds
        #pragma unroll
        for (int q = 0; q < P / 8; ++q) { as_given[q] = cur[q]; }
        if (p.rope_center != nullptr && store) { rope_center_sub<Elem, kHeadDim>(p, seq, head, pos, s, cur); }

        // ---- apply the signs, to float32
        float x[P];
        {
            #pragma unroll
            for (int q = 0; q < P / 8; ++q) {
                const uint4 raw = cur[q];
                const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 f = unpack2<Elem>(w[i] ^ sign_mask[4 * q + i]);
                    x[8 * q + 2 * i] = f.x;
                    x[8 * q + 2 * i + 1] = f.y;
                }
            }
        }
        if constexpr (kTurbo) { butterflies<1, P>(x); }  // index bits below P

        // ---- transpose: thread t takes elements e = 8j + t
        __syncwarp();
        #pragma unroll
        for (int q = 0; q < P / 4; ++q) {
            *reinterpret_cast<float4 *>(buf + s * P + 4 * q) =
                make_float4(x[4 * q], x[4 * q + 1], x[4 * q + 2], x[4 * q + 3]);
        }
        __syncwarp();
        #pragma unroll
        for (int j = 0; j < P; ++j) { x[j] = buf[8 * j + s]; }
        // x[j] is element 8j + s: index bits >= P of the element are bits >= P / 8 of j
        if constexpr (kTurbo) { butterflies<P / 8, P>(x); }

        int code[P];
        float scale_out, offset_out;
        bool finite;
        [[maybe_unused]] float unit_factor = 0.f, norm_out = 0.f;  // turbo uniform: for the ring's codes
        if constexpr (kQuant == Quant::kAsym) {
            float lo = x[0], hi = x[0];
            #pragma unroll
            for (int k = 1; k < P; ++k) {
                lo = fminf(lo, x[k]);
                hi = fmaxf(hi, x[k]);
            }
            float nan_probe = 0.f;  // x * 0 is NaN exactly for NaN / Inf (fminf / fmaxf skip NaN)
            #pragma unroll
            for (int k = 0; k < P; ++k) { nan_probe = __fmaf_rn(x[k], 0.f, nan_probe); }
            const float vmin = group8_min(lo), vmax = group8_max(hi);
            finite = group8_sum(nan_probe) == 0.f;
            float scale =
                __half2float(__float2half_rn(__fdiv_rn(__fsub_rn(vmax, vmin), static_cast<float>(kLevels - 1))));
            if (!(scale > 0.f)) scale = 1.f;
            // the grid starts at the vector's own minimum (rounded to float16 before any code is
            // taken from it), so vectors that do not straddle 0 are coded as finely as those that do
            const float offset = __half2float(__float2half_rn(vmin));
            #pragma unroll
            for (int k = 0; k < P; ++k) {
                code[k] = static_cast<int>(fminf(
                    fmaxf(floorf(__fadd_rn(__fdiv_rn(__fsub_rn(x[k], offset), scale), 0.5f)), 0.f), kLevels - 1.f));
            }
            scale_out = scale;
            offset_out = offset;
        } else if constexpr (kQuant == Quant::kTurboMean) {
            // x is the unnormalized transform H x (the rotated vector is x / sqrt(d)): fit the grid
            // to r = x - mean(x): codes of r * sqrt(d) / |r| on the uniform grid, then the
            // least-squares affine map of the codes' deviations onto r's, plus the mean
            float sx = 0.f;
            #pragma unroll
            for (int k = 0; k < P; ++k) { sx = __fadd_rn(sx, x[k]); }
            const float mean_u = __fdiv_rn(group8_sum(sx), static_cast<float>(kHeadDim));
            float ss = 0.f;
            #pragma unroll
            for (int k = 0; k < P; ++k) {
                x[k] = __fsub_rn(x[k], mean_u);
                ss = __fmaf_rn(x[k], x[k], ss);
            }
            const float rn_u = __fsqrt_rn(group8_sum(ss));
            finite = rn_u < INFINITY;
            const float to_grid = rn_u > 0.f ? __fmul_rn(__fdiv_rn(sqrt_d, rn_u), p.inv_step) : 0.f;
            int s1 = 0, s2 = 0;
            #pragma unroll
            for (int k = 0; k < P; ++k) {
                code[k] = min(max(__float2int_rd(__fmaf_rn(x[k], to_grid, 0.5f * kLevels)), 0), kLevels - 1);
                s1 += code[k];
                s2 += code[k] * code[k];
            }
            #pragma unroll
            for (int o = 1; o < 8; o <<= 1) {
                s1 += __shfl_xor_sync(0xffffffffu, s1, o);
                s2 += __shfl_xor_sync(0xffffffffu, s2, o);
            }
            // |c - mean(c)|^2 = (d * sum c^2 - (sum c)^2) / d, exact in integers
            const float cn =
                __fsqrt_rn(__fdiv_rn(static_cast<float>(kHeadDim * s2 - s1 * s1), static_cast<float>(kHeadDim)));
            const float rn = __fdiv_rn(rn_u, sqrt_d), mean = __fdiv_rn(mean_u, sqrt_d);
            const float cm = __fdiv_rn(static_cast<float>(s1), static_cast<float>(kHeadDim));
            scale_out = cn > 0.f ? __half2float(__float2half_rn(__fdiv_rn(rn, cn))) : 0.f;
            offset_out = __fsub_rn(mean, __fmul_rn(scale_out, cm));
        } else {
            // x is the unnormalized transform H x: the rotated vector is x / sqrt(d), its norm
            // norm_u / sqrt(d), and the unit-variance coordinate y = x * sqrt(d) / norm_u
            float ss = 0.f;
            #pragma unroll
            for (int k = 0; k < P; ++k) { ss = __fmaf_rn(x[k], x[k], ss); }
            const float norm_u = __fsqrt_rn(group8_sum(ss));
            finite = norm_u < INFINITY;  // NaN or Inf anywhere in the vector: not finite
            const float to_unit = norm_u > 0.f ? __fdiv_rn(sqrt_d, norm_u) : 0.f;
            const float norm = __fdiv_rn(norm_u, sqrt_d);
            if constexpr (kQuant == Quant::kTurboUniform) {
                scale_out = uniform_codes<kBits, P>(x, to_unit, norm, p.inv_step, code);
                offset_out = __fmul_rn(-scale_out, 0.5f * (kLevels - 1));
                unit_factor = to_unit;
                norm_out = norm;
            } else {
                float lss = 0.f;
                #pragma unroll
                for (int k = 0; k < P; ++k) {
                    const float y = __fmul_rn(x[k], to_unit);
                    int cnt = 0;  // number of bin edges at or below y: a value on an edge goes up
                    #pragma unroll
                    for (int e = 0; e + 1 < kLevels; ++e) { cnt += y >= edge_smem[e] ? 1 : 0; }
                    code[k] = cnt;
                    const float level = level_smem[cnt];
                    lss = __fmaf_rn(level, level, lss);
                }
                const float lnorm = __fsqrt_rn(group8_sum(lss));
                scale_out = lnorm > 0.f ? __fdiv_rn(norm, lnorm) : 0.f;
                offset_out = 0.f;
            }
        }

        // the meta words are float16: a scale or offset past its range (a bf16 / fp32 vector that large)
        // would be stored as Inf, so such a vector is refused like a non-finite one (65520 rounds to Inf)
        finite = finite && fabsf(scale_out) < 65520.f && fabsf(offset_out) < 65520.f;
        if (!finite) {  // a quantized cache cannot hold it: flag the call, write nothing
            if (store && s == 0 && p.error_flags != nullptr) { atomicOr(p.error_flags, kPackNonFinite); }
            bad |= store;
            store = false;
        }

        // ---- pack this thread's run of codes (positions s*P ...) and store
        using Packer = RunPacker<kBits, P>;
        uint32_t lanes[Packer::kLanes];
        Packer::pack(code, s * P, lanes);
        uint8_t *row =
            p.codes + slot_row * p.codes_row_stride + slot_col * p.codes_col_stride + head * p.codes_head_stride;
        if constexpr (kBits == 3 && P == 8) {  // half blocks: merge with the neighbour, the even thread stores
            #pragma unroll
            for (int i = 0; i < 3; ++i) { lanes[i] |= __shfl_xor_sync(0xffffffffu, lanes[i], 1); }
            if (store && (s & 1) == 0) {
                uint16_t *dst = reinterpret_cast<uint16_t *>(row + 6 * (s / 2));
                #pragma unroll
                for (int i = 0; i < 3; ++i) { dst[i] = static_cast<uint16_t>(lanes[i]); }
            }
        } else if (store) {
            constexpr int kBytes = Packer::kLanes * 2;  // 6 (3-bit), 2 / 4 / 8 / 16
            uint8_t *dst = row + s * kBytes;
            if constexpr (kBytes == 16) {
                *reinterpret_cast<uint4 *>(dst) = make_uint4(lanes[0] | (lanes[1] << 16), lanes[2] | (lanes[3] << 16),
                                                             lanes[4] | (lanes[5] << 16), lanes[6] | (lanes[7] << 16));
            } else if constexpr (kBytes == 8) {
                *reinterpret_cast<uint2 *>(dst) = make_uint2(lanes[0] | (lanes[1] << 16), lanes[2] | (lanes[3] << 16));
            } else if constexpr (kBytes == 4) {
                *reinterpret_cast<uint32_t *>(dst) = lanes[0] | (lanes[1] << 16);
            } else {
                #pragma unroll
                for (int i = 0; i < Packer::kLanes; ++i) {
                    reinterpret_cast<uint16_t *>(dst)[i] = static_cast<uint16_t>(lanes[i]);
                }
            }
        }
        if constexpr (kQuant == Quant::kTurboUniform) {
            if (p.ring_codes != nullptr && p.ring_bits == 4) {  // (warp-uniform: the 4-bit ring, the one built)
                store_ring<4, P>(p, x, unit_factor, norm_out, store && chunk_j >= p.n_new - p.ring, seq, pos, head, s);
            }
        }
        if (p.side != nullptr && store) {  // a sink, or one of the chunk's last side_ring tokens
            const int slot = pos < p.side_sinks                                    ? pos
                             : p.side_ring > 0 && chunk_j >= p.n_new - p.side_ring ? p.side_sinks + pos % p.side_ring
                                                                                   : -1;
            if (slot >= 0) {
                uint4 *dst = reinterpret_cast<uint4 *>(static_cast<Elem *>(p.side) + seq * p.side_batch_stride +
                                                       slot * p.side_slot_stride + head * p.side_head_stride + s * P);
                #pragma unroll
                for (int q = 0; q < P / 8; ++q) { dst[q] = as_given[q]; }
            }
        }
        if (store && s == 0) {
            uint16_t *dst =
                p.meta + slot_row * p.meta_row_stride + slot_col * p.meta_col_stride + head * p.meta_head_stride;
            const uint16_t scale_bits = __half_as_ushort(__float2half_rn(scale_out));
            if (p.meta_words == 1) {  // the offset is -mid * scale by construction: not stored
                *dst = scale_bits;
            } else {
                *reinterpret_cast<uint32_t *>(dst) =
                    scale_bits | (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(offset_out))) << 16);
            }
        }
    }
    return bad;
}

// The append's length update (PackParams::lengths), once the CTA is done with its vectors: the CTA
// counts itself into the tally (after setting its top bit if it met an error); the last to count
// knows that every CTA has read `start` (which lengths may be), so it writes the lengths, unless a
// CTA met an error, and leaves the tally at zero for the next launch.
constexpr unsigned kTallyError = 1u << 31;
__device__ __forceinline__ void advance_lengths(const PackParams &p, bool bad) {
    __shared__ unsigned tally;
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) {
        __threadfence();
        if (bad) { atomicOr(p.tally, kTallyError); }
        tally = atomicAdd(p.tally, 1u) + 1u;
        __threadfence();  // (the last CTA's length stores after every CTA's reads of start)
    }
    __syncthreads();
    if ((tally & ~kTallyError) != gridDim.x * gridDim.y) return;  // (CTA-uniform)
    if ((tally & kTallyError) == 0u) {
        const int entries = p.tokens / p.n_new;
        for (int i = threadIdx.x; i < entries; i += blockDim.x) {
            const int row = p.batch_idx != nullptr ? p.batch_idx[i] : i;
            if (row >= 0 && row < p.lengths_rows) { p.lengths[row] = p.start[i] + p.n_new; }
        }
    }
    if (threadIdx.x == 0) { *p.tally = 0u; }
}

// The first of an append's two pack launches (K's, when K and V take a launch each: the second
// advances the lengths): an error only marks the tally, so the second launch's last CTA sees it.
__device__ __forceinline__ void mark_tally_error(const PackParams &p, bool bad) {
    if (__syncthreads_or(bad) && threadIdx.x == 0) { atomicOr(p.tally, kTallyError); }
}

template <typename Elem, int kHeadDim, int kBits, Quant kQuant>
__global__ void __launch_bounds__(128) pack_kv_kernel(const __grid_constant__ PackParams p) {
    pdl_launch_dependents();  // (a decode kernel after it waits for its end: tq_decode_launch.h)
    const bool bad = pack_vectors<Elem, kHeadDim, kBits, kQuant>(p, blockIdx.x, gridDim.x);
    if (p.lengths != nullptr) {
        advance_lengths(p, bad);
    } else if (p.tally != nullptr) {
        mark_tally_error(p, bad);
    }
}

// An append's K and V in one launch (grid.y: 0 K, 1 V): half the launches of a decode step's
// appends, whose vectors are too few to fill the GPU either way.
template <typename Elem, int kHeadDim, int kKBits, int kVBits, Quant kQuant>
__global__ void __launch_bounds__(128)
    pack_pair_kernel(const __grid_constant__ PackParams k, const __grid_constant__ PackParams v) {
    pdl_launch_dependents();
    const bool bad = blockIdx.y == 0 ? pack_vectors<Elem, kHeadDim, kKBits, kQuant>(k, blockIdx.x, gridDim.x)
                                     : pack_vectors<Elem, kHeadDim, kVBits, kQuant>(v, blockIdx.x, gridDim.x);
    if (k.lengths != nullptr) { advance_lengths(k, bad); }  // (K's and V's start are the same)
}

}  // namespace flash_tq
