"""Chat messages -> prompt token ids, with the model's own chat template.

The template is rendered with a placeholder in place of each message's text; the rendered
string is then encoded piece by piece: the template's own pieces with special tokens
recognised, the users' and assistant's text with special tokens split into plain text.
So a user who types `<|im_end|>` gets the characters, never the control token, and cannot
end their own turn or open a system turn (rendering the whole string and encoding it would
let them).

Cheap per turn: a message's text is encoded once (its ids stay with the `Message`), and
the template's pieces between messages are learnt once per tokenizer from two probe
conversations, so a long conversation's prompt is put together from lists of ids, without
rendering or re-encoding it (BENCHMARKS.md, "History fitting"). A template whose pieces
depend on more than the neighbouring roles (the probes show it) is rendered every time.
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import ChatError

ROLES = ("system", "user", "assistant")
API_ROLES = ROLES + ("tool",)  # a tool's result, given back by an API client
START, END = "(start)", "(end)"  # the neighbours of the first and after the last message
_FORMATTERS = itertools.count()
MAX_SYSTEM_PROMPTS = 256  # system prompts kept encoded (users can write their own)


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    # [formatter number, token ids of `content`]: encoded once per formatter, then reused.
    _ids: list = field(default_factory=list, compare=False, repr=False)
    # An assistant's calls of tools, as the chat template takes them:
    # {"id", "type": "function", "function": {"name", "arguments": {...}}} (API only).
    tool_calls: tuple = ()
    tool_call_id: str = ""  # a tool message's answer to this call (API only)

    def __post_init__(self):
        if self.role not in API_ROLES:
            raise ChatError(f"Unknown message role {self.role!r}; allowed: "
                            f"{', '.join(API_ROLES)}.")
        if not isinstance(self.content, str):
            raise ChatError("Message content must be text.")


def as_messages(items: Sequence[Message | dict]) -> list[Message]:
    """Accept `Message`s or `{role, content}` dicts (checked as they become Messages)."""
    return [m if isinstance(m, Message) else Message(m["role"], m["content"]) for m in items]


class ChatFormatter:
    """Builds prompt token ids for one tokenizer (one per engine)."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatError("The model's tokenizer has no chat template; pick an instruct model.")
        self.tokenizer = tokenizer
        self._number = next(_FORMATTERS)
        self._tag = secrets.token_hex(8)
        self._mark = re.compile(f"VCHATMSG{self._tag}N(\\d+)E")
        self._piece_ids: dict[str, list[int]] = {}  # template pieces -> ids (a handful)
        self._systems: dict[str, Message] = {}
        self._controls: list[str] | None = None  # the tokenizer's added tokens, once asked
        self.glue = self._learn_glue()  # (role before, role) -> template piece, or None
        self._glue_ids = {pair: self._template_ids(piece)
                          for pair, piece in (self.glue or {}).items()}

    def with_system(self, messages: Sequence[Message | dict], system_prompt: str
                    ) -> list[Message]:
        """`messages` with the system prompt first, unless they start with one."""
        msgs = as_messages(messages)
        if system_prompt and not (msgs and msgs[0].role == "system"):
            system = self._systems.get(system_prompt)
            if system is None:  # one Message per system prompt, so it is encoded once
                if len(self._systems) >= MAX_SYSTEM_PROMPTS:
                    self._systems.clear()
                system = self._systems[system_prompt] = Message("system", system_prompt)
            msgs.insert(0, system)
        return msgs

    def assemble(self, msgs: Sequence[Message], tools: Sequence[dict] | None = None,
                 template: dict | None = None) -> tuple[list[int], list[int]]:
        """The prompt's token ids (the template's piece before each message, the message;
        last the generation prompt), and where each message's part ends in them. `tools`:
        functions the model may call, in OpenAI's shape, for the template to describe;
        `template`: what else the template is rendered with (an API request's
        add_generation_prompt, continue_final_message, chat_template_kwargs)."""
        ids, ends = [], []
        pieces = self._pieces(msgs, tools, template)
        for piece, msg in zip(pieces, msgs):
            ids += piece
            ids += self.content_ids(msg)
            ends.append(len(ids))
        ids += pieces[-1]
        return ids, ends

    def prompt_ids(self, messages: Sequence[Message | dict], system_prompt: str = "") -> list[int]:
        """Token ids for `messages` (system prompt first when given), ready for generation."""
        return self.assemble(self.with_system(messages, system_prompt))[0]

    def count(self, messages: Sequence[Message | dict], system_prompt: str = "") -> int:
        """Prompt length in tokens, as the engine will see it."""
        return len(self.assemble(self.with_system(messages, system_prompt))[0])

    def content_ids(self, msg: Message) -> list[int]:
        """`msg.content` as token ids, special tokens as plain text; encoded once."""
        if not msg._ids or msg._ids[0] != self._number:
            msg._ids[:] = [self._number, self._encode(msg.content, special=False)]
        return msg._ids[1]

    # -- the template's own pieces -----------------------------------------------------

    def _pieces(self, msgs: Sequence[Message], tools: Sequence[dict] | None = None,
                template: dict | None = None) -> list[list[int]]:
        """The template's pieces, as ids, before each message and after the last."""
        if tools is None and not template and not any(m.tool_calls for m in msgs):
            roles = [START] + [m.role for m in msgs] + [END]
            pairs = list(zip(roles, roles[1:]))
            if self.glue is not None and all(pair in self.glue for pair in pairs):
                return [self._glue_ids[pair] for pair in pairs]
        return [self._template_ids(piece) for piece in self._render(msgs, tools, template)]

    def _render(self, msgs: Sequence[Message], tools: Sequence[dict] | None = None,
                template: dict | None = None) -> list[str]:
        """Render the template with a placeholder for each message's text (an empty text
        stays empty: templates test for it) and split it at them: the pieces before each
        message and after the last (a piece before an empty message is "", its part of
        the template goes with the next). What the template writes out itself (tools,
        tool calls) is encoded with control tokens recognised, so it may not hold any."""
        marked = [i for i, m in enumerate(msgs) if m.content]
        conversation = []
        for i, m in enumerate(msgs):
            item = {"role": m.role, "content": f"VCHATMSG{self._tag}N{i}E" if m.content else ""}
            if m.tool_calls:
                item["tool_calls"] = list(self._plain(m.tool_calls, "a tool call"))
            if m.tool_call_id:
                item["tool_call_id"] = self._plain(m.tool_call_id, "a tool_call_id")
            conversation.append(item)
        options = {"add_generation_prompt": True,
                   **(self._plain(template, "chat_template_kwargs") if template else {})}
        try:
            rendered = self.tokenizer.apply_chat_template(
                conversation, tools=None if tools is None else self._plain(tools, "the tools"),
                tokenize=False, **options)
        except Exception as exc:
            if not template:
                raise
            # An API request's options the template cannot take (vLLM's 400 too)
            text = str(exc).strip().splitlines()
            raise ChatError("The model's chat template cannot be rendered as asked: "
                            f"{text[0][:300] if text else type(exc).__name__}") from None
        parts = self._mark.split(rendered)  # text, number, text, number, ..., text
        if [int(n) for n in parts[1::2]] != marked:
            raise ChatError("The model's chat template reorders or drops messages; this "
                            "chat cannot use it.")
        texts = iter(parts[0::2])
        return [next(texts) if m.content else "" for m in msgs] + [next(texts)]

    def _plain(self, value, what: str):
        """`value` (text or JSON-like data the template writes out), refused when it holds
        the model's control text: a tool named "<|im_end|>" would end the turn."""
        if self._controls is None:
            self._controls = [t for t in self.tokenizer.get_added_vocab() if t.strip()]
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        for token in self._controls:
            if token in text:
                raise ChatError(f"{what[0].upper()}{what[1:]} may not hold the model's "
                                f"control text {token!r}.")
        return value

    def _learn_glue(self) -> dict[tuple[str, str], str] | None:
        """The piece between each pair of neighbouring roles, from two probe conversations;
        None when the same pair gets different pieces (the template looks further)."""
        glue: dict[tuple[str, str], str] = {}
        for roles in (["system", "user", "assistant", "user", "assistant", "user"],
                      ["user", "assistant", "user", "assistant", "user", "assistant"]):
            try:
                pieces = self._render([Message(role, "x") for role in roles])
            except Exception:  # a template with rules of its own: render every prompt
                return None
            around = [START] + roles + [END]
            for pair, piece in zip(zip(around, around[1:]), pieces):
                if glue.setdefault(pair, piece) != piece:
                    return None
        return glue

    def _template_ids(self, piece: str) -> list[int]:
        ids = self._piece_ids.get(piece)
        if ids is None:
            ids = self._piece_ids[piece] = self._encode(piece, special=True)
        return ids

    def _encode(self, text: str, special: bool) -> list[int]:
        if not text:
            return []
        return self.tokenizer(
            text, add_special_tokens=False, split_special_tokens=not special
        )["input_ids"]
