"""The benchmark's metric definitions (vLLM's) and its headline figures, on hand-made
timings and runs."""

from bench.metrics import RequestTiming, decode_by_wave, summarize
from bench.report import targets
from bench.run import headline, keep_preset_runs
from bench.workloads import chat, mixed


def test_ttft_itl_tpot_e2e_and_throughput():
    a = RequestTiming(sent=0.0, chunks=[0.5, 0.6, 0.8, 1.0], output_tokens=4)
    b = RequestTiming(sent=0.0, chunks=[1.0, 1.5], output_tokens=2)
    failed = RequestTiming(sent=0.0, ok=False)
    result = summarize([a, b, failed], wall_s=2.0)
    assert result["completed"] == 2 and result["output_tokens"] == 6
    assert result["tok_s"] == 3.0 and result["req_s"] == 1.0
    assert result["ttft_ms"]["p50"] == 750.0
    assert result["e2e_ms"]["p50"] == 1250.0
    # ITL pooled over both requests: 100, 200, 200, 500 ms.
    assert result["itl_ms"]["p50"] == 200.0 and result["itl_ms"]["mean"] == 250.0
    # TPOT per request: (1.0 - 0.5) / 3 and (1.5 - 1.0) / 1.
    assert abs(result["tpot_ms"]["mean"] - (500 / 3 + 500) / 2) < 0.01


def test_decode_speed_is_taken_wave_by_wave_in_the_order_turns_began():
    """bench.room sets the engine's pace per wave of seats beside the app's: turns grouped
    by their first token's time, not by the order they were sent or listed."""
    def turn(first: float, tpot: float) -> RequestTiming:
        return RequestTiming(sent=0.0, chunks=[first, first + 10 * tpot], output_tokens=11)
    late_and_slow = [turn(5.0 + i, 0.02) for i in range(3)]
    early_and_fast = [turn(0.1 * i, 0.01) for i in range(3)]
    failed = RequestTiming(sent=0.0, ok=False)
    assert decode_by_wave([*late_and_slow, failed, *early_and_fast], 3) == [100.0, 50.0]
    assert decode_by_wave(early_and_fast, 2) == [100.0, 100.0]


def test_workloads_are_seeded_and_mixed_has_long_prompts():
    assert chat(8, seed=3) == chat(8, seed=3) != chat(8, seed=4)
    reqs = mixed(8, output_len=16, seed=1, long_every=4)
    assert [r.long for r in reqs] == [False, False, False, True] * 2
    assert all((0.5 <= r.delay_s <= 3.0) == r.long for r in reqs)
    assert all(r.output_len == 16 for r in reqs)
    assert len(reqs[3].prompt) > 10 * len(reqs[0].prompt)


def run(tok_s: float, itl_p95: float) -> dict:
    return {"tok_s": tok_s, "ttft_ms": {"p50": 1.0, "p95": 2.0},
            "itl_ms": {"p50": itl_p95 / 2, "p95": itl_p95}}


def test_presets_are_compared_by_neighbouring_runs_and_medians():
    # The host slows down between the two repeats: absolute figures drift, ratios do not.
    done = {"latency-first": [run(40.0, 100.0), run(30.0, 148.5)],
            "throughput-first": [run(80.0, 160.0), run(60.0, 220.0)]}
    runs = {name: {"engine": {}} for name in done}
    pairs = keep_preset_runs(runs, done, 32)
    assert pairs == {"itl_p95_ratio": [0.625, 0.675], "tok_s_ratio": [2.0, 2.0]}
    result = headline(runs, 32, pairs)
    assert result["presets_itl_p95_ratio"] == 0.65 and result["presets_tok_s_ratio"] == 2.0
    # Per preset, each figure is the median over the repeats.
    assert result["presets"]["latency-first"]["tok_s"] == 35.0
    assert result["presets"]["throughput-first"]["itl_p95_ms"] == 190.0
    table = targets(result)
    assert "| 0.65 (median of 0.625 / 0.675) | yes |" in table
    assert "| 2.0 (median of 2.0 / 2.0) | yes |" in table
