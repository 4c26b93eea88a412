// key_center='rope' (flash_attn_tq/cache.py): the codes hold k - R(p) c, a key less its kv head's
// center c (the prompt's mean pre-RoPE key) turned by RoPE to the key's position p; the decode
// kernel adds each score's q . R(p) c back with this.
//
// With rotate-half pairs (m, m' = m + D/2) and frequencies theta_m,
//   q . R(p) c = sum_m alpha_m cos(p theta_m) + beta_m sin(p theta_m),
//   alpha_m = q_m c_m + q_m' c_m',  beta_m = q_m' c_m - q_m c_m'.
// For a tile's tokens p = P + tau (tau < kTileN), angle addition moves P into the coefficients,
//   (A_m, B_m) = (alpha_m cos P theta_m + beta_m sin P theta_m, beta_m cos P theta_m - alpha_m sin P theta_m),
// which leaves a product with a table that is the same for every tile:
//   bias[tau] = sum_m A_m cos(tau theta_m) + B_m sin(tau theta_m).
// That is one more m16n8k16 chain a 16-token block (k: the D interleaved (A_m, B_m)), the table the
// A operand (shared memory, in fragment order), the coefficients the B operand. Both operands are
// float16 whatever the query dtype (the table is in [-1, 1]; float16's 11 bits keep the term's error
// near 1e-3 relative, under the 3-bit codes').
//
// A warp's tiles are kStride tokens apart, so with one n8 tile of rows (decode) the coefficients
// stay in float32 registers and turn from tile to tile by the constant angle kStride theta_m:
//   (A, B) <- (A cos + B sin, B cos - A sin),
// four FMAs a pair, the constants in shared memory; every kAnchor tiles they are computed afresh
// (D / 8 sincos a lane), which bounds the float32 drift. With at most 4 rows (GQA groups of 4 or
// less, one query) the n8 tile's other 4 columns would be padding, so they carry the same rows at
// the warp's next tile instead ("paired"): one chain gives two tiles' terms, each lane turns its
// coefficients once every two tiles (by 2 kStride theta_m), and the second tile's columns reach the
// score layout by one shuffle. With more rows (chunks) each tile turns the shared-memory
// (alpha, beta) by its own sincos (tile_bias).
//
// The prefill kernel (256 query rows a CTA) takes the term from the key side instead: the codes'
// domain vector v(p) = H R(p) c / sqrt(D) (turbo's rotation H = WHT diag(signs); R(p) c itself
// without one) added into each expanded K tile, so that q . (k - R(p) c) + q . v(p) comes out of the
// same S = Q K^T. rope_table_kernel writes v(p) / |c| for every key position once a call (rope_table;
// |v| <= |c| elementwise, so the rows fit 16 bits whatever c's size), so a tile costs one table row a
// key to copy and one packed FMA a K pair slot: code - mid + row * |c| / scale. The sum carries
// 16-bit precision relative to the whole key, as an fp16 / bf16 cache would.
#pragma once

#include "tq_params.h"
#include "tq_rows.h"
#include "tq_utils.h"

namespace flash_tq {

// sin and cos of an angle of any size: reduced to [-pi, pi] (2 pi in two parts), then the fast
// intrinsic (accurate there; past it its error grows with the angle)
__device__ __forceinline__ void sincos_any(float a, float &s, float &c) {
    const float turns = rintf(a * 0.159154943f);
    float r = fmaf(-turns, 6.28318548f, a);
    r = fmaf(-turns, -1.74845553e-7f, r);
    __sincosf(r, &s, &c);
}

template <int D, int kTileN, int kNT, int kStride>
struct RopeCenter {
    static constexpr int KB = D / 16;  // k-blocks of the interleaved (A, B) pairs: 8 pairs each
    static constexpr int MT = kTileN / 16;
    static constexpr int kTableBytes = MT * KB * 32 * 16;   // [mt][kb][lane] uint4: A fragments
    static constexpr int kCoeffBytes = kNT * KB * 32 * 16;  // [nt][kb][lane] float4: (alpha, beta) x 2 pairs
    static constexpr int kStepBytes = KB * 4 * 16;  // [kb][lane % 4] float4: (cos, sin) of kStride theta, 2 pairs
    static constexpr int kBytes = kTableBytes + kCoeffBytes + kStepBytes;
    static constexpr bool kRecur = kNT == 1;  // coefficients carried in registers from tile to tile
    static constexpr int kAnchor = 64;        // tiles between exact coefficients (float32 drift ~1e-6 a turn; even)

    // Whether a CTA's rows [row0, total_rows) fit the paired layout (see above).
    static __device__ __forceinline__ bool paired(int row0, int total_rows) { return kRecur && total_rows - row0 <= 4; }

    // Lane l of an m16n8k16 fragment holds pairs m = 8 kb + l % 4 + 4 h (h = 0, 1) of its k-block;
    // the table's A fragment also tokens tau = 16 mt + l / 4 (+ 8).
    static __device__ __forceinline__ int pair_of(int kb, int lane, int h) { return 8 * kb + lane % 4 + 4 * h; }

    // Before the first tile, all the CTA's threads (a barrier follows): the table's fragments, and
    // each query row's (alpha, beta) from q (the RoPE domain, before turbo's rotation) and the
    // center c of (batch entry b, kv head hk). Rows past total_rows get zeros; paired, columns 4-7
    // repeat rows 0-3.
    template <typename Elem, int kRows>
    static __device__ void setup(const DecodeParams &p, int b, int hk, int row0, int total_rows, char *smem, int tid,
                                 int nthreads) {
        const bool pair = paired(row0, total_rows);
        uint4 *table = reinterpret_cast<uint4 *>(smem);
        for (int i = tid; i < MT * KB * 32; i += nthreads) {
            const int lane = i % 32, kb = (i / 32) % KB, tau = (i / (32 * KB)) * 16 + lane / 4;
            uint32_t r[4];
            #pragma unroll
            for (int h = 0; h < 4; ++h) {  // (tau, m), (tau + 8, m), (tau, m + 4), (tau + 8, m + 4)
                float s, co;
                sincos_any(static_cast<float>(tau + 8 * (h & 1)) * __ldg(p.rope_inv_freq + pair_of(kb, lane, h >> 1)),
                           s, co);
                r[h] = pack2<__half>(co, s);
            }
            table[i] = make_uint4(r[0], r[1], r[2], r[3]);
        }
        float4 *coeff = reinterpret_cast<float4 *>(smem + kTableBytes);
        const float *center = p.rope_center + b * p.rope_center_batch_stride + hk * D;
        for (int i = tid; i < kNT * KB * 32; i += nthreads) {
            const int lane = i % 32, kb = (i / 32) % KB, nt = i / (32 * KB);
            const int r = row0 + nt * 8 + (pair ? lane / 4 % 4 : lane / 4);
            float ab[4] = {0.f, 0.f, 0.f, 0.f};
            if (r < total_rows) {
                const Elem *q = q_row_ptr<Elem>(p, b, hk, r);
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int m = pair_of(kb, lane, h);
                    const float qa = to_float(q[m]), qb = to_float(q[m + D / 2]);
                    const float ca = __ldg(center + m), cb = __ldg(center + m + D / 2);
                    ab[2 * h] = qa * ca + qb * cb;
                    ab[2 * h + 1] = qb * ca - qa * cb;
                }
            }
            coeff[i] = make_float4(ab[0], ab[1], ab[2], ab[3]);
        }
        float4 *step = reinterpret_cast<float4 *>(smem + kTableBytes + kCoeffBytes);
        const float turn = static_cast<float>(pair ? 2 * kStride : kStride);  // between a lane's tiles
        for (int i = tid; i < KB * 4; i += nthreads) {
            float s0, c0, s1, c1;
            sincos_any(turn * __ldg(p.rope_inv_freq + pair_of(i / 4, i % 4, 0)), s0, c0);
            sincos_any(turn * __ldg(p.rope_inv_freq + pair_of(i / 4, i % 4, 1)), s1, c1);
            step[i] = make_float4(c0, s0, c1, s1);
        }
    }

    // The coefficients at a tile (kRecur): (A, B) of the lane's pairs h = 0, 1 in each k-block.
    struct State {
        float4 ab[KB];
    };

    // The exact coefficients of the tile starting at key index tile_start (paired: lanes of columns
    // 4-7 those of the warp's next tile).
    static __device__ __forceinline__ void anchor(const DecodeParams &p, const char *smem, int tile_start, bool pair,
                                                  int lane, State &st) {
        const float4 *coeff = reinterpret_cast<const float4 *>(smem + kTableBytes);
        const float pos = static_cast<float>(tile_start + (pair && lane >= 16 ? kStride : 0) + p.rope_offset);
        #pragma unroll
        for (int kb = 0; kb < KB; ++kb) {
            float s[2], co[2];
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                sincos_any(pos * __ldg(p.rope_inv_freq + pair_of(kb, lane, h)), s[h], co[h]);
            }
            const float4 ab = coeff[kb * 32 + lane];
            st.ab[kb] = make_float4(ab.x * co[0] + ab.y * s[0], ab.y * co[0] - ab.x * s[0], ab.z * co[1] + ab.w * s[1],
                                    ab.w * co[1] - ab.z * s[1]);
        }
    }

    // The next tile of the warp (kStride tokens on; paired, two tiles on): each pair turned by the
    // step's angle.
    static __device__ __forceinline__ void advance(const char *smem, int lane, State &st) {
        const float4 *step = reinterpret_cast<const float4 *>(smem + kTableBytes + kCoeffBytes);
        #pragma unroll
        for (int kb = 0; kb < KB; ++kb) {
            const float4 t = step[kb * 4 + lane % 4];
            const float4 ab = st.ab[kb];
            st.ab[kb] = make_float4(ab.x * t.x + ab.y * t.y, ab.y * t.x - ab.x * t.y, ab.z * t.z + ab.w * t.w,
                                    ab.w * t.z - ab.z * t.w);
        }
    }

    // q . R(p) c of a tile from carried coefficients (kRecur; layout as tile_bias).
    static __device__ __forceinline__ void state_bias(const char *smem, const State &st, int lane,
                                                      float (&bias)[MT][kNT][4]) {
        const uint4 *table = reinterpret_cast<const uint4 *>(smem);
        float part[2][MT][4] = {};  // even / odd k-blocks: two independent MMA chains an m-tile (latency)
        #pragma unroll
        for (int kb = 0; kb < KB; ++kb) {
            const uint32_t b0 = pack2<__half>(st.ab[kb].x, st.ab[kb].y), b1 = pack2<__half>(st.ab[kb].z, st.ab[kb].w);
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const uint4 t = table[(mt * KB + kb) * 32 + lane];
                const uint32_t a[4] = {t.x, t.y, t.z, t.w};
                mma_16816<__half>(part[kb % 2][mt], a, b0, b1);
            }
        }
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            #pragma unroll
            for (int j = 0; j < 4; ++j) { bias[mt][0][j] = part[0][mt][j] + part[1][mt][j]; }
        }
    }

    // The term of the warp's it-th tile (kRecur), from key index tile_start: coefficients anchored
    // every kAnchor tiles and turned in between; paired, an odd tile takes what the even one before
    // it left in `next` (its columns 4-7 moved to columns 0-3).
    static __device__ __forceinline__ void recur_bias(const DecodeParams &p, const char *smem, int it, int tile_start,
                                                      bool pair, int lane, State &st, float (&next)[MT][4],
                                                      float (&bias)[MT][kNT][4]) {
        if (pair && (it & 1)) {  // (pair: warp-uniform)
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                #pragma unroll
                for (int j = 0; j < 4; ++j) { bias[mt][0][j] = next[mt][j]; }
            }
            return;
        }
        if (it % kAnchor == 0) {
            anchor(p, smem, tile_start, pair, lane, st);
        } else {
            advance(smem, lane, st);
        }
        state_bias(smem, st, lane, bias);
        if (pair) {
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                #pragma unroll
                for (int j = 0; j < 4; ++j) { next[mt][j] = __shfl_xor_sync(0xffffffffu, bias[mt][0][j], 2); }
            }
        }
    }

    // q . R(p) c of the tile's tokens (from key index tile_start) in the score accumulators' layout:
    // bias[mt][nt][j] is token 16 mt + lane / 4 (+ 8 for j >= 2) and row nt * 8 + 2 (lane % 4) + (j & 1).
    static __device__ __forceinline__ void tile_bias(const DecodeParams &p, const char *smem, int tile_start, int lane,
                                                     float (&bias)[MT][kNT][4]) {
        const uint4 *table = reinterpret_cast<const uint4 *>(smem);
        const float4 *coeff = reinterpret_cast<const float4 *>(smem + kTableBytes);
        const float pos = static_cast<float>(tile_start + p.rope_offset);  // (as the cache's positions: float32)
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            #pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                #pragma unroll
                for (int j = 0; j < 4; ++j) { bias[mt][nt][j] = 0.f; }
            }
        }
        #pragma unroll
        for (int kb = 0; kb < KB; ++kb) {
            float s[2], co[2];
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                sincos_any(pos * __ldg(p.rope_inv_freq + pair_of(kb, lane, h)), s[h], co[h]);
            }
            uint32_t bf[kNT][2];
            #pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                const float4 ab = coeff[(nt * KB + kb) * 32 + lane];
                bf[nt][0] = pack2<__half>(ab.x * co[0] + ab.y * s[0], ab.y * co[0] - ab.x * s[0]);
                bf[nt][1] = pack2<__half>(ab.z * co[1] + ab.w * s[1], ab.w * co[1] - ab.z * s[1]);
            }
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const uint4 t = table[(mt * KB + kb) * 32 + lane];
                const uint32_t a[4] = {t.x, t.y, t.z, t.w};
                #pragma unroll
                for (int nt = 0; nt < kNT; ++nt) { mma_16816<__half>(bias[mt][nt], a, bf[nt][0], bf[nt][1]); }
            }
        }
    }
};

// Whether quad c's K slot i holds elements q_element_at(0, i, hi) + 2c, all in the lane's own set
// {8j + 2c + e} (every format but 3-bit codes at d = 64): then a lane has its slots' values itself.
template <typename KV, int D>
constexpr bool slots_in_lane() {
    for (int c = 0; c < 4; ++c) {
        for (int i = 0; i < KV::kSlotsK; ++i) {
            for (int hi = 0; hi < 2; ++hi) {
                const int e0 = KV::q_element_at(0, i, hi);
                if ((e0 & 6) != 0 || KV::q_element_at(c, i, hi) != e0 + 2 * c) return false;
            }
        }
    }
    return true;
}

// v(p) / |c| of positions [0, rope_table_len) for every (batch entry, kv head): a warp 8 positions, a lane
// quad a position, lane c holding elements 8j + 2c + e (fwht_quad_rows' layout, where the RoPE pair
// m, m + D/2 is in one lane). Rows go out in the loader's K slot order: quad c's slots c kSlotsK + i
// hold elements KV::q_element_at(c, i, 0 / 1) as a 16-bit pair (from the lane's registers, or
// through shared memory where the slots leave the lane's set), so the prefill kernel's expansion
// unit (token, quad c) reads its kSlotsK words as one contiguous run. Only the rows of the entry's
// keys are written, up to its last tile of kTileN (the prefill kernel reads no others): the table is
// sized by the cache's capacity, which may be far past its length.
template <typename Elem, int D, typename KV, int kTileN>
__global__ void __launch_bounds__(128) rope_table_kernel(const DecodeParams p) {
    constexpr int J = D / 8, kSlots = KV::kSlotsK;
    constexpr bool kInLane = slots_in_lane<KV, D>();
    __shared__ float rows[kInLane ? 1 : 4][8][D + 1];  // each warp's 8 positions (odd stride: no bank conflicts)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int b = blockIdx.y / p.h_k, hk = blockIdx.y % p.h_k;
    const int keys = max(0, min(p.seqlens_k[b], p.max_seqlen_k));
    if ((blockIdx.x * 4 + warp) * 8 >= (keys + kTileN - 1) / kTileN * kTileN) return;  // (warp-uniform)
    const int pos = (blockIdx.x * 4 + warp) * 8 + g;
    const float *center = p.rope_center + b * p.rope_center_batch_stride + hk * D;
    const float at = static_cast<float>(pos + p.rope_offset);  // (float32 positions, as the cache's)
    float x[1][J][2], norm = 0.f;
    #pragma unroll
    for (int j = 0; j < J / 2; ++j) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {  // pair (m, m + D/2): R(p) c = (c_m cos - c_m' sin, c_m' cos + c_m sin)
            const int m = 8 * j + 2 * c + e;
            float s, co;
            sincos_any(at * __ldg(p.rope_inv_freq + m), s, co);
            const float ca = __ldg(center + m), cb = __ldg(center + m + D / 2);
            x[0][j][e] = ca * co - cb * s;
            x[0][j + J / 2][e] = cb * co + ca * s;
            norm += ca * ca + cb * cb;
        }
    }
    norm += __shfl_xor_sync(0xffffffffu, norm, 1);
    norm += __shfl_xor_sync(0xffffffffu, norm, 2);
    const float inv_norm = norm > 0.f ? rsqrtf(norm) : 0.f;
    const bool rotate = p.rot_signs != nullptr;
    if (rotate) {
        #pragma unroll
        for (int j = 0; j < J; ++j) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) { x[0][j][e] *= __ldg(p.rot_signs + 8 * j + 2 * c + e); }
        }
        fwht_quad_rows<D, 1>(x, lane);
    }
    const float scale = rotate ? inv_norm * RowMath<D>::kInvSqrtD : inv_norm;
    uint32_t w[kSlots];
    if constexpr (kInLane) {
        #pragma unroll
        for (int i = 0; i < kSlots; ++i) {
            const int e0 = KV::q_element_at(0, i, 0), e1 = KV::q_element_at(0, i, 1);  // (compile-time)
            w[i] = pack2<Elem>(x[0][e0 / 8][e0 % 2] * scale, x[0][e1 / 8][e1 % 2] * scale);
        }
    } else {
        #pragma unroll
        for (int j = 0; j < J; ++j) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) { rows[warp][g][8 * j + 2 * c + e] = x[0][j][e] * scale; }
        }
        __syncwarp();
        #pragma unroll
        for (int i = 0; i < kSlots; ++i) {
            w[i] = pack2<Elem>(rows[warp][g][KV::q_element_at(c, i, 0)], rows[warp][g][KV::q_element_at(c, i, 1)]);
        }
    }
    if (pos >= p.rope_table_len) return;
    uint4 *out = reinterpret_cast<uint4 *>(reinterpret_cast<Elem *>(const_cast<void *>(p.rope_table)) +
                                           (static_cast<int64_t>(blockIdx.y) * p.rope_table_len + pos) * D) +
                 c * (kSlots / 4);
    #pragma unroll
    for (int q = 0; q < kSlots / 4; ++q) { out[q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]); }
}

}  // namespace flash_tq
