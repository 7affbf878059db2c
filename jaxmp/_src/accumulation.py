"""Gradient accumulation for `mixed_precision`: fp32 means, clean windows.

`optax.MultiSteps` (0.2.8) has three flaws for loss-scaled half gradients,
which `multi_steps` fixes:

* it resets its accumulator as ``(1 - emit) * acc``: after a window whose
  microbatch overflowed the accumulator holds inf/NaN and ``0 * inf`` keeps it
  NaN, so every later window is skipped too and the loss scale collapses.
  `multi_steps` clears it with a select;
* it casts the fp32 accumulator back to the gradient dtype, so the window mean
  reaches the optimizer rounded to fp16. `multi_steps` accumulates the
  microbatches in fp32 and hands the fp32 mean on (`mixed_precision` unscales
  in fp32 anyway);
* its state says nothing about the microbatch just seen: `mixed_precision`'s
  ``grads_finite`` only moves when a window ends, so mid-window it is stale.
  `multi_steps` checks every microbatch and keeps the flag in its state, for
  `jaxmp.rollback_if_skipped`.
"""

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from jaxmp._src import mixed_precision as mp


class AccumulationState(NamedTuple):
  """State of `jaxmp.multi_steps`.

  Attributes:
    multi_steps: the `optax.MultiStepsState` (its ``inner_opt_state`` holds
      the `mixed_precision` state; the accessors find it there).
    microbatch_finite: bool, whether the last microbatch's gradients were all
      finite (the flag `jaxmp.rollback_if_skipped` reads).
  """

  multi_steps: optax.MultiStepsState
  microbatch_finite: jax.Array


def multi_steps(
  opt: optax.GradientTransformation,
  every_k_schedule: Union[int, Callable[[jax.Array], jax.Array]],
  *,
  axis_name: Optional[str] = None,
  **kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
  """Gradient accumulation around `jaxmp.mixed_precision`.

  Put it outside: ``multi_steps(jaxmp.mixed_precision(inner), k)``. Each
  ``update`` takes one microbatch's (scaled) gradients; every ``k``-th one
  hands the window's fp32 mean to ``opt`` and returns its updates, the others
  return zero updates. The loss scale stays fixed within a window
  (``mixed_precision``'s state only moves when the window ends), a window
  with any non-finite microbatch is skipped as a whole (its mean is not
  finite) and the next window starts from a clean accumulator.

  For the caller's state (BatchNorm statistics, an EMA) call
  `jaxmp.rollback_if_skipped` after every microbatch: it keeps ``old`` exactly
  for the microbatches whose own gradients were not finite. A skipped window
  thus keeps params, masters and the optimizer state as they were before it,
  and keeps the statistics of its finite microbatches (forward passes of
  those unchanged params, as valid as in an applied window); no forward pass
  of an overflowed microbatch reaches them.

  Args:
    opt: the optimizer to call once per window, usually a
      `jaxmp.mixed_precision`.
    every_k_schedule: microbatches per window (or a schedule of it).
    axis_name: the mapped axis (``shard_map``/``pmap``) over which the
      microbatch flag is reduced, as ``mixed_precision``'s ``axis_name``.
    **kwargs: passed to `optax.MultiSteps` (``use_grad_mean``,
      ``should_skip_update_fn``). The accumulator is always fp32.

  Returns:
    A gradient transformation with an `AccumulationState` as its state.

  >>> import jax.numpy as jnp, optax, jaxmp
  >>> mp = jaxmp.mixed_precision(optax.sgd(1.0), loss_scale=1024.0)
  >>> opt = jaxmp.multi_steps(mp, 2)
  >>> params = {"w": jnp.ones(1, jnp.float16)}
  >>> state = opt.init(params)
  >>> for g in (1.0, 2.0):  # gradients of loss * 1024
  ...   grads = {"w": jnp.full(1, g * 1024, jnp.float16)}
  ...   updates, state = opt.update(grads, state, params)
  >>> optax.apply_updates(params, updates)["w"]  # 1 - mean(1, 2)
  Array([-0.5], dtype=float16)
  """
  if "accumulator_dtype" in kwargs:
    raise TypeError("multi_steps always accumulates in float32")
  inner = optax.MultiSteps(opt, every_k_schedule, **kwargs)

  def init_fn(params):
    return AccumulationState(inner.init(params), jnp.ones([], jnp.bool_))

  def update_fn(updates, state, params=None, **extra_args):
    finite = mp.all_finite(updates)
    if axis_name is not None:
      finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(bool)
    # fp32 microbatches: MultiSteps casts its mean to the gradients' dtype.
    wide = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
    updates, ms = inner.update(wide, state.multi_steps, params, **extra_args)
    clear = ms.mini_step == 0
    acc = jax.tree.map(
      lambda a: jnp.where(clear, jnp.zeros_like(a), a), ms.acc_grads
    )
    return updates, AccumulationState(ms._replace(acc_grads=acc), finite)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
