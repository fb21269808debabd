// lna2 v2: routed-expert MoE decode for EXL3 weights, one plain (non-cooperative) launch per layer.
//
// Why this shape (kernels/lna2/NOTES.md has the measurements behind each point):
//  * The decode of trellis states is the arithmetic that cannot be skipped, so each tile costs as
//    few issue slots as possible: the EXL3 tile order is exactly the m16n8k16 *A* fragment of the
//    transposed product out^T = W^T x^T, so one decoded tile is one MMA for up to 8 rows (the rows
//    are the MMA's N), with no wasted 16-row padding. States are pulled out of the lane's window
//    with shift/multiply forms that the compiler can put on the integer-multiply pipe, next to the
//    ALU ops of the codebook.
//  * MCG "exact sum": an MCG weight is lo + hi of two fp16 halves. Instead of adding them (and
//    packing pairs) per weight, the lop3 output (lo, hi) goes into the MMA as two k-elements, and
//    the input x_k is duplicated into both; the tensor core then sums x*lo + x*hi in fp32. That
//    drops 12 instructions per tile and computes the weight more exactly than the format's own
//    fp16 rounding of lo + hi (by at most half an fp16 ulp of the weight).
//  * Work is handed out by tickets in a fixed global order: gate/up items (group, 128-column block,
//    k-range) first, then down items (group, 128-column block of the output). A down item waits
//    only for gate/up items, whose tickets are lower and so already held by running CTAs: the wait
//    cannot deadlock whatever the residency, and no cooperative launch is needed.
//  * Trellis tiles stream through a cp.async ring completed on mbarriers, so a CTA prefetches the
//    next item (also a down item's weights before its activation exists) while it computes.
//  * Every sum has a fixed order (k-split partials, warps, top-k slots): bitwise repeatable.
//    Counters are returned to zero by their last user, so the next launch needs no host work.

#include "lna2_api.h"
#include "lna2_common.cuh"
#include "lna2_tile.cuh"

// Resident CTAs per SM the register budget is set for: 3 (80 registers, spills around the tile
// loop) for variants 2/3, 2 (up to 128 registers, no spills) for variant 4 (NOTES.md compares them).
constexpr int V2_MIN_BLOCKS = 3, V4_MIN_BLOCKS = 2;

namespace lna2 {
namespace {

constexpr int KSUB = 4;            // gate/up: warps per projection, splitting an item's k-range
constexpr int KCI_MAX = 16;        // k-tiles per chunk (one rotation of the input)
constexpr int RED_FLOATS = 4096;   // reduction buffer; aliases the B-fragment buffer
constexpr int RAW_STRIDE = KCI_MAX * 16 + 8;  // halves per staged raw input row
constexpr int XS_BYTES = RED_FLOATS * 4;      // >= 2 proj x KCI_MAX k-tiles x 32 lanes x 8 B
static_assert(2 * KCI_MAX * 32 * 8 <= XS_BYTES, "B fragments fit the buffer");
// v55's chunks of 32 k-tiles (512 input columns) where items are many: half the chunks, so half the
// staging, CTA barriers and rotation waits per tile; their B fragments fill the same buffer
constexpr int KCI_BIG = 32;
constexpr int RAW_STRIDE_BIG = KCI_BIG * 16 + 8;
constexpr int RAW_ROWS_BIG = THREADS / (KCI_BIG * 16 / 8);  // input rows one load_raw pass holds (4)
static_assert(2 * KCI_BIG * 32 * 8 <= XS_BYTES, "B fragments of a big chunk fit the buffer");
static_assert(THREADS == 256 && WARPS == 8, "the item shapes assume 8 warps");

struct Plan : RoutePlan<GR> {
    int q;                        // ticket handoff from thread 0
    int qseq;                     // which of this CTA's items s.q belongs to (read without a barrier:
                                  // both words are written and polled with shared-memory atomics)
    int flag;
};

// Dynamic shared memory, laid out the same way on host and device.
struct Dyn {
    int ring, xs, raw, ptr, bar, total;
};

// 8 tiles of one k-tile row, or of kt consecutive k-tiles (v54's rows hold two)
__host__ __device__ inline int ring_row_bytes(int bits, int kt = 1) { return 256 * bits * kt; }

__host__ __device__ inline Dyn dyn_layout(int bits, int stages, int ucap, int kt = 1, bool big = false) {
    Dyn d{};
    int off = 0;
    d.ring = off; off += stages * WARPS * ring_row_bytes(bits, kt);
    d.xs = off;   off += XS_BYTES;
    d.raw = off;  off += big ? GR * RAW_STRIDE_BIG * 2 + 2 * KCI_BIG * 16 * 2 : GR * RAW_STRIDE * 2 + 2 * KCI_MAX * 16 * 2;
    off = (off + 15) & ~15;
    d.ptr = off;  off += ucap * 9 * 8;
    off = (off + 15) & ~15;
    d.bar = off;  off += WARPS * stages * 8;  // one mbarrier per warp and slot
    d.total = (off + 15) & ~15;
    return d;
}


// ------------------------------------------------------------------------------------------------
// work items

enum Kind : int { IT_NONE = 0, IT_GU = 1, IT_DN = 2, IT_ZERO = 3 };

struct Cfg {
    int N1, N2, N;          // gate/up items, down items, all items
    int KS, R, KCI, kws;    // gate/up: k-splits, chunks per item, k-tiles per chunk, log2 k-tiles per warp per chunk
    int n_ib, n_cb;         // 128-blocks of I and H
    int KSd, KWd;           // down: k-splits, k-tiles per warp per item
    int DB, WB, wbs;        // down: 128-column output blocks per item (1 or 2), warps per block, log2(WB)
};

struct Item {
    int kind, g, u, blk, kc, nst;  // u: the expert's compact index (pointer cache row); blk: ib for
                                   // gate/up, cb for down/zero; kc: the item's k-split
    const char* src;               // this warp's first trellis row (set by V2Kernel::locate)
};

template <class Pl>
__device__ __forceinline__ Item item_of(int t, const Cfg& c, int ng, const Pl& s) {
    Item it{IT_NONE, 0, 0, 0, 0, 0};  // a down item's blk is its block pair when c.DB == 2
    if (t >= c.N) return it;
    if (ng == 0) {
        it.kind = IT_ZERO;
        it.blk = t;
        return it;
    }
    if (t < c.N1) {  // (group, ib, kc), kc fastest: the k-splits of one block run side by side
        const int per_g = c.n_ib * c.KS;
        it.kind = IT_GU;
        it.g = t / per_g;
        const int r = t - it.g * per_g;
        it.blk = r / c.KS;
        it.kc = r - it.blk * c.KS;
        it.nst = c.R << c.kws;
    } else {  // (group, cb, k-split)
        const int d = t - c.N1, per_g = (c.n_cb >> (c.DB - 1)) * c.KSd;
        it.kind = IT_DN;
        it.g = d / per_g;
        const int r = d - it.g * per_g;
        it.blk = r / c.KSd;
        it.kc = r - it.blk * c.KSd;
        it.nst = c.KWd;
    }
    it.u = s.ubase[s.gexp[it.g]];
    return it;
}

// BIG (v55): chunks of 32 k-tiles wherever one-chunk items would still be enough items
template <bool BIG = false>
__device__ __forceinline__ Cfg make_cfg(const Args& a, int ng, int gr, int G) {
    Cfg c{};
    c.n_ib = a.inter / 128;
    c.n_cb = a.hidden / 128;
    const int kt = a.hidden / 16;
    const int target = max(1, G * a.items_x8 / 8);
    c.KCI = (kt % 16 == 0) ? 16 : 8;
    if (c.KCI == 16 && ng * c.n_ib * (kt / 16) < target) c.KCI = 8;  // finer items when few groups
    if constexpr (BIG) {
        if (c.KCI == 16 && kt % KCI_BIG == 0 && ng * c.n_ib * (kt / KCI_BIG) >= target) c.KCI = KCI_BIG;
        c.kws = c.KCI == KCI_BIG ? 3 : c.KCI == 16 ? 2 : 1;
    } else {
        c.kws = c.KCI == 16 ? 2 : 1;
    }
    const int nchunk = kt / c.KCI;
    int ks = nchunk;
    while (ks % 2 == 0 && (ng * c.n_ib * (ks / 2) >= target || ks * gr > V2_PART_CAP)) ks /= 2;
    if (ks * gr > V2_PART_CAP) ks = 1;  // an odd chunk count that cannot be halved
    c.KS = ks;
    c.R = nchunk / ks;
    // down: split k (each split writes its own y partial) while items are few and each warp keeps
    // at least two k-tiles
    int ksd = 1;
    while (ksd < V2_DOWN_SPLITS && ng * c.n_cb * ksd < target && c.n_ib % (2 * ksd) == 0 && c.n_ib / (2 * ksd) >= 2)
        ksd *= 2;
    c.KSd = ksd;
    // Two output blocks per down item (4 warps each) when there are at least 4 short down items per
    // CTA (the TP8 slice from ~8 rows): half the items, so half the per-item waits, activation
    // loads, reductions and arrivals, which the 2026-12-03 ablations found to be most of the down
    // phase. With fewer items per CTA pairing measured 3-8 % slower (TP8 4 rows).
    c.DB = (a.pair_down && ksd == 1 && c.n_cb % 2 == 0 && c.n_ib <= 4 && ng * c.n_cb >= 4 * G) ? 2 : 1;
    c.wbs = c.DB == 2 ? 2 : 3;
    c.WB = 1 << c.wbs;
    c.KWd = c.n_ib * 8 / (c.WB * ksd);  // (I/16)/KSd k-tiles over the block's warps
    c.N1 = ng * c.n_ib * c.KS;
    c.N2 = ng * (c.n_cb / c.DB) * c.KSd;
    c.N = ng ? c.N1 + c.N2 : c.n_cb;
    return c;
}

// ------------------------------------------------------------------------------------------------
// the kernel

// Ring slots per warp (a power of two: slot and phase are bit fields of the stage index). 8 slots
// measured no faster anywhere and up to 15 % slower (2026-12-03 run 2, NOTES.md): the stalls are
// not the trellis bytes in flight.
constexpr int S = 4;

enum Event : int {  // trace events (Args::trace); the ticket rides in the upper bits
    EV_START = 0, EV_PLAN = 1, EV_ITEM = 2, EV_STAGE0 = 3, EV_MMA = 4, EV_ARRIVED = 5, EV_FINISHED = 6,
    EV_READY = 7, EV_GATHERED = 8, EV_EXIT = 9, EV_NEXT = 10
};

// PRM: K2's byte-permute state extraction (states8<2, true>).
// GRP: each warp's ring completes on cp.async commit groups (one per row) instead of mbarriers, and a
// step whose only due row is the current item's next issues it without issue_due's loop (variant 53).
// KT2 (with GRP): a ring row is two consecutive k-tiles of the warp's share, 16 tiles, so each ring
// step, row address and loop turn serves twice the tiles (variant 54). The k order of every warp's
// sums is unchanged, so its outputs are v53's bit for bit.
// KC32 (with KT2): gate/up chunks of 32 k-tiles where items are many (make_cfg<true>), so a warp
// runs four ring rows between two chunk stagings instead of two (variant 55). Each warp's k-tiles
// change (eight consecutive of a 32-tile chunk instead of four of a 16-tile one), so its bits are
// not v54's.
template <int K, int CB, bool DUP, int ABL, bool PRM = false, bool GRP = false, bool KT2 = false, bool KC32 = false>
struct V2Kernel {
    static_assert(!KT2 || GRP, "two-k-tile rows are built on v53's commit-group ring");
    static_assert(!KC32 || KT2, "32-k-tile chunks are built on v54's two-k-tile rows");
    static constexpr int KCAP = KC32 ? KCI_BIG : KCI_MAX;         // k-tiles a chunk may hold
    static constexpr int RSTR = KC32 ? RAW_STRIDE_BIG : RAW_STRIDE;  // halves per staged raw input row
    static constexpr int TILE = 32 * K;   // bytes per tile
    static constexpr int ROW8 = 8 * TILE;  // bytes of 8 tiles of one k-tile
    static constexpr int KTR = KT2 ? 2 : 1;  // k-tiles per ring row
    static constexpr int ROW = KTR * ROW8;   // bytes of a ring row
    static constexpr int PIECES = ROW8 / 16;

    const Args& a;
    const LayoutV2 L;
    Plan& s;
    uint8_t* dyn;
    Dyn D;
    const void** ptr;
    uint64_t* bar;
    Cfg c;
    int G, ng;
    // scheduling state, the same in every thread of the CTA
    Item cur, nxt;
    bool nxt_known;     // this warp knows the item after the current one (else its claim is in flight)
    int item_seq;       // items this CTA has started (the key of s.qseq)
    bool published;     // thread 0: this item's claim is in s.q
    bool done_claiming; // this CTA will claim no more tickets
    bool raw_ready;     // rx/rs hold chunk 0 of the next gate/up item to run
    bool regs_free;     // rx/rs may be overwritten (the current item needs no more raw chunks)
    int base_cur, issued, q;
    // thread 0 only
    int pending, ret_old, nev;
    // the next chunk's raw inputs, loaded ahead into registers
    uint4 rx;
    uint32_t rs;
    uint32_t rs_hi;  // KC32: a 32-k-tile chunk's scales are two words a thread

    __device__ V2Kernel(const Args& a_, Plan& s_, uint8_t* dyn_)
        : a(a_), L(make_layout_v2(a_.hidden, a_.inter)), s(s_), dyn(dyn_) {}

    __device__ const void* P(int g, int i) const { return ptr[s.ubase[s.gexp[g]] * 9 + i]; }

    __device__ void trace(int ev, int ticket) { trace_event(a, nev, ev, ticket); }

    // ---- producer: each warp streams its own trellis rows (8 tiles of one k-tile) through its own
    // ring slots and mbarriers, so no stage needs a CTA-wide barrier
    __device__ uint8_t* slot_row(int slot) const { return dyn + D.ring + ((threadIdx.x >> 5) * S + slot) * ROW; }

    // This warp's first trellis row of an item, once per item: copy_row runs at every stage of both
    // phases (a gate/up stage may be prefetching a down item), so its per-stage part is kept to an
    // offset from here (NOTES.md: the per-stage index arithmetic showed up at TP1).
    __device__ void locate(Item& it) const {
        const int w = threadIdx.x >> 5;
        if (it.kind == IT_GU) {
            const int kt0 = it.kc * c.R * c.KCI + (w >> 1) * (1 << c.kws);
            it.src = reinterpret_cast<const char*>(ptr[it.u * 9 + ((w & 1) ? 3 : 0)]) +
                     (size_t(kt0) * (a.inter / 16) + it.blk * 8) * TILE;
        } else if (it.kind == IT_DN) {
            const int kt0 = (it.kc * c.WB + (w & (c.WB - 1))) * c.KWd;
            const int cb = it.blk * c.DB + (w >> c.wbs);
            it.src = reinterpret_cast<const char*>(ptr[it.u * 9 + 6]) + (size_t(kt0) * (a.hidden / 16) + cb * 8) * TILE;
        }
        if constexpr (KT2) {  // item_of counts one-k-tile steps; a KT2 row takes two (a down share may be odd)
            if (it.kind == IT_GU) it.nst = c.R << (c.kws - 1);
            else if (it.kind == IT_DN) it.nst = (c.KWd + 1) >> 1;
        }
    }

    // KIND: the item's kind when the caller knows it (GRP's steady step), else IT_NONE (look it up).
    // With a known kind the row's offset is computed in 32 bits (an expert's projection is at most
    // 48 MiB of trellis: K3 at the binding's limits, hidden 16384 and intermediate 8192), without the
    // sign fix of a signed division.
    template <int KIND = IT_NONE>
    __device__ void copy_row(const Item& it, int st, int slot) {
        if constexpr (KT2) {
            copy_row2<KIND>(it, st, slot);
            return;
        }
        const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const char* src;
        if constexpr (KIND == IT_GU)
            src = it.src + (unsigned((st >> c.kws) * c.KCI + (st & ((1 << c.kws) - 1))) * (unsigned(a.inter) >> 4) *
                            unsigned(TILE));
        else if constexpr (KIND == IT_DN)
            src = it.src + unsigned(st) * (unsigned(a.hidden) >> 4) * unsigned(TILE);
        else if (it.kind == IT_GU)  // stage st: chunk st >> kws, k-tile st & (kw - 1) of this warp's share
            src = it.src + size_t((st >> c.kws) * c.KCI + (st & ((1 << c.kws) - 1))) * (a.inter / 16) * TILE;
        else
            src = it.src + size_t(st) * (a.hidden / 16) * TILE;
        uint8_t* dst = slot_row(slot);
        if constexpr ((ABL & ABL_NO_COPY) == 0)
            for (int p = lane; p < PIECES; p += 32) cp16(dst + p * 16, src + p * 16);
        if constexpr (GRP) {
            (void)w;
            cp_commit();  // one group per row and lane, in issue order: the wait counts rows
        } else {
            mbar_arrive_cp(bar + (w * S + slot));
        }
    }

    // KT2's row st: k-tiles 2st and 2st + 1 of the warp's share (gate/up: of chunk st >> (kws - 1)),
    // each 8 contiguous tiles in global memory, one after the other in the slot. A down share of odd
    // length leaves its last row half filled (run_dn does not read that half).
    template <int KIND = IT_NONE>
    __device__ void copy_row2(const Item& it, int st, int slot) {
        const int lane = threadIdx.x & 31;
        const bool gu = KIND == IT_GU || (KIND == IT_NONE && it.kind == IT_GU);
        const int ksh = c.kws - 1;
        const unsigned kt = gu ? unsigned((st >> ksh) * c.KCI + ((st & ((1 << ksh) - 1)) << 1)) : unsigned(st) << 1;
        const unsigned pitch = (gu ? unsigned(a.inter) >> 4 : unsigned(a.hidden) >> 4) * unsigned(TILE);
        const char* src = it.src + kt * pitch;  // 32-bit: see copy_row
        const bool second = gu || int(kt) + 1 < c.KWd;
        uint8_t* dst = slot_row(slot);
        for (int p = lane; p < PIECES; p += 32) {
            cp16(dst + p * 16, src + p * 16);
            if (second) cp16(dst + ROW8 + p * 16, src + pitch + p * 16);
        }
        cp_commit();
    }

    // Issue this warp's rows up to S-1 stages ahead, within the items it knows. The caller makes
    // sure every lane is done reading the slots being refilled (__syncwarp or a CTA barrier).
    __device__ void issue_due() {
        const int base_nxt = base_cur + cur.nst;
        const int horizon = (nxt_known ? base_nxt + nxt.nst : base_nxt) - 1;
        const int limit = min(q + S - 1, horizon);
        for (; issued <= limit; issued++) {
            if (issued < base_nxt) copy_row(cur, issued - base_cur, issued & (S - 1));
            else copy_row(nxt, issued - base_nxt, issued & (S - 1));
        }
    }

    // GRP: wait for this lane's copies of row q; `newer` rows were issued after it (0 .. S - 1), and
    // each row is one commit group, so at most that many groups may stay in flight.
    __device__ __forceinline__ static void ring_wait(int newer) {
        static_assert(S == 4, "ring_wait spells out the group counts of a 4-slot ring");
        if (newer >= 3) asm volatile("cp.async.wait_group 3;\n" ::: "memory");
        else if (newer == 2) asm volatile("cp.async.wait_group 2;\n" ::: "memory");
        else if (newer == 1) asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        else asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    }

    // The next ticket's number is in s.q (published for this item): learn it.
    __device__ void learn_next() {
        const int tk = atomicAdd(&s.q, 0);
        nxt = item_of(tk, c, ng, s);
        locate(nxt);
        nxt_known = true;
        trace(EV_NEXT, tk);
        if (nxt.kind == IT_NONE) {
            done_claiming = true;
            if (threadIdx.x == 0) ret_old = atomicAdd(reinterpret_cast<int*>(a.scratch + L.ticket) + 1, 1);
        } else if (nxt.kind == IT_GU && regs_free && !raw_ready) {
            load_raw(nxt, 0);
            raw_ready = true;
        }
    }

    // Thread 0 publishes the claim for the item after the current one (it may wait for its atomic,
    // behind a stage wait anyway); each warp learns it at its next step that sees it.
    __device__ void publish() {
        if (threadIdx.x == 0 && !published) {
            atomicExch(&s.q, pending);
            __threadfence_block();
            atomicExch(&s.qseq, item_seq);
            published = true;
        }
    }

    // One consumer step of this warp: learn the next item if published, refill, wait for this stage.
    // KIND: the current item's kind (GRP's steady step uses it to skip the lookup).
    template <int KIND>
    __device__ const uint32_t* step() {
        if (!nxt_known && atomicAdd(&s.qseq, 0) == item_seq) {
            __threadfence_block();
            learn_next();
        }
        __syncwarp();  // every lane is done with the stage whose slot is refilled now
        if constexpr (GRP) {
            // In the steady state exactly one row is due, S - 1 ahead of this one, and it is the
            // current item's: issue it without issue_due's loop (which would issue the same row);
            // then S - 1 rows are newer than this one.
            if (issued == q + S - 1 && issued < base_cur + cur.nst) {
                copy_row<KIND>(cur, issued - base_cur, issued & (S - 1));
                issued++;
                publish();
                ring_wait(S - 1);
            } else {
                issue_due();
                publish();
                ring_wait(issued - 1 - q);
            }
            __syncwarp();  // each lane's copies of the row are complete; this shows them to the warp
        } else {
            issue_due();
            publish();
        }
        const int slot = q & (S - 1);
        if constexpr (!GRP) mbar_wait(bar + ((threadIdx.x >> 5) * S + slot), (q / S) & 1);
        q++;
        return reinterpret_cast<const uint32_t*>(slot_row(slot));
    }

    // ---- raw inputs of one gate/up chunk, loaded into registers ahead of use

    // The input column where chunk ch of a gate/up item starts (cols: c.KCI * 16, which the callers
    // already hold; recomputing it here changes v55's register allocation).
    __device__ int chunk_k0(const Item& it, int ch, int cols) const { return (it.kc * c.R + ch) * cols; }
    // Eight inputs of routed row `row` (pieces of eight from column k0).
    __device__ uint4 x8(size_t row, int k0, int piece) const {
        return __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const __half*>(a.x) + row * a.hidden + k0 + piece * 8));
    }
    // The gate (proj 0) or up (proj 1) suh vector from column k0, as words of two scales.
    __device__ const uint32_t* suh_at(const Item& it, int proj, int k0) const {
        return reinterpret_cast<const uint32_t*>(reinterpret_cast<const __half*>(P(it.g, proj ? 4 : 1)) + k0);
    }

    __device__ void load_raw(const Item& it, int ch) {
        if constexpr (KC32) {
            load_raw_big(it, ch);
            return;
        }
        const int t = threadIdx.x;
        const int cols = c.KCI * 16;
        const int k0 = chunk_k0(it, ch, cols);
        const int j = t >> 5, piece = t & 31;
        if (j < s.gnr[it.g] && piece * 8 < cols) rx = x8(s.grows[it.g][j], k0, piece);
        const int proj = t >> 7, idx = t & 127;
        if (idx * 2 < cols) rs = __ldg(suh_at(it, proj, k0) + idx);
    }

    __device__ void store_raw(const Item& it, int ch) {
        if constexpr (KC32) {
            store_raw_big(it, ch);
            return;
        }
        const int t = threadIdx.x;
        const int cols = c.KCI * 16;
        __half* rawx = reinterpret_cast<__half*>(dyn + D.raw);
        __half* raws = rawx + GR * RAW_STRIDE;
        const int j = t >> 5, piece = t & 31;
        if (j < s.gnr[it.g] && piece * 8 < cols) *reinterpret_cast<uint4*>(rawx + j * RAW_STRIDE + piece * 8) = rx;
        const int proj = t >> 7, idx = t & 127;
        if (idx * 2 < cols) *reinterpret_cast<uint32_t*>(raws + proj * KCI_MAX * 16 + idx * 2) = rs;
    }

    // KC32's staging, for chunks of 8, 16 or 32 k-tiles: a row's pieces of 8 inputs go to 2^(kws+3)
    // consecutive threads, so one pass holds 256 / that rows (4 at 32 k-tiles; a group's rows past
    // those are read in store_raw, unprefetched: only groups of more than four rows have them);
    // the two projections' scales are one or two words a thread (128 threads each; two as one 8-byte
    // load, so the gate / up suh vectors must be 8-byte aligned, as svh's uint2 reads already assume).
    __device__ void load_raw_big(const Item& it, int ch) {
        const int t = threadIdx.x;
        const int cols = c.KCI * 16;
        const int k0 = chunk_k0(it, ch, cols);
        const int psh = c.kws + 3;
        const int j = t >> psh, piece = t & ((1 << psh) - 1);
        if (j < s.gnr[it.g]) rx = x8(s.grows[it.g][j], k0, piece);
        const int proj = t >> 7, idx = t & 127;
        const uint32_t* sp = suh_at(it, proj, k0);
        if (c.KCI == KCI_BIG) {
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(sp) + idx);
            rs = v.x;
            rs_hi = v.y;
        } else if (idx * 2 < cols) {
            rs = __ldg(sp + idx);
        }
    }

    __device__ void store_raw_big(const Item& it, int ch) {
        const int t = threadIdx.x;
        const int cols = c.KCI * 16;
        __half* rawx = reinterpret_cast<__half*>(dyn + D.raw);
        __half* raws = rawx + GR * RSTR;
        const int psh = c.kws + 3;
        const int j = t >> psh, piece = t & ((1 << psh) - 1);
        const int rows = s.gnr[it.g];
        if (j < rows) *reinterpret_cast<uint4*>(rawx + j * RSTR + piece * 8) = rx;
        if (c.KCI == KCI_BIG) {
            const int k0 = chunk_k0(it, ch, cols);  // the rows one pass did not hold
            for (int jj = j + RAW_ROWS_BIG; jj < rows; jj += RAW_ROWS_BIG)
                *reinterpret_cast<uint4*>(rawx + jj * RSTR + piece * 8) = x8(s.grows[it.g][jj], k0, piece);
        }
        const int proj = t >> 7, idx = t & 127;
        uint32_t* sd = reinterpret_cast<uint32_t*>(raws + proj * KCAP * 16);
        if (c.KCI == KCI_BIG) *reinterpret_cast<uint2*>(sd + 2 * idx) = make_uint2(rs, rs_hi);
        else if (idx * 2 < cols) sd[idx] = rs;
    }

    // x * suh, 128-point Hadamard, into B-fragment order: xs[proj][kt][lane][2] words.
    __device__ void rotate(const Item& it) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int rows = s.gnr[it.g];
        const int nblk = c.KCI / 8;
        const uint8_t* rawx = dyn + D.raw;
        const uint8_t* raws = rawx + GR * RSTR * 2;
        uint32_t* xs = reinterpret_cast<uint32_t*>(dyn + D.xs);
        for (int task = warp; task < 2 * rows * nblk; task += WARPS) {
            const int proj = task & 1, rest = task >> 1;
            const int j = rest % rows, blk = rest / rows;
            const int k = blk * 128 + 4 * lane;
            float v[4], sc[4];
            load4_raw(rawx + (j * RSTR + k) * 2, a.x_dtype, v);
            load4_raw(raws + (proj * KCAP * 16 + k) * 2, DT_F16, sc);
#pragma unroll
            for (int i = 0; i < 4; i++) v[i] *= sc[i];
            fwht128(v, lane);
#pragma unroll
            for (int i = 0; i < 4; i++) v[i] *= RSQRT128;
            store_frag_pairs(xs + (proj * KCAP + blk * 8 + (lane >> 2)) * 64, j, lane, v);
        }
    }

    // One chunk of a gate/up item for this warp: its projection's share of the chunk's k-tiles, one
    // ring step each, B fragments from xb (the chunk's rotated inputs).
    __device__ __forceinline__ void gu_chunk(const uint32_t* xb, int ch, int ticket, int w0i, int w1i, int sh,
                                             float (&acc)[8][4]) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int proj = warp & 1, ksub = warp >> 1;
        const int kw = 1 << c.kws;
        if constexpr (KT2) {
            for (int sub = 0; sub < kw; sub += 2) {
                const uint32_t* row = step<IT_GU>();
                if (ch == 0 && sub == 0) trace(EV_STAGE0, ticket);
                const uint2* xk = reinterpret_cast<const uint2*>(xb) + (proj * KCAP + ksub * kw + sub) * 32 + lane;
                uint32_t b[4];
                b_frag<CB, DUP>(xk[0], b);
                mma_row<K, CB, DUP, ABL, PRM>(row, b, w0i, w1i, sh, a, acc);
                b_frag<CB, DUP>(xk[32], b);
                mma_row<K, CB, DUP, ABL, PRM>(row + ROW8 / 4, b, w0i, w1i, sh, a, acc);
            }
        } else {
            for (int sub = 0; sub < kw; sub++) {
                const uint32_t* row = step<IT_GU>();
                if (ch == 0 && sub == 0) trace(EV_STAGE0, ticket);
                uint32_t b[4];
                b_frag<CB, DUP>(*reinterpret_cast<const uint2*>(xb + ((proj * KCI_MAX + ksub * kw + sub) * 32 + lane) * 2),
                                b);
                mma_row<K, CB, DUP, ABL, PRM>(row, b, w0i, w1i, sh, a, acc);
            }
        }
    }

    // ---- gate/up item: partial GEMV over its k-range for both projections, 8 n-tiles each
    __device__ void run_gu(const Item& it, int ticket) {
        const int lane = threadIdx.x & 31;
        int w0i, w1i, sh;
        lane_window<K>(lane, w0i, w1i, sh);
        float acc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
        const uint32_t* xs = reinterpret_cast<const uint32_t*>(dyn + D.xs);
        __syncwarp();
        issue_due();                      // the trellis is in flight while the raw inputs arrive
        if (!raw_ready) load_raw(it, 0);  // not prefetched: the next item was learnt too late
        raw_ready = false;
        regs_free = false;
        for (int ch = 0; ch < c.R; ch++) {
            __syncthreads();  // the previous chunk's MMAs and rotation are done with xs and raw
            store_raw(it, ch);
            __syncthreads();
            if (ch + 1 < c.R) {
                load_raw(it, ch + 1);
            } else {
                regs_free = true;
                if (nxt_known && nxt.kind == IT_GU) {
                    load_raw(nxt, 0);
                    raw_ready = true;
                }
            }
            rotate(it);
            __syncthreads();  // the rotated inputs are every warp's B fragments
            gu_chunk(xs, ch, ticket, w0i, w1i, sh, acc);
        }
        trace(EV_MMA, ticket);
        epilogue_gu(it, acc, ticket);
    }

    __device__ bool arrive(int* counter, int last_old) {
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            const int old = atomicAdd(counter, 1);
            const int last = old == last_old;
            if (last) {
                *counter = 0;  // its last user: nobody else touches it in this launch
                __threadfence();
            }
            s.flag = last;
        }
        __syncthreads();
        return s.flag;
    }

    __device__ void epilogue_gu(const Item& it, const float (&acc)[8][4], int ticket) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int rows = s.gnr[it.g], ent0 = s.gent[it.g];
        float* red = reinterpret_cast<float*>(dyn + D.xs);
        float* part = reinterpret_cast<float*>(a.scratch + L.part);
        for (int rc = 0; rc * 4 < rows; rc++) {
            __syncthreads();
            write_red(red, rc, acc);
            __syncthreads();
            const int proj = warp & 1, rr = warp >> 1, r = rc * 4 + rr;
            if (r < rows) {
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                for (int ks = 0; ks < KSUB; ks++) {
                    const float4 x = *reinterpret_cast<const float4*>(red + (2 * ks + proj) * 512 + rr * 128 + 4 * lane);
                    v.x += x.x; v.y += x.y; v.z += x.z; v.w += x.w;
                }
                *reinterpret_cast<float4*>(part + (size_t(it.kc * s.gr + ent0 + r) * 2 + proj) * a.inter +
                                           it.blk * 128 + 4 * lane) = v;
            }
        }
        // the finisher's gate/up svh and down suh (cold in HBM) travel during the arrival
        const int col = it.blk * 128 + 4 * lane;
        const uint2 sc[3] = {ld_early(reinterpret_cast<const __half*>(P(it.g, 2)) + col),
                             ld_early(reinterpret_cast<const __half*>(P(it.g, 5)) + col),
                             ld_early(reinterpret_cast<const __half*>(P(it.g, 7)) + col)};
        int* arr = reinterpret_cast<int*>(a.scratch + L.arr) + it.g * MAX_IB + it.blk;
        const bool last = arrive(arr, c.KS - 1);
        trace(EV_ARRIVED, ticket);
        if (last) {
            finish(it, sc);
            trace(EV_FINISHED, ticket);
        }
    }

    // The last gate/up item of (group, block): sum the k-split partials in a fixed order, rotate
    // back (Hadamard, svh), DeepSeek-V4's clamped SwiGLU, times down suh, Hadamard into the down
    // input, stored in B-fragment order; then publish the block.
    __device__ void finish(const Item& it, const uint2 (&sc)[3]) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int rows = s.gnr[it.g], ent0 = s.gent[it.g];
        const int col = it.blk * 128 + 4 * lane;
        float sg[4], su[4], sd[4];
        half4(sc[0], sg);
        half4(sc[1], su);
        half4(sc[2], sd);
        const int wpr = rows == 1 ? 8 : rows == 2 ? 4 : rows <= 4 ? 2 : 1;  // warps sharing a row's k-splits
        const int j = warp / wpr, sub = warp % wpr;
        const float* part = reinterpret_cast<const float*>(a.scratch + L.part);
        float gv[4] = {0.f, 0.f, 0.f, 0.f}, uv[4] = {0.f, 0.f, 0.f, 0.f};
        if (j < rows) {
#pragma unroll 4
            for (int kc = sub; kc < c.KS; kc += wpr) {
                const float* p = part + size_t((kc * s.gr + ent0 + j) * 2) * a.inter + col;
                const float4 x = __ldcg(reinterpret_cast<const float4*>(p));
                const float4 y = __ldcg(reinterpret_cast<const float4*>(p + a.inter));
                gv[0] += x.x; gv[1] += x.y; gv[2] += x.z; gv[3] += x.w;
                uv[0] += y.x; uv[1] += y.y; uv[2] += y.z; uv[3] += y.w;
            }
        }
        float* red = reinterpret_cast<float*>(dyn + D.xs);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 4; i++) {
            red[(warp * 2 + 0) * 128 + 4 * lane + i] = gv[i];
            red[(warp * 2 + 1) * 128 + 4 * lane + i] = uv[i];
        }
        __syncthreads();
        if (sub == 0 && j < rows) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float gs = 0.f, us = 0.f;
                for (int w = 0; w < wpr; w++) {
                    gs += red[((warp + w) * 2 + 0) * 128 + 4 * lane + i];
                    us += red[((warp + w) * 2 + 1) * 128 + 4 * lane + i];
                }
                gv[i] = gs;
                uv[i] = us;
            }
            float av[4];
            swiglu_rotate(gv, uv, sg, su, sd, a.swiglu_limit, lane, av);
            uint32_t* act = reinterpret_cast<uint32_t*>(a.scratch + L.act) + size_t(it.g) * (a.inter / 16) * 64;
            store_frag_pairs(act + (it.blk * 8 + (lane >> 2)) * 64, j, lane, av);
        }
        __syncthreads();
        // without down items nobody would return the ready word to zero for the next launch
        if (threadIdx.x == 0 && (ABL & ABL_NO_DOWN) == 0) {
            __threadfence();
            atomicAdd(reinterpret_cast<int*>(a.scratch + L.ready) + it.g, 1);
        }
    }

    // ---- down item: the group's activation x down weights, one 128-column block of the output
    // and one k-split of the intermediate
    __device__ void run_dn(const Item& it, int ticket) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        int w0i, w1i, sh;
        lane_window<K>(lane, w0i, w1i, sh);
        regs_free = true;
        const int cb = it.blk * c.DB + (warp >> c.wbs);  // this warp's output block
        const uint2 svh_raw = __ldg(reinterpret_cast<const uint2*>(reinterpret_cast<const __half*>(P(it.g, 8)) +
                                                                  cb * 128 + 4 * lane));
        __syncwarp();
        issue_due();  // the down weights stream in while the activation is being made
        int* ready = reinterpret_cast<int*>(a.scratch + L.ready) + it.g;
        int ack_old = 0;
        if (threadIdx.x == 0) {
            for (unsigned spin = 0; ld_acquire(ready) < c.n_ib; spin++) {
                if (spin > SPIN_LIMIT) __trap();
                __nanosleep(32);
            }
            ack_old = atomicAdd(reinterpret_cast<int*>(a.scratch + L.ack) + it.g, 1);  // consumed at the end
        }
        __syncthreads();
        trace(EV_READY, ticket);
        const uint32_t* act = reinterpret_cast<const uint32_t*>(a.scratch + L.act) +
                              size_t(it.g) * (a.inter / 16) * 64 + lane * 2;
        const int kt0 = (it.kc * c.WB + (warp & (c.WB - 1))) * c.KWd;
        uint2 bq0 = ldcg2(act + kt0 * 64), bq1 = make_uint2(0u, 0u);
        if (c.KWd > 1) bq1 = ldcg2(act + (kt0 + 1) * 64);
        float acc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
        if constexpr (KT2) {
            // bq0 / bq1: this row's two k-tiles; the next row's are requested before its MMAs
            for (int st = 0; st < c.KWd; st += 2) {
                const uint32_t* row = step<IT_DN>();
                uint2 nq0 = make_uint2(0u, 0u), nq1 = make_uint2(0u, 0u);
                if (st + 2 < c.KWd) nq0 = ldcg2(act + (kt0 + st + 2) * 64);
                if (st + 3 < c.KWd) nq1 = ldcg2(act + (kt0 + st + 3) * 64);
                uint32_t b[4];
                b_frag<CB, DUP>(bq0, b);
                mma_row<K, CB, DUP, ABL, PRM>(row, b, w0i, w1i, sh, a, acc);
                if (st + 1 < c.KWd) {
                    b_frag<CB, DUP>(bq1, b);
                    mma_row<K, CB, DUP, ABL, PRM>(row + ROW8 / 4, b, w0i, w1i, sh, a, acc);
                }
                bq0 = nq0;
                bq1 = nq1;
            }
        } else {
            for (int st = 0; st < c.KWd; st++) {
                const uint32_t* row = step<IT_DN>();
                uint32_t b[4];
                b_frag<CB, DUP>(bq0, b);
                bq0 = bq1;
                if (st + 2 < c.KWd) bq1 = ldcg2(act + (kt0 + st + 2) * 64);
                mma_row<K, CB, DUP, ABL, PRM>(row, b, w0i, w1i, sh, a, acc);
            }
        }
        trace(EV_MMA, ticket);
        epilogue_dn(it, acc, svh_raw, ticket);
        if (threadIdx.x == 0 && ack_old == (c.n_cb >> (c.DB - 1)) * c.KSd - 1) {
            // every down item of this group has seen it ready: return the group's words to zero
            *ready = 0;
            reinterpret_cast<int*>(a.scratch + L.ack)[it.g] = 0;
        }
    }

    __device__ void epilogue_dn(const Item& it, const float (&acc)[8][4], uint2 svh_raw, int ticket) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int rows = s.gnr[it.g], ent0 = s.gent[it.g];
        float* red = reinterpret_cast<float*>(dyn + D.xs);
        float* y = reinterpret_cast<float*>(a.scratch + L.y);
        const size_t split = size_t(MAX_PAIRS) * a.hidden;
        const float2 s01 = __half22float2(u2h(svh_raw.x)), s23 = __half22float2(u2h(svh_raw.y));
        const float svh[4] = {s01.x, s01.y, s23.x, s23.y};
        for (int rc = 0; rc * 4 < rows; rc++) {
            __syncthreads();
            write_red(red, rc, acc);
            __syncthreads();
            // warp (bsel, rr) sums row rc*4 + rr of output block bsel over that block's warps, in order
            const int rr = warp & 3, bsel = c.DB == 2 ? warp >> 2 : 0, r = rc * 4 + rr;
            if ((c.DB == 2 || warp < 4) && r < rows) {
                float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int i = 0; i < WARPS; i++) {
                    if (i < c.WB) {
                        const float4 x = *reinterpret_cast<const float4*>(red + (bsel * c.WB + i) * 512 + rr * 128 + 4 * lane);
                        v[0] += x.x; v[1] += x.y; v[2] += x.z; v[3] += x.w;
                    }
                }
                fwht128(v, lane);
                const int cb = it.blk * c.DB + bsel;  // == this warp's own block, whose svh it holds
                *reinterpret_cast<float4*>(y + it.kc * split + size_t(ent0 + r) * a.hidden + cb * 128 + 4 * lane) =
                    make_float4(v[0] * RSQRT128 * svh[0], v[1] * RSQRT128 * svh[1], v[2] * RSQRT128 * svh[2],
                                v[3] * RSQRT128 * svh[3]);
            }
        }
        // one arrival counter per item's first block: the last of the ng x KSd items over it gathers
        int* done = reinterpret_cast<int*>(a.scratch + L.done) + it.blk * c.DB;
        const bool last = arrive(done, ng * c.KSd - 1);
        trace(EV_ARRIVED, ticket);
        if (last) {
            for (int b = 0; b < c.DB; b++) gather_cols(a, y, s, it.blk * c.DB + b, c.KSd, split);
            trace(EV_GATHERED, ticket);
        }
    }

    // ---- the whole launch
    // Tickets are claimed from a global counter, one at a time, never derived from blockIdx: a
    // claimed ticket is then always held by a running CTA, which is what makes a down item's wait
    // safe with any residency (its gate/up items have lower tickets, held by CTAs whose current item
    // never waits). The claim for the next item is made when the current one starts; its number is
    // learnt during the current item's first stage, early enough to prefetch the next item. A CTA
    // that will claim no more counts itself retired; the last to retire zeroes the counters.
    __device__ void run() {
        const int t = threadIdx.x;
        G = gridDim.x;
        nev = 0;
        ret_old = -1;
        trace(EV_START, -1);
        D = dyn_layout(K, S, ucap_for(a.n_experts, a.m, a.top_k), KTR, KC32);
        ptr = reinterpret_cast<const void**>(dyn + D.ptr);
        bar = reinterpret_cast<uint64_t*>(dyn + D.bar);
        int* ticket = reinterpret_cast<int*>(a.scratch + L.ticket);
        int first = 0;
        if (t == 0) first = atomicAdd(ticket, 1);  // in flight while the plan is built
        if (!GRP && t < WARPS * S) mbar_init(bar + t, 32);  // one per warp and slot, completed by the warp's lanes
        build_plan(a, s, ptr);  // its barriers also publish the mbarrier init
        ng = s.ng;
        c = make_cfg<KC32>(a, ng, s.gr, G);
        if constexpr ((ABL & ABL_NO_DOWN) != 0) {
            if (ng) {
                c.N2 = 0;
                c.N = c.N1;
            }
        }
        if (t == 0) {
            s.q = first;
            s.qseq = -1;
        }
        __syncthreads();
        int cur_ticket = s.q;
        cur = item_of(cur_ticket, c, ng, s);
        locate(cur);
        trace(EV_PLAN, cur_ticket);
        nxt = Item{IT_NONE, 0, 0, 0, 0, 0};
        raw_ready = false;
        regs_free = true;
        base_cur = 0;
        issued = 0;
        q = 0;
        item_seq = 0;
        published = false;
        if (cur.kind == IT_NONE) {
            done_claiming = true;
            nxt_known = true;
            if (t == 0) ret_old = atomicAdd(ticket + 1, 1);
        } else {
            done_claiming = false;
            nxt_known = false;
            if (t == 0) pending = atomicAdd(ticket, 1);
        }
        while (cur.kind != IT_NONE) {
            trace(EV_ITEM, cur_ticket);
            if (cur.kind == IT_GU) run_gu(cur, cur_ticket);
            else if (cur.kind == IT_DN) run_dn(cur, cur_ticket);
            else gather_cols(a, reinterpret_cast<const float*>(a.scratch + L.y), s, cur.blk);
            // every warp learns the successor (those that did not on the way, e.g. an item with no
            // stages, learn it here), then s.q may be reused for the next claim
            __syncthreads();
            if (!nxt_known) publish();
            __syncthreads();
            if (!nxt_known) learn_next();
            cur_ticket = s.q;
            __syncthreads();
            base_cur += cur.nst;
            cur = nxt;
            nxt = Item{IT_NONE, 0, 0, 0, 0, 0};
            item_seq++;
            published = false;
            if (cur.kind != IT_NONE && !done_claiming) {
                nxt_known = false;
                if (t == 0) pending = atomicAdd(ticket, 1);
            } else {
                nxt_known = true;
            }
        }
        if (t == 0 && ret_old == G - 1) {  // every claim of this launch has been made
            *ticket = 0;
            ticket[1] = 0;
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        trace(EV_EXIT, -1);
    }
};

template <int K, int CB, bool DUP, int MINB, int ABL = 0, bool PRM = false, bool GRP = false, bool KT2 = false,
          bool KC32 = false>
__global__ void __launch_bounds__(THREADS, MINB) moe_decode_v2(const __grid_constant__ Args a) {
    __shared__ Plan s;
    extern __shared__ __align__(16) uint8_t dyn[];
    V2Kernel<K, CB, DUP, ABL, PRM, GRP, KT2, KC32> k(a, s, dyn);
    k.run();
}

using KernelFn = void (*)(Args);

// k-tiles per ring row of the build pick_v2 returns: v54's and v55's MCG builds hold two (their MUL1
// layers run v4's build); the launch's shared-memory size follows from it, and from big_chunks.
int ring_kt(int codebook, int variant) {
    return (variant == V2_KT2_VARIANT || variant == V2_KC32_VARIANT) && codebook == CB_MCG ? 2 : 1;
}
bool big_chunks(int codebook, int variant) { return variant == V2_KC32_VARIANT && codebook == CB_MCG; }

// variant 2: MCG exact-sum; 3: the format's rounding (and every MUL1 layer); 4: variant 2's
// kernel compiled for 2 CTAs per SM
KernelFn pick_v2(int bits, int codebook, int variant) {
    constexpr int M3 = V2_MIN_BLOCKS, M2 = V4_MIN_BLOCKS;
    if (is_ablation(variant)) {  // timing ablations of variant 4, K2 MCG only (50 is not)
        if (bits != 2 || codebook != CB_MCG) return nullptr;
        switch (variant - ABLATION_VARIANT_BASE) {
            case 0: return moe_decode_v2<2, CB_MCG, true, M2, ABL_NO_DECODE>;
            case 1: return moe_decode_v2<2, CB_MCG, true, M2, ABL_NO_COPY>;
            case 2: return moe_decode_v2<2, CB_MCG, true, M2, ABL_NO_DOWN>;
            case 3: return moe_decode_v2<2, CB_MCG, true, M2, ABL_NO_DECODE | ABL_NO_COPY>;
            default: return nullptr;
        }
    }
    if (variant == V2_PRM_VARIANT && codebook == CB_MCG)  // v4's MCG builds, with PRM at K2 (MUL1: v4's, below)
        return bits == 2 ? moe_decode_v2<2, CB_MCG, true, M2, 0, true> : moe_decode_v2<3, CB_MCG, true, M2>;
    if (variant == V2_GRP_VARIANT && codebook == CB_MCG)  // v50's builds with GRP (MUL1: v4's, below)
        return bits == 2 ? moe_decode_v2<2, CB_MCG, true, M2, 0, true, true> : moe_decode_v2<3, CB_MCG, true, M2, 0, false, true>;
    if (big_chunks(codebook, variant))  // v54's builds with 32-k-tile chunks (MUL1: v4's, below)
        return bits == 2 ? moe_decode_v2<2, CB_MCG, true, M2, 0, true, true, true, true>
                         : moe_decode_v2<3, CB_MCG, true, M2, 0, false, true, true, true>;
    if (ring_kt(codebook, variant) == 2)  // v53's builds with two-k-tile rows (MUL1: v4's, below)
        return bits == 2 ? moe_decode_v2<2, CB_MCG, true, M2, 0, true, true, true>
                         : moe_decode_v2<3, CB_MCG, true, M2, 0, false, true, true>;
    if (codebook == CB_MCG) {
        if (variant == 4) return bits == 2 ? moe_decode_v2<2, CB_MCG, true, M2> : moe_decode_v2<3, CB_MCG, true, M2>;
        // 6: v3 (one MMA per tile, the format's fp16 lo + hi) at v4's register budget
        if (variant == 6) return bits == 2 ? moe_decode_v2<2, CB_MCG, false, M2> : moe_decode_v2<3, CB_MCG, false, M2>;
        if (variant == 2) return bits == 2 ? moe_decode_v2<2, CB_MCG, true, M3> : moe_decode_v2<3, CB_MCG, true, M3>;
        return bits == 2 ? moe_decode_v2<2, CB_MCG, false, M3> : moe_decode_v2<3, CB_MCG, false, M3>;
    }
    if (codebook == CB_MUL1 && variant == 6)
        return bits == 2 ? moe_decode_v2<2, CB_MUL1, false, M2> : moe_decode_v2<3, CB_MUL1, false, M2>;
    if (codebook == CB_MUL1)
        return bits == 2 ? moe_decode_v2<2, CB_MUL1, false, M3> : moe_decode_v2<3, CB_MUL1, false, M3>;
    return nullptr;
}

struct Tuning {
    // 11/8 gate/up items per resident CTA: the 2026-12-03 sweep (NOTES.md) found 1.5 one step too
    // many where a shape's item count lands just under it (384 at 264 CTAs: TP8 2 rows, TP1 1-2 rows)
    int ctas_per_sm = 0, items_x8 = 11, pair_down = 1;
};
Tuning g_tuning;

}  // namespace

void set_tuning(int ctas_per_sm, int items_x8, int pair_down) {
    if (ctas_per_sm >= 0) g_tuning.ctas_per_sm = ctas_per_sm;
    if (items_x8 > 0) g_tuning.items_x8 = items_x8;
    if (pair_down >= 0) g_tuning.pair_down = pair_down;
}

static int v2_dyn_bytes(int bits, int codebook, int variant, int n_experts, int m, int top_k) {
    return dyn_layout(bits, S, ucap_for(n_experts, m, top_k), ring_kt(codebook, variant), big_chunks(codebook, variant))
        .total;
}

cudaError_t v2_smem_bytes(int bits, int codebook, int variant, int n_experts, int m, int top_k, int* bytes) {
    KernelFn fn = pick_v2(bits, codebook, variant);
    if (!fn) return cudaErrorInvalidValue;
    cudaFuncAttributes attr{};
    const cudaError_t err = cudaFuncGetAttributes(&attr, fn);
    if (err != cudaSuccess) return err;
    *bytes = int(attr.sharedSizeBytes) + v2_dyn_bytes(bits, codebook, variant, n_experts, m, top_k);
    return cudaSuccess;
}

cudaError_t v2_occupancy(int bits, int codebook, int variant, int device, int n_experts, int m, int top_k,
                         int* blocks_per_sm, int* num_sms) {
    KernelFn fn = pick_v2(bits, codebook, variant);
    if (!fn) return cudaErrorInvalidValue;
    cudaError_t err = cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    const int dyn = v2_dyn_bytes(bits, codebook, variant, n_experts, m, top_k);
    err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);
    if (err != cudaSuccess) return err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, fn, THREADS, dyn);
    if (err == cudaSuccess && g_tuning.ctas_per_sm > 0 && *blocks_per_sm > g_tuning.ctas_per_sm)
        *blocks_per_sm = g_tuning.ctas_per_sm;
    return err;
}

cudaError_t v2_launch(const Args& a_in, int grid, cudaStream_t stream) {
    KernelFn fn = pick_v2(a_in.bits, a_in.codebook, a_in.variant);
    if (!fn) return cudaErrorInvalidValue;
    Args a = a_in;
    a.items_x8 = g_tuning.items_x8;
    a.pair_down = g_tuning.pair_down;
    // shift multipliers for states8 (see there); kmul[7] = 2^16 moves the top half down
    for (int j = 0; j < 7; j++) a.kmul[j] = a.bits == 2 ? 1u << (2 + 2 * j) : (j < 6 ? 1u << (3 * j) : 8u);
    a.kmul[7] = 1u << 16;
    a.stages = S;
    const int dyn = v2_dyn_bytes(a.bits, a.codebook, a.variant, a.n_experts, a.m, a.top_k);
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);
    if (err != cudaSuccess) return err;
    fn<<<grid, THREADS, dyn, stream>>>(a);
    return cudaGetLastError();
}

}  // namespace lna2
