"""Seat state: atomic files, the two locks, pid+start-time identity, and the stale-state paths of
`status` and `down` (no server needed: the "seat" is a state file pointing at processes we own)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dsv4serve import state
from dsv4serve.errors import BadInput

from .conftest import cli


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path))
    return tmp_path


def make(seat: str = "cpu-demo", **kw) -> state.SeatState:
    base = dict(seat=seat, run_id=f"{seat}-test-{os.getpid()}-{time.time_ns()}", profile=seat, profile_digest="x",
                runtime="native", argv=["python"], env={}, host="127.0.0.1", port=1, served_name="m", tp=2,
                run_dir="/nonexistent", log_path="/nonexistent/vllm.log", phase="ready")
    base.update(kw)
    return state.SeatState(**base)


def test_save_load_is_atomic_and_leaves_no_temp_files(home):
    st = make()
    state.save(st)
    assert state.load("cpu-demo") == st
    files = sorted(p.name for p in state.seat_dir("cpu-demo").iterdir())
    assert "state.json" in files and not [f for f in files if f.startswith(".state.json.")]


def test_unreadable_state_is_one_line(home):
    state.seat_dir("cpu-demo").mkdir(parents=True)
    state.state_path("cpu-demo").write_text("{not json")
    with pytest.raises(BadInput, match="is unreadable"):
        state.load("cpu-demo")


@pytest.mark.parametrize("key", ["start_time", "started_at", "ready_at"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_stamp_that_is_not_a_finite_number_makes_the_state_unreadable(home, key, value):
    """A NaN start_time compared as "within a second" of any process, so down stopped an untagged
    stranger as the seat's main process; a NaN started_at made down fail after stopping everything
    (helper audit). Python's json reads both; the state is unreadable (down's tag-only path)."""
    state.save(make(start_time=time.time()))
    obj = json.loads(state.state_path("cpu-demo").read_text())
    obj[key] = float(value.replace("Infinity", "inf"))
    state.state_path("cpu-demo").write_text(json.dumps(obj))  # Python's json writes NaN / Infinity bare
    assert f'"{key}": {value}' in state.state_path("cpu-demo").read_text()
    with pytest.raises(BadInput, match=rf"is unreadable \({key}: "):
        state.load("cpu-demo")


def test_a_state_that_is_a_directory_is_an_unreadable_row_that_down_sets_aside(home):
    state.state_path("cpu-demo").mkdir(parents=True)
    r = cli("status", "--json", home=home, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = {row["seat"]: row for row in json.loads(r.stdout)}
    assert rows["cpu-demo"]["phase"] == "unreadable"
    r = cli("down", "--profile", "cpu-demo", home=home, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not state.state_path("cpu-demo").exists()
    assert [p for p in state.seat_dir("cpu-demo").iterdir() if p.name.startswith("state.json.unreadable-")]


def test_update_refuses_a_stopping_or_foreign_state(home):
    st = make()
    state.save(st)
    assert state.update("cpu-demo", st.run_id, phase_detail="x").phase_detail == "x"
    assert state.update("cpu-demo", "another-run", phase_detail="y") is None
    assert state.mark_stopping("cpu-demo", st.run_id, "down").phase == "stopping"
    assert state.update("cpu-demo", st.run_id, phase="ready") is None  # `down` owns it now
    assert state.load("cpu-demo").phase == "stopping"
    assert not state.remove("cpu-demo", "another-run")  # never a newer run's state
    assert state.remove("cpu-demo", st.run_id) and state.load("cpu-demo") is None


def test_seat_lock_refuses_a_second_holder(home):
    lk = state.acquire("cpu-demo", "up")
    try:
        with pytest.raises(BadInput, match="held by another dsv4serve"):
            state.acquire("cpu-demo", "up")
    finally:
        lk.release()
    state.acquire("cpu-demo", "up").release()


def test_liveness_by_pid_and_start_time(home):
    me = psutil.Process()
    assert state.liveness(make(pid=me.pid, start_time=me.create_time())) == "alive"
    assert state.liveness(make(pid=me.pid, start_time=me.create_time() - 1000)) == "reused"
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert state.liveness(make(pid=p.pid, start_time=time.time())) == "gone"


def test_dead_ranks_and_find_running(home):
    me = psutil.Process()
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    st = make(pid=me.pid, start_time=me.create_time(), rank_pids={0: me.pid, 1: p.pid})
    assert state.dead_ranks(st) == [1]
    state.save(st)
    with pytest.raises(BadInput) as e:
        state.find_running()
    assert e.value.message == "no seat is running"  # a seat with a dead rank is not "running"
    with pytest.raises(BadInput, match="^seat cpu-demo is not running$"):
        state.find_running("cpu-demo")
    state.save(st.model_copy(update={"rank_pids": {0: me.pid}}))
    assert state.find_running().run_id == st.run_id
    # another seat's truncated state file stopped bench and check-seat from finding this one (bench audit)
    state.seat_dir("old-seat").mkdir(parents=True, exist_ok=True)
    state.state_path("old-seat").write_text('{"seat": "old-se')
    assert state.find_running().run_id == st.run_id
    with pytest.raises(state.UnreadableState):
        state.find_running("old-seat")  # named: its own problem is the answer
    state.save(st.model_copy(update={"rank_pids": {0: me.pid, 1: p.pid}}))
    with pytest.raises(BadInput) as e:
        state.find_running()
    assert e.value.message == ("no seat is running (the state of old-seat is unreadable: `dsv4serve status` "
                               "says why)")


def test_stale_state_with_a_reused_pid_status_says_so_and_down_touches_nothing(home):
    """The state points at *this test's* pid and process group with a wrong start time, as if the
    seat's pid had been reused: status must call it stale, and down must clear it without
    signalling anything (a sibling in our process group must survive)."""
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # same pgid as us
    try:
        me = psutil.Process()
        st = make(pid=me.pid, pgid=os.getpgid(0), start_time=me.create_time() - 3600,
                  rank_pids={0: sibling.pid, 1: me.pid})
        state.save(st)
        r = cli("status", "--json", home=home, timeout=60)
        assert r.returncode == 0, r.stderr
        row = json.loads(r.stdout)[0]
        assert row["phase"] == "stale" and row["stale"] and row["process"] == "reused"
        assert f"pid {me.pid} now belongs to another process" in row["problem"]
        r = cli("down", "--json", home=home, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        rep = json.loads(r.stdout)
        seat = rep["seats"][0]
        assert rep["clean"] and seat["signalled"] == [] and seat["killed"] == []
        assert seat["was"] == "reused" and "was not touched" in seat["note"]
        assert sibling.poll() is None and psutil.pid_exists(me.pid)
        assert state.load("cpu-demo") is None
        r = cli("status", "--json", home=home, timeout=60)
        assert json.loads(r.stdout)[0]["phase"] == "not running"
    finally:
        sibling.kill()
        sibling.wait()


def test_down_with_nothing_running_says_so(home):
    r = cli("down", home=home, timeout=60)
    assert r.returncode == 0 and "no seat is running: nothing to stop" in r.stdout
    r = cli("down", "--profile", "cpu-demo", home=home, timeout=60)
    assert r.returncode == 0 and "seat cpu-demo is not running: nothing to stop" in r.stdout


def test_a_mistyped_seat_name_is_an_error_not_a_seat_that_is_not_running(home):
    """`down -p 8x16gb-38k` must not answer "not running, nothing to stop" (exit 0) while the seat
    the user meant keeps running: a name that no seat ever ran under must be a profile."""
    for cmd in (["down", "--profile", "8x16gb-38k"], ["status", "--profile", "8x16gb-38k"],
                ["logs", "--profile", "8x16gb-38k"]):
        r = cli(*cmd, home=home, timeout=60)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert r.stderr.strip() == "error: no seat or profile is named '8x16gb-38k'; did you mean '8x16gb-380k'?", cmd
    r = cli("down", "--profile", "nope", "--json", home=home, timeout=60)
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["message"] == "no seat or profile is named 'nope'"


def test_an_unreadable_state_is_a_status_row_and_down_stops_its_tagged_processes_and_keeps_the_file(home):
    """A state file that does not parse must not lock the user out: `status` shows it as one row
    beside the other seats, and `down` (which the error names as the fix) stops the processes
    tagged with the seat's runs, the only thing left to go by, and sets the file aside, kept."""
    run_id = f"cpu-demo-20261205-000000-{os.getpid() % 9999:04d}"
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    orphan = subprocess.Popen(sleep, env={**os.environ, state.RUN_ID_ENV: run_id,
                                          "DSV4SERVE_RUN_DIR": str(home / "runs" / run_id)})
    # seat cpu-demo-x, not cpu-demo
    stranger = subprocess.Popen(sleep, env={**os.environ, state.RUN_ID_ENV: "cpu-demo-x-20261205-000000-0000",
                                            "DSV4SERVE_RUN_DIR": str(home / "runs" / "cpu-demo-x-20261205-000000-0000")})
    # a cpu-demo run of another state dir (another user's, another test's)
    elsewhere = subprocess.Popen(sleep, env={**os.environ, state.RUN_ID_ENV: "cpu-demo-20261205-000000-ffff",
                                             "DSV4SERVE_RUN_DIR": "/elsewhere/runs/cpu-demo-20261205-000000-ffff"})
    # the run's socket dir, as its run.json names it: down removes it once the run is stopped
    import socket
    import tempfile

    rpc = Path(tempfile.mkdtemp(prefix="dsv4serve-rpc-", dir="/tmp"))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(rpc / "0f4c6f8e-3a53-4c1b-9a43-7d2f6b1e8a11"))
    sock.close()
    (home / "runs" / run_id).mkdir(parents=True)
    (home / "runs" / run_id / "run.json").write_text(json.dumps({"run_id": run_id, "rpc_dir": str(rpc),
                                                                 "started_at": time.time() - 5}))
    # its rendezvous files, named by its log: down of a readable state removes them, and of this one
    # left them (helper audit)
    hexid = f"{os.getpid():08x}{time.time_ns() % 16**8:08x}"
    (home / "runs" / run_id / "vllm.log").write_text(
        f"(Worker pid={orphan.pid}) INFO 12-02 19:15:22 [parallel_state.py:1906] world_size=1 rank=0 local_rank=0 "
        f"distributed_init_method=file:///tmp/vllm_dist_{hexid} backend=gloo\n")
    dist = [Path(f"/dev/shm/vllm_dist_{hexid}-tp:0-0-1-cpushm_0"), Path(f"/tmp/vllm_dist_{hexid}")]
    for f in dist:
        f.write_bytes(b"x")
    try:
        state.save(make(seat="other"))
        state.state_path("cpu-demo").parent.mkdir(parents=True, exist_ok=True)
        state.state_path("cpu-demo").write_text('{"seat": "cpu-demo", "run_id": ')  # truncated
        r = cli("status", "--json", home=home, timeout=60)
        assert r.returncode == 0, r.stderr
        rows = {row["seat"]: row for row in json.loads(r.stdout)}
        assert rows["cpu-demo"]["phase"] == "unreadable" and "down --profile cpu-demo" in rows["cpu-demo"]["problem"]
        assert "other" in rows
        r = cli("down", "--profile", "cpu-demo", "--json", home=home, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        seat = json.loads(r.stdout)["seats"][0]
        assert seat["clean"] and seat["run_id"] == run_id
        assert [p["pid"] for p in seat["signalled"]] == [orphan.pid]
        orphan.wait(timeout=10)
        assert seat["leftovers_removed"] == [str(rpc / "0f4c6f8e-3a53-4c1b-9a43-7d2f6b1e8a11"), str(rpc),
                                             *map(str, dist)], seat["leftovers_removed"]
        assert not rpc.exists() and not any(f.exists() for f in dist)
        assert stranger.poll() is None and elsewhere.poll() is None  # not this seat's, not this state dir's
        kept = [p.name for p in state.seat_dir("cpu-demo").iterdir() if p.name.startswith("state.json.unreadable-")]
        assert len(kept) == 1 and not state.state_path("cpu-demo").exists()
        assert state.load("cpu-demo") is None
    finally:
        for p in (orphan, stranger, elsewhere):
            p.kill()
            p.wait()
        for f in dist:
            f.unlink(missing_ok=True)
        import shutil

        shutil.rmtree(rpc, ignore_errors=True)


def test_down_of_an_unreadable_state_removes_the_socket_dir_of_a_run_already_dead(home):
    """With no tagged process left, the runs were found by nothing, and the socket dir a dead run's
    run.json names stayed behind a 'clean' down (review)."""
    import socket
    import tempfile

    run_id = "cpu-demo-20261207-000000-abcd"
    rpc = Path(tempfile.mkdtemp(prefix="dsv4serve-rpc-", dir="/tmp"))
    try:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(rpc / "0f4c6f8e-3a53-4c1b-9a43-7d2f6b1e8a11"))
        s.close()
        (home / "runs" / run_id).mkdir(parents=True)
        (home / "runs" / run_id / "run.json").write_text(json.dumps({"run_id": run_id, "rpc_dir": str(rpc)}))
        state.state_path("cpu-demo").parent.mkdir(parents=True, exist_ok=True)
        state.state_path("cpu-demo").write_text('{"seat": "cpu-demo", "run_id": ')  # truncated
        r = cli("down", "--profile", "cpu-demo", "--json", home=home, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        seat = json.loads(r.stdout)["seats"][0]
        assert seat["clean"] and seat["leftovers_removed"][-1] == str(rpc) and not rpc.exists(), seat
    finally:
        import shutil

        shutil.rmtree(rpc, ignore_errors=True)


def test_without_a_start_time_only_the_run_tag_proves_the_pid_is_ours(home):
    """If up could not record the start time, a pid reused by another process must not pass as the
    seat (down would signal a stranger's group): the run tag in its environment decides."""
    tagged = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**os.environ, state.RUN_ID_ENV: "cpu-demo-20261205-000000-beef"})
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert state.liveness(make(run_id="cpu-demo-20261205-000000-beef", pid=tagged.pid)) == "alive"
        assert state.liveness(make(run_id="cpu-demo-20261205-000000-beef", pid=stranger.pid)) == "reused"
    finally:
        for p in (tagged, stranger):
            p.kill()
            p.wait()


def test_logs_of_an_unknown_seat_names_the_known_ones(home):
    state.save_last("cpu-demo", {"run_id": "cpu-demo-x", "outcome": "stopped by down", "log": "/nonexistent/log"})
    r = cli("logs", "--profile", "nope", home=home, timeout=60)
    assert r.returncode == 2 and "no seat or profile is named 'nope'" in r.stderr, r.stderr
    assert "known seats: cpu-demo; shipped profiles: 8x16gb-380k" in r.stderr, r.stderr


@pytest.mark.parametrize("arg", ["/etc/passwd", "../x", "a/b"])
def test_a_path_is_never_taken_as_a_seat_name(home, arg):
    """`-p` names a seat or a profile file; a path that is not a loadable profile must not be joined
    onto the state dir (`down -p ../x` renamed and locked files outside it)."""
    for cmd in ("down", "status", "logs"):
        r = cli(cmd, "--profile", arg, home=home, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (cmd, r.stderr)
    assert not (home.parent / "x").exists() and not (home / "seats").exists()


def test_a_state_or_last_run_of_another_shape_is_a_row_not_a_crash_of_every_seat(home):
    """status reads into gates and last.json: a state from another version (or edited by hand)
    must be one unreadable row naming the field, and the other seats still show."""
    state.save(make("good"))
    bad = json.loads(make("odd").model_dump_json())
    bad["gates"] = {"markers": "x", "timeouts": 5}
    state.seat_dir("odd").mkdir(parents=True)
    state.state_path("odd").write_text(json.dumps(bad))
    state.seat_dir("lastlist").mkdir(parents=True)
    state.last_path("lastlist").write_text("[1, 2]")
    state.state_path("lastlist").write_text("{trunc")  # listed by status through its state file
    with pytest.raises(state.UnreadableState) as e:
        state.load("odd")
    assert "(gates: Value error, gates.markers is not a list of {text, ranks})" in e.value.message
    assert state.load_last("lastlist") is None
    r = cli("status", "--json", home=home, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = {row["seat"]: row for row in json.loads(r.stdout)}
    assert rows["odd"]["phase"] == "unreadable" and rows["lastlist"]["phase"] == "unreadable"
    assert rows["good"]["phase"] != "unreadable"
    r = cli("logs", "--profile", "lastlist", home=home, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_logs_of_a_run_whose_files_were_removed_is_one_line_naming_where_logs_remain(home):
    """The run dir of the last run removed: logs printed a rank-count note and "cannot read ...",
    exit 2 (bad input) though nothing typed was wrong, and no fix (helper audit)."""
    gone = home / "runs" / "cpu-demo-20261205-000000-abcd" / "vllm.log"
    state.save_last("cpu-demo", {"run_id": "cpu-demo-20261205-000000-abcd", "log": str(gone)})
    r = cli("logs", "--profile", "cpu-demo", home=home, timeout=60)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: seat cpu-demo's last log {gone} is gone") and f"`ls {home / 'runs'}`" in r.stderr


def test_an_interrupted_down_reads_as_stale_once_the_process_is_gone(home):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    st = make(pid=gone.pid, pgid=gone.pid, start_time=time.time() - 5)
    state.save(st)
    state.mark_stopping("cpu-demo", st.run_id, "dsv4serve down")
    r = cli("status", "--json", home=home, timeout=60)
    row = json.loads(r.stdout)[0]
    assert row["phase"] == "stale" and row["stale"] and "did not finish" in row["problem"], row


def test_check_seat_and_the_dry_run_refuse_what_up_refuses_over_an_unreadable_state(home):
    state.seat_dir("cpu-demo").mkdir(parents=True)
    state.state_path("cpu-demo").write_text("{trunc")
    r = cli("check-seat", "--profile", "cpu-demo", "--json", home=home, timeout=300)
    live = [row for row in json.loads(r.stdout)["rows"] if row["section"] == "live"]
    assert r.returncode == 1 and live[0]["status"] == "fail" and "is unreadable (Invalid JSON" in live[0]["found"]
    r = cli("up", "--profile", "cpu-demo", "--dry-run", "--json", home=home, timeout=300)
    assert r.returncode == 0 and "is unreadable" in json.loads(r.stdout)["up_refuses"][0]


def test_logs_among_several_seats_asks_for_one_even_when_one_state_is_unreadable(home):
    state.save(make("a", phase="stopped"))
    state.seat_dir("b").mkdir(parents=True)
    state.state_path("b").write_text("{trunc")
    r = cli("logs", home=home, timeout=60)
    assert r.returncode == 2 and "2 seats are known (a, b)" in r.stderr and "--profile" in r.stderr, r.stderr


def test_logs_follow_keeps_a_partial_line_whole_and_survives_truncation(home, tmp_path):
    """`logs -f`: a line still being written is printed once, whole; after copytruncate the new
    lines are printed (they used to be lost below the old offset); the run ending stops it."""
    from .conftest import DSV4SERVE

    log = tmp_path / "vllm.log"
    log.write_bytes(b"(APIServer pid=1) INFO first line\n(APIServer pid=1) INFO half of a li")
    st = make(log_path=str(log), run_dir=str(tmp_path))
    state.save(st)

    def wait_for(needle: str) -> None:
        deadline = time.time() + 30
        while needle not in out.read_text():
            assert time.time() < deadline and p.poll() is None, (needle, out.read_text(), err.read_text())
            time.sleep(0.1)

    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as fo, open(err, "w") as fe:
        p = subprocess.Popen([*DSV4SERVE, "logs", "-f", "--profile", "cpu-demo"], stdout=fo, stderr=fe,
                             env={**os.environ, "DSV4SERVE_HOME": str(home), "PYTHONUNBUFFERED": "1"})
    try:
        wait_for("first line\n")
        time.sleep(0.5)
        with open(log, "ab") as f:
            f.write(b"ne\n")
        wait_for("half of a line\n")
        with open(log, "ab") as f:  # a progress bar: redraws end in \r only, shown as they come
            f.write(b"Loading shards: 50%\rLoading shards: 100%\r")
        wait_for("Loading shards: 100%\n")
        with open(log, "r+b") as f:  # copytruncate, then a line shorter than what was read
            f.truncate(0)
            f.write(b"(APIServer pid=1) INFO after\n")
        wait_for("INFO after\n")
        state.remove("cpu-demo", st.run_id)
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
    lines = out.read_text().splitlines()
    assert lines == ["(APIServer pid=1) INFO first line", "(APIServer pid=1) INFO half of a line",
                     "Loading shards: 50%", "Loading shards: 100%", "(APIServer pid=1) INFO after"], lines
    assert "was truncated" in err.read_text() and "has ended" in err.read_text()


def test_logs_follow_ends_when_the_runs_process_is_gone(home, tmp_path):
    """A seat that died after ready keeps its state until `down`: `logs -f` followed it for ever
    (it ended only when the state went), with nothing left to write the log (helper audit)."""
    log = tmp_path / "vllm.log"
    log.write_bytes(b"(APIServer pid=1) INFO started\n(EngineCore pid=2) ERROR EngineCore died\n")
    gone = subprocess.Popen(["true"])
    gone.wait()
    state.save(make(log_path=str(log), run_dir=str(tmp_path), pid=gone.pid, start_time=time.time() - 60))
    r = cli("logs", "-f", "--profile", "cpu-demo", home=home, timeout=60)
    assert r.returncode == 0 and "EngineCore died" in r.stdout
    assert "has ended; its processes are gone, `dsv4serve down` clears its state" in r.stderr, r.stderr


def test_the_log_checkpoint_is_never_in_the_run_dir(home, tmp_path):
    """A docker seat mounts its run dir into the container: a pickle there could be written by
    whatever runs inside and loaded by the host's status."""
    st = make(run_dir=str(tmp_path / "run"))
    ck = state.log_checkpoint(st)
    assert ck.parent == state.seat_dir("cpu-demo") and tmp_path / "run" not in ck.parents


def test_down_stops_a_live_main_pid_even_without_a_process_group(home):
    """A state with no pgid (hand-made, or of another version) whose main pid is provably ours
    (pid and start time): down used to report it clean and leave it running."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        proc = psutil.Process(child.pid)
        state.save(make(pid=child.pid, pgid=None, start_time=proc.create_time()))
        r = cli("down", "--json", "--grace", "5", home=home, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        seat = json.loads(r.stdout)["seats"][0]
        assert child.pid in [p["pid"] for p in seat["signalled"]]
        assert child.wait(timeout=10) is not None and state.load("cpu-demo") is None
    finally:
        child.kill()
        child.wait()


def test_down_never_signals_itself_or_its_parents_whatever_the_state_says(home):
    """This test process is the CLI's parent: a state naming it (pid and start time right) must
    not make `down` signal it."""
    me = psutil.Process()
    state.save(make(pid=me.pid, pgid=None, start_time=me.create_time()))
    r = cli("down", "--json", "--grace", "1", home=home, timeout=60)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    assert me.pid not in [p["pid"] for p in json.loads(r.stdout)["seats"][0]["signalled"]]


@pytest.mark.parametrize("pattern", ["(unclosed", 5])
def test_gates_that_do_not_compile_are_a_status_row_and_down_still_stops_the_seat(home, tmp_path, pattern):
    """A hand-edited state whose forbidden pattern is no regex: status used to fail whole (every
    seat hidden behind one traceback); down must still stop the process and clear the state."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "vllm.log").write_text("INFO starting\n")
        state.save(make("good"))
        proc = psutil.Process(child.pid)
        st = make(pid=child.pid, pgid=None, start_time=proc.create_time(), run_dir=str(tmp_path / "run"),
                  log_path=str(tmp_path / "run" / "vllm.log"))
        state.save(st)
        raw = json.loads(st.model_dump_json())
        raw["gates"] = {"markers": [], "forbidden": [pattern]}
        state.state_path("cpu-demo").write_text(json.dumps(raw))
        r = cli("status", "--json", home=home, timeout=60)
        assert r.returncode == 0, r.stderr
        rows = {row["seat"]: row for row in json.loads(r.stdout)}
        assert rows["good"]["phase"] != "unreadable"
        bad = rows["cpu-demo"]
        assert bad["phase"] == "unreadable" and "gates.forbidden" in bad["problem"] and "down" in bad["problem"]
        r = cli("down", "--profile", "cpu-demo", "--json", "--grace", "5", home=home, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert child.pid in [p["pid"] for p in json.loads(r.stdout)["seats"][0]["signalled"]]
        assert child.wait(timeout=10) is not None and state.load("cpu-demo") is None
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("timeouts, kv", [({"shutdown_grace_s": None}, 512), ({"shutdown_grace_s": "20"}, 512),
                                          ({"stall_s": True}, 512), ({}, "512")])
def test_gates_of_the_wrong_type_are_an_unreadable_state_and_down_still_stops_the_seat(home, timeouts, kv):
    """A state whose gates.timeouts.shutdown_grace_s is null (hand-edited, another version): `down`
    crashed on float(None) and left the seat running. Fields status and down read are checked when
    the state loads, so it is an unreadable row, and down stops the run's tagged processes."""
    run_id = f"cpu-demo-20261206-000000-{os.getpid() % 9999:04d}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                             env={**os.environ, state.RUN_ID_ENV: run_id,
                                  "DSV4SERVE_RUN_DIR": str(home / "runs" / run_id)})
    try:
        st = make(run_id=run_id, pid=child.pid, pgid=child.pid, start_time=psutil.Process(child.pid).create_time())
        raw = json.loads(st.model_dump_json())
        raw["gates"] = {"markers": [], "forbidden": [], "kv_cache_min_tokens": kv,
                        "timeouts": {"stall_s": 240.0, "total_s": 600.0, "ready_s": 180.0, "shutdown_grace_s": 15.0,
                                     **timeouts}}
        state.seat_dir("cpu-demo").mkdir(parents=True)
        state.state_path("cpu-demo").write_text(json.dumps(raw))
        with pytest.raises(state.UnreadableState, match="gates"):
            state.load("cpu-demo")
        r = cli("status", "--json", home=home, timeout=60)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert json.loads(r.stdout)[0]["phase"] == "unreadable"
        r = cli("down", "--profile", "cpu-demo", "--json", home=home, timeout=60)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
        seat = json.loads(r.stdout)["seats"][0]
        assert [p["pid"] for p in seat["signalled"]] == [child.pid] and seat["clean"], seat
        assert child.wait(timeout=10) is not None
        assert not state.state_path("cpu-demo").exists()  # set aside, kept
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_a_reader_that_quits_early_gets_no_error_line(home, tmp_path):
    """`dsv4serve logs | head -1`: the broken pipe is the reader's choice, not a failure to report
    ("Broken pipe; free space or fix that path" was printed once OSErrors became one-line errors)."""
    from .conftest import DSV4SERVE

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "vllm.log").write_text("".join(f"INFO line {i}\n" for i in range(200000)))
    state.save(make(run_dir=str(tmp_path / "run"), log_path=str(tmp_path / "run" / "vllm.log")))
    p = subprocess.Popen([*DSV4SERVE, "logs", "--profile", "cpu-demo", "-n", "200000"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={**os.environ, "DSV4SERVE_HOME": str(home)})
    assert p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 1 and err == "", err


def test_lock_held_reads_the_kernels_lock_table_without_taking_the_lock(home):
    """The dry run asks whether another `up` holds the seat; taking the lock to find out would
    refuse an `up` that starts in that instant."""
    assert state.lock_held("cpu-demo") is False  # no seat dir, no lock file
    lk = state.acquire("cpu-demo", "up")
    try:
        assert state.lock_held("cpu-demo") is True
    finally:
        lk.release()
    assert state.lock_held("cpu-demo") is False


def test_a_lock_table_naming_another_device_number_still_finds_the_holder(home):
    """On btrfs /proc/locks names a file by its superblock's device, stat by the subvolume's: the
    seat's lock never matched, so `down` could not see an `up` in its pre-launch steps (helper
    audit). A line with the inode and a pid that has the file open counts; one whose pid does not
    hold it does not."""
    import subprocess

    lk = state.acquire("cpu-demo", "up")
    try:
        st = (state.seat_dir("cpu-demo") / "seat.lock").stat()
        other_dev = f"{os.major(st.st_dev) + 1:02x}:{os.minor(st.st_dev) + 7:02x}:{st.st_ino}"
        assert state.held_in(f"1: FLOCK  ADVISORY  WRITE {os.getpid()} {other_dev} 0 EOF\n", st) is True
        stranger = subprocess.Popen(["sleep", "30"])
        try:
            assert state.held_in(f"1: FLOCK  ADVISORY  WRITE {stranger.pid} {other_dev} 0 EOF\n", st) is False
        finally:
            stranger.kill()
            stranger.wait()
        wrong_inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino + 1}"
        assert state.held_in(f"1: FLOCK  ADVISORY  WRITE {os.getpid()} {wrong_inode} 0 EOF\n", st) is False
    finally:
        lk.release()


def test_a_forced_update_writes_over_stopping_but_never_brings_a_removed_state_back(home):
    """The supervisor records a failed teardown even after `down` marked the seat stopping; but the
    read and the write are one locked step, so a `down` that removes the state in between wins."""
    import threading

    st = make()
    state.save(st)
    assert state.mark_stopping("cpu-demo", st.run_id, "down").phase == "stopping"
    assert state.update("cpu-demo", st.run_id, even_stopping=True, phase="failed").phase == "failed"

    real_load = state.load
    read = threading.Event()

    def slow_load(seat):
        """The real load, then a pause in which a concurrent `down` tries to remove the state."""
        out = real_load(seat)
        read.set()
        time.sleep(0.5)
        return out

    state.load = slow_load
    try:
        t = threading.Thread(target=state.update, args=("cpu-demo", st.run_id),
                             kwargs={"even_stopping": True, "phase_detail": "teardown not clean"})
        t.start()
        assert read.wait(5)
        state.load = real_load
        removed = state.remove("cpu-demo", st.run_id)  # waits for the update's lock, then removes
        t.join(15)
    finally:
        state.load = real_load
    assert removed and not state.state_path("cpu-demo").exists()
    assert state.update("cpu-demo", st.run_id, even_stopping=True, phase="failed") is None
    assert not state.state_path("cpu-demo").exists()


def test_a_held_state_lock_is_named_as_such_not_as_a_disk_problem(home):
    """filelock's Timeout is an OSError; the one line must say another dsv4serve holds the lock, not
    'free space or fix that path'."""
    from filelock import FileLock

    st = make()
    state.save(st)
    lk = FileLock(str(state.seat_dir("cpu-demo") / "state.lock"))
    lk.acquire()
    try:
        r = cli("down", "--profile", "cpu-demo", "--json", home=home, timeout=90)
    finally:
        lk.release()
    assert r.returncode != 0
    err = json.loads(r.stdout)["error"]
    assert err["type"] == "LockTimeout" and "held by another dsv4serve" in err["message"], err
    assert "free space" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _stopped_run(tmp_path, rank: int, run_json: str) -> None:
    """Seat cpu-demo stopped: its last run's log holds one line of `rank`, beside the given run.json."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "vllm.log").write_text(f"(Worker_TP{rank} pid=1) INFO hello from rank {rank}\n")
    (run_dir / "run.json").write_text(run_json)
    state.save_last("cpu-demo", {"run_id": "cpu-demo-x", "outcome": "stopped by down",
                                 "log": str(run_dir / "vllm.log")})


@pytest.mark.parametrize("run_json", ["[]", "null", '"argv"', '{"argv": 5}'])
def test_logs_of_a_stopped_run_whose_run_json_is_not_a_record_still_print(home, tmp_path, run_json):
    """run.json gives the stopped run's TP (how many rank streams to expect); a hand-edited one that
    is valid JSON of another shape means 'unknown', not a traceback."""
    _stopped_run(tmp_path, 0, run_json)
    r = cli("logs", "--profile", "cpu-demo", home=home, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hello from rank 0" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("field, value", [("pid", -5), ("pgid", 0), ("rank_pids", {"0": -1}), ("tp", 100000000)])
def test_a_state_with_an_impossible_number_is_an_unreadable_row_not_a_traceback(home, field, value):
    """A hand-edited pid of -5 reached psutil (ValueError, every status crashed); a TP of 10**8 made
    readers allocate per rank until the OOM killer came."""
    state.save(make("good"))
    bad = json.loads(make("odd").model_dump_json())
    bad[field] = value
    state.seat_dir("odd").mkdir(parents=True)
    state.state_path("odd").write_text(json.dumps(bad))
    r = cli("status", "--json", home=home, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    rows = {row["seat"]: row for row in json.loads(r.stdout)}
    assert rows["odd"]["phase"] == "unreadable" and field in rows["odd"]["problem"], rows["odd"]
    assert rows["good"]["phase"] != "unreadable"
    assert not state.pid_alive(-1) and not state.pid_alive(2**70)


def test_a_stray_directory_among_the_seats_is_not_a_seat(home):
    """`.trash` or `bad name` under seats/ made every status and logs refuse ("'.trash' is not a
    seat name"), hiding the real seats."""
    state.save(make("good"))
    for stray in (".trash", "bad name"):
        (home / "seats" / stray).mkdir(parents=True)
        (home / "seats" / stray / "last.json").write_text("{}")
    assert state.known_seats() == ["good"] and state.all_seats() == ["good"]
    r = cli("status", "--json", home=home, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [row["seat"] for row in json.loads(r.stdout)] == ["good"]


def test_a_fifo_state_file_is_unreadable_not_a_hang(home):
    state.seat_dir("cpu-demo").mkdir(parents=True)
    os.mkfifo(state.state_path("cpu-demo"))
    os.mkfifo(state.last_path("cpu-demo"))
    with pytest.raises(state.UnreadableState, match="not a regular file"):
        state.load("cpu-demo")
    assert state.load_last("cpu-demo") is None
    r = cli("status", "--json", home=home, timeout=30)
    assert r.returncode == 0 and json.loads(r.stdout)[0]["phase"] == "unreadable", r.stdout + r.stderr


def test_a_corrupt_last_run_record_is_named_not_called_no_log(home, tmp_path):
    state.save_last("cpu-demo", {"run_id": "cpu-demo-x", "outcome": "stopped by down", "log": str(tmp_path / "l")})
    text = state.last_path("cpu-demo").read_text()
    state.last_path("cpu-demo").write_text(text[:20])
    r = cli("status", "--json", home=home, timeout=60)
    row = json.loads(r.stdout)[0]
    assert row["phase"] == "not running" and "last.json is unreadable" in row["problem"], row
    r = cli("status", home=home, timeout=60)
    assert len(row["problem"]) > 80 and row["problem"] in r.stdout, r.stdout  # one line when piped, not wrapped
    r = cli("logs", "--profile", "cpu-demo", home=home, timeout=60)
    assert r.returncode == 2 and "last.json is unreadable" in r.stderr and "has no log" not in r.stderr, r.stderr


@pytest.mark.parametrize("run_json", ['{"argv": ["-tp", "100000000"]}', '{"argv": ["-tp", "0"]}', '{"argv": ["-t'])
def test_logs_of_a_run_whose_rank_count_is_unknown_or_absurd_say_so_and_still_print(home, tmp_path, run_json):
    _stopped_run(tmp_path, 5, run_json)
    r = cli("logs", "--profile", "cpu-demo", "--rank", "5", home=home, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hello from rank 5" in r.stdout
    assert "does not give the run's rank count" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("cmd", ["down", "status", "logs"])
def test_an_empty_profile_name_names_no_seat_and_never_means_all(home, cmd):
    """`dsv4serve down --profile "$SEAT"` with SEAT unset stopped every seat."""
    state.save(make("good"))
    r = cli(cmd, "--profile", "", home=home, timeout=60)
    assert r.returncode == 2 and "--profile '' names no seat" in r.stderr, r.stdout + r.stderr
    assert state.load("good") is not None


def test_a_relative_home_is_made_absolute_and_a_relative_xdg_state_home_ignored(tmp_path, monkeypatch):
    """A relative DSV4SERVE_HOME gave docker relative -v paths and a relative run dir, and status or
    down from another directory found no seat (helper audit)."""
    from dsv4serve import home as home_mod

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSV4SERVE_HOME", "relhome")
    assert home_mod.home() == tmp_path / "relhome"
    monkeypatch.delenv("DSV4SERVE_HOME")
    monkeypatch.setenv("XDG_STATE_HOME", "relstate")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert home_mod.home() == tmp_path / "h" / ".local" / "state" / "dsv4serve"


HOLDER = """
import sys, time
from dsv4serve import state
lk = state.acquire("cpu-demo", "up")  # an up in its pre-launch steps: the lock, no state yet
print("held", flush=True)
deadline = time.time() + 60
while time.time() < deadline:
    if state.cancel_requested("cpu-demo"):  # what up's checkpoints do
        state.clear_cancel("cpu-demo")
        print("cancelled", flush=True)
        break
    time.sleep(0.1)
lk.release()
"""


def test_down_during_ups_pre_launch_steps_stops_that_up(home):
    """`down` while `up` ran its pre-launch checks said "nothing to stop" and the seat came up
    afterwards (helper audit): it now asks that up to stop and waits until it has."""
    from dsv4serve import seat

    holder = subprocess.Popen([sys.executable, "-c", HOLDER], env={**os.environ, "DSV4SERVE_HOME": str(home)},
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert state.starting_seats() == ["cpu-demo"]
        rep = seat.down("cpu-demo")
        assert rep["clean"] and rep["seats"][0]["cancelled_before_launch"], rep
        assert holder.stdout.readline().strip() == "cancelled"
        assert holder.wait(10) == 0
        assert not state.cancel_requested("cpu-demo") and state.starting_seats() == []
        assert seat.down("cpu-demo")["message"] == "seat cpu-demo is not running: nothing to stop"
    finally:
        holder.kill()
        holder.wait()


def test_up_stops_at_its_next_checkpoint_and_the_supervisor_before_spawning(home, monkeypatch, tmp_path):
    from dsv4serve import launch, seat, supervisor
    from dsv4serve.errors import JobFailed
    from dsv4serve.profile import load_profile

    state.seat_dir("cpu-demo").mkdir(parents=True, exist_ok=True)
    state.request_cancel("cpu-demo")
    with pytest.raises(JobFailed, match="stopped by `dsv4serve down` before vLLM was started; nothing was started"):
        seat._stop_if_cancelled("cpu-demo")
    assert not state.cancel_requested("cpu-demo")

    # the request lands after up's last checkpoint, before the supervisor records the state
    profile = load_profile("cpu-demo")
    spec = launch.build(profile, run_id="cpu-demo-cancel-test", run_dir=tmp_path / "run")
    sup = supervisor.Supervisor(profile, spec, json_events=True, foreground=False)
    monkeypatch.setattr(supervisor, "spawn", lambda *a, **k: pytest.fail("spawned after a cancel"))
    state.request_cancel("cpu-demo")
    out = sup.run()
    assert not out.ok and "stopped by `dsv4serve down` before vLLM was started" in out.reason
    assert state.load("cpu-demo") is None and not state.cancel_requested("cpu-demo")


@pytest.mark.parametrize("how", ["cancelled", "spawn fails", "state write fails"])
def test_a_run_that_never_started_leaves_no_socket_dir(home, monkeypatch, tmp_path, request, how):
    """`up` makes the run's directory for vLLM's ZMQ sockets before it records the state: a run
    that stops before the spawn must take that directory away again."""
    import errno
    import shutil
    import tempfile

    from dsv4serve import launch, supervisor
    from dsv4serve.errors import JobFailed
    from dsv4serve.profile import load_profile

    # short: under pytest's long tmp_path the socket paths would not fit, and /tmp would be used
    tdir = Path(tempfile.mkdtemp(prefix="rpct-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(tdir, ignore_errors=True))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    monkeypatch.setenv("TMPDIR", str(tdir))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() caches its first answer
    profile = load_profile("cpu-demo")
    spec = launch.build(profile, run_id="cpu-demo-rpc-test", run_dir=tmp_path / "run")
    sup = supervisor.Supervisor(profile, spec, json_events=True, foreground=False)
    made = []
    real_make = supervisor.leftovers.make_rpc_dir
    monkeypatch.setattr(supervisor.leftovers, "make_rpc_dir",
                        lambda env, cwd=None: made.append(real_make(env, cwd)) or made[-1])
    if how == "cancelled":
        state.seat_dir("cpu-demo").mkdir(parents=True, exist_ok=True)
        state.request_cancel("cpu-demo")
        monkeypatch.setattr(supervisor, "spawn", lambda *a, **k: pytest.fail("spawned after a cancel"))
        assert not sup.run().ok
    elif how == "spawn fails":
        def no_exec(*a, **k):
            raise OSError(errno.ENOENT, "No such file or directory")
        monkeypatch.setattr(supervisor, "spawn", no_exec)
        out = sup.run()
        assert not out.ok and "could not start" in out.reason
    else:
        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(supervisor.state, "save", full)
        with pytest.raises(JobFailed, match="could not write the seat's state"):
            sup.run()
    assert made and made[0].startswith(str(tdir / "dsv4serve-rpc-"))
    assert list(tdir.iterdir()) == [] and state.load("cpu-demo") is None


def test_down_without_a_name_refuses_before_stopping_a_starting_up(home):
    """Review: with one seat running and another's up still starting, a bare down asked that up to
    stop and only then refused with "name one"."""
    from dsv4serve import seat

    state.save(make(seat="cpu-demo", pid=None, phase="ready"))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.replace('"cpu-demo"', '"other-seat"')],
                              env={**os.environ, "DSV4SERVE_HOME": str(home)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(BadInput, match=r"2 seats are known \(cpu-demo, other-seat\)"):
            seat.down(None)
        assert not state.cancel_requested("other-seat")
        # named, a first up of a profile file (no state, no last run, no shipped profile) is reached
        rep = seat.down("other-seat")
        assert rep["seats"][0]["cancelled_before_launch"] and holder.wait(10) == 0
    finally:
        holder.kill()
        holder.wait()


def test_a_launching_state_without_a_pid_whose_up_is_gone_is_stale(home):
    """An up that died between its state write and the spawn left a 'launching' state with no pid,
    which refused every later up as 'already running' (helper audit)."""
    from dsv4serve import seat

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    st = make(pid=None, phase="launching", supervisor_pid=gone.pid)
    assert seat._running_refusal(st) is None
    alive = make(pid=None, phase="launching", supervisor_pid=os.getpid())
    assert "is already running" in seat._running_refusal(alive).message
    # status reads it as up does: it called the orphan plain "launching", with no problem (helper audit)
    state.save(st)
    row = seat._row("cpu-demo")
    assert row["phase"] == "stale" and row["stale"], row
    assert row["problem"] == (f"the up that was starting it (pid {gone.pid}) is gone before it started anything: "
                              "`dsv4serve down` clears it")
    state.save(alive)
    row = seat._row("cpu-demo")
    assert row["phase"] == "launching" and not row["stale"] and row["problem"] is None, row


def test_logs_follow_of_a_docker_seat_ends_when_its_client_is_gone(home, tmp_path):
    """A docker seat's log is its attached client's output: with the client dead nothing writes it,
    but `logs -f` waited only for native runs' processes, so it followed such a seat for ever (docker
    audit). No docker is called: the client's pid alone says the log is over."""
    log = tmp_path / "vllm.log"
    log.write_bytes(b"(APIServer pid=1) INFO started\n")
    gone = subprocess.Popen(["true"])
    gone.wait()
    state.save(make(log_path=str(log), run_dir=str(tmp_path), pid=gone.pid, start_time=time.time() - 60,
                    runtime="docker", container_name="dsv4-logs-test"))
    r = cli("logs", "-f", "--profile", "cpu-demo", home=home, timeout=60)
    assert r.returncode == 0 and "INFO started" in r.stdout
    assert "has ended; its docker client is gone" in r.stderr and "`dsv4serve status`" in r.stderr, r.stderr


def test_a_stop_that_died_half_way_is_not_shown_as_stopping(home):
    """A down killed during its grace left the state "stopping" and status said so for good while
    the seat served on and nothing stopped it (helper audit). The state names the process that
    marked it; once that one is gone, status says a down is needed."""
    seat_proc = subprocess.Popen(["sleep", "60"])
    try:
        st = make(pid=seat_proc.pid, start_time=psutil.Process(seat_proc.pid).create_time())
        state.save(st)
        mark = ("import sys; from dsv4serve import state; "
                "assert state.mark_stopping('cpu-demo', sys.argv[1], 'dsv4serve down') is not None")
        r = subprocess.run([sys.executable, "-c", mark, st.run_id], env={**os.environ, "DSV4SERVE_HOME": str(home)},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        marked = state.load("cpu-demo")
        assert marked.phase == "stopping" and marked.stopper_pid not in (None, os.getpid())
        out = cli("status", "--json", home=home, timeout=60)
        row = {x["seat"]: x for x in json.loads(out.stdout)}["cpu-demo"]
        assert row["phase"] == "stopping", row
        assert row["problem"] == (f"a stop (dsv4serve down, pid {marked.stopper_pid}) did not finish and nothing is "
                                  "stopping the seat now: `dsv4serve down --profile cpu-demo` finishes it"), row
        # a stop that is still running (this process) is just that
        state.mark_stopping("cpu-demo", st.run_id, "dsv4serve down")
        row = {x["seat"]: x for x in json.loads(cli("status", "--json", home=home, timeout=60).stdout)}["cpu-demo"]
        assert row["phase"] == "stopping" and row["problem"] == "dsv4serve down", row
    finally:
        seat_proc.kill()
        seat_proc.wait()


@pytest.mark.parametrize("text", [json.dumps(x) for x in (
    {"started_at": 10**400}, {"argv": ["vllm", "-tp", "²"]}, {"argv": ["vllm", "-tp", "9" * 5000]},
    {"started_at": True}, [1, 2], {"env": "x", "argv": "vllm"})] + ["[" * 200000])
def test_an_odd_old_run_json_makes_no_down_of_an_unreadable_state_crash(home, text):
    """down of an unreadable state reads every past run.json of the seat: a started_at of 10**400
    (OverflowError), a rank count of '²' or 5,000 digits (ValueError), JSON nested past the parser
    (RecursionError) made every down crash (review)."""
    from dsv4serve import seat

    d = home / "runs" / "cpu-demo-20261205-000000-abcd"
    d.mkdir(parents=True)
    (d / "run.json").write_text(text)
    st = seat._tag_only_state("cpu-demo", d)
    assert st.tp == 1 and math.isfinite(st.started_at) and st.started_at > 1e9
    state.state_path("cpu-demo").parent.mkdir(parents=True, exist_ok=True)
    state.state_path("cpu-demo").write_text("{")
    r = cli("down", "--profile", "cpu-demo", "--json", home=home, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["seats"][0]["clean"], r.stdout + r.stderr


def test_down_of_an_unreadable_state_stops_the_group_of_a_tagged_leader_titled_workers_too(home):
    """With the state lost only tagged processes were stopped: a worker whose tag its process title
    wiped (a seat started before SPT_NOENV) ran on under a clean verdict (review). A tagged process
    leading its own group is the run's main process, and its group is stopped whole."""
    from .test_stop_unit import LEADER, TITLED_WORKER

    run_id = f"cpu-demo-20261205-000000-{os.getpid() % 9999:04d}"
    (home / "runs" / run_id).mkdir(parents=True)
    env = {**{k: v for k, v in os.environ.items() if k != "SPT_NOENV"}, state.RUN_ID_ENV: run_id,
           "DSV4SERVE_RUN_DIR": str(home / "runs" / run_id)}
    leader = subprocess.Popen([sys.executable, "-c", LEADER, TITLED_WORKER], env=env, start_new_session=True,
                              stdout=subprocess.PIPE, text=True)
    worker = int(leader.stdout.readline())
    try:
        time.sleep(0.3)
        assert psutil.Process(worker).environ().get(state.RUN_ID_ENV) is None  # the title wiped the tag
        state.state_path("cpu-demo").parent.mkdir(parents=True, exist_ok=True)
        state.state_path("cpu-demo").write_text("{")
        r = cli("down", "--profile", "cpu-demo", "--json", home=home, timeout=60)
        seat = json.loads(r.stdout)["seats"][0]
        assert r.returncode == 0 and seat["clean"], r.stdout + r.stderr
        leader.wait(timeout=10)
        deadline = time.time() + 10
        while psutil.pid_exists(worker) and psutil.Process(worker).status() != psutil.STATUS_ZOMBIE \
                and time.time() < deadline:
            time.sleep(0.1)
        assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    finally:
        leader.kill()
        leader.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, 9)


def test_a_state_naming_this_process_group_or_an_ancestor_never_gets_it_signalled():
    """A hand-edited state naming the group of the shell or test runner above down, with its real
    start time, made down killpg its own caller (review)."""
    from dsv4serve import procs

    me = psutil.Process()
    for leader in [me, *me.parents()]:
        st = make(pid=leader.pid, pgid=leader.pid, start_time=leader.create_time())
        assert procs.group_is_ours(st) is False
    grp = os.getpgrp()
    if psutil.pid_exists(grp):
        assert procs.group_is_ours(make(pid=grp, pgid=grp, start_time=psutil.Process(grp).create_time())) is False
