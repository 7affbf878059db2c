#!/usr/bin/env bash
# One-shot GPU benchmark of jaxmp (run from the repo root on the GPU machine):
#
#   bash bench/gpu.sh            # under 8 minutes; extra args go to gpu_bench.py
#
# Installs jmp, ml_collections and absl-py offline from bench/wheels (pure
# Python wheels kept in the repo) when they are missing, then runs
# bench/gpu_bench.py, which prints one table and the headline lines.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"

if ! "$PY" -c "import jmp, ml_collections, absl" 2>/dev/null; then
  if [ -d bench/wheels ]; then
    echo "installing jmp, ml_collections, absl-py from bench/wheels"
    "$PY" -m pip install -q --no-index --find-links bench/wheels \
      jmp ml_collections absl-py || echo "warning: offline install failed"
  else
    echo "bench/wheels missing: trying pip install --no-deps"
    "$PY" -m pip install -q --no-deps jmp ml_collections absl-py \
      || echo "warning: pip install failed; continuing"
  fi
fi
"$PY" -c "import jax; print('jax devices:', jax.devices())" || true
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
exec "$PY" bench/gpu_bench.py "$@"
