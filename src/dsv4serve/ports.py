"""Is a port free, and if not, who holds it?

The bind test does not set SO_REUSEPORT: with it, a second server could bind the same port and
silently share traffic (vLLM did this before its PR #47529).
"""

from __future__ import annotations

import socket

import psutil


def owner(port: int) -> str | None:
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        return None
    for c in conns:
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            try:
                p = psutil.Process(c.pid)
                cmd = " ".join(p.cmdline())[:120]
                return f"pid {c.pid} ({cmd})"
            except psutil.Error:
                return f"pid {c.pid}"
    return None


def in_use(host: str, port: int) -> bool:
    fam = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    # SO_REUSEADDR (as uvicorn sets it) only ignores TIME_WAIT leftovers; a live listener still
    # makes bind fail, which is the question asked.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host.strip("[]") or "0.0.0.0", port))
        return False
    except OSError:
        return True
    finally:
        s.close()


def free_port(host: str = "127.0.0.1") -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, 0))
    port = s.getsockname()[1]
    s.close()
    return port
