"""History fitting cost per turn (engine/history.py), on the real tokenizers, no engine.

For conversations of about 1k, 8k and 32k tokens (turns of a ~25-word question and a
~180-word reply, random words), on the embedded model's tokenizer and on Qwen's (the
target model's, with the tiny test checkpoint's ChatML template): how long `fit_history`
takes for the next turn as the app calls it, i.e. the earlier messages are the same
objects as last turn and the last reply and the new message are new. Two cases: the
context holds it all (nothing dropped), and it holds half (the oldest turns dropped).
Median of --repeats turns each. This is work the event loop does for every turn. It runs
on the code before issue 13 too, which gave BENCHMARKS.md's "before".

    .venv/bin/python -m bench.fitting
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from engine import ChatFormatter, Message
from engine.history import fit_history
from engine.model import cache_dir, prepare_embedded
from tools import tiny_qwen3

WORDS = ("the a of to and in that is for it on with as was be by this are or at from model "
         "server token batch stream reply user chat engine prompt cache queue").split()
SYSTEM = "You are a helpful, concise assistant."
SIZES = (1_000, 8_000, 32_000)
REPLY_ROOM = 512


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(fmt: ChatFormatter, tokens: int, rng: random.Random) -> list[Message]:
    history = []
    while fmt.count(history + [Message("user", "?")], SYSTEM) < tokens:
        history += [Message("user", text(rng, 25)), Message("assistant", text(rng, 180))]
    return history


def next_turn_ms(fmt: ChatFormatter, history: list[Message], context: int, repeats: int,
                 rng: random.Random) -> dict:
    """Median ms of fitting the turn after `history`'s last question, `repeats` times, each
    with a new reply to it and a new question (the rest as fitted on the turn before):
    `fit`; and `history_part`, the same fit again once the new text is tokenized, i.e. what
    the history itself costs (the rest, tokenizing the new text, any fitting has to do)."""
    asked = history[:-1]  # ends with a question whose reply is now written
    fit_history(fmt, asked[:-1], asked[-1], system_prompt=SYSTEM, max_model_len=context,
                max_tokens=REPLY_ROOM)  # the turn before
    times = {"fit": [], "history_part": []}
    for _ in range(repeats):
        turn = asked + [Message("assistant", text(rng, 180))]
        new = Message("user", text(rng, 25))
        for key in times:
            started = time.perf_counter()
            prompt = fit_history(fmt, turn, new, system_prompt=SYSTEM, max_model_len=context,
                                 max_tokens=REPLY_ROOM)
            times[key].append(time.perf_counter() - started)
    return {**{k: round(statistics.median(v) * 1000, 3) for k, v in times.items()},
            "dropped_turns": prompt.dropped_turns}


def main(repeats: int) -> dict:
    tokenizers = {
        "embedded (SmolLM2)": str(prepare_embedded()),
        "Qwen3 (tiny test checkpoint)": str(tiny_qwen3.build(cache_dir() / "tiny-qwen3")),
    }
    rows = []
    for name, folder in tokenizers.items():
        fmt = ChatFormatter(AutoTokenizer.from_pretrained(folder))
        for size in SIZES:
            rng = random.Random(size)
            history = conversation(fmt, size, rng)
            tokens = fmt.count(history, SYSTEM)
            for case, context in (("fits", tokens * 2 + REPLY_ROOM + 4096),
                                  ("half dropped", tokens // 2 + REPLY_ROOM)):
                ms = next_turn_ms(fmt, history, context, repeats, rng)
                rows.append({"tokenizer": name, "history_tokens": tokens,
                             "turns": len(history) // 2, "case": case, "ms": ms})
                print(f"{name:30} {tokens:>6,} tokens {len(history) // 2:>4} turns {case:13} "
                      f"{ms['fit']:8.3f} ms, the history's part {ms['history_part']:.3f} ms "
                      f"(dropped {ms['dropped_turns']})", flush=True)
    return {"command": "python -m bench.fitting " + " ".join(sys.argv[1:]),
            "repeats": repeats, "rows": rows}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=51)
    parser.add_argument("--out", help="also write the figures (JSON) to this file")
    args = parser.parse_args()
    result = main(args.repeats)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
