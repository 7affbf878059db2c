"""`diagnostics=True`, `jaxmp.overflow_report` and ``update(..., loss=)``."""

import functools

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxmp
from _helpers import tiny_mlp_params

# These tests give update gradients made by hand (scaled or not, on
# purpose), as code that scales the loss by hand does: the documented
# silence of the unscaled-gradients warning.
pytestmark = pytest.mark.filterwarnings(
  "ignore::jaxmp.UnscaledGradientsWarning"
)

SCALE = 2.0**8
PATHS = (
  "['dense1']['bias']",
  "['dense1']['kernel']",
  "['dense2']['bias']",
  "['dense2']['kernel']",
)


_params = tiny_mlp_params


def _loss_fn(params, x, y):
  d1, d2 = params["dense1"], params["dense2"]
  dtype = d1["kernel"].dtype
  h = jnp.tanh(x.astype(dtype) @ d1["kernel"] + d1["bias"])
  logits = (h @ d2["kernel"] + d2["bias"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _batch(n=8, seed=1):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 4)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(rng.integers(0, 3, n), jnp.int32)


def _opt(**kwargs):
  kwargs.setdefault("loss_scale", jmp.DynamicLossScale(jnp.float32(SCALE)))
  return jaxmp.mixed_precision(optax.sgd(0.1), **kwargs)


def _inject(grads, path, value, count):
  """Sets the first ``count`` elements of the leaf at ``path`` to ``value``."""

  def put(p, g):
    if jax.tree_util.keystr(p) != path:
      return g
    flat = g.reshape(-1)
    return flat.at[:count].set(jnp.asarray(value, g.dtype)).reshape(g.shape)

  return jax.tree_util.tree_map_with_path(put, grads)


def _grads(params, state, x, y):
  scaled = lambda p: jaxmp.scale_loss(_loss_fn(p, x, y), state)
  return jax.grad(scaled)(params)


def _true_rows(grads, scale):
  """``{path: (nonfinite, max_abs, zero_fraction)}`` computed in NumPy."""
  out = {}
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    g = np.asarray(g)
    u = g.astype(np.float32) / np.float32(scale)
    ok = np.isfinite(u)
    max_abs = float(np.max(np.abs(u[ok]), initial=0.0))
    zero = None
    if g.dtype in (np.float16, jnp.bfloat16):
      tiny = np.float32(jnp.finfo(g.dtype).tiny)
      small = np.abs(g.astype(np.float32)) < tiny  # NaN compares False
      zero = float(np.float32(small.sum()) / np.float32(g.size))
    out[jax.tree_util.keystr(path)] = (int((~ok).sum()), max_abs, zero)
  return out


def _check_report(rows, truth):
  assert sorted(r.path for r in rows) == sorted(truth)
  for r in rows:
    assert (r.nonfinite, r.max_abs, r.zero_fraction) == truth[r.path], r.path
  keys = [(-r.nonfinite, -r.max_abs) for r in rows]
  assert keys == sorted(keys)  # Worst first.


class TestOffByDefault:
  def test_state_and_compiled_update_are_unchanged(self):
    params = _params()
    grads = jax.tree.map(jnp.ones_like, params)
    texts, structures = [], []
    for opt in (_opt(), _opt(diagnostics=False), _opt(diagnostics=True)):
      state = opt.init(params)
      structures.append(jax.tree_util.tree_structure(state))
      texts.append(jax.jit(opt.update).lower(grads, state, params).as_text())
    assert jaxmp.find_state(_opt().init(params)).diagnostics is None
    assert structures[0] == structures[1] and texts[0] == texts[1]
    # The comparison can fail: diagnostics=True changes both.
    assert structures[2] != structures[0] and texts[2] != texts[0]

  def test_report_without_diagnostics_is_a_clear_error(self):
    state = _opt().init(_params())
    with pytest.raises(ValueError, match=r"diagnostics=True"):
      jaxmp.overflow_report(state)

  def test_non_bool_is_rejected(self):
    with pytest.raises(TypeError, match="static_args"):
      _opt(diagnostics=jnp.array(True))


@pytest.mark.invariant
class TestOverflowReport:
  @pytest.mark.parametrize(
    "path,value,count",
    [
      ("['dense1']['kernel']", jnp.inf, 3),
      ("['dense2']['bias']", jnp.nan, 1),
      ("['dense2']['kernel']", -jnp.inf, 24),
      ("['dense1']['bias']", jnp.nan, 5),
    ],
  )
  def test_names_the_injected_leaf_with_its_count(self, path, value, count):
    opt = _opt(diagnostics=True)
    params, (x, y) = _params(), _batch()
    state = opt.init(params)

    @jax.jit
    def step(params, state):
      grads = _inject(_grads(params, state, x, y), path, value, count)
      _, new_state = opt.update(grads, state, params)
      return grads, new_state

    grads, new_state = step(params, state)
    rows = jaxmp.overflow_report(new_state)
    assert [r.path for r in rows.offending] == [path]
    assert rows[0].path == path and rows[0]["nonfinite"] == count
    assert all(r.nonfinite == 0 for r in rows[1:])
    _check_report(rows, _true_rows(grads, SCALE))
    first = str(rows).splitlines()[0]
    assert path in first and f"({count} non-finite)" in first
    assert not bool(jaxmp.stats(new_state)["step_applied"])

  def test_clean_step_reports_every_leaf_finite(self):
    opt = _opt(diagnostics=True)
    params, (x, y) = _params(), _batch()
    state = opt.init(params)
    grads = jax.jit(_grads)(params, state, x, y)
    _, state = jax.jit(opt.update)(grads, state, params)
    rows = jaxmp.overflow_report(state)
    assert rows.offending == [] and len(rows) == len(PATHS)
    assert rows.rows == tuple(rows)  # As the other two reports.
    assert all(r.max_abs > 0 for r in rows)
    _check_report(rows, _true_rows(grads, SCALE))
    assert "all gradients finite" in str(rows)
    row = rows[0]
    assert dict(row) == {k: getattr(row, k) for k in row.keys()}

  def test_underflow_fractions_match_a_numpy_count(self):
    # Gradients spread over 2**-30..2**0 in fp16 and bf16 (and an fp32 leaf,
    # which is not measured): a share of each is zero or subnormal.
    rng = np.random.default_rng(0)
    exps = lambda n: rng.uniform(-30, 0, n)
    grads = {
      "h": jnp.asarray(2.0 ** exps(1000), jnp.float16),
      "b": jnp.asarray(-(2.0 ** exps(700)) * 2.0**-110, jnp.bfloat16),
      "f": jnp.asarray(2.0 ** exps(50), jnp.float32),
      "z": jnp.zeros((3, 5), jnp.float16),
    }
    params = jax.tree.map(jnp.zeros_like, grads)
    opt = _opt(diagnostics=True)
    _, state = jax.jit(opt.update)(grads, opt.init(params), params)
    rows = {r.path: r for r in jaxmp.overflow_report(state)}
    truth = _true_rows(grads, SCALE)
    assert 0.1 < truth["['h']"][2] < 0.9 and 0.1 < truth["['b']"][2] < 0.9
    for path, (_, max_abs, zero) in truth.items():
      assert (rows[path].max_abs, rows[path].zero_fraction) == (max_abs, zero)
    assert rows["['f']"].zero_fraction is None
    assert rows["['z']"].zero_fraction == 1.0


class TestWrappers:
  @pytest.mark.parametrize("wrapper", ["chain", "multi_steps", "inject"])
  def test_found_inside(self, wrapper):
    loss_scale = jmp.DynamicLossScale(jnp.float32(SCALE))
    if wrapper == "chain":
      # A chain of one: more is a placement error (tests/test_misuse.py).
      opt = optax.chain(_opt(diagnostics=True))
      k = 1
    elif wrapper == "multi_steps":
      opt, k = jaxmp.multi_steps(_opt(diagnostics=True), 2), 2
    else:
      opt = optax.inject_hyperparams(
        jaxmp.mixed_precision,
        static_args=("loss_scale", "max_loss_scale", "hysteresis"),
      )(optax.sgd(0.1), loss_scale=loss_scale, diagnostics=True)
      k = 1
    params, (x, y) = _params(), _batch()
    state = opt.init(params)
    path = "['dense2']['kernel']"

    @jax.jit
    def step(params, state):
      grads = _inject(_grads(params, state, x, y), path, jnp.nan, 2)
      updates, state = opt.update(grads, state, params)
      return grads, optax.apply_updates(params, updates), state

    for _ in range(k):
      grads, params, state = step(params, state)
    rows = jaxmp.overflow_report(state)
    assert [(r.path, r.nonfinite) for r in rows.offending] == [(path, 2)]
    if k == 1:
      _check_report(rows, _true_rows(grads, SCALE))


def _mesh():
  return Mesh(np.array(jax.devices()[:4]), ("data",))


@pytest.mark.devices(4)
class TestShardMap:
  def test_report_from_shard_map_state(self):
    # The NaN is injected on device 2 only, before the gradients are
    # averaged: the averaged leaf holds it on every device.
    mesh = _mesh()
    opt = _opt(diagnostics=True, axis_name="data")
    params, (x, y) = _params(), _batch(16)
    state = opt.init(params)
    path = "['dense1']['kernel']"

    @jax.jit
    @functools.partial(
      jax.shard_map,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P(), P()),
    )
    def step(params, state, x, y):
      grads = _grads(params, state, x, y)
      bad = _inject(grads, path, jnp.nan, 4)
      mine = jax.lax.axis_index("data") == 2
      grads = jax.tree.map(lambda b, g: jnp.where(mine, b, g), bad, grads)
      grads = jax.lax.pmean(grads, "data")
      _, state = opt.update(grads, state, params)
      return grads, state

    grads, state = step(params, state, x, y)
    rows = jaxmp.overflow_report(state)
    assert [(r.path, r.nonfinite) for r in rows.offending] == [(path, 4)]
    _check_report(rows, _true_rows(grads, SCALE))
    assert float(jaxmp.stats(state)["loss_scale"]) == SCALE / 2


def _sgd_checking_extra_args(seen):
  sgd = optax.sgd(0.1)

  def update(updates, state, params=None, **extra_args):
    seen.append(sorted(extra_args))
    return sgd.update(updates, state, params)

  return optax.GradientTransformationExtraArgs(sgd.init, update)


class TestNonFiniteLoss:
  def _run(self, opt, steps, *, nan_data, pass_loss=True):
    params, (x, y) = _params(), _batch()
    if nan_data:
      x = x.at[3, 1].set(jnp.nan)  # One bad pixel of one example.
    state = opt.init(params)

    @jax.jit
    def step(params, state):
      scaled = lambda p: jaxmp.scale_loss(_loss_fn(p, x, y), state)
      grads = jax.grad(scaled)(params)
      loss = _loss_fn(params, x, y)
      kwargs = dict(loss=loss) if pass_loss else {}
      updates, state = opt.update(grads, state, params, **kwargs)
      return optax.apply_updates(params, updates), state

    for _ in range(steps):
      params, state = step(params, state)
    return params, state

  def test_nan_data_keeps_the_scale_and_is_counted_apart(self):
    params, state = self._run(_opt(), 3, nan_data=True)
    stats = jax.device_get(jaxmp.stats(state))
    assert float(stats["loss_scale"]) == SCALE
    assert int(stats["skipped_steps"]) == 3
    assert int(stats["nonfinite_loss_steps"]) == 3
    assert int(stats["consecutive_nonfinite_loss"]) == 3
    assert int(stats["consecutive_overflows"]) == 0
    assert not bool(stats["step_applied"])
    assert jax.tree.all(jax.tree.map(jnp.array_equal, params, _params()))

  def test_without_loss_the_scale_backs_off_as_before(self):
    _, state = self._run(_opt(), 3, nan_data=True, pass_loss=False)
    stats = jax.device_get(jaxmp.stats(state))
    assert float(stats["loss_scale"]) == SCALE / 8
    assert int(stats["nonfinite_loss_steps"]) == 0
    assert int(stats["consecutive_overflows"]) == 3

  def test_finite_loss_changes_nothing(self):
    runs = [
      self._run(_opt(), 2, nan_data=False, pass_loss=p) for p in (True, False)
    ]
    (with_loss, s1), (without, s2) = runs
    assert jax.tree.all(jax.tree.map(jnp.array_equal, with_loss, without))
    for state in (s1, s2):
      assert int(jaxmp.stats(state)["skipped_steps"]) == 0
    assert not jax.tree.all(jax.tree.map(jnp.array_equal, with_loss, _params()))

  def test_check_health_names_the_loss_and_the_steps(self):
    opt = _opt()
    _, state = self._run(opt, 4, nan_data=True)
    jaxmp.check_health(state, 10, max_consecutive_skips=5)
    _, state = self._run(opt, 5, nan_data=True)
    with pytest.raises(jaxmp.NonFiniteLossError) as e:
      jaxmp.check_health(state, 12, max_consecutive_skips=5)
    msg = str(e.value)
    assert "loss itself was NaN/inf" in msg and "not an fp16" not in msg
    assert "an fp16 overflow in the forward pass, in the activations" in msg
    assert "steps 8..12 (5 in a row)" in msg and "256" in msg
    with pytest.raises(jaxmp.NonFiniteLossError):
      jaxmp.check_health(state, 12, 100, max_nonfinite_loss_steps=5)
    jaxmp.check_health(state, 12, 5, max_nonfinite_loss_steps=6)

  def test_a_finite_loss_resets_the_run(self):
    opt = _opt()
    params = _params()
    state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    update = jax.jit(opt.update)
    for loss in (jnp.nan, jnp.inf, 1.0, jnp.nan):
      _, state = update(grads, state, params, loss=jnp.float32(loss))
    stats = jax.device_get(jaxmp.stats(state))
    assert int(stats["nonfinite_loss_steps"]) == 3
    assert int(stats["consecutive_nonfinite_loss"]) == 1
    assert int(stats["skipped_steps"]) == 3

  def test_loss_is_not_passed_to_inner(self):
    seen = []
    opt = jaxmp.mixed_precision(_sgd_checking_extra_args(seen))
    params = _params()
    grads = jax.tree.map(jnp.ones_like, params)
    opt.update(grads, opt.init(params), params, loss=1.0, other=2)
    assert seen == [["other"]]

  @pytest.mark.devices(4)
  def test_nan_data_on_one_device_under_shard_map(self):
    mesh = _mesh()
    opt = _opt(axis_name="data", diagnostics=True)
    params, (x, y) = _params(), _batch(16)
    x = x.at[9, 0].set(jnp.nan)  # Device 2's shard.
    state = opt.init(params)

    @jax.jit
    @functools.partial(
      jax.shard_map,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P(), P()),
    )
    def step(params, state, x, y):
      scaled = lambda p: jaxmp.scale_loss(_loss_fn(p, x, y), state)
      grads = jax.lax.pmean(jax.grad(scaled)(params), "data")
      loss = _loss_fn(params, x, y)  # Device-local: NaN on device 2 only.
      updates, state = opt.update(grads, state, params, loss=loss)
      return optax.apply_updates(params, updates), state

    for _ in range(2):
      params, state = step(params, state, x, y)
    stats = jax.device_get(jaxmp.stats(state))
    assert float(stats["loss_scale"]) == SCALE
    assert int(stats["nonfinite_loss_steps"]) == 2
    rows = jaxmp.overflow_report(state)
    assert rows.loss_finite is False and "loss itself" in str(rows)
    with pytest.raises(jaxmp.NonFiniteLossError, match=r"steps 1\.\.2"):
      jaxmp.check_health(state, 2, max_consecutive_skips=2)
