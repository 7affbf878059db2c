"""Flax NNX: value_and_grad on a model, rollback and master_params on states.

An ``nnx.BatchNorm`` model whose step is forced to skip: its running
statistics must come back to what they were before the step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

nnx = pytest.importorskip("flax.nnx")


class Net(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(3, 4, param_dtype=jnp.float16, rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)  # fp32 params and statistics

  def __call__(self, x):
    return self.bn(self.dense(x.astype(jnp.float16)).astype(jnp.float32))


def _setup():
  model = Net(nnx.Rngs(0))
  opt = nnx.Optimizer(
    model, jaxmp.mixed_precision(optax.sgd(0.1)), wrt=nnx.Param
  )
  x = jax.random.normal(jax.random.key(1), (8, 3))
  return model, opt, x


def _loss(model, x, poison):
  return jnp.mean(jnp.square(model(x) - 1.0)) * poison


@nnx.jit
def _step(model, opt, x, poison):
  old = nnx.clone(nnx.state(model, nnx.BatchStat))
  loss, grads = jaxmp.value_and_grad(_loss)(model, opt.opt_state, x, poison)
  opt.update(model, grads)
  jaxmp.rollback_if_skipped(opt.opt_state, model, old)
  return loss


def _stats(model):
  return jax.device_get(nnx.as_pure(nnx.state(model, nnx.BatchStat)))


def test_value_and_grad_takes_the_model():
  model, opt, x = _setup()
  loss, grads = jaxmp.value_and_grad(_loss)(model, opt.opt_state, x, 1.0)
  ref_loss, ref_grads = nnx.value_and_grad(_loss)(model, x, 1.0)
  # The same loss. (Its half params' products run in one compiled region,
  # for grad_reduce: XLA may sum the fp32 mean of the 8 x 4 squares in
  # another order than eager ops do: within 32 of its roundings.)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=32 * 2.0**-24)
  scale = float(jaxmp.stats(opt.opt_state)["loss_scale"][...])
  assert scale == 2.0**15
  got = nnx.as_pure(grads)
  ref = nnx.as_pure(ref_grads)
  # Power-of-two scaling is exact unless an fp16 gradient under/overflows:
  # compare in fp32, the scaled against the unscaled times the scale.
  for g, r in zip(
    jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)
  ):
    assert g.dtype == r.dtype
    np.testing.assert_allclose(
      np.asarray(g, np.float32),
      np.asarray(r, np.float32) * scale,
      rtol=2.0**-10,  # one fp16 rounding of each
      atol=float(jnp.finfo(jnp.float16).tiny) * scale,
    )


def test_a_skipped_step_rolls_the_batch_stats_back():
  model, opt, x = _setup()
  _step(model, opt, x, 1.0)  # applied: statistics move
  before = _stats(model)
  kernel = np.asarray(model.dense.kernel[...])
  _step(model, opt, x * 3.0, jnp.inf)  # inf gradients: skipped
  assert not bool(jaxmp.stats(opt.opt_state)["step_applied"][...])
  after = _stats(model)
  jax.tree.map(np.testing.assert_array_equal, after, before)
  np.testing.assert_array_equal(np.asarray(model.dense.kernel[...]), kernel)
  _step(model, opt, x * 3.0, 1.0)  # applied again: they move
  moved = _stats(model)
  assert not np.array_equal(moved["bn"]["mean"], before["bn"]["mean"])


def test_rollback_of_states_returns_the_selected_state():
  model, opt, x = _setup()
  old = nnx.clone(nnx.state(model, nnx.BatchStat))

  @nnx.jit
  def step(model, opt, x):
    loss, grads = jaxmp.value_and_grad(_loss)(model, opt.opt_state, x, jnp.inf)
    opt.update(model, grads)
    new = nnx.state(model, nnx.BatchStat)
    return jaxmp.rollback_if_skipped(opt.opt_state, new, old)

  kept = step(model, opt, x)
  jax.tree.map(
    np.testing.assert_array_equal, nnx.as_pure(kept), nnx.as_pure(old)
  )


def test_an_aliased_snapshot_is_an_error():
  """Formerly silent: ``nnx.state`` as a snapshot aliases the live variables.

  ``old = nnx.state(model, nnx.BatchStat)`` holds the live variables; the
  rollback "restored" the statistics of the skipped step. It is rejected
  now, and the message says to use ``nnx.clone``.
  """
  model, opt, x = _setup()

  @nnx.jit
  def step(model, opt, x):
    old = nnx.state(model, nnx.BatchStat)  # not a copy
    loss, grads = jaxmp.value_and_grad(_loss)(model, opt.opt_state, x, jnp.inf)
    opt.update(model, grads)
    jaxmp.rollback_if_skipped(opt.opt_state, model, old)

  with pytest.raises(ValueError, match=r"nnx\.clone"):
    step(model, opt, x)
  with pytest.raises(ValueError, match=r"not a copy"):
    live = nnx.state(model, nnx.BatchStat)
    jaxmp.rollback_if_skipped(opt.opt_state, live, live)


def test_master_params_takes_nnx_params():
  """Formerly: a raw pytree error inside _src (OptVariable vs Param)."""
  model, opt, x = _setup()
  _step(model, opt, x, 1.0)
  masters = jaxmp.master_params(opt.opt_state, nnx.state(model, nnx.Param))
  kernel = masters["dense"]["kernel"]
  assert kernel.dtype == jnp.float32
  # The fp16 param is the master cast, bit for bit; fp32 params are their
  # own masters.
  np.testing.assert_array_equal(
    np.asarray(kernel.astype(jnp.float16)), np.asarray(model.dense.kernel[...])
  )
  np.testing.assert_array_equal(
    np.asarray(masters["bn"]["scale"]), np.asarray(model.bn.scale[...])
  )
  # And without params: the fp32 params have no master, as for any tree.
  with pytest.raises(ValueError, match="no fp32 master"):
    jaxmp.master_params(opt.opt_state)
