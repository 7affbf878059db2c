"""The byte LM trained in bf16, fp8 and the block-scaled recipes: loss gaps.

Run from the repository root::

  python bench/block_scaled.py                 # 150 steps, d = 128
  python bench/block_scaled.py --steps 30      # a quick look

The model is ``examples/byte_lm_autocast.py``'s transformer (fp32 params,
Adam under ``jaxmp.mixed_precision`` with fp32 masters), trained from the
same params on the same batches of the repository's README and docs pages
under ``jaxmp.autocast(model.apply, jnp.bfloat16, fp8=...)`` with:

* ``bf16``: no fp8 (``fp8=False``);
* ``fp8``: per-tensor current scaling (``fp8=True``);
* ``mxfp8``, ``deepseek``, ``nvfp4``: the block-scaled presets
  (``fp8="mxfp8"`` ...);
* ``nvfp4 (head bf16)``: ``BlockRecipe.nvfp4(keep=("head",))``, the output
  projection kept in bf16 as NVIDIA's recipe keeps the last layers.

It prints one Markdown row per run: the mean held-out loss after training
(the last tenth of the corpus, never trained on), its gap to bf16's, and
the median step time on this machine. On a CPU every fp8 and fp4 product
is emulated (quantize, dequantize, float32 product): the times are the
emulation's cost, not a speed-up; the losses are the recipes' own.
"""

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp

sys.path.insert(
  0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
)
import byte_lm_autocast as lm  # noqa: E402
from byte_lm_fp8 import default_corpus  # noqa: E402

RUNS = {
  "bf16": False,
  "fp8": True,
  "mxfp8": "mxfp8",
  "deepseek": "deepseek",
  "nvfp4": "nvfp4",
  "nvfp4 (head bf16)": jaxmp.BlockRecipe.nvfp4(keep=("head",)),
}


def main(argv=None) -> dict:
  """Trains every run; returns ``{name: (final loss, median step s)}``."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--length", type=int, default=64)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--learning-rate", type=float, default=2e-3)
  parser.add_argument("--eval-batches", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--runs", default=",".join(RUNS), help="comma-separated names of RUNS"
  )
  args = parser.parse_args(argv)

  data = np.frombuffer(default_corpus(), np.uint8)
  split = len(data) - len(data) // 10
  train, held_out = data[:split], data[split:]
  kw = dict(batch=args.batch_size, length=args.length)
  evals = list(lm.batches(held_out, steps=args.eval_batches, seed=1, **kw))
  model = lm.ByteLM(args.width, args.depth, args.heads, max_len=args.length)
  params = jax.jit(model.init)(
    jax.random.key(args.seed), jnp.zeros((1, args.length), jnp.int32)
  )["params"]
  out = {}
  print("| run | held-out loss | vs bf16 | step (ms) |")
  print("|---|---|---|---|")
  for name in args.runs.split(","):
    apply_fn = jaxmp.autocast(model.apply, jnp.bfloat16, fp8=RUNS[name])
    optimizer = jaxmp.mixed_precision(
      optax.adam(args.learning_rate),
      loss_scale=jaxmp.get_preset("bf16").loss_scale,
    )
    step = lm.make_train_step(apply_fn, optimizer)
    p, s = params, optimizer.init(params)
    times = []
    for i, tokens in enumerate(
      lm.batches(train, steps=args.steps, seed=args.seed, **kw)
    ):
      t0 = time.perf_counter()
      p, s, loss = step(p, s, tokens)
      loss.block_until_ready()
      if i:  # the first step compiles
        times.append(time.perf_counter() - t0)
    evaluate = jax.jit(lambda p, t, f=apply_fn: lm.loss_fn(f, p, t))
    final = float(np.mean([evaluate(p, t) for t in evals]))
    ms = 1e3 * statistics.median(times) if times else float("nan")
    out[name] = (final, ms)
    base = out.get("bf16", (final,))[0]
    print(
      f"| {name} | {final:.4f} | {100 * (final / base - 1):+.1f}% | {ms:.0f} |"
    )
    sys.stdout.flush()
  return out


if __name__ == "__main__":
  main(sys.argv[1:])
