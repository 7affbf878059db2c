"""tools/as_avx2.sh: a command runs as on a CPU without AVX-512, natively.

These run where the tool can: x86-64 Linux on a CPU with AVX-512 and CPUID
faulting, with a C compiler; elsewhere they skip, saying why.
"""

import os
import platform
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "as_avx2.sh")


def _cpu_flags() -> set:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return set(line.split(":", 1)[1].split())
  except OSError:
    pass
  return set()


def _why_not() -> str:
  if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
    return "x86-64 Linux only"
  flags = _cpu_flags()
  if "avx512f" not in flags:
    return "this CPU has no AVX-512 to hide"
  if "cpuid_fault" not in flags:
    return "this CPU offers no CPUID faulting"
  if shutil.which(os.environ.get("CC", "cc")) is None:
    return "no C compiler"
  return ""


pytestmark = pytest.mark.skipif(bool(_why_not()), reason=_why_not())


def _run(tmp_path, code, *, tool=True, env=None, timeout=120):
  """``python -c code``, under the tool or natively (even inside the tool)."""
  cmd = [sys.executable, "-c", code]
  if tool:
    cmd = ["bash", TOOL, *cmd]
  env = {**os.environ, "AS_AVX2_DIR": str(tmp_path), **(env or {})}
  env.pop("LD_PRELOAD", None)
  return subprocess.run(
    cmd, capture_output=True, text=True, timeout=timeout, env=env
  )


NUMPY_FEATURES = (
  "import numpy as np\n"
  "f = np._core._multiarray_umath.__cpu_features__\n"
  "print(f['AVX2'], f['FMA3'], f['F16C'], f['AVX512F'], f['AVX512BW'])\n"
)


def test_numpy_sees_avx2_and_no_avx512_under_the_tool(tmp_path):
  """The CPUID probe of numpy: AVX2, FMA and F16C kept, AVX-512 gone."""
  native = _run(tmp_path, NUMPY_FEATURES, tool=False)
  assert native.stdout.split() == ["True"] * 5, native.stderr
  under = _run(tmp_path, NUMPY_FEATURES)
  assert under.returncode == 0, under.stderr
  assert under.stdout.split() == ["True", "True", "True", "False", "False"]


def test_xla_compiles_for_avx2_under_the_tool(tmp_path):
  """XLA:CPU's target, as its dump records it: AVX2 on, AVX-512 off."""
  code = (
    "import jax, jax.numpy as jnp\n"
    "print(jax.jit(lambda x: x * 2)(jnp.ones(4)).sum())\n"
  )
  features = {}
  for tool in (False, True):
    dump = tmp_path / f"dump_{tool}"
    out = _run(
      tmp_path,
      code,
      tool=tool,
      env={"XLA_FLAGS": f"--xla_dump_to={dump}", "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr
    found = sorted(dump.rglob("topology.textproto"))
    if not found:
      pytest.skip("this jax writes no topology.textproto in its dumps")
    text = found[0].read_text()
    features[tool] = {f: f"+{f}" in text for f in ("avx2", "avx512f")}
  assert features[False] == {"avx2": True, "avx512f": True}
  assert features[True] == {"avx2": True, "avx512f": False}


@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_real_segfault_still_kills_the_process(tmp_path, faulthandler):
  """A fault that is not CPUID: the program's handler runs, then it dies."""
  code = (
    "import ctypes, faulthandler\n"
    f"if {faulthandler}: faulthandler.enable()\n"
    "ctypes.string_at(0)\n"
  )
  out = _run(tmp_path, code, timeout=60)
  assert out.returncode == -signal.SIGSEGV
  printed = "Fatal Python error: Segmentation fault" in out.stderr
  assert printed == faulthandler
