// Small device helpers: tensor-core MMA, register transposes, cp.async, 16-bit float packing.
#pragma once

#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flash_tq {

// D += A (16x16, row) * B (16x8, col), fp32 accumulators.
template <typename Elem>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (std::is_same_v<Elem, __half>) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// a * b + c on two packed 16-bit floats (exact when the result is a small integer).
template <typename Elem>
__device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    if constexpr (std::is_same_v<Elem, __half>) {
        asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    } else {
        asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    }
    return d;
}

// Transpose an 8x8 matrix of 16-bit values held in the MMA accumulator layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

template <typename Elem>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    if constexpr (std::is_same_v<Elem, __half>) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    } else {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
}

template <typename Elem>
__device__ __forceinline__ float2 unpack2(uint32_t x) {
    if constexpr (std::is_same_v<Elem, __half>) {
        return __half22float2(*reinterpret_cast<__half2 *>(&x));
    } else {
        return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 *>(&x));
    }
}

template <typename Elem>
__device__ __forceinline__ float to_float(Elem x) {
    if constexpr (std::is_same_v<Elem, __half>) {
        return __half2float(x);
    } else {
        return __bfloat162float(x);
    }
}

template <typename Elem>
__device__ __forceinline__ Elem from_float(float x) {
    if constexpr (std::is_same_v<Elem, __half>) {
        return __float2half_rn(x);
    } else {
        return __float2bfloat16_rn(x);
    }
}

__device__ __forceinline__ float half_bits_to_float(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }

// Asynchronous global->shared copies of 4, 8 or 16 bytes; `valid == false` writes zeros instead.
template <int kBytes>
__device__ __forceinline__ void cp_async(void *smem, const void *gmem, bool valid) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    const int src_size = valid ? kBytes : 0;
    if constexpr (kBytes == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_size));
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(gmem), "n"(kBytes), "r"(src_size));
    }
}
// Four 8x8 16-bit matrices from shared memory (lanes 8i..8i+7 give matrix i's row addresses).
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
    if constexpr (kTrans) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(smem_addr));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(smem_addr));
    }
}

// Programmatic dependent launch (sm_90; no-ops before it): a kernel lets the stream's next launch
// start while its last CTAs run (launch_dependents: the pack kernel before a decode kernel, a split
// kernel before its combine); that dependent waits for the kernel's end and memory before reading
// what it wrote (wait; at once after a plain launch).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// In-register Walsh-Hadamard butterflies over the index bits h = kFirst, 2 kFirst, ... < kN of x[kN]
// (round-to-nearest adds: the pack kernel matches the reference's order and rounding).
template <int kFirst, int kN>
__device__ __forceinline__ void butterflies(float (&x)[kN]) {
    #pragma unroll
    for (int h = kFirst; h < kN; h *= 2) {
        #pragma unroll
        for (int k = 0; k < kN; ++k) {
            if ((k & h) == 0) {
                const float a = x[k], b = x[k + h];
                x[k] = __fadd_rn(a, b);
                x[k + h] = __fsub_rn(a, b);
            }
        }
    }
}

// Unnormalized Walsh-Hadamard transform of a row of kD floats held by a warp: lane l holds
// elements l * kV + k (kV = kD / 32) in x[k]. Low index bits in registers, high bits by shuffles.
template <int kD>
__device__ __forceinline__ void fwht_warp(float (&x)[kD / 32], int lane) {
    constexpr int kV = kD / 32;
    butterflies<1, kV>(x);
    #pragma unroll
    for (int h = 1; h < 32; h *= 2) {
        #pragma unroll
        for (int k = 0; k < kV; ++k) {
            const float other = __shfl_xor_sync(0xffffffffu, x[k], h);
            x[k] = (lane & h) ? other - x[k] : x[k] + other;
        }
    }
}
// The same for kN rows held a lane quad a row (the prefill kernel's Q rotation and output): lane
// c of a quad holds row elements 8j + 2c + e (the mma.sync accumulator's columns) in x[u][j][e].
// Index bits 0 and 3.. are inside a lane, bits 1-2 across the quad: 2 shuffle stages instead of
// fwht_warp's 5, and 4x fewer shuffles an element; the rows' shuffles of a stage issue together.
template <int kD, int kN>
__device__ __forceinline__ void fwht_quad_rows(float (&x)[kN][kD / 8][2], int lane) {
    #pragma unroll
    for (int u = 0; u < kN; ++u) { butterflies<1, kD / 4>(reinterpret_cast<float (&)[kD / 4]>(x[u])); }
    #pragma unroll
    for (int h = 1; h <= 2; h *= 2) {
        const float sign = (lane & h) ? -1.f : 1.f;  // x + other, or other - x: one FFMA, rounded as the add
        #pragma unroll
        for (int u = 0; u < kN; ++u) {
            #pragma unroll
            for (int j = 0; j < kD / 8; ++j) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float other = __shfl_xor_sync(0xffffffffu, x[u][j][e], h);
                    x[u][j][e] = fmaf(x[u][j][e], sign, other);
                }
            }
        }
    }
}

// kV consecutive 16-bit values as floats / from floats (one 4- or 8-byte access).
template <typename Elem, int kV>
__device__ __forceinline__ void load_row_part(const Elem *src, float (&x)[kV]) {
    static_assert(kV == 2 || kV == 4, "2 or 4 values");
    if constexpr (kV == 4) {
        const uint2 w = *reinterpret_cast<const uint2 *>(src);
        const float2 a = unpack2<Elem>(w.x), b = unpack2<Elem>(w.y);
        x[0] = a.x;
        x[1] = a.y;
        x[2] = b.x;
        x[3] = b.y;
    } else {
        const float2 a = unpack2<Elem>(*reinterpret_cast<const uint32_t *>(src));
        x[0] = a.x;
        x[1] = a.y;
    }
}
template <typename Elem, int kV>
__device__ __forceinline__ void store_row_part(Elem *dst, const float (&x)[kV]) {
    if constexpr (kV == 4) {
        *reinterpret_cast<uint2 *>(dst) = make_uint2(pack2<Elem>(x[0], x[1]), pack2<Elem>(x[2], x[3]));
    } else {
        *reinterpret_cast<uint32_t *>(dst) = pack2<Elem>(x[0], x[1]);
    }
}

__device__ __forceinline__ float warp_max_rows(float x) {  // over the 8 lanes sharing lane % 4
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
__device__ __forceinline__ float warp_sum_rows(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 4);
    x += __shfl_xor_sync(0xffffffffu, x, 8);
    return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

}  // namespace flash_tq
