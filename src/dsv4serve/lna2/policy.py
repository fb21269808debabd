"""Which lna2 kernel variant serves a call of `rows` decode rows.

All variants compute the same function (parity-checked against the fp64 reference on the H200;
kernels/lna2/NOTES.md) and are bitwise repeatable, so the choice is per call and a seat may use
several. The table is read off the same-process benchmark of 2026-12-03
(kernels/lna2/results/2026-12-03-h200.json):

* v1 (cooperative, cp.async pipeline) wins at 1-2 rows at the seat's TP8 shapes (I = 256), and at
  one row for a whole-layer intermediate (I >= 1024);
* v0 (cooperative, register-streamed) wins from 4 rows up at TP8, and at 17+ rows everywhere;
* v3 (v2's ticket-scheduled kernel, rounded MCG sums) wins at 2-16 rows for I >= 1024 -- at K3 only
  up to 4 rows. v3 rather than v2: v2's exact-sum MMA is no faster and less accurate in fp32.

v2/v3 read x with 16-byte loads: an unaligned x (a view into a larger buffer) takes v0/v1 instead.
"""

from __future__ import annotations

V1_MAX_ROWS = 2
WIDE_INTER = 1024  # a whole-layer (or TP <= 2) intermediate slice


def variant_for(rows: int, inter: int = 256, bits: int = 2, x_aligned: bool = True) -> int:
    if inter >= WIDE_INTER and x_aligned and 2 <= rows <= (16 if bits == 2 else 4):
        return 3
    if rows <= (1 if inter >= WIDE_INTER else V1_MAX_ROWS):
        return 1
    return 0
