#!/usr/bin/env python3
"""Record everything dsv4serve.gpu reads from NVML on this machine, as JSON.

Run once on a GPU machine; the `recording` part is what tests replay through
`dsv4serve.testing.fake_nvml.FakeNvml`, and `parsed` is what gpu.probe made of it there (tests
assert that replaying gives the same). Needs only `nvidia-ml-py` (psutil optional, for process
names); it imports dsv4serve from this checkout's src/ when dsv4serve is not installed.

    python3 scripts/nvml_probe.py [--ids 0,1] [--out nvml.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from dsv4serve import gpu  # noqa: E402
from dsv4serve.testing.fake_nvml import RecordingNvml  # noqa: E402


def _smi() -> dict[str, str]:
    """nvidia-smi's own view, kept beside the recording so a reader can cross-check it."""
    out: dict[str, str] = {}
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {"error": "nvidia-smi not on PATH"}
    for key, argv in (("topo", [exe, "topo", "-m"]), ("query", [exe, "-q", "-d", "MEMORY,COMPUTE,PIDS"])):
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            out[key] = r.stdout[-20000:] + (r.stderr[-2000:] if r.returncode else "")
        except (OSError, subprocess.TimeoutExpired) as e:
            out[key] = f"failed: {e}"
    return out


def _dist_version(name: str) -> str | None:
    """The installed distribution's version (pynvml itself carries none)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", default=None, help="GPU indices to read P2P/topology between (default: all)")
    ap.add_argument("--out", default=None, help="write here instead of stdout")
    ap.add_argument("--source", default=None, help="a label for the recording (default: host and GPU name)")
    a = ap.parse_args()
    ids = [int(x) for x in a.ids.split(",")] if a.ids else None
    try:
        import pynvml
    except ImportError:
        print(json.dumps({"error": "nvidia-ml-py is not installed"}))
        return 1
    rec = RecordingNvml(pynvml)
    machine = gpu.probe(ids=ids, nvml=rec,
                        process_name=lambda pid: rec.note_process_name(pid, gpu._process_name(pid)))
    names = sorted({g.name for g in machine.gpus if g.name})
    rec.recording["source"] = a.source or f"nvml_probe on {platform.node()} ({', '.join(names) or 'no GPU'})"
    doc = {
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"node": platform.node(), "python": platform.python_version(), "platform": platform.platform(),
                 "nvidia_ml_py": _dist_version("nvidia-ml-py") or getattr(pynvml, "__version__", None),
                 "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")},
        "recording": rec.recording,
        "parsed": machine.as_dict(),
        "nvidia_smi": _smi(),
    }
    text = json.dumps(doc, indent=2, default=str)
    if a.out:
        Path(a.out).write_text(text + "\n")
    else:
        print(text)
    return 0 if machine.available else 1


if __name__ == "__main__":
    sys.exit(main())
