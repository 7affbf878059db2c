"""The app's start-up: the persistent compilation cache and the start time."""

import os
import subprocess
import sys
import textwrap

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
  start, after_start = map(float, _python(code).split())
  # The interpreter starts (clock ticks of 10 ms) before its first line runs.
  assert after_start - 5.0 < start <= after_start + 0.02
