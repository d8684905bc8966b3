"""The engine layer: vLLM engines per batching preset, chat formatting, model selection.

Never imports the UI. The app uses `load_config`, `Engines` and the error types.
"""

from .chat_format import ChatFormatter, Message
from .config import Config, Profile, load_config
from .errors import ChatError, ConfigError, EngineBusy, EngineUnavailable, ModelNotFound
from .history import Fitted, MessageTooLong
from .pool import Engines
from .stats import TurnStats

__all__ = [
    "ChatError", "ChatFormatter", "Config", "ConfigError", "EngineBusy", "EngineUnavailable",
    "Engines",
    "Fitted", "Message", "MessageTooLong", "ModelNotFound", "Profile", "TurnStats",
    "load_config",
]
