"""fp8 matrix products for :func:`jaxmp.autocast` (``fp8=True``).

Each floating ``dot_general`` (and each convolution, where the backend runs
fp8 convolutions) becomes a ``custom_vjp`` product with per-tensor current
scaling:

* forward: each operand ``x`` gets ``scale = fmax / amax(x)`` (``fmax`` = 448
  for ``float8_e4m3fn``; ``scale = 1`` where ``amax`` is 0), is quantised to
  ``round(clip(x * scale, -fmax, fmax))`` and saved for the backward pass in
  that format (1 byte an element, plus a float32 scalar);
* the product is laid out as XLA's GPU GEMM rewriter matches it,
  ``dot(convert(a_f8) * (1 / scale_a), convert(b_f8) * (1 / scale_b))`` with
  a float32 result, then converted to the output dtype: cuBLASLt runs it as
  an fp8 GEMM on Hopper and later GPUs, and the CPU emulates it;
* backward: the output cotangent is quantised to ``float8_e5m2`` (``fmax`` =
  57344) with its own current scale, the two backward products are the
  transposes of the forward one on the dequantised fp8 operands, and each
  operand gradient comes out in its primal dtype.

A non-finite operand has an infinite or NaN ``amax``: its scale is 0 or NaN
and its inverse infinite or NaN, so the whole product is non-finite (and
``mixed_precision`` skips the step). An all-zero operand has scale 1 and
gives zeros.
"""

import dataclasses
from typing import Any, Optional, Sequence, Union

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import backend
from jaxmp._src import vma as vma_lib
from jaxmp._src.autocast import block_recipe as _block

_F32 = jnp.dtype(jnp.float32)
_FORMATS = frozenset(jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2))


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  """How :func:`jaxmp.autocast` runs matrix products in fp8.

  Per-tensor current scaling (TransformerEngine's ``Float8CurrentScaling``,
  torch's ``Float8Linear`` with dynamic scaling): every operand is scaled by
  ``fmax / amax`` of its own current value, ``amax`` taken over the whole
  tensor (over the local shard under ``shard_map``, unless ``amax_axes``
  names mesh axes to take it over).

  Attributes:
    forward: the format of the forward operands (activations and weights),
      ``float8_e4m3fn`` (max 448) by default.
    backward: the format of the output cotangents, ``float8_e5m2`` (max
      57344) by default.
    margin: ``scale = fmax / amax / 2**margin``: headroom, in powers of two,
      below the format's largest value (TransformerEngine's ``margin``).
    amax_axes: mesh axis names. Inside a ``shard_map`` body, an operand's
      ``amax`` is the maximum over the shards along those of these axes over
      which the operand varies (one ``pmax``), so every shard uses the same
      scale, as one device would. Empty (the default): each shard scales by
      its own ``amax``.
    conv: whether ``conv_general_dilated`` runs in fp8. ``None`` (the
      default): where XLA runs fp8 convolutions, the CPU (emulated) and CUDA
      GPUs of compute capability 9.0 or later (cuDNN's fp8 convolution
      graphs); elsewhere (TPU, ROCm, older GPUs) convolutions run in the
      autocast dtype.
  """

  forward: Any = jnp.float8_e4m3fn
  backward: Any = jnp.float8_e5m2
  margin: int = 0
  amax_axes: Sequence[str] = ()
  conv: Optional[bool] = None

  def __post_init__(self):
    """Checks the fields and normalises the dtypes and axes."""
    for field in ("forward", "backward"):
      d = jnp.dtype(getattr(self, field))
      if d not in _FORMATS:
        raise ValueError(
          f"Fp8Recipe.{field} must be float8_e4m3fn or float8_e5m2, "
          f"got {d.name}"
        )
      object.__setattr__(self, field, d)
    if int(self.margin) != self.margin or self.margin < 0:
      raise ValueError(f"Fp8Recipe.margin must be an int >= 0: {self.margin}")
    axes = self.amax_axes
    if isinstance(axes, str):
      axes = (axes,)
    object.__setattr__(self, "amax_axes", tuple(axes))
    object.__setattr__(self, "margin", int(self.margin))


def recipe_of(fp8: Union[bool, str, Fp8Recipe, "_block.BlockRecipe", None]):
  """``fp8=`` of :func:`jaxmp.autocast` as a recipe (None when off).

  ``True`` or an :class:`Fp8Recipe`: per-tensor current scaling; a preset's
  name (``"mxfp8"``, ``"deepseek"``, ``"nvfp4"``) or a
  :class:`jaxmp.BlockRecipe`: block scaling (``block_recipe.py``).
  """
  if fp8 is None or fp8 is False:
    return None
  if fp8 is True:
    return Fp8Recipe()
  if isinstance(fp8, (Fp8Recipe, _block.BlockRecipe)):
    return fp8
  if isinstance(fp8, str) and fp8 in _block.PRESETS:
    return _block.preset(fp8)
  raise TypeError(
    "fp8 must be a bool, a jaxmp.Fp8Recipe, a jaxmp.BlockRecipe or one of "
    f"{', '.join(map(repr, _block.PRESETS))}, got {fp8!r}"
  )


def fp8_convolutions(recipe: Fp8Recipe) -> bool:
  """Whether convolutions run in fp8 on the default backend."""
  if recipe.conv is not None:
    return bool(recipe.conv)
  if jax.default_backend() == "cpu":
    return True
  return backend.gpu_capability_at_least(9.0)


def quantize(x, fmt, recipe: Fp8Recipe):
  """``(q, inv)``: ``x`` quantised to ``fmt`` and the scale's inverse (f32).

  ``scale = fmax / amax / 2**margin`` (1 where ``amax`` is 0), ``q =
  round(clip(x * scale, -fmax, fmax))``; ``q * inv`` approximates ``x``.
  """
  fmt = jnp.dtype(fmt)
  x32 = jnp.asarray(x).astype(_F32)
  amax = jnp.max(jnp.abs(x32))
  if recipe.amax_axes:
    vma = vma_lib.varying(amax)
    axes = tuple(a for a in recipe.amax_axes if a in vma)
    if axes:
      amax = lax.pmax(amax, axes)
  fmax = float(jnp.finfo(fmt).max) / 2.0**recipe.margin
  scale = jnp.where(amax == 0, jnp.float32(1), jnp.float32(fmax) / amax)
  # A subnormal amax: the largest finite scale, not infinity.
  scale = jnp.where(
    scale == jnp.inf, jnp.float32(np.finfo(np.float32).max), scale
  )
  q = jnp.clip(x32 * scale, -fmax, fmax).astype(fmt)
  return q, jnp.float32(1) / scale


def dequantize(q, inv):
  """``convert(q) * inv``, in float32: the operand of the rewriter's pattern."""
  return q.astype(_F32) * inv


def product(prim, a, b, recipe: Fp8Recipe, out_dtype):
  """``prim(a, b)`` (a two-operand product, float32 result) in fp8.

  Args:
    prim: ``prim(a32, b32) -> f32``, the product bound on float32 operands
      (a ``dot_general`` or a convolution with a float32
      ``preferred_element_type``); its transposes are the backward products.
    a: the left operand (any castable float dtype).
    b: the right operand.
    recipe: the formats and the scaling.
    out_dtype: the dtype of the result.

  Returns:
    The product in ``out_dtype``; its VJP quantises the cotangent to
    ``recipe.backward`` and returns gradients in the dtypes of ``a`` and
    ``b``.
  """
  a, b = jnp.asarray(a), jnp.asarray(b)
  a_dtype, b_dtype = a.dtype, b.dtype
  out_dtype = jnp.dtype(out_dtype)

  def fwd(a, b):
    qa, ia = quantize(a, recipe.forward, recipe)
    qb, ib = quantize(b, recipe.forward, recipe)
    out = prim(dequantize(qa, ia), dequantize(qb, ib)).astype(out_dtype)
    return out, (qa, ia, qb, ib)

  def bwd(res, g):
    qa, ia, qb, ib = res
    qg, ig = quantize(g, recipe.backward, recipe)
    _, vjp = jax.vjp(prim, dequantize(qa, ia), dequantize(qb, ib))
    da, db = vjp(dequantize(qg, ig))
    return da.astype(a_dtype), db.astype(b_dtype)

  @jax.custom_vjp
  def fp8_product(a, b):
    return fwd(a, b)[0]

  fp8_product.defvjp(fwd, bwd)
  return fp8_product(a, b)
