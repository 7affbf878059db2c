"""The app's start-up: the persistent compilation cache and the start time."""

import os
import subprocess
import sys
import textwrap
import time

from cifar_train import settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, **env) -> str:
  """Runs ``code`` in a fresh interpreter without the suite's JAX cache."""
  environ = {
    k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"
  }
  environ.update(env, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(code)],
    cwd=ROOT,
    env=environ,
    capture_output=True,
    text=True,
    check=True,
  )
  return out.stdout.strip()


def _compile(directory: str) -> str:
  """A program that turns the cache on for ``directory``, then compiles."""
  return f"""
    import jax, jax.numpy as jnp
    from cifar_train import startup
    events = []
    jax.monitoring.register_event_listener(lambda e, **_: events.append(e))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    print(startup.enable_compile_cache({directory!r}))
    jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(7)).block_until_ready()
    count = lambda kind: events.count("/jax/compilation_cache/" + kind)
    print(count("cache_hits"), count("cache_misses"))
  """


def test_compile_cache_fills_the_directory_and_a_second_run_reuses_it(
  tmp_path,
):
  cache = str(tmp_path / "jit")
  code = _compile(cache)
  directory, counts = _python(code).splitlines()
  hits, misses = map(int, counts.split())
  assert directory == cache and hits == 0 and misses > 0
  assert os.listdir(cache), "nothing was written to the cache"
  # The same programs in a new process: every one comes from the cache.
  directory, counts = _python(code).splitlines()
  assert directory == cache and counts == f"{misses} 0"


def test_compile_cache_set_through_jax_takes_precedence(tmp_path):
  mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
  code = _compile(mine)
  out = _python(code, JAX_COMPILATION_CACHE_DIR=theirs).splitlines()
  assert out[0] == theirs and os.listdir(theirs)
  assert not os.path.exists(mine)


def test_empty_compile_cache_dir_leaves_the_cache_off():
  directory, counts = _python(_compile("")).splitlines()
  assert directory == "None" and counts == "0 0"


def test_auto_compile_cache_is_in_the_user_cache_dir(
  make_config, data_dir, monkeypatch
):
  monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
  config = make_config(data_dir)
  config.compile_cache_dir = "auto"
  assert settings.resolve(config).compile_cache_dir == os.path.join(
    "/somewhere/cache", "jaxmp", "jit"
  )
  config.compile_cache_dir = "~/jit"
  assert settings.resolve(config).compile_cache_dir == os.path.expanduser(
    "~/jit"
  )


def test_process_start_time_is_when_the_interpreter_started():
  code = """
    import time
    t = time.time()
    from cifar_train import startup
    print(startup.process_start_time(), t)
  """
  before_spawn = time.time()
  start, after_start = map(float, _python(code).split())
  # The interpreter starts after the spawn and before its first line runs;
  # /proc counts in clock ticks (10 ms) and /proc/uptime in 10 ms too.
  assert before_spawn - 0.02 <= start <= after_start + 0.02


_WORKER_BLOCKS = """
  import threading
  import numpy as np
  from cifar_train import startup
  print(startup.keep_freed_host_memory() if {tune} else "untuned")

  def in_heap(address):
    with open("/proc/self/maps") as f:
      for line in f:
        if line.rstrip().endswith("[heap]"):
          lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
          return lo <= address < hi
    return False

  def work(out):
    # Like Eigen's scratch: a large block, malloc'd and freed by a worker
    # thread, twice.
    for _ in range(2):
      block = np.ones(40_000_000 // 8)  # 40 MB: above glibc's mmap ceiling.
      out.append((block.ctypes.data, in_heap(block.ctypes.data)))
      del block

  blocks = []
  thread = threading.Thread(target=work, args=(blocks,))
  thread.start()
  thread.join()
  (first, first_in_heap), (second, second_in_heap) = blocks
  print(first_in_heap, second_in_heap, first == second)
"""


def test_keep_freed_host_memory_reuses_a_worker_threads_freed_block():
  # glibc's default: a 40 MB block from a worker thread is its own mmap,
  # unmapped on free, so each step's scratch is paged in afresh.
  untuned, placed = _python(_WORKER_BLOCKS.format(tune=False)).splitlines()
  assert untuned == "untuned" and placed.split()[:2] == ["False", "False"]
  # Tuned: one arena, no mmap, no trim: the block comes from the heap and
  # the second allocation gets the same, already paged-in, memory.
  tuned, placed = _python(_WORKER_BLOCKS.format(tune=True)).splitlines()
  assert tuned == "True" and placed.split() == ["True", "True", "True"]


def test_keep_freed_host_memory_leaves_accelerator_hosts_alone():
  code = (
    "from cifar_train import startup; print(startup.keep_freed_host_memory())"
  )
  environ = dict(os.environ, JAX_PLATFORMS="cuda,cpu")
  out = subprocess.run(
    [sys.executable, "-c", code],
    cwd=ROOT,
    env=environ,
    capture_output=True,
    text=True,
    check=True,
  )
  assert out.stdout.strip() == "False"
