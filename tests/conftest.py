"""Shared test setup: four CPU devices, compile flags, the tiny job's data.

``JAXMP_DEFAULT_XLA_FLAGS=1`` runs without the fast-compile flags: the
README's test command runs the ``invariant`` tests (bitwise and exactness
claims) that way once, so that each claim holds for the code users run.
"""

import os
import shutil
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
NUM_DEVICES = 4


def compose_xla_flags(existing: str, default_flags: bool) -> str:
  """``existing`` XLA flags with this suite's appended (XLA: the last wins).

  The suite's are 4 forced host devices and, unless ``default_flags``, the
  fast-compile flags; with ``default_flags`` any fast-compile flag already in
  ``existing`` is dropped, so the exactness claims run under XLA's defaults.
  Flags already there verbatim are not repeated (pytest-xdist's workers
  inherit the controller's variable).
  """
  fast = FAST_COMPILE.split()
  flags = [f for f in existing.split() if not (default_flags and f in fast)]
  ours = [f"--xla_force_host_platform_device_count={NUM_DEVICES}"]
  ours += [] if default_flags else fast
  if flags[-len(ours) :] != ours:
    flags += ours
  return " ".join(flags)


# Must happen before jax starts a backend in the test process.
os.environ["XLA_FLAGS"] = compose_xla_flags(
  os.environ.get("XLA_FLAGS", ""), DEFAULT_FLAGS
)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache, new for each run (`pytest` command):
# identical programs (the same tiny ResNet in several end-to-end tests, in
# pytest-xdist's workers and in the app's child processes, which all inherit
# the variable) compile once per run, and every run starts cold, as on a new
# machine, so that its time is honest. The process that made it deletes it.
# A JAX_COMPILATION_CACHE_DIR set by the caller is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
    prefix="jaxmp-test-jit-cache-"
  )
  os.environ["JAXMP_TEST_CACHE_OWNER"] = str(os.getpid())
# Programs that compile in under 50 ms (most of them: eager ops) are not
# written: writing costs a few ms each, more than compiling them again.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.05")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import gc  # pylint: disable=g-import-not-at-top,wrong-import-position

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

# Tracing makes and drops many small objects, and a test process holds a
# large heap (modules, jaxprs, executables) that Python's default collector
# thresholds walk again and again: collecting less often takes about 7% off
# the suite's CPU time at the same peak memory (tests/test_autocast.py,
# test_state_codec.py and test_sharded.py: 32.2 s -> 30.0 s, 1.41 GB, Intel
# Xeon, 2026-12-06). The heap collected (imports, test modules) is frozen
# once collection ends (`pytest_collection_finish`).
gc.set_threshold(50_000, 20, 100)


def pytest_configure(config):
  config.addinivalue_line(
    "markers", "plots: the app's runs draw plots.png (otherwise not drawn)"
  )


@pytest.fixture(autouse=True)
def _no_plots(request, monkeypatch):
  """The app's runs in this process draw no plots.png (`plot_series_only`).

  Unless the test is marked ``plots``; where the app is not imported (the
  library's tests, the venv without the app) nothing changes.
  """
  reporting = sys.modules.get("cifar_train.reporting")
  if reporting is not None and not request.node.get_closest_marker("plots"):
    from _helpers import plot_series_only  # pylint: disable=g-import-not-at-top

    monkeypatch.setattr(reporting.Reporter, "plot", plot_series_only)


def pytest_collection_finish(session):
  del session
  gc.freeze()


def pytest_ignore_collect(collection_path, config):
  """Under ``-m invariant``, files that never name the mark are not imported.

  The README's second half selects the marked tests only; a module whose
  source lacks the word ``invariant`` cannot mark any (the mark is applied
  by name), so collecting it (importing it, rewriting its asserts, importing
  every library module for its doctests) would only deselect what it holds.
  """
  if (config.option.markexpr or "").strip() != "invariant":
    return None
  if collection_path.suffix != ".py" or collection_path.name == "conftest.py":
    return None
  with open(collection_path, encoding="utf-8") as f:
    return "invariant" not in f.read() or None


def pytest_unconfigure(config):
  del config
  if os.environ.get("JAXMP_TEST_CACHE_OWNER") == str(os.getpid()):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_runtest_setup(item):
  """Fails a ``devices(n)`` test, with the reason, when jax has fewer."""
  marker = item.get_closest_marker("devices")
  if marker is None:
    return
  import jax  # pylint: disable=g-import-not-at-top

  need, have = marker.args[0], jax.device_count()
  if have < need:
    pytest.fail(
      f"{item.nodeid} needs {need} devices and jax has {have} "
      f"({jax.default_backend()}). tests/conftest.py forces {NUM_DEVICES} CPU "
      "devices by appending --xla_force_host_platform_device_count to "
      "XLA_FLAGS before jax starts a backend; here JAX_PLATFORMS="
      f"{os.environ.get('JAX_PLATFORMS')!r}, XLA_FLAGS="
      f"{os.environ.get('XLA_FLAGS')!r} (or jax's backend started first, in "
      "a plugin or before pytest).",
      pytrace=False,
    )


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
