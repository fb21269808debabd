"""The embedded demo model: a tiny, random, deterministic DeepSeek-V3-style MoE with one MTP layer.

It exists so the whole launcher (profiles, supervision, per-rank gates, the vLLM plugin, bench)
runs against a real vLLM on a CPU-only machine with no network. Settings are the ones vLLM's
CPU backend accepts (shared/docs/vllm-cpu-reference.md §2): MLA with a 576-wide latent
(kv_lora_rank 512 + rope 64), `topk_method=noaux_tc`, heads divisible by TP 2. The MTP layer is
stored as decoder layer `num_hidden_layers` plus the enorm/hnorm/eh_proj/shared_head tensors
vLLM's DeepSeek MTP loader expects.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from dsv4serve import home
from dsv4serve.errors import BadInput, JobFailed

FORMAT_VERSION = 1
STAMP = "dsv4serve-demo.json"
# Every name a demo model directory holds (the stamp included); `.demo-*` are its build dirs.
DEMO_FILES = frozenset({STAMP, "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "generation_config.json"})
MAX_SEED = 2**32 - 1
VOCAB = 2048
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
# `thinking` is accepted (and ignored) so clients can send chat_template_kwargs as they would to
# the real seat.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.5,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
}


def _corpus(seed: int, words: int = 3000) -> list[str]:
    rng = random.Random(seed)
    onsets = ["k", "s", "t", "n", "h", "m", "y", "r", "w", "g", "z", "d", "b", "p", ""]
    vowels = ["a", "i", "u", "e", "o"]
    vocab = ["".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(1, 4)))
             for _ in range(words)]
    lines = []
    for _ in range(words // 6):
        lines.append(" ".join(rng.choice(vocab) for _ in range(rng.randint(4, 14))) + ".")
    # Common English and code tokens so bench prompts tokenise to something sensible.
    lines += ["Explain how a transformer generates text step by step.",
              "Write a Python class implementing an LRU cache with get and put.",
              "def get(self, key): return self.cache.get(key)", "the secret code is"] * 20
    return lines


def _train_tokenizer(seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return tok


def _tensors(seed: int) -> dict:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = dict(CONFIG)
    n = cfg["num_hidden_layers"]
    cfg["num_hidden_layers"] = n + 1  # the extra decoder layer becomes the MTP block
    torch.manual_seed(seed)
    hf_cfg = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    model = DeepseekV3ForCausalLM(hf_cfg).to(torch.bfloat16)
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().contiguous()
        # transformers 5 stores experts fused; vLLM's DeepSeek loader reads per-expert linears.
        if k.endswith("mlp.experts.gate_up_proj"):
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                sd[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :inter].clone()
                sd[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, inter:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                sd[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].clone()
        else:
            sd[k] = v
    h = cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed + 1)
    pre = f"model.layers.{n}."
    sd[pre + "enorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    sd[pre + "hnorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    sd[pre + "eh_proj.weight"] = (torch.randn(h, 2 * h, generator=g) * 0.02).to(torch.bfloat16)
    sd[pre + "shared_head.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    sd[pre + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    for k in list(sd):
        if k.endswith("e_score_correction_bias"):
            sd[k] = sd[k].float()  # vLLM keeps the selection bias in fp32
    return sd


def _write(out: Path, seed: int) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(seed)
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "model_max_length": CONFIG["max_position_embeddings"],
        "add_bos_token": False, "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}, indent=2))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))
    save_file(_tensors(seed), str(out / "model.safetensors"), metadata={"format": "pt"})


def _stamp(seed: int) -> dict:
    blob = json.dumps({"v": FORMAT_VERSION, "seed": seed, "config": CONFIG, "template": CHAT_TEMPLATE},
                      sort_keys=True)
    return {"format": FORMAT_VERSION, "seed": seed, "digest": hashlib.sha256(blob.encode()).hexdigest()[:16]}


def check_seed(seed: int) -> int:
    """torch takes seeds up to 2**64-1 and random.Random any int, but `seed + 1` seeds a second
    generator and a negative seed would alias a large one in torch, so a plain 32-bit range keeps
    one seed = one model everywhere."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise BadInput(f"demo model seed {seed!r} is out of range", hint=f"use a whole number from 0 to {MAX_SEED}")
    return seed


def default_dir(seed: int) -> Path:
    return home.models_dir() / f"demo-seed{seed}"


def is_complete(path: Path, seed: int) -> bool:
    """The stamp of this seed, and every file it lists with the content it was written with: a
    model whose weights were emptied or whose config was deleted is rebuilt, never served."""
    try:
        stamp = json.loads((path / STAMP).read_text())
        if not isinstance(stamp, dict) or {k: stamp.get(k) for k in _stamp(seed)} != _stamp(seed):
            return False
        files = stamp.get("files")
        if not isinstance(files, dict) or "model.safetensors" not in files:
            return False
        return all(isinstance(want, str) and _sha256(path / name) == want for name, want in files.items())
    except (OSError, ValueError):
        return False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _is_demo_dir(path: Path) -> bool:
    """Generated by us (any seed or format), so its files are ours to replace: a stamped model, or
    one whose swap was interrupted (the stamp goes last): our build dir still inside it, and no
    name we do not write. The build dir is the proof: a Hugging Face model directory holds the
    very same file names, and must never be taken for ours."""
    try:
        stamp = json.loads((path / STAMP).read_text())
        if isinstance(stamp, dict) and {"format", "seed", "digest"} <= set(stamp):
            return True
    except (OSError, ValueError):
        pass
    entries = list(path.iterdir())
    build = [e for e in entries if e.name.startswith(".demo-") and e.is_dir()]
    return bool(build) and all(e in build or e.name in DEMO_FILES for e in entries)


def _check_out(out: Path) -> None:
    """Refuse any target whose contents are not ours before a byte is written."""
    fix = "pick a new or empty directory (demo-model --out DIR)"
    if out.is_symlink() and not out.exists():
        raise BadInput(f"demo model directory {out} is a broken symlink", hint=fix)
    if out.exists() and not out.is_dir():
        raise BadInput(f"demo model directory {out} is a file, not a directory", hint=fix)
    if not out.is_dir():
        return
    try:
        empty = next(out.iterdir(), None) is None
    except OSError as e:
        raise BadInput(f"cannot read demo model directory {out} ({e.strerror or e})", hint=fix) from None
    if not empty and not _is_demo_dir(out):
        # --force does not override this: it rebuilds a demo model, it never deletes other files.
        why = f"its {STAMP} is not a demo model's stamp" if (out / STAMP).exists() else f"no {STAMP}"
        raise BadInput(f"{out} is not empty and holds no demo model ({why}); nothing was changed",
                       hint=f"{fix}, or move its files away")


def _install(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.replace(tmp, out)  # one atomic rename: the model appears whole or not at all
        return
    # An empty dir or our own earlier model: replace only the files we write, leaving anything
    # else the user keeps there. The stamp goes first and comes back last, so an interrupted
    # swap never looks complete.
    (out / STAMP).unlink(missing_ok=True)
    for f in sorted(tmp.iterdir()):
        if f.name != STAMP:
            os.replace(f, out / f.name)
    os.replace(tmp / STAMP, out / STAMP)


def ensure_demo_model(out: Path | None = None, seed: int = 0, force: bool = False) -> Path:
    """Write the demo model (or reuse a complete one). Built in a temp dir and moved into place
    so an interrupted run never leaves a half-written model that looks valid."""
    check_seed(seed)
    out = Path(out) if out else default_dir(seed)
    _check_out(out)
    if not force and is_complete(out, seed):
        return out
    # Inside an existing target the temp dir shares its filesystem even when `out` is a symlink
    # to another disk, so every move is a rename.
    parent = out if out.is_dir() else out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=parent))
    except OSError as e:
        raise BadInput(f"cannot create the demo model directory {out} ({e.strerror or e})",
                       hint="pick a directory you can write to (demo-model --out DIR)") from None
    try:
        _write(tmp, seed)
        files = {f.name: _sha256(f) for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / STAMP).write_text(json.dumps({**_stamp(seed), "files": files}))
        _install(tmp, out)
    except OSError as e:
        raise JobFailed(f"writing the demo model to {out} failed ({e.strerror or e})",
                        hint="free space or fix permissions there, then run demo-model again") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
