"""`mixed_precision`: FP32 masters and dynamic loss scaling in one transform.

The loss-scale rule is jmp's, which is also `torch.amp.GradScaler`'s::

    # grads are the gradients of loss * scale; every step:
    grads = grads / scale                     # fp32, with the forward's scale
    finite = all(isfinite(grads))             # one flag for the whole tree
    if finite:
      masters, inner_state = inner.update(grads, masters)   # step applied
      counter += 1
      if counter == period:                   # the period-th finite step
        counter = 0
        if isfinite(scale * factor):
          scale = min(scale * factor, max_loss_scale)
    else:                                     # step skipped, nothing changes
      counter = 0
      overflows += 1                          # consecutive overflows
      if overflows >= hysteresis:             # hysteresis=1: every overflow
        scale = max(scale / factor, min_loss_scale)

It is written branch-free with `jnp.where`: the selects fuse into the
elementwise kernels of the optimizer update, so a skipped step costs no extra
pass over the params and the step stays one straight-line XLA program (a
`lax.cond` would split it into separately scheduled computations).

Hyperparameters live in the closure. The state also carries them as a static
`LossScaleConfig` (part of the pytree *structure*, never a leaf), so that
`jit`, `device_put` and checkpoint round trips keep `min_loss_scale` and
`max_loss_scale`: jmp's `DynamicLossScale` flattens to `(loss_scale, counter)`
only and comes back from `jit` with `min_loss_scale=1`.
"""

import dataclasses
import warnings
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

from jaxmp._src import diagnostics as diag
from jaxmp._src import rounding

LossScale = Union[jmp.NoOpLossScale, jmp.StaticLossScale, jmp.DynamicLossScale]
"""The jmp loss scales `mixed_precision` accepts (``loss_scale=``)."""

_HALF = (jnp.float16, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
  """Static description of the loss scale, kept in the state's treedef.

  Attributes:
    kind: ``"dynamic"``, ``"static"`` or ``"noop"``.
    period: finite steps between two growths.
    factor: growth and back-off factor.
    min_loss_scale: floor of the scale.
    max_loss_scale: cap of the scale (``inf``: only never grow to inf).
    hysteresis: back off only from the ``hysteresis``-th consecutive overflow.
  """

  kind: str
  period: int = 2000
  factor: float = 2.0
  min_loss_scale: float = 1.0
  max_loss_scale: float = float("inf")
  hysteresis: int = 1


jax.tree_util.register_static(LossScaleConfig)


class MixedPrecisionState(NamedTuple):
  """State of `mixed_precision`.

  Attributes:
    inner_state: state of the wrapped optimizer.
    master_params: fp32 copies of the half-precision params, ``None`` where a
      param is fp32 already (it is its own master) or masters are disabled.
    loss_scale: fp32 scalar; multiply the next loss by it.
    growth_counter: int32, consecutive finite steps since the last growth
      (jmp's ``counter``, GradScaler's ``growth_tracker``).
    grads_finite: bool, whether the last step was applied: its gradients
      (and its loss, when ``update`` was given ``loss=``) were all finite.
    skipped_steps: int32, how many steps were skipped since `init`, for
      either reason.
    consecutive_skips: int32, steps skipped for non-finite gradients in a row
      up to now (a step skipped for a non-finite loss leaves it unchanged).
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
  """

  inner_state: optax.OptState
  master_params: Any
  loss_scale: jax.Array
  growth_counter: jax.Array
  grads_finite: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  config: LossScaleConfig
  nonfinite_loss_steps: Optional[jax.Array] = None
  consecutive_nonfinite_loss: Optional[jax.Array] = None
  diagnostics: Optional[diag.GradDiagnostics] = None
  compensation: Any = None
  rounding_key: Optional[jax.Array] = None


MASTER_WEIGHTS = ("fp32", "none", "kahan", "stochastic")


def _master_mode(master_weights) -> str:
  """``True``/``False`` or a name of `MASTER_WEIGHTS`, as the name."""
  if isinstance(master_weights, (bool, np.bool_)):
    return "fp32" if master_weights else "none"
  if isinstance(master_weights, str) and master_weights in MASTER_WEIGHTS:
    return master_weights
  raise ValueError(
    "master_weights must be True/'fp32', False/'none', 'kahan' or "
    f"'stochastic', got {master_weights!r}"
  )


def _raw_key(key) -> jax.Array:
  """The raw ``uint32[2]`` threefry key of an int seed or a PRNG key."""
  if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
    with jax.ensure_compile_time_eval():  # Concrete, also inside jit.
      return jax.random.key_data(jax.random.key(int(key)))
  if isinstance(key, jax.Array) and jnp.issubdtype(
    key.dtype, jax.dtypes.prng_key
  ):
    if key.shape != () or jax.random.key_impl(key) != jax.random.key_impl(
      jax.random.key(0)
    ):
      raise ValueError(
        "rounding_key must be one PRNG key of the default (threefry) "
        f"implementation, got {key!r}"
      )
    return jax.random.key_data(key)
  if (
    isinstance(key, (jax.Array, np.ndarray))
    and key.shape == (2,)
    and key.dtype == np.uint32
  ):
    return jnp.asarray(key)
  raise ValueError(
    "rounding_key must be an int seed, a jax.random.key or a raw uint32[2] "
    f"key, got {key!r}"
  )


def _config_from(
  loss_scale: Optional[Union[LossScale, float]],
  max_loss_scale: Optional[float],
  hysteresis: int,
) -> tuple[LossScaleConfig, float]:
  """Validates the user's loss scale; returns (config, initial scale)."""
  if loss_scale is None:
    loss_scale = jmp.DynamicLossScale(np.float32(2.0**15))
  if _is_number(loss_scale):
    loss_scale = jmp.StaticLossScale(
      np.float32(_concrete(loss_scale, "loss_scale"))
    )
  if not _is_number(hysteresis) or _concrete(hysteresis, "hysteresis") < 1:
    raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")
  hysteresis = int(_concrete(hysteresis, "hysteresis"))
  cap = (
    float("inf")
    if max_loss_scale is None
    else _concrete(max_loss_scale, "max_loss_scale")
  )
  if isinstance(loss_scale, jmp.NoOpLossScale):
    return LossScaleConfig("noop", min_loss_scale=1.0, max_loss_scale=1.0), 1.0
  if isinstance(loss_scale, jmp.StaticLossScale):
    value = _concrete(loss_scale.loss_scale, "StaticLossScale.loss_scale")
    _check_positive(value, "loss_scale")
    return LossScaleConfig(
      "static", min_loss_scale=value, max_loss_scale=value
    ), value
  if isinstance(loss_scale, jmp.DynamicLossScale):
    value = _concrete(loss_scale.loss_scale, "DynamicLossScale.loss_scale")
    floor = _concrete(
      loss_scale.min_loss_scale, "DynamicLossScale.min_loss_scale"
    )
    _check_positive(value, "loss_scale")
    _check_positive(floor, "min_loss_scale")
    if int(loss_scale.period) < 1:
      raise ValueError(f"period must be >= 1, got {loss_scale.period!r}")
    if not float(loss_scale.factor) > 1:
      raise ValueError(f"factor must be > 1, got {loss_scale.factor!r}")
    if not floor <= cap:
      raise ValueError(f"min_loss_scale={floor} is above max_loss_scale={cap}")
    clamped = min(max(value, floor), cap)
    if clamped != value:
      warnings.warn(
        f"initial loss scale {value} is outside [min_loss_scale={floor}, "
        f"max_loss_scale={cap}]; it starts at {clamped}",
        stacklevel=3,
      )
    value = clamped
    return LossScaleConfig(
      "dynamic",
      int(loss_scale.period),
      float(loss_scale.factor),
      floor,
      cap,
      hysteresis,
    ), value
  raise TypeError(
    "loss_scale must be None (dynamic, 2**15), a positive number (static), "
    "jmp.DynamicLossScale, jmp.StaticLossScale or jmp.NoOpLossScale; got "
    f"{loss_scale!r}"
  )


def _is_number(x) -> bool:
  """A Python/NumPy number or a 0-d array (optax.inject_hyperparams)."""
  if isinstance(x, bool):
    return False
  return isinstance(x, (int, float, np.number)) or (
    isinstance(x, (np.ndarray, jax.Array)) and np.ndim(x) == 0
  )


def _concrete(x, name: str) -> float:
  try:
    return float(np.asarray(x))
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(
      f"{name} must be a concrete number, not a traced value; with "
      "optax.inject_hyperparams(jaxmp.mixed_precision, static_args=("
      f"'{name}',)) it stays static"
    ) from e


def _check_positive(value: float, name: str) -> None:
  if not (np.isfinite(value) and value > 0):
    raise ValueError(f"{name} must be finite and > 0, got {value}")


def adjust_loss_scale(
  config: LossScaleConfig,
  loss_scale: jax.Array,
  growth_counter: jax.Array,
  consecutive_skips: jax.Array,
  grads_finite: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """One step of the loss-scale rule (see the module docstring).

  Args:
    config: the static loss-scale description.
    loss_scale: the scale the step's forward pass used.
    growth_counter: finite steps in a row before this step.
    consecutive_skips: overflowed steps in a row, this step included.
    grads_finite: whether this step's gradients were finite.

  Returns:
    ``(new_loss_scale, new_growth_counter)``.
  """
  if config.kind != "dynamic":
    return loss_scale, jnp.where(grads_finite, growth_counter + 1, 0)
  counter = jnp.where(grads_finite, growth_counter + 1, 0)
  grow = counter >= config.period
  grown = loss_scale * config.factor
  grown = jnp.minimum(
    jnp.where(jnp.isfinite(grown), grown, loss_scale),
    jnp.float32(config.max_loss_scale),
  )
  shrunk = jnp.maximum(
    loss_scale / config.factor, jnp.float32(config.min_loss_scale)
  )
  back_off = consecutive_skips >= config.hysteresis
  new_scale = jnp.where(
    grads_finite,
    jnp.where(grow, grown, loss_scale),
    jnp.where(back_off, shrunk, loss_scale),
  )
  return new_scale.astype(jnp.float32), jnp.where(grow, 0, counter)


def all_finite(tree: Any) -> jax.Array:
  """Returns a bool scalar: whether every element of every leaf is finite.

  Exact on every platform. Half-precision leaves reduce ``isfinite`` masks.
  fp32 and wider leaves reduce ``sum(x * 2**-64)``: NaN or inf anywhere makes
  it non-finite, and finite inputs cannot overflow it (their scaled magnitudes
  sum to at most ``size * 2**64``). A NaN-dropping ``max(abs(x))`` is not
  used: XLA:CPU's vectorised max reduction loses NaNs.

  On CPU the fp32 leaves take a cheaper path: XLA:CPU reads a plain
  ``sum(x)`` in one vectorised pass but writes ``x * c`` to memory before
  reducing it (about 1.7x slower over a ResNet18-sized tree). A plain sum is
  never finite when an element is not, but finite elements can overflow it,
  so when that fast test fails a `lax.cond` confirms with the exact one; the
  exact pass runs only on steps that look like overflows. Elsewhere the
  exact check fuses into one pass and a conditional would cost a host sync.
  """
  leaves = jax.tree_util.tree_leaves(tree)
  half = [x for x in leaves if _is_half(x)]
  full = [x for x in leaves if not _is_half(x)]
  flags = [jnp.all(jnp.isfinite(x)) for x in half]
  if full:
    flags.append(
      jax.lax.platform_dependent(
        full, cpu=_full_finite_cpu, default=_full_finite_exact
      )
    )
  if not flags:
    return jnp.array(True)
  return jnp.all(jnp.stack(flags))


def _full_finite_exact(leaves) -> jax.Array:
  total = sum(jnp.sum(x * jnp.asarray(2.0**-64, x.dtype)) for x in leaves)
  return jnp.isfinite(total)


def _full_finite_cpu(leaves) -> jax.Array:
  fast = jnp.isfinite(sum(jnp.sum(x) for x in leaves))
  # The true branch returns ``fast`` itself (True there) rather than a
  # constant: under ``shard_map`` both branches then carry the operands'
  # varying manual axes (vma), as ``check_vma=True`` requires.
  return jax.lax.cond(
    fast, lambda f, _: f, lambda _, xs: _full_finite_exact(xs), fast, leaves
  )


def _is_half(x) -> bool:
  return jnp.dtype(x.dtype) in [jnp.dtype(d) for d in _HALF]


def _find_masked_nodes(tree) -> bool:
  is_mn = lambda x: isinstance(x, optax.MaskedNode)
  return any(map(is_mn, jax.tree_util.tree_leaves(tree, is_leaf=is_mn)))


def _find_multisteps(tree) -> bool:
  is_ms = lambda x: isinstance(x, optax.MultiStepsState)
  return any(map(is_ms, jax.tree_util.tree_leaves(tree, is_leaf=is_ms)))


def mixed_precision(
  inner: optax.GradientTransformation,
  *,
  loss_scale: Optional[Union[LossScale, float]] = None,
  max_loss_scale: Optional[float] = 2.0**24,
  hysteresis: int = 1,
  master_weights: Union[bool, str] = True,
  axis_name: Optional[str] = None,
  diagnostics: bool = False,
  rounding_key: Union[int, jax.Array] = 0,
) -> optax.GradientTransformationExtraArgs:
  """Wraps an optax optimizer with FP32 master params and loss scaling.

  The gradients given to ``update`` are those of ``loss * scale`` (use
  `jaxmp.scale_loss`). They are unscaled in fp32 with the scale the forward
  pass used and checked for inf/nan over the whole tree. A finite step runs
  ``inner`` on the fp32 gradients and fp32 masters; a non-finite step returns
  zero updates and leaves masters and ``inner``'s state untouched. Then the
  scale is adjusted (see the module docstring for the rule).

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
  ``mixed_precision(optax.multi_transform(...))``.

  For gradient accumulation put `jaxmp.multi_steps` (a fixed
  `optax.MultiSteps`) outside: ``jaxmp.multi_steps(mixed_precision(inner),
  k)``. The scale then stays fixed within an accumulation window and the
  window is skipped as a whole when any of its microbatches overflowed.
  ``MultiSteps`` inside ``mixed_precision`` is rejected by ``init``.

  ``update(grads, state, params, loss=loss)`` optionally takes the step's
  *unscaled* loss (it is not passed on to ``inner``). When the loss itself is
  inf/NaN (bad data, a diverged model) the step is skipped but the loss-scale
  rule does not see it: the scale, its growth counter and
  ``consecutive_skips`` stay as they were, and the step is counted in
  ``nonfinite_loss_steps`` instead (`jaxmp.check_health` tells the two
  apart). Without ``loss=`` a NaN loss shows up as non-finite gradients and
  backs the scale off, as in every other scaler. Under `jaxmp.multi_steps`
  only the loss given with a window's last microbatch is checked.

  Master weights (``master_weights``) decide how a half-precision param
  takes an fp32 update ``u`` computed from its fp32 value ``v``:

  - ``True``/``"fp32"``: an fp32 master ``m`` in the state (4 bytes a
    param): ``m += u``, param ``= cast(m)``.
  - ``"kahan"``: a compensation buffer ``c`` in the param's dtype (2 bytes):
    ``v = param + c``, then ``param, c = split(v + u)``, ``param`` the
    nearest half value and ``c`` the rest (see `jaxmp.stochastic_round`'s
    module for the bound). The inner optimizer sees ``param + c``. Each
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
  - ``False``/``"none"``: no buffer, round to nearest (Apex O3): an update
    below half an ulp of the param is lost.

  Skipped steps leave masters, compensation and key untouched. fp32 params
  are their own masters in every mode. `jaxmp.master_params` returns the
  best fp32 estimate: the master, ``param + c``, or the upcast param.

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
      ``True``/``"fp32"`` (fp32 masters), ``"kahan"``, ``"stochastic"`` or
      ``False``/``"none"`` (Apex O3, the plain half update); see above.
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
  config, initial_scale = _config_from(loss_scale, max_loss_scale, hysteresis)
  if not isinstance(diagnostics, (bool, np.bool_)):
    raise TypeError(
      f"diagnostics must be a Python bool, got {diagnostics!r}; with "
      "optax.inject_hyperparams pass it in static_args"
    )
  mode = _master_mode(master_weights)
  # On the host: each ``init`` makes its own buffer (a donated state must not
  # delete the key of another one).
  key0 = _raw_key(rounding_key) if mode == "stochastic" else None
  if key0 is not None and not isinstance(key0, jax.core.Tracer):
    key0 = np.asarray(key0)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    if _find_masked_nodes(params):
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
    if mode == "fp32":
      masters = jax.tree.map(
        lambda p: p.astype(jnp.float32) if _is_half(p) else None, params
      )
    else:
      masters = jax.tree.map(lambda p: None, params)
    compensation = None
    if mode == "kahan":
      compensation = jax.tree.map(
        lambda p: jnp.zeros_like(p) if _is_half(p) else None, params
      )
    full = _full_view(params, masters, compensation)
    inner_state = inner.init(full)
    if _find_multisteps(inner_state):
      raise ValueError(
        "optax.MultiSteps inside mixed_precision would change the loss "
        "scale and skip microbatches inside an accumulation window; use "
        "jaxmp.multi_steps(jaxmp.mixed_precision(inner), k) instead"
      )
    return MixedPrecisionState(
      inner_state=inner_state,
      master_params=masters,
      loss_scale=jnp.asarray(initial_scale, jnp.float32),
      growth_counter=jnp.zeros([], jnp.int32),
      grads_finite=jnp.ones([], jnp.bool_),
      skipped_steps=jnp.zeros([], jnp.int32),
      consecutive_skips=jnp.zeros([], jnp.int32),
      config=config,
      nonfinite_loss_steps=jnp.zeros([], jnp.int32),
      consecutive_nonfinite_loss=jnp.zeros([], jnp.int32),
      diagnostics=diag.init_diagnostics(params) if diagnostics else None,
      compensation=compensation,
      rounding_key=None if key0 is None else jnp.asarray(key0),
    )

  def update_fn(grads, state, params=None, *, loss=None, **extra_args):
    if params is None:
      raise ValueError(
        "mixed_precision.update needs params: "
        "opt.update(grads, opt_state, params)"
      )
    scale = state.loss_scale
    # With a scale >= 1 unscaling cannot overflow: check the raw gradients
    # and let XLA fuse the check into one read of them.
    if config.min_loss_scale >= 1:
      finite = all_finite(grads)
    else:
      finite = all_finite(
        jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
      )
    if axis_name is not None:
      finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(bool)
    # Multiplying by the reciprocal is exact for power-of-two scales.
    inv_scale = 1.0 / scale
    report = (
      diag.grad_diagnostics(grads, inv_scale, axis_name)
      if diagnostics
      else None
    )
    grads_finite = finite
    if loss is not None:
      loss_finite = jnp.all(jnp.isfinite(jnp.asarray(loss)))
      if axis_name is not None:
        loss_finite = jax.lax.pmin(
          loss_finite.astype(jnp.int32), axis_name
        ).astype(bool)
      finite = grads_finite & loss_finite  # The step is applied.

    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * inv_scale, grads)
    full = _full_view(params, state.master_params, state.compensation)
    inner_updates, inner_state = inner.update(
      grads, state.inner_state, full, **extra_args
    )
    new_full = optax.apply_updates(full, inner_updates)

    keep = lambda new, old: jnp.where(finite, new, old)
    inner_state = jax.tree.map(keep, inner_state, state.inner_state)
    masters = jax.tree.map(
      lambda m, n: None if m is None else keep(n, m),
      state.master_params,
      new_full,
      is_leaf=lambda x: x is None,
    )

    def outer_update(p, u, m):
      if m is not None:
        # An fp32 update lands p exactly on cast(new master) (see docstring).
        # Where they already agree bit for bit, -0.0 keeps p as it is (a
        # -0.0 param plus the +0.0 of ``t - p`` would turn into +0.0).
        t = m.astype(p.dtype)
        same = (t == p) & (jnp.signbit(t) == jnp.signbit(p))
        u = jnp.where(
          same,
          jnp.asarray(-0.0, jnp.float32),
          t.astype(jnp.float32) - p.astype(jnp.float32),
        )
      # -0.0 is the additive identity of every float, signed zeros included.
      return jnp.where(finite, u, jnp.asarray(-0.0, u.dtype))

    compensation = rounding_key = None
    if mode == "fp32":
      # From the selected masters: XLA reads them instead of redoing the step.
      targets = masters
    elif mode == "kahan":
      targets, compensation = _kahan_targets(params, new_full)
      compensation = jax.tree.map(
        lambda c, n: None if c is None else keep(n, c),
        state.compensation,
        compensation,
        is_leaf=lambda x: x is None,
      )
    elif mode == "stochastic":
      next_key, step_key = jax.random.split(state.rounding_key)
      targets = _stochastic_targets(params, new_full, step_key)
      rounding_key = keep(next_key, state.rounding_key)
    else:
      targets = jax.tree.map(lambda p: None, params)
    updates = jax.tree.map(outer_update, params, inner_updates, targets)

    skips = jnp.where(grads_finite, 0, state.consecutive_skips + 1)
    new_scale, counter = adjust_loss_scale(
      config, scale, state.growth_counter, skips, grads_finite
    )
    loss_steps = state.nonfinite_loss_steps
    loss_run = state.consecutive_nonfinite_loss
    if loss is not None:
      # A non-finite loss says nothing about the scale: the rule skips it.
      skips = jnp.where(loss_finite, skips, state.consecutive_skips)
      new_scale = jnp.where(loss_finite, new_scale, scale)
      counter = jnp.where(loss_finite, counter, state.growth_counter)
      bad_loss = (~loss_finite).astype(jnp.int32)
      loss_steps = loss_steps + bad_loss
      loss_run = jnp.where(loss_finite, 0, loss_run + 1).astype(jnp.int32)
    return updates, MixedPrecisionState(
      inner_state=inner_state,
      master_params=masters,
      loss_scale=new_scale,
      growth_counter=counter.astype(jnp.int32),
      grads_finite=finite,
      skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
      consecutive_skips=skips.astype(jnp.int32),
      config=config,
      nonfinite_loss_steps=loss_steps,
      consecutive_nonfinite_loss=loss_run,
      diagnostics=report,
      compensation=compensation,
      rounding_key=rounding_key,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _kahan_targets(params, new_full):
  """New half params and their compensation (``None`` for fp32 params)."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  news = treedef.flatten_up_to(new_full)
  hi, lo = [], []
  for p, n in zip(leaves, news):
    h, l = rounding.kahan_split(n, p.dtype) if _is_half(p) else (None, None)
    hi.append(h)
    lo.append(l)
  unflatten = lambda xs: jax.tree_util.tree_unflatten(treedef, xs)
  return unflatten(hi), unflatten(lo)


def _stochastic_targets(params, new_full, key):
  """The stochastically rounded half params (``None`` for fp32 params).

  Leaf ``i`` of the flattened params draws from ``fold_in(key, i)``.
  """
  leaves, treedef = jax.tree_util.tree_flatten(params)
  news = treedef.flatten_up_to(new_full)
  out = []
  for i, (p, n) in enumerate(zip(leaves, news)):
    if _is_half(p):
      bits = jax.random.bits(jax.random.fold_in(key, i), p.shape, jnp.uint32)
      out.append(rounding.round_with_bits(n, p.dtype, bits))
    else:
      out.append(None)
  return jax.tree_util.tree_unflatten(treedef, out)


def _full_view(params, masters, compensation):
  """fp32 view of the params: masters, or param + compensation (Kahan)."""
  if compensation is None:
    return _full_precision(params, masters)

  def view(c, p):
    if p is None:
      return None
    full = p.astype(jnp.float32)
    return full if c is None else full + c.astype(jnp.float32)

  return jax.tree.map(view, compensation, params, is_leaf=lambda x: x is None)


def _full_precision(params, masters):
  """fp32 view of the params: the master where there is one, else upcast.

  ``None`` params (empty subtrees, such as the function fields of an
  ``eqx.filter``-ed Equinox module) stay ``None``.
  """

  def view(m, p):
    if p is None:
      return None
    return p.astype(jnp.float32) if m is None else m

  return jax.tree.map(view, masters, params, is_leaf=lambda x: x is None)
