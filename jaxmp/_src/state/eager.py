"""Per-leaf functions called outside ``jit``: one compiled program a call.

Outside ``jit`` JAX runs each op as its own compiled program, compiled once
per op, shape, dtype and sharding. A state's per-leaf functions are dozens
of ops (a leaf's int8 encoding, a bfloat16 param's remainder split and
join), so an eager ``opt.init(params)`` of int8 moments with
``"remainder"`` masters would compile a program for each of them, and
whoever builds the state eagerly (``state = opt.init(params)``, the flax and
optax way) would pay seconds for it once per process.
`jit_when_concrete` runs such a function as one ``jax.jit`` call where its
arguments are concrete: one compile per kind of leaf (shape, dtype,
sharding and the static config), shared by every leaf of that kind; a call
per leaf, not one for the whole state, since leaves may live on different
devices. Under a trace it calls the function itself, so a traced program
(``jax.jit(opt.init)``, every step) is what it was, with no nested call in
it.

The ops are the same, so are the bits: the split and the join are integer
bit operations, and the codec's floating-point arithmetic (a power-of-two
scale, one division, float8 and bfloat16 conversions) is exact or correctly
rounded, fused or not (``tests/test_state_codec.py`` keeps an eager init
equal to the compiled one). Where a jitted call's outputs land is
the compiler's choice; `sharding.place_like_params` then puts each leaf of
an eager init where it puts it op by op (the same shardings, checked too).
"""

import functools
from typing import Callable, Optional

import jax


def _traced(args, kwargs) -> bool:
  leaves = jax.tree_util.tree_leaves((args, kwargs))
  return any(isinstance(x, jax.core.Tracer) for x in leaves)


def jit_when_concrete(
  fn: Optional[Callable] = None, *, static_argnums: tuple[int, ...] = ()
) -> Callable:
  """``fn`` as one jitted call outside a trace; ``fn`` itself under one.

  Args:
    fn: a function of arrays (pytrees of arrays) and hashable config.
    static_argnums: the positions of the config arguments (``jax.jit``'s).

  Returns:
    ``fn``, jitted where no array argument is a tracer.

  >>> import jax, jax.numpy as jnp
  >>> double = jit_when_concrete(lambda x: 2 * x)
  >>> double(jnp.ones(2))  # One compiled program.
  Array([2., 2.], dtype=float32)
  >>> jax.make_jaxpr(double)(1.0)  # Traced: fn's ops, no nested jit.
  { lambda ; a:f32[]. let b:f32[] = mul 2.0:f32[] a in (b,) }
  """
  if fn is None:
    return functools.partial(jit_when_concrete, static_argnums=static_argnums)
  jitted = jax.jit(fn, static_argnums=static_argnums)
  static = set(static_argnums)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    dynamic = [a for i, a in enumerate(args) if i not in static]
    if _traced(dynamic, kwargs):
      return fn(*args, **kwargs)
    return jitted(*args, **kwargs)

  return call
