"""pynvml-shaped doubles: `FakeNvml` replays NVML answers, `RecordingNvml` records them.

No GPU exists in CI, so `dsv4serve.gpu.probe(nvml=FakeNvml(recording))` replays answers that
were recorded by `scripts/nvml_probe.py` (which drives `gpu.probe` through `RecordingNvml`, so
a recording holds exactly the calls gpu.py makes), or a recording constructed from a written
description (`rtx_pro_2000_seat`, clearly marked as such: no such machine was ever probed).

Recording format (JSON-able), every answer either a value or `{"nvml_error": code}`:

    {"source": "...", "init": null | {"nvml_error": 12},
     "driver_version": "570.133.20", "cuda_driver_version": 12080, "device_count": 1,
     "devices": {"0": {"handle": null, "name": ..., "uuid": ..., "pci": {"busId": ...},
                       "memory": {"total": .., "free": .., "used": ..},
                       "compute_capability": [9, 0],
                       "processes": [{"pid": .., "usedGpuMemory": ..}]}},
     "pairs": {"0-1": {"p2p_read": 0, "topology": 50}},
     "process_names": {"1234": "python3"}}
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_UNKNOWN = 999

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """Same shape as pynvml.NVMLError: `.value` is the NVML return code."""

    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML error {self.value}")


class _Handle:
    def __init__(self, index: int, real: Any = None):
        self.index, self.real = index, real


def _answer(v: Any) -> Any:
    if isinstance(v, dict) and "nvml_error" in v:
        raise NVMLError(int(v["nvml_error"]))
    return copy.deepcopy(v)


class FakeNvml:
    """Replays NVML answers, because no GPU exists in CI. Two sources are used in the tests:
    tests/data/nvml-h200.json, recorded by scripts/nvml_probe.py on the device machine's single
    H200 (driver 580.159.04, CUDA 13.0); and `rtx_pro_2000_seat()`, the 8 x RTX PRO 2000 16 GB
    host constructed from seat-reference's description (never probed). A call the recording
    lacks answers NOT_SUPPORTED, as a driver does for an absent feature."""

    NVMLError = NVMLError
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_NO_PERMISSION = NVML_ERROR_NO_PERMISSION

    def __init__(self, recording: dict[str, Any]):
        self.rec = recording
        self.initialised = False
        self.calls: list[str] = []

    # -- helpers -----------------------------------------------------------------------------
    def _top(self, key: str) -> Any:
        self.calls.append(key)
        if not self.initialised:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if key not in self.rec:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return _answer(self.rec[key])

    def _dev(self, h: _Handle, key: str) -> Any:
        self.calls.append(f"{h.index}.{key}")
        d = self.rec.get("devices", {}).get(str(h.index), {})
        if key not in d:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return _answer(d[key])

    def _pair(self, a: _Handle, b: _Handle, key: str) -> Any:
        lo, hi = sorted((a.index, b.index))
        self.calls.append(f"{lo}-{hi}.{key}")
        p = self.rec.get("pairs", {}).get(f"{lo}-{hi}", {})
        if key not in p:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return _answer(p[key])

    # -- the pynvml surface gpu.py uses --------------------------------------------------------
    def nvmlInit(self) -> None:
        init = self.rec.get("init")
        if init:
            _answer(init)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._top("driver_version")

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._top("cuda_driver_version")

    def nvmlDeviceGetCount(self) -> int:
        return self._top("device_count")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not self.initialised:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        d = self.rec.get("devices", {}).get(str(index))
        if d is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if d.get("handle") is not None:
            _answer(d["handle"])
        return _Handle(index)

    def nvmlDeviceGetName(self, h: _Handle) -> str:
        return self._dev(h, "name")

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        return self._dev(h, "uuid")

    def nvmlDeviceGetPciInfo(self, h: _Handle) -> SimpleNamespace:
        return SimpleNamespace(**self._dev(h, "pci"))

    def nvmlDeviceGetMemoryInfo(self, h: _Handle) -> SimpleNamespace:
        return SimpleNamespace(**self._dev(h, "memory"))

    def nvmlDeviceGetCudaComputeCapability(self, h: _Handle) -> tuple[int, int]:
        major, minor = self._dev(h, "compute_capability")
        return int(major), int(minor)

    def nvmlDeviceGetComputeRunningProcesses(self, h: _Handle) -> list[SimpleNamespace]:
        return [SimpleNamespace(**p) for p in self._dev(h, "processes")]

    def nvmlDeviceGetP2PStatus(self, a: _Handle, b: _Handle, index: int) -> int:
        if index != 0:  # only the READ capability is recorded
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return self._pair(a, b, "p2p_read")

    def nvmlDeviceGetTopologyCommonAncestor(self, a: _Handle, b: _Handle) -> int:
        return self._pair(a, b, "topology")

    def process_name(self, pid: int) -> str | None:
        return self.rec.get("process_names", {}).get(str(pid))


class RecordingNvml:
    """Wraps the real pynvml and writes every answer into `recording` (FakeNvml's format)."""

    def __init__(self, real: Any, source: str = ""):
        self.real = real
        self.NVMLError = real.NVMLError
        for const in ("NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED", "NVML_ERROR_NO_PERMISSION"):
            setattr(self, const, getattr(real, const))
        self.recording: dict[str, Any] = {"source": source, "init": None, "devices": {}, "pairs": {},
                                          "process_names": {}}

    def _call(self, slot: dict[str, Any], key: str, fn: Any, *args: Any, conv: Any = None) -> Any:
        try:
            v = fn(*args)
        except self.real.NVMLError as e:
            slot[key] = {"nvml_error": int(getattr(e, "value", NVML_ERROR_UNKNOWN))}
            raise
        slot[key] = conv(v) if conv else (v.decode() if isinstance(v, bytes) else v)
        return v

    def _dev(self, h: _Handle) -> dict[str, Any]:
        return self.recording["devices"].setdefault(str(h.index), {})

    def nvmlInit(self) -> None:
        self._call(self.recording, "init", self.real.nvmlInit, conv=lambda _: None)

    def nvmlShutdown(self) -> None:
        self.real.nvmlShutdown()

    def nvmlSystemGetDriverVersion(self) -> Any:
        return self._call(self.recording, "driver_version", self.real.nvmlSystemGetDriverVersion)

    def nvmlSystemGetCudaDriverVersion(self) -> Any:
        return self._call(self.recording, "cuda_driver_version", self.real.nvmlSystemGetCudaDriverVersion)

    def nvmlDeviceGetCount(self) -> Any:
        return self._call(self.recording, "device_count", self.real.nvmlDeviceGetCount)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        slot = self.recording["devices"].setdefault(str(index), {})
        real = self._call(slot, "handle", self.real.nvmlDeviceGetHandleByIndex, index, conv=lambda _: None)
        return _Handle(index, real)

    def nvmlDeviceGetName(self, h: _Handle) -> Any:
        return self._call(self._dev(h), "name", self.real.nvmlDeviceGetName, h.real)

    def nvmlDeviceGetUUID(self, h: _Handle) -> Any:
        return self._call(self._dev(h), "uuid", self.real.nvmlDeviceGetUUID, h.real)

    def nvmlDeviceGetPciInfo(self, h: _Handle) -> Any:
        def conv(p: Any) -> dict[str, Any]:
            bus = getattr(p, "busId", b"")
            return {"busId": bus.decode() if isinstance(bus, bytes) else str(bus)}
        return self._call(self._dev(h), "pci", self.real.nvmlDeviceGetPciInfo, h.real, conv=conv)

    def nvmlDeviceGetMemoryInfo(self, h: _Handle) -> Any:
        return self._call(self._dev(h), "memory", self.real.nvmlDeviceGetMemoryInfo, h.real,
                          conv=lambda m: {"total": int(m.total), "free": int(m.free), "used": int(m.used)})

    def nvmlDeviceGetCudaComputeCapability(self, h: _Handle) -> Any:
        return self._call(self._dev(h), "compute_capability", self.real.nvmlDeviceGetCudaComputeCapability, h.real,
                          conv=lambda cc: [int(cc[0]), int(cc[1])])

    def nvmlDeviceGetComputeRunningProcesses(self, h: _Handle) -> Any:
        def conv(ps: Any) -> list[dict[str, Any]]:
            return [{"pid": int(p.pid), "usedGpuMemory": None if p.usedGpuMemory is None else int(p.usedGpuMemory)}
                    for p in ps]
        return self._call(self._dev(h), "processes", self.real.nvmlDeviceGetComputeRunningProcesses, h.real,
                          conv=conv)

    def _pair(self, a: _Handle, b: _Handle) -> dict[str, Any]:
        lo, hi = sorted((a.index, b.index))
        return self.recording["pairs"].setdefault(f"{lo}-{hi}", {})

    def nvmlDeviceGetP2PStatus(self, a: _Handle, b: _Handle, index: int) -> Any:
        return self._call(self._pair(a, b), "p2p_read", self.real.nvmlDeviceGetP2PStatus, a.real, b.real, index,
                          conv=int)

    def nvmlDeviceGetTopologyCommonAncestor(self, a: _Handle, b: _Handle) -> Any:
        return self._call(self._pair(a, b), "topology", self.real.nvmlDeviceGetTopologyCommonAncestor, a.real,
                          b.real, conv=int)

    def note_process_name(self, pid: int, name: str | None) -> str | None:
        self.recording["process_names"][str(pid)] = name
        return name


# ---------------------------------------------------------------------------------------------
# A recording constructed from a description, not from a machine.

RTX_PRO_2000_TOTAL = 16_621_600_768  # 15.48 GiB: what seat-reference §6.1 says the card reports
RTX_PRO_2000_NAME = "NVIDIA RTX PRO 2000 Blackwell"  # assumed NVML spelling; the profile matches "RTX PRO 2000"


def rtx_pro_2000_seat(host_gpus: int = 10, foreign: dict[int, tuple[int, int, str]] | None = None,
                      p2p_status: int = 1, topology: int = 40) -> dict[str, Any]:
    """The canon seat's host as seat-reference §6.1/§8 describe it: 16 GB RTX PRO 2000 cards that
    report 15.48 GiB, sm_120, no P2P, the seat on GPUs 0,1,2,3,5,7,8,9 of a host with at least
    10 GPUs. NOT a recording of a real machine: UUIDs, bus ids, the driver version (a CUDA 13
    driver, since the seat's native extension is built for torch cu13), the P2P status word
    (default: chipset not supported) and the topology level (default NODE) are invented.

    `foreign`: {gpu index: (pid, used bytes, process name)} compute processes to place.
    """
    foreign = foreign or {}
    rec: dict[str, Any] = {
        "source": "constructed from seat-reference.md §6.1/§8 (8 x RTX PRO 2000 16 GB seat); not a recording",
        "init": None, "driver_version": "580.95.05", "cuda_driver_version": 13000, "device_count": host_gpus,
        "devices": {}, "pairs": {}, "process_names": {},
    }
    # what an idle card shows as used (driver reservations); invented, but below 444 MiB: the canon
    # seat boots at UTIL 0.972 (seat-reference), and vLLM needs that share of 15.48 GiB free
    idle = 300 * 1024**2
    for i in range(host_gpus):
        procs = []
        used = idle
        if i in foreign:
            pid, nbytes, pname = foreign[i]
            procs.append({"pid": pid, "usedGpuMemory": nbytes})
            rec["process_names"][str(pid)] = pname
            used += nbytes
        rec["devices"][str(i)] = {
            "handle": None, "name": RTX_PRO_2000_NAME,
            "uuid": f"GPU-00000000-0000-0000-0000-{i:012d}",
            "pci": {"busId": f"00000000:{0x11 + 0x10 * i:02X}:00.0"},
            "memory": {"total": RTX_PRO_2000_TOTAL, "free": RTX_PRO_2000_TOTAL - used, "used": used},
            "compute_capability": [12, 0], "processes": procs,
        }
    for a in range(host_gpus):
        for b in range(a + 1, host_gpus):
            rec["pairs"][f"{a}-{b}"] = {"p2p_read": p2p_status, "topology": topology}
    return rec


def no_driver() -> dict[str, Any]:
    """What pynvml answers where libnvidia-ml.so is absent (this CI machine, checked for real)."""
    return {"source": "no driver", "init": {"nvml_error": NVML_ERROR_LIBRARY_NOT_FOUND}}
