"""The state pytrees: `MixedPrecisionState`, `AccumulationState`.

What a checkpoint of a jaxmp optimizer holds: these NamedTuples' fields,
in order, with the buffers of `master_weights`, `state_codec` and
`rounding_figures` as their leaves. Beside
them, what any reader of a state needs: `check_inner_state` (the wrappers
that must not sit inside one), `was_updated` (a state from before an
``update``) and `full_view` (the fp32 values it keeps of the params).
"""

import warnings
import weakref
from typing import Any, NamedTuple, Optional

import jax
import optax

from jaxmp._src.scaling import diagnostics as diag
from jaxmp._src.scaling import loss_scale as loss_scale_lib
from jaxmp._src.scaling import spikes as spikes_lib
from jaxmp._src.state import master_weights as masters_lib
from jaxmp._src.state import modes as modes_lib
from jaxmp._src.state import rounding_figures
from jaxmp._src.state import state_codec

LossScaleConfig = loss_scale_lib.LossScaleConfig
StateQuantization = state_codec.StateQuantization


def _deprecated(old: str, new: str) -> None:
  warnings.warn(
    f"MixedPrecisionState.{old} is deprecated and will be removed in the "
    f"next release; use .{new}",
    DeprecationWarning,
    stacklevel=3,
  )


class MixedPrecisionState(NamedTuple):
  """State of `mixed_precision`.

  Attributes:
    inner_state: state of the wrapped optimizer.
    master_params: fp32 copies of the half-precision params, ``None`` where a
      param is fp32 already (it is its own master) or masters are disabled.
    loss_scale: fp32 scalar; multiply the next loss by it.
    growth_counter: int32, consecutive finite steps since the last growth
      (jmp's ``counter``, GradScaler's ``growth_tracker``).
    step_applied: bool, whether the last step was applied: its gradients
      (and its loss, when ``update`` was given ``loss=``) were all finite,
      and it was not dropped as a spike (``skip_spikes``). (Formerly
      ``grads_finite``, a deprecated alias for one release.)
    skipped_steps: int32, how many steps were skipped since `init` for a
      non-finite value, gradients or loss; steps dropped as spikes are not
      counted here but in ``spikes.spike_skips``.
    consecutive_overflows: int32, steps skipped for non-finite gradients in
      a row up to now; a step skipped for a non-finite loss leaves it
      unchanged. (Formerly ``consecutive_skips``, a deprecated alias.)
    config: static `LossScaleConfig` (structure, not a leaf).
    nonfinite_loss_steps: int32, steps skipped since `init` because the loss
      given to ``update`` was inf/NaN (``loss=``).
    consecutive_nonfinite_loss: int32, such steps in a row up to now.
    diagnostics: ``None``, or with ``diagnostics=True`` the last step's
      per-leaf gradient statistics (see `jaxmp.overflow_report`).
    compensation: with ``master_weights="kahan"``, for each half-precision
      param the rounding error of its last update, in the param's dtype
      (``param + compensation`` is the fp32 estimate); ``None`` elsewhere.
    rounding_key: with ``master_weights="stochastic"``, the raw ``uint32[2]``
      PRNG key of the next step's rounding; ``None`` otherwise.
    spikes: with ``skip_spikes``, a ``SpikeState`` NamedTuple (the
      windows of recent losses and gradient norms, and the spike counters);
      ``None`` otherwise.
    remainder: with ``master_weights="remainder"``, for each bfloat16 param
      the low 16 bits of its fp32 master (int16); ``None`` elsewhere.
    optimizer_state: static: the `jaxmp.StateQuantization` that encodes
      ``inner_state``'s param-shaped leaves, ``None`` for fp32 state (no
      leaf).
    rounding: with ``rounding_every``, the per-leaf rounding figures of the
      last measured step (see `jaxmp.rounding_report`); ``None`` otherwise.
    master_modes: with per-leaf ``master_weights``, static: each param's
      mode (see `jaxmp.state_summary`); ``None`` otherwise.
  """

  inner_state: optax.OptState
  master_params: Any
  loss_scale: jax.Array
  growth_counter: jax.Array
  step_applied: jax.Array
  skipped_steps: jax.Array
  consecutive_overflows: jax.Array
  config: LossScaleConfig
  nonfinite_loss_steps: Optional[jax.Array] = None
  consecutive_nonfinite_loss: Optional[jax.Array] = None
  diagnostics: Optional[diag.GradDiagnostics] = None
  compensation: Any = None
  rounding_key: Optional[jax.Array] = None
  spikes: Optional[spikes_lib.SpikeState] = None
  remainder: Any = None
  optimizer_state: Optional[StateQuantization] = None
  rounding: Optional[rounding_figures.RoundingFigures] = None
  master_modes: Optional[modes_lib.LeafModeNames] = None

  @property
  def grads_finite(self) -> jax.Array:
    """Deprecated: `step_applied` (it was never the gradient flag alone)."""
    _deprecated("grads_finite", "step_applied")
    return self.step_applied

  @property
  def consecutive_skips(self) -> jax.Array:
    """Deprecated: `consecutive_overflows`."""
    _deprecated("consecutive_skips", "consecutive_overflows")
    return self.consecutive_overflows


class AccumulationState(NamedTuple):
  """State of `jaxmp.multi_steps`.

  Attributes:
    multi_steps: the `optax.MultiStepsState` (its ``inner_opt_state`` holds
      the `mixed_precision` state; the accessors find it there).
    microbatch_finite: bool, whether the last microbatch's gradients were all
      finite (the flag `jaxmp.rollback_if_skipped` reads).
  """

  multi_steps: optax.MultiStepsState
  microbatch_finite: jax.Array


def contains(tree, kind) -> bool:
  """Whether ``tree`` holds a node of type ``kind`` at any depth."""
  is_kind = lambda x: isinstance(x, kind)
  return any(map(is_kind, jax.tree_util.tree_leaves(tree, is_leaf=is_kind)))


# The ``step_applied`` arrays (or tracers) of the states ``update`` was
# given, by id; weak, so an entry dies with its array. A state whose flag is
# here is one from *before* an update: `jaxmp.rollback_if_skipped` refuses it.
_UPDATED: "weakref.WeakValueDictionary[int, Any]" = (
  weakref.WeakValueDictionary()
)


def _flag(state: MixedPrecisionState) -> Any:
  leaves = jax.tree_util.tree_leaves(state.step_applied)  # NNX: a variable.
  return leaves[0] if leaves else None


def mark_updated(state: MixedPrecisionState) -> None:
  """Records that ``state`` was given to an ``update`` (see `was_updated`)."""
  flag = _flag(state)
  try:
    _UPDATED[id(flag)] = flag
  except TypeError:  # Not weak-referenceable (a NumPy scalar): unchecked.
    pass


def was_updated(state: MixedPrecisionState) -> bool:
  """Whether ``state`` was given to an ``update`` (it is a pre-update state)."""
  flag = _flag(state)
  return flag is not None and _UPDATED.get(id(flag)) is flag


def check_inner_state(inner_state) -> None:
  """Rejects the transforms that must not sit inside ``mixed_precision``."""
  if contains(inner_state, MixedPrecisionState):
    raise ValueError(
      "jaxmp.mixed_precision inside another jaxmp.mixed_precision (was the "
      "optimizer of jaxmp.initialize wrapped again?): the outer one unscales "
      "the gradients, the inner one unscales them again by a scale no loss "
      "was ever multiplied by, and the steps all but vanish. Use one:\n"
      "  params, opt = jaxmp.initialize(params, optax.sgd(0.1), 'O2')\n"
      "or\n  opt = jaxmp.mixed_precision(optax.sgd(0.1))"
    )
  if contains(inner_state, optax.MultiStepsState):
    raise ValueError(
      "optax.MultiSteps inside mixed_precision would change the loss "
      "scale and skip microbatches inside an accumulation window; use "
      "jaxmp.multi_steps(jaxmp.mixed_precision(inner), k) instead"
    )


def full_view(params, state: MixedPrecisionState):
  """The fp32 view of ``params`` that the state keeps, leaf by leaf.

  The masters, ``param + compensation`` (Kahan), the param joined with its
  remainder, or the upcast param.
  """
  buffers = masters_lib.Buffers(
    state.master_params,
    state.compensation,
    None,
    getattr(state, "remainder", None),
  )
  return masters_lib.full_view(params, buffers)
