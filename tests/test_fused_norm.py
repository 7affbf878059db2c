"""Tests for jaxmp.nn.BatchNorm and its fused train-mode VJP (CPU)."""

import functools

from absl.testing import parameterized
import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest

from jaxmp._src import fused_norm

f16, f32 = jnp.float16, jnp.float32


def _reference_norm_act(x, scale, bias, residual, relu):
  """nn.BatchNorm (train) + add + relu, with the same variables."""
  y, updates = nn.BatchNorm(use_running_average=False, momentum=0.9).apply(
      {'params': {'scale': scale, 'bias': bias},
       'batch_stats': {'mean': jnp.zeros_like(scale),
                       'var': jnp.ones_like(scale)}},
      x, mutable=['batch_stats'],
  )
  if residual is not None:
    y = y + residual
  return (nn.relu(y) if relu else y), updates['batch_stats']


def _fused_norm_act(x, scale, bias, residual, relu, axis_name=None):
  return fused_norm.FusedBatchNorm(
      use_running_average=False, relu=relu, axis_name=axis_name
  ).apply(
      {'params': {'scale': scale, 'bias': bias},
       'batch_stats': {'mean': jnp.zeros_like(scale),
                       'var': jnp.ones_like(scale)}},
      x, residual=residual, mutable=['batch_stats'],
  )[0]


def _norm_inputs(dtype=f32, shape=(4, 3, 3, 5)):
  rng = np.random.default_rng(2)
  x = 2 * rng.normal(size=shape) + 0.5
  residual = rng.normal(size=shape)
  scale = 1 + 0.5 * rng.normal(size=shape[-1:])
  bias = 0.5 * rng.normal(size=shape[-1:])
  return tuple(jnp.asarray(a, dtype) for a in (x, scale, bias, residual))


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
          f, (x, scale, bias, residual), order=1, modes=['rev'], eps=1e-6
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

    np.testing.assert_allclose(
        _fused_norm_act(x, scale, bias, residual, relu),
        _reference_norm_act(x, scale, bias, residual, relu)[0],
        rtol=1e-5, atol=1e-5,
    )
    argnums = (0, 1, 2, 3) if with_residual else (0, 1, 2)
    g_fused = jax.grad(
        functools.partial(loss, _fused_norm_act), argnums
    )(x, scale, bias, residual)
    g_ref = jax.grad(
        functools.partial(loss, _reference_norm_act), argnums
    )(x, scale, bias, residual)
    for a, b in zip(g_fused, g_ref):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

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
        {'params': {'scale': scale, 'bias': bias},
         'batch_stats': {'mean': jnp.full(5, 1.0), 'var': jnp.full(5, 2.0)}},
        x, mutable=['batch_stats'],
    )[1]['batch_stats']
    xs = np.asarray(x).reshape(-1, 5)
    np.testing.assert_allclose(
        stats['mean'], 0.8 * 1.0 + 0.2 * xs.mean(0), rtol=1e-5
    )
    np.testing.assert_allclose(  # Biased variance, like nn.BatchNorm.
        stats['var'], 0.8 * 2.0 + 0.2 * xs.var(0), rtol=1e-5
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
      y, _ = nn.BatchNorm(
          use_running_average=False, axis_name=axis_name
      ).apply(
          {'params': {'scale': scale, 'bias': bias},
           'batch_stats': {'mean': jnp.zeros(5), 'var': jnp.ones(5)}},
          x, mutable=['batch_stats'],
      )
      return nn.relu(y + r)

    def local_loss(fn, x, r, c):
      return jnp.sum(fn(x, r, 'd') * c)

    def whole_batch_loss(x, r):
      y = fused(x.reshape(8, 3, 3, 5), r.reshape(8, 3, 3, 5), None)
      return jnp.sum(y.reshape(x.shape) * ct)

    mapped = jax.vmap(functools.partial(fused, axis_name='d'), axis_name='d')
    whole = fused(x.reshape(8, 3, 3, 5), residual.reshape(8, 3, 3, 5), None)
    np.testing.assert_allclose(
        mapped(x, residual), whole.reshape(x.shape), rtol=1e-5, atol=1e-6
    )
    expected = jax.jit(jax.grad(whole_batch_loss, (0, 1)))(x, residual)
    for fn in (fused, plain):
      grads = jax.jit(jax.vmap(
          jax.grad(functools.partial(local_loss, fn), (0, 1)), axis_name='d'
      ))(x, residual, ct)
      for a, b in zip(grads, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

if __name__ == '__main__':
  pytest.main([__file__])
