"""The seed's PyTorch loop and configs/seed.py, side by side, same weights.

Run: ``pip install -e .[bench]`` (torch), then
``python bench/seed_side_by_side.py`` (defaults: batch 16, 20 steps, the
full-width network; about a minute on 2 CPU cores, most of it XLA compiles).
``--batch 128`` is the seed's batch.

PyTorch: ``bench/_torch_resnet.py``'s ``torchvision_resnet18(10)``
(torchvision's own model when torchvision imports, else the copy of its
architecture there; the first line says which), ``SGD(lr=0.1,
momentum=0.9)``, cross-entropy, fp32, train mode.

JAX: the app's own train step (``cifar_train.steps``) on
``configs/seed.py``'s settings (``resnet18_torchvision``, SGD 0.1/0.9, no
weight decay, constant lr) through ``jaxmp.mixed_precision``, once in fp32
(O0) and once in the seed's O1, started from torch's initial weights through
``jaxmp.models.to_torchvision``'s inverse ``from_torchvision`` (the path of
``--config.init_from``).

Both see the same batches, sliced in order from one synthetic uint8 array
(no shuffling, no augmentation), normalised as ``Normalize(0.5, 0.5)``.
It prints the three loss curves and, per JAX run, the largest relative
difference from torch's losses. Chaotic growth of rounding differences over
training makes later steps differ more.
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxmp import models
import jaxmp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # pylint: disable=g-import-not-at-top,wrong-import-position
from _torch_resnet import torchvision_resnet18  # pylint: disable=g-import-not-at-top,wrong-import-position
from cifar_train import settings as settings_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from cifar_train import steps  # pylint: disable=g-import-not-at-top,wrong-import-position
from configs import seed  # pylint: disable=g-import-not-at-top,wrong-import-position

NUM_CLASSES = 10


def synthetic_batches(num_steps: int, batch: int, data_seed: int):
  """``num_steps`` batches of normalised NHWC images and labels, in order.

  Each class has its own mean colour, so the loss moves as on real data.
  """
  rng = np.random.default_rng(data_seed)
  labels = rng.integers(0, NUM_CLASSES, num_steps * batch)
  colours = rng.integers(40, 216, (NUM_CLASSES, 3))
  noise = rng.integers(-40, 40, (num_steps * batch, 32, 32, 3))
  images = np.clip(colours[labels][:, None, None, :] + noise, 0, 255)
  x = (images.astype(np.float32) / 255.0 - 0.5) / 0.5  # Normalize(0.5, 0.5)
  for i in range(num_steps):
    sl = slice(i * batch, (i + 1) * batch)
    yield x[sl], labels[sl].astype(np.int32)


def torch_losses(net, batches, channels_last=False) -> list[float]:
  """The seed's loop: SGD 0.1/0.9, cross-entropy, fp32, train mode.

  ``channels_last`` runs the same math in NHWC memory (other oneDNN kernels,
  another reduction order): the fp32 noise floor of the comparison.
  """
  fmt = torch.channels_last if channels_last else torch.contiguous_format
  net = net.to(memory_format=fmt)
  opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
  loss_fn = torch.nn.CrossEntropyLoss()
  net.train()
  losses = []
  for x, y in batches:
    opt.zero_grad(set_to_none=True)
    x = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())
    loss = loss_fn(
      net(x.contiguous(memory_format=fmt)),
      torch.from_numpy(y.astype(np.int64)),
    )
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))
  return losses


def jax_losses(policy: str, variables, batches, filters: int):
  """configs/seed.py's train step under ``policy``, from ``variables``."""
  config = seed.get_config()
  config.policy = policy
  config.num_filters = filters
  s = settings_lib.resolve(config)
  model = steps.create_model(
    s.model,
    num_classes=NUM_CLASSES,
    num_filters=s.num_filters,
    precision=s.precision,
  )
  optimizer = steps.create_optimizer(
    s.precision,
    s.learning_rate,
    momentum=s.momentum,
    nesterov=s.nesterov,
    weight_decay=s.weight_decay,
  )
  state = steps.create_train_state(model, optimizer, (32, 32, 3), seed=0)
  state = steps.with_initial_weights(state, optimizer, variables)
  step = jax.jit(
    steps.make_train_step(
      model, optimizer, compute_dtype=s.precision.compute_dtype
    ),
    donate_argnums=0,
  )
  losses = []
  for x, y in batches:
    state, metrics = step(
      state, jnp.asarray(x), jnp.asarray(y), steps.zero_metrics()
    )
    losses.append(float(metrics["last_loss"]))
  stats = jax.device_get(jaxmp.stats(state.opt_state))
  return losses, stats


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--filters", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  print(_common.date_line("seed_side_by_side"), flush=True)

  torch.manual_seed(args.seed)
  net = torchvision_resnet18(NUM_CLASSES)
  if args.filters != 64:
    # Narrow nets exist only in the copy; torchvision's own is 64 wide.
    from _torch_resnet import TorchvisionResNet18  # pylint: disable=g-import-not-at-top

    net = TorchvisionResNet18(NUM_CLASSES, args.filters)
  kind = f"{type(net).__module__}.{type(net).__name__}"
  print(
    f"torch model: {kind} (torch {torch.__version__}), jax {jax.__version__}"
  )
  print(
    f"batch {args.batch}, {args.steps} steps, {args.filters} filters, "
    "SGD 0.1/0.9, Normalize(0.5, 0.5), synthetic 32x32 data"
  )
  initial = {k: v.clone() for k, v in net.state_dict().items()}
  variables = models.from_torchvision(initial)
  batches = list(synthetic_batches(args.steps, args.batch, args.seed))

  t = time.time()
  curves = {"torch fp32": torch_losses(net, batches)}
  print(f"torch: {time.time() - t:.1f} s per run")
  net.load_state_dict(initial)
  curves["torch NHWC"] = torch_losses(net, batches, channels_last=True)
  for policy in ("O0", "O1"):
    t = time.time()
    losses, stats = jax_losses(policy, variables, batches, args.filters)
    curves[f"jax {policy}"] = losses
    print(
      f"jax {policy}: {time.time() - t:.1f} s (compile included), "
      f"loss scale {float(stats['loss_scale']):g}, "
      f"skipped steps {int(stats['skipped_steps'])}"
    )

  names = list(curves)
  print("step " + " ".join(f"{n:>12}" for n in names))
  for i in range(args.steps):
    print(f"{i + 1:4d} " + " ".join(f"{curves[n][i]:12.6f}" for n in names))
  ref = np.asarray(curves["torch fp32"], np.float64)
  rel = {
    n: np.abs(np.asarray(curves[n], np.float64) - ref) / np.abs(ref)
    for n in names[1:]
  }
  print("relative difference from torch fp32, largest over steps 1..k:")
  print("   k " + " ".join(f"{n:>12}" for n in rel))
  for k in sorted({1, 2, 3, 5, 10, args.steps} & set(range(1, args.steps + 1))):
    print(f"{k:4d} " + " ".join(f"{rel[n][:k].max():12.2e}" for n in rel))
  for n in rel:
    print(
      f"{n} vs torch fp32: largest relative loss difference "
      f"{rel[n].max():.2e} (step {int(rel[n].argmax()) + 1})"
    )


if __name__ == "__main__":
  main()
