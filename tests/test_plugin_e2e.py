"""The plugin in real vLLM on the CPU (the demo seat: a tiny DeepSeek-V3-style MoE, TP 2, MTP).

* On the shared demo seat (`demo_seat`, kernel incumbent): the ready line on both ranks (and the
  MTP draft's line), counters files on both ranks that move with a completion.
* On seats of their own (`dsv4serve up` with kernel lna2): the demo's MoE layers are vLLM's
  unquantized ones and there is no CUDA, so lna2 cannot be made ready. Strict 1 must fail every
  rank at load with "lna2 not ready: ..." and leave nothing running; strict 0 must come up with
  the fallback reason logged once per rank.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import assert_nothing_left, cli

pytestmark = pytest.mark.e2e

TP = 2
# --skip-checks: up's pre-launch checks already refuse an lna2 seat without a loadable extension;
# skipping them is how these tests reach the plugin's own refusal inside every worker.
LNA2 = ["--skip-checks", "--set", "moe.kernel=lna2"]


def _rank_lines(log: str, needle: str) -> dict[int, list[str]]:
    """Lines containing needle, by the TP rank in our `rank=r/tp` field, checked against vLLM's
    worker prefix on the same line (`(Worker_TP<r> pid=N)`)."""
    out: dict[int, list[str]] = {}
    for ln in log.splitlines():
        if needle not in ln:
            continue
        m = re.search(r"\brank=(\d+)/(\d+)\b", ln)
        assert m and int(m.group(2)) == TP, ln
        r = int(m.group(1))
        prefix = re.match(r"^\((Worker_TP(\d+)|Worker|VllmWorker-(\d+)) pid=\d+\)", ln)
        assert prefix, f"no vLLM worker prefix: {ln}"
        if prefix.group(2) is not None:
            assert int(prefix.group(2)) == r, ln
        out.setdefault(r, []).append(ln)
    return out


def _complete(base_url: str, model: str) -> None:
    r = httpx.post(f"{base_url}/v1/completions", timeout=120.0,
                   json={"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    r.raise_for_status()


def _calls(run_dir: Path, rank: int) -> dict | None:
    try:
        return json.loads((run_dir / f"counters-rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def test_ready_lines_and_counters_on_the_demo_seat(demo_seat):
    st = demo_seat.state
    log = Path(st.log_path).read_text(errors="replace")
    ready = _rank_lines(log, "dsv4serve plugin ready")
    assert sorted(ready) == [0, 1], ready
    for r, lines in ready.items():
        assert len(lines) == 1, lines  # once per worker process, not again for the draft
        assert lines[0].endswith(f"dsv4serve plugin ready rank={r}/2 moe_layers=1 "
                                 "moe_method=UnquantizedFusedMoEMethod kernel=incumbent"), lines[0]
    assert sorted(_rank_lines(log, "dsv4serve plugin draft")) == [0, 1]
    assert "LNA2 MoE kernel ACTIVE" not in log and "LNA2 declined" not in log

    run_dir = Path(st.run_dir)
    before = {r: _calls(run_dir, r) for r in range(TP)}
    _complete(demo_seat.base_url, demo_seat.model)
    deadline = time.time() + 15  # the plugin flushes every 2 s
    while time.time() < deadline:
        now = {r: _calls(run_dir, r) for r in range(TP)}
        if all(now[r] and now[r]["calls"]["incumbent"] > ((before[r] or {}).get("calls", {}).get("incumbent", 0))
               for r in range(TP)):
            break
        time.sleep(0.5)
    for r in range(TP):
        c = now[r]
        assert c is not None, f"no counters from rank {r} in {run_dir}"
        assert (c["rank"], c["tp"], c["kernel"], c["layers"], c["final"]) == (r, TP, "incumbent", 2, False), c
        assert c["calls"]["lna2"] == 0 and c["calls"]["incumbent"] > 0 and c["declines"] == {}, c


def _up(home: Path, port: int, *extra: str, timeout: float = 400):
    return cli("up", "--profile", "cpu-demo", "--json", "--set", f"vllm.port={port}", *extra, home=home,
               timeout=timeout)


def _events(stdout: str) -> list[dict]:
    out = []
    for ln in stdout.splitlines():
        try:
            out.append(json.loads(ln))
        except ValueError:
            continue
    return out


def _run_log(home: Path) -> tuple[str, list[Path]]:
    logs = sorted((home / "runs").glob("*/vllm.log"))
    assert logs, f"no run log under {home / 'runs'}"
    return logs[-1].read_text(errors="replace"), logs


@pytest.mark.own_server
def test_lna2_strict1_fails_fast_on_every_rank(tmp_path):
    from dsv4serve import ports

    home, port = tmp_path / "home", ports.free_port()
    t0 = time.time()
    r = _up(home, port, *LNA2, "--set", "moe.strict=1", "--set", "env.VLLM_EXL3_MOE_STRICT=1")
    took = time.time() - t0
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    failed = [e for e in _events(r.stdout) if e.get("event") == "failed"]
    assert failed, r.stdout[-3000:]
    first = failed[-1].get("first_errors", {})
    for rank in range(TP):
        assert "lna2 not ready" in first.get(f"rank{rank}", ""), first  # up names every rank
    assert failed[-1].get("left_running") == []
    log, logs = _run_log(home)
    fails = _rank_lines(log, "dsv4serve plugin FAILED lna2 not ready:")
    assert sorted(fails) == [0, 1], fails
    for rank, lines in fails.items():
        assert f"lna2 not ready: rank={rank}/2 layer=model.layers.1.mlp.experts" in lines[0]
        assert "UnquantizedFusedMoEMethod is not vllm-exl3's Exl3MoEMethod" in lines[0]
    assert "dsv4serve plugin ready" not in log
    assert took < 240, f"took {took:.0f} s: not fast"  # the failure is at load, long before any gate timeout
    run_id = logs[-1].parent.name
    assert_nothing_left(run_id, None, port, since=t0, run_dir=logs[-1].parent)


@pytest.mark.own_server
def test_lna2_strict0_comes_up_and_logs_the_fallback_once_per_rank(tmp_path):
    from dsv4serve import ports

    home, port = tmp_path / "home", ports.free_port()
    t0 = time.time()
    r = _up(home, port, *LNA2, "--set", "moe.strict=0", "--set", "env.VLLM_EXL3_MOE_STRICT=0")
    try:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        log, logs = _run_log(home)
        fallback = _rank_lines(log, "LNA2 declined: lna2 not ready:")
        assert sorted(fallback) == [0, 1], fallback
        for rank, lines in fallback.items():
            assert len(lines) == 1, lines  # once per rank: the MTP draft's layer does not repeat it
            assert "UnquantizedFusedMoEMethod is not vllm-exl3's Exl3MoEMethod" in lines[0]
            assert "the incumbent serves it (VLLM_EXL3_MOE_STRICT=0)" in lines[0]
        ready = _rank_lines(log, "dsv4serve plugin ready")
        assert sorted(ready) == [0, 1]
        assert all(ln[0].endswith("kernel=incumbent requested=lna2") for ln in ready.values()), ready
        _complete(f"http://127.0.0.1:{port}", "dsv4-demo")
        run_dir = logs[-1].parent
        deadline = time.time() + 15
        while time.time() < deadline and not all(
                (_calls(run_dir, k) or {}).get("calls", {}).get("incumbent", 0) > 0 for k in range(TP)):
            time.sleep(0.5)
        for k in range(TP):
            c = _calls(run_dir, k)
            assert c and c["calls"]["lna2"] == 0 and c["calls"]["incumbent"] > 0, c
            assert list(c["declines"]) == ["not ready: quant method UnquantizedFusedMoEMethod is not vllm-exl3's "
                                           "Exl3MoEMethod (no EXL3 routed experts for lna2 to serve)"], c
    finally:
        d = cli("down", "--json", home=home, timeout=120)
        assert d.returncode == 0, d.stdout[-2000:] + d.stderr[-2000:]
    run_id = logs[-1].parent.name
    assert_nothing_left(run_id, None, port, since=t0, run_dir=logs[-1].parent)
    # No assertion on "final": on a process-group stop the engine SIGKILLs its workers right
    # after the SIGTERM, so the workers' last write is best effort (plugin_counters.py).
