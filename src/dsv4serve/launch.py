"""Profile -> LaunchSpec: the exact argv, env delta and runtime of a seat, and the plan checks
that refuse a seat before it is started (each refusal names the key and the fix)."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shlex
import socket
import string
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from dsv4serve import home
from dsv4serve.errors import BadInput, ProfileError
from dsv4serve.lna2.build import MODULE as _LNA2_MODULE
from dsv4serve.lna2.loader import ENV as LNA2_EXT_ENV
from dsv4serve.lna2.policy import UBATCH_WHY, graph_rows
from dsv4serve.profile import LNA2_ACTIVE_ANY, LOG_FORMAT_ENV, Profile, VllmSection, quiet_level

PLUGIN_ENV_RUN_ID = "DSV4SERVE_RUN_ID"
PLUGIN_ENV_RUN_DIR = "DSV4SERVE_RUN_DIR"
PLUGIN_ENV_KERNEL = "DSV4SERVE_MOE_KERNEL"
PLUGIN_ENV_STRICT = "VLLM_EXL3_MOE_STRICT"
PLUGIN_ENV_DECODE_ROWS = "DSV4SERVE_DECODE_ROWS"  # rows of the seat's decode calls: the build must take them
PLUGIN_ENV_TUNING = "DSV4SERVE_LNA2_TUNING"  # moe_dispatch.TUNING_ENV (not imported: it pulls in torch)
TUNING_COPY = "lna2-tuning.json"
LNA2_SO = f"{_LNA2_MODULE}.so"  # the name a docker seat's lna2 build has inside the image
NATIVE_ENTRYPOINT = ["-m", "vllm.entrypoints.openai.api_server"]


# vLLM's micro-batching flags and the shortest prefix its parser completes to each (vLLM 0.32:
# argparse abbreviations; `--enable-d` is already unique there). A shorter one is ambiguous.
_DBO, _NO_DBO, _UBATCH = ("--enable-dbo", 10), ("--no-enable-dbo", 13), ("--ubatch-size", 4)


def ubatching_flag(extra_args: list[str]) -> tuple[str, int] | None:
    """(the flag as written, the micro-batches it asks for) when vllm.extra_args leaves vLLM's
    micro-batching on (dual batch overlap, or a ubatch size above one), else None. Read as vLLM's
    parser reads it: `_` for `-`, abbreviations, `=` or the next word for a value, the last word wins."""
    def means(name: str, flag: tuple[str, int]) -> bool:
        return len(name) >= flag[1] and flag[0].startswith(name)

    dbo: str | None = None
    size: tuple[str, int] | None = None
    for i, a in enumerate(extra_args):
        if not a.startswith("--"):
            continue
        head, eq, val = a.partition("=")
        name = "--" + head[2:].replace("_", "-")
        if means(name, _NO_DBO):
            dbo = None
        elif means(name, _DBO):
            dbo = head
        elif means(name, _UBATCH):
            val = val if eq else (extra_args[i + 1] if i + 1 < len(extra_args) else "")
            size = (f"{head} {val}", int(val)) if val.isascii() and val.isdigit() else None
    if dbo is not None:
        return dbo, 2
    return size if size is not None and size[1] > 1 else None


def _numeric_host(host: str) -> str | None:
    """The address a numeric host spells ("0x0", "000.000.000.000" and "::0" included), or None for a name."""
    try:
        return socket.getaddrinfo(host.strip("[]"), None, flags=socket.AI_NUMERICHOST)[0][4][0].split("%")[0]
    except (socket.gaierror, UnicodeError, ValueError):
        return None


def is_public_host(host: str) -> bool:
    """Whether listening on `host` listens on every interface: by the address it spells, not the text
    (the text test let "::0", "0" and "0x0" through the opt-in)."""
    if not host.strip("[]"):
        return True
    addr = _numeric_host(host)
    if addr is None:
        return False
    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_unspecified or bool(mapped and mapped.is_unspecified)

# Flags vLLM spells as BooleanOptionalAction: False renders as --no-<flag>.
_TRISTATE = {"enable_prefix_caching"}
# Keys of VllmSection that are ours, not vLLM flags.
_NOT_FLAGS = {"extra_args", "allow_public_host"}


class LaunchSpec(BaseModel):
    runtime: Literal["native", "docker"]
    argv: list[str]
    env: dict[str, str] = Field(description="delta over the launcher's environment")
    cwd: str | None = None
    vllm_args: list[str] = Field(description="the arguments vLLM itself parses (after its entrypoint)")
    host: str
    port: int
    model_path: str
    served_name: str
    container_name: str | None = None
    run_id: str
    run_dir: str

    def shell(self) -> str:
        """A copy-pasteable command: env assignments (native) then the shell-quoted argv."""
        parts = []
        if self.runtime == "native":
            parts += [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        parts += [shlex.quote(a) for a in self.argv]
        return " ".join(parts)


def placeholders(profile: Profile, run_dir: Path) -> dict[str, str]:
    return {
        "home": str(home.home()),
        "cache": str(home.cache_dir()),
        "run_dir": str(run_dir),
        "model_path": resolve_model_path(profile, expand=False),
    }


def _expand(value: str, ctx: dict[str, str], where: str) -> str:
    """{home}, {cache}, ... replaced, and nothing else: str.format would also run {home.x} (an
    AttributeError traceback), {home[0]} and {home!r} / {cache:>20} (silently other text)."""
    names = ", ".join("{" + k + "}" for k in ctx)
    out = []
    try:
        for literal, field, spec, conv in string.Formatter().parse(value):
            out.append(literal)
            if field is None:
                continue
            if field not in ctx or spec or conv:
                shown = "{" + field + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
                what = "unknown placeholder" if field not in ctx else "placeholder with a conversion or format"
                raise ProfileError(f"{where}: {what} {shown}", hint=f"use one of {names} as written "
                                   "(a literal brace is {{ or }})")
            out.append(ctx[field])
    except ValueError:
        raise ProfileError(f"{where}: malformed placeholder in '{value}' (write a literal brace as {{{{ or }}}})") from None
    return "".join(out)


def resolve_model_path(profile: Profile, expand: bool = True) -> str:
    if profile.model.demo:
        from dsv4serve.demo_model import default_dir

        return str(default_dir(profile.model.demo_seed))
    if not profile.model.path:
        raise ProfileError(f"profile {profile.name}: model.path is required unless model.demo is true")
    path = profile.model.path
    if expand:
        path = _expand(path, {"home": str(home.home()), "cache": str(home.cache_dir())}, "model.path")
    return str(Path(path).expanduser())


def render_flags(v: VllmSection, *, host: str, port: int) -> list[str]:
    out: list[str] = []
    data = v.model_dump()
    data["host"], data["port"] = host, port
    for key, val in data.items():
        if key in _NOT_FLAGS or val is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(val, bool):
            if key in _TRISTATE:
                out.append(flag if val else "--no-" + key.replace("_", "-"))
            elif val:
                out.append(flag)
        elif isinstance(val, (dict, list)):
            out += [flag, json.dumps(val, separators=(",", ":"))]
        else:
            out += [flag, str(val)]
    return out + list(v.extra_args)


def check_plan(profile: Profile) -> None:
    """Refuse, before anything starts, a seat that cannot be what the profile claims."""
    p, v = profile, profile.vllm
    tp = v.tensor_parallel_size
    if p.moe.kernel == "lna2":
        if v.speculative_config and v.speculative_config.get("num_speculative_tokens") is None:
            # vLLM fills it in (DSpark's block size, MTP's n_predict): counted here as 0, every decode
            # step would be (1 + k)x the rows checked against the ceiling and go to the incumbent
            raise ProfileError(f"profile {p.name}: vllm.speculative_config gives no num_speculative_tokens, so vLLM "
                               "chooses it and the decode rows the lna2 row ceiling must hold are unknown",
                               hint="set vllm.speculative_config.num_speculative_tokens (the canon seat's is 3)")
        ub = ubatching_flag(v.extra_args)
        if ub:
            # the worker refuses it at load as well (from vLLM's resolved config); said here before a launch
            raise ProfileError(f"profile {p.name}: vllm.extra_args {ub[0]} splits each step into {ub[1]} "
                               f"micro-batches, {UBATCH_WHY}",
                               hint="drop it from vllm.extra_args, or set moe.kernel=incumbent")
        rows = p.decode_rows()
        cc = v.compilation_config or {}
        padded = graph_rows(rows, cc.get("cudagraph_capture_sizes"), p.spec_tokens(),
                            v.max_num_batched_tokens) if p.cuda_graphs() else rows
        if rows <= p.moe.row_ceiling < padded:
            # the captured graph of that size holds the incumbent (captured above the ceiling), and a
            # replay enters no Python: no decline line, no counter, every decode step on the wrong kernel
            raise ProfileError(
                f"profile {p.name}: a decode step of {rows} rows replays the CUDA graph captured at {padded} rows "
                f"(vllm.compilation_config.cudagraph_capture_sizes), above the lna2 row ceiling {p.moe.row_ceiling}",
                hint=f"add {rows} to cudagraph_capture_sizes, or drop the sizes above {p.moe.row_ceiling}")
        if rows > p.moe.row_ceiling:
            k = p.spec_tokens()
            fit = max(1, p.moe.row_ceiling // (1 + k))
            raise ProfileError(
                f"profile {p.name}: vllm.max_num_seqs: {v.max_num_seqs} x (1 + {k} speculative) = {rows} decode rows "
                f"exceed the lna2 row ceiling {p.moe.row_ceiling}",
                hint=f"set vllm.max_num_seqs <= {fit}, or moe.kernel=incumbent")
    if p.model.wo_a_rank_slices and tp != p.model.wo_a_rank_slices:
        raise ProfileError(
            f"profile {p.name}: vllm.tensor_parallel_size is {tp} but the pack stores attn.wo_a as "
            f"{p.model.wo_a_rank_slices} rank-local slices", hint=f"set vllm.tensor_parallel_size={p.model.wo_a_rank_slices}")
    if p.gpus.ids and len(p.gpus.ids) != tp:
        raise ProfileError(
            f"profile {p.name}: gpus.ids lists {len(p.gpus.ids)} GPUs but vllm.tensor_parallel_size is {tp}",
            hint="give exactly one GPU id per tensor-parallel rank")
    if len(set(p.gpus.ids)) != len(p.gpus.ids):
        twice = sorted({i for i in p.gpus.ids if p.gpus.ids.count(i) > 1})
        raise ProfileError(f"profile {p.name}: gpus.ids {p.gpus.ids} repeats GPU {','.join(map(str, twice))}",
                           hint="list each GPU once, one per tensor-parallel rank")
    needs_gpus = [why for why, yes in (("quantization exl3", v.quantization == "exl3"),
                                       ("moe.kernel lna2", p.moe.kernel == "lna2"),
                                       (f"gpus.model {p.gpus.model}", bool(p.gpus.model))) if yes]
    if p.runtime.kind == "docker" and not p.gpus.ids and needs_gpus:
        # without --gpus the container sees no GPU at all (a CPU image's seat lists none, rightly),
        # and vLLM fails only after the image has started
        raise ProfileError(f"profile {p.name}: a docker seat of {needs_gpus[0]} needs gpus.ids (the container is given "
                           "only those GPUs)", hint=f"set gpus.ids to the {tp} host GPU indices of the seat")
    for var in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        if var in p.env:  # the launcher derives it from gpus.ids (native) or --gpus (docker)
            raise ProfileError(f"profile {p.name}: env.{var} would override the seat's GPUs behind the checks' back",
                               hint=f"drop env.{var} and set gpus.ids")
    if is_public_host(v.host) and not v.allow_public_host:
        raise ProfileError(
            f"profile {p.name}: vllm.host {v.host or '(empty)'} would expose the seat on every interface",
            hint="use 127.0.0.1, or set vllm.allow_public_host=true to opt in")
    env = p.env
    strict_env = env.get("VLLM_EXL3_MOE_STRICT")
    if (p.moe.kernel == "lna2" or strict_env is not None) and strict_env != str(p.moe.strict):
        # the launcher sets it from moe.strict: a different value written here was silently replaced
        raise ProfileError(f"profile {p.name}: moe.strict is {p.moe.strict} but env.VLLM_EXL3_MOE_STRICT is "
                           f"{strict_env or 'unset'}", hint=f"set env.VLLM_EXL3_MOE_STRICT={p.moe.strict}")
    image_kernel = (env.get("VLLM_EXL3_MOE_KERNEL") or "exllamav3").strip().lower()
    if p.moe.kernel == "lna2" and image_kernel not in ("exllamav3", "auto", "incumbent"):
        # dsv4serve's lna2 replaces the method's apply; what it hands back (prefill above the ceiling,
        # strict-0 declines) and what its parity check compares with is that apply: it must be the
        # incumbent exl3_moe, not the image's own lna path (which also needs the image's vllm_exl3_c)
        raise ProfileError(f"profile {p.name}: env.VLLM_EXL3_MOE_KERNEL={env['VLLM_EXL3_MOE_KERNEL']} puts the "
                           "image's own kernel beneath dsv4serve's lna2, where the incumbent exl3_moe must be (the "
                           "calls lna2 hands back and its parity check's reference)",
                           hint="set env.VLLM_EXL3_MOE_KERNEL=exllamav3 (moe.kernel=lna2 is dsv4serve's kernel)")
    if p.moe.kernel == "lna2":
        batched = v.max_num_batched_tokens
        if p.moe.strict >= 2 and (batched is None or batched > p.moe.row_ceiling):
            # strict 2 raises on any call above the ceiling, and vLLM's first pass (the profile run,
            # a prefill chunk) is max_num_batched_tokens rows: such a seat cannot boot
            raise ProfileError(f"profile {p.name}: moe.strict 2 raises on every MoE call above the row ceiling "
                               f"{p.moe.row_ceiling}, and vLLM's prefill passes take "
                               f"{batched if batched else 'its default'} rows (vllm.max_num_batched_tokens)",
                               hint="use moe.strict 1 (prefill goes to the incumbent, every other decline fails "
                                    f"the seat), or set vllm.max_num_batched_tokens <= {p.moe.row_ceiling}")
        if p.moe.tuning:
            tuning_table(p)  # unreadable or not a table: refused here, not in eight workers
    elif image_kernel not in ("exllamav3", "auto", "incumbent"):
        # lna / native / lna2 pick one of the image's own kernels: the seat would run it while
        # dsv4serve reports the incumbent (a restore carries no MOE_KERNEL, seat-reference 4.5)
        raise ProfileError(f"profile {p.name}: env.VLLM_EXL3_MOE_KERNEL={env['VLLM_EXL3_MOE_KERNEL']} but moe.kernel is "
                           f"{p.moe.kernel}", hint="drop env.VLLM_EXL3_MOE_KERNEL (dsv4serve's lna2 is moe.kernel=lna2)")
    else:
        if p.moe.tuning:
            raise ProfileError(f"profile {p.name}: moe.tuning picks lna2 builds but moe.kernel is {p.moe.kernel}",
                               hint="drop moe.tuning, or set moe.kernel=lna2")
        proof = next((m.text for m in p.gates.markers if LNA2_ACTIVE_ANY in m.text), None)
        if proof is not None:  # a gate no seat of this kernel can pass: up would wait its whole timeout
            raise ProfileError(f"profile {p.name}: gates wait for '{proof}' but moe.kernel is {p.moe.kernel}, which "
                               "never prints it", hint="drop that gates.markers entry (the incumbent profile lists "
                               "its own gates), or set moe.kernel=lna2")
    if v.quantization == "exl3":
        # Both are silent hangs (seat-reference trap 3a/3b), not errors vLLM would report.
        for var, want, why in (("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "1", "two EXL3 kernels on two streams deadlock"),
                               ("LNA_DSV4_AUX_STREAMS", "0", "DSV4 aux streams hang warmup with graphs on")):
            if env.get(var) != want:
                raise ProfileError(f"profile {p.name}: env.{var} must be {want} for an EXL3 seat ({why})",
                                   hint=f"set env.{var}={want}")
    if p.runtime.kind == "native" and p.moe.extension:
        raise ProfileError(f"profile {p.name}: moe.extension is mounted into a docker seat's image; a native seat "
                           "loads the default build", hint="drop moe.extension, and run `dsv4serve kernel build` "
                                                           "(or export DSV4SERVE_LNA2_EXT=FILE)")
    if p.runtime.kind == "native" and p.runtime.exl3_extension:
        raise ProfileError(f"profile {p.name}: runtime.exl3_extension is mounted into a docker seat's image; a native "
                           "seat imports the installed exllamav3", hint="drop runtime.exl3_extension, and rebuild the "
                           "installed exllamav3 after `dsv4serve patch apply`")
    if p.moe.kernel != "lna2" and p.moe.extension:
        raise ProfileError(f"profile {p.name}: moe.extension is an lna2 build, and moe.kernel is {p.moe.kernel}: "
                           "nothing would load it", hint="drop moe.extension, or set moe.kernel=lna2")
    if p.model.demo and p.model.path:
        raise ProfileError(f"profile {p.name}: model.path is set and model.demo is true: the demo model would be "
                           f"served, not {p.model.path}", hint="set model.demo=false to serve model.path, or drop "
                           "model.path")
    if p.runtime.kind == "docker" and v.host and _numeric_host(v.host) is None:
        raise ProfileError(f"profile {p.name}: vllm.host {v.host} is a name, and docker's -p takes an IP address",
                           hint="use 127.0.0.1 (or the address the name stands for)")
    if p.runtime.kind == "docker" and not p.runtime.image:
        raise ProfileError(f"profile {p.name}: runtime.image is required for the docker runtime")


def _plugin_env(profile: Profile, run_id: str, run_dir: Path) -> dict[str, str]:
    env = {PLUGIN_ENV_RUN_ID: run_id, PLUGIN_ENV_RUN_DIR: str(run_dir), PLUGIN_ENV_KERNEL: profile.moe.kernel,
           PLUGIN_ENV_STRICT: str(profile.moe.strict)}
    if profile.moe.kernel == "lna2":
        # the profile's row_ceiling is what the user typed; the worker holds the build that runs
        env[PLUGIN_ENV_DECODE_ROWS] = str(profile.decode_rows())
        if profile.moe.tuning:
            # the run's own copy (write_tuning): the run dir is at the same path inside a container, and
            # the table the seat ran with stays beside its logs however the original changes later
            env[PLUGIN_ENV_TUNING] = str(run_dir / TUNING_COPY)
    return env


def tuning_path(profile: Profile) -> Path | None:
    """moe.tuning with {cache} / {home} expanded (None when unset)."""
    v = _state_path(profile.moe.tuning, "moe.tuning")
    return Path(v) if v else None


def tuning_table(profile: Profile) -> tuple[Path, Any, str, bytes] | None:
    """(path, table, digest, bytes) of the profile's tuning table, or ProfileError naming what is wrong."""
    from dsv4serve.lna2 import tuning

    path = tuning_path(profile)
    if path is None:
        return None
    try:
        data = tuning.read_bytes(path)
    except tuning.TuningError as e:
        raise ProfileError(f"profile {profile.name}: moe.tuning: {e}",
                           hint="write it with `dsv4serve kernel check --bench --save-tuning FILE` on the seat's "
                                "card, or drop moe.tuning") from None
    try:
        table, digest = tuning.parse(data, str(path))
    except tuning.TuningError as e:
        raise ProfileError(f"profile {profile.name}: {e}", hint="write it again with `dsv4serve kernel check --bench "
                           "--save-tuning FILE`, or drop moe.tuning") from None
    return path, table, digest, data


def write_tuning(profile: Profile, run_dir: Path) -> str | None:
    """Copy the profile's tuning table into the run dir (atomically) for the workers; its digest."""
    from dsv4serve.state import atomic_write

    got = tuning_table(profile) if profile.moe.kernel == "lna2" else None
    if got is None:
        return None
    _, _, digest, data = got
    atomic_write(run_dir / TUNING_COPY, data, mode=0o644)
    return digest


def build(profile: Profile, run_id: str, run_dir: Path, python: str | None = None) -> LaunchSpec:
    spec = _build(profile, run_id, run_dir, python)
    from dsv4serve.readiness import unsendable

    # readiness, check-seat and bench send it in a header: one they cannot send fails the seat after
    # it came up, as a crashed probe
    if (where := unsendable(seat_api_key(spec.runtime, spec.argv, spec.env))) is not None:
        raise ProfileError(f"profile {profile.name}: the seat's API key (--api-key / VLLM_API_KEY) has a character an "
                           f"HTTP header cannot carry ({where})", hint="use a key of printable ASCII characters")
    return spec


def _build(profile: Profile, run_id: str, run_dir: Path, python: str | None = None) -> LaunchSpec:
    check_plan(profile)
    ctx = placeholders(profile, run_dir)
    ctx["model_path"] = model_path = resolve_model_path(profile)
    env = {k: _expand(val, ctx, f"env.{k}") for k, val in profile.env.items()}
    env.update(_plugin_env(profile, run_id, run_dir))
    v = profile.vllm
    if profile.runtime.kind == "native":
        if profile.gpus.ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, profile.gpus.ids))
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        env.setdefault("PYTHONUNBUFFERED", "1")
        vargs = ["--model", model_path, "--served-model-name", profile.model.served_name]
        vargs += render_flags(v, host=v.host, port=v.port)
        argv = [python or sys.executable, *NATIVE_ENTRYPOINT, *vargs]
        return LaunchSpec(runtime="native", argv=argv, env=env, vllm_args=vargs, host=v.host, port=v.port,
                          model_path=model_path, served_name=profile.model.served_name, run_id=run_id,
                          run_dir=str(run_dir))
    return _build_docker(profile, run_id, run_dir, env, ctx, model_path)


def _build_docker(profile: Profile, run_id: str, run_dir: Path, env: dict[str, str], ctx: dict[str, str],
                  model_path: str) -> LaunchSpec:
    rt, v = profile.runtime, profile.vllm
    if not model_path.startswith("/") and any("{model_path}" in m.host for m in rt.mounts):
        # mounted at the same path: else the mount check below blames runtime.mounts for it (a
        # profile that does not mount it may name a hub repo, which vLLM fetches itself)
        raise ProfileError(f"profile {profile.name}: model.path {model_path} is relative: a docker seat mounts the "
                           "pack at the same path inside the image",
                           hint="give model.path as an absolute path (or start it with {home} or {cache})")
    if not model_path.startswith("/") and Path(model_path).is_dir():
        # the host checks read the pack here, relative to this directory; inside the image the same
        # name resolves against the container's working directory (or is taken for a hub repo id)
        raise ProfileError(f"profile {profile.name}: model.path {model_path} is a directory relative to "
                           f"{Path.cwd()} here, and inside the container a relative path resolves against the "
                           "container's working directory",
                           hint="give model.path as an absolute path and mount it with runtime.mounts "
                                "({host: '{model_path}', container: '{model_path}'})")
    argv = ["docker", "run", "--name", rt.container_name, "--label", f"dsv4serve.run_id={run_id}",
            "--label", f"dsv4serve.profile={profile.name}"]
    if profile.gpus.ids:
        # docker splits --gpus on commas unless the device list is itself quoted
        argv += ["--gpus", '"device=' + ",".join(map(str, profile.gpus.ids)) + '"']
    if rt.ipc_host:
        argv.append("--ipc=host")
    argv += [f"--shm-size={rt.shm_size}"]
    if not rt.core_dumps:
        argv += ["--ulimit", "core=0"]
    argv += [f"--cap-add={c}" for c in rt.cap_add]
    bare = _numeric_host(v.host) or v.host.strip("[]")  # the address it spells: docker takes 127.0.0.1, not 127.1
    argv += ["-p", f"{f'[{bare}]' if ':' in bare else bare}:{v.port}:{rt.container_port}"]  # docker's IPv6 form
    if profile.moe.kernel == "lna2":
        # the file the mount below puts there, and only it: the loader then reports that file's own
        # load error (another Python's or torch's build) instead of "not built" for the host's path
        env = {**env, LNA2_EXT_ENV: f"{rt.site_packages.rstrip('/')}/{LNA2_SO}"}
    for k, val in env.items():
        argv += ["-e", f"{k}={val}"]
    mounts = [(_expand(m.host, ctx, "runtime.mounts.host"), _expand(m.container, ctx, "runtime.mounts.container"),
               m.read_only) for m in rt.mounts]
    mounts += _overlay_mounts(profile, run_dir)
    mounts += patched_file_mounts(profile)
    targets: dict[str, str] = {}
    for host_path, cont, ro in mounts:
        if ":" in host_path or ":" in cont:  # -v splits on ':': docker would mount something else
            bad = host_path if ":" in host_path else cont
            raise ProfileError(f"docker mount path {bad} contains ':', which `docker run -v` reads as a separator",
                               hint="use paths without ':' (for the state dir: DSV4SERVE_HOME)")
        if not host_path.startswith("/") or not cont.startswith("/"):
            # docker takes a relative source for a named volume (silently created, empty) and
            # refuses a relative target only at `docker run`
            bad = host_path if not host_path.startswith("/") else cont
            raise ProfileError(f"docker mount path {bad} is relative: docker would read a source as a volume name "
                               "(created empty) and refuses a relative target", hint="give both sides of "
                               "runtime.mounts as absolute paths (or start the host side with {home} or {cache})")
        if cont in targets:  # the later mount would hide the earlier one, unseen by the checks
            raise ProfileError(f"docker mounts {targets[cont]} and {host_path} both at {cont}",
                               hint="give each runtime.mounts entry its own container path")
        targets[cont] = host_path
        argv += ["-v", f"{host_path}:{cont}" + (":ro" if ro else "")]
    argv += list(rt.extra_args)
    argv.append(rt.image or "")
    # Inside the container vLLM listens on all interfaces of the container; the host side of
    # the port mapping above is what decides exposure.
    vargs = [model_path, "--served-model-name", profile.model.served_name]
    vargs += render_flags(v, host="0.0.0.0", port=rt.container_port)
    argv += vargs
    return LaunchSpec(runtime="docker", argv=argv, env={}, vllm_args=vargs, host=v.host, port=v.port,
                      model_path=model_path, served_name=profile.model.served_name,
                      container_name=rt.container_name, run_id=run_id, run_dir=str(run_dir))


def docker_mount_sources(argv: list[str]) -> list[tuple[str, bool]]:
    """(host side, read-only) of every `-v HOST:CONTAINER[:ro]` of a docker argv (no ':' in either
    side: _build_docker refuses it)."""
    return [(argv[i + 1].split(":", 1)[0], argv[i + 1].endswith(":ro")) for i, a in enumerate(argv[:-1]) if a == "-v"]


def _overlay_mounts(profile: Profile, run_dir: Path) -> list[tuple[str, str, bool]]:
    """What dsv4serve itself puts into the image: its plugin (package + entry-point metadata), the
    run dir (counters), and the lna2 extension when the seat uses it."""
    sp = profile.runtime.site_packages.rstrip("/")
    pkg = Path(__file__).resolve().parent
    out = [(str(run_dir), str(run_dir), False),
           (str(pkg), f"{sp}/dsv4serve", True),
           (str(run_dir / "plugin-dist-info"), f"{sp}/dsv4serve-plugin.dist-info", True)]
    if profile.moe.kernel == "lna2":
        out.append((lna2_mounted(profile), f"{sp}/{LNA2_SO}", True))
    exl3 = exl3_extension_path(profile)
    if exl3:  # over the image's own module of the same name: the patched CUDA fixes run only from a rebuild
        out.append((exl3, f"{sp}/{Path(exl3).name}", True))
    return out


def _state_path(value: str | None, where: str) -> str | None:
    """A profile path with {home} / {cache} expanded (None when unset)."""
    if not value:
        return None
    return _expand(value, {"home": str(home.home()), "cache": str(home.cache_dir())}, where)


def lna2_extension_path(profile: Profile) -> str | None:
    """moe.extension with {cache} / {home} expanded, for the docker seat that mounts it (None when
    unset: the default build is mounted)."""
    return _state_path(profile.moe.extension, "moe.extension")


def lna2_mounted(profile: Profile) -> str:
    """The lna2 build a docker seat mounts: moe.extension, else the default build."""
    from dsv4serve.lna2.build import default_out

    return lna2_extension_path(profile) or str(default_out() / LNA2_SO)


def lna2_launched(profile: Profile) -> dict[str, str | None] | None:
    """The lna2 build file a seat's workers load and the build its metadata names, as `up` found them
    (None for an incumbent seat): a docker seat's mount; a native seat's workers inherit this
    process's DSV4SERVE_LNA2_EXT (the profile cannot set it), so they resolve the path the loader
    resolves here. Kept in the seat's state, so check-seat compares the ranks with what up launched,
    not with whatever the shell that runs check-seat would load."""
    if profile.moe.kernel != "lna2":
        return None
    from dsv4serve.lna2 import loader

    path = Path(lna2_mounted(profile)) if profile.runtime.kind == "docker" else loader.candidates()[0]
    info = loader.describe_file(path, "the lna2 build")
    return {"path": str(path), "build_id": info.get("build_id") if info.get("loadable") else None}


def exl3_extension_path(profile: Profile) -> str | None:
    """runtime.exl3_extension with {cache} / {home} expanded (None when unset)."""
    return _state_path(profile.runtime.exl3_extension, "runtime.exl3_extension")


def patched_file_mounts(profile: Profile) -> list[tuple[str, str, bool]]:
    """Every file of the profile's patch sets, from runtime.patch_root (the host copy of the
    image's site-packages that `patch apply` patches and `up` verifies by hash) over the same path
    in the image's site-packages, read-only: the container runs exactly the bytes that were checked.

    Without a patch_root nothing is mounted and the image must carry its own patched files.
    CUDA sources of a set (`rebuild: true`) take effect only through a rebuilt extension.
    """
    if not profile.patches or not profile.runtime.patch_root:
        return []
    from dsv4serve import patches  # manifests: which files a set patches, relative to site-packages

    root = patches.profile_root(profile)
    sp = profile.runtime.site_packages.rstrip("/")
    out: dict[str, tuple[str, str, bool]] = {}
    for name in profile.patches:
        for f in patches.load_set(name).files:
            # docker refuses two mounts on one target; two sets patching one file cannot both verify
            out.setdefault(f.path, (str(root / f.path), f"{sp}/{f.path}", True))
    return list(out.values())


def write_plugin_dist_info(run_dir: Path) -> Path:
    """Entry-point metadata that makes vLLM inside a container discover the mounted plugin."""
    d = run_dir / "plugin-dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: dsv4serve-plugin\nVersion: 0.1.0\n")
    (d / "entry_points.txt").write_text("[vllm.general_plugins]\ndsv4serve = dsv4serve.vllm_plugin:register\n")
    return d


# The plugin's run channel: set by this launch alone. One exported in the user's shell (a
# DSV4SERVE_LNA2_TUNING left from a device session) reached the workers of a seat whose profile
# names no table. DSV4SERVE_HOME and DSV4SERVE_LNA2_EXT pass: the CLI's checks read the same ones.
_RUN_CHANNEL = (PLUGIN_ENV_RUN_ID, PLUGIN_ENV_RUN_DIR, PLUGIN_ENV_KERNEL, PLUGIN_ENV_DECODE_ROWS, PLUGIN_ENV_TUNING)


def env_for_child(spec: LaunchSpec) -> dict[str, str]:
    # a native seat inherits this shell, but not what would hide its log lines from the gates, nor
    # a kernel choice the plan did not check (a shell left with the old VLLM_EXL3_MOE_KERNEL=lna2)
    env = {k: v for k, v in os.environ.items() if k not in _RUN_CHANNEL and k not in LOG_FORMAT_ENV
           and k not in ("VLLM_EXL3_MOE_KERNEL", "VLLM_EXL3_MOE_STRICT")
           and not (k == "VLLM_LOGGING_LEVEL" and quiet_level(v))}
    env.update(spec.env)
    return env


def api_key(vllm_args: list[str], env: dict[str, str]) -> str | None:
    """A key the seat's API server takes on its /v1 paths, read as vLLM's parser reads its argv:
    the last --api-key wins (spelled --api_key too, or any prefix from --api-k, which argparse
    completes), any one of its values is accepted; else VLLM_API_KEY as the server process sees it."""
    key = None
    for i, a in enumerate(vllm_args):
        flag, eq, val = a.partition("=")
        flag = "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag
        if len(flag) < len("--api-k") or not "--api-key".startswith(flag):
            continue
        if eq:
            key = val or None
        elif i + 1 < len(vllm_args) and not vllm_args[i + 1].startswith("-"):
            key = vllm_args[i + 1]
    return key or env.get("VLLM_API_KEY") or None


def seat_api_key(runtime: str, argv: list[str], env: dict[str, str]) -> str | None:
    """api_key() of a seat from its launch argv and env (a LaunchSpec's or a SeatState's): a native
    server inherits this shell's environment plus `env`, a container sees only its `-e` entries."""
    if runtime == "native":
        return api_key(argv, {**os.environ, **env})
    return api_key(argv, dict(a.split("=", 1) for flag, a in zip(argv, argv[1:]) if flag == "-e" and "=" in a))


def key_fingerprint(key: str | None, salt: str) -> str:
    """A digest that tells two keys apart without recording either ('' for no key). Salted with the
    run id, so it matches nothing outside that run's state file; never printed."""
    if not key:
        return ""
    return hashlib.sha256(f"{salt}\0{key}".encode("utf-8", "surrogateescape")).hexdigest()[:16]


def running_seat_key(st: Any) -> str | None:
    """The API key to send to a running seat (a SeatState): its own from the launch, or this shell's
    VLLM_API_KEY for a native seat; BadInput when that is not the key its server was started with
    (a native seat inherits the key of the shell that ran `up`, which this shell may not have)."""
    key = seat_api_key(st.runtime, st.argv, st.env)
    want = getattr(st, "api_key_fp", None)
    # a state written before the salt held sha256(key)[:12]
    have = key_fingerprint(key, st.run_id) if not want or len(want) != 12 else (
        hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:12] if key else "")
    if want and have != want:
        raise BadInput(f"seat {st.seat}'s server was started with an API key and this shell "
                       + ("has no VLLM_API_KEY" if not key else "has another one in VLLM_API_KEY"),
                       hint="export the VLLM_API_KEY of the shell that ran `up` (bench also takes --api-key KEY)")
    return key


def describe_gates(profile: Profile) -> dict[str, Any]:
    tp = profile.vllm.tensor_parallel_size
    return {
        "markers": [{"text": m.text, "ranks": tp if m.ranks == "all" else m.ranks} for m in profile.gates.markers],
        "kv_cache_min_tokens": profile.kv_min_tokens(),
        "forbidden": list(profile.gates.forbidden),
        "timeouts": profile.gates.timeouts.model_dump(),
        "readiness": ["/health 200", f"/v1/models lists {profile.model.served_name}",
                      "a canary chat completion returns tokens" + (
                          "" if profile.gates.canary.expect is None
                          else f" and its answer matches /{profile.gates.canary.expect}/")],
        "ranks": tp,
    }
