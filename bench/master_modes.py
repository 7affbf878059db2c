"""What each ``master_weights`` mode costs and buys: bytes, time, accuracy.

Run: ``python bench/master_modes.py``  (about 40 minutes on 2 CPU cores;
``BENCH_PARTS=bytes,time`` takes a minute)

Modes of `jaxmp.mixed_precision` for bfloat16 params: ``"fp32"`` (fp32
master copies), ``"kahan"`` (a bfloat16 compensation buffer),
``"stochastic"`` (stochastically rounded updates, a PRNG key) and ``"none"``
(the plain round-to-nearest update, Apex O3's).

* **bytes**: params plus optimizer state per param, summed over the actual
  state trees (``jax.eval_shape`` of ``init``, every leaf), for the full
  CIFAR ResNet18 (64 filters, 10 classes) cast as the ``bf16-kahan`` preset
  does (bfloat16 params, BatchNorm params fp32), with SGD-momentum (the
  app's ``chain(add_decayed_weights, sgd(momentum=0.9))``) and with
  ``optax.adamw``. A plain fp32 model with the same optimizer is printed
  for reference.
* **time**: per mode, the jitted ``update`` + ``apply_updates`` alone and
  the whole train step (forward, backward, update; BatchNorm in train mode)
  of a ResNet18 in bfloat16 (``BENCH_FILTERS``, default 16, batch
  ``BENCH_BATCH``, default 32), relative to ``"fp32"``. All modes are
  timed interleaved in one run (``step_overhead.time_interleaved``, median
  of ``BENCH_REPS`` reps).
* **accuracy**: the app's own training loop (``cifar_train.loop``) with
  ``policy="bf16-kahan"`` and ``master_weights`` set per mode, two seeds
  each, on two jobs: ``configs/smoke.py`` (8 filters, 2 epochs), and the
  ResNet18 on the synthetic set at 16 filters, 8192 images, 3 epochs,
  batch 128 (``synthetic16``). Final test accuracy and loss, and the gap
  to ``"fp32"``, mean over the seeds. ``BENCH_JOBS`` picks the jobs.

The last line is ``state_bytes_per_param_kahan_over_fp32: X`` for
SGD-momentum (goal <= 0.85) with the accuracy gap of ``"kahan"`` to
``"fp32"`` beside it (goal: within 0.3 points).

Measured (AMD EPYC with AVX-512, 2 cores, 2026-12-03; tables in
docs/guides/master_weights.md): 0.800 bytes ratio; smoke job kahan - fp32 +0.00 pp (seeds 0, 1);
``synthetic16`` kahan -0.05, stochastic -0.05, none -0.10 pp against
99.95% for fp32 (seeds 0, 1; every run 99.7-100%, too easy a job to rank
the modes).

Environment: ``BENCH_PARTS`` (default ``bytes,time,accuracy``),
``BENCH_JOBS`` (default ``smoke,synthetic16``), ``BENCH_SEEDS`` (default
``0,1``), ``BENCH_FILTERS``, ``BENCH_BATCH``, ``BENCH_REPS`` (default 20).
"""

import os
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp
from jaxmp.models import resnet18

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import step_overhead  # pylint: disable=g-import-not-at-top,wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

MODES = ("fp32", "kahan", "stochastic", "none")
PARTS = os.environ.get("BENCH_PARTS", "bytes,time,accuracy").split(",")
JOBS = os.environ.get("BENCH_JOBS", "smoke,synthetic16").split(",")
SEEDS = [int(s) for s in os.environ.get("BENCH_SEEDS", "0,1").split(",")]
FILTERS = int(os.environ.get("BENCH_FILTERS", "16"))
BATCH = int(os.environ.get("BENCH_BATCH", "32"))
REPS = int(os.environ.get("BENCH_REPS", "20"))


def _sgd():
  return optax.chain(
    optax.add_decayed_weights(5e-4), optax.sgd(0.1, momentum=0.9)
  )


def _adamw():
  return optax.adamw(1e-3, weight_decay=1e-4)


def _variables(model):
  return jax.eval_shape(
    lambda k: model.init(k, jnp.zeros((1, 32, 32, 3)), train=False),
    jax.random.key(0),
  )


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def bytes_per_param() -> dict:
  """``{optimizer: {mode: bytes per param}}`` for the full ResNet18."""
  params = _variables(resnet18(num_classes=10))["params"]
  n = sum(x.size for x in jax.tree.leaves(params))
  out = {}
  for name, make in (("sgd-momentum", _sgd), ("adamw", _adamw)):
    row = {"fp32 model": (_nbytes(params) + _nbytes(make().init(params))) / n}
    for mode in MODES:

      def init(p, mode=mode):
        cast, opt = jaxmp.initialize(
          p, make(), "bf16-kahan", master_weights=mode
        )
        return cast, opt.init(cast)

      cast, state = jax.eval_shape(init, params)
      row[mode] = (_nbytes(cast) + _nbytes(state)) / n
    out[name] = row
  print(f"\nbytes of params + optimizer state per param ({n:,} params):")
  print(f"{'optimizer':<14}" + "".join(f"{m:>12}" for m in row))
  for name, row in out.items():
    print(f"{name:<14}" + "".join(f"{v:>12.3f}" for v in row.values()))
  return out


def step_times() -> None:
  """Update-only and whole-step medians per mode, relative to fp32."""
  rng = np.random.default_rng(0)
  model, images, labels, variables = step_overhead.half_resnet(
    FILTERS, BATCH, jnp.bfloat16, rng
  )
  grads = jax.tree.map(
    lambda p: jnp.asarray(1e-3 * rng.standard_normal(p.shape), p.dtype),
    variables["params"],
  )
  opts = {
    m: jaxmp.mixed_precision(
      _sgd(), loss_scale=jaxmp.get_preset("bf16").loss_scale, master_weights=m
    )
    for m in MODES
  }

  def fresh(opt):
    params = jax.tree.map(jnp.copy, variables["params"])
    return {
      "params": params,
      "batch_stats": jax.tree.map(jnp.copy, variables["batch_stats"]),
      "opt": opt.init(params),
    }

  def update_only(opt):
    def step(state, g, _):
      updates, new = opt.update(g, state["opt"], state["params"])
      params = optax.apply_updates(state["params"], updates)
      return dict(state, params=params, opt=new), params

    return jax.jit(step, donate_argnums=(0,))

  updates = step_overhead.time_interleaved(
    {m: [update_only(opts[m]), fresh(opts[m])] for m in MODES},
    grads,
    None,
    REPS,
  )
  steps = step_overhead.time_interleaved(
    {
      m: [step_overhead.make_step(model, opts[m], True), fresh(opts[m])]
      for m in MODES
    },
    images,
    labels,
    REPS,
  )
  n = sum(x.size for x in jax.tree.leaves(variables["params"]))
  print(
    f"\ntime: ResNet18 CIFAR, {FILTERS} filters ({n:,} params), batch "
    f"{BATCH}, bfloat16; median of {REPS} interleaved reps"
  )
  print(
    f"{'mode':<12}{'update ms':>11}{'x fp32':>8}{'step ms':>10}{'x fp32':>8}"
  )
  med = lambda t: statistics.median(t) * 1e3
  for m in MODES:
    print(
      f"{m:<12}{med(updates[m]):>11.2f}"
      f"{med(updates[m]) / med(updates['fp32']):>8.3f}"
      f"{med(steps[m]):>10.1f}{med(steps[m]) / med(steps['fp32']):>8.3f}"
    )


def _job_config(job: str, mode: str, seed: int, data_dir: str):
  from configs import smoke  # pylint: disable=g-import-not-at-top

  config = smoke.get_config()
  if job == "synthetic16":
    config.num_filters = 16
    config.synthetic_train_examples = 8192
    config.batch_size = 128
    config.num_epochs = 3
    config.learning_rate = 0.1
    config.log_every_steps = 64
  elif job != "smoke":
    raise ValueError(f"unknown job {job!r}: smoke or synthetic16")
  config.data_dir = data_dir
  config.policy = "bf16-kahan"
  config.master_weights = mode
  config.seed = seed
  config.progress_bar = False
  config.checkpoint_every_steps = 0
  config.compile_cache_dir = ""
  return config


def accuracy() -> dict:
  """``{job: {mode: (accuracy, loss) averaged over seeds}}``."""
  from cifar_train import loop  # pylint: disable=g-import-not-at-top

  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    data_dir = os.path.join(tmp, "tfds")
    for job in JOBS:
      rows = {m: [] for m in MODES}
      for seed in SEEDS:
        for mode in MODES:
          config = _job_config(job, mode, seed, data_dir)
          workdir = os.path.join(tmp, f"{job}-{mode}-{seed}")
          s = loop.train_and_evaluate(config, workdir)
          rows[mode].append((s["test_accuracy"], s["test_loss"]))
          print(
            f"{job} {mode} seed {seed}: test accuracy "
            f"{100 * s['test_accuracy']:.2f}%, loss {s['test_loss']:.4f}, "
            f"{s['wall_seconds']:.0f} s",
            flush=True,
          )
      out[job] = {m: np.mean(r, axis=0) for m, r in rows.items()}
  print(f"\naccuracy, bf16-kahan preset, mean of seeds {SEEDS}:")
  print(f"{'job':<13}{'mode':<12}{'test acc %':>11}{'gap pp':>8}{'loss':>8}")
  for job, row in out.items():
    for m, (acc, loss) in row.items():
      gap = 100 * (acc - row["fp32"][0])
      print(f"{job:<13}{m:<12}{100 * acc:>11.2f}{gap:>8.2f}{loss:>8.4f}")
  return out


def main():
  print(_common.date_line("master_modes"), flush=True)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
  sizes = bytes_per_param() if "bytes" in PARTS else None
  if "time" in PARTS:
    step_times()
  acc = accuracy() if "accuracy" in PARTS else None
  if sizes is not None:
    sgd = sizes["sgd-momentum"]
    gaps = ""
    if acc:
      gaps = "; accuracy gap kahan - fp32: " + ", ".join(
        f"{job} {100 * (row['kahan'][0] - row['fp32'][0]):+.2f} pp"
        for job, row in acc.items()
      )
    print(
      f"state_bytes_per_param_kahan_over_fp32: {sgd['kahan'] / sgd['fp32']:.3f}"
      f"{gaps}"
    )


if __name__ == "__main__":
  main()
