"""The supervisor's guards against what is not a failure of the seat: a character stdout cannot
encode, a py-spy that hangs, and the words a state write failure is reported in. Unit-level: the
paths that start processes are covered by test_up_output_and_signals.py and test_up_full_disk.py."""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path
from types import SimpleNamespace

from filelock import Timeout

from dsv4serve import diagnostics, supervisor
from dsv4serve.ranklog import SeatTracker


def test_a_character_stdout_cannot_encode_is_replaced_not_taken_for_a_lost_stdout(monkeypatch):
    """Under LANG=C an attached seat's log line with "→" once read as "stdout went away" and
    stopped a healthy seat."""
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="latin-1")
    # the console's own slot (None: follow sys.stdout); setting `file` would pin the console to
    # whatever stdout was when monkeypatch restored it, and later in-process CLI tests print nowhere
    monkeypatch.setattr(supervisor.console, "_file", out)
    d = supervisor.Display("s", SeatTracker(1, [], []), False, 0.0)
    d.say("ready → ok", markup=False)
    out.flush()
    assert d.broken is None
    assert b"ready ? ok" in raw.getvalue()


def test_one_hung_py_spy_costs_only_its_own_dump(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    spy = bin_dir / "py-spy"
    # a stand-in for py-spy (not installed here): pid 1 never answers, the others dump at once
    spy.write_text("#!/bin/sh\n[ \"$3\" = 1 ] && exec sleep 30\necho \"Thread 0 (idle) of pid $3\"\n")
    spy.chmod(spy.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "diag"
    names = diagnostics.py_spy_dumps([1, 2, 3], out, timeout=1.0)
    assert names == ["stacks-1.txt", "stacks-2.txt", "stacks-3.txt"]
    assert "of pid 2" in (out / "stacks-2.txt").read_text() and "of pid 3" in (out / "stacks-3.txt").read_text()
    assert "no dump within 1 s" in (out / "stacks-1.txt").read_text()


def test_a_state_write_failure_names_its_cause(tmp_path, monkeypatch):
    """"Free space" was the fix for every OSError, a held lock and a read-only mount included."""
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path))
    me = SimpleNamespace(seat="cpu-demo")
    full = supervisor.Supervisor._state_write_failed(me, OSError(errno.ENOSPC, "No space left on device"))
    assert "No space left on device" in full.message and "df -h" in full.hint
    ro = supervisor.Supervisor._state_write_failed(me, OSError(errno.EROFS, "Read-only file system"))
    assert "Read-only file system" in ro.message and "df -h" not in ro.hint and "read-only mount" in ro.hint
    held = supervisor.Supervisor._state_write_failed(me, Timeout(str(Path(tmp_path) / "state.lock")))
    assert "stayed held" in held.message and "status" in held.hint and "df -h" not in held.hint
