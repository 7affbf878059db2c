"""CIFAR-style input pipeline: load a split, stream augmented batches, evaluate.

Everything here is a pure function of the config and its arguments:

* `load_split` reads a whole split into uint8 numpy arrays (CIFAR10 is 150 MB).
* `train_batches` streams one epoch of augmented, normalised batches through
  `tf.data`. The order is a permutation seeded by `(seed, epoch)` and every
  random crop and flip is drawn by a stateless op from `(seed, epoch, batch)`,
  so the stream is a function of `(seed, epoch)` alone: `start_batch=k`
  resumes it bitwise, and it does not depend on `process_count`.
* `eval_batches` yields every example exactly once, with a padded last batch
  and a mask, so that the eval step never recompiles.
* `device_augment`, `normalize` and `device_epoch_permutation` do the same in
  `jax.numpy`, for a data set kept on the accelerator (airbench style).

Images must have one fixed shape per data set (CIFAR: 32x32x3); this module
does not resize.
"""

from collections.abc import Iterator, Sequence
import os
import socket
import threading
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from jaxmp._src import synthetic

try:
  # TensorFlow only feeds the host; keep it off the GPU that JAX uses.
  tf.config.set_visible_devices([], "GPU")
except (RuntimeError, ValueError):  # Devices already initialised.
  pass

DATASETS = ("cifar10", "cifar100", "image_folder", "synthetic")
PAD = 4  # Random-crop padding, in pixels.
_CIFAR_ARCHIVES = {
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
    "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",
}
_PROBE_ADDRESS = ("www.cs.toronto.edu", 443)
_PROBE_TIMEOUT_S = 2.0

Batch = dict[str, np.ndarray]


class DatasetUnavailableError(RuntimeError):
  """The data set is not prepared locally and cannot be downloaded."""


# ----------------------------------------------------------------------------
# Loading.
# ----------------------------------------------------------------------------


def _network_available(
    address: tuple[str, int] = _PROBE_ADDRESS,
    timeout: float = _PROBE_TIMEOUT_S,
) -> bool:
  """Whether a TCP connection to `address` opens within `timeout` seconds.

  The probe runs in a daemon thread so that a slow DNS lookup (which ignores
  socket timeouts) cannot hold the caller longer than `timeout`.
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


def _tfds_is_mocked() -> bool:
  """Whether `tfds.testing.mock_data` is active (then nothing is downloaded)."""
  fn = tfds.core.DatasetBuilder.download_and_prepare
  return "mock" in getattr(fn, "__qualname__", "")


def _unavailable_message(name: str, builder: tfds.core.DatasetBuilder) -> str:
  data_dir = builder.data_dir_root
  archive = _CIFAR_ARCHIVES[name].rsplit("/", 1)[1]
  manual = os.path.join(data_dir, "downloads", "manual", archive)
  return (
      f"Data set {name!r} is not prepared in the tfds data dir "
      f"{str(data_dir)!r} (looked for {builder.data_dir!r}) and the network "
      "is unreachable, so tfds cannot download it. To provide it, either:\n"
      "  1. on a machine with internet run\n"
      "       python -c \"import tensorflow_datasets as tfds; "
      f"tfds.builder('{name}', data_dir='DIR').download_and_prepare()\"\n"
      f"     and copy DIR/{name} to {os.path.join(data_dir, name)}; or\n"
      f"  2. download {_CIFAR_ARCHIVES[name]} and place the archive, not\n"
      f"     unpacked, at {manual}; tfds then prepares it offline.\n"
      "Select another tfds data dir with --config.data_dir=DIR, or train on\n"
      "offline synthetic data with --config=configs/smoke.py "
      "(config.dataset='synthetic')."
  )


def _builder(config: ml_collections.ConfigDict) -> tfds.core.DatasetBuilder:
  """Returns the prepared tfds builder that `config` names.

  Raises:
    ValueError: for an unknown `config.dataset`, or an `image_folder` root
      without `train/` and `test/`.
    DatasetUnavailableError: CIFAR is not prepared and there is no network.
  """
  name = config.dataset
  data_dir = config.data_dir or None
  if name == "image_folder":
    root = config.data_dir
    if not root or not all(
        os.path.isdir(os.path.join(root, s)) for s in ("train", "test")
    ):
      raise ValueError(
          "dataset='image_folder' needs config.data_dir to be a directory "
          f"with train/<class>/*.png and test/<class>/*.png; got {root!r}."
      )
    return tfds.ImageFolder(root)
  if name == "synthetic":
    builder = synthetic.JaxmpSynthetic(
        data_dir=data_dir,
        config=synthetic.synthetic_config(
            config.synthetic_train_examples, config.synthetic_test_examples
        ),
    )
    # try_download_gcs=False: our data set is not on GCS, and probing for it
    # offline retries for minutes.
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False)
    )
    return builder
  if name in ("cifar10", "cifar100"):
    builder = tfds.builder(name, data_dir=data_dir)
    download_config = None
    if not _tfds_is_mocked() and not builder.is_prepared():
      archive = _CIFAR_ARCHIVES[name].rsplit("/", 1)[1]
      manual = os.path.join(
          builder.data_dir_root, "downloads", "manual", archive
      )
      if os.path.exists(manual):
        # Prepare from the archive; skip the GCS probe, which retries for
        # minutes offline.
        download_config = tfds.download.DownloadConfig(try_download_gcs=False)
      elif not _network_available():
        raise DatasetUnavailableError(_unavailable_message(name, builder))
    builder.download_and_prepare(download_config=download_config)
    return builder
  raise ValueError(
      f"Unknown dataset {name!r}; valid names: {', '.join(DATASETS)}."
  )


def num_classes(config: ml_collections.ConfigDict) -> int:
  """Returns the number of classes of `config.dataset` (prepares it if needed).

  Args:
    config: a config with `dataset` and `data_dir` (and the synthetic sizes).
  """
  return _builder(config).info.features["label"].num_classes


def load_split(
    config: ml_collections.ConfigDict, split: str
) -> tuple[np.ndarray, np.ndarray]:
  """Reads a whole split into memory, in the data set's stored order.

  The number of examples is counted from what is read, never taken from tfds
  metadata (which `tfds.testing.mock_data` does not have).

  Args:
    config: a config with `dataset`, `data_dir` (and for `synthetic`,
      `synthetic_train_examples` and `synthetic_test_examples`).
    split: "train" or "test".

  Returns:
    `(images, labels)`: uint8 `[N, H, W, 3]` and int32 `[N]`.

  Raises:
    ValueError: unknown data set, or images of different shapes.
    DatasetUnavailableError: CIFAR is not available offline.
  """
  builder = _builder(config)
  ds = builder.as_dataset(split=split, as_supervised=True, shuffle_files=False)
  if None not in builder.info.features["image"].shape:
    # Fixed shape (CIFAR, synthetic): decode in parallel, read in chunks.
    ds = ds.batch(1024)
  else:
    ds = ds.map(lambda x, y: (x[None], y[None]))  # image_folder: any shape.
  images, labels = [], []
  for image, label in ds.prefetch(2).as_numpy_iterator():
    images.extend(image)
    labels.append(label)
  if not images:
    raise ValueError(f"Split {split!r} of {config.dataset!r} is empty.")
  shapes = {x.shape for x in images}
  if len(shapes) != 1:
    raise ValueError(
        f"{config.dataset!r} split {split!r} has images of shapes "
        f"{sorted(shapes)}; resize them to one shape first."
    )
  return np.stack(images).astype(np.uint8), np.concatenate(labels).astype(np.int32)


# ----------------------------------------------------------------------------
# Training stream (tf.data).
# ----------------------------------------------------------------------------


def steps_per_epoch(num_examples: int, global_batch: int) -> int:
  """Number of full global batches in an epoch (the remainder is dropped).

  >>> steps_per_epoch(50_000, 128)
  390
  """
  return num_examples // global_batch


def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  """The example order of `epoch`: a permutation seeded by `(seed, epoch)`."""
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


def _normalization(
    mean: Sequence[float], std: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
  """`(scale, bias)` such that `x_u8 * scale + bias == (x_u8 / 255 - m) / s`."""
  mean = np.asarray(mean, np.float32)
  std = np.asarray(std, np.float32)
  return 1.0 / (255.0 * std), -mean / std


def _tf_crop_flip(
    images: tf.Tensor, offsets: tf.Tensor, flip: tf.Tensor
) -> tf.Tensor:
  """Pad-4 crop and horizontal flip of a uint8 batch, all examples at once.

  Two batched gathers on the zero-padded batch (rows, then shifted and
  possibly reversed columns) instead of a per-example map.

  Args:
    images: uint8 `[B, H, W, C]`.
    offsets: int32 `[B, 2]` crop corner `(row, col)` in the padded image,
      each in `[0, 2 * PAD]`.
    flip: bool `[B]`.

  Returns:
    uint8 `[B, H, W, C]`.
  """
  h, w = images.shape[1], images.shape[2]
  padded = tf.pad(images, [[0, 0], [PAD, PAD], [PAD, PAD], [0, 0]])
  rows = offsets[:, :1] + tf.range(h)[None, :]  # [B, H]
  cols = offsets[:, 1:] + tf.where(
      flip[:, None], tf.range(w - 1, -1, -1)[None, :], tf.range(w)[None, :]
  )  # [B, W]
  out = tf.gather(padded, rows, axis=1, batch_dims=1)  # [B, H, W + 2P, C]
  return tf.gather(out, cols, axis=2, batch_dims=1)


@tf.function(jit_compile=True)
def _tf_augment_normalize(
    images: tf.Tensor,
    offsets: tf.Tensor,
    flip: tf.Tensor,
    scale: np.ndarray,
    bias: np.ndarray,
) -> tf.Tensor:
  """`_tf_crop_flip`, then `images * scale + bias` in float32, fused by XLA.

  XLA matters here: TF's unfused cast, multiply and add run at ~15k img/s per
  core for CIFAR batches, the fused kernel at >50k. The random draws stay
  outside (XLA's and TF's stateless RNGs need not agree bit for bit).
  """
  images = _tf_crop_flip(images, offsets, flip)
  return tf.cast(images, tf.float32) * scale + bias


def _tf_augment_params(
    seed: tf.Tensor, batch_size: int
) -> tuple[tf.Tensor, tf.Tensor]:
  """Stateless crop offsets `[B, 2]` in `[0, 2 * PAD]` and flips `[B]`."""
  offsets = tf.random.stateless_uniform(
      [batch_size, 2], seed=seed, maxval=2 * PAD + 1, dtype=tf.int32
  )
  flip = tf.random.stateless_uniform(
      [batch_size], seed=tf.random.experimental.stateless_fold_in(seed, 1),
      maxval=2, dtype=tf.int32,
  )
  return offsets, flip == 1


def train_batches(
    config: ml_collections.ConfigDict,
    images: np.ndarray,
    labels: np.ndarray,
    *,
    epoch: int,
    start_batch: int = 0,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[Batch]:
  """Streams one epoch of augmented, normalised training batches.

  Batch `k` of epoch `e` holds examples `perm[k * B:(k + 1) * B]` with
  `perm = epoch_permutation(config.seed, e, N)` and `B = config.batch_size`,
  cropped and flipped with randomness drawn from `(config.seed, e, k)` for
  the whole global batch. Hence `start_batch=k` yields exactly batches
  `k, k + 1, ...` of the uninterrupted epoch, and the concatenation of all
  processes' batches does not depend on `process_count`.

  Args:
    config: uses `seed`, `batch_size` (global), `mean` and `std`.
    images: uint8 `[N, H, W, 3]`.
    labels: int `[N]`.
    epoch: epoch number (seeds the order and the augmentation).
    start_batch: first batch to yield, in `[0, steps_per_epoch]`.
    process_index: this process's index.
    process_count: number of processes; must divide `config.batch_size`.

  Yields:
    `{"image": float32 [B_local, H, W, 3], "label": int32 [B_local]}` with
    `B_local = config.batch_size // process_count`: this process's slice
    `[process_index * B_local, (process_index + 1) * B_local)` of each global
    batch.
  """
  global_batch = config.batch_size
  augment = config.get("augment", True)
  if global_batch % process_count:
    raise ValueError(
        f"batch_size {global_batch} is not divisible by {process_count} "
        "processes."
    )
  local_batch = global_batch // process_count
  steps = steps_per_epoch(len(images), global_batch)
  if not 0 <= start_batch <= steps:
    raise ValueError(f"start_batch {start_batch} not in [0, {steps}].")
  perm = epoch_permutation(config.seed, epoch, len(images))
  index = perm[: steps * global_batch].reshape(steps, global_batch)
  lo = process_index * local_batch
  index = index[start_batch:, lo:lo + local_batch].astype(np.int32)
  scale, bias = _normalization(config.mean, config.std)
  base_seed = tf.random.experimental.stateless_fold_in(
      tf.constant([config.seed, 0], tf.int64), epoch
  )
  labels_t = tf.constant(labels, tf.int32)
  image_shape = (local_batch,) + images.shape[1:]

  def gather_images(idx):
    # Gather in numpy: converting the whole array to a tf.Tensor costs a copy
    # of the data set (0.5 s for CIFAR10 on a small CPU) every epoch.
    batch = tf.numpy_function(lambda i: images[i], [idx], tf.uint8,
                              stateful=False)
    return tf.ensure_shape(batch, image_shape)

  def make_batch(step, idx):
    seed = tf.random.experimental.stateless_fold_in(base_seed, step)
    # Crops and flips are drawn for the whole global batch and sliced, so an
    # example's augmentation does not depend on `process_count`.
    offsets, flip = _tf_augment_params(seed, global_batch)
    if not augment:  # The centre crop of the padded image is the image.
      offsets, flip = tf.fill(tf.shape(offsets), PAD), tf.zeros_like(flip)
    image = _tf_augment_normalize(
        gather_images(idx),
        offsets[lo:lo + local_batch],
        flip[lo:lo + local_batch],
        scale,
        bias,
    )
    return {"image": image, "label": tf.gather(labels_t, idx)}

  steps_t = tf.range(start_batch, steps, dtype=tf.int64)
  ds = tf.data.Dataset.from_tensor_slices((steps_t, index))
  ds = ds.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE,
              deterministic=True)
  ds = ds.prefetch(tf.data.AUTOTUNE)
  yield from ds.as_numpy_iterator()


# ----------------------------------------------------------------------------
# Evaluation.
# ----------------------------------------------------------------------------


def eval_batches(
    config: ml_collections.ConfigDict,
    images: np.ndarray,
    labels: np.ndarray,
    *,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[Batch]:
  """Yields every example once, normalised, in fixed-size padded batches.

  The split is padded with zeros to a multiple of `batch_size` (global), so
  every batch has the same shape and the eval step compiles once; `mask` is
  False on the padding. Process `i` gets rows `[i * b, (i + 1) * b)` of each
  global batch, `b = batch_size // process_count`.

  Args:
    config: uses `mean` and `std`.
    images: uint8 `[N, H, W, 3]`.
    labels: int `[N]`.
    batch_size: global eval batch size; divisible by `process_count`.
    process_index: this process's index.
    process_count: number of processes.

  Yields:
    `{"image": float32 [b, H, W, 3], "label": int32 [b], "mask": bool [b]}`.
  """
  if batch_size % process_count:
    raise ValueError(
        f"eval batch_size {batch_size} is not divisible by {process_count} "
        "processes."
    )
  local = batch_size // process_count
  scale, bias = _normalization(config.mean, config.std)
  n = len(images)
  for start in range(0, n, batch_size):
    lo = start + process_index * local
    hi = min(lo + local, n)
    valid = max(hi - lo, 0)
    image = np.zeros((local,) + images.shape[1:], np.float32)
    label = np.zeros((local,), np.int32)
    mask = np.zeros((local,), bool)
    if valid:
      image[:valid] = images[lo:hi] * scale + bias
      label[:valid] = labels[lo:hi]
      mask[:valid] = True
    yield {"image": image, "label": label, "mask": mask}


# ----------------------------------------------------------------------------
# Device-resident data (jax.numpy; call inside the jitted step).
# ----------------------------------------------------------------------------


def device_epoch_permutation(
    key: jax.Array, epoch: jax.typing.ArrayLike, num_examples: int
) -> jax.Array:
  """The example order of `epoch` for device-resident data.

  Args:
    key: a PRNG key (the data key of the run).
    epoch: epoch number; may be traced.
    num_examples: static number of examples.

  Returns:
    int32 `[num_examples]` permutation.

  >>> perm = device_epoch_permutation(jax.random.key(0), 3, 10)
  >>> sorted(perm.tolist()) == list(range(10))
  True
  """
  return jax.random.permutation(jax.random.fold_in(key, epoch), num_examples)


def device_augment(images: jax.Array, key: jax.Array) -> jax.Array:
  """Pad-4 random crop and random horizontal flip, per example, on device.

  One gather from the zero-padded batch: output pixel `(i, r, c)` reads
  `padded[i, dy_i + r, dx_i + c']` with `c' = W - 1 - c` for flipped
  examples. No per-example loop; XLA emits a single gather.

  Args:
    images: `[B, H, W, C]` of any dtype (uint8 keeps the gather cheap).
    key: PRNG key; each example gets its own draw.

  Returns:
    `[B, H, W, C]`, same dtype as `images`.

  >>> x = jnp.ones((2, 32, 32, 3), jnp.uint8)
  >>> device_augment(x, jax.random.key(0)).shape
  (2, 32, 32, 3)
  """
  b, h, w, _ = images.shape
  k_offset, k_flip = jax.random.split(key)
  offsets = jax.random.randint(k_offset, (b, 2), 0, 2 * PAD + 1)
  flip = jax.random.bernoulli(k_flip, 0.5, (b,))
  padded = jnp.pad(images, ((0, 0), (PAD, PAD), (PAD, PAD), (0, 0)))
  rows = offsets[:, :1] + jnp.arange(h)[None, :]  # [B, H]
  cols = jnp.where(flip[:, None], jnp.arange(w - 1, -1, -1), jnp.arange(w))
  cols = offsets[:, 1:] + cols  # [B, W]
  return padded[
      jnp.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]
  ]


def normalize(
    images: jax.Array,
    mean: Sequence[float],
    std: Sequence[float],
    dtype: Any = jnp.float32,
) -> jax.Array:
  """Scales uint8 images to `[0, 1]`, then `(x - mean) / std`, in `dtype`.

  The arithmetic runs in float32 and only the result is cast, so a float16
  `dtype` loses no more than its own rounding.

  Args:
    images: uint8 `[..., C]`.
    mean: per-channel mean, length `C`.
    std: per-channel standard deviation, length `C`.
    dtype: output dtype.

  Returns:
    `images` normalised, of `dtype`.

  >>> normalize(jnp.full((1, 3), 255, jnp.uint8), (0.5,) * 3, (0.5,) * 3)
  Array([[1., 1., 1.]], dtype=float32)
  """
  scale, bias = _normalization(mean, std)
  return (images.astype(jnp.float32) * scale + bias).astype(dtype)
