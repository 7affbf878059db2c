"""What ``rounding_every`` costs, and what masters chosen per leaf save.

Run: ``python bench/rounding.py``  (a few minutes on 2 CPU cores)

* **overhead**: whole jitted train steps with ``rounding_every`` 0 (off), 1
  and 100, timed side by side (AB BA ..., two warm-ups each, the median of
  the per-repetition ratios to off):
  - the CIFAR ResNet18 (``jaxmp.models.resnet18``, ``BENCH_FILTERS``
    filters, batch ``BENCH_BATCH``) in fp16 with fp32 masters (O2), SGD
    momentum with weight decay, as ``diagnostics_overhead.py``;
  - the byte LM of ``examples/byte_lm_autocast.py`` (width 64, depth 2, 4
    heads, 16 x 64 bytes) with bfloat16 params upcast for an fp32 forward
    pass and AdamW.
  Goal: at most 1.03 at 1, within noise (1.00 +- 0.01) at 100.
* **per leaf**: the byte LM trained 400 steps on ``README.md`` (AdamW 3e-3,
  weight decay 1e-2, seed 0) with fp32 masters and ``rounding_every=50``;
  each leaf keeps the remedy of its worst measured step
  (``jaxmp.rounding_report(...).master_weights()``; ``"none"`` only where
  every measured step said so). The same run again with those masters: the
  train loss (mean of the last 50 steps) against fp32 masters everywhere
  (goal: within 0.5%), and the bytes saved (`jaxmp.state_summary`).

Environment: ``BENCH_FILTERS`` (8), ``BENCH_BATCH`` (16), ``BENCH_REPS``
(30), ``BENCH_PARTS`` (``overhead,per_leaf``), ``BENCH_MODELS``
(``resnet,lm``: the overhead's models).

The last lines are ``rounding_every_1_ratio: resnet X, lm Y``,
``rounding_every_100_ratio: ...`` and ``per_leaf_loss_ratio: Z``.

Measured (Xeon with AVX-512, 2 cores shared with other jobs, 2026-12-06;
about 4 minutes; the table on the performance page): both models are small
enough that a step is tens of milliseconds, so the figures' per-leaf sums
(one or two reductions a leaf; 62 leaves in the ResNet18, 30 in the byte
LM) weigh in it; at 100 the step pays one ``lax.cond`` and keeps the fp32
update in memory. At AdamW 3e-3 every leaf of the byte LM loses updates in
bf16 alone (at the last measured step the LayerNorm scales 100%, the
embeddings and the head 75-78%, the first block's attention kernels
28-29%), so the per-leaf choice keeps masters everywhere, exact in 2 bytes
(``"remainder"``).
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
import state_bytes  # pylint: disable=g-import-not-at-top,wrong-import-position
import step_overhead  # pylint: disable=g-import-not-at-top,wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

FILTERS = int(os.environ.get("BENCH_FILTERS", "8"))
BATCH = int(os.environ.get("BENCH_BATCH", "16"))
REPS = int(os.environ.get("BENCH_REPS", "30"))
PARTS = os.environ.get("BENCH_PARTS", "overhead,per_leaf").split(",")
MODELS = os.environ.get("BENCH_MODELS", "resnet,lm").split(",")
EVERY = (0, 1, 100)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _ratios(times):
  off = times[0]
  return {
    k: statistics.median(a / b for a, b in zip(times[k], off)) for k in EVERY
  }


def resnet_overhead():
  rng = np.random.default_rng(0)
  model, images, labels, variables = step_overhead.half_resnet(
    FILTERS, BATCH, jnp.float16, rng
  )
  inner = optax.chain(
    optax.add_decayed_weights(5e-4), optax.sgd(0.1, momentum=0.9)
  )
  cases = {}
  for every in EVERY:
    opt = jaxmp.mixed_precision(
      inner,
      loss_scale=jmp.DynamicLossScale(np.float32(2.0**15)),
      rounding_every=every,
    )
    params = jax.tree.map(jnp.copy, variables["params"])
    state = {
      "params": params,
      "batch_stats": jax.tree.map(jnp.copy, variables["batch_stats"]),
      "opt": opt.init(params),
    }
    cases[every] = [step_overhead.make_step(model, opt, True), state]
  times = step_overhead.time_interleaved(cases, images, labels, REPS)
  leaves = len(jax.tree.leaves(variables["params"]))
  return _ratios(times), times, leaves


def _lm_setup(seed=0, steps=400, batch=16, length=64):
  lm = state_bytes._byte_lm()  # pylint: disable=protected-access
  with open(os.path.join(ROOT, "README.md"), "rb") as f:
    data = np.frombuffer(f.read(), np.uint8)
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(data) - length - 1, (steps, batch))
  tokens = np.stack(
    [[data[s : s + length + 1] for s in row] for row in starts]
  ).astype(np.int32)
  model = lm.ByteLM(width=64, depth=2, num_heads=4)
  params = model.init(jax.random.key(seed), tokens[0, :, :-1])["params"]
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)

  def loss_fn(params, toks):
    full = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return lm.loss_fn(model.apply, full, toks)

  return params, jnp.asarray(tokens), loss_fn


def _lm_opt(**kw):
  return jaxmp.mixed_precision(
    optax.adamw(3e-3, weight_decay=1e-2), loss_scale=1.0, **kw
  )


def lm_overhead():
  params, tokens, loss_fn = _lm_setup(steps=4)
  cases = {}
  for every in EVERY:
    opt = _lm_opt(rounding_every=every)

    def step(state, toks, _, opt=opt):
      loss, grads = jax.value_and_grad(loss_fn)(state["params"], toks)
      updates, o = opt.update(grads, state["opt"], state["params"])
      return {
        "params": optax.apply_updates(state["params"], updates),
        "opt": o,
      }, loss

    p = jax.tree.map(jnp.copy, params)
    cases[every] = [
      jax.jit(step, donate_argnums=(0,)),
      {"params": p, "opt": opt.init(p)},
    ]
  times = step_overhead.time_interleaved(cases, tokens[0], None, REPS)
  return _ratios(times), times, len(jax.tree.leaves(params))


def _lm_train(master_weights, rounding_every=0, chunk=50):
  """Trains 400 steps, ``chunk`` a call; returns (loss, state, reports)."""
  params, tokens, loss_fn = _lm_setup()
  opt = _lm_opt(master_weights=master_weights, rounding_every=rounding_every)

  @jax.jit
  def train(params, state, toks):
    def body(carry, t):
      params, state = carry
      loss, grads = jax.value_and_grad(loss_fn)(params, t)
      updates, state = opt.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), loss

    (params, state), losses = jax.lax.scan(body, (params, state), toks)
    return params, state, losses

  state, losses, reports = opt.init(params), [], []
  for i in range(0, len(tokens), chunk):
    params, state, loss = train(params, state, tokens[i : i + chunk])
    losses.append(np.asarray(loss))
    if rounding_every:
      reports.append(jaxmp.rounding_report(state))
  return float(np.concatenate(losses)[-50:].mean()), state, reports


def per_leaf():
  base_loss, base_state, reports = _lm_train("fp32", rounding_every=50)
  choice = reports[-1].master_weights()
  for report in reports:  # A leaf goes without masters only if always safe.
    for row in report:
      if row.master_weights != "none":
        choice[row.path] = row.master_weights
  loss, state, _ = _lm_train(choice)
  modes = {}
  for m in choice.values():
    modes[m] = modes.get(m, 0) + 1
  fp32_bytes = jaxmp.state_summary(base_state).nbytes
  summary = jaxmp.state_summary(state)
  print("\nbyte LM, bf16 params, AdamW 3e-3, wd 1e-2, 400 steps, seed 0")
  print(f"the last measured step's report:\n{reports[-1]}")
  print(f"chosen per leaf: {modes}")
  print("| masters | train loss (last 50 steps) | state bytes | saved |")
  print("|---|---|---|---|")
  print(f"| fp32 everywhere | {base_loss:.4f} | {fp32_bytes:,} | - |")
  print(
    f"| per leaf | {loss:.4f} | {summary.nbytes:,} | "
    f"{summary.masters_saved:,} |"
  )
  return loss / base_loss


def main():
  print(_common.date_line("rounding"), flush=True)
  print(
    f"jax {jax.__version__} on {jax.devices()[0].platform} "
    f"({os.cpu_count()} cpus); {REPS} interleaved reps after 2 warm-up"
  )
  out = {}
  if "overhead" in PARTS:
    for name, fn in (("resnet", resnet_overhead), ("lm", lm_overhead)):
      if name not in MODELS:
        continue
      ratios, times, leaves = fn()
      out[name] = ratios
      print(f"\n{name} ({leaves} leaves): median ms, ratio to off")
      for every in EVERY:
        ms = statistics.median(times[every]) * 1e3
        print(f"rounding_every={every:<4} {ms:8.2f} ms  {ratios[every]:.3f}")
  loss_ratio = per_leaf() if "per_leaf" in PARTS else None
  for every in (1, 100):
    if out:
      print(
        f"rounding_every_{every}_ratio: "
        + ", ".join(f"{k} {v[every]:.3f}" for k, v in out.items())
      )
  if loss_ratio is not None:
    print(f"per_leaf_loss_ratio: {loss_ratio:.4f}")


if __name__ == "__main__":
  main()
