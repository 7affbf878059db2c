"""One batch-source interface over both data modes.

A source compiles the train step for its mode (`jit_step`) and yields, per
epoch, the arguments that step takes after the state (`epoch`). The loop then
runs ``state, metrics = step(state, *args, metrics)`` for either mode:

* `HostStream`: batches built in numpy on the host (`host_stream`), placed
  on the devices by a background thread two steps ahead of the step that
  takes them (any data set size).
* `DeviceResident`: the padded uint8 data set copied to the devices once;
  the devices gather, crop, flip and normalise each batch (`device_data`):
  inside the program of a call of several steps, or, for calls of one step,
  in a small program of its own that the step's program then takes, as it
  takes a host batch.

Both train on the same batches, bit for bit: `host_stream.epoch_plan` of
``(seed, epoch)`` says what every batch holds.
"""

import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp
from cifar_train import device_data
from cifar_train import host_stream
from cifar_train import mesh
from cifar_train import steps
from cifar_train.data_sources import Dataset


class BatchSource(Protocol):
  """What the loop needs of a data mode."""

  def jit_step(self, train_step: steps.TrainStep) -> Any:
    """The jitted ``step(state, *args, metrics) -> (state, metrics)``.

    One call runs as many steps as the ``args`` of `calls` say (up to the
    source's ``steps_per_call``), in one program for every size.
    """

  def calls(
    self,
    state: steps.TrainState,
    epoch: int,
    start_batch: int,
    sizes: Sequence[int],
  ) -> Iterator[tuple[Any, ...]]:
    """The ``args`` of calls of ``sizes[0], sizes[1], ...`` steps of ``epoch``.

    The calls run batches ``start_batch ..`` in order; every size is at
    most the source's ``steps_per_call``.
    """

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
    """What `calls` yields for a call, as shapes, dtypes and shardings only.

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
    steps_per_call: int = 1,
  ):
    self._num_examples = len(data.train_images)
    self._k = steps_per_call
    self._batches = host_stream.HostBatches(
      data.train_images, data.train_labels, mean=mean, std=std, crops=augment
    )
    self._plan_args = dict(seed=seed, batch_size=batch_size, augment=augment)
    self._replicated = replicated
    self._batch_sharding = batch_sharding
    self._prefetch = prefetch_batches
    self._image_shape = tuple(data.train_images.shape[1:])
    self._stacked = NamedSharding(batch_sharding.mesh, P(None, "data"))

  def jit_step(self, train_step):
    """``train_step`` jitted over host batches: ``(state, xs, ys, n, metrics)``.

    ``xs`` and ``ys`` stack ``steps_per_call`` batches; the call trains on
    the first ``n`` (`device_data.loop_over_batches`).
    """
    r, s = self._replicated, self._stacked
    return jax.jit(
      device_data.loop_over_batches(train_step, self._batch_sharding, self._k),
      in_shardings=(r, s, s, None, r),
      out_shardings=(r, r),
      donate_argnums=(0, 4),
      compiler_options=jaxmp.cpu_compiler_options() or None,
    )

  def epoch(self, state, epoch, start_batch, num_batches):
    """The batches ``start_batch..`` of ``epoch``, placed on the mesh."""
    return self.calls(state, epoch, start_batch, [1] * num_batches)

  def calls(self, state, epoch, start_batch, sizes):
    """Each call's batches, stacked ``steps_per_call`` deep, on the mesh."""
    del state  # The batches are a function of (seed, epoch) alone.
    plan = host_stream.epoch_plan(
      epoch=epoch, num_examples=self._num_examples, **self._plan_args
    )
    local = self._batches.epoch(
      plan, start_batch, jax.process_index(), jax.process_count()
    )
    sizes = list(sizes)
    groups = (list(itertools.islice(local, n)) for n in sizes)

    def place(group):
      n = len(group)
      stacked = {}
      for key, first in group[0].items():
        if self._k == 1:
          stacked[key] = first[None]
        else:  # Past n: zeros, never read.
          stacked[key] = np.zeros((self._k, *first.shape), first.dtype)
          stacked[key][:n] = [g[key] for g in group]
      b = mesh.global_batch(stacked, self._stacked)
      return b["image"], b["label"], np.int32(n)

    yield from prefetch(groups, self._prefetch, place)

  def batch(self, state, images, labels, n):
    """The call's first batch is the first of its arguments."""
    del state, n
    return images[0], labels[0]

  def step_args_like(self):
    """float32 images (`host_stream.normalize`), int32 labels, the count."""
    b, k, sharding = self._plan_args["batch_size"], self._k, self._stacked
    return (
      jax.ShapeDtypeStruct(
        (k, b, *self._image_shape), np.float32, sharding=sharding
      ),
      jax.ShapeDtypeStruct((k, b), np.int32, sharding=sharding),
      jax.ShapeDtypeStruct((), np.int32),
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
    steps_per_call: int = 1,
  ):
    self._k = steps_per_call
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
      """Step ``k``'s batch of the epoch's plan."""
      return device_data.device_batch(
        padded, labels, table, index[k], offsets[k], flips[k]
      )

    self._batch_of = batch
    self._batch = jax.jit(batch)

  def jit_step(self, train_step):
    """``train_step`` jitted to build its batches from the resident set.

    With ``steps_per_call`` 1, the batch is built by a program of its own
    (`_BuildThenStep`) and the step's program is `HostStream`'s: on XLA:CPU
    the gather costs 2.3-2.8 ms of a 15 ms one-block step inside the step's
    program and 0.2 ms in its own (`bench/gpu.sh --smoke`'s model, batch
    128, 2 cores). With more steps a call, one program builds each step's
    batch in its loop.
    """
    r = self._replicated
    if self._k == 1:
      stacked = NamedSharding(self._batch_sharding.mesh, P(None, "data"))

      def build(*data):
        x, y = self._batch_of(*data)
        return x[None], y[None]

      return _BuildThenStep(
        jax.jit(
          build,
          in_shardings=(r, r, r, r, r, r, None),
          out_shardings=(stacked, stacked),
        ),
        jax.jit(
          device_data.loop_over_batches(train_step, self._batch_sharding, 1),
          in_shardings=(r, stacked, stacked, None, r),
          out_shardings=(r, r),
          donate_argnums=(0, 4),
          compiler_options=jaxmp.cpu_compiler_options() or None,
        ),
        stacked,
      )
    step = device_data.make_device_train_step(
      train_step, self._batch_sharding, self._k
    )
    return jax.jit(
      step,
      in_shardings=(r, r, r, r, r, r, r, None, None, r),
      out_shardings=(r, r),
      donate_argnums=(0, 9),
      compiler_options=jaxmp.cpu_compiler_options() or None,
    )

  def epoch(self, state, epoch, start_batch, num_batches):
    """The data, the epoch's plan and each step's index; one small copy."""
    return self.calls(state, epoch, start_batch, [1] * num_batches)

  def calls(self, state, epoch, start_batch, sizes):
    """The data, the epoch's plan, each call's first step and step count."""
    del state
    plan = host_stream.epoch_plan(
      epoch=epoch, num_examples=self._num_examples, **self._plan_args
    )
    plan = jax.device_put(tuple(plan), self._replicated)
    k = start_batch
    for n in sizes:
      yield (*self._arrays, *plan, np.int32(k), np.int32(n))
      k += n

  def batch(self, state, *args):
    """The batch gathered and augmented as the step does it."""
    del state
    return self._batch(*args[:-1])  # Not the call's step count.

  def step_args_like(self):
    """The resident arrays, an epoch's plan, the first step and the count."""
    steps_ = host_stream.steps_per_epoch(
      self._num_examples, self._plan_args["batch_size"]
    )
    b = self._plan_args["batch_size"]
    plan = (
      jax.ShapeDtypeStruct((steps_, b), np.int32, sharding=self._replicated),
      jax.ShapeDtypeStruct((steps_, b, 2), np.int32, sharding=self._replicated),
      jax.ShapeDtypeStruct((steps_, b), np.bool_, sharding=self._replicated),
    )
    scalar = jax.ShapeDtypeStruct((), np.int32)
    return (*self._arrays, *plan, scalar, scalar)


class _BuildThenStep:
  """`DeviceResident`'s lone step: the batch's program, then the step's.

  It takes the arguments of the one-program step (`jit_step`).

  ``step(state, padded, labels, table, index, offsets, flips, k, n,
  metrics)`` runs ``run(state, *build(padded, ..., k), n, metrics)``; both
  are dispatched without a sync. ``trace`` traces ``run`` (what
  `loop.compile_ahead` compiles ahead); ``build`` is small and compiles at
  its first call.
  """

  def __init__(self, build, run, stacked: NamedSharding):
    self._build = build
    self._run = run
    self._stacked = stacked

  def __call__(self, state, *args):
    *data, n, metrics = args
    return self._run(state, *self._build(*data), n, metrics)

  def trace(self, state, *args):
    """``run``'s trace on the batches that ``build`` makes of ``args``."""
    *data, n, metrics = args
    xs, ys = jax.eval_shape(self._build, *data)
    return self._run.trace(
      state,
      jax.ShapeDtypeStruct(xs.shape, xs.dtype, sharding=self._stacked),
      jax.ShapeDtypeStruct(ys.shape, ys.dtype, sharding=self._stacked),
      n,
      metrics,
    )


class HostEval:
  """The test split in padded batches built on the host, one call each.

  For a test split too large for the devices: `host_stream.eval_batches`,
  placed on the mesh batch by batch; the sums stay on the devices.
  """

  def __init__(
    self,
    data: Dataset,
    *,
    batch_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    replicated: NamedSharding,
    batch_sharding: NamedSharding,
  ):
    self._images, self._labels = data.test_images, data.test_labels
    self._args = dict(batch_size=batch_size, mean=mean, std=std)
    self._replicated = replicated
    self._batch_sharding = batch_sharding

  def jit_eval(self, eval_step) -> Callable[[steps.TrainState], Any]:
    """``run(state) -> sums`` over the whole split (`steps.zero_eval_sums`)."""
    r, b = self._replicated, self._batch_sharding
    step = jax.jit(
      eval_step,
      in_shardings=(r, b, b, b, r),
      out_shardings=r,
      compiler_options=jaxmp.cpu_compiler_options() or None,
    )

    def run(state):
      sums = jax.device_put(steps.zero_eval_sums(), r)
      for batch in host_stream.eval_batches(
        self._images,
        self._labels,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        **self._args,
      ):
        x = mesh.global_batch(batch, b)
        sums = step(state, x["image"], x["label"], x["mask"], sums)
      return sums

    return run


class ResidentEval:
  """The test split kept on the devices as uint8; one call evaluates it all.

  The split is zero-padded to whole batches of ``batch_size`` (the padding
  masked out) and copied to the devices once; each evaluation is one jitted
  `jax.lax.scan` over the batches, normalising with
  `host_stream.normalization_table` (the host's floats, bit for bit).
  """

  def __init__(
    self,
    data: Dataset,
    *,
    batch_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    replicated: NamedSharding,
    batch_sharding: NamedSharding,
  ):
    images = np.asarray(data.test_images, np.uint8)
    n = len(images)
    batches_ = -(-n // batch_size)
    rows = batches_ * batch_size
    padded = np.zeros((rows, *images.shape[1:]), np.uint8)
    padded[:n] = images
    labels = np.zeros((rows,), np.int32)
    labels[:n] = data.test_labels
    mask = np.arange(rows) < n
    shape = (batches_, batch_size)
    self._arrays = jax.device_put(
      (
        padded.reshape(*shape, *images.shape[1:]),
        labels.reshape(shape),
        mask.reshape(shape),
        host_stream.normalization_table(mean, std),
      ),
      replicated,
    )
    self._replicated = replicated
    self._batch_sharding = batch_sharding

  def jit_eval(self, eval_step) -> Callable[[steps.TrainState], Any]:
    """``run(state) -> sums`` over the whole split (`steps.zero_eval_sums`)."""
    b = self._batch_sharding

    def all_batches(state, images, labels, mask, table):
      channels = jnp.arange(table.shape[1])

      def body(sums, batch):
        x, y, m = (jax.lax.with_sharding_constraint(a, b) for a in batch)
        x = table[x.astype(jnp.int32), channels]
        return eval_step(state, x, y, m, sums), None

      zero = jax.tree.map(jnp.asarray, steps.zero_eval_sums())
      sums, _ = jax.lax.scan(body, zero, (images, labels, mask))
      return sums

    r = self._replicated
    jitted = jax.jit(
      all_batches,
      in_shardings=(r, r, r, r, r),
      out_shardings=r,
      compiler_options=jaxmp.cpu_compiler_options() or None,
    )
    return lambda state: jitted(state, *self._arrays)
