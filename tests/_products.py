"""The dtypes of every matrix product and convolution in a jaxpr."""

from typing import Any

import jax
import numpy as np

PRODUCTS = ("dot_general", "conv_general_dilated", "ragged_dot")


def _sub_jaxprs(value: Any):
  if hasattr(value, "eqns"):  # Jaxpr
    yield value
  elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):  # Closed
    yield value.jaxpr
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _sub_jaxprs(v)


def product_dtypes(jaxpr: Any) -> list[tuple[str, tuple[str, ...], str]]:
  """``(primitive, operand dtypes, output dtype)`` of each product eqn.

  Walks ``jaxpr`` (a `jax.make_jaxpr` result) and every jaxpr nested in an
  eqn's params (jit, scan, cond branches, custom rules, remat...).
  """
  found = []
  stack = list(_sub_jaxprs(jaxpr))
  while stack:
    j = stack.pop()
    for eqn in j.eqns:
      if eqn.primitive.name in PRODUCTS:
        found.append(
          (
            eqn.primitive.name,
            tuple(np.dtype(v.aval.dtype).name for v in eqn.invars),
            np.dtype(eqn.outvars[0].aval.dtype).name,
          )
        )
      for value in eqn.params.values():
        stack.extend(_sub_jaxprs(value))
  return found


def products_of(fun, *args):
  """`product_dtypes` of ``jax.make_jaxpr(fun)(*args)``."""
  return product_dtypes(jax.make_jaxpr(fun)(*args))


def primitive_names(jaxpr: Any) -> set[str]:
  """The names of every primitive in ``jaxpr`` and its nested jaxprs."""
  names = set()
  stack = list(_sub_jaxprs(jaxpr))
  while stack:
    j = stack.pop()
    for eqn in j.eqns:
      names.add(eqn.primitive.name)
      for value in eqn.params.values():
        stack.extend(_sub_jaxprs(value))
  return names
