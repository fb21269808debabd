"""The index and fragment math of lna2's v2 kernel, checked on the CPU against the fp64 reference.

This is a model, not the CUDA kernel: numpy follows ``kernels/lna2/lna2_v2.cu`` lane by lane with
the kernel's own formulas -- the window words each lane reads, ``states8`` (including the
multiplier forms of the state extraction), the A fragment of W^T built from the EXL3 tile order,
the B fragment (x or the activation, with the MCG exact-sum duplication), an emulated
``mma.sync.m16n8k16``, the reduction of C fragments, the B-fragment-order stores of the rotated
input and of the activation, the ring's k-tile rows per warp, the k-split items and the gather --
and the result must match ``moe_reference``. What it cannot cover (scheduling, barriers, memory
ordering, the hardware MMA itself) is covered by the parity run on the GPU (scripts/lna2_device.py).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from dsv4serve.lna2.reference import moe_reference, random_expert_layer

MCG_MULT, MUL1_MULT = 0xCBAC1FED, 0x83DCD12D
M32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# per-lane arithmetic, as lna2_v2.cu / lna2_common.cuh do it


def lane_window(K, lane):
    if K == 2:
        w0 = ((lane + 31) >> 1) & 15
        return w0, (w0 + 1) & 15, 0 if lane & 1 else 16
    b0 = 24 * lane + 755
    w0 = (b0 >> 5) % 24
    return w0, (w0 + 1) % 24, b0 & 31


def funnel_l(lo, hi, n):
    """__funnelshift_l(lo, hi, n): the high word of (hi:lo) << (n & 31)."""
    n &= 31
    return ((((hi << 32) | lo) << n) >> 32) & M32


def kmul(K):
    mul = [1 << (2 + 2 * j) if K == 2 else (1 << (3 * j) if j < 6 else 8) for j in range(7)]
    return mul + [1 << 16]


def states8(K, wa, wb, sh):
    km = kmul(K)
    if K == 2:
        W = funnel_l(wb, wa, sh)
        s = [0] * 8
        s[0] = (((W * km[0]) & M32) * km[7]) >> 32  # __umulhi
        for j in (1, 2, 4, 5, 6):
            s[j] = ((W * km[j]) & M32) >> 16
        s[3] = (W >> 8) & 0xFFFF  # __byte_perm(W, 0, 0x4421)
        s[7] = W & 0xFFFF
        return s
    hi = funnel_l(wb, wa, sh)
    lo = (wb << sh) & M32
    F = funnel_l(lo, hi, 18)
    s = [hi >> 16]
    s += [(((hi * km[j]) & M32) * km[7]) >> 32 for j in (1, 2)]
    s += [((hi * km[j]) & M32) >> 16 for j in (3, 4, 5)]
    s += [F >> 16, ((F * km[6]) & M32) >> 16]
    return s


def byte_perm(x, y, sel):
    """__byte_perm(x, y, sel): result byte i is byte (sel >> 4i) & 7 of the 8 bytes y:x."""
    src = x | (y << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def states8_prm(wa, wb, sh):
    """states8<2, PRM = true>: W << 2, 4, 6 by multiplies, each state cut out by one byte permute."""
    km = kmul(2)
    W = funnel_l(wb, wa, sh)
    W2, W4, W6 = ((W * km[j]) & M32 for j in range(3))
    return [byte_perm(W2, 0, 0x4432), byte_perm(W4, 0, 0x4432), byte_perm(W6, 0, 0x4432), byte_perm(W, 0, 0x4421),
            byte_perm(W2, 0, 0x4421), byte_perm(W4, 0, 0x4421), byte_perm(W6, 0, 0x4421), byte_perm(W, 0, 0x4410)]


def h16(bits):
    return float(np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def f16bits(v):
    return int(np.array([v], dtype=np.float16).view(np.uint16)[0])


def lop3_mcg(x):
    return (x & 0x8FFF8FFF) ^ 0x3B603B60


def value(cb, s):
    """One weight, bit-exact to the format (fp16)."""
    if cb == "mcg":
        x = lop3_mcg((s * MCG_MULT) & M32)
        return float(np.float16(np.float32(h16(x)) + np.float32(h16(x >> 16))))
    x = (s * MUL1_MULT) & M32
    h = 0x6400 + sum((x >> (8 * i)) & 0xFF for i in range(4))
    return float(np.float16(np.float32(h16(h)) * np.float32(h16(0x1EEE)) + np.float32(h16(0xC931))))


def pair(lo_v, hi_v):
    return f16bits(lo_v) | (f16bits(hi_v) << 16)


def a_frag(cb, dup, s):
    """Registers fed to the MMA for one tile: dup -> two (a0..a3) sets, else one."""
    if cb == "mcg" and dup:
        L = [lop3_mcg((x * MCG_MULT) & M32) for x in s]
        return [(L[0], L[4], L[1], L[5]), (L[2], L[6], L[3], L[7])]
    v = [value(cb, x) for x in s]
    return [(pair(v[0], v[1]), pair(v[4], v[5]), pair(v[2], v[3]), pair(v[6], v[7]))]


def b_regs(cb, dup, v):
    """b_frag(): from the stored pair (x[2t], x[2t+1]), (x[2t+8], x[2t+9])."""
    x, y = v
    if cb == "mcg" and dup:
        d = lambda u, hi: ((u >> 16) * 0x10001 if hi else (u & 0xFFFF) * 0x10001)  # noqa: E731
        return [(d(x, 0), d(x, 1)), (d(y, 0), d(y, 1))]
    return [(x, y)]


def _frag_index():
    """Where each fp16 half of a lane's A (8 halves), B (4) and C / D (4) registers sits in the
    16x16, 16x8 and 16x8 matrices of mma.sync.m16n8k16 (PTX ISA's fragment layouts)."""
    g, t = np.arange(32)[:, None] >> 2, np.arange(32)[:, None] & 3
    a_r = np.hstack([g, g, g + 8, g + 8, g, g, g + 8, g + 8])
    a_c = np.hstack([2 * t, 2 * t + 1, 2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9, 2 * t + 8, 2 * t + 9])
    b_r = np.hstack([2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9])
    b_c = np.hstack([g, g, g, g])
    c_r = np.hstack([g, g, g + 8, g + 8])
    c_c = np.hstack([2 * t, 2 * t + 1, 2 * t, 2 * t + 1])
    return a_r, a_c, b_r, b_c, c_r, c_c


_FRAG = _frag_index()


def mma(A_regs, B_regs, C):
    """mma.sync.m16n8k16 f32.f16.f16.f32 on per-lane registers: A_regs[32][4], B_regs[32][2], C [32][4]
    (uint32 registers, each two fp16 halves, low half first); returns D as [32][4]."""
    a_r, a_c, b_r, b_c, c_r, c_c = _FRAG
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    Cm = np.zeros((16, 8))
    A[a_r, a_c] = np.asarray(A_regs, dtype=np.uint32).view(np.float16)
    B[b_r, b_c] = np.asarray(B_regs, dtype=np.uint32).view(np.float16)
    Cm[c_r, c_c] = np.asarray(C, dtype=np.float64)
    D = A @ B + Cm
    return D[c_r, c_c]


def fwht128(v):
    v = np.array(v, dtype=np.float64)
    h = 1
    while h < 128:
        v = v.reshape(-1, 2, h)
        v = np.stack([v[:, 0] + v[:, 1], v[:, 0] - v[:, 1]], axis=1).reshape(-1)
        h *= 2
    return v


def store_frag_pairs(tile, j, lane, vals):
    """tile: uint32 [32 lanes][2]; lane of a Hadamard warp holds kk = 4(lane%4)..+3 of its k-tile."""
    q = lane & 3
    t0, sl = 2 * (q & 1), q >> 1
    tile[4 * j + t0][sl] = pair(vals[0], vals[1])
    tile[4 * j + t0 + 1][sl] = pair(vals[2], vals[3])


# ---------------------------------------------------------------------------------------------
# what every v2-family model reads: the layer's arrays, the route plan, one warp's ring row of MMAs


def layer_arrays(layer):
    """Trellis words (uint32 in int64) and suh / svh as float64, per projection name."""
    words = {name: getattr(layer, name + "_trellis").contiguous().view(torch.int32).numpy().astype(np.int64) & M32
             for name in ("gate", "up", "down")}
    suh = {n: getattr(layer, n + "_suh").double().numpy() for n in ("gate", "up", "down")}
    svh = {n: getattr(layer, n + "_svh").double().numpy() for n in ("gate", "up", "down")}
    return words, suh, svh


def route_plan(ids, n_e):
    """build_plan: per-expert row masks, first entries (entries sorted by expert, then row), and
    groups (expert, first entry, rows) of <= 8 rows of one expert; and the entry count."""
    m, top_k = ids.shape
    mask = [0] * n_e
    for p in range(m * top_k):
        e = int(ids.view(-1)[p])
        if 0 <= e < n_e:
            mask[e] |= 1 << (p // top_k)
    rbase, groups, gr = [0] * n_e, [], 0
    for e in range(n_e):
        rows = [r for r in range(32) if mask[e] >> r & 1]
        rbase[e] = gr
        for i in range(0, len(rows), 8):
            groups.append((e, gr + i, rows[i:i + 8]))
        gr += len(rows)
    return mask, rbase, groups, gr


def entry_of(mask, rbase, e, r):
    """The entry of (expert e, row r): gather_cols' rbase + popc of the lower rows."""
    return rbase[e] + bin(mask[e] & ((1 << r) - 1)).count("1")


def zero_acc():
    return [[[0.0] * 4 for _ in range(32)] for _ in range(8)]


@functools.lru_cache(maxsize=1 << 16)
def tile_a_regs(K, cb, dup, tw):
    """One tile's A registers as the 32 lanes decode them from its trellis words `tw` (a tuple):
    per MMA of the tile (two with MCG's duplication), uint32 [32 lanes][4]. A pure function of the
    words, so it is cached: the models decode the same tiles once per group and once per run, and a
    test runs several models over one layer. The arrays are read-only, so no caller can alter what
    the next one reads; a full cache holds ~150 MB."""
    afr = []
    for ln in range(32):
        w0, w1, sh = lane_window(K, ln)
        afr.append(a_frag(cb, dup, states8(K, tw[w0], tw[w1], sh)))
    regs = tuple(np.array([afr[ln][h] for ln in range(32)], dtype=np.uint32) for h in range(len(afr[0])))
    for r in regs:
        r.setflags(write=False)
    return regs


def ring_row_mma(words, K, cb, dup, H, I):
    """mma_row(proj, e, kt, nt0, b_of_lane, acc): one warp's ring row, 8 tiles of k-tile kt from
    n-tile nt0, decoded per lane and fed to the emulated m16n8k16 (lna2_tile.cuh mma_row)."""
    WPT, ntn_gu, ntn_dn = 8 * K, I // 16, H // 16

    def tile_words(proj, e, kt_, nt_):
        ntn = ntn_dn if proj == "down" else ntn_gu
        return words[proj][e].reshape(-1)[(kt_ * ntn + nt_) * WPT:(kt_ * ntn + nt_ + 1) * WPT]

    def mma_row(proj, e, kt_, nt0, b_of_lane, acc):
        for nt in range(8):
            afr = tile_a_regs(K, cb, dup, tuple(int(v) for v in tile_words(proj, e, kt_, nt0 + nt)))
            bfr = [b_regs(cb, dup, b_of_lane(ln)) for ln in range(32)]
            for h, a_regs in enumerate(afr):
                acc[nt] = mma(a_regs, [bfr[ln][h] for ln in range(32)], acc[nt])

    return mma_row


def warp_rows(acc):
    """write_red: one warp's C fragments -> [8 rows][128]."""
    out = np.zeros((8, 128))
    for nt in range(8):
        for ln in range(32):
            g, t = ln >> 2, ln & 3
            for i, (dn, dr) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
                out[2 * t + dr, nt * 16 + g + dn] = acc[nt][ln][i]
    return out


# ---------------------------------------------------------------------------------------------
# the launch, item by item


def model_v2(x, ids, w, layer, cb, dup, G=8, items_x8=11, limit=10.0, db=1, big=False):
    K, H, I = layer.K, layer.hidden, layer.inter
    m, top_k = ids.shape
    n_e = layer.gate_trellis.shape[0]
    words, suh, svh = layer_arrays(layer)
    # plan: entries sorted by (expert, row); groups of <= 8 rows of one expert
    mask, rbase, groups, gr = route_plan(ids, n_e)
    ng = len(groups)
    # make_cfg
    n_ib, n_cb, kt = I // 128, H // 128, H // 16
    target = max(1, G * items_x8 // 8)
    KCI = 16 if kt % 16 == 0 else 8
    if KCI == 16 and ng * n_ib * (kt // 16) < target:
        KCI = 8
    if big and KCI == 16 and kt % 32 == 0 and ng * n_ib * (kt // 32) >= target:  # make_cfg<true> (v55)
        KCI = 32
    nchunk = kt // KCI
    ks = nchunk
    while ks % 2 == 0 and (ng * n_ib * (ks // 2) >= target or ks * gr > 1024):
        ks //= 2
    KS, R, KW = ks, nchunk // ks, KCI // 4
    part = np.zeros((KS, gr, 2, I))
    act = np.zeros((ng, I // 16, 32, 2), dtype=np.int64)
    y = np.zeros((gr, H))
    xh = x.numpy()
    mma_row = ring_row_mma(words, K, cb, dup, H, I)

    for gi, (e, ent0, rws) in enumerate(groups):
        rows = len(rws)
        # gate/up items (ib, kc) and their chunks
        for ib in range(n_ib):
            for kc in range(KS):
                accs = {wp: zero_acc() for wp in range(8)}
                for ch in range(R):
                    cols = KCI * 16
                    k0 = (kc * R + ch) * cols
                    xs = np.zeros((2, KCI, 32, 2), dtype=np.int64)
                    for proj_i, proj in enumerate(("gate", "up")):
                        for j in range(rows):
                            for blk in range(cols // 128):
                                v = xh[rws[j], k0 + blk * 128:k0 + blk * 128 + 128].astype(np.float64)
                                v = v * suh[proj][e, k0 + blk * 128:k0 + blk * 128 + 128]
                                v = fwht128(v) / np.sqrt(128)
                                for ln in range(32):
                                    store_frag_pairs(xs[proj_i, blk * 8 + (ln >> 2)], j, ln, v[4 * ln:4 * ln + 4])
                    for sub in range(KW):
                        for wp in range(8):
                            proj_i, ksub = wp & 1, wp >> 1
                            kt_ = (kc * R + ch) * KCI + ksub * KW + sub
                            kl = ksub * KW + sub
                            mma_row(("gate", "up")[proj_i], e, kt_, ib * 8,
                                    lambda ln, pi=proj_i, kl=kl: (int(xs[pi, kl, ln, 0]), int(xs[pi, kl, ln, 1])),
                                    accs[wp])
                for proj_i in range(2):
                    tot = sum(warp_rows(accs[2 * ks_ + proj_i])[:rows] for ks_ in range(4))
                    part[kc, ent0:ent0 + rows, proj_i, ib * 128:ib * 128 + 128] = tot
            # finisher for (group, ib)
            col = slice(ib * 128, ib * 128 + 128)
            for j in range(rows):
                gv = fwht128(part[:, ent0 + j, 0, col].sum(0)) / np.sqrt(128) * svh["gate"][e, col]
                uv = fwht128(part[:, ent0 + j, 1, col].sum(0)) / np.sqrt(128) * svh["up"][e, col]
                gg = np.minimum(gv, limit)
                uu = np.clip(uv, -limit, limit)
                av = gg / (1 + np.exp(-gg)) * uu * suh["down"][e, col]
                av = fwht128(av) / np.sqrt(128)
                for ln in range(32):
                    store_frag_pairs(act[gi, ib * 8 + (ln >> 2)], j, ln, av[4 * ln:4 * ln + 4])
        # down items: db output blocks each; warp wp serves block blk * db + wp // wb over its
        # share of the k-tiles (run_dn / copy_row / epilogue_dn with c.DB, c.WB, c.KWd)
        wb = 8 // db
        kwd = (I // 16) // wb
        for blk in range(n_cb // db):
            tot = {cbk: np.zeros((rows, 128)) for cbk in range(blk * db, blk * db + db)}
            for wp in range(8):
                cbk = blk * db + wp // wb
                acc = zero_acc()
                for st in range(kwd):
                    kt_ = (wp % wb) * kwd + st
                    mma_row("down", e, kt_, cbk * 8, lambda ln, kt_=kt_: (int(act[gi, kt_, ln, 0]),
                                                                         int(act[gi, kt_, ln, 1])), acc)
                tot[cbk] += warp_rows(acc)[:rows]
            for cbk, t_ in tot.items():
                for j in range(rows):
                    y[ent0 + j, cbk * 128:cbk * 128 + 128] = fwht128(t_[j]) / np.sqrt(128) * \
                        svh["down"][e, cbk * 128:cbk * 128 + 128]
    # gather: slots in order
    out = np.zeros((m, H))
    for r in range(m):
        for s_ in range(top_k):
            e = int(ids[r, s_])
            if 0 <= e < n_e:
                ent = entry_of(mask, rbase, e, r)
                out[r] += float(w[r, s_]) * y[ent]
    return out, {"KS": KS, "R": R, "KCI": KCI, "groups": ng}


@pytest.mark.parametrize("K, cb, dup", [(2, "mcg", True), (3, "mcg", True), (2, "mcg", False), (3, "mul1", False)])
def test_v2_dataflow_matches_reference(K, cb, dup):
    H, I, E, top_k = 256, 256, 12, 3
    layer = random_expert_layer(E, H, I, K, cb, seed=11 + K)
    gen = torch.Generator().manual_seed(5 + K)
    m = 10
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(m)])
    ids[:9, 0] = 4  # expert 4 has 9 rows: two groups (8 + 1)
    ids[ids[:, 1] == 4, 1] = 5
    ids[ids[:, 2] == 4, 2] = 6
    ids[3, 2] = E + 3  # an out-of-range id contributes nothing
    w = torch.softmax(torch.randn(m, top_k, generator=gen), -1) * 1.5
    x = torch.randn(m, H, generator=gen).half()
    got, cfg = model_v2(x, ids, w, layer, cb, dup, G=4)
    ref_ids = ids.clone()
    ref_w = w.clone()
    ref_w[ref_ids >= E] = 0.0
    ref_ids[ref_ids >= E] = 0
    ref = moe_reference(x, layer, ref_ids, ref_w).numpy()
    rel = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert cfg["groups"] > len(torch.unique(ids[ids < E]))  # the 9-row expert really split
    assert rel.max() < 2e-3, (rel, cfg)


def test_v55_big_chunks_match_reference():
    """v55 (make_cfg<true>): where one-chunk items would still be enough, gate/up chunks hold 32
    k-tiles, each warp eight consecutive ones of its projection, two chunks an item here; one
    expert has five rows."""
    H, I, E, top_k = 1024, 128, 6, 2
    layer = random_expert_layer(E, H, I, 2, "mcg", seed=31)
    gen = torch.Generator().manual_seed(32)
    m = 5
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(m)])
    ids[:, 0] = 4
    ids[ids[:, 1] == 4, 1] = 5
    w = torch.softmax(torch.randn(m, top_k, generator=gen), -1)
    x = torch.randn(m, H, generator=gen).half()
    got, cfg = model_v2(x, ids, w, layer, "mcg", True, G=2, big=True)
    assert cfg["KCI"] == 32 and cfg["R"] == 2
    ref = moe_reference(x, layer, ids, w).numpy()
    assert (np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)).max() < 2e-3


def raw_staging_big(KCI, rows):
    """load_raw_big / store_raw_big (lna2_v2.cu): which (row, piece of 8 inputs) each thread stages,
    prefetched or read in store_raw, and which scale words (projection, word) it stages."""
    kws = {8: 1, 16: 2, 32: 3}[KCI]
    cols, psh = KCI * 16, kws + 3
    xs, ss = [], []
    for t in range(256):
        j, piece = t >> psh, t & ((1 << psh) - 1)
        if j < rows:
            xs.append((j, piece))
        if KCI == 32:
            xs += [(jj, piece) for jj in range(j + 4, rows, 4)]  # RAW_ROWS_BIG = 256 / 64
        proj, idx = t >> 7, t & 127
        if KCI == 32:
            ss += [(proj, 2 * idx), (proj, 2 * idx + 1)]
        elif idx * 2 < cols:
            ss.append((proj, idx))
    return xs, ss, cols


@pytest.mark.parametrize("KCI", [8, 16, 32])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8])
def test_v55_raw_staging_covers_each_input_once(KCI, rows):
    """Every input of the chunk's rows and every scale word of both projections is staged by exactly
    one thread, for each chunk size a v55 launch can pick and group sizes on both sides of the four
    rows one 32-k-tile pass holds."""
    xs, ss, cols = raw_staging_big(KCI, rows)
    assert sorted(xs) == [(j, p) for j in range(rows) for p in range(cols // 8)]
    assert sorted(ss) == [(pr, wd) for pr in range(2) for wd in range(cols // 2)]


def test_v2_paired_down_items_match_reference():
    """Down items of two output blocks (c.DB = 2, 4 warps per block, twice the k-tiles per warp)."""
    H, I, E, top_k = 256, 256, 8, 2
    layer = random_expert_layer(E, H, I, 2, "mcg", seed=21)
    gen = torch.Generator().manual_seed(22)
    m = 5
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(m)])
    w = torch.softmax(torch.randn(m, top_k, generator=gen), -1)
    x = torch.randn(m, H, generator=gen).half()
    got, _ = model_v2(x, ids, w, layer, "mcg", True, G=4, db=2)
    ref = moe_reference(x, layer, ids, w).numpy()
    assert (np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)).max() < 2e-3


def test_v2_k_split_items_cover_k_once():
    """With many CTAs the gate/up k-range is split into items of one chunk each (KS > 1, R = 1)."""
    layer = random_expert_layer(4, 512, 128, 2, "mcg", seed=3)
    gen = torch.Generator().manual_seed(9)
    ids = torch.tensor([[0, 1], [2, 1]])
    w = torch.rand(2, 2, generator=gen)
    x = torch.randn(2, 512, generator=gen).half()
    got, cfg = model_v2(x, ids, w, layer, "mcg", True, G=64)
    assert cfg["KS"] > 1 and cfg["KCI"] == 8
    ref = moe_reference(x, layer, ids, w).numpy()
    assert (np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)).max() < 2e-3


def test_byte_permute_states_match_the_shift_states():
    """v7's PRM extraction (K2) cuts the same 8 states as the shift/multiply one, at every lane's window."""
    rng = np.random.default_rng(7)
    for lane in range(32):
        w0, w1, sh = lane_window(2, lane)
        for wa, wb in rng.integers(0, 2**32, size=(64, 2), dtype=np.uint64).tolist():
            assert states8_prm(wa, wb, sh) == states8(2, wa, wb, sh)


# ---------------------------------------------------------------------------------------------
# v53's ring (lna2_v2.cu, GRP): one cp.async commit group per issued row, a steady step that issues
# one row without issue_due's loop, and cp.async.wait_group counts in place of mbarrier phases


def ring_schedule(nsts, learn_after, S=4):
    """One warp's ring through items of `nsts` stages, in V2Kernel's order: each item starts with
    issue_due, then runs its steps; the next item is learnt at step `learn_after[i]` of item i (or at
    its end, where run() learns it). Yields per step (q, rows issued so far in order, the wait's
    group count, whether the steady branch ran, the rows issue_due would have issued there)."""
    base_cur, issued, rows = 0, 0, []
    out = []
    for i, nst in enumerate(nsts):
        nxt_nst = nsts[i + 1] if i + 1 < len(nsts) else 0
        known = False

        def due(q):
            base_nxt = base_cur + nst
            horizon = (base_nxt + nxt_nst if known else base_nxt) - 1
            return list(range(issued, min(q + S - 1, horizon) + 1))

        q0 = base_cur
        new = due(q0)                            # run_gu / run_dn: issue_due before the first step
        rows += new
        issued += len(new)
        for j in range(nst):
            q = base_cur + j
            if j == learn_after[i]:
                known = True
            general = due(q)
            steady = issued == q + S - 1 and issued < base_cur + nst
            if steady:
                rows.append(issued)              # copy_row<KIND>(cur, issued - base_cur, ...)
                issued += 1
                newer = S - 1
            else:
                rows += general
                issued += len(general)
                newer = issued - 1 - q
            out.append((q, list(rows), newer, steady, general))
        base_cur += nst
    return out


@pytest.mark.parametrize("seed", range(40))
def test_grp_ring_waits_for_exactly_the_row_it_reads(seed):
    """With one commit group per row, `cp.async.wait_group n` completes every row but the n newest:
    the wait a step chooses must cover the row it reads (q) and be a count the 4-slot ring can
    spell (0..3); rows are issued once each, in order (the groups' order is the rows' order); a row
    never lands in a slot whose row is still unread; and the steady branch issues exactly the row
    issue_due would have issued there."""
    rng = np.random.default_rng(seed)
    S = 4
    n_items = int(rng.integers(1, 8))
    nsts = [int(v) for v in rng.choice([0, 1, 2, 3, 4, 5, 8, 16, 32, 64], size=n_items)]
    learn_after = [int(rng.integers(0, max(n, 1) + 1)) for n in nsts]  # == n: learnt at the item's end
    steps = ring_schedule(nsts, learn_after, S)
    assert [q for q, *_ in steps] == list(range(sum(nsts)))
    for q, rows, newer, steady, general in steps:
        assert rows == list(range(len(rows))), "each row issued once, in order"
        assert 0 <= newer <= S - 1
        done = rows[: len(rows) - newer]
        assert q in done, (q, rows, newer)
        assert max(rows) <= q + S - 1, "a slot is refilled only after its row was read"
        if steady:
            assert general == [q + S - 1], (q, general)
    assert steps == [] or steps[-1][1] == list(range(sum(nsts)))


def test_grp_ring_takes_the_steady_branch_inside_long_items():
    """Inside an item of 64 stages (a TP1 gate/up item) the general loop runs only at the item's
    first step (its rows were issued ahead) and its last S - 1 (which issue the next item's rows):
    59 of 64 steps take the steady branch, whenever the next item is learnt."""
    for learn in ([0, 0], [10, 10], [64, 64]):
        steps = ring_schedule([64, 64], learn)
        general = [q for q, _, _, steady, _ in steps if not steady]
        assert general == [0, 61, 62, 63, 64, 125, 126, 127], (learn, general)


# ---------------------------------------------------------------------------------------------
# v54's rows (lna2_v2.cu, KT2): two consecutive k-tiles of a warp's share per ring row


def kt1_gate_up_ktiles(R, kws, KCI):
    """copy_row's gate/up k-tiles (offsets within the warp's share) in stage order, one per stage."""
    return [(st >> kws) * KCI + (st & ((1 << kws) - 1)) for st in range(R << kws)]


def kt2_rows(kind, R, kws, KCI, KWd):
    """locate's KT2 stage count and copy_row2's k-tiles per row (the second only where it is copied)."""
    nst = R << (kws - 1) if kind == "gu" else (KWd + 1) >> 1
    rows = []
    for st in range(nst):
        if kind == "gu":
            ksh = kws - 1
            kt = (st >> ksh) * KCI + ((st & ((1 << ksh) - 1)) << 1)
            second = True
        else:
            kt = st << 1
            second = kt + 1 < KWd
        rows.append([kt, kt + 1] if second else [kt])
    return rows


@pytest.mark.parametrize("KCI, R", [(16, 1), (16, 4), (16, 16), (8, 1), (8, 3), (8, 32), (32, 1), (32, 8)])
def test_kt2_gate_up_rows_hold_the_one_k_tile_sequence(KCI, R):
    """A KT2 gate/up row holds the two k-tiles that two of v53's consecutive stages would: the same
    k-tiles, once each, in the same order (so each warp's MMAs accumulate in v53's order and the
    outputs are v53's bits), and gu_chunk's B fragments (ksub * kw + sub, + 1) follow the rows."""
    kws = {8: 1, 16: 2, 32: 3}[KCI]  # 32: v55's big chunks
    kw = 1 << kws
    rows = kt2_rows("gu", R, kws, KCI, 0)
    assert [k for r in rows for k in r] == kt1_gate_up_ktiles(R, kws, KCI)
    # gu_chunk: chunk ch, sub = 0, 2, ...: row st = ch * kw / 2 + sub / 2 holds sub and sub + 1
    for ch in range(R):
        for sub in range(0, kw, 2):
            st = ch * (kw // 2) + sub // 2
            assert rows[st] == [ch * KCI + sub, ch * KCI + sub + 1]


@pytest.mark.parametrize("KWd", [1, 2, 3, 4, 7, 16, 32])
def test_kt2_down_rows_and_b_prefetch_follow_the_k_tiles(KWd):
    """A down share of any length: rows of two k-tiles, the last one half filled when the share is
    odd (copy_row2 copies no second half past the share, run_dn reads none); run_dn's B fragments
    (bq0, bq1 for this row, nq0 / nq1 requested for the next) are always the row's k-tiles."""
    rows = kt2_rows("dn", 0, 1, 16, KWd)
    assert [k for r in rows for k in r] == list(range(KWd))
    bq0, bq1 = 0, (1 if KWd > 1 else None)  # run_dn: bq0 = act[kt0], bq1 = act[kt0 + 1] if KWd > 1
    for i, st in enumerate(range(0, KWd, 2)):
        nq0 = st + 2 if st + 2 < KWd else None
        nq1 = st + 3 if st + 3 < KWd else None
        used = [bq0] + ([bq1] if st + 1 < KWd else [])
        assert used == rows[i]
        bq0, bq1 = nq0, nq1
