"""Where the test suite's time goes: jax's compile events, test by test.

Run:

    python bench/diagnose/suite_compiles.py [PYTEST ARGS]
    python bench/diagnose/suite_compiles.py -n 2 -m 'not invariant'
    python bench/diagnose/suite_compiles.py tests/test_batches.py --top 5

Runs pytest (in a child, as the README's command does, with ``PYTEST ARGS``;
default ``-n 2 -m 'not invariant'``, the first half) with this file as a
plugin in every test process (pytest-xdist's workers included; not in the
processes a test starts itself). It listens to jax's compile events (tracing,
lowering to StableHLO, XLA's backend compile, persistent-cache hits) and
prints, for the ``--top`` tests with the most backend-compile seconds, the
seconds and counts of each, then the totals over all tests, then the
``--functions`` compiled functions (by name: a jitted function's, or a
primitive's where an op ran eagerly) with the most backend-compile
seconds over the whole run. On a 2-core
machine the suite keeps both cores busy (``/usr/bin/time`` of the README's
command: its CPU time is about twice its wall time), so the suite's time is
the work it does, and these events are the largest part of it.
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EVENTS = {
  "trace": "/jax/core/compile/jaxpr_trace_duration",
  "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "compile": "/jax/core/compile/backend_compile_duration",
  "cache_hit": "/jax/compilation_cache/cache_retrieval_time_sec",
}
OUT_DIR = "JAXMP_SUITE_COMPILES_DIR"
OUTSIDE = "(outside a test: collection, plugins)"

# The plugin: pytest loads this module with ``-p suite_compiles``.
_current = [None]
_seconds = collections.defaultdict(collections.Counter)
_counts = collections.defaultdict(collections.Counter)
# Backend-compile seconds and counts by the compiled function's name.
_fun_seconds = collections.Counter()
_fun_counts = collections.Counter()


def _listen(event, duration, **kwargs):
  _seconds[_current[0]][event] += duration
  _counts[_current[0]][event] += 1
  if event == EVENTS["compile"]:
    name = str(kwargs.get("fun_name", "?"))
    _fun_seconds[name] += duration
    _fun_counts[name] += 1


def pytest_configure(config):
  del config
  import jax  # pylint: disable=g-import-not-at-top

  jax.monitoring.register_event_duration_secs_listener(_listen)


def pytest_runtest_protocol(item, nextitem):
  del nextitem
  _current[0] = item.nodeid


def pytest_unconfigure(config):
  del config
  out = os.environ.get(OUT_DIR)
  if not out:
    return
  name = os.environ.get("PYTEST_XDIST_WORKER", "main")
  with open(os.path.join(out, f"{name}.json"), "w") as f:
    json.dump(
      {
        "tests": {
          (test or OUTSIDE): {
            "seconds": _seconds[test],
            "counts": _counts[test],
          }
          for test in _seconds
        },
        "functions": {
          fun: [_fun_seconds[fun], _fun_counts[fun]] for fun in _fun_seconds
        },
      },
      f,
    )


def _read(out: str) -> tuple[dict, dict]:
  tests, functions = {}, collections.defaultdict(lambda: [0.0, 0])
  for name in os.listdir(out):
    with open(os.path.join(out, name)) as f:
      worker = json.load(f)
    tests.update(worker["tests"])
    for fun, (seconds, count) in worker["functions"].items():
      functions[fun][0] += seconds
      functions[fun][1] += count
  return tests, functions


def _row(label: str, seconds: dict, counts: dict) -> str:
  cells = [
    f"{seconds.get(EVENTS[k], 0.0):.2f} s / {counts.get(EVENTS[k], 0)}"
    for k in EVENTS
  ]
  return f"| {label} | " + " | ".join(cells) + " |"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument(
    "--functions",
    type=int,
    default=25,
    help="also list this many compiled functions (by name) with the most"
    " backend-compile seconds over the whole run",
  )
  args, pytest_args = parser.parse_known_args(argv)
  pytest_args = pytest_args or ["-n", "2", "-m", "not invariant"]
  with tempfile.TemporaryDirectory() as out:
    env = dict(
      os.environ,
      **{OUT_DIR: out},
      PYTHONPATH=os.pathsep.join(
        p for p in (HERE, os.environ.get("PYTHONPATH")) if p
      ),
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "suite_compiles"]
    code = subprocess.call(command + pytest_args, cwd=ROOT, env=env)
    tests, functions = _read(out)
  compile_key = EVENTS["compile"]
  ranked = sorted(
    tests.items(), key=lambda kv: -kv[1]["seconds"].get(compile_key, 0.0)
  )
  print("| test | " + " | ".join(EVENTS) + " |")
  print("|---" * (len(EVENTS) + 1) + "|")
  for test, v in ranked[: args.top]:
    print(_row(test, v["seconds"], v["counts"]))
  total_s, total_n = collections.Counter(), collections.Counter()
  for v in tests.values():
    total_s.update(v["seconds"])
    total_n.update(v["counts"])
  count = sum(t != OUTSIDE for t in tests)
  print(_row(f"all: {count} tests with events, and outside", total_s, total_n))
  if args.functions:
    print()
    print("| compiled function | backend compile | programs |")
    print("|---|---|---|")
    for fun, (seconds, count) in sorted(
      functions.items(), key=lambda kv: -kv[1][0]
    )[: args.functions]:
      print(f"| {fun} | {seconds:.2f} s | {count} |")
  for k in EVENTS:
    print(f"suite_{k}_seconds: {total_s.get(EVENTS[k], 0.0):.1f}")
  return code


if __name__ == "__main__":
  sys.exit(main())
