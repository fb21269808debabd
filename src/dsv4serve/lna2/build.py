"""Build the lna2 extension with torch's cpp_extension (JIT machinery, explicit output dir)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock, Timeout

from dsv4serve import home
from dsv4serve.errors import BadInput, JobFailed
from dsv4serve.resources import kernels_dir
from dsv4serve.state import atomic_write

MODULE = "dsv4serve_lna2"
MAX_ROWS_DEFAULT = 32  # lna2_api.h's LNA2_MAX_ROWS, and the most it can be: a 32-bit row mask per expert
SOURCES = ("bindings.cpp", "lna2_moe.cu", "lna2_v2.cu", "lna2_v7.cu")
HEADERS = ("lna2_api.h", "lna2_common.cuh", "lna2_tile.cuh")


def source_digest(src_dir: Path | None = None) -> str:
    src = src_dir or kernels_dir()
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((src / name).read_bytes())
    return h.hexdigest()[:12]


def build_tag(digest: str, max_rows: Any = MAX_ROWS_DEFAULT) -> str:
    """What the built extension's lna2_build_id() returns for sources of this digest (a leading
    letter keeps the -D macro value an identifier whatever the digest starts with). A row ceiling
    other than the default is part of it: the ceiling sizes shared memory, so which build fits two
    blocks an SM, and a tuning table timed on one ceiling must not pass for another's."""
    rows = f"r{max_rows}" if isinstance(max_rows, int) and max_rows != MAX_ROWS_DEFAULT else ""
    return f"b{digest}{rows}"


def defines(digest: str, max_rows: int = MAX_ROWS_DEFAULT) -> list[str]:
    """The -D flags of a build: its tag, and the row ceiling when it is not the sources' default."""
    rows = [f"-DLNA2_MAX_ROWS={max_rows}"] if max_rows != MAX_ROWS_DEFAULT else []
    return [f"-DLNA2_BUILD_TAG={build_tag(digest, max_rows)}", *rows]


_ARCH = re.compile(r"(?P<major>[0-9]{1,2})\.(?P<minor>[0-9])(?P<a>a)?(?:\+PTX)?", re.ASCII)


def arch_list(arch: str) -> list[str]:
    """'9.0, 12.0;' -> ['9.0', '12.0']: the entries, checked, as TORCH_CUDA_ARCH_LIST takes them
    (torch refuses an empty entry or a padded one, and majors past the 12.x nvcc 13 builds)."""
    archs = [a.strip() for a in arch.replace(",", ";").split(";") if a.strip()]
    if not archs:
        raise BadInput(f"--arch '{arch}' names no architecture", hint='e.g. --arch "9.0;12.0"')
    for a in archs:
        # ASCII digits only: int() also reads '９' and '٣', which nvcc would not
        m = _ARCH.fullmatch(a)
        if m is None or not 3 <= int(m["major"]) <= 12:
            raise BadInput(f"--arch: '{a}' is not a compute capability like 9.0 or 12.0",
                           hint='the seat\'s cards are 12.0, an H100 / H200 9.0: --arch "9.0;12.0"') from None
        if int(m["major"]) < 9:  # nvcc would fail minutes in, on __cluster_dims__ / mbarrier waits
            raise BadInput(f"--arch: lna2 needs compute capability 9.0 or newer (thread-block clusters, "
                           f"mbarriers), not {a}", hint='the seat\'s cards are 12.0, an H100 / H200 9.0: --arch "9.0;12.0"')
    return archs


def nvcc_archs() -> set[str] | None:
    """The compute capabilities this machine's nvcc builds ('90', '120', ...), None when no nvcc
    answers (torch's own error then says what is missing)."""
    # the nvcc torch's JIT will run: PYTORCH_NVCC, else CUDA_HOME / CUDA_PATH's, else the PATH's
    home_ = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.environ.get("PYTORCH_NVCC") or (str(Path(home_) / "bin" / "nvcc") if home_ else None) \
        or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    try:
        r = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    got = set(re.findall(r"compute_(\d+)", r.stdout)) if r.returncode == 0 else set()
    return got or None


def check_archs(arch: str) -> None:
    """BadInput for an arch nvcc cannot build, before a build that would fail minutes later on it."""
    known = nvcc_archs()
    if known is None:
        return
    bad = [a for a in arch_list(arch) if (m := _ARCH.fullmatch(a)) and f"{int(m['major'])}{m['minor']}" not in known]
    if bad:
        listed = ", ".join(f"{k[:-1]}.{k[-1]}" for k in sorted(known, key=int))
        raise BadInput(f"--arch: this nvcc does not build {', '.join(bad)} (it builds {listed})",
                       hint='the seat\'s cards are 12.0, an H100 / H200 9.0: --arch "9.0;12.0"')


def arch_flags(arch: str) -> list[str]:
    """'9.0;12.0' -> nvcc -gencode flags (SASS for each; PTX of the last for newer GPUs)."""
    flags = []
    last = ""
    for a in arch_list(arch):
        m = _ARCH.fullmatch(a)
        assert m is not None  # arch_list checked it
        cc = f"{int(m['major'])}{m['minor']}{m['a'] or ''}"  # 9.0a: arch-specific features
        flags += ["-gencode", f"arch=compute_{cc},code=sm_{cc}"]
        last = cc
    flags += ["-gencode", f"arch=compute_{last},code=compute_{last}"]
    return flags


def default_out() -> Path:
    return home.cache_dir() / "lna2"


def install_so(built: Path, out: Path) -> Path:
    """Copy a built module into `out` as lna2's .so: under a temp name of its own (two builds into one
    --out never share it), synced, then renamed, so a loader never maps a half-copied library."""
    target = out / f"{MODULE}.so"
    fd, tmp = tempfile.mkstemp(prefix=f".{MODULE}.so.", suffix=".tmp", dir=out)
    try:
        with os.fdopen(fd, "wb") as f, open(built, "rb") as src_f:
            shutil.copyfileobj(src_f, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def build(arch: str = "9.0;12.0", out: Path | None = None, jobs: int | None = None, verbose: bool = False,
          max_rows: int = MAX_ROWS_DEFAULT) -> Path:
    """`max_rows`: the row ceiling compiled in (LNA2_MAX_ROWS). Lower shrinks the route plan's
    shared memory (18 B a (row, slot) pair), which decides whether two CTAs fit an SM of the seat's
    sm_120 cards (kernels/lna2/NOTES.md, session 35); calls above it go to the incumbent."""
    # the user's own arguments first: a bad --arch or --out is said before any environment problem
    gencode = arch_flags(arch)
    if jobs is not None and jobs < 0:
        raise BadInput(f"--jobs {jobs} must be 0 (all cores) or more", hint="e.g. --jobs 8")
    if type(max_rows) is not int or not 1 <= max_rows <= MAX_ROWS_DEFAULT:
        raise BadInput(f"--max-rows {max_rows} must be 1..{MAX_ROWS_DEFAULT} (the route plan keeps a 32-bit row "
                       "mask per expert)", hint="e.g. --max-rows 16 for a seat that decodes 16 rows")
    out = Path(out or default_out())
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out} is a file, not a directory", hint="pass a directory (created if absent)")
    base, broken = home.nearest_existing(out)
    if broken is not None or not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        why = f"{broken} is a broken symlink" if broken is not None else \
            f"{base} is {'not a directory' if not base.is_dir() else 'not writable'}"
        raise BadInput(f"--out {out} cannot be made: {why}", hint="pass a directory this user can write")
    check_archs(arch)
    try:
        import torch
        from torch.utils.cpp_extension import load
    except ImportError as e:
        raise BadInput(f"building lna2 needs torch with CUDA ({e})") from None
    if torch.version.cuda is None:
        raise BadInput(f"torch {torch.__version__} is a CPU build: lna2 needs a CUDA build of torch to link against",
                       hint="build on the GPU machine (or in the seat's image)")
    src = kernels_dir()
    digest = source_digest(src)
    # its own directory per ceiling: torch's JIT would otherwise rebuild in place under a versioned name
    build_dir = out / (f"build-{digest}" if max_rows == MAX_ROWS_DEFAULT else f"build-{digest}-rows{max_rows}")
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(out, build_dir):
        return _build_locked(arch, out, build_dir, digest, gencode, jobs, verbose, max_rows, src, torch, load)


BUILD_LOCK_TIMEOUT_S = 1800.0  # another build of the same --out: a full JIT build takes ~5 minutes


@contextlib.contextmanager
def _build_lock(out: Path, build_dir: Path) -> Iterator[None]:
    """One build of an --out at a time. torch's JIT guards its build directory with a bare `lock`
    file and waits on it forever; a build killed by SIGTERM leaves it behind, and every later build
    then hangs without a word. Every build of ours holds this lock, so a torch `lock` found while
    holding it is such a leftover, and goes."""
    lock = FileLock(str(out / ".build.lock"), timeout=BUILD_LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except Timeout:
        raise JobFailed(f"another lna2 build of {out} has held {out / '.build.lock'} for {BUILD_LOCK_TIMEOUT_S:.0f} s",
                        hint="let it finish (or end it), then build again") from None
    try:
        with contextlib.suppress(FileNotFoundError):
            (build_dir / "lock").unlink()
        yield
    finally:
        lock.release()


def _build_locked(arch: str, out: Path, build_dir: Path, digest: str, gencode: list[str], jobs: int | None,
                  verbose: bool, max_rows: int, src: Path, torch: Any, load: Any) -> Path:
    if jobs:
        os.environ["MAX_JOBS"] = str(jobs)
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(arch_list(arch))  # what torch reports; the -gencode flags decide
    t0 = time.time()
    try:
        load(name=MODULE, sources=[str(src / s) for s in SOURCES], extra_include_paths=[str(src)],
             build_directory=str(build_dir), verbose=verbose, with_cuda=True,
             extra_cflags=["-O3", "-std=c++17", *defines(digest, max_rows)],
             extra_cuda_cflags=["-O3", "-std=c++17", "--use_fast_math", "-Xptxas", "-v", *defines(digest, max_rows),
                                *gencode])
    except Exception as e:  # noqa: BLE001 - compiler errors come as RuntimeError/subprocess errors
        # torch puts the compiler's whole output in the exception and writes no log: keep it, and
        # say its first error (the last line is always ninja's "subcommand failed")
        text = str(e).strip()
        log = build_dir / "build.log"
        with contextlib.suppress(OSError):
            atomic_write(log, text + "\n", mode=0o644)
        lines = text.splitlines()
        first = next((ln.strip() for ln in lines if re.search(r"\berror\b|nvcc fatal", ln, re.IGNORECASE)
                      and not re.search(r"subcommand failed|^Error building extension", ln)),
                     lines[-1].strip() if lines else repr(e))
        raise JobFailed(f"lna2 build failed: {first[:300]}", hint=f"the compiler's output is in {log}") from None
    built = next(build_dir.glob(f"{MODULE}*.so"), None)
    if built is None:
        raise JobFailed(f"lna2 build produced no {MODULE}.so in {build_dir}")
    # python and torch: a docker seat mounts this file into an image whose interpreter and libtorch
    # must be the ones it was built against (check-seat's lna2-abi row compares them)
    meta = {"build_id": digest, "arch": arch, "max_rows": max_rows, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
            "seconds": round(time.time() - t0, 1), "built_at": time.time()}
    # The new description is written aside first and renamed into place only once the new .so is:
    # a full disk at either write leaves the old .so with its own description, never one with
    # another build's id, arch and ceiling (check-seat and up trust it for a docker seat).
    staged = out / f".{MODULE}.json.new"
    atomic_write(staged, json.dumps(meta, indent=2), mode=0o644)  # as readable as the .so
    try:
        target = install_so(built, out)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    os.replace(staged, out / f"{MODULE}.json")
    return target
