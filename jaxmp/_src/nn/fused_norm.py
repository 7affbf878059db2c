"""BatchNorm (+ residual add, + ReLU) that saves only its half-precision input.

Flax's ``nn.BatchNorm`` followed by ``nn.relu`` keeps, for the backward pass,
float32 intermediates of the normalisation and a boolean ReLU mask next to the
float16 activations: in float16 a ResNet stores about 0.77x the bytes of its
float32 version instead of 0.5x. :func:`fused_batch_norm` is a
``jax.custom_vjp`` whose residuals are only

* the input ``x`` in its own (compute) dtype,
* per-channel float32 vectors: batch mean, ``rsqrt(var + eps)``, scale, bias,
* for the residual-add variant, the output ``y`` (which the next convolution
  saves anyway, so it costs nothing extra), whose sign is the ReLU mask.

The backward pass recomputes ``x_hat`` and the ReLU mask from these and
applies the standard train-mode BatchNorm gradient in float32::

  g      = dy * relu_mask
  dbias  = sum(g)
  dscale = sum(g * x_hat)
  dx     = scale * rstd * (g - mean(g) - x_hat * mean(g * x_hat))
  dres   = g

where sums and means run over every axis but the last (``mean`` is
``pmean``-ed over ``axis_name`` when set, as the forward statistics are).

:class:`FusedBatchNorm` (public as ``jaxmp.nn.BatchNorm``) wraps it as a
Flax module with the same arguments, parameters (``scale``, ``bias``),
``batch_stats`` (``mean``, ``var``) and output dtype as
``flax.linen.BatchNorm``, so the two are interchangeable.

Under :func:`jaxmp.autocast`, the train-mode ``custom_vjp`` is a
normalisation rule (its function name holds ``NORMALIZATION_MARK``): its
output takes the dtype of its input (half after a half convolution) while its
statistics stay float32, as torch's ``batch_norm`` on cudnn does.
"""

import dataclasses
import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import canonicalize_dtype

from jaxmp._src.autocast.rules import NORMALIZATION_MARK
from jaxmp._src import vma as vma_lib

Dtype = Any
Initializer = Callable[..., jax.Array]


def _stat_dtype(*dtypes: Dtype) -> Dtype:
  """Dtype of statistics and intermediates: at least float32."""
  return functools.reduce(jnp.promote_types, dtypes, jnp.float32)


def _moments(
  xf: jax.Array, axis_name: Optional[str]
) -> tuple[jax.Array, jax.Array]:
  """Per-channel mean and biased variance, as ``nn.BatchNorm`` computes them.

  Uses ``Var = E[x^2] - E[x]^2`` clipped at zero (flax's fast variance) with a
  single ``pmean`` of both moments when ``axis_name`` is set.
  """
  axes = tuple(range(xf.ndim - 1))
  mean = jnp.mean(xf, axes)
  mean_sq = jnp.mean(jnp.square(xf), axes)
  if axis_name is not None:
    mean, mean_sq = jax.lax.pmean(jnp.stack([mean, mean_sq]), axis_name)
  return mean, jnp.maximum(0.0, mean_sq - jnp.square(mean))


def _pre_activation(xf, mean, rstd, scale, bias, residual):
  """``(x - mean) * rstd * scale + bias (+ residual)`` in ``xf``'s dtype."""
  y = (xf - mean) * (rstd * scale.astype(xf.dtype)) + bias.astype(xf.dtype)
  if residual is not None:
    y = y + residual.astype(xf.dtype)
  return y


@dataclasses.dataclass(frozen=True)
class _Static:
  """The static (hashable, non-differentiable) arguments of the fused op.

  Attributes:
    epsilon: added to the variance.
    relu: whether a ReLU follows.
    axis_name: mapped axis of the statistics, or ``None``.
    dtype: the output dtype.
    res_dtype: the residual's dtype, ``None`` without a residual.
    vmas: the varying mesh axes of ``(x, scale, bias, residual)``.
  """

  epsilon: float
  relu: bool
  axis_name: Optional[str]
  dtype: Any
  res_dtype: Any
  vmas: tuple[frozenset, ...]


def _fused_train(x, scale, bias, residual, static: _Static):
  return _fused_train_fwd(x, scale, bias, residual, static)[0]


def _fused_train_fwd(x, scale, bias, residual, static: _Static):
  epsilon, relu, axis_name, dtype = (
    static.epsilon,
    static.relu,
    static.axis_name,
    static.dtype,
  )
  sdt = _stat_dtype(x.dtype, scale.dtype, bias.dtype)
  xf = x.astype(sdt)
  mean, var = _moments(xf, axis_name)
  rstd = jax.lax.rsqrt(var + epsilon)
  y = _pre_activation(xf, mean, rstd, scale, bias, residual)
  if relu:
    y = jnp.maximum(y, 0)
  y = y.astype(dtype)
  # With a residual the pre-activation cannot be recomputed from x alone; the
  # output's sign gives the ReLU mask instead (and the output is the next
  # layer's input, which is saved anyway).
  saved_y = y if (relu and residual is not None) else None
  saved = (x, mean, rstd, scale, bias, saved_y)
  return (y, mean, var), saved


def _fused_train_bwd(static: _Static, saved, cotangents):
  relu, axis_name, res_dtype, vmas = (
    static.relu,
    static.axis_name,
    static.res_dtype,
    static.vmas,
  )
  x, mean, rstd, scale, bias, saved_y = saved
  dy = cotangents[0]  # The returned statistics are stop_gradient-ed.
  sdt = mean.dtype
  xf = x.astype(sdt)
  x_hat = (xf - mean) * rstd
  g = dy.astype(sdt)
  if relu:
    if saved_y is not None:
      mask = saved_y > 0
    else:
      mask = _pre_activation(xf, mean, rstd, scale, bias, None) > 0
    g = jnp.where(mask, g, 0)
  axes = tuple(range(x.ndim - 1))
  dbias = jnp.sum(g, axes)
  dscale = jnp.sum(g * x_hat, axes)
  n = x.size // x.shape[-1]
  mean_g, mean_gx = dbias / n, dscale / n
  if axis_name is not None:
    mean_g, mean_gx = jax.lax.pmean(jnp.stack([mean_g, mean_gx]), axis_name)
  dx = (rstd * scale.astype(sdt)) * (g - mean_g - x_hat * mean_gx)
  x_vma, scale_vma, bias_vma, res_vma = vmas
  dres = (
    None if res_dtype is None else vma_lib.match(g.astype(res_dtype), res_vma)
  )
  return (
    vma_lib.match(dx.astype(x.dtype), x_vma),
    vma_lib.match(dscale.astype(scale.dtype), scale_vma),
    vma_lib.match(dbias.astype(bias.dtype), bias_vma),
    dres,
  )


# Under jaxmp.autocast, a custom_vjp named with NORMALIZATION_MARK returns its
# activation input's dtype (half after a half convolution; the statistics
# still in fp32), as torch's batch_norm on cudnn does.
_fused_train.__name__ = _fused_train.__qualname__ = (
  f"{NORMALIZATION_MARK}_batch_norm"
)
_fused_train = jax.custom_vjp(_fused_train, nondiff_argnums=(4,))
_fused_train.defvjp(_fused_train_fwd, _fused_train_bwd)


def fused_batch_norm(
  x: jax.Array,
  scale: jax.Array,
  bias: jax.Array,
  residual: Optional[jax.Array] = None,
  *,
  epsilon: float = 1e-5,
  relu: bool = False,
  axis_name: Optional[str] = None,
  dtype: Optional[Dtype] = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Train-mode BatchNorm, optional residual add and ReLU, with a lean VJP.

  Computes ``relu(batch_norm(x) * scale + bias + residual)`` over all axes but
  the last, with statistics in (at least) float32, and saves only ``x``,
  per-channel vectors and (with a residual) the output for the backward pass.

  Args:
    x: Input, channels last, e.g. float16 ``[N, H, W, C]``.
    scale: ``[C]`` scale (gamma), typically float32.
    bias: ``[C]`` bias (beta), typically float32.
    residual: Optional tensor of the output's shape added before the ReLU.
    epsilon: Added to the variance.
    relu: Whether to apply a ReLU.
    axis_name: Optional mapped axis over which statistics (and the matching
      terms of the gradient) are averaged with ``jax.lax.pmean``.
    dtype: Output dtype; defaults to ``x.dtype``.

  Returns:
    ``(y, mean, var)``: the output in ``dtype`` and the batch mean and biased
    variance (float32, not differentiable) for running averages.

  >>> x = jnp.arange(8.0).reshape(4, 2)
  >>> y, mean, var = fused_batch_norm(x, jnp.ones(2), jnp.zeros(2), relu=True)
  >>> mean
  Array([3., 4.], dtype=float32)
  """
  dtype = jnp.dtype(x.dtype if dtype is None else dtype)
  res_dtype = None if residual is None else jnp.dtype(residual.dtype)
  # The primals' varying mesh axes (static), so that the backward pass can
  # return cotangents of the same types under ``shard_map``.
  vmas = tuple(
    frozenset() if a is None else vma_lib.varying(a)
    for a in (x, scale, bias, residual)
  )
  static = _Static(epsilon, relu, axis_name, dtype, res_dtype, vmas)
  y, mean, var = _fused_train(x, scale, bias, residual, static)
  return y, jax.lax.stop_gradient(mean), jax.lax.stop_gradient(var)


def batch_norm_inference(
  x: jax.Array,
  scale: jax.Array,
  bias: jax.Array,
  mean: jax.Array,
  var: jax.Array,
  residual: Optional[jax.Array] = None,
  *,
  epsilon: float = 1e-5,
  relu: bool = False,
  dtype: Optional[Dtype] = None,
) -> jax.Array:
  """Eval-mode counterpart of :func:`fused_batch_norm` (running statistics).

  Args:
    x: Input, channels last.
    scale: ``[C]`` scale.
    bias: ``[C]`` bias.
    mean: ``[C]`` running mean.
    var: ``[C]`` running variance.
    residual: Optional tensor added before the ReLU.
    epsilon: Added to the variance.
    relu: Whether to apply a ReLU.
    dtype: Output dtype; defaults to ``x.dtype``.

  Returns:
    The normalised output in ``dtype``.
  """
  dtype = x.dtype if dtype is None else dtype
  sdt = _stat_dtype(x.dtype, scale.dtype, bias.dtype, mean.dtype)
  rstd = jax.lax.rsqrt(var.astype(sdt) + epsilon)
  y = _pre_activation(
    x.astype(sdt), mean.astype(sdt), rstd, scale, bias, residual
  )
  if relu:
    y = jnp.maximum(y, 0)
  return y.astype(dtype)


class FusedBatchNorm(nn.Module):
  """Drop-in ``flax.linen.BatchNorm`` with fused residual add and ReLU.

  Normalises over every axis but the last (``axis=-1``, channels last) with
  the lean backward pass of :func:`fused_batch_norm`. Variables, their
  shapes and dtypes, the running-average update and the output dtype are
  those of ``flax.linen.BatchNorm``: params ``scale`` and ``bias`` in
  ``param_dtype``; ``batch_stats`` ``mean`` and ``var`` in float32 (an update
  from a float64 input under x64 makes them float64), updated
  as ``momentum * old + (1 - momentum) * new`` (not during ``init``); output
  in ``dtype``, by default the promoted dtype of the input and the used
  parameters (float16 input with float32 parameters gives float32). Under
  :func:`jaxmp.autocast` the train-mode output instead takes the dtype of
  ``x`` (and ``residual``), as torch's ``batch_norm`` does under autocast.

  Attributes:
    use_running_average: If True, normalise with the running statistics;
      may instead be given at call time.
    axis: The feature axis; only the last axis (``-1``) is supported.
    momentum: Decay of the running averages; flax's default 0.99 (torch's
      ``momentum=0.1`` is ``0.9`` here).
    epsilon: Added to the variance.
    dtype: Output dtype; None promotes the input with the parameters.
    param_dtype: Dtype of ``scale`` and ``bias``.
    use_bias: Whether to add the learned ``bias``.
    use_scale: Whether to multiply by the learned ``scale``.
    bias_init: Initialiser of ``bias``.
    scale_init: Initialiser of ``scale``.
    axis_name: Optional mapped axis (``vmap``, ``shard_map``, ``pmap``) to
      average statistics over. Keep None for plain ``jit``.
    relu: Whether to apply a ReLU after the (optional) residual add; may be
      overridden at call time.
    unbiased_running_var: If True, ``batch_stats['var']`` tracks the
      unbiased batch variance ``n / (n - 1) * var`` (``n`` elements per
      channel, over all devices of ``axis_name``), as torch's
      ``BatchNorm2d`` does; training still normalises with the biased one.

  >>> import jax, jax.numpy as jnp
  >>> from jaxmp import nn as jnn
  >>> bn = jnn.BatchNorm(use_running_average=False)
  >>> x = jnp.ones((4, 2, 2, 3), jnp.float16)
  >>> variables = bn.init(jax.random.key(0), x)
  >>> y, updates = bn.apply(variables, x, residual=x, relu=True,
  ...                       mutable=['batch_stats'])
  >>> y.dtype, y.shape
  (dtype('float32'), (4, 2, 2, 3))
  """

  use_running_average: Optional[bool] = None
  axis: int = -1
  momentum: float = 0.99
  epsilon: float = 1e-5
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: Initializer = nn.initializers.zeros
  scale_init: Initializer = nn.initializers.ones
  axis_name: Optional[str] = None
  relu: bool = False
  unbiased_running_var: bool = False

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    use_running_average: Optional[bool] = None,
    *,
    residual: Optional[jax.Array] = None,
    relu: Optional[bool] = None,
  ) -> jax.Array:
    """Normalises ``x``, adds ``residual`` if given, applies ReLU if set.

    Args:
      x: Input, channels last.
      use_running_average: Overrides the attribute of the same name.
      residual: Optional tensor of the output's shape added before the ReLU.
      relu: Overrides the ``relu`` attribute.

    Returns:
      The output, in ``dtype`` (default: promoted as ``nn.BatchNorm`` does).
    """
    use_running_average = nn.merge_param(
      "use_running_average", self.use_running_average, use_running_average
    )
    relu = self.relu if relu is None else relu
    if self.axis not in (-1, x.ndim - 1):
      raise ValueError(
        f"jaxmp.nn.BatchNorm normalises the last axis only (axis=-1); got "
        f"axis={self.axis} for an input of rank {x.ndim}."
      )
    features = (x.shape[-1],)
    ra_mean = self.variable(
      "batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), features
    )
    ra_var = self.variable(
      "batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), features
    )
    promote = [x]
    if self.use_scale:
      scale = self.param("scale", self.scale_init, features, self.param_dtype)
      promote.append(scale)
    else:
      scale = jnp.ones(features, jnp.float32)
    if self.use_bias:
      bias = self.param("bias", self.bias_init, features, self.param_dtype)
      promote.append(bias)
    else:
      bias = jnp.zeros(features, jnp.float32)
    dtype = canonicalize_dtype(*promote, dtype=self.dtype)

    if use_running_average:
      return batch_norm_inference(
        x,
        scale,
        bias,
        ra_mean.value,
        ra_var.value,
        residual,
        epsilon=self.epsilon,
        relu=relu,
        dtype=dtype,
      )
    initializing = self.is_initializing()
    # Like nn.BatchNorm: no collective during init (no axis bound then).
    axis_name = None if initializing else self.axis_name
    y, mean, var = fused_batch_norm(
      x,
      scale,
      bias,
      residual,
      epsilon=self.epsilon,
      relu=relu,
      axis_name=axis_name,
      dtype=dtype,
    )
    if not initializing:
      if self.unbiased_running_var:
        var = var * unbiased_factor(x, axis_name)
      m = self.momentum
      # As nn.BatchNorm: float32 statistics stay float32 (``mean`` is at
      # least float32), a float64 batch (x64) updates them in float64.
      ra_mean.value = m * ra_mean.value + (1 - m) * mean
      ra_var.value = m * ra_var.value + (1 - m) * var
    return y


def unbiased_factor(x: jax.Array, axis_name: Optional[str]) -> jax.Array:
  """``n / (n - 1)`` for ``n`` elements per channel (last axis) of ``x``.

  Args:
    x: Input, channels last.
    axis_name: Optional mapped axis whose size multiplies ``n``.

  Returns:
    The factor that turns the biased variance into the unbiased one, in
    float32 (float64 for a float64 ``x``).

  >>> float(unbiased_factor(jnp.zeros((2, 3)), None))
  2.0
  """
  n = jnp.asarray(x.size // x.shape[-1], _stat_dtype(x.dtype))
  if axis_name is not None:
    n = n * jax.lax.psum(1, axis_name)
  return n / jnp.maximum(n - 1, 1)
