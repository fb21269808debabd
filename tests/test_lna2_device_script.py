"""scripts/lna2_device.py's CPU-side pieces: what the device runs record is read right.

The script runs on the device machine; its summaries are plain Python over recorded events, so
they are checked here on synthetic traces."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_device_script():
    spec = importlib.util.spec_from_file_location("lna2_device", ROOT / "scripts" / "lna2_device.py")
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    return dev


def test_v2_trace_summary_tells_gate_up_items_from_down_items():
    """The device script's v2 trace summary sorts items by their events: gate/up items have ring
    stages, down items wait ('ready') for their group's activation."""
    dev = _load_device_script()
    ev = {name: i for i, name in enumerate(dev.EVENTS)}
    us = 1000  # trace times are ns

    def item(t0, *names):
        return [(t0, ev["item"], 0)] + [(t0 + (i + 1) * us, ev[n], 0) for i, n in enumerate(names)]

    cta = ([(0, ev["plan"], 0)]
           + item(1 * us, "stage0", "mma", "arrived")  # gate/up
           + item(10 * us, "stage0", "mma", "arrived")  # gate/up
           + item(20 * us, "ready", "mma", "arrived")  # down
           + [(30 * us, ev["exit"], 0)])
    doc = {"runs": [{"shape": "tp1", "m": 8, "rep": 0, "ctas": [cta]}]}
    row = dev.summarize_trace(doc)[0]
    assert (row["gu_items"], row["dn_items"]) == (2, 1)
    assert row["gu_start_to_first_stage"]["median_us"] == 1.0 and row["dn_start_to_ready"]["median_us"] == 1.0
    # a launch with nothing routed (trace --empty) has a plan and no items: left out of the summary
    empty = {"shape": "tp1", "m": 8, "rep": 0, "empty": True, "ctas": [[(0, ev["plan"], 0)]]}
    both = dev.summarize_trace({"runs": [empty, doc["runs"][0]]})
    assert len(both) == 1 and (both[0]["gu_items"], both[0]["dn_items"]) == (2, 1)


def test_error_figures_are_relative_l2_and_a_zero_reference_row_must_be_zero():
    """The parity gates read these: per-row relative L2 (a row whose reference is ~0, an unrouted
    row, passes only if the output is ~0 too) and one whole-output figure per tuning config."""
    import torch

    dev = _load_device_script()
    ref = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    got = torch.tensor([[3.0, 4.5], [0.0, 0.0], [1.0, 0.0]], dtype=torch.float32)
    rel = dev.row_rel(got, ref)
    assert rel[0] == 0.1 and rel[1] == 0.0 and rel[2] == float("inf")
    assert abs(dev.tensor_rel(got[:1], ref[:1]) - 0.1) < 1e-12
    assert abs(dev.tensor_rel(got, ref) - (0.25 + 1.0) ** 0.5 / 5.0) < 1e-12


def _bench_row(shape, K, m, inc, variants):
    return {"shape": shape, "K": K, "m": m, "I": 256 if shape == "tp8" else 2048, "U": 6 * m, "codebook": "mcg",
            "floor_us": 1.0 * m, "inc_cold_us": inc, "inc_wholeop_cold_us": inc + 5.0, "inc_path": "coop",
            **{f"lna2_v{v}_cold_us": t for v, t in variants.items()}}


def _bench(rows):
    return {"device": "synthetic", "read_bw_gbs": 4321.0, "rows": rows, "method": {}}


def test_merge_takes_the_policy_variant_the_slower_process_and_fills_only_what_matches(tmp_path):
    """`merge` (CPU-side, run at home on the device's bench files): lna2_us is the policy's variant
    at the point, the slower of its two same-process medians; ratio is the best incumbent over it;
    --fill-from copies an earlier row only where this run did not time the policy's variant and the
    earlier row is of that same variant, and says so on the row and at the top."""
    import json
    from argparse import Namespace

    from dsv4serve.lna2.policy import variant_for

    dev = _load_device_script()
    one, four, eight = variant_for(1, 256, 2), variant_for(4, 256, 2), variant_for(8, 256, 2)
    b145 = _bench([_bench_row("tp8", 2, 1, 90.0, {one: 20.0, 4: 30.0}),
                   _bench_row("tp8", 2, 4, 150.0, {4: 50.0}),  # the policy's variant was not timed here
                   _bench_row("tp8", 2, 8, 200.0, {eight: 60.0, 4: 70.0}),
                   _bench_row("tp8", 2, 16, 300.0, {4: 110.0})])  # nor here
    b165 = _bench([_bench_row("tp8", 2, 1, 35.0, {one: 21.0, 4: 31.0}),
                   _bench_row("tp8", 2, 4, 78.0, {4: 49.0}),
                   _bench_row("tp8", 2, 8, 130.0, {eight: 59.0, 4: 71.0}),
                   _bench_row("tp8", 2, 16, 320.0, {4: 111.0})])
    old = {"commit": "abc1234", "rows": [
        {"shape": "tp8", "K": 2, "m": 4, "lna2_variant": f"v{four}", "lna2_us": 40.0, "ratio": 1.95},
        {"shape": "tp8", "K": 2, "m": 16, "lna2_variant": "v999", "lna2_us": 100.0, "ratio": 3.0}]}
    paths = {}
    for name, doc in (("b145", b145), ("b165", b165), ("old", old)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(doc))
    out = tmp_path / "merged.json"
    dev.cmd_merge(Namespace(bench145=str(paths["b145"]), bench165=str(paths["b165"]), out=str(out), commit="deadbee",
                            date="2026-12-05", fill_from=str(paths["old"])))
    d = json.loads(out.read_text())
    assert d["commit"] == "deadbee" and d["read_bw_gbs"] == 4321.0
    rows = {(r["shape"], r["K"], r["m"]): r for r in d["rows"]}
    r1 = rows[("tp8", 2, 1)]
    assert r1["lna2_variant"] == f"v{one}" and r1["lna2_us"] == 21.0  # the slower process
    assert r1["exl3_moe_us"] == 90.0 and r1["exl3_moe_165_us"] == 35.0
    assert r1["ratio"] == round(35.0 / 21.0, 3) and "source" not in r1
    assert rows[("tp8", 2, 8)]["lna2_us"] == 60.0  # the slower process again, the other one this time
    r4 = rows[("tp8", 2, 4)]  # filled: same variant as the policy's
    assert r4["lna2_us"] == 40.0 and "abc1234" in r4["source"]
    assert ("tp8", 2, 16) not in rows  # the earlier row is another variant: not copied
    assert d["filled_from"] == {"file": "old.json", "points": [["tp8", 2, 4]]}
    # the run's order, the filled point in its place
    assert [(r["shape"], r["K"], r["m"]) for r in d["rows"]] == [("tp8", 2, 1), ("tp8", 2, 4), ("tp8", 2, 8)]
