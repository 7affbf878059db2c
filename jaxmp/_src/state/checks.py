"""Trace-time checks that a state given to ``update`` fits the params.

A state built for other params would step them wrong in silence; each check
names the first leaf that differs:

* `check_state`: the masters (and remainders) have the params' tree and
  shapes, and every state leaf on a mesh is on the params' mesh;
* `check_dtypes`: each master-weights buffer was built for its param's
  dtype.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxmp._src import dtypes
from jaxmp._src import nnx_support
from jaxmp._src.state import sharding as sharding_lib
from jaxmp._src.state.master_weights import Buffers
from jaxmp._src.state.master_weights import is_empty
from jaxmp._src.state.master_weights import Placeholder
from jaxmp._src.state.modes import Mode
from jaxmp._src.state.modes import PerLeaf

_is_empty = is_empty
_is_array = sharding_lib.is_array
_is_tracer = sharding_lib.is_tracer


def _mesh_of(x) -> Any:
  """The mesh ``x`` lives on: abstract under a trace, concrete outside."""
  if _is_tracer(x):
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
  else:
    sharding = getattr(x, "sharding", None)
    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
  if mesh is None or getattr(mesh, "empty", True):
    return None
  return mesh


def _mesh_key(mesh, traced: bool):
  if traced:
    return tuple(zip(mesh.axis_names, mesh.axis_sizes))
  return mesh


def check_state(state: Any, masters: Any, params: Any, what: str) -> None:
  """Trace-time checks of a state given to ``update`` with ``params``.

  ``masters`` (a tree with the params' structure: `master_weights.Buffers`'
  masters, ``None``/placeholders included) must match the params leaf by
  leaf, as must ``state.remainder`` where there is one (``"remainder"``
  masters), and every state leaf on a mesh (the codes and scales of an
  encoded one included) must be on the params' mesh.

  Raises:
    ValueError: naming the first leaf that differs.
  """
  params, masters = nnx_support.unwrap(params), nnx_support.unwrap(masters)
  _check_tree(masters, params, what, "master_params")
  # "remainder" masters: the masters are placeholders, the int16
  # remainders have the params' shapes.
  remainder = nnx_support.unwrap(getattr(state, "remainder", None))
  if remainder is not None:
    _check_tree(remainder, params, what, "remainder")
  _check_mesh(state, params, what)


def _check_tree(masters: Any, params: Any, what: str, field: str) -> None:
  """``masters`` (``what.field``) has the params' structure and shapes."""
  p_leaves, p_def = jax.tree_util.tree_flatten(params, is_leaf=_is_empty)
  m_leaves, m_def = jax.tree_util.tree_flatten(masters, is_leaf=_is_empty)
  if p_def == m_def and all(
    not (_is_array(m) and _is_array(p)) or tuple(m.shape) == tuple(p.shape)
    for m, p in zip(m_leaves, p_leaves)
  ):
    return
  # Something differs: find the first leaf that does, by path.
  p_paths = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_empty)[0]
  m_paths = jax.tree_util.tree_flatten_with_path(masters, is_leaf=_is_empty)[0]
  p_keys = [jax.tree_util.keystr(k) for k, _ in p_paths]
  m_keys = [jax.tree_util.keystr(k) for k, _ in m_paths]
  if p_keys != m_keys:
    extra = [k for k in m_keys if k not in set(p_keys)]
    missing = [k for k in p_keys if k not in set(m_keys)]
    detail = (
      f"the state has {what}.{field}{extra[0]}, which the params lack"
      if extra
      else f"the params have params{missing[0]}, which the state lacks"
      if missing
      else "its leaves are in another order"
    )
    raise ValueError(
      f"the optimizer state was built for another tree: {detail}. Build it "
      "with opt.init(params) for these params"
    )
  for (path, m), (_, p) in zip(m_paths, p_paths):
    if _is_array(m) and _is_array(p) and tuple(m.shape) != tuple(p.shape):
      raise ValueError(
        "the optimizer state was built for another tree: "
        f"{what}.{field}{jax.tree_util.keystr(path)} has shape "
        f"{tuple(m.shape)}, params{jax.tree_util.keystr(path)} has "
        f"{tuple(p.shape)}. Build it with opt.init(params) for these params"
      )
  raise ValueError(  # Unreachable: the structures or a shape differ.
    f"the optimizer state was built for another tree ({what}.{field} "
    "differs from the params). Build it with opt.init(params)"
  )


def _check_mesh(state: Any, params: Any, what: str) -> None:
  """Every state leaf on a mesh is on one of the params' meshes."""
  # The params' meshes, as a trace sees them (names and sizes) or as they
  # are outside one; leaves of the other kind (a closed-over constant) are
  # not compared.
  keys, p_mesh, traced = set(), None, None
  for p in jax.tree_util.tree_leaves(params):
    mesh = _mesh_of(p)
    if mesh is not None and traced in (None, _is_tracer(p)):
      traced = _is_tracer(p)
      keys.add(_mesh_key(mesh, traced))
      p_mesh = p_mesh or mesh
  if not keys:
    return
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    mesh = _mesh_of(x)
    if (
      mesh is not None
      and _is_tracer(x) == traced
      and _mesh_key(mesh, traced) not in keys
    ):
      raise ValueError(
        f"the optimizer state is on another mesh than the params: "
        f"{what}{jax.tree_util.keystr(path)} is on {mesh}, the params on "
        f"{p_mesh}. Build the state for these params (opt.init(params)) or "
        "move it: jax.device_put(state, jaxmp.state_shardings(opt, params))"
      )


# The buffer of each mode that says which dtype each param had at ``init``.
_DTYPE_BUFFERS = {
  "fp32": "master_params",
  "kahan": "compensation",
  "remainder": "remainder",
}


def check_dtypes(mode: Mode, params: Any, buffers: Buffers) -> None:
  """Trace-time: ``buffers`` were built for params of these dtypes.

  ``init`` keeps a buffer for each half param only (an fp32 param is its
  own master), so a state built for params of other dtypes would step them
  wrong in silence: a half param without a buffer takes plain half updates
  (``init`` before the cast to half precision), an fp32 param with an fp32
  master would land on that stale master, and a remainder or compensation
  joins the param's bits as if they were another dtype's. Each such leaf is
  refused. ``"stochastic"`` and ``"none"`` keep no per-param buffer: any
  dtype steps as it should. So does a float16 param with the fp32 master of
  a bfloat16 one (the master is its fp32 value either way). Per-leaf modes
  are checked leaf by leaf: each buffer a leaf has, and the buffer of its
  own mode where it has none, in the same words.

  Raises:
    ValueError: naming the first such leaf by its path, its dtype and the
      dtype its buffer was built for.
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(
    params, is_leaf=is_empty
  )
  if isinstance(mode, PerLeaf):
    modes = iter(mode.resolve(params))  # One per param that is not None.
    own = [None if is_empty(p) else next(modes) for _, p in leaves]
    own = [_DTYPE_BUFFERS.get(m) for m in own]  # Its own mode's buffer.
    fields = tuple(_DTYPE_BUFFERS.values())
  else:
    field = _DTYPE_BUFFERS.get(mode.name)
    if field is None or getattr(buffers, field) is None:
      return
    own, fields = [field] * len(leaves), (field,)
  trees = {f: getattr(buffers, f) for f in fields}
  flat = {  # Each field's buffer per leaf (all None where it has no tree).
    f: [None] * len(leaves) if t is None else treedef.flatten_up_to(t)
    for f, t in trees.items()
  }
  for i, (path, p) in enumerate(leaves):
    if is_empty(p) or not hasattr(p, "dtype"):
      continue
    for field in fields:
      b = flat[field][i]
      if isinstance(b, Placeholder) or (b is None and field != own[i]):
        continue
      why = _mismatch(field, b, p, jax.tree_util.keystr(path))
      if why:
        raise ValueError(
          "the optimizer state was built for params of another dtype: "
          f"{why}. Build the state with opt.init(params) from the params as "
          "they are stepped (after any cast)"
        )


def _mismatch(field: str, b: Any, p: Any, where: str) -> Optional[str]:
  """Why buffer ``b`` (of ``field``) does not fit param ``p``, or None."""
  got = jnp.dtype(p.dtype)
  half = dtypes.is_half(p)
  if b is None:
    built = None if half else got  # No buffer: built for a full param.
  elif field == "master_params":
    built = got if half else "half-precision (bfloat16 or float16)"
  elif field == "remainder":
    built = jnp.dtype(jnp.bfloat16)
  else:
    built = jnp.dtype(b.dtype)
  if built is not None and built == got:
    return None
  if b is None:
    return (
      f"state.{field}{where} is None, as for a float32 param (its own "
      f"master), but params{where} is {got.name} (was opt.init called "
      "before the params were cast to half precision?)"
    )
  built_name = getattr(built, "name", built)
  return (
    f"state.{field}{where} ({jnp.dtype(b.dtype).name}) belongs to a "
    f"{built_name} param, but params{where} is {got.name}"
  )
