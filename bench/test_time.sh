#!/usr/bin/env bash
# Times the README's test command, each half, from an empty compilation cache.
#
#   bash bench/test_time.sh
#
# Runs the second line of the README's first bash block (the test command),
# split at " && " into its two halves, with the 15 slowest tests of each
# (--durations=15), and prints the wall time of each half and the CPU.
# tests/conftest.py gives every pytest run a new, empty JAX compilation cache
# (deleted afterwards), so each half starts cold, as on a new machine; a
# JAX_COMPILATION_CACHE_DIR in the environment would be reused, so it is
# unset here. `.ci/run` runs this script.
set -euo pipefail
cd "$(dirname "$0")/.."
COMMAND=$(awk '/^```bash/ { b++; n = 0; next }
  b == 1 && /^```/ { exit }
  b == 1 { n++; if (n == 2) print }' README.md)
if [[ "$COMMAND" != *"python -m pytest"*" && "* ]]; then
  echo "bench/test_time.sh: no test command in README.md: '$COMMAND'" >&2
  exit 1
fi
unset JAX_COMPILATION_CACHE_DIR
export PYTEST_ADDOPTS="--durations=15 ${PYTEST_ADDOPTS:-}"
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs || true)
simd=AVX2
grep -qw avx512f /proc/cpuinfo && simd=AVX-512
echo "test_time: ${cpu:-unknown CPU} ($simd), $(nproc) cores, load" \
  "$(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%F %H:%M') UTC"
total=0
half=0
while IFS= read -r part; do
  half=$((half + 1))
  start=$(date +%s%N)
  bash -c "$part"
  ms=$((($(date +%s%N) - start) / 1000000))
  total=$((total + ms))
  printf 'test_time: half %d: %d.%01d s wall: %s\n' \
    "$half" $((ms / 1000)) $((ms % 1000 / 100)) "$part"
done < <(sed 's/ && /\n/g' <<<"$COMMAND")
printf 'test_time: both halves: %d.%01d s wall\n' \
  $((total / 1000)) $((total % 1000 / 100))
