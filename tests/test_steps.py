"""The train step per policy, the eval step and the state fingerprints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from _products import primitive_names
from _products import product_dtypes
from cifar_train import settings
from cifar_train import steps


def _setup(make_config, data_dir, **overrides):
  s = settings.resolve(make_config(data_dir, **overrides))
  model = steps.create_model(
    s.model, num_classes=10, num_filters=s.num_filters, precision=s.precision
  )
  optimizer = steps.create_optimizer(
    s.precision, 0.05, momentum=0.9, weight_decay=5e-4
  )
  state = steps.create_train_state(model, optimizer, (16, 16, 3), seed=0)
  return s, model, optimizer, state


@pytest.mark.parametrize(
  "policy", ["O0", "O1", "O2", "O3", "bf16", "bf16-kahan"]
)
def test_one_train_step_per_policy(policy, make_config, data_dir):
  # 2**15 overflows the fp16 gradients of this tiny net on its first step,
  # which dynamic scaling would then handle by skipping; start lower here.
  s, model, optimizer, state = _setup(
    make_config, data_dir, policy=policy, init_loss_scale=2.0**8
  )
  p = s.precision
  kernel = state.params["conv1"]["kernel"]
  assert kernel.dtype == p.param_dtype
  # Running statistics always stay fp32; BatchNorm params follow the preset.
  assert {x.dtype for x in jax.tree.leaves(state.batch_stats)} == {
    jnp.dtype(jnp.float32)
  }
  assert state.params["bn1"]["scale"].dtype == p.norm_dtype
  step = jax.jit(
    steps.make_train_step(model, optimizer, compute_dtype=p.compute_dtype)
  )
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.standard_normal((4, 16, 16, 3)), jnp.float32)
  labels = jnp.asarray([0, 1, 2, 3])
  new, metrics = step(state, images, labels, steps.zero_metrics())
  assert int(new.step) == 1 and int(metrics["count"]) == 4
  assert np.isfinite(float(metrics["last_loss"]))
  assert bool(jaxmp.stats(new.opt_state)["step_applied"])
  changed = jax.tree.map(
    lambda a, b: bool(jnp.any(a != b)), state.params, new.params
  )
  assert all(jax.tree.leaves(changed))
  if p.master_weights:
    masters = jaxmp.master_params(new.opt_state, new.params)
    np.testing.assert_array_equal(
      masters["conv1"]["kernel"].astype(kernel.dtype),
      new.params["conv1"]["kernel"],
    )
  # NaN in the data: the step is skipped and BatchNorm stats roll back.
  bad, _ = step(
    new, images.at[0, 0, 0, 0].set(jnp.nan), labels, steps.zero_metrics()
  )
  before, after = jaxmp.stats(new.opt_state), jaxmp.stats(bad.opt_state)
  assert not bool(after["step_applied"])
  # The loss goes to the optimizer: a NaN loss keeps the scale where it was.
  assert int(after["nonfinite_loss_steps"]) == 1
  assert float(after["loss_scale"]) == float(before["loss_scale"])
  for a, b in zip(
    jax.tree.leaves((new.params, new.batch_stats)),
    jax.tree.leaves((bad.params, bad.batch_stats)),
  ):
    np.testing.assert_array_equal(a, b)


def test_state_fingerprint_sees_every_part_of_the_state(make_config, data_dir):
  _, _, _, state = _setup(make_config, data_dir, policy="O2")
  ref = steps.state_fingerprint(state)
  assert steps.state_fingerprint(state) == ref
  mp_state = jaxmp.find_state(state.opt_state)
  changes = {
    "step": state.replace(step=state.step + 1),
    "batch_stats": state.replace(
      batch_stats=jax.tree.map(lambda x: x.at[0].add(1e-7), state.batch_stats)
    ),
    "rng": state.replace(rng=state.rng ^ 1),
    "loss_scale": state.replace(
      opt_state=mp_state._replace(loss_scale=mp_state.loss_scale * 2)
    ),
    "skips": state.replace(
      opt_state=mp_state._replace(skipped_steps=mp_state.skipped_steps + 1)
    ),
    # -0.0 == 0.0, but not in bits.
    "signed zero": state.replace(
      params=jax.tree.map(
        lambda x: (
          jnp.where(x == 0, -0.0, x).astype(x.dtype)
          if x.ndim == 1 and x.dtype == jnp.float32
          else x
        ),
        state.params,
      )
    ),
  }
  for name, changed in changes.items():
    assert steps.state_fingerprint(changed) != ref, name


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
  images = jnp.zeros((4, 16, 16, 3), jnp.float32)
  labels = jnp.zeros((4,), jnp.int32)
  jaxpr = jax.make_jaxpr(step)(state, images, labels, steps.zero_metrics())
  products = product_dtypes(jaxpr)
  convs = [ins for prim, ins, _ in products if prim == "conv_general_dilated"]
  dots = [ins for prim, ins, _ in products if prim == "dot_general"]
  # 20 convolutions forward; their input and kernel gradients backward.
  assert len(convs) >= 3 * 20 - 1, len(convs)
  assert dots, products
  assert all(ins == ("float16", "float16") for ins in convs + dots), products
  # The eval step too.
  eval_jaxpr = jax.make_jaxpr(
    steps.make_eval_step(model, compute_dtype=p.compute_dtype)
  )(state, images, labels, jnp.ones((4,), bool))
  assert {ins for _, ins, _ in product_dtypes(eval_jaxpr)} == {
    ("float16", "float16")
  }
  # --config.diagnostics=True turns on autocast's debug report: one host
  # callback per call; off, the step has none.
  assert ("debug_callback" in primitive_names(jaxpr)) == diagnostics
