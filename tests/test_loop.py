"""End-to-end: `loop.train_and_evaluate` on the tiny job (CPU, 4 devices).

On the one-block net of `one_block_models` (a fraction of ResNet18's
compile time): the point of these tests is the loop, not the architecture.
The app's whole ResNet18 trains through the loop in
tests/test_fidelity_bench.py (its start file needs every layer) and in
tests/test_torchvision.py's ``init_from`` runs.
"""

import errno
import functools
import glob
import json
import os
import re
import shutil
import threading

import jax
import numpy as np
import PIL.Image
import pytest

from _helpers import no_probe
from _helpers import one_block_models
from _helpers import place_archive
from _helpers import read_jsonl

from cifar_train import checkpoint
from cifar_train import data_sources
from cifar_train import loop
from cifar_train import reporting
from cifar_train import settings
from cifar_train import steps
from cifar_train.errors import ConfigError
from configs import default


@pytest.mark.plots
def test_train_and_evaluate_synthetic_writes_everything(
  make_config, data_dir, tmp_path, monkeypatch
):
  one_block_models(monkeypatch)
  workdir = str(tmp_path / "run")
  summary = loop.train_and_evaluate(make_config(data_dir), workdir)
  assert summary["steps"] == 6 and summary["num_devices"] == 4
  assert summary["num_processes"] == 1 and summary["test_count"] == 100
  assert summary["config"] == make_config(data_dir).to_dict()
  for key in ("params_fingerprint", "state_fingerprint"):
    assert re.fullmatch("[0-9a-f]{64}", summary[key]), key
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f) == json.loads(json.dumps(summary))
  (record,) = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert set(record) == {
    "epoch",
    "step",
    "train_loss",
    "train_accuracy",
    "test_loss",
    "test_accuracy",
    "loss_scale",
    "skipped_steps",
    "images_per_sec",
  }
  assert (record["epoch"], record["step"]) == (1, 6)
  # The epoch's record is the summary's: the same evaluation, not another.
  for key in ("test_loss", "test_accuracy", "train_loss", "train_accuracy"):
    assert record[key] == summary[key], key
  # Accuracies are counts: of the 100 test and the 6 * 32 training examples.
  assert record["test_accuracy"] * 100 == pytest.approx(
    round(record["test_accuracy"] * 100), abs=1e-9
  )
  assert record["train_accuracy"] * 192 == pytest.approx(
    round(record["train_accuracy"] * 192), abs=1e-9
  )
  step_records = read_jsonl(os.path.join(workdir, "steps.jsonl"))
  assert [r["step"] for r in step_records] == [1, 2, 3, 4, 5, 6]
  # The epoch's train loss is the mean of its steps' losses: fp32 sums of 6
  # terms on the device, within 6 u = 3.6e-7 of the float64 mean here.
  mean = sum(r["loss"] for r in step_records) / 6
  assert record["train_loss"] == pytest.approx(mean, rel=1e-6)
  assert record["loss_scale"] == step_records[-1]["loss_scale"]
  with PIL.Image.open(os.path.join(workdir, "plots.png")) as image:
    # reporting.plot: 13 x 3.6 inches at 90 dpi; three panels drawn on it.
    assert image.size == (1170, 324)
    assert len(image.getcolors(maxcolors=1 << 16) or range(1 << 16)) > 50
  (events,) = glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*"))
  tags = _tensorboard_tags(events)
  assert {"train_loss", "test_accuracy", "loss_scale"} <= tags, tags
  assert (
    sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    == ["2", "4", "6"][-default.get_config().keep_checkpoints :]
  )


def _tensorboard_tags(path: str) -> set[str]:
  """The scalar tags of a TensorBoard event file (tensorboardX's reader)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  import struct  # pylint: disable=g-import-not-at-top

  tags = set()
  with open(path, "rb") as f:
    data = f.read()
  offset = 0
  while offset < len(data):
    (length,) = struct.unpack("<Q", data[offset : offset + 8])
    event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
    offset += 12 + length + 4
    tags |= {v.tag for v in event.summary.value}
  return tags


class _Closed(list):
  """Records each resource closed, by name."""

  def wrap(self, monkeypatch, cls, name, label):
    original = getattr(cls, name)

    def closing(obj, *args, **kwargs):
      self.append(label)
      return original(obj, *args, **kwargs)

    monkeypatch.setattr(cls, name, closing)


def test_an_error_mid_epoch_closes_every_resource(
  make_config, data_dir, tiny_data, tmp_path, monkeypatch
):
  one_block_models(monkeypatch)
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import tensorboardX  # pylint: disable=g-import-not-at-top
  import tqdm  # pylint: disable=g-import-not-at-top

  closed = _Closed()
  closed.wrap(monkeypatch, ocp.CheckpointManager, "close", "checkpoints")
  closed.wrap(monkeypatch, tqdm.tqdm, "close", "progress bar")
  closed.wrap(monkeypatch, tensorboardX.SummaryWriter, "close", "tensorboard")
  compile_steps = loop.compile_steps

  def failing_at_step_3(*args):
    step_fn, eval_run = compile_steps(*args)
    calls = []

    def step(*a):
      calls.append(1)
      if len(calls) == 3:
        raise RuntimeError("injected at step 3")
      return step_fn(*a)

    return step, eval_run

  monkeypatch.setattr(loop, "compile_steps", failing_at_step_3)
  workdir = tmp_path / "run"
  with pytest.raises(RuntimeError, match="injected at step 3"):
    loop.train_and_evaluate(
      make_config(data_dir, progress_bar=True), str(workdir), data=tiny_data
    )
  assert sorted(set(closed)) == ["checkpoints", "progress bar", "tensorboard"]
  # Closing the manager finished the save of step 2 before the error left.
  assert os.listdir(workdir / "checkpoints") == ["2"]
  assert "commit_success.txt" in os.listdir(workdir / "checkpoints" / "2")
  # The steps before the error were logged.
  assert [r["step"] for r in read_jsonl(workdir / "steps.jsonl")] == [1, 2]


def test_an_error_while_restoring_closes_the_manager(
  make_config, data_dir, tiny_data, tmp_path, monkeypatch
):
  one_block_models(monkeypatch)
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  closed = _Closed()
  closed.wrap(monkeypatch, ocp.CheckpointManager, "close", "checkpoints")

  def fail(*args):
    raise OSError(errno.EIO, "injected")

  monkeypatch.setattr(checkpoint, "restore_latest", fail)
  with pytest.raises(OSError, match="injected"):
    loop.train_and_evaluate(
      make_config(data_dir), str(tmp_path / "run"), data=tiny_data
    )
  assert closed == ["checkpoints"]
  # The train step's compile (`loop.compile_ahead`) was joined, not left
  # running after the error.
  assert "compile-ahead" not in [t.name for t in threading.enumerate()]


def test_the_named_steps_run_alone(
  make_config, data_dir, tiny_data, tmp_path, monkeypatch
):
  one_block_models(monkeypatch)
  s = settings.resolve(make_config(data_dir, num_train_steps=3))
  job = loop.set_up(s, tiny_data)
  assert (job.steps_per_epoch, job.total_steps, job.num_devices) == (8, 3, 4)
  with checkpoint.open_manager(str(tmp_path), keep=2) as manager:
    state, resumed = loop.restore(job, manager)
    assert resumed is None and int(state.step) == 0
    assert state.step.sharding == job.replicated
    source = loop.make_batch_source(job)
    job, state = loop.settle_precision(job, state, source, resumed)
    step_fn, eval_run = loop.compile_steps(job, source)
    with reporting.Reporter(
      str(tmp_path), num_devices=4, total_steps=3, progress_bar=False
    ) as reporter:
      state, train = loop.train_epoch(
        job,
        state,
        step_fn,
        source,
        reporter=reporter,
        manager=manager,
        clock=loop.Clock(),
      )
    test = loop.evaluate(eval_run, state)
  assert (train["epoch"], train["step"], train["steps"]) == (1, 3, 3)
  assert int(state.step) == 3 and test["count"] == 100
  # Saved at step 2 (every 2) and at the run's end, 3.
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3"]


@pytest.mark.parametrize("data_on_device", [False, True])
def test_compile_ahead_leaves_the_first_step_nothing_to_trace(
  make_config, data_dir, tiny_data, tmp_path, monkeypatch, data_on_device
):
  one_block_models(monkeypatch)
  traces = []

  def counting(make_train_step):
    def make(*args, **kwargs):
      train_step = make_train_step(*args, **kwargs)

      def step(*a):
        traces.append(1)  # Runs once per trace.
        return train_step(*a)

      return step

    return make

  monkeypatch.setattr(steps, "make_train_step", counting(steps.make_train_step))
  s = settings.resolve(
    make_config(data_dir, num_train_steps=1, data_on_device=data_on_device)
  )
  job = loop.set_up(s, tiny_data)
  source = loop.make_batch_source(job)
  init = loop.make_init(job)
  step_fn, _ = loop.compile_steps(job, source)
  loop.compile_ahead(job, source, step_fn, init.trace().out_info).join()
  assert len(traces) == 1
  with checkpoint.open_manager(str(tmp_path), keep=2) as manager:
    state, _ = loop.restore(job, manager, init)
  metrics = jax.device_put(steps.zero_metrics(state.opt_state), job.replicated)
  (args,) = source.epoch(state, 0, 0, 1)
  state, metrics = step_fn(state, *args, metrics)
  assert int(state.step) == 1 and int(metrics["count"]) == s.batch_size
  assert len(traces) == 1  # The step ran what compile_ahead compiled.


@pytest.mark.invariant
@pytest.mark.parametrize(
  "on_device,policy,overrides",
  [
    # (False, "O2"): with init_loss_scale='auto', the test below.
    pytest.param(True, "O2", {}, id="True-O2"),
    pytest.param(False, "bf16-kahan", {}, id="False-bf16-kahan"),
    pytest.param(False, "bf16-stochastic", {}, id="False-bf16-stochastic"),
    # Exact masters in 2 bytes, int8 momentum: the 4-filter net's convolutions
    # (108 and 144 elements) are encoded under the lowered min_size.
    pytest.param(
      False,
      "bf16-kahan",
      {
        "master_weights": "remainder",
        "optimizer_state": "int8",
        "optimizer_state_min_size": 64,
      },
      id="False-remainder-int8",
    ),
  ],
)
def test_resume_is_exact_for_the_whole_state(
  on_device,
  policy,
  overrides,
  make_config,
  data_dir,
  tiny_data,
  tmp_path,
  monkeypatch,
):
  """6 steps in one go == stopped after 4, resumed to 6: every bit of the state.

  The run that stops is a copy of the uninterrupted one's workdir as it was
  after step 4 (its checkpoint 4 and the records up to it): one run less
  per case than training the first 4 steps again, and the same files a run
  killed after step 4 leaves. The state fingerprint covers step, params,
  BatchNorm statistics, the whole optimizer state (masters or Kahan
  compensation, remainder or rounding key, momentum or its int8 codes and
  scales, loss scale, counters) and the data key.
  """
  one_block_models(monkeypatch)
  config = make_config(
    data_dir,
    data_on_device=on_device,
    policy=policy,
    keep_checkpoints=3,
    **overrides,
  )
  full = tmp_path / "full"
  ref = loop.train_and_evaluate(config, str(full), data=tiny_data)
  split = tmp_path / "split"
  shutil.copytree(full / "checkpoints" / "4", split / "checkpoints" / "4")
  with open(split / "steps.jsonl", "w") as f:
    for record in read_jsonl(full / "steps.jsonl"):
      if record["step"] <= 4:
        f.write(json.dumps(record) + "\n")
  resumed = loop.train_and_evaluate(config, str(split), data=tiny_data)
  assert resumed["steps"] == 6
  assert resumed["state_fingerprint"] == ref["state_fingerprint"]
  assert resumed["params_fingerprint"] == ref["params_fingerprint"]
  losses = lambda d: [
    (r["step"], r["loss"], r["loss_scale"])
    for r in read_jsonl(os.path.join(d, "steps.jsonl"))
  ]
  assert losses(split) == losses(full)
  assert sorted(os.listdir(split / "checkpoints")) == ["4", "6"]


@pytest.mark.invariant
def test_resume_with_auto_loss_scale_keeps_the_whole_state(
  make_config, data_dir, tiny_data, tmp_path, monkeypatch, capsys
):
  """The whole-state resume, O2 on host data with ``init_loss_scale='auto'``.

  The first run calibrates its scale on its first batch; the resumed one
  keeps its checkpoint's scale, masters and momentum (calibrating again would
  start a fresh optimizer state: another fingerprint). It stands for the
  (False, "O2") case above: the same resume, the scale calibrated.
  """
  auto = functools.partial(make_config, init_loss_scale="auto")
  test_resume_is_exact_for_the_whole_state(
    False, "O2", {}, auto, data_dir, tiny_data, tmp_path, monkeypatch
  )
  out = capsys.readouterr().out
  assert out.count("init_loss_scale 'auto': ") == 2
  assert "resumed, keeping the checkpoint's loss scale" in out


def test_same_seed_same_state(
  make_config, data_dir, tiny_data, tmp_path, monkeypatch
):
  one_block_models(monkeypatch)
  a = loop.train_and_evaluate(
    make_config(data_dir, num_train_steps=2),
    str(tmp_path / "a"),
    data=tiny_data,
  )
  b = loop.train_and_evaluate(
    make_config(data_dir, num_train_steps=2),
    str(tmp_path / "b"),
    data=tiny_data,
  )
  c = loop.train_and_evaluate(
    make_config(data_dir, num_train_steps=2, seed=1),
    str(tmp_path / "c"),
    data=tiny_data,
  )
  assert a["state_fingerprint"] == b["state_fingerprint"]
  assert a["state_fingerprint"] != c["state_fingerprint"]


def test_one_device_and_four_devices_agree(
  make_config, data_dir, tiny_data, tmp_path, monkeypatch
):
  one_block_models(monkeypatch)
  config = lambda n: make_config(
    data_dir, num_devices=n, policy="O0", num_train_steps=1
  )
  one = loop.train_and_evaluate(config(1), str(tmp_path / "1"), data=tiny_data)
  four = loop.train_and_evaluate(config(4), str(tmp_path / "4"), data=tiny_data)
  assert (one["num_devices"], four["num_devices"]) == (1, 4)
  assert one["test_count"] == four["test_count"] == 100
  (a,) = read_jsonl(os.path.join(tmp_path, "1", "steps.jsonl"))
  (b,) = read_jsonl(os.path.join(tmp_path, "4", "steps.jsonl"))
  # The same batch and initial state: only the order of the sums differs,
  # the batch being split over 4 devices. The loss of step 1 comes before
  # any update; the test loss after one update whose gradient carries the
  # same kind of error. Reordering a float32 sum of n terms moves it by about
  # sqrt(n) u (u = 2**-24) relative to the sum of their magnitudes, at most
  # (n - 1) u; this net's sums run over at most n = 32 * 32 * 32 (BatchNorm
  # statistics), through its 3 BatchNorm layers and the mean loss (ResNet18's
  # 20 would give 20 * sqrt(32768) * 2**-24 = 2.2e-4 relative): 1e-3 leaves
  # a margin of 4 even for ResNet18; a wrong batch (other examples, a shifted
  # label) or per-device BatchNorm statistics move the loss by more than 1e-2.
  rel = 1e-3
  assert b["loss"] == pytest.approx(a["loss"], rel=rel), (a, b)
  assert four["test_loss"] == pytest.approx(one["test_loss"], rel=rel)


def test_one_device_and_four_devices_end_in_the_same_state_in_fp32(
  make_config, data_dir, tiny_data, tmp_path, monkeypatch
):
  """3 steps of O0 on 1 device and on 4: the final params and statistics.

  The same data order, global batch and init; only the order of the sums
  differs (each device sums its quarter of the batch, then the all-reduce).
  Reordering a float32 sum of n terms moves it by about sqrt(n) u (u =
  2**-24) of the sum of their magnitudes; here n <= 32 * 32 * 32 (BatchNorm
  statistics and conv kernel gradients over the batch's pixels), through 3
  BatchNorm layers, in each of 3 steps, and step t's error feeds step t+1:
  3 * 3 * sqrt(32768) * u = 9.7e-5 of each leaf's change over the run (of
  its own magnitude for the running statistics). Measured (AMD EPYC, AVX2):
  at most 1.1e-6 of the change (conv1's kernel). A gradient 0.1% off on 4 devices, a missing
  all-reduce or per-device statistics move it by 1e-3 or more.
  """
  one_block_models(monkeypatch)
  states = {}
  restore, finish = loop.restore, loop.finish

  def spy_restore(job, *args, **kwargs):
    state, resumed = restore(job, *args, **kwargs)
    states[job.num_devices, "init"] = jax.device_get(state)
    return state, resumed

  def spy_finish(job, state, **kwargs):
    states[job.num_devices, "final"] = jax.device_get(state)
    return finish(job, state, **kwargs)

  monkeypatch.setattr(loop, "restore", spy_restore)
  monkeypatch.setattr(loop, "finish", spy_finish)
  for n in (1, 4):
    config = make_config(
      data_dir,
      num_devices=n,
      policy="O0",
      num_train_steps=3,
      checkpoint_every_steps=0,
    )
    loop.train_and_evaluate(config, str(tmp_path / str(n)), data=tiny_data)
  tol = 3 * 3 * np.sqrt(32 * 32 * 32) * 2.0**-24
  init = states[1, "init"]
  for part in ("params", "batch_stats"):
    paths = jax.tree_util.tree_flatten_with_path(getattr(init, part))[0]
    leaves = [
      jax.tree.leaves(getattr(states[k], part))
      for k in ((4, "init"), (1, "final"), (4, "final"))
    ]
    for (path, p0), q0, p1, p4 in zip(paths, *leaves):
      name = jax.tree_util.keystr(path)
      np.testing.assert_array_equal(p0, q0, err_msg=name)  # Same init.
      p0, p1, p4 = (np.asarray(v, np.float64) for v in (p0, p1, p4))
      scale = np.max(np.abs(p1 if part == "batch_stats" else p1 - p0))
      err = np.max(np.abs(p1 - p4))
      assert err <= tol * scale, (name, err, scale)


def test_cifar10_from_an_archive_in_the_manual_dir(
  make_config, tmp_path, monkeypatch
):
  one_block_models(monkeypatch)
  # A tiny archive in the official binary format, placed offline: the run
  # prepares it (ArrayRecord) without probing the network, and trains on it.
  monkeypatch.setattr(data_sources, "network_available", no_probe)
  tfds_dir = str(tmp_path / "tfds")
  place_archive(tfds_dir, "cifar10", n_train=96, n_test=40)
  config = make_config(
    tfds_dir, dataset="cifar10", num_train_steps=2, checkpoint_every_steps=0
  )
  summary = loop.train_and_evaluate(config, str(tmp_path / "run"))
  # Two steps on the train split; every one of the 40 test examples once.
  assert summary["steps"] == 2 and summary["test_count"] == 40
  prepared = os.path.join(tfds_dir, "cifar10", "3.0.2")
  assert glob.glob(os.path.join(prepared, "cifar10-train.array_record-*"))


@pytest.mark.parametrize(
  "override,match",
  [
    ({"batch_size": 30}, "batch_size 30 is not divisible by the 4 devices"),
    ({"batch_size": 512}, "batch_size 512 is larger than the 256 training"),
    ({"num_devices": 8}, "num_devices=8 but only 4 devices"),
  ],
)
def test_bad_values_found_at_run_time_fail_before_training(
  override, match, make_config, data_dir, tiny_data, tmp_path
):
  workdir = tmp_path / "run"
  with pytest.raises(ConfigError, match=match):
    loop.train_and_evaluate(
      make_config(data_dir, **override), str(workdir), data=tiny_data
    )
  assert not (workdir / "checkpoints").exists()
