"""Chats out of the database, as JSON and as Markdown: a user's own (the page's Export
menu, chat/downloads.py) and an admin's everything-in-a-period (`python -m store export`).

The JSON (`FORMAT`, version `VERSION`) is the record; `read` takes it back in, checked. Its
shape, also in the README's "Using the app":

    {"format": "vchat-chats", "version": 1, "exported_at": "2026-12-04T10:00:00+00:00",
     "chats": [{"id": "...", "name": "...", "owner": "alice", "created_at": "...",
                "profile": "Latency-first",
                "messages": [{"id": "...", "role": "user" | "assistant", "text": "...",
                              "created_at": "...", "profile": "Latency-first" | null,
                              "stopped": false,
                              "documents": [{"name": "spec.pdf", "kind": "pdf",
                                             "size": 48213, "text": "..."}],
                              "feedback": {"thumbs": "up" | "down", "comment": "..." | null}
                                          | null}]}]}

Messages are the chat's as the page showed them, oldest first (the app's notices are
assistant messages too); times are UTC ISO 8601 as stored. A user message's `documents` are
the files attached to it, with the text the model read of each (`size`: the file's bytes);
the Markdown names them under the message.

The Markdown is for reading: a heading per chat and per message. What a user or the model
wrote cannot pass for the export's own: in their text, outside fenced code
blocks, a line that would make a heading (`#`, or a `===`/`---` underline) has its mark
escaped and raw HTML is escaped as entities (`&lt;`); a code block left open is closed
where its message ends. The JSON keeps the text as it was.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from datetime import date, datetime, timezone

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from store import queries as q
from store import rows
from store.usage import period

FORMAT, VERSION = "vchat-chats", 1
ROLES = {"user_message": "user", "assistant_message": "assistant"}
_OWN = text('SELECT "id" FROM threads WHERE "userIdentifier" = :owner '
            'ORDER BY "createdAt", "id"')
_FILES = text('SELECT "messageId", "name", "kind", "size", "text" FROM documents '
              'WHERE "threadId" = :thread_id ORDER BY "messageId", "position"')
# Chats with a message in [since, before), whoever owns them (the admin's export).
_IN_PERIOD = text(
    'SELECT t."id" FROM threads t WHERE EXISTS (SELECT 1 FROM steps s '
    'WHERE s."threadId" = t."id" AND s."createdAt" >= :since AND s."createdAt" < :before) '
    'AND (CAST(:owner AS TEXT) IS NULL OR t."userIdentifier" = CAST(:owner AS TEXT)) '
    'ORDER BY t."createdAt", t."id"')


class ExportError(ValueError):
    """An export file that is not one of these, said in words."""


@dataclass
class ExportedMessage:
    id: str
    role: str
    text: str
    created_at: str | None
    profile: str | None = None
    stopped: bool = False
    feedback: dict | None = None  # {"thumbs": "up" | "down", "comment": str | None}
    documents: list[dict] = field(default_factory=list)  # {"name", "kind", "size", "text"}


@dataclass
class ExportedChat:
    id: str
    name: str | None
    owner: str | None
    created_at: str | None
    profile: str | None
    messages: list[ExportedMessage] = field(default_factory=list)


async def chat(engine: AsyncEngine, thread_id: str, owner: str | None) -> ExportedChat | None:
    """One chat, if it exists and (`owner` given) is `owner`'s; None either way, so that a
    caller cannot tell another's chat from none."""
    if not rows.is_uuid(thread_id):
        return None
    async with engine.connect() as conn:
        found = (await conn.execute(text(q.THREAD_BY_ID), {"id": thread_id})).mappings().first()
        if found is None or (owner is not None and found["userIdentifier"] != owner):
            return None
        steps = (await conn.execute(text(q.STEPS_OF_THREAD),
                                    {"thread_id": thread_id})).mappings().all()
        files = (await conn.execute(_FILES, {"thread_id": thread_id})).mappings().all()
    attached: dict[str, list[dict]] = {}
    for f in files:
        attached.setdefault(f["messageId"], []).append(
            {k: f[k] for k in ("name", "kind", "size", "text")})
    return _chat(rows.decoded(dict(found)), [rows.decoded(dict(s)) for s in steps], attached)


async def chats_of(engine: AsyncEngine, owner: str) -> list[ExportedChat]:
    """Every chat of `owner`, oldest first."""
    async with engine.connect() as conn:
        ids = (await conn.execute(_OWN, {"owner": owner})).scalars().all()
    return [c for c in [await chat(engine, i, owner) for i in ids] if c is not None]


async def chats_in(engine: AsyncEngine, since: date | None, until: date | None,
                   owner: str | None = None) -> list[ExportedChat]:
    """Every chat with a message from `since` to `until` (UTC days, both included), whole."""
    async with engine.connect() as conn:
        ids = (await conn.execute(_IN_PERIOD, {**period(since, until),
                                               "owner": owner})).scalars().all()
    return [c for c in [await chat(engine, i, None) for i in ids] if c is not None]


def _chat(thread: dict, steps: list[dict], attached: dict[str, list[dict]]) -> ExportedChat:
    metadata = thread.get("metadata") if isinstance(thread.get("metadata"), dict) else {}
    out = ExportedChat(thread["id"], thread.get("name"), thread.get("userIdentifier"),
                       thread.get("createdAt"), metadata.get("chat_profile"))
    # The page's thumbs rate a turn's run (Chainlit's step around the app's on_message) and
    # show under its last message: a run's feedback goes with its last assistant message.
    rated = {s["id"]: _feedback(s) for s in steps if s.get("feedbackValue") is not None}
    last_reply = {s.get("parentId"): s["id"] for s in steps
                  if s.get("type") == "assistant_message" and s.get("parentId") in rated}
    for step in steps:
        role = ROLES.get(step.get("type"))
        if role is None:  # the runs themselves: not messages
            continue
        meta = step.get("metadata") if isinstance(step.get("metadata"), dict) else {}
        feedback = rated.get(step["id"])
        if feedback is None and last_reply.get(step.get("parentId")) == step["id"]:
            feedback = rated[step["parentId"]]
        out.messages.append(ExportedMessage(
            step["id"], role, step.get("output") or "", step.get("createdAt"),
            meta.get("profile"), bool(meta.get("stopped")), feedback,
            attached.get(step["id"], [])))
    if out.profile is None:  # Chainlit stores the chat's profile when its session ends
        out.profile = next((m.profile for m in out.messages if m.profile), None)
    return out


def _feedback(step: dict) -> dict:
    return {"thumbs": "up" if step["feedbackValue"] else "down",
            "comment": step.get("feedbackComment")}


def as_json(chats: list[ExportedChat]) -> str:
    return json.dumps({"format": FORMAT, "version": VERSION,
                       "exported_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "chats": [asdict(c) for c in chats]}, ensure_ascii=False, indent=1)


def as_markdown(chats: list[ExportedChat]) -> str:
    parts = []
    for c in chats:
        parts.append(f"# {_line(c.name) or 'Chat'}\n\n"
                     f"*{_line(c.owner) or '?'}, {c.created_at or '?'}"
                     f"{', ' + _line(c.profile) if c.profile else ''}; chat {c.id}*\n")
        for m in c.messages:
            head = "You" if m.role == "user" else "Assistant"
            notes = [n for n in (_line(m.profile) if m.role == "assistant" else None,
                                 "stopped" if m.stopped else None) if n]
            if m.feedback:
                notes.append(f"thumbs {m.feedback['thumbs']}" + (
                    f": {_line(m.feedback['comment'])}" if m.feedback.get("comment") else ""))
            files = "".join(f"*Attached: {_line(d['name'])} ({d['size']:,} bytes)*\n\n"
                            for d in m.documents)
            parts.append(f"## {head} ({m.created_at or '?'}"
                         f"{'; ' + '; '.join(notes) if notes else ''})\n\n{files}"
                         f"{_markdown_text(m.text)}\n")
    return "\n".join(parts) or "No chats.\n"


def _line(value: str | None) -> str:
    """One line of text for a heading or note: no Markdown structure, no raw HTML."""
    return _no_html(" ".join((value or "").split()))


def _no_html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;")


_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")  # CommonMark's code fence
_HEADING = re.compile(r"^( {0,3})(#)")
_UNDERLINE = re.compile(r"^( {0,3})([=-])(?=[=-]*[ \t\r]*$)")  # makes the line above one


def _markdown_text(text: str) -> str:
    """A message's text in the Markdown export: its fenced code as written; elsewhere no
    line that makes a heading and no raw HTML."""
    out, fence, above = [], None, ""
    for line in text.split("\n"):
        mark = _FENCE.match(line)
        if fence is not None:  # inside a code block: as written, until its closing fence
            if mark and mark[1][0] == fence[0] and len(mark[1]) >= len(fence) and \
                    not line[mark.end():].strip():
                fence = None
            out.append(line)
        elif mark and not (mark[1][0] == "`" and "`" in line[mark.end():]):
            fence = mark[1]
            out.append(line)
        else:
            line = _HEADING.sub(r"\1\\\2", _no_html(line), count=1)
            if above.strip():
                line = _UNDERLINE.sub(r"\1\\\2", line, count=1)
            out.append(line)
        above = line if fence is None else ""
    if fence is not None:  # closed here, so that it cannot take in the next heading
        out.append(fence)
    return "\n".join(out)


def read(data: str | bytes) -> list[ExportedChat]:
    """An export's chats, back from its JSON; ExportError when it is not one."""
    try:
        top = json.loads(data)
    except ValueError as exc:
        raise ExportError(f"not JSON: {exc}") from None
    if not isinstance(top, dict) or top.get("format") != FORMAT:
        raise ExportError(f"not a chat export (its \"format\" is not {FORMAT!r})")
    if top.get("version") != VERSION:
        raise ExportError(f"export version {top.get('version')!r}: this app reads {VERSION}")
    try:
        return [ExportedChat(**{**c, "messages": [ExportedMessage(**m) for m in c["messages"]]})
                for c in top["chats"]]
    except (KeyError, TypeError) as exc:
        raise ExportError(f"a chat or message is missing a field or has one too many: "
                          f"{exc}") from None
