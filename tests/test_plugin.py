"""The vLLM glue (dsv4serve.vllm_plugin) with the installed vLLM, no server.

Each case runs in a fresh interpreter: register() patches vLLM's BaseModelLoader for the rest
of the process, which must not leak into this test process. The "model load" is a stand-in:
BaseModelLoader.load_model is replaced *before* register() wraps it by a function returning a
tiny module whose MoE layer has a real `FusedMoEMethodBase` subclass as quant method, so the
plugin's own hook, layer discovery, lines and counters run exactly as in a worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.model_loader import base_loader

    class Toy(FusedMoEMethodBase):
        def __init__(self):
            super().__init__(moe=None)
        def create_weights(self, *a, **k): pass
        def get_fused_moe_quant_config(self, layer): return None
        def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
            return x * 2

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.quant_method = Toy()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), Experts(), Experts()])

    def fake_load_model(self, vllm_config=None, model_config=None, prefix=""):
        return Model()

    base_loader.BaseModelLoader.load_model = fake_load_model
    from dsv4serve.vllm_plugin import register
    register()
    register()  # vLLM may call it again: nothing doubles
    hooked = base_loader.BaseModelLoader.load_model
    print("HOOKED", getattr(hooked, "_dsv4serve_hook", False), getattr(hooked, "__wrapped__", None) is fake_load_model)
    print("IMPORTED", "dsv4serve.moe_dispatch" in sys.modules)
    if getattr(hooked, "_dsv4serve_hook", False):
        target = hooked(object())
        draft = hooked(object())
        x = torch.ones(3, 4)
        out = target.layers[1].quant_method.apply(layer=target.layers[1], x=x, topk_weights=None, topk_ids=None)
        assert torch.equal(out, x * 2)
        draft.layers[2].quant_method.apply(target.layers[2], x, None, None)
        print("CALLED")
    sys.stdout.flush()
""")


def _run(tmp_path: Path, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4SERVE_", "VLLM_EXL3_"))}
    env.update({"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", **env_extra})
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)


def test_inert_without_run_id(tmp_path):
    r = _run(tmp_path, {"DSV4SERVE_MOE_KERNEL": "lna2", "VLLM_EXL3_MOE_STRICT": "1",
                        "DSV4SERVE_RUN_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "HOOKED False False" in r.stdout and "IMPORTED False" in r.stdout
    assert "dsv4serve" not in r.stdout.replace("dsv4serve.moe_dispatch", "") and "dsv4serve" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_hook_ready_draft_and_counters(tmp_path):
    run_dir = tmp_path / "run"
    r = _run(tmp_path, {"DSV4SERVE_RUN_ID": "t-plugin", "DSV4SERVE_RUN_DIR": str(run_dir),
                        "DSV4SERVE_MOE_KERNEL": "incumbent", "VLLM_EXL3_MOE_STRICT": "0"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "HOOKED True True" in r.stdout and "CALLED" in r.stdout
    # the API-server-style process (MainProcess) announces on stderr, once
    assert r.stderr.count("dsv4serve plugin loaded proc=MainProcess run=t-plugin kernel=incumbent strict=0") == 1
    ready = [ln for ln in r.stdout.splitlines() if "dsv4serve plugin ready" in ln]
    assert len(ready) == 1
    assert ready[0].endswith("dsv4serve plugin ready rank=0/1 moe_layers=2 moe_method=Toy kernel=incumbent")
    assert len([ln for ln in r.stdout.splitlines() if "dsv4serve plugin draft rank=0/1 moe_layers=2" in ln]) == 1
    data = json.loads((run_dir / "counters-rank0.json").read_text())
    assert data["calls"] == {"lna2": 0, "incumbent": 2} and data["layers"] == 4
    assert data["final"] is True and data["kernel"] == "incumbent" and data["pid"] > 0


def test_strict1_lna2_fails_the_load(tmp_path):
    r = _run(tmp_path, {"DSV4SERVE_RUN_ID": "t-plugin", "DSV4SERVE_RUN_DIR": str(tmp_path / "run"),
                        "DSV4SERVE_MOE_KERNEL": "lna2", "VLLM_EXL3_MOE_STRICT": "1"})
    assert r.returncode != 0
    want = ("lna2 not ready: rank=0/1 layer=layers.1: quant method Toy is not vllm-exl3's Exl3MoEMethod "
            "(no EXL3 routed experts for lna2 to serve)")
    assert f"Lna2NotReadyError: {want}" in r.stderr
    assert f"dsv4serve plugin FAILED {want} (VLLM_EXL3_MOE_STRICT=1)" in r.stdout
    assert "dsv4serve plugin ready" not in r.stdout


def test_bad_env_fails_closed_at_load(tmp_path):
    # (every bad value is covered by test_moe_dispatch.test_env_fails_closed; this is the wiring)
    r = _run(tmp_path, {"DSV4SERVE_RUN_ID": "t-plugin", "DSV4SERVE_MOE_KERNEL": "lna3"})
    assert r.returncode != 0 and "PluginConfigError" in r.stderr
    assert "config error" in r.stderr  # announced at register() time too
