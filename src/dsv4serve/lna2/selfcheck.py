"""`dsv4serve kernel check`: is lna2 right on this machine's GPU, and is the policy's pick the
fastest build here?

Every variant lna2 serves was parity-checked and timed on the project's H200 (kernels/lna2/NOTES.md);
the seat's cards are sm_120, where nothing has been timed and where a kernel that builds can still be
wrong (an arch-specific spill, a shared-memory limit, a different SM count under the cluster
kernel's grid). This runs what the dispatch would run -- `policy.variant_for` at the seat's
per-rank shape -- on one local GPU, on a random-but-valid layer (`reference.random_expert_layer`),
against the fp64 reference on the same layer, into NaN-filled fp32 outputs (the parity gate, 2e-3
a row) and outputs of x's own type (what the dispatch allocates, 6e-3): every row within tolerance,
finite, and the same bits on a second run; the pick is also captured into a CUDA graph and replayed
with fresh inputs, as vLLM runs it at decode. With `bench`, every build that takes the shape is
checked the same way and then timed (launches alternated, cold L2, median), and the report says
which is fastest on this card and by how much the policy's pick trails it. A running seat's GPU is
refused, and a device fault stops the check at the case that caused it.

The runner, the timer and the graph capture are parameters so that the checking and the verdicts
are tested on a machine with no GPU; `run` supplies the real ones.
"""

from __future__ import annotations

import os
import re

import statistics
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from pydantic import BaseModel, Field, field_validator, model_validator

from dsv4serve.errors import BadInput, JobFailed, first_line
from dsv4serve.lna2 import policy

CODEBOOKS = {"mcg": 1, "mul1": 2}  # lna2's numbering
FP32_TOL = 2e-3  # per-row relative L2 of an fp32 output against the fp64 reference (issue 8's gate)
HALF_TOL = 6e-3  # the same for an fp16 / bf16 output, the dispatch's (out = empty_like(x))

Runner = Callable[[Any, Any, Any, Any, int], Any]  # (x, ids32, w32, out, variant) -> out
Timer = Callable[[dict[int, Callable[[], None]]], dict[int, float]]  # variant -> launch -> median us
Grapher = Callable[[Callable[[], None]], Callable[[], None]]  # a launch -> its captured replay
Fitter = Callable[[int, str], Mapping[int, int]]  # (K, codebook) -> build -> the most rows that fit the card
GRAPH_REPLAYS = 2  # fresh inputs per captured pick (vLLM replays its decode graphs with new ones)


class CheckSpec(BaseModel):
    """What to check. The defaults are the seat's per-rank slice: DeepSeek-V4-Flash at TP 8."""

    hidden: int = 4096
    inter: int = Field(256, description="this rank's intermediate slice (moe_intermediate_size / TP)")
    experts: int = 256
    top_k: int = 6
    bits: list[int] = [2, 3]
    codebooks: list[str] = ["mcg"]
    rows: list[int] = [1, 2, 4, 8, 16, 24]
    swiglu_limit: float = 10.0
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seeds torch generators (seed * 1000 + ...): 32 bits")
    bench: bool = False
    reps: int = 30
    also: list[int] = Field(default_factory=list, description="builds the policy does not serve, checked and timed "
                                                             "beside its own where they fit (with bench)")

    @field_validator("hidden", "inter")
    @classmethod
    def _blocks(cls, v: int) -> int:
        if v < 128 or v % 128:
            raise ValueError("must be a positive multiple of 128 (the Hadamard block)")
        return v

    @field_validator("bits")
    @classmethod
    def _bits(cls, v: list[int]) -> list[int]:
        if not v or any(b not in policy.BITS for b in v):
            raise ValueError("lna2 decodes K 2 and 3")
        return v

    @field_validator("codebooks")
    @classmethod
    def _codebooks(cls, v: list[str]) -> list[str]:
        if not v or any(c not in CODEBOOKS for c in v):
            raise ValueError(f"lna2 takes {', '.join(CODEBOOKS)}")
        return v

    @field_validator("rows")
    @classmethod
    def _rows(cls, v: list[int]) -> list[int]:
        if not v or any(r < 1 for r in v):
            raise ValueError("each must be >= 1")
        return v

    @field_validator("also")
    @classmethod
    def _also(cls, v: list[int]) -> list[int]:
        if any(x < 0 for x in v):
            raise ValueError("build numbers are 0 or more (lna2_api.h lists them)")
        if bad := sorted(set(v) & policy.ABLATIONS):
            raise ValueError(f"v{bad[0]} is a timing ablation (it skips a stage by design): it computes no op to "
                             "check or serve")
        if bad := sorted(set(v) - policy.TUNABLE):
            raise ValueError(f"v{bad[0]} is no build this check can size and serve (builds: "
                             f"{', '.join(map(str, sorted(policy.TUNABLE)))})")
        return list(dict.fromkeys(v))

    @field_validator("reps")
    @classmethod
    def _reps(cls, v: int) -> int:
        if v < 3:
            raise ValueError("a median needs at least 3 launches")
        return v

    @model_validator(mode="after")
    def _routing(self) -> "CheckSpec":
        if not 1 <= self.top_k <= 8:
            raise ValueError(f"--top-k {self.top_k}: lna2 takes 1 to 8")
        if self.experts < self.top_k:
            raise ValueError(f"--experts {self.experts} is below --top-k {self.top_k}: a row needs top_k distinct experts")
        if not (self.swiglu_limit > 0 and self.swiglu_limit != float("inf")):
            raise ValueError(f"swiglu_limit {self.swiglu_limit} must be finite and > 0")
        return self


class Verdict(BaseModel):
    """One build at one case: two runs into NaN-filled fp32 outputs and two into outputs of x's
    type (what the dispatch allocates), each against the fp64 reference."""

    worst_rel: Optional[float] = None  # fp32 output; None when there is no finite figure
    worst_rel_x: Optional[float] = None  # output of x's dtype
    finite: bool = False
    repeat: bool = False
    error: Optional[str] = None  # it raised (a refusal, a CUDA error): the first line
    fault: bool = False  # the error was the device's (the CUDA context is unusable after it)
    graph_worst_rel: Optional[float] = None  # captured once, replayed with fresh inputs (x-type out)
    graph_error: Optional[str] = None
    graph_checked: bool = False

    @property
    def ok(self) -> bool:
        plain = (self.error is None and self.finite and self.repeat and self.worst_rel is not None
                 and self.worst_rel <= FP32_TOL and self.worst_rel_x is not None and self.worst_rel_x <= HALF_TOL)
        graph = not self.graph_checked or (self.graph_error is None and self.graph_worst_rel is not None
                                           and self.graph_worst_rel <= HALF_TOL)
        return plain and graph


class CaseResult(BaseModel):
    K: int
    codebook: str
    rows: int
    x_dtype: str
    variant: int  # the policy's pick
    pick: Verdict
    ok: bool
    failed_variants: list[int] = []  # other builds the bench checked that failed here
    timings_us: Optional[dict[int, float]] = None  # variant -> median us, output of x's dtype (bench)
    fastest: Optional[int] = None
    # the fastest build, when not the pick, through the pick's CUDA-graph replay check (a tuning
    # table serves it only then); None when not checked
    fastest_graph_ok: Optional[bool] = None


class CheckReport(BaseModel):
    device: str
    spec: CheckSpec
    cases: list[CaseResult]
    aborted: Optional[str] = None  # a device fault stopped the check: where, and that later cases did not run
    # the card and build it ran on, as a tuning table names them (None off a real GPU)
    card: Optional[dict[str, Any]] = None

    @property
    def ok(self) -> bool:
        return self.aborted is None and all(c.ok and not c.failed_variants for c in self.cases)


def parse_spec(hidden: int, inter: int, experts: int, top_k: int, bits: str, codebooks: str, rows: str,
               seed: int, bench: bool, reps: int, also: str = "") -> CheckSpec:
    """The CLI's flags as a CheckSpec, or BadInput naming the flag."""
    def ints(flag: str, text: str) -> list[int]:
        parts = [t.strip() for t in text.split(",") if t.strip()]
        # ASCII digits only: int() also reads '٣' as 3, which nobody means on a command line
        if not parts or not all(re.fullmatch(r"[+-]?[0-9]+", t, re.ASCII) for t in parts):
            raise BadInput(f"--{flag} {text!r} is not a comma-separated list of integers",
                           hint=f"e.g. --{flag} {'2,3' if flag == 'bits' else '1,4,16'}")
        return [int(t) for t in parts]

    given = {"seed": ("--seed", seed), "hidden": ("--hidden", hidden), "inter": ("--inter", inter), "bits": ("--bits", bits),
             "codebooks": ("--codebook", codebooks), "rows": ("--rows", rows), "reps": ("--reps", reps),
             "also": ("--also", also)}
    if also.strip() and not bench:
        raise BadInput("--also times other builds beside the policy's: it needs --bench", hint="add --bench")
    try:
        return CheckSpec(hidden=hidden, inter=inter, experts=experts, top_k=top_k, bits=ints("bits", bits),
                         codebooks=[c.strip() for c in codebooks.split(",") if c.strip()],
                         rows=ints("rows", rows), seed=seed, bench=bench, reps=reps,
                         also=ints("also", also) if also.strip() else [])
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        first = e.errors()[0] if hasattr(e, "errors") else {"msg": str(e), "loc": ()}
        loc = first.get("loc") or ("",)
        msg = str(first.get("msg", e)).removeprefix("Value error, ")
        flag = given.get(str(loc[0]))
        raise BadInput(f"{flag[0]} {flag[1]}: {msg}" if flag else msg,
                       hint="see `dsv4serve kernel check --help`") from None


def candidates(rows: int, spec: CheckSpec, K: int, fit: Optional[Mapping[int, int]] = None) -> list[int]:
    """The policy's pick first, then every other build the policy serves somewhere that takes this
    shape and fits this card's shared memory at these rows (`fit`, as the dispatch reads it; None:
    every build fits): what a different choice on this card could be."""
    pick = policy.variant_for(rows, spec.inter, K, spec.hidden, fit)
    # the fallback first, then the policy's own list, so a build the policy adds is checked here too
    pool = [policy.SEAT_VARIANT] + [v for v in policy.served(spec.inter, spec.hidden) if v != policy.SEAT_VARIANT]
    out = [pick]
    for v in pool + spec.also:
        if v not in out and (fit is None or fit.get(v, 0) >= rows):
            out.append(v)
    return out


def row_errors(got: Any, ref: Any) -> list[float]:
    """Per-row relative L2 against the reference; a row whose reference is ~0 passes only at ~0."""
    num = (got.double() - ref).norm(dim=1).tolist()
    den = ref.norm(dim=1).tolist()
    return [n / d if d > 1e-3 else (n if n <= 1e-4 else float("inf")) for n, d in zip(num, den)]


def _device_fault(e: BaseException) -> bool:
    """A CUDA error (illegal address, a trap from a bounded spin, ...) rather than the binding's
    refusal (ValueError) or a bad argument: after one the context is unusable."""
    import torch

    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(e, accel)) or "CUDA error" in str(e) or "cudaError" in str(e)


def _first_line(e: BaseException) -> str:
    return first_line(e)[:300]


def check_case(run: Runner, layer: Any, spec: CheckSpec, K: int, cb: str, rows: int, device: Any,
               timer: Optional[Timer], grapher: Optional[Grapher] = None,
               fit: Optional[Mapping[int, int]] = None) -> CaseResult:
    import torch

    from dsv4serve.lna2.reference import moe_reference

    xdt = torch.bfloat16 if rows % 2 == 0 else torch.float16  # both input types the kernel takes

    def inputs(draw: int) -> tuple[Any, Any, Any]:
        """x, ids (int32) and weights (fp32) on the device; draw 0 is the case's, later ones fresh."""
        gen = torch.Generator(device="cpu").manual_seed(spec.seed * 1000 + rows * 10 + K + 7919 * draw)
        x_ = torch.randn((rows, spec.hidden), generator=gen).to(xdt).to(device)
        ids_ = torch.rand((rows, spec.experts), generator=gen).topk(spec.top_k, dim=-1).indices
        w_ = torch.softmax(torch.randn((rows, spec.top_k), generator=gen), dim=-1)
        return x_, ids_.to(torch.int32).to(device).contiguous(), w_.float().to(device).contiguous()

    def reference(x_: Any, ids_: Any, w_: Any) -> Any:
        return moe_reference(x_, layer, ids_.long(), w_, spec.swiglu_limit, torch.float64)

    x, ids32, w32 = inputs(0)
    ref = reference(x, ids32, w32)

    def verdict(variant: int) -> Verdict:
        outs: dict[Any, list[Any]] = {torch.float32: [], xdt: []}
        try:
            for dt, runs in outs.items():
                for _ in range(2):
                    out = torch.full((rows, spec.hidden), float("nan"), dtype=dt, device=device)
                    runs.append(run(x, ids32, w32, out, variant))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError:
            raise  # run() says how to free the GPU
        except (RuntimeError, ValueError) as e:  # the binding refuses with ValueError; CUDA errors
            return Verdict(error=_first_line(e), fault=_device_fault(e))
        finite = all(bool(torch.isfinite(o).all()) for runs in outs.values() for o in runs)
        worst = {dt: max(row_errors(runs[0], ref)) if finite else None for dt, runs in outs.items()}
        return Verdict(worst_rel=worst[torch.float32], worst_rel_x=worst[xdt], finite=finite,
                       repeat=all(bool(torch.equal(runs[0], runs[1])) for runs in outs.values()))

    def graph_verdict(variant: int, v: Verdict) -> Verdict:
        """Captured once on static buffers, replayed with fresh inputs copied in, as vLLM's decode
        graphs are: each replay against its own reference."""
        sx, sids, sw = x.clone(), ids32.clone(), w32.clone()
        sout = torch.empty((rows, spec.hidden), dtype=xdt, device=device)
        worst: Optional[float] = 0.0  # None once a replay leaves a NaN/Inf
        try:
            replay = grapher(lambda: run(sx, sids, sw, sout, variant))  # type: ignore[misc]
            for draw in range(1, GRAPH_REPLAYS + 1):
                for static, fresh in zip((sx, sids, sw), inputs(draw)):
                    static.copy_(fresh)
                sout.fill_(float("nan"))
                replay()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if worst is not None:
                    finite = bool(torch.isfinite(sout).all())
                    worst = max(worst, max(row_errors(sout, reference(sx, sids, sw)))) if finite else None
        except torch.cuda.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError) as e:
            return v.model_copy(update={"graph_checked": True, "graph_error": _first_line(e),
                                        "fault": _device_fault(e)})
        return v.model_copy(update={"graph_checked": True, "graph_worst_rel": worst})

    variants = candidates(rows, spec, K, fit) if timer else [policy.variant_for(rows, spec.inter, K, spec.hidden, fit)]
    pick = variants[0]
    if fit is not None and fit.get(pick, 0) < rows:
        # the dispatch declines these calls to the incumbent rather than launch: so does the check
        nofit = Verdict(error=f"v{pick} does not fit this card's shared memory per block at {rows} rows (it fits "
                              f"{fit.get(pick, 0)}); the dispatch declines such calls to the incumbent")
        return CaseResult(K=K, codebook=cb, rows=rows, x_dtype=str(xdt).removeprefix("torch."), variant=pick,
                          pick=nofit, ok=False, failed_variants=[], timings_us=None, fastest=None)
    first = verdict(pick)
    if grapher and first.error is None:
        first = graph_verdict(pick, first)
    failed: list[int] = []
    timings = fastest = None
    if timer and not first.fault:
        good = [pick] if first.ok else []
        for v in variants[1:]:
            other = verdict(v)
            (good if other.ok else failed).append(v)
            if other.fault:
                first = first.model_copy(update={"fault": True})  # the context is gone: stop here
                break
        if good and not first.fault:
            out = torch.empty((rows, spec.hidden), dtype=xdt, device=device)
            timings = timer({v: (lambda v=v: run(x, ids32, w32, out, v)) for v in good})
            fastest = min(timings, key=timings.__getitem__)
    fast_graph: Optional[bool] = None
    if fastest is not None and fastest != pick and grapher:
        g = graph_verdict(fastest, Verdict())
        fast_graph = g.graph_error is None and g.graph_worst_rel is not None and g.graph_worst_rel <= HALF_TOL
        if g.fault:
            first = first.model_copy(update={"fault": True})
    return CaseResult(K=K, codebook=cb, rows=rows, x_dtype=str(xdt).removeprefix("torch."), variant=pick,
                      pick=first, ok=first.ok, failed_variants=failed, timings_us=timings, fastest=fastest,
                      fastest_graph_ok=fast_graph)


def check(spec: CheckSpec, device: Any, make_runner: Callable[[Any], Runner], timer: Optional[Timer] = None,
          device_name: str = "", progress: Callable[[str], None] = lambda s: None,
          grapher: Optional[Grapher] = None, fitter: Optional[Fitter] = None) -> CheckReport:
    """Every (K, codebook, rows) of the spec on one layer per (K, codebook). `fitter` gives, per
    (K, codebook), the most rows each build fits on this card, as the dispatch asks the binding."""
    from dsv4serve.lna2.reference import random_expert_layer

    cases: list[CaseResult] = []
    for K in spec.bits:
        for cb in spec.codebooks:
            layer = random_expert_layer(spec.experts, spec.hidden, spec.inter, K, cb, seed=spec.seed + K,
                                        device=device)
            run = make_runner(layer)
            fit = fitter(K, cb) if fitter else None
            for rows in spec.rows:
                where = f"K{K} {cb} {rows} row{'s' if rows > 1 else ''}"
                progress(where)
                cases.append(check_case(run, layer, spec, K, cb, rows, device, timer if spec.bench else None,
                                        grapher, fit))
                if cases[-1].pick.fault:
                    return CheckReport(device=device_name or str(device), spec=spec, cases=cases,
                                       aborted=f"a device fault at {where}; the CUDA context is unusable after "
                                               "one, so the later cases did not run")
            del run, layer
    return CheckReport(device=device_name or str(device), spec=spec, cases=cases)


# --- the GPU side -----------------------------------------------------------------------------------


def pointer_tables(tensors: Sequence[Any], device: Any) -> list[Any]:
    """Per expert-stacked tensor, the int64 table of its experts' data pointers (lna2's tables)."""
    import torch

    return [torch.tensor([t[e].data_ptr() for e in range(t.shape[0])], dtype=torch.int64, device=device)
            for t in tensors]


class Lna2Runner:
    """lna2 on one CUDA device for one layer: pointer tables and a zeroed scratch, held as the
    vLLM dispatch holds them (moe_dispatch)."""

    def __init__(self, ext: Any, layer: Any, device: Any, swiglu_limit: float) -> None:
        import torch

        from dsv4serve.moe_dispatch import TABLES  # the binding's table order, one copy

        self.tables = pointer_tables([getattr(layer, n) for n in TABLES], device)
        self.scratch = torch.zeros(int(ext.lna2_moe_scratch_bytes(layer.hidden, layer.inter)), dtype=torch.uint8,
                                   device=device)
        self.ext, self.layer, self.limit = ext, layer, swiglu_limit
        self.cb = CODEBOOKS[layer.codebook]

    def __call__(self, x: Any, ids32: Any, w32: Any, out: Any, variant: int) -> Any:
        self.ext.lna2_moe_decode(x, out, *self.tables, ids32, w32, self.layer.K, self.limit, self.scratch,
                                 self.layer.inter, self.cb, variant)
        return out


def cuda_timer(device: Any, reps: int) -> Timer:
    """Median microseconds per launch, cold: launches alternate between the variants, each after a
    write of 4x the card's L2, all enqueued behind a spin so the host's launch cost is not in the
    events. The write sends the weights back to memory; the alternation does the same to each
    build's code, which the SMs keep across a flush but not across another build's full launch
    (kernels/lna2/NOTES.md, session 29), as at decode, where attention and the dense GEMMs run
    between two MoE launches. Ten launches of one build in a row (the device bench) keep it."""
    import torch

    props = torch.cuda.get_device_properties(device)
    l2 = int(getattr(props, "L2_cache_size", 0) or 64 * 2**20)
    flush = torch.empty(max(4 * l2, 64 * 2**20) // 4, dtype=torch.int32, device=device)

    def time_them(fns: dict[int, Callable[[], None]]) -> dict[int, float]:
        for fn in fns.values():  # first-launch setup (function attributes, module load) off the clock
            fn()
        torch.cuda.synchronize(device)
        events: dict[int, list[tuple[Any, Any]]] = {v: [] for v in fns}
        torch.cuda._sleep(50_000_000)
        for rep in range(reps):
            for v, fn in fns.items():
                flush.fill_(rep)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                events[v].append((e0, e1))
        torch.cuda.synchronize(device)
        return {v: round(statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev), 2) for v, ev in events.items()}

    return time_them


def cuda_grapher(device: Any) -> Grapher:
    """Capture one launch into a CUDA graph (after a warm launch outside it, as vLLM does)."""
    import torch

    def capture(launch: Callable[[], None]) -> Callable[[], None]:
        launch()
        torch.cuda.synchronize(device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            launch()
        return g.replay

    return capture


def _uuid_key(u: str) -> str:
    """NVML writes "GPU-8c6f...", torch a bare UUID: compare the hex digits."""
    return u.lower().removeprefix("gpu-").replace("-", "")


def seat_using(gpu_uuid: str) -> Optional[str]:
    """A live seat whose recorded GPUs include this one ("name (pid N)"), or None. A seat's memory
    would leave the check too little, and its traffic would skew the timings."""
    from dsv4serve import state
    from dsv4serve.errors import DsvError

    want = _uuid_key(gpu_uuid)
    for name in state.all_seats():
        try:
            st = state.load(name)
        except DsvError:  # unreadable: `status` / `down` deal with it, it proves nothing about this GPU
            continue
        if st is not None and state.liveness(st) == "alive" and want in {_uuid_key(u) for u in st.gpu_uuids}:
            return f"{st.seat} (pid {st.pid})"
    return None


def run(spec: CheckSpec, gpu: int = 0, progress: Callable[[str], None] = lambda s: None) -> CheckReport:
    """The check on local GPU `gpu`, with the built extension. JobFailed when it cannot run here."""
    import torch

    from dsv4serve.lna2 import loader

    if not torch.cuda.is_available():
        raise JobFailed("no CUDA GPU is visible to torch on this machine",
                        hint="`dsv4serve kernel check` runs lna2 on a local GPU: run it on the seat's machine")
    if not 0 <= gpu < torch.cuda.device_count():
        raise BadInput(f"--gpu {gpu}: this machine has GPUs 0..{torch.cuda.device_count() - 1}",
                       hint="pick one of them (torch's numbering, after CUDA_VISIBLE_DEVICES)")
    try:
        ext = loader.load()
    except RuntimeError as e:
        raise JobFailed(f"lna2 extension not loadable: {e}", hint="run `dsv4serve kernel build`") from None
    from dsv4serve.moe_dispatch import EXT_API

    if missing := [f for f in EXT_API if not hasattr(ext, f)]:  # what the dispatch calls, as it checks
        raise JobFailed(f"the lna2 extension lacks {', '.join(missing)}: a build of other sources",
                        hint="rebuild it with `dsv4serve kernel build`")
    device = torch.device("cuda", gpu)
    busy = seat_using(str(getattr(torch.cuda.get_device_properties(device), "uuid", "")))
    if busy:
        raise BadInput(f"GPU {gpu} belongs to the running seat {busy}: the check needs its memory, and "
                       "timings beside a serving seat mean nothing",
                       hint="stop the seat first (`dsv4serve down`), or pick a GPU it does not use with --gpu")
    torch.cuda.set_device(device)
    try:  # the build's own limits, and whether it takes this layer at all
        info = dict(ext.lna2_moe_info(spec.bits[0], CODEBOOKS[spec.codebooks[0]], spec.hidden, spec.inter))
    except (RuntimeError, ValueError) as e:
        first = _first_line(e)[:200]
        raise BadInput(f"lna2 does not take a {spec.hidden} x {spec.inter} layer: {first}",
                       hint="check --hidden and --inter (this rank's slice)") from None
    if max(spec.rows) > info["max_rows"]:
        raise BadInput(f"--rows {max(spec.rows)}: this build takes 1..{info['max_rows']} rows per call",
                       hint=f"drop the rows above {info['max_rows']}")
    if spec.experts > info["max_experts"] or spec.top_k > info["max_top_k"]:
        raise BadInput(f"--experts {spec.experts} / --top-k {spec.top_k}: this build takes up to "
                       f"{info['max_experts']} experts and top-k {info['max_top_k']}",
                       hint="use the layer's per-rank expert count")
    name = f"cuda:{gpu} {torch.cuda.get_device_name(device)} (sm_{''.join(map(str, torch.cuda.get_device_capability(device)))})"
    try:
        def fitter(K: int, cb: str) -> dict[int, int]:
            try:
                fit = policy.fit_table(ext, K, CODEBOOKS[cb], spec.hidden, spec.inter, spec.top_k, spec.experts)
            except (RuntimeError, ValueError) as e:  # a build of other sources, or a shape it refuses
                raise JobFailed(f"lna2 cannot size its launches for K{K} {cb} on this GPU: {_first_line(e)}",
                                hint="rebuild it with `dsv4serve kernel build`") from None
            for v in spec.also:  # a build that does not take this shape (or does not exist) fits no rows
                try:
                    fit.setdefault(v, int(ext.lna2_moe_fit(v, K, CODEBOOKS[cb], spec.hidden, spec.inter, spec.top_k,
                                                           spec.experts)))
                except (RuntimeError, ValueError):
                    fit.setdefault(v, 0)
            return fit

        report = check(spec, device, lambda layer: Lna2Runner(ext, layer, device, spec.swiglu_limit),
                       cuda_timer(device, spec.reps) if spec.bench else None, name, progress, cuda_grapher(device),
                       fitter)
        from dsv4serve.lna2.tuning import card_identity

        card, sms = card_identity(device)
        report.card = {"device": card, "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
                       "sm_count": sms, "build_id": str(ext.lna2_build_id())}
        return report
    except torch.cuda.OutOfMemoryError:
        free, total = torch.cuda.mem_get_info(device)
        raise JobFailed(f"GPU {gpu} ran out of memory ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free)",
                        hint="stop the seat first (`dsv4serve down`) or pick another GPU with --gpu") from None


def tuning_target(path: Path, bench: bool) -> None:
    """Refuse a --save-tuning that could not be written, before the check runs."""
    if not bench:
        raise BadInput("--save-tuning reads the table off the timings: it needs --bench", hint="add --bench")
    if path.is_dir():
        raise BadInput(f"--save-tuning {path} is a directory", hint="name a file, e.g. --save-tuning "
                       f"{path / 'lna2-tuning.json'}")
    if (path.exists() or path.is_symlink()) and (path.is_symlink() or not path.is_file()):
        # the table is renamed over its path: a FIFO, a device or /dev/stdout's link would be replaced by a file
        raise BadInput(f"--save-tuning {path} is not a regular file", hint="name a regular file (it is replaced whole)")
    from dsv4serve.home import nearest_existing

    parent, broken = nearest_existing(path.parent)
    if broken is not None:
        raise BadInput(f"--save-tuning {path}: {broken} is a broken symlink", hint="pick a path you can write")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(f"--save-tuning {path}: {parent} is not a writable directory", hint="pick a path you can write")


def save_tuning(report: CheckReport, path: Path) -> dict[str, Any]:
    """Write the report's tuning table to `path` (atomically); what was written, or why nothing was."""
    from dsv4serve.lna2 import tuning

    if report.card is None:
        return {"path": str(path), "refused": "the check did not run on a GPU"}
    try:
        table = tuning.from_report(report, **report.card)
    except tuning.TuningError as e:
        return {"path": str(path), "refused": str(e)}
    try:
        digest = tuning.save(table, path)
    except OSError as e:  # checked before the run; the disk may have changed since, and the report stays
        return {"path": str(path), "refused": f"cannot write it: {e.strerror or e}"}
    changes = [f"{k} {r} row{'s' if r > 1 else ''}: v{v} instead of v{base} ({tv:.1f} against {tb:.1f} µs)"
               for k, r, base, v, tb, tv in table.changes()]
    return {"path": str(path.resolve()), "digest": digest, "changes": changes}


def table_rows(report: CheckReport) -> list[list[str]]:
    """The human table: one row per case (CLI renders it)."""
    out = []
    def err(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.1e}"

    for c in report.cases:
        p = c.pick
        verdict = ("ok" if c.ok else f"error: {p.error}" if p.error else "NaN/Inf" if not p.finite
                   else "not repeatable" if not p.repeat
                   else f"graph: {p.graph_error}" if p.graph_error
                   else "graph replay off" if p.graph_checked and (p.graph_worst_rel is None
                                                                   or p.graph_worst_rel > HALF_TOL)
                   else "off the reference")
        row = [f"K{c.K}", c.codebook, str(c.rows), c.x_dtype, f"v{c.variant}",
               f"{err(p.worst_rel)} · {err(p.worst_rel_x)}", "yes" if p.repeat else "NO", verdict]
        if report.spec.bench:
            t = c.timings_us or {}
            row.append(f"{t[c.variant]:.1f}" if c.variant in t else "-")
            if c.fastest is None:
                row.append("-")
            elif c.fastest == c.variant:
                row.append("the pick")
            else:
                row.append(f"v{c.fastest} {t[c.fastest]:.1f} ({t[c.variant] / t[c.fastest]:.2f}x)"
                           if c.variant in t else f"v{c.fastest} {t[c.fastest]:.1f}")
            if c.failed_variants:
                row[-1] += "; off: " + ", ".join(f"v{v}" for v in c.failed_variants)
        out.append(row)
    return out


def headers(bench: bool) -> Sequence[str]:
    h = ["K", "codebook", "rows", "x", "pick", f"worst row err: fp32 · x-type out (tol {FP32_TOL:.0e} · {HALF_TOL:.0e})",
         "repeat", "result"]
    return h + ["pick µs (cold)", "fastest here"] if bench else h
