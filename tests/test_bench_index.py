"""bench/README.md names every script in bench/; the performance page's size."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def _scripts() -> set[str]:
  """Every script of ``bench/`` and its folders, relative to ``bench/``."""
  out = set()
  for folder, dirs, files in os.walk(BENCH):
    dirs[:] = [
      d for d in dirs if not d.startswith((".", "_")) and d != "gpu_wheels"
    ]
    for f in files:
      if f.endswith((".py", ".sh")):
        out.add(os.path.relpath(os.path.join(folder, f), BENCH))
  return out


def _named_in_readme() -> set[str]:
  """The scripts of the README's table rows and of its helpers paragraph."""
  with open(os.path.join(BENCH, "README.md")) as f:
    text = f.read()
  named = set(re.findall(r"^\| `([\w/]+\.(?:py|sh))` \|", text, re.M))
  helpers = re.search(r"^Helpers.*?\n\n", text, re.M | re.S)
  assert helpers, "bench/README.md has no paragraph of helpers"
  return named | set(re.findall(r"`(_\w+\.py)`", helpers.group(0)))


def test_bench_readme_names_every_script_and_only_scripts_that_exist():
  scripts, named = _scripts(), _named_in_readme()
  assert scripts - named == set(), "add a row to bench/README.md"
  assert named - scripts == set(), "bench/README.md names a missing script"


def test_performance_page_stays_under_16_kb():
  size = os.path.getsize(os.path.join(ROOT, "docs", "performance.md"))
  assert size <= 16 * 1024, size
