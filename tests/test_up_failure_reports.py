"""What a failed `up` tells the user: stacks of a stalled seat taken while it still runs, hints that
work when followed, and a docker that cannot answer named as the problem.

The seat is the fake Docker CLI of tests/fakes/docker (the `fake` fixture of test_supervisor_docker):
a stall, a KV cache size and a dead docker daemon are what these cases need, and a real vLLM would
take minutes to give the first two (and needs a GPU to give a KV size on demand).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from dsv4serve import launch, state, supervisor
from dsv4serve.profile import load_profile

from .conftest import cli
from .test_supervisor_docker import fake  # noqa: F401 - the fixture
from .test_up_output_and_signals import no_container_left  # noqa: F401 - the fixture

# Stands in for py-spy, which is not installed here (and attaching needs ptrace rights a test run may
# not have): `dump --pid N` writes whether N still runs, which is what decides whether a real dump
# could show anything.
FAKE_PY_SPY = f"""#!{sys.executable}
import sys
pid = sys.argv[sys.argv.index("--pid") + 1]
try:
    st = open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[0]
except OSError:
    st = "gone"
print(f"pid {{pid}}: " + ("gone" if st in ("Z", "X", "gone") else "running"))
"""

# Stands in for the docker CLI of a host whose daemon is down (no engine runs in CI): every command
# fails the way the real client does then.
DAEMON_DOWN = """#!/bin/sh
echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" >&2
exit 1
"""


# Stands in for a docker whose container prints one line and exits with code 3 (and which then knows
# no such container), the shortest way to a seat that dies before it is ready.
EXITS_AT_ONCE = """#!/bin/sh
if [ "$1" = run ]; then
  echo "(APIServer pid=1) INFO 12-02 19:04:16 [fake.py:1] the container's last words"
  exit 3
fi
echo "Error: No such container" >&2
exit 1
"""


def _on_path(tmp_path: Path, name: str, text: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / name
    exe.write_text(text)
    exe.chmod(0o755)
    return str(bin_dir)


def test_a_stall_dumps_the_stacks_while_the_processes_still_run(fake, tmp_path):  # noqa: F811
    """The hint promises py-spy stacks; they were taken after the stop, of processes already dead."""
    bin_dir = _on_path(tmp_path, "py-spy", FAKE_PY_SPY)
    r = cli("up", "--profile", fake.profile, "--skip-checks", "--no-validate", home=fake.home, timeout=120,
            env_extra={**fake.env, "PATH": f"{bin_dir}{os.pathsep}{fake.env['PATH']}", "FAKE_DOCKER_SCENARIO": "stall"})
    assert r.returncode == 1 and "no progress for" in r.stderr, r.stdout + r.stderr
    diag = Path(r.stderr.split("diagnostics: ")[1].split()[0])
    stacks = json.loads((diag / "summary.json").read_text())["stacks"]
    assert stacks, "the stalled run's processes were dumped"
    for name in stacks:
        assert (diag / name).read_text().endswith(": running\n"), name
    assert "nothing left" in r.stderr


def test_a_fixed_kv_gate_hint_can_be_followed_to_a_ready_seat(fake):  # noqa: F811
    """`gates.kv_cache_min_tokens: 8192` with 4,096 tokens of KV cache: the hint said "retry with
    --set vllm.max_model_len=4096", which leaves a fixed gate where it is, so the retry failed alike."""
    run = lambda *a: cli("up", "--profile", fake.profile, "--skip-checks", "--no-validate", *a,  # noqa: E731
                         home=fake.home, timeout=120, env_extra=fake.env)
    r = run("--set", "gates.kv_cache_min_tokens=8192")
    assert r.returncode == 1 and "KV cache holds 4,096 tokens, below the 8,192" in r.stderr, r.stdout + r.stderr
    hint = r.stderr.split("hint: ", 1)[1].splitlines()[0]
    assert "vllm.max_model_len" not in hint and "VLLM_CPU_KVCACHE_SPACE=2" in hint, hint
    fix = re.search(r"--set (gates\.kv_cache_min_tokens=\d+)", hint)
    assert fix, hint
    r = run("--set", fix.group(1))
    assert r.returncode == 0, r.stdout + r.stderr
    d = cli("down", "--profile", fake.profile, home=fake.home, timeout=120, env_extra=fake.env)
    assert d.returncode == 0, d.stdout + d.stderr


def test_a_kv_gate_that_follows_max_model_len_still_suggests_lowering_it(tmp_path):
    profile = load_profile("cpu-demo", ["vllm.max_model_len=8192"])
    spec = launch.build(profile, run_id="cpu-demo-20261206-000000-0002", run_dir=tmp_path)
    sup = supervisor.Supervisor(profile, spec, json_events=True, foreground=False)
    sup.tracker.feed("(EngineCore pid=50) INFO 12-02 19:04:16 [fake.py:1] CPU KV cache size: 4,096 tokens, "
                     "Maximum concurrency for 512 tokens: 8.00x", 0.0)
    reason, hint = sup._kv_problem(final=True)
    assert "below the 8,192" in reason and "--set vllm.max_model_len=4096" in hint, hint


def test_a_dead_docker_daemon_is_named_as_what_left_the_seat_unclean(fake, tmp_path):  # noqa: F811
    """With the daemon down, a failed `up` said "stopped 0 processes ...; LEFT RUNNING: []": nothing
    was running; docker could not say whether the container is gone."""
    bin_dir = _on_path(tmp_path, "docker", DAEMON_DOWN)
    r = cli("up", "--profile", fake.profile, "--skip-checks", "--no-validate", home=fake.home, timeout=120,
            env_extra={**fake.env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "LEFT RUNNING" not in r.stderr, r.stderr
    assert (f"docker could not say whether container {fake.name} is gone (docker: Cannot connect to the Docker "
            "daemon") in r.stderr and "check that the docker daemon runs" in r.stderr, r.stderr
    assert "then `dsv4serve down --profile fake-docker`" in r.stderr, r.stderr


def test_the_logs_hint_of_a_failed_up_works_beside_another_seat(fake, tmp_path, monkeypatch):  # noqa: F811
    """The hint `dsv4serve logs` was refused as soon as a second seat was known ("2 seats are
    known; name one with --profile"). The container here exits at once (code 3) without a line the
    log watch knows: the path whose hint is "see `dsv4serve logs` for its last lines"."""
    bin_dir = _on_path(tmp_path, "docker", EXITS_AT_ONCE)
    r = cli("up", "--profile", fake.profile, "--skip-checks", "--no-validate", home=fake.home, timeout=120,
            env_extra={**fake.env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert r.returncode == 1 and "vLLM exited with code 3 before the seat was ready" in r.stderr, r.stdout + r.stderr
    monkeypatch.setenv("DSV4SERVE_HOME", str(fake.home))
    state.save_last("other", {"run_id": "other-x", "outcome": "stopped by down", "log": "/nonexistent/log"})
    hint = r.stderr.split("hint: ", 1)[1].splitlines()[0]
    cmd = re.search(r"`dsv4serve (logs[^`]*)`", hint)
    assert cmd and "--profile fake-docker" in cmd.group(1), hint
    logs = cli(*cmd.group(1).split(), home=fake.home, timeout=60)
    assert logs.returncode == 0, logs.stderr
    assert "the container's last words" in logs.stdout


@pytest.mark.parametrize("hint, want", [
    ("a rank process died: its own log lines come first (`dsv4serve logs --rank R`)",
     "(`dsv4serve logs --profile cpu-demo --rank R`)"),
    ("the model produced nothing: read the seat's log (`dsv4serve logs`)", "(`dsv4serve logs --profile cpu-demo`)"),
    ("`dsv4serve logs --profile cpu-demo --rank api`", "`dsv4serve logs --profile cpu-demo --rank api`"),
])
def test_hints_from_the_log_and_the_probe_get_the_seat(tmp_path, hint, want):
    """ranklog's and readiness's hints are written where the seat is not known; the supervisor's
    failure report and check-seat put it in with ranklog.with_seat."""
    from dsv4serve.ranklog import with_seat

    assert want in with_seat(hint, "cpu-demo")
