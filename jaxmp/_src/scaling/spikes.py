"""Spike skipping: drop a step whose loss or gradient norm jumps.

The rule, for ``mixed_precision(..., skip_spikes=SpikeSkip(window, factor))``::

    # every step, after the finite check
    norm = global_l2_norm(unscaled fp32 grads)  # over all devices
    spike = finite and (
        (loss_window full and loss > mean(loss_window) + factor * std(...))
        or (norm_window full and norm > mean(norm_window) + factor * std(...))
    )
    if finite and not spike:  # the step is applied
      loss_window.append(loss)  # only when update was given loss=
      norm_window.append(norm)  # each window keeps its last `window` values
    # a spike is rolled back as an overflow is; the loss scale and its
    # counters are left as they were

``std`` is the population standard deviation (`jnp.std`). The two windows are
kept apart: a step given no ``loss=`` (flax's ``TrainState.apply_gradients``)
is judged on its gradient norm alone and adds nothing to the loss window. The
windows hold accepted steps only: neither a spike nor an overflow enters them.

Written branch-free (``jnp.where``), as the rest of the step: the window is a
ring buffer of ``window`` fp32 values, updated by a select, with no host sync.
"""

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxmp._src import vma as vma_lib


@dataclasses.dataclass(frozen=True)
class SpikeSkip:
  """Configuration of spike skipping in `jaxmp.mixed_precision`.

  A step is dropped when its loss (given to ``update`` with ``loss=``) or the
  global L2 norm of its unscaled fp32 gradients exceeds, strictly, ``mean +
  factor * std`` (population std) of the last ``window`` accepted steps.
  Nothing is dropped before ``window`` steps were accepted.

  Attributes:
    window: how many accepted steps the mean and std are taken over (an int
      >= 2).
    factor: how many standard deviations above the mean a value must lie to
      be a spike (a float > 0).

  >>> import jaxmp
  >>> jaxmp.SpikeSkip(window=128, factor=6.0)
  SpikeSkip(window=128, factor=6.0)
  """

  window: int = 128
  factor: float = 6.0

  def __post_init__(self):
    """Checks ``window`` and ``factor`` and normalises their types."""
    window, factor = self.window, self.factor
    if isinstance(window, bool) or not isinstance(window, int):
      try:
        ok = not isinstance(window, bool) and int(window) == window
      except (TypeError, ValueError):
        ok = False
      if not ok:
        raise TypeError(f"SpikeSkip window must be an int, got {window!r}")
    if int(window) < 2:
      raise ValueError(
        f"SpikeSkip window must be >= 2 (a std needs two values), got {window}"
      )
    try:
      factor = float(factor)
    except (TypeError, ValueError):
      raise TypeError(
        f"SpikeSkip factor must be a number, got {self.factor!r}"
      ) from None
    if not factor > 0 or factor == float("inf"):
      raise ValueError(
        f"SpikeSkip factor must be a finite number > 0, got {self.factor!r}"
      )
    object.__setattr__(self, "window", int(window))
    object.__setattr__(self, "factor", factor)


jax.tree_util.register_static(SpikeSkip)


class SpikeState(NamedTuple):
  """The spike windows of a `jaxmp.mixed_precision` state (``state.spikes``).

  Attributes:
    losses: fp32 ``[window]`` ring buffer of the losses of accepted steps
      that were given ``loss=``.
    loss_count: int32, losses recorded; the next one goes to ``loss_count %
      window``; the window is full from ``window`` on (the count then
      stays below ``2 * window``).
    norms: fp32 ``[window]`` ring buffer of the global gradient norms of
      accepted steps.
    norm_count: int32, as ``loss_count``, for ``norms``.
    spike_skips: int32, steps dropped as spikes since `init`.
    consecutive_spike_skips: int32, steps dropped as spikes in a row up to
      now (a step skipped for a non-finite value neither counts nor breaks
      the run; an applied step ends it).
  """

  losses: jax.Array
  loss_count: jax.Array
  norms: jax.Array
  norm_count: jax.Array
  spike_skips: jax.Array
  consecutive_spike_skips: jax.Array


def check_config(skip_spikes: Any) -> Optional[SpikeSkip]:
  """``skip_spikes`` if it is a `SpikeSkip` or ``None``; raises otherwise."""
  if skip_spikes is None or isinstance(skip_spikes, SpikeSkip):
    return skip_spikes
  raise TypeError(
    "skip_spikes must be a jaxmp.SpikeSkip or None, got "
    f"{skip_spikes!r}; e.g. skip_spikes=jaxmp.SpikeSkip(window=128, "
    "factor=6.0)"
  )


def init(config: SpikeSkip) -> SpikeState:
  """Empty windows: nothing is dropped until one has filled.

  Every leaf is its own array: an eagerly built state shares no buffer
  between two leaves, so a step that donates it can donate each once.
  """
  zero = lambda: jnp.zeros([], jnp.int32)
  empty = lambda: jnp.zeros([config.window], jnp.float32)
  return SpikeState(empty(), zero(), empty(), zero(), zero(), zero())


def check_state(config: Optional[SpikeSkip], spikes: Any) -> None:
  """Rejects a state built for other spike settings (at trace time)."""
  if config is None:
    if spikes is not None:
      raise ValueError(
        "this state has spike windows (built by mixed_precision(..., "
        "skip_spikes=...)) but this optimizer has no skip_spikes: build the "
        "optimizer with the same skip_spikes as the state, or drop the "
        "windows with state._replace(spikes=None)"
      )
    return
  if spikes is None:
    raise ValueError(
      "mixed_precision(..., skip_spikes=...) got a state without spike "
      "windows (built without skip_spikes, or an older checkpoint); to turn "
      "spike skipping on for it: state = state._replace(spikes=opt.init("
      "params).spikes)"
    )
  shape = tuple(jnp.shape(jax.tree_util.tree_leaves(spikes.norms)[0]))
  if shape != (config.window,):
    raise ValueError(
      f"the state's spike windows hold {shape[0] if shape else shape} "
      f"values but skip_spikes has window={config.window}; build the "
      "optimizer with the state's window, or start new windows with state = "
      "state._replace(spikes=opt.init(params).spikes)"
    )


def _axes(axis_name: Any) -> tuple[Any, ...]:
  return (
    tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  )


def _varying(x: jax.Array, axis_name: Any) -> tuple[Any, ...]:
  """The axes of ``axis_name`` that ``x`` is typed as varying over.

  ``shard_map`` (with its default ``check_vma``) types say it; ``pmap``'s
  (and ``check_vma=False``) type every value as invariant.
  """
  varying = vma_lib.varying(x)
  return tuple(a for a in _axes(axis_name) if a in varying)


def global_norm(grads: Any, axis_name: Any) -> jax.Array:
  """The L2 norm of the fp32 ``grads``, the same on every device.

  Under ``jit`` with sharded arrays the sum is global by itself. Under
  ``shard_map`` with ``axis_name``, a leaf that varies over the axis is a
  shard of the gradient (FSDP) and its squares are summed over the axis
  (``psum``); a device-invariant leaf (replicated, or ``pmean``-ed
  data-parallel gradients) is counted once. The result then goes through a
  ``pmax`` over the axis: the identity for a value that is the same on every
  device, and under ``pmap`` (whose types say nothing of what varies: take
  its gradients as ``pmean``-ed) a guarantee that every device decides alike.
  """
  squares = [jnp.sum(jnp.square(g)) for g in jax.tree_util.tree_leaves(grads)]
  if not squares:
    return jnp.zeros([], jnp.float32)
  if axis_name is None:
    return jnp.sqrt(sum(squares))
  groups: dict[tuple[Any, ...], list[jax.Array]] = {}
  for s in squares:
    groups.setdefault(_varying(s, axis_name), []).append(s)
  total = jnp.zeros([], jnp.float32)
  for axes, parts in groups.items():
    part = sum(parts)
    total = total + (jax.lax.psum(part, axes) if axes else part)
  return jax.lax.pmax(jnp.sqrt(total), axis_name)


def global_loss(loss: Any, axis_name: Any) -> jax.Array:
  """The scalar fp32 ``loss``, the same on every device.

  A loss that varies over ``axis_name`` (each device's own batch) is
  averaged over it (``pmean``); then, as for `global_norm`, a ``pmax``
  (under ``pmap``: the largest device loss, unless it was ``pmean``-ed).

  Raises:
    ValueError: for a loss with more than one element.
  """
  loss = jnp.asarray(loss)
  if loss.size != 1:
    raise ValueError(
      "mixed_precision(..., skip_spikes=...) needs a scalar loss= (the "
      f"step's mean loss), got shape {loss.shape}"
    )
  loss = loss.reshape(()).astype(jnp.float32)
  if axis_name is None:
    return loss
  axes = _varying(loss, axis_name)
  if axes:
    loss = jax.lax.pmean(loss, axes)
  return jax.lax.pmax(loss, axis_name)


def _above(values: jax.Array, count: jax.Array, x, factor: float):
  """Whether ``x`` lies above mean + factor * std of a full window."""
  window = values.shape[0]
  mean = jnp.mean(values)
  std = jnp.std(values)  # Population (ddof=0), two-pass: mean, then squares.
  return (count >= window) & (x > mean + jnp.float32(factor) * std)


def _record(values: jax.Array, count: jax.Array, x, take):
  """``values`` with ``x`` in the ring's next slot where ``take``."""
  window = values.shape[0]
  slot = (jnp.arange(window) == count % window) & take
  values = jnp.where(slot, x, values)
  after = count + 1
  after = jnp.where(after >= 2 * window, after - window, after)
  return values, jnp.where(take, after, count).astype(jnp.int32)


def step(
  config: SpikeSkip,
  spikes: SpikeState,
  norm: jax.Array,
  loss: Optional[jax.Array],
  finite: jax.Array,
) -> tuple[jax.Array, SpikeState]:
  """One step of the rule: ``(spike, new windows)``.

  Args:
    config: the settings.
    spikes: the windows before this step.
    norm: this step's global gradient norm (fp32 scalar, uniform).
    loss: this step's loss (fp32 scalar, uniform), or ``None`` when
      ``update`` was given none (static: the loss window is left alone).
    finite: whether the step passed the finite check (its gradients, and
      its loss where given); a non-finite step is no spike and enters no
      window.

  Returns:
    ``spike`` (bool scalar: drop the step) and the new `SpikeState`.
  """
  over = _above(spikes.norms, spikes.norm_count, norm, config.factor)
  if loss is not None:
    over = over | _above(spikes.losses, spikes.loss_count, loss, config.factor)
  spike = finite & over
  accepted = finite & ~over
  # A finite step can still have an inf norm (squares past fp32's range):
  # kept out of the window, whose mean and std it would poison.
  norms, norm_count = _record(
    spikes.norms, spikes.norm_count, norm, accepted & jnp.isfinite(norm)
  )
  losses, loss_count = spikes.losses, spikes.loss_count
  if loss is not None:
    losses, loss_count = _record(losses, loss_count, loss, accepted)
  run = spikes.consecutive_spike_skips
  run = jnp.where(spike, run + 1, jnp.where(accepted, 0, run))
  return spike, SpikeState(
    losses=losses,
    loss_count=loss_count,
    norms=norms,
    norm_count=norm_count,
    spike_skips=spikes.spike_skips + spike.astype(jnp.int32),
    consecutive_spike_skips=run.astype(jnp.int32),
  )
