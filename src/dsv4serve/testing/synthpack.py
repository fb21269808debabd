"""Write small synthetic DSV4-Flash-Vision EXL3 packs, with knobs that inject each known trap.

The names, dtypes, shape rules, shard layout and config.json follow the real Dense6 pack
(seat-reference §6.2/§8, exl3-reference §1.1/§5), scaled down: a few layers and experts,
hidden 256. Tensor *data* is zeros (markers hold their real values): pack.py reads headers only,
so only names, dtypes, shapes and offsets matter. The BF16 tensors outside the EXL3 modules
(norms, gates, hyper-connection mixers, MTP and vision parts) are a representative subset of the
real names, enough to exercise the TP sharding rules, not a complete list.

Shards mirror the real layout: numbered base shards (`model-0000N-of-0000M.safetensors`) plus
the three overlays `model-layers-k2.safetensors` (one layer's experts re-baked), `model-mtp-exl3`
(draft experts) and `model-dense-exl3` (every dense EXL3 module), with an index over all.

Needs torch (safetensors.torch writes BF16, which numpy cannot hold).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MCG = -877912083  # 0xCBAC1FED as int32
MUL1 = -2082680531  # 0x83DCD12D as int32

DENSE_FUSED = {  # vLLM fused module -> pack modules (same table as pack.DENSE_KINDS)
    "attn.fused_wqa_wkv": ("attn.wq_a", "attn.wkv"),
    "attn.wq_b": ("attn.wq_b",),
    "attn.wo_a": ("attn.wo_a.slice.*",),
    "attn.wo_b": ("attn.wo_b",),
    "attn.compressor.fused_wkv_wgate": ("attn.compressor.wkv", "attn.compressor.wgate"),
    "attn.indexer.compressor.fused_wkv_wgate": ("attn.indexer.compressor.wkv", "attn.indexer.compressor.wgate"),
    "attn.indexer.wq_b": ("attn.indexer.wq_b",),
    "ffn.shared_experts.gate_up_proj": ("ffn.shared_experts.w1", "ffn.shared_experts.w3"),
    "ffn.shared_experts.down_proj": ("ffn.shared_experts.w2",),
}


@dataclass
class SynthSpec:
    # --- structure (real: 43 layers, 3 draft layers, 256 experts, hidden 4096) ---------------
    layers: int = 5
    mtp_layers: int = 2
    experts: int = 4
    hidden: int = 256
    inter: int = 128  # moe_intermediate_size (real 2048)
    heads: int = 4
    head_dim: int = 64  # wq_b out = heads * head_dim
    q_lora: int = 128
    o_lora: int = 64
    o_groups: int = 8  # wo_a slices; TP must equal it
    index_heads: int = 4
    index_head_dim: int = 32
    vocab: int = 1024
    hash_layers: int = 1
    vision: bool = True  # vision_n_layers > 0 makes vLLM pick the Vision class
    dense_k: int = 6
    routed_bits: int = 2
    k3_layers: tuple[int, ...] = (2,)  # trunk layers whose experts are K3 (real 13, 22, 28)
    k2_overlay_layer: int | None = 3  # experts re-baked into model-layers-k2 (real 3, 21, 41)
    # --- traps ---------------------------------------------------------------------------------
    bits_stamp: int | None = None  # trap 1: stamp this in non_routed_exl3 (the bake was dense_k)
    prefix_root: str = "language_model.model."  # "model." is dense_bake's default (wrong class)
    shared_spelling: str = "ffn"  # "mlp" is dense_bake's other default
    layer_bits_override: dict[str, int] | None = None  # config layer_bits that disagree with experts
    codebook: str = "mcg"  # declared in config.json
    mixed_codebook: bool = False  # one routed expert module carries a mul1 marker
    drop_marker: bool = False  # one dense module has no codebook marker
    drop_entry: bool = False  # one non_routed_exl3 entry removed
    quant_method: str = "exl3"
    mtp_experts: str | None = None  # a leftover quantization_config.mtp_experts
    drop_tensor: bool = False  # a tensor the index names is absent from its shard
    duplicate_tensor: bool = False  # a tensor written into two shards
    missing_shard: bool = False  # an indexed shard deleted
    truncate_shard: bool = False  # a shard cut short (its header promises more bytes)
    dead_symlink: str | None = None  # this file becomes a symlink into a deleted base pack (trap 10)
    live_symlinks: bool = False  # small files and one shard symlinked into a base pack
    drop_files: tuple[str, ...] = ()  # e.g. ("tokenizer.json",), ("generation_config.json",)
    extra_unindexed: bool = False  # a stray safetensors file the index does not name


@dataclass
class SynthPack:
    path: Path
    spec: SynthSpec
    config: dict[str, Any]
    shards: list[str]
    weight_map: dict[str, str]
    notes: dict[str, str] = field(default_factory=dict)  # what each injected trap touched

    @property
    def expect_shards(self) -> int:
        return len(self.shards)


def compress_schedule(n: int) -> list[int]:
    """DSV4's layer schedule: layers 0-1 sliding only (0), then CSA (4) on even and HCA (128) on odd."""
    return [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(n)]


class _Builder:
    def __init__(self, s: SynthSpec):
        import torch

        self.torch = torch
        self.s = s
        self.shards: dict[str, dict[str, Any]] = {}

    def put(self, shard: str, name: str, shape: list[int], dtype: str, fill: int | None = None) -> None:
        t = self.torch
        dt = {"I16": t.int16, "F16": t.float16, "BF16": t.bfloat16, "F32": t.float32, "I32": t.int32}[dtype]
        x = t.zeros(shape, dtype=dt) if fill is None else t.full(shape, fill, dtype=dt)
        self.shards.setdefault(shard, {})[name] = x

    def exl3(self, shard: str, m: str, k: int, n: int, bits: int, marker: str | None = "mcg",
             marker_shape: list[int] | None = None) -> None:
        """One EXL3 linear, (in k) -> (out n): trellis [k/16, n/16, 16K] I16, suh [k], svh [n] F16."""
        self.put(shard, f"{m}.trellis", [k // 16, n // 16, 16 * bits], "I16")
        self.put(shard, f"{m}.suh", [k], "F16")
        self.put(shard, f"{m}.svh", [n], "F16")
        if marker:
            self.put(shard, f"{m}.{marker}", marker_shape or [], "I32", MCG if marker == "mcg" else MUL1)


def write_pack(out: str | Path, spec: SynthSpec | None = None) -> SynthPack:
    s = spec or SynthSpec()
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    b = _Builder(s)
    notes: dict[str, str] = {}
    H, I, L, M = s.hidden, s.inter, s.layers, s.mtp_layers
    sched = compress_schedule(L)
    n_base = (L + 1) // 2 + 1  # two layers per base shard, the last one also holds head/MTP/vision
    base = [f"model-{i + 1:05d}-of-{n_base:05d}.safetensors" for i in range(n_base)]
    K2, MTP, DENSE = "model-layers-k2.safetensors", "model-mtp-exl3.safetensors", "model-dense-exl3.safetensors"

    def expert_bits(layer: int) -> int:
        return 3 if layer in s.k3_layers else s.routed_bits

    b.put(base[0], "embed.weight", [s.vocab, H], "BF16")
    for ln in range(L):
        sh = base[ln // 2]
        p = f"layers.{ln}"
        for nm, shape, dt in ((f"{p}.attn_norm.weight", [H], "BF16"), (f"{p}.ffn_norm.weight", [H], "BF16"),
                              (f"{p}.attn.q_norm.weight", [s.q_lora], "BF16"),
                              (f"{p}.attn.kv_norm.weight", [s.head_dim], "BF16"),
                              (f"{p}.attn.attn_sink", [s.heads], "F32"),
                              (f"{p}.ffn.gate.weight", [s.experts, H], "BF16"),
                              (f"{p}.hc_attn_fn", [24, 4 * H], "F32"), (f"{p}.hc_attn_base", [24], "F32"),
                              (f"{p}.hc_attn_scale", [3], "F32"), (f"{p}.hc_ffn_fn", [24, 4 * H], "F32"),
                              (f"{p}.hc_ffn_base", [24], "F32"), (f"{p}.hc_ffn_scale", [3], "F32")):
            b.put(sh, nm, shape, dt)
        if ln < s.hash_layers:
            b.put(sh, f"{p}.ffn.gate.tid2eid", [s.vocab, 2], "I32")
        else:
            b.put(sh, f"{p}.ffn.gate.bias", [s.experts], "F32")
        if sched[ln] == 4:
            b.put(sh, f"{p}.attn.indexer.weights_proj.weight", [s.index_heads, H], "BF16")
        # routed experts (donor-mapped scalar markers have shape [1])
        esh = K2 if ln == s.k2_overlay_layer else sh
        kb = expert_bits(ln)
        for e in range(s.experts):
            for w, (k, n) in (("w1", (H, I)), ("w3", (H, I)), ("w2", (I, H))):
                marker = "mul1" if (s.mixed_codebook and ln == 1 and e == 0 and w == "w1") else "mcg"
                b.exl3(esh, f"{p}.ffn.experts.{e}.{w}", k, n, kb, marker, [1])
        if s.mixed_codebook:
            notes["mixed_codebook"] = "layers.1.ffn.experts.0.w1 carries mul1"
        # dense EXL3 modules, all in the dense overlay
        dense = [("attn.wq_a", H, s.q_lora), ("attn.wkv", H, s.head_dim), ("attn.wq_b", s.q_lora, s.heads * s.head_dim),
                 ("attn.wo_b", s.o_groups * s.o_lora, H), ("ffn.shared_experts.w1", H, I),
                 ("ffn.shared_experts.w3", H, I), ("ffn.shared_experts.w2", I, H)]
        dense += [(f"attn.wo_a.slice.{g}", s.heads * s.head_dim // s.o_groups, s.o_lora) for g in range(s.o_groups)]
        if sched[ln]:
            width = 2 * s.head_dim if sched[ln] == 4 else s.head_dim  # CSA windows overlap: 2x
            dense += [("attn.compressor.wkv", H, width), ("attn.compressor.wgate", H, width)]
        if sched[ln] == 4:
            dense += [("attn.indexer.compressor.wkv", H, 2 * s.index_head_dim),
                      ("attn.indexer.compressor.wgate", H, 2 * s.index_head_dim),
                      ("attn.indexer.wq_b", s.q_lora, s.index_heads * s.index_head_dim)]
        for m, k, n in dense:
            name = f"{p}.{m}"
            marker = None if (s.drop_marker and ln == 0 and m == "attn.wq_b") else "mcg"
            b.exl3(DENSE, name, k, n, s.dense_k, marker)
        if s.drop_marker:
            notes["drop_marker"] = "layers.0.attn.wq_b has no marker"
    last = base[-1]
    for nm, shape, dt in (("norm.weight", [H], "BF16"), ("head.weight", [s.vocab, H], "BF16"),
                          ("hc_head_fn", [4, 4 * H], "F32"), ("hc_head_base", [4], "F32"),
                          ("hc_head_scale", [1], "F32")):
        b.put(last, nm, shape, dt)
    # draft (DSpark/MTP) layers: BF16 attention and shared expert, EXL3 routed experts (overlay)
    for j in range(M):
        p = f"mtp.{j}"
        for nm, shape in ((f"{p}.attn.wq_a.weight", [s.q_lora, H]), (f"{p}.attn.wkv.weight", [s.head_dim, H]),
                          (f"{p}.attn.wq_b.weight", [s.heads * s.head_dim, s.q_lora]),
                          (f"{p}.attn.wo_a.weight", [s.o_groups * s.o_lora, s.heads * s.head_dim // s.o_groups]),
                          (f"{p}.attn.wo_b.weight", [H, s.o_groups * s.o_lora]),
                          (f"{p}.ffn.shared_experts.w1.weight", [I, H]), (f"{p}.ffn.shared_experts.w3.weight", [I, H]),
                          (f"{p}.ffn.shared_experts.w2.weight", [H, I]), (f"{p}.ffn.gate.weight", [s.experts, H]),
                          (f"{p}.attn_norm.weight", [H]), (f"{p}.ffn_norm.weight", [H])):
            b.put(last, nm, shape, "BF16")
        for e in range(s.experts):
            for w, (k, n) in (("w1", (H, I)), ("w3", (H, I)), ("w2", (I, H))):
                b.exl3(MTP, f"{p}.ffn.experts.{e}.{w}", k, n, s.routed_bits, "mcg", [1])
    if M:
        b.put(last, "mtp.0.main_proj.weight", [H, 3 * H], "BF16")
    if s.vision:
        for nm, shape in (("vision.patch_embed.weight", [128, 3 * 14 * 14]), ("vision.blocks.0.attn.qkv.weight", [384, 128]),
                          ("vision.blocks.0.mlp.fc1.weight", [352, 128]), ("aligner.proj.weight", [H, 128 * 9])):
            b.put(last, nm, shape, "BF16")

    # --- traps on the tensor level --------------------------------------------------------------
    weight_map = {name: shard for shard, ts in b.shards.items() for name in ts}
    if s.duplicate_tensor:
        victim = "layers.0.attn_norm.weight"
        b.shards[base[-1]][victim] = b.shards[base[0]][victim].clone()
        notes["duplicate_tensor"] = f"{victim} in {base[0]} and {base[-1]}"
    if s.drop_tensor:
        victim = "layers.1.ffn.experts.1.w2.suh"
        del b.shards[weight_map[victim]][victim]
        notes["drop_tensor"] = f"{victim} removed from {weight_map[victim]}"
    for shard, ts in b.shards.items():
        save_file(ts, str(out / shard), metadata={"format": "pt"})
    shards = sorted(b.shards)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum((out / f).stat().st_size for f in shards)},
         "weight_map": dict(sorted(weight_map.items()))}, indent=1))

    # --- config.json -------------------------------------------------------------------------
    shared = "ffn.shared_experts" if s.shared_spelling == "ffn" else "mlp.shared_experts"
    stamp = s.bits_stamp if s.bits_stamp is not None else s.dense_k
    entries: dict[str, Any] = {}
    for ln in range(L):
        for kind in DENSE_FUSED:
            if "compressor" in kind and not sched[ln]:
                continue
            if "indexer" in kind and sched[ln] != 4:
                continue
            key = f"{s.prefix_root}layers.{ln}.{kind.replace('ffn.shared_experts', shared)}"
            entries[key] = {"bits": stamp}
    if s.drop_entry:
        gone = f"{s.prefix_root}layers.{L - 1}.attn.wo_b"
        entries.pop(gone)
        notes["drop_entry"] = gone
    layer_bits = {str(ln): 3 for ln in s.k3_layers if ln < L}
    layer_bits.update({str(L + j): s.routed_bits for j in range(M)})
    if s.layer_bits_override is not None:
        layer_bits = dict(s.layer_bits_override)
    qc: dict[str, Any] = {
        "quant_method": s.quant_method, "codebook": s.codebook, "bits": s.routed_bits, "layer_bits": layer_bits,
        "non_routed_dtype_policy": "bf16_as_stored",
        "non_routed_quantization": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
        "non_routed_exl3": {"codebook": "mcg", "layers": entries},
    }
    if s.mtp_experts is not None:
        qc["mtp_experts"], qc["mtp_experts_start_layer"] = s.mtp_experts, L
    config = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "num_hidden_layers": L, "hidden_size": H, "moe_intermediate_size": I, "n_routed_experts": s.experts,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "num_attention_heads": s.heads, "num_key_value_heads": 1,
        "head_dim": s.head_dim, "q_lora_rank": s.q_lora, "o_lora_rank": s.o_lora, "o_groups": s.o_groups,
        "index_n_heads": s.index_heads, "index_head_dim": s.index_head_dim, "index_topk": 16,
        "sliding_window": 128, "compress_ratios": sched + [0] * M, "num_nextn_predict_layers": M,
        "num_hash_layers": s.hash_layers, "hc_mult": 4, "vocab_size": s.vocab, "swiglu_limit": 10.0,
        "routed_scaling_factor": 1.5, "torch_dtype": "bfloat16", "quantization_config": qc,
    }
    if s.vision:
        config.update({"vision_n_layers": 1, "vision_dim": 128, "vision_n_heads": 2, "vision_patch_size": 14})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                             "bos_token": "<bos>", "eos_token": "<eos>"}))
    (out / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {},
                                                                                 "merges": []}}))

    # --- traps on the file level ---------------------------------------------------------------
    if s.truncate_shard:
        victim = out / base[0]
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size - 64)
        notes["truncate_shard"] = base[0]
    if s.missing_shard:
        (out / K2).unlink()
        notes["missing_shard"] = K2
    for name in s.drop_files:
        (out / name).unlink()
        notes.setdefault("drop_files", ",".join(s.drop_files))
    if s.live_symlinks or s.dead_symlink:
        basedir = out.parent / f"{out.name}-base"
        basedir.mkdir(exist_ok=True)
        linked = ["tokenizer.json", "tokenizer_config.json", "generation_config.json", base[0]] if s.live_symlinks else []
        if s.dead_symlink:
            linked.append(s.dead_symlink)
        for name in dict.fromkeys(linked):
            shutil.move(str(out / name), str(basedir / name))
            os.symlink(basedir / name, out / name)
        if s.dead_symlink:
            (basedir / s.dead_symlink).unlink()  # the base download was deleted
            notes["dead_symlink"] = s.dead_symlink
    if s.extra_unindexed:
        save_file({"stray.weight": b.torch.zeros([4], dtype=b.torch.bfloat16)}, str(out / "model-stray.safetensors"))
        notes["extra_unindexed"] = "model-stray.safetensors"
    return SynthPack(path=out, spec=s, config=config, shards=shards, weight_map=weight_map, notes=notes)
