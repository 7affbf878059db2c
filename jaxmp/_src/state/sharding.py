"""The optimizer state on a mesh: every param-shaped leaf placed like its param.

A state leaf is *param-shaped* when it sits in a subtree of the state that has
the params' tree structure (``None`` and `master_weights.Placeholder` counted
as empty leaves) and has its param's shape: Adam's ``mu`` and ``nu``, SGD's
trace, Lion's momentum, `jaxmp.multi_steps`' accumulator, the fp32 masters
and the Kahan compensation. The match is structural, never a guess by shape
alone: two params of one shape keep their own shardings. Leaves that do not
match (a scalar count, Adafactor's factored second moments) are left alone
by `place_like_params` and replicated by `state_shardings`.

Low-bit state (`state_codec.EncodedLeaf`, ``optimizer_state="bf16"`` or
``"int8"``) counts as one leaf in that match: its codes are placed like the
param, its per-block scales as `encoded_specs` says, and the leaves kept
fp32 beside it like their params. Under ``jit`` the codes and scales are
tied to predicates of the param's shape and of the scales' (the param's
``p != p``, reduced over each block), so each lands where its elements'
param elements are.

Why a tie is needed: optax builds its moments with ``jnp.zeros_like``, which
under ``jax.jit`` in auto mode (Shardy or GSPMD) is a broadcast constant with
no operand: sharding propagation has nothing to carry the param's sharding
to it, and XLA replicates it on every device (plain optax under ``jit`` puts
the whole moments on one device). ``jax.typeof(tracer).sharding`` says
nothing there (``P(None, None)``). In explicit-axes mode it carries the
param's sharding, and ``zeros_like`` keeps it.

The tie, in auto mode: ``select(param != param, leaf, barrier(leaf))``, with
``barrier`` `jax.lax.optimization_barrier`. Both branches are ``leaf``, so
the value is ``leaf`` bit for bit whatever the predicate (infs, NaNs, signed
zeros, integers); the predicate is elementwise in ``param``, so propagation
gives the select, hence the leaf, the param's sharding, and computes it on
each shard locally, with no communication. The barrier keeps the compiler's
canonicalization from folding ``select(c, x, x)`` to ``x`` before
propagation (it does: that tie alone is lost). It costs one fused compare
and select per param-shaped leaf in the compiled ``init``, and nothing in
the training step, which never contains it. Measured against two others on
jax 0.10.2: `jax.experimental.shard_alike` leaves nothing behind, but its
lowering is cached by operand types, so every param of one shape and dtype
lands in one sharding group and takes one param's sharding (two differently
sharded ``(8, 8)`` params both get the second one's); an arithmetic tie
(``x + 0 * p``) is not exact for infs.

In explicit-axes mode a leaf whose type already carries the param's sharding
needs nothing; one whose type disagrees (an optimizer that builds state with
``jnp.zeros(p.shape)``) is resharded with `jax.sharding.reshard` (which needs
``jax.set_mesh``, as explicit mode does anyway). Outside ``jit`` the leaves
are concrete and are `jax.device_put` where they differ from their param;
the other leaves are put replicated on the params' mesh, as ``jit`` places
them.
"""

import functools
from typing import Any, Callable, Optional

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from jaxmp._src.state import master_weights as masters_lib
from jaxmp._src import nnx_support
from jaxmp._src.state import state_codec

_is_empty = masters_lib.is_empty


def _is_encoded(x: Any) -> bool:
  return isinstance(x, state_codec.EncodedLeaf)


def _is_unit(x: Any) -> bool:
  """A leaf when matching against the params: empty, or one encoded leaf."""
  return _is_empty(x) or _is_encoded(x)


def is_array(x: Any) -> bool:
  """Whether ``x`` is an array or an abstract one (shape and dtype)."""
  return hasattr(x, "shape") and hasattr(x, "dtype")


def map_like_params(
  state: Any,
  params: Any,
  like: Callable[[Any, Any], Any],
  other: Callable[[Any], Any],
  encoded: Optional[Callable[[Any, Any], Any]] = None,
) -> Any:
  """Maps ``like(leaf, param)`` over param-shaped leaves, ``other(leaf)`` else.

  A `state_codec.EncodedLeaf` (low-bit optimizer state) counts as one leaf
  when a subtree is matched against the params' structure, so its subtree's
  plain leaves (the small ones kept fp32) still match their params.

  Args:
    state: any pytree (an optimizer state, or its `jax.eval_shape`).
    params: the params the state was built for.
    like: called on each param-shaped leaf and its param.
    other: called on every other leaf (``None`` and placeholders are kept).
    encoded: called on each encoded leaf of a param-shaped subtree and its
      param (``other`` on its children when not given).

  Returns:
    ``state`` with its leaves mapped.
  """
  pdef = jax.tree_util.tree_structure(params, is_leaf=_is_empty)
  pleaves = pdef.flatten_up_to(params)

  def matches(node) -> bool:
    if _is_unit(node):
      return False
    return jax.tree_util.tree_structure(node, is_leaf=_is_unit) == pdef

  def visit(node):
    if _is_empty(node):
      return node
    if not matches(node):
      return other(node)
    out = []
    leaves = jax.tree_util.tree_structure(node, is_leaf=_is_unit).flatten_up_to(
      node
    )
    for x, p in zip(leaves, pleaves):
      if _is_empty(x):
        out.append(x)
      elif _is_encoded(x) and x.spec.shape == tuple(getattr(p, "shape", ())):
        out.append(encoded(x, p) if encoded else jax.tree.map(other, x))
      elif is_array(x) and is_array(p) and tuple(x.shape) == tuple(p.shape):
        out.append(like(x, p))
      else:
        out.append(other(x))
    return pdef.unflatten(out)

  return jax.tree.map(
    visit, state, is_leaf=lambda n: _is_empty(n) or matches(n)
  )


def is_tracer(x: Any) -> bool:
  """Whether ``x`` is traced (inside ``jit`` or a transform)."""
  return isinstance(x, jax.core.Tracer)


def _explicit(sharding) -> bool:
  mesh = getattr(sharding, "mesh", None)
  types = getattr(mesh, "axis_types", ()) or ()
  return any(t == jax.sharding.AxisType.Explicit for t in types)


def _tie(leaf, param):
  """``leaf`` (same value) placed like ``param`` under a trace."""
  want = jax.typeof(param).sharding
  if _explicit(want):
    if jax.typeof(leaf).sharding.spec != want.spec:
      leaf = jax.sharding.reshard(leaf, want)
    return leaf
  # ``leaf`` whatever the predicate, placed like it (see the module
  # docstring: the barrier keeps the select from being folded too early).
  return jax.lax.select(
    param != param, leaf, jax.lax.optimization_barrier(leaf)
  )


def _axis_size(mesh, entry) -> int:
  """How many shards a `PartitionSpec` entry cuts an axis into."""
  if entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  size = 1
  for name in names:
    size *= sizes[name]
  return size


def encoded_specs(
  spec: PartitionSpec, mesh: Any, encoded: Any
) -> tuple[PartitionSpec, Optional[PartitionSpec]]:
  """The specs of an encoded leaf's ``data`` and ``scale``, from its param's.

  Blocks run along the last axis. The leading axes of both are sharded as
  the param's are. The last axis (the codes', the scales' blocks) is
  sharded as the param's for the codes of an unpadded leaf (their param's
  shape: the param's spec), and for the scales only where every shard
  holds whole blocks (the param's last-axis shard length a multiple of the
  block); elsewhere the scales' last axis is replicated (they are 1/block
  of the codes' elements), as are the codes' of a padded leaf (the last
  axis not a multiple of the block, so no longer the param's shape).
  """
  ndim = len(encoded.spec.shape)
  entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
  lead, last = entries[:-1], entries[-1] if ndim else None
  data_last = last
  if encoded.spec.kind == "int8" and last is not None:
    n = encoded.data.shape[-1]  # Padded to whole blocks.
    k = _axis_size(mesh, last)
    if n != encoded.spec.shape[-1]:  # Padded: no longer the param's shape.
      last, data_last = None, None
    elif n % k or (n // k) % encoded.spec.block:
      last = None
  data = PartitionSpec(*lead, data_last) if ndim else PartitionSpec()
  if encoded.scale is None:
    return data, None
  return data, PartitionSpec(*lead, last) if ndim else PartitionSpec()


def _block_pred(param, encoded) -> jax.Array:
  """Predicates like ``param != param`` of the codes' and scales' shapes.

  The codes' is ``param != param`` (padded as the codes are); the scales'
  is it reduced over each block. Elementwise or blockwise in ``param``, so
  propagation carries the param's sharding to both with no communication
  where every shard holds whole blocks.
  """
  spec = encoded.spec
  lead = spec.shape[:-1]
  pred = (param != param).reshape(lead + (spec.shape[-1],))
  padded = encoded.data.shape[-1] if spec.shape else 1
  if padded != pred.shape[-1]:
    pred = jax.numpy.pad(
      pred, [(0, 0)] * len(lead) + [(0, padded - spec.shape[-1])]
    )
  return pred, pred.reshape(lead + (padded // spec.block, spec.block)).any(-1)


def _tie_to(pred, leaf):
  """``leaf`` placed like the elementwise predicate ``pred`` (auto mode)."""
  return jax.lax.select(pred, leaf, jax.lax.optimization_barrier(leaf))


def _tie_encoded(e, param):
  """An encoded leaf placed from its ``param`` under a trace."""
  want = jax.typeof(param).sharding
  if _explicit(want):
    specs = encoded_specs(want.spec, want.mesh, e)
    parts = []
    for x, spec in zip((e.data, e.scale), specs):
      if x is not None and jax.typeof(x).sharding.spec != spec:
        x = jax.sharding.reshard(x, NamedSharding(want.mesh, spec))
      parts.append(x)
    return state_codec.EncodedLeaf(*parts, e.spec)
  if e.scale is None:
    return state_codec.EncodedLeaf(_tie(e.data, param), None, e.spec)
  if not e.spec.shape:  # A scalar: nothing to shard (jit replicates it).
    return e
  data_pred, scale_pred = _block_pred(param, e)
  data = _tie_to(data_pred.reshape(e.data.shape), e.data)
  return state_codec.EncodedLeaf(data, _tie_to(scale_pred, e.scale), e.spec)


def concrete_mesh(params: Any) -> Optional[jax.sharding.Mesh]:
  """The one mesh of the concrete params' `NamedSharding`s, else ``None``."""
  meshes = {
    p.sharding.mesh
    for p in jax.tree_util.tree_leaves(params)
    if isinstance(p, jax.Array)
    and not is_tracer(p)
    and isinstance(p.sharding, NamedSharding)
  }
  return meshes.pop() if len(meshes) == 1 else None


def place_like_params(state: Any, params: Any) -> Any:
  """``state`` with each param-shaped leaf placed like its param.

  Under a trace each param-shaped leaf is tied to its param (see the module
  docstring); the other leaves are left to ``jit`` (constants: replicated).
  Outside one, leaves are `jax.device_put` where their sharding differs:
  param-shaped ones like their param, the others replicated on the params'
  mesh when the params share one.

  Args:
    state: a freshly built optimizer state.
    params: the params it was built for.

  Returns:
    The same values, placed.
  """
  mesh = concrete_mesh(params)
  replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())

  def like(x, p):
    if is_tracer(p):
      return _tie(x, p)
    want = getattr(p, "sharding", None)
    if (
      isinstance(x, jax.Array)
      and not is_tracer(x)
      and want is not None
      and not x.sharding.is_equivalent_to(want, x.ndim)
    ):
      return jax.device_put(x, want)
    return x

  def encoded(e, p):
    if is_tracer(p):
      return _tie_encoded(e, p)
    want = getattr(p, "sharding", None)
    if isinstance(want, jax.sharding.SingleDeviceSharding):
      return jax.tree.map(lambda x: like(x, _Placed(want)), e)
    if not isinstance(want, NamedSharding):
      return e
    specs = encoded_specs(want.spec, want.mesh, e)
    parts = [
      x if x is None else like(x, _Placed(NamedSharding(want.mesh, spec)))
      for x, spec in zip((e.data, e.scale), specs)
    ]
    return state_codec.EncodedLeaf(*parts, e.spec)

  def other(x):
    if (
      replicated is not None
      and isinstance(x, jax.Array)
      and not is_tracer(x)
      and not x.sharding.is_equivalent_to(replicated, x.ndim)
    ):
      return jax.device_put(x, replicated)
    return x

  return map_like_params(state, params, like, other, encoded)


class _Placed:
  """Stands for a param with a sharding (see `place_like_params`)."""

  def __init__(self, sharding):
    self.sharding = sharding


def placed_like_params(init: Callable[[Any], Any]) -> Callable[[Any], Any]:
  """Decorates an ``init(params)``: its state `place_like_params`."""

  @functools.wraps(init)
  def placed_init(params):
    return place_like_params(init(params), params)

  return placed_init


def _path(path) -> str:
  return "params" + jax.tree_util.keystr(path)


def params_mesh(params: Any, what: str = "jaxmp.state_shardings"):
  """The one mesh every param is sharded over.

  Raises:
    ValueError: naming the leaf, for a param that is not an array with a
      `NamedSharding`, or for params on different meshes.
  """
  mesh, first = None, None
  for path, p in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_empty):
    if _is_empty(p):
      continue
    sharding = getattr(p, "sharding", None)
    if not is_array(p) or not isinstance(sharding, NamedSharding):
      raise ValueError(
        f"{what} needs params sharded on a mesh (or all on one device); "
        f"{_path(path)} is {type(p).__name__} with sharding {sharding!r}. "
        "Place them with jax.device_put(params, NamedSharding(mesh, spec)) "
        "(or pass jax.ShapeDtypeStruct(shape, dtype, "
        "sharding=NamedSharding(...)))"
      )
    if mesh is None:
      mesh, first = sharding.mesh, path
    elif sharding.mesh != mesh:
      raise ValueError(
        f"{what}: the params are on different meshes: {_path(first)} on "
        f"{mesh} and {_path(path)} on {sharding.mesh}; put every param on "
        "one mesh"
      )
  if mesh is None:
    raise ValueError(f"{what} needs at least one param (got {params!r})")
  return mesh


def _one_device(params: Any) -> Optional[Any]:
  """The device of params that all live on one, unsharded, else ``None``."""
  devices = set()
  for p in jax.tree_util.tree_leaves(params, is_leaf=_is_empty):
    if _is_empty(p):
      continue
    sharding = getattr(p, "sharding", None)
    if not isinstance(sharding, jax.sharding.SingleDeviceSharding):
      return None
    devices |= set(sharding.device_set)
  return devices.pop() if len(devices) == 1 else None


def state_shardings(opt: Any, params: Any) -> Any:
  """The shardings of ``opt.init(params)``: param-shaped leaves like their param.

  Every leaf of the state that sits in a subtree with the params' structure
  and has its param's shape (the fp32 masters, the Kahan compensation, the
  moments and traces of any optax optimizer inside `jaxmp.mixed_precision`,
  `jaxmp.multi_steps`' accumulator) gets its param's sharding; every other
  leaf (loss scale, counters, rounding key, and leaves of another shape,
  such as Adafactor's factored moments) is replicated on the params' mesh.
  Params that all live whole on one device (a `jax.sharding.SingleDeviceSharding`,
  as `jax.device_put` gives) give that device's sharding for every leaf:
  the target of a sharded checkpoint restored onto one device.

  ``jax.jit(opt.init)(params)`` and ``opt.init(params)`` already place the
  state so; use this for ``jax.jit(opt.init, out_shardings=...)``, to
  restore a checkpoint onto a mesh (orbax targets
  ``jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)``), or to move a
  state with ``jax.device_put(state, shardings)``.

  Args:
    opt: the optimizer (any optax `GradientTransformation`).
    params: the params, concrete arrays or shape structs
      (`jax.ShapeDtypeStruct`), each with a `jax.sharding.NamedSharding`,
      all on one mesh, or all on one device.

  Returns:
    A pytree with the structure of ``jax.eval_shape(opt.init, params)``
    whose leaves are each a `jax.sharding.NamedSharding` (a
    `jax.sharding.SingleDeviceSharding` for params on one device).

  Raises:
    ValueError: naming the param, for a param with neither sharding (a
      Python number, a shape struct without one), for params on different
      meshes, or for params on several devices without a mesh.

  >>> import jax, jax.numpy as jnp, optax, jaxmp
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> mesh = jax.make_mesh((1, jax.device_count()), ("data", "fsdp"))
  >>> w = jax.ShapeDtypeStruct(
  ...   (8, 4), jnp.float16, sharding=NamedSharding(mesh, P("fsdp")))
  >>> opt = jaxmp.mixed_precision(optax.adam(1e-3))
  >>> shardings = jaxmp.state_shardings(opt, {"w": w})
  >>> tuple(shardings.inner_state[0].mu["w"].spec), tuple(shardings.loss_scale.spec)
  (('fsdp',), ())
  """
  abstract = jax.eval_shape(opt.init, params)
  # NNX params and states: matched on their arrays, the variables put back.
  plain, params = nnx_support.unwrap(abstract), nnx_support.unwrap(params)
  device = _one_device(params)
  if device is not None:  # No mesh: every leaf on that device.
    one = jax.sharding.SingleDeviceSharding(device)
    return nnx_support.wrap_like(jax.tree.map(lambda _: one, plain), abstract)
  mesh = params_mesh(params)
  replicated = NamedSharding(mesh, PartitionSpec())

  def encoded(e, p):
    data, scale = encoded_specs(p.sharding.spec, mesh, e)
    return state_codec.EncodedLeaf(
      NamedSharding(mesh, data),
      None if scale is None else NamedSharding(mesh, scale),
      e.spec,
    )

  shardings = map_like_params(
    plain, params, lambda _, p: p.sharding, lambda _: replicated, encoded
  )
  return nnx_support.wrap_like(shardings, abstract)
