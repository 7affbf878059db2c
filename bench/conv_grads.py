"""Conv kernel gradients on CPU: XLA's, jaxmp's per-tap matmuls, PyTorch's.

Run: ``pip install -e .[bench]`` (torch 2.13.0), then
``python bench/conv_grads.py``  (about 2 minutes on 2 cores).

Why: the fp32 ResNet18 train step ran 3.6x slower in JAX than in PyTorch on
this CPU (``bench/cpu_vs_torch.py``). Timing each convolution of one layer
apart (forward, input gradient, kernel gradient) puts almost all of the gap in
one place: XLA:CPU computes a kernel gradient as a spatial convolution whose
window is the whole feature map, 16-19x slower than oneDNN's at the first
stage, while forward and input gradient are within 1.6x. jaxmp's ResNet
computes it instead as one matrix product per kernel tap
(``jaxmp.nn.conv_general_dilated``, whose kernel gradient takes that path
on CPU; used when ``ResNet.tap_kernel_grads`` is on, the default).

For the 3x3 stride-1 convolution of each ResNet18 stage at batch 128 (CIFAR
sizes: 32x32x64, 16x16x128, 8x8x256, 4x4x512), fp32, JAX jitted, torch with
``torch.nn.grad.conv2d_weight`` on all cores, repetitions interleaved, median
of each. The taps are checked against XLA's gradient first. The last line is
the worst stage's ``taps / torch`` time ratio.
"""

import os
import statistics
import time

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import torch

from jaxmp import nn as jaxmp_nn

REPS = int(os.environ.get("BENCH_REPS", "5"))
BATCH = int(os.environ.get("BENCH_BATCH", "128"))
STAGES = ((32, 64), (16, 128), (8, 256), (4, 512))  # (size, channels)
_DN = ("NHWC", "HWIO", "NHWC")
_PAD = ((1, 1), (1, 1))


def _timed(fns: dict, reps: int) -> dict:
  for fn in fns.values():  # Warm-up: compile, touch memory.
    fn()
  times = {k: [] for k in fns}
  for _ in range(reps):
    for k, fn in fns.items():
      t = time.perf_counter()
      fn()
      times[k].append(time.perf_counter() - t)
  return {k: statistics.median(v) for k, v in times.items()}


def stage(size: int, channels: int) -> dict:
  rng = np.random.default_rng(0)
  x = rng.standard_normal((BATCH, size, size, channels), np.float32)
  dy = rng.standard_normal((BATCH, size, size, channels), np.float32)
  w = rng.standard_normal((3, 3, channels, channels), np.float32) * 0.05
  jx, jdy, jw = jnp.asarray(x), jnp.asarray(dy), jnp.asarray(w)

  def xla_grad(x, dy):
    def f(w):
      return lax.conv_general_dilated(x, w, (1, 1), _PAD, dimension_numbers=_DN)

    return jax.vjp(f, jw)[1](dy)[0]

  xla = jax.jit(xla_grad)

  def taps_grad(x, dy):
    def f(w):
      return jaxmp_nn.conv_general_dilated(
        x, w, (1, 1), _PAD, dimension_numbers=_DN
      )

    return jax.vjp(f, jw)[1](dy)[0]

  taps = jax.jit(taps_grad)
  want = np.asarray(xla(jx, jdy))
  np.testing.assert_allclose(
    np.asarray(taps(jx, jdy)), want, rtol=1e-3, atol=1e-3 * np.abs(want).max()
  )
  tx = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())
  tdy = torch.from_numpy(dy.transpose(0, 3, 1, 2).copy())
  tshape = (channels, channels, 3, 3)
  return _timed(
    {
      "xla": lambda: xla(jx, jdy).block_until_ready(),
      "taps": lambda: taps(jx, jdy).block_until_ready(),
      "torch": lambda: torch.nn.grad.conv2d_weight(tx, tshape, tdy, padding=1),
    },
    REPS,
  )


def main():
  torch.set_num_threads(os.cpu_count())
  print(
    f"jax {jax.__version__}, torch {torch.__version__}, "
    f"{os.cpu_count()} cpus; 3x3 conv kernel gradient, batch {BATCH}, "
    f"fp32, {REPS} interleaved reps, median"
  )
  print(
    f"{'stage':<14}{'xla ms':>9}{'taps ms':>9}{'torch ms':>10}"
    f"{'xla/torch':>11}{'taps/torch':>12}"
  )
  worst = 0.0
  for size, channels in STAGES:
    t = stage(size, channels)
    worst = max(worst, t["taps"] / t["torch"])
    print(
      f"{f'{size}x{size}x{channels}':<14}{t['xla'] * 1e3:>9.0f}"
      f"{t['taps'] * 1e3:>9.0f}{t['torch'] * 1e3:>10.0f}"
      f"{t['xla'] / t['torch']:>11.2f}{t['taps'] / t['torch']:>12.2f}",
      flush=True,
    )
  print(f"kernel_grad_taps_over_torch: {worst:.2f}")


if __name__ == "__main__":
  main()
