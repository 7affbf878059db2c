"""Runs the README's library example against an installed jaxmp.

  python tools/check_wheel.py README.md

`.ci/run` runs it from a fresh venv that holds only the built wheel and
its dependencies (no extras): it checks that the jaxmp imported is the
installed one, not a checkout, that it ships ``py.typed``, that flax is not
installed, and runs the
README's ```` ```python ```` block under "## The library in 20 lines"; the
``# -> ...`` lines after a statement are what it prints (``...`` is any
text). Exits non-zero, saying why, on the first difference.
"""

import contextlib
import io
import re
import sys

HEADING = "## The library in 20 lines"


def example(readme: str) -> str:
  """The first ```` ```python ```` block after the library heading."""
  at = readme.find(HEADING)
  if at < 0:
    raise SystemExit(f"check_wheel: no {HEADING!r} section in the README")
  m = re.search(r"```python\n(.*?)```", readme[at:], re.S)
  if m is None:
    raise SystemExit(f"check_wheel: no python block under {HEADING!r}")
  return m.group(1)


def expected(source: str) -> list[str]:
  """The ``# -> ...`` lines of the block, in order."""
  return [
    m.group(1).strip() for m in re.finditer(r"^# -> ?(.*)$", source, re.M)
  ]


def matches(want: str, got: str) -> bool:
  """Whether ``got`` is ``want``, where ``...`` in ``want`` is any text."""
  parts = [re.escape(p) for p in want.split("...")]
  return re.fullmatch(".*?".join(parts), got.strip(), re.S) is not None


def main(path: str) -> None:
  """Checks the installed jaxmp, then runs the README's example."""
  import jaxmp  # pylint: disable=g-import-not-at-top

  if "site-packages" not in jaxmp.__file__:
    raise SystemExit(f"check_wheel: jaxmp from {jaxmp.__file__}, not a wheel")
  from importlib import resources  # pylint: disable=g-import-not-at-top

  if not resources.files("jaxmp").joinpath("py.typed").is_file():
    raise SystemExit("check_wheel: the wheel has no jaxmp/py.typed")
  try:
    import flax  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    pass
  else:
    raise SystemExit("check_wheel: flax is installed; the venv has extras")
  with open(path) as f:
    source = example(f.read())
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(source, path, "exec"), {"__name__": "__main__"})  # pylint: disable=exec-used
  got = out.getvalue().splitlines()
  want = expected(source)
  if len(got) != len(want) or not all(map(matches, want, got)):
    raise SystemExit(
      "check_wheel: the README's example printed\n  "
      + "\n  ".join(got)
      + "\ninstead of\n  "
      + "\n  ".join(want)
    )
  print(
    f"check_wheel: jaxmp {jaxmp.__version__} from {jaxmp.__file__}: the "
    f"README's example ran and printed its {len(want)} lines"
  )


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "README.md")
