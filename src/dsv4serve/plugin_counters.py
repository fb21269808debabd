"""Per-rank MoE call counters the vLLM plugin keeps, and their JSON file under the run directory.

The MoE call path only bumps Python ints under a lock: no file I/O, no device work, so nothing
here can sync the host or touch a CUDA graph being captured. A daemon thread writes the file
every few seconds when something changed, and a final write (`"final": true`) is made on
SIGTERM/SIGINT and at process exit. That keeps `check-seat` and `status` (which read
`state.counters_path(run_dir, rank)`) at most one interval behind. The final write is best
effort: on a process-group stop vLLM's engine SIGKILLs its workers moments after the SIGTERM,
and a worker that loses that race keeps its last periodic file (`"final": false`).

What the numbers mean: CUDA-graph replays do not re-enter Python, so a counter counts eager
calls plus captured calls (each capture of a graph counts once, however often it is replayed).
On a fully graphed decode the lna2 count therefore stops growing after warmup; it proves the
kernel was wired and captured, and prefill (eager) keeps the incumbent count moving. Because a
replay is invisible here, the calls made while a CUDA graph was being captured are also kept per
captured row count (`graphs`): a graph whose capture declined replays the incumbent on every decode
step of that size while the counts above show a single decline.

File schema (one object per rank, written atomically)::

    {"rank": int, "tp": int, "pid": int, "kernel": "lna2"|"incumbent"|"none", "layers": int,
     "calls": {"lna2": int, "incumbent": int}, "declines": {reason: int},
     "parity": {"layers": int, "of": int, "worst": float},
     "graphs": {rows: {"lna2": int, "declined": int, "incumbent": int}},
     "updated": float (epoch s), "final": bool}

In `graphs`, "declined" counts captured calls of layers lna2 was meant to serve that went to the
incumbent; "incumbent" those of layers that are the incumbent's by design (kernel incumbent, a
draft whose experts are not EXL3).
"""

from __future__ import annotations

import atexit
import json
import multiprocessing.util
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from dsv4serve.state import atomic_write, counters_path

FLUSH_INTERVAL_S = 2.0  # check-seat waits 5 s for the counters to move: stay well inside that
SIGNAL_WRITE_WAIT_S = 1.0  # a signal handler waits at most this long for a flusher write in flight
MAX_DECLINE_KEYS = 64  # a runaway reason text must not grow the file without bound
MAX_GRAPH_SIZES = 1024  # vLLM captures a few dozen sizes; a bound keeps a runaway from growing the file
GRAPH_KINDS = ("lna2", "declined", "incumbent")
OTHER_DECLINES = "other reasons (past the reason limit)"


# lna2 against the incumbent on the seat's own layers, per row (relative L2, each side within its
# ~1e-3 of the fp64 reference, plus an fp16 / bf16 output's rounding): a wiring fault (gate and up
# swapped, another permutation, a scale applied twice) is off by O(1), far past this. The dispatch
# checks against it; check-seat reads the result from the counters.
PARITY_TOL = 2e-2
PARITY_DECLINE = "parity mismatch against the incumbent"  # the decline a strict-0 mismatch is counted as


def graph_sizes(graphs: Any) -> dict[int, dict[str, int]] | None:
    """A counters file's `graphs` as {rows: calls by kind}; None when the rank recorded none (a
    plugin from before the record)."""
    if not isinstance(graphs, dict):
        return None
    out: dict[int, dict[str, int]] = {}
    for k, v in graphs.items():
        if str(k).isdigit() and isinstance(v, dict):
            out[int(k)] = {kind: int(n) for kind, n in v.items() if isinstance(n, (int, float))}
    return out


def sizes_text(sizes: list[int], most: int = 12) -> str:
    """Row counts for a line of text: the first `most`, then how many more."""
    return ", ".join(map(str, sizes[:most])) + (f" (+{len(sizes) - most} more)" if len(sizes) > most else "")


class Counters:
    """Thread-safe counters for one worker process (one TP rank)."""

    def __init__(self, run_dir: str | Path | None, rank: int, tp: int, kernel: str,
                 interval_s: float = FLUSH_INTERVAL_S) -> None:
        self.path: Path | None = counters_path(run_dir, rank) if run_dir else None
        self.rank, self.tp, self.kernel = rank, tp, kernel
        self.layers = 0
        self.calls: dict[str, int] = {"lna2": 0, "incumbent": 0}
        self.declines: dict[str, int] = {}
        # lna2 layers whose output matched the incumbent's on a call of their own, and the worst row
        self.parity_layers = 0
        self.parity_of = 0  # the lna2 layers there are to verify
        self.parity_worst = 0.0
        self.graphs: dict[int, dict[str, int]] = {}  # captured row count -> calls by kind (module docstring)
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._dirty = True
        self._final = False
        self._written_final = False
        self._write_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.write_errors = 0

    # -- the hot path: ints only ---------------------------------------------------------------
    def call(self, kind: str) -> None:
        with self._lock:
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self._dirty = True

    def decline(self, reason: str) -> None:
        with self._lock:
            if reason not in self.declines and len(self.declines) >= MAX_DECLINE_KEYS:
                reason = OTHER_DECLINES
            self.declines[reason] = self.declines.get(reason, 0) + 1
            self._dirty = True

    def captured(self, rows: int, kind: str) -> None:
        """One call made while a CUDA graph of `rows` rows was being captured, by kind (GRAPH_KINDS)."""
        with self._lock:
            per = self.graphs.get(rows)
            if per is None:
                if len(self.graphs) >= MAX_GRAPH_SIZES:
                    return
                per = self.graphs[rows] = dict.fromkeys(GRAPH_KINDS, 0)
            per[kind] = per.get(kind, 0) + 1
            self._dirty = True

    def verified(self, layers: int, worst: float) -> None:
        with self._lock:
            self.parity_layers = layers
            self.parity_worst = max(self.parity_worst, worst)
            self._dirty = True

    def set_layers(self, n: int, lna2: int = 0) -> None:
        with self._lock:
            self.layers, self.parity_of = n, lna2
            self._dirty = True

    # -- the file ------------------------------------------------------------------------------
    def snapshot(self, final: bool = False) -> dict[str, Any]:
        with self._lock:
            return self._snap(final)

    def _snap(self, final: bool) -> dict[str, Any]:
        return {"rank": self.rank, "tp": self.tp, "pid": os.getpid(), "kernel": self.kernel,
                "layers": self.layers, "calls": dict(self.calls), "declines": dict(self.declines),
                "parity": {"layers": self.parity_layers, "of": self.parity_of, "worst": self.parity_worst},
                "graphs": {str(rows): dict(per) for rows, per in sorted(self.graphs.items())},
                "updated": time.time(), "final": final}

    def write(self, final: bool = False, *, from_signal: bool = False) -> bool:
        """Write the file now (atomically); False when there is no run dir or the write failed.
        `from_signal`: called from a signal handler on the main thread, which may be inside
        call()'s `with self._lock` or inside this very method: the ints are copied without the
        counters' lock (the interrupted bytecode leaves them consistent: dict updates are single
        bytecodes), and the write lock, which the flusher thread may hold mid-write, is waited for
        only a moment; blocking on either would hang the worker until its SIGKILL."""
        if self.path is None:
            return False
        # Serialised, and nothing overwrites the final file: the flusher thread may be mid-write
        # when close() runs.
        if not self._write_lock.acquire(timeout=SIGNAL_WRITE_WAIT_S if from_signal else -1):
            return False  # the final write is best effort; the last periodic file stays
        try:
            if self._written_final:
                return False
            if from_signal:
                snap = self._snap(final)
            else:
                with self._lock:
                    self._dirty = False
                snap = self.snapshot(final)
            try:
                # 0644: a docker seat's workers write as root into the host's run dir, and the
                # user's status and check-seat must read it (mkstemp alone gives 0600)
                atomic_write(self.path, json.dumps(snap, sort_keys=True) + "\n", mode=0o644)
            except OSError:
                # The run dir vanished or the disk is full: counting goes on, the next write
                # retries. The missing or stale file is what check-seat then reports.
                self.write_errors += 1
                if not from_signal:
                    with self._lock:
                        self._dirty = True
                return False
            self._written_final = final
            return True
        finally:
            self._write_lock.release()

    def flush_if_dirty(self) -> None:
        if self._dirty and not self._final:
            self.write()

    def start(self, handle_signals: bool = True) -> None:
        """Write once now, then every interval from a daemon thread; write final at exit (and,
        with handle_signals, on SIGTERM/SIGINT before the handler that was there)."""
        self.write()
        if self._thread is None and self.path is not None:
            self._thread = threading.Thread(target=self._run, name="dsv4serve-counters", daemon=True)
            self._thread.start()
            # atexit covers interpreters that exit normally (spawned workers end in sys.exit);
            # multiprocessing's own finalizers cover forked children, which end in os._exit
            # after running them. close() is idempotent, so both may fire.
            atexit.register(self.close)
            multiprocessing.util.Finalize(None, self.close, exitpriority=100)
            if handle_signals:
                self._chain_signals()

    def _chain_signals(self) -> None:
        """Write the final file on SIGTERM/SIGINT, then run whatever handler was there.

        vLLM's workers turn SIGTERM into SystemExit, but on a process-group stop the engine
        SIGKILLs its workers right after, so exit hooks alone rarely get to run. Writing first
        (a few ms) usually wins that race; the previous handler then behaves as before.
        """
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal only works there; the exit hooks still apply
        for sig in (signal.SIGTERM, signal.SIGINT):
            prev = signal.getsignal(sig)

            def handler(signum: int, frame: Any, prev: Any = prev) -> None:
                self._close_from_signal()
                if callable(prev):
                    prev(signum, frame)
                elif prev == signal.SIG_DFL:
                    signal.signal(signum, signal.SIG_DFL)
                    os.kill(os.getpid(), signum)

            try:
                signal.signal(sig, handler)
            except (ValueError, OSError):
                return

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush_if_dirty()

    def close(self) -> None:
        if self._final:
            return
        self._final = True
        self._stop.set()
        self.write(final=True)

    def _close_from_signal(self) -> None:
        """close() for a signal handler: see write(from_signal=True)."""
        if self._final:
            return
        self._final = True
        self._stop.set()
        self.write(final=True, from_signal=True)
