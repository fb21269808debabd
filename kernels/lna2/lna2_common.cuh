// lna2 device helpers shared by the kernel variants: the EXL3 decode arithmetic, the MMA, the
// Hadamard butterflies, loads/stores and the fixed-order top-k gather.
#pragma once

#include "lna2_api.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lna2 {

constexpr unsigned FULL = 0xffffffffu;
constexpr float RSQRT128 = 0.08838834764831845f;
constexpr uint32_t MCG_MULT = 0xCBAC1FEDu;
constexpr uint32_t MUL1_MULT = 0x83DCD12Du;

// ------------------------------------------------------------------------------------------------
// small device helpers

__device__ __forceinline__ uint32_t lop3_mcg(uint32_t x) {
    uint32_t r;
    // (x & 0x8fff8fff) ^ 0x3b603b60: sign and two low exponent bits kept, exponent forced to 12..15
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(r) : "r"(x), "r"(0x8fff8fffu), "r"(0x3b603b60u));
    return r;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ uint32_t h2u(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 u2h(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// Two 16-bit trellis states -> one fp16x2 B-fragment register, bit-exact to the EXL3 codebook.
template <int CB>
__device__ __forceinline__ uint32_t decode_pair(uint32_t s0, uint32_t s1) {
    if constexpr (CB == CB_MCG) {
        __half2 a = u2h(lop3_mcg(s0 * MCG_MULT));
        __half2 b = u2h(lop3_mcg(s1 * MCG_MULT));
        // value = lo + hi with one fp16 rounding. Written this way ptxas emits HADD2 with .H0_H0 /
        // .H1_H1 operand selectors (FMA pipe) and a single PRMT to pack, instead of three PRMTs.
        __half2 va = __hadd2(__low2half2(a), __high2half2(a));
        __half2 vb = __hadd2(__low2half2(b), __high2half2(b));
        return h2u(__lows2half2(va, vb));
    } else {
        uint32_t h0 = __dp4a(s0 * MUL1_MULT, 0x01010101u, 0x6400u);  // fp16 bits of 1024 + bytesum
        uint32_t h1 = __dp4a(s1 * MUL1_MULT, 0x01010101u, 0x6400u);
        __half2 h = u2h(prmt(h0, h1, 0x5410));
        return h2u(__hfma2(h, u2h(0x1eee1eeeu), u2h(0xc931c931u)));
    }
}

__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// In-warp 128-point Walsh-Hadamard (Sylvester order), element 4*lane+i in v[i]; unnormalised.
__device__ __forceinline__ void fwht128(float (&v)[4], int lane) {
    float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
    v[0] = a0 + a2; v[2] = a0 - a2; v[1] = a1 + a3; v[3] = a1 - a3;
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float o = __shfl_xor_sync(FULL, v[i], s);
            v[i] = (lane & s) ? (o - v[i]) : (v[i] + o);
        }
    }
}

__device__ __forceinline__ void load4_half(const __half* p, float (&v)[4]) {
    uint2 u = *reinterpret_cast<const uint2*>(p);
    float2 a = __half22float2(u2h(u.x)), b = __half22float2(u2h(u.y));
    v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}

__device__ __forceinline__ void load4_x(const void* x, int dtype, size_t off, float (&v)[4]) {
    if (dtype == DT_BF16) {
        uint2 u = *reinterpret_cast<const uint2*>(reinterpret_cast<const __nv_bfloat16*>(x) + off);
        float2 a = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u.x));
        float2 b = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u.y));
        v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
    } else {
        load4_half(reinterpret_cast<const __half*>(x) + off, v);
    }
}

// Four 2-byte values (fp16, or bf16 when dtype says so) at p, as floats.
__device__ __forceinline__ void load4_raw(const uint8_t* p, int dtype, float (&v)[4]) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    if (dtype == DT_BF16) {
        float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
        float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
        v[0] = x.x; v[1] = x.y; v[2] = y.x; v[3] = y.y;
    } else {
        float2 x = __half22float2(u2h(u.x)), y = __half22float2(u2h(u.y));
        v[0] = x.x; v[1] = x.y; v[2] = y.x; v[3] = y.y;
    }
}

__device__ __forceinline__ uint2 pack4_half(const float (&v)[4]) {
    uint2 u;
    u.x = h2u(__floats2half2_rn(v[0], v[1]));
    u.y = h2u(__floats2half2_rn(v[2], v[3]));
    return u;
}

// Where lane `lane`'s 8 positions of a tile sit in the tile's 32-bit words: the two words holding
// its window and the bit offset of the window inside the first (exl3-reference §1.3).
template <int K>
__device__ __forceinline__ void lane_window(int lane, int& w0i, int& w1i, int& sh) {
    if (K == 2) {
        w0i = ((lane + 31) >> 1) & 15;  // window starts at bit 16*lane - 16 (mod 512)
        w1i = (w0i + 1) & 15;
        sh = (lane & 1) ? 0 : 16;
    } else {
        const int b0 = 24 * lane + 755;  // (8*lane+1)*3 - 16, mod 768
        w0i = (b0 >> 5) % 24;
        w1i = (w0i + 1) % 24;
        sh = b0 & 31;
    }
}

// The 8 16-bit states of this lane's positions 8*lane .. 8*lane+7 from its two window words.
template <int K>
__device__ __forceinline__ void tile_states(uint32_t a, uint32_t b, int sh, uint32_t (&s)[8]) {
    if (K == 2) {
        const uint32_t W = __funnelshift_l(b, a, sh);
#pragma unroll
        for (int j = 0; j < 8; j++) s[j] = (W >> (14 - 2 * j)) & 0xffffu;
    } else {
        const uint32_t hi = __funnelshift_l(b, a, sh);
        const uint32_t lo = b << sh;
        s[0] = hi >> 16;
#pragma unroll
        for (int j = 1; j < 6; j++) s[j] = (hi >> (16 - 3 * j)) & 0xffffu;
        s[6] = __funnelshift_r(lo, hi, 30) & 0xffffu;
        s[7] = __funnelshift_r(lo, hi, 27) & 0xffffu;
    }
}

// The route plan every CTA builds in shared memory: which rows each expert serves, its entries
// (sorted by expert, then row), and its groups of at most GROUP rows (one MMA tile's rows).
template <int GROUP>
struct RoutePlan {
    uint32_t mask[MAX_EXPERTS];        // rows routed to each expert
    int16_t rbase[MAX_EXPERTS];        // first entry of each expert
    int16_t ubase[MAX_EXPERTS];        // compact index of each used expert
    uint8_t gexp[MAX_PAIRS];           // group -> expert
    uint8_t gnr[MAX_PAIRS];            // group -> rows (1..GROUP)
    int16_t gent[MAX_PAIRS];           // group -> first entry
    uint8_t grows[MAX_PAIRS][GROUP];   // group -> its rows
    int16_t rid[MAX_PAIRS];            // routes [m, top_k]: expert id, or -1 when out of range
    float rw[MAX_PAIRS];               // routing weights [m, top_k]
    int wsum[3][WARPS];                // the scans' per-warp totals
    int ng, gr;                        // groups, entries
};

// Exclusive prefix sums of three per-thread counts over the CTA (one thread per expert in the
// route plans): warp scans, then the warp totals through `wsum` (one barrier inside).
__device__ __forceinline__ void block_excl_scan3(const int (&v)[3], int (&excl)[3], int (&wsum)[3][WARPS]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl[3];
#pragma unroll
    for (int i = 0; i < 3; i++) {
        int x = v[i];
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int y = __shfl_up_sync(FULL, x, d);
            if (lane >= d) x += y;
        }
        incl[i] = x;
        if (lane == 31) wsum[i][warp] = x;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 3; i++) {
        int before = 0;
        for (int w = 0; w < warp; w++) before += wsum[i][w];
        excl[i] = before + incl[i] - v[i];
    }
}

// The route plan's tables for expert t (one thread per expert), once the prefix sums of its row
// count c, group count ng and used flag are known: its first entry, its compact index, and its
// groups of at most GROUP rows (rows ascending), numbered by ascending expert.
template <int GROUP, class Plan>
__device__ __forceinline__ void store_groups(Plan& s, int t, int c, int ng, const int (&excl)[3]) {
    s.rbase[t] = static_cast<int16_t>(excl[0]);
    s.ubase[t] = static_cast<int16_t>(excl[2]);
    if (t == THREADS - 1) {
        s.gr = excl[0] + c;
        s.ng = excl[1] + ng;
    }
    if (c == 0) return;
    for (int i = 0; i < ng; i++) {
        const int g = excl[1] + i;
        s.gexp[g] = static_cast<uint8_t>(t);
        s.gent[g] = static_cast<int16_t>(excl[0] + GROUP * i);
        s.gnr[g] = static_cast<uint8_t>(min(GROUP, c - GROUP * i));
    }
    uint32_t mk = s.mask[t];
    for (int j = 0; mk; j++) {
        const int r = __ffs(mk) - 1;
        mk &= mk - 1;
        s.grows[excl[1] + j / GROUP][j % GROUP] = static_cast<uint8_t>(r);
    }
}

// The finisher's math on one row's 128-block, four values per lane: the summed gate and up
// products back from the Hadamard basis (x svh), DeepSeek-V4's SwiGLU with the clamp before SiLU
// (exl3-reference §2.2), x down suh, and into the down projection's Hadamard basis.
__device__ __forceinline__ void swiglu_rotate(float (&gv)[4], float (&uv)[4], const float (&sg)[4],
                                              const float (&su)[4], const float (&sd)[4], float lim, int lane,
                                              float (&av)[4]) {
    fwht128(gv, lane);
    fwht128(uv, lane);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float gg = fminf(gv[i] * RSQRT128 * sg[i], lim);
        const float uu = fminf(fmaxf(uv[i] * RSQRT128 * su[i], -lim), lim);
        const float silu = gg / (1.f + __expf(-gg));
        av[i] = silu * uu * sd[i];
    }
    fwht128(av, lane);
#pragma unroll
    for (int i = 0; i < 4; i++) av[i] *= RSQRT128;
}

__device__ __forceinline__ void cp16(void* smem_dst, const void* gmem_src) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait(int pending) {
    if (pending <= 0) asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    else asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

// Four consecutive outputs at element offset o, in the caller's output dtype.
__device__ __forceinline__ void store_out4(const Args& a, size_t o, const float4& acc) {
    if (a.out_dtype == DT_F32) {
        *reinterpret_cast<float4*>(reinterpret_cast<float*>(a.out) + o) = acc;
    } else if (a.out_dtype == DT_BF16) {
        uint2 u;
        __nv_bfloat162 p0 = __floats2bfloat162_rn(acc.x, acc.y), p1 = __floats2bfloat162_rn(acc.z, acc.w);
        u.x = *reinterpret_cast<uint32_t*>(&p0);
        u.y = *reinterpret_cast<uint32_t*>(&p1);
        *reinterpret_cast<uint2*>(reinterpret_cast<__nv_bfloat16*>(a.out) + o) = u;
    } else {
        float v[4] = {acc.x, acc.y, acc.z, acc.w};
        *reinterpret_cast<uint2*>(reinterpret_cast<__half*>(a.out) + o) = pack4_half(v);
    }
}

// One output at element offset o, in the caller's output dtype (store_out4's roundings).
__device__ __forceinline__ void store_out1(const Args& a, size_t o, float v) {
    if (a.out_dtype == DT_F32) {
        reinterpret_cast<float*>(a.out)[o] = v;
    } else if (a.out_dtype == DT_BF16) {
        reinterpret_cast<__nv_bfloat16*>(a.out)[o] = __float2bfloat16_rn(v);
    } else {
        reinterpret_cast<__half*>(a.out)[o] = __float2half_rn(v);
    }
}

// Output columns [128 cb, 128 cb + 128) of every row: the routing-weighted sum of the row's top-k
// slots in slot order (no atomics: bitwise repeatable). `y` holds one fp32 row per routed entry;
// with a k-split down projection it holds `nsplit` such partials `split_stride` floats apart, and
// an entry's output is their sum in split order.
template <class Plan>
__device__ void gather_cols(const Args& a, const float* y, const Plan& s, int cb, int nsplit = 1,
                            size_t split_stride = 0) {
    for (int idx = threadIdx.x; idx < a.m * 32; idx += THREADS) {
        const int r = idx >> 5, c = cb * 128 + 4 * (idx & 31);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int k = 0; k < nsplit; k++) {
            const float* yk = y + k * split_stride;
            // all slots' loads are issued together; the sum itself runs in slot order
            float4 v[MAX_TOPK];
            float w[MAX_TOPK];
#pragma unroll
            for (int slot = 0; slot < MAX_TOPK; slot++) {
                const int e = slot < a.top_k ? s.rid[r * a.top_k + slot] : -1;
                w[slot] = e >= 0 ? s.rw[r * a.top_k + slot] : 0.f;
                v[slot] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (e >= 0) {
                    const int ent = s.rbase[e] + __popc(s.mask[e] & ((1u << r) - 1u));
                    v[slot] = __ldcg(reinterpret_cast<const float4*>(yk + size_t(ent) * a.hidden + c));
                }
            }
#pragma unroll
            for (int slot = 0; slot < MAX_TOPK; slot++) {
                if (slot < a.top_k && w[slot] != 0.f) {
                    acc.x += w[slot] * v[slot].x; acc.y += w[slot] * v[slot].y;
                    acc.z += w[slot] * v[slot].z; acc.w += w[slot] * v[slot].w;
                }
            }
        }
        store_out4(a, size_t(r) * a.hidden + c, acc);
    }
}

}  // namespace lna2
