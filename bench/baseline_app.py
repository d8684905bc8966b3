"""The usual Chainlit + vLLM deployment, as the baseline our chat path is measured against
(bench/serve_compare.py): Chainlit's on_message calls a separate vLLM OpenAI server through
the `openai` client, streams the chat completion into the message one `stream_token` per
chunk, and keeps the whole conversation in the user session. Nothing of this project's
app is used (its settings are listed in engine/settings.py's table, read here directly).

    VCHAT_BASELINE_BASE_URL=http://127.0.0.1:8001/v1 VCHAT_BASELINE_MODEL=NAME \
    VCHAT_BASELINE_PASSWORD=secret CHAINLIT_AUTH_SECRET=... \
        .venv/bin/chainlit run bench/baseline_app.py --headless --port 8000

Login: any user name with VCHAT_BASELINE_PASSWORD (the headless benchmark client logs in as a
browser does). Settings the client sends (`max_tokens`) apply to the next turns.
VCHAT_BASELINE_IGNORE_EOS=1 makes every reply run to max_tokens (benchmarks: equal lengths).
"""

import os

import chainlit as cl
from openai import AsyncOpenAI

BASE_URL = os.environ.get("VCHAT_BASELINE_BASE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("VCHAT_BASELINE_MODEL", "default")
PASSWORD = os.environ.get("VCHAT_BASELINE_PASSWORD", "")
IGNORE_EOS = os.environ.get("VCHAT_BASELINE_IGNORE_EOS", "0") == "1"
MAX_TOKENS = 512
SAMPLING = {"temperature": 0.8, "top_p": 1.0}  # as bench/workloads.py's SAMPLING

client = AsyncOpenAI(base_url=BASE_URL,
                     api_key=os.environ.get("VCHAT_BASELINE_API_KEY", "none"))


@cl.password_auth_callback
def login(username: str, password: str):
    if PASSWORD and password == PASSWORD:
        return cl.User(identifier=username)
    return None


@cl.on_chat_start
async def start():
    cl.user_session.set("history", [])


@cl.on_message
async def answer(message: cl.Message):
    history = cl.user_session.get("history")
    history.append({"role": "user", "content": message.content})
    settings = cl.user_session.get("chat_settings") or {}
    reply = cl.Message(content="")
    stream = await client.chat.completions.create(
        model=MODEL, messages=history, stream=True,
        max_tokens=int(settings.get("max_tokens", MAX_TOKENS)),
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": IGNORE_EOS}, **SAMPLING)
    async for chunk in stream:
        if chunk.usage:  # the last chunk: counted tokens, for the benchmark's figures
            reply.metadata = {"output_tokens": chunk.usage.completion_tokens}
        if chunk.choices and chunk.choices[0].delta.content:
            await reply.stream_token(chunk.choices[0].delta.content)
    await reply.send()
    history.append({"role": "assistant", "content": reply.content})
