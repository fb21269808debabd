"""Per-rank log parsing on lines captured from the real vLLM CPU server, and on the canon seat's
lines as seat-reference.md quotes them."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4serve.ranklog import SeatTracker, parse_line

REAL = Path(__file__).parent / "data" / "vllm-cpu-tp2-mtp.log"


def feed_all(tr: SeatTracker, lines):
    events = []
    for i, ln in enumerate(lines):
        events += tr.feed(ln, now=1000.0 + i)
    return events


def test_prefixes():
    assert parse_line("(Worker_TP3 pid=42) INFO x").proc == "Worker_TP3"
    assert parse_line("(EngineCore_DP0 pid=7) INFO x").pid == 7
    p = parse_line("INFO:     Application startup complete.")
    assert p.proc is None and p.text.startswith("INFO:")


def test_real_tp2_log_gives_every_phase_marker_and_kv():
    tr = SeatTracker(2, ["dsv4serve plugin ready"], [])
    events = feed_all(tr, REAL.read_text().splitlines())
    assert tr.marker_ranks["dsv4serve plugin ready"] == {0, 1}
    assert tr.kv_tokens == 310688
    assert tr.api_serving
    assert not tr.fatal, tr.fatal
    assert all(r.phase in ("graphs", "marker") for r in tr.ranks.values())
    assert tr.ranks[0].pid and tr.ranks[1].pid and tr.ranks[0].pid != tr.ranks[1].pid
    assert tr.ranks[0].shards == (1, 1)          # the unprefixed tqdm bar belongs to rank 0
    assert tr.dist_ids                            # the run's /dev/shm + /tmp leftovers can be found
    kinds = {e["event"] for e in events}
    assert {"phase", "marker", "kv", "api", "shards"} <= kinds
    assert tr.missing_markers() == {}


def test_missing_marker_names_the_rank():
    lines = [ln for ln in REAL.read_text().splitlines() if "plugin ready rank=1/2" not in ln]
    tr = SeatTracker(2, ["dsv4serve plugin ready"], [])
    feed_all(tr, lines)
    assert tr.missing_markers() == {"dsv4serve plugin ready": [1]}


SEAT = """(APIServer pid=100) INFO 09-04 [api_server.py] vLLM API server version 0.28.1rc1.dev337
(VllmWorker-5 pid=205) INFO 09-04 [parallel_state.py] world_size=8 rank=5 local_rank=5 backend=nccl
(Worker_TP5 pid=205) INFO 09-04 [gpu_model_runner.py] Starting to load model /data/DSV4...
(Worker_TP0 pid=200) INFO 09-04 [gpu_model_runner.py] Starting to load model /data/DSV4...
Loading safetensors checkpoint shards:  47% Completed | 24/51 [01:02<01:10,  2.6s/it]
(Worker_TP0 pid=200) INFO 09-04 [exl3.py] EXL3 MCG trellis engaged for routed experts: bits=2 experts_local=256 hidden=4096 intermediate_local=256 fused_moe=exl3_moe
(EngineCore pid=150) INFO 09-04 [kv_cache_utils.py] GPU KV cache size: 395,069 tokens
""".splitlines()


def test_seat_lines_tp8():
    tr = SeatTracker(8, ["LNA2 MoE kernel ACTIVE"], ["LNA preflight FAILED", r"LNA2 declined: (?!rows=\d+ above the ceiling)"])
    feed_all(tr, SEAT)
    assert tr.kv_tokens == 395069
    assert tr.ranks[5].phase == "kv_sized" and tr.ranks[5].pid == 205
    assert tr.ranks[0].shards == (24, 51)
    for r in range(8):  # the image's own kernel's line is not dsv4serve's proof, on any rank
        tr.feed(f"(Worker_TP{r} pid={200 + r}) WARNING 09-04 [exl3.py] F3 LNA2 MoE kernel ACTIVE (VLLM_EXL3_MOE_KERNEL=lna2)")
    assert tr.marker_ranks["LNA2 MoE kernel ACTIVE"] == set()
    for r in range(8):
        tr.feed(f"(Worker_TP{r} pid={200 + r}) WARNING 09-04 [vllm_plugin.py:70] LNA2 MoE kernel ACTIVE rank={r}/8 "
                "layers=43 bits=2,3 ext=b1 policy=builtin")
    assert tr.marker_ranks["LNA2 MoE kernel ACTIVE"] == set(range(8))
    assert tr.lna2_builds == {r: "b1" for r in range(8)}
    # counted by distinct rank, not by lines
    tr2 = SeatTracker(8, ["LNA2 MoE kernel ACTIVE"], [])
    for _ in range(8):
        tr2.feed("(Worker_TP0 pid=200) WARNING LNA2 MoE kernel ACTIVE rank=0/8 ext=b1")
    assert tr2.missing_markers()["LNA2 MoE kernel ACTIVE"] == [1, 2, 3, 4, 5, 6, 7]
    # a prefill decline is fine, any other decline is forbidden
    tr.feed("(Worker_TP3 pid=203) INFO LNA2 declined: rows=512 above the ceiling 32 (rank=3/8 layer=x)")
    assert not tr.fatal
    tr.feed("(Worker_TP3 pid=203) INFO LNA2 declined: lna2 not ready: rank=3/8 layer=x: no CUDA")
    assert tr.fatal and tr.fatal[0].kind == "forbidden" and tr.fatal[0].stream == "rank3"


def test_fatal_signatures_and_hints():
    tr = SeatTracker(8, [], [])
    tr.feed("(EngineCore pid=150) ERROR ValueError: To serve at least one request with the models's max seq len "
            "(389120), (1.83 GiB KV cache is needed, which is larger than the available KV cache memory (1.37 GiB). "
            "Based on the available memory, the estimated maximum model length is 263424.")
    assert tr.fatal and "--set vllm.max_model_len=263424" in tr.fatal[0].hint
    tr = SeatTracker(2, [], [])
    tr.feed("(Worker_TP1 pid=9) ERROR Traceback (most recent call last):")
    tr.feed('(Worker_TP1 pid=9) ERROR   File "x.py", line 1, in f')
    tr.feed("(Worker_TP1 pid=9) ERROR RuntimeError: lna2 not ready: rank=1/2 layer=model.layers.1.mlp.experts: no CUDA")
    f = [x for x in tr.fatal if x.kind == "traceback"][0]
    assert f.stream == "rank1" and f.line.startswith("RuntimeError: lna2 not ready")
    assert "lna2 runs on a CUDA GPU" in f.hint
    assert tr.ranks[1].first_error.startswith("RuntimeError")
    tr.feed("(Worker_TP0 pid=8) ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert any(x.kind == "oom" for x in tr.fatal)
    tr.feed("(EngineCore pid=7) ERROR Worker proc VllmWorker-1 died unexpectedly, shutting down executor.")
    assert any(x.kind == "rank_died" for x in tr.fatal)


def test_stall_and_laggard():
    tr = SeatTracker(2, [], [], start=0.0)
    tr.feed("(Worker_TP0 pid=1) INFO Starting to load model x", now=10.0)
    assert tr.stalled_for(100.0) == 90.0
    assert tr.laggard().name == "rank1"


# --- faults captured from the real vLLM CPU server (vllm-cpu 0.32.0, the demo model) -----------
# vllm-cpu-tp1-corrupt-safetensors.log: TP 1, model.safetensors truncated to 100 kB
# vllm-cpu-tp1-kv-too-small.log:        TP 1, --kv-cache-memory-bytes 600000 (KV for 240 tokens < 512)
# vllm-cpu-tp2-worker-killed.log:       TP 2, ready, then SIGKILL to Worker_TP1
DATA = Path(__file__).parent / "data"


def real(name: str, tp: int, markers=(), forbidden=()) -> SeatTracker:
    tr = SeatTracker(tp, list(markers), list(forbidden), start=0.0)
    feed_all(tr, (DATA / name).read_text().splitlines())
    return tr


def test_corrupt_safetensors_first_fatal_is_the_workers_last_traceback_line():
    tr = real("vllm-cpu-tp1-corrupt-safetensors.log", 1)
    first = tr.fatal[0]
    assert first.kind == "traceback" and first.rank == 0 and first.stream == "rank0"
    # vLLM logs the worker's traceback through its logger: header + prefix on every line
    assert first.line == ("safetensors._safetensors_rust.SafetensorError: Error while deserializing header: "
                          "incomplete metadata, file not fully covered")
    assert "safetensors" in first.hint
    assert tr.ranks[0].phase == "loading" and tr.ranks[0].shards == (0, 1)
    assert tr.first_errors()["rank0"].startswith("safetensors._safetensors_rust.SafetensorError")
    # the engine's and the API server's consequences come after the root cause
    assert [f.stream for f in tr.fatal[:3]] == ["rank0", "engine", "api"]


def test_kv_too_small_suggests_the_estimated_max_model_len():
    tr = real("vllm-cpu-tp1-kv-too-small.log", 1)
    first = tr.fatal[0]
    assert first.stream == "engine" and first.line.startswith("ValueError: To serve at least one request")
    assert tr.maxlen_hint == 240
    assert first.hint == "the KV cache fits 240 tokens: retry with --set vllm.max_model_len=240"
    assert tr.kv_tokens is None


def test_worker_killed_is_blamed_on_its_rank():
    tr = real("vllm-cpu-tp2-worker-killed.log", 2)
    died = tr.fatal[0]
    assert died.kind == "rank_died" and died.rank == 1 and died.stream == "engine"
    assert "VllmWorker-1 died unexpectedly (exit code: -9)" in died.line
    assert tr.kv_tokens == 310688 and tr.api_serving and tr.engine_ready  # it had been ready
    assert tr.ranks[0].pid == 24278 and tr.ranks[1].pid == 24279


def test_healthy_log_has_no_fatal_and_no_progress_from_heartbeats():
    tr = real("vllm-cpu-tp2-mtp.log", 2, ["dsv4serve plugin ready"])
    assert not tr.fatal
    last = tr.last_progress
    tr.feed('INFO:     127.0.0.1:33978 - "GET /health HTTP/1.1" 200 OK', now=5000.0)
    tr.feed("(APIServer pid=26735) INFO 12-02 20:45:00 [loggers.py:335] Engine 000: Avg prompt throughput: 0.0 "
            "tokens/s, Avg generation throughput: 0.0 tokens/s", now=5001.0)
    tr.feed("(APIServer pid=26735) INFO 12-02 20:45:00 [utils.py:1] Waiting for 1 local, 0 remote core engine "
            "proc(s) to start.", now=5002.0)
    assert tr.last_progress == last  # heartbeats never reset the stall timer
    tr.feed("(Worker_TP1 pid=26764) INFO 12-02 20:45:00 [x.py:1] something new", now=5003.0)
    assert tr.last_progress == 5003.0


def test_real_log_learns_pids_engine_and_rendezvous():
    tr = real("vllm-cpu-tp2-mtp.log", 2, ["dsv4serve plugin ready"])
    assert tr.engine_pid == 26755 and tr.api_pid == 26735
    assert tr.dist_paths == {"/tmp/vllm_dist_5b74b3fd326b48d393772803daeb325d"}
    # the unprefixed torch glog line of a worker pid is routed to that worker's rank
    assert tr.route("W1202 20:44:29.440000 26763 torch/_library/triton.py:53] Triton not available") == "rank0"
    assert tr.route("(Worker pid=26764) INFO x") == "rank1"
    assert tr.route("INFO:     Application startup complete.") == "api"


def test_forbidden_regex_must_compile():
    import pytest

    from dsv4serve.errors import ProfileError

    with pytest.raises(ProfileError, match="not a valid regex"):
        SeatTracker(2, [], ["LNA2 declined: (?!"])


def test_seat_reference_lines_decline_and_untuned_and_kv():
    forb = ["LNA preflight FAILED", r"LNA2 declined: (?!rows=\d+ above the ceiling)",
            "untuned shape .* during CUDA graph capture"]
    tr = SeatTracker(8, ["LNA2 MoE kernel ACTIVE"], forb)
    tr.feed("(EngineCore_DP0 pid=150) INFO 09-04 12:00:01 [kv_cache_utils.py:1] GPU KV cache size: 395,069 tokens")
    tr.feed("(EngineCore_DP0 pid=150) INFO 09-04 12:00:01 [gpu_worker.py:1] Available KV cache memory: 1.86 GiB")
    assert tr.kv_tokens == 395069 and tr.kv_gib == 1.86 and not tr.fatal
    tr.feed("(Worker_TP6 pid=206) WARNING 09-04 [exl3.py:9] [exl3_gemm] LNA-LAB: untuned shape m=16 k=4096 "
            "during CUDA graph capture")
    assert tr.fatal[-1].kind == "forbidden" and tr.fatal[-1].rank == 6
    tr.feed("(Worker_TP2 pid=202) WARNING 09-04 [exl3.py:9] F3/F1 LNA preflight FAILED for model.layers.3 "
            "(backend=lna2): pointer table -- the MoE will fall back to exllamav3")
    assert tr.fatal[-1].kind == "forbidden" and tr.fatal[-1].stream == "rank2"


def test_rank_text_counts_only_for_worker_lines_one_rank_per_pid():
    """`rank=r/tp` in a line's text attributes it to a rank only where the prefix could not: a worker
    process with no rank in its prefix, and one rank per pid. The marker gate counts distinct ranks;
    an engine or API-server line, or one process naming every rank, must not satisfy it."""
    marker = "LNA2 MoE kernel ACTIVE"
    tr = SeatTracker(8, [marker], [])
    for r in range(8):
        tr.feed(f"(EngineCore_DP0 pid=77) INFO {marker} rank={r}/8")
        tr.feed(f"(APIServer pid=1) INFO {marker} rank={r}/8")
        tr.feed(f"(VllmWorker pid=300) INFO {marker} rank={r}/8")  # one process, eight claims
    assert tr.marker_ranks[marker] == {0}
    for r in range(1, 8):
        tr.feed(f"(VllmWorker pid={300 + r}) INFO {marker} rank={r}/8")  # one process per rank
    assert tr.marker_ranks[marker] == set(range(8))


def test_the_docker_clients_own_error_is_the_fatal_line():
    """When the engine cannot run the container, the only line in the log is the docker client's:
    it is the first error (with a docker hint), not 'vLLM exited' with nothing to go by."""
    tr = SeatTracker(8, [], [])
    tr.feed("docker: Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?")
    assert [f.kind for f in tr.fatal] == ["docker"] and "fix docker" in tr.fatal[0].hint
    tr = SeatTracker(8, [], [])
    tr.feed("docker: Error response from daemon: could not select device driver \"\" with capabilities: [[gpu]].")
    assert tr.fatal and tr.fatal[0].kind == "docker" and tr.first_errors()


def _view(tr: SeatTracker) -> dict:
    """Everything status and down read from a tracker."""
    return {"ranks": {r: (s.phase, sorted(s.markers), s.pid) for r, s in tr.ranks.items()},
            "markers": {m: sorted(r) for m, r in tr.marker_ranks.items()}, "kv": tr.kv_tokens,
            "fatal": [(f.kind, f.stream, f.rank, f.line) for f in tr.fatal], "dist": sorted(tr.dist_ids),
            "paths": sorted(tr.dist_paths), "lines": tr.lines, "pids": tr.rank_pids()}


def test_a_checkpointed_read_equals_a_whole_read_as_the_log_grows(tmp_path):
    """status resumes from its checkpoint; the result must be what reading the whole log gives, at
    every cut (mid-line, mid-character, \\r\\n and tqdm's \\r), after truncation and replacement."""
    from dsv4serve.ranklog import read_log

    base = (Path(__file__).parent / "data" / "vllm-cpu-tp2-worker-killed.log").read_bytes()
    data = base.replace(b"\n", b"\r\n", 40) + "(Worker_TP1 pid=7) ünïcode ✓ déjà\rbar 50%\rbar 100%\n".encode()
    log, ck = tmp_path / "seat.log", tmp_path / "log-scan.pkl"
    args = (str(log), 2, ["dsv4serve plugin ready"], [r"Traceback"])
    log.write_bytes(b"")
    cuts = sorted({len(data) * k // 13 for k in range(1, 13)} | {len(data) - 3, len(data) - 1, len(data)})
    for cut in cuts:
        with open(log, "ab") as f:
            f.write(data[log.stat().st_size:cut])
        assert _view(read_log(*args, checkpoint=ck)) == _view(read_log(*args)), cut
    assert ck.is_file() and _view(read_log(*args))["fatal"]
    # copytruncate: the same file, shorter, written anew
    with open(log, "r+b") as f:
        f.truncate(0)
        f.write(base[:len(base) // 3])
    assert _view(read_log(*args, checkpoint=ck)) == _view(read_log(*args))
    # the same length but other bytes before the offset: rescanned, not resumed
    log.write_bytes(base[:len(base) // 3].replace(b"rank", b"RANK"))
    assert _view(read_log(*args, checkpoint=ck)) == _view(read_log(*args))
    # another file under the name (rotation), a torn checkpoint, another gate set
    other = tmp_path / "new.log"
    other.write_bytes(base)
    other.replace(log)
    assert _view(read_log(*args, checkpoint=ck)) == _view(read_log(*args))
    ck.write_bytes(b"\x80\x05torn")
    assert _view(read_log(*args, checkpoint=ck)) == _view(read_log(*args))
    assert _view(read_log(str(log), 2, [], [], checkpoint=ck)) == _view(read_log(str(log), 2, [], []))


def test_a_checkpoint_that_cannot_be_written_costs_only_time(tmp_path):
    from dsv4serve.ranklog import read_log

    log = tmp_path / "seat.log"
    log.write_bytes((Path(__file__).parent / "data" / "vllm-cpu-tp2-mtp.log").read_bytes())
    ck = tmp_path / "gone" / "log-scan.pkl"
    assert _view(read_log(str(log), 2, [], [], checkpoint=ck)) == _view(read_log(str(log), 2, [], []))
    assert not ck.exists()


def test_a_checkpoint_is_resumed_from_not_rescanned(tmp_path, monkeypatch):
    """The point of the checkpoint: the second read feeds only the appended lines, and one
    pickled by a tracker of other fields is not trusted."""
    from dsv4serve import ranklog

    log, ck = tmp_path / "seat.log", tmp_path / "log-scan.pkl"
    log.write_bytes((Path(__file__).parent / "data" / "vllm-cpu-tp2-mtp.log").read_bytes())
    ranklog.read_log(str(log), 2, [], [], checkpoint=ck)
    fed: list[str] = []
    real = ranklog.SeatTracker.feed
    monkeypatch.setattr(ranklog.SeatTracker, "feed", lambda self, raw, now=None: (fed.append(raw), real(self, raw, now))[1])
    with open(log, "ab") as f:
        f.write(b"(APIServer pid=9) INFO one more\n")
    ranklog.read_log(str(log), 2, [], [], checkpoint=ck)
    assert fed == ["(APIServer pid=9) INFO one more"]
    monkeypatch.setattr(ranklog, "_TRACKER_FIELDS", ranklog._TRACKER_FIELDS | {"a_new_field"})
    fed.clear()
    ranklog.read_log(str(log), 2, [], [], checkpoint=ck)
    assert len(fed) > 100  # rescanned whole


def test_vllm_refusing_its_own_command_line_is_the_fatal_line_with_a_fix():
    """With --no-validate a bad flag reaches vLLM, whose argparse prints a usage block and one error
    line, then exits 2: that line is the reason (it was 'no error line in the log')."""
    tr = SeatTracker(2, [], [])
    tr.feed("usage: api_server.py [-h] [--dtype {auto,half,float16,bfloat16,float,float32}]")
    tr.feed("api_server.py: error: argument --dtype: invalid choice: 'bogus' (choose from auto, half, bfloat16)")
    assert [f.kind for f in tr.fatal] == ["argv"]
    assert tr.fatal[0].line.startswith("api_server.py: error: argument --dtype") and "--no-validate" in tr.fatal[0].hint
    tr.feed("(APIServer pid=1) INFO 12-02 19:04:16 [api_server.py:1] vLLM API server version 0.32.0: error: none")
    assert len(tr.fatal) == 1
    tr.feed("vllm serve: error: unrecognized arguments: --bogus")  # the docker seat's entrypoint names itself so
    assert [f.kind for f in tr.fatal] == ["argv", "argv"]


@pytest.mark.parametrize("reason, words", [
    ("lna2 tuning table /srv/t.json (8a54ef4635a9) is not this card's: it was measured on a Another Card (132 SMs), "
     "this is a NVIDIA H100 80GB HBM3 (132 SMs); re-run `dsv4serve kernel check --bench --save-tuning FILE` on this "
     "card, or drop moe.tuning", "--save-tuning FILE` on the seat's card"),
    ("the lna2 build takes at most 32 rows a call but this seat decodes 33 (max_num_seqs x (1 + speculative tokens))",
     "lower vllm.max_num_seqs"),
    ("lna2 extension: extension not built (x.so missing)", "`dsv4serve kernel build`"),
])
def test_a_refusals_hint_matches_its_cause(reason, words):
    """Every 'lna2 not ready' line got "build the lna2 extension", contradicting a refusal for
    another card's table or too many decode rows (helper audit)."""
    tr = SeatTracker(2, [], [])
    tr.feed(f"(Worker_TP0 pid=200) ERROR dsv4serve plugin FAILED lna2 not ready: rank=0/2 layer=model.layers.3.mlp."
            f"experts: {reason} (VLLM_EXL3_MOE_STRICT=1)")
    assert tr.fatal and words in tr.fatal[-1].hint


def test_a_traceback_ending_in_a_cuda_error_is_that_kind_of_fatal():
    """Review: after ready only SERVING_FATAL kinds stop a seat, and a traceback ending in a CUDA,
    NCCL or OOM error was kind 'traceback' (the patterns were not tried on its last line)."""
    from dsv4serve.ranklog import SERVING_FATAL

    for last, kind in (("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
                       ("RuntimeError: CUDA error: an illegal memory access was encountered", "cuda"),
                       ("ValueError: bad tool call", "traceback")):
        tr = SeatTracker(2, [], [])
        tr.feed("(Worker_TP1 pid=9) ERROR Traceback (most recent call last):")
        tr.feed('(Worker_TP1 pid=9) ERROR   File "x.py", line 1, in f')
        tr.feed(f"(Worker_TP1 pid=9) ERROR {last}")
        assert [f.kind for f in tr.fatal] == [kind], tr.fatal
        assert (kind in SERVING_FATAL) == (kind != "traceback") == tr.fatal[0].ends_serving


def test_out_of_memory_in_the_api_servers_stream_does_not_end_a_ready_seat():
    """A request's MemoryError in the API server (its shared-memory buffer full) is that request's
    error, not the seat's end; out of memory on a rank or in the engine still is."""
    tr = SeatTracker(2, [], [])
    for ln in ("ERROR 12-02 19:04:17 [serving.py:929] Error in chat completion.", "Traceback (most recent call last):",
               '  File "/vllm/distributed/device_communicators/shm_object_storage.py", line 719, in put',
               "MemoryError: Not enough space in the data buffer"):
        tr.feed(f"(APIServer pid=1) {ln}")
    assert [(f.kind, f.stream, f.ends_serving) for f in tr.fatal] == [("oom", "api", False)], tr.fatal
    tr.feed("(EngineCore_DP0 pid=5) ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    tr.feed("(Worker_TP0 pid=7) ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert [(f.kind, f.stream, f.ends_serving) for f in tr.fatal[1:]] == [("oom", "engine", True),
                                                                          ("oom", "rank0", True)], tr.fatal
    # an unprefixed line lands in the API server's stream too, but is any process's last words
    tr = SeatTracker(2, [], [])
    tr.feed("terminate called after throwing an instance of 'c10::OutOfMemoryError'")
    for ln in ("Process EngineCore_DP0:", "Traceback (most recent call last):", '  File "x.py", line 1, in run',
               "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"):
        tr.feed(ln)
    assert [(f.kind, f.stream, f.ends_serving) for f in tr.fatal] == [("oom", "api", True)] * 2, tr.fatal


ACTIVE = "LNA2 MoE kernel ACTIVE rank="


def _active(r: int, tp: int = 8, proc: str | None = None) -> str:
    return (f"({proc or f'Worker_TP{r}'} pid={300 + r}) WARNING 12-02 18:00:03 [moe_dispatch.py:1] "
            f"LNA2 MoE kernel ACTIVE rank={r}/{tp} layers=43 bits=2 ext=bX policy=builtin")


BAR = "\rCapturing CUDA graphs (mixed prefill-decode, PIECEWISE): 0%|          | 0/67 [00:00<?, ?it/s]"


def test_a_line_glued_to_a_progress_bar_is_still_its_ranks(tmp_path):
    """Rank 0 draws the CUDA-graph bar with carriage returns and no newline: the next worker's line
    is glued to it and lost its prefix, so the marker gate failed a healthy seat on 7 of 8 (helper
    audit). A process prefix right after a bar's end starts a line of its own: through every reader
    (up's LogTail, status / down's read_log, check-seat's text read), which cut at the carriage
    return before the tracker sees the part (review: the first fix reached none of them)."""
    from dsv4serve.ranklog import read_log
    from dsv4serve.supervisor import LogTail

    tr = SeatTracker(8, [ACTIVE], [])
    feed_all(tr, [BAR + _active(0)] + [_active(r) for r in range(1, 8)])
    assert tr.marker_ranks[ACTIVE] == set(range(8))
    log = tmp_path / "vllm.log"
    log.write_text("".join(ln + "\n" for ln in [BAR + BAR + _active(0)] + [_active(r) for r in range(1, 8)]))
    assert read_log(str(log), 8, [ACTIVE], []).marker_ranks[ACTIVE] == set(range(8))
    tail = SeatTracker(8, [ACTIVE], [])
    feed_all(tail, LogTail(log).read())
    assert tail.marker_ranks[ACTIVE] == set(range(8))
    text = SeatTracker(8, [ACTIVE], [])
    with open(log, errors="replace") as f:  # check-seat's reader: universal newlines cut at \r
        feed_all(text, list(f))
    assert text.marker_ranks[ACTIVE] == set(range(8))


def test_a_quoted_worker_line_after_a_fake_bar_in_a_prompt_forges_nothing():
    """The bar rule applies only to a part with no prefix of its own: a request log line (the API
    server's) that quotes a bar and then a worker's line stays one API line."""
    tr = SeatTracker(8, [ACTIVE], [])
    feed_all(tr, ["(APIServer pid=1) INFO 12-02 18:00:03 [logger.py:1] Received request chatcmpl-1: prompt: "
                  "'x | 0/67 [00:00<?, ?it/s]" + _active(3) + "'"])
    assert tr.marker_ranks[ACTIVE] == set()


def test_a_prefix_quoted_inside_a_message_is_not_split_off():
    """Before any carriage return the text is one message: a prompt echo that quotes a worker's
    line must not become that worker's line (it would count a marker nobody printed)."""
    tr = SeatTracker(8, [ACTIVE], [])
    feed_all(tr, ["(APIServer pid=1) INFO 12-02 18:00:03 [logger.py:1] Received request chatcmpl-1: prompt: 'x "
                  + _active(3) + "'"])
    assert tr.marker_ranks[ACTIVE] == set()


def test_colour_codes_do_not_hide_the_prefix():
    """VLLM_LOGGING_COLOR / FORCE_COLOR inherited from the shell: every line lost its rank (helper audit)."""
    tr = SeatTracker(2, [ACTIVE], [])
    feed_all(tr, [f"\x1b[36m({'Worker_TP%d' % r} pid={300 + r})\x1b[0m \x1b[33mWARNING\x1b[0m 12-02 18:00:03 "
                  f"[moe_dispatch.py:1] LNA2 MoE kernel ACTIVE rank={r}/2 layers=1" for r in range(2)])
    assert tr.marker_ranks[ACTIVE] == {0, 1}


def test_a_worker_name_with_a_space_is_a_rank():
    tr = SeatTracker(8, [ACTIVE], [])
    feed_all(tr, [_active(r, proc=f"VllmWorker TP{r}") for r in range(8)])
    assert tr.marker_ranks[ACTIVE] == set(range(8))


def test_at_tp1_the_engine_process_is_rank_0():
    """With one GPU vLLM runs the worker inside EngineCore: the plugin's rank=0/1 line carries the
    engine's prefix, and a TP 1 seat could never pass its marker gate (helper audit)."""
    tr = SeatTracker(1, [ACTIVE, "dsv4serve plugin ready"], [])
    feed_all(tr, ["(EngineCore_DP0 pid=9) INFO 12-02 18:00:01 [vllm_plugin.py:1] dsv4serve plugin ready rank=0/1",
                  _active(0, tp=1, proc="EngineCore_DP0")])
    assert tr.marker_ranks == {ACTIVE: {0}, "dsv4serve plugin ready": {0}}


def test_kv_tokens_come_from_the_engine_and_never_crash_the_parser():
    """A prompt echoed by the API server overwrote the KV figure; 'KV cache size: ,,, tokens' raised
    out of feed() (status, check-seat and down's cleanup with it) (helper audit)."""
    tr = SeatTracker(2, [], [])
    feed_all(tr, ["(EngineCore_DP0 pid=9) INFO 12-02 18:00:01 [kv_cache_utils.py:1] GPU KV cache size: 120,000 tokens",
                  "(APIServer pid=1) INFO 12-02 18:00:09 [logger.py:1] Received request chatcmpl-1: prompt: "
                  "'GPU KV cache size: 99,999,999 tokens'",
                  "(EngineCore_DP0 pid=9) INFO 12-02 18:00:01 [x.py:1] KV cache size: ,,, tokens"])
    assert tr.kv_tokens == 120000


def test_a_users_prompt_is_no_fatal_and_a_crash_without_a_traceback_is():
    tr = SeatTracker(2, [], ["fell back"])
    feed_all(tr, ["(APIServer pid=1) INFO 12-02 18:00:09 [logger.py:1] Received request chatcmpl-1: prompt: "
                  "'what does CUDA error: an illegal memory access mean? and why fell back'"])
    assert tr.fatal == []
    for line, kind in [
        ("(Worker_TP1 pid=301) terminate called after throwing an instance of 'c10::Error'", "crash"),
        ("(Worker_TP0 pid=300) Fatal Python error: Segmentation fault", "crash"),
        ("(Worker_TP0 pid=300) *** SIGSEGV received at time=1733000000 on cpu 3 ***", "crash"),
        ("(Worker_TP1 pid=301) [rank1]:[E1202 18:00:00] NCCL communicator was aborted on rank 1.", "nccl"),
    ]:
        tr = SeatTracker(2, [], [])
        feed_all(tr, [line])
        assert [f.kind for f in tr.fatal] == [kind], line


def test_an_error_line_quoting_a_marker_is_not_the_marker():
    tr = SeatTracker(2, [ACTIVE], [])
    feed_all(tr, [f"(Worker_TP{r} pid={300 + r}) ERROR 12-02 18:00:03 [x.py:1] expected '{ACTIVE}' but the kernel "
                  "never ran" for r in range(2)])
    assert tr.marker_ranks[ACTIVE] == set()


def test_the_engine_s_kv_line_under_the_api_servers_prefix_counts():
    """With VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine runs in the API server's process: its KV
    line was skipped with every API line, and the KV gate failed (review). Only request echoes are."""
    tr = SeatTracker(1, [], [])
    feed_all(tr, ["(APIServer pid=1) INFO 12-02 18:00:01 [kv_cache_utils.py:1] GPU KV cache size: 4,096 tokens",
                  "(APIServer pid=1) DEBUG 12-02 18:00:09 [request_logger.py:1] Request chatcmpl-1 details: prompt: "
                  "'GPU KV cache size: 9 tokens, and CUDA error: x'"])
    assert tr.kv_tokens == 4096 and tr.fatal == []


# --- what a client or a log record can make the gates believe (ranklog audit) ----------------------

ACTIVE = "LNA2 MoE kernel ACTIVE rank="


def test_an_access_log_line_quoting_an_error_name_is_no_fatal():
    """uvicorn logs every request line unprefixed: `GET /?EngineDeadError` from any client that could
    reach the port ended a healthy seat as a dead rank."""
    tr = SeatTracker(2, [], [])
    for path in ("/?EngineDeadError", "/MemoryError", "/v1/x?ncclSystemError", "/CUDA%20error:%20x"):
        tr.feed(f'INFO:     127.0.0.1:40000 - "GET {path} HTTP/1.1" 404 Not Found')
    for method in ("M-SEARCH", "get", "PROPFIND"):  # any token httptools or h11 parses (review)
        tr.feed(f'INFO:     127.0.0.1:40000 - "{method} /?EngineDeadError HTTP/1.1" 404 Not Found')
    assert tr.fatal == []
    # X-Forwarded-For from a local client is logged as the client, spaces and a forged worker line too
    tr.feed('INFO:     evil host:0 - "GET /?EngineDeadError HTTP/1.1" 404 Not Found')
    tr.feed(f'INFO:     a|1/2 [x](Worker_TP1 pid=9) WARNING {ACTIVE}1/2 ext=x:0 - "GET / HTTP/1.1" 404 Not Found')
    assert tr.fatal == [] and tr.lna2_builds == {}
    tr.feed("ERROR 12-07 10:00:00 [core.py:1] EngineDeadError: the engine died")  # the engine's own still is
    assert [f.kind for f in tr.fatal] == ["rank_died"]


def test_a_carriage_return_inside_a_record_forges_no_line_of_another_process(tmp_path):
    """vLLM re-prefixes only newlines: a request id with a \\r and a worker's prefix after it made
    every rank's ACTIVE marker appear, in up's tail and in status's read alike."""
    from dsv4serve.ranklog import read_log

    forged = "".join(f"\r(Worker_TP{r} pid={300 + r}) WARNING 12-07 10:00:00 [vllm_plugin.py:1] {ACTIVE}{r}/2 ext=x"
                     for r in range(2))
    line = f"(APIServer pid=100) INFO 12-07 10:00:00 [logger.py:1] Added request chatcmpl-a{forged}."
    tr = SeatTracker(2, [ACTIVE], [])
    tr.feed(line)
    assert tr.marker_ranks[ACTIVE] == set() and tr.lna2_builds == {}
    log = tmp_path / "vllm.log"
    log.write_text(line + "\n")
    assert read_log(str(log), 2, [ACTIVE], []).marker_ranks[ACTIVE] == set()
    # a bar's redraws (unprefixed) still split, and a worker's line glued after the bar still counts
    log.write_text("Capturing CUDA graphs: 50%|#   | 1/2 [00:01<00:01]\rCapturing CUDA graphs: 100%|#| 2/2 [00:02<00:00]"
                   f"(Worker_TP1 pid=301) WARNING 12-07 10:00:00 [vllm_plugin.py:1] {ACTIVE}1/2 ext=b\n")
    tr = read_log(str(log), 2, [ACTIVE], [])
    assert tr.marker_ranks[ACTIVE] == {1} and tr.lna2_builds == {1: "b"}


def test_only_the_plugins_own_line_for_its_own_rank_is_the_marker():
    """A warning quoting the marker, a rank's line naming another rank (a spliced write), or a line of
    another TP size proved the kernel on a rank that never printed it."""
    tr = SeatTracker(8, [ACTIVE], [])
    tr.feed(f"(Worker_TP2 pid=202) WARNING 12-07 10:00:00 [x.py:1] expected '{ACTIVE}4/8' in the log")
    tr.feed(f"(Worker_TP2 pid=202) WARNING 12-07 10:00:00 [x.py:1] {'x' * 50}(Worker_TP5 pid=205) WARNING "
            f"{ACTIVE}5/8 ext=b")
    tr.feed(f"(Worker_TP3 pid=203) WARNING 12-07 10:00:00 [vllm_plugin.py:1] {ACTIVE}5/8 ext=b")
    tr.feed(f"(Worker_TP4 pid=204) WARNING 12-07 10:00:00 [vllm_plugin.py:1] {ACTIVE}4/2 ext=b")
    assert tr.marker_ranks[ACTIVE] == set() and tr.lna2_builds == {}
    tr.feed(f"(Worker_TP4 pid=204) WARNING 12-07 10:00:00 [vllm_plugin.py:1] {ACTIVE}4/8 ext=b")
    assert tr.marker_ranks[ACTIVE] == {4} and tr.lna2_builds == {4: "b"}
    other = SeatTracker(2, ["Graph capturing finished"], [])  # another program's text: anywhere in the line
    other.feed("(Worker_TP1 pid=1) INFO 12-07 10:00:00 [gpu_model_runner.py:1] Graph capturing finished in 5 secs")
    assert other.marker_ranks["Graph capturing finished"] == {1}


def test_gpu_plus_host_kv_is_not_gpu_kv():
    """With HiSparse vLLM prints the GPU + host figure (instead of the GPU one): the gate counted host
    memory. Both lines are fed here to show each goes where it belongs."""
    tr = SeatTracker(1, [], [])
    tr.feed("(EngineCore pid=1) INFO 12-07 10:00:00 [kv_cache_utils.py:1] GPU KV cache size: 395,069 tokens")
    tr.feed("(EngineCore pid=1) INFO 12-07 10:00:00 [kv_cache_utils.py:1] GPU + host KV cache size: 1,900,000 tokens")
    assert tr.kv_tokens == 395069 and tr.kv_host_tokens == 1900000  # kept apart, for the message that names it
    tr.feed("(EngineCore pid=1) INFO 12-07 10:00:00 [kv_cache_utils.py:1] XPU + host KV cache size: 2,000,000 tokens")
    assert tr.kv_tokens == 395069 and tr.kv_host_tokens == 2000000


def test_a_line_still_being_written_trips_no_gate(tmp_path):
    """Half a benign decline line (`... above t`) matches the forbidden pattern the whole line does not."""
    from dsv4serve.ranklog import read_log

    pat = r"LNA2 declined: (?!rows=\d+ above the ceiling)"
    log = tmp_path / "vllm.log"
    log.write_text("(Worker_TP0 pid=1) WARNING 12-07 10:00:00 [vllm_plugin.py:1] LNA2 declined: rows=512 above t")
    assert read_log(str(log), 1, [], [pat]).fatal == []
    log.write_text("(Worker_TP0 pid=1) WARNING 12-07 10:00:00 [vllm_plugin.py:1] LNA2 declined: x dtype is bad\n")
    assert [f.kind for f in read_log(str(log), 1, [], [pat]).fatal] == ["forbidden"]


def test_up_s_log_tail_keeps_a_records_carriage_returns_and_hands_over_a_bars_redraws(tmp_path):
    from dsv4serve.supervisor import LogTail

    log = tmp_path / "vllm.log"
    tail = LogTail(log)
    log.write_bytes(b"(APIServer pid=1) INFO 12-07 10:00:00 [x.py:1] Added request a\r(Worker_TP0 pid=2) forged\n"
                    b"Loading safetensors checkpoint shards:  10% Completed | 5/51 [00:05<00:50]\rLoading saf")
    assert tail.read() == ["(APIServer pid=1) INFO 12-07 10:00:00 [x.py:1] Added request a\r(Worker_TP0 pid=2) forged",
                           "Loading safetensors checkpoint shards:  10% Completed | 5/51 [00:05<00:50]\r"]
    with open(log, "ab") as f:
        f.write(b"etensors checkpoint shards: 100% Completed | 51/51 [00:50<00:00]\n")
    assert tail.read() == ["Loading safetensors checkpoint shards: 100% Completed | 51/51 [00:50<00:00]"]


def test_up_s_log_tail_reads_a_truncated_or_replaced_log_from_its_start(tmp_path):
    """After a copytruncate the offset lay past the end: every later line, a CUDA error included, went
    unseen until the file grew past it (ranklog audit)."""
    from dsv4serve.supervisor import LogTail

    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=1) INFO 12-07 10:00:00 [x.py:1] a long first line of the log\n")
    tail = LogTail(log)
    assert len(tail.read()) == 1
    log.write_text("CUDA error: an illegal memory access\n")  # truncated in place, shorter
    assert tail.read() == ["CUDA error: an illegal memory access"]
    other = tmp_path / "new.log"
    other.write_text("x" * 200 + "\nRuntimeError: replaced\n")
    other.replace(log)  # a new file at the path, longer than the offset
    assert tail.read() == ["x" * 200, "RuntimeError: replaced"]


def test_a_bar_prefixed_as_raw_output_still_splits_and_the_line_glued_after_it_counts(tmp_path):
    """The seat image's vLLM (0.28) prefixes each raw line of stdout / stderr, a tqdm bar included:
    `(Worker_TP0 pid=N) \\r<bar>\\r<bar>` with rank 3's ACTIVE line glued after the last redraw. Read
    as one record (review), rank 3's marker was never seen: the canon seat could not come up."""
    from dsv4serve.ranklog import finished_redraws, read_log

    for sep in (" ", ""):
        line = (f"(Worker_TP0 pid=200){sep}\rCapturing CUDA graphs:  33%|###   | 1/3 [00:01<00:02]"
                "\rCapturing CUDA graphs:  67%|######| 2/3 [00:02<00:01]"
                f"(Worker_TP3 pid=203) WARNING 12-07 10:00:00 [vllm_plugin.py:1] {ACTIVE}3/8 ext=b")
        log = tmp_path / "vllm.log"
        log.write_text(line + "\n")
        tr = read_log(str(log), 8, [ACTIVE], [])
        assert tr.marker_ranks[ACTIVE] == {3} and tr.lna2_builds == {3: "b"}, sep
        partial = f"(Worker_TP0 pid=200){sep}\rLoading: 10% | 5/51 [00:05<00:50]\rLoad".encode()
        assert finished_redraws(partial) == partial[:partial.rfind(b"\r") + 1]
    assert finished_redraws(b"(APIServer pid=1) INFO x\ry\rz") == b""  # a record's text stays whole


def test_a_seat_that_reports_only_gpu_plus_host_kv_is_told_so_not_that_vllm_said_nothing():
    """With HiSparse vLLM prints only the GPU + host figure: the gate cannot pass, and it said vLLM
    never reported a KV size (review)."""
    from types import SimpleNamespace

    from dsv4serve.supervisor import Supervisor

    tr = SeatTracker(1, [], [])
    tr.feed("(EngineCore pid=1) INFO 12-07 10:00:00 [kv_cache_utils.py:1] GPU + host KV cache size: 1,900,000 tokens")
    fake = SimpleNamespace(profile=SimpleNamespace(kv_min_tokens=lambda: 389120), tracker=tr)
    why, hint = Supervisor._kv_problem(fake, final=True)
    assert why.startswith("vLLM reported only its GPU + host KV cache size (1,900,000 tokens, HiSparse)")
    assert "kv_cache_min_tokens" in hint
    assert Supervisor._kv_problem(fake, final=False) is None
