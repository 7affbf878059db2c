"""What a run shows and writes: progress bar, epoch lines, metrics, plots.

Only process 0 writes. Files in ``workdir``: ``metrics.jsonl`` (one JSON object
per epoch), ``steps.jsonl`` (loss, loss scale and skips on log steps),
``summary.json``, TensorBoard event files under ``tb/`` and ``plots.png``.
"""

import json
import os
import sys
import tempfile
from typing import Any

import jax

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


class Reporter:
  """Progress bar, the seed's epoch line, metrics.jsonl, TensorBoard, plots."""

  def __init__(
    self,
    workdir: str,
    *,
    num_devices: int,
    total_steps: int,
    progress_bar: bool = True,
  ):
    self.workdir = workdir
    self.num_devices = num_devices
    self.is_main = jax.process_index() == 0
    self.history: list[dict[str, Any]] = []
    self.scales: list[tuple[int, float]] = []
    self._bar = None
    self._tb = None
    if not self.is_main:
      return
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(path):  # Resumed run: keep what earlier runs logged.
      with open(path) as f:
        self.history = [json.loads(line) for line in f if line.strip()]
    if progress_bar:
      import tqdm  # pylint: disable=g-import-not-at-top

      self._bar = tqdm.tqdm(
        total=total_steps,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
        leave=False,
      )
    try:
      import tensorboardX  # pylint: disable=g-import-not-at-top

      self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tb"))
    except ImportError:  # pragma: no cover - declared dependency.
      self._tb = None

  def progress(self, step: int) -> None:
    """Moves the progress bar to ``step``."""
    if self._bar is not None:
      self._bar.n = step
      if step % 10 == 0:
        self._bar.refresh()

  def log_step(self, step: int, stats: dict) -> None:
    """Records a log step: loss, loss scale, skips (steps.jsonl, TensorBoard)."""
    if not self.is_main:
      return
    scale = float(stats["loss_scale"])
    self.scales.append((step, scale))
    if self._bar is not None:
      self._bar.set_postfix(
        scale=f"{scale:g}", skipped=int(stats["skipped_steps"])
      )
    record = {
      "step": step,
      "loss": float(stats["loss"]),
      "loss_scale": scale,
      "skipped_steps": int(stats["skipped_steps"]),
    }
    with open(os.path.join(self.workdir, "steps.jsonl"), "a") as f:
      f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      self._tb.add_scalar("train_loss_step", record["loss"], step)
      self._tb.add_scalar("loss_scale", scale, step)
      self._tb.add_scalar("skipped_steps", record["skipped_steps"], step)

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
    if self._bar is not None:
      self._bar.write(line)
    else:
      print(line, flush=True)
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

  def finish(self, summary: dict) -> None:
    """Prints the test line, writes summary.json and plots.png."""
    if not self.is_main:
      return
    if self._bar is not None:
      self._bar.close()
    print(
      f"Test Loss: {summary['test_loss']:.3f}, "
      f"Accuracy: {100 * summary['test_accuracy']:.3f}",
      flush=True,
    )
    _atomic_write(
      os.path.join(self.workdir, "summary.json"),
      json.dumps(summary, indent=2, sort_keys=True) + "\n",
    )
    if self._tb is not None:
      self._tb.close()
    self.plot()

  def plot(self) -> None:
    """Writes plots.png: loss, accuracy and loss scale against step."""
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    steps = [r["step"] for r in self.history]
    for key, style in (("train_loss", "o-"), ("test_loss", "s--")):
      axes[0].plot(steps, [r[key] for r in self.history], style, label=key)
    for key, style in (("train_accuracy", "o-"), ("test_accuracy", "s--")):
      axes[1].plot(steps, [r[key] for r in self.history], style, label=key)
    scale_steps = [s for s, _ in self.scales] or steps
    scales = [v for _, v in self.scales] or [
      r["loss_scale"] for r in self.history
    ]
    axes[2].step(scale_steps, scales, where="post")
    axes[2].set_yscale("log", base=2)
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
