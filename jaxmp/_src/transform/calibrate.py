"""`calibrate_loss_scale`: an initial loss scale from a few probe gradients.

A fixed initial scale (2**15 in jmp, GradScaler starts at 2**16) either
overflows for the first steps, each one skipped while the scale halves, or
starts lower than the gradients allow. Probing the first batch finds the
largest power of two whose scaled gradients are finite in a handful of
gradient evaluations: a binary search on the exponent, compiled once (the
scale is an argument of the jitted gradient, not a constant).
"""

import math
from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.scaling import finite as finite_lib


def calibrate_loss_scale(
  loss_fn: Callable[..., Any],
  params: Any,
  *args: Any,
  margin: float = 2.0,
  min_loss_scale: float = 1.0,
  max_loss_scale: float = 2.0**24,
  has_aux: bool = False,
  return_evaluations: bool = False,
) -> Union[float, tuple[float, int]]:
  """Returns an initial loss scale: the largest safe power of two / margin.

  Each probe evaluates ``jax.grad(lambda p: loss_fn(p, *args) * s)(params)``
  (the loss is promoted to fp32 first, as `jaxmp.scale_loss` does) and
  checks the gradients with `jaxmp.all_finite`. ``s`` runs over the powers
  of two from ``min_loss_scale`` to ``max_loss_scale * margin``: first the
  top one, then a binary search on the exponent between the largest finite
  and the smallest non-finite probe, assuming that a scale below a finite
  one is finite too. That is ``1 + ceil(log2(exponents))`` evaluations at
  most, 6 with the defaults.

  The result is ``min(largest finite scale / margin, max_loss_scale)``: with
  the default ``margin=2`` a batch whose gradients are twice as large as the
  probed one still does not overflow. Use it as the start of a dynamic
  scale, e.g. ``jmp.DynamicLossScale(jnp.float32(scale))``.

  Args:
    loss_fn: ``loss_fn(params, *args)`` returns the scalar, unscaled loss
      (``(loss, aux)`` with ``has_aux=True``). It may compute in float16 or
      bfloat16 and take half-precision params: their gradients are checked
      in their own dtype, where overflow happens.
    params: the params to differentiate with respect to.
    *args: the rest of ``loss_fn``'s arguments, e.g. the first batch.
    margin: a power of two >= 1 to divide the largest finite scale by.
    min_loss_scale: the smallest scale to probe, a power of two.
    max_loss_scale: the cap of the result, a power of two.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    return_evaluations: also return how many gradient evaluations it took.

  Returns:
    The scale as a Python float (a power of two), or ``(scale,
    evaluations)`` with ``return_evaluations=True``.

  Raises:
    ValueError: for a bad ``margin`` or bounds, or when the gradients are
      non-finite even at ``min_loss_scale`` (then the loss itself, or the
      model, produces inf/NaN: no loss scale fixes it).

  >>> import jax.numpy as jnp, jaxmp
  >>> loss_fn = lambda w, x: jnp.sum(w * x) ** 2  # d/dw = 2 * sum(w * x) * x
  >>> w, x = jnp.ones(4, jnp.float16), jnp.full(4, 8.0, jnp.float16)
  >>> # grads 512 in fp16: 2**6 * 512 is finite, 2**7 * 512 > 65504 is inf.
  >>> jaxmp.calibrate_loss_scale(loss_fn, w, x, return_evaluations=True)
  (32.0, 6)
  """
  lo = _exponent(min_loss_scale, "min_loss_scale")
  top = _exponent(max_loss_scale, "max_loss_scale")
  extra = _exponent(margin, "margin")
  if extra < 0:
    raise ValueError(f"margin must be >= 1, got {margin}")
  if top < lo:
    raise ValueError(
      f"max_loss_scale={max_loss_scale} is below min_loss_scale="
      f"{min_loss_scale}"
    )
  hi = top + extra

  def probe(scale, params, *args):
    def scaled(p):
      out = loss_fn(p, *args)
      loss = out[0] if has_aux else out
      loss = jnp.asarray(loss)
      dtype = jnp.promote_types(loss.dtype, jnp.float32)
      return loss.astype(dtype) * scale.astype(dtype), loss

    grads, loss = jax.grad(scaled, has_aux=True)(params)
    return finite_lib.all_finite(grads), jnp.all(jnp.isfinite(loss))

  probe = jax.jit(probe)
  evaluations = 0

  def finite(e: int) -> bool:
    nonlocal evaluations
    evaluations += 1
    ok, loss_ok = jax.device_get(probe(jnp.float32(2.0**e), params, *args))
    if not loss_ok:
      raise ValueError(
        "the loss itself is NaN/inf: bad input data, a diverged model, or "
        "an fp16 overflow in the forward pass (the activations), which no "
        "loss scale can fix; run the loss in fp32 to tell them apart"
      )
    return bool(ok)

  if finite(hi):
    best = hi
  else:
    good, bad = lo - 1, hi  # lo - 1: no finite probe yet.
    while bad - good > 1:
      mid = (good + bad) // 2
      if finite(mid):
        good = mid
      else:
        bad = mid
    if good < lo:
      raise ValueError(
        f"gradients are non-finite even at the smallest probed loss scale "
        f"{min_loss_scale:g}: the model itself overflows (or produces NaN); "
        "no loss scale fixes that"
      )
    best = good
  scale = min(2.0 ** (best - extra), 2.0**top)
  return (scale, evaluations) if return_evaluations else scale


def _exponent(value: float, name: str) -> int:
  value = float(np.asarray(value))
  if not (np.isfinite(value) and value > 0):
    raise ValueError(f"{name} must be a finite power of two, got {value}")
  e = math.log2(value)
  if e != int(e):
    raise ValueError(f"{name} must be a power of two, got {value}")
  return int(e)
