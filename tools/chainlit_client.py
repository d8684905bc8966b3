"""A headless Chainlit client over the real Socket.IO protocol, and a server launcher, for
tests/ and bench/.

What a browser does, minus the rendering: connect with the session auth, emit
`connection_successful`, then `client_message` per turn, `chat_settings_change` and `stop`.
Every server event is recorded with its arrival time.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import socketio

ROOT = Path(__file__).resolve().parent.parent
# Small, quick engines unless the environment says otherwise: eager, 1 GiB of KV cache
# without a GPU, a 2,048-token context.
TEST_ENV = {"VCHAT_ENFORCE_EAGER": "1", "VCHAT_KV_CACHE_GIB": "1", "VCHAT_MAX_MODEL_LEN": "2048",
            "HF_HUB_OFFLINE": "1"}
# The first admin of every server started here (each gets a data folder of its own), and
# the account a ChatClient logs in with unless told otherwise.
TEST_USER, TEST_PASSWORD = "tester", "a test password, not a secret"


@dataclass
class Event:
    name: str
    data: object
    at: float


@dataclass
class Reply:
    """What one turn produced: streamed tokens, messages, and the final reply message."""

    events: list[Event]
    tokens: list[str] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # new_message payloads, in order

    @property
    def reply(self) -> dict | None:
        """The assistant message that carries the streamed tokens, if any; or one that
        streamed nothing but carries a reply's stats (the model ended at once)."""
        streamed = {e.data["id"] for e in self.events if e.name == "stream_start"}
        for msg in reversed(self.messages):
            if msg["id"] in streamed:
                return msg
        for msg in reversed(self.messages):
            if "output_tokens" in (msg.get("metadata") or {}):
                return msg
        return None

    @property
    def shown(self) -> str:
        return "".join(self.tokens)

    @property
    def notes(self) -> list[str]:
        """Messages other than the streamed reply (errors, notices)."""
        reply = self.reply
        return [m["output"] for m in self.messages if reply is None or m["id"] != reply["id"]]


class ChatClient:
    def __init__(self, base_url: str, profile: str, user: str = TEST_USER,
                 password: str = TEST_PASSWORD, cookies: dict | None = None):
        self.base_url, self.profile = base_url, profile
        self.user, self.password = user, password
        self.cookies = dict(cookies or {})  # sent besides the login's (a proxy's replica)
        self.session_id = str(uuid.uuid4())
        self.sio = socketio.AsyncClient(reconnection=False)
        self.events: list[Event] = []
        # Who waits for which event name: woken by the first such event, not by every one
        # (at 256 users the bench's one client process reads every stream's frames).
        self._waiting: dict[str, list[asyncio.Future]] = {}
        self.sio.on("*", self._record)
        self._token: str | None = None  # the last login's, for new_chat
        self._settings: dict = {}  # the chat settings sent so far, for new_chat

    async def _record(self, name, data=None):
        self.events.append(Event(name, data, time.monotonic()))
        for waiter in self._waiting.pop(name, ()):
            if not waiter.done():
                waiter.set_result(len(self.events) - 1)

    async def login(self) -> str:
        """Log in as a browser does (POST /login); the session cookie's token."""
        async with httpx.AsyncClient(cookies=self.cookies) as client:
            r = await client.post(self.base_url + "/login", timeout=60,
                                  data={"username": self.user, "password": self.password})
        if r.status_code != 200:
            raise PermissionError(f"login as {self.user!r} refused: {r.status_code} {r.text}")
        return r.cookies["access_token"]

    @contextlib.asynccontextmanager
    async def api(self):
        """An HTTP client logged in as this user, for Chainlit's REST API (/project/...)."""
        token = await self.login()
        async with httpx.AsyncClient(base_url=self.base_url, timeout=60,
                                     cookies={**self.cookies, "access_token": token}) as http:
            yield http

    async def connect(self, wait_chat_start: bool = True, resume: str = "") -> None:
        """Log in and open a session: a new chat, or with `resume` that stored chat's id
        reopened (then it waits for the app's settings panel, the last thing it sends)."""
        token = self._token = await self.login()
        await self._open(token, wait_chat_start, resume)

    async def connect_with(self, token: str) -> None:
        """Open a session with a token got elsewhere (a guest's, from an invite link)."""
        self._token = token
        await self._open(token, True, "")

    async def new_chat(self) -> None:
        """A new chat, as a browser's "New chat" button opens one: the old session is
        cleared at once (Chainlit keeps a closed one for `session_timeout`, for a
        reconnect), then a new session on a new socket, the same login, the settings sent so
        far sent again."""
        with contextlib.suppress(Exception):  # already closed; answered before it closes
            await self.sio.call("clear_session", timeout=30)
        await self.close()
        self.session_id = str(uuid.uuid4())
        self.sio = socketio.AsyncClient(reconnection=False)
        self.sio.on("*", self._record)
        await self._open(self._token or await self.login(), True, "")
        if self._settings:
            await self.settings(**self._settings)

    async def reconnect(self) -> None:
        """The page's socket back after it broke (its server went away): a new socket with
        the same session id and no chat id, as Chainlit's page reconnects."""
        await self.close()
        self.sio = socketio.AsyncClient(reconnection=False)
        self.sio.on("*", self._record)
        await self._open(self._token or await self.login(), True, "")

    async def _open(self, token: str, wait_chat_start: bool, resume: str) -> None:
        since = len(self.events)
        cookies = "; ".join(f"{k}={v}" for k, v in {**self.cookies, "access_token": token}.items())
        await self.sio.connect(
            self.base_url, socketio_path="/ws/socket.io", transports=["websocket"],
            headers={"Cookie": cookies},
            wait_timeout=30,  # the default 1 s is too short for many sessions at once
            auth={"sessionId": self.session_id, "clientType": "webapp", "userEnv": "{}",
                  "chatProfile": self.profile, "threadId": resume})
        await self.sio.emit("connection_successful")
        if resume:
            await self.wait_for("chat_settings", since=since)
        elif wait_chat_start:  # (a stray task_end comes first on connect; skip it)
            started = await self.wait_for("task_start", since=since)
            await self.wait_for("task_end", since=started)

    async def wait_for(self, name: str, since: int, timeout: float = 300.0) -> int:
        """Index of the first `name` event at or after index `since`."""
        for i in range(since, len(self.events)):
            if self.events[i].name == name:
                return i
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(name, []).append(waiter)
        try:
            return await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no {name!r} event within {timeout} s") from None
        finally:  # timed out or cancelled: no longer waiting (woken: already taken off)
            waiters = self._waiting.get(name, [])
            if waiter in waiters:
                waiters.remove(waiter)

    async def attach(self, name: str, data: bytes, mime: str = "application/octet-stream"
                     ) -> httpx.Response:
        """Upload a file to this session as the page's attach button does (POST
        /project/file, multipart); the answer, whose JSON's `id` a message then names."""
        async with self.api() as http:
            return await http.post("/project/file", params={"session_id": self.session_id},
                                   files={"file": (name, data, mime)})

    async def send(self, text: str, timeout: float = 300.0, files: list[str] = ()) -> Reply:
        """Send one user message (with the attached `files`' ids) and collect everything
        until its task ends."""
        start = len(self.events)
        self.last_message_id = await self.emit_message(text, files)
        end = await self.wait_for("task_end", since=start, timeout=timeout)
        return self.collect(start, end + 1)

    async def send_refused(self, text: str, timeout: float = 60.0, files: list[str] = ()
                           ) -> str:
        """Send a message that the server refuses before taking it (chat/guard.py: no turn
        starts); the words it shows the page."""
        start = len(self.events)
        await self.emit_message(text, files)
        toast = await self.wait_for("toast", since=start, timeout=timeout)
        return self.events[toast].data["message"]

    async def refusal_since(self, since: int, timeout: float = 120.0) -> str | None:
        """What became of the message sent at event `since`: None when a turn answered it
        (its task ended), else the words of the notice that refused it."""
        waits = {asyncio.ensure_future(self.wait_for(name, since=since, timeout=timeout)): name
                 for name in ("task_end", "toast")}
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for waiting in pending:
            waiting.cancel()
        first = done.pop()
        return None if waits[first] == "task_end" else self.events[first.result()].data["message"]

    async def wait_for_tokens(self, since: int, count: int, timeout: float = 120.0) -> None:
        """Until `count` streamed tokens have arrived after event `since` (a reply is
        streaming: Stop it now, say)."""
        deadline = time.monotonic() + timeout
        while len([e for e in self.events[since:] if e.name == "stream_token"]) < count:
            assert time.monotonic() < deadline, "no reply streaming"
            await asyncio.sleep(0.01)

    async def emit_message(self, text: str, files: list[str] = ()) -> str:
        """Send a user message, naming the attached `files` by id; its id (for `edit`)."""
        message_id = str(uuid.uuid4())
        await self.sio.emit("client_message", {
            "message": {"id": message_id, "threadId": "", "name": "User",
                        "type": "user_message", "output": text,
                        "createdAt": datetime.datetime.now(datetime.timezone.utc).isoformat()},
            "fileReferences": [{"id": f} for f in files]})
        return message_id

    async def edit(self, message_id: str, text: str, timeout: float = 300.0) -> Reply:
        """Edit an earlier message, as the browser's edit button does, and collect the turn
        that answers it."""
        start = len(self.events)
        await self.sio.emit("edit_message", {"message": {"id": message_id, "output": text}})
        end = await self.wait_for("task_end", since=start, timeout=timeout)
        return self.collect(start, end + 1)

    async def wait_for_note(self, text: str, since: int, timeout: float = 60.0) -> str:
        """A message (not streamed) containing `text`, sent at or after event `since`, even
        after its turn ended."""
        while True:
            found = next((e.data["output"] for e in self.events[since:]
                          if e.name == "new_message" and text in e.data.get("output", "")), None)
            if found is not None:
                return found
            since = await self.wait_for("new_message", since=len(self.events), timeout=timeout)

    def actions(self, for_id: str) -> list[dict]:
        """The buttons shown under message `for_id` now (sent and not removed since)."""
        shown = {}
        for e in self.events:
            if e.name == "action" and e.data.get("forId") == for_id:
                shown[e.data["id"]] = e.data
            elif e.name == "remove_action":
                shown.pop(e.data.get("id"), None)
        return list(shown.values())

    async def press(self, action: dict) -> int:
        """Press a button as the browser does (POST /project/action); the index of the
        first event after it (wait for what it does from there)."""
        start = len(self.events)
        async with self.api() as http:
            r = await http.post("/project/action",
                                json={"sessionId": self.session_id, "action": action})
        assert r.status_code == 200, r.text
        self.pressed = r  # its headers say which front end answered, where there are several
        return start

    def collect(self, start: int, end: int) -> Reply:
        events = self.events[start:end]
        reply = Reply(events)
        for e in events:
            if e.name == "stream_start":  # it carries the first piece of text
                reply.tokens.append(e.data["output"])
            elif e.name == "stream_token":
                reply.tokens.append(e.data["token"])
            elif e.name == "new_message" and e.data.get("type") == "assistant_message":
                reply.messages.append(e.data)
        return reply

    async def settings(self, **values) -> Reply:
        """Change settings; returns what the server said in answer. Waits for the server's
        acknowledgement, which it sends once its handler (and every message the handler
        sent) is done; Chainlit wraps the change in a task_start and task_end."""
        start = len(self.events)
        self._settings.update(values)
        await self.sio.call("chat_settings_change", values, timeout=60)
        return self.collect(start, len(self.events))

    async def stop(self) -> None:
        await self.sio.emit("stop")

    async def close(self) -> None:
        await self.sio.disconnect()


def launcher_of(root: Path) -> str | None:
    """The module `make run` starts in checkout `root` (older ones, a benchmark's baseline,
    had it in service/front_ends.py, or none)."""
    if (root / "launcher.py").exists():
        return "launcher"
    old = root / "service" / "front_ends.py"
    return "service.front_ends" if old.exists() and "def main(" in old.read_text() else None


def engine_of(health: dict, preset: str) -> dict:
    """/ready's entry for the engine that runs `preset` (the one both presets share, named
    "latency-first+throughput-first", or the preset's own)."""
    return next(e for name, e in health["engines"].items() if preset in name.split("+"))


@contextlib.asynccontextmanager
async def serving(extra_env: dict | None = None, base_env: dict | None = None,
                  timeout: float = 400.0):
    """A Server, ready, and stopped on leaving."""
    server = Server(extra_env, base_env)
    try:
        await server.wait_ready(timeout=timeout)
        yield server
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chainlit_command() -> list[str]:
    """This Python's `chainlit` script, else its module (a --target install has no script)."""
    chainlit = Path(sys.executable).parent / "chainlit"
    return [str(chainlit)] if chainlit.exists() else [sys.executable, "-m", "chainlit"]


def side_by_side(*runs: tuple[list[str], Mapping[str, str]], timeout: float = 120
                 ) -> list[subprocess.CompletedProcess]:
    """Run (command, environment) pairs at once in ROOT; each one's exit status and text
    output once all have ended. Past `timeout` (or on any error) those still running are
    killed, as subprocess.run does, and the error raised."""
    procs = []
    try:
        for command, env in runs:
            procs.append(subprocess.Popen(command, cwd=ROOT, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        deadline = time.monotonic() + timeout
        done = []
        for proc in procs:
            out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return done
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


class Server:
    """`chainlit run app.py` in its own process group, as a user would start it (`app`:
    another Chainlit app file, relative to the repository root; `root`: the checkout it
    runs from, this one unless a benchmark compares another)."""

    def __init__(self, extra_env: dict | None = None, base_env: dict | None = None,
                 app: str = "app.py", port: int | None = None, root: Path = ROOT):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / ".cache" / f"server-{self.port}.log"
        self.log_path.parent.mkdir(exist_ok=True)
        base = os.environ if base_env is None else base_env
        env = {**TEST_ENV, **base, **(extra_env or {})}  # the environment's own values win
        if not (extra_env or {}).get("VCHAT_DATA_DIR"):  # a fresh database and first admin
            env["VCHAT_DATA_DIR"] = tempfile.mkdtemp(prefix="vchat-data-")
            env.pop("DATABASE_URL", None)
            env["VCHAT_ADMIN_USER"], env["VCHAT_ADMIN_PASSWORD"] = TEST_USER, TEST_PASSWORD
        self.env = env
        # The app as `make run` starts it: its launcher, which runs `chainlit run app.py`
        # or several front ends sharing each engine's core (launcher.py).
        # (A checkout from before the launcher, as a benchmark's baseline: Chainlit's.)
        launcher = launcher_of(root) if app == "app.py" else None
        command = [sys.executable, "-m", launcher, "--port", str(self.port)] if launcher \
            else chainlit_command() + ["run", app, "--headless", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            command,
            cwd=root, env=env, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True)

    async def wait_http(self, timeout: float = 120.0) -> None:
        await self._poll("/health", timeout)

    async def wait_ready(self, timeout: float = 400.0) -> dict:
        return await self._poll("/ready", timeout)

    async def ready_state(self) -> tuple[int, dict]:
        answer = await self.request("/ready")
        return answer.status_code, answer.json()

    async def get(self, path: str) -> dict:
        """A GET's JSON answer, whatever its status."""
        return (await self.request(path)).json()

    async def request(self, path: str) -> httpx.Response:
        async with httpx.AsyncClient() as client:
            return await client.get(self.url + path, timeout=10)

    async def _poll(self, path: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited; log: {self.log_path}\n" + self.log())
                try:
                    r = await client.get(self.url + path, timeout=5)
                    if r.status_code == 200:
                        return r.json()
                    if path == "/ready" and r.json().get("status") == "failed":
                        # the engines gave up; the server stays up to tell its users so
                        raise RuntimeError(f"the engines failed to start; log: "
                                           f"{self.log_path}\n" + self.log())
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(0.5)
        raise TimeoutError(f"{path} not ready in {timeout} s; log: {self.log_path}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode
