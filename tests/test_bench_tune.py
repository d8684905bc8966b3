"""bench/tune.py: preset variants side by side, the pick, and writing it back."""

import shutil

import pytest

from bench.tune import apply, label, pick, variant, variants_file
from engine import load_config
from tools.chainlit_client import ROOT

VARIANTS = [{"max_num_batched_tokens": 512, "long_prefill_token_threshold": 384},
            {"max_num_batched_tokens": 2048, "long_prefill_token_threshold": 0}]


def test_each_variant_is_a_preset_the_app_would_load():
    path = variants_file(ROOT / "profiles.yaml", "latency-first", "vllm_gpu", VARIANTS)
    config = load_config(path)  # checked as the app checks it: shares, vLLM's arguments
    names = [p.name for p in config.used_presets()]
    assert names == [f"latency-first@{label(v)}" for v in VARIANTS]
    first = config.presets[names[0]]
    assert first.vllm_gpu == {**load_config().presets["latency-first"].vllm_gpu, **VARIANTS[0]}
    assert sum(p.memory_share for p in config.used_presets()) <= 1.0


def test_the_pick_keeps_the_first_token_wait_within_bounds():
    figures = {"a": {"tok_s": 3000, "ttft_p95_ms": 1400, "itl_p95_ms": 20},
               "b": {"tok_s": 3200, "ttft_p95_ms": 300, "itl_p95_ms": 40},
               "c": {"tok_s": 3100, "ttft_p95_ms": 900, "itl_p95_ms": 30}}
    assert pick(figures, ttft_ms=1000) == "c", "the smoothest of those within the bound"
    assert pick(figures, ttft_ms=100) == "b", "none within: the shortest wait"


def test_the_pick_is_written_into_the_preset_keeping_the_file_as_it_was(tmp_path):
    path = tmp_path / "profiles.yaml"
    shutil.copy(ROOT / "profiles.yaml", path)
    before = path.read_text().splitlines()
    apply(path, "latency-first", "vllm_gpu", {"max_num_batched_tokens": 333})
    after = path.read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) == 1, changed
    assert changed[0][1].strip().startswith("max_num_batched_tokens: 333")
    config = load_config(path)
    assert config.presets["latency-first"].vllm_gpu["max_num_batched_tokens"] == 333
    assert config.presets["throughput-first"].vllm_gpu["max_num_batched_tokens"] == 8192
    with pytest.raises(SystemExit, match="not in latency-first.vllm_gpu"):
        apply(path, "latency-first", "vllm_gpu", {"max_num_partial_prefills": 2})


def test_a_variant_is_whole_numbers_by_name():
    assert variant("max_num_seqs=32,max_num_batched_tokens=512") == {
        "max_num_seqs": 32, "max_num_batched_tokens": 512}
    for bad in ("max_num_seqs", "max_num_seqs=a", "=3", "max_num_seqs=-1"):
        with pytest.raises(Exception, match="expected key=whole number"):
            variant(bad)
