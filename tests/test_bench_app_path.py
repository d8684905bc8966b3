"""`make bench`'s app path (bench/paths.py, bench/app_clients.py) against the stand-in
engine's server (tests/conftest.py), with the turn log read back (tools/turn_log.py)."""

from bench.paths import run_app
from bench.workloads import chat
from tools import turn_log


async def test_the_bench_spreads_its_users_over_client_processes(fast_stand_in):
    """bench/app_clients.py: the app path's users in two client processes (as many browsers
    are), every reply timed on the one clock; tools/turn_log.py then reads from the server's
    turn log where those turns' first tokens went."""
    result = await run_app(fast_stand_in.url, "Throughput-first", chat(6, 16, seed=3), 6,
                           processes=2)
    assert result["completed"] == 6 and result["output_tokens"] == 6 * 16
    assert len(result["client_cpu"]) == 2
    assert 0 < result["ttft_ms"]["p50"] < result["e2e_ms"]["p50"]
    rows = [r for r in turn_log.turns(fast_stand_in.log_path.read_text())
            if r.get("outcome") == "finished"][-6:]
    figures = turn_log.summary(rows)["all"]
    assert figures["turns"] == 6 and "front_ends" not in turn_log.summary(rows)
    assert 0 < figures["to_turn_ms"]["p50"] <= figures["app_ttft_ms"]["p50"]
    # Each turn's decode speed (the stand-in's pace; bench.room sets it beside the engine's).
    assert figures["tokens_per_s"]["p50"] > 0
    legs = [figures[f"to_turn_{leg}"]["p50"] for leg in ("checks", "chainlit", "app")]
    assert all(ms >= 0 for ms in legs) and sum(legs) <= figures["to_turn_ms"]["p50"] * 3
    # Fewer users than processes (the GPU bench's level 1 with its 4): one process each.
    result = await run_app(fast_stand_in.url, "Throughput-first", chat(1, 8, seed=4), 1,
                           processes=4)
    assert result["completed"] == 1 and len(result["client_cpu"]) == 1
