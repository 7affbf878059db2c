"""Tests of cifar_train.data_sources: CIFAR, image folders, errors (CPU).

Everything is prepared offline: CIFAR from tiny archives in the official
binary format written here, image folders from a few PNG and JPEG files.
"""

import io
import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import PIL.Image
import pytest

from _helpers import no_probe
from _helpers import place_archive

from cifar_train import data_sources
from cifar_train import image_folder
from cifar_train.errors import ConfigError
from cifar_train.errors import DatasetUnavailableError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNTHETIC_EXAMPLES = (120, 40)  # (train, test)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_prepares_offline_from_the_archive_and_reads_back(
  name, tmp_path, monkeypatch
):
  monkeypatch.setattr(data_sources, "network_available", no_probe)
  splits = place_archive(str(tmp_path), name)
  source = data_sources.builder(name, str(tmp_path))
  assert source.info.file_format.value == "array_record"
  label_keys = ["coarse_label", "label"] if name == "cifar100" else ["label"]
  for split, (labels, images) in splits.items():
    # Every record through the data source's own decoding: the id says
    # which example of the archive it is (its index in the files' order).
    records = source.as_data_source(split)
    assert len(records) == len(images)
    ids = []
    for record in records:
      i = int(record["id"].decode().split("_")[1])
      ids.append(i)
      assert record["id"].decode() == f"{split}_{i:05d}"
      np.testing.assert_array_equal(record["image"], images[i])
      for k, key in enumerate(label_keys):
        assert record[key] == labels[i, k]
    assert sorted(ids) == list(range(len(images)))
    # `read_split`'s fast path gives the data source's order and values.
    x, y = data_sources.read_split(source, split)
    np.testing.assert_array_equal(x, images[ids])
    np.testing.assert_array_equal(y, labels[ids, -1])
    assert x.dtype == np.uint8 and y.dtype == np.int32
  assert source.info.features["label"].names[:2] == ["label0", "label1"]
  # Prepared once: a second builder reads the files, the archive is gone.
  os.remove(source.manual_archive())
  again = data_sources.load(name, str(tmp_path))
  assert again.num_classes == (100 if name == "cifar100" else 10)
  np.testing.assert_array_equal(
    np.sort(again.test_labels), np.sort(splits["test"][0][:, -1])
  )


def test_offline_error_is_one_line_of_cause_and_the_how_to(
  monkeypatch, tmp_path
):
  monkeypatch.setattr(data_sources, "network_available", lambda: False)
  with pytest.raises(DatasetUnavailableError) as err:
    data_sources.builder("cifar10", str(tmp_path))
  cause, *how_to = str(err.value).splitlines()
  manual = os.path.join(str(tmp_path), "downloads", "manual")
  for part in ("'cifar10'", str(tmp_path), "network is unreachable"):
    assert part in cause, part
  how_to = "\n".join(how_to)
  for part in (
    "cifar-10-binary.tar.gz",
    manual,
    f"python -m cifar_train.prepare cifar10 --data_dir={tmp_path}",
    "--config.data_dir",
    "smoke.py",
  ):
    assert part in how_to, part
  assert isinstance(err.value, RuntimeError)
  assert not os.path.exists(os.path.join(str(tmp_path), "cifar10"))


def test_the_printed_command_prepares_the_placed_archive(tmp_path):
  place_archive(str(tmp_path), "cifar10", n_train=5, n_test=2)
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "cifar_train.prepare",
      "cifar10",
      f"--data_dir={tmp_path}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert "{'train': 5, 'test': 2}" in out.stdout
  assert os.path.isdir(os.path.join(str(tmp_path), "cifar10", "3.0.2"))


def listening_socket(backlog_full: bool):
  """A loopback server that listens and never accepts.

  With ``backlog_full``, blocking connections fill its accept queue until one
  times out: from then on the kernel drops new SYNs, so a connection to it
  never opens (Linux accepts one or two connections past ``listen(0)``).
  """
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(0)
  clients = []
  if backlog_full:
    for _ in range(16):
      c = socket.socket()
      c.settimeout(0.3)
      try:
        c.connect(server.getsockname())
      except (TimeoutError, socket.timeout):
        c.close()
        break
      clients.append(c)
    else:
      raise AssertionError("16 connections opened without an accept")
  return server, clients


def test_network_probe_on_loopback():
  server, _ = listening_socket(backlog_full=False)
  with server:
    # The kernel completes the handshake; nobody needs to accept.
    assert data_sources.network_available(server.getsockname(), timeout=5)
    address = server.getsockname()
  # Closed: the connection is refused.
  assert not data_sources.network_available(address, timeout=5)


def test_network_probe_gives_up_on_a_connection_that_never_opens():
  server, clients = listening_socket(backlog_full=True)
  try:
    with server:
      assert not data_sources.network_available(
        server.getsockname(), timeout=0.5
      )
  finally:
    for c in clients:
      c.close()


def test_unknown_dataset():
  with pytest.raises(ConfigError, match="cifar10, cifar100, image_folder"):
    data_sources.builder("imagenet")
  with pytest.raises(ConfigError):
    data_sources.load("imagenet")


def write_folder(root, rng, shape=(8, 8, 3)):
  """3 PNGs and one JPEG per class and split; returns {path: pixels}."""
  pixels = {}
  for split in ("train", "test"):
    for label in ("cat", "dog"):
      os.makedirs(root / split / label, exist_ok=True)
      for i in range(3):
        image = rng.integers(0, 256, shape, np.uint8)
        path = root / split / label / f"{i}.png"
        PIL.Image.fromarray(image).save(path)
        pixels[str(path)] = image
      path = root / split / label / "j.jpg"
      PIL.Image.fromarray(rng.integers(0, 256, shape, np.uint8)).save(path)
      # What PIL decodes, not what was encoded: JPEG is lossy.
      pixels[str(path)] = np.asarray(PIL.Image.open(path).convert("RGB"))
  return pixels


def test_image_folder_png_and_jpeg(tmp_path, monkeypatch):
  pixels = write_folder(tmp_path, np.random.default_rng(0))
  data = data_sources.load("image_folder", str(tmp_path))
  assert data.num_classes == 2
  assert data.train_images.shape == (8, 8, 8, 3)
  assert data.test_images.shape == (8, 8, 8, 3)
  for split in ("train", "test"):
    x = getattr(data, f"{split}_images")
    y = getattr(data, f"{split}_labels")
    assert sorted(y.tolist()) == [0] * 4 + [1] * 4
    expected = {
      (p.split(os.sep)[-2], p.split(os.sep)[-1]): v
      for p, v in pixels.items()
      if f"{os.sep}{split}{os.sep}" in p
    }
    seen = set()
    for image, label in zip(x, y):
      name = ("cat", "dog")[label]
      match = [
        k
        for k, v in expected.items()
        if k[0] == name and np.array_equal(v, image)
      ]
      assert len(match) == 1
      seen.add(match[0])
    assert len(seen) == 8
  # Prepared once: a second load reads the records and decodes no file.
  monkeypatch.setattr(image_folder.ImageFolder, "_generate_examples", no_probe)
  again = data_sources.load("image_folder", str(tmp_path))
  np.testing.assert_array_equal(again.train_images, data.train_images)
  monkeypatch.undo()
  # A new file is a new folder: prepared again, with the file.
  extra = np.random.default_rng(1).integers(0, 256, (8, 8, 3), np.uint8)
  PIL.Image.fromarray(extra).save(tmp_path / "train" / "cat" / "new.bmp")
  grown = data_sources.load("image_folder", str(tmp_path))
  assert len(grown.train_images) == 9
  assert any(np.array_equal(extra, x) for x in grown.train_images)


def test_image_folder_of_mixed_shapes_is_refused(tmp_path):
  rng = np.random.default_rng(0)
  write_folder(tmp_path, rng)
  odd = rng.integers(0, 256, (9, 8, 3), np.uint8)
  PIL.Image.fromarray(odd).save(tmp_path / "train" / "dog" / "odd.png")
  with pytest.raises(ConfigError, match="resize them to one shape"):
    data_sources.load("image_folder", str(tmp_path))


def test_image_folder_missing_splits(tmp_path):
  with pytest.raises(ConfigError, match="train/<class>"):
    data_sources.builder("image_folder", str(tmp_path))


def test_a_copy_prepared_in_another_format_is_refused(tmp_path):
  source = data_sources.builder(
    "synthetic", str(tmp_path), synthetic_examples=(20, 10)
  )
  info = os.path.join(str(source.data_dir), "dataset_info.json")
  with open(info) as f:
    record = json.load(f)
  record["fileFormat"] = "tfrecord"
  with open(info, "w") as f:
    json.dump(record, f)
  with pytest.raises(ConfigError, match="prepared as tfrecord"):
    data_sources.builder(
      "synthetic", str(tmp_path), synthetic_examples=(20, 10)
    )


NO_TENSORFLOW = textwrap.dedent(
  """
  import os, sys
  import numpy as np
  import PIL.Image
  sys.path.insert(0, {tests!r})
  from test_data_sources import place_archive, write_folder
  from cifar_train import batches, cli, data_sources, host_stream, loop
  import pathlib
  tmp = pathlib.Path({tmp!r})
  data = data_sources.load("synthetic", str(tmp / "s"), synthetic_examples=(20, 10))
  place_archive(str(tmp / "c"), "cifar10")
  data_sources.load("cifar10", str(tmp / "c"))
  write_folder(tmp / "f", np.random.default_rng(0))
  data_sources.load("image_folder", str(tmp / "f"))
  batch = next(host_stream.train_batches(
      data.train_images, data.train_labels, seed=0, batch_size=4,
      mean=(0.5,) * 3, std=(0.5,) * 3, augment=True, epoch=0))
  print("tensorflow" in sys.modules, sorted(batch))
  """
)


def test_the_data_path_never_imports_tensorflow(tmp_path):
  script = NO_TENSORFLOW.format(
    tests=os.path.join(ROOT, "tests"), tmp=str(tmp_path)
  )
  out = subprocess.run(
    [sys.executable, "-c", script],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().splitlines()[-1] == "False ['image', 'label']"


def test_png_reader_takes_the_fast_path_and_falls_back_to_pil():
  from cifar_train import png  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  image = rng.integers(0, 256, (5, 7, 3), np.uint8)
  stored = png.encode(image)
  assert png._decode_unfiltered(stored) is not None  # pylint: disable=protected-access
  np.testing.assert_array_equal(png.decode(stored), image)
  np.testing.assert_array_equal(
    np.asarray(PIL.Image.open(io.BytesIO(stored))), image
  )
  for fmt, mode in (("PNG", "RGB"), ("PNG", "L"), ("BMP", "RGB")):
    buffer = io.BytesIO()
    PIL.Image.fromarray(image).convert(mode).save(buffer, format=fmt)
    expected = np.asarray(
      PIL.Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    )
    np.testing.assert_array_equal(png.decode(buffer.getvalue()), expected)


def test_png_batch_reader_equals_one_by_one():
  from cifar_train import png  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (6, 32, 32, 3), np.uint8)
  stored = [png.encode(x) for x in images]
  together = png.decode_many(stored)
  assert isinstance(together, np.ndarray)  # The one-gather path.
  np.testing.assert_array_equal(together, images)
  # One file of another kind: every file is decoded on its own, correctly.
  buffer = io.BytesIO()
  PIL.Image.fromarray(images[2]).save(buffer, format="PNG")
  mixed = png.decode_many(stored[:2] + [buffer.getvalue()] + stored[3:])
  assert isinstance(mixed, list)
  np.testing.assert_array_equal(np.stack(mixed), images)
  # Images of two sizes: each decoded on its own.
  small = rng.integers(0, 256, (16, 16, 3), np.uint8)
  sizes = png.decode_many(stored[:2] + [png.encode(small)])
  assert isinstance(sizes, list)
  np.testing.assert_array_equal(sizes[2], small)
