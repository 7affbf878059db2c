"""jaxmp.autocast: the rules, everywhere JAX code goes, and its debug report.

Dtype checks read jaxprs (no compilation). Values are compared with fp32
within bounds derived from what the policy promises: the unit roundoff of
the half dtype (2**-11 for fp16, 2**-8 for bf16) for the half products and
half pointwise ops, fp32's (2**-24) for the fp32-listed sums and
transcendentals, each times the magnitude and count of what it rounds. On
inputs whose fp16 products are exact (XE/WE, XP/WP) only fp32 rounding is
left, so the same ops computed in fp16 fail the value checks too.
"""

import functools
import logging
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp._src.autocast import _jaxpr_custom as jc
from jaxmp._src.autocast import _jaxpr_interp as ji
from jaxmp._src.autocast import rules as ac

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
U = {jnp.dtype(F16): 2.0**-11, jnp.dtype(BF16): 2.0**-8}
U32 = 2.0**-24  # fp32's unit roundoff: the fp32-listed ops


def _subjaxprs(params):
  for v in params.values():
    for u in v if isinstance(v, (tuple, list)) else (v,):
      if isinstance(u, ji.ClosedJaxpr):
        yield u.jaxpr
      elif hasattr(u, "eqns"):
        yield u


def eqns(jaxpr, name=None):
  """Every equation (recursively through sub-jaxprs) named ``name``."""
  out = []

  def walk(j):
    for e in j.eqns:
      if name is None or e.primitive.name == name:
        out.append(e)
      for sub in _subjaxprs(e.params):
        walk(sub)

  walk(jaxpr.jaxpr if isinstance(jaxpr, ji.ClosedJaxpr) else jaxpr)
  return out


def dtypes_of(eqn):
  return tuple(str(v.aval.dtype) for v in eqn.invars)


def products(jaxpr):
  """Input dtypes of every dot_general/conv in ``jaxpr``."""
  return [
    dtypes_of(e)
    for e in eqns(jaxpr)
    if e.primitive.name
    in ("dot_general", "conv_general_dilated", "ragged_dot_general")
  ]


def assert_all_half(jaxpr, half="float16"):
  found = products(jaxpr)
  assert found, "no matrix product in the jaxpr"
  for d in found:
    assert all(t == half for t in d if t.startswith(("float", "bfloat"))), found


def dot_tol(x, w, dtype=F16):
  """Bound on |half x @ w - fp32 x @ w|: K+3 roundings of sum |x||w|."""
  k = x.shape[-1]
  return (k + 3) * U[jnp.dtype(dtype)] * (np.abs(x) @ np.abs(w))


def assert_within(got, want, tol):
  err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
  assert np.all(err <= tol), (err.max(), np.max(tol))


def abs_grad(f, args, argnums):
  """Gradient of ``f`` at ``|args|``: bounds the sum of |terms| of each entry.

  For ``f`` built from products, sums and ReLUs (monotone, slope 1 on
  positive inputs), each gradient entry at |args| is the sum of the absolute
  values of the terms of that entry at ``args``; an error of at most
  ``c * u`` per term then bounds the error of the entry by
  ``c * u * abs_grad``.
  """
  return jax.grad(f, argnums)(*[jnp.abs(a) for a in args])


def matmul_tol(a, b, dtype=F16):
  """Elementwise bound for a @ b with both factors rounded to ``dtype``."""
  k = a.shape[-1]
  return (k + 3) * U[jnp.dtype(dtype)] * (np.abs(a) @ np.abs(b))


W = jnp.linspace(-1.0, 1.0, 12, dtype=F32).reshape(3, 4)
X = jnp.linspace(-2.0, 2.0, 24, dtype=F32).reshape(8, 3) ** 3
ZMAX = float((np.abs(np.asarray(X)) @ np.abs(np.asarray(W))).max())  # |x||w|


# ---------------------------------------------------------------------------
# The rules, row by row.


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_matrix_products_run_in_dtype_forward_and_backward(dtype):
  def f(w, x, k):
    h = jax.nn.relu(x @ w)  # dot_general
    img = h.reshape(2, 4, 4, 1)
    y = lax.conv_general_dilated(
      img, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jnp.sum(y)

  k = jnp.ones((3, 3, 1, 2), F32) / 9
  g = jaxmp.autocast(f, dtype)
  half = jnp.dtype(dtype).name
  fwd = jax.make_jaxpr(g)(W, X, k)
  assert_all_half(fwd, half)
  assert len(products(fwd)) == 2
  # (grad_reduce="native": JAX's own transposes. By default the weights'
  # cotangent products output fp32, and on CPU take bf16 operands in fp32:
  # XLA:CPU runs no bf16 x bf16 -> f32 product outside a fusion.)
  native = jaxmp.autocast(f, dtype, grad_reduce="native")
  bwd = jax.make_jaxpr(jax.grad(native, argnums=(0, 2)))(W, X, k)
  # Forward 2, backward: dW (1), dK and dimg (2), dh (1).
  assert len(products(bwd)) >= 5
  assert_all_half(bwd, half)
  grads = jax.grad(g, argnums=(0, 2))(W, X, k)
  assert [gr.dtype for gr in grads] == [F32, F32]
  ref = jax.grad(f, argnums=(0, 2))(W, X, k)
  # Each term of a gradient entry is a product of rounded factors summed in
  # half: at most 2 * (3 + 9 + 18 + 8 + 32) + 10 roundings along a path
  # (forward sums of 3 and 9 terms, backward of 18, 8 and 32, ten casts).
  bound = abs_grad(f, (W, X, k), (0, 2))
  for gr, r, b in zip(grads, ref, bound):
    assert_within(gr, r, (2 * 70 + 10) * U[jnp.dtype(dtype)] * b)


@pytest.mark.parametrize("grad_reduce", ["fp32", "native"])
def test_backward_products_stay_half_x_half(grad_reduce):
  # An fp32 forward output would make the transposes fp32 x fp32. Under
  # grad_reduce="fp32" the weight's cotangent product asks for an fp32
  # output (its cross-device sum is there), its operands still half.
  g = jaxmp.autocast(lambda w, x: jnp.sum(x @ w), grad_reduce=grad_reduce)
  found = eqns(jax.make_jaxpr(jax.grad(g))(W, X), "dot_general")
  for e in found:
    assert [v.aval.dtype for v in e.invars] == [jnp.float16] * 2
  out = {
    e.outvars[0].aval.shape: e.params["preferred_element_type"] for e in found
  }
  wide = jnp.float32 if grad_reduce == "fp32" else jnp.float16
  # The forward's output (X @ W) stays half; w's cotangent is `wide`.
  assert out == {(8, 4): jnp.float16, W.shape[::-1]: wide}


def test_user_preferred_element_type_is_kept():
  def f(w, x):
    return lax.dot(
      x.astype(F16), w.astype(F16), preferred_element_type=jnp.float32
    )

  (e,) = eqns(jax.make_jaxpr(jaxmp.autocast(f))(W, X), "dot_general")
  assert e.params["preferred_element_type"] == jnp.float32


@pytest.mark.skipif(not hasattr(lax, "ragged_dot"), reason="no ragged_dot")
def test_ragged_dot_runs_in_dtype():
  gs = jnp.array([4, 4], jnp.int32)
  g = jaxmp.autocast(lambda a, b: lax.ragged_dot(a, b, gs))
  (e,) = eqns(jax.make_jaxpr(g)(X, jnp.ones((2, 3, 5))), "ragged_dot_general")
  assert dtypes_of(e) == ("float16", "float16", "int32")


_FP32_OPS = {
  "exp": jnp.exp,
  "exp2": jnp.exp2,
  "log": lambda h: jnp.log(jnp.abs(h) + 1),
  "log1p": lambda h: jnp.log1p(jnp.abs(h)),
  "expm1": jnp.expm1,
  "pow": lambda h: lax.pow(jnp.abs(h), jnp.float32(1.5) + h * 0),
  "integer_pow": lambda h: h**3,
  "square": jnp.square,
  "rsqrt": lambda h: lax.rsqrt(jnp.abs(h) + 1),
  "tan": jnp.tan,
  "asin": lambda h: jnp.arcsin(jnp.tanh(h)),
  "acos": lambda h: jnp.arccos(jnp.tanh(h)),
  "atan": jnp.arctan,
  "sinh": jnp.sinh,
  "cosh": jnp.cosh,
  "asinh": jnp.arcsinh,
  "acosh": lambda h: jnp.arccosh(jnp.abs(h) + 1),
  "atanh": lambda h: jnp.arctanh(jnp.tanh(h) / 2),
  "erf_inv": lambda h: lax.erf_inv(jnp.tanh(h) / 2),
  "reduce_sum": jnp.sum,
  "reduce_prod": jnp.prod,
  "cumsum": lambda h: jnp.cumsum(h, axis=0),
  "cumprod": lambda h: jnp.cumprod(h, axis=0),
  "cumlogsumexp": lambda h: lax.cumlogsumexp(h, axis=0),
}


def test_float32_list_is_the_issues_list():
  assert set(_FP32_OPS) == set(ac.FLOAT32)


@pytest.mark.parametrize("name", sorted(_FP32_OPS))
def test_float32_row(name):
  op = _FP32_OPS[name]
  g = jaxmp.autocast(lambda w, x: op(x @ w))
  found = eqns(jax.make_jaxpr(g)(W, X), name)
  assert found, f"{name} not in the jaxpr"
  for e in found:
    assert all(d == "float32" for d in dtypes_of(e)), (name, dtypes_of(e))
    assert str(e.outvars[0].aval.dtype) == "float32"
  # ... and its result is not cast back to half afterwards.
  assert g(W, X).dtype == F32, name


# Inputs whose fp16 products are exact: multiples of 1/8 (|x| <= 1.5,
# |w| <= 1), so every partial sum of x @ w is a multiple of 1/64 below
# 3 * 1.5 * 1 = 4.5, that is an integer below 288 < 2**11 times 1/64:
# representable in fp16, whatever the order of the sums. Their products
# (1/64 apart) carry more digits than fp16 keeps once squared, exponentiated
# or summed.
WE = jnp.asarray(np.arange(12).reshape(3, 4) % 9 - 4, F32) / 4 + 1 / 8
XE = (jnp.asarray(np.arange(24).reshape(8, 3) * 5 % 13 - 6, F32) / 4) + 0.125


def assert_fp16_exact_products(x, w, qx=1 / 8, qw=1 / 8):
  """Asserts that fp16 computes ``x @ w`` exactly, in any order.

  ``x`` and ``w`` are multiples of ``qx`` and ``qw`` that fp16 holds, and
  ``|x| @ |w| < 2**11 qx qw``: every partial sum is an integer below 2**11
  times ``qx qw``, which fp16 holds.
  """
  for a, q in ((x, qx), (w, qw)):
    a = np.asarray(a, np.float64)
    assert np.array_equal(a, a.astype(np.float16)), "not fp16 values"
    assert np.array_equal(a / q, np.round(a / q)), f"not multiples of {q}"
  zabs = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
  assert zabs.max() < 2**11 * qx * qw


def test_float32_list_values_round_as_fp32():
  # A value test of the fp32 row: on inputs whose fp16 products are exact,
  # every fp32-listed op sees the same input as in fp32, so autocast must
  # match fp32 within fp32 rounding (a few ulps for an elementwise op, the
  # term count for sums). The same ops computed in fp16 (even cast back to
  # fp32) are off by up to 2**-12 relative: 2**11 times more.
  assert_fp16_exact_products(XE, WE)
  z = np.abs(np.asarray(XE @ WE, np.float64))
  sum_abs = {
    "reduce_sum": (z + 1000).sum(),
    "cumsum": np.cumsum(z + 1000, axis=0),
    "cumlogsumexp": 1.0 + z.max(),  # |log-sum-exp| <= max z + log 8
  }
  terms = {"reduce_sum": 32, "reduce_prod": 32}
  # _FP32_OPS reaches these through tanh (a half op, rounded in fp16): here
  # through h / 8, exact in fp16 (|h / 8| < 0.5625, multiples of 1/512).
  # Sums of h + 1000 (fp32, exact): about 32,000 in steps of 1/64, which
  # fp32 sums exactly and fp16 cannot hold.
  big = jnp.float32(1000.0)
  ops = dict(
    _FP32_OPS,
    reduce_sum=lambda h: jnp.sum(h + big),
    cumsum=lambda h: jnp.cumsum(h + big, axis=0),
    asin=lambda h: jnp.arcsin(h / 8),
    acos=lambda h: jnp.arccos(h / 8),
    atanh=lambda h: jnp.arctanh(h / 8),
    erf_inv=lambda h: lax.erf_inv(h / 8),
  )

  def f(w, x):
    return {name: op(x @ w) for name, op in ops.items()}

  got = jaxmp.autocast(f)(WE, XE)
  want = jax.jit(f)(WE, XE)
  caught = []
  for name in ops:
    ref = np.asarray(want[name], np.float64)
    assert np.all(np.isfinite(ref)), name
    n = terms.get(name, 8)  # elementwise: a few ulps; cum*: 8 terms
    tol = 2 * (n + 2) * U32 * sum_abs.get(name, np.abs(ref))
    err = np.abs(np.asarray(got[name], np.float64) - ref)
    if not np.all(err <= tol):
      caught.append((name, float(err.max()), float(np.max(tol))))
  names = " ".join(c[0] for c in caught)
  assert not caught, f"beyond fp32 rounding: {names} ({caught})"


def test_widest_input_row():
  b32 = jnp.ones((4,), F32)

  def f(w, x):
    h = x @ w  # f16
    relu = jax.nn.relu(h)  # half stays half (0.0 is a Python scalar)
    t = jnp.tanh(h)  # half
    biased = h + b32  # half + fp32 bias -> fp32
    masked = jnp.where(h > 0, h, 0.0)  # weak zeros: half
    big = jnp.where(h > 0, h, jnp.finfo(F32).min)  # too big for half: fp32
    bigger = jnp.maximum(h, 1e6)  # 1e6 does not fit fp16: fp32
    return relu, t, biased, masked, big, bigger

  outs = jaxmp.autocast(f)(W, X)
  assert [str(o.dtype) for o in outs] == [
    "float16",
    "float16",
    "float32",
    "float16",
    "float32",
    "float32",
  ]
  np.testing.assert_array_equal(outs[4] == jnp.finfo(F32).min, ~(outs[0] > 0))


def test_integer_bool_float64_and_explicit_casts_are_left_alone():
  def f(w, x, i):
    j = i * 3 + 1  # int
    m = (x @ w) > 0  # bool
    y = (x @ w).astype(jnp.bfloat16)  # the user's cast: kept
    return j, m, y

  j, m, y = jaxmp.autocast(f)(W, X, jnp.arange(4))
  assert (j.dtype, m.dtype, y.dtype) == (jnp.int32, jnp.bool_, BF16)
  with jax.enable_x64(True):
    w64, x64 = W.astype(jnp.float64), X.astype(jnp.float64)
    g = jaxmp.autocast(lambda w, x: jnp.exp(x @ w) + 1.0)
    (e,) = eqns(jax.make_jaxpr(g)(w64, x64), "dot_general")
    assert dtypes_of(e) == ("float64", "float64")
    assert g(w64, x64).dtype == jnp.float64


def test_bad_dtype_is_an_error():
  with pytest.raises(ValueError, match="float16 or bfloat16"):
    jaxmp.autocast(jnp.sum, jnp.float32)


def test_signature_is_kept():
  def apply(params, x, *, train=False):
    """Doc."""
    return x

  g = jaxmp.autocast(apply)
  assert g.__name__ == "apply" and g.__doc__ == "Doc."
  assert g.__wrapped__ is apply


# ---------------------------------------------------------------------------
# Values against fp32, and the numerics that fp16 everywhere gets wrong.


def _mlp(params, x):
  for w, b in params[:-1]:
    x = jax.nn.relu(x @ w + b)
  w, b = params[-1]
  return x @ w + b


def test_values_and_grads_match_fp32_within_half_rounding():
  # Positive weights, biases and inputs: no term cancels another, so the
  # sums of |terms| that bound the error are the values themselves, and a
  # result off by 2x (or zero) is far outside the bounds.
  keys = jax.random.split(jax.random.key(0), 3)
  sizes = [(3, 8), (8, 8), (8, 2)]
  params = [
    (jnp.abs(jax.random.normal(k, s)) / s[0], jnp.full(s[1], 0.1))
    for k, s in zip(keys, sizes)
  ]
  x = jnp.abs(X)

  def loss(params, x):
    return jnp.mean(jnp.square(_mlp(params, x)))

  g = jaxmp.autocast(loss)
  v, gr = jax.value_and_grad(g)(params, x)
  v32, gr32 = jax.value_and_grad(loss)(params, x)
  assert v.dtype == F32
  # Each layer: a half product of K <= 8 terms, (K + 3) u relative, and the
  # fp32 bias add; three layers compound; the fp32 square doubles it, and
  # the fp32 mean of 16 terms adds (16 + 1) roundings of 2**-24. A gradient
  # term: the output's error (three layers), again in the square's
  # derivative 2 out, and the backward half products' (K + 3) u per layer.
  u = U[jnp.dtype(F16)]
  layer = (8 + 3) * u + U32
  assert abs(float(v) - float(v32)) <= (
    2 * 3 * layer + (1 + 16 + 1) * U32
  ) * float(v32)
  bound = jax.grad(loss)(jax.tree.map(jnp.abs, params), x)  # = sum |terms|
  for a, b, c in zip(*map(jax.tree.leaves, (gr, gr32, bound))):
    assert a.dtype == F32
    assert_within(a, b, (3 * 3 * layer + 19 * U32) * np.asarray(c))
  assert_all_half(jax.make_jaxpr(jax.grad(g))(params, x))


def _half_everywhere(f, *args):
  return f(*jax.tree.map(lambda a: a.astype(F16), args))


def test_logsumexp_of_products_near_12():
  # exp(12) = 162755 > 65504: fp16 overflows; autocast runs exp/sum in fp32.
  x = jnp.full((4, 3), 2.0)
  w = jnp.full((3, 5), 2.0)  # products x @ w = 12

  def lse(w, x):
    return jnp.log(jnp.sum(jnp.exp(x @ w)))

  assert not np.isfinite(float(_half_everywhere(lse, w, x)))
  got = jaxmp.autocast(lse)(w, x)
  want = 12.0 + np.log(20.0)
  # x @ w = 12 exactly in half; exp/sum/log in fp32.
  assert abs(float(got) - want) <= 1e-5 * want


def test_variance_of_activations_near_300():
  # Squares of 300 (90000) overflow fp16; autocast squares in fp32.
  x = jnp.linspace(290.0, 310.0, 32).reshape(32, 1)
  w = jnp.ones((1, 4))

  def var(w, x):
    h = x @ w
    return jnp.mean(h**2, axis=0) - jnp.mean(h, axis=0) ** 2

  assert not np.all(np.isfinite(_half_everywhere(var, w, x)))
  got = jaxmp.autocast(var)(w, x)
  # h = x @ w is x rounded to half (spacing 0.25 at 300): the variance of
  # those values, in float64. E[h^2] - E[h]^2 in fp32 cancels ~9e4: each
  # mean carries (32 + 2) roundings of 2**-24 of 9e4, twice.
  h16 = np.asarray(x.astype(F16), np.float64)[:, 0]
  want = np.mean(h16**2) - np.mean(h16) ** 2
  tol = 2 * 9.61e4 * 2.0**-24 * (32 + 2)
  assert want > 30  # the variance is ~35.6: the bound is ~0.4
  np.testing.assert_allclose(got, np.full(4, want), rtol=0, atol=tol)


def test_softmax_of_large_logits():
  # exp(15 * 4) overflows fp16 (and fp32 would not): exp/sum in fp32.
  x = jnp.full((2, 4), 1.0) * jnp.array([[1.0], [0.5]])
  w = jnp.full((4, 3), 3.75) * jnp.array([1.0, 0.9, 0.8])

  def softmax(w, x):
    z = x @ w
    e = jnp.exp(z)
    return e / jnp.sum(e, axis=-1, keepdims=True)

  assert not np.all(np.isfinite(_half_everywhere(softmax, w, x)))
  got = jaxmp.autocast(softmax)(w, x)
  want = jax.nn.softmax(np.asarray(x) @ np.asarray(w), axis=-1)
  # Logits rounded to half (|z| <= 15: abs error <= 15 * u each).
  np.testing.assert_allclose(got, want, atol=2 * 15 * U[jnp.dtype(F16)])
  assert got.dtype == F32


# ---------------------------------------------------------------------------
# Higher-order primitives.


def _ident(z):
  return z


def assert_matches_fp32(g, f, args, n16, n32, argnums=None, grad=None):
  """Values (and gradients) of ``g = autocast(f)`` within rounding of fp32.

  ``f`` takes ``act`` (tanh); ``f(act=identity)`` on ``|args|`` bounds the
  sum of |terms| of each output, and its gradient that of each gradient
  entry (|tanh z| <= |z|, 0 < tanh' <= 1; exp is its own bound). Along any
  path a term meets at most ``n16`` fp16 roundings (the policy's half
  products, ``K + 3`` for a sum of ``K`` products, and half pointwise ops)
  and ``n32`` fp32 ones (sums of ``n`` terms count ``n``, transcendentals a
  few each): ``n16 * 2**-11 + n32 * 2**-24`` per term. ``grad`` is
  ``(n16, n32)`` of the gradient's paths (forward and backward).
  """
  c = n16 * U[jnp.dtype(F16)] + n32 * U32
  f_abs = functools.partial(f, act=_ident)
  abs_args = [jnp.abs(a) for a in args]
  assert_within(g(*args), f(*args), c * f_abs(*abs_args))
  if argnums is not None:
    c = grad[0] * U[jnp.dtype(F16)] + grad[1] * U32
    assert_within(
      jax.grad(g, argnums)(*args),
      jax.grad(f, argnums)(*args),
      c * jax.grad(f_abs, argnums)(*abs_args),
    )


# Positive inputs whose fp16 products are exact (multiples of 1/16 and
# 1/8, |x| @ |w| < 14.3: below 2**11 / 128), whose sum (153.18 in steps of
# 1/128) fp16 cannot hold (its steps are 1/8 there).
XP = (
  jnp.asarray(
    [[40, 13, 6], [15, 20, 39], [22, 5, 16], [29, 39, 35]]
    + [[47, 9, 42], [3, 27, 13], [10, 31, 15], [27, 13, 8]],
    F32,
  )
  / 16
)
WP = jnp.asarray([[10, 6, 9, 9], [13, 6, 3, 9], [13, 13, 12, 9]], F32) / 8


def assert_exact_products_match_fp32(f, n32):
  """``autocast(f)(WP, XP)`` with ``act`` the identity, within fp32 rounding.

  On WP, XP the fp16 products are exact, and ``f``'s other half ops (adds
  of Python scalars) stay on fp16's grid, so only the fp32-listed ops
  round, as in fp32: both sides within ``n32 * 2**-24`` per term. Computed
  in fp16, a sum of the products (about 150, in steps of 1/128) would lose
  its last 4 bits, and exp's results 2**-12 relative.
  """
  assert_fp16_exact_products(XP, WP, 1 / 16, 1 / 8)
  f_id = functools.partial(f, act=_ident)
  got = jaxmp.autocast(f_id)(WP, XP)
  want = jax.jit(f_id)(WP, XP)
  assert_within(got, want, 2 * n32 * U32 * f_id(WP, XP))


def test_jit_inside_is_rewritten_and_keeps_its_name():
  inner = jax.jit(lambda a, b: jnp.exp(a @ b))

  def f(w, x):
    return jnp.sum(inner(x, w))

  jp = jax.make_jaxpr(jaxmp.autocast(f))(W, X)
  (call,) = [e for e in eqns(jp, "jit") if e.params["name"] == "<lambda>"]
  assert_all_half(call.params["jaxpr"])
  (e,) = eqns(jp, "exp")
  assert dtypes_of(e) == ("float32",)
  assert_all_half(jax.make_jaxpr(jax.grad(jaxmp.autocast(f)))(W, X))


def test_under_jit_only_casts_are_added():
  def f(w, x):
    return jnp.sum(jnp.tanh(x @ w) @ w.T)

  def ops(fn):
    text = jax.jit(fn).lower(W, X).as_text()
    names = [
      n
      for n in __import__("re").findall(r"(stablehlo\.\w+)", text)
      if n != "stablehlo.convert"
    ]
    return sorted(names)

  assert ops(jaxmp.autocast(f)) == ops(f)

  def h(w, x):  # relu is a custom_jvp: its rule runs in the backward pass
    return jnp.sum(jax.nn.relu(x @ w) @ w.T)

  assert ops(jax.grad(jaxmp.autocast(h))) == ops(jax.grad(h))


def test_scan_body_is_rewritten_and_carry_keeps_its_dtype():
  def f(w, x, act=jnp.tanh):
    def step(c, xi):
      h = act(xi @ w)  # half
      return c + h, h

    c, ys = lax.scan(step, jnp.zeros(4), x)
    return jnp.sum(c) + jnp.sum(ys)

  g = jaxmp.autocast(f)
  assert_all_half(jax.make_jaxpr(g)(W, X))
  assert_all_half(jax.make_jaxpr(jax.grad(g))(W, X))
  (scan,) = eqns(jax.make_jaxpr(g)(W, X), "scan")
  assert [str(v.aval.dtype) for v in scan.outvars] == ["float32", "float16"]
  # Half: x @ w (3 + 3) and tanh; fp32: the carry's 8 adds, the sums of 4
  # and 32 terms, their add. Backward: tanh' in half (3 ops; it moves by
  # |tanh''| <= 0.77 times z's error 6u ZMAX: 5 ZMAX), the outer product
  # (1 + 3), and 8 fp32 adds of the weight's gradient.
  assert_matches_fp32(
    g, f, (W, X), 7, 45, argnums=0, grad=(7 + 3 + 4 + 5 * ZMAX, 54)
  )
  # With exact products, only the fp32 sums round.
  assert_exact_products_match_fp32(f, 45)


def test_while_loop_body_is_rewritten():
  def f(w, x, act=jnp.tanh):
    def body(c):
      i, h = c
      return i + 1, act(h @ w @ w.T)

    return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

  g = jaxmp.autocast(f)
  assert_all_half(jax.make_jaxpr(g)(W, X))
  out = g(W, X)
  assert out.dtype == F32  # the carry keeps its traced dtype
  # Three trips of two half products (3 + 3 and 4 + 3) and a half tanh.
  assert_matches_fp32(g, f, (W, X), 3 * (6 + 7 + 1), 0)


@pytest.mark.parametrize("pred", [True, False])
def test_cond_and_switch_branches_are_rewritten(pred):
  def f(w, x, act=jnp.tanh):
    del act  # exp bounds itself.
    y = lax.cond(pred, lambda a: a @ w, lambda a: jnp.exp(a @ w), x)
    z = lax.switch(jnp.int32(pred), [lambda a: a @ w, lambda a: a @ w + 1.0], x)
    return jnp.sum(y) + jnp.sum(z)

  g = jaxmp.autocast(f)
  assert_all_half(jax.make_jaxpr(g)(W, X))
  assert_all_half(jax.make_jaxpr(jax.grad(g))(W, X))
  conds = eqns(jax.make_jaxpr(g)(W, X), "cond")
  # Branches unify on the widest: exp is fp32, so the first cond is fp32;
  # the switch's branches are both half.
  assert [str(c.outvars[0].aval.dtype) for c in conds] == [
    "float32",
    "float16",
  ]
  # z = a @ w in half (3 + 3 roundings of |z| <= ZMAX), exp in fp32 (its
  # relative error is z's absolute error, 6u ZMAX, plus a few fp32 ulps), the
  # half add of 1.0, fp32 sums of 32 terms. Backward: the half product
  # a^T (ct exp z) (8 + 3).
  n16 = 6 * (1 + ZMAX) + 1
  assert_matches_fp32(
    g, f, (W, X), n16, 4 + 32 + 32 + 1, argnums=0, grad=(n16 + 11, 8)
  )
  # With exact products, only exp and the fp32 sums round.
  assert_exact_products_match_fp32(f, 4 + 32 + 32 + 1)


def test_loop_carry_from_a_product_keeps_its_traced_dtype():
  # The carry starts from x @ w, which autocast makes fp16: the traced
  # carry is fp32, so the loops' carries (and outputs) stay fp32.
  def f(w, x):
    c, _ = lax.scan(lambda c, xi: (c + xi, None), x @ w, jnp.ones((2, 4)))
    d = lax.while_loop(
      lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] * 0.5), (0, x @ w)
    )
    e = lax.fori_loop(0, 2, lambda i, c: c + 1.0, x @ w)
    return c, d[1], e

  outs = jaxmp.autocast(f)(W, X)
  assert [str(o.dtype) for o in outs] == ["float32"] * 3
  jp = jax.make_jaxpr(jaxmp.autocast(f))(W, X)
  assert_all_half(jp)
  for loop in eqns(jp, "scan") + eqns(jp, "while"):
    assert "float16" not in [str(v.aval.dtype) for v in loop.outvars]


def test_cond_and_switch_output_is_widest_with_the_half_branch_first():
  # lax.cond lists its branches (false, true): here the half branch (a @ w)
  # is branches[0] and the fp32 one (exp) second, in both primitives.
  def f(w, x):
    y = lax.cond(False, lambda a: jnp.exp(a @ w), lambda a: a @ w, x)
    z = lax.switch(1, [lambda a: a @ w, lambda a: jnp.exp(a @ w)], x)
    return y, z

  for c in eqns(jax.make_jaxpr(f)(W, X), "cond"):  # as traced
    assert [len(eqns(b, "exp")) for b in c.params["branches"]] == [0, 1]
  conds = eqns(jax.make_jaxpr(jaxmp.autocast(f))(W, X), "cond")
  assert [str(c.outvars[0].aval.dtype) for c in conds] == ["float32"] * 2
  y, z = jaxmp.autocast(f)(W, X)
  assert y.dtype == z.dtype == F32


def test_remat_body_is_rewritten():
  def f(w, x, act=jnp.tanh):
    h = jax.checkpoint(lambda a: act(a @ w))(x)
    return jnp.sum(h @ w.T)

  g = jaxmp.autocast(f)
  jp = jax.make_jaxpr(jax.grad(g))(W, X)
  assert eqns(jp, "remat2") or eqns(jp, "checkpoint")
  assert_all_half(jp)
  # Half: a @ w (3 + 3), tanh, h @ w.T (4 + 3); fp32: the sum of 24 terms.
  # Backward: dh = 1 @ w (3 + 3), tanh' (3, and 5 ZMAX as in the scan
  # test), a^T dz (8 + 3), and h^T 1 (8 + 3) for the other use of w.
  assert_matches_fp32(
    g, f, (W, X), 14, 25, argnums=0, grad=(7 + 6 + 3 + 11 + 5 * ZMAX, 26)
  )


@jax.custom_vjp
def _clip_cotangent(x):
  return x


_clip_cotangent.defvjp(
  lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),)
)


def test_custom_vjp_rule_still_applies():
  def f(w, x):
    return jnp.sum(_clip_cotangent(x @ w) * 5.0)

  g = jaxmp.autocast(f)
  got = jax.grad(g)(W, X)
  want = jax.grad(f)(W, X)  # cotangents clipped to 0.01: dW = x^T 0.01
  assert_within(got, want, matmul_tol(X.T, jnp.full((8, 4), 0.01)))
  unclipped = X.T @ jnp.full((8, 4), 5.0)
  assert float(jnp.max(jnp.abs(got - unclipped))) > 1.0
  assert_all_half(jax.make_jaxpr(jax.grad(g))(W, X))


@jax.custom_jvp
def _double_slope(x):
  return jnp.tanh(x)


_double_slope.defjvp(lambda p, t: (_double_slope(p[0]), 2.0 * t[0]))


def test_custom_jvp_rule_still_applies():
  def f(w, x):
    return jnp.sum(_double_slope(x @ w))

  g = jaxmp.autocast(f)
  got = jax.grad(g)(W, X)
  # The rule says d tanh = 2 (not 1 - tanh^2): dW = x^T 2.
  ones = jnp.full((8, 4), 2.0)
  want = X.T @ ones
  assert_within(got, want, matmul_tol(X.T, ones))
  (e,) = eqns(jax.make_jaxpr(g)(W, X), "custom_jvp_call")
  assert dtypes_of(e) == ("float16",)  # the primal runs on the half product
  assert jax.nn.relu(X).dtype == jaxmp.autocast(jax.nn.relu)(X).dtype


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))


def test_shard_map_with_psum_inside():
  P = jax.sharding.PartitionSpec
  mesh = _mesh()

  def f(w, x, act=jnp.tanh):
    def body(w, xs):
      return lax.psum(jnp.sum(act(xs @ w), axis=0), "data")

    return jax.shard_map(
      body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
    )(w, x)

  g = jaxmp.autocast(f)
  jp = jax.make_jaxpr(g)(W, X)
  (sm,) = eqns(jp, "shard_map")
  assert sm.params["mesh"] == mesh
  assert eqns(sm.params["jaxpr"], "psum") or eqns(
    sm.params["jaxpr"], "psum_invariant"
  )
  assert_all_half(jp)
  assert_all_half(jax.make_jaxpr(jax.grad(lambda w: jnp.sum(g(w, X))))(W))
  # Half: xs @ w (3 + 3) and tanh; fp32: sums of 2 rows, psum of 4.
  assert_matches_fp32(g, f, (W, X), 7, 7)


def test_autocast_inside_shard_map():
  P = jax.sharding.PartitionSpec
  fwd = jaxmp.autocast(lambda w, x: jnp.mean(jnp.tanh(x @ w)))

  def body(w, x):
    return lax.pmean(fwd(w, x), "data")

  f = jax.shard_map(
    body, mesh=_mesh(), in_specs=(P(), P("data")), out_specs=P()
  )

  def ref(w, x, act=jnp.tanh):
    return jnp.mean(act(x @ w))

  assert jax.grad(f)(W, X).dtype == F32
  # Half: x @ w (3 + 3), tanh; fp32: means of 8 and pmean of 4. Backward:
  # tanh' (3, and 5 ZMAX), x^T dz (2 + 3), psum of the 4 devices' dW.
  assert_matches_fp32(
    f, ref, (W, X), 7, 14, argnums=0, grad=(7 + 3 + 5 + 5 * ZMAX, 18)
  )


def test_nested_autocast_keeps_its_dtype():
  inner = jaxmp.autocast(lambda a, b: a @ b, jnp.bfloat16)

  def f(w, x):
    return inner(x, w) + x @ w

  jp = jax.make_jaxpr(jaxmp.autocast(f))(W, X)
  assert sorted(products(jp)) == [
    ("bfloat16", "bfloat16"),
    ("float16", "float16"),
  ]


def test_no_autocast_region_runs_in_fp32():
  def f(w, x):
    kept = jaxmp.no_autocast(lambda a, b: jnp.tanh(a @ b))(x, w)
    return kept + x @ w

  jp = jax.make_jaxpr(jaxmp.autocast(f))(W, X)
  assert sorted(products(jp)) == [
    ("float16", "float16"),
    ("float32", "float32"),
  ]
  (tanh,) = eqns(jp, "tanh")
  assert dtypes_of(tanh) == ("float32",)
  # Half inputs are cast to fp32 outside autocast too.
  y = jaxmp.no_autocast(lambda a: a * 2)(X.astype(F16))
  assert y.dtype == F32


def test_composes_with_vmap_and_grad():
  g = jaxmp.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
  per_example = jax.vmap(jax.grad(g), in_axes=(None, 0))(W, X)
  assert per_example.shape == (8, 3, 4) and per_example.dtype == F32
  np.testing.assert_allclose(
    per_example.sum(0), jax.grad(g)(W, X), atol=8 * 4 * U[jnp.dtype(F16)]
  )


def test_closure_over_differentiated_values():
  def loss(w):
    return jaxmp.autocast(lambda x: jnp.sum(x @ w))(X)

  ones = jnp.ones((8, 4))
  assert_within(jax.grad(loss)(W), X.T @ ones, matmul_tol(X.T, ones))


def test_eager_calls_trace_once_per_signature():
  count = []

  def f(w, x, *, scale):
    count.append(1)
    return jnp.sum(x @ w) * scale

  g = jaxmp.autocast(f)
  a = g(W, X, scale=2.0)
  b = g(W, X + 1, scale=2.0)
  assert len(count) == 1
  assert float(a) != float(b)
  g(W, X[:4], scale=2.0)  # new shape
  assert len(count) == 2
  g(W, X, scale=3.0)  # new static value
  assert len(count) == 3


def test_non_array_leaves_and_outputs_pass_through():
  def f(tree, x, *, mode, names):
    assert mode == "train" and names == ["a"]
    return {"y": x @ tree["w"], "act": tree["act"], "n": 3}

  out = jaxmp.autocast(f)(
    {"w": W, "act": jax.nn.relu}, X, mode="train", names=["a"]
  )
  assert out["act"] is jax.nn.relu and out["n"] == 3
  assert out["y"].dtype == F16


# ---------------------------------------------------------------------------
# Frameworks: Flax linen, Flax NNX, Equinox; jaxmp.nn.BatchNorm's backward.


def test_flax_linen_batchnorm_statistics_update():
  nn = pytest.importorskip("flax.linen")

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train):
      x = nn.Dense(4)(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
      return nn.Dense(2)(nn.relu(x))

  net = Net()
  v = net.init(jax.random.key(0), XP, train=False)
  # The first kernel WP: its fp16 products with XP are exact, so only the
  # statistics' own (fp32) sums and squares round.
  v["params"]["Dense_0"]["kernel"] = WP
  f = jaxmp.autocast(net.apply)
  y, upd = f(v, XP, train=True, mutable=["batch_stats"])
  y32, upd32 = net.apply(v, XP, train=True, mutable=["batch_stats"])
  assert y.dtype == F32  # half product + fp32 bias
  tol = _stats_tol(XP, WP, momentum=0.5)
  for a, b, old in zip(
    jax.tree.leaves(upd),
    jax.tree.leaves(upd32),
    jax.tree.leaves(v["batch_stats"]),
  ):
    assert a.dtype == F32
    assert float(jnp.max(jnp.abs(b - old))) > 0.1  # the statistics moved...
    assert_within(a, b, tol)  # ...as in fp32

  def loss(params):
    out, _ = f({**v, "params": params}, XP, train=True, mutable=["batch_stats"])
    return jnp.mean(out**2)

  grads = jax.grad(loss)(v["params"])
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(F32)}
  assert_all_half(jax.make_jaxpr(jax.grad(loss))(v["params"]))


def _stats_tol(x, kernel, momentum):
  """Bound on the error of BatchNorm's running mean/var of ``x @ kernel``.

  Its fp16 products are exact (`assert_fp16_exact_products`), and so is the
  zero bias's fp32 add: h is fp32's h. The statistics run in fp32, as in
  fp32, over the n = 8 rows: the mean within (n + 1) 2**-24 of max |h|, the
  variance E[h^2] - E[h]^2 within (2 (n + 2) + 2) 2**-24 of max h^2; the
  running statistic takes (1 - momentum) of it, plus 2 roundings of its
  own (below max h^2 + max |h|). Both sides round: twice that. fp16 sums or
  squares would be off by up to 2**-12 of max h^2.
  """
  assert_fp16_exact_products(x, kernel, 1 / 16, 1 / 8)
  hmax = float((np.abs(np.asarray(x)) @ np.abs(np.asarray(kernel))).max())
  n = x.shape[0]
  big = hmax * hmax + hmax
  return 2 * U32 * ((1 - momentum) * (2 * (n + 2) + 2 + n + 1) + 2) * big


def test_flax_nnx_split_merge_keeps_batchnorm_updates():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Sequential(
    nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
    nnx.BatchNorm(4, momentum=0.5, rngs=nnx.Rngs(0)),
  )
  model.layers[0].kernel[...] = WP  # exact fp16 products with XP
  graphdef, state = nnx.split(model)
  old = [np.array(a) for a in jax.tree.leaves(state)]

  def forward(state, x):
    m = nnx.merge(graphdef, state)
    y = m(x)
    return y, nnx.state(m)  # the new state carries the BatchNorm updates

  y, new_state = jaxmp.autocast(forward)(state, XP)
  # An eager nnx.merge shares the state's variables: run fp32 on a copy.
  y32, new_state32 = forward(jax.tree.map(jnp.array, state), XP)
  assert y.dtype == F32
  means = [
    (a, b, old)
    for a, b, old in zip(
      jax.tree.leaves(new_state),
      jax.tree.leaves(new_state32),
      jax.tree.leaves(state),
    )
  ]
  moved = 0
  tol = _stats_tol(XP, state["layers"][0]["kernel"][...], momentum=0.5)
  for a, b, old in means:
    assert a.dtype == b.dtype
    assert_within(a, b, tol)
    moved += float(jnp.max(jnp.abs(b - old))) > 0.1
  assert moved == 2  # mean and var
  assert_all_half(jax.make_jaxpr(jaxmp.autocast(forward))(state, XP))


def test_equinox_mlp_without_edits():
  eqx = pytest.importorskip("equinox")
  mlp = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(1))
  fwd = jaxmp.autocast(lambda m, x: jax.vmap(m)(x))
  y = fwd(mlp, X)
  ref = jax.vmap(mlp)(X)
  # Half products (sums of 3, 8 and 8 terms) forward and back, plus the
  # casts: <= 2 * 35 fp16 roundings along any path; no fp32-listed op runs
  # inside. Bounds from the network on |params|, |X|.
  params, static = eqx.partition(mlp, eqx.is_array)
  c = 2 * 35 * U[jnp.dtype(F16)]

  def total(p, x):
    return jnp.sum(jax.vmap(eqx.combine(p, static))(x))

  abs_p = jax.tree.map(jnp.abs, params)
  assert_within(y, ref, c * jax.vmap(eqx.combine(abs_p, static))(jnp.abs(X)))
  grads = eqx.filter_grad(lambda m: jnp.sum(fwd(m, X)))(mlp)
  ref_g = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(X)))(mlp)
  bound = jax.grad(total)(abs_p, jnp.abs(X))
  for a, b, m in zip(
    jax.tree.leaves(grads), jax.tree.leaves(ref_g), jax.tree.leaves(bound)
  ):
    assert a.dtype == F32
    assert_within(a, b, c * m)
  loss = lambda p: jnp.sum(fwd(eqx.combine(p, static), X))  # noqa: E731
  assert_all_half(jax.make_jaxpr(jax.grad(loss))(params))


def _residuals(f, *args):
  _, vjp = jax.vjp(f, *args)
  return [(tuple(r.shape), str(r.dtype)) for r in jax.tree.leaves(vjp)]


def test_jaxmp_batchnorm_keeps_its_half_backward():
  nn = pytest.importorskip("flax.linen")
  import jaxmp.nn as jnn  # pylint: disable=g-import-not-at-top

  def net(norm):
    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Conv(4, (3, 3), use_bias=False)(x)
        return norm()(x)

    return Net()

  x = jnp.linspace(-1, 1, 2 * 4 * 4 * 3).reshape(2, 4, 4, 3)
  act = (2, 4, 4, 4)
  fused = net(functools.partial(jnn.BatchNorm, use_running_average=False))
  v = fused.init(jax.random.key(0), x)
  f = jaxmp.autocast(
    lambda p: fused.apply({**v, "params": p}, x, mutable=["batch_stats"])[0]
  )
  res = _residuals(f, v["params"])
  # BatchNorm's custom VJP saves its input, the conv's half output.
  assert (act, "float16") in res
  assert (act, "float32") not in res, res
  # Flax's BatchNorm, under the same rules, saves fp32 activations: the
  # check above can tell them apart.
  plain = net(functools.partial(nn.BatchNorm, use_running_average=False))
  vp = plain.init(jax.random.key(0), x)
  fp = jaxmp.autocast(
    lambda p: plain.apply({**vp, "params": p}, x, mutable=["batch_stats"])[0]
  )
  assert (act, "float32") in _residuals(fp, vp["params"])
  # And the gradients still agree with fp32 (a weighted sum: sum(y^2) of
  # a normalised y is constant, its gradients all but zero).
  w = jnp.linspace(-1.0, 2.0, np.prod(act)).reshape(act) ** 2
  g = jax.grad(lambda p: jnp.sum(f(p) * w))(v["params"])
  g32 = jax.grad(
    lambda p: jnp.sum(
      fused.apply({**v, "params": p}, x, mutable=["batch_stats"])[0] * w
    )
  )(v["params"])
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g32)):
    assert a.dtype == F32 and a.shape == b.shape
  tol = _conv_bn_grad_tol(x, v["params"]["Conv_0"]["kernel"], w)
  assert_within(g["Conv_0"]["kernel"], g32["Conv_0"]["kernel"], tol["kernel"])
  bn = [k for k in g if k != "Conv_0"][0]
  assert_within(g[bn]["scale"], g32[bn]["scale"], tol["scale"])
  assert_within(g[bn]["bias"], g32[bn]["bias"], tol["bias"])


def _conv_bn_grad_tol(x, k, w):
  """Per-entry bounds on the grads of sum(BatchNorm(conv(x, k)) w), fp16.

  First order in u = 2**-11, doubled for the higher orders. The half conv c
  is off by e_c = (27 + 2) u conv(|x|, |k|); x_hat = (c - mean) rstd moves
  by rstd (e_c + mean e_c + |x_hat| mean(|x_hat| e_c)) plus the fp32
  statistics' error; y = x_hat (scale 1, bias 0) is returned in half and
  its cotangent dy = w reaches the layer in half (+u|w|). Then
  d bias = sum dy, d scale = sum dy x_hat, and dc = rstd (dy - mean dy -
  x_hat mean(dy x_hat)) (returned in half), and dK sums x dc over 32
  positions in half ((32 + 3) u of sum |x| |dc|).
  """
  u = U[jnp.dtype(F16)]
  axes = (0, 1, 2)
  with jax.enable_x64(True):
    x64 = jnp.asarray(np.asarray(x, np.float64))
    k64 = jnp.asarray(np.asarray(k, np.float64))
    c = np.asarray(_conv(x64, k64))
    e_c = (27 + 2) * u * np.asarray(_conv(jnp.abs(x64), jnp.abs(k64)))
    rstd = 1 / np.sqrt(c.var(axes) + 1e-5)
    xhat = (c - c.mean(axes)) * rstd
    ax = np.abs(xhat)
    e_xhat = rstd * (e_c + e_c.mean(axes) + ax * (ax * e_c).mean(axes))
    e_xhat = e_xhat + _bn_stats_tol(c, 32)
    dy = np.asarray(w, np.float64)
    e_dy = u * np.abs(dy)
    ady = np.abs(dy)
    dc = rstd * (dy - dy.mean(axes) - xhat * (dy * xhat).mean(axes))
    e_dc = rstd * (
      e_dy
      + e_dy.mean(axes)
      + e_xhat * (ady * ax).mean(axes)
      + ax * (e_dy * ax + ady * e_xhat).mean(axes)
    ) + u * np.abs(dc)
    _, vjp = jax.vjp(lambda k: _conv(jnp.abs(x64), k), k64)
    (tol_k,) = vjp(jnp.asarray(e_dc + (32 + 3) * u * np.abs(dc)))
  return {
    "kernel": 2 * np.asarray(tol_k),
    "bias": 2 * e_dy.sum(axes),
    "scale": 2 * (e_dy * ax + ady * e_xhat).sum(axes),
  }


# ---------------------------------------------------------------------------
# Normalisation layers of jaxmp.nn: output in the input's dtype (torch's
# batch_norm on cudnn), statistics in fp32.


def _bn_stats_tol(x64, n):
  """Bound on |BatchNorm(x) - ref| from fp32 statistics over ``n`` values.

  Mean and E[x^2] are sums of ``n`` fp32 terms (relative error at most
  (n + 3) * 2**-24 each), so ``rstd`` and ``x - mean`` carry at most a few
  times that, relative to ``|x| + |mean|``; ``x64`` is the float64 input.
  """
  mean = x64.mean(axis=(0, 1, 2))
  rstd = 1 / np.sqrt(x64.var(axis=(0, 1, 2)) + 1e-5)
  return 4 * (n + 3) * 2.0**-24 * (np.abs(x64) + np.abs(mean)) * rstd


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_jaxmp_batchnorm_returns_its_input_dtype(dtype):
  nn = pytest.importorskip("flax.linen")
  jnn = pytest.importorskip("jaxmp.nn")
  bn = jnn.BatchNorm(use_running_average=False, momentum=0.5)
  x = (jnp.linspace(-3, 5, 2 * 3 * 3 * 4).reshape(2, 3, 3, 4) ** 2).astype(
    dtype
  )
  v = bn.init(jax.random.key(0), x.astype(F32))
  apply = functools.partial(bn.apply, mutable=["batch_stats"])
  # Its custom_vjp carries the marker the interpreter reads.
  rules = eqns(jax.make_jaxpr(apply)(v, x), "custom_vjp_call")
  assert [ac.NORMALIZATION_MARK in ji.rule_name(e) for e in rules] == [True]
  y, upd = jaxmp.autocast(apply, dtype)(v, x)
  assert y.dtype == dtype
  assert {a.dtype for a in jax.tree.leaves(upd)} == {jnp.dtype(F32)}
  # Against fp32 BatchNorm of the same (half-valued) input: the output is
  # rounded once to ``dtype``; the statistics are fp32 sums of n = 18 terms.
  x32 = x.astype(F32)
  ref, ref_upd = apply(v, x32)
  x64 = np.asarray(x32, np.float64)
  tol = U[jnp.dtype(dtype)] * np.abs(ref) + _bn_stats_tol(x64, 18)
  assert_within(y, ref, tol)
  for a, b in zip(jax.tree.leaves(upd), jax.tree.leaves(ref_upd)):
    assert_within(a, b, 4 * 21 * 2.0**-24 * (np.abs(b) + x64.max() ** 2))
  # An fp32 input (no half product before it) stays fp32, as in torch.
  y32, _ = jaxmp.autocast(apply, dtype)(v, x32)
  assert y32.dtype == F32
  assert_within(y32, ref, _bn_stats_tol(x64, 18))
  # Flax's own BatchNorm is a composition of primitives: fp32 scale/bias
  # widen its output (the widest-input row).
  fbn = nn.BatchNorm(use_running_average=False)
  fv = fbn.init(jax.random.key(0), x32)
  fy, _ = jaxmp.autocast(fbn.apply, dtype)(fv, x, mutable=["batch_stats"])
  assert fy.dtype == F32


def test_jaxmp_batchnorm_grads_under_autocast():
  pytest.importorskip("flax")  # jaxmp.nn says so with an ImportError
  jnn = pytest.importorskip("jaxmp.nn")
  bn = jnn.BatchNorm(use_running_average=False)
  x = (jnp.linspace(-3, 5, 2 * 3 * 3 * 4).reshape(2, 3, 3, 4) ** 2).astype(F16)
  c = jnp.linspace(-1, 1, x.size, dtype=F32).reshape(x.shape) ** 3
  v = bn.init(jax.random.key(0), x.astype(F32))

  def loss(apply):
    def f(p, x):
      y, _ = apply({**v, "params": p}, x, mutable=["batch_stats"])
      return jnp.sum(y.astype(F32) * c)

    return f

  g, gx = jax.grad(loss(jaxmp.autocast(bn.apply)), (0, 1))(v["params"], x)
  assert {a.dtype for a in jax.tree.leaves(g)} == {jnp.dtype(F32)}
  assert gx.dtype == F16
  g32 = jax.grad(loss(bn.apply))(v["params"], x.astype(F32))
  # d bias = sum(c), d scale = sum(c * x_hat) over n = 18 values per channel;
  # under autocast the cotangent c reaches the layer rounded to fp16 (the
  # output is fp16), then the sums run in fp32.
  x64 = np.asarray(x, np.float64)
  xhat = (x64 - x64.mean((0, 1, 2))) / np.sqrt(x64.var((0, 1, 2)) + 1e-5)
  ac = np.abs(np.asarray(c, np.float64))
  per_term = U[jnp.dtype(F16)] + 21 * 2.0**-24
  tol_bias = per_term * ac.sum((0, 1, 2))
  # (and x_hat itself carries the fp32 statistics' error, _bn_stats_tol)
  tol_scale = (per_term * ac * np.abs(xhat) + ac * _bn_stats_tol(x64, 18)).sum(
    (0, 1, 2)
  )
  assert_within(g["bias"], g32["bias"], tol_bias)
  assert_within(g["scale"], g32["scale"], tol_scale)
  # dx = rstd (c - mean(c) - x_hat mean(c x_hat)) (scale = 1), from the same
  # fp16 cotangent: each |term| carries per_term, x_hat the statistics'
  # error; gx itself is rounded to fp16 (u |dx|).
  gx32 = jax.grad(loss(bn.apply), 1)(v["params"], x.astype(F32))
  rstd = 1 / np.sqrt(x64.var((0, 1, 2)) + 1e-5)
  mean_c = ac.mean((0, 1, 2))
  mean_cx = (ac * np.abs(xhat)).mean((0, 1, 2))
  stats = _bn_stats_tol(x64, 18)
  tol_x = rstd * (
    per_term * (ac + mean_c + np.abs(xhat) * mean_cx)
    + stats * mean_cx
    + np.abs(xhat) * (ac * stats).mean((0, 1, 2))
  ) + U[jnp.dtype(F16)] * np.abs(np.asarray(gx32, np.float64))
  assert_within(gx, gx32, tol_x)


def _saved_bytes(f, *args):
  """Bytes of each distinct residual ``jax.vjp(f, *args)`` keeps, by dtype."""
  closed, shape = jax.make_jaxpr(lambda *a: jax.vjp(f, *a), return_shape=True)(
    *args
  )
  j = closed.jaxpr
  n = len(jax.tree.leaves(shape[1]))
  seen, out = set(), {}
  for v in j.outvars[len(j.outvars) - n :]:
    if not hasattr(v, "val"):
      if v in seen or v in j.invars:
        continue
      seen.add(v)
    d = str(v.aval.dtype)
    out[d] = out.get(d, 0) + v.aval.size * jnp.dtype(v.aval.dtype).itemsize
  return out


@pytest.mark.parametrize("fused", [False, True])
def test_conv_bn_relu_add_block_saves_half_residuals(fused):
  nn = pytest.importorskip("flax.linen")
  jnn = pytest.importorskip("jaxmp.nn")

  class Block(nn.Module):
    """Stem conv-BN-ReLU; conv-BN-ReLU, conv-BN, + skip, ReLU; conv."""

    dtype: Any = None

    @nn.compact
    def __call__(self, x):
      conv = functools.partial(
        nn.Conv, 4, (3, 3), use_bias=False, dtype=self.dtype
      )
      bn = functools.partial(
        jnn.BatchNorm, use_running_average=False, dtype=self.dtype
      )
      x = nn.relu(bn()(conv()(x)))  # the skip input is half too
      h = nn.relu(bn()(conv()(x)))
      if fused:  # as jaxmp.models does: the add and ReLU inside BatchNorm
        y = bn()(conv()(h), residual=x, relu=True)
      else:
        y = nn.relu(bn()(conv()(h)) + x)
      return conv()(y)  # the next block's conv saves y too: once, in half

  x = jnp.linspace(-1, 1, 2 * 4 * 4 * 3).reshape(2, 4, 4, 3)
  auto, hand = Block(), Block(dtype=F16)
  v = auto.init(jax.random.key(0), x)

  def run(m, x):
    return lambda p: m.apply({**v, "params": p}, x, mutable=["batch_stats"])[0]

  fa = jaxmp.autocast(run(auto, x))
  assert fa(v["params"]).dtype == F16
  got = _saved_bytes(fa, v["params"])
  want = _saved_bytes(run(hand, x.astype(F16)), v["params"])
  # fp32 residuals: only per-channel vectors (mean, rstd, scale, bias).
  assert got.get("float32", 0) <= 3 * 4 * 4 * 4, got
  assert sum(got.values()) <= sum(want.values()), (got, want)


# ---------------------------------------------------------------------------
# The debug report.


def _attention(wqkv, x):
  qkv = x @ wqkv
  q, k, v = jnp.split(qkv, 3, axis=-1)
  s = q @ k.T / 2.0  # with wqkv x60, q and k fit fp16 but these products do not
  return jax.nn.softmax(s, axis=-1) @ v


_SCORES_LINE = _attention.__code__.co_firstlineno + 3


def _overflowing():
  w = jax.random.normal(jax.random.key(0), (4, 12)) * 60.0
  x = jax.random.normal(jax.random.key(1), (6, 4)) * 40.0
  return w, x


def test_debug_reports_the_first_overflow_under_jit(caplog):
  w, x = _overflowing()
  assert np.isfinite(np.asarray(_attention(w, x))).all()  # fine in fp32
  qkv = np.asarray(x @ w)
  assert np.abs(qkv).max() < 65504  # the projection fits fp16...
  q, k = qkv[:, :4], qkv[:, 4:8]
  assert np.abs(q @ k.T).max() > 65504  # ...the attention scores do not
  reports = []
  f = jax.jit(jaxmp.autocast(_attention, debug=reports.append))
  with caplog.at_level(logging.WARNING, logger="jaxmp"):
    out = jax.block_until_ready(f(w, x))
  assert not np.isfinite(np.asarray(out)).all()
  assert len(reports) == 1
  rep = reports[0]
  assert isinstance(rep, jaxmp.AutocastReport)
  assert rep.primitive == "dot_general"
  assert rep.source.endswith(f"test_autocast.py:{_SCORES_LINE} (_attention)")
  assert rep.dtype == "float16"
  assert str(rep) in caplog.text


def test_debug_names_the_flax_module():
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(12, name="qkv")(x * 400.0)
      return jnp.tanh(h)

  w, x = _overflowing()
  block = Block()
  v = block.init(jax.random.key(0), x)
  v = jax.tree.map(lambda a: a * 60.0, v)
  reports = []
  jaxmp.autocast(block.apply, debug=reports.append)(v, x)
  (rep,) = reports
  assert rep.primitive == "dot_general"
  assert "qkv" in rep.name_stack, rep


def test_debug_is_silent_when_finite_and_free_when_off():
  reports = []
  f = jaxmp.autocast(_attention, debug=reports.append)
  w, x = _overflowing()
  out = f(w / 60.0, x / 40.0)  # no overflow
  assert np.isfinite(np.asarray(out)).all()
  assert reports == []
  off = jax.make_jaxpr(jaxmp.autocast(_attention))(*_overflowing())
  names = {e.primitive.name for e in eqns(off)}
  assert "debug_callback" not in names and "is_finite" not in names
  on = jax.make_jaxpr(jaxmp.autocast(_attention, debug=True))(*_overflowing())
  assert len(eqns(on, "debug_callback")) == 1


# ---------------------------------------------------------------------------
# The private interpreter, one test per primitive family: evaluating a
# jaxpr through `_jaxpr_interp` with no rules gives the original values.


def _identity_eval(jaxpr, args):
  def handle(eqn, invals, inweak):
    k = ji.kind(eqn)
    body = lambda j, a: _identity_eval(j, a)  # noqa: E731
    if k == "jit":
      outs = ji.run_jit(eqn, invals, body)
    elif k == "call":
      outs = ji.run_call(eqn, invals, body)
    elif k == "remat":
      outs = ji.run_remat(eqn, invals, body)
    elif k == "cond":
      outs = ji.run_cond(eqn, invals, body, lambda ds: ds[0])
    elif k == "scan":
      outs = ji.run_scan(eqn, invals, body)
    elif k == "while":
      outs = ji.run_while(eqn, invals, body)
    elif k == "shard_map":
      outs = ji.run_shard_map(eqn, invals, body)
    elif k == "custom_jvp":
      outs = jc.run_custom_jvp(eqn, invals, body, list)
    elif k == "custom_vjp":
      outs = jc.run_custom_vjp(eqn, invals, body, list)
    else:
      outs = ji.bind(eqn, invals)
    return outs, [False] * len(outs)

  return ji.evaluate(jaxpr, args, handle)[0]


# Closed over by custom rules: not a literal, so their traced rules carry it
# as a constant, which the interpreter must hand back to them.
_SLOPES = np.linspace(0.5, 2.0, 8).astype(np.float32)


@jax.custom_jvp
def _sloped_tanh(x):
  return jnp.tanh(x)


_sloped_tanh.defjvp(
  lambda p, t: (_sloped_tanh(p[0]), jnp.asarray(_SLOPES) * t[0])
)


@jax.custom_vjp
def _weighted(x):
  return x * jnp.asarray(_SLOPES)


_weighted.defvjp(
  lambda x: (x * jnp.asarray(_SLOPES), None),
  lambda _, g: (g * jnp.asarray(_SLOPES) * 2.0,),
)

_P = jax.sharding.PartitionSpec
_FAMILIES = {
  "jit": lambda x: jax.jit(jnp.sin)(x),
  "remat": lambda x: jax.checkpoint(jnp.sin)(x),
  "cond": lambda x: lax.cond(x[0] > 0, jnp.sin, jnp.cos, x),
  "scan": lambda x: lax.scan(lambda c, a: (c + a, c * a), 0.0, x)[1],
  "while": lambda x: lax.while_loop(
    lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x)
  )[1],
  "shard_map": lambda x: jax.shard_map(
    lambda a: lax.psum(a, "data"),
    mesh=_mesh(),
    in_specs=_P("data"),
    out_specs=_P(),
  )(x),
  "custom_jvp": jax.nn.relu,
  "custom_vjp": lambda x: _clip_cotangent(x) * 3,
  "custom_jvp+consts": _sloped_tanh,
  "custom_vjp+consts": _weighted,
}


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_interpreter_family(family):
  fn = _FAMILIES[family]
  x = jnp.linspace(-1.0, 2.0, 8)
  jp = jax.make_jaxpr(fn)(x)
  kinds = {ji.kind(e) for e in jp.eqns}
  assert family.split("+")[0] in kinds, kinds
  np.testing.assert_allclose(_identity_eval(jp, [x])[0], fn(x), rtol=1e-6)
  # Re-emitted bodies differentiate as the originals do.
  if family != "while":
    grad = jax.grad(lambda x: jnp.sum(_identity_eval(jp, [x])[0] ** 2))(x)
    np.testing.assert_allclose(
      grad, jax.grad(lambda x: jnp.sum(fn(x) ** 2))(x), rtol=1e-6
    )


def test_interpreter_describe_and_trace():
  jp = ji.trace(lambda a: [jnp.sin(a)], [ji.typeof(X)])
  (e,) = jp.eqns
  d = ji.describe(e)
  assert d.primitive == "sin" and "test_autocast.py" in d.source
  assert ji.kind(e) is None and ji.call_name(e) == ""


def _two_overflows(w, x):
  a = x @ w  # first
  b = (x * 2.0) @ w  # second
  return a + b


def test_debug_reports_the_first_of_two_overflows():
  reports = []
  w = jnp.full((4, 4), 300.0)
  x = jnp.full((2, 4), 100.0)  # 4 * 3e4 = 1.2e5 > 65504, both products
  jaxmp.autocast(_two_overflows, debug=reports.append)(w, x)
  (rep,) = reports
  line = _two_overflows.__code__.co_firstlineno + 1
  assert rep.source.endswith(f":{line} (_two_overflows)"), rep


_NHWC = ("NHWC", "HWIO", "NHWC")


def _conv(x, k):
  return lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=_NHWC)


def _conv_dk_tol(x, k):
  """Per-entry bound on dK of sum(tanh(conv(x, k))) under fp16 autocast.

  dK sums terms x * dy (dy = 1 - tanh(c)^2, c = conv(x, k)) over 32
  positions: x and dy are rounded to half, and the sum rounds once per term
  and once to half: (3 + 32 + 2) units of 2**-11 of sum |x| |dy|. The half
  c is off by <= (27 + 2) u conv(|x|, |k|) (27 terms), which moves dy by at
  most 2 |tanh(c)| times that, summed against |x|.
  """
  u = U[jnp.dtype(F16)]
  with jax.enable_x64(True):
    x64 = jnp.asarray(np.asarray(x, np.float64))
    k64 = jnp.asarray(np.asarray(k, np.float64))
    t = jnp.tanh(_conv(x64, k64))
    dc = (27 + 2) * u * _conv(jnp.abs(x64), jnp.abs(k64))
    _, vjp = jax.vjp(lambda k: _conv(jnp.abs(x64), k), k64)
    (terms,) = vjp(1 - t**2)
    (moved,) = vjp(2 * jnp.abs(t) * dc)
    return np.asarray((3 + 32 + 2) * u * terms + moved)


@jax.custom_vjp
def _conv_saving_inputs(x, k):
  return _conv(x, k)


def _conv_fwd(x, k):
  return _conv(x, k), (x, k)


def _conv_bwd(res, dy):
  # As jaxmp.nn's conv: the rule differentiates the plain conv itself, whose
  # jax.vjp insists that dy has the dtype the conv of these residuals has.
  x, k = res
  _, vjp = jax.vjp(_conv, x, k)
  return vjp(dy)


_conv_saving_inputs.defvjp(_conv_fwd, _conv_bwd)


def test_custom_vjp_of_a_product_saves_half_inputs_and_runs_its_rule_in_half():
  x = jnp.linspace(-1.0, 1.0, 2 * 4 * 4 * 3).reshape(2, 4, 4, 3)
  k = jnp.linspace(-0.5, 0.5, 3 * 3 * 3 * 2).reshape(3, 3, 3, 2)

  def f(k, x):
    return jnp.sum(jnp.tanh(_conv_saving_inputs(x, k)))

  g = jaxmp.autocast(f)
  # The inputs only feed the conv: cast at the boundary, saved in half.
  res = _residuals(lambda k: g(k, x), k)
  assert (x.shape, "float16") in res and (x.shape, "float32") not in res, res
  # The bwd rule's convolutions run in half too.
  jp = jax.make_jaxpr(jax.grad(g))(k, x)
  assert len(products(jp)) >= 3  # forward, dx, dk (and the rule's primal)
  assert_all_half(jp)
  got, want = jax.grad(g)(k, x), jax.grad(f)(k, x)
  assert got.dtype == F32
  assert_within(got, want, _conv_dk_tol(x, k))


@jax.custom_vjp
def _conv_plus_mean(x, k):
  return _conv(x, k) + jnp.mean(x)


def _conv_plus_mean_fwd(x, k):
  return _conv_plus_mean(x, k), (x, k)


def _conv_plus_mean_bwd(res, dy):
  x, k = res
  _, vjp = jax.vjp(lambda x, k: _conv(x, k) + jnp.mean(x), x, k)
  return vjp(dy)


_conv_plus_mean.defvjp(_conv_plus_mean_fwd, _conv_plus_mean_bwd)


def test_custom_vjp_bwd_rule_runs_under_autocast():
  # x also feeds a mean: it reaches the rule in fp32, and the rule's own
  # transposed convolutions are still made half by autocast.
  x = jnp.linspace(-1.0, 1.0, 2 * 4 * 4 * 3).reshape(2, 4, 4, 3)
  k = jnp.linspace(-0.5, 0.5, 3 * 3 * 3 * 2).reshape(3, 3, 3, 2)

  def f(k, x):
    return jnp.sum(jnp.tanh(_conv_plus_mean(x, k)))

  g = jaxmp.autocast(f)
  jp = jax.make_jaxpr(jax.grad(g, argnums=(0, 1)))(k, x)
  assert len(products(jp)) >= 3
  assert_all_half(jp)
  got, want = jax.grad(g)(k, x), jax.grad(f)(k, x)
  assert_within(got, want, _conv_dk_tol(x, k))  # the mean adds nothing to dK


@jax.custom_vjp
def _product_sz(a, b):
  return a * b


def _product_sz_fwd(a, b):
  return _product_sz(a.value, b.value), (a.value, b.value)


def _product_sz_bwd(res, g):
  a, b = res
  return g * b, g * a


_product_sz.defvjp(_product_sz_fwd, _product_sz_bwd, symbolic_zeros=True)


@jax.custom_jvp
def _relu_sz(x):
  return jnp.maximum(x, 0.0)


_relu_sz.defjvp(lambda p, t: (_relu_sz(p[0]), 2.0 * t[0]), symbolic_zeros=True)


def test_custom_rules_with_symbolic_zeros():
  x = jnp.linspace(0.0, 1.0, 6).reshape(2, 3)
  w = jnp.ones((3, 4))

  def f(w, x):
    h = x @ w
    return jnp.sum(_product_sz(h, h + 1.0)) + jnp.sum(_relu_sz(h))

  got = jax.grad(jaxmp.autocast(f))(w, x)
  # d/dw: x^T (2 h + 1) from the product, x^T 2 from the (doubled) relu.
  # Error: 5u |x| |dh| rounding the last product, plus |x| 2 (3 + 3) u |h|
  # from the rounded h, <= 6u |x| |dh| as |dh| > 2 |h|: 3x matmul_tol.
  h = x @ w
  dh = 2 * h + 1 + 2.0
  assert_within(got, x.T @ dh, matmul_tol(x.T, 3 * jnp.abs(dh)))
