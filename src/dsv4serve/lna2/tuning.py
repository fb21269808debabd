"""A per-card lna2 tuning table: which build serves each row count, measured on the card itself.

The built-in policy (`policy.variant_for`) was chosen on an H200 and an H100, 132 SMs each; the
seat's RTX PRO 2000 cards have 34 SMs, 99 KB of shared memory a block and about 270 GB/s, and no
figure of lna2 has been taken on one (kernels/lna2/NOTES.md). `dsv4serve kernel check --bench
--save-tuning FILE` times every build at each checked row count on the card it runs on; this module
turns that report into a table, and the dispatch serves from it (profile `moe.tuning`) wherever it
holds the call's row count and layer shape, and the built-in policy elsewhere.

Three rules keep a table from serving something it should not:
- a build replaces the policy's pick only when it was faster by at least `margin` (3 % by default:
  run-to-run spread of the cold medians on the H100 / H200 was within ~2 %), and only when it also
  passed the CUDA-graph replay check the pick itself passes;
- a table names the lna2 build (`lna2_build_id`) and the card (name, SM count) it was measured on:
  the dispatch refuses it elsewhere (strict) or ignores it with a line saying so;
- it is written atomically, and it is a whole report or nothing: a check with a failing case saves
  no table.

Imports only pydantic, the standard library and the policy: the dispatch reads it inside vLLM's
workers.
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dsv4serve.lna2.policy import ABLATIONS, TUNABLE

FORMAT = "dsv4serve-lna2-tuning/1"
DEFAULT_MARGIN = 0.03
CODEBOOK_NAMES = {1: "mcg", 2: "mul1"}  # lna2's numbering (lna2_api.h)
_KEY = re.compile(r"K[23]/(mcg|mul1)")


class TuningError(ValueError):
    """A table that cannot be used: unreadable, not a table, or for another card or build."""


def card_identity(device: Any) -> tuple[str, int]:
    """The card as a table names it, written by `kernel check` and compared by the dispatch: torch's
    device name and its SM count."""
    import torch

    return torch.cuda.get_device_name(device), int(torch.cuda.get_device_properties(device).multi_processor_count)


def key(bits: int, codebook: int | str) -> str:
    """The table's key for a layer's bits and codebook (lna2's number or its name)."""
    name = CODEBOOK_NAMES.get(codebook, "?") if isinstance(codebook, int) else codebook
    return f"K{bits}/{name}"


class TuningTable(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["dsv4serve-lna2-tuning/1"] = FORMAT
    device: str = Field(..., min_length=1, description="torch.cuda.get_device_name of the card it was measured on")
    capability: str = Field(..., description="compute capability, e.g. 12.0")
    sm_count: int = Field(..., ge=1)
    build_id: str = Field(..., min_length=1, description="lna2_build_id() of the extension it timed")
    hidden: int = Field(..., ge=128)
    inter: int = Field(..., ge=128)
    experts: int = Field(..., ge=1)
    top_k: int = Field(..., ge=1, le=8)
    margin: float = Field(DEFAULT_MARGIN, ge=0, lt=1)
    reps: int = Field(..., ge=3)
    picks: dict[str, dict[int, int]] = Field(..., description='"K2/mcg" -> rows -> the build that serves them')
    policy_picks: dict[str, dict[int, int]] = Field(..., description="the built-in policy's pick at each point on "
                                                                     "this card (shared memory decides some)")
    timings_us: dict[str, dict[int, dict[int, float]]] = Field(..., description="the medians it was read from")

    @field_validator("picks")
    @classmethod
    def _picks(cls, v: dict[str, dict[int, int]]) -> dict[str, dict[int, int]]:
        if not v:
            raise ValueError("no picks (a table of a check that timed nothing)")
        for k, rows in v.items():
            if not _KEY.fullmatch(k):
                raise ValueError(f"key {k!r} is not K2/mcg, K3/mcg, K2/mul1 or K3/mul1")
            if not rows:  # it would be "served" (policy=tuned on the ACTIVE line) with nothing in it
                raise ValueError(f"{k}: no row counts (a check that timed nothing at this K)")
            if any(r < 1 for r in rows) or any(b < 0 for b in rows.values()):
                raise ValueError(f"{k}: rows start at 1 and build numbers at 0")
            if bad := sorted({b for b in rows.values() if b in ABLATIONS}):
                raise ValueError(f"{k}: v{bad[0]} is a timing ablation (it skips a stage by design), not a build "
                                 "that computes the op")
            if bad := sorted({b for b in rows.values() if b not in TUNABLE}):
                raise ValueError(f"{k}: v{bad[0]} is no lna2 build a table may serve (builds: "
                                 f"{', '.join(map(str, sorted(TUNABLE)))})")
        return v

    @model_validator(mode="after")
    def _measured(self) -> "TuningTable":
        # a hand-edited or merged table must not serve a build nobody checked at that point
        for k, rows in self.picks.items():
            for r, v in rows.items():
                if v not in self.timings_us.get(k, {}).get(r, {}):
                    raise ValueError(f"{k} at {r} rows names v{v}, which this table did not time there")
                if r not in self.policy_picks.get(k, {}):
                    raise ValueError(f"{k} at {r} rows has no policy pick beside it")
        return self

    def mismatch(self, device: str, sm_count: int, build_id: str) -> Optional[str]:
        """Why this table does not describe this card and build, or None when it does."""
        if device != self.device or sm_count != self.sm_count:
            return (f"it was measured on a {self.device} ({self.sm_count} SMs), this is a {device} "
                    f"({sm_count} SMs)")
        if build_id != self.build_id:
            return f"it timed lna2 build {self.build_id}, this extension is build {build_id}"
        return None

    def for_layer(self, bits: int, codebook: int | str, hidden: int, inter: int, top_k: int,
                  experts: int) -> Optional[dict[int, int]]:
        """rows -> build for a layer of this shape, or None when the table was not measured on it."""
        if (hidden, inter, top_k, experts) != (self.hidden, self.inter, self.top_k, self.experts):
            return None
        return self.picks.get(key(bits, codebook))

    def changes(self) -> list[tuple[str, int, int, int, float, float]]:
        """(key, rows, policy's pick, tuned pick, its µs, the tuned µs) wherever the table departs
        from the built-in policy's pick on the card it was measured on."""
        out = []
        for k, rows in sorted(self.picks.items()):
            for r, v in sorted(rows.items()):
                base = self.policy_picks[k][r]
                if v != base:
                    t = self.timings_us.get(k, {}).get(r, {})
                    out.append((k, r, base, v, t.get(base, float("nan")), t.get(v, float("nan"))))
        return out


def from_report(report: Any, *, build_id: str, device: str, capability: str, sm_count: int,
                margin: float = DEFAULT_MARGIN) -> TuningTable:
    """The table of a `kernel check --bench` report (selfcheck.CheckReport). Raises TuningError when
    the report cannot make one: no timings, or a case that failed (a table from a check that did not
    pass would serve builds no one verified)."""
    if not report.spec.bench:
        raise TuningError("a tuning table is read off the timings: the check needs --bench")
    if not report.ok:
        raise TuningError("the check did not pass on this card: no table is saved from it")
    picks: dict[str, dict[int, int]] = {}
    policy_picks: dict[str, dict[int, int]] = {}
    timings: dict[str, dict[int, dict[int, float]]] = {}
    for c in report.cases:
        if not c.timings_us:
            continue
        k = key(c.K, c.codebook)
        chosen = c.variant
        fast = c.fastest
        if (fast is not None and fast != c.variant and c.fastest_graph_ok
                and c.timings_us[fast] * (1 + margin) <= c.timings_us[c.variant]):
            chosen = fast
        picks.setdefault(k, {})[c.rows] = chosen
        policy_picks.setdefault(k, {})[c.rows] = c.variant
        timings.setdefault(k, {})[c.rows] = {int(v): float(t) for v, t in c.timings_us.items()}
    if not picks:
        raise TuningError("the check timed no case")
    s = report.spec
    return TuningTable(device=device, capability=capability, sm_count=sm_count, build_id=build_id,
                       hidden=s.hidden, inter=s.inter, experts=s.experts, top_k=s.top_k, margin=margin,
                       reps=s.reps, picks=picks, policy_picks=policy_picks, timings_us=timings)


def dumps(table: TuningTable) -> str:
    return json.dumps(json.loads(table.model_dump_json()), indent=1, sort_keys=True) + "\n"


def save(table: TuningTable, path: Path) -> str:
    """Write the table atomically; returns its digest (what the dispatch's ACTIVE line names)."""
    from dsv4serve.state import atomic_write  # not in the worker's import path

    text = dumps(table)
    atomic_write(path, text, mode=0o644)
    return digest(text.encode())


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


MAX_BYTES = 1 << 20  # a table is a few KB; a path to a device or a huge file must not be read whole


def read_bytes(path: str | Path) -> bytes:
    """The bytes of the table file at `path`, or TuningError: a FIFO named here blocked the dry run,
    check-seat and up forever, and /dev/zero would have been read without end."""
    p = Path(path)
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            raise TuningError(f"lna2 tuning table {p}: not a regular file")
        if st.st_size > MAX_BYTES:
            raise TuningError(f"lna2 tuning table {p}: {st.st_size} bytes, more than a table ({MAX_BYTES} at most)")
        with p.open("rb") as f:
            return f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise TuningError(f"lna2 tuning table {p}: missing") from None
    except OSError as e:
        raise TuningError(f"lna2 tuning table {p}: {e.strerror or e}") from None


def load(path: str | Path) -> tuple[TuningTable, str]:
    """The table at `path` and the digest of its bytes, or TuningError naming what is wrong."""
    return parse(read_bytes(path), str(path))


def parse(data: bytes, p: str) -> tuple[TuningTable, str]:
    """The table in `data` (read from `p`) and its digest, or TuningError."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # 100,000 '[' nest past the parser
        raise TuningError(f"lna2 tuning table {p}: not JSON ({str(e).splitlines()[0][:120]})") from None
    if isinstance(doc, Mapping) and doc.get("format") not in (None, FORMAT):
        raise TuningError(f"lna2 tuning table {p}: format {doc.get('format')!r}, this dsv4serve reads {FORMAT}")
    try:
        return TuningTable.model_validate(doc), digest(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        if not where and not isinstance(doc, Mapping):
            where = "(top level)"
        raise TuningError(f"lna2 tuning table {p}: {where + ': ' if where else ''}{msg}") from None
