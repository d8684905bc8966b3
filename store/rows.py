"""Rows of store/queries.py's statements to and from the dicts Chainlit reads and writes
(its ThreadDict, StepDict), for chat/data_layer.py: no SQL here, and no database calls."""

from __future__ import annotations

import contextlib
import json
import uuid

from store import queries as q


def is_uuid(value) -> bool:
    """A canonical UUID string, as Chainlit's client makes for chats and messages."""
    if not isinstance(value, str) or len(value) != 36:
        return False
    try:
        return str(uuid.UUID(value)) == value.lower()
    except ValueError:
        return False


def like(words: str) -> str:
    """A LIKE pattern (ESCAPE '\\') that finds `words` as they are, in any case."""
    escaped = words.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def bound(sqlite: bool, row: dict) -> dict:
    """A row's values as the database takes them: JSON as text, tag lists as JSON text on
    SQLite (which binds no lists) and as arrays on PostgreSQL."""
    out = {}
    for key, value in row.items():
        if key in q.JSON_COLUMNS and value is not None and not isinstance(value, str):
            value = json.dumps(value)
        elif key in q.TAG_COLUMNS and value is not None and sqlite:
            value = json.dumps(value)
        out[key] = value
    return out


def decoded(row: dict) -> dict:
    """JSON and tag columns as lists and dicts, whichever database handed them back."""
    for key in q.JSON_COLUMNS | q.TAG_COLUMNS:
        if isinstance(row.get(key), str):
            with contextlib.suppress(ValueError):  # not JSON: as it was
                row[key] = json.loads(row[key])
    return row


def thread(row: dict) -> dict:
    return {"id": row["id"], "createdAt": row["createdAt"], "name": row["name"],
            "userId": row["userId"], "userIdentifier": row["userIdentifier"],
            "tags": row["tags"], "metadata": row["metadata"] or {}, "steps": [],
            "elements": []}


def step(row: dict) -> dict:
    """A step as Chainlit's layer returned it: its input only when shown, its feedback."""
    out = {c: row.get(c) for c in q.STEP_COLUMNS}
    out["metadata"] = out["metadata"] or {}
    out["output"] = out["output"] or ""
    if out["showInput"] in (None, "false"):
        out["input"] = ""
    out["feedback"] = None if row.get("feedbackValue") is None else {
        "id": row["feedbackId"], "forId": row["id"], "value": row["feedbackValue"],
        "comment": row.get("feedbackComment")}
    return out


def step_row(step_dict: dict, sqlite: bool) -> dict:
    """A step's values for STEP_UPSERT, as Chainlit's layer wrote them (empty values are
    not written: a later write keeps what is stored). A field without a column is a
    ValueError, so that nothing is lost without a word."""
    unknown = set(step_dict) - set(q.STEP_COLUMNS) - {"feedback"}
    if unknown:
        raise ValueError(f"step field(s) {', '.join(sorted(unknown))} have no column in the "
                         "steps table")
    row = {c: None for c in q.STEP_COLUMNS}
    for key in q.STEP_COLUMNS:
        value = step_dict.get(key)
        if value is not None and not (isinstance(value, dict) and not value):
            row[key] = value
    if "showInput" in step_dict:
        row["showInput"] = str(step_dict["showInput"]).lower()
    row["metadata"] = step_dict.get("metadata") or {}
    row["generation"] = step_dict.get("generation") or {}
    return bound(sqlite, row)
