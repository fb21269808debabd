"""Which lna2 kernel variant serves a call of `rows` decode rows.

Both variants compute the same function (same plan, same fixed-order sums; parity-checked
against the fp64 reference on the H200). v1's cp.async pipeline wins at 1-2 rows, where the
launch is a latency chain; v0's register-streamed decode wins from 4 rows up (measured
2026-12-02, kernels/lna2/NOTES.md). The choice is per call, so one seat uses both.
"""

from __future__ import annotations

V1_MAX_ROWS = 2


def variant_for(rows: int) -> int:
    return 1 if rows <= V1_MAX_ROWS else 0
