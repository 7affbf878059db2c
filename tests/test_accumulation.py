"""Tests of `jaxmp.multi_steps`: windows, fp32 means, caller-state rollback."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _helpers import dynamic_loss_scale
import jaxmp

# These tests give update gradients made by hand (scaled or not, on
# purpose), as code that scales the loss by hand does: the documented
# silence of the unscaled-gradients warning.
pytestmark = pytest.mark.filterwarnings(
  "ignore::jaxmp.UnscaledGradientsWarning"
)


def _run_windows(wrapper, values, k, stats0=0.0):
  """Runs microbatches with gradient ``value * scale`` and stats ``value``.

  The "forward pass" of each microbatch writes ``value`` into the caller's
  statistics (NaN for an overflowed one, as fp16 BatchNorm statistics of an
  overflowed forward pass are), which `rollback_if_skipped` then filters.

  Returns:
    (loss scales used, param after each microbatch, stats after each
    microbatch, final state).
  """
  opt = wrapper(
    jaxmp.mixed_precision(
      optax.sgd(1.0),
      loss_scale=dynamic_loss_scale(
        8.0, period=5, factor=2, min_loss_scale=1.0
      ),
    ),
    k,
  )
  params = {"w": jnp.ones(2, jnp.float16)}
  state = opt.init(params)
  stats = {"mean": jnp.float32(stats0)}

  @jax.jit
  def step(params, state, stats, value):
    scale = jaxmp.stats(state)["loss_scale"]
    grads = {"w": jnp.full(2, value * scale, jnp.float16)}
    new_stats = {"mean": jnp.where(jnp.isfinite(value), value, jnp.nan)}
    updates, state = opt.update(grads, state, params)
    stats = jaxmp.rollback_if_skipped(state, new_stats, stats)
    return optax.apply_updates(params, updates), state, stats, scale

  scales, trajectory, seen = [], [], []
  for v in values:
    params, state, stats, scale = step(params, state, stats, jnp.float32(v))
    scales.append(float(scale))
    trajectory.append(float(params["w"][0]))
    seen.append(float(stats["mean"]))
  return scales, trajectory, seen, state


class TestWindows:
  def test_skips_whole_window_one_scale(self):
    # Window 1: microbatch 2 overflows -> whole window skipped.
    # Window 2: all finite -> mean gradient applied once.
    scales, trajectory, _, state = _run_windows(
      jaxmp.multi_steps, [1.0, np.inf, 1.0, 1.0, 2.0, 3.0], k=3
    )
    assert scales == [8.0, 8.0, 8.0, 4.0, 4.0, 4.0]
    assert trajectory == [1.0, 1.0, 1.0, 1.0, 1.0, -1.0]  # 1 - mean(1, 2, 3)
    assert int(jaxmp.stats(state)["skipped_steps"]) == 1

  def test_optax_multisteps_stays_nan_after_an_overflow(self):
    # Pins optax's flaw that jaxmp.multi_steps fixes: 0 * inf keeps the
    # accumulator NaN, so the finite second window is skipped too.
    opt = optax.MultiSteps(
      jaxmp.mixed_precision(
        optax.sgd(1.0),
        loss_scale=dynamic_loss_scale(
          8.0, period=5, factor=2, min_loss_scale=1.0
        ),
      ),
      3,
    )
    params = {"w": jnp.ones(2, jnp.float16)}
    state = opt.init(params)
    step = jax.jit(opt.update)
    for g in [1.0, np.inf, 1.0, 1.0, 2.0, 3.0]:
      scale = float(jaxmp.stats(state)["loss_scale"])
      updates, state = step(
        {"w": jnp.full(2, g * scale, jnp.float16)}, state, params
      )
      params = optax.apply_updates(params, updates)
    assert float(params["w"][0]) == 1.0
    assert int(jaxmp.stats(state)["skipped_steps"]) == 2

  def test_multisteps_inside_is_rejected(self):
    inner = optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation()
    with pytest.raises(ValueError, match="MultiSteps"):
      jaxmp.mixed_precision(inner).init({"w": jnp.ones(1)})

  def test_should_skip_update_fn_drops_a_microbatch(self):
    # With optax's skip_not_finite the overflowed microbatch never happened:
    # the window waits for another one, and its statistics are rolled back.
    wrapper = lambda opt, k: jaxmp.multi_steps(
      opt, k, should_skip_update_fn=optax.skip_not_finite
    )
    scales, trajectory, seen, state = _run_windows(
      wrapper, [1.0, np.inf, 3.0, 2.0, 4.0], k=2, stats0=-1.0
    )
    assert seen == [1.0, 1.0, 3.0, 2.0, 4.0]
    assert trajectory == [1.0, 1.0, -1.0, -1.0, -4.0]  # -= mean(1, 3), (2, 4)
    assert scales == [8.0] * 5
    assert int(jaxmp.stats(state)["skipped_steps"]) == 0

  def test_accessors_see_through_the_state(self):
    opt = jaxmp.multi_steps(
      jaxmp.mixed_precision(
        optax.sgd(1.0),
        loss_scale=dynamic_loss_scale(
          16.0, period=5, factor=2, min_loss_scale=1.0
        ),
      ),
      2,
    )
    params = {"w": jnp.ones(2, jnp.float16)}
    state = jax.jit(lambda s: s)(opt.init(params))
    assert float(jaxmp.scale_loss(jnp.float16(3.0), state)) == 48.0
    assert float(jaxmp.loss_scaler(state).loss_scale) == 16.0
    assert jaxmp.find_state(state).config.kind == "dynamic"
    assert jaxmp.master_params(state)["w"].dtype == jnp.float32


class TestRollback:
  def test_finite_microbatch_after_a_skipped_window_is_kept(self):
    # The order: [1, inf] is skipped, then [2, 3] is applied. The
    # stale window flag used to throw away microbatch 3's statistics.
    _, trajectory, seen, _ = _run_windows(
      jaxmp.multi_steps, [1.0, np.inf, 2.0, 3.0], k=2
    )
    assert seen == [1.0, 1.0, 2.0, 3.0]
    assert trajectory == [1.0, 1.0, 1.0, -1.5]  # 1 - mean(2, 3)

  def test_overflowed_microbatch_never_reaches_the_stats(self):
    # The other order: [inf, 1] is skipped. The stale flag used to let the
    # NaN statistics of microbatch 1 through (and then keep them at the
    # window end, where ``old`` was already NaN).
    _, trajectory, seen, state = _run_windows(
      jaxmp.multi_steps, [np.inf, 1.0, 2.0, 3.0], k=2
    )
    assert seen == [0.0, 1.0, 2.0, 3.0]
    assert trajectory == [1.0, 1.0, 1.0, -1.5]
    assert int(jaxmp.stats(state)["skipped_steps"]) == 1

  @pytest.mark.parametrize("k", [1, 3])
  def test_every_overflowed_microbatch_rolls_back(self, k):
    rng = np.random.default_rng(k)
    values = np.where(rng.random(12) < 0.3, np.inf, rng.integers(1, 9, 12))
    _, _, seen, state = _run_windows(jaxmp.multi_steps, values, k=k)
    expected, last = [], 0.0
    for v in values:
      last = v if np.isfinite(v) else last
      expected.append(float(last))
    assert seen == expected
    windows = np.isinf(values).reshape(-1, k).any(axis=1)
    assert int(jaxmp.stats(state)["skipped_steps"]) == int(windows.sum())

  def test_optax_multisteps_outside_is_rejected(self):
    opt = optax.MultiSteps(jaxmp.mixed_precision(optax.sgd(1.0)), 2)
    state = opt.init({"w": jnp.ones(2, jnp.float16)})
    with pytest.raises(ValueError, match=r"jaxmp\.multi_steps"):
      jaxmp.rollback_if_skipped(state, 1.0, 0.0)


class _Capture(NamedTuple):
  seen: optax.Updates


def _capture():
  """An optimizer that records the gradients it is given (and applies none)."""
  return optax.GradientTransformation(
    lambda p: _Capture(jax.tree.map(jnp.zeros_like, p)),
    lambda u, s, p=None: (jax.tree.map(jnp.zeros_like, u), _Capture(u)),
  )


class TestFp32Mean:
  @pytest.mark.parametrize("use_grad_mean", [True, False])
  def test_window_mean_reaches_the_optimizer_in_fp32(self, use_grad_mean):
    k, n, scale = 4, 256, 2.0**10
    opt = jaxmp.multi_steps(
      jaxmp.mixed_precision(
        _capture(),
        loss_scale=dynamic_loss_scale(
          scale, period=5, factor=2, min_loss_scale=1.0
        ),
      ),
      k,
      use_grad_mean=use_grad_mean,
    )
    params = {"w": jnp.ones(n, jnp.float16)}
    state = opt.init(params)
    rng = np.random.default_rng(0)
    micro = rng.normal(0.0, 1.0, (k, n)).astype(np.float16)
    step = jax.jit(opt.update)
    for g in micro:
      _, state = step({"w": jnp.asarray(g * np.float16(scale))}, state, params)
    seen = jaxmp.find_state(state).inner_state.seen["w"]
    assert seen.dtype == jnp.float32
    want = micro.astype(np.float64).sum(0) / (k if use_grad_mean else 1)
    # k fp32 roundings of partial results no larger than k * max |g|; an
    # fp16 rounding of the mean alone would be ~2**-11 * |mean|.
    bound = k * 2.0**-24 * k * np.abs(micro.astype(np.float64)).max(
      0
    ) + 2.0**-24 * np.abs(want)
    err = np.abs(np.asarray(seen, np.float64) - want)
    assert np.all(err <= bound), (err / np.abs(want)).max()


@pytest.mark.devices(4)
@pytest.mark.parametrize("reduce", [True, False])
def test_shard_map_microbatch_flag_is_global(reduce):
  # Under shard_map (default check_vma), with gradients that are and are not
  # pmean-ed, axis_name makes every device roll the same microbatches back.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
  P = jax.sharding.PartitionSpec
  mp = jaxmp.mixed_precision(
    optax.sgd(1.0),
    loss_scale=dynamic_loss_scale(8.0, period=5, factor=2, min_loss_scale=1.0),
    axis_name="data",
  )
  opt = jaxmp.multi_steps(mp, 2, axis_name="data")
  params = {"w": jnp.ones(2, jnp.float16)}
  state = opt.init(params)
  # Unreduced gradients make params and accumulators per device: carry
  # array leaves device-stacked (P("data")), scalars replicated.
  stack = lambda t: jax.tree.map(
    lambda x: jnp.tile(x, 4) if np.ndim(x) and not reduce else x, t
  )
  specs = lambda t: jax.tree.map(
    lambda x: P("data") if np.ndim(x) and not reduce else P(), t
  )
  params, state = stack(params), stack(state)

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P("data"), specs(state), specs(params), P("data")),
    out_specs=(specs(params), specs(state), P("data")),
  )
  def step(local, state, params, stats):
    g = jax.lax.pmean(local[0], "data") if reduce else local[0]
    updates, state = opt.update({"w": g}, state, params)
    new_stats = jnp.where(jnp.isfinite(local[0, 0]), local[0, 0], jnp.nan)
    stats = jaxmp.rollback_if_skipped(state, new_stats[None], stats)
    return optax.apply_updates(params, updates), state, stats

  stats = jnp.zeros(4)
  seen, scales = [], []
  # Microbatch 1 overflows on device 3 only; microbatches 2-4 are finite.
  for t in range(4):
    g = np.full((4, 2), 8.0 * (t + 1), np.float16)
    if t == 0:
      g[3] = np.inf
    params, state, stats = jax.jit(step)(jnp.asarray(g), state, params, stats)
    seen.append(stats.tolist())
    scales.append(float(jaxmp.stats(state)["loss_scale"]))
  assert seen == [[0.0] * 4, [16.0] * 4, [24.0] * 4, [32.0] * 4]
  assert scales == [8.0, 4.0, 4.0, 4.0]
  # Window 1 skipped, window 2 applied: 1 - mean(24, 32) / 4 on every device.
  assert params["w"].tolist() == [-6.0] * (2 if reduce else 8)
