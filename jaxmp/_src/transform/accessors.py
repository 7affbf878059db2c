"""Reading and using the `mixed_precision` state from anywhere in an optax state.

Users wrap `jaxmp.mixed_precision` in their own chains, `optax.MultiSteps`,
`optax.inject_hyperparams` or `optax.multi_transform`; these helpers find its
state wherever it sits, so the training step never has to know the nesting.
"""

import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

from jaxmp._src.transform import accumulation
from jaxmp._src.scaling import diagnostics as diag
from jaxmp._src.transform import master_weights as masters_lib
from jaxmp._src.transform import mixed_precision as mp
from jaxmp._src import nnx_support
from jaxmp._src.transform import placement
from jaxmp._src.transform import rounding_report as rounding_lib
from jaxmp._src.transform import state_codec
from jaxmp._src.scaling import unscaled


def _host(x) -> np.ndarray:
  """Fetches a replicated array, also when it spans several processes."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(x.addressable_data(0))
  return np.asarray(jax.device_get(x))


class LossScaleCollapseError(RuntimeError):
  """The loss scale sat at its floor while steps kept being skipped."""


class NonFiniteLossError(RuntimeError):
  """The loss itself was inf/NaN for many steps in a row (not an overflow)."""


class SpikeStallError(RuntimeError):
  """Every step for many steps in a row was dropped as a spike."""


def _a(name: str) -> str:
  return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def find_state(
  opt_state: Any, what: str = "opt_state"
) -> mp.MixedPrecisionState:
  """Returns the one `MixedPrecisionState` inside ``opt_state``.

  Args:
    opt_state: an optax state that contains exactly one `mixed_precision`
      state, at any depth.
    what: how the error names ``opt_state`` (which argument it was).

  Returns:
    That state.

  Raises:
    ValueError: when there is none or more than one.
  """
  is_mp = lambda x: isinstance(x, mp.MixedPrecisionState)
  found = [
    x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_mp) if is_mp(x)
  ]
  if not found:
    raise ValueError(
      f"no jaxmp.mixed_precision state found in {what} (got "
      f"{_a(type(opt_state).__name__)}); build the optimizer with "
      "jaxmp.mixed_precision(...) and pass the state it initialised"
    )
  if len(found) > 1:
    if any(_contains_mp(x.inner_state) for x in found):
      mp._check_inner_state(found[0].inner_state)  # pylint: disable=protected-access
    raise ValueError(
      f"found {len(found)} jaxmp.mixed_precision states in opt_state; use "
      "one mixed_precision around the whole optimizer (wrap multi_transform "
      "inside it, not the other way round)"
    )
  return found[0]


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
  """Multiplies ``loss`` by the current loss scale (Apex's ``amp.scale_loss``).

  A half-precision loss is promoted to fp32 first, as Apex's
  ``loss.float() * scale``: a float16 loss of 3.0 times 2**15 would be inf.

  Args:
    loss: a scalar loss.
    opt_state: the optax state holding a `mixed_precision` state.

  Returns:
    ``loss * scale`` in fp32 (or in ``loss``'s dtype if it is wider).

  Raises:
    ValueError: when ``mixed_precision`` is not the outermost transform of
      ``opt_state`` (nor directly inside `jaxmp.multi_steps`).

  `jaxmp.value_and_grad` does this and the gradient in one call, and hands
  the unscaled loss back. Inside a traced function ``opt_state`` must be an
  argument of it: one read from a global or a closure is a constant of the
  compiled program, with a stale scale; it warns once.
  """
  state = locate(
    opt_state,
    "jaxmp.scale_loss",
    "opt_state, the second argument of jaxmp.scale_loss(loss, opt_state)",
  )
  return scaled(loss, state.loss_scale)


def locate(
  opt_state: Any, caller: str, what: str = "opt_state"
) -> mp.MixedPrecisionState:
  """`find_state`, with the placement checked and a captured state warned."""
  state = find_state(opt_state, what)
  placement.check_placement(opt_state, state, accumulation.AccumulationState)
  placement.warn_if_captured(state, caller)
  unscaled.mark_scaled(state)
  return state


def scaled(loss: jax.Array, scale: Any) -> jax.Array:
  """``loss * scale`` in fp32 or wider (``scale`` may be an NNX variable)."""
  loss = jnp.asarray(loss)
  dtype = jnp.promote_types(loss.dtype, jnp.float32)
  scale = jax.tree_util.tree_leaves(scale)[0]
  return loss.astype(dtype) * scale.astype(dtype)


def loss_scale(opt_state: Any) -> mp.LossScaler:
  """Deprecated alias of `jaxmp.loss_scaler`, kept for one release."""
  warnings.warn(
    "jaxmp.loss_scale(opt_state) is deprecated and will be removed in the "
    "next release: use jaxmp.loss_scaler(opt_state) (the jmp object; the "
    "scale itself is jaxmp.stats(opt_state)['loss_scale'])",
    DeprecationWarning,
    stacklevel=2,
  )
  return loss_scaler(opt_state)


def loss_scaler(opt_state: Any) -> mp.LossScaler:
  """Returns the current loss scaler, the jmp object with the current scale.

  The *loss scale* is the number the loss is multiplied by
  (``jaxmp.stats(opt_state)["loss_scale"]``); the *loss scaler* is the jmp
  object that also says how it moves. (Formerly ``jaxmp.loss_scale``.)

  Args:
    opt_state: the optax state holding a `mixed_precision` state.

  Returns:
    A `jmp.DynamicLossScale` (with this state's scale, counter, period, factor
    and floor), a `jmp.StaticLossScale` or a `jmp.NoOpLossScale`.

  >>> import optax, jaxmp
  >>> state = jaxmp.mixed_precision(optax.sgd(0.1)).init({})
  >>> jaxmp.loss_scaler(state).loss_scale
  Array(32768., dtype=float32)
  """
  state = find_state(opt_state)
  cfg = state.config
  if cfg.kind == "noop":
    return jmp.NoOpLossScale()
  if cfg.kind == "static":
    return jmp.StaticLossScale(state.loss_scale)
  return jmp.DynamicLossScale(
    loss_scale=state.loss_scale,
    counter=state.growth_counter,
    period=cfg.period,
    factor=cfg.factor,
    min_loss_scale=np.float32(cfg.min_loss_scale),
  )


def master_params(opt_state: Any, params: Optional[Any] = None) -> Any:
  """Returns the fp32 master params.

  Half-precision params have an fp32 master in the state. fp32 params are
  their own masters and are not copied into the state; pass ``params`` to
  fill them in. Without fp32 masters pass ``params`` too: with
  ``master_weights="kahan"`` a half param's estimate is ``param +
  compensation`` (exact in fp32), with ``"stochastic"`` or ``"none"`` it is
  the upcast param.

  Flax NNX: pass ``opt.opt_state`` and ``nnx.state(model, nnx.Param)`` as
  they are; the variables are unwrapped and the masters come back as a
  state of plain arrays.

  Args:
    opt_state: the optax state holding a `mixed_precision` state.
    params: the current params; needed only where the state holds no master.

  Returns:
    A tree of fp32 arrays shaped like the params.

  Raises:
    ValueError: when a leaf has no master and ``params`` was not given.
  """
  state = nnx_support.unwrap(find_state(opt_state))
  params = nnx_support.unwrap(params)
  masters = state.master_params
  if params is None:
    # None: a param without a master. A Placeholder is no param at all
    # (the None of an eqx.filter-ed field) and is handed back as None.
    missing = [
      jax.tree_util.keystr(path)
      for path, m in jax.tree_util.tree_leaves_with_path(
        masters, is_leaf=masters_lib.is_empty
      )
      if m is None
    ]
    if missing:
      raise ValueError(
        f"{len(missing)} param(s) have no fp32 master in the state (first: "
        f"{missing[0]}): fp32 params are their own masters, and "
        "master_weights other than 'fp32' keep none; call "
        "jaxmp.master_params(opt_state, params)"
      )
    return masters_lib.placeholders_to_none(masters)
  return mp.full_view(params, state)


def stats(opt_state: Any) -> dict[str, jax.Array]:
  """Returns the loss-scaling statistics as a dict of scalar arrays.

  Args:
    opt_state: the optax state holding a `mixed_precision` state.

  Returns:
    ``{"loss_scale", "step_applied", "skipped_steps",
    "consecutive_overflows", "nonfinite_loss_steps",
    "consecutive_nonfinite_loss", "spike_skips",
    "consecutive_spike_skips"}``: ``skipped_steps`` counts every step
    skipped for a non-finite value; ``consecutive_overflows`` the steps
    skipped for non-finite gradients in a row; the next two the steps
    skipped because the loss given to ``update(..., loss=)`` was inf/NaN (a
    NaN-loss step neither counts in ``consecutive_overflows`` nor breaks its
    run); the last two the steps dropped as spikes
    (``mixed_precision(..., skip_spikes=...)``; zeros without it), which
    ``skipped_steps`` does not count. Arrays stay on
    the device: fetch them with `jax.device_get` on log steps. The old keys
    ``"grads_finite"`` and ``"consecutive_skips"`` still read, with a
    `DeprecationWarning`, for one release.
  """
  state = find_state(opt_state)
  spikes = state.spikes
  if spikes is None:
    spike_skips = run = jnp.zeros([], jnp.int32)
  else:
    spike_skips, run = spikes.spike_skips, spikes.consecutive_spike_skips
  return Stats(
    loss_scale=state.loss_scale,
    step_applied=state.step_applied,
    skipped_steps=state.skipped_steps,
    consecutive_overflows=state.consecutive_overflows,
    nonfinite_loss_steps=state.nonfinite_loss_steps,
    consecutive_nonfinite_loss=state.consecutive_nonfinite_loss,
    spike_skips=spike_skips,
    consecutive_spike_skips=run,
  )


def state_summary(opt_state: Any) -> "StateSummary":
  """Returns how each leaf of the `mixed_precision` state is stored.

  One row per leaf (a ``StateRow``: ``path``, ``shape``, ``stored``,
  ``nbytes``, ``note``): the inner optimizer's state, encoded (``"int8"``,
  ``"bf16"``) or kept as it is (the note says why: under ``min_size``, or
  not a param-shaped leaf), the master buffers and the counters. Its
  ``nbytes`` is the total; its ``str`` a table. Host-side, no transfer.
  An abstract state (``jax.eval_shape(opt.init, params)``) gives the same
  rows: a state can be sized before it is built.

  Args:
    opt_state: the optax state holding a `mixed_precision` state, or its
      `jax.eval_shape` (`jax.ShapeDtypeStruct` leaves).

  Returns:
    A `StateSummary`, a list of rows.

  >>> import jax, jax.numpy as jnp, optax, jaxmp
  >>> opt = jaxmp.mixed_precision(
  ...     optax.adam(1e-3), optimizer_state=jaxmp.StateQuantization(
  ...         "int8", min_size=256))
  >>> params = {"w": jnp.ones((4, 256), jnp.bfloat16), "b": jnp.ones(4)}
  >>> summary = jaxmp.state_summary(opt.init(params))
  >>> [(r.path, r.stored, r.nbytes) for r in summary if "mu" in r.path]
  [(".inner_state[0].mu['b']", 'float32', 16), (".inner_state[0].mu['w']", 'int8', 1040)]
  >>> jaxmp.state_summary(jax.eval_shape(opt.init, params)) == summary
  True
  """
  state = find_state(opt_state)
  codec = getattr(state, "optimizer_state", None)
  out = StateSummary(state_codec.summary_rows(state, codec))
  modes = getattr(state, "master_modes", None)
  if modes is not None:
    out.master_modes = {path: m for path, m, _ in modes.names}
    out.masters_saved = modes.saved()
  return out


class StateSummary(list):
  """The rows of `state_summary`; ``nbytes`` sums them, ``str`` is a table.

  Attributes:
    master_modes: with per-leaf ``master_weights``, each param's mode by
      path; ``None`` with one mode for all.
    masters_saved: with per-leaf ``master_weights``, the bytes saved against
      fp32 masters for every half param; 0 otherwise.
  """

  master_modes: Optional[dict] = None
  masters_saved: int = 0

  @property
  def nbytes(self) -> int:
    """The bytes of every leaf."""
    return sum(r.nbytes for r in self)

  def __str__(self) -> str:
    """One line per leaf, then the total."""
    lines = [
      f"{r.path:<48} {str(r.shape):<16} {r.stored:<9} {r.nbytes:>10}  {r.note}"
      for r in self
    ]
    if self.master_modes is not None:
      counts = {}
      for m in self.master_modes.values():
        counts[m] = counts.get(m, 0) + 1
      modes = ", ".join(f"{n} {m}" for m, n in sorted(counts.items()))
      lines.append(
        f"master weights per leaf ({modes}): {self.masters_saved} bytes saved "
        "against fp32 masters everywhere"
      )
    return "\n".join(lines + [f"total {self.nbytes} bytes"])


_RENAMED_STATS = {
  "grads_finite": "step_applied",
  "consecutive_skips": "consecutive_overflows",
}


class Stats(dict):
  """The dict of `stats`; the renamed keys still read, with a warning."""

  def __missing__(self, key: str) -> Any:
    """A renamed key: the new key's value, with a `DeprecationWarning`."""
    if key not in _RENAMED_STATS:
      raise KeyError(key)
    new = _RENAMED_STATS[key]
    warnings.warn(
      f"jaxmp.stats(...)[{key!r}] is deprecated and will be removed in the "
      f"next release; use [{new!r}]",
      DeprecationWarning,
      stacklevel=2,
    )
    return self[new]


jax.tree_util.register_pytree_with_keys(
  Stats,
  lambda s: (
    tuple((jax.tree_util.DictKey(k), v) for k, v in sorted(s.items())),
    tuple(sorted(s)),
  ),
  lambda keys, values: Stats(zip(keys, values)),
)


def overflow_report(opt_state: Any) -> diag.OverflowReport:
  """Returns the last step's per-leaf gradient report, worst leaf first.

  Needs ``jaxmp.mixed_precision(..., diagnostics=True)``. Host-side: it
  fetches three small arrays (one entry per gradient leaf), so call it on
  log steps or after a skipped step.

  Args:
    opt_state: the optax state holding a `mixed_precision` state (also
      inside ``optax.chain``, `jaxmp.multi_steps`, ``inject_hyperparams`` or
      returned from ``shard_map``).

  Returns:
    A list of rows, one per gradient leaf, sorted by ``nonfinite`` then
    ``max_abs`` (both descending). Each row has ``path``
    (``jax.tree_util.keystr`` form), ``nonfinite`` (int), ``max_abs``
    (float, the largest finite ``|unscaled gradient|``) and
    ``zero_fraction`` (float, zero-or-subnormal share of a half-precision
    gradient; ``None`` for fp32 gradients), as attributes and as keys. Its
    ``str`` is a short table that names the first offending leaf; its
    ``offending`` property lists the rows with non-finite elements.

  Raises:
    ValueError: when the optimizer was built without ``diagnostics=True``.

  >>> import jax.numpy as jnp, optax, jaxmp
  >>> opt = jaxmp.mixed_precision(optax.sgd(0.1), diagnostics=True)
  >>> params = {"a": jnp.zeros(2, jnp.float16), "b": jnp.zeros(3)}
  >>> state = opt.init(params)
  >>> grads = {"a": jnp.ones(2, jnp.float16), "b": jnp.array([1, jnp.nan, 2])}
  >>> _, state = opt.update(grads, state, params)
  >>> rows = jaxmp.overflow_report(state)
  >>> rows[0].path, rows[0]["nonfinite"], rows[1].path
  ("['b']", 1, "['a']")
  """
  state = find_state(opt_state)
  if state.diagnostics is None:
    raise ValueError(
      "no gradient diagnostics in this state: build the optimizer with "
      "jaxmp.mixed_precision(..., diagnostics=True)"
    )
  d = state.diagnostics
  nonfinite, max_abs, zero = (
    _host(d.nonfinite),
    _host(d.max_abs),
    _host(d.zero_fraction),
  )
  loss_finite = None
  if state.consecutive_nonfinite_loss is not None:
    loss_finite = not int(_host(state.consecutive_nonfinite_loss))
  host = diag.GradDiagnostics(nonfinite, max_abs, zero, d.paths)
  return diag.report(host, loss_finite=loss_finite)


def rounding_report(opt_state: Any) -> rounding_lib.RoundingReport:
  """Returns what rounding cost each param leaf at the last measured step.

  Needs ``jaxmp.mixed_precision(..., rounding_every=N)``: every N-th
  applied step the jitted update measures, per leaf, what the param's half
  dtype alone makes of its fp32 update ``u`` (an fp32 param: bfloat16).
  Host-side: it fetches three small arrays (one entry per param leaf).

  Args:
    opt_state: the optax state holding a `mixed_precision` state (also
      inside ``optax.chain``, `jaxmp.multi_steps` or ``shard_map``'s output).

  Returns:
    A list of rows, worst first (the largest of ``stalled``, ``flushed``
    and ``|1 - quality|``), each with, as attributes and keys: ``path``;
    ``stalled``, the share of updated elements with ``cast(h + u) == h``;
    ``quality``, ``<cast(h + u) - h, u> / <u, u>``; ``flushed``, the share
    of nonzero fp32 masters the half dtype holds as zero or subnormal;
    ``step``, the applied step measured (1 for the first, 0 for none yet);
    ``advice``; ``master_weights``, the mode the advice names. Its ``str``
    is a table; ``master_weights()`` gives the per-leaf choice for
    ``mixed_precision(master_weights=...)``.

  Raises:
    ValueError: when the optimizer was built without ``rounding_every``.

  >>> import jax.numpy as jnp, optax, jaxmp
  >>> opt = jaxmp.mixed_precision(optax.adam(1e-4), rounding_every=1)
  >>> params = {"scale": jnp.ones(4, jnp.bfloat16)}
  >>> state = opt.init(params)
  >>> grads = {"scale": jnp.ones(4, jnp.bfloat16)}
  >>> _, state = opt.update(grads, state, params)
  >>> row = jaxmp.rounding_report(state)[0]
  >>> row.path, row.stalled, row.master_weights
  ("['scale']", 1.0, 'remainder')
  """
  state = find_state(opt_state)
  figures = getattr(state, "rounding", None)
  if figures is None:
    raise ValueError(
      "no rounding figures in this state: build the optimizer with "
      "jaxmp.mixed_precision(..., rounding_every=N) (N > 0: every N-th "
      "applied step is measured)"
    )
  return rounding_lib.report(figures, host=_host)


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
  if mp.was_updated(state):
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
  kinds = (accumulation.AccumulationState, optax.MultiStepsState)
  is_acc = lambda x: isinstance(x, kinds)
  for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_acc):
    if isinstance(x, accumulation.AccumulationState):
      return x.microbatch_finite
    if is_acc(x) and _contains_mp(x):
      raise ValueError(
        "optax.MultiSteps around jaxmp.mixed_precision: its state does not "
        "say whether the microbatch just seen was finite, so "
        "rollback_if_skipped cannot tell which statistics to keep; use "
        "jaxmp.multi_steps(jaxmp.mixed_precision(inner), k) instead"
      )
  return None


def _contains_mp(tree: Any) -> bool:
  is_mp = lambda x: isinstance(x, mp.MixedPrecisionState)
  return any(map(is_mp, jax.tree_util.tree_leaves(tree, is_leaf=is_mp)))


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
    bad = int(_host(state.consecutive_nonfinite_loss))
    if bad >= max_nonfinite_loss_steps:
      raise NonFiniteLossError(
        nonfinite_loss_message(
          step - bad + 1, step, float(_host(state.loss_scale))
        )
      )
  skips, scale = (
    int(_host(state.consecutive_overflows)),
    float(_host(state.loss_scale)),
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
    run = int(_host(state.spikes.consecutive_spike_skips))
    if run >= max_consecutive_skips:
      raise SpikeStallError(
        f"steps {step - run + 1}..{step} ({run} in a row) were all dropped "
        "as spikes: their loss or gradient norm stayed above mean + factor "
        "* std of the window of accepted steps, which only accepted steps "
        "renew. A lasting jump (a learning-rate or data change) looks like "
        "this; raise skip_spikes' factor, or restart the windows with "
        "state._replace(spikes=opt.init(params).spikes)"
      )
