"""The host input stream: tf.data training batches and padded eval batches.

* `train_batches` streams one epoch of augmented, normalised batches through
  `tf.data`. The order is a permutation seeded by `(seed, epoch)` and every
  random crop and flip is drawn by a stateless op from `(seed, epoch, batch)`,
  so the stream is a function of `(seed, epoch)` alone: `start_batch=k`
  resumes it bitwise, and it does not depend on `process_count`.
* `eval_batches` yields every example exactly once, with a padded last batch
  and a mask, so that the eval step never recompiles.

Images must have one fixed shape per data set (CIFAR: 32x32x3); this module
does not resize.
"""

from collections.abc import Iterator, Sequence

import numpy as np
import tensorflow as tf

from cifar_train.device_data import normalization
from cifar_train.device_data import PAD
from cifar_train.errors import ConfigError

Batch = dict[str, np.ndarray]


def hide_gpus_from_tensorflow() -> None:
  """TensorFlow only feeds the host: keep it off the GPUs that JAX uses."""
  try:
    tf.config.set_visible_devices([], "GPU")
  except (RuntimeError, ValueError):  # Devices already initialised.
    pass


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
    [batch_size],
    seed=tf.random.experimental.stateless_fold_in(seed, 1),
    maxval=2,
    dtype=tf.int32,
  )
  return offsets, flip == 1


def train_batches(
  images: np.ndarray,
  labels: np.ndarray,
  *,
  seed: int,
  batch_size: int,
  mean: Sequence[float],
  std: Sequence[float],
  augment: bool,
  epoch: int,
  start_batch: int = 0,
  process_index: int = 0,
  process_count: int = 1,
) -> Iterator[Batch]:
  """Streams one epoch of augmented, normalised training batches.

  Batch `k` of epoch `e` holds examples `perm[k * B:(k + 1) * B]` with
  `perm = epoch_permutation(seed, e, N)` and `B = batch_size`,
  cropped and flipped with randomness drawn from `(seed, e, k)` for
  the whole global batch. Hence `start_batch=k` yields exactly batches
  `k, k + 1, ...` of the uninterrupted epoch, and the concatenation of all
  processes' batches does not depend on `process_count`.

  Args:
    images: uint8 `[N, H, W, 3]`.
    labels: int `[N]`.
    seed: the run's seed.
    batch_size: the global batch size.
    mean: per-channel mean of the normalisation.
    std: per-channel standard deviation of the normalisation.
    augment: random crops (pad 4) and flips; else the images as they are.
    epoch: epoch number (seeds the order and the augmentation).
    start_batch: first batch to yield, in `[0, steps_per_epoch]`.
    process_index: this process's index.
    process_count: number of processes; must divide `batch_size`.

  Yields:
    `{"image": float32 [B_local, H, W, 3], "label": int32 [B_local]}` with
    `B_local = batch_size // process_count`: this process's slice
    `[process_index * B_local, (process_index + 1) * B_local)` of each global
    batch.
  """
  global_batch = batch_size
  if global_batch % process_count:
    raise ConfigError(
      f"batch_size {global_batch} is not divisible by {process_count} "
      "processes."
    )
  local_batch = global_batch // process_count
  steps = steps_per_epoch(len(images), global_batch)
  if not 0 <= start_batch <= steps:
    raise ConfigError(f"start_batch {start_batch} not in [0, {steps}].")
  perm = epoch_permutation(seed, epoch, len(images))
  index = perm[: steps * global_batch].reshape(steps, global_batch)
  lo = process_index * local_batch
  index = index[start_batch:, lo : lo + local_batch].astype(np.int32)
  scale, bias = normalization(mean, std)
  base_seed = tf.random.experimental.stateless_fold_in(
    tf.constant([seed, 0], tf.int64), epoch
  )
  labels_t = tf.constant(labels, tf.int32)
  image_shape = (local_batch,) + images.shape[1:]

  def gather_images(idx):
    # Gather in numpy: converting the whole array to a tf.Tensor costs a copy
    # of the data set (0.5 s for CIFAR10 on a small CPU) every epoch.
    batch = tf.numpy_function(
      lambda i: images[i], [idx], tf.uint8, stateful=False
    )
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
      offsets[lo : lo + local_batch],
      flip[lo : lo + local_batch],
      scale,
      bias,
    )
    return {"image": image, "label": tf.gather(labels_t, idx)}

  steps_t = tf.range(start_batch, steps, dtype=tf.int64)
  ds = tf.data.Dataset.from_tensor_slices((steps_t, index))
  ds = ds.map(
    make_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
  )
  ds = ds.prefetch(tf.data.AUTOTUNE)
  yield from ds.as_numpy_iterator()


# ----------------------------------------------------------------------------
# Evaluation.
# ----------------------------------------------------------------------------


def eval_batches(
  images: np.ndarray,
  labels: np.ndarray,
  *,
  batch_size: int,
  mean: Sequence[float],
  std: Sequence[float],
  process_index: int = 0,
  process_count: int = 1,
) -> Iterator[Batch]:
  """Yields every example once, normalised, in fixed-size padded batches.

  The split is padded with zeros to a multiple of `batch_size` (global), so
  every batch has the same shape and the eval step compiles once; `mask` is
  False on the padding. Process `i` gets rows `[i * b, (i + 1) * b)` of each
  global batch, `b = batch_size // process_count`.

  Args:
    images: uint8 `[N, H, W, 3]`.
    labels: int `[N]`.
    batch_size: global eval batch size; divisible by `process_count`.
    mean: per-channel mean of the normalisation.
    std: per-channel standard deviation of the normalisation.
    process_index: this process's index.
    process_count: number of processes.

  Yields:
    `{"image": float32 [b, H, W, 3], "label": int32 [b], "mask": bool [b]}`.
  """
  if batch_size % process_count:
    raise ConfigError(
      f"eval batch_size {batch_size} is not divisible by {process_count} "
      "processes."
    )
  local = batch_size // process_count
  scale, bias = normalization(mean, std)
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
