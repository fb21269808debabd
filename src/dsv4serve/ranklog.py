"""Split vLLM's single output stream into per-process streams and track each rank's bring-up.

vLLM prefixes every line a worker or the engine writes through Python with its process name and
pid: `(APIServer pid=N)`, `(EngineCore pid=N)` / `(EngineCore_DP0 pid=N)`, `(VllmWorker-3 pid=N)`
before init_worker relabels it, `(Worker pid=N)` at TP 1 and during early init, and
`(Worker_TP3 pid=N)` (or `Worker_PP0_TP3`) afterwards. Versions differ, so ranks are learnt from
whatever identifies them (TP in the name, the VllmWorker index, `TP rank r` in vLLM's own
assignment line, `rank=r/tp` in our plugin's lines) and remembered per pid.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

PREFIX = re.compile(r"^\((?P<proc>[A-Za-z][A-Za-z0-9_\-]*) pid=(?P<pid>\d+)\)\s?(?P<rest>.*)$")
_TP_IN_NAME = re.compile(r"TP(\d+)")
_VLLMWORKER = re.compile(r"^VllmWorker-(\d+)$")
_ASSIGNED = re.compile(r"\brank (\d+) in world size (\d+) is assigned as .*?\bTP rank (\d+)")
_WORLD = re.compile(r"\bworld_size=(\d+) rank=(\d+)")
_OUR_RANK = re.compile(r"\brank=(\d+)/(\d+)\b")
SHARDS = re.compile(r"Loading safetensors checkpoint shards:\s+(\d+)% Completed \|\s*(\d+)/(\d+)")
KV_TOKENS = re.compile(r"\b(?:GPU|CPU|XPU|TPU|NPU)? ?KV cache size: ([\d,]+) tokens")
KV_MEMORY = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
MAXLEN_HINT = re.compile(r"estimated maximum model length is (\d+)")
TRACEBACK = "Traceback (most recent call last):"
EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$")

# (phase, pattern) in bring-up order; a rank only moves forward.
PHASES = ["starting", "loading", "loaded", "kv_sized", "graphs", "marker", "ready"]
_RANK_PHASE = [
    ("loading", re.compile(r"Starting to load model|Loading model from scratch|Loading weights")),
    ("loaded", re.compile(r"Loading weights took|Model loading took|model weights took|Loading drafter model")),
    ("kv_sized", re.compile(r"for KV cache|Available KV cache memory|KV cache initialized|KV cache size")),
    ("graphs", re.compile(r"Graph capturing finished|Capturing CUDA graphs|cudagraph|EAGLE drafter KV cache")),
]

FATAL = [
    ("oom", re.compile(r"CUDA out of memory|OutOfMemoryError|torch\.OutOfMemoryError|Cannot allocate memory|MemoryError")),
    ("max_model_len", MAXLEN_HINT),
    ("nccl", re.compile(r"NCCL error|ncclInternalError|ncclSystemError|ncclUnhandledCudaError|Watchdog caught collective")),
    ("rank_died", re.compile(r"died unexpectedly|Worker proc \S+ died|WorkerProc hit an exception|"
                             r"Engine core initialization failed|EngineCore encountered a fatal error|EngineDeadError")),
    ("cuda", re.compile(r"CUDA error: |an illegal memory access|device-side assert triggered")),
]


@dataclass
class ParsedLine:
    proc: str | None
    pid: int | None
    text: str


def parse_line(line: str) -> ParsedLine:
    m = PREFIX.match(line)
    if not m:
        return ParsedLine(None, None, line)
    return ParsedLine(m.group("proc"), int(m.group("pid")), m.group("rest"))


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


@dataclass
class Fatal:
    kind: str
    stream: str
    line: str
    hint: str | None = None


class SeatTracker:
    """Feed it log lines in order; it keeps the state `up`, `status` and the gates read."""

    def __init__(self, tp: int, markers: list[str], forbidden: list[str], start: float | None = None):
        self.tp = tp
        self.required = list(markers)
        self.forbidden = [(f, re.compile(f)) for f in forbidden]
        t0 = start if start is not None else time.time()
        self.ranks = {r: RankState(f"rank{r}", since=t0, last_progress=t0) for r in range(tp)}
        self.others = {"api": RankState("api", since=t0, last_progress=t0),
                       "engine": RankState("engine", since=t0, last_progress=t0)}
        self.pid_rank: dict[int, int] = {}
        self.pending: dict[int, list[str]] = {}
        self.kv_tokens: int | None = None
        self.kv_gib: float | None = None
        self.maxlen_hint: int | None = None
        self.fatal: list[Fatal] = []
        self.marker_ranks: dict[str, set[int]] = {m: set() for m in self.required}
        self.dist_ids: set[str] = set()
        self.api_serving = False
        self.engine_ready = False
        self.last_progress = t0
        self._tb: dict[str, list[str]] = {}
        self.lines = 0

    # -- attribution --------------------------------------------------------------------------
    def _rank_of(self, p: ParsedLine) -> int | None:
        if p.proc is None:
            return None
        m = _VLLMWORKER.match(p.proc)
        if m:
            return int(m.group(1))
        m = _TP_IN_NAME.search(p.proc)
        if m and p.proc.startswith("Worker"):
            return int(m.group(1))
        if p.proc == "Worker" and p.pid is not None:
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
            return "api", None
        if p.proc.startswith("APIServer") or p.proc.startswith("ApiServer"):
            return "api", None
        if p.proc.startswith("EngineCore") or p.proc.startswith("Engine"):
            return "engine", None
        r = self._rank_of(p)
        if r is not None and p.pid is not None:
            self.pid_rank.setdefault(p.pid, r)
        if r is None:
            return f"pid{p.pid}", None
        return f"rank{r}", r

    # -- feeding ------------------------------------------------------------------------------
    def feed(self, raw: str, now: float | None = None) -> list[dict[str, Any]]:
        now = time.time() if now is None else now
        self.lines += 1
        line = raw.rstrip("\n").replace("\r", "")
        p = parse_line(line)
        events: list[dict[str, Any]] = []
        stream, rank = self.stream_for(p)
        text = p.text
        ours = _OUR_RANK.search(text) if "dsv4serve" in text or "LNA2" in text or "lna2" in text else None
        if ours and rank is None and int(ours.group(2)) == self.tp:
            rank = int(ours.group(1))
            stream = f"rank{rank}"
        st = self.ranks.get(rank) if rank is not None else self.others.get(stream)
        if st is not None:
            st.last_line = text[-300:]
            if p.pid is not None and st.pid is None and rank is not None:
                st.pid = p.pid

        # Progress bars from rank 0 are written without a prefix.
        m = SHARDS.search(text)
        if m:
            r0 = self.ranks.get(0)
            if r0 is not None:
                r0.shards = (int(m.group(2)), int(m.group(3)))
                if r0.advance("loading", now):
                    events.append(self._ev(now, "phase", 0, phase="loading"))
                r0.last_progress = self.last_progress = now
                events.append(self._ev(now, "shards", 0, done=r0.shards[0], total=r0.shards[1]))

        if "vllm_dist_" in text:
            self.dist_ids.update(re.findall(r"vllm_dist_([0-9a-f]{8,})", text))

        if rank is not None:
            for phase, pat in _RANK_PHASE:
                if pat.search(text) and self.ranks[rank].advance(phase, now):
                    events.append(self._ev(now, "phase", rank, phase=phase))
            self.ranks[rank].last_progress = self.last_progress = now
        elif stream == "engine":
            self.others["engine"].last_progress = self.last_progress = now
            if "init engine" in text and "took" in text:
                self.engine_ready = True
                for r, rs in self.ranks.items():
                    if rs.advance("graphs", now):
                        events.append(self._ev(now, "phase", r, phase="graphs"))
        elif stream == "api":
            self.others["api"].last_progress = self.last_progress = now
            if "Starting vLLM server on" in text or "Application startup complete" in text:
                self.api_serving = True
                events.append(self._ev(now, "api", None, phase="serving"))

        m = KV_TOKENS.search(text)
        if m:
            self.kv_tokens = int(m.group(1).replace(",", ""))
            events.append(self._ev(now, "kv", None, tokens=self.kv_tokens))
            for r, rs in self.ranks.items():
                if rs.advance("kv_sized", now):
                    events.append(self._ev(now, "phase", r, phase="kv_sized"))
        m = KV_MEMORY.search(text)
        if m:
            self.kv_gib = float(m.group(1))

        for marker in self.required:
            if marker in text:
                mr = rank
                if ours and int(ours.group(2)) == self.tp:
                    mr = int(ours.group(1))
                if mr is not None and mr not in self.marker_ranks[marker]:
                    self.marker_ranks[marker].add(mr)
                    self.ranks[mr].markers.add(marker)
                    events.append(self._ev(now, "marker", mr, marker=marker))
                    if self.ranks[mr].markers >= set(self.required):
                        if self.ranks[mr].advance("marker", now):
                            events.append(self._ev(now, "phase", mr, phase="marker"))

        events += self._fatal_checks(stream, rank, text, now)
        return events

    def _ev(self, now: float, kind: str, rank: int | None, **kw: Any) -> dict[str, Any]:
        return {"t": round(now, 3), "event": kind, "rank": rank, **kw}

    def _note_error(self, stream: str, rank: int | None, line: str) -> None:
        st = self.ranks.get(rank) if rank is not None else self.others.get(stream)
        if st is not None and st.first_error is None:
            st.first_error = line.strip()[:400]

    def _fatal_checks(self, stream: str, rank: int | None, text: str, now: float) -> list[dict[str, Any]]:
        events = []
        key = stream
        if TRACEBACK in text:
            self._tb[key] = []
        elif key in self._tb:
            body = text.strip()
            self._tb[key].append(body)
            if EXC_LINE.match(body):
                self._tb.pop(key)
                self._note_error(stream, rank, body)
                f = Fatal("traceback", stream, body, self._hint_for(body))
                self.fatal.append(f)
                events.append(self._ev(now, "fatal", rank, kind=f.kind, stream=stream, line=body, hint=f.hint))
            elif len(self._tb[key]) > 400:
                self._tb.pop(key)
        for kind, pat in FATAL:
            m = pat.search(text)
            if m:
                if kind == "max_model_len":
                    self.maxlen_hint = int(m.group(1))
                hint = self._hint_for(text)
                self._note_error(stream, rank, text)
                self.fatal.append(Fatal(kind, stream, text.strip()[:400], hint))
                events.append(self._ev(now, "fatal", rank, kind=kind, stream=stream, line=text.strip()[:400],
                                       hint=hint))
        for src, pat in self.forbidden:
            if pat.search(text):
                self._note_error(stream, rank, text)
                self.fatal.append(Fatal("forbidden", stream, text.strip()[:400], f"forbidden by the profile: /{src}/"))
                events.append(self._ev(now, "fatal", rank, kind="forbidden", stream=stream,
                                       line=text.strip()[:400], pattern=src))
        return events

    def _hint_for(self, line: str) -> str | None:
        m = MAXLEN_HINT.search(line)
        if m or self.maxlen_hint:
            n = int(m.group(1)) if m else self.maxlen_hint
            return f"the KV cache fits {n} tokens: retry with --set vllm.max_model_len={n}"
        low = line.lower()
        if "out of memory" in low or "outofmemory" in low:
            return "free the GPUs of other processes, or lower vllm.max_num_batched_tokens or vllm.max_model_len"
        if "nccl" in low:
            return "check NCCL_P2P_DISABLE=1 and --disable-custom-all-reduce on PCIe seats without P2P"
        if "lna2 not ready" in low:
            return "build the lna2 extension for this GPU (`dsv4serve kernel build`) or use moe.kernel=incumbent"
        return None

    # -- gates --------------------------------------------------------------------------------
    def missing_markers(self, ranks_needed: dict[str, int] | None = None) -> dict[str, list[int]]:
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
        """The rank furthest behind (for stall reports)."""
        return min(self.ranks.values(), key=lambda s: (PHASES.index(s.phase), s.last_progress))

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "ranks": {r: {"phase": s.phase, "elapsed_s": round(now - s.since, 1), "pid": s.pid,
                          "markers": sorted(s.markers), "shards": s.shards, "first_error": s.first_error}
                      for r, s in self.ranks.items()},
            "kv_cache_tokens": self.kv_tokens,
            "kv_cache_gib": self.kv_gib,
            "api_serving": self.api_serving,
            "markers": {m: sorted(v) for m, v in self.marker_ranks.items()},
            "fatal": [f.__dict__ for f in self.fatal],
        }
