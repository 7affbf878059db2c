"""A byte-level transformer LM trained in fp32 and under autocast fp16.

The model is a small causal transformer over bytes (Flax linen, pre-LayerNorm
blocks, multi-head attention written out with ``jax.nn.softmax``). It is
written in fp32 with no precision code at all: the fp16 run wraps its
``apply`` in `jaxmp.autocast`, which runs the matrix products in fp16 and the
softmax, LayerNorm statistics and the loss in fp32, and trains it with
`jaxmp.mixed_precision` (dynamic loss scaling). Both runs start from the same
params and see the same batches; their loss curves are printed side by side.

Run (the corpus defaults to this file's own bytes)::

    python examples/byte_lm_autocast.py --steps 300
    python examples/byte_lm_autocast.py --text README.md --out /tmp/curves.tsv
"""

import argparse
import functools
import sys
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp


class Block(nn.Module):
  """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

  num_heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, width = x.shape
    head = width // self.num_heads
    h = nn.LayerNorm(name="ln_attn")(x)
    qkv = nn.Dense(3 * width, name="qkv")(h)
    q, k, v = jnp.split(
      qkv.reshape(batch, length, 3 * self.num_heads, head), 3, 2
    )
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head)
    causal = jnp.tril(jnp.ones((length, length), bool))
    logits = jnp.where(causal, logits, -1e9)
    weights = jax.nn.softmax(logits, axis=-1)
    attn = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape)
    x = x + nn.Dense(width, name="proj")(attn)
    h = nn.LayerNorm(name="ln_mlp")(x)
    h = nn.Dense(4 * width, name="mlp_in")(h)
    return x + nn.Dense(width, name="mlp_out")(nn.gelu(h))


class ByteLM(nn.Module):
  """Embeddings of the 256 bytes and positions, blocks, a LayerNorm, logits."""

  width: int = 64
  depth: int = 2
  num_heads: int = 4
  max_len: int = 256

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(256, self.width, name="embed")(tokens)
    pos = self.param(
      "pos", nn.initializers.normal(0.02), (self.max_len, self.width)
    )
    x = x + pos[: tokens.shape[1]]
    for i in range(self.depth):
      x = Block(self.num_heads, name=f"block{i}")(x)
    return nn.Dense(256, name="head")(nn.LayerNorm(name="ln_out")(x))


def loss_fn(apply_fn, params, tokens):
  """Mean next-byte cross-entropy, written plainly (autocast keeps it fp32)."""
  logits = apply_fn({"params": params}, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def make_train_step(apply_fn, optimizer):
  """The jitted step of one run: scaled gradients, update, the loss."""

  @jax.jit
  def step(params, opt_state, tokens):
    # The loss unscaled, the gradients of loss * scale.
    loss, grads = jaxmp.value_and_grad(functools.partial(loss_fn, apply_fn))(
      params, opt_state, tokens
    )
    updates, opt_state = optimizer.update(grads, opt_state, params, loss=loss)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def batches(data: np.ndarray, *, steps: int, batch: int, length: int, seed):
  """``steps`` batches of ``length + 1`` consecutive bytes, fixed by seed."""
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    start = rng.integers(0, len(data) - length - 1, batch)
    yield np.stack([data[s : s + length + 1] for s in start]).astype(np.int32)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
  """Trains the fp32 and the autocast run; returns both loss curves."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--text", default=__file__, help="corpus file (bytes)")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--length", type=int, default=64)
  parser.add_argument("--width", type=int, default=64)
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--dtype", choices=("float16", "bfloat16"))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="", help="write the curves (TSV)")
  parser.set_defaults(dtype="float16")
  args = parser.parse_args(argv)

  with open(args.text, "rb") as f:
    data = np.frombuffer(f.read(), np.uint8)
  if len(data) < args.length + 2:
    raise SystemExit(f"{args.text}: fewer than {args.length + 2} bytes")
  model = ByteLM(args.width, args.depth, args.heads, max_len=args.length)
  tokens0 = jnp.zeros((1, args.length), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(args.seed), tokens0)["params"]
  dtype = jnp.dtype(args.dtype)
  runs = {
    # fp32: no scaling. autocast: O1's dynamic scale (fp16 gradients).
    "fp32": (model.apply, jaxmp.get_preset("O0").loss_scale),
    "autocast": (
      jaxmp.autocast(model.apply, dtype),
      jaxmp.get_preset("O1" if dtype == jnp.float16 else "bf16").loss_scale,
    ),
  }
  curves, states = {}, {}
  for name, (apply_fn, loss_scale) in runs.items():
    optimizer = jaxmp.mixed_precision(
      optax.adam(args.learning_rate), loss_scale=loss_scale
    )
    step = make_train_step(apply_fn, optimizer)
    p, s = params, optimizer.init(params)
    losses = []
    for tokens in batches(
      data,
      steps=args.steps,
      batch=args.batch_size,
      length=args.length,
      seed=args.seed,
    ):
      p, s, loss = step(p, s, tokens)
      losses.append(loss)
    curves[name] = [float(x) for x in jax.device_get(losses)]
    states[name] = s

  lines = ["step\tfp32\tautocast_" + args.dtype]
  lines += [
    f"{i}\t{a:.4f}\t{b:.4f}"
    for i, (a, b) in enumerate(zip(curves["fp32"], curves["autocast"]))
  ]
  every = max(1, args.steps // 20)
  for i, line in enumerate(lines):
    if i == 0 or (i - 1) % every == 0 or i == len(lines) - 1:
      print(line)
  stats = jaxmp.stats(states["autocast"])
  print(
    f"autocast: loss scale {float(stats['loss_scale']):g}, skipped steps "
    f"{int(stats['skipped_steps'])}"
  )
  if args.out:
    with open(args.out, "w") as f:
      f.write("\n".join(lines) + "\n")
  return {"curves": curves, "params": params, "model": model, "states": states}


if __name__ == "__main__":
  main(sys.argv[1:])
