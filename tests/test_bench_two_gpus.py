"""bench/two_gpus.py (issue 18) on a machine without two GPUs: the layouts it would start,
its figures and its command line. The measurement itself needs the nvidia-h200-x2 kind."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench import two_gpus
from engine import load_config
from engine.launch import Machine, engine_setup

ROOT = Path(__file__).resolve().parent.parent
TWO_GPUS = Machine(gpu=True, cores=32, gpus=2)


def placed(what: str):
    config = load_config(two_gpus.layout_profiles(ROOT / "profiles.yaml", what), env={})
    return config, {p.name: engine_setup(config, p, "/m", TWO_GPUS, env={})
                    for p in config.used_presets()}


def without_placement(setup) -> dict:
    return {k: v for k, v in setup.args.items() if k != "data_parallel_size"}


def test_the_placement_layouts_differ_in_their_gpus_only():
    config, setups = placed("placement")
    assert {name: s.env["CUDA_VISIBLE_DEVICES"] for name, s in setups.items()} == {
        "shared-latency": "0", "shared-throughput": "0", "own-latency": "0",
        "own-throughput": "1"}
    for part in ("latency", "throughput"):
        assert setups[f"shared-{part}"].args == setups[f"own-{part}"].args
    shipped = load_config(ROOT / "profiles.yaml", env={})
    ours = engine_setup(shipped, shipped.presets["latency-first"], "/m", TWO_GPUS, env={})
    assert {k: v for k, v in setups["own-latency"].args.items()
            if k != "gpu_memory_utilization"} == {
        k: v for k, v in ours.args.items() if k != "gpu_memory_utilization"}
    # Every engine has the same memory, and those all on GPU 0 fit it together.
    assert len({s.args["gpu_memory_utilization"] for s in setups.values()}) == 1
    assert sum(p.memory_share for p in config.used_presets() if 0 in config.gpus_of(p)) <= 1


def test_the_data_parallel_layout_is_one_preset_on_one_gpu_and_on_two():
    config, setups = placed("data-parallel")
    one, two = setups["one-gpu"], setups["two-gpus"]
    assert (one.env["CUDA_VISIBLE_DEVICES"], two.env["CUDA_VISIBLE_DEVICES"]) == ("0", "0,1")
    assert two.args["data_parallel_size"] == 2 and "data_parallel_size" not in one.args
    assert without_placement(one) == without_placement(two)


def test_figures_are_medians_of_neighbouring_pairs():
    def run(itl_p95=None, tok_s=None, ttft_p95=None):
        return {"itl_ms": {"p95": itl_p95}, "tok_s": tok_s, "ttft_ms": {"p95": ttft_p95}}

    def pair(shared, own):  # (alone, busy) gap p95s of each layout
        return {"shared": {"alone": run(shared[0]), "busy": run(shared[1])},
                "own": {"alone": run(own[0]), "busy": run(own[1])}}

    pairs = [pair((10, 15), (10, 10)), pair((10, 30), (8, 10)), pair((10, 20), (10, 9))]
    figures = two_gpus.placement_figures(pairs)
    assert figures["shared"] == {"itl_p95_growth": [1.5, 3.0, 2.0], "itl_p95_growth_median": 2.0}
    assert figures["own"]["itl_p95_growth_median"] == 1.0
    dp = two_gpus.data_parallel_figures({256: [
        {"one-gpu": run(tok_s=100, ttft_p95=50), "two-gpus": run(tok_s=190, ttft_p95=40)},
        {"one-gpu": run(tok_s=100, ttft_p95=50), "two-gpus": run(tok_s=170, ttft_p95=50)},
        {"one-gpu": run(tok_s=100, ttft_p95=50), "two-gpus": run(tok_s=185, ttft_p95=45)}]})
    assert dp == {"256": {"tok_s_ratio": [1.9, 1.7, 1.85], "tok_s_ratio_median": 1.85,
                          "ttft_p95_ratio": [0.8, 1.0, 0.9], "ttft_p95_ratio_median": 0.9,
                          "pair_count": 3}}


@pytest.mark.parametrize("argv, words", [
    (["placement", "--pairs", "0"], "--pairs: 0 is too small"),
    (["data-parallel", "--levels", "many"], "'many' is not a whole number"),
    (["placement", "--name", "../elsewhere"], "must be a plain file name"),
    (["both"], "invalid choice: 'both'"),
])
def test_bad_options_are_refused_with_the_reason(capsys, argv, words):
    with pytest.raises(SystemExit) as stop:
        two_gpus.parse_args(argv)
    assert stop.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.skipif(Machine.here().gpus >= 2, reason="this machine has two GPUs")
def test_without_two_gpus_it_says_so_and_starts_nothing():
    done = subprocess.run([sys.executable, "-m", "bench.two_gpus", "placement"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "error: bench.two_gpus needs two GPUs; this machine has" in done.stderr
    assert "Traceback" not in done.stderr and "Engine" not in done.stderr
