// lna2 v7: the routed-expert MoE decode for small intermediates (the TP8 slice), one thread-block
// cluster per (row group, 128-block of the intermediate).
//
// Why (kernels/lna2/NOTES.md, "Ablations"): at TP8 the v2 family spends most of its time neither
// decoding nor reading weights but in the chain around them: k-split partials through global
// memory, an arrival counter, a finisher that reloads them, a ready flag that down items poll, and
// per-item scheduling. Here a cluster of 8 CTAs owns one unit of work end to end:
//  * CTA r of the cluster takes k-tiles [r K/8, (r+1) K/8) of the unit's gate and up block (8
//    n-tiles each) and output columns [r H/8, (r+1) H/8) of the down projection over the unit's
//    128 intermediate rows; it issues every trellis byte of the unit at once (<= 72 KB), so the
//    weights stream while the route plan is read and x is rotated;
//  * gate/up k-split partials are reduced through distributed shared memory (one cluster barrier),
//    CTA r finishes row r's activation (SwiGLU, rotations) and writes it into every CTA's shared
//    memory (a second cluster barrier): no partials, flags or activations go through global memory;
//  * each CTA writes its down columns for the unit (one fp32 row per entry and intermediate block)
//    and the last unit to arrive on a column slice sums the slice's top-k slots and blocks in a
//    fixed order (bitwise repeatable), as v2 does;
//  * clusters are persistent: a cluster walks units cid, cid + clusters, ...; the next unit's
//    gate/up trellis is requested as soon as this unit's gate/up MMAs are done, its down trellis
//    once the down MMAs are. No CTA ever waits on another cluster, so any residency is safe.
// Unit = (group of <= 8 rows of one expert, intermediate block ib); a down projection over one
// block is a k-split of the whole, so an entry's output is the sum over blocks of its y rows:
// intermediate <= 4 blocks (512), hidden 1024, 2048, 4096 or 8192 (geometry: 1, 2, 4 or 8 128-blocks a CTA).

#include <cooperative_groups.h>

#include <algorithm>
#include <mutex>

#include "lna2_api.h"
#include "lna2_common.cuh"
#include "lna2_tile.cuh"

namespace cg = cooperative_groups;

namespace lna2 {
namespace {

constexpr int C7 = 8;  // CTAs per cluster (the portable maximum: sm_90 and sm_120)
constexpr int EARLY_STEPS = 2;  // BULK: gate/up steps of the first unit requested before x and suh

struct Geo {
    int nblk;  // 128-blocks of the hidden size per CTA: its k-range of gate/up, its down columns
    int kpc;   // gate/up k-tiles per CTA (8 nblk)
    int kpw;   // gate/up k-tiles per warp (4 warps split the CTA's k-range per projection)
    int n_ib;  // intermediate blocks: units per group, y partials per entry
};

__host__ __device__ inline bool geometry(int hidden, int inter, Geo& g) {
    if (hidden <= 0 || inter <= 0 || hidden % (128 * C7) != 0 || inter % 128 != 0) return false;
    g.nblk = hidden / (128 * C7);
    g.kpc = 8 * g.nblk;
    g.kpw = g.kpc / 4;
    g.n_ib = inter / 128;
    return (g.nblk == 1 || g.nblk == 2 || g.nblk == 4 || g.nblk == 8) && g.n_ib <= V2_DOWN_SPLITS;
}

struct Dyn7 {
    int gu, dn, xs, cpart, act, ptr, bar, total;
};

// two_buf (variants 21, 26, 31): two partial buffers, used by alternate units (see V7Kernel's FIN
// and SB).
// Rows per partial buffer for a launch of m rows: GR, or min(GR, m) with RCAP (variant 31). One
// function for the host's layout and the kernel's, which must agree.
__host__ __device__ inline int partial_rows(bool rcap, int m) { return rcap && m < GR ? m : GR; }

// prow (variant 31): rows per partial buffer (partial_rows).
__host__ __device__ inline Dyn7 dyn7_layout(int bits, const Geo& g, int ucap, bool two_buf = false, int prow = GR) {
    const int row = 256 * bits;  // 8 tiles of one k-tile
    Dyn7 d{};
    int off = 0;
    d.gu = off;    off += g.kpw * 8 * row;                 // [step][ksub][proj] rows
    d.dn = off;    off += 8 * g.nblk * row;                // [k-tile of the block][block] rows
    d.xs = off;    off += 2 * g.kpc * 256 > WARPS * 512 * 4 ? 2 * g.kpc * 256 : WARPS * 512 * 4;  // B fragments, later the reduction buffer
    d.cpart = off; off += (two_buf ? 2 : 1) * 2 * prow * 128 * 4;  // this CTA's gate/up partials [buf][proj][row][128]
    d.act = off;   off += 8 * 32 * 2 * 4;                  // the unit's activation, B-fragment order
    off = (off + 15) & ~15;
    d.ptr = off;   off += ucap * 9 * 8;
    off = (off + 15) & ~15;
    d.bar = off;   off += (g.kpw + 1) * 8;                 // one per gate/up step, one for down
    d.total = (off + 15) & ~15;
    return d;
}


struct Plan7 : RoutePlan<GR> {
    int flag;
};

// Trace events (Args::trace, thread 0 of each CTA; the unit rides in the upper bits), for
// scripts/lna2_device.py trace --variant 7.
enum Event7 : int {
    E7_START = 0, E7_PLAN = 1, E7_ROTATED = 2, E7_GU_MMA = 3, E7_PARTIAL = 4, E7_SYNC1 = 5, E7_ACT = 6,
    E7_DN_MMA = 7, E7_Y = 8, E7_ARRIVED = 9, E7_GATHERED = 10, E7_EXIT = 11
};

// ABL: timing ablations (lna2_tile.cuh's Ablation bits; variants 17..19). BULK (variant 9): the
// trellis moves by bulk copies, one per row (each warp requests the rows it consumes) instead of
// 16-byte cp.async from every thread; the first unit requests only its first gate/up steps before
// x and suh are read and the rest once they have landed (with the whole unit's trellis queued
// ahead of them, x and suh took 3.4 us instead of 1.5: NOTES.md, "ablations of v7"); the arrival
// is one acquire-release atomic instead of two SC fences.
// PRM (variant 20, K2): v9 with states8's byte-permute extraction.
// FIN (variant 21): v20 where every CTA finishes every row of the unit itself (warp w, row w) from the
// cluster's partials and keeps the activation in its own shared memory: no remote activation
// stores and no second cluster barrier. The partials alternate between two buffers by unit, so a
// unit's partial write comes after the next unit's cluster barrier, which every CTA reaches only
// after its reads of the previous unit's partials; one split barrier (arrive after the last
// unit's reads, wait before exit) keeps every CTA's shared memory alive while its peers read it.
// EPI (variant 26): the down epilogue's (block, row) tasks are dealt to the warps in turn
// (block = warp mod nblk, so each warp needs one svh vector) by a loop the compiler keeps rolled: at
// one row four warps take one task each instead of two warps two each, through one copy of the
// code instead of four. ncu (session 15 run 2, v24, one row): that phase's unrolled code (1,294
// instructions, ~90 executed per warp) drew 10 % of all stall samples, 8.4 points of them waiting
// on instruction fetch.
// RCAP (variant 31): the partial buffers hold min(GR, m) rows, not GR, so that K3's local-finisher
// build keeps two CTAs per SM up to six rows (its two GR-row buffers cost it the second CTA).
// SB (variant 36, with FIN): one partial buffer instead of two. Each CTA arrives on a split cluster
// barrier once its finisher has read its peers' partials and waits on it before it next writes its
// own, by then a rotation and a gate/up loop later: K3 keeps two CTAs per SM at seven and eight rows
// too (two 8-row buffers and the rest come to 119,864 B a CTA; one leaves 111,672).
// RG (variant 40, with SB): arrivals are counted per (column slice, row), not per slice,
// and whichever unit completes a row on slice r sums that row there at once. The per-slice counter
// left the whole slice to the last unit: at eight rows 1,024 four-column items per CTA, four L2 trips
// per thread after the last arrival (session 18's trace: 5.5 us from the last arrival to the end,
// 1.5 at one and two rows). A row expects (its distinct in-range experts) x n_ib arrivals, counted
// once after the plan (a per-unit count through shared memory cost ~1 us a unit in session 18 run 6);
// rows with none are zeroed by cluster 0 at the end. The counters live in v2's `arr` region (C7 x MAX_ROWS
// ints), which v7 does not otherwise use, and return to zero by their last user.
// FXA (variants 58 on 26, 59 on 46; with EPI): no y rows, arrival counters or gather. Each
// (row, expert, 128-block) contribution to an output element, routing weight applied, goes into
// the element's int64 word (scratch FX_ACC) by one returning atomic add of (fixed point << 6) + 1:
// the low six bits count the arrivals, the rest sums exactly (integer adds commute, so the result is
// bitwise repeatable). The add that brings the count to the row's expected arrivals writes the
// output and zeroes the word. This replaces a release (the y rows' stores acknowledged), an arrival
// atomic and the gather's loads after it, three L2 round trips, by one. A contribution past
// +-FX_LIM (or not finite) turns its element NaN instead of wrapping.
// RLX (variant 46, with SB): the arrive that says "this CTA has read its peers' partials" is relaxed:
// it guards only a later overwrite (SB's wait) and the exit, and the values read were consumed by
// then; a release arrive is a GPU-scope MEMBAR (session 20's SASS), paid once per unit.
// Variants measured against these and retired (27, 37-39, 41-45, 47-49), with their commits and
// figures: kernels/lna2/NOTES.md, "The variants".
// FXA's fixed point: a contribution q = round(c 2^26) (resolution 1.5e-8) for |c| <= 2^17, so
// |q| <= 2^43 and an element's <= 32 contributions (top-k 8 x 4 blocks) sum to <= 2^48; one out of
// range adds 2^50, so a sum past 2^49 says "not representable" (32 of them stay below 2^57, and the
// word's 6-bit shift keeps them inside 63 bits).
constexpr float FX_ONE = 67108864.f;
constexpr float FX_LIM = 131072.f;
constexpr long long FX_BAD = 1ll << 50, FX_BAD_SUM = 1ll << 49;
static_assert(MAX_TOPK * 4 < 64, "an element's arrivals (top-k x <= 4 blocks of a <= 512 intermediate) fit six bits");

template <int K, int CB, bool DUP, int ABL, bool BULK, bool PRM, bool FIN = false, bool EPI = false,
          bool RCAP = false, bool SB = false, bool RG = false, bool RLX = false, bool FXA = false>
struct V7Kernel {
    static_assert(!SB || FIN, "SB's split barrier pairs with the local finisher's arrive, not cluster.sync");
    static_assert(!RLX || SB, "the relaxed arrive is SB's");
    static_assert(!FXA || EPI, "the fixed-point sum is written by the dealt epilogue");
    static constexpr int TILE = 32 * K;  // bytes per tile
    static constexpr int ROW = 8 * TILE;
    static constexpr int PR = ROW / 16;  // 16-byte pieces per row

    const Args& a;
    Plan7& s;
    uint8_t* dyn;
    Geo g;
    Dyn7 D;
    const void** ptr;
    uint64_t* bar;
    int r;    // rank in the cluster
    int nev;  // trace events recorded (thread 0)
    int* rneed = nullptr;  // RG: arrivals each row expects on a slice

    __device__ V7Kernel(const Args& a_, Plan7& s_, uint8_t* dyn_) : a(a_), s(s_), dyn(dyn_) {}

    __device__ void trace(int ev, int unit) { trace_event(a, nev, ev, unit); }

    __device__ const char* P(int gi, int i) const {
        return reinterpret_cast<const char*>(ptr[s.ubase[s.gexp[gi]] * 9 + i]);
    }

    // The unit's gate/up trellis for this CTA's k-range: step st holds k-tile ksub * kpw + st of
    // each warp (ksub, proj), so every warp can start on its first k-tile when step 0 lands.
    // BULK requests steps [st0, st1) only.
    __device__ void issue_gu(int u, int st0 = 0, int st1 = 1 << 30) {
        const int gi = u / g.n_ib, ib = u - gi * g.n_ib;
        const char* src[2] = {P(gi, 0), P(gi, 3)};
        uint8_t* gu = dyn + D.gu;
        if constexpr (BULK) {  // lane st of each warp requests the row the warp itself consumes at step st
            static_assert(PR * 16 == ROW, "a row is whole 16-byte pieces");
            const int st = threadIdx.x & 31, rw = threadIdx.x >> 5;
            if (st >= st0 && st < st1 && st < g.kpw) {
                const int kt = r * g.kpc + (rw >> 1) * g.kpw + st;
                fence_async_smem();
                mbar_arm_tx(bar + st, ROW);
                bulk_g2s(gu + (st * 8 + rw) * ROW, src[rw & 1] + (size_t(kt) * (a.inter / 16) + ib * 8) * TILE, ROW, bar + st);
            }
        } else {
            for (int st = 0; st < g.kpw; st++) {
                for (int p = threadIdx.x; p < 8 * PR; p += THREADS) {
                    const int rw = p / PR, piece = p - rw * PR;
                    const int kt = r * g.kpc + (rw >> 1) * g.kpw + st;
                    if constexpr ((ABL & ABL_NO_COPY) == 0)
                        cp16(gu + (st * 8 + rw) * ROW + piece * 16,
                             src[rw & 1] + (size_t(kt) * (a.inter / 16) + ib * 8) * TILE + piece * 16);
                }
                mbar_arrive_cp(bar + st);
            }
        }
    }

    // The unit's down trellis for this CTA's columns: the block's 8 k-tiles x nblk 8-tile rows.
    __device__ void issue_dn(int u) {
        const int gi = u / g.n_ib, ib = u - gi * g.n_ib;
        const char* src = P(gi, 6);
        if constexpr (BULK) {  // lane 0 of warp w: k-tile w of the block, its nblk rows in one run
            if ((threadIdx.x & 31) == 0) {
                const int kt8 = threadIdx.x >> 5;
                fence_async_smem();
                mbar_arm_tx(bar + g.kpw, g.nblk * ROW);
                bulk_g2s(dyn + D.dn + kt8 * g.nblk * ROW, src + (size_t(ib * 8 + kt8) * (a.hidden / 16) + r * g.kpc) * TILE,
                         g.nblk * ROW, bar + g.kpw);
            }
        } else {
            const int per_kt = g.nblk * PR;
            for (int p = threadIdx.x; p < 8 * per_kt; p += THREADS) {
                const int kt8 = p / per_kt, rest = p - kt8 * per_kt;
                if constexpr ((ABL & ABL_NO_COPY) == 0)
                    cp16(dyn + D.dn + kt8 * g.nblk * ROW + rest * 16,
                         src + (size_t(ib * 8 + kt8) * (a.hidden / 16) + r * g.kpc) * TILE + rest * 16);
            }
            mbar_arrive_cp(bar + g.kpw);
        }
    }

    // x * suh, 128-point Hadamard, into B-fragment order for this CTA's k-range: xs[proj][kt][lane][2].
    // late_u >= 0: each warp requests its rows of unit late_u's remaining trellis as soon as its own
    // x and suh are in (or at once if it has no rotation task).
    __device__ void rotate(int gi, int late_u) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int rows = s.gnr[gi];
        uint32_t* xs = reinterpret_cast<uint32_t*>(dyn + D.xs);
        for (int task = warp; task < 2 * rows * g.nblk; task += WARPS) {
            const int proj = task & 1, rest = task >> 1;
            const int j = rest % rows, b = rest / rows;
            const int k = (r * g.nblk + b) * 128 + 4 * lane;
            float v[4], sc[4];
            load4_x(a.x, a.x_dtype, size_t(s.grows[gi][j]) * a.hidden + k, v);
            load4_half(reinterpret_cast<const __half*>(P(gi, proj ? 4 : 1)) + k, sc);
#pragma unroll
            for (int i = 0; i < 4; i++) v[i] *= sc[i];
            if (BULK && late_u >= 0 && task == warp) {  // the warp's first task: its loads have returned
                issue_gu(late_u, EARLY_STEPS);
                issue_dn(late_u);
            }
            fwht128(v, lane);
#pragma unroll
            for (int i = 0; i < 4; i++) v[i] *= RSQRT128;
            store_frag_pairs(xs + (proj * g.kpc + b * 8 + (lane >> 2)) * 64, j, lane, v);
        }
        if (BULK && late_u >= 0 && warp >= 2 * rows * g.nblk) {
            issue_gu(late_u, EARLY_STEPS);
            issue_dn(late_u);
        }
    }

    // Slice r of the output (blocks r nblk ..): every row's top-k slots, each the sum of its n_ib
    // y rows, in a fixed order (block, then slot), all of one item's loads in flight together.
    __device__ void gather(const float* y) {
        const size_t split = size_t(MAX_PAIRS) * a.hidden;
        const int per_row = g.nblk * 32;
        for (int idx = threadIdx.x; idx < a.m * per_row; idx += THREADS) {
            const int row = idx / per_row, rest = idx - row * per_row;
            gather_item(y, split, row, rest);
        }
    }

    // RG: the rows of group gi whose flag is set (rflag[j] for the group's row j), each over slice r.
    __device__ void gather_rows(const float* y, int gi, const int* rflag, int rows) {
        int n = 0;
        for (int j = 0; j < rows; j++) n += rflag[j];
        const int per_row = g.nblk * 32;
        for (int idx = threadIdx.x; idx < n * per_row; idx += THREADS) {
            int k = idx / per_row, j = 0;
            const int rest = idx - k * per_row;
            for (;; j++)
                if (rflag[j] && k-- == 0) break;
            gather_item(y, size_t(MAX_PAIRS) * a.hidden, s.grows[gi][j], rest);
        }
    }

    // Stop build, stage 4: slice r of every row zero, by a loop of a few instructions (gather's
    // code, cold after an L2 flush, is what the empty launch is suspected to wait on).
    __device__ void zero_slice() {
        const int per_row = g.nblk * 32;
        for (int idx = threadIdx.x; idx < a.m * per_row; idx += THREADS) {
            const int row = idx / per_row, rest = idx - row * per_row;
            store_out4(a, size_t(row) * a.hidden + slice_col(rest), make_float4(0.f, 0.f, 0.f, 0.f));
        }
    }

    // RG: rows with no in-range expert get no arrivals; their slice r is zero.
    __device__ void zero_unrouted_rows() {
        const int per_row = g.nblk * 32;
        for (int idx = threadIdx.x; idx < a.m * per_row; idx += THREADS) {
            const int row = idx / per_row, rest = idx - row * per_row;
            if (rneed[row] == 0)
                store_out4(a, size_t(row) * a.hidden + slice_col(rest), make_float4(0.f, 0.f, 0.f, 0.f));
        }
    }

    // Column quad `rest` (0 .. 32 nblk) of slice r: its first column.
    __device__ __forceinline__ int slice_col(int rest) const { return (r * g.nblk + (rest >> 5)) * 128 + 4 * (rest & 31); }

    // One float4 of output row `row`: column quad `rest` of slice r.
    __device__ __forceinline__ void gather_item(const float* y, size_t split, int row, int rest) {
        const int c = slice_col(rest);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int k0 = 0; k0 < g.n_ib; k0 += 2) {
            float4 v[2][MAX_TOPK];
            float w[MAX_TOPK];
#pragma unroll
            for (int slot = 0; slot < MAX_TOPK; slot++) {
                const int e = slot < a.top_k ? s.rid[row * a.top_k + slot] : -1;
                w[slot] = e >= 0 ? s.rw[row * a.top_k + slot] : 0.f;
                const int ent = e >= 0 ? s.rbase[e] + __popc(s.mask[e] & ((1u << row) - 1u)) : 0;
#pragma unroll
                for (int kk = 0; kk < 2; kk++) {
                    v[kk][slot] = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (e >= 0 && k0 + kk < g.n_ib)
                        v[kk][slot] = __ldcg(reinterpret_cast<const float4*>(
                            y + (k0 + kk) * split + size_t(ent) * a.hidden + c));
                }
            }
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
#pragma unroll
                for (int slot = 0; slot < MAX_TOPK; slot++) {
                    if (slot < a.top_k && w[slot] != 0.f && k0 + kk < g.n_ib) {
                        acc.x += w[slot] * v[kk][slot].x; acc.y += w[slot] * v[kk][slot].y;
                        acc.z += w[slot] * v[kk][slot].z; acc.w += w[slot] * v[kk][slot].w;
                    }
                }
            }
        }
        store_out4(a, size_t(row) * a.hidden + c, acc);
    }

    // FXA: row `row`'s contribution from expert e (its slots' weights summed in slot order) to the
    // 128 columns of a block (lane l holds columns 4l .. 4l + 3 from blk), each a returning atomic
    // on the element's word; the arrival that completes an element stores it and zeroes the word.
    // The values are first turned across the warp so that atomic i of lane l is column 32 i + l:
    // each atomic instruction then covers eight whole 32-byte sectors, not one word in each of 32
    // (session 44's trace: 1.6 us of returning atomics at one row with the 4l layout).
    __device__ __forceinline__ void fx_add(int row, int e, int blk, const float (&v)[4], const float (&sv)[4]) {
        const int lane = threadIdx.x & 31;
        float wt = 0.f;
        for (int sl = 0; sl < a.top_k; sl++)
            if (s.rid[row * a.top_k + sl] == e) wt += s.rw[row * a.top_k + sl];
        float c[4], t[4];
#pragma unroll
        for (int i = 0; i < 4; i++) c[i] = wt != 0.f ? wt * (v[i] * RSQRT128 * sv[i]) : 0.f;  // as the gather: w = 0 adds nothing, even beside inf
#pragma unroll
        for (int i = 0; i < 4; i++) {  // column 32 i + lane sits in lane 8 i + lane / 4, value lane % 4
            const int src = 8 * i + (lane >> 2);
            const float g0 = __shfl_sync(FULL, c[0], src), g1 = __shfl_sync(FULL, c[1], src);
            const float g2 = __shfl_sync(FULL, c[2], src), g3 = __shfl_sync(FULL, c[3], src);
            const int k = lane & 3;
            t[i] = k == 0 ? g0 : k == 1 ? g1 : k == 2 ? g2 : g3;
        }
        const unsigned long long need = static_cast<unsigned long long>(rneed[row]);
        const size_t o = size_t(row) * a.hidden + blk + lane;
        unsigned long long* acc = reinterpret_cast<unsigned long long*>(a.scratch + FX_ACC) + o;
        unsigned long long tot[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const long long q = fabsf(t[i]) <= FX_LIM ? __float2ll_rn(t[i] * FX_ONE) : FX_BAD;
            const unsigned long long add = (static_cast<unsigned long long>(q) << 6) + 1ull;
            tot[i] = atomicAdd(acc + 32 * i, add) + add;
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if ((tot[i] & 63ull) == need) {
                const long long sum = static_cast<long long>(tot[i]) >> 6;
                const bool bad = sum >= FX_BAD_SUM || sum <= -FX_BAD_SUM;
                store_out1(a, o + 32 * i, bad ? __int_as_float(0x7fc00000) : __ll2float_rn(sum) * (1.f / FX_ONE));
                acc[32 * i] = 0ull;  // its last user in this launch; the launch boundary publishes it
            }
        }
    }

    // RG: each row's expected arrivals on a slice (its distinct in-range experts x n_ib), from
    // registers, into shared memory that the unit loop's barriers publish.
    __device__ void count_row_needs() {
        __shared__ int rneed_s[MAX_ROWS];
        rneed = rneed_s;
        const int t = threadIdx.x;
        if (t < a.m) {
            int e[MAX_TOPK];
#pragma unroll
            for (int sl = 0; sl < MAX_TOPK; sl++) e[sl] = sl < a.top_k ? s.rid[t * a.top_k + sl] : -1;
            int need = 0;
#pragma unroll
            for (int sl = 0; sl < MAX_TOPK; sl++) {
                bool seen = e[sl] < 0;
#pragma unroll
                for (int q = 0; q < sl; q++) seen |= e[q] == e[sl];
                need += !seen;
            }
            rneed[t] = need * g.n_ib;  // read after the unit loop's barriers
        }
    }

    __device__ void run() {
        cg::cluster_group cluster = cg::this_cluster();
        const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
        r = static_cast<int>(cluster.block_rank());
        nev = 0;
        trace(E7_START, -1);
        const int cid = blockIdx.x / C7, ncl = gridDim.x / C7;
        geometry(a.hidden, a.inter, g);  // validated by the launch
        const int prow = partial_rows(RCAP, a.m);  // a group has <= min(GR, m) rows
        D = dyn7_layout(K, g, ucap_for(a.n_experts, a.m, a.top_k), FIN && !SB, prow);
        ptr = reinterpret_cast<const void**>(dyn + D.ptr);
        bar = reinterpret_cast<uint64_t*>(dyn + D.bar);
        const LayoutV2 L = make_layout_v2(a.hidden, a.inter);
        float* y = reinterpret_cast<float*>(a.scratch + L.y);
        int* done = reinterpret_cast<int*>(a.scratch + L.done) + r;

        if (t <= g.kpw) {
            mbar_init(bar + t, BULK ? WARPS : THREADS);  // BULK: one arming copy per warp
            if constexpr (BULK) fence_async_smem();
        }
        if constexpr ((ABL & ABL_STOP) != 0) {
            if (a.stop == 1) {
                trace(E7_EXIT, -1);
                return;
            }
        }
        build_plan(a, s, ptr);  // its barriers also publish the mbarrier init
        const int units = s.ng * g.n_ib;
        trace(E7_PLAN, -1);
        if constexpr ((ABL & ABL_STOP) != 0) {
            if (a.stop == 2) {
                trace(E7_EXIT, -1);
                return;
            }
        }
        if (units == 0) {  // nothing routed: cluster 0 writes the zero output
            if constexpr ((ABL & ABL_STOP) != 0) {
                if (a.stop == 4) {  // the stop build's test: zeros stored by a short inline loop
                    if (cid == 0) zero_slice();
                    trace(E7_EXIT, -1);
                    return;
                }
            }
            if (cid == 0) gather(y);
            return;
        }
        if constexpr (RG || FXA) count_row_needs();
        if (cid < units) {
            if constexpr (BULK) {
                issue_gu(cid, 0, EARLY_STEPS);  // the rest, and down, once x and suh have landed (rotate)
            } else {
                issue_gu(cid);
                issue_dn(cid);
            }
        }
        int w0i, w1i, sh;
        lane_window<K>(lane, w0i, w1i, sh);
        float* red = reinterpret_cast<float*>(dyn + D.xs);
        float* cpart0 = reinterpret_cast<float*>(dyn + D.cpart);
        uint32_t* act = reinterpret_cast<uint32_t*>(dyn + D.act);
        const uint32_t* xs = reinterpret_cast<const uint32_t*>(dyn + D.xs);
        const int wpb = WARPS / g.nblk, kpwd = 8 / wpb;  // down: warps per output block, k-tiles per warp

        for (int it = 0, u = cid; u < units; it++, u += ncl) {
            const int gi = u / g.n_ib, ib = u - gi * g.n_ib;
            const int rows = s.gnr[gi], ent0 = s.gent[gi];
            const uint32_t par = it & 1;
            // the finisher's and the down epilogue's scales (cold in HBM) travel during the MMAs
            const int jf = FIN ? warp : r + C7 * warp;  // the row this warp finishes, if any
            float* cpart = cpart0 + (FIN && !SB ? (it & 1) * 2 * prow * 128 : 0);
            uint2 sc[3] = {};
            if (jf < rows) {
                const int col = ib * 128 + 4 * lane;
                sc[0] = ld_early(reinterpret_cast<const __half*>(P(gi, 2)) + col);
                sc[1] = ld_early(reinterpret_cast<const __half*>(P(gi, 5)) + col);
                sc[2] = ld_early(reinterpret_cast<const __half*>(P(gi, 7)) + col);
            }
            uint2 dsv[EPI ? 1 : 4] = {};
            if constexpr (EPI) {  // every task of this warp is on block warp mod nblk (WARPS % nblk == 0)
                dsv[0] = ld_early(reinterpret_cast<const __half*>(P(gi, 8)) + (r * g.nblk + (warp & (g.nblk - 1))) * 128 + 4 * lane);
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int tk = warp + WARPS * i;  // down epilogue task (block tk / 4, row tk % 4)
                    if (tk < 4 * g.nblk)
                        dsv[i] = ld_early(reinterpret_cast<const __half*>(P(gi, 8)) + (r * g.nblk + (tk >> 2)) * 128 + 4 * lane);
                }
            }

            rotate(gi, BULK && it == 0 ? u : -1);
            __syncthreads();
            trace(E7_ROTATED, u);

            // ---- gate/up: warp (proj, ksub) over its kpw k-tiles, 8 n-tiles each
            float acc[8][4];
#pragma unroll
            for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
            {
                const int proj = warp & 1, ksub = warp >> 1;
                for (int st = 0; st < g.kpw; st++) {
                    mbar_wait(bar + st, par);
                    uint32_t b[4];
                    b_frag<CB, DUP>(*reinterpret_cast<const uint2*>(xs + ((proj * g.kpc + ksub * g.kpw + st) * 32 + lane) * 2), b);
                    mma_row<K, CB, DUP, ABL, PRM>(reinterpret_cast<const uint32_t*>(dyn + D.gu + (st * 8 + warp) * ROW), b, w0i,
                                        w1i, sh, a, acc);
                }
            }
            __syncthreads();  // gate/up trellis and xs are free
            trace(E7_GU_MMA, u);
            if (u + ncl < units) issue_gu(u + ncl);
            if constexpr (SB) {
                if (it > 0) cluster_wait();  // every peer has read this CTA's partials of the last unit
            }

            // ---- this CTA's partial over its k-range, per (proj, row), into its own cpart
            for (int rc = 0; rc * 4 < rows; rc++) {
                if (rc) __syncthreads();
                write_red(red, rc, acc);
                __syncthreads();
                const int proj = warp & 1, rr = warp >> 1, j = rc * 4 + rr;
                if (j < rows) {
                    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                    for (int ks = 0; ks < 4; ks++) {
                        const float4 x = *reinterpret_cast<const float4*>(red + (2 * ks + proj) * 512 + rr * 128 + 4 * lane);
                        v.x += x.x; v.y += x.y; v.z += x.z; v.w += x.w;
                    }
                    *reinterpret_cast<float4*>(cpart + (proj * prow + j) * 128 + 4 * lane) = v;
                }
            }
            trace(E7_PARTIAL, u);
            cluster.sync();  // every CTA's partials are visible cluster-wide
            trace(E7_SYNC1, u);

            // ---- finisher: row jf's gate and up summed over the cluster in rank order, SwiGLU,
            // into the down input's Hadamard basis, written into every CTA's activation buffer
            if (jf < rows) {
                float4 pg[C7], pu[C7];
#pragma unroll
                for (int q = 0; q < C7; q++) {
                    const float* rp = cluster.map_shared_rank(cpart, q);
                    pg[q] = *reinterpret_cast<const float4*>(rp + jf * 128 + 4 * lane);
                    pu[q] = *reinterpret_cast<const float4*>(rp + (prow + jf) * 128 + 4 * lane);
                }
                float gv[4] = {0.f, 0.f, 0.f, 0.f}, uv[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int q = 0; q < C7; q++) {
                    gv[0] += pg[q].x; gv[1] += pg[q].y; gv[2] += pg[q].z; gv[3] += pg[q].w;
                    uv[0] += pu[q].x; uv[1] += pu[q].y; uv[2] += pu[q].z; uv[3] += pu[q].w;
                }
                float sg[4], su[4], sd[4], av[4];
                half4(sc[0], sg);
                half4(sc[1], su);
                half4(sc[2], sd);
                swiglu_rotate(gv, uv, sg, su, sd, a.swiglu_limit, lane, av);
                if constexpr (FIN) {
                    store_frag_pairs(act + (lane >> 2) * 64, jf, lane, av);
                } else {
#pragma unroll
                    for (int q = 0; q < C7; q++)
                        store_frag_pairs(cluster.map_shared_rank(act, q) + (lane >> 2) * 64, jf, lane, av);
                }
            }
            if constexpr (FIN) {
                if (SB || u + ncl >= units) {  // this CTA's reads of its peers' partials are done
                    if constexpr (RLX) cluster_arrive_relaxed();
                    else cluster_arrive();
                }
                __syncthreads();                          // the activation is in this CTA
            } else {
                cluster.sync();  // the activation is in every CTA; nobody reads cpart or writes act any more
            }
            trace(E7_ACT, u);

            // ---- down: warp (block bw, k-quarter kq) over kpwd of the block's 8 k-tiles
#pragma unroll
            for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
            {
                const int bw = warp / wpb, kq = warp - bw * wpb;
                mbar_wait(bar + g.kpw, par);
                for (int i = 0; i < kpwd; i++) {
                    const int kt8 = kq * kpwd + i;
                    uint32_t b[4];
                    b_frag<CB, DUP>(*reinterpret_cast<const uint2*>(act + (kt8 * 32 + lane) * 2), b);
                    mma_row<K, CB, DUP, ABL, PRM>(reinterpret_cast<const uint32_t*>(dyn + D.dn + (kt8 * g.nblk + bw) * ROW), b,
                                        w0i, w1i, sh, a, acc);
                }
            }
            __syncthreads();  // down trellis is free
            trace(E7_DN_MMA, u);
            if (u + ncl < units) issue_dn(u + ncl);

            // ---- down epilogue: the block's warps summed in order, back from the Hadamard basis,
            // x svh, one fp32 y row per entry and intermediate block
            for (int rc = 0; rc * 4 < rows; rc++) {
                if (rc) __syncthreads();
                write_red(red, rc, acc);
                __syncthreads();
                if constexpr (EPI) {
                    const int ntask = g.nblk * min(4, rows - 4 * rc);
                    const int bsel = warp & (g.nblk - 1);
                    float sv[4];
                    half4(dsv[0], sv);
#pragma unroll 1
                    for (int tk = warp; tk < ntask; tk += WARPS) {
                        const int rr = tk / g.nblk, j = rc * 4 + rr;
                        float v[4] = {0.f, 0.f, 0.f, 0.f};
                        for (int kq = 0; kq < wpb; kq++) {
                            const float4 x = *reinterpret_cast<const float4*>(red + (bsel * wpb + kq) * 512 + rr * 128 + 4 * lane);
                            v[0] += x.x; v[1] += x.y; v[2] += x.z; v[3] += x.w;
                        }
                        fwht128(v, lane);
                        if constexpr (FXA) {
                            fx_add(s.grows[gi][j], s.gexp[gi], (r * g.nblk + bsel) * 128, v, sv);
                        } else {
                            __stcg(reinterpret_cast<float4*>(y + (size_t(ib) * MAX_PAIRS + ent0 + j) * a.hidden +
                                                             (r * g.nblk + bsel) * 128 + 4 * lane),
                                   make_float4(v[0] * RSQRT128 * sv[0], v[1] * RSQRT128 * sv[1],
                                               v[2] * RSQRT128 * sv[2], v[3] * RSQRT128 * sv[3]));
                        }
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const int tk = warp + WARPS * i, bsel = tk >> 2, rr = tk & 3, j = rc * 4 + rr;
                        if (tk < 4 * g.nblk && j < rows) {
                            float v[4] = {0.f, 0.f, 0.f, 0.f};
                            for (int kq = 0; kq < wpb; kq++) {
                                const float4 x = *reinterpret_cast<const float4*>(red + (bsel * wpb + kq) * 512 + rr * 128 + 4 * lane);
                                v[0] += x.x; v[1] += x.y; v[2] += x.z; v[3] += x.w;
                            }
                            fwht128(v, lane);
                            float sv[4];
                            half4(dsv[i], sv);
                            __stcg(reinterpret_cast<float4*>(y + (size_t(ib) * MAX_PAIRS + ent0 + j) * a.hidden +
                                                             (r * g.nblk + bsel) * 128 + 4 * lane),
                                   make_float4(v[0] * RSQRT128 * sv[0], v[1] * RSQRT128 * sv[1], v[2] * RSQRT128 * sv[2],
                                               v[3] * RSQRT128 * sv[3]));
                        }
                    }
                }
            }
            // ---- the last unit over column slice r sums it
            __syncthreads();
            trace(E7_Y, u);
            if constexpr (FXA) continue;  // the epilogue's atomics wrote every completed element
            if constexpr (RG) {
                static_assert(C7 * MAX_ROWS <= MAX_PAIRS * MAX_IB, "per-(slice, row) counters fit v2's arr region");
                __shared__ int rflag[GR];  // this unit completed row j of its group on slice r
                if (t < rows) {
                    const int row = s.grows[gi][t];
                    int* cnt = reinterpret_cast<int*>(a.scratch + L.arr) + r * MAX_ROWS + row;
                    const bool last = atomic_add_acq_rel(cnt, 1) == rneed[row] - 1;
                    if (last) *cnt = 0;  // its last user in this launch
                    rflag[t] = last;
                }
                __syncthreads();
                trace(E7_ARRIVED, u);
                gather_rows(y, gi, rflag, rows);
                continue;
            }
            if (t == 0) {
                int last;
                if constexpr (BULK) {  // release this CTA's y rows (ordered by the barrier), acquire the others'
                    last = atomic_add_acq_rel(done, 1) == units - 1;
                    if (last) *done = 0;  // its last user in this launch; the launch boundary publishes it
                } else {
                    __threadfence();
                    last = atomicAdd(done, 1) == units - 1;
                    if (last) {
                        *done = 0;  // its last user in this launch
                        __threadfence();
                    }
                }
                s.flag = last;
            }
            __syncthreads();
            trace(E7_ARRIVED, u);
            if (s.flag) {
                gather(y);
                trace(E7_GATHERED, u);
            }
        }
        if constexpr (RG || FXA) {
            if (cid == 0) zero_unrouted_rows();
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        if constexpr (FIN) {
            if (cid < units) cluster_wait();  // peers may still read this CTA's partials
        }
        trace(E7_EXIT, -1);
    }
};

template <int K, int CB, bool DUP, int ABL, bool BULK, bool PRM = false, bool FIN = false, bool EPI = false,
          bool RCAP = false, bool SB = false, bool RG = false, bool RLX = false, bool FXA = false>
__global__ void __cluster_dims__(C7, 1, 1) __launch_bounds__(THREADS, 2) moe_decode_v7(const __grid_constant__ Args a) {
    __shared__ Plan7 s;
    extern __shared__ __align__(16) uint8_t dyn[];
    V7Kernel<K, CB, DUP, ABL, BULK, PRM, FIN, EPI, RCAP, SB, RG, RLX, FXA> k(a, s, dyn);
    k.run();
}

using KernelFn = void (*)(Args);

template <bool BULK, bool PRM = false, bool FIN = false, bool EPI = false, bool RCAP = false,
          bool SB = false, bool RG = false, bool RLX = false, bool FXA = false>
KernelFn pick_cb(int bits, int codebook) {
    // MCG layers take v2's exact sum (lo and hi as two MMA k-elements), MUL1 the format's rounding.
    if (codebook == CB_MCG)
        return bits == 2 ? moe_decode_v7<2, CB_MCG, true, 0, BULK, PRM, FIN, EPI, RCAP, SB, RG, RLX, FXA>
                         : moe_decode_v7<3, CB_MCG, true, 0, BULK, false, FIN, EPI, RCAP, SB, RG, RLX, FXA>;
    if (codebook == CB_MUL1)
        return bits == 2 ? moe_decode_v7<2, CB_MUL1, false, 0, BULK, PRM, FIN, EPI, RCAP, SB, RG, RLX, FXA>
                         : moe_decode_v7<3, CB_MUL1, false, 0, BULK, false, FIN, EPI, RCAP, SB, RG, RLX, FXA>;
    return nullptr;
}

// Every cluster build but the timing ablations: its variant number and template flags. The one list
// that pick_v7 and the host's shared-memory layout (layout_of) read, so a variant's kernel and
// the layout its launch asks for cannot disagree.
struct Build7 {
    int variant;
    bool bulk, prm, fin, epi, rcap, sb, rg, rlx, fxa;
};
constexpr Build7 BUILDS7[] = {
    //                  bulk   prm    fin    epi    rcap   sb     rg     rlx    fxa
    {V7_VARIANT,       false, false, false, false, false, false, false, false, false},
    {V7_BULK_VARIANT,  true,  false, false, false, false, false, false, false, false},
    {V7_PRM_VARIANT,   true,  true,  false, false, false, false, false, false, false},
    {V7_FIN_VARIANT,   true,  true,  true,  false, false, false, false, false, false},
    {V7_EPI_VARIANT,   true,  true,  true,  true,  false, false, false, false, false},
    {V7_RCAP_VARIANT,  true,  true,  true,  true,  true,  false, false, false, false},
    {V7_SB_VARIANT,    true,  true,  true,  true,  true,  true,  false, false, false},
    {V7_RG_VARIANT,    true,  true,  true,  true,  true,  true,  true,  false, false},
    {V7_RLX_VARIANT,   true,  true,  true,  true,  true,  true,  true,  true,  false},
    {V7_FXA_VARIANT,   true,  true,  true,  true,  false, false, false, false, true},
    {V7_RGFXA_VARIANT, true,  true,  true,  true,  true,  true,  true,  true,  true},
};
constexpr int N_BUILDS7 = int(sizeof(BUILDS7) / sizeof(BUILDS7[0]));

template <int I = 0>
KernelFn pick_build(int bits, int codebook, int variant) {
    if constexpr (I == N_BUILDS7) {
        return nullptr;
    } else {
        constexpr Build7 b = BUILDS7[I];
        if (variant == b.variant) return pick_cb<b.bulk, b.prm, b.fin, b.epi, b.rcap, b.sb, b.rg, b.rlx, b.fxa>(bits, codebook);
        return pick_build<I + 1>(bits, codebook, variant);
    }
}

const Build7* build7_of(int variant) {
    for (const Build7& b : BUILDS7)
        if (b.variant == variant) return &b;
    return nullptr;  // a timing ablation: v7's flags, all false
}

int g_stop = 0;  // lna2_set_stop: 1 / 2 / 3 / 4 run v26's K2 MCG launches through its stop build (3: to the end)

KernelFn pick_v7(int bits, int codebook, int variant) {
    if (g_stop != 0 && variant == V7_EPI_VARIANT && bits == 2 && codebook == CB_MCG)
        return moe_decode_v7<2, CB_MCG, true, ABL_STOP, true, true, true, true>;
    if (KernelFn fn = pick_build(bits, codebook, variant)) return fn;
    if (bits != 2 || codebook != CB_MCG) return nullptr;  // the ablations: K2 MCG only
    switch (variant - V7_ABLATION_BASE) {
        case 0: return moe_decode_v7<2, CB_MCG, true, ABL_NO_DECODE, false>;
        case 1: return moe_decode_v7<2, CB_MCG, true, ABL_NO_COPY, false>;
        case 2: return moe_decode_v7<2, CB_MCG, true, ABL_NO_DECODE | ABL_NO_COPY, false>;
        default: return nullptr;
    }
}

// The shared-memory layout a launch of `variant` asks for, from its build's flags as the kernel reads
// them (FIN && !SB: two partial buffers; RCAP: rows per buffer). A timing ablation has v7's flags,
// all false.
Dyn7 layout_of(int variant, int bits, const Geo& g, int n_experts, int m, int top_k) {
    const Build7* b = build7_of(variant);
    const Build7 f = b ? *b : Build7{};
    return dyn7_layout(bits, g, ucap_for(n_experts, m, top_k), f.fin && !f.sb, partial_rows(f.rcap, m));
}

int g_spread = 0;  // 0: auto, 1: one CTA per SM, 2: as many as fit (set_tuning's ctas_per_sm)

// Per (kernel, device): the dynamic shared memory the kernel is allowed, and the resident clusters
// per request size, so an eager launch does not pay two driver queries. The allowance only grows:
// a launch with a smaller request than the last one must not shrink it under a later, larger one.
struct KernelSlot {
    KernelFn fn;
    int device, allowed;
    int dyn[8], clusters[8], n;
};
constexpr int SLOTS = 80;
KernelSlot g_slots[SLOTS];
int g_nslots = 0;
std::mutex g_slots_mu;

// The slot of (fn, device), its allowance raised to at least dyn. Caller holds g_slots_mu.
cudaError_t allow(KernelFn fn, int dyn, int device, KernelSlot** slot) {
    KernelSlot* sl = nullptr;
    for (int i = 0; i < g_nslots; i++)
        if (g_slots[i].fn == fn && g_slots[i].device == device) sl = &g_slots[i];
    if (!sl) {
        if (g_nslots == SLOTS) return cudaErrorMemoryAllocation;  // 25 kernels x 3 devices fit
        sl = &g_slots[g_nslots++];
        *sl = KernelSlot{fn, device, 0, {}, {}, 0};
    }
    if (dyn > sl->allowed) {
        const cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);
        if (err != cudaSuccess) return err;
        sl->allowed = dyn;
    }
    *slot = sl;
    return cudaSuccess;
}

cudaError_t max_clusters(KernelFn fn, int dyn, int device, int* out) {
    std::lock_guard<std::mutex> lk(g_slots_mu);
    KernelSlot* sl = nullptr;
    const cudaError_t aerr = allow(fn, dyn, device, &sl);
    if (aerr != cudaSuccess) return aerr;
    for (int i = 0; i < sl->n; i++)
        if (sl->dyn[i] == dyn) {
            *out = sl->clusters[i];
            return cudaSuccess;
        }
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = size_t(dyn);
    cfg.gridDim = dim3(C7);
    const cudaError_t err = cudaOccupancyMaxActiveClusters(out, fn, &cfg);
    if (err != cudaSuccess) return err;
    const int i = sl->n < 8 ? sl->n++ : 7;
    sl->dyn[i] = dyn;
    sl->clusters[i] = *out;
    return cudaSuccess;
}

}  // namespace

bool v7_supports(int hidden, int inter) {
    Geo g;
    return geometry(hidden, inter, g);
}

void v7_set_spread(int ctas_per_sm) {
    if (ctas_per_sm >= 0) g_spread = ctas_per_sm;
}

// Benchmarks only: v26's K2 MCG launches run its stop build (v26's code plus a run-time stage check,
// so its size and registers are v26's), returning after the prologue (1) or the route plan (2), or
// running to the end (3: the control, which computes the op), with v26's launch shape and
// shared-memory layout; 0 restores v26. What a launch stopped early writes is not the op. The served
// kernels are not recompiled.
void v7_set_stop(int stage) { g_stop = stage >= 1 && stage <= 4 ? stage : 0; }

cudaError_t v7_smem_bytes(int bits, int codebook, int variant, int n_experts, int m, int top_k, int hidden, int inter,
                          int* bytes) {
    KernelFn fn = pick_v7(bits, codebook, variant);
    Geo g;
    if (!fn || !geometry(hidden, inter, g)) return cudaErrorInvalidValue;
    cudaFuncAttributes attr{};
    const cudaError_t err = cudaFuncGetAttributes(&attr, fn);
    if (err != cudaSuccess) return err;
    *bytes = int(attr.sharedSizeBytes) + layout_of(variant, bits, g, n_experts, m, top_k).total;
    return cudaSuccess;
}

// Residency at a layer's geometry (the decode call's; lna2_moe_prepare / info report the seat's TP8 one).
cudaError_t v7_occupancy(int bits, int codebook, int variant, int device, int n_experts, int m, int top_k,
                         int* blocks_per_sm, int* num_sms, int hidden, int inter) {
    KernelFn fn = pick_v7(bits, codebook, variant);
    Geo g;
    // the layer's own geometry: sized at the seat's 4096 x 256, a 2048-wide K3 layer on a 99 KB card
    // asked for more shared memory than its launch needs and was refused (session 33's review)
    if (!fn || !geometry(hidden, inter, g)) return cudaErrorInvalidValue;
    cudaError_t err = cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    const int dyn = layout_of(variant, bits, g, n_experts, m, top_k).total;
    {
        std::lock_guard<std::mutex> lk(g_slots_mu);
        KernelSlot* sl = nullptr;
        err = allow(fn, dyn, device, &sl);
    }
    if (err != cudaSuccess) return err;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, fn, THREADS, dyn);
}

cudaError_t v7_launch(const Args& a_in, cudaStream_t stream) {
    KernelFn fn = pick_v7(a_in.bits, a_in.codebook, a_in.variant);
    Geo g;
    if (!fn || !geometry(a_in.hidden, a_in.inter, g)) return cudaErrorInvalidValue;
    Args a = a_in;
    a.stop = g_stop;  // read only by the stop build
    for (int j = 0; j < 7; j++) a.kmul[j] = a.bits == 2 ? 1u << (2 + 2 * j) : (j < 6 ? 1u << (3 * j) : 8u);
    a.kmul[7] = 1u << 16;
    int device = 0, sms = 0, smem_sm = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    if (err != cudaSuccess) return err;
    int dyn = layout_of(a.variant, a.bits, g, a.n_experts, a.m, a.top_k).total;
    // Units are known only on the device; this bounds them. When every unit's cluster can have SMs
    // of its own, the request is padded past half an SM's shared memory so that no two CTAs share
    // one (NOTES.md compares it with packing them, set_tuning's ctas_per_sm 2).
    const int groups = std::min(a.m * a.top_k, a.n_experts * ((a.m + GR - 1) / GR));
    const int bound = groups * g.n_ib;
    const bool spread = g_spread == 1 || (g_spread == 0 && bound * C7 <= sms);
    if (spread) dyn = std::max(dyn, smem_sm / 2 + 1024);
    int clusters = 0;
    err = max_clusters(fn, dyn, device, &clusters);
    if (err != cudaSuccess) return err;
    if (clusters < 1) return cudaErrorInvalidConfiguration;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = size_t(dyn);
    cfg.stream = stream;
    cfg.gridDim = dim3(C7 * std::min(bound, clusters));
    return cudaLaunchKernelEx(&cfg, fn, a);
}

}  // namespace lna2
