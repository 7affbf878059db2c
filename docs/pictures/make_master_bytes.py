"""Bytes per param of each ``master_weights`` mode, from the state trees.

Run from the repository root::

  python docs/pictures/make_master_bytes.py

Writes ``docs/pictures/master_bytes.png``: params plus optimizer state per
param of the full CIFAR ResNet18 (``jaxmp.models.resnet18``, 64 filters, 10
classes, 11.2 M params), cast as the ``bf16-kahan`` preset does (bfloat16
params, BatchNorm fp32), with SGD-momentum (the app's
``chain(add_decayed_weights, sgd(momentum=0.9))``) and ``optax.adamw``, as
``bench/master_modes.py`` counts them (``BENCH_PARTS=bytes``). Every leaf is
counted from ``jax.eval_shape`` of ``init``: nothing is allocated or timed,
so the figure is the same on any machine.
"""

import os

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import optax  # noqa: E402

import jaxmp  # noqa: E402
from jaxmp.models import resnet18  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("fp32", "kahan", "stochastic", "none")
OPTIMIZERS = {
  "SGD-momentum": lambda: optax.chain(
    optax.add_decayed_weights(5e-4), optax.sgd(0.1, momentum=0.9)
  ),
  "AdamW": lambda: optax.adamw(1e-3, weight_decay=1e-4),
}


def nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def breakdown(params, make, mode):
  """Bytes of (params, masters or compensation, inner state, the rest)."""

  def init(p):
    cast, opt = jaxmp.initialize(p, make(), "bf16-kahan", master_weights=mode)
    return cast, opt.init(cast)

  cast, state = jax.eval_shape(init, params)
  mp = jaxmp.find_state(state)
  parts = {
    "params": nbytes(cast),
    "fp32 masters": nbytes(mp.master_params),
    "Kahan compensation": nbytes(mp.compensation),
    "optimizer moments": nbytes(mp.inner_state),
  }
  parts["counters, scale, key"] = nbytes(state) - sum(
    v for k, v in parts.items() if k != "params"
  )
  return parts


def main():
  params = jax.eval_shape(
    lambda k: resnet18(num_classes=10).init(
      k, jnp.zeros((1, 32, 32, 3)), train=False
    ),
    jax.random.key(0),
  )["params"]
  n = sum(x.size for x in jax.tree.leaves(params))
  rows = {}
  for name, make in OPTIMIZERS.items():
    fp32 = nbytes(params) + nbytes(make().init(params))
    rows[name] = {"fp32 model": {"params": nbytes(params)}}
    rows[name]["fp32 model"]["optimizer moments"] = fp32 - nbytes(params)
    for mode in MODES:
      rows[name][f'"{mode}"'] = breakdown(params, make, mode)

  print(f"bytes of params + optimizer state per param ({n:,} params)")
  for name, row in rows.items():
    print(
      name,
      " ".join(f"{k}={sum(v.values()) / n:.3f}" for k, v in row.items()),
    )

  colors = {
    "params": "#4c72b0",
    "fp32 masters": "#dd8452",
    "Kahan compensation": "#55a868",
    "optimizer moments": "#8c8c8c",
    "counters, scale, key": "#c44e52",
  }
  fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
  for ax, (name, row) in zip(axes, rows.items()):
    labels = list(row)
    bottom = [0.0] * len(labels)
    for part, color in colors.items():
      heights = [row[k].get(part, 0) / n for k in labels]
      ax.bar(labels, heights, bottom=bottom, color=color, label=part)
      bottom = [b + h for b, h in zip(bottom, heights)]
    for i, total in enumerate(bottom):
      ax.text(i, total + 0.15, f"{total:.3f}", ha="center", fontsize=9)
    ax.set_title(f"{name}: params + optimizer state")
    ax.tick_params(axis="x", labelsize=9)
    ax.set_ylim(0, 16)
  axes[0].set_ylabel("bytes per param")
  axes[1].legend(loc="upper right", fontsize=8)
  fig.suptitle(
    f"CIFAR ResNet18 ({n / 1e6:.1f} M params), bf16 params with BatchNorm "
    "fp32, by master_weights mode",
    fontsize=10,
  )
  fig.tight_layout()
  out = os.path.join(HERE, "master_bytes.png")
  fig.savefig(out, dpi=100)
  print("wrote", out)


if __name__ == "__main__":
  main()
