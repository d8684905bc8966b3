"""Files a user attaches to a message, as the model reads them: each file's name checked,
its kind told by its name, its text read in a child process with time and memory limits
(service/extract.py), and the text given to the model with its name, in the prompt of its
turn and in the history after it (`with_documents`, the same text every turn, so the
engine's prefix cache keeps serving it). No UI calls here: the chat (chat/attachments.py)
and the store (store/documents.py) use it.

A file that cannot be read is refused with the reason (`Unreadable`), never read in part.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import unicodedata
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from engine import ChatError
from engine.settings import setting
from store.documents import Document, megabytes

__all__ = ["Document", "Limits", "Reader", "Unreadable", "megabytes", "with_documents"]

log = logging.getLogger(__name__)

EXTRACT = Path(__file__).with_name("extract.py")
NAME_CHARS = 200
# A file's kind by its extension: what service/extract.py reads it as.
TEXT_EXTENSIONS = (
    "txt text md markdown rst adoc org log csv tsv json jsonl ndjson yaml yml toml ini cfg "
    "conf env xml svg tex bib srt vtt diff patch sql py pyi ipynb js mjs cjs ts tsx jsx java "
    "kt kts scala groovy c h cc cpp cxx hpp hh cs go rs rb php pl pm lua r jl swift m mm "
    "dart ex exs erl hs ml fs clj sh bash zsh fish ps1 bat cmd vue svelte css scss sass "
    "less proto graphql gql tf hcl dockerfile makefile cmake gradle properties").split()
KINDS = {**{ext: "text" for ext in TEXT_EXTENSIONS}, "html": "html", "htm": "html",
         "xhtml": "html", "pdf": "pdf", "docx": "docx"}
NAMED_FILES = {"makefile", "dockerfile", "readme", "license", "changelog", "gemfile",
               "procfile", "jenkinsfile", "vagrantfile"}
READABLE = "text, Markdown, code, CSV/TSV, JSON, HTML, PDF or Word (.docx)"


class Unreadable(ChatError):
    """A file refused, with the reason in words for its owner; nothing of it is kept."""


@dataclass(frozen=True)
class Limits:
    max_bytes: int
    guest_max_bytes: int  # 0: guests attach nothing
    files: int  # per message
    chars: int  # text per file
    pages: int
    storage_bytes: int  # an account's stored text; 0: no limit
    read_s: int
    read_mb: int

    @classmethod
    def from_settings(cls) -> "Limits":
        mb = 1 << 20
        return cls(int(setting("VCHAT_DOCUMENT_MAX_MB") * mb),
                   int(setting("VCHAT_GUEST_DOCUMENT_MAX_MB") * mb),
                   setting("VCHAT_DOCUMENT_FILES"), setting("VCHAT_DOCUMENT_CHARS"),
                   setting("VCHAT_DOCUMENT_PAGES"),
                   int(setting("VCHAT_DOCUMENT_STORAGE_MB") * mb),
                   setting("VCHAT_DOCUMENT_READ_S"), setting("VCHAT_DOCUMENT_READ_MB"))


def checked_name(name: object) -> str:
    """The file's name as given, or Unreadable: a name with folders in it, control or
    invisible characters, or none at all, is refused rather than changed."""
    if not isinstance(name, str) or not name.strip():
        raise Unreadable("The file has no name; give it one and attach it again.")
    shown = name[:60] + ("…" if len(name) > 60 else "")
    if len(name) > NAME_CHARS:
        raise Unreadable(f"The file name {shown!r} is over {NAME_CHARS} characters; "
                         "rename it and attach it again.")
    if any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in name):
        raise Unreadable(f"The file name {shown!r} has control or invisible characters; "
                         "rename it and attach it again.")
    if "/" in name or "\\" in name or name.strip() in (".", "..") or \
            PurePosixPath(name).name != name:
        raise Unreadable(f"The file name {shown!r} names folders; attach the file by its "
                         "own name.")
    return name


def kind_of(name: str) -> str:
    """What the file is read as, by its name; Unreadable for a kind this chat cannot read."""
    suffix = PurePosixPath(name.lower()).suffix.lstrip(".")
    kind = KINDS.get(suffix) or ("text" if name.lower() in NAMED_FILES else None)
    if kind is None:
        what = f".{suffix} files" if suffix else "files without an extension"
        raise Unreadable(f"{name}: {what} are not read here. This chat reads {READABLE}.")
    return kind


def with_documents(text: str, documents: list[Document] | tuple[Document, ...]) -> str:
    """The user's message as the model gets it: each document's text with its name, then
    what the user wrote. The same documents give the same text, turn after turn."""
    blocks = [f'<document name="{d.name}">\n{d.text}\n</document>' for d in documents]
    return "\n\n".join(blocks + ([text] if text else []))


class Reader:
    """Reads attached files' text in child processes, `at_once` at a time (the rest wait
    their turn, up to `waiting`; beyond that, "busy"), each with the limits' CPU time and
    memory and a wall-clock deadline, at a lower CPU priority than the app."""

    def __init__(self, limits: Limits, at_once: int = 2, waiting: int = 32):
        self.limits = limits
        self._slots = asyncio.Semaphore(at_once)
        self._waiting, self._max_waiting = 0, waiting

    async def read(self, name: object, data: bytes) -> Document:
        name = checked_name(name)
        kind = kind_of(name)
        if not data:
            raise Unreadable(f"{name}: the file is empty.")
        if self._waiting >= self._max_waiting:
            raise Unreadable(f"{name}: the server is reading many files just now; attach "
                             "it again in a minute.")
        self._waiting += 1
        try:
            async with self._slots:
                result = await self._extract(kind, data)
        finally:
            self._waiting -= 1
        if "refused" in result:
            raise Unreadable(f"{name} was not attached: {result['refused']}.")
        return Document(str(uuid.uuid4()), name, kind, len(data), result["text"])

    async def _extract(self, kind: str, data: bytes) -> dict:
        lim = self.limits
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-P", str(EXTRACT), kind, str(lim.chars), str(lim.pages),
            str(lim.read_mb), str(lim.read_s), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(process.communicate(data),
                                              timeout=lim.read_s * 2 + 10)
        except asyncio.TimeoutError:
            out, err = b"", b"wall-clock deadline"
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        try:
            result = json.loads(out)
        except ValueError:
            log.warning("reading a %s file ended with status %s: %s", kind, process.returncode,
                        err.decode(errors="replace").strip().splitlines()[-1:])
            return {"refused": "it took more time or memory to read than this chat allows"}
        if not isinstance(result, dict) or not isinstance(
                result.get("text", result.get("refused")), str):
            return {"refused": "it could not be read"}
        return result
