// The prefill kernel's traits (tile shapes and the shared-memory layout) and its work on one tile:
// the expansion of a packed tile into shared memory (expand_tile), the online softmax of a half tile
// (softmax_half) and the MMAs of a warp (attend_tile: mma.sync) or a warpgroup (attend_tile_wgmma).
// The kernel's pipeline around them is tq_prefill_kernel.h.
#pragma once

#include <cmath>

#include "tq_kv_loader.h"
#include "tq_params.h"
#include "tq_rows.h"
#include "tq_utils.h"
#include "tq_wgmma.h"

namespace flash_tq {

template <typename Elem_, int kHeadDim_, int kKBits, int kVBits, int kNWarps_, int kMTiles_, bool kScaleOnly = false,
          bool kWgmma_ = false, bool kRope_ = false>
struct PrefillTraits {
    using Elem = Elem_;
    using KV = PackedKV<kKBits, kVBits, kHeadDim_, Elem_, kScaleOnly>;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr float kKMid = (1 << (kKBits - 1)) - 0.5f;  // middle of K's code range
    // scale-only metadata (turbo's norm fit, offset = -mid * scale): the K and V terms are zero
    static constexpr bool kTerms = !kScaleOnly;
    static constexpr int kNWarps = kNWarps_;
    // Hopper: S and O through wgmma (a warpgroup's 4 warps x kMTiles m16 tiles = kMTiles m64 tiles),
    // Q and the expanded K / V tiles in the swizzled layout of tq_wgmma.h; else mma.sync fragments.
    static constexpr bool kWgmma = kWgmma_;
    // key_center='rope': v(p) = H R(p) c / sqrt(d) (tq_rope_center.h) added into the expanded K tiles
    static constexpr bool kRope = kRope_;
    static_assert(!kRope || kWgmma, "the RoPE-center variant is the wgmma kernel's (sm_90a)");
    static constexpr int kNThreads = 32 * kNWarps;
    static constexpr int kMTiles = kMTiles_;  // 16-row MMA tiles a warp (2: half the fragment reads an MMA)
    static constexpr int kWarpRows = 16 * kMTiles;
    static constexpr int kRows = kWarpRows * kNWarps;  // query rows a CTA share each expanded tile
    static constexpr int kTileN = 2 * KV::kTileN;      // 64 tokens: 256 K and 256 V expansion units
    static constexpr int kPackedStages = 3;            // packed tiles in flight: i + 1 expanding, i + 2 arriving
    static constexpr int kPackedBytes = 2 * KV::kStageBytes;
    static constexpr int kKChunks = kHeadDim / 8;  // 16-byte chunks of a token's K fragments (4 lanes x kSlotsK words)
    static constexpr int kVChunks = kHeadDim / 4;  // of a token pair's V fragments (8 groups x kHeadDim / 8 words)
    static constexpr int kKFragOff = 0;
    static constexpr int kVFragOff = kKFragOff + kTileN * kKChunks * 16;      // (= kTileN * kHeadDim * 2 either way)
    static constexpr int kKTermOff = kVFragOff + kTileN / 2 * kVChunks * 16;  // float2 a token: K scale, K term
    static constexpr int kVTermOff = kKTermOff + kTileN * 8;                  // float a token: V term
    // wgmma: whole 1 KB blocks, so both buffers' tiles stay 1024-byte aligned (the swizzle's period)
    static constexpr int kFragBytes = kWgmma ? (kVTermOff + kTileN * 4 + 1023) / 1024 * 1024 : kVTermOff + kTileN * 4;
    // expanded tiles: i + 1 being written while i is read (wgmma: and i - 1's last P V still running)
    static constexpr int kFragBuffers = kWgmma ? 3 : 2;
    static constexpr int kQFragBytes = kRows * kHeadDim * 2;  // Q's A fragments (wgmma: Q tile), for the whole kernel
    // float rows of the q rotation and the output: 4 floats of padding a row, so that the 8 rows a
    // warp's thread groups read / write at once fall in different banks (8-way conflicts without)
    static constexpr int kRowStride = kHeadDim + 4;
    static constexpr int kOBytes = kRows * kRowStride * 4;  // output rows at the end
    static constexpr int kAlignSlack = kWgmma ? 1024 : 0;  // the dynamic shared memory is aligned up to 1 KB
    // kRope: two stages of table rows (tile i + 1 read by the expansion while tile i + 2 arrives)
    static constexpr int kTabStageBytes = kRope ? kTileN * kHeadDim * 2 : 0;
    static constexpr int kTabBytes = 2 * kTabStageBytes;
    // 16-byte chunk l of token t's table row in a stage: XOR-swizzled by the token, so that an 8-lane
    // phase of the expansion's reads (4 tokens x 2 quads at d = 128) hits 8 bank groups
    __device__ static int tab_chunk(int t, int l) { return t * (kHeadDim / 8) + (l ^ (t & 7)); }
    // Offsets in the pipeline's memory, for q rotated in `passes` passes. wgmma: the fragment buffers
    // first (their alignment), the packed ring (and table stages) past the rotation's rows, so the
    // first tiles' loads are issued before the rotation.
    static constexpr int q_bytes(int passes) { return kRows / passes * kRowStride * 4; }
    static constexpr int packed_off(int passes) {
        return !kWgmma ? 0
                       : (kFragBuffers * kFragBytes > q_bytes(passes) ? kFragBuffers * kFragBytes
                                                                      : (q_bytes(passes) + 127) / 128 * 128);
    }
    static constexpr int smem_bytes(int passes) {
        const int pipe = (kWgmma ? packed_off(passes) + kPackedStages * kPackedBytes
                                 : kPackedStages * kPackedBytes + kFragBuffers * kFragBytes) +
                         kTabBytes;
        const int work = pipe > q_bytes(passes) ? pipe : q_bytes(passes);  // rotation, then the pipeline
        return (kQFragBytes + work > kOBytes ? kQFragBytes + work : kOBytes) + kAlignSlack;
    }
    // turbo q rotation: all rows in one pass where sm_90's 227 KB hold it (wgmma), else half at a
    // time (sm_80's budget; the wgmma RoPE variant at d = 128, whose table stages take the room)
    static constexpr int kQPasses = kWgmma && smem_bytes(1) <= 227 * 1024 ? 1 : 2;
    static constexpr int kQBytes = q_bytes(kQPasses);
    static constexpr int kFragsOff = kWgmma ? 0 : kPackedStages * kPackedBytes;
    static constexpr int kPackedOff = packed_off(kQPasses);
    static constexpr int kTabOff = kWgmma ? kPackedOff + kPackedStages * kPackedBytes
                                          : kPackedStages * kPackedBytes + kFragBuffers * kFragBytes;
    static constexpr int kSmemBytes = smem_bytes(kQPasses);
    // sm_80's budget (tq_params.h); the wgmma variant runs on sm_90 only (227 KB a CTA)
    static_assert(kSmemBytes <= (kWgmma ? 227 * 1024 : kPrefillSmemBudget), "within the budget the host checks");
    static constexpr int kUnits = kTileN * 4;  // K units (token, lane quad) = V units (token pair, group)
    static_assert(kUnits % kNThreads == 0 && kTileN / 2 * 8 == kUnits, "whole expansion passes");
    static_assert(!kWgmma || (kNWarps % 4 == 0 && kMTiles == 2 && kQFragBytes % 1024 == 0),
                  "whole warpgroups, m64 tiles");

    // wgmma: token t and lane quad c of expansion unit `unit`. At d = 128 an 8-lane phase of the
    // 16-byte stores covers 4 tokens x 2 quads of one 64-element column block: 8 distinct chunk
    // positions after the swizzle (natural order would put two lanes on each).
    __device__ static void unit_token_quad(int unit, int &t, int &c) {
        if constexpr (kHeadDim == 128) {
            t = 4 * (unit / 16) + unit % 4;
            c = 2 * ((unit / 8) % 2) + (unit % 8) / 4;
        } else {
            t = unit / 4;
            c = unit % 4;
        }
    }
    // wgmma: Q tile row of local row n (= kWarpRows x warp + 16 m + i): warp w % 4 of its warpgroup
    // holds rows 16 (w % 4) + i of m64 tile m.
    __device__ static int q_tile_row(int warp, int m, int i) {
        return (warp / 4) * (4 * kWarpRows) + 64 * m + 16 * (warp % 4) + i;
    }
    // Swizzled 16-byte chunk of K chunk `l` of token t: every 8-lane phase of the fragment reads
    // (tokens t, t + 1 x lane quads 0..3) and of the expansion writes lands in 8 bank groups.
    __device__ static int k_chunk(int t, int l) { return t * kKChunks + (l ^ (((l >> 3) << 1) | (t & 1))); }
    // ... and of V chunk `l` (= group * kHeadDim / 32 + part) of token pair u.
    __device__ static int v_chunk(int u, int l) {
        const int x = kHeadDim == 128 ? (u & 7) : ((u & 1) | ((u >> 1) & 2) | ((u << 1) & 4));
        return u * kVChunks + (l ^ x);
    }
};

__device__ __forceinline__ uint4 lds128(const char *base, int chunk) {
    return *reinterpret_cast<const uint4 *>(base + 16 * chunk);
}

// +-2^k as a pair of 16-bit floats.
template <typename Elem>
__device__ constexpr uint32_t pow2_pair(int k, bool negative) {
    const uint32_t bits =
        (negative ? 0x8000u : 0u) |
        (std::is_same_v<Elem, __half> ? static_cast<uint32_t>(k + 15) << 10 : static_cast<uint32_t>(k + 127) << 7);
    return bits | (bits << 16);
}

// A raw loader pair (magic + code * 8^e, tq_format.h) to the codes (exact).
template <typename Elem>
__device__ __forceinline__ uint32_t code_pair(uint32_t raw, int e) {
    constexpr int kMagicLog2 = std::is_same_v<Elem, __half> ? 10 : 7;
    return fma2<Elem>(raw, pow2_pair<Elem>(-3 * e, false), pow2_pair<Elem>(kMagicLog2 - 3 * e, true));
}

// Expand packed tile `packed` (two PackedKV stages) into fragment buffer `frag`; the K terms are
// stored times the softmax scale (log2 domain). kRope: `tab` holds the tile's rope_table rows, added
// to K as row * |c| / scale (center_norm = |c|; scales below |c| 2^-15 count as that, so that the
// sum stays within float16's range).
template <typename T>
__device__ __forceinline__ void expand_tile(const char *packed, char *frag, float softmax_scale_log2, int tid,
                                            const char *tab = nullptr, float center_norm = 0.f) {
    using KV = typename T::KV;
    using Elem = typename T::Elem;
    constexpr int D = T::kHeadDim, kSlots = KV::kSlotsK, kCodes = KV::kGroupCodes;
    #pragma unroll
    for (int unit = tid; unit < T::kUnits; unit += T::kNThreads) {
        if constexpr (
            T::kWgmma) {  // token t, quad c: K and V pair slots c * kSlots.. as code - mid (V: times its scale)
            int t, c;
            T::unit_token_quad(unit, t, c);
            const char *stage = packed + (t / KV::kTileN) * KV::kStageBytes;
            const int tok = t % KV::kTileN;
            uint32_t wk[kSlots], wv[kSlots];
            KV::k_slots(stage, tok, c, wk);
            KV::v_slots(stage, tok, c, wv);
            const float vscale = KV::v_affine(stage, tok).x;
            const uint32_t neg_kmid = pack2<Elem>(-T::kKMid, -T::kKMid), neg_vmid = pack2<Elem>(-KV::kVMid, -KV::kVMid);
            const uint32_t one = pow2_pair<Elem>(0, false), scale = pack2<Elem>(vscale, vscale);
            uint32_t kadd[kSlots];  // -mid, + v / scale with the RoPE center
            if constexpr (T::kRope) {
                const float f = center_norm / fmaxf(KV::k_affine(stage, tok).x, fmaxf(center_norm * 0x1p-15f, 1e-30f));
                const uint32_t f2 = pack2<Elem>(f, f);
                #pragma unroll
                for (int q = 0; q < kSlots / 4; ++q) {
                    const uint4 r = lds128(tab, T::tab_chunk(t, c * (kSlots / 4) + q));
                    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
                    #pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        if constexpr (std::is_same_v<Elem, __half>) {  // (float16: one rounding more, 3 bits finer)
                            kadd[4 * q + k] = fma2<Elem>(w[k], f2, neg_kmid);
                        } else {  // bfloat16: the product rounded once
                            const float2 v = unpack2<Elem>(w[k]);
                            kadd[4 * q + k] = pack2<Elem>(fmaf(v.x, f, -T::kKMid), fmaf(v.y, f, -T::kKMid));
                        }
                    }
                }
            } else {
                #pragma unroll
                for (int i = 0; i < kSlots; ++i) { kadd[i] = neg_kmid; }
            }
            #pragma unroll
            for (int i = 0; i < kSlots; ++i) {
                wk[i] = fma2<Elem>(code_pair<Elem>(wk[i], KV::q_scale_exp(i)), one, kadd[i]);
                wv[i] =
                    fma2<Elem>(fma2<Elem>(code_pair<Elem>(wv[i], KV::v_slot_scale_exp(i)), one, neg_vmid), scale, 0u);
            }
            #pragma unroll
            for (int q = 0; q < kSlots / 4; ++q) {
                const int chunk = tile_chunk<T::kTileN>(t, c * (kSlots / 4) + q);
                *reinterpret_cast<uint4 *>(frag + T::kKFragOff + chunk) =
                    make_uint4(wk[4 * q], wk[4 * q + 1], wk[4 * q + 2], wk[4 * q + 3]);
                *reinterpret_cast<uint4 *>(frag + T::kVFragOff + chunk) =
                    make_uint4(wv[4 * q], wv[4 * q + 1], wv[4 * q + 2], wv[4 * q + 3]);
            }
        } else {
            {  // K: token t, lane quad c: its pair slots as kSlots / 4 chunks of code - mid
                const int t = unit / 4, c = unit % 4;
                uint32_t w[kSlots];
                KV::k_slots(packed + (t / KV::kTileN) * KV::kStageBytes, t % KV::kTileN, c, w);
                const uint32_t neg_mid = pack2<Elem>(-T::kKMid, -T::kKMid);
                #pragma unroll
                for (int i = 0; i < kSlots; ++i) {
                    w[i] = fma2<Elem>(code_pair<Elem>(w[i], KV::q_scale_exp(i)), pow2_pair<Elem>(0, false), neg_mid);
                }
                #pragma unroll
                for (int q = 0; q < kSlots / 4; ++q) {
                    *reinterpret_cast<uint4 *>(frag + T::kKFragOff + 16 * T::k_chunk(t, c * (kSlots / 4) + q)) =
                        make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
                }
            }
            {  // V: token pair u, lane group g: element 8j + g of both tokens (low half: token 2u), each d tile j
                const int u = unit % 32, g = unit / 32, t = 2 * u;
                const char *stage = packed + (t / KV::kTileN) * KV::kStageBytes;
                uint32_t w[kCodes];
                KV::v_pair_slots(stage, t % KV::kTileN, g, w);
                const float2 f0 = KV::v_affine(stage, t % KV::kTileN), f1 = KV::v_affine(stage, t % KV::kTileN + 1);
                const uint32_t scale = pack2<Elem>(f0.x, f1.x), neg_mid = pack2<Elem>(-KV::kVMid, -KV::kVMid);
                #pragma unroll
                for (int j = 0; j < kCodes; ++j) {
                    w[j] = fma2<Elem>(
                        fma2<Elem>(code_pair<Elem>(w[j], KV::v_scale_exp(j)), pow2_pair<Elem>(0, false), neg_mid),
                        scale, 0u);
                }
                #pragma unroll
                for (int q = 0; q < kCodes / 4; ++q) {
                    *reinterpret_cast<uint4 *>(frag + T::kVFragOff + 16 * T::v_chunk(u, g * (D / 32) + q)) =
                        make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
                }
            }
        }
    }
    for (int t = tid; t < T::kTileN; t += T::kNThreads) {  // per-token float32 factors
        const char *stage = packed + (t / KV::kTileN) * KV::kStageBytes;
        const float2 kf = KV::k_affine(stage, t % KV::kTileN), vf = KV::v_affine(stage, t % KV::kTileN);
        *reinterpret_cast<float2 *>(frag + T::kKTermOff + 8 * t) =
            make_float2(kf.x * softmax_scale_log2, (kf.y + T::kKMid * kf.x) * softmax_scale_log2);
        *reinterpret_cast<float *>(frag + T::kVTermOff + 4 * t) = vf.y + KV::kVMid * vf.x;
    }
    if constexpr (T::kWgmma) { fence_proxy_async(); }  // the tiles are read by wgmma after the next barrier
}

// The online softmax of one 32-token half for a warp's rows: s holds S = Q K^T (s[m][j][e]: row
// 16m + g + 8 (e / 2), token t0 + 8j + 2c + e % 2); the K factors, mask and softcap make the scores
// (base 2), the row statistics move (lazily: a row's reference max moves only when the tile's max
// exceeds it by more than 2^8, as in the decode kernel), and P comes out as A fragments in pa
// (k-block kb = n8 tiles 2kb, 2kb + 1). acc_ready() runs before acc and pa are written (wgmma:
// the P V still reading them completes), after the exponentials.
template <typename T, bool kLocal, typename AccReady>
__device__ __forceinline__ void softmax_half(float (&s)[T::kMTiles][T::kTileN / 16][4], const char *frag, int t0,
                                             int tile_start, bool masked, const int (&lim)[T::kMTiles][2],
                                             const int (&first)[T::kMTiles][2], float softcap_log2,
                                             const float (&sumq)[T::kMTiles][2], float (&row_max)[T::kMTiles][2],
                                             float (&row_sum)[T::kMTiles][2], float (&row_corr)[T::kMTiles][2],
                                             float (&acc)[T::kMTiles][T::kHeadDim / 8][4],
                                             uint32_t (&pa)[T::kMTiles][T::kTileN / 32][4], int c, AccReady acc_ready) {
    using Elem = typename T::Elem;
    constexpr int NH = T::kTileN / 16, DJ = T::kHeadDim / 8, MT = T::kMTiles;
    constexpr float kNegInf = -INFINITY, kRescaleSlack = 8.f;
    // per-token factors of tokens (t0 + 8j + 2c, + 1): K (scale, term, scale, term), V (term, term)
    const float4 *k_terms = reinterpret_cast<const float4 *>(frag + T::kKTermOff) + t0 / 2;
    const float2 *v_terms = reinterpret_cast<const float2 *>(frag + T::kVTermOff) + t0 / 2;
    float tile_max[MT][2];
    bool moved = false;
    #pragma unroll
    for (int m = 0; m < MT; ++m) {
        tile_max[m][0] = tile_max[m][1] = kNegInf;
        #pragma unroll
        for (int j = 0; j < NH; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e / 2, tok = tile_start + t0 + 8 * j + 2 * c + e % 2;
                const float4 f = k_terms[4 * j + c];
                float v;
                if constexpr (T::kTerms) {
                    v = e % 2 ? fmaf(s[m][j][e], f.z, f.w * sumq[m][h]) : fmaf(s[m][j][e], f.x, f.y * sumq[m][h]);
                } else {
                    v = s[m][j][e] * (e % 2 ? f.z : f.x);
                }
                // (wgmma: the mask below, on masked tiles only; here predicated on every tile)
                if (!T::kWgmma && masked && (tok >= lim[m][h] || tok < first[m][h])) v = kNegInf;
                if (kLocal && softcap_log2 > 0.f && v != kNegInf) v = softcap_score(v, softcap_log2);
                s[m][j][e] = v;
                if constexpr (!T::kWgmma) { tile_max[m][h] = fmaxf(tile_max[m][h], v); }
            }
        }
        if constexpr (T::kWgmma) {
            if (masked) {  // warp-uniform
                #pragma unroll
                for (int j = 0; j < NH; ++j) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int h = e / 2, tok = tile_start + t0 + 8 * j + 2 * c + e % 2;
                        if (tok >= lim[m][h] || tok < first[m][h]) s[m][j][e] = kNegInf;
                    }
                }
            }
            #pragma unroll
            for (int j = 0; j < NH; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) { tile_max[m][e / 2] = fmaxf(tile_max[m][e / 2], s[m][j][e]); }
            }
        }
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            tile_max[m][h] = fmaxf(tile_max[m][h], __shfl_xor_sync(0xffffffffu, tile_max[m][h], 1));
            tile_max[m][h] = fmaxf(tile_max[m][h], __shfl_xor_sync(0xffffffffu, tile_max[m][h], 2));
            moved |= tile_max[m][h] > row_max[m][h] + kRescaleSlack;
        }
    }
    const bool rescale_rows = __any_sync(0xffffffffu, moved);
    float rescale[MT][2];
    #pragma unroll
    for (int m = 0; m < MT; ++m) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            rescale[m][h] = 1.f;
            if (rescale_rows) {
                const float mx = fmaxf(row_max[m][h], tile_max[m][h]);
                rescale[m][h] = mx == kNegInf ? 1.f : exp2f(row_max[m][h] - mx);
                row_max[m][h] = mx;
                row_sum[m][h] *= rescale[m][h];
                if constexpr (T::kTerms) { row_corr[m][h] *= rescale[m][h]; }
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < MT; ++m) {  // probabilities, in place
        const float use_max[2] = {row_max[m][0] == kNegInf ? 0.f : row_max[m][0],
                                  row_max[m][1] == kNegInf ? 0.f : row_max[m][1]};
        #pragma unroll
        for (int j = 0; j < NH; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e / 2;
                const float2 f = v_terms[4 * j + c];
                const float prob = exp2f(s[m][j][e] - use_max[h]);
                row_sum[m][h] += prob;
                if constexpr (T::kTerms) { row_corr[m][h] += prob * (e % 2 ? f.y : f.x); }
                s[m][j][e] = prob;
            }
        }
    }
    acc_ready();
    if (rescale_rows) {
        #pragma unroll
        for (int m = 0; m < MT; ++m) {
            #pragma unroll
            for (int j = 0; j < DJ; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) { acc[m][j][e] *= rescale[m][e / 2]; }
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < MT; ++m) {
        #pragma unroll
        for (int j = 0; j < NH; ++j) {
            pa[m][j / 2][2 * (j % 2)] = pack2<Elem>(s[m][j][0], s[m][j][1]);
            pa[m][j / 2][2 * (j % 2) + 1] = pack2<Elem>(s[m][j][2], s[m][j][3]);
        }
    }
}

// One warp's rows over fragment buffer `frag` (tile at key tile_start) with mma.sync: S = Q K^T,
// the online softmax, O += P V, for each of its kMTiles 16-row tiles (index m), the tile's two
// 32-token halves one after the other (the scores of both m tiles and the 64-token tile would not
// fit the registers beside the accumulators). masked: some key of the tile lies outside a row's
// keys [first[m][h], lim[m][h]). qfrag: the lane's Q A fragments, [m][k-block] 16 bytes, 512 bytes apart.
template <typename T, bool kLocal>
__device__ __forceinline__ void attend_tile(const char *frag, const char *qfrag, int tile_start, bool masked,
                                            const int (&lim)[T::kMTiles][2], const int (&first)[T::kMTiles][2],
                                            float softcap_log2, const float (&sumq)[T::kMTiles][2],
                                            float (&row_max)[T::kMTiles][2], float (&row_sum)[T::kMTiles][2],
                                            float (&row_corr)[T::kMTiles][2],
                                            float (&acc)[T::kMTiles][T::kHeadDim / 8][4], int lane) {
    using Elem = typename T::Elem;
    constexpr int D = T::kHeadDim, KB = D / 16, NH = T::kTileN / 16, MT = T::kMTiles;
    const int g = lane / 4, c = lane % 4;
    #pragma unroll 1  // (unrolled, the two halves' registers spill)
    for (int half = 0; half < 2; ++half) {
        const int t0 = half * (T::kTileN / 2);
        // ---- S = Q K^T: n8 tile j = tokens t0 + 8j..+7; lane (g, c) reads token t0 + 8j + g, quad c;
        // each K fragment serves every m tile
        float s[MT][NH][4];
        #pragma unroll
        for (int m = 0; m < MT; ++m) {
            #pragma unroll
            for (int j = 0; j < NH; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) { s[m][j][e] = 0.f; }
            }
        }
        #pragma unroll
        for (int q = 0; q < KB / 2; ++q) {  // chunk q: k-blocks 2q, 2q + 1
            uint4 w[NH];
            #pragma unroll
            for (int j = 0; j < NH; ++j) {
                w[j] = lds128(frag + T::kKFragOff, T::k_chunk(t0 + 8 * j + g, c * (KB / 2) + q));
            }
            #pragma unroll
            for (int m = 0; m < MT; ++m) {
                const uint4 a0 = lds128(qfrag, 32 * (m * KB + 2 * q)), a1 = lds128(qfrag, 32 * (m * KB + 2 * q + 1));
                const uint32_t qa0[4] = {a0.x, a0.y, a0.z, a0.w}, qa1[4] = {a1.x, a1.y, a1.z, a1.w};
                #pragma unroll
                for (int j = 0; j < NH; ++j) { mma_16816<Elem>(s[m][j], qa0, w[j].x, w[j].y); }
                #pragma unroll
                for (int j = 0; j < NH; ++j) { mma_16816<Elem>(s[m][j], qa1, w[j].z, w[j].w); }
            }
        }
        uint32_t pa[MT][NH / 2][4];
        softmax_half<T, kLocal>(s, frag, t0, tile_start, masked, lim, first, softcap_log2, sumq, row_max, row_sum,
                                row_corr, acc, pa, c, [] {});
        // ---- O += P V: lane (g, c) reads token pairs t0 / 2 + 8kb + c (b0) and + 4 (b1), group g
        #pragma unroll
        for (int kb = 0; kb < NH / 2; ++kb) {
            #pragma unroll
            for (int q = 0; q < D / 32; ++q) {
                const uint4 b0 = lds128(frag + T::kVFragOff, T::v_chunk(t0 / 2 + 8 * kb + c, g * (D / 32) + q));
                const uint4 b1 = lds128(frag + T::kVFragOff, T::v_chunk(t0 / 2 + 8 * kb + c + 4, g * (D / 32) + q));
                #pragma unroll
                for (int m = 0; m < MT; ++m) {
                    mma_16816<Elem>(acc[m][4 * q + 0], pa[m][kb], b0.x, b1.x);
                    mma_16816<Elem>(acc[m][4 * q + 1], pa[m][kb], b0.y, b1.y);
                    mma_16816<Elem>(acc[m][4 * q + 2], pa[m][kb], b0.z, b1.z);
                    mma_16816<Elem>(acc[m][4 * q + 3], pa[m][kb], b0.w, b1.w);
                }
            }
        }
    }
}

// The wgmma variant, called by a whole warpgroup for every tile (q_tile: its Q rows, kMTiles m64
// tiles). The tensor cores run in issue order, so each half's S is issued before the previous
// half's P V: the P V then runs while this half's softmax does. The P V of a tile's last half is
// left for the next call (pa, pv_addr: its P and V; a zero P over finite memory before the first
// tile), and finished by wgmma_flush_pv after the last: its V buffer must stay intact until then.
template <typename T>
__device__ __forceinline__ void wgmma_issue_pv(float (&acc)[T::kMTiles][T::kHeadDim / 8][4],
                                               const uint32_t (&pa)[T::kMTiles][T::kTileN / 32][4], uint64_t pv_desc) {
    wgmma_fence();
    #pragma unroll
    for (int kb = 0; kb < T::kTileN / 32; ++kb) {  // V tokens 16 kb.. of the half (MN-major: d contiguous)
        #pragma unroll
        for (int m = 0; m < T::kMTiles; ++m) {
            wgmma_rs_m64k16<typename T::Elem, T::kHeadDim>(acc[m], pa[m][kb], desc_at(pv_desc, kb * 16 * 128));
        }
    }
    wgmma_commit();
}

template <typename T, bool kLocal>
__device__ __forceinline__ void attend_tile_wgmma(const char *frag, const char *q_tile, int tile_start, bool masked,
                                                  const int (&lim)[T::kMTiles][2], const int (&first)[T::kMTiles][2],
                                                  float softcap_log2, const float (&sumq)[T::kMTiles][2],
                                                  float (&row_max)[T::kMTiles][2], float (&row_sum)[T::kMTiles][2],
                                                  float (&row_corr)[T::kMTiles][2],
                                                  float (&acc)[T::kMTiles][T::kHeadDim / 8][4],
                                                  uint32_t (&pa)[T::kMTiles][T::kTileN / 32][4], uint64_t &pv_desc,
                                                  int lane) {
    using Elem = typename T::Elem;
    constexpr int KB = T::kHeadDim / 16, NH = T::kTileN / 16, MT = T::kMTiles;
    // K-major Q and K (8-row groups 1 KB apart), MN-major V (64-element column blocks a tile apart)
    const uint64_t q_desc = smem_desc(static_cast<uint32_t>(__cvta_generic_to_shared(q_tile)), 16, 1024);
    const uint64_t k_desc = smem_desc(static_cast<uint32_t>(__cvta_generic_to_shared(frag + T::kKFragOff)), 16, 1024);
    const uint64_t v_desc =
        smem_desc(static_cast<uint32_t>(__cvta_generic_to_shared(frag + T::kVFragOff)), T::kTileN * 128, 1024);
    #pragma unroll 1
    for (int half = 0; half < 2; ++half) {
        const int t0 = half * (T::kTileN / 2);
        float s[MT][NH][4];  // written by the first k-block's wgmma
        // ---- S = Q K^T: Q rows of m64 tile m (K-major), K tokens t0.. (K-major), 64-element column blocks
        wgmma_fence();
        #pragma unroll
        for (int m = 0; m < MT; ++m) {
            #pragma unroll
            for (int kb = 0; kb < KB; ++kb) {
                const int col = 32 * (kb % 4);  // byte column inside a 64-element block
                const uint64_t da = desc_at(q_desc, (kb / 4) * T::kRows * 128 + 64 * m * 128 + col);
                const uint64_t db = desc_at(k_desc, (kb / 4) * T::kTileN * 128 + t0 * 128 + col);
                if (kb == 0) {
                    wgmma_ss_m64n32k16<Elem, false>(s[m], da, db);
                } else {
                    wgmma_ss_m64n32k16<Elem, true>(s[m], da, db);
                }
            }
        }
        wgmma_commit();
        wgmma_issue_pv<T>(acc, pa, pv_desc);  // the previous half's P V
        wgmma_wait<1>();                      // S is in
        fence_operands(s[0]);
        fence_operands(s[1]);
        softmax_half<T, kLocal>(s, frag, t0, tile_start, masked, lim, first, softcap_log2, sumq, row_max, row_sum,
                                row_corr, acc, pa, lane % 4,
                                [&] {  // (the fences order the compiler's code, not ptxas')
                                    fence_operands(s[0]);
                                    fence_operands(s[1]);
                                    wgmma_wait<0>();
                                    fence_operands(acc[0]);
                                    fence_operands(acc[1]);
                                });
        pv_desc = desc_at(v_desc, t0 * 128);
    }
}

template <typename T>
__device__ __forceinline__ void wgmma_flush_pv(float (&acc)[T::kMTiles][T::kHeadDim / 8][4],
                                               const uint32_t (&pa)[T::kMTiles][T::kTileN / 32][4], uint64_t pv_desc) {
    wgmma_issue_pv<T>(acc, pa, pv_desc);
    wgmma_wait<0>();
}

}  // namespace flash_tq
