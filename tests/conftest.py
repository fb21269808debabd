"""Shared fixtures. The e2e tests run real vLLM servers on the CPU (2 cores here), one at a time.

Order (see `pytest_collection_modifyitems`): unit tests; then e2e tests that start and stop their own
short-lived servers (`own_server`), so they never compete with the shared seat for the 2 cores;
then every test on the one shared demo seat (`demo_seat`, started once through the real
`dsv4serve up` CLI); last the `seat_last` tests, which end the shared seat.

`demo_seat` gives `.base_url`, `.model` ("dsv4-demo"), `.max_model_len` (512), `.profile`
("cpu-demo"), `.home` (its DSV4SERVE_HOME, also exported to os.environ so subprocess CLIs see it),
`.port`, `.state` (the loaded SeatState), `.up_seconds`, `.up_stdout`, `.up_stderr`. It comes up on
the patched vLLM: the profile is overridden to need the `vllm-0.32.0` patch set and `up
--apply-patches` applies it (the patches issue's live test; the demo model never loads the patched
DeepSeek-V4 files, so the seat proves they do not break vLLM). Its teardown runs `dsv4serve down`,
asserts nothing of the run is left, reverts the set through the CLI and checks the pristine hashes.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

DSV4SERVE = [sys.executable, "-m", "dsv4serve"]
DEMO_PATCH_SET = "vllm-0.32.0"
FAKES = Path(__file__).parent / "fakes"


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        if item.get_closest_marker("seat_last"):
            return 3
        if "demo_seat" in getattr(item, "fixturenames", ()):
            return 2
        if item.get_closest_marker("own_server"):
            return 1
        return 0

    items.sort(key=rank)  # stable: file order within each group


def pytest_configure(config):
    config.addinivalue_line("markers", "own_server: e2e test that starts (and stops) its own vLLM server")
    config.addinivalue_line("markers", "seat_last: ends the shared demo seat; runs after every other test")


def cli(*args: str, home: Path, timeout: float = 300, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess, with its own DSV4SERVE_HOME."""
    env = {**os.environ, "DSV4SERVE_HOME": str(home), **(env_extra or {})}
    return subprocess.run([*DSV4SERVE, *args], capture_output=True, text=True, timeout=timeout, env=env)


class JsonHandler(BaseHTTPRequestHandler):
    """A quiet handler for local stand-in servers: `send_json(code, doc)`."""

    def send_json(self, code: int, doc: object) -> None:
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a: object) -> None:
        pass


@contextmanager
def local_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` served on 127.0.0.1 in a thread for the block; yields the base URL."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def dead_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shell's proxy variables point at a port nothing listens on, and nothing is exempt."""
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)


def json_lines(text: str) -> list[dict]:
    return [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]


def group_processes(pgid: int) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return out


def tagged_processes(run_id: str) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("DSV4SERVE_RUN_ID") == run_id and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def run_leftovers(run_id: str, dist_ids: list[str]) -> list[str]:
    """This run's vLLM files still in /dev/shm or /tmp."""
    found = []
    for did in dist_ids:
        for d in ("/dev/shm", "/tmp"):
            found += [str(p) for p in Path(d).glob(f"vllm_dist_{did}*")]
    return found


UUID_NAME = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def stray_sockets(since: float) -> list[str]:
    """Socket files named like vLLM's ZMQ endpoints (a uuid4) made directly in a temp dir since
    `since` by this user: what a run that had no socket dir of its own left behind."""
    found = []
    for d in {Path(tempfile.gettempdir()), Path("/tmp")}:
        for p in d.iterdir():
            try:
                s = p.lstat()
            except OSError:
                continue
            if s.st_mtime >= since - 1.0 and s.st_uid == os.getuid() and stat.S_ISSOCK(s.st_mode) \
                    and UUID_NAME.fullmatch(p.name):
                found.append(str(p))
    return sorted(found)


def assert_nothing_left(run_id: str, pgid: int | None, port: int | None = None, dist_ids: list[str] | None = None,
                        timeout: float = 20, since: float | None = None, run_dir: str | Path | None = None) -> None:
    """No process of the run by process group *and* by env tag, the port free, no leftovers; with
    `since` (the run's start, for a real vLLM) no stray socket file of vLLM's, and with `run_dir`
    (a native run's) the socket dir its run.json names made and gone."""
    deadline = time.time() + timeout
    while True:
        left = set(tagged_processes(run_id)) | (set(group_processes(pgid)) if pgid else set())
        if not left or time.time() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"processes of run {run_id} still alive: {sorted(left)}"
    if port is not None:
        from dsv4serve import ports

        assert not ports.in_use("127.0.0.1", port), f"port {port} still bound"
    if dist_ids:
        assert not run_leftovers(run_id, dist_ids), run_leftovers(run_id, dist_ids)
    if since is not None:
        assert not stray_sockets(since), stray_sockets(since)
    if run_dir is not None:
        rpc = json.loads((Path(run_dir) / "run.json").read_text()).get("rpc_dir")
        assert rpc and not Path(rpc).exists(), f"the run's socket dir {rpc!r} was not made, or is still there"


def dist_ids_of(log_path: str) -> list[str]:
    from dsv4serve.ranklog import read_log

    return sorted(read_log(log_path, 8, [], []).dist_ids)


def load_state(home: Path, seat: str):
    from dsv4serve import state

    old = os.environ.get("DSV4SERVE_HOME")
    os.environ["DSV4SERVE_HOME"] = str(home)
    try:
        return state.load(seat)
    finally:
        if old is None:
            os.environ.pop("DSV4SERVE_HOME", None)
        else:
            os.environ["DSV4SERVE_HOME"] = old


@dataclass
class DemoSeat:
    base_url: str
    model: str
    max_model_len: int
    profile: str
    home: Path
    port: int
    up_seconds: float
    up_stdout: str
    up_stderr: str
    run_id: str = ""
    pgid: int | None = None
    log_path: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def state(self):
        return load_state(self.home, self.profile)


def _revert_demo_patches(home: Path) -> None:
    """Back to the pristine vLLM through the CLI; whatever else failed, the tree must not stay patched."""
    from dsv4serve import patches

    rv = cli("patch", "revert", "--set-name", DEMO_PATCH_SET, home=home, timeout=120)
    old = os.environ.get("DSV4SERVE_HOME")
    os.environ["DSV4SERVE_HOME"] = str(home)
    try:
        rows = [r for r in patches.set_status(patches.load_set(DEMO_PATCH_SET)) if r.state != "not-applicable"]
    finally:
        if old is None:
            os.environ.pop("DSV4SERVE_HOME", None)
        else:
            os.environ["DSV4SERVE_HOME"] = old
    assert rv.returncode == 0 and all(r.found_sha256 == r.pristine_sha256 for r in rows), \
        f"{DEMO_PATCH_SET} not reverted: {rv.stdout}{rv.stderr} {[(r.file, r.state) for r in rows]}"


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dsv4home")


@pytest.fixture(scope="session")
def demo_seat(demo_home: Path):
    from dsv4serve import ports

    old_home = os.environ.get("DSV4SERVE_HOME")
    os.environ["DSV4SERVE_HOME"] = str(demo_home)  # subprocess CLIs of other tests see the seat
    port = ports.free_port()
    t0 = time.time()
    r = cli("up", "--profile", "cpu-demo", "--set", f"vllm.port={port}", "--set", f"patches=[{DEMO_PATCH_SET}]",
            "--apply-patches", home=demo_home, timeout=400)
    up_s = time.time() - t0
    st = load_state(demo_home, "cpu-demo")
    if r.returncode != 0:
        cli("down", home=demo_home, timeout=120)
        try:
            pytest.fail(f"the demo seat did not come up (exit {r.returncode}):\n{r.stdout[-4000:]}\n"
                        f"{r.stderr[-4000:]}")
        finally:  # --apply-patches patched this venv's vLLM: left so, every later run of the suite refuses
            _revert_demo_patches(demo_home)
    seat = DemoSeat(base_url=f"http://127.0.0.1:{port}", model="dsv4-demo", max_model_len=512, profile="cpu-demo",
                    home=demo_home, port=port, up_seconds=up_s, up_stdout=r.stdout, up_stderr=r.stderr,
                    run_id=st.run_id, pgid=st.pgid, log_path=st.log_path)
    try:
        yield seat
    finally:
        try:
            if load_state(demo_home, "cpu-demo") is not None:  # a seat_last test may have stopped it already
                d = cli("down", "--json", home=demo_home, timeout=120)
                assert d.returncode == 0 and json.loads(d.stdout)["clean"], d.stdout + d.stderr
            assert_nothing_left(seat.run_id, seat.pgid, port, dist_ids_of(seat.log_path), since=t0,
                                run_dir=Path(seat.log_path).parent)
        finally:
            _revert_demo_patches(demo_home)
            if old_home is None:
                os.environ.pop("DSV4SERVE_HOME", None)
            else:
                os.environ["DSV4SERVE_HOME"] = old_home
