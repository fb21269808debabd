"""What a launch costs before any lna2 work: cold event timings (the bench's method: a 256 MiB
write before each launch, ten launches of one kernel in a row, median) of kernels that do nothing
but what their name says, launched like lna2's builds (256 threads; the cluster builds' 8-CTA
clusters and one CTA per SM; the ticket kernel's two CTAs per SM).

Device only (it compiles a small CUDA module with torch's cpp_extension). Run on the device:
    python3 scripts/launch_probe.py --out launch_probe.json
Session 29 wrote it to split the one-row TP8 time of the cluster kernel (v26, ~20 us on an H100,
~4.3 of it for a one-element add) into launch, cluster set-up, barriers and the first cold loads.
"""

import argparse
import json
import statistics

SRC = r"""
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>  // after torch/extension.h, the order the device run of session 29 built
namespace cg = cooperative_groups;

// mode bits: 1 cluster barrier x3, 2 a dependent chain of two cold loads (ids -> pointer -> store),
// 4 touch every byte of dynamic shared memory once (zero it)
__global__ void probe(const int* ids, const long long* table, float* out, int mode, int cluster) {
    extern __shared__ float sm[];
    if (mode & 4) {
        int n = 0;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
        for (int i = threadIdx.x; i < n / 4; i += blockDim.x) sm[i] = 0.f;
        __syncthreads();
    }
    if ((mode & 1) && cluster > 1) {
        cg::cluster_group cl = cg::this_cluster();
        cl.sync();
        cl.sync();
        cl.sync();
    }
    if (mode & 2) {
        if (threadIdx.x == 0) {
            const int e = __ldg(ids + (blockIdx.x % 6));
            const float* p = reinterpret_cast<const float*>(__ldg(table + e));
            out[blockIdx.x] = __ldg(p + blockIdx.x);
        }
    } else if (threadIdx.x == 0 && blockIdx.x == 0) {
        out[0] = 1.f;
    }
}

void launch(torch::Tensor ids, torch::Tensor table, torch::Tensor out, int64_t grid, int64_t cluster,
            int64_t smem, int64_t mode) {
    static int set = 0;
    if (!set) {
        cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
        cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
        set = 1;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(unsigned(grid));
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = size_t(smem);
    cfg.stream = at::cuda::getCurrentCUDAStream();
    cudaLaunchAttribute attr[1];
    cfg.attrs = attr;
    cfg.numAttrs = 0;
    if (cluster > 1) {
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = unsigned(cluster);
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.numAttrs = 1;
    }
    const cudaError_t err = cudaLaunchKernelEx(&cfg, probe, ids.data_ptr<int>(),
                                               reinterpret_cast<const long long*>(table.data_ptr<int64_t>()),
                                               out.data_ptr<float>(), int(mode), int(cluster));
    TORCH_CHECK(err == cudaSuccess, "probe launch: ", cudaGetErrorString(err));
}
"""

CPP = "void launch(torch::Tensor ids, torch::Tensor table, torch::Tensor out, int64_t grid, int64_t cluster, int64_t smem, int64_t mode);"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="launch_probe.json")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    import torch
    from torch.utils.cpp_extension import load_inline

    mod = load_inline("launch_probe", cpp_sources=CPP, cuda_sources=SRC, functions=["launch"],
                      extra_cuda_cflags=["-O3", "-gencode", "arch=compute_90,code=sm_90"], verbose=False)
    dev = torch.device("cuda:0")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=dev)
    ids = torch.tensor([3, 17, 40, 99, 128, 250], dtype=torch.int32, device=dev)
    rows = torch.randn(256, 4096, device=dev)
    table = torch.tensor([rows[i].data_ptr() for i in range(256)], dtype=torch.int64, device=dev)
    out = torch.zeros(4096, device=dev)

    def series(fn, n=10):
        ev = []
        torch.cuda.synchronize()
        torch.cuda._sleep(int(20e6))
        for _ in range(n):
            flush.fill_(1)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            ev.append((e0, e1))
        torch.cuda.synchronize()
        return [a.elapsed_time(b) * 1e3 for a, b in ev]

    cases = {
        "torch add (one element)": lambda: out[:1].add_(1.0),
    }
    shapes = [("plain 96 CTAs", 96, 1, 0), ("plain 264 CTAs (2/SM), 100 KiB", 2 * sms, 1, 100 * 1024),
              ("plain 96 CTAs, 200 KiB (1/SM)", 96, 1, 200 * 1024),
              ("cluster 8, 96 CTAs, no smem", 96, 8, 0), ("cluster 8, 96 CTAs, 200 KiB (1/SM)", 96, 8, 200 * 1024),
              ("cluster 8, 240 CTAs, 100 KiB (2/SM)", 240, 8, 100 * 1024)]
    for name, grid, cl, smem in shapes:
        for mode, mname in ((0, "noop"), (1, "3 cluster barriers"), (2, "ids -> pointer -> load"), (4, "zero smem"),
                            (7, "all three")):
            if (mode & 1) and cl == 1:
                continue
            if (mode & 4) and smem == 0:
                continue
            cases[f"{name} | {mname}"] = (lambda g=grid, c=cl, s=smem, m=mode: mod.launch(ids, table, out, g, c, s, m))
    for fn in cases.values():
        fn()
    torch.cuda.synchronize()
    acc = {k: [] for k in cases}
    for _ in range(args.reps):
        for k, fn in cases.items():
            acc[k] += series(fn)
    res = {"device": torch.cuda.get_device_name(dev), "sms": sms,
           "us": {k: round(statistics.median(v), 2) for k, v in acc.items()},
           "p10_p90": {k: (round(sorted(v)[len(v) // 10], 2), round(sorted(v)[9 * len(v) // 10], 2)) for k, v in acc.items()}}
    for k, v in res["us"].items():
        print(f"{v:7.2f}  {res['p10_p90'][k]}  {k}")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
