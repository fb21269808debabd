"""Seat profiles: schema, extends, --set overrides, and one-line errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dsv4serve.errors import ProfileError
from dsv4serve.profile import load_profile, shipped_profiles

CANON_FLAGS = {
    "max_model_len": 389120, "max_num_seqs": 4, "max_num_batched_tokens": 512, "kv_cache_dtype": "fp8",
    "gpu_memory_utilization": 0.97, "tensor_parallel_size": 8, "quantization": "exl3", "host": "127.0.0.1",
    "port": 8899, "tool_call_parser": "deepseek_v4", "reasoning_parser": "deepseek_v4",
}
CANON_ENV = {
    "VLLM_DISABLE_SHARED_EXPERTS_STREAM": "1", "LNA_DSV4_AUX_STREAMS": "0", "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": "128",
    "VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION": "1", "VLLM_EXL3_MOE_KERNEL": "exllamav3",
    "VLLM_EXL3_MOE_STRICT": "1",
    "NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
}


def write(tmp_path: Path, data: dict, name: str = "p.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def test_all_shipped_profiles_load():
    names = set(shipped_profiles())
    assert {"8x16gb-380k", "8x16gb-380k-incumbent", "8x16gb-ppl", "cpu-demo"} <= names
    for n in names:
        p = load_profile(n)
        assert p.name == n


def test_canon_profile_is_the_seat():
    p = load_profile("8x16gb-380k")
    for k, v in CANON_FLAGS.items():
        assert getattr(p.vllm, k) == v, k
    for k, v in CANON_ENV.items():
        assert p.env[k] == v, k
    assert p.env["EXLLAMAV3_TUNE_CACHE"]
    assert p.vllm.compilation_config == {"cudagraph_capture_sizes": [1, 2, 4]}
    assert p.vllm.speculative_config == {"method": "dspark", "num_speculative_tokens": 3}
    assert p.vllm.disable_custom_all_reduce and p.vllm.trust_remote_code and p.vllm.enable_auto_tool_choice
    assert p.model.served_name == "DSV4-Flash"
    assert p.moe.kernel == "lna2" and p.moe.strict == 1
    assert p.gpus.ids == [0, 1, 2, 3, 5, 7, 8, 9]
    assert [m.text for m in p.gates.markers][0] == "LNA2 MoE kernel ACTIVE rank="
    assert p.kv_min_tokens() == 389120
    assert p.decode_rows() == 16
    assert p.reference.tok_s["1"]["code"] == 108.6


def test_incumbent_extends_canon_and_drops_lna2_env():
    p = load_profile("8x16gb-380k-incumbent")
    assert p.moe.kernel == "incumbent"
    assert "VLLM_EXL3_MOE_KERNEL" not in p.env and "VLLM_EXL3_MOE_STRICT" not in p.env
    assert p.env["LNA_DSV4_AUX_STREAMS"] == "0"      # inherited
    assert p.vllm.max_model_len == 389120
    assert "LNA2 MoE kernel ACTIVE" in p.gates.forbidden


def test_ppl_profile_turns_speculation_off():
    p = load_profile("8x16gb-ppl")
    assert p.vllm.speculative_config is None and p.spec_tokens() == 0
    assert 0.93 <= p.vllm.gpu_memory_utilization <= 0.95
    assert p.vllm.max_model_len <= 8192


def test_set_overrides_are_typed():
    p = load_profile("cpu-demo", ["vllm.port=8123", "moe.strict=2", "vllm.enforce_eager=false",
                                  'vllm.speculative_config={"method": "mtp", "num_speculative_tokens": 2}'])
    assert p.vllm.port == 8123 and p.moe.strict == 2 and p.vllm.enforce_eager is False
    assert p.spec_tokens() == 2


@pytest.mark.parametrize("override, needle", [
    ("vllm.max_num_seq=4",
     "unknown key 'vllm.max_num_seq' (from --set vllm.max_num_seq); did you mean 'vllm.max_num_seqs'?"),
    ("vllm.port=eighty", "vllm.port"),
    ("moe.strict=3", "moe.strict"),
    ("vllm.port=70000", "between 1 and 65535"),
    ("gpus.idz=[1]", "did you mean 'gpus.ids'"),
    ("novel=1", "unknown key 'novel'"),
    # nonsense values: counts, ports and timeouts out of range or of the wrong kind (YAML true is not 1)
    ("vllm.port=true", "vllm.port: Input should be a valid integer (got true)"),
    ("vllm.tensor_parallel_size=0", "vllm.tensor_parallel_size"),
    ("vllm.tensor_parallel_size=-2", "vllm.tensor_parallel_size"),
    ("vllm.max_model_len=0", "vllm.max_model_len"),
    ("vllm.gpu_memory_utilization=true", "vllm.gpu_memory_utilization"),
    ("gates.timeouts.stall_s=-1", "gates.timeouts.stall_s"),
    ("gates.timeouts.shutdown_grace_s=-1", "gates.timeouts.shutdown_grace_s"),
    ("gates.markers=[{text: x, ranks: 0}]", 'gates.markers.0.ranks: must be a whole number of at least 1 or "all"'),
    ("gates.markers=[{text: x, ranks: -1}]", "gates.markers.0.ranks"),
    ("gates.markers=[{text: x, ranks: 3}]", "gates.markers.0.ranks: 3 exceeds vllm.tensor_parallel_size 2"),
    ("moe.strict=true", "moe.strict"),
    ("vllm.speculative_config.num_speculative_tokens=x", "num_speculative_tokens must be a whole number"),
    ("vllm.speculative_config.num_speculative_tokens=0", "num_speculative_tokens must be a whole number"),
    ("env.BAD-NAME=1", "env.BAD-NAME: not a valid variable name"),
    ("env.1X=1", "env.1X: not a valid variable name"),
    ("model.demo_seed=-1", "model.demo_seed"),
    ("extends=8x16gb-380k", "'extends' cannot be set on the command line"),
    ('vllm.compilation_config={a: 1, a: 2}', "key 'a' is given twice"),
    # an empty marker is "seen" on any line, so its gate proves nothing; an empty forbidden
    # pattern fails every seat
    ('gates.markers=[{text: "", ranks: all}]', "gates.markers.0.text"),
    ('gates.forbidden=[""]', "an empty pattern matches every line"),
    # YAML's .inf / .nan: no timeout at all, and --json would print Infinity / NaN (not JSON)
    ("gates.timeouts.total_s=.inf", "gates.timeouts.total_s: Input should be a finite number (got Infinity)"),
    ("gates.timeouts.stall_s=.nan", "gates.timeouts.stall_s: Input should be a finite number (got NaN)"),
    ('reference.tok_s={"1": {en: .nan}}', "reference.tok_s.1.en: Input should be a finite number"),
    ("vllm.compilation_config={a: [1, -.inf]}", "vllm.compilation_config.a.1 is -inf, which JSON cannot carry"),
    # a typo's rank count is a profile error, not a plan with 10**23 rank streams to tail
    ("vllm.tensor_parallel_size=99999999999999999999999", "vllm.tensor_parallel_size: Input should be less than or equal to 1024"),
    ("vllm.tensor_parallel_size=0", "vllm.tensor_parallel_size: Input should be greater than or equal to 1"),
    # docker would refuse these only at `docker run`, after the checks
    ("runtime.container_name=my seat", "runtime.container_name: must be a docker container name"),
    ("runtime.shm_size=lots", 'runtime.shm_size: must be a docker size such as "16g"'),
    ("runtime.shm_size=\"16\"", "runtime.shm_size: must be a docker size"),  # a bare number is 16 bytes
    # the type errors say how to write the value
    ("gpus.ids=0,1", "gpus.ids: Input should be a valid list (got \"0,1\") (from --set gpus.ids); give a list in "
                     "YAML's brackets: gpus.ids: [..] (with --set, quote it: 'gpus.ids=[..]')"),
    ("runtime.shm_size=16", 'give text: quote the value (runtime.shm_size: "16")'),
    ("vllm.max_num_seqs=x", "give vllm.max_num_seqs as a whole number"),
    ("vllm.trust_remote_code=maybe", "give vllm.trust_remote_code as true or false"),
    # options the launcher sets from a key: docker would take both, the later one winning
    # every spelling vLLM's parser completes or reads with its value attached (helper audit: these
    # moved the port, TP and model behind the plan's back)
    ('vllm.extra_args=["--tensor-parallel=4"]', "--tensor-parallel (vLLM reads it as --tensor-parallel-size) is "
                                                "vllm.tensor_parallel_size's flag"),
    ('vllm.extra_args=["--por", "9999"]', "--por (vLLM reads it as --port) is vllm.port's flag"),
    ('vllm.extra_args=["-qfp8"]', "-qfp8 (vLLM reads it as -q) is vllm.quantization's flag"),
    ('vllm.extra_args=["-t", "4"]', "-t (vLLM reads it as -tp) is vllm.tensor_parallel_size's flag"),
    ('vllm.extra_args=["-sc.num_speculative_tokens=3"]', "is vllm.speculative_config's flag"),
    ('vllm.extra_args=["--model", "/x"]', "--model is model.path's flag: set model.path instead"),
    ('vllm.extra_args=["--served-model-name", "o"]', "--served-model-name is model.served_name's flag"),
    ('vllm.extra_args=["--config", "f.yaml"]', "--config reads a config file"),
    ('vllm.extra_args=["-pp", "2"]', "-pp sets pipeline parallelism, which dsv4serve does not supervise"),
    ('vllm.extra_args=["--data-parallel-size=2"]', "sets data parallelism"),
    ('runtime.extra_args=["--gpus", "all"]', "runtime.extra_args: --gpus is set by the launcher from gpus.ids"),
    ('runtime.extra_args=["-eLNA_DSV4_AUX_STREAMS=1"]', "-e is set by the launcher from env.NAME"),
    ('runtime.extra_args=["--env=X=1"]', "--env is set by the launcher from env.NAME"),
    ('runtime.extra_args=["-p", "0.0.0.0:8899:8000"]', "-p is set by the launcher from vllm.port and vllm.host"),
    ('runtime.extra_args=["--network", "host"]', "--network is set by the launcher"),
    ('runtime.extra_args=["-v", "/x:/usr/local/lib/python3.12"]', "-v is set by the launcher from runtime.mounts"),
    ('runtime.extra_args=["--ulimit", "core=-1"]', "--ulimit is set by the launcher from runtime.core_dumps"),
    ('runtime.extra_args=["-d"]', "the supervisor runs the container attached"),
    ('runtime.extra_args=["-itd"]', "-d is set by the launcher"),  # a bundle of short options
    ('runtime.extra_args=["-tie", "X=1"]', "-e is set by the launcher from env.NAME"),
    ("runtime.container_name=a", "runtime.container_name: must be a docker container name"),  # docker wants two
    ("model.served_name=true", 'give text: quote the value (model.served_name: "true")'),  # YAML's, not Python's
    # a native seat runs the venv's packages: patch, up and check-seat judged the copy (helper audit)
    ("runtime.patch_root=/tmp", "runtime.patch_root is the host copy of a docker image's site-packages; a native "
                                "seat runs this environment's own packages"),
])
def test_bad_overrides_are_one_line_errors(override, needle):
    with pytest.raises(ProfileError) as e:
        load_profile("cpu-demo", [override])
    line = e.value.line()
    assert needle in line and "\n" not in line, line
    assert "(got dict)" not in line and "Value error" not in line


def test_docker_options_the_launcher_does_not_set_pass_through():
    # an option's value is not read as an option: --entrypoint -v, --label -e, -h -p
    p = load_profile("8x16gb-380k", ['runtime.extra_args=["--entrypoint", "-v", "--label", "-e", "-h", "-p", "-it"]'])
    assert p.runtime.extra_args[-1] == "-it"
    p = load_profile("8x16gb-380k", ['runtime.extra_args=["--ulimit", "nofile=65536", "--device", "/dev/fuse", "-it"]',
                                     'runtime.shm_size="16.5GiB"', "runtime.container_name=dsv4_seat.2"])
    assert p.runtime.extra_args == ["--ulimit", "nofile=65536", "--device", "/dev/fuse", "-it"]


def test_typo_in_a_yaml_file(tmp_path):
    data = yaml.safe_load(Path(shipped_profiles()["cpu-demo"]).read_text())
    data["gates"]["timeouts"]["stal_s"] = 5
    with pytest.raises(ProfileError) as e:
        load_profile(str(write(tmp_path, data)))
    assert "gates.timeouts.stal_s" in e.value.line() and "gates.timeouts.stall_s" in e.value.line()


def test_extends_a_shipped_profile_from_a_path(tmp_path):
    path = write(tmp_path, {"extends": "cpu-demo", "vllm": {"port": 9000}}, "mine.yaml")
    p = load_profile(str(path))
    assert p.name == "mine" and p.vllm.port == 9000 and p.vllm.tensor_parallel_size == 2


def test_extends_cycle_and_missing_files(tmp_path):
    write(tmp_path, {"extends": "b.yaml", "model": {"served_name": "x"}}, "a.yaml")
    write(tmp_path, {"extends": "a.yaml", "model": {"served_name": "x"}}, "b.yaml")
    with pytest.raises(ProfileError, match="cycle"):
        load_profile(str(tmp_path / "a.yaml"))
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(str(tmp_path / "nope.yaml"))
    with pytest.raises(ProfileError) as e:
        load_profile("cpu-dem")
    assert e.value.line() == "unknown profile 'cpu-dem'; did you mean 'cpu-demo'?"


def test_malformed_yaml_names_the_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nvllm: {port: 1\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(str(p))


def test_digest_changes_with_content():
    a = load_profile("cpu-demo").digest()
    assert a == load_profile("cpu-demo").digest()
    assert a != load_profile("cpu-demo", ["vllm.port=9999"]).digest()


# --- input-handling defects: every one a one-line ProfileError, nothing loaded ---------------


def test_profile_that_is_not_utf8_names_the_file(tmp_path):
    p = tmp_path / "utf16.yaml"
    p.write_bytes(b"\xff\xfe" + "name: x\n".encode("utf-16-le"))
    with pytest.raises(ProfileError) as e:
        load_profile(str(p))
    assert "utf16.yaml is not UTF-8" in e.value.line() and "\n" not in e.value.line()


def test_a_directory_is_not_a_profile(tmp_path):
    with pytest.raises(ProfileError, match="is a directory"):
        load_profile(str(tmp_path))


@pytest.mark.parametrize("name", ["../../escape", "a/b", "", ".hidden", "-x", "a b", "x" * 101])
def test_seat_names_are_one_path_component(name):
    with pytest.raises(ProfileError) as e:
        load_profile("cpu-demo", [f"name={name}"])
    assert "name:" in e.value.line()


def test_shipped_names_are_valid_seat_names():
    for n in shipped_profiles():
        assert load_profile("cpu-demo", [f"name={n}"]).name == n


def test_markers_may_count_every_rank():
    p = load_profile("cpu-demo", ["gates.markers=[{text: x, ranks: 2}]"])
    assert p.gates.markers[0].ranks == 2


def test_env_set_keeps_the_literal_string():
    p = load_profile("cpu-demo", ["env.A=0755", "env.B=0x10", "env.C=12:30", "env.D=on", "env.E=1e3",
                                  "env.F='0755'", "env.G=plain"])
    assert {k: p.env[k] for k in "ABCDEFG"} == {"A": "0755", "B": "0x10", "C": "12:30", "D": "on", "E": "1e3",
                                                 "F": "0755", "G": "plain"}
    assert "VLLM_NO_USAGE_STATS" not in load_profile("cpu-demo", ["env.VLLM_NO_USAGE_STATS=null"]).env


def test_boolean_env_in_a_file_says_boolean(tmp_path):
    path = write(tmp_path, {"extends": "cpu-demo", "env": {"X": True}})
    with pytest.raises(ProfileError) as e:
        load_profile(str(path))
    assert "env.X: true is a YAML boolean" in e.value.line() and "(got dict)" not in e.value.line()


def test_duplicate_yaml_keys_are_refused_with_lines(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("extends: cpu-demo\nvllm:\n  port: 9000\n  max_num_seqs: 1\n  port: 9001\n")
    with pytest.raises(ProfileError) as e:
        load_profile(str(p))
    assert "key 'port' is given twice (lines 3 and 5)" in e.value.line()


def test_a_forbidden_pattern_that_is_not_a_regex_is_refused_at_load():
    """up's log watch compiles gates.forbidden; the profile load does too, so --dry-run and
    check-seat refuse the same profile instead of passing it."""
    with pytest.raises(ProfileError, match=r"gates.forbidden.*\(unclosed.*not a valid regex"):
        load_profile("cpu-demo", ['gates.forbidden=["(unclosed"]'])


@pytest.mark.parametrize("value, words", [
    ('"(unclosed"', r"gates.canary.expect: .*\(unclosed.*not a valid regex"),
    ('""', r"gates.canary.expect: .*/\/ matches an empty answer, so any answer"),
    ('".*"', r"gates.canary.expect: .*/\.\*/ matches an empty answer"),  # and so would garbage (review)
    ('"ready|"', r"matches an empty answer"),
])
def test_a_canary_expectation_that_cannot_be_matched_as_meant_is_refused_at_load(value, words):
    """The readiness probe searches the canary's answer for gates.canary.expect: a pattern that does
    not compile would crash the probe mid-bring-up, an empty one would pass any garbage."""
    with pytest.raises(ProfileError, match=words):
        load_profile("cpu-demo", [f"gates.canary.expect={value}"])
    assert load_profile("cpu-demo", ["gates.canary.expect=null"]).gates.canary.expect is None
    assert load_profile("8x16gb-380k").gates.canary.expect == r"(?i)\bready\b"  # the canon seat's answer


def test_nested_yaml_merges_are_not_duplicate_keys():
    """A mapping that merges one which itself merges another is valid YAML: PyYAML folds the merged
    keys in place before the inner mapping's own turn, which must not read as a key given twice.
    A real duplicate in one mapping still is one."""
    from dsv4serve.profile import _yaml_load

    text = "a: &a {x: 1}\ndefs:\n  b: &b\n    <<: *a\n    x: 2\nc:\n  <<: *b\n  y: 3\n"
    assert _yaml_load(text) == yaml.safe_load(text)
    with pytest.raises(Exception, match="duplicate key 'x'"):
        _yaml_load("m:\n  x: 1\n  y: 2\n  x: 5\n")


def test_env_numbers_in_a_file_reach_the_process_as_written(tmp_path):
    """YAML 1.1 would turn 0755 into 493 and 0x10 into 16: such env values stay the text the user
    typed; a float (1.10 reads as 1.1) is refused with a hint to quote it; a plain integer is fine."""
    f = tmp_path / "p.yaml"
    f.write_text("extends: cpu-demo\nname: envtest\nenv: {A: 0755, D: 0x10, E: 1_000, G: 4}\n")
    env = load_profile(str(f)).env
    assert (env["A"], env["D"], env["E"], env["G"]) == ("0755", "0x10", "1_000", "4")
    f.write_text("extends: cpu-demo\nname: envtest\nenv: {F: 1.10}\n")
    with pytest.raises(ProfileError, match=r"env.F: 1.1 is a YAML number; quote the value"):
        load_profile(str(f))


def test_a_relative_extends_is_read_beside_its_file_from_any_working_directory(tmp_path, monkeypatch):
    """The same file must launch the same seat wherever dsv4serve runs: a `base.yaml` in the
    working directory must not shadow the one beside the profile that names it."""
    (tmp_path / "prof").mkdir()
    write(tmp_path / "prof", {"extends": "cpu-demo", "name": "base", "vllm": {"port": 1111}}, "base.yaml")
    write(tmp_path, {"extends": "cpu-demo", "name": "base", "vllm": {"port": 2222}}, "base.yaml")
    kid = write(tmp_path / "prof", {"extends": "base.yaml", "name": "kid"}, "kid.yaml")
    for cwd in (tmp_path, tmp_path / "prof"):
        monkeypatch.chdir(cwd)
        assert load_profile(str(kid)).vllm.port == 1111
    write(tmp_path / "prof", {"extends": "gone.yaml"}, "dangling.yaml")
    with pytest.raises(ProfileError) as e:
        load_profile(str(tmp_path / "prof" / "dangling.yaml"))
    assert e.value.message == (f"profile file 'gone.yaml' ({tmp_path / 'prof' / 'gone.yaml'}) does not exist, "
                               f"named by 'extends' in {tmp_path / 'prof' / 'dangling.yaml'}")


def test_an_error_names_the_file_or_flag_the_bad_value_came_from(tmp_path):
    """A copy of a shipped profile keeps its name, so 'profile cpu-demo: unknown key' alone reads as
    a broken shipped profile: the error says which file (or --set) wrote the key."""
    data = yaml.safe_load(Path(shipped_profiles()["cpu-demo"]).read_text())
    data["vllm"]["prot"] = data["vllm"].pop("port")
    copy_ = write(tmp_path, data, "copy.yaml")
    kid = write(tmp_path, {"extends": "copy.yaml", "name": "kid"}, "kid.yaml")
    with pytest.raises(ProfileError) as e:
        load_profile(str(copy_))
    assert e.value.line() == f"profile cpu-demo: unknown key 'vllm.prot' (in {copy_}); did you mean 'vllm.port'?"
    with pytest.raises(ProfileError) as e:
        load_profile(str(kid))
    assert e.value.message == f"profile kid: unknown key 'vllm.prot' (in {copy_})"
    with pytest.raises(ProfileError) as e:
        load_profile("cpu-demo", ["vllm.port=x"])
    assert e.value.message == 'profile cpu-demo: vllm.port: Input should be a valid integer (got "x") (from --set vllm.port)'
    with pytest.raises(ProfileError) as e:
        load_profile("cpu-demo", ["gates.markers=[{text: x, ranks: 0}]"])
    assert e.value.message.endswith('"all" (got 0) (from --set gates.markers)')


@pytest.mark.parametrize("ref, words", [
    ("", "the profile name is empty"),
    ("/dev/null", "profile file '/dev/null' is not a regular file"),
])
def test_an_empty_name_and_a_device_are_named_for_what_they_are(ref, words):
    """'' read as "is a directory" (Path('') is '.'), /dev/null as "does not exist"."""
    with pytest.raises(ProfileError) as e:
        load_profile(ref)
    assert e.value.message == words


def test_a_control_character_is_one_line(tmp_path):
    f = tmp_path / "bin.yaml"
    f.write_bytes(b"name: x\n\x00\n")
    with pytest.raises(ProfileError) as e:
        load_profile(str(f))
    assert "\n" not in e.value.line() and "character #x0000 at offset 8 is not allowed" in e.value.message


def test_nested_aliases_are_refused_before_they_expand(tmp_path):
    """Nine levels of nine aliases are 9**9 values once expanded: `profiles show` hung on it."""
    lines, prev = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]"], "a"
    for i in range(8):
        name = chr(ord("b") + i)
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
        prev = name
    f = tmp_path / "bomb.yaml"
    f.write_text("name: bomb\nextends: cpu-demo\nvllm:\n  compilation_config:\n"
                 + "".join(f"    {ln}\n" for ln in lines))
    with pytest.raises(ProfileError, match="expands to more than 100,000 values"):
        load_profile(str(f))


def test_an_unclosed_bracket_names_the_line_it_opened_on_and_the_fix(tmp_path):
    """PyYAML finds an unclosed bracket at the end of the file, a line past the last: the line to fix
    is where it opened."""
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nextends: cpu-demo\nvllm:\n  port: 1\nenv:\n  A: '1'\npatches: [vllm-0.32.0\n")
    with pytest.raises(ProfileError) as e:
        load_profile(str(p))
    line = e.value.line()
    assert "is not valid YAML" in line and "that starts at line 7" in line and "unclosed bracket" in e.value.hint


def test_every_profile_structure_error_carries_a_fix(tmp_path):
    cases = {
        "list.yaml": "- name: x\n",
        "extends-int.yaml": "name: x\nextends: 5\n",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ProfileError) as e:
            load_profile(str(tmp_path / name))
        assert e.value.hint, (name, e.value.line())
    write(tmp_path, {"extends": "b2.yaml", "model": {"served_name": "x"}}, "a2.yaml")
    write(tmp_path, {"extends": "a2.yaml", "model": {"served_name": "x"}}, "b2.yaml")
    with pytest.raises(ProfileError) as e:
        load_profile(str(tmp_path / "a2.yaml"))
    assert "cycle" in e.value.message and "remove the 'extends'" in e.value.hint


def test_set_cannot_address_a_list_item_and_says_how_to_give_the_list():
    with pytest.raises(ProfileError) as e:
        load_profile("cpu-demo", ["gates.markers.0.ranks=5"])
    assert e.value.message == "--set gates.markers.0.ranks: 'gates.markers' is a list, and --set cannot address one item"
    assert "--set 'gates.markers=[...]'" in e.value.hint


def test_an_lna2_strict_seat_always_gates_on_its_proof(tmp_path):
    """A profile that extends the canon and lists its own gates replaces the parent's lists: the ACTIVE
    marker and the decline pattern went with them, and such a seat came up on any kernel. Under strict
    mode the kernel choice brings them back; one rank of eight is refused; strict 0 adds nothing."""
    import re

    from dsv4serve.profile import LNA2_ACTIVE, LNA2_DECLINE_SAMPLE

    child = write(tmp_path, {"extends": "8x16gb-380k", "name": "mine",
                             "gates": {"markers": [{"text": "dsv4serve plugin ready", "ranks": "all"}],
                                       "forbidden": ["LNA preflight FAILED"]}})
    p = load_profile(str(child))
    assert [(m.text, m.ranks) for m in p.gates.markers] == [("dsv4serve plugin ready", "all"), (LNA2_ACTIVE, "all")]
    assert any(re.search(pat, LNA2_DECLINE_SAMPLE) for pat in p.gates.forbidden)
    assert not any(re.search(pat, "LNA2 declined: rows=40 above the ceiling (rank=0/8)") for pat in p.gates.forbidden)
    canon = load_profile("8x16gb-380k")
    assert [m.text for m in canon.gates.markers].count(LNA2_ACTIVE) == 1 and len(canon.gates.forbidden) == 5
    # the image's own lna2 running beneath dsv4serve's is forbidden in a child's own list too
    assert "F3 LNA2 MoE kernel ACTIVE" in p.gates.forbidden and "F3 LNA2 MoE kernel ACTIVE" in canon.gates.forbidden
    with pytest.raises(ProfileError) as e:
        load_profile("8x16gb-380k", ['gates.markers=[{text: "LNA2 MoE kernel ACTIVE", ranks: 1}]'])
    assert "1 of 8 ranks for the lna2 ACTIVE marker" in e.value.line() and 'use "all"' in e.value.line()
    # a fragment of the ACTIVE line ("MoE" is in ordinary vLLM lines too) is not the proof, and a
    # marker on a few ranks that is not the proof is the user's own business
    frag = load_profile("8x16gb-380k", ['gates.markers=[{text: "MoE", ranks: all}, {text: "rank=", ranks: 1}]',
                                        'gates.forbidden=["LNA2 declined: x dtype"]'])
    assert [m.text for m in frag.gates.markers] == ["MoE", "rank=", LNA2_ACTIVE]
    assert frag.gates.forbidden[-2:] == ["LNA2 declined: (?!rows=\\d+ above the ceiling)", "F3 LNA2 MoE kernel ACTIVE"]
    loose = load_profile("8x16gb-380k", ["moe.strict=0", "env.VLLM_EXL3_MOE_STRICT=0", "gates.markers=[]",
                                          "gates.forbidden=[]"])
    assert loose.gates.markers == [] and loose.gates.forbidden == []


def test_an_empty_mapping_in_a_child_clears_the_parents(tmp_path):
    """The ppl seat runs without speculation; its `tok_s: {}` merged into the canon's kept the
    speculative tok/s and acceptance references, so a correct spec-off run read as 0.53x."""
    p = load_profile("8x16gb-ppl")
    assert p.vllm.speculative_config is None
    assert p.reference.tok_s == {} and p.reference.acceptance_length == {}
    assert p.reference.ppl is not None and p.reference.ppl.value == 6.7159
    child = write(tmp_path, {"extends": "cpu-demo", "name": "bare", "env": {}})
    assert load_profile(str(child)).env == {}
    kept = write(tmp_path, {"extends": "cpu-demo", "name": "more", "env": {"EXTRA": "1"}}, "more.yaml")
    env = load_profile(str(kept)).env
    assert env["EXTRA"] == "1" and set(load_profile("cpu-demo").env) <= set(env)


def test_decode_rows_without_max_num_seqs_are_vllms_default_batch():
    """Unset, vLLM batches up to 256 sequences: decode rows of 1 x (1 + k) let an lna2 plan pass
    that declines every full batch."""
    p = load_profile("8x16gb-380k", ["vllm.max_num_seqs=null"])
    assert p.decode_rows() == 256 * 4


@pytest.mark.parametrize("value, kind", [("{a: 2024-01-01}", "date"), ("{a: !!binary /w==}", "bytes"),
                                         ("{a: [1, {b: 2024-01-01 10:00:00}]}", "datetime")])
def test_a_value_json_has_no_type_for_is_refused_where_vllm_would_get_it(value, kind):
    """YAML reads these as date / bytes; check-seat passed them and `up` crashed at json.dumps."""
    with pytest.raises(ProfileError, match=f"is a {kind} .*which JSON cannot carry; quote it") as e:
        load_profile("cpu-demo", [f"vllm.compilation_config={value}"])
    assert "\n" not in e.value.message
    assert load_profile("cpu-demo", ["vllm.compilation_config={a: '2024-01-01'}"]).vllm.compilation_config == {
        "a": "2024-01-01"}


def test_a_profile_nested_past_the_parser_is_one_line(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("extends: cpu-demo\nvllm:\n  compilation_config: {a: " + "[" * 3000 + "]" * 3000 + "}\n")
    with pytest.raises(ProfileError, match="nests deeper than YAML can be read here"):
        load_profile(str(deep))
    with pytest.raises(ProfileError, match="the value nests deeper"):
        load_profile("cpu-demo", ["vllm.compilation_config={a: " + "[" * 3000 + "]" * 3000 + "}"])


def test_set_gets_the_alias_guards_a_file_gets():
    with pytest.raises(ProfileError, match="expands to more than 100,000 values"):
        load_profile("cpu-demo", ["vllm.compilation_config={a: &a [*a]}"])
    laughs = "{" + ", ".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}" if i else "1"] * 9) + "]" for i in range(7)) + "}"
    with pytest.raises(ProfileError, match="expands to more than 100,000 values"):
        load_profile("cpu-demo", [f"vllm.compilation_config={laughs}"])


def test_a_huge_file_is_refused_by_its_size(tmp_path):
    huge = tmp_path / "huge.yaml"
    huge.write_text("extends: cpu-demo\n" + "# padding\n" * 200_000)
    with pytest.raises(ProfileError, match=r"profile .*huge.yaml is 2 MiB; a seat profile is a few KB"):
        load_profile(str(huge))


@pytest.mark.parametrize("text", ["extends:\n", "extends: ''\n", "extends: '  '\n"])
def test_an_empty_extends_is_named_not_read_as_no_parent(tmp_path, text):
    """An empty `extends:` read as no parent, and the error was the parent's keys missing here."""
    p = tmp_path / "child.yaml"
    p.write_text("name: child\n" + text)
    with pytest.raises(ProfileError) as e:
        load_profile(str(p))
    assert e.value.message == f"profile child.yaml: 'extends' is empty ({p})"
    assert "remove the key" in e.value.hint


def test_an_empty_name_is_called_by_its_file(tmp_path):
    """`name:` with nothing after it is null; the error read "profile None"."""
    p = tmp_path / "seat.yaml"
    p.write_text("name:\nextends: cpu-demo\n")
    with pytest.raises(ProfileError) as e:
        load_profile(str(p))
    assert e.value.message.startswith("profile seat.yaml: name: ") and "None" not in e.value.message


@pytest.mark.parametrize("target", ["loop", "/nonexistent/seat.yaml"])
def test_a_link_that_leads_nowhere_is_not_called_missing(tmp_path, target):
    """A symlink loop read "does not exist" (exists() is False on ELOOP) while the file is right there."""
    link = tmp_path / "seat.yaml"
    if target == "loop":
        (tmp_path / "other.yaml").symlink_to(link)
        link.symlink_to(tmp_path / "other.yaml")
    else:
        link.symlink_to(target)
    with pytest.raises(ProfileError) as e:
        load_profile(str(link))
    assert e.value.message == f"profile file '{link}' is a symbolic link that leads nowhere (dangling, or a loop)"


def test_the_images_own_active_line_is_not_dsv4serves_proof():
    """The seat image's vllm-exl3 prints "F3 LNA2 MoE kernel ACTIVE (VLLM_EXL3_MOE_KERNEL=lna2)" from
    its own kernel path; the bare marker text matched it on eight ranks with our plugin serving
    nothing, and a marker of that line was taken as the proof, so ours was never added."""
    from dsv4serve.profile import LNA2_ACTIVE
    from dsv4serve.ranklog import SeatTracker

    image_line = "F3 LNA2 MoE kernel ACTIVE (VLLM_EXL3_MOE_KERNEL=lna2)"
    p = load_profile("8x16gb-380k", ['gates.markers=[{text: "F3 LNA2 MoE kernel ACTIVE", ranks: all}]'])
    assert [m.text for m in p.gates.markers] == ["F3 LNA2 MoE kernel ACTIVE", LNA2_ACTIVE]
    canon = load_profile("8x16gb-380k")
    tr = SeatTracker(8, [m.text for m in canon.gates.markers], canon.gates.forbidden)
    for r in range(8):
        tr.feed(f"(Worker_TP{r} pid={200 + r}) INFO dsv4serve plugin ready rank={r}/8 moe_layers=43 kernel=lna2")
        tr.feed(f"(Worker_TP{r} pid={200 + r}) WARNING 09-04 [exl3.py] {image_line}")
    assert tr.missing_markers()[LNA2_ACTIVE] == list(range(8))
    for r in range(8):
        tr.feed(f"(Worker_TP{r} pid={200 + r}) WARNING LNA2 MoE kernel ACTIVE rank={r}/8 layers=43 bits=2,3 "
                "ext=b557db3a35138 policy=builtin")
    assert not tr.missing_markers()


@pytest.mark.parametrize("where, overrides, text", [
    ("env.FOO", [], 'extends: cpu-demo\nenv: {FOO: "a\\0b"}\n'),
    ("model.served_name", ['model.served_name="x\\0y"'], "extends: cpu-demo\n"),
    ("vllm.extra_args.0", [], 'extends: cpu-demo\nvllm: {extra_args: ["--x\\0"]}\n'),
])
def test_a_nul_byte_is_refused_at_load(tmp_path, where, overrides, text):
    """No argv or env entry can carry NUL: up passed every check, crashed at spawn with a traceback
    and left the seat recorded as launching with no pid, refusing every later up (helper audit)."""
    p = tmp_path / "seat.yaml"
    p.write_text(text)
    with pytest.raises(ProfileError) as e:
        load_profile(str(p), overrides)
    assert e.value.message.startswith(f"profile seat: {where} holds a NUL byte") and e.value.hint


def test_a_files_bad_env_name_is_not_blamed_on_an_unrelated_set(tmp_path):
    """loc is ("env",) for every env key, so any --set env.X was named as the source (helper audit)."""
    p = tmp_path / "seat.yaml"
    p.write_text("extends: cpu-demo\nenv: {1X: a}\n")
    with pytest.raises(ProfileError) as e:
        load_profile(str(p), ["env.FOO=1"])
    assert e.value.message.endswith(f"(in {p})") and "--set" not in e.value.message
    with pytest.raises(ProfileError) as e:
        load_profile("cpu-demo", ["env.2Y=1"])
    assert e.value.message.endswith("(from --set env.2Y)")


def test_vllm_flags_without_a_key_of_their_own_still_pass_through():
    p = load_profile("cpu-demo", ['vllm.extra_args=["--max-loras", "2", "-O3", "--enable-chunked-prefill", "-n", "1"]'])
    assert p.vllm.extra_args == ["--max-loras", "2", "-O3", "--enable-chunked-prefill", "-n", "1"]


def test_a_long_extends_chain_is_named_as_such(tmp_path):
    """A chain thousands of files deep read as "nests deeper than YAML can be read here", naming a
    one-line file (helper audit)."""
    from dsv4serve.profile import MAX_EXTENDS

    for i in range(MAX_EXTENDS + 2):
        (tmp_path / f"d{i}.yaml").write_text(f"extends: d{i + 1}.yaml\n" if i <= MAX_EXTENDS else "extends: cpu-demo\n")
    with pytest.raises(ProfileError) as e:
        load_profile(str(tmp_path / "d0.yaml"))
    assert e.value.message == f"profile d0.yaml: its extends chain is more than {MAX_EXTENDS} files deep"
    assert load_profile(str(tmp_path / f"d{MAX_EXTENDS - 1}.yaml")).vllm.tensor_parallel_size == 2


def test_vllms_own_short_flags_and_capture_size_flags_are_read_as_vllm_reads_them():
    """Review: -dpl / -dpa (data-parallel flags of their own) were refused as -dp with a value, a
    made-up --no-compilation-config claimed --no-co, and --cudagraph-capture-sizes (which writes
    compilation_config) went past the guard."""
    assert load_profile("cpu-demo", ['vllm.extra_args=["-dpl", "1", "--no-co"]']).vllm.extra_args == ["-dpl", "1",
                                                                                                    "--no-co"]
    for extra in ('["-dp4"]', '["--cudagraph-capture-sizes", "32"]', '["--max-cudagraph-capture-size=64"]'):
        with pytest.raises(ProfileError):
            load_profile("cpu-demo", [f"vllm.extra_args={extra}"])


def test_an_exponent_without_a_point_is_explained():
    """YAML 1.1 reads 1e3 as text; the error said only "Input should be a valid number" (audit)."""
    with pytest.raises(ProfileError) as e:
        load_profile("cpu-demo", ["gates.timeouts.stall_s=1e3"])
    assert e.value.hint == "YAML reads 1e3 as text, not a number: write 1000"


def test_a_hash_in_a_set_value_is_text_or_refused_never_a_silent_comment():
    """` #` starts a YAML comment: `--set env.OMP_NUM_THREADS=#1` deleted the variable and
    `gates.canary.prompt=Say ready #now` sent "Say ready" (helper audit)."""
    assert load_profile("cpu-demo", ["env.OMP_NUM_THREADS=#1"]).env["OMP_NUM_THREADS"] == "#1"
    assert load_profile("cpu-demo", ["env.FOO=abc #1"]).env["FOO"] == "abc #1"
    assert "OMP_NUM_THREADS" not in load_profile("cpu-demo", ["env.OMP_NUM_THREADS=null"]).env
    with pytest.raises(ProfileError, match="reads the '#' in this value as the start of a comment"):
        load_profile("cpu-demo", ["gates.canary.prompt=Say ready #now"])
    assert load_profile("cpu-demo", ['gates.canary.prompt="Say ready #now"']).gates.canary.prompt == "Say ready #now"
    assert load_profile("cpu-demo", ["gates.canary.prompt=a#b"]).gates.canary.prompt == "a#b"


def test_a_list_that_does_not_parse_is_called_bad_yaml_not_a_wrong_type():
    with pytest.raises(ProfileError, match=r"--set 'gpus.ids': the value is not valid YAML") as e:
        load_profile("cpu-demo", ["gpus.ids=[0, 1"])
    assert "should be a valid list" not in e.value.line()
    # inside a free-form mapping nothing would check a broken list later: still bad YAML (review)
    with pytest.raises(ProfileError, match="the value is not valid YAML"):
        load_profile("cpu-demo", ['vllm.compilation_config.custom_ops=["+rms_norm", "-silu_and_mul"'])
    # a text key's text that merely starts with a bracket is still text (review)
    assert load_profile("cpu-demo", ["gates.canary.prompt=[INST] say ready [/INST]"]).gates.canary.prompt == \
        "[INST] say ready [/INST]"


def test_loose_numbers_and_an_unset_window_are_refused():
    """memory_gib took true as 1.0 and 0 / -5; kv_cache_tokens took true and 1.0; a KV gate that
    follows an unset max_model_len was no gate (helper audit)."""
    for bad in ("gpus.memory_gib=true", "gpus.memory_gib=0", "gpus.memory_gib=-5", "reference.kv_cache_tokens=true",
                "reference.kv_cache_tokens=1.0", "reference.ppl={value: 5.0, ctx: 0, chunks: 1}"):
        with pytest.raises(ProfileError):
            load_profile("cpu-demo", [bad])
    with pytest.raises(ProfileError, match=r"max_model_len follows vllm.max_model_len, which is not set.*"
                                           r"\(from --set vllm.max_model_len\)"):
        load_profile("cpu-demo", ["vllm.max_model_len=null"])


def test_a_whole_profile_error_names_the_set_that_caused_it():
    with pytest.raises(ProfileError, match=r"exceeds vllm.tensor_parallel_size.*\(from --set gates.markers\)"):
        load_profile("cpu-demo", ['gates.markers=[{text: "x", ranks: 3}]'])


def test_a_renamed_shipped_profile_is_named_again_by_its_profile_name():
    """`--set name=myseat` renames the seat; hints built from cli_ref() said `--profile myseat`,
    which is no profile (helper audit)."""
    assert load_profile("cpu-demo", ["name=myseat"]).cli_ref() == "cpu-demo"


def test_values_nothing_would_read_are_refused():
    from dsv4serve import launch

    with pytest.raises(ProfileError, match="the demo model would be served, not /srv/x"):
        launch.check_plan(load_profile("cpu-demo", ["model.path=/srv/x"]))
    with pytest.raises(ProfileError, match="moe.extension is an lna2 build, and moe.kernel is incumbent"):
        launch.check_plan(load_profile("8x16gb-380k-incumbent", ["moe.extension=/srv/x.so"]))


def test_a_profile_reached_through_a_link_is_named_again_by_the_link(tmp_path):
    """ref() resolved the link: a seat up'd through `my-seat.yaml -> real.yaml` (no `name:`) is
    named my-seat, but was reloaded from real.yaml, another name and digest (review)."""
    real = tmp_path / "real.yaml"
    real.write_text("extends: cpu-demo\n")
    link = tmp_path / "my-seat.yaml"
    link.symlink_to(real)
    p = load_profile(str(link))
    assert p.name == "my-seat" and p.ref() == str(link)
    again = load_profile(p.ref())
    assert again.name == "my-seat" and again.digest() == p.digest()


@pytest.mark.parametrize("override, said", [
    ("env.VLLM_LOGGING_PREFIX=seat", "env.VLLM_LOGGING_PREFIX=seat changes the log lines the gates read"),
    ("env.VLLM_CONFIGURE_LOGGING=0", "env.VLLM_CONFIGURE_LOGGING=0 changes the log lines"),
    ("env.VLLM_LOGGING_CONFIG_PATH=/x.json", "env.VLLM_LOGGING_CONFIG_PATH=/x.json changes the log lines"),
    ("env.VLLM_LOGGING_LEVEL=error", "env.VLLM_LOGGING_LEVEL=error changes the log lines"),
    # the KV cache size and the server's start are INFO lines the gates read (review)
    ("env.VLLM_LOGGING_LEVEL=WARNING", "env.VLLM_LOGGING_LEVEL=WARNING changes the log lines"),
    ('vllm.extra_args=["--uvicorn-log-level", "warning"]', "--uvicorn-log-level warning changes the log lines"),
    ('vllm.extra_args=["--logging-config", "{}"]', "--logging-config changes the log lines the gates read"),
    ('vllm.extra_args=["--log-config-file=/x.json"]', "--log-config-file changes the log lines"),
    # a level above WARNING in any spelling vLLM and logging take (review)
    ("env.VLLM_LOGGING_LEVEL=FATAL", "env.VLLM_LOGGING_LEVEL=FATAL changes the log lines"),
    ("env.VLLM_LOGGING_LEVEL='40'", "env.VLLM_LOGGING_LEVEL=40 changes the log lines"),
    ('vllm.extra_args=["--log-level", "ERROR"]', "--log-level ERROR changes the log lines"),
    ('vllm.extra_args=["--log_level=critical"]', "--log_level critical changes the log lines"),
])
def test_what_would_hide_the_log_lines_the_gates_read_is_refused(override, said):
    """A logging prefix, a JSON formatter, vLLM's logging off, or a level above WARNING made every
    rank's proof line vanish or lose its rank, and the gate then blamed the plugin (ranklog audit)."""
    with pytest.raises(ProfileError) as e:
        load_profile("cpu-demo", [override])
    assert said in e.value.line()
    assert load_profile("cpu-demo", ["env.VLLM_LOGGING_LEVEL=DEBUG"]).env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert load_profile("cpu-demo", ['vllm.extra_args=["--log-level", "info"]']).vllm.extra_args


def test_a_native_seat_does_not_inherit_what_would_hide_its_log_lines(monkeypatch, tmp_path):
    from dsv4serve import launch

    for k, v in (("VLLM_LOGGING_PREFIX", "x"), ("VLLM_CONFIGURE_LOGGING", "0"), ("VLLM_LOGGING_LEVEL", "ERROR"),
                 ("VLLM_LOGGING_STREAM", "ext://sys.stderr"), ("SOME_OTHER", "kept"),
                 # a shell left with the old canon's kernel choice: the plan never saw it (review)
                 ("VLLM_EXL3_MOE_KERNEL", "lna2"), ("VLLM_EXL3_MOE_STRICT", "2")):
        monkeypatch.setenv(k, v)
    spec = launch.build(load_profile("cpu-demo"), run_id="r", run_dir=tmp_path / "run")
    env = launch.env_for_child(spec)
    assert env["SOME_OTHER"] == "kept"
    assert not {"VLLM_LOGGING_PREFIX", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM",
                "VLLM_EXL3_MOE_KERNEL"} & set(env)
    assert env.get("VLLM_EXL3_MOE_STRICT") == spec.env.get("VLLM_EXL3_MOE_STRICT")  # the launcher's, not the shell's
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "debug")
    assert launch.env_for_child(spec)["VLLM_LOGGING_LEVEL"] == "debug"


@pytest.mark.parametrize("spec, drafts", [
    ("{method: dspark, num_speculative_tokens: 3}", True),
    ("{method: deepseek_mtp, num_speculative_tokens: 1}", True),  # vLLM maps the *_mtp names to mtp
    ("{method: dspark}", True),  # the count left to vLLM, which fills it in
    ("{method: mtp, model: /srv/pack, num_speculative_tokens: 3}", True),  # the pack itself, named
    ("{method: mtp, model: /srv/other, num_speculative_tokens: 3}", False),
    ("{method: eagle3, model: /srv/eagle, num_speculative_tokens: 3}", False),
    ("{method: ngram, num_speculative_tokens: 2, prompt_lookup_max: 3}", False),
    ("{method: '[ngram]', num_speculative_tokens: 2}", False),
    ("{method: extract_hidden_states, num_speculative_tokens: 1}", False),
    ("null", False),
])
def test_which_speculation_loads_the_packs_draft_layers(spec, drafts):
    """check-seat requires the pack's draft layers (and counts their weights) only where vLLM loads
    them: a missing count and `model` naming the pack still do; proposers without a draft do not (review)."""
    p = load_profile("8x16gb-380k", ["model.path=/srv/pack", f"vllm.speculative_config={spec}"])
    assert p.drafts_from_pack() is drafts
