"""Low-bit optimizer state on a ("data", "fsdp") mesh.

The codes of an encoded leaf are placed like its param, its per-block scales
on the param's leading axes (and on its last axis where every shard holds
whole blocks), the small leaves kept fp32 like their params: eagerly, under
``jax.jit(opt.init)`` and in `jaxmp.state_shardings`. A jitted sharded step
keeps every sharding and computes what one device does, bit for bit; an
orbax checkpoint restores onto another mesh and resumes bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from _helpers import bytes_on_device

import jaxmp

pytestmark = pytest.mark.devices(4)

BLOCK = 8
# Encoded (>= 64 elements): w1 sharded on its leading axis, w2 on its last
# (16 / 2 = 8: whole blocks per shard). Kept fp32 (< 64): b1, b2.
SPECS = {
  "w1": ((8, 32), P("fsdp")),
  "b1": ((32,), P("fsdp")),
  "w2": ((32, 16), P(None, "fsdp")),
  "b2": ((16,), P("fsdp")),
}
# How each encoded leaf's scale is sharded on the (2, 2) mesh.
SCALES = {"w1": P("fsdp"), "w2": P(None, "fsdp")}
CASES = [("int8", "remainder"), ("bf16", "fp32")]


def _mesh(shape=(2, 2), kind=AxisType.Auto):
  return jax.make_mesh(shape, ("data", "fsdp"), axis_types=(kind, kind))


def _params(mesh, specs=SPECS):
  rng = np.random.default_rng(0)
  return {
    k: jax.device_put(
      jnp.asarray(rng.normal(size=shape) * 0.5, jnp.bfloat16),
      NamedSharding(mesh, spec),
    )
    for k, (shape, spec) in specs.items()
  }


def _opt(kind, masters):
  quant = jaxmp.StateQuantization(kind, block_size=BLOCK, min_size=64)
  return jaxmp.mixed_precision(
    optax.adam(1e-2), master_weights=masters, optimizer_state=quant
  )


def _init(opt, params, how):
  return jax.jit(opt.init)(params) if how == "jit" else opt.init(params)


def _is_encoded(x):
  return type(x).__name__ == "EncodedLeaf"


def _moments(state):
  """``{(moment, name): leaf}`` of Adam's mu and nu."""
  adam = state.inner_state[0]
  return {
    (m, k): leaf for m in ("mu", "nu") for k, leaf in getattr(adam, m).items()
  }


@pytest.mark.parametrize("how", ["jit", "eager"])
@pytest.mark.parametrize("kind,masters", CASES)
def test_lowbit_state_placed_like_params(kind, masters, how):
  mesh = _mesh()
  params = _params(mesh)
  opt = _opt(kind, masters)
  state = _init(opt, params, how)
  moments = _moments(state)
  for (_, k), leaf in moments.items():
    want = params[k].sharding
    if k.startswith("w"):  # Encoded: codes like the param.
      assert _is_encoded(leaf), k
      assert leaf.data.sharding.is_equivalent_to(want, 2), (k, leaf.data)
      if kind == "int8":
        rows, cols = params[k].shape
        assert leaf.scale.shape == (rows, cols // BLOCK)
        assert leaf.scale.sharding.is_equivalent_to(
          NamedSharding(mesh, SCALES[k]), 2
        ), (k, leaf.scale.sharding)
      else:
        assert leaf.scale is None
    else:  # Kept fp32: like the param.
      assert leaf.dtype == jnp.float32, k
      assert leaf.sharding.is_equivalent_to(want, 1), (k, leaf.sharding)
  if how == "jit":  # The ties move no data: no collective in the init.
    hlo = jax.jit(opt.init).lower(params).compile().as_text()
    for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
      assert op not in hlo, op
  # And jaxmp.state_shardings says the same of every leaf.
  shardings = jaxmp.state_shardings(opt, params)
  for (path, got), s in zip(
    jax.tree_util.tree_leaves_with_path(state),
    jax.tree_util.tree_leaves(shardings),
  ):
    assert got.sharding.is_equivalent_to(s, got.ndim), (
      jax.tree_util.keystr(path),
      got.sharding,
      s,
    )


@pytest.mark.parametrize("how", ["jit", "eager"])
def test_scale_replicated_where_a_block_would_span_two_shards(how):
  """Last axis 24 over 2 shards of 12: blocks of 8 cross; 20: padded."""
  mesh = _mesh()
  specs = {"a": ((4, 24), P(None, "fsdp")), "b": ((16, 20), P("fsdp"))}
  params = _params(mesh, specs)
  opt = _opt("int8", "fp32")  # The scales do not depend on the masters.
  state = _init(opt, params, how)
  shardings = jaxmp.state_shardings(opt, params)
  mu, want = state.inner_state[0].mu, shardings.inner_state[0].mu
  assert want["a"].scale.spec == P(None, None)
  assert want["a"].data.spec == P(None, "fsdp")  # Codes: like the param.
  assert want["b"].scale.spec == P("fsdp", None)
  assert mu["b"].data.shape == (16, 24)  # Padded to whole blocks.
  for k in specs:
    for part in ("data", "scale"):
      got, s = getattr(mu[k], part), getattr(want[k], part)
      assert got.sharding.is_equivalent_to(s, 2), (k, part, got.sharding)


@pytest.mark.parametrize("kind,masters", CASES)
def test_bytes_per_device(kind, masters):
  """Device 0 holds half of every leaf (fsdp 2) but the scalars."""
  mesh = _mesh()
  params = _params(mesh)
  opt = _opt(kind, masters)
  for state in (jax.jit(opt.init)(params), opt.init(params)):
    whole, scalars, on0 = bytes_on_device(state, jax.devices()[0])
    assert whole - scalars > 0
    assert on0 == (whole - scalars) // 2 + scalars


def _grads(params, i):
  rng = np.random.default_rng(10 + i)
  return {
    k: jax.device_put(
      jnp.asarray(rng.normal(size=p.shape), jnp.bfloat16), p.sharding
    )
    for k, p in params.items()
  }


def _linear(params, grads):
  """A loss whose gradient is ``grads``: scaled by a power of two, exact."""
  return sum(
    jnp.sum(p.astype(jnp.float32) * g.astype(jnp.float32))
    for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads))
  )


def _step(opt):
  """A jitted step on given gradients (the loss is linear in the params)."""

  def step(params, state, grads):
    _, grads = jaxmp.value_and_grad(_linear)(params, state, grads)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step)


def _bits(x):
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.dtype.kind == "f" else x


def _ulps32(x: np.ndarray) -> np.ndarray:
  return np.spacing(np.abs(x).astype(np.float32))


def _assert_same_step(state, single, params, single_params, steps, kind):
  """The sharded run against one device's, each within its format's rounding.

  The two are different XLA programs: a compiler may fuse a multiply-add in
  one and not the other (jax 0.12's XLA does, under its default flags), so
  an fp32 value may differ by a rounding a step: the masters by at most
  ``2 * steps`` fp32 ulps (an update's own rounding and the add's). The
  stored moments are the codec's roundings of fp32 moments that differ so:
  bf16 codes by one bf16 unit (2**-8 relative), and the int8 codes,
  stochastically rounded from hashed bits that such a difference changes,
  by one step of the 3-bit mantissa either way (2 * 2**-3 relative), down
  to the block's floor (2**-14 of its largest value, here below 1e-5). The
  bf16 params, roundings of the masters, by one bf16 unit.
  """
  m = jax.tree.map(np.asarray, jaxmp.master_params(state, params))
  m1 = jax.tree.map(np.asarray, jaxmp.master_params(single, single_params))
  for k in m:
    np.testing.assert_array_less(
      np.abs(m[k] - m1[k]), 2 * steps * _ulps32(m1[k]) + 1e-30, err_msg=k
    )
  for k in params:
    a = np.asarray(params[k]).astype(np.float32)
    b = np.asarray(single_params[k]).astype(np.float32)
    np.testing.assert_array_less(np.abs(a - b), 2**-8 * np.abs(b) + 1e-30)
  rtol = {"bf16": 2**-8, "int8": 2 * 2**-3}[kind]
  for (path, x), y in zip(
    jax.tree_util.tree_leaves_with_path(_decoded(state.inner_state)),
    jax.tree_util.tree_leaves(_decoded(single.inner_state)),
  ):
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype.kind != "f":
      np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
      continue
    np.testing.assert_array_less(
      np.abs(x - y),
      rtol * np.abs(y) + 1e-5 + 2 * steps * _ulps32(y),
      err_msg=jax.tree_util.keystr(path),
    )


def _decoded(inner_state):
  from jaxmp._src.state import state_codec  # pylint: disable=g-import-not-at-top

  return state_codec.decode_state(inner_state)


def _assert_bit_equal(a, b):
  for (path, x), y in zip(
    jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)
  ):
    np.testing.assert_array_equal(
      _bits(x), _bits(y), err_msg=jax.tree_util.keystr(path)
    )


def _same_shardings(a, b):
  for (path, x), y in zip(
    jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)
  ):
    assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (
      jax.tree_util.keystr(path),
      x.sharding,
      y.sharding,
    )


@pytest.mark.invariant
@pytest.mark.parametrize("kind,masters", CASES)
def test_sharded_step_keeps_shardings_and_equals_one_device(kind, masters):
  """3 jitted steps on given gradients: one device's params and state.

  The codec's block max is order-free and everything else is elementwise,
  so the partitioned step equals the unpartitioned one up to the roundings
  that two compilations of the same arithmetic may place differently.
  """
  mesh = _mesh()
  params = _params(mesh)
  opt = _opt(kind, masters)
  step = _step(opt)
  state = jax.jit(opt.init)(params)
  single_params = jax.tree.map(lambda p: jnp.asarray(np.asarray(p)), params)
  # Eager (so jit init's values are pinned to eager's too), but for int8
  # with remainder masters: there an eager init compiles each of its many
  # ops (seconds); jitted, and its eager placement is tested above.
  init = opt.init if kind == "bf16" else jax.jit(opt.init)
  single_state = init(single_params)
  for i in range(3):
    grads = _grads(params, i)
    new_params, new_state = step(params, state, grads)
    _same_shardings(new_params, params)
    _same_shardings(new_state, state)
    params, state = new_params, new_state
    single_params, single_state = step(
      single_params, single_state, jax.tree.map(np.asarray, grads)
    )
  # Every shard holds whole blocks: the step gathers nothing (its
  # all-reduces: the loss and the global overflow check).
  hlo = step.lower(params, state, _grads(params, 0)).compile().as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo
  assert step._cache_size() == 2  # One sharded entry, one single-device.  # pylint: disable=protected-access
  assert not np.array_equal(
    np.asarray(params["w1"]), np.asarray(_params(mesh)["w1"])
  )
  _assert_same_step(state, single_state, params, single_params, 3, kind)


@pytest.mark.invariant
def test_orbax_restore_onto_another_mesh_and_resume(tmp_path):
  """Saved on (data 2, fsdp 2), restored onto (1, 4): equal, resumes equal."""
  ocp = pytest.importorskip("orbax.checkpoint")
  params = _params(_mesh())
  opt = _opt("int8", "remainder")
  step = _step(opt)
  state = jax.jit(opt.init)(params)
  params, state = step(params, state, _grads(params, 0))
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "state", state)
  fsdp4 = _mesh((1, 4))
  moved = jax.tree.map(
    lambda p: jax.device_put(p, NamedSharding(fsdp4, p.sharding.spec)), params
  )
  shardings = jaxmp.state_shardings(opt, moved)
  # w2's last axis, 16 over 4 shards of 4, holds no whole block of 8: its
  # scales are replicated there (sharded on fsdp 2 before).
  assert shardings.inner_state[0].mu["w2"].scale.spec == P(None, None)
  assert shardings.inner_state[0].mu["w1"].scale.spec == P("fsdp", None)
  targets = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    jax.eval_shape(opt.init, moved),
    shardings,
  )
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "state", targets)
  for (path, got), s in zip(
    jax.tree_util.tree_leaves_with_path(restored),
    jax.tree_util.tree_leaves(shardings),
  ):
    assert got.sharding.is_equivalent_to(s, got.ndim), jax.tree_util.keystr(
      path
    )
  _assert_bit_equal(restored, state)
  # Resumed from the checkpoint as from the same state moved in memory: the
  # same program on the same mesh, bit for bit. (Against the run on the old
  # mesh, another program, only within rounding: the step test above.)
  in_memory = jax.device_put(state, shardings)
  a = step(moved, in_memory, _grads(moved, 1))
  b = step(moved, restored, _grads(moved, 1))
  _assert_bit_equal(b, a)


def test_step_rejects_encoded_state_of_another_mesh_or_tree():
  mesh = _mesh()
  params = _params(mesh)
  opt = _opt("int8", "remainder")
  state = opt.init(params)
  grads = _grads(params, 0)
  # Only w1's codes and scales moved to another mesh.
  other = NamedSharding(jax.make_mesh((4,), ("x",)), P())
  mu = dict(state.inner_state[0].mu)
  mu["w1"] = jax.device_put(mu["w1"], other)
  adam = state.inner_state[0]._replace(mu=mu)
  moved = state._replace(inner_state=(adam, *state.inner_state[1:]))
  with pytest.raises(ValueError, match=r"another mesh.*mu\['w1'\]\.data"):
    jax.jit(opt.update)(grads, moved, params)
  # A state built for a smaller w1: the remainders say so.
  small = opt.init(dict(params, w1=jnp.ones((4, 32), jnp.bfloat16)))
  with pytest.raises(ValueError, match=r"state\.remainder\['w1'\] has shape"):
    jax.jit(opt.update)(grads, small, params)


def test_explicit_axes_mode():
  """Placed and stepped as in auto mode; a block across shards: an error."""
  mesh = _mesh(kind=AxisType.Explicit)
  params = _params(mesh)
  opt = _opt("int8", "remainder")
  step = _step(opt)
  with jax.set_mesh(mesh):
    state = jax.jit(opt.init)(params)
    shardings = jaxmp.state_shardings(opt, params)
    for (path, got), s in zip(
      jax.tree_util.tree_leaves_with_path(state),
      jax.tree_util.tree_leaves(shardings),
    ):
      assert got.sharding.is_equivalent_to(s, got.ndim), (
        jax.tree_util.keystr(path),
        got.sharding,
      )
    assert state.inner_state[0].nu["w2"].scale.sharding.spec == P(None, "fsdp")
    _, new_state = step(params, state, _grads(params, 0))
    _same_shardings(new_state, state)
    bad = _params(mesh, {"a": ((4, 24), P(None, "fsdp"))})
    with pytest.raises(
      ValueError,
      match=r"inner_state\[0\]\.mu\['a'\] of shape.*2 shards of 12.*of 8",
    ):
      opt.init(bad)


def test_scalar_param_encoded_under_jit_init():
  """A 0-d param (min_size=1) encodes to one block: replicated, no error."""
  mesh = _mesh()
  params = _params(mesh, {"s": ((), P()), "w1": SPECS["w1"]})
  quant = jaxmp.StateQuantization("int8", block_size=BLOCK, min_size=1)
  opt = jaxmp.mixed_precision(
    optax.adam(1e-2), master_weights="remainder", optimizer_state=quant
  )
  mu = jax.jit(opt.init)(params).inner_state[0].mu
  assert mu["s"].data.shape == (1,) and mu["s"].scale.shape == (1,)
  replicated = NamedSharding(mesh, P())
  assert mu["s"].data.sharding.is_equivalent_to(replicated, 1)
  assert mu["w1"].scale.sharding.is_equivalent_to(
    NamedSharding(mesh, P("fsdp")), 2
  )
