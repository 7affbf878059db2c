"""jaxmp: mixed-precision training for JAX, the optax way.

An optax transform with FP32 master params and dynamic loss scaling
(`mixed_precision`), accessors that find its state anywhere in an optax state,
Apex-style precision presets, and `autocast` (Apex O1 / torch.autocast
per-op precision for any JAX function).
"""

from jaxmp._src.state.pytrees import AccumulationState
from jaxmp._src.transform.accumulation import multi_steps
from jaxmp._src.inspect.health import check_health
from jaxmp._src.inspect.accessors import find_state
from jaxmp._src.inspect.accessors import (
  loss_scale as loss_scale,
)  # Deprecated.
from jaxmp._src.inspect.accessors import loss_scaler
from jaxmp._src.inspect.health import LossScaleCollapseError
from jaxmp._src.inspect.accessors import master_params
from jaxmp._src.inspect.health import NonFiniteLossError
from jaxmp._src.inspect.reports import overflow_report
from jaxmp._src.inspect.health import rollback_if_skipped
from jaxmp._src.inspect.reports import rounding_report
from jaxmp._src.inspect.accessors import scale_loss
from jaxmp._src.inspect.health import SpikeStallError
from jaxmp._src.inspect.accessors import state_summary
from jaxmp._src.inspect.accessors import stats
from jaxmp._src.autocast.regions import autocast
from jaxmp._src.autocast.regions import no_autocast
from jaxmp._src.autocast.report import AutocastReport
from jaxmp._src.transform.calibrate import calibrate_loss_scale
from jaxmp._src.nn.compiler import cpu_compiler_options
from jaxmp._src.autocast.fp8 import Fp8Recipe
from jaxmp._src.autocast.block_recipe import BlockRecipe
from jaxmp._src.autocast.block import quantize
from jaxmp._src.presets.initialize import initialize
from jaxmp._src.reduction.report import Reduction
from jaxmp._src.reduction.report import reduction_report
from jaxmp._src.reduction.report import ReductionReport
from jaxmp._src.reduction.wire import pmean_grads
from jaxmp._src.transform.mixed_precision import adjust_loss_scale
from jaxmp._src.scaling.finite import all_finite
from jaxmp._src.transform.mixed_precision import LossScaleConfig
from jaxmp._src.transform.mixed_precision import LossScaler
from jaxmp._src.transform.mixed_precision import mixed_precision
from jaxmp._src.state.pytrees import MixedPrecisionState
from jaxmp._src.presets.policy import get_policy
from jaxmp._src.presets.policy import get_preset
from jaxmp._src.presets.policy import Preset
from jaxmp._src.presets.policy import PRESETS
from jaxmp._src.state.rounding import stochastic_round
from jaxmp._src.scaling.spikes import SpikeSkip
from jaxmp._src.state.sharding import state_shardings
from jaxmp._src.state.state_codec import StateQuantization
from jaxmp._src.scaling.unscaled import UnscaledGradientsWarning
from jaxmp._src.transform.value_and_grad import value_and_grad

__version__ = "0.1.0"

__all__ = (
  "AccumulationState",
  "adjust_loss_scale",
  "all_finite",
  "autocast",
  "AutocastReport",
  "BlockRecipe",
  "calibrate_loss_scale",
  "check_health",
  "cpu_compiler_options",
  "find_state",
  "Fp8Recipe",
  "get_policy",
  "get_preset",
  "initialize",
  "loss_scaler",
  "LossScaleCollapseError",
  "LossScaleConfig",
  "LossScaler",
  "master_params",
  "mixed_precision",
  "no_autocast",
  "multi_steps",
  "MixedPrecisionState",
  "NonFiniteLossError",
  "overflow_report",
  "pmean_grads",
  "Preset",
  "PRESETS",
  "quantize",
  "Reduction",
  "reduction_report",
  "ReductionReport",
  "rollback_if_skipped",
  "rounding_report",
  "scale_loss",
  "SpikeSkip",
  "SpikeStallError",
  "state_shardings",
  "state_summary",
  "StateQuantization",
  "stats",
  "stochastic_round",
  "UnscaledGradientsWarning",
  "value_and_grad",
)

# Renamed public names, kept for one release: each use warns.
_DEPRECATED = {"LossScale": ("LossScaler", LossScaler)}


def __getattr__(name: str):
  """The deprecated names (``jaxmp.LossScale``), with a warning."""
  if name in _DEPRECATED:
    import warnings  # pylint: disable=g-import-not-at-top

    new, value = _DEPRECATED[name]
    warnings.warn(
      f"jaxmp.{name} is deprecated and will be removed in the next release; "
      f"use jaxmp.{new}",
      DeprecationWarning,
      stacklevel=2,
    )
    return value
  raise AttributeError(f"module 'jaxmp' has no attribute {name!r}")
