"""A convolution whose kernel gradient XLA:CPU computes as matrix products.

XLA:CPU lowers the kernel gradient of a convolution to a generic spatial
convolution whose "kernel" is the whole output feature map; at the CIFAR
ResNet18's first stage (batch 128, 32x32, 64 channels) that takes ~4 s
where PyTorch's oneDNN takes ~0.2 s (``bench/conv_grads.py``). The same
gradient is a sum over kernel taps of one matrix product each::

    dw[i, j] = sum over (n, y, x) of
               x_padded[n, s*y + i, s*x + j, :]^T  dy[n, y, x, :]

which XLA:CPU runs at the speed of its matrix multiply (0.2-0.4 s there).
`conv_general_dilated` is ``lax.conv_general_dilated`` (pass it to
``flax.linen.Conv(conv_general_dilated=...)``) with that kernel gradient on
CPU; on other platforms, and for convolutions it does not cover (dilation,
feature groups, layouts other than NHWC/HWIO), it is ``lax``'s, gradient
included.
"""

import functools
import math
from typing import Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp

_NHWC = ("NHWC", "HWIO", "NHWC")
# Above this many rows of the contraction per kernel element, the taps are
# split into independent batched products, which XLA:CPU runs in parallel.
_GROUP_ROWS = 16


def conv_general_dilated(
  lhs,
  rhs,
  window_strides,
  padding,
  lhs_dilation=None,
  rhs_dilation=None,
  dimension_numbers=None,
  feature_group_count=1,
  batch_group_count=1,
  precision=None,
  preferred_element_type=None,
):
  """``lax.conv_general_dilated`` with a matmul kernel gradient on CPU."""
  covered = (
    lhs.ndim == 4
    and _is_nhwc(lhs, rhs, dimension_numbers)
    and not isinstance(padding, str)
    and all(d == 1 for d in (lhs_dilation or (1, 1)))
    and all(d == 1 for d in (rhs_dilation or (1, 1)))
    and feature_group_count == 1
    and batch_group_count == 1
    and preferred_element_type is None
  )
  if not covered:
    return lax.conv_general_dilated(
      lhs,
      rhs,
      window_strides,
      padding,
      lhs_dilation,
      rhs_dilation,
      dimension_numbers,
      feature_group_count,
      batch_group_count,
      precision,
      preferred_element_type,
    )
  padding = tuple((int(lo), int(hi)) for lo, hi in padding)
  return _conv(
    lhs, rhs, tuple(int(s) for s in window_strides), padding, precision
  )


def _is_nhwc(lhs, rhs, dimension_numbers) -> bool:
  if dimension_numbers is None:
    return False
  as_numbers = lambda dn: lax.conv_dimension_numbers(lhs.shape, rhs.shape, dn)
  return as_numbers(dimension_numbers) == as_numbers(_NHWC)


def _lax_conv(lhs, rhs, strides, padding, precision):
  return lax.conv_general_dilated(
    lhs, rhs, strides, padding, dimension_numbers=_NHWC, precision=precision
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _conv(lhs, rhs, strides, padding, precision):
  return _lax_conv(lhs, rhs, strides, padding, precision)


def _conv_fwd(lhs, rhs, strides, padding, precision):
  return _lax_conv(lhs, rhs, strides, padding, precision), (lhs, rhs)


def _conv_bwd(strides, padding, precision, residuals, dy):
  lhs, rhs = residuals
  _, lhs_vjp = jax.vjp(
    lambda x: _lax_conv(x, rhs, strides, padding, precision), lhs
  )
  (dx,) = lhs_vjp(dy)

  def lax_kernel_grad():
    _, rhs_vjp = jax.vjp(
      lambda w: _lax_conv(lhs, w, strides, padding, precision), rhs
    )
    return rhs_vjp(dy)[0]

  def taps_kernel_grad():
    grad = kernel_grad_by_taps(lhs, dy, rhs.shape, strides, padding, precision)
    return grad.astype(rhs.dtype)

  dw = lax.platform_dependent(cpu=taps_kernel_grad, default=lax_kernel_grad)
  return dx, dw


_conv.defvjp(_conv_fwd, _conv_bwd)


def kernel_grad_by_taps(
  lhs: jax.Array,
  dy: jax.Array,
  kernel_shape: Sequence[int],
  strides: Sequence[int],
  padding: Sequence[tuple[int, int]],
  precision: Optional[lax.Precision] = None,
) -> jax.Array:
  """The kernel gradient of an NHWC/HWIO convolution, one matmul per tap.

  Args:
    lhs: the convolution's input, ``[n, h, w, c]``.
    dy: the gradient of its output, ``[n, ho, wo, o]``.
    kernel_shape: ``(kh, kw, c, o)``.
    strides: the window strides.
    padding: ``((lo, hi), (lo, hi))``, explicit.
    precision: passed to the matrix products.

  Returns:
    ``[kh, kw, c, o]`` in fp32 (products accumulated in fp32).
  """
  kh, kw, c, o = kernel_shape
  n, ho, wo, _ = dy.shape
  sh, sw = strides
  x = jnp.pad(lhs, ((0, 0), tuple(padding[0]), tuple(padding[1]), (0, 0)))
  rows = n * ho * wo
  groups = math.gcd(n, 8) if rows >= _GROUP_ROWS * c * o else 1
  dy = dy.reshape(groups, rows // groups, o)
  taps = []
  for i in range(kh):
    for j in range(kw):
      window = lax.slice(
        x,
        (0, i, j, 0),
        (n, i + sh * (ho - 1) + 1, j + sw * (wo - 1) + 1, c),
        (1, sh, sw, 1),
      )
      window = window.reshape(groups, rows // groups, c)
      # Batched over the groups, then summed: independent products that
      # XLA:CPU spreads over its threads (one long contraction it does not).
      tap = jnp.einsum(
        "grc,gro->gco",
        window,
        dy,
        precision=precision,
        preferred_element_type=jnp.float32,
      )
      taps.append(tap.sum(0))
  return jnp.stack(taps).reshape(kh, kw, c, o)
