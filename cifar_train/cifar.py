"""CIFAR10 and CIFAR100 as tfds builders that prepare without TensorFlow.

tfds' own `cifar10` and `cifar100` builders read the archive with
`tf.io.gfile` and encode every image with `tf.image.encode_png`, so preparing
them imports TensorFlow (5-8 s) and needs it installed (1.3 GB). The builders
here are subclasses of tfds' that change only how the archive is read and how
an image is encoded:

* the official binary archive (``cifar-10-binary.tar.gz``) is read with
  `tarfile`, from ``<data_dir>/downloads/manual/`` when it is there, else
  downloaded by tfds' download manager;
* each batch file is parsed with `np.frombuffer` (one label byte, or two for
  CIFAR100, then 3072 bytes of a channel-first 32x32 image);
* each image is a stored PNG written by `png.encode` (~20 us an image; PIL
  takes ~300-500 us on this machine, which alone would cost 20-30 s for
  CIFAR10's 60,000 images).

The records, ids (``train_00000``...), pixels and labels are those of tfds'
preparation; only the PNG bytes differ. The builders keep tfds' names and
versions, so they prepare into ``<data_dir>/cifar10/3.0.2`` like tfds does.
Prepare them to ArrayRecord (``file_format="array_record"``) and read them
with `as_data_source`, which needs no TensorFlow either.

>>> Cifar10.name, str(Cifar10.VERSION)
('cifar10', '3.0.2')
"""

import io
import os
import tarfile
from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.image_classification import cifar as tfds_cifar

from cifar_train import png

IMAGE_SIZE = 32
_IMAGE_BYTES = IMAGE_SIZE * IMAGE_SIZE * 3


def parse_batch(data: bytes, num_labels: int) -> tuple[np.ndarray, np.ndarray]:
  """Parses one binary CIFAR batch file.

  Args:
    data: the file's bytes: records of ``num_labels`` label bytes, then the
      image's 1024 red, 1024 green and 1024 blue bytes, row by row.
    num_labels: 1 (CIFAR10) or 2 (CIFAR100: coarse, then fine).

  Returns:
    ``(labels, images)``: uint8 ``[N, num_labels]`` and ``[N, 32, 32, 3]``.

  Raises:
    ValueError: the size is not a whole number of records.

  >>> record = bytes([7]) + bytes(range(256)) * 12
  >>> labels, images = parse_batch(record, 1)
  >>> labels.tolist(), images.shape, images[0, 0, 1].tolist()
  ([[7]], (1, 32, 32, 3), [1, 1, 1])
  """
  record = num_labels + _IMAGE_BYTES
  if len(data) % record:
    raise ValueError(
      f"a CIFAR batch file of {len(data)} bytes is not a whole number of "
      f"{record}-byte records"
    )
  rows = np.frombuffer(data, np.uint8).reshape(-1, record)
  images = rows[:, num_labels:].reshape(-1, 3, IMAGE_SIZE, IMAGE_SIZE)
  return rows[:, :num_labels], images.transpose(0, 2, 3, 1)


def _archive_members(path: str) -> dict[str, bytes]:
  """``{member name: bytes}`` of every regular file in the tar archive."""
  with tarfile.open(path, "r:*") as tar:
    return {
      m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()
    }


class _TarfileCifar:
  """What the CIFAR builders below change in tfds': no TensorFlow."""

  def manual_archive(self) -> str:
    """Where the archive is read from, when it is there, instead of the web."""
    name = self._cifar_info.url.rsplit("/", 1)[1]
    return os.path.join(self.data_dir_root, "downloads", "manual", name)

  def _archive(self, dl_manager: tfds.download.DownloadManager) -> str:
    manual = self.manual_archive()
    if os.path.exists(manual):
      return manual
    return os.fspath(dl_manager.download(self._cifar_info.url))

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    info = self._cifar_info
    members = _archive_members(self._archive(dl_manager))
    for label_key, label_file in zip(info.label_keys, info.label_files):
      text = members[info.prefix + label_file].decode()
      self.info.features[label_key].names = [n for n in text.split("\n") if n]

    def files(names):
      return [members[info.prefix + name] for name in names]

    return {
      "train": self._generate_examples("train_", files(info.train_files)),
      "test": self._generate_examples("test_", files(info.test_files)),
    }

  def _generate_examples(
    self, split_prefix: str, batch_files: list[bytes]
  ) -> Iterator[tuple[int, dict]]:
    label_keys = self._cifar_info.label_keys
    index = 0  # tfds' key: the example's index in the files' order.
    for data in batch_files:
      labels, images = parse_batch(data, len(label_keys))
      for label, image in zip(labels, images):
        record = {k: int(v) for k, v in zip(label_keys, label)}
        record["id"] = f"{split_prefix}{index:05d}"
        record["image"] = png.encode(image)
        yield index, record
        index += 1


class Cifar10(_TarfileCifar, tfds_cifar.Cifar10, skip_registration=True):
  """tfds' ``cifar10``, prepared without TensorFlow."""

  name = "cifar10"


class Cifar100(_TarfileCifar, tfds_cifar.Cifar100, skip_registration=True):
  """tfds' ``cifar100``, prepared without TensorFlow."""

  name = "cifar100"


BUILDERS = {"cifar10": Cifar10, "cifar100": Cifar100}
_NUM_CLASSES = {
  "cifar10": {"label": 10},
  "cifar100": {"coarse_label": 20, "label": 100},
}


def write_archive(
  path: str,
  name: str,
  train: tuple[np.ndarray, np.ndarray],
  test: tuple[np.ndarray, np.ndarray],
) -> None:
  """Writes a ``.tar.gz`` in the official binary format of CIFAR ``name``.

  For tests and benchmarks: the builders read it as they read the real one.

  Args:
    path: the archive to write.
    name: ``"cifar10"`` (labels ``[N, 1]``, train split over 5 files) or
      ``"cifar100"`` (labels ``[N, 2]``: coarse, fine).
    train: ``(labels, images)``: uint8 ``[N, L]`` and ``[N, 32, 32, 3]``.
    test: the same for the test split.
  """
  info = BUILDERS[name]._cifar_info.fget(BUILDERS[name])  # pylint: disable=protected-access

  def records(labels, images):
    images = np.asarray(images, np.uint8).transpose(0, 3, 1, 2)
    rows = np.concatenate(
      [np.asarray(labels, np.uint8), images.reshape(len(images), -1)], 1
    )
    return rows.tobytes()

  labels, images = train
  parts = np.array_split(np.arange(len(labels)), len(info.train_files))
  files = {
    f: records(labels[p], images[p]) for f, p in zip(info.train_files, parts)
  }
  files[info.test_files[0]] = records(*test)
  for label_key, label_file in zip(info.label_keys, info.label_files):
    count = _NUM_CLASSES[name][label_key]
    files[label_file] = "".join(f"{label_key}{i}\n" for i in range(count))
    files[label_file] = files[label_file].encode()
  with tarfile.open(path, "w:gz") as tar:
    for member, data in files.items():
      entry = tarfile.TarInfo(info.prefix + member)
      entry.size = len(data)
      tar.addfile(entry, io.BytesIO(data))


def write_random_archive(
  data_dir: str, num_train: int = 50_000, num_test: int = 10_000
) -> str:
  """A CIFAR10 archive of random pixels and labels in ``data_dir``'s manual dir.

  For benchmarks: the real archive's size and format (`write_archive`), drawn
  with seed 0, where `Cifar10` looks for a manually placed archive.

  Returns:
    The archive's path.
  """
  archive = Cifar10(data_dir=data_dir).manual_archive()
  os.makedirs(os.path.dirname(archive), exist_ok=True)
  rng = np.random.default_rng(0)

  def split(n):
    labels = rng.integers(0, 10, (n, 1), dtype=np.uint8)
    return labels, rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)

  write_archive(archive, "cifar10", split(num_train), split(num_test))
  return archive
