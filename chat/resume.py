"""A stored chat that goes on in this session: reopened from the chat list (Chainlit's
resume), or taken over from an app process that went away (its page reconnects here with
its socket session's id and no chat id). Its turns come back as they were, so the next turn
is fitted exactly as in the live chat, and a turn that a process's end cut off is said.
"""

from __future__ import annotations

import contextlib
import logging

import chainlit as cl
from chainlit.types import ThreadDict

from chat.panel import settings_panel
from chat.session import Conversation, cut_off_run, stored_turns
from chat.view import CUT_OFF
from engine.config import Config, Profile
from chat.data_layer import ChatDataLayer
from store.documents import Documents
from store.schema import StoreError
from store.guests import invited_profile

log = logging.getLogger("app")


def session_profile(config: Config) -> Profile:
    """The profile the page chose; for a guest whose invite names one, that one, whatever
    the page sent (store/invites.py)."""
    return config.profile_or_default(invited_profile(cl.user_session.get("user"))
                                     or cl.user_session.get("chat_profile"))


class Resuming:
    def __init__(self, config: Config, store: ChatDataLayer, documents: Documents | None = None):
        self.config, self.store = config, store
        self.documents = documents  # the chats' attached files (store/documents.py)

    async def continue_chat(self, thread: ThreadDict) -> Conversation:
        """This session goes on with a stored chat: its turns, its settings panel, the chat
        marked as this session's (a later reconnect elsewhere finds it), and a turn that
        its process's end cut off said."""
        conv = Conversation.start(session_profile(self.config))
        files = await self.documents.of_thread(thread["id"], cl.context.session.user.identifier) \
            if self.documents is not None and cl.context.session.user else {}
        conv.restore(stored_turns(thread.get("steps") or [], conv.profile.limits.message_chars,
                                  files), files)
        cl.user_session.set("conversation", conv)
        with contextlib.suppress(StoreError):  # only a later reconnect elsewhere would miss it
            await self.store.take_over(thread["id"], cl.context.session.id)
        await settings_panel(conv).send()
        if run := cut_off_run(thread.get("steps") or []):  # said once: the run is ended
            note = cl.Message(content=CUT_OFF)
            await note.send()
            # Chainlit draws a resumed chat from `thread` once this returns: the note with it.
            thread.setdefault("steps", []).append(note.to_dict())
            with contextlib.suppress(StoreError):
                await self.store.end_run(run)
        return conv

    async def take_over(self) -> bool:
        """A page whose app process went away (killed, restarted, its session forgotten)
        comes back to this one with its socket session's id and no chat id: its chat goes
        on from the database, and the page keeps what it shows. (Chainlit's own page carries
        the chat's id once it moved to /thread/ID, and Chainlit resumes it.)"""
        session = cl.context.session
        try:
            thread_id = session.user and await self.store.chat_of_session(
                session.id, session.user.identifier)
            thread = thread_id and await self.store.get_thread(thread_id)
        except StoreError:  # the database away: a new chat, as before
            return False
        if not thread:
            return False
        session.thread_id, session.has_first_interaction = thread_id, True
        conv = await self.continue_chat(thread)
        log.info("chat %s taken over by this process with %d turns", thread_id,
                 len(conv.turns))
        return True
