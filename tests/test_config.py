"""profiles.yaml validation: every kind of mistake gets one clear message."""

import dataclasses
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine import ConfigError, load_config
from engine.launch import GIB, Machine, cpu_dtype, engine_groups, engine_setup, group_setup
from engine.pool import capacity_line
from engine import settings as settings_module
from engine.settings import SETTINGS, Setting, check_all, setting
from engine.steps import STEP_CLASSES_KEY
from tools.chainlit_client import chainlit_command, side_by_side

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = yaml.safe_load((ROOT / "profiles.yaml").read_text())


def write(tmp_path, data, text=None) -> Path:
    path = tmp_path / "profiles.yaml"
    path.write_text(text if text is not None else yaml.safe_dump(data))
    return path


def mutated(change):
    data = yaml.safe_load(yaml.safe_dump(SHIPPED))
    change(data)
    return data


def test_shipped_file_loads_with_both_presets():
    config = load_config(ROOT / "profiles.yaml", env={})
    assert [p.name for p in config.used_presets()] == ["latency-first", "throughput-first"]
    assert {p.name for p in config.profiles} >= {"Latency-first", "Throughput-first"}
    assert all(p.description and p.icon and p.starters for p in config.profiles)
    assert config.default_profile.name == "Latency-first"
    assert config.profile_or_default("Throughput-first").name == "Throughput-first"
    assert config.profile_or_default("No such profile") is config.default_profile
    fast, big = config.presets["latency-first"], config.presets["throughput-first"]
    # Latency-first takes smaller steps without a GPU; with one, the same steps (smaller
    # pieces measured worse on the H200: BENCHMARKS.md). Either way its steps are never the
    # larger, its seats the fewer; on a GPU it is promised a pace on the shared engine (its
    # step budget bounds a CPU step).
    cpu_small, cpu_large = fast.options(False), big.options(False)
    assert cpu_small["max_num_batched_tokens"] < cpu_large["max_num_batched_tokens"]
    assert cpu_small["max_num_seqs"] <= cpu_large["max_num_seqs"]
    gpu_small, gpu_large = fast.options(True), big.options(True)
    assert gpu_small["max_num_batched_tokens"] <= gpu_large["max_num_batched_tokens"]
    assert gpu_small["max_num_seqs"] < gpu_large["max_num_seqs"]
    assert fast.pace(gpu=True) > 0 and fast.pace(gpu=False) is None
    assert big.pace(gpu=True) is None


CASES = [
    # (what is wrong, change, field named, words the message must contain)
    ("unknown top-level key", lambda d: d.update(modle="auto"), "modle", "unknown key"),
    ("unknown profile key", lambda d: d["profiles"][0].update(colour="red"),
     "profiles[0].colour", "allowed:"),
    ("missing required", lambda d: d["profiles"][1].pop("preset"), "profiles[1].preset",
     "missing"),
    ("wrong type", lambda d: d["profiles"][0].update(name=5), "profiles[0].name", "text"),
    ("temperature out of range", lambda d: d["profiles"][0]["sampling"].update(temperature=3),
     "profiles[0].sampling.temperature", "<= 2"),
    ("max_tokens zero", lambda d: d["profiles"][0]["sampling"].update(max_tokens=0),
     "profiles[0].sampling.max_tokens", ">= 1"),
    ("bool is not a number", lambda d: d["profiles"][0]["sampling"].update(top_p=True),
     "profiles[0].sampling.top_p", "number"),
    ("unknown preset", lambda d: d["profiles"][0].update(preset="fastest"),
     "profiles[0].preset", "allowed: latency-first, throughput-first"),
    ("unknown vLLM option", lambda d: d["presets"]["latency-first"]["vllm"].update(
        max_num_seq=8), "presets.latency-first.vllm.max_num_seq", "max_num_seqs"),
    ("vLLM option of the wrong type", lambda d: d["presets"]["throughput-first"]["vllm"].update(
        max_num_seqs="many"), "presets.throughput-first.vllm.max_num_seqs", "whole number"),
    ("unknown vLLM option for CPUs", lambda d: d["presets"]["latency-first"]["vllm_cpu"].update(
        max_batched=8), "presets.latency-first.vllm_cpu.max_batched", "not a vLLM"),
    ("vLLM literal option", lambda d: d["vllm"].update(dtype="fp7"), "vllm.dtype",
     "'bfloat16'"),
    ("managed option", lambda d: d["presets"]["latency-first"]["vllm"].update(
        gpu_memory_utilization=0.5), "presets.latency-first.vllm.gpu_memory_utilization",
     "memory_share"),
    ("shares over 1", lambda d: d["presets"]["latency-first"].update(memory_share=0.8),
     "presets.*.memory_share", "at most 1.0"),
    ("share of zero", lambda d: d["presets"]["latency-first"].update(memory_share=0),
     "presets.latency-first.memory_share", "> 0"),
    ("duplicate profile names", lambda d: d["profiles"][1].update(name="Latency-first"),
     "profiles", "unique"),
    ("no profiles", lambda d: d.update(profiles=[]), "profiles", "at least one"),
    ("starter without message", lambda d: d["profiles"][0]["starters"][0].pop("message"),
     "profiles[0].starters[0].message", "missing"),
    ("memory out of range", lambda d: d["memory"].update(gpu_memory_utilization=1.5),
     "memory.gpu_memory_utilization", "<= 1"),
    ("pace for an unknown device", lambda d: d["presets"]["latency-first"].update(
        step_ms={"tpu": 5}), "presets.latency-first.step_ms.tpu", "allowed: cpu, gpu"),
    ("pace of no time", lambda d: d["presets"]["latency-first"].update(step_ms={"gpu": 0}),
     "presets.latency-first.step_ms.gpu", "> 0"),
    ("long prompts' piece missing", lambda d: d["presets"]["latency-first"].update(
        long_prompts={"gpu": {"context": 65536}}), "presets.latency-first.long_prompts.gpu.piece",
     "missing"),
    ("long prompts' piece of nothing", lambda d: d["presets"]["latency-first"].update(
        long_prompts={"gpu": {"piece": 0, "context": 65536}}),
     "presets.latency-first.long_prompts.gpu.piece", ">= 1"),
]


@pytest.mark.parametrize("what,change,field,words", CASES, ids=[c[0] for c in CASES])
def test_each_mistake_names_file_field_and_allowed(tmp_path, what, change, field, words):
    path = write(tmp_path, mutated(change))
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert err.value.field == field
    assert str(path) in str(err.value) and words in str(err.value)


def test_invalid_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, None, text="profiles: [\n"), env={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", env={})


def test_environment_overrides_are_applied_and_checked(tmp_path):
    path = write(tmp_path, SHIPPED)
    config = load_config(path, env={"VCHAT_MODEL": "/models/x", "VCHAT_MAX_MODEL_LEN": "1024",
                                    "VCHAT_ENFORCE_EAGER": "1", "VCHAT_KV_CACHE_GIB": "2"})
    assert config.model == "/models/x" and config.vllm["max_model_len"] == 1024
    assert config.vllm["enforce_eager"] is True and config.memory.cpu_kv_cache_gib == 2
    with pytest.raises(ConfigError, match="VCHAT_MAX_MODEL_LEN"):
        load_config(path, env={"VCHAT_MAX_MODEL_LEN": "lots"})


@pytest.mark.parametrize("name, value, words", [
    ("VCHAT_ENFORCE_EAGER", "ture", "must be one of 1, true, yes, on, 0, false, no, off"),
    ("VCHAT_MAX_MODEL_LEN", "2k", "must be a whole number"),
    ("VCHAT_MAX_MODEL_LEN", "-5", "must be at least -1"),
    ("VCHAT_KV_CACHE_GIB", "0", "must be above 0"),
    ("VCHAT_KV_CACHE_GIB", "nan", "must be above 0"),
    ("VCHAT_STREAM_INTERVAL_MS", "40ms", "must be a whole number"),
    ("VCHAT_SHUTDOWN_GRACE_S", "-1", "must be at least 0"),
    ("VCHAT_ENGINE", "fast", "must be one of vllm, stand-in"),
    ("VCHAT_STANDIN_TOKENS_PER_S", "x", "must be a number"),
    ("VCHAT_BENCH_IGNORE_EOS", "maybe", "must be one of"),
])
def test_every_setting_refuses_a_bad_value_naming_the_variable(name, value, words):
    """Regression: bare int() gave tracebacks, and VCHAT_ENFORCE_EAGER=ture meant false."""
    with pytest.raises(ConfigError) as err:
        setting(name, {name: value})
    assert err.value.field == name and words in str(err.value) and repr(value) in str(err.value)


def test_settings_read_their_values_and_defaults():
    assert setting("VCHAT_ENFORCE_EAGER", {"VCHAT_ENFORCE_EAGER": "Yes"}) is True
    assert setting("VCHAT_ENFORCE_EAGER", {"VCHAT_ENFORCE_EAGER": "0"}) is False
    assert setting("VCHAT_ENFORCE_EAGER", {}) is None  # unset: profiles.yaml decides
    assert setting("VCHAT_SHUTDOWN_GRACE_S", {}) == 10.0
    assert setting("VCHAT_STREAM_INTERVAL_MS", {"VCHAT_STREAM_INTERVAL_MS": "0"}) == 0
    # One prefix, but for the names other software gives them.
    assert all((name.startswith("VCHAT_") or name in ("DATABASE_URL", "CHAINLIT_AUTH_SECRET"))
               and spec.doc for name, spec in SETTINGS.items())


def test_the_code_reads_no_variable_of_its_own_outside_the_table():
    """One table (issue 28: CHAT_ and BASELINE_ names, DATABASE_URL and the data folder were
    read beside it): every name of the product's own the code mentions is in it, as a name
    or a former name; and the environment reads of any other name are other software's
    (vLLM's, CUDA's, a request's HTTP_ headers) or the stack sampler's diagnostic switch."""
    known = set(SETTINGS) | {a for s in SETTINGS.values() for a in s.aliases}
    names, reads = set(), set()
    for path in [*ROOT.glob("*.py"), *ROOT.glob("engine/*.py"), *ROOT.glob("chat/*.py"),
                 *ROOT.glob("api/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("tools/*.py"),
                 *ROOT.glob("store/*.py"), *ROOT.glob("service/*.py")]:
        code = path.read_text()
        names |= set(re.findall(r"\b(?:VCHAT_[A-Z_]+|CHAT_(?:ADMIN|API)_[A-Z_]+|"
                                r"BASELINE_[A-Z_]+|DATABASE_URL|CHAINLIT_AUTH_SECRET)\b", code))
        if path.name != "settings.py":
            reads |= set(re.findall(r'(?:environ|env)(?:\.get\(|\[)"([A-Z][A-Z0-9_]+)"', code))
    assert names <= known, names - known
    others = {r for r in reads - known
              if not r.startswith(("VLLM_", "CUDA_", "TRITON_", "HTTP_", "STACK_SAMPLES"))}
    assert others == set(), others


def test_the_readmes_table_lists_exactly_the_settings():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| variable | what | default |"):]
    table = table[:table.index("\n\n")]
    listed = set()
    for row in table.splitlines()[2:]:
        listed |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1]))
    assert listed == set(SETTINGS), (listed - set(SETTINGS), set(SETTINGS) - listed)


def test_a_former_name_still_works_once_warned_and_a_secret_is_never_repeated(caplog):
    settings_module._WARNED.discard("CHAT_API_KEY")
    with caplog.at_level(logging.WARNING, logger="engine.settings"):
        assert setting("VCHAT_API_KEY", {"CHAT_API_KEY": "old key"}) == "old key"
        assert setting("VCHAT_API_KEY", {"CHAT_API_KEY": "old key"}) == "old key"
        assert setting("VCHAT_API_KEY", {"CHAT_API_KEY": "old", "VCHAT_API_KEY": "new"}) == \
            "new"
    assert ["CHAT_API_KEY is now called VCHAT_API_KEY" in r.getMessage()
            for r in caplog.records] == [True], "warned once"
    with pytest.raises(ConfigError) as err:
        setting("VCHAT_BASELINE_IGNORE_EOS", {"VCHAT_BASELINE_IGNORE_EOS": "sure"})
    assert "'sure'" in str(err.value)
    secret = Setting("VCHAT_X", settings_module.whole(1), None, "a secret number", secret=True)
    with pytest.raises(ConfigError) as err:
        with_settings({"VCHAT_X": secret}, lambda: setting("VCHAT_X", {"VCHAT_X": "hunter2"}))
    assert "hunter2" not in str(err.value) and "VCHAT_X" in str(err.value)
    check_all({})  # every default reads
    with pytest.raises(ConfigError, match="VCHAT_GC_YOUNG_OBJECTS"):
        check_all({"VCHAT_GC_YOUNG_OBJECTS": "0"})


def with_settings(extra: dict, call):
    settings_module.SETTINGS.update(extra)
    try:
        return call()
    finally:
        for name in extra:
            settings_module.SETTINGS.pop(name)


def test_a_bad_setting_stops_the_app_and_the_check_with_one_clear_line():
    env = {**os.environ, "VCHAT_ENFORCE_EAGER": "ture", "VCHAT_SHUTDOWN_GRACE_S": "soon"}
    check, app, launcher = side_by_side(  # at once: each spends ~15 s importing vLLM
        ([sys.executable, "-m", "engine", "check"], env),
        (chainlit_command() + ["run", "app.py", "--headless", "--port", "0"],
         {**env, "VCHAT_ENFORCE_EAGER": "1"}),
        ([sys.executable, "-m", "launcher", "--port", "0"],  # what `make run` runs
         {**env, "VCHAT_FRONT_ENDS": "none"}))
    assert check.returncode == 2 and "Traceback" not in check.stderr
    assert "VCHAT_ENFORCE_EAGER" in check.stderr and "'ture'" in check.stderr
    assert app.returncode != 0 and "Traceback" not in app.stdout + app.stderr
    assert "Configuration error: environment: VCHAT_SHUTDOWN_GRACE_S" in app.stderr
    assert launcher.returncode != 0 and "Traceback" not in launcher.stdout + launcher.stderr
    assert "Configuration error: environment: VCHAT_" in launcher.stderr


CPU = Machine(gpu=False, cores=2, cpu_flags=frozenset({"avx512f", "avx512_fp16"}))
GPU = Machine(gpu=True, cores=16)


def test_engine_setup_splits_memory_and_picks_eager_mode_per_device():
    config = load_config(ROOT / "profiles.yaml", env={})
    fast, big = config.presets["latency-first"], config.presets["throughput-first"]
    cpu = engine_setup(config, fast, "/m", CPU, env={}).args
    assert cpu["model"] == "/m" and cpu["enforce_eager"] is True
    assert cpu["dtype"] == "float16"  # this machine's pick (test below)
    assert cpu["kv_cache_memory_bytes"] == int(config.memory.cpu_kv_cache_gib * 0.5 * GIB)
    assert cpu["max_num_batched_tokens"] == fast.vllm_cpu["max_num_batched_tokens"]
    gpu = [engine_setup(config, p, "/m", GPU, env={}) for p in (fast, big)]
    assert all(s.args["enforce_eager"] is False and "kv_cache_memory_bytes" not in s.args
               for s in gpu)
    assert all(s.args["dtype"] == "auto" for s in gpu)
    # Spawned engine processes (a fork would inherit Chainlit: engine/launch.py); compiled
    # kernels kept in the cache folder for the next start.
    home = Path.home() / ".cache" / "vchat"
    assert all(s.env == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                         "TRITON_CACHE_DIR": str(home / "triton"),
                         "VLLM_CACHE_ROOT": str(home / "vllm")} for s in gpu)
    mine = engine_setup(config, fast, "/m", GPU, env={"TRITON_CACHE_DIR": "/t",
                                                       "VCHAT_CACHE_DIR": "/c"}).env
    assert "TRITON_CACHE_DIR" not in mine and mine["VLLM_CACHE_ROOT"] == "/c/vllm"
    assert gpu[0].args["max_num_batched_tokens"] == fast.vllm_gpu["max_num_batched_tokens"]
    assert gpu[1].args["max_num_seqs"] == big.vllm_gpu["max_num_seqs"]
    assert all(s.args["enable_prefix_caching"] for s in gpu)  # the shared `vllm:` part
    assert "load_format" not in gpu[0].args  # real weights unless the model has none
    assert sum(s.args["gpu_memory_utilization"] for s in gpu) <= (
        config.memory.gpu_memory_utilization)
    forced = load_config(ROOT / "profiles.yaml", env={"VCHAT_ENFORCE_EAGER": "0"})
    assert engine_setup(forced, fast, "/m", CPU, env={}).args["enforce_eager"] is False


def test_the_presets_share_one_engine_by_priority():
    config = load_config(ROOT / "profiles.yaml", env={})
    (group,) = engine_groups(config)
    assert [p.name for p in group.presets] == ["latency-first", "throughput-first"]
    args = group_setup(config, group, "/m", GPU, env={}).args
    fast, big = config.presets["latency-first"], config.presets["throughput-first"]
    assert args["scheduling_policy"] == "priority"
    assert args["max_num_seqs"] == fast.vllm_gpu["max_num_seqs"] + big.vllm_gpu["max_num_seqs"]
    # The engine takes the largest step; Latency-first's pace and long prompts' pieces
    # apply while its turns run (engine/steps.py, in vLLM's process); on a GPU its step is
    # the same as the engine's.
    assert args["max_num_batched_tokens"] == big.vllm_gpu["max_num_batched_tokens"]
    pieces = fast.long_prompts["gpu"]
    assert args["additional_config"][STEP_CLASSES_KEY] == {"0": {
        "step_ms": fast.step_ms["gpu"], "long_piece": pieces["piece"],
        "long_context": pieces["context"]}}
    assert args["gpu_memory_utilization"] == config.memory.gpu_memory_utilization
    # Without a GPU: Latency-first's step budget and prompt pieces, no pace.
    cpu_args = group_setup(config, group, "/m", CPU, env={}).args
    assert cpu_args["max_num_batched_tokens"] == big.vllm_cpu["max_num_batched_tokens"]
    assert "long_prefill_token_threshold" not in cpu_args  # Throughput-first's: whole prompts
    assert cpu_args["additional_config"][STEP_CLASSES_KEY] == {"0": {
        key: fast.vllm_cpu[key]
        for key in ("max_num_batched_tokens", "long_prefill_token_threshold")}}
    # Asked for: an engine per preset.
    apart = load_config(ROOT / "profiles.yaml", env={"VCHAT_ENGINES": "per-preset"})
    assert [g.name for g in engine_groups(apart)] == ["latency-first", "throughput-first"]
    shared = load_config(ROOT / "profiles.yaml", env={"VCHAT_ENGINES": "shared"})
    assert [len(g.presets) for g in engine_groups(shared)] == [2]
    # Presets on GPUs of their own never share.
    own = dataclasses.replace(config, presets={
        "latency-first": dataclasses.replace(fast, gpus=(0,)),
        "throughput-first": dataclasses.replace(big, gpus=(1,))})
    assert [len(g.presets) for g in engine_groups(own)] == [1, 1]
    with pytest.raises(ConfigError, match="engines: must be one of auto, shared, per-preset"):
        load_config(ROOT / "profiles.yaml", env={}) and _build_with(engines="sometimes")


def _build_with(**top):
    from engine.config import _build

    raw = yaml.safe_load((ROOT / "profiles.yaml").read_text())
    return _build("profiles.yaml", {**raw, **top})


def test_without_a_gpu_the_dtype_follows_the_cpu_and_profiles_yaml_can_set_it(tmp_path):
    # float16 only where it was measured to win: AVX512-FP16 without AMX.
    assert cpu_dtype(frozenset({"avx512f", "avx512_bf16", "avx512_fp16"})) == "float16"
    assert cpu_dtype(frozenset({"avx512f", "avx512_fp16", "amx_tile", "amx_bf16"})) == "float32"
    assert cpu_dtype(frozenset({"avx2", "fma"})) == "float32"
    assert cpu_dtype(frozenset()) == "float32"  # no /proc/cpuinfo: the safe choice
    path = write(tmp_path, mutated(lambda d: d["vllm"].update(dtype="bfloat16")))
    config = load_config(path, env={})
    for preset in config.presets.values():
        assert engine_setup(config, preset, "/m", CPU, env={}).args["dtype"] == "bfloat16"


def test_small_cpus_give_every_core_to_the_model_unless_the_operator_decides():
    config = load_config(ROOT / "profiles.yaml", env={})
    preset = config.presets["throughput-first"]
    assert engine_setup(config, preset, "/m", CPU, env={}).env == {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    big_cpu = Machine(gpu=False, cores=64)
    assert engine_setup(config, preset, "/m", big_cpu, env={}).env == {}  # vLLM's default
    for own in ({"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}):
        assert engine_setup(config, preset, "/m", CPU, env=own).env == {}


def test_parallel_sizes_are_checked_against_the_gpus_present(tmp_path):
    """tensor/pipeline/data parallel sizes pass through to vLLM; their product is the GPUs
    a preset's engine needs, checked against the machine with the numbers named."""
    bad = write(tmp_path, mutated(lambda d: d["presets"]["latency-first"]["vllm"].update(
        tensor_parallel_size=0)))
    with pytest.raises(ConfigError, match="tensor_parallel_size: must be at least 1"):
        load_config(bad, env={})
    path = write(tmp_path, mutated(lambda d: d["presets"]["throughput-first"]["vllm"].update(
        tensor_parallel_size=2, data_parallel_size=2)))
    config = load_config(path, env={})
    preset = config.presets["throughput-first"]
    with pytest.raises(ConfigError, match=r"presets\.throughput-first\.vllm: "
                       r"tensor_parallel_size 2 x data_parallel_size 2 needs 4 GPUs; "
                       r"this machine has no GPU"):
        engine_setup(config, preset, "/m", CPU, env={})
    with pytest.raises(ConfigError, match="needs 4 GPUs; this machine has 2 GPUs"):
        engine_setup(config, preset, "/m", Machine(gpu=True, cores=32, gpus=2), env={})
    four = engine_setup(config, preset, "/m", Machine(gpu=True, cores=64, gpus=4), env={})
    assert (four.args["tensor_parallel_size"], four.args["data_parallel_size"]) == (2, 2)
    one = engine_setup(config, config.presets["latency-first"], "/m", CPU, env={})
    assert "tensor_parallel_size" not in one.args  # vLLM's default, one device


def own_gpus(data, fast=(0,), big=(1,), share=1.0):
    """Each preset on its own GPU, each taking all of it."""
    for name, gpus in (("latency-first", fast), ("throughput-first", big)):
        data["presets"][name].update(gpus=list(gpus), memory_share=share)


TWO_GPUS = Machine(gpu=True, cores=32, gpus=2)


def test_on_two_gpus_each_preset_gets_its_own_and_all_of_its_memory(tmp_path):
    config = load_config(write(tmp_path, mutated(own_gpus)), env={})
    fast, big = config.presets["latency-first"], config.presets["throughput-first"]
    assert (config.gpus_of(fast), config.gpus_of(big)) == ((0,), (1,))
    setups = [engine_setup(config, p, "/m", TWO_GPUS, env={}) for p in (fast, big)]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in setups] == ["0", "1"]
    assert all(s.args["gpu_memory_utilization"] == config.memory.gpu_memory_utilization
               for s in setups)  # 1.0 of each GPU's share: nobody else is on it
    # The operator's own CUDA_VISIBLE_DEVICES: our indices count among the GPUs it lets
    # this process see.
    theirs = engine_setup(config, big, "/m", TWO_GPUS, env={"CUDA_VISIBLE_DEVICES": "4,6"})
    assert theirs.env["CUDA_VISIBLE_DEVICES"] == "6"
    # The shipped file names no GPU: its engines take GPU 0 as vLLM would, no variable set.
    shipped = load_config(ROOT / "profiles.yaml", env={})
    assert {shipped.gpus_of(p) for p in shipped.used_presets()} == {(0,)}
    assert "CUDA_VISIBLE_DEVICES" not in engine_setup(
        shipped, shipped.presets["latency-first"], "/m", TWO_GPUS, env={}).env


def test_named_gpus_are_checked_against_the_machine_with_the_numbers_named(tmp_path):
    config = load_config(write(tmp_path, mutated(own_gpus)), env={})
    big = config.presets["throughput-first"]
    with pytest.raises(ConfigError, match=r"presets\.throughput-first\.gpus: GPU 1 named; "
                       r"this machine has 1 GPU \(0 to 0\)"):
        engine_setup(config, big, "/m", Machine(gpu=True, cores=16, gpus=1), env={})
    with pytest.raises(ConfigError, match="GPU 1 named; this machine has no GPU"):
        engine_setup(config, big, "/m", CPU, env={})


@pytest.mark.parametrize("change, words", [
    (lambda d: d["presets"]["latency-first"].update(gpus=1), "must be a list"),
    (lambda d: d["presets"]["latency-first"].update(gpus=[0, 0]), "distinct GPU indices"),
    (lambda d: d["presets"]["latency-first"].update(gpus=[-1]), "distinct GPU indices"),
    (lambda d: d["presets"]["latency-first"].update(gpus=["0"]), "distinct GPU indices"),
    (lambda d: d["presets"]["latency-first"].update(gpus=[0, 1]),
     "names 2 GPUs but its engine runs on 1"),
    # Both on GPU 0 (one named, one by default): together over the whole GPU.
    (lambda d: own_gpus(d, big=()), "shares of the presets in use on GPU 0 must sum to at "
                                    "most 1.0, got 2"),
    (lambda d: d["presets"]["latency-first"]["vllm_gpu"].update(device_ids=[1]),
     "set the preset's `gpus:` instead"),
], ids=["not a list", "twice", "negative", "text", "too many", "sharing GPU 0",
        "vLLM's device_ids"])
def test_bad_gpu_placements_get_one_clear_message(tmp_path, change, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(write(tmp_path, mutated(change)), env={})


def test_one_preset_on_two_gpus_through_vllms_own_parallelism(tmp_path):
    def two_for_big(d):
        d["presets"]["throughput-first"]["vllm_gpu"]["data_parallel_size"] = 2
        own_gpus(d, fast=(), big=(0, 1), share=0.5)

    config = load_config(write(tmp_path, mutated(two_for_big)), env={})
    big = config.presets["throughput-first"]
    assert config.gpus_needed(big) == 2 and config.gpus_of(big) == (0, 1)
    setup = engine_setup(config, big, "/m", TWO_GPUS, env={})
    assert setup.env["CUDA_VISIBLE_DEVICES"] == "0,1" and setup.args["data_parallel_size"] == 2
    # latency-first (no GPU named) also takes GPU 0: 0.5 + 0.5 there, 0.5 on GPU 1.
    tight = mutated(two_for_big)
    tight["presets"]["latency-first"]["memory_share"] = 0.6
    with pytest.raises(ConfigError, match="on GPU 0 must sum to at most 1.0, got 1.1"):
        load_config(write(tmp_path, tight), env={})


def test_an_engines_environment_reaches_its_processes_and_leaves_this_one_as_it_was():
    """process_env around an engine's start: what vLLM's spawned processes see, restored
    afterwards so the next engine's GPUs are its own (a real spawned child reads it)."""
    from engine.launch import process_env

    probe = [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'), "
             "os.environ.get('VCHAT_PROBE'))"]
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["VCHAT_PROBE"] = "operator's"
    try:
        with process_env({"CUDA_VISIBLE_DEVICES": "1", "VCHAT_PROBE": "engine's"}):
            seen = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
        assert seen.split() == ["1", "engine's"]
        assert os.environ.get("CUDA_VISIBLE_DEVICES") == before
        assert os.environ["VCHAT_PROBE"] == "operator's"
    finally:
        os.environ.pop("VCHAT_PROBE", None)


def test_engine_kind_is_vllm_unless_the_stand_in_is_asked_for():
    from engine.llm import PresetEngine
    from engine.pool import engine_kind
    from engine.standin import StandInEngine

    assert engine_kind({}) is PresetEngine
    stand_in = engine_kind({"VCHAT_ENGINE": "stand-in", "VCHAT_STANDIN_TOKENS_PER_S": "500"})
    assert stand_in.func is StandInEngine and stand_in.keywords == {"tokens_per_s": 500.0}
    for env, field in (({"VCHAT_ENGINE": "fast"}, "VCHAT_ENGINE"),
                       ({"VCHAT_ENGINE": "stand-in", "VCHAT_STANDIN_TOKENS_PER_S": "x"},
                        "VCHAT_STANDIN_TOKENS_PER_S")):
        with pytest.raises(ConfigError) as err:
            engine_kind(env)
        assert err.value.field == field


def test_kv_offloading_takes_a_share_of_a_gpu_machines_memory_unless_set(tmp_path):
    def config_from(data):
        return load_config(write(tmp_path, data), env={})

    assert load_config(ROOT / "profiles.yaml", env={}).memory.cpu_offload_gib == "auto"  # shipped
    config = load_config(write(tmp_path, mutated(
        lambda data: data["memory"].update(cpu_offload_gib="auto"))), env={})
    (group,) = engine_groups(config)
    big_host = Machine(gpu=True, cores=16, memory_gib=128.0)
    args = group_setup(config, group, "/m", big_host, env={}).args
    assert args["kv_offloading_size"] == 32.0 and args["kv_offloading_backend"] == "native"
    huge = group_setup(config, group, "/m", Machine(gpu=True, cores=16, memory_gib=2048.0),
                       env={}).args
    assert huge["kv_offloading_size"] == 64.0  # at most OFFLOAD_MOST_GIB
    for machine in (Machine(gpu=True, cores=16, memory_gib=16.0), CPU):  # too little; no GPU
        assert "kv_offloading_size" not in group_setup(config, group, "/m", machine,
                                                       env={}).args
    raw = mutated(lambda data: None)
    raw["memory"]["cpu_offload_gib"] = 0
    off = config_from(raw)
    assert "kv_offloading_size" not in group_setup(off, group, "/m", big_host, env={}).args
    raw["memory"]["cpu_offload_gib"] = 10
    (one_preset,) = [p for p in engine_groups(config_from(raw))]
    assert group_setup(config_from(raw), one_preset, "/m", big_host,
                       env={}).args["kv_offloading_size"] == 10.0
    for bad in ("lots", -1):
        raw["memory"]["cpu_offload_gib"] = bad
        with pytest.raises(ConfigError, match="cpu_offload_gib"):
            config_from(raw)
    raw["memory"]["cpu_offload_gib"] = "auto"
    raw["vllm"]["kv_offloading_size"] = 8
    with pytest.raises(ConfigError, match="memory:`'s cpu_offload_gib"):
        config_from(raw)


def test_a_containers_memory_limit_is_the_machines_memory_for_auto(tmp_path):
    """`auto` takes a share of the memory this process may use: a container's cgroup limit
    where it is below the host's (else a 128 GiB host's share could exceed a 16 GiB
    container), the host's where the limit says "max" or is absent."""
    from engine.launch import memory_gib

    host = memory_gib(limits=())
    assert host > 0
    limit = tmp_path / "memory.max"
    limit.write_text(f"{2 * GIB}\n")
    assert memory_gib(limits=(str(limit),)) == min(host, 2.0)
    limit.write_text("max\n")
    assert memory_gib(limits=(str(limit), str(tmp_path / "absent"))) == host


def test_the_start_says_what_the_kv_cache_holds():
    line = capacity_line("shared", 853_088, 147_456, 32.0, 262_144,
                         {"latency-first": 64, "throughput-first": 256})
    assert "853,088 tokens (144 KiB a token, 117.2 GiB)" in line
    assert "32.0 GiB of CPU memory hold 233,016 more for returning chats" in line
    assert "3 turns of the full 262,144-token context or 416 turns of 2,048 tokens" in line
    assert line.endswith("seats: latency-first 64, throughput-first 256")
    # The H100's own line (2026-12-07): one whole context, said as one.
    assert "1 turn of the full" in capacity_line("shared", 455_792, 147_456, 0.0, 262_144, {})
