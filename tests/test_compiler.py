"""Tests for jaxmp.cpu_compiler_options."""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp._src.nn import compiler


def test_other_platforms_get_no_options():
  for backend in ("gpu", "cuda", "rocm", "tpu"):
    assert jaxmp.cpu_compiler_options(backend) == {}


def test_cpu_gets_ynn_option_and_a_fresh_dict():
  options = jaxmp.cpu_compiler_options("cpu")
  assert set(options) == {"xla_cpu_experimental_ynn_fusion_type"}
  # YNNPACK keeps dots and reductions; convolutions go back to XLA's own.
  kinds = options["xla_cpu_experimental_ynn_fusion_type"].split(",")
  assert "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION" not in kinds
  assert "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT" in kinds
  options.clear()
  assert jaxmp.cpu_compiler_options("cpu")
  assert jaxmp.cpu_compiler_options() == jaxmp.cpu_compiler_options("cpu")


def test_jaxlib_without_the_option_gets_none(monkeypatch):
  monkeypatch.setattr(
    compiler,
    "_CPU_OPTIONS",
    (("xla_cpu_experimental_ynn_fusion_type", "LIBRARY_FUSION_TYPE_BOGUS"),),
  )
  compiler._accepted_cpu_options.cache_clear()
  try:
    assert jaxmp.cpu_compiler_options("cpu") == {}
  finally:
    monkeypatch.undo()
    compiler._accepted_cpu_options.cache_clear()
  assert jaxmp.cpu_compiler_options("cpu")


@pytest.mark.parametrize("stride", [1, 2])
def test_convolution_and_gradients_agree_with_default_compile(stride):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, 9, 9, 8)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, 3, 8, 16)) * 0.1, jnp.float32)
  conv = lambda x, w: lax.conv_general_dilated(
    x,
    w,
    (stride, stride),
    ((1, 1), (1, 1)),
    dimension_numbers=("NHWC", "HWIO", "NHWC"),
  )

  def f(x, w):
    y, vjp = jax.vjp(conv, x, w)
    return (y, *vjp(jnp.cos(y)))

  ours = jax.jit(f, compiler_options=jaxmp.cpu_compiler_options())(x, w)
  ref = jax.jit(f)(x, w)

  # Same sums in another order: a few ulps of the sum of |products|
  # (|cos| <= 1 bounds the output gradient).
  def f_abs(x, w):
    y, vjp = jax.vjp(conv, jnp.abs(x), jnp.abs(w))
    return (y, *vjp(jnp.ones_like(y)))

  mass = jax.jit(f_abs)(x, w)
  eps = float(jnp.finfo(jnp.float32).eps)
  for a, b, m in zip(ours, ref, mass):
    err = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    assert np.all(err <= 16 * eps * np.asarray(m, np.float64) + 1e-30)
