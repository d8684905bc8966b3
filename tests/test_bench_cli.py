"""`make bench`'s command line refuses bad options at once, with a reason and no traceback.

Before bench/cli.py, `--repeats 0` ran for minutes and then failed on an empty list, and a
misspelt `--presets` name ended in a KeyError traceback.
"""

import os
import sys

import pytest

from bench.cli import parse_args
from tools.chainlit_client import side_by_side


def refused(config, capsys, *argv) -> str:
    with pytest.raises(SystemExit) as stop:
        parse_args(list(argv), config)
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_defaults_are_what_make_bench_runs(config):
    args = parse_args([], config)
    assert args.presets is None and args.paths == ["engine", "app"]
    assert args.levels == [1, 4, 16, 32, 64] and args.repeats == 5 and args.name == "latest"
    args = parse_args(["--presets", "latency-first", "--levels", "1", "4", "--name", "smoke"],
                      config)
    assert args.presets == ["latency-first"] and args.levels == [1, 4]
    assert args.paired is None  # the CPU plan: the 32-user headline runs


def test_on_a_gpu_the_defaults_are_the_gpu_issues_levels_and_paired_paths(config):
    args = parse_args([], config, gpu=True)
    assert args.levels == [1, 8, 32, 64, 128, 256] and args.output_len == 256
    assert args.paths == ["raw", "engine", "app"] and args.paired == [1, 64, 256]
    assert args.long_words == [3500, 6900] and args.ceiling_sessions == 256
    assert args.app_client_processes == [4]  # the app path's users as browsers are
    assert parse_args(["--repeats", "4"], config, gpu=True).repeats == 4  # options still win


@pytest.mark.parametrize("argv, words", [
    (["--repeats", "0"], "--repeats: 0 is too small: at least 1"),
    (["--preset-repeats", "-1"], "--preset-repeats: -1 is too small"),
    (["--levels", "4", "many"], "--levels: 'many' is not a whole number"),
    (["--output-len", "0"], "--output-len: 0 is too small"),
    (["--presets", "fast"], "preset 'fast'; those in use: latency-first, throughput-first"),
    (["--presets"], "name at least one preset"),
    (["--name", "../elsewhere"], "must be a plain file name"),
    (["--levels", "64", "--mixed-max-users", "8"], "the mixed workload would not run"),
    (["--long-words", "900", "100"], "--long-words 900 100: LOW above HIGH"),
    (["--paths", "gpu"], "invalid choice: 'gpu'"),
])
def test_bad_options_are_refused_with_the_reason(config, capsys, argv, words):
    assert words in refused(config, capsys, *argv)


def test_the_real_commands_fail_cleanly(tmp_path):
    """The entry point `make bench` calls (a bad option, a missing profiles file), and
    bench/engine_speed.py's (an unknown preset) and bench/ui_ceiling.py's (no sessions)."""
    bench = [sys.executable, "-m"]
    # Side by side: each spends ~15 s importing vLLM before it refuses.
    bad_option, no_preset, no_sessions, no_file = side_by_side(
        (bench + ["bench.run", "--levels", "0"], os.environ),
        (bench + ["bench.engine_speed", "--preset", "x"], os.environ),
        (bench + ["bench.ui_ceiling", "--sessions", "0"], os.environ),
        (bench + ["bench.run"], {**os.environ, "VCHAT_PROFILES": str(tmp_path / "none.yaml")}))
    for done in (bad_option, no_file, no_preset, no_sessions):
        assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--levels: 0 is too small" in bad_option.stderr
    assert "error:" in no_file.stderr and "none.yaml" in no_file.stderr
    assert no_preset.returncode == 2 and "no preset 'x'" in no_preset.stderr
    assert no_sessions.returncode == 2 and "--sessions: 0 is too small" in no_sessions.stderr


def test_the_profiles_bench_scales_down_for_a_cpu_and_refuses_bad_options(capsys):
    """bench/profiles.py (make bench-profiles): --cpu-scale sizes the phases for 2 cores
    unless an option says otherwise; a bad option stops it before a server starts."""
    from bench import profiles

    gpu = profiles.parse_args([])
    assert (gpu.sessions, gpu.load, gpu.load_reply, gpu.long_tokens) == (16, 240, 2048,
                                                                         [4000, 8000])
    cpu = profiles.parse_args(["--cpu-scale", "--load", "20"])
    assert cpu.load == 20, "an option given wins over the CPU size"
    assert (cpu.sessions, cpu.load_reply) == (profiles.CPU_SCALE["sessions"],
                                              profiles.CPU_SCALE["load_reply"])
    for argv, words in ((["--long-tokens", "900", "800"], "the least must not be above"),
                        (["--out", "x.txt"], "must be a .json path"),
                        (["--phases", "sometimes"], "invalid choice"),
                        (["--variant", "fastest"], "invalid choice")):
        with pytest.raises(SystemExit) as stop:
            profiles.parse_args(argv)
        assert stop.value.code == 2 and words in capsys.readouterr().err


def test_the_profiles_figures_merge_a_rerun_phase_and_check_the_targets():
    """bench/profile_figures.py: a later run's phases replace an earlier one's for the same
    layout; each target is the median over the pairs, judged by its direction."""
    from bench.profile_figures import holds, merged

    def probes(tok_s, ttft, gap):
        return {"Latency-first": {"tok_s_median": tok_s, "ttft_p95_s": ttft, "gap_p95_s": gap}}

    first = {"label": "shared", "engines": "shared", "source": "a.json",
             "light": [{"ratio": r} for r in (0.9, 0.95, 0.8)],
             "saturated": [{"both": {"probes": probes(10, 9, 9)}, "total_ratio": 0.1}]}
    again = {"label": "shared", "engines": "shared", "source": "b.json",
             "saturated": [{"both": {"probes": probes(t, 0.2, 0.05)}, "total_ratio": r}
                           for t, r in ((90, 0.7), (110, 0.9), (105, 1.2))],
             "saturated_preempted": 0}
    run = merged([first, again])["shared"]
    assert run["from"] == {"light": "a.json", "saturated": "b.json",
                           "saturated_preempted": "b.json"}
    def got(start):
        return next(t["measured"] for t in run["targets"] if t["name"].startswith(start))

    assert got("light:") == 0.9
    assert got("saturated: Latency-first tok/s") == 105
    assert got("saturated: total tok/s") == 0.9
    assert all(holds(t) for t in run["targets"] if t["measured"] is not None)
    assert got("long prompts:") is None  # not run


def test_a_histograms_quantile_between_two_scrapes_counts_only_what_grew():
    """bench/profiles.py reads the app's loop lag and engine TTFT from /metrics: the
    quantile of the observations made between two scrapes, as a bucket's upper bound."""
    from bench.profile_figures import bucket_quantile
    before = {0.01: 90.0, 0.1: 100.0, 1.0: 100.0, float("inf"): 100.0}
    after = {0.01: 95.0, 0.1: 180.0, 1.0: 199.0, float("inf"): 200.0}  # 100 more: 5, 80, 14, 1
    assert bucket_quantile(before, after, 0.5) == 0.1
    assert bucket_quantile(before, after, 0.95) == 1.0
    assert bucket_quantile(before, after, 0.999) == float("inf")
    assert bucket_quantile(after, after) is None  # nothing observed meanwhile


def test_latency_first_first_token_legs_are_read_between_two_scrapes():
    """bench/profiles.py's legs of Latency-first's engine TTFT: from the app's /metrics
    text, only Latency-first's series, and only the turns that finished in between."""
    from bench.profiles import LEGS, LF, add_leg, legs_between

    def scrape(count: float, total: float, under_10ms: float) -> dict:
        legs: dict = {}
        for profile, scale in ((LF, 1), ("Throughput-first", 100)):
            for line in (f'{LEGS}_bucket{{leg="queued",le="0.01",profile="{profile}"}} '
                         f'{under_10ms}',
                         f'{LEGS}_bucket{{leg="queued",le="0.1",profile="{profile}"}} {count}',
                         f'{LEGS}_bucket{{leg="queued",le="+Inf",profile="{profile}"}} {count}',
                         f'{LEGS}_count{{leg="queued",profile="{profile}"}} {count}',
                         f'{LEGS}_sum{{leg="queued",profile="{profile}"}} {total * scale}',
                         f'{LEGS}_created{{leg="queued",profile="{profile}"}} 1.7e9'):
                add_leg(legs, line)
        return legs

    before, after = scrape(10, 0.1, 10), scrape(20, 0.5, 10)  # 10 more turns, 40 ms each
    assert legs_between(before, after) == {"queued": {"mean_s": 0.04, "p95_s": 0.1}}
    assert legs_between(after, after) == {}


def test_the_profiles_figures_pool_a_phases_pairs_across_runs_when_asked():
    """bench/profile_figures.py --pool saturated: the saturated pairs of every run of the
    layout count (two runs of the same code on two machines), and their preemptions add
    up; the phases not pooled still come from the last run that has them."""
    from bench.profile_figures import merged

    def pair(ttft):
        return {"both": {"probes": {"Latency-first": {"tok_s_median": 100, "ttft_p95_s": ttft,
                                                      "gap_p95_s": 0.05}}},
                "total_ratio": 0.9}

    runs = [{"label": "shared", "engines": "shared", "source": "h.json",
             "light": [{"ratio": 0.9}], "saturated": [pair(t) for t in (1.36, 0.71, 0.49)],
             "saturated_preempted": 2},
            {"label": "shared", "engines": "shared", "source": "i.json",
             "light": [{"ratio": 0.5}], "saturated": [pair(t) for t in (0.14, 0.25, 0.44)],
             "saturated_preempted": 0}]
    pooled = merged(runs, ("saturated",))["shared"]
    ttft = next(t for t in pooled["targets"] if t["name"].startswith("saturated: Latency-first "
                                                                     "TTFT"))
    assert ttft["measured"] == 0.465  # the median of the 6 pairs; the last run alone: 0.25
    assert len(pooled["saturated"]) == 6 and pooled["saturated_preempted"] == 2
    assert pooled["from"]["saturated"] == ["h.json", "i.json"]
    assert pooled["light"] == [{"ratio": 0.5}] and pooled["from"]["light"] == "i.json"
    assert merged(runs)["shared"]["saturated_preempted"] == 0  # not pooled: the last run's


def test_the_rooms_engine_path_samples_as_the_guests_turns_do(config):
    """bench.room's engine path is the same load as the app's: its requests go in the
    invite's profile's class and sample with its temperature and top_p (top-p costs the
    engine each step: with 16 seats on 2 CPU cores, top_p 0.9 ran at 0.64x the benches'
    top_p 1; BENCHMARKS.md), and an empty profile (an invite for any) is the guests'
    default one."""
    from bench.room import guests_class, guests_sampling, parse
    from engine import Engines

    pool = Engines(config)  # not started: its figures only
    for profile in config.profiles:
        assert guests_sampling(config, profile.name) == {
            "temperature": profile.sampling.temperature, "top_p": profile.sampling.top_p}
        # In the class the app sends its turns in (the shared engine's priority).
        assert guests_class(pool, profile.name) == {
            "priority": config.presets[profile.preset].priority}
    assert guests_class(pool, "Throughput-first") == {"priority": 1}
    assert guests_class(pool, "") == guests_class(pool, config.default_profile.name)
    assert guests_sampling(config, "") == guests_sampling(config, config.default_profile.name)
    assert parse([]).engine_repeats == 1 and parse(["--engine-repeats", "3"]).engine_repeats == 3


def test_the_returning_bench_sets_the_kv_block_size_and_dtype_for_every_engine_when_asked():
    """bench.returning --block-size and --kv-cache-dtype: the profiles it runs on give vLLM
    that KV block size and dtype (what a returning chat's history loads back as), checked
    by the app's own loader; without them vLLM chooses."""
    import yaml

    from bench.returning import parse, profiles_with
    from engine import load_config

    path = profiles_with(32.0, 0.3, 64)
    raw = yaml.safe_load(path.read_text())
    assert raw["vllm"]["block_size"] == 64 and raw["memory"]["cpu_offload_gib"] == 32.0
    assert load_config(path, env={}).vllm["block_size"] == 64
    assert "block_size" not in (yaml.safe_load(profiles_with(0.0, None).read_text())
                                .get("vllm") or {})
    assert parse(["--block-size", "64"]).block_size == 64 and parse([]).block_size == 0
    fp8 = profiles_with(32.0, 0.3, kv_cache_dtype="fp8")
    assert load_config(fp8, env={}).vllm["kv_cache_dtype"] == "fp8"
    assert parse(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert parse([]).kv_cache_dtype is None
