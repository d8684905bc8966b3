"""OpenAI's Responses API (`POST /v1/responses`, as `vllm serve` answers it for a text model):
a request is read into the chat completion it amounts to and answered by the same turn path
(api/openai.py: limits, line, quota, usage), its reply given back as Responses' output
items (a message, function calls) whole or as Responses' stream events.

    input              a string, or items: messages (roles user, system, developer,
                       assistant; text or input_text/output_text parts, input_file parts),
                       function_call and function_call_output (a tool round), reasoning
                       (skipped: this model does not reason aloud)
    instructions       the system prompt (not carried on by previous_response_id)
    tools, tool_choice function tools only, as the chat completion's
    text.format        text, json_object, json_schema
    include            message.output_text.logprobs, with top_logprobs
    store              kept in the database for GET /v1/responses/{id} and for a follow-up's
                       previous_response_id (store/responses.py); an owner's own only
    background         answered at once as "queued", run on; GET polls it, cancel stops it

The other fields vLLM takes on this route are passed as the chat completion takes them
(sampling, stop, logit_bias, seed, structured_outputs, chat_template_kwargs...).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

from starlette.responses import JSONResponse, Response

from api.call import Call, first_of, sse
from api.errors import ApiError
from api.requests import MAX_MESSAGES, given, read
from engine import ChatError
from engine.decoding import Piece

KEY = "\x00responses"  # the Responses fields riding in the chat body to read_responses

# The fields of a Responses request this server honours; the rest are refused by name.
TRANSLATED = frozenset((
    "model", "input", "instructions", "max_output_tokens", "tools", "tool_choice",
    "parallel_tool_calls", "text", "include", "top_logprobs", "stream", "store", "background",
    "previous_response_id", "metadata", "user", "truncation", "reasoning", "service_tier",
    "prompt_cache_key", "max_tool_calls", "enable_response_messages", "include_reasoning",
    "request_id"))
# Passed to the chat completion as they are (its reader checks them).
PASSED = frozenset((
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "stop", "ignore_eos", "logit_bias", "structured_outputs",
    "chat_template_kwargs", "min_tokens"))
# What `include` may name (OpenAI's list, as vLLM's); only the logprobs change the answer
# here: the others name what a text model without tool servers never makes.
INCLUDES = frozenset((
    "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "file_search_call.results", "message.input_image.image_url",
    "message.output_text.logprobs", "reasoning.encrypted_content"))
LOGPROBS = "message.output_text.logprobs"
SEPARATOR = "__"  # a namespace's function as the model sees it: NAMESPACE__NAME (vLLM's)
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
METADATA_KEYS, METADATA_CHARS = 16, 512  # OpenAI's bounds on metadata


def to_chat(body: dict, previous: list[dict] | None, default_model: str) -> dict:
    """The chat completion body a Responses request amounts to, with the Responses fields
    the answer needs under KEY (read_responses takes them out); ApiError for bad input."""
    unknown = sorted(str(k) for k, v in body.items()
                     if k not in TRANSLATED | PASSED and v is not None)
    if unknown:
        raise ApiError(400, f"'{unknown[0][:100]}' is not supported by this server; leave it "
                       "out.", code="unsupported_parameter")
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat["model"] = given(body, "model", default_model)
    instructions = given(body, "instructions", None)
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be text.")
    conversation = list(previous or []) + input_messages(body.get("input"))
    if len(conversation) > MAX_MESSAGES:
        raise ApiError(400, f"A request may hold at most {MAX_MESSAGES:,} messages; this one "
                       f"has {len(conversation):,} with its previous responses.")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions
                        else []) + conversation
    if conversation and conversation[-1]["role"] == "assistant" \
            and not conversation[-1].get("tool_calls"):
        # An assistant's message last: the reply continues it (as vLLM's).
        chat["add_generation_prompt"], chat["continue_final_message"] = False, True
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    namespaces: dict[str, list[str]] = {}  # a flat name: [its namespace, its own name]
    if body.get("tools"):
        chat["tools"] = function_tools(body["tools"], namespaces) \
            if isinstance(body["tools"], list) else body["tools"]
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = tool_choice(body["tool_choice"])
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    elif body.get("tools") is not None and not isinstance(body["tools"], list):
        raise ApiError(400, "'tools' must be a list of function tools.")
    if (form := text_format(body.get("text"))) is not None:
        chat["response_format"] = form
    include = given(body, "include", [])
    if not isinstance(include, list) or not set(include) <= INCLUDES:
        raise ApiError(400, f"'include' must be a list of: {', '.join(sorted(INCLUDES))}.")
    top = given(body, "top_logprobs", 0)
    if not isinstance(top, int) or isinstance(top, bool) or top < 0:
        raise ApiError(400, "'top_logprobs' must be a whole number, 0 or more.")
    if LOGPROBS in include:
        chat["logprobs"], chat["top_logprobs"] = True, top
    stream = given(body, "stream", False)
    chat["stream"] = stream
    if body.get("user") is not None:
        chat["user"] = body["user"]
    flags = {k: given(body, k, d) for k, d in (
        ("store", True), ("background", False), ("enable_response_messages", False),
        ("parallel_tool_calls", True))}
    if not all(isinstance(v, bool) for v in flags.values()) or not isinstance(stream, bool):
        raise ApiError(400, "'stream', 'store', 'background', 'parallel_tool_calls' and "
                       "'enable_response_messages' must be true or false.")
    if flags["background"] and not flags["store"]:
        raise ApiError(400, "background can only be used when `store` is true")
    if flags["background"] and stream:
        raise ApiError(400, "A background response is not streamed here: send it without "
                       "'stream' and poll GET /v1/responses/{id}.")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise ApiError(400, "'truncation' must be \"auto\" or \"disabled\".")
    metadata = given(body, "metadata", None)
    if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= METADATA_KEYS and all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str)
                and len(v) <= METADATA_CHARS for k, v in metadata.items())):
        raise ApiError(400, f"'metadata' must be an object of at most {METADATA_KEYS} "
                       f"text values (keys up to 64 characters, values up to "
                       f"{METADATA_CHARS}).")
    for name in ("reasoning", "text"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise ApiError(400, f"'{name}' must be an object.")
    chat[KEY] = {
        **flags, "instructions": instructions, "metadata": metadata,
        "tools": given(body, "tools", []), "tool_choice": given(body, "tool_choice", "auto"),
        "text": given(body, "text", {"format": {"type": "text"}}),
        "reasoning": body.get("reasoning"), "logprobs": LOGPROBS in include,
        "top_logprobs": top, "truncation": given(body, "truncation", "disabled"),
        "service_tier": given(body, "service_tier", "auto"), "user": body.get("user"),
        "max_tool_calls": body.get("max_tool_calls"), "conversation": conversation,
        "namespaces": namespaces,
        "previous_response_id": body.get("previous_response_id")}
    return chat


def read_responses(body: dict, config) -> tuple:
    """api/requests.py's read of the chat body `to_chat` made, the Responses fields kept in
    the turn's parts (`asked["responses"]`)."""
    body = dict(body)
    extras = body.pop(KEY)
    profile, asked = read(body, config)
    if extras["enable_response_messages"]:  # the output's token ids, for output_messages
        asked["decoding"] = replace(asked["decoding"], token_ids=True)
    asked["responses"] = extras
    return profile, asked


def input_messages(given_input) -> list[dict]:
    """A Responses `input` as chat completion messages."""
    if isinstance(given_input, str):
        return [{"role": "user", "content": given_input}]
    if not isinstance(given_input, list) or not given_input:
        raise ApiError(400, "'input' must be text or a non-empty list of items.")
    out: list[dict] = []
    for n, item in enumerate(given_input):
        where = f"input[{n}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object.")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}.")
            out.append({"role": role, "content": content_of(item.get("content"), where)})
        elif kind == "function_call":
            name = text_field(item, "name", where)
            if item.get("namespace") is not None:
                name = f"{text_field(item, 'namespace', where)}{SEPARATOR}{name}"
            call = {"id": text_field(item, "call_id", where), "type": "function",
                    "function": {"name": name,
                                 "arguments": text_field(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":  # the same reply's calls, together
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": text_field(item, "call_id", where),
                        "content": output if isinstance(output, str)
                        else content_of(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # this model's replies hold no reasoning to give back
        else:
            raise ApiError(400, f"{where}.type {str(kind)[:50]!r} is not taken here: items "
                           "are messages, function_call, function_call_output or reasoning.")
    if not out:
        raise ApiError(400, "'input' holds no message.")
    return out


def text_field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{name} must be text.")
    return value


def content_of(content, where: str):
    """A message's content as the chat completion takes it: text, or text and file parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be text or a list of parts.")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text", part.get("refusal")), str):
            parts.append({"type": "text", "text": part.get("text", part.get("refusal"))})
        elif kind == "input_file":
            parts.append({"type": "file", "file": {
                k: part[k] for k in ("filename", "file_data", "file_id") if k in part}})
        elif kind in ("input_image", "input_audio"):
            raise ApiError(400, f"{where}.content[{i}]: this model reads text; an "
                           f"{kind} cannot be given to it.")
        else:
            raise ApiError(400, f"{where}.content[{i}] must be an input_text, output_text "
                           "or input_file part.")
    return parts


def function_tools(tools: list, namespaces: dict[str, list[str]]) -> list[dict]:
    """Responses' function tools as the chat completion's (api/tools.py checks the rest); a
    namespace's functions named "NAMESPACE__NAME" for the model, as vLLM's (`namespaces`
    gets each such name's two parts, for the calls' items)."""
    out = []
    for n, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace" and isinstance(tool.get("name"), str) and \
                isinstance(tool.get("tools"), list):
            for inner in tool["tools"]:
                made = function_tool(inner, n)
                own = made["function"].get("name")
                made["function"]["name"] = flat = f"{tool['name']}{SEPARATOR}{own}"
                namespaces[flat] = [tool["name"], own]
                out.append(made)
        else:
            out.append(function_tool(tool, n))
    return out


def function_tool(tool, n: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise ApiError(400, f"tools[{n}]: only function tools (and namespaces of them) are "
                       f"offered here; {str(kind)[:50]!r} tools need a tool server this app "
                       "does not run.")
    return {"type": "function", "function": {
        k: tool[k] for k in ("name", "description", "parameters", "strict")
        if tool.get(k) is not None}}


def tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                   '{"type": "function", "name": NAME}.')


def text_format(text) -> dict | None:
    """`text.format` as the chat completion's response_format (None: plain text)."""
    form = text.get("format") if isinstance(text, dict) else None
    if form is None or form.get("type") == "text":
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema" and isinstance(form.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {
            k: form[k] for k in ("name", "schema", "strict", "description") if k in form}}
    raise ApiError(400, "'text.format' must be {\"type\": \"text\"}, {\"type\": "
                   "\"json_object\"} or {\"type\": \"json_schema\", \"name\": ..., "
                   "\"schema\": {...}}.")


def status_of(finish_reason: str | None) -> str:
    """A response's status from its reply's finish: cut by max_output_tokens, or not."""
    return "incomplete" if finish_reason == "length" else "completed"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseCall(Call):
    """One Responses request on a chat completion's turn: its output as message and
    function_call items, whole, stored, streamed as Responses' events or run in the
    background (`stored`: store/responses.py, set by the route; `owner`: whose rows)."""

    stored = None
    owner = ""

    def __init__(self, request, profile, asked, turn):
        super().__init__(request, profile, asked, turn)
        self.r = asked["responses"]
        self.id, self.created = new_id("resp"), int(time.time())
        self.message_id = new_id("msg")
        self.seq = 0

    # -- the response object -------------------------------------------------------

    def response(self, status: str, output: list, usage: dict | None) -> dict:
        r, sampling = self.r, self.asked["sampling"]
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        body = {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "background": r["background"], "error": None,
            "incomplete_details": incomplete, "instructions": r["instructions"],
            "max_output_tokens": self.prompt.max_tokens if self.prompt else None,
            "max_tool_calls": r["max_tool_calls"], "metadata": r["metadata"],
            "model": self.profile.name, "output": output,
            "parallel_tool_calls": r["parallel_tool_calls"],
            "previous_response_id": r["previous_response_id"], "reasoning": r["reasoning"],
            "service_tier": r["service_tier"], "store": r["store"],
            "temperature": sampling["temperature"], "text": r["text"],
            "tool_choice": r["tool_choice"], "tools": r["tools"],
            "top_logprobs": r["top_logprobs"], "top_p": sampling["top_p"],
            "truncation": r["truncation"], "usage": usage, "user": r["user"]}
        if r["enable_response_messages"] and usage is not None:
            body.update(self.raw_messages())
        return body

    def finished(self) -> tuple[str, list, dict]:
        """(status, output items, usage) once the reply has ended."""
        message = self.choices.messages(self.turn.stats.finish_reason, self.logprobs)[0]
        return status_of(message["finish_reason"]), self.output_items(message), \
            self.response_usage()

    def output_items(self, message: dict) -> list[dict]:
        """A chat choice's message as Responses output: its text as a message item, each
        tool call as a function_call item."""
        reply, items = message["message"], []
        text = reply.get("content") or ""
        calls = reply.get("tool_calls") or []
        if text or not calls:
            items.append(self.message_item(text, "completed", message.get("logprobs")))
        for call in calls:
            items.append(self.call_item(call, "completed"))
        return items

    def message_item(self, text: str, status: str, logprobs: dict | None = None) -> dict:
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": [self.text_part(text, logprobs)] if text else []}

    def text_part(self, text: str, logprobs: dict | None = None) -> dict:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": self.logprob_list(logprobs)}

    def logprob_list(self, logprobs: dict | None) -> list:
        if not self.r["logprobs"] or not logprobs:
            return []
        return [{**t, "top_logprobs": t["top_logprobs"][:self.r["top_logprobs"]]}
                for t in logprobs["content"]]

    def call_item(self, call: dict, status: str) -> dict:
        function = call["function"]
        item = {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call",
                "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"], "status": status}
        if function["name"] in self.r["namespaces"]:  # a namespace's: its two parts
            item["namespace"], item["name"] = self.r["namespaces"][function["name"]]
        return item

    def response_usage(self) -> dict:
        s = self.turn.stats
        return {"input_tokens": s.prompt_tokens,
                "input_tokens_details": {"cached_tokens": s.cached_tokens or 0},
                "output_tokens": s.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": s.prompt_tokens + s.output_tokens}

    def raw_messages(self) -> dict:
        """vLLM's enable_response_messages: the prompt and the reply as the model saw and
        wrote them (text and token ids)."""
        tokenizer = self.turn.engines.for_profile(self.profile.name).formatter.tokenizer
        ids = self.choices.ids[0]
        return {"input_messages": [{"type": "raw_message_tokens",
                                    "message": tokenizer.decode(self.prompt.token_ids),
                                    "tokens": self.prompt.token_ids}],
                "output_messages": [{"type": "raw_message_tokens",
                                     "message": self.choices.text(0), "tokens": ids}]}

    def conversation(self, output: list) -> list[dict]:
        """The messages a follow-up (previous_response_id) continues: this request's,
        then its reply."""
        text = "".join(p["text"] for item in output if item["type"] == "message"
                       for p in item["content"])
        calls = [{"id": i["call_id"], "type": "function", "function": {
            "name": f"{i['namespace']}{SEPARATOR}{i['name']}" if i.get("namespace")
            else i["name"], "arguments": i["arguments"]}}
            for i in output if i["type"] == "function_call"]
        reply = {"role": "assistant", "content": text or None if calls else text}
        if calls:
            reply["tool_calls"] = calls
        return self.r["conversation"] + [reply]

    async def keep(self, body: dict) -> None:
        if self.r["store"] and self.stored is not None:
            await self.stored.put(self.owner, body, self.conversation(body["output"]))

    # -- whole, background ---------------------------------------------------------

    async def whole(self) -> Response:
        if self.r["background"]:
            return await self.in_background()
        return await super().whole()

    async def whole_body(self) -> dict:
        body = self.response(*self.finished())
        await self.keep(body)
        return body

    async def in_background(self) -> Response:
        """Answered at once as queued; the turn runs on in a task (cancel stops it)."""
        queued = self.response("queued", [], None)
        await self.stored.put(self.owner, queued, self.r["conversation"])
        task = asyncio.create_task(self.run_on(), name=f"response {self.id}")
        RUNNING[self.id] = task
        task.add_done_callback(lambda _: RUNNING.pop(self.id, None))
        return JSONResponse(queued)

    async def run_on(self) -> None:
        try:
            await self._collect()
        except asyncio.CancelledError as exc:
            self.end(exc)
            raise
        except Exception as exc:  # a refusal or failure after "queued": the row says it
            self.end(exc)
            failed = self.response("failed", [], None)
            failed["error"] = {"code": "server_error" if not isinstance(exc, ChatError)
                               else "unavailable", "message": str(exc) if isinstance(
                                   exc, ChatError) else "Something went wrong on our side."}
            await self.stored.rewrite(self.owner, failed, self.r["conversation"])
            return
        self.end()
        body = self.response(*self.finished())
        await self.stored.rewrite(self.owner, body, self.conversation(body["output"]))

    # -- streamed ------------------------------------------------------------------

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\n{sse(body)}"

    async def event_lines(self, first: str | Piece | None, items, include_usage: bool):
        """Responses' events: created, in_progress, the message item's text as deltas,
        then each function call's item and arguments, completed with the whole response."""
        text, logprobs, calls, opened = [], [], [], False
        for kind in ("response.created", "response.in_progress"):
            yield self.event(kind, response=self.response("in_progress", [], None))
        item, ended = first, False
        while True:
            if item is not None:
                chunks = self.choices.deltas(self.choices.take(item), self.logprobs)
            elif not ended and self.choices.open():  # the plain path's end
                chunks, ended = self.choices.ending(0, self.turn.stats.finish_reason), True
            else:
                break
            for choice, _ in chunks:
                delta = choice["delta"]
                calls.extend(delta.get("tool_calls") or ())
                if not delta.get("content"):
                    continue
                if not opened:
                    for event in self.open_message():
                        yield event
                    opened = True
                part = self.logprob_list(choice.get("logprobs"))
                text.append(delta["content"])
                logprobs.extend(part)
                yield self.event("response.output_text.delta", item_id=self.message_id,
                                 output_index=0, content_index=0,
                                 delta=delta["content"], logprobs=part)
            item = await first_of(items) if item is not None else None
        self.end()
        output = []
        if opened:
            message = self.message_item("".join(text), "completed")
            message["content"][0]["logprobs"] = logprobs  # as the deltas gave them
            for event in self.close_message(message):
                yield event
            output.append(message)
        elif not calls:  # nothing written: an empty message, no text part (as vLLM's)
            message = self.message_item("", "completed")
            yield self.event("response.output_item.added", output_index=0,
                             item={**message, "status": "in_progress"})
            yield self.event("response.output_item.done", output_index=0, item=message)
            output.append(message)
        for call in calls:
            n, done = len(output), self.call_item(call, "completed")
            yield self.event("response.output_item.added", output_index=n,
                             item={**done, "arguments": "", "status": "in_progress"})
            yield self.event("response.function_call_arguments.delta", item_id=done["id"],
                             output_index=n, delta=done["arguments"])
            yield self.event("response.function_call_arguments.done", item_id=done["id"],
                             output_index=n, arguments=done["arguments"],
                             name=done["name"])
            yield self.event("response.output_item.done", output_index=n, item=done)
            output.append(done)
        body = self.response(status_of(self.choices.finish[0]), output, self.response_usage())
        await self.keep(body)
        yield self.event("response.completed", response=body)

    def error_event(self, exc: ApiError) -> str:
        return self.event("error", code=exc.code, message=str(exc), param=None)

    def open_message(self) -> list[str]:
        return [self.event("response.output_item.added", output_index=0,
                           item=self.message_item("", "in_progress")),
                self.event("response.content_part.added", item_id=self.message_id,
                           output_index=0, content_index=0, part=self.text_part(""))]

    def close_message(self, message: dict) -> list[str]:
        """The done events of a message item that has text (its one part)."""
        [part] = message["content"]
        return [self.event("response.output_text.done", item_id=self.message_id,
                           output_index=0, content_index=0, text=part["text"],
                           logprobs=part["logprobs"]),
                self.event("response.content_part.done", item_id=self.message_id,
                           output_index=0, content_index=0, part=part),
                self.event("response.output_item.done", output_index=0, item=message)]


RUNNING: dict[str, asyncio.Task] = {}  # background responses of this process, by id


async def cancel_running(response_id: str) -> None:
    """Stop a background response's turn where this process runs it (its engine request
    aborted as the task is cancelled)."""
    task = RUNNING.get(response_id)
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{str(response_id)[:100]}' not found.",
                    code="response_not_found")


def cancelled(body: dict) -> dict:
    return {**body, "status": "cancelled"}

