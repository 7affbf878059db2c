"""The app's O1 end to end: the fp32 ResNet under autocast, its debug report.

Two short runs of the tiny job, on the one-block net (`one_block_models`),
through `cli.run` with ``policy="O1"``: one
that trains, and one whose normalised images are so large that the first
convolution overflows fp16, where ``diagnostics=True`` names that op.
"""

import json
import logging
import math
import os

from _helpers import one_block_models
from cifar_train import cli


def test_o1_trains_the_tiny_job(
  make_config, data_dir, tiny_data, tmp_path, monkeypatch
):
  one_block_models(monkeypatch)
  workdir = str(tmp_path / "o1")
  config = make_config(data_dir, policy="O1", num_train_steps=3)
  assert cli.run(config, workdir, data=tiny_data) == 0
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["steps"] == 3 and summary["config"]["policy"] == "O1"
  assert math.isfinite(summary["train_loss"])
  with open(os.path.join(workdir, "steps.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [1, 2, 3]


def test_o1_diagnostics_name_the_forward_overflow(
  make_config, data_dir, tiny_data, tmp_path, caplog, monkeypatch
):
  one_block_models(monkeypatch)
  # std 1e-5: inputs up to 5e4; a 3x3x3 convolution of them sums 27 terms
  # of ~3e4 * |w| (|w| ~ 0.2) and overflows fp16 (65504), fp32 does not.
  config = make_config(
    data_dir,
    policy="O1",
    diagnostics=True,
    num_train_steps=1,
    std=(1e-5, 1e-5, 1e-5),
  )
  with caplog.at_level(logging.WARNING, logger="jaxmp"):
    cli.run(config, str(tmp_path / "overflow"), data=tiny_data)
  reports = [r.getMessage() for r in caplog.records if r.name == "jaxmp"]
  assert reports, caplog.text
  assert "first non-finite float16 output" in reports[0]
  assert "conv_general_dilated" in reports[0], reports[0]
  # The first convolution, by its Flax name stack, and a source line.
  assert "in ResNet/conv1 at " in reports[0], reports[0]
  assert ".py:" in reports[0], reports[0]
