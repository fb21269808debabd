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
// region has the same place and size for every geometry, so one scratch can serve layers of
// different shapes one after another; concurrent launches need separate scratches.
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
    off = align_up(off, 256);
    L.ctrl_bytes = off;
    L.part = off;  off = align_up(off + size_t(PART_CAP) * 2 * inter * sizeof(float), 256);
    L.act = off;   off = align_up(off + size_t(MAX_PAIRS) * inter * 2, 256);
    L.y = off;     off = align_up(off + size_t(MAX_PAIRS) * hidden * sizeof(float), 256);
    L.total = off;
    return L;
}

struct Args {
    const void* x;              // [m, hidden] fp16 or bf16
    void* out;                  // [m, hidden] fp16, bf16 or fp32
    const int64_t* tables[9];   // device arrays [n_experts] of data_ptrs: gate/up/down x trellis/suh/svh
    const int32_t* expert_ids;  // [m, top_k] rank-local ids; out-of-range ids contribute nothing
    const float* weights;       // [m, top_k] routing weights, routed scaling already applied
    uint8_t* scratch;
    int m, top_k, n_experts, hidden, inter, bits, codebook, x_dtype, out_dtype;
    int variant;                // 0: register-streamed kernel, 1: cp.async-pipelined kernel
    int stages;                 // set by launch(): v1 pipeline depth
    float swiglu_limit;
};

// Grid the kernel needs on `device` (all CTAs co-resident; it launches cooperatively).
cudaError_t occupancy(int bits, int codebook, int variant, int device, int* blocks_per_sm, int* num_sms);
cudaError_t launch(const Args& a, int grid, cudaStream_t stream);
const char* build_id();

}  // namespace lna2
