// The 16-bit side (sink tokens and the recent ring, DecodeParams::side_k) of a chunk's rows: the
// prefill kernel's companion launch, written as the launch's last split (the prefill epilogue or
// the combine kernel merges it). Query rows are the MMA's M (16 a warp, 64 a CTA), the side's
// slots its N: S = Q K^T and O = P V straight from shared-memory tiles of 16 slots, an online
// softmax a row, no merge across warps. Rows that see none of the ring's keys (causal: all of a
// long chunk's but its last `side_ring` queries) read the sinks' tile alone. The side holds keys
// and values as they are, so q is not rotated and the output is rotated forward into the codes'
// domain (turbo), as the combine kernel and the prefill epilogue expect of a split.
#pragma once

#include <cmath>

#include "tq_params.h"
#include "tq_rows.h"
#include "tq_utils.h"

namespace flash_tq {

template <typename Elem_, int kHeadDim_>
struct SideRowsTraits {
    using Elem = Elem_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kNWarps = 4;
    static constexpr int kNThreads = 32 * kNWarps;
    static constexpr int kRows = 16 * kNWarps;  // query rows a CTA: one m16 tile a warp
    static constexpr int kTileN = 16;           // side slots a tile
    static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks a slot's row
    static constexpr int kTileBytes = kTileN * kHeadDim * 2;
    static constexpr int kSmemBytes = 2 * 2 * kTileBytes;  // K and V, two stages
    // 16-byte chunk l of slot t's row: XOR-swizzled by the slot, so the 8 rows an ldmatrix phase
    // reads at one chunk fall in 8 bank groups
    __device__ static int chunk(int t, int l) { return t * kChunks + (l ^ (t & 7)); }
};

template <typename T>
__global__ void __launch_bounds__(T::kNThreads) side_rows_kernel(const DecodeParams p) {
    using Elem = typename T::Elem;
    constexpr int D = T::kHeadDim, KB = D / 16, DJ = D / 8, kTileN = T::kTileN;
    constexpr float kNegInf = -INFINITY;
    __shared__ __align__(128) char smem[T::kSmemBytes];
    pdl_launch_dependents();  // (the prefill kernel after it, or the combine: run_prefill)
    const int tid = threadIdx.x, warp = __shfl_sync(0xffffffffu, tid / 32, 0), lane = tid % 32, g = lane / 4,
              c = lane % 4;
    const int b = blockIdx.y / p.h_k, hk = blockIdx.y % p.h_k;
    const int group = p.h_h_k_ratio, total_rows = group * p.seqlen_q;
    const int row0 = blockIdx.x * T::kRows, wrow0 = row0 + 16 * warp;
    const CacheRow entry = cache_row(p, b);
    const int bc = entry.row;
    const int seqlen_all = max(0, min(p.seqlens_k[b], p.max_seqlen_k));

    // the slots the CTA's rows can see: the sinks, and the ring when its last row reaches the ring's first key
    const int cta_last = min(row0 + T::kRows, total_rows) - 1;
    const bool sees_ring = sees_side_ring(p, key_limit(p, seqlen_all, total_rows, cta_last), seqlen_all);
    const int n_slots = sees_ring ? p.side_sinks + p.side_ring : p.side_sinks;
    const int n_tiles = (n_slots + kTileN - 1) / kTileN;

    const int64_t elem = sizeof(Elem);
    const char *k_base = static_cast<const char *>(p.side_k) + (bc * p.side_batch_stride + hk * p.side_head_stride) * elem;
    const char *v_base = static_cast<const char *>(p.side_v) + (bc * p.side_batch_stride + hk * p.side_head_stride) * elem;
    const int64_t row_bytes = p.side_row_stride * elem;
    auto load = [&](int i) {  // tile i's K and V rows to stage i % 2, by all threads
        if (i < n_tiles) {
            char *st = smem + (i % 2) * 2 * T::kTileBytes;
            #pragma unroll
            for (int k = tid; k < kTileN * T::kChunks; k += T::kNThreads) {
                const int t = k / T::kChunks, l = k % T::kChunks, slot = i * kTileN + t;
                const bool valid = slot < n_slots;
                const int64_t off = (valid ? slot : 0) * row_bytes + 16 * l;
                cp_async<16>(st + 16 * T::chunk(t, l), k_base + off, valid);
                cp_async<16>(st + T::kTileBytes + 16 * T::chunk(t, l), v_base + off, valid);
            }
        }
        cp_async_commit();
    };
    load(0);

    // Q as A fragments: rows g (a0, a2) and g + 8 (a1, a3) of the warp's tile, columns 16 kb + 2c (+ 8)
    uint32_t qa[KB][4];
    int lim[2], ring_from[2];  // each row's keys end at lim; its ring keys start at ring_from (window_start)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = wrow0 + g + 8 * h;
        lim[h] = key_limit(p, seqlen_all, total_rows, r);
        ring_from[h] = window_start(p, lim[h], seqlen_all);
        const uint32_t *q = r < total_rows ? reinterpret_cast<const uint32_t *>(q_row_ptr<Elem>(p, b, hk, r)) : nullptr;
        #pragma unroll
        for (int kb = 0; kb < KB; ++kb) {
            qa[kb][h] = q != nullptr ? q[8 * kb + c] : 0u;
            qa[kb][h + 2] = q != nullptr ? q[8 * kb + 4 + c] : 0u;
        }
    }

    float acc[DJ][4], row_max[2] = {kNegInf, kNegInf}, row_sum[2] = {0.f, 0.f};
    #pragma unroll
    for (int j = 0; j < DJ; ++j) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) { acc[j][e] = 0.f; }
    }
    for (int i = 0; i < n_tiles; ++i) {
        load(i + 1);
        cp_async_wait<1>();
        __syncthreads();
        const char *st = smem + (i % 2) * 2 * T::kTileBytes;
        const uint32_t k_sm = static_cast<uint32_t>(__cvta_generic_to_shared(st));
        const uint32_t v_sm = k_sm + T::kTileBytes;
        // S = Q K^T: ldmatrix x4 gives both n8 tiles (slots 0-7, 8-15) of k-block kb
        float s[2][4] = {};
        #pragma unroll
        for (int kb = 0; kb < KB; ++kb) {
            const int m = lane / 8, t = (m / 2) * 8 + lane % 8;
            uint32_t kf[4];
            ldmatrix_x4<false>(kf, k_sm + 16 * T::chunk(t, 2 * kb + m % 2));
            mma_16816<Elem>(s[0], qa[kb], kf[0], kf[1]);
            mma_16816<Elem>(s[1], qa[kb], kf[2], kf[3]);
        }
        // scores (base 2) at the slots' positions, masked; the rows' new maxima
        float mx[2] = {row_max[0], row_max[1]};
        #pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int pos = side_position(p, i * kTileN + 8 * nt + 2 * c + e, seqlen_all);
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float &v = s[nt][2 * h + e];
                    const bool seen = pos >= 0 && pos < lim[h] && (pos < p.side_sinks || pos >= ring_from[h]);
                    v = seen ? v * entry.scale_log2 : kNegInf;
                    mx[h] = fmaxf(mx[h], v);
                }
            }
        }
        uint32_t pa[4];  // P as the A fragment of the 16-slot k-block
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float use = mx[h] == kNegInf ? 0.f : mx[h];
            const float rescale = exp2f(row_max[h] - use);  // (0 while the row had no key)
            row_max[h] = mx[h];
            row_sum[h] *= rescale;
            #pragma unroll
            for (int j = 0; j < DJ; ++j) {
                acc[j][2 * h] *= rescale;
                acc[j][2 * h + 1] *= rescale;
            }
            float p0[2][2];
            #pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    p0[nt][e] = exp2f(s[nt][2 * h + e] - use);
                    row_sum[h] += p0[nt][e];
                }
            }
            pa[h] = pack2<Elem>(p0[0][0], p0[0][1]);      // slots 2c, 2c + 1
            pa[h + 2] = pack2<Elem>(p0[1][0], p0[1][1]);  // slots 8 + 2c, 8 + 2c + 1
        }
        // O += P V: ldmatrix.trans x4 gives d tiles j and j + 1 (slots 0-7 and 8-15 each)
        #pragma unroll
        for (int j = 0; j < DJ; j += 2) {
            const int m = lane / 8, t = (m % 2) * 8 + lane % 8;
            uint32_t vf[4];
            ldmatrix_x4<true>(vf, v_sm + 16 * T::chunk(t, j + m / 2));
            mma_16816<Elem>(acc[j], pa, vf[0], vf[1]);
            mma_16816<Elem>(acc[j + 1], pa, vf[2], vf[3]);
        }
        __syncthreads();  // stage i % 2 is refilled by the next iteration's load
    }

    // normalize, rotate forward (turbo), and write the split's partial rows
    float x[2][DJ][2];
    float total[2];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        total[h] = row_sum[h] + __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
        total[h] += __shfl_xor_sync(0xffffffffu, total[h], 2);
        const float inv = total[h] != 0.f ? 1.f / total[h] : 0.f;  // (NaN stays NaN)
        #pragma unroll
        for (int j = 0; j < DJ; ++j) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) { x[h][j][e] = acc[j][2 * h + e] * inv; }
        }
    }
    if (p.rot_signs != nullptr) {
        #pragma unroll
        for (int j = 0; j < DJ; ++j) {
            const float2 sg = *reinterpret_cast<const float2 *>(p.rot_signs + 8 * j + 2 * c);
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                x[h][j][0] *= sg.x;
                x[h][j][1] *= sg.y;
            }
        }
        fwht_quad_rows<D, 2>(x, lane);
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            #pragma unroll
            for (int j = 0; j < DJ; ++j) {
                x[h][j][0] *= RowMath<D>::kInvSqrtD;
                x[h][j][1] *= RowMath<D>::kInvSqrtD;
            }
        }
    }
    const int split = p.num_splits - 1;
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = wrow0 + g + 8 * h;
        if (r >= total_rows) continue;
        const int i = r / group, hq = query_head(p, hk, r);
        const int64_t row_id = ((static_cast<int64_t>(split) * p.b + b) * p.h + hq) * p.seqlen_q + i;
        #pragma unroll
        for (int j = 0; j < DJ; ++j) {
            *reinterpret_cast<float2 *>(p.out_accum + row_id * D + 8 * j + 2 * c) = make_float2(x[h][j][0], x[h][j][1]);
        }
        if (c == 0) { p.lse_accum[row_id] = row_lse(row_max[h] == kNegInf ? 0.f : row_max[h], total[h]); }
    }
}

}  // namespace flash_tq
