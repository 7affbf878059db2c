"""How each ``grad_reduce`` mode sums the gradients across 8 devices.

Run: ``python bench/grad_reduce.py`` (a few minutes on 2 CPU cores;
``--smoke`` for tiny models)

Two models trained O1-style (fp32 params under ``jaxmp.autocast``): the byte
LM of ``examples/byte_lm_autocast.py`` in bf16 and ``jaxmp.models.ResNet18``
(CIFAR stem) in fp16, each under data parallelism (a ``(8,)`` mesh, params
replicated) and FSDP (a ``(2, 4)`` mesh, each param split over ``fsdp`` on
its first axis that splits), on 8 forced CPU devices. For each mode
(``fp32``, ``half_wire``, ``native``):

* **bytes**: what one device sends in one train step (a jitted, pinned
  ``mixed_precision(sgd)`` step), read by `jaxmp.reduction_report` from the
  program as XLA's partitioner placed the collectives, and the share of it
  that sums gradients in half precision. Under FSDP it includes the
  forward's all-gathers of params, the same in every mode.
* **time**: the step's median time against ``native``'s, interleaved
  (CPU, informational: XLA:CPU computes half collectives in fp32).
* **ring error**: the gradients of each device's own batch slice (its fp32
  partials, computed slice by slice; for fp16 multiplied by the largest
  power of 2 that leaves every partial finite, as a dynamic loss scale
  would), summed as a GPU ring all-reduce would sum them in
  each mode -- ``native``: each partial rounded to the half dtype and every
  hop's add rounded to it; ``half_wire``: partials sent in half, adds in
  fp32, the sum rounded to half once for the gather; ``fp32``: fp32 all
  along -- against their fp64 sum: the largest relative error (norm-wise)
  over the leaves, and the elements that overflowed.

The last line is ``native_ring_error_over_fp32: X`` for the ResNet under
data parallelism.
"""

import os
import sys

_COUNT = "--xla_force_host_platform_device_count"
if _COUNT not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_COUNT}=8"

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import functools
import runpy
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp
from jaxmp import models

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

MODES = ("fp32", "half_wire", "native")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_models(smoke: bool):
  """{name: (loss(params, batch), params, batch, half dtype, loss scale)}."""
  rng = np.random.default_rng(0)
  lm_ns = runpy.run_path(os.path.join(ROOT, "examples", "byte_lm_autocast.py"))
  width, length, batch = (32, 16, 16) if smoke else (128, 64, 32)
  lm = lm_ns["ByteLM"](width=width, depth=1 if smoke else 2, num_heads=4)
  tokens = jnp.asarray(rng.integers(0, 256, (batch, length + 1)), jnp.int32)
  lm_params = lm.init(jax.random.key(0), tokens[:, :-1])["params"]
  lm_apply = jaxmp.autocast(lm.apply, jnp.bfloat16)

  def lm_loss(params, tokens, apply_fn=lm_apply):
    return lm_ns["loss_fn"](apply_fn, params, tokens)

  filters, image, rows = (4, 8, 16) if smoke else (16, 32, 32)
  net = models.resnet18(num_classes=10, num_filters=filters)
  images = jnp.asarray(rng.normal(size=(rows, image, image, 3)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, rows), jnp.int32)
  variables = net.init(jax.random.key(1), images, train=False)

  def resnet_loss(params, batch, apply_fn=None):
    apply_fn = apply_fn or jaxmp.autocast(net.apply, jnp.float16)
    x, y = batch
    logits, _ = apply_fn(
      {"params": params, "batch_stats": variables["batch_stats"]},
      x,
      train=True,
      mutable=["batch_stats"],
    )
    return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), y
    ).mean()

  return {
    "byte LM (bf16)": (lm_loss, lm_params, tokens, jnp.bfloat16, 1.0, lm),
    "ResNet18 (fp16)": (
      resnet_loss,
      variables["params"],
      (images, labels),
      jnp.float16,
      2.0**15,
      net,
    ),
  }


def mesh_of(kind: str):
  auto = AxisType.Auto
  if kind == "DP":
    return jax.make_mesh((8,), ("data",), axis_types=(auto,)), ("data",)
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(auto, auto))
  return mesh, ("data", "fsdp")


def param_spec(x, kind: str) -> P:
  if kind == "DP":
    return P()
  for axis, size in enumerate(x.shape):
    if size % 4 == 0:
      return P(*([None] * axis + ["fsdp"]))
  return P()


def autocast_loss(loss, name, model, mode):
  """``loss`` with its model's forward under autocast with ``mode``."""
  if name.startswith("byte"):
    apply_fn = jaxmp.autocast(model.apply, jnp.bfloat16, grad_reduce=mode)
  else:
    apply_fn = jaxmp.autocast(model.apply, jnp.float16, grad_reduce=mode)
  return functools.partial(loss, apply_fn=apply_fn)


def make_step(loss, opt, shardings):
  param_sh, state_sh, batch_sh = shardings

  @functools.partial(
    jax.jit,
    in_shardings=(param_sh, state_sh, batch_sh),
    out_shardings=(param_sh, state_sh),
  )
  def step(params, state, batch):
    _, grads = jaxmp.value_and_grad(loss)(params, state, batch)
    grads = jax.lax.with_sharding_constraint(grads, param_sh)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def local_partials(loss, params, batch, n, scale):
  """Each device's fp32 gradient of its slice of the batch, stacked.

  The slices are the rows each of the ``n`` devices holds (the batch is
  split on its first axis over all of them); each slice's gradient is
  computed on one device, as that device computes its partial.
  """
  grad = jax.jit(jax.grad(loss))
  slices = [
    jax.tree.map(lambda a, i=i: np.array_split(np.asarray(a), n)[i], batch)
    for i in range(n)
  ]
  parts = [jax.device_get(grad(params, b)) for b in slices]
  stacked = jax.tree.map(lambda *g: np.stack(g), *parts)
  if scale is None:  # fp16: the largest power of 2 that no partial overflows
    top = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(stacked))
    scale = 2.0 ** np.floor(np.log2(float(jnp.finfo(jnp.float16).max) / top))
  return jax.tree.map(lambda g: g * scale, stacked), scale


def ring_sum(partials: np.ndarray, mode: str, half) -> np.ndarray:
  """The sum of ``partials`` (n, ...) as a ring all-reduce adds them.

  The buffer is split in n chunks; chunk c starts at device c + 1 and each
  hop adds the next device's partial to what it received, in the wire
  dtype (native), in fp32 (fp32), or in fp32 after the half partials were
  sent (half_wire, whose chunk is rounded to half once for the gather).
  """
  n = partials.shape[0]
  flat = partials.reshape(n, -1).astype(np.float32)
  if mode != "fp32":
    flat = flat.astype(half).astype(np.float32)  # Sent in half.
  out = np.empty(flat.shape[1], np.float32)
  for c, idx in enumerate(np.array_split(np.arange(flat.shape[1]), n)):
    acc = flat[(c + 1) % n, idx]
    for hop in range(2, n + 1):
      acc = acc + flat[(c + hop) % n, idx]
      if mode == "native":
        acc = acc.astype(half).astype(np.float32)
    if mode == "half_wire":
      acc = acc.astype(half).astype(np.float32)
    out[idx] = acc
  return out.reshape(partials.shape[1:])


def ring_errors(partials, half):
  """{mode: (largest relative error over leaves, overflowed elements)}."""
  out = {}
  leaves = jax.tree.leaves(partials)
  for mode in MODES:
    worst, overflow = 0.0, 0
    for p in leaves:
      exact = p.astype(np.float64).sum(0)
      with np.errstate(over="ignore", invalid="ignore"):
        got = ring_sum(np.asarray(p), mode, half).astype(np.float64)
      bad = ~np.isfinite(got)
      overflow += int(bad.sum())
      norm = np.linalg.norm(exact)
      if norm > 0:
        err = np.linalg.norm(np.where(bad, 0.0, got - exact)) / norm
        worst = max(worst, float(err))
    out[mode] = (worst, overflow)
  return out


def run_case(name, spec, kind, reps):
  loss, params, batch, half, scale, model = spec
  mesh, axes = mesh_of(kind)
  param_sh = jax.tree.map(
    lambda x: NamedSharding(mesh, param_spec(x, kind)), params
  )
  batch_sh = jax.tree.map(lambda _: NamedSharding(mesh, P(axes)), batch)
  params = jax.device_put(params, param_sh)
  batch = jax.device_put(batch, batch_sh)
  opt = jaxmp.mixed_precision(optax.sgd(1e-3), loss_scale=scale)
  state_sh = jaxmp.state_shardings(opt, params)
  state = jax.jit(opt.init, out_shardings=state_sh)(params)
  rows, steps = {}, {}
  with jax.set_mesh(mesh):
    for mode in MODES:
      step = make_step(
        autocast_loss(loss, name, model, mode),
        opt,
        (param_sh, state_sh, batch_sh),
      )
      report = jaxmp.reduction_report(step, params, state, batch)
      half_sums = sum(
        r.bytes_sent for r in report.sums() if r.dtype in ("f16", "bf16")
      )
      rows[mode] = [report.bytes_sent, half_sums]
      steps[mode] = step
      jax.block_until_ready(step(params, state, batch))  # Compile, warm.
    times = {m: [] for m in MODES}
    for _ in range(reps):
      for mode in MODES:
        start = time.perf_counter()
        jax.block_until_ready(steps[mode](params, state, batch))
        times[mode].append(time.perf_counter() - start)
  native = statistics.median(times["native"])
  for mode in MODES:
    rows[mode].append(statistics.median(times[mode]) / native)
  partials, ring_scale = local_partials(
    autocast_loss(loss, name, model, "fp32"),
    jax.device_get(params),
    jax.device_get(batch),
    len(jax.devices()),
    None if half == jnp.float16 else 1.0,
  )
  errors = ring_errors(partials, half)
  for mode in MODES:
    rows[mode] += list(errors[mode]) + [ring_scale]
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny models")
  parser.add_argument("--reps", type=int, default=5)
  args = parser.parse_args()
  print(f"{_common.date_line('grad_reduce')}, {len(jax.devices())} devices")
  print(
    "| model | mesh | grad_reduce | bytes sent / step / device | of it half"
    " sums | step time vs native | ring error vs fp64 | overflowed |"
  )
  print("|---|---|---|---|---|---|---|---|")
  last = None
  for name, spec in make_models(args.smoke).items():
    for kind in ("DP", "FSDP"):
      rows = run_case(name, spec, kind, args.reps)
      for mode in MODES:
        sent, half, ratio, err, over, ring_scale = rows[mode]
        print(
          f"| {name} | {kind} | `{mode}` | {sent:,.0f} | {half:,.0f} | "
          f"{ratio:.2f} | {err:.1e} | {over} (x{ring_scale:g}) |"
        )
      if name.startswith("ResNet") and kind == "DP":
        last = rows["native"][3] / max(rows["fp32"][3], 1e-30)
  print(f"native_ring_error_over_fp32: {last:.1f}")


if __name__ == "__main__":
  main()
