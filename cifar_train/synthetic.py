"""A procedural, offline CIFAR10-shaped data set: the `jaxmp_synthetic` builder.

It needs no download: every image is drawn from a seeded numpy generator, so
the same `SyntheticConfig` always writes the same records. It stands in for
CIFAR10 in smoke tests and on machines without internet.

Each of the 10 classes has its own colour pair (a foreground hue and a darker
background) and its own stripe frequency. Stripes run horizontally or
vertically; both survive a horizontal flip and a 4 pixel random crop (a flip
or shift only changes their phase). Every example gets a random phase,
orientation, brightness, colour shift, a distracting rectangle of random
colour and per-pixel noise, so it is not a lookup table, but a narrow ResNet18
reaches >= 90% test accuracy in a few hundred steps.

>>> images, labels = make_examples(20, seed=0, split="train")
>>> images.shape, images.dtype.name, labels.dtype.name
((20, 32, 32, 3), 'uint8', 'int64')
"""

import colorsys
import dataclasses

from etils import epath
import numpy as np
import tensorflow_datasets as tfds

from cifar_train import png

NUM_CLASSES = 10
IMAGE_SIZE = 32
_SPLIT_IDS = {"train": 0, "test": 1}


def _palette() -> tuple[np.ndarray, np.ndarray]:
  """Returns per-class foreground and background colours, float [10, 3]."""
  fg, bg = [], []
  for k in range(NUM_CLASSES):
    hue = k / NUM_CLASSES
    fg.append(colorsys.hsv_to_rgb(hue, 0.85, 0.95))
    # The background hue is shifted so that classes differ in both colours.
    bg.append(colorsys.hsv_to_rgb((hue + 0.37) % 1.0, 0.6, 0.35))
  return 255.0 * np.asarray(fg), 255.0 * np.asarray(bg)


def make_examples(
  num_examples: int, *, seed: int, split: str
) -> tuple[np.ndarray, np.ndarray]:
  """Draws a split of the synthetic data set, deterministically.

  Args:
    num_examples: how many examples to draw.
    seed: data seed; the split name is folded in, so `train` and `test` differ.
    split: "train" or "test".

  Returns:
    `(images, labels)`: uint8 `[num_examples, 32, 32, 3]` and int64
    `[num_examples]`, classes balanced up to one example.
  """
  rng = np.random.default_rng([seed, _SPLIT_IDS[split]])
  n = num_examples
  labels = rng.permutation(np.arange(n) % NUM_CLASSES)
  fg, bg = _palette()
  freq = 1.5 + 0.75 * np.arange(NUM_CLASSES)  # Stripes per image side.

  coords = np.arange(IMAGE_SIZE, dtype=np.float32) / IMAGE_SIZE
  horizontal = rng.random(n) < 0.5
  phase = rng.uniform(0, 2 * np.pi, (n, 1)).astype(np.float32)
  f = (freq[labels] * rng.uniform(0.9, 1.1, n)).astype(np.float32)[:, None]
  wave = 0.5 + 0.5 * np.sin(2 * np.pi * f * coords + phase)  # [n, 32]
  # Horizontal stripes vary along rows, vertical ones along columns.
  mix = np.where(horizontal[:, None, None], wave[:, :, None], wave[:, None, :])[
    ..., None
  ]  # [n, 32, 32, 1]

  # Per-example brightness and colour shift, folded into two [n, 1, 1, 3]
  # terms so that the full-size arithmetic is one multiply and one add.
  brightness = rng.uniform(0.75, 1.25, (n, 1, 1, 1))
  shift = rng.normal(0.0, 12.0, (n, 1, 1, 3))
  base = (bg[labels][:, None, None, :] * brightness + shift).astype(np.float32)
  scale = ((fg - bg)[labels][:, None, None, :] * brightness).astype(np.float32)
  images = mix * scale + base

  # A distracting rectangle of random colour at a random place.
  size = rng.integers(6, 13, (n, 2))
  top_left = rng.integers(0, IMAGE_SIZE - 6, (n, 2))
  pixels = np.arange(IMAGE_SIZE)
  in_rows = (pixels >= top_left[:, :1]) & (
    pixels < top_left[:, :1] + size[:, :1]
  )
  in_cols = (pixels >= top_left[:, 1:]) & (
    pixels < top_left[:, 1:] + size[:, 1:]
  )
  box = (in_rows[:, :, None] & in_cols[:, None, :])[..., None]
  box_colour = rng.uniform(0, 255, (n, 1, 1, 3)).astype(np.float32)
  np.copyto(images, box_colour, where=box)

  # Uniform integer noise in [-32, 32) (std ~18); integers are ~4x cheaper to
  # draw than normals, which matters on small CPUs.
  images += rng.integers(0, 64, images.shape, dtype=np.uint8)
  images -= 32.0
  np.clip(images, 0, 255, out=images)
  images = images.astype(np.uint8)
  return images, labels.astype(np.int64)


@dataclasses.dataclass(eq=False)
class SyntheticConfig(tfds.core.BuilderConfig):
  """Sizes and seed of the synthetic data set.

  Use `synthetic_config` to build one: it puts the sizes and seed into the
  config name, so data sets of different sizes live in different directories
  of the tfds cache (`<data_dir>/jaxmp_synthetic/<name>/<version>`).

  Attributes:
    num_train: number of `train` examples.
    num_test: number of `test` examples.
    data_seed: seed of the generator.
  """

  num_train: int = 10_000
  num_test: int = 2_000
  data_seed: int = 0


def synthetic_config(
  num_train: int = 10_000, num_test: int = 2_000, data_seed: int = 0
) -> SyntheticConfig:
  """Returns a `SyntheticConfig` named after its sizes and seed."""
  return SyntheticConfig(
    name=f"train{num_train}_test{num_test}_seed{data_seed}",
    num_train=num_train,
    num_test=num_test,
    data_seed=data_seed,
    description="Procedural 10-class 32x32 images (see cifar_train/synthetic.py).",
  )


class JaxmpSynthetic(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Procedural CIFAR10-shaped data set; `download_and_prepare` needs no network.

  Not registered by name (`skip_registration`): construct the class, which
  also keeps a second import of this module (doctests) from failing.
  Prepare it with `DownloadConfig(try_download_gcs=False)`: it is not on GCS,
  and tfds' GCS probe retries for minutes offline. The app prepares it to
  ArrayRecord (``file_format="array_record"``), without TensorFlow.

  >>> import tempfile
  >>> builder = JaxmpSynthetic(
  ...     data_dir=tempfile.mkdtemp(), config=synthetic_config(20, 10))
  >>> builder.info.features["label"].num_classes
  10
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  BUILDER_CONFIGS = [synthetic_config()]
  # tfds infers these from the package with `importlib.resources`, which fails
  # for a namespace package; nothing (no checksums file) is read from them.
  pkg_dir_path = epath.Path(__file__).parent
  code_path = epath.Path(__file__)

  def __init__(self, *, config: SyntheticConfig | str | None = None, **kwargs):
    # tfds refuses a config instance that shares its name with a registered
    # one (it compares by identity); pass the registered one's name instead.
    if isinstance(config, SyntheticConfig) and config.name in {
      c.name for c in self.BUILDER_CONFIGS
    }:
      config = config.name
    super().__init__(config=config, **kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Image(shape=(IMAGE_SIZE, IMAGE_SIZE, 3)),
          "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
        }
      ),
      supervised_keys=("image", "label"),
      homepage="https://github.com/jaxmp/jaxmp",
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # Nothing to download.
    cfg = self.builder_config
    return {
      "train": self._generate_examples("train", cfg.num_train, cfg.data_seed),
      "test": self._generate_examples("test", cfg.num_test, cfg.data_seed),
    }

  def _generate_examples(self, split: str, num_examples: int, seed: int):
    images, labels = make_examples(num_examples, seed=seed, split=split)
    for i in range(num_examples):
      yield i, {"image": png.encode(images[i]), "label": int(labels[i])}
