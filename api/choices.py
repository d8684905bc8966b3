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
        # Each choice's tokens so far (a piece without its ids counts as one), for the
        # usage in every chunk (stream_options.continuous_usage_stats).
        self.tokens = [0] * n
        self.ids: list[list[int]] = [[] for _ in range(n)]  # where the engine says them
        self.prompt_logprobs: list | None = None  # where asked (vLLM's prompt_logprobs)
        self.readers = [CallReader(tools) for _ in range(n)] \
            if tools is not None and tools.reads_calls else None

    def take(self, item: str | Piece) -> Piece:
        piece = item if isinstance(item, Piece) else Piece(0, item)
        self.texts[piece.index].append(piece.text)
        if piece.logprobs:
            self.logprobs[piece.index].extend(piece.logprobs)
        if piece.finish_reason:
            self.finish[piece.index] = piece.finish_reason
        if piece.prompt_logprobs:  # in order, in one piece or several
            self.prompt_logprobs = (self.prompt_logprobs or []) + piece.prompt_logprobs
        if piece.token_ids is not None:
            self.tokens[piece.index] += len(piece.token_ids)
            self.ids[piece.index].extend(piece.token_ids)
        elif piece.text:
            self.tokens[piece.index] += 1
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

    def messages(self, default_finish: str, logprobs: bool, token_ids: bool = False
                 ) -> list[dict]:
        """A chat completion's choices (`token_ids`: each with its reply's token ids, as
        vLLM's return_token_ids)."""
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
            if token_ids:
                out[-1]["token_ids"] = self.ids[i]
        return out

    # -- streamed ----------------------------------------------------------------------

    def deltas(self, piece: Piece, logprobs: bool) -> list[tuple[dict, str | None]]:
        """What a chat stream sends for `piece`: (choice without its index, finish reason)
        for each chunk: its text as content (less what may be a tool call), its log
        probabilities, and at the choice's end its calls and its finish, on the last
        chunk (as `vllm serve`: the last text and the finish reason come together)."""
        i = piece.index
        text = piece.text if self.readers is None else self.readers[i].feed(piece.text)
        out = []
        if text or (logprobs and piece.logprobs):
            out.append(({"delta": {"content": text},
                         "logprobs": chat_logprobs(piece.logprobs) if logprobs else None},
                        None))
        if piece.finish_reason:
            return self.ending(i, piece.finish_reason, out)
        return out

    def ending(self, index: int, default_finish: str, out: list | None = None
               ) -> list[tuple[dict, str | None]]:
        """A choice's last chunks (after `out`, its last piece's): the content held back
        and the calls read, the last of them with its finish reason (alone, in an empty
        delta, where there is none)."""
        out, calls = list(out or ()), []
        if self.readers is not None:
            rest, calls = self.readers[index].finish()
            if rest:
                out.append(({"delta": {"content": rest}}, None))
            if calls:
                out.append(({"delta": {"tool_calls": [
                    {"index": k, **call} for k, call in enumerate(calls)]}}, None))
        self.finish[index] = self.finish_reason(index, calls, default_finish)
        if out:
            out[-1] = (out[-1][0], self.finish[index])
        else:
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
