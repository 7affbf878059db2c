"""Training and evaluation of a ResNet on CIFAR-like data with jaxmp.

`train_and_evaluate(config, workdir)` is the whole job; it is made of small
named functions (model, optimizer, state, steps, data, logging) that tests call
one by one. One jitted train step (donated state, fixed shapes) runs over a 1-D
device mesh: the batch is sharded over the ``data`` axis, params and optimizer
state are replicated, so BatchNorm statistics, the finite check and the loss
scale are global by construction. The host only syncs on log steps and at the
end of an epoch.
"""

import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Optional

from absl import logging
import flax
import jax
import jax.numpy as jnp
import jmp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxmp
from jaxmp._src import checkpoint as ckpt_lib
from jaxmp._src import input_pipeline
from jaxmp._src import reporting
from jaxmp._src import resnet


class ConfigError(ValueError):
  """A config value is invalid; the message names it and the valid choices."""


@flax.struct.dataclass
class TrainState:
  """Everything that decides the future of a run.

  Attributes:
    step: number of optimizer steps taken.
    params: model params, in the preset's param dtype.
    batch_stats: BatchNorm running statistics (fp32 unless O3).
    opt_state: optimizer state, including jaxmp's masters and loss scale.
    rng: the data/augmentation key of the run.
  """
  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: Any
  rng: jax.Array


# ---------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------

MODELS = ("resnet18", "resnet18_torchvision")
SCHEDULES = ("cosine", "constant")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises `ConfigError` naming the first invalid value and the valid ones."""
  if config.model not in MODELS:
    raise ConfigError(f"unknown model {config.model!r}; valid: "
                      f"{', '.join(MODELS)}")
  if config.dataset not in input_pipeline.DATASETS:
    raise ConfigError(f"unknown dataset {config.dataset!r}; valid: "
                      f"{', '.join(input_pipeline.DATASETS)}")
  try:
    jaxmp.get_preset(config.policy)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  for key in ("batch_size", "eval_batch_size", "num_filters", "num_epochs"):
    if int(config[key]) < 1:
      raise ConfigError(f"{key} must be >= 1, got {config[key]}")
  if config.lr_schedule not in SCHEDULES:
    raise ConfigError(f"unknown lr_schedule {config.lr_schedule!r}; valid: "
                      f"{', '.join(SCHEDULES)}")
  if config.dataset == "image_folder" and not config.data_dir:
    raise ConfigError("dataset 'image_folder' needs --config.data_dir=DIR "
                      "holding train/<class>/* and test/<class>/*")
  if config.data_dir and not os.path.isdir(config.data_dir) and (
      config.dataset == "image_folder"):
    raise ConfigError(f"data_dir {config.data_dir!r} does not exist")
  if len(config.mean) != 3 or len(config.std) != 3:
    raise ConfigError("mean and std must have 3 values (RGB)")


# ---------------------------------------------------------------------------
# Model, optimizer, state.
# ---------------------------------------------------------------------------


def create_model(config: ml_collections.ConfigDict, num_classes: int,
                 axis_name: Optional[str] = None) -> resnet.ResNet:
  """The ResNet of ``config.model`` with the preset's dtypes."""
  preset = jaxmp.get_preset(config.policy)
  policy = preset.policy
  norm_dtype = jnp.float32 if preset.keep_batchnorm_fp32 else (
      policy.param_dtype)
  return resnet.get_model(
      config.model, num_classes=num_classes, num_filters=config.num_filters,
      dtype=policy.compute_dtype, param_dtype=policy.param_dtype,
      norm_dtype=norm_dtype, axis_name=axis_name)


def create_learning_rate(config: ml_collections.ConfigDict,
                         steps_per_epoch: int,
                         total_steps: int) -> optax.Schedule:
  """The learning-rate schedule (optional linear warm-up, then cosine)."""
  warmup = int(config.warmup_epochs * steps_per_epoch)
  if config.lr_schedule == "constant":
    main = optax.constant_schedule(config.learning_rate)
  else:
    main = optax.cosine_decay_schedule(config.learning_rate,
                                       max(total_steps - warmup, 1))
  if warmup == 0:
    return main
  return optax.join_schedules(
      [optax.linear_schedule(0.0, config.learning_rate, warmup), main],
      [warmup])


def create_loss_scale(config: ml_collections.ConfigDict) -> jaxmp.LossScale:
  """The preset's loss scale, with the config's dynamic-scale settings."""
  if jaxmp.get_preset(config.policy).loss_scale == "none":
    return jmp.NoOpLossScale()
  return jmp.DynamicLossScale(
      np.float32(config.init_loss_scale), period=config.loss_scale_period,
      factor=config.loss_scale_factor,
      min_loss_scale=np.float32(config.min_loss_scale))


def create_optimizer(config: ml_collections.ConfigDict,
                     learning_rate: optax.Schedule
                     ) -> optax.GradientTransformation:
  """SGD with momentum and coupled weight decay (torch.optim.SGD), wrapped.

  Apex's FusedSGD fused the update into one kernel; here XLA fuses the whole
  optax chain, masters and loss-scale bookkeeping included.
  """
  preset = jaxmp.get_preset(config.policy)
  inner = optax.chain(
      optax.add_decayed_weights(config.weight_decay),
      optax.sgd(learning_rate, momentum=config.momentum or None,
                nesterov=config.nesterov))
  return jaxmp.mixed_precision(
      inner, loss_scale=create_loss_scale(config),
      max_loss_scale=config.max_loss_scale,
      hysteresis=config.loss_scale_hysteresis,
      master_weights=preset.master_weights)


def create_train_state(config: ml_collections.ConfigDict, model: resnet.ResNet,
                       optimizer: optax.GradientTransformation,
                       image_shape: tuple[int, ...]) -> TrainState:
  """Initialises params (in the param dtype), BatchNorm stats and opt state."""
  init_key, data_key = jax.random.split(jax.random.key(config.seed))

  @jax.jit
  def init(key):
    variables = model.init(key, jnp.zeros((1,) + tuple(image_shape)),
                           train=False)
    params = variables["params"]
    return params, variables.get("batch_stats", {})

  params, batch_stats = init(init_key)
  return TrainState(step=jnp.zeros([], jnp.int32), params=params,
                    batch_stats=batch_stats, opt_state=optimizer.init(params),
                    rng=jax.random.key_data(data_key))


def cross_entropy(logits: jax.Array, labels: jax.Array,
                  label_smoothing: float = 0.0) -> jax.Array:
  """Per-example softmax cross-entropy, in fp32."""
  logits = logits.astype(jnp.float32)
  one_hot = jax.nn.one_hot(labels, logits.shape[-1])
  if label_smoothing:
    one_hot = optax.smooth_labels(one_hot, label_smoothing)
  return optax.softmax_cross_entropy(logits, one_hot)


def make_train_step(config: ml_collections.ConfigDict, model: resnet.ResNet,
                    optimizer: optax.GradientTransformation):
  """Returns ``train_step(state, images, labels, metrics) -> (state, metrics)``.

  ``images`` are normalised float images; ``metrics`` accumulates
  ``loss_sum``, ``correct`` and ``count`` on the device, so nothing is
  fetched per step.
  """
  dtype = jaxmp.get_policy(config.policy).compute_dtype

  def train_step(state: TrainState, images, labels, metrics):
    images = images.astype(dtype)

    def loss_fn(params):
      logits, new_vars = model.apply(
          {"params": params, "batch_stats": state.batch_stats}, images,
          train=True, mutable=["batch_stats"])
      loss = cross_entropy(logits, labels, config.label_smoothing).mean()
      return jaxmp.scale_loss(loss, state.opt_state), (loss, logits, new_vars)

    grads, (loss, logits, new_vars) = jax.grad(loss_fn, has_aux=True)(
        state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # The forward pass of a skipped step must not move the running stats.
    batch_stats = jaxmp.rollback_if_skipped(
        opt_state, new_vars["batch_stats"], state.batch_stats)
    n = labels.shape[0]
    metrics = {
        "loss_sum": metrics["loss_sum"] + loss * n,
        "correct": metrics["correct"] + jnp.sum(
            jnp.argmax(logits, -1) == labels),
        "count": metrics["count"] + n,
        "last_loss": loss,
    }
    return state.replace(step=state.step + 1, params=params,
                         batch_stats=batch_stats, opt_state=opt_state), metrics

  return train_step


def make_device_train_step(config: ml_collections.ConfigDict,
                           model: resnet.ResNet,
                           optimizer: optax.GradientTransformation,
                           batch_sharding: NamedSharding):
  """The train step of the device-resident mode.

  ``train_step(state, images_u8, labels, perm, batch_index, metrics)`` slices
  the epoch permutation, gathers the uint8 batch, crops, flips and normalises
  it on the device, then runs the ordinary step. Randomness comes from
  ``(state.rng, step)``, so a resumed run sees the same batches.
  """
  inner = make_train_step(config, model, optimizer)
  batch = config.batch_size

  def train_step(state, images_u8, labels, perm, batch_index, metrics):
    idx = jax.lax.dynamic_slice_in_dim(perm, batch_index * batch, batch)
    idx = jax.lax.with_sharding_constraint(idx, batch_sharding)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    x = images_u8[idx]
    if config.get("augment", True):
      x = input_pipeline.device_augment(x, key)
    x = input_pipeline.normalize(x, config.mean, config.std, jnp.float32)
    return inner(state, x, labels[idx], metrics)

  return train_step


def make_eval_step(config: ml_collections.ConfigDict, model: resnet.ResNet):
  """Returns ``eval_step(state, batch) -> {loss_sum, correct, count}``."""
  dtype = jaxmp.get_policy(config.policy).compute_dtype

  def eval_step(state: TrainState, images, labels, mask):
    logits = model.apply(
        {"params": state.params, "batch_stats": state.batch_stats},
        images.astype(dtype), train=False)
    mask = mask.astype(jnp.float32)
    return {
        "loss_sum": jnp.sum(cross_entropy(logits, labels) * mask),
        "correct": jnp.sum((jnp.argmax(logits, -1) == labels) * mask),
        "count": jnp.sum(mask),
    }

  return eval_step


def zero_metrics() -> dict[str, jax.Array]:
  return {"loss_sum": jnp.zeros([], jnp.float32),
          "correct": jnp.zeros([], jnp.int32),
          "count": jnp.zeros([], jnp.int32),
          "last_loss": jnp.zeros([], jnp.float32)}


def to_host(tree: Any) -> Any:
  """Fetches replicated arrays, also those spanning several processes."""
  def fetch(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(x.addressable_data(0))
    return np.asarray(jax.device_get(x))
  return jax.tree.map(fetch, tree)


def params_fingerprint(state: TrainState) -> str:
  """sha256 of the fp32 master params, leaves in sorted path order."""
  masters = jaxmp.master_params(state.opt_state, state.params)
  flat = jax.tree_util.tree_leaves_with_path(to_host(masters))
  digest = hashlib.sha256()
  for path, leaf in sorted(flat, key=lambda kv: jax.tree_util.keystr(kv[0])):
    digest.update(jax.tree_util.keystr(path).encode())
    digest.update(np.ascontiguousarray(leaf, np.float32).tobytes())
  return digest.hexdigest()


# ---------------------------------------------------------------------------
# Devices and data.
# ---------------------------------------------------------------------------


def initialize_distributed(config: ml_collections.ConfigDict) -> None:
  """Joins a multi-process run when one is configured; no-op otherwise.

  ``config.coordinator_address`` (with ``num_processes`` and ``process_id``)
  starts `jax.distributed` explicitly; otherwise a cluster launcher that JAX
  detects (SLURM, Open MPI, ``JAX_COORDINATOR_ADDRESS``) does.
  """
  address = config.get("coordinator_address", "")
  if address:
    jax.distributed.initialize(address, int(config.num_processes),
                               int(config.process_id))
  elif any(v in os.environ for v in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE",
                                     "JAX_COORDINATOR_ADDRESS")):
    jax.distributed.initialize()


def create_mesh(config: ml_collections.ConfigDict) -> Mesh:
  """A 1-D ``data`` mesh over ``config.num_devices`` devices (0 = all)."""
  devices = jax.devices()
  n = config.get("num_devices", 0) or len(devices)
  if n > len(devices):
    raise ConfigError(f"num_devices={n} but only {len(devices)} devices are "
                      "visible")
  for key in ("batch_size", "eval_batch_size"):
    if config[key] % n:
      raise ConfigError(
          f"{key} {config[key]} is not divisible by the {n} devices; use a "
          f"multiple of {n}")
  return Mesh(np.asarray(devices[:n]), ("data",))


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding
                 ) -> dict[str, jax.Array]:
  """A global array sharded over ``data`` from this process's rows."""
  return {k: jax.make_array_from_process_local_data(sharding, v)
          for k, v in local.items()}


@dataclasses.dataclass
class Data:
  """The splits in host memory (and, in device mode, on the devices)."""
  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray
  num_classes: int


def load_data(config: ml_collections.ConfigDict) -> Data:
  train_images, train_labels = input_pipeline.load_split(config, "train")
  test_images, test_labels = input_pipeline.load_split(config, "test")
  num_classes = int(max(train_labels.max(), test_labels.max()) + 1)
  try:
    num_classes = max(num_classes, input_pipeline.num_classes(config))
  except Exception:  # pylint: disable=broad-except
    pass  # mock data and image folders: count what was read.
  return Data(train_images, train_labels, test_images, test_labels,
              num_classes)


# ---------------------------------------------------------------------------
# The loop.
# ---------------------------------------------------------------------------


def evaluate(config, eval_step, state, data: Data, sharding) -> dict:
  """Loss and accuracy over every test example exactly once."""
  totals = zero_metrics()
  del totals["last_loss"]
  for batch in input_pipeline.eval_batches(
      config, data.test_images, data.test_labels,
      batch_size=config.eval_batch_size,
      process_index=jax.process_index(), process_count=jax.process_count()):
    b = global_batch(batch, sharding)
    m = eval_step(state, b["image"], b["label"], b["mask"])
    totals = jax.tree.map(lambda a, x: a + x.astype(a.dtype), totals, m)
  totals = to_host(totals)
  count = max(int(totals["count"]), 1)
  return {"loss": float(totals["loss_sum"]) / count,
          "accuracy": float(totals["correct"]) / count,
          "count": int(totals["count"])}


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> dict:
  """Trains, evaluates every epoch, writes the outputs; returns the summary.

  Args:
    config: see ``configs/default.py`` for the fields.
    workdir: where metrics, summary, plots, TensorBoard events and
      checkpoints go; a workdir with checkpoints is resumed.

  Returns:
    The summary written to ``<workdir>/summary.json``.
  """
  validate_config(config)
  reporting.check_workdir(workdir)
  start_time = time.time()
  data = load_data(config)
  mesh = create_mesh(config)
  num_devices = mesh.devices.size
  replicated = NamedSharding(mesh, P())
  batch_sharding = NamedSharding(mesh, P("data"))

  steps_per_epoch = input_pipeline.steps_per_epoch(len(data.train_images),
                                                   config.batch_size)
  if steps_per_epoch < 1:
    raise ConfigError(f"batch_size {config.batch_size} is larger than the "
                      f"{len(data.train_images)} training examples")
  # num_train_steps stops the run early; the learning-rate schedule follows
  # num_epochs, so a run stopped at k steps and resumed is the same run.
  schedule_steps = steps_per_epoch * config.num_epochs
  total_steps = (config.num_train_steps if config.num_train_steps > 0 else
                 schedule_steps)

  model = create_model(config, data.num_classes)
  optimizer = create_optimizer(
      config, create_learning_rate(config, steps_per_epoch,
                                   max(schedule_steps, total_steps)))
  state = create_train_state(config, model, optimizer,
                             data.train_images.shape[1:])
  manager = ckpt_lib.create_manager(workdir, config)
  state, resumed = ckpt_lib.restore_latest(manager, state)
  if jax.process_count() > 1:
    # Placing a committed one-device array on other processes' devices is a
    # cross-host transfer, which CPU and GPU backends lack; every process
    # holds the same values, so place host copies (jax checks they agree).
    state = jax.device_get(state)
  state = jax.device_put(state, replicated)
  first_step = int(state.step)
  if resumed:
    print(f"Resuming from {resumed} at step {first_step}", flush=True)

  eval_step = jax.jit(make_eval_step(config, model),
                      in_shardings=(replicated, batch_sharding,
                                    batch_sharding, batch_sharding),
                      out_shardings=replicated)
  if config.data_on_device:
    images_dev = jax.device_put(data.train_images, replicated)
    labels_dev = jax.device_put(data.train_labels, replicated)
    step_fn = jax.jit(
        make_device_train_step(config, model, optimizer, batch_sharding),
        in_shardings=(replicated, replicated, replicated, replicated, None,
                      replicated),
        out_shardings=(replicated, replicated), donate_argnums=(0, 5))
    perm_fn = jax.jit(
        lambda key, epoch: input_pipeline.device_epoch_permutation(
            jax.random.wrap_key_data(key), epoch, len(data.train_images)),
        out_shardings=replicated)
  else:
    step_fn = jax.jit(
        make_train_step(config, model, optimizer),
        in_shardings=(replicated, batch_sharding, batch_sharding, replicated),
        out_shardings=(replicated, replicated), donate_argnums=(0, 3))

  writer = reporting.Reporter(workdir, config, num_devices=num_devices,
                              total_steps=total_steps)
  step = first_step
  last_train = {"loss": float("nan"), "accuracy": float("nan")}
  test = None
  while step < total_steps:
    epoch, start_batch = divmod(step, steps_per_epoch)
    epoch_end = min((epoch + 1) * steps_per_epoch, total_steps)
    metrics = jax.device_put(zero_metrics(), replicated)
    epoch_start, epoch_first_step = time.time(), step
    if config.data_on_device:
      perm = perm_fn(state.rng, epoch)
      batches = range(start_batch, start_batch + epoch_end - step)
    else:
      batches = input_pipeline.train_batches(
          config, data.train_images, data.train_labels, epoch=epoch,
          start_batch=start_batch, process_index=jax.process_index(),
          process_count=jax.process_count())
    for batch in batches:
      if step >= epoch_end:
        break
      if config.data_on_device:
        state, metrics = step_fn(state, images_dev, labels_dev, perm,
                                 np.int32(batch), metrics)
      else:
        b = global_batch(batch, batch_sharding)
        state, metrics = step_fn(state, b["image"], b["label"], metrics)
      step += 1
      writer.progress(step)
      if step % config.log_every_steps == 0 or step == epoch_end:
        jaxmp.check_health(state.opt_state, step,
                           config.max_consecutive_skips)
        writer.log_step(step, to_host(
            {**jaxmp.stats(state.opt_state), "loss": metrics["last_loss"]}))
      if ckpt_lib.should_save(config, step, epoch_end, total_steps):
        ckpt_lib.save(manager, state, step, epoch_end == step,
                      steps_per_epoch)
    m = to_host(metrics)
    elapsed = time.time() - epoch_start
    count = max(int(m["count"]), 1)
    last_train = {"loss": float(m["loss_sum"]) / count,
                  "accuracy": float(m["correct"]) / count}
    test = evaluate(config, eval_step, state, data, batch_sharding)
    stats = to_host(jaxmp.stats(state.opt_state))
    writer.log_epoch(
        epoch=epoch + 1, step=step, train=last_train, test=test,
        loss_scale=float(stats["loss_scale"]),
        skipped_steps=int(stats["skipped_steps"]),
        images_per_sec=(step - epoch_first_step) * config.batch_size /
        max(elapsed, 1e-9))
  if test is None:  # Nothing left to train (resumed at the end): evaluate.
    test = evaluate(config, eval_step, state, data, batch_sharding)
  ckpt_lib.wait_until_finished(manager)
  summary = {
      "test_loss": test["loss"],
      "test_accuracy": test["accuracy"],
      "train_loss": last_train["loss"],
      "train_accuracy": last_train["accuracy"],
      "steps": int(state.step),
      "wall_seconds": time.time() - start_time,
      "num_devices": num_devices,
      "num_processes": jax.process_count(),
      "params_fingerprint": params_fingerprint(state),
      "config": config.to_dict(),
  }
  writer.finish(summary)
  manager.close()
  logging.info("done: %s", json.dumps({k: v for k, v in summary.items()
                                        if k != "config"}))
  return summary

