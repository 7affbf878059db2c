"""Sphinx configuration: MyST notebooks executed at build, autodoc API pages.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``
(needs ``pip install -e ".[docs]"``).
"""

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
sys.path.insert(0, ROOT)  # the working tree's jaxmp, not an installed one
sys.path.insert(0, DOCS)

# The guides' kernels inherit this environment: CPU, quiet TensorFlow, and
# the checkout on the path. Set before anything imports jax.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The fast-compile flags of the test suite: the examples compile in a fraction
# of the time, and what they print and assert does not depend on them.
os.environ.setdefault(
  "XLA_FLAGS",
  "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
)
os.environ["PYTHONPATH"] = os.pathsep.join(
  p for p in (ROOT, os.environ.get("PYTHONPATH")) if p
)

from docutils.parsers.rst import Directive  # noqa: E402

import jaxmp  # noqa: E402
from _tested_pages import pages_with_stated_outputs  # noqa: E402

project = "jaxmp"
author = "the jaxmp authors"
copyright = "2026, the jaxmp authors"  # noqa: A001
release = jaxmp.__version__
version = release

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "**.ipynb_checkpoints"]
templates_path = ["_templates"]

# Single backticks in docstrings (`mixed_precision`) are Python references.
default_role = "py:obj"

# API reference: one generated page per public name (autosummary stubs are
# written under api/_autosummary/, which git ignores).
autosummary_generate = True
autosummary_imported_members = True
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # `Attributes:` as fields, not duplicate targets
napoleon_use_rtype = False
napoleon_attr_annotations = False  # the docstrings say what each field holds

# Guides: MyST-markdown notebooks, executed on every build; any error fails it.
nb_execution_mode = "force"
# JAXMP_DOCS_TESTED=1 (`.ci/run`, after the test suite): the pages that state
# their outputs are left unexecuted here, because the suite has just run each
# of them and checked what it prints (docs/_tested_pages.py); the other pages
# still run here.
if os.environ.get("JAXMP_DOCS_TESTED") == "1":
  nb_execution_excludepatterns = pages_with_stated_outputs(DOCS)
nb_execution_raise_on_error = True
nb_execution_timeout = 300  # per cell; loaded CI machines are slow
nb_execution_show_tb = True
nb_merge_streams = True
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3
suppress_warnings = ["mystnb.unknown_mime_type"]

html_theme = "furo"
html_title = f"jaxmp {release}"
html_static_path = []


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
  """Leaves NamedTuple fields to the class's ``Attributes:`` section."""
  del app, what, name, options
  doc = getattr(obj, "__doc__", None) or ""
  return True if doc.startswith("Alias for field number") else skip


def _attribute_docstring(app, what, name, obj, options, lines):
  """Gives re-exported data (``jaxmp.PRESETS``) the docstring of its source.

  autodoc reads attribute docstrings from the module it documents, and
  ``jaxmp/__init__.py`` only imports them from ``jaxmp._src``.
  """
  del app, options
  if what not in ("data", "attribute") or "." not in name:
    return
  from sphinx.pycode import ModuleAnalyzer  # pylint: disable=g-import-not-at-top

  short = name.rsplit(".", 1)[1]
  for modname, module in sorted(sys.modules.items()):
    if not modname.startswith("jaxmp._src") or module is None:
      continue
    if getattr(module, short, None) is not obj:
      continue
    doc = ModuleAnalyzer.for_module(modname).find_attr_docs().get(("", short))
    if doc:
      lines[:] = list(doc)
      return


def _public_signature(app, what, name, obj, options, signature, annotation):
  """Signatures in public names: ``jaxmp.X``, not ``jaxmp._src.mod.X``.

  Also writes a dtype default (``<class 'jax.numpy.float16'>``) as
  ``jnp.float16``.
  """
  del app, what, name, obj, options
  import re  # pylint: disable=g-import-not-at-top

  def fix(text):
    if not text:
      return text
    text = re.sub(r"<class '(?:jax\.numpy)\.(\w+)'>", r"jnp.\1", text)
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    text = re.sub(r"~(?:[\w]+\.)*(\w+)", r"\1", text)  # ~typing.Any: Any
    for public in ("jaxmp", "jaxmp.nn", "jaxmp.models"):
      module = sys.modules.get(public)
      for short in getattr(module, "__all__", ()):
        text = re.sub(
          rf"~?jaxmp\._src\.(?:\w+\.)+{short}\b", f"{public}.{short}", text
        )
    return text

  return fix(signature), fix(annotation)


def _document_jaxmp_aliases_as_classes():
  """Documents a class re-exported under another name as itself.

  ``jaxmp.nn.BatchNorm`` is ``FusedBatchNorm`` of ``jaxmp._src``: autodoc
  would write "alias of FusedBatchNorm" and leave its docstring out. Sphinx 9
  decides that in a property of its class records, older Sphinx in
  ``ClassDocumenter.import_object``; a jaxmp class is never an alias here.
  """
  try:
    from sphinx.ext.autodoc import _property_types  # pylint: disable=g-import-not-at-top
  except ImportError:
    _property_types = None
  if _property_types is not None:
    record = _property_types._ClassDefProperties  # pylint: disable=protected-access
    plain = record.doc_as_attr

    def doc_as_attr(self):
      module = getattr(self, "_obj___module__", None) or ""
      return False if module.startswith("jaxmp.") else plain.fget(self)

    record.doc_as_attr = property(doc_as_attr)
    return None
  from sphinx.ext.autodoc import ClassDocumenter  # pylint: disable=g-import-not-at-top

  class PublicClassDocumenter(ClassDocumenter):
    priority = ClassDocumenter.priority + 1

    def import_object(self, raiseerror: bool = False) -> bool:
      ok = super().import_object(raiseerror)
      if ok and getattr(self.object, "__module__", "").startswith("jaxmp."):
        self.doc_as_attr = False
      return ok

  return PublicClassDocumenter


class _ExamplesGallery(Directive):
  """``.. jaxmp-examples::``: a section for each ``examples/*.py``.

  Each section is the script's docstring (its first line the title) and its
  source; a new script in ``examples/`` shows up without an edit here.
  """

  has_content = False

  def run(self):
    """Inserts the sections as reStructuredText into the page."""
    import ast  # pylint: disable=g-import-not-at-top
    import glob  # pylint: disable=g-import-not-at-top

    env = self.state.document.settings.env
    lines = []
    for path in sorted(glob.glob(os.path.join(ROOT, "examples", "*.py"))):
      name = os.path.basename(path)
      env.note_dependency(path)
      with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or name
      title, _, body = doc.partition("\n")
      title = f"``{name}``: {title.rstrip('.')}"
      lines += [title, "-" * len(title), "", *body.strip().splitlines(), ""]
      lines += [
        f".. literalinclude:: ../examples/{name}",
        "   :language: python",
        "   :caption: " + f"examples/{name}",
        "",
      ]
    self.state_machine.insert_input(lines, os.path.join(ROOT, "examples"))
    return []


def setup(app):
  """Registers the hooks, the class documenter and the gallery above."""
  app.connect("autodoc-skip-member", _skip_namedtuple_fields)
  app.connect("autodoc-process-docstring", _attribute_docstring)
  app.connect("autodoc-process-signature", _public_signature)
  documenter = _document_jaxmp_aliases_as_classes()
  if documenter is not None:
    app.registry.documenters["class"] = documenter
  app.add_directive("jaxmp-examples", _ExamplesGallery)
