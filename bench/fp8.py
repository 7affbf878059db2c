"""Train-step time of the byte LM: ``autocast(fp8=True)`` against bf16.

Run from the repository root::

  python bench/fp8.py                          # d = 1024 and 4096
  python bench/fp8.py --widths 1024 --steps 3  # a quick look on a CPU

The model is ``examples/byte_lm_autocast.py``'s transformer (fp32 params,
Adam under ``jaxmp.mixed_precision`` with fp32 masters), at each width ``d``
(``d / 128`` heads). Both steps are jitted once, warmed up, then timed
interleaved (bf16, fp8, bf16, fp8, ...) on the same batch; the figure is the
median of the per-pair ratios ``time(bf16) / time(fp8)`` (the fp8 speed-up;
above 1 is faster), with the medians of each.

On a CPU the fp8 products are emulated (float8 converts around float32
GEMMs), so the ratio is the emulation's cost against XLA:CPU's bf16 GEMMs
(slower than its float32 ones on CPUs without bf16 instructions), not an fp8
speed-up. On a Hopper GPU XLA rewrites them to cuBLASLt fp8 GEMMs; the goal
there is >= 1.3 at d = 4096. ``bash bench/gpu.sh`` runs this comparison at
d = 4096 and prints it as ``fp8_over_bf16_step``.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position


def _block(x):
  return jax.tree.map(lambda a: a.block_until_ready(), x)


def bench_width(width, args):
  """(bf16 seconds, fp8 seconds, speed-up) medians at ``width``."""
  heads = max(1, width // 128)
  model = lm.ByteLM(width, args.depth, heads, max_len=args.length)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(
    rng.integers(0, 256, (args.batch_size, args.length + 1)), jnp.int32
  )
  params = jax.jit(model.init)(jax.random.key(0), tokens[:, :-1])["params"]
  steps = {}
  for name, fp8 in (("bf16", False), ("fp8", True)):
    optimizer = jaxmp.mixed_precision(
      optax.adam(1e-4), loss_scale=jaxmp.get_preset("bf16").loss_scale
    )
    step = lm.make_train_step(
      jaxmp.autocast(model.apply, jnp.bfloat16, fp8=fp8), optimizer
    )
    state = (params, optimizer.init(params))
    state = _block(step(*state, tokens)[:2])  # compile and warm up
    steps[name] = (step, state)
  times = {"bf16": [], "fp8": []}
  for _ in range(args.steps):
    for name in ("bf16", "fp8"):
      step, state = steps[name]
      t0 = time.perf_counter()
      state = _block(step(*state, tokens)[:2])
      times[name].append(time.perf_counter() - t0)
      steps[name] = (step, state)
  ratios = [b / f for b, f in zip(times["bf16"], times["fp8"])]
  return (
    statistics.median(times["bf16"]),
    statistics.median(times["fp8"]),
    statistics.median(ratios),
  )


def main(argv=None):
  """Prints one line per width: the step times and the fp8 speed-up."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--widths", default="1024,4096")
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--steps", type=int, default=10)
  args = parser.parse_args(argv)
  print(_common.date_line("fp8"), flush=True)
  dev = jax.devices()[0]
  print(f"device: {dev.platform} {getattr(dev, 'device_kind', '')}")
  if dev.platform == "cpu":
    print("note: on a CPU fp8 is emulated (fp32 GEMMs) and bf16 GEMMs are")
    print("slow: the ratio is no fp8 speed-up")
  out = {}
  for width in (int(w) for w in args.widths.split(",")):
    bf16, fp8, ratio = bench_width(width, args)
    out[width] = ratio
    print(
      f"d={width}: step bf16 {1e3 * bf16:.1f} ms, fp8 {1e3 * fp8:.1f} ms, "
      f"speed-up bf16/fp8 {ratio:.3f}x (batch {args.batch_size}, length "
      f"{args.length}, depth {args.depth}, {args.steps} steps)"
    )
  return out


if __name__ == "__main__":
  main(sys.argv[1:])
