"""scripts/lna2_device.py's CPU-side pieces: what the device runs record is read right.

The script runs on the device machine; its summaries are plain Python over recorded events, so
they are checked here on synthetic traces."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_v2_trace_summary_tells_v51s_three_item_kinds_apart():
    """The device script's v2 trace summary sorts items by their events: gate/up items have ring
    stages (v51's also a 'ready' for their group's rotation), down items wait without stages, v51's
    rotation items only arrive. A v51 gate/up item must not be counted as a down item."""
    spec = importlib.util.spec_from_file_location("lna2_device", ROOT / "scripts" / "lna2_device.py")
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    ev = {name: i for i, name in enumerate(dev.EVENTS)}
    us = 1000  # trace times are ns

    def item(t0, *names):
        return [(t0, ev["item"], 0)] + [(t0 + (i + 1) * us, ev[n], 0) for i, n in enumerate(names)]

    cta = ([(0, ev["plan"], 0)] + item(1 * us, "arrived")  # rotation
           + item(10 * us, "ready", "stage0", "mma", "arrived")  # v51 gate/up
           + item(20 * us, "ready", "mma", "arrived")  # down
           + [(30 * us, ev["exit"], 0)])
    doc = {"runs": [{"shape": "tp1", "m": 8, "rep": 0, "ctas": [cta]}]}
    row = dev.summarize_trace(doc)[0]
    assert (row["rot_items"], row["gu_items"], row["dn_items"]) == (1, 1, 1)
