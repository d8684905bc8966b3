"""The checks profiles.yaml's values go through: types, ranges, known keys, and vLLM's
engine options by vLLM's own names and types. Each failure is one ConfigError naming the
field and what it must be.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing

from .errors import ConfigError

# vLLM options the engine layer sets itself; a preset naming them would be overridden.
MANAGED_OPTIONS = {"model", "tokenizer", "kv_cache_memory_bytes", "gpu_memory_utilization",
                   "kv_offloading_size"}
PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def gpus_for(options: dict) -> int:
    """The GPUs an engine with these vLLM options runs on: its parallel sizes' product."""
    return math.prod(options.get(name, 1) for name in PARALLEL_SIZES)


def check_map(source, where, value, required=frozenset(), optional=frozenset()) -> dict:
    value = check_type(source, where, value, dict)
    allowed = set(required) | set(optional)
    for key in value:
        if key not in allowed:
            raise ConfigError(source, f"{where}.{key}" if where != "(top level)" else str(key),
                              f"unknown key; allowed: {', '.join(sorted(allowed))}")
    for key in sorted(required):
        if key not in value:
            raise ConfigError(source, f"{where}.{key}" if where != "(top level)" else key,
                              "missing (required)")
    return value


TYPE_WORDS = {str: "text", dict: "a mapping", list: "a list", bool: "true or false",
              int: "a whole number", float: "a number"}


def check_type(source, where, value, kind):
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ConfigError(source, where, f"must be {TYPE_WORDS[kind]}, got {value!r}")
    return value


def check_number(source, where, value, kind, lo=None, hi=None, lo_open=False):
    value = check_type(source, where, value, kind)
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    too_high = hi is not None and value > hi
    if too_low or too_high:
        low = "" if lo is None else (f"> {lo:g}" if lo_open else f">= {lo:g}")
        high = "" if hi is None else f"<= {hi:g}"
        raise ConfigError(source, where, f"must be {' and '.join(x for x in (low, high) if x)}, "
                                         f"got {value!r}")
    return kind(value)


def check_vllm(source: str, where: str, options) -> dict:
    """Check vLLM engine options by vLLM's own names and types (AsyncEngineArgs)."""
    from vllm import AsyncEngineArgs

    options = check_type(source, where, options, dict)
    known = {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}
    for key, value in options.items():
        if key in MANAGED_OPTIONS:
            raise ConfigError(source, f"{where}.{key}", "set by the engine layer (use "
                              "`model:`, `memory_share` and `memory:`'s cpu_offload_gib)")
        if key == "device_ids":  # the preset's GPUs are checked against the memory shares
            raise ConfigError(source, f"{where}.{key}",
                              "set the preset's `gpus:` instead (GPU indices; checked "
                              "against the machine and each GPU's memory shares)")
        if key not in known:
            close = [k for k in known if key.replace("-", "_") in k or k in key][:5]
            hint = f"; did you mean: {', '.join(close)}" if close else ""
            raise ConfigError(source, f"{where}.{key}", f"not a vLLM engine option{hint}")
        problem = type_problem(known[key].type, value)
        if problem:
            raise ConfigError(source, f"{where}.{key}", f"{problem}, got {value!r}")
        if key in PARALLEL_SIZES and value < 1:  # GPUs per engine: launch.py checks the count
            raise ConfigError(source, f"{where}.{key}", f"must be at least 1, got {value!r}")
    return dict(options)


def type_problem(annotation, value) -> str | None:
    """Why `value` does not fit a simple vLLM annotation; None if it fits or is too complex."""
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        if value is None and type(None) in args:
            return None
        simple = [a for a in args if a is not type(None)]
        return type_problem(simple[0], value) if len(simple) == 1 else None
    if typing.get_origin(annotation) is typing.Literal:
        return None if value in args else f"must be one of {', '.join(map(repr, args))}"
    if annotation in (int, float, bool, str):
        ok = isinstance(value, annotation) and not (annotation is not bool
                                                    and isinstance(value, bool))
        if annotation is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        return None if ok else f"must be {TYPE_WORDS[annotation]}"
    return None
