"""What rounding costs each layer: steps.jsonl figures and their plot.

With ``config.rounding_every`` the optimizer measures, every N-th applied
step, what each param's half dtype alone loses of its update
(`jaxmp.rounding_report`). On log steps the app records the figures per
leaf, or, where there are more than `MAX_LEAVES` leaves, per group: the
leaves that share the path's first key (a ResNet's ``['layer1_0']``), each
figure the group's worst (largest ``stalled`` and ``flushed``, the
``quality`` farthest from 1). At the end it plots ``stalled`` per group over
the steps (``rounding_stalled.png``).
"""

import os
import re
from typing import Any

MAX_LEAVES = 24
PLOT_NAME = "rounding_stalled.png"


def _group(path: str) -> str:
  """The path's first key: ``['layer1_0']['conv1']['kernel']`` -> layer1_0."""
  m = re.match(r"\[['\"]?([^'\"\]]+)['\"]?\]", path)
  return m.group(1) if m else path


def groups(report: Any, max_leaves: int = MAX_LEAVES) -> dict[str, dict]:
  """``{name: {"stalled", "quality", "flushed"}}`` of a rounding report.

  Per leaf (``name`` the path) up to ``max_leaves`` leaves, else per group
  of the path's first key, with each group's worst figures.
  """
  per_leaf = len(report) <= max_leaves
  out: dict[str, dict] = {}
  for row in sorted(report, key=lambda r: r.path):
    name = row.path if per_leaf else _group(row.path)
    figures = {
      "stalled": row.stalled,
      "quality": row.quality,
      "flushed": row.flushed,
    }
    if name in out:
      old = out[name]
      figures = {
        "stalled": max(old["stalled"], row.stalled),
        "flushed": max(old["flushed"], row.flushed),
        "quality": min(
          (old["quality"], row.quality), key=lambda q: -abs(1 - q)
        ),
      }
    out[name] = figures
  return out


def plot(records: list[dict], workdir: str) -> str:
  """Writes ``rounding_stalled.png``: ``stalled`` per group over the steps.

  Args:
    records: the steps.jsonl records; those with a ``rounding`` entry.
    workdir: where the PNG goes.

  Returns:
    The PNG's path.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  rows = [r for r in records if r.get("rounding")]
  names = sorted({n for r in rows for n in r["rounding"]})
  fig, ax = plt.subplots(figsize=(10, 4.2))
  for name in names:
    points = [
      (r["step"], 100 * r["rounding"][name]["stalled"])
      for r in rows
      if name in r["rounding"]
    ]
    ax.plot(*zip(*points), "-o", ms=3, lw=1, label=name)
  ax.set_title("updates the half dtype alone would lose (stalled)")
  ax.set_xlabel("step")
  ax.set_ylabel("stalled, % of updated elements")
  ax.grid(alpha=0.3)
  if names:
    ax.legend(
      fontsize=6,
      ncol=2 if len(names) > 16 else 1,
      loc="upper left",
      bbox_to_anchor=(1.01, 1.0),
    )
  fig.tight_layout()
  path = os.path.join(workdir, PLOT_NAME)
  fig.savefig(path + ".tmp.png", dpi=90)
  os.replace(path + ".tmp.png", path)
  plt.close(fig)
  return path
