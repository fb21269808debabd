"""Which lna2 kernel variant serves a call of `rows` decode rows.

All variants compute the same function (parity-checked against the fp64 reference on the H200;
kernels/lna2/NOTES.md) and are bitwise repeatable, so the choice is per call. The table is read
off the same-process benchmarks of 2026-12-03 (kernels/lna2/NOTES.md; the figures are in
kernels/lna2/results/2026-12-03-h200.json):

* The cluster kernel (lna2_v7.cu: one 8-CTA cluster per row group and 128-block of the
  intermediate, the gate/up k-split reduced through distributed shared memory, nothing but the
  top-k sum through global memory) in its second build serves one to eight rows of the TP8 slice
  (I <= 256): bulk-copied trellis rows requested by the warps that consume them, the first unit's
  trellis requested around x and suh, an acquire-release arrival and, at K2, byte-permute state
  extraction (v20). At K2 it runs as v21, where every CTA finishes the activation itself (no second
  cluster barrier): 2-10 % faster than v20 at 1-8 rows (evening run 5). At K3 v21's second partial
  buffer costs the second CTA per SM and it loses 15-25 % from two rows, so K3 runs v20. Against v4
  the cluster kernel is 1.1-1.8x faster at 1-4 rows and 1.1x at eight at K2; at K3 and eight rows
  they are within 2 % either way; at sixteen they tie. It takes hidden sizes that are a multiple
  of 1024 up to 8192 and intermediates up to 512 (the binding refuses others).
* v4 (v2's ticket-scheduled kernel compiled for 2 CTAs per SM: up to 128 registers, no spills)
  is the fastest variant everywhere else, and at every TP1 point.

v0-v3, v6, v7 and v9 (v20 without the byte-permute extraction) stay available for the benchmark and the parity grid; v3 (the format's fp16 lo+hi
rounding) is also what variants 2 to 4 run for MUL1 layers.

Every variant reads x with vector loads and the binding refuses an x that is not 16-byte aligned;
the dispatch hands an offset view over as an aligned copy (v0 faulted on one, 2026-12-03)."""

from __future__ import annotations

SEAT_VARIANT = 4
CLUSTER_VARIANT = 27  # K3 (and any bits but 2), two to eight rows
CLUSTER_VARIANT_K2 = 28  # K2 up to CLUSTER_MAX_ROWS_K2 rows, and one row at any bits
CLUSTER_MAX_ROWS = 8
CLUSTER_MAX_ROWS_K2 = 24
CLUSTER_MAX_INTER = 256  # measured at the TP8 slice only


def cluster_kernel_takes(hidden: int, inter: int) -> bool:
    """lna2_v7.cu's geometry (variants 7, 9, 20, 21, 23-28): whole 1024-column slices for its 8 CTAs,
    <= 4 intermediate blocks."""
    return hidden % 1024 == 0 and 1024 <= hidden <= 8192 and inter % 128 == 0 and inter <= 512


def variant_for(rows: int, inter: int = 256, bits: int = 2, hidden: int = 4096) -> int:
    if inter > CLUSTER_MAX_INTER or not cluster_kernel_takes(hidden, inter):
        return SEAT_VARIANT
    if rows == 1 or (bits == 2 and rows <= CLUSTER_MAX_ROWS_K2):
        return CLUSTER_VARIANT_K2
    return CLUSTER_VARIANT if rows <= CLUSTER_MAX_ROWS else SEAT_VARIANT
