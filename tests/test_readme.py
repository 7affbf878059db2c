"""The README's library example runs and does what it says."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_library_example_runs():
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  example = next(b for b in blocks if "jaxmp.mixed_precision" in b)
  namespace = {}
  exec(compile(example, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  stats = namespace["jax"].device_get(namespace["jaxmp"].stats(
      namespace["opt_state"]))
  assert int(stats["skipped_steps"]) == 0
  assert float(stats["loss_scale"]) == 2.0**15


def test_readme_starts_with_install_and_test_commands():
  with open(os.path.join(ROOT, "README.md")) as f:
    first_block = re.search(r"```bash\n(.*?)```", f.read(), re.S).group(1)
  lines = first_block.strip().splitlines()
  assert "pip install -e \".[dev]\"" in lines[0]
  assert lines[1] == "python -m pytest -q -n 2 tests"
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    assert "python -m pytest -q -n 2 tests" in f.read()
