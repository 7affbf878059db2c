"""Tests for jaxmp.models (ResNet18, tiny shapes, CPU)."""

import functools

from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._src import resnet

f16, f32 = jnp.float16, jnp.float32


def _param_count(model, image_shape):
  variables = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros(image_shape), False)
  )
  return sum(x.size for x in jax.tree.leaves(variables["params"]))


def _small(**kwargs):
  """Two-stage ResNet (identity and projection blocks): compiles quickly."""
  kwargs.setdefault("num_filters", 8)
  return resnet.ResNet(stage_sizes=(1, 1), **kwargs)


def _init(model, x, seed=0):
  """Variables of ``model`` filled from NumPy (jax.random compiles slowly).

  Kernels ~ N(0, 1/fan_in), BatchNorm scale ~ 1 + N(0, 0.1^2), biases ~
  N(0, 0.1^2), batch_stats as initialised.
  """
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    name = path[-1].key
    if path[0].key == "batch_stats":
      value = np.full(leaf.shape, 0.0 if name == "mean" else 1.0)
    elif name == "kernel":
      fan_in = np.prod(leaf.shape[:-1])
      value = rng.normal(size=leaf.shape) / np.sqrt(fan_in)
    else:
      value = (name == "scale") + 0.1 * rng.normal(size=leaf.shape)
    return jnp.asarray(value, leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def _images(shape=(4, 8, 8, 3), seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), f32)


def _train_step_fn(model, loss_scale=1.0):
  """Jitted (loss, logits, new_batch_stats, grads) of a train step.

  Gradients are of ``loss * loss_scale``, returned unscaled in float32 (or
  float64): a static loss scale keeps float16 gradients of this tiny net from
  underflow.
  """

  def loss_fn(params, batch_stats, x, labels):
    logits, updates = model.apply(
      {"params": params, "batch_stats": batch_stats},
      x,
      train=True,
      mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return loss.mean() * loss_scale, (logits, updates["batch_stats"])

  @jax.jit
  def step(variables, x, labels):
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, (logits, stats)), grads = grad_fn(
      variables["params"], variables["batch_stats"], x, labels
    )
    grads = jax.tree.map(
      lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)) / loss_scale,
      grads,
    )
    return loss, logits, stats, grads

  return step


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12)


def _float64_step(
  variables, x, labels, loss_scale=1.0, fused_norm=False, cpu_convs=False, **kw
):
  """`_train_step_fn`'s outputs in float64 (default: flax's BatchNorm, convs)."""
  kwargs = dict(
    kw,
    dtype=np.float64,
    param_dtype=np.float64,
    norm_dtype=np.float64,
    fused_norm=fused_norm,
    cpu_convs=cpu_convs,
  )
  with jax.enable_x64(True):
    v64 = jax.tree.map(lambda a: np.asarray(a, np.float64), variables)
    step = _train_step_fn(_small(**kwargs), loss_scale)
    return jax.device_get(step(v64, np.asarray(x, np.float64), labels))


def _errors(out, ref):
  """Per-tensor errors (`_rel_err`) of a step's outputs, by kind."""
  leaves = lambda i: zip(jax.tree.leaves(out[i]), jax.tree.leaves(ref[i]))
  return {
    "logits": [_rel_err(out[1], ref[1])],
    "batch_stats": [_rel_err(a, b) for a, b in leaves(2)],
    "grads": [_rel_err(a, b) for a, b in leaves(3)],
  }


def _assert_as_accurate(ours, theirs, ref, unit_roundoff, ours_unit=None):
  """``ours`` is within 16 times ``theirs``' rounding error of float64.

  Rounding error is the unit roundoff u times the computation's
  amplification (depth, sums, train-mode BatchNorm over few values), the same
  for every implementation of the same math; ``theirs`` (flax's ops, in the
  same dtype) measures it per kind of output: its worst error over the
  tensors of a kind, over u, at least 1. Another summation order (AVX2 or
  AVX-512) draws from the same distribution: 16 times the worst is a wide
  margin, and a wrong tensor (a transposed kernel, a missing term: errors of
  order 1) is far outside it. With ``ours_unit`` (``ours`` in another dtype,
  float64), the same amplification times that unit roundoff, with a margin
  of 64: both sides round there.
  """
  e_ours, e_theirs = _errors(ours, ref), _errors(theirs, ref)
  for kind, errs in e_ours.items():
    amplification = max(max(e_theirs[kind]) / unit_roundoff, 1.0)
    tol = 16 * amplification * unit_roundoff
    if ours_unit is not None:
      tol = 64 * amplification * ours_unit
    for i, e in enumerate(errs):
      assert e < tol, (kind, i, e, tol)


def _resnet18_param_count(stem_kernel, num_classes, f=64):
  """ResNet18's parameters by hand (torch's and the paper's layout).

  Convs ``k * k * in * out`` (no bias), BatchNorm a scale and a bias per
  channel, four stages of two basic blocks (two 3x3 convs and BatchNorms
  each; the first block of a stage that changes the width adds a 1x1
  projection conv and its BatchNorm), then ``fc`` (``in * out + out``).
  """
  n = stem_kernel**2 * 3 * f + 2 * f  # Stem conv and BatchNorm.
  c_in = f
  for i in range(4):
    c = f * 2**i
    n += 9 * c_in * c + 9 * c * c + 2 * 2 * c  # First block.
    if c_in != c:
      n += c_in * c + 2 * c  # Its projection shortcut.
    n += 2 * 9 * c * c + 2 * 2 * c  # Second block.
    c_in = c
  return n + c_in * num_classes + num_classes


class ParamCountTest(parameterized.TestCase):
  # The counts torchvision's resnet18 (11,689,512 with 1000 classes) and
  # kuangliu's CIFAR ResNet18 (11,173,962) report.
  @parameterized.named_parameters(
    ("cifar_10", "resnet18", 3, 10, 32, 11_173_962),
    ("torchvision_1000", "resnet18_torchvision", 7, 1000, 224, 11_689_512),
    ("torchvision_10", "resnet18_torchvision", 7, 10, 224, 11_181_642),
  )
  def test_param_count(self, name, stem_kernel, num_classes, size, expected):
    self.assertEqual(_resnet18_param_count(stem_kernel, num_classes), expected)
    model = resnet.get_model(name, num_classes=num_classes)
    self.assertEqual(_param_count(model, (1, size, size, 3)), expected)

  def test_fused_and_plain_have_same_variables(self):
    shapes = [
      jax.eval_shape(lambda m=m: m.init(jax.random.key(0), _images(), False))
      for m in (
        resnet.resnet18(num_filters=4, fused_norm=fused)
        for fused in (True, False)
      )
    ]
    self.assertEqual(
      jax.tree.structure(shapes[0]), jax.tree.structure(shapes[1])
    )

  def test_torchvision_layer_names(self):
    model = resnet.resnet18_torchvision(num_filters=4)
    variables = jax.eval_shape(
      lambda: model.init(jax.random.key(0), _images((1, 32, 32, 3)), False)
    )
    params = variables["params"]
    self.assertEqual(
      set(params),
      {"conv1", "bn1", "fc"}
      | {f"layer{i}_{j}" for i in range(1, 5) for j in range(2)},
    )
    self.assertIn("downsample_conv", params["layer2_0"])
    self.assertNotIn("downsample_conv", params["layer1_0"])
    self.assertEqual(params["conv1"]["kernel"].shape, (7, 7, 3, 4))
    self.assertEqual(set(variables["batch_stats"]["bn1"]), {"mean", "var"})


class ResNetTest(parameterized.TestCase):
  @parameterized.product(stem=("cifar", "imagenet"), dtype=(f32, f16))
  def test_output_shape_and_dtype(self, stem, dtype):
    model = _small(num_filters=4, num_classes=7, stem=stem, dtype=dtype)
    x = _images((4, 16, 16, 3))
    variables = _init(model, x)
    apply = jax.jit(
      functools.partial(model.apply, mutable=["batch_stats"]),
      static_argnames="train",
    )
    for train in (True, False):
      out = apply(variables, x, train=train)[0]
      self.assertEqual(out.shape, (4, 7))
      self.assertEqual(out.dtype, f32)

  def test_o2_dtypes(self):
    model = resnet.resnet18(
      num_filters=4, dtype=f16, param_dtype=f16, norm_dtype=f32
    )
    variables = jax.eval_shape(
      lambda: model.init(jax.random.key(0), _images(), train=False)
    )
    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    for path, leaf in flat:
      keys = [k.key for k in path]
      is_norm = keys[0] == "batch_stats" or any("bn" in k for k in keys)
      with self.subTest("/".join(keys)):
        self.assertEqual(leaf.dtype, f32 if is_norm else f16)
    logits = jax.eval_shape(
      lambda v: model.apply(v, _images(), train=True, mutable=["batch_stats"])[
        0
      ],
      variables,
    )
    self.assertEqual(logits.dtype, f32)

  @parameterized.parameters(True, False)
  def test_jit_train_step_without_axis_name(self, fused):
    model = _small(fused_norm=fused)
    self.assertIsNone(model.axis_name)
    x = _images()
    variables = _init(model, x)
    loss, _, stats, grads = _train_step_fn(model)(
      variables, x, jnp.arange(4) % 10
    )
    self.assertTrue(np.isfinite(loss))
    self.assertEqual(
      jax.tree.structure(stats),
      jax.tree.structure(variables["batch_stats"]),
    )
    self.assertFalse(  # Running statistics moved.
      np.allclose(stats["bn1"]["mean"], variables["batch_stats"]["bn1"]["mean"])
    )
    self.assertEqual(
      jax.tree.structure(grads), jax.tree.structure(variables["params"])
    )

  @parameterized.named_parameters(
    ("fp32", dict()),
    # float16 convs and activations: the fused path adds the residual in
    # float32 before rounding, plain flax in float16.
    ("o1", dict(dtype=f16)),
    ("o2", dict(dtype=f16, param_dtype=f16)),
    (
      "unbiased_var_imagenet",
      dict(unbiased_running_var=True, stem="imagenet"),
    ),
  )
  def test_fused_matches_plain_train(self, kwargs):
    x = _images()
    labels = jnp.arange(4) % 10
    fused = _small(fused_norm=True, **kwargs)
    plain = _small(fused_norm=False, **kwargs)
    variables = _init(fused, x, seed=1)
    out_f = _train_step_fn(fused, 1024.0)(variables, x, labels)
    out_p = _train_step_fn(plain, 1024.0)(variables, x, labels)
    for a, b in zip(jax.tree.leaves(out_f[2]), jax.tree.leaves(out_p[2])):
      self.assertEqual(a.dtype, b.dtype)
    ref = _float64_step(variables, x, labels, 1024.0, **kwargs)
    u = 2.0**-11 if kwargs.get("dtype") == f16 else 2.0**-24
    _assert_as_accurate(out_f, out_p, ref, u)
    if u == 2.0**-24:  # The fused math in float64 too: a far finer check.
      fused64 = _float64_step(
        variables, x, labels, 1024.0, fused_norm=True, cpu_convs=True, **kwargs
      )
      _assert_as_accurate(fused64, out_p, ref, u, ours_unit=2.0**-53)

  def test_unbiased_running_var(self):
    self.assertTrue(resnet.resnet18_torchvision().unbiased_running_var)
    self.assertFalse(resnet.resnet18().unbiased_running_var)
    x = _images()
    labels = jnp.arange(4) % 10
    stats = []
    for unbiased in (False, True):
      model = _small(unbiased_running_var=unbiased, bn_momentum=0.0)
      variables = _init(model, x, seed=1)
      stats.append(_train_step_fn(model)(variables, x, labels)[2])
    # With momentum 0 the stored variance is the batch variance: the ratio
    # is n / (n - 1), n = 4 images * 8 * 8 pixels for the stem's bn1.
    n = 4 * 8 * 8
    np.testing.assert_allclose(
      stats[1]["bn1"]["var"], stats[0]["bn1"]["var"] * n / (n - 1), rtol=1e-6
    )

  def test_fused_matches_plain_eval(self):
    x = _images()
    fused = _small(fused_norm=True)
    plain = _small(fused_norm=False)
    variables = _init(fused, x)
    # Non-trivial running statistics.
    variables = {
      "params": variables["params"],
      "batch_stats": _train_step_fn(fused)(variables, x, jnp.zeros(4, int))[2],
    }
    np.testing.assert_allclose(
      jax.jit(functools.partial(fused.apply, train=False))(variables, x),
      jax.jit(functools.partial(plain.apply, train=False))(variables, x),
      rtol=1e-5,
      atol=1e-5,
    )

  def test_torchvision_init_statistics(self):
    model = resnet.ResNet(
      stage_sizes=(1,),
      num_filters=32,
      num_classes=10,
      stem="imagenet",
      init_scheme="torchvision",
    )
    init = jax.jit(functools.partial(model.init, train=False))
    params = init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]
    conv = params["layer1_0"]["conv1"]["kernel"]  # 3x3x32x32, fan_out 288
    # The std of n = 9216 normal values: standard error sigma / sqrt(2n),
    # 0.74%; 5% is 6.8 standard errors.
    np.testing.assert_allclose(np.std(conv), np.sqrt(2 / 288), rtol=0.05)
    self.assertGreater(
      np.max(np.abs(conv)), 3 * np.sqrt(2 / 288)
    )  # Untruncated.
    bound = 1 / np.sqrt(32)
    for leaf in (params["fc"]["kernel"], params["fc"]["bias"]):
      self.assertLessEqual(np.max(np.abs(leaf)), bound)
      self.assertGreater(np.max(np.abs(leaf)), 0.5 * bound)
    np.testing.assert_array_equal(params["bn1"]["scale"], 1.0)
    np.testing.assert_array_equal(params["bn1"]["bias"], 0.0)

  def test_get_model_bad_name(self):
    with self.assertRaisesRegex(ValueError, "'resnet19'.*resnet18"):
      resnet.get_model("resnet19")

  def test_get_model_partials(self):
    model = resnet.get_model("resnet18_torchvision", num_classes=3)
    self.assertEqual(model.stem, "imagenet")
    self.assertEqual(model.init_scheme, "torchvision")
    self.assertEqual(tuple(model.stage_sizes), (2, 2, 2, 2))
    self.assertEqual(model.num_classes, 3)


class CpuConvsModelTest(parameterized.TestCase):
  """ResNet with jaxmp's CPU convs and max-pool matches flax's."""

  @parameterized.named_parameters(("cifar", "cifar"), ("imagenet", "imagenet"))
  def test_model_gradients_match_flax_ops(self, stem):
    x = _images((4, 32, 32, 3)) if stem == "imagenet" else _images()
    labels = jnp.arange(4) % 10
    ours = _small(cpu_convs=True, stem=stem)
    plain = _small(cpu_convs=False, stem=stem)
    variables = _init(ours, x, seed=2)
    out_t = _train_step_fn(ours)(variables, x, labels)
    out_p = _train_step_fn(plain)(variables, x, labels)
    # The forward convolutions are lax's in both; the max-pool's value too.
    np.testing.assert_array_equal(out_t[1], out_p[1])
    ref = _float64_step(variables, x, labels, stem=stem)
    _assert_as_accurate(out_t, out_p, ref, 2.0**-24)
