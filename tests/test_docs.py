"""The API reference lists exactly the public names (no Sphinx build here).

Each page under ``docs/api/`` sets ``.. currentmodule::`` and lists names in
``.. autosummary::`` blocks; Sphinx generates a page for each. This test reads
those sources and compares them with ``__all__``: when a public name is added
(or removed), it says which line to add to (or remove from) which page.
"""

import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API = os.path.join(ROOT, "docs", "api")
MODULES = ("jaxmp", "jaxmp.nn", "jaxmp.models")


def documented_names(text):
  """``{module: [name, ...]}`` listed in the autosummary blocks of ``text``.

  A name's module is the last ``.. currentmodule::`` above its block. Names
  are returned in page order, duplicates kept (the test rejects them).
  """
  names = {}
  module = None
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    line = lines[i]
    current = re.match(r"\.\. (?:py:)?currentmodule:: *(\S+)\s*$", line)
    if current:
      module = current.group(1)
    elif re.match(r"\.\. autosummary::\s*$", line):
      if module is None:
        raise ValueError(f"autosummary before any currentmodule: {line!r}")
      i += 1
      # The directive's body: indented lines, options (":toctree: x") first.
      while i < len(lines) and (not lines[i].strip() or lines[i][0] == " "):
        entry = lines[i].strip()
        if entry and not entry.startswith(":"):
          name = entry.split()[0].lstrip("~")
          if name.startswith(module + "."):
            name = name[len(module) + 1 :]
          names.setdefault(module, []).append(name)
        i += 1
      continue
    i += 1
  return names


def api_pages():
  pages = {}
  for fname in sorted(os.listdir(API)):
    if fname.endswith((".rst", ".md")):
      with open(os.path.join(API, fname)) as f:
        pages[fname] = f.read()
  return pages


def test_parser_reads_blocks_options_and_modules():
  text = """
.. currentmodule:: jaxmp

.. autosummary::
   :toctree: _autosummary

   mixed_precision
   ~jaxmp.stats

Some text.

.. currentmodule:: jaxmp.nn

.. autosummary::

   BatchNorm
not_in_a_block
"""
  assert documented_names(text) == {
    "jaxmp": ["mixed_precision", "stats"],
    "jaxmp.nn": ["BatchNorm"],
  }


@pytest.mark.parametrize("module_name", MODULES)
def test_reference_lists_exactly_the_public_names(module_name):
  module = importlib.import_module(module_name)
  assert hasattr(module, "__all__"), f"{module_name} has no __all__"
  listed = []
  where = {}
  for fname, text in api_pages().items():
    for name in documented_names(text).get(module_name, []):
      listed.append(name)
      where.setdefault(name, []).append(fname)
  missing = sorted(set(module.__all__) - set(listed), key=str.lower)
  extra = sorted(set(listed) - set(module.__all__), key=str.lower)
  twice = sorted({n for n in listed if listed.count(n) > 1}, key=str.lower)
  page = "docs/api/" + (module_name.split(".", 1)[1:] or ["jaxmp"])[0] + ".rst"
  assert not missing, (
    f"{module_name}.__all__ names missing from the API reference: {missing}; "
    f"add one line each to an autosummary block of {page}"
  )
  assert not extra, (
    f"the API reference lists names not in {module_name}.__all__: "
    f"{ {n: where[n] for n in extra} }; remove those lines"
  )
  assert not twice, f"listed more than once: { {n: where[n] for n in twice} }"


def test_every_listed_module_is_public_and_every_page_is_in_the_toctree():
  pages = api_pages()
  for fname, text in pages.items():
    for module_name in documented_names(text):
      assert module_name in MODULES, f"{fname} documents {module_name}"
  with open(os.path.join(API, "index.rst")) as f:
    index = f.read()
  for fname in pages:
    stem = os.path.splitext(fname)[0]
    if stem != "index":
      assert re.search(rf"^\s+{stem}\s*$", index, re.M), (
        f"docs/api/index.rst's toctree misses {stem}"
      )
