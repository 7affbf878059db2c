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

import dataclasses
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import dtypes
from jaxmp._src.transform import eager
from jaxmp._src.transform import rounding

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
def _init_remainder(param: jax.Array) -> jax.Array:
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
      return _init_remainder(p) if dtypes.is_half(p) else None

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


@dataclasses.dataclass(frozen=True)
class LeafModeNames:
  """Static: each param leaf's ``(path, mode, bytes an fp32 master takes)``.

  The bytes are 0 for an fp32 param (its own master).
  """

  names: tuple[tuple[str, str, int], ...]

  def saved(self) -> int:
    """The bytes saved against fp32 masters for every half param."""
    cost = {"fp32": 4, "kahan": 2, "remainder": 2}
    return sum(n - n // 4 * cost.get(m, 0) for _, m, n in self.names)


jax.tree_util.register_static(LeafModeNames)


def _mode_name(m, where: str) -> str:
  if isinstance(m, (bool, np.bool_)):
    m = "fp32" if m else "none"
  if not (isinstance(m, str) and m in MODES):
    per_leaf = "" if where else (
      "; or per leaf, a function (path, param) -> mode or a pytree of modes"
    )  # fmt: skip
    raise ValueError(
      "master_weights must be True/'fp32', False/'none', 'kahan', "
      f"'stochastic' or 'remainder'{where}, got {m!r}{per_leaf}"
    )
  return m


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


class PerLeaf:
  """A mode per param: a function ``(path, param) -> mode`` or a pytree.

  Each leaf keeps its own mode's buffer and lands on its own mode's target:
  bit for bit as under that mode alone (the stochastic leaves draw from the
  same ``fold_in(key, i)`` streams).
  """

  name = "per-leaf"

  def __init__(self, spec, key0):
    self._spec = spec
    self._key0 = key0

  def resolve(self, params) -> list[str]:
    """The mode of each param leaf, in leaf order."""
    pairs = jax.tree_util.tree_flatten_with_path(params)[0]
    if callable(self._spec):
      modes = [self._spec(path, p) for path, p in pairs]
    else:
      treedef = jax.tree_util.tree_structure(params)
      wide = jax.tree.map(
        lambda m, sub: jax.tree.map(lambda _: m, sub), self._spec, params
      )
      modes = treedef.flatten_up_to(wide)
    return [
      _mode_name(m, f" for {jax.tree_util.keystr(path)}")
      for m, (path, _) in zip(modes, pairs)
    ]

  def names(self, params) -> LeafModeNames:
    """The static record of each leaf's mode."""
    pairs = jax.tree_util.tree_flatten_with_path(params)[0]
    return LeafModeNames(
      tuple(
        (jax.tree_util.keystr(k), m, 4 * p.size if dtypes.is_half(p) else 0)
        for (k, p), m in zip(pairs, self.resolve(params))
      )
    )

  def init(self, params) -> Buffers:
    """Each half leaf's buffer of its mode."""
    modes = self.resolve(params)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    masters, comp, rem = [], [], []
    for (path, p), m in zip(
      jax.tree_util.tree_flatten_with_path(params)[0], modes
    ):
      half = dtypes.is_half(p)
      if half and m == "remainder":
        Remainder().init({jax.tree_util.keystr(path): p})  # fp16: an error.
      masters.append(p.astype(jnp.float32) if half and m == "fp32" else None)
      comp.append(jnp.zeros_like(p) if half and m == "kahan" else None)
      rem.append(_init_remainder(p) if half and m == "remainder" else None)
    it = iter(masters)
    masters = jax.tree.map(
      lambda p: Placeholder() if p is None else next(it),
      params,
      is_leaf=lambda x: x is None,
    )
    unflatten = lambda xs: jax.tree_util.tree_unflatten(treedef, xs)
    stochastic = any(
      m == "stochastic" and dtypes.is_half(p) for p, m in zip(leaves, modes)
    )
    return Buffers(
      master_params=masters,
      compensation=unflatten(comp) if "kahan" in modes else None,
      rounding_key=jnp.asarray(self._key0) if stochastic else None,
      remainder=unflatten(rem) if "remainder" in modes else None,
    )

  def view(self, params, buffers: Buffers):
    """Each leaf's view of its mode."""
    return full_view(params, buffers)

  def targets(self, params, new_view, buffers: Buffers, applied):
    """Each leaf's target of its mode; each mode's next buffers."""
    modes = self.resolve(params)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    t, b = {}, {}
    t["fp32"], masters = Fp32Masters().targets(
      params, new_view, Buffers(master_params=buffers.master_params), applied
    )
    if buffers.compensation is not None:
      t["kahan"], b["kahan"] = Kahan().targets(
        params, new_view, Buffers(compensation=buffers.compensation), applied
      )
    if buffers.remainder is not None:
      t["remainder"], b["remainder"] = Remainder().targets(
        params, new_view, Buffers(remainder=buffers.remainder), applied
      )
    if buffers.rounding_key is not None:
      t["stochastic"], b["stochastic"] = Stochastic(None).targets(
        params, new_view, Buffers(rounding_key=buffers.rounding_key), applied
      )
    flat = {k: treedef.flatten_up_to(v) for k, v in t.items()}
    out = [
      flat[m][i] if dtypes.is_half(p) and m in flat else None
      for i, (p, m) in enumerate(zip(leaves, modes))
    ]
    get = lambda k, field: getattr(b[k], field) if k in b else None
    return jax.tree_util.tree_unflatten(treedef, out), Buffers(
      master_params=masters.master_params,
      compensation=get("kahan", "compensation"),
      rounding_key=get("stochastic", "rounding_key"),
      remainder=get("remainder", "remainder"),
    )


Mode = Union[Fp32Masters, RoundToNearest, Kahan, Stochastic, Remainder, PerLeaf]

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


def get_mode(master_weights, rounding_key=0) -> Mode:
  """The mode object of ``mixed_precision``'s ``master_weights``.

  A function ``(path, param) -> mode`` or a pytree of modes (a prefix of
  the params' tree) chooses a mode per leaf (`PerLeaf`).
  """
  if callable(master_weights) or jax.tree_util.tree_leaves(master_weights) != [
    master_weights
  ]:  # A function, or a pytree (not one leaf, not None).
    if master_weights is not None:
      return PerLeaf(master_weights, _host_key(rounding_key))
  master_weights = _mode_name(master_weights, "")
  if master_weights == "fp32":
    return Fp32Masters()
  if master_weights == "none":
    return RoundToNearest()
  if master_weights == "kahan":
    return Kahan()
  if master_weights == "remainder":
    return Remainder()
  return Stochastic(_host_key(rounding_key))


def _host_key(key) -> Any:
  """The raw key, on the host where it is concrete.

  Each ``init`` then makes its own buffer: a donated state must not delete
  the key of another one.
  """
  key = _raw_key(key)
  try:
    return np.asarray(key)
  except jax.errors.TracerArrayConversionError:  # A traced key stays as is.
    return key


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
