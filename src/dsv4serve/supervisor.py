"""Start a LaunchSpec in its own session and watch it until the seat is provably ready or failed.

The child writes straight into the run's log file (so it keeps logging after `up` returns); the
supervisor tails that file into a `SeatTracker`. It fails fast on a fatal line, on the main process
exiting, on a rank process dying, on a stall (no progress on any rank for `stall_s`; every new
non-heartbeat line is progress, as Ollama's load timer resets on progress) and on the hard cap.
Once the API server serves, a probe thread checks /health, /v1/models and a canary completion
(bounded by `ready_s`) while the main loop keeps tailing, so a rank crashing under the canary is
still seen. The seat is ready only when every rank showed every required marker (counted by
distinct rank), the KV cache holds the profile's minimum, and the canary returned tokens.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil
from filelock import Timeout
from rich.markup import escape

from dsv4serve import leftovers, procs, readiness, state, stop
from dsv4serve.cli_common import console, emit_json_line, err_console, silence
from dsv4serve.errors import EXIT_FAILED, EXIT_OK, DsvError, JobFailed
from dsv4serve.launch import (LaunchSpec, describe_gates, env_for_child, key_fingerprint, lna2_launched,
                              seat_api_key)
from dsv4serve.profile import Profile
from dsv4serve.ranklog import PHASE_LABEL, SeatTracker, finished_redraws, with_seat
from dsv4serve.state import RUN_ID_ENV, SeatState

POLL_S = 0.2
STATE_POLL_S = 0.5
OWNER_CHECK_S = 5.0  # how often the readiness wait looks for a foreign listener on the seat's port
# The demo plugin's marker comes before the API serves; lna2's ACTIVE line comes with the first
# decode-shaped MoE call (trap 7), i.e. during the canary on an eager seat. The ranks write the
# log file themselves, unbuffered, before the canary's answer leaves the server, so a short wait
# after the canary covers every marker still in flight.
MARKER_GRACE_S = 3.0
# A line written just before the canary's answer can reach the log after the answer reaches us
# (Docker relays container output through the daemon to the attached client). Before calling the
# seat ready, the log is read on for this long through the loop's fatal check, so a fallback or a
# crash under the canary fails the bring-up instead of slipping past it.
READY_SETTLE_S = {"native": 1.0, "docker": 2.0}
# After the first fatal line, how long the other ranks may take to say why before the seat is stopped:
# ranks of one seat fail together (same load, same check), milliseconds to a second apart.
FATAL_SETTLE_S = 2.0
# How long an `up` whose seat `down` took over waits for down to stop its child before doing it itself.
TAKEN_OVER_WAIT_S = 120.0
EXIT_INTERRUPTED = 130  # Ctrl-C's; each signal exits 128 + its number (Interrupts.exit_code)
# What a write to a stream that went away raises: OSError (EPIPE, EIO of a closed pty), ValueError (a
# closed file), and SystemExit, which is how rich answers EPIPE (after pointing stdout at /dev/null).
OUTPUT_ERRORS = (OSError, ValueError, SystemExit)


class StateWriteFailed(JobFailed):
    """The seat's state could not be written (a full disk): a run it cannot record is stopped."""


@dataclass
class Outcome:
    ok: bool
    code: int = EXIT_OK
    reason: str = ""
    hint: str | None = None
    seconds: float = 0.0
    readiness: dict[str, Any] = field(default_factory=dict)
    taken_over: bool = False  # `dsv4serve down` stopped the seat
    interrupted: bool = False
    stalled: bool = False
    diagnostics: str | None = None
    stop_report: dict[str, Any] | None = None


class LogTail:
    """Incremental reader of a growing log file, yielding whole lines (tqdm's \\r bars included)."""

    def __init__(self, path: Path):
        self.path = path
        self.pos = 0
        self.buf = b""
        self.ident: tuple[int, int] | None = None  # the file read so far (device, inode)

    def read(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size < self.pos or (self.ident is not None and self.ident != (st.st_dev, st.st_ino)):
                    # truncated (copytruncate) or replaced: read it from its start, or every line
                    # after would go unseen until it grew past the old offset
                    self.pos, self.buf = 0, b""
                self.ident = (st.st_dev, st.st_ino)
                f.seek(self.pos)
                chunk = f.read()
                self.pos = f.tell()
        except OSError:
            return []
        if not chunk:
            return []
        self.buf += chunk
        # whole lines, carriage returns and all (ranklog.physical_parts tells a bar's redraws from a
        # record's text); of the line still being written only a bar's finished redraws
        parts = self.buf.split(b"\n")
        self.buf = parts.pop()
        done = finished_redraws(self.buf)
        if done:
            parts.append(done)
            self.buf = self.buf[len(done):]
        return [p.decode("utf-8", "replace") for p in parts if p.strip()]


class Interrupts:
    """Ctrl-C / SIGTERM / SIGHUP of `up` itself: the first asks for a clean teardown, the second
    escalates it to SIGKILL. The child runs in its own session, so a terminal's Ctrl-C reaches only
    `up`, never vLLM directly."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    LABELS = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM",
              signal.SIGHUP: "SIGHUP (the terminal or session went away)"}

    def __init__(self, give_up_at: int | None = None) -> None:
        self.count = 0
        self.first: int | None = None  # the signal that asked for the teardown
        self._old: dict[int, Any] = {}
        # `down`: the first signal hurries the stop, and a user who keeps pressing Ctrl-C past that
        # (a docker CLI that hangs) gets the shell back
        self.give_up_at = give_up_at

    def _handler(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.first is None:
            self.first = signum
        if self.give_up_at is not None and self.count >= self.give_up_at:
            raise KeyboardInterrupt

    def label(self) -> str:
        sig = self.first if self.first is not None else signal.SIGINT
        return self.LABELS.get(sig, signal.Signals(sig).name)

    def exit_code(self) -> int:
        # the shell's convention for a run ended by a signal: 130 SIGINT, 143 SIGTERM, 129 SIGHUP
        return 128 + int(self.first if self.first is not None else signal.SIGINT)

    def __enter__(self) -> "Interrupts":
        for s in self.SIGNALS:
            if signal.getsignal(s) is signal.SIG_IGN:
                continue  # ignored by whoever started us (`nohup`): that choice stands
            self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    @property
    def requested(self) -> bool:
        return self.count >= 1

    def escalate(self) -> bool:
        return self.count >= 2


# ---------------------------------------------------------------------------------------------
# display


def _stream_error(e: BaseException) -> str:
    """What went wrong with a stream, in a few words."""
    if isinstance(e, SystemExit):
        return "Broken pipe: its reader is gone"
    if isinstance(e, OSError):
        return e.strerror or type(e).__name__
    return str(e) or type(e).__name__


class Display:
    """The per-rank table (rich Live on a terminal; event lines and a final table otherwise), or
    JSON event lines with --json. Everything for humans goes to stdout; errors to stderr.

    Every write to stdout goes through `_out`: a stdout that went away (a pipe whose reader quit, a
    terminal that closed) must never raise through the supervisor, which would skip the teardown and
    leave the seat running with nobody watching. The first failure is kept in `broken`, nothing more
    is written, and the supervisor stops the seat. The Live table refreshes from `tick` on this
    thread, not from rich's own thread, so its failures are seen here too."""

    def __init__(self, seat: str, tracker: SeatTracker, json_events: bool, t0: float):
        self.seat, self.tracker, self.json, self.t0 = seat, tracker, json_events, t0
        self.live: Any = None
        self.http = "waiting for the API server"
        self._last = 0.0
        self.broken: str | None = None  # why stdout stopped taking our writes
        # A character stdout's encoding cannot show (a vLLM log line under LANG=C) goes out replaced:
        # the stream is fine, and taking the error for a lost stdout would stop a healthy seat.
        with contextlib.suppress(AttributeError, ValueError, OSError):
            console.file.reconfigure(errors="replace")

    def _broke(self, e: BaseException) -> None:
        if self.broken is None:
            self.broken = _stream_error(e)
        console.quiet = True
        silence(console.file, sys.stdout)

    def _out(self, write: Callable[..., Any], *args: Any, **kw: Any) -> bool:
        if self.broken is not None:
            return False
        try:
            write(*args, **kw)
            return True
        except UnicodeError:
            return False  # a stream reconfigure could not make tolerant (see __init__): the line is lost, not the seat
        except OUTPUT_ERRORS as e:
            if isinstance(e, ValueError) and "closed file" not in str(e):
                raise  # not a stream that went away: a bug of ours, which the supervisor's net reports
            self._broke(e)
            return False

    def say(self, text: str, **kw: Any) -> None:
        """One line for humans on stdout."""
        self._out(console.print, text, highlight=False, **kw)

    def line(self, obj: dict[str, Any]) -> None:
        """One JSON event line on stdout."""
        self._out(emit_json_line, obj)

    def start(self) -> None:
        if not self.json and console.is_terminal:
            from rich.live import Live

            live = Live(self.table(time.time()), console=console, auto_refresh=False, transient=False)
            self.live = live
            if not self._out(live.start, refresh=True):
                self._end_live()

    def _end_live(self, final: Any = None) -> None:
        # always stopped, even on a dead terminal: Live redirects sys.stdout and sys.stderr until then
        live, self.live = self.live, None
        try:
            if final is not None and self.broken is None:
                live.update(final)
            live.stop()
        except OUTPUT_ERRORS as e:
            self._broke(e)

    def stop(self, final: bool = True) -> None:
        now = time.time()
        if self.live is not None:
            self._end_live(self.table(now))
        elif final and not self.json:
            self._out(console.print, self.table(now))

    def emit(self, event: dict[str, Any]) -> None:
        """One of our own events (spawn, readiness, ready, failed...)."""
        if self.json:
            self.line({"t": round(time.time(), 3), "elapsed_s": round(time.time() - self.t0, 1), **event})
        elif self.live is None and event.get("say"):
            self.say(f"{time.time() - self.t0:6.1f} s  {event['say']}", markup=False, soft_wrap=True)

    def events(self, evs: list[dict[str, Any]]) -> None:
        for e in evs:
            if self.json:
                self.line(e)
            elif self.live is None:
                line = self._describe(e)
                if line:
                    self.say(f"{e.get('elapsed_s', 0):6.1f} s  {line}", markup=False, soft_wrap=True)

    @staticmethod
    def _describe(e: dict[str, Any]) -> str | None:
        who = f"rank {e['rank']}" if e.get("rank") is not None else ""
        kind = e["event"]
        if kind == "phase":
            return f"{who}: {PHASE_LABEL.get(e['phase'], e['phase'])}"
        if kind == "marker":
            return f"{who}: marker '{e['marker']}'"
        if kind == "kv":
            return f"KV cache: {e['tokens']:,} tokens"
        if kind == "api":
            return "API server: serving"
        if kind == "engine":
            return "engine: initialised"
        if kind == "fatal":
            return f"FATAL ({e['kind']}) {e['stream']}: {e['line'][:200]}"
        return None  # shards: the table shows them

    def tick(self, now: float) -> None:
        if self.live is not None and now - self._last >= 0.25:
            self._last = now
            if not self._out(self.live.update, self.table(now), refresh=True):
                self._end_live()

    def table(self, now: float) -> Any:
        from rich.table import Table

        tr = self.tracker
        t = Table(title=f"{self.seat}: {now - self.t0:.0f} s", title_justify="left", expand=False)
        wide = console.width >= 120  # the last line only where it fits without wrapping the table
        cols = ["rank", "pid", "phase", "in phase", "shards", "markers"] + (["last line"] if wide else [])
        for col in cols:
            t.add_column(col, no_wrap=True, overflow="ellipsis",
                         max_width=max(20, console.width - 90) if col == "last line" else None)
        need = len(tr.required)
        for name, s in (("api", tr.others["api"]), ("engine", tr.others["engine"])):
            phase = ("serving" if tr.api_serving else "starting") if name == "api" else (
                "initialised" if tr.engine_ready else "starting")
            t.add_row(name, str(s.pid or ""), phase, "", "", "", *([s.last_line] if wide else []))
        for r, s in tr.ranks.items():
            shards = f"{s.shards[0]}/{s.shards[1]}" if s.shards else ""
            marks = f"{len(s.markers)}/{need}" if need else "-"
            t.add_row(str(r), str(s.pid or ""), PHASE_LABEL.get(s.phase, s.phase), f"{now - s.since:.0f} s", shards,
                      marks, *([s.last_line] if wide else []))
        kv = f"KV cache {tr.kv_tokens:,} tokens" if tr.kv_tokens is not None else "KV cache not sized yet"
        t.caption = f"{kv} · HTTP: {self.http}"
        return t


# ---------------------------------------------------------------------------------------------
# the supervisor


def _no_core_dumps() -> None:  # runs in the child between fork and exec
    # A crashed seat once wrote 27.6 GB of core files (seat-reference trap 5).
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def spawn(spec: LaunchSpec, log_path: Path, core_dumps: bool = False, rpc_dir: str | None = None) -> subprocess.Popen:
    """The seat in its own session (so its whole tree shares one process group that `down` can
    signal, and a Ctrl-C in our terminal never reaches it), logging into the run's file; vLLM's
    socket files in `rpc_dir` (leftovers.make_rpc_dir)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = env_for_child(spec)
    env[RUN_ID_ENV] = spec.run_id  # also on the docker client, whose env delta is passed with -e
    # vLLM's engine and workers set their process title, which by default writes over the environment
    # block /proc/PID/environ shows: their run tag would vanish, and with the main process gone they
    # were found by nothing (review)
    env["SPT_NOENV"] = "1"
    if rpc_dir:
        env[leftovers.RPC_ENV] = rpc_dir
    with open(log_path, "ab", buffering=0) as log:
        return subprocess.Popen(spec.argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=spec.cwd, start_new_session=True,
                                preexec_fn=None if core_dumps else _no_core_dumps)


def canary_said(res: dict[str, Any]) -> str:
    """The canary's evidence in words: its tokens, and the expected answer it matched (when the profile
    names one)."""
    said = f"{res.get('canary_tokens')} tokens"
    return said + (f" matching /{res['canary_expect']}/" if res.get("canary_expect") is not None else "")


class Supervisor:
    def __init__(self, profile: Profile, spec: LaunchSpec, *, json_events: bool, foreground: bool,
                 gpu_uuids: list[str] | None = None, overrides: list[str] | None = None):
        self.profile, self.spec = profile, spec
        self.json_events, self.foreground = json_events, foreground
        self.seat = profile.name
        self.run_dir = Path(spec.run_dir)
        self.log_path = self.run_dir / "vllm.log"
        self.t = profile.gates.timeouts
        self.tp = profile.vllm.tensor_parallel_size
        self.need = {m.text: (self.tp if m.ranks == "all" else int(m.ranks)) for m in profile.gates.markers}
        self.t0 = time.time()
        self.tracker = SeatTracker(self.tp, list(self.need), list(profile.gates.forbidden), start=self.t0)
        self.tail: LogTail | None = None  # the reader feeding the tracker, drained once more on a failure
        self.display = Display(self.seat, self.tracker, json_events, self.t0)
        self.proc: subprocess.Popen | None = None
        self.st: SeatState | None = None
        self.gpu_uuids = gpu_uuids or []
        self.overrides = overrides or []
        self._probe: threading.Thread | None = None
        self._probe_result: dict[str, Any] | None = None
        self._probe_error: JobFailed | None = None
        self._probe_started = 0.0
        self._last_state_poll = 0.0
        self._saved: dict[str, Any] = {}
        self._starts: dict[int, float] = {}  # rank / engine pid -> its start time (native seats)
        self._tearing_down = False  # set once a teardown began: a crash after it must not start another
        self._attached_ready = False  # --foreground, past ready: a `down` then is the user's stop, not a failure
        self._failing: Outcome | None = None  # the failure _fail is stopping the seat for
        self.rpc_dir: str | None = None  # vLLM's socket files' directory (run() makes it)

    # -- state ----------------------------------------------------------------------------------
    def _initial_state(self) -> SeatState:
        s = self.spec
        return SeatState(seat=self.seat, run_id=s.run_id, profile=self.profile.name,
                         profile_digest=self.profile.digest(), profile_ref=self.profile.ref(), runtime=s.runtime, container_name=s.container_name,
                         argv=s.argv, env=s.env, host=s.host, port=s.port, served_name=s.served_name, tp=self.tp,
                         gpu_ids=list(self.profile.gpus.ids), gpu_uuids=self.gpu_uuids, run_dir=str(self.run_dir),
                         log_path=str(self.log_path), phase="launching", started_at=self.t0,
                         supervisor_pid=os.getpid(), gates=describe_gates(self.profile), overrides=self.overrides,
                         lna2_build=lna2_launched(self.profile), tmp_dir=tempfile.gettempdir(),
                         rpc_dir=self.rpc_dir,
                         api_key_fp=key_fingerprint(seat_api_key(s.runtime, s.argv, s.env), s.run_id))

    def _update(self, **changes: Any) -> bool:
        """Write to the state unless `down` took the seat (then False). StateWriteFailed when it
        cannot be written (a full disk): the seat cannot be brought up without its record."""
        try:
            st = state.update(self.seat, self.spec.run_id, **changes)
        except OSError as e:
            # the teardown that follows needs what the state could not take (the pid and group)
            if self.st is not None:
                self.st = self.st.model_copy(update=changes)
            raise self._state_write_failed(e) from None
        if st is None:
            return False
        self.st = st
        return True

    def _state_write_failed(self, e: OSError) -> "StateWriteFailed":
        where = state.state_path(self.seat)
        if isinstance(e, Timeout):  # filelock's: another process held the state lock past its wait
            why, hint = (f"its lock {e.lock_file} stayed held", "check `dsv4serve status` for another dsv4serve on "
                         "this seat, then up again")
        elif e.errno in (errno.ENOSPC, errno.EDQUOT):
            why, hint = (e.strerror or "no space", f"free space on the filesystem of {where.parent} "
                         f"(`df -h {where.parent}`), then up again")
        else:
            why, hint = (e.strerror or type(e).__name__, f"fix {where.parent} (permissions, a read-only mount), "
                         "then up again")
        return StateWriteFailed(f"could not write the seat's state {where} ({why})", hint=hint)

    def _taken_over(self, now: float) -> bool:
        if now - self._last_state_poll < STATE_POLL_S:
            return False
        self._last_state_poll = now
        try:
            cur = state.load(self.seat)
        except Exception:  # noqa: BLE001 - a torn read is retried next poll
            return False
        return cur is None or cur.run_id != self.spec.run_id or cur.phase == "stopping"

    def _pid_starts(self) -> dict[int, float]:
        """Each rank / engine pid's start time, read when the log first names it (the run is alive
        then): what proves a recorded pid still the run's once the main process is gone (procs)."""
        tr = self.tracker
        if self.spec.runtime != "native":  # a container's pids are of its own namespace
            return {}
        for pid in {p for p in (*tr.rank_pids().values(), tr.engine_pid) if p} - set(self._starts):
            try:
                self._starts[pid] = psutil.Process(pid).create_time()
            except psutil.Error:  # gone already, or a container's pid: nothing to prove it by
                continue
        return dict(self._starts)

    def _sync_tracker_to_state(self) -> bool:
        tr = self.tracker
        facts = {"rank_pids": tr.rank_pids(), "engine_pid": tr.engine_pid, "pid_starts": self._pid_starts(),
                 "dist_ids": sorted(tr.dist_ids),
                 "dist_paths": sorted(tr.dist_paths), "kv_cache_tokens": tr.kv_tokens,
                 "markers": {m: sorted(v) for m, v in tr.marker_ranks.items()}}
        changed = {k: v for k, v in facts.items() if self._saved.get(k) != v}
        if not changed:
            return True
        self._saved.update(changed)
        return self._update(**changed)

    # -- run ------------------------------------------------------------------------------------
    def _not_started(self, reason: str, code: int = EXIT_FAILED) -> Outcome:
        """Nothing was spawned: no state of this run may stay behind."""
        with contextlib.suppress(OSError, state.UnreadableState):
            state.remove(self.seat, self.spec.run_id)
        self._drop_rpc_dir()
        return self._finish(Outcome(False, code, reason, None, 0.0))

    def _drop_rpc_dir(self) -> None:
        if self.rpc_dir:
            with contextlib.suppress(OSError):  # empty: nothing ran that could have bound a socket there
                os.rmdir(self.rpc_dir)

    def _make_rpc_dir(self) -> str | None:
        if self.spec.runtime != "native":
            return None  # a container's sockets are in its own /tmp, gone with it
        try:
            return leftovers.make_rpc_dir(self.spec.env, self.spec.cwd)
        except leftovers.NoRpcDir as e:
            raise JobFailed(f"could not make a directory for vLLM's socket files ({e})",
                            hint="free space in the temp dir or fix its permissions, or point TMPDIR (the profile's "
                                 "env or this shell's) at a writable directory, then up again") from None

    def run(self) -> Outcome:
        # The signals are ours from before the state is written: a SIGTERM between that write and
        # the spawn left a "launching" state of a run that never started, said to be maybe running.
        with Interrupts() as intr:
            self.rpc_dir = self._make_rpc_dir()
            try:
                self.st = self._initial_state()
                state.save(self.st)
                state.atomic_write(self.run_dir / "run.json", json.dumps(
                    {"seat": self.seat, "run_id": self.spec.run_id, "argv": self.spec.argv, "env": self.spec.env,
                     "profile_digest": self.profile.digest(), "overrides": self.overrides, "started_at": self.t0,
                     "log": str(self.log_path), "rpc_dir": self.rpc_dir}, indent=2))
            except OSError as e:
                # nothing runs yet, and no state of a run that never started may stay behind
                with contextlib.suppress(OSError, state.UnreadableState):
                    state.remove(self.seat, self.spec.run_id)
                self._drop_rpc_dir()
                raise self._state_write_failed(e) from None
            except BaseException:
                self._drop_rpc_dir()  # nothing was spawned that could have used it
                raise
            if state.cancel_requested(self.seat):
                # a `down` that found no state yet asked us to stop; from here on it would find this one
                state.clear_cancel(self.seat)
                return self._not_started("stopped by `dsv4serve down` before vLLM was started; nothing was started")
            if intr.requested:
                return self._not_started(f"up stopped by {intr.label()} before vLLM was started; nothing was started",
                                         code=intr.exit_code())
            try:
                self.proc = spawn(self.spec, self.log_path, core_dumps=self.profile.runtime.core_dumps,
                                  rpc_dir=self.rpc_dir)
            except (OSError, ValueError) as e:  # ValueError: a NUL byte in argv or env (exec cannot carry it)
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                return self._not_started(f"could not start {self.spec.argv[0]}: {why}")
            pid = self.proc.pid
            # Reap our child the moment it exits: a zombie would hold `down`'s and our own
            # teardown's reap wait (Popen.poll() stays safe alongside a waiting thread).
            threading.Thread(target=self.proc.wait, name="dsv4serve-reaper", daemon=True).start()
            created = procs_start_time(pid)
            try:
                out = self._supervise(intr, pid, created)
            except DsvError as e:  # a state that cannot be written or read: its own words, not "a bug"
                out = self._after_crash(intr, Outcome(False, EXIT_FAILED, e.message, e.hint, time.time() - self.t0))
            except Exception as e:  # noqa: BLE001 - whatever broke in here, the seat must not run on unwatched
                out = self._after_crash(intr, self._crash_outcome(e))
            return self._finish(out)

    def _supervise(self, intr: Interrupts, pid: int, created: float | None) -> Outcome:
        if not self._update(pid=pid, pgid=pid, start_time=created, phase="starting"):
            # down took the state before it held a pid: it stopped nothing of ours (and said clean)
            return self._taken_over_outcome(intr, down_knew_pid=False)
        self.display.emit({"event": "spawn", "run_id": self.spec.run_id, "pid": pid, "pgid": pid,
                           "log": str(self.log_path),
                           "say": f"started run {self.spec.run_id}: pid {pid} (process group {pid}); "
                                  f"log {self.log_path}"})
        self.display.start()
        try:
            out = self._bring_up(intr)
        finally:
            self.display.stop(final=True)
        if out.ok and self.foreground:
            self._announce_ready(out)
            return self._attached(intr, out)
        return out

    def _crash_outcome(self, e: Exception) -> Outcome:
        """A bug of ours as a failure: the reason names it, the traceback goes into the run dir."""
        where = self.run_dir / "supervisor-error.txt"
        try:
            where.write_text(traceback.format_exc())
            hint = f"a dsv4serve bug: its traceback is in {where}"
        except OSError:
            hint = "a dsv4serve bug"
        return Outcome(False, EXIT_FAILED, f"dsv4serve failed while watching the seat: {type(e).__name__}: {e}",
                       hint, time.time() - self.t0)

    def _after_crash(self, intr: Interrupts, out: Outcome) -> Outcome:
        """Stop the seat after an exception escaped the supervision; a teardown already under way is
        not started twice: what it left is killed outright."""
        self.display.stop(final=False)
        if not self._tearing_down:
            return self._fail(out, intr)
        first = self._failing  # what the teardown that broke was stopping the seat for
        if first is not None:
            first.hint = "; ".join(x for x in (first.hint, f"and the teardown then failed: {out.reason}") if x)
            out = first
        if self.st is not None:
            with contextlib.suppress(Exception):
                out.stop_report = stop.stop_run(self.st, 0.0, escalate=intr.escalate)
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):  # as _fail ends: no stale "stopping" seat, and a last run
            if out.stop_report is None or out.stop_report.get("clean"):
                state.remove(self.seat, self.spec.run_id)
            state.save_last(self.seat, {"run_id": self.spec.run_id, "outcome": "failed", "reason": out.reason,
                                        "hint": out.hint, "log": str(self.log_path), "run_dir": str(self.run_dir),
                                        "clean": bool(out.stop_report and out.stop_report.get("clean"))})
        return out

    def _bring_up(self, intr: Interrupts) -> Outcome:
        self.tail = LogTail(self.log_path)
        canary_done_at: float | None = None
        while True:
            now = time.time()
            evs = self._drain(now)
            if evs:
                self.display.events(evs)
            self.display.tick(now)
            elapsed = now - self.t0
            if intr.requested:
                return self._fail(Outcome(False, intr.exit_code(), f"interrupted by {intr.label()}: the seat was not "
                                          "ready", None, elapsed, interrupted=True), intr)
            if self.display.broken is not None:
                return self._fail(Outcome(False, EXIT_FAILED, f"{self._output_lost()} while the seat was starting: "
                                          "stopped it rather than leave it running with nobody watching",
                                          self._OUTPUT_HINT, elapsed), intr)
            if self._taken_over(now):
                return self._taken_over_outcome(intr)
            if self.tracker.fatal:
                self._settle_fatal()
                return self._fail(self._from_fatal(elapsed), intr)
            rc = self.proc.poll() if self.proc else None
            if rc is not None:
                self.display.events(self._drain())
                if self._taken_over(float("inf")):
                    return self._taken_over_outcome(intr)
                if self.tracker.fatal:
                    return self._fail(self._from_fatal(elapsed), intr)
                return self._fail(Outcome(False, EXIT_FAILED, f"vLLM exited with code {rc} before the seat was ready "
                                          f"(in phase '{self.tracker.laggard().phase}')",
                                          f"see `{self._logs_cmd()}` for its last lines", elapsed), intr)
            dead = self._dead_rank()
            if dead is not None:
                return self._fail(Outcome(False, EXIT_FAILED, f"rank {dead[0]} (pid {dead[1]}) died while in phase "
                                          f"'{self.tracker.ranks[dead[0]].phase}'",
                                          f"see `{self._logs_cmd(dead[0])}`", elapsed), intr)
            if not self._sync_tracker_to_state():
                return self._taken_over_outcome(intr)
            kv_problem = self._kv_problem(final=False)
            if kv_problem:
                return self._fail(Outcome(False, EXIT_FAILED, kv_problem[0], kv_problem[1], elapsed), intr)
            if elapsed > self.t.total_s:
                return self._fail(Outcome(False, EXIT_FAILED, f"bring-up exceeded the hard cap of {self.t.total_s:.0f} s "
                                          f"({self._where()})", "raise gates.timeouts.total_s if this seat is just slow",
                                          elapsed, stalled=True), intr)
            if self._probe is None:
                stalled = self.tracker.stalled_for(now)
                if stalled > self.t.stall_s:
                    lag = self.tracker.laggard()
                    return self._fail(Outcome(
                        False, EXIT_FAILED,
                        f"no progress for {stalled:.0f} s (stall limit {self.t.stall_s:.0f} s): {lag.name} stopped in "
                        f"phase '{PHASE_LABEL.get(lag.phase, lag.phase)}' (last line: {lag.last_line[-160:]!r})",
                        "py-spy stacks are in the diagnostics when py-spy is installed; a hang at 100% GPU with no "
                        "error is usually two kernels on two streams (seat-reference trap 3)", elapsed, stalled=True),
                        intr)
                if self.tracker.api_serving:
                    self._start_probe()
            else:
                if self._probe_error is not None:
                    # the rank that crashed under the canary says more than the HTTP error
                    time.sleep(0.5)
                    self.display.events(self._drain())
                    if self.tracker.fatal:
                        return self._fail(self._from_fatal(elapsed), intr)
                    e = self._probe_error
                    return self._fail(Outcome(False, EXIT_FAILED, f"readiness: {e.message}", e.hint, elapsed), intr)
                if self._probe_result is not None:
                    if canary_done_at is None:
                        canary_done_at = now
                        said = canary_said(self._probe_result)
                        self.display.http = f"canary ok ({said})"
                        self.display.emit({"event": "readiness", **self._probe_result,
                                           "say": f"readiness: /health 200, /v1/models lists {self.spec.served_name}, "
                                                  f"canary returned {said}"})
                    missing = self._missing_markers()
                    kv_problem = self._kv_problem(final=True)
                    if not missing and not kv_problem:
                        if now - canary_done_at >= READY_SETTLE_S.get(self.spec.runtime, 2.0):
                            for rs in self.tracker.ranks.values():
                                rs.advance("ready", time.time())
                            return self._ready(Outcome(True, EXIT_OK, "ready", None, time.time() - self.t0,
                                                       readiness=self._probe_result))
                    elif now - canary_done_at > MARKER_GRACE_S:
                        reason, hint = missing or kv_problem  # type: ignore[misc]
                        return self._fail(Outcome(False, EXIT_FAILED, reason, hint, elapsed), intr)
                elif now - self._probe_started > self.t.ready_s + 30:
                    return self._fail(Outcome(False, EXIT_FAILED, f"readiness did not finish within {self.t.ready_s:.0f} s",
                                              None, elapsed), intr)
            time.sleep(POLL_S)

    # -- readiness probe --------------------------------------------------------------------------
    def _start_probe(self) -> None:
        self._probe_started = time.time()
        self.display.http = "probing /health"
        self.display.emit({"event": "http", "phase": "probing", "say": "API server serving: probing readiness"})
        base, deadline = self.spec_base_url(), time.time() + self.t.ready_s

        native = self.spec.runtime == "native" and self.st is not None

        def probe() -> None:
            try:
                owner_checked = 0.0
                while not readiness.health(base, timeout=3.0):
                    if time.time() > deadline:
                        raise JobFailed(f"{base}/health did not answer 200 within {self.t.ready_s:.0f} s")
                    if native and time.time() - owner_checked > OWNER_CHECK_S:
                        # another process took the port after up's own check: say so now, not after ready_s
                        owner_checked = time.time()
                        ours = {p.pid for p in procs.run_processes(self.st)}
                        other = readiness.foreign_listeners(self.spec.port, ours)
                        if other:
                            raise JobFailed(f"port {self.spec.port} is held by {other}, not by this seat, so its "
                                            "/health cannot answer", hint="stop that process, or pick another port: "
                                            "--set vllm.port=N")
                    time.sleep(0.5)
                self.display.http = "canary"
                ours = {p.pid for p in procs.run_processes(self.st)} if self.spec.runtime == "native" and self.st else None
                key = seat_api_key(self.spec.runtime, self.spec.argv, self.spec.env)
                self._probe_result = readiness.check(base, self.spec.served_name, self.profile.gates.canary,
                                                     timeout=max(5.0, deadline - time.time()), port=self.spec.port,
                                                     our_pids=ours, api_key=key)
            except JobFailed as e:
                self._probe_error = e
            except Exception as e:  # noqa: BLE001 - any probe crash is a readiness failure, reported
                self._probe_error = JobFailed(f"readiness probe crashed: {type(e).__name__}: {e}")

        self._probe = threading.Thread(target=probe, name="dsv4serve-readiness", daemon=True)
        self._probe.start()

    def spec_base_url(self) -> str:
        return state.http_base(self.spec.host, self.spec.port)

    # -- what the report tells the user to run ----------------------------------------------------
    _OUTPUT_HINT = ("keep `up`'s output open until it returns: send it to a file (`> up.log`), not into a reader "
                    "that quits early (`| head`)")

    def _output_lost(self) -> str:
        return f"stdout went away ({self.display.broken})"

    def _logs_cmd(self, rank: int | str | None = None) -> str:
        # `logs` without --profile is refused as soon as a second seat is known
        return f"dsv4serve logs --profile {self.seat}" + (f" --rank {rank}" if rank is not None else "")

    # -- gates ----------------------------------------------------------------------------------
    def _missing_markers(self) -> tuple[str, str] | None:
        missing = self.tracker.missing_markers(self.need)
        if not missing:
            return None
        parts = []
        for text, ranks in missing.items():
            have = sorted(self.tracker.marker_ranks.get(text, set()))
            parts.append(f"marker '{text}' seen on {len(have)} of the {self.need[text]} ranks it needs "
                         f"(ranks {','.join(map(str, have)) or 'none'}); missing on rank {', '.join(map(str, ranks))}")
        return ("; ".join(parts), "the plugin or kernel did not come up on those ranks: "
                f"`{self._logs_cmd(next(iter(missing.values()))[0])}`")

    def _kv_problem(self, final: bool) -> tuple[str, str | None] | None:
        want = self.profile.kv_min_tokens()
        if not want:
            return None
        kv = self.tracker.kv_tokens
        if kv is None and final and self.tracker.kv_host_tokens is not None:
            return (f"vLLM reported only its GPU + host KV cache size ({self.tracker.kv_host_tokens:,} tokens, "
                    "HiSparse): the gate counts the KV cache on the GPUs, which it did not report",
                    "run without HiSparse, or set gates.kv_cache_min_tokens: null to drop the gate")
        if kv is None:
            return ("vLLM never reported its KV cache size ('KV cache size: N tokens')", None) if final else None
        if kv < want:
            return (f"KV cache holds {kv:,} tokens, below the {want:,} the profile needs (gates.kv_cache_min_tokens)",
                    self._kv_hint(kv, want))
        return None

    def _kv_hint(self, kv: int, want: int) -> str:
        """A fix that can work for this gate: lowering max_model_len moves only a gate that follows
        it; a fixed number is met by a bigger KV cache or by asking for less."""
        if self.profile.gpus.ids:
            more = "give the KV cache more memory (raise vllm.gpu_memory_utilization, or free the seat's GPUs)"
        else:
            # the CPU backend's KV cache is VLLM_CPU_KVCACHE_SPACE GiB, whatever max_model_len is
            cur = self.profile.env.get("VLLM_CPU_KVCACHE_SPACE")
            try:
                need = str(math.ceil(float(cur) * want / kv)) if cur and kv > 0 else "<GiB>"
            except ValueError:
                need = "<GiB>"
            more = f"give the KV cache more memory (--set env.VLLM_CPU_KVCACHE_SPACE={need})"
        if self.profile.gates.kv_cache_min_tokens == "max_model_len":
            return f"the gate follows vllm.max_model_len: retry with --set vllm.max_model_len={kv}, or {more}"
        return (f"the gate is a fixed {want:,} tokens (max_model_len does not move it): {more}, or gate on what "
                f"fits: --set gates.kv_cache_min_tokens={kv}")

    def _dead_rank(self) -> tuple[int, int] | None:
        if self.spec.runtime != "native":
            return None  # container pids are not in our namespace
        for r, pid in self.tracker.rank_pids().items():
            if not state.pid_alive(pid):
                return r, pid
        return None

    def _where(self) -> str:
        lag = self.tracker.laggard()
        return f"{lag.name} in phase '{PHASE_LABEL.get(lag.phase, lag.phase)}'"

    def _drain(self, now: float | None = None) -> list[dict[str, Any]]:
        """Feed the tracker whatever the log holds that the tail has not read yet; its events.
        `now` stamps every line (one poll of the bring-up loop), else each line is stamped as read."""
        evs: list[dict[str, Any]] = []
        if self.tail is not None:
            for ln in self.tail.read():
                evs += self.tracker.feed(ln, time.time() if now is None else now)
        return evs

    def _settle_fatal(self) -> None:
        """Let every rank say why before the stop cuts them off: the report names each rank's first
        error (a rank that stays silent past FATAL_SETTLE_S is reported without one)."""
        deadline = time.time() + FATAL_SETTLE_S
        while sum(1 for r in self.tracker.ranks.values() if r.first_error) < self.tp and time.time() < deadline:
            time.sleep(POLL_S)
            self._drain()

    def _from_fatal(self, elapsed: float) -> Outcome:
        f = self.tracker.fatal[0]
        who = f"rank {f.rank}" if f.rank is not None else f.stream
        return Outcome(False, EXIT_FAILED, f"{who}: {f.line}", f.hint, elapsed)

    # -- endings --------------------------------------------------------------------------------
    def _ready(self, out: Outcome) -> Outcome:
        tr = self.tracker
        ok = self._update(phase="ready", ready_at=time.time(), phase_detail=f"ready in {out.seconds:.0f} s",
                          rank_pids=tr.rank_pids(), engine_pid=tr.engine_pid, pid_starts=self._pid_starts(),
                          kv_cache_tokens=tr.kv_tokens,
                          markers={m: sorted(v) for m, v in tr.marker_ranks.items()},
                          dist_ids=sorted(tr.dist_ids), dist_paths=sorted(tr.dist_paths),
                          supervisor_pid=os.getpid() if self.foreground else None)
        if not ok:
            return Outcome(False, EXIT_FAILED, "stopped by `dsv4serve down` just as it became ready", None,
                           out.seconds, taken_over=True)
        state.save_last(self.seat, {"run_id": self.spec.run_id, "outcome": "ready", "seconds": round(out.seconds, 1),
                                    "log": str(self.log_path), "run_dir": str(self.run_dir)})
        if not self.foreground:
            # The seat is ready and recorded so: a READY line that cannot be printed any more changes
            # nothing the exit code and `status` do not already say.
            self._announce_ready(out)
        return out

    def _announce_ready(self, out: Outcome) -> None:
        tr = self.tracker
        marks = ", ".join(f"'{m}' on {len(r)}/{self.tp} ranks" for m, r in tr.marker_ranks.items()) or "none gated"
        kv = f"{tr.kv_tokens:,} tokens" if tr.kv_tokens is not None else "not reported"
        self.display.emit({"event": "ready", "seat": self.seat, "run_id": self.spec.run_id,
                           "seconds": round(out.seconds, 1), "endpoint": f"{self.spec_base_url()}/v1",
                           "model": self.spec.served_name, "pid": self.proc.pid if self.proc else None,
                           "markers": {m: sorted(v) for m, v in tr.marker_ranks.items()},
                           "kv_cache_tokens": tr.kv_tokens, "canary": out.readiness.get("canary"),
                           "canary_tokens": out.readiness.get("canary_tokens"),
                           "canary_expect": out.readiness.get("canary_expect")})
        if not self.json_events:
            self.display.say("[bold green]READY[/] " + escape(
                f"seat {self.seat} in {out.seconds:.1f} s: {self.spec_base_url()}/v1 model {self.spec.served_name}; "
                f"markers {marks}; KV cache {kv}; canary {canary_said(out.readiness)}"), soft_wrap=True)

    def _taken_over_outcome(self, intr: Interrupts, down_knew_pid: bool = True) -> Outcome:
        """`down` owns the teardown now: reap our child so `down`'s reap wait can finish, write nothing.
        A `down` that took the state before the pid was in it is not stopping our child: no wait."""
        deadline = time.time() + (TAKEN_OVER_WAIT_S if down_knew_pid else 0.0)
        while self.proc is not None and self.proc.poll() is None and time.time() < deadline:
            time.sleep(POLL_S)
        if self.proc is not None and self.proc.poll() is None:
            # `down` missed it (e.g. its scan ran before the child carried the run tag): the child
            # and its group are ours, and nobody else will stop them now
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        if self._attached_ready:
            # wherever it was noticed first (the takeover poll, or the rank death down's SIGTERM causes)
            return Outcome(True, EXIT_OK, "stopped by `dsv4serve down`", None, time.time() - self.t0,
                           taken_over=True)
        return Outcome(False, EXIT_FAILED, "stopped by `dsv4serve down` before the seat was ready", None,
                       time.time() - self.t0, taken_over=True)

    def _claim(self, why: str) -> bool:
        """Mark the seat stopping for our own teardown: False when `down` marked it first (the
        teardown and the story are then its own). A mark that cannot be written (a full disk) or a
        state that no longer reads does not hold the teardown up: the mark is bookkeeping."""
        assert self.st is not None
        try:
            return state.claim_stop(self.seat, self.st.run_id, why) is not None
        except (OSError, state.UnreadableState):
            return True

    def _fail(self, out: Outcome, intr: Interrupts) -> Outcome:
        """Snapshot the processes (and their stacks on a stall), stop the seat (SIGKILL on a second
        Ctrl-C), write the bundle. Nothing written to the user, the state or the disk comes between
        the decision and the stop in a way that could skip it: each of those can fail (stdout gone,
        disk full) and is only ever reported."""
        from dsv4serve import diagnostics

        out.hint = with_seat(out.hint, self.seat)
        self._failing = out
        st = self.st
        snapshot_procs = [procs.describe(p) for p in procs.run_processes(st)] if st else []
        # `down` may have caused this very failure (its SIGTERM makes the ranks raise): if it
        # marked the seat first, the teardown and the story are its own.
        if st is not None and not self._claim(f"failed: {out.reason[:200]}"):
            return self._taken_over_outcome(intr)
        self._tearing_down = True
        self.display.emit({"event": "stopping", "reason": out.reason, "say": f"failed: stopping the seat ({out.reason[:120]})"})
        stacks = None
        if out.stalled:
            # before the stop: py-spy can only dump a process that still runs
            stacks = diagnostics.dump_stacks(self.run_dir, [p["pid"] for p in snapshot_procs if not p.get("gone")])
        # Still starting: SIGTERM is swallowed, so the short grace (the SIGKILL does the work).
        grace = min(self.t.shutdown_grace_s, stop.STARTUP_GRACE_S)
        rep = stop.stop_run(st, grace, escalate=intr.escalate) if st else None
        out.stop_report = rep
        self._drain()  # the processes are gone: the log is complete, and what it says goes in the report
        tr = self.tracker
        try:
            out.diagnostics = str(diagnostics.bundle(
                self.run_dir, self.log_path, reason=out.reason, hint=out.hint, snapshot=tr.snapshot(time.time()),
                first_errors=tr.first_errors(),
                launch={"argv": self.spec.argv, "env": self.spec.env, "endpoint": self.spec_base_url(),
                        "runtime": self.spec.runtime, "profile": self.profile.name, "digest": self.profile.digest(),
                        "overrides": self.overrides},
                processes=snapshot_procs, gpu_ids=list(self.profile.gpus.ids), stacks=stacks))
        except OSError:
            out.diagnostics = None  # a full disk: the failure itself is still reported
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(OSError, state.UnreadableState):
            if rep is None or rep["clean"]:
                state.remove(self.seat, self.spec.run_id)
            else:
                self._force_update(phase="failed", phase_detail=f"{out.reason[:200]} (teardown not clean: "
                                                                f"{why_not_clean(rep, self.seat)[:200]})")
        state.save_last(self.seat, {"run_id": self.spec.run_id, "outcome": "failed", "reason": out.reason,
                                    "hint": out.hint, "diagnostics": out.diagnostics, "log": str(self.log_path),
                                    "run_dir": str(self.run_dir), "clean": bool(rep and rep["clean"])})
        return out

    def _force_update(self, **changes: Any) -> None:
        state.update(self.seat, self.spec.run_id, even_stopping=True, **changes)

    def _attached(self, intr: Interrupts, ready: Outcome) -> Outcome:
        """--foreground: echo the log, watch for a crash, tear down on Ctrl-C (twice: SIGKILL)."""
        # The bring-up's own tail reads on from its last line: a fresh tail skipped to the end would
        # drop, unchecked, whatever was written between the ready verdict and this point.
        tail = self.tail
        n_fatal = len(self.tracker.fatal)
        self._attached_ready = True
        if not self.json_events:
            self.display.say("attached: Ctrl-C stops the seat (a second Ctrl-C kills it at once)")
        while True:
            now = time.time()
            for ln in tail.read():
                evs = self.tracker.feed(ln, now)
                if self.json_events:
                    for e in evs:
                        if e["event"] == "fatal":
                            self.display.line(e)
                else:  # a bar's redraws as the last of them, a record's carriage returns as spaces
                    self.display.say(ln.rstrip("\r").rsplit("\r", 1)[-1] if not ln.startswith("(") else
                                     ln.replace("\r", " "), markup=False, soft_wrap=True)
            if intr.requested:
                return self._stop_attached(intr, f"stopped by {intr.label()}", EXIT_OK)
            if self.display.broken is not None:
                return self._stop_attached(intr, f"{self._output_lost()}: stopped the seat rather than leave it "
                                           "running with nobody watching", EXIT_FAILED, self._OUTPUT_HINT)
            if self._taken_over(now):
                return self._taken_over_outcome(intr)
            new_fatal = self.tracker.fatal[n_fatal:]
            n_fatal = len(self.tracker.fatal)
            f = next((f for f in new_fatal if f.ends_serving), None)
            if f is not None:  # as status judges a ready seat: one request's traceback is not the seat's end
                return self._fail(Outcome(False, EXIT_FAILED, f"after ready: {f.stream}: {f.line}", f.hint,
                                          now - self.t0), intr)
            rc = self.proc.poll() if self.proc else None
            if rc is not None:
                return self._fail(Outcome(False, EXIT_FAILED, f"vLLM exited with code {rc} after the seat was ready",
                                          f"see `{self._logs_cmd()}` for its last lines", now - self.t0), intr)
            dead = self._dead_rank()
            if dead is not None:
                return self._fail(Outcome(False, EXIT_FAILED, f"rank {dead[0]} (pid {dead[1]}) died after the seat "
                                          "was ready", f"see `{self._logs_cmd(dead[0])}`", now - self.t0), intr)
            time.sleep(POLL_S)

    def _stop_attached(self, intr: Interrupts, why: str, code: int, hint: str | None = None) -> Outcome:
        st = self.st
        if st is None or not self._claim(why):
            return self._taken_over_outcome(intr)
        self._tearing_down = True
        if not self.json_events:
            self.display.say(f"stopping seat {self.seat} ({why}; grace {self.t.shutdown_grace_s:.0f} s)")
        rep = stop.stop_run(st, self.t.shutdown_grace_s, escalate=intr.escalate)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if rep["clean"]:
            with contextlib.suppress(OSError, state.UnreadableState):
                state.remove(self.seat, st.run_id)
        state.save_last(self.seat, {"run_id": st.run_id, "outcome": "stopped", "reason": why,
                                    "log": str(self.log_path), "clean": rep["clean"]})
        return Outcome(rep["clean"] and code == EXIT_OK, code if rep["clean"] else EXIT_FAILED, why, hint,
                       time.time() - self.t0, stop_report=rep)

    def _finish(self, out: Outcome) -> Outcome:
        if out.ok or out.code == EXIT_OK:
            if out.taken_over:
                # an attached `up` that `down` stopped: say so (it used to exit 0 without a word);
                # the teardown and its report are `down`'s
                if self.json_events:
                    self.display.line({"t": round(time.time(), 3), "event": "stopped", "reason": out.reason,
                                       "by": "down"})
                else:
                    self.display.say(f"seat {self.seat} {out.reason}; the stop report is down's", markup=False)
            elif self.json_events and out.stop_report is not None:
                self.display.line({"t": round(time.time(), 3), "event": "stopped", "reason": out.reason,
                                   "clean": out.stop_report["clean"]})
            return out
        report_failure(self.seat, self.tracker, out, self.json_events and self.display.broken is None)
        return out


def why_not_clean(rep: dict[str, Any], seat: str) -> str:
    """Why a stop report is not clean, as the fix needs it said."""
    why = []
    left = [p.get("pid") for p in rep.get("remaining", [])]
    if left:
        why.append(f"LEFT RUNNING: {left}")
    if rep.get("unreaped"):
        why.append(f"not reaped yet: {rep['unreaped']}")
    name = rep.get("container") or "the container"
    if rep.get("container_left") is True:
        why.append(f"container {name} is still there: `docker rm -f {name}`, then `dsv4serve down --profile {seat}`")
    elif "container_left" in rep and rep["container_left"] is None:
        said = f" (docker: {rep['container_check']})" if rep.get("container_check") else ""
        why.append(f"docker could not say whether container {name} is gone{said}: check that the docker daemon "
                   f"runs and lets you in (`docker ps -a --filter name={name}`), then "
                   f"`dsv4serve down --profile {seat}`")
    if rep.get("leftovers_failed"):
        why.append(f"could not remove {', '.join(rep['leftovers_failed'])}")
    if (rep.get("gpu") or {}).get("ours"):
        why.append(f"still holding GPU memory: {rep['gpu']['ours']}")
    if rep.get("port_free") is False and rep.get("port_owner") is None:
        why.append("the port is still bound by a process that cannot be seen")
    return "; ".join(why) or "not clean"


def report_failure(seat: str, tracker: SeatTracker, out: Outcome, json_events: bool) -> None:
    """The failure on stderr (as JSON on stdout with --json). Written as far as the streams still
    take it: the seat is already stopped, and a report that cannot be written must not turn into a
    traceback (or, with a closed stdout, into a silent exit)."""
    first = tracker.first_errors()
    rep = out.stop_report or {}
    left = [p.get("pid") for p in rep.get("remaining", [])]
    not_clean = None if out.stop_report is None or rep.get("clean") else why_not_clean(rep, seat)
    if json_events:
        try:
            emit_json_line({"t": round(time.time(), 3), "event": "failed", "seat": seat, "reason": out.reason,
                            "hint": out.hint, "first_errors": first, "diagnostics": out.diagnostics,
                            "stopped_by_down": out.taken_over, "interrupted": out.interrupted,
                            "clean": rep.get("clean"), "left_running": left,
                            "container_left": rep.get("container_left"), "not_clean": not_clean})
            return
        except OUTPUT_ERRORS:
            silence(sys.stdout)  # the human lines below, on stderr, are all that is left

    lines = [f"[bold red]FAILED[/] seat {seat} after {out.seconds:.1f} s: {escape(out.reason)}"]
    lines += [f"  first error on {who}: {line}" for who, line in first.items()]
    if out.hint:
        lines.append(f"  hint: {out.hint}")
    if out.stop_report is not None:
        lines.append(f"  stopped {len(rep.get('signalled', []))} processes ({len(rep.get('killed', []))} needed "
                     f"SIGKILL), removed {len(rep.get('leftovers_removed', []))} leftovers; "
                     + ("nothing left" if rep.get("clean") else str(not_clean)))
    if out.diagnostics:
        lines.append(f"  diagnostics: {out.diagnostics}")
    for i, line in enumerate(lines):
        try:
            # only the first line is markup; the others carry log text that may contain brackets
            err_console.print(line, highlight=False, markup=i == 0, soft_wrap=True)
        except OUTPUT_ERRORS:
            silence(err_console.file)
            return


def procs_start_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


__all__ = ["Outcome", "LogTail", "Interrupts", "Display", "Supervisor", "spawn", "report_failure",
           "MARKER_GRACE_S", "EXIT_INTERRUPTED"]
