"""Which lna2 kernel variant serves a call of `rows` decode rows.

All variants compute the same function (parity-checked against the fp64 reference on the H200;
kernels/lna2/NOTES.md) and are bitwise repeatable, so the choice is per call. The table is read
off the same-process benchmarks of 2026-12-03 (runs 8 and 10 in kernels/lna2/NOTES.md; the
figures are in kernels/lna2/results/2026-12-03-h200.json):

* v4 (v2's ticket-scheduled kernel compiled for 2 CTAs per SM: up to 128 registers, no spills)
  is the fastest variant from 2 rows up at the seat's TP8 shapes (by 5-13 % over v2 and 10-50 %
  over v0/v1) and at every TP1 point.
* v1 (cooperative, cp.async pipeline, one grid barrier) is 3-12 % faster than v4 at a single row
  of the TP8 slice (I <= 256), K2 and K3, in each same-process run of the day. Its CUDA-graph
  capture and replay at one row are part of the device parity grid and of the dispatch check.

v0, v2 and v3 stay available for the benchmark and the parity grid; v3 (the format's fp16 lo+hi
rounding) is also what every variant >= 2 runs for MUL1 layers.

Every variant reads x with vector loads and the binding refuses an x that is not 16-byte aligned;
the dispatch hands an offset view over as an aligned copy (v0 faulted on one, 2026-12-03)."""

from __future__ import annotations

SEAT_VARIANT = 4
ONE_ROW_VARIANT = 1
ONE_ROW_MAX_INTER = 256  # the TP8 slice; at TP1 (I = 2048) v1 is 20-30 % slower than v4 at one row


def variant_for(rows: int, inter: int = 256, bits: int = 2) -> int:
    del bits  # K2 and K3 measured alike
    if rows == 1 and inter <= ONE_ROW_MAX_INTER:
        return ONE_ROW_VARIANT
    return SEAT_VARIANT
