"""`rounding_every` and `jaxmp.rounding_report` against a NumPy reference.

The reference casts with ml_dtypes (round to nearest even): ``h`` the half
param (bfloat16 for an fp32 one), ``u`` the fp32 update, ``m`` the new fp32
master. Counts are exact; ``quality`` sums ``n`` fp32 products, so it is
compared with float64 within ``n`` ulps of fp32.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp

LR = 2.0**-10


def _tree(seed=0):
  """bf16, fp16 and fp32 leaves; fp16 ones with values fp16 flushes."""
  rng = np.random.default_rng(seed)
  mags = lambda *s: rng.standard_normal(s) * 10.0 ** rng.uniform(-6, 1, s)
  return {
    "a": jnp.asarray(mags(16, 3), jnp.bfloat16),
    "b": jnp.asarray(mags(16), jnp.float16),
    "c": {"d": jnp.asarray(mags(16, 2), jnp.float32)},
    # Four just below fp16's smallest normal, 2**-14: see _NEAR_TINY.
    "e": jnp.asarray(rng.standard_normal(16) * 1e-6, jnp.float16)
    .at[:4]
    .set(1022 * 2.0**-24),
  }


# A gradient that moves 1022 * 2**-24 to 1023.99 * 2**-24 in fp32: a master
# that fp16 rounds up to its smallest normal (not flushed).
_NEAR_TINY = -1.990234375 * 2.0**-14


def _grads(params, seed):
  rng = np.random.default_rng(100 + seed)

  def g(p):
    x = rng.standard_normal(p.shape) * 10.0 ** rng.uniform(-4, 2, p.shape)
    x[rng.random(p.shape) < 0.2] = 0.0  # Some elements do not move.
    return jnp.asarray(x, p.dtype)

  return jax.tree.map(g, params)


def _reference(params, grads, masters=None):
  """NumPy: (stalled, quality, flushed) per leaf, for sgd(LR) + fp32 masters.

  ``masters``: the fp32 masters before the step (default: the params).
  """
  out = []
  masters = params if masters is None else masters
  for p, g, m in zip(*map(jax.tree.leaves, (params, grads, masters))):
    p, g, m = np.asarray(p), np.asarray(g), np.asarray(m)
    half = p.dtype if p.dtype != np.float32 else ml_dtypes.bfloat16
    h = p.astype(half).astype(np.float32)
    u = (g.astype(np.float32) * np.float32(-LR)).astype(np.float32)
    landed = (h + u).astype(half).astype(np.float32) - h
    m = (m.astype(np.float32) + u).astype(np.float32)
    moved = u != 0
    stalled = np.sum(moved & (landed == 0)) / max(np.sum(moved), 1)
    uu = np.sum(u.astype(np.float64) ** 2)
    quality = np.sum(landed.astype(np.float64) * u) / uu if uu else 1.0
    tiny = float(ml_dtypes.finfo(half).tiny)
    small = np.abs(m.astype(half).astype(np.float32)) < tiny
    flushed = np.sum((m != 0) & small) / max(np.sum(m != 0), 1)
    out.append((stalled, quality, flushed, u.size))
  return out


def _check(figures, params, grads, masters=None):
  want = _reference(params, grads, masters)
  for i, (stalled, quality, flushed, n) in enumerate(want):
    assert float(figures.stalled[i]) == pytest.approx(stalled, rel=1e-6)
    assert float(figures.flushed[i]) == pytest.approx(flushed, rel=1e-6)
    # n fp32 products summed in any order: at most ~n ulps of each sum.
    tol = 2 * n * 2.0**-24 * (abs(quality) + 1)
    assert float(figures.quality[i]) == pytest.approx(quality, abs=tol)
  return want


def _opt(every=1, **kw):
  return jaxmp.mixed_precision(
    optax.sgd(LR), loss_scale=1.0, rounding_every=every, **kw
  )


@functools.lru_cache(maxsize=None)
def _update(every):
  return jax.jit(_opt(every).update)


def test_figures_match_numpy_and_skip_every_and_rollback():
  # One compiled step (every=2), five calls: applied step 1 (not due), a
  # skipped one (NaN: due by count, but nothing moves), applied step 2
  # (measured), 3 (not due), 4 (measured).
  params = _tree()
  update = _update(2)
  state = _opt(2).init(params)
  grads = [_grads(params, s) for s in range(4)]
  grads[0]["e"] = grads[0]["e"].at[:4].set(0.0)  # Kept at 1022 * 2**-24,
  grads[1]["e"] = grads[1]["e"].at[:4].set(_NEAR_TINY)  # then moved.
  _, state = update(grads[0], state, params)
  assert int(state.rounding.step) == 0 and int(state.rounding.applied) == 1
  bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads[2])
  _, state = update(bad, state, params)
  assert int(state.rounding.step) == 0 and int(state.rounding.applied) == 1
  np.testing.assert_array_equal(state.rounding.stalled, 0.0)
  with pytest.raises(ValueError, match="no step measured yet"):
    jaxmp.rounding_report(state).master_weights()
  masters = jaxmp.master_params(state, params)
  _, state = update(grads[1], state, params)
  first = state.rounding
  want = _check(first, params, grads[1], masters)
  assert int(first.step) == 2
  # The fp16 leaf of values near 1e-6: flushed; some leaves stall.
  assert want[3][2] > 0.25 and float(first.flushed[3]) > 0.25
  assert 0 < max(w[0] for w in want) < 1
  _, state = update(grads[2], state, params)
  assert int(state.rounding.step) == 2 and int(state.rounding.applied) == 3
  np.testing.assert_array_equal(state.rounding.stalled, first.stalled)
  np.testing.assert_array_equal(state.rounding.quality, first.quality)
  masters = jaxmp.master_params(state, params)
  _, state = update(grads[3], state, params)
  assert int(state.rounding.step) == 4
  _check(state.rounding, params, grads[3], masters)
  # Saved and restored with the state: a pytree of arrays and static paths.
  leaves, treedef = jax.tree.flatten(jax.jit(lambda s: s)(state))
  back = jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])
  assert jaxmp.rounding_report(back) == jaxmp.rounding_report(state)


def test_off_is_todays_state_and_step():
  params = {"w": jnp.ones(4, jnp.bfloat16)}
  default, off = _opt(0), jaxmp.mixed_precision(optax.sgd(LR), loss_scale=1.0)
  s0, s1 = default.init(params), off.init(params)
  assert s0.rounding is None
  assert jax.tree.structure(s0) == jax.tree.structure(s1)
  text = lambda o, s: jax.jit(o.update).lower(params, s, params).as_text()
  assert text(default, s0) == text(off, s1)
  with pytest.raises(ValueError, match="rounding_every=N"):
    jaxmp.rounding_report(s0)
  with pytest.raises(ValueError, match="rounding_every"):
    _opt(-1)
  # Under optax.inject_hyperparams the period, traced in update, is the
  # state's.
  inject = optax.inject_hyperparams(
    jaxmp.mixed_precision,
    static_args=("loss_scale", "max_loss_scale", "hysteresis"),
  )(optax.sgd(LR), loss_scale=1.0, rounding_every=1)
  _, s2 = jax.jit(inject.update)(params, inject.init(params), params)
  assert int(jaxmp.find_state(s2).rounding.step) == 1


def test_known_failures_and_advice():
  # A LayerNorm scale of ones at Adam lr 1e-4, and decay with lr*wd = 1e-6
  # (no gradient): bf16 alone never moves; a small-update leaf next to them;
  # a frozen leaf (zero gradient, zero value: no update at all).
  params = {
    "scale": jnp.ones(8, jnp.bfloat16),
    "w": jnp.full(8, 1e-3, jnp.bfloat16),
    "f": jnp.ones(8, jnp.float32),
    "tiny": jnp.full(8, 1e-6, jnp.float16),  # fp16 subnormals
    "frozen": jnp.zeros(8, jnp.bfloat16),
  }
  opt = jaxmp.mixed_precision(
    optax.adamw(1e-4, weight_decay=1e-2), loss_scale=1.0, rounding_every=1
  )
  state = opt.init(params)
  grads = {
    "scale": jnp.ones(8, jnp.bfloat16),
    "w": jnp.ones(8, jnp.bfloat16),
    "f": jnp.zeros(8, jnp.float32),
    "tiny": jnp.zeros(8, jnp.float16),
    "frozen": jnp.zeros(8, jnp.bfloat16),
  }
  update = jax.jit(opt.update)
  _, state = update(grads, state, params)
  report = jaxmp.rounding_report(state)
  rows = {r.path: r for r in report}
  assert rows["['scale']"].stalled == 1.0 and rows["['scale']"].quality == 0
  assert rows["['scale']"].master_weights == "remainder"
  assert "remainder" in rows["['scale']"].advice
  # lr * wd = 1e-6 on an fp32 1.0: bfloat16 would drop all of it.
  assert rows["['f']"].stalled == 1.0
  assert "keep it fp32" in rows["['f']"]["advice"]
  # 1e-3 moves by ~1e-4 (10% of it): bf16 keeps it.
  assert rows["['w']"].stalled == 0.0
  assert rows["['w']"].advice == "bf16 alone keeps its updates"
  # fp16 holds the tiny leaf's masters as subnormals: fp32 masters.
  assert rows["['tiny']"].flushed == 1.0
  assert rows["['tiny']"].master_weights == "fp32"
  assert rows["['tiny']"].advice.startswith("fp32 masters: fp16 holds 100%")
  # No update loses nothing: quality 1, nothing stalled, bf16 alone.
  frozen = rows["['frozen']"]
  assert (frozen.stalled, frozen.quality, frozen.flushed) == (0, 1, 0)
  assert frozen.master_weights == "none"
  assert report.step == 1 and {r.path for r in report[-2:]} == {
    "['w']",
    "['frozen']",
  }
  # Like the other two reports: a list of its rows, also as ``.rows``.
  assert len(report) == 5 and report.rows == tuple(report)
  assert "scale" in str(report) and "stalled" in str(report)
  choice = report.master_weights()
  assert choice["['w']"] == "none" and choice["['scale']"] == "remainder"
  path = jax.tree_util.tree_flatten_with_path(params)[0][2][0]
  assert choice(path, params["scale"]) == "remainder"
  # A leaf the report does not name takes the default asked for.
  unnamed = (jax.tree_util.DictKey("new"),)
  assert choice(unnamed, params["w"]) == "fp32"
  other = report.master_weights(default="kahan")
  assert other(unnamed, params["w"]) == "kahan" and other == choice
  # A skipped step (an overflow) at every=1 measures nothing: the figures
  # of applied step 1 stay.
  bad = {k: np.full(g.shape, np.inf, g.dtype) for k, g in grads.items()}
  _, skipped = update(bad, state, params)
  assert int(skipped.rounding.applied) == 1
  for a, b in zip(
    jax.tree.leaves(skipped.rounding), jax.tree.leaves(state.rounding)
  ):
    np.testing.assert_array_equal(a, b)
  assert jaxmp.rounding_report(skipped) == report


# Figures on each side of the advice's thresholds (1% stalled, quality
# within 0.1 of 1), one leaf each: (stalled, quality, needs masters).
_NEAR = {
  "['a']": (0.02, 1.0, True),  # fp32: bf16 would lose 2% of its updates.
  "['b']": (0.005, 1.0, False),
  "['c']": (0.0, 0.71, True),  # Nothing stalled, updates cut short.
  "['d']": (0.0, 1.05, False),
  "['e']": (0.0, 1.2, True),  # Updates overshoot.
}


def test_advice_on_each_side_of_its_thresholds():
  params = {k: jnp.ones(2, jnp.bfloat16) for k in "bcde"}
  params["a"] = jnp.ones(2, jnp.float32)
  state = _opt(1).init(params)
  paths = state.rounding.paths
  figures = dataclasses.replace(
    state.rounding,
    step=jnp.ones([], jnp.int32),
    stalled=jnp.asarray([_NEAR[p][0] for p in paths], jnp.float32),
    quality=jnp.asarray([_NEAR[p][1] for p in paths], jnp.float32),
  )
  report = jaxmp.rounding_report(state._replace(rounding=figures))
  got = {r.path: r.master_weights != "none" for r in report}
  assert got == {p: v[2] for p, v in _NEAR.items()}, str(report)


@pytest.mark.devices(4)
def test_fsdp_and_shard_map_equal_one_device():
  params = {
    "a": _tree()["a"],
    "b": _tree()["b"],
    "e": _tree()["e"],
  }
  grads = _grads(params, 7)
  opt = _opt(1)
  one_update = jax.jit(opt.update)
  _, one = one_update(grads, opt.init(params), params)
  mesh = jax.make_mesh((4,), ("fsdp",))
  put = lambda t: jax.device_put(t, NamedSharding(mesh, P("fsdp")))
  sp, sg = put(params), put(grads)
  state = jax.jit(opt.init)(sp)
  _, fsdp = jax.jit(opt.update)(sg, state, sp)
  for got in (fsdp.rounding,):
    assert got.stalled.sharding.is_fully_replicated
    np.testing.assert_array_equal(got.stalled, one.rounding.stalled)
    np.testing.assert_array_equal(got.flushed, one.rounding.flushed)
    np.testing.assert_allclose(got.quality, one.rounding.quality, rtol=1e-5)
  # Per-leaf masters on the mesh: each buffer placed like its param.
  modes = {"a": "remainder", "b": "fp32", "e": "kahan"}
  per_leaf = _opt(1, master_weights=modes)
  placed = jax.jit(per_leaf.init)(sp)
  for buf in (
    placed.remainder["a"],
    placed.master_params["b"],
    placed.compensation["e"],
  ):
    assert buf.sharding.is_equivalent_to(sp["a"].sharding, 1)
  # shard_map: each device holds a quarter of every param and gradient.
  # Every 2nd step: the sums under lax.cond, measured at the second call.
  sm_opt = _opt(2, axis_name="fsdp")
  state = sm_opt.init(params)
  specs = jax.tree.map(lambda x: P("fsdp") if np.ndim(x) else P(), state)
  specs = specs._replace(rounding=jax.tree.map(lambda _: P(), state.rounding))

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P("fsdp"), specs, P("fsdp")),
    out_specs=specs,
  )
  def step(g, s, p):
    return sm_opt.update(g, s, p)[1]

  state = jax.device_put(
    state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  )
  run = jax.jit(step)
  state = run(sg, state, sp)
  assert int(state.rounding.step) == 0
  got = run(sg, state, sp).rounding
  assert int(got.step) == 2
  _, one = one_update(grads, one, params)
  np.testing.assert_array_equal(got.stalled, one.rounding.stalled)
  np.testing.assert_array_equal(got.flushed, one.rounding.flushed)
  np.testing.assert_allclose(got.quality, one.rounding.quality, rtol=1e-5)


def test_multi_steps_measures_once_per_window():
  params = {"a": _tree()["a"]}
  opt = jaxmp.multi_steps(_opt(1), 2)
  state = opt.init(params)
  update = jax.jit(opt.update)
  g1, g2 = _grads(params, 1), _grads(params, 2)
  _, state = update(g1, state, params)
  assert int(jaxmp.find_state(state).rounding.applied) == 0
  _, state = update(g2, state, params)
  figures = jaxmp.find_state(state).rounding
  assert int(figures.applied) == 1 and int(figures.step) == 1
  # multi_steps' running mean: acc + (g - acc) / 2.
  f32 = lambda x: np.asarray(x, np.float32)
  mean = jax.tree.map(lambda x, y: f32(x) + (f32(y) - f32(x)) / 2, g1, g2)
  _check(figures, params, mean)
