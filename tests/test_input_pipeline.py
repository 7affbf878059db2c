"""Tests of jaxmp._src.input_pipeline and the synthetic data set (CPU, small)."""

import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import PIL.Image
import pytest
import tensorflow_datasets as tfds

from jaxmp._src import input_pipeline as ip
from jaxmp._src import synthetic

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def make_config(**overrides) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict(dict(
      dataset="synthetic",
      data_dir="",
      mean=MEAN,
      std=STD,
      batch_size=16,
      eval_batch_size=16,
      seed=0,
      synthetic_train_examples=120,
      synthetic_test_examples=40,
  ))
  config.update(overrides)
  return config


def random_data(n: int = 100, size: int = 8, seed: int = 0):
  """Random uint8 images; label i marks example i, to trace the order."""
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
  return images, np.arange(n, dtype=np.int32)


def unnormalize(x: np.ndarray) -> np.ndarray:
  u8 = (x * np.asarray(STD) + np.asarray(MEAN)) * 255.0
  np.testing.assert_allclose(u8, np.rint(u8), atol=1e-3)
  return np.rint(u8).astype(np.uint8)


def crop_options(image: np.ndarray) -> list[np.ndarray]:
  """All 2 * 9 * 9 pad-4 crops (flipped or not) of `image`."""
  h, w, _ = image.shape
  padded = np.pad(image, ((4, 4), (4, 4), (0, 0)))
  out = []
  for dy in range(9):
    for dx in range(9):
      crop = padded[dy:dy + h, dx:dx + w]
      out += [crop, crop[:, ::-1]]
  return out


def is_valid_crop(out: np.ndarray, image: np.ndarray) -> bool:
  return any(np.array_equal(out, c) for c in crop_options(image))


# -- Synthetic data set -----------------------------------------------------


@pytest.fixture(scope="module")
def synthetic_splits(tmp_path_factory):
  config = make_config(data_dir=str(tmp_path_factory.mktemp("tfds")))
  return config, ip.load_split(config, "train"), ip.load_split(config, "test")


def test_synthetic_split_shapes_and_classes(synthetic_splits):
  config, (x, y), (xt, yt) = synthetic_splits
  assert x.shape == (120, 32, 32, 3) and x.dtype == np.uint8
  assert xt.shape == (40, 32, 32, 3)
  assert y.dtype == np.int32 and set(y.tolist()) == set(range(10))
  assert np.bincount(y).tolist() == [12] * 10
  assert ip.num_classes(config) == 10
  assert x.std() > 20  # Not blank images.


def test_synthetic_deterministic(synthetic_splits, tmp_path):
  _, (x, y), _ = synthetic_splits
  x2, y2 = ip.load_split(make_config(data_dir=str(tmp_path)), "train")
  np.testing.assert_array_equal(x, x2)
  np.testing.assert_array_equal(y, y2)
  a, _ = synthetic.make_examples(10, seed=0, split="train")
  b, _ = synthetic.make_examples(10, seed=1, split="train")
  c, _ = synthetic.make_examples(10, seed=0, split="test")
  assert not np.array_equal(a, b) and not np.array_equal(a, c)


def test_synthetic_sizes_in_config_name():
  a = synthetic.synthetic_config(100, 10).name
  b = synthetic.synthetic_config(200, 10).name
  assert a != b and "100" in a


def test_synthetic_png_roundtrip():
  image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)
  decoded = np.asarray(PIL.Image.open(
      __import__("io").BytesIO(synthetic._encode_png(image))))
  np.testing.assert_array_equal(decoded, image)


# -- Loading other data sets ------------------------------------------------


def test_cifar10_mock_data(monkeypatch):
  def no_probe():
    raise AssertionError("network probed under mock_data")

  monkeypatch.setattr(ip, "_network_available", no_probe)
  config = make_config(dataset="cifar10")
  with tfds.testing.mock_data(num_examples=20):
    x, y = ip.load_split(config, "train")
    assert ip.num_classes(config) == 10
  assert x.shape == (20, 32, 32, 3) and x.dtype == np.uint8
  assert y.shape == (20,) and y.dtype == np.int32


def test_offline_error_is_fast_and_clear(monkeypatch, tmp_path):
  monkeypatch.setattr(ip, "_network_available", lambda: False)
  config = make_config(dataset="cifar10", data_dir=str(tmp_path))
  start = time.perf_counter()
  with pytest.raises(ip.DatasetUnavailableError) as err:
    ip.load_split(config, "train")
  assert time.perf_counter() - start < 5
  message = str(err.value)
  for part in ("'cifar10'", str(tmp_path), "cifar-10-binary.tar.gz",
               "download_and_prepare", "data_dir", "smoke.py",
               os.path.join("downloads", "manual")):
    assert part in message, part
  assert isinstance(err.value, RuntimeError)


def test_network_probe_times_out_quickly():
  start = time.perf_counter()
  # 192.0.2.0/24 is TEST-NET-1: never routed.
  assert not ip._network_available(("192.0.2.1", 9), timeout=0.5)
  assert time.perf_counter() - start < 2


def test_unknown_dataset():
  with pytest.raises(ValueError, match="cifar10, cifar100, image_folder"):
    ip.load_split(make_config(dataset="imagenet"), "train")


def test_image_folder(tmp_path):
  rng = np.random.default_rng(0)
  for split, count in (("train", 3), ("test", 2)):
    for label in ("cat", "dog"):
      os.makedirs(tmp_path / split / label)
      for i in range(count):
        image = rng.integers(0, 256, (8, 8, 3), np.uint8)
        PIL.Image.fromarray(image).save(tmp_path / split / label / f"{i}.png")
  config = make_config(dataset="image_folder", data_dir=str(tmp_path))
  x, y = ip.load_split(config, "train")
  assert x.shape == (6, 8, 8, 3) and x.dtype == np.uint8
  assert sorted(y.tolist()) == [0, 0, 0, 1, 1, 1]
  assert ip.load_split(config, "test")[0].shape == (4, 8, 8, 3)
  assert ip.num_classes(config) == 2


def test_image_folder_missing_splits(tmp_path):
  config = make_config(dataset="image_folder", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="train/<class>"):
    ip.load_split(config, "train")


# -- Training stream --------------------------------------------------------


def collect(config, images, labels, **kwargs):
  return list(ip.train_batches(config, images, labels, **kwargs))


def test_train_stream_shapes_order_and_normalisation():
  images, labels = random_data()
  config = make_config()
  batches = collect(config, images, labels, epoch=0)
  assert len(batches) == ip.steps_per_epoch(100, 16) == 6  # Drop remainder.
  for b in batches:
    assert b["image"].shape == (16, 8, 8, 3) and b["image"].dtype == np.float32
    assert b["label"].shape == (16,) and b["label"].dtype == np.int32
  order = np.concatenate([b["label"] for b in batches])
  np.testing.assert_array_equal(order, ip.epoch_permutation(0, 0, 100)[:96])
  for b in batches[:2]:
    for image, label in zip(b["image"], b["label"]):
      assert is_valid_crop(unnormalize(image), images[label])


def test_train_stream_without_augmentation_is_the_plain_images():
  images, labels = random_data()
  config = make_config()
  config.augment = False
  batches = collect(config, images, labels, epoch=0)
  for b in batches[:2]:
    for image, label in zip(b["image"], b["label"]):
      np.testing.assert_array_equal(unnormalize(image), images[label])


def test_train_stream_deterministic_per_seed_and_epoch():
  images, labels = random_data()
  config = make_config()
  a = collect(config, images, labels, epoch=3)
  b = collect(config, images, labels, epoch=3)
  c = collect(config, images, labels, epoch=4)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["image"], y["image"])
    np.testing.assert_array_equal(x["label"], y["label"])
  assert not np.array_equal(a[0]["label"], c[0]["label"])
  d = collect(make_config(seed=1), images, labels, epoch=3)
  assert not np.array_equal(a[0]["label"], d[0]["label"])


def test_train_stream_resume_is_bitwise():
  images, labels = random_data()
  config = make_config()
  full = collect(config, images, labels, epoch=1)
  resumed = collect(config, images, labels, epoch=1, start_batch=4)
  assert len(resumed) == 2
  for x, y in zip(full[4:], resumed):
    np.testing.assert_array_equal(x["image"], y["image"])
    np.testing.assert_array_equal(x["label"], y["label"])
  assert collect(config, images, labels, epoch=1, start_batch=6) == []


def test_train_stream_process_slices():
  images, labels = random_data()
  config = make_config()
  full = collect(config, images, labels, epoch=2)
  parts = [
      collect(config, images, labels, epoch=2, process_index=i,
              process_count=2)
      for i in range(2)
  ]
  for step, whole in enumerate(full):
    p0, p1 = parts[0][step], parts[1][step]
    assert p0["image"].shape == (8, 8, 8, 3)
    assert not set(p0["label"]) & set(p1["label"])
    np.testing.assert_array_equal(
        np.concatenate([p0["label"], p1["label"]]), whole["label"])
    np.testing.assert_array_equal(
        np.concatenate([p0["image"], p1["image"]]), whole["image"])
  with pytest.raises(ValueError, match="divisible"):
    collect(config, images, labels, epoch=0, process_count=3)


# -- Evaluation -------------------------------------------------------------


@pytest.mark.parametrize("process_count", [1, 2])
def test_eval_covers_every_example_once(process_count):
  images, labels = random_data(n=50)
  config = make_config()
  seen = []
  for i in range(process_count):
    batches = list(ip.eval_batches(
        config, images, labels, batch_size=16, process_index=i,
        process_count=process_count))
    assert len(batches) == 4
    for b in batches:
      assert b["image"].shape == (16 // process_count, 8, 8, 3)
      assert b["mask"].dtype == bool
      for image, label in zip(b["image"][b["mask"]], b["label"][b["mask"]]):
        np.testing.assert_array_equal(unnormalize(image), images[label])
      seen += b["label"][b["mask"]].tolist()
  assert sorted(seen) == list(range(50))
  last = list(ip.eval_batches(config, images, labels, batch_size=16))[-1]
  assert last["mask"].tolist() == [True] * 2 + [False] * 14


# -- Device-resident helpers ------------------------------------------------


def test_device_augment():
  images, _ = random_data(n=32)
  augment = jax.jit(ip.device_augment)
  a = augment(jnp.asarray(images), jax.random.key(0))
  b = augment(jnp.asarray(images), jax.random.key(0))
  c = augment(jnp.asarray(images), jax.random.key(1))
  assert a.shape == images.shape and a.dtype == jnp.uint8
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  a = np.asarray(a)
  for out, image in zip(a, images):
    assert is_valid_crop(out, image)
  assert not np.array_equal(a, images)  # Some example was moved or flipped.


def test_normalize_matches_host_pipeline():
  images, labels = random_data(n=16)
  host = next(ip.eval_batches(make_config(), images, labels, batch_size=16))
  dev = jax.jit(ip.normalize, static_argnums=(1, 2, 3))(
      jnp.asarray(images), MEAN, STD, jnp.float32)
  np.testing.assert_allclose(dev, host["image"], rtol=1e-6, atol=1e-6)
  half = ip.normalize(jnp.asarray(images), MEAN, STD, jnp.float16)
  assert half.dtype == jnp.float16


def test_device_epoch_permutation():
  key = jax.random.key(0)
  perm = jax.jit(ip.device_epoch_permutation, static_argnums=2)
  p0, p1 = perm(key, 0, 50), perm(key, 1, 50)
  assert sorted(np.asarray(p0).tolist()) == list(range(50))
  assert not np.array_equal(p0, p1)
  np.testing.assert_array_equal(p0, perm(key, 0, 50))
