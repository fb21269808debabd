"""pack.py on packs that agree with themselves but are not whole, and on files that are not what
their names say: each is a failure on one named row with a fix that fits, never a pass or a crash."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from pathlib import Path
from typing import Callable

import pytest

from dsv4serve import pack
from dsv4serve.testing.synthpack import write_pack

VISION = "DeepseekV4ForConditionalGeneration"


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return write_pack(tmp_path_factory.mktemp("packs") / "clean")


def _copy(clean, tmp_path: Path) -> Path:
    p = tmp_path / "p"
    shutil.copytree(clean.path, p)
    return p


def _validate(path: Path, clean, **kw) -> pack.PackReport:
    args = {"expect_shards": clean.expect_shards, "model_class": VISION, "wo_a_slices": 8}
    args.update(kw)
    return pack.validate(path, **args)


def _bad(rep: pack.PackReport) -> dict[str, pack.Finding]:
    return {f.check: f for f in rep.findings if f.status in ("fail", "warn")}


def _drop(root: Path, gone: Callable[[str], bool]) -> None:
    """Remove matching tensors from their shards and from the index, as rebuilding the index from
    the headers after losing them would: the pack then agrees with itself."""
    from safetensors.torch import load_file, save_file

    idx = json.loads((root / pack.INDEX).read_text())
    for f in sorted(set(idx["weight_map"].values())):
        ts = load_file(str(root / f))
        kept = {k: v for k, v in ts.items() if not gone(k)}
        if len(kept) != len(ts):
            save_file(kept, str(root / f), metadata={"format": "pt"})
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if not gone(k)}
    (root / pack.INDEX).write_text(json.dumps(idx))


@pytest.mark.parametrize("gone, found", [
    (lambda n: n.startswith("layers.1.ffn.experts.2.w2."), "layers.1: 1 expert projections (2.w2)"),
    (lambda n: n.startswith("layers.1.ffn.experts."), "layers.1: all 4 experts"),
    (lambda n: n.startswith("layers.0.attn.wkv."), "layers.0: attn.wkv"),
    (lambda n: n.startswith("layers.2.ffn.shared_experts.w3."), "layers.2: ffn.shared_experts.w3"),
    (lambda n: n == "layers.1.ffn.experts.2.w2.trellis", "layers.1: 1 expert projections (2.w2)"),
    (lambda n: n.startswith("mtp.1.ffn.experts.3."), "mtp.1: 3 expert projections"),
    # the router, which a rewrite of `layers.N.ffn.*` also drops (check-seat audit)
    (lambda n: n == "layers.3.ffn.gate.weight", "layers.3: ffn.gate"),
    (lambda n: n == "mtp.0.ffn.gate.weight", "mtp.0: ffn.gate"),
])
def test_a_module_lost_with_its_index_entries_fails_layer_modules(tmp_path, clean, gone, found):
    p = _copy(clean, tmp_path)
    _drop(p, gone)
    rep = _validate(p, clean)
    f = rep.get("layer-modules")
    assert f.status == "fail" and found in f.found, (f.found, [(x.check, x.found) for x in rep.findings])
    assert "restore the shards" in f.fix


def test_a_clean_pack_has_every_layer_module(clean):
    f = _validate(Path(clean.path), clean).get("layer-modules")
    assert f.status == "ok" and f.found == "5 layers and 2 draft layers complete", f.found


def test_a_k3_layer_without_experts_is_not_called_a_stale_layer_bits_key(tmp_path, clean):
    """Layer 2 is K3 in layer_bits: with its experts gone, "drop the stale key" would silence the
    only sign of the loss."""
    p = _copy(clean, tmp_path)
    _drop(p, lambda n: n.startswith("layers.2.ffn.experts."))
    rep = _validate(p, clean)
    assert rep.get("layer-modules").status == "fail" and "layers.2: all 4 experts" in rep.get("layer-modules").found
    assert rep.get("routed-bits").status == "ok", rep.get("routed-bits").found


def test_weights_held_only_by_a_file_the_index_leaves_out_fail_with_rebuild_the_index(tmp_path, clean):
    """vLLM loads only the files the index names: the overlay is on disk, but its layer is empty."""
    p = _copy(clean, tmp_path)
    idx = json.loads((p / pack.INDEX).read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != "model-layers-k2.safetensors"}
    (p / pack.INDEX).write_text(json.dumps(idx))
    rep = _validate(p, clean, expect_shards=clean.expect_shards - 1)
    f = rep.get("layer-modules")
    assert f.status == "fail" and "layers.3: all 4 experts" in f.found
    assert "leaves out model-layers-k2.safetensors" in f.fix and "rebuild the index" in f.fix
    assert "remove them" not in rep.get("unindexed-files").fix


def test_a_tensor_indexed_to_the_wrong_shard_is_a_stale_index_not_a_missing_tensor(tmp_path, clean):
    p = _copy(clean, tmp_path)
    idx = json.loads((p / pack.INDEX).read_text())
    idx["weight_map"]["layers.0.attn_norm.weight"] = sorted(set(idx["weight_map"].values()))[-1]
    (p / pack.INDEX).write_text(json.dumps(idx))
    rep = _validate(p, clean)
    assert set(_bad(rep)) == {"tensors-missing"}
    f = rep.get("tensors-missing")
    assert f.status == "warn" and "rebuild the index" in f.fix and "re-download" not in f.fix


def test_a_directory_without_weights_fails(tmp_path, clean):
    p = _copy(clean, tmp_path)
    for f in p.glob("*.safetensors"):
        f.unlink()
    (p / pack.INDEX).unlink()
    rep = pack.validate(p, model_class=VISION)
    f = rep.get("shard-count")
    assert f.status == "fail" and f.found == "no safetensors files" and "model.path" in f.fix


@pytest.mark.parametrize("last_dim", [40, 144, 8])
def test_a_trellis_width_exllamav3_cannot_decode_is_malformed(tmp_path, last_dim):
    """Last dim 16 K with K a whole 1-8: 40 is K2.5, 144 K9, 8 K0.5."""
    from safetensors.torch import save_file
    import torch

    root = tmp_path / "p"
    root.mkdir()
    t = {"m.trellis": torch.zeros([4, 4, last_dim], dtype=torch.int16), "m.suh": torch.zeros([64], dtype=torch.float16),
         "m.svh": torch.zeros([64], dtype=torch.float16), "m.mcg": torch.zeros([1], dtype=torch.int32)}
    save_file(t, str(root / "model.safetensors"))
    rep = pack.PackReport(str(root))
    _, hdr = pack.read_header(root / "model.safetensors")
    for name, h in hdr.items():
        rep.tensors[name] = pack.Tensor(name, "model.safetensors", h["dtype"], h["shape"],
                                        h["data_offsets"][1] - h["data_offsets"][0])
    pack._exl3_tensors(rep, pack._modules(rep.tensors))
    f = rep.get("exl3-tensors")
    assert f.status == "fail" and f"m.trellis I16[4, 4, {last_dim}]" in f.found and "K 1-8" in f.expected


def _shard_with(tmp_path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return f


@pytest.mark.parametrize("header, data, word", [
    ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4096 + b"\0" * 4, "trailing bytes"),
    ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
      "b": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "overlap"),
    ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
      "b": {"dtype": "F16", "shape": [2], "data_offsets": [8, 12]}}, b"\0" * 12, "gap"),
    ({"a": {"dtype": "BF61", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "unknown dtype 'BF61'"),
    ({"__metadata__": {"format": 1}, "a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4,
     "__metadata__ is not a map of text to text"),
])
def test_headers_safetensors_refuses_are_refused_here_too(tmp_path, header, data, word):
    from safetensors import safe_open

    f = _shard_with(tmp_path, header, data)
    with pytest.raises(Exception):  # the library vLLM loads with refuses each of these
        with safe_open(str(f), "pt"):
            pass
    with pytest.raises(pack.HeaderError, match=word):
        pack.read_header(f)


def test_sub_byte_and_complex_dtypes_safetensors_reads_are_read(tmp_path):
    f = _shard_with(tmp_path, {"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
                               "b": {"dtype": "C64", "shape": [1], "data_offsets": [2, 10]}}, b"\0" * 10)
    assert set(pack.read_header(f)[1]) == {"a", "b"}


@pytest.mark.parametrize("name", ["config.json", pack.INDEX])
def test_json_nested_past_the_parser_is_a_row_not_a_crash(tmp_path, clean, name):
    p = _copy(clean, tmp_path)
    (p / name).write_text("[" * 100000 + "]" * 100000)
    rep = _validate(p, clean)
    check = "config" if name == "config.json" else "index"
    f = rep.get(check)
    assert f.status == "fail" and "nested too deep" in f.found, f.found


def _no_hang(fn: Callable[[], object], seconds: float = 20.0) -> object:
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "validate blocked on a file that is not a regular file"
    return out[0]


@pytest.mark.parametrize("name", ["config.json", "model-dense-exl3.safetensors", "tokenizer.json"])
def test_a_fifo_in_place_of_a_file_fails_instead_of_hanging(tmp_path, clean, name):
    p = _copy(clean, tmp_path)
    (p / name).unlink()
    os.mkfifo(p / name)
    rep = _no_hang(lambda: _validate(p, clean))
    assert any(f.status == "fail" and "not a regular file" in f.found for f in rep.findings), \
        [(f.check, f.found) for f in rep.findings if f.status != "ok"]


def test_a_device_in_place_of_config_json_is_not_read(tmp_path, clean):
    p = _copy(clean, tmp_path)
    (p / "config.json").unlink()
    (p / "config.json").symlink_to("/dev/zero")
    rep = _no_hang(lambda: _validate(p, clean))
    assert rep.get("config").status == "fail" and "not a regular file" in rep.get("config").found


@pytest.mark.parametrize("name, make, word", [
    ("tokenizer.json", lambda f: f.mkdir(), "a directory"),
    ("tokenizer.json", lambda f: f.write_text(""), "not JSON"),
    ("tokenizer_config.json", lambda f: f.write_text("{trunc"), "not JSON"),
    ("generation_config.json", lambda f: f.mkdir(), "a directory"),
])
def test_tokenizer_and_generation_config_must_be_readable_json(tmp_path, clean, name, make, word):
    p = _copy(clean, tmp_path)
    (p / name).unlink()
    make(p / name)
    rep = _validate(p, clean)
    check = "generation-config" if name.startswith("generation") else "tokenizer"
    f = rep.get(check)
    assert f.status == "fail" and name in f.found and word in f.found, f.found


def test_an_unreadable_pack_dir_and_files_name_the_permission_not_corruption(tmp_path, clean, monkeypatch):
    """Tests run as root, for whom chmod 000 changes nothing: os.access is made to answer as it
    would for another user, which is the one call these checks take permission from."""
    p = _copy(clean, tmp_path)
    shard = p / "model-dense-exl3.safetensors"
    real = os.access
    denied = {str(p / "config.json"), str(shard), str(p / "tokenizer.json")}
    monkeypatch.setattr(os, "access", lambda f, mode, *a, **kw: str(f) not in denied and real(f, mode, *a, **kw))
    rep = _validate(p, clean)
    cfg, hdr, tok = rep.get("config"), rep.get("headers"), rep.get("tokenizer")
    assert cfg.status == "fail" and "permission denied" in cfg.found and "chmod a+r" in cfg.fix
    assert hdr.status == "fail" and "model-dense-exl3.safetensors: permission denied" in hdr.found
    assert "chmod a+r" in hdr.fix and "re-download" not in hdr.fix
    assert tok.status == "fail" and "permission denied" in tok.found and "chmod a+r" in tok.fix
    denied.add(str(p))
    rep = _validate(p, clean)
    f = rep.get("pack-dir")
    assert f.status == "fail" and f.found == f"{p}: permission denied" and "chmod a+rx" in f.fix


def _add(root: Path, shard: str, tensors: dict) -> None:
    """Add tensors to a shard and to the index, as a converter that left them would."""
    from safetensors.torch import load_file, save_file

    ts = load_file(str(root / shard))
    ts.update(tensors)
    save_file(ts, str(root / shard), metadata={"format": "pt"})
    idx = json.loads((root / pack.INDEX).read_text())
    idx["weight_map"].update({k: shard for k in tensors})
    (root / pack.INDEX).write_text(json.dumps(idx))


def test_a_routed_expert_stored_as_a_plain_weight_is_not_an_exl3_expert(tmp_path, clean):
    """A routed expert whose trellis was replaced by a plain `.weight` counted as present, and the
    EXL3 rules read only modules with a trellis: the pack passed every row (helper audit)."""
    import torch

    p = _copy(clean, tmp_path)
    assert _validate(p, clean).get("expert-format").status == "ok"
    idx = json.loads((p / pack.INDEX).read_text())
    shard = idx["weight_map"]["layers.0.ffn.experts.0.w1.trellis"]
    _drop(p, lambda n: n.startswith("layers.0.ffn.experts.0.w1."))
    _add(p, shard, {"layers.0.ffn.experts.0.w1.weight": torch.zeros(16, 16, dtype=torch.bfloat16)})
    rep = _validate(p, clean)
    f = rep.get("expert-format")
    assert f.status == "fail" and "1 without a trellis: layers.0.ffn.experts.0.w1.weight" in f.found, f.found
    assert "re-export" in f.fix


def test_fp8_leftovers_beside_a_draft_experts_trellis_fail(tmp_path, clean):
    """The draft shards' state before their rewrite (seat-reference §8): fp8 `.weight` and
    `.weight_scale_inv` still beside the EXL3 trellis."""
    import torch

    p = _copy(clean, tmp_path)
    idx = json.loads((p / pack.INDEX).read_text())
    shard = idx["weight_map"]["mtp.0.ffn.experts.0.w1.trellis"]
    _add(p, shard, {"mtp.0.ffn.experts.0.w1.weight": torch.zeros(16, 16, dtype=torch.float8_e4m3fn),
                    "mtp.0.ffn.experts.0.w1.weight_scale_inv": torch.ones(1, 1)})
    f = _validate(p, clean).get("expert-format")
    assert f.status == "fail" and f.found.startswith("2 left beside a trellis: mtp.0.ffn.experts.0.w1.weight"), f.found


def test_an_entry_that_cannot_be_stat_ed_is_a_named_row_not_a_crash(tmp_path, clean, monkeypatch):
    """Path.exists() raises for EACCES and ENAMETOOLONG: a shard linked into another user's private
    base pack, or an index naming a 300-character file, crashed the whole pack section into one
    'check crashed' row (helper audit)."""
    p = _copy(clean, tmp_path)
    idx = json.loads((p / pack.INDEX).read_text())
    shard = sorted(set(idx["weight_map"].values()))[1]
    real_stat = os.stat

    def stat(path, *a, **kw):
        if str(path).endswith(shard) and kw.get("follow_symlinks", True):  # a link through a drwx------ directory
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(pack.os, "stat", stat)
    rep = _validate(p, clean)
    f = rep.get("files-resolve")
    assert f.status == "fail" and f"{shard} (Permission denied)" in f.found and "readable" in f.fix, f
    assert rep.get("layer-modules").status == "n/a"  # the completeness rows stand aside, as for a missing file
    monkeypatch.setattr(pack.os, "stat", real_stat)
    long_name = "x" * 300 + ".safetensors"
    idx["weight_map"]["layers.0.attn_norm.weight"] = long_name
    (p / pack.INDEX).write_text(json.dumps(idx))
    f = _validate(p, clean).get("files-resolve")
    assert f.status == "fail" and "File name too long" in f.found, f


def test_dotfiles_and_unrelated_dead_links_are_not_weights(tmp_path, clean):
    """Without an index every *.safetensors on disk was a weight file, macOS's ._ AppleDouble
    companions included (vLLM's glob skips them); a dead README link failed files-resolve, and so
    `up`, for a pack vLLM loads (helper audit)."""
    p = _copy(clean, tmp_path)
    (p / pack.INDEX).unlink()
    (p / "._model-00001-of-00004.safetensors").write_bytes(b"\x00\x05\x16\x07" + b"\0" * 4000)
    (p / "README.md").symlink_to("/nonexistent/README.md")
    rep = _validate(p, clean)
    assert rep.get("shard-count").status == "ok" and rep.get("headers").status == "ok", _bad(rep)
    assert rep.get("files-resolve").status == "ok"
    f = rep.get("other-files")
    assert f.status == "warn" and f.found == "1 unresolvable: README.md (dead symlink -> /nonexistent/README.md)"
    assert rep.get("layer-modules").status == "ok"  # nothing stood aside for it


def test_a_header_safetensors_refuses_as_too_large_fails(tmp_path, clean):
    """safetensors refuses a header past 100,000,000 bytes; ours allowed 256 MiB (helper audit)."""
    p = _copy(clean, tmp_path)
    idx = json.loads((p / pack.INDEX).read_text())
    shard = p / sorted(set(idx["weight_map"].values()))[0]
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    pad = 101_000_000 - n
    shard.write_bytes(struct.pack("<Q", n + pad) + raw[8:8 + n] + b" " * pad + raw[8 + n:])
    f = _validate(p, clean).get("headers")
    assert f.status == "fail" and shard.name in f.found, f


def test_an_index_that_is_a_dead_link_or_a_loop_is_a_failing_row(tmp_path, clean):
    """_index special-cased only a missing index: a dead link raised FileNotFoundError out of the
    pack section (review)."""
    p = _copy(clean, tmp_path)
    (p / pack.INDEX).unlink()
    (p / pack.INDEX).symlink_to("/nonexistent/index.json")
    f = _validate(p, clean).get("index")
    assert f.status == "fail" and f.found.startswith(f"{pack.INDEX} dead symlink -> /nonexistent/index.json"), f
    (p / pack.INDEX).unlink()
    (p / pack.INDEX).symlink_to(pack.INDEX)  # itself: a loop
    f = _validate(p, clean).get("index")
    assert f.status == "fail" and "symbolic links" in f.found, f


def test_a_lost_draft_overlay_fails_a_seat_that_speculates(tmp_path, clean):
    """The draft's experts (the MTP overlay) lost and the index rebuilt without them: the pack agreed
    with itself, layer-modules said "0 draft layers complete", and the one warning ("drop the stale
    layer_bits keys") would have removed the last sign of it (helper audit). A seat that speculates
    with the pack's draft needs every draft layer config.json declares; one that does not, none."""
    p = _copy(clean, tmp_path)
    _drop(p, lambda n: n.startswith("mtp.") and ".ffn.experts." in n)
    declared = json.loads((p / "config.json").read_text())["num_nextn_predict_layers"]
    rep = _validate(p, clean, draft=True)
    f = rep.get("layer-modules")
    assert f.status == "fail", f
    assert all(f"mtp.{j}: all 4 experts" in f.found for j in range(declared)), f.found
    assert rep.get("routed-bits").status == "ok", rep.get("routed-bits")  # the draft's keys are not stale
    assert _validate(p, clean, draft=False).get("layer-modules").status == "ok"
    # the seat's profiles say which they are
    from dsv4serve.profile import load_profile
    assert load_profile("8x16gb-380k").drafts_from_pack() and load_profile("cpu-demo").drafts_from_pack()
    assert not load_profile("8x16gb-ppl").drafts_from_pack()
    assert not load_profile("cpu-demo", ["vllm.speculative_config={method: ngram, num_speculative_tokens: 2, "
                                         "prompt_lookup_max: 3}"]).drafts_from_pack()


@pytest.mark.parametrize("name, check", [("config.json", "config"), (pack.INDEX, "index")])
@pytest.mark.parametrize("encode, word", [
    (lambda t: b"\xef\xbb\xbf" + t.encode(), "starts with a UTF-8 byte-order mark"),
    (lambda t: t.encode("utf-16"), "not UTF-8 text"),
])
def test_json_vllm_cannot_decode_fails_though_python_reads_it(tmp_path, clean, name, check, encode, word):
    """json.loads(bytes) strips a BOM and reads UTF-16; vLLM's index reader and transformers' config
    reader refuse both, so the pack passed check-seat and failed at load (helper audit)."""
    p = _copy(clean, tmp_path)
    (p / name).write_bytes(encode((p / name).read_text()))
    f = _validate(p, clean).get(check)
    assert f.status == "fail" and word in f.found, f
    if check == "config" and "mark" in word:
        assert f.fix.startswith("re-save config.json as UTF-8 without a BOM"), f.fix


def test_an_empty_non_routed_exl3_with_dense_exl3_modules_fails_like_a_missing_one(tmp_path, clean):
    p = _copy(clean, tmp_path)
    cfg = json.loads((p / "config.json").read_text())
    cfg["quantization_config"]["non_routed_exl3"] = {}
    (p / "config.json").write_text(json.dumps(cfg))
    f = _validate(p, clean).get("dense-bits")
    assert f.status == "fail" and "dense EXL3 modules but non_routed_exl3 has no layers, bits or layer_bits" in f.found, f


def test_every_shard_on_disk_and_a_stale_index_is_no_re_download(tmp_path, clean):
    """shard-count counted the files the index names: all seven shards present, the index naming
    six, said "re-download it" (86 GB) for what a rebuilt index fixes; it is also the line `up` shows."""
    p = _copy(clean, tmp_path)
    idx = json.loads((p / pack.INDEX).read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != "model-layers-k2.safetensors"}
    (p / pack.INDEX).write_text(json.dumps(idx))
    f = _validate(p, clean).get("shard-count")
    n = clean.expect_shards
    assert f.status == "fail" and f.found == (f"{n} safetensors files on disk, the index names {n - 1} (it leaves out "
                                              "model-layers-k2.safetensors)"), f
    assert "rebuild model.safetensors.index.json" in f.fix and "re-download" not in f.fix


def test_an_empty_folder_or_the_folder_above_the_pack_is_one_row(tmp_path, clean):
    """Four failing rows, the first (the one `up` shows) saying "restore config.json", for a
    model.path one level too high (helper audit)."""
    (tmp_path / "empty").mkdir()
    rep = pack.validate(tmp_path / "empty", model_class=VISION)
    assert [(f.check, f.status) for f in rep.findings] == [("pack-dir", "fail")]
    assert rep.findings[0].found.endswith("holds no config.json and no .safetensors files")
    shutil.copytree(clean.path, tmp_path / "models" / "DSV4-Flash")
    rep = pack.validate(tmp_path / "models", model_class=VISION)
    assert [(f.check, f.status) for f in rep.findings] == [("pack-dir", "fail")]
    assert "(its DSV4-Flash/ holds a config.json)" in rep.findings[0].found
    assert rep.findings[0].fix == f"set model.path to {tmp_path / 'models' / 'DSV4-Flash'}"


@pytest.mark.parametrize("how", ["missing", "unindexed"])
def test_a_lost_dense_overlay_fails_on_the_rows_that_name_its_cause_only(tmp_path, clean, how):
    """A missing or unindexed dense overlay also failed dense-bits ("check the entry prefixes"),
    dense-coverage ("rebuild non_routed_exl3.layers") and wo-a-slices ("use the Dense pack"), each a
    wrong fix, and `up` shows only the first failing row (helper audit)."""
    p = _copy(clean, tmp_path)
    if how == "missing":
        (p / "model-dense-exl3.safetensors").unlink()
    else:
        idx = json.loads((p / pack.INDEX).read_text())
        idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != "model-dense-exl3.safetensors"}
        (p / pack.INDEX).write_text(json.dumps(idx))
    rep = _validate(p, clean, expect_shards=None)
    fails = {f.check for f in rep.findings if f.status == "fail"}
    assert fails == ({"files-resolve", "tensors-missing"} if how == "missing" else {"layer-modules"}), _bad(rep)
    for row in ("dense-bits", "dense-coverage", "wo-a-slices"):
        assert rep.get(row).status == "n/a", rep.get(row)
    if how == "unindexed":
        assert "leaves out model-dense-exl3.safetensors" in rep.get("layer-modules").fix


def test_a_whole_wo_a_still_fails_wo_a_slices_beside_an_unrelated_unindexed_file(tmp_path, clean):
    """Standing aside is for modules that are absent: wo_a stored whole (not the Dense pack) is the
    profile's mismatch whatever stray file lies beside it."""
    from safetensors.torch import load_file, save_file

    p = _copy(clean, tmp_path)
    idx = json.loads((p / pack.INDEX).read_text())
    f = idx["weight_map"]["layers.0.attn.wo_a.slice.0.trellis"]
    ts = load_file(str(p / f))
    renamed = {k.replace(".wo_a.slice.0.", ".wo_a."): v for k, v in ts.items() if ".wo_a.slice." not in k or
               ".wo_a.slice.0." in k}
    save_file(renamed, str(p / f), metadata={"format": "pt"})
    idx["weight_map"] = {k.replace(".wo_a.slice.0.", ".wo_a."): v for k, v in idx["weight_map"].items()
                         if ".wo_a.slice." not in k or ".wo_a.slice.0." in k}
    (p / pack.INDEX).write_text(json.dumps(idx))
    save_file({"stray.weight": __import__("torch").zeros(2)}, str(p / "leftover.safetensors"))
    rep = _validate(p, clean, expect_shards=None)
    assert rep.get("unindexed-files").status == "warn"
    assert rep.get("wo-a-slices").status == "fail" and rep.get("wo-a-slices").found == "no attn.wo_a.slice.R tensors"


def _plain_dense(p: Path, keep_overlay_unindexed: bool) -> None:
    """The dense modules as plain bf16 weights in an indexed file (a non-Dense pack), wo_a whole, and
    non_routed_exl3 gone; with `keep_overlay_unindexed` the EXL3 dense overlay stays on disk, unindexed
    (downloaded, index not rebuilt)."""
    import torch
    from safetensors.torch import load_file, save_file

    dense_file = "model-dense-exl3.safetensors"
    idx = json.loads((p / pack.INDEX).read_text())
    plain = {}
    for k in load_file(str(p / dense_file)):
        if k.endswith(".trellis"):
            plain[k[: -len(".trellis")].split(".slice.")[0] + ".weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    if not keep_overlay_unindexed:
        (p / dense_file).unlink()
    save_file(plain, str(p / "model-dense-plain.safetensors"), metadata={"format": "pt"})
    wm = {k: v for k, v in idx["weight_map"].items() if v != dense_file}
    wm.update({k: "model-dense-plain.safetensors" for k in plain})
    idx["weight_map"] = wm
    (p / pack.INDEX).write_text(json.dumps(idx))
    cfg = json.loads((p / "config.json").read_text())
    if not keep_overlay_unindexed:
        cfg["quantization_config"].pop("non_routed_exl3")
    (p / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("overlay", [False, True])
def test_a_stray_file_beside_a_pack_hides_no_row_that_fails_it(tmp_path, clean, overlay):
    """The stand-aside for absent modules took any unindexed file as the cause: a non-Dense pack for
    a seat that wants wo_a slices passed beside an unrelated leftover, and a Dense overlay downloaded
    without rebuilding the index (the base holding plain copies, which vLLM would load) passed with
    every dense row n/a (review). Only a file holding modules the indexed files lack stands them aside."""
    import torch
    from safetensors.torch import save_file

    p = _copy(clean, tmp_path)
    _plain_dense(p, keep_overlay_unindexed=overlay)
    save_file({"stray.weight": torch.zeros(2)}, str(p / "leftover.safetensors"))
    rep = _validate(p, clean, expect_shards=None)
    assert rep.get("wo-a-slices").status == "fail" and rep.get("wo-a-slices").found == "no attn.wo_a.slice.R tensors"
    if overlay:
        assert rep.get("dense-bits").status == "fail" and rep.get("dense-coverage").status == "fail", _bad(rep)


def test_a_lost_shard_beside_a_stray_file_is_not_called_a_stale_index(tmp_path, clean):
    """A shard lost with its index entries, and an unrelated file on disk making the count match:
    shard-count (the row `up` shows) said "rebuild the index", naming the stray file (review)."""
    import torch
    from safetensors.torch import save_file

    p = _copy(clean, tmp_path)
    idx = json.loads((p / pack.INDEX).read_text())
    (p / "model-layers-k2.safetensors").unlink()
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != "model-layers-k2.safetensors"}
    (p / pack.INDEX).write_text(json.dumps(idx))
    save_file({"x.weight": torch.zeros(2)}, str(p / "notes-backup.safetensors"))
    f = _validate(p, clean).get("shard-count")
    assert f.status == "fail" and "re-download it" in f.fix and "rebuild" not in f.fix, f
