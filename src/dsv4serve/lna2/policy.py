"""Which lna2 kernel variant serves a call of `rows` decode rows.

All variants compute the same function (parity-checked against the fp64 reference on the H200;
kernels/lna2/NOTES.md) and are bitwise repeatable, so the choice is per call and a seat may use
several. The table is read off the same-process benchmark of 2026-12-03, run 4
(kernels/lna2/results/2026-12-03-h200.json):

* v4 (v2's ticket-scheduled kernel compiled for 2 CTAs per SM: up to 128 registers, no spills)
  is the fastest variant at every measured point but one, by 4-20 % over v2 and up to 17 % over
  v0/v1 at the seat's TP8 shapes;
* v1 (cooperative, cp.async pipeline) is 5 % faster than v4 at one row at TP8 with K2 (32.0 vs
  33.6 us, the slower of two same-process medians), so it keeps that one case.

v0, v2 and v3 stay available for the benchmark and the parity grid; v3 (the format's fp16 lo+hi
rounding) is also what every variant >= 2 runs for MUL1 layers.

Every variant reads x with vector loads and the binding refuses an x that is not 16-byte aligned;
the dispatch hands an offset view over as an aligned copy (v0 faulted on one, 2026-12-03).
"""

from __future__ import annotations

WIDE_INTER = 1024  # a whole-layer (or TP <= 2) intermediate slice


def variant_for(rows: int, inter: int = 256, bits: int = 2) -> int:
    if rows == 1 and bits == 2 and inter < WIDE_INTER:
        return 1
    return 4
