"""`up` whose own output goes away, or that is stopped by a signal, still tears its seat down.

The seat is the fake Docker CLI of tests/fakes/docker (the `fake` fixture of test_supervisor_docker):
these cases are about what `up` does with its stdout and its signals, which a real vLLM would only
make minutes slower. Its "stall" scenario loads and then waits, so nothing but the test ends the
bring-up (the stall limit is raised out of the way); a line the test appends to the run's log is the
event that makes `up` write after its reader has gone.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from .conftest import DSV4SERVE, FAKES, assert_nothing_left, load_state
from .test_supervisor_docker import fake  # noqa: F401 - the fixture

MARKER_LINE = ("(Worker_TP0 pid=100) INFO 12-02 19:04:17 [fake.py:1] dsv4serve plugin ready rank=0/2 moe_layers=1 "
               "moe_method=UnquantizedFusedMoEMethod kernel=incumbent\n")


@pytest.fixture(autouse=True)
def no_container_left(fake):  # noqa: F811
    """A run that failed this test's assertions may have left its fake container running."""
    yield
    subprocess.run([str(FAKES / "docker"), "rm", "-f", fake.name], env={**os.environ, **fake.env},
                   capture_output=True, timeout=60)


def start_up(fake, *extra: str, scenario: str = "stall", **popen) -> subprocess.Popen:  # noqa: F811
    env = {**os.environ, "DSV4SERVE_HOME": str(fake.home), **fake.env, "FAKE_DOCKER_SCENARIO": scenario}
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    # up keeps a SIGHUP its parent ignores (nohup): these tests send it one, so it starts with the default
    # whatever the suite was started under
    popen.setdefault("preexec_fn", lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    return subprocess.Popen([*DSV4SERVE, "up", "--profile", fake.profile, "--skip-checks", "--no-validate",
                             "--set", "gates.timeouts.stall_s=120", *extra], env=env, stdin=subprocess.DEVNULL,
                            text=True, **popen)


@contextmanager
def reaped(p: subprocess.Popen):
    """The `up` under test, killed and reaped if an assertion leaves it running."""
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def read_until(p: subprocess.Popen, needle: str, timeout: float = 60) -> list[str]:
    lines: list[str] = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        ln = p.stdout.readline()
        if not ln:
            break
        lines.append(ln)
        if needle in ln:
            return lines
    raise AssertionError(f"{needle!r} never came: {''.join(lines)}{p.stderr.read() if p.poll() is not None else ''}")


def spawn_info(lines: list[str]) -> tuple[str, Path]:
    """run id and log path of the run, from the spawn line (plain or JSON)."""
    for ln in lines:
        if ln.startswith("{"):
            e = json.loads(ln)
            if e.get("event") == "spawn":
                return e["run_id"], Path(e["log"])
        elif "started run " in ln:
            run_id = ln.split("started run ", 1)[1].split(":", 1)[0]
            return run_id, Path(ln.rsplit("log ", 1)[1].strip())
    raise AssertionError(lines)


def assert_seat_gone(fake, run_id: str) -> dict:  # noqa: F811
    assert_nothing_left(run_id, None, fake.port)
    assert not (fake.dir / f"{fake.name}.json").exists()  # the container was removed
    assert load_state(fake.home, "fake-docker") is None
    last = json.loads((fake.home / "seats" / "fake-docker" / "last.json").read_text())
    assert last["run_id"] == run_id and last["clean"], last
    return last


def test_a_closed_stdout_mid_bring_up_stops_the_seat_and_says_so_on_stderr(fake):  # noqa: F811
    """`up ... | head -4`: the reader quits, the next event cannot be written. `up` used to exit 1
    without a word (rich answers EPIPE with SystemExit) and leave the seat starting, unwatched."""
    for extra in ((), ("--json",)):
        with reaped(start_up(fake, *extra)) as p:
            lines = read_until(p, "started run " if not extra else '"event":"spawn"')
            run_id, log = spawn_info(lines)
            p.stdout.close()  # the reader is gone
            with open(log, "a") as f:  # progress: an event `up` has to write
                f.write(MARKER_LINE)
            err = p.stderr.read()
            assert p.wait(timeout=60) == 1, err
        assert "Traceback" not in err, err
        assert "FAILED seat fake-docker" in err and "stdout went away (Broken pipe" in err, err
        assert "nothing left" in err, err
        last = assert_seat_gone(fake, run_id)
        assert last["outcome"] == "failed" and "stdout went away" in last["reason"]


def test_sighup_after_the_reader_left_still_stops_the_seat_and_exits_129(fake):  # noqa: F811
    """The stopping line of the teardown hit the dead pipe before the stop: exit 1, the processes
    running and the state stuck in `stopping` while /health answered."""
    with reaped(start_up(fake)) as p:
        lines = read_until(p, "rank 1: loading weights")  # every event of the fake's start is out
        run_id, _ = spawn_info(lines)
        p.stdout.close()
        p.send_signal(signal.SIGHUP)
        err = p.stderr.read()
        assert p.wait(timeout=60) == 129, err
    assert "Traceback" not in err and "interrupted by SIGHUP" in err, err
    last = assert_seat_gone(fake, run_id)
    assert "SIGHUP" in last["reason"] and "Ctrl-C" not in last["reason"], last


def test_sigterm_during_bring_up_is_named_and_exits_143(fake):  # noqa: F811
    with reaped(start_up(fake)) as p:
        run_id, _ = spawn_info(read_until(p, "started run "))
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert "interrupted by SIGTERM: the seat was not ready" in err and "Ctrl-C" not in err, err
    last = assert_seat_gone(fake, run_id)
    assert last["reason"] == "interrupted by SIGTERM: the seat was not ready", last


def test_foreground_on_a_terminal_that_closes_stops_the_seat(fake):  # noqa: F811
    """`up --foreground` in a terminal that goes away: its stop line raised EIO after the seat was
    marked stopping, so the seat ran on and every later `up` was refused "already running"."""
    master, slave = os.openpty()
    p = start_up(fake, "--foreground", scenario="ok", stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    seen = b""
    with reaped(p):
        try:
            deadline = time.time() + 60
            while b"attached:" not in seen:
                assert time.time() < deadline and p.poll() is None, seen.decode(errors="replace")
                if select.select([master], [], [], 0.5)[0]:
                    seen += os.read(master, 65536)
            st = load_state(fake.home, "fake-docker")
            assert st is not None and st.phase == "ready"
            os.close(master)  # the terminal is gone: every write to it fails with EIO
            master = None
            p.send_signal(signal.SIGHUP)  # what the kernel sends the session of a closed terminal
            assert p.wait(timeout=60) == 0
        finally:
            if master is not None:
                os.close(master)
    last = assert_seat_gone(fake, st.run_id)
    assert last["outcome"] == "stopped" and last["reason"].startswith("stopped by SIGHUP"), last


def test_foreground_stopped_by_down_is_not_a_failure_when_the_ranks_die_first(fake):  # noqa: F811
    """Real vLLM's ranks raise and exit the moment `down` signals them, so the attached `up` can see the
    death before its next look at the state: that is still `down`'s stop (exit 0, said so), not
    "stopped before the seat was ready" with exit 1 (found with real vLLM on the CPU seat)."""
    for extra in ((), ("--json",)):
        with reaped(start_up(fake, "--foreground", *extra, scenario="brittle")) as p:
            lines = read_until(p, "attached:" if not extra else '"event":"ready"')
            run_id, _ = spawn_info(lines)
            d = fake.run("down", "--profile", fake.profile, "--json", scenario="brittle")
            assert d.returncode == 0, d.stdout + d.stderr
            out, err = p.communicate(timeout=60)
        assert p.returncode == 0, out[-2000:] + err
        assert "before the seat was ready" not in out + err, out[-2000:] + err
        if extra:
            last = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")][-1]
            assert last["event"] == "stopped" and last["by"] == "down", last
        else:
            assert "seat fake-docker stopped by `dsv4serve down`; the stop report is down's" in out, out[-2000:]
        assert_seat_gone(fake, run_id)


def test_foreground_stopped_by_down_says_so_and_exits_0(fake):  # noqa: F811
    """`up --foreground` that `dsv4serve down` stops: the attached `up` used to exit 0 without a
    word, so the terminal it held showed nothing about why it ended. It names `down` now (a line for
    humans, a `stopped` event with `by: down` for --json) and leaves the teardown's report to it."""
    for extra in ((), ("--json",)):
        with reaped(start_up(fake, "--foreground", *extra, scenario="ok")) as p:
            lines = read_until(p, "attached:" if not extra else '"event":"ready"')
            run_id, _ = spawn_info(lines)
            d = fake.run("down", "--profile", fake.profile, "--json")
            assert d.returncode == 0, d.stdout + d.stderr
            out, err = p.communicate(timeout=60)
        assert p.returncode == 0, out[-2000:] + err
        assert "Traceback" not in out + err, out + err
        if extra:
            last = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")][-1]
            assert last["event"] == "stopped" and last["by"] == "down", last
            assert last["reason"] == "stopped by `dsv4serve down`", last
        else:
            assert "seat fake-docker stopped by `dsv4serve down`; the stop report is down's" in out, out[-2000:]
        assert_seat_gone(fake, run_id)


def test_sigterm_before_the_launch_is_one_line_and_exits_143(tmp_path):
    """Before vLLM starts (the checks, the demo model, vLLM's parser check) a SIGTERM used to end `up`
    with exit 143 and not a word; it is one line now, and nothing is left (real CPU seat profile; the
    signal lands while vLLM's parser is imported, which takes seconds)."""
    from dsv4serve import ports

    home = tmp_path / "home"
    env = {**os.environ, "DSV4SERVE_HOME": str(home)}
    p = subprocess.Popen([*DSV4SERVE, "up", "--profile", "cpu-demo", "--set", f"vllm.port={ports.free_port()}",
                          "--skip-checks", "--json"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        with reaped(p):
            read_until(p, '"event":"checks"', timeout=240)  # next: the parser check, then the launch
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=60)
    finally:
        # a seat launched in spite of the signal (the bug this test guards) must not outlive it
        subprocess.run([*DSV4SERVE, "down", "--profile", "cpu-demo"], env=env, capture_output=True, timeout=120)
    assert p.returncode == 143, out[-2000:] + err
    errs = [ln for ln in err.splitlines() if ln.strip()]
    assert len(errs) == 1 and "up stopped by SIGTERM before vLLM was started; nothing was started" in errs[0], err
    last = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")][-1]
    assert last["event"] == "error" and last["exit_code"] == 143, last
    assert load_state(home, "cpu-demo") is None
    assert not [ln for ln in out.splitlines() if '"event":"spawn"' in ln]
