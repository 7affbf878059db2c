"""jaxmp.quantize: every block format against a numpy + ml_dtypes reference.

The reference below is written apart from the library: float64 numpy, a
Python loop over the blocks, each formula step rounded to float32 where the
format computes in float32 (one float64 operation rounded once equals the
float32 operation), ml_dtypes casts after explicit clipping, and MXFP8's
exponent found by exact comparisons ``amax <= fmax * 2**k``.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxmp
from jaxmp._src.autocast import block

E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
E2M1 = ml_dtypes.float4_e2m1fn
F32_MAX = float(np.finfo(np.float32).max)

# block, element dtype, element max, rule
FMTS = {
  "mxfp8": ((32,), E4M3, 448.0, "mx"),
  "mxfp8_e5m2": ((32,), E5M2, 57344.0, "mx"),
  "fp8_1x128": ((128,), E4M3, 448.0, "fp32"),
  "fp8_128x128": ((128, 128), E4M3, 448.0, "fp32"),
  "nvfp4": ((16,), E2M1, 6.0, "nvfp4"),
  "nvfp4_16x16": ((16, 16), E2M1, 6.0, "nvfp4"),
}


def f32(v):
  """``v`` rounded to float32, kept as float64."""
  return np.asarray(v, np.float64).astype(np.float32).astype(np.float64)


def mx_exponent(amax, fmax):
  """The least k with amax <= fmax * 2**k, at least -127 (exact)."""
  if amax == 0:
    return -127
  k = int(np.floor(np.log2(amax / fmax)))
  while fmax * 2.0**k < amax:
    k += 1
  while fmax * 2.0 ** (k - 1) >= amax:
    k -= 1
  return max(k, -127)


def reference(x, fmt, amax_t=None):
  """(codes, scales, T, dequantized, codes times scales in float64).

  Blocks along the last axis (1D formats) or the last two axes (2D);
  NVFP4's T from ``amax_t`` if given, else from ``max |x|``.
  """
  blk, elem, fmax, rule = FMTS[fmt]
  x = np.asarray(x, np.float32).astype(np.float64)
  if rule != "mx":  # float32 subnormals count as zeros
    x = np.where(np.abs(x) < 2.0**-126, 0.0 * x, x)
  nd = len(blk)
  lead = x.shape[:-nd]
  grid = tuple(-(-n // b) for n, b in zip(x.shape[-nd:], blk))
  codes = np.zeros(x.shape, elem)
  deq = np.zeros(x.shape)
  exact = np.zeros(x.shape)
  scales = np.zeros(lead + grid)
  t = None
  if rule == "nvfp4":
    amax_t = np.abs(x).max() if amax_t is None else amax_t
    t = f32(min(f32(2688.0 / amax_t), F32_MAX)) if amax_t > 0 else 1.0
  for li in np.ndindex(*lead):
    for bi in np.ndindex(*grid):
      sl = li + tuple(slice(i * b, (i + 1) * b) for i, b in zip(bi, blk))
      v = x[sl]
      amax = np.abs(v).max()
      if rule == "mx":
        k = mx_exponent(amax, fmax)
        c = np.clip(v / 2.0**k, -fmax, fmax).astype(elem)
        s = 2.0**k
        d = c.astype(np.float64) * s
        e = d
        scales[li + bi] = k
      elif rule == "fp32":
        s = max(f32(amax / 448.0), 2.0**-126) if amax > 0 else 1.0
        c = np.clip(f32(v / s), -448.0, 448.0).astype(elem)
        e = c.astype(np.float64) * s
        d = f32(e)
        scales[li + bi] = s
      else:
        raw = min(f32(f32(amax / 6.0) * t), 448.0)
        s = float(np.float64(raw).astype(E4M3))
        if s == 0:
          c = np.zeros(v.shape, elem)
        else:
          c = np.clip(f32(f32(v * t) / s), -6.0, 6.0).astype(elem)
        e = c.astype(np.float64) * s / t
        d = f32(f32(c.astype(np.float64) * s) / t)
        scales[li + bi] = s
      codes[sl], deq[sl], exact[sl] = c, d, e
  return codes, scales, t, deq, exact


SCENARIOS = (  # (amax planted at the head of every 16 elements, fill)
  (448.0, "rand"),
  (449.0, "rand"),
  (500.0, "rand"),
  (512.0, "rand"),
  (464.0, "rand"),
  (57344.0, "rand"),
  (60000.0, "rand"),
  (1.0, "rand"),
  (0.0, "zero"),
  (1e30, "one_huge"),  # one huge element, the rest standard normal
  (1e-39, "tiny"),  # float32 subnormals
  (2.0**-125, "tiny"),  # mxfp8 scales at 2**-127
  (1e-36, "tiny"),
  (500.0, "midpoints"),  # x / (500 / 448) near e4m3 rounding midpoints
  (3.0, "lognormal"),
  (1.0, "lognormal"),
  (2.0**-118, "rand"),  # mxfp8 scales at 2**-126
)


def scenario_rows(cols, seed=0):
  """(len(SCENARIOS), cols) float32, one edge case a row."""
  rng = np.random.default_rng(seed)
  rows = []
  grid = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)
  grid = np.unique(grid[np.isfinite(grid) & (grid >= 0)])
  mid = (grid[1:] + grid[:-1]) / 2  # e4m3's rounding midpoints
  mid = mid[(mid > 1) & (mid < 400)]
  for amax, fill in SCENARIOS:
    sign = rng.choice([-1.0, 1.0], cols)
    if fill == "zero":
      r = 0.0 * sign  # signed zeros
    elif fill == "rand":
      r = rng.uniform(-1, 1, cols) * amax
    elif fill == "one_huge":
      r = rng.standard_normal(cols)
      r[5] = amax
    elif fill == "tiny":
      r = rng.uniform(-1, 1, cols) * amax
    elif fill == "midpoints":
      s = np.float32(np.float32(amax) / np.float32(448.0))
      r = (rng.choice(mid, cols) * s).astype(np.float32) * sign
    else:
      r = rng.standard_normal(cols) * np.exp(rng.uniform(-6, 6, cols)) * amax
    if fill != "one_huge":
      r[::16] = amax * sign[::16]
    r[9::37] = -0.0
    rows.append(r)
  return np.asarray(rows, np.float32)


@functools.lru_cache(maxsize=None)
def program(fmt, axis):
  """One compiled quantize + dequantize a format and axis."""

  def run(x):
    q = jaxmp.quantize(x, fmt, axis=axis)
    return q, q.dequantize()

  return jax.jit(run)


def check(fmt, x, q, deq, move):
  """``q`` and ``deq`` against the reference of ``move(x)`` (blocks last)."""
  codes, scales, t, ref_deq, exact = reference(move(x), fmt)
  assert isinstance(q, block.Quantized) and q.fmt == fmt
  assert len(jax.tree_util.tree_leaves(q)) == (3 if t is not None else 2)
  data = move(np.asarray(q.data))
  assert q.data.dtype == FMTS[fmt][1] and q.data.shape == x.shape
  np.testing.assert_array_equal(data.view(np.uint8), codes.view(np.uint8))
  scale = move(np.asarray(q.scale))
  if FMTS[fmt][3] == "mx":
    assert q.scale.dtype == ml_dtypes.float8_e8m0fnu
    got = scale.view(np.uint8).astype(np.int64) - 127
    np.testing.assert_array_equal(got, scales)
  else:
    np.testing.assert_array_equal(scale.astype(np.float64), scales)
  if t is None:
    assert q.global_scale is None
  else:
    assert q.global_scale.shape == () and q.global_scale.dtype == jnp.float32
    assert float(q.global_scale) == t
  d = move(np.asarray(deq))
  assert deq.dtype == jnp.float32 and np.all(np.isfinite(d))
  np.testing.assert_array_equal(d, ref_deq)
  np.testing.assert_allclose(d, exact, rtol=1e-6, atol=0)
  return scales


@pytest.mark.parametrize("fmt", block.FORMATS)
def test_matches_reference(fmt):
  """Codes, scales, T and dequantize bit for bit, on edge blocks and axes."""
  blk = FMTS[fmt][0]
  if len(blk) == 1:
    x = scenario_rows(300)  # 300: not a multiple of 16, 32 or 128
    q, deq = program(fmt, -1)(x)
    scales = check(fmt, x, q, deq, lambda a: a)
    if FMTS[fmt][3] == "mx":  # 448, 449, 500, 512 and zero
      want = [0, 1, 1, 1, -127] if fmt == "mxfp8" else [-7, -6, -6, -6, -127]
      np.testing.assert_array_equal(scales[[0, 1, 2, 3, 8], 0], want)
    xt = np.ascontiguousarray(x.T)  # blocks along axis 0
    q, deq = program(fmt, 0)(xt)
    check(fmt, xt, q, deq, lambda a: a.T)
  else:
    rows, cols = blk
    base = scenario_rows(2 * cols + 5)
    # Each block row repeats one scenario, so blocks keep its edge case.
    pick = [[0, 1], [8, 9], [10, 13], [2, 14]] if rows == 16 else [[2, 8]]
    x = np.stack(
      [np.repeat(base[p], rows, axis=0)[: 2 * rows - 3] for p in pick]
    )
    q, deq = program(fmt, -1)(x)
    check(fmt, x, q, deq, lambda a: a)
  if FMTS[fmt][3] == "nvfp4":  # T from the huge row, then without it
    x = np.where(np.abs(x) >= 1e30, np.float32(2.0), x)
    q, deq = program(fmt, -1)(x)
    check(fmt, x, q, deq, lambda a: a)


@functools.lru_cache(maxsize=None)
def stochastic_program():
  """NVFP4 with stochastic rounding, both block shapes, a batch of keys."""

  def one(x, key):
    q1 = jaxmp.quantize(x, "nvfp4", key=key)
    q2 = jaxmp.quantize(x, "nvfp4_16x16", key=key)
    return q1.data, q1.dequantize(), q2.data, q2.dequantize()

  return jax.jit(jax.vmap(one, in_axes=(None, 0)))


def e2m1_step(y):
  """The e2m1 grid's step at ``|y|`` (0.5 below 2, 1 below 4, then 2)."""
  a = np.abs(y)
  return np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))


def test_stochastic_rounding_unbiased_neighbours_and_per_key():
  """Codes are grid neighbours of x * T / b, unbiased, fixed by the key."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((4, 40)) * np.exp(rng.uniform(-2, 2, (4, 40)))
  x = x.astype(np.float32)
  n = 2048
  keys = jax.random.split(jax.random.key(0), n)
  out = [np.asarray(o) for o in stochastic_program()(x, keys)]
  for fmt, data, deq in (("nvfp4", *out[:2]), ("nvfp4_16x16", *out[2:])):
    _, scales, t, _, _ = reference(x, fmt)
    blk = FMTS[fmt][0]
    b = scales
    for axis, size in zip(range(-len(blk), 0), blk):
      b = np.repeat(b, size, axis=axis)
    b = b[: x.shape[0], : x.shape[1]]
    # The value before rounding, as the reference computes it.
    y = np.where(
      b > 0, np.clip(f32(f32(x * t) / np.where(b > 0, b, 1)), -6, 6), 0
    )
    codes = data.astype(np.float64)
    step = e2m1_step(y)
    assert np.all(np.abs(codes - y) < step), "not a grid neighbour"
    a = np.abs(y)
    frac = (a - np.floor(a / step) * step) / step
    mixed = (frac > 0.1) & (frac < 0.9)
    up = np.abs(codes) > a  # rounded up, per key
    both = up.any(0) & (~up).any(0)  # each neighbour drawn by some key
    assert mixed.sum() > 50 and np.all(both[mixed])
    # Each code is lo or lo + step, up with probability (y - lo) / step:
    # its mean over n keys is y within 6 standard deviations.
    tol = 6 * step / (2 * np.sqrt(n)) + step * 2.0**-22
    np.testing.assert_array_less(np.abs(codes.mean(0) - y), tol)
    # All draws together: the magnitude's error in steps has mean 0 and a
    # standard deviation of at most 1/2 a draw (a bias of 1% of a step
    # shows).
    z = ((np.abs(codes) - a) / step)[:, mixed]
    assert abs(z.mean()) < 6 * 0.5 / np.sqrt(z.size)
    np.testing.assert_allclose(
      deq.mean(0), y * b / t, rtol=0, atol=float(np.max(tol * b / t))
    )
  # The same key gives the same codes; two keys give different ones.
  again = [np.asarray(o) for o in stochastic_program()(x, jnp.roll(keys, 1))]
  np.testing.assert_array_equal(
    again[0][1:].view(np.uint8), out[0][:-1].view(np.uint8)
  )
  assert np.any(out[0][0].view(np.uint8) != out[0][1].view(np.uint8))
  assert np.any(out[2][0].view(np.uint8) != out[2][1].view(np.uint8))


def test_non_finite_blocks_and_tensor_amax():
  """A block with an inf or a NaN dequantizes to NaN; ``amax=`` sets T."""
  x = scenario_rows(64)[[7, 14]]  # (2, 64): two blocks of 32 a row
  x[0, 3], x[1, 40] = np.inf, np.nan
  amax = np.float32(5000.0)

  @jax.jit
  def run(x):
    out = [jaxmp.quantize(x, f).dequantize() for f in block.FORMATS]
    finite = jnp.nan_to_num(x, posinf=0.0)
    q = jaxmp.quantize(finite, "nvfp4", amax=amax)
    low = jaxmp.quantize(finite, "nvfp4_16x16", amax=amax / 16)
    return out, q, low

  out, q, low = run(x)
  for fmt, d in zip(block.FORMATS, out):
    d = np.asarray(d)
    assert np.isnan(d[0, :16]).any() and np.isnan(d[1, 32:48]).any(), fmt
    if FMTS[fmt][3] != "nvfp4" and len(FMTS[fmt][0]) == 1:
      # The other blocks stay finite; a block with a NaN or an inf is NaN
      # whole (its scale is).
      size = FMTS[fmt][0][0]
      assert np.isfinite(d[0, size:]).all(), fmt
      assert np.isnan(d[1, (40 // size) * size :][:size]).all(), fmt
      if size <= 32:
        assert np.isfinite(d[1, :32]).all(), fmt
  finite = np.nan_to_num(x, posinf=0.0)
  assert np.abs(finite).max() < amax
  codes, scales, t, ref_deq, _ = reference(finite, "nvfp4", amax_t=amax)
  assert float(q.global_scale) == t == f32(2688.0 / 5000.0)
  np.testing.assert_array_equal(
    np.asarray(q.data).view(np.uint8), codes.view(np.uint8)
  )
  np.testing.assert_array_equal(np.asarray(q.scale).astype(np.float64), scales)
  np.testing.assert_array_equal(np.asarray(q.dequantize()), ref_deq)
  # An amax below max |x|: the scales and the codes saturate.
  codes, scales, t, ref_deq, _ = reference(finite, "nvfp4_16x16", amax / 16)
  assert scales.max() == 448.0 and np.abs(codes.astype(float)).max() == 6.0
  np.testing.assert_array_equal(
    np.asarray(low.data).view(np.uint8), codes.view(np.uint8)
  )
  np.testing.assert_array_equal(np.asarray(low.dequantize()), ref_deq)


@pytest.mark.parametrize(
  "args, kwargs, message",
  [
    (("mxfp4",), {}, "unknown block format"),
    (("fp8_128x128",), {"shape": (8,)}, "rank >= 2"),
    (("mxfp8",), {"axis": 2}, "out of range"),
    (("fp8_1x128",), {"key": True}, "NVFP4 only"),
    (("mxfp8",), {"amax": 1.0}, "NVFP4 only"),
    (("nvfp4",), {"amax": np.ones(2)}, "scalar"),
  ],
)
def test_errors(args, kwargs, message):
  shape = kwargs.pop("shape", (4, 8))
  if kwargs.get("key"):
    kwargs["key"] = jax.random.key(0)
  with pytest.raises(ValueError, match=message):
    jaxmp.quantize(np.ones(shape, np.float32), *args, **kwargs)
