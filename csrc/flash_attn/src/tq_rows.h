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

// The cache row of batch entry b (cache_batch_idx[b], or b) and the base-2 score scale of its rows.
// A GPU index cannot be checked without a host sync, so an entry outside [0, cache_rows) reads row 0
// (never memory past the cache) with a NaN scale: its rows come out NaN (the stores below keep NaN).
struct CacheRow {
    int row;
    float scale_log2;
};
__device__ __forceinline__ CacheRow cache_row(const DecodeParams &p, int b) {
    if (p.cache_batch_idx == nullptr) return {b, p.scale_softmax_log2};
    const int bc = p.cache_batch_idx[b];
    const bool named = bc >= 0 && bc < p.cache_rows;
    return {named ? bc : 0, named ? p.scale_softmax_log2 : __int_as_float(0x7fc00000)};
}

// Position of side slot t in a sequence of n keys (see DecodeParams::side_k), or -1 when the slot
// holds no key that pass attends: a sink beyond n, a ring slot not yet written or holding a sink.
__device__ __forceinline__ int side_position(const DecodeParams &p, int t, int n) {
    if (t < p.side_sinks) return t < n ? t : -1;
    const int s = t - p.side_sinks;
    if (s >= p.side_ring) return -1;
    int age = (n - 1 - s) % p.side_ring;
    age += age < 0 ? p.side_ring : 0;
    const int pos = n - 1 - age;
    return pos >= p.side_sinks && pos >= 0 ? pos : -1;
}

// Whether a row whose keys end at key_limit (exclusive) sees any of the ring's keys: the last
// side_ring of n, after the sinks. Rows that see none (most of a long causal chunk's) attend the
// side's sinks alone.
__device__ __forceinline__ bool sees_side_ring(const DecodeParams &p, int key_limit, int n) {
    return key_limit > max(p.side_sinks, n - p.side_ring);
}

// A recent window of codes_tail keys (codes_tail > 0): the first key a row whose keys end at
// key_limit reads from the ring rather than the codes. A one-token decode at that row's length sees
// its last codes_tail keys in the window, so a row of a multi-token call does too where the ring
// still holds them (side_ring >= codes_tail + the call's rows - 1: a verify call of draft tokens
// attends as one-token decodes would); past the ring's oldest key (n - side_ring) the codes serve.
// The codes are attended below it, the ring from it. Grows with key_limit. (A ring as large as the
// window: n - codes_tail for every row.)
__device__ __forceinline__ int window_start(const DecodeParams &p, int key_limit, int n) {
    return max(key_limit - p.codes_tail, n - max(p.side_ring, p.codes_tail));
}

// Upstream's softcap on a base-2 score: c tanh(s / c), c = softcap * log2(e).
__device__ __forceinline__ float softcap_score(float s, float c) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(s / c));
    return c * t;
}

// The query head of row r of the codes' kv head hk (a head group's heads placed in the layer's).
__device__ __forceinline__ int query_head(const DecodeParams &p, int hk, int r) {
    const int layer_hk = hk + p.head_base + (hk >= p.head_skip_from ? p.head_skip : 0);
    return layer_hk * p.h_h_k_ratio + r % p.h_h_k_ratio;
}

template <typename Elem>
__device__ __forceinline__ const Elem *q_row_ptr(const DecodeParams &p, int b, int hk, int r) {
    return reinterpret_cast<const Elem *>(p.q) + b * p.q_batch_stride + (r / p.h_h_k_ratio) * p.q_row_stride +
           query_head(p, hk, r) * p.q_head_stride;
}

template <typename Elem>
__device__ __forceinline__ Elem *out_row_ptr(const DecodeParams &p, int b, int hk, int r) {
    return reinterpret_cast<Elem *>(p.out) + b * p.o_batch_stride + (r / p.h_h_k_ratio) * p.o_row_stride +
           query_head(p, hk, r) * p.o_head_stride;
}

// turbo: rows [row0, row0 + kRows) of q, sign-flipped and Walsh-Hadamard transformed (unnormalized),
// a warp a row, into sm_q[kRows][kStride] (rows past total_rows: zeros). The caller synchronizes.
// (The decode kernel: a few rows a warp.)
template <typename Elem, int D, int kRows, int kWarps, int kStride = D>
__device__ void rotate_q_rows(const DecodeParams &p, int b, int hk, int row0, int total_rows, float *sm_q, int warp,
                              int lane) {
    constexpr int kV = RowMath<D>::kV;
    #pragma unroll 1
    for (int n = warp; n < kRows; n += kWarps) {
        float x[kV];
        const int r = row0 + n;
        #pragma unroll
        for (int k = 0; k < kV; ++k) { x[k] = 0.f; }
        if (r < total_rows) {  // warp-uniform; padding rows stay zero, untransformed
            load_row_part<Elem, kV>(q_row_ptr<Elem>(p, b, hk, r) + lane * kV, x);
            #pragma unroll
            for (int k = 0; k < kV; ++k) { x[k] *= p.rot_signs[lane * kV + k]; }
            fwht_warp<D>(x, lane);
        }
        #pragma unroll
        for (int k = 0; k < kV; ++k) { sm_q[n * kStride + lane * kV + k] = x[k]; }
    }
}

// A row's log-sum-exp (natural log) from its base-2 max and probability sum: -inf without keys
// (the split accumulators' convention; the output's lse is +inf there, as upstream writes).
__device__ __forceinline__ float row_lse(float max_log2, float total) {
    constexpr float kLn2 = 0.6931471805599453f;
    return total != 0.f ? (max_log2 + log2f(total)) * kLn2 : -INFINITY;  // (NaN stays NaN)
}

// The prefill kernel's rotation: the same rows, a lane quad a row (fwht_quad_rows), 8 x kBatch rows
// a warp at a time, every row's loads issued before any is transformed (a warp a row, 16 rows
// at once, took 12 us of an 8K x 1024 call on the H200).
template <typename Elem, int D, int kRows, int kWarps, int kBatch, int kStride>
__device__ void rotate_q_quads(const DecodeParams &p, int b, int hk, int row0, int total_rows, float *sm_q, int warp,
                               int lane) {
    constexpr int J = D / 8;
    static_assert(kRows % (8 * kBatch * kWarps) == 0, "whole batches of rows a warp");
    const int g = lane / 4, c = lane % 4;
    float sign[J][2];  // of the lane's elements 8j + 2c + e
    #pragma unroll
    for (int j = 0; j < J; ++j) {
        const float2 s = *reinterpret_cast<const float2 *>(p.rot_signs + 8 * j + 2 * c);
        sign[j][0] = s.x;
        sign[j][1] = s.y;
    }
    #pragma unroll 1
    for (int n0 = 8 * kBatch * warp; n0 < kRows; n0 += 8 * kBatch * kWarps) {
        float x[kBatch][J][2];
        #pragma unroll
        for (int u = 0; u < kBatch; ++u) {  // rows past the end read row 0
            const int r = row0 + n0 + 8 * u + g;
            const Elem *q = q_row_ptr<Elem>(p, b, hk, r < total_rows ? r : 0) + 2 * c;
            #pragma unroll
            for (int j = 0; j < J; ++j) {
                const float2 v = unpack2<Elem>(*reinterpret_cast<const uint32_t *>(q + 8 * j));
                x[u][j][0] = v.x;
                x[u][j][1] = v.y;
            }
        }
        #pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const bool valid = row0 + n0 + 8 * u + g < total_rows;
            #pragma unroll
            for (int j = 0; j < J; ++j) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) { x[u][j][e] = valid ? x[u][j][e] * sign[j][e] : 0.f; }
            }
        }
        fwht_quad_rows<D, kBatch>(x, lane);
        #pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            #pragma unroll
            for (int j = 0; j < J; ++j) {
                *reinterpret_cast<float2 *>(sm_q + (n0 + 8 * u + g) * kStride + 8 * j + 2 * c) =
                    make_float2(x[u][j][0], x[u][j][1]);
            }
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
    magic = KV::kKMagicValue * ms;
}

// A row (the lane's kV elements) back from turbo's rotated domain: the transform, then the sign
// flips and 1 / sqrt(D).
template <int D>
__device__ __forceinline__ void unrotate_row(const float *rot_signs, float (&o)[D / 32], int lane) {
    constexpr int kV = RowMath<D>::kV;
    fwht_warp<D>(o, lane);
    #pragma unroll
    for (int k = 0; k < kV; ++k) { o[k] *= rot_signs[lane * kV + k] * RowMath<D>::kInvSqrtD; }
}

// The inverse of unrotate_row: a row (the lane's kV elements) into turbo's rotated domain, as q
// goes (sign flips, the transform, 1 / sqrt(D)).
template <int D>
__device__ __forceinline__ void rotate_row(const float *rot_signs, float (&o)[D / 32], int lane) {
    constexpr int kV = RowMath<D>::kV;
    #pragma unroll
    for (int k = 0; k < kV; ++k) { o[k] *= rot_signs[lane * kV + k]; }
    fwht_warp<D>(o, lane);
    #pragma unroll
    for (int k = 0; k < kV; ++k) { o[k] *= RowMath<D>::kInvSqrtD; }
}

// Store output row r (o: the lane's kV consecutive elements, normalized; max_log2 / total: the
// row's base-2 max and probability sum). One split: rotate back (turbo), write out and the lse
// (natural log; +inf for a row with no visible key, as upstream writes). Several splits: the raw
// row and its lse go to the accumulators, the combine kernel rotates.
template <typename Elem, int D>
__device__ __forceinline__ void store_row(const DecodeParams &p, int b, int hk, int split, int r, float (&o)[D / 32],
                                          float max_log2, float total, int lane) {
    constexpr int kV = RowMath<D>::kV;
    const int i = r / p.h_h_k_ratio, hq = query_head(p, hk, r);
    const float lse = row_lse(max_log2, total);
    if (p.num_splits == 1) {
        if (p.rot_signs != nullptr) { unrotate_row<D>(p.rot_signs, o, lane); }
        store_row_part<Elem, kV>(out_row_ptr<Elem>(p, b, hk, r) + lane * kV, o);
        if (lane == 0) {
            p.softmax_lse[(static_cast<int64_t>(b) * p.h + hq) * p.seqlen_q + i] = total != 0.f ? lse : INFINITY;
        }
    } else {
        const int64_t row_id = ((static_cast<int64_t>(split) * p.b + b) * p.h + hq) * p.seqlen_q + i;
        float *acc_out = p.out_accum + row_id * D + lane * kV;
        if constexpr (kV == 4) {
            *reinterpret_cast<float4 *>(acc_out) = make_float4(o[0], o[1], o[2], o[3]);
        } else {
            *reinterpret_cast<float2 *>(acc_out) = make_float2(o[0], o[1]);
        }
        if (lane == 0) { p.lse_accum[row_id] = lse; }
    }
}

// Empty partials (lse -inf, o 0) in split slots [from, to) of the CTA's rows (blockIdx.z's row block)
// of batch entry * h_k + kv head bh: the slots a head group with fewer splits leaves (decode_pair_split).
template <int D, int kRows>
__device__ __forceinline__ void clear_splits(const DecodeParams &p, int bh, int from, int to) {
    const int b = bh / p.h_k, hk = bh % p.h_k, total_rows = p.h_h_k_ratio * p.seqlen_q;
    const int row0 = blockIdx.z * kRows, rows = min(kRows, total_rows - row0);
    for (int k = threadIdx.x; k < (to - from) * rows * (D / 4); k += blockDim.x) {
        const int split = from + k / (rows * (D / 4)), r = row0 + k / (D / 4) % rows, part = k % (D / 4);
        const int64_t row_id =
            ((static_cast<int64_t>(split) * p.b + b) * p.h + query_head(p, hk, r)) * p.seqlen_q + r / p.h_h_k_ratio;
        *reinterpret_cast<float4 *>(p.out_accum + row_id * D + 4 * part) = make_float4(0.f, 0.f, 0.f, 0.f);
        if (part == 0) { p.lse_accum[row_id] = -INFINITY; }
    }
}

}  // namespace flash_tq
