"""The optimizer state on a ("data", "fsdp") mesh, and a sharded step.

Placement: every param-shaped state leaf (moments, traces, masters, Kahan
compensation, accumulators) sharded like its param, under ``jit(init)`` and
eagerly, in JAX's auto (Shardy and GSPMD) and explicit-axes modes; scalars
replicated. The step: shardings kept, one compilation, no fp32 all-gather
in the compiled HLO, a global overflow decision, and the losses of one
device.
"""

import functools
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from _helpers import backend_compiles
from _helpers import bytes_on_device

import jaxmp

pytestmark = pytest.mark.devices(4)

# A tiny MLP: every param has its own shape, so a test can find a state
# leaf's param by shape alone (the library matches by structure).
SPECS = {
  # Specs as jit writes them (no trailing None): outputs then equal inputs.
  "w1": ((8, 16), P("fsdp")),
  "b1": ((16,), P("fsdp")),
  "w2": ((16, 4), P(None, "fsdp")),
  "b2": ((4,), P()),
}
OPTIMIZERS = {
  "adam": (lambda: optax.adam(1e-2), 2),
  "sgd_momentum": (lambda: optax.sgd(1e-2, momentum=0.9), 1),
  "lion": (lambda: optax.lion(1e-3), 1),
  "chain_adamw": (
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    2,
  ),
}


def _mesh(explicit=False):
  kind = AxisType.Explicit if explicit else AxisType.Auto
  return jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(kind, kind))


def _params(mesh, dtype):
  rng = np.random.default_rng(0)
  return {
    k: jax.device_put(
      jnp.asarray(rng.normal(size=shape) * 0.5, dtype),
      NamedSharding(mesh, spec),
    )
    for k, (shape, spec) in SPECS.items()
  }


def _placement(state, params, mesh):
  """Checks every leaf; returns how many were param-shaped."""
  by_shape = {p.shape: p for p in params.values()}
  replicated = NamedSharding(mesh, P())
  like = 0
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    where = jax.tree_util.keystr(path)
    p = by_shape.get(x.shape)
    if p is not None and x.ndim:
      assert x.sharding.is_equivalent_to(p.sharding, x.ndim), (
        where,
        x.sharding,
        p.sharding,
      )
      like += 1
    else:
      assert x.sharding.is_equivalent_to(replicated, x.ndim), (
        where,
        x.sharding,
      )
  return like


def _init(opt, params, how):
  return jax.jit(opt.init)(params) if how == "jit" else opt.init(params)


# Each optimizer's state (its own tree) with half params and fp32 masters;
# fp32 params (no masters) once. fp16 and bf16 masters are placed by the
# same code (fp16: the master modes' and multi_steps' tests below).
PLACED = [(name, "bfloat16") for name in sorted(OPTIMIZERS)] + [
  ("adam", "float32")
]


@pytest.mark.parametrize("how", ["jit", "eager"])
@pytest.mark.parametrize("name,dtype", PLACED)
def test_state_placed_like_params(name, dtype, how):
  make, moments = OPTIMIZERS[name]
  mesh = _mesh()
  params = _params(mesh, jnp.dtype(dtype))
  opt = jaxmp.mixed_precision(make())
  state = _init(opt, params, how)
  masters = 4 if dtype != "float32" else 0
  assert _placement(state, params, mesh) == 4 * moments + masters


@pytest.mark.parametrize("how", ["jit", "eager"])
@pytest.mark.parametrize(
  "mode,dtype", [("kahan", "float16"), ("stochastic", "bfloat16")]
)
def test_master_modes_placed_like_params(mode, dtype, how):
  mesh = _mesh()
  params = _params(mesh, jnp.dtype(dtype))
  opt = jaxmp.mixed_precision(optax.adam(1e-2), master_weights=mode)
  state = _init(opt, params, how)
  compensation = 4 if mode == "kahan" else 0
  assert _placement(state, params, mesh) == 8 + compensation
  if mode == "stochastic":
    assert state.rounding_key.sharding.is_equivalent_to(
      NamedSharding(mesh, P()), 1
    )


@pytest.mark.parametrize("how", ["jit", "eager"])
def test_multi_steps_accumulator_placed_like_params(how):
  mesh = _mesh()
  params = _params(mesh, jnp.float16)
  opt = jaxmp.multi_steps(jaxmp.mixed_precision(optax.adam(1e-2)), 2)
  state = _init(opt, params, how)
  # acc_grads, masters, mu, nu.
  assert _placement(state, params, mesh) == 16
  acc = state.multi_steps.acc_grads
  assert acc["w1"].dtype == jnp.float32
  assert acc["w1"].sharding.is_equivalent_to(params["w1"].sharding, 2)


def test_multi_steps_over_plain_optax_placed_like_params():
  mesh = _mesh()
  params = _params(mesh, jnp.float32)
  state = jax.jit(jaxmp.multi_steps(optax.sgd(0.1, momentum=0.9), 2).init)(
    params
  )
  assert _placement(state, params, mesh) == 8  # acc_grads, trace


def test_matched_by_structure_not_shape():
  """Two params of one shape, sharded differently, keep their own."""
  mesh = _mesh()
  params = {
    "a": jax.device_put(
      jnp.ones((8, 8), jnp.float16), NamedSharding(mesh, P("fsdp", None))
    ),
    "b": jax.device_put(
      jnp.ones((8, 8), jnp.float16), NamedSharding(mesh, P(None, "fsdp"))
    ),
  }
  opt = jaxmp.mixed_precision(optax.adam(1e-2))
  for state in (jax.jit(opt.init)(params), opt.init(params)):
    for tree in (state.master_params, state.inner_state[0].mu):
      for k in params:
        assert tree[k].sharding.is_equivalent_to(params[k].sharding, 2), k


@pytest.mark.invariant
def test_jit_init_values_bit_exact_infs_and_nans():
  """The tie changes no value: masters are the params, bit for bit."""
  mesh = _mesh()
  w = np.array([[np.inf, -np.inf], [np.nan, -0.0]] * 2, np.float16)
  params = {"w": jax.device_put(w, NamedSharding(mesh, P("fsdp")))}
  opt = jaxmp.mixed_precision(optax.adam(1e-2), master_weights="fp32")
  state = jax.jit(opt.init)(params)
  got = np.asarray(state.master_params["w"])
  np.testing.assert_array_equal(
    got.view(np.uint32), w.astype(np.float32).view(np.uint32)
  )
  assert not np.asarray(state.inner_state[0].mu["w"]).any()
  assert state.master_params["w"].sharding.is_equivalent_to(
    params["w"].sharding, 2
  )


def test_jit_init_compiles_to_no_communication():
  """The ties move no data: the compiled init has no collective.

  Two params of one shape and dtype, sharded differently, included: ties
  that merged them (one sharding group) would reshard one with an
  all-to-all.
  """
  mesh = _mesh()
  params = dict(
    _params(mesh, jnp.float16),
    a=jax.device_put(
      jnp.ones((8, 8), jnp.float16), NamedSharding(mesh, P("fsdp"))
    ),
    b=jax.device_put(
      jnp.ones((8, 8), jnp.float16), NamedSharding(mesh, P(None, "fsdp"))
    ),
  )
  opt = jaxmp.mixed_precision(optax.adam(1e-2))
  hlo = jax.jit(opt.init).lower(params).compile().as_text()
  for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
    assert op not in hlo, op


def test_explicit_axes_mode():
  mesh = _mesh(explicit=True)
  params = _params(mesh, jnp.float16)
  opt = jaxmp.mixed_precision(optax.adam(1e-2), master_weights="kahan")
  with jax.set_mesh(mesh):
    state = jax.jit(opt.init)(params)
    assert _placement(state, params, mesh) == 12
    assert _placement(opt.init(params), params, mesh) == 12

    # An optimizer that builds its state with zeros(shape): explicit mode
    # types it replicated; init reshards it to the param's sharding.
    def init(p):
      return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p)

    own = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
    state = jax.jit(jaxmp.mixed_precision(own).init)(params)
    assert _placement(state, params, mesh) == 8


def test_gspmd_partitioner():
  """Auto mode under the older GSPMD partitioner (Shardy off)."""
  mesh = _mesh()
  params = _params(mesh, jnp.bfloat16)
  before = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", False)
  try:
    opt = jaxmp.mixed_precision(optax.sgd(1e-2, momentum=0.9))
    state = jax.jit(opt.init)(params)
  finally:
    jax.config.update("jax_use_shardy_partitioner", before)
  assert _placement(state, params, mesh) == 8


def test_adafactor_factored_leaves_left_replicated():
  mesh = _mesh()
  params = _params(mesh, jnp.float16)
  opt = jaxmp.mixed_precision(optax.adafactor(1e-2, min_dim_size_to_factor=8))
  state = jax.jit(opt.init)(params)
  leaves = {
    jax.tree_util.keystr(k): x
    for k, x in jax.tree_util.tree_leaves_with_path(state)
  }
  # w1's row and column factors are not param-shaped (v_col['w1'] has
  # b1's shape, but not its place in the tree): replicated. b1 is 1-D, its
  # second moment unfactored: like b1.
  [row] = [x for k, x in leaves.items() if k.endswith("v_row['w1']")]
  [col] = [x for k, x in leaves.items() if k.endswith("v_col['w1']")]
  [v_b1] = [x for k, x in leaves.items() if k.endswith(".v['b1']")]
  assert (row.shape, col.shape, v_b1.shape) == ((8,), (16,), (16,))
  replicated = NamedSharding(mesh, P())
  assert row.sharding.is_equivalent_to(replicated, 1)
  assert col.sharding.is_equivalent_to(replicated, 1)
  assert v_b1.sharding.is_equivalent_to(params["b1"].sharding, 1)
  assert state.master_params["w1"].sharding.is_equivalent_to(
    params["w1"].sharding, 2
  )
  shardings = jaxmp.state_shardings(opt, params)
  for got, want in zip(
    jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(shardings)
  ):
    assert got.sharding.is_equivalent_to(want, got.ndim)


# ---------------------------------------------------------------------------
# jaxmp.state_shardings


@pytest.mark.parametrize("mode", ["fp32", "kahan", "stochastic"])
def test_state_shardings_match_jit_init(mode):
  mesh = _mesh()
  params = _params(mesh, jnp.float16)
  opt = jaxmp.multi_steps(
    jaxmp.mixed_precision(optax.adam(1e-2), master_weights=mode), 2
  )
  abstract = {
    k: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=p.sharding)
    for k, p in params.items()
  }
  shardings = jaxmp.state_shardings(opt, abstract)
  assert jax.tree_util.tree_structure(
    shardings
  ) == jax.tree_util.tree_structure(jax.eval_shape(opt.init, params))
  state = jax.jit(opt.init)(params)
  pairs = zip(
    jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(shardings)
  )
  for got, want in pairs:
    assert isinstance(want, NamedSharding)
    assert got.sharding.is_equivalent_to(want, got.ndim)
  # As out_shardings, and as restore targets.
  again = jax.jit(opt.init, out_shardings=shardings)(params)
  for got, want in zip(
    jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(shardings)
  ):
    assert got.sharding.is_equivalent_to(want, got.ndim)
  targets = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    jax.eval_shape(opt.init, params),
    shardings,
  )
  assert jax.tree_util.tree_leaves(targets)[0].sharding is not None


def test_state_shardings_as_orbax_restore_targets_on_another_mesh(tmp_path):
  """Saved on (data 2, fsdp 2), restored bit for bit onto fsdp 4."""
  ocp = pytest.importorskip("orbax.checkpoint")
  params = _params(_mesh(), jnp.float16)
  opt = jaxmp.mixed_precision(optax.adam(1e-2), master_weights="kahan")
  state = jax.jit(opt.init)(params)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "state", state)
  fsdp4 = jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Auto,))
  moved = {
    k: jax.ShapeDtypeStruct(
      shape, jnp.float16, sharding=NamedSharding(fsdp4, spec)
    )
    for k, (shape, spec) in SPECS.items()
  }
  shardings = jaxmp.state_shardings(opt, moved)
  targets = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    jax.eval_shape(opt.init, moved),
    shardings,
  )
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(tmp_path / "state", targets)
  assert isinstance(restored, jaxmp.MixedPrecisionState)
  assert restored.compensation["w1"].sharding.spec == P("fsdp")
  for got, want, sharding in zip(
    jax.tree_util.tree_leaves(restored),
    jax.tree_util.tree_leaves(state),
    jax.tree_util.tree_leaves(shardings),
  ):
    assert got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_state_shardings_errors():
  mesh = _mesh()
  opt = jaxmp.mixed_precision(optax.adam(1e-2))
  params = _params(mesh, jnp.float16)
  with pytest.raises(ValueError, match=r"params\['b2'\] is ArrayImpl"):
    jaxmp.state_shardings(opt, {**params, "b2": jnp.ones(4, jnp.float16)})
  with pytest.raises(ValueError, match=r"params\['b2'\] is float"):
    jaxmp.state_shardings(opt, {**params, "b2": 1.0})
  other = jax.make_mesh((4,), ("x",))
  moved = jax.device_put(params["w1"], NamedSharding(other, P("x")))
  with pytest.raises(ValueError, match=r"different meshes.*params\['w1'\]"):
    jaxmp.state_shardings(opt, {**params, "w1": moved})


def test_state_shardings_of_params_on_one_device():
  """Params on one device (a restore target without a mesh): every leaf there."""
  device = jax.devices()[1]
  opt = jaxmp.mixed_precision(
    optax.adam(1e-2),
    optimizer_state=jaxmp.StateQuantization("int8", block_size=8, min_size=8),
  )
  params = {
    "w": jax.device_put(jnp.ones((4, 8), jnp.bfloat16), device),
    "b": jax.ShapeDtypeStruct(
      (8,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device)
    ),
  }
  shardings = jaxmp.state_shardings(opt, params)
  abstract = jax.eval_shape(opt.init, params)
  assert jax.tree.structure(shardings) == jax.tree.structure(abstract)
  for s in jax.tree.leaves(shardings):
    assert s == jax.sharding.SingleDeviceSharding(device)
  on_two = dict(params, w=jax.device_put(params["w"], jax.devices()[0]))
  with pytest.raises(ValueError, match=r"params\['b'\] is ShapeDtypeStruct"):
    jaxmp.state_shardings(opt, on_two)


def test_step_rejects_state_of_another_tree():
  mesh = _mesh()
  opt = jaxmp.mixed_precision(optax.adam(1e-2))
  params = _params(mesh, jnp.float16)
  grads = jax.tree.map(jnp.zeros_like, params)
  # Shapes that broadcast: without the check the step runs, silently wrong.
  small = dict(params, w1=jnp.ones((16,), jnp.float16))
  with pytest.raises(ValueError, match=r"master_params\['w1'\] has shape"):
    jax.jit(opt.update)(grads, opt.init(small), params)
  fewer = {k: v for k, v in params.items() if k != "b2"}
  with pytest.raises(ValueError, match=r"params\['b2'\], which the state"):
    jax.jit(opt.update)(grads, opt.init(fewer), params)


def test_step_rejects_state_on_another_mesh():
  mesh = _mesh()
  opt = jaxmp.mixed_precision(optax.adam(1e-2))
  params = _params(mesh, jnp.float16)
  other = jax.make_mesh((4,), ("x",))
  state = jax.device_put(
    opt.init(params),
    jax.tree.map(lambda x: NamedSharding(other, P()), opt.init(params)),
  )
  grads = jax.tree.map(jnp.zeros_like, params)
  with pytest.raises(ValueError, match=r"another mesh.*state\.inner_state"):
    jax.jit(opt.update)(grads, state, params)
  with pytest.raises(ValueError, match=r"another mesh"):
    opt.update(grads, state, params)


# ---------------------------------------------------------------------------
# The step on a sharded model.

LR = 1e-2
# Every param sharded over fsdp (the step needs nothing but plain jit), or b2
# replicated (auto mode then wants the gradients and the outputs pinned).
FSDP = dict(SPECS, b2=((4,), P("fsdp")))


def _loss(params, x, y, accumulate=None):
  """Half precision through and through; the loss in fp32.

  With ``accumulate=jnp.float32`` the products sum in fp32 (their cotangents
  too): a sharded run then differs from one device's only by the order of
  fp32 sums. In fp16, partial sums over a sharded axis round to fp16 before
  they are reduced, once per shard, where one device rounds once.
  """
  dot = functools.partial(jnp.dot, preferred_element_type=accumulate)
  h = jax.nn.relu(dot(x, params["w1"]).astype(x.dtype) + params["b1"])
  out = dot(h, params["w2"]).astype(x.dtype) + params["b2"]
  return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def _step(opt, shardings=None, accumulate=None):
  """The train step; with ``shardings`` (params, state): auto mode's pins."""
  loss_fn = functools.partial(_loss, accumulate=accumulate)

  def step(params, state, x, y):
    loss, grads = jaxmp.value_and_grad(loss_fn)(params, state, x, y)
    if shardings is not None:
      grads = jax.lax.with_sharding_constraint(grads, shardings[0])
    updates, state = opt.update(grads, state, params, loss=loss)
    return optax.apply_updates(params, updates), state, loss

  if shardings is None:
    return jax.jit(step)
  return jax.jit(step, out_shardings=(*shardings, None))


def _setup(mode, how, specs, pinned=False, accumulate=None):
  """Mesh, params, opt, state, step and batch of one configuration."""
  mesh = _mesh(explicit=mode == "explicit")
  rng = np.random.default_rng(0)
  params = {
    k: jax.device_put(
      jnp.asarray(rng.normal(size=shape) * 0.5, jnp.float16),
      NamedSharding(mesh, spec),
    )
    for k, (shape, spec) in specs.items()
  }
  opt = jaxmp.mixed_precision(optax.adam(LR))
  with jax.set_mesh(mesh):
    state = _init(opt, params, how)
  shardings = None
  if pinned:
    shardings = (
      jax.tree.map(lambda p: p.sharding, params),
      jaxmp.state_shardings(opt, params),
    )
  step = _step(opt, shardings, accumulate)
  return mesh, params, state, step, _batch(mesh)


def _batch(mesh, dtype=jnp.float16):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(8, 8)).astype(np.float32)
  y = rng.normal(size=(8, 4)).astype(np.float32)
  if mesh is None:
    return jnp.asarray(x, dtype), jnp.asarray(y)
  data = NamedSharding(mesh, P("data"))
  return (
    jax.device_put(jnp.asarray(x, dtype), data),
    jax.device_put(jnp.asarray(y), data),
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


CONFIGS = [
  ("auto", "fsdp"),
  ("explicit", "fsdp"),
  ("auto", "replicated_bias"),
  ("explicit", "replicated_bias"),
]


def _specs(params):
  return FSDP if params == "fsdp" else SPECS


@pytest.mark.parametrize("how", ["jit", "eager"])
@pytest.mark.parametrize("mode,params", CONFIGS)
def test_step_keeps_shardings_and_compiles_once(mode, params, how):
  """Plain jit keeps every sharding, but for a replicated param in auto mode.

  There XLA may reshard the outputs: the step pins them (out_shardings from
  `jaxmp.state_shardings`).
  """
  pinned = mode == "auto" and params == "replicated_bias"
  mesh, params, state, step, (x, y) = _setup(mode, how, _specs(params), pinned)
  with jax.set_mesh(mesh):
    new_params, new_state, _ = step(params, state, x, y)
    _same_shardings(new_params, params)
    _same_shardings(new_state, state)
    calls = lambda: step(*step(new_params, new_state, x, y)[:2], x, y)
    assert backend_compiles(calls) == 0
  if not pinned and mode == "auto":
    # Equal, not only equivalent: jit's dispatch cache holds one entry.
    assert step._cache_size() == 1  # pylint: disable=protected-access


_GATHER = re.compile(r"=\s*(\(?[^=]*?)\s+all-gather(?:-start)?\(")


def _all_gather_types(hlo):
  """The element types of every all-gather's result in HLO text."""
  types = []
  for m in _GATHER.finditer(hlo):
    types += re.findall(r"\b([a-z]+\d*)\[", m.group(1))
  return types


def test_all_gather_parser():
  hlo = (
    "  %ag = f16[8,16]{1,0} all-gather(f16[4,16]{1,0} %p), dimensions={0}\n"
    "  %s = (f32[4]{0}, f32[8]{0}) all-gather-start(f32[4]{0} %m)\n"
  )
  assert _all_gather_types(hlo) == ["f16", "f32", "f32"]


@pytest.mark.parametrize("mode,params", CONFIGS)
def test_compiled_step_gathers_no_fp32_master(mode, params, how="jit"):
  """Only half values are all-gathered (params, activations for compute).

  From a jitted init: an eager one places the state alike (the placement
  tests above), and the step's HLO depends on its inputs' shardings only.
  """
  pinned = mode == "auto" and params == "replicated_bias"
  mesh, params, state, step, (x, y) = _setup(mode, how, _specs(params), pinned)
  with jax.set_mesh(mesh):
    hlo = step.lower(params, state, x, y).compile().as_text()
  types = _all_gather_types(hlo)
  assert types, "no all-gather at all: the params are not sharded"
  assert set(types) <= {"f16", "bf16"}, types


@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_overflow_in_one_data_shard_skips_everywhere(mode):
  mesh, params, state, step, _ = _setup(mode, "jit", FSDP)
  x, y = _batch(None)
  x = np.array(x)
  x[6, 3] = np.inf  # Row 6 lives on the second data shard only.
  data = NamedSharding(mesh, P("data"))
  x, y = jax.device_put(x, data), jax.device_put(y, data)
  inf_rows = {
    s.index[0].start for s in x.addressable_shards if np.isinf(s.data).any()
  }
  assert inf_rows == {4}
  with jax.set_mesh(mesh):
    new_params, new_state, _ = step(params, state, x, y)
  for k in params:
    for got, old in zip(
      new_params[k].addressable_shards, params[k].addressable_shards
    ):
      assert got.device == old.device
      np.testing.assert_array_equal(got.data, old.data)
  for shard in new_state.skipped_steps.addressable_shards:
    assert int(shard.data) == 1
  for shard in new_state.step_applied.addressable_shards:
    assert not bool(shard.data)
  # And a finite batch steps, on every device.
  with jax.set_mesh(mesh):
    newer, _, _ = step(new_params, new_state, *_batch(mesh))
  assert not np.array_equal(np.asarray(newer["w1"]), np.asarray(params["w1"]))


@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_losses_equal_one_device(mode):
  """The fp32 losses of 3 steps: sharded as on one device, within 1e-5."""

  def run(params, state, step, batch):
    losses = []
    for _ in range(3):
      params, state, loss = step(params, state, *batch)
      losses.append(float(loss))
    return np.array(losses)

  f32 = jnp.float32
  mesh, params, state, step, batch = _setup(
    mode, "jit", SPECS, pinned=mode == "auto", accumulate=f32
  )
  with jax.set_mesh(mesh):
    sharded = run(params, state, step, batch)
  single = jax.tree.map(lambda p: jnp.asarray(np.asarray(p)), params)
  opt = jaxmp.mixed_precision(optax.adam(LR))
  single = run(
    single, opt.init(single), _step(opt, accumulate=f32), _batch(None)
  )
  # Every loss differs from the one before: the steps were applied.
  assert len(set(single.tolist())) == 3
  # fp32 sums of 8 to 16 products in another order: ~1e-7 relative.
  np.testing.assert_allclose(sharded, single, rtol=1e-5)


def test_bytes_per_device():
  """Device 0 holds 1/fsdp of every sharded leaf, all of a replicated one."""
  mesh = _mesh()
  rng = np.random.default_rng(0)
  params = {
    "w": jax.device_put(
      jnp.asarray(rng.normal(size=(64, 32)), jnp.float16),
      NamedSharding(mesh, P("fsdp", None)),
    ),
    "v": jax.device_put(
      jnp.asarray(rng.normal(size=(32, 64)), jnp.float16),
      NamedSharding(mesh, P(None, "fsdp")),
    ),
  }
  opt = jaxmp.mixed_precision(optax.adam(LR))
  for state in (jax.jit(opt.init)(params), opt.init(params)):
    whole, scalars, on0 = bytes_on_device(state, jax.devices()[0])
    # masters, mu, nu: 3 * 4 bytes * 2 * 2048; half on device 0.
    assert whole - scalars == 3 * 4 * 2 * 2048
    assert on0 == (whole - scalars) // 2 + scalars


_EIGHT = textwrap.dedent(
  """
  import os
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  import jax, jax.numpy as jnp, optax, jaxmp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jax.sharding import AxisType
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
  w = jax.device_put(jnp.ones((64, 32), jnp.float16),
                     NamedSharding(mesh, P("fsdp")))
  state = jax.jit(jaxmp.mixed_precision(optax.adam(1e-3)).init)({"w": w})
  leaves = jax.tree_util.tree_leaves(state)
  d0 = jax.devices()[0]
  on0 = sum(s.data.nbytes for x in leaves for s in x.addressable_shards
            if s.device == d0 and x.ndim)
  print(on0, sum(x.nbytes for x in leaves if x.ndim))
  # Block-scaled autocast (NVFP4: global amax, data-seeded stochastic
  # rounding, Hadamard rotations) on the (2, 4) mesh: one device's gradients.
  import numpy as np
  rng = np.random.default_rng(0)
  x, w, c = (rng.normal(size=s).astype("float32")
             for s in ((64, 32), (32, 48), (64, 48)))
  g = jax.jit(jax.grad(jaxmp.autocast(
      lambda x, w, c: jnp.sum((x @ w) * c), fp8="nvfp4"), (0, 1)))
  one = g(x, w, c)
  put = lambda a, *s: jax.device_put(a, NamedSharding(mesh, P(*s)))
  two = g(put(x, "data"), put(w, None, "fsdp"), put(c, "data", "fsdp"))
  # Only the sum orders differ: 2 * terms * eps of |a| |b|, twice that for
  # the quantized operands, 64 more terms for the rotations.
  bx = np.abs(c) @ np.abs(w).T * (48 + 64) * 4 * 2.0**-24
  bw = np.abs(x).T @ np.abs(c) * (64 + 64) * 4 * 2.0**-24
  print(int(np.all(np.abs(one[0] - two[0]) <= bx)
            and np.all(np.abs(one[1] - two[1]) <= bw)))
  """
)


def test_eight_devices_quarter_per_device_and_block_autocast_as_one():
  out = subprocess.run(
    [sys.executable, "-c", _EIGHT],
    capture_output=True,
    text=True,
    check=True,
    timeout=120,
    env={k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"},
  )
  lines = out.stdout.split("\n")
  on0, whole = map(int, lines[0].split())
  assert whole == 3 * 4 * 64 * 32
  assert on0 * 4 == whole
  assert lines[1] == "1"  # the (2, 4) mesh's gradients are one device's
