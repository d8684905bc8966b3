"""engine/base.py: vLLM's engine, the remote one and the stand-in are one interface, with the
same errors and no sampling defaults of their own (issue 28: the pool told them apart
with isinstance, the stand-in refused with a plain ChatError where the others said
Unavailable, so the API answered 400 instead of 503, and all three defaulted top_p to 1.0
where profiles.yaml says 0.9). And the engine layer loads vLLM only where an engine is
built (`import chat.input` took 10.6 s importing vLLM)."""

import inspect
import subprocess
import sys

import pytest

from engine import Unavailable
from engine.base import Engine
from engine.config import Remote
from engine.history import Prompt
from engine.launch import EngineSetup
from engine.llm import PresetEngine
from engine.remote import RemoteEngine
from engine.standin import StandInEngine
from tools.chainlit_client import ROOT

ENGINES = {
    "vllm": lambda: PresetEngine("p", EngineSetup({"model": "unused"})),
    "remote": lambda: RemoteEngine("p", Remote("http://127.0.0.1:9/v1", "m"), "unused"),
    "stand-in": lambda: StandInEngine("p", EngineSetup({"model": "unused"})),
}


@pytest.mark.parametrize("kind", ENGINES)
def test_every_engine_is_the_interface_with_one_turn_signature(kind):
    engine = ENGINES[kind]()  # abstract methods left out would refuse this
    assert isinstance(engine, Engine)
    assert inspect.signature(type(engine).stream) == inspect.signature(Engine.stream)
    params = inspect.signature(type(engine).stream).parameters
    assert params["temperature"].default is params["top_p"].default is inspect.Parameter.empty
    assert (engine.remote is not None) == (kind == "remote") and \
        engine.restartable is (kind != "remote")


@pytest.mark.parametrize("kind", ENGINES)
async def test_an_engine_not_started_says_unavailable_everywhere(kind):
    engine = ENGINES[kind]()
    assert not engine.running and not await engine.check_health()
    with pytest.raises(Unavailable):
        engine.formatter
    with pytest.raises(Unavailable):
        async for _ in engine.stream(Prompt((), "", [1, 2], 2, 8, 0), temperature=0.7,
                                     top_p=0.9):
            pass
    engine.shutdown()
    engine.shutdown()  # idempotent


def test_the_engine_layer_chat_and_store_load_no_vllm_until_an_engine_is_built():
    code = ("import sys; import engine, engine.pool, service.input, service.turn, chat.session, "
            "store.__main__, "
            "api.requests; heavy = [m for m in ('vllm', 'torch', 'openai') if m in "
            "sys.modules]; print(heavy); sys.exit(1 if heavy else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
