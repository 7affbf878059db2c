"""A state built for params of one dtype, stepped with params of another.

``init`` keeps a buffer (an fp32 master, a Kahan compensation, a remainder)
for each half-precision param only. ``update`` refuses, at trace time and
naming the leaf's path and both dtypes, every mismatch it would step wrong,
and steps right the ones the buffers do not depend on.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _opt(mode):
  return jaxmp.mixed_precision(
    optax.sgd(1e-1), master_weights=mode, loss_scale=1.0
  )


def _tree(dtype, value=1.0):
  return {"b": jnp.ones(2, F32), "w": jnp.full(3, value, dtype)}


# (mode, dtype the state was built for, dtype stepped, the error's words).
REFUSED = [
  # opt.init before the cast: no master, so the bf16 param would stall.
  (
    "fp32",
    F32,
    BF16,
    r"master_params\['w'\] is None.*params\['w'\] is bfloat16",
  ),
  (
    "kahan",
    F32,
    BF16,
    r"compensation\['w'\] is None.*params\['w'\] is bfloat16",
  ),
  (
    "remainder",
    F32,
    BF16,
    r"remainder\['w'\] is None.*params\['w'\] is bfloat16",
  ),
  # A bf16 state's fp32 master would be taken over the fp32 param itself.
  (
    "fp32",
    BF16,
    F32,
    r"master_params\['w'\] \(float32\) belongs to a half.*params\['w'\] is float32",
  ),
  # A bf16 remainder joined to fp16 bits; to fp32 (a broadcasting error).
  (
    "remainder",
    BF16,
    F16,
    r"remainder\['w'\] \(int16\) belongs to a bfloat16.*params\['w'\] is float16",
  ),
  (
    "remainder",
    BF16,
    F32,
    r"remainder\['w'\] \(int16\) belongs to a bfloat16.*params\['w'\] is float32",
  ),
  (
    "kahan",
    BF16,
    F16,
    r"compensation\['w'\] \(bfloat16\) belongs to a bfloat16.*params\['w'\] is float16",
  ),
  (
    "kahan",
    BF16,
    F32,
    r"compensation\['w'\] \(bfloat16\) belongs to a bfloat16.*params\['w'\] is float32",
  ),
]


# The same, each mode chosen per leaf (the fp32 "b" under another mode);
# and a choice by dtype, whose fp32 "w" no longer names the remainder it has.
REFUSED += [({"b": "kahan", "w": m}, b, s, w) for m, b, s, w in REFUSED]
REFUSED.append(
  (
    lambda path, p: "remainder" if p.dtype == BF16 else "fp32",
    BF16,
    F32,
    r"remainder\['w'\] \(int16\) belongs to a bfloat16.*params\['w'\] is float32",
  )
)


def _id(mode, built, stepped, *_):
  if callable(mode):
    name = "per-leaf-by-dtype"
  else:
    name = mode if isinstance(mode, str) else f"per-leaf-{mode['w']}"
  return f"{name}-{jnp.dtype(built).name}-{jnp.dtype(stepped).name}"


@pytest.mark.parametrize(
  "mode, built, stepped, words", REFUSED, ids=[_id(*r) for r in REFUSED]
)
def test_update_refuses_a_state_built_for_another_dtype(
  mode, built, stepped, words
):
  opt = _opt(mode)
  # Shapes alone: refused at trace time, nothing computed.
  state = jax.eval_shape(lambda: opt.init(_tree(built)))
  params = jax.eval_shape(lambda: _tree(stepped, 2.0))
  with pytest.raises(ValueError, match="built for params of another dtype"):
    jax.eval_shape(opt.update, params, state, params)
  with pytest.raises(ValueError, match=words):
    jax.eval_shape(opt.update, params, state, params)


HANDLED = [("fp32", BF16, F16), ("stochastic", F32, BF16), ("none", F32, BF16)]


def test_per_leaf_modes_take_the_mismatches_their_modes_take():
  for mode, built, stepped in HANDLED:
    opt = _opt({"b": "kahan", "w": mode})
    params = jax.eval_shape(lambda: _tree(stepped, 2.0))
    state = jax.eval_shape(lambda: opt.init(_tree(built)))
    jax.eval_shape(opt.update, params, state, params)


@pytest.mark.invariant
@pytest.mark.parametrize("mode, built, stepped", HANDLED)
def test_update_steps_the_mismatches_it_handles(mode, built, stepped):
  """No buffer depends on the dtype: the step is a fresh state's."""
  opt = _opt(mode)
  params = _tree(stepped, 2.0)
  grads = jax.tree.map(jnp.ones_like, params)
  state = opt.init(_tree(built, 2.0))
  fresh = opt.init(params)
  step = jax.jit(opt.update)
  for a, b in zip(
    jax.tree.leaves(step(grads, state, params)),
    jax.tree.leaves(step(grads, fresh, params)),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
