"""The figures of bench/profiles.py's runs: per-stream figures, the issue's targets, the
kept figures from `make bench`'s JSON, and the plot of several engine layouts side by side.

    python -m bench.profile_figures bench/results/gpu-h200-profiles-*.json \\
        --out bench/results/gpu-h200-profiles.json --plot bench/results/gpu-h200-profiles.png

merges the runs of each layout (a rerun of some phases over the first run's; `--pool
PHASE`: that phase's pairs from all of them), works out
issue 27's targets for each (`--kept FILE`: with engine/raw from `make bench`'s JSON) and
draws every target, measured against its mark, per layout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import textwrap
from pathlib import Path

import numpy as np

LF, TF = "Latency-first", "Throughput-first"


def pct(values, q):
    return round(float(np.percentile(values, q)), 4) if values else None


def med(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def bucket_quantile(before: dict[float, float], after: dict[float, float],
                    q: float = 0.95) -> float | None:
    """The `q` quantile, as its bucket's upper bound, of what a Prometheus histogram
    observed between two scrapes (cumulative counts by `le`); None when it observed
    nothing."""
    grown = sorted((le, after.get(le, 0.0) - before.get(le, 0.0)) for le in after)
    total = grown[-1][1] if grown else 0.0
    if total <= 0:
        return None
    return next(le for le, count in grown if count >= q * total)


def stream_figures(client, start: int, sent: float) -> dict | None:
    """One reply's TTFT, tok/s and update gaps, from a ChatClient's events after `start`."""
    times = [e.at for e in client.events[start:] if e.name in ("stream_start", "stream_token")]
    reply = client.collect(start, len(client.events)).reply
    tokens = ((reply or {}).get("metadata") or {}).get("output_tokens")
    if len(times) < 2 or not tokens:
        return None
    return {"ttft_s": times[0] - sent, "tok_s": tokens / max(times[-1] - times[0], 1e-6),
            "gaps": [b - a for a, b in zip(times, times[1:])], "tokens": tokens}


def summary(rows: list[dict | None]) -> dict:
    rows = [r for r in rows if r]
    gaps = [g for r in rows for g in r["gaps"]]
    return {"streams": len(rows),
            "tok_s_median": pct([r["tok_s"] for r in rows], 50),
            "tok_s_min": pct([r["tok_s"] for r in rows], 0),
            "ttft_p50_s": pct([r["ttft_s"] for r in rows], 50),
            "ttft_p95_s": pct([r["ttft_s"] for r in rows], 95),
            "gap_p95_s": pct(gaps, 95), "gap_max_s": pct(gaps, 100)}


def target(name: str, measured, mark: float, direction: str) -> dict:
    return {"name": name, "measured": measured, "target": mark, "direction": direction}


def targets(out: dict) -> list[dict]:
    """Issue 27's targets against the medians of this run's pairs (phases not run: None)."""
    sat = out.get("saturated", [])
    probe = [s["both"]["probes"][LF] for s in sat]
    first = out.get("first_burst", {})
    return [
        target("light: worst profile's per-stream tok/s / one engine's at 32 streams",
               med([p["ratio"] for p in out.get("light", [])]), 0.85, "min"),
        target("saturated: Latency-first TTFT p95 (s)",
               med([p["ttft_p95_s"] for p in probe]), 0.3, "max"),
        target("saturated: Latency-first update gap p95 (s)",
               med([p["gap_p95_s"] for p in probe]), 0.1, "max"),
        target("saturated: Latency-first tok/s per stream (median)",
               med([p["tok_s_median"] for p in probe]), 100, "min"),
        target("saturated: total tok/s / Throughput-first alone",
               med([s["total_ratio"] for s in sat]), 0.8, "min"),
        target("saturated: preemptions", out.get("saturated_preempted"), 0, "max"),
        target("long prompts: Latency-first update gap p95 (s)",
               med([p["with_long"]["gap_p95_s"] for p in out.get("long_prompts", [])]),
               0.1, "max"),
        target("first burst after /ready: TTFT p95 / a warmed burst's",
               first.get("ttft_p95_ratio"), 2.0, "max"),
        target("kept: the app's tok/s for one user (Latency-first)",
               med([r["tok_s"] for r in out.get("one_user", []) if r]), 250, "min"),
    ]


def kept_targets(bench: dict, preset: str = "throughput-first") -> list[dict]:
    """From `make bench`'s JSON (bench/run.py, run with --paired 1 256): engine/raw at 1
    and 256 users (median of the neighbouring pairs)."""
    run = bench["runs"][preset]
    return [target(f"kept: engine/raw at {n} users ({preset}, make bench)",
                   med(run.get("pairs", {}).get(f"chat@{n}", {}).get("engine_over_raw", [])),
                   0.95, "min") for n in (1, 256)]


def holds(t: dict) -> bool | None:
    if t["measured"] is None:
        return None
    return t["measured"] >= t["target"] if t["direction"] == "min" \
        else t["measured"] <= t["target"]


def plot(runs: dict[str, dict], path: Path) -> None:
    """Each target's measured value over its mark (above 1: better than the mark, for
    targets of either direction), one bar per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [t["name"] for t in next(iter(runs.values()))["targets"]]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(names) * len(runs) + 1.5))
    height = 0.8 / len(runs)
    for i, (layout, run) in enumerate(runs.items()):
        by_name = {t["name"]: t for t in run["targets"]}
        scores = []
        for name in names:
            t = by_name.get(name)
            if t is None or t["measured"] is None:
                scores.append(0)
            elif t["direction"] == "min":
                scores.append(t["measured"] / t["target"])
            else:  # at most: the mark over the measure (0 preemptions: met or not)
                scores.append((t["target"] / t["measured"] if t["measured"] else 2.0)
                              if t["target"] else (2.0 if t["measured"] == 0 else 0.1))
        ys = [k + i * height for k in range(len(names))]
        ax.barh(ys, [min(s, 3) for s in scores], height=height, label=layout)
        for y, name in zip(ys, names):
            t = by_name.get(name)
            if t and t["measured"] is not None:
                ax.text(0.02, y, f"{t['measured']:g}", va="center", fontsize=7)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks([k + 0.4 - height / 2 for k in range(len(names))])
    ax.set_yticklabels([textwrap.fill(f"{n} ({'>=' if t['direction'] == 'min' else '<='} "
                                      f"{t['target']:g})", 38)
                        for n, t in zip(names, next(iter(runs.values()))["targets"])],
                       fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("measured against the target (right of the line: met; capped at 3)")
    ax.set_title("Both profiles at once (bench/profiles.py): each layout against issue 27's "
                 "targets", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


PHASE_KEYS = ("first_burst", "one_user", "light", "long_prompts", "saturated",
              "saturated_preempted", "saturated_load")


POOLED = {"light": "light", "long_prompts": "long_prompts", "saturated": "saturated",
          "saturated_preempted": "saturated"}  # a phase's keys, for --pool


def merged(runs: list[dict], pool: tuple[str, ...] = ()) -> dict[str, dict]:
    """Runs by layout (their label); runs of one layout merged phase by phase, a later
    run's phases over an earlier's (a rerun of some phases), with where each came from.
    A phase in `pool` instead takes the pairs of every run of the layout that has it (runs
    of the same code on different machines: their medians over all the pairs), and their
    preemptions added up."""
    out: dict[str, dict] = {}
    for run in runs:
        label = run.get("label") or run["engines"]
        into = out.setdefault(label, {"label": label, "engines": run["engines"],
                                      "variant": run.get("variant"), "from": {}})
        for key in PHASE_KEYS:
            if key not in run:
                continue
            if POOLED.get(key) in pool and key in into:
                into[key] = into[key] + run[key]  # pairs' lists, or preemptions' counts
                into["from"][key] = [*into["from"][key], run.get("source")]
            else:
                into[key] = run[key]
                into["from"][key] = [run.get("source")] if POOLED.get(key) in pool \
                    else run.get("source")
    for run in out.values():
        run["targets"] = targets(run)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="bench/profiles.py JSON files (one layout each; "
                   "several of one layout are merged, later phases over earlier)")
    p.add_argument("--kept", help="make bench's JSON with the kept figures, added to each")
    p.add_argument("--out", help="write the layouts' merged figures and targets (JSON) here")
    p.add_argument("--plot", help="write the plot (PNG) here")
    p.add_argument("--pool", nargs="+", default=[], choices=["light", "long_prompts",
                                                             "saturated"],
                   help="phases whose pairs are taken from every run of a layout that has "
                        "them, rather than the last run's")
    args = p.parse_args()
    runs = []
    for name in args.runs:
        run = json.loads(Path(name).read_text())
        run["source"] = Path(name).name
        runs.append(run)
    layouts = merged(runs, tuple(args.pool))
    for label, run in layouts.items():
        if args.kept:
            run["targets"] += kept_targets(json.loads(Path(args.kept).read_text()))
        for t in run["targets"]:
            print(f"{label}: {t['name']}: {t['measured']} ({t['direction']} {t['target']})"
                  f"{'' if holds(t) or t['measured'] is None else '  NOT MET'}")
    if args.out:
        Path(args.out).write_text(json.dumps({"layouts": layouts}, indent=1))
    if args.plot:
        plot(layouts, Path(args.plot))


if __name__ == "__main__":
    main()
