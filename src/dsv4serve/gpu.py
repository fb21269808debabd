"""What the GPUs of this machine are, read through NVML (`nvidia-ml-py`, imported as `pynvml`).

`probe()` never raises for a machine without a driver: it returns a `Machine` whose `error`
says so ("no NVIDIA driver: NVML not found"), because `check-seat` must print one clear row,
not a traceback. Every NVML call goes through the module object passed as `nvml`, so tests
replay recorded answers (`dsv4serve.testing.fake_nvml`) where no GPU exists, and
`scripts/nvml_probe.py` records exactly what this module reads on a real one.

Indices are NVML indices, which follow PCI bus order: the same numbering as `nvidia-smi` and as
CUDA with CUDA_DEVICE_ORDER=PCI_BUS_ID, which is what a profile's `gpus.ids` means.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

GIB = 1024**3
NO_DRIVER = "no NVIDIA driver: NVML not found"

# nvidia-ml-py 13.x defines NVML_P2P_CAPS_INDEX_READ as the tuple `(0,)` (a stray comma), which
# ctypes cannot pass; the C enum value is 0.
P2P_CAPS_INDEX_READ = 0

# nvmlGpuP2PStatus_t -> words (nvml.h).
P2P_STATUS = {
    0: "ok",
    1: "chipset not supported",
    2: "GPU not supported",
    3: "IOH topology not supported",
    4: "disabled by regkey",
    5: "not supported",
    6: "unknown",
}

# nvmlGpuTopologyLevel_t -> the labels `nvidia-smi topo -m` prints.
TOPOLOGY = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
TOPOLOGY_WORDS = {
    "X": "same board",
    "PIX": "one PCIe switch",
    "PXB": "several PCIe switches",
    "PHB": "one PCIe host bridge",
    "NODE": "host bridges of one NUMA node",
    "SYS": "across NUMA nodes (SMP interconnect)",
}


@dataclass
class GpuProcess:
    pid: int
    used_bytes: int | None
    name: str | None


@dataclass
class Gpu:
    index: int
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    memory_total: int | None = None
    memory_free: int | None = None
    memory_used: int | None = None
    compute_capability: str | None = None  # "12.0"
    processes: list[GpuProcess] | None = None  # None: NVML could not say
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def sm(self) -> str | None:
        """The CUDA arch name torch and nvcc use (`sm_120` for 12.0)."""
        if not self.compute_capability:
            return None
        major, _, minor = self.compute_capability.partition(".")
        return f"sm_{major}{minor or '0'}"


@dataclass
class Link:
    a: int
    b: int
    p2p_read: str | None  # P2P_STATUS word, None when NVML could not say
    topology: str | None  # TOPOLOGY label
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class Machine:
    available: bool
    error: str | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # "12.8"
    device_count: int = 0
    gpus: list[Gpu] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)

    def gpu(self, index: int) -> Gpu | None:
        return next((g for g in self.gpus if g.index == index), None)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _cuda_version(v: int) -> str:
    # nvmlSystemGetCudaDriverVersion answers 12080 for 12.8
    return f"{v // 1000}.{(v % 1000) // 10}"


def _process_name(pid: int) -> str | None:
    try:
        import psutil

        return psutil.Process(pid).name()
    except Exception:  # gone, another pid namespace, or psutil missing on a bare probe host
        return None


def _init_error(nvml: Any, exc: BaseException) -> str:
    code = getattr(exc, "value", None)
    if code == getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", 12):
        return NO_DRIVER
    if code == getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", 9):
        return "NVIDIA driver not loaded: NVML cannot talk to it"
    if code == getattr(nvml, "NVML_ERROR_NO_PERMISSION", 4):
        return "NVML initialisation refused: no permission on /dev/nvidia*"
    return f"NVML failed to initialise: {exc}"


def probe(ids: list[int] | None = None, nvml: Any = None,
          process_name: Callable[[int], str | None] | None = None) -> Machine:
    """Read every GPU on the machine, and P2P/topology between the GPUs in `ids` (all if None).

    `nvml`: a pynvml-like module (default: the real `pynvml`). `process_name`: pid -> name
    (default: psutil); tests pass the names recorded with the answers.
    """
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[no-redef]
        except ImportError:
            return Machine(available=False, error="nvidia-ml-py is not installed (import pynvml failed)")
    names = process_name or _process_name
    err_type = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except err_type as e:
        return Machine(available=False, error=_init_error(nvml, e))
    except OSError as e:  # a broken libnvidia-ml.so can fail at dlopen with an OSError
        return Machine(available=False, error=f"NVML failed to load: {e}")
    try:
        return _read(nvml, err_type, ids, names)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _read(nvml: Any, err_type: type, ids: list[int] | None, names: Callable[[int], str | None]) -> Machine:
    m = Machine(available=True)

    def ask(errors: dict[str, str], key: str, fn: Callable[[], Any]) -> Any:
        # One unsupported query (e.g. processes on a vGPU) must not hide the others.
        try:
            return fn()
        except err_type as e:
            errors[key] = str(e)
            return None

    top: dict[str, str] = {}
    drv = ask(top, "driver_version", nvml.nvmlSystemGetDriverVersion)
    m.driver_version = _text(drv) if drv is not None else None
    cuda = ask(top, "cuda_driver_version", nvml.nvmlSystemGetCudaDriverVersion)
    m.cuda_driver_version = _cuda_version(int(cuda)) if cuda is not None else None
    count = ask(top, "device_count", nvml.nvmlDeviceGetCount)
    if count is None:
        m.available, m.error = False, f"NVML could not count devices: {top.get('device_count')}"
        return m
    m.device_count = int(count)

    handles: dict[int, Any] = {}
    for i in range(m.device_count):
        g = Gpu(index=i)
        h = ask(g.errors, "handle", lambda: nvml.nvmlDeviceGetHandleByIndex(i))
        m.gpus.append(g)
        if h is None:
            continue
        handles[i] = h
        v = ask(g.errors, "name", lambda: nvml.nvmlDeviceGetName(h))
        g.name = _text(v) if v is not None else None
        v = ask(g.errors, "uuid", lambda: nvml.nvmlDeviceGetUUID(h))
        g.uuid = _text(v) if v is not None else None
        pci = ask(g.errors, "pci", lambda: nvml.nvmlDeviceGetPciInfo(h))
        if pci is not None:
            g.pci_bus_id = _text(getattr(pci, "busId", None) or getattr(pci, "busIdLegacy", ""))
        mem = ask(g.errors, "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            g.memory_total, g.memory_free, g.memory_used = int(mem.total), int(mem.free), int(mem.used)
        cc = ask(g.errors, "compute_capability", lambda: nvml.nvmlDeviceGetCudaComputeCapability(h))
        if cc is not None:
            g.compute_capability = f"{cc[0]}.{cc[1]}"
        procs = ask(g.errors, "processes", lambda: nvml.nvmlDeviceGetComputeRunningProcesses(h))
        if procs is not None:
            g.processes = [GpuProcess(pid=int(p.pid),
                                      used_bytes=int(p.usedGpuMemory) if p.usedGpuMemory is not None else None,
                                      name=names(int(p.pid)))
                           for p in procs]

    wanted = sorted(i for i in (ids if ids is not None else handles) if i in handles)
    for a, b in itertools.combinations(wanted, 2):
        ln = Link(a=a, b=b, p2p_read=None, topology=None)
        st = ask(ln.errors, "p2p_read",
                 lambda: nvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], P2P_CAPS_INDEX_READ))
        ln.p2p_read = P2P_STATUS.get(int(st), f"status {st}") if st is not None else None
        lvl = ask(ln.errors, "topology", lambda: nvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))
        ln.topology = TOPOLOGY.get(int(lvl), f"level {lvl}") if lvl is not None else None
        m.links.append(ln)
    return m


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"
