"""The cluster-kernel variant set is written in four places; they must name the same variants.

`lna2_api.h` decides (is_cluster_variant), the binding's refusal messages list the set for the
user, `scripts/lna2_device.py` filters the device grid with its own copy, and the policy may only
name variants the binding takes. Session 17 added and retired three variants in a day; a copy left
behind shows up here instead of as a wrong refusal message or a device grid that skips a build."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from dsv4serve.lna2 import policy

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels" / "lna2"


def api_v7_constants() -> dict[str, int]:
    """lna2_api.h's V7_* constants by name."""
    api = (KERNELS / "lna2_api.h").read_text()
    return {name: int(val) for name, val in re.findall(r"\b(V7_\w+)\s*=\s*(\d+)", api)}


def api_v2_extras() -> dict[str, int]:
    """lna2_api.h's V2_*_VARIANT constants (v2-family builds past 0..6)."""
    api = (KERNELS / "lna2_api.h").read_text()
    return {name: int(val) for name, val in re.findall(r"\b(V2_\w+_VARIANT)\s*=\s*(\d+)", api)}


def api_cluster_variants() -> tuple[set[int], set[int]]:
    """is_cluster_variant's set, and the timing ablations within it."""
    api = (KERNELS / "lna2_api.h").read_text()
    consts = api_v7_constants()
    body = api[api.index("inline bool is_cluster_variant"):]
    body = body[:body.index("}")]
    named = {consts[n] for n in re.findall(r"v == (V7_\w+)", body)}
    base, count = consts["V7_ABLATION_BASE"], consts["V7_ABLATIONS"]
    assert "v >= V7_ABLATION_BASE && v < V7_ABLATION_BASE + V7_ABLATIONS" in body
    ablations = set(range(base, base + count))
    return named | ablations, ablations


def listed(message_start: str, text: str) -> set[int]:
    """The integers of the comma/'and' list that follows message_start in text."""
    tail = text[text.index(message_start) + len(message_start):]
    lst = re.match(r"([\d, and]+)", tail).group(1)
    return {int(n) for n in re.findall(r"\d+", lst)}


def test_binding_messages_name_the_api_set():
    cluster, ablations = api_cluster_variants()
    extras = api_v2_extras()
    v2_more = set(extras.values())
    api = (KERNELS / "lna2_api.h").read_text()
    known_fn = api[api.index("inline bool variant_known"):]
    known_fn = known_fn[:known_fn.index("}")]
    assert all(name in known_fn for name in extras)
    binding = (KERNELS / "bindings.cpp").read_text()
    # "variants 7, 9, ... and 31 (the cluster kernel) need ...": the non-ablation cluster builds
    assert listed('"variants ', binding) == cluster - ablations
    # "variant must be 0..4, 6, 7, ..., 31, or 10..13 / 17..19 ...": every build a user may name
    known = listed('"variant must be 0..4, ', binding)
    assert known == {6} | v2_more | (cluster - ablations)
    # "trace is recorded by variants 2, 3, 4, 6, 7, ... and 17..19 only"
    traced = listed('"trace is recorded by variants ', binding)
    assert traced == {2, 3, 4, 6} | v2_more | (cluster - ablations) | {min(ablations)}  # "17..19" reads as 17


def test_device_script_and_policy_use_the_api_set():
    cluster, _ = api_cluster_variants()
    spec = importlib.util.spec_from_file_location("lna2_device", ROOT / "scripts" / "lna2_device.py")
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    assert dev.CLUSTER_VARIANTS == cluster
    assert policy.CLUSTER_VARIANT in cluster
    assert policy.SEAT_VARIANT not in cluster
    # every variant the device script runs by default is one the binding knows, and the builds the
    # policy serves come first (a short DEADLINE still times them)
    order = [int(v) for v in dev.DEFAULT_VARIANTS.split(",")]
    assert set(order) <= cluster | {0, 1, 2, 3, 4, 6} | set(api_v2_extras().values())
    served = {policy.CLUSTER_VARIANT, policy.SEAT_VARIANT}
    assert set(order[:len(served)]) == served
    # lna2_device.sh's defaults (smoke/parity and bench) are the same list
    sh = (ROOT / "scripts" / "lna2_device.sh").read_text()
    assert sh.count(f"VARIANTS:-{dev.DEFAULT_VARIANTS}}}") == 2


def test_v7_build_table_covers_the_cluster_set_with_coherent_flags():
    """lna2_v7.cu's BUILDS7 maps each cluster variant to its template flags for pick_v7 and for the
    host's shared-memory layout. Every non-ablation cluster variant has exactly one row, and the rows
    respect what the kernel's protocols assume: one partial buffer (sb) only with the local
    finisher (fin), per-row arrivals (rg) only with one buffer, row-capped buffers (rcap) only with
    the local finisher, the relaxed arrive (rlx) only on the single buffer's split barrier."""
    cluster, ablations = api_cluster_variants()
    consts = api_v7_constants()
    src = (KERNELS / "lna2_v7.cu").read_text()
    table = src[src.index("constexpr Build7 BUILDS7[] = {"):]
    table = table[:table.index("};")]
    header = re.search(r"//\s+(bulk.*)", table).group(1).split()
    rows = re.findall(r"\{(V7_\w+),\s*([a-z, ]+)\}", table)
    variants = [consts[name] for name, _ in rows]
    assert len(variants) == len(set(variants))
    assert set(variants) == cluster - ablations
    for name, flags in rows:
        values = [v.strip() for v in flags.split(",")]
        assert len(values) == len(header) and set(values) <= {"true", "false"}, name
        f = dict(zip(header, (v == "true" for v in values)))
        if f["sb"]:
            assert f["fin"], name
        if f["rg"]:
            assert f["sb"], name
        if f["rcap"]:
            assert f["fin"], name
        if f["rlx"]:
            assert f["sb"], name
        if f["fxa"]:  # the fixed-point sum is written by the dealt epilogue
            assert f["epi"], name



def test_the_policys_ablations_are_the_apis():
    """policy.ABLATIONS keeps timing ablations out of tables, --also and the dispatch: it must be
    lna2_api.h's is_ablation set."""
    api = (KERNELS / "lna2_api.h").read_text()
    consts = {name: int(val) for name, val in re.findall(r"\b(\w*ABLATION\w*)\s*=\s*(\d+)", api)}
    want = set(range(consts["ABLATION_VARIANT_BASE"], consts["ABLATION_VARIANT_BASE"] + consts["ABLATION_VARIANTS"]))
    want |= set(range(consts["V7_ABLATION_BASE"], consts["V7_ABLATION_BASE"] + consts["V7_ABLATIONS"]))
    assert policy.ABLATIONS == want


def test_the_policys_tunable_builds_are_what_the_binding_launches():
    """An unknown build number "fits" in the binding's sizing (pick_v2 falls back) and is refused only
    at launch: a hand-edited table naming v52 passed a strict load and died on its first decode
    (helper audit). TUNABLE, with the ablations and the cooperative v0 / v1, is the binding's list."""
    binding = (KERNELS / "bindings.cpp").read_text()
    msg = re.search(r'"variant must be ([^"]*?), or ', binding).group(1)
    named: set[int] = set()
    for part in msg.split(","):
        lo, _, hi = part.strip().partition("..")
        named |= set(range(int(lo), int(hi or lo) + 1))
    assert policy.TUNABLE | {0, 1} == named and not policy.TUNABLE & policy.ABLATIONS
    assert set(policy.served(256, 4096)) | set(policy.served(2048, 4096)) <= policy.TUNABLE
