"""Low-precision optimizer state: bf16 or 8-bit moments, decoded in the step.

`mixed_precision(..., optimizer_state=...)` stores the param-shaped float
leaves of its inner optimizer's state encoded. Each step decodes them to
fp32, runs the inner optimizer in fp32, and encodes the new state again, all
in the same compiled step: no fp32 copy of the state lives between steps.

Which leaves: the subtrees of the inner state with the params' tree
structure (Adam's ``mu`` and ``nu``, a momentum ``trace``, Lion's ``mu``...),
leaf by leaf where the leaf has its param's shape, a float dtype and at
least ``min_size`` elements. Everything else (counts, Adafactor's factored
row and column statistics, biases and norms under ``min_size``) is kept as
it is; `state_summary` lists what was kept and why.

The 8-bit code (``"int8"``) is block-wise, as bitsandbytes' 8-bit optimizers
are, over a non-linear map: each block of ``block_size`` elements along a
leaf's last axis has its own fp32 scale, its largest finite magnitude
``absmax``, and each element is stored as the 8 bits of the nearest
``float8_e4m3fn`` value of ``256 * x / absmax`` (a sign, 4 exponent bits, 3
mantissa bits; 256 rather than float8's largest, 448, so that decoding,
``code * absmax * 2**-8``, is exact). So every element down to
``2**-14 * absmax`` (6e-5) keeps a relative error of at most 2**-4; below
that the codes are float8 subnormals, spaced ``2**-17 * absmax``. The map has the same
shape for both signs, so one code serves first moments (signed) and second
moments (non-negative) alike, with no per-leaf guess of which is which.

Second moments: a positive ``nu`` that decodes to 0 turns Adam's update
into ``mu / eps``, and training diverges. The non-linear map keeps 5
decades of a block's range above its floor, and any nonzero element that
would still round to 0 is stored as the smallest code of its sign
(``2**-17 * absmax``) instead: a too-small ``nu`` comes back
larger, which only shrinks its step. Non-finite elements decode to NaN and
do not spoil the scale of their block's finite elements.

``"bf16"`` stores each leaf as its round-to-nearest bfloat16 (2 bytes).

Rounding to nearest loses a change smaller than half a code's step: Lion's
momentum (``b2 = 0.99``) and Adam's ``nu`` (``b2 = 0.999``) move by 1% and
0.1% a step, below an 8-bit code's 2**-4. Stochastic rounding (the
default of ``"int8"``) rounds up or down in proportion instead, so such changes survive in expectation;
its random bits hash each element's fp32 bits and position (no key in the
state, and a resumed run rounds as the uninterrupted one).

Blocks run along the last axis only (padded to a multiple of the block, or
one block per row when the last axis is shorter than ``block_size``): a
block never spans two shards of a param sharded along any other axis. When
the last axis itself is sharded, each shard's length should be a multiple of
``block_size``: then the codes and the scales are sharded there too, and a
step moves no data; otherwise the scales are replicated along that axis and
the compiler gathers what a block needs (auto axes), or encoding raises
(explicit axes). The codes of an unpadded leaf have the param's shape
(int8) and are placed like it (see `sharding.encoded_specs`).
"""

import dataclasses
import math
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.state import eager
from jaxmp._src.state import rounding

KINDS = ("fp32", "bf16", "int8")
_F8 = jnp.float8_e4m3fn
_F8_TOP = 256.0  # A block's largest magnitude is coded as this.


@dataclasses.dataclass(frozen=True)
class StateQuantization:
  """How `mixed_precision` stores its inner optimizer's state.

  Accepted by ``jaxmp.mixed_precision(..., optimizer_state=...)`` wherever
  a kind's name (``"fp32"``, ``"bf16"``, ``"int8"``) is.

  Attributes:
    kind: ``"fp32"`` (as the inner optimizer keeps it), ``"bf16"`` (round to
      nearest bfloat16) or ``"int8"`` (8-bit codes with a scale per block).
    block_size: elements per block of ``"int8"``, along the last axis.
    min_size: leaves with fewer elements stay as they are (norms, biases).
    rounding: ``"nearest"``, ``"stochastic"``, or ``None`` (the default):
      stochastic for ``"int8"``, nearest for ``"bf16"``. Stochastic rounds
      up or down at random in proportion, so that a small change of a moment (``nu``'s
      ``(1 - b2) * g**2``, Lion's momentum) survives in expectation instead
      of being rounded away step after step. The random bits are a hash of
      each element's fp32 bits and position: no key, the same on a resume.

  >>> import jaxmp
  >>> jaxmp.StateQuantization("int8", block_size=128).min_size
  4096
  """

  kind: str = "int8"
  block_size: int = 256
  min_size: int = 4096
  rounding: Optional[str] = None

  def __post_init__(self):
    """Checks the fields."""
    if self.rounding not in (None, "nearest", "stochastic"):
      raise ValueError(
        "StateQuantization.rounding must be 'nearest', 'stochastic' or None, "
        f"got {self.rounding!r}"
      )
    if self.kind not in KINDS:
      raise ValueError(
        f"optimizer_state kind must be one of {KINDS}, got {self.kind!r}"
      )
    for name in ("block_size", "min_size"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
          f"StateQuantization.{name} must be a positive int, got {value!r}"
        )


jax.tree_util.register_static(StateQuantization)


def get_codec(
  optimizer_state: Union[str, StateQuantization, None],
) -> Optional[StateQuantization]:
  """The `StateQuantization` of ``optimizer_state``; ``None`` for fp32."""
  if optimizer_state is None:
    return None
  if isinstance(optimizer_state, str):
    if optimizer_state not in KINDS:
      raise ValueError(
        "optimizer_state must be 'fp32', 'bf16', 'int8' or a "
        f"jaxmp.StateQuantization, got {optimizer_state!r}"
      )
    optimizer_state = StateQuantization(optimizer_state)
  if not isinstance(optimizer_state, StateQuantization):
    raise ValueError(
      "optimizer_state must be 'fp32', 'bf16', 'int8' or a "
      f"jaxmp.StateQuantization, got {optimizer_state!r}"
    )
  return None if optimizer_state.kind == "fp32" else optimizer_state


class Spec(NamedTuple):
  """The static part of an encoded leaf: what it decodes to."""

  kind: str
  shape: tuple[int, ...]
  dtype: Any
  block: int  # Elements per block along the last axis (int8).
  stochastic: bool = False


class EncodedLeaf:
  """One leaf of an optimizer state, stored encoded; a pytree node.

  Attributes:
    data: the codes: bfloat16 (``"bf16"``) or int8 (``"int8"``, the bits
      of float8_e4m3fn values; the leaf's shape, its last axis padded to a
      multiple of the block).
    scale: fp32, one per block (``"int8"``): its largest finite magnitude;
      ``None`` for ``"bf16"``.
    spec: the static `Spec`.
  """

  def __init__(self, data, scale, spec: Spec):
    self.data = data
    self.scale = scale
    self.spec = spec

  def __repr__(self) -> str:
    """The kind and the decoded shape."""
    return f"EncodedLeaf({self.spec.kind}, shape={self.spec.shape})"


jax.tree_util.register_pytree_with_keys(
  EncodedLeaf,
  lambda e: (
    (
      (jax.tree_util.GetAttrKey("data"), e.data),
      (jax.tree_util.GetAttrKey("scale"), e.scale),
    ),
    e.spec,
  ),
  lambda spec, children: EncodedLeaf(children[0], children[1], spec),
)


def _is_encoded(x) -> bool:
  return isinstance(x, EncodedLeaf)


def named_axes(x: Any) -> Optional[list]:
  """For an encoded leaf, the axes of its codes and scales named as its param's.

  The leading axes of both are the param's; the codes' last axis is the
  param's where it is not padded; the scales' last axis (blocks) is not.
  (NNX: the variables of an encoded leaf keep their param's sharding names
  on these axes only, so that every name fits its axis.) ``None`` for any
  other value.
  """
  if not _is_encoded(x):
    return None
  ndim = len(x.spec.shape)
  lead = (True,) * max(ndim - 1, 0)
  data_last = tuple(x.data.shape) == tuple(x.spec.shape)
  out = [lead + ((data_last,) if ndim else ())]
  if x.scale is not None:
    out.append(lead + ((False,) if ndim else ()))
  return out


def _blocks(shape: tuple[int, ...], block_size: int) -> tuple[int, int, int]:
  """``(last, block, padded last)`` of a leaf's shape."""
  last = shape[-1] if shape else 1
  block = min(block_size, last)
  return last, block, -(-last // block) * block


def _hash_bits(v: jax.Array) -> jax.Array:
  """32 well-mixed bits per element from its fp32 bits and its position."""
  bits = jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint32)
  index = jnp.arange(v.size, dtype=jnp.uint32).reshape(v.shape)
  h = bits ^ (index * jnp.uint32(0x9E3779B9))
  # MurmurHash3's finaliser: every input bit flips each output bit ~1/2.
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _round_f8_stochastic(y: jax.Array, bits: jax.Array) -> jax.Array:
  """``y`` (fp32, ``|y| <= 256``) to a float8_e4m3fn neighbour at random."""
  a = jnp.abs(y)
  # The float8 grid step at a: 3 mantissa bits below a's binade, and
  # 2**-9 (the subnormals' step) from 2**-6 down; built from a's exponent
  # bits, as are its reciprocal (both powers of two, so exact).
  e = jax.lax.bitcast_convert_type(a, jnp.uint32) >> 23
  e = jnp.maximum(e, jnp.uint32(127 - 6)) - 3
  ulp = jax.lax.bitcast_convert_type(e << 23, jnp.float32)
  inv = jax.lax.bitcast_convert_type((254 - e) << 23, jnp.float32)
  u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
  r = jnp.floor(a * inv + u) * ulp
  return jnp.where(y < 0, -r, r).astype(_F8)


def encode_int8(
  x: jax.Array, block_size: int, stochastic: bool = False
) -> EncodedLeaf:
  """The 8-bit block-wise code of ``x`` (see the module docstring)."""
  shape = tuple(x.shape)
  last, block, padded = _blocks(shape, block_size)
  _check_explicit_blocks(x, block, padded)
  lead = shape[:-1]
  v = x.astype(jnp.float32).reshape(lead + (last,))
  if padded != last:
    v = jnp.pad(v, [(0, 0)] * len(lead) + [(0, padded - last)])
  v = v.reshape(lead + (padded // block, block))
  finite = jnp.isfinite(v)
  absmax = jnp.max(jnp.where(finite, jnp.abs(v), 0.0), axis=-1)
  inv = jnp.where(absmax > 0, _F8_TOP / absmax, 0.0)
  inv = jnp.where(jnp.isfinite(inv), inv, 0.0)
  y = jnp.clip(v * inv[..., None], -_F8_TOP, _F8_TOP)
  if stochastic:
    code = _round_f8_stochastic(y, _hash_bits(v))
  else:
    code = y.astype(_F8)
  # The selects run on the int8 bits (XLA:CPU emulates float8 arithmetic).
  code = jax.lax.bitcast_convert_type(code, jnp.int8)
  # A nonzero element never decodes to zero: the smallest code of its sign
  # (0x01, 0x81: 2**-9 and -2**-9).
  floor = jnp.where(v < 0, jnp.int8(-127), jnp.int8(1))
  code = jnp.where(((code & 0x7F) == 0) & (v != 0), floor, code)
  code = jnp.where(finite, code, jnp.int8(0x7F))  # NaN.
  data = code.reshape(lead + (padded,))
  spec = Spec("int8", shape, x.dtype, block, stochastic)
  return EncodedLeaf(data, absmax, spec)


def _check_explicit_blocks(
  x, block: int, padded: int, name: str = "a leaf"
) -> None:
  """Explicit-axes mode: a sharded last axis must hold whole blocks a shard.

  (In auto mode the compiler gathers what a block needs; under explicit
  axes the blocks' reshape is a type error, made clear here.)
  """
  if not isinstance(x, (jax.Array, jax.core.Tracer)) or not x.ndim:
    return
  sharding = jax.typeof(x).sharding
  mesh = getattr(sharding, "mesh", None)
  types = getattr(mesh, "axis_types", ()) or ()
  if not any(t == jax.sharding.AxisType.Explicit for t in types):
    return
  entry = (tuple(sharding.spec) + (None,) * x.ndim)[x.ndim - 1]
  if entry is None:
    return
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  shards = int(
    np.prod(
      [sizes[n] for n in (entry if isinstance(entry, tuple) else (entry,))]
    )
  )
  last = x.shape[-1]
  if padded == last and last % shards == 0 and (last // shards) % block == 0:
    return
  raise ValueError(
    f'optimizer_state="int8" under explicit mesh axes: {name} of shape '
    f"{tuple(x.shape)} has its last axis sharded over {entry!r} in "
    f"{shards} shards of {last / shards:g} elements, which is not a whole "
    f"number of blocks of {block}, so a block would span two shards. Pick "
    "a StateQuantization(block_size=...) that divides the shard length, "
    "shard another axis, or use auto axes (where the compiler gathers what "
    "a block needs)"
  )


@eager.jit_when_concrete
def decode(e: EncodedLeaf) -> jax.Array:
  """The value of an encoded leaf, in its original dtype."""
  spec = e.spec
  if spec.kind == "bf16":
    return e.data.astype(spec.dtype)
  last, block, padded = _blocks(spec.shape, spec.block)
  lead = spec.shape[:-1]
  code = jax.lax.bitcast_convert_type(e.data, _F8).astype(jnp.float32)
  scale = e.scale[..., None] * (1.0 / _F8_TOP)  # Exact: a power of two.
  v = code.reshape(lead + (padded // block, block)) * scale
  v = v.reshape(lead + (padded,))[..., :last]
  return v.reshape(spec.shape).astype(spec.dtype)


@eager.jit_when_concrete(static_argnums=(1,))
def encode(x: jax.Array, codec: StateQuantization) -> EncodedLeaf:
  """``x`` encoded as ``codec`` says."""
  stochastic = codec.rounding == "stochastic" or (
    codec.rounding is None and codec.kind == "int8"
  )
  if codec.kind == "bf16":
    spec = Spec("bf16", tuple(x.shape), x.dtype, 1, stochastic)
    return encode_with(x, spec)
  return encode_int8(x, codec.block_size, stochastic)


def _encodable(x, param, codec: StateQuantization) -> bool:
  return (
    hasattr(x, "shape")
    and hasattr(param, "shape")
    and tuple(x.shape) == tuple(param.shape)
    and jnp.issubdtype(x.dtype, jnp.floating)
    and int(np.prod(x.shape)) >= codec.min_size
  )


def _not_constant(x):
  """``x``, which XLA may not treat as a constant (under a trace).

  Optax builds its moments with ``jnp.zeros_like``: under ``jax.jit`` a
  constant, whose whole encoding (each block's absmax, the rounding hash,
  the codes) XLA would fold while compiling ``init``, seconds for a large
  kernel. Behind `jax.lax.optimization_barrier` the same ops run in the
  compiled ``init``, with the same bits (a leaf's fp32 zeros live while it
  runs, as its decoded moments do in every step). Placement is still
  `sharding`'s tie of the encoded leaf: propagation carries the param's
  sharding back through the encoding and this barrier, so each device
  encodes its own shard.
  """
  if isinstance(x, jax.core.Tracer):
    return jax.lax.optimization_barrier(x)
  return x


def _check_int8(x, block_size: int, kind: str, path) -> None:
  """`_check_explicit_blocks` of a leaf about to be encoded, named by path."""
  if kind != "int8" or not hasattr(x, "shape"):
    return
  _, block, padded = _blocks(tuple(x.shape), block_size)
  name = "state.inner_state" + jax.tree_util.keystr(tuple(path))
  _check_explicit_blocks(x, block, padded, name)


def encode_state(
  inner_state: Any, params: Any, codec: Optional[StateQuantization]
):
  """The inner state with its param-shaped float leaves encoded.

  A subtree is param-shaped when its tree structure is the params'; within
  it, a leaf is encoded when it has its param's shape, a float dtype and at
  least ``codec.min_size`` elements.
  """
  if codec is None:
    return inner_state
  treedef = jax.tree.structure(params)
  param_leaves = jax.tree.leaves(params)
  param_paths = [
    path for path, _ in jax.tree_util.tree_leaves_with_path(params)
  ]

  def is_params_like(x):
    if _is_encoded(x):
      return False
    try:
      return jax.tree.structure(x) == treedef
    except Exception:  # pylint: disable=broad-except
      return False

  def encode_subtree(path, x):
    if not is_params_like(x):
      return x
    leaves = treedef.flatten_up_to(x)
    out = []
    for leaf, p, p_path in zip(leaves, param_leaves, param_paths):
      if _encodable(leaf, p, codec):
        _check_int8(leaf, codec.block_size, codec.kind, path + p_path)
        leaf = encode(_not_constant(leaf), codec)
      out.append(leaf)
    return jax.tree.unflatten(treedef, out)

  return jax.tree_util.tree_map_with_path(
    encode_subtree, inner_state, is_leaf=is_params_like
  )


def decode_state(state: Any) -> Any:
  """Every encoded leaf of ``state`` decoded."""
  return jax.tree.map(
    lambda x: decode(x) if _is_encoded(x) else x, state, is_leaf=_is_encoded
  )


def encode_like(new_state: Any, encoded: Any) -> Any:
  """``new_state`` encoded where ``encoded`` (its old value) was."""

  def encode_one(path, old, new):
    if not _is_encoded(old):
      return new
    _check_int8(new, old.spec.block, old.spec.kind, path)
    return encode_with(new, old.spec)

  return jax.tree_util.tree_map_with_path(
    encode_one, encoded, new_state, is_leaf=_is_encoded
  )


@eager.jit_when_concrete(static_argnums=(1,))
def encode_with(x: jax.Array, spec: Spec) -> EncodedLeaf:
  """``x`` encoded with an existing leaf's `Spec`."""
  if spec.kind == "bf16":
    x = x.astype(jnp.float32)
    if spec.stochastic:
      data = rounding.round_with_bits(x, jnp.bfloat16, _hash_bits(x))
    else:
      data = x.astype(jnp.bfloat16)
    return EncodedLeaf(data, None, spec)
  return encode_int8(x.astype(spec.dtype), spec.block, spec.stochastic)


def _nbytes(x) -> int:
  """The bytes of an array or of a `jax.ShapeDtypeStruct` (no ``nbytes``)."""
  return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def summary_rows(state: Any, codec: Optional[StateQuantization]) -> list:
  """One row per leaf of ``state``: path, shape, how it is stored, bytes.

  ``state`` may be abstract (`jax.eval_shape` of an ``init``): the rows are
  those of the state it describes.
  """
  rows = []
  for path, x in jax.tree_util.tree_leaves_with_path(
    state, is_leaf=_is_encoded
  ):
    path = jax.tree_util.keystr(path)
    if _is_encoded(x):
      nbytes = _nbytes(x.data) + (0 if x.scale is None else _nbytes(x.scale))
      rows.append(
        StateRow(path, x.spec.shape, x.spec.kind, int(nbytes), "encoded")
      )
      continue
    shape = tuple(getattr(x, "shape", ()))
    dtype = jnp.dtype(getattr(x, "dtype", np.asarray(x).dtype))
    size = math.prod(shape)
    note = ""
    inner = path.startswith(".inner_state")
    if inner and codec and jnp.issubdtype(dtype, jnp.floating) and shape:
      note = (
        f"kept: under min_size ({size} < {codec.min_size})"
        if size < codec.min_size
        else "kept: not a param-shaped leaf"
      )
    rows.append(StateRow(path, shape, dtype.name, size * dtype.itemsize, note))
  return rows


class StateRow(NamedTuple):
  """A row of `jaxmp.state_summary`.

  Attributes:
    path: the leaf's path in the state (``jax.tree_util.keystr``).
    shape: the shape it decodes to.
    stored: ``"int8"``, ``"bf16"`` or the dtype name of a plain leaf.
    nbytes: the bytes it takes (codes and scales).
    note: ``"encoded"``, why a float leaf was kept as it is, or ``""``.
  """

  path: str
  shape: tuple
  stored: str
  nbytes: int
  note: str
