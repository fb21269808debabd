"""pack.py against generated synthetic packs: a clean pack passes, each trap fails by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4serve import pack
from dsv4serve.pack import Tensor
from dsv4serve.testing.synthpack import SynthSpec, compress_schedule, write_pack

VISION = "DeepseekV4ForConditionalGeneration"


def _validate(sp, **kw):
    args = {"expect_shards": sp.expect_shards, "model_class": VISION, "wo_a_slices": 8}
    args.update(kw)
    return pack.validate(sp.path, **args)


def _bad(rep, statuses=("fail", "warn")):
    return {f.check: f for f in rep.findings if f.status in statuses}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return write_pack(tmp_path_factory.mktemp("packs") / "clean")


def test_clean_pack_passes(clean):
    rep = _validate(clean)
    assert _bad(rep) == {}, [(f.check, f.found) for f in rep.findings if f.status != "ok"]
    names = [f.check for f in rep.findings]
    for check in ("files-resolve", "shard-count", "tensors-missing", "tensors-duplicated", "quant-method", "codebook",
                  "codebook-markers", "dense-bits", "dense-prefixes", "dense-entry-counts", "routed-bits",
                  "tokenizer", "generation-config", "shapes"):
        assert check in names
    # the expectation is derived from the synthetic pack's own 5-layer schedule, not the real 43
    assert rep.get("dense-entry-counts").found == "5/5/5/5/3/2/2/5/5"


# (spec knobs, the check that must catch it, its status, a word its `found` must contain)
TRAPS = [
    ({"bits_stamp": 4}, "dense-bits", "fail", "bits 4"),                      # trap 1: the 6-bit bake stamped 4
    ({"prefix_root": "model."}, "dense-prefixes", "fail", "model.layers.N"),  # dense_bake default, text class
    ({"shared_spelling": "mlp"}, "dense-prefixes", "fail", "mlp.shared_experts"),
    ({"layer_bits_override": {"2": 2}}, "routed-bits", "fail", "layer 2"),   # K3 experts, config says 2
    ({"codebook": "mul1"}, "codebook", "fail", "mcg"),                        # declared codebook vs markers
    ({"mixed_codebook": True}, "codebook", "fail", "mixed"),
    ({"drop_marker": True}, "codebook-markers", "fail", "layers.0.attn.wq_b"),
    ({"drop_entry": True}, "dense-entry-counts", "fail", "attn.wo_b"),
    ({"drop_entry": True}, "dense-coverage", "fail", "layers.4.attn.wo_b"),
    ({"quant_method": "fp8"}, "quant-method", "fail", "fp8"),
    ({"mtp_experts": "source"}, "mtp-experts", "fail", "source"),
    ({"drop_tensor": True}, "tensors-missing", "fail", "layers.1.ffn.experts.1.w2.suh"),
    ({"duplicate_tensor": True}, "tensors-duplicated", "fail", "layers.0.attn_norm.weight"),
    ({"missing_shard": True}, "files-resolve", "fail", "model-layers-k2.safetensors (missing)"),
    ({"truncate_shard": True}, "headers", "fail", "truncated"),
    ({"dead_symlink": "tokenizer.json"}, "files-resolve", "fail", "dead symlink"),  # trap 10
    ({"dead_symlink": "model-00002-of-00004.safetensors"}, "files-resolve", "fail", "dead symlink"),
    ({"live_symlinks": True}, "symlinks", "warn", "4 symlinked"),
    ({"drop_files": ("tokenizer.json",)}, "tokenizer", "fail", "tokenizer.json"),
    ({"drop_files": ("generation_config.json",)}, "generation-config", "fail", "missing"),
    ({"extra_unindexed": True}, "unindexed-files", "warn", "model-stray.safetensors"),
    ({"vision": False}, "model-class", "fail", "DeepseekV4ForCausalLM"),  # vLLM would pick the text class
]


@pytest.mark.parametrize("knobs,check,status,word", TRAPS, ids=[f"{t[1]}:{list(t[0])[0]}" for t in TRAPS])
def test_each_trap_is_caught_by_name(tmp_path, knobs, check, status, word):
    sp = write_pack(tmp_path / "pack", SynthSpec(**knobs))
    rep = _validate(sp)
    f = rep.get(check)
    assert f is not None, f"no {check} finding"
    assert f.status == status, (f, _bad(rep))
    assert word in f.found, f.found
    assert f.fix, "every failing finding says how to fix it"


def test_bits_stamp_fix_names_the_real_width(tmp_path):
    rep = _validate(write_pack(tmp_path / "p", SynthSpec(bits_stamp=4)))
    f = rep.get("dense-bits")
    assert "last dim 96" in f.found and "to 6" in f.fix
    # and nothing else is blamed: the rest of the pack is fine
    assert set(_bad(rep)) == {"dense-bits"}


def test_wrong_prefix_still_gets_bits_checked(tmp_path):
    """The prefix trap fails dense-prefixes alone; coverage and bits still see the modules."""
    rep = _validate(write_pack(tmp_path / "p", SynthSpec(prefix_root="model.")))
    assert set(_bad(rep)) == {"dense-prefixes"}
    assert rep.get("dense-bits").status == "ok"


def test_text_class_wants_model_layers(tmp_path):
    sp = write_pack(tmp_path / "p", SynthSpec(prefix_root="model.", vision=False))
    rep = _validate(sp, model_class="DeepseekV4ForCausalLM")
    assert rep.get("dense-prefixes").status == "ok"
    assert rep.get("model-class").status == "ok"


def test_shard_count_against_the_profile(clean):
    rep = _validate(clean, expect_shards=51)
    f = rep.get("shard-count")
    assert f.status == "fail" and f.found == f"{clean.expect_shards} safetensors files" and "51" in f.expected


def test_wo_a_slices_against_tp(clean):
    rep = _validate(clean, wo_a_slices=4)
    assert rep.get("wo-a-slices").status == "fail"


def test_canon_shaped_pack_has_the_real_entry_counts(tmp_path):
    """43 layers with the real schedule give the counts seat-reference §8 quotes (790 dense linears)."""
    sp = write_pack(tmp_path / "canon", SynthSpec(layers=43, mtp_layers=3, experts=2, hidden=128, inter=64, vocab=256,
                                                  k3_layers=(13, 22, 28), k2_overlay_layer=21))
    rep = _validate(sp)
    assert _bad(rep) == {}
    assert rep.get("dense-entry-counts").found == "43/43/43/43/41/21/21/43/43"
    assert "790 modules K6" in rep.get("dense-bits").found
    assert rep.get("routed-bits").found == "43 layers K2, 3 layers K3"  # 40 trunk K2 + 3 draft K2; 13, 22, 28 K3


def test_expected_counts_from_the_real_config():
    cfg = {"num_hidden_layers": 43, "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0, 0, 0]}
    assert compress_schedule(43) == cfg["compress_ratios"][:43]
    counts, basis = pack._expected_counts(cfg, {})
    assert tuple(counts) == pack.CANON_ENTRY_COUNTS and "compress_ratios" in basis


def test_headers_only(clean, monkeypatch):
    """Validation reads the 8-byte length and the JSON header of each shard, never tensor data."""
    read = {"bytes": 0}
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def read(self, n=-1):
            data = self.f.read(n)
            read["bytes"] += len(data)
            return data

    monkeypatch.setattr(pack, "open", lambda p, mode="r", *a, **k: Counting(real_open(p, mode, *a, **k)),
                        raising=False)
    import safetensors

    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: pytest.fail("safe_open loads tensors"))
    _validate(clean)
    budget = 0
    for f in clean.shards:
        with real_open(clean.path / f, "rb") as fh:
            budget += 8 + int.from_bytes(fh.read(8), "little")
    assert 0 < read["bytes"] <= budget


def test_header_reader_agrees_with_safetensors(clean):
    from safetensors import safe_open

    shard = clean.path / clean.shards[0]
    _, hdr = pack.read_header(shard)
    with safe_open(str(shard), framework="pt") as f:
        keys = set(f.keys())
        sample = sorted(keys)[0]
        assert list(f.get_slice(sample).get_shape()) == hdr[sample]["shape"]
    assert keys == set(hdr)


def test_garbage_file_is_a_header_failure(tmp_path, clean):
    import shutil

    p = tmp_path / "p"
    shutil.copytree(clean.path, p)
    (p / clean.shards[0]).write_bytes(b"\xff" * 64)
    rep = pack.validate(p, expect_shards=clean.expect_shards, model_class=VISION)
    assert rep.get("headers").status == "fail" and "header length" in rep.get("headers").found


def test_missing_directory(tmp_path):
    rep = pack.validate(tmp_path / "nope")
    assert [(f.check, f.status) for f in rep.findings] == [("pack-dir", "fail")]


def test_plain_pack_rules(tmp_path, clean):
    """exl3=False (the demo seat): file rules only; a quantization_config is only a warning."""
    rep = pack.validate(clean.path, exl3=False)
    assert rep.get("quant-method").status == "warn"
    assert rep.get("dense-bits") is None


# --- weights per rank -------------------------------------------------------------------------


def _exl3(name, k, n, bits, marker_shape=(1,)):
    return {f"{name}.trellis": Tensor(f"{name}.trellis", "f", "I16", [k // 16, n // 16, 16 * bits], k * n * bits // 8),
            f"{name}.suh": Tensor(f"{name}.suh", "f", "F16", [k], 2 * k),
            f"{name}.svh": Tensor(f"{name}.svh", "f", "F16", [n], 2 * n),
            f"{name}.mcg": Tensor(f"{name}.mcg", "f", "I32", list(marker_shape), 4)}


def test_one_real_expert_per_rank_matches_the_kernels_figure():
    """exl3-reference §5.3: a K2 expert (H 4096, I 2048) holds 812,544 B per rank at TP 8 (trellis
    786,432 + suh/svh 26,112), independently measured by lna-lab's kernel; plus 3 markers."""
    ts = {}
    for w, (k, n) in (("w1", (4096, 2048)), ("w3", (4096, 2048)), ("w2", (2048, 4096))):
        ts.update(_exl3(f"layers.0.ffn.experts.0.{w}", k, n, 2))
    assert pack.rank_weights(ts, 8) == {"routed experts": 812_544 + 3 * 4}


def test_sharding_rules():
    ts = {}
    ts.update(_exl3("layers.0.attn.wq_a", 4096, 1024, 6, ()))  # replicated: whole on every rank
    ts.update(_exl3("layers.0.attn.wq_b", 1024, 32768, 6, ()))  # column-parallel
    for g in range(8):
        ts.update(_exl3(f"layers.0.attn.wo_a.slice.{g}", 4096, 1024, 6, ()))  # one slice per rank
    ts.update(_exl3("mtp.0.ffn.experts.0.w1", 4096, 2048, 2))
    whole = sum(t.nbytes for n, t in ts.items() if n.startswith("layers.0.attn.wq_a"))
    wq_b = (1024 * 32768 * 6 // 8) // 8 + 2 * 1024 + (2 * 32768) // 8 + 4
    slice0 = sum(t.nbytes for n, t in ts.items() if n.startswith("layers.0.attn.wo_a.slice.0."))
    got = pack.rank_weights(ts, 8)
    assert got["attention/other per layer"] == whole + wq_b + slice0
    assert "draft experts" in got
    assert "draft experts" not in pack.rank_weights(ts, 8, include_draft=False)


def test_index_json_is_what_the_generator_wrote(clean):
    idx = json.loads((Path(clean.path) / pack.INDEX).read_text())
    assert set(idx["weight_map"].values()) == set(clean.shards)
    assert clean.config["quantization_config"]["non_routed_exl3"]["layers"]


# --- one failure on the real cause ---------------------------------------------------------------


def test_a_missing_shard_fails_on_its_files_not_on_the_dense_entries_it_held(tmp_path):
    """Entries whose modules sit in the missing file are that failure: dense-coverage and the
    tensor-counted entry counts must not send the user to rebuild a config that is fine."""
    sp = write_pack(tmp_path / "pack", SynthSpec(missing_shard=True))
    rep = _validate(sp)
    assert set(_bad(rep, ("fail",))) == {"files-resolve", "tensors-missing"}, \
        [(f.check, f.found) for f in rep.findings if f.status == "fail"]


@pytest.mark.parametrize("edit, found", [
    (lambda c: [c], "the top level is a JSON list, not an object"),
    (lambda c: {**c, "architectures": 5}, "architectures is 5, not a list of class names"),
    (lambda c: {**c, "num_hidden_layers": "two"}, 'num_hidden_layers is "two", not a whole number'),
    (lambda c: {**c, "vision_n_layers": "x"}, 'vision_n_layers is "x", not a whole number'),
    (lambda c: {**c, "quantization_config": [1]}, "quantization_config is [1], not a JSON object"),
    (lambda c: {**c, "compress_ratios": 4}, "compress_ratios is 4, not a JSON list"),
    (lambda c: {**c, "compress_ratios": ["4"] * len(c["compress_ratios"])}, 'compress_ratios holds "4", not whole numbers'),
    # the checks enumerate each layer's experts: these exhausted memory before any row was written
    (lambda c: {**c, "n_routed_experts": 100_000_000}, "n_routed_experts is 100,000,000, beyond any model (65,536 at most)"),
    (lambda c: {**c, "num_hidden_layers": 1_000_000_000}, "num_hidden_layers is 1,000,000,000, beyond any model (65,536 at most)"),
    # each within its bound, their product 13 billion expert names (MemoryError; helper audit)
    (lambda c: {**c, "num_hidden_layers": 65_536, "n_routed_experts": 65_536},
     "num_hidden_layers x n_routed_experts is 4,294,967,296, beyond any model (1,048,576 at most; DeepSeek-V4 has "
     "61 x 256)"),
])
def test_a_config_of_the_wrong_shape_is_one_config_failure_not_a_crash(tmp_path, clean, edit, found):
    import shutil

    p = tmp_path / "p"
    shutil.copytree(clean.path, p)
    cfg = json.loads((p / "config.json").read_text())
    (p / "config.json").write_text(json.dumps(edit(cfg)))
    rep = pack.validate(p, expect_shards=clean.expect_shards, model_class=VISION, wo_a_slices=8)
    assert set(_bad(rep)) == {"config"}, [(f.check, f.found) for f in rep.findings if f.status != "ok"]
    assert rep.get("config").found == f"config.json: {found}" and rep.get("config").fix
    assert rep.get("exl3-rules").status == "n/a"


@pytest.mark.parametrize("index, word", [
    ("{not json", "JSONDecodeError"),
    ('{"metadata": {}}', "KeyError"),
    ("[1, 2]", "TypeError"),
    ('{"weight_map": {"a.weight": null}}', "weight_map['a.weight'] is null, not a file name"),
    ('{"weight_map": {}}', "weight_map is empty"),
])
def test_an_unreadable_index_still_reads_the_shards_on_disk(tmp_path, clean, index, word):
    import shutil

    p = tmp_path / "p"
    shutil.copytree(clean.path, p)
    (p / pack.INDEX).write_text(index)
    rep = pack.validate(p, expect_shards=clean.expect_shards, model_class=VISION, wo_a_slices=8)
    assert set(_bad(rep)) == {"index"} and word in rep.get("index").found, \
        [(f.check, f.found) for f in rep.findings if f.status != "ok"]
    assert rep.get("shard-count").status == "ok" and rep.get("dense-bits").status == "ok"
    assert rep.get("unindexed-files").status == "n/a"  # not "the index names every file": it names none


@pytest.mark.parametrize("entry", [
    {"dtype": "F16", "shape": [2], "data_offsets": ["0", "4"]},
    {"dtype": "F16", "shape": "ab", "data_offsets": [0, 4]},
    {"dtype": 7, "shape": [2], "data_offsets": [0, 4]},
    {"dtype": "F16", "shape": [2], "data_offsets": [4, 0]},
])
def test_a_header_entry_of_the_wrong_types_is_malformed_not_a_crash(tmp_path, entry):
    import struct

    hdr = json.dumps({"t": entry}).encode()
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 8)
    with pytest.raises(pack.HeaderError, match="tensor t: malformed header entry"):
        pack.read_header(f)


def test_layer_bits_that_is_not_a_mapping_fails_instead_of_being_ignored(tmp_path, clean):
    import shutil

    p = tmp_path / "p"
    shutil.copytree(clean.path, p)
    cfg = json.loads((p / "config.json").read_text())
    cfg["quantization_config"]["layer_bits"] = [2, 3]
    (p / "config.json").write_text(json.dumps(cfg))
    rep = pack.validate(p, expect_shards=clean.expect_shards, model_class=VISION, wo_a_slices=8)
    f = rep.get("routed-bits")
    assert f.status == "fail" and f.found == "quantization_config.layer_bits is [2, 3]" and f.fix


@pytest.mark.parametrize("where", ["sub/{name}", "../elsewhere/{name}", ".{name}"])
def test_an_index_naming_files_outside_the_top_level_fails(tmp_path, clean, where):
    """vLLM reads the top level's *.safetensors only (and a docker seat mounts nothing else): a
    weight_map entry that is a path, or a hidden file, names tensors that are never loaded."""
    import shutil

    p = tmp_path / "p"
    shutil.copytree(clean.path, p)
    doc = json.loads((p / pack.INDEX).read_text())
    name = sorted(set(doc["weight_map"].values()))[3]
    moved = where.format(name=name)
    (p / moved).parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(p / name), str(p / moved))
    doc["weight_map"] = {k: (moved if v == name else v) for k, v in doc["weight_map"].items()}
    (p / pack.INDEX).write_text(json.dumps(doc))
    rep = pack.validate(p, expect_shards=clean.expect_shards, model_class=VISION, wo_a_slices=8)
    row = rep.get("index")
    assert row.status == "fail" and f"outside the pack's top level: {moved}" in row.found, row
    assert "move those files into the pack directory" in row.fix


@pytest.mark.parametrize("key, value, tensor, found", [
    ("moe_intermediate_size", 256, "layers.0.ffn.experts.0.w1.trellis", "[16, 8], config says [16, 16]"),
    ("hidden_size", 512, "embed.weight", "[1024, 256], config says [1024, 512]"),
    ("vocab_size", 2048, "embed.weight", "[1024, 256], config says [2048, 256]"),
    ("n_routed_experts", 8, "layers.0.ffn.gate.weight", "[4, 256], config says [8, 256]"),
])
def test_config_dimensions_against_the_stored_shapes(tmp_path, clean, key, value, tensor, found):
    """A config.json of another export fails by name before an 86 GB load, not as one rank's shape
    error minutes into it."""
    import shutil

    p = tmp_path / "p"
    shutil.copytree(clean.path, p)
    cfg = json.loads((p / "config.json").read_text())
    assert cfg[key] != value
    cfg[key] = value
    (p / "config.json").write_text(json.dumps(cfg))
    f = pack.validate(p, expect_shards=clean.expect_shards, model_class=VISION, wo_a_slices=8).get("shapes")
    assert f.status == "fail" and f"{tensor} {found}" in f.found, f
    assert f"{key} {value}" in f.expected and "config.json is not this pack's" in f.fix


def test_a_missing_quantization_config_is_one_failure_not_five(tmp_path, clean):
    import shutil

    p = tmp_path / "p"
    shutil.copytree(clean.path, p)
    cfg = json.loads((p / "config.json").read_text())
    cfg.pop("quantization_config")
    (p / "config.json").write_text(json.dumps(cfg))
    rep = pack.validate(p, expect_shards=clean.expect_shards, model_class=VISION, wo_a_slices=8)
    assert set(_bad(rep, ("fail",))) == {"quant-method"}, [(f.check, f.found) for f in rep.findings if f.status == "fail"]
    for name in ("codebook", "dense-bits", "routed-bits", "mtp"):
        assert rep.get(name).status == "n/a" and "see quant-method" in rep.get(name).found


def test_the_short_form_dense_stamp_is_checked_too(tmp_path, clean):
    """non_routed_exl3 without a layers map (bits / layer_bits / modules) used to be 'not checked':
    a 6-bit bake stamped 4 there (trap 1) passed with a warning."""
    import shutil

    p = tmp_path / "p"
    shutil.copytree(clean.path, p)
    cfg = json.loads((p / "config.json").read_text())
    nr = cfg["quantization_config"]["non_routed_exl3"]
    real = {v["bits"] if isinstance(v, dict) else v for v in nr["layers"].values()}
    assert len(real) == 1
    (k,) = real

    def short(bits):
        cfg["quantization_config"]["non_routed_exl3"] = {"codebook": nr.get("codebook", "mcg"), "bits": bits,
                                                         "modules": ["attn", "ffn.shared_experts"]}
        (p / "config.json").write_text(json.dumps(cfg))
        return pack.validate(p, expect_shards=clean.expect_shards, model_class=VISION, wo_a_slices=8).get("dense-bits")

    ok = short(k)
    assert ok.status == "ok" and ok.found.startswith("short form: ") and f"match bits {k}" in ok.found, ok
    wrong = 4 if k != 4 else 6
    bad = short(wrong)
    assert bad.status == "fail" and f"bits {wrong}, trellis K{k}" in bad.found and "trap 1" in bad.fix, bad
    cfg["quantization_config"]["non_routed_exl3"] = {"layers": ["x"]}
    (p / "config.json").write_text(json.dumps(cfg))
    row = pack.validate(p, expect_shards=clean.expect_shards, model_class=VISION, wo_a_slices=8).get("dense-bits")
    assert row.status == "fail" and 'non_routed_exl3.layers is ["x"], not a map' in row.found


def _shard_linked_out(clean, tmp_path):
    """A copy of the clean pack at tmp_path/p whose third shard lives in tmp_path/base and is linked
    back by an absolute symlink: (pack dir, shard name, base dir)."""
    import shutil

    p = tmp_path / "p"
    shutil.copytree(clean.path, p)
    name = sorted(x.name for x in p.glob("*.safetensors"))[2]
    base = tmp_path / "base"
    base.mkdir()
    shutil.move(str(p / name), str(base / name))
    (p / name).symlink_to(base / name)
    return p, name, base


def test_a_shard_linked_from_outside_the_pack_is_dead_in_the_container(tmp_path, clean):
    """A docker seat mounts only model.path: a symlink to a file outside it resolves on the host
    and is dead in the container, so there it fails; a native seat only gets trap 10's warning."""
    import shutil

    p, name, outside = _shard_linked_out(clean, tmp_path)
    kw = {"expect_shards": clean.expect_shards, "model_class": VISION, "wo_a_slices": 8}
    row = pack.validate(p, mounted_only=True, **kw).get("symlinks")
    assert row.status == "fail" and row.found == f"1 symlinked to paths the container does not mount: {name} -> {outside}"
    assert "inside the container these links are dead" in row.fix and "runtime.mounts" in row.fix
    assert pack.validate(p, **kw).get("symlinks").status == "warn"
    # the same link with its directory mounted at the same path is live there: it was refused (helper audit)
    mounted = [(str(p), str(p)), (str(outside), str(outside))]
    assert pack.validate(p, mounted_only=True, mounts=mounted, **kw).get("symlinks").status == "warn"
    assert pack.validate(p, mounted_only=True, mounts=[(str(p), str(p)), (str(outside), "/elsewhere")],
                         **kw).get("symlinks").status == "fail"  # mounted, but not where the link points
    # model.path a symlink to the real folder, a shard an absolute link into that folder: only
    # model.path is mounted, so the link is dead in the container; it passed as inside the pack
    real = tmp_path / "real"
    shutil.copytree(clean.path, real)
    (real / "store").mkdir()
    shutil.move(str(real / name), str(real / "store" / name))
    (real / name).symlink_to(real / "store" / name)
    current = tmp_path / "current"
    current.symlink_to(real)
    row = pack.validate(current, mounted_only=True, mounts=[(str(current), str(current))], **kw).get("symlinks")
    assert row.status == "fail" and row.found.endswith(f"{name} -> {real / 'store'}"), row
    inside = tmp_path / "q"
    shutil.copytree(clean.path, inside)
    (inside / "sub").mkdir()
    shutil.move(str(inside / name), str(inside / "sub" / name))
    (inside / name).symlink_to(inside / "sub" / name)  # a link that stays inside the mount is visible there
    assert pack.validate(inside, mounted_only=True, **kw).get("symlinks").status == "warn"


@pytest.mark.parametrize("edit, check", [
    # 10**400 has no float: OverflowError crashed the pack check (helper audit)
    (lambda c: c["quantization_config"].__setitem__("bits", 10**400), "routed-bits"),
    # a 5,000-digit layer index passed int()'s digit limit: ValueError crashed the check
    (lambda c: c["quantization_config"]["non_routed_exl3"]["layers"].__setitem__(
        "language_model.model.layers." + "9" * 5000 + ".attn.wq_b", {"bits": 6}), "dense-coverage"),
])
def test_absurd_numbers_in_a_config_are_findings_not_crashes(tmp_path, clean, edit, check):
    import shutil

    p = tmp_path / "p"
    shutil.copytree(clean.path, p)
    cfg = json.loads((p / "config.json").read_text())
    edit(cfg)
    (p / "config.json").write_text(json.dumps(cfg))
    rep = pack.validate(p, expect_shards=clean.expect_shards, model_class=VISION, wo_a_slices=8)
    assert rep.get(check).status == "fail" and not any("crashed" in f.found for f in rep.findings)


def test_a_header_that_is_not_plain_utf8_is_refused_as_safetensors_refuses_it(tmp_path, clean):
    """json.loads(bytes) also takes a UTF-8 BOM or UTF-16, which safetensors refuses: the pack
    check passed a shard vLLM could not open (helper audit). The header is decoded strictly first
    (landed in 8ad0760 without its test)."""
    import shutil
    import struct

    p = tmp_path / "p"
    shutil.copytree(clean.path, p)
    shard = p / clean.shards[0]
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    bom = b"\xef\xbb\xbf" + data[8:8 + n]
    shard.write_bytes(struct.pack("<Q", len(bom)) + bom + data[8 + n:])
    with pytest.raises(pack.HeaderError, match="header is not JSON"):
        pack.read_header(shard)


def test_routed_widths_the_seats_kernel_does_not_serve_fail(clean):
    """Stamps and widths agreed, so routed-bits said ok for a K3 layer on a seat whose kernel takes
    K2 only (lna2 under strict takes K 2 and 3, vllm-exl3 0.2.3 K 2-6): every rank then fails at load
    (check-seat audit)."""
    from dsv4serve import checks
    from dsv4serve.profile import load_profile

    args = dict(expect_shards=clean.expect_shards, model_class=VISION, wo_a_slices=8)
    ok = pack.validate(clean.path, routed_ks=(2, 3), **args).get("routed-bits")
    assert ok.status == "ok" and "K3" in ok.found
    f = pack.validate(clean.path, routed_ks=(2,), **args).get("routed-bits")
    assert f.status == "fail" and "layer 2: K3" in f.found and f.expected.startswith("routed experts of K2"), f
    assert checks._routed_ks(load_profile("8x16gb-380k")) == (2, 3)  # lna2, strict 1
    assert checks._routed_ks(load_profile("8x16gb-380k", ["moe.strict=0", "env.VLLM_EXL3_MOE_STRICT=0"])) == \
        (2, 3, 4, 5, 6)  # lna2 falls back to the incumbent for what it declines


def test_wo_a_slices_are_compared_with_the_seats_tensor_parallel_size(clean):
    """The row read "8 (one per TP rank)" without looking at TP: a profile without
    model.wo_a_rank_slices at TP 4 passed, and the attention patch refuses it at load (audit)."""
    args = dict(expect_shards=clean.expect_shards, model_class=VISION)
    assert pack.validate(clean.path, tp=8, **args).get("wo-a-slices").status == "ok"
    f = pack.validate(clean.path, tp=4, **args).get("wo-a-slices")
    assert f.status == "fail" and f.found.endswith("x 8 slices, the seat runs TP 4"), f


def test_bf16_shards_on_a_layer_split_across_ranks_fails_at_tp_above_one(tmp_path):
    """vllm-exl3 refuses `bf16_shards` where a dense layer's effective TP is above one (seat-reference
    §2.2): a pack baked for one GPU passed every row and died at load on the TP 8 seat (check-seat
    audit). Replicated layers (fused_wqa_wkv, the compressors) are whole on every rank: allowed."""
    sp = write_pack(tmp_path / "p", SynthSpec())
    cfg_path = sp.path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    entries = cfg["quantization_config"]["non_routed_exl3"]["layers"]
    wqa = next(k for k in entries if k.endswith("layers.0.attn.fused_wqa_wkv"))
    entries[wqa]["bf16_shards"] = [1]
    cfg_path.write_text(json.dumps(cfg))
    assert _validate(sp, tp=8).get("bf16-shards").status == "ok"
    wo_b = next(k for k in entries if k.endswith("layers.1.attn.wo_b"))
    entries[wo_b]["bf16_shards"] = [0]
    cfg_path.write_text(json.dumps(cfg))
    f = _validate(sp, tp=8).get("bf16-shards")
    assert f.status == "fail" and f.found == f"1 entries split across the 8 ranks set bf16_shards: {wo_b}", f.found
    assert "a pack baked for TP 8" in f.fix
    assert _validate(sp, tp=1).get("bf16-shards").status == "ok"
    assert _validate(write_pack(tmp_path / "q", SynthSpec()), tp=8).get("bf16-shards") is None  # none set: no row


def test_check_seat_judges_a_docker_seats_links_by_the_mounts_its_launch_gives(tmp_path, clean):
    """check-seat passes the docker seat's own `-v` pairs (as launch builds them) to the pack check:
    a shard linked into a directory the profile mounts at the same path is no refusal."""
    from dsv4serve import checks
    from dsv4serve.profile import load_profile

    p, name, base = _shard_linked_out(clean, tmp_path)
    model = ["model.demo=false", f"model.path={p}", f"model.expect_shards={clean.expect_shards}"]
    mounts = ('runtime.mounts=[{host: "{model_path}", container: "{model_path}", read_only: true}, '
              f'{{host: {base}, container: {base}, read_only: true}}]')
    for extra, want in (([], "fail"), ([mounts], "warn")):
        prof = load_profile("8x16gb-380k", [*model, *extra])
        assert (str(base), str(base)) in (checks._docker_mounts(prof) or []) or not extra
        rep = checks.Report(profile=prof.name)
        checks.check_pack(rep, checks.Ctx(profile=prof))
        assert rep.row("pack", "symlinks").status == want, rep.row("pack", "symlinks")
