"""The engine layer: vLLM engines per batching preset, chat formatting, model selection.

Never imports the UI. The app uses `load_config`, `Engines`, `Message`, `Prompt`,
`TurnStats` and the error types.
"""

from .chat_format import ChatFormatter, Message
from .config import Profile, load_config
from .errors import Busy, ChatError, ConfigError, Unavailable
from .history import Prompt
from .pool import Engines
from .stats import TurnStats

__all__ = [
    "Busy", "ChatError", "ChatFormatter", "ConfigError", "Engines", "Message", "Profile",
    "Prompt", "TurnStats", "Unavailable", "load_config",
]
