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


def deprecated_renames():
  """``[(old, new), ...]``: every name the library still reads with a warning.

  Found in the code, not listed by hand: the module-level aliases of
  ``jaxmp`` (its ``_DEPRECATED`` table and functions documented as
  "Deprecated alias of `jaxmp.X`"), the renamed keys of `jaxmp.stats`, and
  the `MixedPrecisionState` properties documented as "Deprecated: `new`".
  """
  import jaxmp  # pylint: disable=g-import-not-at-top
  from jaxmp._src.inspect import accessors  # pylint: disable=g-import-not-at-top

  pairs = [
    (f"jaxmp.{old}", f"jaxmp.{new}")
    for old, (new, _) in jaxmp._DEPRECATED.items()
  ]  # pylint: disable=protected-access
  for name, value in vars(jaxmp).items():
    m = re.match(r"Deprecated alias of `(jaxmp\.\w+)`", value.__doc__ or "")
    if callable(value) and m:
      pairs.append((f"jaxmp.{name}", m.group(1)))
  pairs += [
    (f'["{old}"]', f'["{new}"]')
    for old, new in accessors._RENAMED_STATS.items()  # pylint: disable=protected-access
  ]
  for name, value in vars(jaxmp.MixedPrecisionState).items():
    m = re.match(r"Deprecated: `(\w+)`", getattr(value, "__doc__", "") or "")
    if isinstance(value, property) and m:
      pairs.append(
        (f"MixedPrecisionState.{name}", f"MixedPrecisionState.{m.group(1)}")
      )
  return pairs


def test_changelog_says_what_each_deprecated_name_became_and_when_it_goes():
  pairs = deprecated_renames()
  assert len(pairs) >= 6, pairs  # LossScale, loss_scale, 2 keys, 2 fields
  with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
    rows = [line for line in f if line.startswith("| `")]
  for old, new in pairs:
    assert any(
      re.search(rf"{re.escape(old)}(?!\w)", row.split(" | ")[0])
      and re.search(rf"{re.escape(new)}(?!\w)", row.split(" | ")[1])
      for row in rows
    ), f"CHANGELOG.md has no row '| `{old}` | `{new}` ... |'"
  with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
    assert "removed in 0.2.0" in f.read()


def test_every_example_has_a_title_for_the_gallery():
  # docs/examples.rst renders each examples/*.py under its docstring's first
  # line; a script without one would get a bare file name.
  import ast  # pylint: disable=g-import-not-at-top

  folder = os.path.join(ROOT, "examples")
  scripts = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
  assert scripts
  for name in scripts:
    with open(os.path.join(folder, name)) as f:
      doc = ast.get_docstring(ast.parse(f.read()))
    assert doc and doc.splitlines()[0].strip(), f"examples/{name}: no title"
