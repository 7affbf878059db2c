"""Tests of `jaxmp.mixed_precision`: scale rule, skips, masters, jit trips."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import jmp
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


def _scale_trajectory(pattern, **kwargs):
  """Runs mixed_precision on a 1-param problem; returns the scale per step."""
  loss_scale = kwargs.pop("loss_scale")
  opt = jaxmp.mixed_precision(optax.sgd(0.1), loss_scale=loss_scale, **kwargs)
  params = {"w": jnp.zeros(2, jnp.float32)}
  state = opt.init(params)

  @jax.jit
  def step(state, bad):
    grads = {"w": jnp.where(bad, jnp.inf, 1.0) * jnp.ones(2)}
    _, state = opt.update(grads, state, params)
    return state

  used, finite = [], []
  for bad in pattern:
    used.append(float(state.loss_scale))
    state = step(state, jnp.asarray(bad))
    finite.append(bool(state.step_applied))
  return used, finite, state


def _grad_scaler_rule(pattern, init, growth_interval, factor, hysteresis=1):
  """torch.amp.GradScaler's documented update rule, in plain Python (float64).

  GradScaler (``growth_factor=factor, backoff_factor=1/factor``): an overflow
  multiplies the scale by ``backoff_factor`` and resets the growth tracker;
  the ``growth_interval``-th finite step in a row multiplies it by
  ``growth_factor`` where that stays finite. ``hysteresis`` > 1 is
  DeepSpeed's ``DynamicLossScaler(delayed_shift=hysteresis,
  consecutive_hysteresis=True)``: the back-off waits for the
  ``hysteresis``-th overflow in a row, and any finite step resets the count.
  """
  scale, tracker, overflows, used = float(init), 0, 0, []
  for found_inf in pattern:
    used.append(scale)
    if found_inf:
      tracker = 0
      overflows += 1
      if overflows >= hysteresis:
        scale *= 1.0 / factor
    else:
      overflows = 0
      tracker += 1
      if tracker == growth_interval:
        if math.isfinite(scale * factor):
          scale *= factor
        tracker = 0
  return used


def _overflow_pattern(n, seed, p_bad=0.15, runs=False):
  """A scripted overflow pattern; ``runs`` adds runs of 2-4 overflows."""
  rng = np.random.default_rng(seed)
  pattern = list(rng.random(n) < p_bad)
  if runs:
    for start in rng.choice(n - 4, size=n // 25, replace=False):
      length = int(rng.integers(2, 5))
      pattern[start : start + length] = [True] * length
  return pattern


class TestLossScaleRule:
  def test_growth_closed_form_over_150_steps(self):
    used, finite, state = _scale_trajectory(
      [False] * 150,
      loss_scale=dynamic_loss_scale(
        1.0, period=7, factor=2, min_loss_scale=1.0
      ),
      max_loss_scale=None,
    )
    assert all(finite)
    expected = [2.0 ** (t // 7) for t in range(150)]
    assert used == expected
    assert int(state.growth_counter) == 150 % 7

  def test_matches_grad_scaler_on_scripted_overflows(self):
    rng = np.random.default_rng(0)
    pattern = list(rng.random(300) < 0.15)
    used, finite, _ = _scale_trajectory(
      pattern,
      loss_scale=dynamic_loss_scale(
        2.0**16, period=4, factor=2, min_loss_scale=2.0 ** (-60)
      ),
      max_loss_scale=None,
    )
    assert finite == [not b for b in pattern]
    assert used == _grad_scaler_rule(pattern, 2.0**16, 4, 2)

  def test_factor_4_matches_grad_scaler(self):
    """Growth x4 and back-off /4, not a hard-coded 2."""
    pattern = _overflow_pattern(300, seed=1, p_bad=0.2)
    used, finite, _ = _scale_trajectory(
      pattern,
      loss_scale=dynamic_loss_scale(
        2.0**16, period=3, factor=4, min_loss_scale=2.0 ** (-100)
      ),
      max_loss_scale=None,
    )
    assert finite == [not b for b in pattern]
    expected = _grad_scaler_rule(pattern, 2.0**16, 3, 4)
    assert used == expected
    # Both directions happen, and the scale stays inside float32's range.
    ratios = {b / a for a, b in zip(expected, expected[1:]) if a != b}
    assert ratios == {4.0, 0.25}
    assert 2.0**-100 < min(expected) and max(expected) < 2.0**100

  def test_hysteresis_3_matches_grad_scaler_with_delayed_shift(self):
    pattern = _overflow_pattern(300, seed=2, p_bad=0.1, runs=True)
    used, finite, _ = _scale_trajectory(
      pattern,
      loss_scale=dynamic_loss_scale(
        2.0**16, period=4, factor=2, min_loss_scale=2.0 ** (-100)
      ),
      max_loss_scale=None,
      hysteresis=3,
    )
    assert finite == [not b for b in pattern]
    expected = _grad_scaler_rule(pattern, 2.0**16, 4, 2, hysteresis=3)
    assert used == expected
    # The pattern holds overflows that must not back off (1st and 2nd of a
    # run) and runs long enough to back off twice in a row.
    assert expected != _grad_scaler_rule(pattern, 2.0**16, 4, 2)
    halvings = [b / a == 0.5 for a, b in zip(expected, expected[1:])]
    assert any(x and y for x, y in zip(halvings, halvings[1:]))

  def test_python_rule_is_torch_grad_scalers(self):
    """The reference above against torch's own GradScaler, where installed."""
    torch = pytest.importorskip("torch")
    pattern = _overflow_pattern(120, seed=3, p_bad=0.2)
    param = torch.nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler(
      "cpu",
      init_scale=2.0**16,
      growth_factor=4.0,
      backoff_factor=0.25,
      growth_interval=3,
    )
    used = []
    for bad in pattern:
      used.append(scaler.get_scale())
      sgd.zero_grad()
      loss = (param * (math.inf if bad else 1.0)).sum()
      scaler.scale(loss).backward()
      scaler.step(sgd)
      scaler.update()
    assert used == _grad_scaler_rule(pattern, 2.0**16, 3, 4)

  def test_floor_holds(self):
    used, _, state = _scale_trajectory(
      [True] * 20,
      loss_scale=dynamic_loss_scale(
        2.0**5, period=5, factor=2, min_loss_scale=4.0
      ),
    )
    assert used[:4] == [32.0, 16.0, 8.0, 4.0]
    assert set(used[3:]) == {4.0}
    assert float(state.loss_scale) == 4.0
    assert int(state.skipped_steps) == 20
    assert int(state.consecutive_overflows) == 20

  def test_cap_holds_and_never_inf(self):
    _, _, state = _scale_trajectory(
      [False] * 40,
      loss_scale=dynamic_loss_scale(
        2.0**20, period=1, factor=2, min_loss_scale=1.0
      ),
      max_loss_scale=2.0**24,
    )
    assert float(state.loss_scale) == 2.0**24
    _, _, state = _scale_trajectory(
      [False] * 40,
      loss_scale=dynamic_loss_scale(
        2.0**120, period=1, factor=2, min_loss_scale=1.0
      ),
      max_loss_scale=None,
    )
    assert float(state.loss_scale) == 2.0**127  # next would be inf.

  def test_overflow_resets_the_growth_counter(self):
    pattern = [False] * 4 + [True] + [False] * 5
    used, _, _ = _scale_trajectory(
      pattern,
      loss_scale=dynamic_loss_scale(
        8.0, period=5, factor=2, min_loss_scale=1.0
      ),
    )
    # 4 finite steps, overflow halves, then the 5th finite step after it grows.
    assert used == [8.0] * 5 + [4.0] * 5
    used, _, state = _scale_trajectory(
      pattern + [False],
      loss_scale=dynamic_loss_scale(
        8.0, period=5, factor=2, min_loss_scale=1.0
      ),
    )
    assert float(state.loss_scale) == 8.0

  def test_hysteresis_backs_off_from_the_kth_overflow_in_a_row(self):
    pattern = [True, False, True, True, True, False]
    used, finite, state = _scale_trajectory(
      pattern,
      loss_scale=dynamic_loss_scale(
        64.0, period=5, factor=2, min_loss_scale=1.0
      ),
      hysteresis=2,
    )
    assert finite == [False, True, False, False, False, True]
    assert used == [64.0, 64.0, 64.0, 64.0, 32.0, 16.0]
    assert int(state.skipped_steps) == 4

  def test_static_and_noop_never_change_but_still_skip(self):
    used, finite, state = _scale_trajectory([True, False] * 3, loss_scale=128.0)
    assert set(used) == {128.0} and finite == [False, True] * 3
    assert int(state.skipped_steps) == 3
    used, _, _ = _scale_trajectory(
      [True, False], loss_scale=jmp.NoOpLossScale()
    )
    assert set(used) == {1.0}

  def test_adjust_loss_scale_is_pure(self):
    """Same inputs, same outputs: eager or jitted, repeated, in any order.

    Away from the cap and the floor (period 3, hysteresis 2, scale 8 between
    1 and 1024), every branch of the rule: count, grow, overflow before and
    at the hysteresis. The inputs (numpy arrays) are never written to.
    """
    cfg = jaxmp.LossScaleConfig(
      "dynamic",
      period=3,
      factor=2.0,
      min_loss_scale=1.0,
      max_loss_scale=1024.0,
      hysteresis=2,
    )
    # (scale, counter, consecutive skips, finite) -> (scale, counter).
    cases = [
      ((8.0, 0, 0, True), (8.0, 1)),  # Counts a finite step.
      ((8.0, 2, 0, True), (16.0, 0)),  # The 3rd in a row grows.
      ((8.0, 2, 1, False), (8.0, 0)),  # 1st overflow: hysteresis holds.
      ((8.0, 1, 2, False), (4.0, 0)),  # 2nd in a row backs off.
    ]
    args = [
      (
        np.array(s, np.float32),
        np.array(c, np.int32),
        np.array(k, np.int32),
        np.array(f),
      )
      for (s, c, k, f), _ in cases
    ]
    copies = [tuple(a.copy() for a in arg) for arg in args]
    eager = functools.partial(jaxmp.adjust_loss_scale, cfg)
    jitted = jax.jit(jaxmp.adjust_loss_scale, static_argnums=0)
    for _ in range(2):  # Again, after every other case: no hidden state.
      for arg, (_, want) in zip(args + args[::-1], cases + cases[::-1]):
        for fn in (eager, functools.partial(jitted, cfg)):
          scale, counter = fn(*arg)
          assert (float(scale), int(counter)) == want, (arg, want)
          assert scale.dtype == jnp.float32
    for arg, copy in zip(args, copies):
      for a, c in zip(arg, copy):
        np.testing.assert_array_equal(a, c)
    # One trace serves every case: the rule is traced, not branched on values.
    assert jitted._cache_size() == 1  # pylint: disable=protected-access
    assert cfg == jaxmp.LossScaleConfig(
      "dynamic", 3, 2.0, 1.0, 1024.0, hysteresis=2
    )


class TestJitRoundTrip:
  @pytest.mark.parametrize(
    "loss_scale",
    [
      dynamic_loss_scale(
        2.0**15, period=10, factor=2, min_loss_scale=2.0 ** (-3)
      ),
      64.0,
      jmp.NoOpLossScale(),
    ],
  )
  def test_state_survives_jit_with_every_field(self, loss_scale):
    opt = jaxmp.mixed_precision(
      optax.adam(1e-3),
      loss_scale=loss_scale,
      max_loss_scale=2.0**20,
      hysteresis=3,
    )
    params = {"a": jnp.ones(3, jnp.float16), "b": jnp.ones(2)}
    state = opt.init(params)
    out = jax.jit(lambda s: s)(state)
    assert jax.tree.structure(out) == jax.tree.structure(state)
    assert out.config == state.config
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(out)):
      np.testing.assert_array_equal(x, y)
      assert x.dtype == y.dtype

  def test_min_loss_scale_survives_jit_where_jmp_loses_it(self):
    ls = dynamic_loss_scale(8.0, period=5, factor=2, min_loss_scale=0.25)
    # jmp 0.0.4's flaw, pinned: its flatten drops min_loss_scale.
    jmp_out = jax.jit(lambda s: s)(ls)
    assert float(jmp_out.min_loss_scale) == 1.0
    opt = jaxmp.mixed_precision(optax.sgd(0.1), loss_scale=ls)
    state = jax.jit(lambda s: s)(opt.init({"w": jnp.zeros(1)}))
    assert state.config.min_loss_scale == 0.25
    assert float(jaxmp.loss_scaler(state).min_loss_scale) == 0.25
    used, _, _ = _scale_trajectory([True] * 8, loss_scale=ls)
    assert used[-1] == 0.25


def _random_grads(rng, params, n, scale_fn):
  """Unscaled fp32 gradients for n steps."""
  del scale_fn
  return [
    {
      k: rng.standard_normal(v.shape).astype(np.float32)
      for k, v in params.items()
    }
    for _ in range(n)
  ]


def _scaled(grads, params, scale):
  """Gradients of loss * scale, in each param's dtype (exact: scale is 2^k)."""
  return {
    k: jnp.asarray(g * scale).astype(params[k].dtype) for k, g in grads.items()
  }


def _jitted_step(opt):
  """A plain optax step, update and apply in one jit, as a train step has it.

  XLA contracts ``p + lr * m`` into a fused multiply-add inside one jit, so
  the reference must be compiled the same way to compare bit for bit.
  """

  @jax.jit
  def step(grads, state, params):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


class TestMastersAndSkips:
  def _params(self):
    rng = np.random.default_rng(1)
    return {
      "half": jnp.asarray(rng.standard_normal((4, 8)), jnp.float16),
      "bf16": jnp.asarray(rng.standard_normal((8,)), jnp.bfloat16),
      "full": jnp.asarray(rng.standard_normal((5,)), jnp.float32),
    }

  @pytest.mark.invariant
  @pytest.mark.parametrize(
    "inner",
    [optax.sgd(0.1, momentum=0.9), optax.adamw(1e-2, weight_decay=1e-2)],
  )
  def test_params_are_cast_masters_and_masters_match_plain_fp32(self, inner):
    params = self._params()
    opt = jaxmp.mixed_precision(
      inner,
      loss_scale=dynamic_loss_scale(
        2.0**8, period=7, factor=2, min_loss_scale=1.0
      ),
    )
    state = opt.init(params)
    ref_params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    ref_state = inner.init(ref_params)
    step = jax.jit(opt.update)
    ref_step = _jitted_step(inner)
    rng = np.random.default_rng(2)
    ulps = jax.tree.map(lambda p: np.zeros(p.shape), ref_params)
    moved = jax.tree.map(lambda p: np.zeros(p.shape), ref_params)
    for grads in _random_grads(rng, params, 50, None):
      # fp16-representable gradients so both runs see the same numbers.
      grads = {
        k: np.asarray(jnp.asarray(g, params[k].dtype), np.float32)
        for k, g in grads.items()
      }
      scale = float(state.loss_scale)
      updates, state = step(_scaled(grads, params, scale), state, params)
      params = optax.apply_updates(params, updates)
      old_ref = ref_params
      ref_params, ref_state = ref_step(
        {k: jnp.asarray(g) for k, g in grads.items()}, ref_state, ref_params
      )
      assert bool(state.step_applied)
      masters = jaxmp.master_params(state, params)
      for k in params:
        np.testing.assert_array_equal(
          np.asarray(params[k]).view(np.uint8),
          np.asarray(masters[k].astype(params[k].dtype)).view(np.uint8),
        )
        # The two are different XLA programs, fused differently, and XLA:CPU
        # contracts a multiply and an add into an FMA only inside one fusion
        # (the default flags do, the fast ones mostly do not): the same ops
        # can round differently. Per step, the param may round once
        # differently (1 ulp of |p|) and the update by a few fp32 eps of
        # |dp|, an error the momentum carries on for 1 / (1 - beta) steps.
        old = np.abs(np.asarray(old_ref[k], np.float64))
        ulps[k] += np.spacing(np.asarray(old, np.float32))
        moved[k] += np.abs(np.asarray(ref_params[k], np.float64) - old)
        tol = 2 * ulps[k] + 8 * np.finfo(np.float32).eps / 0.1 * moved[k]
        np.testing.assert_array_less(
          np.abs(
            np.asarray(masters[k], np.float64)
            - np.asarray(ref_params[k], np.float64)
          ),
          tol + 1e-30,
        )
    assert float(state.loss_scale) == 2.0**8 * 2**7  # 50 // 7 growths.

  @pytest.mark.invariant
  @pytest.mark.parametrize("bad_value", [np.inf, -np.inf, np.nan])
  @pytest.mark.parametrize("bad_leaf", ["half", "full"])
  @pytest.mark.parametrize("bad_steps", [(0,), (5, 6, 11)])
  def test_fault_injection_equals_control_run(
    self, bad_value, bad_leaf, bad_steps
  ):
    """Skipped steps change nothing: bit-identical to a run without them."""
    params = self._params()
    opt = jaxmp.mixed_precision(
      optax.sgd(0.05, momentum=0.9),
      loss_scale=dynamic_loss_scale(
        2.0**6, period=3, factor=2, min_loss_scale=1.0
      ),
    )
    step = jax.jit(opt.update)
    run = {
      "faulty": [params, opt.init(params)],
      "control": [params, opt.init(params)],
    }
    rng = np.random.default_rng(3)
    for t, grads in enumerate(_random_grads(rng, params, 14, None)):
      grads = {
        k: np.asarray(jnp.asarray(g, params[k].dtype), np.float32)
        for k, g in grads.items()
      }
      for name in ("faulty", "control") if t not in bad_steps else ("faulty",):
        p, state = run[name]
        scaled = _scaled(grads, p, float(state.loss_scale))
        if name == "faulty" and t in bad_steps:
          leaf = scaled[bad_leaf]
          scaled[bad_leaf] = leaf.at[(0,) * leaf.ndim].set(bad_value)
        updates, state = step(scaled, state, p)
        new_p = optax.apply_updates(p, updates)
        if t in bad_steps:
          assert not bool(state.step_applied)
          assert not any(np.any(np.asarray(u)) for u in updates.values())
          for k in p:  # Skipped: the params are unchanged, bit for bit.
            np.testing.assert_array_equal(
              np.asarray(new_p[k]).view(np.uint8),
              np.asarray(p[k]).view(np.uint8),
            )
        run[name] = [new_p, state]
      (p1, s1), (p2, s2) = run["faulty"], run["control"]
      for a, b in (
        (p1, p2),
        (s1.master_params, s2.master_params),
        (s1.inner_state, s2.inner_state),
      ):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
          np.testing.assert_array_equal(
            np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)
          )
    stats = jax.device_get(jaxmp.stats(run["faulty"][1]))
    assert stats["skipped_steps"] == len(bad_steps)

  @pytest.mark.invariant
  @pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
  def test_params_are_cast_masters_bitwise_with_zeros_and_subnormals(
    self, dtype
  ):
    tiny = float(jnp.finfo(dtype).smallest_subnormal)
    base = np.array(
      [
        0.0,
        -0.0,
        tiny,
        -tiny,
        3 * tiny,
        -3 * tiny,
        1e-3,
        -1e-3,
        1.0,
        -1.0,
        0.0,
        -0.0,
      ],
      np.float32,
    )
    params = {"w": jnp.asarray(base, dtype)}
    opt = jaxmp.mixed_precision(optax.sgd(1.0), loss_scale=2.0**4)
    state = opt.init(params)
    step = jax.jit(opt.update)
    rng = np.random.default_rng(5)
    # Steps that cross zero, land on it from both sides, stay on it, and
    # move by less than a half ulp (masters move, params do not).
    # The first one takes the -0.0 params to masters of -tiny / 4: params
    # that must stay -0.0.
    grads = [
      np.full_like(base, tiny / 4),
      base,
      -base,
      2 * base,
      np.zeros_like(base),
      -base,
      np.full_like(base, tiny / 4),
      np.full_like(base, -tiny / 4),
    ]
    grads += [
      rng.standard_normal(base.shape).astype(np.float32) * tiny
      for _ in range(6)
    ]
    for g in grads:
      old = np.asarray(params["w"])
      updates, state = step({"w": jnp.asarray(g * 2.0**4)}, state, params)
      params = optax.apply_updates(params, updates)
      got = np.asarray(params["w"]).view(np.uint16)
      want = np.asarray(state.master_params["w"].astype(dtype)).view(np.uint16)
      # The one documented exception: p + u is -0.0 only if both are -0.0,
      # so a param that was not -0.0 cannot become it; it becomes +0.0.
      neg_zero = np.asarray(jnp.asarray(-0.0, dtype)).view(np.uint16)
      old_bits = old.view(np.uint16)
      # (Where XLA flushes fp32 subnormals, a bf16 subnormal acts as a zero
      # of its sign, so the exception is allowed, not required.)
      excused = (want == neg_zero) & (got == 0) & (old_bits != neg_zero)
      np.testing.assert_array_equal(got, np.where(excused, got, want))

  def test_no_master_weights_updates_half_params_in_place(self):
    params = {"w": jnp.ones(4, jnp.float16)}
    opt = jaxmp.mixed_precision(
      optax.sgd(0.25), loss_scale=4.0, master_weights=False
    )
    state = opt.init(params)
    assert state.master_params == {"w": None}
    updates, state = opt.update(
      {"w": jnp.full(4, 4.0, jnp.float16)}, state, params
    )
    assert optax.apply_updates(params, updates)["w"].tolist() == [0.75] * 4
    with pytest.raises(ValueError, match="no fp32 master"):
      jaxmp.master_params(state)

  def test_master_params_without_params_for_all_half_tree(self):
    params = {"w": jnp.ones(3, jnp.float16)}
    state = jaxmp.mixed_precision(optax.sgd(0.1)).init(params)
    masters = jaxmp.master_params(state)
    assert masters["w"].dtype == jnp.float32

  @pytest.mark.invariant
  def test_small_half_gradients_are_unscaled_exactly_in_fp32(self):
    # Gradients of about 1e-6 and below 2**-24 (fp16's smallest subnormal),
    # scaled by 2**15 into fp16's normal range. Unscaled in fp32 (an fp16
    # value times a power of two) they are exact; unscaled in fp16 they
    # would land on fp16's subnormal grid (1e-6 as 1.0133e-6) or flush to 0.
    true = np.array([1e-6, 1.0002e-6, 3e-7, 2.0**-25, 1e-8], np.float64)
    scale = 2.0**15
    g16 = jnp.asarray(true * scale, jnp.float16)
    want = np.asarray(g16, np.float64) / scale  # exact in fp32
    assert np.all(np.abs(want - true) <= 2.0**-11 * true)  # all nonzero
    params = {"w": jnp.zeros(true.size, jnp.float16)}
    opt = jaxmp.mixed_precision(optax.sgd(1.0), loss_scale=scale)
    state = opt.init(params)
    _, state = jax.jit(opt.update)({"w": g16}, state, params)
    # master = 0 - 1.0 * unscaled gradient: exact.
    np.testing.assert_array_equal(
      np.asarray(state.master_params["w"], np.float64), -want
    )


class TestAllFinite:
  """The global finite check: exact, whatever the size, dtype or position."""

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
  def test_catches_a_bad_value_anywhere(self, dtype):
    # Sizes past the vector widths: XLA:CPU's vectorised max reduction drops
    # NaNs from 4099 fp32 elements on, so a max-based check would miss them.
    check = jax.jit(jaxmp.all_finite)
    rng = np.random.default_rng(0)
    for size in (7, 4099, 65537):
      good = rng.standard_normal(size).astype(np.float32)
      tree = {"x": jnp.asarray(good, dtype), "other": jnp.ones(3)}
      assert bool(check(tree))
      for pos in sorted(
        {
          0,
          1,
          size // 2,
          size - 2,
          size - 1,
          *range(0, size, max(1, size // 11)),
        }
      ):
        for value in (np.nan, np.inf, -np.inf):
          bad = good.copy()
          bad[pos] = value
          tree["x"] = jnp.asarray(bad, dtype)
          assert not bool(check(tree)), (size, pos, value)

  def test_finite_values_whose_sum_overflows_are_finite(self):
    big = {
      "a": jnp.full(1000, 3e38, jnp.float32),
      "b": jnp.full(10, 3e38, jnp.float32),
    }
    assert bool(jax.jit(jaxmp.all_finite)(big))
    big["b"] = big["b"].at[3].set(np.nan)
    assert not bool(jax.jit(jaxmp.all_finite)(big))
    assert bool(jaxmp.all_finite({}))

  def test_huge_finite_grads_are_not_skipped(self):
    params = {"w": jnp.zeros(1000, jnp.float32)}
    opt = jaxmp.mixed_precision(optax.sgd(1e-30), loss_scale=1.0)
    grads = {"w": jnp.full(1000, 3e38, jnp.float32)}
    updates, state = jax.jit(opt.update)(grads, opt.init(params), params)
    assert bool(state.step_applied) and int(state.skipped_steps) == 0
    assert np.all(np.asarray(updates["w"]) < 0)


class TestComposition:
  def test_clip_inside_sees_unscaled_grads(self):
    params = {"w": jnp.zeros(4)}
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    opt = jaxmp.mixed_precision(inner, loss_scale=2.0**12)
    state = opt.init(params)
    grads = jnp.array([3.0, 4.0, 0.0, 0.0])  # norm 5, clipped to 1.
    updates, _ = opt.update({"w": grads * 2.0**12}, state, params)
    np.testing.assert_allclose(updates["w"], -grads / 5.0, rtol=1e-6)

  def test_schedule_does_not_advance_on_skipped_steps(self):
    sched = optax.piecewise_constant_schedule(1.0, {1: 0.5})
    opt = jaxmp.mixed_precision(optax.sgd(sched), loss_scale=1.0)
    params = {"w": jnp.zeros(1)}
    state = opt.init(params)
    _, state = opt.update({"w": jnp.array([jnp.nan])}, state, params)
    updates, state = opt.update({"w": jnp.ones(1)}, state, params)
    assert float(updates["w"][0]) == -1.0  # still step 0 of the schedule.

  def test_inject_hyperparams_inside_and_outside(self):
    params = {"w": jnp.ones(2, jnp.float16)}
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    opt = jaxmp.mixed_precision(inner, loss_scale=2.0)
    state = opt.init(params)
    updates, state = opt.update(
      {"w": jnp.full(2, 2.0, jnp.float16)}, state, params
    )
    assert updates["w"].tolist() == [-0.5, -0.5]
    outer = optax.inject_hyperparams(
      jaxmp.mixed_precision,
      static_args=("loss_scale", "max_loss_scale", "hysteresis"),
    )(optax.sgd(0.5), loss_scale=2.0)
    ostate = outer.init(params)
    assert float(jaxmp.stats(ostate)["loss_scale"]) == 2.0
    updates, ostate = outer.update(
      {"w": jnp.full(2, 2.0, jnp.float16)}, ostate, params
    )
    assert updates["w"].tolist() == [-0.5, -0.5]
    assert float(jaxmp.scale_loss(jnp.float32(3.0), ostate)) == 6.0

  def test_multi_transform_inside(self):
    params = {"a": jnp.ones(2, jnp.float16), "b": jnp.ones(2)}
    inner = optax.multi_transform(
      {"fast": optax.sgd(1.0), "frozen": optax.set_to_zero()},
      {"a": "fast", "b": "frozen"},
    )
    opt = jaxmp.mixed_precision(inner, loss_scale=4.0)
    state = opt.init(params)
    grads = {"a": jnp.full(2, 4.0, jnp.float16), "b": jnp.full(2, 4.0)}
    updates, state = jax.jit(opt.update)(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert new["a"].tolist() == [0.0, 0.0] and new["b"].tolist() == [1.0, 1.0]
    assert jaxmp.stats(state)["loss_scale"] == 4.0

  def test_two_mixed_precision_states_are_ambiguous(self):
    inner = optax.chain(
      jaxmp.mixed_precision(optax.sgd(1.0)),
      jaxmp.mixed_precision(optax.sgd(1.0)),
    )
    state = inner.init({"a": jnp.ones(1), "b": jnp.ones(1)})
    with pytest.raises(ValueError, match="found 2"):
      jaxmp.stats(state)

  @pytest.mark.parametrize(
    "wrap",
    [
      lambda tx, labels: optax.multi_transform(
        {"a": jaxmp.mixed_precision(tx), "b": optax.sgd(1.0)}, labels
      ),
      lambda tx, labels: optax.masked(
        jaxmp.mixed_precision(tx), {"a": True, "b": False}
      ),
    ],
  )
  def test_half_wrapped_multi_transform_is_rejected(self, wrap):
    opt = wrap(optax.sgd(1.0), {"a": "a", "b": "b"})
    params = {"a": jnp.ones(2, jnp.float16), "b": jnp.ones(2, jnp.float16)}
    with pytest.raises(
      ValueError,
      match=r"jaxmp\.mixed_precision\(optax\."
      r"multi_transform\(\.\.\.\)\)",
    ):
      opt.init(params)


class TestAccessorsAndHelpers:
  def _state(self):
    # A chain of one: a transform before or after mixed_precision is a
    # placement error (tests/test_misuse.py).
    opt = optax.chain(
      jaxmp.mixed_precision(
        optax.sgd(0.1),
        loss_scale=dynamic_loss_scale(
          16.0, period=5, factor=2, min_loss_scale=2.0
        ),
      ),
    )
    params = {"w": jnp.ones(2, jnp.float16)}
    return opt, params, opt.init(params)

  def test_scale_loss_and_loss_scale_in_a_chain(self):
    _, _, state = self._state()
    assert float(jaxmp.scale_loss(jnp.float32(0.5), state)) == 8.0
    ls = jaxmp.loss_scaler(state)
    assert isinstance(ls, jmp.DynamicLossScale)
    assert float(ls.loss_scale) == 16.0 and float(ls.min_loss_scale) == 2.0
    assert sorted(jaxmp.stats(state)) == [
      "consecutive_nonfinite_loss",
      "consecutive_overflows",
      "consecutive_spike_skips",
      "loss_scale",
      "nonfinite_loss_steps",
      "skipped_steps",
      "spike_skips",
      "step_applied",
    ]

  def test_missing_state_is_a_clear_error(self):
    with pytest.raises(ValueError, match="no jaxmp.mixed_precision state"):
      jaxmp.scale_loss(1.0, optax.sgd(0.1).init({"w": jnp.ones(1)}))

  def test_rollback_and_health_check(self):
    opt, params, state = self._state()
    bad = {"w": jnp.full(2, jnp.nan, jnp.float16)}
    step = jax.jit(opt.update)
    for t in range(1, 5):
      _, state = step(bad, state, params)
      jaxmp.check_health(state, t, max_consecutive_skips=5)
      kept = jaxmp.rollback_if_skipped(
        state, {"m": jnp.ones(2)}, {"m": jnp.zeros(2)}
      )
      assert kept["m"].tolist() == [0.0, 0.0]
    _, state = step(bad, state, params)
    with pytest.raises(
      jaxmp.LossScaleCollapseError,
      match=r"steps 1\.\.5 \(5 in a row\).*floor 2",
    ):
      jaxmp.check_health(state, 5, max_consecutive_skips=5)
    _, state = step({"w": jnp.ones(2, jnp.float16)}, state, params)
    jaxmp.check_health(state, 7, max_consecutive_skips=5)
    kept = jaxmp.rollback_if_skipped(
      state, {"m": jnp.ones(2)}, {"m": jnp.zeros(2)}
    )
    assert kept["m"].tolist() == [1.0, 1.0]


class TestBadInput:
  @pytest.mark.parametrize(
    "kwargs,match",
    [
      (dict(loss_scale="dynamic"), "loss_scale must be"),
      (dict(loss_scale=-1.0), "finite and > 0"),
      (
        dict(
          loss_scale=dynamic_loss_scale(
            2.0**10, period=5, factor=2, min_loss_scale=0.0
          )
        ),
        "min_loss_scale",
      ),
      (dict(hysteresis=0), "hysteresis"),
      (
        dict(
          loss_scale=dynamic_loss_scale(
            2.0, period=5, factor=2, min_loss_scale=4.0
          ),
          max_loss_scale=2.0,
        ),
        "above max_loss_scale",
      ),
    ],
  )
  def test_bad_construction(self, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
      jaxmp.mixed_precision(optax.sgd(0.1), **kwargs)

  @pytest.mark.parametrize(
    "kwargs,match,start",
    [
      (
        dict(
          loss_scale=dynamic_loss_scale(
            2.0**30, period=5, factor=2, min_loss_scale=1.0
          ),
          max_loss_scale=2.0**20,
        ),
        r"1073741824\.0.*max_loss_scale=1048576\.0",
        2.0**20,
      ),
      (
        dict(
          loss_scale=dynamic_loss_scale(
            0.5, period=5, factor=2, min_loss_scale=2.0
          )
        ),
        r"0\.5.*min_loss_scale=2\.0",
        2.0,
      ),
    ],
  )
  def test_clamped_initial_scale_warns(self, kwargs, match, start):
    with pytest.warns(UserWarning, match=match):
      opt = jaxmp.mixed_precision(optax.sgd(0.1), **kwargs)
    assert float(opt.init({"w": jnp.ones(1)}).loss_scale) == start

  def test_integer_params_and_missing_params(self):
    opt = jaxmp.mixed_precision(optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"\['i'\] has dtype int32"):
      opt.init({"i": jnp.ones(2, jnp.int32)})
    state = opt.init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="needs params"):
      opt.update({"w": jnp.ones(2)}, state)


class TestPolicies:
  @pytest.mark.parametrize(
    "spec,param,compute,output",
    [
      ("O0", "float32", "float32", "float32"),
      ("O1", "float32", "float32", "float32"),  # + autocast(float16)
      ("O2", "float16", "float16", "float32"),
      ("O3", "float16", "float16", "float16"),
      ("bf16", "float32", "bfloat16", "float32"),
      (
        "params=float32,compute=float16,output=float32",
        "float32",
        "float16",
        "float32",
      ),
      ("p=f16,c=f16,o=f32", "float16", "float16", "float32"),
    ],
  )
  def test_get_policy(self, spec, param, compute, output):
    policy = jaxmp.get_policy(spec)
    assert isinstance(policy, jmp.Policy)
    assert [
      np.dtype(d).name
      for d in (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
    ] == [param, compute, output]

  def test_presets_carry_apex_properties(self):
    o2 = jaxmp.get_preset("O2")
    assert isinstance(o2.loss_scale, jmp.DynamicLossScale)
    assert (o2.keep_batchnorm_fp32, o2.master_weights) == (True, True)
    o3 = jaxmp.get_preset("O3")
    assert isinstance(o3.loss_scale, jmp.StaticLossScale)
    assert float(o3.loss_scale.loss_scale) == 1.0
    assert (o3.keep_batchnorm_fp32, o3.master_weights) == (False, False)
    custom = jaxmp.get_preset("p=f16,c=f16,o=f32")
    assert custom.master_weights
    assert isinstance(custom.loss_scale, jmp.DynamicLossScale)
    with pytest.raises(
      dataclasses.FrozenInstanceError, match="cannot assign to field 'name'"
    ):
      o2.name = "x"
    assert o2.name == "O2"

  @pytest.mark.parametrize("spec", ["O4", "fp16", "p=f99", ""])
  def test_unknown_spec_lists_valid_ones(self, spec):
    with pytest.raises(ValueError, match=r"O0, O1, O2, O3, bf16"):
      jaxmp.get_policy(spec)
