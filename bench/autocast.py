"""`jaxmp.autocast` on the CIFAR ResNet18 against the hand-cast fp16 model.

Run from the repository root (a couple of minutes on 2 cores)::

  python bench/autocast.py

Two versions of one train step of ``jaxmp.models.resnet18`` (CIFAR stem,
10 classes, BatchNorm in train mode with mutable ``batch_stats``, fp32 softmax
cross-entropy, `jaxmp.mixed_precision` SGD with a dynamic loss scale), the
same init and batch, measured side by side in this one run:

* ``autocast``: the fp32 model (``resnet18()``) with its ``apply`` under
  ``jaxmp.autocast(..., jnp.float16)``: Apex O1, jaxmp's ``"O1"`` preset.
* ``hand-cast``: the model built in fp16 (``resnet18(dtype=float16)``, fp32
  params and BatchNorm params), the images cast to fp16: the hand-cast O1 of
  before (and O2's compute; O2's residual bytes are printed too).

Figures, one line each (``name: value``):

* ``activation_bytes``: bytes of the residuals ``jax.vjp`` of the loss keeps
  for the backward pass, excluding the step's own arguments
  (``bench/activation_memory.py``'s accounting; traced only, so at the full
  size: 64 filters, batch 128). Ratio goal: <= 1.05.
* ``compiled_temp_bytes``: XLA's ``memory_analysis().temp_size_in_bytes`` of
  the compiled train step (small size, see below).
* ``step_time``: compiled train-step time on CPU, median of the per-repetition
  ratios of interleaved runs (``bench/step_overhead.py``'s timing; 16
  filters, batch 32 by default). Ratio goal: <= 1.05.
* ``convert_ops``: ``convert`` instructions in the optimised HLO of the
  compiled train step, and ``stablehlo.convert`` ops in the lowered program.
* ``first_eager_call``: the first eager (unjitted) forward call of the
  autocast model, which traces and rewrites it, against its second call
  (cached rewrite) and the hand-cast model's first eager call.

Environment: ``BENCH_FILTERS`` (16), ``BENCH_BATCH`` (32), ``BENCH_REPS``
(10) for the compiled figures; ``BENCH_CPU_CONVS=0`` builds both models
with ``cpu_convs=False`` (XLA's own convolutions and max-pool gradient
instead of ``jaxmp.nn``'s per-shape CPU lowerings, the default).
"""

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

import jaxmp
from jaxmp.models import resnet18

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import activation_memory  # pylint: disable=g-import-not-at-top,wrong-import-position
import step_overhead  # pylint: disable=g-import-not-at-top,wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

FILTERS = int(os.environ.get("BENCH_FILTERS", "16"))
BATCH = int(os.environ.get("BENCH_BATCH", "32"))
REPS = int(os.environ.get("BENCH_REPS", "10"))
CPU_CONVS = os.environ.get("BENCH_CPU_CONVS", "1") == "1"
F16, F32 = jnp.float16, jnp.float32


class Autocast:
  """``model`` with its ``apply`` under `jaxmp.autocast` (``init`` as is)."""

  def __init__(self, model, dtype=F16):
    self.init = model.init
    self.apply = jaxmp.autocast(model.apply, dtype)


class CastInputs:
  """``model`` whose ``apply`` casts the images to ``dtype`` first."""

  def __init__(self, model, dtype=F16):
    self.init = model.init
    self.apply = lambda v, x, **kw: model.apply(v, x.astype(dtype), **kw)


def variants(filters: int) -> dict:
  net = lambda **kw: resnet18(num_filters=filters, cpu_convs=CPU_CONVS, **kw)
  return {
    "autocast": Autocast(net()),
    "hand-cast": CastInputs(net(dtype=F16)),
  }


def ratio_line(name: str, values: dict, unit: str, fmt: str) -> str:
  a, h = values["autocast"], values["hand-cast"]
  return (
    f"{name}: autocast {a:{fmt}} {unit}, hand-cast {h:{fmt}} {unit}, "
    f"ratio {a / h:.3f}"
  )


def residual_bytes() -> dict:
  """Activation residual bytes of the full-size step, per variant."""
  out = {}
  models = variants(64)
  models["hand-cast O2"] = CastInputs(
    resnet18(dtype=F16, param_dtype=F16, norm_dtype=F32, cpu_convs=CPU_CONVS)
  )
  for name, model in models.items():
    act, _ = activation_memory.step_residual_bytes(model)
    out[name] = act
  return out


def main() -> None:
  print(_common.date_line("autocast"), flush=True)
  print(
    f"jax {jax.__version__}, {os.cpu_count()} cpus, {_common.cpu_name(isa=True)}; "
    f"ResNet18 CIFAR (cpu_convs={CPU_CONVS}); compiled figures at {FILTERS} "
    f"filters, batch {BATCH}, {REPS} interleaved reps"
  )
  res = residual_bytes()
  print(
    ratio_line(
      "activation_bytes (64 filters, batch 128)",
      {k: v / 1e6 for k, v in res.items()},
      "MB",
      ".1f",
    )
    + f"; hand-cast O2 {res['hand-cast O2'] / 1e6:.1f} MB"
  )

  rng = np.random.default_rng(0)
  models = variants(FILTERS)
  images, labels, variables = step_overhead.random_batch_and_variables(
    models["autocast"], BATCH, F32, rng
  )
  inner = optax.sgd(0.1, momentum=0.9)
  opt = jaxmp.mixed_precision(
    inner, loss_scale=jmp.DynamicLossScale(np.float32(2.0**15))
  )
  cases, temp, converts, lowered_converts = {}, {}, {}, {}
  for name, model in models.items():
    step = step_overhead.make_step(model, opt, scaled=True)
    state = {
      "params": jax.tree.map(jnp.copy, variables["params"]),
      "batch_stats": jax.tree.map(jnp.copy, variables["batch_stats"]),
    }
    state["opt"] = opt.init(state["params"])
    lowered = step.lower(state, images, labels)
    compiled = lowered.compile()
    temp[name] = compiled.memory_analysis().temp_size_in_bytes
    hlo = compiled.as_text()
    converts[name] = sum(" convert(" in line for line in hlo.splitlines())
    lowered_converts[name] = lowered.as_text().count("stablehlo.convert")
    cases[name] = [step, state]
  print(ratio_line("compiled_temp_bytes", temp, "B", ".0f"))
  print(
    f"convert_ops: autocast {converts['autocast']} (lowered "
    f"{lowered_converts['autocast']}), hand-cast {converts['hand-cast']} "
    f"(lowered {lowered_converts['hand-cast']}) in the optimised (lowered) "
    "train step"
  )

  times = step_overhead.time_interleaved(cases, images, labels, REPS)
  ratio = statistics.median(
    a / h for a, h in zip(times["autocast"], times["hand-cast"])
  )
  med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
  print(
    f"step_time: autocast {med['autocast']:.1f} ms, hand-cast "
    f"{med['hand-cast']:.1f} ms (medians), median per-rep ratio {ratio:.3f}"
  )

  # Eager forward calls: the first traces and rewrites, the second reuses.
  fresh = variants(FILTERS)

  def eager(model):
    t = time.perf_counter()
    out = model.apply(variables, images, train=True, mutable=["batch_stats"])
    jax.block_until_ready(out)
    return time.perf_counter() - t

  hand_first = eager(fresh["hand-cast"])  # Warms the per-op caches first.
  first = eager(fresh["autocast"])
  second = eager(fresh["autocast"])
  print(
    f"first_eager_call: autocast {first:.2f} s (second call {second:.2f} s), "
    f"hand-cast first call {hand_first:.2f} s"
  )

  # Tracing alone: the fp32 model's jaxpr, and the same under autocast
  # (trace plus rewrite), each from a fresh function (no cache).
  def trace(model):
    fn = lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"])
    t = time.perf_counter()
    jax.make_jaxpr(fn)(variables, images)
    return time.perf_counter() - t

  plain_s = trace(resnet18(num_filters=FILTERS, cpu_convs=CPU_CONVS))
  auto_s = trace(variants(FILTERS)["autocast"])
  print(
    f"trace_time: autocast {auto_s:.2f} s (trace + rewrite), fp32 model "
    f"{plain_s:.2f} s, ratio {auto_s / plain_s:.2f}"
  )


if __name__ == "__main__":
  main()
