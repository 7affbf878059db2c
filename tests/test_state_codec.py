"""``optimizer_state="bf16"``/``"int8"``: the inner state stored encoded.

The 8-bit code against a numpy reference (``ml_dtypes``' float8_e4m3fn
casts, written out block by block), its error bound per block, its corner
cases, stochastic rounding's bias (float8 subnormals included); then the
codec inside `jaxmp.mixed_precision`: the rounding its step encodes with,
which leaves it encodes, their bytes, a skipped step, a checkpoint, and
Adam, SGD momentum, Lion and Adafactor on a small regression task against
fp32 state.
"""

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from _helpers import backend_compiles

import jaxmp
from jaxmp._src.state import state_codec

F8 = ml_dtypes.float8_e4m3fn
BF16 = jnp.bfloat16


def _reference(x: np.ndarray, block: int):
  """The 8-bit code of the module docstring, in numpy: (codes, scales)."""
  x = np.asarray(x, np.float32)
  lead, last = x.shape[:-1], x.shape[-1]
  block = min(block, last)
  padded = -(-last // block) * block
  v = np.zeros(lead + (padded,), np.float32)
  v[..., :last] = x
  v = v.reshape(lead + (padded // block, block))
  finite = np.isfinite(v)
  absmax = np.max(np.where(finite, np.abs(v), 0), axis=-1)
  with np.errstate(divide="ignore"):
    inv = np.where(absmax > 0, np.float32(256) / absmax, 0).astype(np.float32)
  inv = np.where(np.isfinite(inv), inv, 0).astype(np.float32)
  with np.errstate(invalid="ignore"):
    y = np.clip(v * inv[..., None], -256, 256)
  code = y.astype(F8)
  floor = np.where(v < 0, -(2.0**-9), 2.0**-9).astype(F8)
  code = np.where((code.astype(np.float32) == 0) & (v != 0), floor, code)
  code = np.where(finite, code, np.array(np.nan, F8))
  return code.view(np.int8).reshape(lead + (padded,)), absmax


def _roundtrip(x, block=256):
  e = jax.jit(lambda x: state_codec.encode_int8(x, block))(jnp.asarray(x))
  return e, np.asarray(state_codec.decode(e))


def _check_bound(x, dec, scale, block):
  """Each finite element within max(2**-4 |x|, 2**-17 * its block's absmax)."""
  x = np.asarray(x, np.float64)
  last = x.shape[-1]
  per_elem = np.repeat(scale, min(block, last), axis=-1)[..., :last]
  finite = np.isfinite(x)
  bound = np.maximum(2.0**-4 * np.abs(x), 2.0**-17 * per_elem)
  err = np.abs(dec.astype(np.float64) - x)
  assert np.all(err[finite] <= bound[finite])
  # Signs kept, and a nonzero element never decodes to zero.
  assert np.all((dec[finite] != 0) == (x[finite] != 0))
  assert np.all(np.sign(dec[finite]) == np.sign(x[finite]))


def test_int8_code_matches_the_numpy_reference_and_its_bound():
  rng = np.random.default_rng(0)
  # Rows of blocks whose magnitudes span 8 decades; a last axis of 300 is
  # padded to two blocks of 256.
  x = rng.normal(size=(6, 300)) * 10.0 ** rng.uniform(-6, 2, (6, 300))
  x = x.astype(np.float32)
  e, dec = _roundtrip(x)
  codes, scales = _reference(x, 256)
  np.testing.assert_array_equal(np.asarray(e.data), codes)
  np.testing.assert_array_equal(np.asarray(e.scale), scales)
  assert e.data.dtype == jnp.int8 and e.data.shape == (6, 512)
  assert dec.shape == x.shape and dec.dtype == np.float32
  _check_bound(x, dec, np.asarray(e.scale), 256)
  # Down to 2**-14 of the block's largest magnitude: 2**-4 relative.
  big = np.abs(x) >= 2.0**-14 * np.repeat(np.asarray(e.scale), 256, 1)[:, :300]
  assert 0.3 < np.mean(big) < 0.95  # Both sides of it are tested.
  assert np.all(np.abs(dec - x)[big] <= 2.0**-4 * np.abs(x)[big])


def test_int8_zeros_infs_nans_and_one_huge_value():
  x = np.ones((4, 64), np.float32)
  x[0] = 0.0  # A block of zeros.
  x[1, :8] = [np.inf, -np.inf, np.nan, 0.0, 3.0, -2.0, 1e-3, 5.0]
  x[2, 5] = 1e30  # One huge value: its block's others hit the floor.
  x[2, 6] = -1.0
  x[3] = np.linspace(-1, 1, 64)
  e, dec = _roundtrip(x, block=64)
  codes, scales = _reference(x, 64)
  np.testing.assert_array_equal(np.asarray(e.data), codes)
  np.testing.assert_array_equal(np.asarray(e.scale), scales)
  np.testing.assert_array_equal(dec[0], 0.0)
  assert np.all(np.isnan(dec[1, :3]))  # Non-finite: NaN, never finite.
  assert np.asarray(e.scale)[1, 0] == 5.0  # The finite ones'.
  np.testing.assert_allclose(dec[1, 3:8], x[1, 3:8], rtol=2.0**-4)
  assert dec[2, 5] == np.float32(1e30)
  assert dec[2, 6] == np.float32(-1e30) * np.float32(2.0**-17)
  assert np.all(dec[2, 7:] > 0)  # Floored, not zero.
  np.testing.assert_allclose(dec[3], x[3], rtol=2.0**-4, atol=2.0**-17)
  _check_bound(x, dec, np.asarray(e.scale), 64)


# Values between two neighbouring float8 codes, in units of the subnormals'
# step 2**-9 (a block's absmax 1: the code of v is 256 * v): subnormals, the
# last subnormal up to the least normal, the first normal binade (the same
# step), the next (step 2), and 76.8 * 2**9 (step 8 * 2**9: 0.3).
SUBNORMAL_STEPS = (1.7, 5.3, 7.6, 10.4, 18.5, 76.8 * 2**9)


def _f8_neighbours(y):
  """float8_e4m3fn's codes just below and above ``y`` > 0 (float64)."""
  exponent = np.maximum(np.floor(np.log2(y)), -6)  # Subnormals: 2**-6 on.
  step = 2.0 ** (exponent - 3)
  lo = np.floor(y / step) * step
  return lo, lo + step


def _check_unbiased(x, dec, lo, hi):
  """Each element on ``lo`` or ``hi``, both taken, the mean ``x``'s.

  An unbiased rounding takes ``hi`` with probability ``p = (x - lo) / (hi -
  lo)``: its mean error is 0 with standard error ``sqrt(sum p (1 - p) (hi -
  lo)**2) / n``; 5 of them is the tolerance (the draws are a fixed hash:
  the same on every machine).
  """
  x = np.asarray(x, np.float64)
  dec = np.asarray(dec, np.float64)
  where = f"between {lo:.6g} and {hi:.6g}"
  assert np.all((dec == lo) | (dec == hi)), (where, np.unique(dec))
  assert np.any(dec == lo) and np.any(dec == hi), (where, np.unique(dec))
  p = (x - lo) / (hi - lo)
  se = np.sqrt(np.sum(p * (1 - p) * (hi - lo) ** 2)) / x.size
  bias = np.mean(dec - x)
  assert abs(bias) <= 5 * se, f"{where}: mean error {bias:.3g}, se {se:.3g}"


def test_stochastic_rounding_is_unbiased_and_one_step_wide():
  """Rows of one value each: every element on a neighbour, the mean exact.

  The values sit between float8 subnormals, at the edge of the normals, and
  among the normals (`SUBNORMAL_STEPS`).
  """
  cases = np.asarray(SUBNORMAL_STEPS) * 2.0**-9 / 256  # With absmax 1.
  x = np.repeat(cases, -(-64 // len(cases)))[:64, None].astype(np.float32)
  x = np.repeat(x, 256, 1)
  x[:, 0] = 1.0  # absmax 1: 0.3 codes as 76.8, between 72 and 80.
  # And 8 rows (blocks) spanning 8 decades each, for the sign and the bound.
  y = np.random.default_rng(4).normal(size=(8, 256)).astype(np.float32)
  y *= 10.0 ** np.random.default_rng(5).uniform(-8, 0, y.shape)
  blocks = np.concatenate([x, y])
  e = jax.jit(lambda x: state_codec.encode_int8(x, 256, True))(blocks)
  dec, z = np.split(np.asarray(state_codec.decode(e)), [64])
  dec = dec[:, 1:]
  for case in cases.astype(np.float32):
    rows = x[:, 1] == case
    lo, hi = _f8_neighbours(np.float64(case) * 256)
    _check_unbiased(x[rows, 1:], dec[rows], lo / 256, hi / 256)
  assert set(np.unique(dec[x[:, 1] == np.float32(0.3)]).tolist()) == {
    72 / 256,
    80 / 256,
  }
  # Deterministic: the same input rounds the same way (compiled again).
  again = jax.jit(lambda x: state_codec.encode_int8(x, 256, True))(blocks)
  np.testing.assert_array_equal(again.data, e.data)
  # Never to zero, nor to the wrong sign, and within one step.
  assert np.all(np.sign(z) == np.sign(y))
  step = np.maximum(2.0**-3 * np.abs(y), 2.0**-17 * np.abs(y).max(1)[:, None])
  assert np.all(np.abs(z - y) <= step)


@pytest.mark.parametrize(
  "kind,rounding",
  [("bf16", "stochastic"), ("bf16", None), ("int8", None), ("int8", "nearest")],
)
def test_the_step_encodes_the_new_state_with_its_rounding(kind, rounding):
  """One SGD-momentum step from zeros: the new trace is the gradient.

  Every element but one per row is 0.3 (the row's absmax is 1.0), between
  two codes: rounded to nearest (bf16's default, or asked) every one is
  the nearer code; stochastically (int8's default, or asked) each is either
  code, and the mean is 0.3. The codes are those the step wrote.
  """
  codec = jaxmp.StateQuantization(
    kind, block_size=256, min_size=1024, rounding=rounding
  )
  opt = jaxmp.mixed_precision(
    optax.sgd(0.1, momentum=0.9), loss_scale=1.0, optimizer_state=codec
  )
  params = {"w": jnp.zeros((16, 256), jnp.float32)}
  g = np.full((16, 256), 0.3, np.float32)
  g[:, 0] = 1.0
  _, state = jax.jit(opt.update)(
    {"w": jnp.asarray(g)}, opt.init(params), params
  )
  leaf = state.inner_state[0].trace["w"]
  assert leaf.spec.kind == kind
  dec = np.asarray(state_codec.decode(leaf))
  np.testing.assert_array_equal(dec[:, 0], 1.0)
  if kind == "bf16":
    ulp = 2.0**-9  # bfloat16's step in [0.25, 0.5).
    lo = np.floor(0.3 / ulp) * ulp
    nearest = np.asarray(g.astype(BF16), np.float32)
  else:
    lo = 72 / 256  # 76.8 between the codes 72 and 80.
    ulp = 8 / 256
    nearest = state_codec.decode(
      state_codec.EncodedLeaf(
        _reference(g, 256)[0], np.ones((16, 1)), leaf.spec
      )
    )
  if (rounding or {"bf16": "nearest", "int8": "stochastic"}[kind]) == "nearest":
    np.testing.assert_array_equal(dec, nearest)
  else:
    _check_unbiased(g[:, 1:], dec[:, 1:], lo, lo + ulp)


def test_a_positive_second_moment_never_decodes_to_zero():
  rng = np.random.default_rng(1)
  nu = (10.0 ** rng.uniform(-30, 0, (16, 256))).astype(np.float32)
  nu[:, 0] = 1.0  # Every block spans 30 decades.
  _, dec = _roundtrip(nu)
  assert np.all(dec > 0)
  assert np.all(dec >= np.minimum(nu, 2.0**-17) * (1 - 2.0**-4))


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _task(seed=0, n=256, d=64, k=32):
  """A linear regression with a bias: x (n, d) -> y (n, k)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d)).astype(np.float32)
  w_true = rng.normal(size=(d, k)).astype(np.float32) / np.sqrt(d)
  y = x @ w_true + 0.01 * rng.normal(size=(n, k)).astype(np.float32)
  params = {"w": jnp.zeros((d, k), BF16), "b": jnp.zeros((k,))}
  return params, jnp.asarray(x), jnp.asarray(y)


def _loss(params, x, y):
  pred = x @ params["w"].astype(jnp.float32) + params["b"]
  return jnp.mean((pred - y) ** 2)


def _train(inner, state_kind, steps, masters="fp32", min_size=1024):
  params, x, y = _task()
  opt = jaxmp.mixed_precision(
    inner,
    loss_scale=1.0,
    master_weights=masters,
    optimizer_state=jaxmp.StateQuantization(
      state_kind, block_size=32, min_size=min_size
    ),
  )
  state = opt.init(params)

  @jax.jit
  def run(params, state):
    def body(carry, _):
      params, state = carry
      loss, g = jax.value_and_grad(_loss)(params, x, y)
      updates, state = opt.update(g, state, params)
      return (optax.apply_updates(params, updates), state), loss

    (params, state), losses = jax.lax.scan(
      body, (params, state), None, length=steps
    )
    return params, state, losses

  params, state, losses = run(params, state)
  return params, state, np.asarray(losses), float(_loss(params, x, y))


OPTIMIZERS = {
  "adam": (lambda: optax.adam(3e-2), ("mu", "nu")),
  "sgd_momentum": (lambda: optax.sgd(3e-2, momentum=0.9), ("trace",)),
  "lion": (lambda: optax.lion(3e-3), ("mu",)),
  # Factored second moments: (64,) and (32,) rows and columns, left alone.
  "adafactor": (
    lambda: optax.adafactor(
      3e-2, min_dim_size_to_factor=16, multiply_by_parameter_scale=False
    ),
    (),
  ),
}


@functools.cache
def _fp32_reference(name):
  """The first and the final loss of 200 steps with fp32 state (once)."""
  _, _, losses, final = _train(OPTIMIZERS[name][0](), "fp32", 200)
  return losses[0], final


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_low_bit_state_tracks_fp32_state(name, kind):
  """200 steps: the final loss within 10% of fp32 state's, far below start.

  Measured (Xeon, AVX-512): Adam 1.2%, SGD momentum 0.4%, Lion 4.2% (int8,
  stochastic rounding; rounded to nearest Lion's int8 momentum stalls: 7x
  the loss, and SGD momentum's 35% more); bf16 within 1.2% for all.
  """
  make, encoded = OPTIMIZERS[name]
  first, ref = _fp32_reference(name)
  _, state, losses, got = _train(make(), kind, 200)
  assert ref < 0.05 * first  # It did train.
  assert abs(got - ref) <= 0.1 * ref, (got, ref)
  rows = jaxmp.state_summary(state)
  coded = {r.path for r in rows if r.note == "encoded"}
  assert coded == {f".inner_state[0].{f}['w']" for f in encoded}, coded
  for r in rows:
    if r.note == "encoded":
      assert r.stored == kind
    if r.path.endswith("['b']") and r.shape == (32,):
      assert "under min_size" in r.note


def test_adafactor_keeps_its_factored_leaves_as_they_are():
  _, state, _, _ = _train(
    optax.adafactor(3e-2, min_dim_size_to_factor=16), "int8", 2, min_size=16
  )
  rows = {r.path: r for r in jaxmp.state_summary(state)}
  for leaf in ("v_row['w']", "v_col['w']"):  # (64,) and (32,): factored.
    row = rows[f".inner_state[0].{leaf}"]
    assert row.stored == "float32", row
    assert row.note == "kept: not a param-shaped leaf", row
  # The unfactored second moment of the (32,) bias is param-shaped.
  assert rows[".inner_state[0].v['b']"].stored == "int8"
  assert [p for p, r in rows.items() if r.note == "encoded"] == [
    ".inner_state[0].v['b']"
  ]
  assert rows[".master_params['w']"].note == ""  # Not the inner state.


def test_bytes_of_the_encoded_state():
  params = {"w": jnp.zeros((16, 512), BF16), "b": jnp.zeros((512,))}
  n = 16 * 512
  sizes = {}
  for kind in ("fp32", "bf16", "int8"):
    opt = jaxmp.mixed_precision(
      optax.adam(1e-3), master_weights="remainder", optimizer_state=kind
    )
    state = opt.init(params)
    inner = sum(x.nbytes for x in jax.tree.leaves(state.inner_state))
    sizes[kind] = inner
    assert jaxmp.state_summary(state).nbytes == sum(
      x.nbytes for x in jax.tree.leaves(state)
    )
    assert state.remainder["w"].nbytes == 2 * n
  small = 2 * 512 * 4 + 4  # b's mu and nu (under min_size), the count.
  assert sizes["fp32"] == 2 * 4 * n + small
  assert sizes["bf16"] == 2 * 2 * n + small
  assert sizes["int8"] == 2 * (n + 4 * n // 256) + small


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_summary_of_the_abstract_state_is_the_states(kind):
  """`jax.eval_shape` of the init sizes the state before it is built."""
  params = {"w": jnp.zeros((16, 600), BF16), "b": jnp.zeros((600,))}
  opt = jaxmp.mixed_precision(
    optax.adam(1e-3), master_weights="remainder", optimizer_state=kind
  )
  shapes = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  abstract = jaxmp.state_summary(jax.eval_shape(opt.init, shapes))
  state = opt.init(params)
  assert abstract == jaxmp.state_summary(state)
  assert abstract.nbytes == sum(x.nbytes for x in jax.tree.leaves(state))
  # int8 pads w's rows from 600 to 768 (3 blocks): counted as stored.
  rows = {r.path: r for r in abstract}
  assert rows[".inner_state[0].mu['w']"].note == "encoded"
  assert rows[".inner_state[0].mu['b']"].note.startswith("kept: under")


def test_the_init_encodes_when_it_runs_not_when_it_compiles():
  """The scales of optax's zero moments are computed by the compiled init.

  ``jnp.zeros_like`` is a constant under ``jit``: unless the encoding is
  kept from it, XLA folds the encoding while compiling (~2 s per
  3x3x256x256 kernel), and no ``reduce_max`` is left in the program.
  """
  params = {"w": jnp.zeros((64, 512), BF16)}
  opt = jaxmp.mixed_precision(
    optax.adam(1e-3), master_weights="remainder", optimizer_state="int8"
  )
  hlo = jax.jit(opt.init).lower(params).compile().as_text()
  assert re.search(r" reduce\(.*reduce_max", hlo), "the encoding was folded"


@pytest.mark.invariant
def test_an_eager_init_compiles_a_program_per_leaf_not_per_op():
  """Outside jit the codec and the remainder split run as one program each.

  Op by op, an eager init of int8 moments with ``"remainder"`` masters
  compiled every op of a leaf's encoding, split and join as its own
  program; now each is one program per kind of leaf, and the state is still
  the compiled init's, bit for bit (zeros, -0, NaN, infs in the param).
  """
  rng = np.random.default_rng(3)
  x = rng.normal(size=(40, 56)).astype(np.float32)
  x *= np.logspace(-6, 6, 56, dtype=np.float32)
  x[0, :6] = [0.0, -0.0, np.nan, np.inf, -np.inf, 3e38]
  params = {"w": jnp.asarray(x, BF16)}  # A shape no other test compiles.
  opt = jaxmp.mixed_precision(
    optax.adagrad(0.1, initial_accumulator_value=0.3),  # Nonzero codes.
    master_weights="remainder",
    optimizer_state=jaxmp.StateQuantization("int8", block_size=8, min_size=64),
  )
  state = []
  compiles = backend_compiles(lambda: state.append(opt.init(params)))
  # jax 0.10.2, this test alone: 8 (78 op by op); fewer after other tests.
  assert compiles <= 12, compiles
  assert _bits(state[0]) == _bits(jax.jit(opt.init)(params))


@pytest.mark.invariant
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_skipped_step_leaves_the_codes_bit_for_bit(kind):
  params = {"w": jnp.linspace(-1, 1, 64 * 64, dtype=BF16).reshape(64, 64)}
  opt = jaxmp.mixed_precision(
    optax.adam(1e-2),
    loss_scale=1.0,
    master_weights="remainder",
    optimizer_state=kind,
  )
  step = jax.jit(opt.update)
  g = {"w": jnp.cos(params["w"] * 7)}
  _, state = step(g, opt.init(params), params)
  before = jax.device_get(state)
  _, after = step({"w": g["w"].at[0, 0].set(jnp.nan)}, state, params)
  assert not bool(after.step_applied)
  assert _bits(after.inner_state) == _bits(before.inner_state)
  assert _bits(after.remainder) == _bits(before.remainder)


def test_jit_identity_and_checkpoint_round_trip(tmp_path):
  params, state, _, _ = _train(optax.adam(3e-2), "int8", 3, "remainder")
  same = jax.jit(lambda s: s)(state)
  assert jax.tree.structure(same) == jax.tree.structure(state)
  assert _bits(same) == _bits(state)
  tree = {"state": state, "params": params}
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "c", tree)
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(
      tmp_path / "c", jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    )
  assert jax.tree.structure(restored) == jax.tree.structure(tree)
  assert _bits(restored) == _bits(tree)


def test_bad_optimizer_state_is_one_clear_error():
  with pytest.raises(ValueError, match="'fp32', 'bf16', 'int8' or a"):
    jaxmp.mixed_precision(optax.adam(1e-3), optimizer_state="fp8")
  with pytest.raises(ValueError, match="block_size must be a positive int"):
    jaxmp.StateQuantization("int8", block_size=0)


@pytest.mark.invariant
@pytest.mark.devices(4)
def test_sharded_params_give_the_unsharded_codes_bit_for_bit():
  """Rows over 4 devices: blocks run along the unsharded last axis."""
  params = {"w": jnp.linspace(-1, 1, 8 * 512, dtype=BF16).reshape(8, 512)}
  grads = {"w": jnp.cos(params["w"] * 9)}
  opt = jaxmp.mixed_precision(
    optax.adam(1e-2),
    loss_scale=1.0,
    master_weights="remainder",
    optimizer_state="int8",
  )

  def run(params, grads):
    state = jax.jit(opt.init)(params)
    step = jax.jit(opt.update)
    for _ in range(3):
      updates, state = step(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params, state

  ref = run(params, grads)
  mesh = jax.make_mesh((4,), ("d",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  put = lambda t: jax.tree.map(lambda x: jax.device_put(x, rows), t)
  got = run(put(params), put(grads))
  assert _bits(got) == _bits(ref)
  assert got[0]["w"].sharding.is_equivalent_to(rows, 2)


def test_under_multi_steps_a_window_equals_one_step_on_the_mean():
  params = {"w": jnp.linspace(-1, 1, 64 * 64, dtype=BF16).reshape(64, 64)}
  g = {"w": jnp.cos(params["w"] * 5)}
  make = lambda: jaxmp.mixed_precision(
    optax.adam(1e-2),
    loss_scale=1.0,
    master_weights="remainder",
    optimizer_state="int8",
  )
  one, acc = make(), jaxmp.multi_steps(make(), 2)
  _, s1 = jax.jit(one.update)(g, one.init(params), params)
  state = acc.init(params)
  step = jax.jit(acc.update)
  for _ in range(2):
    _, state = step(g, state, params)
  inner = jaxmp.find_state(state).inner_state
  assert _bits(inner) == _bits(s1.inner_state)


@pytest.mark.invariant
@pytest.mark.devices(4)
def test_a_checkpoint_restores_onto_a_mesh_and_resumes_bit_for_bit(tmp_path):
  """Saved from one device, restored with rows over 4: the same next step."""
  params = {"w": jnp.linspace(-1, 1, 8 * 512, dtype=BF16).reshape(8, 512)}
  grads = {"w": jnp.cos(params["w"] * 9)}
  opt = jaxmp.mixed_precision(
    optax.adam(1e-2),
    loss_scale=1.0,
    master_weights="remainder",
    optimizer_state="int8",
  )
  step = jax.jit(opt.update)
  state = opt.init(params)
  for _ in range(2):
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
  tree = {"state": state, "params": params}
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "c", tree)

  mesh = jax.make_mesh((4,), ("d",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=rows if x.ndim and x.shape[0] == 8 else whole
    ),
    tree,
  )
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "c", target)
  codes = restored["state"].inner_state[0].mu["w"]
  assert codes.data.dtype == jnp.int8 and codes.data.sharding == rows
  assert codes.scale.shape == (8, 2) and codes.scale.sharding == rows
  ref = step(grads, state, params)
  got = step(grads, restored["state"], restored["params"])
  assert _bits(got) == _bits(ref)
