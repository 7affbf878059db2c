"""Convolutions for CPU, chosen per shape, exact against lax.

Measured per convolution of both ResNet18s at batch 128 on 2 cores of an AMD
EPYC with AVX-512, under `jaxmp.cpu_compiler_options` (``bench/cpu_ops.py``;
the table is in its docstring):

* **3x3 and larger kernels, more than 4 output pixels**: XLA's own
  convolution for the forward and both gradients. With XLA's convolutions
  (not YNNPACK's, see ``jaxmp/_src/nn/compiler.py``) its kernel gradient is
  1.2-2x faster than one matrix product per kernel tap (stage 1 of the CIFAR
  ResNet18: 115-150 ms against 250-320 ms).
* **1x1 kernels** (the strided projections): XLA's forward and input
  gradient, and the kernel gradient as one matrix product of the strided
  input and the output gradient (`kernel_grad_by_taps` with its single tap),
  2-4x faster than XLA's, which is a spatial convolution whose window is the
  whole feature map.
* **At most 4 output pixels** (the last stages of the torchvision ResNet18
  on 32x32 images): XLA:CPU's convolutions are 10-40x slower than a matrix
  product there, so the whole convolution, forward and gradients, is one
  im2col product (`conv_by_im2col`).
* **Gradients inside loops.** XLA:CPU runs a convolution on its fast
  (Eigen) kernel only in one layout, ``b01f_01io->b01f``. It rewrites
  ``lax``'s input and kernel gradients into that layout in a program's entry
  computation, but not inside a ``while`` body (``lax.fori_loop``,
  ``lax.scan``: several train steps per jitted call), where they run on a
  generic loop nest, many times slower (``bench/steps_per_call.py``). On
  CPU the gradients here are written in that layout (`input_grad_as_conv`,
  `kernel_grad_as_conv`): the same arithmetic as ``lax``'s (bitwise the
  same outside loops), fast in loops too.

`conv_general_dilated` is ``lax.conv_general_dilated`` (pass it to
``flax.linen.Conv(conv_general_dilated=...)``) with those choices on CPU; on
other platforms, and for convolutions it does not cover (dilation, feature
groups, layouts other than NHWC/HWIO), it is ``lax``'s, gradients included.
"""

import functools
import math
from typing import Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp

from jaxmp._src import vma as vma_lib
from jaxmp._src.reduction import wire

_NHWC = ("NHWC", "HWIO", "NHWC")
# Convolutions with at most this many output pixels per image run as one
# im2col matrix product on CPU (measured in bench/cpu_ops.py).
_IM2COL_PIXELS = 4
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
  """``lax.conv_general_dilated`` with faster CPU lowerings, chosen per shape.

  Same arguments, values (exact against ``lax``) and gradients as
  ``lax.conv_general_dilated``; pass it to
  ``flax.linen.Conv(conv_general_dilated=...)``. On CPU, for NHWC/HWIO
  convolutions without dilation or feature groups:

  * 3x3 and larger kernels with more than 4 output pixels: XLA's own
    convolution, forward and gradients (fastest under
    `jaxmp.cpu_compiler_options`);
  * 1x1 kernels: XLA's forward and input gradient, the kernel gradient as
    one matrix product (2-4x faster than XLA's);
  * at most 4 output pixels: the whole convolution as one im2col matrix
    product (XLA:CPU's convolutions are 10-40x slower there);
  * in the first two cases, XLA's convolutions for the gradients are
    written in the one layout that XLA:CPU also runs fast inside a loop
    body (``lax.fori_loop``, ``lax.scan``), where it leaves ``lax``'s own
    gradients in a layout it runs many times slower.

  Elsewhere, and on other platforms, it is ``lax``'s, gradients included.
  The covered convolutions have custom VJPs: reverse mode (``jax.grad``,
  ``jax.vjp``) only, not forward mode (``jax.jvp``). The timings are in
  ``bench/cpu_ops.py`` and ``bench/steps_per_call.py``.
  """
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
  strides = tuple(int(s) for s in window_strides)
  if _output_pixels(lhs.shape, rhs.shape, strides, padding) <= _IM2COL_PIXELS:
    return lax.platform_dependent(
      lhs,
      rhs,
      cpu=functools.partial(
        conv_by_im2col, strides=strides, padding=padding, precision=precision
      ),
      default=lambda x, w: _lax_conv(x, w, strides, padding, precision),
    )
  return _conv(lhs, rhs, strides, padding, precision)


def _output_pixels(lhs_shape, rhs_shape, strides, padding) -> int:
  pixels = 1
  for size, k, s, (lo, hi) in zip(
    lhs_shape[1:3], rhs_shape[:2], strides, padding
  ):
    pixels *= max((size + lo + hi - k) // s + 1, 0)
  return pixels


def conv_by_im2col(
  lhs: jax.Array,
  rhs: jax.Array,
  *,
  strides: Sequence[int],
  padding: Sequence[tuple[int, int]],
  precision: Optional[lax.Precision] = None,
) -> jax.Array:
  """An NHWC/HWIO convolution as one matrix product (im2col).

  The ``kh * kw`` strided windows of the padded input are laid side by side
  into ``[n * ho * wo, kh * kw * c]`` and multiplied by the kernel reshaped to
  ``[kh * kw * c, o]``, in fp32 for half-precision operands (fp64 for fp64
  ones), rounded once to ``lhs``'s dtype at the end. Its gradients are JAX's
  own: matrix products, and pads for the windows' transposes, all in that
  wider dtype, so that the input gradient sums its overlapping windows
  before its one rounding, as XLA's convolution does. On maps of a few
  pixels XLA:CPU's convolution is 10-40x slower than this product (2x2 and
  1x1 maps of 256-512 channels, the last stages of the torchvision ResNet18
  on 32x32 images: ``bench/cpu_ops.py``); on larger maps it is faster.

  Args:
    lhs: ``[n, h, w, c]``.
    rhs: ``[kh, kw, c, o]``.
    strides: the window strides.
    padding: ``((lo, hi), (lo, hi))``, explicit.
    precision: passed to the matrix product.

  Returns:
    ``[n, ho, wo, o]`` in ``lhs``'s dtype.
  """
  kh, kw, c, o = rhs.shape
  n = lhs.shape[0]
  sh, sw = strides
  # XLA:CPU computes half precision in fp32 anyway: widening first costs no
  # arithmetic, and keeps every gradient's partial sums wide.
  wide = _accumulation_dtype(lhs, rhs)
  x = jnp.pad(
    lhs.astype(wide), ((0, 0), tuple(padding[0]), tuple(padding[1]), (0, 0))
  )
  ho = (x.shape[1] - kh) // sh + 1
  wo = (x.shape[2] - kw) // sw + 1
  windows = [
    strided_tap(x, i, j, strides, (ho, wo))
    for i in range(kh)
    for j in range(kw)
  ]
  cols = jnp.concatenate(windows, axis=-1).reshape(n * ho * wo, kh * kw * c)
  y = jnp.matmul(
    cols, rhs.astype(wide).reshape(kh * kw * c, o), precision=precision
  )
  return y.reshape(n, ho, wo, o).astype(lhs.dtype)


def _accumulation_dtype(*arrays: jax.Array) -> jnp.dtype:
  """At least fp32: fp32 for half-precision operands, fp64 for fp64 ones."""
  return functools.reduce(
    jnp.promote_types, (a.dtype for a in arrays), jnp.float32
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

  def lax_grads():
    _, vjp = jax.vjp(
      lambda x: _lax_conv(x, rhs, strides, padding, precision), lhs
    )

    def kernel_grad(x, d):
      # The kernel's value is not read (the conv is linear in it).
      w, axes = jnp.zeros(rhs.shape, rhs.dtype), vma_lib.varying(x)
      w = vma_lib.mark_varying(w, tuple(sorted(axes))) if axes else w
      conv = lambda w: _lax_conv(x, w, strides, padding, precision)
      return jax.vjp(conv, w)[1](d)[0]

    dw = wire.summed_over_batch(kernel_grad, lhs, dy)
    dw = vma_lib.match(dw.astype(rhs.dtype), vma_lib.varying(rhs))
    return vjp(dy)[0], dw

  def cpu_grads():
    dx = input_grad_as_conv(dy, rhs, lhs.shape, strides, padding, precision)
    if rhs.shape[0] * rhs.shape[1] == 1:
      kernel_grad = kernel_grad_by_taps
    else:
      kernel_grad = kernel_grad_as_conv
    # Summed across devices as autocast's grad_reduce says (half_wire).
    dw = wire.summed_over_batch(
      lambda x, d: kernel_grad(x, d, rhs.shape, strides, padding, precision),
      lhs,
      dy,
    )
    # Under shard_map: typed as lax's gradients are (a replicated kernel's
    # summed over the axes the batch varies over).
    return (
      vma_lib.match(dx, vma_lib.varying(lhs)),
      vma_lib.match(dw.astype(rhs.dtype), vma_lib.varying(rhs)),
    )

  return lax.platform_dependent(cpu=cpu_grads, default=lax_grads)


def input_grad_as_conv(
  dy: jax.Array,
  rhs: jax.Array,
  lhs_shape: Sequence[int],
  strides: Sequence[int],
  padding: Sequence[tuple[int, int]],
  precision: Optional[lax.Precision] = None,
) -> jax.Array:
  """The input gradient of an NHWC/HWIO convolution, as one NHWC/HWIO conv.

  The convolution of ``dy`` (dilated by the strides) with the kernel
  flipped in space and its features swapped: the arithmetic of ``lax``'s
  transpose rule, written in the one layout that XLA:CPU hands to its fast
  convolution wherever the convolution is (see `kernel_grad_as_conv`).

  Args:
    dy: the gradient of the output, ``[n, ho, wo, o]``.
    rhs: the kernel, ``[kh, kw, c, o]``.
    lhs_shape: ``(n, h, w, c)``, the input's shape.
    strides: the window strides.
    padding: ``((lo, hi), (lo, hi))``, explicit.
    precision: passed to the convolution.

  Returns:
    ``[n, h, w, c]`` in ``dy``'s dtype.
  """
  pads = []
  for (lo, _), size, k, out, s in zip(
    padding, lhs_shape[1:3], rhs.shape[:2], dy.shape[1:3], strides
  ):
    # Output size: (out - 1) * s + 1 + lo' + hi' - k + 1 = size.
    pads.append((k - 1 - lo, size - (out - 1) * s - 1 + lo))
  flipped = jnp.transpose(rhs[::-1, ::-1], (0, 1, 3, 2))
  return lax.conv_general_dilated(
    dy,
    flipped,
    (1, 1),
    pads,
    lhs_dilation=tuple(strides),
    dimension_numbers=_NHWC,
    precision=precision,
  )


def kernel_grad_as_conv(
  lhs: jax.Array,
  dy: jax.Array,
  kernel_shape: Sequence[int],
  strides: Sequence[int],
  padding: Sequence[tuple[int, int]],
  precision: Optional[lax.Precision] = None,
) -> jax.Array:
  """The kernel gradient of an NHWC/HWIO convolution, as one NHWC/HWIO conv.

  The input's features become the batch and its batch the features
  (``[c, h, w, n]``), the output gradient the kernel (``[ho, wo, n, o]``,
  dilated by the strides): the arithmetic of ``lax``'s transpose rule, in
  the layout that XLA:CPU runs as its fast (Eigen) convolution. XLA:CPU
  rewrites ``lax``'s own layout into this one only outside loops: inside a
  ``while`` body (``lax.fori_loop``, ``lax.scan``) it runs the gradients
  in ``lax``'s layout on a generic loop nest, many times slower.

  Args:
    lhs: the convolution's input, ``[n, h, w, c]``.
    dy: the gradient of its output, ``[n, ho, wo, o]``.
    kernel_shape: ``(kh, kw, c, o)``.
    strides: the window strides.
    padding: ``((lo, hi), (lo, hi))``, explicit.
    precision: passed to the convolution.

  Returns:
    ``[kh, kw, c, o]`` in the operands' dtype.
  """
  pads = []
  for (lo, _), size, k, out, s in zip(
    padding, lhs.shape[1:3], kernel_shape[:2], dy.shape[1:3], strides
  ):
    # Output size: size + lo + hi' - ((out - 1) * s + 1) + 1 = k.
    pads.append((lo, k + (out - 1) * s - size - lo))
  out = lax.conv_general_dilated(
    jnp.transpose(lhs, (3, 1, 2, 0)),
    jnp.transpose(dy, (1, 2, 0, 3)),
    (1, 1),
    pads,
    rhs_dilation=tuple(strides),
    dimension_numbers=_NHWC,
    precision=precision,
  )
  return jnp.transpose(out, (1, 2, 0, 3))


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
    ``[kh, kw, c, o]`` in fp32 (products accumulated in fp32), or in fp64
    for fp64 operands.
  """
  kh, kw, c, o = kernel_shape
  n, ho, wo, _ = dy.shape
  x = jnp.pad(lhs, ((0, 0), tuple(padding[0]), tuple(padding[1]), (0, 0)))
  rows = n * ho * wo
  groups = math.gcd(n, 8) if rows >= _GROUP_ROWS * c * o else 1
  dy = dy.reshape(groups, rows // groups, o)
  taps = []
  for i in range(kh):
    for j in range(kw):
      window = strided_tap(x, i, j, strides, (ho, wo))
      window = window.reshape(groups, rows // groups, c)
      # Batched over the groups, then summed: independent products that
      # XLA:CPU spreads over its threads (one long contraction it does not).
      tap = jnp.einsum(
        "grc,gro->gco",
        window,
        dy,
        precision=precision,
        preferred_element_type=_accumulation_dtype(lhs, dy),
      )
      taps.append(tap.sum(0))
  return jnp.stack(taps).reshape(kh, kw, c, o)


def strided_tap(
  x: jax.Array, i: int, j: int, strides: Sequence[int], out_hw: Sequence[int]
) -> jax.Array:
  """Tap ``(i, j)`` of a window over NHWC ``x``: ``x[:, i::sh, j::sw]``.

  Args:
    x: the (padded) input, ``[n, h, w, c]``.
    i: the tap's row within the window.
    j: the tap's column within the window.
    strides: ``(sh, sw)``.
    out_hw: ``(ho, wo)``, the output pixels: the tap holds that many.

  Returns:
    ``[n, ho, wo, c]``: the input pixel under tap ``(i, j)`` of every window.
  """
  n, _, _, c = x.shape
  (sh, sw), (ho, wo) = strides, out_hw
  return lax.slice(
    x,
    (0, i, j, 0),
    (n, i + sh * (ho - 1) + 1, j + sw * (wo - 1) + 1, c),
    (1, sh, sw, 1),
  )
