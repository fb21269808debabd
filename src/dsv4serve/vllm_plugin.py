"""dsv4serve's vLLM general plugin (entry point `vllm.general_plugins: dsv4serve`).

Inert unless dsv4serve launched the process (DSV4SERVE_RUN_ID set): a user's unrelated vLLM run
in the same environment is never changed: register() returns before importing anything.

vLLM calls register() in the API server (during arg parsing, before its logging is set up: we
write to stderr there), in EngineCore and in every worker (before init_device, so no TP rank
yet), and it may call it more than once per process. register() installs one hook, idempotently:
a wrapper of `BaseModelLoader.load_model`, which runs after weights are loaded and
`process_weights_after_loading` is done, for the target model and again for the MTP draft. In
there the TP rank is known (`vllm.distributed.parallel_state`), and the hook hands every
FusedMoE layer (`isinstance(m.quant_method, FusedMoEMethodBase)`) to `moe_dispatch.Runtime`,
which wraps its apply (lna2 dispatch for vllm-exl3 layers, call counting everywhere).

Lines it writes (through vLLM's logger outside the API server, so they carry vLLM's process
prefix, e.g. `(Worker_TP1 pid=N) WARNING ... [vllm_plugin.py:NN] dsv4serve plugin ready ...`):
  dsv4serve plugin loaded proc=<name> run=<id> kernel=<k> strict=<s> pid=<pid>   (once per process)
  dsv4serve plugin ready rank=<r>/<tp> moe_layers=<n> moe_method=<class> kernel=<lna2|incumbent|none>
  dsv4serve plugin draft rank=<r>/<tp> moe_layers=<n> moe_method=<class> kernel=<...>
  LNA2 MoE kernel ACTIVE rank=<r>/<tp> layers=<n> bits=<K,...> ext=<build id> policy=<builtin|tuned:<digest>
      tuned_rows=<row counts the table picks for> tuned_layers=<n>/<lna2 layers>>   (other rows: built-in)
  dsv4serve plugin lna2 tuning ...   (a tuning table ignored, or holding none of a layer's shapes)
  LNA2 declined: <reason> (...)
  dsv4serve plugin FAILED lna2 not ready: rank=<r>/<tp> layer=<name>: <reason> (VLLM_EXL3_MOE_STRICT=<s>)
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import sys
from typing import Any

_HOOK_FLAG = "_dsv4serve_hook"
_announced = False
_runtime: Any = None  # moe_dispatch.Runtime, made at the first model load of this process
_loads = 0
_ready_said = False


def register() -> None:
    if not os.environ.get("DSV4SERVE_RUN_ID"):
        return
    from dsv4serve import moe_dispatch

    global _announced
    proc = multiprocessing.current_process().name
    try:
        env = moe_dispatch.read_env(os.environ)
        summary = moe_dispatch.env_summary(env) if env else ""
    except moe_dispatch.PluginConfigError as e:
        # Fail closed, but where it counts: the worker's load hook raises the same error.
        summary = f"config error: {e}"
    if not _announced:
        _announced = True
        _say(f"dsv4serve plugin loaded proc={proc} {summary}", api_server=proc == "MainProcess", level=logging.INFO)
    _install_load_hook()


def _say(line: str, api_server: bool = False, level: int = logging.WARNING) -> None:
    """One plugin line. The API server's logging is not configured while plugins load, so a
    raw stderr write there. Elsewhere vLLM's own logger: vLLM 0.32 puts the process prefix
    (`(Worker_TP1 pid=N)`) on log records, not on print() output, and the rank parser and the
    gates key on that prefix. Gate lines go out at WARNING so VLLM_LOGGING_LEVEL=WARNING keeps
    them. Where vLLM has not configured its logging (0.32 does that per process, explicitly) a
    record would be dropped or reformatted, so the line is printed (flushed) instead."""
    if not api_server:
        try:
            from vllm.logger import init_logger

            lg = init_logger("vllm.dsv4serve")
            if logging.getLogger("vllm").handlers:
                lg.log(level, "%s", line)
                return
        except ImportError:
            pass
    print(line, file=sys.stderr if api_server else sys.stdout, flush=True)


def _install_load_hook() -> None:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    current = BaseModelLoader.load_model
    if getattr(current, _HOOK_FLAG, False):
        return  # register() ran before in this process

    @functools.wraps(current)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = current(self, *args, **kwargs)
        _after_load(model, args, kwargs)
        return model

    setattr(load_model, _HOOK_FLAG, True)
    # Loaders that override load_model (tensorizer, modelexpress, the weight-cache IPC loader)
    # bypass this; then no `plugin ready` line appears and the seat's marker gate fails.
    BaseModelLoader.load_model = load_model  # type: ignore[method-assign]


def _rank() -> tuple[int, int]:
    from vllm.distributed import parallel_state as ps

    try:
        if ps.model_parallel_is_initialized():
            return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError):
        pass
    return 0, 1


def _is_draft(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The first load in a process is the target; the drafter loads after it (its own config)."""
    if _loads > 1:
        return True
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    model_config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
    spec = getattr(vllm_config, "speculative_config", None)
    draft_cfg = getattr(spec, "draft_model_config", None)
    return draft_cfg is not None and model_config is draft_cfg and model_config is not getattr(
        vllm_config, "model_config", None)


def with_vllm_decode_rows(env: Any, vllm_config: Any) -> Any:
    """env with decode_rows recounted from the config vLLM resolved, when that is more than the
    launcher counted from the profile: vLLM fills in what a profile leaves out (the speculative
    token count) and pads a decode step to its CUDA-graph capture size, and a graph captured
    above the build's ceiling replays the incumbent on every step without a line or a count."""
    import dataclasses

    from dsv4serve.lna2.policy import graph_rows

    seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    if not isinstance(seqs, int) or seqs < 1:
        return env  # not a config this plugin knows: the launcher's count stands
    k = getattr(getattr(vllm_config, "speculative_config", None), "num_speculative_tokens", None)
    k = k if isinstance(k, int) and k > 0 else 0
    rows = seqs * (1 + k)
    why = f"vLLM's max_num_seqs {seqs} x (1 + {k} speculative tokens)"
    comp = getattr(vllm_config, "compilation_config", None)
    mode = getattr(comp, "cudagraph_mode", None)
    eager = bool(getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False))
    # an unresolved mode (None) is vLLM's default, graphs on: counted as such (fail closed)
    if not eager and getattr(mode, "name", str(mode)) != "NONE":
        batched = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
        padded = graph_rows(rows, getattr(comp, "cudagraph_capture_sizes", None), k,
                            batched if isinstance(batched, int) else None)
        if padded > rows:
            rows, why = padded, f"{why}, replayed in the CUDA graph captured at {padded} rows"
    if env.decode_rows is not None and rows <= env.decode_rows:
        return env
    return dataclasses.replace(env, decode_rows=rows, decode_rows_why=why)


def with_vllm_ubatches(env: Any, vllm_config: Any) -> Any:
    """env with the micro-batches vLLM's resolved config runs at once (dual batch overlap or
    ubatch_size): lna2 refuses them at load, since their MoE calls would share one scratch."""
    import dataclasses

    pc = getattr(vllm_config, "parallel_config", None)
    size = getattr(pc, "ubatch_size", 0)
    n = 2 if getattr(pc, "enable_dbo", False) is True else (size if isinstance(size, int) and size > 1 else 0)
    return dataclasses.replace(env, ubatches=n) if n else env


def moe_layers(model: Any) -> list[tuple[str, Any]]:
    """Every module whose quant method is a FusedMoE method (RoutedExperts in 0.32), once each."""
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    except ImportError:  # older layouts kept the base class in layer.py
        from vllm.model_executor.layers.fused_moe.layer import FusedMoEMethodBase  # type: ignore[no-redef]

    seen: set[int] = set()
    out = []
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if isinstance(qm, FusedMoEMethodBase) and id(qm) not in seen:
            seen.add(id(qm))
            out.append((name, m))
    return out


def _after_load(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    from dsv4serve import moe_dispatch
    from dsv4serve.lna2 import loader
    from dsv4serve.plugin_counters import Counters

    global _runtime, _loads, _ready_said
    env = moe_dispatch.read_env(os.environ)  # raises PluginConfigError: a bad env fails the worker
    if env is None:
        return
    _loads += 1
    draft = _is_draft(args, kwargs)
    if _runtime is None:
        if env.kernel == "lna2":
            vllm_config = kwargs.get("vllm_config", args[0] if args else None)
            env = with_vllm_ubatches(with_vllm_decode_rows(env, vllm_config), vllm_config)
        rank, tp = _rank()
        counters = Counters(env.run_dir, rank, tp, env.kernel)
        _runtime = moe_dispatch.Runtime(env, rank, tp, emit=_say, counters=counters, ext_loader=loader.load)
    rt = _runtime
    summary = rt.prepare(moe_layers(model), draft=draft)
    what = "draft" if draft else "ready"
    line = (f"dsv4serve plugin {what} {rt.who} moe_layers={len(summary.layers)} "
            f"moe_method={summary.method_names} kernel={rt.effective_kernel}")
    if rt.effective_kernel != env.kernel:
        line += f" requested={env.kernel}"
    if draft or not _ready_said:  # one ready line per worker process, after the target load
        _say(line, level=logging.INFO if draft else logging.WARNING)
        _ready_said = _ready_said or not draft
    rt.counters.start()  # idempotent: writes now, then every few seconds, and final at exit
