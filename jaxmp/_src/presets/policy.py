"""Precision policies and Apex-style presets (O0-O3, bf16, bf16-kahan...).

A `jmp.Policy` says which dtype params are stored in, which dtype the forward
and backward pass compute in, and which dtype the model's output is cast to.
Apex's opt levels decide more than that: whether BatchNorm stays in fp32,
whether fp32 master weights are kept and which loss scale is used. A `Preset`
records those decisions next to the policy so the training code can wire them
up from a single string.
"""

import dataclasses
from typing import Any, Optional, Union

import jax.numpy as jnp
import jmp
import numpy as np

from jaxmp._src.transform.mixed_precision import LossScale


@dataclasses.dataclass(frozen=True)
class Preset:
  """An Apex-style opt level.

  Attributes:
    name: the preset's name, e.g. ``"O2"``.
    policy: param/compute/output dtypes.
    loss_scale: the jmp loss-scale object for `jaxmp.mixed_precision`, as
      Apex's ``loss_scale``: ``jmp.StaticLossScale(1.0)`` (O0, O3),
      ``jmp.DynamicLossScale(2**15)`` (O1, O2, fp16 compute) or
      ``jmp.NoOpLossScale()`` (bf16: no scaling needed).
    keep_batchnorm_fp32: BatchNorm params, statistics and arithmetic stay fp32.
    master_weights: how half-precision params keep their updates, as
      `jaxmp.mixed_precision`'s ``master_weights``: ``True`` (fp32 master
      copies in the optimizer state), ``False`` (none: the plain half
      update), ``"kahan"`` or ``"stochastic"`` (no fp32 copy; see there).
    description: one line for humans.
    autocast: the dtype of `jaxmp.autocast` for the forward pass, as Apex's
      ``patch_torch_functions``: ``jnp.float16`` for O1 (the model stays
      fp32, its matrix products and convolutions run in fp16, the sensitive
      ops in fp32); ``None`` (every other preset): the model computes in
      ``policy.compute_dtype`` as it is built.
  """

  name: str
  policy: jmp.Policy
  loss_scale: LossScale
  keep_batchnorm_fp32: bool
  master_weights: Union[bool, str]
  description: str
  autocast: Optional[Any] = None


# NumPy scalars: building a preset must not start a JAX backend at import.
_DYNAMIC = jmp.DynamicLossScale(np.float32(2.0**15), counter=np.int32(0))
_STATIC_ONE = jmp.StaticLossScale(np.float32(1.0))
_NOOP = jmp.NoOpLossScale()


def _preset(
  name, policy, loss_scale, keep_bn_fp32, master, description, autocast=None
):
  return Preset(
    name,
    jmp.get_policy(policy),
    loss_scale,
    keep_bn_fp32,
    master,
    description,
    autocast,
  )


PRESETS = {
  p.name: p
  for p in (
    _preset(
      "O0",
      "p=f32,c=f32,o=f32",
      _STATIC_ONE,
      True,
      False,
      "fp32 everywhere: the accuracy baseline.",
    ),
    # Apex's O1: the model is left fp32 (its params and its compute dtype);
    # jaxmp.autocast runs its matrix products and convolutions in fp16.
    _preset(
      "O1",
      "p=f32,c=f32,o=f32",
      _DYNAMIC,
      True,
      False,
      "fp32 params and model, forward under jaxmp.autocast(float16): "
      "products and convolutions fp16, sensitive ops fp32; dynamic loss "
      "scaling.",
      jnp.float16,
    ),
    _preset(
      "O2",
      "p=f16,c=f16,o=f32",
      _DYNAMIC,
      True,
      True,
      "fp16 params and compute, BatchNorm fp32, fp32 master "
      "weights, dynamic loss scaling.",
    ),
    _preset(
      "O3",
      "p=f16,c=f16,o=f16",
      _STATIC_ONE,
      False,
      False,
      "pure fp16, no masters, no loss scaling: a speed baseline.",
    ),
    _preset(
      "bf16",
      "p=f32,c=bf16,o=f32",
      _NOOP,
      True,
      False,
      "fp32 params, bfloat16 compute, no loss scaling needed.",
    ),
    _preset(
      "bf16-kahan",
      "p=bf16,c=bf16,o=f32",
      _NOOP,
      True,
      "kahan",
      "bfloat16 params and compute, BatchNorm fp32, Kahan-compensated "
      "updates instead of fp32 masters (2 bytes a param, not 4).",
    ),
    _preset(
      "bf16-stochastic",
      "p=bf16,c=bf16,o=f32",
      _NOOP,
      True,
      "stochastic",
      "bfloat16 params and compute, BatchNorm fp32, stochastically rounded "
      "updates instead of fp32 masters (no extra bytes).",
    ),
  )
}
"""The Apex-style presets by name, each a `Preset`: ``"O0"`` to ``"O3"``,
``"bf16"``, ``"bf16-kahan"`` and ``"bf16-stochastic"``.

>>> sorted(PRESETS) == sorted(["O0", "O1", "O2", "O3", "bf16", "bf16-kahan",
...                            "bf16-stochastic"])
True
"""

_SPEC_HELP = (
  "a preset (" + ", ".join(PRESETS) + ") or a jmp policy string such as "
  "'params=float32,compute=float16,output=float32' or 'p=f32,c=f16,o=f32' "
  "(dtypes: float32/f32, float16/f16/half, bfloat16/bf16)"
)


def get_preset(spec: Union[str, Preset]) -> Preset:
  """Returns the `Preset` for a preset name or a jmp policy string.

  A policy string gets the preset that matches its dtypes: half-precision
  params keep fp32 masters, float16 compute gets dynamic loss scaling
  (``jmp.DynamicLossScale(2**15)``, else ``jmp.NoOpLossScale()``), BatchNorm
  stays fp32.

  Args:
    spec: ``"O0"``..``"O3"``, ``"bf16"``, a jmp policy string, or a
      `Preset` (returned as it is).

  Returns:
    The preset.

  Raises:
    ValueError: for an unknown spec; the message lists the valid ones.
    TypeError: for a spec that is neither a string nor a `Preset`.

  >>> get_preset("O2").master_weights
  True
  """
  if isinstance(spec, Preset):
    return spec
  if not isinstance(spec, str):
    raise TypeError(
      f"policy must be a string or a jaxmp.Preset, got {spec!r}: {_SPEC_HELP}"
    )
  if spec in PRESETS:
    return PRESETS[spec]
  try:
    policy = jmp.get_policy(spec)
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"unknown policy {spec!r}; expected {_SPEC_HELP}") from e
  half = {"float16", "bfloat16"}
  fp16_compute = _dtype_name(policy.compute_dtype) == "float16"
  return Preset(
    name=spec,
    policy=policy,
    loss_scale=_DYNAMIC if fp16_compute else _NOOP,
    keep_batchnorm_fp32=True,
    master_weights=_dtype_name(policy.param_dtype) in half,
    description="custom jmp policy",
  )


def get_policy(spec: Union[str, Preset]) -> jmp.Policy:
  """Returns the `jmp.Policy` of a preset name or a jmp policy string.

  Args:
    spec: ``"O0"``, ``"O1"``, ``"O2"``, ``"O3"``, ``"bf16"``, a jmp policy
      string (``"params=float32,compute=float16,output=float32"`` or
      ``"p=f32,c=f16,o=f32"``), or a `Preset`.

  Returns:
    The policy.

  Raises:
    ValueError: for an unknown spec; the message lists the valid ones.
    TypeError: for a spec that is neither a string nor a `Preset`.

  >>> get_policy("O2").param_dtype
  <class 'jax.numpy.float16'>
  """
  return get_preset(spec).policy


def _dtype_name(dtype) -> str:
  return np.dtype(dtype).name
