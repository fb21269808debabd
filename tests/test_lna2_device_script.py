"""scripts/lna2_device.py's CPU-side pieces: what the device runs record is read right.

The script runs on the device machine; its summaries are plain Python over recorded events, so
they are checked here on synthetic traces."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_v2_trace_summary_tells_gate_up_items_from_down_items():
    """The device script's v2 trace summary sorts items by their events: gate/up items have ring
    stages, down items wait ('ready') for their group's activation."""
    spec = importlib.util.spec_from_file_location("lna2_device", ROOT / "scripts" / "lna2_device.py")
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
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
