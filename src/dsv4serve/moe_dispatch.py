"""lna2 dispatch for vllm-exl3's routed-expert layers, with no way to fall back in silence.

At load, per MoE layer: check the layer against the lna2 kernel's contract, build the nine
per-expert pointer tables once, and make sure the device has its zeroed scratch (one per device,
shared by every layer, sized for the largest geometry) before anything can be captured. Then the
layer's quant method gets a wrapped ``apply``: decode-shaped calls (1 <= rows <= the kernel's
ceiling) go to ``lna2_moe_decode``, everything else to the method's own (incumbent) apply, and
every distinct reason for not using lna2 is logged once and counted.

This module is pure torch: it imports neither vLLM nor vllm-exl3 (not installable here), so the
whole dispatch is unit-tested on a CPU against stand-ins (tests/test_moe_dispatch.py).
``vllm_plugin`` is the glue that finds the layers and calls :meth:`Runtime.prepare`.

Strict levels (``VLLM_EXL3_MOE_STRICT``), for a seat whose kernel is lna2:
  0  fall back to the incumbent, with the reason logged once and counted;
  1  raise at load when lna2 cannot be made ready on this rank (``lna2 not ready: ...``), and
     raise on any dispatch error; shape declines (prefill rows above the ceiling) only log;
  2  also raise on shape declines (gate runs that must never leave lna2).

Routed scaling factor: the dispatch never applies it, because what reaches ``apply`` already
carries it exactly as the incumbent expects. vLLM 0.32 (checked in the installed sources):
  * DeepSeek-V4 (models/deepseek_v4/nvidia/model.py:873-886) builds its experts with
    ``routed_scaling_factor`` and the default ``apply_routed_scale_to_output=False``, so the router
    multiplies ``topk_weights`` (fused_topk_bias_router.py:225-226 and :366-367,
    router/dsv4_topk.py:103) and the runner's own factor is 1.0 (fused_moe/layer.py:310, 406, 435);
  * DeepSeek-V2/V3 (the demo model; model_executor/models/deepseek_v2.py:1336) passes
    ``apply_routed_scale_to_output=True`` off ROCm, so the router gets 1.0 and the runner scales
    the routed output after ``apply`` returns (fused_moe/runner/moe_runner.py:415-419).
Either way the weights handed to ``apply`` are what the incumbent (vllm-exl3's
``apply_exl3_experts``, which uses them as given) multiplies by; passing them to lna2 unchanged
applies the factor exactly once, and ``layer.routed_scaling_factor`` says which case holds.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4serve.errors import first_line
from dsv4serve.lna2 import policy, tuning
from dsv4serve.lna2.policy import UBATCH_WHY, variant_for
from dsv4serve.lna2.reference import MCG_MARKER, MUL1_MARKER
from dsv4serve.plugin_counters import PARITY_DECLINE, PARITY_TOL, Counters

KERNELS = ("lna2", "incumbent", "none")
STRICT_LEVELS = (0, 1, 2)
# vllm-exl3's own VLLM_EXL3_MOE_KERNEL values; only lna2 is ours to dispatch, the rest mean
# "the incumbent as far as dsv4serve is concerned" (vllm-exl3 may still pick its own path).
_EXL3_KERNEL_VALUES = {"lna2": "lna2", "exllamav3": "incumbent", "auto": "incumbent", "lna": "incumbent",
                       "native": "incumbent", "incumbent": "incumbent", "none": "none"}
CODEBOOKS = {"mcg": (1, MCG_MARKER), "mul1": (2, MUL1_MARKER)}  # lna2 codebook id, marker value
TABLES = ("gate_trellis", "gate_suh", "gate_svh", "up_trellis", "up_suh", "up_svh",
          "down_trellis", "down_suh", "down_svh")
EXT_API = ("lna2_moe_decode", "lna2_moe_max_rows", "lna2_moe_scratch_bytes", "lna2_moe_info", "lna2_moe_fit",
           "lna2_build_id")
# vllm-exl3's apply clamps at `moe.swiglu_limit or 10.0` (SWIGLU_LIMIT_DEFAULT): an unset, None or
# 0 limit is 10, not "no clamp". lna2 wants a finite positive clamp; for an infinite one, a clamp at
# 3e38 changes no finite fp32 value, so it is the same function.
SWIGLU_LIMIT_DEFAULT = 10.0
NO_CLAMP = 3.0e38
PARITY_FLOOR = 1e-3  # the parity check: a row whose norm is below this on both sides is judged on that floor
KERNEL_MAX_TOP_K = 8  # lna2_api.h MAX_TOPK; the build's lna2_moe_info(...)["max_top_k"] wins
KERNEL_MAX_EXPERTS = 256
MAX_LOGGED_REASONS = 32
TUNING_ENV = "DSV4SERVE_LNA2_TUNING"  # the launcher's copy of the profile's moe.tuning table


class PluginConfigError(ValueError):
    """The launcher's env asks for something the plugin does not know: fail closed."""


class ContractError(ValueError):
    """Why a layer cannot be served by lna2 (the text is the logged reason). `key`: the counted
    decline reason when the text varies per call (a row count), so one cause is one counter."""

    def __init__(self, text: str, key: str | None = None) -> None:
        super().__init__(text)
        self.key = key or text


class Lna2NotReadyError(RuntimeError):
    """Strict >= 1: lna2 cannot be made ready on this rank. Message: ``lna2 not ready: ...``."""


class Lna2DispatchError(RuntimeError):
    """Strict >= 1: a call that should have gone to lna2 did not (or strict 2: a shape decline)."""


# --- the launcher's env ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PluginEnv:
    run_id: str
    run_dir: str | None
    kernel: str  # lna2 | incumbent | none
    strict: int  # 0 | 1 | 2
    decode_rows: int | None = None  # rows of the seat's decode calls, when the launcher said
    # how decode_rows was counted; the plugin recounts from vLLM's resolved config (vllm_plugin)
    decode_rows_why: str = "max_num_seqs x (1 + speculative tokens)"
    tuning: str | None = None  # this card's lna2 tuning table (lna2/tuning.py), when the profile names one
    # micro-batches vLLM splits each step into (dual batch overlap, ubatch_size), from its resolved
    # config; lna2 refuses them (policy.UBATCH_WHY)
    ubatches: int = 0


def read_env(environ: Mapping[str, str]) -> PluginEnv | None:
    """The plugin's settings, or None when dsv4serve did not launch this process (inert)."""
    run_id = environ.get("DSV4SERVE_RUN_ID", "")
    if not run_id:
        return None
    raw_kernel = environ.get("DSV4SERVE_MOE_KERNEL", "").strip()
    if raw_kernel:
        if raw_kernel not in KERNELS:
            raise PluginConfigError(f"DSV4SERVE_MOE_KERNEL={raw_kernel!r} is not one of {'|'.join(KERNELS)}")
        kernel = raw_kernel
    else:
        exl3 = environ.get("VLLM_EXL3_MOE_KERNEL", "").strip().lower()
        if exl3 and exl3 not in _EXL3_KERNEL_VALUES:
            raise PluginConfigError(f"VLLM_EXL3_MOE_KERNEL={exl3!r} is not one of "
                                    f"{'|'.join(sorted(_EXL3_KERNEL_VALUES))}")
        kernel = _EXL3_KERNEL_VALUES.get(exl3, "incumbent")
    raw_strict = environ.get("VLLM_EXL3_MOE_STRICT", "0").strip() or "0"
    if raw_strict not in ("0", "1", "2"):
        raise PluginConfigError(f"VLLM_EXL3_MOE_STRICT={raw_strict!r} is not 0, 1 or 2")
    raw_rows = environ.get("DSV4SERVE_DECODE_ROWS", "").strip()
    if raw_rows and not (raw_rows.isascii() and raw_rows.isdigit() and int(raw_rows) > 0):
        raise PluginConfigError(f"DSV4SERVE_DECODE_ROWS={raw_rows!r} is not a positive whole number")
    return PluginEnv(run_id=run_id, run_dir=environ.get("DSV4SERVE_RUN_DIR") or None, kernel=kernel,
                     strict=int(raw_strict), decode_rows=int(raw_rows) if raw_rows else None,
                     tuning=environ.get(TUNING_ENV, "").strip() or None)


# --- which layers ---------------------------------------------------------------------------------


def is_exl3_moe_method(method: object) -> bool:
    """vllm-exl3's ``Exl3MoEMethod`` (or a subclass), recognised without importing vllm_exl3."""
    return any(c.__name__ == "Exl3MoEMethod" and (c.__module__ or "").split(".")[0] == "vllm_exl3"
               for c in type(method).__mro__)


# --- the contract ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    n_experts: int
    hidden: int
    inter: int  # this rank's intermediate slice
    bits: int
    codebook: int  # 1 mcg, 2 mul1 (lna2's numbering)
    codebook_name: str
    top_k: int
    device: torch.device
    swiglu_limit: float


def _tensor(layer: Any, name: str) -> torch.Tensor:
    t = getattr(layer, name, None)
    if t is None:
        raise ContractError(f"missing parameter {name}")
    if not isinstance(t, torch.Tensor):
        raise ContractError(f"{name} is a {type(t).__name__}, not a tensor")
    return t.data if isinstance(t, torch.nn.Parameter) else t


def _marker(layer: Any, proj: str, n: int) -> str:
    """The one codebook a projection's markers name; all-zero marker tensors count as absent."""
    found = []
    for cb, (_, value) in CODEBOOKS.items():
        t = getattr(layer, f"{proj}_{cb}", None)
        if t is None:
            continue
        t = t.data if isinstance(t, torch.nn.Parameter) else t
        if t.numel() != n:
            raise ContractError(f"codebook marker {proj}_{cb} has {t.numel()} values, expected {n}")
        if t.dtype != torch.int32:
            raise ContractError(f"codebook marker {proj}_{cb} is {t.dtype}, expected torch.int32")
        if bool((t == 0).all()):
            continue
        if not bool((t == value).all()):
            bad = int(t[t != value].reshape(-1)[0])
            raise ContractError(f"codebook marker {proj}_{cb} holds {bad}, expected {value}")
        found.append(cb)
    if len(found) != 1:
        what = "both mcg and mul1" if found else "neither mcg nor mul1 (3INST is not an lna2 codebook)"
        raise ContractError(f"codebook: {proj} carries {what} markers; exactly one is required")
    return found[0]


def _swiglu_limit(method: Any) -> float:
    """The clamp the incumbent applies to this layer, as vllm-exl3's apply reads it (from the
    method's MoE config only), or ContractError where lna2 cannot compute the same function."""
    raw = getattr(getattr(method, "moe", None), "swiglu_limit", None) or SWIGLU_LIMIT_DEFAULT
    try:
        v = float(raw)
    except (TypeError, ValueError):
        raise ContractError(f"swiglu_limit: {raw!r} is not a number") from None
    if v == math.inf:
        return NO_CLAMP
    if not math.isfinite(v) or v <= 0:
        raise ContractError(f"swiglu_limit: {v!r}; lna2 clamps at a finite positive limit")
    return v


def _top_k(layer: Any, method: Any) -> int | None:
    k = getattr(layer, "top_k", None)
    if k is None:
        k = getattr(getattr(method, "moe", None), "experts_per_token", None)
    return int(k) if k is not None else None


def validate_layer(layer: Any, method: Any, *, max_top_k: int = KERNEL_MAX_TOP_K,
                   max_experts: int = KERNEL_MAX_EXPERTS, require_cuda: bool = True) -> Geometry:
    """The layer's geometry, or ContractError naming the first thing lna2 cannot serve.

    Shapes are vllm-exl3 0.2.3's ``Exl3MoEMethod`` parameters (exl3-reference §4.4):
    w13_trellis [E,2,H/16,I/16,16K] int16 (0 gate, 1 up), w13_suh [E,2,H], w13_svh [E,2,I] fp16,
    w2_trellis [E,I/16,H/16,16K], w2_suh [E,I], w2_svh [E,H]; markers w13_{mcg|mul1} [E,2,1] and
    w2_{mcg|mul1} [E,1] int32.
    """
    w13t = _tensor(layer, "w13_trellis")
    if w13t.dim() != 5 or w13t.shape[1] != 2:
        raise ContractError(f"w13_trellis shape {tuple(w13t.shape)} is not [E, 2, H/16, I/16, 16K]")
    e, _, h16, i16, words = (int(s) for s in w13t.shape)
    if words % 16:
        raise ContractError(f"w13_trellis last dim {words} is not 16*K")
    bits = words // 16
    if bits not in policy.BITS:
        raise ContractError(f"K={bits} (trellis last dim {words}) is not 2 or 3")
    hidden, inter = 16 * h16, 16 * i16
    if hidden % 128 or hidden > 16384:
        raise ContractError(f"hidden {hidden} is not a multiple of 128 up to 16384")
    if inter % 128 or inter > 8192:
        raise ContractError(f"local intermediate {inter} is not a multiple of 128 up to 8192")
    if not 1 <= e <= max_experts:
        raise ContractError(f"{e} local experts, outside 1..{max_experts}")
    expected = {
        "w13_trellis": ((e, 2, h16, i16, words), torch.int16),
        "w13_suh": ((e, 2, hidden), torch.float16),
        "w13_svh": ((e, 2, inter), torch.float16),
        "w2_trellis": ((e, i16, h16, words), torch.int16),
        "w2_suh": ((e, inter), torch.float16),
        "w2_svh": ((e, hidden), torch.float16),
    }
    device = w13t.device
    for name, (shape, dtype) in expected.items():
        t = _tensor(layer, name)
        if tuple(t.shape) != shape:
            raise ContractError(f"{name} shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != dtype:
            raise ContractError(f"{name} is {t.dtype}, expected {dtype}")
        if not t.is_contiguous():
            raise ContractError(f"{name} is not contiguous (per-expert pointers need dense slices)")
        if t.device != device:
            raise ContractError(f"{name} is on {t.device}, w13_trellis on {device}")
    if require_cuda and device.type != "cuda":
        raise ContractError(f"experts are on {device}, not a CUDA device")
    cb13, cb2 = _marker(layer, "w13", 2 * e), _marker(layer, "w2", e)
    if cb13 != cb2:
        raise ContractError(f"codebook: w13 is {cb13} but w2 is {cb2}")
    top_k = _top_k(layer, method)
    if top_k is None or not 1 <= top_k <= max_top_k:
        raise ContractError(f"top_k {top_k} outside 1..{max_top_k}")
    act = getattr(getattr(method, "moe", None), "activation", getattr(layer, "activation", None))
    act = getattr(act, "value", act)
    if act is not None and str(act) != "silu":
        raise ContractError(f"activation {act} is not SiLU-gated (lna2 computes clipped SwiGLU)")
    if getattr(layer, "apply_router_weight_on_input", False):
        raise ContractError("apply_router_weight_on_input is set (lna2 weights the expert outputs)")
    return Geometry(n_experts=e, hidden=hidden, inter=inter, bits=bits, codebook=CODEBOOKS[cb13][0],
                    codebook_name=cb13, top_k=top_k, device=device, swiglu_limit=_swiglu_limit(method))


def pointer_tables(layer: Any, g: Geometry) -> dict[str, torch.Tensor]:
    """The nine int64 [E] tables of per-expert data_ptrs (gate = w13[:, 0], up = w13[:, 1], down = w2).

    Built once at load from the stacked parameters' base pointers and strides (the tensors are
    contiguous, checked by :func:`validate_layer`), every pointer checked for 16-byte alignment,
    then copied to the experts' device. The layer keeps the parameters alive, so the pointers
    stay valid for the process's life.
    """
    sources = {
        "gate": [("trellis", "w13_trellis", 0), ("suh", "w13_suh", 0), ("svh", "w13_svh", 0)],
        "up": [("trellis", "w13_trellis", 1), ("suh", "w13_suh", 1), ("svh", "w13_svh", 1)],
        "down": [("trellis", "w2_trellis", None), ("suh", "w2_suh", None), ("svh", "w2_svh", None)],
    }
    out: dict[str, torch.Tensor] = {}
    for proj, items in sources.items():
        for kind, pname, slot in items:
            t = _tensor(layer, pname)
            esz = t.element_size()
            base = t.data_ptr()
            ptrs = []
            for e in range(g.n_experts):
                off = e * t.stride(0) + (slot * t.stride(1) if slot is not None else 0)
                p = base + off * esz
                if p % 16:
                    where = f"{pname}[{e}, {slot}]" if slot is not None else f"{pname}[{e}]"
                    raise ContractError(f"pointer {where} = {p:#x} is not 16-byte aligned")
                ptrs.append(p)
            out[f"{proj}_{kind}"] = torch.tensor(ptrs, dtype=torch.int64).to(g.device)
    return {name: out[name] for name in TABLES}


# --- scratch --------------------------------------------------------------------------------------


def _capturing() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class ScratchPool:
    """One zeroed lna2 scratch per device, shared by all layers (their launches never overlap on
    one stream; lna2_moe_info reports concurrent_streams=1). Only grown at load: a scratch made
    with torch.empty, or made during capture, silently corrupts the kernel's scheduler (trap 20).
    A grown pool keeps the old tensor alive, so nothing captured against it can dangle."""

    def __init__(self, capturing: Callable[[], bool] = _capturing) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []
        self._capturing = capturing

    def ensure(self, device: torch.device, nbytes: int) -> torch.Tensor:
        cur = self._by_device.get(device)
        if cur is not None and cur.numel() >= nbytes:
            return cur
        if self._capturing():
            raise RuntimeError(f"lna2 scratch for {device} was not allocated before graph capture")
        new = torch.zeros(int(nbytes), dtype=torch.uint8, device=device)
        if cur is not None:
            self._retired.append(cur)
        self._by_device[device] = new
        return new

    def get(self, device: torch.device) -> torch.Tensor | None:
        return self._by_device.get(device)

    def bytes_resident(self) -> int:
        return sum(t.numel() for t in self._by_device.values()) + sum(t.numel() for t in self._retired)


# --- per-layer state ------------------------------------------------------------------------------


@dataclass
class LayerState:
    name: str
    layer: Any
    method: Any
    entry: str  # the method attribute the MoE runner calls: apply, or apply_monolithic
    orig_apply: Callable[..., Any]
    geometry: Geometry | None = None  # set when lna2 serves this layer
    tables: tuple[torch.Tensor, ...] = ()
    not_ready: str | None = None  # why lna2 does not serve it (kernel lna2, strict 0)
    fit: dict[int, int] | None = None  # per build the policy may pick: the most rows that fit the device
    tuned: dict[int, int] | None = None  # rows -> build from this card's tuning table, where it holds the layer
    verified: bool = False  # lna2's output matched the incumbent's on a multi-row call of this layer's own
    captured: bool = False  # a CUDA graph holds an lna2 launch of this layer (replays never come back here)
    unchecked: str | None = None  # strict 0: why the incumbent cannot check this layer (no further tries)


@dataclass
class LoadSummary:
    draft: bool
    layers: list[str] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)
    lna2_layers: int = 0
    not_ready: dict[str, list[str]] = field(default_factory=dict)

    @property
    def method_names(self) -> str:
        return ",".join(sorted(set(self.methods))) or "none"


def _build_key(st: LayerState, variant: int) -> tuple[int, int, int, int, int]:
    g = st.geometry
    assert g is not None
    return (variant, g.bits, g.codebook, g.hidden, g.inter)


def _varied(x: torch.Tensor, rows: int) -> bool:
    """Rows that differ (one host sync): vLLM's warm-up runs identical dummy rows, which cannot show
    a kernel that mixes rows."""
    if rows < 2:
        return False
    x2 = x.reshape(rows, -1)
    return bool((x2 != x2[:1]).any())


def _worst_row(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest per-row relative L2 between two [rows, n] fp32 outputs; inf where they disagree on
    which entries are not finite (an input that overflows both is not lna2's fault)."""
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb):
        return math.inf
    if not bool(fa.all()):
        same = torch.equal(a[~fa].nan_to_num(), b[~fb].nan_to_num())
        if not same:
            return math.inf
        a, b = a.where(fa, torch.zeros_like(a)), b.where(fb, torch.zeros_like(b))
    floor = torch.full((a.shape[0],), PARITY_FLOOR, device=a.device)
    rel = (a - b).norm(dim=1) / torch.maximum(torch.maximum(a.norm(dim=1), b.norm(dim=1)), floor)
    return float(rel.max()) if rel.numel() else 0.0


def _spans(values: list[int]) -> str:
    """Sorted whole numbers as runs: [1, 2, 3, 4, 8, 12, 13] -> "1-4,8,12-13"."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() >= 1 and x.shape[-1] else 0


def _rows_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The call's row count, 0 when its x cannot be found (the incumbent is called all the same)."""
    try:
        return _rows(_pick(args, kwargs, 1, "x"))
    except Exception:  # noqa: BLE001 - counting must never fail a call lna2 does not serve
        return 0


def _pick(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    if len(args) > i:
        return args[i]
    raise TypeError(f"apply() got no {name}")


# --- the runtime (one per worker process) ---------------------------------------------------------


class Runtime:
    """Dispatch policy, markers and counters for one worker process (one TP rank)."""

    def __init__(self, env: PluginEnv, rank: int, tp: int, *, emit: Callable[[str], None],
                 counters: Counters, ext_loader: Callable[[], Any], require_cuda: bool = True,
                 capturing: Callable[[], bool] = _capturing,
                 device_identity: Callable[[torch.device], tuple[str, int]] = tuning.card_identity) -> None:
        self.env, self.rank, self.tp = env, rank, tp
        self.emit = emit
        self.counters = counters
        self._ext_loader = ext_loader
        self._ext: Any = None
        self._ext_error: str | None = None
        self._rows_refusal: str | None = None  # strict: the build's row ceiling is below the seat's decode
        self.require_cuda = require_cuda
        self.scratch = ScratchPool(capturing)
        self._capturing = capturing
        # (build, bits, codebook, hidden, inter) whose output matched the incumbent's once: a build is
        # checked at each geometry it serves (a K2-only fault is not seen on a K3 layer)
        self.verified_builds: set[tuple[int, int, int, int, int]] = set()
        self._verified_logged = False
        self.states: list[LayerState] = []
        self.ceiling = 0
        self.build_id = "?"
        self._limits: dict[str, dict[str, Any]] = {}  # lna2_moe_info per geometry
        self._fits: dict[str, dict[int, int]] = {}  # lna2_moe_fit per shape and build
        self._identity = device_identity
        self._tuning: tuple[tuning.TuningTable, str] | None = None  # the table and its digest
        self._tuning_error: str | None = None
        self._tuning_mismatch: dict[str, str | None] = {}  # per device: why the table is not this card's
        self.tuned_digest: str | None = None  # set once a layer is served from the table
        self._active_logged = False
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    @property
    def who(self) -> str:
        return f"rank={self.rank}/{self.tp}"

    @property
    def lna2_layers(self) -> int:
        return sum(1 for s in self.states if s.geometry is not None)

    @property
    def effective_kernel(self) -> str:
        if self.env.kernel == "lna2":
            return "lna2" if self.lna2_layers else "incumbent"
        return self.env.kernel

    @property
    def bits(self) -> list[int]:
        return sorted({s.geometry.bits for s in self.states if s.geometry is not None})

    # -- load ----------------------------------------------------------------------------------
    def prepare(self, layers: Sequence[tuple[str, Any]], *, draft: bool) -> LoadSummary:
        """Wrap every MoE layer's apply; with kernel lna2 make each EXL3 layer ready or say why.

        Strict >= 1 raises :class:`Lna2NotReadyError` at the first layer lna2 cannot serve, before any
        layer of this model is wrapped, so the worker dies at load with the reason.
        """
        summary = LoadSummary(draft=draft)
        fresh: list[LayerState] = []
        for name, layer in layers:
            method = layer.quant_method
            if getattr(method, "_dsv4serve_state", None) is not None:
                continue  # already prepared (the hook ran twice on one model)
            summary.layers.append(name)
            summary.methods.append(type(method).__name__)
            entry = "apply_monolithic" if getattr(method, "is_monolithic", False) else "apply"
            st = LayerState(name=name, layer=layer, method=method, entry=entry, orig_apply=getattr(method, entry))
            if self.env.kernel == "lna2" and draft and not is_exl3_moe_method(method):
                # An MTP draft whose experts are not EXL3 (vllm-exl3's mtp_experts=source delegates
                # them): lna2 has nothing to serve there, by design. Said once, counted as incumbent.
                if self._once(f"draft-not-exl3:{type(method).__name__}"):
                    self.emit(f"dsv4serve plugin draft {self.who} layer={name}: quant method {type(method).__name__} "
                              "is not EXL3; lna2 does not apply to it (the incumbent serves the draft's experts)")
            elif self.env.kernel == "lna2":
                try:
                    if entry == "apply_monolithic":
                        # it routes itself from router_logits: no topk ids and weights for lna2 to take,
                        # so every call would fail; refused here, at load, like any other contract
                        raise ContractError(f"{type(method).__name__} is monolithic (apply_monolithic routes "
                                            "from router logits; lna2 takes top-k ids and weights)")
                    self._make_ready(st)
                    summary.lna2_layers += 1
                except ContractError as e:
                    reason = str(e)
                    if self.env.strict >= 1:
                        msg = f"lna2 not ready: {self.who} layer={name}: {reason}"
                        self.emit(f"dsv4serve plugin FAILED {msg} (VLLM_EXL3_MOE_STRICT={self.env.strict})")
                        raise Lna2NotReadyError(msg) from None
                    st.not_ready = reason
                    summary.not_ready.setdefault(reason, []).append(name)
            fresh.append(st)
        if self.env.kernel == "lna2" and not draft and not layers:
            reason = "the model has no FusedMoE layers"
            if self.env.strict >= 1:
                msg = f"lna2 not ready: {self.who} layer=(none): {reason}"
                self.emit(f"dsv4serve plugin FAILED {msg} (VLLM_EXL3_MOE_STRICT={self.env.strict})")
                raise Lna2NotReadyError(msg)
            summary.not_ready[reason] = ["(none)"]
        if (self.env.kernel == "lna2" and self._tuning is not None and not draft
                and not any(self._tuning_mismatch.values())  # another card's table was said already
                and any(st.geometry is not None for st in fresh) and not any(st.tuned for st in fresh)):
            # a table for other shapes (another TP slice, another export) serves nothing: under strict
            # that is a wrong table, not a seat to run on the built-in policy unannounced
            table, digest = self._tuning
            msg = (f"lna2 tuning table {self.env.tuning} ({digest}) holds none of this model's layers: it was "
                   f"measured at hidden={table.hidden} intermediate={table.inter} top_k={table.top_k} "
                   f"experts={table.experts} ({', '.join(sorted(table.picks))})")
            if self.env.strict >= 1:
                self.emit(f"dsv4serve plugin FAILED lna2 not ready: {self.who}: {msg} "
                          f"(VLLM_EXL3_MOE_STRICT={self.env.strict})")
                raise Lna2NotReadyError(f"lna2 not ready: {self.who}: {msg}; measure this seat's per-rank shape "
                                        "(`dsv4serve kernel check --bench --hidden H --inter I --save-tuning FILE`)")
            if self._once(f"tuning-none: {digest}"):
                self.emit(f"dsv4serve plugin lna2 tuning ignored {self.who}: {msg}; the built-in policy serves "
                          f"(VLLM_EXL3_MOE_STRICT={self.env.strict})")
        for st in fresh:
            self._wrap(st)
        self.states.extend(fresh)
        self.counters.set_layers(len(self.states), self.lna2_layers)
        self.counters.kernel = self.effective_kernel
        for reason, names in summary.not_ready.items():
            if not self._once(f"not ready: {reason}"):
                continue  # e.g. the draft's layers, for the reason the target's already gave
            more = f" (+{len(names) - 1} more layers)" if len(names) > 1 else ""
            self.emit(f"LNA2 declined: lna2 not ready: {self.who} layer={names[0]}{more}: {reason}; "
                      f"the incumbent serves {'them' if more else 'it'} (VLLM_EXL3_MOE_STRICT=0)")
        return summary

    def _ext_or_reason(self) -> Any:
        if self._ext is None and self._ext_error is None:
            try:
                ext = self._ext_loader()
                missing = [f for f in EXT_API if not hasattr(ext, f)]
                if missing:
                    raise RuntimeError(f"the loaded module lacks {', '.join(missing)}")
                ceiling, build_id = int(ext.lna2_moe_max_rows()), str(ext.lna2_build_id())
                # loaded only once both are read: a module failing either is no extension to serve
                self._ext, self.ceiling, self.build_id = ext, ceiling, build_id
                rows = self.env.decode_rows
                if self.env.strict >= 1 and rows and self.ceiling < rows:
                    # every decode step would go to the incumbent as "above the ceiling", which the
                    # gates let through as prefill: the seat would run, proven, on the wrong kernel
                    self._rows_refusal = (f"the lna2 build takes at most {self.ceiling} rows a call but this seat "
                                          f"decodes {rows} ({self.env.decode_rows_why}); lower "
                                          f"vllm.max_num_seqs until that is at most {self.ceiling}, and "
                                          "moe.row_ceiling to the build's (`dsv4serve kernel info`)")
            except (RuntimeError, OSError, ImportError) as e:
                self._ext_error = str(e)
        if self._ext is None:
            raise ContractError(f"lna2 extension: {self._ext_error}")
        if self._rows_refusal:
            raise ContractError(self._rows_refusal)
        return self._ext

    def _make_ready(self, st: LayerState) -> None:
        if not is_exl3_moe_method(st.method):
            raise ContractError(f"quant method {type(st.method).__name__} is not vllm-exl3's Exl3MoEMethod "
                                "(no EXL3 routed experts for lna2 to serve)")
        if self.require_cuda and not torch.cuda.is_available():
            raise ContractError("no CUDA device in this process")
        if self.env.ubatches > 1:
            raise ContractError(f"vLLM splits each step into {self.env.ubatches} micro-batches (--enable-dbo / "
                                f"--ubatch-size), {UBATCH_WHY}; drop the micro-batching flag, or set "
                                "moe.kernel=incumbent")
        ext = self._ext_or_reason()
        g = validate_layer(st.layer, st.method, require_cuda=self.require_cuda)
        key = f"{g.device}/{g.bits}/{g.codebook}/{g.hidden}/{g.inter}"
        if key not in self._limits:
            try:
                with _on_device(g.device):
                    self._limits[key] = dict(ext.lna2_moe_info(g.bits, g.codebook, g.hidden, g.inter))
            except Exception as e:  # noqa: BLE001 - a build for another arch fails right here
                raise ContractError(f"lna2 extension unusable on {g.device}: {e}") from None
        # every layer against the build's limits, not only the first of each geometry: layers of one
        # shape may still differ in top-k or in how many experts sit on this rank
        info = self._limits[key]
        if g.top_k > int(info.get("max_top_k", KERNEL_MAX_TOP_K)):
            raise ContractError(f"top_k {g.top_k} above the build's max_top_k {info.get('max_top_k')}")
        if g.n_experts > int(info.get("max_experts", KERNEL_MAX_EXPERTS)):
            raise ContractError(f"{g.n_experts} local experts above the build's max_experts "
                                f"{info.get('max_experts')}")
        fit = self._fit(ext, g)
        nbytes = max(int(info.get("scratch_bytes", 0)), int(ext.lna2_moe_scratch_bytes(g.hidden, g.inter)))
        tuned = self._tuned(g)
        extra = sorted(set(tuned.values()) - set(fit)) if tuned else []
        if extra:  # builds the policy does not serve (`kernel check --also`): what they fit here, too
            fit = {**fit, **self._fit_extra(ext, g, extra)}
        if self.env.strict >= 1:
            # strict promises a refusal at load, not an error per call in the middle of serving (or
            # of graph capture): every row count up to the build's ceiling goes to lna2, prefill
            # chunks included, so each must have a build that fits this device
            short = next(((r, v) for r in range(1, self.ceiling + 1)
                          if fit.get(v := variant_for(r, g.inter, g.bits, g.hidden, fit, tuned), 0) < r), None)
            if short is not None:
                r, v = short
                rows = self.env.decode_rows
                what = (f"this seat decodes {rows} rows a call ({self.env.decode_rows_why}): lower vllm.max_num_seqs "
                        "until every decode step fits, and " if rows and r <= rows else "")
                raise ContractError(f"this device's shared memory per block holds v{v} for {fit.get(v, 0)} rows at "
                                    f"bits={g.bits} hidden={g.hidden} intermediate={g.inter}, and the build takes "
                                    f"calls of up to {self.ceiling} rows: {r} would not launch; {what}build lna2 with "
                                    f"`dsv4serve kernel build --max-rows {r - 1}` (moe.row_ceiling to match)")
        tables = pointer_tables(st.layer, g)
        self.scratch.ensure(g.device, nbytes)
        st.geometry, st.tables, st.fit, st.tuned = g, tuple(tables[n] for n in TABLES), fit, tuned
        if tuned is not None:
            self.tuned_digest = self._tuning[1] if self._tuning else None

    def _tuned(self, g: Geometry) -> dict[int, int] | None:
        """rows -> build from the profile's tuning table for this layer, or None (no table, or it does
        not hold this shape). A table that cannot be read, or was measured on another card or build,
        refuses the layer under strict >= 1 and is ignored, said once, under strict 0."""
        if not self.env.tuning:
            return None
        if self._tuning is None and self._tuning_error is None:
            try:
                self._tuning = tuning.load(self.env.tuning)
            except tuning.TuningError as e:
                self._tuning_error = str(e)
        if self._tuning is None:
            return self._tuning_refused(str(self._tuning_error))
        table, digest = self._tuning
        dev = str(g.device)
        if dev not in self._tuning_mismatch:
            try:
                name, sms = self._identity(g.device)
                why = table.mismatch(name, sms, self.build_id)
            except Exception as e:  # noqa: BLE001 - no card to compare with is no match
                why = f"this device's name and SM count are unreadable ({first_line(e)})"
            self._tuning_mismatch[dev] = why
        why = self._tuning_mismatch[dev]
        if why:
            return self._tuning_refused(f"lna2 tuning table {self.env.tuning} ({digest}) is not this card's: {why}")
        picks = table.for_layer(g.bits, g.codebook, g.hidden, g.inter, g.top_k, g.n_experts)
        if picks is None:
            if self._once(f"tuning-shape:{g.bits}/{g.codebook}/{g.hidden}/{g.inter}/{g.top_k}/{g.n_experts}"):
                self.emit(f"dsv4serve plugin lna2 tuning {self.who}: table {digest} holds no "
                          f"{tuning.key(g.bits, g.codebook)} layer of hidden={g.hidden} intermediate={g.inter} "
                          f"top_k={g.top_k} experts={g.n_experts}; the built-in policy serves these layers")
            return None
        return dict(picks)

    def _tuned_reach(self) -> str:
        """What the table decides, for the ACTIVE line: its row counts hold the card's own picks, every
        other row count (and a layer of another shape) the built-in policy's."""
        lna2 = [s for s in self.states if s.geometry is not None]

        def served(s: LayerState) -> set[int]:
            # a row count the table names is its pick only where the build fits it and lna2 takes it
            g = s.geometry
            assert g is not None
            return {r for r, v in (s.tuned or {}).items()
                    if r <= self.ceiling and variant_for(r, g.inter, g.bits, g.hidden, s.fit, s.tuned) == v}

        per = [served(s) for s in lna2]
        rows = sorted(set().union(*per)) if per else []
        return f" tuned_rows={_spans(rows)} tuned_layers={sum(1 for p in per if p)}/{len(lna2)}"

    def _tuning_refused(self, why: str) -> None:
        if self.env.strict >= 1:
            raise ContractError(f"{why}; re-run `dsv4serve kernel check --bench --save-tuning FILE` on this card, "
                                "or drop moe.tuning")
        if self._once(f"tuning: {why}"):
            self.emit(f"dsv4serve plugin lna2 tuning ignored {self.who}: {why}; the built-in policy serves "
                      f"(VLLM_EXL3_MOE_STRICT={self.env.strict})")
        return None

    def _fit(self, ext: Any, g: Geometry) -> dict[int, int]:
        """Per build the policy may pick for this shape, the most rows whose launch fits the device's
        shared memory per block: sm_120 cards allow 99 KB, where the cluster kernel's K3 builds do not
        fit (the policy then picks the next build). One query per shape and device."""
        key = f"{g.device}/{g.bits}/{g.codebook}/{g.hidden}/{g.inter}/{g.top_k}/{g.n_experts}"
        if key not in self._fits:
            try:
                with _on_device(g.device):
                    self._fits[key] = policy.fit_table(ext, g.bits, g.codebook, g.hidden, g.inter, g.top_k,
                                                       g.n_experts)
            except Exception as e:  # noqa: BLE001 - a build of other sources, or a shape it refuses
                raise ContractError(f"lna2 extension cannot size its launches on {g.device}: {first_line(e)}") \
                    from None
            short = {v: n for v, n in self._fits[key].items() if n < self.ceiling}
            if short:  # said once per shape: which builds this card cannot launch at which rows
                self.emit(f"dsv4serve plugin lna2 fit {self.who} bits={g.bits} hidden={g.hidden} "
                          f"intermediate={g.inter}: " + ", ".join(f"v{v} fits {n} of {self.ceiling} rows"
                                                                  for v, n in short.items()) +
                          " (shared memory per block); the policy serves the next build that fits")
        fit = self._fits[key]
        if fit.get(policy.SEAT_VARIANT, 0) < 1:
            raise ContractError(f"no lna2 build fits this device's shared memory per block for bits={g.bits} "
                                f"hidden={g.hidden} intermediate={g.inter} (v{policy.SEAT_VARIANT} needs more at one row)")
        return fit

    def _fit_extra(self, ext: Any, g: Geometry, variants: list[int]) -> dict[int, int]:
        """lna2_moe_fit for builds a tuning table names beyond the policy's; a build that refuses the
        shape fits no rows (the built-in policy then serves those row counts)."""
        out = {}
        for v in variants:
            if v not in policy.TUNABLE:  # an ablation or unknown number (a table's validator refuses them too)
                out[v] = 0
                continue
            key = f"{g.device}/{g.bits}/{g.codebook}/{g.hidden}/{g.inter}/{g.top_k}/{g.n_experts}/v{v}"
            if key not in self._fits:
                try:
                    with _on_device(g.device):
                        self._fits[key] = {v: int(ext.lna2_moe_fit(v, g.bits, g.codebook, g.hidden, g.inter, g.top_k,
                                                                   g.n_experts))}
                except Exception as e:  # noqa: BLE001 - e.g. a build number this extension lacks
                    self._fits[key] = {v: 0}
                    self.emit(f"dsv4serve plugin lna2 tuning {self.who}: v{v} cannot size its launches for bits="
                              f"{g.bits} hidden={g.hidden} intermediate={g.inter} ({first_line(e)}); the built-in "
                              "policy serves the rows the table gives it")
            out.update(self._fits[key])
        return out

    def _wrap(self, st: LayerState) -> None:
        rt = self

        def apply(*args: Any, **kwargs: Any) -> Any:
            return rt.call(st, args, kwargs)

        # Under torch.compile (CPU seats) Dynamo would trace the counters away; a graph break
        # keeps every call counted. CUDA seats reach apply through vLLM's opaque moe_forward op,
        # where this is a no-op.
        wrapped = torch.compiler.disable(apply)
        wrapped._dsv4serve_orig = st.orig_apply  # type: ignore[attr-defined]
        # An instance attribute: only this layer's method changes, never the class.
        object.__setattr__(st.method, st.entry, wrapped)
        object.__setattr__(st.method, "_dsv4serve_state", st)

    # -- the call path -------------------------------------------------------------------------
    def call(self, st: LayerState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if st.geometry is None:
            if st.not_ready is not None:
                self.counters.decline(f"not ready: {st.not_ready}")
            self._count("incumbent", _rows_of(args, kwargs), declined=st.not_ready is not None)
            return st.orig_apply(*args, **kwargs)
        try:
            x = _pick(args, kwargs, 1, "x")
            rows = _rows(x)
        except Exception as e:  # noqa: BLE001
            return self._dispatch_failed(st, e, args, kwargs, _rows_of(args, kwargs))
        if rows == 0:
            # Nothing to compute (an empty step); not a decline.
            self._count("incumbent", 0)
            return st.orig_apply(*args, **kwargs)
        if rows > self.ceiling:
            reason = f"rows={rows} above the ceiling {self.ceiling}"
            if self.env.strict >= 2:
                raise Lna2DispatchError(f"lna2 dispatch refused: {self.who} layer={st.name}: {reason} "
                                        "(VLLM_EXL3_MOE_STRICT=2 raises on shape declines)")
            self._decline(st, f"rows above the ceiling {self.ceiling}", reason)
            self._count("incumbent", rows, declined=True)
            return st.orig_apply(*args, **kwargs)
        try:
            out, variant = self._launch(st, x, _pick(args, kwargs, 2, "topk_weights"), _pick(args, kwargs, 3, "topk_ids"),
                                        rows)
        except ContractError as e:
            if self.env.strict >= 1:
                raise Lna2DispatchError(f"lna2 dispatch failed: {self.who} layer={st.name}: {e}") from None
            self._decline(st, e.key, str(e))
            self._count("incumbent", rows, declined=True)
            return st.orig_apply(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - strict decides; never swallowed silently
            return self._dispatch_failed(st, e, args, kwargs, rows)
        if self._capturing():
            st.captured = True
        elif st.unchecked is None and (_build_key(st, variant) not in self.verified_builds
                                       or (not st.verified and _varied(x, rows))):
            # a build once at each geometry, a layer once on rows that differ: a seat whose eager lna2
            # calls are all one row (long prompts above the ceiling, decode one row at a time) checks
            # each build once, not every call
            mismatch = self._parity(st, out, variant, rows, args, kwargs)
            if mismatch is not None:  # strict 0: this layer is the incumbent's from now on
                self.counters.call("incumbent")
                return mismatch
        self._count("lna2", rows)
        if not self._active_logged:
            self._active_logged = True
            bits = ",".join(map(str, self.bits))
            policy_in_force = f"tuned:{self.tuned_digest}{self._tuned_reach()}" if self.tuned_digest else "builtin"
            self.emit(f"LNA2 MoE kernel ACTIVE {self.who} layers={self.lna2_layers} bits={bits} ext={self.build_id} "
                      f"policy={policy_in_force}")
        return out

    def _launch(self, st: LayerState, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                rows: int) -> tuple[torch.Tensor, int]:
        """lna2's output for this call, and the build that computed it."""
        g = st.geometry
        assert g is not None
        if x.shape[-1] != g.hidden:
            raise ContractError(f"x width {x.shape[-1]} is not the layer's hidden {g.hidden}")
        if x.dtype not in (torch.float16, torch.bfloat16):
            raise ContractError(f"x is {x.dtype}, not fp16/bf16")
        if x.device != g.device:
            raise ContractError(f"x is on {x.device}, the experts on {g.device}")
        # A swapped pair (an apply() signature that moved) would cast float weights to ids, all
        # expert 0, and still produce text: refuse the types, never guess.
        if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool or topk_ids.is_complex():
            raise ContractError(f"topk_ids is {topk_ids.dtype}, not an integer tensor")
        if not topk_weights.dtype.is_floating_point:
            raise ContractError(f"topk_weights is {topk_weights.dtype}, not a floating tensor")
        if topk_ids.numel() != rows * g.top_k or topk_weights.numel() != rows * g.top_k:
            raise ContractError(f"routing carries {topk_ids.numel()} ids / {topk_weights.numel()} weights for "
                                f"rows={rows} x top_k={g.top_k}")
        for what, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            # flat is vLLM's other spelling (trap 14); a 2-D [top_k, rows] has the right count and
            # would route every row by another row's experts
            if t.dim() != 1 and tuple(t.shape) != (rows, g.top_k):
                raise ContractError(f"{what} is {tuple(t.shape)}, not [rows={rows}, top_k={g.top_k}] or flat",
                                    key="routing of another shape")
        x2 = x.reshape(rows, g.hidden)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        elif x2.data_ptr() % 16:
            # An offset view (e.g. a slice of a larger activation buffer): every lna2 variant reads x
            # with vector loads, and the binding refuses an unaligned x. A fresh copy is aligned.
            x2 = x2.clone()
        # Trap 14: ids may arrive flat ([rows*top_k]); lna2 takes [rows, top_k] and rejects flat.
        ids = topk_ids.reshape(rows, g.top_k)
        expert_map = getattr(st.layer, "expert_map", None)
        if isinstance(expert_map, torch.Tensor) and expert_map.dtype != torch.bool:
            # Expert parallelism: global -> local ids, -1 for experts of other ranks, which lna2
            # skips (out-of-range ids contribute nothing, lna2_api.h). An id outside the map (a -1
            # pad) stays -1: indexed as it is, -1 would read the map's last entry, another expert.
            n = expert_map.numel()
            inside = (ids >= 0) & (ids < n)
            ids = torch.where(inside, expert_map[ids.long().clamp(0, n - 1)], torch.full_like(expert_map[:1], -1))
        ids = ids.to(torch.int32).contiguous()
        # The routed scaling factor is already where vLLM put it (module docstring): unchanged.
        weights = topk_weights.reshape(rows, g.top_k).to(torch.float32).contiguous()
        scratch = self.scratch.get(g.device)
        if scratch is None:
            raise RuntimeError(f"no lna2 scratch for {g.device} (allocated at load only)")
        out = torch.empty_like(x2)
        variant = variant_for(rows, g.inter, g.bits, g.hidden, st.fit, st.tuned)
        if st.fit is not None and st.fit.get(variant, 0) < rows:
            raise ContractError(f"rows={rows} need more shared memory per block than this device has for "
                                f"v{variant} (it fits {st.fit.get(variant, 0)} rows)",
                                key="rows past the shared memory this device has for the build")
        self._ext.lna2_moe_decode(x2, out, *st.tables, ids, weights, g.bits, g.swiglu_limit, scratch,
                                  g.inter, g.codebook, variant)
        return out.view(x.shape), variant

    def _parity(self, st: LayerState, out: torch.Tensor, variant: int, rows: int, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> torch.Tensor | None:
        """lna2's output against the incumbent's on the same call, outside graph capture (one host
        sync each), until the layer has matched on a call whose rows differ (vLLM's warm-up runs
        identical dummy rows, which would hide a fault that mixes rows) and each build has matched at
        each geometry it serves. The ACTIVE line and the counters say the kernel ran; this says it
        computed the seat's MoE (the founding trap: a kernel that passed every gate). A mismatch
        raises at strict >= 1; at strict 0 the layer goes back to the incumbent, whose output this
        call returns, with the reason logged and counted."""
        try:
            ref_out = st.orig_apply(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the incumbent's own failure is not lna2's mismatch
            detail = f"{self.who} layer={st.name}: the incumbent's apply failed: {type(e).__name__}: {e}"
            if self.env.strict >= 1:
                raise Lna2DispatchError(f"lna2 parity not checked: {detail}"[:400]) from e
            st.unchecked = detail[:300]  # tried once: not again on every call
            self._decline(st, "parity not checked: the incumbent failed", detail[:300])
            return None
        a = out.reshape(rows, -1).float()
        b = ref_out.reshape(rows, -1).float()
        varied = _varied(_pick(args, kwargs, 1, "x"), rows)
        worst = _worst_row(a, b)
        if worst <= PARITY_TOL:
            with self._lock:
                if varied or rows == 1:  # identical rows prove nothing about a build that mixes them
                    self.verified_builds.add(_build_key(st, variant))
                st.verified = st.verified or varied
                self.counters.verified(sum(1 for s in self.states if s.verified), worst)
                done = not self._verified_logged and all(s.verified for s in self.states if s.geometry is not None)
                if done:
                    self._verified_logged = True
            if done:
                self.emit(f"LNA2 parity verified {self.who} layers={self.lna2_layers} builds="
                          f"{','.join(sorted({f'v{k[0]}' for k in self.verified_builds}))} "
                          f"worst={self.counters.parity_worst:.1e} (tolerance {PARITY_TOL:g} against the incumbent)")
            return None
        detail = (f"{self.who} layer={st.name} v{variant} rows={rows}: worst row relative L2 "
                  f"{worst:.3g} against the incumbent (tolerance {PARITY_TOL:g})")
        if self.env.strict >= 1:
            raise Lna2DispatchError(f"lna2 parity failed: {detail}")
        if st.captured:  # graphs replay lna2 whatever this layer's state says from now on
            detail += "; CUDA graphs captured before this keep replaying lna2: restart the seat with STRICT=1"
        self._decline(st, PARITY_DECLINE, detail)
        st.geometry, st.not_ready = None, f"parity mismatch v{variant}"
        return ref_out

    def _dispatch_failed(self, st: LayerState, e: BaseException, args: tuple[Any, ...],
                         kwargs: dict[str, Any], rows: int = 0) -> Any:
        detail = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if self.env.strict >= 1:
            raise Lna2DispatchError(f"lna2 dispatch failed: {self.who} layer={st.name}: {detail}") from e
        key = f"dispatch error: {type(e).__name__}"
        self.counters.decline(key)
        if self._once(f"error:{key}"):
            self.emit(f"LNA2 dispatch failed; falling back: {self.who} layer={st.name}: {detail}")
        self._count("incumbent", rows, declined=True)
        return st.orig_apply(*args, **kwargs)

    def _count(self, kind: str, rows: int, *, declined: bool = False) -> None:
        """One call served by `kind`; under CUDA-graph capture also recorded for its row count (0: the
        call's x could not be read), since every replay of that graph runs the same kernel without
        coming back here."""
        self.counters.call(kind)
        if self._capturing():
            self.counters.captured(rows, "declined" if declined else kind)

    def _decline(self, st: LayerState, key: str, text: str) -> None:
        self.counters.decline(key)
        if self._once(key):
            self.emit(f"LNA2 declined: {text} ({self.who} layer={st.name}; counted, not logged again)")

    def _once(self, key: str) -> bool:
        with self._lock:
            if key in self._logged:
                return False
            if len(self._logged) >= MAX_LOGGED_REASONS:
                if "__overflow__" not in self._logged:
                    self._logged.add("__overflow__")
                    self.emit(f"LNA2 declined: more than {MAX_LOGGED_REASONS} distinct reasons on {self.who}; "
                              "the rest are only counted")
                return False
            self._logged.add(key)
            return True


class _on_device:
    """``torch.cuda.device(d)`` for CUDA devices, nothing otherwise (CPU stand-ins in tests)."""

    def __init__(self, device: torch.device) -> None:
        self._ctx = torch.cuda.device(device) if device.type == "cuda" else None

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def env_summary(env: PluginEnv) -> str:
    return f"run={env.run_id} kernel={env.kernel} strict={env.strict} pid={os.getpid()}"
