"""Checkpoints under faults: SIGKILL during saves, lost files, a full disk.

One driver process (see `_helpers.py`) runs a chain of jobs on one workdir,
each killed (SIGKILL, nothing runs after it) or failed at a different point of
a checkpoint save; every restart must resume from the newest complete
checkpoint, remove the leftovers and end with the whole state (masters,
momentum, BatchNorm statistics, loss scale, data key) of an uninterrupted run.
The jobs train the one-block net (`one_block_models`): the point is the
checkpoints, not ResNet18. The chain saves every step (6 steps, keep 2):

  job  fault (at checkpoint)         complete after the job  resumes from
  1    kill before saving 2          1                        -
  2    kill while writing 3          1 2 (+ 3 temporary)      1
  3    kill before renaming 4        2 3 (+ 4 temporary)      2
  4    disk full writing 5           3 4 (+ 5 temporary)      3
  5    kill while deleting 3         4 5 (3 half deleted)     4
  6    a data file of 5 deleted      5 6                      4, set 5 aside

The configuration errors below fail in-process, before any training step.
"""

import errno
import gc
import glob
import json
import os
import re
import shutil

import orbax.checkpoint as ocp
import pytest

from _helpers import TMP_MARK, one_block_models, read_log, run_driver
from cifar_train import checkpoint
from cifar_train import loop
from cifar_train import settings
from cifar_train import steps
from cifar_train.errors import CheckpointError

STEPS = 6
# Wide enough that orbax writes the arrays to data files (``d/*``), which
# the tests damage, instead of inlining small values in its index.
FILTERS = 16
CHAIN = [  # (fault, at checkpoint, expected exit code, resumed from)
  ("kill_before_save", 2, -9, None),
  ("kill_during_write", 3, -9, 1),
  ("kill_after_write", 4, -9, 2),
  ("enospc", 5, 2, 3),
  ("kill_during_cleanup", 3, -9, 4),
  ("missing_file", 5, 0, 4),
]


def _resumed_from(log: str):
  found = re.findall(r"Resuming from (\S+) at step (\d+)", log)
  assert len(found) <= 1, found
  if not found:
    return None
  path, step = found[0]
  assert os.path.basename(path) == step
  return int(step)


def test_killed_and_failed_saves_resume_exactly(data_dir, tmp_path):
  config = {
    "checkpoint_every_steps": 1,
    "keep_checkpoints": 2,
    "num_train_steps": STEPS,
    "num_filters": FILTERS,
  }
  ref = str(tmp_path / "ref")
  run = str(tmp_path / "run")
  jobs = [
    {
      "workdir": ref,
      "config": dict(config, checkpoint_every_steps=0),
      "log": str(tmp_path / "ref.log"),
    }
  ]
  for i, (fault, step, _, _) in enumerate(CHAIN, start=1):
    job = {
      "workdir": run,
      "config": config,
      "fault": fault,
      "step": step,
      "cli": fault == "enospc",
      "log": str(tmp_path / f"{i}-{fault}.log"),
    }
    if fault == "missing_file":
      job.update(
        fault="",
        remove=[
          os.path.join(
            run, "checkpoints", str(step), "state", "ocdbt.process_0", "d", "*"
          )
        ],
      )
    jobs.append(job)
  # A guard against a hung child, not a speed limit: 7 jobs of several
  # seconds of CPU each on a loaded 2-core machine.
  results = run_driver(
    {"data_dir": data_dir, "jobs": jobs, "one_block": True},
    str(tmp_path / "spec.json"),
    timeout=1200,
  )
  logs = [read_log(job) for job in jobs]
  fingerprint = lambda log: re.findall(r"^state_fingerprint (\w+)$", log, re.M)

  assert results[0]["exit"] == 0, logs[0][-2000:]
  (reference,) = fingerprint(logs[0])
  assert sorted(results[0]["checkpoints"]) == ["6"]

  for i, (fault, step, code, resumed) in enumerate(CHAIN, start=1):
    log, result = logs[i], results[i]
    what = f"job {i} ({fault or 'no fault'} at {step}):\n{log[-3000:]}"
    assert result["exit"] == code, what
    assert _resumed_from(log) == resumed, what
    listing = result["checkpoints"]
    # Each start removed the temporary directory that the previous left.
    if i > 1:
      for name in results[i - 1]["checkpoints"]:
        if TMP_MARK in name:
          assert name not in listing, what
    complete = sorted(
      int(n)
      for n in listing
      if n.isdigit() and "commit_success.txt" in listing[n]
    )
    if fault == "kill_before_save":
      assert listing == {"1": listing["1"]}, what  # Nothing of 2 exists.
    elif fault == "kill_during_write":
      assert "killing during the write of 3" in log
      assert int(re.search(r"\((\d+) files written\)", log)[1]) > 0, what
      assert complete == [1, 2], what
      assert "commit_success.txt" not in listing[f"3{TMP_MARK}"], what
    elif fault == "kill_after_write":
      assert "commit_success: True" in log, what
      assert complete == [2, 3], what
      assert f"4{TMP_MARK}" in listing, what
    elif fault == "enospc":
      errors = [line for line in log.splitlines() if line.startswith("error")]
      assert errors == [
        f"error: saving a checkpoint failed: [Errno {errno.ENOSPC}] "
        f"{os.strerror(errno.ENOSPC)}: "
        f"'{run}/checkpoints/5{TMP_MARK}/state{TMP_MARK}/_METADATA'; the "
        f"newest complete checkpoint is {run}/checkpoints/4"
      ], what
      assert complete == [3, 4], what  # The failed save deleted nothing.
    elif fault == "kill_during_cleanup":
      assert f"killing while deleting {run}/checkpoints/3" in log, what
      assert complete == [3, 4, 5] and "state" not in listing["3"], what
    else:  # A data file of 5 went missing: one warning line names the
      # checkpoint and the array; 5 is set aside and made again.
      (warning,) = [
        line
        for line in log.splitlines()
        if line.startswith("WARNING: checkpoint")
      ]
      assert re.fullmatch(
        rf"WARNING: checkpoint {run}/checkpoints/5 is unusable \(.*"
        r"leaf_\d{4} = \.\w+.*\); falling back to an older one",
        warning,
      ), what
      assert f"WARNING: moved 1 unusable checkpoint(s) to {run}/unusable_" in (
        log
      ), what
      assert os.listdir(os.path.join(run, "unusable_checkpoints")) == ["5"]
      assert fingerprint(log) == [reference], what
      assert complete == [5, 6] and sorted(listing) == ["5", "6"], what
      with open(os.path.join(run, "summary.json")) as f:
        assert json.load(f)["state_fingerprint"] == reference


@pytest.fixture(scope="module", autouse=True)
def _one_block_net():
  """The one-block net (`one_block_models`) in this module's in-process runs."""
  with pytest.MonkeyPatch.context() as patch:
    one_block_models(patch)
    yield


def _template(make_config, data_dir):
  s = settings.resolve(make_config(data_dir, num_filters=FILTERS))
  model = steps.create_model(
    s.model, num_classes=10, num_filters=s.num_filters, precision=s.precision
  )
  # A schedule, as the loop's, so that the optimizer state has its count.
  optimizer = steps.create_optimizer(
    s.precision, lambda _: 0.1, momentum=0.9, weight_decay=5e-4
  )
  return steps.create_train_state(model, optimizer, (32, 32, 3), seed=0)


@pytest.fixture(scope="module")
def trained(make_config, data_dir, tiny_data, tmp_path_factory):
  """A workdir with checkpoints 2 and 4 of the tiny job (keep 3)."""
  workdir = str(tmp_path_factory.mktemp("trained") / "run")
  config = make_config(
    data_dir, num_train_steps=4, keep_checkpoints=3, num_filters=FILTERS
  )
  loop.train_and_evaluate(config, workdir, data=tiny_data)
  return workdir


@pytest.fixture
def workdir(trained, tmp_path):
  """A fresh copy of `trained`'s workdir."""
  path = str(tmp_path / "run")
  shutil.copytree(trained, path)
  return path


def _tree(workdir):
  """Every file under ``workdir``'s checkpoint folders, with its size."""
  return {
    os.path.relpath(p, workdir): os.path.getsize(p)
    for p in glob.glob(
      os.path.join(workdir, "*checkpoints", "**"), recursive=True
    )
    if os.path.isfile(p)
  }


def _truncate(paths):
  assert paths
  for path in paths:
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)


@pytest.fixture
def collect_abandoned_reads():
  """Collects, in this test's teardown, what a failed restore abandoned.

  A failed restore leaves orbax's other shard reads as coroutines in
  reference cycles; collected later, in whichever test the GC runs, each
  reports "Exception ignored" there. Collected here, under this test's
  filter, they report nothing: the error that matters is the one restore
  raises.
  """
  yield
  gc.collect()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.usefixtures("collect_abandoned_reads")
@pytest.mark.parametrize(
  "damage",
  [
    "array data",  # TensorStore: OUT_OF_RANGE, the byte range is not there.
    "array metadata",  # The state's _METADATA: JSON that does not parse.
    "missing record",  # meta/metadata: FileNotFoundError.
  ],
)
def test_corrupt_checkpoint_falls_back_and_is_set_aside(
  damage, make_config, data_dir, workdir, capsys
):
  newest = os.path.join(workdir, "checkpoints", "4")
  if damage == "array data":
    _truncate(
      glob.glob(os.path.join(newest, "state", "ocdbt.process_0", "d", "*"))
    )
  elif damage == "array metadata":
    _truncate([os.path.join(newest, "state", "_METADATA")])
  else:
    os.remove(os.path.join(newest, "meta", "metadata"))
  template = _template(make_config, data_dir)
  manager = checkpoint.create_manager(workdir, keep=3)
  state, path = checkpoint.restore_latest(manager, template)
  manager.close()
  assert path == os.path.join(workdir, "checkpoints", "2")
  assert int(state.step) == 2
  out = capsys.readouterr().out
  assert f"checkpoint {newest} is unusable" in out, out
  assert os.listdir(os.path.join(workdir, "unusable_checkpoints")) == ["4"]
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["2"]
  # The unusable checkpoint, put back as the only one left: no fallback.
  os.replace(os.path.join(workdir, "unusable_checkpoints", "4"), newest)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "2"))
  manager = checkpoint.create_manager(workdir, keep=3)
  with pytest.raises(CheckpointError, match="checkpoints/4"):
    checkpoint.restore_latest(manager, template)
  manager.close()


@pytest.mark.parametrize(
  "error",
  [
    OSError(errno.EIO, os.strerror(errno.EIO)),
    TimeoutError("reading took too long"),
    TypeError("a bug in the restore"),
  ],
  ids=["EIO", "timeout", "bug"],
)
def test_transient_and_code_errors_stop_and_move_nothing(
  error, make_config, data_dir, workdir, monkeypatch, capsys
):
  before = _tree(workdir)
  newest = os.path.join(workdir, "checkpoints", "4")
  read = ocp.JsonCheckpointHandler.restore

  def failing_read(self, directory, *args, **kwargs):
    if str(directory).startswith(newest):
      raise error
    return read(self, directory, *args, **kwargs)

  manager = checkpoint.create_manager(workdir, keep=3)
  monkeypatch.setattr(ocp.JsonCheckpointHandler, "restore", failing_read)
  template = _template(make_config, data_dir)
  with pytest.raises(type(error)) as raised:
    checkpoint.restore_latest(manager, template)
  manager.close()
  assert raised.value is error  # Its class, message and traceback.
  assert any(newest in note for note in raised.value.__notes__)
  assert "unusable" not in capsys.readouterr().out
  assert _tree(workdir) == before  # Nothing moved, deleted or written.
  assert not os.path.exists(os.path.join(workdir, "unusable_checkpoints"))


def test_corruption_is_told_from_io_errors():
  def chained(outer, inner):
    try:
      try:
        raise inner
      except BaseException as e:
        raise outer from e
    except BaseException as e:  # pylint: disable=broad-except
      return e

  truncated = ValueError(
    'OUT_OF_RANGE: Error reading "leaf_0000/0": Requested byte range '
    "[0, 2291) is not valid for value of size 1278"
  )
  assert checkpoint.corruption(chained(Exception("reading"), truncated)) is (
    truncated
  )
  missing = FileNotFoundError("File meta/metadata not found.")
  assert checkpoint.corruption(missing) is missing
  # TensorStore's report of an I/O error, and any OSError in the chain.
  io = ValueError("UNKNOWN: Error reading: [OS error 5: Input/output error]")
  assert checkpoint.corruption(io) is None
  eio = OSError(errno.EIO, "Input/output error")
  assert checkpoint.corruption(chained(truncated, eio)) is None
  assert checkpoint.corruption(ValueError("UNAVAILABLE: retry")) is None
  assert checkpoint.corruption(KeyError("leaf_0000")) is None


def test_checkpoint_shape_mismatch_names_the_leaf(
  make_config, data_dir, tiny_data, workdir
):
  before = _tree(workdir)
  with pytest.raises(
    CheckpointError,
    match=r"does not match the config at \.params\['bn1'\]\['bias'\]: stored shape \(16,\), config shape \(8,\)",
  ):
    loop.train_and_evaluate(
      make_config(data_dir, num_filters=8, keep_checkpoints=3),
      workdir,
      data=tiny_data,
    )
  assert _tree(workdir) == before


@pytest.mark.parametrize(
  "every,expected", [(0, [3, 6]), (2, [2, 4, 6]), (4, [4, 6])]
)
def test_should_save(every, expected):
  saved = [
    step
    for step in range(1, 7)
    if checkpoint.should_save(every, step, 3 if step <= 3 else 6, 6)
  ]
  assert saved == expected
