"""The finite flag is global: under jit with sharded arrays and with axis_name."""

import functools

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxmp

pytestmark = pytest.mark.skipif(jax.device_count() < 4,
                                reason="needs 4 (forced) CPU devices")


def _mesh():
  return Mesh(np.array(jax.devices()[:4]), ("data",))


def test_jit_over_sharded_grads_skips_globally():
  mesh = _mesh()
  opt = jaxmp.mixed_precision(optax.sgd(1.0), loss_scale=4.0)
  params = {"w": jnp.ones(8, jnp.float16)}
  state = opt.init(params)
  grads = np.full(8, 4.0, np.float16)
  grads[6] = np.inf  # Only the last device's shard overflows.
  sharded = jax.device_put({"w": grads}, NamedSharding(mesh, P("data")))
  assert len(sharded["w"].addressable_shards) == 4
  updates, state = jax.jit(opt.update)(sharded, state, params)
  assert not bool(state.grads_finite)
  assert optax.apply_updates(params, updates)["w"].tolist() == [1.0] * 8
  assert float(state.loss_scale) == 4.0  # static scale


@pytest.mark.parametrize("axis_name,expect_agree", [("data", True),
                                                    (None, False)])
def test_shard_map_axis_name_makes_devices_agree(axis_name, expect_agree):
  mesh = _mesh()
  opt = jaxmp.mixed_precision(
      optax.sgd(1.0), loss_scale=jmp.DynamicLossScale(np.float32(16.0)),
      axis_name=axis_name)
  params = {"w": jnp.ones(2, jnp.float32)}
  state = opt.init(params)

  @functools.partial(jax.shard_map, mesh=mesh,
                     in_specs=(P("data"), P(), P()),
                     out_specs=(P("data"), P("data")), check_vma=False)
  def step(local_grads, state, params):
    # Per-device gradients that were (wrongly or on purpose) not reduced.
    updates, state = opt.update({"w": local_grads[0]}, state, params)
    new = optax.apply_updates(params, updates)["w"]
    return new[None], state.loss_scale[None]

  local = np.full((4, 2), 16.0, np.float32)
  local[2, 0] = np.nan  # Device 2 only.
  new, scales = jax.jit(step)(local, state, params)
  new, scales = np.asarray(new), np.asarray(scales)
  if expect_agree:
    np.testing.assert_array_equal(new, np.ones((4, 2)))  # all skipped
    np.testing.assert_array_equal(scales, [8.0] * 4)
  else:
    # Without axis_name each device decides alone: the failure axis_name fixes.
    assert not np.array_equal(new[0], new[2])
    assert sorted(scales.tolist()) == [8.0, 16.0, 16.0, 16.0]
