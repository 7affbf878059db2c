"""The autocast examples run at tiny size and do what they say.

``examples/flax_mnist_autocast.py`` (flax's MNIST CNN, one autocast line) and
``examples/byte_lm_autocast.py`` (a byte-level transformer LM, fp32 and
autocast fp16 side by side) are imported and their ``main`` run with tiny
arguments, in this process.
"""

import ast
import functools
import os
import runpy

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp
from _products import product_dtypes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
U16 = 2.0**-11  # unit roundoff of float16
HALF = ("float16", "float16")


def _load(script):
  return runpy.run_path(os.path.join(ROOT, "examples", script), run_name="x")


def _loss_bound(num_products, logits):
  """First-order bound of |autocast loss - fp32 loss| (cross-entropy).

  Each matrix product or convolution rounds its two operands and its output
  to fp16: at most 3u relative error per product. The normalisation layers
  bring each product's input back to unit scale, so the error a product adds
  to the logits is at most 3u times their magnitude (max |logit|, at least
  1), and the ``num_products`` on the path add up. Cross-entropy is
  2-Lipschitz in the max-norm of the logits (|softmax - onehot|_1 <= 2).
  """
  scale = max(1.0, float(jnp.max(jnp.abs(logits))))
  return 2 * num_products * 3 * U16 * scale


MNIST_ARGS = [
  "--steps", "15", "--batch-size", "32", "--num-train", "512",
  "--num-test", "64", "--learning-rate", "0.01",
]  # fmt: skip


def test_flax_mnist_example_runs_the_fp32_cnn_under_autocast():
  ns = _load("flax_mnist_autocast.py")
  model = ns["CNN"](rngs=nnx.Rngs(0))
  # The jaxpr in eval mode: under a plain jax.grad NNX cannot update the
  # statistics in place. The products are those of train mode.
  frozen = nnx.clone(model)
  frozen.eval()
  graphdef, params, rest = nnx.split(frozen, nnx.Param, ...)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
  data = ns["synthetic_mnist"](16)

  def grads_of(forward):
    def loss(p, r):
      m = nnx.merge(graphdef, p, r)
      logits = forward(m, data["image"], nnx.Rngs(dropout=0))
      return optax.softmax_cross_entropy_with_integer_labels(
        logits, data["label"]
      ).mean()

    return jax.make_jaxpr(jax.value_and_grad(loss))(params, rest)

  # The one autocast line: both convolutions and both dense layers in fp16,
  # forward and backward (input and kernel gradients); without it, fp32.
  auto = product_dtypes(grads_of(ns["make_forward"]()))
  plain = product_dtypes(grads_of(ns["make_forward"](autocast=False)))
  convs = [p for p in auto if p[0] == "conv_general_dilated"]
  dots = [p for p in auto if p[0] == "dot_general"]
  assert len(convs) >= 5 and len(dots) >= 5, auto  # 2 fwd + 2-ish bwd each
  assert all(ins == HALF for _, ins, _ in auto), auto
  # (Autocast's jaxpr holds more product equations than plain JAX's: each
  # weight's cotangent product sits in a custom rule, which the jaxpr keeps
  # with the forward it was traced beside.)
  assert len(auto) >= len(plain)
  assert all(ins == ("float32", "float32") for _, ins, _ in plain), plain
  # Its output and the statistics it writes back to the model stay fp32.
  before = nnx.clone(nnx.state(model, nnx.BatchStat))
  logits = ns["make_forward"]()(model, data["image"], nnx.Rngs(dropout=0))
  assert logits.dtype == jnp.float32
  after = nnx.state(model, nnx.BatchStat)
  assert jax.tree.map(lambda x: x.dtype, after) == jax.tree.map(
    lambda x: x.dtype, before
  )
  assert any(
    bool(jnp.any(a != b))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))
  )


def test_flax_mnist_example_trains_like_fp32_early_on():
  ns = _load("flax_mnist_autocast.py")
  auto = ns["main"](MNIST_ARGS)
  fp32 = ns["main"](MNIST_ARGS + ["--precision", "fp32"])
  a, f = auto["losses"], fp32["losses"]
  # It learns: the last steps' loss is well below the first's.
  assert np.mean(a[-3:]) < 0.7 * a[0], a
  assert np.mean(f[-3:]) < 0.7 * f[0], f
  # The same params, batch and dropout key at step 0: the same loss within
  # the fp16 rounding of its 4 products, at the initial logits' magnitude.
  model = ns["CNN"](rngs=nnx.Rngs(0))  # main's init (seed 0)
  model.eval()
  logits = model(ns["synthetic_mnist"](64)["image"])
  assert abs(a[0] - f[0]) <= _loss_bound(4, logits), (a[0], f[0])
  assert a[0] != f[0]  # ... and it did compute in fp16.
  # Dynamic loss scaling saw no overflow; the BatchNorm statistics moved.
  assert int(jaxmp.stats(auto["opt_state"])["skipped_steps"]) == 0
  moved = jax.tree.map(lambda x: bool(jnp.any(x != 0)), auto["stats"])
  assert any(m for m in jax.tree.leaves(moved))
  # A fraction of MNIST_ARGS' 64 test images, above chance (6.4): 15 on
  # this data (14 in fp32).
  correct = auto["test_accuracy"] * 64
  assert correct == round(correct) and correct > 64 / 10, correct


def test_flax_mnist_example_imports_tfds_only_for_real_data():
  with open(os.path.join(ROOT, "examples", "flax_mnist_autocast.py")) as f:
    tree = ast.parse(f.read())
  top = {
    alias.name.split(".")[0]
    for node in tree.body
    if isinstance(node, (ast.Import, ast.ImportFrom))
    for alias in (
      node.names if isinstance(node, ast.Import) else [ast.alias(node.module)]
    )
  }
  assert not top & {"tensorflow", "tensorflow_datasets"}, top
  loader = next(
    n
    for n in tree.body
    if isinstance(n, ast.FunctionDef) and n.name == "tfds_mnist"
  )
  assert "tensorflow_datasets" in ast.unparse(loader)


LM_ARGS = [
  "--steps", "12", "--batch-size", "4", "--length", "16", "--width", "32",
  "--depth", "1", "--heads", "2",
]  # fmt: skip


def test_byte_lm_example_products_are_half_and_the_rest_untouched():
  ns = _load("byte_lm_autocast.py")
  model = ns["ByteLM"](width=32, depth=1, num_heads=2, max_len=16)
  tokens = jnp.zeros((2, 17), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), tokens[:, :-1])["params"]
  loss = ns["loss_fn"]
  jaxpr = jax.make_jaxpr(
    jax.value_and_grad(functools.partial(loss, jaxmp.autocast(model.apply)))
  )(params, tokens)
  products = product_dtypes(jaxpr)
  # qkv, q.k, weights.v, proj, mlp_in, mlp_out, head: 7 forward products,
  # each with its transposes backward, all fp16 x fp16.
  assert len([p for p in products if p[0] == "dot_general"]) >= 3 * 7 - 1
  assert all(ins == HALF for _, ins, _ in products), products
  # Jitted: one compilation instead of one per operation.
  value, grads = jax.jit(
    jax.value_and_grad(functools.partial(loss, jaxmp.autocast(model.apply)))
  )(params, tokens)
  assert value.dtype == jnp.float32
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype("float32")}


def test_byte_lm_example_curves_side_by_side(tmp_path, capsys):
  ns = _load("byte_lm_autocast.py")
  out = tmp_path / "curves.tsv"
  result = ns["main"](LM_ARGS + ["--out", str(out)])
  a, f = result["curves"]["autocast"], result["curves"]["fp32"]
  assert len(a) == len(f) == 12
  assert np.mean(a[-3:]) < a[0] - 0.5 and np.mean(f[-3:]) < f[0] - 0.5, (a, f)
  # Step 0: the same params and batch. Logits of the initial LM are O(1).
  logits = result["model"].apply(
    {"params": result["params"]}, jnp.zeros((1, 16), jnp.int32)
  )
  assert abs(a[0] - f[0]) <= _loss_bound(7, logits), (a[0], f[0])
  assert a[0] != f[0]  # ... and the autocast run did compute in fp16.
  # The printed table and the file hold both curves, side by side.
  lines = out.read_text().splitlines()
  assert lines[0] == "step\tfp32\tautocast_float16"
  assert len(lines) == 13
  step, fp32_loss, auto_loss = lines[1].split("\t")
  assert (int(step), float(fp32_loss), float(auto_loss)) == (
    0,
    round(f[0], 4),
    round(a[0], 4),
  )
  printed = capsys.readouterr().out
  assert lines[1] in printed and "skipped steps 0" in printed
