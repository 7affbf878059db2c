#!/usr/bin/env bash
# Downloads the wheels that the offline GPU machine lacks, for `bench/gpu.sh`.
#
#   bash bench/gpu_wheels.sh          # where pip reaches PyPI; then copy the
#                                     # repository (with bench/gpu_wheels/)
#   bash bench/gpu_wheels.sh DIR      # also DIR's train/ and test/ (an image
#                                     # folder) as bench/gpu_wheels/images.tar.xz
#
# Then, on the GPU machine: bash bench/gpu.sh --data_dir
# bench/gpu_wheels/images.tar.xz (bench/seed_job.py unpacks it once into
# bench/.gpu_data/).
#
# The GPU image has Python 3.12, jax with CUDA, flax, optax, orbax, torch and
# torchvision, but not tensorflow-datasets (nor array-record, its ArrayRecord
# reader), jmp, ml_collections, tensorboardX, nor promise (tfds imports it).
# Their wheels, and the pure-Python packages tfds needs that such an image
# may lack, go to bench/gpu_wheels/ (git ignores it): cp312 manylinux, no
# dependencies resolved (the image has the rest). promise publishes no
# wheel: it is built from its sdist. gpu.sh installs from this folder with
# `pip install --no-index --no-deps --target`, each package only when it
# does not import.
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT=bench/gpu_wheels
mkdir -p "$OUT"
# The versions this repository is tested with (pyproject's app extra).
WHEELS=(
  "tensorflow-datasets==4.9.10"
  "array-record==0.8.6"
  "jmp==0.0.4"
  "ml-collections==1.1.0"
  "tensorboardX==2.6.5"
  "absl-py==2.5.1"
  "dm-tree==0.1.10"
  "etils==1.15.0"
  "immutabledict==4.3.1"
  "simple-parsing==0.1.9"
  "docstring-parser==0.18.0"
  "tensorflow-metadata==1.21.0"
  "termcolor==3.3.0"
  "toml==0.10.2"
  "wrapt==2.5.2"
)
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$OUT" "${WHEELS[@]}"
"$PY" -m pip wheel --no-deps -w "$OUT" "promise==2.3"
if [ $# -gt 0 ]; then
  "$PY" -c 'import sys; sys.path.insert(0, "bench"); import seed_job
seed_job.pack(sys.argv[1], sys.argv[2])' "$1" "$OUT/images.tar.xz"
fi
ls -1sh "$OUT"
