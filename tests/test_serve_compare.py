"""bench/serve_compare.py's cheap parts: its options, checked before any server starts, the
engine arguments as vLLM server flags, and its table (no engine, no server)."""

import pytest

from bench.serve_compare import parse_args, ratios, table
from tools.vllm_server import server_flags


def test_options_are_checked_before_anything_starts(capsys):
    assert parse_args([]).pairs == 3
    for bad in (["--pairs", "0"], ["--input-len", "2000", "--max-model-len", "2048"],
                ["--gpu-memory", "0.9"], ["--compare", "speed"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "--max-model-len" in capsys.readouterr().err


def test_engine_arguments_become_server_flags():
    flags = server_flags({"model": "/m", "max_num_seqs": 128, "enforce_eager": True,
                          "enable_prefix_caching": False, "kv_cache_memory_bytes": 1 << 30,
                          "max_model_len": None})
    assert flags == ["--max-num-seqs", "128", "--enforce-eager",
                     "--no-enable-prefix-caching", "--kv-cache-memory-bytes", "1073741824"]


def test_pairs_ratios_and_table():
    run = lambda tok, ttft: {"tok_s": tok, "ttft_ms": {"p50": ttft / 2, "p95": ttft}}
    pairs = [{"order": ["app", "vllm"], "app": run(95, 100), "vllm": run(100, 200)},
             {"order": ["vllm", "app"], "app": run(99, 100), "vllm": run(100, 100)}]
    r = {"pairs": pairs, **ratios(pairs, "app", "vllm")}
    assert r["tok_s_ratio"] == [0.95, 0.99] and r["tok_s_ratio_median"] == 0.97
    assert r["ttft_p95_ratio_median"] == 0.75 and r["pair_count"] == 2
    assert "vllm then app" in table({"api": r}) and "median of 2" in table({"api": r})
