"""ports: what `up` and check-seat call a busy port, on real sockets of this machine."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from dsv4serve import ports
from dsv4serve.checks import Report
from dsv4serve.profile import load_profile


def _time_wait_port() -> int:
    """A port whose only trace is a TIME_WAIT connection, as right after `down`: the side that
    closes first (here the server) keeps it."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port), timeout=5)
    conn, _ = srv.accept()
    conn.close()
    srv.close()
    time.sleep(0.1)
    cli.close()
    return port


def test_a_time_wait_leftover_is_free_to_up_and_to_check_seat():
    from dsv4serve import checks

    port = _time_wait_port()
    plain = socket.socket()
    try:
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))  # the leftover is there: a bind without SO_REUSEADDR fails
    finally:
        plain.close()
    assert ports.bind_problem("127.0.0.1", port) is None
    rep = Report("cpu-demo")
    checks._port(rep, checks.Ctx(profile=load_profile("cpu-demo", [f"vllm.port={port}"]), seat=None))
    assert [(r.status, r.found) for r in rep.rows] == [("ok", f"127.0.0.1:{port} free")]


def test_a_listener_is_in_use_and_named_on_one_line():
    code = "import socket, time\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\n" \
           "print(s.getsockname()[1], flush=True)\ntime.sleep(60)\n"
    proc = subprocess.Popen([sys.executable, "-c", code + "# " + "x" * 200], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        problem = ports.bind_problem("127.0.0.1", port)
        assert problem is not None and problem.kind == "in-use"
        who = ports.owner(port)
        if who is not None:  # psutil may not see other processes' sockets in a sandbox
            assert who.startswith(f"pid {proc.pid} (") and "\n" not in who and who.endswith(" …)")
            assert len(who) < ports.OWNER_CHARS + 20
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.parametrize("host, words", [("nosuchhost.invalid", "does not resolve"),
                                         ("192.0.2.1", "is not an address of this machine")])
def test_a_host_that_is_not_this_machine_is_not_called_a_busy_port(host, words):
    from dsv4serve import checks, seat
    from dsv4serve.errors import BadInput

    port = ports.free_port()
    problem = ports.bind_problem(host, port)
    assert problem is not None and problem.kind == "host" and words in problem.detail
    profile = load_profile("cpu-demo", [f"vllm.host={host}", f"vllm.port={port}"])
    with pytest.raises(BadInput) as e:
        seat._check_port(profile)
    assert e.value.line().startswith(f"vllm.host {host} {words}") and "vllm.host=127.0.0.1" in e.value.line()
    rep = Report("cpu-demo")
    checks._port(rep, checks.Ctx(profile=profile, seat=None))
    (row,) = rep.rows
    assert row.status == "fail" and row.found.startswith(f"vllm.host {host}") and "in use" not in row.found


def test_a_name_is_checked_on_its_ipv4_address_as_the_server_binds_it(monkeypatch):
    """uvicorn binds a host name in IPv4 unless it is an IPv6 literal; resolving 'localhost' to ::1
    first would check another socket than the one vLLM opens."""
    asked = []
    real = socket.getaddrinfo

    def spy(host, port, family=0, type=0, *a, **kw):
        asked.append((host, family))
        return real(host, port, family, type, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", spy)
    port = ports.free_port()
    assert ports.bind_problem("localhost", port) is None
    ports.bind_problem("::1", port)  # free or not (a machine without IPv6): the family asked is the point
    assert asked == [("localhost", socket.AF_INET), ("::1", socket.AF_INET6)]


def test_an_owner_line_keeps_its_detail_when_one_word_is_long():
    line = ports._one_line(["python3", "-c", "import socket\n" + "x = 1; " * 40])
    assert "\n" not in line and line.startswith("python3 -c import socket x = 1;") and line.endswith(" …")
    assert len(line) >= ports.OWNER_CHARS


def test_check_seat_and_up_probe_a_wildcard_host_alike():
    """check-seat once probed 127.0.0.1 for a 0.0.0.0 seat; `up` probes 0.0.0.0, which a listener on
    any address blocks. Both now give the same one-line problem and fix."""
    from dsv4serve import checks, seat
    from dsv4serve.errors import BadInput

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        port = s.getsockname()[1]
        profile = load_profile("cpu-demo", ["vllm.host=0.0.0.0", "vllm.allow_public_host=true", f"vllm.port={port}"])
        with pytest.raises(BadInput) as e:
            seat._check_port(profile)
        rep = Report("cpu-demo")
        checks._port(rep, checks.Ctx(profile=profile, seat=None))
        (row,) = rep.rows
        assert row.status == "fail" and row.found.startswith(f"port 0.0.0.0:{port} is already in use")
        assert e.value.line().startswith(row.found) and "--set vllm.port=" in row.fix
    finally:
        s.close()
