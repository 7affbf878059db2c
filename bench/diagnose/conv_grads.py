"""Conv kernel gradients on CPU: XLA's with and without jaxmp's options.

XLA's under its defaults, XLA's under ``jaxmp.cpu_compiler_options()``, and
PyTorch's.

Run: ``pip install -e .[bench]`` (torch 2.13.0), then
``python bench/diagnose/conv_grads.py``  (about 2 minutes on 2 cores).

History. On jaxlib 0.10.2 the kernel gradient was the slowest op of the fp32
ResNet18 step (``bench/cpu_vs_torch.py``): 16-19x oneDNN's at the first stage
on an AMD EPYC with AVX2 (2026-12-02), so jaxmp computed it as one matrix
product per kernel tap. The cause was not XLA's algorithm but the library it
hands convolutions to: jaxlib 0.10 sends every CPU convolution to YNNPACK by
default, and XLA's own (Eigen) convolution is about 2x faster on the 2-core
machines here (AMD EPYC with AVX-512, 2026-12-03; ``jaxmp/_src/nn/compiler.py``).
With ``jaxmp.cpu_compiler_options()`` XLA's kernel gradient beats the taps at
every 3x3 shape of both ResNet18s, so ``jaxmp.nn.conv_general_dilated`` now
keeps XLA's for kernels larger than 1x1.

For the 3x3 stride-1 convolution of each ResNet18 stage at batch 128 (CIFAR
sizes: 32x32x64, 16x16x128, 8x8x256, 4x4x512), fp32, JAX jitted, torch with
``torch.nn.grad.conv2d_weight`` on all cores, repetitions interleaved, median
of each. The two JAX gradients are checked against each other first. The
last line is the worst stage's JAX/torch ratio with the options.

Measured (AMD EPYC with AVX-512, 2 cores, 2026-12-03), ms::

  stage        default  options  torch  default/torch  options/torch
  32x32x64         340      116    102           3.34           1.14
  16x16x128        217       67     58           3.72           1.15
  8x8x256          125       74     65           1.94           1.15
  4x4x512           81       53     84           0.97           0.64

``kernel_grad_over_torch: 1.15``.
"""

import os
import statistics
import sys

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import torch

import jaxmp

# bench/: the shared helpers.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

REPS = int(os.environ.get("BENCH_REPS", "5"))
BATCH = int(os.environ.get("BENCH_BATCH", "128"))
STAGES = ((32, 64), (16, 128), (8, 256), (4, 512))  # (size, channels)
_DN = ("NHWC", "HWIO", "NHWC")
_PAD = ((1, 1), (1, 1))


def _timed(fns: dict, reps: int) -> dict:
  times = _common.interleaved(fns, reps, warmup=1)
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
  opts = jax.jit(xla_grad, compiler_options=jaxmp.cpu_compiler_options())
  want = np.asarray(xla(jx, jdy))
  np.testing.assert_allclose(
    np.asarray(opts(jx, jdy)), want, rtol=1e-3, atol=1e-3 * np.abs(want).max()
  )
  tx = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())
  tdy = torch.from_numpy(dy.transpose(0, 3, 1, 2).copy())
  tshape = (channels, channels, 3, 3)
  return _timed(
    {
      "xla": lambda: xla(jx, jdy).block_until_ready(),
      "opts": lambda: opts(jx, jdy).block_until_ready(),
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
    f"{'stage':<14}{'default ms':>11}{'options ms':>11}{'torch ms':>10}"
    f"{'default/torch':>15}{'options/torch':>15}"
  )
  worst = 0.0
  for size, channels in STAGES:
    t = stage(size, channels)
    worst = max(worst, t["opts"] / t["torch"])
    print(
      f"{f'{size}x{size}x{channels}':<14}{t['xla'] * 1e3:>11.0f}"
      f"{t['opts'] * 1e3:>11.0f}{t['torch'] * 1e3:>10.0f}"
      f"{t['xla'] / t['torch']:>15.2f}{t['opts'] / t['torch']:>15.2f}",
      flush=True,
    )
  print(f"kernel_grad_over_torch: {worst:.2f}")


if __name__ == "__main__":
  main()
