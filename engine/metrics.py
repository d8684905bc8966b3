"""vLLM's own Prometheus series for every engine of the process, told apart by preset.

vLLM's `PrometheusStatLogger` writes into prometheus_client's process-wide registry and,
when it starts, unregisters every `vllm:` series already there: a second engine in the
same process silently replaces the first one's series. Here each engine's logger writes
into a registry of its own (`engine_series`), and `PresetSeries` shows them all at once,
each sample with a `preset` label beside vLLM's `model_name` and `engine`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric


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
