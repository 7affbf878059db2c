"""`mixed_precision` under Flax NNX's `nnx.Optimizer`: state, steps, restores.

`nnx.Optimizer` keeps the state in variables and writes each step's state
back with `nnx.update`; `nnx.eval_shape` of a model and its optimizer is
flax's restore target. The state must survive both as it does with plain
optax, for every master-weights mode and every ``optimizer_state``.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp

pytestmark = pytest.mark.devices(4)

BF16 = jnp.bfloat16
# Every master mode and every optimizer_state, each at least once (the whole
# product would compile three times as much).
CASES = [
  ("remainder", "int8"),
  ("fp32", "bf16"),
  ("kahan", "fp32"),
  ("stochastic", "int8"),
  ("none", "bf16"),
]


class _Net(nnx.Module):
  """A bf16 linear layer and an fp32 gain (its own master: no buffer).

  The kernel's last axis (12) is padded to whole blocks of 8 when encoded.
  """

  def __init__(self, rngs, dtype=BF16, kernel_names=None):
    init = nnx.initializers.lecun_normal()
    if kernel_names:
      init = nnx.with_partitioning(init, kernel_names)
    self.l = nnx.Linear(8, 12, param_dtype=dtype, kernel_init=init, rngs=rngs)
    self.gain = nnx.Param(jnp.ones((12,), jnp.float32))

  def __call__(self, x):
    return self.l(x.astype(self.l.kernel.dtype)).astype(jnp.float32) * self.gain


def _tx(mode, state):
  quant = jaxmp.StateQuantization(state, block_size=8, min_size=12)
  return jaxmp.mixed_precision(
    optax.sgd(1e-2, momentum=0.9), master_weights=mode, optimizer_state=quant
  )


def _loss(model, x):
  return jnp.mean(jnp.square(model(x) - 0.5))


def _bits(tree):
  return [
    np.asarray(x).view(f"u{np.asarray(x).dtype.itemsize}")
    for x in jax.tree.leaves(tree)
  ]


def _assert_same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(_bits(a), _bits(b), strict=True):
    np.testing.assert_array_equal(x, y)


def _x():
  return jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), BF16)


def _nnx_step(model, opt, x):
  grads = nnx.grad(lambda m: jaxmp.scale_loss(_loss(m, x), opt.opt_state))(
    model
  )
  opt.update(model, grads)


def _split_merge_step(graphdef, tx, params, state, x):
  """The functional route: params from `nnx.split`, variables and all."""

  def loss(p):
    return jaxmp.scale_loss(_loss(nnx.merge(graphdef, p), x), state)

  updates, state = tx.update(jax.grad(loss)(params), state, params)
  return optax.apply_updates(params, updates), state


@pytest.mark.invariant
def test_nnx_optimizer_steps_as_split_merge_every_mode_and_state():
  """3 steps of `nnx.Optimizer` (under `nnx.jit`) equal the functional route.

  Every master mode with every ``optimizer_state``, in one compiled program:
  the state written back by `nnx.update` decodes again at the next step.
  """
  cases = CASES
  txs = [_tx(*c) for c in cases]
  models = [_Net(nnx.Rngs(0)) for _ in cases]
  opts = [nnx.Optimizer(m, tx, wrt=nnx.Param) for m, tx in zip(models, txs)]
  graphdef, _ = nnx.split(models[0], nnx.Param)
  pures = []
  for tx in txs:
    params = nnx.split(_Net(nnx.Rngs(0)), nnx.Param)[1]
    pures.append((params, tx.init(params)))
  params0 = nnx.as_pure(nnx.state(models[0], nnx.Param))
  # The functional state keeps its variables step after step (a scan carry).
  structures = [jax.tree.structure(pure) for pure in pures]

  @nnx.jit
  def step(models, opts, pures, x):
    for model, opt in zip(models, opts):
      _nnx_step(model, opt, x)
    return [
      _split_merge_step(graphdef, tx, p, s, x) for tx, (p, s) in zip(txs, pures)
    ]

  x = _x()
  for _ in range(3):
    pures = step(models, opts, pures, x)
  assert [jax.tree.structure(pure) for pure in pures] == structures
  for case, model, opt, (params, state) in zip(cases, models, opts, pures):
    got = nnx.as_pure(opt.opt_state)
    assert int(got.skipped_steps) == 0, case
    mu = got.inner_state[0].trace["l"]["kernel"]
    encoded = type(mu).__name__ == "EncodedLeaf"
    assert encoded == (case[1] != "fp32"), case
    _assert_same(nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(params))
    _assert_same(got, nnx.as_pure(state))
    moved = nnx.as_pure(nnx.state(model, nnx.Param))["l"]["kernel"]
    assert not np.array_equal(moved, params0["l"]["kernel"]), case


def test_nnx_optimizer_low_bit_state_steps_eagerly():
  """Eager `nnx.Optimizer.update`, int8 state: the functional route's steps.

  The second step decodes what `nnx.update` wrote back after the first. (A
  state left undecoded raises; one not written back holds the first step's
  momentum, about a third of the third step's: far outside the tolerance,
  an int8 code's relative error of 2**-4.)
  """
  tx = _tx("remainder", "int8")
  model = _Net(nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, params = nnx.split(_Net(nnx.Rngs(0)), nnx.Param)
  pure = tx.init(params)
  x = _x()
  for _ in range(3):
    _nnx_step(model, opt, x)
    params, pure = _split_merge_step(graphdef, tx, params, pure, x)
  got = nnx.as_pure(opt.opt_state)
  assert int(got.skipped_steps) == 0
  assert jax.tree.structure(got) == jax.tree.structure(nnx.as_pure(pure))
  for a, b in zip(
    jax.tree.leaves(nnx.as_pure(got)),
    jax.tree.leaves(nnx.as_pure(pure)),
  ):
    if jnp.issubdtype(a.dtype, jnp.floating):  # Int8 codes: by their scales.
      np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-4
      )


def test_settle_no_variable_holds_a_pytree_or_none():
  """Each variable of an NNX-built state holds an array.

  Nothing else for NNX to treat as one: a `None` master, an encoded leaf.
  """
  mesh = jax.make_mesh(
    (2, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2
  )

  def make():
    model = _Net(nnx.Rngs(0), kernel_names=(None, "fsdp"))
    return model, nnx.Optimizer(model, _tx("fp32", "int8"), wrt=nnx.Param)

  with jax.set_mesh(mesh):  # Abstract: nothing computed.
    model, opt = nnx.eval_shape(make)
  variables = jax.tree.leaves(
    opt.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )
  assert variables
  for v in variables:
    assert isinstance(v, nnx.Variable) and hasattr(v.get_value(), "shape"), v
  assert nnx.as_pure(opt.opt_state).master_params["gain"] is None
  # The master keeps the kernel's sharding names; the codes (their last
  # axis padded from 12 to 16) and the scales (blocks) keep them on the
  # leading axis only, so that every name fits its axis.
  names = lambda v: tuple(v.get_metadata()["out_sharding"])
  assert names(opt.opt_state.master_params["l"]["kernel"]) == (None, "fsdp")
  enc = opt.opt_state.inner_state[0].trace["l"]["kernel"]
  assert type(enc).__name__ == "EncodedLeaf"
  assert type(enc.data).__name__ == "OptVariable"
  assert names(enc.data) == names(enc.scale) == (None, None)
  # `jaxmp.state_shardings` of NNX params: the state's structure, variables
  # included, each param-shaped leaf placed like its param.
  params = nnx.state(model, nnx.Param)
  shardings = jaxmp.state_shardings(opt.tx, params)
  assert jax.tree.structure(shardings) == jax.tree.structure(
    jax.eval_shape(opt.tx.init, params)
  )
  kernel = shardings.master_params["l"]["kernel"].get_value()
  assert kernel.spec == P(None, "fsdp")


CKPT_CASES = [  # (param dtype, master mode, optimizer_state)
  (jnp.float32, "fp32", "fp32"),  # fp32 params: no masters at all.
  (BF16, "remainder", "int8"),
  (BF16, "kahan", "bf16"),
]


def _make(dtype, mode, state):
  model = _Net(nnx.Rngs(0), dtype, kernel_names=("fsdp", None))
  return model, nnx.Optimizer(model, _tx(mode, state), wrt=nnx.Param)


def _on(mesh, abstract):
  """`nnx.eval_shape`'s shape structs on the concrete ``mesh``."""
  return jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=NamedSharding(mesh, a.sharding.spec)
    ),
    abstract,
  )


@pytest.mark.invariant
def test_nnx_eval_shape_target_restores_bit_for_bit(tmp_path):
  """Built under a (2, 2) mesh, saved, restored onto (1, 4) bit for bit."""
  axes = (AxisType.Auto,) * 2
  mesh = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=axes)
  other = jax.make_mesh((1, 4), ("data", "fsdp"), axis_types=axes)
  x = _x()

  @nnx.jit
  def build_and_step(x):
    pairs = [_make(*c) for c in CKPT_CASES]
    for model, opt in pairs:
      _nnx_step(model, opt, x)
    return pairs

  with jax.set_mesh(mesh):
    pairs = build_and_step(x)
  kernel = nnx.as_pure(nnx.state(pairs[1][1]))["opt_state"]["remainder"]
  assert tuple(kernel["l"]["kernel"].sharding.spec) == ("fsdp",)
  saved = [nnx.state(pair) for pair in pairs]
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", saved)
  checkpointer.wait_until_finished()
  with jax.set_mesh(other):
    abstract = [nnx.eval_shape(lambda c=c: _make(*c)) for c in CKPT_CASES]
  target = _on(other, [nnx.state(pair) for pair in abstract])
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  for case, pair, got, want in zip(CKPT_CASES, abstract, restored, saved):
    for leaf in jax.tree.leaves(got):
      assert leaf.sharding.mesh == other, case
    _assert_same(nnx.as_pure(got), nnx.as_pure(want))
    nnx.update(pair, got)
  # The restored int8 optimizer steps on the new mesh.
  model, opt = abstract[1]
  with jax.set_mesh(other):
    nnx.jit(_nnx_step)(model, opt, x)
  assert int(nnx.as_pure(opt.opt_state).skipped_steps) == 0
  assert (
    type(opt.opt_state.inner_state[0].trace["l"]["kernel"]).__name__
    == "EncodedLeaf"
  )
