#!/usr/bin/env bash
# The one GPU command of jaxmp (run from anywhere; offline is fine):
#
#   bash bench/gpu.sh                    # one GPU, under 9 minutes
#   bash bench/gpu.sh --data_dir DIR     # the seed job on an image folder
#   bash bench/gpu.sh --data_dir bench/gpu_wheels/images.tar.xz  # packed
#   bash bench/gpu.sh --smoke            # tiny sizes, on a CPU
#
# Step rows of both ResNet18s (jaxmp O1/O2/O0 TF32/bf16 against torch AMP
# channels_last, eager and compiled), then the seed's job (the app's
# configs/seed.py, cold and warm compile cache, against the seed's PyTorch
# script with torch.amp), then the byte LM of bench/fp8.py at width 4096,
# bf16 against fp8 autocast (current scaling), side by side
# (fp8_over_bf16_step): one table, the headline lines, and a JSON file
# (gpu_bench.json; --json PATH). Other arguments go to bench/gpu_bench.py.
#
# The app's packages that the GPU image lacks (tensorflow-datasets,
# array-record, jmp, ml_collections, tensorboardX, promise, ...) are
# installed offline from bench/gpu_wheels/ (fetched beforehand, where pip
# reaches PyPI, by `bash bench/gpu_wheels.sh`) into bench/.gpu_site/, each
# only when it does not import, and that folder goes on PYTHONPATH.
# `bash bench/gpu_wheels.sh DIR` also packs an image folder into
# bench/gpu_wheels/images.tar.xz (CIFAR-10's 60,000 JPEGs: 18.6 MB).
#
# The seed's job's accuracy on the GPU, O1 against O0 and against the seed's
# script, after `bash bench/gpu.sh --data_dir bench/gpu_wheels/images.tar.xz`:
#   PYTHONPATH=bench/.gpu_site python bench/fidelity.py --recipe=seed \
#     --data_dir bench/.gpu_data/images --policies=O0,O1 --seeds=0,1,2
#   python bench/seed_torch.py --image_folder bench/.gpu_data/images --seed S
# for S = 0, 1, 2.
set -u
cd "$(dirname "$0")/.."
# PYTHON, else the first of python and python3 that imports jax (where a
# plain python3 holds jax and torch and python is another, or none).
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  PY=python3
  for c in python python3; do
    if "$c" -c "import jax" 2>/dev/null; then
      PY=$c
      break
    fi
  done
fi
SITE="$PWD/bench/.gpu_site"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# wheel-name prefix -> module it provides.
declare -A MODULES=(
  [tensorflow_datasets]=tensorflow_datasets [array_record]=array_record
  [jmp]=jmp [ml_collections]=ml_collections [tensorboardx]=tensorboardX
  [promise]=promise [absl_py]=absl [dm_tree]=tree [etils]=etils
  [immutabledict]=immutabledict [simple_parsing]=simple_parsing
  [docstring_parser]=docstring_parser [tensorflow_metadata]=tensorflow_metadata
  [termcolor]=termcolor [toml]=toml [wrapt]=wrapt
)
missing=()
for wheel in bench/gpu_wheels/*.whl; do
  [ -e "$wheel" ] || break
  name="$(basename "$wheel" | cut -d- -f1 | tr 'A-Z' 'a-z')"
  module="${MODULES[$name]:-}"
  [ -n "$module" ] || continue
  "$PY" -c "import $module" 2>/dev/null || missing+=("$wheel")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing offline into bench/.gpu_site: ${missing[*]##*/}"
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${missing[@]}" \
    || echo "warning: offline install failed"
fi
for module in jmp ml_collections tensorflow_datasets array_record; do
  "$PY" -c "import $module" 2>/dev/null \
    || echo "warning: $module does not import (run bench/gpu_wheels.sh where pip works)"
done
"$PY" -c "import jax; print('jax devices:', jax.devices())" || true
command -v nvidia-smi >/dev/null \
  && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
exec "$PY" bench/gpu_bench.py "$@"
