"""The config, validated and resolved once into one typed record.

`resolve` is the only place that reads the `ml_collections.ConfigDict`: it
checks every value, resolves the precision preset into a `Precision` record
and returns a frozen `Settings`. Everything below the app's top function takes
explicit values from it. The defaults live in ``configs/default.py`` only.
"""

import dataclasses
import os
from typing import Any, Optional

import jax.numpy as jnp
import jmp
import ml_collections
import numpy as np

import jaxmp
from cifar_train.errors import ConfigError

MODELS = ("resnet18", "resnet18_torchvision")
SCHEDULES = ("cosine", "constant")
DATASETS = ("cifar10", "cifar100", "image_folder", "synthetic")
# config.master_weights -> jaxmp.mixed_precision's master_weights.
MASTER_WEIGHTS = {
  "fp32": True,
  "none": False,
  "kahan": "kahan",
  "stochastic": "stochastic",
  "remainder": "remainder",
}
# config.optimizer_state ("" = "fp32") -> jaxmp.StateQuantization's kind.
OPTIMIZER_STATES = ("fp32", "bf16", "int8")
# config.grad_reduce -> jaxmp's grad_reduce (autocast, value_and_grad).
GRAD_REDUCE = ("fp32", "half_wire", "native")


@dataclasses.dataclass(frozen=True)
class Precision:
  """A preset resolved for this run: dtypes, loss scale, masters.

  Attributes:
    name: the preset name or jmp policy string of the config.
    param_dtype: dtype the model's params are stored in.
    compute_dtype: dtype of the forward and backward pass.
    norm_dtype: dtype of BatchNorm params and arithmetic.
    loss_scale: the jmp loss-scale object handed to `jaxmp.mixed_precision`.
    max_loss_scale: the cap of a dynamic scale.
    hysteresis: back off from the ``hysteresis``-th overflow in a row.
    master_weights: `jaxmp.mixed_precision`'s ``master_weights``: ``True``
      (fp32 masters), ``False``, ``"kahan"``, ``"stochastic"`` or
      ``"remainder"`` (bfloat16 params only).
    optimizer_state: `jaxmp.mixed_precision`'s ``optimizer_state``: a
      `jaxmp.StateQuantization` (kind ``"fp32"``, ``"bf16"`` or ``"int8"``,
      and its ``min_size``).
    calibrate: the initial scale is "auto": the loop calibrates it on the
      first batch (`with_initial_scale`); until then ``loss_scale`` starts
      at the floor.
    autocast: the preset's `jaxmp.autocast` dtype (O1: float16): the model
      is built in ``compute_dtype`` (fp32) and its apply runs under
      ``jaxmp.autocast``; ``None`` for the hand-cast presets.
    autocast_debug: autocast's ``debug=True`` (``config.diagnostics``):
      report the first op whose half output overflowed.
    grad_reduce: how weight gradients are summed across devices
      (``jaxmp.autocast``'s and ``jaxmp.value_and_grad``'s ``grad_reduce``).
  """

  name: str
  param_dtype: Any
  compute_dtype: Any
  norm_dtype: Any
  loss_scale: jaxmp.LossScaler
  max_loss_scale: float
  hysteresis: int
  master_weights: Any
  optimizer_state: jaxmp.StateQuantization = jaxmp.StateQuantization("fp32")
  calibrate: bool = False
  autocast: Any = None
  autocast_debug: bool = False
  grad_reduce: str = "fp32"


@dataclasses.dataclass(frozen=True)
class Settings:
  """Every value of a run, checked. Field meanings: ``configs/default.py``."""

  model: str
  num_filters: int
  init_from: str
  precision: Precision
  max_consecutive_skips: int
  max_nonfinite_loss_steps: int
  skip_spikes: Optional[jaxmp.SpikeSkip]  # spike_skip_window/_factor
  diagnostics: bool
  rounding_every: int  # jaxmp.rounding_report's measure period; 0 = off.
  dataset: str
  data_dir: str
  mean: tuple[float, float, float]
  std: tuple[float, float, float]
  augment: bool
  data_on_device: Any  # True, False or "auto" (`loop.set_up` decides).
  synthetic_train_examples: int
  synthetic_test_examples: int
  batch_size: int
  eval_batch_size: int
  steps_per_call: Any  # An int >= 1 or "auto" (`loop.set_up` decides).
  num_epochs: int
  num_train_steps: int
  learning_rate: float
  lr_schedule: str
  warmup_epochs: float
  momentum: float
  nesterov: bool
  weight_decay: float
  label_smoothing: float
  num_devices: int
  coordinator_address: str
  num_processes: int
  process_id: int
  distributed_heartbeat_timeout_s: int
  seed: int
  log_every_steps: int
  checkpoint_every_steps: int
  keep_checkpoints: int
  progress_bar: bool
  compile_cache_dir: str
  reuse_host_memory: bool
  inject_nan_data_at_step: int
  inject_overflow_at_step: int
  inject_overflow_leaf: str


def resolve_precision(config: ml_collections.ConfigDict) -> Precision:
  """The preset of ``config.policy`` with the config's loss-scale settings."""
  try:
    preset = jaxmp.get_preset(config.policy)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  policy = preset.policy
  loss_scale = preset.loss_scale
  dynamic = isinstance(loss_scale, jmp.DynamicLossScale)
  calibrate = config.init_loss_scale == "auto"
  if calibrate and not dynamic:
    raise ConfigError(
      f"init_loss_scale 'auto' needs a preset with a dynamic loss scale "
      f"(O1, O2); policy {config.policy!r} has none"
    )
  if dynamic:  # The config's settings.
    init = config.min_loss_scale if calibrate else config.init_loss_scale
    try:
      init = float(init)
    except (TypeError, ValueError):
      raise ConfigError(
        f"init_loss_scale must be a number or 'auto', got {init!r}"
      ) from None
    loss_scale = jmp.DynamicLossScale(
      np.float32(init),
      period=int(config.loss_scale_period),
      factor=config.loss_scale_factor,
      min_loss_scale=np.float32(config.min_loss_scale),
    )
  master_weights = preset.master_weights
  if config.master_weights:
    if config.master_weights not in MASTER_WEIGHTS:
      raise ConfigError(
        f"unknown master_weights {config.master_weights!r}; valid: "
        f"{', '.join(MASTER_WEIGHTS)} (or '' for the preset's)"
      )
    master_weights = MASTER_WEIGHTS[config.master_weights]
  bf16 = jnp.dtype(policy.param_dtype) == jnp.bfloat16
  if master_weights == "remainder" and not bf16:
    raise ConfigError(
      "master_weights 'remainder' keeps each bfloat16 param's fp32 master as "
      "the param and 16 more bits, and needs bfloat16 params; policy "
      f"{config.policy!r} has {jnp.dtype(policy.param_dtype).name} params. "
      "Use policy bf16-kahan or bf16-stochastic (bfloat16 params), or "
      "master_weights fp32, kahan or stochastic"
    )
  norm_dtype = jnp.float32 if preset.keep_batchnorm_fp32 else policy.param_dtype
  return Precision(
    name=preset.name,
    param_dtype=policy.param_dtype,
    compute_dtype=policy.compute_dtype,
    norm_dtype=norm_dtype,
    loss_scale=loss_scale,
    max_loss_scale=float(config.max_loss_scale),
    hysteresis=int(config.loss_scale_hysteresis),
    master_weights=master_weights,
    optimizer_state=_optimizer_state(config),
    calibrate=calibrate,
    autocast=preset.autocast,
    autocast_debug=preset.autocast is not None and bool(config.diagnostics),
    grad_reduce=_grad_reduce(config),
  )


def _grad_reduce(config) -> str:
  """``config.grad_reduce``, checked ("fp32" where the config has none)."""
  mode = config.get("grad_reduce", "fp32")
  if mode not in GRAD_REDUCE:
    raise ConfigError(
      f"unknown grad_reduce {mode!r}; valid: {', '.join(GRAD_REDUCE)}"
    )
  return mode


def _optimizer_state(config) -> jaxmp.StateQuantization:
  """``config.optimizer_state`` and its ``_min_size`` as a StateQuantization."""
  kind = config.optimizer_state or "fp32"
  if kind not in OPTIMIZER_STATES:
    raise ConfigError(
      f"unknown optimizer_state {config.optimizer_state!r}; valid: "
      f"{', '.join(OPTIMIZER_STATES)} (or '' for fp32)"
    )
  min_size = config.optimizer_state_min_size
  if (
    isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1
  ):
    raise ConfigError(
      f"optimizer_state_min_size must be an integer >= 1, got {min_size!r}"
    )
  return jaxmp.StateQuantization(kind, min_size=min_size)


def with_initial_scale(precision: Precision, scale: float) -> Precision:
  """``precision`` whose dynamic loss scale starts at ``scale``."""
  ls = precision.loss_scale
  return dataclasses.replace(
    precision,
    loss_scale=jmp.DynamicLossScale(
      np.float32(scale),
      period=ls.period,
      factor=ls.factor,
      min_loss_scale=ls.min_loss_scale,
    ),
    calibrate=False,
  )


def _compile_cache_dir(value: str) -> str:
  """The cache directory of ``config.compile_cache_dir``; "" when off."""
  if value != "auto":
    return os.path.expanduser(value)
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
    os.path.expanduser("~"), ".cache"
  )
  return os.path.join(base, "jaxmp", "jit")


_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


def _auto_or_bool(config, key: str) -> Any:
  """``config[key]`` as True, False or "auto" (strings from the CLI too)."""
  value = config[key]
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  text = str(value).strip().lower()
  if text == "auto":
    return "auto"
  if text in _TRUE or text in _FALSE:
    return text in _TRUE
  raise ConfigError(f"{key} must be True, False or 'auto', got {value!r}")


def _auto_or_count(config, key: str) -> Any:
  """``config[key]`` as an int >= 1 or "auto" (strings from the CLI too)."""
  value = config[key]
  if isinstance(value, str) and value.strip().lower() == "auto":
    return "auto"
  try:
    count = int(value)
    exact = not isinstance(value, bool) and count == float(value)
  except (TypeError, ValueError):
    exact = False
  if not exact or count < 1:
    raise ConfigError(f"{key} must be an integer >= 1 or 'auto', got {value!r}")
  return count


def _rounding_every(config) -> int:
  every = config.rounding_every
  if isinstance(every, bool) or not isinstance(every, int) or every < 0:
    raise ConfigError(f"rounding_every must be an int >= 0, got {every!r}")
  return every


def _skip_spikes(config) -> Optional[jaxmp.SpikeSkip]:
  """``config.spike_skip_window``/``_factor`` as a `jaxmp.SpikeSkip` (0: off)."""
  window = config.spike_skip_window
  if isinstance(window, bool) or not isinstance(window, int) or window < 0:
    raise ConfigError(
      f"spike_skip_window must be 0 (off) or an integer >= 2, got {window!r}"
    )
  if window == 0:
    return None
  try:
    return jaxmp.SpikeSkip(window=window, factor=config.spike_skip_factor)
  except (TypeError, ValueError) as e:
    raise ConfigError(
      f"spike_skip_window/spike_skip_factor: {e}".replace("SpikeSkip ", "")
    ) from None


def _choice(config, key: str, valid: tuple[str, ...]) -> str:
  if config[key] not in valid:
    raise ConfigError(
      f"unknown {key} {config[key]!r}; valid: {', '.join(valid)}"
    )
  return config[key]


def resolve(config: ml_collections.ConfigDict) -> Settings:
  """Validates ``config`` once and returns its `Settings`.

  Raises:
    ConfigError: naming the first invalid value and the valid choices.
  """
  model = _choice(config, "model", MODELS)
  dataset = _choice(config, "dataset", DATASETS)
  precision = resolve_precision(config)
  for key in (
    "batch_size",
    "eval_batch_size",
    "num_filters",
    "num_epochs",
    "log_every_steps",
    "distributed_heartbeat_timeout_s",
  ):
    if int(config[key]) < 1:
      raise ConfigError(f"{key} must be >= 1, got {config[key]}")
  lr_schedule = _choice(config, "lr_schedule", SCHEDULES)
  if dataset == "image_folder":
    if not config.data_dir:
      raise ConfigError(
        "dataset 'image_folder' needs --config.data_dir=DIR "
        "holding train/<class>/* and test/<class>/*"
      )
    if not os.path.isdir(config.data_dir):
      raise ConfigError(f"data_dir {config.data_dir!r} does not exist")
  if len(config.mean) != 3 or len(config.std) != 3:
    raise ConfigError("mean and std must have 3 values (RGB)")
  init_from = os.path.expanduser(config.init_from)
  if init_from and not os.path.isfile(init_from):
    raise ConfigError(f"init_from {config.init_from!r} is not a file")
  if int(config.num_devices) < 0:
    raise ConfigError(f"num_devices must be >= 0, got {config.num_devices}")
  if int(config.max_nonfinite_loss_steps) < 1:
    raise ConfigError(
      "max_nonfinite_loss_steps must be >= 1, got "
      f"{config.max_nonfinite_loss_steps}"
    )
  return Settings(
    model=model,
    num_filters=int(config.num_filters),
    init_from=init_from,
    precision=precision,
    max_consecutive_skips=int(config.max_consecutive_skips),
    max_nonfinite_loss_steps=int(config.max_nonfinite_loss_steps),
    skip_spikes=_skip_spikes(config),
    diagnostics=bool(config.diagnostics),
    rounding_every=_rounding_every(config),
    dataset=dataset,
    data_dir=config.data_dir,
    mean=tuple(float(m) for m in config.mean),
    std=tuple(float(s) for s in config.std),
    augment=bool(config.augment),
    data_on_device=_auto_or_bool(config, "data_on_device"),
    synthetic_train_examples=int(config.synthetic_train_examples),
    synthetic_test_examples=int(config.synthetic_test_examples),
    batch_size=int(config.batch_size),
    eval_batch_size=int(config.eval_batch_size),
    steps_per_call=_auto_or_count(config, "steps_per_call"),
    num_epochs=int(config.num_epochs),
    num_train_steps=int(config.num_train_steps),
    learning_rate=float(config.learning_rate),
    lr_schedule=lr_schedule,
    warmup_epochs=float(config.warmup_epochs),
    momentum=float(config.momentum),
    nesterov=bool(config.nesterov),
    weight_decay=float(config.weight_decay),
    label_smoothing=float(config.label_smoothing),
    num_devices=int(config.num_devices),
    coordinator_address=config.coordinator_address,
    num_processes=int(config.num_processes),
    process_id=int(config.process_id),
    distributed_heartbeat_timeout_s=int(config.distributed_heartbeat_timeout_s),
    seed=int(config.seed),
    log_every_steps=int(config.log_every_steps),
    checkpoint_every_steps=int(config.checkpoint_every_steps),
    keep_checkpoints=int(config.keep_checkpoints),
    progress_bar=bool(config.progress_bar),
    compile_cache_dir=_compile_cache_dir(config.compile_cache_dir),
    reuse_host_memory=bool(config.reuse_host_memory),
    inject_nan_data_at_step=int(config.inject_nan_data_at_step),
    inject_overflow_at_step=int(config.inject_overflow_at_step),
    inject_overflow_leaf=config.inject_overflow_leaf,
  )
