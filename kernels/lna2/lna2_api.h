// lna2: routed-expert MoE decode for EXL3 weights (dsv4serve).
// Host-side interface shared by the CUDA translation unit and the torch binding. No torch here,
// so the kernel compiles with plain nvcc (CI builds it for sm_90 and sm_120 without a GPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#ifndef LNA2_MAX_ROWS
#define LNA2_MAX_ROWS 32  // rows per call: a 32-bit row mask per expert in the route plan
#endif

namespace lna2 {

constexpr int THREADS = 256;                 // 8 warps per CTA
constexpr int WARPS = THREADS / 32;
constexpr int MAX_ROWS = LNA2_MAX_ROWS;
constexpr int MAX_TOPK = 8;
constexpr int MAX_EXPERTS = 256;             // one thread per expert in the route scan
constexpr int MAX_PAIRS = MAX_ROWS * MAX_TOPK;  // bound on (expert, row) entries and on groups
constexpr int GROUP_ROWS = 16;               // rows sharing one decoded tile: the MMA's M
constexpr int CHUNK_KT = 16;                 // k-tiles (256 inputs) staged in shared memory at once
constexpr int PART_CAP = 512;                // partial-sum slots: entries x k-splits
constexpr int KSPLIT_MAX = 16;
constexpr int MAX_IB = 64;                   // intermediate <= 8192
constexpr int MAX_CB = 128;                  // hidden <= 16384

static_assert(MAX_ROWS <= 32, "the route plan keeps one 32-bit row mask per expert");
static_assert(MAX_PAIRS <= 32767, "entries are indexed with int16 in shared memory");

enum Codebook : int { CB_MCG = 1, CB_MUL1 = 2 };
enum DType : int { DT_F16 = 0, DT_BF16 = 1, DT_F32 = 2 };

// Byte offsets inside the caller's scratch. The control words must be zero before the first
// launch (allocate with zeros); every launch returns them to zero before it ends. The control
// region has the same place and size for every geometry and every kernel variant, so one scratch
// can serve layers of different shapes and variants one after another; concurrent launches need
// separate scratches.
constexpr size_t CTRL_WORDS = 72 * 1024;     // >= either variant family's control words (asserted below)
// FXA builds (variants 58, 59): per output element one int64 holding the fixed-point sum of its
// top-k contributions (scaled by FX_ONE = 2^26, shifted left by 6) plus, in its low 6 bits, how many
// have arrived. Zero like the control words; the element's last contributor stores it back to zero.
constexpr int FX_MAX_HIDDEN = 8192;          // the cluster kernel's widest hidden size
constexpr size_t FX_ACC = CTRL_WORDS;
constexpr size_t CTRL_BYTES = FX_ACC + size_t(MAX_ROWS) * FX_MAX_HIDDEN * sizeof(long long);

struct Layout {
    int ib;            // 128-wide blocks of the expert intermediate (gate/up output, down input)
    int cb;            // 128-wide blocks of the hidden size (down output)
    size_t arr;        // int32 [MAX_PAIRS * ib]: gate/up partials arrived per (group, block)
    size_t ready;      // int32 [MAX_PAIRS]: activation blocks ready per group
    size_t done;       // int32 [cb]: down outputs arrived per hidden block
    size_t ctrl_bytes; // control region [0, ctrl_bytes): word 0 retire count, word 1 down ticket
    size_t part;       // fp32 [PART_CAP][2][I]: gate/up partial sums per k-split
    size_t act;        // fp16 [MAX_PAIRS][I]: rotated down-projection input per entry
    size_t y;          // fp32 [MAX_PAIRS][H]: down output per entry (before routing weights)
    size_t total;
};

inline __host__ __device__ size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

inline __host__ __device__ Layout make_layout(int hidden, int inter) {
    Layout L{};
    L.ib = inter / 128;
    L.cb = hidden / 128;
    size_t off = 64 * sizeof(int);
    L.arr = off;   off += size_t(MAX_PAIRS) * MAX_IB * sizeof(int);
    L.ready = off; off += size_t(MAX_PAIRS) * sizeof(int);
    L.done = off;  off += size_t(MAX_CB) * sizeof(int);
    L.ctrl_bytes = CTRL_BYTES;
    off = CTRL_BYTES;
    L.part = off;  off = align_up(off + size_t(PART_CAP) * 2 * inter * sizeof(float), 256);
    L.act = off;   off = align_up(off + size_t(MAX_PAIRS) * inter * 2, 256);
    L.y = off;     off = align_up(off + size_t(MAX_PAIRS) * hidden * sizeof(float), 256);
    L.total = off;
    return L;
}

// v2 (ticket-scheduled) scratch. Control words: the ticket counter and per-group / per-block
// arrival counters, each returned to zero by its last user within the launch.
constexpr int V2_PART_CAP = 1024;            // partial-sum slots: entries x k-splits
constexpr int V2_DOWN_SPLITS = 4;            // most k-splits of a down item (one fp32 y row each)
struct LayoutV2 {
    size_t ticket;     // int32: next dynamic ticket
    size_t arr;        // int32 [MAX_PAIRS * MAX_IB]: gate/up items arrived per (group, block)
    size_t ready;      // int32 [MAX_PAIRS]: activation blocks ready per group
    size_t ack;        // int32 [MAX_PAIRS]: down items that have seen their group ready
    size_t done;       // int32 [MAX_CB]: down items arrived per output block
    size_t part;       // fp32 [V2_PART_CAP][2][I]: gate/up partial sums
    size_t act;        // u32 [MAX_PAIRS][I/16][32][2]: down input of each group, in MMA B-fragment order
    size_t y;          // fp32 [V2_DOWN_SPLITS][MAX_PAIRS][H]: down output per k-split and entry
    size_t total;
};

inline __host__ __device__ LayoutV2 make_layout_v2(int hidden, int inter) {
    LayoutV2 L{};
    size_t off = 0;
    L.ticket = off; off += 64 * sizeof(int);
    L.arr = off;    off += size_t(MAX_PAIRS) * MAX_IB * sizeof(int);
    L.ready = off;  off += size_t(MAX_PAIRS) * sizeof(int);
    L.ack = off;    off += size_t(MAX_PAIRS) * sizeof(int);
    L.done = off;   off += size_t(MAX_CB) * sizeof(int);
    off = CTRL_BYTES;
    L.part = off;   off = align_up(off + size_t(V2_PART_CAP) * 2 * inter * sizeof(float), 256);
    L.act = off;    off = align_up(off + size_t(MAX_PAIRS) * inter * 16, 256);
    L.y = off;      off = align_up(off + size_t(V2_DOWN_SPLITS) * MAX_PAIRS * hidden * sizeof(float), 256);
    L.total = off;
    return L;
}

static_assert((64 + MAX_PAIRS * MAX_IB + 2 * MAX_PAIRS + MAX_CB) * sizeof(int) <= CTRL_WORDS,
              "control words must fit the shared control region");

// Bytes a scratch needs to serve every variant at this geometry.
inline size_t scratch_bytes(int hidden, int inter) {
    const size_t a = make_layout(hidden, inter).total, b = make_layout_v2(hidden, inter).total;
    return a > b ? a : b;
}

struct Args {
    const void* x;              // [m, hidden] fp16 or bf16
    void* out;                  // [m, hidden] fp16, bf16 or fp32
    const int64_t* tables[9];   // device arrays [n_experts] of data_ptrs: gate/up/down x trellis/suh/svh
    const int32_t* expert_ids;  // [m, top_k] rank-local ids; out-of-range ids contribute nothing
    const float* weights;       // [m, top_k] routing weights, routed scaling already applied
    uint8_t* scratch;
    int m, top_k, n_experts, hidden, inter, bits, codebook, x_dtype, out_dtype;
    int variant;                // 0: register-streamed, 1: cp.async-pipelined, 2: v2, 3: v2 without the
                                // MCG exact-sum MMA (see lna2_v2.cu), 4: v2 built for 2 CTAs per SM;
                                // 7, 9, 20, 21: the cluster kernel; 10..13, 17..19: timing ablations (K2 MCG only, below)
    int stages;                 // set by launch(): pipeline depth (v1, v2)
    int items_x8;               // v2: aim for at least grid * items_x8 / 8 gate/up items (set by launch())
    int pair_down;              // v2: allow down items of two output blocks (set by launch())
    uint32_t kmul[8];           // v2: decode shift multipliers (set by launch())
    float swiglu_limit;
    unsigned long long* trace;  // v2 family and v7, optional: per-CTA event timeline (TRACE_EVENTS x {ns, (ticket or unit + 1)<<8 | event})
    int stop;                   // read only by v26's stop build (lna2_set_stop): 1 / 2 return after the prologue / plan
};

constexpr int TRACE_EVENTS = 64;  // per CTA

// Variants from here on are timing ablations of variant 4, each with one stage removed (10: no
// trellis decode, 11: no trellis copies, 12: no down phase, 13: neither decode nor copies). Their
// outputs are garbage by design; only a benchmark asks for them (scripts/lna2_device.py ablate).
constexpr int ABLATION_VARIANT_BASE = 10, ABLATION_VARIANTS = 4;
// Variant 7 is the cluster kernel (lna2_v7.cu) for small intermediates: v7_supports() says which.
// Variant 9 is the same kernel with its trellis moved by bulk (TMA) copies, the first unit's
// trellis requested around x and suh, and an acquire-release arrival; 20 is 9 with the byte-permute
// state extraction at K2; 21 is 20 with every CTA finishing the activation itself (no second
// cluster barrier); 26 is 21 with the down epilogue's tasks dealt to the warps in turn through one
// rolled copy of its code. (22-25 and 28 were session 15's experiments, measured and retired:
// kernels/lna2/NOTES.md; 27, 20 with that epilogue and two k-steps per decode-loop iteration, was
// retired in session 20: no build the policy serves had its paired loops.)
// 31 is 26 with partial buffers of min(8, m) rows, which keeps K3 at two CTAs per SM up to six rows;
// 36 is 31 with one partial buffer (a split cluster barrier guards its reuse), two K3 CTAs per SM to
// eighteen rows; 40 is 36 with arrivals counted per (column slice, row) and each row summed by the unit
// that completes it; 46 is 40 with a relaxed arrive after the finisher's reads. 58 and 59 are 26
// and 46 whose top-k sum is one returning 64-bit integer atomic per output element (fixed-point sum
// and arrival count in one word: the contribution that completes an element writes it), in place of
// the y rows, the arrival counter and the gather.
// (32-35 were session 17's experiments, 37-39 session 18's, 41-44 session 19's, 45 session 20's and
// 47-49 session 21's and 56 session 33's, measured and retired: kernels/lna2/NOTES.md, "The variants".)
// Variants 17..19 are timing ablations of 7 (K2 MCG only): 17 no trellis decode, 18 no trellis
// copies, 19 neither.
constexpr int V7_VARIANT = 7, V7_BULK_VARIANT = 9, V7_PRM_VARIANT = 20, V7_FIN_VARIANT = 21;
constexpr int V7_EPI_VARIANT = 26, V7_RCAP_VARIANT = 31, V7_SB_VARIANT = 36, V7_RG_VARIANT = 40;
constexpr int V7_RLX_VARIANT = 46, V7_FXA_VARIANT = 58, V7_RGFXA_VARIANT = 59;
constexpr int V7_ABLATION_BASE = 17, V7_ABLATIONS = 3;
inline bool is_ablation(int v) {
    return (v >= ABLATION_VARIANT_BASE && v < ABLATION_VARIANT_BASE + ABLATION_VARIANTS) ||
           (v >= V7_ABLATION_BASE && v < V7_ABLATION_BASE + V7_ABLATIONS);
}
inline bool is_cluster_variant(int v) {
    return v == V7_VARIANT || v == V7_BULK_VARIANT || v == V7_PRM_VARIANT || v == V7_FIN_VARIANT || v == V7_EPI_VARIANT ||
           v == V7_RCAP_VARIANT || v == V7_SB_VARIANT || v == V7_RG_VARIANT || v == V7_RLX_VARIANT ||
           v == V7_FXA_VARIANT || v == V7_RGFXA_VARIANT ||
           (v >= V7_ABLATION_BASE && v < V7_ABLATION_BASE + V7_ABLATIONS);
}
// Variant 50 is v4 (the ticket-scheduled v2 kernel at 2 CTAs per SM) with v20's byte-permute state
// extraction at K2 (at K3 it is v4's kernel), aimed at TP1 (kernels/lna2/NOTES.md). (51, session
// 22's v50 with each group's gate/up inputs rotated once by rotation items ticketed first, was
// measured and retired: NOTES.md, "The variants".)
constexpr int V2_PRM_VARIANT = 50;
// Variant 53 is v50 whose per-warp trellis rings complete on cp.async commit groups instead of
// mbarriers, with a steady-state step that issues its one due row directly, aimed at TP1, where
// the ring step's integer work shares the ALU pipe the decode saturates (kernels/lna2/NOTES.md,
// session 26). (52, session 24's v50 with one CTA barrier per gate/up chunk, tied v50 and was
// retired: NOTES.md, "The variants".)
constexpr int V2_GRP_VARIANT = 53;
// Variant 54 is v53 whose ring rows hold two k-tiles (16 tiles) instead of one: half the ring steps,
// row addresses and loop turns per tile at the same decode, aimed at TP1, where those are most of
// the ~11 instructions a tile outside the decode (kernels/lna2/NOTES.md, session 27).
constexpr int V2_KT2_VARIANT = 54;
// Variant 55 is v54 with gate/up chunks of 32 k-tiles where items are many (TP1, and TP8 from ~4
// rows): the chunk's staging, three CTA barriers and rotation wait are paid per 64 tiles a warp
// instead of 32, which session 26's profile put at 7 % of TP1's instructions and 13 % of its stall
// samples (kernels/lna2/NOTES.md, session 28). (57, session 33's v55 with each warp rotating its own
// 128-block and no CTA barrier between chunks, was bitwise v55, no faster, and retired: NOTES.md.)
constexpr int V2_KC32_VARIANT = 55;
inline bool variant_known(int v) {
    return (v >= 0 && v <= 4) || v == 6 || v == V2_PRM_VARIANT || v == V2_GRP_VARIANT || v == V2_KT2_VARIANT ||
           v == V2_KC32_VARIANT ||
           is_cluster_variant(v) || is_ablation(v);
}

// Grid the kernel needs on `device` (all CTAs co-resident; it launches cooperatively).
// `n_experts`, `m` and `top_k` size v2's shared memory (its pointer cache); v0/v1 ignore them.
cudaError_t occupancy(int bits, int codebook, int variant, int device, int n_experts, int m, int top_k,
                      int* blocks_per_sm, int* num_sms, int hidden = 4096, int inter = 256);
cudaError_t launch(const Args& a, int grid, cudaStream_t stream);

// Process-wide v2 tuning for benchmarks: resident CTAs per SM (0: as many as fit, < 0 keeps the
// setting), the gate/up item target, grid * items_x8 / 8 (0 keeps it), and whether down items may
// cover two output blocks (0 / 1, < 0 keeps it).
void set_tuning(int ctas_per_sm, int items_x8, int pair_down);

// v2's own entry points (lna2_v2.cu); occupancy() and launch() route variants 2, 3 and 4 to them.
cudaError_t v2_occupancy(int bits, int codebook, int variant, int device, int n_experts, int m, int top_k,
                         int* blocks_per_sm, int* num_sms);
cudaError_t v2_launch(const Args& a, int grid, cudaStream_t stream);
// v7's own entry points (lna2_v7.cu). It needs hidden 1024, 2048, 4096 or 8192 and an
// intermediate of at most 512 (4 blocks); it sizes its own (cluster) grid. v7_set_spread: 0 lets a
// launch keep one CTA per SM when its units' clusters all fit that way, 1 always, 2 never.
bool v7_supports(int hidden, int inter);
void v7_set_spread(int ctas_per_sm);
void v7_set_stop(int stage);  // benchmarks: v26 K2 MCG stops after its prologue (1), route plan (2), not (3); 0 off
cudaError_t v7_occupancy(int bits, int codebook, int variant, int device, int n_experts, int m, int top_k, int* blocks_per_sm,
                         int* num_sms, int hidden = 4096, int inter = 256);
cudaError_t v7_launch(const Args& a, cudaStream_t stream);
// Shared memory one CTA of `variant` asks for at a launch of m rows (static + dynamic, before the
// cluster kernel's one-CTA-per-SM padding to half an SM, which stays under a block's limit), for the v2 family
// (variants 2..6, 50 and later) and the cluster kernel; other variants: cudaErrorInvalidValue.
// sm_120 cards allow 99 KB a block, where the cluster kernel's K3 builds do not fit: the policy
// asks this before it picks (kernels/lna2/NOTES.md, session 33).
cudaError_t smem_bytes(int bits, int codebook, int variant, int n_experts, int m, int top_k, int hidden, int inter,
                       int* bytes);
cudaError_t v2_smem_bytes(int bits, int codebook, int variant, int n_experts, int m, int top_k, int* bytes);
cudaError_t v7_smem_bytes(int bits, int codebook, int variant, int n_experts, int m, int top_k, int hidden, int inter,
                          int* bytes);
const char* build_id();

}  // namespace lna2
