"""`mixed_precision`: FP32 masters and dynamic loss scaling in one transform.

An optax transform in the shape of `optax.apply_if_finite`: a factory of two
pure closures around an inner optimizer, its hyperparameters in the closure,
its state a `NamedTuple`. Each ``update`` is four named steps:

1. `_finite_flags`: are the gradients (and the loss, when given) finite, on
   every device of ``axis_name``;
2. the inner step: unscale in fp32, run ``inner`` on the fp32 view of the
   params that the master-weights mode gives (`master_weights`:
   one small object per mode), keep its state only if the step is applied;
3. `_outer_updates`: the half params' updates that land them on the mode's
   targets (``cast(master)`` for fp32 masters), ``-0.0`` on a skipped step;
4. `_next_counters`: the loss-scale rule (`scaling.loss_scale`) and the
   skip counters.

A skipped step is written branch-free with `jnp.where`: the selects fuse into
the elementwise kernels of the optimizer update, so a skipped step costs no
extra pass over the params and the step stays one straight-line XLA program
(a `lax.cond` would split it into separately scheduled computations).

Names: a step is *applied* when its gradients are finite (``grads_finite``,
the flag the loss-scale rule reads) and so is its loss, when given
(``loss_finite``), and, with ``skip_spikes``, it is no spike
(`jaxmp.SpikeSkip`). ``skipped_steps`` counts every step skipped for a
non-finite value, gradients or loss (spikes are counted apart, in
``spikes.spike_skips``); ``consecutive_overflows`` counts the steps skipped
for non-finite gradients in a row (a step skipped for a non-finite loss
neither counts nor breaks the run: it is counted in ``nonfinite_loss_steps``
and ``consecutive_nonfinite_loss``).
"""

import sys
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._src import nnx_support
from jaxmp._src.inspect import placement
from jaxmp._src.scaling import diagnostics as diag
from jaxmp._src.scaling import finite as finite_lib
from jaxmp._src.scaling import loss_scale as loss_scale_lib
from jaxmp._src.scaling import spikes as spikes_lib
from jaxmp._src.scaling import unscaled
from jaxmp._src.state import checks
from jaxmp._src.state import master_weights as masters_lib
from jaxmp._src.state import modes as modes_lib
from jaxmp._src.state import pytrees
from jaxmp._src.state import rounding_figures as rounding_lib
from jaxmp._src.state import sharding as sharding_lib
from jaxmp._src.state import state_codec

# Re-exported: the public names live here since the first release.
LossScaler = loss_scale_lib.LossScaler
LossScale = LossScaler  # The old name, kept for one release (deprecated).
LossScaleConfig = loss_scale_lib.LossScaleConfig
adjust_loss_scale = loss_scale_lib.adjust_loss_scale
MASTER_WEIGHTS = masters_lib.MODES
StateQuantization = state_codec.StateQuantization
# The state is defined with the other state pytrees (`state.pytrees`).
MixedPrecisionState = pytrees.MixedPrecisionState


def mixed_precision(
  inner: optax.GradientTransformation,
  *,
  loss_scale: Optional[Union[loss_scale_lib.LossScaler, float]] = None,
  max_loss_scale: Optional[float] = 2.0**24,
  hysteresis: int = 1,
  master_weights: Union[bool, str] = True,
  axis_name: Optional[str] = None,
  diagnostics: bool = False,
  rounding_key: Union[int, jax.Array] = 0,
  skip_spikes: Optional[spikes_lib.SpikeSkip] = None,
  optimizer_state: Union[str, StateQuantization] = "fp32",
  rounding_every: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """Wraps an optax optimizer with FP32 master params and loss scaling.

  The gradients given to ``update`` are those of ``loss * scale`` (use
  `jaxmp.value_and_grad`, or `jaxmp.scale_loss`). They are unscaled in fp32
  with the scale the forward pass used and checked for inf/nan over the
  whole tree. A finite step runs
  ``inner`` on the fp32 gradients and fp32 masters; a non-finite step returns
  zero updates and leaves masters and ``inner``'s state untouched. Then the
  scale is adjusted by jmp's rule, which is GradScaler's (written out in
  `jaxmp.adjust_loss_scale`).

  For every float16/bfloat16 param the state keeps an fp32 master, and the
  returned (fp32) updates satisfy ``optax.apply_updates(params, updates) ==
  new_master.astype(param.dtype)`` bit for bit, except where a half-precision
  param shrinks more than 2**13-fold in one step to a nonzero value (a single
  fp32 update cannot express that; the error is then below
  ``2**-24 * |old param|``), and except for one signed zero: where
  ``cast(new master)`` is ``-0.0`` and the param was not ``-0.0``, the param
  becomes ``+0.0`` (in round-to-nearest ``p + u`` is ``-0.0`` only when both
  are ``-0.0``). Both zeros compare equal. (Where XLA flushes fp32
  subnormals, as on CPU, a bfloat16 subnormal acts as a zero of its sign.)
  fp32 params are their own masters.

  Placement: ``mixed_precision`` must be the outermost transform, wrapping the
  whole optimizer, e.g. ``mixed_precision(optax.chain(clip, adam))``. The two
  other placements are wrong. A transform chained before it
  (``optax.chain(clip, mixed_precision(adam))``) sees the *scaled* gradients,
  which can be inf/nan: clipping then uses a norm ``scale`` times too large
  and statistics are poisoned. A transform chained after it
  (``optax.chain(mixed_precision(adam), optax.add_decayed_weights(...))``)
  changes updates the masters never see, and moves the params on skipped
  steps too; a half param lands on ``cast(master)`` again at the next step,
  which quietly undoes the move (an fp32 param keeps it). Inside
  ``optax.multi_transform``/``optax.masked`` part of the gradients would never
  be unscaled nor checked: ``init`` rejects it; use
  ``mixed_precision(optax.multi_transform(...))``. The placement is checked,
  at trace time, where the whole optimizer state is first seen:
  `jaxmp.value_and_grad` and `jaxmp.scale_loss` reject a state whose
  ``mixed_precision`` sits in a chain or inside another optax wrapper, the
  ``init`` of a ``mixed_precision`` rejects one nested inside it (for example
  the optimizer of `jaxmp.initialize` wrapped again), and `jaxmp.multi_steps`
  rejects a misplaced one inside it; each error shows the right chain.

  For gradient accumulation put `jaxmp.multi_steps` (a fixed
  `optax.MultiSteps`) outside: ``jaxmp.multi_steps(mixed_precision(inner),
  k)``. The scale then stays fixed within an accumulation window and the
  window is skipped as a whole when any of its microbatches overflowed.
  ``MultiSteps`` inside ``mixed_precision`` is rejected by ``init``, and a
  plain ``optax.MultiSteps`` around it by `jaxmp.value_and_grad`.

  ``update(grads, state, params, loss=loss)`` optionally takes the step's
  *unscaled* loss (it is not passed on to ``inner``). When the loss itself is
  inf/NaN (bad data, a diverged model) the step is skipped but the loss-scale
  rule does not see it: the scale, its growth counter and
  ``consecutive_overflows`` stay as they were, and the step is counted in
  ``nonfinite_loss_steps`` (and ``skipped_steps``) instead
  (`jaxmp.check_health` tells the two apart). A non-finite loss can also be
  an fp16 overflow in the forward pass (the activations), which no loss
  scale fixes. Without ``loss=`` a NaN loss shows up as non-finite gradients and
  backs the scale off, as in every other scaler. Under `jaxmp.multi_steps`
  only the loss given with a window's last microbatch is checked.

  Master weights (``master_weights``) decide how a half-precision param
  takes an fp32 update ``u`` computed from its fp32 value ``v``:

  - ``True``/``"fp32"``: an fp32 master ``m`` in the state (4 bytes a
    param): ``m += u``, param ``= cast(m)``.
  - ``"kahan"``: a compensation buffer ``c`` in the param's dtype (2 bytes):
    ``v = param + c``, then ``param, c = split(v + u)``, ``param`` the
    nearest half value and ``c`` the rest. The inner optimizer sees
    ``param + c``. Each
    step adds an error of at most ``2**-p * ulp(param) / 2`` (``p`` = 8 for
    bfloat16), far below a plain half update's ``ulp / 2``; float16's
    compensation goes subnormal, and loses bits, for params below about
    ``2**-4``.
  - ``"stochastic"``: no buffer; ``param = stochastic_round(v + u)``, up or
    down at random in proportion, so every update counts in expectation. The
    key is in the state (from ``rounding_key``): the rounding is
    deterministic given it, and a skipped step does not advance it. Under
    ``shard_map``/``pmap`` every device draws from the same key, so
    replicated params round identically; shards of a param split over
    devices each reuse the same stream (independent of each other only in
    that their values differ).
  - ``"remainder"`` (bfloat16 params only): an int16 buffer (2 bytes)
    holding the low 16 bits of the fp32 master, whose high 16 bits are the
    param: `jaxmp.master_params` is bit for bit the master ``"fp32"`` keeps,
    at half its bytes. The param is the master rounded to nearest with ties
    away from zero: it differs from ``"fp32"``'s ``cast(master)`` only on
    exact ties (one master in 65,536), by one ulp. Exact as long as each
    param takes its update (the exceptions above: a param shrinking more
    than 2**13-fold in one step, and bfloat16 subnormals where XLA flushes
    them). float16 params are rejected (float16 is no half of float32).
  - ``False``/``"none"``: no buffer, round to nearest (Apex O3): an update
    below half an ulp of the param is lost.

  Skipped steps leave masters, compensation, remainder and key untouched. fp32 params
  are their own masters in every mode. `jaxmp.master_params` returns the
  best fp32 estimate: the master, ``param + c``, or the upcast param.

  Spike skipping (``skip_spikes=jaxmp.SpikeSkip(window, factor)``) also
  drops a finite step whose loss (given with ``loss=``) or the global L2
  norm of whose unscaled fp32 gradients exceeds, strictly, ``mean + factor *
  std`` (population std) of the last ``window`` accepted steps; nothing is
  dropped before the window has filled. The loss and the norm have windows
  of their own: without ``loss=`` (flax's ``TrainState.apply_gradients``)
  the norm alone decides, and a spike in the loss that leaves the gradients
  ordinary goes through. Neither a dropped step nor an overflowed one enters
  the windows. A dropped step is rolled back exactly as an overflowed one
  (``step_applied`` is False: masters, inner state, compensation, key, and
  `jaxmp.rollback_if_skipped` for the caller's state), is counted in
  ``jaxmp.stats(state)["spike_skips"]`` (not in ``skipped_steps``), and
  leaves the loss scale, its growth counter and the overflow counters as
  they were. Under ``shard_map``/``pmap`` with ``axis_name`` the norm and
  the loss are made global first, so every device decides alike.

  Args:
    inner: the optimizer to run on unscaled fp32 gradients and masters, e.g.
      ``optax.sgd(0.1, momentum=0.9)`` or any chain.
    loss_scale: ``jmp.DynamicLossScale``, ``jmp.StaticLossScale``,
      ``jmp.NoOpLossScale``, a positive number (static) or ``None`` for
      ``jmp.DynamicLossScale(2**15)`` (period 2000, factor 2, floor 1).
    max_loss_scale: cap of a dynamic scale; ``None`` for no cap (the scale
      still never grows to inf).
    hysteresis: a dynamic scale backs off only from the ``hysteresis``-th
      overflow in a row; every overflowed step is skipped regardless.
    master_weights: how half-precision params keep their fp32 updates:
      ``True``/``"fp32"`` (fp32 masters), ``"kahan"``, ``"stochastic"``,
      ``"remainder"`` (exact fp32 masters in 2 bytes, bfloat16 params) or
      ``False``/``"none"`` (Apex O3, the plain half update); see above. Or
      per leaf: a function ``(path, param) -> mode`` or a pytree of modes
      (`jaxmp.rounding_report` can choose), each leaf as under its mode.
    axis_name: name of a mapped axis (``shard_map``/``pmap``) over which the
      finite flag is reduced, so that every device skips together. Not needed
      under ``jit`` with sharded arrays: the check is global there. Under
      ``shard_map`` without it, device-varying gradients make the flag, the
      scale and the counters device-varying too: their ``out_specs`` must
      then be ``P(axis)``, not ``P()`` (``check_vma`` rejects ``P()``).
    diagnostics: keep the last step's per-leaf gradient statistics in the
      state (non-finite count, largest finite ``|unscaled gradient|``, and
      the zero-or-subnormal fraction of half-precision gradients); read them
      with `jaxmp.overflow_report`. ``False`` (the default) leaves the state
      and the compiled step exactly as without it.
    rounding_key: the seed (an int) or PRNG key of
      ``master_weights="stochastic"``; ignored by the other modes.
    skip_spikes: a `jaxmp.SpikeSkip` to drop steps whose loss or gradient
      norm spikes (see above); ``None`` (the default) leaves the state and
      the compiled step exactly as without it.
    optimizer_state: how ``inner``'s state is stored between steps:
      ``"fp32"`` (as ``inner`` keeps it), ``"bf16"`` (2 bytes an element),
      ``"int8"`` (1 byte, and an fp32 scale per block of 256 along the last
      axis), or a `jaxmp.StateQuantization` with its block size and
      ``min_size`` (leaves under 4096 elements are kept as they are). The
      subtrees of the state shaped like the params (Adam's moments, a
      momentum) are encoded leaf by leaf; each step decodes them, runs
      ``inner`` in fp32 and encodes the result. `jaxmp.state_summary` lists
      how each leaf is stored. A skipped step leaves the codes bit for bit.
    rounding_every: ``N > 0`` measures, on the ``N``-th, ``2N``-th, ...
      applied step, what each param's half dtype alone loses of its update;
      read it with `jaxmp.rounding_report`. ``0`` (the default) leaves the
      state and the compiled step exactly as without it.

  Returns:
    An `optax.GradientTransformationExtraArgs`; extra args go to ``inner``.

  >>> import jax.numpy as jnp, optax, jaxmp
  >>> params = {"w": jnp.ones(3, jnp.float16)}
  >>> opt = jaxmp.mixed_precision(optax.sgd(0.5), loss_scale=8.0)
  >>> state = opt.init(params)
  >>> grads = {"w": jnp.full(3, 8.0, jnp.float16)}  # d(8 * loss)/dw
  >>> updates, state = opt.update(grads, state, params)
  >>> optax.apply_updates(params, updates)["w"]
  Array([0.5, 0.5, 0.5], dtype=float16)
  """
  config, initial_scale = loss_scale_lib.config_from(
    loss_scale, max_loss_scale, hysteresis
  )
  if not isinstance(diagnostics, (bool, np.bool_)):
    raise TypeError(
      f"diagnostics must be a Python bool, got {diagnostics!r}; with "
      "optax.inject_hyperparams pass it in static_args"
    )
  mode = modes_lib.get_mode(master_weights, rounding_key)
  rounding_every = rounding_lib.check_every(rounding_every)
  skip_spikes = spikes_lib.check_config(skip_spikes)
  codec = state_codec.get_codec(optimizer_state)
  inner = optax.with_extra_args_support(inner)

  @sharding_lib.placed_like_params  # Also under jit: see `sharding`.
  def build(params):
    _check_params(params)
    buffers = mode.init(params)
    inner_state = inner.init(mode.view(params, buffers))
    pytrees.check_inner_state(inner_state)
    inner_state = state_codec.encode_state(inner_state, params, codec)
    return MixedPrecisionState(
      inner_state=inner_state,
      master_params=buffers.master_params,
      loss_scale=jnp.asarray(initial_scale, jnp.float32),
      growth_counter=jnp.zeros([], jnp.int32),
      step_applied=jnp.ones([], jnp.bool_),
      skipped_steps=jnp.zeros([], jnp.int32),
      consecutive_overflows=jnp.zeros([], jnp.int32),
      config=config,
      nonfinite_loss_steps=jnp.zeros([], jnp.int32),
      consecutive_nonfinite_loss=jnp.zeros([], jnp.int32),
      diagnostics=diag.init_diagnostics(params) if diagnostics else None,
      compensation=buffers.compensation,
      rounding_key=buffers.rounding_key,
      spikes=spikes_lib.init(skip_spikes) if skip_spikes else None,
      remainder=buffers.remainder,
      optimizer_state=codec,
      rounding=rounding_lib.init(params, rounding_every),
      master_modes=mode.names(params) if mode.name == "per-leaf" else None,
    )

  def init_fn(params):
    # NNX params (variables): every variable of the state holds one array.
    return nnx_support.settle(build(params), state_codec.named_axes)

  def update_fn(grads, state, params=None, *, loss=None, **extra_args):
    if params is None:
      raise ValueError(
        "mixed_precision.update needs params: "
        "opt.update(grads, opt_state, params)"
      )
    placement.check_chain(sys._getframe(1), update_fn.__code__)  # pylint: disable=protected-access
    # NNX variables (the split/merge route): the step runs on their arrays,
    # and the updates and the state come back in variables as they came.
    given_state, given_params = state, params
    grads, state, params = nnx_support.unwrap((grads, state, params))
    updates, state = _update(grads, state, params, loss, extra_args)
    return (
      nnx_support.wrap_like(updates, given_params),
      nnx_support.wrap_like(state, given_state),
    )

  def _update(grads, state, params, loss, extra_args):
    pytrees.check_inner_state(state.inner_state)
    spikes_lib.check_state(skip_spikes, state.spikes)
    checks.check_state(state, state.master_params, params, "state")
    unscaled.warn_if_unscaled(state)
    pytrees.mark_updated(state)
    scale = state.loss_scale
    grads_finite, loss_finite = _finite_flags(
      grads, loss, scale, config, axis_name
    )
    finite = grads_finite if loss_finite is None else grads_finite & loss_finite
    # Multiplying by the reciprocal is exact for power-of-two scales.
    inv_scale = 1.0 / scale
    report = (
      diag.grad_diagnostics(grads, inv_scale, axis_name)
      if diagnostics
      else None
    )

    # The inner step, on unscaled fp32 gradients and the fp32 view.
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * inv_scale, grads)
    applied, spike, spikes = finite, None, state.spikes
    if skip_spikes is not None:
      spike, spikes = spikes_lib.step(
        skip_spikes,
        state.spikes,
        spikes_lib.global_norm(grads, axis_name),
        None if loss is None else spikes_lib.global_loss(loss, axis_name),
        finite,
      )
      applied = finite & ~spike
    buffers = masters_lib.Buffers(
      state.master_params,
      state.compensation,
      state.rounding_key,
      state.remainder,
    )
    checks.check_dtypes(mode, params, buffers)
    view = mode.view(params, buffers)
    # Encoded state: decoded, updated in fp32 and encoded in this one step.
    inner_updates, inner_state = inner.update(
      grads, state_codec.decode_state(state.inner_state), view, **extra_args
    )
    inner_state = state_codec.encode_like(inner_state, state.inner_state)
    inner_state = jax.tree.map(
      lambda new, old: jnp.where(applied, new, old),
      inner_state,
      state.inner_state,
    )
    new_view = optax.apply_updates(view, inner_updates)
    targets, buffers = mode.targets(params, new_view, buffers, applied)
    rounding = state.rounding  # With rounding_every (the period is in it).
    if rounding is not None:
      rounding = rounding_lib.step(
        rounding, params, inner_updates, new_view, applied, axis_name
      )
    updates = _outer_updates(params, inner_updates, targets, applied)

    new_scale, counter, overflows, loss_steps, loss_run = _next_counters(
      config, state, grads_finite, loss_finite
    )
    if spike is not None:
      # A spike leaves the loss-scale rule as it was (as if never seen).
      hold = lambda new, old: jnp.where(spike, old, new)
      new_scale = hold(new_scale, state.loss_scale)
      counter = hold(counter, state.growth_counter)
      overflows = hold(overflows, state.consecutive_overflows)
      if loss_run is not None:
        loss_run = hold(loss_run, state.consecutive_nonfinite_loss)
    return updates, MixedPrecisionState(
      inner_state=inner_state,
      master_params=buffers.master_params,
      loss_scale=new_scale,
      growth_counter=counter.astype(jnp.int32),
      step_applied=applied,
      skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
      consecutive_overflows=overflows.astype(jnp.int32),
      config=config,
      nonfinite_loss_steps=loss_steps,
      consecutive_nonfinite_loss=loss_run,
      diagnostics=report,
      compensation=buffers.compensation,
      rounding_key=buffers.rounding_key,
      spikes=spikes,
      remainder=buffers.remainder,
      optimizer_state=codec,
      rounding=rounding,
      master_modes=state.master_modes,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_params(params) -> None:
  if pytrees.contains(params, optax.MaskedNode):
    raise ValueError(
      "mixed_precision inside optax.multi_transform or optax.masked sees "
      "only part of the params: the other groups' gradients are never "
      "unscaled and their inf/nan never skips the step; wrap the whole "
      "optimizer instead: jaxmp.mixed_precision(optax.multi_transform("
      "...))"
    )
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
      raise ValueError(
        "mixed_precision needs floating-point params; "
        f"{jax.tree_util.keystr(path)} has dtype {leaf.dtype}"
      )


def _finite_flags(grads, loss, scale, config, axis_name):
  """``(grads_finite, loss_finite)``, the same on every device of the axis.

  ``loss_finite`` is ``None`` when no loss was given.
  """
  # With a scale >= 1 unscaling cannot overflow: check the raw gradients
  # and let XLA fuse the check into one read of them.
  if config.min_loss_scale >= 1:
    grads_finite = finite_lib.all_finite(grads)
  else:
    grads_finite = finite_lib.all_finite(
      jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
    )
  grads_finite = finite_lib.all_devices(grads_finite, axis_name)
  if loss is None:
    return grads_finite, None
  loss_finite = jnp.all(jnp.isfinite(jnp.asarray(loss)))
  return grads_finite, finite_lib.all_devices(loss_finite, axis_name)


def _outer_updates(params, inner_updates, targets, applied):
  """The updates of the params themselves: onto a target, or the inner one.

  An fp32 update lands a half param exactly on ``cast(target)`` (see
  `mixed_precision`); ``None`` targets (fp32 params, no masters) take the
  inner update as it is. A skipped step returns ``-0.0``, the additive
  identity of every float, signed zeros included.
  """

  def update(p, u, t):
    if t is not None:
      # Where they already agree bit for bit, -0.0 keeps p as it is (a
      # -0.0 param plus the +0.0 of ``t - p`` would turn into +0.0).
      t = t.astype(p.dtype)
      same = (t == p) & (jnp.signbit(t) == jnp.signbit(p))
      u = jnp.where(
        same,
        jnp.asarray(-0.0, jnp.float32),
        t.astype(jnp.float32) - p.astype(jnp.float32),
      )
    return jnp.where(applied, u, jnp.asarray(-0.0, u.dtype))

  return jax.tree.map(update, params, inner_updates, targets)


def _next_counters(config, state, grads_finite, loss_finite):
  """The loss-scale rule and the skip counters after this step.

  Returns ``(scale, growth_counter, consecutive_overflows,
  nonfinite_loss_steps, consecutive_nonfinite_loss)``.
  """
  overflows = jnp.where(grads_finite, 0, state.consecutive_overflows + 1)
  scale, counter = adjust_loss_scale(
    config, state.loss_scale, state.growth_counter, overflows, grads_finite
  )
  loss_steps = state.nonfinite_loss_steps
  loss_run = state.consecutive_nonfinite_loss
  if loss_finite is not None:
    # A non-finite loss says nothing about the scale: the rule skips it.
    overflows = jnp.where(loss_finite, overflows, state.consecutive_overflows)
    scale = jnp.where(loss_finite, scale, state.loss_scale)
    counter = jnp.where(loss_finite, counter, state.growth_counter)
    loss_steps = loss_steps + (~loss_finite).astype(jnp.int32)
    loss_run = jnp.where(loss_finite, 0, loss_run + 1).astype(jnp.int32)
  return scale, counter, overflows, loss_steps, loss_run
