"""Block-scaled fp8 and fp4: MXFP8, DeepSeek's fp8 blocks and NVFP4.

:func:`quantize` cuts a tensor into blocks (1D along an axis, or 2D over
the last two axes), gives each block a scale and rounds its elements to a
narrow float format; its docstring gives each format's rule.
:class:`Quantized` holds the codes and the scales, and
:meth:`Quantized.dequantize` reads them back. :func:`fake_quantize` is the
round trip, as an emulated block-scaled product uses it.

Exactness on XLA: MXFP8's exponent comes from ``amax``'s bits by integer
math (ml_dtypes' and XLA's e8m0 casts round to nearest), and its scaling by
a power of two is done on exponents, since XLA flushes float32 subnormals
(``2**-127`` included) to zero in arithmetic. Every division is one IEEE
division (``_div``), and e2m1's rounding is done in float32 before an exact
cast, since XLA:CPU's older emitters round that cast through float16.
"""

import dataclasses
import functools
from typing import Any, Optional, Tuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

_F32 = jnp.float32
_TINY = float(np.finfo(np.float32).tiny)  # 2**-126
_F32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class _Spec:
  """One format: its block, element dtype and scale rule."""

  block: Tuple[int, ...]  # (n,) along axis, or (rows, cols): last two axes
  elem: Any  # the element dtype
  rule: str  # "mx" (e8m0), "fp32" or "nvfp4"


_SPECS = {
  "mxfp8": _Spec((32,), jnp.float8_e4m3fn, "mx"),
  "mxfp8_e5m2": _Spec((32,), jnp.float8_e5m2, "mx"),
  "fp8_1x128": _Spec((128,), jnp.float8_e4m3fn, "fp32"),
  "fp8_128x128": _Spec((128, 128), jnp.float8_e4m3fn, "fp32"),
  "nvfp4": _Spec((16,), jnp.float4_e2m1fn, "nvfp4"),
  "nvfp4_16x16": _Spec((16, 16), jnp.float4_e2m1fn, "nvfp4"),
}

#: The format names :func:`quantize` accepts.
FORMATS = tuple(_SPECS)


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=("data", "scale", "global_scale"),
  meta_fields=("fmt", "axis"),
)
@dataclasses.dataclass(frozen=True)
class Quantized:
  """A block-scaled tensor: codes, block scales and a per-tensor scale.

  A pytree (``fmt`` and ``axis`` are static): it passes through
  ``jax.jit`` and ``jax.tree_util`` as its three arrays.

  Attributes:
    data: the element codes in the format's element dtype
      (``float8_e4m3fn``, ``float8_e5m2`` or ``float4_e2m1fn``), in the
      input's shape (the padding of a last partial block is dropped).
    scale: the block scales: ``float8_e8m0fnu`` (mxfp8), ``float32``
      (fp8_1x128, fp8_128x128) or ``float8_e4m3fn`` (nvfp4). The input's
      shape with the blocked axes divided by the block size, rounded up:
      ``x.shape[axis]`` becomes ``ceil(n / 32)`` (``/ 128``, ``/ 16``) for
      the 1D formats, the last two axes ``ceil(m / 128), ceil(n / 128)``
      (``/ 16``) for the 2D formats.
    global_scale: NVFP4's per-tensor scale ``T = 6 * 448 / amax(x)``, a
      float32 of shape ``()`` that multiplies ``x`` before the block scales
      (so the value is ``data * scale / T``); ``None`` for the other formats.
    fmt: the format's name, one of ``FORMATS``.
    axis: the blocked axis (non-negative) of the 1D formats; ``None`` for
      the 2D formats (their blocks cover the last two axes).
  """

  data: jax.Array
  scale: jax.Array
  global_scale: Optional[jax.Array]
  fmt: str
  axis: Optional[int]

  def dequantize(self) -> jax.Array:
    """The values the codes stand for, float32, in the input's shape.

    ``data * scale`` (mxfp8 exactly, subnormal results included; the fp8
    formats rounded once) or ``data * scale / global_scale`` (nvfp4), each
    block's scale applied to its elements.
    """
    spec = _SPECS[self.fmt]
    shape = self.data.shape
    axis = self.axis if self.axis is not None else -1
    codes = _to_blocks(self.data.astype(_F32), spec, axis)
    scale = _scale_grid(self.scale, spec, axis)[..., None]
    if spec.rule == "mx":
      out = _mul_pow2(codes, _e8m0_exponent(scale))
    elif spec.rule == "fp32":
      out = codes * scale
    else:
      out = _div(codes * scale.astype(_F32), self.global_scale)
    return _from_blocks(out, spec, axis, shape)


def quantize(
  x: jax.typing.ArrayLike,
  fmt: str,
  axis: int = -1,
  key: Optional[jax.Array] = None,
  *,
  amax: Optional[jax.typing.ArrayLike] = None,
) -> Quantized:
  """``x`` in a block-scaled fp8 or fp4 format: codes and block scales.

  The formats (``amax``: the largest magnitude in a block):

  * ``"mxfp8"`` / ``"mxfp8_e5m2"`` (OCP Microscaling, TransformerEngine's
    ``MXFP8BlockScaling``): 1x32 blocks along ``axis``, ``float8_e4m3fn``
    / ``float8_e5m2`` elements, a ``float8_e8m0fnu`` scale by the round-up
    rule of cuBLAS, TransformerEngine and ``jax.nn``: ``X =
    2**ceil(log2(amax / fmax))`` (``fmax`` 448 / 57344; ``2**-127`` at
    least, and for an all-zero block), elements ``saturate(RNE(x / X))``.
    Exact for every finite input, float32 subnormals included.
  * ``"fp8_1x128"`` / ``"fp8_128x128"`` (DeepSeek-V3's recipe,
    TransformerEngine's ``Float8BlockScaling``): 1x128 tiles along
    ``axis`` / 128x128 blocks over the last two axes, a float32 scale
    ``amax / 448`` (1 where ``amax`` is 0; at least ``2**-126``), elements
    ``saturate(RNE(x / scale))`` in ``float8_e4m3fn``.
  * ``"nvfp4"`` / ``"nvfp4_16x16"`` (NVIDIA's NVFP4, TransformerEngine's
    ``NVFP4BlockScaling``): 1x16 blocks along ``axis`` / 16x16 blocks over
    the last two axes, a per-tensor float32 ``T = 6 * 448 / amax(x)`` (1
    where it is 0; float32's largest at most), a ``float8_e4m3fn`` block
    scale ``b = e4m3(min(amax / 6 * T, 448))`` and ``float4_e2m1fn``
    elements ``e2m1(clip(x * T / b, -6, 6))``; the value is ``q * b / T``,
    and a block whose ``b`` rounds to zero is zero.

  ``x`` is read in float32; each division is one IEEE division (XLA would
  otherwise multiply by a rounded reciprocal), so the codes are those of a
  float32 numpy evaluation of these rules, on any CPU. In the float32-scale
  formats, float32 subnormals (below ``2**-126``) count as zeros, as XLA's
  arithmetic reads them. A shape the block does not divide is padded with
  zeros for the scales. Finite inputs give finite codes and scales (and
  values, unless one rounds up past float32's largest); a block holding an
  inf or a NaN dequantizes to NaN (under NVFP4, the whole tensor does).
  Works under ``jax.jit``, with a traced ``key``.

  >>> import jax.numpy as jnp
  >>> q = quantize(jnp.array([[1.0, -3.0, 500.0, 0.0]]), "mxfp8")
  >>> q.data.dtype, q.scale.dtype, q.scale.shape
  (dtype(float8_e4m3fn), dtype(float8_e8m0fnu), (1, 1))
  >>> q.scale.astype(jnp.float32), q.data.astype(jnp.float32)
  (Array([[2.]], dtype=float32), Array([[  0.5,  -1.5, 256. ,   0. ]], dtype=float32))
  >>> q.dequantize()
  Array([[  1.,  -3., 512.,   0.]], dtype=float32)

  Args:
    x: the array (any float dtype, at least 1D; 2D for the 2D formats).
    fmt: the format: ``"mxfp8"``, ``"mxfp8_e5m2"``, ``"fp8_1x128"``,
      ``"fp8_128x128"``, ``"nvfp4"`` or ``"nvfp4_16x16"``.
    axis: the axis the 1D formats' blocks run along (the contraction axis
      of a product); the 2D formats block the last two axes and ignore it.
    key: a ``jax.random`` key: NVFP4's elements are rounded stochastically,
      up to the next grid value with probability equal to the distance
      from the lower one in units of the step between the two (unbiased;
      the same codes for the same key). ``None``: round to nearest even.
      The other formats take no key.
    amax: NVFP4 only: the ``amax(x)`` that ``T`` is computed from, instead
      of ``max |x|`` (a float32 scalar, such as the maximum over the shards
      of a tensor inside ``shard_map``, by ``lax.pmax``). Below ``max
      |x|``, the block scales saturate at 448 and the codes at 6.

  Returns:
    A pytree with the static fields ``fmt`` and ``axis`` (the blocked axis,
    non-negative; ``None`` for the 2D formats), the arrays

    * ``data``: the codes, in the element dtype and in ``x``'s shape;
    * ``scale``: the block scales (``float8_e8m0fnu``, ``float32`` or
      ``float8_e4m3fn``), in ``x``'s shape with the blocked axes divided by
      the block, rounded up: ``(4, 100)`` along the last axis in 1x32
      blocks gives ``(4, 4)``, ``(300, 200)`` in 128x128 blocks ``(3, 2)``;
    * ``global_scale``: NVFP4's ``T`` (the factor ``x`` is multiplied by,
      so values are ``data * scale / T``), float32 of shape ``()``;
      ``None`` for the other formats;

    and ``dequantize()``: the values, float32 in ``x``'s shape (mxfp8's
    exactly, subnormal results included).

  Raises:
    ValueError: an unknown format, an axis out of range, a rank too low
      for the format, or ``key`` or ``amax`` with a format other than NVFP4.
  """
  if fmt not in _SPECS:
    raise ValueError(f"unknown block format {fmt!r}; one of {FORMATS}")
  spec = _SPECS[fmt]
  x = jnp.asarray(x)
  if x.ndim < len(spec.block):
    raise ValueError(
      f"format {fmt!r} needs an array of rank >= {len(spec.block)}, "
      f"got shape {x.shape}"
    )
  if len(spec.block) == 1:
    if not -x.ndim <= axis < x.ndim:
      raise ValueError(f"axis {axis} out of range for shape {x.shape}")
    axis = axis % x.ndim
  else:
    axis = None
  if spec.rule != "nvfp4":
    if key is not None:
      raise ValueError(
        f"stochastic rounding (key=) is for NVFP4 only, not {fmt!r}"
      )
    if amax is not None:
      raise ValueError(f"amax= is for NVFP4 only, not {fmt!r}")
  elif amax is not None and jnp.ndim(amax) != 0:
    raise ValueError(f"amax must be a scalar, got shape {jnp.shape(amax)}")
  x = x.astype(_F32)
  block_axis = axis if axis is not None else -1
  xb = _to_blocks(x, spec, block_axis)
  global_scale = None
  if spec.rule == "mx":
    codes, scale = _mx(xb, spec.elem)
  elif spec.rule == "fp32":
    codes, scale = _fp32(xb)
  else:
    codes, scale, global_scale = _nvfp4(xb, key, amax)
  data = _from_blocks(codes, spec, block_axis, x.shape).astype(spec.elem)
  scale = _scale_layout(scale[..., 0], spec, block_axis)
  return Quantized(data, scale, global_scale, fmt, axis)


def fake_quantize(
  x: jax.typing.ArrayLike,
  fmt: str,
  axis: int = -1,
  key: Optional[jax.Array] = None,
  *,
  amax: Optional[jax.typing.ArrayLike] = None,
) -> jax.Array:
  """``quantize(x, fmt, axis, key).dequantize()``: float32, ``x``'s shape."""
  return quantize(x, fmt, axis=axis, key=key, amax=amax).dequantize()


# The three scale rules, on blocks: xb is float32 (..., n_elements_a_block).


def _mx(xb, elem):
  """MXFP8: codes and e8m0 scales by the round-up rule, in integer math."""
  bits = lax.bitcast_convert_type(xb, jnp.uint32)
  mag = bits & np.uint32(0x7FFFFFFF)
  amax = jnp.max(mag, axis=-1, keepdims=True)  # float order on magnitudes
  # fmax = 1.75 * 2**f for both formats: amax = m * 2**e with m in [1, 2)
  # needs X = 2**(e - f) where m <= 1.75, else 2**(e - f + 1).
  f = {jnp.dtype(jnp.float8_e4m3fn): 8, jnp.dtype(jnp.float8_e5m2): 15}[
    jnp.dtype(elem)
  ]
  fmax = 1.75 * 2.0**f
  e = (amax >> 23).astype(jnp.int32) - 127
  up = ((amax & np.uint32(0x7FFFFF)) > 0x600000).astype(jnp.int32)
  k = jnp.maximum(e - f + up, -127)  # zero and subnormal amax: 2**-127
  finite = (amax >> 23) != 255
  scale_bits = jnp.where(finite, k + 127, 255).astype(jnp.uint8)
  scale = lax.bitcast_convert_type(scale_bits, jnp.float8_e8m0fnu)
  # x / X on the exponent: a subnormal x is its integer mantissa times
  # 2**-149, and a result below 2**-126 rounds to a zero code anyway.
  subnormal = (mag >> 23) == 0
  mant = (mag & np.uint32(0x7FFFFF)).astype(_F32)
  negative = (bits >> 31) == 1
  f_sub = jnp.where(negative, -mant, mant)
  v = jnp.where(subnormal, f_sub, xb)
  shift = jnp.where(subnormal, -149, 0) - k
  y = v * _pow2(jnp.clip(shift, -126, 127))
  # |y| <= fmax by the round-up rule: the clip only saturates an inf.
  codes = jnp.clip(y, -fmax, fmax).astype(elem)
  return codes, scale


def _fp32(xb):
  """DeepSeek's fp8: float32 scales amax / 448, e4m3 codes."""
  xb = _flush_subnormals(xb)
  amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
  scale = jnp.where(amax > 0, jnp.maximum(_div(amax, 448.0), _TINY), 1.0)
  # A non-finite block dequantizes to NaN whatever the backend's min/max
  # make of NaN (jaxlib 0.9's clip and max drop it).
  scale = jnp.where(jnp.isfinite(amax), scale, jnp.nan)
  codes = jnp.clip(_div(xb, scale), -448.0, 448.0)
  return codes.astype(jnp.float8_e4m3fn), scale


def _nvfp4(xb, key, amax_t):
  """NVFP4: per-tensor T, e4m3 block scales, e2m1 codes."""
  xb = _flush_subnormals(xb)
  ab = jnp.abs(xb)
  if amax_t is None:
    amax_t = jnp.max(ab)
  else:
    amax_t = _flush_subnormals(jnp.asarray(amax_t, _F32))
  # A NaN amax gives a NaN T (so every value is NaN), an inf one T = 0.
  t = jnp.minimum(6.0 * 448.0 / amax_t, _F32_MAX)
  t = jnp.where(amax_t == 0, 1.0, t).astype(_F32)
  amax = jnp.max(ab, axis=-1, keepdims=True)
  b = jnp.minimum(_div(amax, 6.0) * t, 448.0).astype(jnp.float8_e4m3fn)
  bf = b.astype(_F32)
  y = jnp.where(bf > 0, _div(xb * t, bf), 0.0)
  y = jnp.clip(y, -6.0, 6.0)
  return _e2m1_round(y, key).astype(jnp.float4_e2m1fn), b, t


def _e2m1_round(y, key):
  """``y`` (in [-6, 6]) onto e2m1's grid: to nearest even, or stochastically.

  The grid's step is 0.5 below 2, 1 below 4 and 2 up to 6, and a grid
  value's index in steps is even where its mantissa bit is 0, so rounding
  ``|y| / step`` to the nearest even integer is e2m1's RNE. Done here in
  float32 (exact: the steps are powers of two) rather than by the cast,
  which XLA:CPU's older emitters round through float16, twice. With a key,
  ``|y|`` goes up to the next grid value with probability ``(|y| - lo) /
  step``: unbiased.
  """
  a = jnp.abs(y)
  step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0))
  n = a / step
  if key is None:
    n = jnp.round(n)  # half to even
  else:
    lo = jnp.floor(n)
    n = lo + (jax.random.uniform(key, y.shape, _F32) < n - lo)
  r = n * step
  return jnp.copysign(r, y)


# Exact helpers.


def _div(a, b):
  """``a / b`` as one IEEE division.

  XLA rewrites ``a / broadcast(b)`` and ``a / constant`` into ``a * (1 /
  b)``, which rounds twice; a full-shaped select keeps the divisor opaque.
  """
  a = jnp.asarray(a, _F32)
  b = jnp.asarray(b, _F32)
  a = jnp.broadcast_to(a, jnp.broadcast_shapes(a.shape, b.shape))
  return a / jnp.where(a == a, b, jnp.nan)


def _flush_subnormals(x):
  """``x`` with float32 subnormals as signed zeros.

  XLA's arithmetic reads them so on CPU and GPU; flushing them first makes
  the rule the formats state, whatever the backend's denormal mode.
  """
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  sub = (bits & np.uint32(0x7F800000)) == 0
  return jnp.where(
    sub, lax.bitcast_convert_type(bits & ~np.uint32(0x7FFFFFFF), _F32), x
  )


def _pow2(k):
  """``2.0**k`` in float32 for integer ``k`` in [-126, 127], built from bits."""
  return lax.bitcast_convert_type(((k + 127).astype(jnp.uint32) << 23), _F32)


def _e8m0_exponent(scale):
  """The unbiased exponent of e8m0 scales (int32; 128 for NaN)."""
  return lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32) - 127


def _mul_pow2(v, k):
  """``v * 2**k`` exactly, subnormal results included, NaN where k is 128.

  ``v`` are codes of an fp8 format in float32 (at most 4 significant bits,
  at least ``2**-16``), ``k >= -127``: the result's significand shifts
  right without losing bits. Built on the bits, as XLA flushes subnormals.
  """
  bits = lax.bitcast_convert_type(v, jnp.uint32)
  sign = bits & np.uint32(0x80000000)
  ev = ((bits >> 23) & np.uint32(0xFF)).astype(jnp.int32)
  mant = bits & np.uint32(0x7FFFFF)
  ne = ev + k
  normal = sign | (jnp.clip(ne, 1, 255).astype(jnp.uint32) << 23) | mant
  normal = jnp.where(ne >= 255, sign | np.uint32(0x7F800000), normal)
  shift = jnp.clip(1 - ne, 0, 31).astype(jnp.uint32)
  sub = sign | ((mant | np.uint32(0x800000)) >> shift)
  out = jnp.where(ne >= 1, normal, sub)
  out = jnp.where(ev == 0, sign, out)  # zero codes stay (signed) zero
  out = lax.bitcast_convert_type(out, _F32)
  return jnp.where((k == 128) | (ev == 255), jnp.nan, out)


# Layout: blocks on a trailing axis and back.


def _to_blocks(x, spec, axis):
  """``x`` as (..., blocks..., block_elements), zero-padded to whole blocks.

  1D formats: ``axis`` moved last, (..., n) -> (..., n / B, B). 2D formats:
  (..., m, n) -> (..., m / R, n / C, R * C).
  """
  if len(spec.block) == 1:
    (size,) = spec.block
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    nb = -(-n // size)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * size - n)])
    return x.reshape(*x.shape[:-1], nb, size)
  rows, cols = spec.block
  m, n = x.shape[-2:]
  mb, nb = -(-m // rows), -(-n // cols)
  pad = [(0, 0)] * (x.ndim - 2) + [(0, mb * rows - m), (0, nb * cols - n)]
  x = jnp.pad(x, pad).reshape(*x.shape[:-2], mb, rows, nb, cols)
  x = jnp.swapaxes(x, -3, -2)
  return x.reshape(*x.shape[:-2], rows * cols)


def _from_blocks(xb, spec, axis, shape):
  """The inverse of :func:`_to_blocks`: ``shape`` back, padding dropped."""
  if len(spec.block) == 1:
    x = xb.reshape(*xb.shape[:-2], -1)
    x = x[..., : shape[axis]]
    return jnp.moveaxis(x, -1, axis)
  rows, cols = spec.block
  mb, nb = xb.shape[-3:-1]
  x = xb.reshape(*xb.shape[:-1], rows, cols)
  x = jnp.swapaxes(x, -3, -2).reshape(*xb.shape[:-3], mb * rows, nb * cols)
  return x[..., : shape[-2], : shape[-1]]


def _scale_layout(scale, spec, axis):
  """Block scales (..., blocks...) in the input's layout (``axis`` back)."""
  if len(spec.block) == 1:
    return jnp.moveaxis(scale, -1, axis)
  return scale


def _scale_grid(scale, spec, axis):
  """The inverse of :func:`_scale_layout`."""
  if len(spec.block) == 1:
    return jnp.moveaxis(scale, axis, -1)
  return scale
