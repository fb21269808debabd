"""`dsv4serve bench`: the seat's tok/s table, measured from the client side.

Method (seat-reference §5.1, the bench-streams instrument): streaming chat completions at
temperature 0, thinking off unless asked, one request per stream, all streams released together.
Tokens come from the final usage chunk, never from counting chunks: under speculation one chunk
carries several accepted tokens. Acceptance length comes from the /metrics counters' growth
around each measurement.
"""

from __future__ import annotations

import functools
import math
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from dsv4serve import state
from dsv4serve.readiness import auth, unsendable
from dsv4serve.bench_client import (
    Endpoint,
    SpecDelta,
    StreamResult,
    chat_body,
    check_base_url,
    split_userinfo,
    resolve_endpoint,
    scrape_spec,
    spec_delta,
    stream_chat,
)
from dsv4serve.errors import BadInput, DsvError, JobFailed, first_line
from dsv4serve.launch import running_seat_key
from dsv4serve.profile import Profile, load_profile

# Three kinds of text that speculate differently: prose, Japanese, code. Code drafts best.
SUITES: dict[str, str] = {
    "en": ("Write a long essay on how the printing press changed Europe: the spread of literacy, "
           "the Reformation, science, and the economics of books. Use several paragraphs."),
    "ja": ("日本の四季それぞれの伝統行事と、それらが和歌や俳句などの文学に与えた影響について、"
           "具体例を挙げながら詳しく説明してください。"),
    "code": ("Implement an LRU cache class in Python with O(1) get and put, using a dict and a doubly "
             "linked list. Include docstrings, type hints, unit tests, and a short explanation."),
}

DEFAULT_STREAMS = "1,4"
DEFAULT_SUITES = "en,ja,code"
# A socket cannot wait for ever (settimeout overflows near 1e10 s); no seat is silent for a day.
MAX_TIMEOUT_S = 86400.0


# ---------------------------------------------------------------------------------------------
# input parsing


def parse_streams(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        # isdigit() admits superscripts like '²' that int() rejects: ASCII decimals only.
        if not (part.isascii() and part.isdecimal()) or int(part) < 1:
            raise BadInput(f"--streams '{text}' must be a comma list of positive integers", hint="e.g. --streams 1,4")
        if int(part) > 64:
            raise BadInput(f"--streams {part} is more than this bench opens at once (64)")
        if int(part) not in out:
            out.append(int(part))
    return out


def check_timeout(seconds: float) -> None:
    # Zero makes every read fail at once and a negative value is refused by the socket layer.
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        raise BadInput(f"--timeout {seconds:g} must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}",
                       hint="e.g. --timeout 300")


MAX_TEXT_BYTES = 256 << 20  # wikitext-2's test split is 1.3 MB; a 380K-token haystack about 1.5 MB


def check_text_file(path: Path, flag: str) -> None:
    """A text the user names (--haystack, --text) must be a regular file of sane size, or a pipe
    (`--text <(zcat wiki.gz)`), read up to that size: /dev/zero would be read until memory ran out."""
    try:
        st = path.stat()
    except OSError as e:
        raise BadInput(f"cannot read {flag} {path}: {e.strerror or e}", hint="pass a UTF-8 text file") from None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        raise BadInput(f"{flag} {path} is not a regular file or a pipe", hint="pass a UTF-8 text file")
    if st.st_size > MAX_TEXT_BYTES:
        raise BadInput(f"{flag} {path} is {st.st_size >> 20} MiB, more than the {MAX_TEXT_BYTES >> 20} MiB read",
                       hint="pass a smaller text (a few MB covers any context)")


def read_text_file(path: Path, flag: str) -> str:
    check_text_file(path, flag)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TEXT_BYTES + 1)
        if len(raw) > MAX_TEXT_BYTES:  # a pipe has no size to check beforehand
            raise BadInput(f"{flag} {path} holds more than the {MAX_TEXT_BYTES >> 20} MiB read",
                           hint="pass a smaller text (a few MB covers any context)")
        # newlines as reading in text mode gave them (the perplexity of a CRLF file stays the same)
        return raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except OSError as e:
        raise BadInput(f"cannot read {flag} {path}: {e.strerror or e}", hint="pass a UTF-8 text file") from None
    except UnicodeDecodeError:
        raise BadInput(f"{flag} {path} is not UTF-8 text", hint="pass a UTF-8 text file") from None


def parse_suites(text: str) -> list[str]:
    out: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if part not in SUITES:
            raise BadInput(f"--suite '{part}' is not a suite", hint=f"choose from {', '.join(SUITES)}")
        if part not in out:
            out.append(part)
    return out


# ---------------------------------------------------------------------------------------------
# where to measure, and what to compare with


@dataclass
class Target:
    endpoint: Endpoint
    profile: Profile | None          # whose reference figures the report shows
    seat: str | None                 # the running seat measured, when it came from the state
    max_num_seqs: int | None         # the measured seat's, when known
    notes: list[str] = field(default_factory=list)
    api_key: str | None = None       # what the server's /v1 paths demand (--api-key / VLLM_API_KEY), if any
    basic: httpx.BasicAuth | None = None  # the --base-url's own user:password, kept out of every report


def _running_seat(seat: str | None, profile: str | None) -> tuple[state.SeatState, bool]:
    """The seat to measure, and whether --profile (not --seat) picked it."""
    try:
        return state.find_running(seat), False
    except BadInput as e:
        if seat is not None or "seats are running" not in e.message:
            raise
        # Several seats up and no --seat: a --profile that names one of them picks it, since a
        # seat is named after the profile it was brought up with.
        if profile is not None:
            try:
                return state.find_running(profile), True
            except BadInput:
                pass
        # state's hint names --profile, the seat flag of `down` and `logs`; bench's is --seat.
        raise BadInput(e.message, hint="name one with --seat (--profile only picks the reference figures)") from None


def _launched_profile(st: state.SeatState, notes: list[str]) -> Profile | None:
    """The running seat's profile as `up` launched it: the shipped name or YAML file it was given,
    with its --set applied again (its name alone loads neither a profile from a file nor a seat
    started with --set vllm.max_num_seqs=8)."""
    try:
        p = load_profile(st.profile_ref or st.profile, list(st.overrides))
    except DsvError as e:
        notes.append(f"the seat's profile could not be loaded ({e.line()})")
        return None
    if p.digest() != st.profile_digest:
        notes.append(f"profile {p.cli_ref()} changed since the seat was started: its reference figures and "
                     "max-num-seqs are read from the file as it is now")
    return p


def resolve_target(client: httpx.Client, *, base_url: str | None, model: str | None,
                   profile: str | None, seat: str | None, api_key: str | None = None) -> Target:
    notes: list[str] = []
    seat_profile: Profile | None = None
    seat_name: str | None = None
    picked_by_profile = False
    st = None
    basic = None
    if base_url is not None:
        base_url, basic = split_userinfo(check_base_url(base_url))
        if basic is not None:  # sent as httpx would have sent the URL's own, never written anywhere
            client.auth = basic
    else:
        st, picked_by_profile = _running_seat(seat, profile)
        base_url, seat_name = st.base_url, st.seat
        if st.phase != "ready":  # its readiness canary has not passed: warm-up and capture may still run
            notes.append(f"seat {st.seat} is still {st.phase} (not ready): its figures may include start-up work")
        model = model or st.served_name
        seat_profile = _launched_profile(st, notes)
    # A --profile that picked the seat means that seat's own profile, which is already loaded
    # (or noted as unloadable): the seat's name need not be a loadable profile name.
    ref_profile = load_profile(profile) if profile and not picked_by_profile else seat_profile
    # When /v1/models lacks max_model_len: a running seat's own profile knows its window (a
    # --profile given only for comparison does not); with --base-url, --profile is the best guess.
    fallback = seat_profile if seat_name else ref_profile
    fallback_len = fallback.vllm.max_model_len if fallback else None
    if api_key is not None:  # --api-key: what the user says the endpoint takes
        key, source = api_key or None, "--api-key"
    elif st is None:  # another server: vLLM's own convention for a client's key
        key, source = os.environ.get("VLLM_API_KEY") or None, "VLLM_API_KEY"
    else:  # the key the seat's server was started with (a 401 on every request otherwise)
        key, source = running_seat_key(st), f"seat {st.seat}'s API key"
    _header_safe(key, source)
    if basic is not None and key:
        # one Authorization header: httpx's basic auth would replace the key, and vLLM would refuse
        raise BadInput(f"--base-url carries a user:password and {source} gives an API key: one request cannot "
                       "send both", hint="drop one: the key alone for a vLLM server, the user:password alone for a "
                       "proxy that checks it" + (" (unset VLLM_API_KEY for this command)" if source == "VLLM_API_KEY"
                                                 else ""))
    client.headers.update(auth(key))
    endpoint = resolve_endpoint(client, base_url, model, fallback_len)
    seqs = seat_profile.vllm.max_num_seqs if seat_profile else None
    if ref_profile is None:
        notes.append("no reference figures: pass --profile NAME (e.g. 8x16gb-380k) to compare with that "
                     "profile's reference figures")
    return Target(endpoint=endpoint, profile=ref_profile, seat=seat_name, max_num_seqs=seqs, notes=notes,
                  api_key=key, basic=basic)


def _header_safe(key: str | None, source: str) -> None:
    if (where := unsendable(key)) is not None:
        raise BadInput(f"{source} has a character an HTTP header cannot carry ({where})",
                       hint="type the key again (a pasted one may carry a non-breaking space or a curly quote)")


def make_client(api_key: str | None = None, *, local: bool = False, basic: httpx.BasicAuth | None = None) -> httpx.Client:
    # Per-call timeouts are always passed explicitly; this default only guards a forgotten one.
    # `local`: a seat on this machine, which an http_proxy of the shell must not carry away (a
    # --base-url may be reached through one on purpose).
    try:
        return httpx.Client(timeout=httpx.Timeout(30.0, connect=5.0), headers=auth(api_key), trust_env=not local,
                            auth=basic)
    except (ImportError, ValueError, httpx.InvalidURL) as e:  # the shell's proxy variables, read by httpx here
        raise BadInput(f"the shell's proxy settings cannot be used: {first_line(e, e.__class__.__name__)}",
                       hint="fix or unset ALL_PROXY / HTTP_PROXY / HTTPS_PROXY (a socks5:// proxy needs "
                            "`pip install 'httpx[socks]'`), or exempt the server's host in NO_PROXY") from None


# ---------------------------------------------------------------------------------------------
# statistics


@dataclass(frozen=True)
class Stat:
    """Mean and half-range over runs: how the seat's figures are reported (3 runs, ± half-range)."""

    mean: float
    half_range: float
    n: int

    @classmethod
    def of(cls, values: list[float | None]) -> "Stat | None":
        vals = [v for v in values if v is not None]
        if not vals:
            return None
        return cls(mean=sum(vals) / len(vals), half_range=(max(vals) - min(vals)) / 2.0, n=len(vals))

    def to_dict(self) -> dict[str, float | int]:
        return {"mean": self.mean, "half_range": self.half_range, "n": self.n}


# ---------------------------------------------------------------------------------------------
# one measurement: N concurrent streams of one suite


@dataclass
class RunResult:
    streams: int
    suite: str
    run: int
    per_stream: list[StreamResult]
    spec: SpecDelta | None

    @property
    def wall_s(self) -> float:
        # From the first request sent to the last stream closed: TTFT is inside, as in the
        # reference's aggregate.
        start = min(s.t_start for s in self.per_stream)
        end = max(s.t_end or s.t_start for s in self.per_stream)
        return end - start

    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens or 0 for s in self.per_stream)

    @property
    def aggregate_tok_s(self) -> float | None:
        w = self.wall_s
        return self.completion_tokens / w if w > 0 else None

    @property
    def ttft_max_s(self) -> float | None:
        vals = [s.ttft_s for s in self.per_stream if s.ttft_s is not None]
        return max(vals) if vals else None

    @property
    def per_stream_tok_s(self) -> list[float]:
        return [v for v in (s.decode_tok_s for s in self.per_stream) if v is not None]

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "wall_s": self.wall_s,
            "completion_tokens": self.completion_tokens,
            "aggregate_tok_s": self.aggregate_tok_s,
            "ttft_max_s": self.ttft_max_s,
            "acceptance_length": self.spec.acceptance_length if self.spec else None,
            "spec_delta": None if self.spec is None else {
                "accepted": self.spec.accepted, "drafts": self.spec.drafts, "draft_tokens": self.spec.draft_tokens},
            "per_stream": [{
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.completion_tokens,
                "ttft_s": s.ttft_s,
                "decode_s": s.decode_s,
                "decode_tok_s": s.decode_tok_s,
                "burst": s.burst,
                "finish_reason": s.finish_reason,
                "chunks": s.chunks,
                "content_chars": len(s.content),
                "reasoning_chars": len(s.reasoning),
            } for s in self.per_stream],
        }


def run_streams(endpoint: Endpoint, body: dict[str, Any], streams: int, read_timeout_s: float,
                client_factory: Callable[[], httpx.Client] = make_client) -> list[StreamResult]:
    """Start `streams` identical requests together; return them in order or raise the first error."""
    results: list[StreamResult | None] = [None] * streams
    errors: list[tuple[int, BaseException]] = []
    gate = threading.Barrier(streams)
    lock = threading.Lock()

    def worker(i: int) -> None:
        with client_factory() as c:
            try:
                gate.wait(timeout=30)
                results[i] = stream_chat(c, endpoint, body, read_timeout_s)
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                with lock:
                    errors.append((i, e))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True, name=f"bench-stream-{i}")
               for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        i, e = sorted(errors, key=lambda x: x[0])[0]
        if isinstance(e, DsvError):
            e.message = f"stream {i + 1}/{streams}: {e.message}"
            raise e
        raise JobFailed(f"stream {i + 1}/{streams}: {e.__class__.__name__}: {first_line(e, '')}")
    done = [r for r in results if r is not None]
    for i, r in enumerate(done):
        if r.completion_tokens == 0:  # a rate of 0 tok/s would read as a figure, and a TTFT has no token
            raise JobFailed(f"stream {i + 1}/{streams}: the server generated 0 tokens (finish_reason "
                            f"{r.finish_reason or '?'}): no rate can be read off it",
                            hint="the model ended at once: check the chat template (is thinking on?) and the "
                                 "seat's log (`dsv4serve logs`)")
    return done


def measure(client: httpx.Client, endpoint: Endpoint, suite: str, streams: int, run: int, max_tokens: int,
            thinking: bool, read_timeout_s: float,
            client_factory: Callable[[], httpx.Client] = make_client) -> RunResult:
    body = chat_body(endpoint, SUITES[suite], max_tokens, thinking)
    before = scrape_spec(client, endpoint.base_url)
    try:
        per_stream = run_streams(endpoint, body, streams, read_timeout_s, client_factory)
    except DsvError as e:
        e.message = f"{suite} × {streams} stream(s), run {run}: {e.message}"
        raise
    after = scrape_spec(client, endpoint.base_url)
    return RunResult(streams=streams, suite=suite, run=run, per_stream=per_stream, spec=spec_delta(before, after))


# ---------------------------------------------------------------------------------------------
# the whole table


@dataclass
class BenchSettings:
    streams: list[int]
    suites: list[str]
    max_tokens: int = 256
    runs: int = 3
    thinking: bool = False
    read_timeout_s: float = 300.0
    warmup: bool = True

    def check_inputs(self) -> None:
        """What can be refused before the endpoint is contacted."""
        if self.max_tokens < 1:
            raise BadInput(f"--max-tokens {self.max_tokens} must be at least 1", hint="e.g. --max-tokens 256")
        if self.runs < 1:
            raise BadInput(f"--runs {self.runs} must be at least 1", hint="e.g. --runs 3")
        check_timeout(self.read_timeout_s)

    def validate(self, endpoint: Endpoint) -> None:
        self.check_inputs()
        if endpoint.max_model_len is not None and self.max_tokens >= endpoint.max_model_len:
            raise BadInput(f"--max-tokens {self.max_tokens} does not fit the seat's max-model-len "
                           f"{endpoint.max_model_len} with a prompt", hint=f"use at most {endpoint.max_model_len // 2}")


# How the profiles' reference tok/s were measured (seat-reference §5: bench-streams, thinking off):
# an aggregate includes TTFT, so another budget or reasoning on changes the figure, not the seat.
REF_MAX_TOKENS = 256
REF_THINKING = False


def reference_method_differs(settings: "BenchSettings") -> str | None:
    """Why this run's tok/s cannot be set beside the references, or None when it can."""
    why = []
    if settings.max_tokens != REF_MAX_TOKENS:
        why.append(f"--max-tokens {settings.max_tokens} (the references used {REF_MAX_TOKENS})")
    if settings.thinking != REF_THINKING:
        why.append("--thinking (the references ran with thinking off)")
    return "; ".join(why) or None


def summarize_cell(runs: list[RunResult], profile: Profile | None, comparable: bool = True,
                   acceptance_comparable: bool = True) -> dict[str, Any]:
    streams, suite = runs[0].streams, runs[0].suite
    agg = Stat.of([r.aggregate_tok_s for r in runs])
    ttft = Stat.of([r.ttft_max_s for r in runs])
    acc = Stat.of([r.spec.acceptance_length if r.spec else None for r in runs])
    per_stream = [v for r in runs for v in r.per_stream_tok_s]
    ref_tok = ref_acc = None
    if profile is not None:
        ref_tok = profile.reference.tok_s.get(str(streams), {}).get(suite)
        ref_acc = profile.reference.acceptance_length.get(suite)
    return {
        "streams": streams,
        "suite": suite,
        "aggregate_tok_s": agg.to_dict() if agg else None,
        "per_stream_tok_s": {"min": min(per_stream), "max": max(per_stream)} if per_stream else None,
        "ttft_max_s": ttft.to_dict() if ttft else None,
        "acceptance_length": acc.to_dict() if acc else None,
        "completion_tokens": [r.completion_tokens for r in runs],
        "reference": {"tok_s": ref_tok, "acceptance_length": ref_acc},
        "ratio": {
            "tok_s": (agg.mean / ref_tok) if agg and ref_tok and comparable else None,
            "acceptance_length": (acc.mean / ref_acc) if acc and ref_acc and acceptance_comparable else None,
        },
        "runs": [r.to_dict() for r in runs],
    }


Progress = Callable[[str], None]


def run_bench(client: httpx.Client, target: Target, settings: BenchSettings,
              progress: Progress | None = None,
              client_factory: Callable[[], httpx.Client] | None = None) -> dict[str, Any]:
    ep = target.endpoint
    if client_factory is None:  # one client per stream, each with the target's key
        client_factory = functools.partial(make_client, target.api_key, local=target.seat is not None,
                                           basic=target.basic)
    settings.validate(ep)
    notes = list(target.notes)
    if target.profile is not None and not target.profile.reference.tok_s:
        notes.append(f"profile {target.profile.name} carries no reference tok/s: pass --profile NAME "
                     "(e.g. 8x16gb-380k) to compare")
    if target.max_num_seqs is not None and max(settings.streams) > target.max_num_seqs:
        notes.append(f"{max(settings.streams)} streams exceed the seat's max-num-seqs {target.max_num_seqs}: "
                     "the extra requests queue, so that aggregate is not concurrent throughput")
    if settings.warmup:
        # The first request after start pays one-off costs (TP warm-up, compilation caches);
        # it is sent and discarded so it does not land in the first cell.
        if progress:
            progress("warm-up")
        # As many at once as the widest cell, so a first batch of that size is not measured either.
        try:
            run_streams(ep, chat_body(ep, "Say hello.", 2, settings.thinking), max(settings.streams),
                        settings.read_timeout_s, client_factory)
        except DsvError as e:
            e.message = f"warm-up request (before any measurement): {e.message}"
            raise
    cells: dict[tuple[int, str], list[RunResult]] = {}
    # Runs are the outer loop so slow drift (clocks, thermals, other tenants) spreads over
    # all cells instead of biasing whichever cell ran last.
    try:
        for run in range(1, settings.runs + 1):
            for streams in settings.streams:
                for suite in settings.suites:
                    if progress:
                        progress(f"run {run}/{settings.runs}: {suite} × {streams}")
                    r = measure(client, ep, suite, streams, run, settings.max_tokens, settings.thinking,
                                settings.read_timeout_s, client_factory)
                    cells.setdefault((streams, suite), []).append(r)
    except DsvError as e:
        if cells:  # one failed stream late in a long table must not take the finished runs with it
            from dsv4serve.bench_report import keep_result

            partial = _table_doc(target, settings, cells, notes + [f"stopped early: {e.message}"])
            kept = keep_result({**partial, "kind": "dsv4serve.bench.partial"}, "bench-partial")
            if kept is not None:
                e.hint = f"the {sum(map(len, cells.values()))} runs measured before it are kept in {kept}" + (
                    f"; {e.hint}" if e.hint else "")
        raise
    return _table_doc(target, settings, cells, notes)


def _table_doc(target: Target, settings: "BenchSettings", cells: dict[tuple[int, str], list[RunResult]],
               notes: list[str]) -> dict[str, Any]:
    """The table's result document from the runs measured (every cell, or those done before a failure)."""
    ep = target.endpoint
    notes = list(notes)
    bursts = sum(s.burst for rs in cells.values() for r in rs for s in r.per_stream)
    if bursts:
        notes.append(f"{bursts} stream(s) received all their tokens in one burst (client or server starved of CPU): "
                     "their decode rate is not measurable and is left out of the per-stream figures")
    short = [s for rs in cells.values() for r in rs for s in r.per_stream
             if s.completion_tokens is not None and s.completion_tokens < settings.max_tokens]
    # an early end: the rate is still a rate, but over a shorter (less loaded) tail. "length" short
    # of --max-tokens is the server's cut: vLLM lowers max_tokens to what the window leaves after
    # the prompt (or to a configured output limit), without a word
    for why, group in (("the model's end of sequence", [s for s in short if s.finish_reason != "length"]),
                       ("the server's cap: it lowered max_tokens to what the seat's max-model-len leaves after "
                        "the prompt, or to its own output limit", [s for s in short if s.finish_reason == "length"])):
        if group:
            notes.append(f"{len(group)} stream(s) ended before --max-tokens {settings.max_tokens} (as few as "
                         f"{min(s.completion_tokens for s in group)} tokens, {why}): their figures cover fewer "
                         "tokens than the reference's")
    differs = reference_method_differs(settings)
    if differs and target.profile is not None and target.profile.reference.tok_s:
        notes.append(f"no tok/s ratio against the reference: {differs}")
    if differs and target.profile is not None and target.profile.reference.acceptance_length:
        # with thinking on the drafts run over reasoning text, the references' over answers; and an
        # acceptance over the first N tokens of an answer is another average than over 256
        notes.append(f"no acceptance ratio against the reference: {differs}")
    summaries = [summarize_cell(cells[(s, q)], target.profile, comparable=differs is None,
                                acceptance_comparable=differs is None)
                 for s in settings.streams for q in settings.suites if (s, q) in cells]
    if all(c["acceptance_length"] is None for c in summaries):
        notes.append("acceptance length n/a: the server exposes no speculative-decoding counters "
                     "(speculation off, or /metrics absent)")
    else:
        notes.append("acceptance length comes from server-wide /metrics counters: "
                     "other traffic during the run would skew it")
    ref = target.profile.reference if target.profile else None
    return {
        "kind": "dsv4serve.bench",
        "version": 1,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "endpoint": {"base_url": ep.base_url, "model": ep.model, "max_model_len": ep.max_model_len,
                     "seat": target.seat},
        "settings": {"streams": settings.streams, "suites": settings.suites, "max_tokens": settings.max_tokens,
                     "runs": settings.runs, "thinking": settings.thinking, "temperature": 0},
        "reference": None if target.profile is None else {
            "profile": target.profile.name, "source": ref.source if ref else None},
        "cells": summaries,
        "notes": notes,
    }
