"""Where `mixed_precision` sits in an optimizer, checked at trace time.

`mixed_precision` must be the outermost transform, or directly inside
`jaxmp.multi_steps` (``optax.inject_hyperparams`` around it is fine too).
Every other placement trains wrongly without a sound: a transform chained
before it sees the scaled gradients, one chained after it changes updates
the fp32 masters never see, a plain `optax.MultiSteps` around it stays NaN
after one overflowed microbatch. The state says where it sat: these checks
walk the optimizer state in Python, so under ``jit`` they run once, while
tracing, and cost the compiled step nothing.

`warn_if_captured` catches the other silent mistake: an ``opt_state`` that a
jitted step reads from a global (or a closure) instead of its arguments is a
constant of the compiled program, so the forward pass keeps multiplying by
the scale of the first trace while the real scale moves on.
"""

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

RIGHT_CHAIN = (
  "wrap the whole optimizer, e.g.\n"
  "  opt = jaxmp.mixed_precision(optax.chain(optax.clip_by_global_norm(1.0),"
  " optax.sgd(0.1)))\n"
  "and for gradient accumulation put jaxmp.multi_steps outside it:\n"
  "  opt = jaxmp.multi_steps(jaxmp.mixed_precision(optax.chain(...)), k)"
)


def _child(node: Any, key: Any) -> Any:
  """The child of ``node`` at one key of a ``tree_flatten_with_path`` path."""
  children, _ = jax.tree_util.tree_flatten_with_path(
    node, is_leaf=lambda x: x is not node
  )
  for path, child in children:
    if path == (key,):
      return child
  raise KeyError(key)  # Not reached for a key of the same tree.


def _ancestors(opt_state: Any, target: Any) -> list[tuple[Any, Any, str]]:
  """``(container, key, keystr)`` from the root down to ``target``'s parent."""
  is_mp = lambda x: isinstance(x, type(target))
  for path, leaf in jax.tree_util.tree_flatten_with_path(
    opt_state, is_leaf=is_mp
  )[0]:
    if leaf is target:
      out, node = [], opt_state
      for i, key in enumerate(path):
        out.append((node, key, jax.tree_util.keystr(path[:i])))
        node = _child(node, key)
      return out
  return []


def _is_optax_state(x: Any) -> bool:
  return type(x).__module__.split(".")[0] == "optax"


def check_placement(opt_state: Any, state: Any, accumulation: type) -> None:
  """Raises a ``ValueError`` unless ``state`` sits where it must.

  Args:
    opt_state: the whole optimizer state the user passed.
    state: the `MixedPrecisionState` found inside it.
    accumulation: the state type of `jaxmp.multi_steps`, the one wrapper
      that may hold it (handed in: this module imports neither transform,
      so that both can import it).

  Containers that are neither optax's nor jaxmp's (a user's dict, an NNX
  optimizer) are taken as they are: only the known wrong wrappers raise.
  """
  ancestors = _ancestors(opt_state, state)
  for depth, (node, key, where) in enumerate(ancestors):
    at = f"opt_state{where}"
    parent = ancestors[depth - 1][0] if depth else None
    if isinstance(node, accumulation):
      continue
    if isinstance(node, optax.MultiStepsState):
      if isinstance(parent, accumulation):
        continue
      raise ValueError(
        f"jaxmp.mixed_precision inside optax.MultiSteps (at {at}): after one "
        "overflowed microbatch its accumulator stays NaN and every later "
        "window is skipped, and mixed_precision sees only whole windows; "
        "use jaxmp.multi_steps(jaxmp.mixed_precision(inner), k)"
      )
    if type(node) in (tuple, list) and len(node) > 1:
      index = getattr(key, "idx", "?")
      if index == 0 and all(isinstance(x, optax.EmptyState) for x in node[1:]):
        # Stateless transforms after it: optax.identity() is harmless, a
        # clip is not, and their states are alike. `check_chain` tells
        # them apart when the chain runs update.
        continue
      raise ValueError(
        f"jaxmp.mixed_precision is transform {index} (from 0) of a chain of "
        f"{len(node)} (at {at}): it must be the outermost transform. A "
        "transform chained before it sees the *scaled* gradients (a clip "
        "then uses a norm loss_scale times too large), one chained after it "
        "changes updates that the fp32 masters never see, and the next step "
        "undoes them; " + RIGHT_CHAIN
      )
    if _is_optax_state(node) and not type(node).__name__.startswith("Inject"):
      raise ValueError(
        f"jaxmp.mixed_precision inside optax's {type(node).__name__} (at "
        f"{at}): the wrapper sees the scaled gradients or changes updates "
        "that the fp32 masters never see; " + RIGHT_CHAIN
      )


def _concrete(x: Any) -> bool:
  """Whether ``x`` has a value now (not a tracer of a function being traced)."""
  try:
    np.asarray(x)
  except (
    jax.errors.TracerArrayConversionError,
    jax.errors.ConcretizationTypeError,
  ):
    return False
  return True


def warn_if_captured(state: Any, caller: str) -> None:
  """Warns when ``state`` is a constant of a function being traced.

  Its loss scale then has a value while a fresh array made here is a tracer
  (``jit``, ``shard_map``, ``pmap``...): the state reached the traced
  function from a global or a closure, not as an argument. The probe is
  public API only (a tracer cannot become a NumPy array); it costs one scalar
  at trace time, and in eager mode one tiny op where the state is concrete.
  """
  scale = jax.tree_util.tree_leaves(state.loss_scale)
  if not scale or not _concrete(scale[0]) or _concrete(jnp.zeros(())):
    return
  warnings.warn(
    f"{caller} got an opt_state that is a constant of the function being "
    "traced (read from a global or a closure, not passed in as an argument): "
    "the compiled step keeps the loss scale of its first trace while the "
    "optimizer's scale moves on, so the gradients come out too small or "
    "overflow. Pass opt_state to the jitted step as an argument, e.g. "
    "step(params, opt_state, batch)",
    UserWarning,
    stacklevel=3,
  )


_CHAIN_UPDATE = optax.chain(optax.identity()).update.__code__
_IDENTITY_UPDATE = optax.identity().update.__code__


def _is_identity(fn: Any) -> bool:
  """Whether ``fn`` is ``optax.identity()``'s update (extra-args wrapped or not)."""
  if getattr(fn, "__code__", None) is _IDENTITY_UPDATE:
    return True
  for cell in getattr(fn, "__closure__", None) or ():
    try:
      inner = getattr(cell.cell_contents, "update", None)
    except ValueError:  # An empty cell.
      continue
    if getattr(inner, "__code__", None) is _IDENTITY_UPDATE:
      return True
  return False


def check_chain(frame: Any, own_code: Any) -> None:
  """Raises when ``update`` runs first in an ``optax.chain`` of more than it.

  ``frame`` is the caller of ``mixed_precision``'s ``update``. In an
  ``optax.chain`` its locals hold the chain's update functions: every one
  after ``mixed_precision`` must be ``optax.identity()``. (The states of
  stateless transforms look alike, so `check_placement` lets such chains
  through to here.)
  """
  if frame is None or frame.f_code is not _CHAIN_UPDATE:
    return
  fns = frame.f_locals.get("update_fns") or ()
  others = [
    (i, fn)
    for i, fn in enumerate(fns)
    if getattr(fn, "__code__", None) is not own_code
  ]
  bad = [i for i, fn in others if not _is_identity(fn)]
  if bad:
    raise ValueError(
      f"jaxmp.mixed_precision is transform 0 (from 0) of a chain of "
      f"{len(fns)}, with transform {bad[0]} after it: it must be the "
      "outermost transform. A transform chained after it changes updates "
      "that the fp32 masters never see, and the next step undoes them "
      "(only optax.identity() may follow it); " + RIGHT_CHAIN
    )
