"""Validate a model pack from its safetensors headers (never the tensors) and its config files.

A pack that fails here would fail minutes into a seat's load, or boot and serve wrong answers:
a dead symlink (seat-reference trap 10), a missing or duplicated tensor, a dense bits stamp
that disagrees with the stored trellis width (trap 1: the 6-bit bake stamped 4), routed
`layer_bits` that disagree with the experts, `non_routed_exl3` prefixes for the wrong vLLM
model class (`model.layers.N` where the Vision class needs `language_model.model.layers.N`).

EXL3 facts used (exl3-reference §1.1): a quantized linear `<m>` stores `<m>.trellis` I16
`[k/16, n/16, 16·K]` (K = last dim / 16), `<m>.suh` F16 `[k]`, `<m>.svh` F16 `[n]`, and a
codebook marker `<m>.mcg` or `<m>.mul1` I32 of shape `[]` or `[1]`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import struct
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

Status = str  # "ok" | "warn" | "fail" | "n/a"

INDEX = "model.safetensors.index.json"
MAX_HEADER = 100_000_000  # safetensors' own limit ("header too large"): a real shard header is a few MB
# Every dtype safetensors 0.8 reads, in bits per element (F4 and F6 pack several per byte). A name
# outside this table is a header safetensors refuses ("unknown variant"), so vLLM could not load it.
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
MAX_JSON = 64 * 1024**2  # config.json, the index, tokenizer files: a real one is at most a few tens of MB
EXL3_PARTS = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")
MARKERS = ("mcg", "mul1")

# One non_routed_exl3 entry per fused vLLM module, and the pack modules (relative to
# `layers.N.`) it covers (seat-reference §8). The order is the one the entry counts are quoted in.
DENSE_KINDS: dict[str, tuple[str, ...]] = {
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
CANON_ENTRY_COUNTS = (43, 43, 43, 43, 41, 21, 21, 43, 43)
# vLLM module prefix of decoder layer N per model class. The Vision class nests the language
# model; dense_bake's default (`model.layers.N`) is the text class's and was the first-light trap.
CLASS_ROOT = {
    "DeepseekV4ForConditionalGeneration": "language_model.model.",
    "DeepseekV4ForCausalLM": "model.",
}
VISION_CLASS = "DeepseekV4ForConditionalGeneration"

_EXPERT = re.compile(r"^(layers|mtp)\.(\d{1,9})\.ffn\.experts\.(\d{1,9})\.(w[123])$")
_TRUNK = re.compile(r"^layers\.(\d{1,9})\.(.+)$")
_DRAFT = re.compile(r"^mtp\.(\d{1,9})\.")
_WHOLE_WO_A = re.compile(r"^layers\.\d{1,9}\.attn\.wo_a$")
# indices bounded: a 5,000-digit one (a corrupt header or config) made int() raise past Python's limit
_ENTRY = re.compile(r"^(?P<root>.*?)layers\.(?P<n>\d{1,9})\.(?P<rest>.+)$")
_SLICE = re.compile(r"^attn\.wo_a\.slice\.(\d{1,9})$")
_SHARD_NAME = re.compile(r"\.safetensors$")


def _dense_module(m: str) -> bool:
    """A trunk layer's module other than a routed expert (what non_routed_exl3 describes), but a
    wo_a slice: a Dense overlay's slices stand for a whole wo_a the base may hold (wo-a-slices's)."""
    return bool(_TRUNK.match(m)) and ".ffn.experts." not in m and ".attn.wo_a.slice." not in m


@dataclass
class Finding:
    check: str
    status: Status
    found: str
    expected: str = ""
    fix: str = ""


@dataclass
class Tensor:
    name: str
    file: str
    dtype: str
    shape: list[int]
    nbytes: int


@dataclass
class PackReport:
    path: str
    findings: list[Finding] = field(default_factory=list)
    tensors: dict[str, Tensor] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    files: list[str] = field(default_factory=list)  # the safetensors files the pack loads
    partial: bool = False  # some weight file was missing or unreadable: tensors is incomplete
    unindexed: dict[str, str] = field(default_factory=dict)  # module -> file of the files the index leaves out

    def held_elsewhere(self, relevant: Callable[[str], bool]) -> bool:
        """Whether the `relevant` modules may be absent for a reason another row names: a weight file
        missing or unreadable (files-resolve, headers), or a file the index leaves out holding such a
        module the indexed files lack (layer-modules). Rows that would read that absence as a config
        or profile error stand aside then: their fixes (restamp, rebuild the entries, another pack)
        were wrong and `up` shows only the first. Any unindexed file beside the pack was too broad:
        a wrong pack passed beside a stray file (review)."""
        if self.partial:
            return True
        present = _present(self.tensors)
        return any(relevant(m) and m not in present for m in self.unindexed)

    def add(self, check: str, status: Status, found: str, expected: str = "", fix: str = "") -> Finding:
        f = Finding(check, status, found, expected, fix)
        self.findings.append(f)
        return f

    def get(self, check: str) -> Finding | None:
        return next((f for f in self.findings if f.check == check), None)

    def failed(self) -> list[str]:
        return [f.check for f in self.findings if f.status == "fail"]


class HeaderError(Exception):
    pass


class FileProblem(HeaderError):
    """A pack file that cannot be read as one (permission, not a regular file, not JSON): `fix`
    says what to do about it, which is not always "re-download"."""

    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.fix = fix


def read_header(path: str | Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(metadata, {name: {dtype, shape, data_offsets}}) from a safetensors file, reading only the
    8-byte length and the JSON header. Raises HeaderError for anything safetensors (so vLLM) would
    refuse: a dtype it does not know, a byte count that does not match the shape, tensors that
    overlap or leave a gap, a data section longer than its tensors, metadata that is not text."""
    p = Path(path)
    _regular(p)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError("shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n < 2 or n > MAX_HEADER or 8 + n > size:
            raise HeaderError(f"header length {n} does not fit a {size}-byte file")
        raw = f.read(n)
    try:
        # text first, strictly: json.loads(bytes) also takes a BOM or UTF-16, which safetensors refuses
        hdr = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise HeaderError(f"header is not JSON ({e.__class__.__name__})") from None
    if not isinstance(hdr, dict):
        raise HeaderError("header is not a JSON object")
    meta = hdr.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise HeaderError("__metadata__ is not a map of text to text")
    data_len = size - 8 - n
    spans = []
    for name, t in hdr.items():
        try:
            start, end = t["data_offsets"]
            dtype, shape = t["dtype"], t["shape"]
            ok = (all(type(v) is int for v in (start, end)) and 0 <= start <= end and isinstance(dtype, str)
                  and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise HeaderError(f"tensor {name}: malformed header entry (data_offsets, dtype or shape)")
        if end > data_len:
            raise HeaderError(f"truncated: tensor {name} ends at byte {end} of a {data_len}-byte data section")
        bits = DTYPE_BITS.get(dtype)
        if bits is None:
            raise HeaderError(f"tensor {name}: unknown dtype {dtype!r}")
        nbits = _numel(shape) * bits
        if nbits % 8 or nbits // 8 != end - start:
            raise HeaderError(f"tensor {name}: {dtype}{shape} does not match its {end - start} bytes")
        spans.append((start, end, name))
    at = 0
    for start, end, name in sorted(spans):
        if start != at:
            raise HeaderError(f"tensor {name}: starts at byte {start}, where the previous tensor ends at {at} "
                              f"({'overlap' if start < at else 'gap'})")
        at = end
    if at != data_len:
        raise HeaderError(f"the tensors end at byte {at} of a {data_len}-byte data section (trailing bytes)")
    return meta, hdr


def _regular(p: Path) -> None:
    """Refuse what is not a regular file before opening it: a FIFO blocks the open forever and a
    device (config.json -> /dev/zero) never ends."""
    try:
        st = p.stat()
    except PermissionError:
        raise FileProblem("permission denied", f"make it readable (chmod a+r {p}, or chown it)") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a pipe, device or socket)"
        raise FileProblem(kind, f"restore {p.name} from the pack's source")
    if not os.access(p, os.R_OK):
        raise FileProblem("permission denied", f"make it readable (chmod a+r {p}, or chown it)")


def read_json(p: Path) -> Any:
    """A small JSON file of the pack (config, index, tokenizer files), or FileProblem saying why not."""
    _regular(p)
    size = p.stat().st_size
    if size > MAX_JSON:
        raise FileProblem(f"{size:,} bytes, more than a pack's JSON file can be", f"restore {p.name} from the pack's source")
    try:
        raw = p.read_bytes()
        if raw.startswith(b"\xef\xbb\xbf"):  # json.loads(bytes) strips it; vLLM's and transformers' readers refuse it
            raise FileProblem("starts with a UTF-8 byte-order mark, which vLLM's JSON reader refuses",
                              f"re-save {p.name} as UTF-8 without a BOM (e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' "
                              f"{shlex.quote(str(p))})")
        # text first, strictly: json.loads(bytes) also takes UTF-16 / UTF-32, which vLLM's readers do not
        return json.loads(raw.decode("utf-8"))
    except PermissionError:
        raise FileProblem("permission denied", f"make it readable (chmod a+r {p}, or chown it)") from None
    except OSError as e:
        raise FileProblem(e.strerror or str(e), f"restore {p.name} from the pack's source") from None
    except (ValueError, RecursionError) as e:  # RecursionError: a JSON nested deeper than Python parses
        why = ("nested too deep to parse" if isinstance(e, RecursionError) else
               "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else f"{e.__class__.__name__}: {e}")
        raise FileProblem(f"not JSON ({why})"[:200], f"restore {p.name} from the pack's source") from None


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _n(count: int, word: str) -> str:
    return f"{count:,} {word}" + ("" if count == 1 else "s")


def _few(items: Iterable[Any], n: int = 4) -> str:
    items = list(items)
    s = ", ".join(str(i) for i in items[:n])
    return s + (f" (+{len(items) - n} more)" if len(items) > n else "")


def _k(trellis: Tensor) -> float:
    return trellis.shape[-1] / 16 if trellis.shape else 0.0


def _kstr(k: float) -> str:
    return f"K{int(k)}" if float(k).is_integer() else f"K{k}"


def _bits_eq(a: Any, b: float) -> bool:
    try:
        return abs(float(a) - b) < 1e-9
    except (TypeError, ValueError, OverflowError):  # 10**400 has no float
        return False


# ---------------------------------------------------------------------------------------------
# entry point


def validate(path: str | Path, *, expect_shards: int | None = None, model_class: str | None = None,
             wo_a_slices: int | None = None, exl3: bool = True, mounted_only: bool = False,
             routed_ks: tuple[int, ...] | None = None, tp: int | None = None, draft: bool = False,
             mounts: list[tuple[str, str]] | None = None) -> PackReport:
    """Every finding about the pack at `path`. `exl3=False` (the demo seat) checks a plain
    safetensors pack: files, headers, index coverage, config, tokenizer; no EXL3 rules.
    `mounted_only`: the seat sees the pack through docker mounts (`mounts`, (host, container) pairs;
    default: this directory at its own path), so a link whose target no mount holds is dead there.
    `draft`: the seat speculates with the pack's MTP layers, so each one config.json declares must be whole."""
    root = Path(path)
    rep = PackReport(path=str(root))
    if not root.is_dir():
        rep.add("pack-dir", "fail", f"{root} does not exist" if not root.exists() else f"{root} is not a directory",
                "a pack directory", "set model.path to the pack, or download it")
        return rep
    if not os.access(root, os.R_OK | os.X_OK):
        rep.add("pack-dir", "fail", f"{root}: permission denied", "a readable pack directory",
                f"make it readable to this user and the seat's container (chmod a+rx {root}, or chown it)")
        return rep
    entries = sorted(root.iterdir(), key=lambda p: p.name)
    if not any(e.name == "config.json" or _SHARD_NAME.search(e.name) for e in entries):
        # an empty folder, or model.path one level too high: one line, not four rows each with its own fix
        inner = [e.name for e in entries if os.path.isfile(e / "config.json")]  # os.path: never raises
        rep.add("pack-dir", "fail", f"{root} holds no config.json and no .safetensors files"
                + (f" (its {_few(inner, 2)}/ holds a config.json)" if inner else ""), "a pack directory",
                f"set model.path to {root / inner[0]}" if len(inner) == 1 else
                "set model.path to the pack directory itself, or download the pack there")
        return rep
    rep.add("pack-dir", "ok", str(root))
    # what does not resolve (a dead link, a target behind a directory this user cannot enter),
    # said rather than raised: one entry must not take the whole pack section with it
    unresolved = {e.name: err for e in entries if (err := _stat_error(e))}
    live_links = [e for e in entries if e.is_symlink() and e.name not in unresolved]

    rep.config = _config(rep, root)
    weight_map = _index(rep, root)
    # vLLM's glob skips dotfiles (a macOS ._ AppleDouble beside each shard is not a shard)
    on_disk = [e.name for e in entries if _SHARD_NAME.search(e.name) and not e.name.startswith(".")]
    # an unreadable index ({}, already a failure) names no files: read the shards on disk instead
    files = sorted(set(weight_map.values())) if weight_map else sorted(on_disk)
    rep.files = files
    _resolve(rep, root, files, unresolved)
    if mounted_only:
        seen = mounts if mounts is not None else [(str(root), str(root))]
        escaping = [e for e in live_links if not _live_in_container(e, root, seen)]
    else:
        escaping = []
    if escaping:
        targets = sorted({os.path.dirname(os.readlink(e)) or "." for e in escaping})
        rep.add("symlinks", "fail", f"{len(escaping)} symlinked to paths the container does not mount: "
                f"{_few(e.name for e in escaping)} -> {_few(targets, 2)}", "files inside the mounted pack directory",
                "inside the container these links are dead: copy the targets in (cp --remove-destination), "
                "hardlink them, or mount their directory at the same path (runtime.mounts)")
    elif live_links:
        targets = sorted({str(Path(os.path.realpath(e)).parent) for e in live_links})
        rep.add("symlinks", "warn", f"{len(live_links)} symlinked: {_few(e.name for e in live_links)} -> {_few(targets, 2)}",
                "real files or hardlinks",
                "copy the targets in (cp --remove-destination) or hardlink them: deleting the base pack "
                "leaves this one unable to restart (trap 10)")
    else:
        rep.add("symlinks", "ok", "no symlinks")
    _shard_count(rep, files, expect_shards, on_disk, root, weight_map)
    stray: list[str] = []
    if weight_map == {}:  # unreadable (already a failure): nothing to compare the files with
        rep.add("unindexed-files", "n/a", "the index is unreadable (see index)", "", "checked once the index is rebuilt")
    elif weight_map is not None:
        stray = [n for n in on_disk if n not in set(files)]
        if stray:
            rep.add("unindexed-files", "warn", f"{len(stray)} not in the index: {_few(stray)}",
                    "the index names every safetensors file",
                    "vLLM skips files the index does not name: rebuild the index if they belong to the pack "
                    "(layer-modules says whether weights are missing), or move them out of it")
        else:
            rep.add("unindexed-files", "ok", "the index names every safetensors file")
    headers = _headers(rep, root, files)
    _coverage(rep, weight_map, headers)
    if exl3 and rep.config is None:
        rep.add("exl3-rules", "n/a", "config.json is missing or unusable (see config)", "",
                "checked once config.json is restored")
    elif exl3:
        rep.unindexed = _stray_modules(root, stray)
        _exl3_rules(rep, model_class, wo_a_slices, routed_ks, tp)
        _layer_modules(rep, rep.config or {}, rep.unindexed, draft)
        _expert_format(rep)
    else:
        qc = (rep.config or {}).get("quantization_config")
        if qc:
            rep.add("quant-method", "warn", f"quant_method {qc.get('quant_method')!r}", "a plain (unquantized) pack",
                    "this profile serves the pack as plain weights")
        else:
            rep.add("quant-method", "ok", "none (plain weights)", "a plain (unquantized) pack")
    _small_files(rep, root)
    return rep


# ---------------------------------------------------------------------------------------------
# files


def _config(rep: PackReport, root: Path) -> dict[str, Any] | None:
    p = root / "config.json"
    if err := _stat_error(p):
        rep.add("config", "fail", f"config.json {err}", "config.json",
                "make it readable to this user" if "permission" in err.lower() else
                "restore config.json from the pack's source")
        return None
    try:
        cfg = read_json(p)
    except FileProblem as e:
        rep.add("config", "fail", f"config.json unreadable ({e})", "valid JSON", e.fix)
        return None
    bad = _config_problem(cfg)
    if bad:
        rep.add("config", "fail", f"config.json: {bad}", "a model config (architectures, num_hidden_layers, …)",
                "restore config.json from the pack's source")
        return None
    arch = cfg.get("architectures") or ["?"]
    rep.add("config", "ok", f"{arch[0]}, {cfg.get('num_hidden_layers', '?')} layers")
    return cfg


CONFIG_COUNT_MAX = 65_536  # layers, experts or groups: DeepSeek-V4 has 61 layers and 256 experts
CONFIG_MODULES_MAX = 1_048_576  # layers x routed experts: DeepSeek-V4 has 15,616


def _config_problem(cfg: Any) -> str | None:
    """What makes a config.json unusable to these checks (and to vLLM), or None: each field they
    read, if present, has the type they read it as."""
    if not isinstance(cfg, dict):
        return f"the top level is a JSON {type(cfg).__name__}, not an object"
    arch = cfg.get("architectures")
    if arch is not None and (not isinstance(arch, list) or not all(isinstance(a, str) for a in arch)):
        return f"architectures is {json.dumps(arch)}, not a list of class names"
    for key in ("num_hidden_layers", "vision_n_layers", "o_groups", "n_routed_experts"):
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            return f"{key} is {json.dumps(v)}, not a whole number"
        if v is not None and v > CONFIG_COUNT_MAX:
            # the checks enumerate every layer's experts: an absurd count is a broken config, and
            # would exhaust memory before any row is written
            return f"{key} is {v:,}, beyond any model ({CONFIG_COUNT_MAX:,} at most)"
    layers, experts = cfg.get("num_hidden_layers"), cfg.get("n_routed_experts")
    if isinstance(layers, int) and isinstance(experts, int) and layers * experts > CONFIG_MODULES_MAX:
        # each bound alone let 65,536 x 65,536 through: 13 billion expert names before any row
        return (f"num_hidden_layers x n_routed_experts is {layers * experts:,}, beyond any model "
                f"({CONFIG_MODULES_MAX:,} at most; DeepSeek-V4 has 61 x 256)")
    ratios = cfg.get("compress_ratios")
    odd = next((r for r in ratios if not isinstance(r, int) or isinstance(r, bool)), None) \
        if isinstance(ratios, list) else None
    if odd is not None:  # read as layer counts below: "4" would read as a layer without its modules
        return f"compress_ratios holds {json.dumps(odd)}, not whole numbers"
    for key, kind in (("quantization_config", dict), ("compress_ratios", list)):
        v = cfg.get(key)
        if v is not None and not isinstance(v, kind):
            return f"{key} is {json.dumps(v)}, not a JSON {'object' if kind is dict else 'list'}"
    return None


def _index(rep: PackReport, root: Path) -> dict[str, str] | None:
    p = root / INDEX
    shards = [e for e in root.glob("*.safetensors") if not e.name.startswith(".")]
    err = _stat_error(p)
    if err and err != "missing":  # a dead link, a loop, no permission: say it, never raise
        rep.add("index", "fail", f"{INDEX} {err}", "a JSON weight_map",
                "make it readable to this user" if "permission" in err.lower() else
                "restore the index (or rebuild it from the shard headers)")
        return {}
    if err == "missing":
        if len(shards) <= 1:
            rep.add("index", "n/a", "single-file pack, no index needed")
        else:
            rep.add("index", "warn", f"no {INDEX} for {len(shards)} safetensors files",
                    "an index naming every tensor's file",
                    "write an index (vLLM then loads only what it names, and coverage can be checked)")
        return None
    try:
        doc = read_json(p)
        if not isinstance(doc, dict):
            raise TypeError(f"the top level is a JSON {type(doc).__name__}, not an object")
        wm = doc["weight_map"]
        if not isinstance(wm, dict):
            raise ValueError("weight_map is not an object")
        odd = next((k for k, v in wm.items() if not isinstance(v, str) or not v), None)
        if odd is not None:
            raise ValueError(f"weight_map[{odd!r}] is {json.dumps(wm[odd])}, not a file name")
        if not wm:
            raise ValueError("weight_map is empty: vLLM would load no tensor")
        # vLLM loads the top level's *.safetensors only (a docker seat mounts nothing else): a file
        # named by a path, or a hidden one its glob skips, is a tensor it never reads
        outside = sorted({v for v in wm.values() if "/" in v or "\\" in v or v.startswith(".")})
        if outside:
            rep.add("index", "fail", f"{INDEX} names {_n(len(outside), 'file')} outside the pack's top level: "
                    f"{_few(outside, 3)}", "plain file names in the pack directory",
                    "move those files into the pack directory and name them plainly in the weight_map")
            return {}
    except FileProblem as e:
        rep.add("index", "fail", f"{INDEX} unreadable ({e})", "a JSON weight_map",
                e.fix if "permission" in str(e) else "rebuild the index from the shard headers")
        return {}
    except (ValueError, TypeError, KeyError) as e:
        rep.add("index", "fail", f"{INDEX} unreadable ({e.__class__.__name__}: {e})", "a JSON weight_map",
                "rebuild the index from the shard headers")
        return {}
    rep.add("index", "ok", f"{len(wm):,} tensors in {len(set(wm.values()))} files")
    return {str(k): str(v) for k, v in wm.items()}


def _stat_error(p: Path) -> str | None:
    """Why `p` does not resolve ("missing", "dead symlink -> T", "Permission denied", "File name too
    long", ...), or None when it does. Path.exists() raises the ones that are not "not there"."""
    try:
        os.stat(p)
        return None
    except FileNotFoundError:
        try:
            return f"dead symlink -> {os.readlink(p)}" if p.is_symlink() else "missing"
        except OSError as e:
            return e.strerror or str(e)
    except (OSError, ValueError) as e:  # ValueError: a NUL in a name the index gives
        return getattr(e, "strerror", None) or str(e)


# files the seat reads besides the weights; their own rows (config, tokenizer, ...) judge them
_READ_FILES = ("config.json", INDEX, "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
               "generation_config.json")


def _resolve(rep: PackReport, root: Path, files: list[str], unresolved: dict[str, str]) -> None:
    problems = [f"{f} ({err})" for f in files if (err := unresolved.get(f) or _stat_error(root / f))]
    if problems:
        rep.partial = True  # tensors are missing from the report: completeness rows stand aside
    problems += [f"{n} ({unresolved[n]})" for n in _READ_FILES if n in unresolved and n not in files]
    if problems:
        denied = any("permission" in p.lower() for p in problems)
        rep.add("files-resolve", "fail", f"{len(problems)} unresolvable: {_few(problems, 3)}",
                "every file the pack names exists and resolves",
                ("make the targets readable to this user and the seat's container (chmod a+rx on the directories "
                 "the links pass through), or " if denied else "")
                + "restore the files (re-download, or copy from the base pack) and prefer real copies "
                "over symlinks (trap 10)")
    else:
        rep.add("files-resolve", "ok", f"{_n(len(files), 'weight file')} and every other file the seat reads resolve")
    # a dead README link or a leftover download is not a weight file: a warning, never a refusal
    other = [f"{n} ({err})" for n, err in sorted(unresolved.items())
             if n not in files and n not in _READ_FILES and not n.startswith(".")]
    if other:
        rep.add("other-files", "warn", f"{len(other)} unresolvable: {_few(other, 3)}", "entries that resolve",
                "remove or repair them (the seat does not read them)")


def _live_in_container(link: Path, root: Path, mounts: list[tuple[str, str]]) -> bool:
    """Whether `link` resolves inside a container that mounts (host, container) pairs: its text is
    what the container resolves, against the pack's container path, not the host's chain. A link
    into a directory mounted at the same path is live (it was refused); an absolute link into the
    real folder behind a symlinked model.path is dead (it passed: only model.path is mounted)."""
    norm = [(os.path.normpath(h), os.path.normpath(c)) for h, c in mounts]
    cont_root = next((c for h, c in norm if h == os.path.normpath(root)), os.path.normpath(root))
    try:
        text = os.readlink(link)
    except OSError:
        return False
    target = os.path.normpath(text if os.path.isabs(text) else os.path.join(cont_root, text))
    for h, c in norm:
        if target == c or target.startswith(c.rstrip("/") + "/"):
            return os.path.exists(h + target[len(c):])  # the file is there on the host side of that mount
    return False


def _holds_unindexed(root: Path, left: list[str], weight_map: dict[str, str] | None) -> bool:
    """Whether the files the index leaves out hold modules the index does not name: then the index
    is stale. A stray file beside a pack that lost a shard is not (review: a notes backup made the
    count match and the lost shard read as a stale index)."""
    indexed = _present((weight_map or {}).keys())
    return any((_TRUNK.match(m) or _DRAFT.match(m)) and m not in indexed for m in _stray_modules(root, left))


def _shard_count(rep: PackReport, files: list[str], expect: int | None, on_disk: list[str],
                 root: Path | None = None, weight_map: dict[str, str] | None = None) -> None:
    if not files:
        rep.add("shard-count", "fail", "no safetensors files", f"{expect}" if expect else "the pack's weights",
                "model.path holds no weights: download the pack there, or point model.path at it")
    elif expect is None:
        rep.add("shard-count", "ok", _n(len(files), "safetensors file"), "(profile sets no model.expect_shards)")
    elif len(files) == expect:
        rep.add("shard-count", "ok", _n(len(files), "safetensors file"), f"{expect}")
    elif len(on_disk) == expect and set(files) < set(on_disk) and root is not None and _holds_unindexed(
            root, sorted(set(on_disk) - set(files)), weight_map):
        # every shard is here and the index is stale (an overlay added without it): no re-download
        left = sorted(set(on_disk) - set(files))
        rep.add("shard-count", "fail", f"{_n(len(on_disk), 'safetensors file')} on disk, the index names "
                f"{len(files)} (it leaves out {_few(left, 2)})", f"{expect} (model.expect_shards)",
                "rebuild model.safetensors.index.json so that it names every shard (vLLM skips the rest)")
    else:
        rep.add("shard-count", "fail", _n(len(files), "safetensors file"), f"{expect} (model.expect_shards)",
                "the pack is incomplete or a different pack: re-download it, or fix model.path")


def _headers(rep: PackReport, root: Path, files: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    bad: list[str] = []
    fixes: list[str] = []
    for f in files:
        p = root / f
        if _stat_error(p):
            continue  # already a files-resolve failure
        try:
            _, hdr = read_header(p)
        except FileProblem as e:
            bad.append(f"{f}: {e}")
            fixes.append(e.fix)
            continue
        except (HeaderError, OSError) as e:
            bad.append(f"{f}: {e}")
            fixes.append("re-download the shard (a truncated or corrupt file)")
            continue
        out[f] = hdr
    if bad:
        rep.partial = True
        rep.add("headers", "fail", f"{len(bad)} unreadable: {_few(bad, 2)}", "every shard header parses and fits its file",
                "; ".join(dict.fromkeys(fixes)))
    else:
        rep.add("headers", "ok", f"{_n(len(out), 'header')} read, {_n(sum(len(h) for h in out.values()), 'tensor')}")
    return out


def _coverage(rep: PackReport, weight_map: dict[str, str] | None,
              headers: dict[str, dict[str, dict[str, Any]]]) -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for f, hdr in headers.items():
        for name, t in hdr.items():
            where[name].append(f)
            if name not in rep.tensors:
                start, end = t["data_offsets"]
                rep.tensors[name] = Tensor(name, f, t["dtype"], [int(d) for d in t["shape"]], int(end) - int(start))
    dup = {n: fs for n, fs in where.items() if len(fs) > 1}
    if dup:
        ex = [f"{n} in {' and '.join(fs)}" for n, fs in list(dup.items())[:2]]
        rep.add("tensors-duplicated", "fail", f"{len(dup)} tensors in more than one shard: {_few(ex, 2)}",
                "each tensor in exactly one shard",
                "rebuild the overlay: a rewritten shard still holds tensors its overlay replaced")
    else:
        rep.add("tensors-duplicated", "ok", "each tensor in one shard")
    if not weight_map:  # no index (nothing to cross-check) or an unreadable one (already failed)
        return
    absent, stale, in_missing_file = [], [], 0
    for name, f in weight_map.items():
        if f not in headers:
            in_missing_file += 1
        elif name not in headers[f]:
            # vLLM reads the index for its file list only and loads every tensor of each file, so a
            # tensor in another indexed file loads: the index is stale, the pack is not broken
            (stale if where.get(name) else absent).append(f"{name} (index: {f})")
    if stale and not absent and not in_missing_file:
        rep.add("tensors-missing", "warn", f"{len(stale)} indexed tensors are in another shard than the index says: "
                f"{_few(stale, 2)}", "every tensor the index names is in that shard",
                "rebuild the index from the shard headers (vLLM still loads them: it reads every indexed file whole)")
    elif absent:
        extra = f"; {in_missing_file} more in unreadable files" if in_missing_file else ""
        rep.add("tensors-missing", "fail", f"{len(absent)} indexed tensors absent from their shard: {_few(absent, 2)}{extra}",
                "every tensor the index names is in that shard",
                "re-download or rebuild the shard, then rebuild the index from the headers")
    elif in_missing_file:
        rep.add("tensors-missing", "fail", f"{in_missing_file} indexed tensors are in missing or unreadable files",
                "every tensor the index names is in that shard", "restore the files files-resolve/headers name")
    else:
        rep.add("tensors-missing", "ok", f"all {len(weight_map):,} indexed tensors present")
    unlisted = [n for n in where if n not in weight_map]
    if unlisted:
        rep.add("tensors-unlisted", "warn", f"{len(unlisted)} tensors not in the index: {_few(unlisted, 2)}",
                "the index lists every tensor", "rebuild the index from the shard headers")
    else:
        rep.add("tensors-unlisted", "ok", "the index lists every tensor")


def _small_files(rep: PackReport, root: Path) -> None:
    """The tokenizer and generation config must be files vLLM can read, not just names: an empty
    tokenizer.json or a directory in its place fails the server's start."""
    def problem(name: str) -> tuple[str, str] | None:
        p = root / name
        if err := _stat_error(p):
            return (err, "make it readable to this user" if "permission" in err.lower() else "")
        try:
            if name.endswith(".json"):
                read_json(p)
            else:
                _regular(p)
                if p.stat().st_size == 0:
                    return ("empty", "")
        except FileProblem as e:
            return (str(e), e.fix)
        return None

    tok_name = "tokenizer.json" if not _stat_error(root / "tokenizer.json") or _stat_error(root / "tokenizer.model") \
        else "tokenizer.model"
    bad = [(n, pr) for n in (tok_name, "tokenizer_config.json") if (pr := problem(n)) is not None]
    if not bad:
        rep.add("tokenizer", "ok", f"{tok_name} + tokenizer_config.json")
    else:
        fix = next((pr[1] for _, pr in bad if pr[1] and "permission" in pr[0]), "copy the tokenizer files from the pack's source")
        rep.add("tokenizer", "fail", "; ".join(f"{n}: {pr[0]}" for n, pr in bad),
                "tokenizer.json (or .model) + tokenizer_config.json, readable", fix)
    pr = problem("generation_config.json")
    if pr is None:
        rep.add("generation-config", "ok", "generation_config.json")
    else:
        rep.add("generation-config", "fail", f"generation_config.json: {pr[0]}", "generation_config.json, readable JSON",
                pr[1] if "permission" in pr[0] else
                "copy it from the pack's source (vLLM reads sampling defaults and EOS ids from it)")


# ---------------------------------------------------------------------------------------------
# EXL3 rules


@dataclass
class _Modules:
    """EXL3 modules of the pack: module name -> {part: Tensor}."""

    parts: dict[str, dict[str, Tensor]]

    def trellis(self, m: str) -> Tensor | None:
        return self.parts.get(m, {}).get("trellis")


def _modules(tensors: dict[str, Tensor]) -> _Modules:
    bases = {n[: -len(".trellis")] for n in tensors if n.endswith(".trellis")}
    parts: dict[str, dict[str, Tensor]] = {b: {} for b in bases}
    for n, t in tensors.items():
        base, _, part = n.rpartition(".")
        if part in EXL3_PARTS and base in parts:
            parts[base][part] = t
    return _Modules(parts)


def effective_class(config: dict[str, Any] | None, profile_class: str | None) -> str | None:
    """The class vLLM will instantiate: it picks the Vision class when vision_n_layers > 0."""
    cfg = config or {}
    if (cfg.get("vision_n_layers") or 0) > 0 and "DeepseekV4" in " ".join(cfg.get("architectures") or []):
        return VISION_CLASS
    arch = cfg.get("architectures") or []
    return arch[0] if arch else profile_class


def _exl3_rules(rep: PackReport, model_class: str | None, wo_a_slices: int | None,
                routed_ks: tuple[int, ...] | None = None, tp: int | None = None) -> None:
    cfg = rep.config or {}
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict):
        rep.add("quant-method", "fail", "config.json has no quantization_config", "quant_method exl3",
                "restore the pack's config.json (vLLM would load it unquantized)")
        qc = {}
    elif qc.get("quant_method") != "exl3":
        rep.add("quant-method", "fail", f"quant_method {qc.get('quant_method')!r}", "quant_method exl3",
                "set quantization_config.quant_method to exl3 (a leftover fp8 block silently overrides "
                "--quantization exl3)")
    else:
        rep.add("quant-method", "ok", "exl3", "exl3")
    _model_class(rep, cfg, model_class)
    mods = _modules(rep.tensors)
    _exl3_tensors(rep, mods)
    _markers(rep, mods)
    _shapes(rep, cfg, mods)
    if not qc:
        # every stamp below is read from it: four more failures would only repeat quant-method's
        for name in ("codebook", "dense-bits", "routed-bits", "mtp"):
            rep.add(name, "n/a", "config.json has no quantization_config (see quant-method)", "",
                    "checked once quantization_config is restored")
        _wo_a(rep, cfg, mods, wo_a_slices, tp)
        return
    _codebook(rep, qc, mods)
    nr = qc.get("non_routed_exl3") if isinstance(qc.get("non_routed_exl3"), dict) else None
    entries = _entries(rep, nr)
    cls = model_class or effective_class(cfg, None)
    _dense(rep, cfg, mods, nr, entries, cls)
    _routed_bits(rep, cfg, qc, mods, routed_ks)
    _mtp(rep, qc, mods)
    _wo_a(rep, cfg, mods, wo_a_slices, tp)
    _bf16_shards(rep, entries, tp)


# Dense kinds vLLM 0.28's DeepSeek-V4 splits across tensor-parallel ranks (column / row parallel
# without disable_tp); the others (fused_wqa_wkv, the compressors, the indexer's wq_b) are
# replicated, so each rank holds them whole.
TP_SPLIT_KINDS = ("attn.wq_b", "attn.wo_a", "attn.wo_b", "ffn.shared_experts.gate_up_proj",
                  "ffn.shared_experts.down_proj")


def _bf16_shards(rep: PackReport, entries: list[tuple[str, dict[str, Any]]], tp: int | None) -> None:
    """vllm-exl3 refuses `bf16_shards` on a dense EXL3 layer whose effective TP is above one (seat-
    reference §2.2): a pack made for one GPU dies at load on the seat, one rank after another."""
    marked = [p for p, spec in entries if spec.get("bf16_shards")]
    if not marked:
        return  # the usual case: no row
    m = [(p, _ENTRY.match(p)) for p in marked]
    split = [p for p, e in m if e and _kind_of(e.group("rest")) in TP_SPLIT_KINDS]
    if tp is None or tp <= 1 or not split:
        rep.add("bf16-shards", "ok", f"{len(marked)} entries set bf16_shards"
                + (f", none on a layer split across the {tp} ranks" if tp and tp > 1 else f" (TP {tp or '?'})"),
                "no bf16_shards where a layer is split across ranks")
        return
    rep.add("bf16-shards", "fail", f"{len(split)} entries split across the {tp} ranks set bf16_shards: "
            f"{_few(split, 2)}", "no bf16_shards where a layer is split across ranks",
            f"vllm-exl3 refuses them at TP > 1 (a bf16 shard is not split across ranks): use a pack baked for "
            f"TP {tp}, or serve this one at TP 1")


def _shapes(rep: PackReport, cfg: dict[str, Any], mods: _Modules) -> None:
    """config.json's dimensions against the stored shapes vLLM will load them into: a config from
    another export (or shards of another model) otherwise fails minutes into the load, as a bare
    shape error from one rank."""
    dims = {k: cfg.get(k) for k in ("hidden_size", "moe_intermediate_size", "vocab_size", "n_routed_experts")}
    known = {k: v for k, v in dims.items() if type(v) is int and v > 0}
    H, I, V, E = (known.get(k) for k in dims)
    want: list[tuple[str, list[int], str]] = []  # (tensor, expected shape prefix, from which keys)
    if H and I:
        for m in mods.parts:
            e = _EXPERT.match(m)
            if e:
                k, n = (I, H) if e.group(4) == "w2" else (H, I)
                want.append((f"{m}.trellis", [k // 16, n // 16],
                             "[moe_intermediate_size/16, hidden_size/16]" if e.group(4) == "w2"
                             else "[hidden_size/16, moe_intermediate_size/16]"))
    if H and V:
        want += [(n, [V, H], "[vocab_size, hidden_size]") for n in ("embed.weight", "head.weight")]
    if H and E:
        want += [(n, [E, H], "[n_routed_experts, hidden_size]") for n in rep.tensors
                 if re.fullmatch(r"(layers|mtp)\.\d+\.ffn\.gate\.weight", n)]
    if not want:
        rep.add("shapes", "n/a", "config.json gives none of hidden_size, moe_intermediate_size, vocab_size, "
                "n_routed_experts", "", "")
        return
    bad, seen = [], 0
    for name, shape, rule in sorted(want):
        t = rep.tensors.get(name)
        if t is None:  # absent (another spelling, a quantized head): the coverage rows speak for it
            continue
        seen += 1
        if t.shape[:len(shape)] != shape:
            bad.append(f"{name} {t.shape[:len(shape)]}, config says {shape} {rule}")
    cfg_text = ", ".join(f"{k} {v}" for k, v in known.items())
    if bad:
        rep.add("shapes", "fail", f"{len(bad)} tensors disagree with config.json: {_few(bad, 2)}", cfg_text,
                "config.json is not this pack's (restore the one shipped with these shards), or the shards "
                "are of another export")
    else:
        rep.add("shapes", "ok", f"{seen:,} tensors match config.json ({cfg_text})")


def _model_class(rep: PackReport, cfg: dict[str, Any], want: str | None) -> None:
    got = effective_class(cfg, None)
    arch = (cfg.get("architectures") or ["?"])[0]
    why = f"architectures {arch}" + (f", vision_n_layers {cfg.get('vision_n_layers')}" if cfg.get("vision_n_layers") else "")
    if want is None:
        rep.add("model-class", "ok", f"{got} ({why})", "(profile sets no model.model_class)")
    elif got == want:
        rep.add("model-class", "ok", f"{got} ({why})", want)
    else:
        rep.add("model-class", "fail", f"vLLM would pick {got} ({why})", want,
                "use the pack made for this class, or fix model.model_class (vLLM picks the Vision class "
                "only when config.json has vision_n_layers > 0)")


def _exl3_tensors(rep: PackReport, mods: _Modules) -> None:
    bad = []
    for m, p in mods.parts.items():
        tr = p["trellis"]
        if tr.dtype != "I16" or len(tr.shape) != 3 or tr.shape[-1] % 16 or not 1 <= tr.shape[-1] // 16 <= 8:
            # exllamav3 1.4.5 (the seat's) decodes whole K from 1 to 8: last dim 16, 32, .. 128
            bad.append(f"{m}.trellis {tr.dtype}{tr.shape}")
            continue
        k, n = tr.shape[0] * 16, tr.shape[1] * 16
        for part, want in (("suh", k), ("svh", n)):
            t = p.get(part)
            if t is None:
                if part[:2] not in p:  # legacy su/sv packed signs are acceptable
                    bad.append(f"{m}.{part} missing")
            elif t.dtype != "F16" or t.shape != [want]:
                bad.append(f"{m}.{part} {t.dtype}{t.shape} (trellis says [{want}])")
    if bad:
        rep.add("exl3-tensors", "fail", f"{len(bad)} malformed: {_few(bad, 2)}",
                "trellis I16 [k/16, n/16, 16K] with K 1-8, suh F16 [k], svh F16 [n]",
                "re-export the module; the pack is corrupt or from an unknown converter")
    else:
        rep.add("exl3-tensors", "ok", f"{len(mods.parts):,} EXL3 modules well-formed")


def _markers(rep: PackReport, mods: _Modules) -> None:
    none, both, bad = [], [], []
    for m, p in mods.parts.items():
        have = [k for k in MARKERS if k in p]
        if not have:
            none.append(m)
        elif len(have) > 1:
            both.append(m)
        for k in have:
            t = p[k]
            if t.dtype != "I32" or t.shape not in ([], [1]):
                bad.append(f"{m}.{k} {t.dtype}{t.shape}")
    if none or both or bad:
        parts = []
        if none:
            parts.append(f"{len(none)} without a codebook marker: {_few(none, 2)}")
        if both:
            parts.append(f"{len(both)} with both mcg and mul1: {_few(both, 2)}")
        if bad:
            parts.append(f"{len(bad)} malformed markers: {_few(bad, 2)}")
        rep.add("codebook-markers", "fail", "; ".join(parts),
                "every EXL3 module has one marker (.mcg or .mul1, I32 [] or [1])",
                "re-export those modules: without a marker exllamav3 decodes them with the 3INST codebook "
                "(vllm-exl3 does not support it), i.e. wrong weights")
    else:
        rep.add("codebook-markers", "ok", f"{len(mods.parts):,} modules carry one marker each")


def _codebook(rep: PackReport, qc: dict[str, Any], mods: _Modules) -> None:
    routed: Counter[str] = Counter()
    dense: Counter[str] = Counter()
    for m, p in mods.parts.items():
        have = [k for k in MARKERS if k in p]
        if len(have) != 1:
            continue  # codebook-markers reports these
        (routed if _EXPERT.match(m) else dense)[have[0]] += 1
    nr = qc.get("non_routed_exl3") if isinstance(qc.get("non_routed_exl3"), dict) else {}
    declared_r = qc.get("codebook")
    declared_d = nr.get("codebook", declared_r) if nr else declared_r
    problems = []
    for label, found, declared in (("routed", routed, declared_r), ("dense", dense, declared_d)):
        if not found:
            continue
        if len(found) > 1:
            problems.append(f"mixed codebooks in {label} modules: " + ", ".join(f"{c} {k}" for k, c in found.most_common())
                            + f" (config: {declared})")
        elif declared not in MARKERS:
            problems.append(f"{label} codebook declared {declared!r}, markers say {next(iter(found))}")
        elif declared not in found:
            problems.append(f"{label}: config says {declared}, markers say "
                            + ", ".join(f"{k} ({c})" for k, c in found.most_common()))
    summary = ", ".join(f"{label} {'/'.join(f.keys()) or '-'}" for label, f in (("routed", routed), ("dense", dense)))
    if problems:
        rep.add("codebook", "fail", "; ".join(problems), "one codebook per group, as config.json declares",
                "re-export the odd modules with the declared codebook, or correct quantization_config.codebook / "
                "non_routed_exl3.codebook")
    else:
        rep.add("codebook", "ok", summary, f"config: routed {declared_r}, dense {declared_d}")


def _entries(rep: PackReport, nr: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    if nr is None:
        return []
    layers = nr.get("layers")
    if not isinstance(layers, dict):
        return []
    return [(str(k), v if isinstance(v, dict) else {"bits": v}) for k, v in layers.items()]


def _kind_of(rest: str) -> str:
    """Normalise an entry's module path; `mlp.` is dense_bake's default spelling of `ffn.`."""
    return "ffn." + rest[len("mlp."):] if rest.startswith("mlp.") else rest


def _dense(rep: PackReport, cfg: dict[str, Any], mods: _Modules, nr: dict[str, Any] | None,
           entries: list[tuple[str, dict[str, Any]]], cls: str | None) -> None:
    # dense EXL3 modules in trunk layers: (layer, module path)
    dense: dict[tuple[int, str], str] = {}
    for m in mods.parts:
        if _EXPERT.match(m):
            continue
        t = _TRUNK.match(m)
        if t:
            dense[(int(t.group(1)), t.group(2))] = m
    if nr is None:
        if dense:
            rep.add("dense-bits", "fail", f"{len(dense)} dense EXL3 modules but no non_routed_exl3 in config.json",
                    "non_routed_exl3.layers entries for them", "restore the merged config.json (dense_bake --merge)")
        else:
            rep.add("dense-bits", "n/a", "no dense EXL3 modules (dense layers stored as plain weights)")
        return
    if "layers" in nr and not isinstance(nr.get("layers"), dict):
        rep.add("dense-bits", "fail", f"non_routed_exl3.layers is {json.dumps(nr.get('layers'))[:60]}, not a map",
                "a layers map {module prefix: {bits}}", "restore the merged config.json (dense_bake --merge)")
        return
    if "layers" not in nr:
        _dense_short_form(rep, nr, dense, mods)
        return

    default_bits = nr.get("bits")
    covered: set[tuple[int, str]] = set()
    wrong, empty, unknown, roots, kinds_per_layer = [], [], [], Counter(), defaultdict(set)
    mlp_spelling = 0
    for prefix, spec in entries:
        m = _ENTRY.match(prefix)
        if not m or _kind_of(m.group("rest")) not in DENSE_KINDS:
            unknown.append(prefix)
            continue
        roots[m.group("root")] += 1
        mlp_spelling += m.group("rest").startswith("mlp.")
        n, kind = int(m.group("n")), _kind_of(m.group("rest"))
        kinds_per_layer[kind].add(n)
        bits = spec.get("bits", default_bits)
        targets = []
        for pat in DENSE_KINDS[kind]:
            if pat.endswith(".*"):
                stem = pat[:-1]
                targets += [k for k in dense if k[0] == n and k[1].startswith(stem)]
            elif (n, pat) in dense:
                targets.append((n, pat))
        if not targets:
            empty.append(prefix)
            continue
        for key in targets:
            covered.add(key)
            tr = mods.trellis(dense[key])
            k = _k(tr) if tr else 0.0
            if not _bits_eq(bits, k):
                wrong.append((prefix, bits, k, dense[key]))

    # dense-bits (trap 1)
    if wrong:
        stamps = Counter((str(b), _kstr(k)) for _, b, k, _ in wrong)
        desc = ", ".join(f"{c} say bits {b} for {ks} trellis" for (b, ks), c in stamps.most_common(3))
        ex = wrong[0]
        real = sorted({_kstr(w[2]) for w in wrong})
        rep.add("dense-bits", "fail", f"{len(wrong)} modules disagree: {desc} (e.g. {ex[0]} bits {ex[1]}, "
                f"{ex[3]}.trellis last dim {int(ex[2] * 16)})",
                "every non_routed_exl3 bits = trellis last dim / 16",
                f"restamp non_routed_exl3.layers.*.bits to {'/'.join(k[1:] for k in real)} (re-run dense_bake "
                "--merge with the bake's --bits; trap 1)")
    elif covered:
        ks = Counter(_kstr(_k(mods.trellis(dense[c]))) for c in covered)  # type: ignore[arg-type]
        rep.add("dense-bits", "ok", f"{len(entries)} entries match their trellis ("
                + ", ".join(f"{c} modules {k}" for k, c in ks.most_common()) + ")",
                "bits = trellis last dim / 16")
    elif not dense and rep.held_elsewhere(_dense_module):  # the modules are absent, not uncovered
        rep.add("dense-bits", "n/a", "no non_routed_exl3 entry covers a dense EXL3 module in the files read, and "
                "weight files are missing, unreadable or left out of the index (files-resolve, layer-modules)", "",
                "checked once the files are restored and indexed")
    else:
        rep.add("dense-bits", "fail", "no non_routed_exl3 entry covers a dense EXL3 module",
                "entries covering the dense modules", "check the entry prefixes (dense-prefixes)")

    # dense-coverage
    uncovered = sorted(dense[k] for k in dense if k not in covered)
    problems = []
    if uncovered:
        problems.append(f"{len(uncovered)} dense EXL3 modules without an entry: {_few(uncovered, 2)}")
    if empty and not rep.held_elsewhere(_dense_module):  # a weight file gone (or unindexed) is the failure
        problems.append(f"{len(empty)} entries cover no tensors: {_few(empty, 2)}")
    if unknown:
        problems.append(f"{len(unknown)} entries name an unknown module: {_few(unknown, 2)}")
    if not problems and empty:
        rep.add("dense-coverage", "n/a", f"{len(empty)} entries cover no tensors, and weight files are missing, "
                "unreadable or left out of the index (files-resolve, layer-modules)", "",
                "checked once the files are restored and indexed")
    elif problems:
        rep.add("dense-coverage", "fail", "; ".join(problems), "one entry per fused module, each covering its tensors",
                "rebuild non_routed_exl3.layers from the pack (an uncovered module loads as plain weights and fails)")
    else:
        rep.add("dense-coverage", "ok", f"{len(dense)} dense EXL3 modules covered by {len(entries)} entries")

    # dense-prefixes
    want = CLASS_ROOT.get(cls or "")
    if want is None:
        rep.add("dense-prefixes", "warn", f"roots {_few(f'{r or chr(34)*2}layers.N' for r in roots)}",
                f"no prefix rule for model class {cls}", "check the prefixes against the class's module names")
    else:
        off = {r: c for r, c in roots.items() if r != want}
        if off or mlp_spelling:
            parts = [f"{c} entries use {r}layers.N" for r, c in off.items()]
            if mlp_spelling:
                parts.append(f"{mlp_spelling} use mlp.shared_experts")
            rep.add("dense-prefixes", "fail", "; ".join(parts), f"{want}layers.N… with ffn.shared_experts ({cls})",
                    f"rewrite the keys to {want}layers.N… (dense_bake's default model.layers.N / mlp.shared_experts "
                    "fits the text class only)")
        else:
            rep.add("dense-prefixes", "ok", f"{want}layers.N…", f"{cls}")

    # dense-entry-counts: the expectation comes from the pack's own layer structure
    found = [len(kinds_per_layer.get(k, ())) for k in DENSE_KINDS]
    expected, basis = _expected_counts(cfg, dense)
    f_s, e_s = "/".join(map(str, found)), "/".join(map(str, expected))
    canon = " (the real pack: " + "/".join(map(str, CANON_ENTRY_COUNTS)) + ")" if tuple(expected) == CANON_ENTRY_COUNTS else ""
    if found == expected:
        rep.add("dense-entry-counts", "ok", f_s, f"{e_s} from {basis}{canon}")
    elif rep.partial and not basis.startswith("config.json"):  # counted from tensors, some of them missing
        rep.add("dense-entry-counts", "n/a", f"{f_s} against {e_s} from {basis}, with weight files missing or "
                "unreadable (files-resolve, headers)", "", "checked once the files are restored")
    else:
        diff = [f"{k} {f}≠{e}" for k, f, e in zip(DENSE_KINDS, found, expected) if f != e]
        rep.add("dense-entry-counts", "fail", f"{f_s} ({_few(diff, 3)})", f"{e_s} from {basis}{canon}",
                "rebuild non_routed_exl3.layers: one entry per layer for each fused module the layer has")


def _dense_short_form(rep: PackReport, nr: dict[str, Any], dense: dict[tuple[int, str], str], mods: _Modules) -> None:
    """non_routed_exl3 without a layers map: `bits` for every dense module, `layer_bits` per layer.
    The stamp is what vLLM sizes the module by, so trap 1 (a 6-bit bake stamped 4) fails here too."""
    base = nr.get("bits")
    lb = nr.get("layer_bits") if isinstance(nr.get("layer_bits"), dict) else {}
    if base is None and not lb:
        # an empty entry tells vllm-exl3 as little about the dense modules as a missing one does
        rep.add("dense-bits", "fail" if dense else "warn",
                (f"{len(dense)} dense EXL3 modules but " if dense else "")
                + "non_routed_exl3 has no layers, bits or layer_bits", "bits (and layer_bits) for the dense modules",
                "restore the merged config.json (dense_bake --merge)")
        return
    wrong = []
    checked = 0
    for (n, _path), m in sorted(dense.items()):
        want = lb.get(str(n), lb.get(n, base))
        if want is None:
            continue
        checked += 1
        tr = mods.trellis(m)
        k = _k(tr) if tr else 0.0
        if not _bits_eq(want, k):
            wrong.append(f"{m}: bits {want}, trellis {_kstr(k)} (last dim {int(k * 16)})")
    if wrong:
        rep.add("dense-bits", "fail", f"{len(wrong)} dense modules disagree with the short-form stamp: {_few(wrong, 2)}",
                "every non_routed_exl3 bits = trellis last dim / 16",
                "correct non_routed_exl3.bits / layer_bits to the stored widths (trap 1: a bake merged without "
                "its --bits), or re-bake")
    else:
        rep.add("dense-bits", "ok", f"short form: {_n(checked, 'dense module')} match bits {base}"
                + (f" and {len(lb)} layer_bits" if lb else ""))


def _expected_counts(cfg: dict[str, Any], dense: dict[tuple[int, str], str]) -> tuple[list[int], str]:
    n = cfg.get("num_hidden_layers")
    cr = cfg.get("compress_ratios")
    if isinstance(n, int) and isinstance(cr, list) and len(cr) >= n:
        trunk = cr[:n]
        comp = sum(1 for r in trunk if r)
        idx = sum(1 for r in trunk if r == 4)  # CSA layers carry the lightning indexer
        return [n, n, n, n, comp, idx, idx, n, n], "config.json (num_hidden_layers, compress_ratios)"
    # no schedule in the config: one entry per layer that stores the kind's tensors
    out = []
    for pats in DENSE_KINDS.values():
        layers = {ln for (ln, m) in dense for p in pats if (m.startswith(p[:-1]) if p.endswith(".*") else m == p)}
        out.append(len(layers))
    return out, "the dense tensors in the pack"


def _routed_bits(rep: PackReport, cfg: dict[str, Any], qc: dict[str, Any], mods: _Modules,
                 routed_ks: tuple[int, ...] | None = None) -> None:
    """The stamps (bits, layer_bits) against the experts' trellis widths, and with `routed_ks` the
    widths against what the seat's routed-expert kernel serves."""
    n = int(cfg.get("num_hidden_layers") or 0)
    per_layer: dict[int, Counter[float]] = defaultdict(Counter)
    for m in mods.parts:
        e = _EXPERT.match(m)
        if not e:
            continue
        layer = int(e.group(2)) + (n if e.group(1) == "mtp" else 0)  # vLLM numbers draft layers after the trunk
        tr = mods.trellis(m)
        per_layer[layer][_k(tr) if tr else 0.0] += 1
    if not per_layer:
        rep.add("routed-bits", "n/a", "no EXL3 routed experts")
        return
    base = qc.get("bits")
    lb_raw = qc.get("layer_bits") or {}
    if not isinstance(lb_raw, dict):  # read as {layer: bits}: a list would silently check every layer against bits
        rep.add("routed-bits", "fail", f"quantization_config.layer_bits is {json.dumps(lb_raw)[:80]}",
                "an object {layer index: bits}", "rewrite layer_bits as {\"N\": bits, ...} (or drop it)")
        return
    lb = {}
    for k, v in lb_raw.items():
        try:
            lb[int(k)] = v
        except ValueError:
            pass
    wrong, mixed = [], []
    for layer in sorted(per_layer):
        ks = per_layer[layer]
        want = lb.get(layer, base)
        if len(ks) > 1:
            mixed.append(f"layer {layer}: " + ", ".join(f"{c} {_kstr(k)}" for k, c in ks.most_common()))
            continue
        (k,) = ks
        if not _bits_eq(want, k):
            src = "layer_bits" if layer in lb else "bits"
            wrong.append(f"layer {layer}: trellis {_kstr(k)} (last dim {int(k * 16)}), {src} says {want}")
    # with a weight file missing, absent experts are that failure, not stale layer_bits
    # (a trunk layer without experts is layer-modules' failure, not a stale key to drop)
    # a declared draft layer's key is not stale when its experts are missing: layer-modules says that
    drafts = {n + j for j in _declared_drafts(cfg, set())}
    orphans = [] if rep.partial else sorted(k for k in lb if k not in per_layer and not 0 <= k < n and k not in drafts)
    mix = Counter(next(iter(ks)) for ks in per_layer.values() if len(ks) == 1)
    summary = ", ".join(f"{c} layers {_kstr(k)}" for k, c in sorted(mix.items()))
    if wrong or mixed:
        rep.add("routed-bits", "fail", "; ".join(([_few(wrong, 3)] if wrong else []) + mixed[:2]),
                f"bits {base}, layer_bits {json.dumps(lb_raw, separators=(',', ':'))} = expert trellis widths "
                "(32 -> K2, 48 -> K3)",
                "correct quantization_config.layer_bits (or bits) to the stored widths, or re-bake the odd layers")
    elif routed_ks and (odd := [f"layer {layer}: {_kstr(next(iter(ks)))}" for layer, ks in sorted(per_layer.items())
                                if next(iter(ks)) not in routed_ks]):
        # stamps and widths agree, but the seat's kernel refuses the width: every rank fails at load
        serves = ", ".join(f"K{k}" for k in routed_ks)
        rep.add("routed-bits", "fail", f"{summary}; {_few(odd, 3)}", f"routed experts of {serves} (what the seat's "
                "kernel serves)", "re-bake those layers at a width the kernel serves, or use a profile whose "
                "moe.kernel serves it")
    elif orphans:
        rep.add("routed-bits", "warn", f"{summary}; layer_bits names layers without experts: {_few(orphans)}",
                "layer_bits only for layers with experts", "drop the stale layer_bits keys")
    else:
        rep.add("routed-bits", "ok", summary, f"bits {base}, layer_bits {len(lb)} overrides")


def _mtp(rep: PackReport, qc: dict[str, Any], mods: _Modules) -> None:
    mtp = [m for m in mods.parts if m.startswith("mtp.") and _EXPERT.match(m)]
    if not mtp:
        rep.add("mtp-experts", "n/a", "no EXL3 draft (mtp.*) experts")
        return
    mode = qc.get("mtp_experts")
    if mode not in (None, "exl3"):
        rep.add("mtp-experts", "fail", f"quantization_config.mtp_experts = {mode!r} with {len(mtp)} EXL3 draft modules",
                "mtp_experts absent (or exl3), so draft experts load as EXL3",
                "remove mtp_experts and mtp_experts_start_layer from quantization_config")
    elif "mtp_experts_start_layer" in qc and mode is None:
        rep.add("mtp-experts", "warn", "mtp_experts_start_layer set without mtp_experts",
                "neither key (draft experts load as EXL3)", "remove mtp_experts_start_layer")
    else:
        layers = sorted({int(_EXPERT.match(m).group(2)) for m in mtp})  # type: ignore[union-attr]
        rep.add("mtp-experts", "ok", f"{len(layers)} draft layers with EXL3 experts", "draft experts load as EXL3")


def _wo_a(rep: PackReport, cfg: dict[str, Any], mods: _Modules, want: int | None, tp: int | None = None) -> None:
    per_layer: dict[int, set[int]] = defaultdict(set)
    for m in mods.parts:
        t = _TRUNK.match(m)
        if t:
            s = _SLICE.match(t.group(2))
            if s:
                per_layer[int(t.group(1))].add(int(s.group(1)))
    expect = want or cfg.get("o_groups")
    if not per_layer:
        # absent, not stored whole (a non-Dense pack's wo_a is a failure here whatever else is wrong)
        whole = any(_WHOLE_WO_A.match(m) for m in _present(rep.tensors))  # EXL3 or plain
        if want and not whole and rep.held_elsewhere(lambda m: ".attn.wo_a.slice." in m):
            rep.add("wo-a-slices", "n/a", "no attn.wo_a.slice.R tensors in the files read, and weight files are "
                    "missing, unreadable or left out of the index (files-resolve, layer-modules)", "",
                    "checked once the files are restored and indexed")
        elif want:
            rep.add("wo-a-slices", "fail", "no attn.wo_a.slice.R tensors", f"{want} rank-local slices per layer",
                    "use the Dense pack, or unset model.wo_a_rank_slices")
        else:
            rep.add("wo-a-slices", "n/a", "attn.wo_a not stored as rank-local slices")
        return
    n = int(cfg.get("num_hidden_layers") or 0)
    bad = [f"layer {ln}: {len(s)}" for ln, s in sorted(per_layer.items()) if s != set(range(int(expect or len(s))))]
    lacking = [ln for ln in range(n) if ln not in per_layer]
    if bad or lacking:
        parts = []
        if bad:
            parts.append(f"slice counts off: {_few(bad, 3)}")
        if lacking:
            parts.append(f"layers without slices: {_few(lacking)}")
        msg = "; ".join(parts)
        rep.add("wo-a-slices", "fail", msg, f"slices 0..{int(expect or 0) - 1} on every layer",
                "the pack is incomplete: restore the dense overlay shard")
    elif tp is not None and int(expect or 0) != tp:
        # the patched DeepSeek-V4 attention serves a rank-local wo_a only with one slice (group) per
        # rank: "EXL3 wo_a requires TP=8" otherwise (seat-reference §2, the wo_a patch)
        rep.add("wo-a-slices", "fail", f"{len(per_layer)} layers x {int(expect or 0)} slices, the seat runs TP {tp}",
                f"{tp} (one per TP rank)", f"run this pack at TP {int(expect or 0)}, or use a pack baked for TP {tp}")
    else:
        rep.add("wo-a-slices", "ok", f"{len(per_layer)} layers x {int(expect or 0)} slices",
                f"{int(expect or 0)} (one per TP rank)")


_ATTN = ("attn.wq_a", "attn.wkv", "attn.wq_b", "attn.wo_b")
_SHARED = ("ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3")
_COMPRESSOR = ("attn.compressor.wkv", "attn.compressor.wgate")
_INDEXER = ("attn.indexer.compressor.wkv", "attn.indexer.compressor.wgate", "attn.indexer.wq_b")


def _present(names: Iterable[str]) -> set[str]:
    """Modules that hold weights: an EXL3 trellis or a plain `.weight` (suh, svh and markers alone
    are what is left of a module whose trellis was lost)."""
    out = set()
    for n in names:
        base, _, part = n.rpartition(".")
        if part in ("trellis", "weight"):
            out.add(base)
    return out


def _expert_format(rep: PackReport) -> None:
    """Routed experts (trunk and draft) in an EXL3 pack are trellises: one stored as a plain or fp8
    `.weight` counts as present for layer-modules, and a `.weight` / `.weight_scale_inv` left beside
    a trellis is the pre-rewrite draft shards' state (seat-reference §8). The EXL3 rules read only
    modules with a trellis, so neither is seen there."""
    plain, leftover = [], []
    for name in rep.tensors:
        base, _, part = name.rpartition(".")
        if part not in ("weight", "weight_scale_inv") or not _EXPERT.match(base):
            continue
        (leftover if base + ".trellis" in rep.tensors else plain).append(name)
    if not plain and not leftover:
        rep.add("expert-format", "ok", "every routed expert is an EXL3 trellis")
        return
    parts = []
    if plain:
        parts.append(f"{len(plain)} without a trellis: {_few(sorted(plain), 2)}")
    if leftover:
        parts.append(f"{len(leftover)} left beside a trellis: {_few(sorted(leftover), 2)}")
    rep.add("expert-format", "fail", "; ".join(parts), "routed experts as EXL3 trellis / suh / svh only",
            "re-export those experts with the EXL3 converter (a plain or fp8 .weight is not what the EXL3 MoE "
            "kernels read), and drop leftover .weight / .weight_scale_inv tensors from the shards")


def _stray_modules(root: Path, stray: list[str]) -> dict[str, str]:
    """Module -> file for the safetensors files the index leaves out (vLLM never reads them)."""
    out: dict[str, str] = {}
    for f in stray:
        try:
            _, hdr = read_header(root / f)
        except (HeaderError, OSError):
            continue
        for m in _present(hdr):
            out.setdefault(m, f)
    return out


def _declared_drafts(cfg: dict[str, Any], present: set[str]) -> set[int]:
    """The draft (MTP) layers a seat that speculates loads: those config.json declares
    (num_nextn_predict_layers) and any whose modules the pack stores."""
    k = cfg.get("num_nextn_predict_layers")
    declared = set(range(k)) if isinstance(k, int) and not isinstance(k, bool) and 0 < k <= 64 else set()
    return declared | {int(d.group(1)) for m in present if (d := _DRAFT.match(m))}


def _layer_modules(rep: PackReport, cfg: dict[str, Any], stray: dict[str, str], draft: bool = False) -> None:
    """Every module config.json says a layer has: each trunk layer's routed experts, attention, wo_a,
    shared experts, and the compressor and indexer its compress ratio gives it; each draft layer
    that stores experts, all of them, and with `draft` (the seat speculates) every draft layer
    config.json declares or the pack holds modules of. The index only says where tensors are: a pack
    whose index was rebuilt after a shard was lost agrees with itself and misses whole modules (an
    overlay of the draft's experts lost so passed, with only a stale-layer_bits warning)."""
    n, n_exp = cfg.get("num_hidden_layers"), cfg.get("n_routed_experts")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0 or not isinstance(n_exp, int) or n_exp <= 0:
        rep.add("layer-modules", "n/a", "config.json gives no num_hidden_layers / n_routed_experts")
        return
    n_shared = cfg.get("n_shared_experts")
    cr = cfg.get("compress_ratios") if isinstance(cfg.get("compress_ratios"), list) else []
    present = _present(rep.tensors)
    sliced = {m.rsplit(".slice.", 1)[0] for m in present if ".attn.wo_a.slice." in m}
    missing: dict[str, list[str]] = defaultdict(list)  # layer prefix -> its missing modules (short names)
    for ln in range(n):
        p = f"layers.{ln}."
        need = list(_ATTN) + (list(_SHARED) if isinstance(n_shared, int) and n_shared > 0 else [])
        ratio = cr[ln] if ln < len(cr) else 0
        need += list(_COMPRESSOR) if ratio else []
        need += list(_INDEXER) if ratio == 4 else []
        # the router too: vLLM does not track missing weights of a quantized model, so a layer
        # served without its gate routes with whatever the parameter held
        missing[p] += [m for m in (*need, "ffn.gate") if p + m not in present]
        if p + "attn.wo_a" not in present and p + "attn.wo_a" not in sliced:
            missing[p].append("attn.wo_a")
        missing[p] += [f"ffn.experts.{e}.{w}" for e in range(n_exp) for w in ("w1", "w2", "w3")
                       if f"{p}ffn.experts.{e}.{w}" not in present]
    drafts = sorted({int(e.group(2)) for m in present if (e := _EXPERT.match(m)) and e.group(1) == "mtp"}
                    | (_declared_drafts(cfg, present) if draft else set()))
    for j in drafts:
        p = f"mtp.{j}."
        missing[p] += ([] if p + "ffn.gate" in present else ["ffn.gate"])
        missing[p] += [f"ffn.experts.{e}.{w}" for e in range(n_exp) for w in ("w1", "w2", "w3")
                       if f"{p}ffn.experts.{e}.{w}" not in present]
    gone = [(p, ms) for p, ms in missing.items() if ms]
    total = sum(len(ms) for _, ms in gone)
    expected = (f"{n} layers, each with {n_exp} routed experts (w1/w2/w3) and their gate, attention, wo_a"
                + (", shared experts" if isinstance(n_shared, int) and n_shared > 0 else "")
                + (" and the compressor / indexer its compress ratio gives it" if cr else ""))
    if not gone:
        rep.add("layer-modules", "ok", f"{n} layers and {len(drafts)} draft layers complete", expected)
        return

    def describe(p: str, ms: list[str]) -> str:
        experts = sum(1 for m in ms if m.startswith("ffn.experts."))
        parts = [m for m in ms if not m.startswith("ffn.experts.")]
        if experts:
            parts.append(f"all {n_exp} experts" if experts == 3 * n_exp else
                         f"{experts} expert projections ({_few([m[len('ffn.experts.'):] for m in ms if m.startswith('ffn.experts.')], 2)})")
        return f"{p.rstrip('.')}: {', '.join(parts)}"

    found = f"{total} modules missing: {_few([describe(p, ms) for p, ms in gone], 3)}"
    if rep.partial:  # a weight file is missing or unreadable: that failure explains these
        rep.add("layer-modules", "n/a", found + " (weight files missing or unreadable: files-resolve, headers)", "",
                "checked once the files are restored")
        return
    held = sorted({stray[p + m] for p, ms in gone for m in ms if p + m in stray})
    if held:
        fix = (f"the index leaves out {_few(held, 2)}, which holds them, and vLLM loads only indexed files: "
               "rebuild the index from the shard headers")
    else:
        fix = ("restore the shards that held them (re-download the pack or its overlay), then rebuild the index; "
               "served without them the layers load garbage or fail")
        if all(p.startswith("mtp.") for p, _ in gone):  # only the draft: the seat may also go without it
            fix += "; or serve without speculation (vllm.speculative_config: null)"
    rep.add("layer-modules", "fail", found, expected, fix)


# ---------------------------------------------------------------------------------------------
# weights per tensor-parallel rank

# Module paths (below layers.N. / mtp.N.) by how vLLM shards them at TP (seat-reference §6.2):
# column-parallel splits outputs, row-parallel splits inputs; wq_a, wkv, compressors and the
# indexer are ReplicatedLinear (every rank holds them whole).
_COLUMN = {"attn.wq_b", "ffn.shared_experts.w1", "ffn.shared_experts.w3"}
_ROW = {"attn.wo_b", "ffn.shared_experts.w2"}
_SPLIT_WHOLE = {"attn.wo_a", "attn.attn_sink"}  # BF16 grouped wo_a / per-head sinks: split by heads
_VOCAB = {"embed.weight", "head.weight"}  # VocabParallelEmbedding / ParallelLMHead


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _share(t: Tensor, style: str, part: str, tp: int) -> int:
    """Bytes of tensor `t` on one rank. EXL3: column-parallel splits trellis (dim 1), svh and bias
    and keeps suh whole; row-parallel splits trellis (dim 0) and suh and keeps svh (and bias)
    whole (exl3-reference §1.1 sharding rule); markers are whole everywhere."""
    if style == "whole" or part in MARKERS:
        return t.nbytes
    if part in ("suh", "su"):
        return _ceil_div(t.nbytes, tp) if style == "row" else t.nbytes
    if part in ("svh", "sv"):
        return _ceil_div(t.nbytes, tp) if style == "column" else t.nbytes
    if part == "bias" and style == "row":
        return t.nbytes
    return _ceil_div(t.nbytes, tp)


def rank_weights(tensors: dict[str, Tensor], tp: int, *, include_draft: bool = True) -> dict[str, int]:
    """Bytes of weights rank 0 holds at tensor parallelism `tp`, by category.

    Routed experts split the intermediate dim by TP (w1/w3 column-, w2 row-parallel); rank r
    loads `attn.wo_a.slice.r` only, so rank 0 counts slice 0; vision is counted split by TP (the
    tower is TP-split in vLLM dev337, seat-reference §6.1); anything unrecognised counts whole
    (an overestimate, never an under-). `include_draft=False` drops `mtp.*`, which vLLM loads only
    with speculative decoding on.
    """
    out: dict[str, int] = defaultdict(int)
    trellis_bases = {n[: -len(".trellis")] for n in tensors if n.endswith(".trellis")}
    for name, t in tensors.items():
        base, _, part = name.rpartition(".")
        is_exl3 = base in trellis_bases and part in EXL3_PARTS
        module = base if is_exl3 else (base if part in ("weight", "scale", "bias", "weight_scale_inv") else name)
        if not is_exl3:
            part = "weight"
        if name.startswith("mtp.") and not include_draft:
            continue
        e = _EXPERT.match(module)
        if e:
            cat = "draft experts" if e.group(1) == "mtp" else "routed experts"
            out[cat] += _share(t, "row" if e.group(4) == "w2" else "column", part, tp)
            continue
        m = re.match(r"^(?:layers|mtp)\.(\d+)\.(.+)$", module)
        if m:
            rest = m.group(2)
            cat = "draft dense" if module.startswith("mtp.") else (
                "shared experts" if rest.startswith("ffn.shared_experts") else "attention/other per layer")
            s = _SLICE.match(rest)
            if s:
                if int(s.group(1)) == 0:  # rank 0's own group
                    out[cat] += t.nbytes
                continue
            style = "column" if rest in _COLUMN else "row" if rest in _ROW else (
                "split" if rest in _SPLIT_WHOLE else "whole")
            out[cat] += _share(t, style, part, tp)
            continue
        if name in _VOCAB:
            out["embed/head"] += _ceil_div(t.nbytes, tp)
        elif name.startswith(("vision.", "aligner.")):
            out["vision"] += _ceil_div(t.nbytes, tp)
        else:
            out["other (whole)"] += t.nbytes
    return dict(out)
