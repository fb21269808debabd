"""A seat on an IPv6 literal (`vllm.host=::1`): its URL needs brackets, or readiness fails a healthy
seat ("readiness probe crashed: InvalidURL") and `status` crashes while it comes up."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest

from dsv4serve import launch, state, supervisor
from dsv4serve.profile import load_profile

from .conftest import cli
from .test_state import make


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class _OpenAI(BaseHTTPRequestHandler):
    """Stands in for vLLM's OpenAI server (/health, /v1/models, one chat completion): what is under
    test is the URL dsv4serve builds for an IPv6 host, and a real vLLM takes minutes to start here."""

    def log_message(self, *a):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self._send({})
        elif self.path == "/v1/models":
            self._send({"data": [{"id": "dsv4-demo"}]})
        else:
            self.send_error(404)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._send({"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
                    "usage": {"completion_tokens": 1}})


@pytest.fixture()
def v6_server():
    srv = _V6Server(("::1", 0), _OpenAI)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("host, url", [("::1", "http://[::1]:18433"), ("[::1]", "http://[::1]:18433"),
                                       ("fe80::1", "http://[fe80::1]:18433"), ("::", "http://127.0.0.1:18433"),
                                       ("0.0.0.0", "http://127.0.0.1:18433"), ("127.0.0.1", "http://127.0.0.1:18433")])
def test_the_seat_url_brackets_an_ipv6_host(host, url):
    assert state.SeatState(**{**make().model_dump(), "host": host, "port": 18433}).base_url == url


def test_readiness_passes_a_healthy_seat_on_ipv6_loopback(v6_server, tmp_path):
    """The supervisor's own probe thread, against a server on [::1]."""
    profile = load_profile("cpu-demo", ["vllm.host=::1", f"vllm.port={v6_server}"])
    spec = launch.build(profile, run_id="cpu-demo-20261206-000000-0001", run_dir=tmp_path)
    sup = supervisor.Supervisor(profile, spec, json_events=True, foreground=False)
    assert sup.spec_base_url() == f"http://[::1]:{v6_server}"
    sup._start_probe()
    sup._probe.join(timeout=60)
    assert sup._probe_error is None, sup._probe_error.message
    assert sup._probe_result["health"] == 200 and sup._probe_result["canary_tokens"] == 1


def test_status_of_a_seat_starting_on_ipv6_is_a_row_not_a_traceback(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("DSV4SERVE_HOME", str(home))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        state.save(make(host="::1", port=18433, phase="starting", tp=1, pid=child.pid, pgid=child.pid,
                        start_time=psutil.Process(child.pid).create_time(), run_dir=str(tmp_path),
                        log_path=str(tmp_path / "vllm.log")))
        r = cli("status", "--json", home=home, timeout=60)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        row = json.loads(r.stdout)[0]
        assert row["phase"] == "starting" and row["endpoint"] == "http://[::1]:18433/v1" and row["health"] is False
    finally:
        child.kill()
        child.wait()


def test_a_url_httpx_cannot_build_is_a_failed_probe_not_a_crash():
    """httpx.InvalidURL is no httpx.HTTPError: `status` and the probe thread used to crash on it."""
    from dsv4serve import readiness
    from dsv4serve.errors import JobFailed

    assert readiness.health("http://::1:18433") is False
    with pytest.raises(JobFailed, match="did not answer"):
        readiness.served_models("http://::1:18433")
