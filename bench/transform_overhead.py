"""Overhead of `jaxmp.mixed_precision` over the bare optax optimizer it wraps.

Run: ``python bench/transform_overhead.py``

Times the jitted, warmed optimizer step of
``mixed_precision(optax.sgd(0.1, momentum=0.9))`` against plain
``optax.sgd(0.1, momentum=0.9)`` on a CIFAR ResNet18-shaped param tree
(11,173,962 params), repetitions interleaved, median of each. Two timed units:

* ``update``: ``opt.update(grads, state, params)`` alone.
* ``update+apply``: ``update`` then ``optax.apply_updates`` in one jit (how a
  train step runs it: XLA fuses the two, the updates never hit memory).

Cases: fp32 params (both optimizers see fp32 params and grads), and O2 fp16
params (conv/dense fp16, BatchNorm fp32) with fp32 masters in the state,
against plain SGD on the same params in fp32, the work fp32 training does.

Bytes per param moved by ``update+apply`` (memory-bound, so time follows):
* plain SGD, fp32: read grad 4 + momentum 4 + param 4, write momentum 4 +
  param 4 = 20 B.
* jaxmp fp32: the same 20 B plus one read of the grad for the global finite
  check (4 B) = 24 B; the skip selects fuse into the update loop.
* jaxmp O2 fp16: read grad 2 (twice: finite check and update) + momentum 4 +
  master 4 + param 2, write momentum 4 + master 4 + param 2 = 24 B.
``update`` alone also writes the updates (4 B fp32 each) and, for jaxmp fp16,
reads the fp16 param (2 B) to express the update as ``cast(master) - param``.

Those are the byte counts of a fused update, which XLA:GPU produces. XLA:CPU
(jax 0.10.2) moves more: it does not fuse sibling outputs, so the selected new
state and the updates are separate loops that each re-read the gradients and
the old state, and it copies donated momentum and master buffers that are
read after being overwritten (see the optimised HLO:
``jax.jit(opt.update, donate_argnums=1).lower(...).compile().as_text()``).

The last line is the worse ``update`` ratio: ``update_time_ratio: X``.
"""

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
import _shapes  # pylint: disable=g-import-not-at-top,wrong-import-position
import jaxmp  # pylint: disable=g-import-not-at-top,wrong-import-position

REPS = int(os.environ.get("BENCH_REPS", "15"))


def make_tree(half: bool, seed: int = 0):
  rng = np.random.default_rng(seed)
  tree = {}
  for name, (shape, is_bn) in _shapes.resnet18_param_shapes().items():
    dtype = jnp.float16 if (half and not is_bn) else jnp.float32
    tree[name] = jnp.asarray(rng.standard_normal(shape, np.float32) * 0.05,
                             dtype)
  return tree


def timed(fn, args):
  out = fn(*args)
  jax.block_until_ready(out)
  return out


def runner(opt, params, grads, unit):
  state = opt.init(params)
  if unit == "update":
    step = jax.jit(lambda g, s, p: opt.update(g, s, p), donate_argnums=(1,))

    def run(st):
      t = time.perf_counter()
      upd, st = step(grads, st, params)
      jax.block_until_ready((upd, st))
      return time.perf_counter() - t, st
  else:
    def both(g, s, p):
      upd, s = opt.update(g, s, p)
      return optax.apply_updates(p, upd), s
    step = jax.jit(both, donate_argnums=(1, 2))
    holder = {"p": jax.tree.map(jnp.copy, params)}

    def run(st):
      t = time.perf_counter()
      holder["p"], st = step(grads, st, holder["p"])
      jax.block_until_ready((holder["p"], st))
      return time.perf_counter() - t, st
  return run, state


def compare(unit, half):
  params = make_tree(half)
  params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  scale = 2.0**10
  grads = jax.tree.map(lambda p: (p * scale).astype(p.dtype), params)
  grads32 = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
  base_run, base_state = runner(optax.sgd(0.1, momentum=0.9), params32,
                                grads32, unit)
  mp = jaxmp.mixed_precision(optax.sgd(0.1, momentum=0.9),
                              loss_scale=scale)
  mp_run, mp_state = runner(mp, params, grads, unit)
  for _ in range(3):  # Warm-up: compile and touch memory.
    _, base_state = base_run(base_state)
    _, mp_state = mp_run(mp_state)
  tb, tm = [], []
  for _ in range(REPS):
    dt, base_state = base_run(base_state)
    tb.append(dt)
    dt, mp_state = mp_run(mp_state)
    tm.append(dt)
  return statistics.median(tb), statistics.median(tm)


def main():
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"{_shapes.num_params(_shapes.resnet18_param_shapes()):,} params, "
        f"{REPS} interleaved reps, median")
  print(f"{'unit':<14}{'params':<10}{'optax ms':>10}{'jaxmp ms':>10}"
        f"{'ratio':>8}")
  worst = {}
  for unit in ("update", "update+apply"):
    for half in (False, True):
      base, mine = compare(unit, half)
      ratio = mine / base
      worst[unit] = max(worst.get(unit, 0.0), ratio)
      print(f"{unit:<14}{'fp16 O2' if half else 'fp32':<10}"
            f"{base * 1e3:>10.2f}{mine * 1e3:>10.2f}{ratio:>8.3f}")
  print(f"update_apply_time_ratio: {worst['update+apply']:.3f}")
  print(f"update_time_ratio: {worst['update']:.3f}")


if __name__ == "__main__":
  main()
