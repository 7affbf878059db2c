"""Accessors of the `mixed_precision` state."""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import jaxmp


@pytest.mark.filterwarnings("ignore::jaxmp.UnscaledGradientsWarning")
def test_scale_loss_of_a_float16_loss_is_fp32_under_a_growing_scale():
  # update is given gradients made by hand (the documented silence).
  opt = jaxmp.mixed_precision(
    optax.sgd(0.0),
    loss_scale=jmp.DynamicLossScale(np.float32(2.0**15), period=1),
    max_loss_scale=2.0**20,
  )
  params = {"w": jnp.ones(2, jnp.float16)}
  state = opt.init(params)
  loss16 = jnp.asarray(3.0, jnp.float16)
  step = jax.jit(opt.update)
  for _ in range(3):  # 2**15 -> 2**18: 3 * 2**18 is far beyond fp16's max.
    scaled = jaxmp.scale_loss(loss16, state)
    assert scaled.dtype == jnp.float32
    assert float(scaled) == 3.0 * float(state.loss_scale)
    _, state = step({"w": jnp.ones(2, jnp.float16)}, state, params)
  assert float(state.loss_scale) == 2.0**18
  assert int(state.skipped_steps) == 0
