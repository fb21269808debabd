"""moe_dispatch on the CPU: the lna2 dispatch policy, strict levels, markers and counters.

vllm-exl3 cannot be installed here (it needs CUDA) and the lna2 extension needs a GPU, so two
stand-ins carry these tests; the real pair ran on the H200 (kernels/lna2/NOTES.md).

* ``Exl3MoEMethod`` below is a stand-in for vllm-exl3's quant method: it has the same class name
  under a ``vllm_exl3`` module (how the dispatch recognises it) and its apply is the incumbent,
  computed with the project's fp64 reference.
* ``FakeExt`` is a stand-in for the compiled lna2 module with the real API. It refuses anything
  the real kernel refuses (flat ids, non-int32 ids, non-fp32 weights, scratch not zeroed, pointer
  tables that do not name each expert's slices), so a test that passes here exercised the real
  calling convention, and computes the output with the same reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dsv4serve import moe_dispatch as md
from dsv4serve.lna2 import reference as ref
from dsv4serve.lna2.policy import variant_for
from dsv4serve.plugin_counters import Counters

E, H, I, TOP_K = 4, 128, 128, 2
CEILING = 24


def make_layer(K: int = 2, codebook: str = "mcg", seed: int = 0, n_experts: int = E) -> tuple[torch.nn.Module, ref.ExpertLayer]:
    """A vllm-exl3-shaped routed-expert layer (exl3-reference §4.4) from a random ExpertLayer."""
    el = ref.random_expert_layer(n_experts, H, I, K, codebook, seed=seed)
    m = torch.nn.Module()
    p = lambda t: torch.nn.Parameter(t.contiguous(), requires_grad=False)  # noqa: E731
    m.w13_trellis = p(torch.stack([el.gate_trellis, el.up_trellis], dim=1))
    m.w13_suh = p(torch.stack([el.gate_suh, el.up_suh], dim=1))
    m.w13_svh = p(torch.stack([el.gate_svh, el.up_svh], dim=1))
    m.w2_trellis = p(el.down_trellis)
    m.w2_suh = p(el.down_suh)
    m.w2_svh = p(el.down_svh)
    marker = ref.codebook_marker(codebook)
    for cb, value in (("mcg", ref.MCG_MARKER), ("mul1", ref.MUL1_MARKER)):
        on = cb == codebook and marker is not None
        m.register_buffer(f"w13_{cb}", torch.full((n_experts, 2, 1), value if on else 0, dtype=torch.int32))
        m.register_buffer(f"w2_{cb}", torch.full((n_experts, 1), value if on else 0, dtype=torch.int32))
    m.top_k = TOP_K
    m.swiglu_limit = 10.0
    return m, el


def layer_view(m: torch.nn.Module, K: int, codebook: str) -> ref.ExpertLayer:
    return ref.ExpertLayer(gate_trellis=m.w13_trellis[:, 0], gate_suh=m.w13_suh[:, 0], gate_svh=m.w13_svh[:, 0],
                           up_trellis=m.w13_trellis[:, 1], up_suh=m.w13_suh[:, 1], up_svh=m.w13_svh[:, 1],
                           down_trellis=m.w2_trellis, down_suh=m.w2_suh, down_svh=m.w2_svh,
                           K=K, codebook=codebook, hidden=H, inter=I)


def incumbent(layer, x, topk_weights, topk_ids) -> torch.Tensor:
    K = layer.w13_trellis.shape[-1] // 16
    cb = "mcg" if bool((layer.w13_mcg != 0).any()) else "mul1"
    rows = x.numel() // x.shape[-1]
    out = ref.moe_reference(x.reshape(rows, H).float(), layer_view(layer, K, cb), topk_ids.reshape(rows, TOP_K),
                            topk_weights.reshape(rows, TOP_K).float(), swiglu_limit=layer.swiglu_limit)
    return out.to(x.dtype).view(x.shape)


class Exl3MoEMethod:
    """Stand-in for vllm_exl3's Exl3MoEMethod (not installable here): the incumbent apply."""

    def __init__(self) -> None:
        self.calls = 0

    def apply(self, layer, x, topk_weights, topk_ids, *rest, **kw):
        self.calls += 1
        return incumbent(layer, x, topk_weights, topk_ids)


Exl3MoEMethod.__module__ = "vllm_exl3.layers.moe"


class UnquantizedFusedMoEMethod:
    """Stand-in for vLLM's unquantised method (what the CPU demo seat really has)."""

    def __init__(self) -> None:
        self.calls = 0

    def apply(self, layer, x, topk_weights, topk_ids, *rest, **kw):
        self.calls += 1
        return torch.zeros_like(x)


class FakeExt:
    """Stand-in for the compiled lna2 extension (needs a GPU), with the real module's API."""

    def __init__(self, layers: list[tuple[torch.nn.Module, ref.ExpertLayer]], ceiling: int = CEILING,
                 fail: Exception | None = None, fit: dict[int, int] | None = None) -> None:
        self.layers = layers
        self.ceiling = ceiling
        self.fail = fail
        self.fit = fit  # variant -> the most rows that fit the device (None: every build fits, an H200)
        self.fit_queries: list[tuple] = []
        self.seen: list[dict] = []

    def lna2_moe_max_rows(self) -> int:
        return self.ceiling

    def lna2_moe_scratch_bytes(self, hidden: int, inter: int) -> int:
        return 4096

    def lna2_moe_info(self, bits: int, codebook: int, hidden: int, inter: int) -> dict:
        return {"scratch_bytes": 8192, "max_top_k": 8, "max_experts": 256}

    def lna2_build_id(self) -> str:
        return "fake-0"

    def lna2_moe_fit(self, variant, bits, codebook, hidden, inter, top_k, n_experts) -> int:
        self.fit_queries.append((variant, bits, codebook, hidden, inter, top_k, n_experts))
        return self.ceiling if self.fit is None else self.fit.get(variant, 0)

    def _which(self, gate_trellis: torch.Tensor) -> torch.nn.Module:
        for m, _ in self.layers:
            want = [m.w13_trellis[e, 0].data_ptr() for e in range(m.w13_trellis.shape[0])]
            if gate_trellis.tolist() == want:
                return m
        raise RuntimeError("pointer table names no known layer")

    def lna2_moe_decode(self, x, out, gt, gs, gv, ut, us, uv, dt, ds, dv, ids, weights, bits, limit, scratch,
                        inter, codebook, variant):
        if self.fail is not None:
            raise self.fail
        m = self._which(gt)
        e = m.w13_trellis.shape[0]
        tables = {"gt": (gt, m.w13_trellis, 0), "gs": (gs, m.w13_suh, 0), "gv": (gv, m.w13_svh, 0),
                  "ut": (ut, m.w13_trellis, 1), "us": (us, m.w13_suh, 1), "uv": (uv, m.w13_svh, 1),
                  "dt": (dt, m.w2_trellis, None), "ds": (ds, m.w2_suh, None), "dv": (dv, m.w2_svh, None)}
        for name, (tab, src, slot) in tables.items():
            assert tab.dtype == torch.int64 and tab.shape == (e,), name
            want = [(src[i, slot] if slot is not None else src[i]).data_ptr() for i in range(e)]
            assert tab.tolist() == want, f"table {name} does not point at each expert's slice"
        assert ids.dim() == 2 and ids.dtype == torch.int32 and ids.is_contiguous(), "ids must be [rows, top_k] int32"
        assert weights.dtype == torch.float32 and weights.shape == ids.shape
        assert x.dim() == 2 and out.shape == x.shape and x.is_contiguous()
        assert int(scratch.count_nonzero()) == 0, "scratch must be zeroed"
        assert inter == I and bits == m.w13_trellis.shape[-1] // 16 and codebook in (1, 2)
        assert limit > 0
        self.seen.append({"rows": x.shape[0], "variant": variant, "ids_shape": tuple(ids.shape)})
        cb = "mcg" if codebook == 1 else "mul1"
        lim = None if limit >= md.NO_CLAMP else limit
        y = ref.moe_reference(x.float(), layer_view(m, bits, cb), ids.long(), weights, swiglu_limit=lim)
        out.copy_(y.to(out.dtype))


class Harness:
    def __init__(self, kernel: str = "lna2", strict: int = 0, n_layers: int = 2, ext: object | None = "fake",
                 tmp_path=None, method_cls=Exl3MoEMethod, decode_rows: int | None = None, tuning: str | None = None,
                 identity: tuple[str, int] = ("Stand-in Card", 34), **ext_kw) -> None:
        self.env = md.PluginEnv(run_id="t1", run_dir=str(tmp_path) if tmp_path else None, kernel=kernel, strict=strict,
                                decode_rows=decode_rows, tuning=tuning)
        self.layers = []
        for i in range(n_layers):
            m, el = make_layer(seed=i)
            m.quant_method = method_cls()
            self.layers.append((f"model.layers.{i + 1}.mlp.experts", m, el))
        self.lines: list[str] = []
        self.counters = Counters(self.env.run_dir, 0, 1, kernel)
        if ext == "fake":
            self.ext = FakeExt([(m, el) for _, m, el in self.layers], **ext_kw)
        else:
            self.ext = ext

        def loader():
            if self.ext is None:
                raise RuntimeError("extension not built (x.so missing): run `dsv4serve kernel build`")
            return self.ext

        # the card's name and SM count, as a tuning table names them (no CUDA device here)
        self.rt = md.Runtime(self.env, 0, 1, emit=self.lines.append, counters=self.counters, ext_loader=loader,
                             require_cuda=False, capturing=lambda: False, device_identity=lambda d: identity)

    def prepare(self, draft: bool = False):
        return self.rt.prepare([(n, m) for n, m, _ in self.layers], draft=draft)

    def call(self, i: int, rows: int, flat_ids: bool = False, seed: int = 0):
        _, m, _ = self.layers[i]
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(rows, H, generator=g) * 0.5).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(rows)]).to(torch.int64)
        w = torch.rand(rows, TOP_K, generator=g)
        if flat_ids:
            ids = ids.reshape(-1)
        out = m.quant_method.apply(m, x, w, ids)
        return out, incumbent(m, x, w, ids)

    def grep(self, text: str) -> list[str]:
        return [ln for ln in self.lines if text in ln]


# --- env ------------------------------------------------------------------------------------------


def test_env_inert_without_run_id():
    assert md.read_env({"VLLM_EXL3_MOE_KERNEL": "lna2"}) is None


def test_env_maps_and_validates():
    e = md.read_env({"DSV4SERVE_RUN_ID": "r", "VLLM_EXL3_MOE_KERNEL": "lna2", "VLLM_EXL3_MOE_STRICT": "1"})
    assert (e.kernel, e.strict) == ("lna2", 1)
    assert md.read_env({"DSV4SERVE_RUN_ID": "r", "VLLM_EXL3_MOE_KERNEL": "exllamav3"}).kernel == "incumbent"
    assert md.read_env({"DSV4SERVE_RUN_ID": "r", "DSV4SERVE_MOE_KERNEL": "none",
                        "VLLM_EXL3_MOE_KERNEL": "lna2"}).kernel == "none"
    for bad in ({"VLLM_EXL3_MOE_KERNEL": "lna3"}, {"DSV4SERVE_MOE_KERNEL": "fast"}, {"VLLM_EXL3_MOE_STRICT": "3"}):
        with pytest.raises(md.PluginConfigError):
            md.read_env({"DSV4SERVE_RUN_ID": "r", **bad})


# --- the lna2 path --------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 4, 16, 24])
def test_lna2_serves_decode_rows_with_the_incumbents_result(rows, tmp_path):
    h = Harness(tmp_path=tmp_path)
    s = h.prepare()
    assert s.lna2_layers == 2 and not s.not_ready
    out, want = h.call(0, rows)
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2e-2)
    assert h.ext.seen == [{"rows": rows, "variant": variant_for(rows, I, 2, H), "ids_shape": (rows, TOP_K)}]
    # the incumbent ran once, beside lna2, to check the layer's first call; what returned is lna2's
    assert h.layers[0][1].quant_method.calls == 1
    assert h.counters.calls == {"lna2": 1, "incumbent": 0}
    h.call(0, rows, seed=1)
    if rows == 1:  # the build is checked; the layer waits for rows that differ, without a check per call
        assert h.layers[0][1].quant_method.calls == 1 and not h.rt.states[0].verified
    else:  # layer and build verified: the incumbent no longer runs
        assert h.layers[0][1].quant_method.calls == 1 and h.rt.states[0].verified
    assert h.counters.calls == {"lna2": 2, "incumbent": 0}


def test_variant_follows_the_policy():
    h = Harness()
    h.prepare()
    for rows in (1, 2, 3, 9):
        h.call(0, rows)
    # the dispatch hands the policy the layer's hidden size: this 128-wide harness layer is not one
    # the cluster kernel takes, so v55 serves it even at one row, where a 4096-wide slice gets v59
    # (to twelve K2 rows)
    assert [s["variant"] for s in h.ext.seen] == [55, 55, 55, 55]
    assert [variant_for(r, I, 2) for r in (1, 2, 3, 9, 13, 25)] == [59, 59, 59, 59, 55, 55]


def test_flat_ids_are_reshaped(tmp_path):
    h = Harness()
    h.prepare()
    out, want = h.call(1, 3, flat_ids=True)
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2e-2)
    assert h.ext.seen[0]["ids_shape"] == (3, TOP_K)


def test_active_marker_once_per_process():
    h = Harness()
    h.prepare()
    for i in range(4):
        h.call(i % 2, 1, seed=i)
    active = h.grep("LNA2 MoE kernel ACTIVE")
    assert active == ["LNA2 MoE kernel ACTIVE rank=0/1 layers=2 bits=2 ext=fake-0 policy=builtin"]
    assert h.counters.calls["lna2"] == 4


def test_counters_file(tmp_path):
    h = Harness(tmp_path=tmp_path)
    h.prepare()
    h.call(0, 1)
    h.call(0, 30)  # prefill: the incumbent
    assert h.counters.write()
    doc = json.loads((tmp_path / "counters-rank0.json").read_text())
    assert doc["calls"] == {"lna2": 1, "incumbent": 1} and doc["kernel"] == "lna2" and doc["layers"] == 2
    assert doc["declines"] == {f"rows above the ceiling {CEILING}": 1} and doc["final"] is False
    h.counters.close()
    assert json.loads((tmp_path / "counters-rank0.json").read_text())["final"] is True
    h.call(0, 1)
    h.counters.write()  # nothing overwrites the final file
    assert json.loads((tmp_path / "counters-rank0.json").read_text())["calls"]["lna2"] == 1


def test_sigterm_inside_a_counted_call_writes_the_final_file_without_hanging(tmp_path):
    """The final-write signal handler runs on the main thread, which may be inside call()'s lock
    (the MoE hot path) when SIGTERM lands: it must not wait on that lock (the worker would hang
    until its SIGKILL and leave no final file). A real SIGTERM arrives while the lock is held, in a
    child process so that a hang is a timeout here, not a hung test run."""
    import subprocess
    import sys

    script = (
        "import os, signal, sys, time\n"
        "from dsv4serve.plugin_counters import Counters\n"
        "signal.signal(signal.SIGTERM, lambda *a: None)  # the handler it chains to\n"
        f"c = Counters({str(tmp_path)!r}, rank=3, tp=8, kernel='lna2')\n"
        "c.start(handle_signals=True)\n"
        "c.call('lna2')\n"
        "with c._lock:  # the hot path's critical section\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.05)  # the handler runs at this thread's next bytecode boundary\n"
        "print('past the lock')\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "past the lock" in r.stdout, r.stderr[-2000:]
    doc = json.loads((tmp_path / "counters-rank3.json").read_text())
    assert doc["final"] is True and doc["calls"]["lna2"] == 1


def test_the_counters_file_is_readable_by_other_users(tmp_path):
    """A docker seat's workers run as root and write into the host's run dir: a 0600 file read as
    "no counters from rank N: the plugin did not run" in the user's check-seat."""
    from dsv4serve.plugin_counters import Counters

    c = Counters(str(tmp_path), rank=0, tp=1, kernel="lna2")
    c.call("lna2")
    assert c.write()
    assert ((tmp_path / "counters-rank0.json").stat().st_mode & 0o777) == 0o644


# --- shape declines --------------------------------------------------------------------------------


def test_rows_above_ceiling_go_to_incumbent_logged_once_strict0():
    h = Harness(strict=0)
    h.prepare()
    for seed in range(3):
        out, want = h.call(0, CEILING + 1, seed=seed)
        torch.testing.assert_close(out, want)
    assert h.layers[0][1].quant_method.calls == 3 and not h.ext.seen
    declined = h.grep("LNA2 declined")
    assert len(declined) == 1 and f"rows={CEILING + 1} above the ceiling {CEILING}" in declined[0]
    assert h.counters.declines == {f"rows above the ceiling {CEILING}": 3}
    assert h.counters.calls == {"lna2": 0, "incumbent": 3}


def test_strict1_shape_decline_only_logs():
    h = Harness(strict=1)
    h.prepare()
    h.call(0, 100)
    assert h.counters.calls["incumbent"] == 1 and len(h.grep("LNA2 declined")) == 1


def test_strict2_shape_decline_raises():
    h = Harness(strict=2)
    h.prepare()
    with pytest.raises(md.Lna2DispatchError, match=r"rows=25 above the ceiling 24.*STRICT=2"):
        h.call(0, 25)
    h.call(0, 24)  # at the ceiling: lna2
    assert h.counters.calls == {"lna2": 1, "incumbent": 0}


def test_swapped_ids_and_weights_are_refused_not_cast():
    """Float weights passed where ids go would cast to expert 0 everywhere and still make text:
    the dispatch names the types instead (strict 1: the load fails loudly)."""
    h = Harness(strict=1)
    h.prepare()
    _, m, _ = h.layers[0]
    x = torch.randn(1, H).to(torch.bfloat16)
    ids = torch.randperm(E)[:TOP_K].reshape(1, TOP_K)
    w = torch.rand(1, TOP_K)
    with pytest.raises(md.Lna2DispatchError, match="topk_ids is torch.float32, not an integer tensor"):
        m.quant_method.apply(m, x, ids, w)  # (weights, ids) swapped
    with pytest.raises(md.Lna2DispatchError, match="topk_weights is torch.int64, not a floating tensor"):
        m.quant_method.apply(m, x, ids, ids)


def test_canon_forbidden_regex_lets_shape_declines_through_only():
    import re

    from dsv4serve.profile import load_profile

    forbidden = [re.compile(p) for p in load_profile("8x16gb-380k").gates.forbidden]
    h = Harness(strict=0, ext=None)
    h.prepare()
    h2 = Harness(strict=0)
    h2.prepare()
    h2.call(0, 99)
    shape_line = h2.grep("LNA2 declined")[0]
    not_ready_line = h.grep("LNA2 declined")[0]
    assert not any(p.search(shape_line) for p in forbidden), shape_line
    assert any(p.search(not_ready_line) for p in forbidden), not_ready_line


# --- not ready --------------------------------------------------------------------------------------


def test_missing_extension_strict0_declines_once_and_counts():
    h = Harness(strict=0, ext=None)
    s = h.prepare()
    assert s.lna2_layers == 0 and len(s.not_ready) == 1
    (line,) = h.grep("LNA2 declined")
    assert "lna2 not ready: rank=0/1 layer=model.layers.1.mlp.experts (+1 more layers)" in line
    assert "extension not built" in line and "VLLM_EXL3_MOE_STRICT=0" in line
    out, want = h.call(0, 1)
    torch.testing.assert_close(out, want)
    assert h.rt.effective_kernel == "incumbent"
    assert h.counters.calls == {"lna2": 0, "incumbent": 1}
    assert list(h.counters.declines) == [next(iter(h.counters.declines))]
    assert next(iter(h.counters.declines)).startswith("not ready: lna2 extension: extension not built")
    # the draft model's layers decline for the same reason: not logged twice
    draft, _ = make_layer(seed=9)
    draft.quant_method = Exl3MoEMethod()
    h.rt.prepare([("draft.mlp.experts", draft)], draft=True)
    assert len(h.grep("LNA2 declined")) == 1


def test_missing_extension_strict1_fails_at_load_before_wrapping():
    h = Harness(strict=1, ext=None)
    with pytest.raises(md.Lna2NotReadyError, match=r"^lna2 not ready: rank=0/1 layer=model.layers.1.mlp.experts: "
                                                   r"lna2 extension: extension not built"):
        h.prepare()
    assert h.grep("dsv4serve plugin FAILED lna2 not ready")
    assert not hasattr(h.layers[0][1].quant_method, "_dsv4serve_state")  # nothing wrapped


def test_a_build_below_the_seats_decode_rows_is_not_ready_under_strict():
    """Every decode step above the build's ceiling would go to the incumbent as a prefill-shaped
    decline, which the gates let through: strict mode refuses the build at load instead."""
    h = Harness(strict=1, decode_rows=16, ceiling=8)
    with pytest.raises(md.Lna2NotReadyError, match=r"the lna2 build takes at most 8 rows a call but this seat decodes 16"):
        h.prepare()
    assert not hasattr(h.layers[0][1].quant_method, "_dsv4serve_state")  # nothing wrapped
    assert Harness(strict=1, decode_rows=16, ceiling=24).prepare() is not None
    assert Harness(strict=0, decode_rows=16, ceiling=8).prepare() is not None  # strict 0: declines, counted


def test_a_module_whose_build_id_fails_is_no_extension_not_one_without_a_ceiling_check():
    """The module was taken as loaded before its ceiling and build id were read: one whose
    lna2_build_id raised was served with the decode-rows refusal never decided."""
    h = Harness(strict=1, decode_rows=16, ceiling=8)

    def broken() -> str:
        raise RuntimeError("lna2_build_id: no build tag")

    h.ext.lna2_build_id = broken
    with pytest.raises(md.Lna2NotReadyError, match="lna2 extension: lna2_build_id: no build tag"):
        h.prepare()
    assert not hasattr(h.layers[0][1].quant_method, "_dsv4serve_state")


def test_the_launcher_tells_the_plugin_the_seats_decode_rows():
    from dsv4serve import launch
    from dsv4serve.profile import load_profile

    env = launch._plugin_env(load_profile("8x16gb-380k"), "r", Path("/tmp/x"))
    assert env["DSV4SERVE_DECODE_ROWS"] == "16"  # 4 streams x (1 + 3 DSpark tokens)
    assert md.read_env({"DSV4SERVE_RUN_ID": "r", **env}).decode_rows == 16
    assert "DSV4SERVE_DECODE_ROWS" not in launch._plugin_env(load_profile("cpu-demo"), "r", Path("/tmp/x"))
    for bad in ("0", "-4", "16.0", "x"):
        with pytest.raises(md.PluginConfigError, match="DSV4SERVE_DECODE_ROWS"):
            md.read_env({"DSV4SERVE_RUN_ID": "r", "DSV4SERVE_DECODE_ROWS": bad})


def test_non_exl3_method_strict1_names_the_method():
    h = Harness(strict=1, method_cls=UnquantizedFusedMoEMethod)
    with pytest.raises(md.Lna2NotReadyError, match="UnquantizedFusedMoEMethod is not vllm-exl3's Exl3MoEMethod"):
        h.prepare()


def test_no_moe_layers_is_not_ready_for_lna2():
    h = Harness(strict=1, n_layers=0)
    with pytest.raises(md.Lna2NotReadyError, match="no FusedMoE layers"):
        h.prepare()
    h0 = Harness(strict=1, n_layers=0)
    h0.prepare(draft=True)  # a draft without MoE layers is fine


@pytest.mark.parametrize("breakage, reason", [
    (lambda m: m.w13_mul1.fill_(ref.MUL1_MARKER), "both mcg and mul1"),
    (lambda m: m.w13_mcg.zero_(), "neither mcg nor mul1"),
    (lambda m: m.w2_mcg.fill_(7), "holds 7"),
    (lambda m: setattr(m, "w2_suh", torch.nn.Parameter(m.w2_suh.data.float(), requires_grad=False)), "w2_suh is torch.float32"),
    (lambda m: setattr(m, "top_k", 9), "top_k 9 outside 1..8"),
    (lambda m: setattr(m, "w13_svh", None), "missing parameter w13_svh"),
])
def test_contract_violations_are_named(breakage, reason):
    m, _ = make_layer()
    breakage(m)
    with pytest.raises(md.ContractError, match=reason):
        md.validate_layer(m, Exl3MoEMethod(), require_cuda=False)


def test_k4_is_refused():
    m, _ = make_layer(K=4)
    with pytest.raises(md.ContractError, match="K=4"):
        md.validate_layer(m, Exl3MoEMethod(), require_cuda=False)


def test_cpu_tensors_refused_when_cuda_required():
    m, _ = make_layer()
    with pytest.raises(md.ContractError, match="not a CUDA device"):
        md.validate_layer(m, Exl3MoEMethod(), require_cuda=True)


def test_mul1_and_k3_layers_validate():
    m, _ = make_layer(K=3, codebook="mul1")
    g = md.validate_layer(m, Exl3MoEMethod(), require_cuda=False)
    assert (g.bits, g.codebook, g.codebook_name, g.n_experts, g.hidden, g.inter) == (3, 2, "mul1", E, H, I)
    assert g.swiglu_limit == 10.0


# --- dispatch errors ----------------------------------------------------------------------------------


def test_dispatch_error_strict0_falls_back_loudly():
    h = Harness(strict=0, fail=RuntimeError("CUDA error: misaligned address"))
    h.prepare()
    out, want = h.call(0, 1)
    torch.testing.assert_close(out, want)
    h.call(0, 1, seed=1)
    (line,) = h.grep("LNA2 dispatch failed; falling back")
    assert "misaligned address" in line
    assert h.counters.declines == {"dispatch error: RuntimeError": 2}
    assert not h.grep("ACTIVE")


def test_dispatch_error_strict1_raises():
    h = Harness(strict=1, fail=RuntimeError("CUDA error: misaligned address"))
    h.prepare()
    with pytest.raises(md.Lna2DispatchError, match="lna2 dispatch failed: rank=0/1 layer=.*misaligned"):
        h.call(0, 1)


# --- other kernels ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["incumbent", "none"])
def test_other_kernels_only_count(kernel):
    h = Harness(kernel=kernel, strict=2)
    s = h.prepare()
    assert s.lna2_layers == 0 and not s.not_ready
    out, want = h.call(0, 1)
    torch.testing.assert_close(out, want)
    assert not h.ext.seen and h.counters.calls == {"lna2": 0, "incumbent": 1}
    assert not h.grep("LNA2")


def test_prepare_is_idempotent_and_class_untouched():
    h = Harness()
    h.prepare()
    again = h.prepare()
    assert again.layers == [] and len(h.rt.states) == 2
    assert "apply" not in vars(Exl3MoEMethod()) and Exl3MoEMethod.apply is not h.layers[0][1].quant_method.apply


# --- tables and scratch -------------------------------------------------------------------------------


def test_pointer_tables_name_each_slice():
    m, _ = make_layer()
    g = md.validate_layer(m, Exl3MoEMethod(), require_cuda=False)
    t = md.pointer_tables(m, g)
    assert list(t) == list(md.TABLES)
    assert t["up_trellis"].tolist() == [m.w13_trellis[e, 1].data_ptr() for e in range(E)]
    assert t["down_svh"].tolist() == [m.w2_svh[e].data_ptr() for e in range(E)]


def test_scratch_zeroed_shared_and_never_made_during_capture():
    capturing = [False]
    pool = md.ScratchPool(capturing=lambda: capturing[0])
    a = pool.ensure(torch.device("cpu"), 100)
    assert int(a.count_nonzero()) == 0 and pool.ensure(torch.device("cpu"), 50) is a
    capturing[0] = True
    with pytest.raises(RuntimeError, match="before graph capture"):
        pool.ensure(torch.device("cpu"), 1000)
    assert pool.ensure(torch.device("cpu"), 100) is a  # no growth needed: fine while capturing
    capturing[0] = False
    b = pool.ensure(torch.device("cpu"), 1000)
    assert b is not a and pool.bytes_resident() == 1100  # the old one stays alive


def test_layers_share_one_scratch_sized_for_the_largest():
    h = Harness()
    h.prepare()
    s = h.rt.scratch.get(torch.device("cpu"))
    assert s is not None and s.numel() == 8192


def test_every_layer_is_checked_against_the_builds_limits():
    """Two layers of one geometry: the second's top-k (set after the first was made ready) is above
    the build's max_top_k and must be refused too, not waved through by a per-geometry cache."""
    h = Harness(strict=0)
    h.ext.lna2_moe_info = lambda bits, codebook=1, hidden=H, inter=I: {"scratch_bytes": 8192, "max_top_k": TOP_K,
                                                                        "max_experts": 256}
    h.layers[1][1].top_k = TOP_K + 1
    summary = h.prepare()
    assert summary.lna2_layers == 1
    assert any(f"top_k {TOP_K + 1} above the build's max_top_k {TOP_K}" in r for r in summary.not_ready)


# --- shared memory per block (sm_120 cards allow 99 KB) -------------------------------------------


def test_the_device_fit_is_asked_once_per_shape_with_the_layers_own_facts():
    """Two layers of one shape: one lna2_moe_fit query per build the policy may pick for it, with the
    layer's bits, codebook, hidden, intermediate, top-k and local expert count; where every build
    fits (an H200) nothing is said about it."""
    h = Harness()
    assert h.prepare().lna2_layers == 2
    assert h.grep("lna2 fit") == []
    from dsv4serve.lna2 import policy

    cb = 1  # make_layer's mcg
    assert h.ext.fit_queries == [(v, 2, cb, H, I, TOP_K, E) for v in policy.served(I, H)]


def test_a_device_where_no_build_fits_is_not_ready_with_the_reason(tmp_path):
    """v55 (which takes every shape) not fitting at one row: the layer is declined at load, said
    once, and every call goes to the incumbent; strict refuses at load instead."""
    h = Harness(fit={55: 0}, tmp_path=tmp_path)
    s = h.prepare()
    assert s.lna2_layers == 0
    (reason,) = s.not_ready
    assert reason.startswith("no lna2 build fits this device's shared memory per block for bits=2 "
                             f"hidden={H} intermediate={I}"), reason
    h.call(0, 1)
    assert h.ext.seen == [] and h.counters.calls == {"lna2": 0, "incumbent": 1}
    assert h.grep("dsv4serve plugin lna2 fit") == [f"dsv4serve plugin lna2 fit rank=0/1 bits=2 hidden={H} "
                                                   f"intermediate={I}: v55 fits 0 of {CEILING} rows (shared memory "
                                                   "per block); the policy serves the next build that fits"]
    with pytest.raises(md.Lna2NotReadyError, match="no lna2 build fits this device's shared memory"):
        Harness(fit={55: 0}, strict=1).prepare()


def test_rows_past_what_fits_are_declined_not_launched(tmp_path):
    """v55 fits four rows here: five are a decline (strict 0) or an error (strict 1), never a launch
    the driver would refuse mid-step."""
    h = Harness(fit={55: 4}, tmp_path=tmp_path)
    h.prepare()
    h.call(0, 4)
    h.call(0, 5)
    assert [s["rows"] for s in h.ext.seen] == [4]
    assert h.counters.calls == {"lna2": 1, "incumbent": 1}
    assert any("rows=5 need more shared memory per block than this device has for v55 (it fits 4 rows)" in ln
               for ln in h.lines), h.lines
    h.call(0, 6)  # another row count past the fit is the same cause: one counter, logged once
    assert h.counters.declines == {"rows past the shared memory this device has for the build": 2}
    assert len(h.grep("need more shared memory")) == 1
    with pytest.raises(md.Lna2NotReadyError, match="holds v55 for 4 rows"):  # strict: at load (below)
        Harness(fit={55: 4}, strict=1).prepare()


def test_on_a_99_kb_card_a_k3_layer_goes_to_the_builds_that_fit(monkeypatch):
    """A shape the cluster kernel takes (1024 wide) at K3 with an sm_120's fit: one row goes to v59,
    two and more to v55 (v59 fits one row only), as policy.variant_for says, and every call is
    computed."""
    monkeypatch.setattr(sys.modules[__name__], "H", 1024)
    h = Harness(fit={59: 1, 55: 32}, n_layers=1)
    m3, el3 = make_layer(K=3, seed=5)  # the harness's layer is K2: this test's one layer is K3
    m3.quant_method = Exl3MoEMethod()
    h.layers = [("model.layers.1.mlp.experts", m3, el3)]
    h.ext.layers = [(m3, el3)]
    assert h.prepare().lna2_layers == 1
    for rows in (1, 2, 3):
        out, want = h.call(0, rows)
        torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2e-2)
    assert [s["variant"] for s in h.ext.seen] == [59, 55, 55]
    assert h.grep("lna2 fit") == ["dsv4serve plugin lna2 fit rank=0/1 bits=3 hidden=1024 intermediate=128: v59 fits 1 "
                                  "of 24 rows (shared memory per block); the policy serves the next build that fits"]


def test_the_worker_recounts_decode_rows_from_the_config_vllm_resolved():
    """The launcher counts from the profile; vLLM fills in a left-out speculative token count and
    pads a decode step to its CUDA-graph capture size. Counted from the profile alone, a seat whose
    every decode step ran above the build's ceiling passed the load-time refusal (helper audit)."""
    from types import SimpleNamespace as NS

    from vllm.config import CompilationConfig, CUDAGraphMode, SchedulerConfig

    from dsv4serve.vllm_plugin import with_vllm_decode_rows

    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=2048, is_encoder_decoder=False)
    env = md.PluginEnv(run_id="t1", run_dir=None, kernel="lna2", strict=1, decode_rows=8)  # k left out: 8 x 1
    eager = NS(enforce_eager=True)
    cfg = NS(scheduler_config=sched, speculative_config=NS(num_speculative_tokens=3), model_config=eager,
             compilation_config=CompilationConfig())
    got = with_vllm_decode_rows(env, cfg)
    assert (got.decode_rows, got.decode_rows_why) == (32, "vLLM's max_num_seqs 8 x (1 + 3 speculative tokens)")
    h = Harness(strict=1, ceiling=24)
    h.rt.env = got  # what _after_load hands the Runtime it makes
    with pytest.raises(md.Lna2NotReadyError, match=r"at most 24 rows a call but this seat decodes 32 \(vLLM's max_num_"
                                                   r"seqs 8 x \(1 \+ 3 speculative tokens\)\)"):
        h.prepare()

    # 4 streams x 4 = 16 rows replay the graph captured at 32 (graphs on), not at 16 (eager)
    sched4 = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=2048, is_encoder_decoder=False)
    comp = CompilationConfig(cudagraph_capture_sizes=[4, 8, 32], cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    env16 = md.PluginEnv(run_id="t1", run_dir=None, kernel="lna2", strict=1, decode_rows=16)
    spec = NS(num_speculative_tokens=3)
    graphs = with_vllm_decode_rows(env16, NS(scheduler_config=sched4, speculative_config=spec,
                                             model_config=NS(enforce_eager=False), compilation_config=comp))
    assert graphs.decode_rows == 32 and graphs.decode_rows_why.endswith("replayed in the CUDA graph captured at 32 rows")
    for model, mode in ((eager, CUDAGraphMode.FULL_AND_PIECEWISE), (NS(enforce_eager=False), CUDAGraphMode.NONE)):
        plain = CompilationConfig(cudagraph_capture_sizes=[4, 8, 32], cudagraph_mode=mode)
        assert with_vllm_decode_rows(env16, NS(scheduler_config=sched4, speculative_config=spec, model_config=model,
                                               compilation_config=plain)) is env16
    # the launcher's count is never lowered, and a config the plugin does not know leaves it as it is
    assert with_vllm_decode_rows(env16, NS(scheduler_config=NS(max_num_seqs=2))).decode_rows == 16
    assert with_vllm_decode_rows(env16, None) is env16


def test_strict_refuses_at_load_a_device_that_cannot_launch_the_seats_decode_rows():
    """v55 fitting fewer rows than the seat decodes was found per call, in the middle of serving or
    of graph capture, though strict promises a refusal at load (helper review of the kernel)."""
    with pytest.raises(md.Lna2NotReadyError, match=r"holds v55 for 4 rows .* this seat decodes 8 rows a call"):
        Harness(fit={55: 4}, strict=1, decode_rows=8).prepare()
    # a prefill chunk between the decode rows and the ceiling goes to lna2 too (review): refused at
    # load, with the ceiling a build would need
    with pytest.raises(md.Lna2NotReadyError, match=r"holds v55 for 8 rows .* 9 would not launch; build lna2 with "
                                                   r"`dsv4serve kernel build --max-rows 8`"):
        Harness(fit={55: 8}, strict=1, decode_rows=8).prepare()
    assert Harness(fit={55: CEILING}, strict=1, decode_rows=8).prepare().lna2_layers == 2
    assert Harness(fit={55: 4}, strict=0, decode_rows=8).prepare().lna2_layers == 2  # declined per call there


def test_vllm_micro_batching_is_refused_at_load_since_both_micro_batches_would_share_one_scratch():
    """vLLM's micro-batching runs each micro-batch's MoE calls from a thread of its own with a slice of
    the batch, which the dispatch's parity check and per-size graph record do not model (dispatch
    audit; vLLM 0.32's ubatching.py). The worker reads it from the config vLLM resolved and refuses
    at load."""
    from types import SimpleNamespace as NS

    from vllm.config import ParallelConfig

    from dsv4serve.vllm_plugin import with_vllm_ubatches

    env = md.PluginEnv(run_id="t1", run_dir=None, kernel="lna2", strict=1)
    assert with_vllm_ubatches(env, NS(parallel_config=ParallelConfig())) is env
    assert with_vllm_ubatches(env, None) is env
    assert with_vllm_ubatches(env, NS(parallel_config=NS(enable_dbo=True, ubatch_size=0))).ubatches == 2
    assert with_vllm_ubatches(env, NS(parallel_config=NS(enable_dbo=False, ubatch_size=3))).ubatches == 3
    h = Harness(strict=1)
    h.rt.env = with_vllm_ubatches(h.env, NS(parallel_config=NS(enable_dbo=True, ubatch_size=0)))
    with pytest.raises(md.Lna2NotReadyError, match=r"vLLM splits each step into 2 micro-batches \(--enable-dbo / "
                                                   r"--ubatch-size\), whose MoE calls come from threads"):
        h.prepare()
    h = Harness(strict=0)
    h.rt.env = with_vllm_ubatches(h.env, NS(parallel_config=NS(enable_dbo=True, ubatch_size=0)))
    assert h.prepare().lna2_layers == 0  # strict 0: the incumbent serves, said once
    assert [ln for ln in h.lines if "micro-batches" in ln][0].startswith("LNA2 declined: lna2 not ready: rank=0/1")
    out, want = h.call(0, 2)
    assert torch.equal(out, want) and not h.ext.seen
