"""The whole job: `train_and_evaluate(config, workdir)`.

The one function that reads the config: it resolves it into `Settings`, then
wires data, mesh, model, optimizer, checkpoints and reporting together with
explicit values. One jitted train step (donated state, fixed shapes) runs over
a 1-D device mesh: the batch is sharded over ``data``, params and optimizer
state are replicated, so BatchNorm statistics, the finite check and the loss
scale are global by construction. The host syncs only on log steps and at the
end of an epoch.
"""

import json
import time
from typing import Optional

from absl import logging
import jax
import numpy as np
import ml_collections
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxmp
from cifar_train import batches as batches_lib
from cifar_train import checkpoint as ckpt_lib
from cifar_train import data_sources
from cifar_train import faults as faults_lib
from cifar_train import host_stream
from cifar_train import mesh as mesh_lib
from cifar_train import reporting
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


def evaluate(
  eval_step,
  state: steps.TrainState,
  data: data_sources.Dataset,
  sharding: NamedSharding,
  *,
  batch_size: int,
  mean,
  std,
) -> dict:
  """Loss and accuracy over every test example exactly once."""
  totals = steps.zero_metrics()
  del totals["last_loss"]
  for batch in host_stream.eval_batches(
    data.test_images,
    data.test_labels,
    batch_size=batch_size,
    mean=mean,
    std=std,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
  ):
    b = mesh_lib.global_batch(batch, sharding)
    m = eval_step(state, b["image"], b["label"], b["mask"])
    totals = jax.tree.map(lambda a, x: a + x.astype(a.dtype), totals, m)
  totals = mesh_lib.to_host(totals)
  count = max(int(totals["count"]), 1)
  return {
    "loss": float(totals["loss_sum"]) / count,
    "accuracy": float(totals["correct"]) / count,
    "count": int(totals["count"]),
  }


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


def worst_leaf(opt_state, metrics) -> Optional[tuple[str, int]]:
  """``(path, non-finite count)`` of the last skipped step's worst leaf.

  Host side, for log steps: `jaxmp.overflow_report` of the per-leaf report
  that the train step keeps of its last skipped step; None when no step of
  the epoch so far had a non-finite gradient.
  """
  rows = steps.skip_report(opt_state, metrics)
  if not rows or not rows[0].nonfinite:
    return None
  return rows[0].path, rows[0].nonfinite


def train_and_evaluate(
  config: ml_collections.ConfigDict,
  workdir: str,
  *,
  data: Optional[data_sources.Dataset] = None,
) -> dict:
  """Trains, evaluates every epoch, writes the outputs; returns the summary.

  Args:
    config: see ``configs/default.py`` for the fields.
    workdir: where metrics, summary, plots, TensorBoard events and
      checkpoints go; a workdir with checkpoints is resumed.
    data: the data set to train on; by default the one ``config`` names.

  Returns:
    The summary written to ``<workdir>/summary.json``.

  Raises:
    UserError: (a subclass of) for anything the user can fix.
  """
  return train(
    settings_lib.resolve(config),
    workdir,
    data=data,
    config_record=config.to_dict(),
  )


def train(
  s: settings_lib.Settings,
  workdir: str,
  *,
  data: Optional[data_sources.Dataset] = None,
  config_record: Optional[dict] = None,
) -> dict:
  """`train_and_evaluate` from resolved settings.

  ``config_record`` is what ``summary.json`` records as the config.
  """
  mesh_lib.initialize_distributed(
    s.coordinator_address, s.num_processes, s.process_id
  )
  reporting.check_workdir(workdir)
  start_time = time.time()
  startup.enable_compile_cache(s.compile_cache_dir)
  mesh = mesh_lib.create_mesh(
    s.num_devices,
    {"batch_size": s.batch_size, "eval_batch_size": s.eval_batch_size},
  )
  data = data if data is not None else load_data(s)
  num_devices = mesh.devices.size
  replicated = NamedSharding(mesh, P())
  batch_sharding = NamedSharding(mesh, P("data"))

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
  make_optimizer = lambda precision: steps.create_optimizer(
    precision,
    learning_rate,
    momentum=s.momentum,
    nesterov=s.nesterov,
    weight_decay=s.weight_decay,
    seed=s.seed,
    diagnostics=s.diagnostics,
  )
  optimizer = make_optimizer(precision)
  faults = faults_lib.Faults(
    nan_data_at_step=s.inject_nan_data_at_step,
    overflow_at_step=s.inject_overflow_at_step,
    overflow_leaf=s.inject_overflow_leaf,
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
  state = steps.create_train_state(
    model, optimizer, data.image_shape, seed=s.seed
  )
  faults_lib.check(faults, state.params)
  manager = ckpt_lib.create_manager(workdir, s.keep_checkpoints)
  state, resumed = ckpt_lib.restore_latest(manager, state)
  if initial is not None and not resumed:
    state = steps.with_initial_weights(state, optimizer, initial)
    print(f"Initialised params and batch_stats from {s.init_from}", flush=True)
  if jax.process_count() > 1:
    # Placing a committed one-device array on other processes' devices is a
    # cross-host transfer, which CPU and GPU backends lack; every process
    # holds the same values, so place host copies (jax checks they agree).
    state = jax.device_get(state)
  state = jax.device_put(state, replicated)
  first_step = int(state.step)
  if resumed:
    print(f"Resuming from {resumed} at step {first_step}", flush=True)
    if s.init_from:
      print(
        f"Not loading init_from {s.init_from}: the workdir's checkpoint "
        "takes precedence",
        flush=True,
      )

  eval_step = jax.jit(
    steps.make_eval_step(model, compute_dtype=precision.compute_dtype),
    in_shardings=(replicated, batch_sharding, batch_sharding, batch_sharding),
    out_shardings=replicated,
    compiler_options=jaxmp.cpu_compiler_options() or None,
  )
  source_cls = (
    batches_lib.DeviceResident if s.data_on_device else batches_lib.HostStream
  )
  source_args = dict(
    batch_size=s.batch_size,
    mean=s.mean,
    std=s.std,
    augment=s.augment,
    replicated=replicated,
    batch_sharding=batch_sharding,
    seed=s.seed,
  )
  source: batches_lib.BatchSource = source_cls(data, **source_args)
  loss_fn = steps.make_loss_fn(
    model,
    compute_dtype=precision.compute_dtype,
    label_smoothing=s.label_smoothing,
  )
  if precision.calibrate and not resumed:
    precision = calibrate(precision, loss_fn, state, source)
    optimizer = make_optimizer(precision)
    state = state.replace(
      opt_state=jax.device_put(optimizer.init(state.params), replicated)
    )
  elif precision.calibrate:
    print(
      "init_loss_scale 'auto': resumed, keeping the checkpoint's loss scale",
      flush=True,
    )
  step_fn = source.jit_step(
    steps.make_train_step(
      model,
      optimizer,
      compute_dtype=precision.compute_dtype,
      label_smoothing=s.label_smoothing,
      faults=faults,
    )
  )
  evaluate_args = dict(batch_size=s.eval_batch_size, mean=s.mean, std=s.std)

  writer = reporting.Reporter(
    workdir,
    num_devices=num_devices,
    total_steps=total_steps,
    progress_bar=s.progress_bar,
    initial_loss_scale=float(
      mesh_lib.to_host(jaxmp.stats(state.opt_state)["loss_scale"])
    ),
  )
  step = first_step
  last_train = {"loss": float("nan"), "accuracy": float("nan")}
  test = None
  seconds_to_first_step = None
  while step < total_steps:
    epoch, start_batch = divmod(step, steps_per_epoch)
    epoch_end = min((epoch + 1) * steps_per_epoch, total_steps)
    metrics = jax.device_put(steps.zero_metrics(state.opt_state), replicated)
    epoch_start, epoch_first_step = time.time(), step
    for args in source.epoch(state, epoch, start_batch, epoch_end - step):
      state, metrics = step_fn(state, *args, metrics)
      step += 1
      if seconds_to_first_step is None:  # One sync, on the first step only.
        jax.block_until_ready(state.step)
        seconds_to_first_step = time.time() - startup.process_start_time()
        print(
          f"First step done {seconds_to_first_step:.1f} s after start "
          "(imports, data, compile)",
          flush=True,
        )
      writer.progress(step)
      if step % s.log_every_steps == 0 or step == epoch_end:
        writer.log_step(
          step,
          mesh_lib.to_host(
            {
              **jaxmp.stats(state.opt_state),
              "loss": metrics["last_loss"],
              "accuracy": metrics["correct"] / metrics["count"],
            }
          ),
          worst_leaf=worst_leaf(state.opt_state, metrics)
          if s.diagnostics
          else None,
        )
        try:
          jaxmp.check_health(
            state.opt_state,
            step,
            s.max_consecutive_skips,
            max_nonfinite_loss_steps=s.max_nonfinite_loss_steps,
          )
        except (jaxmp.LossScaleCollapseError, jaxmp.NonFiniteLossError) as e:
          # Finish the pending save: orbax's writer thread must not outlive
          # the run (it fails at interpreter exit with a traceback).
          ckpt_lib.wait_until_finished(manager)
          manager.close()
          raise TrainingError(str(e)) from None
      if ckpt_lib.should_save(
        s.checkpoint_every_steps, step, epoch_end, total_steps
      ):
        ckpt_lib.save(manager, state, step, epoch_end == step, steps_per_epoch)
    m = mesh_lib.to_host(metrics)
    elapsed = time.time() - epoch_start
    count = max(int(m["count"]), 1)
    last_train = {
      "loss": float(m["loss_sum"]) / count,
      "accuracy": float(m["correct"]) / count,
    }
    test = evaluate(eval_step, state, data, batch_sharding, **evaluate_args)
    stats = mesh_lib.to_host(jaxmp.stats(state.opt_state))
    writer.log_epoch(
      epoch=epoch + 1,
      step=step,
      train=last_train,
      test=test,
      loss_scale=float(stats["loss_scale"]),
      skipped_steps=int(stats["skipped_steps"]),
      images_per_sec=(step - epoch_first_step)
      * s.batch_size
      / max(elapsed, 1e-9),
    )
  if test is None:  # Nothing left to train (resumed at the end): evaluate.
    test = evaluate(eval_step, state, data, batch_sharding, **evaluate_args)
  ckpt_lib.wait_until_finished(manager)
  summary = {
    "test_loss": test["loss"],
    "test_accuracy": test["accuracy"],
    "train_loss": last_train["loss"],
    "train_accuracy": last_train["accuracy"],
    "steps": int(state.step),
    "wall_seconds": time.time() - start_time,
    "seconds_to_first_step": seconds_to_first_step,
    "num_devices": num_devices,
    "num_processes": jax.process_count(),
    "params_fingerprint": steps.params_fingerprint(state),
    "state_fingerprint": steps.state_fingerprint(state),
    "config": config_record,
  }
  writer.finish(summary)
  manager.close()
  logging.info(
    "done: %s", json.dumps({k: v for k, v in summary.items() if k != "config"})
  )
  return summary
