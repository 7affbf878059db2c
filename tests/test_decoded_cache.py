"""The decoded copy of each split that `data_sources.read_split` keeps."""

import os

import numpy as np
import pytest

from cifar_train import data_sources

EXAMPLES = (24, 8)  # (train, test) of the synthetic set.


def _source(data_dir):
  return data_sources.builder(
    "synthetic", str(data_dir), synthetic_examples=EXAMPLES
  )


def _copy_path(source, split):
  return os.path.join(
    str(source.data_dir), f"{source.info.name}-{split}.decoded-uint8.npz"
  )


def _records_unread(monkeypatch):
  """Makes reading the ArrayRecord files fail: only the copy can answer."""

  def fail(source, split):
    raise AssertionError(f"read the records of {split!r}")

  monkeypatch.setattr(data_sources, "read_records", fail)


@pytest.fixture(name="source")
def fixture_source(tmp_path):
  return _source(tmp_path)


def test_first_read_writes_the_copy_and_later_reads_use_it(source, monkeypatch):
  want = {s: data_sources.read_records(source, s) for s in ("train", "test")}
  for split in ("train", "test"):
    assert not os.path.exists(_copy_path(source, split))
    x, y = data_sources.read_split(source, split)
    assert os.path.exists(_copy_path(source, split))
    np.testing.assert_array_equal(x, want[split][0])
    np.testing.assert_array_equal(y, want[split][1])
  _records_unread(monkeypatch)
  for split in ("train", "test"):
    x, y = data_sources.read_split(source, split)
    assert x.dtype == np.uint8 and y.dtype == np.int32
    assert x.shape == (EXAMPLES[split == "test"], 32, 32, 3)
    # Mapped from the file (the page cache), not copied into memory.
    assert not x.flags.writeable and not x.flags.owndata
    np.testing.assert_array_equal(x, want[split][0])
    np.testing.assert_array_equal(y, want[split][1])


def test_records_prepared_again_make_the_copy_stale(source, monkeypatch):
  x, y = data_sources.read_split(source, "train")
  record = next(
    os.path.join(str(source.data_dir), f)
    for f in sorted(os.listdir(str(source.data_dir)))
    if f.startswith(f"{source.info.name}-train.array_record")
  )
  stat = os.stat(record)
  os.utime(record, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  calls = []
  real = data_sources.read_records

  def counting(source, split):
    calls.append(split)
    return real(source, split)

  monkeypatch.setattr(data_sources, "read_records", counting)
  x2, y2 = data_sources.read_split(source, "train")
  assert calls == ["train"]
  np.testing.assert_array_equal(x2, x)
  np.testing.assert_array_equal(y2, y)
  data_sources.read_split(source, "train")  # Rewritten: used again.
  assert calls == ["train"]


@pytest.mark.parametrize(
  "damage", ["truncated", "garbage", "flipped byte", "other shape"]
)
def test_a_damaged_copy_is_read_again_from_the_records(source, damage):
  x, y = data_sources.read_split(source, "train")
  path = _copy_path(source, "train")
  if damage == "truncated":
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  elif damage == "garbage":
    with open(path, "wb") as f:
      f.write(b"not an npz")
  elif damage == "flipped byte":  # In the pixels, the file's bulk.
    with open(path, "r+b") as f:
      f.seek(os.path.getsize(path) // 2)
      byte = f.read(1)
      f.seek(-1, os.SEEK_CUR)
      f.write(bytes([byte[0] ^ 1]))
  else:  # Valid file, right key, wrong content.
    with np.load(path) as f:
      key = f["key"]
    np.savez(path, images=x[:, :, :, 0], labels=y, key=key)
  x2, y2 = data_sources.read_split(source, "train")
  np.testing.assert_array_equal(x2, x)
  np.testing.assert_array_equal(y2, y)
  with np.load(path) as f:  # Rewritten whole.
    np.testing.assert_array_equal(f["images"], x)


def test_a_read_only_data_dir_reads_the_records_each_time(source):
  if os.geteuid() == 0:
    # root writes through permissions: make the copy's name a directory.
    os.makedirs(_copy_path(source, "test"))
  else:
    os.chmod(str(source.data_dir), 0o555)
  try:
    x, y = data_sources.read_split(source, "test")
    x2, y2 = data_sources.read_split(source, "test")
  finally:
    os.chmod(str(source.data_dir), 0o755)
  want = data_sources.read_records(source, "test")
  np.testing.assert_array_equal(x, want[0])
  np.testing.assert_array_equal(x2, want[0])
  np.testing.assert_array_equal(y2, want[1])
  assert not [
    f for f in os.listdir(str(source.data_dir)) if ".tmp-" in f
  ]  # No partial copy left behind.
