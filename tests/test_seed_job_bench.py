"""bench/seed_job.py: an image folder packed into one archive and unpacked."""

import os
import tarfile

import pytest

from _helpers import bench_module


def _seed_job():
  return bench_module("seed_job")


def _tree(root):
  """``{relative path: bytes}`` of every file under ``root``'s splits."""
  out = {}
  for split in ("train", "test"):
    for folder, _, files in os.walk(os.path.join(root, split)):
      for name in files:
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
          out[os.path.relpath(path, root)] = f.read()
  return out


def test_a_packed_folder_unpacks_to_the_same_files_once(tmp_path):
  """pack, then unpacked: the same bytes; again: kept; a new archive: redone."""
  seed_job = _seed_job()
  folder = tmp_path / "images"
  for split, classes in (("train", ("cat", "dog")), ("test", ("cat", "dog"))):
    for c in classes:
      (folder / split / c).mkdir(parents=True)
      for i in range(3):
        (folder / split / c / f"{i}.jpg").write_bytes(
          os.urandom(50) + f"{split}{c}{i}".encode()
        )
  (folder / "README").write_text("not a split")
  archive = seed_job.pack(str(folder), str(tmp_path / "w" / "images.tar.xz"))
  root = str(tmp_path / "unpacked")
  dest = seed_job.unpacked(archive, root)
  assert dest == os.path.join(root, "images")
  assert _tree(dest) == _tree(str(folder)) and len(_tree(dest)) == 12
  assert not os.path.exists(os.path.join(dest, "README"))
  assert seed_job.unpacked(str(folder), root) == str(folder)  # A folder.
  # Unchanged archive: found as it was, not extracted again.
  marker = os.path.join(dest, "train", "cat", "0.jpg")
  with open(marker, "wb") as f:
    f.write(b"edited")
  assert seed_job.unpacked(archive, root) == dest
  with open(marker, "rb") as f:
    assert f.read() == b"edited"
  # A new archive of the same name: extracted afresh.
  (folder / "test" / "dog" / "0.jpg").write_bytes(b"new")
  os.remove(archive)
  seed_job.pack(str(folder), archive)
  assert _tree(seed_job.unpacked(archive, root)) == _tree(str(folder))


def test_pack_and_unpacked_name_a_missing_split(tmp_path):
  """A folder or an archive without test/ is an error that says so."""
  seed_job = _seed_job()
  (tmp_path / "f" / "train" / "cat").mkdir(parents=True)
  with pytest.raises(ValueError, match="has no test/ folder"):
    seed_job.pack(str(tmp_path / "f"), str(tmp_path / "a.tar.xz"))

  with tarfile.open(tmp_path / "b.tar.xz", "w:xz") as tar:
    tar.add(tmp_path / "f" / "train", arcname="train")
  with pytest.raises(ValueError, match="holds no test/ folder"):
    seed_job.unpacked(str(tmp_path / "b.tar.xz"), str(tmp_path / "u"))


def test_torch_script_reads_an_image_folder_without_torchvision(
  tmp_path, monkeypatch
):
  """read_image_folder: the pixels, labels by sorted class name, files sorted."""
  pytest.importorskip("torch")
  import numpy as np
  import PIL.Image

  seed_torch = bench_module("seed_torch")
  rng = np.random.default_rng(0)
  expected = {}
  for name in ("zebra", "ant", "cat"):  # Label order: ant 0, cat 1, zebra 2.
    (tmp_path / name).mkdir()
    for file in ("b.png", "a.png"):
      pixels = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
      PIL.Image.fromarray(pixels).save(tmp_path / name / file)
      expected[(name, file)] = pixels
  # The directory listings come in reverse order: the reader must sort.
  listdir, scandir = os.listdir, os.scandir
  monkeypatch.setattr(os, "listdir", lambda p: sorted(listdir(p))[::-1])
  monkeypatch.setattr(
    os, "scandir", lambda p: sorted(scandir(p), key=lambda e: e.name)[::-1]
  )
  images, labels, classes = seed_torch.read_image_folder(str(tmp_path))
  assert classes == ["ant", "cat", "zebra"]
  np.testing.assert_array_equal(labels, [0, 0, 1, 1, 2, 2])
  order = [(c, f) for c in classes for f in ("a.png", "b.png")]
  np.testing.assert_array_equal(images, np.stack([expected[k] for k in order]))
