"""ResNet18 (CIFAR) train-step throughput on one GPU: jaxmp O2 against the rest.

Run on the GPU machine: ``bash bench/gpu.sh`` (installs jmp/ml_collections
from ``bench/wheels`` if needed, then runs this file; under 8 minutes).
Check it on a CPU: ``python bench/gpu_bench.py --smoke`` (tiny model, one
window, ~1 minute).

Every entry trains the CIFAR ResNet18 (10 classes, BatchNorm in train mode,
softmax cross-entropy, SGD lr 0.1 momentum 0.9) on a random batch resident on
the device, for batch 128 and 512:

* ``jax O0 tf32``: fp32 params and compute, ``default_matmul_precision``
  ``tensorfloat32``; ``jax O0 fp32``: the same at ``highest`` (true fp32).
* ``jax O2 fp16``: fp16 params and compute, BatchNorm fp32,
  ``jaxmp.mixed_precision`` with fp32 masters and dynamic loss scaling
  (``jaxmp.scale_loss``, ``jaxmp.rollback_if_skipped``), as ``train.py``.
* ``jax bf16``: fp32 params, bf16 compute, BatchNorm fp32, no loss scaling.
* ``torch fp32``: eager, NCHW, cuDNN defaults (TF32 convolutions on).
* ``torch amp cl``: ``torch.autocast`` fp16, ``channels_last``, GradScaler.
* ``torch amp cl compile``: the same with ``torch.compile`` (inductor).

All use the same GPU in one process (JAX does not preallocate, so torch has
room). Every entry is compiled and warmed up first (not timed); then timed
windows of a fixed number of steps (about 0.4 s each) go round-robin over all
entries, so the ratios are measured side by side. Reported: median img/s over
the windows. A time guard skips entries (then windows) rather than overrun
``--budget_s`` (default 400 s). Last, if time is left and the app's data
packages are installed, a short timed run of ``train.py --config
configs/default.py`` on the synthetic data set (needs tensorflow_datasets and
array_record, not TensorFlow; otherwise "skipped").

Headlines (img/s ratios, > 1 means the first is faster), at batch 512:
``jax_o2_over_torch_amp_cl``, ``jax_o2_over_jax_fp32`` (fp32 = O0 with
TF32, JAX's GPU default), ``jax_o2_images_per_sec_b512``.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
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
from jaxmp.models import resnet18  # pylint: disable=g-import-not-at-top

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


def jax_maker(preset_name: str, precision: str, filters: int):
  """Returns ``make(batch) -> run(n)`` for a jaxmp preset at a precision."""
  preset = jaxmp.get_preset(preset_name)
  policy = preset.policy

  def make(batch):
    model = resnet18(
      num_classes=10,
      num_filters=filters,
      dtype=policy.compute_dtype,
      param_dtype=policy.param_dtype,
      norm_dtype=jnp.float32
      if preset.keep_batchnorm_fp32
      else policy.param_dtype,
    )
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
        logits, new_vars = model.apply(
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
      jstep = jax.jit(step, donate_argnums=(0,))
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


def torch_maker(amp: bool, compile_: bool, filters: int):
  """Returns ``make(batch) -> run(n)``: eager fp32, or AMP fp16 channels_last."""

  def make(batch):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    net = _torch_resnet.ResNet18(10, filters).to(dev)
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


def train_run(smoke: bool, timeout_s: float) -> str:
  """Runs ``train.py --config configs/default.py`` on synthetic data briefly."""
  for package in ("tensorflow_datasets", "array_record", "orbax"):
    if importlib.util.find_spec(package) is None:
      return f"skipped: {package} not installed"
  if timeout_s < 30:
    return "skipped: time guard"
  steps = 4 if smoke else 300
  overrides = [
    "--config.dataset=synthetic",
    f"--config.num_train_steps={steps}",
    "--config.num_epochs=1",
    "--config.progress_bar=False",
    "--config.synthetic_train_examples=10000",
    "--config.synthetic_test_examples=1000",
    "--config.data_on_device=True",
    "--config.log_every_steps=100",
  ]
  if smoke:
    overrides += [
      "--config.num_filters=8",
      "--config.batch_size=16",
      "--config.eval_batch_size=100",
      "--config.synthetic_train_examples=256",
      "--config.synthetic_test_examples=100",
    ]
  with tempfile.TemporaryDirectory() as workdir:
    cmd = [
      sys.executable,
      os.path.join(REPO, "train.py"),
      "--config",
      os.path.join(REPO, "configs", "default.py"),
      "--workdir",
      os.path.join(workdir, "run"),
    ] + overrides
    try:
      out = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
      )
    except subprocess.TimeoutExpired:
      return f"stopped by the time guard after {timeout_s:.0f} s"
    summary_path = os.path.join(workdir, "run", "summary.json")
    if out.returncode or not os.path.exists(summary_path):
      tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
      return f"failed (rc {out.returncode}): {tail[:100]}"
    with open(summary_path) as f:
      s = json.load(f)
  return (
    f"O2, {s['steps']} steps (batch {128 if not smoke else 16}) in "
    f"{s['wall_seconds']:.0f} s wall incl. data generation and "
    f"compile; test acc {s['test_accuracy']:.3f}"
  )


# ---------------------------------------------------------------------------


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--smoke",
    action="store_true",
    help="tiny model and batches, one window (CPU check)",
  )
  parser.add_argument("--budget_s", type=float, default=400.0)
  parser.add_argument("--windows", type=int, default=7)
  args = parser.parse_args()
  start = time.perf_counter()
  left = lambda: args.budget_s - (time.perf_counter() - start)

  smoke = args.smoke
  if smoke and torch is not None:
    # A shared small CPU: 2 OpenMP threads spin-wait behind XLA's threads
    # and slow torch down 10-50x; one thread keeps the smoke run short.
    torch.set_num_threads(1)
  filters = 8 if smoke else 64
  batches = (8, 16) if smoke else (128, 512)
  windows = 1 if smoke else args.windows
  window_s, min_steps = (0.0, 2) if smoke else (0.4, 5)
  big = batches[1]

  # Priority order: the headline entries first, torch.compile (slow to
  # build) last, so the time guard drops the least important.
  jax_rows = [
    ("jax O2 fp16", "O2", "default"),
    ("jax O0 tf32", "O0", "tensorfloat32"),
    ("jax O0 fp32", "O0", "highest"),
    ("jax bf16", "bf16", "default"),
  ]
  torch_rows = [
    ("torch amp cl", True, False),
    ("torch fp32", False, False),
    ("torch amp cl compile", True, True),
  ]
  entries = []
  for b in (big, batches[0]):
    for name, preset, prec in jax_rows:
      entries.append(Entry(name, b, jax_maker(preset, prec, filters)))
    for name, amp, comp in torch_rows[:2]:
      entries.append(
        Entry(name, b, torch_maker(amp, comp, filters) if torch else None)
      )
  for b in (big, batches[0]):
    name, amp, comp = torch_rows[2]
    entries.append(
      Entry(name, b, torch_maker(amp, comp, filters) if torch else None)
    )

  dev = jax.devices()[0]
  tdev = (
    torch.cuda.get_device_name(0)
    if torch and torch.cuda.is_available()
    else ("cpu" if torch else "none")
  )
  print(
    f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}); "
    f"torch {torch.__version__ if torch else 'not installed'} on {tdev}; "
    f"ResNet18 CIFAR {filters} filters{' [SMOKE]' if smoke else ''}",
    flush=True,
  )

  # Build (compile + warm-up), keeping ~25% of the budget for the windows.
  for e in entries:
    if e._make is None:  # pylint: disable=protected-access
      e.note = "skipped: torch not installed"
      continue
    reserve = 0.25 * args.budget_s + (60 if "compile" in e.name else 20)
    if not smoke and left() < reserve:
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

  # Timed windows, round-robin over everything built.
  ready = [e for e in entries if e.ready]
  for w in range(windows):
    if w >= 1 and left() < 0.12 * args.budget_s:
      print(f"  time guard: stopped after {w} windows", flush=True)
      break
    for e in ready:
      e.window()

  # Table.
  by = {(e.name, e.batch): e for e in entries}
  print()
  print(
    f"{'entry':<24}{'batch':>6}{'img/s':>10}{'steps/win':>10}"
    f"{'windows':>8}  note"
  )
  for e in entries:
    print(
      f"{e.name:<24}{e.batch:>6}{e.ips():>10.0f}{e.steps:>10}"
      f"{len(e.rates):>8}  {e.note}"
    )

  def ratio(a, b, batch):
    x, y = by[(a, batch)].ips(), by[(b, batch)].ips()
    return x / y if x == x and y == y and y > 0 else float("nan")

  print()
  print("speedups (img/s ratios, side by side in this run):")
  for b in batches:
    for a, ref in (
      ("jax O2 fp16", "jax O0 tf32"),
      ("jax O2 fp16", "jax O0 fp32"),
      ("jax bf16", "jax O0 tf32"),
      ("torch amp cl", "torch fp32"),
      ("jax O2 fp16", "torch amp cl"),
      ("jax O2 fp16", "torch amp cl compile"),
      ("jax O0 tf32", "torch fp32"),
    ):
      print(f"  b{b:<4} {a:>12} / {ref:<22}{ratio(a, ref, b):>7.2f}")

  print()
  # The smoke run ignores the guard here, to exercise this path too.
  msg = train_run(smoke, 300.0 if smoke else left() - 10)
  print(f"train.py configs/default.py on synthetic data: {msg}")
  print(f"total {time.perf_counter() - start:.0f} s")
  print(
    f"jax_o2_over_torch_amp_cl: {ratio('jax O2 fp16', 'torch amp cl', big):.2f}"
  )
  print(f"jax_o2_over_jax_fp32: {ratio('jax O2 fp16', 'jax O0 tf32', big):.2f}")
  print(f"jax_o2_images_per_sec_b{big}: {by[('jax O2 fp16', big)].ips():.0f}")


if __name__ == "__main__":
  main()
