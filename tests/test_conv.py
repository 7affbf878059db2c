"""Tests for jaxmp.nn.conv_general_dilated (per-shape CPU lowerings)."""

import functools
import re

from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp

from jaxmp._src.nn import conv
from _products import product_dtypes

f16, f32 = jnp.float16, jnp.float32


class TapKernelGradTest(parameterized.TestCase):
  """jaxmp's CPU conv kernel gradient equals XLA's, and the rest is lax's."""

  @parameterized.named_parameters(
    # (batch, size, in, out, kernel, stride, padding, dtype)
    ("3x3_s1", 4, 9, 3, 8, 3, 1, 1, f32),
    ("3x3_s2", 4, 8, 5, 6, 3, 2, 1, f32),
    ("1x1_s2_projection", 2, 8, 4, 6, 1, 2, 0, f32),
    ("7x7_s2_imagenet_stem", 2, 15, 3, 4, 7, 2, 3, f32),
    ("fp16", 4, 8, 4, 4, 3, 1, 1, f16),
    ("grouped_products", 64, 8, 2, 2, 3, 1, 1, f32),
    # At most 4 output pixels: one im2col product on CPU.
    ("im2col_2x2_s1", 4, 2, 6, 5, 3, 1, 1, f32),
    ("im2col_1x1_map", 4, 1, 6, 5, 3, 1, 1, f32),
    ("im2col_4x4_s2", 3, 4, 5, 7, 3, 2, 1, f32),
    ("im2col_1x1_kernel_s2", 2, 3, 4, 6, 1, 2, 0, f32),
    ("im2col_fp16", 4, 2, 6, 5, 3, 1, 1, f16),
  )
  def test_output_and_gradients_match_lax(
    self, n, size, cin, cout, k, s, pad, dtype
  ):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, size, size, cin)), dtype)
    w = jnp.asarray(rng.standard_normal((k, k, cin, cout)) * 0.1, dtype)
    args = ((s, s), ((pad, pad), (pad, pad)))
    dn = ("NHWC", "HWIO", "NHWC")

    def loss(fn, x, w):
      y = fn(x, w, *args, dimension_numbers=dn).astype(f32)
      return jnp.sum(jnp.sin(y))

    def outputs(fn, x, w):
      grads = jax.grad(functools.partial(loss, fn), (0, 1))(x, w)
      return (fn(x, w, *args, dimension_numbers=dn), *grads)

    conv_at = lambda a, b: jax.lax.conv_general_dilated(
      a, b, *args, dimension_numbers=dn
    )

    def masses(x, w):
      # Each gradient element is a sum of products; both sides may order the
      # sum differently, so bound the difference by a few ulps of the sum of
      # the products' magnitudes (the same gradient of |x|, |w| and |dy|).
      abs_dy = jnp.abs(jnp.cos(conv_at(x, w).astype(f32))).astype(dtype)
      return (
        conv_at(jnp.abs(x), jnp.abs(w)),
        jax.vjp(lambda a: conv_at(a, jnp.abs(w)), x)[1](abs_dy)[0],
        jax.vjp(lambda b: conv_at(jnp.abs(x), b), w)[1](abs_dy)[0],
      )

    # One program (one compilation) for ours, lax's and the bounds.
    ours, ref, mass = jax.jit(
      lambda x, w: (
        outputs(conv.conv_general_dilated, x, w),
        outputs(jax.lax.conv_general_dilated, x, w),
        masses(x, w),
      )
    )(x, w)
    eps = float(jnp.finfo(dtype).eps)
    for a, b, m in zip(ours, ref, mass):
      self.assertEqual(a.dtype, b.dtype)
      err = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
      bound = 16 * eps * np.asarray(m, np.float64) + 1e-30
      self.assertTrue(
        np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"
      )

  def test_uncovered_convolutions_are_lax(self):
    x = jnp.ones((2, 6, 6, 4))
    w = jnp.ones((3, 3, 2, 4))
    got = conv.conv_general_dilated(
      x,
      w,
      (1, 1),
      "SAME",
      rhs_dilation=(2, 2),
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
      feature_group_count=2,
    )
    want = jax.lax.conv_general_dilated(
      x,
      w,
      (1, 1),
      "SAME",
      rhs_dilation=(2, 2),
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
      feature_group_count=2,
    )
    np.testing.assert_array_equal(got, want)


def _conv_hlo(size: int, platform: str, kernel: int = 3) -> str:
  """StableHLO of the conv's value and gradients, exported for a platform."""
  x = jax.ShapeDtypeStruct((2, size, size, 8), f32)
  w = jax.ShapeDtypeStruct((kernel, kernel, 8, 8), f32)
  pad = kernel // 2

  def f(x, w):
    fn = lambda x, w: conv.conv_general_dilated(
      x,
      w,
      (1, 1),
      ((pad, pad), (pad, pad)),
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    y, vjp = jax.vjp(fn, x, w)
    return y, *vjp(y)

  exported = jax.export.export(jax.jit(f), platforms=[platform])(x, w)
  return exported.mlir_module()


def test_cpu_rewrites_stay_off_other_platforms():
  # CPU: a 2x2 map is one im2col product, no convolution at all; a larger
  # map keeps XLA's three convolutions for a 3x3 kernel, and for a 1x1
  # kernel its forward and input gradient, the kernel gradient a product.
  assert "convolution" not in _conv_hlo(2, "cpu")
  assert _conv_hlo(8, "cpu").count("stablehlo.convolution") == 3
  assert _conv_hlo(8, "cpu", kernel=1).count("stablehlo.convolution") == 2
  # GPU: lax's convolutions only (forward, input and kernel gradient).
  for size, kernel in ((2, 3), (8, 3), (8, 1)):
    hlo = _conv_hlo(size, "cuda", kernel)
    assert hlo.count("stablehlo.convolution") == 3


@pytest.mark.parametrize("k, s", [(3, 1), (3, 2), (7, 2), (1, 2)])
def test_gradients_in_a_loop_body_are_convolutions_xla_cpu_runs_fast(k, s):
  """In a ``fori_loop`` body every convolution has XLA:CPU's fast layout.

  XLA:CPU runs a convolution on its fast (Eigen) kernel only in the layout
  ``b01f_01io->b01f``. It rewrites ``lax``'s gradients into it in a
  program's entry computation, but not inside a ``while`` body (k steps per
  call, ``lax.scan``), where they ran 10-80x slower; jaxmp writes them in
  that layout itself.
  """
  # Maps larger than the kernel (XLA swaps a convolution's operands where
  # the kernel is the larger, into another layout, loop or not).
  x = jnp.ones((2, 16, 16, 3), f32)
  w = jnp.ones((k, k, 3, 5), f32)
  pad = ((k // 2, k // 2),) * 2

  def step(i, xw):
    loss = lambda x, w: jnp.sum(
      jnp.sin(
        conv.conv_general_dilated(
          x, w, (s, s), pad, dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
      )
    )
    return jax.tree.map(
      lambda v, g: v - 0.1 * g, xw, jax.grad(loss, (0, 1))(*xw)
    )

  looped = jax.jit(lambda xw: jax.lax.fori_loop(0, 2, step, xw))
  compiled = (
    looped.lower((x, w)).compile(jaxmp.cpu_compiler_options()).as_text()
  )
  labels = re.findall(r"convolution\(.*?dim_labels=([\w>-]+)", compiled)
  # The forward and the input gradient; 1x1's kernel gradient is a product.
  assert len(labels) == (2 if k == 1 else 3), compiled
  assert set(labels) == {"b01f_01io->b01f"}, labels


@pytest.mark.parametrize(
  "k, n, size, cin, cout",
  [
    # (kernel, batch, size, in, out): each forward output sums k*k*in
    # products, each input-gradient element k*k*out, each kernel-gradient
    # element batch*size*size (4096, or 2304 for the 2x2 map: im2col).
    (3, 64, 8, 128, 32),
    (1, 64, 8, 128, 32),
    (3, 576, 2, 64, 32),
  ],
)
@pytest.mark.parametrize("jaxmp_options", [False, True])
def test_half_convolutions_accumulate_in_float32(
  k, n, size, cin, cout, jaxmp_options
):
  """fp16 in, fp16 out, but each long sum carried in fp32 (as cuDNN does).

  On positive operands, a sum of ``m`` products carried in fp32 and rounded
  once to fp16 is within ``u16 + m * u32`` of float64, relative to the
  value (every partial sum is below the total). Carried in fp16, it drifts
  by ``log2(m)`` to ``m`` units of ``u16``: over the thousands of products
  of a ResNet's kernel gradient, far outside. Checked for `lax`'s
  convolution, which XLA:CPU computes (with its default convolutions, and
  with its own under `jaxmp.cpu_compiler_options`), and for `jaxmp.nn`'s CPU
  lowerings, forward and both gradients, against float64 on the same fp16
  values.
  """
  rng = np.random.default_rng(k * 1000 + size)
  x = rng.uniform(0.5, 1.0, (n, size, size, cin)).astype(np.float16)
  w = rng.uniform(0.5, 1.0, (k, k, cin, cout)).astype(np.float16)
  dy = rng.uniform(0.5, 1.0, (n, size, size, cout)).astype(np.float16)
  dn = ("NHWC", "HWIO", "NHWC")
  pad = ((k // 2, k // 2),) * 2

  def outputs(fn, x, w, dy):
    y, vjp = jax.vjp(
      lambda a, b: fn(a, b, (1, 1), pad, dimension_numbers=dn), x, w
    )
    return (y, *vjp(dy))

  got = jax.jit(
    lambda x, w, dy: [
      outputs(f, x, w, dy)
      for f in (jax.lax.conv_general_dilated, conv.conv_general_dilated)
    ],
    # XLA's default CPU convolutions (YNNPACK's), or its own (Eigen's).
    compiler_options=(jaxmp.cpu_compiler_options() or None)
    if jaxmp_options
    else None,
  )(x, w, dy)
  with jax.enable_x64(True):
    want = jax.jit(functools.partial(outputs, jax.lax.conv_general_dilated))(
      *(jnp.asarray(a, jnp.float64) for a in (x, w, dy))
    )
    want = [np.asarray(a) for a in want]
  # Terms per sum: forward, input gradient, kernel gradient (zero padding
  # drops some at the border: fewer terms, a smaller bound's share).
  terms = (k * k * cin, k * k * cout, n * size * size)
  u16, u32 = 2.0**-11, 2.0**-24
  for name, ours in zip(("lax", "jaxmp.nn"), got):
    for what, a, b, m in zip(("y", "dx", "dw"), ours, want, terms):
      assert a.dtype == jnp.float16, (name, what)
      err = np.max(np.abs(np.asarray(a, np.float64) - b) / b)
      assert err <= u16 + m * u32, (name, what, err / u16)


@pytest.mark.devices(4)
@pytest.mark.parametrize("autocast", [False, True])
def test_gradients_under_shard_map_are_typed_as_lax(autocast):
  """A replicated kernel's gradient inside shard_map: summed over the batch.

  jaxmp's CPU gradient rule computes it from the device's own rows, as lax
  does; it must come back typed (and summed) as lax's own transpose gives it,
  or the platform switch of its two rules fails shard_map's type checks. Under
  autocast the kernel, replicated and marked varying before the product, is
  cast to half at the rule's boundary as on one device.
  """
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh(
    (4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8, 5, 5, 3)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 3, 3, 3)) / 9, jnp.float32)

  def loss(conv_fn, w, x):
    # Twice: under autocast the second one's input is the first's half
    # output, its kernel still the fp32 (replicated) param.
    for _ in range(2):
      x = conv_fn(
        x,
        w,
        (1, 1),
        ((1, 1), (1, 1)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
      )
    return jnp.sum(jnp.square(x.astype(jnp.float32)))

  def grad_fn(conv_fn):
    f = functools.partial(loss, conv_fn)
    if autocast:
      f = jaxmp.autocast(f)
    return jax.shard_map(
      jax.grad(f), mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
    )

  def grad_of(conv_fn):
    return jax.jit(grad_fn(conv_fn))(w, x)

  if autocast:  # Every convolution of jaxmp's rule, forward and backward.
    found = product_dtypes(
      jax.make_jaxpr(grad_fn(conv.conv_general_dilated))(w, x)
    )
    assert found and all(ins == ("float16",) * 2 for _, ins, _ in found)
  got = grad_of(conv.conv_general_dilated)
  want = grad_of(jax.lax.conv_general_dilated)
  # Sums of products in two orders: at |w|, |x| every term is positive, so
  # lax's fp32 gradient there is the sum of the terms' magnitudes. fp32:
  # within 4 n roundings of it (n = 8 * 5 * 5 a conv); under autocast each
  # side also rounds its half outputs: a few fp16 ulps of it.
  magnitude = jax.jit(
    jax.shard_map(
      jax.grad(functools.partial(loss, jax.lax.conv_general_dilated)),
      mesh=mesh,
      in_specs=(P(), P("data")),
      out_specs=P(),
    )
  )(jnp.abs(w), jnp.abs(x))
  tol = 4 * 8 * 5 * 5 * 2.0**-24 * magnitude
  if autocast:
    tol = tol + 8 * 2.0**-11 * magnitude
  assert got.dtype == want.dtype == jnp.float32
  assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= tol)
