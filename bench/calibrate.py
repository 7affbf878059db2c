"""Skipped steps at the start: the default 2**15 against a calibrated scale.

Run: ``python bench/calibrate.py``  (about 20 s on 2 cores)

The model is an fp16 MLP (fp32 masters, Adam 1e-3) regressing unnormalised
targets (hundreds, as raw prices or counts are) with a mean squared error:
its gradients are in the thousands, so ``2**15`` times them overflows fp16
(max 65504) from the first step. Two runs of ``STEPS`` steps on the same
batches, both with a dynamic scale (period 2000, factor 2):

* ``default``: starts at ``2**15``, jmp's and jaxmp's default;
* ``calibrated``: starts at ``jaxmp.calibrate_loss_scale(loss_fn, params,
  *first_batch)`` (margin 2, cap 2**24), whose gradient evaluations are
  counted and timed (compile included) against one train step.

Each run counts its skipped steps (``jaxmp.stats``) and the steps until the
first applied update. The last line is ``skipped_steps_default: A
skipped_steps_calibrated: B calibration_evaluations: C``.
Environment: ``BENCH_STEPS`` (default 200).
"""

import os
import time

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

import jaxmp

STEPS = int(os.environ.get("BENCH_STEPS", "200"))
BATCH, FEATURES, HIDDEN = 64, 16, 64


def init_params(key):
  k1, k2, k3 = jax.random.split(key, 3)
  dense = lambda k, n, m: jax.random.normal(k, (n, m)) / np.sqrt(n)
  return jax.tree.map(
    lambda x: x.astype(jnp.float16),
    {
      "l1": {"kernel": dense(k1, FEATURES, HIDDEN), "bias": jnp.zeros(HIDDEN)},
      "l2": {"kernel": dense(k2, HIDDEN, HIDDEN), "bias": jnp.zeros(HIDDEN)},
      "out": {"kernel": dense(k3, HIDDEN, 1), "bias": jnp.zeros(1)},
    },
  )


def loss_fn(params, x, y):
  h = x
  for name in ("l1", "l2"):
    h = jax.nn.relu(h @ params[name]["kernel"] + params[name]["bias"])
  pred = (h @ params["out"]["kernel"] + params["out"]["bias"])[:, 0]
  return jnp.mean(jnp.square(pred.astype(jnp.float32) - y))


def batches(steps):
  rng = np.random.default_rng(0)
  w = rng.normal(size=FEATURES)
  for _ in range(steps):
    x = rng.normal(size=(BATCH, FEATURES))
    y = 300.0 + 100.0 * np.tanh(x @ w)  # Targets in the hundreds.
    yield jnp.asarray(x, jnp.float16), jnp.asarray(y, jnp.float32)


def train(initial_scale, data):
  opt = jaxmp.mixed_precision(
    optax.adam(1e-3),
    loss_scale=jmp.DynamicLossScale(np.float32(initial_scale), period=2000),
  )
  params = init_params(jax.random.key(0))
  state = opt.init(params)

  @jax.jit
  def step(params, state, x, y):
    scaled = lambda p: jaxmp.scale_loss(loss_fn(p, x, y), state)
    grads = jax.grad(scaled)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  first_applied, t_step = None, None
  for i, (x, y) in enumerate(data):
    t = time.perf_counter()
    params, state = step(params, state, x, y)
    if first_applied is None and bool(jaxmp.stats(state)["step_applied"]):
      first_applied = i + 1
    if i == 5:
      t_step = time.perf_counter() - t  # One warm step (after compile).
  stats = jax.device_get(jaxmp.stats(state))
  return {
    "skipped": int(stats["skipped_steps"]),
    "first_applied": first_applied,
    "final_scale": float(stats["loss_scale"]),
    "final_loss": float(loss_fn(params, *data[-1])),
    "step_s": t_step,
  }


def main():
  data = list(batches(STEPS))
  params = init_params(jax.random.key(0))
  t = time.perf_counter()
  scale, evals = jaxmp.calibrate_loss_scale(
    loss_fn, params, *data[0], return_evaluations=True
  )
  t_cal = time.perf_counter() - t
  runs = {"default": train(2.0**15, data), "calibrated": train(scale, data)}
  print(
    f"jax {jax.__version__} on {jax.devices()[0].platform}; fp16 MLP "
    f"{FEATURES}-{HIDDEN}-{HIDDEN}-1, batch {BATCH}, MSE on targets ~300, "
    f"Adam 1e-3, {STEPS} steps"
  )
  print(
    f"calibrate_loss_scale: {scale:g} (2**{int(np.log2(scale))}) in {evals} "
    f"gradient evaluations, {t_cal:.2f} s with its compile"
  )
  print(
    f"{'start':<11}{'initial':>9}{'skipped':>9}{'1st applied':>13}"
    f"{'final scale':>13}{'final loss':>12}"
  )
  for name, init in (("default", 2.0**15), ("calibrated", scale)):
    r = runs[name]
    print(
      f"{name:<11}{init:>9g}{r['skipped']:>9}{r['first_applied']:>13}"
      f"{r['final_scale']:>13g}{r['final_loss']:>12.4g}"
    )
  print(
    f"cost: {evals} gradient evaluations (each about one train step, "
    f"{runs['default']['step_s'] * 1e3:.2f} ms warm) against "
    f"{runs['default']['skipped'] - runs['calibrated']['skipped']} skipped "
    "steps saved"
  )
  print(
    f"skipped_steps_default: {runs['default']['skipped']} "
    f"skipped_steps_calibrated: {runs['calibrated']['skipped']} "
    f"calibration_evaluations: {evals}"
  )


if __name__ == "__main__":
  main()
