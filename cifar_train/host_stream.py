"""The batch of a step, defined once in numpy, and the padded eval batches.

Training batch ``k`` of epoch ``e`` is a function of ``(seed, e, k)`` alone:

* `epoch_plan` draws, from ``(seed, e)``, the epoch's example order (a
  permutation) and every example's pad-4 crop offsets and horizontal flip;
* `HostBatches` builds the batch in numpy: the data set is zero-padded once,
  one fancy index per batch gathers the cropped and flipped uint8 pixels,
  and `normalize` scales them to float32 (``x * scale + bias``, two float32
  roundings);
* the device-resident mode (`device_data.device_batch`) runs the same
  integer indexing on the devices and looks the float32 values up in
  `normalization_table`, which is `normalize` of every byte value: the
  same floats, bit for bit, with no float arithmetic on the device.

So ``start_batch=k`` resumes an epoch bitwise, a batch does not depend on
``process_count`` (each process builds only its rows of it), and both data
modes train on the same batches. `eval_batches` yields every test example
exactly once, with a padded last batch and a mask, so that the eval step
never recompiles.

Images must have one fixed shape per data set (CIFAR: 32x32x3); this module
does not resize.
"""

from collections.abc import Iterator, Sequence
import threading
from typing import NamedTuple

import numpy as np

from cifar_train.errors import ConfigError

Batch = dict[str, np.ndarray]
PAD = 4  # Random-crop padding, in pixels.


def steps_per_epoch(num_examples: int, global_batch: int) -> int:
  """Number of full global batches in an epoch (the remainder is dropped).

  >>> steps_per_epoch(50_000, 128)
  390
  """
  return num_examples // global_batch


def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  """The example order of `epoch`: a permutation seeded by `(seed, epoch)`."""
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


class EpochPlan(NamedTuple):
  """What every batch of one epoch holds, for the global batch.

  Attributes:
    index: int32 ``[steps, B]``: the examples of each step's batch.
    offsets: int32 ``[steps, B, 2]``: each example's crop corner ``(row,
      col)`` in the padded image, in ``[0, 2 * PAD]``; ``PAD`` without
      augmentation (the image itself).
    flips: bool ``[steps, B]``: whether the example is flipped left-right.
  """

  index: np.ndarray
  offsets: np.ndarray
  flips: np.ndarray


def epoch_plan(
  seed: int, epoch: int, num_examples: int, batch_size: int, augment: bool
) -> EpochPlan:
  """The order, crops and flips of epoch ``epoch``, from ``(seed, epoch)``.

  Args:
    seed: the run's seed.
    epoch: the epoch number.
    num_examples: the training set's size.
    batch_size: the global batch size.
    augment: draw crops and flips; else every batch is the plain images.

  Returns:
    The `EpochPlan` of ``steps_per_epoch(num_examples, batch_size)`` steps.

  >>> plan = epoch_plan(0, 1, 10, 4, augment=True)
  >>> plan.index.shape, plan.offsets.shape, plan.flips.shape
  ((2, 4), (2, 4, 2), (2, 4))
  """
  steps = steps_per_epoch(num_examples, batch_size)
  perm = epoch_permutation(seed, epoch, num_examples)
  index = perm[: steps * batch_size].reshape(steps, batch_size)
  if augment:
    rng = np.random.default_rng([seed, epoch, 1])
    offsets = rng.integers(0, 2 * PAD + 1, (steps, batch_size, 2))
    flips = rng.integers(0, 2, (steps, batch_size)) == 1
  else:
    offsets = np.full((steps, batch_size, 2), PAD)
    flips = np.zeros((steps, batch_size), bool)
  return EpochPlan(
    index.astype(np.int32), offsets.astype(np.int32), flips.astype(bool)
  )


def normalization(
  mean: Sequence[float], std: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
  """float32 ``(scale, bias)`` with ``x * scale + bias ~ (x / 255 - m) / s``."""
  mean = np.asarray(mean, np.float32)
  std = np.asarray(std, np.float32)
  return (1.0 / (255.0 * std)).astype(np.float32), (-mean / std).astype(
    np.float32
  )


def normalize(
  images: np.ndarray, scale: np.ndarray, bias: np.ndarray
) -> np.ndarray:
  """uint8 ``[..., C]`` to float32 ``images * scale + bias`` (two roundings).

  The one definition of the normalisation: `normalization_table` is this
  function of every byte value.
  """
  out = images.astype(np.float32)  # Exact.
  out *= scale
  out += bias
  return out


def normalization_table(
  mean: Sequence[float], std: Sequence[float]
) -> np.ndarray:
  """float32 ``[256, C]``: `normalize` of each byte value, per channel.

  >>> table = normalization_table((0.5,) * 3, (0.5,) * 3)
  >>> table.shape, table[0].tolist(), table[255].tolist()
  ((256, 3), [-1.0, -1.0, -1.0], [1.0, 1.0, 1.0])
  """
  scale, bias = normalization(mean, std)
  values = np.repeat(np.arange(256, dtype=np.uint8)[:, None], len(scale), 1)
  return normalize(values, scale, bias)


def pad(images: np.ndarray) -> np.ndarray:
  """uint8 ``[N, H + 2 PAD, W + 2 PAD, C]``: ``images`` zero-padded."""
  n, h, w, c = images.shape
  out = np.zeros((n, h + 2 * PAD, w + 2 * PAD, c), images.dtype)
  out[:, PAD : PAD + h, PAD : PAD + w] = images
  return out


def crop_rows_cols(
  offsets, flips, height: int, width: int, xp=np
) -> tuple[np.ndarray, np.ndarray]:
  """Rows ``[B, H]`` and columns ``[B, W]`` of each crop in the padded images.

  Output pixel ``(r, c)`` of example ``i`` is padded pixel
  ``(rows[i, r], cols[i, c])``; a flipped example reads its columns in
  reverse. ``xp`` is `numpy` or `jax.numpy`: the device mode calls this too.
  """
  r = xp.arange(height, dtype=np.int32)
  c = xp.arange(width, dtype=np.int32)
  rows = offsets[:, :1] + r[None, :]
  cols = offsets[:, 1:] + xp.where(flips[:, None], c[::-1][None], c[None])
  return rows, cols


class _InBackground:
  """``fn()`` computed on a daemon thread; `result` waits for it."""

  def __init__(self, fn):
    self._out = []
    self._thread = threading.Thread(
      target=self._run, args=(fn,), daemon=True, name="jaxmp-pad"
    )
    self._thread.start()

  def _run(self, fn):
    try:
      self._out.append((True, fn()))
    except BaseException as e:  # pylint: disable=broad-except
      self._out.append((False, e))  # Raised in the caller, by `result`.

  def result(self):
    """``fn()``'s value, or its exception raised here."""
    self._thread.join()
    ok, value = self._out[0]
    if not ok:
      raise value
    return value


class _Done:
  """A value already there, behind `_InBackground`'s interface."""

  def __init__(self, value):
    self._value = value

  def result(self):
    return self._value


class HostBatches:
  """Training batches of one data set, built in numpy on the host.

  The data set is padded once (`pad`); a batch is one fancy index into it
  (each pixel's three bytes read as one item) and `normalize`. The padding
  (a 240 MB copy for CIFAR10, ~0.1 s when the memory is already the
  process's, seconds on a VM that must first hand it back) runs on a
  background thread from construction, so that it overlaps the caller's
  start-up (numpy releases the GIL); the first batch waits for it.

  ``crops=False`` (for plans drawn with ``augment=False``, whose crops are
  the images themselves) skips the copy and gathers from ``images`` as they
  are: the same batches, bit for bit; a plan with other crops is refused.
  """

  def __init__(
    self,
    images: np.ndarray,
    labels: np.ndarray,
    *,
    mean: Sequence[float],
    std: Sequence[float],
    crops: bool = True,
  ):
    n, self._h, self._w, c = images.shape
    self._crops = crops
    border = PAD if crops else 0  # Around each image, in the gathered array.
    self._ph, self._pw = self._h + 2 * border, self._w + 2 * border
    images = np.ascontiguousarray(images, np.uint8)
    # One item per pixel: a gather moves C bytes at once.
    pixel = np.dtype((np.void, c))
    if crops:
      self._padding = _InBackground(lambda: pad(images).view(pixel).reshape(-1))
    else:
      self._padding = _Done(images.view(pixel).reshape(-1))
    self._channels = c
    self._labels = np.asarray(labels, np.int32)
    self._scale, self._bias = normalization(mean, std)
    self.num_examples = n

  def batch(self, index, offsets, flips) -> Batch:
    """The normalised crops of examples ``index`` (int ``[b]``)."""
    if not self._crops:
      if np.any(offsets != PAD):
        raise ValueError(
          "HostBatches(crops=False) serves plans without crops "
          "(epoch_plan(..., augment=False)); this plan has crops"
        )
      offsets = offsets - PAD
    rows, cols = crop_rows_cols(offsets, flips, self._h, self._w)
    flat = (
      index.astype(np.intp)[:, None, None] * (self._ph * self._pw)
      + rows[:, :, None] * self._pw
      + cols[:, None, :]
    )
    pixels = self._padding.result()[flat].view(np.uint8)
    pixels = pixels.reshape(len(index), self._h, self._w, self._channels)
    return {
      "image": normalize(pixels, self._scale, self._bias),
      "label": self._labels[index],
    }

  def epoch(
    self,
    plan: EpochPlan,
    start_batch: int = 0,
    process_index: int = 0,
    process_count: int = 1,
  ) -> Iterator[Batch]:
    """This process's rows of batches ``start_batch...`` of ``plan``."""
    global_batch = plan.index.shape[1]
    if global_batch % process_count:
      raise ConfigError(
        f"batch_size {global_batch} is not divisible by {process_count} "
        "processes."
      )
    local = global_batch // process_count
    lo, hi = process_index * local, (process_index + 1) * local
    steps = len(plan.index)
    if not 0 <= start_batch <= steps:
      raise ConfigError(f"start_batch {start_batch} not in [0, {steps}].")
    for k in range(start_batch, steps):
      yield self.batch(
        plan.index[k, lo:hi], plan.offsets[k, lo:hi], plan.flips[k, lo:hi]
      )


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

  Batch ``k`` of epoch ``e`` holds the examples, crops and flips of step
  ``k`` of ``epoch_plan(seed, e, N, batch_size, augment)``. Hence
  ``start_batch=k`` yields exactly batches ``k, k + 1, ...`` of the
  uninterrupted epoch, and the concatenation of all processes' batches does
  not depend on ``process_count``.

  Args:
    images: uint8 ``[N, H, W, 3]``.
    labels: int ``[N]``.
    seed: the run's seed.
    batch_size: the global batch size.
    mean: per-channel mean of the normalisation.
    std: per-channel standard deviation of the normalisation.
    augment: random crops (pad 4) and flips; else the images as they are.
    epoch: epoch number (seeds the order and the augmentation).
    start_batch: first batch to yield, in ``[0, steps_per_epoch]``.
    process_index: this process's index.
    process_count: number of processes; must divide ``batch_size``.

  Yields:
    ``{"image": float32 [B_local, H, W, 3], "label": int32 [B_local]}`` with
    ``B_local = batch_size // process_count``: this process's slice
    ``[process_index * B_local, (process_index + 1) * B_local)`` of each
    global batch.
  """
  if batch_size % process_count:
    raise ConfigError(
      f"batch_size {batch_size} is not divisible by {process_count} processes."
    )
  plan = epoch_plan(seed, epoch, len(images), batch_size, augment)
  batches = HostBatches(images, labels, mean=mean, std=std, crops=augment)
  yield from batches.epoch(plan, start_batch, process_index, process_count)


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
      image[:valid] = normalize(images[lo:hi], scale, bias)
      label[:valid] = labels[lo:hi]
      mask[:valid] = True
    yield {"image": image, "label": label, "mask": mask}
