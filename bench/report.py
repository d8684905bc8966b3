"""Render bench/results/latest.json as the Markdown tables in BENCHMARKS.md.

    .venv/bin/python -m bench.report [bench/results/latest.json]
"""

import json
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parent / "results" / "latest.json"


def fmt(value, digits=1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def render(result: dict) -> str:
    lines = ["| preset | path | workload | users | tok/s | req/s | TTFT p50 / p95 ms "
             "| ITL p50 / p95 ms | TPOT p50 ms | E2E p95 ms | peak running |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for preset, runs in result["runs"].items():
        for path in ("engine", "app"):
            for key, r in runs[path].items():
                workload, _, users = key.partition("@")
                users = users or "1 (one at a time)"
                lines.append(
                    f"| {preset} | {path} | {workload} | {users} | {fmt(r['tok_s'])} "
                    f"| {fmt(r['req_s'], 2)} | {fmt(r['ttft_ms']['p50'], 0)} / "
                    f"{fmt(r['ttft_ms']['p95'], 0)} | {fmt(r['itl_ms']['p50'], 0)} / "
                    f"{fmt(r['itl_ms']['p95'], 0)} | {fmt(r['tpot_ms']['p50'], 0)} "
                    f"| {fmt(r['e2e_ms']['p95'], 0)} "
                    f"| {r.get('engine', {}).get('running_max', '-')} |")
    head = {k: v for k, v in result.items() if k not in ("runs", "presets", "settings")}
    return "\n".join(lines) + "\n\n```json\n" + json.dumps(
        {**head, "presets": result.get("presets")}, indent=2) + "\n```\n"


if __name__ == "__main__":
    print(render(json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else DEFAULT).read_text())))
