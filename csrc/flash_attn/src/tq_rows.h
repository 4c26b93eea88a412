// Query and output rows, shared by the decode (tq_decode_kernel.h) and prefill
// (tq_prefill_kernel.h) kernels: causal key limits, the turbo rotation of q, q gathered in the
// loader's slot order, and the final store (rotation back, lse, or a split's partial result).
//
// Rows: row r of a (batch, kv head) is query position r / group of q head hk * group + r % group,
// so a GQA group's heads share every K/V tile.
#pragma once

#include <cmath>

#include "tq_params.h"
#include "tq_utils.h"

namespace flash_tq {

template <int kHeadDim>
struct RowMath {
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims");
    static constexpr int kV = kHeadDim / 32;  // elements a lane holds of a row in the warp-wide transforms
    static constexpr float kInvSqrtD = kHeadDim == 128 ? 0.08838834764831845f : 0.125f;
};

// Keys [key_first, key_limit) visible to row r (none for rows past the last): bottom-right causal
// alignment and the local window. Both grow with r.
__device__ __forceinline__ int key_limit(const DecodeParams &p, int seqlen_k, int total_rows, int r) {
    if (r >= total_rows) return 0;
    const int right = p.is_causal ? 0 : p.window_right;
    if (right < 0) return seqlen_k;
    return max(0, min(seqlen_k, seqlen_k - p.seqlen_q + r / p.h_h_k_ratio + right + 1));
}
// key_start: the sequence's first key (cache_leftpad; 0 without). 0 in the kernels' non-local variants.
template <bool kLocal>
__device__ __forceinline__ int key_first(const DecodeParams &p, int seqlen_k, int total_rows, int r, int key_start) {
    if (!kLocal || r >= total_rows) return 0;
    if (p.window_left < 0) return key_start;
    return max(key_start, seqlen_k - p.seqlen_q + r / p.h_h_k_ratio - p.window_left);
}

// Upstream's softcap on a base-2 score: c tanh(s / c), c = softcap * log2(e).
__device__ __forceinline__ float softcap_score(float s, float c) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(s / c));
    return c * t;
}

template <typename Elem>
__device__ __forceinline__ const Elem *q_row_ptr(const DecodeParams &p, int b, int hk, int r) {
    const int group = p.h_h_k_ratio;
    return reinterpret_cast<const Elem *>(p.q) + b * p.q_batch_stride + (r / group) * p.q_row_stride +
           (hk * group + r % group) * p.q_head_stride;
}

// turbo: rows [row0, row0 + kRows) of q, sign-flipped and Walsh-Hadamard transformed (unnormalized),
// a warp a row, into sm_q[kRows][kStride] (rows past total_rows: zeros). The caller synchronizes. A warp
// with 8+ rows loads kMaxBatch of them before transforming them: one global-load latency per batch,
// not per row (the prefill kernel's wgmma variant: 16, all of them; 4 at a time took 15 us of an
// 8K x 1024 call on the H200; its mma.sync variant keeps 4, which keeps it free of spills); the
// decode kernel's 2-4 rows a warp go one at a time, which keeps its registers.
template <typename Elem, int D, int kRows, int kWarps, int kMaxBatch = 4, int kStride = D>
__device__ void rotate_q_rows(const DecodeParams &p, int b, int hk, int row0, int total_rows, float *sm_q,
                              int warp, int lane) {
    constexpr int kV = RowMath<D>::kV;
    constexpr int kPerWarp = kRows / kWarps, kBatch = kPerWarp >= 8 ? (kPerWarp < kMaxBatch ? kPerWarp : kMaxBatch) : 1;
    static_assert(kRows % kWarps == 0 && kPerWarp % kBatch == 0, "whole batches of rows a warp");
    #pragma unroll 1
    for (int n0 = warp; n0 < kRows; n0 += kBatch * kWarps) {
        float x[kBatch][kV];
        if constexpr (kBatch == 1) {
            const int r = row0 + n0;
            #pragma unroll
            for (int k = 0; k < kV; ++k) { x[0][k] = 0.f; }
            if (r < total_rows) {
                load_row_part<Elem, kV>(q_row_ptr<Elem>(p, b, hk, r) + lane * kV, x[0]);
                #pragma unroll
                for (int k = 0; k < kV; ++k) { x[0][k] *= p.rot_signs[lane * kV + k]; }
            }
        } else {  // rows n0 + kWarps * u: every load issued before any is used (rows past the end read row 0)
            #pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const int r = row0 + n0 + kWarps * u;
                load_row_part<Elem, kV>(q_row_ptr<Elem>(p, b, hk, r < total_rows ? r : 0) + lane * kV, x[u]);
            }
            #pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const bool valid = row0 + n0 + kWarps * u < total_rows;
                #pragma unroll
                for (int k = 0; k < kV; ++k) { x[u][k] = valid ? x[u][k] * p.rot_signs[lane * kV + k] : 0.f; }
            }
        }
        fwht_warp_rows<D, kBatch>(x, lane);
        #pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            #pragma unroll
            for (int k = 0; k < kV; ++k) { sm_q[(n0 + kWarps * u) * kStride + lane * kV + k] = x[u][k]; }
        }
    }
}

// One query row in the loader's pair-slot order, as the two registers (half 0, 1) of each k-block
// that thread c holds: for raw K values (kRawK) scaled by 8^-q_scale_exp (powers of two: exact).
// `sum` returns the row's sum of its (rounded) elements (for K's offsets), `magic` the loader's
// magic value times the sum of the scaled elements (for the magic number in raw K values); both
// reduced over the row's 4 lanes. q_at(e): element e of the row (rotated and normalized for turbo).
template <typename KV, typename Elem, int KB, bool kRawK = true, typename QAt>
__device__ __forceinline__ void q_row_slots(QAt q_at, int c, uint32_t (&f)[KB][2], float &sum, float &magic) {
    float s = 0.f, ms = 0.f;
    #pragma unroll
    for (int kb = 0; kb < KB; ++kb) {
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int slot = KV::q_slot(c, kb, half);
            const int e = kRawK ? KV::q_scale_exp(slot) : 0;
            const float down = exp2f(-3.f * e);
            const int t = 2 * kb + half;
            f[kb][half] = pack2<Elem>(q_at(KV::q_element_at(c, t, 0)) * down, q_at(KV::q_element_at(c, t, 1)) * down);
            const float2 used = unpack2<Elem>(f[kb][half]);
            s += (used.x + used.y) * exp2f(3.f * e);
            ms += used.x + used.y;
        }
    }
    #pragma unroll
    for (int o = 1; o <= 2; o *= 2) {
        s += __shfl_xor_sync(0xffffffffu, s, o);
        ms += __shfl_xor_sync(0xffffffffu, ms, o);
    }
    sum = s;
    magic = KV::kMagicValue * ms;
}

// kN rows (the lane's kV elements each) back from turbo's rotated domain: the transform, then the
// sign flips and 1 / sqrt(D); the rows' shuffles interleave.
template <int D, int kN>
__device__ __forceinline__ void unrotate_rows(const float *rot_signs, float (&o)[kN][D / 32], int lane) {
    constexpr int kV = RowMath<D>::kV;
    fwht_warp_rows<D, kN>(o, lane);
    #pragma unroll
    for (int k = 0; k < kV; ++k) {
        const float s = rot_signs[lane * kV + k] * RowMath<D>::kInvSqrtD;
        #pragma unroll
        for (int u = 0; u < kN; ++u) { o[u][k] *= s; }
    }
}

// Store output rows r0 .. r0 + kN - 1 below total_rows (o[u]: the lane's kV consecutive elements of
// row r0 + u, normalized; max_log2 / total: the row's base-2 max and probability sum). One split:
// rotate back (turbo), write out and the lse (natural log; +inf for a
// row with no visible key, as upstream writes). Several splits: the raw rows and their lse go to
// the accumulators, the combine kernel rotates. store_row: one row.
template <typename Elem, int D, int kN>
__device__ __forceinline__ void store_rows(const DecodeParams &p, int b, int hk, int split, int r0, int total_rows,
                                           float (&o)[kN][D / 32], const float (&max_log2)[kN],
                                           const float (&total)[kN], int lane) {
    constexpr int kV = RowMath<D>::kV;
    constexpr float kLn2 = 0.6931471805599453f;
    if (p.num_splits == 1 && p.rot_signs != nullptr) { unrotate_rows<D, kN>(p.rot_signs, o, lane); }
    #pragma unroll
    for (int u = 0; u < kN; ++u) {
        const int r = r0 + u;
        if (r >= total_rows) break;
        const int group = p.h_h_k_ratio, i = r / group, hq = hk * group + r % group;
        const float lse = total[u] > 0.f ? (max_log2[u] + log2f(total[u])) * kLn2 : -INFINITY;
        if (p.num_splits == 1) {
            Elem *out = reinterpret_cast<Elem *>(p.out) + b * p.o_batch_stride + i * p.o_row_stride + hq * p.o_head_stride;
            store_row_part<Elem, kV>(out + lane * kV, o[u]);
            if (lane == 0) { p.softmax_lse[(static_cast<int64_t>(b) * p.h + hq) * p.seqlen_q + i] = total[u] > 0.f ? lse : INFINITY; }
        } else {
            const int64_t row_id = ((static_cast<int64_t>(split) * p.b + b) * p.h + hq) * p.seqlen_q + i;
            float *acc_out = p.out_accum + row_id * D + lane * kV;
            if constexpr (kV == 4) {
                *reinterpret_cast<float4 *>(acc_out) = make_float4(o[u][0], o[u][1], o[u][2], o[u][3]);
            } else {
                *reinterpret_cast<float2 *>(acc_out) = make_float2(o[u][0], o[u][1]);
            }
            if (lane == 0) { p.lse_accum[row_id] = lse; }
        }
    }
}
template <typename Elem, int D>
__device__ __forceinline__ void store_row(const DecodeParams &p, int b, int hk, int split, int r, float (&o)[D / 32],
                                          float max_log2, float total, int lane) {
    const float mx[1] = {max_log2}, tot[1] = {total};
    store_rows<Elem, D, 1>(p, b, hk, split, r, r + 1, reinterpret_cast<float (&)[1][D / 32]>(o), mx, tot, lane);
}

}  // namespace flash_tq
