"""The benchmark's metric definitions (vLLM's), on hand-made timings."""

from bench.metrics import RequestTiming, summarize
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


def test_workloads_are_seeded_and_mixed_has_long_prompts():
    assert chat(8, seed=3) == chat(8, seed=3) != chat(8, seed=4)
    reqs = mixed(8, output_len=16, seed=1, long_every=4)
    assert [r.long for r in reqs] == [False, False, False, True] * 2
    assert all((0.5 <= r.delay_s <= 3.0) == r.long for r in reqs)
    assert all(r.output_len == 16 for r in reqs)
    assert len(reqs[3].prompt) > 10 * len(reqs[0].prompt)
