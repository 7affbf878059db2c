"""More mistakes a new user makes, each one loud or handled now.

An NNX module under `jaxmp.autocast` (its state updates were dropped),
gradients no jaxmp call scaled (steps 32768x too small), an autocast'd loop
body (an fp16 carry), Equinox placeholders in `jaxmp.master_params`, and the
smaller ones. The docstring of each test says what happened before.
"""

import os
import subprocess
import sys
import warnings

import equinox as eqx
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mp(**kw):
  return jaxmp.mixed_precision(optax.sgd(0.1), **kw)


def _leaves_equal(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
    np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
  )


class _BnDrop(nnx.Module):
  """BatchNorm and dropout on the input, and a dense layer beside them.

  BatchNorm sees the fp32 input under autocast too, so its statistics must
  match plain JAX bit for bit; the dense layer gives autocast a product.
  """

  def __init__(self, rngs):
    self.bn = nnx.BatchNorm(4, momentum=0.5, rngs=rngs)
    self.drop = nnx.Dropout(0.5)
    self.dense = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x, rngs=None):
    return self.drop(self.bn(x), rngs=rngs), self.dense(x)


def _x(i=0):
  return jax.random.normal(jax.random.key(i), (16, 4)) * 2.0 + 1.0


class TestNnxUnderAutocast:
  """Formerly silent: BatchNorm statistics stayed 0, one dropout mask."""

  def _run(self, autocast, steps=3):
    model, rngs = _BnDrop(nnx.Rngs(0)), nnx.Rngs(dropout=7)
    call = lambda m, x, r: m(x, r)
    if autocast:
      call = jaxmp.autocast(call)
    masks, dense = [], []
    for i in range(steps):
      out, y = call(model, _x(i), rngs)
      masks.append(np.asarray(out) == 0)
      dense.append(y)
    stats = nnx.state(model, nnx.BatchStat)
    return stats, masks, dense, rngs

  def test_statistics_and_dropout_masks_move_as_without_autocast(self):
    stats, masks, dense, rngs = self._run(autocast=True)
    want_stats, want_masks, want_dense, want_rngs = self._run(autocast=False)
    assert _leaves_equal(stats, want_stats)  # Bit for bit.
    assert not _leaves_equal(
      stats, nnx.state(_BnDrop(nnx.Rngs(0)), nnx.BatchStat)
    )
    for got, want in zip(masks, want_masks):
      np.testing.assert_array_equal(got, want)
    assert not np.array_equal(masks[0], masks[1])  # The counter moved.
    assert (
      int(rngs.dropout.count[...]) == int(want_rngs.dropout.count[...]) == 3
    )
    # ... and autocast did run: the dense layer's product was fp16.
    assert not np.array_equal(dense[0], want_dense[0])
    np.testing.assert_allclose(dense[0], want_dense[0], rtol=0.01, atol=0.01)

  def test_module_as_the_function_and_shared_rngs(self):
    """``autocast(model)`` and one ``Rngs`` held by a module and passed in."""

    class Holder(nnx.Module):
      def __init__(self, rngs):
        self.inner = _BnDrop(nnx.Rngs(0))
        self.rngs = rngs

      def __call__(self, x):
        return self.inner(x, self.rngs)

    for autocast in (False, True):
      rngs = nnx.Rngs(dropout=3)
      holder = Holder(rngs)
      f = jaxmp.autocast(holder) if autocast else holder
      out, _ = f(_x())
      if autocast:
        got = (np.asarray(out) == 0, nnx.state(holder, nnx.BatchStat))
      else:
        want = (np.asarray(out) == 0, nnx.state(holder, nnx.BatchStat))
      # The Rngs shared by the holder and the caller advanced once.
      assert int(rngs.dropout.count[...]) == 1
    np.testing.assert_array_equal(got[0], want[0])
    assert _leaves_equal(got[1], want[1])

  def test_under_jaxmp_value_and_grad_and_nnx_optimizer(self):
    """Flax's MNIST step: nnx.jit, nnx.Optimizer, the forward autocast."""

    def run(autocast):
      model, rngs = _BnDrop(nnx.Rngs(0)), nnx.Rngs(dropout=7)
      opt = nnx.Optimizer(model, _mp(), wrt=nnx.Param)
      call = lambda m, x, r: m(x, r)
      fwd = jaxmp.autocast(call) if autocast else call

      def loss_fn(m, x, r):
        out, y = fwd(m, x, r)
        return jnp.mean(out**2) + jnp.mean(y.astype(jnp.float32) ** 2)

      @nnx.jit
      def step(model, opt, x, r):
        loss, grads = jaxmp.value_and_grad(loss_fn)(model, opt.opt_state, x, r)
        opt.update(model, grads, loss=loss)
        return loss

      for i in range(2):
        step(model, opt, _x(i), rngs)
      return nnx.state(model, nnx.BatchStat), rngs

    stats, rngs = run(True)
    want_stats, want_rngs = run(False)
    assert _leaves_equal(stats, want_stats)
    assert (
      int(rngs.dropout.count[...]) == int(want_rngs.dropout.count[...]) == 2
    )

  def test_returning_a_module_is_an_error(self):
    with pytest.raises(TypeError, match=r"returned an NNX object"):
      jaxmp.autocast(lambda m: m)(_BnDrop(nnx.Rngs(0)))

  def test_import_jaxmp_does_not_import_flax(self):
    code = (
      "import sys, jaxmp, jax.numpy as jnp\n"
      "jaxmp.autocast(lambda x: x @ x)(jnp.ones((2, 2)))\n"
      "assert 'flax' not in sys.modules, 'flax imported'\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def _loss(p, x):
  return jnp.mean(jnp.square(p["w"].astype(jnp.float32) * x - 1.0))


def _params():
  return {"w": jnp.full((4,), 0.5, jnp.float16)}


class TestUnscaledGradients:
  """Formerly silent: loss 14.30 after 100 steps where scaled code reaches 0.0018."""

  def test_jax_grad_warns_once_naming_the_fix(self):
    opt, params = _mp(), _params()
    state = opt.init(params)

    @jax.jit
    def step(params, state, x):
      grads = jax.grad(_loss)(params, x)
      return opt.update(grads, state, params)

    with pytest.warns(jaxmp.UnscaledGradientsWarning) as record:
      step(params, state, jnp.ones(4))
      step(params, state, jnp.ones(4))  # Cached: traced once, warned once.
    assert len(record) == 1
    msg = str(record[0].message)
    assert "jaxmp.value_and_grad" in msg and "jaxmp.scale_loss" in msg
    assert "UnscaledGradientsWarning" in msg  # How to silence it.
    assert record[0].filename == __file__  # The user's line.

  def test_nnx_value_and_grad_with_nnx_optimizer_warns(self):
    model = nnx.Linear(4, 1, param_dtype=jnp.float16, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, _mp(), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x):
      loss_fn = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)
      _, grads = nnx.value_and_grad(loss_fn)(model)
      opt.update(model, grads)

    with pytest.warns(jaxmp.UnscaledGradientsWarning):
      step(model, opt, jnp.ones((2, 4), jnp.float16))

  def test_eqx_filter_grad_warns(self):
    model = eqx.nn.Linear(4, 1, key=jax.random.key(0))
    opt = _mp()
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, x):
      loss_fn = lambda m: jnp.mean(jax.vmap(m)(x) ** 2)
      grads = eqx.filter_grad(loss_fn)(model)
      params = eqx.filter(model, eqx.is_inexact_array)
      return opt.update(grads, state, params)

    with pytest.warns(jaxmp.UnscaledGradientsWarning):
      step(model, state, jnp.ones((2, 4)))

  @pytest.mark.parametrize(
    "wrap", ["bare", "multi_steps", "chain_identity", "inject"]
  )
  def test_scaled_steps_do_not_warn(self, wrap):
    opt = {
      "bare": _mp,
      "multi_steps": lambda: jaxmp.multi_steps(_mp(), 2),
      "chain_identity": lambda: optax.chain(_mp(), optax.identity()),
      "inject": lambda: optax.inject_hyperparams(
        jaxmp.mixed_precision,
        static_args=("loss_scale", "max_loss_scale", "hysteresis"),
      )(optax.sgd(0.1)),
    }[wrap]()
    params = _params()
    state = opt.init(params)

    @jax.jit
    def step(params, state, x):
      loss, grads = jaxmp.value_and_grad(_loss)(params, state, x)
      return opt.update(grads, state, params, loss=loss)

    @jax.jit
    def step_scale_loss(params, state, x):
      f = lambda p: jaxmp.scale_loss(_loss(p, x), state)
      return opt.update(jax.grad(f)(params), state, params)

    with warnings.catch_warnings():
      warnings.simplefilter("error")
      step(params, state, jnp.ones(4))
      step_scale_loss(params, state, jnp.ones(4))

  def test_scaled_nnx_steps_do_not_warn(self):
    model = nnx.Linear(4, 1, param_dtype=jnp.float16, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, _mp(), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x):
      loss_fn = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)
      loss, grads = jaxmp.value_and_grad(loss_fn)(model, opt.opt_state)
      opt.update(model, grads, loss=loss)

    with warnings.catch_warnings():
      warnings.simplefilter("error")
      step(model, opt, jnp.ones((2, 4), jnp.float16))

  def test_silenced_by_its_category_static_and_eager_unchecked(self):
    params = _params()
    grads = jax.grad(_loss)(params, jnp.ones(4))
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      # A static scale is the user's explicit choice; eager steps are not
      # traced.
      static = _mp(loss_scale=8.0)
      jax.jit(static.update)(grads, static.init(params), params)
      dynamic = _mp()
      dynamic.update(grads, dynamic.init(params), params)
      # The documented silence, for code that scales the loss by hand.
      warnings.filterwarnings("ignore", category=jaxmp.UnscaledGradientsWarning)
      jax.jit(dynamic.update)(grads, dynamic.init(params), params)


def _rnn_step(w):
  def body(h, x):
    h = jnp.tanh((h + x) @ w)  # An fp16 product: an fp16 carry under autocast.
    return h, h @ w

  return body


class TestLoopBodies:
  """Formerly an error from JAX that did not name autocast (an fp16 carry).

  A loop body under autocast keeps its carry's traced dtype by itself (the
  only dtype the loop accepts); a scan body's stacked outputs follow the
  rules.
  """

  def test_scan_body_keeps_its_carry_dtype(self):
    w = jax.random.normal(jax.random.key(0), (4, 4)) * 0.3
    h0, xs = jnp.zeros((2, 4), jnp.float16), jnp.ones((3, 2, 4), jnp.float16)
    h0 = h0.astype(jnp.float32)
    xs = xs.astype(jnp.float32)
    body = _rnn_step(w)
    h, ys = jax.lax.scan(jaxmp.autocast(body, keep_output_dtypes=True), h0, xs)
    assert h.dtype == ys.dtype == jnp.float32
    # Per output: the carry kept, the stacked outputs left in fp16.
    per = jaxmp.autocast(body, keep_output_dtypes=(True, False))
    h2, ys2 = jax.lax.scan(per, h0, xs)
    assert h2.dtype == jnp.float32 and ys2.dtype == jnp.float16
    np.testing.assert_array_equal(h2, h)  # The same fp16 products.
    # Unasked, the same: the carry kept, the outputs in fp16 (also under jit).
    h3, ys3 = jax.lax.scan(jaxmp.autocast(body), h0, xs)
    assert h3.dtype == jnp.float32 and ys3.dtype == jnp.float16
    np.testing.assert_array_equal(h3, h)
    np.testing.assert_array_equal(ys3, ys2)
    run = jax.jit(lambda h0: jax.lax.scan(jaxmp.autocast(body), h0, xs))
    np.testing.assert_array_equal(run(h0)[0], h)
    # The products did run in fp16: within fp16 rounding of fp32, not equal.
    want, _ = jax.lax.scan(body, h0, xs)
    assert not np.array_equal(h, want)
    np.testing.assert_allclose(h, want, atol=3 * 8 * 2.0**-11)

  def test_fori_and_while_loop_bodies_keep_their_carry_dtype(self):
    w = jax.random.normal(jax.random.key(0), (4, 4)) * 0.3
    h0 = jnp.ones((2, 4))
    f = jaxmp.autocast(lambda i, h: jnp.tanh(h @ w))
    want = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), h0)
    got = jax.lax.fori_loop(0, 3, f, h0)  # through scan (static trips)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=3 * 8 * 2.0**-11)
    dyn = jax.jit(lambda n: jax.lax.fori_loop(0, n, f, h0))(3)  # while
    np.testing.assert_array_equal(dyn, got)
    g = jaxmp.autocast(lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)))
    out = jax.lax.while_loop(lambda c: c[0] < 3, g, (0, h0))
    assert out[1].dtype == jnp.float32
    np.testing.assert_array_equal(out[1], got)

  def test_functions_called_inside_a_loop_body_keep_the_rules(self):
    # Only the body the loop calls keeps its carry: an autocast function the
    # user's body calls, or lax.map's function, returns its products in fp16.
    w = jnp.full((4, 4), 0.25)
    f = jaxmp.autocast(lambda h: h @ w)

    def body(h, x):
      y = f(h)
      assert y.dtype == jnp.float16
      return h + x, y

    _, ys = jax.lax.scan(body, jnp.ones((2, 4)), jnp.ones((3, 2, 4)))
    assert ys.dtype == jnp.float16
    assert jax.lax.map(f, jnp.ones((3, 2, 4))).dtype == jnp.float16

  def test_fori_and_while_loop_bodies(self):
    w = jax.random.normal(jax.random.key(0), (4, 4)) * 0.3
    h0 = jnp.ones((2, 4))
    f = jaxmp.autocast(lambda i, h: jnp.tanh(h @ w), keep_output_dtypes=True)
    assert jax.lax.fori_loop(0, 3, f, h0).dtype == jnp.float32
    g = jaxmp.autocast(
      lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), keep_output_dtypes=True
    )
    out = jax.lax.while_loop(lambda c: c[0] < 3, g, (0, h0))
    assert out[1].dtype == jnp.float32

  def test_a_bad_keep_output_dtypes_names_itself(self):
    f = jaxmp.autocast(lambda x: (x @ x, x), keep_output_dtypes=(True,))
    with pytest.raises(ValueError, match=r"keep_output_dtypes"):
      f(jnp.ones((2, 2)))
    g = jaxmp.autocast(lambda x: x @ x, keep_output_dtypes="yes")
    with pytest.raises(TypeError, match=r"keep_output_dtypes"):
      g(jnp.ones((2, 2)))


class TestEquinoxPlaceholders:
  """Formerly wrong: "2 param(s) have no fp32 master (first: .activation)"."""

  def _mlp(self, dtype):
    model = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))
    return jax.tree.map(
      lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model
    )

  def test_half_mlp_masters_come_back_with_the_placeholders(self):
    params = eqx.filter(self._mlp(jnp.float16), eqx.is_inexact_array)
    opt = _mp()
    state = opt.init(params)
    masters = jaxmp.master_params(state)
    assert masters.activation is None and masters.final_activation is None
    assert jax.tree.structure(masters) == jax.tree.structure(params)
    for m, p in zip(jax.tree.leaves(masters), jax.tree.leaves(params)):
      assert m.dtype == jnp.float32
      np.testing.assert_array_equal(m, p.astype(jnp.float32))
    # A step (jitted, scaled) keeps them so.
    grads = jax.tree.map(jnp.ones_like, params)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", jaxmp.UnscaledGradientsWarning)
      updates, state = jax.jit(opt.update)(grads, state, params)
    new = optax.apply_updates(params, updates)
    for m, p in zip(
      jax.tree.leaves(jaxmp.master_params(state)), jax.tree.leaves(new)
    ):
      np.testing.assert_array_equal(m.astype(jnp.float16), p)

  @pytest.mark.parametrize("mode", [True, "kahan"])
  def test_fp32_mlp_counts_its_four_arrays(self, mode):
    params = eqx.filter(self._mlp(jnp.float32), eqx.is_inexact_array)
    state = _mp(master_weights=mode).init(params)
    with pytest.raises(ValueError, match=r"^4 param\(s\) have no fp32 master"):
      jaxmp.master_params(state)
    full = jaxmp.master_params(state, params)
    assert full.activation is None
    assert _leaves_equal(full, params)


class TestSmallerOnes:
  def test_rollback_refuses_the_state_from_before_update(self):
    """Formerly silent: the new statistics kept on a skipped step."""
    opt, params = _mp(), _params()
    before = opt.init(params)
    inf = {"w": jnp.full(4, jnp.inf, jnp.float16)}
    _, after = opt.update(inf, before, params)
    with pytest.raises(ValueError, match=r"from before this step's update"):
      jaxmp.rollback_if_skipped(before, {"m": 1.0}, {"m": 0.0})
    got = jaxmp.rollback_if_skipped(after, {"m": 1.0}, {"m": 0.0})
    assert float(got["m"]) == 0.0  # Skipped: the old statistics.

    @jax.jit
    def step(state, g):
      _, new = opt.update(g, state, params)
      return jaxmp.rollback_if_skipped(state, {"m": 1.0}, {"m": 0.0})

    with warnings.catch_warnings():  # Gradients made by hand, unscaled.
      warnings.simplefilter("ignore", jaxmp.UnscaledGradientsWarning)
      with pytest.raises(ValueError, match=r"Pass the state update returned"):
        step(after, inf)
    assert "which state" in jaxmp.rollback_if_skipped.__doc__.lower()

  def test_debug_names_the_users_line_beside_the_flax_layer(self):
    """Formerly: Flax's linear.py:287, not the line that called the layer."""
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.ones((4, 4))  # 4 * 6e4 overflows fp16.
    reports = []

    def forward(m, x):
      return m(x)  # <- the user's line

    x = jnp.full((2, 4), 6e4)
    jaxmp.autocast(forward, debug=reports.append)(model, x)
    jax.effects_barrier()
    assert reports, "no overflow reported"
    rep = reports[0]
    line = rep.source.split(":")[1].split()[0]
    assert rep.source.startswith(f"{__file__}:") and ".forward)" in rep.source
    with open(__file__) as f:
      assert "<- the user's line" in f.read().splitlines()[int(line) - 1]
    assert "flax" in rep.layer and "linear.py" in rep.layer
    assert rep.layer in str(rep) and rep.source in str(rep)
    # Plain JAX: the user's line, no layer.
    plain = []
    jaxmp.autocast(lambda w, x: x @ w, debug=plain.append)(jnp.ones((4, 4)), x)
    jax.effects_barrier()
    assert plain[0].source.startswith(f"{__file__}:") and plain[0].layer == ""

  def test_argument_errors_name_the_argument(self):
    with pytest.raises(TypeError, match=r"argnums=1.*only argnums=0"):
      jaxmp.value_and_grad(lambda a, b: a * b, argnums=1)
    params = _params()
    with pytest.raises(ValueError, match=r"second argument of grad_fn") as e:
      jaxmp.value_and_grad(_loss)(params, jnp.ones(4))  # opt_state forgotten
    assert "(got an ArrayImpl)" in str(e.value)
    with pytest.raises(
      ValueError, match=r"second argument of jaxmp\.scale_loss"
    ):
      jaxmp.scale_loss(1.0, params)

  def test_identity_after_it_is_allowed_a_clip_is_not(self):
    """Formerly rejected: ``chain(mixed_precision(sgd), optax.identity())``."""
    params = _params()

    def step_of(opt):
      @jax.jit
      def step(params, state, x):
        loss, grads = jaxmp.value_and_grad(_loss)(params, state, x)
        return opt.update(grads, state, params, loss=loss)

      return step

    bare = _mp()
    want, _ = step_of(bare)(params, bare.init(params), jnp.ones(4))
    chained = optax.chain(_mp(), optax.identity())
    got, _ = step_of(chained)(params, chained.init(params), jnp.ones(4))
    assert _leaves_equal(got, want)
    clipped = optax.chain(_mp(), optax.clip(1.0))
    with pytest.raises(ValueError, match=r"outermost transform"):
      step_of(clipped)(params, clipped.init(params), jnp.ones(4))
