"""``master_weights`` per leaf: each leaf bit for bit as under its own mode."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

MODES = {
  "a": "fp32",
  "b": "kahan",
  "c": "stochastic",
  "d": "remainder",
  "e": "none",
  "f": "kahan",  # float16
  "g": "fp32",  # an fp32 param: its own master in every mode
}
N = 8


def _params(remainder_ok=False):
  rng = np.random.default_rng(0)
  out = {}
  for k in MODES:
    dtype = {"f": jnp.float16, "g": jnp.float32}.get(k, jnp.bfloat16)
    if k == "f" and remainder_ok:
      dtype = jnp.bfloat16  # "remainder" takes no float16; f is not compared.
    out[k] = jnp.asarray(rng.standard_normal(N), dtype)
  return out


def _run(master_weights, params):
  opt = jaxmp.mixed_precision(
    optax.sgd(3e-3, momentum=0.9),
    loss_scale=1.0,
    master_weights=master_weights,
    rounding_key=7,
    optimizer_state=jaxmp.StateQuantization("bf16", min_size=1),
  )
  state = opt.init(params)
  update = jax.jit(opt.update)
  rng = np.random.default_rng(1)
  for t in range(3):
    grads = jax.tree.map(
      lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params
    )
    if t == 1:  # A skipped step: every mode rolls back.
      grads["a"] = grads["a"].at[0].set(jnp.inf)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _bits(x):
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@pytest.mark.invariant
def test_each_leaf_as_under_its_mode_alone():
  """Each leaf bit for bit as under its own mode alone; the state's record.

  Bit for bit, so it runs in the test command's second half only
  (``-m invariant``, XLA's default flags): the first half's fast-compile
  flags round some fused expressions differently in two programs.
  """
  params = _params()
  fn = lambda path, p: MODES[path[0].key]
  got, state = _run(fn, params)
  refs = {}
  for mode in sorted(set(MODES.values())):
    ref, refs[mode] = _run(mode, _params(remainder_ok=mode == "remainder"))
    for k, m in MODES.items():
      if m == mode and (k, mode) != ("f", "remainder"):
        np.testing.assert_array_equal(_bits(got[k]), _bits(ref[k]), err_msg=k)
  # A pytree of modes is the same choice as the function.
  tree_opt = jaxmp.mixed_precision(optax.sgd(0.1), master_weights=dict(MODES))
  fn_opt = jaxmp.mixed_precision(optax.sgd(0.1), master_weights=fn)
  assert jax.tree.structure(tree_opt.init(params)) == jax.tree.structure(
    fn_opt.init(params)
  )
  # Resumed: the static choice survives a jit round trip.
  assert jax.jit(lambda s: s)(state).master_modes == state.master_modes
  # The masters read back per leaf: fp32 for "a", joined for "d".
  masters = jaxmp.master_params(state, got)
  assert masters["d"].dtype == jnp.float32
  np.testing.assert_array_equal(masters["e"], got["e"].astype(jnp.float32))
  # The bytes saved against fp32 masters for all six half params: a keeps
  # 4 bytes, b, d and f 2 each, c and e none.
  summary = jaxmp.state_summary(state)
  assert summary.masters_saved == (6 * 4 - 4 - 3 * 2) * N
  assert summary.master_modes["['c']"] == "stochastic"
  assert "bytes saved" in str(summary)
  key_bytes = 8
  assert (
    jaxmp.state_summary(refs["fp32"]).nbytes - summary.nbytes + key_bytes
    == summary.masters_saved
  )


def test_report_choice_and_errors():
  params = {"w": jnp.ones(4, jnp.float16), "v": jnp.ones(4, jnp.bfloat16)}
  with pytest.raises(ValueError, match=r"\['w'\]"):
    jaxmp.mixed_precision(
      optax.sgd(0.1), master_weights=lambda path, p: "remainder"
    ).init(params)
  with pytest.raises(ValueError, match="'v'.*got 'fp64'"):
    jaxmp.mixed_precision(
      optax.sgd(0.1), master_weights={"w": "fp32", "v": "fp64"}
    ).init(params)
  # The loop: measure, choose, train with the choice.
  opt = jaxmp.mixed_precision(optax.adam(1e-4), rounding_every=1)
  state = opt.init(params)
  grads = {
    "w": jnp.full(4, 2.0**15, jnp.float16),
    "v": jnp.ones(4, jnp.bfloat16),
  }
  _, state = opt.update(grads, state, params)
  choice = jaxmp.rounding_report(state).master_weights()
  assert dict(choice) == {"['w']": "fp32", "['v']": "remainder"}
  state = jaxmp.mixed_precision(optax.adam(1e-4), master_weights=choice).init(
    params
  )
  assert state.master_params["w"].dtype == jnp.float32
  assert state.master_params["v"] is None and state.remainder["v"] is not None
  # Modes given for a subtree: each of its leaves takes the subtree's. An
  # fp32 param is its own master under any mode: no buffer, no bytes saved.
  tree = {
    "w": jnp.ones(4, jnp.float16),
    "sub": {"x": jnp.ones(4, jnp.bfloat16), "y": jnp.ones(4, jnp.float32)},
  }
  state = jaxmp.mixed_precision(
    optax.sgd(0.1), master_weights={"w": "fp32", "sub": "kahan"}
  ).init(tree)
  assert state.master_params["w"].dtype == jnp.float32
  assert state.compensation["sub"]["x"].dtype == jnp.bfloat16
  assert state.compensation["sub"]["y"] is None
  summary = jaxmp.state_summary(state)
  assert summary.master_modes["['sub']['y']"] == "kahan"
  # Against fp32 masters: x's compensation saves 2 of 4 bytes; w none.
  assert summary.masters_saved == 2 * 4
