"""The loss-scale rule: its static description and one step of it.

The rule is jmp's, which is also `torch.amp.GradScaler`'s::

    # grads are the gradients of loss * scale; every step:
    grads = grads / scale                     # fp32, with the forward's scale
    finite = all(isfinite(grads))             # one flag for the whole tree
    if finite:
      masters, inner_state = inner.update(grads, masters)   # step applied
      counter += 1
      if counter == period:                   # the period-th finite step
        counter = 0
        if isfinite(scale * factor):
          scale = min(scale * factor, max_loss_scale)
    else:                                     # step skipped, nothing changes
      counter = 0
      overflows += 1                          # consecutive overflows
      if overflows >= hysteresis:             # hysteresis=1: every overflow
        scale = max(scale / factor, min_loss_scale)

Names: the *loss scale* is the number (``state.loss_scale``,
``stats()["loss_scale"]``, ``mixed_precision(loss_scale=8.0)``); a *loss
scaler* is the jmp object that says how it moves (`LossScaler`: dynamic,
static or none), which ``mixed_precision(loss_scale=...)`` also accepts and
`jaxmp.loss_scaler` returns.

Hyperparameters live in the closure. The state also carries them as a static
`LossScaleConfig` (part of the pytree *structure*, never a leaf), so that
`jit`, `device_put` and checkpoint round trips keep `min_loss_scale` and
`max_loss_scale`: jmp's `DynamicLossScale` flattens to `(loss_scale, counter)`
only and comes back from `jit` with `min_loss_scale=1`.
"""

import dataclasses
import warnings
from typing import Optional, Union

import jax
import jax.numpy as jnp
import jmp
import numpy as np

LossScaler = Union[jmp.NoOpLossScale, jmp.StaticLossScale, jmp.DynamicLossScale]
"""The jmp loss scalers `mixed_precision` accepts (``loss_scale=``)."""


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
  """Static description of the loss scale, kept in the state's treedef.

  Attributes:
    kind: ``"dynamic"``, ``"static"`` or ``"noop"``.
    period: finite steps between two growths.
    factor: growth and back-off factor.
    min_loss_scale: floor of the scale.
    max_loss_scale: cap of the scale (``inf``: only never grow to inf).
    hysteresis: back off only from the ``hysteresis``-th consecutive overflow.
  """

  kind: str
  period: int = 2000
  factor: float = 2.0
  min_loss_scale: float = 1.0
  max_loss_scale: float = float("inf")
  hysteresis: int = 1


jax.tree_util.register_static(LossScaleConfig)


def config_from(
  loss_scale: Optional[Union[LossScaler, float]],
  max_loss_scale: Optional[float],
  hysteresis: int,
) -> tuple[LossScaleConfig, float]:
  """Validates the user's loss scale; returns (config, initial scale)."""
  if loss_scale is None:
    loss_scale = jmp.DynamicLossScale(np.float32(2.0**15))
  if _is_number(loss_scale):
    loss_scale = jmp.StaticLossScale(
      np.float32(_concrete(loss_scale, "loss_scale"))
    )
  if not _is_number(hysteresis) or _concrete(hysteresis, "hysteresis") < 1:
    raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")
  hysteresis = int(_concrete(hysteresis, "hysteresis"))
  cap = (
    float("inf")
    if max_loss_scale is None
    else _concrete(max_loss_scale, "max_loss_scale")
  )
  if isinstance(loss_scale, jmp.NoOpLossScale):
    return LossScaleConfig("noop", min_loss_scale=1.0, max_loss_scale=1.0), 1.0
  if isinstance(loss_scale, jmp.StaticLossScale):
    value = _concrete(loss_scale.loss_scale, "StaticLossScale.loss_scale")
    _check_positive(value, "loss_scale")
    return LossScaleConfig(
      "static", min_loss_scale=value, max_loss_scale=value
    ), value
  if isinstance(loss_scale, jmp.DynamicLossScale):
    value = _concrete(loss_scale.loss_scale, "DynamicLossScale.loss_scale")
    floor = _concrete(
      loss_scale.min_loss_scale, "DynamicLossScale.min_loss_scale"
    )
    _check_positive(value, "loss_scale")
    _check_positive(floor, "min_loss_scale")
    if int(loss_scale.period) < 1:
      raise ValueError(f"period must be >= 1, got {loss_scale.period!r}")
    if not float(loss_scale.factor) > 1:
      raise ValueError(f"factor must be > 1, got {loss_scale.factor!r}")
    if not floor <= cap:
      raise ValueError(f"min_loss_scale={floor} is above max_loss_scale={cap}")
    clamped = min(max(value, floor), cap)
    if clamped != value:
      warnings.warn(
        f"initial loss scale {value} is outside [min_loss_scale={floor}, "
        f"max_loss_scale={cap}]; it starts at {clamped}",
        stacklevel=3,
      )
    value = clamped
    return LossScaleConfig(
      "dynamic",
      int(loss_scale.period),
      float(loss_scale.factor),
      floor,
      cap,
      hysteresis,
    ), value
  raise TypeError(
    "loss_scale must be None (dynamic, 2**15), a positive number (static), "
    "jmp.DynamicLossScale, jmp.StaticLossScale or jmp.NoOpLossScale; got "
    f"{loss_scale!r}"
  )


def _is_number(x) -> bool:
  """A Python/NumPy number or a 0-d array (optax.inject_hyperparams)."""
  if isinstance(x, bool):
    return False
  return isinstance(x, (int, float, np.number)) or (
    isinstance(x, (np.ndarray, jax.Array)) and np.ndim(x) == 0
  )


def _concrete(x, name: str) -> float:
  try:
    return float(np.asarray(x))
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(
      f"{name} must be a concrete number, not a traced value; with "
      "optax.inject_hyperparams(jaxmp.mixed_precision, static_args=("
      f"'{name}',)) it stays static"
    ) from e


def _check_positive(value: float, name: str) -> None:
  if not (np.isfinite(value) and value > 0):
    raise ValueError(f"{name} must be finite and > 0, got {value}")


def adjust_loss_scale(
  config: LossScaleConfig,
  loss_scale: jax.Array,
  growth_counter: jax.Array,
  consecutive_overflows: jax.Array,
  grads_finite: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """One step of the loss-scale rule: jmp's, which is ``GradScaler``'s.

  For a step whose gradients are ``grads_finite``::

    if finite:
      counter += 1
      if counter == period:                   # the period-th finite step
        counter = 0
        if isfinite(scale * factor):
          scale = min(scale * factor, max_loss_scale)
    else:                                     # the step is skipped
      counter = 0                             # (overflows counts it)
      if overflows >= hysteresis:             # hysteresis=1: every overflow
        scale = max(scale / factor, min_loss_scale)

  Args:
    config: the static loss-scale description.
    loss_scale: the scale the step's forward pass used.
    growth_counter: finite steps in a row before this step.
    consecutive_overflows: overflowed steps in a row, this step included.
    grads_finite: whether this step's gradients were finite.

  Returns:
    ``(new_loss_scale, new_growth_counter)``.
  """
  if config.kind != "dynamic":
    return loss_scale, jnp.where(grads_finite, growth_counter + 1, 0)
  counter = jnp.where(grads_finite, growth_counter + 1, 0)
  grow = counter >= config.period
  grown = loss_scale * config.factor
  grown = jnp.minimum(
    jnp.where(jnp.isfinite(grown), grown, loss_scale),
    jnp.float32(config.max_loss_scale),
  )
  shrunk = jnp.maximum(
    loss_scale / config.factor, jnp.float32(config.min_loss_scale)
  )
  back_off = consecutive_overflows >= config.hysteresis
  new_scale = jnp.where(
    grads_finite,
    jnp.where(grow, grown, loss_scale),
    jnp.where(back_off, shrunk, loss_scale),
  )
  return new_scale.astype(jnp.float32), jnp.where(grow, 0, counter)
