"""What Chainlit shows beside the chat: the profile menu and a session's settings panel."""

from __future__ import annotations

import chainlit as cl
from chainlit.input_widget import Slider, Switch, TextInput

from chat.session import Conversation
from engine.config import Config
from engine.limits import bounds
from store.guests import invited_profile


class Answered:
    """An awaitable that is already answered, and is neither a coroutine nor a future."""

    def __init__(self, value):
        self.value = value

    def __await__(self):
        return self.value
        yield  # a generator: awaiting it returns at once


def profile_menu(config: Config):
    """Chainlit's `set_chat_profiles` hook for `config`'s profiles. Chainlit also calls it
    for every connecting session inside `loop.run_until_complete`, on the loop that is
    already running. Under Chainlit's nest_asyncio that ran nested, and a few dozen
    connects at once ended in RecursionError (test_app.py::test_many_sessions_connect_at_once);
    on the loops the app runs (service/loop.py) it is refused, and Chainlit goes on with
    its global config. What it is given matters there: a coroutine would be left unawaited
    (a warning per connect), and a finished future would make uvloop stop the server's
    loop (it schedules the future's done callback, which stops the loop, before it refuses).
    So: an awaitable already answered."""

    def chat_profiles(current_user=None, language=None) -> Answered:
        only = invited_profile(current_user)  # a guest whose invite names one: just it
        shown = [p for p in config.profiles if p.name == only] or config.profiles
        return Answered([
            cl.ChatProfile(
                name=p.name, markdown_description=p.description, icon=p.icon or None,
                default=p is config.default_profile or len(shown) == 1,
                starters=[cl.Starter(label=s.label, message=s.message) for s in p.starters],
            )
            for p in shown
        ])

    return chat_profiles


def settings_panel(conv: Conversation) -> cl.ChatSettings:
    """The settings a user may change, within the profile's limits, as they are now."""
    limits, now = conv.profile.limits, conv.settings
    temperature, max_tokens = (bounds(limits)[k] for k in ("temperature", "max_tokens"))
    return cl.ChatSettings([
        Slider(id=temperature.name, label=temperature.label, initial=now.temperature,
               min=temperature.lo, max=temperature.hi, step=0.05,
               description="Higher is more varied, lower more focused."),
        Slider(id=max_tokens.name, label=max_tokens.label, initial=now.max_tokens,
               min=max_tokens.lo, max=max_tokens.hi, step=1,
               description="Longest reply, in tokens."),
        TextInput(id="system_prompt", label="System prompt", initial=now.system_prompt,
                  multiline=True,
                  description=f"At most {limits.system_prompt_chars:,} characters."),
        Switch(id="show_stats", label="Show stats under replies", initial=now.show_stats),
    ])
