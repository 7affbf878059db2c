"""Start-up: the compilation cache, host memory reuse, the start time.

JAX's persistent compilation cache, glibc reusing freed memory on CPU, and
when the process began.

Light on purpose (no TensorFlow): the cache must be on before the first
compilation, and the start time measures the whole start-up.
"""

import ctypes
import importlib.metadata
import os
import time
from typing import Optional

import jax


def process_start_time() -> float:
  """When this process started, on the ``time.time()`` clock; best effort.

  On Linux from ``/proc`` (to the clock tick, 10 ms); elsewhere the time
  this module was imported, which misses the imports before it.
  """
  try:
    with open("/proc/self/stat") as f:
      # Field 22, after the parenthesised command name: the start, in clock
      # ticks since boot.
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
      uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
  except (OSError, ValueError, IndexError):
    return _IMPORTED_AT


_IMPORTED_AT = time.time()


def enable_compile_cache(directory: str) -> Optional[str]:
  """Turns on JAX's persistent compilation cache; returns the directory.

  A cache directory already set through JAX (``JAX_COMPILATION_CACHE_DIR``
  or ``jax.config``) is kept. ``directory == ""`` leaves the cache off.
  """
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  if not directory:
    return None
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  return directory


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_GPU_PLUGINS = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm", "libtpu")


def keep_freed_host_memory() -> bool:
  """On a CPU-only JAX, makes glibc reuse freed memory; True if it did.

  XLA:CPU's convolutions allocate their scratch (up to 300 MB each at batch
  128) with malloc from Eigen's worker threads. glibc serves those from
  fresh ``mmap`` pages and unmaps them on free, so every train step
  page-faults about 1.1 GB back in: 270,000 minor faults and 0.6 s of
  system time a step for the CIFAR ResNet18 on 2 cores (AMD EPYC). One
  arena, no ``mmap`` and no trimming keep those pages for the next step:
  no faults, 0.3-0.4 s a step faster. It must run before JAX starts its CPU
  client (its thread pools), so `cli.run` calls it first (with the config's
  ``reuse_host_memory``).

  Skipped (False) where JAX may run on an accelerator (``JAX_PLATFORMS``
  not "cpu", or a GPU/TPU plugin installed): there the host only feeds
  data, and one arena would serialise the host's threads. Also False where
  the C library has no glibc ``mallopt``.
  """
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    if platforms.split(",")[0].strip() != "cpu":
      return False
  elif any(
    (d.metadata["Name"] or "").lower().startswith(_GPU_PLUGINS)
    for d in importlib.metadata.distributions()
  ):
    return False
  try:
    mallopt = ctypes.CDLL("libc.so.6").mallopt
  except (OSError, AttributeError):
    return False
  done = [
    mallopt(_M_ARENA_MAX, 1),
    mallopt(_M_MMAP_MAX, 0),
    mallopt(_M_TRIM_THRESHOLD, 2**31 - 1),
  ]
  return all(done)
