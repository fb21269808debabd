// torch binding of the lna2 kernel: argument checks that turn every contract violation into a
// Python exception naming the argument, then one launch on the current stream (no host sync).
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "lna2_api.h"

namespace {

constexpr int kDefaultHidden = 4096;
constexpr int kDefaultInter = 256;

// Error messages are assembled here, numbers through std::to_string, and reach torch as one string.
// On the H200 image (extensions built by /opt/gcc's g++, torch 2.11) streaming an integer into a
// std::ostringstream kills the process with SIGSEGV, in any extension built there (a four-line one
// did the same), so every check whose message passed an integer to c10::str crashed instead of
// raising; the text-only ones raised (session 16 runs 3 and 4, `lna2_device.py refusals`).
template <class T>
std::string piece(const T& v) {
    if constexpr (std::is_same_v<T, bool>) {
        return v ? "true" : "false";
    } else if constexpr (std::is_arithmetic_v<T>) {
        return std::to_string(v);
    } else if constexpr (std::is_convertible_v<const T&, std::string>) {
        return std::string(v);
    } else if constexpr (std::is_same_v<T, c10::ScalarType>) {
        return c10::toString(v);
    } else {
        return v.str();  // torch::Device
    }
}
template <class... T>
std::string message(const T&... v) {
    std::string out;
    ((out += piece(v)), ...);
    return out;
}

#define LNA2_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, message("lna2_moe_decode: ", __VA_ARGS__))

// Whether two tensors' element bytes share any address (both contiguous, checked before this).
bool overlaps(const torch::Tensor& a, const torch::Tensor& b) {
    const auto lo_a = reinterpret_cast<uintptr_t>(a.data_ptr()), lo_b = reinterpret_cast<uintptr_t>(b.data_ptr());
    const auto hi_a = lo_a + a.nbytes(), hi_b = lo_b + b.nbytes();
    return a.nbytes() > 0 && b.nbytes() > 0 && lo_a < hi_b && lo_b < hi_a;
}

void check_table(const torch::Tensor& t, const char* name, int64_t n_experts, const torch::Device& dev) {
    LNA2_CHECK(t.is_cuda() && t.device() == dev, name, " must be a CUDA tensor on ", dev);
    LNA2_CHECK(t.scalar_type() == torch::kInt64, name, " must be int64 (data_ptr values), got ", t.scalar_type());
    LNA2_CHECK(t.dim() == 1 && t.size(0) == n_experts && t.is_contiguous(), name,
               " must be a contiguous [n_experts] table with n_experts = ", n_experts);
}

struct GridKey {
    int device, bits, codebook, variant, ucap;  // ucap: v2's pointer cache (0 for v0/v1)
    int hidden, inter;                          // the cluster kernel's shared memory follows the layer's geometry
    bool operator<(const GridKey& o) const {
        return std::tie(device, bits, codebook, variant, ucap, hidden, inter) <
               std::tie(o.device, o.bits, o.codebook, o.variant, o.ucap, o.hidden, o.inter);
    }
};

std::mutex g_mu;
std::map<GridKey, std::pair<int, int>> g_grid;  // -> (blocks_per_sm, num_sms)

std::pair<int, int> grid_for(int device, int bits, int codebook, int variant, int n_experts, int m, int top_k,
                             int hidden = kDefaultHidden, int inter = kDefaultInter) {
    std::lock_guard<std::mutex> lk(g_mu);
    const int ucap = variant >= 2 ? std::min(n_experts, m * top_k) : 0;
    GridKey k{device, bits, codebook, variant, ucap, hidden, inter};
    auto it = g_grid.find(k);
    if (it != g_grid.end()) return it->second;
    int bps = 0, sms = 0;
    cudaError_t err = lna2::occupancy(bits, codebook, variant, device, n_experts, m, top_k, &bps, &sms, hidden, inter);
    TORCH_CHECK(err == cudaSuccess, "lna2: occupancy query failed: ", cudaGetErrorString(err),
                " (is the extension built for this GPU's architecture?)");
    TORCH_CHECK(bps >= 1, "lna2: the kernel cannot be resident on this GPU (0 blocks per SM)");
    g_grid[k] = {bps, sms};
    return {bps, sms};
}

int dtype_code(torch::ScalarType t, bool allow_f32) {
    if (t == torch::kFloat16) return lna2::DT_F16;
    if (t == torch::kBFloat16) return lna2::DT_BF16;
    if (allow_f32 && t == torch::kFloat32) return lna2::DT_F32;
    return -1;
}

}  // namespace

int64_t lna2_moe_scratch_bytes(int64_t hidden, int64_t intermediate) {
    TORCH_CHECK_VALUE(hidden > 0 && hidden % 128 == 0, "hidden must be a positive multiple of 128");
    TORCH_CHECK_VALUE(intermediate > 0 && intermediate % 128 == 0, "intermediate must be a positive multiple of 128");
    return static_cast<int64_t>(lna2::scratch_bytes(static_cast<int>(hidden), static_cast<int>(intermediate)));
}

int64_t lna2_moe_max_rows() { return lna2::MAX_ROWS; }

torch::Tensor lna2_moe_decode(torch::Tensor x, torch::Tensor out, torch::Tensor gate_trellis, torch::Tensor gate_suh,
                              torch::Tensor gate_svh, torch::Tensor up_trellis, torch::Tensor up_suh,
                              torch::Tensor up_svh, torch::Tensor down_trellis, torch::Tensor down_suh,
                              torch::Tensor down_svh, torch::Tensor expert_ids, torch::Tensor routing_weights,
                              int64_t bits, double swiglu_limit, torch::Tensor scratch, int64_t intermediate,
                              int64_t codebook, int64_t variant, c10::optional<torch::Tensor> trace) {
    LNA2_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    const auto dev = x.device();
    const int xdt = dtype_code(x.scalar_type(), false);
    LNA2_CHECK(xdt >= 0, "x must be fp16 or bf16, got ", x.scalar_type());
    LNA2_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [m, hidden] tensor");
    const int64_t m = x.size(0), hidden = x.size(1);
    LNA2_CHECK(m >= 1 && m <= lna2::MAX_ROWS, "rows m=", m, " outside 1..", lna2::MAX_ROWS, " (lna2_moe_max_rows)");
    LNA2_CHECK(hidden % 128 == 0 && hidden / 128 <= lna2::MAX_CB, "hidden ", hidden,
               " must be a multiple of 128 up to ", 128 * lna2::MAX_CB);
    LNA2_CHECK(intermediate > 0 && intermediate % 128 == 0 && intermediate / 128 <= lna2::MAX_IB, "intermediate ",
               intermediate, " must be a positive multiple of 128 up to ", 128 * lna2::MAX_IB);
    LNA2_CHECK(out.device() == dev && out.is_contiguous() && out.sizes() == x.sizes(),
               "out must be a contiguous tensor of x's shape on x's device");
    const int odt = dtype_code(out.scalar_type(), true);
    LNA2_CHECK(odt >= 0, "out must be fp16, bf16 or fp32, got ", out.scalar_type());
    const int64_t n_experts = gate_trellis.numel();
    LNA2_CHECK(n_experts >= 1 && n_experts <= lna2::MAX_EXPERTS, "pointer tables hold ", n_experts,
               " experts; 1..", lna2::MAX_EXPERTS, " supported");
    const torch::Tensor* tables[9] = {&gate_trellis, &gate_suh, &gate_svh, &up_trellis, &up_suh,
                                      &up_svh,       &down_trellis, &down_suh, &down_svh};
    const char* names[9] = {"gate_trellis", "gate_suh", "gate_svh", "up_trellis", "up_suh",
                            "up_svh",       "down_trellis", "down_suh", "down_svh"};
    for (int i = 0; i < 9; i++) check_table(*tables[i], names[i], n_experts, dev);
    LNA2_CHECK(expert_ids.device() == dev && expert_ids.scalar_type() == torch::kInt32 && expert_ids.dim() == 2 &&
                   expert_ids.is_contiguous() && expert_ids.size(0) == m,
               "expert_ids must be a contiguous int32 [m, top_k] tensor (flat [m*top_k] ids are rejected)");
    const int64_t top_k = expert_ids.size(1);
    LNA2_CHECK(top_k >= 1 && top_k <= lna2::MAX_TOPK, "top_k ", top_k, " outside 1..", lna2::MAX_TOPK);
    LNA2_CHECK(routing_weights.device() == dev && routing_weights.scalar_type() == torch::kFloat32 &&
                   routing_weights.is_contiguous() && routing_weights.sizes() == expert_ids.sizes(),
               "routing_weights must be a contiguous fp32 [m, top_k] tensor");
    LNA2_CHECK(bits == 2 || bits == 3, "bits must be 2 or 3, got ", bits);
    LNA2_CHECK(codebook == lna2::CB_MCG || codebook == lna2::CB_MUL1, "codebook must be 1 (mcg) or 2 (mul1)");
    LNA2_CHECK(lna2::variant_known(static_cast<int>(variant)),
               "variant must be 0..4, 6, 7, 9, 20, 21, 26, 31, 36, 40, 46, 50, 53, 54, 55, 58, 59, or 10..13 / 17..19 for a timing ablation (see lna2_api.h), got ", variant);
    LNA2_CHECK(!lna2::is_cluster_variant(static_cast<int>(variant)) || lna2::v7_supports(static_cast<int>(hidden), static_cast<int>(intermediate)),
               "variants 7, 9, 20, 21, 26, 31, 36, 40, 46, 58 and 59 (the cluster kernel) need hidden 1024, 2048, 4096 or 8192 and intermediate a multiple of 128 up to 512, got ",
               hidden, " x ", intermediate, "; use variant 4 for this layer");
    LNA2_CHECK(!lna2::is_ablation(static_cast<int>(variant)) || (bits == 2 && codebook == lna2::CB_MCG),
               "timing ablations (variants 10..13, 17..19) exist for K2 MCG only");
    LNA2_CHECK(std::isfinite(swiglu_limit) && swiglu_limit > 0, "swiglu_limit must be finite and > 0");
    const size_t need = lna2::scratch_bytes(static_cast<int>(hidden), static_cast<int>(intermediate));
    LNA2_CHECK(scratch.device() == dev && scratch.scalar_type() == torch::kUInt8 && scratch.is_contiguous() &&
                   static_cast<size_t>(scratch.numel()) >= need,
               "scratch must be a contiguous uint8 CUDA tensor of >= ", need,
               " bytes (lna2_moe_scratch_bytes), zeroed once before first use");
    // Every variant reads x and writes out with vector accesses (8 or 16 bytes): an unaligned view
    // is refused here rather than faulting on the device (it did, 2026-12-03, through v0).
    LNA2_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
               "x and out must be 16-byte aligned (pass fresh contiguous tensors, not offset views)");
    LNA2_CHECK(reinterpret_cast<uintptr_t>(scratch.data_ptr()) % 256 == 0, "scratch must be 256-byte aligned");
    // One launch reads x and writes out and scratch from different CTAs at different times: a row of
    // out written over x (an in-place call) would be read back by a later unit as its input.
    LNA2_CHECK(!overlaps(out, x) && !overlaps(out, scratch) && !overlaps(x, scratch),
               "out must not share memory with x or scratch, nor x with scratch (lna2 does not run in place: pass a fresh out)");

    const c10::cuda::CUDAGuard guard(dev);
    const auto [bps, sms] = grid_for(dev.index(), static_cast<int>(bits), static_cast<int>(codebook),
                                     static_cast<int>(variant), static_cast<int>(n_experts), static_cast<int>(m),
                                     static_cast<int>(top_k), static_cast<int>(hidden), static_cast<int>(intermediate));
    lna2::Args a{};
    a.x = x.data_ptr();
    a.out = out.data_ptr();
    for (int i = 0; i < 9; i++) a.tables[i] = tables[i]->data_ptr<int64_t>();
    a.expert_ids = expert_ids.data_ptr<int32_t>();
    a.weights = routing_weights.data_ptr<float>();
    a.scratch = scratch.data_ptr<uint8_t>();
    a.m = static_cast<int>(m);
    a.top_k = static_cast<int>(top_k);
    a.n_experts = static_cast<int>(n_experts);
    a.hidden = static_cast<int>(hidden);
    a.inter = static_cast<int>(intermediate);
    a.bits = static_cast<int>(bits);
    a.codebook = static_cast<int>(codebook);
    a.x_dtype = xdt;
    a.out_dtype = odt;
    a.variant = static_cast<int>(variant);
    a.swiglu_limit = static_cast<float>(swiglu_limit);
    a.trace = nullptr;
    if (trace.has_value() && trace->defined()) {
        LNA2_CHECK(variant >= 2 && (variant < lna2::ABLATION_VARIANT_BASE || lna2::is_cluster_variant(static_cast<int>(variant)) ||
                                    variant == lna2::V2_PRM_VARIANT || variant == lna2::V2_GRP_VARIANT ||
                                    variant == lna2::V2_KT2_VARIANT || variant == lna2::V2_KC32_VARIANT),
                   "trace is recorded by variants 2, 3, 4, 6, 7, 9, 20, 21, 26, 31, 36, 40, 46, 50, 53, 54, 55, 58, 59 and 17..19 only");
        LNA2_CHECK(trace->device() == dev && trace->scalar_type() == torch::kInt64 && trace->is_contiguous() &&
                       trace->numel() >= int64_t(bps) * sms * lna2::TRACE_EVENTS * 2,
                   "trace must be a contiguous int64 CUDA tensor of >= grid x ", lna2::TRACE_EVENTS, " x 2 elements");
        a.trace = reinterpret_cast<unsigned long long*>(trace->data_ptr<int64_t>());
    }
    cudaError_t err = lna2::launch(a, bps * sms, c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, "lna2_moe_decode: launch failed: ", cudaGetErrorString(err));
    return out;
}

std::vector<int64_t> lna2_moe_prepare(int64_t bits, int64_t codebook, int64_t variant) {
    int dev = 0;
    TORCH_CHECK(cudaGetDevice(&dev) == cudaSuccess, "lna2_moe_prepare: no CUDA device");
    // v2's residency depends on the call's rows (its pointer cache); report the seat's worst case
    const auto [bps, sms] = grid_for(dev, static_cast<int>(bits), static_cast<int>(codebook), static_cast<int>(variant),
                                     lna2::MAX_EXPERTS, lna2::MAX_ROWS, 6);
    return {sms, bps, static_cast<int64_t>(bps) * sms};
}

std::map<std::string, int64_t> lna2_moe_info(int64_t bits, int64_t codebook, int64_t hidden, int64_t intermediate) {
    int dev = 0;
    TORCH_CHECK(cudaGetDevice(&dev) == cudaSuccess, "lna2_moe_info: no CUDA device");
    const auto [bps, sms] = grid_for(dev, static_cast<int>(bits), static_cast<int>(codebook), 0, 0, 0, 0);
    return {
        {"sms", sms},
        {"blocks_per_sm", bps},
        {"grid", static_cast<int64_t>(bps) * sms},
        {"threads", lna2::THREADS},
        {"max_rows", lna2::MAX_ROWS},
        {"max_top_k", lna2::MAX_TOPK},
        {"max_experts", lna2::MAX_EXPERTS},
        {"group_rows", lna2::GROUP_ROWS},
        {"chunk_k_tiles", lna2::CHUNK_KT},
        {"partial_slots", lna2::PART_CAP},
        {"max_k_split", lna2::KSPLIT_MAX},
        {"scratch_bytes", lna2_moe_scratch_bytes(hidden, intermediate)},
        {"ctrl_bytes", static_cast<int64_t>(lna2::CTRL_BYTES)},
        {"concurrent_streams", 1},
    };
}

// The most rows (1 .. MAX_ROWS) at which a launch of `variant` on a layer of this shape fits the
// shared memory a block may have (smem_limit, or this device's opt-in maximum when 0); 0 when one row
// does not. A launch's shared memory grows with its rows (the pointer cache, the cluster kernel's
// partial buffers), so every row count up to the answer fits. sm_120 cards allow 99 KB a block,
// where the cluster kernel's K3 builds do not fit: the dispatch asks this before the policy picks.
int64_t lna2_moe_fit(int64_t variant, int64_t bits, int64_t codebook, int64_t hidden, int64_t intermediate,
                     int64_t top_k, int64_t n_experts, int64_t smem_limit) {
    TORCH_CHECK_VALUE(bits == 2 || bits == 3, message("lna2_moe_fit: bits must be 2 or 3, got ", bits));
    TORCH_CHECK_VALUE(top_k >= 1 && top_k <= lna2::MAX_TOPK && n_experts >= 1 && n_experts <= lna2::MAX_EXPERTS,
                      message("lna2_moe_fit: top_k must be 1..", lna2::MAX_TOPK, " and n_experts 1..",
                              lna2::MAX_EXPERTS, ", got ", top_k, " and ", n_experts));
    TORCH_CHECK_VALUE(smem_limit >= 0, message("lna2_moe_fit: smem_limit must be >= 0 (0: this device's), got ",
                                               smem_limit));
    int dev = 0, limit = static_cast<int>(smem_limit);
    TORCH_CHECK(cudaGetDevice(&dev) == cudaSuccess, "lna2_moe_fit: no CUDA device");
    if (limit == 0)
        TORCH_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess,
                    "lna2_moe_fit: cannot read the device's shared memory per block");
    int fit = 0;
    for (int m = 1; m <= lna2::MAX_ROWS; m++) {
        int bytes = 0;
        const cudaError_t err = lna2::smem_bytes(static_cast<int>(bits), static_cast<int>(codebook), static_cast<int>(variant),
                                                 static_cast<int>(n_experts), m, static_cast<int>(top_k),
                                                 static_cast<int>(hidden), static_cast<int>(intermediate), &bytes);
        TORCH_CHECK_VALUE(err == cudaSuccess, message("lna2_moe_fit: variant ", variant, " does not take bits=", bits,
                                                      " codebook=", codebook, " hidden=", hidden, " intermediate=",
                                                      intermediate, " (", cudaGetErrorString(err), ")"));
        if (bytes > limit) break;
        fit = m;
    }
    return fit;
}

std::string lna2_build_id() { return lna2::build_id(); }

// Benchmarks only: v2 resident CTAs per SM (0: as many as fit), the gate/up item target and
// whether down items may pair output blocks.
// Process-wide; the cached grids are recomputed.
void lna2_set_tuning(int64_t ctas_per_sm, int64_t items_x8, int64_t pair_down) {
    std::lock_guard<std::mutex> lk(g_mu);
    lna2::set_tuning(static_cast<int>(ctas_per_sm), static_cast<int>(items_x8), static_cast<int>(pair_down));
    lna2::v7_set_spread(static_cast<int>(ctas_per_sm));
    g_grid.clear();
}

// Benchmarks only: v26's K2 MCG launches run its stop build, stopping after their prologue (1) or
// route plan (2), or not (3, the control); 4 runs it to the end too, but a launch with nothing
// routed writes its zeros by a short inline loop instead of the gather; 0 = off (the launch split
// of NOTES.md's session 29 next step 1). What a launch stopped early writes is not the op.
void lna2_set_stop(int64_t stage) {
    TORCH_CHECK_VALUE(stage >= 0 && stage <= 4,
                      "lna2_set_stop: stage must be 0 (off), 1 (after the prologue), 2 (after the route plan), 3 "
                      "(the stop build run to the end) or 4 (3, with an inline zero store when nothing is routed), "
                      "got ", stage);
    std::lock_guard<std::mutex> lk(g_mu);
    lna2::v7_set_stop(static_cast<int>(stage));
    g_grid.clear();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "lna2: EXL3 routed-expert MoE decode kernel (dsv4serve)";
    m.def("lna2_moe_decode", &lna2_moe_decode, "one launch: routed experts for [m, top_k] routes",
          py::arg("x"), py::arg("out"), py::arg("gate_trellis"), py::arg("gate_suh"), py::arg("gate_svh"),
          py::arg("up_trellis"), py::arg("up_suh"), py::arg("up_svh"), py::arg("down_trellis"), py::arg("down_suh"),
          py::arg("down_svh"), py::arg("expert_ids"), py::arg("routing_weights"), py::arg("bits"),
          py::arg("swiglu_limit"), py::arg("scratch"), py::arg("intermediate") = kDefaultInter,
          py::arg("codebook") = static_cast<int64_t>(lna2::CB_MCG), py::arg("variant") = 0,
          py::arg("trace") = py::none());
    m.def("lna2_moe_scratch_bytes", &lna2_moe_scratch_bytes, py::arg("hidden") = kDefaultHidden,
          py::arg("intermediate") = kDefaultInter);
    m.def("lna2_moe_max_rows", &lna2_moe_max_rows);
    m.def("lna2_moe_prepare", &lna2_moe_prepare, "occupancy and grid: [sms, blocks_per_sm, grid]", py::arg("bits"),
          py::arg("codebook") = static_cast<int64_t>(lna2::CB_MCG), py::arg("variant") = 0);
    m.def("lna2_moe_info", &lna2_moe_info, "named facts of this build on the current device", py::arg("bits"),
          py::arg("codebook") = static_cast<int64_t>(lna2::CB_MCG), py::arg("hidden") = kDefaultHidden,
          py::arg("intermediate") = kDefaultInter);
    m.def("lna2_moe_fit", &lna2_moe_fit,
          "the most rows (0: none) at which a launch of variant fits a block's shared memory (0: this device's)",
          py::arg("variant"), py::arg("bits"), py::arg("codebook") = static_cast<int64_t>(lna2::CB_MCG),
          py::arg("hidden") = kDefaultHidden, py::arg("intermediate") = kDefaultInter, py::arg("top_k") = 6,
          py::arg("n_experts") = 256, py::arg("smem_limit") = 0);
    m.def("lna2_build_id", &lna2_build_id);
    m.def("lna2_set_tuning", &lna2_set_tuning, "benchmarks: v2 CTAs per SM (-1 = keep; for v7 0 = auto, 1 = one CTA per SM, 2 = as many as fit), item target x8 (0 = keep), paired down items (-1 = keep)",
          py::arg("ctas_per_sm") = -1, py::arg("items_x8") = 0, py::arg("pair_down") = -1);
    m.def("lna2_set_stop", &lna2_set_stop, "benchmarks: v26 K2 MCG launches stop after the prologue (1) or the route plan (2), or run its stop build to the end (3; 4: empty launches zero inline); 0 = off",
          py::arg("stage"));
}
