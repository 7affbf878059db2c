"""``master_weights``: fp32 masters, Kahan, stochastic rounding and none.

The problem where a plain half update stalls: bfloat16 params just below 1
(ulp ``2**-8``) take updates of about ``1e-3``, under half an ulp
(``2**-9 ~ 1.95e-3``). Each element's gradient is constant, so the fp32
trajectory is known in float64 and the modes' errors add up without
feedback. All of it runs under XLA's default flags (``invariant``).

Bounds, for ``K`` steps with params in ``[0.5, 1]`` (``ulp <= 2**-8``):

- Kahan: each step computes ``v + u`` in fp32 (error ``<= 2**-24``) and
  splits it into ``param + c`` with ``|param + c - (v + u)| <= 2**-8 *
  ulp / 2`` (`jaxmp.stochastic_round`'s module, ``kahan_split``). So
  ``|v_K - m_K| <= K * (2**-17 + 2 * 2**-24)`` against the fp32 masters
  ``m_K`` (which round too, ``2**-24`` a step), and the param itself is
  within ``ulp / 2`` more.
- Stochastic: ``param_K - m_K`` is a martingale whose steps have variance
  ``<= ulp**2 / 4``: over ``N`` independent elements its mean is within 5
  standard errors ``5 * sqrt(K / N) * ulp / 2`` of 0 and its RMS is below
  ``1.25 * sqrt(K) * ulp / 2`` (a chi-square over ``N = 4096`` values
  stays within a few percent of its mean). Both hold for any seed except
  with negligible probability; the seed is fixed, so the test is
  deterministic.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxmp

pytestmark = pytest.mark.invariant

MODES = ("fp32", "kahan", "stochastic", "none", "remainder")
N, K, LR = 4096, 64, 1e-3
ULP = 2.0**-8  # bfloat16's ulp in [0.5, 1).
BF16 = jnp.bfloat16


def _problem():
  rng = np.random.default_rng(0)
  start = jnp.full(N, 1.0 - 2.0**-8, BF16)  # 0.99609375, ulp 2**-8 below.
  grads = rng.uniform(0.5, 1.0, N).astype(np.float32)  # updates 5e-4..1e-3
  return {"w": start, "b": jnp.zeros(4)}, {
    "w": jnp.asarray(grads, BF16),
    "b": jnp.ones(4),
  }


def _run(mode, params, grads_seq, *, seed=0, inner=None, state=None):
  opt = jaxmp.mixed_precision(
    inner or optax.sgd(LR),
    loss_scale=1.0,
    master_weights=mode,
    rounding_key=seed,
  )
  if state is None:
    state = opt.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for grads in grads_seq:
    params, state = step(params, state, grads)
  return params, state


def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _expected(params, grads, steps):
  return _f64(params["w"]) - steps * LR * _f64(grads["w"])


def test_none_stalls_while_kahan_and_stochastic_follow_fp32():
  params, grads = _problem()
  want = _expected(params, grads, K)  # float64
  got = {m: _run(m, params, [grads] * K) for m in MODES}
  w = {m: _f64(p["w"]) for m, (p, _) in got.items()}

  np.testing.assert_array_equal(w["none"], _f64(params["w"]))  # Stalled.
  fp32 = _f64(got["fp32"][1].master_params["w"])
  assert np.max(np.abs(fp32 - want)) <= K * 2.0**-24
  assert np.mean(want - w["none"]) < -0.03  # What the stall loses.

  # Kahan: the compensated value within K * (2**-17 + 2**-23) of fp32's.
  p, state = got["kahan"]
  kahan = _f64(jaxmp.master_params(state, p)["w"])
  bound = K * (2.0**-17 + 2.0 * 2.0**-24)
  assert np.max(np.abs(kahan - fp32)) <= bound
  assert np.max(np.abs(w["kahan"] - fp32)) <= ULP / 2 + bound
  assert state.compensation["w"].dtype == BF16
  assert state.compensation["b"] is None  # fp32 params: their own master.

  # Stochastic: unbiased, with a random-walk spread.
  dev = w["stochastic"] - fp32
  assert abs(np.mean(dev)) <= 5 * np.sqrt(K / N) * ULP / 2
  assert np.sqrt(np.mean(dev**2)) <= 1.25 * np.sqrt(K) * ULP / 2
  assert np.max(np.abs(dev)) > 0  # It did round at random.

  # fp32 params take the same fp32 update in every mode.
  for m in MODES:
    np.testing.assert_array_equal(got[m][0]["b"], got["fp32"][0]["b"])


@pytest.mark.parametrize(
  "dtype, scale",
  [
    (jnp.bfloat16, 1.0),
    (jnp.float16, 1.0),
    # float16's subnormals: |x| < 2**-14, spacing 2**-24 (normal in float32,
    # so no flush-to-zero on the way).
    (jnp.float16, 2.0**-14),
  ],
  ids=["bfloat16", "float16", "float16_subnormal"],
)
def test_stochastic_round_is_unbiased(dtype, scale):
  draws = 4000
  x = np.random.default_rng(1).uniform(-3, 3, 64).astype(np.float32)
  if scale == 1.0:
    x[:4] = [0.0, 1.0, -0.5, 2.0**-20]  # Exact, exact, exact, tiny.
  else:
    x = (x / 3 * scale).astype(np.float32)
    # Exact subnormals, and one below the smallest: between 0 and 2**-24.
    x[:4] = [2.0**-24, -5 * 2.0**-24, 2.0**-26, -(2.0**-14) + 2.0**-24]
    assert np.all(np.abs(x) < 2.0**-14)
  y = jax.vmap(lambda k: jaxmp.stochastic_round(x, dtype, k))(
    jax.random.split(jax.random.key(3), draws)
  )
  assert y.dtype == dtype
  y = np.asarray(y.astype(jnp.float32), np.float64)
  nearest = _f64(jnp.asarray(x).astype(dtype))
  other = _f64(
    jnp.nextafter(
      jnp.asarray(nearest, dtype),
      jnp.asarray(np.where(nearest <= x, np.inf, -np.inf), dtype),
    )
  )
  down = np.where(nearest <= x, nearest, other)
  up = np.where(nearest <= x, other, nearest)
  exact = nearest == x
  # Every draw is one of the two neighbours; exact values never move.
  assert np.all((y == down) | (y == up) | exact)
  assert np.all(y[:, exact] == x[exact])
  frac = np.where(exact, 0.0, (x - down) / (up - down))
  se = np.sqrt(frac * (1 - frac) / draws) * (up - down)
  err = np.abs(y.mean(0) - x)
  assert np.all(err <= 5 * se + 1e-12 * np.abs(x)), np.max(err / (se + 1e-30))
  # And the draws do split between the two.
  mixed = (frac > 0.05) & (frac < 0.95)
  assert np.all((y[:, mixed] == up[mixed]).any(0))
  assert np.all((y[:, mixed] == down[mixed]).any(0))


def test_stochastic_round_keeps_non_finite_and_rejects_fp32():
  x = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 3e38], jnp.float32)
  y = jaxmp.stochastic_round(x, jnp.bfloat16, jax.random.key(0))
  assert np.isposinf(y[0]) and np.isneginf(y[1]) and np.isnan(y[2])
  assert np.isfinite(y[3])
  with pytest.raises(ValueError, match="bfloat16 or float16, not float32"):
    jaxmp.stochastic_round(x, jnp.float32, jax.random.key(0))


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("mode", MODES)
def test_skips_change_nothing_but_the_counters(mode):
  """Overflowed steps in between == a control run that never saw them."""
  params, grads = _problem()
  bad = jax.tree.map(lambda g: g.at[3].set(jnp.inf), grads)
  other = jax.tree.map(lambda g: g * 0.75, grads)
  seq = [grads, other, grads]
  control, c_state = _run(mode, params, seq)
  skipped, s_state = _run(mode, params, [grads, bad, other, bad, bad, grads])
  assert int(s_state.skipped_steps) == 3
  assert _bits(skipped) == _bits(control)
  for field in (
    "inner_state",
    "master_params",
    "compensation",
    "rounding_key",
    "remainder",
  ):
    assert _bits(getattr(s_state, field)) == _bits(getattr(c_state, field))


@pytest.mark.parametrize("mode", ["kahan", "stochastic", "remainder"])
def test_fixed_seed_is_deterministic_across_a_resume(mode):
  params, grads = _problem()
  seq = [grads, jax.tree.map(lambda g: g * 0.5, grads)] * 3
  ref, ref_state = _run(mode, params, seq)
  again, _ = _run(mode, params, seq)
  assert _bits(again) == _bits(ref)
  # Stop after 2 steps, through host numpy (a checkpoint), go on.
  mid, mid_state = _run(mode, params, seq[:2])
  mid, mid_state = jax.tree.map(np.asarray, jax.device_get((mid, mid_state)))
  resumed, state = _run(mode, mid, seq[2:], state=mid_state)
  assert _bits(resumed) == _bits(ref)
  assert _bits(state) == _bits(ref_state)
  if mode == "stochastic":
    other, _ = _run(mode, params, seq, seed=1)
    assert _bits(other) != _bits(ref)


@pytest.mark.parametrize("mode", MODES)
def test_multi_steps_window_equals_one_step_on_the_mean(mode):
  params, grads = _problem()
  inner = optax.sgd(LR, momentum=0.9)
  one, _ = _run(mode, params, [grads] * 2, inner=inner)
  opt = jaxmp.multi_steps(
    jaxmp.mixed_precision(
      inner, loss_scale=1.0, master_weights=mode, rounding_key=0
    ),
    2,
  )
  state = opt.init(params)
  step = jax.jit(opt.update)
  p = params
  for _ in range(4):  # Two windows of two equal microbatches.
    updates, state = step(grads, state, p)
    p = optax.apply_updates(p, updates)
  assert _bits(p) == _bits(one)


@pytest.mark.parametrize("mode", MODES)
def test_four_devices_round_alike(mode):
  """Four devices give one device's params, bit for bit.

  shard_map with pmean'd gradients keeps params and state replicated (P()
  out_specs pass check_vma); jit over params split across the devices draws
  the same rounding too.
  """
  params, grads = _problem()
  ref, ref_state = _run(mode, params, [grads] * 3)
  mesh = jax.make_mesh((4,), ("d",))
  opt = jaxmp.mixed_precision(
    optax.sgd(LR), loss_scale=1.0, master_weights=mode, axis_name="d"
  )
  state = opt.init(params)

  def step(params, state, grads):
    grads = jax.lax.pmean(grads, "d")  # Equal per device: exact.
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  sharded = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), P(), P()),
      out_specs=(P(), P()),
    )
  )
  p = params
  for _ in range(3):
    p, state = sharded(p, state, grads)
  assert _bits(p) == _bits(ref)
  assert _bits(jaxmp.master_params(state, p)) == _bits(
    jaxmp.master_params(ref_state, ref)
  )

  # jit with the params split over the devices: the same rounding.
  split = jax.sharding.NamedSharding(mesh, P("d"))
  put = lambda t: {"w": jax.device_put(t["w"], split), "b": t["b"]}
  p, _ = _run(mode, put(params), [put(grads)] * 3)
  assert p["w"].sharding == split
  assert _bits(p) == _bits(ref)


def test_master_params_is_the_best_fp32_estimate():
  params, grads = _problem()
  p, state = _run("kahan", params, [grads] * 3)
  est = jaxmp.master_params(state, p)["w"]
  np.testing.assert_array_equal(
    est, p["w"].astype(jnp.float32) + state.compensation["w"]
  )
  assert np.any(np.asarray(state.compensation["w"]) != 0)
  for mode in ("kahan", "stochastic", "none"):
    p, state = _run(mode, params, [grads])
    with pytest.raises(ValueError, match="no fp32 master"):
      jaxmp.master_params(state)
  p, state = _run("stochastic", params, [grads])
  np.testing.assert_array_equal(
    jaxmp.master_params(state, p)["w"], p["w"].astype(jnp.float32)
  )


def test_bad_mode_and_key_are_one_clear_error():
  with pytest.raises(
    ValueError, match="'stochastic' or 'remainder', got 'fp16'"
  ):
    jaxmp.mixed_precision(optax.sgd(0.1), master_weights="fp16")
  with pytest.raises(ValueError, match="rounding_key must be an int seed"):
    jaxmp.mixed_precision(
      optax.sgd(0.1), master_weights="stochastic", rounding_key="0"
    )
  opt = jaxmp.mixed_precision(
    optax.sgd(0.1),
    master_weights="stochastic",
    rounding_key=jax.random.key(7),
  )
  key = opt.init({"w": jnp.ones(2, BF16)}).rounding_key
  np.testing.assert_array_equal(key, jax.random.key_data(jax.random.key(7)))


def test_each_init_has_its_own_key_buffer():
  """A donated state must not delete the key of a second `init`'s state."""
  opt = jaxmp.mixed_precision(
    optax.sgd(0.1), loss_scale=1.0, master_weights="stochastic"
  )
  params = {"w": jnp.ones(4, BF16)}
  a, b = opt.init(params), opt.init(params)
  step = jax.jit(lambda s: opt.update(params, s, params)[1], donate_argnums=0)
  step(a)
  assert not b.rounding_key.is_deleted()
  step(b)
