"""Tests for jaxmp.nn.BatchNorm and its fused train-mode VJP (CPU)."""

import functools

from absl.testing import parameterized
import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest

from jaxmp._src.nn import fused_norm

f16, f32 = jnp.float16, jnp.float32


def _reference_norm_act(x, scale, bias, residual, relu):
  """nn.BatchNorm (train) + add + relu, with the same variables."""
  y, updates = nn.BatchNorm(use_running_average=False, momentum=0.9).apply(
    {
      "params": {"scale": scale, "bias": bias},
      "batch_stats": {
        "mean": jnp.zeros_like(scale),
        "var": jnp.ones_like(scale),
      },
    },
    x,
    mutable=["batch_stats"],
  )
  if residual is not None:
    y = y + residual
  return (nn.relu(y) if relu else y), updates["batch_stats"]


def _fused_norm_act(x, scale, bias, residual, relu, axis_name=None):
  return fused_norm.FusedBatchNorm(
    use_running_average=False, relu=relu, axis_name=axis_name
  ).apply(
    {
      "params": {"scale": scale, "bias": bias},
      "batch_stats": {
        "mean": jnp.zeros_like(scale),
        "var": jnp.ones_like(scale),
      },
    },
    x,
    residual=residual,
    mutable=["batch_stats"],
  )[0]


def _norm_inputs(dtype=f32, shape=(4, 3, 3, 5)):
  rng = np.random.default_rng(2)
  x = 2 * rng.normal(size=shape) + 0.5
  residual = rng.normal(size=shape)
  scale = 1 + 0.5 * rng.normal(size=shape[-1:])
  bias = 0.5 * rng.normal(size=shape[-1:])
  return tuple(jnp.asarray(a, dtype) for a in (x, scale, bias, residual))


U32 = 2.0**-24  # float32's unit roundoff.


def _moment_errors(xs):
  """Worst-case float32 errors of a channel's mean and biased variance.

  ``xs``: ``[n, C]`` float64 values. flax's fast moments, as FusedBatchNorm
  computes them: mean and mean of squares are sums of n terms, off by at
  most n u times the mean magnitude in any summation order (squares rounded
  once more); var = mean(x^2) - mean(x)^2 adds the square's error and two
  roundings.
  """
  n = xs.shape[0]
  mean, mean_sq = xs.mean(0), np.mean(xs**2, 0)
  d_mean = n * U32 * np.abs(xs).mean(0)
  d_var = (n + 1) * U32 * mean_sq + 2 * np.abs(mean) * d_mean + d_mean**2
  return d_mean, d_var + 2 * U32 * (mean_sq + mean**2)


def _norm_bounds(x, scale, bias, residual, relu, ct, eps=1e-5):
  """Float64 BatchNorm(+add)(+ReLU) and float32 error bounds for one side.

  Returns ``(dy, dgrads)``: per-element bounds on |y32 - y| of one float32
  implementation, and on each gradient of ``sum(y * ct)`` (x, scale, bias,
  residual). The output moves with the statistics' errors (`_moment_errors`)
  through ``(x - mean) * rstd * scale`` (rstd's relative error is half the
  variance's) plus a few roundings of each term. The backward pass is three
  chains of per-channel sums of n terms (mean g, mean g x_hat, then dscale,
  dbias) whose float32 errors, and the statistics' through x_hat, are each at
  most n u times the sum of the magnitudes of what is summed (``mass``):
  4 n u mass.
  """
  c = x.shape[-1]
  xs = np.asarray(x, np.float64).reshape(-1, c)
  n = xs.shape[0]
  s, b = np.asarray(scale, np.float64), np.asarray(bias, np.float64)
  mean, var = xs.mean(0), xs.var(0)
  rstd = 1 / np.sqrt(var + eps)
  x_hat = (xs - mean) * rstd
  pre = x_hat * s + b
  res = 0.0 if residual is None else np.asarray(residual, np.float64)
  res = np.reshape(res, (-1, c)) if residual is not None else 0.0
  pre = pre + res
  d_mean, d_var = _moment_errors(xs)
  d_xhat = rstd * (d_mean + np.abs(xs - mean) * d_var / (2 * (var + eps)))
  d_xhat += 3 * U32 * np.abs(x_hat)
  dy = np.abs(s) * d_xhat + 4 * U32 * (np.abs(x_hat * s) + np.abs(b))
  dy = dy + 2 * U32 * np.abs(res)
  g = np.asarray(ct, np.float64).reshape(-1, c) * (pre > 0 if relu else 1)
  mass = {
    "bias": np.abs(g).sum(0),
    "scale": np.abs(g * x_hat).sum(0)
    + np.abs(g).sum(0) * d_xhat.max(0) / (n * U32),
    "x": np.abs(s)
    * rstd
    * (
      np.abs(g) + np.abs(g).mean(0) + np.abs(x_hat) * np.abs(g * x_hat).mean(0)
    ),
    "residual": np.abs(g),
  }
  dgrads = {
    k: 4 * n * U32 * (v.reshape(x.shape) if v.ndim == 2 else v)
    for k, v in mass.items()
  }
  return dy.reshape(x.shape), dgrads


def _assert_within(got, want, bound, msg=""):
  """|got - want| <= bound elementwise (float64)."""
  got = np.asarray(got, np.float64)
  err = np.abs(got - np.asarray(want, np.float64))
  bound = np.broadcast_to(bound, err.shape) + 1e-30
  assert np.all(err <= bound), f"{msg} max err/bound {np.max(err / bound):.3g}"


class FusedNormTest(parameterized.TestCase):
  @parameterized.product(relu=(True, False), with_residual=(True, False))
  def test_check_grads_float64(self, relu, with_residual):
    with jax.enable_x64(True):
      x, scale, bias, residual = _norm_inputs(jnp.float64)
      if not with_residual:
        residual = None

      def f(x, scale, bias, residual):
        y, _, _ = fused_norm.fused_batch_norm(
          x, scale, bias, residual, relu=relu
        )
        return y

      jax.test_util.check_grads(
        f, (x, scale, bias, residual), order=1, modes=["rev"], eps=1e-6
      )

  @parameterized.product(relu=(True, False), with_residual=(True, False))
  def test_matches_flax_batch_norm(self, relu, with_residual):
    x, scale, bias, residual = _norm_inputs()
    if not with_residual:
      residual = None
    ct = jnp.asarray(np.random.default_rng(3).normal(size=x.shape), f32)

    def loss(fn, x, scale, bias, residual):
      y = fn(x, scale, bias, residual, relu)
      if isinstance(y, tuple):
        y = y[0]
      return jnp.sum(y * ct)

    argnums = (0, 1, 2, 3) if with_residual else (0, 1, 2)

    # Both sides, values and gradients, in one program.
    @jax.jit
    def both(x, scale, bias, residual):
      return [
        (
          fn(x, scale, bias, residual, relu),
          jax.grad(functools.partial(loss, fn), argnums)(
            x, scale, bias, residual
          ),
        )
        for fn in (_fused_norm_act, lambda *a: _reference_norm_act(*a)[0])
      ]

    (y_fused, g_fused), (y_ref, g_ref) = both(x, scale, bias, residual)
    # Two float32 implementations: each within `_norm_bounds` of the exact
    # values, so within twice that of each other.
    dy, dgrads = _norm_bounds(x, scale, bias, residual, relu, ct)
    _assert_within(y_fused, y_ref, 2 * dy, "y")
    names = ("x", "scale", "bias", "residual")[: len(argnums)]
    for name, a, b in zip(names, g_fused, g_ref):
      _assert_within(a, b, 2 * dgrads[name], name)

  def test_half_precision_io_float32_stats(self):
    x, scale, bias, residual = _norm_inputs(f16)
    scale, bias = scale.astype(f32), bias.astype(f32)
    y, mean, var = fused_norm.fused_batch_norm(
      x, scale, bias, residual, relu=True
    )
    self.assertEqual((y.dtype, mean.dtype, var.dtype), (f16, f32, f32))
    grads = jax.grad(
      lambda *a: jnp.sum(fused_norm.fused_batch_norm(*a, relu=True)[0]),
      argnums=(0, 1, 2, 3),
    )(x, scale, bias, residual)
    self.assertEqual([g.dtype for g in grads], [f16, f32, f32, f16])

  def test_saves_only_half_precision_activations(self):
    x, scale, bias, residual = _norm_inputs(f16, shape=(4, 8, 8, 16))
    scale, bias = scale.astype(f32), bias.astype(f32)

    def f(x):
      y = fused_norm.fused_batch_norm(x, scale, bias, residual, relu=True)[0]
      return jnp.sum(y.astype(f32))

    jaxpr = jax.make_jaxpr(lambda x: jax.vjp(f, x)[1])(x).jaxpr
    big = [v.aval for v in jaxpr.outvars if v.aval.size >= x.size]
    self.assertTrue(big)
    self.assertTrue(all(a.dtype == f16 for a in big), big)
    self.assertLessEqual(len(big), 2)  # x and the output; no mask, no fp32.

  def test_running_average_update(self):
    x, scale, bias, _ = _norm_inputs()
    stats = fused_norm.FusedBatchNorm(
      use_running_average=False, momentum=0.8
    ).apply(
      {
        "params": {"scale": scale, "bias": bias},
        "batch_stats": {"mean": jnp.full(5, 1.0), "var": jnp.full(5, 2.0)},
      },
      x,
      mutable=["batch_stats"],
    )[1]["batch_stats"]
    xs = np.asarray(x, np.float64).reshape(-1, 5)
    # The float32 moments' errors (`_moment_errors`) times 0.2, and the
    # update's three roundings (0.8 * old, 0.2 * new, their sum).
    d_mean, d_var = _moment_errors(xs)
    want_mean = 0.8 * 1.0 + 0.2 * xs.mean(0)
    _assert_within(
      stats["mean"], want_mean, 0.2 * d_mean + 3 * U32 * np.abs(want_mean)
    )
    want_var = 0.8 * 2.0 + 0.2 * xs.var(0)  # Biased, like nn.BatchNorm.
    _assert_within(
      stats["var"], want_var, 0.2 * d_var + 3 * U32 * np.abs(want_var)
    )
    # Not the unbiased variance: 0.2 var / (n - 1) away, far outside.
    self.assertTrue(
      np.all(0.2 * xs.var(0) / (len(xs) - 1) > 10 * (0.2 * d_var))
    )

  def test_axis_name_under_vmap(self):
    # Two "devices" as a named vmap axis: statistics span both, and each
    # device's gradient (taken inside the map, as in a pmap-ed train step) is
    # that of the summed loss, exactly as for nn.BatchNorm and as for one
    # device holding the whole batch.
    x, scale, bias, residual = _norm_inputs(shape=(2, 4, 3, 3, 5))
    ct = jnp.cos(jnp.arange(x.size, dtype=f32).reshape(x.shape))

    def fused(x, r, axis_name):
      return _fused_norm_act(x, scale, bias, r, True, axis_name=axis_name)

    def plain(x, r, axis_name):
      y, _ = nn.BatchNorm(use_running_average=False, axis_name=axis_name).apply(
        {
          "params": {"scale": scale, "bias": bias},
          "batch_stats": {"mean": jnp.zeros(5), "var": jnp.ones(5)},
        },
        x,
        mutable=["batch_stats"],
      )
      return nn.relu(y + r)

    def local_loss(fn, x, r, c):
      return jnp.sum(fn(x, r, "d") * c)

    def whole_batch_loss(x, r):
      y = fused(x.reshape(8, 3, 3, 5), r.reshape(8, 3, 3, 5), None)
      return jnp.sum(y.reshape(x.shape) * ct)

    mapped = jax.vmap(functools.partial(fused, axis_name="d"), axis_name="d")

    @jax.jit
    def everything(x, residual):
      whole = fused(x.reshape(8, 3, 3, 5), residual.reshape(8, 3, 3, 5), None)
      grads = [
        jax.vmap(
          jax.grad(functools.partial(local_loss, fn), (0, 1)), axis_name="d"
        )(x, residual, ct)
        for fn in (fused, plain)
      ]
      return (
        mapped(x, residual),
        whole.reshape(x.shape),
        jax.grad(whole_batch_loss, (0, 1))(x, residual),
        grads,
      )

    y_mapped, y_whole, expected, grads = everything(x, residual)
    # Two float32 computations of the statistics over the same n = 72
    # values per channel: each within `_norm_bounds` of exact, so within
    # twice that of each other.
    dy, dgrads = _norm_bounds(x, scale, bias, residual, True, ct)
    _assert_within(y_mapped, y_whole, 2 * dy, "y")
    for per_fn in grads:
      for name, a, b in zip(("x", "residual"), per_fn, expected):
        _assert_within(a, b, 2 * dgrads[name], name)


def _tol(dtype, n):
  """Tolerance for O(1) values after summing ``n`` terms in ``dtype``."""
  return 8 * float(jnp.finfo(dtype).eps) * np.sqrt(n)


class DropInTest(parameterized.TestCase):
  """jaxmp.nn.BatchNorm behaves as flax.linen.BatchNorm on the same args."""

  @parameterized.named_parameters(
    ("f32_train", f32, {}, True),
    ("f32_eval", f32, {}, False),
    ("f16_train", f16, {}, True),
    ("f16_eval", f16, {}, False),
    ("f16_dtype_f16", f16, dict(dtype=f16), True),
    ("no_scale", f32, dict(use_scale=False), True),
    ("no_bias_f16", f16, dict(use_bias=False), True),
    ("no_scale_no_bias_f16", f16, dict(use_scale=False, use_bias=False), True),
    (
      "inits_momentum",
      f32,
      dict(
        scale_init=nn.initializers.constant(1.5),
        bias_init=nn.initializers.constant(-0.25),
        momentum=0.7,
        epsilon=1e-3,
      ),
      True,
    ),
    ("axis_last_explicit", f32, dict(axis=3), True),
  )
  def test_matches_flax(self, dtype, kwargs, train):
    x, _, _, _ = _norm_inputs(dtype)
    ours = fused_norm.FusedBatchNorm(**kwargs)
    ref = nn.BatchNorm(**kwargs)
    v_ours = ours.init(jax.random.key(0), x, use_running_average=not train)
    v_ref = ref.init(jax.random.key(0), x, use_running_average=not train)
    shapes = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)
    self.assertEqual(shapes(v_ours), shapes(v_ref))
    for a, b in zip(jax.tree.leaves(v_ours), jax.tree.leaves(v_ref)):
      np.testing.assert_array_equal(a, b)
    # Non-trivial running statistics for eval mode.
    stats = {"mean": jnp.full((5,), 0.3), "var": jnp.full((5,), 2.0)}
    variables = {**v_ref, "batch_stats": stats}

    def loss(module, params, x):
      y, upd = module.apply(
        {"params": params, "batch_stats": stats},
        x,
        use_running_average=not train,
        mutable=["batch_stats"],
      )
      return jnp.sum(jnp.sin(y.astype(f32))), (y, upd["batch_stats"])

    n = x.size // x.shape[-1]
    params = variables.get("params", {})
    (l1, (y1, s1)), g1 = jax.value_and_grad(
      functools.partial(loss, ours), (0, 1), has_aux=True
    )(params, x)
    (l2, (y2, s2)), g2 = jax.value_and_grad(
      functools.partial(loss, ref), (0, 1), has_aux=True
    )(params, x)
    self.assertEqual(y1.dtype, y2.dtype)
    # nn.BatchNorm does part of its arithmetic in the input's dtype (ours
    # stays in float32), so for fp16 inputs allow a few fp16 ulps of |y|.
    ymax = max(float(np.max(np.abs(np.asarray(y2, f32)))), 1.0)
    tol = 4 * float(jnp.finfo(x.dtype).eps) if x.dtype == f16 else _tol(f32, n)
    np.testing.assert_allclose(
      np.asarray(y1, f32), np.asarray(y2, f32), rtol=0, atol=tol * ymax
    )
    for k in ("mean", "var"):
      self.assertEqual(s1[k].dtype, s2[k].dtype)
      np.testing.assert_allclose(s1[k], s2[k], rtol=_tol(f32, n), atol=0)
    self.assertEqual(shapes(g1), shapes(g2))
    gtol = 8 * float(jnp.finfo(f16).eps) if x.dtype == f16 else 4 * _tol(f32, n)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      scale = max(np.max(np.abs(b)), 1.0)
      np.testing.assert_allclose(a, b, rtol=0, atol=gtol * scale)

  def test_output_dtype_promotion(self):
    x = jnp.ones((4, 3), f16)
    for kwargs, want in (
      ({}, f32),
      (dict(dtype=f16), f16),
      (dict(param_dtype=f16), f16),
      (dict(use_scale=False, use_bias=False), f16),
    ):
      for module in (fused_norm.FusedBatchNorm, nn.BatchNorm):
        bn = module(use_running_average=True, **kwargs)
        y = bn.apply(bn.init(jax.random.key(0), x), x)
        self.assertEqual(y.dtype, want, (module, kwargs))

  def test_use_running_average_only_once(self):
    x = jnp.ones((4, 3))
    bn = fused_norm.FusedBatchNorm(use_running_average=True)
    v = bn.init(jax.random.key(0), x)
    with self.assertRaisesRegex(ValueError, "just once"):
      bn.apply(v, x, use_running_average=True)

  def test_other_axis_raises(self):
    bn = fused_norm.FusedBatchNorm(use_running_average=True, axis=1)
    with self.assertRaisesRegex(ValueError, "last axis only"):
      bn.init(jax.random.key(0), jnp.ones((4, 3, 2)))

  def test_relu_and_residual_call_options(self):
    x, scale, bias, residual = _norm_inputs()
    variables = {
      "params": {"scale": scale, "bias": bias},
      "batch_stats": {"mean": jnp.zeros(5), "var": jnp.ones(5)},
    }
    bn = fused_norm.FusedBatchNorm(use_running_average=True)
    y = bn.apply(variables, x, residual=residual, relu=True)
    plain = nn.BatchNorm(use_running_average=True).apply(variables, x)
    np.testing.assert_allclose(
      y, jnp.maximum(plain + residual, 0), rtol=_tol(f32, 1), atol=_tol(f32, 1)
    )


class UnbiasedRunningVarTest(parameterized.TestCase):
  """``unbiased_running_var`` tracks torch's n / (n - 1) batch variance."""

  @pytest.mark.invariant
  def test_matches_numpy(self):
    x, _, _, _ = _norm_inputs()
    bn = fused_norm.FusedBatchNorm(
      use_running_average=False, unbiased_running_var=True, momentum=0.6
    )
    v = bn.init(jax.random.key(0), x)
    y, upd = bn.apply(v, x, mutable=["batch_stats"])
    xn = np.asarray(x, np.float64).reshape(-1, 5)
    n = xn.shape[0]
    want = 0.6 * 1.0 + 0.4 * xn.var(0, ddof=1)
    np.testing.assert_allclose(
      upd["batch_stats"]["var"], want, rtol=_tol(f32, n)
    )
    # Normalisation still uses the biased variance.
    y_ref = nn.BatchNorm(use_running_average=False).apply(
      v, x, mutable=["batch_stats"]
    )[0]
    np.testing.assert_allclose(y, y_ref, rtol=_tol(f32, n), atol=_tol(f32, n))

  def test_axis_name_counts_devices(self):
    x, _, _, _ = _norm_inputs(shape=(4, 2, 3, 5))
    bn = fused_norm.FusedBatchNorm(
      use_running_average=False,
      unbiased_running_var=True,
      momentum=0.0,
      axis_name="batch",
    )
    v = bn.init(jax.random.key(0), x[0])
    upd = jax.vmap(
      lambda xi: bn.apply(v, xi, mutable=["batch_stats"])[1], axis_name="batch"
    )(x)
    xn = np.asarray(x, np.float64).reshape(-1, 5)
    want = xn.var(0, ddof=1)  # n = 4 devices * 2 * 3 elements per channel.
    for row in np.asarray(upd["batch_stats"]["var"]):
      np.testing.assert_allclose(row, want, rtol=_tol(f32, xn.shape[0]))


class ShardMapTest(parameterized.TestCase):
  """Gradients under ``jax.shard_map(check_vma=True)`` on 4 CPU devices."""

  @parameterized.named_parameters(
    ("relu_residual", True, True), ("plain", False, False)
  )
  def test_global_batch_gradients(self, relu, with_residual):
    devices = jax.devices()[:4]
    self.assertLen(devices, 4)
    P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
    mesh = jax.make_mesh(
      (4,),
      ("batch",),
      devices=devices,
      axis_types=(jax.sharding.AxisType.Auto,),
    )
    x, scale, bias, residual = _norm_inputs(shape=(8, 2, 3, 5))
    if not with_residual:
      residual = None
    c = jnp.asarray(np.random.default_rng(5).normal(size=x.shape), f32)

    def module_loss(module, x, scale, bias, residual, c, axis_name):
      variables = {
        "params": {"scale": scale, "bias": bias},
        "batch_stats": {"mean": jnp.zeros(5), "var": jnp.ones(5)},
      }
      if module is nn.BatchNorm:
        y = nn.BatchNorm(use_running_average=False, axis_name=axis_name).apply(
          variables, x, mutable=["batch_stats"]
        )[0]
        if residual is not None:
          y = y + residual
        y = jnp.maximum(y, 0) if relu else y
      else:
        y = fused_norm.FusedBatchNorm(
          use_running_average=False, axis_name=axis_name, relu=relu
        ).apply(variables, x, residual=residual, mutable=["batch_stats"])[0]
      return jnp.sum(y * c)

    argnums = (0, 1, 2) + ((3,) if with_residual else ())

    def sharded_grads(module):
      def local(x, scale, bias, residual, c):
        grads = jax.grad(
          lambda *a: module_loss(module, *a, c, "batch"), argnums
        )(x, scale, bias, residual)
        return grads

      res_spec = P("batch") if with_residual else None
      out_specs = (P("batch"), P(), P()) + (
        (P("batch"),) if with_residual else ()
      )
      fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P("batch"), P(), P(), res_spec, P("batch")),
        out_specs=out_specs,
        check_vma=True,
      )
      return jax.jit(fn)(x, scale, bias, residual, c)

    ours = sharded_grads(fused_norm.FusedBatchNorm)
    flax_grads = sharded_grads(nn.BatchNorm)
    whole = jax.grad(
      lambda *a: module_loss(fused_norm.FusedBatchNorm, *a, c, None), argnums
    )(x, scale, bias, residual)
    n = x.size // 5
    for a, b, w in zip(ours, flax_grads, whole):
      scale_ = max(float(np.max(np.abs(w))), 1.0)
      np.testing.assert_allclose(a, w, rtol=0, atol=_tol(f32, n) * scale_)
      np.testing.assert_allclose(a, b, rtol=0, atol=_tol(f32, n) * scale_)


class PrecisionTest(parameterized.TestCase):
  def test_fp16_eval_computes_in_float32(self):
    x, scale, bias, _ = _norm_inputs(f16)
    scale, bias = scale.astype(f32), bias.astype(f32)
    stats = {"mean": jnp.full((5,), 0.3), "var": jnp.full((5,), 2.0)}
    bn = fused_norm.FusedBatchNorm(use_running_average=True)
    y = bn.apply(
      {"params": {"scale": scale, "bias": bias}, "batch_stats": stats}, x
    )
    ref = (np.asarray(x, np.float64) - 0.3) / np.sqrt(2.0 + 1e-5) * np.asarray(
      scale, np.float64
    ) + np.asarray(bias, np.float64)
    self.assertEqual(y.dtype, f32)
    np.testing.assert_allclose(
      y, ref, rtol=0, atol=_tol(f32, 4) * np.max(np.abs(ref))
    )
