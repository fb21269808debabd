"""Which lna2 kernel variant serves a call of `rows` decode rows.

All variants compute the same function (parity-checked against the fp64 reference on the H200;
kernels/lna2/NOTES.md) and are bitwise repeatable, so the choice is per call and a seat may use
several. The table is read off the same-process benchmark of 2026-12-03
(kernels/lna2/results/2026-12-03-h200.json):

* v1 (cooperative, cp.async pipeline) wins at 1-2 rows at the seat's TP8 shapes (I = 256);
* v0 (cooperative, register-streamed) wins at 4 rows there (by 1-3 %);
* v2 (ticket-scheduled, per-warp rings, MCG lo+hi summed in the MMA) wins from 8 rows up at TP8
  and at every row count for a whole-layer intermediate (I >= 1024), by 5-20 %. v3 (the same kernel
  with the format's fp16 lo+hi rounding) is 1-8 % slower; the policy takes v2, whose error
  (<= 5.7e-4 rel. L2 in fp32) is still below both exllamav3 incumbents'.

v2/v3 read x with 16-byte loads: an unaligned x (a view into a larger buffer) takes v0/v1 instead.
"""

from __future__ import annotations

V1_MAX_ROWS = 2
V2_MIN_ROWS = 8
WIDE_INTER = 1024  # a whole-layer (or TP <= 2) intermediate slice


def variant_for(rows: int, inter: int = 256, bits: int = 2, x_aligned: bool = True) -> int:
    del bits  # K2 and K3 measured alike: same choice
    if x_aligned and (inter >= WIDE_INTER or rows >= V2_MIN_ROWS):
        return 2
    return 1 if rows <= V1_MAX_ROWS else 0
