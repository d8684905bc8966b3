"""Tools in the OpenAI API: a request's `tools` and `tool_choice` read and checked, what the
model is held to for each `tool_choice`, and each reply read back as tool calls.

- "auto" (the default with tools): the model's chat template describes the tools (for
  Qwen3: in the system turn), and a call the model writes in Qwen's form,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, is read back into
  `tool_calls` (finish_reason "tool_calls"); text before the first call is the content.
  Streamed, text is sent as it comes, except what could be the start of a call.
- "required": the reply is held (vLLM's structured outputs) to a JSON list of one or more
  calls, each naming a tool with arguments that follow its parameters' schema (their
  `$defs` moved to the root, where their references point, as vLLM's).
- {"type": "function", "function": {"name": ...}}: the reply is held to that function's
  parameters' schema and is the call's arguments (finish_reason "stop", as OpenAI's).
  For both, a reply cut short (max_tokens) is no call and no content, as vLLM answers.
- "none" (the default without tools): the tools are described, nothing is read back.

Role "tool" messages carry results back; an assistant message's `tool_calls` are given to
the template with their arguments as objects (api/requests.py reads both).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from api.errors import ApiError

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule for a function's name
OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tools:
    specs: tuple = field(hash=False)  # the request's tools, checked (for the template)
    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the function a named choice calls
    parallel: bool = True  # parallel_tool_calls: more than one call in a reply

    def schema(self) -> dict | None:
        """The JSON schema a reply is held to: a named function's parameters, or for
        "required" a list of calls; None where the model writes freely."""
        params = {s["function"]["name"]: s["function"].get("parameters") or {"type": "object"}
                  for s in self.specs}
        if self.choice == "named":
            return params[self.name]
        if self.choice != "required":
            return None
        defs, calls = {}, []
        for name, schema in params.items():
            schema = dict(schema)
            found = schema.pop("$defs", {})
            if not isinstance(found, dict):
                raise ApiError(400, f"The '$defs' of tool '{name}' must be an object.")
            for key, value in found.items():
                if defs.setdefault(key, value) != value:
                    raise ApiError(400, f"Tools define '$defs/{key}' differently; give "
                                   "each definition one schema.")
            calls.append({"type": "object", "properties": {
                "name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"]})
        # Each tool's "#/$defs/..." references point at the root of the schema the reply is
        # held to: its definitions go there (as vLLM's _get_json_schema_from_tools).
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": {"anyOf": calls}, **({"$defs": defs} if defs else {})}

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    @property
    def marks_calls(self) -> bool:
        """The model writes Qwen's call markers (special tokens in its vocabulary): the
        reply's text must keep them."""
        return self.choice == "auto"


def read_tools(body: dict, most: int) -> Tools | None:
    """The request's tools and tool_choice, or None without tools; at most `most` tools."""
    specs, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be true or false.")
    if specs is None:
        if choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' needs 'tools'.")
        return None
    if not isinstance(specs, list) or not specs:
        raise ApiError(400, "'tools' must be a non-empty list of functions.")
    if len(specs) > most:
        raise ApiError(400, f"A request may offer at most {most:,} tools; this one has "
                       f"{len(specs):,}.")
    names = [tool_name(spec, n) for n, spec in enumerate(specs)]
    if len(set(names)) != len(names):
        raise ApiError(400, "Each tool must have a name of its own.")
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        named = function.get("name") if isinstance(function, dict) else None
        if named not in names:
            raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                           '{"type": "function", "function": {"name": NAME}} naming one of '
                           "the tools.")
        choice = "named"
    elif choice not in CHOICES:
        raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or a "
                       "named function.")
    return Tools(tuple(specs), choice, named, parallel is not False)


def tool_name(spec, n: int) -> str:
    """A tool's function name, the tool checked: {"type": "function", "function": {"name",
    "description"?, "parameters"? (a JSON schema object), "strict"?}}."""
    where = f"tools[{n}]"
    function = spec.get("function") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or spec.get("type") != "function" or \
            not isinstance(function, dict):
        raise ApiError(400, f'{where} must be {{"type": "function", "function": {{...}}}}.')
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise ApiError(400, f"{where}.function.{sorted(unknown)[0]} is not supported by this "
                       "server; leave it out.", code="unsupported_parameter")
    if not isinstance(function.get("name"), str) or not NAME.fullmatch(function["name"]):
        raise ApiError(400, f"{where}.function.name must be 1 to 64 letters, digits, '_', "
                       "'.' or '-'.")
    if not isinstance(function.get("description", ""), str):
        raise ApiError(400, f"{where}.function.description must be text.")
    if not isinstance(function.get("parameters", {}), dict):
        raise ApiError(400, f"{where}.function.parameters must be a JSON schema object.")
    return function["name"]


def call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class CallReader:
    """One reply's text read as it streams: `feed` answers the content that may be sent
    now; `finish` the rest of it and the calls read from the reply."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.text = ""
        self.sent = 0  # of `text`, sent as content
        self.in_call = False  # a call's marker has been written

    def feed(self, text: str) -> str:
        self.text += text
        if self.tools.choice in ("named", "required") or self.in_call:
            return ""
        at = self.text.find(OPEN, self.sent)
        if at >= 0:
            self.in_call = True
            end = at
        else:  # hold back an end that may become the marker
            end = len(self.text) - held_back(self.text, OPEN)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content not yet sent, the calls read); a reply that does not read as calls is
        all content."""
        rest = self.text[self.sent:]
        try:
            if self.tools.choice == "named":
                json.loads(self.text)  # a reply cut short (max_tokens) is no call, as vLLM's
                return "", [call(self.tools.name, self.text)]
            if self.tools.choice == "required":
                calls = [call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                         for c in json.loads(self.text)]
            elif self.in_call:
                calls = [call(c["name"], json.dumps(c.get("arguments", {}),
                                                    ensure_ascii=False))
                         for c in marked_calls(rest)]
            else:
                return rest, []
        except (ValueError, TypeError, KeyError):
            # A held reply that does not read (cut short by max_tokens) gives neither calls
            # nor its broken JSON as content, as vLLM answers.
            return ("", []) if self.tools.choice in ("named", "required") else (rest, [])
        if not self.tools.parallel:
            calls = calls[:1]
        content = rest[:rest.find(OPEN)] if self.in_call else ""
        return content, calls


def marked_calls(text: str) -> list[dict]:
    """The calls in Qwen's markers, in order (a last one cut off by the end is read too)."""
    calls = []
    for part in text.split(OPEN)[1:]:
        found = json.loads(part.split(CLOSE, 1)[0])
        if not isinstance(found, dict) or not isinstance(found.get("name"), str):
            raise ValueError("not a call")
        calls.append(found)
    return calls


def held_back(text: str, marker: str) -> int:
    """The length of `text`'s longest end that begins `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
