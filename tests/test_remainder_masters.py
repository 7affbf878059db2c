"""``master_weights="remainder"``: exact fp32 masters in 2 bytes a param.

A bfloat16 param is the upper half of an fp32 master's bits; the state keeps
the lower half (int16). Against ``master_weights="fp32"`` fed the same
gradients, `jaxmp.master_params` must agree bit for bit after every step,
overflowed (skipped) steps included, and the params must agree except on
exact ties (ties go away from zero, not to even), by one ulp.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxmp

# The gradients are scaled by hand, with the state's scale.
pytestmark = pytest.mark.filterwarnings(
  "ignore::jaxmp.UnscaledGradientsWarning"
)

BF16 = jnp.bfloat16
STEPS = 50
SKIPPED = (3, 4, 17, 30, 31, 32, 44)  # Steps whose gradients hold an inf.


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "w": (jax.random.normal(k1, (32, 48)) * 0.5).astype(BF16),
    "v": jax.random.normal(k2, (48,)).astype(BF16),
    "z": jnp.zeros((8,), BF16).at[1].set(-0.0),  # Zeros, one negative.
    "b": jnp.zeros((48,)),  # fp32: its own master.
  }


def _loss(params, x, y):
  h = jnp.tanh(x @ params["w"].astype(jnp.float32))
  pred = h @ params["v"].astype(jnp.float32) + params["b"].sum()
  return jnp.mean((pred - y) ** 2) + jnp.sum(params["z"].astype(jnp.float32))


def _opt(mode):
  return jaxmp.mixed_precision(
    optax.adamw(3e-3, weight_decay=1e-2),
    loss_scale=jmp_scale(),
    master_weights=mode,
  )


def jmp_scale():
  import jmp  # pylint: disable=g-import-not-at-top

  return jmp.DynamicLossScale(jnp.float32(2.0**15), period=5)


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _u32(x):
  return np.asarray(jnp.asarray(x, jnp.float32)).view(np.uint32)


def _run_both(steps=STEPS):
  """Both modes on the gradients of the fp32 run's params, step by step."""
  params = _params()
  opts = {m: _opt(m) for m in ("fp32", "remainder")}
  states = {m: o.init(params) for m, o in opts.items()}
  ps = {m: params for m in opts}

  @jax.jit
  def step(ps, states, x, y, bad):
    g = jax.grad(_loss)(ps["fp32"], x, y)
    scale = states["fp32"].loss_scale
    g = jax.tree.map(lambda a, p: (a * scale).astype(p.dtype), g, params)
    g = dict(g, w=g["w"].at[2, 3].set(jnp.where(bad, jnp.inf, g["w"][2, 3])))
    out = {m: _apply(o, g, states[m], ps[m]) for m, o in opts.items()}
    return {m: o[0] for m, o in out.items()}, {m: o[1] for m, o in out.items()}

  rng = np.random.default_rng(1)
  history = [(ps, states)]  # The init states too.
  for i in range(steps):
    x = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(16,)), jnp.float32)
    ps, states = step(ps, states, x, y, i in SKIPPED)
    history.append((ps, states))
  return history


def _apply(opt, grads, state, params):
  updates, state = opt.update(grads, state, params)
  return optax.apply_updates(params, updates), state


@pytest.mark.invariant
def test_masters_equal_fp32_masters_bit_for_bit_every_step():
  history = _run_both()
  ties = 0
  for ps, states in history:
    want = jaxmp.master_params(states["fp32"], ps["fp32"])
    got = jaxmp.master_params(states["remainder"], ps["remainder"])
    assert _bits(got) == _bits(want)
    for k in ("w", "v", "z"):
      p_fp32 = np.asarray(ps["fp32"][k]).view(np.uint16).astype(np.int64)
      p_rem = np.asarray(ps["remainder"][k]).view(np.uint16).astype(np.int64)
      m = _u32(want[k])
      tie = (m & 0xFFFF) == 0x8000
      # Off by one ulp, away from zero (in bits: +1), at ties only.
      assert np.all(np.where(tie, p_rem - p_fp32 == 1, p_rem == p_fp32))
      ties += int(np.sum(tie))
    np.testing.assert_array_equal(ps["remainder"]["b"], ps["fp32"]["b"])
  last = history[-1][1]
  assert int(last["remainder"].skipped_steps) == len(SKIPPED)
  assert int(last["fp32"].skipped_steps) == len(SKIPPED)
  assert last["remainder"].remainder["w"].dtype == jnp.int16
  assert last["remainder"].remainder["b"] is None
  assert last["remainder"].master_params["w"] is None
  # The masters did move below the params' resolution.
  assert np.any(np.asarray(last["remainder"].remainder["w"]) != 0)
  print("ties seen:", ties)


@pytest.mark.invariant
def test_a_tie_rounds_away_from_zero_and_the_master_stays_exact():
  """1 + 2**-8 is half a bfloat16 ulp above 1: fp32 casts it to 1 (even)."""
  params = {"w": jnp.array([1.0, -1.0, 3.0], BF16)}
  grads = [
    {"w": jnp.array([-(2.0**-8), 2.0**-8, 0.0], BF16)},  # Onto the ties.
    {"w": jnp.array([2.0**-9, -(2.0**-9), 2.0**-9], BF16)},
  ]
  got = {}
  for mode in ("fp32", "remainder"):
    opt = jaxmp.mixed_precision(
      optax.sgd(1.0), loss_scale=1.0, master_weights=mode
    )
    p, s = params, opt.init(params)
    seen = []
    for g in grads:
      p, s = _apply(opt, g, s, p)
      seen.append((p, jaxmp.master_params(s, p)))
    got[mode] = seen
  (p32, m32), (prem, mrem) = got["fp32"][0], got["remainder"][0]
  assert _bits(mrem) == _bits(m32)
  np.testing.assert_array_equal(m32["w"], [1 + 2.0**-8, -1 - 2.0**-8, 3.0])
  np.testing.assert_array_equal(p32["w"], [1.0, -1.0, 3.0])  # To even.
  np.testing.assert_array_equal(prem["w"], [1 + 2.0**-7, -1 - 2.0**-7, 3.0])
  (p32, m32), (prem, mrem) = got["fp32"][1], got["remainder"][1]
  assert _bits(mrem) == _bits(m32)
  assert _bits(prem) == _bits(p32)


@pytest.mark.invariant
def test_skipped_step_leaves_the_remainder_bit_for_bit():
  history = _run_both(6)
  for i in (
    4,
    5,
  ):  # history[0] is the init.  # Skipped steps: nothing but the counters moves.
    before, after = history[i - 1], history[i]
    assert not bool(after[1]["remainder"].step_applied)
    assert _bits(after[0]["remainder"]) == _bits(before[0]["remainder"])
    for field in ("remainder", "inner_state"):
      assert _bits(getattr(after[1]["remainder"], field)) == _bits(
        getattr(before[1]["remainder"], field)
      )


def test_float16_params_are_one_clear_error():
  opt = jaxmp.mixed_precision(optax.sgd(0.1), master_weights="remainder")
  params = {"a": jnp.ones(2, BF16), "h": jnp.ones(3, jnp.float16)}
  with pytest.raises(ValueError, match=r"\['h'\] is float16.*'?kahan"):
    opt.init(params)


def test_state_survives_jit_identity_and_a_checkpoint(tmp_path):
  opt = _opt("remainder")
  params = {"w": jnp.linspace(-1, 1, 64, dtype=BF16), "b": jnp.ones(3)}
  g = jax.tree.map(lambda p: jnp.full(p.shape, 300.0, p.dtype), params)
  state = opt.init(params)
  # Jitted: eagerly each of the update's ops would compile on its own.
  step = jax.jit(functools.partial(_apply, opt))
  for _ in range(2):
    params, state = step(g, state, params)
  assert np.any(np.asarray(state.remainder["w"]) != 0)
  same = jax.jit(lambda s: s)(state)
  assert jax.tree.structure(same) == jax.tree.structure(state)
  assert _bits(same) == _bits(state)

  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, {"state": state, "params": params})
  with ocp.StandardCheckpointer() as ckpt:
    target = jax.tree.map(
      ocp.utils.to_shape_dtype_struct, {"state": state, "params": params}
    )
    restored = ckpt.restore(path, target)
  assert _bits(restored) == _bits({"state": state, "params": params})
  assert restored["state"].remainder["w"].dtype == jnp.int16
  # And the resumed run goes on bit for bit.
  a = step(g, state, params)
  b = step(g, restored["state"], restored["params"])
  assert _bits(a) == _bits(b)
