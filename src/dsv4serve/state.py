"""Seat state files: one per seat, written atomically, with two locks.

- `seat.lock` is held by `up` while it brings a seat up (and for as long as `up --foreground`
  stays attached): a second `up` of the same seat is refused at once.
- `state.lock` is held for the few milliseconds of a read-modify-write of state.json, so `down`
  (which may run while `up` is still bringing the seat up) and `up` never overwrite each other:
  `down` marks the state `stopping` first, and `update()` refuses to touch a stopping state.

The state names the run by pid *and* process start time, so a pid reused by an unrelated process
is never mistaken for the seat. When a run ends, `last.json` keeps one line about it (outcome,
diagnostics path), so `status` and `logs` still know what happened after the state is gone.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from pathlib import Path
import stat
from typing import Annotated, Any, Literal

import psutil
from filelock import FileLock, Timeout
from pydantic import BaseModel, Field, ValidationError, field_validator

from dsv4serve import home
from dsv4serve.errors import BadInput

Phase = Literal["launching", "starting", "ready", "failed", "stopping", "stopped"]
RUN_ID_ENV = "DSV4SERVE_RUN_ID"


TP_MAX = 1024  # vLLM serves at most a few hundred ranks; past this a count is a typo, not a seat
Pid = Annotated[int, Field(ge=1)]  # a hand-edited 0 or -1 would name a process group to psutil and kill
# A NaN start time compared as "within a second" of any process's, so down took a stranger for the
# seat's main process (helper audit): a stamp that is not a finite number makes the state unreadable.
Stamp = Annotated[float, Field(allow_inf_nan=False)]


class SeatState(BaseModel):
    seat: str = Field(description="seat name (the profile name)")
    run_id: str
    profile: str
    profile_digest: str
    profile_ref: str | None = Field(None, description="what `up --profile` named: a shipped profile's name or "
                                                      "the YAML file's absolute path (Profile.ref())")
    runtime: Literal["native", "docker"]
    pid: Pid | None = None
    pgid: Pid | None = None
    start_time: Stamp | None = Field(None, description="psutil create_time() of pid, seconds since the epoch")
    container_name: str | None = None
    argv: list[str]
    env: dict[str, str]
    host: str
    port: int
    served_name: str
    tp: Annotated[int, Field(ge=1, le=TP_MAX)]  # as the profile bounds it: readers allocate per rank
    gpu_ids: list[int] = Field(default_factory=list)
    gpu_uuids: list[str] = Field(default_factory=list)
    run_dir: str
    log_path: str
    phase: Phase = "launching"
    phase_detail: str = ""
    started_at: Stamp = Field(default_factory=time.time)
    ready_at: Stamp | None = None
    kv_cache_tokens: int | None = None
    markers: dict[str, list[int]] = Field(default_factory=dict)
    dist_ids: list[str] = Field(default_factory=list)
    dist_paths: list[str] = Field(default_factory=list, description="vLLM's file:// rendezvous files of this run")
    rank_pids: dict[Annotated[int, Field(ge=0)], Pid] = Field(default_factory=dict,
                                                              description="TP rank -> worker pid, from the log")
    engine_pid: Pid | None = None
    pid_starts: dict[Pid, Stamp] = Field(default_factory=dict, description="create_time() of each rank / engine "
                                                                     "pid when the log named it (the run alive)")
    supervisor_pid: Pid | None = Field(None, description="the `up` process watching the seat, while it runs")
    stopper_pid: Pid | None = Field(None, description="the process (down, or up tearing down) that marked the "
                                                      "seat stopping")
    stopper_start: Stamp | None = Field(None, description="psutil create_time() of stopper_pid")
    gates: dict[str, Any] = Field(default_factory=dict, description="launch.describe_gates() of the run")
    overrides: list[str] = Field(default_factory=list, description="the --set overrides `up` was given")
    lna2_build: dict[str, str | None] | None = Field(
        None, description="launch.lna2_launched(): the lna2 build file the workers load and its build id")
    tmp_dir: str | None = Field(None, description="the temp dir `up` (and so the seat) had: where vLLM's "
                                                  "rendezvous files go when the profile sets no TMPDIR")
    rpc_dir: str | None = Field(None, description="the directory `up` made for vLLM's ZMQ socket files "
                                                  "(VLLM_RPC_BASE_PATH); `down` empties and removes it")
    api_key_fp: str | None = Field(None, description="launch.key_fingerprint() of the API key the server was "
                                                     "started with, salted with run_id ('' for none; never the key "
                                                     "itself): a native seat's may come from the shell that ran `up`")

    @field_validator("gates")
    @classmethod
    def _gates_shape(cls, v: dict[str, Any]) -> dict[str, Any]:
        # status and down read into it: a state from another version, or edited by hand, must be an
        # unreadable state (a status row, and down sets it aside), not a crash of every command
        markers = v.get("markers", [])
        if not isinstance(markers, list) or not all(
                isinstance(m, dict) and isinstance(m.get("text"), str) and type(m.get("ranks")) is int for m in markers):
            raise ValueError("gates.markers is not a list of {text, ranks}")
        if not isinstance(v.get("forbidden", []), list):
            raise ValueError("gates.forbidden is not a list")
        timeouts = v.get("timeouts", {})
        if not isinstance(timeouts, dict):
            raise ValueError("gates.timeouts is not a mapping")
        for key, val in timeouts.items():
            # `down` takes its grace from here (float(None) was a TypeError that left the seat running)
            if not _is_seconds(val):
                raise ValueError(f"gates.timeouts.{key} is {val!r}, not a number of seconds")
        kv = v.get("kv_cache_min_tokens")
        if kv is not None and type(kv) is not int:
            raise ValueError(f"gates.kv_cache_min_tokens is {kv!r}, not a number of tokens")
        return v

    @property
    def base_url(self) -> str:
        return http_base(self.host, self.port)

    def marker_texts(self) -> list[str]:
        return [m["text"] for m in self.gates.get("markers", [])]

    def forbidden(self) -> list[str]:
        return list(self.gates.get("forbidden", []))


def _is_seconds(val: Any) -> bool:
    return type(val) in (int, float) and math.isfinite(val) and val >= 0


def client_host(host: str) -> str:
    """The address a client on this machine reaches a server listening on `host` by: a wildcard
    host on loopback, any other as it is (without IPv6 brackets)."""
    bare = host.strip("[]")
    return "127.0.0.1" if bare in ("0.0.0.0", "", "::") else bare


def http_base(host: str, port: int) -> str:
    """The URL of a server listening on (host, port), for a client on this machine; an IPv6
    literal goes in brackets (`http://::1:8000` is no URL)."""
    h = client_host(host)
    return f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}"


# A seat's name (profiles are held to it too): one plain path component, never "." or ".." (the
# first character is a letter or digit), so a name given on the command line (`down -p ../x`,
# `-p /etc/passwd`) can never reach outside the state dir.
SEAT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def seat_dir(seat: str) -> Path:
    if not SEAT_NAME.fullmatch(seat):
        raise BadInput(f"'{seat}' is not a seat name (letters, digits, '.', '_' and '-', as a profile's name)",
                       hint="name a seat as `dsv4serve status` lists it, or a profile file that loads")
    return home.seats_dir() / seat


def state_path(seat: str) -> Path:
    return seat_dir(seat) / "state.json"


def last_path(seat: str) -> Path:
    return seat_dir(seat) / "last.json"


def lock(seat: str, timeout: float = 0.0) -> FileLock:
    d = home.ensure(seat_dir(seat))  # a file or a read-only dir in the way: one line, not a traceback
    return FileLock(str(d / "seat.lock"), timeout=timeout)


def lock_held(seat: str) -> bool:
    """Whether a process holds the seat's lock, read from the kernel's lock table: a probe that took
    the lock itself, however briefly, would refuse an `up` starting in that instant (the dry run's
    case). False where there is no lock file, or no /proc/locks to read."""
    p = seat_dir(seat) / "seat.lock"
    try:
        st = p.stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return False
    return held_in(table, st)


def held_in(table: str, st: os.stat_result) -> bool:
    """Whether /proc/locks' `table` holds a lock on the file `st` describes. The table names a file
    by MAJ:MIN:INODE of its superblock, which is not stat's st_dev on btrfs (a subvolume has a device
    number of its own): a line with the inode but another device counts when its pid has the file
    open (its fd stats to the same st_dev and inode)."""
    exact = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():
        fields = line.split()
        at = next((i for i, f in enumerate(fields) if f.count(":") == 2 and f.rsplit(":", 1)[1].isdigit()), None)
        if at is None or int(fields[at].rsplit(":", 1)[1]) != st.st_ino:
            continue
        if fields[at] == exact or (at > 0 and fields[at - 1].isdigit() and _has_open(int(fields[at - 1]), st)):
            return True
    return False


def _has_open(pid: int, st: os.stat_result) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or another user's: not provably this file
        return False
    for fd in fds:
        try:
            o = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if o.st_ino == st.st_ino and o.st_dev == st.st_dev:
            return True
    return False


def acquire(seat: str, what: str) -> FileLock:
    lk = lock(seat)
    try:
        lk.acquire(timeout=0)
    except Timeout:
        raise BadInput(f"seat {seat} is held by another dsv4serve (an `up` bringing it up or attached with "
                       f"--foreground); {what} refused",
                       hint="wait for it to finish, or check `dsv4serve status`") from None
    return lk


def _state_lock(seat: str) -> FileLock:
    d = home.ensure(seat_dir(seat))
    return FileLock(str(d / "state.lock"), timeout=10.0)


def atomic_write(path: Path, data: str | bytes, mode: int | None = None) -> None:
    """Write next to the target, fsync, then rename over it: readers see old or new bytes, never
    half. The temp file is mkstemp's 0600 unless `mode` is given (a patched source keeps its own)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".dsv4tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def save(st: SeatState) -> None:
    with _state_lock(st.seat):
        atomic_write(state_path(st.seat), st.model_dump_json(indent=2))


class UnreadableState(BadInput):
    """A state file that exists but does not parse (truncated by a full disk, edited by hand)."""

    def __init__(self, seat: str, path: Path, why: str):
        super().__init__(f"state file {path} is unreadable ({why})",
                         hint=f"`dsv4serve down --profile {seat}` stops what the seat's run may have left and sets "
                              "the file aside")
        self.seat, self.path = seat, path


def _regular(p: Path) -> bool:
    """False for a FIFO, socket or device under the name (reading one would block or stream); raises
    FileNotFoundError when there is nothing."""
    return stat.S_ISREG(p.stat().st_mode)


def load(seat: str) -> SeatState | None:
    p = state_path(seat)
    try:
        if not _regular(p):
            raise UnreadableState(seat, p, "not a regular file")
        return SeatState.model_validate_json(p.read_text())
    except FileNotFoundError:
        return None
    except ValidationError as e:  # a ValueError: name the first field, not just the class
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        msg = err.get("msg") or e.__class__.__name__
        raise UnreadableState(seat, p, f"{where}: {msg}" if where else msg) from None
    except (ValueError, OSError) as e:
        raise UnreadableState(seat, p, e.__class__.__name__) from None


def set_aside(seat: str) -> Path | None:
    """Move an unreadable state file out of the way (renamed, never deleted: it may be all that
    says what ran); None when there was none."""
    p = state_path(seat)
    dest = p.with_name(f"state.json.unreadable-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    with _state_lock(seat):
        try:
            os.replace(p, dest)
        except FileNotFoundError:
            return None
    return dest


def update(seat: str, run_id: str, *, even_stopping: bool = False, **changes: Any) -> SeatState | None:
    """Change fields of this run's state, unless `down` has taken the seat over (state gone, a
    different run, or phase `stopping` unless `even_stopping`): then nothing is written and None is
    returned. The read and the write are under one lock, so a `down` that removes the state in
    between is never undone by writing it back."""
    with _state_lock(seat):
        st = load(seat)
        if st is None or st.run_id != run_id or (st.phase == "stopping" and not even_stopping):
            return None
        st = st.model_copy(update=changes)
        atomic_write(state_path(seat), st.model_dump_json(indent=2))
        return st


def mark_stopping(seat: str, run_id: str, why: str) -> SeatState | None:
    """`down` takes the seat: from now on `up` writes nothing to it.

    A mark that cannot be written (a full disk) is not written, and the stopping state is still
    returned: the mark is bookkeeping, and a `down` that gave up here would leave the seat running
    when stopping it is the whole job (an `up` still watching it then sees its processes die)."""
    with _state_lock(seat):
        st = load(seat)
        if st is None or st.run_id != run_id:
            return None
        st = st.model_copy(update={"phase": "stopping", "phase_detail": why, **_stopper()})
        try:
            atomic_write(state_path(seat), st.model_dump_json(indent=2))
        except OSError:
            pass
        return st


def _stopper() -> dict[str, Any]:
    """This process as the one stopping a seat: a stop killed half way left "stopping" for good
    while the seat served on, and status could not tell (helper audit)."""
    me = psutil.Process()
    return {"stopper_pid": me.pid, "stopper_start": me.create_time()}


def stopper_gone(st: SeatState) -> bool:
    """Whether the process that marked the seat stopping has ended (its number gone or reused)."""
    if st.phase != "stopping" or st.stopper_pid is None:
        return False
    try:
        proc = psutil.Process(st.stopper_pid)
        created, zombie = proc.create_time(), proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False
    return zombie or (st.stopper_start is not None and not abs(created - st.stopper_start) <= 1.0)


def claim_stop(seat: str, run_id: str, why: str) -> SeatState | None:
    """`up` stopping its own seat: like mark_stopping, but None when someone else (`down`) already
    marked it stopping, so two teardowns never report over each other."""
    with _state_lock(seat):
        st = load(seat)
        if st is None or st.run_id != run_id or st.phase == "stopping":
            return None
        st = st.model_copy(update={"phase": "stopping", "phase_detail": why, **_stopper()})
        atomic_write(state_path(seat), st.model_dump_json(indent=2))
        return st


def remove(seat: str, run_id: str | None = None) -> bool:
    """Remove the state (only this run's, when `run_id` is given: never a newer run's)."""
    with _state_lock(seat):
        if run_id is not None:
            cur = load(seat)
            if cur is None or cur.run_id != run_id:
                return False
        try:
            state_path(seat).unlink()
            return True
        except FileNotFoundError:
            return False


def save_last(seat: str, info: dict[str, Any]) -> bool:
    """Record the run's ending; False when it could not be written (a full disk). The record is a
    courtesy for `status` and `logs`: failing to write it must never fail the stop that came first."""
    try:
        atomic_write(last_path(seat), json.dumps({"at": time.time(), **info}, indent=2, default=str))
    except OSError:
        return False
    return True


def load_last(seat: str) -> dict[str, Any] | None:
    """The seat's last run summary, or None when there is none or it is not one (a hand-edited or
    foreign last.json is no reason for status or logs to crash). Values it names are checked by
    their readers."""
    try:
        p = last_path(seat)
        data = json.loads(p.read_text()) if _regular(p) else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def last_unreadable(seat: str) -> str | None:
    """Why the seat's last.json exists but `load_last` cannot use it; None when it is fine or absent."""
    p = last_path(seat)
    if not os.path.lexists(p) or load_last(seat) is not None:
        return None
    try:
        what = "not a JSON object: truncated or edited" if _regular(p) else "not a regular file"
    except OSError as e:
        what = e.strerror or type(e).__name__
    return f"{p} is unreadable ({what}); the run logs are still under runs/"


def _seat_entries() -> list[Path]:
    d = home.seats_dir()
    if not d.is_dir():
        return []
    # only names a seat can have: a stray directory (an editor's backup, `.trash`) is not a seat, and
    # naming it would make every status and logs refuse
    return [p for p in d.iterdir() if SEAT_NAME.fullmatch(p.name)]


CANCEL_FILE = "cancel-up"  # `down` asks an `up` still in its pre-launch steps (no state yet) to stop


def request_cancel(seat: str) -> None:
    atomic_write(seat_dir(seat) / CANCEL_FILE, json.dumps({"pid": os.getpid(), "at": time.time()}))


def cancel_requested(seat: str) -> bool:
    return (seat_dir(seat) / CANCEL_FILE).exists()


def clear_cancel(seat: str) -> None:
    (seat_dir(seat) / CANCEL_FILE).unlink(missing_ok=True)


def starting_seats() -> list[str]:
    """Seats an `up` holds the lock of but has not recorded a state for yet (its pre-launch steps)."""
    return sorted(p.name for p in _seat_entries() if not (p / "state.json").exists() and lock_held(p.name))


def all_seats() -> list[str]:
    # exists(), not is_file(): a state.json that is a directory (or anything unreadable) is still a
    # seat's state; load() reports it as unreadable and `down` sets it aside, instead of the seat
    # vanishing from `status` without a word
    return sorted(p.name for p in _seat_entries() if (p / "state.json").exists())


def known_seats() -> list[str]:
    """Seats with a state or a record of their last run."""
    return sorted(p.name for p in _seat_entries() if (p / "state.json").exists() or (p / "last.json").exists())


def liveness(st: SeatState) -> Literal["alive", "gone", "reused", "unknown"]:
    """Is the recorded main process still *our* process?"""
    if st.pid is None:
        return "unknown"
    try:
        proc = psutil.Process(st.pid)
        created = proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, OverflowError, ValueError):  # no such pid can exist
        return "gone"
    except psutil.AccessDenied:
        return "unknown"
    if st.start_time is not None and not abs(created - st.start_time) <= 1.0:  # NaN: not ours
        return "reused"
    if st.start_time is None:
        # No start time was recorded (the child was already gone when up asked): the run tag
        # in its environment is then the only proof the pid is still ours
        try:
            if proc.environ().get(RUN_ID_ENV) != st.run_id:
                return "reused"
        except psutil.AccessDenied:
            return "unknown"
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return "gone"
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "gone"
    except psutil.Error:
        pass
    return "alive"


def pid_alive(pid: int | None) -> bool:
    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OverflowError, ValueError):
        return False


def dead_ranks(st: SeatState) -> list[int]:
    """Ranks whose recorded worker process is gone (native seats; container pids are not ours)."""
    if st.runtime != "native":
        return []
    return sorted(r for r, pid in st.rank_pids.items() if not pid_alive(pid))


def find_running(seat: str | None = None) -> SeatState:
    """The seat a client command (bench, check-seat live) should talk to."""
    names = [seat] if seat else all_seats()
    live, unreadable = [], []
    for n in names:
        try:
            st = load(n)
        except UnreadableState:
            if seat:
                raise
            unreadable.append(n)  # a leftover of another seat must not hide the one that runs
            continue
        if st is not None and st.phase in ("ready", "starting") and liveness(st) == "alive" and not dead_ranks(st):
            live.append(st)
    if not live:
        what = f"seat {seat} is not running" if seat else "no seat is running"
        if unreadable:
            what += f" (the state of {', '.join(unreadable)} is unreadable: `dsv4serve status` says why)"
        raise BadInput(what, hint="start one with `dsv4serve up`, or pass --base-url and --model")
    if len(live) > 1:
        raise BadInput(f"{len(live)} seats are running ({', '.join(s.seat for s in live)})",
                       hint="name one with --profile")
    return live[0]


def log_checkpoint(st: SeatState) -> Path:
    """Where status and down keep their place in the run's log (ranklog.read_log's checkpoint). In
    the seat's state dir, never the run dir: a docker seat mounts that one into its container, and
    whatever runs there must not be able to hand the host a pickle to load. One file per seat: it
    names the log it belongs to (device and inode), so a new run's log is read afresh."""
    return seat_dir(st.seat) / "log-scan.pkl"


def counters_path(run_dir: str | Path, rank: int) -> Path:
    """Per-rank MoE call counters the vLLM plugin writes (schema: plugin_counters)."""
    return Path(run_dir) / f"counters-rank{rank}.json"


def read_counters(run_dir: str | Path, tp: int) -> dict[int, dict[str, Any] | None]:
    out: dict[int, dict[str, Any] | None] = {}
    for r in range(tp):
        try:
            out[r] = json.loads(counters_path(run_dir, r).read_text())
        except (OSError, ValueError):
            out[r] = None
    return out
