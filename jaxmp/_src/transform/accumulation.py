"""Gradient accumulation for `mixed_precision`: fp32 means, clean windows.

`multi_steps` is `optax.MultiSteps` (same state, same Welford mean, same
schedule and skip hooks) without four flaws that 0.2.8 has for loss-scaled
half gradients:

* it resets its accumulator as ``(1 - emit) * acc``: after a window whose
  microbatch overflowed the accumulator holds inf/NaN and ``0 * inf`` keeps it
  NaN, so every later window is skipped too and the loss scale collapses.
  `multi_steps` clears it with a select;
* it casts the fp32 accumulator back to the gradient dtype, so the window mean
  reaches the optimizer rounded to fp16. `multi_steps` accumulates the
  microbatches in fp32 and hands the fp32 mean on (`mixed_precision` unscales
  in fp32 anyway);
* its state says nothing about the microbatch just seen: `mixed_precision`'s
  ``step_applied`` only moves when a window ends, so mid-window it is stale.
  `multi_steps` checks every microbatch and keeps the flag in its state, for
  `jaxmp.rollback_if_skipped`;
* its ``lax.cond`` on the skip hook fails under ``shard_map`` with its default
  ``check_vma`` for device-varying gradients. `multi_steps` selects with
  ``jnp.where`` (and returns ``-0.0``, the additive identity of signed zeros
  too, as updates between windows).
"""

from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from jaxmp._src.inspect import placement
from jaxmp._src.scaling import finite as finite_lib
from jaxmp._src.state import pytrees
from jaxmp._src.state import sharding as sharding_lib


AccumulationState = pytrees.AccumulationState


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
  for the microbatches whose own gradients were not finite (or that
  ``should_skip_update_fn`` rejected: they count as never seen). A skipped window
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
    **kwargs: ``use_grad_mean`` and ``should_skip_update_fn``, as for
      `optax.MultiSteps`. The accumulator is always fp32.

  Returns:
    A gradient transformation with an `AccumulationState` as its state.

  >>> import jax.numpy as jnp, optax, jaxmp
  >>> inner = jaxmp.mixed_precision(optax.sgd(1.0), loss_scale=1024.0)
  >>> opt = jaxmp.multi_steps(inner, 2)
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
  # Validates the arguments and gives the state's structure.
  reference = optax.MultiSteps(opt, every_k_schedule, **kwargs)
  use_grad_mean = kwargs.get("use_grad_mean", True)
  should_skip = kwargs.get("should_skip_update_fn")
  every_k = (
    every_k_schedule
    if callable(every_k_schedule)
    else (lambda _: every_k_schedule)
  )
  opt = optax.with_extra_args_support(opt)

  @sharding_lib.placed_like_params  # The accumulator too, under jit.
  def init_fn(params):
    state = AccumulationState(reference.init(params), jnp.ones([], jnp.bool_))
    _check_inside(state)
    return state

  def update_fn(updates, state, params=None, **extra_args):
    ms = state.multi_steps
    finite = finite_lib.all_devices(finite_lib.all_finite(updates), axis_name)
    if should_skip is None:
      skip, skip_state = jnp.zeros([], jnp.bool_), ms.skip_state
    else:
      skip, skip_state = should_skip(updates, ms.gradient_step, params)
    n = ms.mini_step

    def accumulate(g, acc):
      g = g.astype(jnp.float32)
      return acc + (g - acc) / (n + 1) if use_grad_mean else acc + g

    acc = jax.tree.map(accumulate, updates, ms.acc_grads)
    inner_updates, inner_state = opt.update(
      acc, ms.inner_opt_state, params, **extra_args
    )
    emit = (n == every_k(ms.gradient_step) - 1) & ~skip
    zero = lambda u: jnp.asarray(-0.0, u.dtype)
    updates = jax.tree.map(lambda u: jnp.where(emit, u, zero(u)), inner_updates)
    inner_state = jax.tree.map(
      lambda new, old: jnp.where(emit, new, old).astype(old.dtype),
      inner_state,
      ms.inner_opt_state,
    )
    acc = jax.tree.map(
      lambda a, old: jnp.where(skip, old, jnp.where(emit, 0.0, a)),
      acc,
      ms.acc_grads,
    )
    ms = optax.MultiStepsState(
      mini_step=jnp.where(emit, 0, jnp.where(skip, n, n + 1)).astype(n.dtype),
      gradient_step=ms.gradient_step + emit.astype(ms.gradient_step.dtype),
      inner_opt_state=inner_state,
      acc_grads=acc,
      skip_state=skip_state,
    )
    return updates, AccumulationState(ms, finite & ~skip)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_inside(state: AccumulationState) -> None:
  """A `mixed_precision` inside must be directly inside (see `placement`)."""
  is_mp = lambda x: isinstance(x, pytrees.MixedPrecisionState)
  for x in jax.tree_util.tree_leaves(state, is_leaf=is_mp):
    if is_mp(x):
      placement.check_placement(state, x, AccumulationState)
