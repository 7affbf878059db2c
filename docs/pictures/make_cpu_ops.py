"""The per-op CPU table of ``bench/cpu_ops.py`` as a bar chart.

Run from the repository root::

  python docs/pictures/make_cpu_ops.py

Writes ``docs/pictures/cpu_ops.png``. Nothing is timed here: the figures are
parsed from the measured table in ``bench/cpu_ops.py``'s docstring
(``BENCH_REPS=5 python bench/cpu_ops.py``, AMD EPYC with AVX-512, 2 cores,
nothing else running, jax 0.10.2, torch 2.13.0+cpu, 2026-12-03, jitted with
``jaxmp.cpu_compiler_options()``). Each bar is the op's time in one train
step, its median time times how often the step runs it ("x"), JAX against
PyTorch, batch 128, fp32, both ResNet18s.
"""

import ast
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BENCH = os.path.join(ROOT, "bench", "cpu_ops.py")

CONV = re.compile(
  r"^\s+(cifar|torchvision)\s+(.+?)\s+(\d+)\s+"
  r"([\d.]+)/([\d.]+)\s+([\d.]+)/([\d.]+)\s+([\d.]+)/([\d.]+)\s*$"
)
OTHER = re.compile(
  r"^\s+(cifar|torchvision)\s+(.+?)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s*$"
)


def measured_rows():
  """``{model: [(label, jax ms per step, torch ms per step), ...]}``."""
  with open(BENCH) as f:
    doc = ast.get_docstring(ast.parse(f.read()))
  rows = {"cifar": [], "torchvision": []}
  sums = {}
  for line in doc.splitlines():
    conv = CONV.match(line)
    if conv:
      model, name, times = conv.group(1), conv.group(2), int(conv.group(3))
      pairs = [float(v) for v in conv.groups()[3:]]
      for kind, (j, t) in zip(
        ("fwd", "input grad", "kernel grad"),
        (pairs[0:2], pairs[2:4], pairs[4:6]),
      ):
        rows[model].append((f"{name} {kind}", times * j, times * t))
      continue
    total = re.match(
      r"^\s+(cifar|torchvision)\s+sum over one step\s+([\d.]+)\s+([\d.]+)",
      line,
    )
    if total:
      sums[total.group(1)] = float(total.group(2)) / float(total.group(3))
      continue
    other = OTHER.match(line)
    if other:
      model, name, times = other.group(1), other.group(2), int(other.group(3))
      j, t = float(other.group(4)), float(other.group(5))
      rows[model].append((name.strip(), times * j, times * t))
  if (
    len(rows["cifar"]) != 33 + 9
    or len(rows["torchvision"]) != 33 + 13
    or len(sums) != 2
  ):
    raise ValueError(
      f"the table in {BENCH} changed shape: "
      f"{len(rows['cifar'])} and {len(rows['torchvision'])} rows"
    )
  return rows, sums


def main():
  rows, sums = measured_rows()
  fig, axes = plt.subplots(1, 2, figsize=(13, 11))
  titles = {
    "cifar": "CIFAR stem (resnet18)",
    "torchvision": "torchvision stem (resnet18_torchvision)",
  }
  for ax, (model, data) in zip(axes, rows.items()):
    labels = [r[0] for r in data]
    y = range(len(data))
    ax.barh([i - 0.2 for i in y], [r[1] for r in data], 0.4, label="JAX")
    ax.barh([i + 0.2 for i in y], [r[2] for r in data], 0.4, label="PyTorch")
    for i, (_, j, t) in enumerate(data):
      ax.text(max(j, t) * 1.02, i, f"{j / t:.2f}x", va="center", fontsize=6.5)
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms per train step (median x times run), batch 128, fp32")
    ax.set_title(
      f"{titles[model]}: ops sum to {sums[model]:.2f}x torch's", fontsize=10
    )
    ax.set_xlim(0, max(max(r[1], r[2]) for r in data) * 1.12)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
  fig.suptitle(
    "bench/cpu_ops.py as measured: AMD EPYC with AVX-512, 2 cores, "
    "jax 0.10.2 with jaxmp.cpu_compiler_options(), torch 2.13.0+cpu, "
    "2026-12-03 (labels: JAX / torch)",
    fontsize=9,
  )
  fig.tight_layout()
  out = os.path.join(HERE, "cpu_ops.png")
  fig.savefig(out, dpi=90)
  print("wrote", out)


if __name__ == "__main__":
  main()
