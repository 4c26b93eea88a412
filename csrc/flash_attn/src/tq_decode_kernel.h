// Split-KV decode attention over a K/V cache read through a loader policy (tq_kv_loader.h):
// PackedKV (3/4-bit codes) or Fp16KV (float16/bfloat16 cache, our FP16 baseline) share this body.
//
// One CTA = (split, batch * kv_head, chunk of query rows). The query rows of a CTA are the GQA
// group's heads times the new query positions (row r = i * group + head_in_group), so each K/V
// tile is read and expanded once per group. Transposed tensor-core formulation (the tensor cores
// would otherwise be 75% padding): S^T[16 tokens x 8 rows] = K (A operand, expanded by the loader
// straight into fragments) * Q^T (B operand, in registers for the whole kernel), then
// O^T[16 d x 8 rows] += V^T (A operand) * P^T (B operand, S^T transposed in registers with
// movmatrix). Codes are never scaled element by element: K's per-token (scale, offset) and V's
// fold into the scores and the probabilities (see tq_kv_loader.h). Each of the 4 warps streams its
// own tiles through its own cp.async pipeline with an online softmax; warps, then splits (combine
// kernel), are merged through their log-sum-exp. kRope: each score also gets q . R(p) c back
// (key_center='rope', tq_rope_center.h), a table and the rows' coefficients after the pipeline.
//
// A packed cache with a 16-bit side (sink tokens and the recent-token ring, DecodeParams::side_k)
// is attended by one launch: the last split's CTAs run the same body over the side with the Fp16KV
// loader (Part::kSide: slots mapped to their keys' positions for the masks, q not rotated, the
// output rotated into the codes' domain so the combine kernel merges it like any split), the
// others over the codes' keys between the sinks and the ring (Part::kCodes). A ring of window codes
// (QuantizedKVCache's window_bits: the recent tokens as 4-bit codes, the side holding the sinks alone)
// is one more split of that launch (Part::kRing): the same body over the ring's codes with the
// PackedKV loader, its slots mapped to their keys' positions as the side's are, q rotated as for the
// codes (the ring shares their rotation), the RoPE term at each slot's position (a tile a lap).
#pragma once

#include <algorithm>
#include <cmath>

#include "tq_kv_loader.h"
#include "tq_params.h"
#include "tq_rope_center.h"
#include "tq_rows.h"
#include "tq_utils.h"

namespace flash_tq {

template <typename Elem_, int kHeadDim_, int kNT_, typename KV_>
struct DecodeTraits {
    using Elem = Elem_;
    using KV = KV_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kNT = kNT_;  // n8 tiles of query rows per CTA
    static constexpr int kRows = 8 * kNT;
    static constexpr int kNWarps = 4;  // each streams its own tiles (8: no faster, measured)
    static constexpr int kNThreads = 32 * kNWarps;
    static constexpr int kStages = KV::kStages;
    static constexpr int kTileN = KV::kTileN;
    static constexpr int kMTiles = kTileN / 16;  // 16-token MMA blocks a tile
    static constexpr int kKBlocks = kHeadDim / 16;
    static constexpr int kPipeBytes = kNWarps * kStages * KV::kStageBytes;
    // turbo's rotated query rows (packed caches), past the pipeline and the RoPE tables: no barrier
    // between their last read and the first tiles' copies
    static constexpr int kQBytes = KV::kAffine ? kRows * kHeadDim * 4 : 0;
    // merge: per-warp max/sum and O slices
    static constexpr int kMergeBytes = kNWarps * kRows * (kHeadDim + 2) * 4;
    static constexpr int kSmemBytes = std::max(kPipeBytes + kQBytes, kMergeBytes);
    using Rope = RopeCenter<kHeadDim, kTileN, kNT, kNWarps * kTileN>;  // (a warp's tiles are kNWarps apart)
    static constexpr int kRopeSmemBytes = std::max(kPipeBytes + Rope::kBytes + kQBytes, kMergeBytes);
};

// The side pass of a packed cache's launch: the same rows over 16-bit tiles, one pipeline stage a
// warp (its few tiles must not enlarge the CTA's shared memory).
template <typename Traits>
using SideTraits = DecodeTraits<typename Traits::Elem, Traits::kHeadDim, Traits::kNT,
                                Fp16KV<Traits::kHeadDim, typename Traits::Elem, 1>>;

// The ring of window codes: kBits keys and values, the codes' metadata, one stage a warp (its few
// tiles must not enlarge the CTA's shared memory).
template <typename Traits, int kBits>
using RingTraits =
    DecodeTraits<typename Traits::Elem, Traits::kHeadDim, Traits::kNT,
                 PackedKV<kBits, kBits, Traits::kHeadDim, typename Traits::Elem, Traits::KV::kMetaBytes == 2, 1>>;

// What a split body attends: every key of the codes (no side), the codes' part of a launch with a
// 16-bit side, that side, or a ring of window codes.
enum class Part { kAll, kCodes, kSide, kRing };

// The ring of window codes in laps: its slots [newest + 1, R) hold the older lap's keys (positions
// base - R + slot), [0, newest] the newer lap's (base + slot), newest the slot of the sequence's
// last key (n - 1 = base + newest). Its tiles cover one lap each (the older lap's first), so a
// tile's keys have contiguous positions: the RoPE term is one tile_bias at the tile's first.
struct RingLaps {
    int newest, base, older_tiles;
    __device__ RingLaps(int n, int ring, int tile_n) {
        const int last = max(n, 1) - 1;
        newest = last % ring;
        base = last - newest;
        older_tiles = base > 0 ? (ring - 1 - newest + tile_n - 1) / tile_n : 0;  // (none before the first lap)
    }
    // tile i: its first slot, the end of its lap's slots, the position of slot 0 of its lap
    __device__ void tile(int i, int ring, int tile_n, int &first, int &end, int &lap_base) const {
        const bool older = i < older_tiles;
        first = older ? newest + 1 + i * tile_n : (i - older_tiles) * tile_n;
        end = older ? ring : newest + 1;
        lap_base = older ? base - ring : base;
    }
};

// split: the CTA's split index (where its partial result goes); bh: batch entry * h_k + kv head.
template <typename Traits, Paging kPaging, bool kLocal, bool kRope, Part kPart>
__device__ __forceinline__ void split_body(const DecodeParams &p, char *smem, int split, int bh) {
    using Elem = typename Traits::Elem;
    using KV = typename Traits::KV;
    constexpr int D = Traits::kHeadDim, NT = Traits::kNT, kRows = Traits::kRows, KB = Traits::kKBlocks;
    constexpr int kStages = Traits::kStages, kTileN = Traits::kTileN, kWarps = Traits::kNWarps, MT = Traits::kMTiles;
    constexpr float kNegInf = -INFINITY;
    constexpr bool kSide = kPart == Part::kSide, kRing = kPart == Part::kRing;
    constexpr bool kSlots = kSide || kRing;  // tiles over slots that map to their keys' positions
    constexpr bool kLower = kLocal || kPart == Part::kCodes;  // a lower key bound: the local window, leftpad, the sinks

    // warp through a shuffle: known warp-uniform, so the shuffles under branches on it need no divergence handling
    const int warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0), lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int b = bh / p.h_k, hk = bh % p.h_k, row0 = blockIdx.z * kRows;
    const int group = p.h_h_k_ratio, total_rows = group * p.seqlen_q;
    const CacheRow entry = cache_row(p, b);
    const int bc = entry.row;
    const int seqlen_all = max(0, min(p.seqlens_k[b], p.max_seqlen_k));  // never read past the cache
    // keys the tiles cover: the side's slots, the ring's (side_ring of the ring's params), or the codes'
    // keys before the tail
    const int seqlen_k = kSide ? p.side_sinks + p.side_ring : kRing ? p.side_ring : max(0, seqlen_all - p.codes_tail);
    int key_start = kLocal && p.leftpad_k != nullptr ? max(0, p.leftpad_k[b]) : 0;
    if constexpr (kPart == Part::kCodes) { key_start = max(key_start, p.side_sinks); }

    // Keys [first, lim) visible to each accumulator column (row) this thread holds, and to the CTA's
    // rows: tiles from the first row's first key to the last row's limit. Causal limits count every
    // key of the sequence; the side pass compares its slots' positions with them.
    // A recent window splits each row's keys at its window_start: the codes below, the ring from it.
    int lim[NT][2], first[NT][2];
    [[maybe_unused]] int ring_from[NT][2];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int r = row0 + nt * 8 + 2 * c + j;
            const int all = key_limit(p, seqlen_all, total_rows, r);
            if constexpr (kSlots) {
                lim[nt][j] = all;
                ring_from[nt][j] = window_start(p, all, seqlen_all);
            } else if constexpr (kPart == Part::kCodes) {
                lim[nt][j] = min(seqlen_k, min(all, window_start(p, all, seqlen_all)));
            } else {
                lim[nt][j] = min(seqlen_k, all);
            }
            first[nt][j] = key_first<kLower>(p, seqlen_all, total_rows, r, key_start);
        }
    }
    const int cta_last_row = min(row0 + kRows, total_rows) - 1;
    const int cta_key_limit = key_limit(p, seqlen_all, total_rows, cta_last_row);
    // the side: CTAs whose rows see none of the ring's keys attend the sinks' tiles only (the ring of
    // codes: none of its tiles)
    const bool sees_ring = sees_side_ring(p, cta_key_limit, seqlen_all);
    const int cta_limit = kSide   ? (sees_ring ? seqlen_k : p.side_sinks)
                          : kRing ? (sees_ring ? seqlen_k : 0)
                                  : min(seqlen_k, cta_key_limit);
    const int cta_first_max =
        key_first<kLower>(p, seqlen_all, total_rows, cta_last_row, key_start);  // tiles before it need the lower mask
    const int tile_first = kSlots ? 0 : key_first<kLower>(p, seqlen_all, total_rows, row0, key_start) / kTileN;
    [[maybe_unused]] const RingLaps laps(seqlen_all, kRing ? p.side_ring : 1, kTileN);
    const int n_tiles = !kRing      ? (cta_limit + kTileN - 1) / kTileN
                        : cta_limit ? laps.older_tiles + (laps.newest + kTileN) / kTileN
                                    : 0;
    // the side pass and the ring are a split each (the launch's last, and the one before it); the codes'
    // parts share the others
    const int splits = kPart == Part::kAll ? p.num_splits : (kSlots ? 1 : p.num_splits - 1 - (p.has_ring ? 1 : 0));
    const int tiles_per_split = (max(0, n_tiles - tile_first) + splits - 1) / splits;
    const int tile_begin = tile_first + (kSlots ? 0 : split) * tiles_per_split;
    const int tile_end = min(n_tiles, tile_begin + tiles_per_split);

    const typename KV::Consts kv_consts = KV::consts();
    typename KV::Bases bases;
    if constexpr (kSide) {
        bases = KV::side_bases(p, bc, hk);
    } else {
        bases = KV::bases(p, bc, hk);
    }
    // (a lap's tiles start at any slot: the whole-tile copies' 16-byte alignment would not hold)
    if constexpr (kRing) { bases.dense = false; }
    float row_max[NT][2], row_sum[NT][2], row_corr[NT][2];
    float acc[NT][KB][4];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            row_max[nt][j] = kNegInf;
            row_sum[nt][j] = 0.f;
            row_corr[nt][j] = 0.f;
        }
        #pragma unroll
        for (int m = 0; m < KB; ++m) {
            #pragma unroll
            for (int j = 0; j < 4; ++j) { acc[nt][m][j] = 0.f; }
        }
    }

    char *pipe = smem + warp * kStages * KV::kStageBytes;
    const int my_first = tile_begin + warp;
    const int my_count = my_first < tile_end ? (tile_end - my_first + kWarps - 1) / kWarps : 0;
    // the warp's tile i (i = 0, 1, 2, ...) into stage `st`
    TilePages<kTileN, KV::kSegment, kPaging == Paging::kRows16> pages;
    if constexpr (rows_given(kPaging)) { pages.start(p, bc, my_first, kWarps, my_count, seqlen_k, lane); }
    auto load = [&](int i, int st) {
        int rows[2] = {0, 0};
        if constexpr (rows_given(kPaging)) { pages.rows_of(i, rows, lane); }
        int first = (my_first + i * kWarps) * kTileN, end = seqlen_k;
        if constexpr (kRing) {
            int lap_base;
            laps.tile(my_first + i * kWarps, p.side_ring, kTileN, first, end, lap_base);
        }
        KV::template load_tile<kPaging>(p, bases, pipe + st * KV::kStageBytes, bc, first, end, lane, rows);
    };

    // turbo: q is rotated here (signs, then a Walsh-Hadamard transform, a warp a row, into shared
    // memory of its own), and the output is rotated back at the end. The side holds keys and values
    // as they are: its q is not rotated and its output is rotated forward.
    const bool rotate = !kSide && Traits::kQBytes > 0 && p.rot_signs != nullptr;
    constexpr int kV = RowMath<D>::kV;
    using Rope = typename Traits::Rope;
    char *sm_rope = smem + Traits::kPipeBytes;
    float *sm_q = reinterpret_cast<float *>(sm_rope + (kRope ? Rope::kBytes : 0));  // [kRows][D]
    // the first tiles' copies go out before the query's gather and rotation and the RoPE setup (their
    // own shared memory), so that their DRAM latency overlaps that work (short caches wait on it)
    #pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < my_count) { load(s, s); }
        cp_async_commit();
    }
    if (rotate) { rotate_q_rows<Elem, D, kRows, kWarps>(p, b, hk, row0, total_rows, sm_q, warp, lane); }
    if constexpr (kRope) {
        Rope::template setup<Elem, kRows>(p, b, hk, row0, total_rows, sm_rope, threadIdx.x, Traits::kNThreads);
    }
    if (rotate || kRope) { __syncthreads(); }  // (one barrier for both)

    // Q as B fragments (rows g of each n8 tile), gathered in the loader's slot order and scaled by
    // 8^-q_scale_exp (powers of two: exact), plus per row the sum of its (rounded) elements (for K's
    // offsets) and magic * the sum of the scaled elements (for the magic number in the raw K values).
    uint32_t qf[NT][KB][2];
    float sumq[NT][2], magicq[NT][2];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int r = row0 + nt * 8 + g;
        const bool valid = r < total_rows;
        const Elem *qrow = q_row_ptr<Elem>(p, b, hk, valid ? r : 0);
        float s, ms;
        if (rotate) {  // (uniform: the two gathers compiled apart, no branch an element)
            const float *qs = sm_q + (nt * 8 + g) * D;
            q_row_slots<KV, Elem, KB>([&](int e) { return qs[e] * RowMath<D>::kInvSqrtD; }, c, qf[nt], s, ms);
        } else {
            q_row_slots<KV, Elem, KB>([&](int e) { return valid ? to_float(qrow[e]) : 0.f; }, c, qf[nt], s, ms);
        }
        #pragma unroll
        for (int j = 0; j < 2; ++j) {  // to the accumulator layout: row 2c + j is a column
            sumq[nt][j] = __shfl_sync(0xffffffffu, s, (2 * c + j) * 4);
            magicq[nt][j] = __shfl_sync(0xffffffffu, ms, (2 * c + j) * 4);
        }
    }

    int load_stage = kStages - 1, compute_stage = 0;
    typename Rope::State rope_state;
    float rope_next[kRope ? MT : 1][4];  // paired: the next tile's term
    [[maybe_unused]] const bool rope_pair = Rope::paired(row0, total_rows);
    for (int it = 0; it < my_count; ++it) {
        const int ahead = it + kStages - 1;
        if (ahead < my_count) { load(ahead, load_stage); }
        load_stage = load_stage == kStages - 1 ? 0 : load_stage + 1;
        cp_async_commit();
        int tile_start = (my_first + it * kWarps) * kTileN;
        [[maybe_unused]] int lap_end = 0, lap_base = 0;  // the ring's tile: its lap's slot end and position base
        if constexpr (kRing) { laps.tile(my_first + it * kWarps, p.side_ring, kTileN, tile_start, lap_end, lap_base); }
        // the RoPE-center term needs no tile data: computed while the tile may still be in flight
        float rope_bias[kRope ? MT : 1][NT][4];
        if constexpr (kRope && kRing) {  // one lap's slots: contiguous positions from lap_base + tile_start
            Rope::tile_bias(p, sm_rope, lap_base + tile_start, lane, rope_bias);
        } else if constexpr (kRope && Rope::kRecur) {  // coefficients carried from the warp's previous tile
            Rope::recur_bias(p, sm_rope, it, tile_start, rope_pair, lane, rope_state, rope_next, rope_bias);
        } else if constexpr (kRope) {
            Rope::tile_bias(p, sm_rope, tile_start, lane, rope_bias);
        }
        cp_async_wait<kStages - 1>();
        __syncwarp();
        const char *stage = pipe + compute_stage * KV::kStageBytes;
        compute_stage = compute_stage == kStages - 1 ? 0 : compute_stage + 1;

        // ---- scores S^T for the tile's 16-token m-tiles
        float sc[MT][NT][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int t0 = mt * 16 + g, t1 = t0 + 8;
            uint32_t ka[KB][4];
            KV::k_frags(stage, mt, lane, ka);
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                float part[2][4] = {};  // even / odd k-blocks: two independent MMA chains (latency)
                #pragma unroll
                for (int kb = 0; kb < KB; ++kb) { mma_16816<Elem>(part[kb % 2], ka[kb], qf[nt][kb][0], qf[nt][kb][1]); }
                #pragma unroll
                for (int j = 0; j < 4; ++j) { sc[mt][nt][j] = part[0][j] + part[1][j]; }
            }
            float2 f0 = make_float2(1.f, 0.f), f1 = f0;
            if constexpr (KV::kAffine) {
                f0 = KV::k_affine(stage, t0);
                f1 = KV::k_affine(stage, t1);
            }
            // the side's and the ring's slots at their keys' positions (-1: no key; fails every limit
            // below); ring slot s is slot side_sinks + s of a side with the ring's side_ring, and a
            // ring tile's slots past its lap are the other lap's tiles'
            const int slot0 = (kRing ? p.side_sinks : 0) + tile_start + t0, slot1 = slot0 + 8;
            const int pos0 =
                !kSlots || (kRing && tile_start + t0 >= lap_end) ? -1 : side_position(p, slot0, seqlen_all);
            const int pos1 =
                !kSlots || (kRing && tile_start + t1 >= lap_end) ? -1 : side_position(p, slot1, seqlen_all);
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float2 f = j < 2 ? f0 : f1;
                    const int key = kSlots ? (j < 2 ? pos0 : pos1) : tile_start + (j < 2 ? t0 : t1);
                    float v = sc[mt][nt][j] * entry.scale_log2;
                    if constexpr (KV::kAffine) {
                        v = f.x * (sc[mt][nt][j] - magicq[nt][j & 1]) + f.y * sumq[nt][j & 1];
                        if constexpr (kRope) { v += rope_bias[mt][nt][j]; }
                        v *= entry.scale_log2;
                    }
                    bool seen = key < lim[nt][j & 1];
                    if constexpr (kSlots) { seen = seen && key >= 0 && (key < p.side_sinks || key >= ring_from[nt][j & 1]); }
                    sc[mt][nt][j] = seen ? v : kNegInf;
                }
            }
        }
        if (kLower &&
            tile_start < cta_first_max) {  // warp-uniform: only tiles before a row's first key (window, leftpad, sinks)
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    #pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        if (tile_start + mt * 16 + g + (j < 2 ? 0 : 8) < first[nt][j & 1]) sc[mt][nt][j] = kNegInf;
                    }
                }
            }
        }
        if (kLocal && p.softcap_log2 > 0.f) {  // warp-uniform; masked scores stay -inf
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    #pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        if (sc[mt][nt][j] != kNegInf) sc[mt][nt][j] = softcap_score(sc[mt][nt][j], p.softcap_log2);
                    }
                }
            }
        }

        // ---- online softmax (base 2) with lazy rescaling: a row's reference max moves only when the
        // tile's max exceeds it by more than kRescaleSlack (probabilities stay <= 2^slack, safe in
        // 16 bits), and the accumulators are rescaled only when some row of the warp moved; past
        // the first tiles that is rare. Probabilities scaled by V's per-token scale go to P^T.
        constexpr float kRescaleSlack = 8.f;
        float tile_max[NT][2];
        bool moved = false;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                float mx = kNegInf;
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) { mx = fmaxf(mx, fmaxf(sc[mt][nt][j], sc[mt][nt][j + 2])); }
                tile_max[nt][j] = warp_max_rows(mx);
                moved |= tile_max[nt][j] > row_max[nt][j] + kRescaleSlack;
            }
        }
        if (__any_sync(0xffffffffu, moved)) {
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                #pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const float mx = fmaxf(row_max[nt][j], tile_max[nt][j]);
                    const float rescale = mx == kNegInf ? 1.f : exp2f(row_max[nt][j] - mx);
                    row_max[nt][j] = mx;
                    row_sum[nt][j] *= rescale;
                    row_corr[nt][j] *= rescale;
                    #pragma unroll
                    for (int m = 0; m < KB; ++m) {
                        acc[nt][m][j] *= rescale;
                        acc[nt][m][j + 2] *= rescale;
                    }
                }
            }
        }
        uint32_t pb[MT][NT][2];
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const float use_max[2] = {row_max[nt][0] == kNegInf ? 0.f : row_max[nt][0],
                                      row_max[nt][1] == kNegInf ? 0.f : row_max[nt][1]};
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int t0 = mt * 16 + g;
                float2 v0 = make_float2(1.f, 0.f), v1 = v0;
                if constexpr (KV::kAffine) {
                    v0 = KV::v_affine(stage, t0);
                    v1 = KV::v_affine(stage, t0 + 8);
                }
                float pr[4];
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float prob = exp2f(sc[mt][nt][j] - use_max[j & 1]);
                    row_sum[nt][j & 1] += prob;
                    pr[j] = prob;
                    if constexpr (KV::kAffine) {
                        const float2 f = j < 2 ? v0 : v1;
                        const float scaled = to_float(from_float<Elem>(prob * f.x));
                        pr[j] = scaled;
                        // the MMA adds scaled * (code - center); this adds prob * (offset + mid * scale)
                        // and 0.5 * scaled, so the rounding error of `scaled` multiplies code - mid, which
                        // is zero-mean on turbo's symmetric grid (a common-mode error would survive the
                        // inverse Hadamard transform concentrated in one output element)
                        row_corr[nt][j & 1] += prob * (f.y + KV::kVMid * f.x) + 0.5f * scaled;
                    }
                }
                pb[mt][nt][0] = movmatrix_trans(pack2<Elem>(pr[0], pr[1]));
                pb[mt][nt][1] = movmatrix_trans(pack2<Elem>(pr[2], pr[3]));
            }
        }

        // ---- O^T += V^T P^T
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            uint32_t va[KB][4];
            KV::v_frags(stage, kv_consts, mt, lane, va);
            #pragma unroll
            for (int m = 0; m < KB; ++m) {
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt) { mma_16816<Elem>(acc[nt][m], va[m], pb[mt][nt][0], pb[mt][nt][1]); }
            }
        }
        __syncwarp();
    }
    cp_async_wait<0>();

    // ---- merge the warps: per-row max and sum through shared memory, then the O^T slices
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            row_sum[nt][j] = warp_sum_rows(row_sum[nt][j]);
            row_corr[nt][j] = warp_sum_rows(row_corr[nt][j]);
        }
    }
    __syncthreads();  // the pipeline's memory is the merge's from here on
    float *sm_max = reinterpret_cast<float *>(smem);  // [warps][rows]
    float *sm_sum = sm_max + kWarps * kRows;          // [warps][rows]
    float *sm_o = sm_sum + kWarps * kRows;            // [warps][rows][D], each warp's own max
    if (g == 0) {
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                sm_max[warp * kRows + nt * 8 + 2 * c + j] = row_max[nt][j];
                sm_sum[warp * kRows + nt * 8 + 2 * c + j] = row_sum[nt][j];
            }
        }
    }
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int n = nt * 8 + 2 * c + j;
            #pragma unroll
            for (int m = 0; m < KB; ++m) {
                sm_o[(warp * kRows + n) * D + 16 * m + g] = acc[nt][m][j] + row_corr[nt][j];
                sm_o[(warp * kRows + n) * D + 16 * m + g + 8] = acc[nt][m][j + 2] + row_corr[nt][j];
            }
        }
    }
    __syncthreads();
    // a warp a row: the warps' slices weighted by their maxima, normalized, stored (rotated back
    // when there is one split)
    #pragma unroll
    for (int n = warp; n < kRows; n += kWarps) {
        const int r = row0 + n;
        if (r >= total_rows) continue;  // warp-uniform
        float mx = kNegInf;
        #pragma unroll
        for (int w = 0; w < kWarps; ++w) { mx = fmaxf(mx, sm_max[w * kRows + n]); }
        const float use = mx == kNegInf ? 0.f : mx;
        float wt[kWarps], total = 0.f;
        #pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            wt[w] = exp2f(sm_max[w * kRows + n] - use);  // (0 for a warp without keys)
            total += sm_sum[w * kRows + n] * wt[w];
        }
        float o[kV];
        #pragma unroll
        for (int k = 0; k < kV; ++k) {
            float sum = 0.f;
            #pragma unroll
            for (int w = 0; w < kWarps; ++w) { sum += sm_o[(w * kRows + n) * D + lane * kV + k] * wt[w]; }
            o[k] = total != 0.f ? sum / total : 0.f;  // (NaN stays NaN)
        }
        if (kSide && p.rot_signs != nullptr) { rotate_row<D>(p.rot_signs, o, lane); }  // into the codes' domain
        store_row<Elem, D>(p, b, hk, split, r, o, use, total, lane);
    }
}

template <typename Traits, Paging kPaging, bool kLocal, bool kRope, bool kSide>
__device__ __forceinline__ void decode_split(const DecodeParams &p) {
    extern __shared__ __align__(16) char smem[];
    pdl_wait();  // (launched as the previous kernel's dependent: its writes, e.g. the append's, first)
    pdl_launch_dependents();  // (the combine's CTAs start once every CTA here has: after the last wave began)
    if constexpr (kSide) {  // (no kLocal with a side: host checks)
        // CTAs start in linear order (x fastest): the codes' CTAs of a row block first, its side CTAs
        // last, so the side's short CTAs fill the slots the codes' leave instead of putting a third
        // long CTA on some SMs (8 x 32K: 127 us with the side CTAs interleaved, as plain 92 with them last)
        const int code_splits = p.num_splits - 1;
        const int lin = blockIdx.x + gridDim.x * blockIdx.y, codes = code_splits * gridDim.y;
        if (lin >= codes) {
            split_body<SideTraits<Traits>, Paging::kNone, false, false, Part::kSide>(p, smem, code_splits, lin - codes);
        } else {
            split_body<Traits, kPaging, false, kRope, Part::kCodes>(p, smem, lin % code_splits, lin / code_splits);
        }
    } else {
        split_body<Traits, kPaging, kLocal, kRope, Part::kAll>(p, smem, blockIdx.x, blockIdx.y);
    }
}

// A launch with a 16-bit side (the sinks) and a ring of window codes (DecodeParams::has_ring), over
// a contiguous cache; r: the ring's params (its codes kRingBits wide). CTAs in linear order: the
// codes', the ring's, the side's.
// (The RoPE variant with one row tile held to 3 CTAs an SM, as decode_split_rope_kernel.)
template <typename Traits, int kRingBits, bool kRope>
__global__ void __launch_bounds__(Traits::kNThreads, (kRope && Traits::kNT == 1) ? 3 : 1)
    decode_ring_kernel(const DecodeParams p, const DecodeParams r) {
    extern __shared__ __align__(16) char smem[];
    pdl_wait();
    pdl_launch_dependents();
    const int code_splits = p.num_splits - 2, rows = gridDim.y;
    const int lin = blockIdx.x + gridDim.x * blockIdx.y, codes = code_splits * rows;
    if (lin < codes) {
        split_body<Traits, Paging::kNone, false, kRope, Part::kCodes>(p, smem, lin % code_splits, lin / code_splits);
    } else if (lin < codes + rows) {
        split_body<RingTraits<Traits, kRingBits>, Paging::kNone, false, kRope, Part::kRing>(r, smem, code_splits,
                                                                                            lin - codes);
    } else {
        split_body<SideTraits<Traits>, Paging::kNone, false, false, Part::kSide>(p, smem, code_splits + 1,
                                                                                 lin - codes - rows);
    }
}

template <typename Traits, Paging kPaging, bool kLocal, bool kRope = false, bool kSide = false>
__global__ void __launch_bounds__(Traits::kNThreads) decode_split_kernel(const DecodeParams p) {
    decode_split<Traits, kPaging, kLocal, kRope, kSide>(p);
}

// The RoPE-center variants with one n8 tile of rows, held to 3 CTAs an SM (<= 168 registers; left
// free, the one with a side took 200 and fit 2)
template <typename Traits, Paging kPaging, bool kSide>
__global__ void __launch_bounds__(Traits::kNThreads, 3) decode_split_rope_kernel(const DecodeParams p) {
    decode_split<Traits, kPaging, false, true, kSide>(p);
}

// Two head groups of a layer whose codes differ in width (TQCache's 8-bit copy heads beside 3-bit
// ones), both with a 16-bit side, in one launch. Each group splits its keys its own way (num_splits:
// its code splits + 1), so that a wide head's CTAs take about as long as a narrow one's; the split
// buffers hold the larger count, every row's side in the last slot, and a group with fewer splits
// fills its unused slots with empty partials (its side CTA), for one combine over the layer's rows
// (DecodeParams::head_base). grid.x: b's code CTAs (the longer), a's, then every side CTA.
template <typename TA, typename TB, bool kRope>
__device__ __forceinline__ void decode_pair_split(const DecodeParams &a, const DecodeParams &b) {
    static_assert(TA::kNThreads == TB::kNThreads && TA::kRows == TB::kRows, "one CTA shape for both groups");
    extern __shared__ __align__(16) char smem[];
    pdl_wait();
    pdl_launch_dependents();
    const int a_splits = a.num_splits - 1, b_splits = b.num_splits - 1;
    const int side_slot = max(a_splits, b_splits), a_rows = a.b * a.h_k, b_codes = b_splits * b.b * b.h_k;
    int lin = blockIdx.x;
    if (lin < b_codes) {
        split_body<TB, Paging::kNone, false, kRope, Part::kCodes>(b, smem, lin % b_splits, lin / b_splits);
        return;
    }
    lin -= b_codes;
    if (lin < a_splits * a_rows) {
        split_body<TA, Paging::kNone, false, kRope, Part::kCodes>(a, smem, lin % a_splits, lin / a_splits);
        return;
    }
    lin -= a_splits * a_rows;
    if (lin < a_rows) {
        split_body<SideTraits<TA>, Paging::kNone, false, false, Part::kSide>(a, smem, side_slot, lin);
        clear_splits<TA::kHeadDim, TA::kRows>(a, lin, a_splits, side_slot);
    } else {
        split_body<SideTraits<TB>, Paging::kNone, false, false, Part::kSide>(b, smem, side_slot, lin - a_rows);
        clear_splits<TB::kHeadDim, TB::kRows>(b, lin - a_rows, b_splits, side_slot);
    }
}

// (one row tile: held to 3 CTAs an SM, as decode_split_rope_kernel; unbounded, the K8V8 body took 173
// registers and held the 3-bit heads to 2)
template <typename TA, typename TB, bool kRope>
__global__ void __launch_bounds__(TA::kNThreads, TA::kNT == 1 ? 3 : 1)
    decode_pair_kernel(const DecodeParams a, const DecodeParams b) {
    decode_pair_split<TA, TB, kRope>(a, b);
}

// The end of a merged row: o (the lane's kV elements of sum_s w_s o_s, w_s = exp(lse_s - use)) over
// total = sum_s w_s, rotated back (turbo), to out; lse = use + log(total) (+inf without keys).
template <typename Elem, int kHeadDim>
__device__ __forceinline__ void write_merged_row(const DecodeParams &p, int64_t row, float (&o)[kHeadDim / 32],
                                                 float total, float use, int lane) {
    constexpr int kV = kHeadDim / 32;
    #pragma unroll
    for (int k = 0; k < kV; ++k) { o[k] = total != 0.f ? o[k] / total : 0.f; }
    if (p.rot_signs != nullptr) { unrotate_row<kHeadDim>(p.rot_signs, o, lane); }
    const int i = row % p.seqlen_q, hq = (row / p.seqlen_q) % p.h, b = row / (static_cast<int64_t>(p.seqlen_q) * p.h);
    Elem *out = reinterpret_cast<Elem *>(p.out) + b * p.o_batch_stride + i * p.o_row_stride + hq * p.o_head_stride;
    store_row_part<Elem, kV>(out + lane * kV, o);
    if (lane == 0) { p.softmax_lse[row] = total != 0.f ? use + logf(total) : INFINITY; }
}

template <int kV>
__device__ __forceinline__ void load_accum(const float *src, float (&v)[kV]) {
    if constexpr (kV == 4) {
        const float4 t = *reinterpret_cast<const float4 *>(src);
        v[0] = t.x;
        v[1] = t.y;
        v[2] = t.z;
        v[3] = t.w;
    } else {
        const float2 t = *reinterpret_cast<const float2 *>(src);
        v[0] = t.x;
        v[1] = t.y;
    }
}

// Merge the splits of each (batch, head, query) row: a CTA a row; its 4 warps take every 4th split
// (lanes: kV consecutive d), kChunk splits' lse and O loads issued before any is used (one L2 round
// trip for up to 4 kChunk splits), each warp merging its own against its own max; then warp 0 merges
// the warps, normalizes and rotates back (turbo). For decode: few rows, many splits.
template <typename Elem, int kHeadDim>
__global__ void __launch_bounds__(128) decode_combine_kernel(const DecodeParams p) {
    constexpr int kV = kHeadDim / 32, kChunk = 8;
    __shared__ float sm_max[4], sm_total[4];
    __shared__ __align__(16) float sm_o[4][kHeadDim];
    pdl_wait();
    const int64_t rows = static_cast<int64_t>(p.b) * p.h * p.seqlen_q;
    const int64_t row = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float mx = -INFINITY, total = 0.f, o[kV] = {};
    for (int s0 = warp; s0 < p.num_splits; s0 += 4 * kChunk) {
        float lse[kChunk], v[kChunk][kV];
        #pragma unroll
        for (int i = 0; i < kChunk; ++i) {
            const int s = s0 + 4 * i;
            lse[i] = s < p.num_splits ? p.lse_accum[s * rows + row] : -INFINITY;
            if (s < p.num_splits) {
                load_accum<kV>(p.out_accum + (s * rows + row) * kHeadDim + lane * kV, v[i]);
            } else {
                #pragma unroll
                for (int k = 0; k < kV; ++k) { v[i][k] = 0.f; }
            }
        }
        float cmx = mx;
        bool nan = false;  // a NaN row (cache_row) stays NaN: fmaxf alone would skip its splits
        #pragma unroll
        for (int i = 0; i < kChunk; ++i) {
            cmx = fmaxf(cmx, lse[i]);
            nan |= lse[i] != lse[i];
        }
        if (cmx == -INFINITY && !nan) continue;  // (warp-uniform)
        const float rescale = __expf(mx - cmx);  // (0 while mx is -inf)
        total *= rescale;
        #pragma unroll
        for (int k = 0; k < kV; ++k) { o[k] *= rescale; }
        #pragma unroll
        for (int i = 0; i < kChunk; ++i) {
            const float w = __expf(lse[i] - cmx);
            total += w;
            #pragma unroll
            for (int k = 0; k < kV; ++k) { o[k] += w * v[i][k]; }
        }
        mx = cmx;
    }
    #pragma unroll
    for (int k = 0; k < kV; ++k) { sm_o[warp][lane * kV + k] = o[k]; }
    if (lane == 0) {
        sm_max[warp] = mx;
        sm_total[warp] = total;
    }
    __syncthreads();
    if (warp != 0) return;
    const float m = fmaxf(fmaxf(sm_max[0], sm_max[1]), fmaxf(sm_max[2], sm_max[3]));
    const float use = m == -INFINITY ? 0.f : m;
    float f[4];
    total = 0.f;
    #pragma unroll
    for (int w = 0; w < 4; ++w) {
        f[w] = sm_max[w] == -INFINITY ? 0.f : __expf(sm_max[w] - use);
        total += sm_total[w] * f[w];
    }
    #pragma unroll
    for (int k = 0; k < kV; ++k) {
        const int d = lane * kV + k;
        o[k] = sm_o[0][d] * f[0] + sm_o[1][d] * f[1] + sm_o[2][d] * f[2] + sm_o[3][d] * f[3];
    }
    write_merged_row<Elem, kHeadDim>(p, row, o, total, use, lane);
}

// The same merge for many rows and at most 32 splits (chunked prefill): a warp a row, 4 rows a CTA,
// lane s holding split s's lse (a CTA a row took 20 us of an 8K x 512 prefill call, H200).
template <typename Elem, int kHeadDim>
__global__ void __launch_bounds__(128) combine_rows_kernel(const DecodeParams p) {
    constexpr int kV = kHeadDim / 32;
    pdl_wait();
    const int64_t rows = static_cast<int64_t>(p.b) * p.h * p.seqlen_q;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;  // warp-uniform
    constexpr int kEarly = 4;  // splits whose slices load beside the lse (one L2 round trip for that many)
    float early[kEarly][kV];
    #pragma unroll
    for (int s = 0; s < kEarly; ++s) {
        if (s < p.num_splits) {
            load_accum<kV>(p.out_accum + (s * rows + row) * kHeadDim + lane * kV, early[s]);
        } else {
            #pragma unroll
            for (int k = 0; k < kV; ++k) { early[s][k] = 0.f; }
        }
    }
    const float lse = lane < p.num_splits ? p.lse_accum[lane * rows + row] : -INFINITY;
    float mx = lse;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) { mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o)); }
    const float use = mx == -INFINITY ? 0.f : mx;
    const float w_lane = __expf(lse - use);  // (0 for lanes past the splits)
    float total = w_lane;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) { total += __shfl_xor_sync(0xffffffffu, total, o); }
    float o[kV] = {};
    #pragma unroll
    for (int s = 0; s < kEarly; ++s) {
        const float w = __shfl_sync(0xffffffffu, w_lane, s);  // (0 past the splits)
        #pragma unroll
        for (int k = 0; k < kV; ++k) { o[k] += w * early[s][k]; }
    }
    #pragma unroll 4
    for (int s = kEarly; s < p.num_splits; ++s) {
        const float w = __shfl_sync(0xffffffffu, w_lane, s);
        float v[kV];
        load_accum<kV>(p.out_accum + (s * rows + row) * kHeadDim + lane * kV, v);
        #pragma unroll
        for (int k = 0; k < kV; ++k) { o[k] += w * v[k]; }
    }
    write_merged_row<Elem, kHeadDim>(p, row, o, total, use, lane);
}

}  // namespace flash_tq
