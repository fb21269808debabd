"""Find, signal and wait for the processes of one run, never by name.

A run's processes are found two ways, and the union is taken:
- its process group: `up` starts vLLM in a new session, so API server, resource tracker,
  EngineCore and workers share the pgid of the main pid. The group is used only while it is
  provably still ours: its leader is our recorded process (pid and start time);
- the `DSV4SERVE_RUN_ID` tag in their environment, which every descendant inherits, including
  ones that left the group (setsid) or were orphaned by a SIGKILL of the main process.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil

from dsv4serve.launch import PLUGIN_ENV_RUN_DIR as RUN_DIR_ENV
from dsv4serve.state import RUN_ID_ENV, SeatState, liveness


def _mine_or_above(pgid: int) -> bool:
    """Whether `pgid` is this process's, its group's or an ancestor's (a shell, a test runner): a state
    file, however it reads, never makes down signal those (review)."""
    try:
        return pgid in (os.getpid(), os.getpgrp()) or pgid in {p.pid for p in psutil.Process().parents()}
    except psutil.Error:
        return True


def group_is_ours(st: SeatState) -> bool:
    """The recorded group, only while its leader is our recorded process (pid and start time; running
    or a zombie not yet reaped, which keeps its number). Once the leader is gone its number is free:
    a new session whose leader exits (`sh -c 'x &'`, a double-forked daemon) can own it within the
    same boot, and killpg reached that stranger's group (helper audit, a real pid wrap at pid_max
    32768). The run's surviving processes carry its tag (SPT_NOENV keeps it readable), and the
    ranks the log named are found by pid (_recorded_members)."""
    if st.pgid is None or st.runtime != "native" or st.pgid != st.pid or st.start_time is None \
            or _mine_or_above(st.pgid):
        return False
    try:  # a zombie leader still holds the number (and the stop reports it)
        return abs(psutil.Process(st.pgid).create_time() - st.start_time) <= 1.0  # NaN compares False
    except psutil.Error:
        return False


def _recorded_members(st: SeatState) -> list[psutil.Process]:
    """With the recorded leader gone: the processes still in its group whose pid the run's log named
    (a rank's, the engine's) with the start time recorded then. A vLLM worker's run tag is unreadable
    once it sets its title (setproctitle writes over /proc/PID/environ: seats started before
    SPT_NOENV=1, or a child that clears it), so the tag alone missed them; the group alone took a
    stranger's whose leader had exited (a pid wrap)."""
    # only when the leader is gone: a recorded pid now another process's ("reused") says the
    # recorded pids are not the run's any more, and a group other than the leader's was never ours
    if st.pgid is None or st.runtime != "native" or st.pgid != st.pid or liveness(st) != "gone" \
            or _mine_or_above(st.pgid):
        return []
    out = []
    for pid in {p for p in (*st.rank_pids.values(), st.engine_pid) if p}:
        try:
            p = psutil.Process(pid)
            # the start time read when the log named it: a pid (and group number) a stranger took
            # after a wrap or a reboot has another (review); a state without it proves nothing
            if _pgid(pid) == st.pgid and pid in st.pid_starts and \
                    abs(p.create_time() - st.pid_starts[pid]) <= 1.0:
                out.append(p)
        except psutil.Error:
            continue
    return out


def _began(st: SeatState) -> float:
    """When the run began: its main process's start, else the state's own stamp."""
    return st.start_time if st.start_time is not None else st.started_at


def _born_in_run(p: psutil.Process, st: SeatState) -> bool:
    """A process created before the run began cannot be one of its processes, whatever its group
    (a group whose number the run's leader once had)."""
    try:
        return p.create_time() >= _began(st) - 1.0
    except psutil.Error:
        return False


def is_tagged(pid: int, st: SeatState) -> bool:
    """pid is a live process carrying this run's tag: a recorded pid (a rank's, the main one)
    proves nothing by itself once its process may have ended and the number been reused."""
    try:
        return psutil.Process(pid).environ().get(RUN_ID_ENV) == st.run_id
    except (psutil.Error, OSError):
        return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _environs() -> Iterator[tuple[psutil.Process, dict[str, str]]]:
    """Every other process whose environment we may read, with it (the run tags live there)."""
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            yield p, p.environ()
        except (psutil.Error, OSError):
            continue  # gone, or not ours to read (then not ours to kill either)


def tagged(run_id: str) -> list[psutil.Process]:
    return [p for p, env in _environs() if env.get(RUN_ID_ENV) == run_id]


def run_id_pattern(seat: str) -> re.Pattern[str]:
    """A run id of this seat, to match whole: `<seat>-YYYYmmdd-HHMMSS-<4 hex>` (seat._run_id)."""
    return re.compile(rf"{re.escape(seat)}-\d{{8}}-\d{{6}}-[0-9a-f]{{4}}")


def tagged_runs(seat: str, runs_dir: Path) -> dict[str, list[psutil.Process]]:
    """Running processes tagged with any run of this seat, by run id: what a seat whose state file
    is unreadable may have left. Run ids are `<seat>-YYYYmmdd-HHMMSS-<4 hex>` (seat._run_id), matched
    whole, so seat `cpu` never claims a run of seat `cpu-demo`; and the run's directory (the
    plugin's DSV4SERVE_RUN_DIR tag) must be under `runs_dir`, so another state dir's seat of the same
    name (another user's, a test's) is never touched."""
    run_of = run_id_pattern(seat)
    out: dict[str, list[psutil.Process]] = {}
    for p, env in _environs():
        tag, run_dir = env.get(RUN_ID_ENV), env.get(RUN_DIR_ENV)
        if tag and run_of.fullmatch(tag) and run_dir and Path(run_dir).parent == runs_dir and _running(p):
            out.setdefault(tag, []).append(p)
    return out


def run_processes(st: SeatState, include_zombies: bool = False) -> list[psutil.Process]:
    """Every process of this run: its group (when provably ours) and its env tag."""
    found: dict[int, psutil.Process] = {}
    me = os.getpid()
    if group_is_ours(st):
        for p in psutil.process_iter():
            if p.pid != me and _pgid(p.pid) == st.pgid and _born_in_run(p, st):
                found[p.pid] = p
    else:
        for p in _recorded_members(st):
            found.setdefault(p.pid, p)
    for p in tagged(st.run_id):
        found.setdefault(p.pid, p)
    main = _main_process(st)
    if main is not None:
        found.setdefault(main.pid, main)
    if include_zombies:
        return [p for p in found.values() if p.is_running()]
    return [p for p in found.values() if _running(p)]


def _main_process(st: SeatState) -> psutil.Process | None:
    """The recorded main pid itself, when it is provably ours (pid and start time): a state with no
    pgid (written by hand or by another version) and no run tag in reach must still not leave it
    running. Never this process or one of its ancestors, whatever a state file says."""
    if st.pid is None or liveness(st) != "alive":
        return None
    me = psutil.Process()
    try:
        if st.pid == me.pid or st.pid in {p.pid for p in me.parents()}:
            return None
        return psutil.Process(st.pid)
    except psutil.Error:
        return None


def describe(p: psutil.Process) -> dict[str, Any]:
    try:
        with p.oneshot():
            return {"pid": p.pid, "ppid": p.ppid(), "name": p.name(), "status": p.status(),
                    "cmd": " ".join(p.cmdline())[:200], "rss_mib": p.memory_info().rss >> 20,
                    "pgid": _pgid(p.pid)}
    except psutil.Error:
        return {"pid": p.pid, "gone": True}


def signal_run(st: SeatState, procs: list[psutil.Process], sig: int) -> None:
    """The whole group at once (killpg), then each tagged process outside it."""
    if group_is_ours(st):
        try:
            os.killpg(st.pgid, sig)  # type: ignore[arg-type]
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def wait_gone(st: SeatState, timeout: float, abort: Callable[[], bool] | None = None,
              poll: float = 0.2) -> list[psutil.Process]:
    """Wait until no process of the run is running; returns those still running at the end."""
    deadline = time.monotonic() + timeout
    left = run_processes(st)
    while left and time.monotonic() < deadline and not (abort and abort()):
        time.sleep(poll)
        left = run_processes(st)
    return left


def _zombie_parent(pid: int) -> int | None:
    """The parent of `pid` when it is a zombie (exited: no memory, files or port held), else None."""
    try:
        p = psutil.Process(pid)
        return p.ppid() if p.status() == psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def wait_reaped(st: SeatState, timeout: float) -> tuple[list[int], list[int]]:
    """Wait for the run's exited processes to be reaped (init reaps re-parented ones, some inits
    only every few seconds; `up` reaps its own child): (pids not yet exited, zombies left at the
    end). A container's PID 1 that never reaps (`sleep infinity`) left every `down` reporting "NOT
    clean" over zombies, which hold no memory, files or port (NVML's check still runs): they are
    named, not counted against the stop."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p.pid for p in run_processes(st, include_zombies=True)]
        if not left:
            return [], []
        parents = {pid: _zombie_parent(pid) for pid in left}
        if time.monotonic() >= deadline:
            running = [pid for pid, pp in parents.items() if pp is None]
            return running, [pid for pid in left if pid not in running]
        time.sleep(0.1)


def stop(st: SeatState, grace: float, escalate: Callable[[], bool] | None = None) -> dict[str, Any]:
    """SIGTERM to the group and the tagged strays, `grace` seconds, SIGKILL, wait for the reap."""
    report: dict[str, Any] = {"signalled": [], "killed": [], "remaining": [], "unreaped": [], "zombies": []}
    procs = run_processes(st)
    report["signalled"] = [describe(p) for p in procs]
    if not procs:
        return report
    t0 = time.monotonic()
    signal_run(st, procs, signal.SIGTERM)
    left = wait_gone(st, grace, abort=escalate)
    if left:
        report["killed"] = [p.pid for p in left]
        signal_run(st, left, signal.SIGKILL)
        left = wait_gone(st, 15.0)
    report["remaining"] = [describe(p) for p in left]
    report["unreaped"], report["zombies"] = wait_reaped(st, 10.0) if not left else ([], [])
    report["seconds"] = round(time.monotonic() - t0, 2)
    return report
