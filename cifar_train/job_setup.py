"""The job's set-up: everything `train` does before its first epoch.

* `set_up`: settings to a `Job`: processes, mesh, data, model, optimizer;
  every run-time check that can fail before anything is written. It decides
  where the data lives (``data_on_device``, `place_splits`) and how many
  steps a call runs (``steps_per_call``, `auto_steps_per_call`);
* `restore`: the fresh state, or the workdir's newest usable checkpoint, or
  ``init_from``'s weights; replicated on the mesh;
* `settle_precision` and `compile_steps`: the calibrated loss scale, then the
  jitted train and eval steps; without calibration the steps come first and
  `compile_ahead` compiles the train step on a thread, from shapes, while
  `restore` runs.

`cifar_train.loop` runs the epochs (and re-exports these names).
"""

import dataclasses
import math
import os
import threading
from typing import Any, Callable, Optional

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxmp
from cifar_train import batches as batches_lib
from cifar_train import checkpoint as ckpt_lib
from cifar_train import data_sources
from cifar_train import faults as faults_lib
from cifar_train import host_stream
from cifar_train import mesh as mesh_lib
from cifar_train import settings as settings_lib
from cifar_train import startup
from cifar_train import steps
from cifar_train.errors import ConfigError
from cifar_train.errors import TrainingError


def load_data(s: settings_lib.Settings) -> data_sources.Dataset:
  """The data set that the settings name."""
  return data_sources.load(
    s.dataset,
    s.data_dir,
    synthetic_examples=(s.synthetic_train_examples, s.synthetic_test_examples),
  )


@dataclasses.dataclass(frozen=True)
class Job:
  """What `set_up` builds: everything about a run but its state.

  Attributes:
    settings: the resolved config.
    mesh: the 1-D ``data`` mesh.
    data: the data set.
    model: the Flax ResNet.
    precision: the preset, its loss scale calibrated by `settle_precision`.
    learning_rate: the schedule, over ``num_epochs`` epochs.
    optimizer: the wrapped optimizer of ``precision``.
    faults: the test knobs.
    steps_per_epoch: full batches per epoch.
    total_steps: where this run stops (``num_train_steps`` or the schedule).
    initial: ``init_from``'s params and batch_stats, or None.
    data_on_device: the training split lives on the devices
      (`batches.DeviceResident`), else the host feeds it (`batches.HostStream`).
    test_on_device: the test split lives on the devices
      (`batches.ResidentEval`), else the host feeds it (`batches.HostEval`).
    steps_per_call: the most train steps a jitted call runs (`call_sizes`).
  """

  settings: settings_lib.Settings
  mesh: Mesh
  data: data_sources.Dataset
  model: Any
  precision: settings_lib.Precision
  learning_rate: optax.Schedule
  optimizer: optax.GradientTransformation
  faults: faults_lib.Faults
  steps_per_epoch: int
  total_steps: int
  initial: Optional[dict]
  data_on_device: bool = False
  test_on_device: bool = False
  steps_per_call: int = 1

  @property
  def replicated(self) -> NamedSharding:
    """Params, optimizer state and metrics: the same on every device."""
    return NamedSharding(self.mesh, P())

  @property
  def batch_sharding(self) -> NamedSharding:
    """Batches: split over the ``data`` axis."""
    return NamedSharding(self.mesh, P("data"))

  @property
  def num_devices(self) -> int:
    """The devices of the mesh."""
    return self.mesh.devices.size


def make_optimizer(
  s: settings_lib.Settings,
  precision: settings_lib.Precision,
  learning_rate: optax.Schedule,
) -> optax.GradientTransformation:
  """The optimizer of the settings with ``precision``'s loss scale."""
  return steps.create_optimizer(
    precision,
    learning_rate,
    momentum=s.momentum,
    nesterov=s.nesterov,
    weight_decay=s.weight_decay,
    seed=s.seed,
    diagnostics=s.diagnostics,
    skip_spikes=s.skip_spikes,
    rounding_every=s.rounding_every,
  )


def set_up(
  s: settings_lib.Settings, data: Optional[data_sources.Dataset] = None
) -> Job:
  """Joins the processes, builds mesh, data, model and optimizer.

  Raises:
    ConfigError: a value that only the devices or the data can refute (a
      batch larger than the data set, more devices than visible), before
      anything is written.
  """
  mesh_lib.initialize_distributed(
    s.coordinator_address,
    s.num_processes,
    s.process_id,
    heartbeat_timeout_s=s.distributed_heartbeat_timeout_s,
  )
  startup.enable_compile_cache(s.compile_cache_dir)
  mesh = mesh_lib.create_mesh(
    s.num_devices,
    {"batch_size": s.batch_size, "eval_batch_size": s.eval_batch_size},
  )
  data = data if data is not None else load_data(s)
  steps_per_epoch = host_stream.steps_per_epoch(
    len(data.train_images), s.batch_size
  )
  if steps_per_epoch < 1:
    raise ConfigError(
      f"batch_size {s.batch_size} is larger than the "
      f"{len(data.train_images)} training examples"
    )
  # num_train_steps stops the run early; the learning-rate schedule follows
  # num_epochs, so a run stopped at k steps and resumed is the same run.
  schedule_steps = steps_per_epoch * s.num_epochs
  total_steps = s.num_train_steps if s.num_train_steps > 0 else schedule_steps
  precision = s.precision
  model = steps.create_model(
    s.model,
    num_classes=data.num_classes,
    num_filters=s.num_filters,
    precision=precision,
  )
  learning_rate = steps.create_learning_rate(
    s.learning_rate,
    schedule=s.lr_schedule,
    warmup_steps=int(s.warmup_epochs * steps_per_epoch),
    total_steps=max(schedule_steps, total_steps),
  )
  data_on_device, test_on_device = place_splits(s.data_on_device, data, mesh)
  steps_per_call = s.steps_per_call
  if steps_per_call == "auto":
    steps_per_call = auto_steps_per_call(
      jax.default_backend(),
      steps_per_epoch,
      s.log_every_steps,
      s.checkpoint_every_steps,
    )
  # Read and checked before anything is written: a mismatch is one line.
  initial = None
  if s.init_from:
    initial = steps.load_torch_weights(
      s.init_from,
      model_name=s.model,
      num_classes=data.num_classes,
      num_filters=s.num_filters,
    )
  return Job(
    settings=s,
    mesh=mesh,
    data=data,
    model=model,
    precision=precision,
    learning_rate=learning_rate,
    optimizer=make_optimizer(s, precision, learning_rate),
    faults=faults_lib.Faults(
      nan_data_at_step=s.inject_nan_data_at_step,
      overflow_at_step=s.inject_overflow_at_step,
      overflow_leaf=s.inject_overflow_leaf,
    ),
    steps_per_epoch=steps_per_epoch,
    total_steps=total_steps,
    initial=initial,
    data_on_device=data_on_device,
    test_on_device=test_on_device,
    steps_per_call=steps_per_call,
  )


# data_on_device="auto": a split lives on the devices when its uint8 copy
# there takes at most this fraction of one device's memory (both splits
# together; on a CPU, of the host's RAM, once per device of the mesh).
DEVICE_MEMORY_FRACTION = 0.25
MAX_AUTO_STEPS_PER_CALL = 8


def device_memory_bytes(device) -> int:
  """The memory of ``device``; on a CPU (no memory stats), the host's RAM."""
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    stats = {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def place_splits(
  setting: Any, data: data_sources.Dataset, mesh: Mesh
) -> tuple[bool, bool]:
  """``(train split on the devices, test split on the devices)``.

  ``setting`` is ``config.data_on_device``: True or False decide the
  training split; "auto" puts it on the devices when its padded uint8 copy
  fits in `DEVICE_MEMORY_FRACTION` of a device's memory. The test split
  goes to the devices when it fits in what is left of that fraction.
  """
  devices = mesh.devices.flatten()
  budget = DEVICE_MEMORY_FRACTION * device_memory_bytes(devices[0])
  if devices[0].platform == "cpu":  # The CPU devices share the host's RAM.
    budget /= len(devices)
  n, h, w, c = data.train_images.shape
  pad = 2 * host_stream.PAD
  train_bytes = n * ((h + pad) * (w + pad) * c + 4)
  test_bytes = int(np.prod(data.test_images.shape)) + 5 * len(data.test_images)
  train = train_bytes <= budget if setting == "auto" else bool(setting)
  left = budget - (train_bytes if train else 0)
  return train, test_bytes <= left


def auto_steps_per_call(
  backend: str, steps_per_epoch: int, log_every: int, checkpoint_every: int
) -> int:
  """``steps_per_call="auto"``: 1 on a CPU; elsewhere a k that fits the run.

  The largest k <= `MAX_AUTO_STEPS_PER_CALL` that divides the steps of an
  epoch, ``log_every`` and ``checkpoint_every`` (when > 0), so that every
  call runs k steps. On a CPU a step takes milliseconds or more, and the
  host's dispatch (microseconds) hides behind it.

  >>> auto_steps_per_call("gpu", 390, 50, 0)
  5
  >>> auto_steps_per_call("cpu", 390, 50, 0)
  1
  """
  if backend == "cpu":
    return 1
  g = math.gcd(steps_per_epoch, log_every)
  if checkpoint_every > 0:
    g = math.gcd(g, checkpoint_every)
  return max(k for k in range(1, MAX_AUTO_STEPS_PER_CALL + 1) if g % k == 0)


def restore(
  job: Job, manager, init: Optional[Callable[[], steps.TrainState]] = None
) -> tuple[steps.TrainState, Optional[str]]:
  """The state to start from, replicated over the mesh, and where from.

  The workdir's newest usable checkpoint (`checkpoint.restore_latest`)
  takes precedence over ``init_from``; with neither, a fresh state.
  ``init`` is `steps.make_init` of the job, when the caller has made it.

  Returns:
    ``(state, path of the checkpoint or None)``.
  """
  s = job.settings
  if init is None:
    init = make_init(job)
  state = init()
  faults_lib.check(job.faults, state.params)
  state, resumed = ckpt_lib.restore_latest(manager, state)
  if job.initial is not None and not resumed:
    state = steps.with_initial_weights(state, job.optimizer, job.initial)
    print(f"Initialised params and batch_stats from {s.init_from}", flush=True)
  if jax.process_count() > 1:
    # Placing a committed one-device array on other processes' devices is a
    # cross-host transfer, which CPU and GPU backends lack; every process
    # holds the same values, so place host copies (jax checks they agree).
    state = jax.device_get(state)
  state = jax.device_put(state, job.replicated)
  if resumed:
    print(f"Resuming from {resumed} at step {int(state.step)}", flush=True)
    if s.init_from:
      print(
        f"Not loading init_from {s.init_from}: the workdir's checkpoint "
        "takes precedence",
        flush=True,
      )
  return state, resumed


def make_init(job: Job) -> Callable[[], steps.TrainState]:
  """The job's jitted fresh-state initialiser (`steps.make_init`)."""
  return steps.make_init(
    job.model, job.optimizer, job.data.image_shape, seed=job.settings.seed
  )


def make_batch_source(job: Job) -> batches_lib.BatchSource:
  """The train batches: host stream or device-resident, as configured."""
  s = job.settings
  source_cls = (
    batches_lib.DeviceResident if job.data_on_device else batches_lib.HostStream
  )
  source_args = dict(
    batch_size=s.batch_size,
    mean=s.mean,
    std=s.std,
    augment=s.augment,
    replicated=job.replicated,
    batch_sharding=job.batch_sharding,
    seed=s.seed,
    steps_per_call=job.steps_per_call,
  )
  return source_cls(job.data, **source_args)


def make_eval_source(job: Job):
  """The test batches: `batches.ResidentEval` or `batches.HostEval`."""
  s = job.settings
  cls = batches_lib.ResidentEval if job.test_on_device else batches_lib.HostEval
  return cls(
    job.data,
    batch_size=s.eval_batch_size,
    mean=s.mean,
    std=s.std,
    replicated=job.replicated,
    batch_sharding=job.batch_sharding,
  )


def calibrate(
  precision: settings_lib.Precision,
  loss_fn,
  state: steps.TrainState,
  source: batches_lib.BatchSource,
) -> settings_lib.Precision:
  """``precision`` starting from `jaxmp.calibrate_loss_scale`.

  Probes the first batch of a fresh run (``state`` at step 0); prints the
  scale chosen and the number of gradient evaluations it took.

  Raises:
    TrainingError: the gradients are non-finite at every probed scale (the
      loss itself is NaN/inf, or the model overflows in any case).
  """
  args = next(iter(source.epoch(state, 0, 0, 1)))
  images, labels = source.batch(state, *args)
  ls = precision.loss_scale
  try:
    scale, evaluations = jaxmp.calibrate_loss_scale(
      loss_fn,
      state.params,
      state.batch_stats,
      images,
      labels,
      min_loss_scale=float(ls.min_loss_scale),
      max_loss_scale=precision.max_loss_scale,
      has_aux=True,
      return_evaluations=True,
    )
  except ValueError as e:
    raise TrainingError(f"init_loss_scale 'auto': {e}") from None
  # The largest finite probe over the margin may lie below the floor.
  scale = max(scale, float(ls.min_loss_scale))
  print(
    f"init_loss_scale 'auto': {scale:g} (2^{int(np.log2(scale))}), from "
    f"{evaluations} gradient evaluations on the first batch",
    flush=True,
  )
  return settings_lib.with_initial_scale(precision, scale)


def settle_precision(
  job: Job,
  state: steps.TrainState,
  source: batches_lib.BatchSource,
  resumed: Optional[str],
) -> tuple[Job, steps.TrainState]:
  """With ``init_loss_scale='auto'``: the job and state of the scale found.

  A fresh run calibrates on its first batch and starts its optimizer state
  from the scale found; a resumed run keeps its checkpoint's scale.
  """
  if not job.precision.calibrate:
    return job, state
  if resumed:
    print(
      "init_loss_scale 'auto': resumed, keeping the checkpoint's loss scale",
      flush=True,
    )
    return job, state
  loss_fn = steps.make_loss_fn(
    job.model,
    compute_dtype=job.precision.compute_dtype,
    label_smoothing=job.settings.label_smoothing,
  )
  precision = calibrate(job.precision, loss_fn, state, source)
  optimizer = make_optimizer(job.settings, precision, job.learning_rate)
  state = state.replace(
    opt_state=jax.device_put(optimizer.init(state.params), job.replicated)
  )
  return dataclasses.replace(
    job, precision=precision, optimizer=optimizer
  ), state


def compile_steps(
  job: Job, source: batches_lib.BatchSource, eval_source=None
) -> tuple[Callable[..., Any], Callable[[steps.TrainState], Any]]:
  """The jitted ``(train call over source's batches, evaluation)``.

  The train call is ``step(state, *args, metrics) -> (state, metrics)``
  for the ``args`` of `BatchSource.calls`: one program for calls of any
  number of steps up to ``job.steps_per_call``. The evaluation is
  ``run(state) -> sums`` over the whole test split (``eval_source``, by
  default `make_eval_source`); see `evaluate`.
  """
  precision = job.precision
  step_fn = source.jit_step(
    steps.make_train_step(
      job.model,
      job.optimizer,
      compute_dtype=precision.compute_dtype,
      label_smoothing=job.settings.label_smoothing,
      faults=job.faults,
      grad_reduce=precision.grad_reduce,
      mesh=job.mesh,
    )
  )
  if eval_source is None:
    eval_source = make_eval_source(job)
  eval_run = eval_source.jit_eval(
    steps.make_eval_step(job.model, compute_dtype=precision.compute_dtype)
  )
  return step_fn, eval_run


def compile_ahead(
  job: Job,
  source: batches_lib.BatchSource,
  step_fn,
  state_like: steps.TrainState,
) -> threading.Thread:
  """Starts compiling ``step_fn`` on a daemon thread; join it before a step.

  The step is traced on shapes alone (``state_like``, e.g.
  ``init.trace().out_info``, and `BatchSource.step_args_like`), so that its
  tracing and XLA's compilation (or the persistent cache's load) overlap
  the state's initialisation and restore. The first real call then finds
  the executable in jax's caches. An error here is dropped: the first call
  compiles again and raises it there, with its traceback.
  """
  replicated = job.replicated

  def like(x):
    return jax.ShapeDtypeStruct(
      x.shape, x.dtype, weak_type=x.weak_type, sharding=replicated
    )

  def work():
    try:
      state = jax.tree.map(like, state_like)
      metrics = jax.tree.map(
        like, jax.eval_shape(steps.zero_metrics, state_like.opt_state)
      )
      step_fn.trace(state, *source.step_args_like(), metrics).lower().compile()
    except Exception:  # pylint: disable=broad-except
      pass  # Raised again by the first step, where it belongs.

  thread = threading.Thread(target=work, daemon=True, name="compile-ahead")
  thread.start()
  return thread
