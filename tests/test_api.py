"""The public surface: names, light imports, and who may import what."""

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APP_ONLY = (
  "tensorflow",
  "tensorflow_datasets",
  "orbax",
  "ml_collections",
  "absl",
  "tqdm",
  "tensorboardX",
  "matplotlib",
  "etils",
)

PUBLIC = {
  "jaxmp": (
    "AccumulationState",
    "adjust_loss_scale",
    "all_finite",
    "autocast",
    "AutocastReport",
    "calibrate_loss_scale",
    "check_health",
    "cpu_compiler_options",
    "find_state",
    "BlockRecipe",
    "Fp8Recipe",
    "get_policy",
    "get_preset",
    "initialize",
    "loss_scaler",
    "LossScaleCollapseError",
    "LossScaleConfig",
    "LossScaler",
    "master_params",
    "mixed_precision",
    "no_autocast",
    "multi_steps",
    "MixedPrecisionState",
    "NonFiniteLossError",
    "overflow_report",
    "pmean_grads",
    "Preset",
    "PRESETS",
    "quantize",
    "Reduction",
    "reduction_report",
    "ReductionReport",
    "rollback_if_skipped",
    "rounding_report",
    "scale_loss",
    "SpikeSkip",
    "SpikeStallError",
    "state_shardings",
    "state_summary",
    "StateQuantization",
    "stats",
    "stochastic_round",
    "UnscaledGradientsWarning",
    "value_and_grad",
  ),
  "jaxmp.nn": ("BatchNorm", "conv_general_dilated", "max_pool"),
  "jaxmp.models": (
    "from_torchvision",
    "get_model",
    "read_state_dict",
    "ResNet",
    "resnet18",
    "resnet18_torchvision",
    "to_torchvision",
  ),
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_all_is_pinned(module):
  if module != "jaxmp":  # jaxmp.nn and jaxmp.models need flax
    pytest.importorskip("flax")
  mod = __import__(module, fromlist=["_"])
  assert sorted(mod.__all__) == sorted(PUBLIC[module])
  for name in mod.__all__:
    obj = getattr(mod, name)
    if callable(obj) and getattr(obj, "__module__", "").startswith("jaxmp"):
      assert obj.__doc__, f"{module}.{name} has no docstring"


def _prose_docs() -> dict[str, str]:
  """The README and every docs page (guides, performance, why, development)."""
  paths = [os.path.join(ROOT, "README.md")]
  for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
    if "_build" not in folder:
      paths += [os.path.join(folder, f) for f in files if f.endswith(".md")]
  out = {}
  for path in sorted(paths):
    with open(path) as f:
      out[os.path.relpath(path, ROOT)] = f.read()
  return out


def test_docs_pages_use_every_public_name_and_only_public_names():
  # The API reference lists exactly `__all__` (tests/test_docs.py); this
  # checks the prose: every public name is shown in use on some page, and no
  # page or the README names anything that is not public (a private or
  # removed name, or a deprecated alias written as jaxmp.<old name>).
  docs = _prose_docs()
  text = "\n".join(docs.values())
  for module, names in PUBLIC.items():
    for name in names:
      assert f"{module}.{name}" in text, f"no docs page uses {module}.{name}"
  public = {f"{m}.{n}" for m, names in PUBLIC.items() for n in names}
  public |= set(PUBLIC) | {"jaxmp.__version__"}
  for path, page in docs.items():
    mentioned = set(
      re.findall(r"(?<![/\w])jaxmp\.(?:nn\.|models\.)?[A-Za-z_]\w*", page)
    )
    assert mentioned <= public, (path, sorted(mentioned - public))


def _run(code: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )


def test_import_jaxmp_is_light():
  out = _run(
    "import sys, jaxmp; print(sorted({m.split('.')[0] for m in "
    "sys.modules} & {'flax', 'tensorflow', 'orbax', "
    "'tensorflow_datasets', 'ml_collections', 'torch'}))"
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"


_NO_FLAX = """
import sys
class NoFlax:
  def find_spec(self, name, path=None, target=None):
    if name == "flax" or name.startswith("flax."):
      raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoFlax())
import jaxmp
print(jaxmp.mixed_precision.__name__)
import jaxmp.{module}
"""


@pytest.mark.parametrize("module", ["nn", "models"])
def test_building_blocks_without_flax_fail_with_one_message(module):
  out = _run(_NO_FLAX.replace("{module}", module))
  assert out.stdout.strip() == "mixed_precision"
  assert out.returncode == 1
  last = out.stderr.strip().splitlines()[-1]
  assert last == (
    f"ImportError: jaxmp.{module} needs flax: pip install 'jaxmp[flax]'"
  ), out.stderr
  # One error: the ImportError of flax itself is not chained onto it.
  assert "During handling" not in out.stderr
  assert "direct cause" not in out.stderr


def _imports(path: str) -> set[str]:
  with open(path) as f:
    tree = ast.parse(f.read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      found.add(node.module)
  return found


def _python_files(*parts):
  top = os.path.join(ROOT, *parts)
  if top.endswith(".py"):
    return [top]
  return [
    os.path.join(d, f)
    for d, _, files in os.walk(top)
    for f in files
    if f.endswith(".py")
  ]


def test_the_library_never_imports_the_apps_dependencies():
  for path in _python_files("jaxmp"):
    bad = {m for m in _imports(path) if m.split(".")[0] in APP_ONLY}
    assert not bad, (path, bad)


@pytest.mark.parametrize(
  "part", ["bench", "configs", "train.py", "cifar_train", "examples"]
)
def test_app_bench_and_configs_use_public_names_only(part):
  for path in _python_files(part):
    private = {m for m in _imports(path) if "_src" in m}
    assert not private, (path, private)
    with open(path) as f:
      assert "jaxmp._src" not in f.read(), path
