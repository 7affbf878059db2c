"""Tests for cifar_train.reporting: log-step records, skip lines, plots."""

import json

import numpy as np
import PIL.Image
import pytest

from cifar_train import reporting

# The reporter's own tests: `Reporter.plot` draws (tests/conftest.py).
pytestmark = pytest.mark.plots


def _stats(loss, scale, skipped, accuracy=0.5):
  return {
    "loss": loss,
    "accuracy": accuracy,
    "loss_scale": scale,
    "skipped_steps": skipped,
  }


def _reporter(workdir, **kwargs):
  return reporting.Reporter(
    str(workdir), num_devices=1, total_steps=10, progress_bar=False, **kwargs
  )


def test_skips_since_the_last_log_step_are_one_line(tmp_path, capsys):
  writer = _reporter(tmp_path)
  writer.log_step(2, _stats(2.0, 2.0**15, 0))
  writer.log_step(4, _stats(1.9, 2.0**13, 2), ("['conv1']['kernel']", 7))
  writer.log_step(6, _stats(1.8, 2.0**13, 2))
  assert capsys.readouterr().out.splitlines() == [
    "Step 4: skipped 2 of steps 3-4, loss scale 32768 -> 8192; "
    "worst leaf ['conv1']['kernel']: 7 non-finite"
  ]
  with open(tmp_path / "steps.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["skipped_since_last_log"] for r in records] == [0, 2, 0]
  assert records[1]["worst_leaf"] == "['conv1']['kernel']"
  assert records[1]["worst_leaf_nonfinite"] == 7
  assert "worst_leaf" not in records[2]


def test_a_resumed_run_counts_skips_from_the_last_logged_step(tmp_path, capsys):
  _reporter(tmp_path).log_step(2, _stats(2.0, 8.0, 1))
  capsys.readouterr()
  resumed = _reporter(tmp_path)
  resumed.log_step(4, _stats(2.0, 4.0, 2))
  assert capsys.readouterr().out.splitlines() == [
    "Step 4: skipped 1 of steps 3-4, loss scale 8 -> 4"
  ]


def test_first_skip_line_starts_from_the_initial_scale_and_counts_nan_losses(
  tmp_path, capsys
):
  writer = _reporter(tmp_path, initial_loss_scale=2.0**15)
  stats = dict(_stats(float("nan"), 2.0**15, 3), nonfinite_loss_steps=2)
  writer.log_step(4, stats)
  writer.log_step(6, dict(stats, skipped_steps=4, nonfinite_loss_steps=3))
  assert capsys.readouterr().out.splitlines() == [
    "Step 4: skipped 3 of steps 1-4, loss scale 32768 -> 32768; "
    "2 of them with a NaN/inf loss",
    "Step 6: skipped 1 of steps 5-6, loss scale 32768 -> 32768; "
    "1 of them with a NaN/inf loss",
  ]
  with open(tmp_path / "steps.jsonl") as f:
    assert [json.loads(l)["nonfinite_loss_steps"] for l in f] == [2, 3]


def test_spike_skips_since_the_last_log_step_are_one_line(tmp_path, capsys):
  writer = _reporter(tmp_path)
  writer.log_step(2, dict(_stats(2.0, 8.0, 0), spike_skips=0))
  writer.log_step(8, dict(_stats(2.0, 8.0, 0), spike_skips=3))
  writer.log_step(10, dict(_stats(2.0, 8.0, 0), spike_skips=3))
  assert capsys.readouterr().out.splitlines() == [
    "Step 8: dropped 3 of steps 3-8 as loss or gradient-norm spikes"
  ]
  with open(tmp_path / "steps.jsonl") as f:
    records = [json.loads(line) for line in f]
  # Off (or none yet): the record is as without spike skipping.
  assert [r.get("spike_skips") for r in records] == [None, 3, 3]


def test_plot_has_a_train_point_per_log_step_and_marks_skips(tmp_path):
  writer = _reporter(tmp_path)
  for step in range(1, 9):
    writer.log_step(step, _stats(3.0 - 0.1 * step, 1.0, int(step >= 5)))
  writer.log_epoch(
    epoch=1,
    step=8,
    train={"loss": 2.5, "accuracy": 0.4},
    test={"loss": 2.4, "accuracy": 0.45},
    loss_scale=1.0,
    skipped_steps=1,
    images_per_sec=1.0,
  )
  series = writer.plot_series()
  assert series["train_loss"][0] == list(range(1, 9))
  assert series["test_loss"] == ([8], [2.4])
  assert series["skipped"][0] == [5]
  writer.plot()
  with PIL.Image.open(tmp_path / "plots.png") as image:
    assert image.size == (1170, 324)  # 13 x 3.6 inches at 90 dpi.
    pixels = np.asarray(image.convert("RGB")).reshape(-1, 3).astype(int)
  # The skipped step's marker is pure red ("rx"); nothing else is.
  red = (pixels[:, 0] > 200) & (pixels[:, 1] < 60) & (pixels[:, 2] < 60)
  assert red.sum() > 10
