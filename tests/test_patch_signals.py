"""A patch change stopped part-way (SIGTERM, SIGHUP, Ctrl-C, a second signal during the rollback,
an edit made meanwhile) leaves no file half changed. In-process, on a synthetic three-file set:
the signal is sent by the test itself at a chosen write, which is where a real one can land."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsv4serve import patches

FILES = ["a.py", "b.py", "c.py"]
PRISTINE = b"x\ny\nz\n"
PATCHED = b"x\nY\nz\n"


def _diff(package: str, name: str) -> bytes:
    return f"--- a/{package}/{name}\n+++ b/{package}/{name}\n@@ -1,3 +1,3 @@\n x\n-y\n+Y\n z\n".encode()


def _add_set(sets: Path, root: Path, name: str, package: str, files: list[str]) -> None:
    """Set `name` under `sets` (y becomes Y in each file of `package` 1.0), and the package installed
    pristine in `root` with its dist-info."""
    folder = sets / name
    folder.mkdir(parents=True)
    for f in files:
        (folder / f"{f}.diff").write_bytes(_diff(package, f))
    (folder / "manifest.yaml").write_text(json.dumps({
        "set": folder.name, "package": package, "distributions": [package], "version": "1.0",
        "pip_requirement": f"{package}==1.0",
        "files": [{"path": f"{package}/{f}", "diff": f"{f}.diff", "pristine_sha256": patches.sha256_bytes(PRISTINE),
                   "patched_sha256": patches.sha256_bytes(PATCHED), "fixes": "y becomes Y", "prevents": "a test"}
                  for f in files]}))
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    for f in files:
        (root / package / f).write_bytes(PRISTINE)
    info = root / f"{package}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(f"{package}\n")


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(patches, "patches_dir", lambda: tmp_path / "sets")
    root = tmp_path / "site"
    _add_set(tmp_path / "sets", root, "sig-1.0", "sigpkg", FILES)
    return root


def _contents(root: Path) -> list[bytes]:
    return [(root / "sigpkg" / f).read_bytes() for f in FILES]


def _cli(*args: str):
    from dsv4serve.cli import app

    return CliRunner().invoke(app, ["patch", *args])


def _on_tree_write(monkeypatch: pytest.MonkeyPatch, root: Path, n: int, act) -> list[Path]:
    """Run `act(path)` just before the n-th write of a file in the tree (backups are not counted)."""
    real, seen = patches._atomic_write, []

    def spy(path: Path, data: bytes) -> None:
        if path.is_relative_to(root):
            seen.append(path)
            if len(seen) == n:
                act(path)
        real(path, data)

    monkeypatch.setattr(patches, "_atomic_write", spy)
    return seen


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_mid_apply_restores_every_file_and_says_so(tree, monkeypatch, sig):
    _on_tree_write(monkeypatch, tree, 3, lambda p: os.kill(os.getpid(), sig))
    r = _cli("apply", "-s", "sig-1.0", "--root", str(tree))
    assert r.exit_code == 128 + sig, r.output
    assert f"patch apply stopped by {signal.Signals(sig).name}; the sets it had changed were taken back" in \
        " ".join(r.output.split())
    assert _contents(tree) == [PRISTINE] * 3
    assert signal.getsignal(sig) is signal.default_int_handler or signal.getsignal(sig) in (signal.SIG_DFL, None)


def test_a_signal_mid_revert_patches_every_file_again(tree, monkeypatch):
    assert _cli("apply", "-s", "sig-1.0", "--root", str(tree)).exit_code == 0
    _on_tree_write(monkeypatch, tree, 2, lambda p: os.kill(os.getpid(), signal.SIGTERM))
    r = _cli("revert", "-s", "sig-1.0", "--root", str(tree))
    assert r.exit_code == 143 and "patch revert stopped by SIGTERM" in r.output
    assert _contents(tree) == [PATCHED] * 3


@pytest.mark.parametrize("other_thread", [False, True])
def test_a_second_signal_during_the_rollback_waits_for_it(tree, monkeypatch, other_thread):
    """With another thread alive the kernel may hand the signal to it (a signal mask in the main
    thread alone held nothing then: this case failed when the test suite's HTTP threads were up)."""
    import threading

    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    if other_thread:
        t.start()
    # the first TERM lands before the third file; the rollback's first write draws a second
    _on_tree_write(monkeypatch, tree, 3, lambda p: os.kill(os.getpid(), signal.SIGTERM))
    seen = _on_tree_write(monkeypatch, tree, 4, lambda p: os.kill(os.getpid(), signal.SIGTERM))
    try:
        r = _cli("apply", "-s", "sig-1.0", "--root", str(tree))
    finally:
        stop.set()
    assert r.exit_code == 143
    # the first TERM waits for the set's section (three writes and the record), then the undo
    # writes all three back, the second TERM waiting for it
    assert len(seen) == 6
    assert _contents(tree) == [PRISTINE] * 3


def test_ctrl_c_while_the_record_is_written_restores_the_set(tree, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(patches, "_record", interrupted)
    r = _cli("apply", "-s", "sig-1.0", "--root", str(tree))
    assert r.exit_code == 130
    assert _contents(tree) == [PRISTINE] * 3


def test_an_edit_made_during_the_apply_is_kept_and_the_set_restored(tree, monkeypatch):
    real_read = Path.read_bytes
    edited = tree / "sigpkg" / "b.py"

    def read(self: Path) -> bytes:
        data = real_read(self)
        if self == edited and data == PRISTINE and (tree / "sigpkg" / "a.py").read_text() == PATCHED.decode():
            self.write_bytes(PRISTINE + b"# hotfix\n")  # lands between the check and this file's write
            return real_read(self)
        return data

    monkeypatch.setattr(Path, "read_bytes", read)
    r = _cli("apply", "-s", "sig-1.0", "--root", str(tree))
    assert r.exit_code == 1
    assert "changed while it was being written" in " ".join(r.output.split())
    assert _contents(tree) == [PRISTINE, PRISTINE + b"# hotfix\n", PRISTINE]


def test_a_relative_patch_root_is_refused_at_load():
    from dsv4serve.errors import ProfileError
    from dsv4serve.profile import load_profile

    with pytest.raises(ProfileError, match="runtime.patch_root: must be an absolute path"):
        load_profile("8x16gb-380k", ["runtime.patch_root=site-packages"])
    assert load_profile("8x16gb-380k", ["runtime.patch_root=~/sp"]).runtime.patch_root == "~/sp"


def test_a_revert_does_not_point_at_the_backups_it_removed(tree):
    assert "backups in" in " ".join(_cli("apply", "-s", "sig-1.0", "--root", str(tree)).output.split())
    r = _cli("revert", "-s", "sig-1.0", "--root", str(tree))
    assert r.exit_code == 0 and "restored 3 file(s)" in r.output and "backups in" not in r.output


def test_a_signal_right_after_a_later_set_is_written_takes_back_both(tree, tmp_path, monkeypatch):
    """Two sets: a Ctrl-C that lands after the second set's files are written and recorded, before
    apply_set returns, still finds that set on the undo list (all sets or none)."""
    _add_set(tmp_path / "sets", tree, "sig2-1.0", "sigpkg2", ["a.py"])
    real, fired = patches._change_whole, []

    def then_interrupted(targets, sdir, pset, tree_, action, *a, **k):
        real(targets, sdir, pset, tree_, action, *a, **k)
        if pset.set == "sig2-1.0" and action == "apply" and not fired:
            fired.append(1)
            raise KeyboardInterrupt  # where a Ctrl-C lands once the section is over

    monkeypatch.setattr(patches, "_change_whole", then_interrupted)
    r = _cli("apply", "-s", "sig-1.0", "-s", "sig2-1.0", "--root", str(tree))
    assert r.exit_code == 130
    assert _contents(tree) == [PRISTINE] * 3 and (tree / "sigpkg2" / "a.py").read_bytes() == PRISTINE


def test_a_signal_held_over_a_section_that_fails_does_not_replace_its_error():
    from dsv4serve.errors import JobFailed, Signalled

    def stop(signum, frame):
        raise Signalled(signum, "stopped")

    old = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(JobFailed, match="rollback failed too"):
            with patches._signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                raise JobFailed("patch write failed and the rollback failed too: x")
        with pytest.raises(Signalled):  # a clean section raises what it held, once it is over
            with patches._signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                done = True
        assert done
        assert signal.getsignal(signal.SIGTERM) is stop
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_signal_during_an_undo_that_fails_does_not_claim_it_worked(tree, tmp_path, monkeypatch):
    """The undo of the earlier sets runs with signals held; a TERM held there was raised as it ended
    and replaced the undo's failure: "stopped by SIGTERM; the sets it had changed were taken back"
    while the tree stayed patched (helper audit)."""
    _add_set(tmp_path / "sets", tree, "sig2-1.0", "sigpkg2", ["a.py"])
    real_record = patches._record

    def second_fails(sdir, pset, tree_, action, changed):
        if pset.set == "sig2-1.0":
            raise OSError(28, "No space left on device")
        real_record(sdir, pset, tree_, action, changed)

    def undo_fails(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)  # the user stops it while the undo runs
        raise OSError(30, "Read-only file system")  # and the undo fails

    monkeypatch.setattr(patches, "_record", second_fails)
    monkeypatch.setattr(patches, "revert_set", undo_fails)
    r = _cli("apply", "-s", "sig-1.0", "-s", "sig2-1.0", "--root", str(tree))
    out = " ".join(r.output.split())
    assert r.exit_code == 1, out
    assert ("and undoing the sets applied before it failed: sig-1.0 is still patched ([Errno 30] Read-only file "
            "system)") in out
    assert "then run the same `dsv4serve patch apply` again to finish it, or `dsv4serve patch revert`" in out
    assert "SIGTERM" in out and "were taken back" not in out
    assert _contents(tree) == [PATCHED] * 3  # what the message says


def test_an_undo_on_a_full_disk_says_the_set_is_still_patched(tree, tmp_path, monkeypatch):
    """The disk fills while the second set is recorded, so the undo of the first cannot write
    either: the error read "...sig-1.0: cannot write ...; every file of the set was restored" (the
    undo's own rollback), with the set in fact still patched (helper audit)."""
    _add_set(tmp_path / "sets", tree, "sig2-1.0", "sigpkg2", ["a.py"])
    real_record, real_write = patches._record, patches._atomic_write
    full = []

    def second_fills_the_disk(sdir, pset, tree_, action, changed):
        if pset.set == "sig2-1.0":
            full.append(True)
            raise OSError(28, "No space left on device")
        real_record(sdir, pset, tree_, action, changed)

    def write(path, data):
        if full and path.is_relative_to(tree / "sigpkg"):
            raise OSError(28, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(patches, "_record", second_fills_the_disk)
    monkeypatch.setattr(patches, "_atomic_write", write)
    r = _cli("apply", "-s", "sig-1.0", "-s", "sig2-1.0", "--root", str(tree))
    out = " ".join(r.output.split())
    assert r.exit_code == 1, out
    assert "and undoing the sets applied before it failed: sig-1.0 is still patched (cannot write " in out, out
    assert "every file of the set was restored" not in out.split("before it failed:")[1], out
    assert _contents(tree) == [PATCHED] * 3  # what the message says


def test_a_rollback_that_fails_names_the_files_it_left_changed(tree, monkeypatch):
    """When the record could not be written and the rollback's first write failed too, the message
    was the forward write's "every file of the set was restored" with the set fully patched; and a
    record's ENOSPC named no file ("No space left on device: None") (helper audit)."""
    real_write = patches._atomic_write

    def no_record(*a, **k):
        state["rollback"] = True
        raise OSError(28, "No space left on device")  # as f.write raises it: no file name

    def write(path, data):
        if state.get("rollback") and path.is_relative_to(tree):
            state["rollback"] = False
            raise OSError(28, "No space left on device")
        real_write(path, data)

    state: dict = {}
    monkeypatch.setattr(patches, "_record", no_record)
    monkeypatch.setattr(patches, "_atomic_write", write)
    # where hard links work, the rollback renames the old files back and needs no write: that one
    # succeeds (every file back) whatever the disk says
    r = _cli("apply", "-s", "sig-1.0", "--root", str(tree))
    out = " ".join(r.output.split())
    assert r.exit_code == 1 and "state.json); every file it changed was restored" in out, out
    assert _contents(tree) == [PRISTINE] * 3
    assert not [p for p in tree.rglob(".*") if p.name.endswith((".dsv4keep", ".dsv4tmp"))]
    # a filesystem without hard links: the rollback writes, and here its first write fails; the set
    # stays whole (the files already put back are patched again) and the message says so
    state.clear()
    real_keep = patches._keep
    monkeypatch.setattr(patches, "_keep", lambda path: None)
    r = _cli("apply", "-s", "sig-1.0", "--root", str(tree))
    out = " ".join(r.output.split())
    assert r.exit_code == 1
    assert "state.json" in out and ": None" not in out
    assert "restoring its files failed too" in out and "a.py, sigpkg/b.py, sigpkg/c.py still patched" in out
    assert "every file of the set was restored" not in out
    assert _contents(tree) == [PATCHED] * 3
    monkeypatch.setattr(patches, "_keep", real_keep)
    monkeypatch.setattr(patches, "_atomic_write", real_write)
    state.clear()
    for f in FILES:  # as the hint says: restored from the backups
        (tree / "sigpkg" / f).write_bytes(PRISTINE)
    r = _cli("apply", "-s", "sig-1.0", "--root", str(tree))  # one fault: every file back, state.json named
    out = " ".join(r.output.split())
    assert r.exit_code == 1 and "No space left on device:" in out and "state.json); every file it changed was " \
        "restored" in out
    assert _contents(tree) == [PRISTINE] * 3


def test_a_file_changed_between_the_locked_check_and_the_read_is_said_so(tree, monkeypatch):
    """apply read each file again after the locked status without checking it: an edit in between
    was blamed on the set ("the set is broken: regenerate the diff or the manifest") (helper audit)."""
    real, calls = patches.set_status, []

    def status_then_edit(*a, **k):
        rows = real(*a, **k)
        calls.append(1)
        if len(calls) == 3:  # check_sets, apply_set's, then the status under the set's lock
            with open(tree / "sigpkg" / "b.py", "ab") as f:
                f.write(b"# an edit\n")
        return rows

    monkeypatch.setattr(patches, "set_status", status_then_edit)
    r = _cli("apply", "-s", "sig-1.0", "--root", str(tree))
    out = " ".join(r.output.split())
    assert r.exit_code != 0 and "sigpkg/b.py changed while the apply was checking it; nothing was changed" in out
    assert "regenerate" not in out
    assert _contents(tree) == [PRISTINE, PRISTINE + b"# an edit\n", PRISTINE]


def test_a_revert_refusal_offers_only_a_backup_that_is_still_pristine(tree):
    """The hint offered the backup whatever it held; a changed backup copied over would leave the
    file modified-unknown (helper audit)."""
    assert _cli("apply", "-s", "sig-1.0", "--root", str(tree)).exit_code == 0
    (tree / "sigpkg" / "a.py").write_bytes(b"edited\n")
    r = _cli("revert", "-s", "sig-1.0", "--root", str(tree))
    assert r.exit_code != 0 and "copy the pristine backup" in " ".join(r.output.split())
    backup = next(Path(os.environ["DSV4SERVE_HOME"]).rglob("backup/sigpkg/a.py"))
    backup.write_bytes(b"not pristine\n")
    r = _cli("revert", "-s", "sig-1.0", "--root", str(tree))
    out = " ".join(r.output.split())
    assert r.exit_code != 0 and "copy the pristine backup" not in out and "reinstall sigpkg==1.0" in out


def test_two_dist_infos_owning_the_package_are_named_not_one_picked(tree):
    """A stale dist-info left by an earlier install decided the version by its name's order (helper audit)."""
    for version in ("0.9", "1.0"):
        info = tree / f"sigpkg-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sigpkg\nVersion: {version}\n")
        (info / "RECORD").write_text("sigpkg/__init__.py,,\n")
    v = patches.installed_version(tree, "sigpkg", ["sigpkg"])
    assert v == "0.9 and 1.0 (several dist-infos own sigpkg: remove the stale ones)"
    rows = patches.set_status(patches.load_set("sig-1.0"), tree)
    assert {r.state for r in rows} == {"version-mismatch"}


def test_a_signal_that_starts_an_undo_that_fails_does_not_claim_it_worked(tree, tmp_path, monkeypatch):
    """The signal itself set off the undo of the earlier set, and the undo failed: the message led
    with the signal's own text, 'the sets it had changed were taken back' (review)."""
    _add_set(tmp_path / "sets", tree, "sig2-1.0", "sigpkg2", ["a.py"])
    real = patches._change_whole

    def term_on_second(targets, sdir, pset, tree_, action, *a, **k):
        if pset.set == "sig2-1.0":
            os.kill(os.getpid(), signal.SIGTERM)
        return real(targets, sdir, pset, tree_, action, *a, **k)

    def undo_fails(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(patches, "_change_whole", term_on_second)
    monkeypatch.setattr(patches, "revert_set", undo_fails)
    r = _cli("apply", "-s", "sig-1.0", "-s", "sig2-1.0", "--root", str(tree))
    out = " ".join(r.output.split())
    assert r.exit_code == 1 and "were taken back" not in out, out
    assert "patch apply stopped by SIGTERM; and undoing the sets applied before it failed: sig-1.0" in out
    assert _contents(tree) == [PATCHED] * 3


def test_a_revert_refused_for_a_stale_dist_info_says_to_remove_it(tree):
    """'replaced the files this set patched: there is nothing to revert' was said with the files
    still patched and only a stale dist-info beside the real one (review)."""
    assert _cli("apply", "-s", "sig-1.0", "--root", str(tree)).exit_code == 0
    for version in ("0.9", "1.0"):
        info = tree / f"sigpkg-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sigpkg\nVersion: {version}\n")
        (info / "RECORD").write_text("sigpkg/__init__.py,,\n")
    r = _cli("revert", "-s", "sig-1.0", "--root", str(tree))
    out = " ".join(r.output.split())
    assert r.exit_code != 0 and "remove the stale ones" in out and "nothing of sig-1.0 to revert" not in out


def test_a_venv_given_as_root_is_pointed_at_its_site_packages(tree, tmp_path):
    """`--root` of a venv (or a prefix) instead of its site-packages: the advice was to install the
    package there (patch audit); the package is there, one path down."""
    import shutil

    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    shutil.copytree(tree, site)
    for cmd in ("status", "apply"):
        r = _cli(cmd, "-s", "sig-1.0", "--root", str(tmp_path / "venv"), "--json")
        assert r.exit_code == 1, r.output
        assert f"pass --root {site} (the site-packages directory itself)" in r.stdout, r.stdout
    assert (site / "sigpkg" / "a.py").read_bytes() == PRISTINE


def test_what_a_killed_apply_left_beside_a_file_is_removed_by_the_next(tree):
    """A SIGKILL between the hard link (or the temp file) and its removal leaves `.a.py.<hex>.dsv4keep`
    / `.a.py.<rand>.dsv4tmp` in site-packages for ever (review): the next write of the set takes them
    away, and nothing else."""
    pkg = tree / "sigpkg"
    stale = [pkg / ".a.py.0123abcd.dsv4keep", pkg / ".b.py.k2_x9q1z.dsv4tmp"]
    for p in stale:
        p.write_bytes(PRISTINE)
    others = [pkg / ".a.py.notes", pkg / ".zz.py.0123abcd.dsv4keep"]  # not beside a target of the set
    for p in others:
        p.write_bytes(b"keep")
    r = _cli("apply", "-s", "sig-1.0", "--root", str(tree))
    assert r.exit_code == 0, r.output
    assert _contents(tree) == [PATCHED] * 3
    assert not any(p.exists() for p in stale) and all(p.read_bytes() == b"keep" for p in others)
