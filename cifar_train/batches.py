"""One batch-source interface over both data modes.

A source compiles the train step for its mode (`jit_step`) and yields, per
epoch, the arguments that step takes after the state (`epoch`). The loop then
runs ``state, metrics = step(state, *args, metrics)`` for either mode:

* `HostStream`: augmented batches from tf.data on the host, placed on the
  devices each step (any data set size).
* `DeviceResident`: the uint8 data set copied to the devices once; batches
  are gathered, cropped, flipped and normalised inside the step.
"""

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding

import jaxmp
from cifar_train import device_data
from cifar_train import host_stream
from cifar_train import mesh
from cifar_train import steps
from cifar_train.data_sources import Dataset


class BatchSource(Protocol):
  """What the loop needs of a data mode."""

  def jit_step(self, train_step: steps.TrainStep) -> Any:
    """The jitted ``step(state, *args, metrics) -> (state, metrics)``."""

  def epoch(
    self,
    state: steps.TrainState,
    epoch: int,
    start_batch: int,
    num_batches: int,
  ) -> Iterator[tuple[Any, ...]]:
    """The ``args`` of the next ``num_batches`` steps of ``epoch``."""

  def batch(self, state: steps.TrainState, *args: Any) -> tuple[Any, Any]:
    """``(images, labels)`` that a step on ``args`` of `epoch` trains on."""


class HostStream:
  """Batches from `host_stream.train_batches`, one host-to-device copy each."""

  def __init__(
    self,
    data: Dataset,
    *,
    batch_size: int,
    seed: int,
    mean: Sequence[float],
    std: Sequence[float],
    augment: bool,
    replicated: NamedSharding,
    batch_sharding: NamedSharding,
  ):
    self._data = data
    self._stream_args = dict(
      seed=seed, batch_size=batch_size, mean=mean, std=std, augment=augment
    )
    self._replicated = replicated
    self._batch_sharding = batch_sharding

  def jit_step(self, train_step):
    """``train_step`` jitted over host batches: ``(state, x, y, metrics)``."""
    r, b = self._replicated, self._batch_sharding
    return jax.jit(
      train_step,
      in_shardings=(r, b, b, r),
      out_shardings=(r, r),
      donate_argnums=(0, 3),
      compiler_options=jaxmp.cpu_compiler_options() or None,
    )

  def epoch(self, state, epoch, start_batch, num_batches):
    """The batches ``start_batch..`` of ``epoch``, placed on the mesh."""
    del state  # The stream is a function of (seed, epoch) alone.
    stream = host_stream.train_batches(
      self._data.train_images,
      self._data.train_labels,
      epoch=epoch,
      start_batch=start_batch,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      **self._stream_args,
    )
    for _, batch in zip(range(num_batches), stream):
      b = mesh.global_batch(batch, self._batch_sharding)
      yield b["image"], b["label"]

  def batch(self, state, images, labels):
    """The step's batch is its arguments."""
    del state
    return images, labels


class DeviceResident:
  """The whole uint8 training set on the devices (airbench style)."""

  def __init__(
    self,
    data: Dataset,
    *,
    batch_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    augment: bool,
    replicated: NamedSharding,
    batch_sharding: NamedSharding,
  ):
    self._num_examples = len(data.train_images)
    self._images = jax.device_put(data.train_images, replicated)
    self._labels = jax.device_put(data.train_labels, replicated)
    self._step_args = dict(
      batch_size=batch_size,
      mean=mean,
      std=std,
      augment=augment,
      batch_sharding=batch_sharding,
    )
    self._replicated = replicated
    self._batch = jax.jit(steps.make_device_batch(**self._step_args))
    n = self._num_examples
    self._perm = jax.jit(
      lambda key, epoch: device_data.device_epoch_permutation(
        jax.random.wrap_key_data(key), epoch, n
      ),
      out_shardings=replicated,
    )

  def jit_step(self, train_step):
    """``train_step`` jitted to gather its batch from the resident set."""
    r = self._replicated
    step = steps.make_device_train_step(train_step, **self._step_args)
    return jax.jit(
      step,
      in_shardings=(r, r, r, r, None, r),
      out_shardings=(r, r),
      donate_argnums=(0, 5),
      compiler_options=jaxmp.cpu_compiler_options() or None,
    )

  def epoch(self, state, epoch, start_batch, num_batches):
    """The epoch's permutation and batch indices; no data moves."""
    perm = self._perm(state.rng, epoch)
    for batch in range(start_batch, start_batch + num_batches):
      yield self._images, self._labels, perm, np.int32(batch)

  def batch(self, state, images_u8, labels, perm, batch_index):
    """The batch gathered and augmented as the step does it."""
    return self._batch(state, images_u8, labels, perm, batch_index)
