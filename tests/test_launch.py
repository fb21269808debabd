"""Launch assembly: profile -> argv/env, and the refusals before anything starts."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from dsv4serve import launch
from dsv4serve.errors import ProfileError
from dsv4serve.profile import load_profile

from tests.test_profile import CANON_ENV


def build(name, *overrides, tmp=Path("/tmp/dsv4serve-test-run")):
    return launch.build(load_profile(name, list(overrides)), run_id="r1", run_dir=tmp)


def flag_value(argv, flag):
    i = argv.index(flag)
    return argv[i + 1]


def test_canon_docker_argv_holds_every_flag_and_env():
    spec = build("8x16gb-380k")
    a = spec.argv
    assert a[:2] == ["docker", "run"]
    assert flag_value(a, "--gpus") == '"device=0,1,2,3,5,7,8,9"'
    assert "--ipc=host" in a and "--shm-size=16g" in a and "--cap-add=SYS_PTRACE" in a
    assert flag_value(a, "--ulimit") == "core=0"
    assert flag_value(a, "-p") == "127.0.0.1:8899:8000"
    envs = {a[i + 1].split("=", 1)[0]: a[i + 1].split("=", 1)[1] for i, x in enumerate(a) if x == "-e"}
    for k, v in CANON_ENV.items():
        assert envs[k] == v
    assert envs["DSV4SERVE_RUN_ID"] == "r1" and envs["DSV4SERVE_MOE_KERNEL"] == "lna2"
    image = a.index("lna-lab/vllm-exl3:dsv4-dense")
    v = a[image + 1:]
    assert v[0] == "/data/models/DSV4-Flash-Vision-EXL3-MixedK-D2-K2x3-Dense6"
    for flag, val in [("--served-model-name", "DSV4-Flash"), ("--tensor-parallel-size", "8"),
                      ("--quantization", "exl3"), ("--max-model-len", "389120"), ("--max-num-seqs", "4"),
                      ("--max-num-batched-tokens", "512"), ("--kv-cache-dtype", "fp8"),
                      ("--gpu-memory-utilization", "0.97"), ("--tool-call-parser", "deepseek_v4"),
                      ("--reasoning-parser", "deepseek_v4"), ("--host", "0.0.0.0"), ("--port", "8000")]:
        assert flag_value(v, flag) == val, flag
    assert json.loads(flag_value(v, "--compilation-config")) == {"cudagraph_capture_sizes": [1, 2, 4]}
    assert json.loads(flag_value(v, "--speculative-config")) == {"method": "dspark", "num_speculative_tokens": 3}
    for f in ("--disable-custom-all-reduce", "--trust-remote-code", "--enable-auto-tool-choice"):
        assert f in v
    vols = [a[i + 1] for i, x in enumerate(a) if x == "-v"]
    assert any(m.endswith(":/lab/exl3-tune-cache") for m in vols)
    assert any("/dist-packages/dsv4serve:ro" in m for m in vols)          # our plugin
    assert any(m.endswith("/dist-packages/dsv4serve_lna2.so:ro") for m in vols)  # the lna2 extension
    # ... and the loader in the image loads that file alone, so its own load error is what it reports
    assert envs["DSV4SERVE_LNA2_EXT"] == "/usr/local/lib/python3.12/dist-packages/dsv4serve_lna2.so"
    inc = build("cpu-demo", "runtime.kind=docker", "runtime.image=x/y:z").argv  # an incumbent docker seat
    assert not any(inc[i + 1].startswith("DSV4SERVE_LNA2_EXT=") for i, x in enumerate(inc) if x == "-e")
    # the shell rendering round-trips
    assert shlex.split(spec.shell()) == spec.argv
    # no rebuilt exllamav3 extension named: the image's own module runs (check-seat warns)
    assert not any("exllamav3_ext" in m for m in vols)


def test_a_rebuilt_exllamav3_extension_is_mounted_over_the_images_module():
    so = "{cache}/exl3/exllamav3_ext.cpython-312-x86_64-linux-gnu.so"
    a = build("8x16gb-380k", f"runtime.exl3_extension={so}").argv
    vols = [a[i + 1] for i, x in enumerate(a) if x == "-v"]
    want = "/usr/local/lib/python3.12/dist-packages/exllamav3_ext.cpython-312-x86_64-linux-gnu.so:ro"
    (m,) = [m for m in vols if "exllamav3_ext" in m]
    assert m.endswith(":" + want) and "{cache}" not in m, m
    with pytest.raises(ProfileError, match="runtime.exl3_extension: must be a path to exllamav3_ext"):
        build("8x16gb-380k", "runtime.exl3_extension=/x/exllamav3.so")
    with pytest.raises(ProfileError, match="a native seat imports the installed exllamav3"):
        build("cpu-demo", f"runtime.exl3_extension={so}")


def test_native_demo_argv_uses_this_interpreter():
    spec = build("cpu-demo")
    assert spec.argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert flag_value(spec.argv, "--tensor-parallel-size") == "2"
    assert "--enforce-eager" in spec.argv
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert spec.env["DSV4SERVE_RUN_DIR"] == "/tmp/dsv4serve-test-run"
    assert spec.env["VLLM_CACHE_ROOT"].endswith("/cache/vllm")   # placeholder expanded


@pytest.mark.parametrize("overrides, needle", [
    (["vllm.max_num_seqs=8"], "vllm.max_num_seqs: 8 x (1 + 3 speculative) = 32 decode rows exceed the lna2 row ceiling 24"),
    (["vllm.tensor_parallel_size=4", "gpus.ids=[0,1,2,3]"], "wo_a"),
    (["gpus.ids=[0,1,2]"], "gpus.ids lists 3 GPUs"),
    (["vllm.host=0.0.0.0"], "vllm.host 0.0.0.0"),
    # the image's own lna2 path beneath dsv4serve's: what lna2 hands back and checks against (audit)
    (["env.VLLM_EXL3_MOE_KERNEL=lna2"], "env.VLLM_EXL3_MOE_KERNEL=lna2 puts the image's own kernel beneath "
                                        "dsv4serve's lna2, where the incumbent exl3_moe must be"),
    (["env.VLLM_EXL3_MOE_STRICT=2"], "moe.strict is 1"),
    (["env.LNA_DSV4_AUX_STREAMS=1"], "LNA_DSV4_AUX_STREAMS must be 0"),
    (["env.VLLM_DISABLE_SHARED_EXPERTS_STREAM=0"], "VLLM_DISABLE_SHARED_EXPERTS_STREAM must be 1"),
    # a kernel that never prints the proof the inherited gates wait for
    (["moe.kernel=incumbent", "env.VLLM_EXL3_MOE_KERNEL=null"],
     "gates wait for 'LNA2 MoE kernel ACTIVE rank=' but moe.kernel is incumbent, which never prints it; drop that "
     "gates.markers entry"),
    # no --gpus: the container would see no GPU
    (["gpus.ids=[]"], "a docker seat of quantization exl3 needs gpus.ids (the container is given only those GPUs); "
                      "set gpus.ids to the 8"),
    (["env.CUDA_VISIBLE_DEVICES=0,1"], "env.CUDA_VISIBLE_DEVICES would override the seat's GPUs"),
    (["env.NVIDIA_VISIBLE_DEVICES=all"], "drop env.NVIDIA_VISIBLE_DEVICES and set gpus.ids"),
    (["gpus.ids=[0,1,2,3,5,7,8,8]"], "repeats GPU 8; list each GPU once"),
])
def test_refusals_name_the_key_and_fix(overrides, needle):
    with pytest.raises(ProfileError) as e:
        build("8x16gb-380k", *overrides)
    assert needle in e.value.line() and "\n" not in e.value.line()


def test_a_docker_seat_of_a_cpu_image_lists_no_gpus():
    """gpus.ids empty is a CPU seat (a vLLM CPU image): no --gpus, and no refusal."""
    spec = build("cpu-demo", "runtime.kind=docker", "runtime.image=vllm/vllm-openai:cpu")
    assert "--gpus" not in spec.argv


def test_row_ceiling_refusal_suggests_a_fit():
    with pytest.raises(ProfileError) as e:
        build("8x16gb-380k", "vllm.max_num_seqs=8")
    assert "vllm.max_num_seqs <= 6" in e.value.line()


def test_public_host_needs_opt_in():
    spec = build("cpu-demo", "vllm.host=0.0.0.0", "vllm.allow_public_host=true")
    assert flag_value(spec.argv, "--host") == "0.0.0.0"
    assert "--allow-public-host" not in spec.argv


def test_unknown_placeholder_is_refused():
    with pytest.raises(ProfileError, match=r"unknown placeholder \{nope\}"):
        build("cpu-demo", "env.X={nope}/y")


def test_incumbent_profile_needs_no_lna2_env():
    spec = build("8x16gb-380k-incumbent")
    envs = [spec.argv[i + 1] for i, x in enumerate(spec.argv) if x == "-e"]
    assert not any(e.startswith("VLLM_EXL3_MOE_KERNEL=") for e in envs)
    assert not any("dsv4serve_lna2.so" in x for x in spec.argv)


SP = "/usr/local/lib/python3.12/dist-packages"
PATCHED = ["vllm/models/deepseek_v4/attention.py", "vllm/models/deepseek_v4/nvidia/mtp.py",
           "exllamav3/modules/quant/exl3.py", "exllamav3/exllamav3_ext/quant/exl3_gemm.cu"]


def volumes(argv):
    return [argv[i + 1] for i, x in enumerate(argv) if x == "-v"]


def test_docker_mounts_each_patched_file_read_only_from_patch_root(tmp_path):
    from dsv4serve import patches

    root = tmp_path / "image-site-packages"
    spec = build("8x16gb-380k", f"runtime.patch_root={root}")
    vols = volumes(spec.argv)
    for rel in PATCHED:
        assert f"{root}/{rel}:{SP}/{rel}:ro" in vols, rel
    every = [f.path for s in ("exllamav3-1.4.5", "vllm-0.28.0") for f in patches.load_set(s).files]
    assert sum(v.startswith(f"{root}/") for v in vols) == len(set(every))  # each file once, nothing else
    # the site-packages path is the profile's
    moved = build("8x16gb-380k", f"runtime.patch_root={root}", "runtime.site_packages=/opt/sp/")
    assert f"{root}/{PATCHED[0]}:/opt/sp/{PATCHED[0]}:ro" in volumes(moved.argv)


def test_no_patch_root_or_no_sets_mounts_no_patched_files(tmp_path):
    assert not [v for v in volumes(build("8x16gb-380k").argv) if "/vllm/models/" in v]
    bare = build("8x16gb-380k", f"runtime.patch_root={tmp_path}", "patches=[]")
    assert not [v for v in volumes(bare.argv) if v.startswith(f"{tmp_path}/")]


def test_dry_run_json_shows_the_patched_file_mounts(tmp_path):
    import os
    import subprocess

    root = tmp_path / "image-site-packages"
    root.mkdir()  # a copy of the image's site-packages that lacks the package
    r = subprocess.run([sys.executable, "-m", "dsv4serve", "up", "--profile", "8x16gb-380k", "--set",
                        f"runtime.patch_root={root}", "--dry-run", "--json", "--no-validate"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "DSV4SERVE_HOME": str(tmp_path / "home")})
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    for rel in PATCHED:
        assert f"{root}/{rel}:{SP}/{rel}:ro" in volumes(plan["argv"]), rel
    assert f"{root}/{PATCHED[0]}:{SP}/{PATCHED[0]}:ro" in plan["command"]
    # with runtime.patch_root set the image's files are checkable: the refusal is no longer "cannot be
    # verified" but the tree's own state, as up's, and nothing was copied out here (a port 8000 held
    # on this machine would be listed too, and is not this test's business)
    refusals = [x for x in plan["up_refuses"] if "patch" in x]
    assert len(refusals) == 1 and f"install exllamav3==1.4.5 in {root}" in refusals[0], refusals
    assert "cannot be verified" not in refusals[0]


def test_dry_run_names_what_up_would_refuse(tmp_path):
    """The shipped canon profile has no runtime.patch_root: up refuses to launch image files nobody
    verified, and the dry run says so in its plan instead of looking like a plan that runs."""
    import os
    import subprocess

    r = subprocess.run([sys.executable, "-m", "dsv4serve", "up", "--profile", "8x16gb-380k", "--dry-run", "--json",
                        "--no-validate"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "DSV4SERVE_HOME": str(tmp_path / "home")})
    assert r.returncode == 0, r.stderr
    refuses = json.loads(r.stdout)["up_refuses"]
    assert len(refuses) == 2 and "runtime.patch_root is not set" in refuses[0], refuses
    # and the pre-launch checks up runs next: this machine has no NVIDIA driver and no pack
    assert refuses[1].startswith("pre-launch checks failed (") and "machine/nvml" in refuses[1], refuses
    assert refuses[1].endswith("; --skip-checks starts anyway"), refuses
    r = subprocess.run([sys.executable, "-m", "dsv4serve", "up", "--profile", "8x16gb-380k", "--dry-run", "--json",
                        "--no-validate", "--skip-checks"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "DSV4SERVE_HOME": str(tmp_path / "home")})
    assert r.returncode == 0, r.stderr
    assert [x for x in json.loads(r.stdout)["up_refuses"] if "pre-launch" in x] == []  # up would skip them too


def test_dry_run_names_a_port_in_use(tmp_path):
    """up refuses a port something already listens on; the dry run lists that refusal too."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "dsv4serve", "up", "--profile", "cpu-demo", "--set",
                            f"vllm.port={port}", "--dry-run", "--json", "--no-validate"], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "DSV4SERVE_HOME": str(tmp_path / "home")})
    assert r.returncode == 0, r.stderr
    refuses = json.loads(r.stdout)["up_refuses"]
    assert len(refuses) == 1 and f"port 127.0.0.1:{port} is already in use" in refuses[0]


def test_a_docker_mount_path_with_a_colon_is_refused(tmp_path, monkeypatch):
    """`docker run -v a:b:c` splits on ':': a state dir with one would mount the wrong thing."""
    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path / "co:lon"))
    with pytest.raises(ProfileError) as e:
        build("8x16gb-380k")
    assert "contains ':'" in e.value.message and "DSV4SERVE_HOME" in e.value.hint


def test_dry_run_names_a_missing_pack_that_the_pre_launch_checks_refuse(tmp_path):
    """up runs the pre-launch checks before it launches; a pack that is not there is refused there,
    so the dry run lists it (on one line, even at 80 columns) and changes nothing."""
    from .conftest import cli

    home = tmp_path / "home"
    args = ("up", "--profile", "cpu-demo", "--set", "model.demo=false", "--set", f"model.path={tmp_path / 'nopack'}",
            "--dry-run", "--no-validate")
    r = cli(*args, "--json", home=home, timeout=120)
    assert r.returncode == 0, r.stderr
    refuses = json.loads(r.stdout)["up_refuses"]
    assert len(refuses) == 1 and refuses[0].startswith("pre-launch checks failed (1): pack/pack-dir: "), refuses
    assert f"{tmp_path / 'nopack'} does not exist" in refuses[0]
    r = cli(*args, home=home, timeout=120, env_extra={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("up would refuse")]
    assert len(lines) == 1 and lines[0].endswith("--skip-checks starts anyway"), r.stdout
    assert not home.exists()  # the plan started and wrote nothing


def test_hints_name_a_profile_from_a_file_by_its_path(tmp_path):
    """A profile read from YAML is found again by its path, not its name: the fix commands the dry run
    and check-seat print must work as printed. A patch_root that does not exist is named as such."""
    from .conftest import cli

    root = tmp_path / "image-site-packages"
    root.mkdir()
    prof = tmp_path / "my profile.yaml"
    prof.write_text(f"name: canon-pr\nextends: 8x16gb-380k\nruntime:\n  patch_root: {root}\n")
    home = tmp_path / "home"
    r = cli("up", "--profile", str(prof), "--dry-run", "--json", "--no-validate", home=home, timeout=120)
    assert r.returncode == 0, r.stderr
    patch_refusals = [x for x in json.loads(r.stdout)["up_refuses"] if "patch" in x]
    assert patch_refusals and "--profile canon-pr" not in patch_refusals[0], patch_refusals
    assert f"--profile '{prof}'" in patch_refusals[0], patch_refusals
    r = cli("check-seat", "--profile", str(prof), "--json", home=home, timeout=180)
    hints = [row["fix"] for row in json.loads(r.stdout)["rows"] if row["section"] == "live"]
    assert hints and all("--profile canon-pr" not in h for h in hints) and f"--profile '{prof}'" in hints[0], hints

    prof.write_text(f"name: canon-pr\nextends: 8x16gb-380k\nruntime:\n  patch_root: {tmp_path / 'nowhere'}\n")
    r = cli("patch", "apply", "--profile", str(prof), home=home, timeout=120)
    assert r.returncode == 2 and f"runtime.patch_root {tmp_path / 'nowhere'} is not a directory" in r.stderr, r.stderr
    # up says it as patch does, with --apply-patches too (it was 'package-missing' rows whose hints
    # failed on the same path, exit 1 with --apply-patches: helper audit)
    for extra in ([], ["--apply-patches"]):
        r = cli("up", "--profile", str(prof), "--skip-checks", "--no-validate", *extra, home=home, timeout=120)
        assert r.returncode == 2 and r.stderr.startswith(
            f"error: profile canon-pr: runtime.patch_root {tmp_path / 'nowhere'} is not a directory"), r.stderr
        r = cli("up", "--profile", str(prof), "--dry-run", "--json", "--no-validate", *extra, home=home, timeout=120)
        refuses = [x for x in json.loads(r.stdout)["up_refuses"] if "patch_root" in x]
        assert refuses and "is not a directory" in refuses[0] and "package-missing" not in refuses[0], refuses
    assert not (tmp_path / "nowhere").exists()


def test_an_lna2_seat_must_say_its_speculative_tokens_and_not_replay_a_graph_above_the_ceiling():
    """A left-out num_speculative_tokens counted as 0 (vLLM fills it in: every decode step (1 + k)x
    the rows checked), and a capture size above the ceiling holds the incumbent, replayed on every
    decode step that pads to it without a line or a count (helper audit)."""
    from dsv4serve.launch import check_plan

    with pytest.raises(ProfileError) as e:
        check_plan(load_profile("8x16gb-380k", ["vllm.speculative_config={method: dspark}"]))
    assert "gives no num_speculative_tokens" in e.value.line() and "num_speculative_tokens (the canon" in e.value.line()
    with pytest.raises(ProfileError) as e:
        check_plan(load_profile("8x16gb-380k", ["vllm.compilation_config={cudagraph_capture_sizes: [4, 8, 32]}"]))
    assert e.value.line() == (
        "profile 8x16gb-380k: a decode step of 16 rows replays the CUDA graph captured at 32 rows "
        "(vllm.compilation_config.cudagraph_capture_sizes), above the lna2 row ceiling 24; add 16 to "
        "cudagraph_capture_sizes, or drop the sizes above 24")
    for sizes in ("[1, 2, 4]", "[4, 16, 32]", "[4, 8, 24, 32]"):
        check_plan(load_profile("8x16gb-380k", [f"vllm.compilation_config={{cudagraph_capture_sizes: {sizes}}}"]))
    check_plan(load_profile("8x16gb-380k-incumbent", ["vllm.compilation_config={cudagraph_capture_sizes: [4, 64]}"]))



def test_an_lna2_seat_refuses_vllm_micro_batching_before_a_launch():
    """vLLM's micro-batching runs each micro-batch's MoE calls from a thread of its own with a slice of
    the batch, which lna2's dispatch was not built for (dispatch audit); the worker refuses it at
    load, `up` before launching, in every spelling vLLM's parser takes (review: `_`, abbreviations,
    the last of --enable-dbo / --no-enable-dbo)."""
    from dsv4serve.launch import check_plan, ubatching_flag

    for extra, said in ((["--enable-dbo"], ("--enable-dbo", 2)), (["--enable_dbo"], ("--enable_dbo", 2)),
                        (["--enable-d"], ("--enable-d", 2)), (["--ubatch-size", "2"], ("--ubatch-size 2", 2)),
                        (["--ubatch_size=3"], ("--ubatch_size 3", 3)), (["--ub", "4"], ("--ub 4", 4)),
                        (["--no-enable-dbo", "--enable-dbo"], ("--enable-dbo", 2))):
        assert ubatching_flag(extra) == said, extra
        with pytest.raises(ProfileError) as e:
            check_plan(load_profile("8x16gb-380k", [f"vllm.extra_args={json.dumps(extra)}"]))
        assert f"vllm.extra_args {said[0]} splits each step into {said[1]} micro-batches" in e.value.line()
        assert e.value.line().endswith("drop it from vllm.extra_args, or set moe.kernel=incumbent")
    for extra in (["--ubatch-size", "1"], ["--enable-dbo", "--no-enable-dbo"]):
        assert ubatching_flag(extra) is None, extra
        check_plan(load_profile("8x16gb-380k", [f"vllm.extra_args={json.dumps(extra)}"]))
    assert ubatching_flag(["--enable-", "x"]) is None and ubatching_flag(["--u", "2"]) is None  # ambiguous to vLLM
    check_plan(load_profile("8x16gb-380k-incumbent", ['vllm.extra_args=["--enable-dbo"]']))


@pytest.mark.parametrize("host", ["::0", "0:0:0:0:0:0:0:0", '"0"', "0x0", "000.000.000.000", '"[::]"', "::ffff:0.0.0.0"])
def test_every_spelling_of_the_wildcard_address_needs_the_opt_in(host):
    """The opt-in compared text against 0.0.0.0 / :: / [::]: "::0" or "0x0" listened on every
    interface without it (helper audit)."""
    with pytest.raises(ProfileError, match="would expose the seat on every interface"):
        build("cpu-demo", f"vllm.host={host}")
    build("cpu-demo", f"vllm.host={host}", "vllm.allow_public_host=true")
    for private in ("127.0.0.1", "::1", "localhost", "10.0.0.5"):
        build("cpu-demo", f"vllm.host={private}")


def test_a_bracketed_ipv6_host_reaches_vllm_bare_and_docker_bracketed():
    """vLLM binds --host as given and "[::1]" does not resolve there; docker's -p wants brackets,
    and takes no name at all (helper audit)."""
    assert flag_value(build("cpu-demo", 'vllm.host="[::1]"').argv, "--host") == "::1"
    docker = build("8x16gb-380k", 'vllm.host="[::1]"', "runtime.patch_root=/tmp")
    assert "[::1]:8899:8000" in docker.argv
    assert "127.0.0.1:8899:8000" in build("8x16gb-380k", 'vllm.host="127.1"', "runtime.patch_root=/tmp").argv
    with pytest.raises(ProfileError) as e:
        build("8x16gb-380k", "vllm.host=localhost", "runtime.patch_root=/tmp")
    assert e.value.line() == ("profile 8x16gb-380k: vllm.host localhost is a name, and docker's -p takes an IP "
                              "address; use 127.0.0.1 (or the address the name stands for)")


@pytest.mark.parametrize("overrides, words", [
    # the launcher sets it from moe.strict: a different value was silently replaced (helper audit)
    (["env.VLLM_EXL3_MOE_STRICT=1"], "moe.strict is 0 but env.VLLM_EXL3_MOE_STRICT is 1"),
    # the image's own F1 / native kernel would run while dsv4serve reported the incumbent
    (["env.VLLM_EXL3_MOE_KERNEL=lna"], "env.VLLM_EXL3_MOE_KERNEL=lna but moe.kernel is incumbent"),
    (["env.VLLM_EXL3_MOE_KERNEL=native"], "env.VLLM_EXL3_MOE_KERNEL=native but moe.kernel is incumbent"),
    (["env.VLLM_EXL3_MOE_KERNEL=lna2"], "env.VLLM_EXL3_MOE_KERNEL=lna2 but moe.kernel is incumbent"),
])
def test_an_incumbent_seat_carries_no_kernel_or_strict_env_it_would_not_honour(overrides, words):
    with pytest.raises(ProfileError, match=words):
        build("8x16gb-380k-incumbent", "runtime.patch_root=/tmp", *overrides)
    build("8x16gb-380k-incumbent", "runtime.patch_root=/tmp", "env.VLLM_EXL3_MOE_KERNEL=exllamav3",
          "env.VLLM_EXL3_MOE_STRICT=0")


def test_strict_2_is_refused_where_vllms_prefill_passes_exceed_the_ceiling():
    """Strict 2 raises on any call above the ceiling; vLLM's profile run and prefill chunks are
    max_num_batched_tokens rows: such a seat failed in its workers at boot (helper audit)."""
    with pytest.raises(ProfileError) as e:
        build("8x16gb-380k", "moe.strict=2", "env.VLLM_EXL3_MOE_STRICT=2")
    assert "moe.strict 2 raises on every MoE call above the row ceiling 24, and vLLM's prefill passes take 512" \
        in e.value.line() and "max_num_batched_tokens <= 24" in e.value.line()
    build("8x16gb-380k", "moe.strict=2", "env.VLLM_EXL3_MOE_STRICT=2", "vllm.max_num_batched_tokens=24",
          "runtime.patch_root=/tmp")


def test_a_profile_cannot_write_the_launchers_own_variables():
    """env.DSV4SERVE_LNA2_EXT put another build into the workers than check-seat described."""
    for var in ("DSV4SERVE_LNA2_EXT", "DSV4SERVE_LNA2_TUNING", "DSV4SERVE_RUN_ID"):
        with pytest.raises(ProfileError, match=f"env.{var}: DSV4SERVE_\\* variables are set by the launcher"):
            load_profile("cpu-demo", [f"env.{var}=/x"])


def test_the_shells_run_channel_does_not_reach_the_seat(monkeypatch):
    """A DSV4SERVE_LNA2_TUNING exported in the shell reached the workers of a seat whose profile
    names no table; DSV4SERVE_HOME still passes (the checks read the same one)."""
    monkeypatch.setenv("DSV4SERVE_LNA2_TUNING", "/srv/old-card-table.json")
    monkeypatch.setenv("DSV4SERVE_DECODE_ROWS", "4")
    monkeypatch.setenv("DSV4SERVE_HOME", "/tmp/dsv4home-x")
    env = launch.env_for_child(build("cpu-demo"))
    assert "DSV4SERVE_LNA2_TUNING" not in env and "DSV4SERVE_DECODE_ROWS" not in env
    assert env["DSV4SERVE_HOME"] == "/tmp/dsv4home-x" and env["DSV4SERVE_RUN_ID"] == "r1"


@pytest.mark.parametrize("value, words", [
    ("{home.x}", "unknown placeholder {home.x}"),
    ("{home[0]}", "unknown placeholder {home[0]}"),
    ("{home!r}", "placeholder with a conversion or format {home!r}"),
    ("{cache:>20}", "placeholder with a conversion or format {cache:>20}"),
    ("{}", "unknown placeholder {}"),
])
def test_a_placeholder_is_a_name_and_nothing_more(value, words):
    """str.format ran {home.x} (AttributeError traceback, the --json dry run printing nothing) and
    {home!r} / {cache:>20} (silently other text) (helper audit)."""
    with pytest.raises(ProfileError) as e:
        build("cpu-demo", f"env.FOO={value}")
    assert e.value.message == f"env.FOO: {words}" and "{home}" in e.value.hint
    assert build("cpu-demo", "env.FOO={home}/a{{b}}").env["FOO"].endswith("/a{b}")


def test_check_seat_judges_the_assembled_plan_as_up_does(tmp_path, monkeypatch):
    """check-seat ran only check_plan, so a placeholder up refuses read as a passing plan."""
    from dsv4serve import checks

    monkeypatch.setenv("DSV4SERVE_HOME", str(tmp_path))
    rep = checks.Report("cpu-demo")
    checks.check_plan(rep, checks.Ctx(profile=load_profile("cpu-demo", ["env.FOO={home.x}"])))
    row = next(r for r in rep.rows if r.check == "launch-plan")
    assert row.status == "fail" and row.found == "env.FOO: unknown placeholder {home.x}"


@pytest.mark.parametrize("mounts, words", [
    ('[{host: data, container: /data}]', "docker mount path data is relative"),
    ('[{host: /data, container: data}]', "docker mount path data is relative"),
    ('[{host: /a, container: /root/.cache}, {host: /b, container: /root/.cache}]',
     "docker mounts /a and /b both at /root/.cache"),
])
def test_docker_mounts_are_absolute_and_one_per_target(mounts, words):
    """docker takes a relative source as a named volume (created empty), and a later mount on the same
    target hides the earlier one; both passed the dry run (helper audit)."""
    with pytest.raises(ProfileError, match=words):
        build("8x16gb-380k", f"runtime.mounts={mounts}")


def test_the_graph_check_reads_capture_sizes_as_vllm_does():
    """Review of this session's change: with speculative decoding vLLM may round each capture size up
    to a multiple of 1 + k (22 -> 25 at k 4: a 20-row step replays 25 rows, above 24), and it drops the
    sizes above max_num_batched_tokens; an eager seat or graph mode NONE replays nothing."""
    from dsv4serve.launch import check_plan

    seat = ["vllm.speculative_config={method: dspark, num_speculative_tokens: 4}"]  # 4 seqs x 5 = 20 rows
    with pytest.raises(ProfileError, match="a decode step of 20 rows replays the CUDA graph captured at 25 rows"):
        check_plan(load_profile("8x16gb-380k", [*seat, "vllm.compilation_config={cudagraph_capture_sizes: [22, 64]}"]))
    for fine in (["vllm.enforce_eager=true", "vllm.compilation_config={cudagraph_capture_sizes: [8, 32]}"],
                 ["vllm.compilation_config={cudagraph_capture_sizes: [8, 32], cudagraph_mode: NONE}"],
                 ["vllm.max_num_batched_tokens=24", "vllm.compilation_config={cudagraph_capture_sizes: [8, 32]}"]):
        check_plan(load_profile("8x16gb-380k", fine))


def test_the_incumbent_kernel_env_is_read_without_regard_to_case():
    """Review: the plugin lower-cases VLLM_EXL3_MOE_KERNEL; the launcher refused EXLLAMAV3."""
    build("8x16gb-380k-incumbent", "runtime.patch_root=/tmp", "env.VLLM_EXL3_MOE_KERNEL=EXLLAMAV3")
    with pytest.raises(ProfileError, match="env.VLLM_EXL3_MOE_KERNEL=LNA but moe.kernel is incumbent"):
        build("8x16gb-380k-incumbent", "runtime.patch_root=/tmp", "env.VLLM_EXL3_MOE_KERNEL=LNA")


def test_a_seats_api_key_is_read_from_its_own_launch():
    """The supervisor, check-seat and bench find the key from the launch argv and env alone: a docker
    seat's profile env reaches the container as -e entries, a native seat's as its env."""
    docker = build("8x16gb-380k", "env.VLLM_API_KEY=k1", "runtime.patch_root=/tmp")
    assert launch.seat_api_key(docker.runtime, docker.argv, docker.env) == "k1"
    native = build("cpu-demo", "env.VLLM_API_KEY=k2")
    assert launch.seat_api_key(native.runtime, native.argv, native.env) == "k2"


def test_an_api_key_a_header_cannot_carry_is_refused_before_launch(tmp_path, monkeypatch):
    """readiness sends the key in a header: a non-ASCII one (a pasted non-breaking space) crashed the
    probe after the seat came up; a space is a header character and stays allowed."""
    from dsv4serve import launch
    from dsv4serve.errors import ProfileError

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ProfileError, match=r"has a character an HTTP header cannot carry \('\\xa0' at position 2\)"):
        launch.build(load_profile("cpu-demo", ["env.VLLM_API_KEY=k1\u00a0"]), run_id="r", run_dir=tmp_path / "run")
    with pytest.raises(ProfileError, match="cannot carry"):
        launch.build(load_profile("cpu-demo", ["vllm.extra_args=[--api-key, 'k\u2019s']"]), run_id="r",
                     run_dir=tmp_path / "run")
    assert launch.build(load_profile("cpu-demo", ["env.VLLM_API_KEY=a key"]), run_id="r", run_dir=tmp_path / "run")


def test_a_relative_model_path_of_a_docker_seat_is_named_as_such():
    """The mount check said "give both sides of runtime.mounts as absolute paths" for a relative
    model.path, a key the user never wrote (docker audit)."""
    with pytest.raises(ProfileError, match=r"model.path models/x is relative: a docker seat mounts the pack") as e:
        build("8x16gb-380k", "model.path=models/x")
    assert "runtime.mounts" not in e.value.message and "model.path as an absolute path" in (e.value.hint or "")
    # a profile that does not mount it may name a hub repo: vLLM resolves that itself (review)
    spec = build("8x16gb-380k", "model.path=org/some-repo", "runtime.mounts=[]")
    assert spec.vllm_args[0] == "org/some-repo"


def test_a_relative_local_model_path_of_a_docker_seat_without_its_mount_is_refused(tmp_path, monkeypatch):
    """The host checks read a relative pack from here and passed; inside the image the name resolved
    against the container's working directory, or was fetched as a hub repo (review)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "packs" / "dsv4").mkdir(parents=True)
    with pytest.raises(ProfileError) as e:
        build("8x16gb-380k", "model.path=packs/dsv4", "runtime.mounts=[]")
    assert e.value.message == (f"profile 8x16gb-380k: model.path packs/dsv4 is a directory relative to {tmp_path} "
                               "here, and inside the container a relative path resolves against the container's "
                               "working directory")
    assert "runtime.mounts" in (e.value.hint or "")
    assert build("8x16gb-380k", "model.path=org/some-repo", "runtime.mounts=[]").vllm_args[0] == "org/some-repo"
