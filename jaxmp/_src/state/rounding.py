"""Rounding fp32 values to half precision: stochastic, and Kahan's split.

Both let half-precision params take updates far below half an ulp without an
fp32 master copy (`mixed_precision`'s ``master_weights="stochastic"`` and
``"kahan"``).

Stochastic rounding rounds ``x`` to one of its two half-precision neighbours
``lo <= x <= hi``, up with probability ``(x - lo) / (hi - lo)``, so that the
result is ``x`` in expectation. The draw has 16 bits of resolution (bfloat16)
or 24 (float16): the bias is at most ``2**-16`` or ``2**-24`` of an ulp.

- bfloat16 is the top half of float32's bits: adding 16 uniform random bits
  to the low half and truncating it rounds up exactly when the carry reaches
  the top half, with the right probability, for every finite input (normal
  or subnormal, either sign; the magnitude rounds, so negative numbers round
  towards -inf or 0 in proportion).
- float16 has no such relation to float32: the neighbours come from the
  round-to-nearest result and `jnp.nextafter`, and a 24-bit uniform draw
  picks between them (the gap is a power of two, so every step is exact).

Non-finite inputs come back as round-to-nearest would give them.
"""

from typing import Any

import jax
import jax.numpy as jnp

from jaxmp._src import dtypes


def stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
  """Rounds ``x`` to ``dtype`` stochastically: unbiased in expectation.

  Args:
    x: the values, any float dtype (computed in float32).
    dtype: ``jnp.bfloat16`` or ``jnp.float16``.
    key: a PRNG key (typed or a raw ``uint32[2]``); one draw per element.

  Returns:
    ``x`` rounded to ``dtype``: to the neighbour below or above it, the one
    above with probability proportional to the distance from the one below.

  Raises:
    ValueError: for a ``dtype`` other than bfloat16 and float16.

  >>> import jax, jax.numpy as jnp, jaxmp
  >>> x = jnp.full(10_000, 1.0 + 2.0**-10)  # 1/8 of a bfloat16 ulp above 1
  >>> y = jaxmp.stochastic_round(x, jnp.bfloat16, jax.random.key(0))
  >>> sorted(set(y.tolist()))
  [1.0, 1.0078125]
  >>> round(float(y.astype(jnp.float32).mean() - 1), 4)  # 2**-10 ~ 0.0010
  0.001
  """
  dtype = jnp.dtype(dtype)
  if not dtypes.is_half(dtype):
    raise ValueError(
      f"stochastic_round rounds to bfloat16 or float16, not {dtype}"
    )
  x = jnp.asarray(x)
  bits = jax.random.bits(key, x.shape, jnp.uint32)
  return round_with_bits(x.astype(jnp.float32), dtype, bits)


def round_with_bits(x: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
  """`stochastic_round` of float32 ``x`` with given uniform uint32 ``bits``."""
  if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
    raw = jax.lax.bitcast_convert_type(x, jnp.uint32)
    # Non-finite inputs keep their bits: a carry must not touch the sign.
    raw = jnp.where(jnp.isfinite(x), raw + (bits >> 16), raw)
    raw = raw & jnp.uint32(0xFFFF0000)
    out = jax.lax.bitcast_convert_type(raw, jnp.float32).astype(dtype)
    return jnp.where(jnp.isfinite(x), out, x.astype(dtype))
  nearest = x.astype(dtype)
  near32 = nearest.astype(jnp.float32)
  below = near32 <= x
  other = jnp.nextafter(
    nearest, jnp.where(below, jnp.inf, -jnp.inf).astype(dtype)
  )
  lo = jnp.where(below, nearest, other)
  hi = jnp.where(below, other, nearest)
  lo32 = lo.astype(jnp.float32)
  gap = hi.astype(jnp.float32) - lo32
  # u in [0, 1) on a 2**-24 grid; gap is a power of two: u * gap is exact.
  u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
  out = jnp.where(u * gap < x - lo32, hi, lo)
  exact = near32 == x
  return jnp.where(exact | ~jnp.isfinite(gap), nearest, out)


def kahan_split(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
  """Splits float32 ``x`` into ``(hi, lo)`` in ``dtype``: ``hi + lo ~ x``.

  ``hi`` is ``x`` rounded to nearest and ``lo`` the rounding error
  ``x - hi`` (exact in float32, as ``hi`` is the nearest neighbour of ``x``),
  rounded to nearest in ``dtype`` too. So ``|lo| <= ulp(hi) / 2`` and
  ``|hi + lo - x| <= 2**-p * |x - hi| <= 2**-p * ulp(hi) / 2`` for a
  ``p``-bit significand (``p`` = 8 for bfloat16, 11 for float16), while
  ``lo`` is a normal number. ``hi + lo`` is exact in float32.
  """
  hi = x.astype(dtype)
  lo = (x - hi.astype(jnp.float32)).astype(dtype)
  return hi, lo
