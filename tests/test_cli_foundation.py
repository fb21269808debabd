"""The CLI surface of the foundation: dry runs, profile listings, bad input, the demo model."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4serve import launch, vllm_args
from dsv4serve.errors import ProfileError
from dsv4serve.profile import load_profile, shipped_profiles

from tests.test_profile import CANON_ENV

CLI = [sys.executable, "-m", "dsv4serve"]


def run(*args, timeout=120, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=e)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_canon_dry_run_json_passes_vllm_parser(home):
    r = run("up", "--profile", "8x16gb-380k", "--dry-run", "--json", env={"DSV4SERVE_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert {"argv", "env", "runtime", "gates"} <= set(plan)
    assert plan["runtime"] == "docker"
    argv = plan["argv"]
    for flag in ("--max-model-len", "389120", "--max-num-seqs", "--max-num-batched-tokens", "512", "--kv-cache-dtype",
                 "fp8", "--gpu-memory-utilization", "0.97", "--disable-custom-all-reduce", "--quantization", "exl3",
                 "--trust-remote-code", "--served-model-name", "DSV4-Flash", "--enable-auto-tool-choice",
                 "--tool-call-parser", "--reasoning-parser", "deepseek_v4", "--speculative-config"):
        assert flag in argv, flag
    joined = " ".join(argv)
    for k, v in CANON_ENV.items():
        assert f"{k}={v}" in joined, k
    assert "EXLLAMAV3_TUNE_CACHE=" in joined
    assert plan["gates"]["markers"][0] == {"text": "LNA2 MoE kernel ACTIVE", "ranks": 8}
    assert plan["gates"]["kv_cache_min_tokens"] == 389120
    assert plan["vllm_parser"]["checked"] is True, plan["vllm_parser"]
    assert not list(home.glob("runs/*")) if home.exists() else True   # a dry run starts and writes nothing


def test_every_shipped_profile_parses_with_vllm(tmp_path):
    for name in shipped_profiles():
        spec = launch.build(load_profile(name), run_id="r", run_dir=tmp_path)
        res = vllm_args.validate(spec.vllm_args, name)
        assert res.available, res.detail


def test_vllm_parser_rejections_become_one_line_errors(tmp_path):
    bad_flag = launch.build(load_profile("cpu-demo", ["vllm.extra_args=[--no-such-flag]"]), "r", tmp_path)
    with pytest.raises(ProfileError) as e:
        vllm_args.validate(bad_flag.vllm_args, "cpu-demo")
    assert "unrecognized arguments: --no-such-flag" in e.value.line()
    bad_choice = launch.build(load_profile("cpu-demo", ["vllm.kv_cache_dtype=int3"]), "r", tmp_path)
    with pytest.raises(ProfileError, match="kv-cache-dtype"):
        vllm_args.validate(bad_choice.vllm_args, "cpu-demo")
    bad_parser = launch.build(load_profile("8x16gb-380k", ["vllm.tool_call_parser=deepseek_v9"]), "r", tmp_path)
    with pytest.raises(ProfileError) as e:
        vllm_args.validate(bad_parser.vllm_args, "8x16gb-380k")
    assert "vllm.tool_call_parser: 'deepseek_v9'" in e.value.line()


@pytest.mark.parametrize("override, needle", [
    ("vllm.max_num_seq=4", "did you mean 'vllm.max_num_seqs'"),
    ("vllm.max_num_seqs=eight", "vllm.max_num_seqs"),
    ("vllm.max_num_seqs=8", "32 decode rows exceed the lna2 row ceiling 24"),
])
def test_bad_profiles_exit_2_with_one_line(home, override, needle):
    r = run("up", "--profile", "8x16gb-380k", "--set", override, "--dry-run", "--no-validate",
            env={"DSV4SERVE_HOME": str(home)})
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_missing_profile_file_exits_2(home):
    r = run("up", "--profile", "/nonexistent/seat.yaml", "--dry-run", env={"DSV4SERVE_HOME": str(home)})
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_profiles_list_and_show(home):
    r = run("profiles", "list", "--json")
    assert r.returncode == 0
    names = {row["name"] for row in json.loads(r.stdout)}
    assert {"8x16gb-380k", "cpu-demo"} <= names
    r = run("profiles", "show", "8x16gb-380k-incumbent", "--json")
    data = json.loads(r.stdout)
    assert data["moe"]["kernel"] == "incumbent" and data["vllm"]["max_model_len"] == 389120


def test_every_command_has_help():
    for cmd in ("up", "down", "status", "logs", "demo-model", "check-seat", "profiles", "patch", "bench", "kernel"):
        r = run(cmd, "--help")
        assert r.returncode == 0 and "Usage" in r.stdout, cmd


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in d.iterdir() if p.is_file()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def test_demo_model_is_deterministic_and_complete(tmp_path):
    from dsv4serve.demo_model import ensure_demo_model, is_complete

    a = ensure_demo_model(tmp_path / "a", seed=3)
    b = ensure_demo_model(tmp_path / "b", seed=3)
    assert is_complete(a, 3) and _digest(a) == _digest(b)
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576        # CPU MLA needs a 576-wide latent
    assert cfg["num_attention_heads"] % 2 == 0 and cfg["num_nextn_predict_layers"] == 1
    tok = json.loads((a / "tokenizer_config.json").read_text())
    assert "chat_template" in tok
    from safetensors import safe_open

    with safe_open(str(a / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    n = cfg["num_hidden_layers"]
    assert f"model.layers.{n}.eh_proj.weight" in keys and f"model.layers.{n}.shared_head.head.weight" in keys
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in keys
    # reuse: a complete model is not rebuilt
    mtime = (a / "model.safetensors").stat().st_mtime
    ensure_demo_model(a, seed=3)
    assert (a / "model.safetensors").stat().st_mtime == mtime
