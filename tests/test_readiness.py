"""readiness.check's listener gate, on stubbed probes: which processes answer on the seat's port.

The HTTP probes and psutil's listener scan are replaced by functions returning fixed answers (no
server runs here); what is under test is the decision, in particular that a second listener that is
not ours fails readiness even when one of ours shares the port (SO_REUSEPORT)."""

from __future__ import annotations

import pytest

from dsv4serve import readiness
from dsv4serve.errors import JobFailed


@pytest.fixture()
def probes(monkeypatch):
    monkeypatch.setattr(readiness, "health", lambda base, timeout=5.0: True)
    monkeypatch.setattr(readiness, "served_models", lambda base, timeout=5.0: ["m"])
    monkeypatch.setattr(readiness, "canary_result",
                        lambda base, model, cfg, timeout: {"text": "ok", "tokens": 2, "seconds": 0.1})

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
