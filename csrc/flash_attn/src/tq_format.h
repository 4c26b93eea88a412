// The packed K/V code format on the device side: the mirror of flash_attn_tq/format.py.
//
// Code sequence: 8 groups; group g holds elements 16m + g and 16m + g + 8 (m = 0, 1, ...), the two
// rows a thread owns in each 16-row block of an m16n8k16 fragment. The sequence is packed into
// 16-bit lanes: 2 / 4 / 8 codes a lane at 8 / 4 / 2 bits; at 3 bits, blocks of 16 codes in 3 lanes
// (5 codes a lane at bit 3j, the 16th from the spare bit 15 of the block's lanes).
//
// Unpacking: a 32-bit word whose two 16-bit lanes hold codes at the same bit offsets turns into
// two 16-bit floats magic + code with one shift and one lop3 (mask, OR the magic exponent); 8-bit
// codes in bfloat16 (8 significant bits, 7 stored) go through float32 instead (byte_pair_exact).
// K reads words of lanes (2w, 2w + 1) of one token: a "pair slot" s gives two elements of that
// token. V merges lane l of two consecutive tokens into one word: the same element of both.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flash_tq {

// Element held at code-sequence position n.
template <int kHeadDim>
__host__ __device__ constexpr int seq_element(int n) {
    const int k = n % (kHeadDim / 8);
    return 16 * (k / 2) + n / (kHeadDim / 8) + 8 * (k % 2);
}

// Code-sequence position of code j (j < codes per lane) of lane l.
template <int kBits>
__host__ __device__ constexpr int lane_code_seq(int lane, int j) {
    return kBits == 3 ? 16 * (lane / 3) + 5 * (lane % 3) + j : lane * (16 / kBits) + j;
}

// The (lo, hi) elements of K pair slot s: slot s uses words like the 3-bit block of a lane-merged
// V word (slot r < 15 of a 3-word superblock: word r / 5, code r % 5; slot 15: the spare codes of
// the superblock's two 3-lane blocks); at 2 / 4 bits slot s is code s % (16 / kBits) of word
// s / (16 / kBits).
template <int kBits, int kHeadDim>
__host__ __device__ constexpr int k_pair_element(int s, int hi) {
    if (kBits == 3) {
        const int sb = s / 16, r = s % 16;
        if (r == 15) return seq_element<kHeadDim>(32 * sb + 15 + 16 * hi);
        return seq_element<kHeadDim>(lane_code_seq<3>(6 * sb + 2 * (r / 5) + hi, r % 5));
    }
    constexpr int kPerLane = 16 / kBits;
    return seq_element<kHeadDim>(lane_code_seq<kBits>(2 * (s / kPerLane) + hi, s % kPerLane));
}

// k_pair_element repeats along the slots: element(s + kPeriod, hi) = element(s, hi) + kShift for
// every format (found here at compile time; kPeriod = kSlots and kShift = 0 would mean none). Kernels
// take a thread's elements as a few compile-time values plus a runtime shift instead of computing
// each from scratch (divisions by 3 and 5 a slot: ~2500 integer instructions a warp in the prefill
// epilogue, and the registers that spilled).
template <int kBits, int kHeadDim>
struct PairPeriod {
    static constexpr int kSlots = kHeadDim / 2;  // pair slots of a token (4 threads x kHeadDim / 8)
    __host__ __device__ static constexpr int find() {
        for (int period = 4; period < kSlots; period *= 2) {
            const int shift = k_pair_element<kBits, kHeadDim>(period, 0) - k_pair_element<kBits, kHeadDim>(0, 0);
            bool same = true;
            for (int s = 0; s + period < kSlots; ++s) {
                for (int hi = 0; hi < 2; ++hi) {
                    same = same &&
                           k_pair_element<kBits, kHeadDim>(s + period, hi) - k_pair_element<kBits, kHeadDim>(s, hi) ==
                               shift;
                }
            }
            if (same) return period;
        }
        return kSlots;
    }
    static constexpr int kPeriod = find();
    static constexpr int kShift =
        kPeriod < kSlots ? k_pair_element<kBits, kHeadDim>(kPeriod, 0) - k_pair_element<kBits, kHeadDim>(0, 0) : 0;
};

template <int kBits, int kHeadDim>
struct CodeLayout {
    static_assert(kBits == 2 || kBits == 3 || kBits == 4 || kBits == 8, "2, 3, 4 or 8 bits");
    static constexpr int kBytes = kHeadDim * kBits / 8;
    static constexpr int kWords = kBytes / 4;
    static constexpr int kGroupCodes = kHeadDim / 8;  // codes of one thread group (V)
    // lanes a thread group reads per token for V: its whole 3-lane block at 3 bits
    static constexpr int kGroupLanes = kBits == 3 ? 3 : kGroupCodes * kBits / 16;
    static_assert(kBits != 3 || kHeadDim % 64 == 0, "3-bit groups are whole or half 3-lane blocks");
    __host__ __device__ static constexpr int group_first_lane(int g) {
        return kBits == 3 ? 3 * ((g * kGroupCodes) / 16) : g * kGroupLanes;
    }
    // position of the group's first code inside the words read (nonzero: second half of a 3-bit block)
    __host__ __device__ static constexpr int group_first_code(int g) { return kBits == 3 ? (g * kGroupCodes) % 16 : 0; }
};

// The 16-bit float type the tensor cores take, and its magic number: 1024 in fp16 (10 mantissa
// bits), 128 in bf16 (7 mantissa bits); OR-ing a small integer into the mantissa adds it exactly.
template <typename Elem>
struct Magic;
template <>
struct Magic<__half> {
    static constexpr uint32_t kBits2 = 0x64006400u;
    static constexpr float kValue = 1024.f;
    static constexpr bool kFitsByte = true;  // an 8-bit code fits the mantissa
};
template <>
struct Magic<__nv_bfloat16> {
    static constexpr uint32_t kBits2 = 0x43004300u;
    static constexpr float kValue = 128.f;
    static constexpr bool kFitsByte = false;
};

// Field of a word, in place: (word & (mask in both lanes)) | magic, i.e. magic + code * 2^shift when
// the field sits inside the mantissa. Saves the shift: the 2^shift scale is folded elsewhere.
template <uint32_t kFieldMask, uint32_t kMagic>
__device__ __forceinline__ uint32_t lane_field(uint32_t word) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(word), "n"(kFieldMask * 0x10001u), "n"(kMagic));
    return r;
}

// 3-bit fast path (whole 16-slot blocks): slot j of a word (j < 5) is read at 8^e(j) times its
// value, e(j) = 0,1,2,1,2 (fp16, 10 mantissa bits) or 0,1,0,1,0 (bf16, 7 mantissa bits); the
// spare slot at scale 1. K folds the scale into Q, V into its centering multiply-add.
template <uint32_t kMagic>
__host__ __device__ constexpr int fast_scale_exp(int slot_in_block) {
    constexpr bool kFp16 = kMagic == 0x64006400u;
    if (slot_in_block == 15) return 0;
    const int j = slot_in_block % 5;
    return kFp16 ? (j == 0 ? 0 : (j == 2 || j == 4 ? 2 : 1)) : (j % 2);
}

template <uint32_t kMagic>
__device__ __forceinline__ void word5_fast(uint32_t w, uint32_t *out) {
    if constexpr (kMagic == 0x64006400u) {
        const uint32_t s6 = w >> 6;
        out[0] = lane_field<0x7u, kMagic>(w);
        out[1] = lane_field<0x38u, kMagic>(w);
        out[2] = lane_field<0x1c0u, kMagic>(w);
        out[3] = lane_field<0x38u, kMagic>(s6);
        out[4] = lane_field<0x1c0u, kMagic>(s6);
    } else {
        const uint32_t s6 = w >> 6, s12 = w >> 12;
        out[0] = lane_field<0x7u, kMagic>(w);
        out[1] = lane_field<0x38u, kMagic>(w);
        out[2] = lane_field<0x7u, kMagic>(s6);
        out[3] = lane_field<0x38u, kMagic>(s6);
        out[4] = lane_field<0x7u, kMagic>(s12);
    }
}

// What a raw value holds besides its code: the magic number, except for 8-bit codes in bfloat16,
// which arrive as the exact codes (byte_pair_exact).
template <typename Elem, int kBits>
__host__ __device__ constexpr float raw_magic_value() {
    return (kBits == 8 && !Magic<Elem>::kFitsByte) ? 0.f : Magic<Elem>::kValue;
}

// The bytes at bit `shift` of both lanes as bfloat16x2 of the exact codes (0..255 has 8 significant
// bits, bfloat16's all): each byte into the mantissa of the float 2^23, less 2^23, one conversion.
__device__ __forceinline__ uint32_t byte_pair_exact(uint32_t word, int shift) {
    const uint32_t w = word >> shift;
    const float lo = __uint_as_float(__byte_perm(w, 0x4b000000u, 0x7540)) - 8388608.f;
    const float hi = __uint_as_float(__byte_perm(w, 0x4b000000u, 0x7542)) - 8388608.f;
    const __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&r);
}

template <int kBits, uint32_t kMagic>
__device__ __forceinline__ uint32_t lane_pair(uint32_t word, int shift) {
    constexpr uint32_t kMask = ((1u << kBits) - 1u) * 0x10001u;
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(word >> shift), "n"(kMask), "n"(kMagic));  // (a & b) | c
    return r;
}

// Spare codes of a 3-bit block in lane-merged words (V): bit i of the low / high lane's code is
// bit 15 / 31 of word i.
template <uint32_t kMagic>
__device__ __forceinline__ uint32_t spare_pair_merged(uint32_t w0, uint32_t w1, uint32_t w2) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w0 >> 15), "n"(0x10001u), "n"(kMagic));
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w1 >> 14), "n"(0x20002u), "r"(r));
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w2 >> 13), "n"(0x40004u), "r"(r));
    return r;
}

// Spare codes of the two 3-lane blocks in a K superblock of words (lanes 0..5): the low code's
// bits are bit 15 of lanes 0, 1, 2 (word 0 bits 15, 31, word 1 bit 15), the high code's bit 15
// of lanes 3, 4, 5 (word 1 bit 31, word 2 bits 15, 31).
template <uint32_t kMagic>
__device__ __forceinline__ uint32_t spare_pair_k(uint32_t w0, uint32_t w1, uint32_t w2) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w0 >> 15), "n"(0x1u), "n"(kMagic));
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w0 >> 30), "n"(0x2u), "r"(r));
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w1 >> 13), "n"(0x4u), "r"(r));
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w1 >> 15), "n"(0x10000u), "r"(r));
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w2 << 2), "n"(0x20000u), "r"(r));
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w2 >> 13), "n"(0x40000u), "r"(r));
    return r;
}

// Slot r (compile time) of a 3-bit 3-word block.
template <int R, uint32_t kMagic, bool kMerged>
__device__ __forceinline__ uint32_t block3_pair(const uint32_t (&w)[3]) {
    if constexpr (R == 15) {
        return kMerged ? spare_pair_merged<kMagic>(w[0], w[1], w[2]) : spare_pair_k<kMagic>(w[0], w[1], w[2]);
    } else {
        return lane_pair<3, kMagic>(w[R / 5], 3 * (R % 5));
    }
}

template <int I, uint32_t kMagic, bool kMerged>
__device__ __forceinline__ void block3_half(const uint32_t (&w)[3], bool upper, uint32_t (&out)[8]) {
    if constexpr (I < 8) {
        // lower half: slots 0..7, upper half: slots 8..15 of the block; picked per lane (no divergence)
        if constexpr (I + 8 == 15) {
            const uint32_t a = block3_pair<I, kMagic, kMerged>(w), b = block3_pair<I + 8, kMagic, kMerged>(w);
            out[I] = upper ? b : a;
        } else {
            const uint32_t word = upper ? w[(I + 8) / 5] : w[I / 5];
            const int shift = upper ? 3 * ((I + 8) % 5) : 3 * (I % 5);
            out[I] = lane_pair<3, kMagic>(word, shift);
        }
        block3_half<I + 1, kMagic, kMerged>(w, upper, out);
    }
}

// kCount consecutive slots starting at `first` (a multiple of kCount) of the words at `vec`:
// raw fp16x2 / bf16x2 registers, magic + code * 8^slot_scale_exp (see fast_scale_exp). kMerged: the words are lane-merged V words (3-bit
// spare layout differs). Slots of one 3-bit block come from its 3 words.
template <int kBits, int kCount, uint32_t kMagic, bool kMerged, typename Words>
__device__ __forceinline__ void extract_slots(const Words &vec, int first, uint32_t (&out)[kCount]) {
    if constexpr (kBits == 3) {
        if constexpr (kCount == 16) {  // whole blocks: slot i at scale 8^fast_scale_exp(i)
            const int b = 3 * (first >> 4);
            const uint32_t w[3] = {vec[b], vec[b + 1], vec[b + 2]};
            #pragma unroll
            for (int i = 0; i < 3; ++i) { word5_fast<kMagic>(w[i], out + 5 * i); }
            out[15] = block3_pair<15, kMagic, kMerged>(w);
        } else {
            static_assert(kCount == 8 || kCount == 4, "slot count");
            const int first8 = first & ~7;
            const int b = 3 * (first8 >> 4);
            const uint32_t w[3] = {vec[b], vec[b + 1], vec[b + 2]};
            uint32_t half[8];
            block3_half<0, kMagic, kMerged>(w, (first8 & 8) != 0, half);
            if constexpr (kCount == 8) {
                #pragma unroll
                for (int i = 0; i < 8; ++i) { out[i] = half[i]; }
            } else {
                const bool hi4 = (first & 4) != 0;
                #pragma unroll
                for (int i = 0; i < 4; ++i) { out[i] = hi4 ? half[i + 4] : half[i]; }
            }
        }
    } else {
        constexpr int kPerWord = 16 / kBits;
        #pragma unroll
        for (int i = 0; i < kCount; ++i) {
            const int s = first + i;
            if constexpr (kBits == 8 && kMagic == Magic<__nv_bfloat16>::kBits2) {
                out[i] = byte_pair_exact(vec[s / kPerWord], kBits * (s % kPerWord));
            } else {
                out[i] = lane_pair<kBits, kMagic>(vec[s / kPerWord], kBits * (s % kPerWord));
            }
        }
    }
}

// Scale exponent of slot i of an extract_slots<kBits, kCount> call (nonzero on the 3-bit fast path).
template <int kBits, int kCount, uint32_t kMagic>
__host__ __device__ constexpr int slot_scale_exp(int i) {
    return (kBits == 3 && kCount == 16) ? fast_scale_exp<kMagic>(i % 16) : 0;
}

}  // namespace flash_tq
