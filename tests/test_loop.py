"""End-to-end: `loop.train_and_evaluate` on the tiny job (CPU, 4 devices)."""

import glob
import json
import os

import pytest

from _helpers import read_jsonl
from test_data_sources import no_probe
from test_data_sources import place_archive

from cifar_train import data_sources
from cifar_train import loop
from cifar_train.errors import ConfigError
from configs import default


def test_train_and_evaluate_synthetic_writes_everything(
  make_config, data_dir, tmp_path
):
  workdir = str(tmp_path / "run")
  summary = loop.train_and_evaluate(make_config(data_dir), workdir)
  assert summary["steps"] == 6 and summary["num_devices"] == 4
  assert len(summary["params_fingerprint"]) == 64
  assert len(summary["state_fingerprint"]) == 64
  for key in (
    "test_loss",
    "test_accuracy",
    "train_loss",
    "train_accuracy",
    "wall_seconds",
    "num_processes",
    "config",
  ):
    assert key in summary
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f)["state_fingerprint"] == summary["state_fingerprint"]
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
  assert 0 <= record["test_accuracy"] <= 1 and record["step"] == 6
  assert os.path.getsize(os.path.join(workdir, "plots.png")) > 1000
  assert glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*"))
  assert (
    sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    == ["2", "4", "6"][-default.get_config().keep_checkpoints :]
  )
  assert [
    r["step"] for r in read_jsonl(os.path.join(workdir, "steps.jsonl"))
  ] == [1, 2, 3, 4, 5, 6]


@pytest.mark.invariant
@pytest.mark.parametrize(
  "on_device,policy",
  [
    (False, "O2"),
    (True, "O2"),
    (False, "bf16-kahan"),
    (False, "bf16-stochastic"),
  ],
)
def test_resume_is_exact_for_the_whole_state(
  on_device, policy, make_config, data_dir, tiny_data, tmp_path
):
  """6 steps in one go == 4 steps, stop, resume to 6: every bit of the state.

  The state fingerprint covers step, params, BatchNorm statistics, the whole
  optimizer state (masters or Kahan compensation or rounding key, momentum,
  loss scale, counters) and the data key.
  """
  config = lambda **kw: make_config(
    data_dir, data_on_device=on_device, policy=policy, **kw
  )
  full = str(tmp_path / "full")
  ref = loop.train_and_evaluate(config(), full, data=tiny_data)
  split = str(tmp_path / "split")
  loop.train_and_evaluate(config(num_train_steps=4), split, data=tiny_data)
  resumed = loop.train_and_evaluate(config(), split, data=tiny_data)
  assert resumed["steps"] == 6
  assert resumed["state_fingerprint"] == ref["state_fingerprint"]
  assert resumed["params_fingerprint"] == ref["params_fingerprint"]
  losses = lambda d: [
    (r["step"], r["loss"], r["loss_scale"])
    for r in read_jsonl(os.path.join(d, "steps.jsonl"))
  ]
  assert losses(split) == losses(full)


def test_same_seed_same_state(make_config, data_dir, tiny_data, tmp_path):
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
  make_config, data_dir, tiny_data, tmp_path
):
  one = loop.train_and_evaluate(
    make_config(data_dir, num_devices=1, policy="O0", num_train_steps=3),
    str(tmp_path / "1"),
    data=tiny_data,
  )
  four = loop.train_and_evaluate(
    make_config(data_dir, num_devices=4, policy="O0", num_train_steps=3),
    str(tmp_path / "4"),
    data=tiny_data,
  )
  assert (one["num_devices"], four["num_devices"]) == (1, 4)
  # The same batches; only the order of the cross-device sums differs.
  a = read_jsonl(os.path.join(tmp_path, "1", "steps.jsonl"))
  b = read_jsonl(os.path.join(tmp_path, "4", "steps.jsonl"))
  # Over 3 steps: on this tiny net the reduction-order differences grow
  # about tenfold per step (measured on an AMD EPYC: 0, 9e-8, 3e-7, 5e-6,
  # 3e-4, 3e-3 over steps 1-6), so later steps say nothing about parallelism.
  assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
  for ra, rb in zip(a, b):
    assert rb["loss"] == pytest.approx(ra["loss"], rel=2e-5), (ra, rb)
  assert four["test_loss"] == pytest.approx(one["test_loss"], rel=1e-4)


def test_cifar10_from_an_archive_in_the_manual_dir(
  make_config, tmp_path, monkeypatch
):
  # A tiny archive in the official binary format, placed offline: the run
  # prepares it (ArrayRecord) without probing the network, and trains on it.
  monkeypatch.setattr(data_sources, "network_available", no_probe)
  tfds_dir = str(tmp_path / "tfds")
  place_archive(tfds_dir, "cifar10", n_train=96, n_test=40)
  config = make_config(
    tfds_dir, dataset="cifar10", num_train_steps=2, checkpoint_every_steps=0
  )
  summary = loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert summary["steps"] == 2
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
