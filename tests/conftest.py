"""Test setup: four CPU devices, so multi-device code paths run everywhere."""

import os
import sys
import tempfile

# Must happen before jax is imported anywhere in the test process. The tests
# use tiny shapes, so XLA's slow LLVM optimisations only cost compile time
# (about half of the suite's CPU time without these two flags).
FAST_COMPILE = ("--xla_backend_optimization_level=0 "
                "--xla_llvm_disable_expensive_passes=true")
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=4 " + FAST_COMPILE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Identical programs (the same tiny ResNet in several end-to-end tests) are
# compiled once per test session.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), "jaxmp-test-jit-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)  # `configs` is importable as a package.
