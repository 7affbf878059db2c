"""The byte-level transformer LM trained under autocast bf16 and fp8.

The model of ``byte_lm_autocast.py`` (written in fp32, no precision code), at
a width where matrix products dominate the step, trained twice from the same
params on the same batches:

* ``bf16``: ``jaxmp.autocast(model.apply, jnp.bfloat16)``;
* ``fp8``: ``jaxmp.autocast(model.apply, jnp.bfloat16, fp8=True)``: every
  matrix product on float8_e4m3fn operands with per-tensor current scaling,
  its output cotangent in float8_e5m2, everything else as in bf16.

It prints both loss curves and the gap between their final losses (the mean
of the last tenth of the steps). On a CPU the fp8 products are emulated
(slower than bf16); on a Hopper GPU XLA runs them as fp8 GEMMs.

Run (the corpus defaults to this file's own bytes)::

    python examples/byte_lm_fp8.py --steps 300
"""

import argparse
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


def final_loss(curve: Sequence[float]) -> float:
  """The mean loss of the last tenth of the steps (at least one)."""
  n = max(1, len(curve) // 10)
  return float(np.mean(curve[-n:]))


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
  """Trains the bf16 and the fp8 run; returns both loss curves."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--text", default=lm.__file__, help="corpus (bytes)")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--length", type=int, default=64)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  with open(args.text, "rb") as f:
    data = np.frombuffer(f.read(), np.uint8)
  if len(data) < args.length + 2:
    raise SystemExit(f"{args.text}: fewer than {args.length + 2} bytes")
  model = lm.ByteLM(args.width, args.depth, args.heads, max_len=args.length)
  tokens0 = jnp.zeros((1, args.length), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(args.seed), tokens0)["params"]
  runs = {
    "bf16": jaxmp.autocast(model.apply, jnp.bfloat16),
    "fp8": jaxmp.autocast(model.apply, jnp.bfloat16, fp8=True),
  }
  curves, states = {}, {}
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

  every = max(1, args.steps // 20)
  print("step\tbf16\tfp8")
  for i, (a, b) in enumerate(zip(curves["bf16"], curves["fp8"])):
    if i % every == 0 or i == args.steps - 1:
      print(f"{i}\t{a:.4f}\t{b:.4f}")
  bf16, fp8 = final_loss(curves["bf16"]), final_loss(curves["fp8"])
  gap = fp8 / bf16 - 1.0
  skipped = int(jaxmp.stats(states["fp8"])["skipped_steps"])
  print(
    f"final loss (mean of the last tenth): bf16 {bf16:.4f}, fp8 {fp8:.4f} "
    f"({100 * gap:+.2f}%); fp8 skipped steps {skipped}"
  )
  return {"curves": curves, "gap": gap, "skipped": skipped}


if __name__ == "__main__":
  main(sys.argv[1:])
