#!/usr/bin/env bash
# Runs a command as an x86-64 CPU without AVX-512 would run it, natively:
#
#   bash tools/as_avx2.sh python -m pytest -q tests/test_torchvision.py
#
# Builds tools/as_avx2.c once (with $CC, else cc) into $AS_AVX2_DIR (default
# $XDG_CACHE_HOME/jaxmp, else ~/.cache/jaxmp) and preloads it: CPUID then
# reports no AVX-512, so XLA:CPU compiles for AVX2 and its kernel libraries
# pick their AVX2 code paths (docs/development.md). Needs x86-64 Linux and a
# CPU with CPUID faulting (`cpuid_fault` in /proc/cpuinfo). On a CPU without
# AVX-512 it runs the command as it is.
set -euo pipefail
if [[ $# -eq 0 ]]; then
  echo "usage: bash tools/as_avx2.sh COMMAND [ARG...]" >&2
  exit 2
fi
die() {
  echo "as_avx2: $*" >&2
  exit 2
}
[[ "$(uname -s) $(uname -m)" == "Linux x86_64" ]] || die "x86-64 Linux only"
if ! grep -qw avx512f /proc/cpuinfo; then
  echo "as_avx2: this CPU has no AVX-512: running the command as it is" >&2
  exec "$@"
fi
grep -qw cpuid_fault /proc/cpuinfo ||
  die "this CPU (or its hypervisor) offers no CPUID faulting (no cpuid_fault in /proc/cpuinfo)"
src="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/as_avx2.c"
dir="${AS_AVX2_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/jaxmp}"
so="$dir/as_avx2-$(sha256sum "$src" | cut -c1-16).so"
if [[ ! -f "$so" ]]; then
  cc="${CC:-cc}"
  command -v "$cc" >/dev/null || die "no C compiler ($cc) to build $src"
  mkdir -p "$dir"
  "$cc" -O2 -Wall -shared -fPIC -o "$so.$$" "$src" -ldl
  mv "$so.$$" "$so"
fi
# Once only, when a command run under this tool runs it again.
others=$(tr ': ' '\n\n' <<<"${LD_PRELOAD:-}" | grep -v '/as_avx2-[0-9a-f]*\.so$' |
  paste -sd: - || true)
export LD_PRELOAD="$so${others:+:$others}"
exec "$@"
