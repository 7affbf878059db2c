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

from jaxmp._src import nnx_support
from jaxmp._src.inspect import placement
from jaxmp._src.scaling import loss_scale as loss_scale_lib
from jaxmp._src.scaling import unscaled
from jaxmp._src.state import master_weights as masters_lib
from jaxmp._src.state import pytrees
from jaxmp._src.state import state_codec


def to_host(x) -> np.ndarray:
  """Fetches a replicated array, also when it spans several processes."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(x.addressable_data(0))
  return np.asarray(jax.device_get(x))


def _a(name: str) -> str:
  return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def find_state(
  opt_state: Any, what: str = "opt_state"
) -> pytrees.MixedPrecisionState:
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
  is_mp = lambda x: isinstance(x, pytrees.MixedPrecisionState)
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
    if any(
      pytrees.contains(x.inner_state, pytrees.MixedPrecisionState)
      for x in found
    ):
      pytrees.check_inner_state(found[0].inner_state)
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
) -> pytrees.MixedPrecisionState:
  """`find_state`, with the placement checked and a captured state warned."""
  state = find_state(opt_state, what)
  placement.check_placement(opt_state, state, pytrees.AccumulationState)
  placement.warn_if_captured(state, caller)
  unscaled.mark_scaled(state)
  return state


def scaled(loss: jax.Array, scale: Any) -> jax.Array:
  """``loss * scale`` in fp32 or wider (``scale`` may be an NNX variable)."""
  loss = jnp.asarray(loss)
  dtype = jnp.promote_types(loss.dtype, jnp.float32)
  scale = jax.tree_util.tree_leaves(scale)[0]
  return loss.astype(dtype) * scale.astype(dtype)


def loss_scale(opt_state: Any) -> loss_scale_lib.LossScaler:
  """Deprecated alias of `jaxmp.loss_scaler`, kept for one release."""
  warnings.warn(
    "jaxmp.loss_scale(opt_state) is deprecated and will be removed in the "
    "next release: use jaxmp.loss_scaler(opt_state) (the jmp object; the "
    "scale itself is jaxmp.stats(opt_state)['loss_scale'])",
    DeprecationWarning,
    stacklevel=2,
  )
  return loss_scaler(opt_state)


def loss_scaler(opt_state: Any) -> loss_scale_lib.LossScaler:
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
  return pytrees.full_view(params, state)


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
