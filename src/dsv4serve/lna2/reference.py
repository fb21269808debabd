"""Pure-PyTorch reference for EXL3 weights and the routed-expert MoE op that lna2 computes.

This is the yardstick the CUDA kernel is judged against, so it favours plainness over speed:
everything is vectorised torch, bit work is done in int64 (no sign or overflow surprises), and
nothing is shared with exllamav3 or vllm-exl3 code.

Conventions (see docs/exl3-reference.md §1):

* A quantised linear is stored in (in_features k, out_features n) orientation: ``y = x @ W``.
* ``trellis`` is int16 ``[k/16, n/16, 16*K]``: one circular 256*K-bit stream per 16x16 tile.
* ``W = diag(suh) . Hk . W_rot . Hn . diag(svh)`` with block-diagonal normalised H128.

Public API
----------
codebook_lut, codebook_from_markers, codebook_marker, tensor_core_perm,
inverse_tensor_core_perm, decode_states, pack_trellis, encode_states, states_are_consistent,
reconstruct_rot, hadamard_128, hadamard_rotate, dequantize, default_scales,
random_expert_layer, ExpertLayer, swiglu_clamped, moe_reference, moe_reference_rotated,
moe_reference_kernel_boundaries.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# --- constants ------------------------------------------------------------------------------

CODEBOOKS: tuple[str, ...] = ("3inst", "mcg", "mul1")

INST3_MULT = 89226354  # 0x5517C72
INST3_ADD = 64248484  # 0x3D45AA4
MCG_MULT = 0xCBAC1FED
MUL1_MULT = 0x83DCD12D
HALVES_MASK = 0x8FFF8FFF  # keeps sign, the two low exponent bits and the mantissa of each half
HALVES_XOR = 0x3B603B60  # then forces each half's exponent field into 12..15
MUL1_SCALE_BITS = 0x1EEE  # fp16 ~ 1/147.77
MUL1_BIAS_BITS = 0xC931  # fp16 -10.3828125

# The safetensors markers are the multipliers reinterpreted as int32; only presence selects the
# codebook in exllamav3, but vllm-exl3 rejects a wrong value ("packed ABI mismatch").
MCG_MARKER = -877912083
MUL1_MARKER = -2082680531

TILE = 16  # a tile is 16 x 16 weights
TILE_WEIGHTS = TILE * TILE
HAD = 128  # Hadamard block on both sides of every projection
K_RANGE = range(1, 9)

_MASK16 = 0xFFFF
_MASK32 = 0xFFFFFFFF


def _check_codebook(name: str) -> str:
    key = name.lower()
    if key not in CODEBOOKS:
        raise ValueError(f"unknown EXL3 codebook {name!r}; expected one of {CODEBOOKS}")
    return key


def _check_k(K: int) -> int:
    if int(K) != K or int(K) not in K_RANGE:
        raise ValueError(f"K must be an integer bitrate 1..8, got {K!r}")
    return int(K)


def _fp16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret the low 16 bits of an int64 tensor as fp16 (sign-extend so int16 holds it)."""
    signed = ((bits & _MASK16) ^ 0x8000) - 0x8000
    return signed.to(torch.int16).view(torch.float16)


def _fp16_scalar(bits: int) -> float:
    return float(_fp16_from_bits(torch.tensor([bits], dtype=torch.int64))[0])


# --- codebooks ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _lut_cpu(name: str) -> torch.Tensor:
    s = torch.arange(65536, dtype=torch.int64)
    if name == "mul1":
        x = (s * MUL1_MULT) & _MASK32
        bytesum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
        # 1024 + bytesum <= 2044 is an exact fp16 integer; h*scale needs <= 22 significant bits
        # and adding the bias stays exact in fp32, so one final rounding equals __hfma.
        h = (1024 + bytesum).to(torch.float32)
        exact = h * _fp16_scalar(MUL1_SCALE_BITS) + _fp16_scalar(MUL1_BIAS_BITS)
        return exact.to(torch.float16)
    mult, add = (INST3_MULT, INST3_ADD) if name == "3inst" else (MCG_MULT, 0)
    x = (s * mult + add) & _MASK32
    x = (x & HALVES_MASK) ^ HALVES_XOR
    lo = _fp16_from_bits(x).to(torch.float32)
    hi = _fp16_from_bits(x >> 16).to(torch.float32)
    # Both halves lie in +-[1/8, 2) with 11 significant bits, so the fp32 sum is exact and the
    # single rounding to fp16 is exactly what the GPU's __hadd produces.
    return (lo + hi).to(torch.float16)


def _lut_on(name: str, device: torch.device) -> torch.Tensor:
    return _lut_cpu(_check_codebook(name)).to(device)


def codebook_lut(name: str) -> torch.Tensor:
    """fp16 value of every 16-bit trellis state, bit-exact to the GPU decode: ``[65536]``."""
    return _lut_cpu(_check_codebook(name)).clone()


def codebook_marker(name: str) -> int | None:
    """The int32 marker tensor value a pack stores for this codebook (None for 3INST)."""
    return {"3inst": None, "mcg": MCG_MARKER, "mul1": MUL1_MARKER}[_check_codebook(name)]


def _marker_value(marker: object) -> int:
    t = torch.as_tensor(marker)
    if t.numel() != 1:
        raise ValueError(f"a codebook marker is a scalar ([] or [1]), got shape {tuple(t.shape)}")
    return int(t.reshape(-1)[0])


def codebook_from_markers(
    mcg: object | None = None, mul1: object | None = None, *, check_values: bool = True
) -> str:
    """Codebook name from the presence of the ``.mcg`` / ``.mul1`` marker tensors.

    ``None`` means the tensor is absent. Neither present means 3INST, as in exllamav3. With
    ``check_values`` a present marker must hold the expected constant (vllm-exl3's rule).
    """
    if mcg is not None and mul1 is not None:
        raise ValueError("both .mcg and .mul1 markers present; a pack carries at most one")
    for name, marker, want in (("mcg", mcg, MCG_MARKER), ("mul1", mul1, MUL1_MARKER)):
        if marker is None:
            continue
        if check_values and _marker_value(marker) != want:
            raise ValueError(f".{name} marker is {_marker_value(marker)}, expected {want}")
        return name
    return "3inst"


# --- tile layout ----------------------------------------------------------------------------


def tensor_core_perm() -> torch.Tensor:
    """``perm[p]`` = flat tile index ``r*16 + c`` of the weight at stream position ``p``.

    Stream position p = 8*lane + j follows the mma.m16n8k16 B-fragment: rows r0, r0+1, r0+8,
    r0+9 (r0 = 2*(lane % 4)) in column lane // 4 for j < 4, and in column lane // 4 + 8 after.
    """
    p = torch.arange(TILE_WEIGHTS, dtype=torch.int64)
    lane, j = p // 8, p % 8
    row = 2 * (lane % 4) + (j % 2) + 8 * ((j // 2) % 2)
    col = lane // 4 + 8 * (j // 4)
    return row * TILE + col


def inverse_tensor_core_perm() -> torch.Tensor:
    """``inv[r*16 + c]`` = stream position holding tile element (r, c)."""
    perm = tensor_core_perm()
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(TILE_WEIGHTS, dtype=torch.int64)
    return inv


# --- bitstream ------------------------------------------------------------------------------


def _check_trellis(trellis: torch.Tensor, K: int) -> int:
    K = _check_k(K)
    if trellis.dtype != torch.int16:
        raise TypeError(f"trellis must be int16, got {trellis.dtype}")
    if trellis.dim() < 1 or trellis.shape[-1] != TILE * K:
        raise ValueError(f"trellis last dim must be 16*K = {TILE * K}, got {tuple(trellis.shape)}")
    return K


def _u32_words(trellis: torch.Tensor) -> torch.Tensor:
    """int64 ``[..., 8K]`` in [0, 2^32): word i = u16[2i] | u16[2i+1] << 16.

    Spelled out instead of ``view(torch.int32)`` so the result never depends on host byte order.
    """
    u16 = trellis.to(torch.int64) & _MASK16
    pairs = u16.reshape(*u16.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 16)


@functools.lru_cache(maxsize=None)
def _window_tables(K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each position t: the two 32-bit words its 16-bit window touches, and the right shift.

    The window of position t is stream bits [(t+1)K - 16, (t+1)K), circular over 256K bits. One
    extra stream length is added so the start is never negative before the modulo.
    """
    t = torch.arange(TILE_WEIGHTS, dtype=torch.int64)
    n_words = 8 * K
    end = (t + 1) * K + TILE_WEIGHTS * K
    start = end - 16
    i_hi = (start // 32) % n_words
    i_lo = ((end - 1) // 32) % n_words
    shift = ((end - 1) // 32 + 1) * 32 - end  # bits of the low word that follow the window
    return i_hi, i_lo, shift


def decode_states(trellis: torch.Tensor, K: int) -> torch.Tensor:
    """16-bit trellis state of every stream position: int16 ``[..., 16K]`` -> int64 ``[..., 256]``.

    Stream bit b is bit 31 - (b % 32) of 32-bit word b // 32 (big-endian bits in little-endian
    assembled words); the state at t is the circular 16-bit window ending at bit (t+1)K.
    """
    K = _check_trellis(trellis, K)
    words = _u32_words(trellis)
    i_hi, i_lo, shift = (v.to(trellis.device) for v in _window_tables(K))
    hi = words[..., i_hi]
    lo = words[..., i_lo]
    # shift <= 31, so only hi's low 15 bits can reach the window; masking keeps the int64 positive.
    joined = ((hi & _MASK16) << 32) | lo
    return (joined >> shift) & _MASK16


def pack_trellis(codes_or_states: torch.Tensor, K: int) -> torch.Tensor:
    """Pack 256 codes per tile (the low K bits of each value) into int16 ``[..., 16K]``.

    The codes are concatenated MSB-first into one 256K-bit stream, cut MSB-first into 16-bit
    words, and adjacent words are swapped in pairs: the exact inverse of :func:`decode_states`.
    """
    K = _check_k(K)
    if codes_or_states.shape[-1] != TILE_WEIGHTS:
        raise ValueError(f"last dim must be 256 positions, got {tuple(codes_or_states.shape)}")
    lead = codes_or_states.shape[:-1]
    device = codes_or_states.device
    codes = codes_or_states.to(torch.int64) & ((1 << K) - 1)
    msb_first = torch.arange(K - 1, -1, -1, dtype=torch.int64, device=device)
    bits = (codes.unsqueeze(-1) >> msb_first) & 1
    bits = bits.reshape(*lead, TILE * K, 16)
    weights = torch.arange(15, -1, -1, dtype=torch.int64, device=device)
    words = (bits << weights).sum(-1)
    words = words.reshape(*lead, 8 * K, 2).flip(-1).reshape(*lead, TILE * K)
    return ((words ^ 0x8000) - 0x8000).to(torch.int16)


def states_are_consistent(states: torch.Tensor, K: int) -> bool:
    """True when every state is the circular shift-register successor of the one before it."""
    K = _check_k(K)
    s = states.to(torch.int64)
    prev = torch.roll(s, shifts=1, dims=-1)
    code = s & ((1 << K) - 1)
    return bool(torch.equal(((prev << K) | code) & _MASK16, s & _MASK16) and bool((s >= 0).all()))


def encode_states(states: torch.Tensor, K: int) -> torch.Tensor:
    """Pack full 16-bit states (e.g. a Viterbi result), refusing ones no bitstream can produce."""
    if not states_are_consistent(states, K):
        raise ValueError("states are not a circular 16-bit shift register with K-bit steps")
    return pack_trellis(states, K)


# --- weights --------------------------------------------------------------------------------


def reconstruct_rot(trellis: torch.Tensor, K: int, codebook: str) -> torch.Tensor:
    """W_rot fp16 ``[k, n]`` from int16 ``[k/16, n/16, 16K]`` (what ``ext.reconstruct`` emits)."""
    K = _check_trellis(trellis, K)
    if trellis.dim() != 3:
        raise ValueError(f"trellis must be [k/16, n/16, 16K], got {tuple(trellis.shape)}")
    tk, tn, _ = trellis.shape
    states = decode_states(trellis, K)
    values = _lut_on(codebook, trellis.device)[states]
    tiles = values[..., inverse_tensor_core_perm().to(trellis.device)]
    return tiles.reshape(tk, tn, TILE, TILE).permute(0, 2, 1, 3).reshape(tk * TILE, tn * TILE)


@functools.lru_cache(maxsize=None)
def _hadamard_f64() -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < HAD:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(HAD)


def hadamard_128(
    dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
) -> torch.Tensor:
    """Normalised Sylvester H128: ``H[i, j] = (-1)^popcount(i & j) / sqrt(128)`` (symmetric)."""
    return _hadamard_f64().to(dtype=dtype, device=device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Multiply every 128-chunk of the last dim by H128 (i.e. ``x @ blockdiag(H)``), in x's dtype."""
    n = x.shape[-1]
    if n % HAD:
        raise ValueError(f"last dim {n} is not a multiple of {HAD}")
    h = hadamard_128(x.dtype, x.device)
    return (x.reshape(*x.shape[:-1], n // HAD, HAD) @ h).reshape(x.shape)


def dequantize(
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    K: int,
    codebook: str,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Dense ``W [k, n]`` in ``dtype``: ``diag(suh) . Hk . W_rot . Hn . diag(svh)``.

    W_rot itself is exact fp16 values; every later stage stays in ``dtype`` (exllamav3's own
    ``get_weight_tensor`` rounds to fp16 after each stage, so it differs by that rounding).
    """
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be floating point, got {dtype}")
    w_rot = reconstruct_rot(trellis, K, codebook).to(dtype)
    k, n = w_rot.shape
    if k % HAD or n % HAD:
        raise ValueError(f"k={k} and n={n} must be multiples of {HAD} for the Hadamard blocks")
    if suh.shape != (k,) or svh.shape != (n,):
        raise ValueError(f"suh {tuple(suh.shape)} / svh {tuple(svh.shape)} do not match [{k}], [{n}]")
    h = hadamard_128(dtype, w_rot.device)
    w = (h @ w_rot.reshape(k // HAD, HAD, n)).reshape(k, n)
    w = w * suh.to(dtype).unsqueeze(1)
    w = (w.reshape(k, n // HAD, HAD) @ h).reshape(k, n)
    return w * svh.to(dtype).unsqueeze(0)


# --- synthetic expert layers ----------------------------------------------------------------

PROJECTIONS: tuple[str, ...] = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's routed experts as vllm-exl3 holds them on one TP rank (stacked over E).

    gate (w1) and up (w3): trellis ``[E, hidden/16, inter/16, 16K]``, suh ``[E, hidden]``,
    svh ``[E, inter]``; down (w2): trellis ``[E, inter/16, hidden/16, 16K]``, suh ``[E, inter]``,
    svh ``[E, hidden]``. ``x[e]`` of any field is one expert's contiguous tensor, the same object
    a kernel pointer table would point at.
    """

    gate_trellis: torch.Tensor
    gate_suh: torch.Tensor
    gate_svh: torch.Tensor
    up_trellis: torch.Tensor
    up_suh: torch.Tensor
    up_svh: torch.Tensor
    down_trellis: torch.Tensor
    down_suh: torch.Tensor
    down_svh: torch.Tensor
    K: int
    codebook: str
    hidden: int
    inter: int

    def __post_init__(self) -> None:
        _check_k(self.K)
        _check_codebook(self.codebook)
        e, h, i, w = self.n_experts, self.hidden, self.inter, TILE * self.K
        expected = {
            "gate_trellis": (e, h // TILE, i // TILE, w),
            "up_trellis": (e, h // TILE, i // TILE, w),
            "down_trellis": (e, i // TILE, h // TILE, w),
            "gate_suh": (e, h),
            "up_suh": (e, h),
            "down_suh": (e, i),
            "gate_svh": (e, i),
            "up_svh": (e, i),
            "down_svh": (e, h),
        }
        for name, shape in expected.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
            want = torch.int16 if name.endswith("trellis") else torch.float16
            if t.dtype != want:
                raise TypeError(f"{name} must be {want}, got {t.dtype}")

    @property
    def n_experts(self) -> int:
        return int(self.gate_trellis.shape[0])

    @property
    def marker(self) -> int | None:
        return codebook_marker(self.codebook)

    def projection(self, which: str, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(trellis, suh, svh) of one expert's gate, up or down projection."""
        if which not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {which!r}")
        trellis, suh, svh = (getattr(self, f"{which}_{part}")[expert] for part in ("trellis", "suh", "svh"))
        return trellis, suh, svh

    def dequantize_expert(
        self, expert: int, dtype: torch.dtype = torch.float64
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense (W_gate [H, I], W_up [H, I], W_down [I, H]) of one expert."""
        return tuple(  # type: ignore[return-value]
            dequantize(*self.projection(p, expert), self.K, self.codebook, dtype) for p in PROJECTIONS
        )

    def to(self, device: torch.device | str) -> ExpertLayer:
        moved = {
            f"{p}_{part}": getattr(self, f"{p}_{part}").to(device)
            for p in PROJECTIONS
            for part in ("trellis", "suh", "svh")
        }
        return ExpertLayer(**moved, K=self.K, codebook=self.codebook, hidden=self.hidden, inter=self.inter)


# A SwiGLU of N(0,1)-ish gate and up has an RMS of about 0.6; used only to aim the down scale.
_ACT_RMS = 0.6
_TARGET_PREACT_STD = 1.0
_TARGET_EXPERT_RMS = 0.05
_SUH_DEFAULT = 1.0 / 16


def _nearest_pow2(v: float) -> float:
    return 2.0 ** round(math.log2(v))


def default_scales(hidden: int, inter: int, codebook: str = "mcg") -> dict[str, tuple[float, float]]:
    """Default ``{projection: (|suh|, |svh|)}`` for synthetic layers, all powers of two.

    Powers of two make every suh/svh product exact in any precision, so a kernel-vs-reference
    difference can never come from where a scale multiply happens to round. With x ~ N(0, 1):

    * suh = 1/16 everywhere keeps the fp16 rotated inputs (std 1/16 for x, about 0.04 for the
      activation) well clear of the fp16 subnormal band (< 6.1e-5) and of overflow;
    * gate/up svh is chosen so the pre-activations have std near 1 (clamp at 10 rarely active);
    * down svh is chosen so one expert's output has RMS near 0.05, which gives a routed sum of
      roughly 0.02-0.05 for six slots with DeepSeek-V4-like weights.

    At hidden 4096, inter 256 and MCG that is gate/up (1/16, 1/4) and down (1/16, 1/16).
    """
    sigma = float(codebook_lut(codebook).double().std())
    suh = _SUH_DEFAULT
    svh_gu = _nearest_pow2(_TARGET_PREACT_STD / (suh * math.sqrt(hidden) * sigma))
    svh_d = _nearest_pow2(_TARGET_EXPERT_RMS / (suh * math.sqrt(inter) * sigma * _ACT_RMS))
    return {"gate": (suh, svh_gu), "up": (suh, svh_gu), "down": (suh, svh_d)}


def _per_projection(value: float | Sequence[float] | None, defaults: Sequence[float]) -> list[float]:
    if value is None:
        return list(defaults)
    if isinstance(value, (int, float)):
        return [float(value)] * len(PROJECTIONS)
    values = [float(v) for v in value]
    if len(values) != len(PROJECTIONS):
        raise ValueError(f"per-projection scales need {len(PROJECTIONS)} values (gate, up, down)")
    return values


def _random_signs(shape: tuple[int, ...], scale: float, gen: torch.Generator) -> torch.Tensor:
    signs = torch.randint(0, 2, shape, dtype=torch.int8, generator=gen).to(torch.float32) * 2 - 1
    return (signs * scale).to(torch.float16)


def random_expert_layer(
    n_experts: int,
    hidden: int,
    inter: int,
    K: int,
    codebook: str = "mcg",
    seed: int = 0,
    suh_scale: float | Sequence[float] | None = None,
    svh_scale: float | Sequence[float] | None = None,
    device: torch.device | str = "cpu",
) -> ExpertLayer:
    """A random but valid routed-expert layer (any int16 words are a legal trellis stream).

    Scales: a float applies to all three projections, a 3-sequence is (gate, up, down), None
    takes :func:`default_scales`. suh/svh are independent random signs times the scale. Data is
    drawn on the CPU from one seeded generator in a fixed order, so a seed gives the same layer
    on every device.
    """
    K = _check_k(K)
    codebook = _check_codebook(codebook)
    if hidden % HAD or inter % HAD:
        raise ValueError(f"hidden={hidden} and inter={inter} must be multiples of {HAD}")
    if n_experts < 1:
        raise ValueError("n_experts must be >= 1")
    defaults = default_scales(hidden, inter, codebook)
    suh = _per_projection(suh_scale, [defaults[p][0] for p in PROJECTIONS])
    svh = _per_projection(svh_scale, [defaults[p][1] for p in PROJECTIONS])
    for v in suh + svh:
        if not (math.isfinite(v) and v > 0 and math.isfinite(float(torch.tensor(v, dtype=torch.float16)))):
            raise ValueError(f"scales must be positive and finite in fp16, got {v}")

    gen = torch.Generator(device="cpu").manual_seed(seed)
    words = TILE * K
    dims = {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
    fields: dict[str, torch.Tensor] = {}
    for p in PROJECTIONS:
        k, n = dims[p]
        fields[f"{p}_trellis"] = torch.randint(
            -32768, 32768, (n_experts, k // TILE, n // TILE, words), dtype=torch.int16, generator=gen
        )
    for idx, p in enumerate(PROJECTIONS):
        k, n = dims[p]
        fields[f"{p}_suh"] = _random_signs((n_experts, k), suh[idx], gen)
        fields[f"{p}_svh"] = _random_signs((n_experts, n), svh[idx], gen)
    fields = {name: t.to(device) for name, t in fields.items()}
    return ExpertLayer(**fields, K=K, codebook=codebook, hidden=hidden, inter=inter)


# --- the MoE op -----------------------------------------------------------------------------


def swiglu_clamped(g: torch.Tensor, u: torch.Tensor, limit: float | None) -> torch.Tensor:
    """DeepSeek-V4's clipped SwiGLU: ``silu(min(g, L)) * clamp(u, -L, L)`` (clip before SiLU).

    exllamav3's ``exl3_moe`` clips after SiLU instead; the two differ only where g > L.
    """
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(g) * u


def _check_routes(
    x: torch.Tensor,
    layer: ExpertLayer,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor,
    swiglu_limit: float | None,
) -> None:
    if x.dim() != 2 or x.shape[1] != layer.hidden:
        raise ValueError(f"x must be [m, {layer.hidden}], got {tuple(x.shape)}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids must be [m, top_k] with m={x.shape[0]}, got {tuple(expert_ids.shape)}")
    if routing_weights.shape != expert_ids.shape:
        raise ValueError(
            f"routing_weights {tuple(routing_weights.shape)} must match expert_ids {tuple(expert_ids.shape)}"
        )
    if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
        raise TypeError(f"expert_ids must be an integer tensor, got {expert_ids.dtype}")
    if expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= layer.n_experts):
        raise ValueError(f"expert ids must lie in [0, {layer.n_experts})")
    if swiglu_limit is not None and not (math.isfinite(swiglu_limit) and swiglu_limit > 0):
        raise ValueError(f"swiglu_limit must be finite and > 0 (or None for no clamp), got {swiglu_limit}")


def _routes_by_expert(expert_ids: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """[(expert, rows, slots)] for every distinct expert, ascending by id."""
    ids = expert_ids.to(torch.int64)
    out = []
    for e in torch.unique(ids).tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        out.append((int(e), rows, slots))
    return out


def _sum_slots_in_order(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_s w[:, s] * y[:, s] accumulated slot 0 first, the fixed order lna2's gather uses."""
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=y.dtype, device=y.device)
    for s in range(y.shape[1]):
        acc = acc + weights[:, s : s + 1] * y[:, s]
    return acc


def moe_reference(
    x: torch.Tensor,
    layer: ExpertLayer,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor,
    swiglu_limit: float | None = 10.0,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Routed-expert MoE on dense dequantised weights, entirely in ``dtype``: ``[m, hidden]``.

    ``out[r] = Σ_s w[r, s] * down_e(swiglu(x_r @ Wg_e, x_r @ Wu_e))`` with e = expert_ids[r, s],
    slots summed in order. Routing weights are used as given (routed scaling already applied).
    Each distinct expert is dequantised once and dropped after use, so memory stays at one
    expert's dense weights plus the per-slot outputs.
    """
    _check_routes(x, layer, expert_ids, routing_weights, swiglu_limit)
    m, top_k = expert_ids.shape
    xd = x.to(dtype)
    y = torch.zeros(m, top_k, layer.hidden, dtype=dtype, device=x.device)
    for e, rows, slots in _routes_by_expert(expert_ids):
        wg, wu, wd = layer.dequantize_expert(e, dtype)
        xe = xd[rows]
        y[rows, slots] = swiglu_clamped(xe @ wg, xe @ wu, swiglu_limit) @ wd
    return _sum_slots_in_order(y, routing_weights.to(dtype))


def _project_rotated(xr: torch.Tensor, trellis: torch.Tensor, svh: torch.Tensor, K: int, cb: str) -> torch.Tensor:
    """Rotated-basis input -> output: ``H(xr @ W_rot) * svh`` in xr's dtype."""
    w_rot = reconstruct_rot(trellis, K, cb).to(xr.dtype)
    return hadamard_rotate(xr @ w_rot) * svh.to(xr.dtype)


def _rotate_input(v: torch.Tensor, suh: torch.Tensor, to_fp16: bool) -> torch.Tensor:
    r = hadamard_rotate(v * suh.to(v.dtype))
    return r.to(torch.float16).to(v.dtype) if to_fp16 else r


def moe_reference_rotated(
    x: torch.Tensor,
    layer: ExpertLayer,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor,
    swiglu_limit: float | None = 10.0,
    dtype: torch.dtype = torch.float32,
    fp16_boundaries: bool = True,
) -> torch.Tensor:
    """The MoE op computed the way the kernel is structured: in the rotated basis on W_rot.

    Per projection: input ``* suh``, H128, ``@ W_rot``, H128, ``* svh``, all in ``dtype``. With
    ``fp16_boundaries`` the values are rounded to fp16 at exactly the points where lna2 stores
    fp16 (seat-reference §3.4 "F1 v2" order):

    1. x on entry (the kernel's input is fp16, or bf16 converted to fp16 in-kernel);
    2. the suh-scaled, Hadamard-rotated x shared by gate and up (the had_g / had_u buffers);
    3. the SwiGLU activation (computed in ``dtype``, then stored as fp16);
    4. the suh-scaled, Hadamard-rotated activation that feeds the down GEMV (down_i).

    Everything between those points, the routing weights and the slot-ordered sum stay in
    ``dtype``. Without ``fp16_boundaries`` this equals :func:`moe_reference` up to ``dtype``
    rounding, which is what ties the two formulations together in the tests.
    """
    _check_routes(x, layer, expert_ids, routing_weights, swiglu_limit)
    m, top_k = expert_ids.shape
    xd = x.to(torch.float16).to(dtype) if fp16_boundaries else x.to(dtype)
    y = torch.zeros(m, top_k, layer.hidden, dtype=dtype, device=x.device)
    K, cb = layer.K, layer.codebook
    for e, rows, slots in _routes_by_expert(expert_ids):
        gt, gs, gv = layer.projection("gate", e)
        ut, us, uv = layer.projection("up", e)
        dt, ds, dv = layer.projection("down", e)
        xe = xd[rows]
        g = _project_rotated(_rotate_input(xe, gs, fp16_boundaries), gt, gv, K, cb)
        u = _project_rotated(_rotate_input(xe, us, fp16_boundaries), ut, uv, K, cb)
        a = swiglu_clamped(g, u, swiglu_limit)
        if fp16_boundaries:
            a = a.to(torch.float16).to(dtype)
        y[rows, slots] = _project_rotated(_rotate_input(a, ds, fp16_boundaries), dt, dv, K, cb)
    return _sum_slots_in_order(y, routing_weights.to(dtype))


def moe_reference_kernel_boundaries(
    x: torch.Tensor,
    layer: ExpertLayer,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor,
    swiglu_limit: float | None = 10.0,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The op with lna2's fp16 roundings and fp32 everywhere else, cast once to ``out_dtype``.

    This is the tight-parity twin of the kernel; it still cannot be bit-exact, because the
    kernel's GEMV accumulates in fp16 MMAs folded into fp32 every two k-slices and its
    Hadamards and SiLU use their own operation order.
    """
    out = moe_reference_rotated(
        x, layer, expert_ids, routing_weights, swiglu_limit, dtype=torch.float32, fp16_boundaries=True
    )
    return out.to(out_dtype)
