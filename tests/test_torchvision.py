"""PyTorch state dicts in and out: `from_torchvision`, `to_torchvision`.

State dicts built with numpy in torch's names and layout, a float64 numpy
forward pass written on that layout, the errors and the exact round trip.
Parity with PyTorch without torch: ``tests/golden/torch_resnet18.npz`` holds
torch's logits, BatchNorm statistics and gradients (float32 and float64) of
``bench/_torch_resnet.py``'s torchvision ResNet18 and, renamed to
kuangliu/pytorch-cifar's names, its CIFAR ResNet18, written by
``tools/make_torch_golden.py``; and the torchvision ResNet18 with running
statistics calibrated by torch on one batch, with the eval-mode loss's
gradients too. With torch, three more tests: the golden files regenerated and
compared, the ``.pth`` read, torch's bfloat16 tensors.
"""

import doctest
import functools
import os
import sys

import jax
import numpy as np
import pytest

from _helpers import FAST_COMPILE
from _helpers import conv_f64
from jaxmp import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = ("resnet18_torchvision", "resnet18")
FILTERS, CLASSES, EPS = 4, 5, 1e-5
# kuangliu/pytorch-cifar's names for the shortcut and the classifier.
NAMES = {
  "resnet18_torchvision": ("downsample", "fc"),
  "resnet18": ("shortcut", "linear"),
}


def torch_state_dict(arch, seed=0, f=FILTERS, classes=CLASSES):
  """A ResNet18 state dict in torch's names and layouts, random values."""
  rng = np.random.default_rng(seed)
  shortcut, classifier = NAMES[arch]
  sd = {}

  def conv(name, out_ch, in_ch, k):
    std = np.sqrt(2.0 / (in_ch * k * k))
    sd[f"{name}.weight"] = (
      rng.normal(size=(out_ch, in_ch, k, k)) * std
    ).astype(np.float32)

  def bn(name, c):
    sd[f"{name}.weight"] = rng.uniform(0.5, 1.5, c).astype(np.float32)
    sd[f"{name}.bias"] = rng.normal(0, 0.2, c).astype(np.float32)
    sd[f"{name}.running_mean"] = rng.normal(0, 0.3, c).astype(np.float32)
    sd[f"{name}.running_var"] = rng.uniform(0.5, 2.0, c).astype(np.float32)
    sd[f"{name}.num_batches_tracked"] = np.int64(rng.integers(0, 10**6))

  conv("conv1", f, 3, 7 if arch == "resnet18_torchvision" else 3)
  bn("bn1", f)
  in_ch = f
  for i in range(4):
    out_ch = f * 2**i
    for j in range(2):
      p = f"layer{i + 1}.{j}"
      conv(f"{p}.conv1", out_ch, in_ch, 3)
      bn(f"{p}.bn1", out_ch)
      conv(f"{p}.conv2", out_ch, out_ch, 3)
      bn(f"{p}.bn2", out_ch)
      if in_ch != out_ch:
        conv(f"{p}.{shortcut}.0", out_ch, in_ch, 1)
        bn(f"{p}.{shortcut}.1", out_ch)
      in_ch = out_ch
  sd[f"{classifier}.weight"] = rng.normal(0, 0.1, (classes, in_ch)).astype(
    np.float32
  )
  sd[f"{classifier}.bias"] = rng.normal(0, 0.1, classes).astype(np.float32)
  return sd


def _conv(x, w, stride, pad):
  """NCHW x OIHW -> NCHW in float64, torch's zero padding."""
  y = conv_f64(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0), stride, pad)
  return y.transpose(0, 3, 1, 2)


def _bn(x, sd, name):
  g = lambda k: sd[f"{name}.{k}"].astype(np.float64)[None, :, None, None]
  return (x - g("running_mean")) / np.sqrt(g("running_var") + EPS) * g(
    "weight"
  ) + g("bias")


def numpy_eval_logits(sd, arch, x):
  """The eval-mode forward of torch on the torch layout, float64 numpy."""
  sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
  shortcut, classifier = NAMES[arch]
  relu = lambda v: np.maximum(v, 0)
  if arch == "resnet18_torchvision":
    y = relu(_bn(_conv(x, sd["conv1.weight"], 2, 3), sd, "bn1"))
    y = np.pad(y, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    ho = (y.shape[2] - 3) // 2 + 1
    y = np.max(
      [
        y[:, :, dy : dy + 2 * ho : 2, dx : dx + 2 * ho : 2]
        for dy in range(3)
        for dx in range(3)
      ],
      axis=0,
    )
  else:
    y = relu(_bn(_conv(x, sd["conv1.weight"], 1, 1), sd, "bn1"))
  for i in range(4):
    for j in range(2):
      p = f"layer{i + 1}.{j}"
      s = 2 if i > 0 and j == 0 else 1
      h = relu(_bn(_conv(y, sd[f"{p}.conv1.weight"], s, 1), sd, f"{p}.bn1"))
      h = _bn(_conv(h, sd[f"{p}.conv2.weight"], 1, 1), sd, f"{p}.bn2")
      if f"{p}.{shortcut}.0.weight" in sd:
        y = _bn(
          _conv(y, sd[f"{p}.{shortcut}.0.weight"], s, 0),
          sd,
          f"{p}.{shortcut}.1",
        )
      y = relu(h + y)
  pooled = y.mean(axis=(2, 3))
  return pooled @ sd[f"{classifier}.weight"].T + sd[f"{classifier}.bias"]


def _model(arch, dtype="float32", fused_norm=True):
  return models.get_model(
    arch,
    num_classes=CLASSES,
    num_filters=FILTERS,
    unbiased_running_var=True,
    dtype=dtype,
    param_dtype=dtype,
    norm_dtype=dtype,
    fused_norm=fused_norm,
  )


@pytest.mark.parametrize("arch", ARCHS)
def test_numpy_forward_is_torchs_and_imported_weights_give_its_logits(arch):
  """The golden weights and batch (see below) through this file's numpy."""
  sd = _golden_weights(arch)
  x = _golden_arrays()[f"{arch}/x"].astype(np.float64)
  want = numpy_eval_logits(sd, arch, x)
  tol = _tolerance(arch, "eval_logits")
  # The numpy forward pass above is torch's, both in float64.
  torch64 = _golden(f"{arch}/float64")["eval_logits"]
  assert _leaf_err(want, torch64) < tol["float64"]
  variables = models.from_torchvision(sd)
  assert variables["params"]["conv1"]["kernel"].shape[-1] == FILTERS
  assert variables["params"]["fc"]["kernel"].shape == (8 * FILTERS, CLASSES)
  # JAX's float32 eval logits of these variables on this batch (NHWC).
  got = _jax_outputs(arch, "float32")["eval_logits"]
  assert _leaf_err(got, want) < tol["float32"]


def test_fc_and_conv_layouts_by_hand():
  sd = torch_state_dict("resnet18_torchvision")
  params = models.from_torchvision(sd)["params"]
  h = np.random.default_rng(2).normal(size=(3, 8 * FILTERS))
  got = h @ params["fc"]["kernel"] + params["fc"]["bias"]
  want = np.einsum("ni,oi->no", h, sd["fc.weight"]) + sd["fc.bias"]
  # Both in float64: sums of 8 * FILTERS + 1 terms in two orders, each off by
  # at most that many u64 times the sum of the terms' magnitudes.
  mass = np.abs(h) @ np.abs(sd["fc.weight"]).T + np.abs(sd["fc.bias"])
  bound = 2 * (8 * FILTERS + 1) * U["float64"] * mass
  assert np.all(np.abs(got - want) <= bound)
  w = sd["layer2.0.downsample.0.weight"]  # (O, I, 1, 1).
  np.testing.assert_array_equal(
    params["layer2_0"]["downsample_conv"]["kernel"][0, 0].T, w[:, :, 0, 0]
  )
  k = params["layer1_0"]["conv1"]["kernel"]  # (H, W, I, O).
  w = sd["layer1.0.conv1.weight"]
  assert k[1, 2, 3, 0] == w[0, 3, 1, 2] and k[0, 1, 2, 3] == w[3, 2, 0, 1]


@pytest.mark.invariant
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_exact_counters_included(arch):
  sd = torch_state_dict(arch)
  variables = models.from_torchvision(sd)
  counters = variables["num_batches_tracked"]
  assert (
    counters["layer2_0"]["downsample_bn"]
    == (sd[f"layer2.0.{NAMES[arch][0]}.1.num_batches_tracked"])
  )
  back = models.to_torchvision(variables)
  assert sorted(back) == sorted(sd)
  for name, value in sd.items():
    assert back[name].dtype == np.asarray(value).dtype, name
    np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_counters_are_optional_and_prefixes_dropped():
  sd = torch_state_dict("resnet18")
  no_counters = {
    f"module.{k}": v for k, v in sd.items() if "num_batches" not in k
  }
  back = models.to_torchvision(models.from_torchvision(no_counters))
  assert sorted(back) == sorted(sd)
  assert back["bn1.num_batches_tracked"] == 0
  np.testing.assert_array_equal(back["linear.weight"], sd["linear.weight"])


def test_init_variables_export_with_zero_counters():
  variables = _torchvision_init()  # model.init's variables: no counters.
  assert "num_batches_tracked" not in variables
  sd = models.to_torchvision(variables)
  assert sorted(sd) == sorted(torch_state_dict("resnet18_torchvision"))
  assert sd["conv1.weight"].shape == (INIT_FILTERS, 3, 7, 7)
  assert sd["layer4.1.bn2.num_batches_tracked"] == 0
  again = models.from_torchvision(sd)
  np.testing.assert_array_equal(
    again["params"]["fc"]["kernel"], variables["params"]["fc"]["kernel"]
  )


def test_one_error_names_every_bad_tensor():
  sd = torch_state_dict("resnet18_torchvision")
  del sd["layer3.1.bn2.running_var"]
  sd["layer5.0.conv1.weight"] = np.zeros((1, 1, 3, 3), np.float32)
  sd["layer2.0.conv1.weight"] = sd["layer2.0.conv1.weight"][:, :, :2]
  sd["bn1.num_batches_tracked"] = np.zeros((2,), np.int64)
  with pytest.raises(ValueError) as e:
    models.from_torchvision(sd)
  msg = str(e.value)
  assert "unknown: layer5.0.conv1.weight" in msg
  assert "missing: layer3.1.bn2.running_var" in msg
  assert "layer2.0.conv1.weight (8, 4, 2, 3) (expected (8, 4, 3, 3))" in msg
  assert "bn1.num_batches_tracked (2,)" in msg
  assert "\n" not in msg


def test_explicit_num_classes_must_match_and_arch_is_checked():
  sd = torch_state_dict("resnet18_torchvision")
  with pytest.raises(
    ValueError, match=r"fc\.bias \(5,\) .*fc\.weight \(5, 32\)"
  ):
    models.from_torchvision(sd, num_classes=10)
  assert models.from_torchvision(sd, num_classes=CLASSES)
  with pytest.raises(ValueError, match="arch must be one of"):
    models.from_torchvision(sd, arch="vgg")
  # The torchvision names read as the CIFAR net: the 7x7 stem is mis-shaped.
  with pytest.raises(
    ValueError,
    match=r"missing: .*linear\.weight; mis-shaped: conv1\.weight "
    r"\(4, 3, 7, 7\) \(expected \(4, 3, 3, 3\)\)$",
  ):
    models.from_torchvision(sd, arch="resnet18")


def test_read_state_dict_formats(tmp_path):
  pytest.importorskip("safetensors")
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top

  sd = torch_state_dict("resnet18")
  for ext in ("safetensors", "npz"):
    path = str(tmp_path / f"w.{ext}")
    if ext == "npz":
      np.savez(path, **sd)
    else:
      st_numpy.save_file({k: np.asarray(v) for k, v in sd.items()}, path)
    got = models.read_state_dict(path)
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():
      np.testing.assert_array_equal(got[k], v)
      assert got[k].dtype == np.asarray(v).dtype
  with pytest.raises(ValueError, match=r"'\.ckpt'.*valid: \.safetensors"):
    models.read_state_dict(str(tmp_path / "w.ckpt"))


# PyTorch's answers, without torch: tests/golden/torch_resnet18.npz, written
# by tools/make_torch_golden.py (see its docstring for every array) from
# bench/_torch_resnet.py's nets, in float32 and float64.

GOLDEN_DIR = os.path.join(ROOT, "tests", "golden")
GOLDEN = os.path.join(GOLDEN_DIR, "torch_resnet18.npz")
GOLDEN_PTH = os.path.join(GOLDEN_DIR, "torch_resnet18.pth")
DTYPES = ("float32", "float64")
# The golden case of the torchvision net with calibrated running statistics,
# and each case's arch (a case is a prefix of the golden file's names).
CALIBRATED = "calibrated"
CASE_ARCH = {
  **{arch: arch for arch in ARCHS},
  CALIBRATED: "resnet18_torchvision",
}
# Unit roundoffs.
U = {"float32": 2.0**-24, "float64": 2.0**-53}


@functools.lru_cache(maxsize=None)
def _golden_arrays():
  with np.load(GOLDEN, allow_pickle=False) as f:
    return {k: f[k] for k in f.files}


def _golden(prefix):
  """``{name: array}`` of the golden arrays under ``prefix/``."""
  prefix += "/"
  return {
    k[len(prefix) :]: v
    for k, v in _golden_arrays().items()
    if k.startswith(prefix)
  }


def _leaf_err(got, want):
  """One tensor's error on its own scale: max |got - want| / max |want|."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.max(np.abs(got - want)) / np.max(np.abs(want))


@functools.lru_cache(maxsize=None)
def _tolerance(case, kind):
  """``{dtype: tolerance}`` of ``kind`` of golden ``case``, per tensor.

  ``case`` is a prefix of the golden file (an arch of `ARCHS`, or
  `CALIBRATED`), ``kind`` what it holds per dtype: eval_logits,
  train_logits, loss, stats or grad, and for `CALIBRATED` eval_loss and
  eval_grad (the gradients of the eval-mode loss). A tolerance is a fraction
  of each tensor's own largest |value|.

  Rounding error is the unit roundoff u times the problem's amplification
  (depth, sums, train-mode BatchNorm over few values), which does not depend
  on who computes. The golden file holds one independent float32 evaluation
  of the same math (torch's) next to float64: its worst error over the
  tensors of ``kind``, divided by u32, is that amplification for this
  problem. A float32 result may be 16 times as far from float64 as torch's
  own float32 result is (another summation order, AVX2 or AVX-512: the same
  distribution of errors; 16 times its worst is a wide margin). In float64
  the same amplification times u64, with a margin of 64: both sides round
  there (torch's float64 is the reference), and float64 kernels sum in longer
  sequential chains than float32's blocked ones (JAX's float64 gradients
  were 4 times amplification * u64 on one CPU; 64 leaves 16 to spare).
  """
  g32, g64 = _golden(f"{case}/float32"), _golden(f"{case}/float64")
  errs = [
    _leaf_err(g32[k], g64[k])
    for k in g64
    if k == kind or (k.startswith(kind + "/") and "num_batches" not in k)
  ]
  amplification = max(errs) / U["float32"]
  margin = {"float32": 16, "float64": 64}
  return {dtype: margin[dtype] * amplification * U[dtype] for dtype in DTYPES}


def _golden_weights(case, dtype="float32"):
  """The golden state dict, floating tensors cast (exactly) to ``dtype``."""
  return {
    k: v.astype(dtype) if v.dtype.kind == "f" else v
    for k, v in _golden(f"{case}/weights").items()
  }


def _golden_inputs(case, dtype):
  """The golden NHWC batch in ``dtype`` and its labels."""
  x = _golden_arrays()[f"{case}/x"].astype(dtype)
  return x.transpose(0, 2, 3, 1), _golden_arrays()[f"{case}/labels"]


def _x64(dtype):
  """JAX's float64 on for ``dtype="float64"`` (a context manager)."""
  return jax.enable_x64(dtype == "float64")


def test_golden_file_holds_what_the_tests_read():
  g = _golden_arrays()
  total = sum(v.nbytes for v in g.values())
  assert os.path.getsize(GOLDEN) + os.path.getsize(GOLDEN_PTH) < 4e6, total
  for arch, (shortcut, classifier) in NAMES.items():
    weights = _golden(f"{arch}/weights")
    # The names and shapes are those the numpy builder above writes.
    assert {k: v.shape for k, v in weights.items()} == {
      k: np.shape(v) for k, v in torch_state_dict(arch).items()
    }
    assert f"layer3.0.{shortcut}.0.weight" in weights
    assert f"{classifier}.bias" in weights
    for dtype in DTYPES:
      grads = _golden(f"{arch}/{dtype}/grad")
      assert sorted(grads) == sorted(
        k for k in weights if "running" not in k and "num_batches" not in k
      )
      assert all(v.dtype == dtype for v in grads.values())
      for kind in ("eval_logits", "train_logits"):
        assert g[f"{arch}/{dtype}/{kind}"].shape == (4, CLASSES)
    # The derived tolerances still see a 0.1% error in float32, 1e-11 in
    # float64: the golden float32 values are not far off float64.
    for kind in ("eval_logits", "train_logits", "stats", "grad"):
      tol = _tolerance(arch, kind)
      assert 0.0 < tol["float32"] < 1e-3 and 0.0 < tol["float64"] < 1e-11
  # The calibrated case: the torchvision net's names and shapes, every
  # counter 1 (one calibration batch), a batch of 4 at 64x64, and per dtype
  # the logits, losses and gradients of both modes.
  weights = _golden(f"{CALIBRATED}/weights")
  assert {k: v.shape for k, v in weights.items()} == {
    k: np.shape(v) for k, v in torch_state_dict(CASE_ARCH[CALIBRATED]).items()
  }
  counters = [v for k, v in weights.items() if "num_batches" in k]
  assert len(counters) == 20 and all(v == 1 for v in counters)
  assert g[f"{CALIBRATED}/x"].shape == (4, 3, 64, 64)
  assert g[f"{CALIBRATED}/labels"].shape == (4,)
  params = {
    k: v.shape
    for k, v in weights.items()
    if "running" not in k and "num_batches" not in k
  }
  for dtype in DTYPES:
    for kind in ("grad", "eval_grad"):
      grads = _golden(f"{CALIBRATED}/{dtype}/{kind}")
      assert {k: v.shape for k, v in grads.items()} == params, kind
      assert all(v.dtype == dtype for v in grads.values()), kind
    for kind in ("eval_logits", "train_logits"):
      assert g[f"{CALIBRATED}/{dtype}/{kind}"].shape == (4, CLASSES)
    for kind in ("eval_loss", "loss"):
      assert g[f"{CALIBRATED}/{dtype}/{kind}"].shape == ()
  for kind in ("eval_logits", "train_logits", "grad", "eval_grad"):
    tol = _tolerance(CALIBRATED, kind)
    assert 0.0 < tol["float32"] < 1e-3 and 0.0 < tol["float64"] < 1e-11


# The ResNet18 of 4 filters has, per arch, 62 trainable tensors: the stem conv
# and BatchNorm (3), 8 blocks of two convs and two BatchNorms (8 * 6 = 48),
# the 3 projection shortcuts (conv + BatchNorm: 3 * 3 = 9), fc weight and bias
# (2).
NUM_PARAM_TENSORS = 3 + 8 * 6 + 3 * 3 + 2
# ``(dtype, fused_norm)`` by test id: the unfused path (flax's BatchNorm +
# ReLU) in float64 too.
VARIANTS = {
  "float32": ("float32", True),
  "float64": ("float64", True),
  "float64-unfused_norm": ("float64", False),
}


@functools.lru_cache(maxsize=None)
def _jax_outputs(case, dtype, fused_norm=True):
  """JAX's answers to what the golden file holds, from one jitted program.

  The golden weights of ``case`` (cast to ``dtype``) and batch through
  `_model`: eval logits, train-mode logits, the mean cross-entropy ``loss``
  of those, the state dict after that train-mode pass (``state``, torch
  names) and the gradient of ``loss`` for every parameter (``grad``, torch
  names). Where the golden case holds them (`CALIBRATED`), also the
  eval-mode loss ``eval_loss`` and its gradients ``eval_grad`` (the eval
  logits are then that loss's forward pass). One compilation holds the eval
  and train passes and the backward passes.
  """
  arch = CASE_ARCH[case]
  variables = models.from_torchvision(_golden_weights(case, dtype))
  x, labels = _golden_inputs(case, dtype)
  model = _model(arch, dtype, fused_norm)
  with_eval_grad = f"{case}/float64/eval_loss" in _golden_arrays()

  def cross_entropy(logits):
    log_p = jax.nn.log_softmax(logits)
    return -log_p[np.arange(len(labels)), labels].mean()

  def loss_fn(params, rest):
    logits, new = model.apply(
      {**rest, "params": params}, x, train=True, mutable=["batch_stats"]
    )
    return cross_entropy(logits), (logits, new)

  def eval_loss_fn(params, rest):
    logits = model.apply({**rest, "params": params}, x, train=False)
    return cross_entropy(logits), logits

  def outputs(variables):
    params = variables["params"]
    (loss, (logits, new)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, variables
    )
    if not with_eval_grad:
      eval_logits = model.apply(variables, x, train=False)
      return eval_logits, logits, new, loss, grads, None, None
    (eval_loss, eval_logits), eval_grads = jax.value_and_grad(
      eval_loss_fn, has_aux=True
    )(params, variables)
    return eval_logits, logits, new, loss, grads, eval_loss, eval_grads

  with _x64(dtype):
    eval_logits, logits, new, loss, grads, eval_loss, eval_grads = (
      jax.device_get(jax.jit(outputs)(variables))
    )
  out = {
    "variables": variables,
    "eval_logits": eval_logits,
    "train_logits": logits,
    "loss": loss,
    "state": models.to_torchvision({**variables, **new}, arch=arch),
    "grad": models.to_torchvision({**variables, "params": grads}, arch=arch),
    "num_grad_leaves": len(jax.tree.leaves(grads)),
  }
  if with_eval_grad:
    out["eval_loss"] = eval_loss
    out["eval_grad"] = models.to_torchvision(
      {**variables, "params": eval_grads}, arch=arch
    )
  return out


def _check_logits(case, got, dtype):
  """``got``'s eval and train logits against torch's float64 (`_tolerance`)."""
  want64 = _golden(f"{case}/float64")
  for kind in ("eval_logits", "train_logits"):
    assert got[kind].dtype == dtype, kind
    err, tol = _leaf_err(got[kind], want64[kind]), _tolerance(case, kind)
    assert err < tol[dtype], (kind, err, tol[dtype])


def _check_loss(case, got, dtype, loss="loss", logits="train_logits"):
  """``got[loss]`` against torch's float64, from its logits' tolerance.

  The loss is mean_i(logsumexp(z_i) - z_i[y_i]); logsumexp moves at most as
  far as the largest logit, so |d loss| <= 2 max |d z| <= 2 * (the logits'
  tolerance) * max |z|. Relative to the loss, with torch's float64 logits for
  max |z| (the loss's own rounding, a few u over 5 classes and 4 examples, is
  far inside the tolerance's margin of 16 or 64).
  """
  want_loss = _golden_arrays()[f"{case}/float64/{loss}"]
  z_max = np.max(np.abs(_golden(f"{case}/float64")[logits]))
  loss_tol = 2 * _tolerance(case, logits)[dtype] * z_max / want_loss
  err = _leaf_err(got[loss], want_loss)
  assert err < loss_tol, (loss, got[loss], want_loss, err, loss_tol)


def _check_grads(case, got, dtype, kind="grad"):
  """Every parameter's gradient ``got[kind]`` against torch's float64."""
  want = _golden(f"{case}/float64/{kind}")
  tol = _tolerance(case, kind)[dtype]
  assert len(want) == got["num_grad_leaves"] == NUM_PARAM_TENSORS
  for name, g in want.items():
    assert got[kind][name].dtype == dtype, (kind, name)
    assert got[kind][name].shape == g.shape, (kind, name)
    err = _leaf_err(got[kind][name], g)
    assert err < tol, (kind, name, err, tol)


# The unfused path (`_norm_act` with fused=False: flax's BatchNorm, then the
# add and ReLU) is the same code under both stems, so it runs under
# torchvision's only; tests/test_resnet.py compares it with the fused path
# under the CIFAR stem, in train and in eval mode.
LOGITS_CASES = [
  (arch, variant)
  for arch in ARCHS
  for variant in VARIANTS
  if arch == "resnet18_torchvision" or VARIANTS[variant][1]
]


@pytest.mark.parametrize(
  "arch, variant", LOGITS_CASES, ids=[f"{a}-{v}" for a, v in LOGITS_CASES]
)
def test_logits_statistics_and_gradients_match_torch(arch, variant):
  """Torchvision's ResNet18, and kuangliu's CIFAR ResNet18 by its names.

  Eval and train logits, the running statistics after one train-mode pass,
  the loss and every parameter's gradient by torch name, each against
  torch's float64 within the tolerance of its kind (`_tolerance`).
  """
  dtype, fused_norm = VARIANTS[variant]
  got = _jax_outputs(arch, dtype, fused_norm)
  _check_logits(arch, got, dtype)

  stats = _golden(f"{arch}/float64/stats")
  tol = _tolerance(arch, "stats")[dtype]
  assert sum("running_" in k for k in stats) == 2 * 20  # 20 BatchNorms.
  for name, value in stats.items():
    if "running_" in name:
      assert got["state"][name].dtype == dtype, name
      assert _leaf_err(got["state"][name], value) < tol, name

  _check_loss(arch, got, dtype)
  _check_grads(arch, got, dtype)

  # Round trip exact, counters included.
  sd = _golden_weights(arch, dtype)
  back = models.to_torchvision(got["variables"])
  assert sorted(back) == sorted(sd)
  for name, value in sd.items():
    np.testing.assert_array_equal(back[name], value, err_msg=name)
    assert back[name].dtype == value.dtype, name


# The fused path: the unfused one's eval mode (flax's BatchNorm on the
# running statistics) is checked against torch by the uncalibrated
# unfused case above and against the fused path by tests/test_resnet.py.
@pytest.mark.parametrize("variant", [v for v in VARIANTS if VARIANTS[v][1]])
def test_calibrated_statistics_eval_and_train_gradients_match_torch(variant):
  """Running statistics calibrated by torch, in eval mode and in train mode.

  The torchvision ResNet18 (random BatchNorm affine) whose running
  statistics are one calibration batch's (``calibrated/``, see
  ``tools/make_torch_golden.py``), on another batch: the eval logits, the
  eval-mode loss and every parameter's gradient through the running
  statistics, and the train-mode logits, loss and gradients, each against
  torch's float64 within the tolerance of its kind (`_tolerance`, from this
  case's own float32 error).
  """
  dtype, fused_norm = VARIANTS[variant]
  got = _jax_outputs(CALIBRATED, dtype, fused_norm)
  _check_logits(CALIBRATED, got, dtype)
  _check_loss(CALIBRATED, got, dtype, "eval_loss", "eval_logits")
  _check_loss(CALIBRATED, got, dtype, "loss", "train_logits")
  _check_grads(CALIBRATED, got, dtype, "eval_grad")
  _check_grads(CALIBRATED, got, dtype, "grad")


# The init scheme of torchvision's resnet18 (zero_init_residual=False):
# convs kaiming_normal_(mode="fan_out", nonlinearity="relu"), untruncated;
# BatchNorm weight 1, bias 0 (and running mean 0, var 1); fc torch.nn.Linear's
# default, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias. Checked on
# wider nets than the parity tests': 16 filters, 100 classes (144 to 295k
# values per tensor).
INIT_FILTERS, INIT_CLASSES = 16, 100
# 62 tensors of params (NUM_PARAM_TENSORS), and per BatchNorm (20) its
# running mean, running var and counter.
NUM_STATE_DICT_TENSORS = NUM_PARAM_TENSORS + 20 * 3


def _expected_init(name, shape):
  """``(distribution, sigma)`` of tensor ``name`` under torchvision's init."""
  if name.endswith("num_batches_tracked"):
    return "zero", 0.0
  if len(shape) == 4:  # OIHW conv: fan_out = O * kh * kw.
    return "normal", np.sqrt(2.0 / (shape[0] * shape[2] * shape[3]))
  if name.startswith("fc."):  # Uniform with bound 1/sqrt(fan_in).
    return "uniform", 1.0 / np.sqrt(INIT_FILTERS * 8) / np.sqrt(3.0)
  if name.endswith(("bias", "running_mean")):
    return "zero", 0.0
  return "one", 1.0  # BatchNorm weight, running_var.


def _init_statistics(w):
  """``[size, mean, std, max |value|]``, as the golden file's ``init/``."""
  w = np.asarray(w, np.float64)
  return np.array([w.size, w.mean(), w.std(), np.abs(w).max()])


def _check_init(stats, shapes, other=None):
  """Each tensor's statistics (`_init_statistics`) against the scheme.

  Mean and standard deviation within 5 standard errors of the sample size
  (``sigma / sqrt(n)``; ``sqrt((m4 - sigma^4) / n) / (2 sigma)`` for the
  std, kurtosis 3 for a normal, 9/5 for a uniform); a normal is untruncated
  (values beyond 2.5 sigma, where a truncated normal at 2 sigma has none);
  a uniform stays within its bound and reaches 95% of it. With ``other``
  (the other framework's statistics), the two stds agree within 5 combined
  errors.
  """
  for name, (n, mean, std, absmax) in stats.items():
    kind, sigma = _expected_init(name, shapes[name])
    assert n == np.prod(shapes[name]), name
    if kind in ("zero", "one"):
      want = 0.0 if kind == "zero" else 1.0
      assert (mean, std, absmax) == (want, 0.0, want), name
      continue
    kurtosis = 3.0 if kind == "normal" else 9.0 / 5.0
    se_std = sigma * np.sqrt((kurtosis - 1) / n) / 2
    assert abs(mean) < 5 * sigma / np.sqrt(n), name
    assert abs(std - sigma) < 5 * se_std, (name, std, sigma)
    if kind == "normal":
      assert absmax > 2.5 * sigma, name
    else:
      bound = sigma * np.sqrt(3.0)
      assert absmax <= bound, name
      assert absmax > 0.95 * bound, name
    if other is not None:
      assert abs(std - other[name][2]) < 5 * np.sqrt(2) * se_std, name


@functools.lru_cache(maxsize=None)
def _torchvision_init():
  """``resnet18_torchvision``'s ``init`` at the init tests' size (jitted)."""
  model = models.resnet18_torchvision(
    num_classes=INIT_CLASSES, num_filters=INIT_FILTERS
  )
  return jax.device_get(
    jax.jit(
      lambda k: model.init(k, np.zeros((1, 32, 32, 3), "f4"), train=False)
    )(jax.random.key(3))
  )


def test_init_scheme_is_torchvisions():
  sd = models.to_torchvision(_torchvision_init())
  assert len(sd) == NUM_STATE_DICT_TENSORS
  shapes = {k: np.shape(v) for k, v in sd.items()}
  ours = {k: _init_statistics(v) for k, v in sd.items()}
  torchs = _golden("init")  # torch's TorchvisionResNet18, same size.
  assert sorted(torchs) == sorted(sd)
  _check_init(torchs, shapes)  # bench's torch model is torchvision's init.
  _check_init(ours, shapes, other=torchs)
  # The CIFAR resnet18 keeps flax's defaults (documented, not torch's): its
  # convs are lecun-normal in fan_in, not kaiming fan_out.
  cifar = models.resnet18(num_classes=INIT_CLASSES, num_filters=INIT_FILTERS)
  # One kernel of its init: jit keeps only what that kernel needs (the other
  # initialisers' random numbers are dead code), a fraction of the compile.
  k = jax.jit(
    lambda k: cifar.init(k, np.zeros((1, 32, 32, 3), "f4"), train=False)[
      "params"
    ]["layer4_0"]["conv2"]["kernel"]
  )(jax.random.key(3))
  fan_in = 9 * 8 * INIT_FILTERS
  # 5 standard errors of a normal's std over k.size values (see _check_init).
  se_std = np.sqrt(1.0 / fan_in) * np.sqrt(2 / k.size) / 2
  assert abs(np.std(k) - np.sqrt(1.0 / fan_in)) < 5 * se_std


def test_pth_without_torch_says_how_to_convert(monkeypatch):
  """The committed .pth (torch.save of a state dict), torch not importable."""
  monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails.
  with pytest.raises(ImportError, match=r"needs torch .*np\.savez"):
    models.read_state_dict(GOLDEN_PTH)


def test_pth_written_by_torch_reads_as_the_state_dict():
  pytest.importorskip("torch")
  got = models.read_state_dict(GOLDEN_PTH)
  want = _golden("resnet18_torchvision/weights")
  assert sorted(got) == sorted(want)
  for k, v in want.items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)
    assert got[k].dtype == v.dtype, k


def test_bfloat16_state_dict_round_trips_exactly():
  """The bfloat16 cast by torch of the weights (its bits), without torch."""
  weights = _golden("resnet18_torchvision/weights")
  bits = _golden("bfloat16")
  sd = {
    k: bits[k].view(jax.numpy.bfloat16) if k in bits else v
    for k, v in weights.items()
  }
  for k in bits:  # torch rounds to nearest even, as numpy's cast does.
    np.testing.assert_array_equal(
      sd[k], weights[k].astype(jax.numpy.bfloat16), err_msg=k
    )
  back = models.to_torchvision(models.from_torchvision(sd))
  assert sorted(back) == sorted(sd)
  for k, v in sd.items():
    assert back[k].dtype == v.dtype, k
    np.testing.assert_array_equal(
      np.asarray(back[k]).view(np.uint16 if k in bits else v.dtype),
      np.asarray(v).view(np.uint16 if k in bits else v.dtype),
      err_msg=k,
    )


def test_bfloat16_torch_tensors_round_trip_exactly():
  """The same from torch tensors: `from_torchvision`'s torch.bfloat16 path."""
  torch = pytest.importorskip("torch")
  sd = {
    k: torch.from_numpy(v).bfloat16()
    if v.dtype.kind == "f"
    else torch.tensor(v)
    for k, v in _golden("resnet18_torchvision/weights").items()
  }
  back = models.to_torchvision(models.from_torchvision(sd))
  for k, v in sd.items():
    got = torch.from_numpy(back[k].astype(np.float32)).to(v.dtype)
    assert back[k].dtype == (
      jax.numpy.bfloat16 if v.is_floating_point() else np.int64
    )
    assert torch.equal(got, v), k


def _golden_maker():
  """``tools/make_torch_golden.py`` as a module (it imports torch)."""
  sys.path.insert(0, os.path.join(ROOT, "tools"))
  try:
    import make_torch_golden  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  return make_torch_golden


def test_golden_maker_measures_kink_and_tie_clearance_on_hand_cases():
  """With torch: the golden maker's doctests, the hand cases of its checks.

  `kink_clearance` (a ReLU input near 0) and `pool_tie_clearance` (a
  max-pool window's two largest inputs close): each a case clear of the
  kink and one that is not.
  """
  pytest.importorskip("torch")
  result = doctest.testmod(_golden_maker(), verbose=False)
  assert result.attempted >= 9 and result.failed == 0, result


def test_golden_files_are_what_torch_computes(tmp_path):
  """With torch: tools/make_torch_golden.py again, against what is committed.

  Inputs, weights, counters and bits are exact (the calibrated running
  statistics too: computed in float64 and rounded to float32, which another
  summation order changes only at a near-tie); computed values within the
  float32/float64 tolerances above (torch on another CPU sums in another
  order); torch's init statistics (its generator may take another vector
  path on another CPU) to float32 rounding.
  """
  torch = pytest.importorskip("torch")
  make_torch_golden = _golden_maker()
  make_torch_golden.write(str(tmp_path))
  with np.load(tmp_path / make_torch_golden.NPZ) as f:
    fresh = {k: f[k] for k in f.files}
  committed = _golden_arrays()
  assert sorted(fresh) == sorted(committed)
  for key, want in committed.items():
    got = fresh[key]
    assert got.dtype == want.dtype and got.shape == want.shape, key
    parts = key.split("/")
    if key.startswith("init/"):
      # [size, mean, std, max |w|]: the size exact; a value drawn by another
      # vector path may round differently, |dw| <= 2 u32 |w|, which moves
      # the mean and max |w| by at most 2 u32 max |w| and the std by twice
      # that; the float64 statistics over n values add n u64 max |w|.
      assert got[0] == want[0], key
      absmax = want[3]
      tol = (4 * U["float32"] + want[0] * U["float64"]) * absmax
      assert np.all(np.abs(got[1:] - want[1:]) <= tol), (key, got, want)
    elif parts[1] in DTYPES and "num_batches" not in key:
      kind = parts[2]
      tol = _tolerance(parts[0], kind)[parts[1]]
      if np.max(np.abs(want)) > 0:
        assert _leaf_err(got, want) < 2 * tol, key
    else:
      np.testing.assert_array_equal(got, want, err_msg=key)
  pth = torch.load(tmp_path / make_torch_golden.PTH, weights_only=True)
  committed_pth = torch.load(GOLDEN_PTH, weights_only=True)
  assert pth["epoch"] == committed_pth["epoch"] == 3
  assert sorted(pth["net"]) == sorted(committed_pth["net"])
  for k, v in committed_pth["net"].items():
    assert torch.equal(pth["net"][k], v), k


# The app: --config.init_from.


def _tiny_weights_file(tmp_path, make_config, data_dir, drop=None):
  """A .safetensors state dict of the tiny job's net, kuangliu's names."""
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top

  config = make_config(data_dir)
  model = models.get_model(
    config.model, num_classes=10, num_filters=config.num_filters
  )
  # The variables' shapes without compiling, filled from numpy: every tensor
  # its own random values (running statistics too), so that a tensor loaded
  # into the wrong place shows.
  shapes = jax.eval_shape(
    lambda: model.init(
      jax.random.key(0), np.zeros((1, 32, 32, 3), "f4"), train=False
    )
  )
  rng = np.random.default_rng(7)

  def fill(path, leaf):
    name = path[-1].key
    if name == "kernel":
      std = 1 / np.sqrt(np.prod(leaf.shape[:-1]))
      value = rng.normal(0, std, leaf.shape)
    elif name == "var":
      value = rng.uniform(0.5, 1.5, leaf.shape)
    else:
      value = (name == "scale") + 0.1 * rng.normal(size=leaf.shape)
    return np.asarray(value, leaf.dtype)

  variables = jax.tree_util.tree_map_with_path(fill, shapes)
  sd = models.to_torchvision(variables, arch=config.model)
  if drop:
    del sd[drop]
  path = str(tmp_path / "weights.safetensors")
  st_numpy.save_file(sd, path)
  return path, variables


def test_init_from_safetensors_trains_from_those_weights(
  make_config, data_dir, tiny_data, tmp_path, capsys
):
  pytest.importorskip("safetensors")
  from cifar_train import loop  # pylint: disable=g-import-not-at-top
  from cifar_train import settings  # pylint: disable=g-import-not-at-top
  from cifar_train import steps  # pylint: disable=g-import-not-at-top

  path, variables = _tiny_weights_file(tmp_path, make_config, data_dir)
  # lr 0 in fp32: the params stay the imported ones, bit for bit.
  config = make_config(
    data_dir,
    init_from=path,
    policy="O0",
    learning_rate=0.0,
    weight_decay=0.0,
    num_train_steps=1,
    checkpoint_every_steps=1,
  )
  workdir = str(tmp_path / "run")
  summary = loop.train_and_evaluate(config, workdir, data=tiny_data)
  assert f"Initialised params and batch_stats from {path}" in (
    capsys.readouterr().out
  )
  s = settings.resolve(config)
  optimizer = steps.create_optimizer(s.precision, 0.0, momentum=0.9)
  params = jax.tree.map(np.asarray, variables["params"])
  expected = steps.TrainState(
    step=np.int32(0),
    params=params,
    batch_stats=variables["batch_stats"],
    opt_state=optimizer.init(params),
    rng=np.zeros(2, np.uint32),
  )
  assert summary["params_fingerprint"] == steps.params_fingerprint(expected)

  # A checkpoint in the workdir takes precedence, and says so. (The same
  # config: its programs come from the compilation cache.)
  again = loop.train_and_evaluate(config, workdir, data=tiny_data)
  out = capsys.readouterr().out
  assert "Not loading init_from" in out and "takes precedence" in out
  assert "Initialised params" not in out
  assert again["params_fingerprint"] == summary["params_fingerprint"]


def test_init_from_casts_to_the_presets_dtypes(make_config, data_dir, tmp_path):
  pytest.importorskip("safetensors")
  from cifar_train import settings  # pylint: disable=g-import-not-at-top
  from cifar_train import steps  # pylint: disable=g-import-not-at-top

  path, variables = _tiny_weights_file(tmp_path, make_config, data_dir)
  s = settings.resolve(make_config(data_dir, policy="O2", init_from=path))
  model = steps.create_model(
    s.model, num_classes=10, num_filters=s.num_filters, precision=s.precision
  )
  optimizer = steps.create_optimizer(s.precision, 0.1, momentum=0.9)
  state = steps.create_train_state(model, optimizer, (32, 32, 3), seed=0)
  loaded = steps.with_initial_weights(
    state,
    optimizer,
    steps.load_torch_weights(
      path, model_name=s.model, num_classes=10, num_filters=s.num_filters
    ),
  )
  kernel = loaded.params["layer1_0"]["conv1"]["kernel"]
  assert kernel.dtype == np.float16
  np.testing.assert_array_equal(
    kernel,
    variables["params"]["layer1_0"]["conv1"]["kernel"].astype(np.float16),
  )
  assert loaded.params["bn1"]["scale"].dtype == np.float32  # O2: fp32 BN.
  np.testing.assert_array_equal(
    loaded.batch_stats["layer2_0"]["downsample_bn"]["var"],
    variables["batch_stats"]["layer2_0"]["downsample_bn"]["var"],
  )
  masters = jax.tree.leaves(
    __import__("jaxmp").master_params(loaded.opt_state, loaded.params)
  )
  assert all(m.dtype == np.float32 for m in masters)


def test_init_from_mismatch_is_one_line_naming_the_tensor(
  make_config, data_dir, tiny_data, tmp_path
):
  pytest.importorskip("safetensors")
  from cifar_train import loop  # pylint: disable=g-import-not-at-top
  from cifar_train.errors import ConfigError  # pylint: disable=g-import-not-at-top

  path, _ = _tiny_weights_file(
    tmp_path, make_config, data_dir, drop="layer3.0.shortcut.1.running_var"
  )
  config = make_config(data_dir, init_from=path)
  with pytest.raises(ConfigError) as e:
    loop.train_and_evaluate(config, str(tmp_path / "w"), data=tiny_data)
  msg = str(e.value)
  assert msg.startswith(f"init_from {path}: ") and "\n" not in msg
  assert "missing: layer3.0.shortcut.1.running_var" in msg
  with pytest.raises(ConfigError, match="is not a file"):
    loop.train_and_evaluate(
      make_config(data_dir, init_from=str(tmp_path / "nope.safetensors")),
      str(tmp_path / "w2"),
      data=tiny_data,
    )


def test_train_py_init_from_mismatch_is_one_error_line(
  make_config, data_dir, tiny_data, tmp_path
):
  pytest.importorskip("safetensors")
  import subprocess  # pylint: disable=g-import-not-at-top

  del tiny_data  # Prepares the data set in data_dir.
  path, _ = _tiny_weights_file(
    tmp_path, make_config, data_dir, drop="linear.bias"
  )
  config = make_config(data_dir)
  out = subprocess.run(
    [
      sys.executable,
      "train.py",
      "--config=configs/smoke.py",
      f"--workdir={tmp_path / 'w'}",
      f"--config.data_dir={data_dir}",
      f"--config.synthetic_train_examples={config.synthetic_train_examples}",
      f"--config.synthetic_test_examples={config.synthetic_test_examples}",
      f"--config.num_filters={config.num_filters}",
      f"--config.init_from={path}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=FAST_COMPILE,
      TF_CPP_MIN_LOG_LEVEL="3",
    ),
  )
  assert out.returncode == 2, out.stderr[-2000:]
  assert "Traceback" not in out.stderr, out.stderr[-2000:]
  (line,) = [l for l in out.stderr.splitlines() if l.startswith("error:")]
  assert line.startswith(f"error: init_from {path}: state dict does not fit")
  assert line.endswith("missing: linear.bias")
  assert not (tmp_path / "w" / "checkpoints").exists()
