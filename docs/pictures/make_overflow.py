"""The loss scale and the skipped steps of a real jaxmp run through overflows.

Run from the repository root::

  python docs/pictures/make_overflow.py

Writes ``docs/pictures/overflow.png``. The run: a least-squares fit of 64
float16 weights (``jaxmp.mixed_precision(optax.sgd(0.05))``, fp32 masters)
to a fixed random target, 160 jitted steps on the CPU, with a dynamic loss
scale that starts too high on purpose (``2**24``, growth period 20 instead
of 2000 so that growth shows in a short run). Two kinds of overflow:

* natural ones at the start: the scaled float16 gradients exceed 65504
  until the scale has backed off far enough;
* injected ones: at steps 70, 71 and 72 and at step 120 the step's
  gradients are multiplied by inf inside the jitted step, as the app's
  ``--config.inject_overflow_at_step`` does.

Every skipped step leaves the params and the masters untouched and halves
the scale; every 20th finite step in a row doubles it. Per step the script
reads ``jaxmp.stats`` (a host read per step, for the picture only).
"""

import os

import jax
import jax.numpy as jnp
import jmp
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import optax  # noqa: E402

import jaxmp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 160
INJECT = (70, 71, 72, 120)


def run():
  """Per-step loss, loss scale (used by the step), and skipped flag."""
  key_w, key_x, key_t = jax.random.split(jax.random.key(0), 3)
  params = {"w": (0.1 * jax.random.normal(key_w, (64,))).astype(jnp.float16)}
  x = jax.random.normal(key_x, (256, 64)).astype(jnp.float16)
  target = jax.random.normal(key_t, (256,))
  opt = jaxmp.mixed_precision(
    optax.sgd(0.05),
    loss_scale=jmp.DynamicLossScale(jnp.float32(2.0**24), period=20),
  )
  opt_state = opt.init(params)

  def loss_fn(p):
    pred = (x @ p["w"]).astype(jnp.float32)
    return 0.5 * jnp.mean(jnp.square(pred - target))

  @jax.jit
  def step(params, opt_state, poison):
    scale = jaxmp.stats(opt_state)["loss_scale"]
    loss, grads = jax.value_and_grad(
      lambda p: jaxmp.scale_loss(loss_fn(p), opt_state)
    )(params)
    grads = jax.tree.map(lambda g: g * poison.astype(g.dtype), grads)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss / scale, scale

  rows = []
  for i in range(1, STEPS + 1):
    poison = jnp.float32(jnp.inf if i in INJECT else 1.0)
    params, opt_state, loss, scale = step(params, opt_state, poison)
    stats = jax.device_get(jaxmp.stats(opt_state))
    rows.append((i, float(loss), float(scale), not bool(stats["step_applied"])))
  final = jax.device_get(jaxmp.stats(opt_state))
  return np.array(rows), final


def main():
  rows, final = run()
  steps, loss, scale, skipped = rows.T
  skipped = skipped.astype(bool)
  natural = skipped & ~np.isin(steps, INJECT)
  injected = skipped & np.isin(steps, INJECT)
  print(
    f"{int(skipped.sum())} skipped steps ({int(natural.sum())} natural "
    f"overflows at steps {steps[natural].astype(int).tolist()}, injected at "
    f"{steps[injected].astype(int).tolist()}); final loss scale "
    f"{float(final['loss_scale']):g}, skipped_steps "
    f"{int(final['skipped_steps'])}; loss {loss[0]:.3f} -> {loss[-1]:.4f}"
  )

  fig, (ax1, ax2) = plt.subplots(
    2, 1, figsize=(9, 5.5), sharex=True, height_ratios=(3, 2)
  )
  ax1.step(steps, np.log2(scale), where="post", color="#4c72b0")
  ax1.scatter(
    steps[natural],
    np.log2(scale[natural]),
    color="#dd8452",
    zorder=3,
    label="skipped: scaled fp16 gradients overflowed",
  )
  ax1.scatter(
    steps[injected],
    np.log2(scale[injected]),
    color="#c44e52",
    marker="x",
    s=60,
    zorder=3,
    label="skipped: inf injected into the gradients",
  )
  ax1.set_ylabel("log2(loss scale) used")
  ax1.legend(fontsize=8, loc="upper right")
  ax1.grid(alpha=0.3)
  ax1.set_title(
    "jaxmp.mixed_precision, DynamicLossScale(2**24, period=20): "
    "÷2 on each overflow, ×2 after 20 finite steps",
    fontsize=9,
  )
  ax2.semilogy(steps, loss, color="#55a868")
  ax2.scatter(steps[skipped], loss[skipped], color="#c44e52", s=12, zorder=3)
  ax2.set_ylabel("loss (unscaled)")
  ax2.set_xlabel("step")
  ax2.grid(alpha=0.3)
  fig.tight_layout()
  out = os.path.join(HERE, "overflow.png")
  fig.savefig(out, dpi=100)
  print("wrote", out)


if __name__ == "__main__":
  main()
