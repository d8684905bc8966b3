"""The engine layer: vLLM engines per batching preset, chat formatting, model selection.

Never imports the UI. The app uses `load_config`, `Engines`, `Message`, `Prompt`,
`TurnStats` and the error types.

Each name is imported when first used, so a part that needs one module of the layer
(the `store` command reads `engine.settings` only) does not load the pool, the config's
YAML and Prometheus with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "Busy": "errors", "ChatError": "errors", "ConfigError": "errors", "Unavailable": "errors",
    "ChatFormatter": "chat_format", "Message": "chat_format",
    "Profile": "config", "load_config": "config",
    "Prompt": "history", "Engines": "pool", "TurnStats": "stats",
}
__all__ = sorted(_HOMES)

if TYPE_CHECKING:
    from .chat_format import ChatFormatter, Message
    from .config import Profile, load_config
    from .errors import Busy, ChatError, ConfigError, Unavailable
    from .history import Prompt
    from .pool import Engines
    from .stats import TurnStats


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
