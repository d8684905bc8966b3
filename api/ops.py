"""The operator's routes, beside the chat and the OpenAI API on the same server:

    GET /ready    readiness: 200 once every engine is up, 503 while starting, stopping or
                  after a failure, with each engine's health, seats and line, the turns in
                  flight, and whether the database answers and which writes it refused
    GET /notice   what every open page says above the chat about the engines' state
                  (public/model-status.js): always 200
    GET /metrics  Prometheus' text format: the app's series (service/turn_metrics.py), every
                  engine's vLLM series by preset (engine/metrics.py), the process's own

None needs a login (probes and scrapers have none) and none holds a user's name or text.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector
from prometheus_client import generate_latest
from starlette.responses import JSONResponse, Response

from engine import Engines
from engine.metrics import PresetSeries


class Ops:
    """The routes (`router`) and the registry behind /metrics (`registry`: the app's own
    series register there)."""

    def __init__(self, engines: Engines, shutdown, store, page_notice: Callable[[str], str]):
        self.engines, self.shutdown, self.store = engines, shutdown, store
        self.page_notice = page_notice
        self.registry = CollectorRegistry()
        self.registry.register(PresetSeries(engines.metric_registries))
        ProcessCollector(registry=self.registry)
        self.router = APIRouter()
        self.router.add_api_route("/ready", self.ready, methods=["GET"])
        self.router.add_api_route("/notice", self.notice, methods=["GET"])
        self.router.add_api_route("/metrics", self.metrics, methods=["GET"])

    async def ready(self) -> JSONResponse:
        health = await self.engines.health()
        health["turns_in_flight"] = self.shutdown.turns
        # Failed database writes are the operator's to see here, not only in the log.
        health["store"] = {"reachable": await self.store.healthy(),
                           "failed_writes": self.store.failures,
                           "last_failure": self.store.last_failure}
        if self.shutdown.closing:
            health["status"] = "stopping"
        return JSONResponse(health, status_code=200 if health["status"] == "ok" else 503)

    async def notice(self) -> JSONResponse:
        """Always 200: a 503 would be logged as an error in every visitor's console."""
        status = "stopping" if self.shutdown.closing else (await self.engines.health())["status"]
        return JSONResponse({"ready": status == "ok", "notice": self.page_notice(status)})

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
