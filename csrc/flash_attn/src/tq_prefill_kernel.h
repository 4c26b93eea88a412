// Prefill / chunked-prefill attention over a packed K/V cache: many query rows a (batch, kv head).
//
// One CTA = (split, batch * kv_head, 32 query rows a warp: two 16-row MMA tiles share each K/V
// fragment the warp reads); rows as in tq_rows.h (a GQA group's heads share every tile). Q waits in
// shared memory as A fragments (each lane its own: no barrier), read back every tile. The CTA streams the cache in 64-token tiles:
//   1. two warps copy the packed tile (codes + fp16 metadata, ~6.6 KB at 3 bits, d=128) into a
//      3-stage cp.async ring, as two PackedKV stages of 32 tokens;
//   2. all threads expand it once into shared memory as tensor-core B fragments (256 K (token,
//      lane-quad) units and 256 V (token pair, lane-group) units, through the loader's k_slots /
//      v_pair_slots), double-buffered. K is stored as code - mid (exact), its per-token scale and
//      offset + mid * scale applied to the scores in float32 (a 16-bit scale would put one
//      rounding error on a whole score); V as (code - mid) * scale, whose scale rounding then
//      multiplies a zero-mean factor (see the decode kernel on why a common-mode error must be
//      avoided), with offset + mid * scale a float32 term times p;
//   3. each warp runs FA2's loop on its rows: S = Q K^T (Q: A fragments in the loader's slot
//      order), online softmax, O += P V, the V term summed per row.
// One barrier a tile: tile i + 1 is expanded while tile i is multiplied (warps interleave both).
//
// The Hopper variant (PrefillTraits::kWgmma, sm_90a) keeps steps 1-2 and the softmax but expands K
// and V token-major into wgmma's 128-byte-swizzled tiles (tq_wgmma.h), holds Q as such a tile, and
// each warpgroup (4 warps, 128 rows) issues S = Q K^T and O += P V (P from registers) as warpgroup
// MMAs (attend_tile_wgmma). The traits and the per-tile steps are tq_prefill_tile.h.
//
// A cache with a 16-bit side (sinks, recent window): the CTAs read the codes' keys between the sinks
// and the window; the side is a launch of its own written as the last split (tq_side_rows.h,
// run_prefill). With the RoPE center (wgmma only) each tile's rope_table rows are copied beside its
// codes and added into the expanded keys (tq_rope_center.h).
#pragma once

#include "tq_prefill_tile.h"

namespace flash_tq {

template <typename T, bool kLocal>
__device__ __forceinline__ void prefill_split_body(const DecodeParams &p) {
    using Elem = typename T::Elem;
    using KV = typename T::KV;
    constexpr int D = T::kHeadDim, KB = D / 16, DJ = D / 8, MT = T::kMTiles, WR = T::kWarpRows;
    constexpr float kNegInf = -INFINITY;
    extern __shared__ __align__(16) char smem_raw[];
    // wgmma tiles need 1024-byte alignment (the swizzle's period): the base is aligned up (kAlignSlack)
    char *smem = smem_raw;
    if constexpr (T::kWgmma) {
        smem += (1024u - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023u)) & 1023u;
    }

    // (warp through a shuffle: the compiler then knows it, and the branches on it, to be warp-uniform,
    // and the shuffles under those branches need no divergence handling)
    const int tid = threadIdx.x, warp = __shfl_sync(0xffffffffu, tid / 32, 0), lane = tid % 32, g = lane / 4,
              c = lane % 4;
    // the last row blocks first: under causal masking they see the most keys, so the longest CTAs
    // start in the first wave instead of trailing the last one
    const int split = blockIdx.x, b = blockIdx.y / p.h_k, hk = blockIdx.y % p.h_k;
    const int row0 = (gridDim.z - 1 - blockIdx.z) * T::kRows;
    const int total_rows = p.h_h_k_ratio * p.seqlen_q, wrow0 = row0 + WR * warp;
    const CacheRow entry = cache_row(p, b);
    const int bc = entry.row;
    const int seqlen_k = max(0, min(p.seqlens_k[b], p.max_seqlen_k));
    const int key_start = kLocal && p.leftpad_k != nullptr ? max(0, p.leftpad_k[b]) : 0;
    // The codes' keys [side_sinks, seqlen_k - codes_tail) with a 16-bit side (its sinks and ring are
    // the last split, tq_side_rows.h: run_prefill); causal alignment counts every key, and a row's
    // codes end where its recent window starts (window_start). (0 and seqlen_k without one.)
    const int codes_end = max(0, seqlen_k - p.codes_tail);
    auto limit = [&](int r) {
        const int lim = key_limit(p, seqlen_k, total_rows, r);
        return min(codes_end, p.codes_tail > 0 ? min(lim, window_start(p, lim, seqlen_k)) : lim);
    };
    auto lower = [&](int r) { return max(p.side_sinks, key_first<kLocal>(p, seqlen_k, total_rows, r, key_start)); };

    // keys [first, lim) of rows wrow0 + 16m + g (h = 0) and + 8 (h = 1); limits and firsts grow with the row
    int lim[MT][2], first[MT][2];
    #pragma unroll
    for (int m = 0; m < MT; ++m) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            lim[m][h] = limit(wrow0 + 16 * m + g + 8 * h);
            first[m][h] = lower(wrow0 + 16 * m + g + 8 * h);
        }
    }
    const int cta_limit = limit(min(row0 + T::kRows, total_rows) - 1);
    const int warp_last = min(wrow0 + WR, total_rows) - 1;
    const int warp_limit = wrow0 < total_rows ? limit(warp_last) : 0;
    const int warp_first = wrow0 < total_rows ? lower(wrow0) : 0;
    // tiles within [the last row's first key, the first row's limit) need no mask
    const int warp_unmasked = wrow0 < total_rows ? limit(wrow0) : 0;
    const int warp_first_max = wrow0 < total_rows ? lower(warp_last) : 0;
    const int tile_first = lower(row0) / T::kTileN;
    const int n_tiles = (cta_limit + T::kTileN - 1) / T::kTileN;
    const int code_splits = p.num_splits - (p.side_k != nullptr ? 1 : 0);
    const int tiles_per_split = (max(0, n_tiles - tile_first) + code_splits - 1) / code_splits;
    const int tile_begin = tile_first + split * tiles_per_split;
    const int n_mine = max(0, min(n_tiles, tile_begin + tiles_per_split) - tile_begin);

    // ---- Q: A fragments of rows wrow0 + 16m + g (a0, a2) and + 8 (a1, a3) in the loader's slot
    // order, to the lane's own 16-byte slots of shared memory (read back by the same lane only)
    const bool rotate = p.rot_signs != nullptr;
    // (wgmma: the warpgroup's Q rows)
    char *qfrag = T::kWgmma ? smem + (warp / 4) * (4 * WR) * 128 : smem + 16 * (warp * MT * KB * 32 + lane);
    char *work = smem + T::kQFragBytes;  // the rotation's rows, then the pipeline
    constexpr int RS = T::kRowStride;
    float *sm_q = reinterpret_cast<float *>(work);  // [kRows / kQPasses][RS]
    float sumq[MT][2], unused_magic;
    auto build_frags = [&](int first_row) {  // rows of this warp; rotated rows from sm_q, which starts at first_row
        #pragma unroll
        for (int m = 0; m < MT; ++m) {
            uint32_t f[2][KB][2];
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int n = WR * warp + 16 * m + g + 8 * h, r = row0 + n;
                const bool valid = r < total_rows;
                const Elem *qrow = q_row_ptr<Elem>(p, b, hk, valid ? r : 0);
                auto q_at = [&](int e) {
                    if (rotate) return sm_q[(n - first_row) * RS + e] * RowMath<D>::kInvSqrtD;
                    return valid ? to_float(qrow[e]) : 0.f;
                };
                q_row_slots<KV, Elem, KB, false>(q_at, c, f[h], sumq[m][h], unused_magic);
            }
            if constexpr (T::kWgmma) {  // rows to the Q tile: thread c's slots are 16-byte chunks c * KB / 2..
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    #pragma unroll
                    for (int q = 0; q < KB / 2; ++q) {
                        *reinterpret_cast<uint4 *>(
                            smem + tile_chunk<T::kRows>(T::q_tile_row(warp, m, g + 8 * h), c * (KB / 2) + q)) =
                            make_uint4(f[h][2 * q][0], f[h][2 * q][1], f[h][2 * q + 1][0], f[h][2 * q + 1][1]);
                    }
                }
            } else {
                #pragma unroll
                for (int kb = 0; kb < KB; ++kb) {
                    *reinterpret_cast<uint4 *>(qfrag + 512 * (m * KB + kb)) =
                        make_uint4(f[0][kb][0], f[1][kb][0], f[0][kb][1], f[1][kb][1]);
                }
            }
        }
    };
    const typename KV::Bases bases = KV::bases(p, bc, hk);
    char *packed = work + T::kPackedOff;
    char *frags = work + T::kFragsOff;
    // kRope: tile i's rope_table rows, by every thread, to table stage i % 2 (tile i + 1 is expanded
    // from the other while they arrive); |c| for the expansion
    const char *tab_rows = nullptr;
    char *tabs = work + T::kTabOff;
    float center_norm = 0.f;
    if constexpr (T::kRope) {
        tab_rows = static_cast<const char *>(p.rope_table) +
                   static_cast<int64_t>(blockIdx.y) * p.rope_table_len * (D * 2);  // (blockIdx.y = b h_k + hk)
        const float *center = p.rope_center + b * p.rope_center_batch_stride + hk * D;
        #pragma unroll
        for (int e = lane; e < D; e += 32) { center_norm = fmaf(__ldg(center + e), __ldg(center + e), center_norm); }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) { center_norm += __shfl_xor_sync(0xffffffffu, center_norm, o); }
        center_norm = sqrtf(center_norm);
    }
    // a thread copies chunk tid % kRowChunks of rows tab_t + kTabPassRows j: its source and destination
    // offsets are set once (the swizzle's period, 8 rows, divides kTabPassRows), an add and a compare a copy
    constexpr int kRowChunks = D * 2 / 16, kTabPassRows = T::kNThreads / kRowChunks;
    static_assert(kTabPassRows % 8 == 0 && T::kTileN % kTabPassRows == 0, "whole swizzle periods a pass");
    const int tab_t = tid / kRowChunks;
    const char *tab_src = T::kRope ? tab_rows + tab_t * (D * 2) + 16 * (tid % kRowChunks) : nullptr;
    const int tab_dst = 16 * T::tab_chunk(tab_t, tid % kRowChunks);
    auto load_tab = [&](int i) {
        if (T::kRope && i < n_mine) {
            const int t0 = (tile_begin + i) * T::kTileN;
            char *dst = tabs + (i % 2) * T::kTabStageBytes + tab_dst;
            const char *src = tab_src + static_cast<int64_t>(t0) * (D * 2);
            #pragma unroll
            for (int j = 0; j < T::kTileN / kTabPassRows; ++j) {
                const bool valid = t0 + tab_t + j * kTabPassRows < p.rope_table_len;
                cp_async<16>(dst + j * kTabPassRows * kRowChunks * 16, valid ? src + j * kTabPassRows * (D * 2) : tab_rows,
                             valid);
            }
        }
    };
    auto load = [&](int i) {  // packed tile i of this split, by warps 0 and 1 (32 tokens each)
        if (warp < 2 && i < n_mine) {
            KV::load_tile(p, bases, packed + (i % T::kPackedStages) * T::kPackedBytes + warp * KV::kStageBytes, bc,
                          (tile_begin + i) * T::kTileN + warp * KV::kTileN, seqlen_k, lane);
        }
        if (i < 2) { load_tab(i); }  // (later tiles' rows: after the barrier that frees their stage)
        cp_async_commit();
    };
    // wgmma: the first two tiles arrive while q is rotated (their ring lies past the rotation's rows)
    if constexpr (T::kWgmma) {
        load(0);
        load(1);
    }
    if (rotate) {  // all rows (wgmma) or half at a time: warps 0-3's rows, then 4-7's
        constexpr int kPassRows = T::kRows / T::kQPasses;
        #pragma unroll 1
        for (int pass = 0; pass < T::kQPasses; ++pass) {
            rotate_q_quads<Elem, D, kPassRows, T::kNWarps, 2, RS>(p, b, hk, row0 + pass * kPassRows, total_rows, sm_q,
                                                                  warp, lane);
            __syncthreads();
            if (warp / (T::kNWarps / T::kQPasses) == pass) { build_frags(pass * kPassRows); }
            // sm_q: the next pass's rows, then the pipeline's memory (wgmma: the pipeline's first barrier)
            if (!T::kWgmma || pass + 1 < T::kQPasses) { __syncthreads(); }
        }
    } else {
        build_frags(0);
    }
    if constexpr (T::kWgmma) { fence_proxy_async(); }  // the Q tile is published by the pipeline's first barrier

    float acc[MT][DJ][4], row_max[MT][2], row_sum[MT][2], row_corr[MT][2];
    #pragma unroll
    for (int m = 0; m < MT; ++m) {
        #pragma unroll
        for (int j = 0; j < DJ; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) { acc[m][j][e] = 0.f; }
        }
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            row_max[m][h] = kNegInf;
            row_sum[m][h] = 0.f;
            row_corr[m][h] = 0.f;
        }
    }

    // wgmma: the P V of each tile's last half runs during the next tile (attend_tile_wgmma); before the
    // first, a zero P over the Q tile (finite values)
    uint32_t pa[MT][T::kTileN / 32][4] = {};
    uint64_t pv_desc = smem_desc(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), T::kTileN * 128, 1024);

    if constexpr (!T::kWgmma) {
        load(0);
        load(1);
    }
    cp_async_wait<1>();
    __syncthreads();
    if (n_mine > 0) { expand_tile<T>(packed, frags, entry.scale_log2, tid, tabs, center_norm); }
    // Warps 0-3 expand before their tile's MMAs, warps 4-7 after: each scheduler (warp % 4) holds
    // one of each, so one runs integer work while the other keeps its tensor core busy.
    const bool expand_first = warp < T::kNWarps / 2;
    for (int it = 0; it < n_mine; ++it) {
        load(it + 2);
        cp_async_wait<1>();
        __syncthreads();  // tile it + 1 landed, tile it expanded, tile it - 1's fragments free
        if constexpr (T::kRope) {  // (tile it's table stage is free: it was expanded before the barrier)
            load_tab(it + 2);
            cp_async_commit();
        }
        auto expand_next = [&]() {
            if (it + 1 < n_mine) {
                expand_tile<T>(packed + ((it + 1) % T::kPackedStages) * T::kPackedBytes,
                               frags + ((it + 1) % T::kFragBuffers) * T::kFragBytes, entry.scale_log2, tid,
                               tabs + ((it + 1) % 2) * T::kTabStageBytes, center_norm);
            }
        };
        if (expand_first) { expand_next(); }
        const int tile_start = (tile_begin + it) * T::kTileN;
        // warp-uniform: a row sees the tile. wgmma: every tile of the CTA's range (at most one more
        // than a warpgroup's rows see); a warp-dependent branch around wgmma serializes its MMAs.
        if (T::kWgmma || (tile_start < warp_limit && tile_start + T::kTileN > warp_first)) {
            const bool masked = tile_start + T::kTileN > warp_unmasked || tile_start < warp_first_max;
            const char *frag = frags + (it % T::kFragBuffers) * T::kFragBytes;
            if constexpr (T::kWgmma) {
                attend_tile_wgmma<T, kLocal>(frag, qfrag, tile_start, masked, lim, first, p.softcap_log2, sumq, row_max,
                                             row_sum, row_corr, acc, pa, pv_desc, lane);
            } else {
                attend_tile<T, kLocal>(frag, qfrag, tile_start, masked, lim, first, p.softcap_log2, sumq, row_max,
                                       row_sum, row_corr, acc, lane);
            }
        }
        if (!expand_first) { expand_next(); }
    }
    if constexpr (T::kWgmma) { wgmma_flush_pv<T>(acc, pa, pv_desc); }
    cp_async_wait<0>();

    // ---- rows to shared memory (a warp's WR rows), then a warp a row: normalize, store
    #pragma unroll
    for (int m = 0; m < MT; ++m) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            #pragma unroll
            for (int o = 1; o <= 2; o *= 2) {
                row_sum[m][h] += __shfl_xor_sync(0xffffffffu, row_sum[m][h], o);
                if constexpr (T::kTerms) { row_corr[m][h] += __shfl_xor_sync(0xffffffffu, row_corr[m][h], o); }
            }
        }
    }
    __syncthreads();  // every warp is done with the fragment buffers
    // ---- output, 8 rows a warp at a time: lane quad g holds row 16m + 8h + g of the warp (pass m, h),
    // columns 8j + 2c + e as the mma.sync accumulators do (wgmma: its pair-slot columns are put back
    // in order through shared memory first), rotated back in registers (fwht_quad_rows), normalized
    // and stored through shared memory as 16-byte chunks; several splits: the raw rows and their lse
    // to the accumulators (the combine kernel rotates). A warp a row with 5 shuffle stages took ~11 us
    // of an 8K x 1024 call (H200).
    float *sm_o = reinterpret_cast<float *>(smem) + warp * WR * RS;  // [WR][RS]
    if constexpr (T::kWgmma) {
        // accumulator column 8j + 2c + e % 2: V's pair slot 4j + c, whose element e % 2 it holds:
        // vcol[j % kJP][e % 2] + (j / kJP) * shift (PairPeriod)
        constexpr int kJP = KV::VPeriod::kPeriod / 4;
        int vcol[kJP][2];
        #pragma unroll
        for (int jj = 0; jj < kJP; ++jj) {
            #pragma unroll
            for (int hi = 0; hi < 2; ++hi) { vcol[jj][hi] = KV::v_slot_element(4 * jj + c, hi); }
        }
        #pragma unroll
        for (int m = 0; m < MT; ++m) {
            #pragma unroll
            for (int j = 0; j < DJ; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = vcol[j % kJP][e % 2] + (j / kJP) * KV::VPeriod::kShift;
                    sm_o[(16 * m + g + 8 * (e / 2)) * RS + col] =
                        T::kTerms ? acc[m][j][e] + row_corr[m][e / 2] : acc[m][j][e];
                }
            }
        }
        __syncwarp();
    }
    // the output rows are final: one split, or the side's split merged here (side_first)
    const bool unrotate = rotate && (p.num_splits == 1 || p.side_first);
    float sign[DJ][2];  // of the lane's columns, times 1 / sqrt(d)
    #pragma unroll
    for (int j = 0; j < DJ; ++j) {
        const float2 s =
            unrotate ? *reinterpret_cast<const float2 *>(p.rot_signs + 8 * j + 2 * c) : make_float2(1.f, 1.f);
        sign[j][0] = s.x * RowMath<D>::kInvSqrtD;
        sign[j][1] = s.y * RowMath<D>::kInvSqrtD;
    }
    if (p.side_first) { pdl_wait(); }  // the side's partial rows (run_prefill launches this kernel as its dependent)
    const int group = p.h_h_k_ratio;
    #pragma unroll
    for (int m = 0; m < MT; ++m) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int n0 = 16 * m + 8 * h, n = n0 + g, r = wrow0 + n;
            if (wrow0 + n0 >= total_rows) continue;  // warp-uniform
            float x[1][DJ][2];
            #pragma unroll
            for (int j = 0; j < DJ; ++j) {
                if constexpr (T::kWgmma) {
                    const float2 v = *reinterpret_cast<const float2 *>(sm_o + n * RS + 8 * j + 2 * c);
                    x[0][j][0] = v.x;
                    x[0][j][1] = v.y;
                } else {
                    #pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        x[0][j][e] = T::kTerms ? acc[m][j][2 * h + e] + row_corr[m][h] : acc[m][j][2 * h + e];
                    }
                }
            }
            float total = row_sum[m][h], inv = total != 0.f ? 1.f / total : 0.f;  // (NaN stays NaN)
            float lse = row_lse(row_max[m][h] == kNegInf ? 0.f : row_max[m][h], total);
            const int i = r / group, hq = query_head(p, hk, r);
            if (p.side_first && r < total_rows) {  // o = (w o + w_side o_side) / (w + w_side), in the codes' domain
                const int64_t side_row = ((static_cast<int64_t>(p.num_splits - 1) * p.b + b) * p.h + hq) * p.seqlen_q + i;
                const float lse_side = p.lse_accum[side_row], mx = fmaxf(lse, lse_side);
                const float w = mx == kNegInf ? 0.f : __expf(lse - mx), w_side = mx == kNegInf ? 0.f : __expf(lse_side - mx);
                const float sum = w + w_side, f_side = sum != 0.f ? w_side / sum : 0.f;
                inv *= sum != 0.f ? w / sum : 0.f;
                #pragma unroll
                for (int j = 0; j < DJ; ++j) {
                    const float2 o = *reinterpret_cast<const float2 *>(p.out_accum + side_row * D + 8 * j + 2 * c);
                    x[0][j][0] = fmaf(x[0][j][0], inv, f_side * o.x);
                    x[0][j][1] = fmaf(x[0][j][1], inv, f_side * o.y);
                }
                inv = 1.f;
                total = sum;  // (> 0 when either part has keys: the lse below)
                lse = sum != 0.f ? mx + __logf(sum) : kNegInf;
            }
            if (unrotate) { fwht_quad_rows<D, 1>(x, lane); }
            #pragma unroll
            for (int j = 0; j < DJ; ++j) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) { x[0][j][e] *= unrotate ? sign[j][e] * inv : inv; }
            }
            if (p.num_splits == 1 || p.side_first) {
                __syncwarp();  // the quad's reads of its row are done: stage it there as Elem
                uint32_t *staged = reinterpret_cast<uint32_t *>(sm_o + n * RS);
                #pragma unroll
                for (int j = 0; j < DJ; ++j) { staged[4 * j + c] = pack2<Elem>(x[0][j][0], x[0][j][1]); }
                __syncwarp();
                #pragma unroll
                for (int k = lane; k < 8 * DJ; k += 32) {  // 16-byte chunk k % DJ of the pass's row k / DJ
                    const int u = k / DJ, ru = wrow0 + n0 + u;
                    if (ru < total_rows) {
                        *reinterpret_cast<uint4 *>(out_row_ptr<Elem>(p, b, hk, ru) + 8 * (k % DJ)) =
                            *reinterpret_cast<const uint4 *>(reinterpret_cast<const char *>(sm_o + (n0 + u) * RS) +
                                                             16 * (k % DJ));
                    }
                }
                if (c == 0 && r < total_rows) {
                    p.softmax_lse[(static_cast<int64_t>(b) * p.h + hq) * p.seqlen_q + i] =
                        total != 0.f ? lse : INFINITY;
                }
            } else if (r < total_rows) {
                const int64_t row_id = ((static_cast<int64_t>(split) * p.b + b) * p.h + hq) * p.seqlen_q + i;
                #pragma unroll
                for (int j = 0; j < DJ; ++j) {
                    *reinterpret_cast<float2 *>(p.out_accum + row_id * D + 8 * j + 2 * c) =
                        make_float2(x[0][j][0], x[0][j][1]);
                }
                if (c == 0) { p.lse_accum[row_id] = lse; }
            }
        }
    }
}

template <typename T, bool kLocal>
__global__ void __launch_bounds__(T::kNThreads, 256 / T::kNThreads) prefill_split_kernel(const DecodeParams p) {
#ifndef TQ_WGMMA_ENABLED
    if constexpr (T::kWgmma) {  // wgmma code exists in sm_90a builds only; the host launches it there only
        __trap();
    } else
#endif
    {
        pdl_launch_dependents();  // (a combine launched as its dependent: tq_decode_launch.h)
        prefill_split_body<T, kLocal>(p);
    }
}

}  // namespace flash_tq
