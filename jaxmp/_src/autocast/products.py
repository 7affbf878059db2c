"""Matrix products whose weight cotangents leave the product in fp32.

Under GSPMD, a weight gradient's cross-device sum sits at the output of the
backward product that contracts the batch, in that product's dtype. For a
product run in half precision (autocast, or half params), JAX's transpose
rule binds that backward product with a half output, so the gradient is
summed in half across devices. `product` binds the forward product as
before, and computes the cotangent of each ``wide`` operand with the same
backward product on the same half operands, asking only for an fp32 output
(``preferred_element_type``): the cross-device sum then runs in fp32 (or,
with ``"half_wire"``, on a half wire with fp32 adds), and on one device the
weight gradient no longer passes through half on its way to fp32.

The backward products are JAX's own: the transpose of the forward is traced
(``jax.vjp`` in the operand) and evaluated again with its products asked for
fp32, so every dimension layout, feature group and sharding JAX supports is
handled as JAX handles it. These products are ``custom_vjp`` functions:
reverse mode only (``grad_reduce="native"`` for ``jax.jvp``).
"""

from typing import Sequence

import jax
import jax.numpy as jnp

from jaxmp._src import vma as vma_lib
from jaxmp._src.autocast import _jaxpr_interp as ji
from jaxmp._src.reduction import wire

_SymbolicZero = jax.custom_derivatives.SymbolicZero

PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


def product(eqn, operands: Sequence, dtypes: Sequence, wide, mode, updates):
  """``eqn`` bound on ``operands`` cast to ``dtypes``, wide cotangents.

  Args:
    eqn: a ``dot_general`` or ``conv_general_dilated`` equation.
    operands: its two operands, in the dtypes the caller differentiates
      (fp32 params under autocast, half params under ``value_and_grad``).
    dtypes: the dtypes the forward product runs in.
    wide: per operand, whether its cotangent leaves the backward product in
      fp32 (a weight's); the others keep plain JAX's cotangent.
    mode: ``"fp32"`` or ``"half_wire"``.
    updates: parameters of ``eqn`` to change (``preferred_element_type``).

  Returns:
    The product, as ``ji.bind(eqn, casts, **updates)`` would return it.
  """
  in_dtypes = [jnp.dtype(x.dtype) for x in operands]
  # Inside shard_map: the axes each operand varies over (its placeholder's).
  vma = [vma_lib.varying(x) for x in operands]
  # Explicit-axes mode: each cotangent must carry its operand's sharding.
  shardings = [_explicit_sharding(x) for x in operands]

  def casts(ops):
    return [x if x.dtype == d else x.astype(d) for x, d in zip(ops, dtypes)]

  @jax.custom_vjp
  def prod(*ops):
    return ji.bind(eqn, casts(ops), **updates)[0]

  def prod_fwd(*ops):
    # Only the operands whose cotangents are asked for (perturbed) need the
    # other operand saved: data's weight is not saved for data's cotangent.
    perturbed = [p.perturbed for p in ops]
    cast = casts([p.value for p in ops])
    out = ji.bind(eqn, cast, **updates)[0]
    saved = [x if perturbed[1 - j] else None for j, x in enumerate(cast)]
    return out, (saved, perturbed)

  def prod_bwd(res, g):
    saved, perturbed = res
    # An operand's own value is never read for its cotangent (a product is
    # linear in it): where it was not saved, its zeros stand for its type.
    saved = [
      _resharded(
        _zeros_like(operands[j].shape, dtypes[j], vma[j]), shardings[j]
      )
      if x is None
      else x
      for j, x in enumerate(saved)
    ]
    cts = []
    for j, dtype in enumerate(in_dtypes):
      if not perturbed[j] or isinstance(g, _SymbolicZero):
        cts.append(None)
        continue
      if wide[j] and not (mode == "half_wire" and _activation(eqn, j)):
        ct = _wide_cotangent(eqn, updates, saved, g, j, mode, shardings[j])
      else:
        ct = _cotangent(eqn, updates, saved, g, j, wide_out=False)
      cts.append(_resharded(ct.astype(dtype), shardings[j]))
    return tuple(cts)

  prod.defvjp(prod_fwd, prod_bwd, symbolic_zeros=True)
  return prod(*operands)


def _explicit_sharding(x):
  """``x``'s (a value's or a type's) sharding under explicit axes, or None."""
  aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
  sharding = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  types = getattr(mesh, "axis_types", ()) or ()
  if explicit is None or not any(t == explicit for t in types):
    return None
  return sharding


def _resharded(x, sharding):
  """``x`` typed with ``sharding`` (explicit axes only)."""
  if sharding is None or getattr(jax.typeof(x), "sharding", None) == sharding:
    return x
  # The sharding itself (its mesh with it): no mesh need be set.
  return jax.sharding.reshard(x, sharding)


def _zeros_like(shape, dtype, vma):
  zeros = jnp.zeros(shape, dtype)
  return vma_lib.mark_varying(zeros, tuple(sorted(vma))) if vma else zeros


def _cotangent(eqn, updates, cast, g, j, wide_out: bool):
  """The cotangent of operand ``j``: JAX's transpose, fp32 out if asked."""

  def linear(t):
    args = list(cast)
    args[j] = t
    return ji.bind(eqn, args, **updates)[0]

  # jax.vjp at the operand itself (its value unused: the product is linear
  # in it) keeps the types shard_map checks (which axes a value varies
  # over), which linear_transpose's abstract primal drops.
  _, transpose = jax.vjp(linear, cast[j])
  if not wide_out:
    return transpose(g)[0]
  jaxpr = jax.make_jaxpr(lambda c: transpose(c)[0])(g)
  return ji.evaluate(jaxpr, [g], _widen)[0][0]


def bind_f32(eqn, args, updates=None):
  """Binds product ``eqn`` on ``args`` with an fp32 output.

  XLA:CPU runs no bf16 x bf16 -> f32 product outside a fusion
  ("Unsupported element type for DotThunk"), so on CPU bf16 operands are
  widened first (it computes bf16 in fp32 anyway); elsewhere the operands
  stay as they are.
  """
  if jax.default_backend() == "cpu" and any(
    jnp.dtype(x.dtype) == jnp.dtype(jnp.bfloat16) for x in args
  ):
    args = [x.astype(wire.F32) for x in args]
  return ji.bind(
    eqn, args, **dict(updates or {}, preferred_element_type=wire.F32)
  )[0]


def _widen(eqn, invals, inweak):
  """Binds a backward product with an fp32 output; keeps it fp32 after."""
  name = ji.primitive_name(eqn)
  if name in PRODUCTS:
    outs = [bind_f32(eqn, invals)]
  elif (
    name == "convert_element_type"
    and jnp.dtype(invals[0].dtype) == wire.F32
    and jnp.dtype(ji.params(eqn)["new_dtype"]) in wire.HALF
  ):
    outs = [invals[0]]  # The transpose's cast back to half: skipped.
  else:
    outs = ji.bind(eqn, invals)
  return outs, [False] * len(outs)


def _wide_cotangent(eqn, updates, cast, g, j, mode, target=None):
  """The fp32 cotangent of operand ``j``; on a half wire where asked."""
  if mode == "half_wire":
    plan = _half_wire_plan(eqn, cast, g, j)
    if plan is not None:
      return _half_wire_cotangent(eqn, updates, cast, g, j, *plan, target)
  return _cotangent(eqn, updates, cast, g, j, wide_out=True)


def _batch_dims(eqn, j):
  """(the other operand's batch dim, the output's), or None.

  The batch is the leading dimension of the other operand when it is a free
  dimension that leads the output too: a dense layer's ``x @ w``, an einsum
  ``btd,df->btf``, a convolution's ``N`` (by its dimension numbers).
  """
  p = ji.params(eqn)
  k = 1 - j
  name = ji.primitive_name(eqn)
  if name == "dot_general":
    (contract, batch) = p["dimension_numbers"]
    if batch[0] or batch[1]:
      return None
    if 0 in contract[k]:
      return None
    if k == 0:
      return 0, 0
    return None  # w @ x: the batch is not the output's leading dim.
  dn = p["dimension_numbers"]
  if j != 1 or p.get("batch_group_count", 1) != 1:
    return None
  return dn.lhs_spec[0], dn.out_spec[0]


def _activation(eqn, j):
  """Whether operand ``j`` is the batch side (``x`` of ``x @ w``).

  The other operand is then a weight whose cotangent contracts the batch.

  Under ``"half_wire"`` its cotangent is JAX's, in the product's dtype: it
  sums nothing over the batch (as plain JAX, and as Megatron leaves a
  tensor-parallel layer's), and an fp32 cotangent would have XLA:CPU widen
  the weight before it gathers it again (FSDP): twice the bytes.
  """
  return _batch_dims(eqn, j) is None and _batch_dims(eqn, 1 - j) is not None


def _half_wire_plan(eqn, cast, g, j):
  """``(mesh, axes, dims)`` for operand ``j``'s half-wire cotangent, or None.

  The mesh is `jax.set_mesh`'s or the one the operands' types carry; None
  (the fp32 sum) where there is none (nothing crosses devices) or the batch
  does not split evenly over its devices.
  """
  dims = _batch_dims(eqn, j)
  if dims is None:
    return None
  plan = wire.batch_plan([cast[1 - j], g], dims)
  return None if plan is None else (*plan, dims)


def _half_wire_cotangent(eqn, updates, cast, g, j, mesh, axes, dims, target):
  """Operand ``j``'s cotangent: per-device partials sent in half.

  Each device computes its partial cotangent from its slice of the batch in
  fp32; `wire.batch_summed` sends the partials in the product's half dtype
  by one all-to-all and adds them in fp32, laid out as the gradient's
  sharding asks (a parameter's shards: no gather; replicated: a gather in
  half).
  """
  k = 1 - j
  wire_dtype = jnp.dtype(cast[j].dtype)
  if wire_dtype not in wire.HALF:
    wire_dtype = jnp.dtype(g.dtype)
  local_updates = dict(updates)
  if "out_sharding" in ji.params(eqn):
    local_updates["out_sharding"] = None
  shape = cast[j].shape

  def partial(other, gl):
    ops = [None, None]
    ops[k] = other
    ops[j] = _zeros_like(shape, cast[j].dtype, vma_lib.varying(other))
    return _cotangent(eqn, local_updates, ops, gl, j, wide_out=True)

  plan = (mesh, axes)
  ct = wire.batch_summed(
    partial, [cast[k], g], dims, wire_dtype, plan, target, shape
  )
  # Inside a shard_map's manual axes: typed (and summed over them) as JAX
  # types the cotangent of operand j.
  return vma_lib.match(ct, vma_lib.varying(cast[j]))


def summed_in_fp32(eqn, invals, mode="fp32"):
  """``eqn`` (a broadcast or a gather of a half weight), summed back in fp32.

  The transpose of a broadcast sums over what it broadcast (a bias's or a
  norm scale's gradient, over the batch); a gather's scatter-adds (an
  embedding's). Both run on the fp32 cotangent, so a cross-device sum at
  their output runs in fp32; the result is rounded to the weight's dtype.
  ``invals[0]`` is the op's only float operand (a gather's indices follow).
  With ``mode="half_wire"``, a gather's (batch-leading indices) is summed
  on a half wire with fp32 adds (`wire.batch_summed`).
  """
  x = invals[0]
  dtype, shape = x.dtype, x.shape
  vma = vma_lib.varying(x)
  sharding = _explicit_sharding(x)

  @jax.custom_vjp
  def op(x, *rest):
    return ji.bind(eqn, [x, *rest])[0]

  def op_fwd(x, *rest):
    return op(x, *rest), rest

  def op_bwd(rest, g):
    if mode == "half_wire":
      ct = _half_wire_gather(eqn, x, rest, g)
      if ct is not None:
        return (_resharded(ct.astype(dtype), sharding), *[None] * len(rest))
    linear = lambda t: ji.bind(eqn, [t, *rest])[0]
    wide = _resharded(_zeros_like(shape, wire.F32, vma), sharding)
    (ct,) = jax.vjp(linear, wide)[1](g.astype(wire.F32))
    return (_resharded(ct.astype(dtype), sharding), *[None] * len(rest))

  op.defvjp(op_fwd, op_bwd)
  return op(*invals)


def _half_wire_gather(eqn, x, rest, g):
  """A gather's (an embedding's) scatter-add on a half wire, or None.

  None (the fp32 sum) unless the gather's output leads with its indices'
  leading (batch) dimension and a mesh splits it evenly.
  """
  if ji.primitive_name(eqn) != "gather" or len(rest) != 1:
    return None
  idx, dn = rest[0], ji.params(eqn)["dimension_numbers"]
  if (
    idx.ndim < 2
    or 0 in dn.offset_dims
    or getattr(dn, "operand_batching_dims", ())
    or idx.shape[0] != g.shape[0]
  ):
    return None
  plan = wire.batch_plan([idx, g], [0, 0])
  if plan is None:
    return None
  shape = x.shape

  def partial(i, gl):
    zeros = _zeros_like(shape, wire.F32, vma_lib.varying(i))
    linear = lambda t: ji.bind(eqn, [t, i])[0]
    return jax.vjp(linear, zeros)[1](gl.astype(wire.F32))[0]

  sharding = _explicit_sharding(x)
  ct = wire.batch_summed(
    partial, [idx, g], [0, 0], x.dtype, plan, sharding, shape
  )
  return vma_lib.match(ct, vma_lib.varying(x))


def broadcast_summed_in_fp32(x, shape, like=None):
  """``x`` broadcast to ``shape`` (its size-1 dims), summed back in fp32.

  For an elementwise op that broadcasts a half weight itself (``h + b``
  with ``b`` of shape ``(1, d)``): its transpose would sum the cotangent
  over the batch in half. With explicit axes the broadcast takes the
  sharding of ``like`` (the op's output), so that its cotangent stays
  sharded until the fp32 sum.
  """
  dtype = x.dtype
  sharding = _explicit_sharding(x)
  out_sharding = None if like is None else _explicit_sharding(like)
  axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if a != b)

  @jax.custom_vjp
  def op(x):
    return _resharded(jnp.broadcast_to(x, shape), out_sharding)

  def op_fwd(x):
    return op(x), None

  def op_bwd(_, g):
    summed = jnp.sum(g.astype(wire.F32), axis=axes, keepdims=True)
    return (_resharded(summed.astype(dtype), sharding),)

  op.defvjp(op_fwd, op_bwd)
  return op(x)
