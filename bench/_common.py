"""What the benchmarks share: the machine's name, a timing loop, the date line.

* `cpu_name`: the CPU's model name from ``/proc/cpuinfo`` (with ``isa=True``
  its widest vector extension, ``AVX-512`` or ``AVX2``): every figure in
  the docs names its machine.
* `interleaved`: times several callables alternately, ``A B B A ...``,
  after warm-ups, so that load on a shared machine hits each alike; the
  scripts report medians (and medians of per-repetition ratios).
* `date_line`: the first line of a run's output: the script, the CPU, its
  cores, jax's version and the UTC date and time.

Imported by the scripts as ``import _common`` (``python bench/<name>.py`` puts
``bench/`` first on the path).
"""

import datetime
import os
import platform
import time
from typing import Any, Callable, Optional


def _cpuinfo() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return f.read()
  except OSError:
    return ""


def cpu_isa(info: Optional[str] = None) -> str:
  """``"AVX-512"``, ``"AVX2"`` or ``""``: the CPU's widest vector extension."""
  flags = (_cpuinfo() if info is None else info).split()
  return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""


def cpu_name(isa: bool = False) -> str:
  """The CPU's model name; with ``isa``, its vector extension in brackets."""
  info = _cpuinfo()
  name = next(
    (
      line.split(":", 1)[1].strip()
      for line in info.splitlines()
      if line.startswith("model name")
    ),
    platform.processor() or platform.machine() or "unknown CPU",
  )
  ext = cpu_isa(info) if isa else ""
  return f"{name} ({ext})" if ext else name


def interleaved(
  fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 2
) -> dict[str, list[float]]:
  """``{name: [seconds, ...]}`` of ``reps`` calls of each, alternately.

  Each callable runs one measured unit and waits for its result (a jitted
  step with `jax.block_until_ready`). ``warmup`` rounds run first and are
  not timed (compiles, first touches of memory); the order reverses every
  repetition (``A B``, ``B A``, ...), so that neither side always runs
  first.
  """
  for _ in range(warmup):
    for fn in fns.values():
      fn()
  times = {name: [] for name in fns}
  order = list(fns)
  for _ in range(reps):
    for name in order:
      t = time.perf_counter()
      fns[name]()
      times[name].append(time.perf_counter() - t)
    order.reverse()
  return times


def date_line(script: str) -> str:
  """``script: CPU (ISA), N cores, jax V, YYYY-MM-DD HH:MM UTC``."""
  import jax  # pylint: disable=g-import-not-at-top

  now = datetime.datetime.now(datetime.timezone.utc)
  return (
    f"{script}: {cpu_name(isa=True)}, {os.cpu_count()} cores, "
    f"jax {jax.__version__}, {now:%Y-%m-%d %H:%M} UTC"
  )
