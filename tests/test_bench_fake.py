"""The bench CLI against a scripted fake endpoint, and its error paths against a closed port.

`FakeVllm` stands in for vLLM's OpenAI server so the tests can script what a real server will not
produce on demand: error chunks mid-stream, chunks without `choices`, HTTP 500s, several tokens
per chunk, missing /metrics or /tokenize, two served models.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest
from typer.testing import CliRunner

from dsv4serve.cli import app

TOKENS_PER_CHUNK = 3


@dataclass
class Script:
    models: list[str] = field(default_factory=lambda: ["fake-model"])
    max_model_len: int | None = 4096
    chat: str = "ok"                  # ok | error_chunk | no_choices | http_500 | json_200 | reasoning_only
    content_chunks: int = 4
    metrics: bool = True
    tokenize: bool = True
    tokenize_reply: Any = None        # when set, /tokenize answers this JSON instead of vLLM's
    chunk_delay_s: float = 0.01
    api_key: str | None = None        # when set, /v1 paths answer 401 without "Bearer <it>", as vLLM's do
    basic: str | None = None          # "user:password": /v1 paths answer 401 without it (a proxy's basic auth)
    answer_suffix: str = ""           # appended to the needle's code in the answer (a wrong recollection)
    finish: str = "length"            # the last chunk's finish_reason
    fail_after: int | None = None     # chat requests answered before every later one gets HTTP 500
    # filled in by the server
    chat_bodies: list[dict] = field(default_factory=list)
    completion_bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    drafts: float = 0.0
    accepted: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    script: Script

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def _json(self, status: int, obj: Any) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length", "0"))
        return json.loads(self.rfile.read(n) or b"{}")

    def _refused(self) -> bool:
        basic = self.script.basic
        if basic is not None and self.path.startswith("/v1") and \
                self.headers.get("Authorization") != "Basic " + base64.b64encode(basic.encode()).decode():
            self._json(401, {"error": "Unauthorized"})
            return True
        key = self.script.api_key
        if key is None or not self.path.startswith("/v1") or self.headers.get("Authorization") == f"Bearer {key}":
            return False
        self._json(401, {"error": "Unauthorized"})
        return True

    def do_GET(self) -> None:  # noqa: N802
        s = self.script
        if self._refused():
            return
        if self.path == "/v1/models":
            data = []
            for m in s.models:
                entry: dict[str, Any] = {"id": m, "object": "model"}
                if s.max_model_len is not None:
                    entry["max_model_len"] = s.max_model_len
                data.append(entry)
            self._json(200, {"object": "list", "data": data})
        elif self.path == "/metrics" and s.metrics:
            with s.lock:
                text = (f'vllm:spec_decode_num_drafts_total{{engine="0"}} {s.drafts / 2}\n'
                        f'vllm:spec_decode_num_drafts_total{{engine="1"}} {s.drafts / 2}\n'
                        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {s.accepted}\n'
                        f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {s.drafts * 3}\n')
            raw = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        s = self.script
        body = self._body()
        if self._refused():
            return
        if self.path == "/v1/chat/completions":
            self._chat(body)
        elif self.path == "/tokenize" and s.tokenize:
            if s.tokenize_reply is not None:
                self._json(200, s.tokenize_reply)
            elif "messages" in body:
                text = body["messages"][0]["content"]
                self._json(200, {"count": (len(text) + 2) // 3 + 7, "max_model_len": s.max_model_len, "tokens": []})
            else:
                n = (len(body["prompt"]) + 2) // 3
                self._json(200, {"count": n, "max_model_len": s.max_model_len, "tokens": [10 + i % 50 for i in range(n)]})
        elif self.path == "/v1/completions":
            s.completion_bodies.append(body)
            prompt = body["prompt"]
            # The prompt token scores -2.0; a better candidate rides along as vLLM adds top-k.
            plp = [None] + [{str(t): {"logprob": -2.0, "rank": 4}, "999": {"logprob": -0.1, "rank": 1}}
                            for t in prompt[1:]]
            self._json(200, {"choices": [{"index": 0, "text": "x", "prompt_logprobs": plp}],
                             "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1}})
        else:
            self._json(404, {"detail": "Not Found"})

    def _chat(self, body: dict) -> None:
        s = self.script
        with s.lock:
            s.chat_bodies.append(body)
            s.in_flight += 1
            s.max_in_flight = max(s.max_in_flight, s.in_flight)
        try:
            if body.get("model") not in s.models:
                self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
                return
            if s.chat == "json_200":  # a proxy that ignored stream: true
                self._json(200, {"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": 1}})
                return
            if s.chat == "http_500" or (s.fail_after is not None and len(s.chat_bodies) > s.fail_after):
                # a traceback in the message (what a crashed engine sends) must still be one line
                self._json(500, {"error": {"message": "EngineCore died\nTraceback (most recent call last):\n"
                                                      + '  File "x.py", line 1, in f\n    y()\n' * 40
                                                      + "torch.OutOfMemoryError: CUDA out of memory",
                                           "type": "InternalServerError"}})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            prompt = body["messages"][0]["content"]
            m = re.search(r"passcode is ([a-z]+-[a-z]+-\d+)\.", prompt)
            events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
            if s.chat == "error_chunk":
                events += [{"choices": [{"index": 0, "delta": {"content": "abc"}}]},
                           {"error": {"message": "KV cache exhausted at 166000 tokens", "code": 500}}]
            elif s.chat == "no_choices":
                events += [{"choices": [{"index": 0, "delta": {"content": "abc"}}]}, {"object": "oops"}]
            elif s.chat == "reasoning_only":  # every answer token went to reasoning (trap 6)
                events += [{"choices": [{"index": 0, "delta": {"reasoning_content": "let me think"},
                                         "finish_reason": "length"}]},
                           {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 32,
                                                     "total_tokens": 52}}]
            else:
                words = [m.group(1) + s.answer_suffix] if m else [f" w{i}" for i in range(s.content_chunks)]
                for i, w in enumerate(words):
                    last = i == len(words) - 1
                    events.append({"choices": [{"index": 0, "delta": {"content": w},
                                                "finish_reason": s.finish if last else None}]})
                n = TOKENS_PER_CHUNK * len(words)
                events.append({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": n,
                                                        "total_tokens": 20 + n}})
                with s.lock:
                    # Each chunk is one target step that accepted 2 drafted tokens: length 3.
                    s.drafts += len(words)
                    s.accepted += 2 * len(words)
            for ev in events:
                time.sleep(s.chunk_delay_s)
                self.wfile.write(b": keep-alive\n\n")
                self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        finally:
            with s.lock:
                s.in_flight -= 1


@pytest.fixture
def fake():
    script = Script()
    handler = type("H", (_Handler,), {"script": script})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    script.url = f"http://127.0.0.1:{srv.server_address[1]}"  # type: ignore[attr-defined]
    yield script
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here now
    return port


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


def one_line_error(res, json_out: bool = False) -> str:
    err = res.stderr.rstrip("\n")  # a blank line before the error (a progress bar's leftover) is a second line
    assert "\n" not in err, repr(err)
    assert err.startswith("error: ")
    if json_out:  # --json: the same refusal as one JSON document on stdout, nothing else there
        doc = json.loads(res.stdout)["error"]
        assert doc["exit_code"] == res.exit_code and doc["message"] in err
    else:
        assert res.stdout == ""
    return err


# ---------------------------------------------------------------------------------------------
# the table


def test_bench_json_counts_from_usage_and_acceptance_from_metrics(fake):
    res = run("--base-url", fake.url, "--streams", "1,3", "--suite", "en,code", "--runs", "2",
              "--max-tokens", "12", "--json", "--profile", "8x16gb-380k")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)  # one clean document: no bar, no table
    assert doc["reference"]["profile"] == "8x16gb-380k"
    assert [(c["streams"], c["suite"]) for c in doc["cells"]] == [(1, "en"), (1, "code"), (3, "en"), (3, "code")]
    for c in doc["cells"]:
        for r in c["runs"]:
            for s in r["per_stream"]:
                # 4 content chunks of 3 tokens each: usage says 12; the chunk count (7) is not used
                assert s["completion_tokens"] == 12 and s["chunks"] == 6
            assert r["completion_tokens"] == 12 * c["streams"]
        assert c["acceptance_length"]["mean"] == pytest.approx(3.0)
        assert c["aggregate_tok_s"]["n"] == 2
    en1 = doc["cells"][0]
    assert en1["reference"]["tok_s"] == 78.6
    # the references were measured at 256 tokens: at 12 the figure is shown, not divided
    assert en1["ratio"]["tok_s"] is None
    assert "no tok/s ratio against the reference: --max-tokens 12 (the references used 256)" in doc["notes"]
    assert doc["cells"][2]["reference"]["tok_s"] is None  # the profile has no 3-stream figure
    assert fake.max_in_flight == 3  # the three streams really ran together
    # warm-up (3 streams) + 2 runs x (1 + 3 streams) x 2 suites
    assert len(fake.chat_bodies) == 3 + 2 * 4 * 2
    b = fake.chat_bodies[-1]
    assert b["temperature"] == 0 and b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert b["chat_template_kwargs"] == {"thinking": False} and b["max_tokens"] == 12
    # at the references' 256 tokens the ratio is there
    res256 = run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--json",
                 "--profile", "8x16gb-380k")
    assert res256.exit_code == 0, res256.stderr
    c256 = json.loads(res256.stdout)["cells"][0]
    assert c256["ratio"]["tok_s"] == pytest.approx(c256["aggregate_tok_s"]["mean"] / 78.6)


def test_a_password_in_the_base_url_is_sent_but_never_written(fake, tmp_path):
    """A base URL with user:password (a seat behind a proxy's basic auth) went verbatim into the
    JSON, bench.json and bench.md (bench audit): the credentials now go to the client alone."""
    fake.basic = "admin:s3cret"
    secret_url = fake.url.replace("http://", "http://admin:s3cret@")
    out = tmp_path / "report"
    res = run("--base-url", secret_url, "--streams", "1", "--suite", "en", "--runs", "1", "--no-warmup", "--json",
              "--out", str(out))
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["endpoint"]["base_url"] == fake.url
    for text in (res.stdout, res.stderr, (out / "bench.json").read_text(), (out / "bench.md").read_text()):
        assert "s3cret" not in text
    fake.basic = "admin:other"  # the same run against a server that wants another password: refused, no leak
    res = run("--base-url", secret_url, "--streams", "1", "--suite", "en", "--runs", "1", "--no-warmup")
    assert res.exit_code != 0 and "s3cret" not in res.stderr + res.stdout
    assert "refused the user:password of --base-url" in res.stderr  # not the API key's hint
    # a URL refused before it was split was quoted whole (review): every refusal masks it
    for bad in (fake.url.replace("http://", "http://admin:s3cret@") + "0000", secret_url + "/?x=1",
                "ftp://admin:s3cret@host", "http://admin:s3cret@[bad", "admin:s3cret@127.0.0.1:8000",
                "http:admin:s3cret@host:8000"):
        res = run("--base-url", bad, "--runs", "1", "--json")
        assert res.exit_code == 2 and "s3cret" not in res.stderr + res.stdout and "***@" in res.stderr, res.stderr
    # one Authorization header cannot carry the user:password and an API key: said, not dropped (review)
    res = run("--base-url", secret_url, "--api-key", "k", "--runs", "1")
    assert res.exit_code == 2 and "carries a user:password and --api-key gives an API key" in one_line_error(res)


def test_thinking_flag_keeps_reasoning_on(fake):
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--thinking",
              "--no-warmup", "--json")
    assert res.exit_code == 0, res.stderr
    # sent, not left to the template's default, which may be off on another model (bench audit)
    assert fake.chat_bodies[0]["chat_template_kwargs"] == {"thinking": True}


def test_table_output_and_files(fake, tmp_path):
    out = tmp_path / "report"
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "ja", "--runs", "1", "--max-tokens", "12",
              "--profile", "8x16gb-380k", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    assert "ja: fake-model vs reference 8x16gb-380k" in res.stdout
    assert "71.1" in res.stdout  # the reference figure beside the measured one
    md = (out / "bench.md").read_text()
    assert "| ja | 1 |" in md and "| 71.1 |" in md
    assert json.loads((out / "bench.json").read_text())["cells"][0]["suite"] == "ja"


def test_metrics_absent_gives_na(fake):
    fake.metrics = False
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["cells"][0]["acceptance_length"] is None
    assert any("acceptance length n/a" in n for n in doc["notes"])


@pytest.mark.parametrize("mode, words", [
    ("error_chunk", "server sent an error chunk: KV cache exhausted at 166000 tokens"),
    ("no_choices", "stream chunk has no 'choices'"),
    ("http_500", "HTTP 500: EngineCore died torch.OutOfMemoryError: CUDA out of memory"),
    ("json_200", "did not stream (content-type application/json)"),
])
def test_stream_errors_are_surfaced(fake, mode, words):
    fake.chat = mode
    res = run("--base-url", fake.url, "--streams", "2", "--suite", "en", "--runs", "1", "--no-warmup", "--json")
    assert res.exit_code == 1
    err = one_line_error(res, json_out=True)
    assert words in err and "en × 2 stream(s), run 1" in err and "stream 1/2" in err


def test_wrong_model_names_the_served_ones(fake):
    res = run("--base-url", fake.url, "--model", "nope")
    assert res.exit_code == 2
    assert "model 'nope' is not served" in one_line_error(res) and "(served: fake-model)" in res.stderr


def test_two_models_need_a_choice(fake):
    fake.models = ["a", "b"]
    res = run("--base-url", fake.url)
    assert res.exit_code == 2
    assert "serves 2 models (a, b)" in one_line_error(res)


def test_bad_streams_syntax_exits_2(fake):
    res = run("--base-url", fake.url, "--streams", "1,four")
    assert res.exit_code == 2
    assert "--streams '1,four'" in one_line_error(res)


def test_running_seat_from_state(fake, isolated_home):
    from dsv4serve import state

    port = int(fake.url.rsplit(":", 1)[1])
    st = state.SeatState(seat="cpu-demo", run_id="r1", profile="cpu-demo", profile_digest="x", runtime="native",
                         pid=os.getpid(), start_time=psutil.Process().create_time(), argv=["vllm"], env={},
                         host="127.0.0.1", port=port, served_name="fake-model", tp=2, run_dir=str(isolated_home),
                         log_path=str(isolated_home / "log"), phase="ready")
    state.save(st)
    res = run("--streams", "1", "--suite", "en", "--runs", "1", "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["endpoint"]["seat"] == "cpu-demo" and doc["endpoint"]["model"] == "fake-model"
    assert doc["reference"]["profile"] == "cpu-demo"  # the seat's own profile: no figures
    assert doc["cells"][0]["reference"]["tok_s"] is None
    res = run("--streams", "1", "--suite", "en", "--runs", "1", "--json", "--profile", "8x16gb-380k")
    assert json.loads(res.stdout)["cells"][0]["reference"]["tok_s"] == 78.6
    assert not any("still" in n for n in json.loads(res.stdout)["notes"])
    state.save(st.model_copy(update={"phase": "starting"}))  # up has not seen its canary pass yet
    res = run("--streams", "1", "--suite", "en", "--runs", "1", "--json")
    assert "seat cpu-demo is still starting (not ready): its figures may include start-up work" in \
        json.loads(res.stdout)["notes"]


def test_a_native_seat_started_with_the_shells_key_is_benched_with_it_or_refused_by_name(fake, isolated_home,
                                                                                          monkeypatch):
    """A native seat inherits VLLM_API_KEY from the shell that ran `up`, which the state did not
    record: bench from another shell sent no key (401 on every request) or another one, and the hint
    blamed the seat's own key (bench audit). The state keeps a fingerprint of the key, never the key."""
    from dsv4serve import launch, state

    fake.api_key = "k-up"
    port = int(fake.url.rsplit(":", 1)[1])
    st = state.SeatState(seat="cpu-demo", run_id="r1", profile="cpu-demo", profile_digest="x", runtime="native",
                         pid=os.getpid(), start_time=psutil.Process().create_time(), argv=["vllm"], env={},
                         host="127.0.0.1", port=port, served_name="fake-model", tp=2, run_dir=str(isolated_home),
                         log_path=str(isolated_home / "log"), phase="ready",
                         api_key_fp=launch.key_fingerprint("k-up", "r1"))
    state.save(st)
    assert "k-up" not in state.state_path("cpu-demo").read_text()
    # salted with the run: the same key of another run (or another tool's plain hash) does not match it
    assert launch.key_fingerprint("k-up", "r2") != st.api_key_fp and launch.key_fingerprint(None, "r1") == ""
    args = ("--streams", "1", "--suite", "en", "--runs", "1", "--no-warmup")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    res = run(*args)
    assert res.exit_code == 2
    err = one_line_error(res)
    assert "seat cpu-demo's server was started with an API key and this shell has no VLLM_API_KEY" in err
    assert "export the VLLM_API_KEY of the shell that ran `up`" in err and st.api_key_fp not in err
    monkeypatch.setenv("VLLM_API_KEY", "k-other")
    err = one_line_error(run(*args))
    assert "and this shell has another one in VLLM_API_KEY" in err
    assert launch.key_fingerprint("k-other", "r1") not in err  # no digest of an unrelated key is printed (review)
    monkeypatch.setenv("VLLM_API_KEY", "k-\udcff")  # not UTF-8 (a byte the shell held): one line, no traceback
    res = run(*args, "--json")
    assert res.exit_code == 2 and json.loads(res.stdout)["error"]
    monkeypatch.setenv("VLLM_API_KEY", "k-up")
    assert run(*args).exit_code == 0
    monkeypatch.delenv("VLLM_API_KEY")
    assert run(*args, "--api-key", "k-up").exit_code == 0  # said on the command line: taken as given
    # a state written before the salt (sha256(key)[:12]) still matches its key (review)
    import hashlib

    state.save(st.model_copy(update={"api_key_fp": hashlib.sha256(b"k-up").hexdigest()[:12]}))
    monkeypatch.setenv("VLLM_API_KEY", "k-up")
    assert run(*args).exit_code == 0
    monkeypatch.setenv("VLLM_API_KEY", "k-other")
    assert run(*args).exit_code == 2


def test_no_seat_running_is_bad_input():
    res = run("--streams", "1")
    assert res.exit_code == 2
    assert "no seat is running" in one_line_error(res)


# ---------------------------------------------------------------------------------------------
# needle and ppl


def test_needle_found_with_figures(fake):
    res = run("needle", "--base-url", fake.url, "--tokens", "900", "--depth", "0.37", "--json", "--seed", "1")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["found"] is True and doc["code"] in doc["answer"]
    assert doc["tokens_sized_by"] == "tokenize" and 890 <= doc["tokens_counted"] <= 900
    assert doc["prefill_tok_s"] == pytest.approx(doc["prompt_tokens"] / doc["ttft_s"])
    prompt = fake.chat_bodies[0]["messages"][0]["content"]
    assert prompt.count(doc["code"]) == 1


def test_needle_without_tokenize_estimates_and_says_so(fake):
    fake.tokenize = False
    res = run("needle", "--base-url", fake.url, "--tokens", "900", "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["tokens_sized_by"] == "estimate" and doc["tokens_counted"] is None
    assert any("no /tokenize" in n for n in doc["notes"])


def test_needle_above_max_model_len(fake):
    fake.max_model_len = 512
    res = run("needle", "--base-url", fake.url, "--tokens", "600")
    assert res.exit_code == 2
    assert "exceeds the seat's max-model-len 512" in one_line_error(res)
    assert fake.chat_bodies == []


def test_needle_uses_profile_window_when_models_lack_it(fake):
    fake.max_model_len = None
    res = run("needle", "--base-url", fake.url, "--tokens", "600", "--profile", "cpu-demo")
    assert res.exit_code == 2
    assert "max-model-len 512" in one_line_error(res)


def test_ppl_reads_the_prompt_tokens_logprob(fake):
    res = run("ppl", "--base-url", fake.url, "--ctx", "64", "--chunks", "3", "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ppl"] == pytest.approx(math.exp(2.0))  # not exp(0.1): the max candidate is ignored
    assert doc["chunks"] == 3 and doc["tokens_scored"] == 3 * 63
    assert any("NOT comparable" in n for n in doc["notes"])
    for b in fake.completion_bodies:
        assert b["prompt_logprobs"] == 0 and b["max_tokens"] == 1 and b["temperature"] == 0
        assert isinstance(b["prompt"], list) and len(b["prompt"]) == 64


def test_ppl_compares_with_the_reference_only_on_windows_cut_as_its_were(fake, tmp_path):
    """The ppl references scored ctx*4-character windows capped at ctx tokens; exact token windows
    score other spans with longer contexts, so only --windows chars gives a ratio."""
    f = tmp_path / "wiki.test.raw"
    f.write_text(("The quick brown fox jumps over the lazy dog near the river bank. " * 600)[:40000])
    args = ("ppl", "--base-url", fake.url, "--ctx", "512", "--chunks", "16", "--text", str(f), "--json",
            "--profile", "8x16gb-ppl")
    doc = json.loads(run(*args).stdout)
    assert doc["windows"] == "tokens" and doc["reference"]["comparable"] is False and doc["ratio"] is None
    assert any("pass --windows chars" in n for n in doc["notes"])
    fake.completion_bodies.clear()
    res = run(*args, "--windows", "chars")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["windows"] == "chars" and doc["chunks"] == 16 and doc["reference"]["comparable"] is True
    assert doc["ratio"] == pytest.approx(math.exp(2.0) / 6.7159)
    # 2,048 characters tokenize to 683 here (the fake's 3 characters a token), capped at 512
    assert [len(b["prompt"]) for b in fake.completion_bodies] == [512] * 16
    bad = run("ppl", "--base-url", fake.url, "--windows", "words")
    assert bad.exit_code == 2 and "--windows 'words' is not tokens or chars" in one_line_error(bad)


def test_ppl_text_too_short(fake, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("only a few words here")
    res = run("ppl", "--base-url", fake.url, "--ctx", "64", "--text", str(f))
    assert res.exit_code == 2
    assert "less than one window" in one_line_error(res)


def test_shared_options_before_the_subcommand(fake):
    res = run("--base-url", fake.url, "--json", "ppl", "--ctx", "32", "--chunks", "1")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["chunks"] == 1


# ---------------------------------------------------------------------------------------------
# endpoint down


@pytest.mark.parametrize("sub", [[], ["needle", "--tokens", "300"], ["ppl"]])
def test_endpoint_down_is_one_line_exit_1(closed_port, sub):
    res = run(*sub, "--base-url", f"http://127.0.0.1:{closed_port}")
    assert res.exit_code == 1
    assert f"cannot reach http://127.0.0.1:{closed_port}" in one_line_error(res)


# ---------------------------------------------------------------------------------------------
# bad input: refused up front, one line, exit 2


@pytest.mark.parametrize("url, words", [
    ("http://[::1", "is not a valid URL"),
    ("notaurl", "must start with http:// or https://"),
    ("ftp://127.0.0.1:8000", "must start with http:// or https://"),
    ("http://", "has no host"),
    ("http://a..b:8000", "invalid host name 'a..b'"),
    ("http://127.0.0.1:99999", "outside 1-65535"),
    ("http://127.0.0.1:8000/?x=1", "must not carry a query"),
])
@pytest.mark.parametrize("sub", [[], ["needle", "--tokens", "300"], ["ppl"]])
def test_bad_base_url_is_one_line_exit_2(sub, url, words):
    res = run(*sub, "--base-url", url, "--json")
    assert res.exit_code == 2, res.output
    err = one_line_error(res, json_out=True)
    assert f"--base-url '{url}'" in err and words in err and "e.g. --base-url http://" in err


def test_base_url_v1_suffix_gets_a_hint(fake):
    res = run("--base-url", fake.url + "/v1")
    assert res.exit_code == 1
    assert "drop the trailing /v1" in one_line_error(res)


@pytest.mark.parametrize("sub", [[], ["needle", "--tokens", "300"], ["ppl"]])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_timeout_must_be_positive(fake, sub, value):
    res = run(*sub, "--base-url", fake.url, "--timeout", value)
    assert res.exit_code == 2, res.output
    assert f"--timeout {value} must be a number of seconds above 0" in one_line_error(res)
    assert fake.chat_bodies == [] and fake.completion_bodies == []


@pytest.mark.parametrize("args, words", [
    (["--runs", "0"], "--runs 0 must be at least 1"),
    (["--max-tokens", "0"], "--max-tokens 0 must be at least 1"),
    (["needle", "--tokens", "0"], "--tokens 0 must be between 1 and"),
    (["needle", "--tokens", "99999999999"], "--tokens 99999999999 must be between 1 and"),
    (["needle", "--tokens", "300", "--depth", "nan"], "--depth nan must be between 0 and 1"),
    (["ppl", "--ctx", "1"], "--ctx 1 must be at least 2"),
    (["ppl", "--chunks", "0"], "--chunks 0 must be at least 1"),
])
def test_numeric_options_are_refused_before_any_request(closed_port, args, words):
    # A closed port: were the endpoint contacted first, the error would be "cannot reach" (exit 1).
    res = run(*args, "--base-url", f"http://127.0.0.1:{closed_port}")
    assert res.exit_code == 2, res.output
    assert words in one_line_error(res)


def test_unwritable_out_is_refused_before_measuring(fake, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = run("--base-url", fake.url, "--out", str(blocker / "sub"))
    assert res.exit_code == 2
    assert "cannot create --out" in one_line_error(res)
    res = run("--base-url", fake.url, "--out", str(blocker))
    assert res.exit_code == 2
    assert f"--out {blocker} is a file, not a directory" in one_line_error(res)
    assert fake.chat_bodies == []


# ---------------------------------------------------------------------------------------------
# a server that answers, but not as vLLM does


@pytest.mark.parametrize("reply, missing", [
    ({"max_model_len": 4096}, "'count'"),
    ({"count": "many", "tokens": [1]}, "'count'"),
    ([1, 2], "not a JSON object"),
])
def test_needle_malformed_tokenize_is_one_line_exit_1(fake, reply, missing):
    fake.tokenize_reply = reply
    res = run("needle", "--base-url", fake.url, "--tokens", "900", "--json")
    assert res.exit_code == 1, res.output
    err = one_line_error(res, json_out=True)
    assert f"POST {fake.url}/tokenize answered" in err and missing in err
    assert fake.chat_bodies == []


@pytest.mark.parametrize("reply", [{"count": 3}, {"count": 2, "tokens": ["a", "b"]}, {"count": 1, "tokens": 7}])
def test_ppl_malformed_tokenize_is_one_line_exit_1(fake, reply):
    fake.tokenize_reply = reply
    res = run("ppl", "--base-url", fake.url, "--ctx", "32", "--json")
    assert res.exit_code == 1, res.output
    err = one_line_error(res, json_out=True)
    assert f"POST {fake.url}/tokenize answered without a 'tokens' list" in err
    assert fake.completion_bodies == []


# ---------------------------------------------------------------------------------------------
# several seats


def _seat(fake, home, name: str, profile: str) -> None:
    from dsv4serve import state

    port = int(fake.url.rsplit(":", 1)[1])
    state.save(state.SeatState(seat=name, run_id=f"r-{name}", profile=profile, profile_digest="x", runtime="native",
                               pid=os.getpid(), start_time=psutil.Process().create_time(), argv=["vllm"], env={},
                               host="127.0.0.1", port=port, served_name="fake-model", tp=2, run_dir=str(home),
                               log_path=str(home / "log"), phase="ready"))


def test_several_seats_name_the_seat_flag(fake, isolated_home):
    _seat(fake, isolated_home, "fa", "fa")
    _seat(fake, isolated_home, "fb", "cpu-demo")
    res = run("--streams", "1", "--suite", "en", "--runs", "1")
    assert res.exit_code == 2
    err = one_line_error(res)
    assert "2 seats are running (fa, fb)" in err and "name one with --seat" in err
    assert "name one with --profile" not in err
    # --seat picks one; so does a --profile naming a running seat, even when that seat's
    # profile ('fa') cannot be loaded by name.
    for args in (["--seat", "fb"], ["--profile", "fa"]):
        res = run("--streams", "1", "--suite", "en", "--runs", "1", "--no-warmup", "--json", *args)
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["endpoint"]["seat"] == args[1]
    # A --profile naming no running seat only picks figures: the seat still has to be named.
    res = run("--streams", "1", "--profile", "8x16gb-380k")
    assert res.exit_code == 2
    assert "name one with --seat" in one_line_error(res)


def test_help_says_what_seat_and_profile_do():
    for sub in ([], ["needle"], ["ppl"]):
        res = CliRunner().invoke(app, ["bench", *sub, "--help"])
        out = " ".join(res.stdout.replace("│", " ").split())  # rich wraps help inside a box
        assert "name of the running seat to measure" in out
        assert "profile whose reference figures to show beside the results" in out
        assert "to choose which running seat to measure, use --seat" in out


@pytest.mark.parametrize("before, advice", [
    (["--timeout", "60"], "`dsv4serve bench needle` has its own --timeout: put it after the subcommand"),
    (["--max-tokens", "8"], "`dsv4serve bench needle` has its own --max-tokens: put it after the subcommand"),
    (["--no-warmup"], "`dsv4serve bench needle` has no --warmup: drop it"),
])
def test_table_options_before_a_subcommand_are_refused_not_dropped(before, advice, closed_port):
    """`bench --timeout 60 needle` would have measured with needle's own default timeout, silently;
    it is refused, naming the flag and where it goes (or that the subcommand has no such option).
    Nothing is contacted (the port is closed)."""
    res = run(*before, "--base-url", f"http://127.0.0.1:{closed_port}", "needle", "--tokens", "100")
    assert res.exit_code == 2
    err = one_line_error(res)
    assert f"{before[0]} before `needle` would be ignored" in err and advice in err, err


def test_a_refused_table_option_honours_the_subcommands_json(closed_port):
    res = run("--streams", "4", "--base-url", f"http://127.0.0.1:{closed_port}", "ppl", "--json")
    assert res.exit_code == 2
    doc = json.loads(res.stdout)
    assert doc["error"]["type"] == "BadInput" and "`dsv4serve bench ppl` has no --streams" in doc["error"]["hint"]


def test_seat_and_base_url_together_are_refused(closed_port):
    res = run("--seat", "cpu-demo", "--base-url", f"http://127.0.0.1:{closed_port}", "--runs", "1")
    assert res.exit_code == 2 and "--seat and --base-url both name what to measure" in one_line_error(res)


@pytest.mark.parametrize("sub", [["ppl", "--text"], ["needle", "--tokens", "100", "--haystack"]])
def test_a_refused_input_is_one_stderr_line_from_the_real_cli(fake, tmp_path, sub):
    """Through a pipe, as a user's script sees it: the progress bar used to leave a bare newline
    on stderr before the error line (CliRunner does not show it)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "dsv4serve", "bench", *sub[:1], "--base-url", fake.url, *sub[1:],
                        str(tmp_path / "absent.txt")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: cannot read --") and r.stderr.count("\n") == 1, repr(r.stderr)


# ---------------------------------------------------------------------------------------------
# results that must survive a misbehaving server or a bad --out


def _strict(text: str):
    def refuse(word):
        raise AssertionError(f"{word} in --json output")
    return json.loads(text, parse_constant=refuse)


def test_an_infinite_counter_is_no_figure_and_the_json_stays_strict(fake, tmp_path):
    """A /metrics counter at +Inf made acceptance inf - inf: the bare word NaN reached --json and
    bench.json, which strict parsers refuse. Non-finite samples are dropped (no acceptance)."""
    fake.accepted = math.inf
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--json",
              "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.stderr
    doc = _strict(res.stdout)
    _strict((tmp_path / "o" / "bench.json").read_text())
    assert all(c["acceptance_length"] is None for c in doc["cells"]), doc["cells"]


@pytest.mark.parametrize("ident", [5, {"a": 1}, ""])
def test_a_model_list_with_an_id_that_is_no_name_is_one_line(fake, ident):
    fake.models = [ident]
    res = run("--base-url", fake.url, "--runs", "1", "--json")
    assert res.exit_code == 1
    assert "/v1/models did not return an OpenAI model list" in one_line_error(res, json_out=True)


def test_a_dollar_in_the_model_name_still_gives_the_chart(fake, tmp_path):
    """matplotlib reads `$...$` as mathtext; a bad one raised after the whole run."""
    fake.models = ["m$\\frac$"]
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.stderr
    pytest.importorskip("matplotlib")
    assert (tmp_path / "o" / "bench.png").stat().st_size > 0


def test_an_out_that_fails_midway_keeps_the_result_and_leaves_no_part(fake, tmp_path, isolated_home):
    out = tmp_path / "o"
    (out / "bench.md").mkdir(parents=True)  # the last file cannot be written
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--json", "--out", str(out))
    assert res.exit_code == 2
    err = one_line_error(res, json_out=True)
    assert f"cannot write to --out {out}" in err and "the result is kept in" in err
    kept = Path(err.split("the result is kept in ")[1].split(";")[0])
    assert kept.parent == isolated_home / "bench" and _strict(kept.read_text())["cells"]
    assert sorted(p.name for p in out.iterdir()) == ["bench.md"]  # no bench.json / .png, no temp files


def test_a_full_disk_at_out_is_a_failed_job_and_json_keeps_the_measurement(fake, tmp_path, isolated_home, monkeypatch):
    """A disk full when --out was written came out as bad input (exit 2), and --json's stdout held
    only the error: a script lost an hour's result to a message (bench audit). Exit 1 now, and the
    one document on stdout is the measurement with the error beside it."""
    import errno

    from dsv4serve import bench_report

    def full(result, out_dir, stem, temps):
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / f"{stem}.json"))

    monkeypatch.setattr(bench_report, "_write_outputs", full)
    out = tmp_path / "o"
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--json", "--out", str(out))
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert doc["cells"][0]["suite"] == "en" and doc["error"]["exit_code"] == 1
    assert doc["error"]["message"].startswith(f"cannot write to --out {out}: No space left on device")
    assert "free space or fix the disk" in doc["error"]["hint"] and "the result is kept in" in doc["error"]["hint"]
    assert res.stderr.startswith("error: cannot write to --out") and res.stderr.count("\n") == 1


def test_a_stream_that_fails_late_keeps_the_runs_measured_before_it(fake, isolated_home):
    """One transient 500 in the last cell of a long table threw every finished cell away (bench
    audit): they are kept in the state dir, and the error names the file."""
    fake.fail_after = 3  # warm-up, en, code, then the second run's first request fails
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "en,code", "--runs", "2")
    assert res.exit_code == 1
    err = one_line_error(res)
    assert "HTTP 500" in err and "the 2 runs measured before it are kept in " in err
    kept = Path(err.split("are kept in ")[1].split(";")[0])
    doc = _strict(kept.read_text())
    assert kept.parent == isolated_home / "bench" and doc["kind"] == "dsv4serve.bench.partial"
    assert [(c["suite"], len(c["runs"])) for c in doc["cells"]] == [("en", 1), ("code", 1)]
    assert any(n.startswith("stopped early: en × 1 stream(s), run 2: stream 1/1") for n in doc["notes"])


def test_a_run_that_fails_creates_no_out_dir(closed_port, tmp_path):
    out = tmp_path / "new" / "a" / "b"
    res = run("--base-url", f"http://127.0.0.1:{closed_port}", "--runs", "1", "--out", str(out))
    assert res.exit_code == 1
    assert not (tmp_path / "new").exists()


def test_connect_failures_say_which(fake, closed_port):
    """Every connect failure used to read "connection refused or no route"."""
    res = run("--base-url", fake.url.replace("http://", "https://"), "--runs", "1")
    assert res.exit_code == 1 and "TLS handshake failed" in one_line_error(res) and "use http://" in res.stderr
    res = run("--base-url", "http://nonexistent-host.invalid:8000", "--runs", "1")
    assert res.exit_code == 1 and "(its host name does not resolve)" in one_line_error(res)
    res = run("--base-url", f"http://127.0.0.1:{closed_port}", "--runs", "1")
    assert res.exit_code == 1 and "Connection refused" in one_line_error(res)


@pytest.mark.parametrize("flag", ["--model", "--profile", "--seat", "--base-url"])
def test_an_empty_option_is_refused_not_read_as_absent(flag, closed_port):
    args = ["--base-url", f"http://127.0.0.1:{closed_port}"] if flag not in ("--base-url", "--seat") else []
    res = run(*args, flag, "", "--runs", "1")
    assert res.exit_code == 2 and f"{flag} is empty" in one_line_error(res)


def test_a_failed_warm_up_says_it_was_the_warm_up(fake):
    fake.chat = "http_500"
    res = run("--base-url", fake.url, "--streams", "2", "--suite", "en", "--runs", "1")
    assert res.exit_code == 1
    err = one_line_error(res)
    assert "warm-up request (before any measurement): stream 1/2" in err and "HTTP 500" in err


def test_a_model_list_entry_without_a_name_is_skipped_beside_real_ones(fake):
    """A proxy may add entries of its own; only a list with no model at all is refused."""
    fake.models = [5, "fake-model"]
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--json")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["endpoint"]["model"] == "fake-model"


def test_json_with_out_lists_the_files_and_their_notes(fake, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # no chart: its note must reach stdout too
    out = tmp_path / "o"
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--json", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["written"] == [str(out / "bench.json"), str(out / "bench.md")]
    assert any("matplotlib is not installed" in n for n in doc["notes"])
    # an earlier run's chart beside this run's files would read as this run's (bench audit)
    (out / "bench.png").write_bytes(b"an earlier run's chart")
    doc = json.loads(run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--json",
                         "--out", str(out)).stdout)
    assert not (out / "bench.png").exists()
    assert "removed bench.png of an earlier run: this run has no chart" in doc["notes"]
    # one that cannot be removed is a note beside the written files, not the write's error (review)
    (out / "bench.png").write_bytes(b"an earlier run's chart")
    from dsv4serve import bench_report

    real = Path.unlink

    def refuse(self, *a, **k):
        if self.name == "bench.png":
            raise PermissionError(1, "Operation not permitted", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(bench_report.Path, "unlink", refuse)
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--json", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["written"] == [str(out / "bench.json"), str(out / "bench.md")] and "error" not in doc
    assert any(n.startswith(f"bench.png of an earlier run is still in {out}") for n in doc["notes"])


def test_api_key_option_reaches_an_endpoint_that_demands_one(fake, monkeypatch):
    """With --base-url the only key bench could send was this shell's VLLM_API_KEY (one meant for
    another server, or none): --api-key names the endpoint's own, before or after the subcommand."""
    fake.api_key = "k-remote"
    monkeypatch.setenv("VLLM_API_KEY", "k-shell")
    base = ("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--max-tokens", "8",
            "--no-warmup", "--json")
    res = run(*base)
    assert res.exit_code != 0 and "401" in res.stderr, res.stderr
    res = run(*base, "--api-key", "k-remote")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["cells"][0]["runs"][0]["completion_tokens"] == 12
    res = run("--api-key", "k-remote", "ppl", "--base-url", fake.url, "--ctx", "16", "--chunks", "1", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["tokens_scored"] > 0, res.stderr
    res = run(*base, "--api-key", "")
    assert res.exit_code != 0 and one_line_error(res, json_out=True).startswith("error: --api-key is empty")


def test_a_401_says_whether_a_key_was_sent(fake, monkeypatch):
    """The 401 hint still said "bench does not send an API key" after --api-key came (helper audit
    of session 38's leftovers): no key sent asks for one, a refused key says so."""
    fake.api_key = "k-remote"
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    base = ("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--no-warmup")
    err = one_line_error(run(*base))
    assert "HTTP 401" in err and "pass it with --api-key KEY" in err and "does not send" not in err
    err = one_line_error(run(*base, "--api-key", "k-wrong"))
    assert "HTTP 401" in err and "the server refused the API key bench sent" in err


@pytest.mark.parametrize("sub", [[], ["needle", "--tokens", "300"], ["ppl"]])
def test_a_dead_proxy_is_named_not_the_seat(fake, monkeypatch, sub):
    """A --base-url reached through the shell's proxy (on purpose, or by a forgotten http_proxy) that
    is down read "cannot reach <seat> ... is the seat up?" with the seat up: the proxy is named."""
    from .conftest import dead_proxy

    dead_proxy(monkeypatch)
    res = run(*sub, "--base-url", fake.url)
    assert res.exit_code == 1
    err = one_line_error(res)
    assert f"cannot reach {fake.url} through the shell's proxy http://127.0.0.1:9" in err, err
    assert "NO_PROXY" in err and "is the seat up" not in err


def test_a_proxys_502_names_the_proxy(fake, monkeypatch):
    """A proxy that cannot reach the seat answers 502 itself: "the server failed the request" sent
    the user to a seat log with nothing in it."""
    from .conftest import JsonHandler, local_server

    class Proxy(JsonHandler):
        def do_GET(self):
            self.send_json(502, {"error": "upstream unreachable"})

    with local_server(Proxy) as proxy:
        for var in ("http_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(var, proxy)
        for var in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
            monkeypatch.delenv(var, raising=False)
        err = one_line_error(run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1"))
    assert "HTTP 502" in err and f"the request went through the shell's proxy {proxy}" in err, err


def test_zero_tokens_generated_is_no_figure(fake):
    """A stream that ended at once (usage 0 tokens) gave '0.0 tok/s' and exit 0, a figure read off
    nothing (helper audit)."""
    fake.content_chunks = 0
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "code", "--runs", "1", "--no-warmup")
    assert res.exit_code == 1
    assert "run 1: stream 1/1: the server generated 0 tokens (finish_reason " in one_line_error(res)


def test_thinking_or_another_budget_gives_no_acceptance_ratio_against_the_references(fake):
    """With --thinking the drafts run over reasoning text; the references were measured with
    thinking off: the tok/s ratio stood aside, the acceptance ratio did not (helper audit). Nor did
    it at another --max-tokens, where the acceptance averages over another stretch of the answer than
    the references' 256 tokens (bench audit): the same rule as tok/s now."""
    base = ("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--no-warmup", "--json",
            "--profile", "8x16gb-380k")
    doc = json.loads(run(*base).stdout)  # the references' budget (256) and thinking off
    assert doc["cells"][0]["ratio"]["acceptance_length"] is not None
    doc = json.loads(run(*base, "--max-tokens", "12").stdout)
    assert doc["cells"][0]["ratio"]["acceptance_length"] is None
    assert "no acceptance ratio against the reference: --max-tokens 12 (the references used 256)" in doc["notes"]
    res = run(*base, "--thinking")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["cells"][0]["ratio"]["acceptance_length"] is None
    assert any(n.startswith("no acceptance ratio against the reference: --thinking") for n in doc["notes"])


def test_a_longer_wrong_code_is_not_the_needle(fake):
    """found was a substring test: 'saffron-anchor-51797' passed for 'saffron-anchor-5179' (helper audit)."""
    args = ("needle", "--base-url", fake.url, "--tokens", "2000", "--seed", "1", "--json")
    assert json.loads(run(*args).stdout)["found"] is True
    fake.answer_suffix = "7"
    res = run(*args)
    doc = json.loads(res.stdout)
    assert doc["found"] is False
    assert res.exit_code == 1  # a missed retrieval is a failed check (README's exit codes), the result printed


def test_a_needle_whose_answer_budget_went_to_reasoning_says_so(fake):
    """With --thinking the 32 answer tokens went to reasoning: found: no, exit 0, no word of why, so a
    budget problem read as a long-context retrieval failure (bench audit; trap 6)."""
    fake.chat = "reasoning_only"
    res = run("needle", "--base-url", fake.url, "--tokens", "900", "--thinking", "--json")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert doc["found"] is False and doc["finish_reason"] == "length"
    assert ("the answer budget (--max-tokens 32) ran out before any answer (the reasoning used it): raise "
            "--max-tokens, or leave --thinking off") in doc["notes"]


@pytest.mark.parametrize("env, words", [
    ({"ALL_PROXY": "socks5://127.0.0.1:9"}, "the shell's proxy settings cannot be used"),
    ({"HTTP_PROXY": "ftp://x:1"}, "the shell's proxy settings cannot be used"),
    ({"VLLM_API_KEY": "sk-abc\u00a0"}, "VLLM_API_KEY has a character an HTTP header cannot carry ('\\xa0' at position 6)"),
])
def test_the_shells_settings_are_one_line_errors_not_tracebacks(fake, monkeypatch, env, words):
    """A SOCKS ALL_PROXY without socksio, a proxy URL httpx cannot use, and a pasted key with a
    non-breaking space each ended bench in a traceback with an empty --json stdout (helper audit)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--json")
    assert res.exit_code == 2, res.stderr
    assert words in one_line_error(res, json_out=True)


def test_a_key_an_http_header_cannot_carry_is_refused_by_name(fake):
    res = run("--base-url", fake.url, "--api-key", "sk-\u2018x\u2019", "ppl", "--json")
    assert res.exit_code == 2 and "--api-key has a character an HTTP header cannot carry" in one_line_error(res, True)


def test_a_seat_is_benched_against_the_profile_up_launched(fake, isolated_home, tmp_path):
    """bench loaded the running seat's profile by its name alone: a seat started from a YAML file
    lost its reference figures ("unknown profile"), and one started with --set max_num_seqs got the
    queueing note of the file's value (helper audit)."""
    from dsv4serve import state
    from dsv4serve.profile import load_profile

    f = tmp_path / "my-seat.yaml"
    f.write_text("name: my-seat\nextends: 8x16gb-380k\n")
    sets = ["vllm.max_num_seqs=2"]
    prof = load_profile(str(f), sets)
    port = int(fake.url.rsplit(":", 1)[1])
    st = state.SeatState(seat="my-seat", run_id="r1", profile="my-seat", profile_ref=prof.ref(), overrides=sets,
                         profile_digest=prof.digest(), runtime="native", pid=os.getpid(),
                         start_time=psutil.Process().create_time(), argv=["vllm"], env={}, host="127.0.0.1",
                         port=port, served_name="fake-model", tp=8, run_dir=str(isolated_home),
                         log_path=str(isolated_home / "log"), phase="ready")
    state.save(st)
    args = ("--streams", "4", "--suite", "en", "--runs", "1", "--no-warmup", "--json")
    res = run(*args)
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["reference"]["profile"] == "my-seat" and doc["cells"][0]["reference"]["tok_s"] == 146.4
    assert any(n.startswith("4 streams exceed the seat's max-num-seqs 2") for n in doc["notes"]), doc["notes"]
    assert not any("could not be loaded" in n or "changed since" in n for n in doc["notes"]), doc["notes"]
    # the file edited after up: read as it is now, and said so
    f.write_text("name: my-seat\nextends: 8x16gb-380k\nreference: {source: edited}\n")
    doc = json.loads(run(*args).stdout)
    assert any(n.startswith(f"profile {f} changed since the seat was started") for n in doc["notes"]), doc["notes"]


def test_markup_in_a_model_name_or_a_note_is_printed_as_text(fake, tmp_path):
    """A served name or a path holding "[/...]" raised rich's MarkupError after the whole run, and
    "[wiki]" vanished from a title (helper audit)."""
    fake.models = ["lab/[/exl3]"]
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--no-warmup")
    assert res.exit_code == 0, res.output
    assert "en: lab/[/exl3] vs reference" in res.stdout
    text = tmp_path / "[wiki]" / "[" / "x]" / "t.txt"  # .../[wiki]/[/x]/t.txt
    text.parent.mkdir(parents=True)
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    res = run("--base-url", fake.url, "ppl", "--text", str(text), "--ctx", "64", "--chunks", "1")
    assert res.exit_code == 0, res.output
    assert f"ppl:{text}" in "".join(res.stdout.split())  # the title, as wrapped to the terminal


@pytest.mark.parametrize("finish,why", [("stop", "the model's end of sequence"),
                                        ("length", "the server's cap: it lowered max_tokens")])
def test_a_stream_that_ended_early_is_blamed_on_what_ended_it(fake, finish, why):
    """vLLM lowers max_tokens to what the window leaves after the prompt, without a word: a stream
    ended by "length" short of --max-tokens was blamed on the model's end of sequence (helper audit)."""
    fake.finish = finish
    res = run("--base-url", fake.url, "--streams", "1", "--suite", "en", "--runs", "1", "--no-warmup",
              "--max-tokens", "100", "--json")
    assert res.exit_code == 0, res.stderr
    notes = [n for n in json.loads(res.stdout)["notes"] if "ended before --max-tokens 100" in n]
    assert len(notes) == 1 and notes[0].startswith(f"1 stream(s) ended before --max-tokens 100 (as few as 12 "
                                                    f"tokens, {why}"), json.loads(res.stdout)["notes"]


def test_a_haystack_in_a_spaceless_script_is_long_enough(fake, tmp_path):
    """A Japanese haystack (the reference's) has few space-separated words: it was refused as
    "too short" (helper audit)."""
    ja = tmp_path / "ja.txt"
    ja.write_text("春はあけぼの。やうやう白くなりゆく山ぎは、すこしあかりて、紫だちたる雲のほそくたなびきたる。" * 40 + "\n")
    res = run("--base-url", fake.url, "needle", "--tokens", "300", "--haystack", str(ja), "--json")
    assert res.exit_code == 0, res.stderr
    short = tmp_path / "short.txt"
    short.write_text("春はあけぼの。")
    res = run("--base-url", fake.url, "needle", "--tokens", "300", "--haystack", str(short))
    assert res.exit_code == 2 and "is too short to build a haystack from" in one_line_error(res)
