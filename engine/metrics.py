"""vLLM's own Prometheus series for every engine of the process, told apart by preset.

vLLM's `PrometheusStatLogger` writes into prometheus_client's process-wide registry and,
when it starts, unregisters every `vllm:` series already there: a second engine in the
same process silently replaces the first one's series. Here each engine's logger writes
into a registry of its own (`engine_series`), and `PresetSeries` shows them all at once,
each sample with a `preset` label beside vLLM's `model_name` and `engine`.

`ShareSeries` adds how each preset's admission line is shared among accounts
(engine/admission.py), as figures only: no account is named in a label.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric


def engine_series(registry: CollectorRegistry) -> type:
    """vLLM's Prometheus logger for one engine, writing into `registry` (a stat logger
    factory for `AsyncLLM`; being a PrometheusStatLogger, it replaces vLLM's default)."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger  # only where an engine runs

    class EngineSeries(PrometheusStatLogger):
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    return EngineSeries


class PresetSeries:
    """A prometheus_client collector: the series of every engine's registry, merged by
    name, each sample labelled with its preset. `registries` is asked at every scrape
    (an engine restarted after a crash brings a new registry)."""

    def __init__(self, registries: Callable[[], Mapping[str, CollectorRegistry]]):
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for preset, registry in self.registries().items():
            for family in registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
                into.samples += [s._replace(labels={**s.labels, "preset": preset})
                                 for s in family.samples]
        yield from merged.values()


class ShareSeries:
    """A prometheus_client collector: per preset, the accounts with turns inside and
    waiting, the most one of them has, and the turns refused for an account's share of a
    full line. `admissions` (the pool's, by preset) is asked at every scrape."""

    def __init__(self, admissions: Callable[[], Mapping]):
        self.admissions = admissions

    def collect(self) -> Iterator[Metric]:
        accounts = GaugeMetricFamily("vchat_admission_accounts", "Accounts with turns "
                                     "inside the engine (admitted) or waiting (queued)",
                                     labels=["preset", "state"])
        largest = GaugeMetricFamily("vchat_admission_largest_account_turns", "The most turns "
                                    "one account has inside (admitted) or waiting (queued)",
                                    labels=["preset", "state"])
        refused = CounterMetricFamily("vchat_admission_account_refused", "Turns refused "
                                      "for their account's share of a full line",
                                      labels=["preset"])
        for preset, gate in dict(self.admissions()).items():
            shares = gate.shares()
            for state in ("admitted", "queued"):
                accounts.add_metric([preset, state], shares[f"accounts_{state}"])
                largest.add_metric([preset, state], shares[f"largest_{state}"])
            refused.add_metric([preset], shares["refused_over_share"])
        yield from (accounts, largest, refused)
