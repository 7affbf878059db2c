"""The train step per policy, the eval step and the state fingerprints.

The net is the app's ResNet cut to one stage of one block
(``stage_sizes=(1,)``) on 8x8 images: every kind of layer and leaf the app's
step handles (conv, BatchNorm, dense; masters, momentum, Kahan terms), at a
fraction of ResNet18's compile time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from _products import primitive_names
from _products import product_dtypes
from cifar_train import mesh
from cifar_train import settings
from cifar_train import steps

POLICIES = ("O0", "O1", "O2", "O3", "bf16", "bf16-kahan")
IMAGE = (8, 8, 3)


def _setup(make_config, data_dir, **overrides):
  s = settings.resolve(make_config(data_dir, **overrides))
  model = steps.create_model(
    s.model, num_classes=10, num_filters=s.num_filters, precision=s.precision
  ).clone(stage_sizes=(1,))
  optimizer = steps.create_optimizer(
    s.precision, 0.05, momentum=0.9, weight_decay=5e-4
  )
  state = steps.create_train_state(model, optimizer, IMAGE, seed=0)
  return s, model, optimizer, state


def _batch():
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.standard_normal((4,) + IMAGE), jnp.float32)
  return images, jnp.asarray([0, 1, 2, 3])


def test_init_never_raises_the_optimisation_level_of_xla_flags(monkeypatch):
  """Level 1 on CPU, or the lower level ``XLA_FLAGS`` asks (its last wins)."""
  level = lambda: steps.init_compiler_options()[
    "xla_backend_optimization_level"
  ]
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  assert level() == 1
  for flags, want in (
    ("--xla_backend_optimization_level=0", 0),
    (
      "--xla_force_host_platform_device_count=4 "
      "--xla_backend_optimization_level=0 --foo=1",
      0,
    ),
    ("--xla_backend_optimization_level=3", 1),
    (
      "--xla_backend_optimization_level=0 --xla_backend_optimization_level=2",
      1,
    ),
    ("--xla_llvm_disable_expensive_passes=true", 1),
  ):
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert level() == want, flags


def test_one_train_step_per_policy(make_config, data_dir):
  # 2**15 overflows the fp16 gradients of this tiny net on its first step,
  # which dynamic scaling would then handle by skipping; start lower here.
  setups = {
    p: _setup(make_config, data_dir, policy=p, init_loss_scale=2.0**8)
    for p in POLICIES
  }
  for p, (s, _, _, state) in setups.items():
    kernel = state.params["conv1"]["kernel"]
    assert kernel.dtype == s.precision.param_dtype, p
    # Running statistics always stay fp32; BatchNorm params follow the preset.
    assert {x.dtype for x in jax.tree.leaves(state.batch_stats)} == {
      jnp.dtype(jnp.float32)
    }, p
    assert state.params["bn1"]["scale"].dtype == s.precision.norm_dtype, p
  train_steps = {
    p: steps.make_train_step(
      model, optimizer, compute_dtype=s.precision.compute_dtype
    )
    for p, (s, model, optimizer, _) in setups.items()
  }

  # One program for the six steps: compiled once, run twice.
  @jax.jit
  def step_all(states, images, labels):
    return {
      p: train_steps[p](states[p], images, labels, steps.zero_metrics())
      for p in POLICIES
    }

  images, labels = _batch()
  first = step_all({p: setups[p][3] for p in POLICIES}, images, labels)
  # NaN in the data: the step is skipped and BatchNorm stats roll back.
  second = step_all(
    {p: first[p][0] for p in POLICIES},
    images.at[0, 0, 0, 0].set(jnp.nan),
    labels,
  )
  assert step_all._cache_size() == 1  # pylint: disable=protected-access

  for p in POLICIES:
    s, _, _, state = setups[p]
    new, metrics = first[p]
    assert int(new.step) == 1 and int(metrics["count"]) == 4, p
    assert bool(jaxmp.stats(new.opt_state)["step_applied"]), p
    changed = jax.tree.map(
      lambda a, b: bool(jnp.any(a != b)), state.params, new.params
    )
    assert all(jax.tree.leaves(changed)), p
    if s.precision.master_weights:
      kernel = state.params["conv1"]["kernel"]
      masters = jaxmp.master_params(new.opt_state, new.params)
      np.testing.assert_array_equal(
        masters["conv1"]["kernel"].astype(kernel.dtype),
        new.params["conv1"]["kernel"],
      )
    bad, bad_metrics = second[p]
    before, after = jaxmp.stats(new.opt_state), jaxmp.stats(bad.opt_state)
    assert not bool(after["step_applied"]), p
    assert np.isnan(float(bad_metrics["last_loss"])), p
    # The loss goes to the optimizer: a NaN loss keeps the scale where it was.
    assert int(after["nonfinite_loss_steps"]) == 1, p
    assert float(after["loss_scale"]) == float(before["loss_scale"]), p
    for a, b in zip(
      jax.tree.leaves((new.params, new.batch_stats)),
      jax.tree.leaves((bad.params, bad.batch_stats)),
    ):
      np.testing.assert_array_equal(a, b, err_msg=p)


def test_eval_step_sums_on_the_device_and_skips_padding(make_config, data_dir):
  s, model, _, state = _setup(make_config, data_dir, policy="O0")
  eval_step = jax.jit(steps.make_eval_step(model, compute_dtype=jnp.float32))
  images, labels = _batch()
  mask = jnp.asarray([True, True, True, False])
  once = eval_step(state, images, labels, mask, steps.zero_eval_sums())
  twice = eval_step(state, images, labels, mask, once)
  logits = model.apply(
    {"params": state.params, "batch_stats": state.batch_stats},
    images,
    train=False,
  )
  losses = np.asarray(steps.cross_entropy(logits, labels))
  hits = np.asarray(jnp.argmax(logits, -1) == labels)
  assert int(once["count"]) == 3 and int(twice["count"]) == 6
  assert int(once["correct"]) == int(hits[:3].sum())
  assert int(twice["correct"]) == 2 * int(hits[:3].sum())
  # A sum of 3 positive fp32 terms, then that sum doubled: a few ulps.
  np.testing.assert_allclose(
    float(once["loss_sum"]), losses[:3].astype(np.float64).sum(), rtol=4e-7
  )
  assert float(twice["loss_sum"]) == 2 * float(once["loss_sum"])


def _bump(x, index=0):
  """``x`` with the lowest bit of element ``index`` flipped: a neighbour."""
  flat = np.array(x).reshape(-1)
  bits = flat.view(np.dtype(f"uint{8 * flat.dtype.itemsize}"))
  bits[index] ^= 1
  return jnp.asarray(flat.reshape(np.shape(x)), x.dtype)


def _change_where(tree, part: str):
  """``tree`` with one element of its first leaf under ``part`` bumped."""
  done = []

  def change(path, leaf):
    if not done and part in jax.tree_util.keystr(path):
      done.append(jax.tree_util.keystr(path))
      return _bump(leaf)
    return leaf

  out = jax.tree_util.tree_map_with_path(change, tree)
  assert done, part
  return out


@pytest.mark.parametrize("policy", ["O2", "bf16-kahan"])
def test_state_fingerprint_sees_every_part_of_the_state(
  policy, make_config, data_dir
):
  _, _, _, state = _setup(make_config, data_dir, policy=policy)
  mp_state = jaxmp.find_state(state.opt_state)
  ref = steps.state_fingerprint(state)
  assert steps.state_fingerprint(jax.tree.map(jnp.copy, state)) == ref
  opt = state.opt_state
  changes = {
    "step": state.replace(step=state.step + 1),
    "a param value": state.replace(
      params=_change_where(state.params, "['fc']['kernel']")
    ),
    "a batch_stats value": state.replace(
      batch_stats=_change_where(state.batch_stats, "var")
    ),
    "the momentum": state.replace(opt_state=_change_where(opt, ".trace")),
    "the rng": state.replace(rng=state.rng ^ 1),
    "the loss scale": state.replace(
      opt_state=mp_state._replace(loss_scale=mp_state.loss_scale * 2)
    ),
    "the growth counter": state.replace(
      opt_state=_change_where(opt, "growth_counter")
    ),
    "the skip count": state.replace(
      opt_state=mp_state._replace(skipped_steps=mp_state.skipped_steps + 1)
    ),
    # -0.0 == 0.0, but not in bits.
    "a signed zero": state.replace(
      params=jax.tree.map(
        lambda x: (
          jnp.where(x == 0, -0.0, x).astype(x.dtype) if x.ndim == 1 else x
        ),
        state.params,
      )
    ),
  }
  if policy == "O2":
    changes["a master"] = state.replace(
      opt_state=_change_where(opt, ".master_params")
    )
  else:
    changes["a Kahan term"] = state.replace(
      opt_state=_change_where(opt, ".compensation")
    )
  for name, changed in changes.items():
    assert jax.tree.structure(changed) == jax.tree.structure(state), name
    assert steps.state_fingerprint(changed) != ref, name
  # The params fingerprint is that of the fp32 masters (`master_params`).
  masters_changed = changes["a master" if policy == "O2" else "a param value"]
  assert steps.params_fingerprint(masters_changed) != (
    steps.params_fingerprint(state)
  )


def test_host_reads_and_fingerprints_take_every_shard():
  # The multi-process case (shards on other processes) is in
  # test_distributed.py; here the 4 devices of this process.
  devices = np.asarray(jax.devices())
  assert devices.size == 4, "tests/conftest.py forces 4 CPU devices"
  data = jax.sharding.NamedSharding(
    jax.sharding.Mesh(devices, ("data",)), jax.sharding.PartitionSpec("data")
  )
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  sharded = jax.device_put(x, data)
  assert sharded.addressable_data(0).shape == (2, 4)
  np.testing.assert_array_equal(mesh.to_host({"x": sharded})["x"], x)

  def fingerprint(w):
    return steps.state_fingerprint(
      steps.TrainState(
        step=np.int32(0),
        params={"w": w},
        batch_stats={},
        opt_state={},
        rng=np.zeros(2, np.uint32),
      )
    )

  assert fingerprint(sharded) == fingerprint(x)
  last_rows = x.copy()
  last_rows[7, 3] += 1  # On the last device only.
  assert fingerprint(jax.device_put(last_rows, data)) != fingerprint(x)


@pytest.mark.parametrize("diagnostics", [False, True])
def test_o1_step_runs_the_fp32_model_under_autocast(
  diagnostics, make_config, data_dir
):
  # Apex O1: the model is built and kept in fp32; jaxmp.autocast runs its
  # convolutions and matrix products in fp16, forward and backward.
  s, model, optimizer, state = _setup(
    make_config, data_dir, policy="O1", diagnostics=diagnostics
  )
  p = s.precision
  assert jnp.dtype(p.autocast) == jnp.float16
  assert model.dtype == jnp.float32 and p.compute_dtype == jnp.float32
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {
    jnp.dtype(jnp.float32)
  }
  step = steps.make_train_step(model, optimizer, compute_dtype=p.compute_dtype)
  images = jnp.zeros((4,) + IMAGE, jnp.float32)
  labels = jnp.zeros((4,), jnp.int32)
  jaxpr = jax.make_jaxpr(step)(state, images, labels, steps.zero_metrics())
  products = product_dtypes(jaxpr)
  convs = [ins for prim, ins, _ in products if prim == "conv_general_dilated"]
  dots = [ins for prim, ins, _ in products if prim == "dot_general"]
  # Every forward convolution, its kernel gradient and (but for the stem's)
  # its input gradient.
  eval_sums = steps.zero_eval_sums()
  forward = product_dtypes(
    jax.make_jaxpr(steps.make_eval_step(model, compute_dtype=p.compute_dtype))(
      state, images, labels, jnp.ones((4,), bool), eval_sums
    )
  )
  n_convs = sum(prim == "conv_general_dilated" for prim, _, _ in forward)
  assert n_convs >= 3, forward
  assert len(convs) >= 3 * n_convs - 1, (len(convs), n_convs)
  assert dots, products
  assert all(ins == ("float16", "float16") for ins in convs + dots), products
  # The eval step too.
  eval_jaxpr = jax.make_jaxpr(
    steps.make_eval_step(model, compute_dtype=p.compute_dtype)
  )(state, images, labels, jnp.ones((4,), bool), steps.zero_eval_sums())
  assert {ins for _, ins, _ in product_dtypes(eval_jaxpr)} == {
    ("float16", "float16")
  }
  # --config.diagnostics=True turns on autocast's debug report: one host
  # callback per call; off, the step has none.
  assert ("debug_callback" in primitive_names(jaxpr)) == diagnostics
