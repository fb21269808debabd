"""Which lna2 kernel variant serves a call of `rows` decode rows.

All variants compute the same function (parity-checked against the fp64 reference on the H200;
kernels/lna2/NOTES.md) and are bitwise repeatable, so the choice is per call. The table is read
off the same-process benchmark of 2026-12-03, run 4 (kernels/lna2/results/2026-12-03-h200.json):

* v4 (v2's ticket-scheduled kernel compiled for 2 CTAs per SM: up to 128 registers, no spills)
  is the fastest variant at every measured point but one, by 3-20 % over v2 and up to 17 % over
  v0/v1 at the seat's TP8 shapes. It is also the variant whose CUDA-graph capture and replay ran
  on the GPU (parity grid and the plugin's dispatch), which is how a seat runs decode.
* v1 (cooperative, cp.async pipeline) was 5 % faster at one K2 row at TP8 (32.0 vs 33.6 us), but
  its graph capture has not been run on a GPU: v4 serves that case too.

v0-v3 stay available for the benchmark and the parity grid; v3 (the format's fp16 lo+hi
rounding) is also what every variant >= 2 runs for MUL1 layers.

Every variant reads x with vector loads and the binding refuses an x that is not 16-byte aligned;
the dispatch hands an offset view over as an aligned copy (v0 faulted on one, 2026-12-03).
"""

from __future__ import annotations

SEAT_VARIANT = 4


def variant_for(rows: int, inter: int = 256, bits: int = 2) -> int:
    del rows, inter, bits  # measured alike at every row count, both shapes, K2 and K3
    return SEAT_VARIANT
