"""`initialize`: Apex's ``amp.initialize`` for optax, from a preset name.

``model, opt = amp.initialize(model, opt, opt_level="O2")`` casts the model
and wraps the optimizer. In JAX the model is its params tree, its forward
function and the optimizer an optax transform, so `initialize` casts the params
by the preset's policy (keeping normalisation layers fp32 where the preset says
so), wraps the optimizer in `mixed_precision` with the preset's loss scale and
masters and, given the forward function, patches it as Apex patches
``model.forward``: under `jaxmp.autocast` for O1, with its inputs cast to the
compute dtype and its output to the output dtype.
"""

import functools
import re
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from jaxmp._src.autocast import regions as autocast_lib
from jaxmp._src.reduction import wire
from jaxmp._src.transform import mixed_precision as mp
from jaxmp._src.presets import policy as policy_lib

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


def _is_mutable_call(kwargs: dict[str, Any]) -> bool:
  """Flax linen's ``apply(..., mutable=...)`` returns ``(output, vars)``."""
  return kwargs.get("mutable", False) is not False


def _patch_forward(
  apply_fn: Callable[..., Any],
  preset: policy_lib.Preset,
  grad_reduce: str = "fp32",
) -> Callable[..., Any]:
  """``apply_fn`` as Apex's ``amp.initialize`` patches ``model.forward``.

  ``apply_fn(variables, *inputs, **kwargs)`` takes the model's variables (or
  params, or an Equinox module) first: they are left as they are. The
  floating arrays among ``inputs`` and ``kwargs`` are cast to
  ``preset.policy.compute_dtype`` and the floating arrays of the output to
  ``preset.policy.output_dtype``; under a Flax ``mutable=`` call only the
  output's first element is cast, so the updated variables (BatchNorm
  statistics) keep their dtypes. With ``preset.autocast`` set (O1), the
  function runs under ``jaxmp.autocast(apply_fn, preset.autocast)``.
  Integer, bool and non-array arguments (``train=True``) pass unchanged.
  The weight gradients' cross-device sums follow ``grad_reduce``: under
  autocast by its own, with half params by `autocast_lib.reducing_in_fp32`.
  """
  policy = preset.policy
  fun = apply_fn
  if preset.autocast is not None:
    fun = autocast_lib.autocast(
      apply_fn, preset.autocast, grad_reduce=grad_reduce
    )
  elif grad_reduce != "native" and jnp.dtype(policy.param_dtype) in wire.HALF:
    fun = autocast_lib.reducing_in_fp32(apply_fn, grad_reduce)

  @functools.wraps(apply_fn)
  def forward(variables, *args, **kwargs):
    args, kwargs = policy.cast_to_compute((args, kwargs))
    out = fun(variables, *args, **kwargs)
    if _is_mutable_call(kwargs) and isinstance(out, tuple) and len(out) == 2:
      return policy.cast_to_output(out[0]), out[1]
    return policy.cast_to_output(out)

  return forward


def initialize(
  params: optax.Params,
  optimizer: optax.GradientTransformation,
  opt_level: Union[str, policy_lib.Preset] = "O2",
  *,
  apply_fn: Optional[Callable[..., Any]] = None,
  keep_fp32: Optional[Callable[[tuple[Union[str, int], ...]], bool]] = None,
  grad_reduce: str = "fp32",
  **overrides: Any,
) -> Union[
  tuple[optax.Params, optax.GradientTransformationExtraArgs],
  tuple[
    Callable[..., Any], optax.Params, optax.GradientTransformationExtraArgs
  ],
]:
  """Casts params, wraps an optimizer and patches a forward as Apex does.

  The params' floating leaves are cast to the preset's
  ``policy.param_dtype``; where the preset has ``keep_batchnorm_fp32``, the
  leaves that ``keep_fp32`` selects are cast to fp32 instead. The optimizer
  becomes ``mixed_precision(optimizer, loss_scale=preset.loss_scale,
  master_weights=preset.master_weights, **overrides)``.

  Given ``apply_fn`` (a Flax ``model.apply``, an Equinox module's call, any
  ``f(variables, *inputs, **kwargs)``), it is returned patched as Apex patches
  ``model.forward`` (`_patch_forward`):

  - ``"O1"`` (``preset.autocast``): under ``jaxmp.autocast(apply_fn,
    float16)``. The model stays as it is built, in fp32; its matrix products
    and convolutions run in fp16 and its sensitive ops in fp32.
  - every other preset: its floating inputs cast to
    ``policy.compute_dtype`` and its output to ``policy.output_dtype``
    (Apex's O2/O3 input and output casts). The compute dtype is still the
    model's business: build it with ``jaxmp.get_policy(opt_level)
    .compute_dtype`` (a Flax ``dtype=``).

  Args:
    params: the model's params (in Flax, ``variables["params"]``; the
      ``batch_stats`` are not the optimizer's and stay as they are).
    optimizer: the optax optimizer to wrap.
    opt_level: ``"O0"``..``"O3"``, ``"bf16"``, a jmp policy string or a
      `jaxmp.Preset`.
    apply_fn: the model's forward function, its variables or params first.
    keep_fp32: ``keep_fp32(path) -> bool`` on a leaf's path, a tuple of its
      keys (dict keys and attribute names as strings, sequence indices as
      ints), e.g. ``("BatchNorm_0", "scale")``. The default selects paths
      with a key that contains ``"norm"`` (any case: Flax's ``BatchNorm_0``,
      ``LayerNorm_0``, ``GroupNorm_0``) or a ``bn`` token (``bn1``,
      ``downsample_bn``).
    grad_reduce: how the patched forward's weight gradients are summed
      across devices: ``"fp32"`` (default), ``"half_wire"`` or ``"native"``
      (`jaxmp.autocast`'s argument; with half params, the same for their
      products, broadcasts and gathers).
    **overrides: keyword arguments of `jaxmp.mixed_precision` that replace the
      preset's (``loss_scale``, ``master_weights``) or add to them
      (``max_loss_scale``, ``hysteresis``, ``axis_name``).

  Returns:
    ``(params, optimizer)``: the cast params and the wrapped optimizer;
    with ``apply_fn``, ``(apply_fn, params, optimizer)`` with the patched
    forward first.

  Raises:
    TypeError: ``apply_fn`` is given and not callable.

  >>> import jax, jax.numpy as jnp, optax, jaxmp
  >>> params = {"Dense_0": {"kernel": jnp.ones((2, 2))},
  ...           "BatchNorm_0": {"scale": jnp.ones(2)}}
  >>> params, opt = jaxmp.initialize(params, optax.sgd(0.1), "O2")
  >>> params["Dense_0"]["kernel"].dtype, params["BatchNorm_0"]["scale"].dtype
  (dtype('float16'), dtype('float32'))
  >>> jaxmp.loss_scaler(opt.init(params)).loss_scale
  Array(32768., dtype=float32)

  O1 keeps the model fp32 and returns its forward under autocast:

  >>> def apply(params, x):
  ...   return jax.nn.relu(x @ params["w"])
  >>> apply, params, opt = jaxmp.initialize(
  ...     {"w": jnp.ones((4, 3))}, optax.sgd(0.1), "O1", apply_fn=apply)
  >>> params["w"].dtype, apply(params, jnp.ones((2, 4))).dtype
  (dtype('float32'), dtype('float32'))
  >>> jaxpr = jax.make_jaxpr(apply)(params, jnp.ones((2, 4)))
  >>> "f16[2,3] = dot_general" in str(jaxpr)  # the product in fp16
  True
  """
  grad_reduce = wire.check_mode(grad_reduce, "jaxmp.initialize")
  if apply_fn is not None and not callable(apply_fn):
    raise TypeError(
      f"apply_fn must be the model's forward function, got {apply_fn!r}"
    )
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
  optimizer = mp.mixed_precision(optimizer, **kwargs)
  if apply_fn is None:
    return params, optimizer
  return _patch_forward(apply_fn, preset, grad_reduce), params, optimizer
