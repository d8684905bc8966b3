"""The choices of one completion as the engine's pieces arrive (api/openai.py): each one's
text, log probabilities and finish reason, and with tools its calls (api/tools.py), in
OpenAI's shapes: a whole chat message or legacy completion, or the deltas of a stream.

The engine yields plain text for a request without a `Decoding` (one choice, no log
probabilities) and `Piece`s with one (engine/decoding.py); both are taken here.
"""

from __future__ import annotations

from engine.decoding import Piece, TokenLogprob

from api.tools import CallReader, Tools


class Choices:
    def __init__(self, n: int, tools: Tools | None = None):
        self.tools = tools
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.readers = [CallReader(tools) for _ in range(n)] \
            if tools is not None and tools.reads_calls else None

    def take(self, item: str | Piece) -> Piece:
        piece = item if isinstance(item, Piece) else Piece(0, item)
        self.texts[piece.index].append(piece.text)
        if piece.logprobs:
            self.logprobs[piece.index].extend(piece.logprobs)
        if piece.finish_reason:
            self.finish[piece.index] = piece.finish_reason
        return piece

    def text(self, index: int) -> str:
        return "".join(self.texts[index])

    def finish_reason(self, index: int, calls: list, default: str) -> str:
        """The engine's reason (or `default`: the turn's), "tool_calls" where the model
        stopped after calling tools it chose to call (OpenAI's; "stop" for a named one)."""
        reason = self.finish[index] or default
        if calls and reason == "stop" and self.tools.choice != "named":
            return "tool_calls"
        return reason

    # -- whole -------------------------------------------------------------------------

    def messages(self, default_finish: str, logprobs: bool) -> list[dict]:
        """A chat completion's choices."""
        out = []
        for i in range(len(self.texts)):
            content, calls = self.text(i), []
            if self.readers is not None:
                sent = self.readers[i].feed(content)
                rest, calls = self.readers[i].finish()
                content = sent + rest
            message = {"role": "assistant", "content": (content or None) if calls else content}
            if calls:
                message["tool_calls"] = calls
            out.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(self.logprobs[i]) if logprobs else None,
                        "finish_reason": self.finish_reason(i, calls, default_finish)})
        return out

    def completions(self, default_finish: str, logprobs: bool) -> list[dict]:
        """A legacy completion's choices."""
        return [{"index": i, "text": self.text(i),
                 "logprobs": legacy_logprobs(self.logprobs[i]) if logprobs else None,
                 "finish_reason": self.finish[i] or default_finish}
                for i in range(len(self.texts))]

    # -- streamed ----------------------------------------------------------------------

    def deltas(self, piece: Piece, logprobs: bool) -> list[tuple[dict, str | None]]:
        """What a chat stream sends for `piece`: (choice without its index, finish reason)
        for each chunk: its text as content (less what may be a tool call), its log
        probabilities, and at the choice's end its calls and its finish."""
        i = piece.index
        text = piece.text if self.readers is None else self.readers[i].feed(piece.text)
        out = []
        if text or (logprobs and piece.logprobs):
            out.append(({"delta": {"content": text},
                         "logprobs": chat_logprobs(piece.logprobs) if logprobs else None},
                        None))
        if piece.finish_reason:
            out += self.ending(i, piece.finish_reason)
        return out

    def ending(self, index: int, default_finish: str) -> list[tuple[dict, str | None]]:
        """A choice's last chunks: the content held back and the calls read, then its
        finish reason."""
        out, calls = [], []
        if self.readers is not None:
            rest, calls = self.readers[index].finish()
            if rest:
                out.append(({"delta": {"content": rest}}, None))
            if calls:
                out.append(({"delta": {"tool_calls": [
                    {"index": k, **call} for k, call in enumerate(calls)]}}, None))
        self.finish[index] = self.finish_reason(index, calls, default_finish)
        out.append(({"delta": {}}, self.finish[index]))
        return out

    def open(self) -> list[int]:
        """The choices not yet ended (the plain path says its end in the turn's stats)."""
        return [i for i, reason in enumerate(self.finish) if reason is None]


def token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(tokens) -> dict:
    return {"content": [
        {"token": t.token, "logprob": t.logprob, "bytes": token_bytes(t.token),
         "top_logprobs": [{"token": token, "logprob": logprob, "bytes": token_bytes(token)}
                          for token, logprob in t.top]}
        for t in tokens or ()]}


def legacy_logprobs(tokens, offset: int = 0) -> dict:
    """/v1/completions' shape: parallel lists, the alternatives as {token: logprob}."""
    offsets, at = [], offset
    for t in tokens or ():
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in tokens or ()],
            "token_logprobs": [t.logprob for t in tokens or ()],
            "top_logprobs": [dict(t.top) for t in tokens or ()], "text_offset": offsets}
