"""Data sources: whole splits read into uint8 numpy arrays, without TensorFlow.

CIFAR10/100 (`cifar`), an image folder (`image_folder`) or the synthetic set
(`synthetic`): each a tfds builder, prepared once to ArrayRecord files and
read through its random-access data source (`as_data_source`), neither of
which imports TensorFlow.

`load` prepares the builder if needed and reads both splits (CIFAR10 is
180 MB). When CIFAR is not prepared, its archive is not in the manual dir and
the network is unreachable, it fails in seconds with a message that says how
to provide the data, instead of letting tfds retry for minutes.
"""

import dataclasses
import glob
import io
import json
import math
import mmap
import os
import socket
import struct
import threading
import zipfile
import zlib
from typing import Optional

import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.proto import tf_example_pb2

from cifar_train import cifar
from cifar_train import image_folder
from cifar_train import png
from cifar_train import synthetic
from cifar_train.errors import ConfigError
from cifar_train.errors import DatasetUnavailableError

_CIFAR_ARCHIVES = {
  "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
  "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",
}
_PROBE_ADDRESS = ("www.cs.toronto.edu", 443)
_PROBE_TIMEOUT_S = 2.0
DATASETS = ("cifar10", "cifar100", "image_folder", "synthetic")
FORMAT = "array_record"  # Random access, read without TensorFlow.
_CHUNK = 4096  # Records per `__getitems__` call.
# The decoded copy of a split, beside its ArrayRecord files (`read_split`).
_DECODED = "{name}-{split}.decoded-uint8.npz"
_DECODED_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Both splits in host memory.

  The images are read-only where they are mapped from a split's decoded
  copy (`read_split`).

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


def _unavailable_message(name: str, source: tfds.core.DatasetBuilder) -> str:
  data_dir = str(source.data_dir_root)
  url = _CIFAR_ARCHIVES[name]
  manual = source.manual_archive()
  return (
    f"Data set {name!r} is not prepared in the tfds data dir {data_dir!r} "
    f"(looked for {str(source.data_dir)!r}), its archive is not at "
    f"{manual!r}, and the network is unreachable.\n"
    f"To provide it, download {url} on any machine and place the archive, "
    f"not unpacked, at {manual}; then run\n"
    f"  python -m cifar_train.prepare {name} --data_dir={data_dir}\n"
    "or just train: the first run prepares it (about half a minute). "
    "Or select another tfds data dir with --config.data_dir=DIR, or train "
    "on offline synthetic data with --config=configs/smoke.py "
    "(config.dataset='synthetic')."
  )


_NO_GCS = tfds.download.DownloadConfig(try_download_gcs=False)


def _construct(cls, data_dir, **kwargs) -> tfds.core.DatasetBuilder:
  """``cls(...)`` reading ArrayRecord; refuses a copy in another format."""
  try:
    return cls(data_dir=data_dir, file_format=FORMAT, **kwargs)
  except ValueError as e:
    if "File format is already set" not in str(e):
      raise
    # tfds read the prepared copy's dataset_info.json: it is TFRecord.
    found = cls(data_dir=data_dir, **kwargs)
    stored = getattr(found.info.file_format, "value", found.info.file_format)
    raise ConfigError(
      f"{found.name!r} in {str(found.data_dir)!r} is prepared as {stored}, "
      "which the app does not read; move that directory away (the app then "
      "prepares ArrayRecord in its place) or choose another "
      "--config.data_dir"
    ) from None


def _prepare(source: tfds.core.DatasetBuilder, download_config=None):
  """Prepares ``source`` unless it is."""
  if not source.is_prepared():
    source.download_and_prepare(download_config=download_config)
  return source


def builder(
  name: str,
  data_dir: Optional[str] = None,
  *,
  synthetic_examples: tuple[int, int] = (10_000, 2_000),
) -> tfds.core.DatasetBuilder:
  """Returns the tfds builder of data set ``name``, prepared to ArrayRecord.

  Preparing is done once; later calls find the prepared files.

  Args:
    name: ``"cifar10"``, ``"cifar100"``, ``"image_folder"`` or
      ``"synthetic"``.
    data_dir: the tfds data dir (``None``: tfds's default); for
      ``image_folder`` the root holding ``train/`` and ``test/`` (prepared
      into its ``.tfds`` subdirectory).
    synthetic_examples: train and test sizes of the synthetic set.

  Raises:
    ConfigError: an unknown name, or an image folder without its splits.
    DatasetUnavailableError: CIFAR is not prepared, its archive is not in
      the manual dir and there is no network.
  """
  data_dir = data_dir or None
  if name == "image_folder":
    if not data_dir or not all(
      os.path.isdir(os.path.join(data_dir, s)) for s in image_folder.SPLITS
    ):
      raise ConfigError(
        "dataset='image_folder' needs config.data_dir to be a directory "
        f"with train/<class>/<images> and test/<class>/<images>; got {data_dir!r}"
      )
    source = _construct(
      image_folder.ImageFolder,
      os.path.join(data_dir, ".tfds"),
      config=image_folder.folder_config(data_dir),
    )
    return _prepare(source, _NO_GCS)
  if name == "synthetic":
    source = _construct(
      synthetic.JaxmpSynthetic,
      data_dir,
      config=synthetic.synthetic_config(*synthetic_examples),
    )
    # Not on GCS, and probing for it offline retries for minutes.
    return _prepare(source, _NO_GCS)
  if name in _CIFAR_ARCHIVES:
    source = _construct(cifar.BUILDERS[name], data_dir)
    if not source.is_prepared() and not os.path.exists(source.manual_archive()):
      if not network_available():
        raise DatasetUnavailableError(_unavailable_message(name, source))
    # The GCS probe retries for minutes offline, and GCS holds TFRecords.
    return _prepare(source, _NO_GCS)
  raise ConfigError(
    f"unknown dataset {name!r}; valid: cifar10, cifar100, "
    "image_folder, synthetic"
  )


def _fields(record: bytes) -> tuple[bytes, int]:
  """``(image bytes, label)`` of one serialized `tf.train.Example`."""
  feature = tf_example_pb2.Example.FromString(record).features.feature
  return (
    feature["image"].bytes_list.value[0],
    feature["label"].int64_list.value[0],
  )


def _split_files(source: tfds.core.DatasetBuilder, split: str) -> dict:
  """Name, size and mtime of each ArrayRecord file of ``split``.

  The key of the split's decoded copy: preparing the data set again (or
  growing an image folder, which makes a new config) changes it.
  """
  pattern = os.path.join(
    str(source.data_dir), f"{source.info.name}-{split}.{FORMAT}*"
  )
  key = {"version": _DECODED_VERSION, "files": []}
  for path in sorted(glob.glob(pattern)):
    stat = os.stat(path)
    key["files"].append(
      [os.path.basename(path), stat.st_size, stat.st_mtime_ns]
    )
  return key


def _mapped(path: str, archive: zipfile.ZipFile, name: str) -> np.ndarray:
  """Array ``name`` of the uncompressed ``.npz`` at ``path``, memory-mapped.

  Read-only and backed by the page cache, where a previous run left the
  file: no copy in the process's own memory, which on a VM can cost seconds
  to touch (the host hands each page back first). The member's CRC-32 is
  checked, as reading it would.

  Raises:
    zipfile.BadZipFile: the member is damaged.
    OSError, ValueError: it cannot be mapped (compressed, a file system
      without ``mmap``, an ``.npy`` header this reader does not know).
  """
  info = archive.getinfo(f"{name}.npy")
  if info.compress_type != zipfile.ZIP_STORED:
    raise ValueError(f"{name}.npy is compressed")
  with open(path, "rb") as f:
    f.seek(info.header_offset)
    local = f.read(30)  # The member's local header, then its name and extra.
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
      raise zipfile.BadZipFile(f"{name}.npy: no local header")
    name_len, extra_len = struct.unpack("<HH", local[26:])
    start = info.header_offset + 30 + name_len + extra_len
    whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  member = memoryview(whole)[start : start + info.file_size]
  if len(member) != info.file_size or zlib.crc32(member) != info.CRC:
    raise zipfile.BadZipFile(f"{name}.npy: bad CRC-32")
  header = io.BytesIO(member[: min(len(member), 1 << 16)])
  version = np.lib.format.read_magic(header)
  if version == (1, 0):
    shape, fortran, dtype = np.lib.format.read_array_header_1_0(header)
  elif version == (2, 0):
    shape, fortran, dtype = np.lib.format.read_array_header_2_0(header)
  else:
    raise ValueError(f"{name}.npy: .npy version {version}")
  if fortran or dtype.hasobject:
    raise ValueError(f"{name}.npy: not a C-ordered plain array")
  count = math.prod(shape)
  return np.frombuffer(member, dtype, count, header.tell()).reshape(shape)


def _read_decoded(path: str, key: dict):
  """The decoded copy's ``(images, labels)``, or None.

  None when there is no copy, it was made from other record files than
  ``key`` names, or it is damaged. The images are memory-mapped
  (`_mapped`), read-only; read into memory where they cannot be.
  """
  try:
    with np.load(path, allow_pickle=False) as f:
      if json.loads(f["key"].tobytes().decode()) != key:
        return None
      labels = f["labels"]
      try:
        images = _mapped(path, f.zip, "images")
      except (OSError, ValueError):
        images = f["images"]
  except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
    return None  # Derived data: read the records again and rewrite it.
  if (
    images.dtype != np.uint8
    or images.ndim != 4
    or labels.shape != images.shape[:1]
  ):
    return None
  return images, labels.astype(np.int32, copy=False)


def _write_decoded(path: str, key: dict, images, labels) -> None:
  """Writes the decoded copy atomically; skipped where the dir is read-only."""
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    with open(tmp, "wb") as f:
      np.savez(
        f,
        images=images,
        labels=labels,
        key=np.frombuffer(json.dumps(key).encode(), np.uint8),
      )
    os.replace(tmp, path)
  except OSError:  # A shared, read-only data dir: read the records each run.
    try:
      os.remove(tmp)
    except OSError:
      pass


def read_split(
  source: tfds.core.DatasetBuilder, split: str
) -> tuple[np.ndarray, np.ndarray]:
  """Reads a whole split into memory, from its decoded copy when it has one.

  The first read goes through the ArrayRecord data source (`read_records`)
  and writes the pixels and labels beside the records as one uncompressed
  ``.npz`` (``<name>-<split>.decoded-uint8.npz``, keyed by the record files'
  names, sizes and mtimes); later runs map that file's pixels read-only
  (`_mapped`; 0.07 s for CIFAR10 instead of ~1 s of record parsing, more
  for image folders of JPEGs).
  A stale or damaged copy is rewritten; a read-only data dir gets none.

  Args:
    source: a prepared builder (see `builder`).
    split: ``"train"`` or ``"test"``.

  Returns:
    ``(images, labels)``: uint8 ``[N, H, W, 3]`` and int32 ``[N]``, in the
    data source's order.

  Raises:
    ConfigError: an empty split, or images of different shapes.
  """
  key = _split_files(source, split)
  path = os.path.join(
    str(source.data_dir), _DECODED.format(name=source.info.name, split=split)
  )
  if key["files"]:
    found = _read_decoded(path, key)
    if found is not None:
      return found
  images, labels = read_records(source, split)
  if key["files"]:
    _write_decoded(path, key, images, labels)
  return images, labels


def read_records(
  source: tfds.core.DatasetBuilder, split: str
) -> tuple[np.ndarray, np.ndarray]:
  """Reads a whole split through its ArrayRecord data source.

  Records are read as raw bytes in chunks (`__getitems__`), then each
  `tf.train.Example` is parsed with its protobuf and the PNGs decoded with
  `png.decode_many`: ~20x faster than the data source's own decoding,
  which takes ~0.5 ms a record through tfds' feature decoders and PIL. The split's order
  is the data source's, the order tfds' own readers give.

  Args:
    source: a prepared builder (see `builder`).
    split: ``"train"`` or ``"test"``.

  Returns:
    ``(images, labels)``: uint8 ``[N, H, W, 3]`` and int32 ``[N]``.

  Raises:
    ConfigError: an empty split, or images of different shapes.
  """
  records = source.as_data_source(
    split, deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES
  )
  name = source.info.name
  n = len(records)
  if not n:
    raise ConfigError(f"split {split!r} of {name!r} is empty")
  encoded, labels = [], np.empty(n, np.int32)
  for start in range(0, n, _CHUNK):
    chunk = records.__getitems__(range(start, min(start + _CHUNK, n)))
    for i, record in enumerate(chunk, start):
      image, labels[i] = _fields(record)
      encoded.append(image)
  images = png.decode_many(encoded)
  if isinstance(images, np.ndarray):
    return images, labels
  shapes = {x.shape for x in images}
  if len(shapes) != 1:
    raise ConfigError(
      f"{name!r} split {split!r} has images of shapes {sorted(shapes)}; "
      "resize them to one shape first"
    )
  return np.stack(images), labels


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
