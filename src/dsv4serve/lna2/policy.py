"""Which lna2 kernel variant serves a call of `rows` decode rows.

All variants compute the same function (parity-checked against the fp64 reference on the H200,
v53, v54 and v55 on an H100; kernels/lna2/NOTES.md) and are bitwise repeatable, so the choice is per call. The table is read
off the same-process benchmarks of 2026-12-03 (session 15 run 4, kernels/lna2/results/2026-12-03-h200.json)
and, from two rows, of 2026-12-04 (session 18 runs 1-7); session 19 run 2 re-measured every point
with this table in force, and its dispatch ran it (2026-12-04-h200.json; session 18 run 7's figures
are in 2026-12-04-h200-s18.json). Session 17's candidates -- 16-warp CTAs at one row (v32), K2's
states by multiply-high (v33), the first unit's trellis requested earlier (v34, v35) -- were no
faster and are not built; nor are session 18's v37 (L2 prefetches, unawaited arrivals), v38
(batched rotation loads) and v39 (v36 with unawaited arrivals, superseded by v40), session 19's
v41 (v40 with lazier per-row bookkeeping: a tie), v42 (units claimed from a ticket: no faster
below sixteen rows, and a shared-memory hazard), v43 (a cluster per unit: slower from four rows) and
v44 (claims past the second pass: its K3 builds spilled and lost from two to sixteen rows), or
session 20's v45 (the next unit's rotation during this unit's finisher: slower from four rows):

* The cluster kernel (lna2_v7.cu: one 8-CTA cluster per row group and 128-block of the
  intermediate, the gate/up k-split reduced through distributed shared memory, nothing but the
  top-k sum through global memory) serves the TP8 slice (I <= 256) up to 24 rows at K2 and up to
  16 at K3, in its later builds: bulk-copied trellis rows requested by the warps that consume them,
  the first unit's trellis requested around x and suh, an acquire-release arrival, byte-permute
  state extraction at K2 (v20), and the down epilogue's tasks dealt to the warps in turn through one
  rolled copy of its code (session 15: 2-12 % at every K2 point, against v21).
  - **Since session 44 one build serves every cluster point below: v59**, which is v46 whose top-k
    sum is one returning 64-bit atomic per output element (a fixed-point sum with the arrival count
    in its low bits; the add that completes an element writes it), in place of the y rows, the
    arrival counter and the gather: 1.1-3.2 us faster than the build each point had at one to eight
    TP8 rows, K2 and K3 (an H100, same process: one K2 row 18.58 against v26's 19.68, eight K3 rows
    69.14 against v46's 72.30; kernels/lna2/NOTES.md, session 44), and 0.9-2.3 us on the H200 (session
    45: one K2 row 18.42 against v26's 19.3, eight K3 rows 66.11 against v46's 68.4).
    What follows is how v26 / v36 / v46 came to hold those points, and the ranges v59 inherits.
  - One row, K2 or K3: v26, where every CTA also finishes the activation itself (no second cluster
    barrier) and every unit's cluster has SMs of its own. Session 19 run 2: 19.3 / 20.6 us at one
    K2 / K3 row against v40's 19.3 / 21.2 (v40's per-row bookkeeping buys nothing at one row).
  - From two rows, K2 to twelve and K3 from three to eight: v46 (since session 24; K2 to 24 and K3 to
    sixteen until session 27, below), which is
    v40 with its "reads done" cluster arrive relaxed. v40 is v26 with one partial buffer of min(8, m) rows
    whose reuse a split cluster barrier guards (v36: two K3 CTAs per SM to eighteen rows, where
    v26's two 8-row buffers cost K3 its second CTA from two rows), and arrivals counted per (column
    slice, row), each row summed by the unit that completes it (the per-slice counter left a whole
    slice to the last unit: four L2 trips per thread at eight rows). Session 19 run 2 (the slower of
    two same-process medians): K2 25.4 / 42.2 / 62.0 / 103.1 / 139.3 us at 2 / 4 / 8 / 16 / 24 rows
    against v26's 25.0 / 42.8 / 64.7 / 111.6 / 152.4; K3 42.1 / 69.4 / 129.0 at 4 / 8 / 16 against
    v36's 42.4 / 72.0 / 137.7 and v4's 54.0 / 75.9 / 140.6. Rows 9-15 were not timed then; session 27
    timed 10, 12 and 14 against v54 (below).
  - K3, two rows: v36 (the same without per-row arrivals): 27.7 us against v40's 28.4 in session 19
    run 2, 27.6-28.0 in all six of session 18's runs, and 27.9 against v46's 28.3 in session 24.
    At 24 K3 rows (one CTA per SM for every cluster build) v4 takes 180 us against v40's 219.
  It takes hidden sizes 1024, 2048, 4096 and 8192 and intermediates up to 512 (the
  binding refuses others). The choice was measured on the H200 (132 SMs; v59's on an H100, 132
  SMs too): a card with fewer SMs fits fewer clusters per pass, and nothing here has been timed on one.
* v55 serves everything else, every TP1 point included, and from session 28 also 13-24 K2 and 9-24
  K3 rows of the TP8 slice. It is v54 with gate/up chunks of 32 k-tiles wherever one-chunk items
  would still be enough items (TP1 from one row, TP8 from ~4 rows): a warp runs four ring rows
  between two chunk stagings instead of two, so the staging, the chunk's three CTA barriers and the
  rotation's wait are paid half as often. Each warp's k-tiles change, so its bits are not v54's;
  272 parity cases and 32 CUDA-graph cases with v54 passed, memcheck and racecheck clean. Session 28
  (2026-12-05, an H100 80GB HBM3, the slower of two same-process medians): TP1 K2 64.0 / 106.0 /
  166.9 / 314.3 / 538.6 / 797.7 us at 1 / 2 / 4 / 8 / 16 / 24 rows against v54's 69.7 / 112.6 /
  172.4 / 324.6 / 561.4 / 826.3, K3 73.6 / 111.9 / 201.3 / 327.5 / 621.7 / 873.1 against 74.1 /
  116.1 / 209.9 / 338.9 / 639.6 / 899.6; TP8 K2 96.3 / 127.9 at 16 / 24 rows against 99.8 / 130.5,
  K3 118.5 / 150.1 against 122.3 / 152.8. At TP8 against v46 (a third process, 4-14 rows): K3 61.2 / 62.7 /
  68.7 / 80.2 at 6 / 7 / 8 / 9 rows against 66.9 / 67.0 / 72.6 / 86.4 (v46 wins at 4 and 5: 43.8 /
  52.6 against 50.9 / 60.8); K2 v46 wins or ties to twelve rows but at ten (74.4 against 79.1), v55
  from thirteen (89.1 / 90.8 against 96.1 / 98.4 at 13 / 14). Those are the bench's timings, ten
  launches of one build in a row. Timed launch by launch against each other (`lna2_device.py
  order`), v55 is 7-10 us slower at every TP8 point and v46 at most 2.2 us: then v46 wins at six to
  nine K3 rows (67.4-73.5 against 70.7-78.5 at 6 and 8) and ties v55 at 10-12 K3 and 13-16 K2 rows;
  with a GEMM between launches of one build, v55 loses only 1-2 us from two rows (5.7 at one K2 row).
  The seat's launch order lies between those (every layer runs the same build at a given row count,
  but K2 and K3 layers are different builds), so the cluster ranges stay where session 27 set them,
  K2 to twelve and K3 to eight: v46's time depends little on what ran before it (0.3-2.1 us), and
  past those points v55 wins or ties however it is timed. Session 29 found why v55 loses: its own
  code goes cold on the SMs when another build runs a full launch in between (kernels/lna2/NOTES.md).
* v54 served everything else, every TP1 point included, in session 27, with 13-24 K2 and 9-16
  K3 rows of the TP8 slice. It is v53 with two k-tiles per ring row (16 tiles a ring step): the
  ring step, row address and loop turn are paid half as often, the arithmetic and its order are
  v53's, and its outputs were bitwise v53's in all 152 parity cases (16 of them at I = 384, where a
  down share is odd and the last ring row half filled). Session 27 (2026-12-05, an
  H100 80GB HBM3 again, the slower of two same-process medians): TP1 K2 69.4 / 111.1 / 173.5 /
  328.0 / 562.3 / 827.3 us at 1 / 2 / 4 / 8 / 16 / 24 rows against v53's 71.0 / 117.4 / 176.2 /
  348.5 / 597.1 / 887.3, K3 73.5 / 126.8 / 209.4 / 339.4 / 639.5 / 898.5 against 75.2 / 122.3 /
  222.3 / 366.5 / 692.4 / 976.3; compute-sanitizer memcheck and racecheck clean. At TP8 it beat
  v46 at 16 and 24 K2 rows (100.5 / 130.6 against 103.6 / 139.0) and at 8-24 K3 rows (eight 69.7
  against 72.8, sixteen 122.0 against 134.1); a third process at 8-16 rows: K2 66.5 / 77.1 / 90.1
  / 94.4 / 100.7 against v46's 63.4 / 80.0 / 87.0 / 99.0 / 104.8 at 8 / 10 / 12 / 14 / 16, K3
  70.0 / 86.0 / 93.8 / 108.7 / 122.8 against 72.6 / 93.7 / 100.8 / 116.2 / 134.4. So v46 keeps K2
  to twelve rows (it won at 8 and 12) and K3 to eight, where on the H200 the cluster kernels were
  relatively faster by ~4 % (v50 against v46 at sixteen K3 rows: +9 % there, +5 % on the H100)
  and v54's margin at eight K3 rows (3.6 %) is inside that; from ten K3 rows and fourteen K2 rows
  its margin (3.5-9 %) is not.
* v53 served everything else, every TP1 point included, in session 26. It is v50 whose
  per-warp trellis rings complete on cp.async commit groups instead of mbarriers, with a steady step
  that issues its one due row directly; the arithmetic is v50's, and its outputs were bitwise v50's
  in all 136 parity cases. Session 26 (2026-12-05, an H100 80GB HBM3: no H200 came; the slowest
  median of three processes, two at two and four TP1 rows): TP1 K2 72.2 / 117.9 / 176.0 / 348.4 /
  597.1 / 894.4 us at 1 / 2 / 4 / 8 / 16 / 24 rows against v50's 72.5 / 129.8 / 194.9 / 389.7 /
  668.5 / 1001.1, K3 75.8 / 123.4 / 223.9 / 368.9 / 698.9 / 985.2 against 85.5 / 143.0 / 264.1 /
  423.1 / 807.9 / 1141.3; at TP8 past the cluster range (24 K3 rows) 164.8 against 181.0.
  compute-sanitizer memcheck and racecheck were clean. At sixteen TP8 K3 rows v53 also beat v46 on
  that H100 (130.8 / 130.5 against 134.4 / 134.9 in two processes; a tie at eight, v46 ahead at K2).
* v50 -- v4 (v2's ticket-scheduled kernel compiled for 2 CTAs per SM: up to 128 registers, no
  spills) with v20's byte-permute state extraction at K2; at K3 it is v4's kernel -- served
  everything else, every TP1 point included, from session 23 to 25. Session 23 (2026-12-05, one
  process per incumbent, the slower of the two medians): TP1 K2 71.2 / 121.2 / 197.8 / 386.6 /
  662.5 / 999.3 us at 1 / 2 / 4 / 8 / 16 / 24 rows against v4's 78.6 / 134.8 / 216.2 / 423.7 /
  712.0 / 1069.6, K3 within 0.6 us of v4 everywhere; its outputs were bitwise v4's in all 136
  parity cases.

Session 23 also measured session 21's v46-v49 and session 22's v51. v46 (v40 with the "reads done"
cluster arrive relaxed) was 0.1-2.1 us faster than v40 at every multi-row TP8 point (as the slower
of two same-process medians; in one process it was 0.2 us slower at sixteen K2 rows). Session 24
(2026-12-05, commit 9d1d497) ran compute-sanitizer memcheck and racecheck on v46 itself (clean),
its 120 parity cases and 12 CUDA-graph cases (all within tolerance, bitwise repeatable), and timed
it beside v40 again: K2 25.5 / 41.9 / 60.9 / 103.6 / 139.1 us at 2 / 4 / 8 / 16 / 24 rows against
v40's 25.5 / 42.5 / 62.2 / 103.7 / 140.1, K3 41.8 / 68.5 / 129.1 at 4 / 8 / 16 against 42.4 / 70.0 /
130.0 (at two K3 rows 28.3 against v36's 27.9). So v46 serves where v40 did. v47 / v48
(partials pushed into per-CTA inboxes) tied at one and four K2 rows and lost from eight; v49 (each
cluster's units in one run) tied at K2 and lost at K3; v51 (TP1's gate/up inputs rotated once per
group) tied from eight K2 rows and lost below and at K3. Those four are retired.

v52 (session 24: v50 with one CTA barrier per gate/up chunk, aimed at TP1) tied v50 (session 25, on
an H100; v5 had tied the same way on 2026-12-03) and was retired in session 26.
v0-v4, v6, v7, v9, v20, v21, v26, v31, v36, v40, v46, v50, v53, v54 and v58 (v26 with v59's top-k sum)
stay available for the benchmark, the parity grid and `kernel check --also`; v3 (the format's fp16
lo+hi rounding) is also what variants 2 to 4, 50, 53, 54 and 55 run for MUL1 layers.

Every variant reads x with vector loads and the binding refuses an x that is not 16-byte aligned;
the dispatch hands an offset view over as an aligned copy (v0 faulted on one, 2026-12-03).

Every choice above was made on the H200 and H100, where a block may have 227 KB of shared memory.
The seat's sm_120 cards allow 99 KiB (101,376 B), and the cluster kernel's K3 builds ask for more:
v26 115,824 B at one row, v36 and v46 101,920 / 102,080 B from two rows (at one K3 row they fit:
100,464 / 100,624 B). At K2 every cluster build fits where it serves (v26 to 24 rows, v36 and v46
to 32), and v55 fits every shape to 32 rows (the binding's answers on an H100 at that limit, session
33). So each point has a list of builds in preference order
(`preference`), and the dispatch serves the first whose launch fits the device (the binding's
`lna2_moe_fit`, per layer shape, at load): on sm_120 one K3 row goes to v59 (v46's shared memory)
and more to v55, and
nothing that cannot launch is picked (session 33 found it; before, every K3 launch there would have
failed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The routed-expert widths (K, bits per weight) lna2 is built for: the dispatch refuses any other
# layer, and check-seat holds a pack's routed experts to them.
BITS = (2, 3)
# Timing ablations (lna2_api.h is_ablation: v4's 10..13, v7's 17..19) skip a stage by design: what
# they write is not the op, so nothing may serve them (a tuning table, --also, the dispatch).
ABLATIONS = frozenset(range(10, 14)) | frozenset(range(17, 20))
# The builds a tuning table, `kernel check --also` and the dispatch's fit query may name: what the
# binding launches (lna2_api.h's variant_known) less the ablations and the cooperative v0 / v1,
# which lna2_moe_fit cannot size. An unknown number "fits" in the binding's sizing and is refused
# only at launch, mid-serving.
TUNABLE = frozenset({2, 3, 4, 6, 7, 9, 20, 21, 26, 31, 36, 40, 46, 50, 53, 54, 55, 58, 59})
SEAT_VARIANT = 55  # v54 (two k-tiles per ring row) with 32-k-tile gate/up chunks where items are many
# v59 (v46 whose top-k sum is one fixed-point atomic per output element) serves every cluster point
# since session 44: faster than the build that served each (v26 at one row, v36 at two K3 rows, v46
# elsewhere) at one to eight TP8 rows, K2 and K3, by 1.1-3.2 us on an H100 (session 44) and 0.9-2.3
# on the H200 (session 45; same process, kernels/lna2/NOTES.md), so one constant names it throughout
CLUSTER_VARIANT = 59  # one to CLUSTER_MAX_ROWS_K2 rows at K2, to CLUSTER_MAX_ROWS at any other bits
CLUSTER_MAX_ROWS = 8
CLUSTER_MAX_ROWS_K2 = 12
CLUSTER_MAX_INTER = 256  # measured at the TP8 slice only


def cluster_kernel_takes(hidden: int, inter: int) -> bool:
    """lna2_v7.cu's geometry (every cluster variant): one, two, four or eight 128-column blocks for
    each of its 8 CTAs, <= 4 intermediate blocks. (A multiple of 1024 such as 3072 or 7168 is not one:
    the binding refuses it, and so would lna2_moe_fit.)"""
    return hidden in (1024, 2048, 4096, 8192) and inter % 128 == 0 and 128 <= inter <= 512


def preference(rows: int, inter: int = 256, bits: int = 2, hidden: int = 4096) -> list[int]:
    """The builds that may serve a call, best first (the H200's order above), ending with v55, which
    takes every shape. The first whose shared memory fits the device serves (`variant_for`)."""
    if inter > CLUSTER_MAX_INTER or not cluster_kernel_takes(hidden, inter):
        return [SEAT_VARIANT]
    top = CLUSTER_MAX_ROWS_K2 if bits == 2 else CLUSTER_MAX_ROWS
    return [CLUSTER_VARIANT, SEAT_VARIANT] if rows <= top else [SEAT_VARIANT]


def served(inter: int = 256, hidden: int = 4096) -> list[int]:
    """Every build `preference` may name for a layer of this shape, in a fixed order."""
    out: list[int] = []
    for rows in range(1, CLUSTER_MAX_ROWS_K2 + 2):
        for bits in BITS:
            out += [v for v in preference(rows, inter, bits, hidden) if v not in out]
    return out


def fit_table(ext: Any, bits: int, codebook: int, hidden: int, inter: int, top_k: int,
              n_experts: int) -> dict[int, int]:
    """Per build `served` names for this shape, the most rows whose launch fits the current CUDA
    device's shared memory per block (the extension's lna2_moe_fit), as `variant_for` takes it.
    Raises whatever the extension raises (a build of other sources, a shape it refuses)."""
    return {v: int(ext.lna2_moe_fit(v, bits, codebook, hidden, inter, top_k, n_experts))
            for v in served(inter, hidden)}


def variant_for(rows: int, inter: int = 256, bits: int = 2, hidden: int = 4096,
                fit: Mapping[int, int] | None = None, tuned: Mapping[int, int] | None = None) -> int:
    """The build that serves `rows` rows. `fit`: per build, the most rows whose launch fits this
    device's shared memory per block (the binding's lna2_moe_fit); None takes every build to fit,
    as on the H100 / H200. On sm_120 cards (99 KB a block) the cluster kernel's K3 builds do not fit
    from two rows (v59 fits one), and v55 serves them (kernels/lna2/NOTES.md, sessions 33 and 44).
    `tuned`: rows -> build, this card's own measurements (lna2/tuning.py), which decide the row
    counts they hold wherever their build fits; the table above decides the rest."""
    if tuned is not None and rows in tuned and (fit is None or fit.get(tuned[rows], 0) >= rows):
        return tuned[rows]
    prefs = preference(rows, inter, bits, hidden)
    if fit is None:
        return prefs[0]
    for v in prefs[:-1]:
        if fit.get(v, 0) >= rows:
            return v
    return prefs[-1]


# Why lna2 refuses vLLM's micro-batching (dual batch overlap, ubatch_size): `up`'s plan and the
# worker's load say it alike.
UBATCH_WHY = ("whose MoE calls come from threads of their own with a slice of the batch each, which "
              "lna2's dispatch (its parity check, its per-size graph record) was not built or proven for")


def graph_rows(rows: int, capture_sizes: Any, spec_tokens: int = 0, max_tokens: int | None = None) -> int:
    """The rows a decode step of `rows` runs at under CUDA graphs: vLLM pads a batch up to the
    smallest capture size that holds it, and runs one larger than every size eagerly. It drops the
    sizes above max_num_batched_tokens, and with speculative decoding may round each size up to a
    multiple of 1 + k (dropping those past the largest, keeping 1 + k if none is left); whether it
    rounds depends on the graph mode, so the larger of the two readings is taken (fail closed)."""
    sizes = sorted({s for s in capture_sizes or [] if isinstance(s, int) and not isinstance(s, bool) and s > 0
                    and (max_tokens is None or s <= max_tokens)})
    readings = [sizes]
    q = 1 + max(0, spec_tokens)
    if sizes and q > 1:
        top = sizes[-1]
        rounded = sorted({-(-s // q) * q for s in sizes if -(-s // q) * q <= top}) or ([q] if q <= top else [])
        readings.append(rounded)
    return max(min((s for s in r if s >= rows), default=rows) for r in readings)
