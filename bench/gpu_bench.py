"""ResNet18 train steps and the seed's job on one GPU: jaxmp against PyTorch.

Run on the GPU machine: ``bash bench/gpu.sh`` (installs the app's missing
packages offline from ``bench/gpu_wheels/``, then runs this file; under 9
minutes). Check it on a CPU: ``bash bench/gpu.sh --smoke`` (tiny sizes,
the one-block net; a few minutes).

Step rows: both ResNet18s of ``jaxmp.models`` (``resnet18``, the CIFAR
stem, and ``resnet18_torchvision``, the ImageNet stem that the seed's job
trains), 10 classes, BatchNorm in train mode, softmax cross-entropy, SGD lr
0.1 momentum 0.9, on a random batch resident on the device, batches 128 and
512:

* ``jax O1``: fp32 params, ``jaxmp.autocast`` float16 (the app's O1),
  dynamic loss scaling;
* ``jax O2``: fp16 params and compute, BatchNorm fp32, fp32 masters and
  dynamic loss scaling;
* ``jax O0 tf32``: fp32 at ``default_matmul_precision("tensorfloat32")``;
* ``jax bf16``: fp32 params, bf16 compute, BatchNorm fp32;
* ``torch amp cl``: eager, ``torch.autocast`` fp16, ``channels_last``,
  GradScaler; ``torch amp cl compile``: the same under ``torch.compile``.

Every entry is compiled and warmed up first (not timed); then timed windows
of about 0.4 s go round-robin over all entries, so that the ratios are
measured side by side; reported: the median img/s over the windows. A time
guard skips entries rather than overrun ``--budget_s``.

Then the seed's job (``bench/seed_job.py``): the app's ``configs/seed.py`` on
synthetic CIFAR-shaped data (``--data_dir``: an image folder) for
``--epochs`` epochs with a cold and a warm compile cache, and the seed's
PyTorch script with torch.amp on the same images. Last, the byte LM of
``bench/fp8.py`` at width 4096: its train step under bf16 autocast and
under fp8 autocast (current scaling), timed in interleaved pairs.

The table, then the headline lines (ratios > 1: the first is faster or
longer, as named):

* ``seed_job_wall_over_torch_script``: the app's wall time over the script's
  (warm cache; the cold one in brackets);
* ``seed_job_first_step_s``: seconds from start to the app's first step
  (warm; cold and the script's in brackets);
* ``app_over_step_b128``: the app's steady img/s over the bare step of its
  model (``resnet18_torchvision`` O1 at batch 128);
* ``jax_o1_over_torch_amp_cl_b128``: CIFAR-stem ResNet18, O1 over torch AMP
  channels_last, batch 128;
* ``fp8_over_bf16_step``: the byte LM of ``bench/fp8.py`` (width 4096, depth
  2, batch 8, length 512), its train step under ``jaxmp.autocast(...,
  fp8=True)`` (per-tensor current scaling) against bf16 autocast, timed
  interleaved in this run: steps per second, fp8 over bf16 (the median of
  the per-pair ratios; above 1, fp8 is faster; goal on Hopper: >= 1.3).

Everything goes to a JSON file too (``--json``, default ``gpu_bench.json``).
With ``--smoke`` the models have one block and 8 filters, the batches are
16 and 128, the byte LM's width is 128 (depth 1, length 64, batch 4), and
``app_over_step_b128`` is the CPU goal: the app's steady rate over its bare
step on the one-block net. On a CPU fp8 is emulated, so there
``fp8_over_bf16_step`` only shows that the path runs.
"""

import argparse
import json
import os
import statistics
import sys
import time

# Let torch share the GPU: no 75% preallocation by JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import optax  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxmp  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxmp.models import get_model  # pylint: disable=g-import-not-at-top
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

try:
  import torch  # pylint: disable=g-import-not-at-top
  import _torch_resnet  # pylint: disable=g-import-not-at-top
except ImportError:
  torch = None


class Entry:
  """One thing to time: ``build()`` compiles and warms up, ``window()`` times.

  Attributes:
    name: row label.
    batch: images per step.
    steps: steps per timed window (set by ``build``).
    rates: img/s of each timed window.
    note: why it was skipped or failed, if it was.
  """

  def __init__(self, name, batch, make):
    self.name, self.batch, self._make = name, batch, make
    self.steps, self.rates, self.note = 0, [], ""
    self._run = None

  def build(self, window_s: float, min_steps: int):
    run = self._make(self.batch)
    run(2)  # Compile and first touches.
    t = time.perf_counter()
    run(3)
    per_step = (time.perf_counter() - t) / 3
    self.steps = max(min_steps, int(window_s / max(per_step, 1e-6)))
    self._run = run

  def window(self):
    t = time.perf_counter()
    self._run(self.steps)
    self.rates.append(self.steps * self.batch / (time.perf_counter() - t))

  @property
  def ready(self):
    return self._run is not None

  def ips(self):
    return statistics.median(self.rates) if self.rates else float("nan")


# ---------------------------------------------------------------------------
# JAX.
# ---------------------------------------------------------------------------


def jax_maker(
  arch: str, preset_name: str, precision: str, filters: int, one_block: bool
):
  """Returns ``make(batch) -> run(n)`` for a jaxmp preset at a precision."""
  preset = jaxmp.get_preset(preset_name)
  policy = preset.policy

  def make(batch):
    model = get_model(
      arch,
      num_classes=10,
      num_filters=filters,
      dtype=policy.compute_dtype,
      param_dtype=policy.param_dtype,
      norm_dtype=jnp.float32
      if preset.keep_batchnorm_fp32
      else policy.param_dtype,
    )
    if one_block:
      model = model.clone(stage_sizes=(1,))
    apply = model.apply
    if preset.autocast is not None:  # O1: the fp32 model under autocast.
      apply = jaxmp.autocast(model.apply, preset.autocast)
    opt = jaxmp.mixed_precision(
      optax.sgd(0.1, momentum=0.9),
      loss_scale=preset.loss_scale,
      master_weights=preset.master_weights,
    )
    rng = np.random.default_rng(0)
    images = jax.device_put(rng.standard_normal((batch, 32, 32, 3), np.float32))
    labels = jax.device_put(rng.integers(0, 10, batch).astype(np.int32))
    with jax.default_matmul_precision(precision):
      variables = jax.jit(lambda k: model.init(k, images[:1], train=False))(
        jax.random.key(0)
      )

    def step(state, images, labels):
      images = images.astype(policy.compute_dtype)

      def loss_fn(params):
        logits, new_vars = apply(
          {"params": params, "batch_stats": state["batch_stats"]},
          images,
          train=True,
          mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), labels
        ).mean()
        return jaxmp.scale_loss(loss, state["opt"]), new_vars["batch_stats"]

      grads, stats = jax.grad(loss_fn, has_aux=True)(state["params"])
      updates, opt_state = opt.update(grads, state["opt"], state["params"])
      stats = jaxmp.rollback_if_skipped(opt_state, stats, state["batch_stats"])
      return {
        "params": optax.apply_updates(state["params"], updates),
        "batch_stats": stats,
        "opt": opt_state,
      }

    with jax.default_matmul_precision(precision):
      # As the app compiles its step (on a GPU: no options).
      jstep = jax.jit(
        step,
        donate_argnums=(0,),
        compiler_options=jaxmp.cpu_compiler_options() or None,
      )
    holder = {
      "s": {
        "params": variables["params"],
        "batch_stats": variables["batch_stats"],
        "opt": opt.init(variables["params"]),
      }
    }

    def run(n):
      s = holder["s"]
      with jax.default_matmul_precision(precision):
        for _ in range(n):
          s = jstep(s, images, labels)
      jax.block_until_ready(s)
      holder["s"] = s

    return run

  return make


# ---------------------------------------------------------------------------
# PyTorch.
# ---------------------------------------------------------------------------


def torch_maker(
  arch: str, amp: bool, compile_: bool, filters: int, one_block: bool
):
  """Returns ``make(batch) -> run(n)``: eager fp32, or AMP fp16 channels_last."""

  def make(batch):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    if arch == "resnet18":
      net = _torch_resnet.ResNet18(10, filters)
      if one_block:
        net.layers = net.layers[:1]
        net.fc = torch.nn.Linear(filters, 10)
    else:
      net = _torch_resnet.TorchvisionResNet18(10, filters)
      if one_block:
        net.layer1 = net.layer1[:1]
        for i in (2, 3, 4):
          setattr(net, f"layer{i}", torch.nn.Identity())
        net.fc = torch.nn.Linear(filters, 10)
    net = net.to(dev)
    images = torch.randn(batch, 3, 32, 32, device=dev)
    labels = torch.randint(0, 10, (batch,), device=dev)
    if amp:
      net = net.to(memory_format=torch.channels_last)
      images = images.contiguous(memory_format=torch.channels_last)
    net.train()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler(dev, enabled=amp)
    loss_f = torch.nn.CrossEntropyLoss()
    # inductor on the GPU; "eager" on a CPU smoke run (no C++ toolchain).
    model = (
      torch.compile(net, backend="inductor" if dev == "cuda" else "eager")
      if compile_
      else net
    )

    def one():
      sgd.zero_grad(set_to_none=True)
      with torch.autocast(dev, dtype=torch.float16, enabled=amp):
        loss = loss_f(model(images), labels)
      scaler.scale(loss).backward()
      scaler.step(sgd)
      scaler.update()

    def run(n):
      for _ in range(n):
        one()
      if dev == "cuda":
        torch.cuda.synchronize()

    return run

  return make


# ---------------------------------------------------------------------------
# The optional training run.
# ---------------------------------------------------------------------------


MODELS = (("resnet18", "cifar"), ("resnet18_torchvision", "tv"))
JAX_ROWS = (
  ("jax O1", "O1", "default"),
  ("jax O2", "O2", "default"),
  ("jax O0 tf32", "O0", "tensorfloat32"),
  ("jax bf16", "bf16", "default"),
)
TORCH_ROWS = (("torch amp cl", False), ("torch amp cl compile", True))


def entries_of(batches, filters, one_block):
  """Every step row, the headline ones first (the time guard drops last)."""
  first, rest = [], []
  for b in batches:
    for arch, short in MODELS:
      for name, preset, prec in JAX_ROWS:
        e = Entry(
          f"{short} {name}",
          b,
          jax_maker(arch, preset, prec, filters, one_block),
        )
        (first if name == "jax O1" and b == 128 else rest).append(e)
      for name, comp in TORCH_ROWS:
        make = (
          torch_maker(arch, True, comp, filters, one_block) if torch else None
        )
        e = Entry(f"{short} {name}", b, make)
        (first if not comp and b == 128 else rest).append(e)
  # Compiled torch last: slow to build, and not a headline.
  rest.sort(key=lambda e: "compile" in e.name)
  return first + rest


def nan_ratio(x, y):
  return x / y if x == x and y == y and y > 0 else float("nan")


def fp8_lm(smoke: bool) -> dict:
  """The byte LM's train step, bf16 against fp8 autocast, side by side.

  ``bench/fp8.py``'s `bench_width`: both steps jitted and warmed up, then
  timed in interleaved pairs (bf16, fp8, ...) on the same batch.

  Args:
    smoke: tiny sizes for a CPU (width 128, depth 1, length 64, batch 4, 5
      pairs) in place of width 4096, depth 2, length 512, batch 8, 10 pairs.

  Returns:
    ``{"width", "depth", "batch", "length", "pairs", "bf16_ms", "fp8_ms",
    "fp8_over_bf16_step"}``, the last the median of the per-pair step-time
    ratios bf16 / fp8 (steps per second, fp8 over bf16); or ``{"error"}``.
  """
  import fp8 as fp8_bench  # pylint: disable=g-import-not-at-top

  sizes = argparse.Namespace(
    depth=1 if smoke else 2,
    batch_size=4 if smoke else 8,
    length=64 if smoke else 512,
    steps=5 if smoke else 10,
  )
  width = 128 if smoke else 4096
  try:
    bf16_s, fp8_s, ratio = fp8_bench.bench_width(width, sizes)
  except Exception as ex:  # pylint: disable=broad-except
    return {"error": f"{type(ex).__name__}: {str(ex).splitlines()[0][:200]}"}
  return {
    "width": width,
    "depth": sizes.depth,
    "batch": sizes.batch_size,
    "length": sizes.length,
    "pairs": sizes.steps,
    "bf16_ms": 1e3 * bf16_s,
    "fp8_ms": 1e3 * fp8_s,
    "fp8_over_bf16_step": ratio,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--smoke",
    action="store_true",
    help="one-block nets, 8 filters, small data, one window (a CPU check)",
  )
  parser.add_argument("--budget_s", type=float, default=0.0)
  parser.add_argument("--windows", type=int, default=7)
  parser.add_argument(
    "--data_dir", default="", help="an image folder, or its .tar.xz (seed_job)"
  )
  parser.add_argument("--epochs", type=int, default=0, help="seed job epochs")
  parser.add_argument("--json", default="gpu_bench.json")
  args = parser.parse_args()
  start = time.perf_counter()
  smoke = args.smoke
  # Default: 8 minutes in all, 5 of them for the step rows; the byte LM's
  # fp8 rows come after (under a minute on a GPU).
  budget = args.budget_s or (330.0 if smoke else 470.0)
  steps_budget = 0.35 * budget if smoke else 290.0
  left = lambda: budget - (time.perf_counter() - start)
  used = lambda: time.perf_counter() - start

  # Compiled programs persist between runs of the bench (as the app's do).
  cache = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
    "jaxmp",
    "bench-jit",
  )
  jax.config.update("jax_compilation_cache_dir", cache)

  if smoke and torch is not None:
    # A shared small CPU: 2 OpenMP threads spin-wait behind XLA's threads
    # and slow torch down 10-50x; one thread keeps the smoke run short.
    torch.set_num_threads(1)
  filters = 8 if smoke else 64
  batches = (16, 128) if smoke else (128, 512)
  # Smoke: three windows before the app's run and three after it, so that
  # the bare step's median spans about as long as the app's epochs.
  windows = 3 if smoke else args.windows
  window_s, min_steps = (0.2, 3) if smoke else (0.4, 5)
  entries = entries_of(batches, filters, one_block=smoke)

  dev = jax.devices()[0]
  tdev = (
    torch.cuda.get_device_name(0)
    if torch and torch.cuda.is_available()
    else ("cpu" if torch else "none")
  )
  header = (
    f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}); "
    f"torch {torch.__version__ if torch else 'not installed'} on {tdev}; "
    f"ResNet18s with {filters} filters"
    f"{', one block [SMOKE]' if smoke else ''}"
  )
  print(_common.date_line("gpu_bench"), flush=True)
  print(header, flush=True)

  for e in entries:
    if e._make is None:  # pylint: disable=protected-access
      e.note = "skipped: torch not installed"
      continue
    reserve = 0.2 * steps_budget + (40 if "compile" in e.name else 10)
    if used() > steps_budget - reserve:
      e.note = "skipped: time guard"
      continue
    t = time.perf_counter()
    try:
      e.build(window_s, min_steps)
      print(
        f"  built {e.name} b{e.batch} in {time.perf_counter() - t:.0f} s"
        f" ({e.steps} steps/window)",
        flush=True,
      )
    except Exception as ex:  # pylint: disable=broad-except
      e.note = f"failed: {type(ex).__name__}: {str(ex).splitlines()[0][:60]}"
      print(f"  {e.name} b{e.batch}: {e.note}", flush=True)

  ready = [e for e in entries if e.ready]
  for w in range(windows):
    if w >= 1 and used() > steps_budget:
      print(f"  time guard: stopped after {w} windows", flush=True)
      break
    for e in ready:
      e.window()
  steps_s = used()

  # The seed's job: the app, cold and warm, and the seed's script.
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import seed_job  # pylint: disable=g-import-not-at-top

  job_args = seed_job.complete(
    seed_job.parser().parse_args(
      (["--smoke"] if smoke else [])
      + (["--data_dir", args.data_dir] if args.data_dir else [])
      + (["--epochs", str(args.epochs)] if args.epochs else [])
    )
  )
  try:
    job = seed_job.run(job_args, timeout=max(left(), 60.0))
  except Exception as ex:  # pylint: disable=broad-except
    job = {"error": f"{type(ex).__name__}: {str(ex)[:300]}"}
    print(f"  seed job failed: {job['error']}", flush=True)

  if smoke:  # The bare steps again after the app: both sides of its run.
    for _ in range(windows):
      for e in ready:
        e.window()

  # The byte LM, bf16 against fp8 autocast (current scaling).
  t = time.perf_counter()
  lm = fp8_lm(smoke)
  print(f"  byte LM bf16 / fp8 in {time.perf_counter() - t:.0f} s", flush=True)

  by = {(e.name, e.batch): e for e in entries}
  print()
  print(header)
  print(
    f"{'entry':<28}{'batch':>6}{'img/s':>10}{'steps/win':>10}"
    f"{'windows':>8}  note"
  )
  for e in entries:
    print(
      f"{e.name:<28}{e.batch:>6}{e.ips():>10.0f}{e.steps:>10}"
      f"{len(e.rates):>8}  {e.note}"
    )
  ips = lambda name, b: by[(name, b)].ips()
  print()
  print("ratios (img/s, side by side in this run):")
  for b in batches:
    for short in ("cifar", "tv"):
      for x, y in (
        ("jax O1", "torch amp cl"),
        ("jax O1", "torch amp cl compile"),
        ("jax O2", "jax O1"),
        ("jax O1", "jax O0 tf32"),
        ("jax bf16", "jax O1"),
      ):
        r = nan_ratio(ips(f"{short} {x}", b), ips(f"{short} {y}", b))
        print(f"  b{b:<4}{short:<6}{x:>8} / {y:<22}{r:>7.2f}")
  print()
  nan = float("nan")
  no_torch = {
    "process_wall_s": nan,
    "first_step_s": nan,
    "steady_images_per_sec": nan,
    "test_accuracy": nan,
  }
  if "error" not in job:
    cold, warm = job["cold"], job["warm"]
    ts = job["torch"] if "error" not in job["torch"] else no_torch
    print(
      f"seed job ({job['data']}, {job['epochs']} epochs, data prepared in "
      f"{job['prepare_s']:.1f} s, not counted):"
    )
    print(
      f"{'run':<26}{'wall s':>8}{'first step s':>14}{'steady img/s':>14}"
      f"{'test acc':>10}"
    )
    for name, r, wall in (
      ("app, cold compile cache", cold, cold["wall_s"]),
      ("app, warm compile cache", warm, warm["wall_s"]),
      ("torch script (torch.amp)", ts, ts["process_wall_s"]),
    ):
      print(
        f"{name:<26}{wall:>8.1f}{r['first_step_s']:>14.1f}"
        f"{r['steady_images_per_sec']:>14.0f}{r['test_accuracy']:>10.4f}"
      )
    wall_warm = nan_ratio(warm["wall_s"], ts["process_wall_s"])
    wall_cold = nan_ratio(cold["wall_s"], ts["process_wall_s"])
    first = (warm["first_step_s"], cold["first_step_s"], ts["first_step_s"])
    app_step = nan_ratio(warm["steady_images_per_sec"], ips("tv jax O1", 128))
  else:
    wall_warm = wall_cold = app_step = float("nan")
    first = (float("nan"),) * 3
  o1_torch = nan_ratio(ips("cifar jax O1", 128), ips("cifar torch amp cl", 128))
  if "error" in lm:
    print(f"byte LM, bf16 against fp8 autocast: failed: {lm['error']}")
    fp8_ratio = float("nan")
  else:
    print(
      f"byte LM (width {lm['width']}, depth {lm['depth']}, batch "
      f"{lm['batch']}, length {lm['length']}), {lm['pairs']} interleaved "
      f"pairs: bf16 step {lm['bf16_ms']:.1f} ms, fp8 autocast (current "
      f"scaling) {lm['fp8_ms']:.1f} ms"
    )
    fp8_ratio = lm["fp8_over_bf16_step"]
  total = used()
  print(f"total {total:.0f} s (step rows {steps_s:.0f} s)")
  print(
    f"seed_job_wall_over_torch_script: {wall_warm:.2f} (warm cache; "
    f"cold {wall_cold:.2f})"
  )
  print(
    f"seed_job_first_step_s: {first[0]:.1f} (warm cache; cold {first[1]:.1f}; "
    f"torch script {first[2]:.1f}; over the script's: warm "
    f"{nan_ratio(first[0], first[2]):.2f}, cold "
    f"{nan_ratio(first[1], first[2]):.2f})"
  )
  print(
    f"app_over_step_b128: {app_step:.2f} (the seed job's steady img/s over "
    f"its model's bare step{', one-block net: the CPU goal' if smoke else ''})"
  )
  print(f"jax_o1_over_torch_amp_cl_b128: {o1_torch:.2f}")
  print(
    f"fp8_over_bf16_step: {fp8_ratio:.2f} (the byte LM's steps/s, fp8 "
    f"autocast over bf16{'; fp8 emulated on a CPU' if smoke else ''})"
  )
  record = {
    "header": header,
    "smoke": smoke,
    "steps": [
      {
        "entry": e.name,
        "batch": e.batch,
        "images_per_sec": e.ips(),
        "windows": len(e.rates),
        "note": e.note,
      }
      for e in entries
    ],
    "seed_job": job,
    "fp8_lm": lm,
    "headlines": {
      "seed_job_wall_over_torch_script": wall_warm,
      "seed_job_wall_over_torch_script_cold": wall_cold,
      "seed_job_first_step_s": first[0],
      "seed_job_first_step_s_cold": first[1],
      "torch_script_first_step_s": first[2],
      "app_over_step_b128": app_step,
      "jax_o1_over_torch_amp_cl_b128": o1_torch,
      "fp8_over_bf16_step": fp8_ratio,
    },
    "total_s": total,
  }
  with open(args.json, "w") as f:
    json.dump(record, f, indent=1, default=float)
  print(f"(written to {args.json})")


if __name__ == "__main__":
  main()
