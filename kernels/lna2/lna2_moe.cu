// lna2: one cooperative launch per MoE layer for EXL3 routed experts at decode (1..32 rows).
//
// Why this shape: at decode an expert sees ~1 row, so the cost is decoding every weight of every
// touched expert exactly once, spread over the whole chip, and the latency of the gate/up ->
// activation -> down -> top-k sum chain. The kernel therefore
//   * builds the route plan redundantly in every CTA (no grid barrier needed for it),
//   * groups up to 16 rows of one expert so a decoded 16x16 tile feeds one m16n8k16 MMA pair
//     (the tensor-core B fragment is exactly the EXL3 tile order, so no shuffles of values),
//   * splits gate/up along k as far as needed to give every CTA work, with fp32 partials that the
//     last-arriving CTA of a (group, 128-block) reduces in a fixed order and turns into the
//     activation (no float atomics anywhere: bitwise repeatable),
//   * lets down-projection CTAs prefetch their weights before waiting on that activation, and
//   * has the last CTA to finish a 128-column block of the output sum the top-k slots of every
//     row in slot order and store the consumer dtype.
// All CTAs are co-resident (cooperative launch), so the waits cannot deadlock; control words are
// returned to zero by the last CTA to retire.

#include "lna2_api.h"
#include "lna2_common.cuh"

// The build passes the source digest as a bare token (build systems mangle quoted strings).
#define LNA2_STR2(x) #x
#define LNA2_STR(x) LNA2_STR2(x)
#ifdef LNA2_BUILD_TAG
#define LNA2_BUILD_ID LNA2_STR(LNA2_BUILD_TAG)
#else
#define LNA2_BUILD_ID "dev"
#endif
#ifndef LNA2_MIN_BLOCKS
#define LNA2_MIN_BLOCKS 2
#endif

namespace lna2 {

constexpr int XS_STRIDE = CHUNK_KT * 16 + 8;   // halves; +8 keeps the A-fragment loads conflict-free
constexpr int YS_STRIDE = 128 + 4;

struct Smem : RoutePlan<GROUP_ROWS> {
    const void* ptr[MAX_EXPERTS][9];   // pointers of the used experts, by compact index
    int ksplit, item, flag;
    alignas(16) union {
        __half xs[GROUP_ROWS][XS_STRIDE];
        float ys[GROUP_ROWS][YS_STRIDE];
        float red[WARPS][2][128];
    } buf;
};

// One decoded 16x16 tile against 16 staged input columns: two m16n8k16 MMAs.
template <int CB>
__device__ __forceinline__ void tile_mma(const uint32_t (&s)[8], const __half* r0, const __half* r1, bool two_halves,
                                         float (&acc)[8]) {
    const uint32_t b0 = decode_pair<CB>(s[0], s[1]);
    const uint32_t b1 = decode_pair<CB>(s[2], s[3]);
    const uint32_t b2 = decode_pair<CB>(s[4], s[5]);
    const uint32_t b3 = decode_pair<CB>(s[6], s[7]);
    const uint32_t a0 = *reinterpret_cast<const uint32_t*>(r0);
    const uint32_t a2 = *reinterpret_cast<const uint32_t*>(r0 + 8);
    uint32_t a1 = 0, a3 = 0;
    if (two_halves) {
        a1 = *reinterpret_cast<const uint32_t*>(r1);
        a3 = *reinterpret_cast<const uint32_t*>(r1 + 8);
    }
    mma16816(acc, a0, a1, a2, a3, b0, b1);
    mma16816(acc + 4, a0, a1, a2, a3, b2, b3);
}


// ------------------------------------------------------------------------------------------------
// route plan: every CTA builds the same one in shared memory

__device__ void build_route(const Args& a, Smem& s) {
    const int t = threadIdx.x;
    // Pointer loads are issued before the ids arrive so their latency overlaps the plan.
    const void* mine[9];
    const bool is_expert = t < a.n_experts;
#pragma unroll
    for (int i = 0; i < 9; i++) mine[i] = is_expert ? reinterpret_cast<const void*>(a.tables[i][t]) : nullptr;
    s.mask[t] = 0;
    __syncthreads();
    const int pairs = a.m * a.top_k;
    for (int p = t; p < pairs; p += THREADS) {
        int e = a.expert_ids[p];
        const bool ok = e >= 0 && e < a.n_experts;
        s.rid[p] = static_cast<int16_t>(ok ? e : -1);
        s.rw[p] = a.weights[p];
        if (ok) atomicOr(&s.mask[e], 1u << (p / a.top_k));
    }
    __syncthreads();
    const int c = is_expert ? __popc(s.mask[t]) : 0;
    const int ng = (c + GROUP_ROWS - 1) / GROUP_ROWS;
    const int used = c > 0;
    const int v[3] = {c, ng, used};
    int excl[3];
    block_excl_scan3(v, excl, s.wsum);
    store_groups<GROUP_ROWS>(s, t, c, ng, excl);
    if (used) {
#pragma unroll
        for (int i = 0; i < 9; i++) s.ptr[excl[2]][i] = mine[i];
    }
    __syncthreads();
}

__device__ __forceinline__ int choose_ksplit(int ng, int gr, int ib, int grid, int kt) {
    const int base = ng * 2 * ib;
    int ks = 1;
    while (ks < KSPLIT_MAX) {
        const int nk = ks * 2;
        if (base * ks >= 2 * grid) break;           // enough items for every CTA already
        if (nk * gr > PART_CAP) break;               // partial-sum slots are bounded
        if (kt % nk != 0 || (kt / nk) % 8 != 0) break;  // k-chunks stay multiples of 8 tiles
        ks = nk;
    }
    return ks;
}

// ------------------------------------------------------------------------------------------------
// weights: a warp streams one 16-column strip of a projection, CHUNK_KT tiles at a time

template <int K>
struct Strip {
    static constexpr int NREG = (K == 2) ? CHUNK_KT / 2 : CHUNK_KT;
    uint32_t w[NREG];
};

// K2: a tile is 16 words, two tiles per 32-lane load. K3: 24 words, one tile per load (lanes 0-23).
template <int K>
__device__ __forceinline__ void load_strip(Strip<K>& st, const uint32_t* tr, int kt0, int tn, int ntn, int nt,
                                           int lane) {
    constexpr int WPT = 8 * K;  // 32-bit words per tile
#pragma unroll
    for (int q = 0; q < Strip<K>::NREG; q++) {
        int tile = (K == 2) ? 2 * q + (lane >> 4) : q;
        int word = (K == 2) ? (lane & 15) : lane;
        bool ok = tile < nt && word < WPT;
        st.w[q] = ok ? __ldg(tr + (size_t(kt0 + tile) * ntn + tn) * WPT + word) : 0u;
    }
}

// Decode the strip's tiles against the staged activations (rows of one group) and accumulate.
template <int K, int CB>
__device__ __forceinline__ void mma_strip(const Strip<K>& st, const __half (*xs)[XS_STRIDE], int rows, int nt,
                                          int lane, float (&acc)[8]) {
    const int gid = lane >> 2, tig = lane & 3;
    int w0i, w1i, sh;
    lane_window<K>(lane, w0i, w1i, sh);
    const bool two_halves = rows > 8;
#pragma unroll
    for (int kt = 0; kt < CHUNK_KT; kt++) {
        if (kt >= nt) break;
        const uint32_t reg = (K == 2) ? st.w[kt >> 1] : st.w[kt];
        const int base = (K == 2) ? ((kt & 1) << 4) : 0;
        const uint32_t a = __shfl_sync(FULL, reg, base + w0i);
        const uint32_t b = __shfl_sync(FULL, reg, base + w1i);
        uint32_t s[8];
        tile_states<K>(a, b, sh, s);
        tile_mma<CB>(s, &xs[gid][kt * 16 + 2 * tig], &xs[gid + 8][kt * 16 + 2 * tig], two_halves, acc);
    }
}

// ------------------------------------------------------------------------------------------------
// phase 1: gate / up partial GEMV for (group, projection, 128-block of I, k-split)

__device__ void stage_input(const Args& a, Smem& s, int g, int rows, int k0, int nk, const __half* suh) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nblk = nk / 128;
    for (int q = warp; q < rows * nblk; q += WARPS) {
        const int j = q / nblk, b = q - j * nblk;
        const int r = s.grows[g][j];
        const int k = k0 + b * 128 + 4 * lane;
        float v[4], sc[4];
        load4_x(a.x, a.x_dtype, size_t(r) * a.hidden + k, v);
        load4_half(suh + k, sc);
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] *= sc[i];
        fwht128(v, lane);
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] *= RSQRT128;
        *reinterpret_cast<uint2*>(&s.buf.xs[j][b * 128 + 4 * lane]) = pack4_half(v);
    }
}

// The last CTA to deliver a (group, block) sums the k-split partials in a fixed order, rotates
// back (Hadamard, svh), applies DeepSeek-V4's clamped SwiGLU, and rotates into the down input.
__device__ void finish_block(const Args& a, const Layout& L, Smem& s, int g, int ib, int ks, int gr, bool signal) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = s.gexp[g], u = s.ubase[e];
    const int rows = s.gnr[g], ent0 = s.gent[g];
    const int col = ib * 128 + 4 * lane;
    const float* part = reinterpret_cast<const float*>(a.scratch + L.part);
    __half* act = reinterpret_cast<__half*>(a.scratch + L.act);
    float sg[4], su[4], sd[4];
    load4_half(reinterpret_cast<const __half*>(s.ptr[u][2]) + col, sg);
    load4_half(reinterpret_cast<const __half*>(s.ptr[u][5]) + col, su);
    load4_half(reinterpret_cast<const __half*>(s.ptr[u][7]) + col, sd);
    const float lim = a.swiglu_limit;
    // warps_per_row warps share a row's k-splits so their loads are in flight together
    const int wpr = ks < WARPS ? ks : WARPS;
    const int rpp = WARPS / wpr;
    const int my_row = warp / wpr, my_lane_group = warp % wpr;
    for (int r0 = 0; r0 < rows; r0 += rpp) {
        const int j = r0 + my_row;
        float gv[4] = {0.f, 0.f, 0.f, 0.f}, uv[4] = {0.f, 0.f, 0.f, 0.f};
        if (j < rows) {
            for (int kc = my_lane_group; kc < ks; kc += wpr) {
                const float* p = part + (size_t((kc * gr + ent0 + j) * 2) * a.inter + col);
                const float4 x = __ldcg(reinterpret_cast<const float4*>(p));
                const float4 y = __ldcg(reinterpret_cast<const float4*>(p + a.inter));
                gv[0] += x.x; gv[1] += x.y; gv[2] += x.z; gv[3] += x.w;
                uv[0] += y.x; uv[1] += y.y; uv[2] += y.z; uv[3] += y.w;
            }
        }
        __syncthreads();  // the reduction buffer aliases the staging buffer
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s.buf.red[warp][0][4 * lane + i] = gv[i];
            s.buf.red[warp][1][4 * lane + i] = uv[i];
        }
        __syncthreads();
        if (my_lane_group == 0 && j < rows) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float gs = 0.f, us = 0.f;
                for (int w = 0; w < wpr; w++) {
                    gs += s.buf.red[warp + w][0][4 * lane + i];
                    us += s.buf.red[warp + w][1][4 * lane + i];
                }
                gv[i] = gs;
                uv[i] = us;
            }
            float av[4];
            swiglu_rotate(gv, uv, sg, su, sd, lim, lane, av);
            *reinterpret_cast<uint2*>(act + size_t(ent0 + j) * a.inter + col) = pack4_half(av);
        }
    }
    if (!signal) {
        __syncthreads();  // the reduction buffer is reused by the caller's next step
        return;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(reinterpret_cast<int*>(a.scratch + L.ready) + g, 1);
}

template <int K, int CB>
__device__ void phase1_item(const Args& a, const Layout& L, Smem& s, int g, int proj, int ib, int kc, int kti,
                            int ks, int gr) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int u = s.ubase[s.gexp[g]];
    const int rows = s.gnr[g], ent0 = s.gent[g];
    const uint32_t* tr = reinterpret_cast<const uint32_t*>(s.ptr[u][proj == 0 ? 0 : 3]);
    const __half* suh = reinterpret_cast<const __half*>(s.ptr[u][proj == 0 ? 1 : 4]);
    const int ntn = a.inter / 16;
    const int tn = ib * 8 + warp;
    const int kt0 = kc * kti;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    Strip<K> cur, nxt;
    load_strip<K>(cur, tr, kt0, tn, ntn, min(CHUNK_KT, kti), lane);
    for (int c = 0; c < kti; c += CHUNK_KT) {
        const int nt = min(CHUNK_KT, kti - c);
        if (c + CHUNK_KT < kti) load_strip<K>(nxt, tr, kt0 + c + CHUNK_KT, tn, ntn, min(CHUNK_KT, kti - c - CHUNK_KT), lane);
        stage_input(a, s, g, rows, (kt0 + c) * 16, nt * 16, suh);
        __syncthreads();
        mma_strip<K, CB>(cur, s.buf.xs, rows, nt, lane, acc);
        __syncthreads();
        cur = nxt;
    }
    float* part = reinterpret_cast<float*>(a.scratch + L.part);
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int n = tn * 16 + h * 8 + 2 * tig;
        if (gid < rows)
            *reinterpret_cast<float2*>(part + size_t((kc * gr + ent0 + gid) * 2 + proj) * a.inter + n) =
                make_float2(acc[4 * h], acc[4 * h + 1]);
        if (gid + 8 < rows)
            *reinterpret_cast<float2*>(part + size_t((kc * gr + ent0 + gid + 8) * 2 + proj) * a.inter + n) =
                make_float2(acc[4 * h + 2], acc[4 * h + 3]);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int old = atomicAdd(reinterpret_cast<int*>(a.scratch + L.arr) + g * L.ib + ib, 1);
        s.flag = (old == 2 * ks - 1);
    }
    __syncthreads();
    if (s.flag) {
        __threadfence();
        finish_block(a, L, s, g, ib, ks, gr, true);
    }
}

// ------------------------------------------------------------------------------------------------
// phase 2: down projection for (group, 128-column block of the output)

__device__ void gather_block(const Args& a, const Layout& L, Smem& s, int cb) {
    gather_cols(a, reinterpret_cast<const float*>(a.scratch + L.y), s, cb);
}

template <int K, int CB>
__device__ void phase2_item(const Args& a, const Layout& L, Smem& s, int g, int cb, int ng) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int u = s.ubase[s.gexp[g]];
    const int rows = s.gnr[g], ent0 = s.gent[g];
    const uint32_t* tr = reinterpret_cast<const uint32_t*>(s.ptr[u][6]);
    const int ntn = a.hidden / 16;
    const int tn = cb * 8 + warp;
    const int kt_total = a.inter / 16;
    float svh[4];
    load4_half(reinterpret_cast<const __half*>(s.ptr[u][8]) + cb * 128 + 4 * lane, svh);
    Strip<K> cur, nxt;
    load_strip<K>(cur, tr, 0, tn, ntn, min(CHUNK_KT, kt_total), lane);
    // weights are in flight; now wait for this group's activation
    if (threadIdx.x == 0) {
        const int* ready = reinterpret_cast<const int*>(a.scratch + L.ready) + g;
        while (ld_acquire(ready) < L.ib) __nanosleep(32);
    }
    __syncthreads();
    const __half* act = reinterpret_cast<const __half*>(a.scratch + L.act);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int c = 0; c < kt_total; c += CHUNK_KT) {
        const int nt = min(CHUNK_KT, kt_total - c);
        if (c + CHUNK_KT < kt_total) load_strip<K>(nxt, tr, c + CHUNK_KT, tn, ntn, min(CHUNK_KT, kt_total - c - CHUNK_KT), lane);
        // stage rows x (nt*16) halves of the activation, 8 halves per lane
        const int per_row = nt * 2;  // 16-byte pieces
        for (int q = threadIdx.x; q < rows * per_row; q += THREADS) {
            const int j = q / per_row, piece = q - j * per_row;
            const uint4 v = __ldcg(reinterpret_cast<const uint4*>(act + size_t(ent0 + j) * a.inter + c * 16) + piece);
            *reinterpret_cast<uint4*>(&s.buf.xs[j][piece * 8]) = v;
        }
        __syncthreads();
        mma_strip<K, CB>(cur, s.buf.xs, rows, nt, lane, acc);
        __syncthreads();
        cur = nxt;
    }
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int n = warp * 16 + h * 8 + 2 * tig;
        if (gid < rows) *reinterpret_cast<float2*>(&s.buf.ys[gid][n]) = make_float2(acc[4 * h], acc[4 * h + 1]);
        if (gid + 8 < rows)
            *reinterpret_cast<float2*>(&s.buf.ys[gid + 8][n]) = make_float2(acc[4 * h + 2], acc[4 * h + 3]);
    }
    __syncthreads();
    float* y = reinterpret_cast<float*>(a.scratch + L.y);
    for (int j = warp; j < rows; j += WARPS) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = s.buf.ys[j][4 * lane + i];
        fwht128(v, lane);
        float4 o = make_float4(v[0] * RSQRT128 * svh[0], v[1] * RSQRT128 * svh[1], v[2] * RSQRT128 * svh[2],
                               v[3] * RSQRT128 * svh[3]);
        *reinterpret_cast<float4*>(y + size_t(ent0 + j) * a.hidden + cb * 128 + 4 * lane) = o;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int old = atomicAdd(reinterpret_cast<int*>(a.scratch + L.done) + cb, 1);
        s.flag = (old == ng - 1);
    }
    __syncthreads();
    if (s.flag) {
        __threadfence();
        gather_block(a, L, s, cb);
    }
}

// ------------------------------------------------------------------------------------------------

template <int K, int CB>
__global__ void __launch_bounds__(THREADS, LNA2_MIN_BLOCKS) moe_decode_v0(Args a) {
    __shared__ Smem s;
    const Layout L = make_layout(a.hidden, a.inter);
    int* ctrl = reinterpret_cast<int*>(a.scratch);
    build_route(a, s);
    const int ng = s.ng, gr = s.gr;
    const int grid = gridDim.x;
    const int kt = a.hidden / 16;
    const int ks = choose_ksplit(ng, gr, L.ib, grid, kt);
    const int kti = kt / ks;

    if (ng == 0) {
        // nothing routed anywhere: the output is still ours to write
        for (int cb = blockIdx.x; cb < L.cb; cb += grid) gather_block(a, L, s, cb);
    }

    const int n1 = ng * 2 * L.ib * ks;
    for (int it = blockIdx.x; it < n1; it += grid) {
        const int ib = it % L.ib;
        const int t1 = it / L.ib;
        const int proj = t1 & 1;
        const int t2 = t1 >> 1;
        const int g = t2 % ng;
        const int kc = t2 / ng;
        phase1_item<K, CB>(a, L, s, g, proj, ib, kc, kti, ks, gr);
    }

    // Down-projection items are taken from a ticket counter, so CTAs that finished phase 1 early
    // take more; the next ticket is fetched while the current item runs.
    const int n2 = ng * L.cb;
    if (threadIdx.x == 0) s.item = atomicAdd(ctrl + 1, 1);
    __syncthreads();
    int it = s.item;
    __syncthreads();
    while (it < n2) {
        int next = 0;
        if (threadIdx.x == 0) next = atomicAdd(ctrl + 1, 1);  // consumed only after the item
        phase2_item<K, CB>(a, L, s, it % ng, it / ng, ng);
        if (threadIdx.x == 0) s.item = next;
        __syncthreads();
        it = s.item;
        __syncthreads();
    }

    // retire: the last CTA out returns every control word it used to zero
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        int old = atomicAdd(ctrl, 1);
        s.flag = (old == grid - 1);
    }
    __syncthreads();
    if (s.flag) {
        __threadfence();
        int* arr = reinterpret_cast<int*>(a.scratch + L.arr);
        int* ready = reinterpret_cast<int*>(a.scratch + L.ready);
        int* done = reinterpret_cast<int*>(a.scratch + L.done);
        for (int i = threadIdx.x; i < ng * L.ib; i += THREADS) arr[i] = 0;
        for (int i = threadIdx.x; i < ng; i += THREADS) ready[i] = 0;
        for (int i = threadIdx.x; i < L.cb; i += THREADS) done[i] = 0;
        if (threadIdx.x == 0) {
            ctrl[1] = 0;
            ctrl[0] = 0;
        }
        __threadfence();
    }
}

// ================================================================================================
// v1: the same plan fed by a cp.async pipeline. The weights, raw inputs and suh of the next chunks
// are in flight while the current chunk decodes; the down projection's weights are fetched before
// the one grid-wide barrier that publishes every activation; release/acquire is a CTA barrier plus
// one thread's fence (as cooperative groups does), not a fence in every thread.

constexpr int V1_ROW_STRIDE = XS_STRIDE * 2;                 // bytes; padded like xs (conflict-free A loads)
constexpr int V1_ROWS_BYTES = GROUP_ROWS * V1_ROW_STRIDE;    // one chunk of inputs / activations
constexpr int V1_SUH_BYTES = CHUNK_KT * 16 * 2;

template <int K>
struct V1 {
    static constexpr int WPT = 8 * K;                       // 32-bit words per tile
    static constexpr int PPR = 2 * WPT;                     // 16-byte pieces per row of 8 tiles
    static constexpr int TR_BYTES = CHUNK_KT * PPR * 16;    // 16 k-tiles x 8 n-tiles
    static constexpr int STAGE_BYTES = TR_BYTES + V1_ROWS_BYTES + V1_SUH_BYTES;
};

// Trellis of one chunk: k-tiles [k0t, k0t+nt) x the 8 n-tiles [tn0, tn0+8) of a projection whose
// row of tiles is ntn long. A row of 8 tiles is contiguous in memory, and so in the stage.
template <int K>
__device__ __forceinline__ void v1_copy_tiles(uint8_t* dst, const char* tr, int k0t, int nt, int tn0, int ntn) {
    constexpr int WPT = V1<K>::WPT, PPR = V1<K>::PPR;
    for (int p = threadIdx.x; p < nt * PPR; p += THREADS) {
        const int row = p / PPR, off = p - row * PPR;
        cp16(dst + row * PPR * 16 + off * 16, tr + (size_t(k0t + row) * ntn + tn0) * WPT * 4 + off * 16);
    }
}

// `rows` rows of 2-byte values [col0, col0 + 16*nt) of a row-major matrix with `ld` columns.
__device__ __forceinline__ void v1_copy_rows(uint8_t* dst, const char* src, const uint8_t* row_ids, int row_base,
                                             int rows, size_t ld, int col0, int nt) {
    const int ppr = 2 * nt;
    for (int p = threadIdx.x; p < rows * ppr; p += THREADS) {
        const int j = p / ppr, q = p - j * ppr;
        const size_t r = row_ids ? row_ids[j] : size_t(row_base + j);
        cp16(dst + j * V1_ROW_STRIDE + q * 16, src + (r * ld + col0) * 2 + q * 16);
    }
}

template <int K, int CB>
__device__ __forceinline__ void v1_mma(const uint8_t* stage_tr, const __half* xs_base, int rows, int nt, int warp,
                                       int lane, float (&acc)[8]) {
    constexpr int WPT = V1<K>::WPT;
    const int gid = lane >> 2, tig = lane & 3;
    int w0i, w1i, sh;
    lane_window<K>(lane, w0i, w1i, sh);
    const bool two_halves = rows > 8;
    const uint32_t* base = reinterpret_cast<const uint32_t*>(stage_tr) + warp * WPT;
    const __half* r0 = xs_base + gid * XS_STRIDE + 2 * tig;
    const __half* r1 = r0 + 8 * XS_STRIDE;
#pragma unroll
    for (int kt = 0; kt < CHUNK_KT; kt++) {
        if (kt >= nt) break;
        const uint32_t* t = base + kt * 8 * WPT;
        uint32_t s[8];
        tile_states<K>(t[w0i], t[w1i], sh, s);
        tile_mma<CB>(s, r0 + kt * 16, r1 + kt * 16, two_halves, acc);
    }
}

// Rotate one chunk of raw inputs (already in shared memory) into the MMA's A operand.
__device__ __forceinline__ void v1_rotate_inputs(Smem& s, const uint8_t* xr, const uint8_t* suh, int dtype, int rows,
                                                 int nk) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nblk = nk / 128;
    for (int q = warp; q < rows * nblk; q += WARPS) {
        const int j = q / nblk, b = q - j * nblk;
        const int k = b * 128 + 4 * lane;
        float v[4], sc[4];
        load4_raw(xr + j * V1_ROW_STRIDE + k * 2, dtype, v);
        load4_raw(suh + k * 2, DT_F16, sc);
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] *= sc[i];
        fwht128(v, lane);
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] *= RSQRT128;
        *reinterpret_cast<uint2*>(&s.buf.xs[j][k]) = pack4_half(v);
    }
}

__device__ __forceinline__ void cta_arrive(int* counter, int target_minus_one, Smem& s) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const int old = atomicAdd(counter, 1);
        const int last = old == target_minus_one;
        if (last) __threadfence();
        s.flag = last;
    }
    __syncthreads();
}

template <int K, int CB>
__device__ void v1_phase1(const Args& a, const Layout& L, Smem& s, uint8_t* stages, int nst, int ng, int gr, int ks,
                          int kti) {
    constexpr int SB = V1<K>::STAGE_BYTES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int G = gridDim.x, b = blockIdx.x;
    const int n1 = ng * 2 * L.ib * ks;
    const int nch = (kti + CHUNK_KT - 1) / CHUNK_KT;
    const int mine = b < n1 ? (n1 - 1 - b) / G + 1 : 0;
    const int total = mine * nch;
    const int ntn = a.inter / 16;
    auto info = [&](int st, int& g, int& proj, int& ib, int& kc, int& c, int& nt) {
        const int ii = st / nch;
        c = st - ii * nch;
        const int it = b + ii * G;
        ib = it % L.ib;
        const int t1 = it / L.ib;
        proj = t1 & 1;
        const int t2 = t1 >> 1;
        g = t2 % ng;
        kc = t2 / ng;
        nt = min(CHUNK_KT, kti - c * CHUNK_KT);
    };
    auto issue = [&](int st) {
        if (st < total) {
            int g, proj, ib, kc, c, nt;
            info(st, g, proj, ib, kc, c, nt);
            uint8_t* stg = stages + (st % nst) * SB;
            const int u = s.ubase[s.gexp[g]];
            const int k0t = kc * kti + c * CHUNK_KT;
            v1_copy_tiles<K>(stg, reinterpret_cast<const char*>(s.ptr[u][proj ? 3 : 0]), k0t, nt, ib * 8, ntn);
            v1_copy_rows(stg + V1<K>::TR_BYTES, reinterpret_cast<const char*>(a.x), s.grows[g], 0, s.gnr[g],
                         a.hidden, k0t * 16, nt);
            const char* suh = reinterpret_cast<const char*>(s.ptr[u][proj ? 4 : 1]) + size_t(k0t) * 32;
            uint8_t* dsh = stg + V1<K>::TR_BYTES + V1_ROWS_BYTES;
            for (int p = threadIdx.x; p < 2 * nt; p += THREADS) cp16(dsh + p * 16, suh + p * 16);
        }
        cp_commit();
    };
    for (int st = 0; st < nst - 1; st++) issue(st);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float* part = reinterpret_cast<float*>(a.scratch + L.part);
    for (int st = 0; st < total; st++) {
        cp_wait(nst - 2);
        __syncthreads();          // this step's copies (all threads) have landed; the oldest stage is free
        issue(st + nst - 1);
        int g, proj, ib, kc, c, nt;
        info(st, g, proj, ib, kc, c, nt);
        const uint8_t* stg = stages + (st % nst) * SB;
        const int rows = s.gnr[g];
        if (c == 0) {
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i] = 0.f;
        }
        v1_rotate_inputs(s, stg + V1<K>::TR_BYTES, stg + V1<K>::TR_BYTES + V1_ROWS_BYTES, a.x_dtype, rows, nt * 16);
        __syncthreads();
        v1_mma<K, CB>(stg, &s.buf.xs[0][0], rows, nt, warp, lane, acc);
        if (c == nch - 1) {
            const int ent0 = s.gent[g], tn = ib * 8 + warp;
            const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int n = tn * 16 + h * 8 + 2 * tig;
                if (gid < rows)
                    *reinterpret_cast<float2*>(part + size_t((kc * gr + ent0 + gid) * 2 + proj) * a.inter + n) =
                        make_float2(acc[4 * h], acc[4 * h + 1]);
                if (gid + 8 < rows)
                    *reinterpret_cast<float2*>(part + size_t((kc * gr + ent0 + gid + 8) * 2 + proj) * a.inter + n) =
                        make_float2(acc[4 * h + 2], acc[4 * h + 3]);
            }
            cta_arrive(reinterpret_cast<int*>(a.scratch + L.arr) + g * L.ib + ib, 2 * ks - 1, s);
            if (s.flag) finish_block(a, L, s, g, ib, ks, gr, false);
        }
    }
    cp_wait(0);
}

template <int K, int CB>
__device__ void v1_phase2(const Args& a, const Layout& L, Smem& s, uint8_t* stages, int nst, int ng) {
    constexpr int SB = V1<K>::STAGE_BYTES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int G = gridDim.x, b = blockIdx.x;
    const int n2 = ng * L.cb;
    // CTAs with the highest index have the fewest phase-1 items, so they take down items first
    const int first = G - 1 - b;
    const int mine = first < n2 ? (n2 - 1 - first) / G + 1 : 0;
    const int kt_total = a.inter / 16;
    const int nch = (kt_total + CHUNK_KT - 1) / CHUNK_KT;
    const int total = mine * nch;
    const int ntn = a.hidden / 16;
    const char* act = reinterpret_cast<const char*>(a.scratch + L.act);
    auto info = [&](int st, int& g, int& cb, int& c, int& nt) {
        const int ii = st / nch;
        c = st - ii * nch;
        const int j = first + ii * G;
        g = j % ng;
        cb = j / ng;
        nt = min(CHUNK_KT, kt_total - c * CHUNK_KT);
    };
    auto copy_tr = [&](int st) {
        int g, cb, c, nt;
        info(st, g, cb, c, nt);
        const int u = s.ubase[s.gexp[g]];
        v1_copy_tiles<K>(stages + (st % nst) * SB, reinterpret_cast<const char*>(s.ptr[u][6]), c * CHUNK_KT, nt, cb * 8,
                         ntn);
    };
    auto copy_act = [&](int st) {
        int g, cb, c, nt;
        info(st, g, cb, c, nt);
        v1_copy_rows(stages + (st % nst) * SB + V1<K>::TR_BYTES, act, nullptr, s.gent[g], s.gnr[g], a.inter,
                     c * CHUNK_KT * 16, nt);
    };
    // weights do not depend on phase 1: fetch them before the barrier
    for (int st = 0; st < nst - 1; st++) {
        if (st < total) copy_tr(st);
        cp_commit();
    }
    // every activation block of every group is written once all CTAs have arrived here
    {
        __syncthreads();
        int* bar = reinterpret_cast<int*>(a.scratch) + 2;
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(bar, 1);
            while (ld_acquire(bar) < G) __nanosleep(20);
        }
        __syncthreads();
    }
    for (int st = 0; st < nst - 1; st++)
        if (st < total) copy_act(st);
    cp_commit();
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float svh[4] = {0.f, 0.f, 0.f, 0.f};
    float* y = reinterpret_cast<float*>(a.scratch + L.y);
    for (int st = 0; st < total; st++) {
        cp_wait(st == 0 ? 0 : nst - 2);
        __syncthreads();
        if (st + nst - 1 < total) {
            copy_tr(st + nst - 1);
            copy_act(st + nst - 1);
        }
        cp_commit();
        int g, cb, c, nt;
        info(st, g, cb, c, nt);
        const uint8_t* stg = stages + (st % nst) * SB;
        const int rows = s.gnr[g];
        if (c == 0) {
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i] = 0.f;
            // issued now, consumed after the MMA: its latency hides behind the decode
            load4_half(reinterpret_cast<const __half*>(s.ptr[s.ubase[s.gexp[g]]][8]) + cb * 128 + 4 * lane, svh);
        }
        v1_mma<K, CB>(stg, reinterpret_cast<const __half*>(stg + V1<K>::TR_BYTES), rows, nt, warp, lane, acc);
        if (c == nch - 1) {
            const int gid = lane >> 2, tig = lane & 3, ent0 = s.gent[g];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int n = warp * 16 + h * 8 + 2 * tig;
                if (gid < rows) *reinterpret_cast<float2*>(&s.buf.ys[gid][n]) = make_float2(acc[4 * h], acc[4 * h + 1]);
                if (gid + 8 < rows)
                    *reinterpret_cast<float2*>(&s.buf.ys[gid + 8][n]) = make_float2(acc[4 * h + 2], acc[4 * h + 3]);
            }
            __syncthreads();
            for (int j = warp; j < rows; j += WARPS) {
                float v[4];
#pragma unroll
                for (int i = 0; i < 4; i++) v[i] = s.buf.ys[j][4 * lane + i];
                fwht128(v, lane);
                *reinterpret_cast<float4*>(y + size_t(ent0 + j) * a.hidden + cb * 128 + 4 * lane) =
                    make_float4(v[0] * RSQRT128 * svh[0], v[1] * RSQRT128 * svh[1], v[2] * RSQRT128 * svh[2],
                                v[3] * RSQRT128 * svh[3]);
            }
            cta_arrive(reinterpret_cast<int*>(a.scratch + L.done) + cb, ng - 1, s);
            if (s.flag) gather_block(a, L, s, cb);
        }
    }
    cp_wait(0);
}

template <int K, int CB>
__global__ void __launch_bounds__(THREADS, LNA2_MIN_BLOCKS) moe_decode_v1(Args a) {
    __shared__ Smem s;
    extern __shared__ __align__(16) uint8_t stages[];
    const Layout L = make_layout(a.hidden, a.inter);
    int* ctrl = reinterpret_cast<int*>(a.scratch);
    build_route(a, s);
    const int ng = s.ng, gr = s.gr;
    const int G = gridDim.x;
    const int kt = a.hidden / 16;
    const int ks = choose_ksplit(ng, gr, L.ib, G, kt);
    if (ng == 0) {
        for (int cb = blockIdx.x; cb < L.cb; cb += G) gather_block(a, L, s, cb);
    } else {
        v1_phase1<K, CB>(a, L, s, stages, a.stages, ng, gr, ks, kt / ks);
        v1_phase2<K, CB>(a, L, s, stages, a.stages, ng);
    }
    // retire: the last CTA out returns every control word this launch used to zero
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const int old = atomicAdd(ctrl, 1);
        s.flag = (old == G - 1);
        if (s.flag) __threadfence();
    }
    __syncthreads();
    if (s.flag) {
        int* arr = reinterpret_cast<int*>(a.scratch + L.arr);
        int* done = reinterpret_cast<int*>(a.scratch + L.done);
        for (int i = threadIdx.x; i < ng * L.ib; i += THREADS) arr[i] = 0;
        for (int i = threadIdx.x; i < L.cb; i += THREADS) done[i] = 0;
        if (threadIdx.x == 0) {
            ctrl[1] = 0;
            ctrl[2] = 0;
            ctrl[0] = 0;
        }
    }
}

// ------------------------------------------------------------------------------------------------
// host side

using KernelFn = void (*)(Args);

template <int V>
static KernelFn pick_v(int bits, int codebook) {
    if constexpr (V == 0) {
        if (bits == 2 && codebook == CB_MCG) return moe_decode_v0<2, CB_MCG>;
        if (bits == 3 && codebook == CB_MCG) return moe_decode_v0<3, CB_MCG>;
        if (bits == 2 && codebook == CB_MUL1) return moe_decode_v0<2, CB_MUL1>;
        if (bits == 3 && codebook == CB_MUL1) return moe_decode_v0<3, CB_MUL1>;
    } else {
        if (bits == 2 && codebook == CB_MCG) return moe_decode_v1<2, CB_MCG>;
        if (bits == 3 && codebook == CB_MCG) return moe_decode_v1<3, CB_MCG>;
        if (bits == 2 && codebook == CB_MUL1) return moe_decode_v1<2, CB_MUL1>;
        if (bits == 3 && codebook == CB_MUL1) return moe_decode_v1<3, CB_MUL1>;
    }
    return nullptr;
}

static KernelFn pick(int bits, int codebook, int variant) {
    return variant == 0 ? pick_v<0>(bits, codebook) : pick_v<1>(bits, codebook);
}

static int stage_bytes(int bits) { return bits == 2 ? V1<2>::STAGE_BYTES : V1<3>::STAGE_BYTES; }

// v1 takes three pipeline stages where two CTAs per SM still fit, else two (consumer Blackwell
// has ~100 KB of shared memory per SM against the H200's 228 KB).
static int v1_stages(int bits, int device) {
    int per_sm = 0;
    cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    const int need3 = 2 * (int(sizeof(Smem)) + 3 * stage_bytes(bits) + 1024);
    return per_sm >= need3 ? 3 : 2;
}

static cudaError_t prepare_fn(KernelFn fn, int variant, int bits, int device, size_t* dyn) {
    *dyn = 0;
    if (variant == 0) return cudaSuccess;
    *dyn = size_t(v1_stages(bits, device)) * stage_bytes(bits);
    return cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(*dyn));
}

cudaError_t occupancy(int bits, int codebook, int variant, int device, int n_experts, int m, int top_k,
                      int* blocks_per_sm, int* num_sms, int hidden, int inter) {
    if (is_cluster_variant(variant))
        return v7_occupancy(bits, codebook, variant, device, n_experts, m, top_k, blocks_per_sm, num_sms, hidden, inter);
    if (variant >= 2)
        return v2_occupancy(bits, codebook, variant, device, n_experts, m, top_k, blocks_per_sm, num_sms);
    KernelFn fn = pick(bits, codebook, variant);
    if (!fn) return cudaErrorInvalidValue;
    cudaError_t err = cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    size_t dyn = 0;
    err = prepare_fn(fn, variant, bits, device, &dyn);
    if (err != cudaSuccess) return err;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, fn, THREADS, dyn);
}

cudaError_t smem_bytes(int bits, int codebook, int variant, int n_experts, int m, int top_k, int hidden, int inter,
                       int* bytes) {
    if (is_cluster_variant(variant) && !is_ablation(variant))
        return v7_smem_bytes(bits, codebook, variant, n_experts, m, top_k, hidden, inter, bytes);
    if (variant >= 2 && !is_cluster_variant(variant)) return v2_smem_bytes(bits, codebook, variant, n_experts, m, top_k, bytes);
    return cudaErrorInvalidValue;
}

cudaError_t launch(const Args& a_in, int grid, cudaStream_t stream) {
    if (is_cluster_variant(a_in.variant)) return v7_launch(a_in, stream);  // sizes its own cluster grid
    if (a_in.variant >= 2) return v2_launch(a_in, grid, stream);
    KernelFn fn = pick(a_in.bits, a_in.codebook, a_in.variant);
    if (!fn) return cudaErrorInvalidValue;
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    Args a = a_in;
    a.stages = a.variant == 0 ? 0 : v1_stages(a.bits, device);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = a.variant == 0 ? 0 : size_t(a.stages) * stage_bytes(a.bits);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, fn, a);
}

const char* build_id() { return LNA2_BUILD_ID; }

}  // namespace lna2
