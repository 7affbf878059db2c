"""jaxmp.autocast(fp8="mxfp8" | "deepseek" | "nvfp4" | BlockRecipe(...)).

Each recipe's product and both its backward products against a hand
emulation: the operands quantized with ``block.fake_quantize`` along the
axes TransformerEngine uses (the forward's contraction; the output features
for the input gradient; the batch for the weight gradient, with NVFP4's
Hadamard rotation there), then multiplied in float64. The quantizer itself
is checked bit for bit against numpy in its own tests.
"""

import dataclasses
import functools
import os
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxmp
from jaxmp._src.autocast import block
from jaxmp._src.autocast import block_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32_EPS = 2.0**-24
M, K, N = 32, 256, 160  # x: (M, K) @ w: (K, N); M: two Hadamard blocks.
RECIPES = {
  "mxfp8": jaxmp.BlockRecipe.mxfp8(),
  "mxfp8_e5m2": jaxmp.BlockRecipe.mxfp8(gradient="mxfp8_e5m2"),
  "deepseek": jaxmp.BlockRecipe.deepseek(),
  "nvfp4": jaxmp.BlockRecipe.nvfp4(stochastic_rounding=False),
}


def _data(seed=0):
  """x, w, c with outlying rows and columns.

  Columns of x and rows of w (along the forward's contraction) spread over
  2**+-12: a block along that axis flushes its small elements to fp8's
  subnormals, a block across it does not, so even MXFP8's power-of-two
  scales give other values along the other axis.
  """
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(M, K)) * np.exp(rng.normal(size=(M, 1)))
  x *= np.exp(3 * rng.normal(size=(1, K)))
  w = rng.normal(size=(K, N)) * np.exp(rng.normal(size=(1, N)))
  w *= np.exp(3 * rng.normal(size=(K, 1)))
  c = rng.normal(size=(M, N)) * np.exp(rng.normal(size=(1, N)))
  # c in bf16's values: the product's cotangent (bf16) is c itself.
  c = np.asarray(c, jnp.bfloat16)
  return [np.asarray(a, np.float32) for a in (x, w, c)]


def _loss(x, w, c):
  out = x @ w  # bf16 under autocast
  return jnp.sum(out * c), out


@functools.lru_cache(maxsize=None)
def _grad(recipe):
  f = jaxmp.autocast(_loss, fp8=recipe)
  return jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))


_fake_quantize = jax.jit(block.fake_quantize, static_argnames=("fmt", "axis"))


def _q(x, fmt, axis):
  return np.asarray(_fake_quantize(x, fmt, axis=axis), np.float64)


def _rotated(x, m):
  """``x`` rotated along axis 0 in blocks of m's size (x' = R^T x)."""
  n = m.shape[0]
  r = np.kron(np.eye(x.shape[0] // n), m.astype(np.float64))
  return (r.T @ x.astype(np.float64)).astype(np.float32)


def _emulate(recipe, x, w, c, transposed_codes=False):
  """The (lhs, rhs) of TransformerEngine's out, dx and dw, dequantized."""
  act, wt, gr = recipe.activation, recipe.weight, recipe.gradient
  out = (_q(x, act, 1), _q(w, wt, 0))
  # Input gradient: over the output features (w's axis 1).
  w_bwd = _q(w, wt, 0) if transposed_codes else _q(w, wt, 1)
  dx = (_q(c, gr, 1), w_bwd.T)
  # Weight gradient: over the batch (axis 0 of x and c), rotated for NVFP4.
  if recipe.hadamard:
    m = block_recipe.hadamard_matrix(recipe.hadamard, recipe.seed)
    x, c = _rotated(x, m), _rotated(c, m)
  x_bwd = _q(x, act, 1) if transposed_codes else _q(x, act, 0)
  dw = (x_bwd.T, _q(c, gr, 0))
  return out, dx, dw


def _errors(got, pair, terms=None, slack=0.0):
  """|got - a @ b| and its float32 rounding bound (|a| |b| times terms)."""
  a, b = pair
  bound = (np.abs(a) @ np.abs(b)) * (terms or a.shape[1]) * 2 * F32_EPS
  return np.abs(np.asarray(got, np.float64) - a @ b), bound + slack + 1e-30


def _close(got, pair, terms=None, slack=0.0):
  """``got`` is ``a @ b`` within float32 rounding.

  Hadamard-rotated operands, rotated back before the product, round a few
  more times per term: in ``terms``.
  """
  err, bound = _errors(got, pair, terms, slack)
  assert np.all(err <= bound), np.max(err - bound)


def _far(got, pair, terms=None):
  """``got`` is not ``a @ b`` within the rounding of `_close`."""
  err, bound = _errors(got, pair, terms)
  return np.any(err > bound)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_forward_and_backward_are_the_recipes_emulation(name):
  recipe = RECIPES[name]
  x, w, c = _data()
  (_, out), (dx, dw) = _grad(recipe)(x, w, c)
  assert out.dtype == jnp.bfloat16
  assert dx.dtype == dw.dtype == jnp.float32  # fp32 inputs: fp32 gradients
  eo, ex, ew = _emulate(recipe, x, w, c)
  # The float32 product, rounded to bf16 (unit roundoff 2**-8).
  _close(out, eo, slack=np.abs(eo[0] @ eo[1]) * 2.0**-8)
  _close(dx, ex)
  # The rotation and its inverse: 2 x 16 more roundings per term.
  _close(dw, ew, terms=M + 64 if recipe.hadamard else None)
  # Not the forward codes transposed: re-quantized along the new axis.
  _, tx, tw = _emulate(recipe, x, w, c, transposed_codes=True)
  assert _far(dw, tw, terms=M + 64 if recipe.hadamard else None)
  if block_recipe.FORMATS[recipe.weight][0] == 1:  # 2D: the same either way.
    assert _far(dx, tx)
  # The element formats in the program: e5m2 only for an e5m2 gradient
  # (used by the backward products alone), e2m1 only for NVFP4.
  jaxpr = str(jax.make_jaxpr(_grad(recipe))(x, w, c))
  assert ("f8_e5m2" in jaxpr) == (recipe.gradient == "mxfp8_e5m2")
  assert ("f4_e2m1fn" in jaxpr) == (recipe.gradient == "nvfp4")
  assert ("f8_e4m3fn" in jaxpr) is True  # also NVFP4's block scales
  # A power-of-two loss scale scales the gradient codes exactly (mxfp8's
  # power-of-two scales, deepseek's amax / 448).
  if recipe.weight != "nvfp4_16x16":
    _, (sx, sw) = _grad(recipe)(x, w, c * 1024)

    np.testing.assert_array_equal(np.asarray(sx), np.asarray(dx) * 1024)
    np.testing.assert_array_equal(np.asarray(sw), np.asarray(dw) * 1024)


def test_nvfp4_rounds_gradients_stochastically_from_the_data():
  x, w, c = _data()
  (_, out), (dx, dw) = _grad(jaxmp.BlockRecipe.nvfp4())(x, w, c)
  (_, out2), (dx2, dw2) = _grad("nvfp4")(x, w, c)
  # The string is the preset; no key to pass, the same gradients.
  assert jaxmp.BlockRecipe.nvfp4() == jaxmp.BlockRecipe.nvfp4()
  for a, b in ((out, out2), (dx, dx2), (dw, dw2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Against round-to-nearest (the same recipe otherwise): the forward is
  # the same, the gradients are not, and their error against the
  # unquantized cotangent is of the same size.
  (_, out_n), (dx_n, _) = _grad(RECIPES["nvfp4"])(x, w, c)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(out_n))
  assert np.any(np.asarray(dx) != np.asarray(dx_n))
  exact = c.astype(np.float64) @ _q(w, "nvfp4_16x16", 1).T
  err_sr = np.linalg.norm(np.asarray(dx) - exact)
  err_rn = np.linalg.norm(np.asarray(dx_n) - exact)
  assert 0.5 * err_rn < err_sr < 3 * err_rn
  # The seed comes from the cotangent's bits: another cotangent, other
  # rounding choices (its gradient is not the first one's, scaled).
  _, (dx3, _) = _grad("nvfp4")(x, w, c * 2)
  assert np.any(np.asarray(dx3) != 2 * np.asarray(dx))


def test_recipe_fields_and_presets():
  mx, ds, fp4 = (getattr(jaxmp.BlockRecipe, n)() for n in block_recipe.PRESETS)
  assert mx.block_shapes == {
    "activation": (1, 32),
    "weight": (1, 32),
    "gradient": (1, 32),
  }
  assert ds.block_shapes["weight"] == (128, 128)
  assert (
    ds.block_shapes["activation"] == ds.block_shapes["gradient"] == (1, 128)
  )
  assert fp4.weight == "nvfp4_16x16" and fp4.gradient == "nvfp4"
  assert fp4.stochastic_rounding and fp4.hadamard == 16
  assert not (mx.stochastic_rounding or ds.stochastic_rounding or mx.hadamard)
  assert jaxmp.BlockRecipe.mxfp8(gradient="mxfp8_e5m2").gradient == "mxfp8_e5m2"
  assert jaxmp.BlockRecipe.nvfp4(keep="head").keep == ("head",)
  with pytest.raises(ValueError, match="activation"):
    jaxmp.BlockRecipe(activation="fp8")
  with pytest.raises(ValueError, match="gradient"):
    jaxmp.BlockRecipe(gradient="fp8_128x128")
  with pytest.raises(ValueError, match="hadamard"):
    jaxmp.BlockRecipe(hadamard=12)
  with pytest.raises(TypeError, match="BlockRecipe"):
    jaxmp.autocast(jnp.matmul, fp8="fp4")
  m = block_recipe.hadamard_matrix(16, 0)
  np.testing.assert_allclose(m @ m.T, np.eye(16), atol=1e-6)
  assert len(set(np.sign(m[:, 0]))) == 2  # random signs


def _two_layers(x, w1, w2):
  h = jnp.tanh(x @ w1)  # bf16: an activation
  with jax.named_scope("head"):
    return h @ w2, h


def test_weight_role_and_kept_products():
  """Deepseek's 128x128 blocks for the weight, on either side.

  A product whose name stack matches ``keep`` runs in bf16, unquantized.
  """
  x, w, _ = _data()
  rng = np.random.default_rng(1)
  w2 = np.asarray(rng.normal(size=(N, 48)) * 8, np.float32)
  recipe = jaxmp.BlockRecipe.deepseek(keep=("head",))
  out, h = jax.jit(jaxmp.autocast(_two_layers, fp8=recipe))(x, w, w2)
  assert out.dtype == h.dtype == jnp.bfloat16
  # The kept product: bf16 operands, as plain autocast multiplies them.
  pair = (np.asarray(h, np.float64), np.asarray(w2.astype(jnp.bfloat16), float))
  _close(out, pair, slack=np.abs(pair[0] @ pair[1]) * 2.0**-8)
  # The weight on the left (w^T x^T), only it from the inputs.
  xb = jnp.asarray(x, jnp.bfloat16)
  f = jax.jit(jaxmp.autocast(lambda w, x: w.T @ jnp.tanh(x).T, fp8="deepseek"))
  got = f(w, xb)
  t = np.asarray(jnp.tanh(xb), np.float32)
  pair = (_q(w.T, "fp8_128x128", 1), _q(t.T, "fp8_1x128", 0))
  _close(got, pair, slack=np.abs(pair[0] @ pair[1]) * 2.0**-8)
  assert _far(got, (_q(w.T, "fp8_1x128", 1), pair[1]))


def _chain(ws, x):
  for w in ws:
    x = (x @ w).astype(jnp.float32)
  return jnp.sum(x * x)


def _scanned(ws, x):
  body = jax.checkpoint(lambda x, w: ((x @ w).astype(jnp.float32), None))
  return jnp.sum(jnp.square(jax.lax.scan(body, x, ws)[0]))


def test_scan_and_remat_give_the_unrolled_chains_gradients():
  rng = np.random.default_rng(2)
  ws = jnp.asarray(rng.normal(size=(2, 32, 32)) / 6, jnp.float32)
  x = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
  grads = [
    jax.jit(jax.grad(jaxmp.autocast(f, fp8="mxfp8"), (0, 1)))(ws, x)
    for f in (_chain, _scanned)
  ]
  for a, b in zip(*grads):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(a).max())


def test_shard_map_over_the_batch_is_one_device_and_non_finite_propagates():
  """One device's gradients from 4 shards of 32 rows.

  MXFP8's blocks of 32 rows per shard are the whole batch's blocks, so only
  the weight gradient's cross-shard sum order differs.
  """
  x, w, c = _data()
  x = np.concatenate([x] * 4)[:, :64].astype(jnp.bfloat16)  # 128 rows
  w, c = w[:64], np.concatenate([c] * 4)
  mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))

  def local(x, w, c):
    return jax.lax.psum(_loss(x, w, c)[0], "d")

  sharded = jax.shard_map(
    local, mesh=mesh, in_specs=(P("d"), P(), P("d")), out_specs=P()
  )
  grads = [
    jax.jit(jax.grad(jaxmp.autocast(f, fp8="mxfp8"), (0, 1)))(x, w, c)
    for f in (lambda *a: _loss(*a)[0], sharded)
  ]
  (dx1, dw1), (dx4, dw4) = grads
  assert dx1.dtype == dx4.dtype == jnp.bfloat16  # in the inputs' dtypes
  assert dw1.dtype == dw4.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(dx1), np.asarray(dx4))
  bound = np.abs(np.asarray(x, np.float64)).T @ np.abs(c) * 128 * 4 * F32_EPS
  assert np.all(np.abs(np.asarray(dw1) - np.asarray(dw4)) <= bound)
  # A non-finite operand: non-finite gradients (mixed_precision skips).
  x, w, c = _data()
  x[3, 5] = np.inf
  _, (dx, dw) = _grad(RECIPES["mxfp8"])(x, w, c)
  assert not np.any(np.isfinite(np.asarray(dw)))


def test_block_scaled_mlp_example_runs(capsys):
  ns = runpy.run_path(
    os.path.join(ROOT, "examples", "block_scaled_mlp.py"), run_name="x"
  )
  args = "--steps 2 --width 32 --batch-size 16 --recipes nvfp4".split()
  finals = ns["main"](args)
  assert sorted(finals) == ["bf16", "nvfp4"]
  assert all(np.isfinite(v) for v in finals.values())
  assert finals["bf16"] != finals["nvfp4"]  # trained and evaluated in fp4
  assert "nvfp4: final loss" in capsys.readouterr().out


@pytest.mark.skipif(
  not block_recipe.native_available(cpu=True),
  reason="jax.nn.scaled_dot_general lowers on CPU from jax 0.11",
)
def test_native_mxfp8_products_equal_the_emulation():
  """``native=True``: MXFP8 forward products through jax.nn's, same values.

  The operands it receives are MXFP8 values already, which its quantizer
  maps to themselves; the product (bf16) and both gradients equal the
  emulation's bit for bit (jax >= 0.11 on CPU, CI's newest venv; the
  backward products stay emulated).
  """
  x, w, c = _data()
  got = {}
  for native in (False, True):
    recipe = dataclasses.replace(RECIPES["mxfp8"], native=native)
    f = jaxmp.autocast(_loss, fp8=recipe)
    step = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    text = step.lower(x, w, c).as_text()
    assert ("scaled_matmul" in text) == native  # jax.nn's, inlined
    got[native] = step(x, w, c)
  for a, b in zip(*map(jax.tree.leaves, (got[False], got[True]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
