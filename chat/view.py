"""Texts the chat shows besides the model's replies (plain strings, no UI calls)."""

from engine import TurnStats


def stats_line(stats: TurnStats, profile: str) -> str:
    """The small line under a reply: time to first token, speed, tokens in/out, profile."""
    ttft = f"{stats.ttft_s * 1000:,.0f} ms to first token" if stats.ttft_s is not None else (
        "no tokens")
    return (f"*{ttft} · {stats.tokens_per_s:.1f} tokens/s · {stats.prompt_tokens:,} in / "
            f"{stats.output_tokens:,} out · {profile}*")


def dropped_notice(turns: int) -> str:
    return (f"This conversation no longer fits the model's context, so the oldest "
            f"{'turn was' if turns == 1 else f'{turns} turns were'} left out of what the "
            "model sees (and older ones will be as it grows). Start a new chat for a clean "
            "slate.")


def queued_notice(place: int) -> str:
    ahead = "next in line" if place == 1 else f"number {place} in line"
    return (f"Many people are chatting right now: your message is {ahead}. It will be "
            "answered as soon as a place is free (Stop withdraws it).")
