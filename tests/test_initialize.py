"""Tests of the presets' loss scales and `jaxmp.initialize` on a Flax model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import jaxmp

F32, F16 = np.dtype("float32"), np.dtype("float16")
BF16 = np.dtype(jnp.bfloat16)

# (param dtype of Dense layers, of BatchNorm, loss-scale kind, initial scale,
# masters) per preset: Apex's cast_model_type, keep_batchnorm_fp32,
# loss_scale and master_weights.
EXPECTED = {
  "O0": (F32, F32, "static", 1.0, False),
  "O1": (F32, F32, "dynamic", 2.0**15, False),
  "O2": (F16, F32, "dynamic", 2.0**15, True),
  "O3": (F16, F16, "static", 1.0, False),
  "bf16": (F32, F32, "noop", 1.0, False),
  "bf16-kahan": (BF16, F32, "noop", 1.0, "kahan"),
  "bf16-stochastic": (BF16, F32, "noop", 1.0, "stochastic"),
}


class _Net(nn.Module):
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(8, dtype=self.dtype)(x)
    x = nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x)
    return nn.Dense(3, dtype=self.dtype)(nn.relu(x))


def _variables():
  x = jnp.ones((4, 5))
  return _Net().init(jax.random.key(0), x, train=False)


def _dtypes(params):
  return {
    layer: {np.dtype(v.dtype) for v in jax.tree.leaves(p)}
    for layer, p in params.items()
  }


class TestPresetLossScale:
  @pytest.mark.parametrize("name", sorted(EXPECTED))
  def test_is_a_jmp_object_mixed_precision_accepts(self, name):
    preset = jaxmp.get_preset(name)
    _, _, kind, scale, _ = EXPECTED[name]
    expected_type = {
      "static": jmp.StaticLossScale,
      "dynamic": jmp.DynamicLossScale,
      "noop": jmp.NoOpLossScale,
    }[kind]
    assert type(preset.loss_scale) is expected_type
    opt = jaxmp.mixed_precision(optax.sgd(0.1), loss_scale=preset.loss_scale)
    state = opt.init({"w": jnp.ones(2)})
    assert state.config.kind == kind
    assert float(state.loss_scale) == scale

  @pytest.mark.parametrize(
    "spec,kind",
    [
      ("p=f32,c=f16,o=f32", "dynamic"),
      ("p=f16,c=f16,o=f16", "dynamic"),
      ("p=f32,c=bf16,o=f32", "noop"),
      ("p=f32,c=f32,o=f32", "noop"),
    ],
  )
  def test_policy_strings(self, spec, kind):
    state = jaxmp.mixed_precision(
      optax.sgd(0.1), loss_scale=jaxmp.get_preset(spec).loss_scale
    ).init({"w": jnp.ones(2)})
    assert state.config.kind == kind


class TestInitialize:
  @pytest.mark.parametrize("name", sorted(EXPECTED))
  def test_param_dtypes_and_loss_scale_per_preset(self, name):
    dense, norm, kind, scale, masters = EXPECTED[name]
    params, opt = jaxmp.initialize(_variables()["params"], optax.sgd(0.1), name)
    assert _dtypes(params) == {
      "Dense_0": {dense},
      "BatchNorm_0": {norm},
      "Dense_1": {dense},
    }
    state = opt.init(params)
    assert state.config.kind == kind
    assert float(jaxmp.stats(state)["loss_scale"]) == scale
    has = lambda tree: any(
      x is not None for x in jax.tree.leaves(tree, is_leaf=lambda x: x is None)
    )
    assert has(state.master_params) == (masters is True)
    assert has(state.compensation) == (masters == "kahan")
    assert (state.rounding_key is not None) == (masters == "stochastic")

  def test_keep_fp32_predicate_and_overrides(self):
    params, opt = jaxmp.initialize(
      _variables()["params"],
      optax.sgd(0.1),
      "O2",
      keep_fp32=lambda path: path[0] == "Dense_1",
      loss_scale=jmp.StaticLossScale(np.float32(4.0)),
      master_weights=False,
    )
    assert _dtypes(params) == {
      "Dense_0": {F16},
      "BatchNorm_0": {F16},
      "Dense_1": {F32},
    }
    state = opt.init(params)
    assert state.config.kind == "static"
    assert float(state.loss_scale) == 4.0
    assert all(m is None for m in jax.tree.leaves(state.master_params))

  def test_default_selects_norm_layers_only(self):
    tree = {
      "bn1": 1.0,
      "downsample_bn": 1.0,
      "LayerNorm_0": 1.0,
      "subnet": 1.0,
      "conv1": 1.0,
      "layers": [{"norm": 1.0}, {"dense": 1.0}],
      "step": np.int32(3),
    }
    params, _ = jaxmp.initialize(
      jax.tree.map(jnp.asarray, tree), optax.sgd(0.1), "O2"
    )
    got = jax.tree.map(lambda x: np.dtype(x.dtype).name, params)
    assert got == {
      "bn1": "float32",
      "downsample_bn": "float32",
      "LayerNorm_0": "float32",
      "subnet": "float16",
      "conv1": "float16",
      "layers": [{"norm": "float32"}, {"dense": "float16"}],
      "step": "int32",
    }

  @pytest.mark.invariant
  @pytest.mark.parametrize("name", ["O1", "O2", "O3"])
  def test_training_matches_mixed_precision_by_hand_bitwise(self, name):
    preset = jaxmp.get_preset(name)
    compute = preset.policy.compute_dtype
    model = _Net(dtype=compute)
    variables = _variables()
    inner = optax.sgd(0.1, momentum=0.9)
    params, opt = jaxmp.initialize(variables["params"], inner, name)

    # By hand: Apex's rules spelled out.
    def by_hand(path, x):
      bn = path[0].key.startswith("BatchNorm")
      keep = preset.keep_batchnorm_fp32 and bn
      return x.astype(jnp.float32 if keep else preset.policy.param_dtype)

    hand_params = jax.tree_util.tree_map_with_path(by_hand, variables["params"])
    scale = (
      jmp.StaticLossScale(np.float32(1.0))
      if name == "O3"
      else jmp.DynamicLossScale(np.float32(2.0**15))
    )
    hand_opt = jaxmp.mixed_precision(
      inner, loss_scale=scale, master_weights=name == "O2"
    )

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 4, 5)), compute)
    y = jnp.asarray(rng.integers(0, 3, (6, 4)))

    def run(opt, params):
      state = {"p": params, "s": variables["batch_stats"]}
      state["o"] = opt.init(params)

      @jax.jit
      def step(state, x, y):
        def loss_fn(p):
          logits, new = model.apply(
            {"params": p, "batch_stats": state["s"]},
            x,
            train=True,
            mutable=["batch_stats"],
          )
          loss = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), y
          ).mean()
          return jaxmp.scale_loss(loss, state["o"]), new["batch_stats"]

        grads, stats = jax.grad(loss_fn, has_aux=True)(state["p"])
        updates, o = opt.update(grads, state["o"], state["p"])
        stats = jaxmp.rollback_if_skipped(o, stats, state["s"])
        return {
          "p": optax.apply_updates(state["p"], updates),
          "s": stats,
          "o": o,
        }

      for t in range(len(x)):
        state = step(state, x[t], y[t])
      return state

    got, want = run(opt, params), run(hand_opt, hand_params)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(
        np.asarray(a).view(f"u{a.dtype.itemsize}"),
        np.asarray(b).view(f"u{b.dtype.itemsize}"),
      )
    # The run did train: the params moved.
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), got["p"], params)
    assert all(jax.tree.leaves(moved))
