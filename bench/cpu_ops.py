"""Where a CPU train step's time goes, per op, JAX against PyTorch.

Run: ``pip install -e .[bench]`` (torch 2.13.0), then
``python bench/cpu_ops.py`` (about 5 minutes on 2 cores; ``BENCH_REPS``,
``BENCH_BATCH``, ``BENCH_MODELS=cifar,torchvision`` to change it).

For every distinct convolution of both ResNet18s (the CIFAR-stem
``jaxmp.models.resnet18`` and ``resnet18_torchvision``, 64 filters, 32x32
inputs, batch 128, fp32) it times the forward, the input gradient and the
kernel gradient, as the models compute them on CPU
(``jaxmp.nn.conv_general_dilated``: XLA's convolutions, matrix-product
kernel gradients for 1x1 kernels, im2col products on maps of at most 4
pixels), against ``torch.nn.functional.conv2d``,
``torch.nn.grad.conv2d_input`` and ``conv2d_weight``; then the torchvision
stem's 3x3/2 max-pool and its gradient (``jaxmp.nn.max_pool``), BatchNorm
(``jaxmp.nn.BatchNorm``, train mode) forward and forward+backward at each
stage's shape, and the SGD-momentum update of 11.2M params. JAX is jitted; torch runs on all cores.
Repetitions are interleaved (JAX, torch, JAX, ...) and each time is a
median, so that load on a shared machine hits both sides alike.

The last line is the slowest op's JAX/torch ratio among those that take at
least 5% of the torch step (``worst_op_jax_over_torch``).

Measured on 2026-12-03, AMD EPYC with AVX-512 (2 cores, nothing else
running), jax 0.10.2, torch 2.13.0+cpu, ``BENCH_REPS=5 python
bench/cpu_ops.py``, jitted with ``jaxmp.cpu_compiler_options()`` ("x" is how
often the op runs in one step)::

  model       conv (output map)     x     forward ms  input grad ms  kernel grad ms
                                         jax / torch    jax / torch    jax / torch
  cifar       stem 3x3 32px         1    26.1/36.0      35.4/33.6      29.1/24.2
  cifar       stage1 3x3 32px       4    78.8/94.0      72.4/106.9    101.9/88.8
  cifar       stage2 3x3/2 32px     1    34.1/56.0     113.0/83.3      60.9/59.0
  cifar       stage2 3x3 16px       3    60.6/47.4      61.9/49.3      75.3/59.8
  cifar       stage2 1x1/2 32px     1     6.9/28.6      30.8/62.5       9.8/23.2
  cifar       stage3 3x3/2 16px     1    34.2/30.0      70.2/55.5      41.6/43.7
  cifar       stage3 3x3 8px        3    63.6/44.7      64.8/48.0      69.0/67.1
  cifar       stage3 1x1/2 16px     1     6.4/7.3        8.4/33.1      10.4/14.4
  cifar       stage4 3x3/2 8px      1    31.3/24.6      46.0/30.5      43.8/47.1
  cifar       stage4 3x3 4px        3    57.3/39.9      63.4/38.8      55.9/79.7
  cifar       stage4 1x1/2 8px      1     6.2/7.4        8.2/11.6       8.3/8.3
  torchvision stem 7x7/2 32px       1    10.5/4.3       22.9/20.8      14.5/4.8
  torchvision stage1 3x3 8px        4     6.5/3.1        4.0/3.4        4.8/4.4
  torchvision stage2 3x3/2 8px      1     2.1/1.7        2.5/2.4        2.9/2.3
  torchvision stage2 3x3 4px        3     7.0/2.7        7.4/2.9        7.9/5.0
  torchvision stage2 1x1/2 8px      1     0.7/0.6        0.9/1.4        0.9/0.7
  torchvision stage3 3x3/2 4px      1     5.1/2.6        4.6/4.0        6.1/6.1
  torchvision stage3 3x3 2px        3     5.7/2.9        6.9/3.0        7.4/4.9
  torchvision stage3 1x1/2 4px      1     0.7/0.7        0.8/1.6        0.6/0.9
  torchvision stage4 3x3/2 2px      1     3.8/2.9        4.2/4.2        4.0/8.9
  torchvision stage4 3x3 1px        3     6.8/2.8        4.1/2.6        8.1/10.3
  torchvision stage4 1x1/2 2px      1     0.7/0.6        0.6/1.1        0.7/0.9

  model       op                               x  jax ms  torch  ratio
  cifar       BN+ReLU forward 32x32x64         5    20.0   35.8   0.56
  cifar       BN+ReLU fwd+bwd 32x32x64         5    34.1  131.5   0.26
  cifar       BN+ReLU forward 16x16x128        5     5.0    6.8   0.74
  cifar       BN+ReLU fwd+bwd 16x16x128        5    11.1   30.6   0.36
  cifar       BN+ReLU forward 8x8x256          5     3.1    7.2   0.43
  cifar       BN+ReLU fwd+bwd 8x8x256          5     6.9   15.1   0.45
  cifar       BN+ReLU forward 4x4x512          5     0.9    2.2   0.42
  cifar       BN+ReLU fwd+bwd 4x4x512          5     1.9    5.2   0.36
  cifar       SGD-momentum update              1     7.1    8.0   0.90
  cifar       sum over one step                   3666.0 4224.0   0.87
  torchvision max-pool forward                 1     4.1    9.4   0.44
  torchvision max-pool fwd+grad                1    17.4   10.7   1.62
  torchvision BN+ReLU forward 16x16x64         1     2.1    4.0   0.54
  torchvision BN+ReLU fwd+bwd 16x16x64         1     6.2    9.8   0.63
  torchvision BN+ReLU forward 8x8x64           4     0.6    0.9   0.68
  torchvision BN+ReLU fwd+bwd 8x8x64           4     1.1    2.0   0.54
  torchvision BN+ReLU forward 4x4x128          5     0.7    0.7   0.98
  torchvision BN+ReLU fwd+bwd 4x4x128          5     1.0    1.5   0.67
  torchvision BN+ReLU forward 2x2x256          5     0.4    0.5   0.87
  torchvision BN+ReLU fwd+bwd 2x2x256          5     0.7    2.0   0.34
  torchvision BN+ReLU forward 1x1x512          5     0.2    0.1   2.02
  torchvision BN+ReLU fwd+bwd 1x1x512          5     0.4    0.3   1.29
  torchvision SGD-momentum update              1     7.4    8.3   0.90
  torchvision sum over one step                    381.0  285.0   1.34

What it says:

* With XLA's own convolutions (the options) every CIFAR-stem op is within
  1.0-1.6x of PyTorch and the stage-1 convolutions and every BatchNorm are
  faster; the sum over one step is 0.87x torch's. The rest of the JAX
  step's time is outside these ops (``bench/cpu_vs_torch.py`` times the
  whole step).
* Without the options (``BENCH_COMPILER_OPTIONS=0``, YNNPACK's
  convolutions) the same run's stage-1 3x3 forward was 177 ms, its input
  gradient 163 ms and the kernel gradient (then per-tap products) 260 ms:
  1.9x, 1.4x and 2.2x torch.
* Left: the 3x3 convolutions of the later CIFAR stages (1.3-1.6x) and the
  strided input gradients (1.4-1.5x); the torchvision stem's 7x7/2 forward
  and kernel gradient (2.5-3x, 10-15 ms against 4-5 ms) and the 2-16 pixel
  maps of its later stages (1.5-2.6x, a few ms each); its max-pool gradient
  (1.6x; flax's select-and-scatter took 49-59 ms). The torchvision model's
  whole step still beats torch's, whose per-op overhead is larger on such
  small maps.
"""

import functools
import os
import statistics
import sys

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import jaxmp
from jaxmp import nn as jaxmp_nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

REPS = int(os.environ.get("BENCH_REPS", "5"))
BATCH = int(os.environ.get("BENCH_BATCH", "128"))
MODELS = os.environ.get("BENCH_MODELS", "cifar,torchvision").split(",")
# As the app jits: with jaxmp.cpu_compiler_options() (BENCH_COMPILER_OPTIONS=0
# for XLA:CPU's defaults).
OPTIONS = (
  jaxmp.cpu_compiler_options()
  if os.environ.get("BENCH_COMPILER_OPTIONS", "1") == "1"
  else {}
)
_jit = functools.partial(jax.jit, compiler_options=OPTIONS or None)
_DN = ("NHWC", "HWIO", "NHWC")

# (model, name, input size, in channels, out channels, kernel, stride, pad)
CONVS = {
  "cifar": (
    ("stem 3x3", 32, 3, 64, 3, 1, 1),
    ("stage1 3x3", 32, 64, 64, 3, 1, 1),
    ("stage2 3x3/2", 32, 64, 128, 3, 2, 1),
    ("stage2 3x3", 16, 128, 128, 3, 1, 1),
    ("stage2 1x1/2", 32, 64, 128, 1, 2, 0),
    ("stage3 3x3/2", 16, 128, 256, 3, 2, 1),
    ("stage3 3x3", 8, 256, 256, 3, 1, 1),
    ("stage3 1x1/2", 16, 128, 256, 1, 2, 0),
    ("stage4 3x3/2", 8, 256, 512, 3, 2, 1),
    ("stage4 3x3", 4, 512, 512, 3, 1, 1),
    ("stage4 1x1/2", 8, 256, 512, 1, 2, 0),
  ),
  "torchvision": (
    ("stem 7x7/2", 32, 3, 64, 7, 2, 3),
    ("stage1 3x3", 8, 64, 64, 3, 1, 1),
    ("stage2 3x3/2", 8, 64, 128, 3, 2, 1),
    ("stage2 3x3", 4, 128, 128, 3, 1, 1),
    ("stage2 1x1/2", 8, 64, 128, 1, 2, 0),
    ("stage3 3x3/2", 4, 128, 256, 3, 2, 1),
    ("stage3 3x3", 2, 256, 256, 3, 1, 1),
    ("stage3 1x1/2", 4, 128, 256, 1, 2, 0),
    ("stage4 3x3/2", 2, 256, 512, 3, 2, 1),
    ("stage4 3x3", 1, 512, 512, 3, 1, 1),
    ("stage4 1x1/2", 2, 256, 512, 1, 2, 0),
  ),
}
# How often each conv runs in one forward pass of the model.
COUNT = {
  "stem": 1,
  "stage1 3x3": 4,
  "3x3/2": 1,
  "stage2 3x3": 3,
  "stage3 3x3": 3,
  "stage4 3x3": 3,
  "1x1/2": 1,
}
BN = {
  "cifar": ((32, 64, 5), (16, 128, 5), (8, 256, 5), (4, 512, 5)),
  "torchvision": (
    (16, 64, 1),
    (8, 64, 4),
    (4, 128, 5),
    (2, 256, 5),
    (1, 512, 5),
  ),
}


def _count(name: str) -> int:
  for key, n in COUNT.items():
    if key in name:
      return n
  return 1


def _timed(pairs: dict, reps: int) -> dict:
  """{name: (jax_fn, torch_fn)} -> {name: (jax_s, torch_s)}, interleaved."""
  fns = {(k, i): fn for k, pair in pairs.items() for i, fn in enumerate(pair)}
  times = _common.interleaved(fns, reps, warmup=1)
  return {
    k: (statistics.median(times[k, 0]), statistics.median(times[k, 1]))
    for k in pairs
  }


def conv_pairs(size, cin, cout, k, stride, pad) -> dict:
  """Forward, input gradient and kernel gradient of one convolution."""
  rng = np.random.default_rng(0)
  out = (size + 2 * pad - k) // stride + 1
  x = rng.standard_normal((BATCH, size, size, cin), np.float32)
  w = rng.standard_normal((k, k, cin, cout), np.float32) * 0.05
  dy = rng.standard_normal((BATCH, out, out, cout), np.float32)
  jx, jw, jdy = map(jnp.asarray, (x, w, dy))
  padding = ((pad, pad), (pad, pad))

  def conv(x, w):
    return jaxmp_nn.conv_general_dilated(
      x, w, (stride, stride), padding, dimension_numbers=_DN
    )

  fwd = _jit(conv)
  dx = _jit(lambda x, w, dy: jax.vjp(lambda x: conv(x, w), x)[1](dy)[0])
  dw = _jit(lambda x, w, dy: jax.vjp(lambda w: conv(x, w), w)[1](dy)[0])
  # The rewrite is exact against lax (tests/test_conv.py); check the shapes.
  want = lax.conv_general_dilated(
    jx, jw, (stride, stride), padding, dimension_numbers=_DN
  )
  assert fwd(jx, jw).shape == want.shape == jdy.shape
  tx = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())
  tw = torch.from_numpy(w.transpose(3, 2, 0, 1).copy())
  tdy = torch.from_numpy(dy.transpose(0, 3, 1, 2).copy())
  F = torch.nn.functional
  return {
    "forward": (
      lambda: fwd(jx, jw).block_until_ready(),
      lambda: F.conv2d(tx, tw, stride=stride, padding=pad),
    ),
    "input grad": (
      lambda: dx(jx, jw, jdy).block_until_ready(),
      lambda: torch.nn.grad.conv2d_input(
        tx.shape, tw, tdy, stride=stride, padding=pad
      ),
    ),
    "kernel grad": (
      lambda: dw(jx, jw, jdy).block_until_ready(),
      lambda: torch.nn.grad.conv2d_weight(
        tx, tw.shape, tdy, stride=stride, padding=pad
      ),
    ),
  }


def maxpool_pairs() -> dict:
  """The torchvision stem's 3x3 stride-2 max-pool, 16x16x64 -> 8x8x64."""
  x = np.random.default_rng(0).standard_normal((BATCH, 16, 16, 64), np.float32)
  dy = np.random.default_rng(1).standard_normal((BATCH, 8, 8, 64), np.float32)
  jx, jdy = jnp.asarray(x), jnp.asarray(dy)
  pool = lambda x: jaxmp_nn.max_pool(
    x, (3, 3), strides=(2, 2), padding=((1, 1),) * 2
  )
  fwd = _jit(pool)
  bwd = _jit(lambda x, dy: jax.vjp(pool, x)[1](dy)[0])
  tx = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()).requires_grad_()
  tdy = torch.from_numpy(dy.transpose(0, 3, 1, 2).copy())
  tpool = torch.nn.MaxPool2d(3, 2, 1)

  def torch_bwd():
    tx.grad = None
    tpool(tx).backward(tdy)

  return {
    "max-pool forward": (
      lambda: fwd(jx).block_until_ready(),
      lambda: tpool(tx.detach()),
    ),
    "max-pool fwd+grad": (
      lambda: bwd(jx, jdy).block_until_ready(),
      torch_bwd,
    ),
  }


def bn_pairs(size: int, channels: int) -> dict:
  """Train-mode BatchNorm + ReLU forward, and forward + backward."""
  x = np.random.default_rng(0).standard_normal(
    (BATCH, size, size, channels), np.float32
  )
  jx = jnp.asarray(x)
  bn = jaxmp_nn.BatchNorm(use_running_average=False, momentum=0.9)
  variables = bn.init(jax.random.key(0), jx)
  params, stats = variables["params"], variables["batch_stats"]

  def f(params, x):
    y, _ = bn.apply(
      {"params": params, "batch_stats": stats},
      x,
      relu=True,
      mutable=["batch_stats"],
    )
    return y

  fwd = _jit(f)
  grad = _jit(jax.grad(lambda p, x: jnp.sum(f(p, x) ** 2), argnums=(0, 1)))
  tbn = torch.nn.BatchNorm2d(channels).train()
  tx = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()).requires_grad_()

  def torch_fb():
    tx.grad = None
    tbn.zero_grad(set_to_none=True)
    (torch.relu(tbn(tx)) ** 2).sum().backward()

  def torch_f():
    with torch.no_grad():
      torch.relu(tbn(tx))

  return {
    "BN+ReLU forward": (lambda: fwd(params, jx).block_until_ready(), torch_f),
    "BN+ReLU fwd+bwd": (
      lambda: jax.block_until_ready(grad(params, jx)),
      torch_fb,
    ),
  }


def update_pairs() -> dict:
  """SGD momentum 0.9 on 11.2M fp32 params, donated state."""
  n = 11_173_962
  rng = np.random.default_rng(0)
  p = rng.standard_normal(n, np.float32)
  g = rng.standard_normal(n, np.float32) * 1e-3
  opt = optax.sgd(0.1, momentum=0.9)

  @functools.partial(_jit, donate_argnums=(0, 1))
  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  holder = {"p": jnp.asarray(p), "g": jnp.asarray(g)}
  holder["s"] = opt.init(holder["p"])

  def jax_fn():
    holder["p"], holder["s"] = step(holder["p"], holder["s"], holder["g"])
    jax.block_until_ready(holder["p"])

  tp = torch.nn.Parameter(torch.from_numpy(p.copy()))
  tp.grad = torch.from_numpy(g.copy())
  sgd = torch.optim.SGD([tp], lr=0.1, momentum=0.9)
  return {"SGD-momentum update": (jax_fn, sgd.step)}


def main():
  torch.set_num_threads(os.cpu_count())
  print(_common.date_line("cpu_ops"), flush=True)
  cpu = _common.cpu_name()
  print(
    f"jax {jax.__version__}, torch {torch.__version__}, {os.cpu_count()} "
    f"cpus, {cpu}; batch {BATCH}, fp32, {REPS} interleaved reps, median; "
    f"compiler_options={OPTIONS}"
  )
  print(
    f"{'model':<12}{'op':<36}{'x/step':>7}{'jax ms':>9}{'torch ms':>10}"
    f"{'jax/torch':>10}"
  )
  worst = (0.0, "")
  for model in MODELS:
    rows = []
    for name, size, cin, cout, k, stride, pad in CONVS[model]:
      for op, t in _timed(
        conv_pairs(size, cin, cout, k, stride, pad), REPS
      ).items():
        rows.append((f"conv {name} {size}px {op}", _count(name), *t))
    if model == "torchvision":
      for op, t in _timed(maxpool_pairs(), REPS).items():
        rows.append((op, 1, *t))
    for size, channels, n in BN[model]:
      for op, t in _timed(bn_pairs(size, channels), REPS).items():
        rows.append((f"{op} {size}x{size}x{channels}", n, *t))
    for op, t in _timed(update_pairs(), REPS).items():
      rows.append((op, 1, *t))
    # A step: every conv's forward, input and kernel gradient; the pool's
    # and BatchNorm's forward+backward (their forward rows are included in
    # those); the update.
    in_step = [
      not op.startswith(("max-pool forward", "BN+ReLU forward"))
      for op, *_ in rows
    ]
    total_torch = sum(r[1] * r[3] for r, i in zip(rows, in_step) if i)
    total_jax = sum(r[1] * r[2] for r, i in zip(rows, in_step) if i)
    for (op, n, tj, tt), i in zip(rows, in_step):
      print(
        f"{model:<12}{op:<36}{n:>7}{tj * 1e3:>9.1f}{tt * 1e3:>10.1f}"
        f"{tj / tt:>10.2f}",
        flush=True,
      )
      if i and n * tt >= 0.05 * total_torch and tj / tt > worst[0]:
        worst = (tj / tt, f"{model} {op}")
    print(
      f"{model:<12}{'sum over one step':<36}{'':>7}"
      f"{total_jax * 1e3:>9.0f}{total_torch * 1e3:>10.0f}"
      f"{total_jax / total_torch:>10.2f}",
      flush=True,
    )
  print(f"worst op: {worst[1]}")
  print(f"worst_op_jax_over_torch: {worst[0]:.2f}")


if __name__ == "__main__":
  sys.exit(main())
