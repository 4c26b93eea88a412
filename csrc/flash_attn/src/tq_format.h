// The packed K/V code format on the device side: the mirror of flash_attn_tq/format.py.
//
// Codes live in little-endian 32-bit words. A *pair slot* holds two codes at the same bit offset
// of the word's low and high 16-bit lanes, so one shift + one lop3 (mask, OR the exponent of a
// "magic" float) gives a 32-bit register of two 16-bit floats equal to kMagicValue + code.
// Pair slot s of a head_dim-D vector holds elements lo = 16 * (s % (D/16)) + s / (D/16), hi = lo + 8.
// 3 bits: 16 slots per 3-word block; slot r < 15 in word r / 5 at bit 3 * (r % 5); slot 15 is made
// of the spare top bit of every lane of the block (bit i of the code = bit 15/31 of word i).
// 2 / 4 bits: 8 / 4 slots per word at bit kBits * (s % slots_per_word).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flash_tq {

template <int kHeadDim>
__host__ __device__ constexpr int pair_lo_element(int slot) {
    return 16 * (slot % (kHeadDim / 16)) + slot / (kHeadDim / 16);
}

template <int kBits, int kHeadDim>
struct CodeLayout {
    static_assert(kBits == 2 || kBits == 3 || kBits == 4, "2, 3 or 4 bits");
    static constexpr int kBytes = kHeadDim * kBits / 8;
    static constexpr int kWords = kBytes / 4;
};

// The 16-bit float type the tensor cores take, and its magic number: 1024 in fp16 (10 mantissa
// bits), 128 in bf16 (7 mantissa bits); OR-ing a small integer into the mantissa adds it exactly.
template <typename Elem> struct Magic;
template <> struct Magic<__half> { static constexpr uint32_t kBits2 = 0x64006400u; static constexpr float kValue = 1024.f; };
template <> struct Magic<__nv_bfloat16> { static constexpr uint32_t kBits2 = 0x43004300u; static constexpr float kValue = 128.f; };

template <int kBits, uint32_t kMagic>
__device__ __forceinline__ uint32_t lane_pair(uint32_t word, int shift) {
    constexpr uint32_t kMask = ((1u << kBits) - 1u) * 0x10001u;
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(word >> shift), "n"(kMask), "n"(kMagic));  // (a & b) | c
    return r;
}

// Slot 15 of a 3-bit block: gather the spare top bit of each lane of the three words.
template <uint32_t kMagic>
__device__ __forceinline__ uint32_t spare_pair(uint32_t w0, uint32_t w1, uint32_t w2) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w0 >> 15), "n"(0x10001u), "n"(kMagic));
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w1 >> 14), "n"(0x20002u), "r"(r));
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(w2 >> 13), "n"(0x40004u), "r"(r));
    return r;
}

// Slot r (compile time) of a 3-bit block whose words are w[0..2].
template <int R, uint32_t kMagic>
__device__ __forceinline__ uint32_t block3_pair(const uint32_t (&w)[3]) {
    if constexpr (R == 15) {
        return spare_pair<kMagic>(w[0], w[1], w[2]);
    } else {
        return lane_pair<3, kMagic>(w[R / 5], 3 * (R % 5));
    }
}

template <int I, int N, uint32_t kMagic>
__device__ __forceinline__ void block3_half(const uint32_t (&w)[3], bool upper, uint32_t (&out)[8]) {
    if constexpr (I < N) {
        // lower half: slots 0..7, upper half: slots 8..15 of the block; pick by lane (no divergence)
        if constexpr (I + 8 == 15) {
            const uint32_t a = block3_pair<I, kMagic>(w), b = block3_pair<I + 8, kMagic>(w);
            out[I] = upper ? b : a;
        } else {
            const uint32_t word = upper ? w[(I + 8) / 5] : w[I / 5];
            const int shift = upper ? 3 * ((I + 8) % 5) : 3 * (I % 5);
            out[I] = lane_pair<3, kMagic>(word, shift);
        }
        block3_half<I + 1, N, kMagic>(w, upper, out);
    }
}

// kCount consecutive pair slots starting at `first` (a multiple of kCount) of one vector whose
// words start at `vec` (shared memory). Writes raw fp16x2/bf16x2 registers (magic + code).
template <int kBits, int kCount, uint32_t kMagic>
__device__ __forceinline__ void extract_slots(const uint32_t *vec, int first, uint32_t (&out)[kCount]) {
    if constexpr (kBits == 3) {
        if constexpr (kCount == 16) {
            const uint32_t *b = vec + 3 * (first >> 4);
            const uint32_t w[3] = {b[0], b[1], b[2]};
            #pragma unroll
            for (int i = 0; i < 15; ++i) { out[i] = lane_pair<3, kMagic>(w[i / 5], 3 * (i % 5)); }
            out[15] = spare_pair<kMagic>(w[0], w[1], w[2]);
        } else {
            static_assert(kCount == 8 || kCount == 4, "slot count");
            const int first8 = first & ~7;
            const uint32_t *b = vec + 3 * (first8 >> 4);
            const uint32_t w[3] = {b[0], b[1], b[2]};
            uint32_t half[8];
            block3_half<0, 8, kMagic>(w, (first8 & 8) != 0, half);
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
            // `first` is a multiple of kCount, so i % kPerWord is the in-word position when
            // kCount >= kPerWord, and (first % kPerWord) + i otherwise
            const int s = first + i;
            out[i] = lane_pair<kBits, kMagic>(vec[s / kPerWord], kBits * (s % kPerWord));
        }
    }
}

}  // namespace flash_tq
