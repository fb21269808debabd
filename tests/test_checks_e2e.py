"""check-seat's live rows against the real demo seat (vLLM on the CPU, TP 2).

`demo_seat` comes from the lead developer's conftest: a running cpu-demo seat with `.profile`,
`.home` (its DSV4SERVE_HOME), `.base_url` and `.model`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dsv4serve import checks

pytestmark = pytest.mark.e2e

DSV4SERVE = Path(sys.executable).parent / "dsv4serve"


def _complete(seat) -> None:
    r = httpx.post(f"{seat.base_url}/v1/chat/completions", timeout=120.0,
                   json={"model": seat.model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
                         "temperature": 0})
    r.raise_for_status()


def test_live_rows_on_the_demo_seat(demo_seat, monkeypatch):
    monkeypatch.setenv("DSV4SERVE_HOME", str(demo_seat.home))
    _complete(demo_seat)  # counters exist once a decode has run
    p = checks.load_for_check(demo_seat.profile, None)  # as check-seat does: the seat's own --set applied
    rep = checks.run_all(p)
    live = {r.check: r for r in rep.section("live")}
    assert live["seat"].status == "ok", live["seat"]
    assert live["profile"].status == "ok" and "--set vllm.port=" in live["profile"].found, live["profile"]
    for m in p.gates.markers:
        row = live[f"marker: {m.text}"]
        assert row.status == "ok" and row.found == "ranks 0,1", row
    assert live["counters"].status == "ok", live["counters"]
    assert "r0 " in live["counters"].found and "r1 " in live["counters"].found
    kv = live["kv-cache"]
    assert kv.status == "ok", kv
    assert int(re.match(r"([\d,]+) tokens", kv.found).group(1).replace(",", "")) >= 512
    assert live["forbidden"].status == "ok"
    assert live["endpoint"].status == "ok"
    assert live["canary"].status == "ok", live["canary"]
    assert rep.row("machine", "port").status == "ok"  # the seat's own port is not a conflict
    assert rep.exit_code() == 0, checks.summary_line(rep)


def test_cli_json_on_the_demo_seat(demo_seat):
    env = {**os.environ, "DSV4SERVE_HOME": str(demo_seat.home)}
    r = subprocess.run([str(DSV4SERVE), "check-seat", "--profile", demo_seat.profile, "--json"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(r.stdout)
    live = [row for row in doc["rows"] if row["section"] == "live"]
    assert {row["check"] for row in live} >= {"seat", "kv-cache", "forbidden", "endpoint", "canary", "counters"}
    assert all(row["status"] == "ok" for row in live), live


def test_the_canary_row_holds_the_answer_to_the_profiles_expectation(demo_seat, monkeypatch):
    """gates.canary.expect on the real seat: the greedy answer of the demo model (gibberish, but the
    same every time) passes an expectation built from it, and fails one it cannot meet, the row naming
    the answer it got."""
    from dsv4serve import readiness

    monkeypatch.setenv("DSV4SERVE_HOME", str(demo_seat.home))
    p = checks.load_for_check(demo_seat.profile, None)
    answer = readiness.canary(demo_seat.base_url, demo_seat.model, p.gates.canary, 120.0)
    exact = "^" + re.escape(answer) + "$"
    for expect, status in ((exact, "ok"), ("NO-SUCH-ANSWER-[0-9]{40}", "fail")):
        rep = checks.run_all(checks.load_for_check(demo_seat.profile, [f"gates.canary.expect={json.dumps(expect)}"]))
        row = rep.row("live", "canary")
        assert row.status == status and row.expected == f"an answer matching /{expect}/", row
        if status == "fail":
            assert row.found.startswith(f"canary answered {answer[:80]!r} (") and "NO-SUCH-ANSWER" in row.found, row
            assert rep.exit_code() == 1
