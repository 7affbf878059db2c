"""The README's Python blocks run and print what the README says they print.

Convention: comment lines ``# -> <text>`` right after a top-level statement
of a ```` ```python ```` block are the lines that statement prints, in order
(a loop's lines after the loop). ``...`` inside a line matches any text, and
a line that is only ``...`` matches any number of lines. A number written
with a decimal point matches within one unit of its last written digit
(``0.89610`` matches 0.89609 to 0.89611), an integer exactly: what a
statement prints on any x86-64 CPU, not the digits of one run. Statements without ``# ->`` lines may print anything.
"""

import ast
import contextlib
import io
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
EXPECTED = re.compile(r"^# -> ?(.*)$")
NUMBER = r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?"


def python_blocks(text: str) -> list[tuple[int, str]]:
  """``(first line number, source)`` of each ```` ```python ```` block."""
  out = []
  for m in re.finditer(r"```python\n(.*?)```", text, re.S):
    out.append((text.count("\n", 0, m.start(1)) + 1, m.group(1)))
  return out


def _line_matches(want: str, got: str) -> bool:
  """``got`` is ``want``: ``...`` is any text, numbers to their last digit."""
  pattern, numbers = [], []
  for part in re.split(r"(\.\.\.(?!\d)|" + NUMBER + ")", want.strip()):
    if part == "...":
      pattern.append(".*?")
    elif part and re.fullmatch(NUMBER, part):
      pattern.append(f"({NUMBER})")
      numbers.append(part)
    elif part:
      pattern.append(r"\s+".join(map(re.escape, part.split())))
      pattern.append(r"\s*" if part[-1:].isspace() else "")
      if part[:1].isspace():
        pattern.insert(-2, r"\s*")
  m = re.fullmatch("".join(pattern), got.strip())
  if m is None:
    return False
  for w, g in zip(numbers, m.groups()):
    if not re.search(r"[.eE]", w):
      if int(w) != int(float(g)):
        return False
      continue
    digits = len(w.split("e")[0].split("E")[0].split(".")[1])
    unit = 10.0**-digits * (
      10.0 ** int(w.lower().split("e")[1]) if "e" in w.lower() else 1
    )
    if abs(float(g) - float(w)) > unit * (1 + 1e-9):
      return False
  return True


def output_matches(want: list[str], got: list[str]) -> bool:
  """Lines ``got`` match lines ``want`` (a lone ``...`` spans lines)."""
  if not want:
    return not got
  if want[0].strip() == "...":
    return any(output_matches(want[1:], got[i:]) for i in range(len(got) + 1))
  return (
    bool(got)
    and _line_matches(want[0], got[0])
    and (output_matches(want[1:], got[1:]))
  )


def run_block(source: str, filename: str) -> list[tuple[int, list, list]]:
  """Runs ``source`` a statement at a time; ``(line, want, got)`` checked.

  One entry per statement followed by ``# ->`` lines; the caller asserts.
  """
  lines = source.splitlines()
  namespace, checks = {}, []
  for stmt in ast.parse(source, filename).body:
    want = []
    for line in lines[stmt.end_lineno :]:
      m = EXPECTED.match(line)
      if not m:
        break
      want.append(m.group(1))
    out = io.StringIO()
    code = compile(ast.Module([stmt], type_ignores=[]), filename, "exec")
    with contextlib.redirect_stdout(out):
      exec(code, namespace)  # pylint: disable=exec-used
    if want:
      checks.append((stmt.lineno, want, out.getvalue().splitlines()))
  return checks


with open(README) as _f:
  BLOCKS = python_blocks(_f.read())


@pytest.mark.parametrize(
  "start, source", BLOCKS, ids=[f"line{start}" for start, _ in BLOCKS]
)
def test_python_block_runs_and_prints_what_the_readme_says(start, source):
  for line, want, got in run_block(source, f"README.md:{start}"):
    assert output_matches(want, got), (
      f"README.md line {start + line - 1} prints\n"
      + "\n".join(got)
      + "\nbut the README says\n"
      + "\n".join(want)
    )


def test_readme_has_blocks_and_states_outputs():
  assert len(BLOCKS) >= 5
  stated = sum(
    bool(EXPECTED.match(line))
    for _, source in BLOCKS
    for line in source.splitlines()
  )
  assert stated >= 5


@pytest.mark.parametrize(
  "want, got, ok",
  [
    ("fp32 0.89610", "fp32 0.8960952", True),
    ("fp32 0.89610", "fp32 0.8960852", False),  # 1.1 units off.
    ("fp32 0.89610", "kahan 0.89610", False),
    ("loss 2.286", "loss 2.2869", True),
    ("loss 2.286", "loss 2.2875", False),
    (
      "{...'loss_scale': array(32768., dtype=float32)...}",
      "{'a': 1, 'loss_scale': array(32768., dtype=float32), 'b': 2}",
      True,
    ),
    (
      "{...'loss_scale': array(32768., dtype=float32)...}",
      "{'a': 1, 'loss_scale': array(16384., dtype=float32), 'b': 2}",
      False,
    ),
    ("skipped_steps 0", "skipped_steps 1", False),
    ("steps 2..2 (1 in a row): ...", "steps 2..2 (1 in a row): bad data", True),
    ("1.5e-3", "0.00151", True),
    ("1.5e-3", "0.00161", False),
  ],
)
def test_output_convention(want, got, ok):
  assert _line_matches(want, got) is ok


def test_output_convention_spans_lines_and_checks_every_statement():
  source = "print('a 1')\n# -> a 1\nfor i in range(3):\n  print(i)\n# -> 0\n# -> ...\n# -> 2\nprint('x')\n"
  checks = run_block(source, "example")
  assert [(line, output_matches(w, g)) for line, w, g in checks] == [
    (1, True),
    (3, True),
  ]
  wrong = run_block("print('a 2')\n# -> a 1\n", "example")
  assert [output_matches(w, g) for _, w, g in wrong] == [False]
  assert not output_matches(["0", "1"], ["0", "1", "2"])  # A line too many.


def test_readme_starts_with_install_and_test_commands(tmp_path):
  with open(README) as f:
    first_block = re.search(r"```bash\n(.*?)```", f.read(), re.S).group(1)
  lines = first_block.strip().splitlines()
  assert 'pip install -e ".[dev]"' in lines[0]
  test_command = (
    "python -m pytest -q -n 2 -m 'not invariant' && JAXMP_DEFAULT_XLA_FLAGS=1 "
    "python -m pytest -q -n 2 -m invariant"
  )
  assert lines[1] == test_command
  assert lines[2].startswith("pip install .")
  # CI runs it through bench/test_time.sh, which reads it from the README:
  # run that with a `python` that only says how it was called.
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    assert "\nbash bench/test_time.sh\n" in f.read()
  fake = tmp_path / "python"
  fake.write_text(
    '#!/bin/sh\necho "python $* default=$JAXMP_DEFAULT_XLA_FLAGS '
    'cache=${JAX_COMPILATION_CACHE_DIR:-none} addopts=$PYTEST_ADDOPTS"\n'
  )
  fake.chmod(0o755)
  env = dict(
    os.environ,
    PATH=f"{tmp_path}:{os.environ['PATH']}",
    JAX_COMPILATION_CACHE_DIR="/a/warm/cache",
    PYTEST_ADDOPTS="",
  )
  env.pop("JAXMP_DEFAULT_XLA_FLAGS", None)
  out = subprocess.run(
    ["bash", os.path.join(ROOT, "bench", "test_time.sh")],
    env=env,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.splitlines()
  calls = [l for l in out if l.startswith("python ")]
  assert calls == [
    "python -m pytest -q -n 2 -m not invariant default= cache=none "
    "addopts=--durations=15 ",
    "python -m pytest -q -n 2 -m invariant default=1 cache=none "
    "addopts=--durations=15 ",
  ]
  halves = [l for l in out if l.startswith("test_time: half")]
  assert [h.split(": ", 3)[-1] for h in halves] == test_command.split(" && ")
