"""Every file or folder of the repository named in its text exists.

A docstring, a message, a comment or a doc page that sends the reader to
``jaxmp/_src/x.py``, ``bench/x.py``, ``tools/x.sh`` or ``docs/x.md`` must
send them somewhere: a file moved or removed takes its mentions with it.
Read from the source as text: docstrings, strings (the app's messages and
data-set descriptions) and comments alike, in the library, the app, the
benchmarks, the examples, the tools, the configs and the doc pages. The
tests themselves and the changelog (history) are not read.
"""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A repository path: a top folder, then a file with an extension or a
# folder ending in "/".
TOPS = "jaxmp|cifar_train|bench|tools|examples|tests|docs|configs|\\.ci"
EXTENSIONS = "py|sh|md|rst|c|npz|pth|json|toml|txt|png|yml|yaml|cfg"
PATH = re.compile(
  rf"(?<![\w/.-])((?:{TOPS})/(?:[\w.-]+/)*(?:[\w.-]+\.(?:{EXTENSIONS})\b|))"
  r"(?![\w*<-])"
)
READ = ["jaxmp", "cifar_train", "bench", "examples", "tools", "docs", "configs"]
READ_FILES = ["README.md", "train.py", "pyproject.toml", "bench/README.md"]
SUFFIXES = (".py", ".md", ".rst", ".sh", ".c", ".toml")
# Written by commands, ignored by git (each is in .gitignore).
GENERATED = ("docs/_build/", "bench/.gpu_data/", "bench/.gpu_site/",
             "bench/gpu_wheels/")  # fmt: skip
# Named as examples of a form, not as files: a config that is not there
# (the error it gives), a test file's name in a how-to.
PLACEHOLDERS = {
  "configs/nope.py",
  "examples/NAME.py",
  "tests/test_foo.py",
  "tests/test_x.py",
}
# Other projects' files, named as theirs (flax's examples).
ELSEWHERE = {"examples/imagenet/train.py"}


def _sources() -> list[str]:
  out = [os.path.join(ROOT, f) for f in READ_FILES]
  for top in READ:
    for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
      dirs[:] = [d for d in dirs if d not in ("_build", "__pycache__")]
      rel = os.path.relpath(folder, ROOT) + "/"
      if rel.startswith(GENERATED):
        continue
      out += [os.path.join(folder, f) for f in files if f.endswith(SUFFIXES)]
  return sorted(set(out))


def named_paths(text: str) -> set[str]:
  """The repository paths ``text`` names."""
  return {m.group(1) for m in PATH.finditer(text)}


def test_the_reader_finds_paths_and_only_paths():
  text = (
    "see ``jaxmp/_src/state/pytrees.py``, bench/README.md, (tools/as_avx2.sh)"
    " and docs/guides/; not jaxmp/optax, tests/test_<module>.py, "
    "docs/pictures/make_*.py, my_bench/x.py or https://x.org/docs/a.md"
  )
  assert named_paths(text) == {
    "jaxmp/_src/state/pytrees.py",
    "bench/README.md",
    "tools/as_avx2.sh",
    "docs/guides/",
  }


def test_the_generated_folders_are_ignored_by_git():
  with open(os.path.join(ROOT, ".gitignore")) as f:
    ignored = f.read().split()
  assert all(g in ignored for g in GENERATED)


@pytest.mark.parametrize("top", READ + ["README.md and the entry point"])
def test_every_path_named_exists(top):
  missing = {}
  for source in _sources():
    rel = os.path.relpath(source, ROOT)
    if rel.split("/")[0] != top and not (
      top.startswith("README") and rel in READ_FILES
    ):
      continue
    with open(source, errors="replace") as f:
      names = named_paths(f.read())
    for name in names - PLACEHOLDERS - ELSEWHERE:
      if name.startswith(GENERATED):
        continue
      if not os.path.exists(os.path.join(ROOT, name)):
        missing.setdefault(name, []).append(rel)
  assert not missing, missing
