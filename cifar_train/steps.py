"""Train state, model and optimizer factories, and the jitted steps.

Every function takes explicit values (see `settings.Settings`), never the
config. The train step keeps its metrics on the device, so the loop fetches
nothing per step.
"""

import functools
import hashlib
import os
import pickle
import re
import zipfile
from typing import Any, Callable, Optional, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp
from jaxmp import models
from cifar_train import faults as faults_lib
from cifar_train import mesh
from cifar_train.errors import ConfigError
from cifar_train.settings import Precision


@flax.struct.dataclass
class TrainState:
  """Everything that decides the future of a run.

  Attributes:
    step: number of optimizer steps taken.
    params: model params, in the preset's param dtype.
    batch_stats: BatchNorm running statistics (fp32 unless O3).
    opt_state: optimizer state, including jaxmp's masters and loss scale.
    rng: the data/augmentation key of the run.
  """

  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: Any
  rng: jax.Array


class AutocastModel:
  """A Flax model whose ``apply`` runs under `jaxmp.autocast` (Apex O1).

  ``init`` and every other attribute are the model's own.
  """

  def __init__(
    self,
    model: models.ResNet,
    dtype: Any,
    debug: bool = False,
    grad_reduce: str = "fp32",
  ):
    self.model = model
    self.autocast_dtype = dtype
    self.autocast_debug = debug
    self.grad_reduce = grad_reduce
    self.apply = jaxmp.autocast(
      model.apply, dtype, debug=debug, grad_reduce=grad_reduce
    )

  def clone(self, **updates: Any) -> "AutocastModel":
    """``model.clone(**updates)``, still under autocast."""
    return AutocastModel(
      self.model.clone(**updates),
      self.autocast_dtype,
      self.autocast_debug,
      self.grad_reduce,
    )

  def __getattr__(self, name: str) -> Any:
    """The wrapped model's attribute (``init``, ``dtype``, ...)."""
    if name == "model":  # Not set yet (copy, pickle): no recursion.
      raise AttributeError(name)
    return getattr(self.model, name)


def create_model(
  name: str,
  *,
  num_classes: int,
  num_filters: int,
  precision: Precision,
  axis_name: Optional[str] = None,
) -> models.ResNet:
  """The ResNet ``name`` with the precision's dtypes.

  Under an autocast preset (O1) the model is the fp32 one, its ``apply``
  wrapped by ``jaxmp.autocast(..., precision.autocast)`` (`AutocastModel`).
  """
  model = models.get_model(
    name,
    num_classes=num_classes,
    num_filters=num_filters,
    dtype=precision.compute_dtype,
    param_dtype=precision.param_dtype,
    norm_dtype=precision.norm_dtype,
    axis_name=axis_name,
  )
  if precision.autocast is None:
    return model
  return AutocastModel(
    model,
    precision.autocast,
    debug=precision.autocast_debug,
    grad_reduce=precision.grad_reduce,
  )


def create_learning_rate(
  base: float, *, schedule: str, warmup_steps: int, total_steps: int
) -> optax.Schedule:
  """Optional linear warm-up, then cosine decay or a constant."""
  if schedule == "constant":
    main = optax.constant_schedule(base)
  else:
    main = optax.cosine_decay_schedule(base, max(total_steps - warmup_steps, 1))
  if warmup_steps == 0:
    return main
  return optax.join_schedules(
    [optax.linear_schedule(0.0, base, warmup_steps), main], [warmup_steps]
  )


def create_optimizer(
  precision: Precision,
  learning_rate: optax.ScalarOrSchedule,
  *,
  momentum: float,
  nesterov: bool = False,
  weight_decay: float = 0.0,
  seed: int = 0,
  diagnostics: bool = False,
  skip_spikes: Optional[jaxmp.SpikeSkip] = None,
  rounding_every: int = 0,
) -> optax.GradientTransformation:
  """SGD with momentum and coupled weight decay (torch.optim.SGD), wrapped.

  Apex's FusedSGD fused the update into one kernel; here XLA fuses the whole
  optax chain, masters and loss-scale bookkeeping included. ``precision``
  gives the masters and how the momentum is stored (``optimizer_state``);
  ``seed`` keys the rounding of ``master_weights="stochastic"``;
  ``diagnostics`` keeps
  jaxmp's per-leaf gradient report (`jaxmp.overflow_report`);
  ``skip_spikes`` drops loss and gradient-norm spikes (`jaxmp.SpikeSkip`);
  ``rounding_every`` measures what rounding costs each layer
  (`jaxmp.rounding_report`).
  """
  inner = optax.chain(
    optax.add_decayed_weights(weight_decay),
    optax.sgd(learning_rate, momentum=momentum or None, nesterov=nesterov),
  )
  return jaxmp.mixed_precision(
    inner,
    loss_scale=precision.loss_scale,
    max_loss_scale=precision.max_loss_scale,
    hysteresis=precision.hysteresis,
    master_weights=precision.master_weights,
    optimizer_state=precision.optimizer_state,
    rounding_key=seed,
    diagnostics=diagnostics,
    skip_spikes=skip_spikes,
    rounding_every=rounding_every,
  )


def init_compiler_options() -> Optional[dict[str, Any]]:
  """XLA options for the state's initialisation: on CPU, optimisation level 1.

  XLA:CPU spends 10-12 s compiling the ResNet18's initialisation (one
  threefry stream per parameter) at its default level 3 and 3-4 s at level
  1, and the program runs once, in 0.2-0.3 s either way (AMD EPYC (AVX2),
  2 cores, loaded, 2026-12-03). A per-program option overrides
  ``XLA_FLAGS``, so a lower ``--xla_backend_optimization_level`` there
  (the test suite's) is kept: level 0 compiles the tests' 4-filter net's
  initialisation in 2.4-2.5 s against 3.4-3.8 s at level 1 (AMD EPYC with
  AVX-512, 2 cores, loaded, 2026-12-05). None elsewhere (XLA's defaults).
  """
  if jax.default_backend() != "cpu":
    return None
  asked = re.findall(
    r"--xla_backend_optimization_level=(\d+)", os.environ.get("XLA_FLAGS", "")
  )
  level = min(1, int(asked[-1])) if asked else 1
  return {"xla_backend_optimization_level": level}


def make_init(
  model: models.ResNet,
  optimizer: optax.GradientTransformation,
  image_shape: Sequence[int],
  *,
  seed: int,
) -> Callable[[], TrainState]:
  """The jitted ``init() -> TrainState`` of `create_train_state`.

  ``init.trace().out_info`` gives the state's shapes without running it.
  """

  @functools.partial(jax.jit, compiler_options=init_compiler_options())
  def init():
    init_key, data_key = jax.random.split(jax.random.key(seed))
    variables = model.init(
      init_key, jnp.zeros((1,) + tuple(image_shape)), train=False
    )
    params = variables["params"]
    return TrainState(
      step=jnp.zeros([], jnp.int32),
      params=params,
      batch_stats=variables.get("batch_stats", {}),
      opt_state=optimizer.init(params),
      rng=jax.random.key_data(data_key),
    )

  return init


def create_train_state(
  model: models.ResNet,
  optimizer: optax.GradientTransformation,
  image_shape: Sequence[int],
  *,
  seed: int,
) -> TrainState:
  """Initialises params (in the param dtype), BatchNorm stats and opt state.

  One jitted program (`make_init`): run eagerly, the optimizer's ``init``
  would dispatch (and, from the persistent cache, load) one small executable
  per op, about a second of every start-up. On CPU it is compiled at LLVM
  optimisation level 1 (`init_compiler_options`).
  """
  return make_init(model, optimizer, image_shape, seed=seed)()


# What reading a state dict file raises when the file, not the code, is wrong:
# a missing reader (ImportError), an unknown format or no state dict in it
# (ValueError), an unreadable or damaged file (OSError, a bad zip, a broken
# pickle, a file cut short). Anything else is a bug and keeps its traceback.
_UNREADABLE = (
  ImportError,
  ValueError,
  OSError,
  EOFError,
  zipfile.BadZipFile,
  pickle.UnpicklingError,
)
try:  # An optional reader: its own error class for a damaged file.
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top

  _UNREADABLE += (SafetensorError,)
except ImportError:  # pragma: no cover - safetensors is in the dev extra.
  pass


# Of those, the errors whose own message is the whole story: a missing reader,
# an unknown format, a file that is not there or cannot be opened. The rest
# come from reading a damaged file, and their messages rarely say so.
_SAYS_WHY = (
  ImportError,
  ValueError,
  FileNotFoundError,
  IsADirectoryError,
  PermissionError,
)


def load_torch_weights(
  path: str, *, model_name: str, num_classes: int, num_filters: int
) -> dict[str, Any]:
  """``params`` and ``batch_stats`` of a PyTorch state dict file.

  The file is read by ``jaxmp.models.read_state_dict`` and mapped by
  ``jaxmp.models.from_torchvision`` with the names of ``model_name``
  (torchvision's or kuangliu/pytorch-cifar's), checked against the model of
  ``num_classes`` and ``num_filters``.

  Raises:
    ConfigError: the file cannot be read or does not fit the model; one
      line naming the tensors.
  """
  try:
    state_dict = models.read_state_dict(path)
  except _UNREADABLE as e:
    if isinstance(e, _SAYS_WHY):
      raise ConfigError(f"init_from {path}: {e}") from None
    raise ConfigError(
      f"init_from {path}: the file is damaged or cut short "
      f"({type(e).__name__}: {e})"
    ) from None
  try:
    variables = models.from_torchvision(
      state_dict,
      num_classes=num_classes,
      num_filters=num_filters,
      arch=model_name,
    )
  except ValueError as e:
    raise ConfigError(f"init_from {path}: {e}") from None
  return {
    "params": variables["params"],
    "batch_stats": variables["batch_stats"],
  }


def with_initial_weights(
  state: TrainState,
  optimizer: optax.GradientTransformation,
  variables: dict[str, Any],
) -> TrainState:
  """``state`` starting from ``variables`` (cast to the state's dtypes).

  The optimizer state is initialised afresh from the cast params, so the
  fp32 masters of half-precision params are upcasts of them, as in Apex.
  """
  cast = lambda ref, x: jnp.asarray(x, ref.dtype)
  params = jax.tree.map(cast, state.params, variables["params"])
  batch_stats = jax.tree.map(cast, state.batch_stats, variables["batch_stats"])
  return state.replace(
    params=params, batch_stats=batch_stats, opt_state=optimizer.init(params)
  )


def cross_entropy(
  logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0
) -> jax.Array:
  """Per-example softmax cross-entropy, in fp32."""
  logits = logits.astype(jnp.float32)
  one_hot = jax.nn.one_hot(labels, logits.shape[-1])
  if label_smoothing:
    one_hot = optax.smooth_labels(one_hot, label_smoothing)
  return optax.softmax_cross_entropy(logits, one_hot)


def zero_metrics(opt_state: Any = None) -> dict[str, Any]:
  """The train step's running sums, at zero.

  With an ``opt_state`` built with ``diagnostics=True`` also
  ``skip_diagnostics``: the per-leaf report of the last skipped step (all
  zero until a step is skipped), so that a log step can name the leaf of a
  skip between log steps.
  """
  metrics = {
    "loss_sum": jnp.zeros([], jnp.float32),
    "correct": jnp.zeros([], jnp.int32),
    "count": jnp.zeros([], jnp.int32),
    "last_loss": jnp.zeros([], jnp.float32),
  }
  if opt_state is not None:
    diagnostics = jaxmp.find_state(opt_state).diagnostics
    if diagnostics is not None:
      metrics["skip_diagnostics"] = jax.tree.map(jnp.zeros_like, diagnostics)
  return metrics


def skip_report(opt_state: Any, metrics: dict) -> list[Any]:
  """Host side: `jaxmp.overflow_report` of the last skipped step.

  ``metrics`` are those of a train step from `zero_metrics(opt_state)`.
  """
  held = jaxmp.find_state(opt_state)._replace(
    diagnostics=metrics["skip_diagnostics"]
  )
  return jaxmp.overflow_report(held)


def make_loss_fn(
  model: models.ResNet, *, compute_dtype: Any, label_smoothing: float = 0.0
) -> Callable[..., tuple[jax.Array, tuple[jax.Array, Any]]]:
  """``loss_fn(params, batch_stats, images, labels) -> (loss, aux)``.

  The unscaled mean cross-entropy of a training forward pass; ``aux`` is
  ``(logits, new_vars)`` with the updated ``batch_stats``.
  """

  def loss_fn(params, batch_stats, images, labels):
    logits, new_vars = model.apply(
      {"params": params, "batch_stats": batch_stats},
      images.astype(compute_dtype),
      train=True,
      mutable=["batch_stats"],
    )
    loss = cross_entropy(logits, labels, label_smoothing).mean()
    return loss, (logits, new_vars)

  return loss_fn


TrainStep = Callable[..., tuple[TrainState, dict[str, jax.Array]]]


def make_train_step(
  model: models.ResNet,
  optimizer: optax.GradientTransformation,
  *,
  compute_dtype: Any,
  label_smoothing: float = 0.0,
  faults: faults_lib.Faults = faults_lib.Faults(),
  grad_reduce: str = "fp32",
  mesh: Optional[jax.sharding.Mesh] = None,
) -> TrainStep:
  """Returns ``train_step(state, images, labels, metrics) -> (state, metrics)``.

  ``images`` are normalised float images; ``metrics`` accumulates
  ``loss_sum``, ``correct`` and ``count`` on the device (`zero_metrics`).
  The unscaled loss goes to the optimizer (``loss=``): a NaN/inf loss skips
  the step without backing off the loss scale. ``faults`` are test knobs.
  ``grad_reduce``: how half params' gradients are summed across devices
  (`jaxmp.value_and_grad`; an O1 model's autocast has its own). Under
  ``"half_wire"`` the step is traced with ``mesh`` as its abstract mesh:
  the half-wire sums run over its devices.
  """
  loss_fn = make_loss_fn(
    model, compute_dtype=compute_dtype, label_smoothing=label_smoothing
  )

  def one_step(state: TrainState, images, labels, metrics):
    images = faults_lib.corrupt_images(faults, state.step, images)

    (loss, (logits, new_vars)), grads = jaxmp.value_and_grad(
      loss_fn, has_aux=True, grad_reduce=grad_reduce
    )(state.params, state.opt_state, state.batch_stats, images, labels)
    grads = faults_lib.corrupt_grads(faults, state.step, grads)
    updates, opt_state = optimizer.update(
      grads, state.opt_state, state.params, loss=loss
    )
    params = optax.apply_updates(state.params, updates)
    # The forward pass of a skipped step must not move the running stats.
    batch_stats = jaxmp.rollback_if_skipped(
      opt_state, new_vars["batch_stats"], state.batch_stats
    )
    n = labels.shape[0]
    new_metrics = {
      "loss_sum": metrics["loss_sum"] + loss * n,
      "correct": metrics["correct"] + jnp.sum(jnp.argmax(logits, -1) == labels),
      "count": metrics["count"] + n,
      "last_loss": loss,
    }
    if "skip_diagnostics" in metrics:  # Static: built with diagnostics=True.
      mp_state = jaxmp.find_state(opt_state)
      new_metrics["skip_diagnostics"] = jax.tree.map(
        lambda new, old: jnp.where(mp_state.step_applied, old, new),
        mp_state.diagnostics,
        metrics["skip_diagnostics"],
      )
    return state.replace(
      step=state.step + 1,
      params=params,
      batch_stats=batch_stats,
      opt_state=opt_state,
    ), new_metrics

  def train_step(state: TrainState, images, labels, metrics):
    if grad_reduce != "half_wire" or mesh is None:
      return one_step(state, images, labels, metrics)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return one_step(state, images, labels, metrics)

  return train_step


def zero_eval_sums() -> dict[str, np.ndarray]:
  """The eval step's sums at zero, on the host (place them on the mesh)."""
  return {
    "loss_sum": np.zeros([], np.float32),
    "correct": np.zeros([], np.int32),
    "count": np.zeros([], np.int32),
  }


def make_eval_step(model: models.ResNet, *, compute_dtype: Any):
  """Returns ``eval_step(state, images, labels, mask, sums) -> sums``.

  Adds the batch's ``loss_sum``, ``correct`` and ``count`` over the rows
  where ``mask`` is true (the padding of the last batch is not counted) to
  ``sums`` (`zero_eval_sums`), which stay on the devices from batch to
  batch: the host fetches them once, after the last batch.
  """

  def eval_step(state: TrainState, images, labels, mask, sums):
    logits = model.apply(
      {"params": state.params, "batch_stats": state.batch_stats},
      images.astype(compute_dtype),
      train=False,
    )
    mask = mask.astype(bool)
    loss = jnp.where(mask, cross_entropy(logits, labels), 0.0)
    hit = jnp.logical_and(mask, jnp.argmax(logits, -1) == labels)
    return {
      "loss_sum": sums["loss_sum"] + jnp.sum(loss),
      "correct": sums["correct"] + jnp.sum(hit, dtype=jnp.int32),
      "count": sums["count"] + jnp.sum(mask, dtype=jnp.int32),
    }

  return eval_step


def _digest(tree: Any) -> str:
  """sha256 over the leaves of ``tree`` on the host, in sorted path order.

  Each leaf contributes its path, dtype, shape and bytes, so two trees have
  the same digest only when every leaf is bitwise equal.
  """
  flat = jax.tree_util.tree_leaves_with_path(tree)
  digest = hashlib.sha256()
  for path, leaf in sorted(flat, key=lambda kv: jax.tree_util.keystr(kv[0])):
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(
      leaf.dtype, jax.dtypes.prng_key
    ):
      leaf = jax.random.key_data(leaf)
    array = np.ascontiguousarray(mesh.to_host(leaf))
    digest.update(jax.tree_util.keystr(path).encode())
    digest.update(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.tobytes())
  return digest.hexdigest()


def params_fingerprint(state: TrainState) -> str:
  """sha256 of the fp32 master params."""
  return _digest(jaxmp.master_params(state.opt_state, state.params))


def state_fingerprint(state: TrainState) -> str:
  """sha256 of the whole train state.

  Step, params, batch_stats, the whole opt_state (scale, counters, momentum,
  masters) and the data key.
  """
  return _digest(
    {
      "step": state.step,
      "params": state.params,
      "batch_stats": state.batch_stats,
      "opt_state": state.opt_state,
      "rng": state.rng,
    }
  )
