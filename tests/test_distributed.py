"""Scale out: two processes on localhost (`jax.distributed`, CPU collectives).

Each process has 2 CPU devices, so the global mesh has 4 devices, as the
single-process reference run in this (4-device) test process has. Each process
reads its half of every global batch; params, BatchNorm statistics and the
loss scale are replicated over both. On the one-block net in fp32, the two
processes agree with one, each restores the other's checkpoints exactly, and
a process killed mid-run makes the other exit with an error naming it. These
run in every suite run (the one-block net keeps the compiles small).

jax 0.10.2 runs CPU collectives across processes with gloo by default
(``jax_cpu_collectives_implementation``); nothing has to be configured.
"""

import json
import os
import re
import shutil

import pytest

from _helpers import one_block_models, read_jsonl, run_distributed

from cifar_train import loop


def test_host_reads_gather_what_other_processes_hold(tmp_path):
  # No model: two processes start, place an 8 x 4 array over their 2 + 2
  # devices and read it back. Each holds half of the sharded one's rows.
  outputs = run_distributed(
    {"check": "to_host"},
    str(tmp_path / "spec.json"),
    num_processes=2,
    local_devices=2,
    timeout=300,
  )
  whole = [float(v) for v in range(32)]
  prints = []
  for i, out in enumerate(outputs):
    (line,) = [l for l in out.splitlines() if l.startswith(f"process {i} ")]
    m = re.fullmatch(
      rf"process {i} x (\[.*\]) r (\[.*\]) fingerprint (\w+)", line
    )
    assert m, out
    assert json.loads(m[1]) == whole and json.loads(m[2]) == whole, line
    prints.append(m[3])
  assert prints[0] == prints[1]  # Both hashed the whole array.


# The one-block net in fp32 (O0): each two-process run compiles one small
# program (the test's persistent compilation cache serves the second job).
ONE_BLOCK_O0 = {"policy": "O0", "num_train_steps": 4}


def test_two_processes_agree_with_one_and_checkpoints_cross(
  make_config, data_dir, tmp_path, monkeypatch, capsys
):
  """1 x 4 devices against 2 x 2, and each one's checkpoint in the other.

  The same global batch, data order and init; fp32 (O0), so the per-step
  losses agree to float rounding (the gradient all-reduce sums in another
  order: a few units of 2**-24 in each of 32-example sums over 4 steps;
  1e-4 relative is a wide margin and far below what one wrong example or
  a missing all-reduce moves). A checkpoint written by one process is
  restored by two and the other way round, exactly: the whole-state
  fingerprint after the restore is the writer's.
  """
  one_block_models(monkeypatch)
  one_dir, two_dir = str(tmp_path / "one"), str(tmp_path / "two")
  one = loop.train_and_evaluate(make_config(data_dir, **ONE_BLOCK_O0), one_dir)
  assert (one["num_devices"], one["num_processes"]) == (4, 1)
  one_copy = str(tmp_path / "one_for_two")
  shutil.copytree(one_dir, one_copy)

  outputs = run_distributed(
    {
      "data_dir": data_dir,
      "one_block": True,
      "config": ONE_BLOCK_O0,
      # A fresh two-process run, then two processes resume the one-process
      # checkpoint at its last step (nothing left to train: restore, eval).
      "jobs": [{"workdir": two_dir}, {"workdir": one_copy}],
    },
    str(tmp_path / "spec.json"),
    num_processes=2,
    local_devices=2,
    timeout=240,
  )
  prints = {
    (int(p), int(j)): (f, st)
    for p, j, f, st in re.findall(
      r"^process (\d) job (\d) fingerprint (\w+) state (\w+)$",
      "\n".join(outputs),
      re.M,
    )
  }
  assert len(prints) == 4, outputs
  # Both processes hold the same replicated state.
  assert prints[0, 0] == prints[1, 0] and prints[0, 1] == prints[1, 1]
  for out in outputs:
    resumed = re.findall(r"Resuming from (\S+) at step (\d+)", out)
    assert resumed == [(os.path.join(one_copy, "checkpoints", "4"), "4")]
  # One process's checkpoint, restored in two: the writer's whole state.
  assert prints[0, 1][1] == one["state_fingerprint"]

  with open(os.path.join(two_dir, "summary.json")) as f:
    two = json.load(f)
  assert (two["num_devices"], two["num_processes"], two["steps"]) == (4, 2, 4)
  assert two["state_fingerprint"] == prints[0, 0][1]
  # Only process 0 writes: each step is logged once.
  steps = read_jsonl(os.path.join(two_dir, "steps.jsonl"))
  ref_steps = read_jsonl(os.path.join(one_dir, "steps.jsonl"))
  assert [r["step"] for r in steps] == [1, 2, 3, 4]
  for got, want in zip(steps, ref_steps):
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), (got, want)
  assert two["test_loss"] == pytest.approx(one["test_loss"], rel=1e-4)

  # Two processes' checkpoint, restored in one.
  two_copy = str(tmp_path / "two_for_one")
  shutil.copytree(two_dir, two_copy)
  capsys.readouterr()
  back = loop.train_and_evaluate(
    make_config(data_dir, **ONE_BLOCK_O0), two_copy
  )
  out = capsys.readouterr().out
  assert (
    f"Resuming from {os.path.join(two_copy, 'checkpoints', '4')} at step 4"
    in out
  )
  assert back["num_processes"] == 1
  assert back["state_fingerprint"] == two["state_fingerprint"]


def test_a_dead_process_is_an_error_naming_it_not_a_hang(
  data_dir, tiny_data, tmp_path
):
  """Process 1 is SIGKILLed after 2 steps; process 0 must not wait for ever.

  JAX's coordination service (in process 0) misses process 1's heartbeats
  for ``distributed_heartbeat_timeout_s`` (5 s here) and aborts process 0
  with an error that names task 1, well within 120 s.
  """
  del tiny_data  # Prepared here, not by both processes at once.
  returncodes = []
  outputs = run_distributed(
    {
      "data_dir": data_dir,
      "one_block": True,
      "config": dict(
        ONE_BLOCK_O0, num_train_steps=10**6, distributed_heartbeat_timeout_s=5
      ),
      "die": 1,
      "jobs": [{"workdir": str(tmp_path / "dead")}],
    },
    str(tmp_path / "spec.json"),
    num_processes=2,
    local_devices=2,
    timeout=240,
    returncodes=returncodes,
  )
  killed_at = re.findall(r"killed after 2 steps at ([\d.]+)", outputs[1])
  assert len(killed_at) == 1, (returncodes, outputs[1][-3000:])
  (survivor_rc, survivor_exit), (dead_rc, _) = returncodes
  assert dead_rc == -9, outputs[1][-2000:]
  assert survivor_rc != 0, outputs[0][-2000:]
  assert survivor_exit - float(killed_at[0]) < 120
  # A collective may fail first (gloo: connection reset by peer); the
  # coordination service then ends the process naming the lost task.
  assert re.search(
    r"Task 1 heartbeat timeout|"
    r"tasks are unhealthy \(stopped sending heartbeats\):\s*1\b",
    outputs[0],
  ), outputs[0][-3000:]
