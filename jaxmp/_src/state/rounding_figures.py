"""What rounding costs each leaf: measured inside the jitted update.

`mixed_precision(..., rounding_every=N)` keeps a `RoundingFigures` in its
state and, every N-th applied step, measures for each param leaf what its
half dtype alone would make of the step's fp32 update ``u``. With ``h`` the
half param before the step (an fp32 param is measured against bfloat16, as
what storing it in bfloat16 would lose) and ``cast`` round-to-nearest-even:

- ``stalled``: among the elements with ``u != 0``, the share with
  ``cast(h + u) == h`` (Collage's "imprecision percentage");
- ``quality``: ``<cast(h + u) - h, u> / <u, u>`` (Collage's "effective
  descent quality"): 1 when every update lands as intended, 0 when none does;
- ``flushed``: among the nonzero fp32 master values after the step, the
  share that the half dtype holds as zero or subnormal (TransformerEngine's
  "underflows%").

``h + u`` is computed in fp32, then cast. The counts and the two dot
products are sums over the whole leaf: under ``jit`` on a mesh GSPMD makes
them global, and under ``shard_map`` they are summed over ``axis_name``
before the ratios are taken, so every device holds the global figures.

The measurement sits in a `jax.lax.cond`: on the other steps it costs one
scalar compare, and no pass over the params (a ``jnp.where`` would compute
it on every step). ``inspect/rounding_report.py`` turns fetched figures
into rows with advice.
"""

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import dtypes


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["applied", "step", "stalled", "quality", "flushed"],
  meta_fields=["every", "paths", "dtypes", "measured_as"],
)
@dataclasses.dataclass(frozen=True)
class RoundingFigures:
  """The last measured step's per-leaf rounding figures.

  Attributes:
    applied: int32, the applied steps since ``init``.
    step: int32, the applied step (1 for the first) the figures describe;
      0 before any was measured.
    stalled: fp32[n], the share of updated elements the half dtype loses.
    quality: fp32[n], ``<cast(h + u) - h, u> / <u, u>`` (1 with no update).
    flushed: fp32[n], the share of nonzero masters held as zero/subnormal.
    every: static, the period ``N`` of ``rounding_every``.
    paths: static, ``jax.tree_util.keystr`` of each param leaf.
    dtypes: static, each param's dtype name.
    measured_as: static, the half dtype each leaf is measured in.
  """

  applied: jax.Array
  step: jax.Array
  stalled: jax.Array
  quality: jax.Array
  flushed: jax.Array
  every: int
  paths: tuple[str, ...]
  dtypes: tuple[str, ...]
  measured_as: tuple[str, ...]


def check_every(every) -> int:
  """``rounding_every`` as a Python int, checked; ``None`` when traced."""
  # optax.inject_hyperparams hands numeric defaults over as arrays, traced
  # in ``update``: ``None`` there, where the state's figures say it.
  try:
    value = np.asarray(every)
  except jax.errors.TracerArrayConversionError:
    return None
  if (
    value.shape
    or value.dtype == bool
    or not np.issubdtype(value.dtype, np.integer)
    or value < 0
  ):
    raise ValueError(
      f"rounding_every must be an int >= 0, got {every!r} (with "
      "optax.inject_hyperparams pass it in static_args)"
    )
  return int(value)


def _half_of(p) -> Any:
  return jnp.dtype(p.dtype) if dtypes.is_half(p) else jnp.dtype(jnp.bfloat16)


def init(params, every) -> Optional[RoundingFigures]:
  """Figures for ``params``, measured every ``every`` applied steps.

  ``None`` for ``every=0`` (off); a ``ValueError`` for a traced ``every``.
  """
  if every is None:  # Traced in init: optax.inject_hyperparams under jit.
    raise ValueError(
      "rounding_every must be static: with optax.inject_hyperparams pass "
      "it in static_args"
    )
  if not every:
    return None
  pairs = jax.tree_util.tree_flatten_with_path(params)[0]
  n = len(pairs)
  return RoundingFigures(
    applied=jnp.zeros([], jnp.int32),
    step=jnp.zeros([], jnp.int32),
    stalled=jnp.zeros([n], jnp.float32),
    quality=jnp.ones([n], jnp.float32),
    flushed=jnp.zeros([n], jnp.float32),
    every=every,
    paths=tuple(jax.tree_util.keystr(k) for k, _ in pairs),
    dtypes=tuple(jnp.dtype(p.dtype).name for _, p in pairs),
    measured_as=tuple(_half_of(p).name for _, p in pairs),
  )


def _sums(p, u, m):
  """Per leaf: the counts (int32[4]) and the dot products (fp32[2])."""
  half = _half_of(p)
  h = p.astype(half).astype(jnp.float32)
  u = u.astype(jnp.float32)
  landed = (h + u).astype(half).astype(jnp.float32) - h
  moved = u != 0
  nonzero = m != 0
  # cast(m) is zero or subnormal below tiny less half a subnormal ulp (the
  # tie rounds up to tiny, whose significand is even): no cast needed.
  info = jnp.finfo(half)
  edge = float(info.tiny) * (1 - 2.0 ** -(info.nmant + 1))
  small = jnp.abs(m) < edge
  # One reduction of each kind, not six: XLA reads the leaf once for each.
  flags = jnp.stack([moved, moved & (landed == 0), nonzero, nonzero & small])
  counts = jnp.sum(flags.reshape(4, -1), axis=1, dtype=jnp.int32)
  dots = jnp.sum(jnp.stack([landed * u, u * u]).reshape(2, -1), axis=1)
  return counts, dots


def measure(params, updates, masters, axis_name=None):
  """``(stalled, quality, flushed)``, fp32[n] each, global over devices."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  if not leaves:
    empty = jnp.zeros([0], jnp.float32)
    return empty, empty, empty
  sums = [
    _sums(p, u, m)
    for p, u, m in zip(
      leaves, treedef.flatten_up_to(updates), treedef.flatten_up_to(masters)
    )
  ]
  counts = jnp.stack([c for c, _ in sums])
  dots = jnp.stack([d for _, d in sums])
  if axis_name is not None:
    counts = jax.lax.psum(counts, axis_name)
    dots = jax.lax.psum(dots, axis_name)
  ratio = lambda a, b: a.astype(jnp.float32) / jnp.maximum(b, 1)
  stalled = ratio(counts[:, 1], counts[:, 0])
  flushed = ratio(counts[:, 3], counts[:, 2])
  uu = dots[:, 1]
  quality = jnp.where(uu > 0, dots[:, 0] / jnp.where(uu > 0, uu, 1.0), 1.0)
  return stalled, quality, flushed


def step(
  figures: RoundingFigures,
  params,
  updates,
  masters,
  applied: jax.Array,
  axis_name: Optional[str] = None,
) -> RoundingFigures:
  """The figures after a step: measured on every ``every``-th applied one.

  Args:
    figures: the state's figures before the step; measured on the
      ``every``-th, ``2 * every``-th, ... applied step.
    params: the params before the step.
    updates: the inner optimizer's fp32 updates.
    masters: the fp32 values after the step (the new masters, or the
      params plus their updates).
    applied: whether the step is applied (a skipped one changes nothing).
    axis_name: the mapped axis to sum the figures over, or ``None``.

  Returns:
    The new `RoundingFigures`.
  """
  every = figures.every
  due = applied & ((figures.applied + 1) % every == 0)
  old = (figures.stalled, figures.quality, figures.flushed)

  def keep(operands):
    return operands[0]

  def fresh(operands):
    _, p, u, m = operands
    return measure(p, u, m, axis_name)

  operands = (old, params, updates, masters)
  if every == 1:
    # Due on every applied step: no conditional, so that XLA can fuse the
    # sums into the update's own passes over the leaves.
    new = fresh(operands)
    stalled, quality, flushed = (jnp.where(due, n, o) for n, o in zip(new, old))
  else:
    stalled, quality, flushed = jax.lax.cond(due, fresh, keep, operands)
  count = figures.applied + applied.astype(jnp.int32)
  return dataclasses.replace(
    figures,
    applied=count,
    step=jnp.where(due, count, figures.step),
    stalled=stalled,
    quality=quality,
    flushed=flushed,
  )
