"""Tests for jaxmp.models (ResNet18, tiny shapes, CPU)."""

import functools

from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _helpers import conv_f64

from jaxmp._src.nn import resnet

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


# The torchvision stem (7x7 stride-2 conv, max-pool) with torch's unbiased
# running variance, on 32x32 images: maps of 16x16 (stem), 8x8 (pool, stage
# 1) and 4x4 (stage 2), all more than 4 pixels, so that the forward
# convolutions are lax's with cpu_convs too (CpuConvsModelTest).
IMAGENET = dict(unbiased_running_var=True, stem="imagenet")
IMAGENET_IMAGES = (4, 32, 32, 3)


# The static loss scale of every train step here: it keeps float16 gradients
# of this tiny net from underflow, and a power of two scales and unscales
# float32 and float64 exactly. One value for all tests, so that the tests
# that build the same model compile the same program once (tests/conftest.py's
# compilation cache).
LOSS_SCALE = 1024.0


def _train_step_fn(model, loss_scale=LOSS_SCALE):
  """Jitted (loss, logits, new_batch_stats, grads) of a train step.

  Gradients are of ``loss * loss_scale``, returned unscaled in float32 (or
  float64).
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
  variables,
  x,
  labels,
  loss_scale=LOSS_SCALE,
  fused_norm=False,
  cpu_convs=False,
  **kw,
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
    # Shapes and dtypes are the traced program's (jax.eval_shape), without
    # compiling it; the tests below run these models.
    model = _small(num_filters=4, num_classes=7, stem=stem, dtype=dtype)
    x = _images((4, 16, 16, 3))
    variables = _init(model, x)
    for train in (True, False):
      out = jax.eval_shape(
        functools.partial(model.apply, train=train, mutable=["batch_stats"]),
        variables,
        x,
      )[0]
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
    # float32 before rounding, plain flax in float16. (float16 conv params
    # too, O2, would give the BatchNorms the same inputs and float32 params:
    # norm_dtype, checked by test_o2_dtypes.)
    ("o1", dict(dtype=f16)),
  )
  def test_fused_matches_plain_train(self, kwargs):
    self._check_fused_matches_plain_train(kwargs)

  # Under XLA's default flags: the fast-compile flags' older XLA:CPU kernel
  # emitters (tests/_helpers.py) get this float64 program's stem gradients
  # wrong (the fused BatchNorm with jaxmp's convs and max-pool: errors of
  # order 1, where the default emitters agree with flax's ops to 1e-15).
  @pytest.mark.invariant
  def test_fused_matches_plain_train_unbiased_var_imagenet(self):
    self._check_fused_matches_plain_train(IMAGENET)

  def _check_fused_matches_plain_train(self, kwargs):
    x = _images(
      IMAGENET_IMAGES if kwargs.get("stem") == "imagenet" else (4, 8, 8, 3)
    )
    labels = jnp.arange(4) % 10
    fused = _small(fused_norm=True, **kwargs)
    plain = _small(fused_norm=False, **kwargs)
    variables = _init(fused, x, seed=1)
    out_f = _train_step_fn(fused)(variables, x, labels)
    out_p = _train_step_fn(plain)(variables, x, labels)
    for a, b in zip(jax.tree.leaves(out_f[2]), jax.tree.leaves(out_p[2])):
      self.assertEqual(a.dtype, b.dtype)
    ref = _float64_step(variables, x, labels, **kwargs)
    u = 2.0**-11 if kwargs.get("dtype") == f16 else 2.0**-24
    _assert_as_accurate(out_f, out_p, ref, u)
    if u == 2.0**-24:  # The fused math in float64 too: a far finer check.
      fused64 = _float64_step(
        variables, x, labels, fused_norm=True, cpu_convs=True, **kwargs
      )
      _assert_as_accurate(fused64, out_p, ref, u, ours_unit=2.0**-53)

  @parameterized.named_parameters(
    # (model kwargs, images, stem conv stride and padding); the programs of
    # test_fused_matches_plain_train's fused models (fp32, and
    # unbiased_var_imagenet), compiled once for both tests.
    ("cifar_biased", {}, (4, 8, 8, 3), 1, 1),
    ("imagenet_unbiased", IMAGENET, IMAGENET_IMAGES, 2, 3),
  )
  def test_unbiased_running_var(self, kwargs, shape, stride, pad):
    self.assertTrue(resnet.resnet18_torchvision().unbiased_running_var)
    self.assertFalse(resnet.resnet18().unbiased_running_var)
    x = _images(shape)
    model = _small(**kwargs)
    variables = _init(model, x, seed=1)
    stats = _train_step_fn(model)(variables, x, jnp.arange(4) % 10)[2]
    got = np.asarray(stats["bn1"]["var"], np.float64)
    # The stem's bn1 normalises the stem conv's output y over n = 4 images *
    # its pixels; the stored variance is m * 1 + (1 - m) * c * var(y), m =
    # 0.9, c = n / (n - 1) (torch's unbiased variance) or 1. y in float64:
    kernel = np.asarray(variables["params"]["conv1"]["kernel"], np.float64)
    x64 = np.asarray(x, np.float64)
    y = conv_f64(x64, kernel, stride, pad)
    n = y.size // y.shape[-1]
    c = n / (n - 1) if kwargs.get("unbiased_running_var") else 1.0
    m, u = 0.9, 2.0**-24
    want = m + (1 - m) * c * y.var(axis=(0, 1, 2))
    # float32 rounding, worst case in any summation order: each y is a sum of
    # k = 3 * kh * kw products, off by at most k u sum |x w| (``mass``); the
    # moments mean(y) and mean(y^2) are sums of n terms, off by n u times
    # the mean magnitude (plus what y's error brings); var = mean(y^2) -
    # mean(y)^2 and the running update add a few roundings of their size.
    k = kernel.shape[0] * kernel.shape[1] * kernel.shape[2]
    dy = np.max(k * u * conv_f64(np.abs(x64), np.abs(kernel), stride, pad))
    axes = (0, 1, 2)
    mean, mean_sq = y.mean(axes), np.mean(y**2, axes)
    d_mean = dy + n * u * np.abs(y).mean(axes)
    d_mean_sq = 2 * np.abs(y).mean(axes) * dy + dy**2 + (n + 1) * u * mean_sq
    d_var = d_mean_sq + 2 * np.abs(mean) * d_mean + d_mean**2
    d_var += 2 * u * (mean_sq + mean**2)
    tol = (1 - m) * c * d_var + 4 * u * want
    np.testing.assert_array_less(np.abs(got - want), tol)
    # The other variance is (1 - m) var / (n - 1) away: more than twice the
    # bound, so that a wrong factor cannot pass.
    assert np.all((1 - m) * y.var(axes) / (n - 1) > 2 * tol)

  def test_fused_matches_plain_eval(self):
    x = _images()
    labels = jnp.arange(4) % 10
    fused = _small(fused_norm=True)
    plain = _small(fused_norm=False)
    variables = _init(fused, x, seed=1)
    # Non-trivial running statistics (test_fused_matches_plain_train's fp32
    # program).
    variables = {
      "params": variables["params"],
      "batch_stats": _train_step_fn(fused)(variables, x, labels)[2],
    }
    apply = lambda model, v, x: jax.device_get(
      jax.jit(functools.partial(model.apply, train=False))(v, x)
    )
    got_fused = apply(fused, variables, x)
    got_plain = apply(plain, variables, x)
    with jax.enable_x64(True):
      plain64 = _small(
        fused_norm=False,
        cpu_convs=False,
        dtype=np.float64,
        param_dtype=np.float64,
        norm_dtype=np.float64,
      )
      v64 = jax.tree.map(lambda a: np.asarray(a, np.float64), variables)
      ref = apply(plain64, v64, np.asarray(x, np.float64))
    # As in `_assert_as_accurate`: the fused logits within 16 times flax's
    # float32 rounding error (u times the amplification of this net, at
    # least 1) of float64.
    u = 2.0**-24
    amplification = max(_rel_err(got_plain, ref) / u, 1.0)
    err = _rel_err(got_fused, ref)
    self.assertLess(err, 16 * amplification * u)

  def test_torchvision_init_statistics(self):
    model = resnet.ResNet(
      stage_sizes=(1,),
      num_filters=32,
      num_classes=10,
      stem="imagenet",
      init_scheme="torchvision",
    )
    # Only the tensors checked below: jit drops the other initialisers.
    params = jax.jit(
      lambda k: {
        name: p
        for name, p in model.init(k, jnp.zeros((1, 8, 8, 3)), train=False)[
          "params"
        ].items()
        if name in ("layer1_0", "fc", "bn1")
      }
    )(jax.random.key(0))
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

  # The CIFAR and the torchvision stem (`IMAGENET`, with the unbiased running
  # variance): ours and the float64 reference are the programs
  # test_fused_matches_plain_train compiles for fp32 and
  # unbiased_var_imagenet.
  @parameterized.named_parameters(("cifar", {}), ("imagenet", IMAGENET))
  def test_model_gradients_match_flax_ops(self, kwargs):
    x = _images(
      IMAGENET_IMAGES if kwargs.get("stem") == "imagenet" else (4, 8, 8, 3)
    )
    labels = jnp.arange(4) % 10
    ours = _small(cpu_convs=True, **kwargs)
    plain = _small(cpu_convs=False, **kwargs)
    variables = _init(ours, x, seed=2)
    out_t = _train_step_fn(ours)(variables, x, labels)
    out_p = _train_step_fn(plain)(variables, x, labels)
    ref = _float64_step(variables, x, labels, **kwargs)
    _assert_as_accurate(out_t, out_p, ref, 2.0**-24)


class CpuConvsBitwiseTest(parameterized.TestCase):
  """A bitwise claim about two programs, under XLA's default flags.

  The fast-compile flags' older XLA:CPU kernel emitters round the train
  step's imagenet-stem logits one unit apart in the two programs.
  """

  pytestmark = pytest.mark.invariant

  @parameterized.named_parameters(("cifar", {}), ("imagenet", IMAGENET))
  def test_model_logits_are_flax_ops_bit_for_bit(self, kwargs):
    """The forward convolutions are lax's in both; the max-pool's value too."""
    x = _images(
      IMAGENET_IMAGES if kwargs.get("stem") == "imagenet" else (4, 8, 8, 3)
    )
    ours = _small(cpu_convs=True, **kwargs)
    plain = _small(cpu_convs=False, **kwargs)
    variables = _init(ours, x, seed=2)

    def logits(model):
      apply = lambda v: model.apply(v, x, train=True, mutable=["batch_stats"])
      return jax.jit(apply)(variables)[0]

    np.testing.assert_array_equal(logits(ours), logits(plain))
