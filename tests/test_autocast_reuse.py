"""`jaxmp.autocast` rewrites each distinct jitted body once per trace."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxmp


@jax.jit
def layer(w, x):
  return jnp.tanh(x @ w)


def _jit_bodies(jaxpr, name="layer"):
  """The bodies of the ``jit`` equations called ``name``, at any depth."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("pjit", "jit"):
      if eqn.params["name"] == name:
        found.append(eqn.params["jaxpr"])
      found += _jit_bodies(eqn.params["jaxpr"].jaxpr, name)
  return found


def _layer_bodies(fn, *args):
  """The bodies of the calls of ``layer`` in ``fn``'s jaxpr."""
  return _jit_bodies(jax.make_jaxpr(fn)(*args).jaxpr)


def test_repeated_layer_shares_one_rewritten_body():
  """Three calls of one jitted layer at one type: one body, bound 3 times."""
  w = jnp.ones((4, 4), jnp.float32) / 4

  def net(w, x):
    return layer(w, x), layer(w, 2 * x), layer(w, 3 * x)

  bodies = _layer_bodies(jaxmp.autocast(net), w, jnp.ones((2, 4)))
  assert len(bodies) == 3
  assert len({id(b) for b in bodies}) == 1
  # The shared body is the autocast one: a half product.
  assert "f16[2,4] = dot_general" in str(bodies[0])


def test_same_layer_at_other_types_gets_its_own_body():
  """Reuse is keyed by the types autocast gives the inputs.

  In the traced program both calls of ``layer`` take float32, so they share
  one jaxpr; under autocast the second one's input is the float16 output of
  a product, so it needs its own body.
  """
  w = jnp.full((4, 4), 0.25, jnp.float32)
  x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).reshape(2, 4)

  def net(w, x):
    return layer(w, x), layer(w, jnp.tanh(x @ w)), layer(w, 3 * x)

  traced = _layer_bodies(net, w, x)
  assert len(traced) == 3
  assert len({id(b) for b in traced}) == 1  # One jaxpr in the plain trace.
  bodies = _layer_bodies(jaxmp.autocast(net), w, x)
  assert len(bodies) == 3
  invars = [[str(v.aval) for v in b.jaxpr.invars] for b in bodies]
  assert invars == [
    ["float32[4,4]", "float32[2,4]"],
    ["float32[4,4]", "float16[2,4]"],
    ["float32[4,4]", "float32[2,4]"],
  ]
  outs = jaxmp.autocast(net)(w, x)
  h = jnp.tanh(x.astype(jnp.float16) @ w.astype(jnp.float16))
  want = jnp.tanh(h @ w.astype(jnp.float16))
  np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(want))
