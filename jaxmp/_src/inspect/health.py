"""Host-side checks of a run: roll back a skipped step, stop a dead one.

`rollback_if_skipped` keeps the caller's own state (Flax ``batch_stats``, an
EMA) as it was on a skipped step; `check_health` raises when training cannot
recover (a collapsed loss scale, a run of non-finite losses, a stall of
spike skips).
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from jaxmp._src import nnx_support
from jaxmp._src.inspect.accessors import find_state
from jaxmp._src.inspect.accessors import to_host
from jaxmp._src.state import pytrees


class LossScaleCollapseError(RuntimeError):
  """The loss scale sat at its floor while steps kept being skipped."""


class NonFiniteLossError(RuntimeError):
  """The loss itself was inf/NaN for many steps in a row (not an overflow)."""


class SpikeStallError(RuntimeError):
  """Every step for many steps in a row was dropped as a spike."""


def rollback_if_skipped(opt_state: Any, new: Any, old: Any) -> Any:
  """Keeps ``old`` instead of ``new`` when this step's gradients overflowed.

  Roll back the caller's other mutable state with it: Flax ``batch_stats``
  updated by the forward pass of an overflowed step, an EMA of the params.

  Without accumulation the test is ``mixed_precision``'s ``step_applied``:
  ``old`` is kept exactly when the update was skipped, for a non-finite
  value or as a spike (``skip_spikes``). Under
  `jaxmp.multi_steps` it is the flag of the microbatch just accumulated, as
  `jaxmp.multi_steps` checks each one: ``old`` is kept exactly for the
  microbatches whose own gradients were not finite, whether the window
  they belong to ends skipped or not. A skipped window so keeps the
  statistics of its finite microbatches (forward passes of params that did
  not change, as valid as in an applied window), and no forward pass of an
  overflowed microbatch ever reaches the state. (``step_applied`` would be
  stale mid-window: it only moves when a window ends.) A plain
  `optax.MultiSteps` around ``mixed_precision`` is rejected, for that
  reason. A window dropped as a spike (``skip_spikes`` judges the window's
  mean gradient, when the window ends) keeps its microbatches' statistics,
  as a window skipped for an overflow keeps those of its finite ones.

  Flax NNX: ``new`` may be the model itself: the variables of the types in
  ``old`` (an ``nnx.State``) are then put back in place, and the model is
  returned. ``old`` must be a copy taken before the forward pass,
  ``nnx.clone(nnx.state(model, nnx.BatchStat))``: ``nnx.state`` alone holds
  the live variables, which the forward pass updates in place, and is
  rejected.

  Which state: the one ``update`` returned for this step, ``updates,
  opt_state = opt.update(grads, opt_state, params)`` then
  ``rollback_if_skipped(opt_state, new, old)`` (NNX: ``opt.opt_state``
  after ``opt.update``). The state from before ``update`` says whether the
  *previous* step was applied; the very object ``update`` was given is
  refused.

  Args:
    opt_state: the optax state *after* ``update`` for this step.
    new: the tree computed during this step (or an NNX model).
    old: the same tree before this step.

  Returns:
    ``new`` where the step's gradients were finite, ``old`` elsewhere.

  Raises:
    ValueError: for an `optax.MultiSteps` around ``mixed_precision``, for
      an ``old`` that holds the very NNX variables of ``new``, and for an
      ``opt_state`` that was given to ``update`` (the pre-update state).

  >>> import jax.numpy as jnp, optax, jaxmp
  >>> opt = jaxmp.mixed_precision(optax.sgd(0.1))
  >>> params = {"w": jnp.zeros(2)}
  >>> state = opt.init(params)
  >>> _, state = opt.update({"w": jnp.array([jnp.inf, 0.])}, state, params)
  >>> jaxmp.rollback_if_skipped(state, {"mean": 1.0}, {"mean": 0.0})
  {'mean': Array(0., dtype=float32, weak_type=True)}
  """
  state = find_state(opt_state)
  if pytrees.was_updated(state):
    raise ValueError(
      "rollback_if_skipped got the optimizer state from before this step's "
      "update (the very state update was given): its flag says whether the "
      "previous step was applied, not this one. Pass the state update "
      "returned: updates, opt_state = opt.update(grads, opt_state, params); "
      "new = jaxmp.rollback_if_skipped(opt_state, new, old)"
    )
  finite = _accumulation_flag(opt_state)
  if finite is None:
    finite = state.step_applied
  finite = jax.tree_util.tree_leaves(finite)[0]  # An NNX variable's array.
  nnx_support.check_not_aliased(new, old)
  select = lambda n, o: jnp.where(finite, n, o)
  if not nnx_support.is_module(new):
    return jax.tree.map(select, new, old)
  nnx = nnx_support.nnx()
  kinds = list(dict.fromkeys(type(v) for v in nnx_support.variables(old)))
  if not kinds:
    return new
  live = nnx.state(new, kinds[0] if len(kinds) == 1 else nnx.Any(*kinds))
  nnx.update(new, jax.tree.map(select, live, old))
  return new


def _accumulation_flag(opt_state: Any) -> Optional[jax.Array]:
  """The microbatch flag of the `jaxmp.multi_steps` around the jaxmp state."""
  kinds = (pytrees.AccumulationState, optax.MultiStepsState)
  is_acc = lambda x: isinstance(x, kinds)
  for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_acc):
    if isinstance(x, pytrees.AccumulationState):
      return x.microbatch_finite
    if is_acc(x) and pytrees.contains(x, pytrees.MixedPrecisionState):
      raise ValueError(
        "optax.MultiSteps around jaxmp.mixed_precision: its state does not "
        "say whether the microbatch just seen was finite, so "
        "rollback_if_skipped cannot tell which statistics to keep; use "
        "jaxmp.multi_steps(jaxmp.mixed_precision(inner), k) instead"
      )
  return None


def nonfinite_loss_message(first: int, last: int, scale: float) -> str:
  """What a run of NaN/inf losses can mean, and how to tell the causes apart."""
  find = (
    "run the step's loss function under jaxmp.autocast(loss_fn, "
    "debug=True), whose report names the first forward op that "
    "overflowed, or run the step in fp32"
  )
  return (
    f"the loss itself was NaN/inf at steps {first}..{last} "
    f"({last - first + 1} in a row). Three causes: bad input data (check "
    "the batch for NaN/inf), a diverged model (lower the learning rate), or "
    "an fp16 overflow in the forward pass, in the activations, which no "
    "loss scale can fix (it only scales the backward pass). To tell: "
    f"{find}. The steps were skipped and the loss scale was left at "
    f"{scale:g}"
  )


def check_health(
  opt_state: Any,
  step: int,
  max_consecutive_skips: int = 100,
  max_nonfinite_loss_steps: Optional[int] = None,
) -> None:
  """Raises when training cannot recover: a host-side check for loops.

  Call it on log steps (it fetches a few scalars from the device). It stops
  two things:

  * a non-finite loss: ``max_nonfinite_loss_steps`` or more steps in a row
    whose loss, given to ``update(..., loss=loss)``, was inf/NaN. The loss
    scale is not the cause (it is left alone on those steps): bad input
    data, a diverged model, or an fp16 overflow of the forward pass's
    activations is (the message says how to tell them apart).
  * a collapsed loss scale: ``max_consecutive_skips`` or more steps in a row
    skipped for non-finite gradients with the scale at its floor (a static
    scale always is): nan/inf that loss scaling cannot fix. Without
    ``loss=``, a NaN loss ends up here.

  With ``skip_spikes`` it stops a third: ``max_consecutive_skips`` or more
  steps in a row dropped as spikes. The windows only take accepted steps,
  so a lasting jump of the loss or of the gradient norm (a new phase of the
  schedule, a new data mix) would otherwise drop every later step.

  Args:
    opt_state: the optax state holding a `mixed_precision` state.
    step: the number of steps taken so far (for the message).
    max_consecutive_skips: how many skipped steps in a row to tolerate.
    max_nonfinite_loss_steps: how many non-finite losses in a row to
      tolerate; ``None`` for ``max_consecutive_skips``.

  Raises:
    NonFiniteLossError: naming the step range of the non-finite losses.
    LossScaleCollapseError: naming the step range and the scale.
    SpikeStallError: naming the step range of the dropped steps.
  """
  state = find_state(opt_state)
  if max_nonfinite_loss_steps is None:
    max_nonfinite_loss_steps = max_consecutive_skips
  if state.consecutive_nonfinite_loss is not None:
    bad = int(to_host(state.consecutive_nonfinite_loss))
    if bad >= max_nonfinite_loss_steps:
      raise NonFiniteLossError(
        nonfinite_loss_message(
          step - bad + 1, step, float(to_host(state.loss_scale))
        )
      )
  skips, scale = (
    int(to_host(state.consecutive_overflows)),
    float(to_host(state.loss_scale)),
  )
  cfg = state.config
  at_floor = cfg.kind != "dynamic" or scale <= cfg.min_loss_scale
  if skips >= max_consecutive_skips and at_floor:
    raise LossScaleCollapseError(
      f"loss scale collapsed: steps {step - skips + 1}..{step} "
      f"({skips} in a row) had non-finite gradients and were skipped, with "
      f"the loss scale at its floor {scale:g}; check the input data for "
      "NaN/inf and the learning rate"
    )
  if state.spikes is not None:
    run = int(to_host(state.spikes.consecutive_spike_skips))
    if run >= max_consecutive_skips:
      raise SpikeStallError(
        f"steps {step - run + 1}..{step} ({run} in a row) were all dropped "
        "as spikes: their loss or gradient norm stayed above mean + factor "
        "* std of the window of accepted steps, which only accepted steps "
        "renew. A lasting jump (a learning-rate or data change) looks like "
        "this; raise skip_spikes' factor, or restart the windows with "
        "state._replace(spikes=opt.init(params).spikes)"
      )
