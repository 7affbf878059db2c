"""The finite flag is global under jit, shard_map (check_vma) and pmap.

Under ``jit`` with sharded arrays the check is global by itself; under
``shard_map`` (with its default ``check_vma=True``) and ``pmap`` it is with
``axis_name``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from _helpers import dynamic_loss_scale
import jaxmp

# These tests give update gradients made by hand (scaled or not, on
# purpose), as code that scales the loss by hand does: the documented
# silence of the unscaled-gradients warning.
pytestmark = [
  pytest.mark.devices(4),
  pytest.mark.filterwarnings("ignore::jaxmp.UnscaledGradientsWarning"),
]


def _mesh():
  return Mesh(np.array(jax.devices()[:4]), ("data",))


def _specs(state, sharded):
  """``P("data")`` for array leaves when params are sharded, else ``P()``."""
  return jax.tree.map(
    lambda x: P("data") if sharded and np.ndim(x) else P(), state
  )


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
  assert not bool(state.step_applied)
  assert optax.apply_updates(params, updates)["w"].tolist() == [1.0] * 8
  assert float(state.loss_scale) == 4.0  # static scale


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_shard_map_unreduced_grads_with_axis_name_skip_together(dtype):
  mesh = _mesh()
  opt = jaxmp.mixed_precision(
    optax.sgd(1.0),
    loss_scale=dynamic_loss_scale(16.0, period=2, factor=2, min_loss_scale=1.0),
    axis_name="data",
  )
  params = {"w": jnp.ones(2, dtype)}
  state = opt.init(params)

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P("data"), P(), P()),
    out_specs=(P("data"), P()),
  )
  def step(local_grads, state, params):
    # Per-device gradients that were (wrongly or on purpose) not reduced.
    updates, state = opt.update({"w": local_grads[0]}, state, params)
    new = optax.apply_updates(params, updates)["w"]
    # pmin makes the flag, hence scale and counters, device-invariant: P().
    return new[None], (
      state.loss_scale,
      state.step_applied,
      state.skipped_steps,
      state.growth_counter,
    )

  local = np.full((4, 2), 16.0, np.float32)
  local[2, 0] = np.nan  # Device 2 only.
  new, (scale, finite, skipped, counter) = jax.jit(step)(
    jnp.asarray(local, dtype), state, params
  )
  np.testing.assert_array_equal(new, np.ones((4, 2)))  # all skipped
  assert (float(scale), bool(finite), int(skipped), int(counter)) == (
    8.0,
    False,
    1,
    0,
  )
  new, (scale, finite, _, counter) = jax.jit(step)(
    jnp.full((4, 2), 8.0, dtype), state._replace(loss_scale=scale), params
  )
  np.testing.assert_array_equal(new, np.zeros((4, 2)))
  assert (float(scale), bool(finite), int(counter)) == (8.0, True, 1)


def test_shard_map_without_axis_name_devices_decide_alone():
  mesh = _mesh()
  opt = jaxmp.mixed_precision(
    optax.sgd(1.0),
    loss_scale=dynamic_loss_scale(16.0, period=2, factor=2, min_loss_scale=1.0),
  )
  params = {"w": jnp.ones(2, jnp.float32)}
  state = opt.init(params)

  # A device-varying flag makes the state device-varying: out_specs P("data").
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P("data"), P(), P()),
    out_specs=(P("data"), P("data")),
  )
  def step(local_grads, state, params):
    updates, state = opt.update({"w": local_grads[0]}, state, params)
    new = optax.apply_updates(params, updates)["w"]
    return new[None], state.loss_scale[None]

  local = np.full((4, 2), 16.0, np.float32)
  local[2, 0] = np.nan
  new, scales = jax.jit(step)(local, state, params)
  new, scales = np.asarray(new), np.asarray(scales)
  # The failure axis_name fixes: device 2 skipped, the others stepped.
  np.testing.assert_array_equal(new[2], [1.0, 1.0])
  np.testing.assert_array_equal(new[[0, 1, 3]], np.zeros((3, 2)))
  np.testing.assert_array_equal(scales, [16.0, 16.0, 8.0, 16.0])


@pytest.mark.parametrize("bad", [False, True])
def test_shard_map_replicated_params_pmeaned_grads(bad):
  mesh = _mesh()
  opt = jaxmp.mixed_precision(
    optax.sgd(0.5, momentum=0.9),
    loss_scale=dynamic_loss_scale(4.0, period=2, factor=2, min_loss_scale=1.0),
    axis_name="data",
  )
  params = {"h": jnp.ones(3, jnp.float16), "f": jnp.ones(2, jnp.float32)}
  state = opt.init(params)
  specs = _specs(state, sharded=False)

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P("data"), specs, P()),
    out_specs=(P(), specs),
  )
  def step(local, state, params):
    grads = jax.lax.pmean(
      {"h": local[0, :3].astype(jnp.float16), "f": local[0, 3:]}, "data"
    )
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  local = np.tile(np.arange(1.0, 5.0, dtype=np.float32)[:, None] * 4, (1, 5))
  if bad:
    local[1, 4] = np.inf
  new, new_state = jax.jit(step)(local, state, params)
  # mean over devices of 4 * (1, 2, 3, 4) / scale 4 = 2.5; sgd lr 0.5.
  expected = 1.0 if bad else 1.0 - 0.5 * 2.5
  for k in params:
    np.testing.assert_array_equal(new[k], np.full(params[k].shape, expected))
  assert float(new_state.loss_scale) == (2.0 if bad else 4.0)
  assert bool(new_state.step_applied) == (not bad)


def test_shard_map_sharded_params():
  mesh = _mesh()
  opt = jaxmp.mixed_precision(
    optax.sgd(0.25, momentum=0.5),
    loss_scale=dynamic_loss_scale(8.0, period=2, factor=2, min_loss_scale=1.0),
    axis_name="data",
  )
  params = {"w": jnp.ones(8, jnp.float16), "f": jnp.ones(4, jnp.float32)}
  state = opt.init(params)
  specs = _specs(state, sharded=True)

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P("data"), specs, P("data")),
    out_specs=(P("data"), specs),
  )
  def step(grads, state, params):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step)
  grads = {"w": jnp.full(8, 8.0, jnp.float16), "f": jnp.full(4, 8.0)}
  params, state = step(grads, state, params)
  np.testing.assert_array_equal(params["w"], np.full(8, 0.75))
  np.testing.assert_array_equal(params["f"], np.full(4, 0.75))
  bad = {"w": grads["w"], "f": grads["f"].at[3].set(jnp.inf)}  # Last shard.
  params, state = step(bad, state, params)
  np.testing.assert_array_equal(params["w"], np.full(8, 0.75))
  np.testing.assert_array_equal(params["f"], np.full(4, 0.75))
  np.testing.assert_array_equal(state.master_params["w"], np.full(8, 0.75))
  assert float(state.loss_scale) == 4.0 and int(state.skipped_steps) == 1


def test_pmap_with_axis_name_skips_together():
  opt = jaxmp.mixed_precision(
    optax.sgd(1.0),
    loss_scale=dynamic_loss_scale(16.0, period=2, factor=2, min_loss_scale=1.0),
    axis_name="data",
  )
  params = {"w": jnp.ones(2, jnp.float16)}
  state = opt.init(params)
  rep = lambda t: jax.tree.map(lambda x: jnp.stack([x] * 4), t)

  def step(grads, state, params):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  local = np.full((4, 2), 16.0, np.float16)
  local[3, 1] = np.inf
  new, new_state = jax.pmap(step, axis_name="data", devices=jax.devices()[:4])(
    {"w": jnp.asarray(local)}, rep(state), rep(params)
  )
  np.testing.assert_array_equal(new["w"], np.ones((4, 2)))
  np.testing.assert_array_equal(new_state.loss_scale, [8.0] * 4)
  np.testing.assert_array_equal(new_state.skipped_steps, [1] * 4)
