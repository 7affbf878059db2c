"""Cost of jaxmp's loss scaling in a whole fp32 ResNet18 train step (CPU).

Run: ``python bench/step_overhead.py``  (about 1 minute on 2 cores)
Full size: ``BENCH_FULL=1 python bench/step_overhead.py`` (64 filters, batch
128; about 12 s a step on 2 cores, so several minutes).

Two jitted train steps of the CIFAR ResNet18 (``jaxmp.models.resnet18``,
10 classes, BatchNorm in train mode, policy O0: fp32 params and compute), the
same model, init and batch:

* ``optax``: the bare optimizer ``inner = chain(add_decayed_weights(5e-4),
  sgd(0.1, momentum=0.9))`` (the project's SGD), no scaling, no finite check.
* ``jaxmp``: ``jaxmp.mixed_precision(inner,
  loss_scale=jmp.DynamicLossScale(2**15))``; the loss goes through
  ``jaxmp.scale_loss`` and the BatchNorm statistics through
  ``jaxmp.rollback_if_skipped``, as ``cifar_train.steps.make_train_step`` does.

Both steps donate their state. Each repetition runs both steps back to
back, alternating which goes first (AB BA ...), after two warm-up calls each
(compile excluded). The headline is the median over repetitions of the
per-repetition ratio: on a shared 2-core machine the load drifts between
repetitions by +-30%, and a ratio of two steps run seconds apart cancels most
of that drift (the ratio of the two medians is printed too).
Environment: ``BENCH_FILTERS`` (default 16), ``BENCH_BATCH`` (default 32),
``BENCH_REPS`` (default 30; 10 with ``BENCH_FULL=1``: 64 filters, batch 128).

Why 16 filters at batch 32 is representative: the optimizer's work (and so
the loss-scaling overhead: unscale, finite check, selects) grows with the
params, ``~F**2``; the convolutions with ``F**2 * batch``. Their ratio does
not depend on the width, so 16 filters at batch 32 has the overhead share of
the full 64-filter model at batch 32, and 4x the share it has at batch 128:
a conservative stand-in that runs 16x faster, so it can afford the many
repetitions a shared 2-core machine needs.

The last line is ``step_time_ratio: X`` (jaxmp / optax; goal <= 1.03).
"""

import os
import sys
import statistics

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

import jaxmp
from jaxmp.models import resnet18

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

FULL = os.environ.get("BENCH_FULL", "0") == "1"
FILTERS = int(os.environ.get("BENCH_FILTERS", "64" if FULL else "16"))
BATCH = int(os.environ.get("BENCH_BATCH", "128" if FULL else "32"))
REPS = int(os.environ.get("BENCH_REPS", "10" if FULL else "30"))


def make_step(model, optimizer, scaled: bool, compiler_options=None):
  """A jitted ``step(state, images, labels) -> (state, loss)``.

  Args:
    model: the Flax ResNet.
    optimizer: the optax optimizer whose state is in ``state["opt"]``.
    scaled: scale the loss and roll back BatchNorm statistics through jaxmp
      (``optimizer`` must then be a `jaxmp.mixed_precision`).
    compiler_options: for ``jax.jit``; ``None`` for
      ``jaxmp.cpu_compiler_options()``, what the app uses.

  Returns:
    The jitted step, with the state donated.
  """

  def step(state, images, labels):
    def loss_fn(params):
      logits, new_vars = model.apply(
        {"params": params, "batch_stats": state["batch_stats"]},
        images,
        train=True,
        mutable=["batch_stats"],
      )
      loss = optax.softmax_cross_entropy_with_integer_labels(
        logits, labels
      ).mean()
      out = jaxmp.scale_loss(loss, state["opt"]) if scaled else loss
      return out, (loss, new_vars["batch_stats"])

    grads, (loss, stats) = jax.grad(loss_fn, has_aux=True)(state["params"])
    updates, opt = optimizer.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    if scaled:
      stats = jaxmp.rollback_if_skipped(opt, stats, state["batch_stats"])
    return {"params": params, "batch_stats": stats, "opt": opt}, loss

  if compiler_options is None:
    compiler_options = jaxmp.cpu_compiler_options()
  return jax.jit(
    step, donate_argnums=(0,), compiler_options=compiler_options or None
  )


def time_interleaved(cases: dict, images, labels, reps: int) -> dict:
  """Times ``{name: [step, state]}`` alternately (AB BA ...), 2 warm-ups.

  Each step is ``step(state, images, labels) -> (state, loss)``; the states
  in ``cases`` are advanced in place. Returns ``{name: [seconds, ...]}``.
  """

  def runner(name):
    def run():
      step, state = cases[name]
      state, loss = step(state, images, labels)
      jax.block_until_ready((state, loss))
      cases[name][1] = state

    return run

  return _common.interleaved({name: runner(name) for name in cases}, reps)


def half_resnet(filters: int, batch: int, dtype, rng):
  """A CIFAR ResNet18 in ``dtype`` (params too), a random batch, variables.

  Returns ``(model, images, labels, variables)``
  (`random_batch_and_variables`).
  """
  model = resnet18(
    num_classes=10, num_filters=filters, dtype=dtype, param_dtype=dtype
  )
  return (model, *random_batch_and_variables(model, batch, dtype, rng))


def random_batch_and_variables(model, batch: int, dtype, rng):
  """A random CIFAR-shaped batch and ``model``'s variables from key 0.

  Returns ``(images, labels, variables)``: images in ``dtype``, int32
  labels; ``rng`` (a NumPy Generator) draws the images, then the labels.
  """
  images = jnp.asarray(rng.standard_normal((batch, 32, 32, 3)), dtype)
  labels = jnp.asarray(rng.integers(0, 10, batch), jnp.int32)
  variables = jax.jit(lambda k: model.init(k, images[:1], train=False))(
    jax.random.key(0)
  )
  return images, labels, variables


def main():
  print(_common.date_line("step_overhead"), flush=True)
  model = resnet18(num_classes=10, num_filters=FILTERS)
  rng = np.random.default_rng(0)
  images, labels, variables = random_batch_and_variables(
    model, BATCH, jnp.float32, rng
  )

  inner = optax.chain(
    optax.add_decayed_weights(5e-4), optax.sgd(0.1, momentum=0.9)
  )
  scaled_opt = jaxmp.mixed_precision(
    inner, loss_scale=jmp.DynamicLossScale(np.float32(2.0**15))
  )
  cases = {}
  for name, opt, scaled in (
    ("optax", inner, False),
    ("jaxmp", scaled_opt, True),
  ):
    params = jax.tree.map(jnp.copy, variables["params"])
    state = {
      "params": params,
      "batch_stats": jax.tree.map(jnp.copy, variables["batch_stats"]),
      "opt": opt.init(params),
    }
    cases[name] = [make_step(model, opt, scaled), state]

  times = time_interleaved(cases, images, labels, REPS)
  med = {name: statistics.median(t) for name, t in times.items()}
  ratio = statistics.median(
    a / b for a, b in zip(times["jaxmp"], times["optax"])
  )
  n_params = sum(x.size for x in jax.tree.leaves(variables["params"]))
  print(
    f"jax {jax.__version__} on {jax.devices()[0].platform} "
    f"({os.cpu_count()} cpus); ResNet18 CIFAR, {FILTERS} filters "
    f"({n_params:,} params), batch {BATCH}, fp32 (O0); {REPS} "
    "interleaved reps after 2 warm-up, median"
  )
  print(f"{'step':<8}{'median ms':>11}{'min ms':>9}{'max ms':>9}")
  for name in cases:
    print(
      f"{name:<8}{med[name] * 1e3:>11.1f}{min(times[name]) * 1e3:>9.1f}"
      f"{max(times[name]) * 1e3:>9.1f}"
    )
  print(
    f"ratio of medians (jaxmp/optax): {med['jaxmp'] / med['optax']:.3f}; "
    f"per-rep ratios: "
    + " ".join(f"{a / b:.2f}" for a, b in zip(times["jaxmp"], times["optax"]))
  )
  print(f"step_time_ratio: {ratio:.3f}")


if __name__ == "__main__":
  main()
