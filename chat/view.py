"""Texts the chat shows besides the model's replies (plain strings, no UI calls)."""

from engine import TurnStats

STARTING = ("The model is still starting (about half a minute on a CPU). You can type "
            "already: your message will be answered as soon as it is ready.")
STARTING_TURN = ("*The model is still starting: your message will be answered as soon as it is "
                 "ready.*")
RESTARTING_PAGE = ("The model stopped unexpectedly and is being restarted: replies resume in a "
                   "moment.")
UNREACHABLE_PAGE = ("The model server for this chat cannot be reached right now: replies resume "
                    "once it is back.")
FAILED_PAGE = ("The model could not start, so messages cannot be answered. Please tell the "
               "operator of this app (its log says why).")
STOPPING_PAGE = "The app is restarting or shutting down: new messages wait until it is back."
WITHDRAWN = "*Stopped before the reply began: that message is not part of the conversation.*"
UNEXPECTED = ("Sorry, something went wrong on our side while answering, and it has been "
              "logged. Your message was not added to the conversation; please send it again.")
NOT_ANSWERED = ("The app shut down before your message could be answered; it is not part of "
                "the conversation. Please send it again in a minute.")
CUT_OFF = ("The server that was answering your last message went away before the reply was "
           "finished, so that reply is not part of the conversation. This chat goes on here "
           "with everything before it: please send that message again.")
CUT_SHORT = ("\n\n*Cut short: the app is shutting down. Send your message again once it is "
             "back for a full reply.*")
STAND_IN = ("Benchmark mode: this server runs a stand-in engine, not a model. Replies are "
            "filler text produced at a set speed to measure the chat layer.")
NOT_SAVED = ("This turn is shown but could not be saved to your chat history (the database "
             "refused it; the operator's log says why). It will be missing if you reopen "
             "this chat.")
NOT_REGENERATED = ("Only the last reply can be written again, and only when no reply is being "
                   "written: this one stays as it is.")
RANDOM_WEIGHTS = ("Test mode: this server runs the model with random weights (its real "
                  "size and speed, but no training). Replies are random text, not answers.")


def page_line(status: str, *standing: str | None) -> str | None:
    """The line at the top of every open page (/notice): the engines' state while they are
    not ready, else what always holds here (`standing`: a test mode, a demo), or none. In
    that line, not in the chat: a message at a chat's start switched Chainlit's view under
    the input and lost what the user had begun typing."""
    return page_notice(status) or " ".join(p for p in standing if p) or None


def page_notice(status: str) -> str | None:
    """The line at the top of every open page for the engines' state (/notice), or none."""
    return {"ok": None, "starting": STARTING, "restarting": RESTARTING_PAGE,
            "ready": RESTARTING_PAGE,  # up, but an engine fails its health check
            "unreachable": UNREACHABLE_PAGE,  # a remote preset's server (engine/remote.py)
            "stopping": STOPPING_PAGE, "stopped": STOPPING_PAGE}.get(status, FAILED_PAGE)


def stats_line(stats: TurnStats, profile: str) -> str:
    """The small line under a reply: time to first token, speed, tokens in/out, profile."""
    ttft = f"{stats.ttft_s * 1000:,.0f} ms to first token" if stats.ttft_s is not None else (
        "no tokens")
    return (f"*{ttft} · {stats.tokens_per_s:.1f} tokens/s · {stats.prompt_tokens:,} in / "
            f"{stats.output_tokens:,} out · {profile}*")


def reply_metadata(stats: TurnStats, profile: str, dropped_turns: int) -> dict:
    """What a finished reply carries besides its text (for clients, tests and benchmarks)."""
    return {"profile": profile, "preset": stats.preset, "prompt_tokens": stats.prompt_tokens,
            "output_tokens": stats.output_tokens, "ttft_s": stats.ttft_s,
            "tokens_per_s": stats.tokens_per_s, "finish_reason": stats.finish_reason,
            "dropped_turns": dropped_turns}


def dropped_notice(turns: int) -> str:
    return (f"This conversation no longer fits the model's context, so the oldest "
            f"{'turn was' if turns == 1 else f'{turns} turns were'} left out of what the "
            "model sees (and older ones will be as it grows). Start a new chat for a clean "
            "slate.")


def short_reply_notice(room: int, asked: int) -> str:
    return (f"Replies in this chat can be cut short: the model's context leaves this one room "
            f"for {room:,} tokens, fewer than the {asked:,} your settings allow. Lower "
            "'Max tokens' in the settings to avoid it.")


def queued_notice(place: int) -> str:
    ahead = "next in line" if place == 1 else f"number {place} in line"
    return (f"Many people are chatting right now: your message is {ahead}. It will be "
            "answered as soon as a place is free (Stop withdraws it).")


def reading_notice(tokens: int, percent: int | None) -> str:
    """Said while the model reads a long message (its prefill: nothing comes out of it
    meanwhile), until the reply begins; `percent` is an estimate (engine/reading.py), None
    once the estimated time has run out."""
    done = f"about {percent}% (estimated)" if percent is not None else \
        "taking longer than estimated"
    return f"*Reading your message ({tokens:,} tokens): {done}*"
