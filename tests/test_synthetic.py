"""Tests of cifar_train.synthetic: the offline synthetic data set (CPU)."""

import numpy as np
import pytest

from cifar_train import data_sources
from cifar_train import synthetic

SYNTHETIC_EXAMPLES = (120, 40)  # (train, test)


def read_synthetic(tfds_root: str, split: str):
  source = data_sources.builder(
    "synthetic", tfds_root, synthetic_examples=SYNTHETIC_EXAMPLES
  )
  return data_sources.read_split(source, split)


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="module")
def synthetic_splits(tfds_dir):
  return (
    tfds_dir,
    read_synthetic(tfds_dir, "train"),
    read_synthetic(tfds_dir, "test"),
  )


def test_synthetic_split_shapes_and_classes(synthetic_splits):
  tfds_root, (x, y), (xt, yt) = synthetic_splits
  assert x.shape == (120, 32, 32, 3) and x.dtype == np.uint8
  assert xt.shape == (40, 32, 32, 3)
  assert y.dtype == np.int32 and set(y.tolist()) == set(range(10))
  assert np.bincount(y).tolist() == [12] * 10
  assert (
    data_sources.load(
      "synthetic", tfds_root, synthetic_examples=SYNTHETIC_EXAMPLES
    ).num_classes
    == 10
  )
  assert x.std() > 20  # Not blank images.


def test_synthetic_deterministic(synthetic_splits, tmp_path):
  _, (x, y), _ = synthetic_splits
  x2, y2 = read_synthetic(str(tmp_path), "train")
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


def test_synthetic_is_prepared_to_array_record_with_its_pixels(tfds_dir):
  source = data_sources.builder(
    "synthetic", tfds_dir, synthetic_examples=SYNTHETIC_EXAMPLES
  )
  assert source.info.file_format.value == "array_record"
  # The records hold exactly `make_examples`, in the data source's order.
  images, labels = synthetic.make_examples(120, seed=0, split="train")
  records = source.as_data_source("train")
  x, y = data_sources.read_split(source, "train")
  for i in (0, 7, 119):
    image = records[i]["image"]
    (match,) = [j for j in range(120) if np.array_equal(images[j], image)]
    assert labels[match] == records[i]["label"] == y[i]
    np.testing.assert_array_equal(x[i], image)
