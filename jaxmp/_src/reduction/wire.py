"""The ``grad_reduce`` modes, the half-wire sum and `pmean_grads`.

A ring all-reduce (NCCL's) adds in the dtype of what it sends and rounds at
every hop, so an fp16 or bf16 all-reduce of gradients loses more the more
devices there are, and a sum of loss-scaled fp16 partials can overflow where
no partial did. The modes:

* ``"fp32"`` (the default): the sum runs in fp32, on an fp32 wire (twice the
  bytes of a half all-reduce).
* ``"half_wire"``: half precision on the wire, fp32 accumulation, as
  Megatron-LM's ``--grad-reduce-in-bf16``: an all-to-all of the half
  partials and an fp32 sum of this device's chunk. Where the gradient is
  sharded as its parameter is (FSDP), the chunk is this device's shard and
  nothing follows (a reduce-scatter in effect); where it is replicated, the
  chunk is rounded once to half and gathered in half. Either way the bytes
  of a half all-reduce or reduce-scatter.
* ``"native"``: what XLA does by itself: the sum in the product's dtype.
"""

import contextlib
import contextvars
import functools
import math
from typing import Any, Callable, Optional, Sequence, Union

import jax
from jax import lax
from jax.experimental import custom_partitioning as cp
import jax.numpy as jnp

MODES = ("fp32", "half_wire", "native")
F32 = jnp.dtype(jnp.float32)
HALF = frozenset({jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)})


def _gather_invariant(x, axis_name):
  """``all_gather`` typed as the same on every device (shard_map's checks).

  ``all_gather(..., to="invarying")`` where jax takes it (0.10 on); before,
  the private ``all_gather_invariant``.
  """
  try:
    return lax.all_gather(x, axis_name, tiled=True, to="invarying")
  except (TypeError, ValueError):  # jax 0.9: no such `to`.
    from jax._src.lax import parallel  # pylint: disable=g-import-not-at-top

    return parallel.all_gather_invariant(x, axis_name, tiled=True)


def check_mode(grad_reduce: Any, where: str) -> str:
  """``grad_reduce`` if it is one of `MODES`, else a ``ValueError``."""
  if isinstance(grad_reduce, str) and grad_reduce in MODES:
    return grad_reduce
  raise ValueError(
    f"{where}: grad_reduce must be one of {', '.join(map(repr, MODES))}; "
    f"got {grad_reduce!r}. 'fp32' sums gradients across devices in fp32 "
    "(the default), 'half_wire' sends half precision and adds in fp32, "
    "'native' leaves the sum in the product's dtype (XLA's choice)"
  )


def _axes_size(axis_name) -> int:
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  return math.prod(lax.axis_size(n) for n in names)


def half_wire_chunks(partial: jax.Array, axis_name, wire) -> jax.Array:
  """This device's chunk of the sum of ``partial`` over ``axis_name``.

  Inside ``shard_map``: ``partial`` (any shape, any float dtype) is
  flattened, padded to ``n`` equal chunks, sent as ``wire`` by one
  all-to-all, and the ``n`` chunks this device receives are added in fp32.
  Returns the fp32 chunk, of ``ceil(size / n)`` elements.
  """
  n = _axes_size(axis_name)
  flat = partial.reshape(-1)
  k = -(-flat.size // n)
  flat = jnp.pad(flat, (0, n * k - flat.size))
  sent = flat.astype(wire).reshape(n, k)
  got = lax.all_to_all(sent, axis_name, 0, 0, tiled=True)
  return jnp.sum(got.astype(F32), axis=0)


# The mode of `summed_over_batch`: autocast sets it while it traces a
# custom_vjp's bwd rule (jaxmp.nn's convolution), "native" elsewhere.
_MODE = contextvars.ContextVar("jaxmp_grad_reduce", default="native")


@contextlib.contextmanager
def reducing(mode: str):
  """Within: `summed_over_batch` sums as ``grad_reduce=mode`` says."""
  token = _MODE.set(mode)
  try:
    yield
  finally:
    _MODE.reset(token)


def find_mesh(values: Sequence[Any] = ()):
  """``(mesh, axes)`` a gradient is summed over, or None.

  The mesh of ``jax.set_mesh``, else the mesh the types of ``values`` carry
  (arrays placed with a ``NamedSharding``, under ``jit``); ``axes``: its
  axes of more than one device that are not manual (``shard_map``'s). None
  where there is no such mesh: one device, or values not placed on a mesh
  (then nothing is summed across devices).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    mesh = None
    for x in values:
      m = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
      if m is not None and not m.empty:
        mesh = m
        break
  if mesh is None:
    return None
  manual = getattr(jax.sharding.AxisType, "Manual", None)
  types = getattr(mesh, "axis_types", None) or (None,) * len(mesh.axis_names)
  axes = tuple(
    a
    for a, t in zip(mesh.axis_names, types)
    if t != manual and mesh.shape[a] > 1
  )
  return (mesh, axes) if axes else None


def batch_plan(operands: Sequence[jax.Array], dims: Sequence[int]):
  """`find_mesh`'s ``(mesh, axes)``, where the operands' batch splits evenly.

  Each ``operands[i]``'s dim ``dims[i]`` must split evenly over ``axes``;
  else None (the fp32 sum).
  """
  found = find_mesh(operands)
  if found is None:
    return None
  mesh, axes = found
  n = math.prod(mesh.shape[a] for a in axes)
  if any(x.shape[d] % n for x, d in zip(operands, dims)):
    return None
  return found


def _spec(ndim: int, dim: Optional[int], axes) -> jax.sharding.PartitionSpec:
  spec = [None] * ndim
  if dim is not None:
    spec[dim] = tuple(axes)
  return jax.sharding.PartitionSpec(*spec)


def _layout(sharding, axes, shape, sizes):
  """``(dim, shard_axes)``: the one dim ``sharding`` splits, or ``(None, ())``.

  The dim must be split over axes all in ``axes``, evenly; anything else is
  laid out replicated over ``axes``.
  """
  spec = tuple(getattr(sharding, "spec", None) or ())
  split = [(d, s) for d, s in enumerate(spec) if s is not None and s != ()]
  if len(split) != 1:
    return None, ()
  d, names = split[0]
  names = tuple(names) if isinstance(names, (tuple, list)) else (names,)
  if not set(names) <= set(axes) or shape[d] % math.prod(
    sizes[a] for a in names
  ):
    return None, ()
  return d, names


def _reduce_local(x, axes, sizes, dim, shard_axes, typed=True):
  """This device's part of the sum of ``x`` (its half partial) over ``axes``.

  The result has dim ``dim`` split over ``shard_axes``, the rest replicated.

  One all-to-all sends each device its piece of every partial (in half);
  the pieces are added in fp32. Where the result is replicated over some
  axes (all of them for data parallelism), each piece is rounded once to
  half and gathered over them in half; a result split over all of ``axes``
  (a parameter sharded as the batch) keeps its fp32 sum.
  """
  wire_dtype, shape = x.dtype, x.shape
  rest = tuple(a for a in axes if a not in shard_axes)
  n_shard = math.prod(sizes[a] for a in shard_axes)
  n_rest = math.prod(sizes[a] for a in rest)
  y = x.reshape(1, -1) if dim is None else jnp.moveaxis(x, dim, 0)
  moved = y.shape
  m = moved[0] // n_shard if dim is not None else moved[1]
  tail = moved[1:] if dim is not None else ()
  y = y.reshape(n_shard, m, *tail)
  k = -(-m // n_rest)
  y = jnp.pad(y, [(0, 0), (0, n_rest * k - m)] + [(0, 0)] * len(tail))
  order = shard_axes + rest
  y = y.reshape(*(sizes[a] for a in order), k, *tail)
  perm = [order.index(a) for a in axes] + list(range(len(order), y.ndim))
  y = jnp.transpose(y, perm).reshape(n_shard * n_rest, k, *tail)
  got = lax.all_to_all(y, axes, 0, 0, tiled=True)
  total = jnp.sum(got.astype(F32), axis=0)
  if rest:
    half = total.astype(wire_dtype)
    if typed:
      total = _gather_invariant(half, rest)
    else:
      total = lax.all_gather(half, rest, tiled=True)
  total = total[:m].astype(F32)
  if dim is None:
    return total.reshape(shape)
  return jnp.moveaxis(total, 0, dim)


_LETTERS = "abcdefghijklmopqrstuvwxyz"  # Shardy factor names; "n": devices.


@functools.lru_cache(maxsize=None)
def _reducer(ndim: int):
  """``reduce(parts, axes)``: the fp32 sum over dim 0 of ``parts``, half wire.

  ``parts``: one half partial per device, dim 0 split over ``axes``.

  A ``custom_partitioning`` op: XLA's partitioner gives it the layout its
  users ask of the sum (replicated for data parallelism, a parameter's
  shards for FSDP), and `_reduce_local` produces exactly that layout.
  """

  @functools.partial(cp.custom_partitioning, static_argnums=(1,))
  def reduce(parts, axes):
    del axes
    return jnp.sum(parts.astype(F32), axis=0)

  def partition(axes, mesh, arg_shapes, result_shape):
    del arg_shapes
    sizes = dict(mesh.shape)
    shape = result_shape.shape
    dim, shard_axes = _layout(result_shape.sharding, axes, shape, sizes)

    def lower(parts):
      return _reduce_local(parts[0], axes, sizes, dim, shard_axes, False)

    named = jax.sharding.NamedSharding
    out = named(mesh, _spec(len(shape), dim, shard_axes))
    return mesh, lower, out, (named(mesh, _spec(ndim + 1, 0, axes)),)

  def infer(axes, mesh, arg_shapes, result_shape):
    del axes, arg_shapes, result_shape
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def propagate(axes, mesh, user_shape):
    del axes, mesh
    return user_shape.sharding

  dims = " ".join(_LETTERS[:ndim])
  reduce.def_partition(
    partition,
    infer_sharding_from_operands=infer,
    propagate_user_sharding=propagate,
    sharding_rule=f"n {dims} -> {dims}",
    reduction_factors=("n",),
  )
  return reduce


def batch_summed(
  fn: Callable[..., jax.Array],
  operands: Sequence[jax.Array],
  dims: Sequence[int],
  wire_dtype,
  plan,
  target=None,
  shape: Sequence[int] = (),
) -> jax.Array:
  """The sum over the devices of ``fn``'s partials, on a half wire.

  ``fn(*local operands)`` is one device's partial (of a weight's
  cotangent); each ``operands[i]`` is split on dim ``dims[i]`` (its batch)
  over every axis of ``plan`` (`batch_plan`'s). The partial is rounded to
  ``wire_dtype``, sent by one all-to-all, and added in fp32 (`_reduce_local`).
  Returns the fp32 sum (of ``shape``), laid out as ``target`` says (a
  sharding: a mesh of explicit axes), replicated inside a ``shard_map``, or
  else as XLA's partitioner lays out its users.
  """
  mesh, axes = plan
  P = jax.sharding.PartitionSpec
  in_specs = tuple(_spec(x.ndim, d, axes) for x, d in zip(operands, dims))
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  if any(t == explicit for t in getattr(mesh, "axis_types", ())):
    operands = [
      jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, s))
      for x, s in zip(operands, in_specs)
    ]

  def partial(*ops):
    return fn(*ops).astype(wire_dtype)

  manual = getattr(jax.sharding.AxisType, "Manual", None)
  if target is not None or manual in getattr(mesh, "axis_types", ()):
    # The layout is known (explicit axes), or inside a shard_map's manual
    # axes (no custom_partitioning there: replicated): one shard_map.
    sizes = dict(mesh.shape)
    dim, shard_axes = _layout(target, axes, shape, sizes)
    return jax.shard_map(
      lambda *ops: _reduce_local(partial(*ops), axes, sizes, dim, shard_axes),
      mesh=mesh,
      in_specs=in_specs,
      out_specs=_spec(len(shape), dim, shard_axes),
      axis_names=set(axes),
    )(*operands)
  parts = jax.shard_map(
    lambda *ops: partial(*ops)[None],
    mesh=mesh,
    in_specs=in_specs,
    out_specs=P(axes),
    axis_names=set(axes),
  )(*operands)
  return _reducer(parts.ndim - 1)(parts, axes)


def summed_over_batch(fn: Callable[..., jax.Array], *operands) -> jax.Array:
  """``fn(*operands)``, a weight's cotangent, summed as ``grad_reduce`` says.

  ``fn`` contracts the leading (batch) dimension of every operand.

  Under ``grad_reduce="half_wire"`` (autocast sets it while it traces a
  ``custom_vjp``'s bwd rule: jaxmp.nn's convolution) and a mesh that splits
  the batch evenly, its cross-device sum is `batch_summed`'s half-wire sum;
  otherwise it is ``fn(*operands)``.
  """
  if _MODE.get() != "half_wire" or not operands:
    return fn(*operands)
  wire_dtype = next(
    (jnp.dtype(x.dtype) for x in operands if jnp.dtype(x.dtype) in HALF),
    None,
  )
  plan = batch_plan(operands, [0] * len(operands))
  if wire_dtype is None or plan is None:
    return fn(*operands)
  shape = jax.eval_shape(fn, *operands).shape
  dims = [0] * len(operands)
  return batch_summed(fn, operands, dims, wire_dtype, plan, None, shape)


def _half_wire_sum(x: jax.Array, axis_name, wire) -> jax.Array:
  """The sum of ``x`` over ``axis_name``: ``wire`` on the wire, fp32 adds."""
  chunk = half_wire_chunks(x, axis_name, wire).astype(wire)
  full = _gather_invariant(chunk, axis_name)
  return full[: x.size].reshape(x.shape).astype(F32)


def pmean_grads(
  grads: Any,
  axis_name: Union[str, Sequence[str]],
  grad_reduce: str = "fp32",
) -> Any:
  """The mean of ``grads`` over ``axis_name``, summed as ``grad_reduce`` says.

  For data parallelism written with ``jax.shard_map`` (or ``pmap``): where
  ``jax.lax.pmean(grads, axis_name)`` sums fp16 or bf16 gradients in their
  own dtype, ``"fp32"`` (the default) sums them in fp32, ``"half_wire"``
  sends them in half and adds them in fp32 (an all-to-all, fp32 adds of
  this device's chunk, an all-gather: the bytes of a half all-reduce), and
  ``"native"`` is ``lax.pmean``. fp32 leaves are summed in fp32 by every
  mode; integer leaves are left alone. Each leaf comes back in its dtype,
  rounded once after the sum.

  Args:
    grads: a pytree of gradients, this device's.
    axis_name: the mapped axis, or a tuple of them.
    grad_reduce: ``"fp32"``, ``"half_wire"`` or ``"native"``.

  Returns:
    The mean over the devices of ``axis_name``, the same on each.

  >>> import jax, jax.numpy as jnp, numpy as np, jaxmp
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
  >>> g = {"w": jnp.full((1, 4), 3.0, jnp.float16)}
  >>> mean = jax.shard_map(
  ...   lambda t: jaxmp.pmean_grads(t, "data", grad_reduce="half_wire"),
  ...   mesh=mesh, in_specs=P("data"), out_specs=P())(g)
  >>> mean["w"].dtype, np.asarray(mean["w"])[0, 0]
  (dtype('float16'), np.float16(3.0))
  """
  check_mode(grad_reduce, "jaxmp.pmean_grads")

  def one(g):
    if not isinstance(g, jax.Array) or not jnp.issubdtype(
      g.dtype, jnp.floating
    ):
      return g
    n = _axes_size(axis_name)
    dtype = jnp.dtype(g.dtype)
    if grad_reduce == "native" or dtype not in HALF and dtype != F32:
      return lax.pmean(g, axis_name)
    if grad_reduce == "half_wire" and dtype in HALF:
      total = _half_wire_sum(g, axis_name, dtype)
    else:
      total = lax.psum(g.astype(F32), axis_name)
    return (total / n).astype(dtype)

  return jax.tree.map(one, grads)
