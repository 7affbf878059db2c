"""One batch-source interface over both data modes.

A source compiles the train step for its mode (`jit_step`) and yields, per
epoch, the arguments that step takes after the state (`epoch`). The loop then
runs ``state, metrics = step(state, *args, metrics)`` for either mode:

* `HostStream`: batches built in numpy on the host (`host_stream`), placed
  on the devices by a background thread two steps ahead of the step that
  takes them (any data set size).
* `DeviceResident`: the padded uint8 data set copied to the devices once;
  the step gathers, crops, flips and normalises its batch itself
  (`device_data`).

Both train on the same batches, bit for bit: `host_stream.epoch_plan` of
``(seed, epoch)`` says what every batch holds.
"""

import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
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

  def step_args_like(self) -> tuple[Any, ...]:
    """What `epoch` yields, as shapes, dtypes and shardings only.

    Lets `jit_step`'s step be traced and compiled before any batch exists
    (`jax.jit(...).trace(state, *args, metrics)`); a step called later on
    the real arguments then finds it in jax's caches.
    """


def prefetch(
  items: Iterable[Any], size: int, transform: Callable[[Any], Any]
) -> Iterator[Any]:
  """``transform(item)`` of each item, computed ``size`` items ahead.

  A daemon thread builds the items and transforms them (for batches:
  `jax.make_array_from_process_local_data`, which starts the host-to-device
  copy), so that the next batches are on their way while the devices run
  the current step. An exception in the thread is raised here, at the item
  it concerns; closing this generator stops the thread.

  >>> list(prefetch(range(4), 2, lambda x: x * 10))
  [0, 10, 20, 30]
  """
  done = object()
  buffer = queue.Queue(maxsize=max(size, 1))
  stop = threading.Event()

  def put(value) -> bool:
    while not stop.is_set():
      try:
        buffer.put(value, timeout=0.1)
        return True
      except queue.Full:
        pass
    return False

  def produce():
    try:
      for item in items:
        if not put((transform(item), None)):
          return
    except BaseException as e:  # pylint: disable=broad-except
      put((None, e))
      return
    put((done, None))

  thread = threading.Thread(target=produce, daemon=True, name="prefetch")
  thread.start()
  try:
    while True:
      value, error = buffer.get()
      if error is not None:
        raise error
      if value is done:
        return
      yield value
  finally:
    stop.set()
    thread.join()


class HostStream:
  """Batches from `host_stream.HostBatches`, prefetched to the devices."""

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
    prefetch_batches: int = 2,
  ):
    self._num_examples = len(data.train_images)
    self._batches = host_stream.HostBatches(
      data.train_images, data.train_labels, mean=mean, std=std, crops=augment
    )
    self._plan_args = dict(seed=seed, batch_size=batch_size, augment=augment)
    self._replicated = replicated
    self._batch_sharding = batch_sharding
    self._prefetch = prefetch_batches
    self._image_shape = tuple(data.train_images.shape[1:])

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
    del state  # The batches are a function of (seed, epoch) alone.
    plan = host_stream.epoch_plan(
      epoch=epoch, num_examples=self._num_examples, **self._plan_args
    )
    local = self._batches.epoch(
      plan, start_batch, jax.process_index(), jax.process_count()
    )
    place = lambda b: mesh.global_batch(b, self._batch_sharding)
    for b in prefetch(
      itertools.islice(local, num_batches), self._prefetch, place
    ):
      yield b["image"], b["label"]

  def batch(self, state, images, labels):
    """The step's batch is its arguments."""
    del state
    return images, labels

  def step_args_like(self):
    """float32 images (`host_stream.normalize`) and int32 labels."""
    b, sharding = self._plan_args["batch_size"], self._batch_sharding
    return (
      jax.ShapeDtypeStruct(
        (b, *self._image_shape), np.float32, sharding=sharding
      ),
      jax.ShapeDtypeStruct((b,), np.int32, sharding=sharding),
    )


class DeviceResident:
  """The whole padded uint8 training set on the devices (airbench style)."""

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
    self._num_examples = len(data.train_images)
    self._arrays = jax.device_put(
      (
        host_stream.pad(data.train_images),
        np.asarray(data.train_labels, np.int32),
        host_stream.normalization_table(mean, std),
      ),
      replicated,
    )
    self._plan_args = dict(seed=seed, batch_size=batch_size, augment=augment)
    self._replicated = replicated
    self._batch_sharding = batch_sharding

    def batch(padded, labels, table, index, offsets, flips, k):
      return device_data.device_batch(
        padded, labels, table, index[k], offsets[k], flips[k]
      )

    self._batch = jax.jit(batch)

  def jit_step(self, train_step):
    """``train_step`` jitted to build its batch from the resident set."""
    r = self._replicated
    step = device_data.make_device_train_step(train_step, self._batch_sharding)
    return jax.jit(
      step,
      in_shardings=(r, r, r, r, r, r, r, None, r),
      out_shardings=(r, r),
      donate_argnums=(0, 8),
      compiler_options=jaxmp.cpu_compiler_options() or None,
    )

  def epoch(self, state, epoch, start_batch, num_batches):
    """The data, the epoch's plan and each step's index; one small copy."""
    del state
    plan = host_stream.epoch_plan(
      epoch=epoch, num_examples=self._num_examples, **self._plan_args
    )
    plan = jax.device_put(tuple(plan), self._replicated)
    for k in range(start_batch, start_batch + num_batches):
      yield (*self._arrays, *plan, np.int32(k))

  def batch(self, state, *args):
    """The batch gathered and augmented as the step does it."""
    del state
    return self._batch(*args)

  def step_args_like(self):
    """The resident arrays, an epoch's plan and an int32 step index."""
    steps_ = host_stream.steps_per_epoch(
      self._num_examples, self._plan_args["batch_size"]
    )
    b = self._plan_args["batch_size"]
    plan = (
      jax.ShapeDtypeStruct((steps_, b), np.int32, sharding=self._replicated),
      jax.ShapeDtypeStruct((steps_, b, 2), np.int32, sharding=self._replicated),
      jax.ShapeDtypeStruct((steps_, b), np.bool_, sharding=self._replicated),
    )
    return (*self._arrays, *plan, jax.ShapeDtypeStruct((), np.int32))
