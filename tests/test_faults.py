"""The fault-injection knobs: traced, exact, and off by default."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cifar_train import faults
from cifar_train.errors import ConfigError

PARAMS = {"conv": {"kernel": jnp.ones((2, 3), jnp.float16)}, "b": jnp.ones(4)}


def test_overflow_hits_one_leaf_at_one_step():
  f = faults.Faults(overflow_at_step=3, overflow_leaf="conv/kernel")
  corrupt = jax.jit(lambda step, g: faults.corrupt_grads(f, step, g))
  for taken in range(5):  # Step 3 is the one taken after 2 steps.
    out = corrupt(jnp.int32(taken), PARAMS)
    bad = int(np.sum(~np.isfinite(np.asarray(out["conv"]["kernel"]))))
    assert bad == (6 if taken == 2 else 0), taken
    assert out["conv"]["kernel"].dtype == jnp.float16
    np.testing.assert_array_equal(out["b"], PARAMS["b"])


def test_nan_data_from_its_step_on():
  f = faults.Faults(nan_data_at_step=2)
  corrupt = jax.jit(lambda step, x: faults.corrupt_images(f, step, x))
  x = jnp.ones((2, 3))
  assert [
    bool(jnp.all(jnp.isnan(corrupt(jnp.int32(t), x)))) for t in range(4)
  ] == [
    False,
    True,
    True,
    True,
  ]


def test_off_by_default_changes_nothing():
  f = faults.Faults()
  assert faults.corrupt_grads(f, jnp.int32(0), PARAMS) is PARAMS
  x = jnp.ones(3)
  assert faults.corrupt_images(f, jnp.int32(0), x) is x
  faults.check(f, PARAMS)  # No leaf needed when off.


def test_unknown_leaf_is_a_config_error():
  f = faults.Faults(overflow_at_step=1, overflow_leaf="conv/bias")
  with pytest.raises(
    ConfigError, match="'conv/bias' is not a param.*conv/kernel"
  ):
    faults.check(f, PARAMS)
