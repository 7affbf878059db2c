"""Test and demo knobs: inject a NaN batch or a gradient overflow on purpose.

They reproduce, on any data set, the two failures that the app's diagnostics
tell apart (README, "When fp16 goes wrong"); they have no use in a real run.
Step ``K`` is the K-th optimizer step, the one logged as ``Step K``. Each
fault is a ``jnp.where`` on the traced step counter inside the jitted step:
no Python branch on a traced value, no recompilation, and with every knob at
0 no extra operation in the compiled step at all.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from cifar_train.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Faults:
  """The faults of a run; 0 turns each off.

  Attributes:
    nan_data_at_step: from this step on, every training image is NaN (bad
      data: the loss itself is NaN, which no loss scale fixes).
    overflow_at_step: at this step only, every element of the gradient of
      ``overflow_leaf`` becomes +inf (an fp16 overflow in one layer).
    overflow_leaf: the param whose gradient overflows, as a slash path of
      its keys, e.g. ``layer3_1/conv2/kernel``.
  """

  nan_data_at_step: int = 0
  overflow_at_step: int = 0
  overflow_leaf: str = ""


def leaf_name(path) -> str:
  """``layer3_1/conv2/kernel`` for the key path of that leaf."""
  return "/".join(str(getattr(k, "key", k)) for k in path)


def check(faults: Faults, params: Any) -> None:
  """Raises `ConfigError` when ``overflow_leaf`` is not a leaf of ``params``."""
  if faults.overflow_at_step <= 0:
    return
  names = [
    leaf_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)
  ]
  if faults.overflow_leaf not in names:
    raise ConfigError(
      f"inject_overflow_leaf {faults.overflow_leaf!r} is not a param of the "
      f"model; e.g. {', '.join(names[:3])}"
    )


def corrupt_images(faults: Faults, step: jax.Array, images: jax.Array):
  """``images``, or NaN from step ``nan_data_at_step`` on.

  ``step`` is the traced number of steps taken before this one.
  """
  if faults.nan_data_at_step <= 0:
    return images
  bad = step + 1 >= faults.nan_data_at_step
  return jnp.where(bad, jnp.asarray(jnp.nan, images.dtype), images)


def corrupt_grads(faults: Faults, step: jax.Array, grads: Any) -> Any:
  """``grads`` with ``overflow_leaf`` all +inf at step ``overflow_at_step``."""
  if faults.overflow_at_step <= 0:
    return grads
  hit = step + 1 == faults.overflow_at_step

  def corrupt(path, g):
    if leaf_name(path) != faults.overflow_leaf:
      return g
    return jnp.where(hit, jnp.asarray(jnp.inf, g.dtype), g)

  return jax.tree_util.tree_map_with_path(corrupt, grads)
