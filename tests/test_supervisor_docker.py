"""The Docker runtime's code paths, and the supervisor's stall and crash handling, cheaply.

No Docker engine exists in CI, so `tests/fakes/docker` stands in for the Docker CLI: it records its
argv and, for `run`, prints canned vLLM-style lines and serves a minimal OpenAI API (see its
docstring). The real supervisor runs unchanged through the real `dsv4serve` CLI.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from dsv4serve import ports, stop

from .conftest import FAKES, assert_nothing_left, cli, json_lines


@pytest.fixture()
def fake(tmp_path):
    home = tmp_path / "home"
    ddir = tmp_path / "docker"
    name = f"dsv4-fake-{secrets.token_hex(3)}"
    port = ports.free_port()
    prof = tmp_path / "fake-docker.yaml"
    prof.write_text(f"""
name: fake-docker
extends: cpu-demo
model: {{demo: false, path: {tmp_path / 'model'}, served_name: dsv4-demo}}
runtime: {{kind: docker, image: "fake/vllm:test", container_name: {name}}}
vllm: {{port: {port}}}
gates:
  timeouts: {{stall_s: 3, total_s: 60, ready_s: 20, shutdown_grace_s: 2}}
""")
    (tmp_path / "model").mkdir()
    env = {"PATH": f"{FAKES}{os.pathsep}{os.environ['PATH']}", "FAKE_DOCKER_DIR": str(ddir)}

    class F:
        pass

    f = F()
    f.home, f.dir, f.name, f.port, f.profile, f.env = home, ddir, name, port, str(prof), env

    def run(*args, scenario="ok", timeout=120):
        return cli(*args, home=home, timeout=timeout, env_extra={**env, "FAKE_DOCKER_SCENARIO": scenario})

    def calls():
        p = ddir / "calls.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []

    f.run, f.calls = run, calls
    return f


def test_docker_seat_up_json_events_status_and_down(fake):
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    events = json_lines(r.stdout)
    assert all(isinstance(e, dict) and "event" in e for e in events)  # nothing but JSON lines on stdout
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "ready" and "spawn" in kinds and "readiness" in kinds
    assert {e["rank"] for e in events if e["event"] == "marker"} == {0, 1}  # by distinct rank
    assert next(e for e in events if e["event"] == "kv")["tokens"] == 4096
    ready = events[-1]
    assert ready["markers"] == {"dsv4serve plugin ready": [0, 1]} and ready["canary_tokens"] == 2
    run_argv = next(c for c in fake.calls() if c[0] == "run")
    assert run_argv[run_argv.index("--name") + 1] == fake.name
    assert f"127.0.0.1:{fake.port}:8000" in run_argv
    run_id = ready["run_id"]
    assert f"DSV4SERVE_RUN_ID={run_id}" in run_argv  # the run tag travels into the container
    st = json.loads(fake.run("status", "--profile", fake.profile, "--json").stdout)[0]
    assert st["phase"] == "ready" and st["runtime"] == "docker" and st["health"]
    # a second up of the running seat is refused before anything starts
    r2 = fake.run("up", "--profile", fake.profile, "--skip-checks")
    assert r2.returncode == 2 and "already running" in r2.stderr
    d = fake.run("down", "--profile", fake.profile, "--json")
    assert d.returncode == 0, d.stdout + d.stderr
    rep = json.loads(d.stdout)
    assert rep["clean"]
    docker_calls = [c[:2] for c in fake.calls() if c[0] in ("stop", "rm")]
    assert docker_calls == [["stop", "-t"], ["rm", "-f"]]
    stop_call = next(c for c in fake.calls() if c[0] == "stop")
    assert stop_call == ["stop", "-t", "2", fake.name]  # the profile's grace
    assert_nothing_left(run_id, st["pgid"], fake.port)


def test_stall_names_the_rank_and_phase_and_tears_down(fake):
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", scenario="stall")
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr
    assert "no progress for" in err and "stall limit 3 s" in err
    assert "rank0 stopped in phase 'loading weights'" in err
    diag = Path(err.split("diagnostics: ")[1].split()[0])
    summary = json.loads((diag / "summary.json").read_text())
    assert summary["reason"].startswith("no progress") and (diag / "vllm.log").is_file()
    assert [c[:2] for c in fake.calls() if c[0] in ("stop", "rm")] == [["stop", "-t"], ["rm", "-f"]]
    assert not (fake.dir / f"{fake.name}.json").exists()  # the container is gone
    st = json.loads(fake.run("status", "--profile", fake.profile, "--json").stdout)[0]
    assert st["phase"] == "not running" and st["last_run"]["outcome"] == "failed"


def test_rank_traceback_fails_fast_with_its_last_line(fake):
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--json", scenario="crash")
    assert r.returncode == 1
    failed = json_lines(r.stdout)[-1]
    assert failed["event"] == "failed"
    assert failed["reason"] == "rank 1: KeyError: 'model.layers.0.fake'"
    assert failed["first_errors"] == {"rank1": "KeyError: 'model.layers.0.fake'"}
    assert failed["clean"] and Path(failed["diagnostics"]).is_dir()
    # the fake engine would have taken 30 s to exit: dsv4serve stopped it at the first fatal line
    fatal = next(e for e in json_lines(r.stdout) if e["event"] == "fatal")
    assert fatal["elapsed_s"] < 20


def test_a_fatal_line_just_after_the_canary_fails_the_bring_up(fake):
    """The canary's answer can overtake a rank's last lines (docker relays them through the daemon):
    `up` reads on before calling the seat ready, so a CUDA error printed 1 s after the first
    completion fails the bring-up instead of a seat reported ready over a dead rank."""
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--json", scenario="late")
    assert r.returncode == 1, r.stdout[-2000:]
    events = json_lines(r.stdout)
    assert not any(e["event"] == "ready" for e in events)
    assert any(e["event"] == "readiness" for e in events)  # the canary itself passed
    failed = events[-1]
    assert failed["event"] == "failed" and "illegal memory access" in failed["reason"], failed
    assert failed["clean"]


def test_foreground_watches_on_after_ready_and_fails_on_a_rank_error(fake):
    """`up --foreground` stays attached after ready and keeps reading the bring-up's log from where
    it stopped: a rank's CUDA error 4 s after the canary (past the ready settle) ends the run with
    exit 1, the error named, and the seat stopped clean."""
    r = cli("up", "--profile", fake.profile, "--skip-checks", "--json", "--foreground", home=fake.home,
            timeout=120, env_extra={**fake.env, "FAKE_DOCKER_SCENARIO": "late", "FAKE_DOCKER_LATE_S": "4"})
    assert r.returncode == 1, r.stdout[-2000:]
    events = json_lines(r.stdout)
    assert any(e["event"] == "ready" for e in events)
    failed = events[-1]
    assert failed["event"] == "failed" and failed["reason"].startswith("after ready: ") \
        and "illegal memory access" in failed["reason"], failed
    assert failed["clean"]


@pytest.mark.parametrize("scenario,words", [("request_error", "JSONDecodeError"),
                                             ("request_oom", "MemoryError: Not enough space")])
def test_foreground_survives_one_requests_traceback_and_still_fails_on_a_rank_error(fake, scenario, words):
    """vLLM logs a traceback for one failed request (a tool parser that raised on a stream; a
    multimodal input too big for the API server's shared-memory buffer, a MemoryError, which was
    classified "oom" and stopped the seat) and keeps serving; the attached `up` stopped a healthy
    seat for it. It is judged as status judges a ready seat: the traceback passes, the rank's CUDA
    error 2 s later still ends the run."""
    r = cli("up", "--profile", fake.profile, "--skip-checks", "--json", "--foreground", home=fake.home,
            timeout=120, env_extra={**fake.env, "FAKE_DOCKER_SCENARIO": scenario, "FAKE_DOCKER_LATE_S": "4"})
    assert r.returncode == 1, r.stdout[-2000:]
    events = json_lines(r.stdout)
    assert any(e["event"] == "ready" for e in events)
    assert any(e["event"] == "fatal" and words in e["line"] for e in events)  # seen, and shown
    failed = events[-1]
    assert failed["event"] == "failed" and failed["reason"].startswith("after ready: ") \
        and "illegal memory access" in failed["reason"], failed


def _deaf_container(fake, monkeypatch) -> subprocess.Popen:
    """A fake container whose main process ignores SIGTERM, as a starting vLLM does; returned once
    its ranks are loading (so the SIGTERM handler is already ignored). stop.py finds the fake CLI
    through PATH, as it would the real one."""
    monkeypatch.setenv("PATH", fake.env["PATH"])
    monkeypatch.setenv("FAKE_DOCKER_DIR", fake.env["FAKE_DOCKER_DIR"])
    argv = ["docker", "run", "--rm", "--name", fake.name, "-p", f"127.0.0.1:{fake.port}:8000", "fake/vllm:test",
            "--served-model-name", "dsv4-demo", "--tensor-parallel-size", "2"]
    run = subprocess.Popen(argv, env={**os.environ, "FAKE_DOCKER_SCENARIO": "deaf"}, stdout=subprocess.PIPE,
                           stdin=subprocess.DEVNULL, text=True)
    for line in run.stdout:  # EOF (a crashed fake) ends the loop and fails the assert below
        if line.startswith("(Worker_TP1") and "Starting to load model" in line:
            break
    assert run.poll() is None, "the fake container did not start"
    return run


def test_second_ctrl_c_escalates_docker_stop_to_docker_kill(fake, monkeypatch):
    run = _deaf_container(fake, monkeypatch)
    try:
        t0 = time.monotonic()
        second_ctrl_c = lambda: time.monotonic() - t0 > 1.0  # noqa: E731 - the user presses again after 1 s
        rep = stop.stop_container(fake.name, grace=60, escalate=second_ctrl_c)
        elapsed = time.monotonic() - t0
        assert run.wait(timeout=10) == -9  # SIGKILLed: SIGTERM alone would never have ended it
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=10)
        run.stdout.close()
    assert 1.0 <= elapsed < 15, elapsed  # not the 60 s grace
    assert [c[:1] for c in fake.calls() if c[0] != "run"] == [["stop"], ["kill"], ["rm"]]
    assert [r["argv"] for r in rep] == [["docker", "stop", "-t", "60", fake.name], ["docker", "kill", fake.name],
                                        ["docker", "rm", "-f", fake.name]]
    assert all(r["rc"] == 0 for r in rep), rep
    assert not (fake.dir / f"{fake.name}.json").exists()


def test_docker_stop_without_escalation_waits_the_grace(fake, monkeypatch):
    run = _deaf_container(fake, monkeypatch)
    try:
        t0 = time.monotonic()
        rep = stop.stop_container(fake.name, grace=1, escalate=lambda: False)
        elapsed = time.monotonic() - t0
        assert run.wait(timeout=10) == -9  # the engine's own SIGKILL after the grace
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=10)
        run.stdout.close()
    assert elapsed >= 1.0
    assert [c[0] for c in fake.calls() if c[0] != "run"] == ["stop", "rm"]
    assert [r["rc"] for r in rep] == [0, 0]


def test_a_container_of_the_same_name_but_another_seat_is_never_stopped(fake, tmp_path):
    """Every docker seat defaults to container_name dsv4: `down` of a stale seat B stopped and removed
    seat A's running container, and `up` of B called it B's (helper audit). The run-id label `up`
    gives each container now decides whose it is."""
    from dsv4serve import state

    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--no-validate")
    assert r.returncode == 0, r.stdout + r.stderr
    other = tmp_path / "seat-b.yaml"
    other.write_text(Path(fake.profile).read_text().replace("name: fake-docker", "name: seat-b")
                     .replace(f"port: {fake.port}", f"port: {ports.free_port()}"))
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale_b = state.SeatState(seat="seat-b", run_id="seat-b-20250101-000000-abcd", profile="seat-b",
                              profile_digest="x", runtime="docker", container_name=fake.name, argv=["docker"], env={},
                              host="127.0.0.1", port=1, served_name="m", tp=1, run_dir=str(tmp_path),
                              log_path=str(tmp_path / "b.log"), phase="ready", pid=gone.pid, start_time=1.0)
    os.environ["DSV4SERVE_HOME"], old = str(fake.home), os.environ.get("DSV4SERVE_HOME")
    try:
        state.save(stale_b)
    finally:
        os.environ.pop("DSV4SERVE_HOME") if old is None else os.environ.__setitem__("DSV4SERVE_HOME", old)
    n = len(fake.calls())
    d = fake.run("down", "--profile", str(other), "--json")
    assert d.returncode == 0, d.stdout + d.stderr
    rep = json.loads(d.stdout)["seats"][0]
    assert rep["docker"] == [] and rep["container_other"].startswith("run fake-docker-")
    assert not [c for c in fake.calls()[n:] if c[0] in ("stop", "rm", "kill")]
    st = json.loads(fake.run("status", "--profile", fake.profile, "--json").stdout)[0]
    assert st["phase"] == "ready", st
    r = fake.run("up", "--profile", str(other), "--skip-checks", "--no-validate")
    assert r.returncode == 2 and f"container {fake.name} belongs to seat fake-docker" in r.stderr, r.stderr
    assert "`dsv4serve down --profile fake-docker`" in r.stderr
    assert fake.run("down", "--profile", fake.profile).returncode == 0


def test_a_warning_of_the_docker_cli_is_not_read_as_the_containers_labels(fake, tmp_path):
    """docker prints its own warnings (an unreadable ~/.docker/config.json) on stderr: the label
    check read one as the run id, so status called a running container gone and down skipped it
    and said clean (review)."""
    shim = tmp_path / "warnbin"
    shim.mkdir()
    (shim / "docker").write_text(f"#!/bin/sh\necho 'WARNING: Error loading config file: /root/.docker/config.json' >&2\n"
                                 f"exec {FAKES}/docker \"$@\"\n")
    (shim / "docker").chmod(0o755)
    env = {**fake.env, "PATH": f"{shim}{os.pathsep}{fake.env['PATH']}"}
    r = cli("up", "--profile", fake.profile, "--skip-checks", "--no-validate", home=fake.home, timeout=120,
            env_extra=env)
    assert r.returncode == 0, r.stdout + r.stderr
    st = json.loads(cli("status", "--profile", fake.profile, "--json", home=fake.home, timeout=60,
                        env_extra=env).stdout)[0]
    assert st["phase"] == "ready", st
    d = cli("down", "--profile", fake.profile, "--json", home=fake.home, timeout=120, env_extra=env)
    rep = json.loads(d.stdout)["seats"][0]
    assert d.returncode == 0 and "container_other" not in rep and [c["argv"][1] for c in rep["docker"]] == ["stop", "rm"]


def test_a_container_a_finished_run_left_is_named_for_docker_rm_not_for_down(fake):
    """A labelled container whose run is no seat's any more: the hint sent the user to a `down` that
    had nothing to stop, and up refused again (review)."""
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--no-validate")
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads((fake.dir / f"{fake.name}.json").read_text())
    assert fake.run("down", "--profile", fake.profile).returncode == 0
    (fake.dir / f"{fake.name}.json").write_text(json.dumps(rec))  # the container record comes back, exited
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--no-validate")
    assert r.returncode == 2 and f"docker rm -f {fake.name}" in r.stderr, r.stderr


def test_a_running_container_of_a_seat_in_another_home_is_never_called_removable(fake, tmp_path):
    """Another user's (or another DSV4SERVE_HOME's) live seat holds the name: up told this user to
    `docker rm -f` it, since this home has no state of that run (review)."""
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--no-validate")
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        other = cli("up", "--profile", fake.profile, "--skip-checks", "--no-validate", "--set",
                    f"vllm.port={ports.free_port()}", home=tmp_path / "home2", timeout=120, env_extra=fake.env)
        assert other.returncode == 2 and f"container {fake.name} belongs to seat fake-docker" in other.stderr
        assert "docker rm -f" not in other.stderr and "stop that seat where it was started" in other.stderr
    finally:
        assert fake.run("down", "--profile", fake.profile).returncode == 0


def test_a_container_that_exited_is_a_stale_seat_not_a_running_one(fake):
    """A crash, an OOM kill or a reboot leaves the container exited, not removed: up said the seat was
    "already running" while status said failed (audit). Now up clears the stale run, removing the
    exited container, and starts."""
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--no-validate")
    assert r.returncode == 0, r.stdout + r.stderr
    first = json.loads(fake.run("status", "--profile", fake.profile, "--json").stdout)[0]
    k = subprocess.run(["docker", "kill", fake.name], env={**os.environ, **fake.env}, capture_output=True, timeout=30)
    assert k.returncode == 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = json.loads(fake.run("status", "--profile", fake.profile, "--json").stdout)[0]
        if st["phase"] == "failed" or not st.get("alive", True):
            break
        time.sleep(0.2)
    assert json.loads((fake.dir / f"{fake.name}.json").read_text())  # the exited container's record stays
    n = len(fake.calls())
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--no-validate")
    try:
        assert r.returncode == 0 and "already running" not in r.stderr, r.stdout + r.stderr
        assert "clearing the stale state" in r.stdout
        assert ["rm", "-f", fake.name] in fake.calls()[n:]  # the exited container went before the new run
    finally:
        assert fake.run("down", "--profile", fake.profile).returncode == 0
    assert_nothing_left(first["run_id"], first["pgid"], fake.port)


def test_an_image_named_like_the_container_does_not_hide_that_the_container_is_gone(fake):
    """`docker inspect NAME` without --type answers for an image of that name once the container is
    gone; the container template fails on it, and down reported the seat not clean while every later
    up refused: "docker could not say" (docker audit). The inspect names the container type now."""
    fake.env["FAKE_DOCKER_IMAGES"] = fake.name  # e.g. an image tagged like the default container name
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--no-validate")
    assert r.returncode == 0, r.stdout + r.stderr
    st = json.loads(fake.run("status", "--profile", fake.profile, "--json").stdout)[0]
    d = fake.run("down", "--profile", fake.profile, "--json")
    assert d.returncode == 0 and json.loads(d.stdout)["clean"], d.stdout + d.stderr
    assert all(c[:3] == ["inspect", "--type", "container"] for c in fake.calls() if c[0] == "inspect")
    assert_nothing_left(st["run_id"], st["pgid"], fake.port)


def test_a_missing_mount_source_is_refused_before_docker_would_create_it(fake, tmp_path):
    """`docker run -v` makes a missing source an empty root-owned directory: an empty pack for vLLM,
    or a directory where the lna2 build goes that blocks every later `kernel build` (docker audit).
    up refuses it, --skip-checks or not, before anything starts."""
    gone = tmp_path / "not-downloaded"
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--no-validate", "--set",
                 f'runtime.mounts=[{{"host": "{gone}", "container": "/data/pack", "read_only": true}}]')
    assert r.returncode == 2 and f"docker mount source {gone} does not exist" in r.stderr, r.stdout + r.stderr
    assert not [c for c in fake.calls() if c[0] == "run"] and not gone.exists()


def test_a_missing_writable_mount_source_is_made_as_this_user(fake, tmp_path):
    """The canon profile mounts caches under {cache} that nothing makes before the first up: refusing
    them (review) would keep the seat from ever starting; they are made as this user, as docker would
    have made them (as root)."""
    cache = fake.home / "cache" / "exl3-tune-cache"  # {cache}/exl3-tune-cache, as the canon profile has it
    elsewhere = tmp_path / "conf" / "app.json"  # writable but not dsv4serve's: a file the user meant to make
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--no-validate", "--set",
                 f'runtime.mounts=[{{"host": "{elsewhere}", "container": "/etc/app.json"}}]')
    assert r.returncode == 2 and f"docker mount source {elsewhere} does not exist" in r.stderr, r.stderr
    assert not elsewhere.exists() and not elsewhere.parent.exists()
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--no-validate", "--set",
                 'runtime.mounts=[{"host": "{cache}/exl3-tune-cache", "container": "/lab/exl3-tune-cache"}]')
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert cache.is_dir() and cache.stat().st_uid == os.getuid()
    finally:
        assert fake.run("down", "--profile", fake.profile).returncode == 0


def test_a_canary_answer_without_the_expected_text_fails_the_bring_up_and_names_the_answer(fake):
    """Tokens alone passed readiness: a seat emitting garbage (a wrong quant, a kernel computing
    nonsense) came up READY. The fake engine answers "ok ok"; a profile expecting "ready" must stop
    the seat, say what it answered, and leave nothing behind."""
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--json", "--set", "gates.canary.expect=(?i)ready")
    assert r.returncode == 1, r.stdout + r.stderr
    failed = json_lines(r.stdout)[-1]
    assert failed["event"] == "failed" and failed["clean"]
    assert failed["reason"] == ("readiness: canary answered 'ok ok' (2 token(s), finish_reason 'length'), which does "
                                "not match gates.canary.expect /(?i)ready/"), failed
    assert "fix gates.canary.expect" in failed["hint"] and "check-seat" in failed["hint"]
    assert not (fake.dir / f"{fake.name}.json").exists()  # the container is gone
    st = json.loads(fake.run("status", "--profile", fake.profile, "--json").stdout)[0]
    assert st["phase"] == "not running" and st["last_run"]["outcome"] == "failed"


def test_a_canary_answer_with_the_expected_text_is_ready_and_says_what_it_matched(fake):
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--set", "gates.canary.expect=^ok\\b")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "canary 2 tokens matching /^ok\\b/" in " ".join(r.stdout.split())
    finally:
        assert fake.run("down", "--profile", fake.profile).returncode == 0


def test_down_with_an_unreadable_state_stops_the_seats_container(fake):
    """A docker seat whose state file was lost (truncated by a full disk, a hand edit): down stopped
    only tagged processes, said clean, and the container kept serving with no dsv4serve command
    able to stop it (helper audit). The container its run was given is stopped by its run label."""
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    run_id = json_lines(r.stdout)[-1]["run_id"]
    path = Path(fake.home) / "seats" / "fake-docker" / "state.json"
    path.write_text(path.read_text()[:200])  # truncated
    # a rendezvous file its log names: removed as a readable state's down removes it (review)
    hexid = f"{os.getpid():08x}{time.time_ns() % 16**8:08x}"
    log = Path(fake.home) / "runs" / run_id / "vllm.log"
    with open(log, "a") as f:
        f.write(f"(Worker_TP0 pid=7) INFO world_size=2 rank=0 distributed_init_method=file:///tmp/vllm_dist_{hexid} "
                "backend=gloo\n")
    dist = Path(f"/dev/shm/vllm_dist_{hexid}-tp:0-0-1-cpushm_0")
    dist.write_bytes(b"x")
    try:
        d = fake.run("down", "--profile", fake.profile, "--json")
    finally:
        left = dist.exists()
        dist.unlink(missing_ok=True)
    assert d.returncode == 0, d.stdout + d.stderr
    rep = json.loads(d.stdout)["seats"][0]
    assert rep["unreadable_state"] and rep["clean"] and rep["run_id"] == run_id, rep
    assert rep["containers_stopped"] == [f"{fake.name} (run {run_id})"] and rep["containers_left"] == []
    assert not left and str(dist) in rep["leftovers_removed"], rep
    assert ["stop", "-t", "5", fake.name] in fake.calls()
    assert not (fake.dir / f"{fake.name}.json").exists()  # the container is gone
    assert_nothing_left(run_id, None, fake.port)


def test_down_with_an_unreadable_state_is_not_clean_when_docker_cannot_say_about_the_container(fake, tmp_path):
    """With the daemon down nothing is stopped on a guess, and the verdict says so (exit 1)."""
    r = fake.run("up", "--profile", fake.profile, "--skip-checks", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    path = Path(fake.home) / "seats" / "fake-docker" / "state.json"
    path.write_text("{")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon at "
                                    "unix:///var/run/docker.sock. Is the docker daemon running?' >&2\nexit 1\n")
    (bin_dir / "docker").chmod(0o755)
    try:
        d = cli("down", "--profile", fake.profile, "--json", home=fake.home, timeout=120,
                env_extra={**fake.env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
        rep = json.loads(d.stdout)["seats"][0]
        assert d.returncode == 1 and not rep["clean"] and rep["containers_stopped"] == [], d.stdout + d.stderr
        assert rep["containers_left"] == [f"{fake.name} (docker cannot say: Cannot connect to the Docker daemon at "
                                          "unix:///var/run/docker.sock. Is the docker daemon running?)"], rep
        # the state is kept, so the next down (docker back) stops it: it was set aside, and the next
        # down found nothing to stop while the container served on (review)
        assert rep["set_aside"] is None and path.read_text() == "{"
        d = fake.run("down", "--profile", fake.profile, "--json")
        rep = json.loads(d.stdout)["seats"][0]
        assert d.returncode == 0 and rep["clean"] and rep["containers_stopped"], d.stdout + d.stderr
        assert rep["set_aside"] and not path.exists()
    finally:  # the fake docker removes what is left
        subprocess.run([str(FAKES / "docker"), "rm", "-f", fake.name], env={**os.environ, **fake.env},
                       capture_output=True, timeout=60)
    assert not (fake.dir / f"{fake.name}.json").exists()
