"""The command line of `make bench` (bench/run.py): its options, checked before anything
starts, so a mistyped option costs a clear message, not a traceback minutes into a run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.workloads import WORKLOADS


def whole_number(text: str) -> int:
    """An option's value that counts something: a whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is too small: at least 1")
    return value


def report(result: dict, out: str | None) -> None:
    """A bench's result printed as one JSON line, and written to `out` where given."""
    print(json.dumps(result))
    if out:
        with open(out, "w") as written:
            json.dump(result, written, indent=1)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--presets", nargs="*", help="presets to measure (default: those in use)")
    p.add_argument("--paths", nargs="+", default=["engine", "app"],
                   choices=["raw", "engine", "app"],
                   help="raw: vLLM's AsyncLLM straight, the anchor for engine/'s own cost")
    p.add_argument("--levels", type=whole_number, nargs="+", default=[1, 4, 16, 32, 64],
                   help="concurrent users")
    p.add_argument("--workloads", nargs="+", default=["chat", "mixed"],
                   choices=sorted(WORKLOADS), help="engine path workloads")
    p.add_argument("--app-workloads", nargs="+", default=["chat"],
                   choices=sorted(WORKLOADS), help="app path workloads")
    p.add_argument("--app-client-processes", type=whole_number, nargs="+", default=[1],
                   metavar="N", help="the app path's users spread over N client processes "
                   "(bench/app_clients.py), as many browsers would be; with --paired, each "
                   "further N is one more app route (app-Np) in the pairs")
    p.add_argument("--skip-ui-ceiling", action="store_true",
                   help="leave out the stand-in engine run of the app layer")
    p.add_argument("--output-len", type=whole_number, default=64)
    p.add_argument("--name", default="latest",
                   help="results file name in bench/results (without extension)")
    p.add_argument("--mixed-max-users", type=whole_number, default=32,
                   help="highest concurrency level for the mixed workload")
    p.add_argument("--repeats", type=whole_number, default=5,
                   help="runs of the headline level (chat, 32 users); the median is kept")
    p.add_argument("--repeats-other", type=whole_number, default=3,
                   help="the same for the other presets (their app/engine ratio is "
                        "for information)")
    p.add_argument("--preset-repeats", type=whole_number, default=2,
                   help="runs per preset of the mixed workload at the headline level, "
                        "taking turns between the presets")
    p.add_argument("--min-requests", type=whole_number, default=4,
                   help="requests per run at least (low levels would be too noisy)")
    p.add_argument("--long-words", type=whole_number, nargs=2, default=[1200, 1200],
                   metavar=("LOW", "HIGH"),
                   help="the mixed workload's long prompts, in words (~1.16 tokens each)")
    p.add_argument("--paired", type=whole_number, nargs="*", default=None, metavar="LEVEL",
                   help="run the paths side by side at every level, each level's runs in "
                        "neighbouring pairs, --repeats times at these levels (once at the "
                        "others), instead of the CPU plan's 32-user headline runs")
    p.add_argument("--headline-users", type=whole_number, default=32,
                   help="the level where the presets' mixed runs take turns")
    p.add_argument("--ceiling-sessions", type=whole_number, default=64,
                   help="sessions in the app layer's ceiling run (stand-in engine)")
    return p


# What `make bench` measures on a GPU (H200, Qwen3-4B shapes): the levels, reply length and
# long prompts (4-8k tokens) the GPU issue names, every path side by side.
# Sized to finish in about 15 minutes on the H200 (engine starts take 75-100 s each, four of
# them): two repeats at the target levels, the app path on the chat workload.
GPU_DEFAULTS = {"levels": [1, 8, 32, 64, 128, 256], "output_len": 256, "mixed_max_users": 256,
                "long_words": [3500, 6900], "paths": ["raw", "engine", "app"],
                "app_workloads": ["chat"], "paired": [1, 64, 256], "repeats": 2,
                "headline_users": 64, "ceiling_sessions": 256, "preset_repeats": 2,
                # The app path's users in 4 client processes, as browsers are: at 256 users
                # one client process stamped first tokens ~85 ms late (BENCHMARKS.md, issue 31).
                "app_client_processes": [4]}


def parse_args(argv: list[str], config, description: str = "", gpu: bool = False
               ) -> argparse.Namespace:
    """The options in `argv`, checked against each other and against `config`'s presets;
    exits with status 2 and a one-line reason otherwise (argparse's way). `gpu`: the
    defaults are GPU_DEFAULTS."""
    p = parser(description)
    if gpu:
        p.set_defaults(**GPU_DEFAULTS)
    args = p.parse_args(argv)
    known = [preset.name for preset in config.used_presets()]  # those the app can serve
    for name in args.presets or []:
        if name not in known:
            p.error(f"--presets: no profile in {config.source} uses a preset {name!r}; "
                    f"those in use: {', '.join(known)}")
    if args.presets == []:
        p.error("--presets: name at least one preset, or leave the option out")
    if Path(args.name).name != args.name or args.name in (".", ".."):
        p.error(f"--name: {args.name!r} must be a plain file name (results go to bench/results)")
    if args.long_words[0] > args.long_words[1]:
        p.error(f"--long-words {args.long_words[0]} {args.long_words[1]}: LOW above HIGH")
    if "mixed" in args.workloads and not any(lv <= args.mixed_max_users for lv in args.levels):
        p.error(f"--mixed-max-users {args.mixed_max_users}: below every level in --levels, "
                "so the mixed workload would not run at all")
    return args
