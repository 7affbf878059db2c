"""`value_and_grad`: the loss and the scaled gradients of a train step.

Where flax's `DynamicScale.value_and_grad` keeps the scale in its own object,
jaxmp keeps it in the optimizer state; so the state is an argument of every
call, and the scale the forward pass uses is always the one ``update`` will
unscale with. The loss comes back unscaled, ready for ``update(...,
loss=loss)``, and the gradients are those of ``loss * scale``, ready for
``update``: the two mistakes of a hand-written ``scale_loss`` step (a
forgotten scale, a state read from a global) cannot happen.
"""

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxmp._src.inspect import accessors
from jaxmp._src import nnx_support
from jaxmp._src.autocast import regions
from jaxmp._src.reduction import wire


def value_and_grad(
  fun: Callable[..., Any],
  has_aux: bool = False,
  *,
  wrt: Optional[Any] = None,
  argnums: int = 0,
  grad_reduce: str = "fp32",
) -> Callable[..., tuple[Any, Any]]:
  """Returns ``grad_fn(params, opt_state, *args, **kwargs) -> (loss, grads)``.

  ``fun(params, *args, **kwargs)`` returns the unscaled scalar loss (or
  ``(loss, aux)`` with ``has_aux=True``). ``grad_fn`` multiplies it by the
  loss scale of ``opt_state`` (in fp32, also for a half-precision loss) and
  differentiates that with respect to ``params``. It returns what ``fun``
  returned, unscaled, and the gradients of ``loss * scale``, which
  ``opt.update(grads, opt_state, params, loss=loss)`` unscales, checks and
  applies. Works under ``jit``, ``shard_map`` (reduce the gradients over the
  axis as usual, and give ``mixed_precision`` its ``axis_name``) and
  `jaxmp.multi_steps`.

  Flax NNX: pass the model as ``params``; ``fun(model, *args)`` may update
  its BatchNorm statistics as usual, and the gradients are an ``nnx.State``
  of the ``wrt`` variables (``nnx.Param`` by default), ready for
  ``opt.update(model, grads)``. ``opt_state`` is ``opt.opt_state``.

  Args:
    fun: the loss function; its first argument is differentiated.
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    wrt: NNX only: the filter of the variables to differentiate.
    argnums: only ``0``: the first argument of ``fun`` is differentiated (it
      sits before ``opt_state`` in ``grad_fn``'s arguments). To
      differentiate several arguments, pass them as one tuple.
    grad_reduce: where ``params`` hold fp16 or bf16 leaves, the dtype of
      their gradients' cross-device sums (under ``jit`` on a mesh, XLA sums
      a weight's gradient at the output of the backward product that gives
      it). ``"fp32"`` (default): those products output fp32, the sum runs
      in fp32, and each gradient is rounded once to its param's dtype after
      it; the same for the sums of broadcast weights (biases, norm scales)
      and gathered ones (embeddings). ``"half_wire"``: half on the wire,
      fp32 adds (over the mesh of ``jax.set_mesh`` or of the inputs'
      shardings; biases and norm scales in fp32). ``"native"``: plain
      JAX (the sums in half). With fp32 params, ``fun`` runs as it is
      (use ``jaxmp.autocast(..., grad_reduce=)`` for its products).

  Returns:
    ``grad_fn``, which returns ``(loss, grads)`` or, with ``has_aux``,
    ``((loss, aux), grads)``, as `jax.value_and_grad` does.

  Raises:
    TypeError: for ``argnums`` other than ``0``.
    ValueError: when ``mixed_precision`` is not the outermost transform of
      ``opt_state``, nor directly inside `jaxmp.multi_steps`, and when
      ``grad_fn``'s second argument holds no ``mixed_precision`` state. A
      state that is a constant of the function being traced (read from a
      global, not passed in) warns.

  >>> import jax, jax.numpy as jnp, optax, jaxmp
  >>> opt = jaxmp.mixed_precision(optax.sgd(0.5), loss_scale=8.0)
  >>> params = {"w": jnp.ones(2, jnp.float16)}
  >>> opt_state = opt.init(params)
  >>> loss_fn = lambda p, x: jnp.sum(p["w"] * x, dtype=jnp.float32)
  >>> loss, grads = jaxmp.value_and_grad(loss_fn)(params, opt_state, 2.0)
  >>> loss, grads["w"]  # the unscaled loss; the gradients of 8 * loss
  (Array(4., dtype=float32), Array([16., 16.], dtype=float16))
  >>> updates, opt_state = opt.update(grads, opt_state, params, loss=loss)
  >>> optax.apply_updates(params, updates)["w"]  # 1 - 0.5 * 2
  Array([0., 0.], dtype=float16)
  """
  grad_reduce = wire.check_mode(grad_reduce, "jaxmp.value_and_grad")
  if argnums != 0:
    raise TypeError(
      f"jaxmp.value_and_grad(fun, argnums={argnums!r}): only argnums=0 is "
      "supported: grad_fn(params, opt_state, *args) differentiates fun's "
      "first argument, and opt_state must come second. Put what you "
      "differentiate first, or pass several as one tuple: "
      "fun((a, b), x) with jaxmp.value_and_grad(fun)((a, b), opt_state, x)"
    )

  reducing = None
  if grad_reduce != "native":
    reducing = regions.reducing_in_fp32(fun, grad_reduce)

  def grad_fn(params, opt_state, *args, **kwargs):
    state = accessors.locate(
      opt_state,
      "jaxmp.value_and_grad",
      "opt_state, the second argument of grad_fn(params, opt_state, *args)",
    )
    scale = state.loss_scale
    loss_fn = reducing if reducing and _has_half(params) else fun

    def scaled_fun(p, *a, **k):
      out = loss_fn(p, *a, **k)
      loss, aux = out if has_aux else (out, None)
      return accessors.scaled(loss, scale), (loss, aux)

    if nnx_support.is_module(params):
      nnx = nnx_support.nnx()
      argnums = nnx.DiffState(0, nnx.Param if wrt is None else wrt)
      vg = nnx.value_and_grad(scaled_fun, argnums=argnums, has_aux=True)
    else:
      if wrt is not None:
        raise TypeError("wrt= is for NNX models; params is not an nnx.Module")
      vg = jax.value_and_grad(scaled_fun, has_aux=True)
    (_, (loss, aux)), grads = vg(params, *args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return grad_fn


def _has_half(params) -> bool:
  """Whether ``params`` (a pytree or an NNX module) holds fp16/bf16 leaves."""
  if nnx_support.is_module(params):
    params = nnx_support.nnx().state(params)
  return any(
    hasattr(x, "dtype") and jnp.dtype(x.dtype) in wire.HALF
    for x in jax.tree.leaves(params)
  )
