"""`initialize`: Apex's ``amp.initialize`` for optax, from a preset name.

``model, opt = amp.initialize(model, opt, opt_level="O2")`` casts the model
and wraps the optimizer. In JAX the model is its params tree and the optimizer
an optax transform, so `initialize` casts the params by the preset's policy
(keeping normalisation layers fp32 where the preset says so) and wraps the
optimizer in `mixed_precision` with the preset's loss scale and masters.
"""

import re
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from jaxmp._src import mixed_precision as mp
from jaxmp._src import policy as policy_lib

_BN = re.compile(r"(?:^|_)bn(?:\d|_|$)")


def _is_norm_path(path: Sequence[Union[str, int]]) -> bool:
  """Whether a param path names a normalisation layer (the default)."""
  return any(
    isinstance(k, str) and ("norm" in k.lower() or _BN.search(k.lower()))
    for k in path
  )


def _key_name(key) -> Union[str, int]:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return getattr(key, attr)
  return str(key)


def initialize(
  params: optax.Params,
  optimizer: optax.GradientTransformation,
  opt_level: Union[str, policy_lib.Preset] = "O2",
  *,
  keep_fp32: Optional[Callable[[tuple[Union[str, int], ...]], bool]] = None,
  **overrides: Any,
) -> tuple[optax.Params, optax.GradientTransformationExtraArgs]:
  """Casts params and wraps an optimizer as an Apex opt level prescribes.

  The params' floating leaves are cast to the preset's
  ``policy.param_dtype``; where the preset has ``keep_batchnorm_fp32``, the
  leaves that ``keep_fp32`` selects are cast to fp32 instead. The optimizer
  becomes ``mixed_precision(optimizer, loss_scale=preset.loss_scale,
  master_weights=preset.master_weights, **overrides)``. The compute dtype is
  the model's business in JAX: build the model with
  ``jaxmp.get_policy(opt_level).compute_dtype`` (a Flax ``dtype=``) and cast
  its inputs with ``policy.cast_to_compute``.

  Args:
    params: the model's params (in Flax, ``variables["params"]``; the
      ``batch_stats`` are not the optimizer's and stay as they are).
    optimizer: the optax optimizer to wrap.
    opt_level: ``"O0"``..``"O3"``, ``"bf16"``, a jmp policy string or a
      `jaxmp.Preset`.
    keep_fp32: ``keep_fp32(path) -> bool`` on a leaf's path, a tuple of its
      keys (dict keys and attribute names as strings, sequence indices as
      ints), e.g. ``("BatchNorm_0", "scale")``. The default selects paths
      with a key that contains ``"norm"`` (any case: Flax's ``BatchNorm_0``,
      ``LayerNorm_0``, ``GroupNorm_0``) or a ``bn`` token (``bn1``,
      ``downsample_bn``).
    **overrides: keyword arguments of `jaxmp.mixed_precision` that replace the
      preset's (``loss_scale``, ``master_weights``) or add to them
      (``max_loss_scale``, ``hysteresis``, ``axis_name``).

  Returns:
    ``(params, optimizer)``: the cast params and the wrapped optimizer.

  >>> import jax.numpy as jnp, optax, jaxmp
  >>> params = {"Dense_0": {"kernel": jnp.ones((2, 2))},
  ...           "BatchNorm_0": {"scale": jnp.ones(2)}}
  >>> params, opt = jaxmp.initialize(params, optax.sgd(0.1), "O2")
  >>> params["Dense_0"]["kernel"].dtype, params["BatchNorm_0"]["scale"].dtype
  (dtype('float16'), dtype('float32'))
  >>> jaxmp.loss_scaler(opt.init(params)).loss_scale
  Array(32768., dtype=float32)
  """
  preset = (
    opt_level
    if isinstance(opt_level, policy_lib.Preset)
    else policy_lib.get_preset(opt_level)
  )
  keep = _is_norm_path if keep_fp32 is None else keep_fp32
  half = preset.policy.param_dtype

  def cast(path, leaf):
    if leaf is None or not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      return leaf
    names = tuple(_key_name(k) for k in path)
    dtype = jnp.float32 if preset.keep_batchnorm_fp32 and keep(names) else half
    return jnp.asarray(leaf).astype(dtype)

  params = jax.tree_util.tree_map_with_path(cast, params)
  kwargs = dict(
    loss_scale=preset.loss_scale, master_weights=preset.master_weights
  )
  kwargs.update(overrides)
  return params, mp.mixed_precision(optimizer, **kwargs)
