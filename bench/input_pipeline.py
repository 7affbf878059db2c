"""Throughput of the training input paths on CIFAR10-shaped data.

Run:

    python bench/input_pipeline.py [--num_images 50000] [--batch 128]

Measures images per second of

* `tfdata`: `input_pipeline.train_batches` from uint8 arrays in host memory
  (gather, pad-4 crop, flip, normalise, batch), consumed as numpy;
* `device`: jitted `device_augment` + `normalize` on JAX's default device
  (the CPU here; on a GPU this is the airbench-style resident-data path).

tf.data may use every core, so its rate is also given per core
(`os.cpu_count()`). The last line is `tfdata_images_per_sec_per_core: X`.
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxmp._src import input_pipeline as ip

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def bench_tfdata(images, labels, batch: int, epochs: int) -> float:
  config = ml_collections.ConfigDict(
      dict(seed=0, batch_size=batch, mean=MEAN, std=STD))
  # Warm up: trace the map function and fill the prefetch buffer.
  it = ip.train_batches(config, images, labels, epoch=0)
  for _ in range(5):
    next(it)
  del it
  count, start = 0, time.perf_counter()
  for epoch in range(1, epochs + 1):
    for b in ip.train_batches(config, images, labels, epoch=epoch):
      count += len(b["label"])
  return count / (time.perf_counter() - start)


def bench_device(images, batch: int, steps: int) -> float:
  @jax.jit
  def step(x, key):
    return ip.normalize(ip.device_augment(x, key), MEAN, STD, jnp.float32)

  data = jax.device_put(images)
  n = len(images) // batch
  batches = [data[i * batch:(i + 1) * batch] for i in range(min(n, steps))]
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
  print(f"{'tf.data (host, ' + str(cores) + ' cores)':<28}"
        f"{tfdata:>12,.0f}{tfdata / cores:>14,.0f}")
  print(f"{'device (' + platform + ', jit)':<28}{device:>12,.0f}"
        f"{'':>14}")
  print(f"tfdata_images_per_sec_per_core: {tfdata / cores:.0f}")


if __name__ == "__main__":
  main()
