"""What a run shows and writes: progress bar, epoch lines, metrics, plots.

Only process 0 writes. Files in ``workdir``: ``metrics.jsonl`` (one JSON object
per epoch), ``steps.jsonl`` (loss, accuracy so far, loss scale and skips on log steps),
``summary.json``, TensorBoard event files under ``tb/`` and ``plots.png``;
with ``rounding_every``, ``rounding_report.txt`` and ``rounding_stalled.png``.
"""

import json
import os
import sys
import tempfile
from typing import Any, Optional

import jax

from cifar_train import rounding_figures
from cifar_train.errors import WorkdirError


def check_workdir(workdir: str) -> None:
  """Fails before any training when ``workdir`` cannot be written."""
  if not workdir:
    raise WorkdirError("--workdir is required")
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write_test"):
      pass
  except OSError as e:
    raise WorkdirError(
      f"workdir {workdir!r} is not writable: {e.strerror}"
    ) from None


def _atomic_write(path: str, text: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def _summary_writer(logdir: str):
  """A tensorboardX ``SummaryWriter``, imported without PyTorch.

  tensorboardX imports torch when it is installed (to accept its tensors),
  which costs 1.5-2 s of every start where torch is present (the bench
  extra); the app logs Python floats only. A torch the process already
  imported is used as is.
  """
  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None  # `import torch` raises ImportError.
  try:
    import tensorboardX  # pylint: disable=g-import-not-at-top
  finally:
    if blocked and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return tensorboardX.SummaryWriter(logdir)


class Reporter:
  """Progress bar, the seed's epoch line, metrics.jsonl, TensorBoard, plots.

  A context manager: leaving the ``with`` block, by an error too, closes the
  progress bar and the TensorBoard writer (`close`).
  """

  def __init__(
    self,
    workdir: str,
    *,
    num_devices: int,
    total_steps: int,
    progress_bar: bool = True,
    initial_loss_scale: float = float("nan"),
  ):
    """Opens the workdir's records (a resumed run appends to them).

    Args:
      workdir: where the files go.
      num_devices: for the epoch line.
      total_steps: the progress bar's length.
      progress_bar: show one (tqdm, on stderr).
      initial_loss_scale: the scale before the first step, the "before" of
        a skip line when no log step has been recorded yet.
    """
    self.workdir = workdir
    self.initial_loss_scale = initial_loss_scale
    self.num_devices = num_devices
    self.is_main = jax.process_index() == 0
    self.history: list[dict[str, Any]] = []
    self.steps: list[dict[str, Any]] = []
    self._bar = None
    self._tb = None
    if not self.is_main:
      return
    path = os.path.join(workdir, "metrics.jsonl")
    # A resumed run keeps what earlier runs logged.
    self.history = _read_jsonl(path)
    self.steps = _read_jsonl(os.path.join(workdir, "steps.jsonl"))
    if progress_bar:
      import tqdm  # pylint: disable=g-import-not-at-top

      self._bar = tqdm.tqdm(
        total=total_steps,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
        leave=False,
      )
    self._tb = _summary_writer(os.path.join(workdir, "tb"))

  def __enter__(self) -> "Reporter":
    """Returns the reporter itself."""
    return self

  def __exit__(self, *exc_info) -> None:
    """Closes (`close`), whatever ended the block."""
    self.close()

  def close(self) -> None:
    """Closes the progress bar and the TensorBoard writer; idempotent."""
    bar, self._bar = self._bar, None
    tb, self._tb = self._tb, None
    try:
      if bar is not None:
        bar.close()
    finally:
      if tb is not None:
        tb.close()

  def progress(self, step: int) -> None:
    """Moves the progress bar to ``step``."""
    if self._bar is not None:
      # Host counters only: nothing here waits for the devices. Redrawn
      # every 10 steps (a call of k steps may jump over a multiple of 10).
      if step // 10 != self._bar.n // 10:
        self._bar.n = step
        self._bar.refresh()
      self._bar.n = step

  def log_step(
    self,
    step: int,
    stats: dict,
    worst_leaf: Optional[tuple[str, int]] = None,
    rounding: Optional[Any] = None,
  ) -> None:
    """Records a log step in steps.jsonl and TensorBoard.

    When steps were skipped since the previous log step, also prints one
    line: how many, the loss scale before and after, how many of them had a
    NaN/inf loss (the scale is not backed off for those), and, with
    diagnostics on, the leaf with the most non-finite gradient elements.
    When steps were dropped as spikes since then (``spike_skip_window``),
    one line says how many.

    Args:
      step: the global step.
      stats: `jaxmp.stats` plus ``loss`` (the last step's) and ``accuracy``
        (the epoch's so far), fetched to the host; ``nonfinite_loss_steps``
        and ``spike_skips`` are optional.
      worst_leaf: ``(path, non-finite count)`` of the last skipped step's
        worst leaf (`jaxmp.overflow_report`), or None.
      rounding: a `jaxmp.rounding_report`, recorded per leaf or layer
        group (`rounding_figures.groups`) with the applied step measured.
    """
    if not self.is_main:
      return
    last = self.steps[-1] if self.steps else None
    record = _step_record(step, stats, last)
    if self._bar is not None:
      self._bar.set_postfix(
        scale=f"{record['loss_scale']:g}", skipped=record["skipped_steps"]
      )
    self._report_spikes(record, int(stats.get("spike_skips", 0)), last)
    if record["skipped_since_last_log"] > 0:
      self._report_skips(record, last, worst_leaf)
    if rounding is not None and rounding.step:
      record["rounding_step"] = rounding.step
      record["rounding"] = rounding_figures.groups(rounding)
    self.steps.append(record)
    with open(os.path.join(self.workdir, "steps.jsonl"), "a") as f:
      f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      self._tb.add_scalar("train_loss_step", record["loss"], step)
      self._tb.add_scalar("loss_scale", record["loss_scale"], step)
      self._tb.add_scalar("skipped_steps", record["skipped_steps"], step)
      self._tb.add_scalar(
        "skipped_since_last_log", record["skipped_since_last_log"], step
      )

  def _report_spikes(self, record: dict, spikes: int, last: Optional[dict]):
    """Prints how many steps were dropped as spikes since the last log step.

    ``record`` keeps the count once spike skipping has dropped any step.
    """
    if not spikes and not (last and "spike_skips" in last):
      return
    record["spike_skips"] = spikes
    new = spikes - (last.get("spike_skips", 0) if last else 0)
    if new > 0:
      step, prev_step = record["step"], last["step"] if last else 0
      self._write_line(
        f"Step {step}: dropped {new} of steps {prev_step + 1}-{step} as "
        "loss or gradient-norm spikes"
      )

  def _report_skips(
    self, record: dict, last: Optional[dict], worst_leaf
  ) -> None:
    """Prints the line of the steps skipped since the previous log step.

    Also to TensorBoard; the worst leaf goes into ``record`` too.
    """
    step, scale = record["step"], record["loss_scale"]
    prev_step = last["step"] if last else 0
    bad_loss = 0  # Of the skipped steps, those whose loss was NaN/inf.
    if "nonfinite_loss_steps" in record:
      bad_loss = record["nonfinite_loss_steps"] - (
        last.get("nonfinite_loss_steps", 0) if last else 0
      )
    before = last["loss_scale"] if last else self.initial_loss_scale
    line = (
      f"Step {step}: skipped {record['skipped_since_last_log']} of steps "
      f"{prev_step + 1}-{step}, loss scale {before:g} -> {scale:g}"
    )
    if bad_loss > 0:
      line += f"; {bad_loss} of them with a NaN/inf loss"
    if worst_leaf is not None:
      record["worst_leaf"], record["worst_leaf_nonfinite"] = worst_leaf
      line += f"; worst leaf {worst_leaf[0]}: {worst_leaf[1]} non-finite"
    self._write_line(line)
    if self._tb is not None:
      self._tb.add_text("skipped", line, step)

  def log_grad_reduce(self, mode: str) -> None:
    """The start-up line: how gradients are summed across the devices."""
    if not self.is_main:
      return
    how = {
      "fp32": "in fp32",
      "half_wire": "in half precision on the wire, added in fp32",
      "native": "in the dtype of each product (XLA's choice)",
    }[mode]
    self._write_line(
      f"Gradients summed across {self.num_devices} device(s) {how} "
      f"(grad_reduce={mode})"
    )

  def _write_line(self, line: str) -> None:
    if self._bar is not None:
      self._bar.write(line)
    else:
      print(line, flush=True)

  def log_epoch(
    self,
    *,
    epoch: int,
    step: int,
    train: dict,
    test: dict,
    loss_scale: float,
    skipped_steps: int,
    images_per_sec: float,
  ) -> None:
    """Prints the seed's epoch line; appends to metrics.jsonl."""
    if not self.is_main:
      return
    record = {
      "epoch": epoch,
      "step": step,
      "train_loss": train["loss"],
      "train_accuracy": train["accuracy"],
      "test_loss": test["loss"],
      "test_accuracy": test["accuracy"],
      "loss_scale": loss_scale,
      "skipped_steps": skipped_steps,
      "images_per_sec": images_per_sec,
    }
    self.history.append(record)
    line = (
      f"Epoch: {epoch}, Loss: {train['loss']:.3f}, "
      f"Accuracy: {100 * train['accuracy']:.3f} | "
      f"Test Loss: {test['loss']:.3f}, "
      f"Test Accuracy: {100 * test['accuracy']:.3f} | "
      f"{images_per_sec:,.0f} img/s on {self.num_devices} device(s), "
      f"loss scale {loss_scale:g}, skipped {skipped_steps}"
    )
    self._write_line(line)
    with open(os.path.join(self.workdir, "metrics.jsonl"), "a") as f:
      f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for key in (
        "train_loss",
        "train_accuracy",
        "test_loss",
        "test_accuracy",
        "loss_scale",
        "images_per_sec",
      ):
        self._tb.add_scalar(key, record[key], step)
      self._tb.flush()

  def log_rounding(self, report: Any) -> None:
    """Writes a final `jaxmp.rounding_report` to the log and the workdir."""
    if not self.is_main:
      return
    text = str(report)
    for line in text.splitlines():
      self._write_line(line)
    _atomic_write(
      os.path.join(self.workdir, "rounding_report.txt"), text + "\n"
    )

  def finish(self, summary: dict) -> None:
    """Prints the test line, writes summary.json and plots.png."""
    if not self.is_main:
      return
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    print(
      f"Test Loss: {summary['test_loss']:.3f}, "
      f"Accuracy: {100 * summary['test_accuracy']:.3f}",
      flush=True,
    )
    _atomic_write(
      os.path.join(self.workdir, "summary.json"),
      json.dumps(summary, indent=2, sort_keys=True) + "\n",
    )
    self.close()
    self.plot()
    if any(r.get("rounding") for r in self.steps):
      rounding_figures.plot(self.steps, self.workdir)

  def plot_series(self) -> dict[str, tuple[list, list]]:
    """What `plot` draws: ``{name: (steps, values)}``.

    ``train_loss``/``train_accuracy``: a point per log step (that step's
    loss, the epoch's accuracy so far); ``test_loss``/``test_accuracy``: one
    per epoch; ``loss_scale`` per log step; ``skipped``: the log steps that
    saw skipped steps, at their loss.
    """
    at = lambda rows, key: (
      [r["step"] for r in rows],
      [r.get(key, float("nan")) for r in rows],
    )
    skips = [r for r in self.steps if r.get("skipped_since_last_log", 0) > 0]
    return {
      "train_loss": at(self.steps, "loss"),
      "train_accuracy": at(self.steps, "train_accuracy"),
      "test_loss": at(self.history, "test_loss"),
      "test_accuracy": at(self.history, "test_accuracy"),
      "loss_scale": at(self.steps, "loss_scale"),
      "skipped": at(skips, "loss"),
    }

  def plot(self) -> None:
    """Writes plots.png: loss, accuracy and loss scale (`plot_series`)."""
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    series = self.plot_series()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, kind in zip(axes[:2], ("loss", "accuracy")):
      ax.plot(*series["train_" + kind], "-", lw=1, label="train, log steps")
      ax.plot(*series["test_" + kind], "s", label="test, epochs")
    axes[2].step(*series["loss_scale"], where="post")
    axes[2].set_yscale("log", base=2)
    if series["skipped"][0]:
      axes[0].plot(*series["skipped"], "rx", label="steps skipped")
      for step in series["skipped"][0]:
        axes[2].axvline(step, color="r", alpha=0.3, lw=1)
    for ax, title in zip(axes, ("loss", "accuracy", "loss scale")):
      ax.set_title(title)
      ax.set_xlabel("step")
      ax.grid(alpha=0.3)
    axes[0].legend()
    axes[1].legend()
    fig.tight_layout()
    path = os.path.join(self.workdir, "plots.png")
    fig.savefig(path + ".tmp.png", dpi=90)
    os.replace(path + ".tmp.png", path)
    plt.close(fig)


def _step_record(step: int, stats: dict, last: Optional[dict]) -> dict:
  """The steps.jsonl record of a log step (``last``: the previous one)."""
  skipped = int(stats["skipped_steps"])
  record = {
    "step": step,
    "loss": float(stats["loss"]),
    "train_accuracy": float(stats.get("accuracy", float("nan"))),
    "loss_scale": float(stats["loss_scale"]),
    "skipped_steps": skipped,
    "skipped_since_last_log": skipped - (last["skipped_steps"] if last else 0),
  }
  if "nonfinite_loss_steps" in stats:
    record["nonfinite_loss_steps"] = int(stats["nonfinite_loss_steps"])
  return record


def _read_jsonl(path: str) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
