"""The whole job: `train_and_evaluate(config, workdir)`, in named steps.

`train` is short on purpose (flax's ``examples/imagenet/train.py`` and
big_vision's ``train.py`` read the same way); each step is a function that a
test can call alone:

* the set-up, in `cifar_train.job_setup` (its names are re-exported here):
  `set_up` (processes, mesh, data, model, optimizer; every run-time check
  that can fail before anything is written), `restore` (the fresh state or
  a checkpoint), `settle_precision` and `compile_steps` (the calibrated loss
  scale, then the jitted steps; `compile_ahead` compiles on a thread while
  `restore` runs);
* `train_epoch`: a host loop over the calls of one epoch (up to k steps a
  call, `call_sizes`), with logging, the health check and checkpoint saves
  between calls;
* `evaluate`: loss and accuracy over the test set, summed on the devices;
* `finish`: the summary, written by the reporter.

One jitted train call (donated state, fixed shapes; a loop of up to k steps)
runs over a 1-D device mesh: the batch is sharded over ``data``, params and
optimizer state are replicated, so BatchNorm statistics, the finite check
and the loss scale are global by construction. The host syncs only on log
steps and at the end of an epoch. `set_up` decides where the data lives
(``data_on_device``, `place_splits`) and how many steps a call runs
(``steps_per_call``, `auto_steps_per_call`). The checkpoint manager and the reporter (progress bar, TensorBoard
writer) are context managers, closed on every exit, errors included.
"""

import contextlib
import dataclasses
import json
import time
from typing import Callable, Optional

from absl import logging
import jax
import ml_collections

import jaxmp
from cifar_train import batches as batches_lib
from cifar_train import checkpoint as ckpt_lib
from cifar_train import data_sources
from cifar_train import mesh as mesh_lib
from cifar_train import preemption as preemption_lib
from cifar_train import reporting
from cifar_train import settings as settings_lib
from cifar_train import startup
from cifar_train import steps
from cifar_train.errors import TrainingError

# The set-up steps live in `cifar_train.job_setup`, and every public name
# of it is here too: `train` calls them by these names (tests replace them
# here), and scripts reach them as ``loop.<name>``.
from cifar_train.job_setup import auto_steps_per_call as auto_steps_per_call
from cifar_train.job_setup import calibrate as calibrate
from cifar_train.job_setup import compile_ahead
from cifar_train.job_setup import compile_steps
from cifar_train.job_setup import (
  DEVICE_MEMORY_FRACTION as DEVICE_MEMORY_FRACTION,
)
from cifar_train.job_setup import device_memory_bytes as device_memory_bytes
from cifar_train.job_setup import Job
from cifar_train.job_setup import load_data as load_data
from cifar_train.job_setup import make_batch_source
from cifar_train.job_setup import make_eval_source
from cifar_train.job_setup import make_init
from cifar_train.job_setup import make_optimizer as make_optimizer
from cifar_train.job_setup import (
  MAX_AUTO_STEPS_PER_CALL as MAX_AUTO_STEPS_PER_CALL,
)
from cifar_train.job_setup import place_splits as place_splits
from cifar_train.job_setup import restore
from cifar_train.job_setup import set_up
from cifar_train.job_setup import settle_precision


def evaluate(eval_run, state: steps.TrainState) -> dict:
  """Loss and accuracy over every test example exactly once.

  ``eval_run`` (`compile_steps`'s) sums the whole split on the devices;
  the host fetches the sums once.
  """
  totals = mesh_lib.to_host(eval_run(state))
  count = max(int(totals["count"]), 1)
  return {
    "loss": float(totals["loss_sum"]) / count,
    "accuracy": float(totals["correct"]) / count,
    "count": int(totals["count"]),
  }


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


@dataclasses.dataclass
class Clock:
  """When the run started; how long its first step took to come."""

  start: float = dataclasses.field(default_factory=time.time)
  seconds_to_first_step: Optional[float] = None


def _log_step(job: Job, state, metrics, step: int, reporter) -> None:
  """A log step: the step's record, then the health check."""
  s = job.settings
  reporter.log_step(
    step,
    mesh_lib.to_host(
      {
        **jaxmp.stats(state.opt_state),
        "loss": metrics["last_loss"],
        "accuracy": metrics["correct"] / metrics["count"],
      }
    ),
    worst_leaf=worst_leaf(state.opt_state, metrics) if s.diagnostics else None,
    rounding=(
      jaxmp.rounding_report(state.opt_state) if s.rounding_every else None
    ),
  )
  try:
    jaxmp.check_health(
      state.opt_state,
      step,
      s.max_consecutive_skips,
      max_nonfinite_loss_steps=s.max_nonfinite_loss_steps,
    )
  except (
    jaxmp.LossScaleCollapseError,
    jaxmp.NonFiniteLossError,
    jaxmp.SpikeStallError,
  ) as e:
    raise TrainingError(str(e)) from None


def call_sizes(
  step: int, end: int, steps_per_call: int, is_stop: Callable[[int], bool]
) -> list[int]:
  """The steps of each call from ``step`` to ``end``: k, or fewer at a stop.

  No call runs past a step where ``is_stop`` holds (a log step, a save) or
  past ``end``: between two stops, calls of ``steps_per_call`` steps, then
  one call of the rest.

  >>> call_sizes(0, 10, 4, lambda s: s % 5 == 0)
  [4, 1, 4, 1]
  >>> call_sizes(3, 8, 8, lambda s: False)
  [5]
  """
  sizes = []
  while step < end:
    stop = step + 1
    while stop < end and not is_stop(stop):
      stop += 1
    n = stop - step
    sizes += [steps_per_call] * (n // steps_per_call)
    sizes += [n % steps_per_call] if n % steps_per_call else []
    step = stop
  return sizes


def train_epoch(
  job: Job,
  state: steps.TrainState,
  step_fn,
  source: batches_lib.BatchSource,
  *,
  reporter,
  manager,
  clock: Clock,
  preemption: Optional[preemption_lib.Preemption] = None,
) -> tuple[steps.TrainState, dict]:
  """The steps from ``state.step`` to the end of its epoch (or the run).

  A host loop over calls of ``step_fn`` (`compile_steps`), of `call_sizes`
  steps each: the host dispatches, and syncs only on log steps (one fetch
  each), where it also checks the run's health, and at saves. After each
  call, a preemption (`preemption_lib.Preemption.reached`, asked for every
  step the call ran) saves a checkpoint at the step reached and raises
  `preemption_lib.Preempted`.

  Returns:
    ``(state, {"loss", "accuracy", "epoch", "step", "steps", "seconds"})``:
    the train metrics of the steps run, fetched once at the end; the epoch
    (counted from 1) and the step reached; the number of steps run and the
    seconds they took.
  """
  s = job.settings
  step = int(state.step)  # One fetch per epoch.
  epoch, start_batch = divmod(step, job.steps_per_epoch)
  epoch_end = min((epoch + 1) * job.steps_per_epoch, job.total_steps)

  def is_log(k):
    return k % s.log_every_steps == 0 or k == epoch_end

  def is_save(k):
    return ckpt_lib.should_save(
      s.checkpoint_every_steps, k, epoch_end, job.total_steps
    )

  sizes = call_sizes(
    step, epoch_end, job.steps_per_call, lambda k: is_log(k) or is_save(k)
  )
  metrics = jax.device_put(steps.zero_metrics(state.opt_state), job.replicated)
  started, first = time.time(), step
  for n, args in zip(sizes, source.calls(state, epoch, start_batch, sizes)):
    state, metrics = step_fn(state, *args, metrics)
    step += n
    if clock.seconds_to_first_step is None:  # One sync, on the first call.
      jax.block_until_ready(state.step)
      clock.seconds_to_first_step = time.time() - startup.process_start_time()
      print(
        f"First step done {clock.seconds_to_first_step:.1f} s after start "
        "(imports, data, compile)",
        flush=True,
      )
    reporter.progress(step)
    if is_log(step):
      _log_step(job, state, metrics, step, reporter)
    saved = is_save(step)
    if saved:
      ckpt_lib.save(
        manager, state, step, epoch_end == step, job.steps_per_epoch
      )
    if preemption is not None and any(
      preemption.reached(k) for k in range(step - n + 1, step + 1)
    ):
      preemption_lib.save_and_stop(
        manager, state, step, epoch_end == step, job.steps_per_epoch, saved
      )
  m = mesh_lib.to_host(metrics)
  count = max(int(m["count"]), 1)
  return state, {
    "loss": float(m["loss_sum"]) / count,
    "accuracy": float(m["correct"]) / count,
    "epoch": epoch + 1,
    "step": step,
    "steps": step - first,
    "seconds": time.time() - started,
  }


def finish(
  job: Job,
  state: steps.TrainState,
  *,
  train: dict,
  test: dict,
  manager,
  reporter,
  clock: Clock,
  config_record: Optional[dict],
) -> dict:
  """Waits for the last save; writes and returns the summary."""
  ckpt_lib.wait_until_finished(manager)
  summary = {
    "test_loss": test["loss"],
    "test_accuracy": test["accuracy"],
    "test_count": test["count"],
    "train_loss": train["loss"],
    "train_accuracy": train["accuracy"],
    "steps": int(state.step),
    "wall_seconds": time.time() - clock.start,
    "seconds_to_first_step": clock.seconds_to_first_step,
    "num_devices": job.num_devices,
    "num_processes": jax.process_count(),
    "params_fingerprint": steps.params_fingerprint(state),
    "state_fingerprint": steps.state_fingerprint(state),
    "config": config_record,
  }
  if job.settings.rounding_every:
    reporter.log_rounding(jaxmp.rounding_report(state.opt_state))
  reporter.finish(summary)
  logging.info(
    "done: %s", json.dumps({k: v for k, v in summary.items() if k != "config"})
  )
  return summary


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
  clock = Clock()
  reporting.check_workdir(workdir)
  job = set_up(s, data)
  with contextlib.ExitStack() as resources:
    manager = resources.enter_context(
      ckpt_lib.open_manager(workdir, s.keep_checkpoints)
    )
    # SIGTERM / SIGINT from here on: a checkpoint at the step, then stop.
    preemption = resources.enter_context(preemption_lib.Preemption())
    # The batch source first: where it crops, it pads the data set on a
    # background thread while `restore` initialises the state.
    source = make_batch_source(job)
    eval_source = make_eval_source(job)
    init = make_init(job)
    ahead = None
    if not job.precision.calibrate:  # Else the optimizer is not final yet.
      step_fn, eval_run = compile_steps(job, source, eval_source)
      ahead = compile_ahead(job, source, step_fn, init.trace().out_info)
      # On an error before the first step, too: no compile outlives `train`.
      resources.callback(ahead.join)
    state, resumed = restore(job, manager, init)
    if ahead is None:
      job, state = settle_precision(job, state, source, resumed)
      step_fn, eval_run = compile_steps(job, source, eval_source)
    reporter = resources.enter_context(_open_reporter(workdir, job, state))
    reporter.log_grad_reduce(job.precision.grad_reduce)
    train = {"loss": float("nan"), "accuracy": float("nan")}
    test = None
    step = int(state.step)
    if ahead is not None:
      ahead.join()  # Compiled: the first step finds it in jax's caches.
    while step < job.total_steps:
      state, train = train_epoch(
        job,
        state,
        step_fn,
        source,
        reporter=reporter,
        manager=manager,
        clock=clock,
        preemption=preemption,
      )
      step = train["step"]
      test = evaluate(eval_run, state)
      _log_epoch(reporter, job, state, train, test)
    if test is None:  # Nothing left to train (resumed at the end).
      test = evaluate(eval_run, state)
    return finish(
      job,
      state,
      train=train,
      test=test,
      manager=manager,
      reporter=reporter,
      clock=clock,
      config_record=config_record,
    )


def _open_reporter(workdir: str, job: Job, state) -> reporting.Reporter:
  """The run's reporter, its loss scale from the (restored) state."""
  return reporting.Reporter(
    workdir,
    num_devices=job.num_devices,
    total_steps=job.total_steps,
    progress_bar=job.settings.progress_bar,
    initial_loss_scale=float(
      mesh_lib.to_host(jaxmp.stats(state.opt_state)["loss_scale"])
    ),
  )


def _log_epoch(reporter, job: Job, state, train: dict, test: dict) -> None:
  """One epoch's line: its train and test metrics, scale, throughput."""
  stats = mesh_lib.to_host(jaxmp.stats(state.opt_state))
  reporter.log_epoch(
    epoch=train["epoch"],
    step=train["step"],
    train=train,
    test=test,
    loss_scale=float(stats["loss_scale"]),
    skipped_steps=int(stats["skipped_steps"]),
    images_per_sec=train["steps"]
    * job.settings.batch_size
    / max(train["seconds"], 1e-9),
  )
