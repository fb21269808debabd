"""lna2 dispatch (dsv4serve.moe_dispatch) against stand-ins, on the CPU, without vLLM: the wiring.

Two fakes, both documented where they are defined:

* ``Exl3MoEMethod`` / ``Exl3Experts``: stand-ins for vllm-exl3 0.2.3's routed-expert quant method
  and the vLLM layer that holds its parameters. vllm-exl3 cannot be installed here (it needs
  exllamav3's CUDA build), so they reproduce what the dispatch reads: the parameter names, shapes
  and dtypes (exl3-reference §4.4), the class name and module the plugin recognises, and the
  ``apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)`` signature.
  Their ``apply`` is the incumbent: the real MoE computed by ``lna2.reference`` from the stacked
  parameters, so incumbent and lna2 outputs are comparable.
* ``FakeLna2``: stands in for the CUDA extension ``dsv4serve_lna2``, which cannot run on a CPU.
  It implements the same Python API and argument checks as kernels/lna2/bindings.cpp, and it
  computes the real MoE from what it is *given*: it follows every pointer in the nine tables
  back to the tensor it points into, so a swapped gate/up, a wrong expert offset, flat ids or a
  doubled scaling factor change its output. CUDA-only checks (device type) are the one thing it
  cannot mirror; the dispatch's own CUDA requirement is tested separately.

The dispatch runs with ``require_cuda=False`` so CPU tensors are accepted (the test seam);
one test shows that the default refuses them.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dsv4serve import moe_dispatch as md
from dsv4serve.lna2 import reference as ref
from dsv4serve.lna2 import policy
from dsv4serve.lna2.policy import variant_for
from dsv4serve.plugin_counters import Counters
from dsv4serve.state import counters_path

# What the stand-in takes: the early builds and every build the policy can serve, read from the
# policy itself (a hand-written copy of the served set went stale when v53 began serving).
KNOWN_VARIANTS = {0, 1, 2, 3, 4, 7} | {policy.SEAT_VARIANT, policy.CLUSTER_VARIANT}

H, I, E, TOP_K = 128, 128, 4, 2
CANON_FORBIDDEN = re.compile(r"LNA2 declined: (?!rows=\d+ above the ceiling)")  # configs/8x16gb-380k.yaml


# --- stand-ins for vLLM / vllm-exl3 -----------------------------------------------------------------


class FusedMoEMethodBase:
    """Stand-in for vLLM's base class (only its role as a base matters here)."""


class MoEConfig:
    def __init__(self, top_k: int = TOP_K, swiglu_limit: float | None = 10.0, activation: str = "silu") -> None:
        self.experts_per_token, self.swiglu_limit, self.activation = top_k, swiglu_limit, activation


class Exl3MoEMethod(FusedMoEMethodBase):
    """Stand-in for vllm-exl3 0.2.3's ``vllm_exl3.exl3.Exl3MoEMethod`` (not installable here).

    Same class name and module, so ``is_exl3_moe_method`` sees it as the real one; same apply
    signature; its apply is the incumbent, computed with the reference from the layer's stacked
    parameters (gate = w13[:, 0], up = w13[:, 1], down = w2), ids and weights used as given.
    """

    __module__ = "vllm_exl3.exl3"
    is_monolithic = False

    def __init__(self, moe: MoEConfig) -> None:
        self.moe = moe
        self.calls = 0

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: Any, shared_experts_input: Any) -> torch.Tensor:
        del shared_experts, shared_experts_input
        self.calls += 1
        rows = x.shape[0]
        if rows == 0:
            return torch.zeros_like(x)
        ids, w = topk_ids.reshape(rows, -1).long(), topk_weights.reshape(rows, -1)
        emap = getattr(layer, "expert_map", None)
        if isinstance(emap, torch.Tensor):  # expert parallelism: global ids to local, other ranks' add nothing
            ids = emap.long()[ids.clamp(0, emap.numel() - 1)].where(ids >= 0, torch.full_like(ids, -1))
            w = w.where(ids >= 0, torch.zeros_like(w))
            ids = ids.clamp(min=0)
        return ref.moe_reference(x, layer.as_expert_layer(), ids, w, self.moe.swiglu_limit or 10.0).to(x.dtype)


class OtherMethod(FusedMoEMethodBase):
    """Any non-EXL3 MoE method (vLLM's UnquantizedFusedMoEMethod on the demo seat)."""

    is_monolithic = False

    def __init__(self) -> None:
        self.calls = 0

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        self.calls += 1
        return torch.zeros_like(x)


class Exl3Experts(torch.nn.Module):
    """Stand-in for the vLLM layer (RoutedExperts) holding vllm-exl3's stacked parameters.

    w13_trellis [E,2,H/16,I/16,16K] int16, w13_suh [E,2,H], w13_svh [E,2,I] fp16, w13_mcg|mul1
    [E,2,1] int32, w2_trellis [E,I/16,H/16,16K], w2_suh [E,I], w2_svh [E,H], w2_mcg|mul1 [E,1].
    """

    def __init__(self, el: ref.ExpertLayer, top_k: int = TOP_K, name: str = "model.layers.3.mlp.experts",
                 method: Any = None) -> None:
        super().__init__()
        p = lambda t: torch.nn.Parameter(t.contiguous(), requires_grad=False)  # noqa: E731
        self.w13_trellis = p(torch.stack([el.gate_trellis, el.up_trellis], 1))
        self.w13_suh = p(torch.stack([el.gate_suh, el.up_suh], 1))
        self.w13_svh = p(torch.stack([el.gate_svh, el.up_svh], 1))
        self.w2_trellis, self.w2_suh, self.w2_svh = p(el.down_trellis), p(el.down_suh), p(el.down_svh)
        marker = el.marker
        self.register_parameter(f"w13_{el.codebook}", p(torch.full((el.n_experts, 2, 1), marker, dtype=torch.int32)))
        self.register_parameter(f"w2_{el.codebook}", p(torch.full((el.n_experts, 1), marker, dtype=torch.int32)))
        self.codebook, self.K = el.codebook, el.K
        self.top_k = top_k
        self.layer_name = name
        self.expert_map: torch.Tensor | None = None
        self.routed_scaling_factor = 1.0
        self.quant_method = method or Exl3MoEMethod(MoEConfig(top_k))

    def as_expert_layer(self) -> ref.ExpertLayer:
        return ref.ExpertLayer(
            gate_trellis=self.w13_trellis[:, 0], gate_suh=self.w13_suh[:, 0], gate_svh=self.w13_svh[:, 0],
            up_trellis=self.w13_trellis[:, 1], up_suh=self.w13_suh[:, 1], up_svh=self.w13_svh[:, 1],
            down_trellis=self.w2_trellis.data, down_suh=self.w2_suh.data, down_svh=self.w2_svh.data,
            K=self.K, codebook=self.codebook, hidden=self.w13_suh.shape[-1], inter=self.w13_svh.shape[-1])


def make_layer(K: int = 2, codebook: str = "mcg", seed: int = 0, **kw: Any) -> tuple[Exl3Experts, ref.ExpertLayer]:
    el = ref.random_expert_layer(E, H, I, K, codebook, seed=seed)
    return Exl3Experts(el, **kw), el


# --- the fake extension ------------------------------------------------------------------------------


class FakeLna2:
    """Stands in for the lna2 CUDA extension (which cannot run on a CPU): same API and argument
    checks as kernels/lna2/bindings.cpp; computes the real MoE by following the pointer tables
    back into the registered parameter tensors (see the module docstring)."""

    TABLES = md.TABLES

    def __init__(self, max_rows: int = 4, build_id: str = "fake-0001") -> None:
        self.max_rows, self.build_id = max_rows, build_id
        self.bases: list[torch.Tensor] = []
        self.calls: list[dict[str, Any]] = []
        self.fail_with: Exception | None = None

    # the API
    def lna2_moe_max_rows(self) -> int:
        return self.max_rows

    def lna2_build_id(self) -> str:
        return self.build_id

    def lna2_moe_scratch_bytes(self, hidden: int = 4096, intermediate: int = 256) -> int:
        assert hidden % 128 == 0 and intermediate % 128 == 0
        return 1024 + hidden + intermediate

    def lna2_moe_info(self, bits: int, codebook: int = 1, hidden: int = 4096, intermediate: int = 256) -> dict:
        return {"max_rows": self.max_rows, "max_top_k": 8, "max_experts": 256, "concurrent_streams": 1,
                "scratch_bytes": self.lna2_moe_scratch_bytes(hidden, intermediate)}

    def lna2_moe_fit(self, variant: int, bits: int, codebook: int = 1, hidden: int = 4096, intermediate: int = 256,
                     top_k: int = 6, n_experts: int = 256) -> int:
        assert variant in KNOWN_VARIANTS and bits in (2, 3) and codebook in (1, 2)
        return self.max_rows  # an H200: every build fits at every row count

    def lna2_moe_decode(self, x, out, gate_trellis, gate_suh, gate_svh, up_trellis, up_suh, up_svh, down_trellis,
                        down_suh, down_svh, expert_ids, routing_weights, bits, swiglu_limit, scratch,
                        intermediate=256, codebook=1, variant=0):
        if self.fail_with is not None:
            raise self.fail_with
        assert x.dtype in (torch.float16, torch.bfloat16) and x.dim() == 2 and x.is_contiguous()
        m, hidden = x.shape
        assert 1 <= m <= self.max_rows, f"rows m={m} outside 1..{self.max_rows}"
        assert out.shape == x.shape and out.is_contiguous() and out.dtype in (torch.float16, torch.bfloat16, torch.float32)
        tables = [gate_trellis, gate_suh, gate_svh, up_trellis, up_suh, up_svh, down_trellis, down_suh, down_svh]
        n = gate_trellis.numel()
        for t in tables:
            assert t.dtype == torch.int64 and t.dim() == 1 and t.numel() == n and t.is_contiguous()
        assert expert_ids.dtype == torch.int32 and expert_ids.dim() == 2 and expert_ids.shape[0] == m, \
            "expert_ids must be a contiguous int32 [m, top_k] tensor (flat [m*top_k] ids are rejected)"
        assert expert_ids.is_contiguous() and 1 <= expert_ids.shape[1] <= 8
        assert routing_weights.dtype == torch.float32 and routing_weights.shape == expert_ids.shape
        assert routing_weights.is_contiguous()
        assert bits in (2, 3) and codebook in (1, 2) and 0 < swiglu_limit < float("inf") and variant in KNOWN_VARIANTS
        # every variant reads x and writes out with vector accesses
        assert x.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0, "x and out must be 16-byte aligned"
        assert scratch.dtype == torch.uint8 and scratch.numel() >= self.lna2_moe_scratch_bytes(hidden, intermediate)
        assert int(scratch.count_nonzero()) == 0, "scratch must be zeroed before first use"
        w = 16 * bits
        shapes = {"trellis": {"gate": (hidden // 16, intermediate // 16, w), "up": (hidden // 16, intermediate // 16, w),
                              "down": (intermediate // 16, hidden // 16, w)},
                  "suh": {"gate": (hidden,), "up": (hidden,), "down": (intermediate,)},
                  "svh": {"gate": (intermediate,), "up": (intermediate,), "down": (hidden,)}}
        fields = {}
        for name, table in zip(self.TABLES, tables):
            proj, part = name.split("_")
            dtype = torch.int16 if part == "trellis" else torch.float16
            fields[name] = torch.stack([self._deref(int(p), shapes[part][proj], dtype) for p in table.tolist()])
        el = ref.ExpertLayer(**fields, K=bits, codebook={1: "mcg", 2: "mul1"}[codebook], hidden=hidden,
                             inter=intermediate)
        ids = expert_ids.long()
        valid = (ids >= 0) & (ids < n)  # out-of-range ids contribute nothing (lna2_api.h)
        weights = torch.where(valid, routing_weights, torch.zeros_like(routing_weights))
        res = ref.moe_reference(x, el, torch.where(valid, ids, torch.zeros_like(ids)), weights, swiglu_limit)
        out.copy_(res.to(out.dtype))
        self.calls.append({"m": m, "ids": expert_ids.clone(), "weights": routing_weights.clone(), "bits": bits,
                           "variant": variant, "swiglu_limit": swiglu_limit})
        return out

    def _deref(self, p: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert p % 16 == 0, f"pointer {p:#x} not 16-byte aligned"
        numel = 1
        for s in shape:
            numel *= s
        for base in self.bases:
            b0, esz = base.data_ptr(), base.element_size()
            if base.dtype == dtype and b0 <= p < b0 + base.numel() * esz:
                off = (p - b0) // esz
                assert off + numel <= base.numel()
                return base.reshape(-1)[off:off + numel].view(shape)
        raise AssertionError(f"pointer {p:#x} does not point into any registered parameter")

    def register(self, layer: Exl3Experts) -> None:
        self.bases += [t.data for n, t in layer.named_parameters() if n.endswith(("trellis", "suh", "svh"))]


# --- helpers -----------------------------------------------------------------------------------------


def env(kernel: str = "lna2", strict: int = 0, run_dir: str | None = None) -> md.PluginEnv:
    return md.PluginEnv(run_id="t1", run_dir=run_dir, kernel=kernel, strict=strict)


class Lines(list):
    def __call__(self, line: str) -> None:
        self.append(line)

    def matching(self, needle: str) -> list[str]:
        return [ln for ln in self if needle in ln]


def runtime(kernel: str = "lna2", strict: int = 0, fake: FakeLna2 | None = None, run_dir: Path | None = None,
            rank: int = 1, tp: int = 2, loader: Any = None, capturing: Any = lambda: False) -> tuple[md.Runtime, Lines]:
    lines = Lines()
    fake = fake if fake is not None else FakeLna2()
    counters = Counters(run_dir, rank, tp, kernel, interval_s=0.05)
    rt = md.Runtime(env(kernel, strict, str(run_dir) if run_dir else None), rank, tp, emit=lines, counters=counters,
                    ext_loader=loader or (lambda: fake), require_cuda=False, capturing=capturing)
    return rt, lines


def routes(rows: int, seed: int = 1, scale: float = 1.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(rows)]).to(torch.int32)
    w = torch.rand(rows, TOP_K, generator=g) * scale  # routed scaling already in, as vLLM's DSV4 router does
    return x, ids, w


def call(layer: Exl3Experts, x, w, ids) -> torch.Tensor:
    # Exactly how vLLM 0.32's RoutedExperts.forward_modular calls it: keywords.
    return layer.quant_method.apply(layer=layer, x=x, topk_weights=w, topk_ids=ids, shared_experts=None,
                                    shared_experts_input=None)


def run(layer: Exl3Experts, rows: int, seed: int = 1) -> torch.Tensor:
    x, ids, w = routes(rows, seed)
    return call(layer, x, w, ids)


def ready(strict: int = 0, max_rows: int = 4, **kw: Any) -> tuple[md.Runtime, Lines, Exl3Experts, ref.ExpertLayer, FakeLna2]:
    fake = FakeLna2(max_rows=max_rows)
    layer, el = make_layer(**kw)
    fake.register(layer)
    rt, lines = runtime(strict=strict, fake=fake)
    rt.prepare([(layer.layer_name, layer)], draft=False)
    return rt, lines, layer, el, fake


# --- env ---------------------------------------------------------------------------------------------


def test_env_inert_without_run_id():
    assert md.read_env({"DSV4SERVE_MOE_KERNEL": "lna2", "VLLM_EXL3_MOE_STRICT": "1"}) is None


@pytest.mark.parametrize("environ,kernel,strict", [
    ({"DSV4SERVE_MOE_KERNEL": "lna2", "VLLM_EXL3_MOE_STRICT": "1"}, "lna2", 1),
    ({"DSV4SERVE_MOE_KERNEL": "none"}, "none", 0),
    ({"VLLM_EXL3_MOE_KERNEL": "lna2", "VLLM_EXL3_MOE_STRICT": "2"}, "lna2", 2),
    ({"VLLM_EXL3_MOE_KERNEL": "exllamav3"}, "incumbent", 0),
    ({}, "incumbent", 0),
])
def test_env_values(environ, kernel, strict):
    e = md.read_env({"DSV4SERVE_RUN_ID": "r", "DSV4SERVE_RUN_DIR": "/x", **environ})
    assert (e.kernel, e.strict, e.run_dir) == (kernel, strict, "/x")


@pytest.mark.parametrize("environ,needle", [
    ({"DSV4SERVE_MOE_KERNEL": "lna3"}, "DSV4SERVE_MOE_KERNEL='lna3'"),
    ({"VLLM_EXL3_MOE_KERNEL": "fast"}, "VLLM_EXL3_MOE_KERNEL='fast'"),
    ({"VLLM_EXL3_MOE_STRICT": "yes"}, "VLLM_EXL3_MOE_STRICT='yes'"),
])
def test_env_fails_closed(environ, needle):
    with pytest.raises(md.PluginConfigError, match=re.escape(needle)):
        md.read_env({"DSV4SERVE_RUN_ID": "r", **environ})


def test_exl3_detection_by_name_and_module():
    assert md.is_exl3_moe_method(Exl3MoEMethod(MoEConfig()))
    assert not md.is_exl3_moe_method(OtherMethod())
    lookalike = type("Exl3MoEMethod", (), {"__module__": "someone_else.exl3"})()
    assert not md.is_exl3_moe_method(lookalike)
    sub = type("LnaExl3MoEMethod", (Exl3MoEMethod,), {"__module__": "site.patch"})(MoEConfig())
    assert md.is_exl3_moe_method(sub)


# --- the contract ------------------------------------------------------------------------------------


def _raw_layer(h: int = H, i: int = I, k: int = 2, e: int = E, markers: tuple[str, ...] = ("mcg",)) -> Exl3Experts:
    """Zero-filled parameters of arbitrary geometry (the reference only builds 128-multiples)."""
    layer, _ = make_layer()
    for name, shape, dtype in [("w13_trellis", (e, 2, h // 16, i // 16, 16 * k), torch.int16),
                               ("w13_suh", (e, 2, h), torch.float16), ("w13_svh", (e, 2, i), torch.float16),
                               ("w2_trellis", (e, i // 16, h // 16, 16 * k), torch.int16),
                               ("w2_suh", (e, i), torch.float16), ("w2_svh", (e, h), torch.float16)]:
        setattr(layer, name, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))
    for cb in ("mcg", "mul1"):
        for proj, shape in (("w13", (e, 2, 1)), ("w2", (e, 1))):
            if hasattr(layer, f"{proj}_{cb}"):
                delattr(layer, f"{proj}_{cb}")
            if cb in markers:
                setattr(layer, f"{proj}_{cb}", torch.nn.Parameter(
                    torch.full(shape, md.CODEBOOKS[cb][1], dtype=torch.int32), requires_grad=False))
    return layer


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros(t.numel() + 1, dtype=t.dtype)
    return buf[1:].view(t.shape)  # contiguous, 2 bytes off


def _mutate(layer: Exl3Experts, what: str) -> None:
    if what == "missing":
        del layer.w2_svh
    elif what == "dtype":
        layer.w13_suh = torch.nn.Parameter(layer.w13_suh.data.float(), requires_grad=False)
    elif what == "shape":
        layer.w2_suh = torch.nn.Parameter(torch.zeros(E, I + 128, dtype=torch.float16), requires_grad=False)
    elif what == "contiguity":
        layer.w13_svh = torch.nn.Parameter(torch.zeros(E, I, 2, dtype=torch.float16).transpose(1, 2),
                                           requires_grad=False)
    elif what == "wrong marker":
        layer.w2_mcg.data[2, 0] = 12345
    elif what == "both markers":
        layer.w13_mul1 = torch.nn.Parameter(torch.full((E, 2, 1), md.MUL1_MARKER, dtype=torch.int32),
                                            requires_grad=False)
    elif what == "no marker":
        del layer.w13_mcg
    elif what == "mixed codebooks":
        del layer.w2_mcg
        layer.w2_mul1 = torch.nn.Parameter(torch.full((E, 1), md.MUL1_MARKER, dtype=torch.int32), requires_grad=False)
    elif what == "top_k":
        layer.top_k = 9
    elif what == "activation":
        layer.quant_method.moe.activation = "gelu"
    elif what == "alignment":
        layer.w13_svh = torch.nn.Parameter(_misaligned(layer.w13_svh.data), requires_grad=False)


@pytest.mark.parametrize("what,needle", [
    ("missing", "missing parameter w2_svh"),
    ("dtype", "w13_suh is torch.float32, expected torch.float16"),
    ("shape", "w2_suh shape (4, 256), expected (4, 128)"),
    ("contiguity", "w13_svh is not contiguous"),
    ("wrong marker", "codebook marker w2_mcg holds 12345, expected -877912083"),
    ("both markers", "codebook: w13 carries both mcg and mul1 markers"),
    ("no marker", "codebook: w13 carries neither mcg nor mul1"),
    ("mixed codebooks", "codebook: w13 is mcg but w2 is mul1"),
    ("top_k", "top_k 9 outside 1..8"),
    ("activation", "activation gelu is not SiLU-gated"),
    ("alignment", "pointer w13_svh[0, 0] = "),
])
def test_contract_errors_are_named(what, needle):
    layer, _ = make_layer()
    _mutate(layer, what)
    with pytest.raises(md.ContractError, match=re.escape(needle)):
        g = md.validate_layer(layer, layer.quant_method, require_cuda=False)
        md.pointer_tables(layer, g)


@pytest.mark.parametrize("kw,needle", [
    ({"k": 4}, "K=4 (trellis last dim 64) is not 2 or 3"),
    ({"h": 144}, "hidden 144 is not a multiple of 128"),
    ({"i": 64}, "local intermediate 64 is not a multiple of 128"),
    ({"e": 300}, "300 local experts, outside 1..256"),
])
def test_geometry_errors_are_named(kw, needle):
    layer = _raw_layer(**kw)
    with pytest.raises(md.ContractError, match=re.escape(needle)):
        md.validate_layer(layer, layer.quant_method, require_cuda=False)


def test_cpu_experts_are_refused_by_default():
    layer, _ = make_layer()
    with pytest.raises(md.ContractError, match="experts are on cpu, not a CUDA device"):
        md.validate_layer(layer, layer.quant_method)


def test_zero_filled_marker_counts_as_absent_and_mul1_is_codebook_2():
    layer = _raw_layer(markers=("mul1",))
    layer.w13_mcg = torch.nn.Parameter(torch.zeros(E, 2, 1, dtype=torch.int32), requires_grad=False)
    g = md.validate_layer(layer, layer.quant_method, require_cuda=False)
    assert (g.codebook, g.codebook_name, g.bits, g.hidden, g.inter, g.n_experts) == (2, "mul1", 2, H, I, E)


def test_pointer_tables_point_at_each_experts_gate_up_and_down():
    layer, _ = make_layer(K=3)
    g = md.validate_layer(layer, layer.quant_method, require_cuda=False)
    t = md.pointer_tables(layer, g)
    assert list(t) == list(md.TABLES)
    for e in range(E):
        assert t["gate_trellis"][e] == layer.w13_trellis[e, 0].data_ptr()
        assert t["up_trellis"][e] == layer.w13_trellis[e, 1].data_ptr()
        assert t["gate_suh"][e] == layer.w13_suh[e, 0].data_ptr()
        assert t["up_svh"][e] == layer.w13_svh[e, 1].data_ptr()
        assert t["down_trellis"][e] == layer.w2_trellis[e].data_ptr()
        assert t["down_suh"][e] == layer.w2_suh[e].data_ptr()
        assert t["down_svh"][e] == layer.w2_svh[e].data_ptr()
    assert all(v.dtype == torch.int64 and v.shape == (E,) for v in t.values())


# --- routing -----------------------------------------------------------------------------------------


def test_decode_goes_to_lna2_and_computes_the_incumbents_moe():
    rt, lines, layer, el, fake = ready()
    x, ids, w = routes(3)
    out = call(layer, x, w, ids)
    # the incumbent ran once beside it: the layer's first lna2 call is checked against it
    assert len(fake.calls) == 1 and layer.quant_method.calls == 1
    want = ref.moe_reference(x, el, ids.long(), w).to(x.dtype)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert torch.equal(out, want)
    # and the incumbent (the stand-in's own, unwrapped apply) agrees
    assert torch.equal(out, Exl3MoEMethod.apply(layer.quant_method, layer, x, w, ids, None, None))
    assert rt.counters.calls == {"lna2": 1, "incumbent": 0}
    assert any(ln.startswith("LNA2 parity verified rank=1/2 layers=1 builds=v") for ln in lines), lines
    layer.quant_method.calls = 0
    call(layer, x, w, ids)  # verified: lna2 alone from now on
    assert len(fake.calls) == 2 and layer.quant_method.calls == 0


@pytest.mark.parametrize("limit", [None, 0.0])
def test_an_unset_swiglu_limit_is_the_incumbents_10_not_no_clamp(limit):
    """vllm-exl3's apply clamps at `moe.swiglu_limit or 10.0`; the dispatch read an unset or zero
    limit as "no clamp", so lna2 (decode) and the incumbent (prefill) computed different functions
    wherever a gate pre-activation passed 10 (helper audit)."""
    fake = FakeLna2()
    layer, el = make_layer(method=Exl3MoEMethod(MoEConfig(TOP_K, swiglu_limit=limit)))
    layer.swiglu_limit = 7.0  # not what the incumbent reads: it must not be lna2's either
    fake.register(layer)
    rt, _ = runtime(fake=fake)
    rt.prepare([(layer.layer_name, layer)], draft=False)
    x, ids, w = routes(3)
    x = (x.float() * 40).to(torch.bfloat16)  # pre-activations well past 10
    out = call(layer, x, w, ids)
    assert fake.calls and fake.calls[-1]["swiglu_limit"] == 10.0
    assert torch.equal(out, Exl3MoEMethod.apply(layer.quant_method, layer, x, w, ids, None, None))
    assert not torch.equal(out, ref.moe_reference(x, el, ids.long(), w, None).to(x.dtype))  # the clamp bites


@pytest.mark.parametrize("limit, want", [(float("inf"), md.NO_CLAMP), (-1.0, "finite positive"),
                                         (float("nan"), "finite positive"), ("ten", "not a number")])
def test_a_swiglu_limit_lna2_cannot_match_is_refused_at_load(limit, want):
    layer, _ = make_layer(method=Exl3MoEMethod(MoEConfig(TOP_K, swiglu_limit=limit)))
    if isinstance(want, float):
        assert md.validate_layer(layer, layer.quant_method, require_cuda=False).swiglu_limit == want
    else:
        with pytest.raises(md.ContractError, match=want):
            md.validate_layer(layer, layer.quant_method, require_cuda=False)


def test_an_offset_view_of_x_reaches_the_kernel_aligned():
    """v0 faulted on the H200 (misaligned address) when handed a view 2 bytes into a buffer: the
    dispatch copies such an x, and the result is the same as for the aligned tensor."""
    rt, lines, layer, el, fake = ready()
    x, ids, w = routes(3)
    buf = torch.empty(x.numel() + 8, dtype=x.dtype)
    view = buf[1:1 + x.numel()].view_as(x)
    view.copy_(x)
    assert view.data_ptr() % 16 != 0
    out = call(layer, view, w, ids)
    assert len(fake.calls) == 1 and rt.counters.calls == {"lna2": 1, "incumbent": 0}
    assert torch.equal(out, ref.moe_reference(x, el, ids.long(), w).to(x.dtype))
    assert not rt.counters.declines


def test_positional_call_works_too():
    _, _, layer, el, fake = ready()
    x, ids, w = routes(2)
    out = layer.quant_method.apply(layer, x, w, ids, None, None)
    assert len(fake.calls) == 1 and torch.equal(out, ref.moe_reference(x, el, ids.long(), w).to(x.dtype))


def test_the_fake_sees_a_gate_up_swap():
    """The wiring test means something: with gate and up exchanged the fake's output moves."""
    rt, _, layer, el, fake = ready()
    x, ids, w = routes(2)
    st = rt.states[0]
    swapped = list(st.tables)
    swapped[0:3], swapped[3:6] = st.tables[3:6], st.tables[0:3]
    out = torch.empty_like(x)
    fake.lna2_moe_decode(x, out, *swapped, ids, w, 2, 10.0, rt.scratch.get(torch.device("cpu")), I, 1)
    assert not torch.equal(out, ref.moe_reference(x, el, ids.long(), w).to(x.dtype))


def test_flat_ids_are_reshaped_to_rows_by_top_k():
    _, _, layer, el, fake = ready()
    x, ids, w = routes(3)
    out = call(layer, x, w.reshape(-1), ids.reshape(-1))  # map_topk_to_local-style flat ids (trap 14)
    assert fake.calls[-1]["ids"].shape == (3, TOP_K)
    assert torch.equal(out, ref.moe_reference(x, el, ids.long(), w).to(x.dtype))
    # the reshape is row-major: reading the flat ids column-major gives another MoE
    other = ids.reshape(-1).reshape(TOP_K, 3).t()
    assert not torch.equal(out, ref.moe_reference(x, el, other.long(), w).to(x.dtype))


def test_int64_ids_and_bf16_weights_are_converted():
    _, _, layer, el, fake = ready()
    x, ids, w = routes(2)
    out = call(layer, x, w.to(torch.bfloat16), ids.long())
    assert fake.calls[-1]["ids"].dtype == torch.int32 and fake.calls[-1]["weights"].dtype == torch.float32
    assert torch.equal(out, ref.moe_reference(x, el, ids.long(), w.to(torch.bfloat16).float()).to(x.dtype))


def test_routed_scaling_is_applied_exactly_once():
    """What reaches apply already carries the factor (DSV4: the router; V2/V3: 1.0 here and the
    runner scales the output after): lna2 gets the weights unchanged, like the incumbent."""
    _, _, layer, el, fake = ready()
    x, ids, w = routes(2, scale=1.5)
    layer.routed_scaling_factor = 1.5  # what RoutedExperts records when the router applied it
    out = call(layer, x, w, ids)
    assert torch.equal(fake.calls[-1]["weights"], w)
    assert torch.equal(out, ref.moe_reference(x, el, ids.long(), w).to(x.dtype))
    assert not torch.equal(out, ref.moe_reference(x, el, ids.long(), w * 1.5).to(x.dtype))
    # runner-scaled models (apply_routed_scale_to_output): unscaled in, the runner's x1.5 after
    layer.routed_scaling_factor = 1.0
    unscaled = w / 1.5
    out2 = call(layer, x, unscaled, ids).double() * 1.5
    incumbent = Exl3MoEMethod.apply(layer.quant_method, layer, x, unscaled, ids, None, None).double() * 1.5
    assert torch.equal(out2, incumbent)


def test_expert_map_sends_other_ranks_experts_nowhere():
    _, _, layer, el, fake = ready()
    x, ids, w = routes(2)
    # EP-style: 8 global experts, this rank holds global 4..7 as local 0..3
    layer.expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)
    global_ids = ids.clone()
    global_ids[:, 1] = 0  # the second slot goes to another rank's expert 0
    global_ids[:, 0] += 4
    out = call(layer, x, w, global_ids)
    assert fake.calls[-1]["ids"][:, 1].tolist() == [-1, -1]
    keep = w.clone()
    keep[:, 1] = 0
    assert torch.equal(out, ref.moe_reference(x, el, torch.stack([ids[:, 0], ids[:, 0]], 1).long(), keep).to(x.dtype))
    # a -1 pad read the map's last entry (local expert 3) as the expert; it goes nowhere (audit)
    global_ids[:, 1] = -1
    call(layer, x, w, global_ids)
    assert fake.calls[-1]["ids"][:, 1].tolist() == [-1, -1]


def test_prefill_goes_to_the_incumbent_and_is_logged_once():
    rt, lines, layer, el, fake = ready(max_rows=4)
    x, ids, w = routes(6)
    out = call(layer, x, w, ids)
    run(layer, 7)
    assert not fake.calls and layer.quant_method.calls == 2
    assert torch.equal(out, ref.moe_reference(x, el, ids.long(), w).to(x.dtype))
    declined = lines.matching("LNA2 declined")
    assert len(declined) == 1
    assert declined[0].startswith("LNA2 declined: rows=6 above the ceiling 4 (rank=1/2 layer=model.layers.3.mlp.experts")
    assert not CANON_FORBIDDEN.search(declined[0])  # prefill shapes are allowed on the canon seat
    assert rt.counters.declines == {"rows above the ceiling 4": 2}
    assert rt.counters.calls == {"lna2": 0, "incumbent": 2}


def test_decode_and_prefill_mixed():
    rt, lines, layer, _, fake = ready(max_rows=4)
    for rows in (1, 4, 5, 2, 64):
        run(layer, rows)
    assert [c["m"] for c in fake.calls] == [1, 4, 2]
    assert [c["variant"] for c in fake.calls] == [variant_for(m, I, 2, H) for m in (1, 4, 2)]
    assert rt.counters.calls == {"lna2": 3, "incumbent": 2}


def test_empty_batch_is_not_a_decline():
    rt, lines, layer, _, fake = ready()
    x = torch.zeros(0, H, dtype=torch.bfloat16)
    call(layer, x, torch.zeros(0, TOP_K), torch.zeros(0, TOP_K, dtype=torch.int32))
    assert not lines.matching("declined") and rt.counters.calls["incumbent"] == 1


# --- strict levels -----------------------------------------------------------------------------------


def test_strict2_raises_on_a_shape_decline():
    _, _, layer, _, _ = ready(strict=2, max_rows=4)
    x, ids, w = routes(5)
    with pytest.raises(md.Lna2DispatchError, match=re.escape(
            "lna2 dispatch refused: rank=1/2 layer=model.layers.3.mlp.experts: rows=5 above the ceiling 4")):
        call(layer, x, w, ids)


def test_strict1_shape_declines_only_log():
    rt, lines, layer, _, _ = ready(strict=1, max_rows=4)
    run(layer, 5)
    assert lines.matching("LNA2 declined: rows=5 above the ceiling 4")


def _not_built() -> Any:
    raise RuntimeError("extension not built (/x/dsv4serve_lna2.so (missing)): run `dsv4serve kernel build`")


@pytest.mark.parametrize("case,needle", [
    ("no extension", "lna2 extension: extension not built (/x/dsv4serve_lna2.so (missing)): run `dsv4serve kernel build`"),
    ("not exl3", "quant method OtherMethod is not vllm-exl3's Exl3MoEMethod"),
    ("contract", "K=4 (trellis last dim 64) is not 2 or 3"),
    # loaded as ready, then every call failed ("apply() got no topk_ids") (helper audit)
    ("monolithic", "Exl3MoEMethod is monolithic (apply_monolithic routes from router logits"),
])
def test_strict1_refuses_at_load_naming_rank_layer_reason(case, needle):
    layer = _raw_layer(k=4) if case == "contract" else make_layer()[0]
    if case == "not exl3":
        layer.quant_method = OtherMethod()
    if case == "monolithic":
        layer.quant_method.is_monolithic = True
        layer.quant_method.apply_monolithic = lambda layer, x, router_logits: x
    rt, lines = runtime(strict=1, loader=_not_built if case == "no extension" else None)
    with pytest.raises(md.Lna2NotReadyError) as ei:
        rt.prepare([("model.layers.7.mlp.experts", layer)], draft=False)
    msg = str(ei.value)
    assert msg.startswith("lna2 not ready: rank=1/2 layer=model.layers.7.mlp.experts: ") and needle in msg
    assert lines.matching("dsv4serve plugin FAILED lna2 not ready: rank=1/2")
    # nothing was wrapped: the worker dies with the layer as vLLM built it
    assert not hasattr(layer.quant_method, "_dsv4serve_state")


def test_strict1_refuses_a_model_without_moe_layers():
    rt, _ = runtime(strict=1)
    with pytest.raises(md.Lna2NotReadyError, match=r"lna2 not ready: rank=1/2 layer=\(none\): the model has no FusedMoE"):
        rt.prepare([], draft=False)


def test_strict0_falls_back_with_the_reason_logged_once():
    rt, lines = runtime(strict=0, loader=_not_built)
    layers = [make_layer(seed=s, name=f"model.layers.{s}.mlp.experts")[0] for s in range(3)]
    rt.prepare([(ly.layer_name, ly) for ly in layers[:2]], draft=False)
    rt.prepare([(layers[2].layer_name, layers[2])], draft=True)  # the MTP draft: same reason, not repeated
    declined = lines.matching("LNA2 declined")
    assert len(declined) == 1
    assert declined[0].startswith("LNA2 declined: lna2 not ready: rank=1/2 layer=model.layers.0.mlp.experts "
                                  "(+1 more layers): lna2 extension: extension not built")
    assert rt.effective_kernel == "incumbent"
    x, ids, w = routes(2)
    for ly in layers:
        call(ly, x, w, ids)
    assert [ly.quant_method.calls for ly in layers] == [1, 1, 1]
    assert rt.counters.calls == {"lna2": 0, "incumbent": 3}
    assert list(rt.counters.declines.values()) == [3]


@pytest.mark.parametrize("strict", [0, 1])
def test_dispatch_error(strict):
    rt, lines, layer, el, fake = ready(strict=strict)
    fake.fail_with = RuntimeError("lna2_moe_decode: launch failed: too many resources requested")
    x, ids, w = routes(2)
    if strict:
        with pytest.raises(md.Lna2DispatchError, match=re.escape(
                "lna2 dispatch failed: rank=1/2 layer=model.layers.3.mlp.experts: RuntimeError: lna2_moe_decode: "
                "launch failed")):
            call(layer, x, w, ids)
        return
    out = call(layer, x, w, ids)
    call(layer, x, w, ids)
    assert torch.equal(out, ref.moe_reference(x, el, ids.long(), w).to(x.dtype))  # the incumbent served it
    assert len(lines.matching("LNA2 dispatch failed; falling back: rank=1/2 layer=model.layers.3.mlp.experts")) == 1
    assert rt.counters.declines == {"dispatch error: RuntimeError": 2}
    assert not lines.matching("ACTIVE")


@pytest.mark.parametrize("strict", [0, 1])
def test_call_time_contract_decline(strict):
    rt, lines, layer, _, fake = ready(strict=strict)
    x, ids, w = routes(2)
    if strict:
        with pytest.raises(md.Lna2DispatchError, match="x is torch.float32, not fp16/bf16"):
            call(layer, x.float(), w, ids)
        return
    call(layer, x.float(), w, ids)
    assert lines.matching("LNA2 declined: x is torch.float32, not fp16/bf16")
    assert CANON_FORBIDDEN.search(lines.matching("LNA2 declined")[0])  # a real decline trips the canon gate
    assert not fake.calls and layer.quant_method.calls == 1


# --- markers, scratch, counters ----------------------------------------------------------------------


def test_active_marker_once_per_process_after_the_first_success():
    fake = FakeLna2(max_rows=4)
    a, _ = make_layer(K=2, seed=1, name="model.layers.1.mlp.experts")
    b, _ = make_layer(K=3, seed=2, name="model.layers.2.mlp.experts")
    fake.register(a), fake.register(b)
    rt, lines = runtime(fake=fake)
    rt.prepare([(a.layer_name, a)], draft=False)
    rt.prepare([(b.layer_name, b)], draft=True)
    assert not lines.matching("ACTIVE")  # nothing ran yet
    run(a, 9)  # prefill: not a success of lna2
    assert not lines.matching("ACTIVE")
    for ly in (a, b, a):
        run(ly, 2)
    assert lines.matching("ACTIVE") == ["LNA2 MoE kernel ACTIVE rank=1/2 layers=2 bits=2,3 ext=fake-0001 policy=builtin"]


def test_one_zeroed_scratch_per_device_for_the_largest_geometry():
    fake = FakeLna2()
    layers = [make_layer(seed=s)[0] for s in range(3)]
    rt, _ = runtime(fake=fake)
    rt.prepare([(f"l{i}", ly) for i, ly in enumerate(layers)], draft=False)
    s = rt.scratch.get(torch.device("cpu"))
    assert s.dtype == torch.uint8 and s.numel() == fake.lna2_moe_scratch_bytes(H, I) and int(s.count_nonzero()) == 0
    assert rt.scratch.bytes_resident() == s.numel()  # shared, not per layer


def test_scratch_is_never_made_during_capture():
    pool = md.ScratchPool(capturing=lambda: True)
    with pytest.raises(RuntimeError, match="not allocated before graph capture"):
        pool.ensure(torch.device("cpu"), 64)
    pool2 = md.ScratchPool(capturing=lambda: False)
    first = pool2.ensure(torch.device("cpu"), 64)
    assert pool2.ensure(torch.device("cpu"), 32) is first
    bigger = pool2.ensure(torch.device("cpu"), 128)
    assert bigger.numel() == 128 and pool2.bytes_resident() == 192  # the old one stays alive


def test_incumbent_seat_only_counts():
    def never() -> Any:
        raise AssertionError("an incumbent seat must not load the lna2 extension")

    rt, lines = runtime(kernel="incumbent", loader=never)
    a, _ = make_layer()
    b = make_layer(seed=3)[0]
    b.quant_method = OtherMethod()
    rt.prepare([("a", a), ("b", b)], draft=False)
    x, ids, w = routes(2)
    call(a, x, w, ids), call(b, x, w, ids), call(a, x, w, ids)
    assert rt.counters.calls == {"lna2": 0, "incumbent": 3} and not lines
    assert (a.quant_method.calls, b.quant_method.calls) == (2, 1)


def test_wrapping_is_per_instance_and_idempotent():
    rt, _ = runtime(kernel="incumbent")
    a, _ = make_layer()
    untouched = Exl3MoEMethod(MoEConfig())
    rt.prepare([("a", a)], draft=False)
    first = a.quant_method.apply
    summary = rt.prepare([("a", a)], draft=True)
    assert a.quant_method.apply is first and summary.layers == [] and len(rt.states) == 1
    assert "apply" not in vars(untouched) and Exl3MoEMethod.apply is not first


def test_counters_file(tmp_path):
    rt, lines, layer, _, _ = ready()
    rt.counters.path = counters_path(tmp_path, 1)
    x, ids, w = routes(2)
    call(layer, x, w, ids)
    run(layer, 6)
    rt.counters.start(handle_signals=False)  # not in the test process
    data = json.loads(counters_path(tmp_path, 1).read_text())
    assert set(data) == {"rank", "tp", "pid", "kernel", "layers", "calls", "declines", "parity", "graphs", "updated",
                         "final"}
    assert data["parity"]["layers"] == 1 and 0 <= data["parity"]["worst"] <= md.PARITY_TOL
    assert (data["rank"], data["tp"], data["kernel"], data["layers"]) == (1, 2, "lna2", 1)
    assert data["calls"] == {"lna2": 1, "incumbent": 1} and data["declines"] == {"rows above the ceiling 4": 1}
    assert data["final"] is False
    # the flusher thread picks up later calls within its interval
    call(layer, x, w, ids)
    deadline = time.time() + 5
    while json.loads(counters_path(tmp_path, 1).read_text())["calls"]["lna2"] != 2:
        assert time.time() < deadline, "counters were not flushed"
        time.sleep(0.02)
    rt.counters.close()
    final = json.loads(counters_path(tmp_path, 1).read_text())
    assert final["final"] is True and final["calls"]["lna2"] == 2
    rt.counters.write()  # nothing overwrites the final file
    assert json.loads(counters_path(tmp_path, 1).read_text())["final"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counters-rank1.json"]  # no temp files left


def test_counter_bumps_are_thread_safe():
    c = Counters(None, 0, 1, "lna2")
    threads = [threading.Thread(target=lambda: [c.call("lna2") for _ in range(2000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.calls["lna2"] == 8000


def test_a_non_exl3_mtp_draft_is_exempt_not_a_failure():
    """vllm-exl3 can delegate the MTP draft's experts (mtp_experts=source): lna2 has nothing to
    serve there, so even strict 2 does not refuse the seat for them; it says so once."""
    rt, lines, layer, _, fake = ready(strict=2)
    draft = make_layer(seed=5, name="model.layers.43.mtp_block.mlp.experts")[0]
    draft.quant_method = OtherMethod()
    rt.prepare([(draft.layer_name, draft)], draft=True)
    assert lines.matching("dsv4serve plugin draft rank=1/2 layer=model.layers.43.mtp_block.mlp.experts: quant "
                          "method OtherMethod is not EXL3; lna2 does not apply")
    assert not lines.matching("LNA2 declined")
    run(draft, 2)
    assert draft.quant_method.calls == 1 and rt.counters.calls == {"lna2": 0, "incumbent": 1}
    assert rt.effective_kernel == "lna2" and rt.lna2_layers == 1
    # the same class in the *target* model is a refusal
    rt2, _ = runtime(strict=1)
    with pytest.raises(md.Lna2NotReadyError, match="quant method OtherMethod is not vllm-exl3's Exl3MoEMethod"):
        rt2.prepare([(draft.layer_name, make_layer(method=OtherMethod())[0])], draft=False)


@pytest.mark.parametrize("strict", [0, 1])
def test_an_lna2_output_that_is_not_the_incumbents_is_caught_on_the_layers_first_call(strict):
    """ACTIVE and the counters say the kernel ran, not that it computed the seat's MoE: a wiring
    fault (here the gate and up tables swapped) passed every gate (audit; the founding trap). The
    layer's first eager call is checked against the incumbent: strict 1 raises, strict 0 serves the
    incumbent's answer and hands the layer back to it."""
    rt, lines, layer, el, fake = ready(strict=strict)
    st = rt.states[0]
    t = list(st.tables)
    t[0:3], t[3:6] = t[3:6], t[0:3]
    st.tables = tuple(t)
    x, ids, w = routes(3)
    if strict:
        with pytest.raises(md.Lna2DispatchError,
                           match=r"^lna2 parity failed: rank=1/2 layer=\S+ v\d+ rows=3: worst row relative L2 \S+ "
                                 r"against the incumbent \(tolerance 0.02\)$"):
            call(layer, x, w, ids)
        assert rt.counters.calls == {"lna2": 0, "incumbent": 0}
        return
    out = call(layer, x, w, ids)
    assert torch.equal(out, Exl3MoEMethod.apply(layer.quant_method, layer, x, w, ids, None, None))
    assert rt.counters.calls == {"lna2": 0, "incumbent": 1}
    assert rt.counters.declines == {"parity mismatch against the incumbent": 1}
    assert lines.matching("LNA2 declined: rank=1/2 layer=") and not lines.matching("ACTIVE")
    n = len(fake.calls)
    call(layer, x, w, ids)  # the incumbent's layer from now on
    assert len(fake.calls) == n and rt.counters.calls == {"lna2": 0, "incumbent": 2}
    assert not lines.matching("parity verified") and rt.counters.parity_layers == 0


def test_a_call_under_graph_capture_is_checked_at_the_next_eager_one():
    """Capture runs no comparison (the incumbent's apply would be captured too, and the check needs
    the host): the layer stays unverified until a call outside capture."""
    capturing = {"on": False}
    fake = FakeLna2(max_rows=4)
    layer, el = make_layer()
    fake.register(layer)
    rt, lines = runtime(fake=fake, capturing=lambda: capturing["on"])
    rt.prepare([(layer.layer_name, layer)], draft=False)
    x, ids, w = routes(2)
    capturing["on"] = True
    call(layer, x, w, ids)
    assert layer.quant_method.calls == 0 and not rt.states[0].verified and lines.matching("ACTIVE")
    capturing["on"] = False
    call(layer, x, w, ids)
    assert layer.quant_method.calls == 1 and rt.states[0].verified
    assert lines.matching("LNA2 parity verified rank=1/2 layers=1")


@pytest.mark.parametrize("strict", [0, 1])
def test_routing_of_another_2d_shape_is_refused_not_reshaped(strict):
    """Only the element count was checked: a [top_k, rows] ids tensor was reshaped to [rows, top_k]
    and lna2 served every row with other rows' experts (audit; the flat-id trap's cousin)."""
    rt, lines, layer, el, fake = ready(strict=strict)
    x, ids, w = routes(3)
    if strict:
        with pytest.raises(md.Lna2DispatchError, match=r"topk_ids is \(2, 3\), not \[rows=3, top_k=2\] or flat"):
            call(layer, x, w, ids.t().contiguous())
        return
    call(layer, x, w, ids.t().contiguous())
    assert not fake.calls and rt.counters.declines == {"routing of another shape": 1}
    call(layer, x, w.reshape(-1), ids.reshape(-1))  # flat stays vLLM's other spelling
    assert len(fake.calls) == 1



def test_parity_waits_for_rows_that_differ_and_checks_each_build_at_each_width():
    """vLLM's warm-up runs identical dummy rows: a kernel that mixed rows matched there and was never
    checked again; and a build checked on a K3 layer was trusted on a K2 one (review)."""
    rt, lines, layer, el, fake = ready()
    x, ids, w = routes(3)
    same = x[:1].expand(3, -1).contiguous()
    call(layer, same, w, ids[:1].expand(3, -1).contiguous())
    assert layer.quant_method.calls == 1 and not rt.states[0].verified  # matched, but proves no row order
    assert not rt.verified_builds  # nor for the build: a warm-up must not excuse it later (review)
    call(layer, x, w, ids)
    assert layer.quant_method.calls == 2 and rt.states[0].verified
    call(layer, x, w, ids)
    assert layer.quant_method.calls == 2
    assert {(k[1], k[2]) for k in rt.verified_builds} == {(2, 1)}
    # a layer whose eager calls are all one row checks its build once, not every call (review)
    rt2, _, layer2, _, _ = ready()
    for seed in range(5):
        run(layer2, 1, seed=seed)
    assert layer2.quant_method.calls == 1 and not rt2.states[0].verified


def test_an_incumbent_that_fails_during_the_check_is_not_lna2s_mismatch():
    """The check's incumbent call raising killed a strict-0 worker that would have served lna2's
    output (review): strict 0 serves it, unverified, and counts why; strict 1 raises naming it."""
    for strict in (0, 1):
        rt, lines, layer, el, fake = ready(strict=strict)

        def broken(*a, **k):
            raise RuntimeError("incumbent scratch exhausted")

        rt.states[0].orig_apply = broken
        x, ids, w = routes(3)
        if strict:
            with pytest.raises(md.Lna2DispatchError, match="lna2 parity not checked: .*incumbent scratch exhausted"):
                call(layer, x, w, ids)
            continue
        out = call(layer, x, w, ids)
        assert torch.equal(out, ref.moe_reference(x, el, ids.long(), w).to(x.dtype))
        assert rt.counters.declines == {"parity not checked: the incumbent failed": 1} and not rt.states[0].verified
        call(layer, x, w, ids)  # tried once, not on every call (review)
        assert rt.counters.declines == {"parity not checked: the incumbent failed": 1}


def test_rows_that_overflow_on_both_sides_are_not_a_mismatch():
    """inf on both sides made NaN in the difference and failed the check (review)."""
    a = torch.tensor([[1.0, float("inf")], [2.0, 3.0]])
    assert md._worst_row(a, a.clone()) == 0.0
    assert md._worst_row(a, torch.tensor([[1.0, 5.0], [2.0, 3.0]])) == float("inf")
    assert md._worst_row(a, torch.tensor([[1.0, float("-inf")], [2.0, 3.0]])) == float("inf")


def test_each_captured_graph_size_records_which_kernel_it_holds(tmp_path):
    """A replay never comes back to Python: a graph whose capture declined replayed the incumbent on
    every decode step of its size while the counters showed a single decline (dispatch audit). The
    calls made during capture are kept per row count, by kind, in the counters file."""
    capturing = {"on": False}
    fake = FakeLna2(max_rows=4)
    layer, _ = make_layer()
    fake.register(layer)
    other = make_layer(seed=3)[0]
    other.quant_method = OtherMethod()  # a draft's experts that are not EXL3: the incumbent's by design
    rt, _ = runtime(fake=fake, capturing=lambda: capturing["on"], run_dir=tmp_path)
    rt.prepare([(layer.layer_name, layer)], draft=False)
    rt.prepare([("mtp.experts", other)], draft=True)
    run(layer, 2)  # eager: not a graph
    capturing["on"] = True
    for rows in (1, 2, 8):  # 8 is above the build's ceiling: declined, captured with the incumbent
        run(layer, rows)
        run(other, rows)
    x, ids, w = routes(4)
    call(layer, x.float(), w, ids)  # a contract decline (fp32 x) during capture
    capturing["on"] = False
    assert rt.counters.graphs == {1: {"lna2": 1, "declined": 0, "incumbent": 1},
                                  2: {"lna2": 1, "declined": 0, "incumbent": 1},
                                  4: {"lna2": 0, "declined": 1, "incumbent": 0},
                                  8: {"lna2": 0, "declined": 1, "incumbent": 1}}
    rt.counters.write()
    snap = json.loads(counters_path(tmp_path, 1).read_text())
    assert snap["graphs"]["8"] == {"lna2": 0, "declined": 1, "incumbent": 1} and set(snap["graphs"]) == {"1", "2", "4", "8"}
