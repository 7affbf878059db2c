"""A GPT-style byte LM trained FSDP-sharded, saved, and resumed on a new mesh.

The model is a small causal transformer over bytes, written in fp32 with no
precision code. Its params are bfloat16 (``--dtype``), sharded FSDP-style
over the ``fsdp`` axis of a ``("data", "fsdp")`` mesh (2 x 4 by default) and
the batch over both axes; `jaxmp.autocast` runs its matrix products in the
params' dtype and its softmax, LayerNorm statistics and loss in fp32, and
`jaxmp.mixed_precision` keeps fp32 masters of the params and AdamW's
moments in the optimizer state, each sharded like its param. The state is
built under ``jax.jit`` with out-shardings, the step is jitted with donated
params and state, spike skipping is on (`jaxmp.SpikeSkip`), and
orbax saves the run halfway and restores it onto another mesh (4 x 2) with
target shardings.

What it prints: per-device bytes of the params, the masters and the
optimizer state against their whole size; each step's loss on the mesh
beside the same model on one device; the restored state's fingerprint
against the saved one; and the restored run's losses beside those of the
same state resharded in memory (no checkpoint), which must be equal bit for
bit.

Flax linen rather than NNX: linen's ``nn.with_logical_partitioning`` boxes
the params with logical axis names (``nn.LogicallyPartitioned``), and
``nn.get_partition_spec`` with ``nn.logical_to_mesh_sharding`` turns those
names into the params' shardings: the route flax's own examples and MaxText
take to a sharded train state. The boxes pass through jaxmp's tree maps into
the masters and the moments; `jaxmp.state_shardings` gives the whole state's
shardings (the same as ``nn.get_partition_spec`` of the abstract state would)
for ``jax.jit(opt.init, out_shardings=...)`` and the orbax restore target.

Run (8 CPU devices are forced unless ``XLA_FLAGS`` already sets a count;
the corpus defaults to the repository's LICENSE)::

    python examples/sharded_lm.py
    python examples/sharded_lm.py --steps 200 --width 128 --depth 4
    python examples/sharded_lm.py --processes 2   # 2 processes x 4 devices
"""

import os

_COUNT = "--xla_force_host_platform_device_count"
if _COUNT not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_COUNT}=8"

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import functools
import json
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import optax
import orbax.checkpoint as ocp

import jaxmp

# The repository's LICENSE (this file's own bytes where it is missing).
CORPUS = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "..", "LICENSE"
)
if not os.path.exists(CORPUS):
  CORPUS = __file__

# Logical axis names -> mesh axes. Every weight has a dimension named
# "embed" or "hidden", both on "fsdp" (flax gives a mesh axis to the first
# name of a tensor that asks for it); the batch goes over all devices.
RULES = (
  ("batch", ("data", "fsdp")),
  ("embed", "fsdp"),
  ("hidden", "fsdp"),
  ("vocab", None),
  ("length", None),
)


def _dense(features: int, axes: tuple[str, str], name: str) -> nn.Dense:
  init = nn.initializers.lecun_normal()
  return nn.Dense(
    features,
    kernel_init=nn.with_logical_partitioning(init, axes),
    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
    name=name,
  )


def _layer_norm(name: str) -> nn.LayerNorm:
  return nn.LayerNorm(
    scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
    name=name,
  )


class Block(nn.Module):
  """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

  num_heads: int
  mesh: Optional[Mesh] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, width = x.shape
    head = width // self.num_heads
    h = _layer_norm("ln_attn")(x)
    qkv = _dense(3 * width, ("embed", "hidden"), "qkv")(h)
    q, k, v = jnp.split(
      qkv.reshape(batch, length, 3 * self.num_heads, head), 3, 2
    )
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head)
    causal = jnp.tril(jnp.ones((length, length), bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    attn = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape)
    x = x + _dense(width, ("hidden", "embed"), "proj")(attn)
    h = _layer_norm("ln_mlp")(x)
    h = nn.gelu(_dense(4 * width, ("embed", "hidden"), "mlp_in")(h))
    x = x + _dense(width, ("hidden", "embed"), "mlp_out")(h)
    # Activations split by batch over every device (no-op without a mesh).
    return nn.with_logical_constraint(
      x, ("batch", "length", "embed"), rules=RULES, mesh=self.mesh
    )


class ByteLM(nn.Module):
  """Embeddings of the 256 bytes and positions, blocks, a LayerNorm, logits."""

  width: int = 32
  depth: int = 2
  num_heads: int = 4
  max_len: int = 32
  mesh: Optional[Mesh] = None

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    normal = nn.initializers.normal(0.02)
    x = nn.Embed(
      256,
      self.width,
      embedding_init=nn.with_logical_partitioning(normal, ("vocab", "embed")),
      name="embed",
    )(tokens)
    pos = self.param(
      "pos",
      nn.with_logical_partitioning(normal, ("length", "embed")),
      (self.max_len, self.width),
    )
    x = x + pos[: tokens.shape[1]]
    for i in range(self.depth):
      x = Block(self.num_heads, self.mesh, name=f"block{i}")(x)
    x = _layer_norm("ln_out")(x)
    return _dense(256, ("embed", "vocab"), "head")(x)


def loss_fn(apply_fn, params, tokens):
  """Mean next-byte cross-entropy, written plainly (autocast keeps it fp32)."""
  logits = apply_fn({"params": params}, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def make_mesh(shape: Sequence[int], devices=None) -> Mesh:
  """A ``("data", "fsdp")`` mesh of ``shape`` over ``devices`` (all)."""
  return jax.make_mesh(
    tuple(shape),
    ("data", "fsdp"),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
    devices=devices,
  )


def param_shardings(abstract_params: Any, mesh: Mesh) -> Any:
  """The params' shardings: their logical axis names mapped by `RULES`."""
  return nn.logical_to_mesh_sharding(
    nn.get_partition_spec(abstract_params), mesh, RULES
  )


def _is_box(x) -> bool:
  return isinstance(x, nn.Partitioned)


def with_shardings(abstract: Any, sharding_tree: Any) -> Any:
  """``abstract`` (boxed) with each leaf a ShapeDtypeStruct with a sharding.

  ``sharding_tree`` has a sharding where ``abstract`` has a box (or a leaf),
  as `param_shardings` gives. The boxes stay, so that an orbax restore gives
  the saved tree's structure.
  """

  def one(a, s):
    if _is_box(a):
      return a.replace_boxed(
        jax.ShapeDtypeStruct(a.value.shape, a.value.dtype, sharding=s)
      )
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

  return jax.tree.map(one, abstract, sharding_tree, is_leaf=_is_box)


def make_optimizer(args) -> optax.GradientTransformation:
  """AdamW in `jaxmp.mixed_precision`: fp32 masters, the dtype's scaling."""
  dtype = jnp.dtype(args.dtype)
  preset = {"float16": "O1", "bfloat16": "bf16", "float32": "O0"}[dtype.name]
  return jaxmp.mixed_precision(
    optax.adamw(args.learning_rate, b2=0.95, weight_decay=0.1),
    loss_scale=jaxmp.get_preset(preset).loss_scale,
    skip_spikes=jaxmp.SpikeSkip(args.spike_window, args.spike_factor),
  )


def make_train_step(apply_fn, optimizer, param_sh, state_sh, batch_sh):
  """The jitted step: params and state donated, kept where they are."""

  def step(params, opt_state, tokens):
    # The loss unscaled, the gradients of loss * scale.
    loss, grads = jaxmp.value_and_grad(functools.partial(loss_fn, apply_fn))(
      params, opt_state, tokens
    )
    # Gradients where their params live: each device updates its shard of
    # every master (a replicated param's included) and gathers none.
    grads = jax.lax.with_sharding_constraint(grads, param_sh)
    updates, opt_state = optimizer.update(grads, opt_state, params, loss=loss)
    return optax.apply_updates(params, updates), opt_state, loss

  replicated = NamedSharding(batch_sh.mesh, P())
  return jax.jit(
    step,
    in_shardings=(param_sh, state_sh, batch_sh),
    out_shardings=(param_sh, state_sh, replicated),
    donate_argnums=(0, 1),
  )


def batches(data: np.ndarray, *, steps: int, batch: int, length: int, seed):
  """``steps`` batches of ``length + 1`` consecutive bytes, fixed by seed.

  Every process draws the same global batches (it reads only its own rows
  of each, in `place`).
  """
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    start = rng.integers(0, len(data) - length - 1, batch)
    yield np.stack([data[s : s + length + 1] for s in start]).astype(np.int32)


def place(tokens: np.ndarray, sharding) -> jax.Array:
  """The global batch as an array with ``sharding``, from local rows."""
  return jax.make_array_from_callback(
    tokens.shape, sharding, lambda index: tokens[index]
  )


def bytes_per_device(tree: Any) -> tuple[int, int]:
  """``(whole, on the first local device)`` bytes of the arrays of a tree."""
  device = jax.local_devices()[0]
  whole = on_device = 0
  for leaf in jax.tree.leaves(tree):
    whole += leaf.nbytes
    on_device += sum(
      s.data.nbytes for s in leaf.addressable_shards if s.device == device
    )
  return whole, on_device


@jax.jit
def fingerprint(tree: Any) -> jax.Array:
  """A uint32 hash of every bit of every leaf, the same under any sharding.

  Integer sums wrap and do not depend on the order of summation, so the
  same values give the same hash on any mesh and in any process.
  """
  total = jnp.uint32(0)
  for leaf in jax.tree.leaves(tree):
    if leaf.dtype == jnp.bool_:
      bits = leaf.astype(jnp.uint32)
    else:
      uint = jnp.dtype(f"uint{8 * leaf.dtype.itemsize}")
      bits = jax.lax.bitcast_convert_type(leaf, uint).astype(jnp.uint32)
    bits = bits.ravel()
    weights = 2 * jnp.arange(bits.size, dtype=jnp.uint32) + 1
    total = total * jnp.uint32(1000003) + jnp.sum(bits * weights)
  return total


def weights_fingerprint(params: Any, opt_state: Any) -> int:
  """The `fingerprint` of the params, the masters and the moments.

  The rest of the state counts steps and, for spike skipping, keeps the
  last losses: the mean of a loss over devices may differ in its last bit
  between two runs that add the devices' parts in another order.
  """
  weights = (params, opt_state.master_params, opt_state.inner_state)
  return _host(fingerprint(weights))


def _host(x: jax.Array) -> Any:
  """A replicated array's value (from this process's own copy)."""
  return np.asarray(x.addressable_data(0)).item()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(argv: Sequence[str], processes: int, workdir: str) -> int:
  """Runs this script as ``processes`` `jax.distributed` processes (local).

  Each process gets ``8 / processes`` CPU devices and the same arguments;
  process 0 prints. Returns the first nonzero exit code, or 0.
  """
  flags = [
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith(_COUNT)
  ]
  env = dict(
    os.environ,
    XLA_FLAGS=" ".join(flags + [f"{_COUNT}={8 // processes}"]),
    JAX_PLATFORMS="cpu",
  )
  coordinator = f"127.0.0.1:{_free_port()}"
  procs = [
    subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), *argv]
      + ["--workdir", workdir, "--coordinator", coordinator]
      + ["--num-processes", str(processes), "--process-id", str(i)],
      env=env,
    )
    for i in range(processes)
  ]
  codes = [p.wait() for p in procs]
  return next((c for c in codes if c), 0)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--text", default=CORPUS, help="corpus file (bytes)")
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--save-at", type=int, default=3, help="checkpoint step")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--length", type=int, default=32)
  parser.add_argument("--width", type=int, default=32)
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument(
    "--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32")
  )
  parser.add_argument("--mesh", default="2,4", help="data,fsdp of the run")
  parser.add_argument("--restore-mesh", default="4,2", help="data,fsdp")
  parser.add_argument("--spike-window", type=int, default=32)
  parser.add_argument("--spike-factor", type=float, default=6.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no-unsharded", action="store_true")
  parser.add_argument(
    "--no-resume", action="store_true", help="restore, but train no further"
  )
  parser.add_argument("--workdir", default="", help="checkpoints (temp dir)")
  parser.add_argument("--out", default="", help="write the results (JSON)")
  parser.add_argument("--processes", type=int, default=1)
  parser.add_argument("--coordinator", default="", help="host:port")
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  return parser.parse_args(argv)


class Trainer:
  """The model, its optimizer and its data; steps on any mesh (or none)."""

  def __init__(self, args: argparse.Namespace):
    self.args = args
    with open(args.text, "rb") as f:
      self.data = np.frombuffer(f.read(), np.uint8)
    self.model = ByteLM(args.width, args.depth, args.heads, args.length)
    self.dtype = jnp.dtype(args.dtype)
    self.optimizer = make_optimizer(args)
    self.key = jax.random.key(args.seed)
    # Boxed (nn.LogicallyPartitioned) trees of ShapeDtypeStructs.
    self.abstract_params = jax.eval_shape(self.init_params, self.key)
    self.abstract_state = jax.eval_shape(
      self.optimizer.init, self.abstract_params
    )

  def init_params(self, key: jax.Array) -> Any:
    """Params in the run's dtype, each still in its logical-axes box."""
    tokens = jnp.zeros((1, self.args.length), jnp.int32)
    params = self.model.init(key, tokens)["params"]
    return jax.tree.map(lambda x: x.astype(self.dtype), params)

  def on(self, mesh: Mesh) -> dict[str, Any]:
    """Shardings of params, state and batch, and the jitted step."""
    apply_fn = self.model.clone(mesh=mesh).apply
    if self.dtype != jnp.float32:
      apply_fn = jaxmp.autocast(apply_fn, self.dtype)
    params = param_shardings(self.abstract_params, mesh)
    # Each param-shaped leaf (master, moments) like its param, the rest
    # (loss scale, counters, spike windows) replicated. The same as flax's
    # nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_state)...).
    state = jaxmp.state_shardings(
      self.optimizer, with_shardings(self.abstract_params, params)
    )
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    step = make_train_step(apply_fn, self.optimizer, params, state, batch)
    return {"params": params, "state": state, "batch": batch, "step": step}

  def start(self, on: dict[str, Any]) -> tuple[Any, Any]:
    """Params and optimizer state built under jit where ``on`` says."""
    params = jax.jit(self.init_params, out_shardings=on["params"])(self.key)
    state = jax.jit(self.optimizer.init, out_shardings=on["state"])(params)
    return params, state

  def train(self, on, params, state, first: int, last: int):
    """Steps ``first..last`` (1-based); the losses fetched once at the end."""
    args = self.args
    every = batches(
      self.data,
      steps=last,
      batch=args.batch_size,
      length=args.length,
      seed=args.seed,
    )
    losses = []
    for i, tokens in enumerate(every, 1):
      if i >= first:
        tokens = place(tokens, on["batch"])
        params, state, loss = on["step"](params, state, tokens)
        losses.append(loss)
    return params, state, [_host(x) for x in losses]


def restore_target(trainer: Trainer, on: dict[str, Any]) -> dict[str, Any]:
  """The checkpoint's abstract tree with ``on``'s shardings (orbax target)."""
  return {
    "params": with_shardings(trainer.abstract_params, on["params"]),
    # state_shardings has the state's structure, boxes included.
    "opt_state": jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      trainer.abstract_state,
      on["state"],
    ),
  }


def _mesh(text: str) -> Mesh:
  return make_mesh([int(n) for n in text.split(",")])


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
  """Trains, saves, restores onto the other mesh; returns what it printed."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.processes > 1 and not args.coordinator:
    i = argv.index("--processes")
    rest = argv[:i] + argv[i + 2 :]
    workdir = args.workdir or tempfile.mkdtemp(prefix="sharded_lm_")
    code = launch(rest, args.processes, workdir)
    if not args.workdir:
      shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(code)
  if args.coordinator:
    jax.distributed.initialize(
      args.coordinator, args.num_processes, args.process_id
    )
  lead = jax.process_index() == 0
  say = print if lead else (lambda *a, **k: None)
  trainer = Trainer(args)
  mesh, other = _mesh(args.mesh), _mesh(args.restore_mesh)
  on, on_other = trainer.on(mesh), trainer.on(other)

  params, opt_state = trainer.start(on)
  weights = {"initial": weights_fingerprint(params, opt_state)}
  sizes = {
    "params": bytes_per_device(params),
    "masters": bytes_per_device(opt_state.master_params),
    "moments": bytes_per_device(opt_state.inner_state),
    "opt_state": bytes_per_device(opt_state),
  }
  say(
    f"mesh {dict(mesh.shape)}, {jax.process_count()} process(es), "
    f"{trainer.dtype.name} params, fp32 masters"
  )
  say(f"{'bytes':10s} {'whole':>9s} {'device 0':>9s}")
  for name, (whole, dev) in sizes.items():
    say(f"{name:10s} {whole:9d} {dev:9d}  ({dev / max(whole, 1):.3f})")

  # Train to the checkpoint and save; keep a copy moved to the other mesh in
  # memory (the step donates the state it is given).
  params, opt_state, losses = trainer.train(
    on, params, opt_state, 1, args.save_at
  )
  # orbax's default cuts each replicated array into one slice per replica
  # (an eager op compiled for each leaf on the first save): most of this
  # tiny run's time on CPU. Each array is written from one device instead.
  ocp.type_handlers.register_type_handler(
    jax.Array,
    ocp.type_handlers.ArrayHandler(use_replica_parallel=False),
    override=True,
  )
  workdir = args.workdir or tempfile.mkdtemp(prefix="sharded_lm_")
  path = os.path.join(workdir, f"step_{args.save_at}")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, {"params": params, "opt_state": opt_state})
  checkpointer.wait_until_finished()
  saved = _host(fingerprint((params, opt_state)))
  weights["saved"] = weights_fingerprint(params, opt_state)
  moved = None
  if not args.no_resume:
    moved = jax.jit(
      lambda tree: tree, out_shardings=(on_other["params"], on_other["state"])
    )((params, opt_state))
  params, opt_state, more = trainer.train(
    on, params, opt_state, args.save_at + 1, args.steps
  )
  losses += more
  weights["end"] = weights_fingerprint(params, opt_state)

  # Restore onto the other mesh: the targets carry its shardings.
  restored = checkpointer.restore(path, restore_target(trainer, on_other))
  checkpointer.close()
  if not args.workdir:
    shutil.rmtree(workdir, ignore_errors=True)
  restored_print = _host(
    fingerprint((restored["params"], restored["opt_state"]))
  )
  target = jax.tree.leaves(restore_target(trainer, on_other))
  placed = all(
    x.sharding.is_equivalent_to(t.sharding, x.ndim)
    for x, t in zip(jax.tree.leaves(restored), target)
  )
  ends, resumed = {}, {"checkpoint": [], "memory": []}
  runs = {
    "checkpoint": (restored["params"], restored["opt_state"]),
    "memory": moved,
  }
  for name, (p, s) in runs.items() if not args.no_resume else ():
    p, s, resumed[name] = trainer.train(
      on_other, p, s, args.save_at + 1, args.steps
    )
    ends[name] = _host(fingerprint((p, s)))
    weights[name] = weights_fingerprint(p, s)

  unsharded = []
  if lead and not args.no_unsharded:  # The same run on one device.
    on_one = trainer.on(make_mesh((1, 1), jax.local_devices()[:1]))
    p = jax.jit(trainer.init_params, out_shardings=on_one["params"])(
      trainer.key
    )
    s = trainer.optimizer.init(p)  # Eager: the state lands with the params.
    # Its scalars are left uncommitted on the device; committed like the
    # step's outputs, so that the step compiles once, not again at step 2.
    s = jax.device_put(s, on_one["state"])
    _, _, unsharded = trainer.train(on_one, p, s, 1, args.steps)

  say(
    f"step  mesh {args.mesh:8s} one device  restored on {args.restore_mesh}"
    "  moved in memory"
  )
  for i, loss in enumerate(losses):
    one = f"{unsharded[i]:.6f}" if unsharded else "-"
    j = i - args.save_at
    r = (
      f"{resumed['checkpoint'][j]:.6f}"
      if 0 <= j < len(resumed["checkpoint"])
      else ""
    )
    m = f"{resumed['memory'][j]:.6f}" if 0 <= j < len(resumed["memory"]) else ""
    say(f"{i + 1:4d}  {loss:.6f}      {one:10s}  {r:16s}  {m}".rstrip())
  say(
    f"state at step {args.save_at}: saved {saved:08x}, restored on "
    f"{args.restore_mesh} {restored_print:08x}, shardings "
    + ("as the targets" if placed else "NOT as the targets")
  )
  if ends:
    say(
      f"state at step {args.steps} on {args.restore_mesh}: from the "
      f"checkpoint {ends['checkpoint']:08x}, moved in memory "
      f"{ends['memory']:08x}"
    )
  stats = jaxmp.stats(opt_state)
  say(
    f"skipped steps {_host(stats['skipped_steps'])}, "
    f"spike skips {_host(stats['spike_skips'])}"
  )
  result = {
    "mesh": args.mesh,
    "restore_mesh": args.restore_mesh,
    "processes": jax.process_count(),
    "bytes": sizes,
    "losses": losses,
    "unsharded": unsharded,
    "resumed": resumed["checkpoint"],
    "in_memory": resumed["memory"],
    "weights_fingerprints": weights,
    "saved_fingerprint": saved,
    "restored_fingerprint": restored_print,
    "restored_placed": placed,
    "resumed_fingerprint": ends.get("checkpoint"),
    "in_memory_fingerprint": ends.get("memory"),
  }
  if args.out and lead:
    with open(args.out, "w") as f:
      json.dump(result, f)
  return result


if __name__ == "__main__":
  main()
