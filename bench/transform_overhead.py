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

Both jits donate the optimizer state (and ``update+apply`` the params), with
the outputs in the order of the donated inputs: jax hands each donated
buffer to the first output of the same shape and dtype, and with the updates
first they would take the state's buffers, costing both sides copies that a
real train step (which returns params and state) does not make.

Bytes per param, counting each array read or written once (what a backend
that fuses every loop over the params into one, as XLA:GPU does, moves;
memory-bound, so time follows):

==============  ==========  ==================  ==================  =======
unit            plain SGD   jaxmp fp32          jaxmp O2 fp16       floor
==============  ==========  ==================  ==================  =======
update          16          16 + 4 (check)      26                  1.25 / 1.63
update+apply    20          20 + 4 (check)      24                  1.20 / 1.20
==============  ==========  ==================  ==================  =======

plain SGD ``update``: read grad 4 + momentum 4, write momentum 4 + update 4.
jaxmp reads the gradients once more, for the global finite check, before it
may write anything: the step is skipped or applied as a whole. O2 fp16
``update``: check 2, read grad 2 + momentum 4 + master 4 + fp16 param 2,
write momentum 4 + master 4 + fp32 update 4. O2 ``update+apply`` writes the
fp16 param (2) instead of the update. So no implementation of a skip-on-
overflow step reaches 1.10 here: 1.20 to 1.63 is the floor on any backend;
the overhead disappears only where the check fuses into the kernels that
produce the gradients, as in a whole train step (``bench/step_overhead.py``).

XLA:CPU (jax 0.10.2) moves more than the table: it fuses no sibling loops,
so the kept and the skipped results are separate loops that each re-read the
gradients and the old state, and it copies each donated state buffer that a
later loop overwrites in place (``jax.jit(...).lower(...).compile()
.as_text()`` shows the ``copy`` ops). Tried: a ``lax.cond`` that runs the
bare optimizer only on finite steps reaches the floor for ``update`` alone
(1.20 fp32) but makes the whole train step 2-9% slower
(``bench/step_overhead.py``: 1.02-1.09 against 0.92-0.97 with selects), so
the selects stay. (An earlier version also timed jaxmp with the finite flag
fixed to True, by patching a private module: the fp32 rows then ran at about
the bare optimizer's time, so the rest of the fp32 ratio is the cost of being
able to skip a step. Benchmarks use public names only, so it is gone.)

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

REPS = int(os.environ.get("BENCH_REPS", "15"))


def make_tree(half: bool, seed: int = 0):
  rng = np.random.default_rng(seed)
  tree = {}
  for name, (shape, is_bn) in _shapes.resnet18_param_shapes().items():
    dtype = jnp.float16 if (half and not is_bn) else jnp.float32
    tree[name] = jnp.asarray(
      rng.standard_normal(shape, np.float32) * 0.05, dtype
    )
  return tree


def timed(fn, args):
  out = fn(*args)
  jax.block_until_ready(out)
  return out


def runner(opt, params, grads, unit):
  state = opt.init(params)
  if unit == "update":
    # State first in the outputs: jax hands each donated buffer to the first
    # output of the same shape and dtype, so the updates would otherwise take
    # the old state's buffers and XLA would copy the state to keep it alive.
    step = jax.jit(
      lambda g, s, p: opt.update(g, s, p)[::-1], donate_argnums=(1,)
    )

    def run(st):
      t = time.perf_counter()
      st, upd = step(grads, st, params)
      jax.block_until_ready((upd, st))
      return time.perf_counter() - t, st
  else:

    def both(g, p, s):  # Donated in the order they are returned.
      upd, s = opt.update(g, s, p)
      return optax.apply_updates(p, upd), s

    step = jax.jit(both, donate_argnums=(1, 2))
    holder = {"p": jax.tree.map(jnp.copy, params)}

    def run(st):
      t = time.perf_counter()
      holder["p"], st = step(grads, holder["p"], st)
      jax.block_until_ready((holder["p"], st))
      return time.perf_counter() - t, st

  return run, state


def compare(unit, half):
  """Median seconds of (plain SGD, jaxmp)."""
  params = make_tree(half)
  params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  scale = 2.0**10
  grads = jax.tree.map(lambda p: (p * scale).astype(p.dtype), params)
  grads32 = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
  runs = [list(runner(optax.sgd(0.1, momentum=0.9), params32, grads32, unit))]
  mp = jaxmp.mixed_precision(optax.sgd(0.1, momentum=0.9), loss_scale=scale)
  runs.append(list(runner(mp, params, grads, unit)))
  for _ in range(3):  # Warm-up: compile and touch memory.
    for run in runs:
      _, run[1] = run[0](run[1])
  times = [[] for _ in runs]
  for _ in range(REPS):
    for run, t in zip(runs, times):
      dt, run[1] = run[0](run[1])
      t.append(dt)
  return tuple(statistics.median(t) for t in times)


def main():
  print(_common.date_line("transform_overhead"), flush=True)
  print(
    f"jax {jax.__version__} on {jax.devices()[0].platform}, "
    f"{_shapes.num_params(_shapes.resnet18_param_shapes()):,} params, "
    f"{REPS} interleaved reps, median"
  )
  print(
    f"{'unit':<14}{'params':<10}{'optax ms':>10}{'jaxmp ms':>10}{'ratio':>8}"
  )
  worst = {}
  for unit in ("update", "update+apply"):
    for half in (False, True):
      base, mine = compare(unit, half)
      ratio = mine / base
      worst[unit] = max(worst.get(unit, 0.0), ratio)
      print(
        f"{unit:<14}{'fp16 O2' if half else 'fp32':<10}"
        f"{base * 1e3:>10.2f}{mine * 1e3:>10.2f}{ratio:>8.3f}",
        flush=True,
      )
  print(f"update_apply_time_ratio: {worst['update+apply']:.3f}")
  print(f"update_time_ratio: {worst['update']:.3f}")


if __name__ == "__main__":
  main()
