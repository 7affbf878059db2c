"""Block-scaled fp8 and fp4 training of an MLP: MXFP8, DeepSeek's and NVFP4.

A plain fp32 MLP (no precision code in the model) learns to classify
random inputs as a fixed random teacher MLP does (16 classes,
cross-entropy), from the same init on the same batches, once per recipe:

* ``bf16``: ``jaxmp.autocast(loss, jnp.bfloat16)``;
* ``mxfp8`` / ``deepseek`` / ``nvfp4``: ``jaxmp.autocast(loss, fp8=name)``:
  every matrix product, forward and backward, on block-scaled operands
  (1x32 e4m3 blocks; 1x128 tiles and 128x128 weight blocks; 1x16 e2m1
  blocks, 16x16 weight blocks, stochastic rounding of gradients and a
  random Hadamard transform on the weight gradients).

It prints each recipe's final loss and its gap to bf16's. On a CPU every
block-scaled product is emulated (quantize, dequantize, float32 product),
with the numerics a Blackwell GPU's block-scaled GEMMs give.

Run::

    python examples/block_scaled_mlp.py --steps 300
    python examples/block_scaled_mlp.py --recipes nvfp4 --steps 50
"""

import argparse
import sys
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp


def mlp(params, x):
  """``x`` through the layers: ``tanh(x @ w + b)``, the last one linear."""
  for w, b in params[:-1]:
    x = jnp.tanh(x @ w + b)
  w, b = params[-1]
  return x @ w + b


def init(key, sizes):
  """fp32 ``[(w, b), ...]`` for the layer ``sizes``, LeCun-normal."""
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    (jax.random.normal(k, (m, n)) / np.sqrt(m), jnp.zeros((n,)))
    for k, m, n in zip(keys, sizes[:-1], sizes[1:])
  ]


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
  """Trains bf16 and each recipe; returns ``{name: final loss}``."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--recipes", default="mxfp8,deepseek,nvfp4")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  sizes = [64, args.width, args.width, 16]
  teacher = init(jax.random.key(args.seed + 1), sizes)
  params0 = init(jax.random.key(args.seed), sizes)

  def loss_fn(params, x, labels):
    logits = mlp(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()

  # The teacher's labels, in float32 (outside autocast).
  label = jax.jit(lambda x: jnp.argmax(mlp(teacher, x), axis=-1))

  finals = {}
  for name in ["bf16"] + args.recipes.split(","):
    fp8 = False if name == "bf16" else name
    loss = jaxmp.autocast(loss_fn, jnp.bfloat16, fp8=fp8)
    optimizer = optax.adam(args.learning_rate)

    @jax.jit
    def step(params, opt_state, x, y, loss=loss, optimizer=optimizer):
      value, grads = jax.value_and_grad(loss)(params, x, y)
      updates, opt_state = optimizer.update(grads, opt_state)
      return optax.apply_updates(params, updates), opt_state, value

    params, opt_state = params0, optimizer.init(params0)
    rng = np.random.default_rng(args.seed)
    for _ in range(args.steps):
      x = rng.normal(size=(args.batch_size, sizes[0])).astype(np.float32)
      params, opt_state, value = step(params, opt_state, x, label(x))
    # The held-out loss of the trained model, computed as it was trained.
    x = np.random.default_rng(args.seed + 2).normal(size=(1024, sizes[0]))
    x = x.astype(np.float32)
    finals[name] = float(jax.jit(loss)(params, x, label(x)))
    gap = finals[name] / finals["bf16"] - 1
    print(f"{name}: final loss {finals[name]:.5f} ({100 * gap:+.1f}% vs bf16)")
  return finals


if __name__ == "__main__":
  main(sys.argv[1:])
