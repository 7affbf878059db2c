"""Preemption: SIGTERM (or SIGINT) saves at the step and the rerun resumes.

The signal arrives from a thread once ``steps.jsonl`` logs 2 steps, so the
step it lands at (2 to 5 of 6) is whatever the loop has reached. The run must
stop there with a checkpoint of that step (not the last periodic one: these
runs save only at the end), say so, exit 0, and the same command must resume
and end with the whole-state fingerprint of an uninterrupted run.
"""

import os
import re
import signal
import threading
import time

import pytest

from _helpers import one_block_models, run_distributed

from cifar_train import cli
from cifar_train import loop

# Six steps of one epoch (8 steps of 32 in 256 examples); no periodic save.
CONFIG = {"num_train_steps": 6, "checkpoint_every_steps": 0}


def _signal_after_steps(steps_path: str, count: int, signum: int):
  """Sends ``signum`` to this process once ``steps_path`` logs ``count``."""

  def watch():
    while True:
      if os.path.exists(steps_path):
        with open(steps_path) as f:
          if len(f.read().splitlines()) >= count:
            os.kill(os.getpid(), signum)
            return
      time.sleep(0.01)

  thread = threading.Thread(target=watch, daemon=True)
  thread.start()
  return thread


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_one_process_saves_at_the_step_and_resumes_exactly(
  signum, make_config, data_dir, tiny_data, tmp_path, monkeypatch, capsys
):
  del tiny_data  # Prepared.
  one_block_models(monkeypatch)
  whole = loop.train_and_evaluate(
    make_config(data_dir, **CONFIG), str(tmp_path / "whole")
  )
  workdir = str(tmp_path / "cut")
  capsys.readouterr()
  before = signal.getsignal(signum)
  thread = _signal_after_steps(os.path.join(workdir, "steps.jsonl"), 2, signum)
  assert cli.run(make_config(data_dir, **CONFIG), workdir) == 0
  thread.join(timeout=10)
  assert signal.getsignal(signum) is before  # The handlers are put back.
  out = capsys.readouterr().out
  (step,) = re.findall(
    r"^preempted at step (\d+): checkpoint saved$", out, re.M
  )
  step = int(step)
  assert 2 <= step < 6, out
  assert os.listdir(os.path.join(workdir, "checkpoints")) == [str(step)]
  assert not os.path.exists(os.path.join(workdir, "summary.json"))

  assert cli.run(make_config(data_dir, **CONFIG), workdir) == 0
  out = capsys.readouterr().out
  resumed = os.path.join(workdir, "checkpoints", str(step))
  assert f"Resuming from {resumed} at step {step}" in out
  import json  # pylint: disable=g-import-not-at-top

  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["steps"] == 6
  assert summary["state_fingerprint"] == whole["state_fingerprint"]


def test_two_processes_stop_at_the_same_step_and_resume_exactly(
  data_dir, tiny_data, tmp_path
):
  """SIGTERM to process 1 only (after step 3); both save at one step.

  One launch runs the uninterrupted reference, then the interrupted run (the
  preemption notice outlives a job, so the rerun is a second launch).
  """
  del tiny_data
  whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
  spec = {
    "data_dir": data_dir,
    "one_block": True,
    "config": CONFIG,
    "sigterm": {"process": 1, "job": 1, "step": 3},
  }
  outputs = run_distributed(
    dict(spec, jobs=[{"workdir": whole}, {"workdir": cut}]),
    str(tmp_path / "spec1.json"),
    num_processes=2,
    local_devices=2,
    timeout=240,
  )
  stops = [
    re.findall(r"^process \d job 1 preempted at step (\d+)$", out, re.M)
    for out in outputs
  ]
  assert len(stops[0]) == 1 and stops[0] == stops[1], outputs
  step = int(stops[0][0])
  assert 2 <= step < 6
  assert re.search(
    rf"^preempted at step {step}: checkpoint saved$", outputs[0], re.M
  )
  assert os.listdir(os.path.join(cut, "checkpoints")) == [str(step)]
  (ref,) = set(
    re.findall(
      r"^process \d job 0 fingerprint \w+ state (\w+)$",
      "\n".join(outputs),
      re.M,
    )
  )

  outputs = run_distributed(
    dict(spec, sigterm=None, jobs=[{"workdir": cut}]),
    str(tmp_path / "spec2.json"),
    num_processes=2,
    local_devices=2,
    timeout=240,
  )
  for out in outputs:
    assert f"Resuming from {os.path.join(cut, 'checkpoints', str(step))}" in out
  states = set(
    re.findall(
      r"^process \d job 0 fingerprint \w+ state (\w+)$",
      "\n".join(outputs),
      re.M,
    )
  )
  assert states == {ref}
