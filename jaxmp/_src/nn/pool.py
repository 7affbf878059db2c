"""A max-pool whose gradient on CPU is elementwise work, not select-and-scatter.

``flax.linen.max_pool`` is ``lax.reduce_window(max)``; its gradient is
XLA's select-and-scatter, which XLA:CPU runs as a scalar loop over every
window: for the torchvision ResNet18's 3x3 stride-2 stem pool on CIFAR
(batch 128, 16x16x64) the forward takes 5 ms and forward plus gradient
59 ms, against PyTorch's 21 ms (``bench/cpu_ops.py``, AMD EPYC with
AVX-512). The same gradient, for a window of ``kh x kw`` taps, is::

    for each tap t, in the window's row-major order:
      hit_t = (x at tap t == y) and no earlier tap hit
      dx   += dy where hit_t, moved back to tap t's input positions

one strided compare-and-select per tap, and each move a ``lax.pad`` with
interior padding (the transpose of a strided slice). The first maximal tap of
each window takes the gradient, as in XLA's select-and-scatter (its select
is ``>=``), so ties go to the same input; only the order in which the
gradients of overlapping windows are summed can differ (last-bit rounding).
"""

import functools
from typing import Sequence, Union

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

from jaxmp._src.nn import conv

Padding = Union[str, Sequence[tuple[int, int]]]


def max_pool(
  inputs: jax.Array,
  window_shape: Sequence[int],
  strides: Sequence[int] | None = None,
  padding: Padding = "VALID",
) -> jax.Array:
  """``flax.linen.max_pool`` with a gather-free gradient on CPU.

  Same arguments and values as ``flax.linen.max_pool``. For 2-D windows over
  ``[N, H, W, C]`` floating-point inputs on CPU, the gradient is computed tap
  by tap: one strided compare-and-select per window tap, the first maximal
  tap of each window taking the gradient (as XLA's select-and-scatter does),
  instead of XLA's select-and-scatter, which XLA:CPU runs as a scalar loop
  over every window. Everything else, and every other platform, is flax's.

  Args:
    inputs: ``[N, H, W, C]`` (other ranks fall back to flax).
    window_shape: ``(kh, kw)``.
    strides: ``(sh, sw)``; ``None`` for ones.
    padding: ``"SAME"``, ``"VALID"`` or ``((lo, hi), (lo, hi))``.

  Returns:
    The pooled array, ``[N, Ho, Wo, C]``.
  """
  window = tuple(int(k) for k in window_shape)
  strides = tuple(int(s) for s in strides) if strides else (1,) * len(window)
  covered = (
    inputs.ndim == 4
    and len(window) == 2
    and len(strides) == 2
    and jnp.issubdtype(inputs.dtype, jnp.floating)
  )
  if not covered:
    return nn.max_pool(inputs, window, strides, padding)
  if isinstance(padding, str):
    pads = lax.padtype_to_pads(inputs.shape[1:3], window, strides, padding)
  else:
    pads = padding
  pads = tuple((int(lo), int(hi)) for lo, hi in pads)
  if any(p < 0 for pair in pads for p in pair):
    return nn.max_pool(inputs, window, strides, pads)
  return lax.platform_dependent(
    inputs,
    cpu=lambda x: _tap_max_pool(x, window, strides, pads),
    default=lambda x: _reduce_window_max(x, window, strides, pads),
  )


def _reduce_window_max(x, window, strides, pads):
  # A Python -inf, so that lax sees max's identity and uses its
  # differentiable max reducer.
  return lax.reduce_window(
    x,
    -jnp.inf,
    lax.max,
    (1, *window, 1),
    (1, *strides, 1),
    ((0, 0), *pads, (0, 0)),
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _tap_max_pool(x, window, strides, pads):
  return _reduce_window_max(x, window, strides, pads)


def _fwd(x, window, strides, pads):
  y = _reduce_window_max(x, window, strides, pads)
  return y, (x, y)


def _bwd(window, strides, pads, residuals, dy):
  x, y = residuals
  n, h, w, c = x.shape
  (kh, kw), (sh, sw) = window, strides
  ho, wo = y.shape[1:3]
  xp = lax.pad(
    x,
    jnp.array(-jnp.inf, x.dtype),
    ((0, 0, 0), (*pads[0], 0), (*pads[1], 0), (0, 0, 0)),
  )
  hp, wp = xp.shape[1:3]
  zero = jnp.zeros((), dy.dtype)
  taken = jnp.zeros(y.shape, bool)
  dxp = jnp.zeros(xp.shape, dy.dtype)
  span_h, span_w = sh * (ho - 1) + 1, sw * (wo - 1) + 1
  for i in range(kh):
    for j in range(kw):
      tap = conv.strided_tap(xp, i, j, strides, (ho, wo))
      hit = (tap == y) & ~taken
      taken = taken | hit
      dxp = dxp + lax.pad(
        jnp.where(hit, dy, zero),
        zero,
        (
          (0, 0, 0),
          (i, hp - i - span_h, sh - 1),
          (j, wp - j - span_w, sw - 1),
          (0, 0, 0),
        ),
      )
  (lo_h, _), (lo_w, _) = pads
  return (lax.slice(dxp, (0, lo_h, lo_w, 0), (n, lo_h + h, lo_w + w, c)),)


_tap_max_pool.defvjp(_fwd, _bwd)
