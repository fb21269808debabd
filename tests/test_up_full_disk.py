"""A full disk while a seat runs: `up` stops the seat it can no longer record, `down` still stops one.

The disk is a fake: the CLI runs through SHIM, which makes the state module's atomic_write fail with
ENOSPC once the test creates a flag file. A real full filesystem needs a mount (root, a tmpfs of its
own) that a test run cannot count on, and filling a shared disk would fail everything beside it; the
code under test sees the very OSError a full disk raises, at the write that hit it in the audit
(state.update during bring-up, mark_stopping in `down`). The seat of the `up` case is the fake Docker
CLI of tests/fakes/docker (the `fake` fixture), as bring-up on real vLLM takes minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import psutil

from dsv4serve import state

from .conftest import FAKES, assert_nothing_left, load_state
from .test_state import make
from .test_supervisor_docker import fake  # noqa: F401 - the fixture
from .test_up_output_and_signals import MARKER_LINE, read_until, reaped, spawn_info

SHIM = """
import errno, os, sys
from dsv4serve import state
_write = state.atomic_write
def atomic_write(path, *a, **k):
    if os.path.exists(os.environ["FULL_DISK_FLAG"]):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _write(path, *a, **k)
state.atomic_write = atomic_write
sys.argv[0] = "dsv4serve"
from dsv4serve.cli import main
main()
"""


def shim_cli(*args: str, flag, home, env_extra=None, **popen) -> subprocess.Popen:
    env = {**os.environ, "DSV4SERVE_HOME": str(home), "FULL_DISK_FLAG": str(flag), **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-c", SHIM, *args], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_a_full_disk_during_bring_up_stops_the_seat_with_one_line(fake, tmp_path):  # noqa: F811
    """`up` crashed with a traceback at the state write and left the seat running, state `starting`."""
    flag = tmp_path / "disk-full"
    p = shim_cli("up", "--profile", fake.profile, "--skip-checks", "--no-validate", "--set",
                 "gates.timeouts.stall_s=120", flag=flag, home=fake.home,
                 env_extra={**fake.env, "FAKE_DOCKER_SCENARIO": "stall"})
    try:
        with reaped(p):
            lines = read_until(p, "rank 1: loading weights")
            run_id, log = spawn_info(lines)
            assert load_state(fake.home, "fake-docker").phase == "starting"
            flag.touch()  # the disk is full from now on
            with open(log, "a") as f:  # a marker: the next state write of the bring-up
                f.write(MARKER_LINE)
            out, err = p.communicate(timeout=60)
    finally:
        subprocess.run([str(FAKES / "docker"), "rm", "-f", fake.name], env={**os.environ, **fake.env},
                       capture_output=True, timeout=60)
    assert p.returncode == 1, out + err
    assert "Traceback" not in err, err
    assert "could not write the seat's state" in err and "No space left on device" in err, err
    assert "df -h" in err and "nothing left" in err, err
    assert_nothing_left(run_id, None, fake.port)
    assert not (fake.dir / f"{fake.name}.json").exists()  # the container is gone
    assert load_state(fake.home, "fake-docker") is None  # no `starting` state of a seat that is not there


def test_down_on_a_full_disk_still_stops_the_seat(tmp_path, monkeypatch):
    """`down` failed writing `stopping` before it sent any signal, so it could not stop the seat
    (and its record of the stop, written after it, failed the same way)."""
    home = tmp_path / "home"
    monkeypatch.setenv("DSV4SERVE_HOME", str(home))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    threading.Thread(target=child.wait, daemon=True).start()  # its `up` would reap it
    flag = tmp_path / "disk-full"
    try:
        state.save(make(tp=1, pid=child.pid, pgid=child.pid, start_time=psutil.Process(child.pid).create_time()))
        flag.touch()
        p = shim_cli("down", "--profile", "cpu-demo", "--json", flag=flag, home=home)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, out + err
        assert "Traceback" not in err, err
        seat = json.loads(out)["seats"][0]
        assert child.pid in [s["pid"] for s in seat["signalled"]] and seat["clean"], seat
        assert child.wait(timeout=10) is not None
        assert state.load("cpu-demo") is None
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
