"""Chainlit 2.12's `Message` and `Step` constructors each call `time.sleep(0.001)`, so that
two objects made one after the other get different `created_at` times; a turn makes at
least three (the user's message, Chainlit's `on_message` step, the reply), and the event
loop that every session shares stood still for each (BENCHMARKS.md, "GPU (H200)"). Upstream:
Chainlit/chainlit pull request #1374 (closed, not merged).

`skip_constructor_pause()` keeps what the sleep was for without the wait: those two modules
get a clock that never repeats itself (chat/clock.py) and a `time` whose `sleep` returns
at once for that one millisecond; any other use of `time` is the real module's. The other
stalls of the loop, and how they are watched: service/loop.py.
"""

from __future__ import annotations

import importlib
import time

from chat.clock import CLOCK

CONSTRUCTOR_PAUSE_S = 0.001  # the sleep in Message.__init__ and Step.__init__


def _modules() -> list:
    # By module path: the package's own `chainlit.step` is the @step decorator, not the
    # module.
    return [importlib.import_module(f"chainlit.{name}") for name in ("message", "step")]


class _TimeWithoutPause:
    """The `time` module, except that the constructors' pause does not block."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        if seconds != CONSTRUCTOR_PAUSE_S:
            time.sleep(seconds)


def skip_constructor_pause() -> None:
    """Idempotent: the modules point at the same replacements however often it runs."""
    for module in _modules():
        module.time = _TimeWithoutPause()
        module.utc_now = CLOCK.utc_now


def constructor_pause_skipped() -> bool:
    return all(getattr(m.utc_now, "__self__", None) is CLOCK
               and isinstance(m.time, _TimeWithoutPause) for m in _modules())
