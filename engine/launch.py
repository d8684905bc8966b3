"""How a preset becomes a vLLM engine on this machine: `engine_setup` is the one place that
turns profiles.yaml, the model and the machine into vLLM's engine arguments and the
environment its processes need. Measurements behind the defaults: BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .checks import PARALLEL_SIZES, gpus_for
from .config import Config, Preset
from .errors import ConfigError
from .qwen import has_random_weights
from .settings import cache_dir
from .steps import STEP_CLASSES_KEY

GIB = 1 << 30
CPU_WORKER = "engine.cpu_worker.SeededCPUWorker"  # engine/cpu_worker.py, by name
SMALL_CPU_CORES = 4  # at most this many cores: every one of them runs the model


def has_cuda() -> bool:
    """True when vLLM will run on a CUDA GPU."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where it does not)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def gpu_count() -> int:
    """The CUDA GPUs this process may use (CUDA_VISIBLE_DEVICES counts)."""
    import torch

    return torch.cuda.device_count()


@dataclass(frozen=True)
class Machine:
    gpu: bool
    cores: int
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    gpus: int = 1  # how many, when `gpu`
    memory_gib: float = 0.0  # its memory (RAM), where known

    @classmethod
    def here(cls) -> "Machine":
        gpu = has_cuda()
        return cls(gpu, len(os.sched_getaffinity(0)), cpu_flags(), gpu_count() if gpu else 0,
                   memory_gib())

    @property
    def gpus_text(self) -> str:
        """What this machine has, for messages: "2 GPUs", "1 GPU", "no GPU"."""
        return f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}" if self.gpu else "no GPU"


@dataclass(frozen=True)
class EngineSetup:
    args: dict  # vLLM's AsyncEngineArgs, by its own names
    env: dict = field(default_factory=dict)  # variables vLLM's processes must see

    def with_args(self, **changes) -> "EngineSetup":
        """The same engine with some arguments changed (benchmarks, tests)."""
        return EngineSetup({**self.args, **changes}, self.env)


@dataclass(frozen=True)
class EngineGroup:
    """The presets that run on one engine: one, or (shared) several by priority."""

    name: str
    presets: tuple[Preset, ...]

    @property
    def shared(self) -> bool:
        return len(self.presets) > 1


def engine_groups(config: Config) -> list[EngineGroup]:
    """Which presets run on which engine. Remote presets are their server's; the local
    presets on the same GPUs (without a GPU: all of them) share one engine unless
    `engines: per-preset` (two engines on one device time-slice it, each slowing the
    other's streams: BENCHMARKS.md, "Both profiles at once")."""
    groups: dict[object, list[Preset]] = {}
    share = config.engines != "per-preset"
    for preset in config.used_presets():
        local = preset.remote is None and share
        key = ("gpus", config.gpus_of(preset)) if local else ("preset", preset.name)
        groups.setdefault(key, []).append(preset)
    out = []
    for presets in groups.values():
        presets.sort(key=lambda p: p.priority)
        out.append(EngineGroup("+".join(p.name for p in presets), tuple(presets)))
    return out


def seats(config: Config, preset: Preset, gpu: bool) -> int:
    """The turns a preset runs at once: its max_num_seqs (vLLM's default 256 unless set)."""
    return int({**config.vllm, **preset.options(gpu)}.get("max_num_seqs", 256))


STEP_SHAPE = ("max_num_batched_tokens", "long_prefill_token_threshold")


def shared_preset(config: Config, group: EngineGroup, gpu: bool) -> Preset:
    """The one engine of a shared group, as a preset: the highest-priority preset's options
    (the others' only where it sets nothing); seats for every preset's turns at once (each
    keeps its own in admission); the largest step shape among them (a step that no preset
    alone would take never happens: each class's own shape and pace apply while its turns
    run, engine/steps.py); vLLM's priority scheduling; the memory shares together."""
    options: dict = {}
    for preset in reversed(group.presets):
        options.update(preset.options(gpu))
    shapes = [{**config.vllm, **p.options(gpu)} for p in group.presets]
    for key in STEP_SHAPE:
        values = [shape.get(key) for shape in shapes]
        options.pop(key, None)
        if key == "long_prefill_token_threshold":  # 0 or unset: prompts are not cut
            if all(values):
                options[key] = max(values)
        elif None not in values:  # unset: vLLM's own default
            options[key] = max(values)
    options["max_num_seqs"] = sum(seats(config, p, gpu) for p in group.presets)
    if "max_num_batched_tokens" in options:  # vLLM: a step holds at least one token a seat
        options["max_num_batched_tokens"] = max(options["max_num_batched_tokens"],
                                                options["max_num_seqs"])
    options["scheduling_policy"] = "priority"
    classes = step_classes(group, shapes, options, gpu)
    if classes:
        options["additional_config"] = {**options.get("additional_config", {}),
                                        STEP_CLASSES_KEY: classes}
    share = min(1.0, sum(p.memory_share for p in group.presets))
    return Preset(group.name, share, vllm=options, gpus=group.presets[0].gpus)


def step_classes(group: EngineGroup, shapes: list[dict], engine: dict, gpu: bool) -> dict:
    """Each class's promise for the steps while its turns run, where it differs from the
    engine's own steps: its step shape, its pace (`step_ms`) and its long prompts' pieces
    (`long_prompts`), by priority (the first preset of a priority speaks for it)."""
    classes: dict[str, dict] = {}
    for preset, shape in zip(group.presets, shapes):
        own = {key: shape.get(key) or 0 for key in STEP_SHAPE
               if (shape.get(key) or 0) != (engine.get(key) or 0)}
        if preset.pace(gpu) is not None:
            own["step_ms"] = preset.pace(gpu)
        if preset.long_pieces(gpu):
            own.update(long_piece=preset.long_pieces(gpu)["piece"],
                       long_context=preset.long_pieces(gpu)["context"])
        if own and str(preset.priority) not in classes:
            classes[str(preset.priority)] = own
    return classes


def group_setup(config: Config, group: EngineGroup, model: str, machine: Machine,
                env: Mapping[str, str] | None = None) -> EngineSetup:
    """The engine of `group` on `machine` (engine_setup for one preset)."""
    preset = shared_preset(config, group, machine.gpu) if group.shared else group.presets[0]
    return engine_setup(config, preset, model, machine, env)


def engine_setup(config: Config, preset: Preset, model: str, machine: Machine,
                 env: Mapping[str, str] | None = None) -> EngineSetup:
    """One preset's engine on `machine`: profiles.yaml's options (the preset's `vllm_cpu` on
    top without a GPU), the model, the preset's memory share, and the defaults below
    unless profiles.yaml sets them. `env`: the environment the operator gave."""
    env = os.environ if env is None else env
    args = {**config.vllm, **preset.options(machine.gpu), "model": model}
    check_parallelism(preset.name, args, machine)
    devices = visible_devices(preset, machine, env)
    if has_random_weights(model):  # no weight files: vLLM draws them at random
        args.setdefault("load_format", "dummy")
    # Compilation pays off on a GPU; on CPU it takes minutes to start for little gain.
    args.setdefault("enforce_eager", not machine.gpu)
    args.setdefault("dtype", "auto" if machine.gpu else cpu_dtype(machine.cpu_flags))
    if machine.gpu:
        args["gpu_memory_utilization"] = config.memory.gpu_memory_utilization * preset.memory_share
        offload = offload_gib(config.memory.cpu_offload_gib, machine) * preset.memory_share
        if offload > 0:  # vLLM's native KV offloading (its CacheConfig)
            args["kv_offloading_size"] = round(offload, 2)
            args.setdefault("kv_offloading_backend", "native")
        # vLLM forks its engine process while CUDA is untouched; a fork inherits Chainlit's
        # modules, whose lazy attributes break torch.compile's cache pickling there
        # (KeyError: 'torch'). Spawned, the process starts clean (neutral_main).
        return EngineSetup(args, {"VLLM_WORKER_MULTIPROC_METHOD": env.get(
            "VLLM_WORKER_MULTIPROC_METHOD", "spawn"), **compile_caches(env), **devices})
    args["kv_cache_memory_bytes"] = int(config.memory.cpu_kv_cache_gib * preset.memory_share
                                        * GIB)
    # vLLM's own CPU worker dies on a seeded request whose prompt is prefilled in chunks
    # (engine/cpu_worker.py).
    args.setdefault("worker_cls", CPU_WORKER)
    return EngineSetup(args, cpu_thread_env(env, machine.cores))


# memory.cpu_offload_gib "auto": this share of the machine's memory, at most OFFLOAD_MOST_GIB,
# where the machine has at least OFFLOAD_FROM_GIB (the app's processes, vLLM's engine
# process and the page cache need the rest).
OFFLOAD_SHARE, OFFLOAD_MOST_GIB, OFFLOAD_FROM_GIB = 0.25, 64.0, 32.0


def offload_gib(setting: float | str, machine: Machine) -> float:
    """GiB of CPU memory for offloaded KV blocks, for all engines together (0: none).
    Offloading is for a GPU's cache; without a GPU the KV cache is in CPU memory already."""
    if not machine.gpu:
        return 0.0
    if setting != "auto":
        return float(setting)
    if machine.memory_gib < OFFLOAD_FROM_GIB:
        return 0.0
    return min(OFFLOAD_MOST_GIB, OFFLOAD_SHARE * machine.memory_gib)


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max",  # v2; v1 below
                 "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_gib(limits: tuple[str, ...] = CGROUP_LIMITS) -> float:
    """This machine's memory in GiB, or its container's limit where lower (cgroup v2 or v1);
    0 where it cannot be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0.0
    for limit in limits:
        try:
            total = min(total, int(Path(limit).read_text().strip()))
        except (OSError, ValueError):  # absent, or "max": no limit
            continue
    return total / GIB


def compile_caches(env: Mapping[str, str]) -> dict[str, str]:
    """Triton's JIT kernels and vLLM's torch.compile artefacts in the cache folder, so a
    restart (or a second engine) reuses them; an operator's own setting wins."""
    root = cache_dir(env)
    wanted = {"TRITON_CACHE_DIR": root / "triton", "VLLM_CACHE_ROOT": root / "vllm"}
    return {name: str(path) for name, path in wanted.items() if not env.get(name)}


def check_parallelism(preset: str, args: dict, machine: Machine) -> None:
    """vLLM's parallel sizes of one preset against the GPUs present: their product is the
    GPUs its engine needs. Without a GPU each preset runs as one engine on the CPU."""
    needed = gpus_for(args)
    if needed == 1:
        return
    asked = " x ".join(f"{name} {args[name]}" for name in PARALLEL_SIZES
                       if args.get(name, 1) != 1)
    if not machine.gpu or needed > machine.gpus:
        raise ConfigError("profiles.yaml", f"presets.{preset}.vllm",
                          f"{asked} needs {needed} GPUs; this machine has {machine.gpus_text}")


def visible_devices(preset: Preset, machine: Machine, env: Mapping[str, str]) -> dict:
    """The GPUs a preset names, as the CUDA_VISIBLE_DEVICES its engine's processes see
    (indices count among the GPUs this process sees: an operator's own
    CUDA_VISIBLE_DEVICES maps them); {} for a preset that names none."""
    if not preset.gpus:
        return {}
    missing = [g for g in preset.gpus if not machine.gpu or g >= machine.gpus]
    if missing:
        seen = f" (0 to {machine.gpus - 1})" if machine.gpu and machine.gpus else ""
        raise ConfigError("profiles.yaml", f"presets.{preset.name}.gpus",
                          f"GPU {', '.join(map(str, missing))} named; this machine has "
                          f"{machine.gpus_text}{seen}")
    ours = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ours[g] if g < len(ours) else str(g)
                                             for g in preset.gpus)}


_PROCESS_ENV = threading.Lock()


@contextlib.contextmanager
def process_env(env: Mapping[str, str]) -> Iterator[None]:
    """`env` in this process while one engine's processes start (they copy it), and as it
    was afterwards: one engine's GPUs are not the next one's. One engine at a time."""
    with _PROCESS_ENV:
        before = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def cpu_dtype(flags: frozenset[str]) -> str:
    """The model's dtype without a GPU: float16 where it was measured to be faster with the
    same replies (AVX512-FP16 without AMX), else float32, the safe choice."""
    return "float16" if "avx512_fp16" in flags and "amx_tile" not in flags else "float32"


def cpu_thread_env(env: Mapping[str, str], cores: int) -> dict[str, str]:
    """On small machines every core for the model: vLLM would keep one per engine for its
    scheduler, which idles most of the time. An operator's own VLLM_CPU_* setting wins."""
    if cores > SMALL_CPU_CORES or any(
            k in env for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")):
        return {}
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@contextlib.contextmanager
def neutral_main():
    """Hide the parent's `__main__` from processes spawned inside this block.

    vLLM starts its EngineCore with multiprocessing's `spawn`, which re-imports the
    parent's main module in the child. Under `chainlit run app.py` that module is
    Chainlit's CLI; the child then imports Chainlit, and vLLM's CPU worker, which scans
    every loaded module, trips over Chainlit's context proxy and dies. The engine process
    needs nothing from our main module, so during start-up `__main__` is a blank module:
    spawn then re-imports nothing. Scripts without a main guard work for the same reason.
    """
    real = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = real


@contextlib.contextmanager
def importable_here():
    """This project's folder on the import path of processes started inside this block.

    A shared engine's scheduler (engine/scheduler.py) is loaded by name in vLLM's engine
    process, which takes the import path this process has when it starts. `chainlit run`
    puts the app's folder on that path only while it loads app.py, so here it is put back
    for the start."""
    root = str(Path(__file__).resolve().parent.parent)
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    try:
        yield
    finally:
        if added and root in sys.path:
            sys.path.remove(root)
