"""Flax NNX support without importing flax: only where the user has already.

NNX wraps every array in a ``Variable`` (``Param``, ``BatchStat``, the
optimizer's ``OptVariable``); the variable's type is part of the pytree
structure, so a tree of ``Param`` and a tree of ``OptVariable`` never match.
And ``nnx.state(model, nnx.BatchStat)`` holds the model's *own* variables:
the next forward pass updates that "snapshot" in place. These helpers unwrap
variables and catch that aliasing.
"""

import sys
from typing import Any, Callable, Optional


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


def _rewrap(var: Any, value: Any, keep: Optional[tuple] = None) -> Any:
  """A variable of ``var``'s type and metadata that holds ``value``.

  Built as ``jax.tree_util`` rebuilds a variable (no hooks, no resharding).
  ``keep`` (one bool per axis of ``value``): the axes that keep the names of
  ``var``'s ``out_sharding`` metadata; the others get ``None`` (replicated).
  """
  import jax  # pylint: disable=g-import-not-at-top

  names = _metadata(var).get("out_sharding")
  if keep is not None and isinstance(names, (tuple, list)):
    if len(names) == len(keep):
      new = tuple(n if k else None for n, k in zip(names, keep))
      if new != tuple(names):
        return var.replace(value, out_sharding=new)
  treedef = jax.tree_util.tree_structure(var, is_leaf=lambda x: x is not var)
  return treedef.unflatten([value])


def _metadata(var: Any) -> dict:
  get = getattr(var, "get_metadata", None)
  return dict(get()) if get is not None else {}


def settle(tree: Any, axes: Optional[Callable[[Any], Any]] = None) -> Any:
  """``tree`` with every NNX variable holding one array.

  A state built by mapping over NNX params (``tx.init(nnx.state(model,
  nnx.Param))``) holds each of its values in a variable like the param's:
  a ``None`` master, an empty node or an encoded low-bit leaf would end up
  inside one. NNX treats a variable's value as one array: ``nnx.eval_shape``
  reads its ``.shape``, and ``nnx.update`` writes back an ``nnx.State`` in
  place of a pytree it held. So a variable holding a pytree is replaced by
  that pytree with each of its leaves in a variable like it, and one holding
  no leaf (``None``, an empty node) by its value.

  Args:
    tree: any pytree.
    axes: called on a pytree a variable held: for each of its leaves (in
      leaf order) a tuple of bools, the axes that keep the variable's
      sharding names (``None``: all of them), or ``None`` for all leaves.

  Returns:
    ``tree``, its variables each holding one array.

  >>> import jax.numpy as jnp
  >>> settle({"a": jnp.ones(2), "b": None})["b"] is None
  True
  """
  if nnx() is None:
    return tree
  import jax  # pylint: disable=g-import-not-at-top

  def settle_one(x):
    if not is_variable(x):
      return x
    value = _value(x)
    leaves, treedef = jax.tree_util.tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:
      return x  # An array (or a shape struct): as NNX expects.
    keep = (axes(value) if axes is not None else None) or [None] * len(leaves)
    return treedef.unflatten(
      [_rewrap(x, leaf, k) for leaf, k in zip(leaves, keep)]
    )

  return jax.tree.map(settle_one, tree, is_leaf=is_variable)


def wrap_like(plain: Any, template: Any) -> Any:
  """``plain`` (no variables) with the NNX variables of ``template`` again.

  ``template`` is ``plain``'s structure with some subtrees held in
  variables (`unwrap` of it has ``plain``'s structure): each such subtree of
  ``plain`` goes back into a variable like ``template``'s. A template
  without variables gives ``plain`` back as it is.
  """
  if nnx() is None or not variables(template):
    return plain
  import jax  # pylint: disable=g-import-not-at-top

  return jax.tree.map(
    lambda t, v: _rewrap(t, v) if is_variable(t) else v,
    template,
    plain,
    is_leaf=is_variable,
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


# ---------------------------------------------------------------------------
# NNX objects as arguments of a traced function (`jaxmp.autocast`).


class _Slot:
  """Where the ``index``-th NNX object sat among a function's arguments."""

  __slots__ = ("index",)

  def __init__(self, index: int):
    self.index = index

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, _Slot) and other.index == self.index

  def __hash__(self) -> int:
    return hash((_Slot, self.index))

  def __repr__(self) -> str:
    return f"_Slot({self.index})"


def is_graph_node(x: Any) -> bool:
  """Whether ``x`` is an NNX graph node (module, ``Rngs``, variable...)."""
  mod = nnx()
  return mod is not None and mod.graph.is_graph_node(x)


class Lifted:
  """A function's arguments with their NNX objects split into a state.

  ``tree`` is ``(graphdef, state, template)``: ``template`` is the
  arguments with every NNX object (a module, an ``nnx.Rngs``)
  replaced by a placeholder; ``graphdef`` and ``state`` are ``nnx.split`` of
  those objects, together, so that objects shared between them (one
  ``Rngs`` in two modules) stay shared. Inside the traced function
  `run` merges them and calls the function; `write_back` then does what
  ``nnx.update`` does for ``nnx.jit``: BatchNorm statistics, RNG counters and
  every other variable the call changed land in the caller's objects.
  """

  def __init__(self, nodes: tuple, tree: tuple):
    self.nodes = nodes
    self.tree = tree

  def write_back(self, new_state: Any) -> None:
    """Updates the caller's NNX objects with the variables the call set."""
    import jax  # pylint: disable=g-import-not-at-top

    if jax.tree_util.tree_leaves(new_state):
      nnx().update(self.nodes, new_state)


def lift(tree: Any) -> Optional[Lifted]:
  """`Lifted` for ``tree`` (a function's ``(args, kwargs)``), ``None`` if no NNX.

  Flax is never imported here: without ``flax.nnx`` in ``sys.modules`` no
  argument can be an NNX object.
  """
  mod = nnx()
  if mod is None:
    return None
  import jax  # pylint: disable=g-import-not-at-top

  # Modules and Rngs, the objects a caller holds and expects to see updated.
  # Variables on their own (an nnx.State passed in) stay values, as before:
  # a function of a state returns the new state.
  is_node = lambda x: mod.graph.is_graph_node(x) and not is_variable(x)
  leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_node)
  nodes = [x for x in leaves if is_node(x)]
  if not nodes:
    return None
  slots = iter(range(len(nodes)))
  template = jax.tree_util.tree_unflatten(
    treedef, [_Slot(next(slots)) if is_node(x) else x for x in leaves]
  )
  graphdef, state = mod.split(tuple(nodes))
  return Lifted(tuple(nodes), (graphdef, state, template))


def run(fun: Any, tree: tuple, caller: str) -> tuple[Any, Any]:
  """Calls ``fun`` on fresh NNX objects merged from ``tree`` (see `Lifted`).

  Returns ``(out, new_state)``, ``new_state`` the variables of the NNX
  objects that the call set, as they are after it. Raises a ``TypeError`` when ``out`` holds an NNX object:
  it would come back as a copy, detached from the caller's.
  """
  import jax  # pylint: disable=g-import-not-at-top

  mod = nnx()
  graphdef, state, template = tree
  given = {path: _value(v) for path, v in mod.to_flat_state(state)}
  nodes = mod.merge(graphdef, state)
  is_slot = lambda x: isinstance(x, _Slot)
  args, kwargs = jax.tree.map(
    lambda x: nodes[x.index] if is_slot(x) else x, template, is_leaf=is_slot
  )
  out = fun(*args, **kwargs)
  check_no_nodes(out, caller)
  # Only the variables the call set: what plain NNX code would have mutated
  # (writing an unchanged BatchStat back can be refused under a transform).
  changed = [
    (path, v)
    for path, v in mod.to_flat_state(mod.state(nodes))
    if given.get(path, given) is not _value(v)
  ]
  return out, mod.from_flat_state(changed)


def check_no_nodes(out: Any, caller: str) -> None:
  """Raises when a traced function's output holds an NNX module or ``Rngs``."""
  if nnx() is None:
    return
  import jax  # pylint: disable=g-import-not-at-top

  # Variables may come back (an nnx.State of them, as nnx.state returns):
  # they are values. A module or an Rngs is an object the caller holds.
  found = [
    x
    for x in jax.tree_util.tree_leaves(out, is_leaf=is_graph_node)
    if is_graph_node(x) and not is_variable(x)
  ]
  if found:
    raise TypeError(
      f"the function given to {caller} returned an NNX object (a "
      f"{type(found[0]).__name__}): it would come back as a detached copy. "
      "Pass NNX modules and nnx.Rngs in as arguments (their updates are "
      "written back to them) and return arrays"
    )
