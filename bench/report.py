"""Render bench/results/latest.json as the Markdown tables in BENCHMARKS.md.

    .venv/bin/python -m bench.report [bench/results/latest.json]
"""

import json
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parent / "results" / "latest.json"


def fmt(value, digits=1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def targets(result: dict) -> str:
    """The issue's targets against this run's figures."""
    rows = []

    def row(name, target, value, holds):
        verdict = "-" if value is None else ("yes" if holds else "**no**")
        rows.append(f"| {name} | {target} | {value if value is not None else '-'} | {verdict} |")

    main = result.get("runs", {}).get(result.get("headline_preset"), {})

    def median_of(value, pairs):
        return f"{value} (median of {' / '.join(map(str, pairs))})" if value and pairs else value

    speed = result.get("batching_speedup_32")
    row("batching_speedup_32 (throughput-first)", ">= 12",
        median_of(speed, main.get("batching_speedup_pairs")), speed is not None and speed >= 12)
    app = result.get("app_over_engine_32")
    row("app_over_engine_32 (throughput-first)", ">= 0.9",
        median_of(app, main.get("app_over_engine_pairs")), app is not None and app >= 0.9)
    pairs = result.get("presets_pairs")
    if pairs:  # medians of neighbouring runs' ratios (interleaved presets)
        ratio = result["presets_itl_p95_ratio"]
        row("latency-first ITL p95 / throughput-first's (mixed, 32 users)", "<= 0.8",
            median_of(ratio, pairs["itl_p95_ratio"]), ratio <= 0.8)
        ratio = result["presets_tok_s_ratio"]
        row("throughput-first tok/s / latency-first's (mixed, 32 users)", ">= 1.15",
            median_of(ratio, pairs["tok_s_ratio"]), ratio >= 1.15)
    ceiling = (result.get("ui_ceiling") or {}).get("coalesced")
    if ceiling:
        row(f"app layer ceiling, stand-in engine, {ceiling['sessions']} sessions (tok/s)",
            ">= 20,000", fmt(ceiling["tok_s"], 0), ceiling["tok_s"] >= 20000)
    return "\n".join(["| figure | target | measured | holds |", "| --- | --- | --- | --- |"]
                     + rows) + "\n"


def ceiling_table(result: dict) -> str:
    runs = result.get("ui_ceiling") or {}
    if not runs:
        return ""
    lines = ["| stand-in run | sessions | tok/s | text events/s | tokens per event "
             "| TTFT p50 ms | ITL p50 / p95 ms | server CPU (cores) | clients CPU (cores) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in runs.items():
        lines.append(f"| {name} | {r['sessions']} | {fmt(r['tok_s'], 0)} | "
                     f"{fmt(r['events_per_s'], 0)} | {r['tokens_per_event']} | "
                     f"{fmt(r['ttft_ms']['p50'], 0)} | {fmt(r['itl_ms']['p50'], 0)} / "
                     f"{fmt(r['itl_ms']['p95'], 0)} | {r['server_cpu_share']} | "
                     f"{r['clients_cpu_share']} |")
    return "\n".join(lines) + "\n"


def render(result: dict) -> str:
    lines = ["| preset | path | workload | users | tok/s | req/s | TTFT p50 / p95 ms "
             "| ITL p50 / p95 ms | TPOT p50 ms | E2E p95 ms | peak running |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for preset, runs in result["runs"].items():
        for path in ("engine", "app"):
            for key, r in runs[path].items():
                workload, _, users = key.partition("@")
                users = users or "1 (one at a time)"
                tok_s = fmt(r["tok_s"])
                if "repeats_tok_s" in r:  # the median run of several
                    tok_s += " (median of " + " / ".join(fmt(x) for x in r["repeats_tok_s"]) + ")"
                elif "repeats" in r:  # the presets' interleaved runs
                    tok_s += " (median run; repeats " + "; ".join(
                        f"{fmt(x['tok_s'])} tok/s, ITL p95 {fmt(x['itl_p95_ms'], 0)}"
                        for x in r["repeats"]) + ")"
                lines.append(
                    f"| {preset} | {path} | {workload} | {users} | {tok_s} "
                    f"| {fmt(r['req_s'], 2)} | {fmt(r['ttft_ms']['p50'], 0)} / "
                    f"{fmt(r['ttft_ms']['p95'], 0)} | {fmt(r['itl_ms']['p50'], 0)} / "
                    f"{fmt(r['itl_ms']['p95'], 0)} | {fmt(r['tpot_ms']['p50'], 0)} "
                    f"| {fmt(r['e2e_ms']['p95'], 0)} "
                    f"| {r.get('engine', {}).get('running_max', '-')} |")
    head = {k: v for k, v in result.items()
            if k not in ("runs", "presets", "settings", "ui_ceiling")}
    return (targets(result) + "\n" + "\n".join(lines) + "\n\n" + ceiling_table(result)
            + "\n```json\n" + json.dumps({**head, "presets": result.get("presets")}, indent=2)
            + "\n```\n")


if __name__ == "__main__":
    print(render(json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else DEFAULT).read_text())))
