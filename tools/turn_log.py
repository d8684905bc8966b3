"""Where a run's first tokens went, from the app server's turn log (one line per turn,
service/turn_metrics.py): per front end, how many turns it ran and the medians of each
turn's way to its first token.

    python -m tools.turn_log .cache/server-PORT.log [--last 256]   # the last 256 turns
    python -m tools.turn_log .cache/server-PORT.log --each 256     # every 256 turns in turn

Fields: to_turn_ms (the message's arrival -> its turn's start: the login check, Chainlit's
handling), ttft_ms (the engine: the request -> its first token), app_ttft_ms (the arrival
-> the first text handed to the socket), and the engine's legs (to_engine, queued, prefill,
back), and to_turn_ms's legs (to_turn_checks: the guard's, the login's and the limits';
to_turn_chainlit: Chainlit's handling, its storing of the message started beside it, not
awaited; to_turn_app: the app's handler); tokens_per_s, each turn's decode speed (runs of
turns that ended together: the engine's pace while they ran).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

FIELD = re.compile(r"(\w+)=('[^']*'|\"[^\"]*\"|\S+)")
TIMES = ("to_turn_ms", "ttft_ms", "app_ttft_ms")
# And each turn's decode speed after its first token (the engine's pace: 1 / TPOT).
SPEEDS = ("tokens_per_s",)


def turns(text: str) -> list[dict]:
    """Every turn line's fields, in the log's order (numbers as floats)."""
    out = []
    for line in text.splitlines():
        at = line.find("turn outcome=")
        if at < 0:
            continue
        fields = {}
        for key, value in FIELD.findall(line[at + 5:]):
            try:
                fields[key] = float(value)
            except ValueError:
                fields[key] = value.strip("'\"")
        for legs, prefix in (("ttft_legs_ms", "leg_"), ("to_turn_legs_ms", "to_turn_")):
            for leg in str(fields.get(legs, "")).split(","):
                name, _, ms = leg.partition(":")
                if ms:
                    fields[f"{prefix}{name}"] = float(ms)
        out.append(fields)
    return out


def summary(rows: list[dict]) -> dict:
    """Turns per front end and each time's median (and the slowest), over all and per front
    end."""
    def medians(group: list[dict]) -> dict:
        keys = [*TIMES, *SPEEDS, *sorted({k for r in group for k in r
                                 if k.startswith(("leg_", "to_turn_")) and k not in TIMES
                                 and not k.endswith("_legs_ms")})]
        out = {"turns": len(group)}
        for key in keys:
            values = [r[key] for r in group if isinstance(r.get(key), float)]
            if values:
                out[key] = {"p50": round(statistics.median(values), 1), "max": max(values)}
        return out

    fronts = sorted({r.get("front_end", -1) for r in rows})
    result = {"all": medians(rows)}
    if fronts != [-1]:
        result["front_ends"] = {int(f): medians([r for r in rows if r.get("front_end", -1) == f])
                                for f in fronts}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--last", type=int, default=0, help="only the last N turns of each log")
    p.add_argument("--each", type=int, default=0,
                   help="a summary for every N turns in turn (runs of N users each)")
    args = p.parse_args()
    for path in args.logs:
        rows = [r for r in turns(path.read_text(errors="replace"))
                if r.get("outcome") == "finished"]
        if args.last:
            rows = rows[-args.last:]
        size = args.each or len(rows) or 1
        for start in range(0, len(rows), size):
            block = rows[start:start + size]
            print(json.dumps({"log": path.name, "turns": f"{start + 1}-{start + len(block)}",
                              **summary(block)}))


if __name__ == "__main__":
    main()
