"""Every SQL statement the chat data layer runs (chat/data_layer.py), as fixed text.

No value ever becomes part of a statement's text: ids, names, search words and feedback are
bound parameters (`:name`), on SQLite and PostgreSQL alike. The column lists below are the
code's own constants (store/schema.py's tables), never keys taken from a request; a step or
element field without a column is refused by the layer before any SQL runs.
tests/test_store.py runs every method with hostile values and checks that each executed
statement is one of `ALL`.

Writes that could reach another account's rows are guarded in the statement itself:
- a step's upsert updates only a step of the same thread (a client picks its messages'
  ids, and may pick one of another chat's);
- a thread's upsert never changes its owner;
- feedback is written only for a step in a chat of the given owner, one per step, and
  deleted likewise.
"""

from __future__ import annotations

STEP_COLUMNS = (
    "id", "name", "type", "threadId", "parentId", "command", "modes", "streaming",
    "waitForAnswer", "isError", "metadata", "tags", "input", "output", "createdAt", "start",
    "end", "generation", "showInput", "defaultOpen", "autoCollapse", "language", "icon")
ELEMENT_COLUMNS = (
    "id", "threadId", "type", "url", "chainlitKey", "name", "display", "objectKey", "size",
    "page", "language", "forId", "mime", "props", "autoPlay", "playerConfig")
# Columns holding JSON (text on SQLite, JSONB on PostgreSQL) and tag lists (JSON text on
# SQLite, TEXT[] on PostgreSQL).
JSON_COLUMNS = frozenset({"modes", "metadata", "generation", "props", "playerConfig"})
TAG_COLUMNS = frozenset({"tags"})


def _upsert(table: str, columns: tuple[str, ...], where: str) -> str:
    """INSERT of every column; on an existing id, the given (non-NULL) values replace the
    stored ones, and only where `where` holds."""
    names = ", ".join(f'"{c}"' for c in columns)
    values = ", ".join(f":{c}" for c in columns)
    updates = ", ".join(f'"{c}" = COALESCE(excluded."{c}", {table}."{c}")'
                        for c in columns if c != "id")
    return (f"INSERT INTO {table} ({names}) VALUES ({values}) "
            f'ON CONFLICT ("id") DO UPDATE SET {updates} WHERE {where}')


# -- users ----------------------------------------------------------------------------
USER_BY_IDENTIFIER = 'SELECT "id", "identifier", "metadata", "createdAt" FROM users ' \
                     'WHERE "identifier" = :identifier'
# A login's user, made or its metadata changed in one statement: two first logins of one
# account at once, in two app processes, make one row.
USER_UPSERT = 'INSERT INTO users ("id", "identifier", "metadata", "createdAt") ' \
              'VALUES (:id, :identifier, :metadata, :createdAt) ON CONFLICT ("identifier") ' \
              'DO UPDATE SET "metadata" = excluded."metadata"'
USER_IDENTIFIER_BY_ID = 'SELECT "identifier" FROM users WHERE "id" = :id'

# -- threads --------------------------------------------------------------------------
THREAD_AUTHOR = 'SELECT "userIdentifier" FROM threads WHERE "id" = :id'
THREAD_METADATA = 'SELECT "metadata" FROM threads WHERE "id" = :id'
# The owner is set once: COALESCE keeps a stored owner whatever a later call passes.
THREAD_UPSERT = (
    'INSERT INTO threads ("id", "createdAt", "name", "userId", "userIdentifier", "tags", '
    '"metadata", "sessionId") VALUES (:id, :createdAt, :name, :userId, :userIdentifier, '
    ':tags, :metadata, :sessionId) '
    'ON CONFLICT ("id") DO UPDATE SET "name" = COALESCE(excluded."name", threads."name"), '
    '"sessionId" = COALESCE(excluded."sessionId", threads."sessionId"), '
    '"userId" = COALESCE(threads."userId", excluded."userId"), '
    '"userIdentifier" = COALESCE(threads."userIdentifier", excluded."userIdentifier"), '
    '"tags" = COALESCE(excluded."tags", threads."tags"), '
    '"metadata" = COALESCE(excluded."metadata", threads."metadata")')
# The chat a socket session last wrote to, if it is the user's (a page reconnecting to
# another replica: app.py's chat_start).
THREAD_OF_SESSION = ('SELECT "id" FROM threads WHERE "sessionId" = :session '
                     'AND "userIdentifier" = :identifier')
THREAD_TAKEN_OVER = 'UPDATE threads SET "sessionId" = :session WHERE "id" = :id'
STEP_ENDED = 'UPDATE steps SET "end" = :end WHERE "id" = :id AND "end" IS NULL'
THREAD_BY_ID = ('SELECT "id", "createdAt", "name", "userId", "userIdentifier", "tags", '
                '"metadata" FROM threads WHERE "id" = :id')
# A user's chats, newest activity first; optionally only those with a step containing
# :search (a LIKE pattern, escaped) or a feedback of value :feedback.
THREADS_OF_USER = (
    'SELECT t."id", t."createdAt", t."name", t."userId", t."userIdentifier", t."tags", '
    't."metadata", MAX(s."createdAt") AS "updatedAt" FROM threads t '
    'LEFT JOIN steps s ON s."threadId" = t."id" WHERE t."userId" = :user_id '
    'AND (CAST(:search AS TEXT) IS NULL OR EXISTS (SELECT 1 FROM steps w '
    "WHERE w.\"threadId\" = t.\"id\" AND LOWER(w.\"output\") LIKE CAST(:search AS TEXT) "
    "ESCAPE '\\')) "
    'AND (CAST(:feedback AS INTEGER) IS NULL OR EXISTS (SELECT 1 FROM feedbacks f '
    'WHERE f."threadId" = t."id" AND f."value" = CAST(:feedback AS INTEGER))) '
    'GROUP BY t."id", t."createdAt", t."name", t."userId", t."userIdentifier", t."tags", '
    't."metadata" ORDER BY "updatedAt" DESC NULLS LAST, t."id" LIMIT :limit')
THREAD_DELETE = ['DELETE FROM shares WHERE "threadId" = :id',
                 'DELETE FROM feedbacks WHERE "threadId" = :id',
                 'DELETE FROM documents WHERE "threadId" = :id',
                 'DELETE FROM elements WHERE "threadId" = :id',
                 'DELETE FROM steps WHERE "threadId" = :id',
                 'DELETE FROM threads WHERE "id" = :id']

# -- steps ----------------------------------------------------------------------------
STEP_UPSERT = _upsert("steps", STEP_COLUMNS, 'steps."threadId" = excluded."threadId"')
_STEP_FIELDS = ", ".join(f's."{c}"' for c in STEP_COLUMNS)
STEPS_OF_THREAD = (
    f'SELECT {_STEP_FIELDS}, f."id" AS "feedbackId", f."value" AS "feedbackValue", '
    'f."comment" AS "feedbackComment" FROM steps s LEFT JOIN feedbacks f ON f."forId" = s."id" '
    'WHERE s."threadId" = :thread_id ORDER BY s."createdAt", s."id"')
# A step goes only from the chat it is in (the session's own thread).
STEP_DELETE = ['DELETE FROM feedbacks WHERE "forId" = :id AND "threadId" = :thread_id',
               'DELETE FROM documents WHERE "messageId" = :id AND "threadId" = :thread_id',
               'DELETE FROM elements WHERE "forId" = :id AND "threadId" = :thread_id',
               'DELETE FROM steps WHERE "id" = :id AND "threadId" = :thread_id']
# (The layer keeps those whose metadata says favorite: JSON is read the same on both.)
STEPS_OF_USER = (
    f'SELECT {_STEP_FIELDS} FROM steps s JOIN threads t ON t."id" = s."threadId" '
    'WHERE t."userId" = :user_id ORDER BY s."createdAt" DESC')

# -- feedback -------------------------------------------------------------------------
# One feedback per step (feedbacks_one_per_step), written only for a step in a chat of
# :owner: the step's feedback is made, or changed in place, in one statement, which returns
# its id. :id is a new one, never the client's: a client's id names no row to overwrite.
FEEDBACK_UPSERT = (
    'INSERT INTO feedbacks ("id", "forId", "threadId", "value", "comment") '
    'SELECT CAST(:id AS TEXT), s."id", s."threadId", CAST(:value AS INTEGER), '
    'CAST(:comment AS TEXT) FROM steps s '
    'JOIN threads t ON t."id" = s."threadId" '
    'WHERE s."id" = :for_id AND t."userIdentifier" = :owner '
    'ON CONFLICT ("forId") DO UPDATE SET "value" = excluded."value", '
    '"comment" = excluded."comment" RETURNING "id"')
FEEDBACK_DELETE = (
    'DELETE FROM feedbacks WHERE "id" = :id AND "threadId" IN '
    '(SELECT "id" FROM threads WHERE "userIdentifier" = :owner)')

# -- elements -------------------------------------------------------------------------
_ELEMENT_FIELDS = ", ".join(f'"{c}"' for c in ELEMENT_COLUMNS)
ELEMENT_BY_ID = f'SELECT {_ELEMENT_FIELDS} FROM elements WHERE "threadId" = :thread_id ' \
                'AND "id" = :id'
ELEMENTS_OF_THREAD = f'SELECT {_ELEMENT_FIELDS} FROM elements WHERE "threadId" = :thread_id'
ELEMENT_DELETE = 'DELETE FROM elements WHERE "id" = :id AND "threadId" = :thread_id'
# A chat's attached files (store/documents.py), without their text, in their messages' order.
DOCUMENTS_OF_THREAD = ('SELECT "id", "messageId", "name", "kind", "size" FROM documents '
                       'WHERE "threadId" = :thread_id ORDER BY "messageId", "position"')

HEALTH = "SELECT 1"



def _statements() -> frozenset[str]:
    found = set()
    for value in list(globals().values()):
        for sql in value if isinstance(value, list) else [value]:
            if isinstance(sql, str) and sql.split(" ", 1)[0] in (
                    "SELECT", "INSERT", "UPDATE", "DELETE"):
                found.add(sql)
    return frozenset(found)


ALL = _statements()
