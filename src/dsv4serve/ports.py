"""Is a port free, and if not, who holds it?

The bind test does not set SO_REUSEPORT: with it, a second server could bind the same port and
silently share traffic (vLLM did this before its PR #47529).
"""

from __future__ import annotations

import errno
import socket
from typing import Literal, NamedTuple

import psutil

OWNER_CHARS = 120


class BindProblem(NamedTuple):
    """Why a (host, port) cannot be bound: the port is taken, the host is not this machine's, or
    something else the OS said (detail)."""

    kind: Literal["in-use", "host", "other"]
    detail: str


def owner(port: int) -> str | None:
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        return None
    for c in conns:
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            try:
                p = psutil.Process(c.pid)
                return f"pid {c.pid} ({_one_line(p.cmdline())})"
            except psutil.Error:
                return f"pid {c.pid}"
    return None


def _one_line(argv: list[str]) -> str:
    """A command line fit for a one-line message: whitespace (newlines of a `python -c` script
    included) collapsed, cut at a word boundary."""
    cmd = " ".join(" ".join(argv).split())
    if len(cmd) <= OWNER_CHARS:
        return cmd
    cut = cmd[:OWNER_CHARS].rsplit(" ", 1)[0]
    if len(cut) < OWNER_CHARS * 2 // 3:  # a long word (a -c script) would take most of the line with it
        cut = cmd[:OWNER_CHARS]
    return cut + " …"


def bind_problem(host: str, port: int) -> BindProblem | None:
    """None when a server could bind (host, port) now. Binds as uvicorn does, with SO_REUSEADDR:
    TIME_WAIT leftovers of a server just stopped do not count (they would not stop vLLM), a live
    listener does."""
    bare = host.strip("[]") or "0.0.0.0"
    fam = socket.AF_INET6 if ":" in bare else socket.AF_INET  # a name binds its IPv4 address, as before
    try:
        infos = socket.getaddrinfo(bare, port, family=fam, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return BindProblem("host", f"does not resolve ({e.strerror})")
    fam, _, _, _, addr = infos[0]
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(addr)
        return None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return BindProblem("in-use", e.strerror or "Address already in use")
        if e.errno == errno.EADDRNOTAVAIL:
            return BindProblem("host", "is not an address of this machine")
        return BindProblem("other", e.strerror or str(e))
    finally:
        s.close()


class Refusal(NamedTuple):
    """Why a seat cannot listen on (host, port), as one line, and the fix, for both `up` (which
    refuses) and `check-seat` (which reports a row): one wording, one probe of the host as given."""

    problem: str
    fix: str


def refusal(host: str, port: int) -> Refusal | None:
    problem = bind_problem(host, port)
    if problem is None:
        return None
    if problem.kind == "host":
        return Refusal(f"vllm.host {host} {problem.detail}",
                       "listen on an address of this machine: --set vllm.host=127.0.0.1")
    if problem.kind == "other":
        return Refusal(f"cannot listen on {host}:{port} ({problem.detail})",
                       f"pick another port: --set vllm.port={free_port()}")
    who = owner(port)
    return Refusal(f"port {host}:{port} is already in use" + (f" by {who}" if who else " (owner not visible)"),
                   f"stop that process, or pick another port: --set vllm.port={free_port()}")


def in_use(host: str, port: int) -> bool:
    """Whether something holds (host, port). A host that cannot be bound at all counts too: the
    seat could not listen there either."""
    return bind_problem(host, port) is not None


def free_port(host: str = "127.0.0.1") -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, 0))
    port = s.getsockname()[1]
    s.close()
    return port
