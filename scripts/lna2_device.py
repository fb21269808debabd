#!/usr/bin/env python3
"""lna2 on a GPU: build, parity against the fp64 reference, sanitizer smoke, and the benchmark
against exllamav3's incumbents, each writing JSON under $OUT.

Run on the device machine (see scripts/lna2_device.sh for the whole cycle in one call):
  lna2_device.py build                 # dsv4serve.lna2.build for TORCH_CUDA_ARCH_LIST (default 9.0)
  lna2_device.py parity [--quick]      # rows x routes x K x codebook x dtypes vs moe_reference (fp64)
  lna2_device.py smoke                 # a few calls, for compute-sanitizer memcheck/racecheck
  lna2_device.py bench --incumbent 145|165|none   # lna2 and one incumbent, same process, alternated
  lna2_device.py merge                 # bench JSONs -> kernels/lna2/results/<date>-<card>.json rows
  lna2_device.py sweep [--items 8,11]  # the gate/up item target (set_tuning, x/8) at the bench's K2 shapes
  lna2_device.py ablate                # variant 4 against its one-stage-removed timing ablations

The incumbents' calls follow what exllamav3 1.4.5 / vllm-exl3 0.2.3 and exllamav3 1.6.5 do
(shared/docs/exl3-reference.md §2.3, incumbent-h200.md, incumbent165-h200.md); weights and routing
use the same seeds as those measurements, so U (distinct experts) matches their tables row by row.
exllamav3 1.4.5 and 1.6.5 both name their extension `exllamav3_ext`, so each runs in its own process.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

OUT = Path(os.environ.get("OUT", REPO / ".device-out"))
E, TOPK, H, L_SWIGLU = 256, 6, 4096, 10.0
DEFAULT_VARIANTS = "59,55,58,46,26,36,54,53,50,40,31,4,21,20,9,7,1,6,2,3,0"  # the policy's builds first (lna2_device.sh has the same list)
VARIANTS = [int(v) for v in os.environ.get("LNA2_VARIANTS", DEFAULT_VARIANTS).split(",")]
SHAPES = {"tp8": 256, "tp1": 2048}
# Builds that run another build's arithmetic in its order, so parity records whether their outputs
# are that build's bits (only the fp64 tolerance is the gate): v50 decodes v4's integers, v53 is v50
# with another ring completion, v54 is v53 with two k-tiles per ring row.
BITWISE_TWINS = {50: 4, 53: 50, 54: 53}
CLUSTER_VARIANTS = {7, 9, 20, 21, 26, 31, 36, 40, 46, 58, 59, 17, 18, 19}  # v7, its bulk-copy builds 9, 20, 21, 26, 31, 36, 40, 46, 58, 59, its timing ablations (lna2_api.h)
ABLATION_VARIANTS = {10, 11, 12, 13, 17, 18, 19}  # K2 MCG only


def serves(variant, hidden, inter, K=None):
    """Whether `variant` takes a layer of this shape (the binding refuses the cluster kernel
    elsewhere, and the timing ablations at anything but K2 MCG)."""
    from dsv4serve.lna2.policy import cluster_kernel_takes

    if K is not None and K != 2 and variant in ABLATION_VARIANTS:
        return False
    return variant not in CLUSTER_VARIANTS or cluster_kernel_takes(hidden, inter)


def ns_stats(v, with_min=False):
    """Median and maximum (and count, or minimum) of nanosecond values, in us; None when empty."""
    v = sorted(v)
    if not v:
        return None
    head = {"min_us": round(v[0] / 1e3, 2)} if with_min else {"n": len(v)}
    return {**head, "median_us": round(v[len(v) // 2] / 1e3, 2), "max_us": round(v[-1] / 1e3, 2)}


def log(*a):
    print(*a, flush=True)


def dump(name, obj):
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(json.dumps(obj, indent=1, default=str))


# ------------------------------------------------------------------------------------------------
# lna2 side


def lna2_mod():
    from dsv4serve.lna2 import loader

    return loader.load()


def expert_tensors(layer):
    """A reference layer's nine expert-stacked tensors, in the order of the kernels' pointer tables."""
    return [layer.gate_trellis, layer.gate_suh, layer.gate_svh, layer.up_trellis, layer.up_suh, layer.up_svh,
            layer.down_trellis, layer.down_suh, layer.down_svh]


def pointer_tables(W, dev):
    """Per stacked tensor, the int64 table of its experts' data pointers (lna2's and exl3_moe's tables)."""
    from dsv4serve.lna2.selfcheck import pointer_tables as tables

    return tables(W, dev)


class Lna2Layer:
    """Pointer tables + scratch for one synthetic layer (tensors stacked over experts)."""

    def __init__(self, W, K, cb, I, dev):
        import torch

        self.W, self.K, self.cb, self.I = W, K, cb, I
        self.P = pointer_tables(W, dev)
        ext = lna2_mod()
        self.scratch = torch.zeros(ext.lna2_moe_scratch_bytes(H, I), dtype=torch.uint8, device=dev)
        self.ext = ext
        self.ctrl = int(ext.lna2_moe_info(K, 1, H, I)["ctrl_bytes"])  # control words: zero between launches

    def run(self, x, ids32, w32, out, variant=0, trace=None):
        self.ext.lna2_moe_decode(x, out, *self.P, ids32, w32, self.K, L_SWIGLU, self.scratch, self.I,
                                 1 if self.cb == "mcg" else 2, variant, trace)
        return out

    def ctrl_zero(self):
        """The contract every launch keeps: the control words (counters, FXA's sums) are back at zero."""
        return not bool(self.scratch[:self.ctrl].any())

    def poison(self):
        """NaN-fill every data byte of the scratch; the control words stay zero (the contract)."""
        import torch

        ctrl = self.ctrl
        self.scratch[ctrl:].view(-1)[: (self.scratch.numel() - ctrl) // 2 * 2].view(torch.float16).fill_(float("nan"))


def make_weights(I, K, dev, gen, suh_s=1 / 64, svh_gu=0.5, svh_d=1.0, seed=1234):
    import torch

    gen.manual_seed(seed + 10 * K + I)

    def trellis(k, n):
        return torch.randint(-32768, 32767, (E, k // 16, n // 16, 16 * K), dtype=torch.int16, device=dev, generator=gen)

    def signs(n, scale):
        s = torch.randint(0, 2, (E, n), device=dev, generator=gen).half() * 2 - 1
        return (s * scale).half().contiguous()

    g_tr, u_tr, d_tr = trellis(H, I), trellis(H, I), trellis(I, H)
    g_suh, u_suh, d_suh = signs(H, suh_s), signs(H, suh_s), signs(I, suh_s)
    g_svh, u_svh, d_svh = signs(I, svh_gu), signs(I, svh_gu), signs(H, svh_d)
    return [g_tr, g_suh, g_svh, u_tr, u_suh, u_svh, d_tr, d_suh, d_svh]


def make_routing(m, K, I, dev, gen):
    import torch

    gen.manual_seed(99 + m + 1000 * K + I)
    x = torch.randn((m, H), device=dev, generator=gen).half()
    sel = torch.rand((m, E), device=dev, generator=gen).topk(TOPK, dim=-1).indices.contiguous()
    rw = torch.softmax(torch.randn((m, TOPK), device=dev, generator=gen), dim=-1).half().contiguous()
    return x, sel, rw


def as_layer(W, K, cb, I):
    from dsv4serve.lna2.reference import ExpertLayer

    names = ["gate_trellis", "gate_suh", "gate_svh", "up_trellis", "up_suh", "up_svh", "down_trellis", "down_suh",
             "down_svh"]
    return ExpertLayer(**dict(zip(names, W)), K=K, codebook=cb, hidden=H, inter=I)


class DenseCache:
    """fp64 dense weights per expert, dequantised once (the reference's own dequantiser)."""

    def __init__(self, layer):
        self.layer, self.cache = layer, {}

    def get(self, e):
        if e not in self.cache:
            self.cache[e] = self.layer.dequantize_expert(e, __import__("torch").float64)
        return self.cache[e]

    def moe(self, x, ids, w, limit=L_SWIGLU):
        import torch

        from dsv4serve.lna2.reference import swiglu_clamped

        m = x.shape[0]
        xd = x.double()
        out = torch.zeros(m, H, dtype=torch.float64, device=x.device)
        ids_h = ids.tolist()
        for r in range(m):
            acc = torch.zeros(H, dtype=torch.float64, device=x.device)
            for s, e in enumerate(ids_h[r]):
                if not 0 <= e < E:  # not routed here (another rank's expert, or masked)
                    continue
                wg, wu, wd = self.get(e)
                a = swiglu_clamped(xd[r : r + 1] @ wg, xd[r : r + 1] @ wu, limit)
                acc = acc + w[r, s].double() * (a @ wd)[0]
            out[r] = acc
        return out


def worst_of(rel):
    """The largest per-row error, NaN if any row's is (Python's max() can pass a NaN over)."""
    return float("nan") if any(r != r for r in rel) else max(rel)


def row_rel(got, ref):
    """Per-row relative L2: `dsv4serve kernel check`'s own measure, so the two gates cannot drift."""
    from dsv4serve.lna2.selfcheck import row_errors

    return row_errors(got, ref)


def tensor_rel(got, ref):
    """Relative L2 error of a whole output against its fp64 reference (one figure per config)."""
    return float(((got.double() - ref).norm() / ref.norm()).item())


def routes(profile, m, gen, dev, top_k=TOPK):
    """Route profiles of the parity grid: ids [m, top_k] int64 on dev."""
    import torch

    if profile == "unique":
        return torch.rand((m, E), device=dev, generator=gen).topk(top_k, dim=-1).indices
    if profile == "hot":  # every row's slot 0 is expert 7: one expert with m rows
        ids = torch.rand((m, E), device=dev, generator=gen).topk(top_k, dim=-1).indices
        ids[ids == 7] = 8
        ids[:, 0] = 7
        return ids
    if profile == "zipf":
        p = 1.0 / torch.arange(1, E + 1, device=dev, dtype=torch.float64) ** 1.2
        return torch.stack([torch.multinomial(p, top_k, replacement=False, generator=gen) for _ in range(m)])
    if profile == "dup":  # duplicates within a row (the same expert in two slots)
        ids = torch.rand((m, E), device=dev, generator=gen).topk(top_k, dim=-1).indices
        ids[:, 1] = ids[:, 0]
        return ids
    if profile == "edge":  # ids at the table boundaries
        ids = torch.rand((m, E), device=dev, generator=gen).topk(top_k, dim=-1).indices
        mid = ids[:, 1:-1]
        mid[(mid == 0) | (mid == E - 1)] = 1 + torch.arange(int(((mid == 0) | (mid == E - 1)).sum()), device=dev) % (E - 2)
        ids[:, 0] = 0
        ids[:, -1] = E - 1
        return ids
    if profile == "masked":  # the last slot out of range in every row (-1 or past the table), the last row wholly
        ids = torch.rand((m, E), device=dev, generator=gen).topk(top_k, dim=-1).indices
        ids[:, -1] = torch.where(torch.arange(m, device=dev) % 2 == 0, -1, E + 3)
        if m > 1:
            ids[-1] = -1  # no expert at all: its output row is zero
        return ids
    raise ValueError(profile)


def cmd_build(args):
    from dsv4serve.lna2 import build

    t0 = time.time()
    path = build.build(arch=os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"), jobs=int(os.environ.get("MAX_JOBS", "8")),
                       verbose=True)
    log(f"lna2 built: {path} in {time.time() - t0:.1f} s")
    ext = lna2_mod()
    import torch

    log("build_id", ext.lna2_build_id(), "max_rows", ext.lna2_moe_max_rows(),
        "info", dict(ext.lna2_moe_info(2)), "device", torch.cuda.get_device_name())
    dump("lna2_build.json", {"seconds": time.time() - t0, "info_k2": dict(ext.lna2_moe_info(2)),
                             "info_k3": dict(ext.lna2_moe_info(3)), "prepare": ext.lna2_moe_prepare(2)})


def zero_weight_cases(lna, dense, res, K, cb, I, dev, gen, bad=5):
    """A slot of routing weight 0 adds nothing (every build's contract; FXA multiplies where the
    gather skips): expert `bad`'s down scales are set to inf on the kernel's side only, every row
    routes it at weight 0 in slot 0, and the output must be finite and match the reference, which
    still holds the expert's finite weights. The scales are restored before anything else runs."""
    import torch

    svh = lna.W[8]
    saved = svh[bad].clone()
    try:
        for m in (1, 4, 16):
            gen.manual_seed(4242 + m)
            pick = torch.rand((m, E), device=dev, generator=gen)
            pick[:, bad] = -1.0  # never chosen by topk, then placed in slot 0
            ids = pick.topk(TOPK, dim=-1).indices
            ids[:, 0] = bad
            w = torch.softmax(torch.randn((m, TOPK), device=dev, generator=gen), -1)
            w[:, 0] = 0.0
            x = torch.randn((m, H), device=dev, generator=gen).half()
            ref = dense.moe(x, ids, w)  # before the scales change: the reference's weights stay finite
            svh[bad].fill_(float("inf"))
            for variant in [v for v in VARIANTS if serves(v, H, I)]:
                out = torch.full((m, H), float("nan"), dtype=torch.float32, device=dev)
                lna.run(x, ids.to(torch.int32).contiguous(), w.float().contiguous(), out, variant)
                torch.cuda.synchronize()
                rel = row_rel(out, ref)
                ctrl_zero = lna.ctrl_zero()
                ok = bool(torch.isfinite(out).all()) and max(rel) <= 2e-3 and ctrl_zero
                case = {"variant": variant, "K": K, "cb": cb, "I": I, "m": m, "route": "zero-weight-inf-expert",
                        "worst_rel": worst_of(rel), "tol": 2e-3, "ok": ok, "ctrl_zero": ctrl_zero}
                res.setdefault("zero_weight", []).append(case)
                if not ok:
                    res["fail"] += 1
                    log("ZERO-WEIGHT FAIL", case)
            svh[bad].copy_(saved)
    finally:
        svh[bad].copy_(saved)
        torch.cuda.synchronize()


def cmd_parity(args):
    import torch

    dev = torch.device("cuda:0")
    gen = torch.Generator(device=dev)
    res = {"cases": [], "fail": 0}
    ms = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 20, 23, 24, 31, 32]
    if args.quick:
        ms = [1, 4, 9, 16, 24]  # 9: an expert with more rows than one v2 group (8)
    route_profiles = ["unique", "hot", "zipf", "dup", "edge", "masked"]
    combos = [(2, "mcg"), (3, "mcg"), (2, "mul1"), (3, "mul1")]
    out_dtypes = [torch.float32, torch.bfloat16, torch.float16]
    for K, cb in combos:
        for I in [int(v) for v in args.inters.split(",")]:
            from dsv4serve.lna2.reference import random_expert_layer

            t0 = time.time()
            layer = random_expert_layer(E, H, I, K, cb, seed=7 + K + I, device=dev)
            W = expert_tensors(layer)
            lna = Lna2Layer(W, K, cb, I, dev)
            dense = DenseCache(layer)
            case_ms = ms if I == 256 else ([1, 8] if args.quick else [1, 8, 16, 24])
            idx = 0
            for m in case_ms:
                for rp in route_profiles if I == 256 else ["unique", "hot"]:
                    idx += 1
                    gen.manual_seed(1000 * m + idx)
                    ids = routes(rp, m, gen, dev)
                    w = torch.softmax(torch.randn((m, TOPK), device=dev, generator=gen), -1) * 1.5
                    x16 = torch.randn((m, H), device=dev, generator=gen)
                    xdt = torch.bfloat16 if idx % 2 else torch.float16
                    x = x16.to(xdt)
                    odt = out_dtypes[idx % 3]
                    ref = dense.moe(x, ids, w)
                    ids32 = ids.to(torch.int32).contiguous()
                    w32 = w.float().contiguous()
                    outs, cases = {}, {}
                    for variant in [v for v in VARIANTS if serves(v, H, I)]:
                        out = torch.full((m, H), float("nan"), dtype=odt, device=dev)
                        if idx % 4 == 0:
                            lna.poison()
                        lna.run(x, ids32, w32, out, variant)
                        out2 = torch.full_like(out, float("nan"))
                        lna.run(x, ids32, w32, out2, variant)
                        torch.cuda.synchronize()
                        rel = row_rel(out.float(), ref)
                        tol = 2e-3 if odt == torch.float32 else 6e-3
                        ok = all(r <= tol for r in rel) and bool(torch.isfinite(out.float()).all())
                        rep = bool(torch.equal(out, out2))
                        ctrl_zero = lna.ctrl_zero()
                        ok = ok and ctrl_zero
                        case = {"variant": variant, "K": K, "cb": cb, "I": I, "m": m, "route": rp, "x": str(xdt),
                                "out": str(odt), "worst_rel": worst_of(rel), "tol": tol, "ok": ok, "bitwise_repeat": rep,
                                "ctrl_zero": ctrl_zero,
                                "U": int(torch.unique(ids[(ids >= 0) & (ids < E)]).numel())}
                        outs[variant], cases[variant] = out, case
                        res["cases"].append(case)
                        if not (ok and rep):
                            res["fail"] += 1
                            log("FAIL", case)
                    for v, twin in BITWISE_TWINS.items():
                        if v in outs and twin in outs:
                            cases[v][f"bitwise_vs_v{twin}"] = bool(torch.equal(outs[v], outs[twin]))
            worst = max((c["worst_rel"] for c in res["cases"] if c["K"] == K and c["cb"] == cb and c["I"] == I),
                        default=None)  # None: no listed variant serves this shape
            log(f"K{K} {cb} I={I}: {idx} cases, worst " + (f"{worst:.2e}" if worst is not None else "-") +
                f" ({time.time() - t0:.1f} s)")
            if I == 256:
                zero_weight_cases(lna, dense, res, K, cb, I, dev, gen)
            # CUDA graph: capture at m, replay with fresh inputs copied into the static buffers
            for m, gvar in [(m_, v_) for m_ in ([1, 4, 16] if args.quick else [1, 4, 16, 24]) for v_ in VARIANTS[:2]]:
                if (I != 256 and m != 4) or not serves(gvar, H, I):
                    continue
                gen.manual_seed(777 + m)
                xs = torch.zeros((m, H), dtype=torch.float16, device=dev)
                ids_s = torch.zeros((m, TOPK), dtype=torch.int32, device=dev)
                w_s = torch.zeros((m, TOPK), dtype=torch.float32, device=dev)
                o_s = torch.zeros((m, H), dtype=torch.float32, device=dev)
                xs.copy_(torch.randn((m, H), device=dev, generator=gen))
                ids_s.copy_(routes("unique", m, gen, dev))
                w_s.copy_(torch.rand((m, TOPK), device=dev, generator=gen))
                lna.run(xs, ids_s, w_s, o_s, gvar)  # warm, outside capture
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(g):
                        lna.run(xs, ids_s, w_s, o_s, gvar)
                    worst = 0.0
                    for rep_i in range(8):
                        xs.copy_(torch.randn((m, H), device=dev, generator=gen))
                        ids_s.copy_(routes(["unique", "hot", "zipf", "dup"][rep_i % 4], m, gen, dev))
                        w_s.copy_(torch.rand((m, TOPK), device=dev, generator=gen))
                        o_s.fill_(float("nan"))
                        g.replay()
                        torch.cuda.synchronize()
                        worst = max(worst, max(row_rel(o_s, dense.moe(xs, ids_s.long(), w_s))))
                    gcase = {"variant": gvar, "K": K, "cb": cb, "I": I, "m": m, "graph_replays": 8,
                             "worst_rel": worst, "ok": worst <= 2e-3}
                except Exception as e:  # noqa: BLE001
                    gcase = {"variant": gvar, "K": K, "cb": cb, "I": I, "m": m, "graph_error": repr(e)[-500:],
                             "ok": False}
                res.setdefault("graph", []).append(gcase)
                if not gcase["ok"]:
                    res["fail"] += 1
                    log("GRAPH FAIL", gcase)
            del lna, dense, layer, W
            torch.cuda.empty_cache()
            dump("lna2_parity.json", res)
    log(f"parity: {len(res['cases'])} cases + {len(res.get('graph', []))} graph cases + "
        f"{len(res.get('zero_weight', []))} zero-weight cases, fail={res['fail']}, worst "
        f"{max(c['worst_rel'] for c in res['cases']):.2e}")
    dump("lna2_parity.json", res)
    if res["fail"]:
        sys.exit(1)


def cmd_smoke(args):
    """Small, quick calls for compute-sanitizer (memcheck / racecheck / synccheck)."""
    import torch

    from dsv4serve.lna2.reference import random_expert_layer

    dev = torch.device("cuda:0")
    gen = torch.Generator(device=dev)
    launches: dict[int, int] = {}  # per variant: the log says what a sanitizer run actually covered
    for K, cb in ((2, "mcg"), (3, "mul1")):
        layer = random_expert_layer(32, 1024, 256, K, cb, seed=3, device=dev)
        P = pointer_tables(expert_tensors(layer), dev)
        ext = lna2_mod()
        scratch = torch.zeros(ext.lna2_moe_scratch_bytes(1024, 256), dtype=torch.uint8, device=dev)
        for m in (1, 5, 17):
            gen.manual_seed(m)
            ids = torch.randint(0, 32, (m, TOPK), device=dev, generator=gen).to(torch.int32)
            w = torch.rand((m, TOPK), device=dev, generator=gen)
            x = torch.randn((m, 1024), device=dev, generator=gen).half()
            out = torch.empty((m, 1024), dtype=torch.float32, device=dev)
            for variant in [v for v in VARIANTS if serves(v, 1024, 256)]:
                ext.lna2_moe_decode(x, out, *P, ids, w, K, L_SWIGLU, scratch, 256, 1 if cb == "mcg" else 2, variant)
                launches[variant] = launches.get(variant, 0) + 1
        torch.cuda.synchronize()
    # Paired down items (lna2_v2.cu make_cfg, c.DB = 2) need >= 4 down items per CTA: a 4096-wide
    # layer (32 output blocks) at one CTA per SM gets there from ~17 groups.
    ext = lna2_mod()
    layer = random_expert_layer(32, H, 256, 2, "mcg", seed=4, device=dev)
    P = pointer_tables(expert_tensors(layer), dev)
    scratch = torch.zeros(ext.lna2_moe_scratch_bytes(H, 256), dtype=torch.uint8, device=dev)
    ext.lna2_set_tuning(1, 0, -1)
    for m in (5, 17):
        gen.manual_seed(100 + m)
        ids = torch.randint(0, 32, (m, TOPK), device=dev, generator=gen).to(torch.int32)
        w = torch.rand((m, TOPK), device=dev, generator=gen)
        x = torch.randn((m, H), device=dev, generator=gen).half()
        out = torch.empty((m, H), dtype=torch.float32, device=dev)
        for variant in [v for v in VARIANTS if v >= 2 and serves(v, H, 256)]:
            ext.lna2_moe_decode(x, out, *P, ids, w, 2, L_SWIGLU, scratch, 256, 1, variant)
            launches[variant] = launches.get(variant, 0) + 1
    ext.lna2_set_tuning(0, 0, -1)
    torch.cuda.synchronize()
    log("smoke ok: launches per variant " + ", ".join(f"v{v} x{n}" for v, n in sorted(launches.items())))


def cmd_dispatch(args):
    """Issue 4 on the GPU: dsv4serve.moe_dispatch.Runtime with the real lna2 build serving stacked,
    vllm-exl3-shaped layers (Exl3MoEMethod's parameter names and shapes, exl3-reference §4.4) at
    I = 256 and 1024, every row count from 1 to past the ceiling, fp16/bf16, aligned and unaligned
    x, flat and [m, top_k] ids, and a CUDA graph of the wrapped apply; each call compared with
    exllamav3 1.4.5's exl3_moe as vllm-exl3 0.2.3 calls it (when importable) and, at some rows,
    with the fp64 reference. With DISPATCH_TUNING=FILE the Runtime serves that tuning table (strict 1,
    as a seat with moe.tuning), each call's expected build is the table's where it holds the layer,
    and a copy of the table naming another card must be refused at load; DISPATCH_TAG names the
    outputs (dispatch<TAG>.json, dispatch<TAG>-run/) so two runs in one call keep both."""
    import torch

    from dsv4serve import moe_dispatch as md
    from dsv4serve.lna2 import loader
    from dsv4serve.lna2.policy import variant_for
    from dsv4serve.lna2.reference import MCG_MARKER
    from dsv4serve.plugin_counters import Counters

    dev = torch.device("cuda:0")
    gen = torch.Generator(device=dev)
    try:
        inc_ext, inc_dir = load_exl3_ext()
    except Exception as e:  # noqa: BLE001 - recorded; the reference still checks every call
        inc_ext, inc_dir = None, f"not importable: {e}"
    res = {"incumbent": "exllamav3 1.4.5 exl3_moe" if inc_ext else None, "incumbent_dir": inc_dir, "layers": [],
           "calls": [], "fail": 0}

    class Exl3MoEMethod:
        """Stand-in for vllm_exl3's Exl3MoEMethod (vllm-exl3 needs its own vLLM build, not installed
        on the device): same class name under a vllm_exl3 module, and an apply that is the real
        incumbent kernel (exllamav3 1.4.5 exl3_moe, called as vllm-exl3 0.2.3 does), or the fp64
        reference when exllamav3 is not importable."""

        def __init__(self, inc, dense):
            self.inc, self.dense, self.last_fp32 = inc, dense, None

        def apply(self, layer, x, topk_weights, topk_ids, *rest, **kw):
            rows = x.numel() // x.shape[-1]
            ids = topk_ids.reshape(rows, TOPK).long()
            w = topk_weights.reshape(rows, TOPK)
            if self.inc is not None:
                out = torch.zeros((rows, H), dtype=torch.float32, device=x.device)
                # exl3_moe faults on an offset view of x (misaligned address, 2026-12-03 run 4); vLLM's
                # activations are fresh tensors, so the stand-in hands it a fresh fp16 copy
                self.inc.launch(x.reshape(rows, H).to(torch.float16, copy=True), out, self.inc.prep(ids, w.half()))
            else:
                out = self.dense.moe(x.reshape(rows, H), ids, w.float()).float()
            self.last_fp32 = out
            return out.to(x.dtype).view(x.shape)

    Exl3MoEMethod.__module__ = "vllm_exl3.layers.moe"

    def make_layer(I, K):
        W = make_weights(I, K, dev, gen)
        m = torch.nn.Module()
        prm = lambda t: torch.nn.Parameter(t.contiguous(), requires_grad=False)  # noqa: E731
        m.w13_trellis = prm(torch.stack([W[0], W[3]], dim=1))
        m.w13_suh = prm(torch.stack([W[1], W[4]], dim=1))
        m.w13_svh = prm(torch.stack([W[2], W[5]], dim=1))
        m.w2_trellis, m.w2_suh, m.w2_svh = prm(W[6]), prm(W[7]), prm(W[8])
        del W
        m.register_buffer("w13_mcg", torch.full((E, 2, 1), MCG_MARKER, dtype=torch.int32, device=dev))
        m.register_buffer("w2_mcg", torch.full((E, 1), MCG_MARKER, dtype=torch.int32, device=dev))
        m.top_k, m.swiglu_limit = TOPK, L_SWIGLU
        views = [m.w13_trellis[:, 0], m.w13_suh[:, 0], m.w13_svh[:, 0], m.w13_trellis[:, 1], m.w13_suh[:, 1],
                 m.w13_svh[:, 1], m.w2_trellis, m.w2_suh, m.w2_svh]
        dense = DenseCache(as_layer(views, K, "mcg", I))
        inc = Inc145(inc_ext, views, K, I, dev) if inc_ext is not None else None
        m.quant_method = Exl3MoEMethod(inc, dense)
        return m, dense

    lines: list[str] = []
    tag = os.environ.get("DISPATCH_TAG", "")
    tuning_file = os.environ.get("DISPATCH_TUNING") or None
    run_dir = OUT / f"dispatch{tag}-run"
    env = md.PluginEnv(run_id="device", run_dir=str(run_dir), kernel="lna2", strict=1, tuning=tuning_file)
    res["tuning"] = tuning_file
    counters = Counters(str(run_dir), 0, 1, "lna2")
    launched: list[int] = []  # the build each lna2_moe_decode call was handed (its last argument)

    class Recording:
        """The real extension, with the build number of each decode call noted on its way through."""

        def __init__(self, ext):
            self._ext = ext

        def __getattr__(self, name):
            return getattr(self._ext, name)

        def lna2_moe_decode(self, *a):
            launched.append(int(a[-1]))
            return self._ext.lna2_moe_decode(*a)

    rt = md.Runtime(env, 0, 1, emit=lambda ln: (lines.append(ln), log(ln)), counters=counters,
                    ext_loader=lambda: Recording(loader.load()))
    specs = [(256, 2), (1024, 2), (256, 3)]
    built = [(f"model.layers.{3 + i}.mlp.experts", *make_layer(I, K), I, K) for i, (I, K) in enumerate(specs)]
    summary = rt.prepare([(name, m) for name, m, _, _, _ in built], draft=False)
    res["prepare"] = {"lna2_layers": summary.lna2_layers, "not_ready": summary.not_ready, "ceiling": rt.ceiling,
                      "build_id": rt.build_id}
    log(f"prepared: {summary.lna2_layers} lna2 layers, ceiling {rt.ceiling}, build {rt.build_id}")
    for name, m, dense, I, K in built:
        st = m.quant_method._dsv4serve_state
        res["layers"].append({"name": name, "I": I, "K": K, "geometry": str(st.geometry), "tuned": st.tuned})
        orig = m.quant_method.apply._dsv4serve_orig
        for rows in list(range(1, rt.ceiling + 1)) + [rt.ceiling + 1, 2 * rt.ceiling]:
            if K == 3 and rows not in (1, 2, 4, 8, 16, rt.ceiling, rt.ceiling + 1):
                continue
            gen.manual_seed(31 * rows + I + K)
            xdt = torch.bfloat16 if rows % 2 else torch.float16
            aligned = rows % 3 != 0
            base = torch.randn((rows * H + 8,), device=dev, generator=gen).to(xdt)
            x = base[:rows * H].view(rows, H) if aligned else base[1:rows * H + 1].view(rows, H)
            ids = torch.rand((rows, E), device=dev, generator=gen).topk(TOPK, dim=-1).indices
            flat = rows % 4 == 1
            w = torch.softmax(torch.randn((rows, TOPK), device=dev, generator=gen), -1)
            before = dict(counters.calls)
            launched.clear()
            where = f"I={I} K={K} rows={rows} x={xdt} aligned={aligned} flat={flat}"
            try:
                got = m.quant_method.apply(m, x, w.reshape(-1) if flat else w, ids.reshape(-1) if flat else ids)
                torch.cuda.synchronize()
            except Exception as e:  # a device fault poisons the context: say where, then stop
                log(f"FAULT in the dispatched apply ({where}, policy variant "
                    f"{variant_for(rows, I, K)}): {e}")
                raise
            after = dict(counters.calls)
            served = "lna2" if after["lna2"] > before["lna2"] else "incumbent"
            try:
                orig(m, x, w, ids)
                torch.cuda.synchronize()
            except Exception as e:
                log(f"FAULT in the incumbent's apply ({where}): {e}")
                raise
            inc = m.quant_method.last_fp32
            rel_inc = max(row_rel(got.float(), inc.double()))
            case = {"I": I, "K": K, "rows": rows, "x": str(xdt), "aligned": aligned, "flat_ids": flat,
                    "served": served, "variant": variant_for(rows, I, K, H, st.fit, st.tuned),
                    "launched": launched[0] if served == "lna2" and launched else None,
                    "rel_vs_incumbent": rel_inc}
            want = "lna2" if rows <= rt.ceiling else "incumbent"
            tol = 1.2e-2 if xdt == torch.bfloat16 else 6e-3  # both kernels' error plus the output's rounding
            ok = served == want and rel_inc <= tol and bool(torch.isfinite(got.float()).all())
            ok = ok and (served != "lna2" or case["launched"] == case["variant"])  # the build the table says
            if I == 256 and K == 2 and rows in (1, 5, 8, 9, 16, rt.ceiling):
                case["rel_vs_reference"] = max(row_rel(got.float(), dense.moe(x, ids, w)))
                ok = ok and case["rel_vs_reference"] <= (1e-2 if xdt == torch.bfloat16 else 6e-3)
            case["ok"] = ok
            res["calls"].append(case)
            if not ok:
                res["fail"] += 1
                log("FAIL", case)
        log(f"{name} I={I} K={K}: {sum(1 for c in res['calls'] if c['I'] == I and c['K'] == K)} calls, worst vs "
            f"incumbent {max(c['rel_vs_incumbent'] for c in res['calls'] if c['I'] == I and c['K'] == K and c['served'] == 'lna2'):.2e}")
        dump(f"dispatch{tag}.json", res)

    # a CUDA graph of the wrapped apply (what vLLM captures), replayed with fresh inputs; one row
    # and four (the cluster kernel) and sixteen (v4), so both of the policy's variants at this
    # layer's shape are captured
    name, m, dense, I, K = built[0]
    st0 = m.quant_method._dsv4serve_state
    res["graph"] = []
    for rows in (1, 4, 16):
        xs = torch.zeros((rows, H), dtype=torch.bfloat16, device=dev)
        ids_s = torch.zeros((rows, TOPK), dtype=torch.int64, device=dev)
        w_s = torch.full((rows, TOPK), 1.0 / TOPK, dtype=torch.float32, device=dev)
        ids_s.copy_(torch.arange(rows * TOPK, device=dev).view(rows, TOPK))
        m.quant_method.apply(m, xs, w_s, ids_s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        calls_before = counters.calls["lna2"]
        try:
            with torch.cuda.graph(g):
                out_s = m.quant_method.apply(m, xs, w_s, ids_s)
            worst = 0.0
            for rep in range(6):
                xs.copy_(torch.randn((rows, H), device=dev, generator=gen))
                ids_s.copy_(torch.rand((rows, E), device=dev, generator=gen).topk(TOPK, dim=-1).indices)
                w_s.copy_(torch.softmax(torch.randn((rows, TOPK), device=dev, generator=gen), -1))
                g.replay()
                torch.cuda.synchronize()
                got = out_s.clone()
                m.quant_method.apply._dsv4serve_orig(m, xs, w_s, ids_s)
                worst = max(worst, max(row_rel(got.float(), m.quant_method.last_fp32.double())))
            gcase = {"layer": name, "rows": rows, "variant": variant_for(rows, I, K, H, st0.fit, st0.tuned), "replays": 6,
                     "worst_rel_vs_incumbent": worst,
                     "lna2_calls_counted_by_capture": counters.calls["lna2"] - calls_before, "ok": worst <= 1.2e-2}
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize()
            gcase = {"layer": name, "rows": rows, "variant": variant_for(rows, I, K, H, st0.fit, st0.tuned),
                     "error": repr(e)[-800:],
                     "ok": False}
        res["graph"].append(gcase)
        if not gcase["ok"]:
            res["fail"] += 1
        log("graph:", gcase)
    # the per-size record check-seat reads (counters' `graphs`), from the real capture: each size above
    # held lna2; a size above the ceiling is captured with the incumbent and recorded as declined
    over = rt.ceiling + 1
    try:
        xs = torch.randn((over, H), device=dev, generator=gen).to(torch.bfloat16)
        ids_s = torch.rand((over, E), device=dev, generator=gen).topk(TOPK, dim=-1).indices
        w_s = torch.softmax(torch.randn((over, TOPK), device=dev, generator=gen), -1)
        m.quant_method.apply(m, xs, w_s, ids_s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            m.quant_method.apply(m, xs, w_s, ids_s)
        over_note = None
    except Exception as e:  # noqa: BLE001 - the incumbent's own capture; the record is still read
        torch.cuda.synchronize()
        over_note = repr(e)[-300:]
    rec = {str(k): v for k, v in counters.graphs.items()}
    gok = all(rec.get(str(r), {}).get("lna2", 0) >= 1 and rec.get(str(r), {}).get("declined", 0) == 0
              for r in (1, 4, 16))
    # recorded before the incumbent's apply runs, so even a failed incumbent capture leaves it
    gok = gok and rec.get(str(over), {}).get("declined", 0) >= 1
    res["graphs_recorded"] = {"record": rec, "over_ceiling_capture_error": over_note, "ok": gok}
    if not gok:
        res["fail"] += 1
    log("graph record:", res["graphs_recorded"])

    # whole-op time as vLLM sees it (Python dispatch included), warm, against the incumbent's apply
    res["timing_us"] = []
    for name, m, dense, I, K in built[:2]:
        orig = m.quant_method.apply._dsv4serve_orig
        for rows in (1, 4, 8, 16):
            x = torch.randn((rows, H), device=dev, generator=gen).to(torch.bfloat16)
            ids = torch.rand((rows, E), device=dev, generator=gen).topk(TOPK, dim=-1).indices
            w = torch.softmax(torch.randn((rows, TOPK), device=dev, generator=gen), -1)
            row = {"I": I, "K": K, "rows": rows}
            for label, fn in (("dispatch_lna2", lambda: m.quant_method.apply(m, x, w, ids)),
                              ("incumbent_apply", lambda: orig(m, x, w, ids))):
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                ts = []
                for _ in range(30):
                    a_, b_ = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a_.record(); fn(); b_.record()
                    torch.cuda.synchronize()
                    ts.append(a_.elapsed_time(b_) * 1e3)
                row[label] = statistics.median(ts)
            res["timing_us"].append(row)
            log("timing", row)
    # the strict decode-rows check with the real build (DSV4SERVE_DECODE_ROWS, which launch sets from
    # max_num_seqs x (1 + speculative tokens)): a seat decoding more rows than the build's ceiling
    # is refused at load, one decoding exactly the ceiling is not
    def refusal(env_x):
        """Why a strict Runtime of this env refuses a fresh K2 layer at load, or None when it takes it."""
        rt_x = md.Runtime(env_x, 0, 1, emit=lambda ln: None, counters=Counters(env_x.run_dir, 0, 1, "lna2"),
                          ext_loader=loader.load)
        try:
            rt_x.prepare([("model.layers.9.mlp.experts", make_layer(256, 2)[0])], draft=False)
        except md.Lna2NotReadyError as e:
            return str(e)
        return None

    res["decode_rows"] = []
    for rows_, refuse in ((rt.ceiling, False), (rt.ceiling + 1, True)):
        got = refusal(md.PluginEnv(run_id="device-rows", run_dir=str(OUT / "dispatch-rows"), kernel="lna2",
                                   strict=1, decode_rows=rows_))
        ok = (got is not None and f"takes at most {rt.ceiling} rows a call but this seat decodes {rows_}" in got) \
            if refuse else got is None
        res["decode_rows"].append({"decode_rows": rows_, "refused": got, "ok": ok})
        log("decode rows", res["decode_rows"][-1])
        if not ok:
            res["fail"] += 1
    if tuning_file:
        # the same table with another card's name: a strict seat must refuse it at load
        doc = json.loads(Path(tuning_file).read_text())
        doc["device"] = "Another Card"
        other = OUT / f"tuning-other{tag}.json"
        other.write_text(json.dumps(doc))
        got = refusal(md.PluginEnv(run_id="device-other", run_dir=None, kernel="lna2", strict=1,
                                   tuning=str(other)))
        ok = got is not None and "is not this card's: it was measured on a Another Card" in got
        res["tuning_other_card"] = {"refused": got, "ok": ok}
        log("tuning of another card", res["tuning_other_card"])
        if not ok:
            res["fail"] += 1
    counters.write(final=True)
    res["counters"] = {"calls": dict(counters.calls), "declines": dict(counters.declines)}
    res["markers"] = [ln for ln in lines if "ACTIVE" in ln or "declined" in ln.lower()]
    res["active_marker_lines"] = sum(1 for ln in lines if "LNA2 MoE kernel ACTIVE" in ln)
    if res["active_marker_lines"] != 1:
        res["fail"] += 1
    res["counters_file"] = sorted(str(p.relative_to(OUT)) for p in run_dir.rglob("*.json")) if run_dir.exists() else []
    if tuning_file and not any("policy=tuned:" in ln for ln in res["markers"]):
        res["fail"] += 1
        log("FAIL: the ACTIVE line does not name the tuning table")
    dump(f"dispatch{tag}.json", res)
    log(f"dispatch: {len(res['calls'])} calls, fail={res['fail']}, counters {res['counters']}")
    if res["fail"]:
        sys.exit(1)


# ------------------------------------------------------------------------------------------------
# incumbents


def load_exl3_ext():
    """exllamav3.ext without running exllamav3/__init__.py (whose imports need more packages)."""
    pkgdir = None
    for p in sys.path:
        cand = os.path.join(p or ".", "exllamav3", "ext.py")
        if os.path.isfile(cand):
            pkgdir = os.path.dirname(os.path.abspath(cand))
            break
    if pkgdir is None:
        raise RuntimeError("exllamav3 is not on sys.path")
    if "exllamav3" not in sys.modules:
        stub = types.ModuleType("exllamav3")
        stub.__path__ = [pkgdir]
        stub.__file__ = os.path.join(pkgdir, "__init__.py")
        sys.modules["exllamav3"] = stub
    import exllamav3.ext as e

    return e.exllamav3_ext, pkgdir


class Inc145:
    """exllamav3 1.4.5 exl3_moe as vllm-exl3 0.2.3 calls it: R = 2048 temp rows, num_active -1,
    argsort + scatter_add count (no host sync), fp32 output zeroed by the caller."""

    def __init__(self, ext, W, K, I, dev):
        import torch

        self.ext, self.K, self.I = ext, K, I
        C = ext.exl3_moe_max_concurrency(dev.index or 0)
        R = 2048
        self.t = [torch.zeros((C, R, H), dtype=torch.half, device=dev), torch.zeros((C, R, H), dtype=torch.half, device=dev),
                  torch.zeros((C, R, I), dtype=torch.half, device=dev), torch.zeros((C, R, I), dtype=torch.half, device=dev)]
        self.P = pointer_tables(W, dev)

    def prep(self, sel, rw):
        import torch

        m = sel.shape[0]
        fe = sel.reshape(-1)
        order = fe.argsort()
        cnt = torch.zeros((E + 1,), dtype=torch.long, device=sel.device)
        cnt.scatter_add_(0, fe, torch.ones_like(fe))
        tok = torch.arange(m, device=sel.device).repeat_interleave(TOPK)
        return cnt, tok[order], rw.reshape(-1)[order]

    def launch(self, x, out, st):
        cnt, ts, ws = st
        self.ext.exl3_moe(x, out, cnt, ts, ws, *self.t, 0, self.K, self.K, self.K, *self.P,
                          True, False, True, False, True, False, L_SWIGLU, -1)


class Inc165:
    """exllamav3 1.6.5's decode path: exl3_moe_coop for m <= 8 (no prep, no host sync), the fused
    tier exl3_moe (deterministic slot scratch) + exl3_moe_gather above."""

    MAX_BSZN = 8

    def __init__(self, ext, W, K, I, dev):
        import torch

        self.ext, self.K, self.I, self.dev = ext, K, I, dev
        self.P = pointer_tables(W, dev)
        C = ext.exl3_moe_max_concurrency(dev.index or 0)
        self.R = 128
        self.fb = [torch.zeros((C, self.R, H), dtype=torch.half, device=dev), torch.zeros((C, self.R, H), dtype=torch.half, device=dev),
                   torch.zeros((C, self.R, I), dtype=torch.half, device=dev), torch.zeros((C, self.R, I), dtype=torch.half, device=dev)]
        slots, rows = self.MAX_BSZN * TOPK, self.MAX_BSZN
        z = lambda shape, dt: torch.zeros(shape, dtype=dt, device=dev)  # noqa: E731
        self.cb = dict(had_g=z((slots, H), torch.half), had_u=z((slots, H), torch.half), gu_g=z((slots, I), torch.half),
                       gu_u=z((slots, I), torch.half), act_out=z((slots, I), torch.half), d_out=z((slots, H), torch.float),
                       ctr=z((slots * (I // 128) + rows * (H // 128) + 2 * slots + 3,), torch.int),
                       out=z((rows, H), torch.float))

    def coop(self, x, sel, rw):
        c = self.cb
        self.ext.exl3_moe_coop(x, sel, rw, -1, -1, H, *self.P, None, None, None, float(self.K), float(self.K),
                               float(self.K), True, False, 0, L_SWIGLU, True, c["had_g"], c["had_u"], c["gu_g"],
                               c["gu_u"], c["act_out"], c["d_out"], c["ctr"], c["out"], None, None)

    def fused_prep(self, sel, rw):
        import torch

        m = sel.shape[0]
        fe = sel.reshape(-1)
        fw = rw.reshape(-1)
        order = fe.argsort()
        tok = torch.arange(m, device=sel.device).repeat_interleave(TOPK)
        cnt = torch.bincount(fe, minlength=E + 1)
        A = fe.shape[0]
        inv = torch.empty_like(order).scatter_(0, order, torch.arange(A, device=sel.device))
        if A <= self.R:
            es = torch.cumsum(cnt, 0) - cnt
            tables = torch.stack([es, es, (cnt > 0).long()])
            n_slots, na = A, -1
        else:  # 1.6.5 reads the counts back and builds the slot tables on the host
            lst = cnt.tolist()
            base, kind, starts, n_slots, na = [0] * (E + 1), [0] * (E + 1), [], 0, 0
            acc = 0
            for e in range(E + 1):
                starts.append(acc)
                acc += lst[e]
            for e in range(E):
                if 0 < lst[e] <= self.R:
                    base[e], kind[e] = n_slots, 1
                    n_slots += lst[e]
                    na += 1
            tables = torch.tensor([base, starts, kind], dtype=torch.long, device=sel.device)
        scratch = torch.empty((max(n_slots, 1), H), dtype=torch.float, device=sel.device)
        return dict(fe=fe, ts=tok[order], ws=fw[order], cnt=cnt, inv=inv, tables=tables, scratch=scratch, na=na)

    def fused(self, x, out, st):
        tb = st["tables"]
        self.ext.exl3_moe(x, out, st["cnt"], st["ts"], st["ws"], *self.fb, 0, float(self.K), float(self.K),
                          float(self.K), *self.P, True, False, True, False, True, False, L_SWIGLU, st["na"],
                          st["scratch"], tb[0], 1, self.R, 16)
        self.ext.exl3_moe_gather(out, st["scratch"], st["fe"], st["inv"], tb[1, :E], tb[0, :E], tb[2, :E], st["ws"])


def gemm_before(dev):
    """A launch to put before a timed one: a cuBLAS fp16 GEMM (4096 x 4096 x 64), as a decode step's
    projections run before its MoE (bench --after gemm, order's after_gemm)."""
    import torch

    ga = torch.randn((4096, 4096), device=dev, dtype=torch.float16)
    gb = torch.randn((4096, 64), device=dev, dtype=torch.float16)
    return lambda: torch.matmul(ga, gb)


def cold_timers(flush, spin_cycles=int(30e6)):
    """(series, alternate) timing helpers shared by bench, sweep and ablate: CUDA events with the
    host queue filled behind a spin; cold = `flush` (256 MiB) written before every launch."""
    import torch

    def series(n, fn, pre=None, cold=False):
        ss = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ee = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        torch.cuda.synchronize()
        torch.cuda._sleep(spin_cycles)
        for i in range(n):
            if pre is not None:
                pre()
            if cold:
                flush.fill_(i)
            ss[i].record(); fn(); ee[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e_) * 1e3 for s, e_ in zip(ss, ee)]

    def alternate(fns, reps, n, cold, pre=None):
        """Interleave the contenders in rounds so drift hits them alike; medians per contender."""
        acc = {k: [] for k in fns}
        for _ in range(reps):
            for k, fn in fns.items():
                acc[k] += series(n, fn, pre.get(k) if pre else None, cold)
        return {k: float(statistics.median(v)) for k, v in acc.items()}, {
            k: (float(sorted(v)[len(v) // 10]), float(sorted(v)[(9 * len(v)) // 10])) for k, v in acc.items()}

    return series, alternate


def cmd_bench(args):
    from dsv4serve.lna2.policy import variant_for

    import torch

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    props = torch.cuda.get_device_properties(dev)
    inc_name = args.incumbent
    ext = None
    if inc_name != "none":
        t0 = time.time()
        ext, pkgdir = load_exl3_ext()
        log(f"exllamav3 ext ({inc_name}) from {pkgdir} in {time.time() - t0:.1f} s")
    lna = lna2_mod()
    if hasattr(lna, "lna2_set_tuning"):
        lna.lna2_set_tuning(0, 11, 1)  # v2 defaults: CTAs as fit, 11/8 gate/up items per CTA, paired down
    gen = torch.Generator(device=dev)
    # read bandwidth, measured in this process: torch.sum over ~4 GiB viewed as fp32
    big = torch.empty(2**31 - 2**20, dtype=torch.half, device=dev).normal_()
    bw = {}
    for name, view in (("sum_fp16", big), ("sum_fp32view", big.view(torch.float32))):
        for _ in range(3):
            torch.sum(view)
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); torch.sum(view); b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e-3)
        bw[name] = big.numel() * 2 / statistics.median(ts) / 1e9
    del big, view
    torch.cuda.empty_cache()
    bw_use = max(bw.values())
    log(f"read bandwidth {bw} -> floor uses {bw_use:.0f} GB/s")
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=dev)
    series, alternate = cold_timers(flush)
    # --after gemm: every cold launch follows a cuBLAS GEMM (then the flush), as a decode step's MoE
    # follows its projections; the default series repeats one kernel, whose code and launch state
    # then stay warm across the flush (session 28's `order`: 7-10 us for the v2 family, at most 2.2 for v46)
    after = gemm_before(dev) if args.after == "gemm" else None

    variants = [int(v) for v in args.variants.split(",")]
    result = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
              "incumbent": inc_name, "read_bw_gbs": bw_use, "read_bw_detail": bw, "lna2_build": lna.lna2_build_id(),
              "variants": variants, "rows": [], "method": {
                  "cold": "median over 3 alternating rounds x 10 launches, 256 MiB written before each launch" +
                          (", each launch after a 4096x4096x64 fp16 GEMM (before the write)" if after else ""),
                  "warm": "median over 3 alternating rounds x 16 launches, same routing",
                  "whole_op": "lna2: id/weight dtype conversion + launch; 1.4.5: zero + argsort + scatter_add + "
                              "launch; 1.6.5: coop (no prep) or fused prep + launch + gather; GPU time only"}}
    shapes = args.shapes.split(",")
    ks = [int(k) for k in args.ks.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    for shape in shapes:
        I = SHAPES[shape]
        for K in ks:
            W = make_weights(I, K, dev, gen)
            L = Lna2Layer(W, K, "mcg", I, dev)
            inc = None
            if inc_name == "145":
                inc = Inc145(ext, W, K, I, dev)
            elif inc_name == "165":
                inc = Inc165(ext, W, K, I, dev)
            bytes_per_expert = 3 * (H * I * K // 8) + 3 * (2 * H + 2 * I)
            dense = None
            for m in ms:
                row = {"shape": shape, "I": I, "K": K, "m": m, "codebook": "mcg"}
                try:
                    x, sel, rw = make_routing(m, K, I, dev, gen)
                    U = int(torch.unique(sel).numel())
                    row["U"] = U
                    row["floor_us"] = U * bytes_per_expert / (bw_use * 1e9) * 1e6
                    ids32 = sel.to(torch.int32).contiguous()
                    w32 = rw.float().contiguous()
                    out_l = torch.empty((m, H), dtype=torch.float32, device=dev)
                    fns, pre = {}, {}
                    for v in [v for v in variants if serves(v, H, I, K)]:
                        fns[f"lna2_v{v}"] = (lambda v=v: L.run(x, ids32, w32, out_l, v))
                    # the policy's variant, with the conversions this routing's int64 ids / fp16 weights need
                    pol = variant_for(m, I, K)
                    whole = {"lna2": lambda: L.run(x, sel.to(torch.int32), rw.float(), out_l, pol)}
                    out_i = torch.zeros((m, H), dtype=torch.float32, device=dev)
                    if inc_name == "145":
                        st = inc.prep(sel, rw)
                        fns["inc"] = lambda: inc.launch(x, out_i, st)
                        pre["inc"] = out_i.zero_
                        whole["inc"] = lambda: (out_i.zero_(), inc.launch(x, out_i, inc.prep(sel, rw)))
                        row["inc_path"] = "exl3_moe (1.4.5, R=2048, num_active=-1)"
                    elif inc_name == "165":
                        if m <= Inc165.MAX_BSZN:
                            fns["inc"] = lambda: inc.coop(x, sel, rw)
                            whole["inc"] = fns["inc"]
                            row["inc_path"] = "exl3_moe_coop (1.6.5)"
                            inc_out = lambda: inc.cb["out"][:m]  # noqa: E731
                        else:
                            st = inc.fused_prep(sel, rw)
                            fns["inc"] = lambda: inc.fused(x, out_i, st)
                            pre["inc"] = out_i.zero_
                            whole["inc"] = lambda: (out_i.zero_(), inc.fused(x, out_i, inc.fused_prep(sel, rw)))
                            row["inc_path"] = "exl3_moe + exl3_moe_gather (1.6.5 fused tier)"
                            inc_out = lambda: out_i  # noqa: E731
                    # correctness of every contender against the fp64 reference
                    if dense is None:
                        dense = DenseCache(as_layer(W, K, "mcg", I))
                    ref = dense.moe(x, sel, rw.float())
                    for k_, fn in fns.items():
                        if pre.get(k_):
                            pre[k_]()
                        fn()
                        torch.cuda.synchronize()
                        got = out_l if k_.startswith("lna2") else (out_i if inc_name == "145" else inc_out())
                        row[f"{k_}_rel_err"] = tensor_rel(got, ref)
                    if m == 1:  # launch + route plan + zero output + retire: nothing routed anywhere
                        ids_none = torch.full_like(ids32, -1)
                        for v in [v for v in variants if serves(v, H, I, K) and v not in ABLATION_VARIANTS]:
                            fns[f"empty_v{v}"] = (lambda v=v: L.run(x, ids_none, w32, out_l, v))
                        # the floor of any launch measured this way: one 4-byte add, same cold flush
                        tiny = torch.zeros(1, device=dev)
                        fns["empty_noop"] = lambda t=tiny: t.add_(1.0)
                    pre_cold = pre
                    if after is not None:
                        pre_cold = {k_: (lambda p=pre.get(k_): (p() if p else None, after())) for k_ in fns}
                    cold, cold_p = alternate(fns, 3, 10, True, pre_cold)
                    warm, _ = alternate(fns, 3, 16, False, pre)
                    wop, _ = alternate(whole, 3, 10, True)
                    for k_ in fns:
                        row[f"{k_}_cold_us"] = cold[k_]
                        row[f"{k_}_cold_p10_p90"] = cold_p[k_]
                        row[f"{k_}_warm_us"] = warm[k_]
                    for k_ in whole:
                        row[f"{k_}_wholeop_cold_us"] = wop[k_]
                    for k_ in [k_ for k_ in fns if k_.startswith("empty")]:
                        fns.pop(k_)
                    best = min(v for k_, v in cold.items() if k_.startswith("lna2"))
                    row["lna2_us"] = best
                    row["lna2_best_variant"] = min((v, k_) for k_, v in cold.items() if k_.startswith("lna2"))[1]
                    if "inc" in cold:
                        row["inc_cold_us"] = cold["inc"]
                        row["ratio"] = cold["inc"] / best
                    log(f"{shape} K{K} m={m:>2} U={U:>3} floor {row['floor_us']:6.2f} | " +
                        " ".join(f"{k_} {v:7.1f}" for k_, v in cold.items()) +
                        (f" | x{row.get('ratio', float('nan')):.2f}" if "ratio" in row else "") +
                        " | err " + " ".join(f"{k_}={row[k_ + '_rel_err']:.1e}" for k_ in fns))
                except Exception:
                    traceback.print_exc()
                    row["error"] = traceback.format_exc()[-2000:]
                    torch.cuda.synchronize()
                result["rows"].append(row)
                dump(f"bench_{inc_name}.json", result)
            del L, inc, W, dense
            torch.cuda.empty_cache()
    dump(f"bench_{inc_name}.json", result)


def mcg_cases(grid, dev, gen, K=2):
    """The MCG cases (K2 unless asked) of sweep, ablate, trace and profile: per (shape, row counts) in
    `grid` one random layer (the bench's weights and seeds order), then per row count its routing
    with the kernel's int32 ids / fp32 weights and an fp32 output; a shape's layer is freed after its
    rows."""
    import torch

    for shape, ms in grid:
        I = SHAPES[shape]
        W = make_weights(I, K, dev, gen)
        L = Lna2Layer(W, K, "mcg", I, dev)
        for m in ms:
            x, sel, rw = make_routing(m, K, I, dev, gen)
            yield types.SimpleNamespace(shape=shape, I=I, m=m, W=W, L=L, x=x, sel=sel, rw=rw,
                                        ids32=sel.to(torch.int32).contiguous(), w32=rw.float().contiguous(),
                                        out=torch.empty((m, H), dtype=torch.float32, device=dev))
        del L, W
        torch.cuda.empty_cache()


def cmd_order(args):
    """Does a build's cold time depend on what ran before it? The bench times ten launches of one
    build in a row (each after the L2 flush); `dsv4serve kernel check --bench` alternates the builds
    launch by launch, and in session 28 it put the v2 family 8-16 us above the bench at every TP8
    point while the cluster builds moved at most 2.5 us. Per case, cold medians (us) of each variant:
      series       the bench's method (ten in a row, rounds alternated);
      interleaved  the kernel check's (one launch each, in turn, 30 rounds);
      after_other  each timed launch preceded by one untimed launch of the next variant, then the flush;
      after_gemm   preceded by an fp16 GEMM (cuBLAS: large shared memory, as a decode step's
                   projections are), then the flush;
      series_half  the bench's method with an fp16 output (the dispatch's out = empty_like(x));
      after_other_empty / after_other_sep / after_self_sep  preceded by the other build with nothing
                   routed, by the other build on a second layer object (own scratch and pointer
                   tables), by the same build on that second object;
      after_self_otherw  preceded by the same build on other weights (and its own scratch);
      after_v<P>_empty  preceded by build P (--before) with nothing routed.
    Each variant's output is checked against the fp64 reference once."""
    import torch

    dev = torch.device("cuda:0")
    gen = torch.Generator(device=dev)
    lna = lna2_mod()
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=dev)
    _, alternate = cold_timers(flush)
    variants = [int(v) for v in args.variants.split(",")]
    if len(variants) < 2 or len(set(variants)) != len(variants):
        raise SystemExit(f"order: --variants needs two or more different builds, got {args.variants}")
    befores = [int(v) for v in args.before.split(",")] if args.before else []
    gemm = gemm_before(dev)
    res = {"variants": variants, "before": befores, "rows": []}

    def per_launch(fns, pre, rounds=30):
        ev = {k: [] for k in fns}
        keys = list(fns)
        for k, fn in fns.items():  # first-launch setup off the clock
            fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(60e6))
        for _ in range(rounds):
            for i, k in enumerate(keys):
                if pre is not None:
                    pre(keys[(i + 1) % len(keys)])
                flush.fill_(1)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fns[k]()
                e1.record()
                ev[k].append((e0, e1))
        torch.cuda.synchronize()
        return {k: round(statistics.median(a.elapsed_time(b) * 1e3 for a, b in v), 2) for k, v in ev.items()}

    for K in [int(k) for k in args.ks.split(",")]:
        grid = [("tp8", tuple(int(m) for m in args.ms.split(",")))]
        dense = None
        for c in mcg_cases(grid, dev, gen, K):
            if not all(serves(v, H, c.I, K) for v in variants):
                continue
            half = torch.empty((c.m, H), dtype=torch.float16, device=dev)

            def fn(v, out=None, c=c):
                return lambda: c.L.run(c.x, c.ids32, c.w32, c.out if out is None else out, v)

            if dense is None or dense[0] is not c.W:
                dense = (c.W, DenseCache(as_layer(c.W, K, "mcg", c.I)))
            ref = dense[1].moe(c.x, c.sel, c.rw.float())
            row = {"K": K, "m": c.m, "U": int(torch.unique(c.sel).numel())}
            for v in variants:
                fn(v)()
                torch.cuda.synchronize()
                row[f"v{v}_rel_err"] = tensor_rel(c.out, ref)
            fns = {v: fn(v) for v in variants}
            row["series"] = alternate(fns, 3, 10, True)[0]
            row["interleaved"] = per_launch(fns, None)
            row["after_other"] = per_launch(fns, lambda nxt: fns[nxt]())
            row["after_gemm"] = per_launch(fns, lambda nxt: gemm())
            row["series_half"] = alternate({v: fn(v, half) for v in variants}, 3, 10, True)[0]
            # which state the preceding launch takes away: the other build with nothing routed (its
            # plan and exit only: little of its code runs), the other build on a layer of its own
            # (its own scratch and pointer tables), the same build on that other layer
            ids_none = torch.full_like(c.ids32, -1)
            other = Lna2Layer(c.W, K, "mcg", c.I, dev)
            out2 = torch.empty_like(c.out)
            row["after_other_empty"] = per_launch(fns, lambda nxt: c.L.run(c.x, ids_none, c.w32, out2, nxt))
            row["after_other_sep"] = per_launch(fns, lambda nxt: other.run(c.x, c.ids32, c.w32, out2, nxt))

            def prev(nxt):  # the build timed right after this pre-launch: per_launch hands over the next one
                return variants[(variants.index(nxt) - 1) % len(variants)]

            row["after_self_sep"] = per_launch(fns, lambda nxt: other.run(c.x, c.ids32, c.w32, out2, prev(nxt)))
            # --before: each build named there, with nothing routed, before every launch (session 29:
            # whatever the build, cluster or not, v55 itself included, an empty launch restores nothing)
            for p in befores:
                row[f"after_v{p}_empty"] = per_launch(fns, lambda nxt, p=p: c.L.run(c.x, ids_none, c.w32, out2, p))
            # the same build, fully routed, on other weights (other pages, same code): fast like the
            # series if what a full launch leaves behind is its code on the SMs, slow if it is the
            # data's address translations
            other_w = Lna2Layer(make_weights(c.I, K, dev, gen, seed=4321), K, "mcg", c.I, dev)
            row["after_self_otherw"] = per_launch(fns, lambda nxt: other_w.run(c.x, c.ids32, c.w32, out2, prev(nxt)))
            del other, other_w
            res["rows"].append(row)
            log(f"K{K} m={c.m:2d} U={row['U']:3d} " + " | ".join(
                f"{how} " + " ".join(f"v{v} {row[how][v]:6.1f}" for v in variants)
                for how in ("series", "interleaved", "after_other", "after_gemm", "series_half", "after_other_empty",
                            "after_other_sep", "after_self_sep", "after_self_otherw", *(f"after_v{p}_empty" for p in befores))))
            dump("order.json", res)
    dump("order.json", res)


def cmd_sweep(args):
    """v2-family tuning grid (CTAs per SM, gate/up item target) at the bench's shapes, MCG (K2 unless
    --bits 3), cold medians alternated in one process; the defaults in lna2_v2.cu are read off this
    table (kernels/lna2/NOTES.md)."""
    import torch

    dev = torch.device("cuda:0")
    gen = torch.Generator(device=dev)
    lna = lna2_mod()
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=dev)
    _, alternate = cold_timers(flush)
    configs = [(int(c_), int(i), int(p)) for c_ in args.ctas.split(",") for i in args.items.split(",")
               for p in args.pair.split(",")]  # (CTAs/SM, items_x8, pair)
    res = {"variant": args.variant, "bits": args.bits, "lna2_build": lna.lna2_build_id(), "configs": configs,
           "config_key": "c<CTAs per SM, 0 = as fit (v7: 0 auto, 1 one per SM, 2 as fit)>_i<items_x8: gate/up item "
                         "target = grid * i / 8>_p<paired down items>",
           "rows": []}
    default_ms = {"tp8": (1, 2, 4, 8, 16, 24), "tp1": (1, 2, 4, 8, 16)}
    want_ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else None
    grid = [(sh, want_ms or default_ms[sh]) for sh in args.shapes.split(",")
            if serves(args.variant, H, SHAPES[sh], args.bits)]
    dense = None
    for c in mcg_cases(grid, dev, gen, args.bits):

        def run_with(cfg, c=c):
            def fn():
                lna.lna2_set_tuning(*cfg)  # host-side only: the next launch reads it
                c.L.run(c.x, c.ids32, c.w32, c.out, args.variant)
            return fn

        cold, _ = alternate({"c%d_i%d_p%d" % cfg: run_with(cfg) for cfg in configs}, 3, 10, True)
        row = {"shape": c.shape, "m": c.m, "U": int(torch.unique(c.sel).numel()), **cold}
        # a tuning changes which items exist (paired down items sum a block over 4 warps, not 8), so
        # each config's output is checked against the fp64 reference, as the parity run would
        if dense is None or dense[0] is not c.W:
            dense = (c.W, DenseCache(as_layer(c.W, args.bits, "mcg", c.I)))
        ref = dense[1].moe(c.x, c.sel, c.rw.float())
        for cfg in configs:
            run_with(cfg)()
            torch.cuda.synchronize()
            row["c%d_i%d_p%d_rel_err" % cfg] = tensor_rel(c.out, ref)
        res["rows"].append(row)
        worst = max(v for k, v in row.items() if k.endswith("_rel_err"))
        log(c.shape, f"K{args.bits}", "m=%2d" % c.m, " ".join(f"{k}={v:.1f}" for k, v in cold.items()), f"| worst err {worst:.1e}")
        if worst > 2e-3:  # the parity gate for fp32 output
            log("FAIL: a tuning's output is off the reference", {k: v for k, v in row.items() if k.endswith("_rel_err")})
        dump(f"sweep-k{args.bits}.json", res)
    lna.lna2_set_tuning(0, 11, 1)


ABLATIONS = {10: "no_decode", 11: "no_copy", 12: "no_down", 13: "no_decode_no_copy"}


def cmd_ablate(args):
    """Variant 4 against its timing ablations (lna2_api.h: each drops one stage; their outputs are
    not the MoE op) and an empty launch, K2 MCG, cold medians alternated in one process: what each
    stage costs on the critical path (kernels/lna2/NOTES.md, "where the time goes")."""
    import torch

    dev = torch.device("cuda:0")
    gen = torch.Generator(device=dev)
    lna = lna2_mod()
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=dev)
    _, alternate = cold_timers(flush)
    res = {"lna2_build": lna.lna2_build_id(), "ablations": ABLATIONS, "rows": []}
    for c in mcg_cases((("tp8", (1, 2, 4, 8, 16, 24)), ("tp1", (1, 8, 16))), dev, gen):
        L, x, ids32, w32, out = c.L, c.x, c.ids32, c.w32, c.out
        none = torch.full_like(ids32, -1)
        fns = {"v4": lambda: L.run(x, ids32, w32, out, 4)}
        for v, name in ABLATIONS.items():
            fns[name] = (lambda v=v: L.run(x, ids32, w32, out, v))
        fns["empty"] = lambda: L.run(x, none, w32, out, 4)
        cold, p = alternate(fns, 3, 10, True)
        # the real variant still computes the op after the ablations shared its scratch
        L.run(x, ids32, w32, out, 4)
        row = {"shape": c.shape, "m": c.m, "U": int(torch.unique(c.sel).numel()), "cold_us": cold, "p10_p90": p}
        if c.m == 1:
            ref = DenseCache(as_layer(c.W, 2, "mcg", c.I)).moe(x, c.sel, c.rw.float())
            row["v4_rel_err_after"] = tensor_rel(out, ref)
        res["rows"].append(row)
        log(c.shape, "m=%2d" % c.m, " ".join(f"{k}={v:.1f}" for k, v in cold.items()))
        dump("ablate.json", res)


EVENTS = ["start", "plan", "item", "stage0", "mma", "arrived", "finished", "ready", "gathered", "exit", "next"]


def cmd_trace(args):
    """Per-CTA event timelines of v2 and the cluster kernel (globaltimer ns) at a few shapes, for
    NOTES.md's breakdown, each beside the launch's time by CUDA events (with --empty, also each
    shape with nothing routed)."""
    import torch

    dev = torch.device("cuda:0")
    gen = torch.Generator(device=dev)
    lna = lna2_mod()
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=dev)
    res = []
    grid = int(lna.lna2_moe_prepare(2, 1, args.variant)[2]) * 2
    cluster = args.variant in CLUSTER_VARIANTS
    events = EVENTS7 if cluster else EVENTS
    tp8_ms = tuple(int(m_) for m_ in args.ms.split(",")) if args.ms else (1, 2, 8)
    shapes = [(sh, ms) for sh, ms in (("tp8", tp8_ms), ("tp1", (1, 8))) if serves(args.variant, H, SHAPES[sh])]
    if args.stop:
        # v26's launch split: the same launches by v26's stop build, returning after its prologue (1)
        # or its route plan (2), or not (3, the control); only their times are kept
        if args.variant != 26 or args.bits != 2 or not hasattr(lna, "lna2_set_stop"):
            raise SystemExit("trace --stop needs --variant 26 --bits 2 and a build with lna2_set_stop")
        lna.lna2_set_stop(args.stop)
    tag = f"v{args.variant}" + (f"-k{args.bits}" if args.bits != 2 else "") + (f"-stop{args.stop}" if args.stop else "")

    def save():  # after every case: a deadline that stops the call keeps what was traced
        dump(f"trace-{tag}.json", {"events": events, "variant": args.variant, "bits": args.bits, "stop": args.stop,
                                   "runs": res})

    try:
        _trace_cases(args, lna, shapes, dev, gen, flush, grid, res, save)
    finally:
        if args.stop:
            lna.lna2_set_stop(0)
    if cluster and args.stop in (0, 3, 4):  # a launch stopped early has no phases to summarize
        summary = summarize_trace_v7({"runs": [r for r in res if not r.get("empty")]})
        for row in summary:
            log(row["shape"], "m=%d" % row["m"], "rep", row["rep"], " ".join(
                f"{k}={v['median_us']}/{v['max_us']}" for k, v in row["phases"].items() if v))
            log("   arrivals by pass (CTAs, median/max us):", " ".join(
                f"{p['ctas']}:{p['median_us']}/{p['max_us']}" for p in row["arrivals_by_pass"]))
        dump(f"trace-summary-{tag}.json", summary)


def _trace_cases(args, lna, shapes, dev, gen, flush, grid, res, save):
    import torch

    for case in mcg_cases(shapes, dev, gen, args.bits):
        shape, m, L, x, ids32, w32, out = case.shape, case.m, case.L, case.x, case.ids32, case.w32, case.out
        # --empty: the same launch with nothing routed (its plan, the zero output and the exit only)
        runs = [(False, ids32)] + ([(True, torch.full_like(ids32, -1))] if args.empty else [])
        for empty, ids in runs:
            for _ in range(3):
                L.run(x, ids, w32, out, args.variant)
            # and once traced, untimed: the traced build is its own kernel, and its first launch pays
            # the lazy module load (33-37 us on the first rep of every H100 run of session 31)
            L.run(x, ids, w32, out, args.variant, torch.zeros(grid * 64 * 2, dtype=torch.int64, device=dev))
            torch.cuda.synchronize()
            for rep in range(3):
                tr = torch.zeros(grid * 64 * 2, dtype=torch.int64, device=dev)
                flush.fill_(rep)
                # the launch's event time beside its traced span (first CTA's first event to the last
                # event): the difference is what happens outside the kernel's instructions
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                L.run(x, ids, w32, out, args.variant, tr)
                e1.record()
                torch.cuda.synchronize()
                t = tr.view(-1, 64, 2).cpu()
                ctas = []
                t0 = min(int(v) for v in t[:, 0, 0].tolist() if v > 0)
                for cta in range(t.shape[0]):
                    evs = [(int(ns) - t0, int(code) & 255, (int(code) >> 8) - 1) for ns, code in t[cta].tolist() if ns > 0]
                    if evs:
                        ctas.append(evs)
                end = max(e[0] for c in ctas for e in c)
                ev_us = e0.elapsed_time(e1) * 1e3
                res.append({"shape": shape, "m": m, "rep": rep, "empty": empty, "event_us": round(ev_us, 2),
                            "span_us": round(end / 1e3, 2), "ctas": ctas})
                log(f"{shape} K{args.bits} m={m}{' empty' if empty else ''}{f' stop{args.stop}' if args.stop else ''} "
                    f"rep={rep}: {len(ctas)} CTAs traced, last event at {end / 1e3:.1f} us, launch {ev_us:.1f} us by events")
        save()


EVENTS7 = ["start", "plan", "rotated", "gu_mma", "partial", "sync1", "act", "dn_mma", "y", "arrived", "gathered",
           "exit"]


def summarize_trace_v7(doc):
    """The cluster kernel's phases per CTA and unit (lna2_v7.cu Event7): median / max over all
    (CTA, unit) pairs in us, plus when the plan was done, the last gather ended and the last CTA
    left, from the first CTA's start."""
    out = []
    for run in doc["runs"]:
        spans = {}
        plan, gathered, exits = [], [], []
        by_pass = []  # arrival times of each CTA's first, second, ... unit: the passes of the clusters
        for evs in run["ctas"]:
            last = None
            k = 0
            for t, ev, unit in evs:
                name = EVENTS7[ev]
                if name == "arrived":
                    by_pass += [[] for _ in range(k + 1 - len(by_pass))]
                    by_pass[k].append(t)
                    k += 1
                if name == "plan":
                    plan.append(t)
                elif name == "gathered":
                    gathered.append(t)
                elif name == "exit":
                    exits.append(t)
                if last is not None and name not in ("gathered", "exit"):
                    spans.setdefault(f"{last[1]}->{name}", []).append(t - last[0])
                if name not in ("gathered", "exit"):
                    last = (t, name)

        out.append({"shape": run["shape"], "m": run["m"], "rep": run["rep"], "ctas": len(run["ctas"]),
                    "plan_done": ns_stats(plan), "last_gather_done": ns_stats(gathered), "exit": ns_stats(exits),
                    "phases": {k: ns_stats(v) for k, v in spans.items()},
                    "arrivals_by_pass": [dict(ns_stats(p), ctas=len(p)) for p in by_pass]})
    return out


def summarize_trace(doc):
    """Phase durations of v2 items from a trace (cmd_trace's JSON): medians and maxima in us (runs
    with nothing routed have no items and are left out)."""
    out = []
    for run in (r for r in doc["runs"] if not r.get("empty")):
        items = {"gu": [], "dn": []}
        plans, exits, gathers = [], [], []
        for evs in run["ctas"]:
            cur = None
            for t, ev, _tk in evs:
                name = EVENTS[ev]
                if name == "plan":
                    plans.append(t)
                elif name == "exit":
                    exits.append(t)
                elif name == "gathered":
                    gathers.append(t)
                elif name == "item":
                    cur = {"start": t}
                elif name == "finished" and cur is None and items["gu"]:
                    items["gu"][-1]["finished"] = t  # the finisher runs after its item arrived
                elif cur is not None and name in ("stage0", "ready", "mma") and name not in cur:
                    cur[name] = t
                elif cur is not None and name == "arrived":
                    cur["arrived"] = t
                    items["dn" if "ready" in cur else "gu"].append(cur)
                    cur = None

        def span(lst, a, b):
            return ns_stats(x[b] - x[a] for x in lst if a in x and b in x)

        def at(v):
            return ns_stats(v, with_min=True)

        gu, dn = items["gu"], items["dn"]
        out.append({"shape": run["shape"], "m": run["m"], "rep": run["rep"], "ctas": len(run["ctas"]),
                    "plan_done": at(plans), "exit": at(exits), "gathers_done": at(gathers),
                    "gu_items": len(gu), "gu_start_to_first_stage": span(gu, "start", "stage0"),
                    "gu_first_stage_to_mma_done": span(gu, "stage0", "mma"),
                    "gu_mma_done_to_arrived": span(gu, "mma", "arrived"),
                    "gu_finisher": span([x for x in gu if "finished" in x], "arrived", "finished"),
                    "dn_items": len(dn), "dn_start_to_ready": span(dn, "start", "ready"),
                    "dn_ready_at": at([x["ready"] for x in dn if "ready" in x]),
                    "dn_ready_to_mma_done": span(dn, "ready", "mma"),
                    "dn_mma_done_to_arrived": span(dn, "mma", "arrived")})
    return out


def cmd_trace_summary(args):
    doc = json.loads(Path(args.trace).read_text())
    summary = summarize_trace(doc)
    Path(args.out).write_text(json.dumps({"source": Path(args.trace).name, "runs": summary}, indent=1))
    for r in summary:
        if r["rep"] == 1:
            log(r["shape"], r["m"], json.dumps({k: v for k, v in r.items() if k not in ("shape", "m", "rep")}))


def cmd_profile(args):
    """A few launches for ncu: tp8 K2 m=1 and m=16, tp1 K2 m=8, three of each (lna2_device.sh's ncu
    step profiles all of them).
    LNA2_PROFILE_SHAPES picks others ("tp8:4+8,tp1:8"), LNA2_PROFILE_BITS the K of all of them."""
    import torch

    dev = torch.device("cuda:0")
    gen = torch.Generator(device=dev)
    variant = int(os.environ.get("LNA2_PROFILE_VARIANT", "4"))
    bits = int(os.environ.get("LNA2_PROFILE_BITS", "2"))
    shapes = [(s_, tuple(int(m_) for m_ in ms_.split("+"))) for s_, ms_ in
              (p_.split(":") for p_ in os.environ.get("LNA2_PROFILE_SHAPES", "tp8:1+16,tp1:8").split(","))]
    for c in mcg_cases(shapes, dev, gen, bits):
        for _ in range(3):
            c.L.run(c.x, c.ids32, c.w32, c.out, variant)
        torch.cuda.synchronize()
        log(f"profiled {c.shape} K{bits} m={c.m}")


def cmd_reconstruct(args):
    """The reference's W_rot against exllamav3's own ext.reconstruct, bit for bit."""
    import torch

    from dsv4serve.lna2.reference import reconstruct_rot

    ext, _ = load_exl3_ext()
    dev = torch.device("cuda:0")
    gen = torch.Generator(device="cpu").manual_seed(5)
    res = []
    for K in range(1, 9):
        for cb, flags in (("mcg", (True, False)), ("mul1", (False, True)), ("3inst", (False, False))):
            tr = torch.randint(-32768, 32768, (256 // 16, 512 // 16, 16 * K), dtype=torch.int16, generator=gen).to(dev)
            w = torch.empty((256, 512), dtype=torch.half, device=dev)
            try:
                ext.reconstruct(w, tr, K, *flags)
                ref = reconstruct_rot(tr, K, cb)
                eq = bool(torch.equal(w.view(torch.int16), ref.to(dev).view(torch.int16)))
                res.append({"K": K, "codebook": cb, "bit_exact": eq,
                            "mismatches": int((w.view(torch.int16) != ref.to(dev).view(torch.int16)).sum())})
            except Exception as e:  # noqa: BLE001 - 3INST or a K the build lacks
                res.append({"K": K, "codebook": cb, "error": repr(e)[-300:]})
    log("reconstruct vs reference:", [(r["K"], r["codebook"], r.get("bit_exact", r.get("error"))) for r in res])
    dump(f"reconstruct_{args.tag}.json", res)


def cmd_merge(args):
    """Bench JSONs -> the results file NOTES.md and a checker read. Runs anywhere (no GPU).

    Each incumbent ran in its own process (1.4.5 and 1.6.5 both name their extension
    exllamav3_ext), with lna2 alternated against it in that same process. exl3_moe_us is 1.4.5's
    exl3_moe as vllm-exl3 calls it; exl3_moe_165_us is 1.6.5's own path at that row count (coop up to
    8 rows, exl3_moe + gather above). lna2_us is the variant dsv4serve.lna2.policy picks for the row
    count, and of its two same-process medians the slower one; ratio = min(incumbents) / lna2_us.
    """
    from dsv4serve.lna2.policy import variant_for

    runs = {"145": json.loads(Path(args.bench145).read_text())}
    if args.bench165:
        runs["165"] = json.loads(Path(args.bench165).read_text())
    by = {tag: {(r["shape"], r["K"], r["m"]): r for r in run["rows"] if "error" not in r} for tag, run in runs.items()}
    rows = []
    for key, r145 in by["145"].items():
        r165 = by.get("165", {}).get(key)
        pick = variant_for(r145["m"], r145["I"], r145["K"])
        col = f"lna2_v{pick}_cold_us"
        mine = [r[col] for r in (r145, r165) if r is not None and col in r]
        if not mine:
            continue
        lna2_us = max(mine)
        v165 = r165.get("inc_cold_us") if r165 else None
        best_inc = min(v for v in (r145.get("inc_cold_us"), v165) if v is not None)
        variants = {k[len("lna2_"):-len("_cold_us")]: round(v, 2) for k, v in r145.items()
                    if k.startswith("lna2_v") and k.endswith("_cold_us")}
        rows.append({"shape": key[0], "K": key[1], "m": key[2], "codebook": r145["codebook"], "U": r145["U"],
                     "lna2_us": round(lna2_us, 2), "lna2_variant": f"v{pick}", "lna2_variants_145run": variants,
                     "exl3_moe_us": round(r145["inc_cold_us"], 2),
                     "exl3_moe_165_us": None if v165 is None else round(v165, 2),
                     "exl3_moe_165_path": r165.get("inc_path") if r165 else None,
                     "floor_us": round(r145["floor_us"], 3),
                     # from the stored (rounded) figures, so that the file recomputes on its own
                     "ratio": round(round(best_inc, 2) / round(lna2_us, 2), 3),
                     "ratio_vs_145": round(r145["inc_cold_us"] / r145[col], 3),
                     "ratio_vs_165": None if v165 is None else round(v165 / r165[col], 3),
                     "lna2_rel_err": r145.get(f"lna2_v{pick}_rel_err"),
                     "exl3_moe_rel_err": r145.get("inc_rel_err"),
                     "exl3_moe_165_rel_err": r165.get("inc_rel_err") if r165 else None,
                     "lna2_warm_us": round(r145.get(f"lna2_v{pick}_warm_us", float("nan")), 2),
                     "lna2_wholeop_us": round(r145.get("lna2_wholeop_cold_us", float("nan")), 2),
                     "exl3_moe_wholeop_us": round(r145.get("inc_wholeop_cold_us", float("nan")), 2),
                     "exl3_moe_165_wholeop_us": round(r165["inc_wholeop_cold_us"], 2) if r165 else None})
    filled = []
    if args.fill_from:
        # Only a point whose policy variant this run did not time, and only if the earlier run timed
        # that same variant there: the row keeps its own run's incumbents, so its ratio is one
        # process's comparison, and it says where it comes from.
        old = json.loads(Path(args.fill_from).read_text())
        have = {(r["shape"], r["K"], r["m"]) for r in rows}
        for r in old["rows"]:
            key = (r["shape"], r["K"], r["m"])
            if key in have or key not in by["145"]:
                continue
            if r["lna2_variant"] != f"v{variant_for(r['m'], by['145'][key]['I'], r['K'])}":
                continue
            rows.append({**r, "source": f"{Path(args.fill_from).name} (commit {old['commit']}): "
                                        f"{r['lna2_variant']} was not timed in this run"})
            filled.append(key)
        order = {k: i for i, k in enumerate(by["145"])}
        rows.sort(key=lambda r: order[(r["shape"], r["K"], r["m"])])
    commit = args.commit or subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True).stdout.strip()
    b145 = runs["145"]
    doc = {"device": b145["device"], "commit": commit, "date": args.date or _dt.date.today().isoformat(),
           "read_bw_gbs": round(b145["read_bw_gbs"], 1), "lna2_build": b145.get("lna2_build"),
           "exl3_moe_165_source": "same-process bench (lna2_device.py bench --incumbent 165)" if "165" in runs
           else None, "method": b145.get("method"),
           "filled_from": {"file": Path(args.fill_from).name, "points": [list(k) for k in filled]} if filled else None,
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    log(f"wrote {args.out}: {len(rows)} rows")


# Each refusal: (name, what to break, a phrase the binding's one-line error must contain).
REFUSALS = [
    ("cluster-hidden", "variant 26 on a 1536-wide layer", "1024, 2048, 4096 or 8192"),
    ("unknown-variant", "variant 5", "variant must be"),
    ("bits", "bits 4", "bits must be 2 or 3"),
    ("flat-ids", "expert_ids flattened to [m*top_k]", "expert_ids must be"),
    ("small-scratch", "scratch one byte short", "scratch must be"),
    ("offset-x", "x as a 2-byte offset view", "16-byte aligned"),
    ("in-place", "out is x", "does not run in place"),
]


def cmd_refusal_case(args):
    """One bad call to the binding (run in its own process by `refusals`, so a crash is a result)."""
    import torch

    from dsv4serve.lna2.reference import random_expert_layer

    dev = torch.device("cuda:0")
    hidden = 1536 if args.case == "cluster-hidden" else 1024
    layer = random_expert_layer(8, hidden, 256, 2, "mcg", seed=5, device=dev)
    P = pointer_tables(expert_tensors(layer), dev)
    ext = lna2_mod()
    m = 2
    # a good call's arguments, then the one this case breaks
    good = {"x": torch.randn((m, hidden), device=dev).half(),
            "ids": torch.tensor([[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7]], dtype=torch.int32, device=dev),
            "scratch": torch.zeros(ext.lna2_moe_scratch_bytes(hidden, 256), dtype=torch.uint8, device=dev),
            "bits": 2, "variant": 4}
    bad = dict(good)
    if args.case == "offset-x":
        bad["x"] = torch.randn((m * hidden + 1,), device=dev).half()[1:].view(m, hidden)
    if args.case == "flat-ids":
        bad["ids"] = good["ids"].reshape(-1)
    if args.case == "small-scratch":
        bad["scratch"] = good["scratch"][:-1]
    if args.case == "bits":
        bad["bits"] = 4
    bad["variant"] = {"cluster-hidden": 26, "unknown-variant": 5}.get(args.case, 4)
    w = torch.rand((m, TOPK), device=dev)
    out = torch.empty((m, hidden), dtype=torch.float32, device=dev)
    good["out"] = out
    bad["out"] = bad["x"] if args.case == "in-place" else out

    def call(a):
        ext.lna2_moe_decode(a["x"], a["out"], *P, a["ids"], w, a["bits"], L_SWIGLU, a["scratch"], 256, 1, a["variant"])
        torch.cuda.synchronize()

    try:
        call(bad)
    except Exception as e:  # noqa: BLE001 - the type is part of the result
        raised = {"type": type(e).__name__, "message": str(e).splitlines()[0][:400]}
    else:
        raised = {"type": None, "message": "accepted"}
    # then the good call in the same process: the refusal left nothing behind
    call(good)
    raised["good_call_after"] = bool(torch.isfinite(out).all().item())
    print(json.dumps(raised))


def cmd_refusals(args):
    """The binding's argument checks on a GPU: each bad call must raise ValueError naming the problem,
    and must not crash the process or poison the context (a good call follows in the same process)."""
    results, fail = [], 0
    for name, what, phrase in REFUSALS:
        r = subprocess.run([sys.executable, __file__, "refusal-case", name], capture_output=True, text=True, timeout=120)
        got = {}
        try:
            got = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            pass
        ok = (r.returncode == 0 and got.get("type") == "ValueError" and phrase in got.get("message", "")
              and got.get("good_call_after") is True)
        fail += not ok
        results.append({"case": name, "bad": what, "rc": r.returncode, "raised": got.get("type"),
                        "message": got.get("message", r.stderr[-300:]), "ok": ok})
        log(("ok  " if ok else "FAIL"), name, "rc", r.returncode, got.get("type"), (got.get("message") or "")[:160])
    dump("refusals.json", {"cases": results, "fail": fail})
    log(f"refusals: {len(results)} cases, fail={fail}")
    if fail:
        sys.exit(1)


# lna2_moe_fit on an sm_120 card (99 KB = 101,376 B a block), TP8 slice, MCG: tests/test_lna2_policy.py
# holds the same table (SM120_FIT), which the policy's choices on such a card are tested against.
SM120_LIMIT = 101376
SM120_FIT = {2: {26: 24, 36: 32, 46: 32, 55: 32, 59: 32}, 3: {26: 0, 36: 1, 46: 1, 55: 32, 59: 1}}


def cmd_fit(args):
    """The binding's lna2_moe_fit for every build the policy may pick, on this card and at an sm_120
    card's 99 KB a block, at the TP8 and TP1 shapes: the rows each launch fits. The sm_120 answers
    must match SM120_FIT (the table the policy's sm_120 choices are tested against)."""
    import torch

    from dsv4serve.lna2 import policy

    ext = lna2_mod()
    props = torch.cuda.get_device_properties(0)
    res = {"device": torch.cuda.get_device_name(), "optin_bytes": getattr(props, "shared_memory_per_block_optin", None),
           "rows": [], "mismatch": []}
    for shape, inter in (("tp8", 256), ("tp1", 2048)):
        for K in (2, 3):
            for cb, code in (("mcg", 1), ("mul1", 2)):
                for limit in (0, SM120_LIMIT):
                    fit = {v: int(ext.lna2_moe_fit(v, K, code, H, inter, TOPK, E, limit))
                           for v in policy.served(inter, H)}
                    res["rows"].append({"shape": shape, "K": K, "cb": cb, "limit": limit or "device", "fit": fit})
                    log(f"{shape} K{K} {cb} limit={limit or 'device'}: " +
                        " ".join(f"v{v}={n}" for v, n in fit.items()))
                    if shape == "tp8" and cb == "mcg" and limit == SM120_LIMIT and fit != {v: SM120_FIT[K].get(v) for v in fit}:
                        res["mismatch"].append({"K": K, "got": fit, "want": SM120_FIT[K]})
    dump("fit.json", res)
    log(f"fit: {len(res['rows'])} rows, mismatches {len(res['mismatch'])}")
    if res["mismatch"]:
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build")
    p = sub.add_parser("parity")
    p.add_argument("--quick", action="store_true")
    # 384: three 128-blocks, so an unpaired down item's k-share per warp is odd (v54's half-filled row)
    p.add_argument("--inters", default="256,2048", help="intermediate sizes, comma list (multiples of 128)")
    sub.add_parser("smoke")
    sub.add_parser("refusals")
    rc = sub.add_parser("refusal-case")
    rc.add_argument("case", choices=[c[0] for c in REFUSALS])
    sub.add_parser("dispatch")
    sub.add_parser("fit")
    sub.add_parser("profile")
    b = sub.add_parser("bench")
    b.add_argument("--incumbent", choices=["145", "165", "none"], default="none")
    b.add_argument("--shapes", default="tp8,tp1")
    b.add_argument("--ks", default="2,3")
    b.add_argument("--ms", default="1,2,4,8,16,24")
    b.add_argument("--variants", default=DEFAULT_VARIANTS)
    b.add_argument("--after", choices=["none", "gemm"], default="none",
                   help="what runs before each cold launch (besides the L2 flush)")
    od = sub.add_parser("order")
    od.add_argument("--ks", default="2,3")
    od.add_argument("--ms", default="1,8,16")
    od.add_argument("--variants", default="55,46")
    od.add_argument("--before", default="",
                    help="builds to launch with nothing routed before every timed launch, one mode each")
    sw = sub.add_parser("sweep")
    sw.add_argument("--variant", type=int, default=4)
    sw.add_argument("--items", default="4,6,8,11,12,16,24", help="items_x8 values")
    sw.add_argument("--pair", default="1", help="paired down items: 0, 1 or a list")
    sw.add_argument("--ctas", default="0", help="CTAs per SM (set_tuning): 0 = as fit; for v7 0 auto, 1, 2")
    sw.add_argument("--bits", type=int, default=2, choices=(2, 3))
    sw.add_argument("--shapes", default="tp8,tp1")
    sw.add_argument("--ms", default="", help="row counts, comma list (default: 1-24 at tp8, 1-16 at tp1)")
    sub.add_parser("ablate")
    tr = sub.add_parser("trace")
    tr.add_argument("--variant", type=int, default=4)
    tr.add_argument("--bits", type=int, default=2, choices=(2, 3))
    tr.add_argument("--ms", default="", help="TP8 row counts, comma list (default 1,2,8)")
    tr.add_argument("--empty", action="store_true", help="also trace each case with nothing routed")
    tr.add_argument("--stop", type=int, default=0, choices=(0, 1, 2, 3, 4),
                    help="v26 K2 only: trace its stop build returning after its prologue (1) or route plan (2), "
                         "or run to the end (3, the control; 4: with nothing routed, zeros by an inline loop)")
    ts = sub.add_parser("trace-summary")
    ts.add_argument("--trace", required=True)
    ts.add_argument("--out", required=True)
    r = sub.add_parser("reconstruct")
    r.add_argument("--tag", default="145")
    mg = sub.add_parser("merge")
    mg.add_argument("--bench145", required=True)
    mg.add_argument("--bench165")
    mg.add_argument("--out", required=True)
    mg.add_argument("--commit")
    mg.add_argument("--date")
    mg.add_argument("--fill-from", help="an earlier results file: a grid point this run lacks (its policy variant "
                                        "was not timed) is copied from there, marked with its source")
    args = ap.parse_args()
    {"build": cmd_build, "parity": cmd_parity, "smoke": cmd_smoke, "bench": cmd_bench, "merge": cmd_merge,
     "reconstruct": cmd_reconstruct, "profile": cmd_profile, "sweep": cmd_sweep, "order": cmd_order, "ablate": cmd_ablate, "trace": cmd_trace,
     "trace-summary": cmd_trace_summary, "dispatch": cmd_dispatch, "refusals": cmd_refusals,
     "refusal-case": cmd_refusal_case, "fit": cmd_fit}[args.cmd](args)


if __name__ == "__main__":
    main()
