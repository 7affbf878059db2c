"""Block-scaled fp8 and fp4 matrix products for :func:`jaxmp.autocast`.

``autocast(fn, fp8="mxfp8" | "deepseek" | "nvfp4" | BlockRecipe(...))``
turns every floating ``dot_general`` of ``fn`` into a ``custom_vjp`` product
whose operands are quantized in blocks (`jaxmp.quantize`'s formats) along
the product's contraction axis, as TransformerEngine's block-scaling recipes
do:

* forward: ``out = dot(Q(a), Q(b))``, each operand quantized from the value
  the product receives (an fp32 param is not rounded to bf16 first) in its
  role's format (``weight`` for the weight operand, ``activation`` for the
  other), dequantized and multiplied in float32, the result in the autocast
  dtype (or the ``preferred_element_type`` the program asked for);
* backward: the high-precision operands are saved, and each backward product
  quantizes its two operands along its own contraction axis: the input
  gradient ``dy . w`` contracts over the output features, the weight
  gradient ``dy . x`` over the batch, so the saved ``x`` and ``w`` are
  re-quantized along those axes (not the forward codes transposed), and the
  output cotangent ``dy`` is quantized in the ``gradient`` format along each
  (with stochastic rounding, if asked, from a seed derived from ``dy``'s
  bits: deterministic for given inputs); each gradient comes out in its
  operand's dtype.

The weight of a product is the operand autocast treats as one elsewhere: an
fp32 operand (a param cast), or a value reached from ``fn``'s inputs through
structural ops (reshape, transpose, casts); where both operands qualify, the
right-hand one (``x @ w``); where neither does (``q @ k.T``), both are
activations. 2D formats (``fp8_128x128``, ``nvfp4_16x16``) block the
quantization axis and the last other axis: for a matrix, the same blocks in
the forward and the backward pass.

The products are emulated: quantize, dequantize, a float32 ``dot_general``
at HIGHEST precision. On GPUs with block-scaled GEMMs (``BlockRecipe.native``)
the MXFP8 forward products go through ``jax.nn.scaled_dot_general`` instead,
with the same results.
"""

import dataclasses
import functools
import re
from typing import Optional, Sequence, Tuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import backend
from jaxmp._src.autocast import block as _block

_F32 = jnp.dtype(jnp.float32)
# Each format's block shape: (rows, elements along the quantization axis).
FORMATS = {
  "mxfp8": (1, 32),
  "mxfp8_e5m2": (1, 32),
  "fp8_1x128": (1, 128),
  "fp8_128x128": (128, 128),
  "nvfp4": (1, 16),
  "nvfp4_16x16": (16, 16),
}
ROLES = ("activation", "weight", "gradient")
PRESETS = ("mxfp8", "deepseek", "nvfp4")


@dataclasses.dataclass(frozen=True)
class BlockRecipe:
  """How :func:`jaxmp.autocast` runs matrix products block-scaled.

  Use a preset: ``BlockRecipe.mxfp8()`` (OCP MXFP8: 1x32 blocks with
  power-of-two scales everywhere), ``BlockRecipe.deepseek()`` (DeepSeek-V3's
  fp8: 1x128 tiles for activations and gradients, 128x128 blocks for
  weights, fp32 scales) or ``BlockRecipe.nvfp4()`` (NVIDIA's 4-bit
  recipe: 1x16 e2m1 blocks with e4m3 scales under a per-tensor scale, 16x16
  weight blocks, stochastic rounding of gradients, a 16x16 random Hadamard
  transform on the weight-gradient product), with fields changed by
  keyword. ``autocast(fp8="mxfp8")`` is ``fp8=BlockRecipe.mxfp8()``.

  Attributes:
    activation: the format of activations (every operand that is no
      weight), a `jaxmp.quantize` format.
    weight: the format of the weight operand.
    gradient: the format of the output cotangent in both backward products.
    stochastic_rounding: round the gradient's elements stochastically
      (unbiased), from a seed derived from the cotangent's own bits, so the
      same inputs give the same gradients.
    hadamard: ``n`` > 0 (a power of two): both operands of each weight's
      gradient product are multiplied, along its contraction axis in blocks
      of ``n``, by one fixed ``n x n`` random-sign Hadamard matrix
      (orthonormal, so the product is unchanged before quantization);
      skipped where ``n`` does not divide that axis. 0: none.
    keep: regular expressions searched in each product's name stack
      (``jax.named_scope`` and module paths, e.g. ``"head"``): a product
      that matches runs in autocast's dtype (bf16), not block-scaled.
    seed: the seed of the Hadamard signs and of the stochastic rounding.
    native: route MXFP8 forward products through
      ``jax.nn.scaled_dot_general`` (same results: the dequantized operands
      are MXFP8 values, which it quantizes again to themselves). ``None``
      (default): on GPUs with block-scaled GEMMs (compute capability 10.0
      or later, jax >= 0.11); ``True``: also on CPUs (jax >= 0.11, where it
      lowers); ``False``: always emulate.
    name: the recipe's name (a preset's name, or ``"custom"``).
  """

  activation: str = "mxfp8"
  weight: str = "mxfp8"
  gradient: str = "mxfp8"
  stochastic_rounding: bool = False
  hadamard: int = 0
  keep: Sequence[str] = ()
  seed: int = 0
  native: Optional[bool] = None
  name: str = "custom"

  def __post_init__(self):
    """Checks the formats and normalises ``keep`` to a tuple."""
    for role in ROLES:
      fmt = getattr(self, role)
      if fmt not in FORMATS:
        raise ValueError(
          f"BlockRecipe.{role} must be one of {sorted(FORMATS)}, got {fmt!r}"
        )
    if FORMATS[self.gradient][0] != 1:
      raise ValueError(
        f"BlockRecipe.gradient must be a 1D format, got {self.gradient!r}"
      )
    h = int(self.hadamard)
    if h != self.hadamard or h < 0 or (h and h & (h - 1)):
      raise ValueError(
        f"BlockRecipe.hadamard must be 0 or a power of two: {self.hadamard}"
      )
    keep = (self.keep,) if isinstance(self.keep, str) else tuple(self.keep)
    for pattern in keep:
      re.compile(pattern)
    object.__setattr__(self, "keep", keep)
    object.__setattr__(self, "hadamard", h)

  @classmethod
  def mxfp8(cls, gradient: str = "mxfp8", **kwargs) -> "BlockRecipe":
    """MXFP8: 1x32 e4m3 blocks, e8m0 scales; ``gradient="mxfp8_e5m2"`` too."""
    kwargs.setdefault("name", "mxfp8")
    return cls("mxfp8", "mxfp8", gradient, **kwargs)

  @classmethod
  def deepseek(cls, **kwargs) -> "BlockRecipe":
    """DeepSeek-V3: 1x128 tiles, 128x128 weight blocks, fp32 scales."""
    kwargs.setdefault("name", "deepseek")
    return cls("fp8_1x128", "fp8_128x128", "fp8_1x128", **kwargs)

  @classmethod
  def nvfp4(cls, **kwargs) -> "BlockRecipe":
    """NVFP4: 1x16 e2m1 blocks, 16x16 weights, SR gradients, Hadamard 16."""
    kwargs.setdefault("name", "nvfp4")
    kwargs.setdefault("stochastic_rounding", True)
    kwargs.setdefault("hadamard", 16)
    return cls("nvfp4", "nvfp4_16x16", "nvfp4", **kwargs)

  @property
  def block_shapes(self) -> dict:
    """Per role, the block shape ``(rows, elements along the axis)``."""
    return {role: FORMATS[getattr(self, role)] for role in ROLES}

  def keeps(self, name_stack: str) -> bool:
    """Whether the product at ``name_stack`` stays in autocast's dtype."""
    return any(re.search(p, name_stack) for p in self.keep)


def preset(name: str) -> BlockRecipe:
  """The preset recipe called ``name`` (``"mxfp8"``, ...)."""
  return getattr(BlockRecipe, name)()


# --------------------------------------------------------------------------
# Quantization along an axis, the Hadamard transform, the rounding seed.


def fake_quantize(x, fmt: str, axis: Optional[int], key=None):
  """``x`` quantized in ``fmt`` along ``axis`` and dequantized (float32).

  2D formats block ``axis`` and the last other axis. ``axis=None`` (a
  product that contracts nothing): ``x`` in float32, unquantized.
  """
  x = jnp.asarray(x).astype(_F32)
  if axis is None:
    return x
  axis = axis % x.ndim
  if FORMATS[fmt][0] == 1:
    out = _block.fake_quantize(x, fmt, axis=axis, key=key)
  elif x.ndim == 1:
    out = _block.fake_quantize(x[None], fmt, key=key)[0]
  else:
    moved = jnp.moveaxis(x, axis, -1)
    out = jnp.moveaxis(_block.fake_quantize(moved, fmt, key=key), -1, axis)
  # A non-finite input makes the whole product non-finite, as the per-tensor
  # recipe does (so mixed_precision skips the step), whatever the codes.
  return out + jnp.sum(x * 0)


@functools.lru_cache(maxsize=None)
def hadamard_matrix(n: int, seed: int) -> np.ndarray:
  """``diag(signs) @ H_n / sqrt(n)``: orthonormal, fixed random signs."""
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  signs = np.random.default_rng([seed, n]).choice([-1.0, 1.0], n)
  return (signs[:, None] * h / np.sqrt(n)).astype(np.float32)


def _rotate(x, axis: int, m: np.ndarray):
  """``x`` times ``m`` along ``axis``, in blocks of ``m``'s size."""
  n = m.shape[0]
  moved = jnp.moveaxis(x, axis, -1)
  shape = moved.shape
  y = moved.reshape(shape[:-1] + (shape[-1] // n, n)) @ jnp.asarray(m)
  return jnp.moveaxis(y.reshape(shape), -1, axis)


def rotated_quantize(x, fmt, axis, m, key=None):
  """``Q(x m) m^T`` along ``axis``: a Hadamard-rotated operand, dequantized.

  For two operands rotated along their common contraction axis, the
  product of the results is the product of the rotated, quantized ones.
  """
  q = fake_quantize(_rotate(x.astype(_F32), axis, m), fmt, axis, key)
  return _rotate(q, axis, m.T)


def data_key(x, seed: int):
  """A PRNG key from ``x``'s bits and positions.

  Each element's bits, offset by its position, go through a 32-bit mixing
  function (murmur3's finalizer) and the results are summed with uint32
  wrap-around: exact in any order, so a sharded ``x`` gives the key of the
  whole array, and any change of ``x`` changes the key.
  """
  bits = lax.bitcast_convert_type(jnp.asarray(x).astype(_F32), jnp.uint32)
  pos = jnp.zeros(bits.shape, jnp.uint32)
  stride = 1
  for d in range(bits.ndim - 1, -1, -1):
    iota = lax.broadcasted_iota(jnp.uint32, bits.shape, d)
    pos = pos + iota * np.uint32(stride % 2**32)
    stride *= bits.shape[d]
  v = bits + pos * np.uint32(0x9E3779B9)
  v = (v ^ (v >> 16)) * np.uint32(0x85EBCA6B)
  v = (v ^ (v >> 13)) * np.uint32(0xC2B2AE35)
  v = v ^ (v >> 16)
  h = jnp.sum(v, dtype=jnp.uint32)
  return jax.random.fold_in(jax.random.key(seed), h)


# --------------------------------------------------------------------------
# The product.


def _axes(dimension_numbers, a_ndim: int, b_ndim: int):
  """The quantization axes of the forward and the two backward products.

  Returns ``((a, b), (b, g), (a, g))``: the forward product's (one of the
  contraction dims of each operand, paired), the input-gradient product of
  ``a`` (over ``b``'s free dims: in ``b`` and in the cotangent ``g``) and
  that of ``b`` (over ``a``'s free dims). ``None`` where a product
  contracts nothing.
  """
  (lc, rc), (lb, rb) = dimension_numbers
  a_free = [d for d in range(a_ndim) if d not in lc and d not in lb]
  b_free = [d for d in range(b_ndim) if d not in rc and d not in rb]
  nb = len(lb)
  fwd = (lc[-1], rc[-1]) if len(lc) else (None, None)
  for_a = (
    (b_free[-1], nb + len(a_free) + len(b_free) - 1) if b_free else (None,) * 2
  )
  for_b = (a_free[-1], nb + len(a_free) - 1) if a_free else (None, None)
  return fwd, for_a, for_b


def _transpose(f, x, ct):
  """The transpose of the linear ``f`` at ``x``'s type, applied to ``ct``."""
  return jax.linear_transpose(f, x)(ct)[0]


def product(
  prim, dimension_numbers, a, b, recipe: BlockRecipe, out_dtype, weight
):
  """``prim(a, b)`` (a ``dot_general``, float32 result) block-scaled.

  Args:
    prim: ``prim(a32, b32) -> f32``, the product on float32 operands.
    dimension_numbers: its ``((lhs_contract, rhs_contract), (lhs_batch,
      rhs_batch))``.
    a: the left operand (any float dtype).
    b: the right operand.
    recipe: the formats.
    out_dtype: the dtype of the result.
    weight: 0 or 1, the operand in the weight role, or None.

  Returns:
    The product in ``out_dtype``; gradients come out in the operands' dtypes.
  """
  a, b = jnp.asarray(a), jnp.asarray(b)
  a_dtype, b_dtype = a.dtype, b.dtype
  out_dtype = jnp.dtype(out_dtype)
  (fa, fb), (ab, ag), (ba, bg) = _axes(dimension_numbers, a.ndim, b.ndim)
  fmt_a = recipe.weight if weight == 0 else recipe.activation
  fmt_b = recipe.weight if weight == 1 else recipe.activation
  fmt_g = recipe.gradient
  m = hadamard_matrix(recipe.hadamard, recipe.seed) if recipe.hadamard else None

  def fwd(a, b):
    qa, qb = fake_quantize(a, fmt_a, fa), fake_quantize(b, fmt_b, fb)
    out = _forward_dot(prim, dimension_numbers, qa, qb, fmt_a, fmt_b, recipe)
    return out.astype(out_dtype), (a, b)

  def operands(x, fmt_x, x_axis, g, g_axis, key, rotate):
    """The quantized operand and cotangent of one backward product."""
    if rotate and x_axis is not None and x.shape[x_axis] % m.shape[0] == 0:
      return (
        rotated_quantize(x, fmt_x, x_axis, m),
        rotated_quantize(g, fmt_g, g_axis, m, key),
      )
    return fake_quantize(x, fmt_x, x_axis), fake_quantize(g, fmt_g, g_axis, key)

  def bwd(res, g):
    a, b = res
    ka = kb = None
    if recipe.stochastic_rounding:
      ka, kb = jax.random.split(data_key(g, recipe.seed))
    # The gradient of a: dy . b over b's free dims (the output features when
    # a is the activation), both re-quantized along them.
    qb, qg = operands(b, fmt_b, ab, g, ag, ka, m is not None and weight == 0)
    a32 = a.astype(_F32)
    da = _transpose(lambda x: prim(x, qb), a32, qg)
    # The gradient of b: dy . a over a's free dims (the batch when b is the
    # weight).
    qa, qg = operands(a, fmt_a, ba, g, bg, kb, m is not None and weight == 1)
    b32 = b.astype(_F32)
    db = _transpose(lambda y: prim(qa, y), b32, qg)
    return da.astype(a_dtype), db.astype(b_dtype)

  @jax.custom_vjp
  def block_product(a, b):
    return fwd(a, b)[0]

  block_product.defvjp(fwd, bwd)
  return block_product(a, b)


# --------------------------------------------------------------------------
# jax.nn.scaled_dot_general, where it lowers.


def _jax_version() -> Tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:2])


def native_available(cpu: bool = False) -> bool:
  """Whether ``jax.nn.scaled_dot_general`` runs natively here.

  On NVIDIA GPUs of compute capability 10.0 or later (cuDNN's block-scaled
  GEMMs), from jax 0.11 on; with ``cpu``, also on CPUs from jax 0.11 on
  (where it lowers to an emulation of its own).
  """
  if not hasattr(jax.nn, "scaled_dot_general") or _jax_version() < (0, 11):
    return False
  if jax.default_backend() == "cpu":
    return cpu
  return backend.gpu_capability_at_least(10.0)


def _forward_dot(prim, dimension_numbers, qa, qb, fmt_a, fmt_b, recipe):
  """The forward product of the dequantized operands (float32).

  MXFP8 products go through ``jax.nn.scaled_dot_general`` where it lowers:
  the dequantized operands are exactly MXFP8 values, which it quantizes
  again to the same values, so the result is the emulation's.
  """
  if recipe.native is False:
    return prim(qa, qb)
  use = native_available(cpu=bool(recipe.native))
  mx = fmt_a == fmt_b == "mxfp8"
  (lc, _), _ = dimension_numbers
  # Its quantizer takes whole blocks along one contraction dim only.
  whole = len(lc) == 1 and qa.shape[lc[0]] % 32 == 0
  if use and mx and whole:  # pragma: no cover - jax >= 0.11.
    config = jax.nn.get_scaled_dot_general_config("mxfp8")
    return jax.nn.scaled_dot_general(
      qa,
      qb,
      dimension_numbers,
      preferred_element_type=_F32,
      configs=[config, config, config],
    )
  return prim(qa, qb)
