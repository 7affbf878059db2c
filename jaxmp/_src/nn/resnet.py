"""ResNet (BasicBlock) in Flax linen with mixed-precision dtypes.

One module, `ResNet`, and two functions that build ResNet18:

* `resnet18`: CIFAR stem (3x3 stride-1 conv, no max-pool);
  11,173,962 params for 10 classes.
* `resnet18_torchvision`: torchvision's ImageNet stem (7x7 stride-2
  conv, BN, ReLU, 3x3 stride-2 max-pool) and initialisers; 11,689,512 params
  for 1000 classes, 11,181,642 for 10.

Precision follows Apex: ``param_dtype`` for conv/dense weights, ``dtype`` for
the computation, ``norm_dtype`` for BatchNorm parameters and statistics
(float32 keeps BatchNorm in float32 as Apex O2 does). Logits are float32
(float64 for a float64 model).
With ``fused_norm=True`` (default) each BatchNorm(+add)(+ReLU) is a
``jaxmp.nn.BatchNorm``, which saves only the
half-precision input for the backward pass; ``fused_norm=False`` uses plain
``nn.BatchNorm`` + ``nn.relu``. Both give the same variable tree.

Porting torchvision weights (``jaxmp.models.from_torchvision`` and
``to_torchvision`` do it; ``torch name -> flax path``; convs have no bias)::

  conv1.weight                 -> params/conv1/kernel
  bn1.{weight,bias}            -> params/bn1/{scale,bias}
  bn1.running_{mean,var}       -> batch_stats/bn1/{mean,var}
  layer{i}.{j}.conv{k}.weight  -> params/layer{i}_{j}/conv{k}/kernel
  layer{i}.{j}.bn{k}.*         -> .../layer{i}_{j}/bn{k}/...
  layer{i}.{j}.downsample.0.*  -> params/layer{i}_{j}/downsample_conv/kernel
  layer{i}.{j}.downsample.1.*  -> .../layer{i}_{j}/downsample_bn/...
  fc.weight, fc.bias           -> params/fc/kernel, params/fc/bias

Conv weights go from torch's ``OIHW`` to flax's ``HWIO``
(``w.transpose(2, 3, 1, 0)``) and ``fc.weight`` is transposed. torch keeps
the unbiased running variance, as this module does with
``unbiased_running_var=True`` (the default of `resnet18_torchvision`);
flax's ``nn.BatchNorm`` keeps the biased one. Padding is explicit (torch's), not
``"SAME"``, so stride-2 convs line up with torch exactly.
"""

import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmp._src.nn import conv as conv_lib
from jaxmp._src.nn import fused_norm
from jaxmp._src.nn import pool as pool_lib

Dtype = Any

# torchvision: kaiming_normal_(mode="fan_out", nonlinearity="relu"), which is
# an untruncated normal: jax's "normal" ("truncated_normal" is the
# truncated one).
_TORCH_CONV_INIT = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
# torch.nn.Linear: kaiming_uniform_(a=sqrt(5)) == U(-1/sqrt(fan_in), ...).
_TORCH_LINEAR_INIT = nn.initializers.variance_scaling(
  1.0 / 3.0, "fan_in", "uniform"
)


def _torch_linear_bias_init(fan_in: int) -> Callable[..., jax.Array]:
  """torch.nn.Linear's bias init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
  bound = 1.0 / fan_in**0.5

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


def _norm_act(
  x: jax.Array,
  residual: Optional[jax.Array],
  *,
  name: str,
  relu: bool,
  train: bool,
  fused: bool,
  dtype: Dtype,
  norm_dtype: Dtype,
  momentum: float,
  epsilon: float,
  axis_name: Optional[str],
  unbiased_running_var: bool = False,
) -> jax.Array:
  """BatchNorm named ``name`` in the current module, then add and ReLU.

  Must be called from inside a compact method; the BatchNorm module becomes a
  child of the module whose method is running.
  """
  kwargs = dict(
    use_running_average=not train,
    momentum=momentum,
    epsilon=epsilon,
    dtype=dtype,
    param_dtype=norm_dtype,
    axis_name=axis_name,
    name=name,
  )
  if fused:
    return fused_norm.FusedBatchNorm(
      relu=relu, unbiased_running_var=unbiased_running_var, **kwargs
    )(x, residual=residual)
  bn = nn.BatchNorm(**kwargs)
  y = bn(x)
  if unbiased_running_var and train and not bn.is_initializing():
    # nn.BatchNorm stored m * old + (1 - m) * var; add (1 - m) * var / (n-1)
    # to get m * old + (1 - m) * var * n / (n - 1) (torch's update).
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    axes = tuple(range(x.ndim - 1))
    mean = jnp.mean(xf, axes)
    mean_sq = jnp.mean(jnp.square(xf), axes)
    if axis_name is not None:
      mean, mean_sq = jax.lax.pmean(jnp.stack([mean, mean_sq]), axis_name)
    var = jnp.maximum(0.0, mean_sq - jnp.square(mean))
    extra = fused_norm.unbiased_factor(x, axis_name) - 1
    new = bn.get_variable("batch_stats", "var")
    bn.put_variable("batch_stats", "var", new + (1 - momentum) * extra * var)
  if residual is not None:
    y = y + residual
  return nn.relu(y) if relu else y


class BasicBlock(nn.Module):
  """torchvision's BasicBlock: two 3x3 convs, shortcut, ReLU.

  Attributes:
    features: Output channels.
    strides: Stride of the first conv and of the projection shortcut.
    conv: Conv constructor (dtype, init, no bias) shared by the network.
    norm_act: ``_norm_act`` with the network's BatchNorm settings bound.
  """

  features: int
  strides: int
  conv: Callable[..., nn.Module]
  norm_act: Callable[..., jax.Array]

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    """Applies the block to NHWC ``x``."""
    norm_act = functools.partial(self.norm_act, train=train)
    s = (self.strides, self.strides)
    y = self.conv(self.features, (3, 3), s, padding=1, name="conv1")(x)
    y = norm_act(y, None, name="bn1", relu=True)
    y = self.conv(self.features, (3, 3), padding=1, name="conv2")(y)
    shortcut = x
    if self.strides != 1 or x.shape[-1] != self.features:
      shortcut = self.conv(
        self.features, (1, 1), s, padding=0, name="downsample_conv"
      )(x)
      shortcut = norm_act(shortcut, None, name="downsample_bn", relu=False)
    return norm_act(y, shortcut, name="bn2", relu=True)


class ResNet(nn.Module):
  """ResNet with BasicBlocks (ResNet18/34), NHWC input, float32+ logits.

  Attributes:
    stage_sizes: Blocks per stage, e.g. ``(2, 2, 2, 2)`` for ResNet18.
    num_classes: Number of output classes.
    num_filters: Channels of the first stage (doubled at each stage).
    stem: ``"cifar"`` (3x3 stride-1 conv, no max-pool) or ``"imagenet"``
      (torchvision: 7x7 stride-2 conv, BN, ReLU, 3x3 stride-2 max-pool).
    dtype: Compute dtype of convs, dense and activations.
    param_dtype: Dtype of conv and dense parameters.
    norm_dtype: Dtype of BatchNorm parameters; statistics and intermediates
      are at least float32.
    bn_momentum: Running-average decay (flax convention; torch's 0.1 is 0.9).
    bn_epsilon: BatchNorm epsilon.
    axis_name: Mapped axis for cross-device BatchNorm; None for plain ``jit``.
    init_scheme: ``"flax"`` (flax defaults) or ``"torchvision"``
      initialisers. (Not ``init``: that would shadow ``Module.init``.)
    fused_norm: Use ``jaxmp.nn.BatchNorm`` (lean backward residuals) instead
      of ``nn.BatchNorm`` + ``nn.relu``.
    unbiased_running_var: Track torch's unbiased running variance
      (``n / (n - 1)`` times the batch variance) in ``batch_stats['var']``;
      the default of `resnet18_torchvision`.
    cpu_convs: Use ``jaxmp.nn.conv_general_dilated`` and
      ``jaxmp.nn.max_pool``, whose CPU lowerings are chosen per shape (im2col
      products on maps of a few pixels, matrix-product kernel gradients for
      1x1 convolutions, a max-pool gradient without select-and-scatter).
      Same values up to fp32 rounding; no effect on other platforms. Jit
      with ``jaxmp.cpu_compiler_options()`` for XLA's faster convolutions.
  """

  stage_sizes: Sequence[int]
  num_classes: int = 10
  num_filters: int = 64
  stem: str = "cifar"
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  norm_dtype: Dtype = jnp.float32
  bn_momentum: float = 0.9
  bn_epsilon: float = 1e-5
  axis_name: Optional[str] = None
  init_scheme: str = "flax"
  fused_norm: bool = True
  cpu_convs: bool = True
  unbiased_running_var: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    """Computes logits.

    Args:
      x: Images, ``[N, H, W, C]`` float.
      train: Use batch statistics and update ``batch_stats`` (make it
        mutable), or use the running averages.

    Returns:
      ``[N, num_classes]`` logits, float32 (float64 for a float64 model).
    """
    if self.init_scheme not in ("flax", "torchvision"):
      raise ValueError(
        f'init_scheme must be "flax" or "torchvision", got {self.init_scheme!r}'
      )
    if self.stem not in ("cifar", "imagenet"):
      raise ValueError(f'stem must be "cifar" or "imagenet", got {self.stem!r}')
    torch_init = self.init_scheme == "torchvision"
    conv_kwargs = dict(kernel_init=_TORCH_CONV_INIT) if torch_init else {}
    if self.cpu_convs:
      conv_kwargs["conv_general_dilated"] = conv_lib.conv_general_dilated
    max_pool = pool_lib.max_pool if self.cpu_convs else nn.max_pool
    conv = functools.partial(
      nn.Conv,
      use_bias=False,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      **conv_kwargs,
    )
    norm_act = functools.partial(
      _norm_act,
      fused=self.fused_norm,
      dtype=self.dtype,
      norm_dtype=self.norm_dtype,
      momentum=self.bn_momentum,
      epsilon=self.bn_epsilon,
      axis_name=self.axis_name,
      unbiased_running_var=self.unbiased_running_var,
    )

    x = jnp.asarray(x, self.dtype)
    if self.stem == "cifar":
      x = conv(self.num_filters, (3, 3), padding=1, name="conv1")(x)
      x = norm_act(x, None, name="bn1", relu=True, train=train)
    else:
      x = conv(self.num_filters, (7, 7), (2, 2), padding=3, name="conv1")(x)
      x = norm_act(x, None, name="bn1", relu=True, train=train)
      x = max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))

    for i, num_blocks in enumerate(self.stage_sizes):
      for j in range(num_blocks):
        x = BasicBlock(
          features=self.num_filters * 2**i,
          strides=2 if i > 0 and j == 0 else 1,
          conv=conv,
          norm_act=norm_act,
          name=f"layer{i + 1}_{j}",
        )(x, train)

    x = jnp.mean(x, axis=(1, 2))
    dense_kwargs = {}
    if torch_init:
      dense_kwargs = dict(
        kernel_init=_TORCH_LINEAR_INIT,
        bias_init=_torch_linear_bias_init(x.shape[-1]),
      )
    x = nn.Dense(
      self.num_classes,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      name="fc",
      **dense_kwargs,
    )(x)
    return jnp.asarray(x, jnp.promote_types(x.dtype, jnp.float32))


def resnet18(**kwargs: Any) -> ResNet:
  """ResNet18 with the CIFAR stem: a 3x3 stride-1 conv, no max-pool.

  11,173,962 params for 10 classes.

  >>> resnet18(num_classes=100).stem
  'cifar'

  Args:
    **kwargs: Other `ResNet` fields (``num_classes``, ``num_filters``,
      ``dtype``, ``param_dtype``, ``norm_dtype``, ...); they override the
      defaults ``stage_sizes=(2, 2, 2, 2)`` and ``stem="cifar"``.

  Returns:
    The `ResNet` module.
  """
  return ResNet(**{"stage_sizes": (2, 2, 2, 2), "stem": "cifar", **kwargs})


def resnet18_torchvision(**kwargs: Any) -> ResNet:
  """ResNet18 as torchvision builds it: its ImageNet stem and initialisers.

  A 7x7 stride-2 conv, BN, ReLU and a 3x3 stride-2 max-pool, torchvision's
  initialisers and its unbiased running variance, so that
  `jaxmp.models.from_torchvision` weights give torchvision's outputs.
  11,689,512 params for 1000 classes, 11,181,642 for 10.

  Args:
    **kwargs: Other `ResNet` fields (``num_classes``, ``num_filters``,
      ``dtype``, ...); they override the defaults ``stage_sizes=(2, 2, 2,
      2)``, ``stem="imagenet"``, ``init_scheme="torchvision"`` and
      ``unbiased_running_var=True``.

  Returns:
    The `ResNet` module.
  """
  defaults = {
    "stage_sizes": (2, 2, 2, 2),
    "stem": "imagenet",
    "init_scheme": "torchvision",
    "unbiased_running_var": True,
  }
  return ResNet(**{**defaults, **kwargs})


_MODELS = {
  "resnet18": resnet18,
  "resnet18_torchvision": resnet18_torchvision,
}


def get_model(name: str, **kwargs: Any) -> ResNet:
  """Builds a model by name.

  Args:
    name: One of ``"resnet18"``, ``"resnet18_torchvision"``.
    **kwargs: Fields of :class:`ResNet` to set or override (``num_classes``,
      ``dtype``, ...).

  Returns:
    The (unbound) Flax module.

  Raises:
    ValueError: If ``name`` is not a known model.

  >>> get_model('resnet18', num_classes=100).num_classes
  100
  """
  if name not in _MODELS:
    raise ValueError(
      f"Unknown model {name!r}; valid names: {', '.join(sorted(_MODELS))}."
    )
  return _MODELS[name](**kwargs)
