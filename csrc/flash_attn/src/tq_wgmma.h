// Hopper warpgroup MMA (wgmma) for the prefill kernel: shared-memory matrix descriptors, the
// fences and the three shapes it issues (S = Q K^T from shared memory, O += P V with P in
// registers). Only compiled into sm_90a code (TQ_WGMMA_ENABLED); elsewhere the calls trap.
//
// Operand tiles live in shared memory in the 128-byte-swizzled layout: rows of 64 16-bit elements
// (128 bytes), 16-byte chunk j of row r stored at chunk j ^ (r % 8), 8-row groups 1024 bytes apart,
// wider rows split into 64-element column blocks (tile_chunk below). The tile bases are
// 1024-byte aligned, so the hardware's swizzle (address bits 4-6 XOR bits 7-9) matches it.
#pragma once

#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TQ_WGMMA_ENABLED 1
#endif

namespace flash_tq {

// Byte offset of 16-byte chunk `chunk` (8 elements) of row r in a swizzled tile of kRowsTotal rows.
template <int kRowsTotal>
__host__ __device__ constexpr int tile_chunk(int r, int chunk) {
    return (chunk / 8) * (kRowsTotal * 128) + r * 128 + 16 * ((chunk % 8) ^ (r % 8));
}

// Descriptor of a 128-byte-swizzled operand at shared address `addr`: lbo / sbo in bytes (K-major:
// sbo = 1024 between 8-row groups, lbo unused; MN-major: lbo between 64-element column blocks,
// sbo between 8-row groups along K).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
           (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

// Descriptor `desc` moved by byte_offset (a multiple of 16; the start-address field does not carry
// into the others for offsets inside shared memory).
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, uint32_t byte_offset) { return desc + (byte_offset >> 4); }

// Pins register values at this point of the program for the compiler (NVVM): values computed before
// stay before, uses after stay after. ptxas schedules the SASS on its own (it moved a
// wgmma.wait_group above exponentials fenced this way); it does keep register uses behind the
// wgmma that writes them.
template <int kN>
__device__ __forceinline__ void fence_operands(float (&x)[kN][4]) {
    #pragma unroll
    for (int i = 0; i < kN; ++i) { asm volatile("" : "+f"(x[i][0]), "+f"(x[i][1]), "+f"(x[i][2]), "+f"(x[i][3])); }
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef TQ_WGMMA_ENABLED
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef TQ_WGMMA_ENABLED
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#ifdef TQ_WGMMA_ENABLED
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// Generic-proxy shared-memory writes (st.shared) made visible to wgmma's reads (async proxy);
// each writing thread runs it before the barrier that publishes the tile.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef TQ_WGMMA_ENABLED
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

#define TQ_ACC4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define TQ_ACC16(d, j) TQ_ACC4(d, j), TQ_ACC4(d, j + 1), TQ_ACC4(d, j + 2), TQ_ACC4(d, j + 3)

#define TQ_OUT4(d, j) "=f"(d[j][0]), "=f"(d[j][1]), "=f"(d[j][2]), "=f"(d[j][3])
#define TQ_OUT16(d, j) TQ_OUT4(d, j), TQ_OUT4(d, j + 1), TQ_OUT4(d, j + 2), TQ_OUT4(d, j + 3)

// d (64 x 32, this warp's 16 rows as four n8 accumulator tiles) = (kAccumulate: d +) A (64 x 16,
// K-major, shared) * B (32 x 16 stored K-major, shared). Without kAccumulate d is only written, so
// nothing has to clear it (a cleared d would be a register write the compiler orders wgmma after).
template <typename Elem, bool kAccumulate>
__device__ __forceinline__ void wgmma_ss_m64n32k16(float (&d)[4][4], uint64_t desc_a, uint64_t desc_b) {
#ifdef TQ_WGMMA_ENABLED
#define TQ_WGMMA_SS(TYPE, SCALE_D, D)                                                                             \
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE                                      \
                 " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, " SCALE_D ", 1, 1, 0, 0;\n" \
                 : D(d, 0)                                                                                        \
                 : "l"(desc_a), "l"(desc_b))
    if constexpr (std::is_same_v<Elem, __half>) {
        if constexpr (kAccumulate) {
            TQ_WGMMA_SS("f16", "1", TQ_ACC16);
        } else {
            TQ_WGMMA_SS("f16", "0", TQ_OUT16);
        }
    } else {
        if constexpr (kAccumulate) {
            TQ_WGMMA_SS("bf16", "1", TQ_ACC16);
        } else {
            TQ_WGMMA_SS("bf16", "0", TQ_OUT16);
        }
    }
#undef TQ_WGMMA_SS
#else
    __trap();
#endif
}

// d (64 x N, this warp's 16 rows as N / 8 n8 tiles) += A (this warp's 16 x 16 in registers, the
// m16n8k16 A-fragment layout) * B (16 x N, MN-major in shared memory: N contiguous), N = 64 or 128.
template <typename Elem, int kN>
__device__ __forceinline__ void wgmma_rs_m64k16(float (&d)[kN / 8][4], const uint32_t (&a)[4], uint64_t desc_b) {
    static_assert(kN == 64 || kN == 128, "the two head dims");
#ifdef TQ_WGMMA_ENABLED
#define TQ_WGMMA_RS64(TYPE)                                                                                            \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE \
                 " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                            \
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31},"                                   \
                 " {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"                                                           \
                 : TQ_ACC16(d, 0), TQ_ACC16(d, 4)                                                                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))
#define TQ_WGMMA_RS128(TYPE)                                                                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE \
                 "." TYPE                                                                                      \
                 " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                    \
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"                            \
                 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"                            \
                 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63},"                           \
                 " {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"                                                   \
                 : TQ_ACC16(d, 0), TQ_ACC16(d, 4), TQ_ACC16(d, 8), TQ_ACC16(d, 12)                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))
    if constexpr (kN == 64) {
        if constexpr (std::is_same_v<Elem, __half>) {
            TQ_WGMMA_RS64("f16");
        } else {
            TQ_WGMMA_RS64("bf16");
        }
    } else {
        if constexpr (std::is_same_v<Elem, __half>) {
            TQ_WGMMA_RS128("f16");
        } else {
            TQ_WGMMA_RS128("bf16");
        }
    }
#undef TQ_WGMMA_RS64
#undef TQ_WGMMA_RS128
#else
    __trap();
#endif
}

#undef TQ_OUT16
#undef TQ_OUT4
#undef TQ_ACC16
#undef TQ_ACC4

}  // namespace flash_tq
