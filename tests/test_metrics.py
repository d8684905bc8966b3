"""The pieces behind GET /metrics and the per-turn log line, without a server (the real
server's /metrics after real turns: tests/test_app.py)."""

import json
import logging
import time

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.turn_metrics import Arrival, JsonLines, TurnMetrics, TurnRecord
from engine import TurnStats
from engine.metrics import PresetSeries


def samples(registry) -> dict:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_engines_series_of_the_same_name_stay_apart_by_preset():
    """Regression in the making: vLLM's own logger keeps one engine's series per process
    (each new engine unregisters the last one's); here each has its own registry."""
    registries = {}
    for preset, running in (("latency-first", 3), ("throughput-first", 40)):
        registries[preset] = CollectorRegistry()
        Gauge("vllm:num_requests_running", "running", ["model_name", "engine"],
              registry=registries[preset]).labels("m", "0").set(running)
    shown = CollectorRegistry()
    shown.register(PresetSeries(lambda: registries))
    found = samples(shown)
    assert found[("vllm:num_requests_running",
                  (("engine", "0"), ("model_name", "m"), ("preset", "latency-first")))] == 3
    assert found[("vllm:num_requests_running",
                  (("engine", "0"), ("model_name", "m"), ("preset", "throughput-first")))] == 40
    registries.pop("throughput-first")  # asked at every scrape: a stopped engine goes
    assert len(samples(shown)) == 1


def test_turns_are_counted_by_profile_and_logged_once_without_text(caplog):
    registry = CollectorRegistry()
    turns = TurnMetrics(registry)
    stats = TurnStats("chat-1", "latency-first", 30, 12, 0.05, 0.5, "stop")
    with caplog.at_level(logging.INFO, logger="vchat.turns"):
        turns.begin("Latency-first")
        turns.end(TurnRecord("finished", "ann", "Latency-first", message="secret question",
                             reply="secret answer"), stats)
        turns.refuse(TurnRecord("refused", "bob", "Throughput-first", reason="message",
                                message="too long"))
    found = samples(registry)
    assert found[("vchat_turns_finished_total", (("profile", "Latency-first"),))] == 1
    assert found[("vchat_turns_running", (("profile", "Latency-first"),))] == 0
    assert found[("vchat_prompt_tokens_total", (("profile", "Latency-first"),))] == 30
    assert found[("vchat_output_tokens_total", (("profile", "Latency-first"),))] == 12
    assert found[("vchat_turns_refused_total",
                  (("profile", "Throughput-first"), ("reason", "message")))] == 1
    assert found[("vchat_time_to_first_token_seconds_count", (("profile", "Latency-first"),))] == 1
    lines = [r for r in caplog.records if r.name == "vchat.turns"]
    assert len(lines) == 2
    assert "secret" not in caplog.text and "too long" not in caplog.text
    first = lines[0].getMessage()
    for part in ("outcome=finished", "user=ann", "profile=Latency-first", "preset=latency-first",
                 "request_id=chat-1", "prompt_tokens=30", "output_tokens=12", "ttft_ms=50.0",
                 "finish_reason=stop"):
        assert part in first, first
    as_json = json.loads(JsonLines().format(lines[0]))
    assert as_json["event"] == "turn" and as_json["profile"] == "Latency-first"
    assert as_json["output_tokens"] == 12 and as_json["tokens_per_s"] == 24.4
    assert "message" not in as_json


def test_message_text_is_logged_only_when_asked(caplog):
    turns = TurnMetrics(CollectorRegistry(), log_text=True)
    with caplog.at_level(logging.INFO, logger="vchat.turns"):
        turns.begin("Latency-first")
        turns.end(TurnRecord("stopped", "ann", "Latency-first", message="the question",
                             reply="half an"))
    record = json.loads(JsonLines().format(caplog.records[-1]))
    assert (record["message"], record["reply"], record["outcome"]) == (
        "the question", "half an", "stopped")


def test_a_turns_first_token_is_also_timed_from_its_messages_arrival(caplog):
    """The app's TTFT (arrival to the first token sent: the engine's part and the app's
    before it) beside the engine's; once per turn, and the arrival itself is not logged."""
    registry = CollectorRegistry()
    turns = TurnMetrics(registry)
    record = TurnRecord("finished", "ann", "Latency-first")
    now = time.monotonic()  # came in 200 ms ago, checked 150 ms ago, handled 100 ms ago
    record.arrival = Arrival(now - 0.2, checked=now - 0.15, handled=now - 0.1)
    record.first_token_sent()
    record.turn_began()
    legs = {k: float(v) for k, v in (leg.split(":") for leg in
                                     record.to_turn_legs_ms.split(","))}
    assert list(legs) == ["checks", "chainlit", "app"]
    assert legs["checks"] == legs["chainlit"] == 50.0 and 100 <= legs["app"] < 10_000
    first = record.app_ttft_ms
    assert 200 <= record.to_turn_ms < 10_000  # the arrival to the turn's start: its part
    record.first_token_sent()  # later tokens leave it as it was
    assert record.app_ttft_ms == first and 200 <= first < 10_000
    with caplog.at_level(logging.INFO, logger="vchat.turns"):
        turns.begin("Latency-first")
        turns.end(record, TurnStats("chat-1", "latency-first", 30, 12, 0.05, 0.5, "stop"))
    found = samples(registry)
    assert found[("vchat_app_time_to_first_token_seconds_count",
                  (("profile", "Latency-first"),))] == 1
    assert found[("vchat_app_time_to_first_token_seconds_sum",
                  (("profile", "Latency-first"),))] == first / 1000
    line = json.loads(JsonLines().format(
        next(r for r in caplog.records if r.name == "vchat.turns")))
    assert line["app_ttft_ms"] == first and line["ttft_ms"] == 50.0 and "arrival" not in line
    assert line["to_turn_ms"] == record.to_turn_ms
    assert line["to_turn_legs_ms"] == record.to_turn_legs_ms
    unsent = TurnRecord("finished", "bob", "Latency-first")  # no arrival: an edit, the API
    unsent.turn_began()
    unsent.first_token_sent()
    assert unsent.app_ttft_ms is None and unsent.to_turn_ms is None


def test_the_engines_first_token_legs_are_counted_by_leg_and_logged(caplog):
    registry = CollectorRegistry()
    turns = TurnMetrics(registry)
    legs = {"to_engine": 0.002, "queued": 0.010, "prefill": 0.030, "back": 0.008}
    with caplog.at_level(logging.INFO, logger="vchat.turns"):
        turns.begin("Latency-first")
        turns.end(TurnRecord("finished", "ann", "Latency-first"),
                  TurnStats("chat-1", "latency-first", 30, 12, 0.05, 0.5, "stop", legs))
        turns.begin("Latency-first")  # an engine that says nothing of its legs
        turns.end(TurnRecord("finished", "bob", "Latency-first"),
                  TurnStats("chat-2", "latency-first", 30, 12, 0.05, 0.5, "stop"))
    found = samples(registry)
    for leg, seconds in legs.items():
        key = (("leg", leg), ("profile", "Latency-first"))
        assert found[("vchat_first_token_legs_seconds_count", key)] == 1
        assert found[("vchat_first_token_legs_seconds_sum", key)] == seconds
    first, second = (json.loads(JsonLines().format(r)) for r in caplog.records
                     if r.name == "vchat.turns")
    assert first["ttft_legs_ms"] == "to_engine:2.0,queued:10.0,prefill:30.0,back:8.0"
    assert "ttft_legs_ms" not in second


def test_the_kv_moved_to_and_from_cpu_memory_is_summed_over_the_engines_steps():
    """engine/stats.py's StepStats sums what vLLM's native KV offloading reports each step
    (bytes and the copies' GPU time, each way): the returning-chats bench reads it. The
    steps' SchedulerStats and their connector payloads are built with vLLM's own classes,
    as its offloading connector fills them on a GPU (it does not run on a CPU); a step
    without a connector, or another connector's payload, adds nothing."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats, _TransferMetricName as Name)
    from vllm.v1.metrics.stats import SchedulerStats

    from engine.stats import StepStats

    def step(load: tuple[int, float] | None = None, store: tuple[int, float] | None = None,
             payload: dict | None = None):
        stats = OffloadingConnectorStats()
        for moved, (size, time_s, sizes) in (
                (load, (Name.LOAD_BYTES, Name.LOAD_TIME, Name.LOAD_SIZE)),
                (store, (Name.STORE_BYTES, Name.STORE_TIME, Name.STORE_SIZE))):
            if moved is not None:
                stats.increase_counter(size, moved[0])
                stats.increase_counter(time_s, moved[1])
                stats.observe_histogram(sizes, moved[0])
        return SchedulerStats(kv_connector_stats=payload if payload is not None else
                              (None if stats.is_empty() else stats.data))

    collected = StepStats()
    for one in (step(load=(3 << 20, 0.002)), step(), step(store=(1 << 20, 0.001)),
                step(load=(5 << 20, 0.003), store=(2 << 20, 0.0005)),
                step(payload={"num_successful_transfers": 4})):
        collected.add(one)
    assert collected.steps == 5
    assert collected.offload == {"loaded_bytes": 8 << 20, "load_s": 0.005,
                                 "stored_bytes": 3 << 20, "store_s": 0.0015}
    collected.reset()
    assert set(collected.offload.values()) == {0}
