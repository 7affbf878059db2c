"""`jaxmp.value_and_grad`: one call for the unscaled loss and scaled grads.

Each form is checked bit for bit against the hand-written step it replaces
(``jax.grad`` of ``jaxmp.scale_loss``), with power-of-two scales: scaling and
unscaling are exact, so the two must agree exactly.
"""

import functools

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxmp


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "w": jax.random.normal(k1, (4, 3)).astype(jnp.float16),
    "b": jax.random.normal(k2, (3,)),  # fp32: its own master
  }


def _loss(p, x, y):
  h = x.astype(jnp.float16) @ p["w"]
  out = h.astype(jnp.float32) + p["b"]
  return jnp.mean(jnp.square(out - y))


def _batch(seed=1, n=8):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (n, 4)), jax.random.normal(ky, (n, 3))


def _opt(**kw):
  kw.setdefault(
    "loss_scale", jmp.DynamicLossScale(jnp.float32(2.0**10), period=2)
  )
  return jaxmp.mixed_precision(optax.sgd(0.1, momentum=0.9), **kw)


def _assert_trees_equal(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _by_hand(opt):
  @jax.jit
  def step(params, state, x, y):
    loss, _ = jax.value_and_grad(_loss)(params, x, y)
    grads = jax.grad(lambda p: jaxmp.scale_loss(_loss(p, x, y), state))(params)
    updates, state = opt.update(grads, state, params, loss=loss)
    return optax.apply_updates(params, updates), state, loss

  return step


def _one_call(opt):
  @jax.jit
  def step(params, state, x, y):
    loss, grads = jaxmp.value_and_grad(_loss)(params, state, x, y)
    updates, state = opt.update(grads, state, params, loss=loss)
    return optax.apply_updates(params, updates), state, loss

  return step


def test_returns_the_unscaled_loss_and_the_scaled_grads():
  opt = _opt()
  params, (x, y) = _params(), _batch()
  state = opt.init(params)
  loss, grads = jaxmp.value_and_grad(_loss)(params, state, x, y)
  ref_loss, ref_grads = jax.value_and_grad(_loss)(params, x, y)
  assert loss.dtype == jnp.float32 and float(loss) == float(ref_loss)
  scaled = jax.grad(lambda p: _loss(p, x, y) * jnp.float32(2.0**10))(params)
  _assert_trees_equal(grads, scaled)
  assert grads["w"].dtype == jnp.float16
  # Not the unscaled gradients: 2**10 times larger.
  np.testing.assert_array_equal(
    np.asarray(grads["b"]), np.asarray(ref_grads["b"]) * 2.0**10
  )


def test_has_aux_and_kwargs():
  opt = _opt()
  params, (x, y) = _params(), _batch()
  state = opt.init(params)

  def loss_fn(p, x, *, y):
    loss = _loss(p, x, y)
    return loss, {"twice": 2 * loss}

  (loss, aux), grads = jaxmp.value_and_grad(loss_fn, has_aux=True)(
    params, state, x, y=y
  )
  assert float(aux["twice"]) == 2 * float(loss)
  _, ref = jaxmp.value_and_grad(_loss)(params, state, x, y)
  _assert_trees_equal(grads, ref)


def test_half_loss_is_scaled_in_fp32():
  """A float16 loss of 3.0 times 2**15 would be inf in float16."""
  opt = jaxmp.mixed_precision(optax.sgd(0.1))
  params = {"w": jnp.ones(2, jnp.float16)}
  state = opt.init(params)
  loss_fn = lambda p: jnp.sum(p["w"]) * jnp.float16(1.5)  # float16, = 3
  loss, grads = jaxmp.value_and_grad(loss_fn)(params, state)
  assert loss.dtype == jnp.float16 and float(loss) == 3.0
  # d(1.5 * sum(w) * 2**15)/dw = 49152, exact in float16; the product is
  # computed in fp32, so nothing overflowed.
  assert grads["w"].tolist() == [49152.0, 49152.0]
  _, state = opt.update(grads, state, params, loss=loss)
  assert bool(state.step_applied)


def _recorder():
  """An inner optimizer that keeps the gradients it is given as its state."""

  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(grads, state, params=None):
    del state, params
    return jax.tree.map(jnp.zeros_like, grads), grads

  return optax.GradientTransformation(init, update)


def test_unscaled_grads_equal_jax_grad_on_growth_and_back_off_steps():
  """The gradients ``update`` unscales are those of the untransformed loss.

  Compared with `jax.grad` of ``_loss`` itself (no scale, no optimizer):
  scaling by a power of two is exact in fp16 and fp32 while nothing over-
  or underflows, so they must be equal bit for bit. Step 0 grows the scale
  (period 1): unscaling by the next step's scale would halve them. Step 1
  overflows in fp16 (``y`` is 1e5 away from the output: ``w``'s cotangent
  is inf) and backs off: ``b``'s gradient stays finite in fp32, and the
  diagnostics' largest finite ``|unscaled gradient|`` of it must be
  ``jax.grad``'s, not twice it.
  """
  opt = jaxmp.mixed_precision(
    _recorder(),
    loss_scale=jmp.DynamicLossScale(jnp.float32(2.0**5), period=1),
    diagnostics=True,
  )
  params, (x, y) = _params(), _batch()
  state = opt.init(params)
  step = jax.jit(
    lambda p, s, x, y: opt.update(
      jaxmp.value_and_grad(_loss)(p, s, x, y)[1], s, p
    )[1]
  )
  ref = jax.grad(_loss)(params, x, y)

  grown = step(params, state, x, y)  # A growth step.
  assert bool(grown.step_applied)
  assert float(grown.loss_scale) == 2.0**6
  seen = grown.inner_state
  assert seen["w"].dtype == jnp.float32
  np.testing.assert_array_equal(
    np.asarray(seen["w"]), np.asarray(ref["w"], np.float32)
  )
  np.testing.assert_array_equal(np.asarray(seen["b"]), np.asarray(ref["b"]))
  assert np.max(np.abs(np.asarray(ref["b"]))) > 0

  far = y + 1e5  # A back-off step: fp16 overflows at scale 2**6.
  ref = jax.grad(_loss)(params, x, far)
  assert np.all(np.isfinite(np.asarray(ref["w"])))  # Finite unscaled.
  backed = step(params, grown, x, far)
  assert not bool(backed.step_applied)
  assert float(backed.loss_scale) == 2.0**5
  _assert_trees_equal(backed.inner_state, grown.inner_state)  # Skipped.
  paths = backed.diagnostics.paths
  max_abs = dict(zip(paths, np.asarray(backed.diagnostics.max_abs)))
  nonfinite = dict(zip(paths, np.asarray(backed.diagnostics.nonfinite)))
  assert nonfinite["['w']"] > 0 and nonfinite["['b']"] == 0
  assert max_abs["['b']"] == np.max(np.abs(np.asarray(ref["b"])))


@pytest.mark.invariant
def test_jit_steps_match_scale_loss_bitwise():
  opt = _opt()
  params, (x, y) = _params(), _batch()
  a = b = params
  sa = sb = opt.init(params)
  by_hand, one_call = _by_hand(opt), _one_call(opt)
  for i in range(6):
    xi = x * (1e4 if i == 2 else 1.0)  # Step 2 overflows in fp16.
    a, sa, la = by_hand(a, sa, xi, y)
    b, sb, lb = one_call(b, sb, xi, y)
    assert float(la) == float(lb) or (np.isnan(la) and np.isnan(lb))
  _assert_trees_equal((a, sa), (b, sb))
  assert int(sb.skipped_steps) == 1  # The overflow was seen.


def test_multi_steps():
  opt = jaxmp.multi_steps(_opt(), 2)
  params = _params()
  a = b = params
  sa = sb = opt.init(params)
  by_hand, one_call = _by_hand(opt), _one_call(opt)
  for i in range(4):
    x, y = _batch(seed=i)
    a, sa, _ = by_hand(a, sa, x, y)
    b, sb, _ = one_call(b, sb, x, y)
  _assert_trees_equal((a, sa), (b, sb))
  assert not np.array_equal(np.asarray(b["w"]), np.asarray(params["w"]))


@pytest.mark.devices(4)
def test_shard_map_with_axis_name():
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  opt = _opt(axis_name="data")
  params = _params()
  state = opt.init(params)

  def make(grad_fn):
    @jax.jit
    @functools.partial(
      jax.shard_map,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P(), P(), P()),
    )
    def step(params, state, x, y):
      loss, grads = grad_fn(params, state, x, y)
      grads = jax.lax.pmean(grads, "data")
      loss = jax.lax.pmean(loss, "data")
      updates, state = opt.update(grads, state, params, loss=loss)
      return optax.apply_updates(params, updates), state, loss

    return step

  def by_hand(params, state, x, y):
    loss = _loss(params, x, y)
    scaled = lambda p: jaxmp.scale_loss(_loss(p, x, y), state)
    return loss, jax.grad(scaled)(params)

  x, y = _batch(n=16)
  a, sa, la = make(by_hand)(params, state, x, y)
  b, sb, lb = make(jaxmp.value_and_grad(_loss))(params, state, x, y)
  _assert_trees_equal((a, sa, la), (b, sb, lb))
  # And the step moved: the sharded loss is the global one.
  # A mean of 48 fp32 squares, summed in another order: a few ulp apart,
  # each sum of n terms within n * 2**-24 relative.
  assert float(lb) == pytest.approx(float(_loss(params, x, y)), rel=48 * 2**-23)
  assert bool(sb.step_applied)


def test_wrt_is_only_for_nnx():
  opt = _opt()
  params = _params()
  with pytest.raises(TypeError, match="NNX"):
    jaxmp.value_and_grad(_loss, wrt=object())(
      params, opt.init(params), *_batch()
    )
