"""Preemption: SIGTERM (or SIGINT) saves at the step and the rerun resumes.

The signal is sent to the process after step 3 of 6 (pinned by a hook on
`Preemption.reached`; the signal and its handler are real). The run must
stop there with a checkpoint of that step (not the last periodic one: these
runs save only at the end), say so, exit 0, and the same command must resume
and end with the whole-state fingerprint of an uninterrupted run.
"""

import os
import re
import signal

import pytest

from _helpers import one_block_models, run_distributed

from cifar_train import cli
from cifar_train import loop
from cifar_train import preemption

# Six steps of one epoch (8 steps of 32 in 256 examples); no periodic save.
CONFIG = {"num_train_steps": 6, "checkpoint_every_steps": 0}


def _signal_at_step(monkeypatch, step: int, signum: int) -> None:
  """Sends ``signum`` to this process when the loop asks after ``step``.

  The real signal, through the real handler; only its timing is pinned (a
  thread watching the log is outrun by a warm compile cache).
  """
  reached = preemption.Preemption.reached

  def patched(self, at: int) -> bool:
    if at == step:
      os.kill(os.getpid(), signum)
    return reached(self, at)

  monkeypatch.setattr(preemption.Preemption, "reached", patched)


@pytest.fixture(scope="module")
def whole(make_config, data_dir, tiny_data, tmp_path_factory):
  """The uninterrupted run's summary, once for both signals."""
  del tiny_data  # Prepared.
  with pytest.MonkeyPatch.context() as patch:
    one_block_models(patch)
    return loop.train_and_evaluate(
      make_config(data_dir, **CONFIG), str(tmp_path_factory.mktemp("whole"))
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_one_process_saves_at_the_step_and_resumes_exactly(
  signum, whole, make_config, data_dir, tmp_path, monkeypatch, capsys
):
  one_block_models(monkeypatch)
  workdir = str(tmp_path / "cut")
  capsys.readouterr()
  before = signal.getsignal(signum)
  _signal_at_step(monkeypatch, 3, signum)
  assert cli.run(make_config(data_dir, **CONFIG), workdir) == 0
  assert signal.getsignal(signum) is before  # The handlers are put back.
  out = capsys.readouterr().out
  (step,) = re.findall(
    r"^preempted at step (\d+): checkpoint saved$", out, re.M
  )
  step = int(step)
  assert step == 3, out
  assert os.listdir(os.path.join(workdir, "checkpoints")) == [str(step)]
  assert not os.path.exists(os.path.join(workdir, "summary.json"))

  monkeypatch.undo()
  one_block_models(monkeypatch)
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
  assert 3 <= step < 6  # The sync point: the same step in both.
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
