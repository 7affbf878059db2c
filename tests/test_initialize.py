"""Tests of the presets' loss scales and `jaxmp.initialize` on a Flax model."""

import dataclasses

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
  @pytest.mark.parametrize("name", ["O1-hand-cast", "O2", "O3"])
  def test_training_matches_mixed_precision_by_hand_bitwise(self, name):
    if name == "O1-hand-cast":
      # O1 is the fp32 model under jaxmp.autocast now (tests/test_o1.py);
      # here its transform with the model cast to fp16 by hand, as O1 was:
      # fp32 params, no masters, dynamic scaling from 2^15.
      preset = dataclasses.replace(
        jaxmp.get_preset("O1"),
        policy=jmp.get_policy("p=f32,c=f16,o=f32"),
        autocast=None,
      )
    else:
      preset = jaxmp.get_preset(name)
    compute = preset.policy.compute_dtype
    model = _Net(dtype=compute)
    variables = _variables()
    inner = optax.sgd(0.1, momentum=0.9)
    params, opt = jaxmp.initialize(variables["params"], inner, preset)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 4, 5)), compute)
    y = jnp.asarray(rng.integers(0, 3, (6, 4)))

    def loss_of(p, stats, x, y):
      logits, new = model.apply(
        {"params": p, "batch_stats": stats},
        x,
        train=True,
        mutable=["batch_stats"],
      )
      loss = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), y
      ).mean()
      return loss, new["batch_stats"]

    def run(opt, params):
      state = {"p": params, "s": variables["batch_stats"]}
      state["o"] = opt.init(params)

      @jax.jit
      def step(state, x, y):
        def loss_fn(p):
          loss, stats = loss_of(p, state["s"], x, y)
          return jaxmp.scale_loss(loss, state["o"]), stats

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

    # By hand, plain optax: Apex's rules spelled out. Params cast (BatchNorm
    # kept fp32 where the preset says so), fp32 masters of the fp16 params
    # under O2, the loss times the scale, gradients to fp32 times 1/scale
    # (exact: a power of two), a step skipped (params, masters, momentum and
    # BatchNorm statistics kept) when a gradient is inf/NaN. Dynamic scales
    # start at 2^15 and halve on an overflow; they grow after 2000 finite
    # steps (Apex's and jmp's period), not within these 6.
    def by_hand(path, x):
      bn = path[0].key.startswith("BatchNorm")
      keep = preset.keep_batchnorm_fp32 and bn
      return x.astype(jnp.float32 if keep else preset.policy.param_dtype)

    dynamic = name != "O3"
    if dynamic:
      assert preset.loss_scale.period == 2000
    hand_params = jax.tree_util.tree_map_with_path(by_hand, variables["params"])
    with_masters = name == "O2"
    hand_masters = jax.tree.map(
      lambda p: p.astype(jnp.float32) if with_masters else None, hand_params
    )
    fp32_view = lambda p, m: p.astype(jnp.float32) if m is None else m

    @jax.jit
    def hand_step(h, x, y):
      def scaled_loss(p):
        loss, stats = loss_of(p, h["s"], x, y)
        return loss * h["scale"], stats

      grads, stats = jax.grad(scaled_loss, has_aux=True)(h["p"])
      finite = jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
      )
      grads = jax.tree.map(
        lambda g: g.astype(jnp.float32) * (1.0 / h["scale"]), grads
      )
      full = jax.tree.map(fp32_view, h["p"], h["m"])
      updates, inner_state = inner.update(grads, h["o"], full)
      new_full = jax.tree.map(lambda f, u: f + u, full, updates)
      keep = lambda new, old: jnp.where(finite, new, old)
      return {
        "p": jax.tree.map(
          lambda p, f: keep(f.astype(p.dtype), p), h["p"], new_full
        ),
        "m": jax.tree.map(
          lambda m, f: None if m is None else keep(f, m),
          h["m"],
          new_full,
          is_leaf=lambda m: m is None,
        ),
        "o": jax.tree.map(keep, inner_state, h["o"]),
        "s": jax.tree.map(keep, stats, h["s"]),
        "scale": h["scale"]
        if not dynamic
        else jnp.where(finite, h["scale"], jnp.maximum(h["scale"] / 2, 1.0)),
        "skipped": h["skipped"] + (~finite).astype(jnp.int32),
      }

    hand = {
      "p": hand_params,
      "m": hand_masters,
      "o": inner.init(jax.tree.map(fp32_view, hand_params, hand_masters)),
      "s": variables["batch_stats"],
      "scale": jnp.float32(2.0**15 if dynamic else 1.0),
      "skipped": jnp.int32(0),
    }
    # Both run eagerly, one operation at a time, as Apex's PyTorch does:
    # every operation rounds its own result. Under jit, XLA may fuse a
    # multiply and an add into one multiply-add (one rounding) in one program
    # and not at the same place in the other: jax 0.11.2 does so here, in one
    # element of one leaf after six steps. That is the compiler's choice, not
    # a rule of the transform, so the rules are compared without it.
    with jax.disable_jit():
      for t in range(len(x)):
        hand = hand_step(hand, x[t], y[t])
      got = run(opt, params)
    state = jaxmp.find_state(got["o"])
    pairs = [
      (got["p"], hand["p"]),
      (got["s"], hand["s"]),
      (state.inner_state, hand["o"]),
      (
        jaxmp.master_params(got["o"], got["p"]),
        jax.tree.map(fp32_view, hand["p"], hand["m"]),
      ),
      (state.loss_scale, hand["scale"]),
      (state.skipped_steps, hand["skipped"]),
    ]
    for a_tree, b_tree in pairs:
      assert jax.tree.structure(a_tree) == jax.tree.structure(b_tree)
      for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(
          np.asarray(a).view(f"u{a.dtype.itemsize}"),
          np.asarray(b).view(f"u{b.dtype.itemsize}"),
        )
    # The run did train: the params moved.
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), got["p"], params)
    assert all(jax.tree.leaves(moved))
