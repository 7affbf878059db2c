"""Throughput of the training input paths on CIFAR10-shaped data.

Run:

    python bench/input_pipeline.py [--num_images 50000] [--batch 128]

Measures images per second of

* `tfdata`: `cifar_train.host_stream.train_batches` from uint8 arrays in host memory
  (gather, pad-4 crop, flip, normalise, batch), consumed as numpy;
* `device`: jitted `device_augment` + `normalize` on JAX's default device
  (the CPU here; on a GPU this is the airbench-style resident-data path).

tf.data may use every core, so its rate is also given per core
(`os.cpu_count()`). The last line is `tfdata_images_per_sec_per_core: X`.
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cifar_train import device_data  # pylint: disable=g-import-not-at-top,wrong-import-position
from cifar_train import host_stream  # pylint: disable=g-import-not-at-top,wrong-import-position

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def bench_tfdata(images, labels, batch: int, epochs: int) -> float:
  stream = dict(seed=0, batch_size=batch, mean=MEAN, std=STD, augment=True)
  # Warm up: trace the map function and fill the prefetch buffer.
  it = host_stream.train_batches(images, labels, epoch=0, **stream)
  for _ in range(5):
    next(it)
  del it
  count, start = 0, time.perf_counter()
  for epoch in range(1, epochs + 1):
    for b in host_stream.train_batches(images, labels, epoch=epoch, **stream):
      count += len(b["label"])
  return count / (time.perf_counter() - start)


def bench_device(images, batch: int, steps: int) -> float:
  @jax.jit
  def step(x, key):
    return device_data.normalize(
      device_data.device_augment(x, key), MEAN, STD, jnp.float32
    )

  data = jax.device_put(images)
  n = len(images) // batch
  batches = [data[i * batch : (i + 1) * batch] for i in range(min(n, steps))]
  key = jax.random.key(0)
  step(batches[0], key).block_until_ready()
  start = time.perf_counter()
  out = None
  for i in range(steps):
    out = step(batches[i % len(batches)], jax.random.fold_in(key, i))
  out.block_until_ready()
  return steps * batch / (time.perf_counter() - start)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_images", type=int, default=50_000)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--device_steps", type=int, default=200)
  args = parser.parse_args()

  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (args.num_images, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, args.num_images).astype(np.int32)
  cores = os.cpu_count() or 1

  tfdata = bench_tfdata(images, labels, args.batch, args.epochs)
  device = bench_device(images, args.batch, args.device_steps)
  platform = jax.devices()[0].platform
  print(f"{'path':<28}{'img/s':>12}{'img/s/core':>14}")
  print(
    f"{'tf.data (host, ' + str(cores) + ' cores)':<28}"
    f"{tfdata:>12,.0f}{tfdata / cores:>14,.0f}"
  )
  print(f"{'device (' + platform + ', jit)':<28}{device:>12,.0f}{'':>14}")
  print(f"tfdata_images_per_sec_per_core: {tfdata / cores:.0f}")


if __name__ == "__main__":
  main()
