"""The per-card lna2 tuning table (dsv4serve.lna2.tuning): made from a `kernel check --bench`
report, saved and read back, refused where it does not belong, and served by the dispatch.

The check's runner, timer and graph capture are stand-ins here (no GPU: tests/test_kernel_check.py
says what each does); so is the dispatch's extension (tests/test_moe_dispatch.py's FakeExt). The
real command ran on a GPU in the device call recorded in issue 8's note."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from dsv4serve import launch
from dsv4serve import moe_dispatch as md
from dsv4serve.errors import ProfileError
from dsv4serve.lna2 import policy, selfcheck, tuning
from dsv4serve.lna2.reference import moe_reference
from dsv4serve.profile import load_profile
from tests.test_moe_dispatch import CEILING, E, H, I, TOP_K, Harness

SMALL = dict(hidden=1024, inter=256, experts=16, top_k=4, codebooks=["mcg"])
CARD = dict(device="NVIDIA RTX PRO 2000 Blackwell", capability="12.0", sm_count=34, build_id="b1")


def measured(picks, base=None, **kw):
    """A table whose picks were timed where they serve (as from_report writes it): the pick at
    10 us, the policy's pick (`base`, default the pick itself) at 11."""
    base = base or picks
    timings = {k: {r: {v: 10.0, base[k][r]: 11.0} if base[k][r] != v else {v: 10.0} for r, v in rows.items()}
               for k, rows in picks.items()}
    return tuning.TuningTable(**{**CARD, "hidden": 4096, "inter": 256, "experts": 256, "top_k": 6, "reps": 30,
                                 **kw}, picks=picks, policy_picks=base, timings_us=timings)


class Runner:
    """A stand-in for lna2's CUDA kernel: the op by the fp32 reference; remembers the last build."""

    def __init__(self, layer):
        self.layer, self.last = layer, None

    def __call__(self, x, ids32, w32, out, variant):
        self.last = variant
        out.copy_(moe_reference(x, self.layer, ids32.long(), w32, 10.0, torch.float32).to(out.dtype))
        return out


def check(rows, set_us, stale_for=(), bits=(2,), also=()):
    """A bench report whose timer returns `set_us[rows][variant]` (a stand-in clock), and whose graph
    capture replays the launch (a stand-in for CUDA graphs) except for the builds in `stale_for`,
    whose replays rewrite their capture-time output (a capture gone wrong). `also`: builds timed
    beside the policy's (`--also`)."""
    runners = []

    def make(layer):
        runners.append(Runner(layer))
        return runners[-1]

    def grapher(launch_fn):
        out = launch_fn()
        if runners[-1].last in stale_for:
            snap = out.clone()
            return lambda: out.copy_(snap)
        return launch_fn

    rows_of = iter(r for _ in bits for r in rows)

    def timer(fns):
        table = set_us[next(rows_of)]
        return {v: table.get(v, 99.0) for v in fns}

    spec = selfcheck.CheckSpec(**SMALL, rows=list(rows), bits=list(bits), bench=True, also=list(also))
    return selfcheck.check(spec, torch.device("cpu"), make, timer, grapher=grapher)


def test_a_build_replaces_the_pick_only_past_the_margin_and_after_a_graph_replay():
    us = {1: {59: 20.0, 46: 18.0, 55: 25.0, 36: 30.0},   # v46 10 % faster than the pick (v59)
          2: {59: 25.0, 36: 24.6, 55: 26.0, 46: 27.0},   # v36 1.6 % faster than v59: inside the margin
          4: {59: 40.0, 55: 30.0, 36: 41.0, 46: 42.0}}   # v55 25 % faster, but its replay is stale
    rep = check([1, 2, 4], us, stale_for={55}, also=(46, 36))
    assert rep.ok
    by_rows = {c.rows: c for c in rep.cases}
    assert (by_rows[1].fastest, by_rows[1].fastest_graph_ok) == (46, True)
    assert by_rows[2].fastest_graph_ok is True and by_rows[4].fastest_graph_ok is False
    t = tuning.from_report(rep, **CARD)
    assert t.picks == {"K2/mcg": {1: 46, 2: 59, 4: 59}}
    assert t.timings_us["K2/mcg"][1] == {59: 20.0, 46: 18.0, 55: 25.0, 36: 30.0}
    assert (t.hidden, t.inter, t.experts, t.top_k, t.margin) == (1024, 256, 16, 4, tuning.DEFAULT_MARGIN)
    assert t.changes() == [("K2/mcg", 1, 59, 46, 20.0, 18.0)]


def test_no_table_from_a_check_that_failed_or_did_not_time():
    def wrong_pick(layer):
        r = Runner(layer)

        def run(x, ids32, w32, out, variant):
            r(x, ids32, w32, out, variant)
            return out.mul_(1.1) if variant == policy.CLUSTER_VARIANT else out
        return run

    spec = selfcheck.CheckSpec(**SMALL, rows=[1], bits=[2], bench=True)
    failed = selfcheck.check(spec, torch.device("cpu"), wrong_pick, lambda fns: {v: 1.0 for v in fns})
    assert not failed.ok
    with pytest.raises(tuning.TuningError, match="did not pass"):
        tuning.from_report(failed, **CARD)
    plain = selfcheck.check(selfcheck.CheckSpec(**SMALL, rows=[1], bits=[2]), torch.device("cpu"), Runner)
    with pytest.raises(tuning.TuningError, match="needs --bench"):
        tuning.from_report(plain, **CARD)
    # the CLI's own path: a report off a GPU names why no table was written
    assert "did not run on a GPU" in selfcheck.save_tuning(plain, __import__("pathlib").Path("/nonexistent/t.json"))[
        "refused"]


def test_saved_atomically_read_back_with_the_digest_of_its_bytes(tmp_path):
    rep = check([1], {1: {59: 20.0, 46: 18.0}}, also=(46,))
    rep.card = dict(CARD)
    path = tmp_path / "sub" / "t.json"
    out = selfcheck.save_tuning(rep, path)
    assert out["path"] == str(path.resolve()) and out["changes"] == [
        "K2/mcg 1 row: v46 instead of v59 (18.0 against 20.0 µs)"]
    data = path.read_bytes()
    assert out["digest"] == hashlib.sha256(data).hexdigest()[:12]
    assert sorted(p.name for p in path.parent.iterdir()) == ["t.json"]  # no temp file left behind
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    table, digest = tuning.load(path)
    assert digest == out["digest"] and table.picks == {"K2/mcg": {1: 46}} and table.device == CARD["device"]
    assert json.loads(data)["format"] == tuning.FORMAT


@pytest.mark.parametrize("content, phrase", [
    (None, "missing"),
    (b"{not json", "not JSON"),
    (b'{"format": "dsv4serve-lna2-tuning/9"}', "this dsv4serve reads dsv4serve-lna2-tuning/1"),
    (b"[]", "(top level)"),
    ("picks", "picks: Value error, key 'K4/mcg'"),
    ("extra", "surprise: Extra inputs are not permitted"),
    ("sm", "sm_count: Input should be greater than or equal to 1"),
    # a key that timed nothing: the ACTIVE line said policy=tuned while nothing was tuned (helper audit)
    ("empty", "picks: Value error, K2/mcg: no row counts"),
])
def test_a_bad_table_is_one_line_naming_the_field(tmp_path, content, phrase):
    good = json.loads(tuning.dumps(measured({"K2/mcg": {1: 26}})))
    path = tmp_path / "t.json"
    if content == "picks":
        good["picks"] = {"K4/mcg": {"1": 26}}
    elif content == "extra":
        good["surprise"] = 1
    elif content == "sm":
        good["sm_count"] = 0
    elif content == "empty":
        good["picks"] = {"K2/mcg": {}}
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(json.dumps(good))
    with pytest.raises(tuning.TuningError) as e:
        tuning.load(path)
    text = str(e.value)
    assert str(path) in text and "\n" not in text
    assert phrase.replace("Value error, ", "") in text


@pytest.mark.parametrize("build, in_table, in_check", [
    *((v, f"v{v} is a timing ablation", f"v{v} is a timing ablation") for v in (10, 13, 17, 19)),
    *((v, f"v{v} is no lna2 build a table may serve", f"v{v} is no build this check can size and serve")
      for v in (5, 52, 99, 0, 1)),
])
def test_a_build_a_table_or_a_check_may_not_name_is_refused_before_serving(tmp_path, build, in_table, in_check):
    """v10-v13 and v17-v19 skip a stage by design: a table naming one (hand-edited, with a timing
    beside it) loaded and the dispatch served it under strict 2, and `--also` timed them into one.
    An unknown number "fits" in the binding's sizing (it falls back to another build) and its launch
    refuses it: a table naming v52 passed a strict load and died on the first decode, and `--also
    52` failed the whole check. v0 / v1 have no fit query (helper audits)."""
    good = json.loads(tuning.dumps(measured({"K2/mcg": {1: 26}})))
    good["picks"]["K2/mcg"]["1"] = build
    good["timings_us"]["K2/mcg"]["1"][str(build)] = 5.0
    path = tmp_path / "t.json"
    path.write_text(json.dumps(good))
    with pytest.raises(tuning.TuningError, match=in_table):
        tuning.load(path)
    with pytest.raises(selfcheck.BadInput, match=in_check):
        selfcheck.parse_spec(4096, 256, 256, 6, "2", "mcg", "16", 0, True, 30, f"53,{build}")
    h = Harness()
    assert h.rt._fit_extra(h.ext, None, [build]) == {build: 0}  # asked of no extension


def test_a_table_nested_past_the_json_parser_is_a_tuning_error():
    with pytest.raises(tuning.TuningError, match="not JSON"):
        tuning.parse(b"[" * 100000, "t.json")


def test_a_table_knows_its_card_build_and_shape():
    t = measured({"K2/mcg": {1: 55, 16: 53}, "K3/mcg": {1: 55}})
    assert t.mismatch(CARD["device"], 34, "b1") is None
    assert "measured on a NVIDIA RTX PRO 2000 Blackwell (34 SMs), this is a NVIDIA H100 80GB HBM3 (132 SMs)" in \
        t.mismatch("NVIDIA H100 80GB HBM3", 132, "b1")
    assert "timed lna2 build b1, this extension is build b2" in t.mismatch(CARD["device"], 34, "b2")
    assert t.for_layer(2, 1, 4096, 256, 6, 256) == {1: 55, 16: 53}
    assert t.for_layer(3, "mcg", 4096, 256, 6, 256) == {1: 55}
    assert t.for_layer(2, 2, 4096, 256, 6, 256) is None  # MUL1 was not measured
    assert t.for_layer(2, 1, 4096, 2048, 6, 256) is None  # nor TP1's slice


def test_the_policy_takes_a_tuned_build_only_where_it_fits():
    tuned = {1: 55, 16: 53}
    assert policy.variant_for(1, 256, 2, 4096, None, tuned) == 55
    assert policy.variant_for(2, 256, 2, 4096, None, tuned) == policy.variant_for(2, 256, 2, 4096)  # not measured
    fit = {26: 32, 36: 32, 46: 32, 55: 32, 53: 11}
    assert policy.variant_for(16, 256, 2, 4096, fit, tuned) == policy.variant_for(16, 256, 2, 4096, fit)
    assert policy.variant_for(16, 256, 2, 4096, {**fit, 53: 16}, tuned) == 53


# --- the dispatch --------------------------------------------------------------------------------


def _table(tmp_path, picks, **over):
    t = measured(picks, **{**dict(device="Stand-in Card", capability="12.0", sm_count=34, build_id="fake-0",
                                  hidden=H, inter=I, experts=E, top_k=TOP_K), **over})
    path = tmp_path / "tuning.json"
    digest = tuning.save(t, path)
    return str(path), digest


def test_the_dispatch_serves_the_cards_table_and_says_so(tmp_path):
    path, digest = _table(tmp_path, {"K2/mcg": {1: 53, 3: 46}})
    h = Harness(tuning=path, strict=1)
    h.prepare()
    for rows in (1, 2, 3):
        out, want = h.call(0, rows)
        torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2e-2)
    # 53 is no build the policy serves: it is served because the table names it and it fits
    assert [s["variant"] for s in h.ext.seen] == [53, policy.variant_for(2, I, 2, H), 46]
    assert (53, 2, 1, H, I, TOP_K, E) in h.ext.fit_queries
    # the line says which row counts the table decides: the others are the built-in policy's (audit)
    assert h.grep("ACTIVE") == [f"LNA2 MoE kernel ACTIVE rank=0/1 layers=2 bits=2 ext=fake-0 policy=tuned:{digest} "
                                "tuned_rows=1,3 tuned_layers=2/2"]
    assert md._spans([1, 2, 3, 4, 8, 12, 13]) == "1-4,8,12-13" and md._spans([]) == "-"


def test_a_tuned_build_that_does_not_fit_leaves_those_rows_to_the_policy(tmp_path):
    path, _ = _table(tmp_path, {"K2/mcg": {1: 53, 2: 53}})
    h = Harness(tuning=path, fit={55: CEILING, 53: 1})
    h.prepare()
    h.call(0, 1)
    h.call(0, 2)
    assert [s["variant"] for s in h.ext.seen] == [53, 55]
    # the ACTIVE line names only the row counts the table's picks serve: 2 rows went to v55 (review)
    assert h.grep("ACTIVE")[0].endswith(" tuned_rows=1 tuned_layers=2/2")
    path, _ = _table(tmp_path, {"K2/mcg": {2: 53}})  # a pick that serves nothing here: no row, no layer
    h = Harness(tuning=path, fit={55: CEILING, 53: 1})
    h.prepare()
    h.call(0, 1)
    assert h.grep("ACTIVE")[0].endswith(" tuned_rows=- tuned_layers=0/2")


@pytest.mark.parametrize("over, phrase", [
    ({"device": "NVIDIA H100 80GB HBM3"}, "measured on a NVIDIA H100 80GB HBM3 (34 SMs), this is a Stand-in Card"),
    ({"sm_count": 132}, "(132 SMs), this is a Stand-in Card (34 SMs)"),
    ({"build_id": "other"}, "timed lna2 build other, this extension is build fake-0"),
])
def test_a_table_of_another_card_or_build_is_refused_under_strict_and_ignored_otherwise(tmp_path, over, phrase):
    path, digest = _table(tmp_path, {"K2/mcg": {1: 53}}, **over)
    with pytest.raises(md.Lna2NotReadyError, match="re-run `dsv4serve kernel check --bench --save-tuning FILE`") as e:
        Harness(tuning=path, strict=1).prepare()
    assert phrase in str(e.value) and digest in str(e.value)
    h = Harness(tuning=path, strict=0)
    h.prepare()
    h.call(0, 1)
    assert h.ext.seen[0]["variant"] == policy.variant_for(1, I, 2, H)
    (line,) = h.grep("tuning ignored")
    assert phrase in line and "the built-in policy serves (VLLM_EXL3_MOE_STRICT=0)" in line
    assert h.grep("ACTIVE")[0].endswith("policy=builtin")


def test_an_unreadable_table_is_refused_under_strict_and_ignored_once_otherwise(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{")
    with pytest.raises(md.Lna2NotReadyError, match="not JSON"):
        Harness(tuning=str(path), strict=1).prepare()
    h = Harness(tuning=str(path), strict=0, n_layers=3)
    h.prepare()
    assert len(h.grep("tuning ignored")) == 1  # one line for three layers


def test_a_table_without_the_layers_shape_leaves_it_to_the_policy(tmp_path):
    path, digest = _table(tmp_path, {"K3/mcg": {1: 53}})
    h = Harness(tuning=path, strict=0)
    h.prepare()
    h.call(0, 1)
    assert h.ext.seen[0]["variant"] == policy.variant_for(1, I, 2, H)
    (line,) = h.grep("holds no K2/mcg layer")
    assert digest in line and "the built-in policy serves these layers" in line
    (line,) = h.grep("holds none of this model's layers")
    assert f"measured at hidden={H} intermediate={I} top_k={TOP_K} experts={E} (K3/mcg)" in line
    assert h.grep("ACTIVE")[0].endswith("policy=builtin")


def test_under_strict_a_table_that_serves_no_layer_is_refused(tmp_path):
    path, digest = _table(tmp_path, {"K2/mcg": {1: 53}}, hidden=4096)
    h = Harness(tuning=path, strict=1)
    with pytest.raises(md.Lna2NotReadyError, match="holds none of this model's layers") as e:
        h.prepare()
    assert "--hidden H --inter I --save-tuning" in str(e.value) and digest in str(e.value)
    assert not hasattr(h.layers[0][1].quant_method, "_dsv4serve_state")  # nothing was wrapped
    # one layer the table holds is enough: the others take the policy, as said
    path, _ = _table(tmp_path, {"K2/mcg": {1: 53}})
    Harness(tuning=path, strict=1).prepare()


def test_the_worker_reads_the_launchers_variable():
    assert launch.PLUGIN_ENV_TUNING == md.TUNING_ENV
    e = md.read_env({"DSV4SERVE_RUN_ID": "r", "VLLM_EXL3_MOE_KERNEL": "lna2", md.TUNING_ENV: "/x/t.json"})
    assert e.tuning == "/x/t.json"
    assert md.read_env({"DSV4SERVE_RUN_ID": "r"}).tuning is None


# --- the launcher ----------------------------------------------------------------------------------


def _canon_table(tmp_path):
    t = measured({"K2/mcg": {1: 55}}, {"K2/mcg": {1: 26}})
    path = tmp_path / "card.json"
    return path, tuning.save(t, path)


def test_the_run_gets_its_own_copy_of_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "home"))
    path, digest = _canon_table(tmp_path)
    p = load_profile("8x16gb-380k", ["runtime.kind=native", f"moe.tuning={path}"])
    run_dir = tmp_path / "run"
    spec = launch.build(p, run_id="r1", run_dir=run_dir)
    assert spec.env[launch.PLUGIN_ENV_TUNING] == str(run_dir / launch.TUNING_COPY)
    assert launch.write_tuning(p, run_dir) == digest
    assert (run_dir / launch.TUNING_COPY).read_bytes() == path.read_bytes()
    docker = load_profile("8x16gb-380k", [f"moe.tuning={path}", "runtime.patch_root=/nonexistent"])
    argv = launch.build(docker, run_id="r1", run_dir=run_dir).argv
    assert f"{launch.PLUGIN_ENV_TUNING}={run_dir / launch.TUNING_COPY}" in argv  # the run dir is mounted as is
    assert launch.build(load_profile("8x16gb-380k", ["runtime.kind=native"]), run_id="r1",
                        run_dir=run_dir).env.get(launch.PLUGIN_ENV_TUNING) is None


@pytest.mark.parametrize("setup, phrase", [
    ("missing", "lna2 tuning table {path}: missing"),
    ("bad", "not JSON"),
    # a FIFO blocked the dry run, check-seat and up forever (helper audit); a directory is no table
    ("fifo", "lna2 tuning table {path}: not a regular file"),
    ("dir", "lna2 tuning table {path}: not a regular file"),
    ("incumbent", "moe.tuning picks lna2 builds but moe.kernel is incumbent"),
])
def test_the_launch_plan_refuses_a_table_it_cannot_use(tmp_path, setup, phrase):
    path = tmp_path / "t.json"
    if setup == "bad":
        path.write_text("{")
    elif setup == "fifo":
        os.mkfifo(path)
    elif setup == "dir":
        path.mkdir()
    phrase = phrase.format(path=path)
    over = ["runtime.kind=native", f"moe.tuning={path}"]
    if setup == "incumbent":
        _canon_table(tmp_path)
        path = tmp_path / "card.json"
        p = load_profile("8x16gb-380k-incumbent", ["runtime.kind=native", f"moe.tuning={path}"])
    else:
        p = load_profile("8x16gb-380k", over)
    with pytest.raises(ProfileError) as e:
        launch.check_plan(p)
    assert phrase in e.value.message
    if setup != "incumbent":
        assert "--save-tuning" in e.value.hint


def test_a_relative_table_path_is_refused_at_load():
    with pytest.raises(ProfileError, match="moe.tuning: must be an absolute path"):
        load_profile("8x16gb-380k", ["moe.tuning=card.json"])


def test_kernel_check_refuses_save_tuning_before_touching_a_gpu(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "dsv4serve", "kernel", "check", *args], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    r = cli("--save-tuning", str(tmp_path / "t.json"))
    assert r.returncode == 2 and "--save-tuning reads the table off the timings: it needs --bench" in r.stderr
    r = cli("--bench", "--save-tuning", str(tmp_path))
    assert r.returncode == 2 and "is a directory" in r.stderr
    r = cli("--bench", "--save-tuning", str(tmp_path / "t.json"))
    assert r.returncode == 1 and "no CUDA GPU" in r.stderr and not (tmp_path / "t.json").exists()


def test_a_pick_the_table_did_not_time_is_refused(tmp_path):
    doc = json.loads(tuning.dumps(measured({"K2/mcg": {1: 55, 4: 46}})))
    doc["picks"]["K2/mcg"]["4"] = 53  # hand-edited: v53 was never checked at four rows
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(tuning.TuningError, match="K2/mcg at 4 rows names v53, which this table did not time there") as e:
        tuning.load(path)
    assert str(e.value) == f"lna2 tuning table {path}: K2/mcg at 4 rows names v53, which this table did not time there"


def test_departures_are_counted_against_the_policys_pick_on_that_card():
    """On a 99 KB card the policy itself moves two K3 rows off v59 (it fits one): a table that
    confirms those picks departs from nothing."""
    def runner(layer):
        return Runner(layer)

    spec = selfcheck.CheckSpec(**SMALL, rows=[1, 2], bits=[3], bench=True)
    fit = {59: 1, 55: 24}
    rep = selfcheck.check(spec, torch.device("cpu"), runner, lambda fns: {v: 10.0 for v in fns},
                          grapher=lambda launch: launch, fitter=lambda K, cb: fit)
    assert rep.ok and [c.variant for c in rep.cases] == [59, 55]
    t = tuning.from_report(rep, **CARD)
    assert t.picks == t.policy_picks == {"K3/mcg": {1: 59, 2: 55}} and t.changes() == []
