"""The two error types the engine layer raises on purpose.

`ChatError` is "the user or operator did something we can explain": the UI shows its
message as is, without a stack trace. Anything else is a bug and is allowed to surface.
"""


class ChatError(Exception):
    """A mistake we can explain in one clear message."""


class ConfigError(ChatError):
    """`profiles.yaml` (or an environment override) holds a value we cannot use."""

    def __init__(self, source: str, field: str, problem: str):
        self.source, self.field, self.problem = source, field, problem
        super().__init__(f"{source}: {field}: {problem}")


class ModelNotFound(ChatError):
    """The configured model cannot be found or prepared."""


class EngineUnavailable(ChatError):
    """The engine is not running (still starting, stopped or failed)."""


class EngineBusy(ChatError):
    """Every place in the engine and in its queue is taken; try again later."""

    def __init__(self, name: str, running: int, waiting: int):
        self.name, self.running, self.waiting = name, running, waiting
        super().__init__(f"This chat is busy right now: {running} replies are being written "
                         f"and {waiting} messages are waiting. Please try again in a minute; "
                         "your message was not sent.")


class EngineFailed(ChatError):
    """The engine died while answering; the turn is lost and the engine restarts."""
