"""gpu.py: the no-driver path for real, GPU facts against replayed NVML answers.

There is no GPU in CI. `FakeNvml` replays either a recording made by scripts/nvml_probe.py on
a real machine (tests/data/nvml-*.json) or the 8 x RTX PRO 2000 host built from its written
description (fake_nvml.rtx_pro_2000_seat; no such machine was probed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4serve import gpu
from dsv4serve.testing import fake_nvml
from dsv4serve.testing.fake_nvml import FakeNvml, RecordingNvml

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parent.parent
SEAT_IDS = [0, 1, 2, 3, 5, 7, 8, 9]


def _real_nvml_loads() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.skipif(_real_nvml_loads(), reason="this machine has an NVIDIA driver")
def test_no_driver_for_real():
    m = gpu.probe()
    assert m.available is False
    assert m.error == gpu.NO_DRIVER == "no NVIDIA driver: NVML not found"
    assert m.gpus == [] and m.device_count == 0


@pytest.mark.skipif(_real_nvml_loads(), reason="this machine has an NVIDIA driver")
def test_probe_script_without_driver_reports_cleanly():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "nvml_probe.py")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    doc = json.loads(r.stdout)
    assert doc["parsed"]["error"] == gpu.NO_DRIVER
    assert doc["recording"]["init"] == {"nvml_error": fake_nvml.NVML_ERROR_LIBRARY_NOT_FOUND}


def test_no_driver_replayed_matches_the_message():
    assert gpu.probe(nvml=FakeNvml(fake_nvml.no_driver())).error == gpu.NO_DRIVER


def test_driver_not_loaded_is_its_own_message():
    m = gpu.probe(nvml=FakeNvml({"init": {"nvml_error": fake_nvml.NVML_ERROR_DRIVER_NOT_LOADED}}))
    assert not m.available and "driver not loaded" in m.error


def test_missing_nvidia_ml_py(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    m = gpu.probe()
    assert not m.available and "nvidia-ml-py" in m.error


def _rtx(**kw):
    f = FakeNvml(fake_nvml.rtx_pro_2000_seat(**kw))
    return gpu.probe(ids=SEAT_IDS, nvml=f, process_name=f.process_name), f


def test_rtx_pro_2000_seat_from_the_description():
    m, f = _rtx(foreign={5: (4242, 3 * 1024**3, "python3")})
    assert m.available and m.device_count == 10
    assert m.driver_version == "580.95.05" and m.cuda_driver_version == "13.0"
    g5 = m.gpu(5)
    assert g5.compute_capability == "12.0" and g5.sm == "sm_120"
    assert round(g5.memory_total / gpu.GIB, 2) == 15.48
    assert [(p.pid, p.used_bytes, p.name) for p in g5.processes] == [(4242, 3 * 1024**3, "python3")]
    assert m.gpu(0).processes == []
    # P2P and topology only between the seat's GPUs: 8 choose 2 pairs, never GPU 4 or 6
    assert len(m.links) == 28
    assert all(4 not in (ln.a, ln.b) and 6 not in (ln.a, ln.b) for ln in m.links)
    assert {ln.p2p_read for ln in m.links} == {"chipset not supported"}
    assert {ln.topology for ln in m.links} == {"NODE"}
    # gpu.py asks for the READ capability with the C enum value 0 (pynvml's constant is a tuple)
    assert any(c.endswith(".p2p_read") for c in f.calls)


def test_one_unsupported_query_does_not_hide_the_rest():
    rec = fake_nvml.rtx_pro_2000_seat(host_gpus=2)
    rec["devices"]["1"]["processes"] = {"nvml_error": fake_nvml.NVML_ERROR_NOT_SUPPORTED}
    rec["pairs"]["0-1"]["p2p_read"] = {"nvml_error": fake_nvml.NVML_ERROR_NOT_SUPPORTED}
    m = gpu.probe(nvml=FakeNvml(rec))
    g1 = m.gpu(1)
    assert g1.processes is None and g1.errors == {"processes": "Not Supported"}
    assert g1.name and g1.memory_total and g1.compute_capability == "12.0"
    assert m.links[0].p2p_read is None and m.links[0].topology == "NODE"


def test_recording_replays_to_the_same_machine():
    """RecordingNvml (what nvml_probe.py runs on a GPU) captures every answer probe reads."""
    original = fake_nvml.rtx_pro_2000_seat(foreign={2: (77, 1024**3, "xorg")})
    live = FakeNvml(original)
    rec = RecordingNvml(live, source="roundtrip")
    first = gpu.probe(ids=SEAT_IDS, nvml=rec, process_name=lambda pid: rec.note_process_name(pid, live.process_name(pid)))
    replay = FakeNvml(json.loads(json.dumps(rec.recording)))
    second = gpu.probe(ids=SEAT_IDS, nvml=replay, process_name=replay.process_name)
    assert first.as_dict() == second.as_dict()
    assert second.gpu(2).processes[0].name == "xorg"


H200 = DATA / "nvml-h200.json"


@pytest.mark.skipif(not H200.exists(), reason="no H200 recording yet: run scripts/nvml_probe.py on the device")
def test_h200_recording_replays_as_recorded():
    doc = json.loads(H200.read_text())
    f = FakeNvml(doc["recording"])
    m = gpu.probe(nvml=f, process_name=f.process_name)
    assert m.as_dict() == doc["parsed"]
    assert m.available and m.device_count >= 1
    g = m.gpus[0]
    assert "H200" in g.name and g.compute_capability == "9.0" and g.sm == "sm_90"
    assert g.memory_total > 130 * gpu.GIB
    assert g.uuid.startswith("GPU-")


def test_probe_module_imports_without_psutil(monkeypatch):
    """The device probe host may lack psutil: process names become None, nothing raises."""
    monkeypatch.setitem(sys.modules, "psutil", None)
    assert gpu._process_name(os.getpid()) is None
