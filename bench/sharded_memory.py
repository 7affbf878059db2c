"""Bytes of the optimizer state per device under FSDP, jaxmp beside optax.

Run: ``python bench/sharded_memory.py`` (a minute on 2 CPU cores;
``--smoke`` for a tiny model in seconds)

The params are a transformer's weights without the model (``--depth``
blocks of a ``--width``-wide attention and MLP, embeddings, LayerNorms) in
bfloat16, every leaf sharded on its first axis over a 1-D ``fsdp`` mesh of
1, 2, 4 and 8 forced CPU devices (``--devices``). For each mesh and each
optimizer -- ``optax.adamw`` on the params, and
``jaxmp.mixed_precision(optax.adamw)``
(fp32 masters and fp32 moments) -- the state is built three ways: eagerly
(``opt.init(params)``), under ``jax.jit(opt.init)`` without out-shardings,
and, for jaxmp, under
``jax.jit(opt.init, out_shardings=jaxmp.state_shardings(opt, params))``.
Each cell is the bytes of the whole state on the device that holds the
most of it, and that as a fraction of the whole state (1/n is the goal on
n devices).

The step time (informational, CPU) is a jitted, donated train step of an
MLP on those weights under jaxmp, batch 64 (split over the devices), on
one device and on 8, median of ``--reps`` steps.

The last line is ``jaxmp_state_share_8_devices_jit_init: X`` (goal 0.125).
"""

import os

_COUNT = "--xla_force_host_platform_device_count"
if _COUNT not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_COUNT}=8"

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import datetime
import json
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax

import jaxmp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position


def make_params(width: int, depth: int) -> dict[str, Any]:
  """A transformer's weights (bfloat16), seeded; no model needed."""
  rng = np.random.default_rng(0)
  shapes = {"embed": (256, width), "ln_out": (width,)}
  for i in range(depth):
    shapes.update(
      {
        f"block{i}/qkv": (width, 3 * width),
        f"block{i}/proj": (width, width),
        f"block{i}/mlp_in": (width, 4 * width),
        f"block{i}/mlp_out": (4 * width, width),
        f"block{i}/ln": (width,),
      }
    )
  return {
    k: jnp.asarray(0.02 * rng.standard_normal(s), jnp.bfloat16)
    for k, s in shapes.items()
  }


def fsdp_mesh(n: int) -> jax.sharding.Mesh:
  return jax.make_mesh(
    (n,),
    ("fsdp",),
    axis_types=(jax.sharding.AxisType.Auto,),
    devices=jax.devices()[:n],
  )


def shard(params: dict[str, Any], mesh) -> dict[str, Any]:
  """Every leaf split on its first axis over ``fsdp``."""
  return jax.device_put(params, NamedSharding(mesh, P("fsdp")))


def state_bytes(state: Any) -> tuple[int, int]:
  """``(whole, on the device holding the most)`` bytes of a state."""
  whole, per_device = 0, {}
  for leaf in jax.tree.leaves(state):
    whole += leaf.nbytes
    for s in leaf.addressable_shards:
      per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
  return whole, max(per_device.values())


def optimizers(lr: float = 1e-3) -> dict[str, optax.GradientTransformation]:
  return {
    "optax": optax.adamw(lr),
    "jaxmp": jaxmp.mixed_precision(
      optax.adamw(lr), loss_scale=jaxmp.get_preset("bf16").loss_scale
    ),
  }


def inits(name: str, opt, params) -> dict[str, Callable[[], Any]]:
  """The ways of building the state that a user reaches for."""
  ways = {
    "eager": lambda: opt.init(params),
    "jit(init)": lambda: jax.jit(opt.init)(params),
  }
  if name == "jaxmp":
    ways["jit(init, out_shardings)"] = lambda: jax.jit(
      opt.init, out_shardings=jaxmp.state_shardings(opt, params)
    )(params)
  return ways


def memory_table(params, device_counts: Sequence[int]) -> list[dict]:
  rows = []
  for n in device_counts:
    sharded = shard(params, fsdp_mesh(n))
    for name, opt in optimizers().items():
      for way, build in inits(name, opt, sharded).items():
        whole, most = state_bytes(build())
        rows.append(
          dict(devices=n, optimizer=name, init=way, whole=whole, most=most)
        )
  return rows


def make_step(opt, where: Any, x: jax.Array) -> Callable:
  """A donated train step of a residual MLP over the weights, under jaxmp.

  Params and state keep the shardings ``where`` (in and out), so that the
  step compiles once.
  """

  def loss_fn(params, x):
    h = x
    for k in sorted(params):
      if k.endswith("mlp_in"):
        w_in, w_out = params[k], params[k[: -len("in")] + "out"]
        h = h + jax.nn.gelu(h @ w_in) @ w_out
    return jnp.mean(h.astype(jnp.float32) ** 2)

  def step(params, state, x):
    loss, grads = jaxmp.value_and_grad(loss_fn)(params, state, x)
    updates, state = opt.update(grads, state, params, loss=loss)
    return optax.apply_updates(params, updates), state, loss

  return jax.jit(
    step,
    in_shardings=(*where, x.sharding),
    out_shardings=(*where, None),
    donate_argnums=(0, 1),
  )


def step_time(params, n: int, reps: int) -> float:
  """Median seconds of a step on ``n`` devices (fsdp params, split batch)."""
  mesh = fsdp_mesh(n)
  opt = optimizers()["jaxmp"]
  p = jax.tree.map(jnp.copy, shard(params, mesh))  # the step donates it
  s = opt.init(p)
  width = params["ln_out"].shape[0]
  x = jax.device_put(
    jnp.ones((64, width), jnp.bfloat16), NamedSharding(mesh, P("fsdp"))
  )
  # Eager init leaves the scalars (loss scale, counters) on one device; the
  # step returns them replicated on the mesh, so a second call would
  # compile again: replicate them first.
  where = jax.tree.map(
    lambda a: a.sharding if a.ndim else NamedSharding(mesh, P()), (p, s)
  )
  p, s = jax.device_put((p, s), where)
  step = make_step(opt, where, x)
  p, s, loss = step(p, s, x)  # compile
  loss.block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    p, s, loss = step(p, s, x)
    loss.block_until_ready()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def _cell(row: dict) -> str:
  return f"{row['most'] / 2**20:.2f} MB ({row['most'] / row['whole']:.3f})"


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--depth", type=int, default=4)
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--smoke", action="store_true", help="tiny and quick")
  parser.add_argument("--no-time", action="store_true", help="bytes only")
  parser.add_argument("--json", default="", help="write the rows here")
  parser.add_argument(
    "--devices", default="1,2,4,8", help="the fsdp mesh sizes (ascending)"
  )
  args = parser.parse_args(argv)
  print(_common.date_line("sharded_memory"), flush=True)
  if args.smoke:
    args.width, args.depth, args.reps = 32, 1, 2
  counts = tuple(int(n) for n in args.devices.split(","))
  most = counts[-1]
  if jax.device_count() < most:
    raise SystemExit(f"needs {most} devices, jax has {jax.device_count()}")

  params = make_params(args.width, args.depth)
  rows = memory_table(params, counts)
  columns = sorted(
    {(r["optimizer"], r["init"]) for r in rows},
    key=lambda c: (c[0] != "optax", len(c[1]), c[1]),
  )
  num_params = sum(x.size for x in jax.tree.leaves(params))
  print(
    f"{num_params:,} bf16 params (width {args.width}, depth {args.depth}),"
    f" fsdp over n CPU devices; {_common.cpu_name()}, "
    f"{datetime.date.today().isoformat()}, jax {jax.__version__}"
  )
  print("Optimizer state on the fullest device (share of the whole state):")
  print()
  print("| devices | " + " | ".join(f"{o} {w}" for o, w in columns) + " |")
  print("|---" * (len(columns) + 1) + "|")
  for n in counts:
    cells = []
    for o, w in columns:
      (row,) = [
        r
        for r in rows
        if (r["devices"], r["optimizer"], r["init"]) == (n, o, w)
      ]
      cells.append(_cell(row))
    print(f"| {n} | " + " | ".join(cells) + " |")
  times = {}
  if not args.no_time:
    times = {n: step_time(params, n, args.reps) for n in (1, most)}
    print()
    print(
      f"jaxmp train step (CPU, informational): 1 device "
      f"{1e3 * times[1]:.2f} ms, {most} devices (fsdp) "
      f"{1e3 * times[most]:.2f} ms"
    )
  (headline,) = [
    r
    for r in rows
    if (r["devices"], r["optimizer"], r["init"]) == (most, "jaxmp", "jit(init)")
  ]
  share = headline["most"] / headline["whole"]
  print(f"jaxmp_state_share_{most}_devices_jit_init: {share:.3f}")
  result = {"rows": rows, "step_seconds": times, "num_params": num_params}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f)
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
