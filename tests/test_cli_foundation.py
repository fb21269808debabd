"""The CLI surface of the foundation: dry runs, profile listings, bad input, the demo model."""

from __future__ import annotations

import hashlib
import json
import os
import re
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
    assert plan["gates"]["markers"][0] == {"text": "LNA2 MoE kernel ACTIVE rank=", "ranks": 8}
    assert plan["gates"]["kv_cache_min_tokens"] == 389120
    assert plan["vllm_parser"]["checked"] is True, plan["vllm_parser"]
    # this machine's vLLM is not the image's (stack.vllm): up skips the check, and the plan says so
    assert "is not the image's stack.vllm >=0.28,<0.29" in plan["vllm_parser"]["up_skips"]
    assert "advice only: up skips this check" in plan["vllm_parser"]["detail"]
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
    # the table at 80 columns (a pipe, not a terminal) keeps every name whole: they are what
    # users copy into --profile
    r = run("profiles", "list", env={"DSV4SERVE_HOME": str(home), "COLUMNS": "80"})
    assert r.returncode == 0 and all(n in r.stdout for n in names), r.stdout


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


# --- bad input at the CLI: one line, exit 2, nothing of the user's touched --------------------


def _one_line_exit_2(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_demo_model_never_deletes_a_directory_that_is_not_a_demo_model(home, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    for extra in ([], ["--force"]):
        line = _one_line_exit_2(run("demo-model", "--out", str(mine), *extra, env={"DSV4SERVE_HOME": str(home)}))
        assert "not empty" in line and "nothing was changed" in line
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"] and (mine / "thesis.tex").read_text() == "years of work"
    # a stamp that is not ours is named as such, not reported missing; still nothing is touched
    from dsv4serve.demo_model import STAMP

    (mine / STAMP).write_text("{corrupt")
    line = _one_line_exit_2(run("demo-model", "--out", str(mine), env={"DSV4SERVE_HOME": str(home)}))
    assert f"its {STAMP} is not a demo model's stamp" in line and "nothing was changed" in line
    assert sorted(p.name for p in mine.iterdir()) == sorted([STAMP, "thesis.tex"])


def test_demo_model_refuses_a_file_and_out_of_range_seeds(home, tmp_path):
    f = tmp_path / "f"
    f.write_text("keep")
    assert "is a file" in _one_line_exit_2(run("demo-model", "--out", str(f), env={"DSV4SERVE_HOME": str(home)}))
    assert f.read_text() == "keep"
    for seed in ("99999999999999999999", "-1"):
        line = _one_line_exit_2(run("demo-model", "--seed", seed, "--out", str(tmp_path / "m"),
                                    env={"DSV4SERVE_HOME": str(home)}))
        assert "out of range" in line and "0 to 4294967295" in line
    assert not (tmp_path / "m").exists()


def test_demo_model_replaces_only_its_own_files(tmp_path, monkeypatch):
    from dsv4serve import demo_model

    def tiny(out: Path, seed: int) -> None:  # the layout without the seconds of training and init
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.safetensors").write_text(f"weights {seed}")
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(demo_model, "_write", tiny)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert demo_model.ensure_demo_model(empty, seed=1) == empty and demo_model.is_complete(empty, 1)
    (empty / "notes.txt").write_text("mine")
    demo_model.ensure_demo_model(empty, seed=2)  # another seed: our files replaced, the user's kept
    assert demo_model.is_complete(empty, 2) and (empty / "model.safetensors").read_text() == "weights 2"
    assert (empty / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in empty.iterdir()) == ["config.json", "dsv4serve-demo.json", "model.safetensors",
                                                       "notes.txt"]


def test_a_state_dir_that_is_a_file_is_one_line(tmp_path):
    f = tmp_path / "home-file"
    f.write_text("not a dir")
    # (`patch apply` goes through the same check; it is left out here so a regression could
    # never patch the installed vLLM from a unit test.)
    for args in (["up", "--profile", "cpu-demo", "--skip-checks"], ["demo-model"], ["status"]):
        line = _one_line_exit_2(run(*args, env={"DSV4SERVE_HOME": str(f / "sub")}))
        assert f"state dir {f / 'sub'} is not a directory" in line and "set DSV4SERVE_HOME" in line, args
    assert f.read_text() == "not a dir"


def test_a_read_only_state_dir_is_bad_input(tmp_path, monkeypatch):
    from dsv4serve import home as home_mod
    from dsv4serve.errors import BadInput

    # Root ignores mode bits, so stand in for a read-only mount at both checks.
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "h"))
    monkeypatch.setattr(home_mod.os, "access", lambda *a, **k: False)
    with pytest.raises(BadInput) as e:
        home_mod.seats_dir()
    assert "is not writable" in e.value.line() and "set DSV4SERVE_HOME to a writable directory" in e.value.line()
    monkeypatch.setenv("DSV4SERVE_RUN_ID", "r1")  # a seat's own workers only read it: never fail them
    assert home_mod.cache_dir() == tmp_path / "h" / "cache"
    monkeypatch.undo()

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(BadInput, match=r"not writable \(Permission denied\)"):
        home_mod.ensure(tmp_path / "runs")


def test_profile_file_not_utf8_or_a_directory_is_one_line(home, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfename: x\n")
    env = {"DSV4SERVE_HOME": str(home)}
    for args in (["profiles", "show", str(bad)], ["up", "--profile", str(bad), "--dry-run"],
                 ["check-seat", "--profile", str(bad)]):
        assert "bad.yaml is not UTF-8" in _one_line_exit_2(run(*args, env=env)), args
    assert "is a directory" in _one_line_exit_2(run("profiles", "show", str(tmp_path), env=env))


def test_bad_seat_name_writes_nothing_outside_home(home, tmp_path):
    line = _one_line_exit_2(run("up", "--profile", "cpu-demo", "--set", "name=../../escape", "--skip-checks",
                                env={"DSV4SERVE_HOME": str(home)}))
    assert "name:" in line
    assert not (tmp_path / "escape").exists() and not home.exists()


@pytest.mark.parametrize("argv, needle", [
    (["up", "--bogus"], "No such option: --bogus"),
    (["up"], "Missing option '--profile'"),
    (["logs", "--lines", "-5"], "'--lines'"),
    (["down", "--grace", "-1"], "'--grace'"),
    (["down", "--grace", "nan"], "nan is not a number of seconds from 0 to 3600"),
    (["down", "--grace", "inf"], "inf is not a number of seconds from 0 to 3600"),
    # typer reads '' as Path('.'): an unset shell variable would have written into the working dir
    (["demo-model", "--out", ""], "'--out': is empty"),
    (["kernel", "build", "--out", ""], "'--out': is empty"),
    (["bench", "--out", ""], "'--out': is empty"),
    (["bench", "needle", "--out", " "], "'--out': is empty"),
    (["nonexist"], "No such command 'nonexist'"),
])
def test_usage_errors_are_one_line_with_exit_2(home, argv, needle):
    """An unknown flag, a missing option or a value out of range is one line naming it and where
    the help is, exit 2, like every other refusal (not a boxed multi-line panel)."""
    r = run(*argv, env={"DSV4SERVE_HOME": str(home)})
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0] and "--help" in lines[0], r.stderr


def test_an_interrupted_demo_build_does_not_lock_its_directory(home, tmp_path):
    """A build killed mid-way leaves its temp dir, or a swap killed after the stamp went, leaves our
    files without a stamp: the next run must take the directory back, not call it someone else's."""
    out = tmp_path / "demo"
    out.mkdir()
    (out / ".demo-killed").mkdir()  # a build dir that was never cleaned up
    (out / "config.json").write_text("{}")  # half a swap, no stamp
    r = run("demo-model", "--out", str(out), env={"DSV4SERVE_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert (out / "dsv4serve-demo.json").is_file() and (out / "model.safetensors").is_file()
    # the same names without our build dir are someone's model (a Hugging Face directory): refused
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"real": true}')
    r = run("demo-model", "--out", str(hf), "--force", env={"DSV4SERVE_HOME": str(home)})
    assert r.returncode == 2 and (hf / "config.json").read_text() == '{"real": true}'


@pytest.mark.parametrize("argv, kind, needle", [
    (["up", "--profile", "8x16gb-380k", "--set", "vllm.max_num_seqs=eight", "--dry-run", "--no-validate", "--json"],
     "ProfileError", "vllm.max_num_seqs"),
    (["profiles", "show", "/nonexistent/seat.yaml", "--json"], "ProfileError", "does not exist"),
    (["status", "--json", "--bogus"], "UsageError", "No such option: --bogus"),
    (["patch", "status", "--root", "/nonexistent/site", "--json"], None, "/nonexistent/site"),
])
def test_json_callers_get_the_error_as_one_json_document(home, argv, kind, needle):
    """A machine that asked for --json reads the refusal from stdout as JSON (type, message, hint,
    exit code); a person still gets the one line on stderr, and the exit code is the same."""
    r = run(*argv, env={"DSV4SERVE_HOME": str(home)})
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = json.loads(r.stdout)["error"]
    assert err["exit_code"] == 2 and needle in err["message"] + (err["hint"] or ""), err
    if kind:
        assert err["type"] == kind
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and err["message"] in lines[0], r.stderr


def test_live_up_json_reports_its_error_as_one_more_event_line(home):
    """`up --json` (not a dry run) streams event lines, so its refusal is an event line too."""
    r = run("up", "--profile", "/nonexistent/seat.yaml", "--json", env={"DSV4SERVE_HOME": str(home)})
    assert r.returncode == 2
    events = [json.loads(ln) for ln in r.stdout.splitlines() if ln.strip()]
    assert events[-1]["event"] == "error" and events[-1]["type"] == "ProfileError"
    assert "does not exist" in events[-1]["message"] and events[-1]["exit_code"] == 2


def test_without_json_errors_leave_stdout_empty(home):
    r = run("profiles", "show", "/nonexistent/seat.yaml", env={"DSV4SERVE_HOME": str(home)})
    assert r.returncode == 2 and r.stdout == "" and "does not exist" in r.stderr


@pytest.mark.parametrize("group", [[], ["profiles"], ["kernel"], ["patch"]])
def test_a_bare_command_group_prints_its_help_once_and_exits_2(home, group):
    """typer builds the no-arguments error from a help call that under rich prints the help
    itself: printing the error's text as well showed every group's help twice."""
    r = run(*group)
    assert r.returncode == 2
    assert (r.stdout + r.stderr).count("Usage:") == 1, r.stdout


def test_an_option_missing_its_value_points_at_its_own_commands_help(home):
    """click fails such an option before any context exists: the hint must still name the
    subcommand, and live `up --json` (an event stream) must get one more event line, not an
    indented document."""
    r = run("up", "-p")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "error: Option '-p' requires an argument. (see `dsv4serve up --help`)"
    r = run("kernel", "build", "--arch")
    assert r.stderr.strip() == "error: Option '--arch' requires an argument. (see `dsv4serve kernel build --help`)"
    r = run("up", "--json", "-p")
    (line,) = r.stdout.splitlines()
    ev = json.loads(line)
    assert ev["event"] == "error" and ev["type"] == "UsageError" and ev["hint"] == "see `dsv4serve up --help`"
    r = run("up", "--dry-run", "--json", "-p")  # the dry run prints one document, so its error is one too
    assert json.loads(r.stdout)["error"]["exit_code"] == 2
    r = run("--bogus", "up", "--json", "-p", "cpu-demo")  # the root's own option: the root's help, no up event
    assert re.fullmatch(r"error: No such option: --bogus \(see `(python -m )?dsv4serve --help`\)", r.stderr.strip())
    assert json.loads(r.stdout)["error"]["type"] == "UsageError"


def test_a_damaged_demo_model_is_rebuilt_not_called_ready(tmp_path, monkeypatch):
    """`demo-model` said "ready" for a directory whose weights were emptied and config deleted,
    because only the stamp and the weights' name were looked at."""
    from dsv4serve import demo_model

    def tiny(out: Path, seed: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.safetensors").write_text(f"weights {seed}")
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(demo_model, "_write", tiny)
    out = tmp_path / "m"
    demo_model.ensure_demo_model(out, seed=1)
    assert demo_model.is_complete(out, 1)
    (out / "model.safetensors").write_text("")
    assert not demo_model.is_complete(out, 1)
    demo_model.ensure_demo_model(out, seed=1)
    assert demo_model.is_complete(out, 1) and (out / "model.safetensors").read_text() == "weights 1"
    (out / "config.json").unlink()
    assert not demo_model.is_complete(out, 1)
    demo_model.ensure_demo_model(out, seed=1)
    assert (out / "config.json").is_file() and demo_model.is_complete(out, 1)
