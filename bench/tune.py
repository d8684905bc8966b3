"""Tuning one preset's scheduler values on this machine: variants of the preset side by side
on the mixed workload (engine path), taking turns, as latency-first's GPU values were chosen
(BENCHMARKS.md, "GPU (H200)").

Each variant becomes a preset of its own in a copy of profiles.yaml (this device's section,
`vllm_gpu` or `vllm_cpu`, changed as given) with a profile that uses it; bench.run then runs
the mixed workload at --users once per variant and --repeats more times in turns (A B C,
C B A, ...). Prints a table and the pick: the lowest inter-token p95 among the variants whose
time-to-first-token p95 stays within --ttft-ms (else the lowest time-to-first-token p95).
--apply writes the pick's values into profiles.yaml.

    .venv/bin/python -m bench.tune --users 64 \
        --variant max_num_batched_tokens=512,long_prefill_token_threshold=384 \
        --variant max_num_batched_tokens=384,long_prefill_token_threshold=256
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bench.cli import whole_number
from engine.launch import has_cuda
from engine.settings import setting

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def variant(text: str) -> dict[str, int]:
    """`key=value,key=value`: whole-number vLLM scheduler arguments."""
    values = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected key=whole number, e.g. max_num_batched_tokens=512")
        values[key.strip()] = int(value)
    return values


def label(values: dict[str, int]) -> str:
    short = {"max_num_batched_tokens": "tok", "max_num_seqs": "seqs",
             "long_prefill_token_threshold": "piece"}
    return "-".join(f"{short.get(k, k)}{v}" for k, v in values.items())


def variants_file(source: Path, preset: str, device: str, variants: list[dict]) -> Path:
    """A profiles file with one preset (and one profile) per variant, sharing the memory."""
    raw = yaml.safe_load(source.read_text())
    base = raw["presets"][preset]
    profile = next(p for p in raw["profiles"] if p["preset"] == preset)
    raw["presets"], raw["profiles"] = {}, []
    for values in variants:
        name = f"{preset}@{label(values)}"
        raw["presets"][name] = {**base, "memory_share": round(1 / len(variants), 4),
                                device: {**(base.get(device) or {}), **values}}
        raw["profiles"].append({**profile, "name": name, "preset": name, "default": False})
    out = Path(tempfile.mkdtemp()) / "profiles.yaml"
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def pick(figures: dict[str, dict], ttft_ms: float) -> str:
    within = [n for n, f in figures.items() if f["ttft_p95_ms"] <= ttft_ms]
    if within:
        return min(within, key=lambda n: (figures[n]["itl_p95_ms"], -figures[n]["tok_s"]))
    return min(figures, key=lambda n: figures[n]["ttft_p95_ms"])


def apply(path: Path, preset: str, device: str, values: dict[str, int]) -> None:
    """Set `values` in `preset`'s `device:` block of the profiles file, keeping its comments
    and layout; every key must be in that block already."""
    lines = path.read_text().splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.rstrip() == f"  {preset}:")
    block = next(i for i in range(start + 1, len(lines)) if lines[i].rstrip() == f"    {device}:")
    for key, value in values.items():
        for i in range(block + 1, len(lines)):
            if not lines[i].startswith("      ") and lines[i].strip() and \
                    not lines[i].lstrip().startswith("#"):
                raise SystemExit(f"error: {key} is not in {preset}.{device} of {path}")
            m = re.match(rf"(\s+{key}:\s*)\S+(.*)", lines[i], re.S)
            if m:
                lines[i] = f"{m.group(1)}{value}{m.group(2)}"
                break
    path.write_text("".join(lines))


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="latency-first")
    p.add_argument("--variant", type=variant, action="append", required=True,
                   help="scheduler values of one variant (two at least)")
    p.add_argument("--users", type=whole_number, default=64)
    p.add_argument("--repeats", type=whole_number, default=2, help="turns after the first run")
    p.add_argument("--output-len", type=whole_number, default=256)
    p.add_argument("--long-words", type=whole_number, nargs=2, default=[3500, 6900])
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--name", default="tune")
    p.add_argument("--apply", action="store_true", help="write the pick into profiles.yaml")
    args = p.parse_args(argv)
    if len(args.variant) < 2:
        p.error("--variant: give two or more")
    source = Path(setting("VCHAT_PROFILES") or ROOT / "profiles.yaml")
    device = "vllm_gpu" if has_cuda() else "vllm_cpu"
    profiles = variants_file(source, args.preset, device, args.variant)
    names = [f"{args.preset}@{label(v)}" for v in args.variant]
    subprocess.run(
        [sys.executable, "-m", "bench.run", "--presets", *names, "--paths", "engine",
         "--workloads", "mixed", "--levels", str(args.users), "--paired", "--repeats", "1",
         "--preset-repeats", str(args.repeats), "--headline-users", str(args.users),
         "--mixed-max-users", str(args.users), "--output-len", str(args.output_len),
         "--long-words", *map(str, args.long_words), "--skip-ui-ceiling", "--name", args.name],
        check=True, env={**os.environ, "VCHAT_PROFILES": str(profiles)})
    result = json.loads((RESULTS / f"{args.name}.json").read_text())
    figures = result["presets"]
    print(f"\n{args.preset} on {device}, mixed workload at {args.users} users "
          f"(medians of {args.repeats} runs in turns):")
    print(f"{'variant':<40} {'tok/s':>8} {'TTFT p50/p95 ms':>18} {'ITL p50/p95 ms':>16}")
    for name in names:
        f = figures[name]
        print(f"{name:<40} {f['tok_s']:>8.0f} {f['ttft_p50_ms']:>8.0f} / {f['ttft_p95_ms']:<7.0f}"
              f" {f['itl_p50_ms']:>6.1f} / {f['itl_p95_ms']:<6.1f}")
    chosen = pick(figures, args.ttft_ms)
    values = args.variant[names.index(chosen)]
    result["tune"] = {"preset": args.preset, "device": device, "variants": args.variant,
                      "pick": values, "ttft_ms_limit": args.ttft_ms}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    why = (f"the lowest ITL p95 with TTFT p95 <= {args.ttft_ms:.0f} ms"
           if figures[chosen]["ttft_p95_ms"] <= args.ttft_ms else
           f"none keeps TTFT p95 <= {args.ttft_ms:.0f} ms: the lowest TTFT p95")
    print(f"pick: {chosen} ({why})")
    if args.apply:
        apply(source, args.preset, device, values)
        print(f"written into {source}")


if __name__ == "__main__":
    main(sys.argv[1:])
