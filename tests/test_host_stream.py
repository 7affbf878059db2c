"""Tests of cifar_train.host_stream: training and eval batches (CPU)."""

import numpy as np
import pytest

from _helpers import is_valid_crop
from _helpers import random_data
from cifar_train import host_stream

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
TRAIN = dict(seed=0, batch_size=16, mean=MEAN, std=STD, augment=True)


def unnormalize(x: np.ndarray) -> np.ndarray:
  u8 = (x * np.asarray(STD) + np.asarray(MEAN)) * 255.0
  np.testing.assert_allclose(u8, np.rint(u8), atol=1e-3)
  return np.rint(u8).astype(np.uint8)


def collect(images, labels, **kwargs):
  return list(host_stream.train_batches(images, labels, **{**TRAIN, **kwargs}))


# -- Training stream --------------------------------------------------------


def test_train_stream_shapes_order_and_normalisation():
  images, labels = random_data()
  batches = collect(images, labels, epoch=0)
  # Drop remainder.
  assert len(batches) == host_stream.steps_per_epoch(100, 16) == 6
  for b in batches:
    assert b["image"].shape == (16, 8, 8, 3) and b["image"].dtype == np.float32
    assert b["label"].shape == (16,) and b["label"].dtype == np.int32
  order = np.concatenate([b["label"] for b in batches])
  np.testing.assert_array_equal(
    order, host_stream.epoch_permutation(0, 0, 100)[:96]
  )
  for b in batches[:2]:
    for image, label in zip(b["image"], b["label"]):
      assert is_valid_crop(unnormalize(image), images[label])


def test_train_stream_without_augmentation_is_the_plain_images():
  images, labels = random_data()
  batches = collect(images, labels, epoch=0, augment=False)
  for b in batches[:2]:
    for image, label in zip(b["image"], b["label"]):
      np.testing.assert_array_equal(unnormalize(image), images[label])


def test_without_crops_the_batches_are_those_of_the_padded_set(monkeypatch):
  # augment=False: the unpadded set gives the padded set's batches, bit for
  # bit, without the padded copy; a plan with crops is refused.
  images, labels = random_data()
  plain = host_stream.epoch_plan(0, 1, 100, 16, augment=False)
  padded = host_stream.HostBatches(images, labels, mean=MEAN, std=STD)
  pad = host_stream.pad
  calls = []
  monkeypatch.setattr(host_stream, "pad", lambda x: calls.append(1) or pad(x))
  unpadded = host_stream.HostBatches(
    images, labels, mean=MEAN, std=STD, crops=False
  )
  for want, got in zip(padded.epoch(plain), unpadded.epoch(plain)):
    np.testing.assert_array_equal(
      got["image"].view(np.uint32), want["image"].view(np.uint32)
    )
    np.testing.assert_array_equal(got["label"], want["label"])
  assert not calls
  cropped = host_stream.epoch_plan(0, 1, 100, 16, augment=True)
  with pytest.raises(ValueError, match="without crops"):
    next(unpadded.epoch(cropped))


def test_train_stream_deterministic_per_seed_and_epoch():
  images, labels = random_data()
  a = collect(images, labels, epoch=3)
  b = collect(images, labels, epoch=3)
  c = collect(images, labels, epoch=4)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["image"], y["image"])
    np.testing.assert_array_equal(x["label"], y["label"])
  assert not np.array_equal(a[0]["label"], c[0]["label"])
  d = collect(images, labels, epoch=3, seed=1)
  assert not np.array_equal(a[0]["label"], d[0]["label"])


def test_train_stream_resume_is_bitwise():
  images, labels = random_data()
  full = collect(images, labels, epoch=1)
  resumed = collect(images, labels, epoch=1, start_batch=4)
  assert len(resumed) == 2
  for x, y in zip(full[4:], resumed):
    np.testing.assert_array_equal(x["image"], y["image"])
    np.testing.assert_array_equal(x["label"], y["label"])
  assert collect(images, labels, epoch=1, start_batch=6) == []


def test_train_stream_process_slices():
  images, labels = random_data()
  full = collect(images, labels, epoch=2)
  parts = [
    collect(images, labels, epoch=2, process_index=i, process_count=2)
    for i in range(2)
  ]
  for step, whole in enumerate(full):
    p0, p1 = parts[0][step], parts[1][step]
    assert p0["image"].shape == (8, 8, 8, 3)
    assert not set(p0["label"]) & set(p1["label"])
    np.testing.assert_array_equal(
      np.concatenate([p0["label"], p1["label"]]), whole["label"]
    )
    np.testing.assert_array_equal(
      np.concatenate([p0["image"], p1["image"]]), whole["image"]
    )
  with pytest.raises(ValueError, match="divisible"):
    collect(images, labels, epoch=0, process_count=3)


def test_each_process_reads_only_its_rows(monkeypatch):
  # Process 1 of 4 gets a data set in which every example that is not in
  # its rows of a batch is garbage: its batches must not change, and it
  # gathers and normalises its 4 rows only, never the global 16.
  images, labels = random_data()
  plan = host_stream.epoch_plan(0, 2, 100, 16, augment=True)
  full = host_stream.HostBatches(images, labels, mean=MEAN, std=STD)
  normalize = host_stream.normalize
  rows = []

  def spy(x, *args):
    rows.append(len(x))
    return normalize(x, *args)

  for step in range(len(plan.index)):
    mine = plan.index[step, 4:8]
    garbage = np.full_like(images, 255)
    garbage[mine] = images[mine]
    local = host_stream.HostBatches(garbage, labels, mean=MEAN, std=STD)
    with monkeypatch.context() as m:
      m.setattr(host_stream, "normalize", spy)
      got = next(local.epoch(plan, step, 1, 4))
    want = full.batch(plan.index[step], plan.offsets[step], plan.flips[step])
    np.testing.assert_array_equal(got["image"], want["image"][4:8])
    np.testing.assert_array_equal(got["label"], want["label"][4:8])
  assert rows == [4] * len(plan.index)


def test_epoch_plan_draws_every_crop_and_flip():
  plan = host_stream.epoch_plan(0, 0, 5000, 100, augment=True)
  assert plan.index.shape == (50, 100) and plan.index.dtype == np.int32
  assert sorted(plan.index.ravel().tolist()) == list(range(5000))
  # 9 offsets per axis, uniformly: each appears about 5000 * 2 / 9 times.
  counts = np.bincount(plan.offsets.ravel(), minlength=10)
  assert counts[9] == 0 and counts[:9].min() > 900, counts
  assert 2200 < plan.flips.sum() < 2800
  plain = host_stream.epoch_plan(0, 0, 5000, 100, augment=False)
  np.testing.assert_array_equal(plain.index, plan.index)
  assert (plain.offsets == host_stream.PAD).all() and not plain.flips.any()


def test_normalization_table_is_normalize_of_every_byte():
  table = host_stream.normalization_table(MEAN, STD)
  scale, bias = host_stream.normalization(MEAN, STD)
  images, _ = random_data(n=4)
  normalized = host_stream.normalize(images, scale, bias)
  np.testing.assert_array_equal(
    table[images, np.arange(3)].view(np.uint32), normalized.view(np.uint32)
  )
  # And it is the normalisation it claims, to float32 rounding (|x| < 3,
  # a few roundings of 2^-24 relative each).
  exact = (np.arange(256)[:, None] / 255.0 - np.asarray(MEAN)) / np.asarray(STD)
  np.testing.assert_allclose(table, exact, rtol=0, atol=4 * 3 * 2.0**-24)


# -- Evaluation -------------------------------------------------------------


@pytest.mark.parametrize("process_count", [1, 2])
def test_eval_covers_every_example_once(process_count):
  images, labels = random_data(n=50)
  seen = []
  for i in range(process_count):
    batches = list(
      host_stream.eval_batches(
        images,
        labels,
        batch_size=16,
        mean=MEAN,
        std=STD,
        process_index=i,
        process_count=process_count,
      )
    )
    assert len(batches) == 4
    for b in batches:
      assert b["image"].shape == (16 // process_count, 8, 8, 3)
      assert b["mask"].dtype == bool
      for image, label in zip(b["image"][b["mask"]], b["label"][b["mask"]]):
        np.testing.assert_array_equal(unnormalize(image), images[label])
      seen += b["label"][b["mask"]].tolist()
  assert sorted(seen) == list(range(50))
  last = list(
    host_stream.eval_batches(images, labels, batch_size=16, mean=MEAN, std=STD)
  )[-1]
  assert last["mask"].tolist() == [True] * 2 + [False] * 14


def test_background_padding_hands_over_its_value_or_its_error():
  """`HostBatches` pads on a thread: its result, or its error, in the caller."""
  done = host_stream._InBackground(lambda: np.arange(3))  # pylint: disable=protected-access
  np.testing.assert_array_equal(done.result(), np.arange(3))

  def fail():
    raise MemoryError("no room for the padded set")

  failed = host_stream._InBackground(fail)  # pylint: disable=protected-access
  with pytest.raises(MemoryError, match="no room for the padded set"):
    failed.result()
