"""Tests for the pure-PyTorch EXL3 / routed-MoE reference (dsv4serve.lna2.reference).

The checks lean on independent constructions written here with plain Python ints, numpy fp16
scalars and explicit loops, so a shared misunderstanding between the reference and its test
has to be made twice, in two different styles, to slip through.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsv4serve.lna2 import reference as ref

# --- independent scalar helpers -------------------------------------------------------------


def _f16(bits: int) -> np.float16:
    return np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0]


def _f16_bits(value: float) -> int:
    return int(np.array([value], dtype=np.float16).view(np.uint16)[0])


def _py_codebook_bits(name: str, state: int) -> int:
    """fp16 bit pattern of one state's value, from Python ints and numpy scalars only."""
    m32 = (1 << 32) - 1
    if name == "mul1":
        x = (state * 0x83DCD12D) & m32
        bytesum = sum((x >> (8 * i)) & 0xFF for i in range(4))
        h = float(_f16(0x6400 + bytesum))  # the fp16 bit trick the kernel uses
        assert h == 1024 + bytesum
        # float64 holds h*k_inv + k_bias exactly, so the one rounding below is the fma's.
        return _f16_bits(h * float(_f16(0x1EEE)) + float(_f16(0xC931)))
    if name == "3inst":
        x = (state * 89226354 + 64248484) & m32
    else:
        x = (state * 0xCBAC1FED) & m32
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    return _f16_bits(float(_f16(x & 0xFFFF)) + float(_f16(x >> 16)))


def _stream_words(tile_words: list[int]) -> list[int]:
    """Stored int16 words -> stream-order uint16 words (undo the pairwise swap)."""
    u = [w & 0xFFFF for w in tile_words]
    out: list[int] = []
    for i in range(0, len(u), 2):
        out += [u[i + 1], u[i]]
    return out


def _py_states(tile_words: list[int], K: int) -> list[int]:
    """States of one tile as circular 16-bit windows of a big-int bitstream."""
    n_bits = 256 * K
    stream = 0
    for w in _stream_words(tile_words):
        stream = (stream << 16) | w
    doubled = (stream << n_bits) | stream
    states = []
    for t in range(256):
        start = ((t + 1) * K - 16) % n_bits
        states.append((doubled >> (2 * n_bits - start - 16)) & 0xFFFF)
    return states


def _py_pack(codes: list[int], K: int) -> list[int]:
    """Hand-pack K-bit codes: MSB-first stream, MSB-first 16-bit words, swap pairs, as int16."""
    stream = 0
    for c in codes:
        stream = (stream << K) | (c & ((1 << K) - 1))
    n_words = 16 * K
    words = [(stream >> (16 * (n_words - 1 - i))) & 0xFFFF for i in range(n_words)]
    swapped = []
    for i in range(0, n_words, 2):
        swapped += [words[i + 1], words[i]]
    return [w - 0x10000 if w >= 0x8000 else w for w in swapped]


def _py_hadamard() -> torch.Tensor:
    h = torch.tensor(
        [[(-1.0) ** bin(i & j).count("1") for j in range(128)] for i in range(128)], dtype=torch.float64
    )
    return h / math.sqrt(128)


def _rand_trellis(shape: tuple[int, ...], K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-32768, 32768, (*shape, 16 * K), dtype=torch.int16, generator=g)


# --- bitstream ------------------------------------------------------------------------------


@pytest.mark.parametrize("K", range(1, 9))
def test_pack_decode_roundtrip(K: int) -> None:
    words = _rand_trellis((3, 5), K, seed=K)
    states = ref.decode_states(words, K)
    assert states.shape == (3, 5, 256) and states.dtype == torch.int64
    assert int(states.min()) >= 0 and int(states.max()) <= 0xFFFF
    assert torch.equal(ref.pack_trellis(states, K), words)
    assert torch.equal(ref.encode_states(states, K), words)


@pytest.mark.parametrize("K", range(1, 9))
def test_shift_register_property(K: int) -> None:
    states = ref.decode_states(_rand_trellis((4, 3), K, seed=100 + K), K)
    prev = torch.roll(states, 1, dims=-1)  # position 0's predecessor is position 255 (tail-biting)
    code = states & ((1 << K) - 1)
    assert torch.equal(((prev << K) | code) & 0xFFFF, states)
    assert ref.states_are_consistent(states, K)
    broken = states.clone()
    broken[0, 0, 17] ^= 1 << 15  # a bit outside the low-K code breaks the register
    assert not ref.states_are_consistent(broken, K)
    with pytest.raises(ValueError):
        ref.encode_states(broken, K)


@pytest.mark.parametrize("K", range(1, 9))
def test_decode_matches_bigint_windows(K: int) -> None:
    words = _rand_trellis((2, 2), K, seed=200 + K)
    states = ref.decode_states(words, K)
    for tk in range(2):
        for tn in range(2):
            want = _py_states(words[tk, tn].tolist(), K)
            assert states[tk, tn].tolist() == want


@pytest.mark.parametrize("K", range(1, 9))
def test_decode_hand_packed_codes(K: int) -> None:
    rng = np.random.default_rng(300 + K)
    codes = [int(c) for c in rng.integers(0, 1 << K, size=256)]
    words = torch.tensor(_py_pack(codes, K), dtype=torch.int16).reshape(1, 1, 16 * K)
    states = ref.decode_states(words, K)
    assert (states & ((1 << K) - 1)).reshape(-1).tolist() == codes
    assert torch.equal(ref.pack_trellis(torch.tensor(codes).reshape(1, 1, 256), K), words)


def test_first_bits_live_in_second_word_of_pair() -> None:
    # K=8: position 0's code is the stream's first byte, the high byte of the *second* int16.
    codes = [0] * 256
    codes[0] = 0xA5
    words = ref.pack_trellis(torch.tensor(codes).reshape(1, 1, 256), 8)
    assert words[0, 0, 1].item() == (0xA500 - 0x10000) and words[0, 0, 0].item() == 0
    # Position 0's window wraps: its high byte is the last code of the tile.
    codes[255] = 0x3C
    states = ref.decode_states(ref.pack_trellis(torch.tensor(codes).reshape(1, 1, 256), 8), 8)
    assert states[0, 0, 0].item() == 0x3CA5


def test_bad_trellis_rejected() -> None:
    with pytest.raises(ValueError):
        ref.decode_states(torch.zeros(1, 1, 30, dtype=torch.int16), 2)
    with pytest.raises(TypeError):
        ref.decode_states(torch.zeros(1, 1, 32, dtype=torch.int32), 2)
    with pytest.raises(ValueError):
        ref.decode_states(torch.zeros(1, 1, 144, dtype=torch.int16), 9)


# --- codebooks ------------------------------------------------------------------------------

# exl3-reference §1.4, over all 65,536 states (population std; sample std rounds the same).
_STATS = {"3inst": (1.2437, -3.96, 3.96), "mcg": (1.2441, -3.95, 3.95), "mul1": (1.0003, -3.45, 3.35)}


@pytest.mark.parametrize("name", ref.CODEBOOKS)
def test_codebook_statistics(name: str) -> None:
    lut = ref.codebook_lut(name)
    assert lut.shape == (65536,) and lut.dtype == torch.float16
    v = lut.double()
    assert torch.isfinite(v).all()
    std, lo, hi = _STATS[name]
    assert round(float(v.std(unbiased=False)), 4) == std
    assert round(float(v.std()), 4) == std
    assert round(float(v.min()), 2) == lo
    # The doc's "±3.96" for 3INST is rounded loosely: the true maximum is 3.97265625.
    assert abs(round(float(v.max()), 2) - hi) <= (0.011 if name == "3inst" else 0.0)


@pytest.mark.parametrize("name", ref.CODEBOOKS)
def test_codebook_spot_values_bit_exact(name: str) -> None:
    lut_bits = ref.codebook_lut(name).view(torch.int16).to(torch.int64) & 0xFFFF
    rng = np.random.default_rng(7)
    states = [0, 1, 2, 0x7FFF, 0x8000, 0x1234, 0xFFFF] + [int(s) for s in rng.integers(0, 65536, size=200)]
    for s in states:
        assert lut_bits[s].item() == _py_codebook_bits(name, s), (name, s)


def test_codebook_known_constants() -> None:
    # MCG state 0 multiplies to 0: both halves are 0x3B60 (0.9219), summing to 1.84375 exactly.
    assert float(ref.codebook_lut("mcg")[0]) == 2 * float(_f16(0x3B60))
    # MUL1 state 0: bytesum 0 -> 1024 * k_inv + k_bias.
    assert float(ref.codebook_lut("mul1")[0]) == float(
        np.float16(1024 * float(_f16(0x1EEE)) + float(_f16(0xC931)))
    )
    assert float(_f16(0xC931)) == -10.3828125
    assert ref.MCG_MARKER == 0xCBAC1FED - (1 << 32)
    assert ref.MUL1_MARKER == 0x83DCD12D - (1 << 32)


def test_codebook_lut_is_a_copy() -> None:
    a = ref.codebook_lut("mcg")
    a[0] = 0
    assert float(ref.codebook_lut("mcg")[0]) != 0


def test_codebook_from_markers() -> None:
    assert ref.codebook_from_markers() == "3inst"
    assert ref.codebook_from_markers(mcg=torch.tensor(ref.MCG_MARKER, dtype=torch.int32)) == "mcg"
    assert ref.codebook_from_markers(mcg=torch.tensor([ref.MCG_MARKER], dtype=torch.int32)) == "mcg"
    assert ref.codebook_from_markers(mul1=ref.MUL1_MARKER) == "mul1"
    with pytest.raises(ValueError):
        ref.codebook_from_markers(mcg=ref.MCG_MARKER, mul1=ref.MUL1_MARKER)
    with pytest.raises(ValueError):
        ref.codebook_from_markers(mcg=123)
    assert ref.codebook_from_markers(mcg=123, check_values=False) == "mcg"
    assert ref.codebook_marker("mcg") == ref.MCG_MARKER and ref.codebook_marker("3inst") is None
    with pytest.raises(ValueError):
        ref.codebook_lut("nope")


# --- tensor-core permutation ----------------------------------------------------------------


def test_tensor_core_perm() -> None:
    perm = ref.tensor_core_perm()
    assert perm.dtype == torch.int64 and sorted(perm.tolist()) == list(range(256))
    inv = ref.inverse_tensor_core_perm()
    assert torch.equal(perm[inv], torch.arange(256)) and torch.equal(inv[perm], torch.arange(256))

    def rc(p: int) -> tuple[int, int]:
        return divmod(int(perm[p]), 16)

    # lane 0: rows 0, 1, 8, 9 in column 0, then the same rows in column 8
    assert [rc(p) for p in range(8)] == [(0, 0), (1, 0), (8, 0), (9, 0), (0, 8), (1, 8), (8, 8), (9, 8)]
    # lane 5: r0 = 2 * (5 % 4) = 2, c0 = 5 // 4 = 1
    assert rc(40) == (2, 1) and rc(43) == (11, 1) and rc(46) == (10, 9)
    # lane 31: r0 = 6, c0 = 7
    assert rc(248) == (6, 7) and rc(255) == (15, 15)
    # lane 14: r0 = 4, c0 = 3
    assert rc(8 * 14 + 1) == (5, 3) and rc(8 * 14 + 5) == (5, 11)


def test_reconstruct_places_positions_by_perm() -> None:
    K = 3
    words = _rand_trellis((2, 3), K, seed=11)
    w_rot = ref.reconstruct_rot(words, K, "mcg")
    assert w_rot.shape == (32, 48) and w_rot.dtype == torch.float16
    states = ref.decode_states(words, K)
    lut = ref.codebook_lut("mcg")
    for tk in range(2):
        for tn in range(3):
            for lane in range(32):
                for j in range(8):
                    r = 2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1)
                    c = lane // 4 + 8 * (j >> 2)
                    got = w_rot[16 * tk + r, 16 * tn + c]
                    assert got.view(torch.int16) == lut[states[tk, tn, 8 * lane + j]].view(torch.int16)


# --- Hadamard -------------------------------------------------------------------------------


def test_hadamard_128() -> None:
    h = ref.hadamard_128()
    assert h.shape == (128, 128) and h.dtype == torch.float64
    assert torch.allclose(h @ h.T, torch.eye(128, dtype=torch.float64), atol=1e-13, rtol=0)
    assert torch.equal(h, h.T)
    assert torch.allclose(h.abs(), torch.full_like(h, 1 / math.sqrt(128)), atol=1e-15, rtol=0)
    assert torch.equal(h, _py_hadamard())
    assert ref.hadamard_128(torch.float32).dtype == torch.float32
    x = torch.randn(3, 256, dtype=torch.float64)
    blocks = torch.block_diag(_py_hadamard(), _py_hadamard())
    assert torch.allclose(ref.hadamard_rotate(x), x @ blocks, atol=1e-13, rtol=0)


# --- dequantisation -------------------------------------------------------------------------


def _slow_w_rot(words: torch.Tensor, K: int, name: str) -> np.ndarray:
    tk_n, tn_n, _ = words.shape
    out = np.zeros((16 * tk_n, 16 * tn_n), dtype=np.uint16)
    cache: dict[int, int] = {}
    for tk in range(tk_n):
        for tn in range(tn_n):
            states = _py_states(words[tk, tn].tolist(), K)
            for p, s in enumerate(states):
                lane, j = divmod(p, 8)
                r = 2 * (lane % 4) + (j % 2) + (8 if j % 4 >= 2 else 0)
                c = lane // 4 + (8 if j >= 4 else 0)
                if s not in cache:
                    cache[s] = _py_codebook_bits(name, s)
                out[16 * tk + r, 16 * tn + c] = cache[s]
    return out


@pytest.mark.parametrize(
    ("K", "name", "k", "n"), [(2, "mcg", 256, 128), (3, "mul1", 128, 256), (4, "3inst", 128, 128)]
)
def test_dequantize_matches_slow_construction(K: int, name: str, k: int, n: int) -> None:
    words = _rand_trellis((k // 16, n // 16), K, seed=K * 31)
    g = torch.Generator().manual_seed(K)
    suh = ((torch.rand(k, generator=g) + 0.5) * torch.sign(torch.randn(k, generator=g))).to(torch.float16)
    svh = ((torch.rand(n, generator=g) + 0.5) * torch.sign(torch.randn(n, generator=g))).to(torch.float16)

    slow_rot = _slow_w_rot(words, K, name)
    w_rot = ref.reconstruct_rot(words, K, name)
    assert np.array_equal(w_rot.view(torch.int16).numpy().view(np.uint16), slow_rot)

    h = _py_hadamard()
    hk = torch.block_diag(*[h] * (k // 128))
    hn = torch.block_diag(*[h] * (n // 128))
    w_rot64 = torch.from_numpy(slow_rot.view(np.float16).astype(np.float64))
    want = torch.diag(suh.double()) @ hk @ w_rot64 @ hn @ torch.diag(svh.double())
    got = ref.dequantize(words, suh, svh, K, name)
    assert got.dtype == torch.float64 and got.shape == (k, n)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)

    # y = x @ W, and the kernel's rotated route to the same y
    x = torch.randn(5, k, dtype=torch.float64, generator=g)
    y_rot = (((x * suh.double()) @ hk) @ w_rot64 @ hn) * svh.double()
    assert torch.allclose(x @ got, y_rot, atol=1e-10, rtol=0)

    got32 = ref.dequantize(words, suh, svh, K, name, dtype=torch.float32)
    assert got32.dtype == torch.float32
    assert torch.allclose(got32.double(), want, atol=1e-5, rtol=0)


# --- synthetic layers -----------------------------------------------------------------------


def test_random_expert_layer_shapes_and_determinism() -> None:
    layer = ref.random_expert_layer(5, 256, 128, 3, codebook="mcg", seed=4)
    assert layer.n_experts == 5 and layer.K == 3 and layer.codebook == "mcg" and layer.marker == ref.MCG_MARKER
    assert layer.gate_trellis.shape == (5, 16, 8, 48) and layer.gate_trellis.dtype == torch.int16
    assert layer.up_trellis.shape == (5, 16, 8, 48)
    assert layer.down_trellis.shape == (5, 8, 16, 48)
    assert layer.gate_suh.shape == (5, 256) and layer.gate_svh.shape == (5, 128)
    assert layer.down_suh.shape == (5, 128) and layer.down_svh.shape == (5, 256)
    assert layer.gate_suh.dtype == torch.float16
    t, s, v = layer.projection("down", 2)
    assert t.is_contiguous() and t.shape == (8, 16, 48) and s.shape == (128,) and v.shape == (256,)

    again = ref.random_expert_layer(5, 256, 128, 3, codebook="mcg", seed=4)
    other = ref.random_expert_layer(5, 256, 128, 3, codebook="mcg", seed=5)
    assert torch.equal(layer.gate_trellis, again.gate_trellis) and torch.equal(layer.down_svh, again.down_svh)
    assert not torch.equal(layer.gate_trellis, other.gate_trellis)
    assert not torch.equal(layer.gate_trellis, layer.up_trellis)

    scales = ref.default_scales(256, 128, "mcg")
    for p in ref.PROJECTIONS:
        a, b = scales[p]
        for vec, scale in ((getattr(layer, f"{p}_suh"), a), (getattr(layer, f"{p}_svh"), b)):
            assert torch.equal(vec.abs(), torch.full_like(vec, scale))
            assert (vec > 0).any() and (vec < 0).any()

    custom = ref.random_expert_layer(2, 128, 128, 2, seed=1, suh_scale=0.1, svh_scale=(1.0, 2.0, 0.5))
    assert torch.allclose(custom.gate_suh.abs().float(), torch.full((2, 128), 0.1), rtol=1e-3)
    assert float(custom.up_svh.abs().max()) == 2.0 and float(custom.down_svh.abs().max()) == 0.5
    with pytest.raises(ValueError):
        ref.random_expert_layer(2, 200, 128, 2)


def test_default_scales_production_geometry() -> None:
    assert ref.default_scales(4096, 256, "mcg") == {
        "gate": (1 / 16, 1 / 4),
        "up": (1 / 16, 1 / 4),
        "down": (1 / 16, 1 / 16),
    }


@pytest.mark.parametrize("name", ["mcg", "mul1"])
def test_default_scales_give_sane_outputs(name: str) -> None:
    layer = ref.random_expert_layer(8, 256, 128, 2, codebook=name, seed=9)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:6] for _ in range(16)])
    w = torch.full((16, 6), 1.5 / 6)
    out = ref.moe_reference(x, layer, ids, w)
    rms = float(out.pow(2).mean().sqrt())
    assert 0.01 <= rms <= 0.1, rms
    wg, wu, wd = layer.dequantize_expert(0)
    pre = x.double() @ wg
    assert 0.3 < float(pre.std()) < 3.0  # pre-activations near unit scale: fp16-safe, clamp rare


# --- the MoE op -----------------------------------------------------------------------------


def _dense_moe_loop(
    x: torch.Tensor, layer: ref.ExpertLayer, ids: torch.Tensor, w: torch.Tensor, limit: float | None
) -> tuple[torch.Tensor, int]:
    """Row by row, slot by slot, re-dequantising per use; also counts clamped pre-activations."""
    m, top_k = ids.shape
    out = torch.zeros(m, layer.hidden, dtype=torch.float64)
    clamped = 0
    for r in range(m):
        xr = x[r].double()
        for s in range(top_k):
            e = int(ids[r, s])
            wg = ref.dequantize(*layer.projection("gate", e), layer.K, layer.codebook)
            wu = ref.dequantize(*layer.projection("up", e), layer.K, layer.codebook)
            wd = ref.dequantize(*layer.projection("down", e), layer.K, layer.codebook)
            gv, uv = xr @ wg, xr @ wu
            if limit is not None:
                clamped += int((gv > limit).sum() + (uv.abs() > limit).sum())
                lim = torch.tensor(limit, dtype=torch.float64)
                gv = torch.minimum(gv, lim)
                uv = torch.maximum(torch.minimum(uv, lim), -lim)
            act = gv / (1 + torch.exp(-gv)) * uv
            out[r] += float(w[r, s]) * (act @ wd)
    return out, clamped


@pytest.fixture(scope="module")
def small_layer() -> ref.ExpertLayer:
    return ref.random_expert_layer(10, 256, 128, 3, codebook="mcg", seed=21)


_CASES = {
    # top_k 6 with duplicates inside a row and a zero weight
    "dup6": (
        torch.tensor([[0, 3, 3, 7, 1, 9], [2, 2, 2, 2, 2, 2], [9, 8, 7, 6, 5, 4]]),
        torch.tensor(
            [
                [0.3, 0.2, 0.25, 0.0, 0.4, 0.35],
                [0.1, 0.2, 0.3, 0.4, 0.5, 0.0],
                [1.5, -0.5, 0.2, 0.1, 0.1, 0.1],
            ]
        ),
    ),
    "top4": (
        torch.tensor([[1, 4, 5, 0], [4, 4, 6, 9]]),
        torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.5, 0.5, 0.25, 0.25]]),
    ),
    "top8": (
        torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [9, 9, 8, 8, 0, 0, 1, 1]]),
        torch.full((2, 8), 1.5 / 8),
    ),
    "top1": (torch.tensor([[5], [5], [0]]), torch.tensor([[1.0], [0.0], [2.0]])),
}


@pytest.mark.parametrize("case", sorted(_CASES))
@pytest.mark.parametrize("amplify", [1.0, 25.0])
def test_moe_reference_matches_dense_loop(small_layer: ref.ExpertLayer, case: str, amplify: float) -> None:
    ids, w = _CASES[case]
    g = torch.Generator().manual_seed(len(case))
    x = torch.randn(ids.shape[0], 256, generator=g) * amplify
    got = ref.moe_reference(x, small_layer, ids, w, swiglu_limit=10.0)
    want, clamped = _dense_moe_loop(x, small_layer, ids, w, 10.0)
    assert got.dtype == torch.float64 and got.shape == (ids.shape[0], 256)
    scale = float(want.abs().max()) or 1.0
    assert torch.allclose(got, want, atol=1e-12 * scale, rtol=1e-10)
    if amplify > 1.0:
        assert clamped > 0, "the amplified case must drive |g| or |u| past the limit"
        unclamped = ref.moe_reference(x, small_layer, ids, w, swiglu_limit=None)
        assert not torch.allclose(got, unclamped)


def test_zero_routing_weights_give_zero_rows(small_layer: ref.ExpertLayer) -> None:
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 6, 7, 7, 8, 9]])
    w = torch.tensor([[0.0] * 6, [0.2] * 6])
    x = torch.randn(2, 256)
    out = ref.moe_reference(x, small_layer, ids, w)
    assert torch.equal(out[0], torch.zeros(256, dtype=torch.float64))
    assert float(out[1].abs().max()) > 0
    kb = ref.moe_reference_kernel_boundaries(x, small_layer, ids, w)
    assert torch.equal(kb[0], torch.zeros(256))


def test_clamp_is_before_silu(small_layer: ref.ExpertLayer) -> None:
    g = torch.tensor([-20.0, -1.0, 0.5, 9.0, 12.0, 40.0], dtype=torch.float64)
    u = torch.tensor([-30.0, 3.0, 11.0, -10.5, 2.0, 20.0], dtype=torch.float64)
    got = ref.swiglu_clamped(g, u, 10.0)
    gc = g.clamp(max=10.0)
    want = gc * torch.sigmoid(gc) * u.clamp(-10.0, 10.0)
    assert torch.allclose(got, want, atol=0, rtol=1e-15)
    after = torch.minimum(torch.nn.functional.silu(g), torch.tensor(10.0, dtype=torch.float64)) * u.clamp(-10, 10)
    assert got[4] != after[4]  # g > L: clip-before and clip-after differ, as the doc says
    assert got[2] == after[2]


def test_routing_weights_used_as_given(small_layer: ref.ExpertLayer) -> None:
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    w = torch.tensor([[0.1, 0.2, 0.3, 0.1, 0.2, 0.1]], dtype=torch.float64)  # fp32 * 1.5 would round
    x = torch.randn(1, 256)
    once = ref.moe_reference(x, small_layer, ids, w)
    scaled = ref.moe_reference(x, small_layer, ids, w * 1.5)
    assert torch.allclose(scaled, once * 1.5, rtol=1e-12, atol=0)


def test_rotated_formulation_matches_dense(small_layer: ref.ExpertLayer) -> None:
    ids, w = _CASES["dup6"]
    x = torch.randn(3, 256) * 25.0  # clamp active too
    dense = ref.moe_reference(x, small_layer, ids, w)
    rot = ref.moe_reference_rotated(x, small_layer, ids, w, dtype=torch.float64, fp16_boundaries=False)
    assert torch.allclose(rot, dense, atol=1e-10 * float(dense.abs().max()), rtol=1e-9)


def test_kernel_boundaries_close_and_deterministic() -> None:
    layer = ref.random_expert_layer(16, 256, 128, 2, codebook="mcg", seed=5)
    g = torch.Generator().manual_seed(3)
    m = 12
    x = torch.randn(m, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(16, generator=g)[:6] for _ in range(m)])
    ids[0, 3] = ids[0, 1]  # a within-row duplicate
    w = torch.rand(m, 6, generator=g) * 0.5
    exact = ref.moe_reference(x, layer, ids, w)
    kb = ref.moe_reference_kernel_boundaries(x, layer, ids, w)
    assert kb.dtype == torch.float32
    rel = (kb.double() - exact).norm(dim=1) / exact.norm(dim=1)
    assert float(rel.max()) < 2e-3  # the seat's parity bar for the kernel itself
    assert float(rel.max()) > 0  # the fp16 boundaries really are applied
    assert torch.equal(kb, ref.moe_reference_kernel_boundaries(x, layer, ids, w))
    unrounded = ref.moe_reference_rotated(x, layer, ids, w, dtype=torch.float32, fp16_boundaries=False)
    assert float(((unrounded.double() - exact).norm(dim=1) / exact.norm(dim=1)).max()) < 1e-5
    assert ref.moe_reference_kernel_boundaries(x, layer, ids, w, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_moe_input_validation(small_layer: ref.ExpertLayer) -> None:
    x = torch.randn(2, 256)
    ids = torch.zeros(2, 6, dtype=torch.int64)
    w = torch.ones(2, 6)
    with pytest.raises(ValueError):
        ref.moe_reference(x, small_layer, ids.reshape(-1), w)
    with pytest.raises(ValueError):
        ref.moe_reference(x, small_layer, ids + 10, w)
    with pytest.raises(ValueError):
        ref.moe_reference(x[:, :128], small_layer, ids, w)
    with pytest.raises(ValueError):
        ref.moe_reference(x, small_layer, ids, w[:, :5])
    with pytest.raises(ValueError):
        ref.moe_reference(x, small_layer, ids, w, swiglu_limit=0.0)
    with pytest.raises(TypeError):
        ref.moe_reference(x, small_layer, ids.float(), w)
