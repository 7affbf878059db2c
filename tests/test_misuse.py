"""The mistakes a new user makes, each one loud now (issue 22).

Every test here reproduces a mistake that used to train wrongly in silence;
the docstring of each says what happened before. Mistakes that cannot be
detected are listed in the README ("What jaxmp cannot catch"), with why.
"""

import warnings

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import jaxmp

RIGHT_CHAIN = r"jaxmp\.mixed_precision\(optax\.chain\("


def _params():
  return {"w": jnp.full((4,), 0.5, jnp.float16)}


def _loss(p, x):
  return jnp.mean(jnp.square(p["w"] * x - 1.0), dtype=jnp.float32)


def _x():
  return jnp.ones((4,), jnp.float16)


def _mp(**kw):
  return jaxmp.mixed_precision(optax.sgd(0.1), **kw)


class TestPlacement:
  """Formerly silent: every wrong placement trained, wrongly."""

  @pytest.mark.parametrize(
    "build",
    [
      # Reproduces: loss stuck at 1.0 for 5 steps (clip saw scaled grads).
      lambda: optax.chain(optax.clip_by_global_norm(1.0), _mp()),
      lambda: optax.chain(_mp(), optax.clip_by_global_norm(1.0)),
      lambda: optax.chain(_mp(), optax.add_decayed_weights(1e-4)),
    ],
    ids=["clip_before", "clip_after", "decay_after"],
  )
  def test_chained_is_an_error_that_shows_the_right_chain(self, build):
    """Formerly silent: ``chain(clip, mp)``, ``chain(mp, clip)``...

    A transform before it is caught where the state is first seen; one
    after it (its state is empty, like ``optax.identity()``'s, which is
    allowed) when the chain runs ``update``, eager or traced.
    """
    opt = build()
    params = _params()
    state = opt.init(params)

    def step(params, state, x):
      loss, grads = jaxmp.value_and_grad(_loss)(params, state, x)
      return opt.update(grads, state, params, loss=loss)

    def scale_then_update():
      jaxmp.scale_loss(_loss(params, _x()), state)
      opt.update(_params(), state, params)

    for call in (
      lambda: step(params, state, _x()),
      scale_then_update,
      lambda: jax.jit(step)(params, state, _x()),
    ):
      with pytest.raises(ValueError, match=r"outermost transform") as e:
        call()
      assert "jaxmp.mixed_precision(optax.chain(" in str(e.value)
      assert "jaxmp.multi_steps(jaxmp.mixed_precision(" in str(e.value)

  def test_optax_multisteps_around_it_is_an_error(self):
    """Formerly silent: loss frozen at 0.766 after one overflowed window."""
    opt = optax.MultiSteps(_mp(), 2)
    params = _params()
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"inside optax\.MultiSteps") as e:
      jaxmp.value_and_grad(_loss)(params, state, _x())
    assert "jaxmp.multi_steps(jaxmp.mixed_precision(inner), k)" in str(e.value)
    with pytest.raises(ValueError, match=r"inside optax\.MultiSteps"):
      jaxmp.scale_loss(1.0, state)

  def test_initialize_then_mixed_precision_again_is_an_error(self):
    """Formerly silent: the double-wrapped run's loss stuck at 1.0."""
    params, opt = jaxmp.initialize(
      {"Dense_0": {"kernel": jnp.ones((2, 2))}}, optax.sgd(0.1), "O2"
    )
    twice = jaxmp.mixed_precision(opt)
    with pytest.raises(ValueError, match=r"inside another") as e:
      twice.init(params)
    assert "jaxmp.initialize(params, optax.sgd(0.1), 'O2')" in str(e.value)

  def test_misplaced_inside_multi_steps_is_an_error_at_init(self):
    """Formerly silent: a clip before mixed_precision inside multi_steps."""
    opt = jaxmp.multi_steps(
      optax.chain(optax.clip_by_global_norm(1.0), _mp()), 2
    )
    with pytest.raises(ValueError, match=RIGHT_CHAIN):
      opt.init(_params())

  @pytest.mark.parametrize(
    "build",
    [
      _mp,
      lambda: jaxmp.multi_steps(_mp(), 2),
      lambda: optax.chain(_mp()),
      lambda: optax.inject_hyperparams(
        jaxmp.mixed_precision,
        static_args=("loss_scale", "max_loss_scale", "hysteresis"),
      )(optax.sgd(0.1)),
      lambda: jaxmp.multi_steps(
        optax.inject_hyperparams(
          jaxmp.mixed_precision,
          static_args=("loss_scale", "max_loss_scale", "hysteresis"),
        )(optax.sgd(0.1)),
        2,
      ),
    ],
    ids=["bare", "multi_steps", "chain_of_one", "inject", "multi_inject"],
  )
  def test_right_placements_pass(self, build):
    opt = build()
    params = _params()
    state = opt.init(params)
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # Nor a warning.
      loss, grads = jax.jit(jaxmp.value_and_grad(_loss))(params, state, _x())
    opt.update(grads, state, params, loss=loss)


class TestCapturedState:
  """Formerly silent: gradients 256x too small after 8 steps (0.595 vs 0.118)."""

  def test_a_global_opt_state_inside_jit_warns(self):
    opt = _mp(loss_scale=jmp.DynamicLossScale(jnp.float32(1024.0), period=1))
    params = _params()
    captured = opt.init(params)

    @jax.jit
    def step(params, x):
      return jaxmp.value_and_grad(_loss)(params, captured, x)

    with pytest.warns(UserWarning, match=r"constant of the function being"):
      step(params, _x())

    @jax.jit
    def step_scale_loss(params, x):
      return jax.grad(lambda p: jaxmp.scale_loss(_loss(p, x), captured))(params)

    with pytest.warns(
      UserWarning,
      match=r"^jaxmp\.scale_loss got an opt_state that is a constant of the "
      r"function being traced .*Pass opt_state to the jitted step as an "
      r"argument",
    ):
      step_scale_loss(params, _x())

  def test_an_argument_or_an_eager_call_does_not_warn(self):
    opt = _mp()
    params = _params()
    state = opt.init(params)
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      jax.jit(jaxmp.value_and_grad(_loss))(params, state, _x())
      jaxmp.value_and_grad(_loss)(params, state, _x())  # eager
      jax.grad(lambda p: jaxmp.scale_loss(_loss(p, _x()), state))(params)


class TestForgottenScale:
  """Forgetting ``scale_loss`` cannot be detected: the one-call form instead.

  See the README, "What jaxmp cannot catch": gradients 2**15 too small are
  valid gradients too. `jaxmp.value_and_grad` makes it impossible instead; this pins that its
  gradients are those of ``loss * scale``, not of ``loss``.

  Reproduces: with a bare ``jax.grad(loss_fn)`` the effective learning rate
  was divided by 32768 and the loss stayed at 1.0.
  """

  def test_value_and_grad_always_scales(self):
    opt = _mp()
    params = _params()
    state = opt.init(params)
    loss, grads = jaxmp.value_and_grad(_loss)(params, state, _x())
    plain = jax.grad(_loss)(params, _x())
    np.testing.assert_array_equal(
      np.asarray(grads["w"], np.float32),
      np.asarray(plain["w"], np.float32) * 2.0**15,
    )
    for _ in range(5):
      loss, grads = jaxmp.value_and_grad(_loss)(params, state, _x())
      updates, state = opt.update(grads, state, params, loss=loss)
      params = optax.apply_updates(params, updates)
    # d loss / dw = (w - 1) / 2, so sgd(0.1) shrinks 1 - w by 0.95 a step:
    # 1 - w = 0.5 * 0.95**5 = 0.387. Unscaled, w would move 2**15 times less
    # (1 - w = 0.49999). fp16 gradients: within 2**-10 relative a step.
    w = np.asarray(jaxmp.master_params(state)["w"])
    np.testing.assert_allclose(1.0 - w, 0.5 * 0.95**5, rtol=5 * 2.0**-10)


class TestHonestMessages:
  def test_nonfinite_loss_names_the_forward_overflow(self):
    """Formerly wrong: it said "not an fp16 overflow".

    It said "bad data or a diverged model, not an fp16 overflow" for what
    was an fp16 overflow of the activations.
    """

    def loss_fn(p, x):
      h = (x * p["w"]) * jnp.float16(60000.0)  # Overflows in fp16.
      return jnp.mean(h.astype(jnp.float32))

    opt = _mp()
    params = _params()
    state = opt.init(params)
    loss, grads = jaxmp.value_and_grad(loss_fn)(params, state, _x() * 4)
    assert not np.isfinite(float(loss))
    _, state = opt.update(grads, state, params, loss=loss)
    with pytest.raises(jaxmp.NonFiniteLossError) as e:
      jaxmp.check_health(state, 1, max_nonfinite_loss_steps=1)
    msg = str(e.value)
    assert "not an fp16 overflow" not in msg
    assert "fp16 overflow in the forward pass, in the activations" in msg
    assert "which no loss scale can fix" in msg
    assert "fp32" in msg

  def test_report_of_an_all_nonfinite_step_says_so(self):
    """Formerly misleading: the "worst leaf" was just the largest tensor."""
    opt = _mp(diagnostics=True)
    params = {"big": jnp.ones(64, jnp.float16), "small": jnp.ones(2)}
    state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
    _, state = opt.update(grads, state, params)
    rows = jaxmp.overflow_report(state)
    assert [r.path for r in rows] == ["['big']", "['small']"]  # Leaf order.
    text = str(rows)
    assert text.startswith("every gradient leaf is non-finite (2 of 2)")
    assert "first:" not in text
    # One finite leaf: ranked again, worst first.
    grads = {"big": jnp.ones(64, jnp.float16), "small": jnp.full(2, jnp.nan)}
    _, state = opt.update(grads, state, params)
    rows = jaxmp.overflow_report(state)
    assert rows[0].path == "['small']"
    assert str(rows).startswith("non-finite gradients in 1 of 2 leaves")


class TestNames:
  def test_skips_and_overflows_are_counted_as_documented(self):
    """``skipped_steps`` counts both causes, the runs each one.

    ``consecutive_overflows`` counts only overflows, and a NaN-loss step
    neither counts in it nor breaks it.
    """
    opt = _mp(loss_scale=jmp.DynamicLossScale(jnp.float32(1024.0)))
    params = _params()
    state = opt.init(params)
    inf = {"w": jnp.full(4, jnp.inf, jnp.float16)}
    ok = {"w": jnp.ones(4, jnp.float16)}
    for grads, loss in ((inf, 1.0), (ok, jnp.nan), (inf, 1.0)):
      _, state = opt.update(grads, state, params, loss=jnp.float32(loss))
    s = jax.device_get(jaxmp.stats(state))
    assert int(s["skipped_steps"]) == 3
    assert int(s["consecutive_overflows"]) == 2
    assert int(s["nonfinite_loss_steps"]) == 1
    assert int(s["consecutive_nonfinite_loss"]) == 0
    assert not bool(s["step_applied"])
    assert float(s["loss_scale"]) == 256.0  # Two back-offs, not three.

  def test_renamed_names_warn_and_still_work(self):
    opt = _mp()
    state = opt.init(_params())
    with pytest.warns(DeprecationWarning, match="step_applied"):
      assert bool(state.grads_finite) == bool(state.step_applied)
    with pytest.warns(DeprecationWarning, match="consecutive_overflows"):
      assert int(state.consecutive_skips) == 0
    stats = jaxmp.stats(state)
    with pytest.warns(DeprecationWarning, match="step_applied"):
      assert stats["grads_finite"] is stats["step_applied"]
    with pytest.warns(DeprecationWarning, match="consecutive_overflows"):
      assert stats["consecutive_skips"] is stats["consecutive_overflows"]
    with pytest.raises(KeyError):
      stats["nope"]  # pylint: disable=pointless-statement
    with pytest.warns(DeprecationWarning, match="loss_scaler"):
      scaler = jaxmp.loss_scale(state)
    assert float(scaler.loss_scale) == float(
      jaxmp.loss_scaler(state).loss_scale
    )
    with pytest.warns(DeprecationWarning, match="LossScaler"):
      assert jaxmp.LossScale is jaxmp.LossScaler
    assert "LossScale" not in jaxmp.__all__
    # The stats dict is a pytree: device_get and jit keep it, keys and all.
    fetched = jax.device_get(stats)
    assert sorted(fetched) == sorted(stats) and isinstance(fetched, dict)

  def test_get_preset_takes_a_preset_and_rejects_other_types(self):
    o2 = jaxmp.get_preset("O2")
    assert jaxmp.get_preset(o2) is o2
    assert jaxmp.get_policy(o2) is o2.policy
    for bad in (3, None, jnp.float16):
      with pytest.raises(TypeError, match=r"string or a jaxmp\.Preset"):
        jaxmp.get_preset(bad)

  def test_accumulation_state_is_public(self):
    state = jaxmp.multi_steps(_mp(), 2).init(_params())
    assert isinstance(state, jaxmp.AccumulationState)
