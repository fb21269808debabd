#!/usr/bin/env python3
"""Does an EXL3 GEMM of a never-tuned shape survive CUDA-graph capture? (exllamav3 1.4.5, device)

For each case (m, K) with k=4096, n=1024 and the MCG codebook by default:
  eager    one child process, its own empty EXLLAMAV3_TUNE_CACHE: build a random EXL3 linear
           (random int16 trellis [k/16, n/16, 16K], random-sign suh [k] and svh [n], an A_had
           buffer), run `exl3_gemm` eagerly (this tunes the shape), save the output.
  capture  a fresh child per case with a fresh empty tune cache: the same inputs (same seed),
           one m=1 call first so exllamav3's per-device context (SM count, lock buffer) exists
           before capture (its first use does a cudaMalloc + cudaMemset, which would break any
           capture by itself), then capture `exl3_gemm` of the untuned (m, K) into a
           torch.cuda.CUDAGraph, fill the output with NaN, replay, compare with the eager output.
The pristine build is expected to abort inside capture (autotuner: stream sync on a capturing
stream), killing the process, which is why every capture runs in its own process. With
--disk-cache each case is captured a second time with the eager run's tune cache copied in:
a disk hit is a plain launch, capture-safe in both builds.

Prints one JSON line per case and capture variant:
  {"case", "eager_ok", "capture_ok", "error", "max_abs_diff_replay_vs_eager", ...}
and writes them all to --json-out.

    python3 scripts/exl3_capture_probe.py --build-only                 # JIT-build the extension
    python3 scripts/exl3_capture_probe.py --cases 4:2,4:6,16:2,16:6 --label pristine --json-out x.json

exllamav3 is imported without running exllamav3/__init__.py (its model, tokenizer and generator
imports need packages this probe does not); put the install on PYTHONPATH (e.g. /tmp/site).
--dry-cpu runs the plumbing on a CPU with a fake extension (tests only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CAPTURE_WARNING = "during CUDA graph capture"
RESULT_PREFIX = "PROBE "
GEMV_TAG = 90  # exl3_gemm's return value when the small-m GEMV path ran (no autotuner involved)


@dataclass(frozen=True)
class Case:
    m: int
    K: int

    @property
    def name(self) -> str:
        return f"m{self.m}_K{self.K}"


def parse_cases(text: str) -> list[Case]:
    """"4:2,16:6" -> [Case(4, 2), Case(16, 6)]; K is the EXL3 bitrate (1..8)."""
    cases = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        m_s, sep, k_s = item.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"case '{item}' must look like M:K, e.g. 16:6")
        try:
            m, K = int(m_s), int(k_s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"case '{item}': M and K must be integers") from None
        if m < 1 or not 1 <= K <= 8:
            raise argparse.ArgumentTypeError(f"case '{item}': need M >= 1 and 1 <= K <= 8")
        cases.append(Case(m, K))
    if not cases:
        raise argparse.ArgumentTypeError("no cases given")
    return cases


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=parse_cases, default=parse_cases("4:2,4:6,16:2,16:6"),
                    help="M:K list (default 4:2,4:6,16:2,16:6)")
    ap.add_argument("--k", type=int, default=4096, help="in_features (multiple of 128)")
    ap.add_argument("--n", type=int, default=1024, help="out_features (multiple of 128)")
    ap.add_argument("--codebook", choices=("mcg", "mul1", "3inst"), default="mcg")
    ap.add_argument("--out-dtype", choices=("float", "half"), default="float",
                    help="C dtype (vllm-exl3 asks for fp32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="build", help="names the build in the output (pristine, patched)")
    ap.add_argument("--json-out", type=Path, default=None, help="write {label, cases: [...]} here")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per child process")
    ap.add_argument("--rel-tol", type=float, default=1e-2,
                    help="replay vs eager relative L2 bound (different kernels, so not bit-equal)")
    ap.add_argument("--disk-cache", action="store_true",
                    help="also capture each case with the eager run's tune cache on disk")
    ap.add_argument("--capture-error-mode", choices=("global", "thread_local", "relaxed"), default="global")
    ap.add_argument("--build-only", action="store_true", help="import (JIT-build) the extension and exit")
    ap.add_argument("--dry-cpu", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dry-build", choices=("auto", "pristine", "patched"), default="auto", help=argparse.SUPPRESS)
    # child-process plumbing
    ap.add_argument("--stage", choices=("drive", "eager", "capture"), default="drive", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--eager-file", type=Path, default=None, help=argparse.SUPPRESS)
    return ap


# --------------------------------------------------------------------------------------------
# the extension (real or fake)


def load_ext() -> Any:
    """exllamav3.ext (JIT-builds exllamav3_ext on first use) without exllamav3/__init__.py."""
    pkgdir = None
    for entry in sys.path:
        cand = Path(entry or ".") / "exllamav3" / "ext.py"
        if cand.is_file():
            pkgdir = cand.parent.resolve()
            break
    if pkgdir is None:
        raise RuntimeError("exllamav3 not found on sys.path (set PYTHONPATH to its site dir)")
    if "exllamav3" not in sys.modules:
        stub = types.ModuleType("exllamav3")
        stub.__path__ = [str(pkgdir)]  # a package whose __init__ never runs
        stub.__file__ = str(pkgdir / "__init__.py")
        sys.modules["exllamav3"] = stub
    import exllamav3.ext as ext_mod  # noqa: E402  (after the stub)

    return ext_mod.exllamav3_ext


def installed_build_is_patched() -> bool | None:
    """Whether the exl3_gemm.cu next to the importable exllamav3 has the capture check (dry runs only)."""
    for entry in sys.path:
        src = Path(entry or ".") / "exllamav3" / "exllamav3_ext" / "quant" / "exl3_gemm.cu"
        if src.is_file():
            return "cudaStreamIsCapturing" in src.read_text(errors="replace")
    return None


class FakeExt:
    """CPU stand-in for exllamav3_ext.exl3_gemm, for --dry-cpu plumbing tests only.

    C = (A * suh) @ W(B) * svh with an arbitrary W derived from the trellis words. It stands in for
    the two builds' behaviour in capture: a "pristine" build dies there like the real one (GPU
    assert on stderr, exit 133) for shapes that reach the autotuner; a "patched" build warns and
    computes. It ignores the tune cache (a real disk hit is capture-safe in both builds). With
    --dry-build auto the installed exl3_gemm.cu decides which one it plays.
    """

    def __init__(self, build: str):
        if build == "auto":
            build = "patched" if installed_build_is_patched() else "pristine"
        self.fail_capture = build == "pristine"
        self.capturing = False

    def exl3_gemm(self, A, B, C, suh, A_had, svh, force_shape_idx, mcg, mul1, force_num_sms):  # noqa: N803
        tuner = not (A.shape[0] <= 8 and B.shape[2] // 16 <= 4)  # the real GEMV path's rule
        if self.capturing and self.fail_capture and tuner:
            sys.stderr.write("GPU assert: operation not permitted when stream is capturing "
                             "quant/coop_autotune.cu 464\n")
            sys.stderr.flush()
            os._exit(133)
        k, n = A.shape[-1], B.shape[1] * 16
        w = B[..., 0].float().repeat_interleave(16, 0).repeat_interleave(16, 1) / 32768.0  # [k, n]
        C.copy_((((A.float() * suh.float()) @ w) * svh.float()).to(C.dtype))
        if self.capturing and tuner:
            sys.stderr.write(f"[exl3_gemm] untuned shape m={A.shape[0]} k={k} n={n} K={B.shape[2] // 16} "
                             f"{CAPTURE_WARNING}; using the static kernel choice\n")
        return 1 if tuner else GEMV_TAG


class FakeGraph:
    """CPU stand-in for torch.cuda.CUDAGraph: records the captured call and re-runs it on replay."""

    def __init__(self, ext: FakeExt):
        self.ext = ext
        self.fn = None

    def capture(self, fn):
        self.ext.capturing = True
        try:
            ret = fn()
        finally:
            self.ext.capturing = False
        self.fn = fn
        return ret

    def replay(self) -> None:
        assert self.fn is not None
        self.fn()


# --------------------------------------------------------------------------------------------
# inputs


def make_inputs(args: argparse.Namespace, case: Case, device: Any) -> dict[str, Any]:
    """A random but valid EXL3 linear and an input, identical in every process for one seed."""
    import torch

    if args.k % 128 or args.n % 128:
        raise SystemExit("--k and --n must be multiples of 128")
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed * 1_000_003 + case.m * 101 + case.K)

    def signs(size: int, scale: float):
        s = torch.randint(0, 2, (size,), generator=gen, device=device).to(torch.float16) * 2 - 1
        return (s * scale).to(torch.float16).contiguous()

    trellis = torch.randint(-32768, 32767, (args.k // 16, args.n // 16, 16 * case.K), dtype=torch.int16,
                            generator=gen, device=device)
    a = torch.randn((case.m, args.k), generator=gen, device=device).to(torch.float16)
    c_dtype = torch.float32 if args.out_dtype == "float" else torch.float16
    return {
        "A": a,
        "B": trellis,
        "suh": signs(args.k, 1 / 64),
        "svh": signs(args.n, 0.5),
        "A_had": torch.empty_like(a),
        "C": torch.zeros((case.m, args.n), dtype=c_dtype, device=device),
        "mcg": args.codebook == "mcg",
        "mul1": args.codebook == "mul1",
    }


def gemm(ext: Any, t: dict[str, Any], A: Any = None, C: Any = None, A_had: Any = None) -> int:
    return int(ext.exl3_gemm(A if A is not None else t["A"], t["B"], C if C is not None else t["C"], t["suh"],
                             A_had if A_had is not None else t["A_had"], t["svh"], -1, t["mcg"], t["mul1"], 0))


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(RESULT_PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------------------------
# child stages


def _setup(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    import torch

    if args.dry_cpu:
        ext = FakeExt(args.dry_build)
        return torch, ext, torch.device("cpu")
    ext = load_ext()
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    return torch, ext, device


def stage_eager(args: argparse.Namespace) -> int:
    torch, ext, device = _setup(args)
    assert args.work is not None
    for case in args.cases:
        out: dict[str, Any] = {"stage": "eager", "case": case.name}
        try:
            t = make_inputs(args, case, device)
            out["path_tag"] = gemm(ext, t)
            if not args.dry_cpu:
                torch.cuda.synchronize()
                out["device"] = torch.cuda.get_device_name(device)
            out["finite"] = bool(torch.isfinite(t["C"]).all().item())
            torch.save(t["C"].cpu(), args.work / f"eager_{case.name}.pt")
            out["ok"] = out["finite"]
            out["error"] = None if out["finite"] else "eager output has non-finite values"
        except Exception as e:  # a Python-level failure; a CUDA abort kills the process instead
            out.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        emit(out)
    return 0


def stage_capture(args: argparse.Namespace) -> int:
    torch, ext, device = _setup(args)
    case = args.cases[0]
    out: dict[str, Any] = {"stage": "capture", "case": case.name}
    t = make_inputs(args, case, device)
    # exllamav3's per-device context exists after any call; m=1 keeps this case's key untuned
    warm_a = t["A"][:1].clone()
    warm_c = torch.zeros((1, t["C"].shape[1]), dtype=t["C"].dtype, device=device)
    gemm(ext, t, A=warm_a, C=warm_c, A_had=torch.empty_like(warm_a))
    if args.dry_cpu:
        graph = FakeGraph(ext)
        out["path_tag"] = graph.capture(lambda: gemm(ext, t))
        t["C"].fill_(float("nan"))
        graph.replay()
    else:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=args.capture_error_mode):
            out["path_tag"] = gemm(ext, t)
        torch.cuda.synchronize()
        t["C"].fill_(float("nan"))  # the replay must write every element
        graph.replay()
        torch.cuda.synchronize()
    got = t["C"].float().cpu()
    out["finite"] = bool(torch.isfinite(got).all().item())
    if args.eager_file is not None and args.eager_file.is_file():
        ref = torch.load(args.eager_file).float()
        diff = (got - ref).abs()
        out["max_abs_diff_replay_vs_eager"] = float(diff.max().item()) if out["finite"] else math.inf
        denom = float(ref.norm().item()) or 1.0
        out["rel_l2_replay_vs_eager"] = float((got - ref).norm().item()) / denom if out["finite"] else math.inf
    out["ok"] = out["finite"]
    emit(out)
    return 0


# --------------------------------------------------------------------------------------------
# the driver


def _child_argv(args: argparse.Namespace, stage: str, cases: list[Case], work: Path,
                eager_file: Path | None = None) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--stage", stage, "--work", str(work),
            "--cases", ",".join(f"{c.m}:{c.K}" for c in cases), "--k", str(args.k), "--n", str(args.n),
            "--codebook", args.codebook, "--out-dtype", args.out_dtype, "--seed", str(args.seed),
            "--capture-error-mode", args.capture_error_mode]
    if eager_file is not None:
        argv += ["--eager-file", str(eager_file)]
    if args.dry_cpu:
        argv.append("--dry-cpu")
        argv += ["--dry-build", args.dry_build]
    return argv


@dataclass
class ChildRun:
    rc: int | None
    results: list[dict[str, Any]]
    stderr: str
    seconds: float


def run_child(argv: list[str], tune_cache: Path, timeout: float) -> ChildRun:
    env = {**os.environ, "EXLLAMAV3_TUNE_CACHE": str(tune_cache)}
    t0 = time.time()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")) + \
            f"\n(timed out after {timeout:.0f} s)"
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in stdout.splitlines()
               if line.startswith(RESULT_PREFIX)]
    return ChildRun(rc, results, stderr, time.time() - t0)


def error_line(stderr: str) -> str:
    """The most telling line of a dead child's stderr (a GPU assert, else the last line)."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    for x in reversed(lines):
        if "GPU assert" in x or "CUDA error" in x or "Error" in x:
            return x[:500]
    return lines[-1][:500] if lines else ""


def drive(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="exl3_capture_"))
    rows: list[dict[str, Any]] = []
    try:
        # eager: one process for every case; a crash costs one case, the rest run again
        eager: dict[str, dict[str, Any]] = {}
        pending = list(args.cases)
        eager_cache = work / "tune_eager"
        eager_cache.mkdir()
        while pending:
            run = run_child(_child_argv(args, "eager", pending, work), eager_cache, args.timeout)
            for r in run.results:
                eager[r["case"]] = r
            done = {r["case"] for r in run.results}
            if run.rc != 0 and len(done) < len(pending):
                dead = next(c for c in pending if c.name not in done)
                eager[dead.name] = {"ok": False, "rc": run.rc, "error": error_line(run.stderr)}
                done.add(dead.name)
            pending = [c for c in pending if c.name not in done]
        variants = ["empty"] + (["disk"] if args.disk_cache else [])
        for case in args.cases:
            ev = eager.get(case.name, {})
            for variant in variants:
                cache = work / f"tune_{case.name}_{variant}"
                if variant == "disk":
                    shutil.copytree(eager_cache, cache)
                else:
                    cache.mkdir()
                eager_file = work / f"eager_{case.name}.pt"
                argv = _child_argv(args, "capture", [case], work, eager_file if eager_file.is_file() else None)
                run = run_child(argv, cache, args.timeout)
                cap = run.results[0] if run.results else {}
                capture_ok = run.rc == 0 and bool(cap.get("ok"))
                rel = cap.get("rel_l2_replay_vs_eager")
                row = {
                    "case": case.name, "m": case.m, "K": case.K, "k": args.k, "n": args.n,
                    "codebook": args.codebook, "build": args.label, "tune_cache": variant,
                    "eager_ok": bool(ev.get("ok")), "eager_path_tag": ev.get("path_tag"),
                    "capture_ok": capture_ok, "capture_rc": run.rc, "capture_path_tag": cap.get("path_tag"),
                    "gemv_path": cap.get("path_tag") == GEMV_TAG,
                    "error": None if capture_ok and ev.get("ok") else (
                        error_line(run.stderr) or cap.get("error") or ev.get("error") or "no result"),
                    "max_abs_diff_replay_vs_eager": cap.get("max_abs_diff_replay_vs_eager"),
                    "rel_l2_replay_vs_eager": rel,
                    "replay_matches_eager": bool(capture_ok and rel is not None and rel <= args.rel_tol),
                    "warned_untuned_in_capture": CAPTURE_WARNING in run.stderr,
                    "device": ev.get("device"), "capture_seconds": round(run.seconds, 1),
                }
                if not capture_ok and not ev.get("ok") and ev.get("error"):
                    row["eager_error"] = ev.get("error")
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"label": args.label, "cases": rows}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.build_only:
        t0 = time.time()
        ext = FakeExt(args.dry_build) if args.dry_cpu else load_ext()
        print(json.dumps({"built": True, "seconds": round(time.time() - t0, 1),
                          "has_exl3_gemm": hasattr(ext, "exl3_gemm")}), flush=True)
        return 0
    if args.stage == "eager":
        return stage_eager(args)
    if args.stage == "capture":
        return stage_capture(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
