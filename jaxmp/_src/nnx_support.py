"""Flax NNX support without importing flax: only where the user has already.

NNX wraps every array in a ``Variable`` (``Param``, ``BatchStat``, the
optimizer's ``OptVariable``); the variable's type is part of the pytree
structure, so a tree of ``Param`` and a tree of ``OptVariable`` never match.
And ``nnx.state(model, nnx.BatchStat)`` holds the model's *own* variables:
the next forward pass updates that "snapshot" in place. These helpers unwrap
variables and catch that aliasing.
"""

import sys
from typing import Any, Optional


def nnx() -> Optional[Any]:
  """The ``flax.nnx`` module if the program imported it, else ``None``."""
  return sys.modules.get("flax.nnx")


def is_variable(x: Any) -> bool:
  """Whether ``x`` is an NNX variable."""
  mod = nnx()
  return mod is not None and isinstance(x, mod.Variable)


def is_module(x: Any) -> bool:
  """Whether ``x`` is an NNX module."""
  mod = nnx()
  return mod is not None and isinstance(x, mod.Module)


def _value(v: Any) -> Any:
  return v.get_value() if hasattr(v, "get_value") else v.value


def unwrap(tree: Any) -> Any:
  """``tree`` with every NNX variable replaced by the array it holds.

  A tree without variables comes back as it is.
  """
  if nnx() is None:
    return tree
  import jax  # pylint: disable=g-import-not-at-top

  return jax.tree.map(
    lambda x: _value(x) if is_variable(x) else x, tree, is_leaf=is_variable
  )


def variables(tree: Any) -> list[Any]:
  """The NNX variables of ``tree`` (a state, a module), in leaf order."""
  mod = nnx()
  if mod is None:
    return []
  import jax  # pylint: disable=g-import-not-at-top

  if is_module(tree):
    tree = mod.state(tree)
  return [
    x
    for x in jax.tree_util.tree_leaves(tree, is_leaf=is_variable)
    if is_variable(x)
  ]


def check_not_aliased(new: Any, old: Any) -> None:
  """Raises when ``old`` holds the very variables of ``new``.

  ``old = nnx.state(model, nnx.BatchStat)`` taken before a step is not a
  copy: the forward pass updates its variables in place, so it shows the
  new statistics and a rollback to it would keep them in silence.
  """
  live = {id(v) for v in variables(new)}
  shared = [v for v in variables(old) if id(v) in live]
  if shared:
    raise ValueError(
      f"`old` holds {len(shared)} of the model's own NNX variables (a "
      f"{type(shared[0]).__name__}), not a copy: nnx.state(model, ...) "
      "returns the live variables, which the forward pass updated in place, "
      "so there is nothing to roll back to. Take the snapshot with "
      "nnx.clone before the step: old = nnx.clone(nnx.state(model, "
      "nnx.BatchStat))"
    )
