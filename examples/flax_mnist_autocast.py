"""Flax's ``examples/mnist`` CNN in Apex O1 mixed precision: a few lines.

Flax's MNIST example (an NNX CNN: two 3x3 convolutions with BatchNorm, dropout
and 2x2 average pooling, then two dense layers; SGD 0.1, momentum 0.9) builds
its model in fp32 and trains it with ``nnx.Optimizer`` and
``nnx.value_and_grad``. Converting it to fp16 by hand takes ``dtype=`` on six
layers and casts in and out. Here the model, ``nnx.Optimizer`` and the
``nnx.jit`` step are kept; the conversion is:

* the optimizer's transform wrapped: ``jaxmp.mixed_precision(optax.sgd(...))``
  (fp32 masters, a dynamic loss scale for the fp16 gradients);
* the forward call under `jaxmp.autocast` (fp16 convolutions and products,
  fp32 the rest): the model and the ``nnx.Rngs`` are passed in as they are,
  and their BatchNorm statistics and RNG counters are written back;
* ``nnx.value_and_grad`` replaced by `jaxmp.value_and_grad` (the loss scaled,
  handed back unscaled) and ``loss=`` given to ``optimizer.update``;
* a skipped step (an fp16 overflow) rolls the statistics back.

Run (synthetic MNIST-shaped data; ``--data tfds`` reads real MNIST through
tensorflow_datasets when it is installed and downloaded)::

    python examples/flax_mnist_autocast.py --steps 200
    python examples/flax_mnist_autocast.py --data tfds --steps 2000
    python examples/flax_mnist_autocast.py --precision fp32  # the baseline
"""

import argparse
import functools
import sys
from typing import Any, Optional, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp


class CNN(nnx.Module):
  """The CNN of flax's examples/mnist, in fp32 as it is written there."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.bn1 = nnx.BatchNorm(32, rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.bn2 = nnx.BatchNorm(64, rngs=rngs)
    self.dense1 = nnx.Linear(7 * 7 * 64, 256, rngs=rngs)
    self.dense2 = nnx.Linear(256, 10, rngs=rngs)
    self.dropout = nnx.Dropout(rate=0.025)

  def __call__(self, x: jax.Array, rngs: Optional[nnx.Rngs] = None):
    pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    x = self.dropout(self.conv1(x), rngs=rngs)
    x = pool(nnx.relu(self.bn1(x)))
    x = pool(nnx.relu(self.bn2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(self.dropout(self.dense1(x), rngs=rngs))
    return self.dense2(x)


def make_forward(*, autocast: bool = True):
  """``forward(model, images, rngs=None) -> logits``: the model, called.

  The NNX model and its ``nnx.Rngs`` are passed as they are; under
  `jaxmp.autocast` their updates (BatchNorm statistics, the dropout RNG's
  counter) are written back as without it.
  """

  def forward(model, images, rngs=None):
    return model(images, rngs=rngs)

  if autocast:
    forward = jaxmp.autocast(forward)  # The one line: Apex O1.
  return forward


def synthetic_mnist(num: int, seed: int = 0) -> dict[str, np.ndarray]:
  """MNIST-shaped data a CNN can learn: one noisy stroke pattern per class.

  ``image`` is float32 in [0, 1] of shape ``(num, 28, 28, 1)``, ``label``
  int32 in [0, 10).
  """
  rng = np.random.default_rng(seed)
  templates = (rng.random((10, 28, 28, 1)) < 0.15).astype(np.float32)
  labels = rng.integers(0, 10, num).astype(np.int32)
  noise = rng.random((num, 28, 28, 1)).astype(np.float32)
  images = np.clip(0.4 * templates[labels] + 0.6 * noise, 0.0, 1.0)
  return {"image": images, "label": labels}


def tfds_mnist(split: str) -> dict[str, np.ndarray]:  # pragma: no cover
  """Real MNIST from tensorflow_datasets (imported only here)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  data = tfds.as_numpy(tfds.load("mnist", split=split, batch_size=-1))
  return {
    "image": data["image"].astype(np.float32) / 255.0,
    "label": data["label"].astype(np.int32),
  }


def loss_fn(forward, model, images, labels, rngs):
  """Flax's loss: mean cross-entropy of the logits (fp32 from autocast)."""
  logits = forward(model, images, rngs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def create_train_step(forward):
  """Flax's ``nnx.jit`` step, with the loss scaled and a skipped step undone."""

  @nnx.jit
  def train_step(model, optimizer, images, labels, rngs):
    stats = nnx.clone(nnx.state(model, nnx.BatchStat))  # For a rollback.
    loss, grads = jaxmp.value_and_grad(functools.partial(loss_fn, forward))(
      model, optimizer.opt_state, images, labels, rngs
    )
    optimizer.update(model, grads, loss=loss)
    # A skipped step (fp16 overflow) must not move the statistics either.
    jaxmp.rollback_if_skipped(optimizer.opt_state, model, stats)
    return loss

  return train_step


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
  """Trains the CNN; returns the per-step losses and the test accuracy."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--precision", choices=("autocast", "fp32"))
  parser.add_argument("--data", choices=("synthetic", "tfds"))
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--learning-rate", type=float, default=0.1)
  parser.add_argument("--momentum", type=float, default=0.9)
  parser.add_argument("--num-train", type=int, default=4096)
  parser.add_argument("--num-test", type=int, default=1024)
  parser.add_argument("--seed", type=int, default=0)
  parser.set_defaults(precision="autocast", data="synthetic")
  args = parser.parse_args(argv)

  if args.data == "tfds":
    train, test = tfds_mnist("train"), tfds_mnist("test")
  else:
    data = synthetic_mnist(args.num_train + args.num_test, args.seed)
    train = {k: v[: args.num_train] for k, v in data.items()}
    test = {k: v[args.num_train :] for k, v in data.items()}

  model = CNN(rngs=nnx.Rngs(args.seed))
  rngs = nnx.Rngs(dropout=args.seed)
  forward = make_forward(autocast=args.precision == "autocast")
  # fp16 gradients need a dynamic loss scale (O1's, from 2**15); fp32 none.
  preset = "O1" if args.precision == "autocast" else "O0"
  optimizer = nnx.Optimizer(
    model,
    jaxmp.mixed_precision(
      optax.sgd(args.learning_rate, args.momentum),
      loss_scale=jaxmp.get_preset(preset).loss_scale,
    ),
    wrt=nnx.Param,
  )
  train_step = create_train_step(forward)

  rng = np.random.default_rng(args.seed)
  losses = []
  n = len(train["label"])
  model.train()
  for _ in range(args.steps):
    idx = rng.choice(n, args.batch_size, replace=False)
    loss = train_step(
      model, optimizer, train["image"][idx], train["label"][idx], rngs
    )
    losses.append(loss)
  losses = [float(x) for x in jax.device_get(losses)]

  model.eval()
  eval_fn = nnx.jit(forward)
  correct = 0
  usable = len(test["label"]) - len(test["label"]) % args.batch_size
  for i in range(0, usable, args.batch_size):
    batch = slice(i, i + args.batch_size)
    logits = eval_fn(model, test["image"][batch])
    correct += int(jnp.sum(jnp.argmax(logits, -1) == test["label"][batch]))
  accuracy = correct / max(usable, 1)
  print(
    f"{args.precision}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in "
    f"{args.steps} steps, test accuracy {accuracy:.4f}, loss scale "
    f"{float(nnx.as_pure(jaxmp.stats(optimizer.opt_state))['loss_scale']):g}"
  )
  return {
    "losses": losses,
    "test_accuracy": accuracy,
    "model": model,
    "stats": nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)),
    "opt_state": nnx.as_pure(optimizer.opt_state),
  }


if __name__ == "__main__":
  main(sys.argv[1:])
