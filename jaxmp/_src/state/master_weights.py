"""How a half-precision param keeps its fp32 updates: one object per mode.

`mixed_precision` runs its inner optimizer on an fp32 *view* of the params
and gets fp32 updates ``u`` back. A master-weights mode decides three things,
and each is one method of its object:

- ``init(params)``: the buffers it keeps in the state (`Buffers`);
- ``view(params, buffers)``: the fp32 value the inner optimizer sees;
- ``targets(params, new_view, buffers, applied)``: the half value each half
  param must land on after the step (``None``: plain ``param + u``), and the
  buffers of the next step (the old ones where the step was not applied).

==================  ==================  ===================  ================
mode                buffers             fp32 view            target
==================  ==================  ===================  ================
``"fp32"``          fp32 masters        the master           ``cast(master)``
``"kahan"``         compensation ``c``  ``param + c``        nearest half
``"stochastic"``    one PRNG key        the upcast param     stochastic round
``"remainder"``     int16 low bits      ``param ++ r``       nearest, ties up
``"none"``          nothing             the upcast param     ``param + u``
==================  ==================  ===================  ================

fp32 params are their own masters in every mode: no buffer, no target.

``"remainder"`` (bfloat16 params only) keeps the fp32 master exactly in 2
bytes: bfloat16 is the upper half of float32's bits, so the master is the
param's 16 bits followed by 16 more. The param is the master rounded to
nearest with ties away from zero (not to even: the signed remainder of a
round-to-nearest-even spans -0x8000..+0x8000, 65,537 values, one more than
16 bits hold; with ties one fixed way it spans -0x8000..0x7FFF, an int16).
The param so equals ``cast(master)`` of the fp32 mode except on exact ties
(the master's low 16 bits exactly 0x8000, one master in 65,536), where it is
one ulp farther from zero. Truncation would fit as well, but its params sit
half an ulp below the master on average, a bias of ``2**-9`` relative.
"""

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxmp._src import dtypes
from jaxmp._src.state import eager
from jaxmp._src.state import rounding

MODES = ("fp32", "none", "kahan", "stochastic", "remainder")


class Buffers(NamedTuple):
  """What a mode keeps in the state, ``None`` where it keeps nothing.

  Attributes:
    master_params: fp32 masters of the half params (``"fp32"``).
    compensation: the rounding error of each half param (``"kahan"``).
    rounding_key: the raw ``uint32[2]`` key of the next step's rounding
      (``"stochastic"``).
    remainder: the low 16 bits of each bfloat16 param's fp32 master, an
      int16 (``"remainder"``).
  """

  master_params: Any = None
  compensation: Any = None
  rounding_key: Optional[jax.Array] = None
  remainder: Any = None


class Placeholder:
  """A master where the params hold ``None``, not a param: no master at all.

  ``eqx.filter(model, eqx.is_inexact_array)`` leaves ``None`` for every
  non-array field (an activation function); the fp32-master tree marks
  those places with this empty node, so that a ``None`` master always means
  an fp32 param (its own master). A pytree without leaves.
  """

  def __eq__(self, other: Any) -> bool:
    """Every placeholder is the same."""
    return isinstance(other, Placeholder)

  def __hash__(self) -> int:
    """One hash for all."""
    return hash(Placeholder)

  def __repr__(self) -> str:
    """``Placeholder()``."""
    return "Placeholder()"


jax.tree_util.register_pytree_node(
  Placeholder, lambda _: ((), None), lambda *_: Placeholder()
)


def is_empty(x: Any) -> bool:
  """``None`` (an fp32 param's master) or a `Placeholder` (no param)."""
  return x is None or isinstance(x, Placeholder)


def placeholders_to_none(tree: Any) -> Any:
  """``tree`` with every `Placeholder` back to ``None``, as in the params."""
  return jax.tree.map(
    lambda x: None if isinstance(x, Placeholder) else x, tree, is_leaf=is_empty
  )


def _no_masters(params):
  """The masters of a mode that keeps none: ``None``, `Placeholder` for ``None``."""
  return jax.tree.map(
    lambda p: Placeholder() if p is None else None,
    params,
    is_leaf=lambda x: x is None,
  )


def _none_like(tree):
  return jax.tree.map(lambda _: None, tree)


def _select(applied, new, old):
  """``new`` where the step was applied, ``old`` elsewhere (``None`` kept)."""
  return jax.tree.map(
    lambda o, n: o if is_empty(o) else jnp.where(applied, n, o),
    old,
    new,
    is_leaf=is_empty,
  )


def _upcast_view(params, masters):
  """The master where there is one, else the upcast param.

  ``None`` params (empty subtrees, such as the function fields of an
  ``eqx.filter``-ed Equinox module) stay ``None``.
  """

  def view(m, p):
    if p is None or isinstance(m, Placeholder):
      return None
    return p.astype(jnp.float32) if m is None else m

  return jax.tree.map(view, masters, params, is_leaf=is_empty)


class Fp32Masters:
  """``True``/``"fp32"``: an fp32 master per half param; param = cast(m)."""

  name = "fp32"

  def init(self, params) -> Buffers:
    """An fp32 copy of each half param."""

    def master(p):
      if p is None:  # An eqx.filter placeholder: no param.
        return Placeholder()
      return p.astype(jnp.float32) if dtypes.is_half(p) else None

    masters = jax.tree.map(master, params, is_leaf=lambda x: x is None)
    return Buffers(master_params=masters)

  def view(self, params, buffers: Buffers):
    """The masters, and the upcast fp32 params."""
    return _upcast_view(params, buffers.master_params)

  def targets(self, params, new_view, buffers: Buffers, applied):
    """The new masters (the old ones on a skipped step) are the targets."""
    masters = _select(applied, new_view, buffers.master_params)
    # From the selected masters: XLA reads them instead of redoing the step.
    return placeholders_to_none(masters), Buffers(master_params=masters)


class RoundToNearest:
  """``False``/``"none"``: no buffer, ``param + u`` rounded (Apex O3)."""

  name = "none"

  def init(self, params) -> Buffers:
    """No buffer."""
    return Buffers(master_params=_no_masters(params))

  def view(self, params, buffers: Buffers):
    """The upcast params."""
    return _upcast_view(params, buffers.master_params)

  def targets(self, params, new_view, buffers: Buffers, applied):
    """No target: every param takes ``param + u``."""
    return _none_like(params), buffers


class Kahan:
  """``"kahan"``: param plus a compensation in its own dtype track fp32."""

  name = "kahan"

  def init(self, params) -> Buffers:
    """A zero compensation per half param, in its dtype."""
    return Buffers(
      master_params=_no_masters(params),
      compensation=jax.tree.map(
        lambda p: jnp.zeros_like(p) if dtypes.is_half(p) else None, params
      ),
    )

  def view(self, params, buffers: Buffers):
    """``param + compensation`` in fp32."""

    def view(c, p):
      if p is None:
        return None
      full = p.astype(jnp.float32)
      return full if c is None else full + c.astype(jnp.float32)

    return jax.tree.map(
      view, buffers.compensation, params, is_leaf=lambda x: x is None
    )

  def targets(self, params, new_view, buffers: Buffers, applied):
    """The nearest half values; the rest is the next compensation."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    hi, lo = [], []
    for p, n in zip(leaves, treedef.flatten_up_to(new_view)):
      h, l = (
        rounding.kahan_split(n, p.dtype) if dtypes.is_half(p) else (None, None)
      )
      hi.append(h)
      lo.append(l)
    unflatten = lambda xs: jax.tree_util.tree_unflatten(treedef, xs)
    compensation = _select(applied, unflatten(lo), buffers.compensation)
    return unflatten(hi), buffers._replace(compensation=compensation)


class Stochastic:
  """``"stochastic"``: no buffer, the new value rounded at random."""

  name = "stochastic"

  def __init__(self, key0):
    self._key0 = key0

  def init(self, params) -> Buffers:
    """The first key, a new buffer per ``init``."""
    return Buffers(
      master_params=_no_masters(params), rounding_key=jnp.asarray(self._key0)
    )

  def view(self, params, buffers: Buffers):
    """The upcast params."""
    return _upcast_view(params, buffers.master_params)

  def targets(self, params, new_view, buffers: Buffers, applied):
    """Stochastically rounded; leaf ``i`` of the flattened params draws from ``fold_in(key, i)``."""
    next_key, key = jax.random.split(buffers.rounding_key)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    out = []
    for i, (p, n) in enumerate(zip(leaves, treedef.flatten_up_to(new_view))):
      if dtypes.is_half(p):
        bits = jax.random.bits(jax.random.fold_in(key, i), p.shape, jnp.uint32)
        out.append(rounding.round_with_bits(n, p.dtype, bits))
      else:
        out.append(None)
    new_key = jnp.where(applied, next_key, buffers.rounding_key)
    return (
      jax.tree_util.tree_unflatten(treedef, out),
      buffers._replace(rounding_key=new_key),
    )


_SIGN = 0x8000  # The sign bit of a bfloat16 (and of an int16).


@eager.jit_when_concrete
def split_master(m: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Splits an fp32 master into ``(param, remainder)``: bfloat16 and int16.

  The param is ``m`` rounded to nearest, ties away from zero; the remainder
  is ``bits(m) - bits(param) << 16``, in ``-0x8000..0x7FFF``. Where the
  param is a zero the remainder holds the master's sign in its sign bit
  instead (its magnitude is below ``0x8000`` there), so that the master
  does not depend on which zero the param lands on. A NaN master keeps its
  sign and upper bits, quieted (a bfloat16 NaN), and loses its low payload.
  `join_master` inverts it bit for bit for every other fp32 value.
  """
  bits = jax.lax.bitcast_convert_type(m.astype(jnp.float32), jnp.uint32)
  # Rounds the magnitude half up: ties away from zero (the sign is bit 31).
  hi = (bits + jnp.uint32(0x8000)) >> 16
  nan = jnp.isnan(m)
  hi = jnp.where(nan, (bits >> 16) | jnp.uint32(0x0040), hi)
  low = jax.lax.bitcast_convert_type(bits - (hi << 16), jnp.int32)
  low = jnp.where(nan, 0, low)
  zero = (hi & jnp.uint32(0x7FFF)) == 0
  low = jnp.where(zero & (hi >= _SIGN), low - _SIGN, low)
  param = jax.lax.bitcast_convert_type(hi.astype(jnp.uint16), jnp.bfloat16)
  return param, low.astype(jnp.int16)


@eager.jit_when_concrete
def join_master(param: jax.Array, remainder: jax.Array) -> jax.Array:
  """The fp32 master of a bfloat16 ``param`` and its int16 ``remainder``."""
  hi = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(jnp.uint32)
  low = remainder.astype(jnp.int32)
  bits = (hi << 16) + jax.lax.bitcast_convert_type(low, jnp.uint32)
  # A zero param: the sign and the magnitude are the remainder's.
  low16 = jax.lax.bitcast_convert_type(remainder, jnp.uint16)
  zero_bits = jnp.where(
    low < 0,
    jnp.uint32(0x80000000) | (low16 & 0x7FFF).astype(jnp.uint32),
    low16.astype(jnp.uint32),
  )
  bits = jnp.where((hi & jnp.uint32(0x7FFF)) == 0, zero_bits, bits)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


@eager.jit_when_concrete
def init_remainder(param: jax.Array) -> jax.Array:
  """The remainder of a master that is ``param`` itself.

  All zeros, but a -0.0 param's master is -0.0 (the sign goes to the
  remainder).
  """
  return split_master(param.astype(jnp.float32))[1]


class Remainder:
  """``"remainder"``: the fp32 master as the bfloat16 param and 16 bits."""

  name = "remainder"

  def init(self, params) -> Buffers:
    """A zero remainder per bfloat16 param; float16 params are rejected."""
    for path, p in jax.tree_util.tree_leaves_with_path(params):
      if jnp.dtype(p.dtype) == jnp.float16:
        raise ValueError(
          'master_weights="remainder" keeps a bfloat16 param\'s fp32 master '
          "as the param's 16 bits and 16 more; float16 is no half of "
          f"float32, and {jax.tree_util.keystr(path)} is float16. Use "
          'master_weights="kahan" or "stochastic" (2 or 0 bytes a param) '
          'or "fp32", or bfloat16 params'
        )

    def remainder(p):
      return init_remainder(p) if dtypes.is_half(p) else None

    return Buffers(
      master_params=_no_masters(params),
      remainder=jax.tree.map(remainder, params),
    )

  def view(self, params, buffers: Buffers):
    """The masters: each bfloat16 param joined with its remainder."""

    def view(r, p):
      if p is None:
        return None
      return p.astype(jnp.float32) if r is None else join_master(p, r)

    return jax.tree.map(
      view, buffers.remainder, params, is_leaf=lambda x: x is None
    )

  def targets(self, params, new_view, buffers: Buffers, applied):
    """The new masters' upper halves; their low halves are kept."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    hi, lo = [], []
    for p, n in zip(leaves, treedef.flatten_up_to(new_view)):
      h, l = split_master(n) if dtypes.is_half(p) else (None, None)
      hi.append(h)
      lo.append(l)
    unflatten = lambda xs: jax.tree_util.tree_unflatten(treedef, xs)
    remainder = _select(applied, unflatten(lo), buffers.remainder)
    return unflatten(hi), buffers._replace(remainder=remainder)


def full_view(params, buffers: Buffers):
  """Each param's fp32 value: its master, ``param + c``, joined, or upcast.

  Per leaf, from whichever buffer it has; the view of every mode.
  """
  is_none = lambda x: x is None
  leaves, treedef = jax.tree_util.tree_flatten(params, is_leaf=is_none)
  flat = lambda t, is_leaf=is_none: (
    [None] * len(leaves)
    if t is None
    else jax.tree_util.tree_leaves(t, is_leaf=is_leaf)
  )
  out = []
  for p, m, c, r in zip(
    leaves,
    flat(buffers.master_params, is_empty),
    flat(buffers.compensation),
    flat(buffers.remainder),
  ):
    if p is None or isinstance(m, Placeholder):
      out.append(None)
    elif m is not None:
      out.append(m)
    elif c is not None:
      out.append(p.astype(jnp.float32) + c.astype(jnp.float32))
    elif r is not None:
      out.append(join_master(p, r))
    else:
      out.append(p.astype(jnp.float32))
  return jax.tree_util.tree_unflatten(treedef, out)
