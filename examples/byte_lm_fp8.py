"""The byte-level transformer LM trained under autocast bf16 and fp8.

The model of ``byte_lm_autocast.py`` (written in fp32, no precision code), at
a width where matrix products dominate the step, trained twice from the same
params on the same batches:

* ``bf16``: ``jaxmp.autocast(model.apply, jnp.bfloat16)``;
* ``fp8``: ``jaxmp.autocast(model.apply, jnp.bfloat16, fp8=True)``: every
  matrix product on float8_e4m3fn operands with per-tensor current scaling,
  its output cotangent in float8_e5m2, everything else as in bf16.

It prints both training curves and the gap between their final losses: the
mean loss of each trained model on the same held-out batches (the last tenth
of the corpus, never trained on). On a CPU the fp8 products are emulated
(slower than bf16); on a Hopper GPU XLA runs them as fp8 GEMMs.

Run (the corpus defaults to the repository's README and docs pages, ~130 kB)::

    python examples/byte_lm_fp8.py --steps 300
    python examples/byte_lm_fp8.py --text some_file.txt
"""

import argparse
import glob
import os
import sys
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import byte_lm_autocast as lm  # noqa: E402  (the model, the batches)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_corpus() -> bytes:
  """The README and the docs pages, concatenated (sorted by path)."""
  paths = [os.path.join(ROOT, "README.md")]
  paths += sorted(
    glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
  )
  out = b""
  for path in paths:
    if os.path.exists(path):
      with open(path, "rb") as f:
        out += f.read()
  return out


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
  """Trains the bf16 and the fp8 run; returns both loss curves."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--text", default="", help="corpus file (bytes)")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--length", type=int, default=64)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--eval-batches", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  if args.text:
    with open(args.text, "rb") as f:
      corpus = f.read()
  else:
    corpus = default_corpus()
  data = np.frombuffer(corpus, np.uint8)
  split = len(data) - len(data) // 10
  train, held_out = data[:split], data[split:]
  if min(len(train), len(held_out)) < args.length + 2:
    raise SystemExit(f"corpus of {len(data)} bytes: too small to split")
  eval_batches = list(
    lm.batches(
      held_out,
      steps=args.eval_batches,
      batch=args.batch_size,
      length=args.length,
      seed=args.seed + 1,
    )
  )
  model = lm.ByteLM(args.width, args.depth, args.heads, max_len=args.length)
  tokens0 = jnp.zeros((1, args.length), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(args.seed), tokens0)["params"]
  runs = {
    "bf16": jaxmp.autocast(model.apply, jnp.bfloat16),
    "fp8": jaxmp.autocast(model.apply, jnp.bfloat16, fp8=True),
  }
  curves, states, finals = {}, {}, {}
  for name, apply_fn in runs.items():
    # bf16 gradients need no loss scale; the fp8 cotangents are scaled per
    # tensor. The transform keeps fp32 masters and skips non-finite steps.
    optimizer = jaxmp.mixed_precision(
      optax.adam(args.learning_rate),
      loss_scale=jaxmp.get_preset("bf16").loss_scale,
    )
    step = lm.make_train_step(apply_fn, optimizer)
    p, s = params, optimizer.init(params)
    losses = []
    for tokens in lm.batches(
      train,
      steps=args.steps,
      batch=args.batch_size,
      length=args.length,
      seed=args.seed,
    ):
      p, s, loss = step(p, s, tokens)
      losses.append(loss)
    curves[name] = [float(x) for x in jax.device_get(losses)]
    states[name] = s
    # The held-out loss of the trained model, computed as it was trained.
    evaluate = jax.jit(lambda p, t, f=apply_fn: lm.loss_fn(f, p, t))
    finals[name] = float(np.mean([evaluate(p, t) for t in eval_batches]))

  every = max(1, args.steps // 20)
  print("step\tbf16\tfp8")
  for i, (a, b) in enumerate(zip(curves["bf16"], curves["fp8"])):
    if i % every == 0 or i == args.steps - 1:
      print(f"{i}\t{a:.4f}\t{b:.4f}")
  bf16, fp8 = finals["bf16"], finals["fp8"]
  gap = fp8 / bf16 - 1.0
  skipped = int(jaxmp.stats(states["fp8"])["skipped_steps"])
  print(
    f"final held-out loss: bf16 {bf16:.4f}, fp8 {fp8:.4f} "
    f"({100 * gap:+.2f}%); fp8 skipped steps {skipped}"
  )
  return {"curves": curves, "final": finals, "gap": gap, "skipped": skipped}


if __name__ == "__main__":
  main(sys.argv[1:])
