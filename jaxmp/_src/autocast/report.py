"""``debug=True``: where an autocast forward pass first overflowed.

The interpreter calls `check` on every operation with a half-precision
output: a flag (non-finite out from finite in) computed on the device, and
where the operation came from. One ``jax.debug.callback`` per call hands the flags to
`report_fn`, which logs the first hit as an `AutocastReport`.
"""

import dataclasses
import logging
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxmp._src.autocast import _jaxpr_interp as ji
from jaxmp._src.autocast import rules

logger = logging.getLogger("jaxmp")


class AutocastReport(NamedTuple):
  """Where an autocast forward pass first overflowed.

  Attributes:
    primitive: the JAX primitive (e.g. ``"dot_general"``).
    source: the user's source line, ``"file.py:12 (fn)"``.
    name_stack: the Flax/JAX name stack (``jax.named_scope``), or ``""``.
    dtype: the half-precision dtype of the non-finite output.
    layer: where a library layer (Flax, Equinox, jaxmp) ran the operation,
      ``"linear.py:287 (__call__)"``, when ``source`` is the user's line
      that called it; ``""`` when the user's code ran it directly.
  """

  primitive: str
  source: str
  name_stack: str
  dtype: str
  layer: str = ""

  def __str__(self) -> str:
    """One line: the primitive, name stack, source line and layer."""
    where = f" in {self.name_stack}" if self.name_stack else ""
    layer = f" (in the layer at {self.layer})" if self.layer else ""
    return (
      f"autocast: the first non-finite {self.dtype} output from finite "
      f"inputs is {self.primitive}{where} at {self.source}{layer}"
    )


@dataclasses.dataclass
class Sink:
  """Debug flags of one autocast region, in program order."""

  flags: list
  where: list


def check(sink, eqn, invals, outs):
  """Appends a flag: half output non-finite while float inputs were finite."""
  half = [o for o in outs if hasattr(o, "dtype") and o.dtype in rules.HALF]
  if not half:
    return
  floats = [
    x
    for x in invals
    if hasattr(x, "dtype")
    and rules.is_float(x.dtype)
    and not isinstance(x, (np.ndarray, np.generic))
  ]
  finite_in = jnp.bool_(True)
  for x in floats:
    finite_in = finite_in & jnp.all(jnp.isfinite(x))
  bad_out = jnp.bool_(False)
  for o in half:
    bad_out = bad_out | ~jnp.all(jnp.isfinite(o))
  sink.flags.append(finite_in & bad_out)
  d = ji.describe(eqn)
  sink.where.append(
    AutocastReport(
      d.primitive, d.source, d.name_stack, str(half[0].dtype), d.layer
    )
  )


def report_fn(debug, where):
  """The host callback: logs (and hands ``debug``) the first flagged op."""

  def report(flags):
    flags = np.asarray(flags).reshape(-1, len(where))
    hit = np.any(flags, axis=0)
    if not hit.any():
      return
    rep = where[int(np.argmax(hit))]
    logger.warning("%s", rep)
    if callable(debug):
      debug(rep)

  return report
