"""What the turns cost, and each account's daily token quota, counted from what is stored
(the `usage` table: one row a turn that reached an engine, chat and API alike), so that the
figures survive restarts and are the same on every replica of one database.

- A turn's row is kept when it ends, finished or stopped (service/turn.py), and written with
  the others of that second (`FLUSH_S`): its prompt's tokens and its replies' (the engine's
  count; for a stopped turn, the text of each of its replies counted by the profile's
  tokenizer). A crash of the app loses at most that second's rows; a stop writes them.
  Refused and failed turns cost nothing. The operator's API key has no account: its turns
  are counted with no identifier.
- A quota is tokens (prompt and reply) per UTC day, decided when a turn is admitted
  (store/admission.py, for a message, an edit, Regenerate and the API alike): while the
  day's turns, with what the turns under way may still cost, reach it, the next is refused
  with `quota_message`'s words and nothing of it is stored. An admitted turn's row is
  written then, pending, and becomes its cost when it ends.
- `report` is what `python -m store usage` prints: per account and profile, turns, tokens,
  stopped replies, and the thumbs up and down given to replies in the period; `days`, what
  `usage --daily` prints: per day and profile (the admin page charts both).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from store.accounts import AccountError
from store.rows import decoded

log = logging.getLogger(__name__)

_INSERT = text(
    'INSERT INTO usage ("id", "identifier", "profile", "source", "day", "createdAt", '
    '"promptTokens", "replyTokens", "stopped", "threadId") '
    "VALUES (:id, :identifier, :profile, :source, :day, :created, :prompt, :reply, "
    ":stopped, :thread)")
# A turn admitted under a limit has a row already (store/admission.py's hold): its cost
# replaces what it held; one that cost nothing gives its place back.
_SETTLE = text(
    'UPDATE usage SET "promptTokens" = :prompt, "replyTokens" = :reply, "stopped" = :stopped, '
    '"threadId" = COALESCE(:thread, "threadId"), "pending" = :no WHERE "id" = :hold')
_RELEASE = text('DELETE FROM usage WHERE "id" = :hold AND "pending" = :yes')
_SET_QUOTA = text('UPDATE accounts SET "dailyTokens" = :n WHERE "identifier" = :i')
_TURNS = text(
    'SELECT "identifier", "profile", COUNT(*), SUM("promptTokens"), SUM("replyTokens"), '
    'SUM(CASE WHEN "stopped" THEN 1 ELSE 0 END) FROM usage '
    'WHERE "day" >= :since AND "day" < :before AND NOT "pending" '
    'GROUP BY "identifier", "profile"')
_DAYS = text(
    'SELECT "day", "profile", COUNT(*), SUM("promptTokens"), SUM("replyTokens") FROM usage '
    'WHERE "day" >= :since AND "day" < :before AND NOT "pending" GROUP BY "day", "profile" '
    'ORDER BY "day", "profile"')
# Every thumb given to a reply written in the period, with its comment and the reply's
# metadata (its profile), newest first: the page rates a turn's run (Chainlit's step around
# the reply), an API client the reply itself.
_FEEDBACK = text(
    'SELECT s."createdAt", t."userIdentifier", f."value", f."comment", f."threadId", '
    's."metadata", r."metadata", r."output", '
    """CASE WHEN s."type" = 'assistant_message' THEN s."output" END """
    'FROM feedbacks f JOIN steps s ON s."id" = f."forId" '
    'JOIN threads t ON t."id" = f."threadId" '
    # the run's reply (its last), where the rated step is a run
    'LEFT JOIN steps r ON r."id" = (SELECT x."id" FROM steps x WHERE x."parentId" = s."id" '
    """AND x."type" = 'assistant_message' ORDER BY x."createdAt" DESC LIMIT 1) """
    'WHERE s."createdAt" >= :since AND s."createdAt" < :before ORDER BY s."createdAt" DESC')

FLUSH_S = 1.0  # the longest a finished turn's usage waits to be written

FIRST_DAY, LAST_DAY = date(1970, 1, 1), date(9999, 12, 30)


def today() -> str:
    return datetime.now(timezone.utc).date().isoformat()


def parse_day(value: str | None, what: str = "date") -> date | None:
    """A YYYY-MM-DD date from the command line; a ValueError in words otherwise."""
    if value is None:
        return None
    try:
        return date.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"{what} {value!r} is not a date: use YYYY-MM-DD, "
                         "for example 2026-12-01") from None


def parse_quota(value: str) -> int | None:
    """`users quota NAME N`'s N: tokens a day, 0 or more, or "none" for no quota."""
    if value.strip().lower() == "none":
        return None
    try:
        tokens = int(value.replace(",", "").replace("_", ""))
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise ValueError(f"quota {value!r}: a whole number of tokens a day, 0 or more, "
                         "or 'none' for no quota")
    return tokens


@dataclass(frozen=True)
class Spent:
    """One turn's cost."""
    identifier: str | None  # None: the operator's API key
    profile: str
    source: str  # "chat" or "api"
    prompt_tokens: int
    reply_tokens: int
    stopped: bool
    thread_id: str | None = None  # the chat's, for a chat turn


@dataclass(frozen=True)
class UsageLine:
    """One account's use of one profile in a period."""
    identifier: str | None
    profile: str
    turns: int = 0
    prompt_tokens: int = 0
    reply_tokens: int = 0
    stopped: int = 0
    thumbs_up: int = 0
    thumbs_down: int = 0


@dataclass(frozen=True)
class Thumb:
    """One reply's feedback."""
    at: str  # when the reply was written (UTC)
    identifier: str | None
    profile: str
    thumbs: str  # "up" or "down"
    comment: str | None
    thread_id: str
    reply: str | None = None  # the rated reply's text


@dataclass(frozen=True)
class DayLine:
    """One UTC day's turns in one profile."""
    day: str
    profile: str
    turns: int
    prompt_tokens: int
    reply_tokens: int


def quota_message(quota: int, used: int) -> str:
    if quota == 0:
        return ("Your account may not start new turns today (its daily token quota is 0). "
                "Please ask an admin.")
    return (f"You have used today's {quota:,} tokens ({used:,} so far), so this message was "
            "not sent. The quota starts again at midnight UTC; an admin can raise it.")


def _profile(metadata) -> str | None:
    metadata = decoded({"metadata": metadata})["metadata"]
    return metadata.get("profile") if isinstance(metadata, dict) else None


class Usage:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self._pending: list[dict] = []  # rows not written yet
        self._flushing: asyncio.Task | None = None

    def record(self, spent: Spent, hold=None) -> None:
        """Keep the turn's row for the next write, at most FLUSH_S from now: one transaction
        for all the turns that ended meanwhile, not one each through the writer's connection
        (BENCHMARKS.md, "Trials at work"). `hold`: the place the turn was admitted with
        (store/admission.py), which its cost replaces."""
        now = datetime.now(timezone.utc)
        row = {"prompt": spent.prompt_tokens, "reply": spent.reply_tokens,
               "stopped": spent.stopped, "thread": spent.thread_id}
        if hold is not None:
            self._pending.append({**row, "hold": hold.id, "no": False})
        else:
            self._pending.append({
                **row, "id": str(uuid.uuid4()), "identifier": spent.identifier,
                "profile": spent.profile, "source": spent.source,
                "day": now.date().isoformat(), "created": now.isoformat(timespec="seconds")})
        self._write_soon()

    def release(self, hold) -> None:
        """A held place given back: the turn it was for cost nothing."""
        self._pending.append({"hold": hold.id, "yes": True, "release": True})
        self._write_soon()

    def _write_soon(self) -> None:
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        await asyncio.sleep(FLUSH_S)
        try:
            await self.flush()
        except Exception as exc:  # the database away: the rows wait for the next turn's write
            log.error("turns' usage not stored yet (%d rows kept): %s", len(self._pending), exc)

    async def flush(self) -> None:
        """Write the rows kept so far; on failure they stay for the next time."""
        rows, self._pending = self._pending, []
        if not rows:
            return
        new = [r for r in rows if "hold" not in r]
        settled = [r for r in rows if "hold" in r and "release" not in r]
        released = [{"hold": r["hold"], "yes": True} for r in rows if "release" in r]
        try:
            async with self.engine.begin() as conn:
                for statement, batch in ((_INSERT, new), (_SETTLE, settled),
                                         (_RELEASE, released)):
                    if batch:
                        await conn.execute(statement, batch)
        except BaseException:
            self._pending[:0] = rows
            raise

    async def settle(self) -> None:
        """Write what is kept now (at shutdown, and in tests)."""
        if self._flushing is not None and not self._flushing.done():
            self._flushing.cancel()
        await self.flush()

    async def set_quota(self, identifier: str, tokens: int | None) -> None:
        if tokens is not None and tokens < 0:
            raise AccountError("a quota is 0 tokens a day or more")
        async with self.engine.begin() as conn:
            done = await conn.execute(_SET_QUOTA, {"n": tokens, "i": identifier})
            if done.rowcount == 0:
                raise AccountError(f"no user {identifier!r}")

    async def report(self, since: date | None = None, until: date | None = None,
                     thumbs: list[Thumb] | None = None) -> list[UsageLine]:
        """Per account and profile, from `since` to `until` (UTC days, both included);
        `thumbs`: the period's feedback where the caller has it already."""
        lines: dict[tuple, dict] = {}
        async with self.engine.connect() as conn:
            for who, profile, turns, prompt, reply, stopped in (
                    await conn.execute(_TURNS, period(since, until))).all():
                lines[(who, profile)] = {"turns": turns, "prompt_tokens": int(prompt or 0),
                                         "reply_tokens": int(reply or 0),
                                         "stopped": int(stopped or 0)}
        for thumb in await self.feedback(since, until) if thumbs is None else thumbs:
            line = lines.setdefault((thumb.identifier, thumb.profile), {})
            key = f"thumbs_{thumb.thumbs}"
            line[key] = line.get(key, 0) + 1
        return [UsageLine(who, profile, **counts) for (who, profile), counts
                in sorted(lines.items(), key=lambda kv: (kv[0][0] or "", kv[0][1]))]

    async def feedback(self, since: date | None = None, until: date | None = None
                       ) -> list[Thumb]:
        """Every thumb given to a reply written from `since` to `until`, newest first."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(_FEEDBACK, period(since, until))).all()
        return [Thumb(at, who, _profile(own) or _profile(replied) or "?",
                      "up" if value else "down", comment, thread, reply or own_text)
                for at, who, value, comment, thread, own, replied, reply, own_text in rows]

    async def days(self, since: date | None = None, until: date | None = None
                   ) -> list[DayLine]:
        """Per UTC day and profile, from `since` to `until` (both included), oldest first;
        days with no turns are left out."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(_DAYS, period(since, until))).all()
        return [DayLine(day, profile, turns, int(prompt or 0), int(reply or 0))
                for day, profile, turns, prompt, reply in rows]


def period(since: date | None, until: date | None) -> dict[str, str]:
    """`since` to `until` (UTC days, both included; open ends allowed) as the statements'
    bounds: {"since": first day, "before": the day after the last}, ISO dates, which compare
    as text with a day and with an ISO time alike."""
    since, until = since or FIRST_DAY, until or LAST_DAY
    if since > until:
        raise ValueError(f"--since {since} is after --until {until}")
    return {"since": since.isoformat(), "before": (until + timedelta(days=1)).isoformat()}
