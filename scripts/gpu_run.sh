#!/bin/bash
# The product's steps on the H200 machine (no package registry there): unpack the bundles
# that scripts/gpu_bundle.sh built into .gpu/, then run the named steps, writing what they
# produce into OUT. Run from the repository root:
#   scripts/gpu_run.sh OUT tests [PYTEST ARGS...]  the test suite on the GPU (tiny Qwen3)
#   scripts/gpu_run.sh OUT bench [BENCH ARGS...]   make bench's runs, dummy Qwen3-4B weights
#   scripts/gpu_run.sh OUT speed [ARGS...]         bench.engine_speed, dummy Qwen3-4B
#   scripts/gpu_run.sh OUT tune [ARGS...]          bench.tune (preset variants side by side)
#   scripts/gpu_run.sh OUT compare [ARGS...]       bench.serve_compare (the app against vLLM's
#                                                  server and the usual Chainlit app, ~5 min)
#   scripts/gpu_run.sh OUT big-request [ARGS...]   bench.big_request on the shipped engines
#   scripts/gpu_run.sh OUT documents [ARGS...]     bench.documents (a long document in the
#                                                  chat beside streaming users)
#   scripts/gpu_run.sh OUT isolation [ARGS...]     bench.isolation (a long prompt beside
#                                                  streams) on the shipped shared engine
#   scripts/gpu_run.sh OUT returning [ARGS...]     bench.returning (returning chats with and
#                                                  without KV offloading to CPU memory)
#   scripts/gpu_run.sh OUT link [ARGS...]          bench.link (the host-to-GPU link's
#                                                  speed, pinned and pageable)
#   scripts/gpu_run.sh OUT room [ARGS...]          bench.room (1,000 guests join by one
#                                                  invite link and ask at once)
#   scripts/gpu_run.sh OUT reliability [ARGS...]   bench.reliability (a front end, then the
#                                                  core, killed under 256 streams)
#   scripts/gpu_run.sh OUT soak [ARGS...]          bench.soak (mixed traffic, sampled each
#                                                  minute; --minutes 8 fits a call)
#   scripts/gpu_run.sh OUT two-gpus placement|data-parallel [ARGS...]
#                                                  bench.two_gpus (nvidia-h200-x2 only)
#   scripts/gpu_run.sh DIR bench-start [ARGS...]   bench in the background (a copy of the
#                                                  checkout, its own session), into DIR
#   scripts/gpu_run.sh DIR profiles-start LAYOUT... [-- ARGS]
#                                                  bench.profiles (both profiles at once
#                                                  through the app) for each engine layout
#                                                  (shared, per-preset), in the background
#   scripts/gpu_run.sh OUT wait DIR [SECONDS]      wait for that bench; copy DIR into OUT
#   scripts/gpu_run.sh OUT profiles LAYOUT [ARGS]  one layout in the foreground (fits a call)
# With STACK_SAMPLES=DIR/stacks:START_S:STOP_S set, the app's process samples its own
# stacks (tools/stack_sampler.py): where its event loop's time goes, under load.
# Through the device tool: run(command="scripts/gpu_run.sh $OUT tests", carry=[".gpu"]).
# A bench (~15 min) outlasts one device call (10 min): bench-start it, then `wait` in the
# next calls while the machine is still warm.
set -uo pipefail
out=${1:?usage: scripts/gpu_run.sh OUT STEP [ARGS...]}; step=${2:?STEP: tests, bench or speed}
shift 2
mkdir -p "$out" /tmp/site
if [ ! -f /tmp/site/.unpacked ]; then  # once per machine: ~5 s
  # Without the app's bundle (a transfer holds 64 MiB with the checkout), .gpu/eng.tar.xz:
  # Qwen's tokenizer alone (qwen_tokenizer* out of app.tar.xz), for the engine's benches.
  for bundle in .gpu/site.tar.xz .gpu/app.tar.xz; do
    [ -f "$bundle" ] || bundle=.gpu/eng.tar.xz
    xz -dc "$bundle" | tar -x -C /tmp/site || exit 1
  done
  touch /tmp/site/.unpacked
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# flashinfer does not travel; NVLink multicast stays off on these shared machines.
export VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
export VCHAT_CACHE_DIR=/tmp/vchat-cache
# STACK_SAMPLES=OUT/stacks:START_S:STOP_S: the app's main thread sampled in that window
# of its life (tools/stack_sampler.py), written to OUT/stacks.main.PID (vLLM's engine process,
# spawned with the app's command line: stacks.spawned.PID); no profiler can be installed there.
if [ -n "${STACK_SAMPLES:-}" ]; then
  echo "from tools.stack_sampler import from_env; from_env()" > /tmp/site/sitecustomize.py
else
  rm -f /tmp/site/sitecustomize.py
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import sys, torch, vllm, chainlit; print(sys.version.split()[0], "torch", torch.__version__, "vllm", vllm.__version__, "chainlit", chainlit.__version__ if hasattr(chainlit, "__version__") else "")'
} 2>&1 | tee "$out/versions.txt"
case "$step" in
  tests)  # the tiny Qwen3 checkpoint (2 layers, Qwen's tokenizer): every test's engine.
    # Deselected: the conversion of the embedded CPU model, whose package (94 MB) does not fit
    # a transfer; on a GPU `auto` is Qwen3-4B, tested by test_model's GPU case.
    tiny=$(python3 -m tools.tiny_qwen3 "$VCHAT_CACHE_DIR/tiny-qwen3" | tail -1)
    # Each failure is written to failures.log as it happens (the call may be cut short).
    VCHAT_MODEL=$tiny VCHAT_GPU_MEMORY=${VCHAT_GPU_MEMORY:-0.2} VCHAT_FAILURE_LOG=$out/failures.log \
      python3 -m pytest -p no:cacheprovider -ra \
        --deselect tests/test_model.py::test_embedded_model_is_converted_once_and_then_reused \
        --deselect tests/test_model.py::test_interrupted_or_outdated_preparation_is_redone \
        "$@" 2>&1 | tee "$out/tests.log" ;;
  bench)
    VCHAT_MODEL=qwen3-4b-dummy python3 -m bench.run --name gpu-h200 "$@" 2>&1 | tee "$out/bench.log" \
      | grep -v '^\s*$' | tail -5
    # This run's results only (bench/results holds every earlier run's: too many files for
    # one call's transfer, which then leaves the newest out).
    find bench/results -name 'gpu-h200*' -newer "$out/versions.txt" -exec cp {} "$out/" \;
    # The app server's turn log: where each run's first tokens went (tools/turn_log.py);
    # TURN_RUNS=N: one summary for every N turns (the users of one run).
    for log in .cache/server-*.log; do
      [ -f "$log" ] && python3 -m tools.turn_log "$log" --each "${TURN_RUNS:-256}" \
        >> "$out/turns.jsonl"
    done; true ;;
  bench-start)
    rm -rf /tmp/bench-checkout && cp -r . /tmp/bench-checkout && cd /tmp/bench-checkout \
      && setsid nohup bash -c "scripts/gpu_run.sh '$out' bench $*; touch '$out/done'" \
        > "$out/bench-start.log" 2>&1 < /dev/null &
    echo "bench started in the background: scripts/gpu_run.sh OUT wait $out" ;;
  profiles-start)  # the shipped app: compiled, the file's context and memory
    # LAYOUT: shared, per-preset, or ENGINES:VARIANT (bench.profiles --variant), in turn.
    layouts=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do layouts+=("$1"); shift; done
    [ "${1:-}" = "--" ] && shift
    rm -rf /tmp/bench-checkout && cp -r . /tmp/bench-checkout && cd /tmp/bench-checkout \
      && setsid nohup bash -c "for l in ${layouts[*]}; do e=\${l%%:*}; v=\${l#\$e}; \
        VCHAT_MODEL=qwen3-4b-dummy python3 -m bench.profiles --engines \$e \
        \${v:+--variant \${v#:}} --out '$out'/gpu-h200-profiles-\${l/:/-}.json \
        --log '$out'/server-\${l/:/-}.log $* 2>&1 | grep -v 'Unclosed\|client_session'; \
        done >> '$out/bench.log'; touch '$out/done'" > "$out/bench-start.log" 2>&1 < /dev/null &
    echo "profiles bench started in the background: scripts/gpu_run.sh OUT wait $out" ;;
  profiles)  # bench.profiles for one LAYOUT in the foreground: on 2026-12-03 a background
    # start did not outlive its call (its folder was gone in the next call on the same
    # machine), so a run that fits one call (10 min) is made in it.
    layout=${1:?profiles LAYOUT [ARGS]}; shift; e=${layout%%:*}; v=${layout#"$e"}
    VCHAT_MODEL=qwen3-4b-dummy python3 -m bench.profiles --engines "$e" ${v:+--variant "${v#:}"} \
      --out "$out/gpu-h200-profiles-${layout/:/-}.json" --log "$out/server-${layout/:/-}.log" \
      "$@" 2>&1 | grep -v 'Unclosed\|client_session' | tee "$out/bench.log" | tail -c 6000 ;;
  wait)
    dir=${1:?wait DIR [SECONDS]}; limit=${2:-540}; waited=0
    while [ ! -f "$dir/done" ] && [ "$waited" -lt "$limit" ]; do sleep 5; waited=$((waited + 5)); done
    [ -f "$dir/done" ] && echo "bench finished" || echo "bench still running after ${waited} s"
    tail -c 3000 "$dir/bench.log"
    cp "$dir"/gpu-h200* "$dir"/bench.log "$dir"/stacks.* "$out/" 2>/dev/null
    [ -f "$dir/done" ] && cp "$dir"/server-*.log "$out/" 2>/dev/null; true ;;
  tune)
    VCHAT_MODEL=qwen3-4b-dummy python3 -m bench.tune --name gpu-h200-tune "$@" > "$out/tune.log" 2>&1
    status=$?; grep -v '^\s*$' "$out/tune.log" | tail -12
    cp bench/results/gpu-h200-tune* profiles.yaml "$out/" 2>/dev/null; exit $status ;;
  compare)  # the app's API vs vLLM's own server, its chat path vs the usual Chainlit app
    VCHAT_MODEL=qwen3-4b-dummy python3 -m bench.serve_compare --name gpu-h200 --pairs 2 \
      --num-prompts 128 --output-len 128 "$@" > "$out/compare.log" 2>&1
    status=$?; grep -v '^\s*$' "$out/compare.log" | grep -v Warning | tail -16
    # the result this run wrote (named by --name when given), not a committed one
    cp "$(ls -t bench/results/serve-compare-*.json | head -1)" "$out/" 2>/dev/null
    [ "$status" = 0 ] || cp .cache/server-*.log .cache/vllm-server-*.log "$out/" 2>/dev/null
    exit $status ;;
  big-request)  # the shipped engines (compiled, the file's context): the test sizes unset
    VCHAT_MODEL=qwen3-4b-dummy VCHAT_ENFORCE_EAGER= VCHAT_MAX_MODEL_LEN= VCHAT_KV_CACHE_GIB= \
      python3 -m bench.big_request --out "$out/big-request-gpu-h200.json" "$@" \
      > "$out/big-request.log" 2>&1
    status=$?; grep -v '^{' "$out/big-request.log" | tail -12
    [ "$status" = 0 ] || cp .cache/server-*.log "$out/" 2>/dev/null; exit $status ;;
  documents)  # bench.documents: the shipped app (compiled, the file's context), a long
    # document attached beside streaming users
    VCHAT_MODEL=qwen3-4b-dummy VCHAT_ENFORCE_EAGER= VCHAT_MAX_MODEL_LEN= VCHAT_KV_CACHE_GIB= \
      python3 -m bench.documents --out "$out/gpu-documents-run.json" "$@" \
      > "$out/documents.log" 2>&1
    status=$?; grep -v '^{' "$out/documents.log" | tail -12
    cp .cache/server-*.log "$out/" 2>/dev/null; exit $status ;;
  isolation)  # bench.isolation on the shipped shared engine (compiled, the file's context)
    VCHAT_MODEL=qwen3-4b-dummy VCHAT_ENFORCE_EAGER= VCHAT_MAX_MODEL_LEN= VCHAT_KV_CACHE_GIB= \
      python3 -m bench.isolation --out "$out/isolation-${ISOLATION_NAME:-run}.json" "$@" \
      > "$out/isolation-${ISOLATION_NAME:-run}.log" 2>&1
    status=$?; grep '^{' "$out/isolation-${ISOLATION_NAME:-run}.log" | cut -c1-400
    [ "$status" = 0 ] || tail -30 "$out/isolation-${ISOLATION_NAME:-run}.log"; exit $status ;;
  returning)  # bench.returning: returning chats with and without KV offloading to CPU
    VCHAT_MODEL=qwen3-4b-dummy VCHAT_ENFORCE_EAGER= VCHAT_MAX_MODEL_LEN= VCHAT_KV_CACHE_GIB= \
      python3 -m bench.returning --out "$out/returning.json" "$@" > "$out/returning.log" 2>&1
    status=$?; grep '^{' "$out/returning.log" | cut -c1-1000
    # vLLM's word on the CPU memory it offloads to (/dev/shm, pinned or not; 1 CPU tensor:
    # the layers of a block laid out together, one copy a block), and /dev/shm's size.
    grep -i 'mmap file\|cudaHostRegister\|CPU tensors\|offload' "$out/returning.log" | grep -v '^{' | sed 's/^.*\] //' \
      | sort | uniq -c | sort -rn | head -8 | cut -c1-300; df -h /dev/shm | tail -1
    [ "$status" = 0 ] || tail -40 "$out/returning.log"; exit $status ;;
  link)  # bench.link: the host-to-GPU link's own speed (a returning chat's load's ceiling)
    python3 -m bench.link --out "$out/link.json" "$@" ;;
  room)  # bench.room: a room of guests joining by one invite link, all asking at once
    # Its figures written straight into OUT (a link in their place): the app's, saved
    # before the engine path runs, come back even if the call's time runs out during it.
    ln -sf "$(realpath "$out")/${ROOM_NAME:-gpu-room}.json" bench/results/
    VCHAT_MODEL=qwen3-4b-dummy VCHAT_ENFORCE_EAGER= VCHAT_MAX_MODEL_LEN= VCHAT_KV_CACHE_GIB= \
      python3 -m bench.room --name "${ROOM_NAME:-gpu-room}" "$@" > "$out/${ROOM_NAME:-gpu-room}.log" 2>&1
    status=$?; tail -12 "$out/${ROOM_NAME:-gpu-room}.log"
    # Where the guests' first tokens went (the newest server log: the app's turn lines).
    log=$(ls -t .cache/server-*.log 2>/dev/null | head -1)
    # All its turns, then every ROOM_WAVE (the seats: the turns that ran together).
    [ -n "$log" ] && { python3 -m tools.turn_log "$log" --each 1000
                       python3 -m tools.turn_log "$log" --each "${ROOM_WAVE:-256}"
                     } > "$out/${ROOM_NAME:-gpu-room}-turns.json"
    # And the log itself (its turn lines' times: the seats taken over the run).
    [ -n "$log" ] && gzip -c "$log" > "$out/${ROOM_NAME:-gpu-room}-server.log.gz"
    exit $status ;;
  reliability)  # bench.reliability: a front end, then the core, killed under load (shipped app)
    VCHAT_MODEL=qwen3-4b-dummy VCHAT_ENFORCE_EAGER= VCHAT_MAX_MODEL_LEN= VCHAT_KV_CACHE_GIB= \
      python3 -m bench.reliability --name "${RELIABILITY_NAME:-gpu-reliability}" "$@" \
      > "$out/reliability.log" 2>&1
    status=$?; tail -12 "$out/reliability.log"
    cp bench/results/"${RELIABILITY_NAME:-gpu-reliability}".json "$out/" 2>/dev/null
    for log in .cache/server-*.log; do
      [ -f "$log" ] && grep -E "front_ends|rejoined|core|died|is back|ready in|warmed" "$log" \
        | tail -60 > "$out/server-$(basename "$log")"
    done
    exit $status ;;
  soak)  # bench.soak: mixed traffic for --minutes (a call holds 10: the hour needs a
    # background run and `wait`), sampled every minute, on the shipped app
    VCHAT_MODEL=qwen3-4b-dummy VCHAT_ENFORCE_EAGER= VCHAT_MAX_MODEL_LEN= VCHAT_KV_CACHE_GIB= \
      python3 -m bench.soak --name "${SOAK_NAME:-gpu-soak}" "$@" > "$out/soak.log" 2>&1
    status=$?; tail -12 "$out/soak.log"
    cp bench/results/"${SOAK_NAME:-gpu-soak}".* "$out/" 2>/dev/null; exit $status ;;
  two-gpus)
    VCHAT_MODEL=qwen3-4b-dummy python3 -m bench.two_gpus "$@" > "$out/two-gpus.log" 2>&1
    status=$?; tail -40 "$out/two-gpus.log"; cp bench/results/two-gpus* "$out/" 2>/dev/null
    exit $status ;;
  speed)
    VCHAT_MODEL=qwen3-4b-dummy python3 -m bench.engine_speed --out "$out/speed.json" "$@" \
      > "$out/speed.log" 2>&1; tail -30 "$out/speed.log" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
