"""Files in a chat request, as OpenAI's format sends them: a message's content part
`{"type": "file", "file": {"filename": "spec.pdf", "file_data": "data:...;base64,..."}}`.
Each is read to its text by the chat's reader (service/documents.py, the same kinds, limits
and refusals as an attached file) and given to the model as the chat gives it: the file's
text with its name, before what follows it in the message. A file sent by id
(`file_id`: OpenAI's Files API, which this server has not) is refused, as is a file where
attaching is off. Nothing of a file is stored (the API keeps no chats).
"""

from __future__ import annotations

import base64
import binascii

from api.errors import ApiError
from service.documents import Reader, Unreadable, megabytes, with_documents


def has_files(body) -> bool:
    messages = body.get("messages") if isinstance(body, dict) else None
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) and any(
            isinstance(p, dict) and p.get("type") == "file" for p in m["content"])
        for m in messages)


async def read_files(body: dict, reader: Reader | None) -> dict:
    """The body with each file part replaced by a text part holding the file's text (the
    body's other parts as they were); ApiError 400 for a file that cannot be read."""
    if not has_files(body):
        return body
    if reader is None:
        raise ApiError(400, "Files in messages are turned off on this server.")
    messages = []
    for n, message in enumerate(body["messages"]):
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            parts = [await _part(p, reader, f"messages[{n}].content[{i}]")
                     for i, p in enumerate(message["content"])]
            message = {**message, "content": parts}
        messages.append(message)
    return {**body, "messages": messages}


async def _part(part, reader: Reader, where: str):
    if not isinstance(part, dict) or part.get("type") != "file":
        return part
    given = part.get("file")
    if not isinstance(given, dict) or not isinstance(given.get("file_data"), str):
        if isinstance(given, dict) and given.get("file_id"):
            raise ApiError(400, f"{where}: files by id (OpenAI's Files API) are not kept "
                                "here; send the file's content as file_data.")
        raise ApiError(400, f"{where} must be {{\"type\": \"file\", \"file\": {{\"filename\""
                            ": ..., \"file_data\": \"data:<type>;base64,...\"}}}}.")
    data = given["file_data"]
    encoded = data.split(",", 1)[1] if data.startswith("data:") and "," in data else data
    if len(encoded) * 3 // 4 > reader.limits.max_bytes:
        raise ApiError(400, f"{where}: the file is over this server's limit of "
                            f"{megabytes(reader.limits.max_bytes)}.")
    try:
        content = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: file_data is not base64.") from None
    try:
        document = await reader.read(given.get("filename"), content)
    except Unreadable as exc:
        raise ApiError(400, f"{where}: {exc}") from None
    return {"type": "text", "text": with_documents("", [document]) + "\n\n"}
