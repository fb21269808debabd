"""`dsv4serve kernel check` (dsv4serve.lna2.selfcheck): the verdicts on CPU, the refusals for real.

The CUDA kernel cannot run on this machine, so the checking logic runs against stand-in runners
(each says so) that compute the op with the pure-PyTorch reference, faithfully or with one planted
fault; the device call runs the real command (lna2_device.sh step `kcheck`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dsv4serve.errors import BadInput
from dsv4serve.lna2 import policy, selfcheck
from dsv4serve.lna2.reference import moe_reference

SMALL = dict(hidden=1024, inter=256, experts=16, top_k=4, codebooks=["mcg"])


class ReferenceRunner:
    """A stand-in for lna2's CUDA kernel (which needs a GPU): the op by the pure-PyTorch reference
    in fp32, written into `out` like the kernel. `fault(variant, out, calls)` may then spoil it."""

    def __init__(self, layer, fault=None):
        self.layer, self.fault, self.calls = layer, fault, 0

    def __call__(self, x, ids32, w32, out, variant):
        self.calls += 1
        out.copy_(moe_reference(x, self.layer, ids32.long(), w32, 10.0, torch.float32).to(out.dtype))
        if self.fault:
            self.fault(variant, out, self.calls)
        return out


def run_check(rows, bits=(2,), fault=None, timer=None, grapher=None, **kw):
    spec = selfcheck.CheckSpec(**{**SMALL, **kw}, rows=list(rows), bits=list(bits), bench=timer is not None)
    return selfcheck.check(spec, torch.device("cpu"), lambda layer: ReferenceRunner(layer, fault), timer,
                           grapher=grapher)


def direct(launch):
    """A stand-in for CUDA graph capture (no GPU here): a replay is the launch itself, reading
    whatever the static buffers hold, which is what a correct capture does."""
    return launch


def stale(launch):
    """A stand-in for a capture gone wrong: a replay rewrites the output of the capture-time inputs,
    as a kernel that baked its inputs into the graph would."""
    out = launch()
    snap = out.clone()
    return lambda: out.copy_(snap)


def test_a_faithful_kernel_passes_and_each_case_names_the_policy_pick():
    rep = run_check([1, 2, 5], bits=(2, 3))
    assert rep.ok and len(rep.cases) == 6
    for c in rep.cases:
        p = c.pick
        assert c.ok and p.finite and p.repeat and p.error is None and not p.fault and p.worst_rel < 1e-5
        # the output of x's own type (the dispatch's) is checked too, at its rounding
        assert 1e-5 < p.worst_rel_x < selfcheck.HALF_TOL
        assert c.variant == policy.variant_for(c.rows, 256, c.K, 1024)
        assert c.x_dtype == ("bfloat16" if c.rows % 2 == 0 else "float16")
    assert {(c.K, c.rows): c.variant for c in rep.cases}[(3, 2)] == policy.CLUSTER_VARIANT
    doc = json.loads(rep.model_dump_json())
    assert doc["cases"][0]["pick"]["worst_rel"] < 1e-5 and doc["spec"]["hidden"] == 1024 and doc["aborted"] is None


@pytest.mark.parametrize("fault, verdict", [
    # one row 1 % off the reference in its first column block
    (lambda v, out, n: out[0, :128].mul_(1.3), "off the reference"),
    (lambda v, out, n: out[-1].fill_(float("nan")), "NaN/Inf"),
    # the second run differs in one bit-level place
    (lambda v, out, n: out[0, 0].add_(1e-6 * (n % 2)), "not repeatable"),
])
def test_each_planted_fault_fails_its_case(fault, verdict):
    rep = run_check([3], fault=fault)
    (c,) = rep.cases
    assert not rep.ok and not c.ok
    assert selfcheck.table_rows(rep)[0][7] == verdict


def test_only_the_half_precision_output_off_fails_the_case():
    """An fp32 store that is right and a 16-bit store that is not (the dispatch's output type)."""
    def bad_half(v, out, n):
        if out.dtype != torch.float32:
            out[0].mul_(1.05)

    (c,) = run_check([1], fault=bad_half).cases
    assert not c.ok and c.pick.worst_rel < 1e-5 and c.pick.worst_rel_x > selfcheck.HALF_TOL


def test_a_refusal_is_a_failed_case_with_its_message_and_strict_json():
    def refuse(v, out, n):  # the binding's argument checks raise ValueError (TORCH_CHECK_VALUE)
        raise ValueError("lna2_moe_decode: something the binding refused\n(traceback follows)")

    rep = run_check([1, 2], fault=refuse)
    assert [c.pick.error for c in rep.cases] == ["lna2_moe_decode: something the binding refused"] * 2
    assert not rep.ok and rep.aborted is None and not rep.cases[0].pick.fault
    # no Infinity/NaN literals: jq and JSON.parse refuse them
    def no_constants(name):
        raise AssertionError(f"{name} in the JSON")

    doc = json.loads(rep.model_dump_json(), parse_constant=no_constants)
    assert doc["cases"][0]["pick"]["worst_rel"] is None


def test_a_device_fault_stops_the_check_where_it_happened():
    """After a CUDA error the context is unusable: the report names the case and runs no more."""
    def fault(v, out, n):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    rep = run_check([1, 2, 4], fault=fault)
    assert len(rep.cases) == 1 and rep.cases[0].pick.fault and not rep.ok
    assert rep.aborted.startswith("a device fault at K2 mcg 1 row;")


def test_bench_times_only_correct_builds_and_names_the_fastest():
    """The timer is a stand-in too (no GPU clock here): it returns set medians per variant, so what is
    tested is which builds get timed and what the report concludes. `--also 46,36` adds two builds
    beside the policy's (v59, v55); v36 computes wrong."""
    set_us = {59: 20.0, 55: 25.0, 46: 18.0, 36: 30.0}
    timed: list[set[int]] = []

    def timer(fns):
        timed.append(set(fns))
        for fn in fns.values():  # the launches the real timer makes
            fn()
        return {v: set_us[v] for v in fns}

    def wrong_36(v, out, n):
        if v == 36:
            out.mul_(1.1)

    rep = run_check([1], fault=wrong_36, timer=timer, also=[46, 36])
    (c,) = rep.cases
    assert c.variant == policy.CLUSTER_VARIANT == 59 and c.ok
    assert c.failed_variants == [36] and not rep.ok  # a build the check ran is wrong here
    assert timed == [{59, 55, 46}] and c.timings_us == {59: 20.0, 55: 25.0, 46: 18.0}
    assert c.fastest == 46
    assert selfcheck.table_rows(rep)[0][-2:] == ["20.0", "v46 18.0 (1.11x); off: v36"]


def test_when_the_pick_is_fastest_the_report_says_so():
    rep = run_check([1], timer=lambda fns: {v: (10.0 if v == policy.CLUSTER_VARIANT else 50.0) for v in fns})
    assert rep.ok and rep.cases[0].fastest == policy.CLUSTER_VARIANT
    assert selfcheck.table_rows(rep)[0][-1] == "the pick"


def test_candidates_are_the_pick_then_the_other_served_builds_that_take_the_shape():
    spec = selfcheck.CheckSpec()
    assert selfcheck.candidates(1, spec, 2) == [59, 55]
    assert selfcheck.candidates(24, spec, 3) == [55, 59]  # K3 past 8 rows: the fallback serves
    tp1 = selfcheck.CheckSpec(inter=2048)
    assert selfcheck.candidates(8, tp1, 2) == [policy.SEAT_VARIANT]  # the cluster kernel does not take TP1


def test_also_adds_builds_the_policy_does_not_serve_where_they_fit():
    """`--also 53` times v53 beside the policy's builds (the two-CTA question of the seat's cards);
    where the card's fit says it cannot launch, it is left out like any other."""
    spec = selfcheck.CheckSpec(also=[53, 53, 54])
    assert spec.also == [53, 54]
    assert selfcheck.candidates(16, spec, 2) == [55, 59, 53, 54]
    assert selfcheck.candidates(16, spec, 2, {55: 32, 59: 32, 53: 16, 54: 0}) == [55, 59, 53]
    with pytest.raises(BadInput, match="--also times other builds beside the policy's: it needs --bench"):
        selfcheck.parse_spec(4096, 256, 256, 6, "2", "mcg", "16", 0, False, 30, "53")
    with pytest.raises(BadInput, match="--also"):
        selfcheck.parse_spec(4096, 256, 256, 6, "2", "mcg", "16", 0, True, 30, "5x")
    assert selfcheck.parse_spec(4096, 256, 256, 6, "2", "mcg", "16", 0, True, 30, "53").also == [53]


def test_every_build_the_policy_serves_for_the_shape_is_a_candidate():
    """The check compares the pick with each build the dispatch could serve for the layer, so a build
    the policy gains is timed here without a second list to update."""
    for spec in (selfcheck.CheckSpec(), selfcheck.CheckSpec(inter=2048), selfcheck.CheckSpec(hidden=2048, inter=512)):
        want = set(policy.served(spec.inter, spec.hidden))
        for rows in (1, 2, 4, 8, 12, 16, 24):
            for K in (2, 3):
                got = selfcheck.candidates(rows, spec, K)
                assert set(got) == want and len(got) == len(want), (spec, rows, K, got)
                assert got[0] == policy.variant_for(rows, spec.inter, K, spec.hidden)


def test_on_a_99_kb_card_the_check_runs_what_the_dispatch_would():
    """With the card's fit (an sm_120's, where the cluster kernel's K3 builds do not fit), the pick is
    the dispatch's (v59 at one K3 row, v55 from two) and builds that cannot launch are not candidates."""
    spec = selfcheck.CheckSpec(also=[26, 36])
    fit3 = {26: 0, 36: 1, 59: 1, 55: 24}
    assert selfcheck.candidates(1, spec, 3, fit3) == [59, 55, 36]
    assert selfcheck.candidates(2, spec, 3, fit3) == [55]
    asked = []

    def fitter(K, cb):
        asked.append((K, cb))
        return fit3 if K == 3 else {26: 24, 36: 24, 59: 24, 55: 24}

    spec = selfcheck.CheckSpec(hidden=1024, inter=256, experts=8, bits=[3], codebooks=["mcg"], rows=[1, 2])
    rep = selfcheck.check(spec, torch.device("cpu"), lambda layer: ReferenceRunner(layer, None), None, "cpu",
                          fitter=fitter)
    assert asked == [(3, "mcg")] and [c.variant for c in rep.cases] == [59, 55] and rep.ok
    # where even v55 does not fit, the case says so and launches nothing, as the dispatch declines
    launched = []

    def runner(layer):
        inner = ReferenceRunner(layer, None)
        return lambda *a: (launched.append(a[-1]), inner(*a))[1]

    rep = selfcheck.check(spec, torch.device("cpu"), runner, None, "cpu", fitter=lambda K, cb: {55: 1, 59: 1})
    (one, two) = rep.cases
    assert one.ok and one.variant == 59 and launched and set(launched) == {59}
    assert not two.ok and two.variant == 55 and not rep.ok
    assert two.pick.error == ("v55 does not fit this card's shared memory per block at 2 rows (it fits 1); the "
                              "dispatch declines such calls to the incumbent")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dsv4serve", "kernel", "check", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cli_without_a_gpu_says_so_and_fails():
    r = _cli("--json")
    assert r.returncode == 1
    assert "no CUDA GPU" in r.stderr and "seat's machine" in r.stderr
    assert json.loads(r.stdout)["error"]["exit_code"] == 1


@pytest.mark.parametrize("args, phrase", [
    (["--bits", "4"], "--bits 4: lna2 decodes K 2 and 3"),
    (["--rows", "0,1"], "--rows 0,1: each must be >= 1"),
    (["--rows", "x"], "--rows 'x' is not a comma-separated list of integers"),
    (["--rows", "\u0663"], "is not a comma-separated list of integers"),  # an Arabic-Indic 3: int() takes it
    (["--rows", ""], "--rows '' is not a comma-separated list of integers"),
    (["--seed", "18446744073709552"], "--seed 18446744073709552: Input should be less than or equal to 4294967295"),
    (["--inter", "100"], "--inter 100: must be a positive multiple of 128"),
    (["--codebook", "foo"], "--codebook foo: lna2 takes mcg, mul1"),
    (["--top-k", "6", "--experts", "4"], "--experts 4 is below --top-k 6"),
])
def test_cli_refuses_bad_flags_before_touching_a_gpu(args, phrase):
    r = _cli(*args)
    assert r.returncode == 2 and phrase in r.stderr and r.stderr.count("\n") == 1


class RecordingExt:
    """A stand-in for the built extension (needs CUDA): records what lna2_moe_decode is handed."""

    def __init__(self):
        self.calls = []

    def lna2_moe_scratch_bytes(self, hidden, inter):
        return 4096

    def lna2_moe_decode(self, *args):
        self.calls.append(args)


def test_the_gpu_runner_hands_the_binding_what_the_dispatch_does():
    """Lna2Runner's call, argument by argument: the order moe_dispatch.Runtime._launch uses (which
    the device's dispatch step runs against the real binding), tables per expert in TABLES order."""
    from dsv4serve.lna2.reference import random_expert_layer
    from dsv4serve.moe_dispatch import TABLES

    layer = random_expert_layer(4, 1024, 256, 3, "mul1", seed=1)
    ext = RecordingExt()
    runner = selfcheck.Lna2Runner(ext, layer, torch.device("cpu"), 10.0)
    x, out = torch.zeros(2, 1024, dtype=torch.bfloat16), torch.zeros(2, 1024, dtype=torch.bfloat16)
    ids, w = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4)
    assert runner(x, ids, w, out, 46) is out
    (args,) = ext.calls
    assert args[0] is x and args[1] is out and len(args) == 2 + 9 + 8
    for table, name in zip(args[2:11], TABLES):
        t = getattr(layer, name)
        assert table.dtype == torch.int64 and table.tolist() == [t[e].data_ptr() for e in range(4)]
    assert args[11] is ids and args[12] is w
    assert args[13] == 3 and args[14] == 10.0 and args[15].numel() == 4096 and not args[15].any()
    assert args[16:] == (256, selfcheck.CODEBOOKS["mul1"], 46)


def test_a_live_seat_on_the_gpu_is_found_by_uuid_in_either_spelling(tmp_path, monkeypatch):
    """`kernel check` refuses a GPU a running seat holds: torch spells the UUID bare, NVML (what
    `up` records) with a GPU- prefix."""
    import os
    import time

    import psutil

    from dsv4serve import state

    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path))
    me = psutil.Process()
    uuid = "8c6f1a2b-3c4d-5e6f-7a8b-9c0d1e2f3a4b"

    def seat(name, **kw):
        state.save(state.SeatState(seat=name, run_id=f"{name}-{os.getpid()}-{time.time_ns()}", profile=name,
                                   profile_digest="x", runtime="native", argv=["python"], env={}, host="127.0.0.1",
                                   port=1, served_name="m", tp=1, run_dir="/nonexistent", log_path="/nonexistent/l",
                                   phase="ready", **kw))

    assert selfcheck.seat_using(uuid) is None
    seat("other", pid=me.pid, start_time=me.create_time(), gpu_uuids=["GPU-00000000-0000-0000-0000-000000000000"])
    seat("gone", pid=None, gpu_uuids=[f"GPU-{uuid}"])  # no live process: not a holder
    assert selfcheck.seat_using(uuid) is None
    seat("s8", pid=me.pid, start_time=me.create_time(), gpu_uuids=[f"GPU-{uuid.upper()}"])
    assert selfcheck.seat_using(uuid) == f"s8 (pid {me.pid})"


def test_the_pick_is_captured_and_replayed_with_fresh_inputs():
    rep = run_check([1, 2], grapher=direct)
    assert rep.ok
    for c in rep.cases:
        assert c.pick.graph_checked and c.pick.graph_error is None and c.pick.graph_worst_rel < selfcheck.HALF_TOL


def test_a_replay_that_ignores_fresh_inputs_fails_and_a_capture_fault_stops_the_check():
    (c,) = run_check([3], grapher=stale).cases
    assert not c.ok and c.pick.graph_worst_rel > selfcheck.HALF_TOL
    assert selfcheck.table_rows(run_check([3], grapher=stale))[0][7] == "graph replay off"

    def refuse_capture(launch):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    rep = run_check([1, 2], grapher=refuse_capture)
    assert len(rep.cases) == 1 and rep.cases[0].pick.graph_error.startswith("CUDA error") and rep.aborted


def test_a_build_of_older_sources_is_a_one_line_refusal(monkeypatch):
    """A build from before lna2_moe_fit made `kernel check` a traceback (an AttributeError in the fit
    query; with --json no document) (helper audit): it is checked against what the dispatch calls.
    torch.cuda is stood in for (no GPU here): the refusal comes before any device work."""
    from types import SimpleNamespace

    from dsv4serve.errors import JobFailed
    from dsv4serve.lna2 import loader

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    old = SimpleNamespace(lna2_moe_decode=None, lna2_moe_max_rows=None, lna2_moe_scratch_bytes=None,
                          lna2_moe_info=None)
    monkeypatch.setattr(loader, "load", lambda: old)
    spec = selfcheck.parse_spec(4096, 256, 256, 6, "2", "mcg", "1", 0, False, 30)
    with pytest.raises(JobFailed, match="the lna2 extension lacks lna2_moe_fit"):
        selfcheck.run(spec)
