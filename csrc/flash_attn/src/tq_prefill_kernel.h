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
// MMAs (attend_tile_wgmma).
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
    const int bc = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    const int seqlen_k = max(0, min(p.seqlens_k[b], p.max_seqlen_k));
    const int key_start = kLocal && p.leftpad_k != nullptr ? max(0, p.leftpad_k[b]) : 0;
    // The codes' keys [side_sinks, seqlen_k - codes_tail) with a 16-bit side (its sinks and ring are
    // the decode kernel's side pass, run as the launch's last split: run_prefill); causal alignment
    // counts every key. (0 and seqlen_k without one.)
    const int codes_end = max(0, seqlen_k - p.codes_tail);
    auto limit = [&](int r) { return min(codes_end, key_limit(p, seqlen_k, total_rows, r)); };
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
    auto load_tab = [&](int i) {
        if (T::kRope && i < n_mine) {
            constexpr int kRowChunks = D * 2 / 16;
            const int t0 = (tile_begin + i) * T::kTileN;
            char *dst = tabs + (i % 2) * T::kTabStageBytes;
            #pragma unroll
            for (int k = tid; k < T::kTileN * kRowChunks; k += T::kNThreads) {
                const int t = k / kRowChunks, tok = t0 + t;
                const bool valid = tok < p.rope_table_len;
                cp_async<16>(dst + 16 * T::tab_chunk(t, k % kRowChunks),
                             tab_rows + static_cast<int64_t>(valid ? tok : 0) * (D * 2) + 16 * (k % kRowChunks), valid);
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
    if (n_mine > 0) { expand_tile<T>(packed, frags, p.scale_softmax_log2, tid, tabs, center_norm); }
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
                               frags + ((it + 1) % T::kFragBuffers) * T::kFragBytes, p.scale_softmax_log2, tid,
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
    const bool unrotate = rotate && p.num_splits == 1;
    float sign[DJ][2];  // of the lane's columns, times 1 / sqrt(d)
    #pragma unroll
    for (int j = 0; j < DJ; ++j) {
        const float2 s =
            unrotate ? *reinterpret_cast<const float2 *>(p.rot_signs + 8 * j + 2 * c) : make_float2(1.f, 1.f);
        sign[j][0] = s.x * RowMath<D>::kInvSqrtD;
        sign[j][1] = s.y * RowMath<D>::kInvSqrtD;
    }
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
            const float total = row_sum[m][h], inv = total > 0.f ? 1.f / total : 0.f;
            if (unrotate) { fwht_quad_rows<D, 1>(x, lane); }
            #pragma unroll
            for (int j = 0; j < DJ; ++j) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) { x[0][j][e] *= unrotate ? sign[j][e] * inv : inv; }
            }
            const float lse = row_lse(row_max[m][h] == kNegInf ? 0.f : row_max[m][h], total);
            const int i = r / group, hq = hk * group + r % group;
            if (p.num_splits == 1) {
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
                    p.softmax_lse[(static_cast<int64_t>(b) * p.h + hq) * p.seqlen_q + i] = total > 0.f ? lse : INFINITY;
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
        prefill_split_body<T, kLocal>(p);
    }
}

}  // namespace flash_tq
