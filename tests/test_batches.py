"""Tests of cifar_train.batches and loop.evaluate: what the steps are fed.

Both data modes on a 4-device mesh: the host stream's batches, placed on the
mesh, and the device-resident set's batches, built on the devices, must be
the same bits for every step of every epoch, resumed or not.
"""

import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cifar_train import batches
from cifar_train import data_sources
from cifar_train import host_stream
from cifar_train import loop
from cifar_train import settings
from cifar_train import steps

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def shardings():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  return NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


def test_device_resident_and_host_stream_see_the_same_batches(tiny_data):
  assert jax.device_count() == 4
  # 96 of the 256 training images, batches of 32: 3 steps an epoch, so the
  # order, the crops and the flips all matter.
  subset = data_sources.Dataset(
    tiny_data.train_images[:96],
    tiny_data.train_labels[:96],
    tiny_data.test_images,
    tiny_data.test_labels,
    tiny_data.num_classes,
  )
  replicated, batch_sharding = shardings()
  args = dict(
    batch_size=32,
    seed=5,
    mean=MEAN,
    std=STD,
    augment=True,
    replicated=replicated,
    batch_sharding=batch_sharding,
  )
  host = batches.HostStream(subset, **args)
  dev = batches.DeviceResident(subset, **args)
  seen = []
  for epoch, start in ((0, 0), (1, 0), (1, 2)):
    a = list(host.epoch(None, epoch, start, 3 - start))
    b = list(dev.epoch(None, epoch, start, 3 - start))
    assert len(a) == len(b) == 3 - start
    for step_a, step_b in zip(a, b):
      xa, ya = host.batch(None, *step_a)
      xb, yb = dev.batch(None, *step_b)
      assert xa.sharding.is_equivalent_to(batch_sharding, 4)
      np.testing.assert_array_equal(
        np.asarray(xa).view(np.uint32), np.asarray(xb).view(np.uint32)
      )
      np.testing.assert_array_equal(np.asarray(ya), np.asarray(yb))
      seen.append(np.asarray(xa))
  # Epochs differ, and a resumed epoch is the uninterrupted one.
  assert not np.array_equal(seen[0], seen[3])
  np.testing.assert_array_equal(seen[5], seen[6])


@pytest.mark.parametrize("resident", [False, True])
def test_eval_counts_every_example_once(
  make_config, data_dir, tiny_data, monkeypatch, resident
):
  s = settings.resolve(make_config(data_dir, policy="O0"))
  replicated, sharding = shardings()
  n = len(tiny_data.test_images)
  assert n == 100 and s.eval_batch_size == 64  # 2 batches, 28 padded rows.
  # Example i carries its id in its first pixel.
  images = tiny_data.test_images.copy()
  images[:, 0, 0, 0] = np.arange(n) % 256
  images[:, 0, 0, 1] = np.arange(n) // 256
  data = data_sources.Dataset(
    tiny_data.train_images,
    tiny_data.train_labels,
    images,
    tiny_data.test_labels,
    tiny_data.num_classes,
  )
  # One stage of one block: what is counted is the batches, not the net.
  model = steps.create_model(
    s.model,
    num_classes=data.num_classes,
    num_filters=s.num_filters,
    precision=s.precision,
  ).clone(stage_sizes=(1,))
  optimizer = steps.create_optimizer(s.precision, 0.1, momentum=0.9)
  state = steps.create_train_state(model, optimizer, (32, 32, 3), seed=0)
  eval_step = steps.make_eval_step(
    model, compute_dtype=s.precision.compute_dtype
  )
  table = host_stream.normalization_table(s.mean, s.std)
  ids = []
  eval_batches = host_stream.eval_batches

  def spy(*args, **kwargs):  # The host's batches, as they are placed.
    for batch in eval_batches(*args, **kwargs):
      first = batch["image"][:, 0, 0, :2]
      pixel = np.abs(first[..., None] - table.T[None, :2]).argmin(-1)
      ids.extend((pixel[:, 0] + 256 * pixel[:, 1])[batch["mask"]].tolist())
      yield batch

  monkeypatch.setattr(host_stream, "eval_batches", spy)
  cls = batches.ResidentEval if resident else batches.HostEval
  source = cls(
    data,
    batch_size=s.eval_batch_size,
    mean=s.mean,
    std=s.std,
    replicated=replicated,
    batch_sharding=sharding,
  )
  if resident:  # What the scan runs over: uint8 batches and their masks.
    u8, _, mask, _ = (np.asarray(a) for a in source._arrays)
    assert u8.shape == (2, 64, 32, 32, 3) and mask.sum() == n
    first = u8[..., 0, 0, :2].astype(int)
    ids = (first[..., 0] + 256 * first[..., 1])[mask].tolist()
  result = loop.evaluate(source.jit_eval(eval_step), state)
  assert sorted(ids) == list(range(n))
  assert result["count"] == n
  # The mean over exactly the 100 examples, computed in one batch.
  logits = model.apply(
    {"params": state.params, "batch_stats": state.batch_stats},
    next(
      host_stream.eval_batches(
        images, data.test_labels, batch_size=n, mean=s.mean, std=s.std
      )
    )["image"],
    train=False,
  )
  losses = np.asarray(steps.cross_entropy(logits, data.test_labels))
  # fp32 sums of 100 losses of ~2.3, on different batch sizes (and so
  # possibly different conv summation orders): agreement to ~1e-6 relative
  # is expected; 28 zero-image rows counted would move the mean by ~1e-2.
  assert result["loss"] == pytest.approx(losses.mean(), rel=1e-4)
  correct = np.argmax(np.asarray(logits), -1) == data.test_labels
  assert result["accuracy"] == pytest.approx(correct.mean(), abs=1.5 / n)


def test_prefetch_runs_ahead_in_order():
  calls = []
  ready = threading.Event()

  def transform(x):
    calls.append(x)
    if len(calls) == 3:
      ready.set()
    return x * 10

  stream = batches.prefetch(range(6), 2, transform)
  assert next(stream) == 0
  # While the consumer holds item 0, items 1 and 2 are being prepared.
  assert ready.wait(10)
  assert calls[:3] == [0, 1, 2]
  assert list(stream) == [10, 20, 30, 40, 50]


def test_prefetch_raises_the_producers_error_at_its_item():
  def transform(x):
    if x == 2:
      raise KeyError("bad item")
    return x

  stream = batches.prefetch(range(5), 2, transform)
  assert [next(stream), next(stream)] == [0, 1]
  with pytest.raises(KeyError, match="bad item"):
    next(stream)


def test_closing_a_prefetch_stops_its_thread():
  before = {t for t in threading.enumerate() if t.name == "prefetch"}
  stream = batches.prefetch(iter(range(10**9)), 2, lambda x: x)
  assert next(stream) == 0
  stream.close()
  time.sleep(0.05)
  after = {t for t in threading.enumerate() if t.name == "prefetch"}
  assert after <= before
