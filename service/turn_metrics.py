"""The app's own Prometheus series, by chat profile, and one log line per turn.

Every message that reaches a turn is counted `started` and ends as exactly one of
`finished`, `stopped` (Stop, a closed browser, shutdown), `failed` (an unexpected error) or
`refused` with reason `engine` (the line was full, the engine restarting or unreachable).
Messages refused before a turn began are `refused` with reason `message` (empty,
too long, too many this minute, one already being answered) or `closing` (shutting down).
Tokens count finished turns. No UI here: service/turn.py (each turn, for the chat and the
API) and app.py (messages refused before a turn) report, this file keeps count.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine import TurnStats
from service import front_ends

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
GAP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# By this name, not the module's: the README gives it to operators to filter on.
turn_log = logging.getLogger("vchat.turns")


def _front_end_index() -> int | None:
    front = front_ends.current()
    return front.index if front is not None else None


@dataclass
class Arrival:
    """A chat message on its way to its turn (time.monotonic()): it reached the socket
    handler `at`, passed the guard's login and quota checks (`checked`), and Chainlit
    handed it to the app's on_message (`handled`: after its task_start, message step and
    "run" step)."""
    at: float
    checked: float | None = None
    handled: float | None = None


@dataclass
class TurnRecord:
    """What one turn's log line says (message text only where the operator asked)."""
    outcome: str  # finished, stopped, failed, refused
    user: str | None
    profile: str
    preset: str | None = None
    request_id: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt's, read from vLLM's prefix cache
    output_tokens: int | None = None
    ttft_ms: float | None = None  # in the engine: from its request to its first token
    app_ttft_ms: float | None = None  # in the app: from the message's arrival to the first
    # token handed to the socket (the engine's part, the database's check of the login, the
    # history's fitting, the event loop's queue)
    ttft_legs_ms: str | None = None  # ttft_ms's legs in the engine, "leg:ms,..." (stats.py)
    to_turn_ms: float | None = None  # app_ttft_ms's first part: the message's arrival to its
    # turn's start (the socket's handler, the login's check, Chainlit's own handling)
    to_turn_legs_ms: str | None = None  # to_turn_ms's legs, "checks:ms,chainlit:ms,app:ms"
    tokens_per_s: float | None = None
    finish_reason: str | None = None
    reason: str | None = None  # why it was refused
    message: str | None = None
    reply: str | None = None
    # which of the app's front ends ran it (service/front_ends.py); None: the app is one
    front_end: int | None = field(default_factory=_front_end_index)
    arrival: Arrival | None = None  # the message's way to its turn; not logged

    def turn_began(self) -> None:
        self.to_turn_ms = self._since_arrival()
        a = self.arrival
        if a is not None and a.checked is not None and a.handled is not None:
            marks = (a.at, a.checked, a.handled, time.monotonic())
            self.to_turn_legs_ms = ",".join(
                f"{leg}:{(end - start) * 1000:.1f}" for leg, start, end in
                zip(("checks", "chainlit", "app"), marks, marks[1:]))

    def first_token_sent(self) -> None:
        if self.app_ttft_ms is None:
            self.app_ttft_ms = self._since_arrival()

    def _since_arrival(self) -> float | None:
        """Milliseconds since the message arrived (None: it did not come by the socket)."""
        if self.arrival is None:
            return None
        return round((time.monotonic() - self.arrival.at) * 1000, 1)

    def fields(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "arrival"}

    def line(self) -> str:
        return "turn " + " ".join(f"{k}={v!r}" if isinstance(v, str) and " " in v else f"{k}={v}"
                                  for k, v in self.fields().items())


class JsonLines(logging.Formatter):
    """Every log record as one JSON object (`VCHAT_LOG_FORMAT=json`); a turn's record
    carries its fields instead of a message."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname,
               "logger": record.name}
        turn = getattr(record, "turn", None)
        if turn is not None:
            out.update(event="turn", **turn)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class TurnMetrics:
    """Counters and gauges of users' turns, labelled by profile, in `registry`."""

    def __init__(self, registry: CollectorRegistry, *, log_text: bool = False):
        self.log_text = log_text
        by = ["profile"]
        self.started = Counter("vchat_turns_started", "Messages that reached a turn", by,
                               registry=registry)
        self.finished = Counter("vchat_turns_finished", "Turns answered to the end", by,
                                registry=registry)
        self.stopped = Counter("vchat_turns_stopped", "Turns ended early by Stop, a closed "
                               "browser or shutdown", by, registry=registry)
        self.failed = Counter("vchat_turns_failed", "Turns ended by an unexpected error", by,
                              registry=registry)
        self.refused = Counter("vchat_turns_refused", "Messages refused with a message to "
                               "the user (reason: message, closing, turn)",
                               [*by, "reason"], registry=registry)
        self.running = Gauge("vchat_turns_running", "Turns being answered or waiting", by,
                             registry=registry)
        self.waiting = Gauge("vchat_turns_waiting", "Turns waiting in line for their engine",
                             by, registry=registry)
        self.prompt_tokens = Counter("vchat_prompt_tokens", "Prompt tokens of finished turns",
                                     by, registry=registry)
        self.output_tokens = Counter("vchat_output_tokens", "Tokens written in finished "
                                     "turns", by, registry=registry)
        self.ttft = Histogram("vchat_time_to_first_token_seconds", "Time to the first token "
                              "in the engine, finished turns", by, buckets=TTFT_BUCKETS,
                              registry=registry)

        self.ttft_legs = Histogram("vchat_first_token_legs_seconds", "Where the engine's "
                                   "time to the first token went, by leg (to_engine, queued, "
                                   "prefill, back: engine/stats.py), finished turns",
                                   [*by, "leg"], buckets=LAG_BUCKETS + (5, 10),
                                   registry=registry)
        self.app_ttft = Histogram("vchat_app_time_to_first_token_seconds", "Time from a "
                                  "message's arrival to its reply's first token sent, "
                                  "finished turns", by, buckets=TTFT_BUCKETS,
                                  registry=registry)
        self.per_token = Histogram("vchat_time_per_output_token_seconds", "A finished "
                                   "turn's mean gap between its tokens after the first "
                                   "(vLLM's TPOT), per turn", by, buckets=GAP_BUCKETS,
                                   registry=registry)
        self.loop_lag = Histogram("vchat_event_loop_lag_seconds", "How late the app's event "
                                  "loop ran a timer that was due (service/loop.py)",
                                  buckets=LAG_BUCKETS, registry=registry)
        self.sessions_held = Gauge("vchat_chat_sessions_held", "What the app holds in "
                                   "memory of chat sessions: the sessions (open, or closed "
                                   "and kept for a reconnect) and their message lists",
                                   ["what"], registry=registry)
        self.gc_pause = Histogram("vchat_gc_pause_seconds", "How long each of Python's "
                                  "garbage collections stopped the app (service/loop.py)",
                                  ["generation"], buckets=LAG_BUCKETS, registry=registry)

    def gc_paused(self, generation: int, seconds: float) -> None:
        self.gc_pause.labels(str(generation)).observe(seconds)

    def refuse(self, record: TurnRecord) -> None:
        """A message refused before its turn began."""
        self.refused.labels(record.profile, record.reason).inc()
        self._log(record)

    def begin(self, profile: str) -> None:
        """A message reached a turn; `end` follows once, however it ends."""
        self.started.labels(profile).inc()
        self.running.labels(profile).inc()

    def end(self, record: TurnRecord, stats: TurnStats | None = None) -> None:
        """A started turn's end, with the engine's stats when it finished. Refused once
        begun is reason "turn"."""
        profile = record.profile
        self.running.labels(profile).dec()
        if stats is not None:
            record.preset, record.request_id = stats.preset, stats.request_id
            record.prompt_tokens, record.output_tokens = stats.prompt_tokens, stats.output_tokens
            record.cached_tokens = stats.cached_tokens
            record.ttft_ms = round(stats.ttft_s * 1000, 1) if stats.ttft_s is not None else None
            record.tokens_per_s = round(stats.tokens_per_s, 1)
            record.finish_reason = stats.finish_reason
            self.prompt_tokens.labels(profile).inc(stats.prompt_tokens)
            self.output_tokens.labels(profile).inc(stats.output_tokens)
            if stats.ttft_s is not None:
                self.ttft.labels(profile).observe(stats.ttft_s)
            if stats.tokens_per_s > 0:
                self.per_token.labels(profile).observe(1 / stats.tokens_per_s)
            if stats.first_token_legs:
                for leg, seconds in stats.first_token_legs.items():
                    self.ttft_legs.labels(profile, leg).observe(max(0.0, seconds))
                record.ttft_legs_ms = ",".join(f"{leg}:{seconds * 1000:.1f}" for leg, seconds
                                               in stats.first_token_legs.items())
            if record.app_ttft_ms is not None:
                self.app_ttft.labels(profile).observe(record.app_ttft_ms / 1000)
        if record.outcome == "refused":
            record.reason = "turn"
            self.refused.labels(profile, record.reason).inc()
        else:
            {"finished": self.finished, "stopped": self.stopped,
             "failed": self.failed}[record.outcome].labels(profile).inc()
        self._log(record)

    def _log(self, record: TurnRecord) -> None:
        if not self.log_text:
            record.message = record.reply = None
        turn_log.info("%s", record.line(), extra={"turn": record.fields()})
