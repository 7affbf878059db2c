"""Start-up: JAX's persistent compilation cache, and when the process began.

Light on purpose (no TensorFlow): the cache must be on before the first
compilation, and the start time measures the whole start-up.
"""

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
