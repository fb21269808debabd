"""Unit tests of the bench arithmetic and parsing: no server, no network."""

from __future__ import annotations

import json
import sys
import math
from pathlib import Path

import pytest

import httpx

from dsv4serve.bench import BenchSettings, RunResult, Stat, check_timeout, parse_streams, parse_suites, summarize_cell
from dsv4serve.bench_client import (
    ACCEPTED,
    DRAFT_TOKENS,
    DRAFTS,
    Endpoint,
    SpecDelta,
    StreamError,
    StreamResult,
    Tokenizer,
    check_base_url,
    consume_stream,
    iter_sse_data,
    parse_metrics,
    spec_delta,
)

from .conftest import JsonHandler, dead_proxy, local_server
from dsv4serve.bench_needle import NeedleSettings, _boundary, build_prompt, compose
from dsv4serve.bench_ppl import PplSettings, _exp, window_nll, windows
from dsv4serve.bench_report import bench_markdown, needle_markdown, ppl_markdown, write_outputs
from dsv4serve.errors import BadInput, JobFailed
from dsv4serve.profile import load_profile


class Clock:
    """A clock that advances a fixed step each time it is read, so timings are exact."""

    def __init__(self, start: float = 100.0, step: float = 0.5):
        self.t = start - step
        self.step = step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def chunk(content: str | None = None, *, reasoning: str | None = None, finish: str | None = None,
          role: bool = False) -> str:
    delta: dict = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    return "data: " + json.dumps({"object": "chat.completion.chunk",
                                  "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def usage_chunk(prompt: int, completion: int) -> str:
    return "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                                           "total_tokens": prompt + completion}})


def sse(*events: str) -> list[str]:
    lines: list[str] = []
    for e in events:
        lines += [e, ""]
    return lines


# ---------------------------------------------------------------------------------------------
# SSE


def test_sse_skips_comments_and_keepalives_and_joins_multiline_data():
    lines = [": keep-alive", "", "event: message", "data: {\"a\":", "data: 1}", "", ":ping", "data:[DONE]", ""]
    assert list(iter_sse_data(lines)) == ['{"a":\n1}', "[DONE]"]


def test_sse_handles_crlf_and_a_last_event_without_blank_line():
    assert list(iter_sse_data(["data: x\r\n", "\r\n", "data: y"])) == ["x", "y"]


def test_stream_counts_tokens_from_usage_not_chunks():
    # Speculation: each chunk carries several accepted tokens; 3 content chunks, 11 tokens.
    lines = sse(chunk("", role=True), chunk("The quick brown"), chunk(" fox jumps over"),
                chunk(" the dog.", finish="stop"), usage_chunk(9, 11), "data: [DONE]")
    clock = Clock(step=0.5)
    r = consume_stream(iter_sse_data(lines), StreamResult(t_start=clock()), clock)
    assert r.completion_tokens == 11 and r.prompt_tokens == 9
    assert r.chunks == 5  # role + 3 content + usage: never used as a count
    assert r.content == "The quick brown fox jumps over the dog."
    assert r.finish_reason == "stop"
    # start 100.0; role chunk 100.5 (empty content: not a first token); first token 101.0;
    # last choice chunk 102.0; usage 102.5; end 103.0
    assert r.ttft_s == pytest.approx(1.0)
    assert r.decode_s == pytest.approx(1.0)
    assert r.decode_tok_s == pytest.approx(11.0)
    assert r.decode_tok_s_after_first == pytest.approx(10.0)  # the first token came from the prefill
    assert r.wall_s == pytest.approx(3.0)


def test_reasoning_delta_counts_as_first_token():
    lines = sse(chunk(reasoning="Let me think"), chunk("42", finish="stop"), usage_chunk(3, 5), "data: [DONE]")
    clock = Clock(step=1.0)
    r = consume_stream(iter_sse_data(lines), StreamResult(t_start=clock()), clock)
    assert r.ttft_s == pytest.approx(1.0)
    assert r.reasoning == "Let me think" and r.content == "42"


def test_vllm_reasoning_field_name_also_counts():
    payload = "data: " + json.dumps({"choices": [{"index": 0, "delta": {"reasoning": "hm"}}]})
    lines = sse(payload, usage_chunk(1, 1), "data: [DONE]")
    r = consume_stream(iter_sse_data(lines), StreamResult(t_start=0.0), Clock())
    assert r.reasoning == "hm" and r.t_first is not None


def test_error_chunk_is_raised_with_the_servers_message():
    lines = sse(chunk("a"), 'data: {"error": {"message": "KV cache exhausted", "code": 500}}', "data: [DONE]")
    with pytest.raises(StreamError, match="KV cache exhausted"):
        consume_stream(iter_sse_data(lines), StreamResult(t_start=0.0), Clock())


def test_chunk_without_choices_is_raised_not_skipped():
    # The 166k-token case that a bench once swallowed as KeyError 'choices' (trap 18).
    lines = sse(chunk("a"), 'data: {"object": "chat.completion.chunk", "detail": "oops"}', "data: [DONE]")
    with pytest.raises(StreamError, match="no 'choices'"):
        consume_stream(iter_sse_data(lines), StreamResult(t_start=0.0), Clock())


def test_non_json_event_is_raised():
    with pytest.raises(StreamError, match="non-JSON"):
        consume_stream(iter_sse_data(sse("data: <html>")), StreamResult(t_start=0.0), Clock())


def test_stream_without_done_is_a_failure():
    lines = sse(chunk("a"), usage_chunk(1, 1))
    with pytest.raises(StreamError, match=r"without \[DONE\]"):
        consume_stream(iter_sse_data(lines), StreamResult(t_start=0.0), Clock())


def test_stream_without_usage_is_a_failure():
    lines = sse(chunk("a", finish="length"), "data: [DONE]")
    with pytest.raises(StreamError, match="no usage"):
        consume_stream(iter_sse_data(lines), StreamResult(t_start=0.0), Clock())


def test_single_token_stream_has_no_decode_rate():
    lines = sse(chunk("a", finish="length"), usage_chunk(1, 1), "data: [DONE]")
    r = consume_stream(iter_sse_data(lines), StreamResult(t_start=0.0), Clock())
    assert r.decode_s == 0.0 and r.decode_tok_s is None


# ---------------------------------------------------------------------------------------------
# /metrics


METRICS_BEFORE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 30.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m",note="a } b, c"} 8.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 120.0
vllm:other{x="1"} NaN
"""

METRICS_AFTER = """\
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 60.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 80.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 112.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m",note="a } b, c"} 11.0 1700000000000
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 420.0
"""


def test_metrics_sum_over_label_sets_and_ignore_created_and_nan():
    m = parse_metrics(METRICS_BEFORE)
    assert m[DRAFTS] == 40.0
    assert m[ACCEPTED] == 20.0  # the label value holding "}" and "," parsed as one label set
    assert m["vllm:spec_decode_num_drafts_created"] == pytest.approx(1.7e9)
    assert "vllm:other" not in m


def test_acceptance_length_from_deltas():
    d = spec_delta(parse_metrics(METRICS_BEFORE), parse_metrics(METRICS_AFTER))
    assert d == SpecDelta(accepted=103.0, drafts=100.0, draft_tokens=300.0)
    assert d.acceptance_length == pytest.approx(1 + 103 / 100)
    assert d.acceptance_rate == pytest.approx(103 / 300)


def test_missing_series_gives_no_acceptance():
    after = parse_metrics(METRICS_AFTER)
    assert spec_delta(None, after) is None
    assert spec_delta({DRAFTS: 1.0}, after) is None  # accepted missing before
    no_tokens = {k: v for k, v in after.items() if k != DRAFT_TOKENS}
    d = spec_delta(parse_metrics(METRICS_BEFORE), no_tokens)
    assert d is not None and d.draft_tokens is None and d.acceptance_rate is None


def test_no_drafts_in_the_window_gives_no_acceptance():
    m = parse_metrics(METRICS_BEFORE)
    assert spec_delta(m, m).acceptance_length is None


# ---------------------------------------------------------------------------------------------
# arithmetic


def _stream(t_start, t_first, t_last, t_end, tokens):
    return StreamResult(t_start=t_start, t_first=t_first, t_last=t_last, t_end=t_end, prompt_tokens=10,
                        completion_tokens=tokens, finish_reason="length")


def test_aggregate_and_per_stream_arithmetic():
    streams = [_stream(0.0, 0.5, 4.5, 4.6, 100), _stream(0.01, 1.0, 3.0, 3.1, 50)]
    r = RunResult(streams=2, suite="en", run=1, per_stream=streams, spec=SpecDelta(30, 20, 60))
    assert r.wall_s == pytest.approx(4.6)
    assert r.completion_tokens == 150
    assert r.aggregate_tok_s == pytest.approx(150 / 4.6)
    assert r.ttft_max_s == pytest.approx(0.99)
    assert r.per_stream_tok_s == pytest.approx([25.0, 25.0])
    d = r.to_dict()
    assert d["acceptance_length"] == pytest.approx(2.5)
    assert [s["completion_tokens"] for s in d["per_stream"]] == [100, 50]


def test_mean_and_half_range():
    s = Stat.of([10.0, 14.0, 12.0, None])
    assert (s.mean, s.half_range, s.n) == (12.0, 2.0, 3)
    assert Stat.of([5.0]).half_range == 0.0
    assert Stat.of([None]) is None


def test_cell_summary_compares_with_the_profile_reference():
    prof = load_profile("8x16gb-380k")
    runs = [RunResult(1, "code", i, [_stream(0.0, 0.1, 1.1, 1.1, n)], SpecDelta(a, 10, 30))
            for i, (n, a) in enumerate([(110, 20), (106, 21)], 1)]
    c = summarize_cell(runs, prof)
    assert c["aggregate_tok_s"]["mean"] == pytest.approx(108 / 1.1)
    assert c["aggregate_tok_s"]["half_range"] == pytest.approx(2 / 1.1)
    assert c["reference"] == {"tok_s": 108.6, "acceptance_length": 3.05}
    assert c["ratio"]["tok_s"] == pytest.approx((108 / 1.1) / 108.6)
    assert c["acceptance_length"]["mean"] == pytest.approx(3.05)
    assert c["ratio"]["acceptance_length"] == pytest.approx(1.0)
    assert c["completion_tokens"] == [110, 106]


def test_no_tok_s_ratio_when_the_run_is_not_measured_as_the_references_were():
    """An aggregate includes TTFT: at 32 tokens (or with reasoning on) the seat is not slower, the
    method is different, so the reference is shown without a ratio and the run says why."""
    from dsv4serve.bench import reference_method_differs

    prof = load_profile("8x16gb-380k")
    runs = [RunResult(1, "code", 1, [_stream(0.0, 0.1, 1.1, 1.1, 110)], SpecDelta(20, 10, 30))]
    c = summarize_cell(runs, prof, comparable=False)
    assert c["reference"]["tok_s"] == 108.6 and c["ratio"]["tok_s"] is None
    assert c["ratio"]["acceptance_length"] is not None  # a ratio of the draft, not of time
    assert reference_method_differs(BenchSettings([1], ["en"])) is None
    assert reference_method_differs(BenchSettings([1], ["en"], max_tokens=32)) == \
        "--max-tokens 32 (the references used 256)"
    assert "--thinking" in reference_method_differs(BenchSettings([1], ["en"], thinking=True))


def test_cell_without_reference_for_that_stream_count():
    prof = load_profile("8x16gb-380k")
    c = summarize_cell([RunResult(2, "en", 1, [_stream(0, 0.1, 1.1, 1.2, 10)], None)], prof)
    assert c["reference"]["tok_s"] is None and c["ratio"]["tok_s"] is None
    assert c["acceptance_length"] is None


@pytest.mark.parametrize("text", ["", "1,,4", "0", "-1", "1;4", "a", "1.5", "65", "²", "1,٤"])
def test_bad_streams_syntax(text):
    with pytest.raises(BadInput):
        parse_streams(text)


def test_streams_and_suites_parse():
    assert parse_streams(" 1, 4,1 ") == [1, 4]
    assert parse_suites("code,en") == ["code", "en"]
    with pytest.raises(BadInput) as ei:
        parse_suites("en,fr")
    assert ei.value.line() == "--suite 'fr' is not a suite; choose from en, ja, code"


# ---------------------------------------------------------------------------------------------
# ppl


def test_ppl_takes_the_actual_tokens_logprob_not_the_max():
    prompt = [5, 7, 9]
    # With prompt_logprobs > 0 vLLM adds the top candidates; the best one is not the prompt token.
    plp = [None,
           {"7": {"logprob": -2.0, "rank": 3}, "1": {"logprob": -0.1, "rank": 1}},
           {"9": {"logprob": -3.0, "rank": 5}, "2": {"logprob": -0.2, "rank": 1}}]
    nll, n = window_nll(prompt, plp)
    assert (nll, n) == (5.0, 2)
    assert math.exp(nll / n) == pytest.approx(math.exp(2.5))


def test_ppl_reads_vllms_clamped_minus_inf_as_a_zero_probability_token():
    """vLLM returns -9999.0 for a -inf prompt logprob; scored as a number it silently multiplies
    the perplexity of a long text instead of saying a token had zero probability."""
    nll, n = window_nll([5, 7, 9], [None, {"7": {"logprob": -2.0}}, {"9": {"logprob": -9999.0}}])
    assert n == 2 and nll == math.inf


def test_ppl_rejects_a_misaligned_or_incomplete_answer():
    with pytest.raises(JobFailed, match="2 entries for a 3-token prompt"):
        window_nll([1, 2, 3], [None, {"2": {"logprob": -1.0}}])
    with pytest.raises(JobFailed, match="no entry for the prompt token 3"):
        window_nll([1, 2, 3], [None, {"2": {"logprob": -1.0}}, {"4": {"logprob": -1.0}}])


def test_windows_are_disjoint_and_exactly_ctx_long():
    ids = list(range(100, 130))
    w = windows(ids, 8, 10, bos=None)
    assert w == [ids[0:8], ids[8:16], ids[16:24]]
    wb = windows(ids, 8, 2, bos=0)
    assert wb == [[0] + ids[0:7], [0] + ids[7:14]]
    assert all(len(x) == 8 for x in w + wb)


def test_ppl_ctx_must_leave_room_for_one_token():
    with pytest.raises(BadInput) as ei:
        PplSettings(ctx=512).validate(512)
    assert ei.value.line().endswith("max-model-len 512; use --ctx 511 or less")
    PplSettings(ctx=511).validate(512)


# ---------------------------------------------------------------------------------------------
# needle


def test_needle_is_placed_at_the_depth():
    filler = "Alpha beta gamma. Delta epsilon zeta. " * 50
    p = compose(filler, 1500, 0.37, "amber-river-1234", "deadbeef")
    assert p.text.count("amber-river-1234") == 1
    assert abs(p.depth_actual - 0.37) < 0.03
    assert p.text.startswith("Document deadbeef.")
    assert compose(filler, 1500, 0.0, "c-o-1", "n").needle_at_char == 0
    end = compose(filler, 1500, 1.0, "c-o-1", "n")
    assert end.needle_at_char == end.haystack_chars


def test_boundary_prefers_a_nearby_sentence_end():
    hay = "aaa bbb. ccc ddd eee fff ggg hhh."
    assert _boundary(hay, 7) == 9 and hay[:9].endswith(". ")
    assert _boundary("x" * 100, 50) == 50  # no boundary near: stay put


def test_needle_refuses_lengths_above_max_model_len():
    with pytest.raises(BadInput) as ei:
        NeedleSettings(tokens=500, depth=0.5, max_tokens=32).validate(512)
    assert ei.value.line().endswith("exceeds the seat's max-model-len 512; use --tokens 480 or less")
    with pytest.raises(BadInput, match="between 0 and 1"):
        NeedleSettings(tokens=100, depth=1.5).validate(None)


class FakeTokenizer:
    """One token per 3 characters plus a fixed chat-template overhead: enough to test sizing."""

    available = True

    def __init__(self, tokenize: bool = True):
        self.tokenize = tokenize
        self.calls = 0

    def chat_count(self, text: str, thinking: bool):
        self.calls += 1
        return (len(text) + 2) // 3 + 7 if self.tokenize else None

    def encode(self, text: str, add_special_tokens: bool = False):
        return list(range((len(text) + 2) // 3)) if self.tokenize else None


def test_needle_sizing_converges_at_or_under_the_target():
    filler = "The mill stands below the bridge. Its wheel turns slowly. " * 40
    tok = FakeTokenizer()
    prompt, counted, notes = build_prompt(tok, NeedleSettings(tokens=900, depth=0.37), "amber-river-1", "n", filler)
    assert counted is not None and 900 - 4 <= counted <= 900
    assert counted == tok.chat_count(prompt.text, False)
    assert notes == []


def test_needle_without_tokenize_says_it_estimated():
    filler = "The mill stands below the bridge. " * 40
    prompt, counted, notes = build_prompt(FakeTokenizer(tokenize=False), NeedleSettings(tokens=600, depth=0.5),
                                          "c-o-1", "n", filler)
    assert counted is None and "no /tokenize" in notes[0]
    assert "c-o-1" in prompt.text


# ---------------------------------------------------------------------------------------------
# reports


def _bench_result() -> dict:
    prof = load_profile("8x16gb-380k")
    cells = [summarize_cell([RunResult(s, q, 1, [_stream(0, 0.1, 1.1, 1.2, 60)] * s, SpecDelta(10, 10, 30))],
                            prof) for s in (1, 4) for q in ("en", "ja", "code")]
    return {"kind": "dsv4serve.bench", "version": 1, "measured_at": "now",
            "endpoint": {"base_url": "http://x", "model": "m", "max_model_len": 512, "seat": None},
            "settings": {"streams": [1, 4], "suites": ["en", "ja", "code"], "max_tokens": 60, "runs": 1,
                         "thinking": False, "temperature": 0},
            "reference": {"profile": "8x16gb-380k", "source": "canon"}, "cells": cells, "notes": ["a note"]}


def test_markdown_puts_reference_beside_measured_with_ratios():
    md = bench_markdown(_bench_result())
    rows = [ln for ln in md.splitlines() if ln.startswith("| en | 1 ")]
    assert len(rows) == 1
    cols = [c.strip() for c in rows[0].strip("|").split("|")]
    # suite, streams, measured, reference, ratio, per-stream, ttft, accept, ref accept, ratio, tokens
    assert cols[2] == "50.0" and cols[3] == "78.6" and cols[4] == f"{50 / 78.6:.2f}×"
    assert cols[7] == "2.00" and cols[8] == "2.08" and cols[9] == f"{2 / 2.08:.2f}×"
    assert "| code | 4 | 200.0 | 193.8 |" in md
    assert "profile `8x16gb-380k`" in md and "- a note" in md


def test_write_outputs_writes_json_md_and_a_real_png(tmp_path: Path):
    import matplotlib.image  # the test extra installs matplotlib: the chart is part of the output

    written, notes = write_outputs(_bench_result(), tmp_path / "o", "bench")
    assert (tmp_path / "o" / "bench.json").is_file() and (tmp_path / "o" / "bench.md").is_file()
    png = tmp_path / "o" / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and notes == []
    h, w = matplotlib.image.imread(png).shape[:2]
    assert w > 300 and h > 150  # a chart, not an empty canvas


def test_write_outputs_says_why_when_matplotlib_is_missing(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    written, notes = write_outputs(_bench_result(), tmp_path / "o", "bench")
    data = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert not (tmp_path / "o" / "bench.png").exists()
    assert any("matplotlib is not installed" in n for n in notes)
    assert any("matplotlib" in n for n in data["notes"])
    assert "matplotlib is not installed" in (tmp_path / "o" / "bench.md").read_text()


def test_needle_and_ppl_markdown():
    needle = {"endpoint": {"base_url": "u", "model": "m"}, "prompt_tokens": 400, "tokens_requested": 400,
              "tokens_sized_by": "tokenize", "depth": 0.37, "code": "a-b-1", "found": True, "ttft_s": 2.0,
              "prefill_tok_s": 200.0, "decode_tok_s": 10.0,
              "reference": {"profile": "p", "tokens": 166000, "depth": 0.37, "found": True, "ttft_s": 119.7,
                            "prefill_tok_s": 1386.8, "decode_tok_s": None, "comparable": False},
              "ratio": None, "notes": []}
    md = needle_markdown(needle)
    assert "| found | yes | yes | |" in md and "| TTFT s | 2.00 | 119.7 | — |" in md
    ppl = {"endpoint": {"base_url": "u", "model": "m"}, "text": "t", "chunks": 16, "ctx": 512,
           "tokens_scored": 8176, "ppl": 6.8, "ratio": None, "notes": ["NOT comparable"],
           "reference": {"value": 6.7159, "text": "wikitext-2-raw test", "ctx": 512, "chunks": 16,
                         "profile": "p", "comparable": False}}
    md = ppl_markdown(ppl)
    assert "| perplexity | 6.8000 | 6.7159 (wikitext-2-raw test, 512×16, profile `p`) | — | no |" in md


def test_burst_delivery_gives_no_decode_rate():
    # 16 tokens arriving 0.2 ms apart from first to last: buffered, not decoded.
    s = _stream(0.0, 1.3360, 1.3362, 1.3363, 16)
    assert s.burst and s.decode_tok_s is None
    ok = _stream(0.0, 0.1, 0.4, 0.41, 16)
    assert not ok.burst and ok.decode_tok_s == pytest.approx(16 / 0.3)
    r = RunResult(4, "ja", 1, [s, ok], None)
    assert r.per_stream_tok_s == pytest.approx([16 / 0.3])
    assert r.aggregate_tok_s == pytest.approx(32 / 1.3363)  # the aggregate still counts every token


# ---------------------------------------------------------------------------------------------
# input checks and malformed answers


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://seat.example/prefix/", " http://[::1]:8000 ",
                                 "HTTP://localhost", "http://bücher.example:8000", "http://seat_1.lan:8000",
                                 "http://[fe80::1%eth0]:8000", "http://seat:8000//"])
def test_good_base_urls_pass_without_trailing_slash(url):
    out = check_base_url(url)
    assert out == url.strip().rstrip("/")


@pytest.mark.parametrize("url", ["http://[::1", "notaurl", "localhost:8000", "ftp://h", "http://", "http://:80",
                                 "http://a..b", "http://h:0", "http://h:70000", "http://h/#x", "https://h:abc",
                                 "http://a b", "https://http://127.0.0.1:1_NOPE", "http://h//v1"])
def test_bad_base_urls_are_bad_input(url):
    with pytest.raises(BadInput, match="--base-url") as ei:
        check_base_url(url)
    assert "\n" not in ei.value.line() and ei.value.exit_code == 2


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf, 1e12])
def test_timeout_bounds(value):
    with pytest.raises(BadInput, match="--timeout"):
        check_timeout(value)
    with pytest.raises(BadInput, match="--timeout"):
        BenchSettings(streams=[1], suites=["en"], read_timeout_s=value).check_inputs()
    with pytest.raises(BadInput, match="--timeout"):
        NeedleSettings(tokens=100, depth=0.5, read_timeout_s=value).check_inputs()
    with pytest.raises(BadInput, match="--timeout"):
        PplSettings(read_timeout_s=value).check_inputs()
    check_timeout(0.5)


def _tokenizer(reply) -> Tokenizer:
    transport = httpx.MockTransport(lambda req: httpx.Response(200, json=reply))
    return Tokenizer(httpx.Client(transport=transport), Endpoint(base_url="http://t", model="m"))


@pytest.mark.parametrize("reply", [{}, {"count": None}, {"count": -1}, {"count": 2.5}, {"count": True}])
def test_tokenize_without_a_count_is_job_failed(reply):
    with pytest.raises(JobFailed, match=r"POST http://t/tokenize answered without a 'count'"):
        _tokenizer(reply).chat_count("hi", False)


@pytest.mark.parametrize("reply", [{}, {"tokens": None}, {"tokens": [1, "x"]}, {"tokens": [1.5]}, {"tokens": {"a": 1}}])
def test_tokenize_without_tokens_is_job_failed(reply):
    with pytest.raises(JobFailed, match=r"POST http://t/tokenize answered without a 'tokens' list"):
        _tokenizer(reply).encode("hi")


def test_tokenize_well_formed_answers_pass():
    assert _tokenizer({"count": 4, "tokens": [1, 2.0]}).encode("hi") == [1, 2]
    assert _tokenizer({"count": 4}).chat_count("hi", False) == 4


def test_tokenize_non_json_is_job_failed():
    transport = httpx.MockTransport(lambda req: httpx.Response(200, text="<html>proxy</html>"))
    tok = Tokenizer(httpx.Client(transport=transport), Endpoint(base_url="http://t", model="m"))
    with pytest.raises(JobFailed, match="not a JSON object"):
        tok.encode("hi")


@pytest.mark.parametrize("event", [
    {"choices": {"0": {}}}, {"choices": ["x"]}, {"choices": [{"delta": "abc"}]},
    {"choices": [{"delta": {"content": 5}}]},
])
def test_malformed_choices_are_stream_errors(event):
    with pytest.raises(StreamError):
        consume_stream(iter_sse_data(sse("data: " + json.dumps(event), "data: [DONE]")), StreamResult(t_start=0.0))


def test_ppl_non_numeric_logprob_and_overflow():
    with pytest.raises(JobFailed, match="non-numeric logprob None"):
        window_nll([1, 2], [None, {"2": {"logprob": None}}])
    assert _exp(1000.0) is None and _exp(math.nan) is None and _exp(0.0) == 1.0


@pytest.mark.parametrize("logprob", [math.nan, 5.0, 0.01])
def test_a_logprob_no_probability_has_is_refused(logprob):
    """NaN gave "perplexity is infinite" and +5 a perplexity below 1: both are the server's bug."""
    with pytest.raises(JobFailed, match=r"position 1 has logprob .*, which no probability has"):
        window_nll([1, 2], [None, {"2": {"logprob": logprob}}])


def test_a_minus_infinite_logprob_is_a_ruled_out_token_and_rounding_is_tolerated():
    assert window_nll([1, 2], [None, {"2": {"logprob": -math.inf}}])[0] == math.inf
    assert window_nll([1, 2], [None, {"2": {"logprob": 1e-6}}]) == (-1e-6, 1)


def test_needle_with_an_answer_budget_that_fills_the_context_says_to_lower_it():
    with pytest.raises(BadInput) as ei:
        NeedleSettings(tokens=2000, depth=0.5, max_tokens=5000).validate(4096)
    assert ei.value.line().endswith("--max-tokens 5000 alone fills it: lower --max-tokens (e.g. 32)")


@pytest.mark.parametrize("make, words", [
    (lambda d: Path("/dev/zero"), "is not a regular file"),
    (lambda d: d, "is not a regular file"),
    (lambda d: d / "missing.txt", "cannot read"),
])
def test_texts_must_be_regular_files_and_are_checked_before_the_endpoint(tmp_path, make, words):
    """/dev/zero was read until memory ran out; a missing file was found only after the endpoint."""
    path = make(tmp_path)
    for settings, flag in ((NeedleSettings(tokens=100, depth=0.5, haystack=path), "--haystack"),
                           (PplSettings(text=path), "--text")):
        with pytest.raises(BadInput) as ei:
            settings.check_inputs()
        assert ei.value.message.startswith(f"{flag}" if words != "cannot read" else f"cannot read {flag}")
        assert words in ei.value.message


def test_a_huge_text_is_refused_by_its_size(tmp_path, monkeypatch):
    import dsv4serve.bench as bench

    big = tmp_path / "big.txt"
    big.write_text("word " * 1000)
    monkeypatch.setattr(bench, "MAX_TEXT_BYTES", 1024)
    with pytest.raises(BadInput, match="more than the 0 MiB read"):
        bench.check_text_file(big, "--text")


def test_a_pipe_is_read_as_a_text(tmp_path):
    """`--text <(zcat wiki.gz)`: a FIFO with a writer is a text, read up to the cap."""
    import os
    import threading

    from dsv4serve.bench import read_text_file

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "wb") as f:
            f.write(b"line one\r\nline two\n")

    t = threading.Thread(target=write)
    t.start()
    assert read_text_file(fifo, "--text") == "line one\nline two\n"
    t.join(10)


def test_an_out_that_became_a_file_during_the_run_keeps_the_result(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(BadInput) as ei:
        write_outputs({"endpoint": {"base_url": "u", "model": "m"}, "text": "t", "chunks": 1, "ctx": 8,
                       "tokens_scored": 7, "ppl": 2.0, "ratio": None, "notes": []}, tmp_path / "afile" / "out", "ppl")
    assert "the result is kept in" in ei.value.line()
    kept = list((tmp_path / "home" / "bench").iterdir())
    assert len(kept) == 1 and json.loads(kept[0].read_text())["ppl"] == 2.0


def test_a_web_page_instead_of_an_api_is_named_with_a_fix():
    """A --base-url at some other web server answers /v1/models with an HTML 404: the error names the
    page by its title (not its markup) and says what --base-url must be; a 5xx points at the log."""
    import httpx

    from dsv4serve import bench_client
    from dsv4serve.errors import JobFailed

    page = ("<!DOCTYPE HTML>\n<html lang=\"en\"><head><title>Error response</title></head>"
            "<body><h1>Error response</h1><p>Error code: 404</p></body></html>\n")

    def handler(req: httpx.Request) -> httpx.Response:
        """Stands in for `python -m http.server` (404 page) and for a server that fails (500)."""
        if req.url.host == "web.test":
            return httpx.Response(404, text=page, headers={"content-type": "text/html;charset=utf-8"})
        return httpx.Response(500, json={"error": {"message": "EngineCore died"}})

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(JobFailed) as e:
            bench_client.list_models(client, "http://web.test:8000")
        assert e.value.message == "GET http://web.test:8000/v1/models: HTTP 404: an HTML page titled 'Error response'"
        assert "--base-url must be the server's root" in e.value.hint
        with pytest.raises(JobFailed) as e:
            bench_client.list_models(client, "http://api.test:8000")
        assert e.value.message.endswith("HTTP 500: EngineCore died") and "dsv4serve logs" in e.value.hint


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_a_generation_the_server_ended_gives_no_figure(reason):
    lines = sse(chunk("The quick"), chunk(" brown", finish=reason), usage_chunk(9, 2), "data: [DONE]")
    with pytest.raises(StreamError, match=f"finish_reason '{reason}' after 2 tokens") as e:
        consume_stream(iter_sse_data(lines), StreamResult(t_start=0.0), Clock())
    assert "dsv4serve logs" in e.value.hint


def test_keep_alives_do_not_hold_a_stream_past_its_deadlines():
    from dsv4serve.bench_client import within_deadlines as deadline_lines

    clock = Clock(step=1.0)
    heartbeat = iter([": keep-alive"] * 100)
    r = StreamResult(t_start=clock())
    with pytest.raises(StreamError, match="no token within 5 s of the request"):
        list(iter_sse_data(deadline_lines(heartbeat, r, 5.0, 500.0, clock)))
    # tokens that keep coming, but past the whole stream's bound
    clock = Clock(step=1.0)
    r = StreamResult(t_start=clock())
    endless = iter(sse(*[chunk("tok")] * 200))
    with pytest.raises(StreamError, match="did not end within 30 s"):
        consume_stream(iter_sse_data(deadline_lines(endless, r, 5.0, 30.0, clock)), r, clock)


def test_sse_lines_split_text_that_arrives_in_any_pieces():
    from dsv4serve.bench_client import sse_lines

    assert list(sse_lines(["da", "ta: a\r", "\ndata: b\rdata", ": c\n", "\n", "tail\r"])) == \
        ["data: a", "data: b", "data: c", "", "tail"]


def test_a_stream_that_never_sends_a_newline_still_meets_its_deadline():
    """The deadlines were checked per complete line: a server that sent a byte a second and never
    a newline held bench past every deadline, forever (helper audit). They are checked per piece of
    text now. The clock is a stand-in that moves 1 s a read; the server really trickles."""
    import threading
    import time as _time

    from dsv4serve.bench_client import Endpoint, stream_chat

    stop = threading.Event()

    class Trickle(JsonHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write((chunk("tok") + "\n\n").encode())
            self.wfile.flush()
            while not stop.is_set():
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    return
                _time.sleep(0.02)

    with local_server(Trickle) as base, httpx.Client() as client:
        ep = Endpoint(base_url=base, model="m")
        body = {"model": "m", "max_tokens": 4, "stream": True}
        t0 = _time.monotonic()
        try:
            with pytest.raises(StreamError, match="did not end within 63 s"):
                stream_chat(client, ep, body, read_timeout_s=3.0, clock=Clock(step=1.0))
        finally:
            stop.set()
        assert _time.monotonic() - t0 < 30


def test_a_repeated_needle_seed_still_misses_the_prefix_cache(monkeypatch):
    """Same --seed, same passcode; the nonce at the prompt's start differs each run."""
    from dsv4serve import bench_needle

    seen = []
    monkeypatch.setattr(bench_needle, "build_prompt",
                        lambda tok, s, code, nonce, filler: seen.append((code, nonce)) or (_ for _ in ()).throw(
                            JobFailed("stop here")))
    target = type("T", (), {"endpoint": Endpoint(base_url="http://127.0.0.1:9", model="m", max_model_len=4096)})()
    settings = NeedleSettings(tokens=800, depth=0.5, seed=7)
    for _ in range(2):
        with pytest.raises(JobFailed):
            bench_needle.run_needle(None, target, settings)
    assert seen[0][0] == seen[1][0] and seen[0][1] != seen[1][1]  # the seed still fixes the passcode


def test_reports_are_written_in_utf8_whatever_the_locale(tmp_path: Path):
    """Under LC_ALL=C the default codec is ASCII; every report holds Σ, × or —. A real process with
    that locale (the codec is chosen at interpreter start, so no monkeypatch can stand in)."""
    import subprocess

    code = ("import sys, json; from pathlib import Path; from dsv4serve.bench_report import write_outputs; "
            "r = json.loads(sys.argv[1]); print(write_outputs(r, Path(sys.argv[2]), 'needle')[0])")
    needle = {"endpoint": {"base_url": "u", "model": "m"}, "prompt_tokens": 400, "tokens_requested": 400,
              "tokens_sized_by": "tokenize", "depth": 0.37, "code": "a-b-1", "found": True, "ttft_s": 2.0,
              "prefill_tok_s": 200.0, "decode_tok_s": 10.0,
              "reference": {"profile": "p", "tokens": 166000, "depth": 0.37, "found": True, "ttft_s": 119.7,
                            "prefill_tok_s": 1386.8, "decode_tok_s": None, "comparable": False},
              "ratio": None, "notes": ["ratio — ×"]}
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("LC_", "LANG", "PYTHONUTF8",
                                                                                 "PYTHONIOENCODING"))}
    r = subprocess.run([sys.executable, "-c", code, json.dumps(needle), str(tmp_path / "o")], capture_output=True,
                       text=True, timeout=60, env={**env, "LC_ALL": "C", "PYTHONUTF8": "0"})
    assert r.returncode == 0, r.stderr[-600:]
    md = (tmp_path / "o" / "needle.md").read_text(encoding="utf-8")
    assert "—" in md and "ratio — ×" in md


def test_a_broken_symlink_out_is_refused_before_the_measurement(tmp_path: Path):
    from dsv4serve.bench_report import prepare_out

    (tmp_path / "dangl").symlink_to(tmp_path / "nowhere" / "dir")
    for out in (tmp_path / "dangl", tmp_path / "dangl" / "sub"):
        with pytest.raises(BadInput, match="is a broken symlink") as e:
            prepare_out(out)
        assert "\n" not in e.value.line()
    prepare_out(tmp_path / "fresh" / "sub")  # absent but creatable: fine


def test_stream_chat_holds_its_requests_to_the_deadlines():
    """Through the real request path (httpx with a stand-in transport: a server that only sends
    keep-alive comments, as a proxy in front of a stuck engine does)."""
    from dsv4serve.bench_client import chat_body, stream_chat

    def handler(request):
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=iter([b": keep-alive\n\n"] * 100))

    ep = Endpoint(base_url="http://stub", model="m")
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(StreamError, match="no token within 5 s of the request"):
            stream_chat(client, ep, chat_body(ep, "hi", 16, False), 5.0, clock=Clock(step=1.0))


def test_needle_without_the_servers_prompt_count_shows_the_tokenizers():
    r = {"endpoint": {"base_url": "u", "model": "m"}, "prompt_tokens": None, "tokens_counted": 812,
         "tokens_requested": 800, "tokens_sized_by": "tokenize", "depth": 0.5, "code": "a-b-1", "found": True,
         "ttft_s": 2.0, "prefill_tok_s": 406.0, "decode_tok_s": 10.0, "reference": None, "ratio": None, "notes": []}
    md = needle_markdown(r)
    assert "- prompt: ~812 tokens" in md and "None" not in md.split("| metric")[0]


def test_bench_sends_the_key_the_server_demands(monkeypatch):
    """A seat started with --api-key (or VLLM_API_KEY) answered 401 to every bench request; with
    --base-url the key comes from VLLM_API_KEY, as vLLM's own clients take it."""
    from dsv4serve import bench

    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    seen = {}

    def fake_endpoint(client, base_url, model, fallback_len):
        seen["auth"] = client.headers.get("Authorization")
        return bench.Endpoint(base_url=base_url, model=model or "m")

    monkeypatch.setattr(bench, "resolve_endpoint", fake_endpoint)
    client = bench.make_client()
    target = bench.resolve_target(client, base_url="http://127.0.0.1:1", model="m", profile=None, seat=None)
    assert seen["auth"] == "Bearer s3cret" and target.api_key == "s3cret"
    assert bench.make_client(target.api_key).headers["Authorization"] == "Bearer s3cret"
    monkeypatch.delenv("VLLM_API_KEY")
    assert "Authorization" not in bench.make_client(None).headers


def test_bench_of_a_local_seat_ignores_the_shells_proxy(monkeypatch):
    """bench of this machine's seat went through an http_proxy of the shell (and failed with it);
    a --base-url may be reached through one on purpose, so only the local seat ignores it."""
    from dsv4serve import bench

    class Seat(JsonHandler):
        def do_GET(self):
            self.send_json(200, {})

    with local_server(Seat) as base:
        dead_proxy(monkeypatch)
        with bench.make_client(local=True) as c:
            assert c.get(f"{base}/health", timeout=5).status_code == 200
        with bench.make_client() as c, pytest.raises(httpx.HTTPError):
            c.get(f"{base}/health", timeout=5)  # through the (dead) proxy, as the shell asks for a --base-url


def test_the_needle_is_a_whole_word_in_any_script():
    """Beside kana, hanzi or Markdown's underscores the code is still the code; a longer code is not
    (review: Unicode \\w boundaries missed the first three)."""
    from dsv4serve.bench_needle import _says

    code = "saffron-anchor-5179"
    for text in ("パスコードはsaffron-anchor-5179です。", "密码是saffron-anchor-5179", "_saffron-anchor-5179_",
                 "**saffron-anchor-5179**", "code: saffron-anchor-5179."):
        assert _says(text, code), text
    for text in ("saffron-anchor-51797", "xsaffron-anchor-5179", "saffron-anchor-5179-2"):
        assert not _says(text, code), text


def test_a_proxy_url_httpx_cannot_parse_is_one_line(monkeypatch):
    from dsv4serve import bench

    monkeypatch.setenv("ALL_PROXY", "http://proxy:notaport")
    with pytest.raises(BadInput, match="the shell's proxy settings cannot be used"):
        bench.make_client()


def test_shell_proxy_names_the_route_without_credentials(monkeypatch):
    """Which proxy carries a request is what an error names: never its password, never a proxy
    NO_PROXY exempts, never one for the local seat's client (which ignores the shell)."""
    from dsv4serve import bench
    from dsv4serve.bench_client import shell_proxy

    monkeypatch.setenv("HTTP_PROXY", "http://user:secret@127.0.0.1:3128")
    monkeypatch.setenv("NO_PROXY", "localhost")
    for var in ("http_proxy", "no_proxy", "all_proxy", "ALL_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)
    with bench.make_client() as c:
        assert shell_proxy(c, "http://127.0.0.1:8000") == "http://127.0.0.1:3128"
        assert shell_proxy(c, "http://localhost:8000") is None
        assert shell_proxy(c, "https://example.org") is None  # no HTTPS_PROXY / ALL_PROXY
    with bench.make_client(local=True) as c:
        assert shell_proxy(c, "http://127.0.0.1:8000") is None


def test_proxy_and_key_hints_name_what_failed():
    """The 407, the refused key and a proxy's timeout each say what to fix (review: untested)."""
    from dsv4serve.bench_client import http_failure, status_hint

    req = httpx.Request("GET", "http://10.0.0.5:8000/v1/models")
    assert "the shell's proxy http://p:3128 wants credentials" in status_hint(httpx.Response(407, request=req),
                                                                              "http://p:3128")
    assert "pass it with --api-key KEY" in status_hint(httpx.Response(401, request=req))
    keyed = httpx.Request("GET", "http://10.0.0.5:8000/v1/models", headers={"Authorization": "Bearer k"})
    assert "refused the API key bench sent" in status_hint(httpx.Response(401, request=keyed))
    assert "see its log" in status_hint(httpx.Response(502, request=req))
    assert "went through the shell's proxy http://p:3128" in status_hint(httpx.Response(502, request=req),
                                                                          "http://p:3128")
    e = http_failure("http://10.0.0.5:8000", httpx.ReadTimeout("timed out", request=req), proxy="http://p:3128")
    assert "did not answer through the shell's proxy http://p:3128 in time" in e.message and "NO_PROXY" in e.hint
    e = http_failure("http://10.0.0.5:8000", httpx.ProxyError("503 Service Unavailable", request=req),
                     proxy="http://p:3128")
    assert e.message.startswith("cannot reach http://10.0.0.5:8000 through the shell's proxy http://p:3128")
