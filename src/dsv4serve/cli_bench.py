"""`dsv4serve bench` (tok/s table), `bench needle`, `bench ppl`: thin wrappers over dsv4serve.bench*."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Union

import typer
from rich.text import Text

from dsv4serve.cli_common import console, dir_path, emit_json, err_console, error_doc, handled, report_error
from dsv4serve.errors import BadInput, DsvError

if TYPE_CHECKING:  # the bench modules load lazily, so `--help` stays fast
    from dsv4serve.bench import BenchSettings
    from dsv4serve.bench_needle import NeedleSettings
    from dsv4serve.bench_ppl import PplSettings

app = typer.Typer(help="Measure a running seat (or any OpenAI-compatible endpoint) from the client side.",
                  invoke_without_command=True, no_args_is_help=False)


@dataclass
class Shared:
    """Options given before the subcommand (`bench --base-url X needle`) apply to it too."""

    base_url: str | None = None
    model: str | None = None
    profile: str | None = None
    seat: str | None = None
    json_out: bool = False
    out: Path | None = None
    api_key: str | None = None
    misplaced: Exception | None = None  # table options given before a subcommand, refused inside it


def _opt_base_url():
    return typer.Option(None, "--base-url", help="endpoint to measure, e.g. http://127.0.0.1:8000 "
                                                  "(default: the running seat)")


def _opt_api_key():
    return typer.Option(None, "--api-key", metavar="KEY",
                        help="key the endpoint's /v1 paths demand (default: a running seat's own; with --base-url, "
                             "VLLM_API_KEY)")


def _opt_model():
    return typer.Option(None, "--model", help="served model name (default: the seat's, or the only one served)")


def _opt_profile():
    return typer.Option(None, "--profile", "-p",
                        help="profile whose reference figures to show beside the results (default: the measured "
                             "seat's own); to choose which running seat to measure, use --seat")


def _opt_seat():
    return typer.Option(None, "--seat", help="name of the running seat to measure (see `dsv4serve status`); "
                                             "needed when several seats are up")


def _opt_json():
    return typer.Option(False, "--json", help="print one JSON document on stdout instead of tables")


def _opt_out():
    return typer.Option(None, "--out", parser=dir_path, metavar="DIR", help="also write JSON and Markdown (and a PNG for the table) here")


def _merge(ctx: typer.Context, **given) -> Shared:
    base: Shared = ctx.obj if isinstance(ctx.obj, Shared) else Shared()
    return Shared(**{k: (v if v not in (None, False) else getattr(base, k)) for k, v in given.items()},
                  misplaced=base.misplaced)


@contextmanager
def _progress(enabled: bool, total: int | None) -> Iterator[Callable[[str], None]]:
    """A transient bar on stderr; a no-op when JSON must own the output, and when stderr is not a
    terminal (a log file or a pipe would keep the bar's last frame, or a bare newline before the
    error line that follows)."""
    if not enabled or not err_console.is_terminal:
        yield lambda _desc: None
        return
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    cols = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn()] if total else [SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()]
    with Progress(*cols, console=err_console, transient=True) as bar:
        task = bar.add_task("starting", total=total)
        started = [False]

        def step(desc: str) -> None:
            if started[0]:
                bar.advance(task)
            started[0] = True
            bar.update(task, description=desc)

        yield step


def _check_inputs(sh: Shared, settings: Union["BenchSettings", "NeedleSettings", "PplSettings"]) -> None:
    """Refuse bad options before contacting the endpoint, so a typo fails in a second, not after a run."""
    settings.check_inputs()
    if sh.out is not None:
        from dsv4serve.bench_report import prepare_out

        prepare_out(sh.out)


@contextmanager
def _session(sh: Shared):
    """An HTTP client and the resolved target; the client is closed however the measurement ends."""
    from dsv4serve.bench import make_client, resolve_target

    for flag, value in (("--base-url", sh.base_url), ("--model", sh.model), ("--profile", sh.profile),
                        ("--seat", sh.seat), ("--api-key", sh.api_key)):
        if value is not None and not value.strip():  # '' would be read as "not given" further down
            raise BadInput(f"{flag} is empty", hint="give it a value, or leave it out")
    if sh.base_url is not None and sh.seat is not None:
        raise BadInput("--seat and --base-url both name what to measure", hint="give one of them")
    client = make_client(local=sh.base_url is None)  # no --base-url: a seat of this machine
    try:
        yield client, resolve_target(client, base_url=sh.base_url, model=sh.model, profile=sh.profile, seat=sh.seat,
                                             api_key=sh.api_key)
    finally:
        client.close()


def _finish(sh: Shared, result: dict, stem: str, render: Callable[[dict], None]) -> None:
    from dsv4serve.bench_report import write_outputs

    file_notes: list[str] = []
    written: list[Path] = []
    if sh.out is not None:
        try:
            written, file_notes = write_outputs(result, sh.out, stem)
        except DsvError as e:
            if not sh.json_out:
                raise
            # one document still: the measurement, with why --out holds none of it beside it
            report_error(type(e).__name__, e.message, e.hint, e.exit_code)
            emit_json({**result, **error_doc(type(e).__name__, e.message, e.hint, e.exit_code)})
            raise typer.Exit(e.exit_code) from None
    if sh.json_out:
        # the notes and files of --out too, as the human output prints them
        emit_json({**result, "notes": [*result.get("notes", []), *file_notes],
                   **({"written": [str(p) for p in written]} if sh.out is not None else {})})
        return
    render(result)
    for note in [*result.get("notes", []), *file_notes]:
        console.print(Text.assemble(("note:", "dim"), " ", note), highlight=False, soft_wrap=True)
    for p in written:
        console.print(Text(f"wrote {p}"), highlight=False)


# The table bench's own options: before a subcommand they would be dropped without a word
# (the subcommand has its own --timeout and --max-tokens, with other defaults).
TABLE_ONLY = ("streams", "suite", "max_tokens", "runs", "thinking", "timeout", "warmup")


def _refuse_table_options(ctx: typer.Context, sub: str) -> None:
    given = [p for p in ctx.command.params if p.name in TABLE_ONLY
             and getattr(ctx.get_parameter_source(p.name), "name", "DEFAULT") != "DEFAULT"]
    if given:
        flags = ", ".join("/".join(p.opts[:1] + list(getattr(p, "secondary_opts", []))[:1]) for p in given)
        get = getattr(ctx.command, "get_command", None)  # typer's group (its click may be its own copy)
        sub_cmd = get(ctx, sub) if get else None
        theirs = {p.name for p in getattr(sub_cmd, "params", [])}
        moved = [p.opts[0] for p in given if p.name in theirs]
        foreign = [p.opts[0] for p in given if p.name not in theirs]
        hint = "; ".join(
            ([f"`dsv4serve bench {sub}` has its own {', '.join(moved)}: put it after the subcommand "
              f"(`dsv4serve bench {sub} {moved[0]} ...`)"] if moved else [])
            + ([f"`dsv4serve bench {sub}` has no {', '.join(foreign)}: drop it"] if foreign else []))
        raise BadInput(f"{flags} before `{sub}` would be ignored: they are the table bench's options", hint=hint)


@app.callback()
def bench(ctx: typer.Context,
          streams: str = typer.Option("1,4", "--streams", help="concurrent stream counts to measure, e.g. 1,4"),
          suite: str = typer.Option("en,ja,code", "--suite", help="prompt suites: en, ja, code"),
          max_tokens: int = typer.Option(256, "--max-tokens", help="tokens to generate per stream"),
          runs: int = typer.Option(3, "--runs", help="repeats per cell; reported as mean ± half-range"),
          thinking: bool = typer.Option(False, "--thinking", help="leave the model's reasoning on (off by default)"),
          timeout: float = typer.Option(300.0, "--timeout", help="seconds to a stream's first token, and of silence "
                                                                 "after it; the whole stream gets this plus a second "
                                                                 "a token (at least 60)"),
          warmup: bool = typer.Option(True, "--warmup/--no-warmup",
                                      help="first send a discarded burst, as many requests at once as the widest "
                                           "--streams"),
          base_url: Optional[str] = _opt_base_url(), model: Optional[str] = _opt_model(),
          profile: Optional[str] = _opt_profile(), seat: Optional[str] = _opt_seat(),
          api_key: Optional[str] = _opt_api_key(), json_out: bool = _opt_json(),
          out: Optional[Path] = _opt_out()) -> None:
    """tok/s for 1 and 4 streams × en/ja/code, with acceptance length, beside the profile's reference.

    Subcommands `needle` and `ppl` measure long-context retrieval and perplexity.
    """
    sh = Shared(base_url=base_url, model=model, profile=profile, seat=seat, json_out=json_out, out=out,
                api_key=api_key)
    ctx.obj = sh
    if ctx.invoked_subcommand is not None:
        # refused by the subcommand, once its own --json is parsed (it is not yet, here)
        try:
            _refuse_table_options(ctx, ctx.invoked_subcommand)
        except BadInput as e:
            sh.misplaced = e
        return
    from dsv4serve.bench import BenchSettings, parse_streams, parse_suites, run_bench
    from dsv4serve.bench_report import bench_tables

    with handled(sh.json_out):
        settings = BenchSettings(streams=parse_streams(streams), suites=parse_suites(suite), max_tokens=max_tokens,
                                 runs=runs, thinking=thinking, read_timeout_s=timeout, warmup=warmup)
        _check_inputs(sh, settings)
        with _session(sh) as (client, target):
            total = settings.runs * len(settings.streams) * len(settings.suites) + (1 if warmup else 0)
            with _progress(not sh.json_out, total) as step:
                result = run_bench(client, target, settings, progress=step)

        def render(r: dict) -> None:
            for t in bench_tables(r):
                console.print(t)

        _finish(sh, result, "bench", render)


@app.command("needle")
def needle(ctx: typer.Context,
           tokens: int = typer.Option(..., "--tokens", help="prompt length in the seat's tokens, e.g. 166000"),
           depth: float = typer.Option(0.37, "--depth", help="where the code hides, 0 (start) to 1 (end)"),
           max_tokens: int = typer.Option(32, "--max-tokens", help="answer budget"),
           haystack: Optional[Path] = typer.Option(None, "--haystack", help="UTF-8 text to build the haystack from "
                                                                              "(default: the shipped sample)"),
           seed: Optional[int] = typer.Option(None, "--seed", help="fix the hidden code (default: a fresh one)"),
           thinking: bool = typer.Option(False, "--thinking", help="leave the model's reasoning on"),
           timeout: float = typer.Option(1800.0, "--timeout", help="seconds to wait for the first token (the "
                                                                   "whole answer: this plus a second a token, at "
                                                                   "least 60)"),
           base_url: Optional[str] = _opt_base_url(), model: Optional[str] = _opt_model(),
           profile: Optional[str] = _opt_profile(), seat: Optional[str] = _opt_seat(),
           api_key: Optional[str] = _opt_api_key(), json_out: bool = _opt_json(),
           out: Optional[Path] = _opt_out()) -> None:
    """Hide a code at a depth of a long prompt; report found, TTFT, prefill and decode tok/s."""
    from dsv4serve.bench_needle import NeedleSettings, run_needle
    from dsv4serve.bench_report import needle_table

    sh = _merge(ctx, base_url=base_url, model=model, profile=profile, seat=seat, json_out=json_out, out=out,
                api_key=api_key)
    with handled(sh.json_out):
        if sh.misplaced is not None:
            raise sh.misplaced
        settings = NeedleSettings(tokens=tokens, depth=depth, max_tokens=max_tokens, thinking=thinking,
                                  read_timeout_s=timeout, haystack=haystack, seed=seed)
        _check_inputs(sh, settings)
        with _session(sh) as (client, target):
            with _progress(not sh.json_out, None) as step:
                result = run_needle(client, target, settings, progress=step)
        _finish(sh, result, "needle", lambda r: console.print(needle_table(r)))
    if not result["found"]:  # a retrieval that failed is a failed check (README, exit codes): 1
        raise typer.Exit(1)


@app.command("ppl")
def ppl(ctx: typer.Context,
        ctx_len: int = typer.Option(512, "--ctx", help="tokens per window"),
        chunks: int = typer.Option(16, "--chunks", help="number of disjoint windows"),
        text: Optional[Path] = typer.Option(None, "--text", help="UTF-8 text, e.g. wikitext-2-raw wiki.test.raw "
                                                                   "(default: a shipped sample, not comparable)"),
        timeout: float = typer.Option(600.0, "--timeout", help="seconds per window request"),
        windows: str = typer.Option("tokens", "--windows", help="tokens: exact --ctx-token windows; chars: "
                                    "--ctx*4-character windows capped at --ctx tokens, as the profiles' references "
                                    "were cut (needed to compare with them)"),
        base_url: Optional[str] = _opt_base_url(), model: Optional[str] = _opt_model(),
        profile: Optional[str] = _opt_profile(), seat: Optional[str] = _opt_seat(),
        api_key: Optional[str] = _opt_api_key(), json_out: bool = _opt_json(),
        out: Optional[Path] = _opt_out()) -> None:
    """Perplexity over disjoint windows via /v1/completions prompt_logprobs.

    prompt_logprobs gathers full-vocabulary logits, which can run a full seat out of memory: use profile 8x16gb-ppl.
    """
    from dsv4serve.bench_ppl import PplSettings, run_ppl
    from dsv4serve.bench_report import ppl_table

    sh = _merge(ctx, base_url=base_url, model=model, profile=profile, seat=seat, json_out=json_out, out=out,
                api_key=api_key)
    with handled(sh.json_out):
        if sh.misplaced is not None:
            raise sh.misplaced
        settings = PplSettings(ctx=ctx_len, chunks=chunks, text=text, read_timeout_s=timeout, windows=windows)
        _check_inputs(sh, settings)
        with _session(sh) as (client, target):
            with _progress(not sh.json_out, chunks) as step:
                result = run_ppl(client, target, settings, progress=step)
        _finish(sh, result, "ppl", lambda r: console.print(ppl_table(r)))
