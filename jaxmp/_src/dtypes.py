"""The half-precision dtypes, named once for the whole library."""

from typing import Any

import jax.numpy as jnp

HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def is_half(x: Any) -> bool:
  """Whether ``x`` (an array or a dtype) is float16 or bfloat16.

  >>> import jax.numpy as jnp
  >>> is_half(jnp.ones(2, jnp.bfloat16)), is_half(jnp.float32)
  (True, False)
  """
  return jnp.dtype(getattr(x, "dtype", x)) in HALF
