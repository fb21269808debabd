"""dsv4serve.lna2.loader.describe: is the loaded extension a build of the sources next to it?

The extension itself needs a GPU; the module below stands in for it (same lna2_build_id / limits
API). The H200 run that found the bug: check-seat warned "build b710d8a1faddf, sources are
710d8a1faddf" for a fresh build, because the build id carries build.build_tag's leading letter.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from dsv4serve.lna2 import build, loader


def _ext(build_id: str, path: str = "/x/dsv4serve_lna2.so") -> SimpleNamespace:
    """Stand-in for the compiled dsv4serve_lna2 module (needs a GPU): its describe()-facing API."""
    return SimpleNamespace(__file__=path, lna2_build_id=lambda: build_id,
                           lna2_moe_max_rows=lambda: 32, lna2_moe_scratch_bytes=lambda h, i: 1 << 20)


def test_a_build_of_these_sources_is_not_stale(monkeypatch):
    monkeypatch.setattr(loader, "load", lambda: _ext(build.build_tag(build.source_digest())))
    info = loader.describe()
    assert info["loadable"] and info["stale"] is False
    assert info["build_id"] == info["source_build_id"] == "b" + build.source_digest()


def test_a_build_of_other_sources_is_stale(monkeypatch):
    monkeypatch.setattr(loader, "load", lambda: _ext(build.build_tag("0123456789ab")))
    assert loader.describe()["stale"] is True


def test_the_build_metadata_is_the_loaded_modules_own(monkeypatch, tmp_path):
    """check-seat's arch row reads `built`: it must describe the module that loaded (which
    DSV4SERVE_LNA2_EXT may put elsewhere than the default build), never another build's file."""
    import json

    so = tmp_path / "custom" / f"{build.MODULE}.so"
    so.parent.mkdir()
    default = tmp_path / "default"
    default.mkdir()
    (default / f"{build.MODULE}.json").write_text(json.dumps({"build_id": "0123456789ab", "arch": "9.0;12.0"}))
    monkeypatch.setattr(loader, "default_out", lambda: default)
    monkeypatch.setattr(loader, "load", lambda: _ext("bfeedfacecafe", str(so)))
    assert "built" not in loader.describe()  # none beside the module: not the default build's
    so.with_suffix(".json").write_text(json.dumps({"build_id": "feedfacecafe", "arch": "12.0"}))
    assert loader.describe()["built"]["arch"] == "12.0"
    so.with_suffix(".json").write_text(json.dumps({"build_id": "0123456789ab", "arch": "9.0"}))
    assert loader.describe()["built"] == f"{so.with_suffix('.json')} describes another build"


@pytest.mark.parametrize("kw, words", [
    ({"arch": "x"}, "--arch: 'x' is not a compute capability like 9.0 or 12.0"),
    ({"arch": " ; "}, "--arch ' ; ' names no architecture"),
    ({"out": "FILE"}, "is a file, not a directory"),
    ({"arch": "-1.0"}, "--arch: '-1.0' is not a compute capability"),
    ({"arch": "99999.0"}, "--arch: '99999.0' is not a compute capability"),
    ({"arch": "\uff19.\uff10"}, "is not a compute capability"),  # full-width digits: int() reads them, nvcc not
    ({"arch": "9.0aa"}, "--arch: '9.0aa' is not a compute capability"),
    ({"jobs": -5}, "--jobs -5 must be 0 (all cores) or more"),
    ({"arch": "13.0"}, "--arch: '13.0' is not a compute capability"),  # nvcc 13 builds to 12.x; torch refuses it
    ({"max_rows": 0}, "--max-rows 0 must be 1..32"),
    ({"max_rows": 33}, "--max-rows 33 must be 1..32 (the route plan keeps a 32-bit row mask per expert)"),
    # nvcc 13 builds no 9.2 / 5.0: the build failed minutes later with "ninja: subcommand failed" (audit)
    ({"arch": "9.0;9.2"}, "--arch: this nvcc does not build 9.2 (it builds "),
    # lna2 needs clusters and mbarriers: nvcc failed on them minutes in for 8.0 (helper audit)
    ({"arch": "5.0"}, "--arch: lna2 needs compute capability 9.0 or newer"),
    ({"arch": "8.0;12.0"}, "--arch: lna2 needs compute capability 9.0 or newer (thread-block clusters, mbarriers), not 8.0"),
    ({"out": "UNDER_FILE"}, "cannot be made: "),
])
def test_build_refuses_its_own_bad_arguments_before_anything_else(tmp_path, kw, words):
    """On this CPU machine the build would refuse torch; a bad --arch or --out must be said first
    (else fixing torch leads to a second refusal), and nothing is created."""
    from dsv4serve.errors import BadInput

    if "this nvcc" in words and build.nvcc_archs() is None:
        pytest.skip("no nvcc here to ask which archs it builds (the machine CI runs on has nvcc 13)")

    if kw.get("out") == "FILE":
        (tmp_path / "f").write_text("")
        kw = {"out": tmp_path / "f"}
    if kw.get("out") == "UNDER_FILE":
        (tmp_path / "f").write_text("")
        kw = {"out": tmp_path / "f" / "sub"}
    with pytest.raises(BadInput) as e:
        build.build(**{"out": tmp_path / "out", **kw})
    assert words in e.value.message
    assert not (tmp_path / "out").exists()


def test_a_lower_row_ceiling_is_compiled_in_and_the_default_is_the_headers():
    import re as _re

    from dsv4serve.resources import kernels_dir

    header = (kernels_dir() / "lna2_api.h").read_text()
    assert int(_re.search(r"#define LNA2_MAX_ROWS (\d+)", header).group(1)) == build.MAX_ROWS_DEFAULT
    assert build.defines("abc") == ["-DLNA2_BUILD_TAG=babc"]
    assert build.defines("abc", 16) == ["-DLNA2_BUILD_TAG=babcr16", "-DLNA2_MAX_ROWS=16"]


def test_a_builds_row_ceiling_is_part_of_its_id(monkeypatch, tmp_path):
    """The ceiling sizes shared memory, so which builds fit two blocks an SM: a tuning table timed on
    a ceiling-16 build passed for a ceiling-32 build of the same sources, whose id was the same
    (helper audit). The id now carries a ceiling other than the default; it is still not stale."""
    import json

    d = build.source_digest()
    assert build.build_tag(d) == f"b{d}" and build.build_tag(d, 16) == f"b{d}r16" and build.build_tag(d, None) == f"b{d}"
    monkeypatch.setattr(loader, "load", lambda: SimpleNamespace(**{**vars(_ext(build.build_tag(d, 16))),
                                                                   "lna2_moe_max_rows": lambda: 16}))
    info = loader.describe()
    assert info["build_id"] == f"b{d}r16" and info["stale"] is False
    so = tmp_path / f"{build.MODULE}.so"
    so.write_bytes(b"\x7fELF")
    so.with_suffix(".json").write_text(json.dumps({"build_id": d, "max_rows": 16}))
    assert loader.describe_file(so)["build_id"] == f"b{d}r16" and loader.describe_file(so)["stale"] is False
    from tests.test_lna2_tuning import measured

    # a ceiling-16 build made before the ceiling was part of the id reports b<digest>: stale (review)
    monkeypatch.setattr(loader, "load", lambda: SimpleNamespace(**{**vars(_ext(f"b{d}")), "lna2_moe_max_rows": lambda: 16}))
    assert loader.describe()["stale"] is True
    table = measured({"K2/mcg": {1: 26}}, build_id=f"b{d}r16")
    assert "this extension is build b" in table.mismatch(table.device, table.sm_count, f"b{d}")
    assert table.mismatch(table.device, table.sm_count, f"b{d}r16") is None


def test_arch_lists_are_normalised_as_torch_takes_them():
    """TORCH_CUDA_ARCH_LIST refuses an empty or padded entry ("Unknown CUDA arch ()"): the build
    hands torch the entries it checked."""
    assert build.arch_list(" 9.0 ;; 12.0, ") == ["9.0", "12.0"]
    assert build.arch_list("9.0a;12.0+PTX") == ["9.0a", "12.0+PTX"]
    assert build.arch_flags("9.0, 12.0")[-2:] == ["-gencode", "arch=compute_120,code=compute_120"]


def test_a_file_that_does_not_load_is_not_called_unbuilt(monkeypatch, tmp_path):
    """A truncated or foreign .so where the build goes is there: the error names it and what the
    loader said, not "not built", which would send the user looking for a build that exists."""
    out = tmp_path / "out"
    out.mkdir()
    so = out / f"{build.MODULE}.so"
    so.write_bytes(b"\x7fELF truncated")
    monkeypatch.delenv("DSV4SERVE_LNA2_EXT", raising=False)
    monkeypatch.setattr(loader, "default_out", lambda: out)
    monkeypatch.setattr(loader, "_loaded", None)
    with pytest.raises(RuntimeError) as e:
        loader.load()
    text = str(e.value)
    assert text.startswith(f"extension does not load ({so} (") and "\n" not in text
    assert text.endswith("rebuild it with `dsv4serve kernel build`")
    so.unlink()
    with pytest.raises(RuntimeError, match=r"^extension not built \(.*\(missing\)\)"):
        loader.load()


def test_a_module_on_sys_path_that_does_not_load_says_why(monkeypatch, tmp_path):
    """The last resort, a module mounted into site-packages, swallowed its ImportError and said "not
    built" with the default path: a container whose mounted build was made for another Python looked
    unbuilt, and rebuilding on the host changed nothing (docker audit)."""
    sp = tmp_path / "site"
    sp.mkdir()
    (sp / f"{build.MODULE}.so").write_bytes(b"\x7fELF too short")
    monkeypatch.syspath_prepend(str(sp))
    monkeypatch.delenv("DSV4SERVE_LNA2_EXT", raising=False)
    monkeypatch.setattr(loader, "default_out", lambda: tmp_path / "nowhere")
    monkeypatch.setattr(loader, "_loaded", None)
    monkeypatch.delitem(sys.modules, build.MODULE, raising=False)
    with pytest.raises(RuntimeError) as e:
        loader.load()
    text = str(e.value)
    assert text.startswith("extension does not load (") and f"{sp / build.MODULE}.so" in text, text
    assert "on sys.path" in text and "not built" not in text


def test_the_build_dsv4serve_lna2_ext_names_is_the_only_one_loaded(monkeypatch, tmp_path):
    """A typo or a broken copy in DSV4SERVE_LNA2_EXT used to fall back to the default build (or an
    importable module) without a word: lna2 then ran a build nobody asked for."""
    default = tmp_path / "default"
    default.mkdir()
    (default / f"{build.MODULE}.so").write_bytes(b"\x7fELF default")  # would be tried by a fallback
    monkeypatch.setattr(loader, "default_out", lambda: default)
    monkeypatch.setattr(loader, "_loaded", None)
    tried = []
    real = loader.importlib.import_module
    monkeypatch.setattr(loader.importlib, "import_module", lambda name: tried.append(name) or real(name))
    for target, words in ((tmp_path / "typo.so", "(missing)"), (tmp_path, "(not a file)")):
        monkeypatch.setenv("DSV4SERVE_LNA2_EXT", str(target))
        with pytest.raises(RuntimeError) as e:
            loader.load()
        text = str(e.value)
        assert text.startswith(f"DSV4SERVE_LNA2_EXT names {target} {words}") and "unset it" in text, text
        assert str(default) not in text
    assert build.MODULE not in tried
    # a module there that does not load: a docker seat's launcher set the variable to its mount, so
    # "unset it" is no advice; the build is for another Python or torch (review)
    broken = tmp_path / "other-python.so"
    broken.write_bytes(b"\x7fELF too short")
    monkeypatch.setenv("DSV4SERVE_LNA2_EXT", str(broken))
    with pytest.raises(RuntimeError) as e:
        loader.load()
    text = str(e.value)
    assert "which does not load here: rebuild it with this interpreter and torch" in text and "unset" not in text


def test_a_build_without_a_function_these_sources_call_is_not_loadable(monkeypatch):
    """An older build lacking lna2_moe_scratch_bytes crashed `kernel info` with an AttributeError."""
    old = SimpleNamespace(__file__="/x/dsv4serve_lna2.so", lna2_build_id=lambda: "b0123456789ab",
                          lna2_moe_max_rows=lambda: 32)
    monkeypatch.setattr(loader, "load", lambda: old)
    info = loader.describe()
    assert info["loadable"] is False
    assert info["error"] == ("/x/dsv4serve_lna2.so lacks lna2_moe_scratch_bytes: a build of other sources; "
                             "rebuild it with `dsv4serve kernel build`")


def test_a_directory_where_the_build_goes_is_not_called_missing(monkeypatch, tmp_path):
    so = tmp_path / f"{build.MODULE}.so"
    so.mkdir()
    monkeypatch.delenv("DSV4SERVE_LNA2_EXT", raising=False)
    monkeypatch.setattr(loader, "default_out", lambda: tmp_path)
    monkeypatch.setattr(loader, "_loaded", None)
    with pytest.raises(RuntimeError, match=rf"^extension does not load \({so} \(not a file\)\)"):
        loader.load()


def test_the_built_module_is_installed_whole_executable_and_without_temp_files(tmp_path):
    """The copy into --out goes by a temp name of its own and a rename (a real file stands in for
    the compiled .so: the copy does not care what it holds)."""
    built = tmp_path / "build" / "dsv4serve_lna2.cpython-311-x86_64-linux-gnu.so"
    built.parent.mkdir()
    built.write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    out = tmp_path / "out"
    out.mkdir()
    (out / "dsv4serve_lna2.so").write_bytes(b"an older build")
    target = build.install_so(built, out)
    assert target == out / "dsv4serve_lna2.so" and target.read_bytes() == built.read_bytes()
    assert target.stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in out.iterdir()) == ["dsv4serve_lna2.so"]


def test_kernel_info_without_a_build_is_one_line_per_field_even_piped(tmp_path):
    """The error field holds a path; at 80 columns it was cut over two lines."""
    from .conftest import cli

    r = cli("kernel", "info", home=tmp_path / "home", timeout=120, env_extra={"COLUMNS": "80"})
    assert r.returncode == 1
    err = [ln for ln in r.stdout.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and err[0].endswith("run `dsv4serve kernel build`"), r.stdout
    assert all(": " in ln for ln in r.stdout.splitlines()), r.stdout


def test_a_torch_lock_left_by_a_killed_build_does_not_hang_the_next(tmp_path):
    """torch's JIT waits forever on a `lock` file in the build directory; a build killed by SIGTERM
    leaves it, and every later build hung without a word (audit). Every build holds dsv4serve's own
    lock on --out, so a torch lock found under it is a leftover."""
    out, bdir = tmp_path / "out", tmp_path / "out" / "build-x"
    bdir.mkdir(parents=True)
    (bdir / "lock").write_text("")
    with build._build_lock(out, bdir):
        assert not (bdir / "lock").exists()
    from filelock import FileLock

    with FileLock(str(out / ".build.lock")):  # another build of this --out running
        build.BUILD_LOCK_TIMEOUT_S, saved = 0.2, build.BUILD_LOCK_TIMEOUT_S
        try:
            from dsv4serve.errors import JobFailed

            with pytest.raises(JobFailed, match="another lna2 build of"):
                with build._build_lock(out, bdir):
                    pass
        finally:
            build.BUILD_LOCK_TIMEOUT_S = saved


def test_a_failed_build_keeps_the_compilers_output_and_says_its_first_error(tmp_path):
    """torch puts the compiler's output in the exception and writes no log; the message kept only
    ninja's last line and pointed at a log that did not exist (audit). The stand-ins are for torch's
    JIT `load` and the torch module, which a CPU machine cannot build with."""
    from dsv4serve.errors import JobFailed

    def load(**kw):
        raise RuntimeError("Error building extension 'dsv4serve_lna2': [1/3] nvcc ...\n"
                           "lna2_moe.cu(12): error: identifier \"foo\" is undefined\n"
                           "ninja: build stopped: subcommand failed.")

    out, bdir = tmp_path / "out", tmp_path / "out" / "build-x"
    bdir.mkdir(parents=True)
    with pytest.raises(JobFailed) as e:
        build._build_locked("9.0", out, bdir, "abc", [], None, False, 32, tmp_path, SimpleNamespace(), load)
    assert e.value.message == 'lna2 build failed: lna2_moe.cu(12): error: identifier "foo" is undefined'
    assert str(bdir / "build.log") in e.value.hint and "subcommand failed" in (bdir / "build.log").read_text()


def test_a_metadata_write_that_fails_leaves_no_other_builds_description(monkeypatch, tmp_path):
    """The new .so was installed, then the metadata write failed (a full disk): the old build's JSON
    stayed beside it, describing it with another id, arch and ceiling (helper audit). Stand-ins for
    torch's JIT `load` and the torch module, which a CPU machine cannot build with."""
    import json

    out, bdir = tmp_path / "out", tmp_path / "out" / "build-x"
    bdir.mkdir(parents=True)
    (out / f"{build.MODULE}.json").write_text(json.dumps({"build_id": "0123456789ab", "arch": "12.0", "max_rows": 32}))

    def load(**kw):
        (bdir / f"{build.MODULE}.so").write_bytes(b"\x7fELF new")

    real = build.atomic_write

    def full(path, data, mode=None):
        if ".json" in str(path):  # the description, staged or in place
            raise OSError(28, "No space left on device", str(path))
        return real(path, data, mode)

    monkeypatch.setattr(build, "atomic_write", full)
    torch_ = SimpleNamespace(__version__="2.13.0", version=SimpleNamespace(cuda="13.0"))
    (out / f"{build.MODULE}.so").write_bytes(b"\x7fELF old")
    with pytest.raises(OSError):
        build._build_locked("9.0", out, bdir, "abcdef012345", [], None, False, 32, tmp_path, torch_, load)
    # the old build stays whole, with its own description
    assert (out / f"{build.MODULE}.so").read_bytes() == b"\x7fELF old"
    assert json.loads((out / f"{build.MODULE}.json").read_text())["build_id"] == "0123456789ab"
    # and a copy of the .so that fails (ENOSPC in the copy) takes the old description with it nowhere
    monkeypatch.setattr(build, "atomic_write", real)

    def no_space(src, dst, *a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(build.shutil, "copyfileobj", no_space)
    with pytest.raises(OSError):
        build._build_locked("9.0", out, bdir, "abcdef012345", [], None, False, 32, tmp_path, torch_, load)
    assert (out / f"{build.MODULE}.so").read_bytes() == b"\x7fELF old"
    assert json.loads((out / f"{build.MODULE}.json").read_text())["build_id"] == "0123456789ab"
    assert sorted(p.name for p in out.iterdir()) == ["build-x", f"{build.MODULE}.json", f"{build.MODULE}.so"]
    monkeypatch.undo()
    build._build_locked("9.0", out, bdir, "abcdef012345", [], None, False, 32, tmp_path, torch_, load)
    assert (out / f"{build.MODULE}.so").read_bytes() == b"\x7fELF new"
    meta = json.loads((out / f"{build.MODULE}.json").read_text())
    assert meta["build_id"] == "abcdef012345"
    # what a docker seat's check compares with the image it mounts the build into
    assert meta["torch"] == "2.13.0" and meta["python"] == f"{sys.version_info[0]}.{sys.version_info[1]}"


def test_metadata_this_user_cannot_read_is_said_not_raised(monkeypatch, tmp_path):
    """The metadata was written 0600 beside a 0755 .so: another user's `kernel info` failed whole
    with PermissionError (audit). It is written 0644 now, and an unreadable one is said."""
    import json
    from pathlib import Path as _P

    so = tmp_path / f"{build.MODULE}.so"
    so.write_bytes(b"\x7fELF")
    meta = so.with_suffix(".json")
    meta.write_text(json.dumps({"build_id": "abc", "max_rows": 32}))
    real = _P.read_text

    def denied(self, *a, **kw):
        if self == meta:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(_P, "read_text", denied)
    info = loader.describe_file(so)
    assert info["loadable"] is False and info.get("built") == "unreadable metadata"


def test_a_broken_module_is_not_described_by_the_default_builds_metadata(monkeypatch, tmp_path):
    """DSV4SERVE_LNA2_EXT naming a broken file showed the default build's metadata under it (audit)."""
    import json

    default = tmp_path / "default"
    default.mkdir()
    (default / f"{build.MODULE}.json").write_text(json.dumps({"build_id": "0123456789ab"}))
    other = tmp_path / "other.so"
    other.write_bytes(b"junk")
    monkeypatch.setattr(loader, "default_out", lambda: default)
    monkeypatch.setenv(loader.ENV, str(other))

    def broken():
        raise RuntimeError("DSV4SERVE_LNA2_EXT names other.so (file too short)")

    monkeypatch.setattr(loader, "load", broken)
    assert "built" not in loader.describe()
    other.with_suffix(".json").write_text(json.dumps({"build_id": "feedfacecafe"}))
    assert loader.describe()["built"]["build_id"] == "feedfacecafe"


def test_save_tuning_refuses_a_path_that_is_not_a_regular_file(tmp_path):
    """The table is renamed over its path: a FIFO (or /dev/stdout's link, as root) was accepted and
    later replaced by a regular file (audit)."""
    import os

    from dsv4serve.errors import BadInput
    from dsv4serve.lna2 import selfcheck

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(BadInput, match="is not a regular file"):
        selfcheck.tuning_target(fifo, True)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "t.json")
    with pytest.raises(BadInput, match="is not a regular file"):
        selfcheck.tuning_target(link, True)
    selfcheck.tuning_target(tmp_path / "t.json", True)  # a new file is fine


def test_the_arch_check_takes_ptx_and_arch_specific_entries_and_asks_torchs_nvcc(monkeypatch, tmp_path):
    """'12.0+PTX' was refused ('120+PTX' is no compute_ number), and the check asked the PATH's nvcc
    where torch builds with CUDA_HOME's (review). The nvcc here is a stand-in script."""
    fake = tmp_path / "cuda" / "bin" / "nvcc"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\nprintf 'compute_90\\ncompute_120\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.delenv("PYTORCH_NVCC", raising=False)
    assert build.nvcc_archs() == {"90", "120"}
    build.check_archs("9.0a;12.0+PTX;12.0a+PTX")
    from dsv4serve.errors import BadInput

    with pytest.raises(BadInput, match=r"does not build 10\.0 \(it builds 9\.0, 12\.0\)"):
        build.check_archs("10.0;12.0")
    build.check_archs("09.0")  # the major as a number: nvcc's 90, not "090"


def test_kernel_info_with_the_ext_variable_naming_the_root_is_not_a_traceback(monkeypatch):
    monkeypatch.setenv(loader.ENV, "/")
    info = loader.describe()
    assert info["loadable"] is False and "DSV4SERVE_LNA2_EXT names /" in info["error"]


def test_kernel_info_fails_for_a_build_this_gpu_cannot_run(monkeypatch):
    """`kernel info` exited 0 for a build that loads but has no kernel image for this GPU (its
    device_error said so) (helper audit)."""
    from typer.testing import CliRunner

    from dsv4serve.cli import app

    monkeypatch.setattr(loader, "describe", lambda: {"loadable": True, "build_id": "b1",
                                                     "device_error": "no kernel image is available"})
    assert CliRunner().invoke(app, ["kernel", "info"]).exit_code == 1
    monkeypatch.setattr(loader, "describe", lambda: {"loadable": True, "build_id": "b1"})
    assert CliRunner().invoke(app, ["kernel", "info"]).exit_code == 0
