"""Data sources: whole splits read into uint8 numpy arrays through tfds.

CIFAR10/100, an image folder or the synthetic set.

`load` asks tfds for one prepared builder and reads both splits
(CIFAR10 is 150 MB). When CIFAR is not prepared and the network is
unreachable, it fails in seconds with a message that says how to provide the
data, instead of letting tfds retry for minutes.
"""

import dataclasses
import os
import socket
import threading
from typing import Optional

import numpy as np
import tensorflow_datasets as tfds

from cifar_train import synthetic
from cifar_train.errors import ConfigError
from cifar_train.errors import DatasetUnavailableError

_CIFAR_ARCHIVES = {
  "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
  "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",
}
_PROBE_ADDRESS = ("www.cs.toronto.edu", 443)
_PROBE_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Both splits in host memory.

  Attributes:
    train_images: uint8 ``[N, H, W, 3]``.
    train_labels: int32 ``[N]``.
    test_images: uint8 ``[M, H, W, 3]``.
    test_labels: int32 ``[M]``.
    num_classes: from the data set's metadata, or counted from the labels.
  """

  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray
  num_classes: int

  @property
  def image_shape(self) -> tuple[int, ...]:
    """``(H, W, C)`` of every image."""
    return tuple(self.train_images.shape[1:])


def network_available(
  address: tuple[str, int] = _PROBE_ADDRESS,
  timeout: float = _PROBE_TIMEOUT_S,
) -> bool:
  """Whether a TCP connection to ``address`` opens within ``timeout`` seconds.

  The probe runs in a daemon thread so that a slow DNS lookup (which ignores
  socket timeouts) cannot hold the caller longer than ``timeout``.
  """
  result = []

  def probe():
    try:
      with socket.create_connection(address, timeout=timeout):
        result.append(True)
    except OSError:
      result.append(False)

  thread = threading.Thread(target=probe, daemon=True)
  thread.start()
  thread.join(timeout)
  return bool(result and result[0])


def _unavailable_message(name: str, builder: tfds.core.DatasetBuilder) -> str:
  data_dir = builder.data_dir_root
  archive = _CIFAR_ARCHIVES[name].rsplit("/", 1)[1]
  manual = os.path.join(data_dir, "downloads", "manual", archive)
  return (
    f"Data set {name!r} is not prepared in the tfds data dir "
    f"{str(data_dir)!r} (looked for {builder.data_dir!r}) and the network "
    "is unreachable, so tfds cannot download it. To provide it, either:\n"
    "  1. on a machine with internet run\n"
    '       python -c "import tensorflow_datasets as tfds; '
    f"tfds.builder('{name}', data_dir='DIR').download_and_prepare()\"\n"
    f"     and copy DIR/{name} to {os.path.join(data_dir, name)}; or\n"
    f"  2. download {_CIFAR_ARCHIVES[name]} and place the archive, not\n"
    f"     unpacked, at {manual}; tfds then prepares it offline.\n"
    "Select another tfds data dir with --config.data_dir=DIR, or train on\n"
    "offline synthetic data with --config=configs/smoke.py "
    "(config.dataset='synthetic')."
  )


def builder(
  name: str,
  data_dir: Optional[str] = None,
  *,
  synthetic_examples: tuple[int, int] = (10_000, 2_000),
) -> tfds.core.DatasetBuilder:
  """Returns the prepared tfds builder of data set ``name``.

  Args:
    name: ``"cifar10"``, ``"cifar100"``, ``"image_folder"`` or
      ``"synthetic"``.
    data_dir: the tfds data dir (``None``: tfds's default); for
      ``image_folder`` the root holding ``train/`` and ``test/``.
    synthetic_examples: train and test sizes of the synthetic set.

  Raises:
    ConfigError: an unknown name, or an image folder without its splits.
    DatasetUnavailableError: CIFAR is not prepared and there is no network.
  """
  data_dir = data_dir or None
  if name == "image_folder":
    if not data_dir or not all(
      os.path.isdir(os.path.join(data_dir, s)) for s in ("train", "test")
    ):
      raise ConfigError(
        "dataset='image_folder' needs config.data_dir to be a directory "
        f"with train/<class>/*.png and test/<class>/*.png; got {data_dir!r}"
      )
    return tfds.ImageFolder(data_dir)
  if name == "synthetic":
    result = synthetic.JaxmpSynthetic(
      data_dir=data_dir, config=synthetic.synthetic_config(*synthetic_examples)
    )
    # try_download_gcs=False: our data set is not on GCS, and probing for it
    # offline retries for minutes.
    result.download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False)
    )
    return result
  if name in _CIFAR_ARCHIVES:
    result = tfds.builder(name, data_dir=data_dir)
    download_config = None
    if not result.is_prepared():
      archive = _CIFAR_ARCHIVES[name].rsplit("/", 1)[1]
      manual = os.path.join(
        result.data_dir_root, "downloads", "manual", archive
      )
      if os.path.exists(manual):
        # Prepare from the archive; skip the GCS probe, which retries for
        # minutes offline.
        download_config = tfds.download.DownloadConfig(try_download_gcs=False)
      elif not network_available():
        raise DatasetUnavailableError(_unavailable_message(name, result))
    result.download_and_prepare(download_config=download_config)
    return result
  raise ConfigError(
    f"unknown dataset {name!r}; valid: cifar10, cifar100, "
    "image_folder, synthetic"
  )


def read_split(
  source: tfds.core.DatasetBuilder, split: str
) -> tuple[np.ndarray, np.ndarray]:
  """Reads a whole split into memory, in the data set's stored order.

  The number of examples is counted from what is read, never taken from tfds
  metadata (which `tfds.testing.mock_data` does not have).

  Args:
    source: a prepared builder (see `builder`).
    split: ``"train"`` or ``"test"``.

  Returns:
    ``(images, labels)``: uint8 ``[N, H, W, 3]`` and int32 ``[N]``.

  Raises:
    ConfigError: an empty split, or images of different shapes.
  """
  ds = source.as_dataset(split=split, as_supervised=True, shuffle_files=False)
  if None not in source.info.features["image"].shape:
    # Fixed shape (CIFAR, synthetic): decode in parallel, read in chunks.
    ds = ds.batch(1024)
  else:
    ds = ds.map(lambda x, y: (x[None], y[None]))  # image_folder: any shape.
  images, labels = [], []
  for image, label in ds.prefetch(2).as_numpy_iterator():
    images.extend(image)
    labels.append(label)
  name = source.info.name
  if not images:
    raise ConfigError(f"split {split!r} of {name!r} is empty")
  shapes = {x.shape for x in images}
  if len(shapes) != 1:
    raise ConfigError(
      f"{name!r} split {split!r} has images of shapes {sorted(shapes)}; "
      "resize them to one shape first"
    )
  return (
    np.stack(images).astype(np.uint8),
    np.concatenate(labels).astype(np.int32),
  )


def load(
  name: str,
  data_dir: Optional[str] = None,
  *,
  synthetic_examples: tuple[int, int] = (10_000, 2_000),
) -> Dataset:
  """Reads both splits of data set ``name`` (see `builder` for the args)."""
  source = builder(name, data_dir, synthetic_examples=synthetic_examples)
  train_images, train_labels = read_split(source, "train")
  test_images, test_labels = read_split(source, "test")
  counted = int(max(train_labels.max(), test_labels.max()) + 1)
  label = source.info.features["label"]
  # Mock data and image folders may know fewer classes than they hold.
  num_classes = max(counted, int(getattr(label, "num_classes", 0) or 0))
  return Dataset(
    train_images, train_labels, test_images, test_labels, num_classes
  )
