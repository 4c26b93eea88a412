// K/V loader policies of the decode kernel. A policy owns the shared-memory layout of one warp's
// pipeline stage, the asynchronous copy of a tile of kTileN tokens into it, and the expansion of
// the staged bytes into tensor-core A fragments plus per-token affine (scale, offset) factors.
//
// PackedKV: codes + float16 (scale, offset) per token (flash_attn_tq/format.py). K fragments are
// *raw* (each 16-bit value is kMagicValue + code): scale, offset and the magic number fold into the
// scores. V fragments are code - kVCenter; scale and offset fold into the probabilities. So there
// is no per-element multiply anywhere.
#pragma once

#include "tq_format.h"
#include "tq_params.h"
#include "tq_utils.h"

namespace flash_tq {

template <int kKBits_, int kVBits_, int kHeadDim, typename Elem>
struct PackedKV {
    static constexpr int kKBits = kKBits_, kVBits = kVBits_;
    static constexpr int kTileN = 32;  // tokens per warp tile: one token per lane for the copies
    using KL = CodeLayout<kKBits, kHeadDim>;
    using VL = CodeLayout<kVBits, kHeadDim>;
    static constexpr int kKOff = 0;
    static constexpr int kVOff = kKOff + kTileN * KL::kBytes;
    static constexpr int kKMetaOff = kVOff + kTileN * VL::kBytes;
    static constexpr int kVMetaOff = kKMetaOff + kTileN * 4;
    static constexpr int kStageBytes = kVMetaOff + kTileN * 4;
    static_assert(kKMetaOff % 16 == 0, "stage layout keeps 16-byte alignment");
    static constexpr uint32_t kMagic = Magic<Elem>::kBits2;
    static constexpr float kMagicValue = Magic<Elem>::kValue;
    // V values enter the tensor cores as code - kVCenter (exact small integers): centring keeps the
    // fp32 accumulators near the size of the result over long sequences.
    static constexpr int kVCenter = 1 << (kVBits - 1);
    static constexpr float kVMid = kVCenter - 0.5f;  // middle of the code range
    static constexpr int kSlotsK = kHeadDim / 8;   // K pair slots per (thread, token)
    static constexpr int kGroupCodes = kHeadDim / 8;  // V codes per (thread group, token)

    // Pair slot that virtual MMA columns (2c, 2c+1) + 8 * half of k-block kb map to, for thread c:
    // Q is gathered with the same map (q_element), so q . k needs no permutation anywhere else.
    __device__ static constexpr int q_slot(int c, int kb, int half) { return c * kSlotsK + 2 * kb + half; }
    __device__ static constexpr int q_element(int slot, int hi) { return k_pair_element<kKBits, kHeadDim>(slot, hi); }
    // K slot values come scaled by 8^q_scale_exp(slot): Q is multiplied by 8^-q_scale_exp(slot).
    __device__ static constexpr int q_scale_exp(int slot) { return slot_scale_exp<kKBits, kSlotsK, kMagic>(slot % kSlotsK); }
    // V code k of a thread group comes scaled by 8^v_scale_exp(k).
    __device__ static constexpr int v_scale_exp(int k) { return slot_scale_exp<kVBits, kGroupCodes, kMagic>(k); }

    // Per-lane global addresses of this (kv head, cache row); load_tile adds the token's offset.
    struct Bases {
        const uint8_t *kc, *vc;
        const uint16_t *km, *vm;
    };
    __device__ static Bases bases(const DecodeParams &p, int bc, int hk) {
        const int64_t row = p.block_table != nullptr ? 0 : bc;
        return {p.k_codes + row * p.kc_batch_stride + hk * p.kc_head_stride,
                p.v_codes + row * p.vc_batch_stride + hk * p.vc_head_stride,
                p.k_meta + row * p.km_batch_stride + hk * p.km_head_stride,
                p.v_meta + row * p.vm_batch_stride + hk * p.vm_head_stride};
    }

    template <int kBytes>
    __host__ __device__ static constexpr int chunk() { return kBytes % 16 == 0 ? 16 : (kBytes % 8 == 0 ? 8 : 4); }

    template <int kBytes>
    __device__ static void copy_row(char *dst, const uint8_t *src, bool valid) {
        constexpr int kChunk = chunk<kBytes>();
        #pragma unroll
        for (int j = 0; j < kBytes / kChunk; ++j) { cp_async<kChunk>(dst + j * kChunk, src + j * kChunk, valid); }
    }

    // Lane l copies token tile_start + l (codes and meta of K and V); tokens >= seqlen_k are zero-filled.
    // Offsets are 32 x 32 -> 64-bit products: row and block strides fit in 32 bits (checked on the host).
    __device__ static void load_tile(const DecodeParams &p, const Bases &base, char *stage, int b, int tile_start,
                                     int seqlen_k, int lane) {
        const int t = tile_start + lane;
        const bool valid = t < seqlen_k;
        int row = 0, col = valid ? t : 0;
        if (p.block_table != nullptr) {  // page sizes are powers of two
            row = valid ? p.block_table[b * p.block_table_batch_stride + (t >> p.page_block_shift)] : 0;
            col = valid ? (t & (p.page_block_size - 1)) : 0;
        }
        auto off = [&](int64_t batch_stride, int64_t row_stride) {
            return static_cast<int64_t>(row) * static_cast<int>(batch_stride) + static_cast<int64_t>(col) * static_cast<int>(row_stride);
        };
        copy_row<KL::kBytes>(stage + kKOff + lane * KL::kBytes, base.kc + off(p.kc_batch_stride, p.kc_row_stride), valid);
        copy_row<VL::kBytes>(stage + kVOff + lane * VL::kBytes, base.vc + off(p.vc_batch_stride, p.vc_row_stride), valid);
        cp_async<4>(stage + kKMetaOff + lane * 4, base.km + off(p.km_batch_stride, p.km_row_stride), valid);
        cp_async<4>(stage + kVMetaOff + lane * 4, base.vm + off(p.vm_batch_stride, p.vm_row_stride), valid);
    }

    // Raw K values of token `tok` (in the tile) at thread c's kSlotsK pair slots.
    __device__ static void k_slots(const char *stage, int tok, int c, uint32_t (&out)[kSlotsK]) {
        const uint32_t *vec = reinterpret_cast<const uint32_t *>(stage + kKOff + tok * KL::kBytes);
        extract_slots<kKBits, kSlotsK, kMagic, false>(vec, c * kSlotsK, out);
    }

    // Raw V values of tokens `tok` and `tok + 1` for thread group g: out[2m] holds element 16m + g
    // of both tokens (low half: `tok`), out[2m + 1] element 16m + g + 8. The group's lanes of the
    // two tokens are merged into words with one byte permute per lane.
    __device__ static void v_pair_slots(const char *stage, int tok, int g, uint32_t (&out)[kGroupCodes]) {
        const uint16_t *v0 = reinterpret_cast<const uint16_t *>(stage + kVOff + tok * VL::kBytes) + VL::group_first_lane(g);
        const uint16_t *v1 = v0 + VL::kBytes / 2;
        uint32_t words[VL::kGroupLanes];
        #pragma unroll
        for (int i = 0; i < VL::kGroupLanes; ++i) { words[i] = __byte_perm(v0[i], v1[i], 0x5410); }
        extract_slots<kVBits, kGroupCodes, kMagic, true>(words, VL::group_first_code(g), out);
    }

    // (scale, offset) of token `tok`: value = scale * code + offset.
    __device__ static float2 affine(const char *stage, int meta_off, int tok) {
        const uint32_t bits = *reinterpret_cast<const uint32_t *>(stage + meta_off + tok * 4);
        return make_float2(half_bits_to_float(static_cast<uint16_t>(bits & 0xffffu)),
                           half_bits_to_float(static_cast<uint16_t>(bits >> 16)));
    }
    __device__ static float2 k_affine(const char *stage, int tok) { return affine(stage, kKMetaOff, tok); }
    __device__ static float2 v_affine(const char *stage, int tok) { return affine(stage, kVMetaOff, tok); }
};

}  // namespace flash_tq
