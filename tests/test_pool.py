"""Tests for jaxmp.nn.max_pool (a CPU gradient without select-and-scatter)."""

from absl.testing import parameterized
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import nn as jaxmp_nn

f16, bf16, f32 = jnp.float16, jnp.bfloat16, jnp.float32


def _value_and_grad(pool, x, dy):
  y, vjp = jax.vjp(pool, x)
  return y, vjp(dy)[0]


class MaxPoolTest(parameterized.TestCase):
  @parameterized.named_parameters(
    # (size, window, strides, padding, dtype)
    ("stem_3x3_s2_pad1", 9, (3, 3), (2, 2), ((1, 1), (1, 1)), f32),
    ("same", 7, (3, 3), (2, 2), "SAME", f32),
    ("valid", 8, (3, 3), (2, 2), "VALID", f32),
    ("asymmetric_pads", 7, (3, 2), (2, 1), ((0, 2), (1, 0)), f32),
    ("overlap_stride1", 6, (2, 2), None, "VALID", f32),
    ("no_overlap_2x2_s2", 8, (2, 2), (2, 2), "VALID", f32),
    ("fp16", 9, (3, 3), (2, 2), ((1, 1), (1, 1)), f16),
    ("bf16", 9, (3, 3), (2, 2), ((1, 1), (1, 1)), bf16),
  )
  def test_value_and_gradient_match_flax_with_ties(
    self, size, window, strides, padding, dtype
  ):
    rng = np.random.default_rng(0)
    # Values from {0, 1, 2}: most windows hold several maxima, so the
    # gradient must go to the same (first) one as flax's.
    x = jnp.asarray(rng.integers(0, 3, (3, size, size, 4)), dtype)
    flax_pool = lambda x: nn.max_pool(x, window, strides, padding)
    ours_pool = lambda x: jaxmp_nn.max_pool(x, window, strides, padding)
    out_shape = jax.eval_shape(flax_pool, x).shape
    dy = jnp.asarray(rng.standard_normal(out_shape), dtype)

    def mass_of(x, dy):
      # Each input's gradient is a sum of the dy of the windows whose first
      # maximum it is; the two sides may add them in a different order, so
      # allow a few ulps of the sum of |dy| over the windows that cover it.
      return jax.vjp(
        lambda x: nn.avg_pool(
          x, window, strides, padding, count_include_pad=True
        ),
        x.astype(f32),
      )[1](jnp.abs(dy).astype(f32))[0] * np.prod(window)

    # One program (one compilation) for flax's, ours and the bound.
    (y_ref, dx_ref), (y, dx), mass = jax.jit(
      lambda x, dy: (
        _value_and_grad(flax_pool, x, dy),
        _value_and_grad(ours_pool, x, dy),
        mass_of(x, dy),
      )
    )(x, dy)
    np.testing.assert_array_equal(y, y_ref)
    self.assertEqual(dx.dtype, dx_ref.dtype)
    eps = float(jnp.finfo(dtype).eps)
    err = np.abs(np.asarray(dx, np.float64) - np.asarray(dx_ref, np.float64))
    bound = 4 * eps * np.asarray(mass, np.float64) + 1e-30
    self.assertTrue(
      np.all(err <= bound), f"max err/bound {np.max(err / bound)}"
    )
    # A different tie rule would move whole dy values: far above the bound.
    self.assertGreater(np.sum(np.abs(np.asarray(dx_ref, np.float64))), 1.0)

  def test_gradient_has_no_select_and_scatter_on_cpu_only(self):
    x = jax.ShapeDtypeStruct((2, 9, 9, 4), f32)

    def f(x):
      pool = lambda x: jaxmp_nn.max_pool(x, (3, 3), (2, 2), ((1, 1), (1, 1)))
      y, vjp = jax.vjp(pool, x)
      return vjp(y)[0]

    def hlo(platform):
      exported = jax.export.export(jax.jit(f), platforms=[platform])(x)
      return exported.mlir_module()

    assert "stablehlo.select_and_scatter" not in hlo("cpu")
    assert "stablehlo.select_and_scatter" in hlo("cuda")

  def test_uncovered_inputs_are_flax(self):
    x = jnp.arange(2 * 8 * 3, dtype=f32).reshape(2, 8, 3)  # 1-D windows.
    np.testing.assert_array_equal(
      jaxmp_nn.max_pool(x, (3,), (2,), "SAME"),
      nn.max_pool(x, (3,), (2,), "SAME"),
    )
    xi = jnp.arange(2 * 6 * 6 * 2).reshape(2, 6, 6, 2)  # Integers.
    np.testing.assert_array_equal(
      jaxmp_nn.max_pool(xi, (2, 2), (2, 2)), nn.max_pool(xi, (2, 2), (2, 2))
    )
