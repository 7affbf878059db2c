"""The ``grad_reduce`` modes, the half-wire sum and `pmean_grads`.

A ring all-reduce (NCCL's) adds in the dtype of what it sends and rounds at
every hop, so an fp16 or bf16 all-reduce of gradients loses more the more
devices there are, and a sum of loss-scaled fp16 partials can overflow where
no partial did. The modes:

* ``"fp32"`` (the default): the sum runs in fp32, on an fp32 wire (twice the
  bytes of a half all-reduce).
* ``"half_wire"``: half precision on the wire, fp32 accumulation, as
  Megatron-LM's ``--grad-reduce-in-bf16``: an all-to-all of the half
  partials, an fp32 sum of this device's chunk, then the chunks gathered in
  half (the bytes of a half all-reduce).
* ``"native"``: what XLA does by itself: the sum in the product's dtype.
"""

import math
from typing import Any, Sequence, Union

import jax
from jax import lax
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
