"""An image folder as a tfds builder, prepared once to ArrayRecord.

``root/train/<class>/*`` and ``root/test/<class>/*``, any image type that PIL
reads (PNG, JPEG, BMP, ...). `tfds.ImageFolder` needs TensorFlow and decodes
every file again on every run (43-48 s for the 60,000 CIFAR10 JPEGs); this
builder decodes each file once, converts it to RGB and stores it as a PNG
(`png.encode`) in ArrayRecord files, so that a later run reads the folder as
fast as a prepared CIFAR10.

The prepared copy lives in the tfds data dir under
``image_folder/<config>/1.0.0``, where the config name is a digest of the
folder's path and of every file's name, size and modification time: a folder
whose files change is prepared again, into a new directory.

Classes are the sorted names of the class directories of both splits; a
class may be missing from ``test``.

>>> import os, tempfile
>>> root = tempfile.mkdtemp()
>>> for split in ("train", "test"):
...   os.makedirs(os.path.join(root, split, "cat"))
>>> scan(root)["classes"]
['cat']
"""

import dataclasses
import hashlib
import os

from etils import epath
import tensorflow_datasets as tfds

from cifar_train import png

SPLITS = ("train", "test")


def scan(root: str) -> dict:
  """``{"classes": [...], "files": {split: [(path, label), ...]}, "digest"}``.

  Files are sorted by class, then name. Hidden files are skipped.
  """
  classes = sorted(
    {
      c
      for split in SPLITS
      for c in os.listdir(os.path.join(root, split))
      if os.path.isdir(os.path.join(root, split, c)) and not c.startswith(".")
    }
  )
  digest = hashlib.sha256(os.path.abspath(root).encode())
  files = {}
  for split in SPLITS:
    files[split] = []
    for label, name in enumerate(classes):
      directory = os.path.join(root, split, name)
      if not os.path.isdir(directory):
        continue
      for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith(".") or not entry.is_file():
          continue
        stat = entry.stat()
        digest.update(
          f"{split}/{name}/{entry.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode()
        )
        files[split].append((entry.path, label))
  return {"classes": classes, "files": files, "digest": digest.hexdigest()}


@dataclasses.dataclass(eq=False)
class FolderConfig(tfds.core.BuilderConfig):
  """One image folder, as scanned by `scan`.

  Attributes:
    root: the folder holding ``train/`` and ``test/``.
    classes: the class names, sorted.
    files: ``{split: [(path, label), ...]}``.
  """

  root: str = ""
  classes: tuple[str, ...] = ()
  files: dict = dataclasses.field(default_factory=dict, repr=False)


def folder_config(root: str) -> FolderConfig:
  """The config of the folder at ``root``, named by the digest of its files."""
  found = scan(root)
  return FolderConfig(
    name=f"{os.path.basename(os.path.abspath(root))}-{found['digest'][:16]}",
    description=f"The image folder {os.path.abspath(root)}.",
    root=os.path.abspath(root),
    classes=tuple(found["classes"]),
    files=found["files"],
  )


class ImageFolder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """``root/{train,test}/<class>/*`` prepared to records of RGB PNGs.

  Construct it with ``config=folder_config(root)``; prepare it with
  ``DownloadConfig(try_download_gcs=False)`` (nothing is on GCS).
  """

  name = "image_folder"
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  # tfds infers these from the package with `importlib.resources`, which fails
  # for a namespace package; nothing (no checksums file) is read from them.
  pkg_dir_path = epath.Path(__file__).parent
  code_path = epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    classes = list(self.builder_config.classes) or None
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(shape=(None, None, 3)),
          "label": tfds.features.ClassLabel(names=classes)
          if classes
          else tfds.features.ClassLabel(num_classes=1),
          "file_name": tfds.features.Text(),
        }
      ),
      supervised_keys=("image", "label"),
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # Nothing to download.
    files = self.builder_config.files
    return {split: self._generate_examples(files[split]) for split in SPLITS}

  def _generate_examples(self, files):
    root = self.builder_config.root
    for path, label in files:
      with open(path, "rb") as f:
        image = png.decode(f.read())
      name = os.path.relpath(path, root)
      yield (
        name,
        {"image": png.encode(image), "label": label, "file_name": name},
      )
