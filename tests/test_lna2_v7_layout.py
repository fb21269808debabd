"""The index and fragment math of lna2's v7 (cluster) kernel, checked on the CPU against the fp64 reference.

A model, not the CUDA kernel: numpy follows ``kernels/lna2/lna2_v7.cu`` CTA by CTA and warp by
warp with the kernel's own index formulas -- each CTA's k-range of gate/up and the trellis rows
its warps read per step, the rotated input in B-fragment order, the in-CTA reduction over k
warps, the rank-ordered cluster sum and the finisher rows per (rank, warp), the activation in
B-fragment order, each CTA's down columns with its (block, k-quarter) warps, one y row per entry
and intermediate block, and the slice gather. The lane arithmetic (windows, states, fragments, the
emulated m16n8k16) is the v2 model's. The kernel's cluster is 8 CTAs; the model takes the cluster
size as a parameter so most cases stay small (the formulas are the kernel's with C7 = C). What it
cannot cover (barriers, DSMEM ordering, the async copies, the hardware MMA) is the GPU parity run's.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv4serve.lna2.reference import moe_reference, random_expert_layer
from tests.test_lna2_v2_layout import (entry_of, fwht128, layer_arrays, ring_row_mma, route_plan, store_frag_pairs,
                                       warp_rows, zero_acc)


NW = 8  # warps per CTA


def geometry(H, I, C):
    """lna2_v7.cu geometry(): None where the kernel refuses the layer."""
    if H % (128 * C) or I % 128:
        return None
    nblk = H // (128 * C)
    kpw, wpb = 2 * 8 * nblk // NW, NW // nblk
    if nblk not in (1, 2, 4, 8) or I // 128 > 4 or kpw < 1 or not 1 <= wpb <= 8:
        return None
    return {"nblk": nblk, "kpc": 8 * nblk, "kpw": kpw, "wpb": wpb, "n_ib": I // 128}


def fx_constants() -> dict[str, float]:
    """lna2_v7.cu's fixed-point constants (FXA), read from the source so the model uses the kernel's."""
    src = (Path(__file__).resolve().parent.parent / "kernels" / "lna2" / "lna2_v7.cu").read_text()
    one = float(re.search(r"constexpr float FX_ONE = ([\d.]+)f;", src).group(1))
    lim = float(re.search(r"constexpr float FX_LIM = ([\d.]+)f;", src).group(1))
    bad, bad_sum = (1 << int(n) for n in re.search(r"FX_BAD = 1ll << (\d+), FX_BAD_SUM = 1ll << (\d+);", src).groups())
    return {"one": one, "lim": lim, "bad": bad, "bad_sum": bad_sum}


def fx_add(words: np.ndarray, c: np.ndarray, need: int, fx: dict) -> np.ndarray:
    """FXA contributions c (fp32) to elements' 64-bit words (uint64, updated in place), as fx_add does
    it: the outputs the adds complete (NaN elsewhere; a completed word returns to zero)."""
    c = np.asarray(c, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        ok = np.abs(c) <= np.float32(fx["lim"])  # False for NaN too
        q = np.where(ok, np.rint(np.where(ok, c, 0) * np.float32(fx["one"])).astype(np.int64), np.int64(fx["bad"]))
    words += (q.view(np.uint64) << np.uint64(6)) + np.uint64(1)  # unsigned 64-bit wrap
    done = (words & np.uint64(63)) == np.uint64(need)
    total = words.view(np.int64) >> np.int64(6)
    vals = np.where(np.abs(total) >= fx["bad_sum"], np.float32(np.nan), total.astype(np.float32) / np.float32(fx["one"]))
    out = np.where(done, vals, np.float32(np.nan))
    words[done] = 0
    return out


def model_v7(x, ids, w, layer, cb, dup, C=8, limit=10.0, fin_local=False, epi=False, rcap=False, sb=False, rg=False,
             fxa=False, order=None):
    K, H, I = layer.K, layer.hidden, layer.inter
    geo = geometry(H, I, C)
    assert geo is not None
    nblk, kpc, kpw, wpb, n_ib = geo["nblk"], geo["kpc"], geo["kpw"], geo["wpb"], geo["n_ib"]
    m, top_k = ids.shape
    n_e = layer.gate_trellis.shape[0]
    words, suh, svh = layer_arrays(layer)
    mask, rbase, groups, gr = route_plan(ids, n_e)
    y = np.zeros((n_ib, gr, H))
    xh = x.numpy()
    mma_row = ring_row_mma(words, K, cb, dup, H, I)

    units = len(groups) * n_ib
    # each CTA's partial buffers as the kernel lays them out: [buf][proj][row][128] with prow rows per
    # (buf, proj), two buffers with fin_local (alternate units) unless sb (v36: one buffer, its
    # reuse guarded by a split cluster barrier), prow = min(8, m) with rcap (v31); NaN until written,
    # so a read of a slot the unit did not write shows
    prow = min(8, m) if rcap else 8
    nbuf = 2 if fin_local and not sb else 1
    cflat = np.full((C, nbuf * 2 * prow * 128), np.nan)
    done = [0] * C
    out = np.full((m, H), np.nan)
    # rg (v40): arrivals per (slice, row); a row expects its distinct in-range experts x n_ib of them
    cnt = np.zeros((C, m), dtype=np.int64)
    need = [len({int(e2) for e2 in ids[row] if 0 <= int(e2) < n_e}) * n_ib for row in range(m)]
    gathered = np.zeros((C, m), dtype=np.int64)

    def gather_row(r, row):
        for b in range(nblk):
            c0 = (r * nblk + b) * 128
            acc4 = np.zeros(128)
            for k in range(n_ib):
                for s_ in range(top_k):
                    e2 = int(ids[row, s_])
                    if 0 <= e2 < n_e and float(w[row, s_]) != 0:  # the kernel's gather skips w = 0
                        ent = entry_of(mask, rbase, e2, row)
                        acc4 = acc4 + float(w[row, s_]) * y[k, ent, c0:c0 + 128]
            out[row, c0:c0 + 128] = acc4
        gathered[r, row] += 1

    if rg and len(groups):  # cluster 0 zeroes the rows no expert serves
        for row in range(m):
            if need[row] == 0:
                out[row] = 0.0
    # fxa (v58, v59): per output element an int64 word, fixed-point sum << 6 plus its arrival count
    fx = fx_constants() if fxa else None
    words64 = np.zeros((m, H), dtype=np.uint64) if fxa else None
    if fxa and len(groups):  # cluster 0 zeroes the rows no expert serves
        for row in range(m):
            if need[row] == 0:
                out[row] = 0.0
    for u in (range(units) if order is None else order):  # nothing crosses units but y (fxa: the words)
        gi, ib = divmod(u, n_ib)
        e, ent0, rws = groups[gi]
        rows = len(rws)
        assert rows <= prow
        base = (u & 1) * 2 * prow * 128 if nbuf == 2 else 0

        def cpart_at(r, proj, j):
            o = base + (proj * prow + j) * 128
            return cflat[r, o:o + 128]

        cflat[:, base:base + 2 * prow * 128] = np.nan  # the unit two before's values are stale
        for r in range(C):
            # rotate(): tasks (proj, row j, block b) of this CTA's k-range into xs[proj][kt][lane][2]
            xs = np.zeros((2, kpc, 32, 2), dtype=np.int64)
            for task in range(2 * rows * nblk):
                proj, rest = task & 1, task >> 1
                j, b = rest % rows, rest // rows
                k0 = (r * nblk + b) * 128
                v = xh[rws[j], k0:k0 + 128].astype(np.float64) * suh[("gate", "up")[proj]][e, k0:k0 + 128]
                v = fwht128(v) / np.sqrt(128)
                for ln in range(32):
                    store_frag_pairs(xs[proj, b * 8 + (ln >> 2)], j, ln, v[4 * ln:4 * ln + 4])
            # gate/up: warp = 2 ksub + proj over steps st; k-tile r kpc + ksub kpw + st
            red = {}
            for warp in range(NW):
                proj, ksub = warp & 1, warp >> 1
                acc = zero_acc()
                for st in range(kpw):
                    kl = ksub * kpw + st
                    mma_row(("gate", "up")[proj], e, r * kpc + kl, ib * 8,
                            lambda ln, p=proj, kl=kl: (int(xs[p, kl, ln, 0]), int(xs[p, kl, ln, 1])), acc)
                red[warp] = warp_rows(acc)
            for proj in range(2):
                tot = np.zeros((8, 128))
                for ks in range(NW // 2):
                    tot = tot + red[2 * ks + proj]
                for j in range(rows):
                    cpart_at(r, proj, j)[:] = tot[j]
        # finisher: rank r's warp w finishes row r + C w and the activation lands in every CTA; with
        # fin_local (v21) every CTA's warp w finishes row w into its own activation
        def finish(jf, act):
            gsum = np.zeros(128)
            usum = np.zeros(128)
            for q in range(C):
                gsum = gsum + cpart_at(q, 0, jf)
                usum = usum + cpart_at(q, 1, jf)
            col = slice(ib * 128, ib * 128 + 128)
            gv = fwht128(gsum) / np.sqrt(128) * svh["gate"][e, col]
            uv = fwht128(usum) / np.sqrt(128) * svh["up"][e, col]
            gg = np.minimum(gv, limit)
            uu = np.clip(uv, -limit, limit)
            av = fwht128(gg / (1 + np.exp(-gg)) * uu * suh["down"][e, col]) / np.sqrt(128)
            for ln in range(32):
                store_frag_pairs(act[ln >> 2], jf, ln, av[4 * ln:4 * ln + 4])

        acts = [np.zeros((8, 32, 2), dtype=np.int64) for _ in range(C if fin_local else 1)]
        finished = set()
        for r in range(C):
            for warp in range(NW):
                jf = warp if fin_local else r + C * warp
                if jf >= rows:
                    continue
                finished.add((r, jf) if fin_local else jf)
                finish(jf, acts[r if fin_local else 0])
        # each row finished once (v7), or once in every CTA (v21)
        assert finished == ({(r, j) for r in range(C) for j in range(rows)} if fin_local else set(range(rows)))
        # down: CTA r's columns; warp = bw wpb + kq over kpwd of the block's 8 k-tiles
        kpwd = 8 // wpb
        for r in range(C):
            act = acts[r if fin_local else 0]
            red = {}
            for warp in range(NW):
                bw, kq = divmod(warp, wpb)
                acc = zero_acc()
                for i in range(kpwd):
                    kt8 = kq * kpwd + i
                    mma_row("down", e, ib * 8 + kt8, r * kpc + bw * 8,
                            lambda ln, kt8=kt8: (int(act[kt8, ln, 0]), int(act[kt8, ln, 1])), acc)
                red[warp] = warp_rows(acc)
            # the epilogue's (block, row) tasks as the kernel deals them to its warps
            covered = []
            for rc in range((rows + 3) // 4):
                if epi:  # variant 26 and its successors: tk = warp, warp + 8, .. of nblk x (rows in the chunk); block warp mod nblk,
                    # also the block of the one svh vector the warp loaded
                    ntask = nblk * min(4, rows - 4 * rc)
                    covered += [(warp & (nblk - 1), rc * 4 + tk // nblk) for warp in range(NW)
                                for tk in range(warp, ntask, NW)]
                else:  # tk = warp + 8 i: block tk >> 2, row tk & 3 of each 4-row chunk
                    covered += [(tk >> 2, rc * 4 + (tk & 3)) for tk in range(4 * nblk) if rc * 4 + (tk & 3) < rows]
            for bsel, j in covered:
                v = sum(red[bsel * wpb + kq][j] for kq in range(wpb))
                c0 = (r * nblk + bsel) * 128
                y[ib, ent0 + j, c0:c0 + 128] = fwht128(v) / np.sqrt(128) * svh["down"][e, c0:c0 + 128]
                if fxa:  # the row's slots on expert e, weights summed in slot order, times this y row
                    row = rws[j]
                    wt = np.float32(0.0)
                    for s_ in range(top_k):
                        if int(ids[row, s_]) == e:
                            wt = np.float32(wt + np.float32(w[row, s_]))
                    yv = y[ib, ent0 + j, c0:c0 + 128].astype(np.float32)
                    c = wt * yv if wt != 0 else np.zeros_like(yv)  # w = 0 adds nothing, as the gather skips it
                    got = fx_add(words64[row, c0:c0 + 128], c, need[row], fx)
                    done_at = words64[row, c0:c0 + 128] == 0  # only a completed word is zero after an add
                    out[row, c0:c0 + 128][done_at] = got[done_at]
            assert sorted(covered) == [(b, j) for b in range(nblk) for j in range(rows)]
            if fxa:
                continue
            if rg:  # the unit that completes a row on slice r sums that row there
                for row in rws:
                    cnt[r, row] += 1
                    if cnt[r, row] == need[row]:
                        cnt[r, row] = 0
                        gather_row(r, row)
                continue
            done[r] += 1
            if done[r] == units:  # the last unit over slice r gathers it: blocks, then slots
                for row in range(m):
                    gather_row(r, row)
    if fxa:
        assert not words64.any()  # every word back at zero for the next launch
    if rg and not fxa:
        assert not cnt.any()  # every counter back at zero for the next launch
        assert (gathered == np.array([[1 if need[row] else 0 for row in range(m)]] * C)).all()
    if units == 0:
        out[:] = 0.0
    return out, {"units": units, "groups": len(groups)}


def _check(layer, ids, w, x, cb, dup, C, fin_local=False, epi=False, rcap=False, sb=False, rg=False):
    got, cfg = model_v7(x, ids, w, layer, cb, dup, C=C, fin_local=fin_local, epi=epi, rcap=rcap, sb=sb, rg=rg)
    E = layer.gate_trellis.shape[0]
    ref_ids, ref_w = ids.clone(), w.clone()
    ref_w[ref_ids >= E] = 0.0
    ref_ids[ref_ids >= E] = 0
    ref = moe_reference(x, layer, ref_ids, ref_w).numpy()
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert rel.max() < 2e-3, (rel, cfg)
    return cfg


@pytest.mark.parametrize("fin_local, epi", [(False, False), (True, False), (True, True)],
                         ids=["v7", "v21-local-finisher", "v26-dealt-epilogue"])
@pytest.mark.parametrize("K, cb, dup, I", [(2, "mcg", True, 256), (3, "mul1", False, 128)])
def test_v7_dataflow_matches_reference(K, cb, dup, I, fin_local, epi):
    """Cluster of 2 over a 256-wide layer: 9 rows on one expert (two groups), an out-of-range id."""
    H, E, top_k = 256, 10, 2
    layer = random_expert_layer(E, H, I, K, cb, seed=31 + K)
    gen = torch.Generator().manual_seed(6 + K)
    m = 10
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(m)])
    ids[:9, 0] = 4
    ids[ids[:, 1] == 4, 1] = 5
    ids[3, 1] = E + 2
    w = torch.softmax(torch.randn(m, top_k, generator=gen), -1) * 1.5
    x = torch.randn(m, H, generator=gen).half()
    cfg = _check(layer, ids, w, x, cb, dup, C=2, fin_local=fin_local, epi=epi)
    assert cfg["groups"] > len(torch.unique(ids[ids < E]))


def test_v7_cluster_of_eight_matches_reference():
    """The kernel's own cluster size at the smallest hidden it takes (1024: one block per CTA)."""
    H, I, E = 1024, 256, 6
    layer = random_expert_layer(E, H, I, 2, "mcg", seed=41)
    gen = torch.Generator().manual_seed(42)
    ids = torch.tensor([[1, 3], [3, 5]])
    w = torch.rand(2, 2, generator=gen)
    x = torch.randn(2, H, generator=gen).half()
    _check(layer, ids, w, x, "mcg", True, C=8)


def test_v26_epilogue_with_four_blocks_per_cta():
    """v26's dealt epilogue where a CTA owns several 128-column blocks (H 1024 over a cluster of 2:
    four), with one row and with a 6-row group (two 4-row chunks, the second partial)."""
    H, I, E = 1024, 128, 5
    layer = random_expert_layer(E, H, I, 2, "mcg", seed=43)
    gen = torch.Generator().manual_seed(44)
    ids = torch.tensor([[2, 0]] * 6 + [[1, 4]])
    w = torch.rand(7, 2, generator=gen)
    x = torch.randn(7, H, generator=gen).half()
    _check(layer, ids, w, x, "mcg", True, C=2, fin_local=True, epi=True)
    _check(layer, ids[6:], w[6:], x[6:], "mcg", True, C=2, fin_local=True, epi=True)


def test_v7_geometry_matches_the_binding():
    """What the kernel takes: the seat's TP8 slice and TP4, not TP1's 2048-wide intermediate."""
    assert geometry(4096, 256, 8) == {"nblk": 4, "kpc": 32, "kpw": 8, "wpb": 2, "n_ib": 2}
    assert geometry(4096, 512, 8) is not None
    assert geometry(4096, 2048, 8) is None
    assert geometry(1536, 256, 8) is None
    assert geometry(16384, 256, 8) is None


def test_v31_row_capped_partials_match_reference():
    """Variant 31: partial buffers of min(8, m) rows, alternating by unit, at three rows (a group of
    all three rows of one expert fills its buffer) and one row."""
    H, I, E = 2048, 256, 4
    layer = random_expert_layer(E, H, I, 3, "mcg", seed=47)
    gen = torch.Generator().manual_seed(48)
    ids = torch.tensor([[1, 2], [1, 3], [1, 0]])
    w = torch.rand(3, 2, generator=gen)
    x = torch.randn(3, H, generator=gen).half()
    _check(layer, ids, w, x, "mcg", True, C=2, fin_local=True, epi=True, rcap=True)
    _check(layer, ids[:1], w[:1], x[:1], "mcg", True, C=2, fin_local=True, epi=True, rcap=True)


def test_v36_single_partial_buffer_matches_reference():
    """Variant 36: one row-capped partial buffer that every unit reuses (8 units here, 4 rows)."""
    H, I, E = 2048, 256, 5
    layer = random_expert_layer(E, H, I, 3, "mcg", seed=49)
    gen = torch.Generator().manual_seed(50)
    ids = torch.tensor([[1, 2], [1, 3], [4, 0], [2, 1]])
    w = torch.rand(4, 2, generator=gen)
    x = torch.randn(4, H, generator=gen).half()
    cfg = _check(layer, ids, w, x, "mcg", True, C=2, fin_local=True, epi=True, rcap=True, sb=True)
    assert cfg["units"] == 10


def hot_routes(E, m, hot, gen):
    """Two random distinct experts per row; expert 4 takes the first `hot` rows' first slot (5 stands in
    where it would repeat) and row `hot` names expert 2 twice."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(m)])
    ids[:hot, 0] = 4
    ids[ids[:, 1] == 4, 1] = 5
    ids[hot] = torch.tensor([2, 2])
    return ids


def test_v40_rows_summed_by_the_unit_that_completes_them():
    """Variant 40: arrivals per (slice, row). A row with an expert twice (one entry), a row whose ids
    are all out of range (zeroed, never gathered), a nine-row expert (two groups); every counter
    returns to zero and every served row is gathered once per slice."""
    H, I, E = 2048, 256, 6
    layer = random_expert_layer(E, H, I, 2, "mcg", seed=51)
    gen = torch.Generator().manual_seed(52)
    m = 11
    ids = hot_routes(E, m, 9, gen)          # row 9: the same expert twice
    ids[10] = torch.tensor([E + 1, E + 3])  # nothing in range
    w = torch.rand(m, 2, generator=gen)
    x = torch.randn(m, H, generator=gen).half()
    got, _ = model_v7(x, ids, w, layer, "mcg", True, C=2, fin_local=True, epi=True, rcap=True, sb=True, rg=True)
    assert (got[10] == 0).all()
    _check(layer, ids[:10], w[:10], x[:10], "mcg", True, C=2, fin_local=True, epi=True, rcap=True, sb=True, rg=True)


def test_v58_v59_fixed_point_sums_match_reference_in_any_unit_order():
    """Variants 58 / 59: each unit adds its rows' weighted contributions into one int64 word per
    output element (fixed-point sum and arrival count), and the add that completes an element writes
    it. Routes like v40's, smaller (an expert twice in a row, a row with nothing in range, a
    four-row expert): the output is bitwise the same whatever order the units arrive in, every word
    returns to zero, the unserved row is zero, and it matches the fp64 reference."""
    H, I, E = 1024, 256, 6
    layer = random_expert_layer(E, H, I, 2, "mcg", seed=51)
    gen = torch.Generator().manual_seed(52)
    m = 6
    ids = hot_routes(E, m, 4, gen)
    ids[5] = torch.tensor([E + 1, E + 3])
    w = torch.rand(m, 2, generator=gen)
    x = torch.randn(m, H, generator=gen).half()
    flags = dict(fin_local=True, epi=True, rcap=True, sb=True, rg=True)  # v59 (v46's flags); v58 is v26's
    got, cfg = model_v7(x, ids, w, layer, "mcg", True, C=2, fxa=True, **flags)
    order = list(range(cfg["units"]))[::-1]
    rev, _ = model_v7(x, ids, w, layer, "mcg", True, C=2, fxa=True, order=order, **flags)
    assert np.array_equal(got, rev)
    assert (got[5] == 0).all()
    ref_w = w.clone()
    ref_w[ids >= E] = 0.0
    ref = moe_reference(x, layer, ids.clamp(max=E - 1), ref_w).numpy()
    rel = np.linalg.norm(got[:5] - ref[:5], axis=1) / np.linalg.norm(ref[:5], axis=1)
    assert rel.max() < 2e-3, rel
    one, _ = model_v7(x[:1], ids[:1], w[:1], layer, "mcg", True, C=2, fxa=True, fin_local=True, epi=True)
    assert np.array_equal(one[0], got[0])  # v58 (v26's flags) at one row: the same words, the same bits


def test_fxa_zero_weight_slot_adds_nothing_even_beside_a_non_finite_expert():
    """A slot whose routing weight is 0 contributes nothing under FXA, as the gather of the other
    builds skips it: an expert whose down scale is inf (its y rows non-finite) routed at weight 0
    leaves every element finite and bitwise what the same routes give on the clean layer. Its
    arrivals still count, so each row completes. v46's gather (no FXA) does the same."""
    H, I, E = 1024, 256, 4
    clean = random_expert_layer(E, H, I, 2, "mcg", seed=61)
    bad = random_expert_layer(E, H, I, 2, "mcg", seed=61)
    bad.down_svh[2] = float("inf")
    gen = torch.Generator().manual_seed(62)
    ids = torch.tensor([[2, 0], [1, 2], [3, 1]])
    w = torch.rand(3, 2, generator=gen)
    w[ids == 2] = 0.0
    x = torch.randn(3, H, generator=gen).half()
    flags = dict(fin_local=True, epi=True, rcap=True, sb=True, rg=True, fxa=True)
    got, _ = model_v7(x, ids, w, bad, "mcg", True, C=2, **flags)
    want, _ = model_v7(x, ids, w, clean, "mcg", True, C=2, **flags)
    assert np.isfinite(got).all() and np.array_equal(got, want)
    flags["fxa"] = False
    got, _ = model_v7(x, ids, w, bad, "mcg", True, C=2, **flags)
    want, _ = model_v7(x, ids, w, clean, "mcg", True, C=2, **flags)
    assert np.isfinite(got).all() and np.array_equal(got, want)


def test_fx_word_bounds():
    """The fixed-point word's bounds as lna2_v7.cu sets them: 32 contributions (top-k 8 x 4 blocks)
    at the limit of either sign sum exactly without touching the count bits or the sign, the count
    says "complete" only at the last add whatever the order, and one contribution out of range or
    not finite turns the element NaN even beside 31 at the opposite limit."""
    fx = fx_constants()
    lim = np.float32(fx["lim"])
    word = np.zeros(2, dtype=np.uint64)
    for i in range(32):
        o = fx_add(word, np.array([lim, -lim]), 32, fx)
        assert np.isnan(o).all() if i < 31 else (o.tolist() == [32 * lim, -32 * lim] and not word.any())
    gen = np.random.default_rng(3)
    vals = (gen.standard_normal((12, 64)) * 10.0).astype(np.float32)
    outs = []
    for _ in range(4):
        word = np.zeros(64, dtype=np.uint64)
        for i, k in enumerate(gen.permutation(12)):
            o = fx_add(word, vals[k], 12, fx)
            assert np.isnan(o).all() == (i < 11)
        outs.append(o)
    assert all(np.array_equal(outs[0], o) for o in outs)
    assert np.abs(outs[0] - vals.astype(np.float64).sum(axis=0)).max() < 1e-5
    word = np.zeros(3, dtype=np.uint64)
    for _ in range(31):
        fx_add(word, np.full(3, -lim), 32, fx)
    o = fx_add(word, np.array([2 * lim, np.inf, np.nan], dtype=np.float32), 32, fx)
    assert np.isnan(o).all() and not word.any()
