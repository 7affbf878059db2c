"""Unscaled gradients: an ``update`` in a traced step where no loss was scaled.

`jaxmp.value_and_grad` and `jaxmp.scale_loss` record the loss-scale tracer
they multiplied a loss by; ``mixed_precision``'s ``update`` looks its own
scale up. Inside one traced step (``jit``, ``shard_map``, ``pmap``,
``nnx.jit``, ``eqx.filter_jit``) the state passed in is the same tracer in
the forward pass and in ``update``, so the check is exact where it runs and
costs the compiled step nothing. Eager steps are not checked.
"""

import warnings
import weakref
from typing import Any

import jax

from jaxmp._src import frames


class UnscaledGradientsWarning(UserWarning):
  """``mixed_precision.update`` got gradients no jaxmp call scaled.

  Under a dynamic loss scale ``update`` divides the gradients by the scale
  (32768 at first): gradients of the plain loss (``jax.grad``,
  ``nnx.value_and_grad``, ``eqx.filter_grad``) then make steps 32768 times
  too small, in silence. Code that multiplies the loss by the scale by hand
  silences it with ``warnings.filterwarnings("ignore",
  category=jaxmp.UnscaledGradientsWarning)``.
  """


# The loss-scale tracers that `jaxmp.value_and_grad` or `jaxmp.scale_loss`
# multiplied a loss by, by id; weak, so an entry dies with its trace (and an
# id cannot be reused while its entry lives).
_SCALED: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def _scale_leaf(state: Any) -> Any:
  leaves = jax.tree_util.tree_leaves(state.loss_scale)  # An NNX variable too.
  return leaves[0] if leaves else None


def mark_scaled(state: Any) -> None:
  """Records that a loss was multiplied by ``state``'s scale in this trace."""
  scale = _scale_leaf(state)
  if isinstance(scale, jax.core.Tracer):
    _SCALED[id(scale)] = scale


def warn_if_unscaled(state: Any) -> None:
  """Warns when ``update`` runs in a trace where this scale scaled no loss.

  Only under a dynamic scale (a static one is the user's explicit choice)
  and only while tracing (``jit``, ``shard_map``, ``pmap``, ``nnx.jit``,
  ``eqx.filter_jit``): the scale is then the same tracer in the forward pass
  and in ``update``, so the check costs nothing and the compiled step
  nothing. Eager steps are not checked.
  """
  if state.config.kind != "dynamic":
    return
  scale = _scale_leaf(state)
  if not isinstance(scale, jax.core.Tracer):
    return
  if _SCALED.get(id(scale)) is scale:
    return
  warnings.warn(
    "jaxmp.mixed_precision's update got gradients that no "
    "jaxmp.value_and_grad or jaxmp.scale_loss scaled in this traced step. "
    "update divides them by the dynamic loss scale (32768 at first), so "
    "gradients of the plain loss (jax.grad, nnx.value_and_grad, "
    "eqx.filter_grad) make steps that many times too small. Compute them "
    "with loss, grads = jaxmp.value_and_grad(loss_fn)(params, opt_state, "
    "...) (Flax NNX: (model, optimizer.opt_state, ...)) and pass loss= to "
    "update, or differentiate jaxmp.scale_loss(loss, opt_state). Code that "
    "scales the loss by hand silences this with warnings.filterwarnings("
    "'ignore', category=jaxmp.UnscaledGradientsWarning)",
    UnscaledGradientsWarning,
    stacklevel=frames.user_stacklevel(),
  )
