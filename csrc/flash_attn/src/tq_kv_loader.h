// K/V loader policies of the decode kernel (one kernel body, tq_decode_kernel.h, templated on
// them). A policy owns the shared-memory layout of one warp's pipeline stage, the asynchronous copy
// of a tile of kTileN tokens into it, and the expansion of the staged bytes into tensor-core A
// fragments: k_frags (K tile, 16 tokens x 16 d per k-block) and v_frags (V^T tile, 16 d x 16
// tokens), plus, when kAffine, per-token (scale, offset) factors the kernel folds into scores and
// probabilities.
//
// PackedKV: codes + float16 (scale, offset) per token (flash_attn_tq/format.py). K fragments are
// *raw* (each 16-bit value is kKMagicValue + code): scale, offset and the magic number fold into the
// scores. V fragments are code - kVCenter; scale and offset fold into the probabilities. So there
// is no per-element multiply anywhere.
//
// Fp16KV: the same kernel over a float16/bfloat16 cache (our FP16 baseline): tiles staged with
// 16-byte cp.async into an XOR-swizzled layout, fragments read with ldmatrix (K) and ldmatrix.trans
// (V), no affine factors.
#pragma once

#include "tq_format.h"
#include "tq_params.h"
#include "tq_utils.h"

namespace flash_tq {

// How a loader finds a tile's cache rows: kRuntime looks at p.block_table (the prefill kernel),
// kNone has no block table (contiguous cache), kRows takes whole dense tiles' page rows from the
// caller (TilePages below) and looks pages up itself only for the partial last tile; kRows16 is
// kRows for 16-token pages (two a tile), a kernel of its own so that pages of 32+ keep theirs.
enum class Paging { kRuntime, kNone, kRows, kRows16 };
__host__ __device__ constexpr bool rows_given(Paging p) { return p == Paging::kRows || p == Paging::kRows16; }

// Block-table rows of one warp's whole tiles (pages of kSegment tokens or more; a tile spans at most
// two): lane l holds the rows of the warp's tile 32 k + l for chunk k, and chunk k + 1 is read when
// chunk k comes into use, 32 tiles early, so a tile's copies wait on a shuffle instead of a
// dependent global load (16-token pages read inside the copy path were +18% over contiguous).
// kHalves (16-token pages, Paging::kRows16, where half-warp h copies the tile's page h): lane l holds
// the row of half l % 2 of tile 16 k + l / 2, so one shuffle hands every lane its half's row.
template <int kTileN, int kSegment, bool kHalves = false>
struct TilePages {
    static constexpr int kChunkTiles = kHalves ? 16 : 32;
    static constexpr int kPer = kHalves ? 1 : 2;  // rows a lane holds a chunk
    const int *table;                             // this sequence's block-table row
    int first, stride, count, seqlen, shift, page;
    int chunk, cur[kPer], nxt[kPer];

    __device__ void read(int k, int (&out)[kPer], int lane) const {
        const int i = kChunkTiles * k + (kHalves ? lane / 2 : lane);
        const int t = (first + i * stride) * kTileN;
        const bool whole = i < count && t + kTileN <= seqlen;
        if constexpr (kHalves) {
            out[0] = whole ? __ldg(table + ((t + (lane & 1) * kSegment) >> shift)) : 0;
        } else {
            out[0] = whole ? __ldg(table + (t >> shift)) : 0;
            out[1] = whole && page < kTileN ? __ldg(table + ((t + kSegment) >> shift)) : out[0];
        }
    }
    // tiles first + i * stride (i < count) of sequence b, seqlen tokens
    __device__ void start(const DecodeParams &p, int b, int first_, int stride_, int count_, int seqlen_, int lane) {
        table = p.block_table + b * p.block_table_batch_stride;
        first = first_, stride = stride_, count = count_, seqlen = seqlen_;
        shift = p.page_block_shift, page = p.page_block_size, chunk = 0;
        read(0, cur, lane);
        read(1, nxt, lane);
    }
    // Rows of the warp's tile i (kHalves: rows[0] = the lane's half's); calls come for i = 0, 1, 2, ...
    // (warp-uniform).
    __device__ void rows_of(int i, int (&rows)[2], int lane) {
        if (i / kChunkTiles != chunk) {
            #pragma unroll
            for (int j = 0; j < kPer; ++j) { cur[j] = nxt[j]; }
            read(++chunk + 1, nxt, lane);
        }
        if constexpr (kHalves) {
            rows[0] = __shfl_sync(0xffffffffu, cur[0], 2 * (i % kChunkTiles) + lane / kSegment);
        } else {
            rows[0] = __shfl_sync(0xffffffffu, cur[0], i & 31);
            rows[1] = __shfl_sync(0xffffffffu, cur[1], i & 31);
        }
    }
};

// kScaleOnly: the metadata is the float16 scale alone (turbo's norm fit, offset = -mid * scale).
// kStages_: fewer for wide codes sharing a launch with narrow ones (decode_pair_kernel), whose CTAs
// all get the larger shared memory. kTileN_: tokens a warp tile (64: head_dim 64 over long splits,
// wide_tiles in tq_decode_launch.h).
template <int kKBits_, int kVBits_, int kHeadDim, typename Elem, bool kScaleOnly = false, int kStages_ = 3,
          int kTileN_ = 32>
struct PackedKV {
    static constexpr int kKBits = kKBits_, kVBits = kVBits_;
    static constexpr int kMetaBytes = kScaleOnly ? 2 : 4;  // a token's metadata
    static constexpr bool kAffine = true;
    static constexpr int kTileN = kTileN_;  // (64-token tiles at d 128: 3-12% slower)
    static_assert(kTileN == 32 || kTileN == 64, "warp tiles of 32 or 64 tokens");
    static constexpr int kStages = kStages_;  // per-warp cp.async stages: two tiles in flight while one computes
    static constexpr int kSegment = 16;  // smallest page copied as contiguous regions (16-token pages: two a tile)
    using KL = CodeLayout<kKBits, kHeadDim>;
    using VL = CodeLayout<kVBits, kHeadDim>;
    static constexpr int kKOff = 0;
    static constexpr int kVOff = kKOff + kTileN * KL::kBytes;
    static constexpr int kKMetaOff = kVOff + kTileN * VL::kBytes;
    static constexpr int kVMetaOff = kKMetaOff + kTileN * kMetaBytes;
    static constexpr int kStageBytes = kVMetaOff + kTileN * kMetaBytes;
    static_assert(kKMetaOff % 16 == 0, "stage layout keeps 16-byte alignment");
    static constexpr uint32_t kMagic = Magic<Elem>::kBits2;
    // raw value = magic + code (8-bit codes in bfloat16: the code alone, see raw_magic_value)
    static constexpr float kKMagicValue = raw_magic_value<Elem, kKBits>();
    static constexpr float kVMagicValue = raw_magic_value<Elem, kVBits>();
    // V values enter the tensor cores as code - kVCenter (exact small integers): centering keeps the
    // fp32 accumulators near the size of the result over long sequences.
    static constexpr int kVCenter = 1 << (kVBits - 1);
    static constexpr float kVMid = kVCenter - 0.5f;   // middle of the code range
    static constexpr int kSlotsK = kHeadDim / 8;      // K pair slots per (thread, token)
    static constexpr int kGroupCodes = kHeadDim / 8;  // V codes per (thread group, token)

    // Pair slot that virtual MMA columns (2c, 2c+1) + 8 * half of k-block kb map to, for thread c:
    // Q is gathered with the same map (q_element_at), so q . k needs no permutation anywhere else.
    __device__ static constexpr int q_slot(int c, int kb, int half) { return c * kSlotsK + 2 * kb + half; }
    // element hi of slot q_slot(c, kb, half), t = 2 kb + half (k_pair_element): compile-time values
    // and c's shift (PairPeriod)
    __device__ static constexpr int q_element_at(int c, int t, int hi) {
        using P = PairPeriod<kKBits, kHeadDim>;
        if constexpr (kSlotsK % P::kPeriod == 0) {
            return k_pair_element<kKBits, kHeadDim>(t, hi) + c * (kSlotsK / P::kPeriod) * P::kShift;
        } else {  // a period spans n threads' slots: thread c's are slots (c % n) kSlotsK + t of one
            constexpr int n = P::kPeriod / kSlotsK;
            int e = k_pair_element<kKBits, kHeadDim>(t, hi);
            for (int i = 1; i < n; ++i) { e = c % n == i ? k_pair_element<kKBits, kHeadDim>(i * kSlotsK + t, hi) : e; }
            return e + (c / n) * P::kShift;
        }
    }
    // K slot values come scaled by 8^q_scale_exp(slot): Q is multiplied by 8^-q_scale_exp(slot).
    __device__ static constexpr int q_scale_exp(int slot) {
        return slot_scale_exp<kKBits, kSlotsK, kMagic>(slot % kSlotsK);
    }
    // V code k of a thread group comes scaled by 8^v_scale_exp(k).
    __device__ static constexpr int v_scale_exp(int k) { return slot_scale_exp<kVBits, kGroupCodes, kMagic>(k); }

    // Per-lane global addresses of this (kv head, cache row); load_tile adds the token's offset.
    // dense: a tile's rows are adjacent and 16-byte aligned in memory (the head-major cache; pages
    // of at least kSegment tokens), so tiles are copied as contiguous regions of kSegment tokens or more.
    struct Bases {
        const uint8_t *kc, *vc;
        const uint16_t *km, *vm;
        bool dense;
    };
    __device__ static Bases bases(const DecodeParams &p, int bc, int hk) {
        const int64_t row = p.block_table != nullptr ? 0 : bc;
        Bases base{p.k_codes + row * p.kc_batch_stride + hk * p.kc_head_stride,
                   p.v_codes + row * p.vc_batch_stride + hk * p.vc_head_stride,
                   p.k_meta + row * p.km_batch_stride + hk * p.km_head_stride,
                   p.v_meta + row * p.vm_batch_stride + hk * p.vm_head_stride, false};
        auto aligned = [](const void *ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; };
        base.dense = p.kc_row_stride == KL::kBytes && p.vc_row_stride == VL::kBytes &&
                     p.km_row_stride == kMetaBytes / 2 && p.vm_row_stride == kMetaBytes / 2 && aligned(base.kc) &&
                     aligned(base.vc) && aligned(base.km) && aligned(base.vm) &&
                     (p.block_table == nullptr ||
                      (p.page_block_size >= kSegment && p.kc_batch_stride % 16 == 0 && p.vc_batch_stride % 16 == 0 &&
                       p.km_batch_stride % 8 == 0 && p.vm_batch_stride % 8 == 0));
        return base;
    }

    // kBytes contiguous bytes (a multiple of 16, 16-byte aligned) with 16-byte copies, lane-consecutive:
    // each warp instruction reads 512 contiguous bytes, so every sector is requested once.
    template <int kBytes>
    __device__ static void copy_region(char *dst, const void *src, int lane) {
        static_assert(kBytes % 16 == 0, "whole 16-byte chunks");
        #pragma unroll
        for (int c = lane; c < kBytes / 16; c += 32) {
            cp_async<16>(dst + 16 * c, reinterpret_cast<const char *>(src) + 16 * c, true);
        }
    }

    // copy_region over kLanes lanes (part = the lane's index among them)
    template <int kBytes, int kLanes>
    __device__ static void copy_part(char *dst, const void *src, int part) {
        static_assert(kBytes % 16 == 0, "whole 16-byte chunks");
        #pragma unroll
        for (int c = part; c < kBytes / 16; c += kLanes) {
            cp_async<16>(dst + 16 * c, reinterpret_cast<const char *>(src) + 16 * c, true);
        }
    }

    template <int kBytes>
    __host__ __device__ static constexpr int chunk() {
        return kBytes % 16 == 0 ? 16 : (kBytes % 8 == 0 ? 8 : 4);
    }

    template <int kBytes>
    __device__ static void copy_row(char *dst, const uint8_t *src, bool valid) {
        constexpr int kChunk = chunk<kBytes>();
        #pragma unroll
        for (int j = 0; j < kBytes / kChunk; ++j) { cp_async<kChunk>(dst + j * kChunk, src + j * kChunk, valid); }
    }

    // Lane l copies tokens tile_start + l (+ 32) (codes and meta of K and V); tokens >= seqlen_k are zero-filled.
    // Offsets are 32 x 32 -> 64-bit products: row and block strides fit in 32 bits (checked on the host).
    // With Paging::kRows, page_rows are the rows of the tile's first and second kSegment tokens; with
    // kRows16, page_rows[0] is the row of the lane's half's page.
    template <Paging kPaging = Paging::kRuntime>
    __device__ static void load_tile(const DecodeParams &p, const Bases &base, char *stage, int b, int tile_start,
                                     int seqlen_k, int lane, const int (&page_rows)[2] = {0, 0}) {
        // (64-token tiles: contiguous caches, or pages of at least a tile, which wide_tiles checks)
        static_assert(kTileN == 32 || kPaging == Paging::kNone || kPaging == Paging::kRows, "64-token tiles");
        const bool paged = rows_given(kPaging) || (kPaging == Paging::kRuntime && p.block_table != nullptr);
        if (base.dense && tile_start + kTileN <= seqlen_k) {  // a whole tile of adjacent rows (or two halves)
            auto copy_run = [&](auto tokens, int first) {     // `tokens` adjacent rows from tile token `first`
                constexpr int kN = decltype(tokens)::value;
                int row = 0, col = tile_start + first;
                if (paged) {
                    row = kPaging == Paging::kRows
                              ? page_rows[first / kSegment]
                              : p.block_table[b * p.block_table_batch_stride + (col >> p.page_block_shift)];
                    col &= p.page_block_size - 1;
                }
                const int64_t r = row;
                copy_region<kN * KL::kBytes>(stage + kKOff + first * KL::kBytes,
                                             base.kc + r * p.kc_batch_stride + col * KL::kBytes, lane);
                copy_region<kN * VL::kBytes>(stage + kVOff + first * VL::kBytes,
                                             base.vc + r * p.vc_batch_stride + col * VL::kBytes, lane);
                constexpr int kW = kMetaBytes / 2;  // halves a token
                copy_region<kN * kMetaBytes>(stage + kKMetaOff + first * kMetaBytes,
                                             base.km + r * p.km_batch_stride + kW * col, lane);
                copy_region<kN * kMetaBytes>(stage + kVMetaOff + first * kMetaBytes,
                                             base.vm + r * p.vm_batch_stride + kW * col, lane);
            };
            if constexpr (kPaging == Paging::kRows16) {
                // 16-token pages: half-warp h copies page h (the tile's tokens 16h..): one row and
                // one set of addresses a lane, the same 16-byte copies a lane as a whole tile
                const int h = lane / kSegment, hl = lane % kSegment;
                const int64_t r = page_rows[0];  // half h's row (TilePages<..., true>)
                copy_part<kSegment * KL::kBytes, kSegment>(stage + kKOff + h * kSegment * KL::kBytes,
                                                           base.kc + r * p.kc_batch_stride, hl);
                copy_part<kSegment * VL::kBytes, kSegment>(stage + kVOff + h * kSegment * VL::kBytes,
                                                           base.vc + r * p.vc_batch_stride, hl);
                copy_part<kSegment * kMetaBytes, kSegment>(stage + kKMetaOff + h * kSegment * kMetaBytes,
                                                           base.km + r * p.km_batch_stride, hl);
                copy_part<kSegment * kMetaBytes, kSegment>(stage + kVMetaOff + h * kSegment * kMetaBytes,
                                                           base.vm + r * p.vm_batch_stride, hl);
            } else if (!paged || p.page_block_size >= kTileN) {
                copy_run(std::integral_constant<int, kTileN>{}, 0);
            } else {
                copy_run(std::integral_constant<int, kSegment>{}, 0);
                copy_run(std::integral_constant<int, kSegment>{}, kSegment);
            }
            return;
        }
        #pragma unroll
        for (int t0 = 0; t0 < kTileN; t0 += 32) {
            const int l = t0 + lane;
            const int t = tile_start + l;
            const bool valid = t < seqlen_k;
            int row = 0, col = valid ? t : 0;
            if (paged) {  // page sizes are powers of two
                row = valid ? p.block_table[b * p.block_table_batch_stride + (t >> p.page_block_shift)] : 0;
                col = valid ? (t & (p.page_block_size - 1)) : 0;
            }
            auto off = [&](int64_t batch_stride, int64_t row_stride) {
                return static_cast<int64_t>(row) * static_cast<int>(batch_stride) +
                       static_cast<int64_t>(col) * static_cast<int>(row_stride);
            };
            copy_row<KL::kBytes>(stage + kKOff + l * KL::kBytes, base.kc + off(p.kc_batch_stride, p.kc_row_stride),
                                 valid);
            copy_row<VL::kBytes>(stage + kVOff + l * VL::kBytes, base.vc + off(p.vc_batch_stride, p.vc_row_stride),
                                 valid);
            if constexpr (
                kScaleOnly) {  // 2 bytes: below cp.async's smallest copy, a plain load (partial tiles, odd layouts)
                reinterpret_cast<uint16_t *>(stage + kKMetaOff)[l] =
                    valid ? base.km[off(p.km_batch_stride, p.km_row_stride)] : 0;
                reinterpret_cast<uint16_t *>(stage + kVMetaOff)[l] =
                    valid ? base.vm[off(p.vm_batch_stride, p.vm_row_stride)] : 0;
            } else {
                cp_async<4>(stage + kKMetaOff + l * 4, base.km + off(p.km_batch_stride, p.km_row_stride), valid);
                cp_async<4>(stage + kVMetaOff + l * 4, base.vm + off(p.vm_batch_stride, p.vm_row_stride), valid);
            }
        }
    }

    // Raw K values of token `tok` (in the tile) at thread c's kSlotsK pair slots.
    __device__ static void k_slots(const char *stage, int tok, int c, uint32_t (&out)[kSlotsK]) {
        const uint32_t *vec = reinterpret_cast<const uint32_t *>(stage + kKOff + tok * KL::kBytes);
        extract_slots<kKBits, kSlotsK, kMagic, false>(vec, c * kSlotsK, out);
    }

    // Raw V values of token `tok` at thread c's kSlotsK pair slots, as k_slots (the prefill kernel's
    // wgmma path stores V token-major): slot s holds elements v_slot_element(s, 0 / 1).
    __device__ static void v_slots(const char *stage, int tok, int c, uint32_t (&out)[kSlotsK]) {
        const uint32_t *vec = reinterpret_cast<const uint32_t *>(stage + kVOff + tok * VL::kBytes);
        extract_slots<kVBits, kSlotsK, kMagic, false>(vec, c * kSlotsK, out);
    }
    __device__ static constexpr int v_slot_element(int slot, int hi) {
        return k_pair_element<kVBits, kHeadDim>(slot, hi);
    }
    using VPeriod = PairPeriod<kVBits, kHeadDim>;  // (the prefill epilogue's columns)
    __device__ static constexpr int v_slot_scale_exp(int slot) {
        return slot_scale_exp<kVBits, kSlotsK, kMagic>(slot % kSlotsK);
    }

    // Raw V values of tokens `tok` and `tok + 1` for thread group g: out[2m] holds element 16m + g
    // of both tokens (low half: `tok`), out[2m + 1] element 16m + g + 8. The group's lanes of the
    // two tokens are merged into words with one byte permute per lane.
    __device__ static void v_pair_slots(const char *stage, int tok, int g, uint32_t (&out)[kGroupCodes]) {
        const uint16_t *v0 =
            reinterpret_cast<const uint16_t *>(stage + kVOff + tok * VL::kBytes) + VL::group_first_lane(g);
        const uint16_t *v1 = v0 + VL::kBytes / 2;
        uint32_t words[VL::kGroupLanes];
        #pragma unroll
        for (int i = 0; i < VL::kGroupLanes; ++i) { words[i] = __byte_perm(v0[i], v1[i], 0x5410); }
        extract_slots<kVBits, kGroupCodes, kMagic, true>(words, VL::group_first_code(g), out);
    }

    // K A-fragments of the tile's 16-token block mt (raw values, see above).
    __device__ static void k_frags(const char *stage, int mt, int lane, uint32_t (&a)[kHeadDim / 16][4]) {
        const int g = lane / 4, c = lane % 4;
        uint32_t k0[kSlotsK], k1[kSlotsK];
        k_slots(stage, mt * 16 + g, c, k0);
        k_slots(stage, mt * 16 + g + 8, c, k1);
        #pragma unroll
        for (int kb = 0; kb < kHeadDim / 16; ++kb) {
            a[kb][0] = k0[2 * kb];
            a[kb][1] = k1[2 * kb];
            a[kb][2] = k0[2 * kb + 1];
            a[kb][3] = k1[2 * kb + 1];
        }
    }

    // V centering constants: code k of a thread group arrives as magic + code * 8^e; times 8^-e
    // minus (magic * 8^-e + center) gives code - center exactly.
    struct Consts {
        uint32_t v_mul[kGroupCodes], v_add[kGroupCodes];
    };
    __device__ static Consts consts() {
        Consts k;
        #pragma unroll
        for (int i = 0; i < kGroupCodes; ++i) {
            const float down = exp2f(-3.f * v_scale_exp(i));
            k.v_mul[i] = pack2<Elem>(down, down);
            const float bias = -(kVMagicValue * down + kVCenter);
            k.v_add[i] = pack2<Elem>(bias, bias);
        }
        return k;
    }

    // V^T A-fragments (centered codes) of 16-token block mt: d block m in a[m].
    __device__ static void v_frags(const char *stage, const Consts &k, int mt, int lane,
                                   uint32_t (&a)[kHeadDim / 16][4]) {
        const int g = lane / 4, u = mt * 16 + 2 * (lane % 4);
        uint32_t x01[kGroupCodes], x89[kGroupCodes];  // tokens (u, u + 1) and (u + 8, u + 9)
        v_pair_slots(stage, u, g, x01);
        v_pair_slots(stage, u + 8, g, x89);
        #pragma unroll
        for (int m = 0; m < kHeadDim / 16; ++m) {
            a[m][0] = fma2<Elem>(x01[2 * m], k.v_mul[2 * m], k.v_add[2 * m]);
            a[m][1] = fma2<Elem>(x01[2 * m + 1], k.v_mul[2 * m + 1], k.v_add[2 * m + 1]);
            a[m][2] = fma2<Elem>(x89[2 * m], k.v_mul[2 * m], k.v_add[2 * m]);
            a[m][3] = fma2<Elem>(x89[2 * m + 1], k.v_mul[2 * m + 1], k.v_add[2 * m + 1]);
        }
    }

    // (scale, offset) of token `tok`: value = scale * code + offset (scale-only: offset = -mid * scale,
    // mid = (2^bits - 1) / 2, the middle of the code range).
    template <int kBits>
    __device__ static float2 affine(const char *stage, int meta_off, int tok) {
        if constexpr (kScaleOnly) {
            const float scale = half_bits_to_float(*reinterpret_cast<const uint16_t *>(stage + meta_off + tok * 2));
            return make_float2(scale, -0.5f * ((1 << kBits) - 1) * scale);
        } else {
            const uint32_t bits = *reinterpret_cast<const uint32_t *>(stage + meta_off + tok * 4);
            return make_float2(half_bits_to_float(static_cast<uint16_t>(bits & 0xffffu)),
                               half_bits_to_float(static_cast<uint16_t>(bits >> 16)));
        }
    }
    __device__ static float2 k_affine(const char *stage, int tok) { return affine<kKBits>(stage, kKMetaOff, tok); }
    __device__ static float2 v_affine(const char *stage, int tok) { return affine<kVBits>(stage, kVMetaOff, tok); }
};

// A float16/bfloat16 cache [rows, cols, h_k, d] (DecodeParams' k_codes / v_codes point at it; the
// kc_* / vc_* strides are in bytes). Rows of a tile are XOR-swizzled in 16-byte chunks so that both
// the ldmatrix reads and the cp.async writes are free of bank conflicts.
// kStages_: 2 for the FP16 cache (64 KB of pipeline a CTA at d=128: 3 CTAs, 12 warps an SM); 1 for
// the side pass of a packed cache (tq_decode_kernel.h), whose few tiles share a CTA's memory with
// the packed pipeline and must not enlarge it.
template <int kHeadDim, typename Elem, int kStages_ = 2>
struct Fp16KV {
    static constexpr bool kAffine = false;
    static constexpr int kTileN = 16;  // one m16 block a tile: 8 KB of K+V at d=128
    static constexpr int kSegment = kTileN;
    static constexpr int kStages = kStages_;
    static constexpr int kRowBytes = kHeadDim * 2;
    static constexpr int kChunks = kRowBytes / 16;  // 16-byte chunks a token row
    static constexpr int kKOff = 0;
    static constexpr int kVOff = kTileN * kRowBytes;
    static constexpr int kStageBytes = 2 * kTileN * kRowBytes;
    static constexpr float kKMagicValue = 0.f;  // (the raw K values are the values)
    static constexpr int kSlotsK = kHeadDim / 8;
    static_assert(32 % kChunks == 0, "a copy pass covers whole rows");

    // Natural d order: pair slot (c, kb, half) holds elements 16 kb + 8 half + 2c (+1), the A
    // fragment's columns, so Q is gathered in the same order as for PackedKV.
    __device__ static constexpr int q_slot(int c, int kb, int half) { return c * kSlotsK + 2 * kb + half; }
    __device__ static constexpr int q_element_at(int c, int t, int hi) {
        return 16 * (t / 2) + 8 * (t % 2) + 2 * c + hi;
    }
    __device__ static constexpr int q_scale_exp(int) { return 0; }

    // Physical chunk of logical chunk `chunk` of token `tok`: a bijection of tok % 8 XOR-ed into the
    // low 3 bits, so 8 consecutive tokens (ldmatrix) and the (token, chunk) pairs of an 8-lane
    // phase land in 8 different bank groups.
    __device__ static int swizzle(int tok, int chunk) { return chunk ^ (((tok & 1) << 2) | ((tok >> 1) & 3)); }

    // a (kv head, cache row)'s K and V rows, and the strides (bytes) load_tile walks
    struct Bases {
        const uint8_t *k, *v;
        int64_t k_batch, k_row, v_batch, v_row;
    };
    __device__ static Bases bases(const DecodeParams &p, int bc, int hk) {
        const int64_t row = p.block_table != nullptr ? 0 : bc;
        return {p.k_codes + row * p.kc_batch_stride + hk * p.kc_head_stride,
                p.v_codes + row * p.vc_batch_stride + hk * p.vc_head_stride,
                p.kc_batch_stride,
                p.kc_row_stride,
                p.vc_batch_stride,
                p.vc_row_stride};
    }
    // the 16-bit side of a packed cache (DecodeParams::side_k): sequence row bc, never paged
    __device__ static Bases side_bases(const DecodeParams &p, int bc, int hk) {
        const int64_t off = (bc * p.side_batch_stride + hk * p.side_head_stride) * static_cast<int64_t>(sizeof(Elem));
        const int64_t row = p.side_row_stride * static_cast<int64_t>(sizeof(Elem));
        return {reinterpret_cast<const uint8_t *>(p.side_k) + off,
                reinterpret_cast<const uint8_t *>(p.side_v) + off,
                0,
                row,
                0,
                row};
    }

    // Lane l resolves the (row, col) of token tile_start + l % kTileN once; each copy pass moves
    // 32 / kChunks tokens' rows, one 16-byte chunk a lane, a token's lanes reading its row in order.
    // (Paging::kRows looks pages up per lane here: this baseline is not tuned for paged caches.)
    template <Paging kPaging = Paging::kRuntime>
    __device__ static void load_tile(const DecodeParams &p, const Bases &base, char *stage, int b, int tile_start,
                                     int seqlen_k, int lane, const int (&)[2] = {0, 0}) {
        const int t = tile_start + lane % kTileN;
        const bool valid = t < seqlen_k;
        int row = 0, col = valid ? t : 0;
        if (rows_given(kPaging) || (kPaging == Paging::kRuntime && p.block_table != nullptr)) {
            row = valid ? p.block_table[b * p.block_table_batch_stride + (t >> p.page_block_shift)] : 0;
            col = valid ? (t & (p.page_block_size - 1)) : 0;
        }
        constexpr int kTokensPerPass = 32 / kChunks;
        const int chunk = lane % kChunks;
        #pragma unroll
        for (int pass = 0; pass < kTileN / kTokensPerPass; ++pass) {
            const int tok = pass * kTokensPerPass + lane / kChunks;
            const int r = __shfl_sync(0xffffffffu, row, tok);
            const int cl = __shfl_sync(0xffffffffu, col, tok);
            const bool ok = __shfl_sync(0xffffffffu, static_cast<int>(valid), tok) != 0;
            const int64_t koff = static_cast<int64_t>(r) * static_cast<int>(base.k_batch) +
                                 static_cast<int64_t>(cl) * static_cast<int>(base.k_row);
            const int64_t voff = static_cast<int64_t>(r) * static_cast<int>(base.v_batch) +
                                 static_cast<int64_t>(cl) * static_cast<int>(base.v_row);
            const int dst = tok * kRowBytes + swizzle(tok, chunk) * 16;
            cp_async<16>(stage + kKOff + dst, base.k + koff + chunk * 16, ok);
            cp_async<16>(stage + kVOff + dst, base.v + voff + chunk * 16, ok);
        }
    }

    struct Consts {};
    __device__ static Consts consts() { return {}; }

    // K A-fragments of the tile's 16-token block mt: matrices (tokens 0-7 | 8-15) x (d chunk 2kb | 2kb + 1).
    __device__ static void k_frags(const char *stage, int mt, int lane, uint32_t (&a)[kHeadDim / 16][4]) {
        const int i = lane / 8, tok = mt * 16 + lane % 8 + 8 * (i & 1);
        const uint32_t row = static_cast<uint32_t>(__cvta_generic_to_shared(stage + kKOff + tok * kRowBytes));
        #pragma unroll
        for (int kb = 0; kb < kHeadDim / 16; ++kb) {
            ldmatrix_x4<false>(a[kb], row + swizzle(tok, 2 * kb + (i >> 1)) * 16);
        }
    }

    // V^T A-fragments of block mt (ldmatrix.trans of token-major rows): matrices
    // (d chunk 2m | 2m + 1) x (tokens 0-7 | 8-15).
    __device__ static void v_frags(const char *stage, const Consts &, int mt, int lane,
                                   uint32_t (&a)[kHeadDim / 16][4]) {
        const int i = lane / 8, tok = mt * 16 + lane % 8 + 8 * (i >> 1);
        const uint32_t row = static_cast<uint32_t>(__cvta_generic_to_shared(stage + kVOff + tok * kRowBytes));
        #pragma unroll
        for (int m = 0; m < kHeadDim / 16; ++m) { ldmatrix_x4<true>(a[m], row + swizzle(tok, 2 * m + (i & 1)) * 16); }
    }
};

}  // namespace flash_tq
