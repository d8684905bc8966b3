"""`profiles.yaml` -> frozen dataclasses, with every field checked.

Mistakes raise one `ConfigError` naming the file, the field and what is allowed. vLLM option
names pass through unchanged and are checked against vLLM's own `AsyncEngineArgs`.
A few environment variables override fields of the file (engine/settings.py, `overrides`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import yaml

from .checks import check_map, check_number, check_type, check_vllm, gpus_for
from .errors import ConfigError
from .limits import bounds, system_prompt_fits
from .qwen import has_random_weights
from .settings import SETTINGS, setting

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "profiles.yaml"


HEADER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
ACCOUNT_SHARES = ("account_share", "account_queued_share")  # a preset's, in (0, 1]

@dataclass(frozen=True)
class Memory:
    """How much of the device the engines may use in total; presets take shares of it."""

    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 4.0
    # On a GPU, CPU memory that keeps KV blocks the GPU's cache lets go (vLLM's native KV
    # offloading), so a chat that comes back after others filled the GPU has its history
    # loaded, not computed again: GiB for all engines together, 0 for none, or "auto"
    # (engine/launch.py's offload_gib: a share of the machine's memory).
    cpu_offload_gib: float | str = 0.0


@dataclass(frozen=True)
class Remote:
    """An OpenAI-compatible server (say a `vllm serve` fleet behind a load balancer) that
    runs a preset's model instead of an engine in this process (engine/remote.py)."""

    base_url: str  # up to and with /v1
    model: str  # the name the server serves it under
    api_key_env: str | None = None  # the environment variable holding its API key
    max_num_seqs: int = 64  # turns this app sends it at once; more wait in our line
    max_model_len: int | None = None  # None: the server's own (its /v1/models says)
    tokenizer: str | None = None  # None: the top-level `model:`'s tokenizer
    # The header carrying each request's session key (a chat's id), for a router that
    # keeps a session on one server (engine/remote.py); None: no key is sent.
    session_header: str | None = "X-Session-Id"


@dataclass(frozen=True)
class Preset:
    name: str
    memory_share: float  # 0 for a remote preset: it needs no memory here
    vllm: dict = field(default_factory=dict)
    vllm_cpu: dict = field(default_factory=dict)  # on top of `vllm` when there is no GPU
    max_queued_turns: int = 64  # turns that may wait for the engine; more are refused
    vllm_gpu: dict = field(default_factory=dict)  # on top of `vllm` on a GPU
    remote: Remote | None = None  # its model runs on that server, not in this process
    gpus: tuple[int, ...] = ()  # the GPUs its engine runs on; () for the first it needs
    priority: int = 0  # on an engine shared with other presets: lower is served first
    # One account's most, beside other accounts' turns: of the seats, and of a full line
    # (engine/admission.py); alone it may use all of both.
    account_share: float = 0.5
    account_queued_share: float = 0.25
    # On a shared engine: the longest step while its turns run, by device ({"gpu": 9}).
    step_ms: dict = field(default_factory=dict)
    # On a shared engine: how long prompts are cut while its turns run, by device
    # ({"gpu": {"piece": 2048, "context": 65536}}: engine/steps.py, point 4).
    long_prompts: dict = field(default_factory=dict)

    def options(self, gpu: bool) -> dict:
        """This preset's vLLM options on the device at hand."""
        return {**self.vllm, **(self.vllm_gpu if gpu else self.vllm_cpu)}

    def pace(self, gpu: bool) -> float | None:
        """The step duration its turns are promised on a shared engine, on this device."""
        return self.step_ms.get("gpu" if gpu else "cpu")

    def long_pieces(self, gpu: bool) -> dict | None:
        """Its long prompts' pieces on this device: {"piece": tokens, "context": tokens}."""
        return self.long_prompts.get("gpu" if gpu else "cpu")

    def all_options(self) -> list[dict]:
        """Every option set this preset may run with (any device)."""
        return [self.options(True), self.options(False)]


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.7
    top_p: float = 0.9
    max_tokens: int = 512


@dataclass(frozen=True)
class Limits:
    """What a user may set in the chat settings panel, and send, per profile."""

    temperature: float = 1.5
    max_tokens: int = 2048
    system_prompt_chars: int = 4000
    message_chars: int = 100_000    # longer messages are refused before any tokenizing
    turns_per_minute: int = 20      # per chat session
    n: int = 4                      # replies to one API request (its `n`)
    top_logprobs: int = 20          # alternatives per token an API request may ask for
    tools: int = 128                # functions one API request may offer the model


@dataclass(frozen=True)
class Starter:
    label: str
    message: str


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    preset: str
    icon: str = ""
    system_prompt: str = ""
    sampling: Sampling = Sampling()
    limits: Limits = Limits()
    starters: tuple[Starter, ...] = ()
    default: bool = False


ENGINE_LAYOUTS = ("auto", "shared", "per-preset")


@dataclass(frozen=True)
class Config:
    source: str
    model: str
    vllm: dict
    memory: Memory
    presets: dict[str, Preset]
    profiles: tuple[Profile, ...]
    engines: str = "auto"  # one of ENGINE_LAYOUTS (engine/launch.py, engine_groups)

    def profile(self, name: str) -> Profile:
        for profile in self.profiles:
            if profile.name == name:
                return profile
        raise ConfigError(self.source, "profile", f"no profile named {name!r}")

    @property
    def default_profile(self) -> Profile:
        return next((p for p in self.profiles if p.default), self.profiles[0])

    def profile_or_default(self, name: str | None) -> Profile:
        """The profile a session asked for, or the default one for an unknown name."""
        return next((p for p in self.profiles if p.name == name), self.default_profile)

    def used_presets(self) -> list[Preset]:
        """Presets that some profile uses: one engine runs for each."""
        names = dict.fromkeys(p.preset for p in self.profiles)
        return [self.presets[n] for n in names]

    def gpus_needed(self, preset: Preset) -> int:
        """The GPUs `preset`'s engine runs on: the product of vLLM's parallel sizes."""
        return gpus_for({**self.vllm, **preset.options(True)})

    def gpus_of(self, preset: Preset) -> tuple[int, ...]:
        """Which GPUs (indices among those the process sees) `preset`'s engine takes: the
        ones it names, else the first it needs, as vLLM places an engine by default."""
        if preset.remote is not None:
            return ()
        return preset.gpus or tuple(range(self.gpus_needed(preset)))

    @property
    def random_weights(self) -> bool:
        """True when the engines run on random weights (the dummy model, or `load_format:
        dummy` anywhere in use): every reply is noise, and users must be told."""
        return has_random_weights(self.model) or any(
            {**self.vllm, **options}.get("load_format") == "dummy"
            for preset in self.used_presets() for options in preset.all_options())


def load_config(path: str | Path | None = None, env: dict | None = None) -> Config:
    """Read and check the profiles file ($VCHAT_PROFILES, else ./profiles.yaml)."""
    path = Path(path or setting("VCHAT_PROFILES", env) or DEFAULT_PATH)
    source = str(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(source, "(file)", "not found; set VCHAT_PROFILES or create it") from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, "(file)", f"not valid YAML: {exc}") from None
    raw = check_map(source, "(top level)", raw, required={"presets", "profiles"},
                    optional={"model", "vllm", "memory", "engines"})
    for name, spec in SETTINGS.items():
        value = setting(name, env) if spec.overrides else None
        if value is not None:
            _set_dotted(raw, spec.overrides, value)
    return _build(source, raw)


def check_offload(source: str, value) -> float | str:
    """memory.cpu_offload_gib: "auto", or GiB, 0 or more."""
    if value == "auto":
        return value
    if isinstance(value, str):
        raise ConfigError(source, "memory.cpu_offload_gib", f'"auto" or GiB (0: none), got '
                          f"{value!r}")
    return check_number(source, "memory.cpu_offload_gib", value, float, lo=0.0)


def _build(source: str, raw: dict) -> Config:
    model = check_type(source, "model", raw.get("model", "auto"), str)
    engines = check_type(source, "engines", raw.get("engines", "auto"), str)
    if engines not in ENGINE_LAYOUTS:
        raise ConfigError(source, "engines", f"must be one of {', '.join(ENGINE_LAYOUTS)}, "
                          f"got {engines!r}")
    vllm = check_vllm(source, "vllm", raw.get("vllm") or {})
    mem_raw = check_map(source, "memory", raw.get("memory") or {},
                        optional={f.name for f in dataclasses.fields(Memory)})
    memory = Memory(**{k: check_offload(source, v) if k == "cpu_offload_gib" else
                       check_number(source, f"memory.{k}", v, float, lo=0.0, lo_open=True,
                                    hi=1.0 if k == "gpu_memory_utilization" else None)
                       for k, v in mem_raw.items()})

    presets = {}
    presets_raw = check_type(source, "presets", raw["presets"], dict)
    if not presets_raw:
        raise ConfigError(source, "presets", "at least one preset is needed")
    for name, body in presets_raw.items():
        where = f"presets.{name}"
        body = check_type(source, where, body, dict)
        queued = check_number(source, f"{where}.max_queued_turns",
                              body.get("max_queued_turns", Preset.max_queued_turns), int, lo=0)
        shares = {key: check_number(source, f"{where}.{key}",
                                    body.get(key, getattr(Preset, key)), float, lo=0.0,
                                    hi=1.0, lo_open=True) for key in ACCOUNT_SHARES}
        if "remote" in body:
            presets[name] = dataclasses.replace(
                _build_remote_preset(source, where, name, body, queued), **shares)
            continue
        body = check_map(source, where, body, required={"memory_share"},
                         optional={"vllm", "vllm_cpu", "vllm_gpu", "max_queued_turns", "gpus",
                                   "priority", "step_ms", "long_prompts", *ACCOUNT_SHARES})
        share = check_number(source, f"{where}.memory_share", body["memory_share"], float,
                             lo=0.0, hi=1.0, lo_open=True)
        presets[name] = Preset(
            name, share, check_vllm(source, f"{where}.vllm", body.get("vllm") or {}),
            check_vllm(source, f"{where}.vllm_cpu", body.get("vllm_cpu") or {}), queued,
            check_vllm(source, f"{where}.vllm_gpu", body.get("vllm_gpu") or {}),
            gpus=_check_gpus(source, f"{where}.gpus", body.get("gpus", [])),
            priority=check_number(source, f"{where}.priority", body.get("priority", 0), int),
            **shares,
            step_ms=_check_step_ms(source, f"{where}.step_ms", body.get("step_ms") or {}),
            long_prompts=_check_long_prompts(source, f"{where}.long_prompts",
                                             body.get("long_prompts") or {}))

    profiles = []
    for i, body in enumerate(check_type(source, "profiles", raw["profiles"], list)):
        profiles.append(_build_profile(source, f"profiles[{i}]", body, presets))
    if not profiles:
        raise ConfigError(source, "profiles", "at least one profile is needed")
    names = [p.name for p in profiles]
    if len(set(names)) != len(names):
        raise ConfigError(source, "profiles", f"profile names must be unique, got {names}")

    config = Config(source, model, vllm, memory, presets, tuple(profiles), engines)
    _check_placement(config)
    return config


def _check_gpus(source: str, where: str, value) -> tuple[int, ...]:
    gpus = check_type(source, where, value, list)
    if not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus) \
            or len(set(gpus)) != len(gpus):
        raise ConfigError(source, where, "must list distinct GPU indices (0, 1, ... as the "
                          f"process sees them, CUDA_VISIBLE_DEVICES counts), got {value!r}")
    return tuple(gpus)


def _check_step_ms(source: str, where: str, value) -> dict:
    raw = check_map(source, where, value, optional={"gpu", "cpu"})
    return {device: check_number(source, f"{where}.{device}", ms, float, lo=0.0, lo_open=True)
            for device, ms in raw.items()}


def _check_long_prompts(source: str, where: str, value) -> dict:
    raw = check_map(source, where, value, optional={"gpu", "cpu"})
    pieces = {}
    for device, body in raw.items():
        body = check_map(source, f"{where}.{device}", body, required={"piece", "context"})
        pieces[device] = {key: check_number(source, f"{where}.{device}.{key}", body[key], int,
                                            lo=1) for key in ("piece", "context")}
    return pieces


def _check_placement(config: Config) -> None:
    """A preset naming its GPUs names as many as its engine runs on; the presets sharing a
    GPU split it: their memory shares sum to at most 1.0 on each GPU (without a GPU, of the
    CPU's KV cache: there every preset counts, as on one GPU)."""
    sharing: dict[int, list[Preset]] = {}
    for preset in config.used_presets():
        needed = config.gpus_needed(preset)
        if preset.gpus and len(preset.gpus) != needed:
            raise ConfigError(config.source, f"presets.{preset.name}.gpus",
                              f"names {len(preset.gpus)} GPUs but its engine runs on {needed} "
                              "(the product of tensor_parallel_size, pipeline_parallel_size and "
                              "data_parallel_size): name that many, or set those sizes")
        for gpu in config.gpus_of(preset):
            sharing.setdefault(gpu, []).append(preset)
    for gpu, presets in sorted(sharing.items()):
        total = sum(p.memory_share for p in presets)
        if total > 1.0 + 1e-9:
            used = ", ".join(f"{p.name}={p.memory_share}" for p in presets)
            named = len(sharing) > 1 or any(p.gpus for p in presets)
            where = f" on GPU {gpu}" if named else ""
            raise ConfigError(config.source, "presets.*.memory_share",
                              f"shares of the presets in use{where} must sum to at most 1.0, "
                              f"got {total:g} ({used})")


def _build_remote_preset(source: str, where: str, name: str, body: dict, queued: int
                         ) -> Preset:
    """A preset whose model runs on an OpenAI-compatible server: no vLLM options and no
    memory here, both belong to that server."""
    for key in ("vllm", "vllm_cpu", "vllm_gpu"):
        if key in body:
            raise ConfigError(source, f"{where}.{key}",
                              "not allowed beside `remote:`: vLLM engine options belong to the "
                              "remote server (set them where it is started); remove them, or "
                              "remove `remote:` to run the model in this process")
    if "memory_share" in body:
        raise ConfigError(source, f"{where}.memory_share",
                          "not allowed beside `remote:`: a remote preset takes no memory "
                          "here (its server has its own); remove it")
    check_map(source, where, body, required={"remote"},
              optional={"max_queued_turns", *ACCOUNT_SHARES})
    at = f"{where}.remote"
    raw = check_map(source, at, body["remote"], required={"base_url", "model"},
                    optional={"api_key_env", "max_num_seqs", "max_model_len", "tokenizer",
                              "session_header"})
    url = check_type(source, f"{at}.base_url", raw["base_url"], str).strip()
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(source, f"{at}.base_url", "must be an http(s) URL of an OpenAI-"
                          f"compatible API, like http://host:8000/v1, got {url!r}")
    for key in ("model", "tokenizer", "api_key_env"):
        if key in raw and not check_type(source, f"{at}.{key}", raw[key], str).strip():
            raise ConfigError(source, f"{at}.{key}", "must not be empty")
    key_env = raw.get("api_key_env")
    if key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env):
        raise ConfigError(source, f"{at}.api_key_env", "must name an environment variable "
                          f"(which holds the key, not the key itself), got {key_env!r}")
    header = raw.get("session_header", Remote.session_header)
    if header is not None and not (isinstance(header, str) and HEADER_NAME.fullmatch(header)):
        raise ConfigError(source, f"{at}.session_header", "must be an HTTP header name "
                          f"(letters, digits and -), or null to send none, got {header!r}")
    remote = Remote(
        url.rstrip("/"), raw["model"], key_env,
        check_number(source, f"{at}.max_num_seqs",
                     raw.get("max_num_seqs", Remote.max_num_seqs), int, lo=1),
        None if raw.get("max_model_len") is None else check_number(
            source, f"{at}.max_model_len", raw["max_model_len"], int, lo=2),
        raw.get("tokenizer"), header)
    return Preset(name, 0.0, max_queued_turns=queued, remote=remote)


def _build_profile(source: str, where: str, body, presets: dict) -> Profile:
    body = check_map(source, where, body, required={"name", "description", "preset"},
                     optional={"icon", "system_prompt", "sampling", "limits", "starters",
                               "default"})
    for key in ("name", "description", "icon", "system_prompt"):
        if key in body:
            check_type(source, f"{where}.{key}", body[key], str)
    if not body["name"].strip():
        raise ConfigError(source, f"{where}.name", "must not be empty")
    if body["preset"] not in presets:
        raise ConfigError(source, f"{where}.preset",
                          f"unknown preset {body['preset']!r}; allowed: {', '.join(presets)}")
    s_raw = check_map(source, f"{where}.sampling", body.get("sampling") or {},
                      optional={"temperature", "top_p", "max_tokens"})
    limits = {"temperature": (float, 0.0, 2.0), "top_p": (float, 0.0, 1.0),
              "max_tokens": (int, 1, None)}
    sampling = Sampling(**{
        k: check_number(source, f"{where}.sampling.{k}", v, limits[k][0], lo=limits[k][1],
                        hi=limits[k][2], lo_open=(k == "top_p"))
        for k, v in s_raw.items()})
    l_raw = check_map(source, f"{where}.limits", body.get("limits") or {},
                      optional={f.name for f in dataclasses.fields(Limits)})
    l_kinds = {"temperature": (float, 0.0, 2.0), "max_tokens": (int, 1, None),
               "system_prompt_chars": (int, 0, None), "message_chars": (int, 1, None),
               "turns_per_minute": (int, 1, None), "n": (int, 1, 64),
               "top_logprobs": (int, 0, 20), "tools": (int, 0, 1024)}
    limits_ = Limits(**{k: check_number(source, f"{where}.limits.{k}", v, l_kinds[k][0],
                                        lo=l_kinds[k][1], hi=l_kinds[k][2])
                        for k, v in l_raw.items()})
    checks = bounds(limits_)
    for key in ("temperature", "max_tokens"):  # the defaults keep the turns' own bounds
        if not checks[key].holds(getattr(sampling, key)):
            raise ConfigError(source, f"{where}.sampling.{key}",
                              f"must be at most limits.{key} ({getattr(limits_, key):g}), "
                              f"got {getattr(sampling, key):g}")
    if not system_prompt_fits(limits_, body.get("system_prompt", "")):
        raise ConfigError(source, f"{where}.system_prompt",
                          f"longer than limits.system_prompt_chars "
                          f"({limits_.system_prompt_chars})")
    starters = []
    for j, st in enumerate(check_type(source, f"{where}.starters", body.get("starters") or [],
                                      list)):
        st = check_map(source, f"{where}.starters[{j}]", st, required={"label", "message"})
        starters.append(Starter(check_type(source, f"{where}.starters[{j}].label",
                                           st["label"], str),
                                check_type(source, f"{where}.starters[{j}].message",
                                           st["message"], str)))
    return Profile(name=body["name"], description=body["description"], preset=body["preset"],
                   icon=body.get("icon", ""), system_prompt=body.get("system_prompt", ""),
                   sampling=sampling, limits=limits_, starters=tuple(starters),
                   default=check_type(source, f"{where}.default", body.get("default", False),
                                      bool))


def _set_dotted(raw: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for key in parents:
        if node.get(key) is None:
            node[key] = {}
        node = node[key]
    node[leaf] = value
