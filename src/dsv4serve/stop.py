"""Take one run down and prove nothing of it is left.

vLLM's tree is the API server, a multiprocessing resource tracker, the EngineCore and one worker
per rank. SIGKILL of the main process orphans the rest (they re-parent to init and keep running,
and on a GPU keep its memory), and SIGTERM is swallowed while vLLM is still starting
(vllm-cpu-reference §5). So: SIGTERM the whole group (and the env-tagged strays), wait a grace
period, SIGKILL, wait until every process is reaped, remove the run's leftovers, check the port and,
where NVML sees GPUs, that no process of ours still holds memory on the seat's GPUs.
Docker seats: `docker stop -t <grace>` (the engine sends SIGTERM, then SIGKILL), then `docker rm -f`;
a second Ctrl-C during the grace does not wait it out but sends `docker kill`, as the native path
sends SIGKILL early.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import Any, Callable

from dsv4serve import gpu, leftovers, ports, procs, state
from dsv4serve.errors import DsvError
from dsv4serve.ranklog import read_log
from dsv4serve.state import SeatState

# While vLLM is still starting, SIGTERM is lost in its init handler (§5: not within 45 s), so a
# long grace only delays the SIGKILL that does the work. Used unless the user asked for a grace.
STARTUP_GRACE_S = 5.0
DOCKER_EXTRA_S = 30.0


def _docker(args: list[str], timeout: float) -> dict[str, Any]:
    exe = shutil.which("docker")
    if exe is None:
        return {"argv": ["docker", *args], "rc": None, "error": "the docker CLI is not on PATH"}
    try:
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"argv": ["docker", *args], "rc": None, "error": f"timed out after {timeout:.0f} s"}
    return {"argv": ["docker", *args], "rc": r.returncode, "out": (r.stdout + r.stderr).strip()[-400:],
            "stdout": r.stdout}


def container_exists(name: str, run_id: str | None = None) -> bool | None:
    """True/False, or None when the docker CLI cannot say. Only the engine's own "No such ..." answer
    means gone: a failing CLI (no permission on the socket, the daemon down) says nothing about the
    container, and reading it as "gone" would let `down` report a running seat clean. With `run_id`,
    a container of that name made by another run (its dsv4serve.run_id label) is not this one."""
    return container_check(name, run_id)[0]


# `docker inspect`'s State.Status of a container that runs or holds its processes; "created",
# "exited" and "dead" hold none ("removing" is on its way out, and `rm -f` finishes it).
CONTAINER_ACTIVE = frozenset({"running", "restarting", "paused"})

_LABELS = '{{.State.Status}} {{index .Config.Labels "dsv4serve.run_id"}} {{index .Config.Labels "dsv4serve.profile"}}'


def container_owner(name: str) -> tuple[bool | None, str | None, str | None, str]:
    """(exists, run id, seat) of the container called `name`, from the labels `up` gives its
    containers (None: not labelled, i.e. not dsv4serve's), and what docker said: its status when
    it exists. Every docker seat defaults to the name "dsv4": the name alone does not say whose
    container it is."""
    # --type container: without it an image (or volume, network) of that name answers once the
    # container is gone, the template fails on it, and "docker cannot say" kept every later up out
    r = _docker(["inspect", "--type", "container", "--format", _LABELS, name], timeout=30)
    said = (r.get("error") or r.get("out") or "").strip().splitlines()
    said_last = said[-1] if said else ""
    if r["rc"] is None:
        return None, None, None, said_last
    if r["rc"] != 0:
        return (False if "no such" in r.get("out", "").lower() else None), None, None, said_last
    # stdout only: the CLI's own warnings (an unreadable ~/.docker/config.json) go to stderr. A
    # missing label prints as "" ("running  "), on older engines as "<no value>".
    first = (r.get("stdout") or "").lstrip("\n").split("\n", 1)[0].replace("<no value>", "")
    parts = first.split(" ")
    if len(parts) != 3 or not parts[0].isalpha():  # not "<status> <run id> <seat>": docker cannot say
        return None, None, None, said_last
    label = [p or None for p in parts[1:]]
    return True, label[0], label[1], parts[0]


def container_check(name: str, run_id: str | None = None) -> tuple[bool | None, str]:
    """container_exists, with what docker said (the reason when it could not say)."""
    exists, owner, _, said = container_owner(name)
    if exists and run_id is not None and owner != run_id:
        return False, said  # a container of that name, but another run's (or not dsv4serve's)
    return exists, said


def _docker_stop(exe: str, name: str, grace: float, escalate: Callable[[], bool] | None,
                 poll: float = 0.2) -> list[dict[str, Any]]:
    """`docker stop` as a child we poll, so a second Ctrl-C (`escalate`) can cut the grace short
    with `docker kill`; the engine's own SIGKILL after the grace would come too late for a user who
    asked twice. The client then returns as soon as the engine sees the container gone."""
    argv = ["stop", "-t", str(max(0, int(round(grace)))), name]
    p = subprocess.Popen([exe, *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + grace + DOCKER_EXTRA_S
    done: list[dict[str, Any]] = []
    out = ""
    while True:
        try:
            out, _ = p.communicate(timeout=poll)  # retried on timeout without losing output
            break
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() >= deadline:
            p.kill()
            try:
                p.communicate(timeout=DOCKER_EXTRA_S)
            except subprocess.TimeoutExpired:  # a stray grandchild holds the pipe: the client is dead
                pass
            why = f"timed out after {grace + DOCKER_EXTRA_S:.0f} s"
            return [{"argv": ["docker", *argv], "rc": None, "error": why}, *done]
        if not done and escalate is not None and escalate():
            done.append(_docker(["kill", name], timeout=DOCKER_EXTRA_S))
            # the container is dead or dying: its stop needs no more than the engine's bookkeeping
            deadline = min(deadline, time.monotonic() + DOCKER_EXTRA_S)
    return [{"argv": ["docker", *argv], "rc": p.returncode, "out": (out or "").strip()[-400:]}, *done]


def stop_container(name: str, grace: float, escalate: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
    """`docker stop` with grace (escalated to `docker kill` on request), then `docker rm -f`."""
    exe = shutil.which("docker")
    if exe is None:
        return [{"argv": ["docker", "stop", name], "rc": None, "error": "the docker CLI is not on PATH"}]
    return [*_docker_stop(exe, name, grace, escalate), _docker(["rm", "-f", name], timeout=DOCKER_EXTRA_S)]


def gpu_check(st: SeatState, ours: set[int], nvml: Any = None,
              process_name: Callable[[int], str | None] | None = None) -> dict[str, Any]:
    """Processes on the seat's GPUs after the stop: ours are a failure, others are named.
    `nvml`/`process_name` go to gpu.probe (default: the real pynvml and psutil); tests pass a FakeNvml."""
    if not st.gpu_ids:
        return {"checked": False, "detail": "CPU seat: no GPUs to check"}
    m = gpu.probe(list(st.gpu_ids), nvml=nvml, process_name=process_name)
    if not m.available:
        return {"checked": False, "detail": m.error or "NVML is not available"}
    held: list[dict[str, Any]] = []
    foreign: list[dict[str, Any]] = []
    unknown: list[int] = []
    for idx in st.gpu_ids:
        g = m.gpu(idx)
        if g is None or g.processes is None:  # NVML could not say: listed as unknown, not as free
            unknown.append(idx)
            continue
        for p in g.processes:
            row = {"gpu": idx, "pid": p.pid, "name": p.name,
                   "used_mib": p.used_bytes >> 20 if p.used_bytes is not None else None}
            (held if p.pid in ours else foreign).append(row)
    return {"checked": True, "ours": held, "foreign": foreign, "unknown_gpus": unknown}


def stop_run(st: SeatState, grace: float, escalate: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Stop this run wherever it is; the report says what was stopped and what (if anything) is left."""
    report: dict[str, Any] = {"seat": st.seat, "run_id": st.run_id, "runtime": st.runtime, "grace_s": grace}
    if st.runtime == "docker" and st.container_name:
        report["container"] = st.container_name
        exists, owner, seat, said = container_owner(st.container_name)
        if exists and owner != st.run_id:
            # another seat's container of the same name (or not dsv4serve's): this run's is gone,
            # and stopping that one would take down a seat nobody asked to stop
            report["docker"] = []
            report["container_other"] = f"run {owner} (seat {seat})" if owner else "a container dsv4serve did not start"
            report["container_left"], report["container_check"] = False, said
        else:
            report["docker"] = stop_container(st.container_name, grace, escalate)
            # True, False, or None when docker could not say: only False counts as stopped
            report["container_left"], report["container_check"] = container_check(st.container_name, st.run_id)
    report.update(procs.stop(st, grace, escalate))
    try:
        # status's arguments, so its checkpoint serves here too (the markers change nothing read below)
        tracker = read_log(st.log_path, st.tp, st.marker_texts(), st.forbidden(),
                           checkpoint=state.log_checkpoint(st))
    except DsvError:
        # the gates of a hand-edited or other-version state (a pattern that does not compile): the
        # processes are already stopped, so the cleanup below must still run
        tracker = read_log(st.log_path, st.tp, [], [])
    found = leftovers.find(st, set(st.dist_ids) | tracker.dist_ids, set(st.dist_paths) | tracker.dist_paths)
    found, report["leftovers_foreign"] = leftovers.by_owner(found)
    removed, failed = leftovers.remove(found)
    # the sockets of a process that outlived the stop stay, for the down that stops it
    rpc_removed, rpc_failed = leftovers.clear_rpc_dir(st) if not report["remaining"] else ([], [])
    removed, failed = removed + rpc_removed, failed + rpc_failed
    report["leftovers_removed"] = removed
    report["leftovers_failed"] = failed
    # what this run signalled, and a recorded rank / main pid only while it still carries the run's
    # tag: after the run died (or a reboot) another job on the seat's GPU may hold that number
    recorded = {pid for pid in (*st.rank_pids.values(), st.pid) if pid is not None}
    ours = {p["pid"] for p in report["signalled"]} | {pid for pid in recorded if procs.is_tagged(pid, st)}
    report["gpu"] = gpu_check(st, ours)
    # only a live listener holds the port: an address that is no longer this machine's (a NIC gone,
    # a name that stopped resolving) holds nothing of ours, and counting it kept the seat unclean
    # and every later up refused until state.json was deleted by hand (helper audit)
    problem = ports.bind_problem(state.client_host(st.host), st.port)
    report["port_free"] = problem is None or problem.kind == "host"  # EACCES & co. say nothing of a holder
    if problem is not None and problem.kind == "host":
        report["port_note"] = f"{st.host} {problem.detail}: nothing can hold port {st.port} there"
    report["port_owner"] = None if report["port_free"] else ports.owner(st.port)
    report["clean"] = (not report["remaining"] and not report["unreaped"] and not failed
                       and not report["gpu"].get("ours") and report.get("container_left", False) is False
                       and (report["port_free"] or report["port_owner"] is not None))
    return report
