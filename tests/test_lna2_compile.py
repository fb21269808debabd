"""CI has nvcc but no GPU: compile lna2 for both target archs so a CUDA error fails the build.

The kernel TU is plain CUDA (no torch) and is compiled to SASS for sm_90 (our H200) and sm_120
(the seat's RTX PRO 2000). The torch binding is syntax-checked against the CPU torch wheel's
headers; that wheel lacks one generated CUDA config header, which a two-line shim provides.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from dsv4serve.resources import kernels_dir

NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


def _need_nvcc():
    if not Path(NVCC).exists():
        if os.environ.get("DSV4SERVE_NO_NVCC") == "1":
            pytest.skip("DSV4SERVE_NO_NVCC=1: this machine has no nvcc")
        pytest.fail(f"nvcc not found ({NVCC}): CI machines ship nvcc; set DSV4SERVE_NO_NVCC=1 to skip deliberately")


def _cuda_include() -> Path:
    """nvcc's own include dir (`nvcc` may be a wrapper script, so ask it rather than follow links)."""
    r = subprocess.run([NVCC, "--dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"], capture_output=True,
                       text=True, timeout=60)
    for m in re.finditer(r'INCLUDES="([^"]*)"', r.stdout + r.stderr):
        for inc in m.group(1).split():
            p = Path(inc.removeprefix("-I").strip('"'))
            if (p / "cuda_runtime_api.h").is_file():
                return p
    return Path(NVCC).resolve().parent.parent / "include"


UNITS = ("lna2_moe.cu", "lna2_v2.cu", "lna2_v7.cu")
ARCHS = ("90", "120")


@pytest.fixture(scope="module")
def sass_builds(tmp_path_factory):
    """Every unit x arch compile started at once (six nvcc processes; each unit's test waits for its
    two): one after another they were ~4 minutes of CI, the v7 unit alone 130 s."""
    _need_nvcc()
    out = tmp_path_factory.mktemp("sass")
    procs = {}
    for unit in UNITS:
        for arch in ARCHS:
            log = out / f"{unit}.{arch}.log"
            with open(log, "w") as fh:  # a file, not a pipe: ptxas -v writes a lot, and nobody reads until the end
                p = subprocess.Popen([NVCC, "-std=c++17", "-O3", "--use_fast_math", "-Xptxas", "-v",
                                      f"-I{kernels_dir()}", "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-c",
                                      str(kernels_dir() / unit), "-o", str(out / f"{unit}.{arch}.o")],
                                     stdout=fh, stderr=subprocess.STDOUT)
            procs[unit, arch] = (p, log)
    yield procs
    for p, _ in procs.values():  # a failed test left the others running
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


@pytest.mark.parametrize("unit, name, entries", [
    # ptxas reports every instantiation once per arch: v0/v1 x K2/K3 x mcg/mul1 ...
    ("lna2_moe.cu", r"moe_decode_v[01]", 16),
    # ... and v2: K2/K3 x (mcg exact-sum at 3 and 2 CTAs per SM, mcg rounded, mul1), plus the
    # four K2 timing ablations of variant 4, v50's K2 build (byte-permute states), v53's two
    # (v50's, its rings completed on cp.async groups), v54's two (v53's, two k-tiles a ring row) and
    # v55's two (v54's, 32-k-tile gate/up chunks)
    ("lna2_v2.cu", r"moe_decode_v2", 46),
    # ... and the cluster kernel: K2/K3 x (mcg exact-sum, mul1) x (v7, v9's bulk copies, v21's
    # local finisher, v26's dealt epilogue, v31's row-capped partials, v36's single partial buffer,
    # v40's per-row arrivals, v46's relaxed arrive, v58 / v59's fixed-point top-k sums), v20's two
    # K2 builds (byte-permute states), the three K2 timing ablations and v26's K2 stop build
    # (lna2_set_stop)
    ("lna2_v7.cu", r"moe_decode_v7", 92),
])
def test_kernel_compiles_for_sm90_and_sm120(sass_builds, unit, name, entries):
    report = ""
    for arch in ARCHS:
        p, log = sass_builds[unit, arch]
        rc = p.wait(timeout=600)
        text = log.read_text()
        assert rc == 0, f"sm_{arch}: " + text[-3000:]
        report += text
    assert len(re.findall(rf"Compiling entry function '\w*{name}", report)) == entries, report[-2000:]
    assert "bytes spill" in report


def test_binding_is_valid_cpp_against_torch_headers(tmp_path):
    import torch

    tinc = Path(torch.__file__).parent / "include"
    shim = tmp_path / "shim" / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    (shim / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cuda_inc = _cuda_include()
    gxx = shutil.which("g++") or "g++"
    r = subprocess.run([gxx, "-std=c++17", "-fsyntax-only", f"-I{tmp_path / 'shim'}", f"-I{tinc}",
                        f"-I{tinc / 'torch/csrc/api/include'}", f"-I{sysconfig.get_paths()['include']}",
                        f"-I{cuda_inc}", f"-I{kernels_dir()}", "-DTORCH_EXTENSION_NAME=dsv4serve_lna2",
                        str(kernels_dir() / "bindings.cpp")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("unit, pick", [("lna2_v2.cu", "pick_v2"), ("lna2_v7.cu", "pick_v7")])
def test_every_known_variant_dispatches_to_a_kernel(tmp_path, unit, pick):
    """The host dispatch tables, run on the CPU (taking a kernel's address needs no GPU): every
    variant the API knows for this family returns a kernel for K2/K3 x MCG/MUL1, the timing
    ablations for K2 MCG only. Session 22's new v2 builds (v50 among them) compiled cleanly and fell
    into the ablation branch, returning no kernel at all; only a device run would have said so, as an
    occupancy error."""
    from tests.test_lna2_variant_sets import api_cluster_variants, api_v2_extras

    _need_nvcc()
    cluster, cluster_abl = api_cluster_variants()
    if unit == "lna2_v2.cu":
        extras = api_v2_extras()
        variants = {2, 3, 4, 6, 10, 11, 12, 13} | set(extras.values())
        ablations = {10, 11, 12, 13}
    else:
        variants, ablations = cluster, cluster_abl
    src = tmp_path / "pick.cu"
    src.write_text(f'#include "{unit}"\n#include <cstdio>\nint main() {{\n'
                   f'    const int vs[] = {{{", ".join(map(str, sorted(variants)))}}};\n'
                   "    for (int v : vs) for (int bits = 2; bits <= 3; bits++) for (int cb = 1; cb <= 2; cb++)\n"
                   f'        printf("%d %d %d %d\\n", v, bits, cb, lna2::{pick}(bits, cb, v) != nullptr);\n'
                   "    return 0;\n}\n")
    exe = tmp_path / "pick"
    # PTX only (no ptxas): the host tables take the kernels' addresses, which needs no SASS, and the
    # SASS is the test above's; this halves the v7 build (85 -> 47 s on a 2-core machine)
    r = subprocess.run([NVCC, "-std=c++17", "-O1", f"-I{kernels_dir()}", "-gencode", "arch=compute_90,code=compute_90",
                        str(src), "-o", str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = {tuple(map(int, ln.split()[:3])): ln.split()[3] == "1" for ln in out.stdout.splitlines()}
    want = {(v, b, cb): (v not in ablations or (b, cb) == (2, 1)) for v in variants for b in (2, 3) for cb in (1, 2)}
    assert got == want, sorted(k for k in want if got.get(k) != want[k])
