"""`RoundingReport`: the rounding figures of a state as rows with advice.

`jaxmp.rounding_report` reads the `RoundingFigures` that
``mixed_precision(..., rounding_every=N)`` keeps in its state
(``state/rounding_figures.py`` measures them) and `report` turns them
into one `RoundingRow` per leaf, worst first, with the master-weights mode
each leaf's figures advise.
"""

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import dtypes
from jaxmp._src.scaling import diagnostics
from jaxmp._src.state.rounding_figures import RoundingFigures


# The advice thresholds: a leaf keeps its updates in its half dtype alone
# when at most STALLED_MAX of its updated elements stall, its quality is
# within QUALITY_TOL of 1 and at most FLUSHED_MAX of its values flush.
STALLED_MAX = 0.01
QUALITY_TOL = 0.1
FLUSHED_MAX = 0.01

_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclasses.dataclass(frozen=True)
class RoundingRow(diagnostics.RowMapping):
  """One leaf of a `RoundingReport`; fields read as attributes or keys.

  Attributes:
    path: the param's ``jax.tree_util.keystr``.
    stalled: the share of its updated elements its half dtype loses whole.
    quality: ``<cast(h + u) - h, u> / <u, u>``; 1 is every update landed.
    flushed: the share of its nonzero masters held as zero or subnormal.
    step: the applied step measured (1 for the first; 0: none yet).
    advice: what to do, in words.
    dtype: the param's dtype name.
    measured_as: the half dtype measured (bfloat16 for an fp32 param).
    master_weights: the master-weights mode the advice names (``"none"``
      where the half dtype alone keeps the updates; ``None`` unmeasured).
  """

  path: str
  stalled: float
  quality: float
  flushed: float
  step: int
  advice: str
  dtype: str
  measured_as: str
  master_weights: Optional[str]


def _advise(stalled, quality, flushed, dtype, half) -> tuple[str, str]:
  """``(mode, advice)`` of one measured leaf (see the module's thresholds)."""
  h = _SHORT.get(half, half)
  full = not dtypes.is_half(jnp.dtype(dtype))
  if flushed > FLUSHED_MAX:
    if full:
      return "fp32", f"keep it fp32: {h} would flush {flushed:.0%} of it"
    return "fp32", (
      f"fp32 masters: {h} holds {flushed:.0%} of its values as zero or "
      "subnormal (or bf16 params)"
    )
  if stalled > STALLED_MAX or abs(quality - 1.0) > QUALITY_TOL:
    if full:
      return "fp32", f"keep it fp32: {h} would lose {stalled:.0%} of updates"
    if half == "bfloat16":
      return "remainder", (
        f'{h} loses {stalled:.0%} of updates: master_weights="remainder" '
        '(exact fp32 masters in 2 bytes) or "fp32"'
      )
    return "fp32", f'{h} loses {stalled:.0%} of updates: master_weights="fp32"'
  if full:
    return "none", f"{h} alone would keep its updates"
  return "none", f"{h} alone keeps its updates"


class LeafModes(dict):
  """A per-leaf choice of master weights: path to mode, and a function.

  Pass it as ``mixed_precision(..., master_weights=choice)``: called with
  ``(path, param)`` it returns the mode of that path (``default`` for a path
  it does not name).
  """

  default: str = "fp32"

  def __call__(self, path, param) -> str:
    """The mode of the leaf at ``path``."""
    return self.get(jax.tree_util.keystr(path), self.default)


class RoundingReport(diagnostics.Rows):
  """`RoundingRow`s, worst first; ``str`` is a table."""

  max_rows: int = 12

  @property
  def step(self) -> int:
    """The applied step the figures describe (0: none measured yet)."""
    return self[0].step if self else 0

  def master_weights(self, default: str = "fp32") -> LeafModes:
    """The per-leaf master weights that the advice names.

    Args:
      default: the mode of a leaf the report does not name.

    Returns:
      A `LeafModes`, for ``mixed_precision(master_weights=...)``.

    Raises:
      ValueError: before any step was measured.
    """
    if self and not self.step:
      raise ValueError(
        "no step measured yet: run at least one applied step with "
        "rounding_every before choosing master weights"
      )
    out = LeafModes((r.path, r.master_weights) for r in self)
    out.default = default
    return out

  def __str__(self) -> str:
    """A header, then one line per leaf, worst first.

    The ``as`` column is the half dtype measured (bf16 for an fp32 param).
    """
    if not self.step:
      return f"rounding: no step measured yet ({len(self)} leaves)"
    needy = [r for r in self if r.master_weights != "none"]
    head = (
      f"rounding at applied step {self.step}: {len(needy)} of {len(self)} "
      "leaves lose updates in their half dtype"
    )
    lines = [
      head,
      f"{'stalled':>8} {'quality':>8} {'flushed':>8} {'as':>5}  path: advice",
    ]
    for r in self[: self.max_rows]:
      d = _SHORT.get(r.measured_as, r.measured_as)
      lines.append(
        f"{r.stalled:>8.2%} {r.quality:>8.3f} {r.flushed:>8.2%} {d:>5}  "
        f"{r.path}: {r.advice}"
      )
    if len(self) > self.max_rows:
      lines.append(f"... {len(self) - self.max_rows} more leaves")
    return "\n".join(lines)


def report(figures: RoundingFigures, host: Callable = np.asarray):
  """Host-side rows of ``figures``, worst first.

  Worst is the largest of ``stalled``, ``flushed`` and ``|1 - quality|``;
  ties keep the leaf order.
  """
  stalled = np.asarray(host(figures.stalled)).reshape(-1)
  quality = np.asarray(host(figures.quality)).reshape(-1)
  flushed = np.asarray(host(figures.flushed)).reshape(-1)
  measured = int(np.asarray(host(figures.step)))
  rows = []
  for i, path in enumerate(figures.paths):
    s, q, f = float(stalled[i]), float(quality[i]), float(flushed[i])
    dtype, half = figures.dtypes[i], figures.measured_as[i]
    if measured:
      mode, advice = _advise(s, q, f, dtype, half)
    else:
      mode, advice = None, "not measured yet"
    rows.append(RoundingRow(path, s, q, f, measured, advice, dtype, half, mode))
  order = sorted(
    range(len(rows)),
    key=lambda i: (
      -max(rows[i].stalled, rows[i].flushed, abs(1 - rows[i].quality)),
      i,
    ),
  )
  return RoundingReport(rows[i] for i in order)
