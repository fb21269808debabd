"""Which lna2 kernel variant serves a call of `rows` decode rows.

All variants compute the same function (parity-checked against the fp64 reference on the H200;
kernels/lna2/NOTES.md) and are bitwise repeatable, so the choice is per call. The table is read
off the same-process benchmarks of 2026-12-03 (session 15 run 4, kernels/lna2/results/2026-12-03-h200.json)
and, for K3 from two rows, of 2026-12-04 (session 18 runs 1-5); session 18 run 5 re-measured every
point with this table in force (2026-12-04-h200.json; within 0.7 % of session 17 run 2's
2026-12-04-h200-s17.json at TP8 wherever the variant is the same). Session 17's candidates -- 16-warp
CTAs at one row (v32), K2's states by multiply-high (v33), the first unit's trellis requested earlier
(v34, v35) -- were no faster and are not built; nor are session 18's v37 (L2 prefetches, unawaited
arrivals) and v38 (batched rotation loads):

* The cluster kernel (lna2_v7.cu: one 8-CTA cluster per row group and 128-block of the
  intermediate, the gate/up k-split reduced through distributed shared memory, nothing but the
  top-k sum through global memory) serves the TP8 slice (I <= 256) up to 24 rows at K2 and up to
  16 at K3, in its later builds: bulk-copied trellis rows requested by the warps that consume them,
  the first unit's trellis requested around x and suh, an acquire-release arrival, byte-permute
  state extraction at K2 (v20), and the down epilogue's tasks dealt to the warps in turn through one
  rolled copy of its code (session 15: 2-12 % at every K2 point, against v21).
  - K2, and one K3 row: v26, where every CTA also finishes the activation itself (no second cluster
    barrier). Session 15 run 4: 19.2 / 25.0 / 43.3 / 64.9 / 112.2 / 153.9 us at 1 / 2 / 4 / 8 / 16 /
    24 rows, against v4's 34.6 / 37.8 / 52.8 / 76.3 / 117.5 / 158.9; v28 (v26 with two k-steps per
    loop iteration) was slower at every K2 point.
  - K3, two to sixteen rows: v36 (v26 with one partial buffer of min(8, m) rows, its reuse guarded
    by a split cluster barrier). v26's two 8-row buffers cost K3 its second CTA per SM (15-25 %
    slower from two rows); v31's two min(8, m)-row buffers from seven rows. v36 keeps two per SM to
    eighteen rows by its layout's arithmetic. Session 18 runs 1 / 2: 28.0 / 28.0, 42.9 / 42.5,
    72.8 / 72.6 and 137.7 / 138.3 us at 2 / 4 / 8 / 16 rows, against v31's 27.8 / 27.8 and
    42.7 / 42.7 at two and four, v27's 75.5 / 75.0 and v4's 75.9 / 76.3 at eight, v4's
    140.4 / 140.8 at sixteen. Rows 9-15 were not timed; eight and sixteen bracket them. At 24 rows
    (one CTA per SM) v4 takes 180 us against v36's 232. It runs as v39: v36 whose non-last units of a
    cluster arrive on their column slice without waiting for the answer. Session 18 run 5 (the
    dispatch ran v39 there): 28.2 / 43.0 / 72.5 / 138.8 us at 2 / 4 / 8 / 16 rows against v36's
    28.0 / 42.9 / 72.9 / 139.2 in the same process -- a tie.
  It takes hidden sizes that are a multiple of 1024 up to 8192 and intermediates up to 512 (the
  binding refuses others). The choice was measured on the H200 (132 SMs): a card with fewer SMs
  fits fewer clusters per pass, and nothing here has been timed on one.
* v4 (v2's ticket-scheduled kernel compiled for 2 CTAs per SM: up to 128 registers, no spills)
  is the fastest variant everywhere else, and at every TP1 point.

v0-v3, v6, v7, v9, v20, v21, v27, v31 and v36 stay available for the benchmark and the parity grid;
v3 (the format's fp16 lo+hi rounding) is also what variants 2 to 4 run for MUL1 layers.

Every variant reads x with vector loads and the binding refuses an x that is not 16-byte aligned;
the dispatch hands an offset view over as an aligned copy (v0 faulted on one, 2026-12-03)."""

from __future__ import annotations

SEAT_VARIANT = 4
ONE_ROW_VARIANT = 26  # one row at any bits
CLUSTER_VARIANT = 40  # K3 (and any bits but 2), two to CLUSTER_MAX_ROWS rows
CLUSTER_VARIANT_K2 = 40  # K2, two to CLUSTER_MAX_ROWS_K2 rows
CLUSTER_MAX_ROWS = 16
CLUSTER_MAX_ROWS_K2 = 24
CLUSTER_MAX_INTER = 256  # measured at the TP8 slice only


def cluster_kernel_takes(hidden: int, inter: int) -> bool:
    """lna2_v7.cu's geometry (variants 7, 9, 20, 21, 26, 27, 31, 36, 39, 40): whole 1024-column slices for its 8 CTAs,
    <= 4 intermediate blocks."""
    return hidden % 1024 == 0 and 1024 <= hidden <= 8192 and inter % 128 == 0 and inter <= 512


def variant_for(rows: int, inter: int = 256, bits: int = 2, hidden: int = 4096) -> int:
    if inter > CLUSTER_MAX_INTER or not cluster_kernel_takes(hidden, inter):
        return SEAT_VARIANT
    if rows == 1:
        return ONE_ROW_VARIANT
    if bits == 2 and rows <= CLUSTER_MAX_ROWS_K2:
        return CLUSTER_VARIANT_K2
    return CLUSTER_VARIANT if rows <= CLUSTER_MAX_ROWS else SEAT_VARIANT
