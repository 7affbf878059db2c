"""Cost of ``mixed_precision(..., diagnostics=True)`` in a whole train step.

Run: ``python bench/diagnostics_overhead.py``  (under a minute on 2 cores)

Two jitted train steps of the CIFAR ResNet18 (``jaxmp.models.resnet18``,
10 classes, BatchNorm in train mode) in fp16 with fp32 masters (O2: fp16
params and compute, fp32 BatchNorm), the same model, init and batch, on CPU:

* ``off``: ``jaxmp.mixed_precision(inner, loss_scale=DynamicLossScale(2**15))``
  with ``inner = chain(add_decayed_weights(5e-4), sgd(0.1, momentum=0.9))``.
* ``on``: the same with ``diagnostics=True`` (per-leaf non-finite count,
  largest finite |gradient| and zero-or-subnormal fraction, every step).

Both steps donate their state; each repetition runs both back to back,
alternating which goes first (AB BA ...), after two warm-up calls each. The
headline is the median of the per-repetition ratios (on a shared machine
the load drifts between repetitions; a ratio of two steps run a few
milliseconds apart cancels most of it). Numbers on a loaded 2-core machine
are noisy: rerun before reading a 1-2 % difference.

It also lowers the whole step with ``diagnostics=False`` and with
``mixed_precision`` built without the argument and compares the HLO text.

Environment: ``BENCH_FILTERS`` (default 8), ``BENCH_BATCH`` (default 16),
``BENCH_REPS`` (default 40).

The last lines are ``off_hlo_equals_baseline: True|False`` and
``diagnostics_step_time_ratio: X`` (on / off; goal <= 1.05).
"""

import os
import statistics
import sys

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

import jaxmp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_overhead  # pylint: disable=g-import-not-at-top,wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

FILTERS = int(os.environ.get("BENCH_FILTERS", "8"))
BATCH = int(os.environ.get("BENCH_BATCH", "16"))
REPS = int(os.environ.get("BENCH_REPS", "40"))


def main():
  print(_common.date_line("diagnostics_overhead"), flush=True)
  rng = np.random.default_rng(0)
  model, images, labels, variables = step_overhead.half_resnet(
    FILTERS, BATCH, jnp.float16, rng
  )
  inner = optax.chain(
    optax.add_decayed_weights(5e-4), optax.sgd(0.1, momentum=0.9)
  )
  scale = lambda: jmp.DynamicLossScale(np.float32(2.0**15))
  opts = {
    "baseline": jaxmp.mixed_precision(inner, loss_scale=scale()),
    "off": jaxmp.mixed_precision(inner, loss_scale=scale(), diagnostics=False),
    "on": jaxmp.mixed_precision(inner, loss_scale=scale(), diagnostics=True),
  }

  def fresh_state(opt):
    params = jax.tree.map(jnp.copy, variables["params"])
    return {
      "params": params,
      "batch_stats": jax.tree.map(jnp.copy, variables["batch_stats"]),
      "opt": opt.init(params),
    }

  make_step = lambda name: step_overhead.make_step(model, opts[name], True)
  hlo = {
    name: make_step(name)
    .lower(fresh_state(opts[name]), images, labels)
    .as_text()
    for name in ("baseline", "off")
  }
  cases = {
    name: [make_step(name), fresh_state(opts[name])] for name in ("off", "on")
  }

  times = step_overhead.time_interleaved(cases, images, labels, REPS)
  ratios = [a / b for a, b in zip(times["on"], times["off"])]
  med = {name: statistics.median(t) for name, t in times.items()}
  rows = jaxmp.overflow_report(cases["on"][1]["opt"])
  n_params = sum(x.size for x in jax.tree.leaves(variables["params"]))
  print(
    f"jax {jax.__version__} on {jax.devices()[0].platform} "
    f"({os.cpu_count()} cpus); ResNet18 CIFAR, {FILTERS} filters "
    f"({n_params:,} params, {len(rows)} leaves), batch {BATCH}, fp16 (O2); "
    f"{REPS} interleaved reps after 2 warm-up, median"
  )
  print(f"{'step':<6}{'median ms':>11}{'min ms':>9}{'max ms':>9}")
  for name in cases:
    print(
      f"{name:<6}{med[name] * 1e3:>11.2f}{min(times[name]) * 1e3:>9.2f}"
      f"{max(times[name]) * 1e3:>9.2f}"
    )
  print(
    f"ratio of medians (on/off): {med['on'] / med['off']:.3f}; ratio of "
    f"minima: {min(times['on']) / min(times['off']):.3f}"
  )
  print("last step's report (diagnostics on):")
  print(str(rows))
  print(f"off_hlo_equals_baseline: {hlo['off'] == hlo['baseline']}")
  print(f"diagnostics_step_time_ratio: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
  main()
