"""The library's layout: floors, no import circle, rooms of a readable size.

The import graph is read from the source (``ast``), not from ``sys.modules``:
every ``import`` and ``from ... import`` statement counts, at module level or
inside a function (a lazy import closes a circle as surely as a top-level
one, it only hides it until the function runs).
"""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "jaxmp", "_src")
# The longest file of each package; the library's folder share of its lines.
MAX_LINES = {"jaxmp": 550, "cifar_train": 700}
MAX_FOLDER_SHARE = 0.30


def _modules(package: str, root: str = ROOT) -> dict[str, str]:
  """``{dotted module name: path}`` of every ``.py`` file under ``package``."""
  out = {}
  for folder, _, files in os.walk(os.path.join(root, package)):
    for f in files:
      if not f.endswith(".py"):
        continue
      path = os.path.join(folder, f)
      parts = os.path.relpath(path, root)[: -len(".py")].split(os.sep)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
  """The absolute module a ``from`` statement names (relative ones too)."""
  if not node.level:
    return node.module or ""
  base = module.split(".")
  # From a package's __init__, "." is the package itself.
  base = base[: len(base) - node.level + (1 if is_package else 0)]
  return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: str, known: set[str]) -> set[str]:
  """The modules of ``known`` that ``module`` imports, anywhere in its body."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  is_package = path.endswith("__init__.py")
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = _resolve(module, is_package, node)
      # `from jaxmp._src.x import y`: y is a module where one is named so,
      # else a name defined in x.
      names = [
        f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
        for a in node.names
      ]
    else:
      continue
    for name in names:
      # `import jaxmp._src.x.y` names the deepest module that exists.
      while name and name not in known:
        name = name.rpartition(".")[0]
      if name and name != module:
        found.add(name)
  return found


def import_graph(package: str, root: str = ROOT) -> dict[str, set[str]]:
  """``{module: the modules of package it imports}``."""
  modules = _modules(package, root)
  return {m: _imports(m, p, set(modules)) for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
  """One circle of ``graph`` as ``[a, b, ..., a]``, or ``[]`` where none."""
  done, path, on_path = set(), [], set()

  def visit(node):
    path.append(node)
    on_path.add(node)
    for nxt in sorted(graph.get(node, ())):
      if nxt in on_path:
        return path[path.index(nxt) :] + [nxt]
      if nxt not in done:
        cycle = visit(nxt)
        if cycle:
          return cycle
    path.pop()
    on_path.discard(node)
    done.add(node)
    return []

  for node in sorted(graph):
    if node not in done:
      cycle = visit(node)
      if cycle:
        return cycle
  return []


def _folder(module: str) -> str:
  """A ``jaxmp._src`` module's concern folder (root modules: ``_src``)."""
  parts = module.split(".")
  if len(parts) > 2 and os.path.isdir(
    os.path.join(ROOT, "jaxmp", "_src", parts[2])
  ):
    return parts[2]
  return "_src"


def test_the_graph_sees_lazy_relative_and_module_imports(tmp_path):
  # The reader itself, on a package made for it: a lazy import inside a
  # function, a relative one, and `from pkg import module`.
  pkg = tmp_path / "pkg"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from pkg.sub import b\n")
  (pkg / "sub" / "b.py").write_text("from . import c\n")
  (pkg / "sub" / "c.py").write_text("def f():\n  import pkg.a\n")
  graph = import_graph("pkg", str(tmp_path))
  assert graph["pkg.a"] == {"pkg.sub.b"}
  assert graph["pkg.sub.b"] == {"pkg.sub.c"}
  assert graph["pkg.sub.c"] == {"pkg.a"}
  assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]


def test_jaxmp_has_no_import_circle():
  graph = import_graph("jaxmp")
  # The graph is the library's: the transform and autocast are in it.
  assert "jaxmp._src.inspect.placement" in graph["jaxmp._src.inspect.accessors"]
  assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))


def test_concern_folders_import_in_one_direction():
  # Folders of jaxmp/_src as a graph of their own: no folder imports one that
  # imports it back (docs/development.md gives their order).
  graph = import_graph("jaxmp")
  folders: dict[str, set[str]] = {}
  for module, deps in graph.items():
    if not module.startswith("jaxmp._src."):
      continue
    here = _folder(module)
    for dep in deps:
      if dep.startswith("jaxmp._src.") and _folder(dep) != here:
        folders.setdefault(here, set()).add(_folder(dep))
  assert folders.get("_src", set()) == set(), "root modules import a folder"
  assert find_cycle(folders) == [], " -> ".join(find_cycle(folders))


def _bullets(package_dir: str) -> list[tuple[str, str]]:
  """``[(name, line)]`` of the ``* ``name``: ...`` lines of a docstring.

  A bullet is one line: the line after it is another bullet or blank.
  """
  with open(os.path.join(package_dir, "__init__.py")) as f:
    doc = ast.get_docstring(ast.parse(f.read())) or ""
  lines = doc.splitlines() + [""]
  out = []
  for line, after in zip(lines, lines[1:]):
    m = re.match(r"\* ``(\w+/?)``: ", line)
    if m:
      assert after == "" or after.startswith("* "), (package_dir, after)
      out.append((m.group(1), line))
  return out


def floors() -> dict[str, int]:
  """``{root module or folder: floor}``, from ``jaxmp/_src``'s docstring.

  The root modules are floor 0; the folders follow in the docstring's order.
  """
  out, floor = {}, 0
  for name, _ in _bullets(SRC):
    if name.endswith("/"):
      floor += 1
    out[name.rstrip("/")] = floor
  return out


def _floor_of(module: str, table: dict[str, int]) -> int:
  name = module.split(".")[2]  # jaxmp._src.<name>[...]
  return table[name]


def test_the_src_docstring_lists_every_root_module_and_folder_in_floors():
  table = floors()
  names = {
    f[: -len(".py")] if f.endswith(".py") else f
    for f in os.listdir(SRC)
    if f != "__init__.py"
    and (
      f.endswith(".py") or os.path.isfile(os.path.join(SRC, f, "__init__.py"))
    )
  }
  assert set(table) == names
  # The root modules come first, on the ground floor.
  assert {n for n, f in table.items() if f == 0} == {
    n for n in names if os.path.isfile(os.path.join(SRC, n + ".py"))
  }


def test_no_import_runs_up_a_floor():
  # jaxmp/_src's docstring orders the floors; a module imports only from its
  # own floor or those below it.
  table = floors()
  graph = import_graph("jaxmp")
  up = [
    f"{module} -> {dep}"
    for module, deps in graph.items()
    if module.startswith("jaxmp._src.")
    for dep in deps
    if dep.startswith("jaxmp._src.")
    and _floor_of(dep, table) > _floor_of(module, table)
  ]
  assert not up, up


def test_each_folder_docstring_gives_each_file_one_line():
  for folder in sorted(os.listdir(SRC)):
    path = os.path.join(SRC, folder)
    if not os.path.isfile(os.path.join(path, "__init__.py")):
      continue
    files = {
      f[: -len(".py")]
      for f in os.listdir(path)
      if f.endswith(".py") and f != "__init__.py"
    }
    bullets = _bullets(path)
    assert sorted(n for n, _ in bullets) == sorted(files), folder
    assert all(len(line) <= 80 for _, line in bullets), folder


def _lines(path: str) -> int:
  with open(path) as f:
    return sum(1 for _ in f)


def test_no_folder_holds_over_30_percent_of_the_library():
  total = sum(_lines(p) for p in _modules("jaxmp").values())
  share = {}
  for module, path in _modules("jaxmp").items():
    if module.count(".") >= 2 and _folder(module) != "_src":
      share[_folder(module)] = share.get(_folder(module), 0) + _lines(path)
  big = {k: round(v / total, 3) for k, v in share.items()}
  assert max(big.values()) <= MAX_FOLDER_SHARE, big


@pytest.mark.parametrize("package", ["jaxmp", "cifar_train"])
def test_no_file_is_too_long(package):
  long = {}
  for path in _modules(package).values():
    n = _lines(path)
    if n > MAX_LINES[package]:
      long[os.path.relpath(path, ROOT)] = n
  assert not long, f"over {MAX_LINES[package]} lines: {long}"
