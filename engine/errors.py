"""The two error types the engine layer raises on purpose.

`ChatError` is "the user or operator did something we can explain": the UI shows its
message as is, without a stack trace. Anything else is a bug and is allowed to surface.
"""


class ChatError(Exception):
    """A mistake or a state we can explain in one clear message (str() is that message)."""


class Busy(ChatError):
    """The engine's seats and its line are full: try again soon."""


class Unavailable(ChatError):
    """The engine cannot serve now (starting, restarting, failed, died mid-turn)."""


class ConfigError(ChatError):
    """`profiles.yaml` (or an environment variable) holds a value we cannot use."""

    def __init__(self, source: str, field: str, problem: str):
        self.source, self.field, self.problem = source, field, problem
        super().__init__(f"{source}: {field}: {problem}")
