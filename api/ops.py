"""The operator's routes, beside the chat and the OpenAI API on the same server:

    GET /ready    readiness: 200 once every engine is up, 503 while starting, stopping or
                  after a failure, with each engine's health, seats and line, the turns in
                  flight, and whether the database answers and which writes it refused;
                  with several front ends (launcher.py), which one answered,
                  each one's status, and 200 only when every one is ready
    GET /notice   what every open page says above the chat (public/model-status.js): the
                  engines' state, else a test mode or a demo's banner; always 200
    GET /metrics  Prometheus' text format: the app's series (service/turn_metrics.py), every
                  engine's vLLM series by preset and how accounts share each preset's line
                  (engine/metrics.py), the process's own;
                  with several front ends every one's, labelled `front_end`

None needs a login (probes and scrapers have none) and none holds a user's name or text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import Engines
from engine.metrics import PresetSeries, ShareSeries
from service.front_ends import PEER_HEADER


class Ops:
    """The routes (`router`) and the registry behind /metrics (`registry`: the app's own
    series register there)."""

    def __init__(self, engines: Engines, shutdown, store, page_notice: Callable[[str], str],
                 front_end=None):
        self.engines, self.shutdown, self.store = engines, shutdown, store
        self.front_end = front_end  # service.front_ends.FrontEnd, when one of several
        self.page_notice = page_notice
        self.registry = CollectorRegistry()
        self.registry.register(PresetSeries(engines.metric_registries))
        self.registry.register(ShareSeries(lambda: engines.admission))
        ProcessCollector(registry=self.registry)
        self.router = APIRouter()
        self.router.add_api_route("/ready", self.ready, methods=["GET"])
        self.router.add_api_route("/notice", self.notice, methods=["GET"])
        self.router.add_api_route("/metrics", self.metrics, methods=["GET"])

    async def ready(self, request: Request) -> JSONResponse:
        health = await self.state(request)
        return JSONResponse(health, status_code=200 if health["status"] == "ok" else 503)

    async def state(self, request: Request) -> dict:
        """What /ready answers (the admin page shows it too)."""
        health = await self.engines.health()
        health["turns_in_flight"] = self.shutdown.turns
        # Failed database writes are the operator's to see here, not only in the log.
        health["store"] = {"reachable": await self.store.healthy(),
                           "failed_writes": self.store.failures,
                           "last_failure": self.store.last_failure}
        if self.shutdown.closing:
            health["status"] = "stopping"
        front = self.front_end
        if front is not None:  # whose answer this is: the engines as it sees them
            health["front_end"] = {"index": front.index, "count": front.count,
                                   "pid": os.getpid()}
        if front is not None and front.count > 1 and not front.from_peer(
                request.headers.get(PEER_HEADER)):  # ready when every front end is
            statuses = {str(front.index): health["status"]}
            for index, answer in (await front.ask_peers("/ready")).items():
                theirs = _parsed(answer)
                statuses[str(index)] = "unreachable" if answer is None else \
                    str((theirs or {}).get("status", "unknown"))
                _fold(health, theirs)
            health["front_ends"] = statuses
            if health["status"] == "ok":
                health["status"] = next((s for s in statuses.values() if s != "ok"), "ok")
        return health

    async def notice(self) -> JSONResponse:
        """Always 200: a 503 would be logged as an error in every visitor's console."""
        status = "stopping" if self.shutdown.closing else (await self.engines.health())["status"]
        return JSONResponse({"ready": status == "ok", "notice": self.page_notice(status)})

    async def metrics(self, request: Request) -> Response:
        """This process's series; with several front ends, every front end's, each sample
        labelled with its `front_end` (a peer asking gets this one's alone)."""
        own = generate_latest(self.registry)
        front = self.front_end
        if front is None or front.count == 1 or front.from_peer(request.headers.get(PEER_HEADER)):
            return Response(own, media_type=CONTENT_TYPE_LATEST)
        texts = {front.index: own.decode()}
        for index, answer in (await front.ask_peers("/metrics")).items():
            if answer and answer[0] == 200:
                texts[index] = answer[1]
        return Response(labelled(texts), media_type=CONTENT_TYPE_LATEST)


# Each front end counts its own turns in its lines (its part of the seats), and vLLM sends
# each step's statistics to one of the front ends only: the app's figures are their sums.
SUMMED = ("admitted", "queued", "max_admitted", "max_queued", "kv_held", "steps",
          "preempted", "unfinished_requests")
PRESET_SUMMED = ("admitted", "queued", "seats", "max_queued", "kv_held")


def _parsed(answer: tuple[int, str] | None) -> dict | None:
    """A peer's /ready answer as JSON (None: no answer, or none that reads as an object)."""
    try:
        data = json.loads(answer[1]) if answer else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _add(mine: dict, theirs: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if isinstance(theirs.get(key), int) and isinstance(mine.get(key), int):
            mine[key] += theirs[key]


def _fold(health: dict, theirs: dict | None) -> None:
    """A peer's engine figures (its parsed /ready) added into this front end's
    (`front_ends_counted`: how many front ends' figures it holds)."""
    engines = (theirs or {}).get("engines")
    if not isinstance(engines, dict):
        return
    for name, engine in health["engines"].items():
        other = engines.get(name) or {}
        _add(engine, other, SUMMED)
        if isinstance(other.get("peak_running"), int):
            engine["peak_running"] = max(engine.get("peak_running") or 0, other["peak_running"])
        for preset, line in (engine.get("presets") or {}).items():
            _add(line, (other.get("presets") or {}).get(preset) or {}, PRESET_SUMMED)
        engine["front_ends_counted"] = engine.get("front_ends_counted", 1) + 1


def labelled(texts: dict[int, str]) -> bytes:
    """Prometheus texts of several front ends as one, each sample with its `front_end`."""
    families: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(
                family.name, family.documentation, family.type, family.unit))
            merged.samples += [sample._replace(labels={**sample.labels, "front_end": str(index)})
                               for sample in family.samples]
    registry = CollectorRegistry()
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    """A collector of metric families already gathered."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
