"""The bounds a turn's numbers must keep, from a profile's limits: the one rule that the chat's
settings panel, the OpenAI API and profiles.yaml's own check (its sampling defaults within
its limits) all apply. Each front end words its refusal; the bounds are these.
"""

from __future__ import annotations

from dataclasses import dataclass

SEED_MAX = 2**63 - 1
PENALTY_MAX = 2.0  # presence and frequency penalties, as OpenAI's API bounds them (and
# vLLM's repetition penalty, a factor: 1 is none)
TOP_K_MAX = 1000  # vLLM's top_k (-1 or 0: off); more alternatives than this change nothing


@dataclass(frozen=True)
class Bound:
    name: str  # the request's field
    label: str  # as the settings panel names it
    kind: type  # int or float (a float bound takes whole numbers too; never a bool)
    lo: float
    hi: float
    lo_open: bool = False  # the lowest value itself is out

    def holds(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        return (self.lo < value if self.lo_open else self.lo <= value) and value <= self.hi

    def broken(self, value) -> str:
        """Which check `value` fails, in the words pydantic's errors use (vLLM's server
        answers with them, and its clients match them): greater_than_equal 0, ..."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                self.kind is int and not isinstance(value, int)):
            return "int_type" if self.kind is int else "float_type"
        if value > self.hi:
            return f"less_than_equal {shown(self.hi)}"
        return f"greater_than {shown(self.lo)}" if self.lo_open else \
            f"greater_than_equal {shown(self.lo)}"

    def span(self) -> str:
        """"from 1 to 1024", or "above 0 and at most 1"."""
        lo, hi = shown(self.lo), shown(self.hi)
        return f"above {lo} and at most {hi}" if self.lo_open else f"from {lo} to {hi}"


def shown(value: float) -> str:
    """A bound as people write it: 0, 1.5, 1024, 9223372036854775807."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def bounds(limits) -> dict[str, Bound]:
    """The bounds of a profile's `Limits` (engine/config.py), by field."""
    return {b.name: b for b in (
        Bound("temperature", "Temperature", float, 0.0, limits.temperature),
        Bound("max_tokens", "Max tokens", int, 1, limits.max_tokens),
        Bound("top_p", "Top p", float, 0.0, 1.0, lo_open=True),
        Bound("seed", "Seed", int, 0, SEED_MAX),
        Bound("n", "Replies", int, 1, limits.n),
        Bound("top_logprobs", "Top logprobs", int, 0, limits.top_logprobs),
        Bound("presence_penalty", "Presence penalty", float, -PENALTY_MAX, PENALTY_MAX),
        Bound("frequency_penalty", "Frequency penalty", float, -PENALTY_MAX, PENALTY_MAX),
        Bound("top_k", "Top k", int, -1, TOP_K_MAX),
        Bound("min_tokens", "Min tokens", int, 0, limits.max_tokens),
        Bound("min_p", "Min p", float, 0.0, 1.0),
        Bound("repetition_penalty", "Repetition penalty", float, 0.0, PENALTY_MAX,
              lo_open=True),
    )}


def system_prompt_fits(limits, text: str) -> bool:
    return len(text) <= limits.system_prompt_chars
