"""chat/session.py's stored_turns: a stored chat's steps back into the turns the live chat
recorded (app.py's on_chat_resume; the real server's resume is in tests/test_accounts.py)."""

from chat.session import HISTORY_CHARS, Conversation, stored_turns
from engine import load_config


def step(kind: str, output: str, at: str, **metadata) -> dict:
    return {"id": f"id-{at}", "type": kind, "output": output, "createdAt": at,
            "metadata": metadata}


def test_turns_are_the_answered_messages_with_the_reply_as_the_history_held_it():
    steps = [
        step("assistant_message", "**Benchmark mode:** ...", "01"),  # a note at chat start
        step("user_message", "What is 2 + 2?", "02"),
        step("assistant_message", "4\n\n`12 tok/s ...`", "04", **{HISTORY_CHARS: 1}),
        step("user_message", "x" * 500, "05"),  # refused as too long: no reply
        step("assistant_message", "Your message is 500 characters long...", "06"),
        step("user_message", "Tell me a story.", "07"),
        step("assistant_message", "Once upon\n\n*Stopped.*", "09", stopped=True,
             **{HISTORY_CHARS: 9}),
        step("user_message", "And then?", "10"),  # withdrawn before its reply began
        step("assistant_message", "*Stopped before the reply began...*", "11"),
        step("run", "", "03"),  # Chainlit's own steps are not messages
    ]
    turns = stored_turns(list(reversed(steps)), message_chars=100)  # any order: by time
    assert turns == [("id-02", "What is 2 + 2?", "4", "id-04"),
                     ("id-07", "Tell me a story.", "Once upon", "id-09")]
    conv = Conversation.start(load_config().default_profile)
    conv.restore(turns)
    assert [(m.role, m.content) for m in conv.history()] == [
        ("user", "What is 2 + 2?"), ("assistant", "4"),
        ("user", "Tell me a story."), ("assistant", "Once upon")]
    # Only the last reply can be asked for again; its turn leaves the history.
    assert conv.take_back("id-04") is None and len(conv.turns) == 2
    again = conv.take_back("id-09")
    assert again.message_id == "id-07" and again.user.content == "Tell me a story."
    conv.restore(turns[1:])
    # An edit of the first message takes both turns out, as the page does.
    assert conv.rewind("id-07") == 1 and conv.rewind("no such message") == 0
    assert conv.rewind("id-02") == 1 and conv.history() == []
