"""seat.py without a server: `up` runs vLLM's own parser before it starts anything, and plain-text
`status` shows each rank's MoE call counters."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsv4serve import launch, ports, seat, state, supervisor, vllm_args
from dsv4serve.plugin_counters import Counters
from dsv4serve.profile import load_profile


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture()
def no_spawn(monkeypatch):
    """Fail the test if `up` gets as far as starting anything."""
    def boom(*a, **k):
        raise AssertionError("up started the seat")

    monkeypatch.setattr(supervisor, "spawn", boom)
    monkeypatch.setattr(supervisor, "Supervisor", boom)


def _spec(name: str, *overrides: str, tmp: Path = Path("/tmp/dsv4serve-test-run")) -> launch.LaunchSpec:
    return launch.build(load_profile(name, list(overrides)), run_id="r1", run_dir=tmp)


def _parser_must_not_run(monkeypatch) -> None:
    def never(*a, **k):
        raise AssertionError("vLLM's parser ran")

    monkeypatch.setattr(vllm_args, "validate", never)


# ---------------------------------------------------------------------------------------------
# up: vLLM's parser before the launch


def test_up_refuses_a_flag_vllm_rejects_with_exit_2_before_spawning(home, no_spawn, monkeypatch):
    pytest.importorskip("vllm.entrypoints.launchers.cli_args")
    from dsv4serve import cli, demo_model

    # the demo model is not what this test is about: pretend it is there
    monkeypatch.setattr(demo_model, "is_complete", lambda *a, **k: True)
    monkeypatch.setattr(demo_model, "ensure_demo_model", lambda *a, **k: demo_model.default_dir(0))
    r = CliRunner().invoke(cli.app, ["up", "--profile", "cpu-demo", "--set", f"vllm.port={ports.free_port()}",
                                     "--set", "vllm.extra_args=[--no-such-flag]", "--skip-checks"])
    assert r.exit_code == 2, (r.stdout, r.stderr, r.exception)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "unrecognized arguments: --no-such-flag" in lines[0] and "vllm.*" in lines[0]
    assert not list((home / "runs").glob("*")) if (home / "runs").exists() else True  # no run dir left
    assert state.load("cpu-demo") is None


def test_no_validate_skips_the_parser(monkeypatch, capsys):
    _parser_must_not_run(monkeypatch)
    seat.check_vllm_argv(load_profile("cpu-demo"), _spec("cpu-demo"), validate=False, json_events=True)
    ev = json.loads(capsys.readouterr().out)
    assert ev["event"] == "vllm_parser" and ev["state"] == "skipped" and "--no-validate" in ev["message"]


def test_docker_seat_skips_the_parser_when_host_vllm_is_not_the_pinned_stack(monkeypatch, capsys):
    _parser_must_not_run(monkeypatch)
    monkeypatch.setattr(seat, "_host_vllm_version", lambda: "0.32.0")
    seat.check_vllm_argv(load_profile("8x16gb-380k"), _spec("8x16gb-380k"), validate=True, json_events=False)
    out = capsys.readouterr().out
    assert "vLLM parser check skipped: vLLM 0.32.0 here is not the image's stack.vllm >=0.28,<0.29" in out


def test_docker_seat_is_parsed_when_host_vllm_matches_the_pin(monkeypatch, capsys):
    seen = []

    def fake(args, name=""):
        seen.append((list(args), name))
        return vllm_args.ParserCheck(True, "0.28.1rc1", "accepted by vLLM 0.28.1rc1's parser")

    monkeypatch.setattr(vllm_args, "validate", fake)
    monkeypatch.setattr(seat, "_host_vllm_version", lambda: "0.28.1rc1.dev337+g27a94d1ce")  # the image's dev build
    spec = _spec("8x16gb-380k")
    seat.check_vllm_argv(load_profile("8x16gb-380k"), spec, validate=True, json_events=False)
    assert seen == [(spec.vllm_args, "8x16gb-380k")]
    assert "vLLM parser: accepted" in capsys.readouterr().out


def test_docker_dry_run_reports_a_refusal_by_another_vllm_as_advice_not_an_error(home, monkeypatch):
    """up skips the parser where this vLLM is not the image's; the dry run still asks it, but a
    refusal there must not fail a plan that up would launch."""
    from dsv4serve.errors import ProfileError

    def refuse(args, name=""):
        raise ProfileError("vLLM 0.32.0 rejects --tool-call-parser deepseek_v4")

    monkeypatch.setattr(vllm_args, "validate", refuse)
    monkeypatch.setattr(seat, "_host_vllm_version", lambda: "0.32.0")
    plan = seat.dry_run(load_profile("8x16gb-380k"))
    p = plan["vllm_parser"]
    assert p["accepted"] is False and p["up_skips"] == "vLLM 0.32.0 here is not the image's stack.vllm >=0.28,<0.29"
    assert p["detail"].startswith("refused here: vLLM 0.32.0 rejects") and "advice only" in p["detail"]
    monkeypatch.setattr(seat, "_host_vllm_version", lambda: "0.28.1rc1")  # the image's own: up would refuse too
    with pytest.raises(ProfileError):
        seat.dry_run(load_profile("8x16gb-380k"))


def test_parser_check_leaves_no_env_behind(monkeypatch):
    """Importing vLLM edits os.environ; the seat must not inherit that from the launcher."""
    def fake(args, name=""):
        os.environ["DSV4SERVE_TEST_FROM_VLLM_IMPORT"] = "1"
        return vllm_args.ParserCheck(True, "x", "accepted")

    monkeypatch.setattr(vllm_args, "validate", fake)
    seat.check_vllm_argv(load_profile("cpu-demo"), _spec("cpu-demo"), validate=True, json_events=True)
    assert "DSV4SERVE_TEST_FROM_VLLM_IMPORT" not in os.environ


def test_dry_run_lists_the_refusal_of_a_running_seat_and_of_a_held_lock(home, monkeypatch):
    """up refuses a seat that runs (or that another up holds); the dry run said it would go ahead."""
    import psutil

    monkeypatch.setattr(vllm_args, "validate", lambda args, name="": vllm_args.ParserCheck(True, "x", "accepted"))
    profile = load_profile("cpu-demo", [f"vllm.port={ports.free_port()}"])
    assert not any("already running" in r or "held by another" in r for r in seat.dry_run(profile)["up_refuses"])
    assert not state.seat_dir("cpu-demo").exists()  # the dry run made no lock file
    me = psutil.Process()
    state.save(_ready_state(home / "run").model_copy(update={"pid": me.pid, "start_time": me.create_time()}))
    refuses = seat.dry_run(profile)["up_refuses"]
    assert any(r.startswith("seat cpu-demo is already running") and "down --profile cpu-demo" in r for r in refuses)
    state.remove("cpu-demo", "cpu-demo-test")
    lk = state.acquire("cpu-demo", "up")
    try:
        refuses = seat.dry_run(profile)["up_refuses"]
        assert any(r.startswith("seat cpu-demo is held by another dsv4serve") for r in refuses), refuses
    finally:
        lk.release()


def test_extra_args_may_not_carry_a_flag_the_profile_owns():
    """vLLM takes the later of two equal flags: `--port` in extra_args moved the server while
    readiness probed vllm.port."""
    from dsv4serve.errors import ProfileError

    for extra, key in ((["--port", "18599"], "port"), (["--port=18599"], "port"), (["-tp", "1"], "tensor_parallel_size"),
                       (["--no-enable-prefix-caching"], "enable_prefix_caching"),
                       (["--max_model_len", "8192"], "max_model_len"),
                       (["--speculative-config.num_speculative_tokens", "5"], "speculative_config"),
                       # vLLM's alias (helper audit: it replaced the seat's 0.97 behind check-seat's plan)
                       (["--device-memory-utilization", "0.5"], "gpu_memory_utilization"),
                       (["--device-mem=0.5"], "gpu_memory_utilization")):
        with pytest.raises(ProfileError, match=f"is vllm.{key}'s flag: set vllm.{key} instead"):
            load_profile("cpu-demo", [f"vllm.extra_args={json.dumps(extra)}"])
    for fine in (["--max-log-len", "10"], ["-O3"], ["--optimization-level", "3"]):  # -O is optimization_level's
        assert load_profile("cpu-demo", [f"vllm.extra_args={json.dumps(fine)}"]).vllm.extra_args == fine


def test_prefill_context_parallelism_is_refused_like_pipeline_parallelism():
    """vLLM 0.32 multiplies the workers by -pcp as by -pp: two workers would share one TP rank's
    markers and counters (helper audit)."""
    from dsv4serve.errors import ProfileError

    for extra in (["-pcp", "2"], ["--prefill-context-parallel-size=2"], ["--prefill-context", "2"]):
        with pytest.raises(ProfileError, match="sets prefill context parallelism, which dsv4serve does not supervise"):
            load_profile("cpu-demo", [f"vllm.extra_args={json.dumps(extra)}"])


def test_a_flag_given_twice_is_refused_by_the_parser_check():
    """vLLM keeps the later of two flags for one setting and only logs "Found duplicate keys": the
    parser check called such a line accepted (helper audit). Flags meant to repeat still pass."""
    from dsv4serve.errors import ProfileError

    for twice in (["--uvicorn-log-level", "info", "--uvicorn-log-level", "debug"],
                  ["--enable-prefix-caching", "--no-enable-prefix-caching"]):
        with pytest.raises(ProfileError, match="both set vLLM's"):
            vllm_args.validate(["/m", *twice])
    assert vllm_args.validate(["/m", "--middleware", "a", "--middleware", "b"]).available


def test_capture_sizes_must_be_whole_numbers():
    """[1, 2, 4, "32"] passed the row-ceiling check (it skipped what was not an int) while vLLM
    reads it as 32; a bare 4 was a traceback (helper audit)."""
    from dsv4serve.errors import ProfileError

    for bad in ('4', '[1, 2, 4, "32"]', '[1, 2, 4, 32.0]', '[0, 1]', '[true]'):
        with pytest.raises(ProfileError, match="cudagraph_capture_sizes must be a list of whole numbers"):
            load_profile("8x16gb-380k", [f"vllm.compilation_config={{cudagraph_capture_sizes: {bad}}}"])
    with pytest.raises(ProfileError, match="max_cudagraph_capture_size must be a whole number"):
        load_profile("8x16gb-380k", ['vllm.compilation_config={max_cudagraph_capture_size: "64"}'])
    with pytest.raises(ProfileError, match="above the lna2 row ceiling"):
        launch.check_plan(load_profile("8x16gb-380k", ["vllm.compilation_config={cudagraph_capture_sizes: [1, 2, 4, 32]}"]))


# ---------------------------------------------------------------------------------------------
# status: per-rank MoE call counters in plain text


def _ready_state(run_dir: Path) -> state.SeatState:
    return state.SeatState(seat="cpu-demo", run_id="cpu-demo-test", profile="cpu-demo", profile_digest="x",
                           runtime="native", argv=["python"], env={}, host="127.0.0.1", port=1, served_name="m",
                           tp=2, run_dir=str(run_dir), log_path=str(run_dir / "vllm.log"), phase="ready")


def test_plain_status_prints_each_ranks_counters(home, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    state.save(_ready_state(run_dir))
    c = Counters(run_dir, rank=0, tp=2, kernel="lna2")  # the plugin's own writer, so the schema is real
    for _ in range(12):
        c.call("lna2")
    for _ in range(40):
        c.call("incumbent")
    c.decline("rows=32 above the ceiling")
    c.decline("rows=32 above the ceiling")
    c.decline("prefill")
    assert c.write()
    rows = seat.status("cpu-demo")
    assert rows[0]["ranks"][0]["moe_calls"]["lna2"] == 12 and rows[0]["ranks"][1]["moe_calls"] is None
    seat.render_status(rows)
    out = capsys.readouterr().out
    assert "rank 0 MoE calls (lna2): lna2 12, incumbent 40, declines 3 (most: rows=32 above the ceiling)" in out
    assert "rank 1 MoE calls: no counters file" in out


def test_plain_status_says_what_each_captured_graph_holds_and_the_parity_count(home, tmp_path, capsys):
    """Graph replays are not counted: a size captured with the incumbent was invisible in status
    (dispatch audit); the counters now record each captured size's kernel, and status shows them."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    state.save(_ready_state(run_dir))
    c = Counters(run_dir, rank=0, tp=2, kernel="lna2")
    c.set_layers(3, 2)
    c.verified(1, 1e-3)
    for rows, kind in ((1, "lna2"), (2, "lna2"), (4, "lna2"), (32, "declined"), (1, "incumbent")):
        c.call("lna2" if kind == "lna2" else "incumbent")
        c.captured(rows, kind)
    assert c.write()
    rows = seat.status("cpu-demo")
    calls = rows[0]["ranks"][0]["moe_calls"]
    assert calls["graphs"] == {"lna2": [1, 2, 4], "declined": [32]} and calls["parity"] == {"layers": 1, "of": 2}
    seat.render_status(rows)
    out = capsys.readouterr().out
    assert ("rank 0 MoE calls (lna2): lna2 3, incumbent 2, declines 0; parity 1/2 layers; graphs lna2 at 1, 2, 4, "
            "the incumbent at 32") in out


def test_a_rank_whose_pid_is_not_known_yet_is_not_called_dead(home, tmp_path, capsys):
    """While a seat loads, the log has not named its workers' pids: alive is unknown (-), not NO."""
    st = _ready_state(tmp_path)
    st.rank_pids = {0: os.getpid()}
    state.save(st)
    rows = seat.status("cpu-demo")
    assert [(k["pid"], k["alive"]) for k in rows[0]["ranks"]] == [(os.getpid(), True), (None, None)]


def test_plain_status_without_counters_says_so(home, tmp_path, capsys):
    state.save(_ready_state(tmp_path))
    seat.render_status(seat.status("cpu-demo"))
    assert "MoE call counters: no file yet" in capsys.readouterr().out


def test_a_ready_seat_whose_endpoint_does_not_answer_is_unhealthy(home, tmp_path, capsys):
    """The state says ready and its main process lives (this test's own), but nothing answers on its
    port: status must not print "ready" beside "/health no"."""
    import psutil

    from dsv4serve import ports

    me = psutil.Process()
    st = _ready_state(tmp_path).model_copy(update={"pid": me.pid, "start_time": me.create_time(),
                                                   "port": ports.free_port()})
    state.save(st)
    row = seat.status("cpu-demo")[0]
    assert row["process"] == "alive" and row["phase"] == "unhealthy" and row["health"] is False
    assert f"{st.base_url}/health does not answer 200" in row["problem"]
    assert "dsv4serve logs --profile cpu-demo --rank api" in row["problem"]
    seat.render_status([row])
    assert "unhealthy" in capsys.readouterr().out


def test_a_signal_ignored_by_whoever_started_up_stays_ignored():
    """`nohup dsv4serve up`: SIGHUP is ignored on purpose, and neither up's pre-launch handlers nor
    the supervisor's may turn a hangup back into a stop; SIGTERM still gets them."""
    import signal

    from dsv4serve import supervisor

    saved = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        old, _ = seat._signals_raise()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and signal.SIGHUP not in old
        assert signal.getsignal(signal.SIGTERM) is not saved[signal.SIGTERM]
        with supervisor.Interrupts():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        seat._signals_restore(old)
        assert signal.getsignal(signal.SIGTERM) is saved[signal.SIGTERM]
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_a_signal_after_the_launch_began_does_not_claim_nothing_was_started():
    """Once the supervisor has run (a ready seat left running, as up leaves it), a late SIGTERM is
    said as such, with how to find and stop the seat."""
    import signal

    from dsv4serve.errors import Signalled

    saved = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM)}
    try:
        old, stage = seat._signals_raise()
        handler = signal.getsignal(signal.SIGTERM)
        with pytest.raises(Signalled) as e:
            handler(signal.SIGTERM, None)
        assert e.value.message.endswith("before vLLM was started; nothing was started") and e.value.exit_code == 143
        stage["launched"] = True
        with pytest.raises(Signalled) as e:
            handler(signal.SIGTERM, None)
        assert "after the launch began; the seat may be running" in e.value.message and "down" in e.value.hint
        seat._signals_restore(old)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_ctrl_c_during_downs_grace_finishes_the_stop_at_once(home, tmp_path):
    """A Ctrl-C while down waited out a ready seat's 20 s grace abandoned the stop: SIGTERM sent
    only, the seat still running and its state stuck at "stopping" (helper audit). It now cuts the
    grace short, the stop finishes (state removed, last.json written) and down exits 130."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    run_id = "cpu-demo-20260101-000000-abcd"
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    p = subprocess.Popen([sys.executable, "-c", deaf], start_new_session=True,
                         env={**os.environ, state.RUN_ID_ENV: run_id})
    try:
        time.sleep(0.3)
        state.save(state.SeatState(
            seat="cpu-demo", run_id=run_id, profile="cpu-demo", profile_digest="x", runtime="native",
            argv=["python"], env={}, host="127.0.0.1", port=1, served_name="m", tp=1, run_dir=str(tmp_path),
            log_path=str(tmp_path / "vllm.log"), phase="ready", pid=p.pid, pgid=p.pid,
            start_time=psutil.Process(p.pid).create_time(), gates={"timeouts": {"shutdown_grace_s": 20.0}}))
        # down keeps a SIGINT its parent ignores (a suite started in the background): this test sends
        # it one, so it starts with the default whatever the suite was started under
        d = subprocess.Popen([sys.executable, "-m", "dsv4serve", "down", "-p", "cpu-demo", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 30
        while state.load("cpu-demo").phase != "stopping" and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # down is inside the grace now
        t0 = time.monotonic()
        d.send_signal(signal.SIGINT)
        out, err = d.communicate(timeout=60)
        assert time.monotonic() - t0 < 15, "the 20 s grace was waited out"
        assert d.returncode == 130, err
        assert p.wait(timeout=10) == -9
        assert state.load("cpu-demo") is None and state.load_last("cpu-demo")["outcome"] == "stopped by down"
        doc = json.loads(out)
        assert doc["signal"]["exit_code"] == 130 and doc["seats"][0]["killed"] == [p.pid]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_sigterm_between_the_state_write_and_the_spawn_leaves_nothing(home, tmp_path):
    """The supervisor took the signals only after writing the state and run.json: a SIGTERM in that
    window left a "launching" state of a run that never started, with "the seat may be running"
    (helper audit). The signals are the supervisor's before the write now."""
    import subprocess
    import sys

    from dsv4serve import ports

    script = tmp_path / "window.py"
    script.write_text(
        "import os, signal, sys\n"
        "from dsv4serve import state\n"
        "real = state.atomic_write\n"
        "def atomic_write(path, data, mode=None):\n"
        "    real(path, data, mode)\n"
        "    if path.name == 'run.json':\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "state.atomic_write = atomic_write\n"
        "from dsv4serve.cli import main\n"
        f"sys.argv = ['dsv4serve', 'up', '--profile', 'cpu-demo', '--skip-checks', '--no-validate', '--set', "
        f"'vllm.port={ports.free_port()}']\n"
        "main()\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "DSV4SERVE_HOME": str(home)})
    assert r.returncode == 143, r.stdout + r.stderr
    assert "up stopped by SIGTERM before vLLM was started; nothing was started" in r.stdout + r.stderr
    assert state.load("cpu-demo") is None


def test_a_third_ctrl_c_gives_down_up_when_docker_hangs(home, tmp_path):
    """Under down's signal handling every further Ctrl-C was ignored: with a docker CLI that took
    8 s a call, down held the shell for 30 s after three presses (review). The third gives up,
    saying the stop is unfinished."""
    import signal
    import subprocess
    import sys
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\nsleep 8\necho \"Error: No such object: $*\" >&2\nexit 1\n")
    (bin_dir / "docker").chmod(0o755)
    gone = subprocess.Popen(["true"])
    gone.wait()
    state.save(state.SeatState(seat="cpu-demo", run_id="cpu-demo-20250101-000000-abcd", profile="cpu-demo",
                               profile_digest="x", runtime="docker", container_name="dsv4-hang", argv=["docker"],
                               env={}, host="127.0.0.1", port=1, served_name="m", tp=1, run_dir=str(tmp_path),
                               log_path=str(tmp_path / "vllm.log"), phase="ready", pid=gone.pid, start_time=1.0))
    d = subprocess.Popen([sys.executable, "-m", "dsv4serve", "down", "-p", "cpu-demo"], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as above
    time.sleep(2.0)
    for _ in range(3):
        d.send_signal(signal.SIGINT)
        time.sleep(0.5)
    t0 = time.monotonic()
    out, _ = d.communicate(timeout=60)
    assert time.monotonic() - t0 < 5, out
    assert d.returncode == 130 and "down stopped by a third Ctrl-C (SIGINT) before the stop finished" in out, out


def test_downs_closing_line_counts_a_docker_kill_as_the_sigkill(capsys):
    """A docker seat's escalation is `docker kill`, after which no process needs SIGKILL: the closing
    line dropped "cut short (SIGKILL)" (review)."""
    rep = {"seat": "s", "run_id": "r", "clean": True, "killed": [], "signalled": [],
           "docker": [{"argv": ["docker", "stop", "-t", "20", "c"], "rc": 0}, {"argv": ["docker", "kill", "c"], "rc": 0}]}
    seat.render_down({"clean": True, "seats": [rep], "signal": {"label": "Ctrl-C (SIGINT)", "exit_code": 130}})
    assert "Ctrl-C (SIGINT): the grace was cut short (SIGKILL); the stop finished" in capsys.readouterr().out
    seat.render_down({"clean": True, "seats": [{**rep, "docker": rep["docker"][:1]}],
                      "signal": {"label": "Ctrl-C (SIGINT)", "exit_code": 130}})
    assert "Ctrl-C (SIGINT): the stop finished" in capsys.readouterr().out
