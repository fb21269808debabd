"""Split vLLM's single output stream into per-process streams and track each rank's bring-up.

vLLM prefixes every line a worker or the engine writes through its logger with the process name
and pid: `(APIServer pid=N)`, `(EngineCore pid=N)` / `(EngineCore_DP0 pid=N)`, `(VllmWorker-3
pid=N)` before init_worker relabels it, `(Worker pid=N)` at TP 1 and during early init, and
`(Worker_TP3 pid=N)` (or `Worker_PP0_TP3`) afterwards. Versions differ, so ranks are learnt from
whatever identifies them (TP in the name, the VllmWorker index, `rank r in world size` / `world_size=
W rank=r` in vLLM's own init lines, `rank=r/tp` in our plugin's lines) and remembered per pid, so a
later `(Worker pid=N)` line or an unprefixed glog line (`W1202 19:04:16.38 22801 torch/...`) of the
same pid lands on the right rank. Unprefixed lines without a pid (uvicorn, tqdm bars, Python
warnings) belong to the API server's stream, except the safetensors bar, which only rank 0 draws.

Every analysis runs on the message with vLLM's `LEVEL MM-DD HH:MM:SS [file.py:N] ` header cut off,
because vLLM logs a traceback through its logger, header and prefix on every line.
"""

from __future__ import annotations

import copy
import os
import pickle
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4serve.errors import ProfileError
from dsv4serve.state import atomic_write

# `(VllmWorker TP3 pid=N)` in some releases: a space may sit inside the name
PREFIX = re.compile(r"^\((?P<proc>[A-Za-z][A-Za-z0-9_\- ]*) pid=(?P<pid>\d+)\)\s?(?P<rest>.*)$")
_EMBEDDED_PREFIX = re.compile(r"\([A-Za-z][A-Za-z0-9_\- ]* pid=\d+\)")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # VLLM_LOGGING_COLOR / FORCE_COLOR, inherited from the shell
_LEVEL = re.compile(r"^(?:ERROR|CRITICAL)\b")
# uvicorn's access log (on by default, no process prefix): `INFO:     <client> - "GET <path> HTTP/1.1"
# 404 ...`. It quotes the request line as any client sent it (`GET /?EngineDeadError`), and the client
# part is X-Forwarded-For as a local client wrote it (spaces, a bar's end, a worker's prefix): known
# by its level head and its tail, whatever lies between.
ACCESS_LOG = re.compile(r'^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):\s.* - "[!#$%&\'*+.^_`|~0-9A-Za-z-]+ \S* '
                        r'HTTP/\d(?:\.\d)?" \d{3}\b')  # the method: any HTTP token (M-SEARCH, get)
# vLLM's request log and the access log echo what users sent: text in a prompt is not the seat's own error
_REQUEST_ECHO = re.compile(r"\b(?:Received request|Generated response|Added request) \S+|"
                           r"\bRequest \S+ (?:details|JSON body):|" + ACCESS_LOG.pattern)
# the end of a tqdm bar (`... 0%|          | 0/67 [00:00<?, ?it/s]`, vLLM's `| 1/1 [00:00<00:00, ...]`)
_BAR_END = re.compile(r"\|\s*\d+/\d+\s*\[[^\]]*\]\s*$")
LOG_HEAD = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+(?:\d\d-\d\d(?: \d\d:\d\d:\d\d(?:\.\d+)?)?\s+)?"
                      r"(?:\[[^\]]+\] ?)?")
GLOG_PID = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +(\d+) ")
_TP_IN_NAME = re.compile(r"TP(\d+)")
_VLLMWORKER = re.compile(r"^VllmWorker-(\d+)$")
_ASSIGNED = re.compile(r"\brank (\d+) in world size (\d+) is assigned as .*?\bTP rank (\d+)")
_WORLD = re.compile(r"\bworld_size=(\d+) rank=(\d+)\b")
_OUR_RANK = re.compile(r"\brank=(\d+)/(\d+)\b")
OWN_MARKER_HEADS = ("LNA2 ", "dsv4serve plugin")  # the plugin's proof lines (vllm_plugin's docstring)
LNA2_ACTIVE_LINE = "LNA2 MoE kernel ACTIVE rank="
_ACTIVE_EXT = re.compile(r"^LNA2 MoE kernel ACTIVE rank=(\d+)/(\d+) .*?\bext=(\S+)")
SHARDS = re.compile(r"Loading safetensors checkpoint shards:\s+(\d+)% Completed \|\s*(\d+)/(\d+)")
# not vLLM's "GPU + host KV cache size" (HiSparse): host memory is no GPU KV the gate may count
KV_TOKENS = re.compile(r"\b(?:(?:GPU|CPU|XPU|TPU|NPU) )?(?<!host )KV cache size: (\d[\d,]*) tokens")
KV_HOST_TOKENS = re.compile(r"\b[A-Z]+ \+ host KV cache size: (\d[\d,]*) tokens")  # said instead, with HiSparse
KV_MEMORY = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
MAXLEN_HINT = re.compile(r"estimated maximum model length is (\d+)")
DIST_ID = re.compile(r"vllm_dist_([0-9a-f]{8,})")
DIST_PATH = re.compile(r"distributed_init_method=file://(\S+)")
TRACEBACK = "Traceback (most recent call last):"
# The last line of a traceback: `pkg.mod.SomeError: message` (bare `Exception:` included).
EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure|Warning)\b(?::.*)?$")
_EXC_NAME = re.compile(r"^[A-Za-z_][\w.]*: \S")  # any `Name: message`, e.g. a custom exception class
_TB_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")
# Lines vLLM (or our own polling) repeats while nothing moves: they must not reset the stall timer.
HEARTBEAT = re.compile(r"Waiting for \d+ local|Avg prompt throughput|SpecDecoding metrics|"
                       r"\"GET /(?:health|v1/models|metrics)|Waiting for shard|still loading")

# Phases in bring-up order; a rank only moves forward (phases may be skipped: at TP 2 only rank 0
# logs "Loading weights took", and an eager seat captures no graphs).
PHASES = ["starting", "loading", "loaded", "kv_sized", "graphs", "marker", "ready"]
PHASE_LABEL = {"starting": "starting", "loading": "loading weights", "loaded": "weights loaded",
               "kv_sized": "KV cache sized", "graphs": "graphs/warmup done", "marker": "markers seen",
               "ready": "ready"}
_RANK_PHASE = [
    ("loading", re.compile(r"Starting to load model|Loading model from scratch|Loading weights")),
    ("loaded", re.compile(r"Loading weights took|Model loading took|model weights took|Loading drafter model|"
                          r"dsv4serve plugin ready")),
    ("kv_sized", re.compile(r"for KV cache|Available KV cache memory|KV cache initialized|KV cache size")),
    ("graphs", re.compile(r"Graph capturing finished|Capturing CUDA graphs|cudagraph capturing finished")),
]
_DIED = re.compile(r"Worker proc VllmWorker-(\d+) died")
_ENGINE_UP = re.compile(r"init engine \(.*\) took")
_API_SERVING = re.compile(r"Starting vLLM server on|Application startup complete")

# argparse refusing vLLM's own command line (`api_server.py: error: argument --dtype: ...`): the
# process exits 2 at once, and this line is the only one that says why
ARGV_ERROR = re.compile(r"^[\w.-]+(?: [\w.-]+)?: error: (?:argument |unrecognized arguments|the following "
                        r"arguments)")  # "api_server.py: error:" or "vllm serve: error:"

FATAL = [
    ("oom", re.compile(r"CUDA out of memory|OutOfMemoryError|Cannot allocate memory|\bMemoryError\b")),
    ("max_model_len", MAXLEN_HINT),
    ("nccl", re.compile(r"NCCL error|ncclInternalError|ncclSystemError|ncclUnhandledCudaError|"
                        r"Watchdog caught collective|NCCL communicator was aborted|watchdog got stuck")),
    # a process killed by C++ or a signal: its last words are not a Python traceback
    ("crash", re.compile(r"terminate called after throwing an instance of|^Fatal Python error: |"
                         r"\*\*\* SIG(?:SEGV|ABRT|BUS|ILL|FPE) received|Segmentation fault \(core dumped\)")),
    ("rank_died", re.compile(r"died unexpectedly|Worker proc \S+ died|WorkerProc hit an exception|"
                             r"Engine core initialization failed|EngineCore encountered a fatal error|"
                             r"EngineDeadError")),
    ("cuda", re.compile(r"CUDA error: |an illegal memory access|device-side assert triggered")),
    ("plugin", re.compile(r"dsv4serve plugin FAILED")),
    # the docker client's own errors (exit 125-127): the engine never ran the container, so no
    # vLLM line follows to say why
    ("docker", re.compile(r"^docker: |^Error response from daemon: |Cannot connect to the Docker daemon")),
    ("argv", ARGV_ERROR),
]


@dataclass
class ParsedLine:
    proc: str | None
    pid: int | None
    text: str


def _record(line: str) -> bool:
    """Whether a line is one log record: it starts with a process prefix and its text is not a bar.
    vLLM 0.32 prefixes records only; older ones (the seat image's 0.28) prefix each raw line written
    to stdout / stderr, so a tqdm bar there reads `(Worker_TP0 pid=N) \\r<bar>\\r<bar>...`: a
    prefix followed at once by a carriage return, which no record has."""
    m = PREFIX.match(line)
    return m is not None and not line[m.end("pid") + 1:].lstrip(" ").startswith("\r")


def physical_parts(raw: str) -> list[str]:
    """The log lines one line of the file holds. A tqdm bar (rank 0's shard loading, CUDA-graph
    capture) redraws itself after a carriage return and ends no line, so the next process's line is
    glued to its last redraw: `Capturing CUDA graphs: 0%| | 0/67 [00:00<?, ?it/s](Worker_TP3 pid=N)
    ...`. In a part that carries no prefix of its own (a bar does not), a process prefix right after
    a bar's end starts a line of its own; anywhere else a prefix is text, so a prompt that quotes a
    worker's line in a request log (prefixed by the API server) forges nothing. Colour codes go."""
    clean = ANSI.sub("", raw.rstrip("\n"))
    if _record(clean) or ACCESS_LOG.match(clean):
        # one log record: a carriage return inside it is its text (a request id, a prompt), and
        # splitting there let the record forge a line of another process, marker and all
        return [clean.rstrip("\r").replace("\r", " ")]
    out = []
    for seg in clean.split("\r"):
        m = _EMBEDDED_PREFIX.search(seg, 1) if not PREFIX.match(seg) else None
        if m is not None and _BAR_END.search(seg[:m.start()]):
            out += [seg[:m.start()], seg[m.start():]]
        elif seg:
            out.append(seg)
    return out or [""]


def parse_line(line: str) -> ParsedLine:
    m = PREFIX.match(line)
    if not m:
        return ParsedLine(None, None, line)
    return ParsedLine(m.group("proc"), int(m.group("pid")), m.group("rest"))


def message(text: str) -> str:
    """The log record's message: vLLM's level/time/file header removed."""
    return LOG_HEAD.sub("", text, count=1)


@dataclass
class RankState:
    name: str
    phase: str = "starting"
    since: float = 0.0
    last_progress: float = 0.0
    pid: int | None = None
    markers: set[str] = field(default_factory=set)
    first_error: str | None = None
    last_line: str = ""
    shards: tuple[int, int] | None = None

    def advance(self, phase: str, now: float) -> bool:
        if PHASES.index(phase) > PHASES.index(self.phase):
            self.phase, self.since = phase, now
            return True
        return False


# What still fails a seat once it is ready. A traceback is not: vLLM logs one for a single bad
# request (a tool or reasoning parser that raised on a stream) and keeps serving; what a dead
# engine leaves behind (a rank gone, the process exiting) is caught on its own.
SERVING_FATAL = ("rank_died", "cuda", "nccl", "oom", "plugin", "forbidden", "crash")


@dataclass
class Fatal:
    kind: str
    stream: str
    line: str
    hint: str | None = None
    rank: int | None = None
    proc: str | None = None  # the process its line's prefix names; None for an unprefixed line

    @property
    def ends_serving(self) -> bool:
        """Whether it ends a ready seat. Out of memory on a line the API server logged is one
        request's: vLLM answers that request with an error and serves on (a multimodal input too
        big for its shared-memory buffer raises MemoryError there). An unprefixed line also lands in
        the API server's stream, but may be any process's last words (a C++ terminate, the engine's
        final traceback): it still ends the seat."""
        return self.kind in SERVING_FATAL and not (self.kind == "oom" and self.stream == "api"
                                                   and self.proc is not None)


class SeatTracker:
    """Feed it log lines in order; it keeps the state `up`, `status` and the gates read."""

    def __init__(self, tp: int, markers: list[str], forbidden: list[str], start: float | None = None):
        self.tp = tp
        self.required = list(markers)
        self.forbidden = []
        for f in forbidden:
            if not isinstance(f, str):  # a state file edited by hand or of another version
                raise ProfileError(f"gates.forbidden: {f!r} is not a regex string")
            try:
                self.forbidden.append((f, re.compile(f)))
            except re.error as e:
                raise ProfileError(f"gates.forbidden: /{f}/ is not a valid regex ({e})") from None
        t0 = start if start is not None else time.time()
        self.start = t0
        self.ranks = {r: RankState(f"rank{r}", since=t0, last_progress=t0) for r in range(tp)}
        self.others = {"api": RankState("api", since=t0, last_progress=t0),
                       "engine": RankState("engine", since=t0, last_progress=t0)}
        self.pid_rank: dict[int, int] = {}
        self.kv_tokens: int | None = None
        self.kv_host_tokens: int | None = None  # vLLM's GPU + host figure (HiSparse): not the gate's
        self.kv_gib: float | None = None
        self.maxlen_hint: int | None = None
        self.fatal: list[Fatal] = []
        self.marker_ranks: dict[str, set[int]] = {m: set() for m in self.required}
        self.lna2_builds: dict[int, str] = {}  # rank -> the build its own ACTIVE line names (ext=)
        self.dist_ids: set[str] = set()
        self.dist_paths: set[str] = set()
        self.api_serving = False
        self.engine_ready = False
        self.api_pid: int | None = None
        self.engine_pid: int | None = None
        self.last_progress = t0
        self._tb: dict[str, bool] = {}  # stream -> inside a traceback body
        self._tb_skipped: dict[str, int] = {}
        self.lines = 0

    # -- attribution --------------------------------------------------------------------------
    def _rank_of(self, p: ParsedLine) -> int | None:
        if p.proc is None:
            return None
        m = _VLLMWORKER.match(p.proc)
        if m:
            return int(m.group(1))
        m = _TP_IN_NAME.search(p.proc)
        if m and "Worker" in p.proc:  # Worker_TP3, Worker_PP0_TP3, VllmWorker TP3
            return int(m.group(1))
        if p.proc.startswith("Worker") and p.pid is not None:
            if p.pid in self.pid_rank:
                return self.pid_rank[p.pid]
            m = _ASSIGNED.search(p.text)
            if m:
                return int(m.group(3))
            m = _WORLD.search(p.text)
            if m:
                return int(m.group(2))
            if self.tp == 1:
                return 0
        return None

    def stream_for(self, p: ParsedLine) -> tuple[str, int | None]:
        if p.proc is None:
            g = GLOG_PID.match(p.text)
            if g and int(g.group(1)) in self.pid_rank:
                r = self.pid_rank[int(g.group(1))]
                return f"rank{r}", r
            if g and self.engine_pid == int(g.group(1)):
                return "engine", None
            return "api", None
        if p.proc.startswith(("APIServer", "ApiServer", "APIServer_")):
            return "api", None
        if p.proc.startswith("EngineCore") or p.proc.startswith("Engine"):
            return "engine", None
        r = self._rank_of(p)
        if r is not None and p.pid is not None:
            self.pid_rank.setdefault(p.pid, r)
        if r is None or r not in self.ranks:
            return f"pid{p.pid}", None
        return f"rank{r}", r

    def route(self, line: str) -> str:
        """The stream a raw log line belongs to (`rank0`, `engine`, `api`, `pid123`)."""
        p = parse_line(physical_parts(line)[-1])
        stream = self.stream_for(p)[0]
        if stream == "engine" and p.pid is not None and self.engine_pid is None:
            self.engine_pid = p.pid
        return stream

    # -- feeding ------------------------------------------------------------------------------
    def feed(self, raw: str, now: float | None = None) -> list[dict[str, Any]]:
        now = time.time() if now is None else now
        self.lines += 1
        events: list[dict[str, Any]] = []
        for part in physical_parts(raw):
            events += self._feed_one(part, now)
        return events

    def _feed_one(self, line: str, now: float) -> list[dict[str, Any]]:
        p = parse_line(line)
        events: list[dict[str, Any]] = []
        stream, rank = self.stream_for(p)
        text = message(p.text)
        ours = _OUR_RANK.search(text) if ("dsv4serve" in text or "LNA" in text or "lna2" in text) else None
        if ours and int(ours.group(2)) == self.tp and int(ours.group(1)) in self.ranks:
            # The text names the rank only where the prefix could not: a worker process whose prefix
            # carries no rank (stream pidN), one rank per pid. API-server and engine lines, and one
            # process claiming several ranks, never count as ranks: the marker gate counts distinct
            # ranks, and one process printing `rank=r/tp` for every r must not satisfy it.
            r_txt = int(ours.group(1))
            if rank is None and stream.startswith("pid") and p.pid is not None \
                    and self.pid_rank.setdefault(p.pid, r_txt) == r_txt:
                rank, stream = r_txt, f"rank{r_txt}"
        # At TP 1 on a GPU vLLM runs the worker inside EngineCore (the uni-process executor): the
        # plugin's `rank=0/1` lines carry the engine's prefix, and are rank 0's
        marker_rank = rank
        if rank is None and self.tp == 1 and stream == "engine" and ours and int(ours.group(1)) == 0:
            marker_rank = 0
        st = self.ranks.get(rank) if rank is not None else self.others.get(stream)
        if st is not None:
            st.last_line = text[-300:]
            if p.pid is not None and st.pid is None and (rank is not None or stream in self.others):
                st.pid = p.pid
        if stream == "engine" and p.pid is not None:
            self.engine_pid = self.engine_pid or p.pid
        elif stream == "api" and p.pid is not None:
            self.api_pid = self.api_pid or p.pid
        progress = not HEARTBEAT.search(text)

        # The safetensors bar is drawn by rank 0 only, without a prefix.
        m = SHARDS.search(text)
        if m:
            r0 = self.ranks.get(0)
            if r0 is not None:
                shards = (int(m.group(2)), int(m.group(3)))
                if r0.advance("loading", now):
                    events.append(self._ev(now, "phase", 0, phase="loading"))
                if shards != r0.shards:
                    r0.shards = shards
                    events.append(self._ev(now, "shards", 0, done=shards[0], total=shards[1]))
                r0.last_progress = now

        if "vllm_dist_" in text:
            self.dist_ids.update(DIST_ID.findall(text))
            self.dist_paths.update(DIST_PATH.findall(text))

        if rank is not None:
            for phase, pat in _RANK_PHASE:
                if pat.search(text) and self.ranks[rank].advance(phase, now):
                    events.append(self._ev(now, "phase", rank, phase=phase))
            if progress:
                self.ranks[rank].last_progress = now
        elif stream == "engine":
            if progress:
                self.others["engine"].last_progress = now
            if _ENGINE_UP.search(text):
                self.engine_ready = True
                events.append(self._ev(now, "engine", None, phase="ready"))
                for r, rs in self.ranks.items():
                    if rs.advance("graphs", now):
                        events.append(self._ev(now, "phase", r, phase="graphs"))
        elif stream == "api":
            if progress:
                self.others["api"].last_progress = now
            if _API_SERVING.search(text) and not self.api_serving:
                self.api_serving = True
                events.append(self._ev(now, "api", None, phase="serving"))
        if progress:
            self.last_progress = now

        # a request log echoes prompts; the engine's own line may carry the API server's prefix (with
        # VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine runs in that process)
        m = KV_TOKENS.search(text) if not _REQUEST_ECHO.search(text) else None
        if m:
            self.kv_tokens = int(m.group(1).replace(",", ""))
            events.append(self._ev(now, "kv", None, tokens=self.kv_tokens))
            for r, rs in self.ranks.items():
                if rs.advance("kv_sized", now):
                    events.append(self._ev(now, "phase", r, phase="kv_sized"))
        m = KV_HOST_TOKENS.search(text) if not _REQUEST_ECHO.search(text) else None
        if m:
            self.kv_host_tokens = int(m.group(1).replace(",", ""))
        m = KV_MEMORY.search(text)
        if m:
            self.kv_gib = float(m.group(1))

        # an ERROR line or a traceback frame quoting a marker ("expected ... ACTIVE") is not the marker
        quoting = _LEVEL.match(p.text) is not None or text.startswith((" ", "\t"))
        r = marker_rank
        for marker in self.required:
            if marker in text and r is not None and not quoting and r not in self.marker_ranks[marker] \
                    and self._own_line(marker, text, r):
                self.marker_ranks[marker].add(r)
                self.ranks[r].markers.add(marker)
                events.append(self._ev(now, "marker", r, marker=marker))
                if self.ranks[r].markers >= set(self.required) and self.ranks[r].advance("marker", now):
                    events.append(self._ev(now, "phase", r, phase="marker"))

        if r is not None and not quoting and text.startswith(LNA2_ACTIVE_LINE):
            m = _ACTIVE_EXT.match(text)
            if m and int(m.group(1)) == r and int(m.group(2)) == self.tp:
                self.lna2_builds[r] = m.group(3)

        events += self._fatal_checks(stream, rank, text, now, p.proc)
        return events

    def _own_line(self, marker: str, text: str, r: int) -> bool:
        """Whether a line holding `marker` is that marker's own line for rank r. dsv4serve's proof
        lines begin their message and name their rank: a warning that quotes one, or a rank's line
        with another rank's spliced into it, proves nothing for either (ranklog audit)."""
        if not marker.startswith(OWN_MARKER_HEADS):
            return True  # another program's text: where it sits in the line is its own business
        if not text.startswith(marker):
            return False
        ours = _OUR_RANK.search(text)
        return ours is None or (int(ours.group(1)) == r and int(ours.group(2)) == self.tp)

    def _ev(self, now: float, event: str, rank: int | None, **kw: Any) -> dict[str, Any]:
        return {"t": round(now, 3), "elapsed_s": round(now - self.start, 1), "event": event, "rank": rank, **kw}

    def _note_error(self, stream: str, rank: int | None, line: str) -> None:
        st = self.ranks.get(rank) if rank is not None else self.others.get(stream)
        if st is not None and st.first_error is None:
            st.first_error = line.strip()[:400]

    def _add_fatal(self, kind: str, stream: str, rank: int | None, line: str, hint: str | None,
                   now: float, proc: str | None = None, **extra: Any) -> dict[str, Any]:
        line = line.strip()[:400]
        if kind == "rank_died" and rank is None:
            m = _DIED.search(line)  # the engine names the dead worker: blame its rank
            if m and int(m.group(1)) in self.ranks:
                rank = int(m.group(1))
        self._note_error(stream, rank, line)
        self.fatal.append(Fatal(kind, stream, line, hint, rank, proc))
        return self._ev(now, "fatal", rank, kind=kind, stream=stream, line=line, hint=hint, **extra)

    def _traceback(self, stream: str, rank: int | None, text: str, now: float,
                   proc: str | None) -> dict[str, Any] | None:
        """A Python traceback ends at its first unindented line that is not a chaining remark:
        that line is the exception (`SafetensorError: ...`), the root cause for the first one."""
        if TRACEBACK in text:
            self._tb[stream] = True
            return None
        if not self._tb.get(stream):
            return None
        if not text.strip() or text.startswith((" ", "\t")) or text.startswith(_TB_CHAIN):
            return None
        body = text.strip()
        if not (EXC_LINE.match(body) or _EXC_NAME.match(body)):
            # Unprefixed streams interleave several processes: a stray line is not the end.
            self._tb_skipped[stream] = self._tb_skipped.get(stream, 0) + 1
            if self._tb_skipped[stream] > 200:
                self._tb[stream] = False
            return None
        self._tb[stream] = False
        self._tb_skipped[stream] = 0
        # the exception line is classified like any line (a CUDA error, NCCL, OOM): after ready
        # only SERVING_FATAL kinds stop a seat, and a traceback of one of those must still do
        kind = next((k for k, pat in FATAL if pat.search(body)), "traceback")
        return self._add_fatal(kind, stream, rank, body, self._hint_for(body), now, proc)

    def _fatal_checks(self, stream: str, rank: int | None, text: str, now: float,
                      proc: str | None = None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if _REQUEST_ECHO.search(text):  # a user's prompt ("what does CUDA error: ... mean?") is no fatal
            return events
        ev = self._traceback(stream, rank, text, now, proc)
        if ev:
            events.append(ev)
        elif not text.startswith((" ", "\t")):  # frames of a traceback quote code, not errors
            for kind, pat in FATAL:
                m = pat.search(text)
                if m:
                    events.append(self._add_fatal(kind, stream, rank, text, self._hint_for(text), now, proc))
                    break
        for src, pat in self.forbidden:
            if pat.search(text):
                events.append(self._add_fatal("forbidden", stream, rank, text, f"forbidden by the profile: /{src}/",
                                              now, proc, pattern=src))
        return events

    def _hint_for(self, line: str) -> str | None:
        m = MAXLEN_HINT.search(line)
        if m:
            self.maxlen_hint = int(m.group(1))
        if self.maxlen_hint:
            n = self.maxlen_hint
            return f"the KV cache fits {n} tokens: retry with --set vllm.max_model_len={n}"
        low = line.lower()
        if "out of memory" in low or "outofmemory" in low or "cannot allocate memory" in low:
            return "free the GPUs of other processes, or lower vllm.max_num_batched_tokens or vllm.max_model_len"
        if "nccl" in low:
            return "check NCCL_P2P_DISABLE=1 and --disable-custom-all-reduce on PCIe seats without P2P"
        if "lna2 not ready" in low:
            # the refusal names its own cause; the hint must not contradict it (a tuning table of
            # another card or too many decode rows read "build the lna2 extension")
            if "tuning table" in low:
                return ("re-run `dsv4serve kernel check --bench --save-tuning FILE` on the seat's card with the "
                        "seat's build, or drop moe.tuning")
            if "rows a call" in low:
                return ("lower vllm.max_num_seqs until max_num_seqs x (1 + speculative tokens), or the CUDA-graph "
                        "size it pads to, fits the build's rows (`dsv4serve kernel info`)")
            if "no cuda" in low:
                return ("lna2 runs on a CUDA GPU: check that gpus.ids gives every worker one (nvidia-smi), or use "
                        "moe.kernel=incumbent")
            if "extension" in low:
                return "build the lna2 extension for this GPU (`dsv4serve kernel build`) or use moe.kernel=incumbent"
            return "the line names the layer and why lna2 cannot serve it; moe.kernel=incumbent runs without lna2"
        if "safetensor" in low or "incomplete metadata" in low or "header" in low and "deserializ" in low:
            return "the pack's safetensors are damaged or incomplete: re-download or re-copy the model files"
        if low.startswith("docker: ") or "response from daemon" in low or "docker daemon" in low:
            return ("the docker engine did not run the container: fix docker (daemon up, access to its socket, "
                    "the image pulled, the NVIDIA runtime), then `dsv4serve up` again")
        if ARGV_ERROR.match(line):
            return ("vLLM refused its command line: fix that setting in the profile (up checks the flags with "
                    "vLLM's own parser first, unless --no-validate)")
        if "died unexpectedly" in low:
            return "a rank process died: its own log lines come first (`dsv4serve logs --rank R`)"
        return None

    # -- gates --------------------------------------------------------------------------------
    def missing_markers(self, ranks_needed: dict[str, int] | None = None) -> dict[str, list[int]]:
        """Required markers seen on fewer distinct ranks than needed -> the ranks lacking them."""
        out = {}
        for m in self.required:
            need = (ranks_needed or {}).get(m, self.tp)
            have = self.marker_ranks[m]
            if len(have) < need:
                out[m] = [r for r in range(self.tp) if r not in have]
        return out

    def stalled_for(self, now: float) -> float:
        return now - self.last_progress

    def laggard(self) -> RankState:
        """The rank furthest behind (for stall reports): lowest phase, then the oldest progress."""
        return min(self.ranks.values(), key=lambda s: (PHASES.index(s.phase), s.last_progress))

    def first_errors(self) -> dict[str, str]:
        out = {f"rank{r}": s.first_error for r, s in self.ranks.items() if s.first_error}
        out.update({k: s.first_error for k, s in self.others.items() if s.first_error})
        return out

    def rank_pids(self) -> dict[int, int]:
        return {r: s.pid for r, s in self.ranks.items() if s.pid is not None}

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "ranks": {r: {"phase": s.phase, "elapsed_s": round(now - s.since, 1), "pid": s.pid,
                          "markers": sorted(s.markers), "shards": s.shards, "first_error": s.first_error,
                          "last_line": s.last_line}
                      for r, s in self.ranks.items()},
            "api": {"pid": self.api_pid, "serving": self.api_serving, "first_error": self.others["api"].first_error},
            "engine": {"pid": self.engine_pid, "ready": self.engine_ready,
                       "first_error": self.others["engine"].first_error},
            "kv_cache_tokens": self.kv_tokens,
            "kv_cache_gib": self.kv_gib,
            "api_serving": self.api_serving,
            "markers": {m: sorted(v) for m, v in self.marker_ranks.items()},
            "dist_ids": sorted(self.dist_ids),
            "fatal": [f.__dict__ for f in self.fatal],
            "lines": self.lines,
        }


# Bump when SeatTracker's fields or what feed() does change: a checkpoint of another version is
# rescanned from the start rather than resumed.
SCAN_VERSION = 4  # 2: physical_parts (lines glued to a bar, colour codes), TP 1 engine ranks, KV lines; 3: Fatal.proc
# 4: a record's carriage returns kept, own markers, lna2_builds
_TAIL_CHECK = 256  # bytes before a checkpoint's offset that must still be there to resume from it
_BLOCK = 8 << 20


def with_seat(hint: str | None, seat: str) -> str | None:
    """A hint written where the seat is not known (this module's fatal lines, readiness) names
    `dsv4serve logs` without --profile, which is refused once a second seat is known: the caller,
    who knows the seat, puts it in."""
    if not hint:
        return hint
    return re.sub(r"`dsv4serve logs(?![^`]*--profile)", f"`dsv4serve logs --profile {seat}", hint)


def read_log(path: str, tp: int, markers: list[str], forbidden: list[str],
             checkpoint: Path | None = None) -> SeatTracker:
    """A tracker fed with a whole log file (for `status`, `down` and diagnostics).

    With `checkpoint`, the tracker as it stood after the last complete line is kept in that file and
    the next call feeds only what the log gained since: a seat that has served for days writes
    hundreds of MB, and reading them all made every `status` take seconds. A log that was replaced
    or truncated (its inode or the bytes before the offset differ) is read from the start.
    """
    key = (SCAN_VERSION, tp, tuple(markers), tuple(forbidden))
    tr, offset = None, 0
    try:
        f = open(path, "rb")
    except OSError:
        return SeatTracker(tp, markers, forbidden, start=0.0)
    with f:
        ident = _ident(f)
        if checkpoint is not None:
            tr, offset = _resume(checkpoint, key, ident, f)
        if tr is None:
            tr, offset = SeatTracker(tp, markers, forbidden, start=0.0), 0
        f.seek(offset)
        carry, tail = b"", b""
        # in blocks, so a first read of a log of hundreds of MB never holds it all in memory
        while block := f.read(_BLOCK):
            data = carry + block
            cut = data.rfind(b"\n") + 1
            _feed_bytes(tr, data[:cut])
            if cut:
                offset += cut
                tail = (tail + data[:cut])[-_TAIL_CHECK:]
            carry = data[cut:]
    if checkpoint is not None and tail:
        _save_checkpoint(checkpoint, key, ident, offset, tail, path, tr)
    done = finished_redraws(carry)
    if done:  # a bar still being drawn: its finished redraws, fed on a copy, never checkpointed
        tr = copy.deepcopy(tr)
        _feed_bytes(tr, done)
    return tr


def finished_redraws(partial: bytes) -> bytes:
    """Of a line still being written, what is already whole: a tqdm bar's redraws up to its last
    carriage return (the shard bar draws for minutes without a newline). Nothing of a log record
    (prefixed), nor a record's unfinished tail: half a line can match what the whole does not
    (`... above t` against a forbidden `(?!rows=\\d+ above the ceiling)`)."""
    cut = partial.rfind(b"\r") + 1
    if not cut or _record(ANSI.sub("", partial[:200].decode("utf-8", "replace"))):
        return b""
    return partial[:cut]


def _feed_bytes(tr: SeatTracker, data: bytes) -> None:
    # what reading the file as text with universal newlines did: \n, \r\n and a lone \r (tqdm's
    # redraws) all end a part; blank parts are skipped. UTF-8 never puts 0x0A or 0x0D inside a
    # character, so splitting the bytes first cuts no character in two.
    for line in data.split(b"\n"):
        if line.strip():  # its carriage returns are physical_parts' to split (a bar's, not a record's)
            tr.feed(line.decode("utf-8", errors="replace"), now=0.0)


def _ident(f: Any) -> tuple[int, int]:
    st = os.fstat(f.fileno())
    return st.st_dev, st.st_ino


_TRACKER_FIELDS = set(vars(SeatTracker(1, [], [], start=0.0)))


def _resume(checkpoint: Path, key: tuple, ident: tuple[int, int], f: Any) -> tuple[SeatTracker | None, int]:
    try:
        # our own file in the seat's state dir (state.log_checkpoint: never a dir a container can
        # write), written by _save_checkpoint below; anything that does not read back as one
        # (another version, a torn or foreign file) means a full rescan
        with open(checkpoint, "rb") as c:
            saved = pickle.load(c)
        if not (isinstance(saved, dict) and saved.get("key") == key and saved.get("ident") == ident
                and isinstance(saved.get("tracker"), SeatTracker)):
            return None, 0
        if set(vars(saved["tracker"])) != _TRACKER_FIELDS:  # pickled by a SeatTracker of other fields
            return None, 0
        offset, tail = int(saved["offset"]), bytes(saved["tail"])
        f.seek(offset - len(tail))
        if f.read(len(tail)) != tail:
            return None, 0
        return saved["tracker"], offset
    except Exception:  # noqa: BLE001 - a checkpoint is only ever a shortcut
        return None, 0


def _save_checkpoint(checkpoint: Path, key: tuple, ident: tuple[int, int], offset: int, tail: bytes, path: str,
                     tr: SeatTracker) -> None:
    if not checkpoint.parent.is_dir():  # a shortcut never creates the dir it would live in
        return
    try:
        atomic_write(checkpoint, pickle.dumps({"key": key, "ident": ident, "offset": offset, "tail": tail, "log": path,
                                               "tracker": tr}, protocol=pickle.HIGHEST_PROTOCOL))
    except OSError:
        pass  # a read-only state dir: status still works, it just reads the whole log next time
