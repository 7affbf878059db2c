"""`get_mode`: ``master_weights=`` as its mode object, one for all or per leaf.

``"fp32"``, ``"none"``, ``"kahan"``, ``"stochastic"`` and ``"remainder"``
are the modes of `master_weights`, one object each; a function ``(path,
param) -> mode`` or a pytree of modes gives each leaf its own (`PerLeaf`),
and the state records them (`LeafModeNames`, static).
"""

import dataclasses
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import dtypes
from jaxmp._src.state.master_weights import Buffers
from jaxmp._src.state.master_weights import Fp32Masters
from jaxmp._src.state.master_weights import full_view
from jaxmp._src.state.master_weights import init_remainder
from jaxmp._src.state.master_weights import Kahan
from jaxmp._src.state.master_weights import MODES
from jaxmp._src.state.master_weights import Placeholder
from jaxmp._src.state.master_weights import Remainder
from jaxmp._src.state.master_weights import RoundToNearest
from jaxmp._src.state.master_weights import Stochastic


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
      rem.append(init_remainder(p) if half and m == "remainder" else None)
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
