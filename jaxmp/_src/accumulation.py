"""Gradient accumulation that survives an overflowed window.

`optax.MultiSteps` (0.2.8) resets its accumulator as ``(1 - emit) * acc``: after
a window whose microbatch overflowed the accumulator holds inf/NaN and
``0 * inf`` keeps it NaN, so every later window is skipped too and the loss
scale collapses. `multi_steps` is `optax.MultiSteps` with the accumulator
cleared by a select instead.
"""

from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
import optax


def multi_steps(
  opt: optax.GradientTransformation,
  every_k_schedule: Union[int, Callable[[jax.Array], jax.Array]],
  **kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
  """`optax.MultiSteps` that recovers after an overflowed window.

  Put it outside `jaxmp.mixed_precision`:
  ``multi_steps(jaxmp.mixed_precision(inner), k)``. The loss scale then stays
  fixed within a window (``mixed_precision``'s state only moves when the
  window ends), a window with any overflowed microbatch is skipped as a whole,
  and the next window starts from a clean accumulator.

  Args:
    opt: the optimizer to call once per window, usually a
      `jaxmp.mixed_precision`.
    every_k_schedule: microbatches per window (or a schedule of it).
    **kwargs: passed to `optax.MultiSteps`.

  Returns:
    A gradient transformation with `optax.MultiStepsState` as its state.
  """
  inner = optax.MultiSteps(opt, every_k_schedule, **kwargs)

  def update_fn(updates, state, params=None, **extra_args):
    updates, state = inner.update(updates, state, params, **extra_args)
    clear = state.mini_step == 0
    acc = jax.tree.map(
      lambda a: jnp.where(clear, jnp.zeros_like(a), a), state.acc_grads
    )
    return updates, state._replace(acc_grads=acc)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)
