"""Per-leaf gradient diagnostics: which leaf overflowed, how close to underflow.

`mixed_precision(..., diagnostics=True)` calls `grad_diagnostics` inside the
jitted step and keeps the result, a `GradDiagnostics`, in its state: three
arrays with one entry per gradient leaf (a few hundred bytes for a ResNet18),
so nothing but the step itself runs on the device. `report` turns it into
host-side rows, worst leaf first (`jaxmp.overflow_report` finds the state).

The leaf paths (`jax.tree_util.keystr` strings) are static metadata of the
pytree, like the `LossScaleConfig`: they survive `jit`, `shard_map` and
checkpoints, and cost no device buffer.
"""

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import dtypes

# zero_fraction of a leaf whose gradient is not half precision: not measured.
# A sentinel rather than NaN, so that jax_debug_nans stays quiet.
NOT_HALF = -1.0


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["nonfinite", "max_abs", "zero_fraction"],
  meta_fields=["paths"],
)
@dataclasses.dataclass(frozen=True)
class GradDiagnostics:
  """The last step's per-leaf gradient statistics, one entry per leaf.

  Attributes:
    nonfinite: int32[n], inf/NaN elements of each unscaled gradient.
    max_abs: fp32[n], the largest finite ``|gradient / loss_scale|``.
    zero_fraction: fp32[n], for float16/bfloat16 gradients the fraction of
      elements that are zero or subnormal *as computed* (scaled, in the half
      dtype): what the loss scale failed to lift above underflow. ``-1`` for
      fp32 and wider gradients (not measured).
    paths: static, ``jax.tree_util.keystr`` of each leaf, in leaf order.
  """

  nonfinite: jax.Array
  max_abs: jax.Array
  zero_fraction: jax.Array
  paths: tuple[str, ...]


def _paths(tree) -> tuple[str, ...]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return tuple(jax.tree_util.keystr(path) for path, _ in leaves)


def _stack(values, dtype) -> jax.Array:
  if not values:
    return jnp.zeros([0], dtype)
  return jnp.stack([jnp.asarray(v, dtype) for v in values])


def init_diagnostics(params) -> GradDiagnostics:
  """All-zero diagnostics shaped for ``params`` (nothing measured yet)."""
  leaves = jax.tree_util.tree_leaves(params)
  return GradDiagnostics(
    nonfinite=jnp.zeros([len(leaves)], jnp.int32),
    max_abs=jnp.zeros([len(leaves)], jnp.float32),
    zero_fraction=_stack(
      [0.0 if dtypes.is_half(x) else NOT_HALF for x in leaves],
      jnp.float32,
    ),
    paths=_paths(params),
  )


def grad_diagnostics(
  grads, inv_scale: jax.Array, axis_name: Optional[str] = None
) -> GradDiagnostics:
  """Measures each leaf of the scaled ``grads`` (inside ``jit``).

  Args:
    grads: the gradients of ``loss * scale``, as given to ``update``.
    inv_scale: ``1 / scale``, fp32.
    axis_name: a mapped axis to reduce over: ``nonfinite`` and ``max_abs``
      take the maximum over devices, ``zero_fraction`` the mean (exact when
      every device holds the same, already averaged, gradients).

  Returns:
    The `GradDiagnostics` of this step.
  """
  leaves = jax.tree_util.tree_leaves(grads)
  nonfinite, max_abs, zero_fraction = [], [], []
  for g in leaves:
    u = g.astype(jnp.float32) * inv_scale
    ok = jnp.isfinite(u)
    nonfinite.append(jnp.sum(~ok, dtype=jnp.int32))
    max_abs.append(jnp.max(jnp.where(ok, jnp.abs(u), 0.0), initial=0.0))
    if dtypes.is_half(g):
      tiny = jnp.finfo(g.dtype).tiny  # smallest normal: below it, subnormal
      small = jnp.sum(jnp.abs(g) < tiny, dtype=jnp.int32)
      zero_fraction.append(small.astype(jnp.float32) / max(g.size, 1))
    else:
      zero_fraction.append(jnp.float32(NOT_HALF))
  out = GradDiagnostics(
    nonfinite=_stack(nonfinite, jnp.int32),
    max_abs=_stack(max_abs, jnp.float32),
    zero_fraction=_stack(zero_fraction, jnp.float32),
    paths=_paths(grads),
  )
  if axis_name is not None:
    out = dataclasses.replace(
      out,
      nonfinite=jax.lax.pmax(out.nonfinite, axis_name),
      max_abs=jax.lax.pmax(out.max_abs, axis_name),
      zero_fraction=jax.lax.pmean(out.zero_fraction, axis_name),
    )
  return out


class RowMapping:
  """A dataclass row whose fields also read as keys (``row["path"]``)."""

  def __getitem__(self, key: str) -> Any:
    """``row["path"]`` is ``row.path``."""
    if key not in self.keys():
      raise KeyError(key)
    return getattr(self, key)

  def keys(self) -> tuple[str, ...]:
    """The field names, so that ``dict(row)`` works."""
    return tuple(f.name for f in dataclasses.fields(self))

  def get(self, key: str, default: Any = None) -> Any:
    """Like ``dict.get``."""
    return getattr(self, key) if key in self.keys() else default


class Rows(list):
  """A report's rows: ``for row in report``, ``len``, indexing; ``str``.

  The base of `OverflowReport`, ``RoundingReport`` and ``ReductionReport``:
  a list of rows that prints as a table (each report writes its own
  ``__str__``).
  """

  @property
  def rows(self) -> tuple:
    """The rows, as a tuple."""
    return tuple(self)

  def __repr__(self) -> str:
    """The class's name around the rows."""
    return f"{type(self).__name__}({list.__repr__(self)})"


def columns(head: tuple, body: list) -> list:
  """Lines of a table: ``head``, a rule, then ``body``, columns aligned."""
  widths = [max(len(x) for x in col) for col in zip(head, *body)]
  fmt = lambda row: "  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip()
  return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in body]


@dataclasses.dataclass(frozen=True)
class LeafRow(RowMapping):
  """One leaf of an `OverflowReport`; fields read as attributes or keys.

  Attributes:
    path: the leaf's ``jax.tree_util.keystr``, e.g. ``['conv1']['kernel']``.
    nonfinite: inf/NaN elements of its gradient in the last step.
    max_abs: the largest finite ``|unscaled gradient|``.
    zero_fraction: fraction of zero-or-subnormal half-precision gradient
      elements; ``None`` for an fp32 (or wider) gradient.
  """

  path: str
  nonfinite: int
  max_abs: float
  zero_fraction: Optional[float]


class OverflowReport(Rows):
  """`LeafRow`s, worst first; ``str`` is a short table.

  Attributes:
    loss_finite: whether the last step's loss was finite (``None`` when no
      loss was given to ``update``).
  """

  loss_finite: Optional[bool] = None
  max_rows: int = 8

  @property
  def offending(self) -> list[LeafRow]:
    """The rows with non-finite gradient elements."""
    return [r for r in self if r.nonfinite]

  def __str__(self) -> str:
    """A header naming the first offending leaf, then the worst rows."""
    bad = self.offending
    if self and len(bad) == len(self):
      head = (
        f"every gradient leaf is non-finite ({len(self)} of {len(self)}), so "
        "no leaf is to blame and the rows below are in leaf order: a NaN/inf "
        "loss, bad input data or an fp16 overflow in the forward pass (the "
        "activations) is the cause, not one layer's gradient"
      )
    elif bad:
      head = (
        f"non-finite gradients in {len(bad)} of {len(self)} leaves; first: "
        f"{bad[0].path} ({bad[0].nonfinite} non-finite)"
      )
    else:
      head = f"all gradients finite in the last step ({len(self)} leaves)"
    if self.loss_finite is False:
      head += "; the loss itself was NaN/inf"
    lines = [head, f"{'nonfinite':>10} {'max_abs':>10} {'zero_frac':>9}  path"]
    for r in self[: self.max_rows]:
      zf = "-" if r.zero_fraction is None else f"{r.zero_fraction:.3f}"
      lines.append(f"{r.nonfinite:>10} {r.max_abs:>10.3g} {zf:>9}  {r.path}")
    if len(self) > self.max_rows:
      lines.append(f"... {len(self) - self.max_rows} more leaves")
    return "\n".join(lines)


def report(
  diagnostics: GradDiagnostics, loss_finite: Optional[bool] = None
) -> OverflowReport:
  """Host-side rows of fetched ``diagnostics``, worst first.

  Args:
    diagnostics: a `GradDiagnostics` whose arrays are host (NumPy) arrays.
    loss_finite: passed on to the report.

  Returns:
    An `OverflowReport` sorted by ``nonfinite`` then ``max_abs``, both
    descending; ties keep the leaf order. When every leaf is non-finite the
    counts only measure the leaves' sizes: the rows keep the leaf order and
    the report's ``str`` says so.
  """
  nonfinite = np.asarray(diagnostics.nonfinite).reshape(-1)
  max_abs = np.asarray(diagnostics.max_abs).reshape(-1)
  zero = np.asarray(diagnostics.zero_fraction).reshape(-1)
  order = range(len(diagnostics.paths))
  if not (nonfinite > 0).all():
    order = sorted(
      order, key=lambda i: (-int(nonfinite[i]), -float(max_abs[i]), i)
    )
  out = OverflowReport(
    LeafRow(
      path=diagnostics.paths[i],
      nonfinite=int(nonfinite[i]),
      max_abs=float(max_abs[i]),
      zero_fraction=None if zero[i] < 0 else float(zero[i]),
    )
    for i in order
  )
  out.loss_finite = loss_finite
  return out
