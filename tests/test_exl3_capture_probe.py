"""CPU plumbing of the device capture probe and its check script (the GPU run is the lead's).

`--dry-cpu` swaps exllamav3_ext and torch.cuda.CUDAGraph for the fakes documented in the probe;
what is tested here is the subprocess-per-case driver, crash handling, the JSON contract, and
(check script) applying the real patch set to an exllamav3 tree with dsv4serve.patches, reverting
it for the pristine phase, and the verdict. The wheel install step is not exercised here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "scripts" / "exl3_capture_probe.py"
CHECK = REPO / "scripts" / "exl3_capture_check.sh"

sys.path.insert(0, str(REPO / "scripts"))
import exl3_capture_probe as probe  # noqa: E402


def test_parse_cases() -> None:
    assert probe.parse_cases("4:2, 16:6") == [probe.Case(4, 2), probe.Case(16, 6)]
    assert probe.parse_cases("16:6")[0].name == "m16_K6"
    for bad in ("4", "4:x", "0:2", "4:9", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            probe.parse_cases(bad)


def _drive(tmp_path: Path, build: str, cases: str) -> list[dict]:
    out = tmp_path / f"{build}.json"
    proc = subprocess.run([sys.executable, str(PROBE), "--dry-cpu", "--dry-build", build, "--k", "256", "--n", "128",
                           "--cases", cases, "--label", build, "--json-out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    doc = json.loads(out.read_text())
    assert doc["label"] == build and doc["cases"] == lines
    return lines


def test_pristine_capture_death_is_reported_per_case(tmp_path: Path) -> None:
    rows = _drive(tmp_path, "pristine", "16:6,4:2")
    by = {r["case"]: r for r in rows}
    dead, gemv = by["m16_K6"], by["m4_K2"]
    assert dead["eager_ok"] is True and dead["capture_ok"] is False and dead["capture_rc"] == 133
    assert "operation not permitted when stream is capturing" in dead["error"]
    assert dead["max_abs_diff_replay_vs_eager"] is None
    # the process dying on one case does not cost the next one
    assert gemv["capture_ok"] is True and gemv["gemv_path"] is True
    for key in ("case", "eager_ok", "capture_ok", "error", "max_abs_diff_replay_vs_eager"):
        assert key in dead


def test_patched_capture_replays_like_eager(tmp_path: Path) -> None:
    (row,) = _drive(tmp_path, "patched", "16:6")
    assert row["capture_ok"] and row["replay_matches_eager"] and row["error"] is None
    assert row["warned_untuned_in_capture"] is True
    assert row["max_abs_diff_replay_vs_eager"] == 0.0


def test_check_script_end_to_end_on_cpu(tmp_path: Path) -> None:
    trees = Path(os.environ.get("DSV4SERVE_PRISTINE_CACHE", REPO / ".cache" / "pristine")) / "trees"
    if not trees.is_dir():
        pytest.skip(f"pristine cache {trees} is absent: run `.venv/bin/python scripts/fetch_pristine.py` first")
    src = trees / "exllamav3-1.4.5"
    assert (src / ".complete.json").is_file(), f"{src} is incomplete: rerun scripts/fetch_pristine.py"
    # The pristine exllamav3 files (with their dist-info) stand in for the pip-installed wheel; the
    # empty ext.py is what the script checks to skip its install step (the dry probe imports nothing).
    site = tmp_path / "site"
    shutil.copytree(src, site)
    (site / "exllamav3" / "ext.py").write_text("")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "EXL3_SITE": str(site),
           "EXL3_CAPTURE_STATE": str(tmp_path / "state"), "EXL3_WHEELS": str(tmp_path / "no-wheels"),
           "PYTHON": sys.executable, "DSV4SERVE_HOME": str(tmp_path / "home"),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "EXL3_CAPTURE_CASES": "16:6",
           "EXL3_PROBE_ARGS": "--dry-cpu --k 256 --n 128"}
    proc = subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "capture.json").read_text())
    assert doc["verdict"]["pristine_capture_failed"] == ["m16_K6/empty", "m16_K6/disk"]
    assert doc["verdict"]["patched_all_ok"] is True
    # check-seat's exl3-extension row runs after each build; the dry build compiles nothing to read
    assert doc["marker_pristine"]["status"] == doc["marker_patched"]["status"] == "no build"
    assert sorted(doc["patch_apply"]["changed"]) == sorted(doc["patch_apply"]["rebuild"] +
                                                           ["exllamav3/modules/quant/exl3.py"])
    # the patched tree really is the patched bytes
    from dsv4serve import patches

    rows = patches.set_status(patches.load_set("exllamav3-1.4.5"), site)
    assert {r.state for r in rows} == {"patched", "not-applicable"}
