r"""O0 (fp32) against O2 (fp16, fp32 masters, dynamic loss scale): the smoke job.

Run from the repository root (about 10 minutes on 2 CPU cores)::

  python docs/pictures/make_o0_o2.py [WORKDIR]

Writes ``docs/pictures/o0_o2.png``. It runs the training app twice, as a
user would, with ``configs/smoke.py`` (an 8-filter CIFAR ResNet18 on the
app's offline synthetic data set: procedural, learnable 10-class 32x32
images, 4096 for training and 1000 for testing; batch 64, SGD 0.05 with
momentum, cosine) made 4 epochs long and logging every 8 steps::

  python train.py --config configs/smoke.py --workdir WORKDIR/O0 \
    --config.policy=O0 --config.num_epochs=4 --config.log_every_steps=8 \
    --config.progress_bar=False

and the same with ``--config.policy=O2``, then plots the train loss and
accuracy from each run's ``steps.jsonl`` and the test accuracy from its
``metrics.jsonl``. Runs whose ``summary.json`` is already in WORKDIR (default
``/tmp/jaxmp-o0-o2``) are not repeated.
"""

import json
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
POLICIES = ("O0", "O2")
EPOCHS = 4


def train(workdir, policy):
  if os.path.exists(os.path.join(workdir, "summary.json")):
    return
  subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "train.py"),
      "--config",
      os.path.join(ROOT, "configs", "smoke.py"),
      "--workdir",
      workdir,
      f"--config.policy={policy}",
      f"--config.num_epochs={EPOCHS}",
      "--config.log_every_steps=8",
      "--config.progress_bar=False",
    ],
    check=True,
    cwd=ROOT,
  )


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def main():
  root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/jaxmp-o0-o2"
  runs = {}
  for policy in POLICIES:
    workdir = os.path.join(root, policy)
    train(workdir, policy)
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
    runs[policy] = (
      read_jsonl(os.path.join(workdir, "steps.jsonl")),
      read_jsonl(os.path.join(workdir, "metrics.jsonl")),
      summary,
    )
    print(
      f"{policy}: test accuracy {100 * summary['test_accuracy']:.1f}%, "
      f"test loss {summary['test_loss']:.3f}, train loss "
      f"{summary['train_loss']:.3f}, {summary['steps']} steps, "
      f"{summary['wall_seconds']:.0f} s"
    )

  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  styles = {"O0": dict(color="#4c72b0"), "O2": dict(color="#dd8452", ls="--")}
  for policy, (steps, metrics, summary) in runs.items():
    label = {"O0": "O0: fp32", "O2": "O2: fp16, fp32 masters, dynamic scale"}[
      policy
    ]
    x = [r["step"] for r in steps]
    axes[0].plot(x, [r["loss"] for r in steps], label=label, **styles[policy])
    axes[1].plot(
      x,
      [100 * r["train_accuracy"] for r in steps],
      label=label,
      **styles[policy],
    )
    axes[2].plot(
      [r["step"] for r in metrics],
      [100 * r["test_accuracy"] for r in metrics],
      marker="o",
      label=f"{label} ({100 * summary['test_accuracy']:.1f}%)",
      **styles[policy],
    )
  axes[0].set_yscale("log")
  axes[0].set_title("train loss (the batch of each log step)", fontsize=10)
  axes[1].set_title("train accuracy so far in the epoch, %", fontsize=10)
  axes[2].set_title("test accuracy, % (1000 images, per epoch)", fontsize=10)
  for ax in axes:
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  axes[2].legend(fontsize=8, loc="lower right")
  fig.suptitle(
    "configs/smoke.py, 4 epochs: 8-filter ResNet18 on the app's synthetic "
    "10-class data, O0 against O2 (CPU)",
    fontsize=10,
  )
  fig.tight_layout()
  out = os.path.join(HERE, "o0_o2.png")
  fig.savefig(out, dpi=100)
  print("wrote", out)


if __name__ == "__main__":
  main()
