"""The README's Python blocks and the guides' code cells print what they say.

The README's ```` ```python ```` blocks run one by one, each in a fresh
namespace. Each docs page with ``# ->`` lines runs its ```` ```{code-cell} ````
cells in order in one fresh namespace, as the docs build's kernel does
(pages without ``# ->`` lines are left to the strict docs build, which
executes every cell).

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
import glob
import io
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
EXPECTED = re.compile(r"^# -> ?(.*)$")
NUMBER = r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?"


def python_blocks(text: str) -> list[tuple[int, str]]:
  """``(first line number, source)`` of each ```` ```python ```` block."""
  out = []
  for m in re.finditer(r"```python\n(.*?)```", text, re.S):
    out.append((text.count("\n", 0, m.start(1)) + 1, m.group(1)))
  return out


def page_source(text: str) -> str:
  """A page's code cells as one program, each line at its line in the page.

  Every other line of the page (prose, fences, cell options) is blank, so
  line numbers in errors and checks are the page's.
  """
  keep = [""] * len(text.splitlines())
  for m in re.finditer(
    r"^```\{code-cell\}[^\n]*\n(.*?)^```", text, re.S | re.M
  ):
    first = text.count("\n", 0, m.start(1))
    body = m.group(1).splitlines()
    if body and body[0].strip() == "---":  # a YAML options header
      end = body.index("---", 1)
      body = [""] * (end + 1) + body[end + 1 :]
    for i, line in enumerate(body):
      keep[first + i] = "" if re.match(r"^:\w[\w-]*:", line) else line
  return "\n".join(keep) + "\n"


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


PAGES = sorted(
  os.path.relpath(p, ROOT)
  for p in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)
  if "_build" not in p
)


def _checked(page: str) -> bool:
  with open(os.path.join(ROOT, page)) as f:
    source = page_source(f.read())
  return any(EXPECTED.match(line) for line in source.splitlines())


CHECKED_PAGES = [p for p in PAGES if _checked(p)]


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


# Pages that print a bitwise equality of two programs (remainder masters are
# fp32 masters bit for bit): checked under XLA's default flags, with the
# exactness claims (the fast-compile flags' older XLA:CPU kernel emitters
# round some fused expressions differently in the two programs).
BITWISE_PAGES = ("docs/guides/master_weights.md",)


@pytest.mark.parametrize(
  "page",
  [
    pytest.param(p, marks=pytest.mark.invariant) if p in BITWISE_PAGES else p
    for p in CHECKED_PAGES
  ],
)
def test_guide_page_runs_and_prints_what_it_says(page):
  with open(os.path.join(ROOT, page)) as f:
    source = page_source(f.read())
  for line, want, got in run_block(source, page):
    assert output_matches(want, got), (
      f"{page} line {line} prints\n"
      + "\n".join(got)
      + "\nbut the page says\n"
      + "\n".join(want)
    )


def test_the_ci_docs_build_leaves_to_the_suite_exactly_the_pages_it_checks():
  """Under ``JAXMP_DOCS_TESTED=1`` docs/conf.py skips executing these pages.

  Each must be one this module runs and checks, and every page it checks
  must be among them (the others run in the docs build).
  """
  import importlib.util  # pylint: disable=g-import-not-at-top

  spec = importlib.util.spec_from_file_location(
    "_tested_pages", os.path.join(DOCS, "_tested_pages.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  left = module.pages_with_stated_outputs(DOCS)
  assert left == sorted(os.path.relpath(p, "docs") for p in CHECKED_PAGES)
  assert "guides/sharded.md" in left and "guides/migrating.md" not in left


def test_the_bitwise_pages_are_pages_it_checks():
  assert BITWISE_PAGES and set(BITWISE_PAGES) <= set(CHECKED_PAGES)


def _stated(source: str) -> int:
  return sum(bool(EXPECTED.match(line)) for line in source.splitlines())


def test_readme_and_guides_have_code_and_state_outputs():
  assert len(BLOCKS) >= 1
  assert sum(_stated(source) for _, source in BLOCKS) >= 2
  # The outputs the README checked before the docs site, now on these pages:
  # none of them may become unchecked.
  stated = {}
  for page in CHECKED_PAGES:
    with open(os.path.join(ROOT, page)) as f:
      stated[page] = _stated(page_source(f.read()))
  required = {
    "loss_scaling.md": 1,
    "diagnostics.md": 3,
    "master_weights.md": 4,
    "frameworks.md": 2,
    "building_blocks.md": 1,
  }
  for name, n in required.items():
    page = os.path.join("docs", "guides", name)
    assert stated.get(page, 0) >= n, f"{page} checks {stated.get(page, 0)}"


def test_page_source_keeps_cells_at_their_lines():
  page = (
    "# T\n\n```{code-cell} ipython3\n:tags: [hide-output]\nprint('a 1')\n"
    "# -> a 1\n```\n\nProse: print('no')\n\n```{code-cell} ipython3\n---\n"
    "tags: [x]\n---\nx = 2\nprint(x)\n# -> 2\n```\n```python\nprint(3)\n```\n"
  )
  source = page_source(page)
  assert source.splitlines()[4] == "print('a 1')"
  checks = run_block(source, "page.md")
  assert [(line, output_matches(w, g)) for line, w, g in checks] == [
    (5, True),
    (16, True),
  ]


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
