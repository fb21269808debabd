"""readiness.check's listener gate, on stubbed probes: which processes answer on the seat's port.

The HTTP probes and psutil's listener scan are replaced by functions returning fixed answers (no
server runs here); what is under test is the decision, in particular that a second listener that is
not ours fails readiness even when one of ours shares the port (SO_REUSEPORT)."""

from __future__ import annotations

import re

import pytest

from dsv4serve import readiness
from dsv4serve.errors import JobFailed

from .conftest import JsonHandler, dead_proxy, local_server


@pytest.fixture()
def probes(monkeypatch):
    monkeypatch.setattr(readiness, "health", lambda base, timeout=5.0: True)
    monkeypatch.setattr(readiness, "served_models", lambda base, timeout=5.0, api_key=None: ["m"])
    monkeypatch.setattr(readiness, "canary_result",
                        lambda base, model, cfg, timeout, api_key=None: {"text": "ok", "tokens": 2, "seconds": 0.1,
                                                                          "expect": None})

    def set_owners(owners):
        monkeypatch.setattr(readiness, "listeners", lambda port: set(owners))
    return set_owners


def test_our_listener_alone_passes(probes):
    probes({100})
    assert readiness.check("http://127.0.0.1:1", "m", None, 5.0, port=1, our_pids={100, 101})["listener"] == [100]


@pytest.mark.parametrize("owners", [{200}, {100, 200}])
def test_a_foreign_listener_fails_even_beside_ours(probes, owners):
    probes(owners)
    with pytest.raises(JobFailed, match=r"also served by pid \[200\]"):
        readiness.check("http://127.0.0.1:1", "m", None, 5.0, port=1, our_pids={100, 101})


def test_a_port_taken_during_bring_up_fails_the_wait_at_once_naming_the_holder(tmp_path, monkeypatch):
    """The /health wait used to run out its whole ready_s (minutes) when another process held the
    seat's port, then blame /health. A socket of this test process listens on the port (the real
    psutil scan sees it); the seat's own processes are none yet (stubbed), and /health never answers."""
    import os
    import socket

    from dsv4serve import launch, procs, supervisor
    from dsv4serve.profile import load_profile

    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        profile = load_profile("cpu-demo", [f"vllm.port={port}", "gates.timeouts.ready_s=600"])
        spec = launch.build(profile, run_id="cpu-demo-probe-test", run_dir=tmp_path / "run")
        sup = supervisor.Supervisor(profile, spec, json_events=True, foreground=False)
        sup.st = sup._initial_state()
        monkeypatch.setattr(readiness, "health", lambda base, timeout=5.0: False)
        monkeypatch.setattr(procs, "run_processes", lambda st: [])
        sup._start_probe()
        sup._probe.join(30)
        assert not sup._probe.is_alive()
    err = sup._probe_error
    assert err is not None and err.message.startswith(f"port {port} is held by pid {os.getpid()} ("), err
    assert "not by this seat" in err.message and "--set vllm.port=N" in err.hint


def test_the_probes_ignore_the_shells_proxy(monkeypatch):
    """An http_proxy without NO_PROXY for 127.0.0.1 carried the probes away: a healthy seat failed
    readiness and was stopped, and status called it unhealthy (helper audit)."""
    class Seat(JsonHandler):
        def do_GET(self):
            self.send_json(200, {} if self.path == "/health" else {"data": [{"id": "demo"}]})

    with local_server(Seat) as base:
        dead_proxy(monkeypatch)
        assert readiness.health(base) and readiness.served_models(base) == ["demo"]


def test_a_seat_with_an_api_key_is_probed_with_it(monkeypatch):
    """vLLM demands the key on every /v1 path when started with --api-key or VLLM_API_KEY: readiness
    read 401 and stopped a healthy seat (helper audit). The key is found as vLLM finds it."""
    from types import SimpleNamespace

    from dsv4serve import launch

    class Seat(JsonHandler):
        def _authorised(self):
            if self.path.startswith("/v1") and self.headers.get("Authorization") != "Bearer s3cret":
                self.send_json(401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self):
            if self._authorised():
                self.send_json(200, {} if self.path == "/health" else {"data": [{"id": "demo"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self._authorised():
                self.send_json(200, {"choices": [{"message": {"content": "ok"}, "finish_reason": "length"}],
                                     "usage": {"completion_tokens": 1}})

    with local_server(Seat) as base:
        canary = SimpleNamespace(prompt="hi", max_tokens=2, thinking_off=False)
        with pytest.raises(JobFailed, match="401"):
            readiness.check(base, "demo", canary, timeout=10)
        assert readiness.check(base, "demo", canary, timeout=10, api_key="s3cret")["canary_tokens"] == 1
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert launch.api_key(["--port", "1", "--api-key", "a", "b"], {"VLLM_API_KEY": "env"}) == "a"  # CLI first
    # as vLLM's parser reads it (review): the last one wins, --api_key and a completed prefix count
    assert launch.api_key(["--api-key", "a", "--api-key", "b"], {}) == "b"
    assert launch.api_key(["--api_key", "s"], {}) == "s" and launch.api_key(["--api-k", "s"], {}) == "s"
    assert launch.api_key(["--api-key=k"], {}) == "k" and launch.api_key([], {"VLLM_API_KEY": "env"}) == "env"
    monkeypatch.setenv("VLLM_API_KEY", "shell")
    assert launch.seat_api_key("native", [], {}) == "shell"  # a native server inherits the shell
    assert launch.seat_api_key("docker", [], {}) is None  # a container sees its -e entries only
    assert launch.seat_api_key("docker", ["docker", "run", "-e", "VLLM_API_KEY=c0nt", "img", "--port", "1"], {}) == "c0nt"


@pytest.mark.parametrize("answer, words", [
    ({"choices": [{"message": {"content": "", "role": "assistant"}, "finish_reason": "abort"}],
      "usage": {"completion_tokens": 1}}, "ended with finish_reason 'abort' after 1 token(s)"),
    ({"choices": [{"message": {"content": "x"}, "finish_reason": "error"}], "usage": {"completion_tokens": 8}},
     "ended with finish_reason 'error'"),
    ({"model": "other", "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
      "usage": {"completion_tokens": 1}}, "answered as model 'other', not demo"),
    ({"choices": [{"message": None, "finish_reason": "stop"}], "usage": {"completion_tokens": 1}},
     "answered without choices"),
    ({"choices": [{"message": {"content": ["a"]}, "finish_reason": "stop"}], "usage": {"completion_tokens": 1}},
     "answered without choices"),
])
def test_a_canary_the_engine_did_not_finish_is_no_readiness(answer, words):
    """The canary passed on completion_tokens >= 1 alone: an aborted or errored generation, and an
    answer from another model, made `up` declare ready; a null message or a list content crashed the
    probe instead of failing it (helper audit)."""
    from types import SimpleNamespace

    class Seat(JsonHandler):
        def do_GET(self):
            self.send_json(200, {} if self.path == "/health" else {"data": [{"id": "demo"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_json(200, answer)

    with local_server(Seat) as base:
        with pytest.raises(JobFailed, match=re.escape(words)):
            readiness.check(base, "demo", SimpleNamespace(prompt="hi", max_tokens=2, thinking_off=False), timeout=10)


def test_a_models_list_of_another_shape_is_a_failure_not_a_crash():
    class Odd(JsonHandler):
        def do_GET(self):
            self.send_json(200, {"data": ["demo"]} if "models" in self.path else {})

    with local_server(Odd) as base:
        assert readiness.served_models(base) == [""]

    class Odder(JsonHandler):
        def do_GET(self):
            self.send_json(200, {"data": {"id": "demo"}})

    with local_server(Odder) as base, pytest.raises(JobFailed, match="did not answer"):
        readiness.served_models(base)


@pytest.mark.parametrize("message, finish, expect, words", [
    ({"content": "Ready."}, "stop", r"(?i)\bready\b", None),
    ({"content": "", "reasoning_content": "the user wants ready"}, "stop", "ready", None),  # a reasoning-only answer
    ({"content": "zxq zxq zxq"}, "length", r"(?i)\bready\b",
     "canary answered 'zxq zxq zxq' (8 token(s), finish_reason 'length'), which does not match gates.canary.expect"),
    ({"content": "already"}, "stop", r"(?i)\bready\b", "canary answered 'already'"),
    ({"content": ""}, "length", "ready", "canary answered '' (8 token(s), finish_reason 'length')"),
    # the budget cut the reasoning before any answer: said as reasoning, with the budget's hint (review)
    ({"content": None, "reasoning_content": "Okay, the user asks me to"}, "length", "ready",
     "canary reasoned (no answer) 'Okay, the user asks me to' (8 token(s), finish_reason 'length')"),
])
def test_a_canary_answer_must_contain_what_the_profile_expects(message, finish, expect, words):
    """gates.canary.expect: a seat emitting garbage returned tokens and passed. The answer (content,
    else the reasoning) must contain the regex; a miss names the answer, and an answer the budget cut
    before any text says to raise max_tokens or turn thinking off instead of blaming the kernel."""
    from dsv4serve.profile import Canary

    class Seat(JsonHandler):
        def do_GET(self):
            self.send_json(200, {} if self.path == "/health" else {"data": [{"id": "demo"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_json(200, {"choices": [{"message": message, "finish_reason": finish}],
                                 "usage": {"completion_tokens": 8}})

    cfg = Canary(prompt="Reply with one word: ready", expect=expect)
    with local_server(Seat) as base:
        if words is None:
            res = readiness.check(base, "demo", cfg, timeout=10)
            assert res["canary_expect"] == expect and res["canary_tokens"] == 8
            return
        with pytest.raises(JobFailed, match=re.escape(words)) as e:
            readiness.check(base, "demo", cfg, timeout=10)
    if message.get("content"):
        assert e.value.hint == readiness.EXPECT_HINT
    else:
        assert "raise gates.canary.max_tokens" in e.value.hint and "thinking_off=true" in e.value.hint
