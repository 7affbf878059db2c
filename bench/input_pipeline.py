"""Throughput of the training input paths on CIFAR10-shaped data.

Run:

    python bench/input_pipeline.py [--num_images 50000] [--batch 128]

Side by side, in one run, on random uint8 images in host memory:

* `numpy batch`: `host_stream.HostBatches.batch`, the app's host batch
  (the set padded once; one fancy index per batch gathers the cropped,
  flipped pixels; float32 normalisation), one thread;
* `numpy per example`: the same batch built one example at a time (slice,
  flip, normalise): the straightforward alternative;
* `host stream + device_put`: `batches.HostStream.epoch`, what the app runs
  (the numpy batch on a background thread, prefetched two batches ahead
  with `jax.make_array_from_process_local_data`);
* `device`: `device_data.device_batch` jitted on JAX's default device (the
  CPU here; on a GPU this is the device-resident path);
* `grain per element` (when grain is installed): ``grain.MapDataset``
  mapping the per-example crop, flip and normalisation, then ``.batch``, in
  the main process (Grain's worker processes would add their start-up).

The numpy paths run on one thread, so their rate per core is images per CPU
second of the process (also given as wall-clock img/s, which a loaded
machine lowers). The last line is ``numpy_batch_images_per_cpu_second: X``.
"""

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cifar_train import batches  # pylint: disable=g-import-not-at-top,wrong-import-position
from cifar_train import data_sources  # pylint: disable=g-import-not-at-top,wrong-import-position
from cifar_train import device_data  # pylint: disable=g-import-not-at-top,wrong-import-position
from cifar_train import host_stream  # pylint: disable=g-import-not-at-top,wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def timed(fn, num_images: int) -> tuple[float, float]:
  """``(wall img/s, img per CPU second)`` of ``fn()``, which makes images."""
  wall, cpu = time.perf_counter(), time.process_time()
  fn()
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  return num_images / wall, num_images / max(cpu, 1e-9)


def per_example_batch(padded, index, offsets, flips, scale, bias):
  """The same batch as `HostBatches.batch`, one example at a time."""
  _, h, w, c = padded.shape
  h, w = h - 2 * host_stream.PAD, w - 2 * host_stream.PAD
  out = np.empty((len(index), h, w, c), np.float32)
  for j, (i, (dy, dx), flip) in enumerate(zip(index, offsets, flips)):
    crop = padded[i, dy : dy + h, dx : dx + w]
    out[j] = host_stream.normalize(crop[:, ::-1] if flip else crop, scale, bias)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_images", type=int, default=50_000)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--steps", type=int, default=390)
  args = parser.parse_args()
  print(_common.date_line("input_pipeline"), flush=True)

  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (args.num_images, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, args.num_images).astype(np.int32)
  plan = host_stream.epoch_plan(0, 0, args.num_images, args.batch, True)
  steps = min(args.steps, len(plan.index))
  n = steps * args.batch
  rows = []

  start = time.perf_counter()
  host = host_stream.HostBatches(images, labels, mean=MEAN, std=STD)
  setup = time.perf_counter() - start

  def numpy_batches():
    for k in range(steps):
      host.batch(plan.index[k], plan.offsets[k], plan.flips[k])

  numpy_rate = timed(numpy_batches, n)
  rows.append(("numpy batch", *numpy_rate))

  padded = host_stream.pad(images)
  scale, bias = host_stream.normalization(MEAN, STD)
  slow_steps = max(steps // 10, 1)

  def per_example():
    for k in range(slow_steps):
      per_example_batch(
        padded, plan.index[k], plan.offsets[k], plan.flips[k], scale, bias
      )

  rows.append(("numpy per example", *timed(per_example, slow_steps * 128)))

  try:
    import grain  # pylint: disable=g-import-not-at-top
  except ImportError:
    grain = None
  if grain is not None:
    flat_index = plan.index[:steps].reshape(-1)
    flat_offsets = plan.offsets[:steps].reshape(-1, 2)
    flat_flips = plan.flips[:steps].reshape(-1)

    def one(j):
      crop = per_example_batch(
        padded,
        flat_index[j : j + 1],
        flat_offsets[j : j + 1],
        flat_flips[j : j + 1],
        scale,
        bias,
      )[0]
      return {"image": crop, "label": labels[flat_index[j]]}

    def grain_batches():
      ds = grain.MapDataset.range(slow_steps * args.batch).map(one)
      for _ in ds.batch(args.batch):
        pass

    rows.append(
      ("grain per element", *timed(grain_batches, slow_steps * args.batch))
    )

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  data = data_sources.Dataset(images, labels, images[:1], labels[:1], 10)
  stream = batches.HostStream(
    data,
    batch_size=args.batch,
    seed=0,
    mean=MEAN,
    std=STD,
    augment=True,
    replicated=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
    batch_sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data")
    ),
  )

  def host_stream_epoch():
    last = None
    for last in stream.epoch(None, 0, 0, steps):
      pass
    jax.block_until_ready(last)

  rows.append(("host stream + device_put", *timed(host_stream_epoch, n)))

  resident = jax.device_put(
    (padded, labels, host_stream.normalization_table(MEAN, STD))
  )
  on_device = jax.device_put(tuple(plan))
  build = jax.jit(
    lambda data, plan, k: device_data.device_batch(*data, *(a[k] for a in plan))
  )
  jax.block_until_ready(build(resident, on_device, np.int32(0)))

  def device():
    out = None
    for k in range(steps):
      out = build(resident, on_device, np.int32(k))
    jax.block_until_ready(out)

  wall, _ = timed(device, n)
  platform = jax.devices()[0].platform
  rows.append((f"device ({platform}, jit)", wall, float("nan")))

  print(f"{'path':<28}{'img/s (wall)':>14}{'img/CPU-s':>12}")
  for name, wall, cpu in rows:
    print(f"{name:<28}{wall:>14,.0f}{cpu:>12,.0f}")
  print(f"padding the set once: {setup:.2f} s ({args.num_images} images)")
  print(f"numpy_batch_images_per_cpu_second: {numpy_rate[1]:.0f}")


if __name__ == "__main__":
  main()
