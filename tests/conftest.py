"""Shared test setup: four CPU devices, compile flags, the tiny job's data.

``JAXMP_DEFAULT_XLA_FLAGS=1`` runs without the fast-compile flags: the
README's test command runs the ``invariant`` tests (bitwise and exactness
claims) that way once, so that each claim holds for the code users run.
"""

import os
import sys
import tempfile

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
for path in (ROOT, TESTS):  # `configs`, `cifar_train` and `_helpers`.
  if path not in sys.path:
    sys.path.insert(0, path)

from _helpers import FAST_COMPILE  # pylint: disable=g-import-not-at-top,wrong-import-position
from _helpers import load_tiny_data  # pylint: disable=g-import-not-at-top,wrong-import-position
from _helpers import tiny_config  # pylint: disable=g-import-not-at-top,wrong-import-position

DEFAULT_FLAGS = os.environ.get("JAXMP_DEFAULT_XLA_FLAGS") == "1"

# Must happen before jax is imported anywhere in the test process.
os.environ.setdefault(
  "XLA_FLAGS",
  "--xla_force_host_platform_device_count=4"
  + ("" if DEFAULT_FLAGS else " " + FAST_COMPILE),
)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Identical programs (the same tiny ResNet in several end-to-end tests) are
# compiled once per test session.
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR",
  os.path.join(
    tempfile.gettempdir(),
    "jaxmp-test-jit-cache" + ("-default" if DEFAULT_FLAGS else ""),
  ),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  """A tfds data dir for the tiny job's synthetic data set."""
  return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="session")
def make_config():
  """``make_config(data_dir, **overrides)``: the tiny job's config."""
  return tiny_config


@pytest.fixture(scope="session")
def tiny_data(data_dir):
  """The tiny job's data set, read once per session."""
  return load_tiny_data(data_dir)
