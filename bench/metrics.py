"""Serving metrics with vLLM's benchmark definitions, from per-request timings.

TTFT: request sent -> first text chunk. ITL: gaps between consecutive chunks of one
request, pooled over all requests. TPOT: (end - first chunk) / (output tokens - 1) per
request. E2E: sent -> last chunk. Throughput over the run's wall time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestTiming:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival time of each text chunk
    output_tokens: int = 0
    ok: bool = True

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    @property
    def e2e(self) -> float | None:
        return self.chunks[-1] - self.sent if self.chunks else None

    @property
    def tpot(self) -> float | None:
        if len(self.chunks) < 2 or self.output_tokens < 2:
            return None
        return (self.chunks[-1] - self.chunks[0]) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def _pcts(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    arr = np.asarray(values) * scale
    return {"p50": round(float(np.percentile(arr, 50)), 2),
            "p95": round(float(np.percentile(arr, 95)), 2),
            "p99": round(float(np.percentile(arr, 99)), 2),
            "mean": round(float(arr.mean()), 2)}


def spread(seconds) -> dict:
    """Min, median and max of some durations, in whole milliseconds."""
    ordered = sorted(seconds)
    return {"min": round(ordered[0] * 1000), "p50": round(statistics.median(ordered) * 1000),
            "max": round(ordered[-1] * 1000)}


def summarize(timings: list[RequestTiming], wall_s: float) -> dict:
    """Aggregate one run (one concurrency level, one path, one preset)."""
    done = [t for t in timings if t.ok and t.chunks]
    out_tokens = sum(t.output_tokens for t in done)
    return {
        "requests": len(timings),
        "completed": len(done),
        "output_tokens": out_tokens,
        "chunks": sum(len(t.chunks) for t in done),  # text events the user received
        "wall_s": round(wall_s, 3),
        "tok_s": round(out_tokens / wall_s, 2) if wall_s > 0 else None,
        "req_s": round(len(done) / wall_s, 3) if wall_s > 0 else None,
        "ttft_ms": _pcts([t.ttft for t in done]),
        "itl_ms": _pcts([g for t in done for g in t.itls()]),
        "tpot_ms": _pcts([t.tpot for t in done if t.tpot is not None]),
        "e2e_ms": _pcts([t.e2e for t in done]),
    }


def decode_by_wave(timings: list[RequestTiming], size: int) -> list[float]:
    """Each stream's decode speed (1 / TPOT, tokens/s), median over every `size` turns in
    the order their first tokens came: with `size` seats and replies of one length, the
    turns that ran together, so the engine's pace wave by wave."""
    started = sorted((t for t in timings if t.ok and t.tpot), key=lambda t: t.chunks[0])
    return [round(statistics.median(1 / t.tpot for t in started[i:i + size]), 1)
            for i in range(0, len(started), max(1, size))]
