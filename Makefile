# The two commands: `make run` (set up, prepare the embedded model, start the app) and
# `make test` (set up, prepare the model, run the test suite). GPU machines: add GPU=1.
VENV    ?= .venv
PY      := $(VENV)/bin/python
HOST    ?= 127.0.0.1
PORT    ?= 8000
GPU     ?= 0
export VCHAT_GPU := $(GPU)

.PHONY: setup model run test screenshots soak bench bench-compare bench-profiles bench-replicas bench-isolation bench-reliability bench-soak conformance lock lock-gpu clean

setup:
	@scripts/setup.sh

model: setup
	@$(PY) -m engine prepare

# One app process (`chainlit run app.py`), or with a GPU several sharing each engine's core
# (launcher.py; VCHAT_FRONT_ENDS).
run: model
	$(PY) -m launcher --host $(HOST) --port $(PORT)

# vLLM's own OpenAI-server test files (tests/test_api_conformance.py runs a few of them) are
# fetched first, into .cache/vllm-tests; without network those tests are skipped.
# Two workers (pytest-xdist): much of a test's time is a server starting or waiting on the
# socket, and the cores are idle for ~40% of a one-process run (BENCHMARKS.md, "Where the
# test suite's time goes"). tests/conftest.py keeps each file, and the files sharing a
# session server, on one worker. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
test: model
	-@$(PY) -m tools.conformance fetch > /dev/null
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The README's pictures, from the browser tests' last run (tests/e2e saves them).
SHOTS := streamed-reply profile-picker history sso-login export-menu attached-document \
  share-link shared-chat admin-invite admin-usage invite-page demo-banner
screenshots:
	@for shot in $(SHOTS); do test -f .cache/e2e/$$shot.png || \
	  { echo "no .cache/e2e/$$shot.png: run the browser tests first (make test)"; exit 1; }; done
	mkdir -p docs/screenshots
	cp $(SHOTS:%=.cache/e2e/%.png) docs/screenshots/

# The soak test at a larger size than `make test` runs (tests/test_app.py), with the shipped
# KV cache (4 GiB): the tests' 1 GiB holds too little of 32 long histories (BENCHMARKS.md).
SOAK_TURNS ?= 1000
soak: model
	VCHAT_KV_CACHE_GIB=4 $(PY) -m pytest tests/test_app.py -k soak -s --soak-turns $(SOAK_TURNS)

# Batching and presets on the engine and app paths; writes bench/results/latest.{json,png}.
bench: model
	$(PY) -m bench.run $(BENCH_ARGS)

# The app's API against vLLM's own OpenAI server and its chat path against the usual
# Chainlit + vLLM app (bench/serve_compare.py); writes bench/results/serve-compare-cpu.json.
bench-compare: model
	$(PY) -m bench.serve_compare $(COMPARE_ARGS)

# Both profiles at once through the app (bench/profiles.py), at the size of a small CPU
# machine; on a GPU: PROFILES_ARGS="--out bench/results/profiles-gpu.json" (its full size).
PROFILES_ARGS ?= --cpu-scale --pairs 2 --out bench/results/profiles-cpu.json
bench-profiles: model
	$(PY) -m bench.profiles $(PROFILES_ARGS)

# Two app replicas against one behind the shipped proxy (bench/replicas.py; needs Debian's
# postgresql and haproxy); writes bench/results/replicas-cpu.json.
REPLICAS_ARGS ?= --users 32 --seconds 60 --pairs 4 --out bench/results/replicas-cpu.json
bench-replicas: model
	$(PY) -m bench.replicas $(REPLICAS_ARGS)

# Other users' streams while a long prompt is read, the pieces it is cut into side by side,
# and one account's burst beside chat users (bench/isolation.py, issue 53), at CPU scale;
# on a GPU: scripts/gpu_run.sh OUT isolation (its docstring has the full-size arguments).
ISOLATION_ARGS ?= --plan cpu heavy --users 4 --long-tokens 1800 --variants none 128/256 \
	--chosen 128/256 --reply 64 --quiet-s 4 --probe-tokens 32 --probe-every-s 1 --repeats 2 \
	--chat-users 4 --heavy 60 --heavy-s 8 --out bench/results/isolation-cpu.json
bench-isolation: model
	$(PY) -m bench.isolation $(ISOLATION_ARGS)
	$(PY) -m bench.isolation --report bench/results/isolation-cpu.json \
		--out bench/results/isolation-cpu.json --png bench/results/isolation-cpu.png

# Crashes under load (bench/reliability.py, issue 57): a front end, then the engine core,
# killed while users stream; at CPU scale (2 front ends); on a GPU: scripts/gpu_run.sh OUT
# reliability (256 users, the shipped front ends).
RELIABILITY_ARGS ?= --users 8 --output-len 400 --front-ends 2 --name reliability-cpu
bench-reliability: model
	$(PY) -m bench.reliability $(RELIABILITY_ARGS)

# Mixed traffic sampled every minute (bench/soak.py, issue 57): memory, loop lag, TTFT and
# gaps over the run; at CPU scale for 10 minutes; on a GPU: scripts/gpu_run.sh OUT soak.
SOAK_ARGS ?= --minutes 10 --chat-users 6 --api-users 2 --guest-every-s 30 --front-ends 2 \
	--max-tokens 64 --name soak-cpu
bench-soak: model
	$(PY) -m bench.soak $(SOAK_ARGS)

# vLLM 0.32.0's own OpenAI-server tests (18 files of tests/entrypoints/openai/, fetched from
# its source package into .cache/vllm-tests) against the app (tools/conformance.py, issue 54);
# CONFORMANCE_TARGET=vllm runs them against vLLM's own server with the same model (the
# baseline). Writes bench/results/conformance-cpu.json (conformance-vllm-cpu.json).
CONFORMANCE_TARGET ?= app
conformance: model
	$(PY) -m tools.conformance run --target $(CONFORMANCE_TARGET) $(CONFORMANCE_ARGS)

# Recompile the pinned requirements.txt from requirements.in (needs the CPU torch wheel
# where uv can see it: a local folder via FIND_LINKS, or PyTorch's CPU index).
FIND_LINKS ?= /opt/wheels
lock: setup
	$(VENV)/bin/uv pip compile requirements.in --override overrides.txt \
	  --python $(PY) --find-links $(FIND_LINKS) --custom-compile-command "make lock" \
	  -o requirements.txt

# The GPU lock: resolved for Linux x86_64 with CUDA wheels from PyPI (no GPU needed here).
lock-gpu: setup
	$(VENV)/bin/uv pip compile requirements-gpu.in --override overrides.txt \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	  --custom-compile-command "make lock-gpu" -o requirements-gpu.txt

clean:
	rm -rf $(VENV) .pytest_cache
