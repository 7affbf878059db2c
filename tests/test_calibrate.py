"""`jaxmp.calibrate_loss_scale` against a brute-force scan of the scales."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp
from _helpers import tiny_mlp_params


_params = tiny_mlp_params


def _loss_fn(params, x, y):
  """A small fp16 MLP; the size of ``x`` sets the size of the gradients."""
  d1, d2 = params["dense1"], params["dense2"]
  dtype = d1["kernel"].dtype
  h = x.astype(dtype) @ d1["kernel"] + d1["bias"]
  logits = (h @ d2["kernel"] + d2["bias"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _batch(magnitude, n=8):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(n, 4)).astype(np.float32) * magnitude
  return jnp.asarray(x), jnp.asarray(rng.integers(0, 3, n), jnp.int32)


def _finite_exponents(loss_fn, params, *args, top=40):
  """Every exponent e in [0, top] whose scale 2**e keeps the grads finite."""

  @jax.jit
  def grads(s):
    scaled = lambda p: loss_fn(p, *args).astype(jnp.float32) * s
    return jax.grad(scaled)(params)

  return [
    e
    for e in range(top + 1)
    if all(
      np.isfinite(np.asarray(g)).all()
      for g in jax.tree.leaves(grads(jnp.float32(2.0**e)))
    )
  ]


def _largest_safe(loss_fn, params, *args):
  finite = _finite_exponents(loss_fn, params, *args)
  best = max(finite)
  assert finite == list(range(best + 1))  # Monotone, as the search assumes.
  return best


@pytest.mark.parametrize("magnitude", [3e2, 3e3])
def test_where_2_15_overflows_it_returns_a_safe_scale(magnitude):
  params, (x, y) = _params(), _batch(magnitude)
  best = _largest_safe(_loss_fn, params, x, y)
  assert best < 15  # The default initial scale overflows here.
  scale, evals = jaxmp.calibrate_loss_scale(
    _loss_fn, params, x, y, return_evaluations=True
  )
  assert scale == 2.0 ** (best - 1)  # Default margin 2.
  assert math.log2(scale) in _finite_exponents(_loss_fn, params, x, y)
  # The bracket is 2**0..2**25: one probe at the top, then a bisection.
  assert evals <= 1 + math.ceil(math.log2(26))


def test_where_2_15_is_safe_it_returns_no_less_than_safe_over_margin():
  params, (x, y) = _params(), _batch(1e-2)
  best = _largest_safe(_loss_fn, params, x, y)
  assert 15 < best < 40
  # Capped at 2**24 by default; with a higher cap, exactly safe / margin.
  assert jaxmp.calibrate_loss_scale(_loss_fn, params, x, y) == min(
    2.0 ** (best - 1), 2.0**24
  )
  for margin in (1.0, 4.0):
    scale = jaxmp.calibrate_loss_scale(
      _loss_fn, params, x, y, margin=margin, max_loss_scale=2.0**40
    )
    assert scale == 2.0**best / margin


def test_cap_reached_takes_one_evaluation():
  params, (x, y) = _params(jnp.float32), _batch(1.0)
  scale, evals = jaxmp.calibrate_loss_scale(
    _loss_fn, params, x, y, return_evaluations=True
  )
  assert (scale, evals) == (2.0**24, 1)


def test_aux_and_fp16_loss():
  params, (x, y) = _params(), _batch(3e2)
  best = _largest_safe(_loss_fn, params, x, y)
  with_aux = lambda p, x, y: (_loss_fn(p, x, y), {"n": x.shape[0]})
  assert jaxmp.calibrate_loss_scale(
    with_aux, params, x, y, has_aux=True
  ) == 2.0 ** (best - 1)
  # An fp16 loss: its cotangent, the scale itself, must fit fp16 too.
  half = lambda p, x, y: _loss_fn(p, x, y).astype(jnp.float16)
  assert jaxmp.calibrate_loss_scale(half, params, x, y) == 2.0 ** (
    min(best, 15) - 1
  )


def test_nan_data_and_hopeless_models_are_clear_errors():
  params, (x, y) = _params(), _batch(1.0)
  with pytest.raises(ValueError, match="loss itself is NaN/inf"):
    jaxmp.calibrate_loss_scale(_loss_fn, params, x.at[0, 0].set(jnp.nan), y)
  big = _batch(1e6)  # fp16 activations overflow: the loss is inf.
  with pytest.raises(ValueError, match="loss itself is NaN/inf"):
    jaxmp.calibrate_loss_scale(_loss_fn, params, *big)
  # A finite loss whose fp16 gradient (1e5 * scale) overflows at every scale.
  hopeless = lambda p, x, y: jnp.sum(p["w"].astype(jnp.float32) * 1e5)
  with pytest.raises(
    ValueError,
    match=r"non-finite even at the smallest probed loss scale 1: the model "
    r"itself overflows",
  ):
    jaxmp.calibrate_loss_scale(hopeless, {"w": jnp.ones(3, jnp.float16)}, x, y)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(margin=3.0), "margin must be a power of two"),
    (dict(margin=0.5), "margin must be >= 1"),
    (dict(max_loss_scale=0.0), "max_loss_scale"),
    (dict(min_loss_scale=4.0, max_loss_scale=2.0), "below min_loss_scale"),
  ],
)
def test_bad_arguments(kwargs, match):
  params, (x, y) = _params(), _batch(1.0)
  with pytest.raises(ValueError, match=match):
    jaxmp.calibrate_loss_scale(_loss_fn, params, x, y, **kwargs)


@pytest.mark.devices(4)
def test_batch_sharded_over_4_devices():
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  params, (x, y) = _params(), _batch(3e2, n=16)
  x_s, y_s = jax.device_put((x, y), NamedSharding(mesh, P("data")))
  assert len(x_s.addressable_shards) == 4
  expected = 2.0 ** (_largest_safe(_loss_fn, params, x, y) - 1)
  assert jaxmp.calibrate_loss_scale(_loss_fn, params, x_s, y_s) == expected
