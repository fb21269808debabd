#!/usr/bin/env python3
"""Which kernels of a CUDA object changed their SASS between two builds.

Every lna2 experiment that adds a template flag claims "the other kernels are SASS-identical", so a
measurement taken before the change still describes them (kernels/lna2/NOTES.md). This checks that
claim: each side is a .o / .so (disassembled with `cuobjdump -sass`, which needs `nvdisasm` beside
it) or a saved `cuobjdump -sass` listing. Kernels are matched per arch by demangled name, so the
anonymous-namespace hash nvcc derives from the file path does not matter. A kernel whose template
arguments are an old kernel's plus trailing `false` / `0` arguments (a flag added with its default)
is compared with that old kernel.

Prints one line per kernel that is not identical (DIFF, NEW, GONE) and a summary; exit status 1 when
any kernel differs or is gone, 0 otherwise. cuobjdump and nvdisasm come with the CUDA toolkit, or
from PyPI: `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` (nvidia/cu13/bin in their wheels).

    scripts/sass_diff.py before.o after.o
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ARCH = re.compile(r"^\s*arch = (sm_\d+)")
FUNCTION = re.compile(r"^\s*Function : (\S+)")
# `/*0a30*/  OPCODE operands ;  /* encoding */`: offsets grow past four hex digits in big kernels
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
TRAILING_DEFAULT = re.compile(r", (?:false|0)>(\(|$)")


def sass_text(path: Path, cuobjdump: str | None) -> str:
    if path.suffix in (".o", ".so", ".cubin", ".fatbin"):
        tool = cuobjdump or shutil.which("cuobjdump")
        if not tool:
            raise SystemExit("sass_diff: no cuobjdump on PATH; pass --cuobjdump (PyPI: nvidia-cuda-cuobjdump)")
        env = dict(os.environ)
        env["PATH"] = f"{Path(tool).parent}{os.pathsep}{env.get('PATH', '')}"  # nvdisasm beside it
        r = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, timeout=600, env=env)
        if r.returncode != 0:
            raise SystemExit(f"sass_diff: cuobjdump failed on {path}: {r.stderr.strip()[-300:]}")
        return r.stdout
    return path.read_text()


def parse(text: str) -> dict[tuple[str, str], list[str]]:
    """(arch, mangled name) -> the function's instructions, addresses and encodings dropped."""
    funcs: dict[tuple[str, str], list[str]] = {}
    arch, cur = "?", None
    for line in text.splitlines():
        m = ARCH.match(line)
        if m:
            arch = m.group(1)
            continue
        m = FUNCTION.match(line)
        if m:
            cur = funcs.setdefault((arch, m.group(1)), [])
            continue
        m = INSTRUCTION.match(line)
        if m and cur is not None:
            cur.append(m.group(2))
    return funcs


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    r = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, timeout=60)
    out = r.stdout.splitlines()
    return dict(zip(names, out)) if r.returncode == 0 and len(out) == len(names) else {n: n for n in names}


def readable(funcs: dict[tuple[str, str], list[str]]) -> dict[tuple[str, str], list[str]]:
    names = demangle(sorted({n for _, n in funcs}))
    return {(arch, names[n]): body for (arch, n), body in funcs.items()}


def compare(old: dict[tuple[str, str], list[str]], new: dict[tuple[str, str], list[str]]) -> list[tuple[str, str, str]]:
    """(status, arch, kernel) for every kernel of either side: same, DIFF, NEW or GONE."""
    out, matched = [], set()
    for (arch, name), body in sorted(new.items()):
        key, cand = None, name
        while True:
            if (arch, cand) in old and (arch, cand) not in matched:
                key = (arch, cand)
                break
            shorter = TRAILING_DEFAULT.sub(r">\1", cand, count=1)
            if shorter == cand:
                break
            cand = shorter
        if key is None:
            out.append(("NEW", arch, f"{name} ({len(body)} instructions)"))
            continue
        matched.add(key)
        if old[key] == body:
            out.append(("same", arch, name))
        else:
            out.append(("DIFF", arch, f"{name} ({len(old[key])} -> {len(body)} instructions)"))
    out += [("GONE", arch, name) for (arch, name) in sorted(old) if (arch, name) not in matched]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--cuobjdump", help="cuobjdump to run on .o/.so inputs (default: the one on PATH)")
    args = ap.parse_args(argv)
    old = readable(parse(sass_text(args.old, args.cuobjdump)))
    new = readable(parse(sass_text(args.new, args.cuobjdump)))
    if not old or not new:
        print(f"sass_diff: no kernels found in {args.old if not old else args.new}", file=sys.stderr)
        return 2
    rows = compare(old, new)
    for status, arch, what in rows:
        if status != "same":
            print(f"{status:4} {arch} {what}")
    count = {s: sum(r[0] == s for r in rows) for s in ("same", "DIFF", "NEW", "GONE")}
    print(f"same {count['same']}, DIFF {count['DIFF']}, NEW {count['NEW']}, GONE {count['GONE']}")
    return 1 if count["DIFF"] or count["GONE"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
