"""The test setup itself: XLA flags that compose, the devices marker."""

import os

import jax
import pytest

import conftest
from _helpers import FAST_COMPILE

FOUR = "--xla_force_host_platform_device_count=4"


@pytest.mark.parametrize(
  "existing, default_flags, want",
  [
    ("", False, f"{FOUR} {FAST_COMPILE}"),
    ("", True, FOUR),
    # A caller's flags are kept, ours come last (XLA: the last one wins).
    (
      "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2",
      False,
      f"--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2 {FOUR} "
      f"{FAST_COMPILE}",
    ),
    # Under JAXMP_DEFAULT_XLA_FLAGS=1 an inherited fast-compile flag goes.
    (
      f"--xla_dump_to=/tmp/x {FAST_COMPILE}",
      True,
      f"--xla_dump_to=/tmp/x {FOUR}",
    ),
    # pytest-xdist's workers inherit the composed variable: not repeated.
    (
      f"--xla_dump_to=/tmp/x {FOUR} {FAST_COMPILE}",
      False,
      f"--xla_dump_to=/tmp/x {FOUR} {FAST_COMPILE}",
    ),
  ],
)
def test_xla_flags_are_appended_to_the_callers(existing, default_flags, want):
  assert conftest.compose_xla_flags(existing, default_flags) == want


def test_this_process_has_the_composed_flags_and_four_devices():
  flags = os.environ["XLA_FLAGS"].split()
  assert FOUR in flags
  fast = set(FAST_COMPILE.split())
  assert fast.isdisjoint(flags) == conftest.DEFAULT_FLAGS
  assert jax.device_count() >= 4


def test_compilation_cache_is_this_runs():
  cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
  assert jax.config.jax_compilation_cache_dir == cache
  if "JAXMP_TEST_CACHE_OWNER" in os.environ:  # Made by this run's conftest.
    assert os.path.basename(cache).startswith("jaxmp-test-jit-cache-")
    assert os.path.isdir(cache)
