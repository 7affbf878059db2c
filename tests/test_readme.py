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
  stats = namespace["jax"].device_get(
    namespace["jaxmp"].stats(namespace["opt_state"])
  )
  assert int(stats["skipped_steps"]) == 0
  assert float(stats["loss_scale"]) == 2.0**15


def test_readme_starts_with_install_and_test_commands():
  with open(os.path.join(ROOT, "README.md")) as f:
    first_block = re.search(r"```bash\n(.*?)```", f.read(), re.S).group(1)
  lines = first_block.strip().splitlines()
  assert 'pip install -e ".[dev]"' in lines[0]
  test_command = (
    "python -m pytest -q -n 2 -m 'not invariant' && JAXMP_DEFAULT_XLA_FLAGS=1 "
    "python -m pytest -q -n 2 -m invariant"
  )
  assert lines[1] == test_command
  assert lines[2].startswith("pip install .")
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    assert test_command in f.read()


def test_every_python_block_of_the_readme_runs():
  with open(os.path.join(ROOT, "README.md")) as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
  assert len(blocks) >= 5
  for i, block in enumerate(blocks):
    exec(compile(block, f"README.md block {i}", "exec"), {})  # pylint: disable=exec-used
