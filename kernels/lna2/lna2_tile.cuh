// lna2 v2 family (lna2_v2.cu, lna2_v7.cu): the tile decode as m16n8k16 A fragments, the
// mbarrier/cp.async helpers, B-fragment stores and the route plan of <= 8-row groups.
#pragma once

#include "lna2_api.h"
#include "lna2_common.cuh"

// Timing ablations of variant 4 (variants 10..13): each drops one stage so a benchmark can see
// what that stage costs on the critical path. Their outputs are NOT the MoE op.
enum Ablation : int {
    ABL_NO_DECODE = 1,  // trellis words go into the MMA as they are: no state extraction, no codebook
    ABL_NO_COPY = 2,    // the ring is never filled (stale shared memory): no trellis bytes move
    ABL_NO_DOWN = 4,    // gate/up items and finishers only: no down items, no top-k gather
    // the cluster kernel's start, for v26's launch split (lna2_set_stop; session 29's next step 1):
    // every CTA returns right after its barrier inits (Args::stop 1) or the route plan (2). The
    // stage is read at run time, so the build keeps all of v26's code and registers.
    ABL_STOP = 8,
};

namespace lna2 {

constexpr int GR = 8;  // rows per group: the MMA's N

// ------------------------------------------------------------------------------------------------
// small helpers

// v2's and v7's shared memory holds one pointer-table row per used expert: at most one per routed
// (row, slot) pair, and no more than the table has.
__host__ __device__ inline int ucap_for(int n_experts, int m, int top_k) {
    const int p = m * top_k;
    return p < n_experts ? p : n_experts;
}

// One event of a CTA's optional %globaltimer timeline (Args::trace, thread 0 only): the time and
// (tag + 1) << 8 | ev, tag being a ticket (v2) or a unit (v7), -1 for none.
__device__ __forceinline__ void trace_event(const Args& a, int& nev, int ev, int tag) {
    if (a.trace == nullptr || threadIdx.x != 0 || nev >= TRACE_EVENTS) return;
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    unsigned long long* tr = a.trace + (size_t(blockIdx.x) * TRACE_EVENTS + nev) * 2;
    tr[0] = ns;
    tr[1] = (static_cast<unsigned long long>(tag + 1) << 8) | unsigned(ev);
    nev++;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// The barrier's phase completes once every thread's cp.async copies issued before this have landed.
__device__ __forceinline__ void mbar_arrive_cp(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// Bulk (TMA) copies, sm_90 and later: one instruction moves a contiguous run of bytes (a multiple of
// 16, both ends 16-byte aligned) and completes on an mbarrier by its byte count. Each arming
// arrive declares the bytes it adds to the phase (v7's bulk builds: one per warp, init count 8).
__device__ __forceinline__ void mbar_arm_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}
// Generic-proxy accesses to shared memory (and barrier inits) ordered before later bulk copies.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// A split cluster barrier: arrive (releasing this thread's earlier accesses) now, wait later.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
// An arrive that releases nothing: for a barrier that only says "this CTA's reads of shared memory
// that peers will overwrite (or that goes away when they exit) are done". Each value read was
// consumed, by arithmetic feeding a store that precedes the arrive, so the reads have completed.
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }

// One device-scope acquire-release add: the old value.
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int v) {
    int old;
    asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// Spins are bounded: a protocol bug traps (a launch error the caller sees) instead of hanging the GPU.
constexpr unsigned SPIN_LIMIT = 1u << 26;

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    const uint32_t addr = smem_u32(bar);
    uint32_t done = 0;
    for (unsigned spin = 0;; spin++) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(addr), "r"(parity)
            : "memory");
        if (done) return;
        if (spin > SPIN_LIMIT) __trap();
    }
}

__device__ __forceinline__ uint2 ldcg2(const uint32_t* p) { return __ldcg(reinterpret_cast<const uint2*>(p)); }

// A read-only 8-byte load the compiler keeps where it is written (not sunk into the branch that
// uses it): the finisher's scales are requested before the arrival that decides who finishes.
__device__ __forceinline__ uint2 ld_early(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ void half4(uint2 u, float (&v)[4]) {
    const float2 a = __half22float2(u2h(u.x)), b = __half22float2(u2h(u.y));
    v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}

// The 8 16-bit states of this lane's positions in one tile, from the two words holding its window.
// A state is moved to the top half by a multiply and shifted down, or cut out with one ALU op where
// it sits byte-aligned. The multipliers come from kernel parameters (Args::kmul), which ptxas cannot
// see through: with literal constants it turns every multiply into shift + mask on the ALU pipe,
// which the codebook's lop3 already loads; this way the work is split across the ALU and the
// integer-multiply pipe (kernels/lna2/NOTES.md, "decode instruction mix").
// PRM (K2 only): three multiplies (W << 2, 4, 6, by the same kmul parameters) put every state on a
// byte boundary of W or of one of them, and one byte permute cuts each out: 12 instructions per tile
// instead of 15, 3 of them on the multiply pipe instead of 7.
template <int K, bool PRM = false>
__device__ __forceinline__ void states8(uint32_t wa, uint32_t wb, int sh, const Args& a, uint32_t (&s)[8]) {
    if constexpr (K == 2 && PRM) {
        const uint32_t W = __funnelshift_l(wb, wa, sh);  // state j: bits [14-2j, 30-2j)
        const uint32_t W2 = W * a.kmul[0], W4 = W * a.kmul[1], W6 = W * a.kmul[2];
        s[0] = __byte_perm(W2, 0u, 0x4432);  // bits [16, 32) of W << 2
        s[1] = __byte_perm(W4, 0u, 0x4432);
        s[2] = __byte_perm(W6, 0u, 0x4432);
        s[3] = __byte_perm(W, 0u, 0x4421);   // bits [8, 24)
        s[4] = __byte_perm(W2, 0u, 0x4421);
        s[5] = __byte_perm(W4, 0u, 0x4421);
        s[6] = __byte_perm(W6, 0u, 0x4421);
        s[7] = __byte_perm(W, 0u, 0x4410);   // bits [0, 16)
    } else if constexpr (K == 2) {
        const uint32_t W = __funnelshift_l(wb, wa, sh);  // state j: bits [14-2j, 30-2j)
        s[0] = __umulhi(W * a.kmul[0], a.kmul[7]);       // both on the multiply pipe
#pragma unroll
        for (int j = 1; j < 7; j++)
            if (j != 3) s[j] = (W * a.kmul[j]) >> 16;
        s[3] = __byte_perm(W, 0u, 0x4421);               // bits [8, 24)
        s[7] = W & 0xffffu;
    } else {
        const uint32_t hi = __funnelshift_l(wb, wa, sh);  // stream bits [b0, b0+32)
        const uint32_t lo = wb << sh;                     // stream bits [b0+32, b0+37) on top
        const uint32_t F = __funnelshift_l(lo, hi, 18);   // stream bits [b0+18, b0+50)
        s[0] = hi >> 16;
        s[1] = __umulhi(hi * a.kmul[1], a.kmul[7]);
        s[2] = __umulhi(hi * a.kmul[2], a.kmul[7]);
#pragma unroll
        for (int j = 3; j < 6; j++) s[j] = (hi * a.kmul[j]) >> 16;
        s[6] = F >> 16;
        s[7] = (F * a.kmul[6]) >> 16;
    }
}

// One decoded tile x one B fragment: acc[n][row] += W^T[n][k] x^T[k][row] for this tile's 16 n.
// Lane (g, t) holds positions j = 0..7 of the tile: W[2t][g], W[2t+1][g], W[2t+8][g], W[2t+9][g]
// and the same four rows of column g+8 (exl3-reference §1.2) -- the A fragment of W^T.
template <int CB, bool DUP>
__device__ __forceinline__ void tile_mma_t(const uint32_t (&s)[8], const uint32_t (&b)[4], float (&acc)[4]) {
    if constexpr (CB == CB_MCG && DUP) {
        uint32_t L[8];
#pragma unroll
        for (int j = 0; j < 8; j++) L[j] = lop3_mcg(s[j] * MCG_MULT);
        // virtual k pair (2t, 2t+1) <- real k 2t, (2t+8, 2t+9) <- real k 2t+1 (b[0], b[1] duplicate them)
        mma16816(acc, L[0], L[4], L[1], L[5], b[0], b[1]);
        mma16816(acc, L[2], L[6], L[3], L[7], b[2], b[3]);
    } else {
        const uint32_t a0 = decode_pair<CB>(s[0], s[1]);
        const uint32_t a1 = decode_pair<CB>(s[4], s[5]);
        const uint32_t a2 = decode_pair<CB>(s[2], s[3]);
        const uint32_t a3 = decode_pair<CB>(s[6], s[7]);
        mma16816(acc, a0, a1, a2, a3, b[0], b[1]);
    }
}

// B fragment registers for one k-tile from the stored pair (x[2t], x[2t+1]), (x[2t+8], x[2t+9]).
template <int CB, bool DUP>
__device__ __forceinline__ void b_frag(uint2 v, uint32_t (&b)[4]) {
    if constexpr (CB == CB_MCG && DUP) {
        b[0] = prmt(v.x, v.x, 0x1010);  // (x[2t], x[2t])
        b[1] = prmt(v.x, v.x, 0x3232);  // (x[2t+1], x[2t+1])
        b[2] = prmt(v.y, v.y, 0x1010);
        b[3] = prmt(v.y, v.y, 0x3232);
    } else {
        b[0] = v.x;
        b[1] = v.y;
        b[2] = b[3] = 0;
    }
}

// A warp's share of one ring stage: 8 consecutive n-tiles of one k-tile row.
template <int K, int CB, bool DUP, int ABL = 0, bool PRM = false>
__device__ __forceinline__ void mma_row(const uint32_t* row, const uint32_t (&b)[4], int w0i, int w1i, int sh,
                                        const Args& a, float (&acc)[8][4]) {
    constexpr int WPT = 8 * K;
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        if constexpr ((ABL & ABL_NO_DECODE) != 0) {
            const uint32_t wa = row[nt * WPT + w0i], wb = row[nt * WPT + w1i];
            mma16816(acc[nt], wa, wb, wb, wa, b[0], b[1]);
            if constexpr (CB == CB_MCG && DUP) mma16816(acc[nt], wb, wa, wa, wb, b[2], b[3]);
            continue;
        }
        uint32_t s[8];
        states8<K, PRM>(row[nt * WPT + w0i], row[nt * WPT + w1i], sh, a, s);
        tile_mma_t<CB, DUP>(s, b, acc[nt]);
    }
}

// Where a value of B-fragment order goes: element kk (0..15) of a k-tile for row j.
// Lane L of a Hadamard warp holds kk = 4(L%4) .. 4(L%4)+3 of its k-tile L/4; it writes two words.
__device__ __forceinline__ void store_frag_pairs(uint32_t* tile_base, int j, int lane, const float (&v)[4]) {
    const int q = lane & 3, t0 = 2 * (q & 1), sl = q >> 1;
    const uint2 p = pack4_half(v);
    tile_base[(4 * j + t0) * 2 + sl] = p.x;
    tile_base[(4 * j + t0 + 1) * 2 + sl] = p.y;
}

// acc[nt] of lane (g, t): (n = 16nt + g, rows 2t, 2t+1) and (n = 16nt + g + 8, rows 2t, 2t+1).
__device__ __forceinline__ void write_red(float* red, int rc, const float (&acc)[8][4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int rr = 2 * t - 4 * rc;
    if (rr < 0 || rr >= 4) return;
    float* w = red + warp * 512;
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        const int n = nt * 16 + g;
        w[rr * 128 + n] = acc[nt][0];
        w[(rr + 1) * 128 + n] = acc[nt][1];
        w[rr * 128 + n + 8] = acc[nt][2];
        w[(rr + 1) * 128 + n + 8] = acc[nt][3];
    }
}

// ------------------------------------------------------------------------------------------------
// route plan: every CTA builds the same one; groups of <= 8 rows of one expert

template <class Plan>
__device__ void build_plan(const Args& a, Plan& s, const void** ptr) {
    const int t = threadIdx.x;
    // Every expert's nine pointers are requested before the ids are known (one thread per expert):
    // the unused ones cost an L2 hit each, the used ones arrive with the ids instead of one HBM
    // round trip after them (kernels/lna2/NOTES.md, "serial HBM trips").
    const void* mine[9];
#pragma unroll
    for (int i = 0; i < 9; i++)
        mine[i] = t < a.n_experts ? reinterpret_cast<const void*>(__ldg(a.tables[i] + t)) : nullptr;
    s.mask[t] = 0;
    __syncthreads();
    const int pairs = a.m * a.top_k;
    for (int p = t; p < pairs; p += THREADS) {
        const int e = a.expert_ids[p];
        const bool ok = e >= 0 && e < a.n_experts;
        s.rid[p] = static_cast<int16_t>(ok ? e : -1);
        s.rw[p] = a.weights[p];
        if (ok) atomicOr(&s.mask[e], 1u << (p / a.top_k));
    }
    __syncthreads();
    const int c = t < a.n_experts ? __popc(s.mask[t]) : 0;
    const int used = c > 0;
    const int ng = (c + GR - 1) / GR;
    const int v[3] = {c, ng, used};
    int excl[3];
    block_excl_scan3(v, excl, s.wsum);
    store_groups<GR>(s, t, c, ng, excl);
    if (used) {
#pragma unroll
        for (int i = 0; i < 9; i++) ptr[excl[2] * 9 + i] = mine[i];
    }
    __syncthreads();
}

}  // namespace lna2
