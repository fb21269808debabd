"""scripts/sass_diff.py on synthetic `cuobjdump -sass` listings (no CUDA tools needed): kernels are
matched per arch by demangled name, addresses and encodings do not count, a flag appended with its
default matches the kernel it extends, and only DIFF / GONE fail."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("sass_diff", ROOT / "scripts" / "sass_diff.py")
sass_diff = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_diff)

# lna2::(anonymous namespace)::moe_decode_v2<3, 2, false, 3, 0, false>(lna2::Args), as nvcc mangles it
# in one file (the namespace hash is per file), and the same kernel with a flag appended (..., false>)
OLD_K = "_ZN4lna243_GLOBAL__N__8e856bf6_10_lna2_v2_cu_efeeb6ac13moe_decode_v2ILi3ELi2ELb0ELi3ELi0ELb0EEEvNS_4ArgsE"
NEW_K = "_ZN4lna243_GLOBAL__N__11111111_10_lna2_v2_cu_2222222213moe_decode_v2ILi3ELi2ELb0ELi3ELi0ELb0ELb0EEEvNS_4ArgsE"
OLD_B = "_ZN4lna243_GLOBAL__N__8e856bf6_10_lna2_v2_cu_efeeb6ac13moe_decode_v2ILi2ELi1ELb1ELi2ELi0ELb1EEEvNS_4ArgsE"
NEW_B = "_ZN4lna243_GLOBAL__N__11111111_10_lna2_v2_cu_2222222213moe_decode_v2ILi2ELi1ELb1ELi2ELi0ELb1ELb0EEEvNS_4ArgsE"
NEW_ONLY = "_ZN4lna243_GLOBAL__N__11111111_10_lna2_v2_cu_2222222213moe_decode_v2ILi2ELi1ELb1ELi2ELi0ELb1ELb1EEEvNS_4ArgsE"


def listing(arch_funcs):
    out = ["", "Fatbin elf code:", "================"]
    for arch, funcs in arch_funcs:
        out += [f"arch = {arch}", "code version = [1,8]", f"\tcode for {arch}"]
        for name, body in funcs:
            out.append(f"\t\tFunction : {name}")
            for i, ins in enumerate(body):
                out.append(f"        /*{i * 16:04x}*/                   {ins} ;      /* 0x{i:016x} */")
                out.append("                                                     /* 0x000fe20000000a00 */")
    return "\n".join(out) + "\n"


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="c++filt (binutils) demangles the kernel names")
def test_kernels_match_by_demangled_name_and_appended_default_flags(tmp_path, capsys):
    body = ["LDC R1, c[0x0][0x28]", "S2R R8, SR_TID.X", "EXIT"]
    changed = ["LDC R1, c[0x0][0x28]", "S2R R9, SR_TID.X", "EXIT"]
    old = tmp_path / "old.sass"
    new = tmp_path / "new.sass"
    old.write_text(listing([("sm_90", [(OLD_K, body), (OLD_B, body)]), ("sm_120", [(OLD_K, body)])]))
    # sm_90: K unchanged under its new name, B changed, one new kernel; sm_120: K gone
    new.write_text(listing([("sm_90", [(NEW_K, body), (NEW_B, changed), (NEW_ONLY, body)]), ("sm_120", [])]))
    rows = sass_diff.compare(sass_diff.readable(sass_diff.parse(old.read_text())),
                             sass_diff.readable(sass_diff.parse(new.read_text())))
    by = {(s, a) for s, a, _ in rows}
    assert [r[0] for r in rows].count("same") == 1 and ("same", "sm_90") in by
    assert [r for r in rows if r[0] == "DIFF"][0][2].startswith("void lna2::(anonymous namespace)::moe_decode_v2<2, 1")
    assert ("NEW", "sm_90") in by and ("GONE", "sm_120") in by
    assert sass_diff.main([str(old), str(new)]) == 1  # a DIFF and a GONE fail
    out = capsys.readouterr().out
    assert "same 1, DIFF 1, NEW 1, GONE 1" in out
    assert sass_diff.main([str(old), str(old)]) == 0


def test_addresses_and_encodings_do_not_count_but_instructions_do():
    a = listing([("sm_90", [(OLD_K, ["IADD3 R1, R1, -0x98, RZ", "EXIT"])])])
    b = a.replace("/* 0x0000000000000000 */", "/* 0xffffffffffffffff */")
    assert sass_diff.parse(a) == sass_diff.parse(b)
    c = a.replace("-0x98", "-0x90")
    assert sass_diff.parse(a) != sass_diff.parse(c)
    # offsets past 0xffff (kernels over 4096 instructions) are still instructions
    big = a.replace("/*0010*/", "/*10010*/")
    assert len(next(iter(sass_diff.parse(big).values()))) == 2
