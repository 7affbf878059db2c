"""The "O1" preset is Apex's O1, and `jaxmp.initialize` patches a forward.

O1 leaves the model fp32 and runs its forward under `jaxmp.autocast`
(float16 products); the other presets keep their hand-cast meaning and get
Apex's input/output casts (``patch_forward``).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import jaxmp
from _products import product_dtypes
from _products import products_of

F16, F32 = "float16", "float32"
U16 = 2.0**-11  # unit roundoff of float16


class _Net(nn.Module):
  """Dense, BatchNorm, Dense: written in fp32 or built in ``dtype``."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(16, dtype=self.dtype)(x)
    x = nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x)
    return nn.Dense(3, dtype=self.dtype)(nn.relu(x))


def _init(model, x):
  return model.init(jax.random.key(0), x, train=False)


def _x(shape=(8, 5), seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), F32)


def test_o1_preset_is_apex_o1():
  o1 = jaxmp.get_preset("O1")
  policy = o1.policy
  # fp32 params and model; the half precision comes from autocast.
  assert [
    np.dtype(d).name
    for d in (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
  ] == [F32, F32, F32]
  assert np.dtype(o1.autocast) == np.float16
  assert isinstance(o1.loss_scale, jmp.DynamicLossScale)
  assert float(o1.loss_scale.loss_scale) == 2.0**15
  assert o1.master_weights is False  # fp32 params need no masters
  assert "autocast" in o1.description
  # Every other preset keeps its hand-cast meaning.
  for name, preset in jaxmp.PRESETS.items():
    if name != "O1":
      assert preset.autocast is None, name
  assert jaxmp.get_preset("p=f32,c=f16,o=f32").autocast is None


def test_initialize_without_apply_fn_returns_params_and_optimizer():
  variables = _init(_Net(), _x())
  out = jaxmp.initialize(variables["params"], optax.sgd(0.1), "O1")
  assert isinstance(out, tuple) and len(out) == 2
  params, opt = out
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(F32)}
  assert isinstance(opt, optax.GradientTransformation)


def test_initialize_o1_runs_the_fp32_model_under_autocast():
  model, x = _Net(), _x()
  variables = _init(model, x)
  apply, params, opt = jaxmp.initialize(
    variables["params"], optax.sgd(0.1), "O1", apply_fn=model.apply
  )
  assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(F32)}
  v = {"params": params, "batch_stats": variables["batch_stats"]}
  fwd = functools.partial(apply, train=True, mutable=["batch_stats"])
  products = products_of(fwd, v, x)
  # Both Dense layers' matrix products run in fp16, on the fp32 model.
  assert len(products) == 2
  assert all(ins == (F16, F16) for _, ins, _ in products), products
  plain = products_of(
    functools.partial(model.apply, train=True, mutable=["batch_stats"]), v, x
  )
  assert all(ins == (F32, F32) for _, ins, _ in plain), plain

  logits, new = fwd(v, x)
  assert logits.dtype == jnp.float32  # output dtype of the policy
  # The BatchNorm statistics move and stay fp32 (not cast by the patch).
  stats = new["batch_stats"]["BatchNorm_0"]
  assert {s.dtype for s in jax.tree.leaves(stats)} == {jnp.dtype(F32)}
  assert bool(jnp.any(stats["mean"] != 0))

  # The fp32 forward by hand, and a first-order bound of autocast's error.
  # A product rounds both operands and its output to fp16: at most 3u
  # relative to sum |a||b| (fp32 accumulation: K * 2**-24, negligible).
  p = params
  h = x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
  mu, var = jnp.mean(h, 0), jnp.mean(h * h, 0) - jnp.mean(h, 0) ** 2
  sigma = jnp.sqrt(var + 1e-5)
  z = (h - mu) / sigma * p["BatchNorm_0"]["scale"] + p["BatchNorm_0"]["bias"]
  r = jax.nn.relu(z)
  w2 = p["Dense_1"]["kernel"]
  want = r @ w2 + p["Dense_1"]["bias"]
  np.testing.assert_allclose(
    want,
    model.apply(v, x, train=True, mutable=["batch_stats"])[0],
    rtol=1e-5,
    atol=1e-5,
  )
  e1 = 3 * U16 * jnp.max(jnp.abs(x) @ jnp.abs(p["Dense_0"]["kernel"]))
  # BatchNorm (unit scale at init): the mean and the std move by <= e1 each,
  # so z moves by <= e1 (2 + |z|) / sigma; relu is 1-Lipschitz.
  dr = e1 * (2 + jnp.max(jnp.abs(z))) / jnp.min(sigma)
  bound = dr * jnp.sum(jnp.abs(w2), 0) + 3 * U16 * (jnp.abs(r) @ jnp.abs(w2))
  err = jnp.abs(logits - want)
  # 2x headroom for the second-order terms (O(u**2)).
  np.testing.assert_array_less(err, 2 * bound)
  assert float(jnp.max(err)) > 0  # It did compute in half.
  # Running statistics (momentum 0.99): mean(h) moves by <= e1 and
  # mean(h*h) - mean(h)**2 by <= 4 max|h| e1 + 2 e1**2.
  np.testing.assert_allclose(stats["mean"], 0.01 * mu, rtol=0, atol=0.02 * e1)
  dvar = 4 * jnp.max(jnp.abs(h)) * e1 + 2 * e1**2
  np.testing.assert_allclose(
    stats["var"], 0.99 + 0.01 * var, rtol=0, atol=float(0.02 * dvar)
  )


def test_initialize_o1_gradients_are_fp32_and_training_converges():
  model, x = _Net(), _x((16, 5))
  y = jnp.asarray(np.arange(16) % 3)
  variables = _init(model, x)
  apply, params, opt = jaxmp.initialize(
    variables["params"],
    optax.sgd(0.1, momentum=0.9),
    "O1",
    apply_fn=model.apply,
  )
  state = {"p": params, "s": variables["batch_stats"], "o": opt.init(params)}

  @jax.jit
  def step(state):
    def loss_fn(p):
      logits, new = apply(
        {"params": p, "batch_stats": state["s"]}, x, mutable=["batch_stats"]
      )
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return jaxmp.scale_loss(loss, state["o"]), (loss, new["batch_stats"])

    grads, (loss, stats) = jax.grad(loss_fn, has_aux=True)(state["p"])
    updates, o = opt.update(grads, state["o"], state["p"])
    return (
      {"p": optax.apply_updates(state["p"], updates), "s": stats, "o": o},
      loss,
      grads,
    )

  losses = []
  for _ in range(30):
    state, loss, grads = step(state)
    losses.append(float(loss))
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(F32)}
  assert int(jaxmp.stats(state["o"])["skipped_steps"]) == 0
  assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("name,output", [("O2", F32), ("O3", F16)])
def test_initialize_hand_cast_presets_cast_inputs_and_output(name, output):
  policy = jaxmp.get_policy(name)
  model, x = _Net(dtype=policy.compute_dtype), _x()
  variables = _init(model, x)
  apply, params, _ = jaxmp.initialize(
    variables["params"], optax.sgd(0.1), name, apply_fn=model.apply
  )
  v = {"params": params, "batch_stats": variables["batch_stats"]}
  logits, new = apply(v, x, train=True, mutable=["batch_stats"])
  assert logits.dtype == jnp.dtype(output)
  # Only the model's output is cast: the statistics keep their dtype.
  assert jax.tree.map(lambda a: a.dtype, new["batch_stats"]) == jax.tree.map(
    lambda a: a.dtype, variables["batch_stats"]
  )
  # Eval mode (no mutable): the whole output is the logits.
  assert apply(v, x, train=False).dtype == jnp.dtype(output)
  # Apex's input caster: floating inputs (positional and keyword) arrive
  # in fp16; integer inputs and Python flags pass through unchanged, and
  # the variables (first argument) are left as they are.
  seen = {}

  def spy(v, images, tokens, *, mask, flag=None):
    seen.update(
      w=v["params"]["Dense_0"]["kernel"].dtype,
      images=images.dtype,
      tokens=tokens.dtype,
      mask=mask.dtype,
      flag=flag,
    )
    return jnp.zeros(2, jnp.float32)

  patched, _, _ = jaxmp.initialize(params, optax.sgd(0.1), name, apply_fn=spy)
  out = patched(v, x, jnp.arange(3), mask=jnp.ones(3, F32), flag=True)
  assert out.dtype == jnp.dtype(output)
  assert seen == {
    "w": jnp.dtype(F16),
    "images": jnp.dtype(F16),
    "tokens": jnp.dtype("int32"),
    "mask": jnp.dtype(F16),
    "flag": True,
  }


def test_initialize_o0_forward_is_numerically_the_model():
  model, x = _Net(), _x()
  variables = _init(model, x)
  apply, params, _ = jaxmp.initialize(
    variables["params"], optax.sgd(0.1), "O0", apply_fn=model.apply
  )
  v = {"params": params, "batch_stats": variables["batch_stats"]}
  np.testing.assert_array_equal(
    apply(v, x, train=False), model.apply(v, x, train=False)
  )


def test_initialize_rejects_a_non_callable_apply_fn():
  with pytest.raises(TypeError, match="apply_fn must be"):
    jaxmp.initialize({"w": jnp.ones(2)}, optax.sgd(0.1), "O1", apply_fn=3)


def test_product_dtypes_reads_nested_jaxprs():
  # The helper itself: products inside jit and scan are found.
  def f(w, x):
    inner = jax.jit(lambda a: a @ w)
    y, _ = jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=2)
    return inner(y)

  w = jnp.ones((3, 3), jnp.float16)
  found = product_dtypes(jax.make_jaxpr(f)(w, jnp.ones((2, 3), jnp.float16)))
  assert [p for p, _, _ in found] == ["dot_general"] * 2
  assert all(ins == (F16, F16) for _, ins, _ in found)
