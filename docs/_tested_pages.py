"""The docs pages that state their outputs, which the test suite runs.

A page states an output with a ``# -> ...`` line in a code cell;
tests/test_readme.py runs every such page and checks what it prints.
`.ci/run` builds the docs after the suite, with ``JAXMP_DOCS_TESTED=1``:
docs/conf.py then leaves these pages unexecuted, and runs the others.
"""

import glob
import os
import re

STATED = re.compile(r"^# -> ?", re.M)


def pages_with_stated_outputs(docs_dir: str) -> list[str]:
  """The ``.md`` pages under ``docs_dir`` with a ``# ->`` line, relative."""
  pages = []
  for path in glob.glob(os.path.join(docs_dir, "**", "*.md"), recursive=True):
    if "_build" in path:
      continue
    with open(path, encoding="utf-8") as f:
      if STATED.search(f.read()):
        pages.append(os.path.relpath(path, docs_dir))
  return sorted(pages)
