"""The dsv4serve command line. Thin: it parses, calls a module, renders the result."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

import typer

from dsv4serve.cli_common import console, dir_path, emit_json, emit_json_line, err_console, error_doc, handled

app = typer.Typer(
    name="dsv4serve",
    help="Bring up, prove and take down a DeepSeek-V4-Flash-Vision EXL3 seat under vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
profiles_app = typer.Typer(help="List and show seat profiles.", no_args_is_help=True)
kernel_app = typer.Typer(help="Build and inspect the lna2 routed-expert kernel.", no_args_is_help=True)
app.add_typer(profiles_app, name="profiles")
app.add_typer(kernel_app, name="kernel")


def _register_subapps() -> None:
    from dsv4serve.cli_bench import app as bench_app
    from dsv4serve.cli_patch import app as patch_app

    app.add_typer(patch_app, name="patch")
    app.add_typer(bench_app, name="bench")


_register_subapps()

ProfileOpt = typer.Option(..., "--profile", "-p", help="a shipped profile name or a path to a YAML file")
SetOpt = typer.Option(None, "--set", help="override a profile key: --set vllm.port=8123 (repeatable)")


# ---------------------------------------------------------------------------------------------
# profiles


@profiles_app.command("list")
def profiles_list(json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """List the shipped seat profiles."""
    from rich import box
    from rich.table import Table

    from dsv4serve.profile import load_profile, shipped_profiles

    with handled(json_out):
        rows = []
        for name, path in shipped_profiles().items():
            p = load_profile(name)
            rows.append({"name": name, "runtime": p.runtime.kind, "tp": p.vllm.tensor_parallel_size,
                         "gpus": len(p.gpus.ids), "max_model_len": p.vllm.max_model_len,
                         "seqs": p.vllm.max_num_seqs, "spec": p.spec_tokens(), "kernel": p.moe.kernel,
                         "strict": p.moe.strict, "description": p.description, "path": str(path)})
        if json_out:
            emit_json(rows)
            return
        t = Table(title="seat profiles", box=box.SIMPLE_HEAD, pad_edge=False)
        # the name is what users copy into --profile: never cut it, let the other columns give way
        t.add_column("name", no_wrap=True, min_width=max(len(r["name"]) for r in rows) if rows else 4)
        for col in ("runtime", "TP", "window", "seqs", "spec", "kernel (strict)"):
            t.add_column(col, no_wrap=True)
        for r in rows:
            t.add_row(r["name"], r["runtime"], str(r["tp"]), str(r["max_model_len"] or "-"), str(r["seqs"] or "-"),
                      str(r["spec"]), f"{r['kernel']} ({r['strict']})")
        console.print(t)


@profiles_app.command("show")
def profiles_show(name: str = typer.Argument(..., help="profile name or YAML path"),
                  overrides: Optional[List[str]] = SetOpt,
                  json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Show a profile fully resolved (extends and --set applied)."""
    import yaml

    from dsv4serve.profile import load_profile

    with handled(json_out):
        p = load_profile(name, overrides)
        data = p.model_dump(mode="json")
        if json_out:
            emit_json(data)
        else:
            console.print(f"# {p.name} (digest {p.digest()})", highlight=False)
            console.print(yaml.safe_dump(data, sort_keys=False), highlight=False, markup=False)


# ---------------------------------------------------------------------------------------------
# up / down / status / logs


@app.command()
def up(profile: str = ProfileOpt,
       overrides: Optional[List[str]] = SetOpt,
       dry_run: bool = typer.Option(False, "--dry-run", help="print what would run; start nothing"),
       json_out: bool = typer.Option(False, "--json", help="JSON (dry run: one object; live: event lines)"),
       foreground: bool = typer.Option(False, "--foreground", help="stay attached; Ctrl-C tears the seat down"),
       apply_patches: bool = typer.Option(False, "--apply-patches", help="apply the profile's patch sets first"),
       validate: bool = typer.Option(True, "--validate/--no-validate", help="check argv with vLLM's parser"),
       skip_checks: bool = typer.Option(False, "--skip-checks", help="do not run check-seat's pre-launch checks")) -> None:
    """Bring a seat up and return once it is provably ready (markers on every rank, a real completion)."""
    from dsv4serve import seat

    # live `up --json` streams event lines, so its error is one more line; a dry run is one document
    with handled(json_out and dry_run, event_lines=json_out and not dry_run):
        p = seat.load(profile, overrides)
        if dry_run:
            plan = seat.dry_run(p, validate=validate, apply_patches=apply_patches, skip_checks=skip_checks,
                                foreground=foreground)
            if json_out:
                emit_json(plan)
            else:
                seat.render_plan(plan)
            return
        code = seat.up(p, json_events=json_out, foreground=foreground, apply_patches=apply_patches,
                       skip_checks=skip_checks, overrides=list(overrides or []), validate=validate)
        raise typer.Exit(code)


def _grace_seconds(value: Optional[float]) -> Optional[float]:
    # click's own range check compares, and every comparison with nan is false, so `--grace nan`
    # was refused as "above 3600"; one check names the real bounds for nan, inf and negatives alike.
    if value is not None and not (math.isfinite(value) and 0.0 <= value <= 3600.0):
        raise typer.BadParameter(f"{value:g} is not a number of seconds from 0 to 3600; e.g. --grace 20")
    return value


@app.command()
def down(profile: Optional[str] = typer.Option(None, "--profile", "-p", help="which seat (default: the only one)"),
         grace: Optional[float] = typer.Option(None, "--grace", callback=_grace_seconds,
                                               help="seconds between SIGTERM and SIGKILL (at most an hour)"),
         json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Stop a seat: the whole process group, its leftovers, and proof nothing is left."""
    from dsv4serve import seat

    with handled(json_out):
        report = seat.down(profile, grace=grace)
        if json_out:
            emit_json(report)
        else:
            seat.render_down(report)
        if report.get("signal"):  # the stop finished, cut short: the shell's code for that signal
            raise typer.Exit(report["signal"]["exit_code"])
        raise typer.Exit(0 if report.get("clean", True) else 1)


@app.command()
def status(profile: Optional[str] = typer.Option(None, "--profile", "-p", help="which seat (default: all)"),
           json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Phase, uptime, processes, endpoint and per-rank proof of every known seat."""
    from dsv4serve import seat

    with handled(json_out):
        rows = seat.status(profile)
        if json_out:
            emit_json(rows)
        else:
            seat.render_status(rows)


@app.command()
def logs(profile: Optional[str] = typer.Option(None, "--profile", "-p", help="which seat"),
         rank: Optional[str] = typer.Option(None, "--rank", "-r", help="a rank number, 'api' or 'engine'"),
         follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines"),
         lines: int = typer.Option(200, "--lines", "-n", min=0, help="lines of history to print first")) -> None:
    """Print a seat's log, whole or one rank's stream."""
    from dsv4serve import seat

    with handled():
        seat.logs(profile, rank=rank, follow=follow, lines=lines)


# ---------------------------------------------------------------------------------------------
# demo model, checks, kernel


@app.command("demo-model")
def demo_model(out: Optional[Path] = typer.Option(None, "--out", parser=dir_path, metavar="DIR",
                                                 help="where to write it (default: state dir)"),
               seed: int = typer.Option(0, "--seed", help="RNG seed, 0 to 4294967295; the same seed gives the same model"),
               force: bool = typer.Option(False, "--force", help="rebuild even if a complete copy exists (only ever "
                                                                 "replaces a demo model's own files)")) -> None:
    """Write the tiny DeepSeek-V3-style MoE + MTP demo model (no network needed)."""
    from dsv4serve.demo_model import ensure_demo_model

    with handled():
        path = ensure_demo_model(out, seed=seed, force=force)
        console.print(f"demo model ready: {path}", highlight=False)


@app.command("check-seat")
def check_seat(profile: str = typer.Option("cpu-demo", "--profile", "-p", help="profile to check against"),
               overrides: Optional[List[str]] = SetOpt,
               json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Will this seat come up, and is the running seat really what it claims?"""
    from dsv4serve import checks

    with handled(json_out):
        p = checks.load_for_check(profile, overrides)
        report = checks.run_all(p)
        if json_out:
            emit_json(report.as_json())
        else:
            checks.render(report)
        raise typer.Exit(report.exit_code())


@kernel_app.command("build")
def kernel_build(arch: str = typer.Option("9.0;12.0", "--arch", help="TORCH_CUDA_ARCH_LIST to build for"),
                 out: Optional[Path] = typer.Option(None, "--out", parser=dir_path, metavar="DIR",
                                                       help="output directory"),
                 jobs: int = typer.Option(0, "--jobs", help="parallel compile jobs (0: all cores)"),
                 max_rows: int = typer.Option(32, "--max-rows", help="rows per call compiled in (1..32); fewer "
                                                                      "shrink shared memory, calls above go to the "
                                                                      "incumbent")) -> None:
    """Build the lna2 extension with torch's cpp_extension."""
    from dsv4serve.lna2 import build as lna2_build

    with handled():
        path = lna2_build.build(arch=arch, out=out, jobs=jobs or None, max_rows=max_rows)
        console.print(f"lna2 extension built: {path}", highlight=False)


@kernel_app.command("info")
def kernel_info(json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Report the lna2 extension: where it is, what it was built for, its limits."""
    from dsv4serve.lna2 import loader

    with handled(json_out):
        info = loader.describe()
        if json_out:
            emit_json(info)
        else:
            for k, v in info.items():  # one line each, piped or not: a path is never cut in two
                console.print(f"{k}: {v}", highlight=False, markup=False, soft_wrap=True)
        # loadable but not runnable here (no kernel image for this GPU): no good answer either
        raise typer.Exit(0 if info.get("loadable") and not info.get("device_error") else 1)


@kernel_app.command("check")
def kernel_check(
    rows: str = typer.Option("1,2,4,8,16,24", "--rows", help="decode rows per call to check, e.g. 1,4,16"),
    bits: str = typer.Option("2,3", "--bits", help="EXL3 bits per weight (K) to check"),
    codebook: str = typer.Option("mcg", "--codebook", help="codebooks to check: mcg, mul1"),
    hidden: int = typer.Option(4096, "--hidden", help="hidden size"),
    inter: int = typer.Option(256, "--inter", help="this rank's intermediate slice (2048 / TP: 256 at TP 8)"),
    experts: int = typer.Option(256, "--experts", help="routed experts in the layer"),
    top_k: int = typer.Option(6, "--top-k", help="experts per row"),
    gpu: int = typer.Option(0, "--gpu", help="local GPU to run on (torch's index)"),
    bench: bool = typer.Option(False, "--bench", help="also check and time every build the policy serves "
                                                      "somewhere, and say which is fastest on this card"),
    reps: int = typer.Option(30, "--reps", help="timed launches per build and case (median)"),
    seed: int = typer.Option(0, "--seed", help="seed of the random layer and inputs"),
    also: str = typer.Option("", "--also", help="with --bench, also check and time these builds the policy does "
                                                "not serve (e.g. 53), where they take the shape and fit"),
    save_tuning: Optional[Path] = typer.Option(None, "--save-tuning", metavar="FILE",
                                               help="with --bench, write this card's tuning table (the fastest "
                                                    "build per checked row count) for a profile's moe.tuning"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Run lna2 on a local GPU against the fp64 reference (and, with --bench, time its builds)."""
    from rich.table import Table

    from dsv4serve.lna2 import selfcheck

    with handled(json_out):
        spec = selfcheck.parse_spec(hidden, inter, experts, top_k, bits, codebook, rows, seed, bench, reps, also)
        if save_tuning is not None:
            selfcheck.tuning_target(save_tuning, bench)  # refused before minutes of GPU work, not after
        with err_console.status("lna2 kernel check") as st:
            report = selfcheck.run(spec, gpu, progress=lambda s: st.update(f"lna2 kernel check: {s}"))
        saved = selfcheck.save_tuning(report, save_tuning) if save_tuning is not None else None
        if json_out:
            # through pydantic's JSON: a missing figure is null, never a bare Infinity strict parsers refuse
            emit_json({"ok": report.ok, **json.loads(report.model_dump_json()), "tuning": saved})
        else:
            t = Table(title=f"lna2 on {report.device}: against the fp64 reference"
                            + (", cold medians" if spec.bench else ""))
            for h in selfcheck.headers(spec.bench):
                t.add_column(h)
            for r in selfcheck.table_rows(report):
                t.add_row(*r)
            console.print(t)
            if report.aborted:
                console.print(f"ABORTED: {report.aborted}", highlight=False)
            console.print("all cases pass" if report.ok else "FAILED: see the rows above", highlight=False)
            if saved and "refused" in saved:
                console.print(f"no tuning table written to {saved['path']}: {saved['refused']}", highlight=False,
                              markup=False, soft_wrap=True)
            elif saved:
                console.print(f"tuning table {saved['path']} (digest {saved['digest']}): "
                              + ("; ".join(saved["changes"]) or "the built-in policy's picks, confirmed here")
                              + f". Serve it with moe.tuning: {saved['path']}", highlight=False, markup=False,
                              soft_wrap=True)
        if saved and "refused" in saved and report.ok:
            raise typer.Exit(1)  # asked for a table and got none
        raise typer.Exit(0 if report.ok else 1)


def _usage_exceptions() -> Any:
    """The exception classes of the click that typer runs on (recent typer vendors its own)."""
    try:
        from typer._click import exceptions as cx
    except ImportError:
        from click import exceptions as cx
    return cx


def _usage_command(ctx: Any) -> str:
    """The command a usage error belongs to. An option missing its value fails before any
    context exists (ctx is None), so the subcommands named on the command line are followed from
    the root."""
    if ctx is not None:  # a context names its command (the root's own options stay the root's)
        return ctx.command_path
    path, cmd = "dsv4serve", typer.main.get_command(app)
    for word in (a for a in sys.argv[1:] if not a.startswith("-")):
        sub = getattr(cmd, "commands", {}).get(word)
        if sub is None:
            break
        path, cmd = f"{path} {word}", sub
    return path


def main() -> None:
    cx = _usage_exceptions()
    no_args = getattr(cx, "NoArgsIsHelpError", ())
    try:
        # standalone_mode=False: usage errors come back here instead of as typer's boxed panel, so
        # they are one line like every other refusal (exit 2 all the same)
        rc = app(standalone_mode=False)
    except no_args as e:
        # The exception is built from ctx.get_help(), which under rich prints the help itself and
        # returns ""; plain click returns the text. Print it only in the second case (else twice).
        if e.format_message().strip():
            print(e.format_message())
        raise SystemExit(2) from None
    except cx.UsageError as e:
        cmd = _usage_command(e.ctx)
        err_console.print(f"error: {e.format_message()} (see `{cmd} --help`)", highlight=False, markup=False,
                          soft_wrap=True)
        # the parse failed before any json_out was bound: the flag on the command line is all there is
        argv = sys.argv[1:]
        if "--json" in argv:
            doc = error_doc("UsageError", e.format_message(), f"see `{cmd} --help`", e.exit_code)
            if cmd.endswith(" up") and "--dry-run" not in argv:  # live up streams events, one per line
                emit_json_line({"t": round(time.time(), 3), "event": "error", **doc["error"]})
            else:
                emit_json(doc)
        raise SystemExit(e.exit_code) from None
    except cx.ClickException as e:
        err_console.print(f"error: {e.format_message()}", highlight=False, markup=False, soft_wrap=True)
        raise SystemExit(e.exit_code) from None
    except (KeyboardInterrupt, typer.Abort):
        err_console.print("interrupted")
        raise SystemExit(130) from None
    raise SystemExit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
