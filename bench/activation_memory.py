"""Bytes saved for the backward pass of one ResNet18 train step, per precision.

Run from the repository root (CPU is enough, it only traces)::

  .venv/bin/python bench/activation_memory.py

For ResNet18 (CIFAR stem, 64 filters, 10 classes) at batch 128 on 32x32x3
inputs, it traces ``jax.vjp`` of a train-step loss (fp32 softmax
cross-entropy on the logits, BatchNorm in train mode with mutable
``batch_stats``) with abstract inputs and sums ``prod(shape) * itemsize`` over
the distinct residuals the VJP keeps, as ``jax.ad_checkpoint`` does (each
jaxpr variable counted once). "activations" excludes residuals that are the
step's own arguments (params, batch_stats, images); "with args" includes them
(the float32 reference's 1313 MB with args is the prototype's figure).
It is a property of the jaxpr, so the same on every platform (XLA may later
fuse or rematerialise some of it).

Variants: a plain-flax reference (``nn.Conv``/``nn.BatchNorm``/``nn.relu``,
written here without project code) in float32 and with ``dtype=float16``,
and the project's ``resnet18`` at O0 (all float32), O1 (float32 params,
float16 compute, float32 BatchNorm), O2 (float16 params and compute, float32
BatchNorm) and bf16 (float32 params, bfloat16 compute, float32 BatchNorm).
The last line is ``activation_bytes_ratio_fp16_over_fp32: X`` with
X = O2 activations / float32 reference activations (goal: <= 0.50).
"""

import functools
import os
import sys
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxmp.models import resnet18  # pylint: disable=g-import-not-at-top

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

BATCH = 128
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10


class _PlainBlock(nn.Module):
  """torchvision BasicBlock with stock flax layers."""

  features: int
  strides: int
  dtype: Any

  @nn.compact
  def __call__(self, x, train):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=0.9,
      epsilon=1e-5,
      dtype=self.dtype,
    )
    s = (self.strides, self.strides)
    y = nn.relu(norm()(conv(self.features, (3, 3), s, padding=1)(x)))
    y = norm()(conv(self.features, (3, 3), padding=1)(y))
    if self.strides != 1 or x.shape[-1] != self.features:
      x = norm()(conv(self.features, (1, 1), s, padding=0)(x))
    return nn.relu(y + x)


class PlainResNet18(nn.Module):
  """Reference CIFAR ResNet18 (11,173,962 params) with stock flax layers."""

  num_classes: int = NUM_CLASSES
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train):
    x = jnp.asarray(x, self.dtype)
    x = nn.Conv(64, (3, 3), padding=1, use_bias=False, dtype=self.dtype)(x)
    x = nn.relu(
      nn.BatchNorm(
        use_running_average=not train,
        momentum=0.9,
        epsilon=1e-5,
        dtype=self.dtype,
      )(x)
    )
    for i in range(4):
      for j in range(2):
        x = _PlainBlock(64 * 2**i, 2 if i > 0 and j == 0 else 1, self.dtype)(
          x, train
        )
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    return jnp.asarray(x, jnp.float32)


def saved_residual_bytes(f: Callable[..., Any], *args: Any) -> tuple[int, int]:
  """Bytes of the residuals a VJP of ``f`` w.r.t. ``args[0]`` keeps.

  Traces only (``args`` may be ``jax.ShapeDtypeStruct``); the other
  arguments are closed over (not differentiated). Mirrors the
  private ``jax._src.ad_checkpoint.saved_residuals``: residuals are the
  jaxpr outputs that the VJP closes over, each variable counted once.

  Args:
    f: Function to differentiate.
    *args: Its (abstract) arguments.

  Returns:
    ``(activation_bytes, argument_bytes)``: residuals computed inside ``f``
    (and literals/constants), and residuals that are ``f``'s own arguments.
    Both count each distinct residual once.
  """
  closed, out_shape = jax.make_jaxpr(
    lambda x, *rest: jax.vjp(lambda x: f(x, *rest), x), return_shape=True
  )(*args)
  jaxpr = closed.jaxpr
  num_res = len(jax.tree.leaves(out_shape[1]))
  outs = jaxpr.outvars[len(jaxpr.outvars) - num_res :]
  # Like saved_residuals: look through reduce_precision to its operand.
  subst = {
    e.outvars[0]: e.invars[0]
    for e in jaxpr.eqns
    if e.primitive.name == "reduce_precision"
  }
  invars = set(jaxpr.invars)
  seen, act, arg = set(), 0, 0
  for v in outs:
    literal = hasattr(v, "val")
    if not literal:
      v = subst.get(v, v)
      if v in seen:
        continue
      seen.add(v)
    nbytes = int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize
    if not literal and v in invars:
      arg += nbytes
    else:
      act += nbytes
  return act, arg


def step_residual_bytes(model: nn.Module) -> tuple[int, int]:
  """Residual bytes of one train step of ``model`` (see module docstring)."""
  images = jax.ShapeDtypeStruct((BATCH, *IMAGE_SHAPE), jnp.float32)
  labels = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
  variables = jax.eval_shape(
    lambda x: model.init(jax.random.key(0), x, train=False), images
  )

  def loss_fn(params, batch_stats, images, labels):
    logits, updates = model.apply(
      {"params": params, "batch_stats": batch_stats},
      images,
      train=True,
      mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels
    ).mean()
    return loss, updates

  return saved_residual_bytes(
    lambda p, s, x, y: loss_fn(p, s, x, y)[0],
    variables["params"],
    variables["batch_stats"],
    images,
    labels,
  )


def main() -> None:
  print(_common.date_line("activation_memory"), flush=True)
  f16, bf16, f32 = jnp.float16, jnp.bfloat16, jnp.float32
  variants = {
    "plain flax fp32 (reference)": PlainResNet18(dtype=f32),
    "plain flax dtype=fp16": PlainResNet18(dtype=f16),
    "jaxmp O0 (fp32)": resnet18(),
    "jaxmp O1 (fp32 params, fp16)": resnet18(dtype=f16),
    "jaxmp O2 (fp16 params, fp16)": resnet18(
      dtype=f16, param_dtype=f16, norm_dtype=f32
    ),
    "jaxmp bf16 (fp32 params)": resnet18(dtype=bf16),
  }
  results = {k: step_residual_bytes(m) for k, m in variants.items()}
  ref_act, ref_arg = results["plain flax fp32 (reference)"]
  ref_all = ref_act + ref_arg
  mb = 1e6
  print(f"ResNet18 CIFAR, batch {BATCH}, bytes saved for the backward pass")
  print(
    f"{'variant':30s} {'activ. MB':>9s} {'ratio':>6s}"
    f" {'w/ args MB':>10s} {'ratio':>6s}"
  )
  for name, (act, arg) in results.items():
    print(
      f"{name:30s} {act / mb:9.1f} {act / ref_act:6.3f}"
      f" {(act + arg) / mb:10.1f} {(act + arg) / ref_all:6.3f}"
    )
  o2 = results["jaxmp O2 (fp16 params, fp16)"][0]
  print(f"activation_bytes_ratio_fp16_over_fp32: {o2 / ref_act:.3f}")


if __name__ == "__main__":
  main()
