"""Spike skipping (``mixed_precision(..., skip_spikes=...)``) against numpy.

The reference below is the documented rule, written out in float64: a finite
step is dropped when its loss or its global gradient norm is strictly above
mean + factor * std (population) of the last ``window`` accepted values; no
step is dropped before that window has filled; dropped and overflowed steps
enter no window. The runs plant spikes in the loss only, in the gradient norm
only, both, one before the windows fill, and an overflow.

The reference also runs the loss-scale rule and every counter beside it (a
spike leaves them as they were), so that shorter runs can take the rule's
edges from a fresh state: the window one step short of full, a finite step
whose fp32 norm is inf while the window fills, overflows and NaN losses
inside runs of spikes with hysteresis, a spike on the step that would grow
the scale. Under ``pmap`` and ``shard_map`` every way devices can disagree:
per-device gradients without ``pmean``, leaves that vary over some of
several axis names.
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

# The runs give update gradients made by hand (the loss times the scale), as
# code that scales the loss by hand does.
pytestmark = pytest.mark.filterwarnings(
  "ignore::jaxmp.UnscaledGradientsWarning"
)

WINDOW, FACTOR, STEPS = 8, 3.0, 60
# Step -> (loss factor, gradient-norm factor); inf: an overflow.
PLANTS = {
  3: (10.0, 10.0),  # Before the windows fill: never dropped.
  17: (np.nan, 1.0),  # A NaN loss (given): skipped, enters no window.
  20: (3.0, 1.0),  # The loss only.
  27: (1.0, 5.0),  # The gradient norm only.
  33: (1.0, np.inf),  # An overflow: skipped, not a spike.
  41: (4.0, 6.0),  # Both, two steps in a row: the first must not
  42: (4.0, 6.0),  # enter the window, or the second would pass.
  50: (3.0, 1.0),  # The loss only.
}


def reference(
  losses,
  norms,
  window,
  factor,
  kept=None,
  grads_finite=None,
  scaler=None,
  trace=None,
):
  """The rule in float64: per step "spike", "overflow" or None (applied).

  ``losses`` holds None where no loss is given. ``norms`` are the global
  gradient norms as the step computes them, in fp32: inf where the squares
  overflow fp32 even though every gradient is finite. ``grads_finite`` says
  which steps had finite gradients (default: those with a finite norm); a
  step skipped for a non-finite gradient or loss is an "overflow". A step
  with finite gradients but an inf norm is judged on that inf (a spike once
  the window is full); applied, it enters the loss window but not the norm
  window. Also returns the smallest relative distance of a judged value to
  its threshold, so a test can check that fp32 rounding cannot flip any
  decision. ``kept`` (a dict) receives the accepted values, ``{"loss":
  [...], "norm": [...]}``.

  ``scaler``, a ``(LossScaleConfig, initial scale)``, runs the loss-scale
  rule beside it; ``trace`` (a list) then receives each step's counters
  after it (`_counters`' keys): the rule of `jaxmp.adjust_loss_scale`, with
  what spikes change: a spike leaves the scale, its growth counter and the
  overflow counters as they were; a skipped step (non-finite) neither
  counts in nor ends a run of spikes; an applied step ends it.
  """
  kept = {"loss": [], "norm": []} if kept is None else kept
  kept.update(loss=[], norm=[])
  if grads_finite is None:
    grads_finite = [bool(np.isfinite(n)) for n in norms]
  if scaler is not None:
    config, scale = scaler
    counters = dict.fromkeys(_COUNTERS, 0)
    counters["loss_scale"] = float(scale)
  out, margin = [], np.inf
  for loss, norm, finite in zip(losses, norms, grads_finite, strict=True):
    loss_finite = loss is None or bool(np.isfinite(loss))
    spike = False
    for key, value in (("loss", loss), ("norm", norm)):
      if not (finite and loss_finite):
        break  # Skipped for a non-finite value: not judged.
      if value is None or len(kept[key]) < window:
        continue
      last = np.asarray(kept[key][-window:], np.float64)
      threshold = last.mean() + factor * last.std()
      margin = min(margin, abs(value - threshold) / abs(threshold))
      spike |= value > threshold
    if not (finite and loss_finite):
      out.append("overflow")
    else:
      out.append("spike" if spike else None)
    if out[-1] is None:
      if np.isfinite(norm):  # An inf norm would poison the window.
        kept["norm"].append(norm)
      if loss is not None:
        kept["loss"].append(loss)
    if scaler is not None:
      _scale_rule(config, counters, out[-1], finite, loss, window, kept)
      trace.append(dict(counters))
  return out, margin


_COUNTERS = (
  "loss_scale",
  "growth_counter",
  "consecutive_overflows",
  "skipped_steps",
  "nonfinite_loss_steps",
  "consecutive_nonfinite_loss",
  "spike_skips",
  "consecutive_spike_skips",
  "norm_count",
  "loss_count",
)


def _scale_rule(config, c, outcome, grads_finite, loss, window, kept):
  """``c``, the counters, after one step of `reference` (in place)."""
  if outcome == "spike":  # The loss-scale rule never sees it.
    c["spike_skips"] += 1
    c["consecutive_spike_skips"] += 1
    return
  if outcome is None:
    c["consecutive_spike_skips"] = 0
  count = lambda n: n if n < 2 * window else (n - window) % window + window
  c["norm_count"] = count(len(kept["norm"]))
  c["loss_count"] = count(len(kept["loss"]))
  c["skipped_steps"] += outcome == "overflow"
  if loss is not None:
    if not np.isfinite(loss):  # Nor does it see a non-finite loss.
      c["nonfinite_loss_steps"] += 1
      c["consecutive_nonfinite_loss"] += 1
      return
    c["consecutive_nonfinite_loss"] = 0
  if grads_finite:
    c["consecutive_overflows"] = 0
    c["growth_counter"] += 1
    if config.kind == "dynamic" and c["growth_counter"] >= config.period:
      c["growth_counter"] = 0
      grown = np.float32(c["loss_scale"] * config.factor)
      if np.isfinite(grown):
        c["loss_scale"] = min(float(grown), config.max_loss_scale)
    return
  c["growth_counter"] = 0
  c["consecutive_overflows"] += 1
  if config.kind == "dynamic" and (
    c["consecutive_overflows"] >= config.hysteresis
  ):
    c["loss_scale"] = max(
      c["loss_scale"] / config.factor, config.min_loss_scale
    )


def _counters(state):
  """The counters of a state that `reference`'s ``trace`` follows."""
  spikes = state.spikes
  values = (
    state.loss_scale,
    state.growth_counter,
    state.consecutive_overflows,
    state.skipped_steps,
    state.nonfinite_loss_steps,
    state.consecutive_nonfinite_loss,
    spikes.spike_skips,
    spikes.consecutive_spike_skips,
    spikes.norm_count,
    spikes.loss_count,
  )
  values = jax.device_get(values)
  return {
    k: float(v) if k == "loss_scale" else int(v)
    for k, v in zip(_COUNTERS, values)
  }


def _series(seed=0, steps=STEPS, plants=PLANTS):
  """Losses (fp32) and unscaled gradients ({"w": 4, "b": 3}) per step."""
  rng = np.random.default_rng(seed)
  w = rng.normal(size=4).astype(np.float32)
  b = rng.normal(size=3).astype(np.float32)
  losses, grads = [], []
  for t in range(steps):
    lf, gf = plants.get(t, (1.0, 1.0))
    loss = np.float32((1.0 + 0.05 * rng.normal()) * lf)
    s = (1.0 + 0.05 * rng.normal()) * gf
    grads.append({"w": w * s, "b": b * s})
    losses.append(loss)
  return losses, grads


def _opt(inner=None, window=WINDOW, **kwargs):
  return jaxmp.mixed_precision(
    inner or optax.adam(1e-2),
    loss_scale=dynamic_loss_scale(
      2.0**10, period=1000, factor=2, min_loss_scale=1.0
    ),
    skip_spikes=jaxmp.SpikeSkip(window=window, factor=FACTOR),
    **kwargs,
  )


def _run_steps(step, losses, grads, params, state, ts):
  """``params, state`` after the jitted ``step`` at each step ``t`` of ``ts``."""
  for t in ts:
    g = _scaled(grads[t], float(state.loss_scale))
    updates, state = step(g, state, params, loss=jnp.float32(losses[t]))
    params = optax.apply_updates(params, updates)
  return params, state


def _scaled(g, scale):
  """The gradients of ``loss * scale``: fp16 ``w``, fp32 ``b``."""
  with np.errstate(over="ignore", invalid="ignore"):
    return {
      "w": (g["w"] * scale).astype(np.float16),
      "b": (g["b"] * scale).astype(np.float32),
    }


def _norm(scaled, scale):
  """The float64 norm of the unscaled gradients the optimizer sees."""
  sq = sum(np.sum((np.float64(x) / scale) ** 2) for x in scaled.values())
  return np.sqrt(sq)


def _params():
  return {"w": jnp.ones(4, jnp.float16), "b": jnp.ones(3, jnp.float32)}


def _equal(a, b):
  return all(
    np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def _ring(kept, window):
  """The ring buffer holding the last ``window`` of ``kept``, as stored."""
  ring = np.zeros(window)
  for i, v in enumerate(kept):
    ring[i % window] = v
  return ring


def _run(with_loss, seed=0, kept=None, trace=None):
  """Runs the planted series; returns per-step records and the reference."""
  opt = _opt()
  params = _params()
  state = opt.init(params)
  scaler = (state.config, float(state.loss_scale))
  step = jax.jit(opt.update)
  losses, grads = _series(seed)
  records, seen_losses, seen_norms = [], [], []
  for t in range(STEPS):
    scale = float(state.loss_scale)
    g = _scaled(grads[t], scale)
    seen_norms.append(_norm(g, scale))
    seen_losses.append(float(losses[t]) if with_loss else None)
    kw = {"loss": jnp.float32(losses[t])} if with_loss else {}
    updates, new_state = step(g, state, params, **kw)
    new_params = optax.apply_updates(params, updates)
    records.append((params, state, new_params, new_state))
    params, state = new_params, new_state
  expected, margin = reference(
    seen_losses, seen_norms, WINDOW, FACTOR, kept, scaler=scaler, trace=trace
  )
  return records, expected, margin


@pytest.mark.invariant
@pytest.mark.parametrize("with_loss", [True, False])
def test_dropped_steps_match_numpy_reference_and_roll_back(with_loss):
  kept, trace = {}, []
  records, expected, margin = _run(with_loss, kept=kept, trace=trace)
  assert margin > 1e-4  # No decision is within fp32 rounding of its line.
  spikes = {t for t, e in enumerate(expected) if e == "spike"}
  # The planted spikes are there: the loss-only ones only with the loss.
  planted = {27, 41, 42} | ({20, 50} if with_loss else set())
  assert planted <= spikes
  assert not any(e == "spike" for e in expected[:WINDOW])
  assert expected[33] == "overflow"
  assert expected[17] == ("overflow" if with_loss else None)
  got = []
  for t, (params, old, new_params, new) in enumerate(records):
    applied = bool(new.step_applied)
    overflow = int(new.skipped_steps) > int(old.skipped_steps)
    got.append(None if applied else ("overflow" if overflow else "spike"))
    if not applied:  # Bit for bit as before.
      assert _equal(new_params, params), t
      assert _equal(new.inner_state, old.inner_state), t
      assert _equal(new.master_params, old.master_params), t
    # The loss scale and every counter, as the reference runs them.
    assert _counters(new) == trace[t], t
  assert got == expected
  final = jax.device_get(jaxmp.stats(records[-1][3]))
  assert final["spike_skips"] == len(spikes)
  # The overflow and the NaN loss (when given) alone.
  assert final["skipped_steps"] == (2 if with_loss else 1)
  # The overflow halved the scale; spikes and the NaN loss never moved it.
  assert final["loss_scale"] == 2.0**9
  # The windows hold the reference's last accepted values, where it put them.
  windows = records[-1][3].spikes
  np.testing.assert_allclose(
    windows.norms, _ring(kept["norm"], WINDOW), rtol=1e-6
  )
  np.testing.assert_allclose(
    windows.losses, _ring(kept["loss"], WINDOW), rtol=1e-6
  )
  count = lambda n: n if n < 2 * WINDOW else (n - WINDOW) % WINDOW + WINDOW
  assert int(windows.norm_count) == count(len(kept["norm"]))
  assert int(windows.loss_count) == count(len(kept["loss"]))


# Runs from a fresh state, each a list of unscaled gradient norms (inf: an
# inf gradient) and, where given, losses (nan: a NaN loss). One optimizer,
# one compiled step for all: window 4, period 5, hysteresis 2.
EDGES = {
  # The window one short of full judges nothing: the 3 is applied. Full, it
  # drops the 30 (and the 5th finite step grows the scale).
  "one_short": ([1.0, 1.1, 0.9, 3.0, 1.0, 1.05, 30.0], None),
  # A spike on the 5th finite step: no growth. Then overflow, spike,
  # overflow: the overflows count 1, 1, 2 (and back off, hysteresis 2), the
  # spikes 1, 1, 2 (check_health sees a run of 2); an applied step ends it.
  "spikes_and_overflows": (
    [1.0, 1.1, 0.9, 1.05, 5.0, np.inf, 5.0, np.inf, 1.0, 5.0],
    None,
  ),
  # Finite 1e20 gradients whose squares overflow fp32: an inf norm. While
  # the window fills it is applied (its loss enters the loss window) and
  # kept out of the norm window; once full, it is a spike. A NaN loss
  # between two spikes neither counts in nor ends their run.
  "nonfinite_norm": (
    [1.0, 1e20, 1.1, 0.9, 1.05, 5.0, 1e20, 1.0, 5.0, 1.0],
    [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0, np.nan, 1.01, 0.99],
  ),
}


@functools.cache
def _edge_step():
  opt = jaxmp.mixed_precision(
    optax.sgd(0.1),
    loss_scale=dynamic_loss_scale(
      2.0**10, period=5, factor=2, min_loss_scale=1.0
    ),
    hysteresis=2,
    skip_spikes=jaxmp.SpikeSkip(window=4, factor=FACTOR),
  )
  return opt, jax.jit(opt.update)


def _fp32_norm(g):
  """The norm as the step computes it: inf once fp32's squares overflow."""
  sq = np.sum(np.square(g.astype(np.float64)))
  return np.inf if sq > np.finfo(np.float32).max else np.sqrt(sq)


@pytest.mark.parametrize("name", sorted(EDGES))
def test_edges_of_the_window_and_the_loss_scale_match_the_reference(name):
  norms, losses = EDGES[name]
  opt, step = _edge_step()
  params = {"w": jnp.ones(4, jnp.float32)}
  state = opt.init(params)
  scaler = (state.config, float(state.loss_scale))
  got, counters, seen, finite = [], [], [], []
  for t, norm in enumerate(norms):
    g = np.full(4, 0.5 * norm, np.float32)  # Norm `norm`; inf: all inf.
    seen.append(_fp32_norm(g))
    finite.append(bool(np.isfinite(g).all()))
    scaled = {"w": jnp.asarray(g * np.float32(state.loss_scale))}
    kw = {} if losses is None else {"loss": jnp.float32(losses[t])}
    _, new = step(scaled, state, params, **kw)
    overflow = int(new.skipped_steps) > int(state.skipped_steps)
    applied = bool(new.step_applied)
    got.append(None if applied else ("overflow" if overflow else "spike"))
    counters.append(_counters(new))
    if name == "spikes_and_overflows" and t == 6:
      # Spike, overflow, spike: a run of 2 spikes.
      with pytest.raises(jaxmp.SpikeStallError, match=r"steps 6\.\.7 \(2 in"):
        jaxmp.check_health(new, step=t + 1, max_consecutive_skips=2)
    state = new
  kept, trace = {}, []
  expected, margin = reference(
    [None] * len(norms) if losses is None else losses,
    seen,
    4,
    FACTOR,
    kept,
    grads_finite=finite,
    scaler=scaler,
    trace=trace,
  )
  assert margin > 1e-4
  assert got == expected
  for t, (c, want) in enumerate(zip(counters, trace, strict=True)):
    diff = {k: (v, want[k]) for k, v in c.items() if v != want[k]}
    assert not diff, f"step {t} (got, reference): {diff}"
  np.testing.assert_allclose(
    state.spikes.norms, _ring(kept["norm"], 4), rtol=1e-6
  )
  np.testing.assert_allclose(
    state.spikes.losses, _ring(kept["loss"], 4), rtol=1e-6
  )
  # What each run is there for, in the reference's own terms.
  if name == "one_short":
    assert expected[3] is None and expected[6] == "spike"
  elif name == "spikes_and_overflows":
    assert expected[4:8] == ["spike", "overflow", "spike", "overflow"]
    assert trace[4]["growth_counter"] == 4 and trace[4]["loss_scale"] == 2**10
    assert [c["consecutive_overflows"] for c in trace[5:8]] == [1, 1, 2]
    assert trace[7]["loss_scale"] == 2**9
    assert [c["consecutive_spike_skips"] for c in trace[4:9]] == [1, 1, 2, 2, 0]
  else:
    assert expected[1] is None and seen[1] == np.inf
    assert expected[5:9] == ["spike", "spike", "overflow", "spike"]
    assert trace[8]["consecutive_spike_skips"] == 3
    assert trace[4]["loss_count"] == trace[4]["norm_count"] + 1


def test_constant_series_is_never_dropped_strictly_above_is():
  # std 0: a value equal to the mean is not above mean + factor * std.
  opt = _opt(optax.sgd(0.1))
  params = {"w": jnp.ones(2, jnp.float32)}
  state = opt.init(params)
  step = jax.jit(opt.update)
  # Unscaled gradient norm 1.0 and loss 1.0: their windows' mean is 1.0
  # exactly, their std 0.
  g = {"w": jnp.asarray([2.0**10, 0.0], jnp.float32)}
  for _ in range(3 * WINDOW):
    _, state = step(g, state, params, loss=jnp.float32(1.0))
    assert bool(state.step_applied)
  # The least step above the constant is a spike, in the loss or the norm.
  up = np.nextafter(np.float32(1.0), np.float32(2.0))
  _, s1 = step(g, state, params, loss=jnp.float32(up))
  bigger = {"w": jnp.asarray([2.0**10 * up, 0.0], jnp.float32)}
  _, s2 = step(bigger, state, params, loss=jnp.float32(1.0))
  assert not bool(s1.step_applied) and not bool(s2.step_applied)
  assert int(jaxmp.stats(s1)["spike_skips"]) == 1


def test_windows_fill_separately_and_norm_alone_without_loss():
  opt = _opt(optax.sgd(0.1))
  params = {"w": jnp.ones(2, jnp.float32)}
  state = opt.init(params)
  step = jax.jit(opt.update)
  g = lambda s: {"w": jnp.asarray([s, -s], jnp.float32) * 2.0**10}
  rng = np.random.default_rng(1)
  # TrainState.apply_gradients gives no loss: the norm window fills alone.
  for _ in range(WINDOW + 2):
    _, state = step(g(1 + 0.01 * rng.normal()), state, params)
  assert int(state.spikes.norm_count) == WINDOW + 2
  assert int(state.spikes.loss_count) == 0
  np.testing.assert_array_equal(state.spikes.losses, np.zeros(WINDOW))
  # Now with losses: a loss spike before the loss window fills goes through.
  for t in range(WINDOW):
    loss = 100.0 if t == 2 else 1 + 0.01 * rng.normal()
    _, state = step(g(1.0), state, params, loss=jnp.float32(loss))
    assert bool(state.step_applied), t
  assert int(state.spikes.loss_count) == WINDOW
  # The norm window judged all along: a norm spike without loss= drops.
  _, dropped = step(g(10.0), state, params)
  assert not bool(dropped.step_applied)
  assert int(dropped.spikes.loss_count) == WINDOW


def test_rollback_if_skipped_and_check_health_on_spikes():
  opt = _opt(optax.sgd(0.1))
  params = {"w": jnp.ones(2, jnp.float32)}
  state = opt.init(params)
  step = jax.jit(opt.update)
  g = {"w": jnp.full(2, 2.0**10, jnp.float32)}
  for _ in range(WINDOW):
    _, state = step(g, state, params, loss=jnp.float32(1.0))
  for t in range(3):  # A lasting jump: every step is dropped.
    _, state = step(g, state, params, loss=jnp.float32(5.0))
    kept = jaxmp.rollback_if_skipped(state, {"m": 1.0}, {"m": 0.0})
    assert float(kept["m"]) == 0.0
  stats = jax.device_get(jaxmp.stats(state))
  assert (stats["spike_skips"], stats["consecutive_spike_skips"]) == (3, 3)
  assert stats["skipped_steps"] == 0
  jaxmp.check_health(state, step=WINDOW + 3, max_consecutive_skips=4)
  with pytest.raises(jaxmp.SpikeStallError, match=r"steps 9\.\.11 \(3 in"):
    jaxmp.check_health(state, step=WINDOW + 3, max_consecutive_skips=3)
  _, state = step(g, state, params, loss=jnp.float32(1.0))
  assert int(jaxmp.stats(state)["consecutive_spike_skips"]) == 0


def test_off_by_default_and_stats_zero():
  opt = jaxmp.mixed_precision(optax.sgd(0.1))
  state = opt.init({"w": jnp.ones(2)})
  assert state.spikes is None
  assert int(jaxmp.stats(state)["spike_skips"]) == 0


@pytest.mark.invariant
def test_state_survives_jit_and_numpy_round_trip_bit_for_bit():
  opt = _opt()
  params = _params()
  state = opt.init(params)
  assert jax.tree_util.tree_leaves(jaxmp.SpikeSkip()) == []
  same = jax.jit(lambda s: s)(state)
  assert jax.tree.structure(same) == jax.tree.structure(state)
  step = jax.jit(opt.update)
  losses, grads = _series(seed=2)

  run = functools.partial(_run_steps, step, losses, grads)

  params, state = run(params, state, range(30))
  # A checkpoint: to numpy and back (what orbax stores, leaf by leaf).
  saved = jax.device_get((params, state))
  restored = jax.tree.map(jnp.asarray, saved)
  assert jax.tree.structure(restored) == jax.tree.structure((params, state))
  a = run(*restored, range(30, STEPS))
  b = run(params, state, range(30, STEPS))
  assert int(b[1].spikes.spike_skips) >= 3  # The resumed part drops spikes.
  assert _equal(a, b)


def test_composes_with_multi_steps():
  k = 2
  opt = jaxmp.multi_steps(_opt(), k)
  params = _params()
  state = opt.init(params)
  step = jax.jit(opt.update)
  losses, grads = _series(seed=3, steps=STEPS * k // 2, plants={})
  n_windows = len(grads) // k
  plants = {12: (1.0, 5.0), 20: (3.0, 1.0), 21: (3.0, 1.0)}
  seen_losses, seen_norms, got = [], [], []
  for window in range(n_windows):
    lf, gf = plants.get(window, (1.0, 1.0))
    before = params
    mp = jaxmp.find_state(state)
    scale = float(mp.loss_scale)
    micro = []
    for i in range(k):
      g = jax.tree.map(lambda x: x * gf, grads[window * k + i])
      micro.append(_scaled(g, scale))
      loss = jnp.float32(losses[window * k + i] * lf)
      updates, state = step(micro[-1], state, params, loss=loss)
      params = optax.apply_updates(params, updates)
    mean = {
      key: (micro[0][key].astype(np.float64) + micro[1][key]) / 2
      for key in micro[0]
    }
    seen_norms.append(_norm(mean, scale))
    seen_losses.append(float(loss))  # The window's last microbatch's.
    applied = bool(jaxmp.find_state(state).step_applied)
    got.append(None if applied else "spike")
    if not applied:
      assert _equal(params, before)
      # As documented: the dropped window's (finite) microbatches keep
      # their statistics; only an overflowed microbatch's are rolled back.
      kept = jaxmp.rollback_if_skipped(state, jnp.ones(()), jnp.zeros(()))
      assert float(kept) == 1.0
  expected, margin = reference(seen_losses, seen_norms, WINDOW, FACTOR)
  assert margin > 1e-4
  assert {12, 20, 21} <= {t for t, e in enumerate(expected) if e}
  assert got == expected
  assert int(jaxmp.stats(state)["spike_skips"]) == got.count("spike")


def _mesh():
  return Mesh(np.array(jax.devices()[:4]), ("data",))


def _sharded_series():
  """Gradients of a sharded fp16 param and of a replicated fp32 one, losses.

  ``w`` (8 elements) is sharded over 4 devices; ``b`` is given per device
  (pmean-ed in the step), and so is the loss (its mean is the step's loss).
  """
  rng = np.random.default_rng(4)
  w = rng.normal(size=8).astype(np.float32)
  b = rng.normal(size=(4, 2)).astype(np.float32)
  plants = {14: (1.0, 5.0), 22: (3.0, 1.0), 30: (4.0, 4.0)}
  out = []
  for t in range(32):
    lf, gf = plants.get(t, (1.0, 1.0))
    s = (1.0 + 0.05 * rng.normal()) * gf
    loss = ((1.0 + 0.05 * rng.normal(size=4)) * lf).astype(np.float32)
    out.append(({"w": w * s, "b": b * s}, loss))
  return out


def _sharded_reference(series, scale, kept=None):
  losses, norms = [], []
  for g, loss in series:
    w = (g["w"] * scale).astype(np.float16).astype(np.float64) / scale
    b = (g["b"] * scale).astype(np.float32).astype(np.float64).mean(0) / scale
    norms.append(np.sqrt(np.sum(w**2) + np.sum(b**2)))
    losses.append(float(np.mean(loss.astype(np.float64))))
  return reference(losses, norms, 6, FACTOR, kept)


@pytest.mark.devices(4)
def test_shard_map_with_axis_name_decides_globally():
  mesh = _mesh()
  # A window of 6: its buffers must not look like the sharded (8,) leaves.
  opt = jaxmp.mixed_precision(
    optax.sgd(0.1, momentum=0.9),
    loss_scale=8.0,
    skip_spikes=jaxmp.SpikeSkip(window=6, factor=FACTOR),
    axis_name="data",
  )
  params = {"w": jnp.ones(8, jnp.float16), "b": jnp.ones(2, jnp.float32)}
  state = opt.init(params)
  specs = jax.tree.map(lambda x: P("data") if x.shape == (8,) else P(), state)
  pspecs = {"w": P("data"), "b": P()}

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(pspecs | {"b": P("data")}, P("data"), specs, pspecs),
    out_specs=(pspecs, specs),
  )
  def step(grads, loss, state, params):
    # w's gradient is a shard (FSDP); b's is each device's own, averaged.
    grads = {"w": grads["w"], "b": jax.lax.pmean(grads["b"][0], "data")}
    updates, state = opt.update(grads, state, params, loss=loss[0])
    return optax.apply_updates(params, updates), state

  step = jax.jit(step)
  series = _sharded_series()
  got = []
  for g, loss in series:
    scaled = {
      "w": jnp.asarray((g["w"] * 8.0).astype(np.float16)),
      "b": jnp.asarray(g["b"] * 8.0),
    }
    old = params
    params, state = step(scaled, jnp.asarray(loss), state, params)
    got.append(None if bool(state.step_applied) else "spike")
    if got[-1]:
      assert _equal(params, old)
  kept = {}
  expected, margin = _sharded_reference(series, 8.0, kept)
  assert margin > 1e-4
  assert {14, 22, 30} <= {t for t, e in enumerate(expected) if e}
  assert got == expected
  # The global norm (the shards' squares summed) and the mean loss.
  np.testing.assert_allclose(
    state.spikes.norms, _ring(kept["norm"], 6), rtol=1e-6
  )
  np.testing.assert_allclose(
    state.spikes.losses, _ring(kept["loss"], 6), rtol=1e-6
  )
  # out_specs P() (checked by shard_map) for the windows: one on all devices.
  for leaf in jax.tree.leaves(state.spikes):
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert all(np.array_equal(s, shards[0]) for s in shards)


@pytest.mark.devices(4)
def test_jit_with_sharded_params_decides_as_one_device():
  mesh = _mesh()
  opt = jaxmp.mixed_precision(
    optax.sgd(0.1, momentum=0.9),
    loss_scale=8.0,
    skip_spikes=jaxmp.SpikeSkip(window=6, factor=FACTOR),
  )
  params = {"w": jnp.ones(8, jnp.float16), "b": jnp.ones(2, jnp.float32)}
  shard = NamedSharding(mesh, P("data"))
  sharded_params = {"w": jax.device_put(params["w"], shard), "b": params["b"]}
  series = _sharded_series()

  def run(params, place):
    state = opt.init(params)
    step = jax.jit(opt.update)
    flags = []
    for g, loss in series:
      grads = {
        "w": place(jnp.asarray((g["w"] * 8.0).astype(np.float16))),
        "b": jnp.asarray(g["b"].mean(0) * 8.0),
      }
      loss = jnp.float32(loss.astype(np.float64).mean())
      updates, state = step(grads, state, params, loss=loss)
      params = optax.apply_updates(params, updates)
      flags.append(None if bool(state.step_applied) else "spike")
    return flags, params, state

  one, p1, _ = run(params, lambda x: x)
  many, p2, s2 = run(sharded_params, lambda x: jax.device_put(x, shard))
  assert len(p2["w"].addressable_shards) == 4
  assert one == many and one.count("spike") >= 3
  np.testing.assert_array_equal(p1["w"], p2["w"])
  for leaf in jax.tree.leaves(s2.spikes):
    assert leaf.sharding.is_fully_replicated


def test_misuse_errors():
  for bad, err in (
    (dict(window=1), ValueError),
    (dict(window=2.5), TypeError),
    (dict(window="8"), TypeError),
    (dict(factor=0.0), ValueError),
    (dict(factor=-1.0), ValueError),
    (dict(factor=float("nan")), ValueError),
    (dict(factor=float("inf")), ValueError),
    (dict(factor="six"), TypeError),
  ):
    with pytest.raises(err, match="SpikeSkip"):
      jaxmp.SpikeSkip(**bad)
  with pytest.raises(TypeError, match="jaxmp.SpikeSkip"):
    jaxmp.mixed_precision(optax.sgd(0.1), skip_spikes=(128, 6.0))
  params = {"w": jnp.ones(2)}
  g = {"w": jnp.ones(2)}
  plain = jaxmp.mixed_precision(optax.sgd(0.1))
  spiky = _opt(optax.sgd(0.1))
  with pytest.raises(ValueError, match="without spike windows"):
    jax.eval_shape(spiky.update, g, plain.init(params), params)
  # The error's recipe turns spike skipping on for an existing state.
  old = plain.init(params)._replace(spikes=spiky.init(params).spikes)
  _, new = jax.jit(spiky.update)(g, old, params)
  assert int(new.spikes.norm_count) == 1
  with pytest.raises(ValueError, match="has no skip_spikes"):
    jax.eval_shape(plain.update, g, spiky.init(params), params)
  with pytest.raises(ValueError, match="window=4"):
    four = _opt(optax.sgd(0.1), window=4)
    jax.eval_shape(four.update, g, spiky.init(params), params)
  with pytest.raises(ValueError, match="scalar loss"):
    jax.eval_shape(
      functools.partial(spiky.update, loss=jnp.ones(3)),
      g,
      spiky.init(params),
      params,
    )


def test_flax_train_state_apply_gradients_without_loss():
  # TrainState.apply_gradients calls tx.update(grads, opt_state, params):
  # no loss reaches the transform; the gradient norm alone decides.
  train_state = pytest.importorskip("flax.training.train_state")
  state = train_state.TrainState.create(
    apply_fn=None, params=_params(), tx=_opt()
  )
  apply = jax.jit(lambda s, g: s.apply_gradients(grads=g))
  _, grads = _series(seed=5, plants={12: (1.0, 5.0), 13: (9.0, 1.0)})
  norms, flags = [], []
  for t, g in enumerate(grads[:20]):
    scale = float(jaxmp.stats(state.opt_state)["loss_scale"])
    scaled = _scaled(g, scale)
    norms.append(_norm(scaled, scale))
    old = state
    state = apply(state, scaled)
    applied = bool(jaxmp.stats(state.opt_state)["step_applied"])
    flags.append(None if applied else "spike")
    if not applied:
      assert _equal(state.params, old.params)
  expected, margin = reference([None] * 20, norms, WINDOW, FACTOR)
  assert margin > 1e-4 and expected[12] == "spike"
  assert flags == expected
  assert int(jaxmp.find_state(state.opt_state).spikes.loss_count) == 0


@pytest.mark.devices(4)
def test_pmap_with_axis_name_decides_alike():
  opt = jaxmp.mixed_precision(
    optax.sgd(0.1),
    loss_scale=8.0,
    skip_spikes=jaxmp.SpikeSkip(window=6, factor=FACTOR),
    axis_name="data",
  )
  params = {"w": jnp.ones(8, jnp.float16), "b": jnp.ones(2, jnp.float32)}
  rep = lambda t: jax.tree.map(lambda x: jnp.stack([x] * 4), t)
  state = rep(opt.init(params))
  params = rep(params)

  def step(grads, loss, state, params):
    # Data parallel: each device's gradients, pmean-ed; each device's own
    # loss as it is (pmap's types cannot say it varies: the largest counts).
    grads = jax.lax.pmean(grads, "data")
    updates, state = opt.update(grads, state, params, loss=loss)
    return optax.apply_updates(params, updates), state

  step = jax.pmap(step, axis_name="data", devices=jax.devices()[:4])
  series = _sharded_series()
  got = []
  for g, loss in series:
    # Each device: the whole w gradient (a quarter of it each, summing to
    # the global one), its own b gradient and loss.
    w = np.stack([g["w"] * 4 * (i == 0) for i in range(4)])
    grads = {"w": (w * 8.0).astype(np.float16), "b": g["b"] * 8.0}
    params, state = step(grads, loss, state, params)
    flags = np.asarray(state.step_applied)
    assert flags.all() or not flags.any()  # One decision everywhere.
    got.append(None if flags[0] else "spike")
  kept = {}
  losses = [float(np.max(loss)) for _, loss in series]
  norms = []
  for g, _ in series:
    w = (g["w"] * 32.0).astype(np.float16).astype(np.float64) / 32.0
    b = (g["b"] * 8.0).astype(np.float64).mean(0) / 8.0
    norms.append(np.sqrt(np.sum(w**2) + np.sum(b**2)))
  expected, margin = reference(losses, norms, 6, FACTOR, kept)
  assert margin > 1e-4 and got == expected
  windows = {"norm": state.spikes.norms, "loss": state.spikes.losses}
  for key, window in windows.items():  # The same on the 4 devices.
    want = np.stack([_ring(kept[key], 6)] * 4)
    np.testing.assert_allclose(window, want, rtol=1e-6)


@pytest.mark.devices(4)
def test_pmap_per_device_gradients_one_device_spiking_decide_alike():
  """Each device's own gradients, no ``pmean``: the largest norm decides.

  pmap's types cannot say what varies, so the norm is ``pmax``-ed: a spike
  on one device drops the step on all four, and their windows stay one.
  """
  opt = jaxmp.mixed_precision(
    optax.sgd(0.1),
    loss_scale=8.0,
    skip_spikes=jaxmp.SpikeSkip(window=4, factor=FACTOR),
    axis_name="data",
  )
  rep = lambda t: jax.tree.map(lambda x: jnp.stack([x] * 4), t)
  params = {"w": jnp.ones(4, jnp.float32)}
  state, params = rep(opt.init(params)), rep(params)

  def step(grads, state, params):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.pmap(step, axis_name="data", devices=jax.devices()[:4])
  rng = np.random.default_rng(7)
  w = rng.normal(size=4)
  sizes = 1.0 + 0.05 * rng.normal(size=(10, 4))  # (step, device)
  sizes[6, 2] = sizes[8, 0] = 10.0  # One device spikes, then another.
  got, norms = [], []
  for size in sizes:
    g = (size[:, None] * w * 8.0).astype(np.float32)  # Scaled by 8.
    norms.append(np.sqrt(np.sum((g.astype(np.float64) / 8) ** 2, 1)).max())
    params, state = step({"w": g}, state, params)
    flags = np.asarray(state.step_applied)
    assert flags.all() or not flags.any(), (len(got), flags)
    got.append(None if flags[0] else "spike")
  kept = {}
  expected, margin = reference([None] * 10, norms, 4, FACTOR, kept)
  assert margin > 1e-4 and got == expected
  assert expected[6] == expected[8] == "spike"
  want = np.stack([_ring(kept["norm"], 4)] * 4)
  np.testing.assert_allclose(state.spikes.norms, want, rtol=1e-6)


@pytest.mark.devices(4)
def test_shard_map_over_two_axis_names_sums_each_leaf_where_it_varies():
  """A (data, fsdp) mesh with ``axis_name=("data", "fsdp")``.

  ``w`` varies over fsdp only (sharded there, replicated over data), ``u``
  over data only, ``v`` over both, ``b`` over neither (each data replica's
  own gradient, ``pmean``-ed): each leaf's squares are summed over the axes
  it varies over and no other, and the norm is the global one.
  """
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "fsdp"))
  opt = jaxmp.mixed_precision(
    optax.sgd(0.1, momentum=0.9),
    loss_scale=8.0,
    skip_spikes=jaxmp.SpikeSkip(window=6, factor=FACTOR),
    axis_name=("data", "fsdp"),
  )
  shapes = {"w": 8, "u": 4, "v": 16, "b": 2}
  pspecs = {"w": P("fsdp"), "u": P("data"), "v": P(("data", "fsdp")), "b": P()}
  params = {k: jnp.ones(n, jnp.float32) for k, n in shapes.items()}
  params["w"] = params["w"].astype(jnp.float16)
  state = opt.init(params)
  by_shape = {(shapes[k],): pspecs[k] for k in pspecs}
  specs = jax.tree.map(lambda x: by_shape.get(x.shape, P()), state)

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(pspecs | {"b": P("data")}, specs, pspecs),
    out_specs=(pspecs, specs),
  )
  def step(grads, state, params):
    grads = grads | {"b": jax.lax.pmean(grads["b"][0], "data")}
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step)
  rng = np.random.default_rng(8)
  base = {k: rng.normal(size=n) for k, n in shapes.items()}
  base["b"] = rng.normal(size=(2, 2))  # One gradient per data replica.
  got, norms = [], []
  for t in range(14):
    size = {k: 1.0 + 0.05 * rng.normal() for k in shapes}
    if t in (8, 11):  # A spike in one leaf: w, then u.
      size["w" if t == 8 else "u"] = 8.0
    g = {k: (base[k] * size[k] * 8.0).astype(np.float32) for k in shapes}
    g["w"] = g["w"].astype(np.float16)
    unscaled = {k: x.astype(np.float64) / 8 for k, x in g.items()}
    unscaled["b"] = unscaled["b"].mean(0)
    norms.append(np.sqrt(sum(np.sum(x**2) for x in unscaled.values())))
    params, state = step(g, state, params)
    got.append(None if bool(state.step_applied) else "spike")
  kept = {}
  expected, margin = reference([None] * 14, norms, 6, FACTOR, kept)
  assert margin > 1e-4
  assert expected[8] == expected[11] == "spike"
  assert got == expected
  np.testing.assert_allclose(
    state.spikes.norms, _ring(kept["norm"], 6), rtol=1e-6
  )


@pytest.mark.invariant
def test_orbax_round_trip_resumes_bit_for_bit(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  opt = _opt()
  step = jax.jit(opt.update)
  losses, grads = _series(seed=6)

  run = functools.partial(_run_steps, step, losses, grads)

  params = _params()
  params, state = run(params, opt.init(params), range(30))
  assert int(state.spikes.spike_skips) >= 1  # Windows full, a spike seen.
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    ckpt.wait_until_finished()
    target = jax.eval_shape(lambda: {"params": params, "opt_state": state})
    restored = ckpt.restore(tmp_path / "ckpt", target)
  assert isinstance(restored["opt_state"], jaxmp.MixedPrecisionState)
  assert _equal(restored["opt_state"].spikes, state.spikes)
  a = run(restored["params"], restored["opt_state"], range(30, STEPS))
  b = run(params, state, range(30, STEPS))
  assert int(b[1].spikes.spike_skips) > int(state.spikes.spike_skips)
  assert _equal(a, b)


def test_flax_nnx_optimizer():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0), param_dtype=jnp.float16)
  tx = jaxmp.mixed_precision(
    optax.sgd(0.01),
    loss_scale=64.0,
    skip_spikes=jaxmp.SpikeSkip(window=4, factor=FACTOR),
  )
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x):
    loss_fn = lambda m: jnp.mean(jnp.square(m(x).astype(jnp.float32)))
    loss, grads = jaxmp.value_and_grad(loss_fn)(model, opt.opt_state)
    opt.update(model, grads, loss=loss)

  applied = []
  for x in [1.0, 1.1, 0.9, 1.0, 1.05, 8.0, 1.0]:  # 8.0: a spike
    before = nnx.clone(nnx.state(model, nnx.Param))
    step(model, opt, jnp.full((4, 3), x, jnp.float16))
    applied.append(bool(jaxmp.stats(opt.opt_state)["step_applied"][...]))
    if not applied[-1]:
      assert _equal(nnx.state(model, nnx.Param), before)
  assert applied == [True] * 5 + [False, True]
  stats = jax.device_get(nnx.as_pure(jaxmp.stats(opt.opt_state)))
  assert (stats["spike_skips"], stats["skipped_steps"]) == (1, 0)
  jaxmp.check_health(opt.opt_state, step=7)
