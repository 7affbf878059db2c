"""Where a step's weight gradients are summed across devices, and in what.

Each test reads the program right after XLA's SPMD partitioner
(`jaxmp.reduction_report`): XLA:CPU computes half all-reduces in fp32 in its
later passes, a GPU's NCCL does not. Meshes of the 4 forced CPU devices:
data parallel ``(4,)`` and FSDP ``(2, 2)``, params ``P("fsdp", None)``.
"""

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp
from jaxmp import nn as jaxmp_nn

pytestmark = pytest.mark.devices(4)

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
HALF = ("f16", "bf16")


def _mesh(kind, explicit=False):
  t = AxisType.Explicit if explicit else AxisType.Auto
  if kind == "dp":
    return jax.make_mesh((4,), ("data",), axis_types=(t,))
  return jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(t, t))


def _specs(kind):
  """(batch spec, weight spec) of a mesh kind."""
  if kind == "dp":
    return P("data"), P()
  return P(("data", "fsdp")), P("fsdp", None)


def _mlp(p, x):
  h = jax.nn.relu(x @ p["w1"] + p["b1"])
  return jnp.mean(jnp.square((h @ p["w2"]).astype(F32)))


def _data(dtype=F32):
  rng = np.random.default_rng(0)
  p = {
    "w1": rng.normal(size=(8, 16)) / 3,
    "b1": rng.normal(size=(16,)) / 10,
    "w2": rng.normal(size=(16, 4)) / 4,
  }
  p = {k: jnp.asarray(v, dtype) for k, v in p.items()}
  return p, jnp.asarray(rng.normal(size=(32, 8)), dtype)


def _place(kind, p, x, explicit=False):
  mesh = _mesh(kind, explicit)
  batch, weight = _specs(kind)
  put = lambda t, s: jax.device_put(t, NamedSharding(mesh, s))
  p = {k: put(v, weight if v.ndim == 2 else P()) for k, v in p.items()}
  return mesh, p, put(x, batch)


def _weight_sums(report):
  """(op, dtype) of the sums whose result is a weight gradient's shape."""
  shapes = {(8, 16), (16, 4), (16,), (4, 16), (16, 8), (4, 8), (8, 4)}
  return {
    (r.op, r.dtype)
    for r in report.rows
    if r.op in ("all-reduce", "reduce-scatter", "all-to-all")
    and (r.shape in shapes or r.op == "all-to-all")
  }


@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_o1_sums_weight_gradients_in_fp32_by_default(kind):
  """Both routes, ``jax.grad`` and ``jaxmp.value_and_grad``, in one program.

  Each route's sums are its own (the loss scale makes their values differ):
  a half sum in either is a row of the report.
  """
  p, x = _data()
  mesh, p, x = _place(kind, p, x)
  loss = jaxmp.autocast(_mlp)
  opt = jaxmp.mixed_precision(optax.sgd(0.1))

  @jax.jit
  def step(p, s, x):
    return jax.grad(loss)(p, x), jaxmp.value_and_grad(loss)(p, s, x)[1]

  with jax.set_mesh(mesh):
    report = jaxmp.reduction_report(step, p, opt.init(p), x)
  sums = _weight_sums(report)
  assert ("all-reduce", "f32") in sums, str(report)
  assert not [r for r in report.sums() if r.dtype in HALF], str(report)
  # Each route sums each of the 3 params' gradients once.
  assert len(report.sums()) == 2 * 3, str(report)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_o2_half_params_sum_in_fp32_under_fsdp(dtype):
  p, x = _data(dtype)
  mesh, p, x = _place("fsdp", p, x)
  opt = jaxmp.mixed_precision(optax.adamw(1e-3))

  @jax.jit
  def step(p, s, x):
    loss, grads = jaxmp.value_and_grad(_mlp)(p, s, x)
    updates, s = opt.update(grads, s, p, loss=loss)
    return optax.apply_updates(p, updates), s

  state = opt.init(p)
  report = jaxmp.reduction_report(step, p, state, x)
  assert ("all-reduce", "f32") in _weight_sums(report), str(report)
  assert not [r for r in report.sums() if r.dtype in HALF], str(report)
  # The gradients keep their params' dtype (traced, not compiled); the
  # step still trains.
  grads = jax.eval_shape(
    lambda p, s, x: jaxmp.value_and_grad(_mlp)(p, s, x)[1], p, state, x
  )
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(dtype)}
  new, _ = step(p, state, x)
  assert all(bool(jnp.any(new[k] != p[k])) for k in p)


def _embedder(model):
  """(loss, fp16 params) of an embedding and a dense layer over tokens."""
  rng = np.random.default_rng(3)
  emb = jnp.asarray(rng.normal(size=(32, 8)) / 4, F16)
  w = jnp.asarray(rng.normal(size=(8, 4)) / 4, F16)
  if model == "bare":  # A gather of the table; a bias broadcast by `+`.
    p = {"emb": emb, "w": w, "b": jnp.asarray(rng.normal(size=4) / 8, F16)}

    def apply(p, t):
      # Explicit axes: the rows split as the tokens are (jax asks).
      spec = jax.typeof(t).sharding.spec
      out = P(*spec, None) if any(spec) else None
      return p["emb"].at[t].get(out_sharding=out) @ p["w"] + p["b"]

    return apply, p
  nn = pytest.importorskip("flax.linen")

  class Model(nn.Module):  # flax's Embed: jnp.take, a nested jit.
    @nn.compact
    def __call__(self, t):
      h = nn.Embed(32, 8, param_dtype=F16)(t)
      return nn.Dense(4, param_dtype=F16, dtype=F16)(h)

  p = {"params": Model().init(jax.random.key(0), jnp.zeros((1,), int))}
  p["params"]["params"]["Embed_0"]["embedding"] = emb
  p["params"]["params"]["Dense_0"]["kernel"] = w
  return (lambda p, t: Model().apply(p["params"], t)), p


@pytest.mark.parametrize("model,explicit", [("linen", False), ("bare", True)])
def test_o2_embedding_gradient_sums_in_fp32(model, explicit):
  """fp16 params under `jaxmp.value_and_grad`: the scatter-add's sum in fp32.

  On a mesh with auto axes (linen, no mesh set) or with `jax.make_mesh`'s
  explicit default (set): the bias's broadcast keeps the batch's sharding,
  so its cotangent is not gathered before the sum. The gradients: the sharded step's are one
  device's within one fp16 rounding of each (both round one fp32 sum),
  and plain JAX's in fp32 within fp16 rounding of the forward.
  """
  apply, p = _embedder(model)
  loss = lambda p, t: jnp.mean(jnp.square(apply(p, t).astype(F32)))
  tokens = np.random.default_rng(4).integers(0, 32, (8, 3))
  opt = jaxmp.mixed_precision(optax.adam(1e-3))
  if explicit:
    mesh = jax.make_mesh((4,), ("data",))
  else:
    mesh = _mesh("dp")
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  grads = jax.jit(lambda p, s, t: jaxmp.value_and_grad(loss)(p, s, t)[1])
  sharded = (put(p, P()), put(opt.init(p), P()), put(tokens, P("data")))
  with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
    report = jaxmp.reduction_report(grads, *sharded)
    on_mesh = grads(*sharded)
  # The three gradients' sums, in fp32; nothing gathered (a bias broadcast
  # keeps the batch's sharding until its sum).
  rows = {(r.op, r.dtype, r.shape) for r in report.rows}
  assert rows == {("all-reduce", "f32", s) for s in [(32, 8), (4, 8), (4,)]}
  state = opt.init(p)
  one = grads(p, state, tokens)
  scale = float(jaxmp.stats(state)["loss_scale"])
  wide = jax.tree.map(lambda a: a.astype(F32), p)
  plain = jax.jit(jax.grad(loss))(wide, tokens)
  for a, b, c in zip(*map(jax.tree.leaves, (on_mesh, one, plain))):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.dtype == b.dtype and np.abs(b).max() > 0
    np.testing.assert_allclose(a, b, rtol=2.0**-10, atol=2.0**-24 * scale)
    np.testing.assert_allclose(
      a / scale, c, rtol=0, atol=2.0**-7 * float(np.abs(c).max())
    )


def _linear(p, x, t):
  return jnp.sum((x @ p["w1"] + p["b1"]).astype(F32) * t)


def _exact_partials(rows):
  """(x, t): ``x.T @ t`` over each of 4 blocks of rows exact in fp16.

  Small multiples of 2**-2 (x) and integers (t), each block of rows (one
  device's, where 4 devices split them) scaled by its own power of two
  (2**6, 1, 2**-3, 2**-6): every block's partial ``x.T @ t`` (and every sum
  of them) is exact in fp32 and each partial is exact in fp16, but their
  sum needs up to 20 bits: fp16 holds it only rounded.
  """
  rng = np.random.default_rng(3)
  x = rng.integers(-7, 8, size=(rows, 8)) / 4
  t = rng.integers(-3, 4, size=(rows, 16)).astype(np.float64)
  scale = np.repeat(2.0 ** np.array([6, 0, -3, -6]), -(-rows // 4))[:rows]
  return x * scale[:, None], t


def _within_one_half_rounding(got, x, t):
  """``got`` is the fp64 ``x.T @ t`` rounded once to fp16, plus fp32 adds.

  One rounding to fp16 errs by at most half an fp16 ulp of the sum:
  ``2**-11 * 2**floor(log2|sum|)``; fp32 adds of the partials (exact here)
  add at most ``n`` fp32 roundings of ``sum |x| |t|``.
  """
  truth = x.T @ t
  mag = np.abs(x).T @ np.abs(t)
  half_ulp = 2.0**-11 * 2.0 ** np.floor(
    np.log2(np.maximum(np.abs(truth), 1e-30))
  )
  tol = half_ulp + len(x) * 2.0**-24 * mag
  err = np.abs(np.asarray(got, np.float64) - truth)
  assert np.all(err <= tol), (np.max(err / tol), got, truth)


@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_half_wire_sends_half_and_adds_in_fp32(kind):
  """Half on the wire: each element the fp64 sum rounded once to fp16.

  Each device's partial is exact in fp16 (`_exact_partials`), so the wire
  itself loses nothing; adding the partials in fp16 would round their sum
  up to three times, fp32 adds round it at most once (to the wire dtype).
  """
  x, t = _exact_partials(32)
  p = {"w1": jnp.ones((8, 16), F32), "b1": jnp.zeros((16,), F32)}
  mesh, p, x32 = _place(kind, p, jnp.asarray(x, F32))
  t32 = jax.device_put(jnp.asarray(t, F32), x32.sharding)
  reports = {}
  for mode in ("half_wire", "native"):
    step = jax.jit(jax.grad(jaxmp.autocast(_linear, grad_reduce=mode)))
    with jax.set_mesh(mesh):
      reports[mode] = jaxmp.reduction_report(step, p, x32, t32)
      if mode == "half_wire":
        grads = step(p, x32, t32)
  wire = reports["half_wire"]
  # The product's weight: an all-to-all of half partials, no all-reduce of
  # its shape (the bias's sum is an fp32 all-reduce).
  assert _weight_sums(wire) == {("all-to-all", "f16"), ("all-reduce", "f32")}
  assert [r.shape for r in wire.sums()] == [(16,)], str(wire)
  half_sums = sum(r.bytes_sent for r in reports["native"].sums("f16"))
  a2a = sum(r.bytes_sent for r in wire.rows if r.op == "all-to-all")
  assert 0 < a2a <= 1.1 * half_sums
  _within_one_half_rounding(grads["w1"], x, t)
  # native leaves the weight's sum in fp16, XLA's choice.
  native = _weight_sums(reports["native"])
  assert "f16" in {d for _, d in native}, str(reports["native"])


def test_half_wire_where_it_cannot_split_the_batch():
  """A batch the devices do not divide, or inside ``shard_map``: no error.

  6 rows on 4 devices; inside ``shard_map`` the mesh's axes are manual (the
  batch is already split). Either way the gradient is the fp64 sum within
  one rounding to fp16 and fp32 adds. One program holds both.
  """
  mesh = _mesh("dp")
  six, split = _exact_partials(6), _exact_partials(32)
  p = {"w1": jnp.ones((8, 16), F32), "b1": jnp.zeros((16,), F32)}
  grad = jax.grad(jaxmp.autocast(_linear, grad_reduce="half_wire"))
  # p is the same on every device: its gradient comes back summed.
  local = jax.shard_map(
    grad, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P()
  )

  @jax.jit
  def both(p, six, split):
    return grad(p, *six), local(p, *split)

  f32 = lambda a: jnp.asarray(a, F32)
  with jax.set_mesh(mesh):
    got = both(p, jax.tree.map(f32, six), jax.tree.map(f32, split))
  for g, (x, t) in zip(got, (six, split)):
    _within_one_half_rounding(g["w1"], x, t)


def _product_loss(w, x, t):
  return jnp.sum((x @ w).astype(F32) * t)


def _integer_data():
  """(w, x, t): x and t small integers (each product and fp32 sum exact)."""
  rng = np.random.default_rng(3)
  x = rng.integers(-60, 61, size=(32, 8)).astype(np.float32)
  t = rng.integers(-60, 61, size=(32, 4)).astype(np.float32)
  return jnp.ones((8, 4), F32), x, t


@pytest.mark.parametrize(
  "kind, weight, explicit, dtype",
  [
    ("dp", P(), False, F16),
    ("fsdp", P("fsdp", None), False, F16),
    ("dp", P("data", None), False, F16),
    ("fsdp", P("fsdp", None), True, BF16),  # jax.make_mesh's default axes.
  ],
)
def test_half_wire_bytes_and_sum(kind, weight, explicit, dtype):
  """Half all-to-all, fp32 adds, the sum rounded once; native's bytes.

  Each device's partial ``x_d.T @ t_d`` is an integer (exact in fp32), up
  to 28,800: fp16 rounds it (to 2 to 16 above 2,048), bf16 more. The half
  wire sends ``half(partial_d)`` and adds in fp32 (exact here): each
  device's sum is its shard of the weight's gradient. Where the weight is
  replicated over some axes (all of them for DP, ``data`` for FSDP) that
  shard is rounded once to half and gathered over them; a weight split over
  every device keeps the fp32 sum. ``x``'s cotangent is asked for too: it
  sums nothing, and takes the forward's half weight (no fp32 gather).
  """
  w, x, t = _integer_data()
  mesh = _mesh(kind, explicit)
  batch = _specs(kind)[0]
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  w, x, t = put(w, weight), put(x, batch), put(t, batch)
  half = jnp.dtype(dtype).name.replace("float", "f").replace("bfloat", "bf")
  steps, reports = {}, {}
  for mode in ("fp32", "half_wire", "native"):
    loss = jaxmp.autocast(_product_loss, dtype, grad_reduce=mode)
    steps[mode] = jax.jit(
      jax.grad(loss, argnums=(0, 1)), out_shardings=(w.sharding, x.sharding)
    )
    with jax.set_mesh(mesh):
      reports[mode] = jaxmp.reduction_report(steps[mode], w, x, t)
  wire = reports["half_wire"]
  assert {(r.op, r.dtype) for r in wire.rows} <= {
    ("all-to-all", half),
    ("all-gather", half),
  }, str(wire)
  assert ("all-to-all", half) in {(r.op, r.dtype) for r in wire.rows}
  native, fp32 = reports["native"].bytes_sent, reports["fp32"].bytes_sent
  assert 0 < wire.bytes_sent <= 1.1 * native, (str(wire), native)
  assert wire.bytes_sent < fp32, (str(wire), fp32)
  # No mesh set: found from the inputs' types, the same program.
  assert jaxmp.reduction_report(steps["half_wire"], w, x, t).rows == wire.rows
  with jax.set_mesh(mesh):
    got = np.asarray(steps["half_wire"](w, x, t)[0], np.float64)
  xs = np.asarray(x, np.float64).reshape(4, 8, 8)
  ts = np.asarray(t, np.float64).reshape(4, 8, 4)
  partials = np.einsum("dbi,dbo->dio", xs, ts)
  truth = partials.sum(0)
  sent = partials.astype(dtype).astype(np.float64)
  rounded = weight != P("data", None)
  want = sent.sum(0).astype(dtype if rounded else np.float64)
  np.testing.assert_array_equal(got, want.astype(np.float64))
  # Against the fp64 sum: each partial's rounding to half plus the sum's.
  unit = 2.0 ** -jnp.finfo(dtype).nmant / 2
  bound = unit * (np.abs(partials).sum(0) + rounded * np.abs(truth))
  assert np.all(np.abs(got - truth) <= bound)
  assert np.any(got != truth)  # Half rounded something: the test can fail.


def test_half_wire_without_a_mesh_to_split_over():
  """One device or an uneven batch: the fp32 sum; shard_map's manual axes."""
  w, x, t = _integer_data()
  one = jax.grad(jaxmp.autocast(_product_loss, grad_reduce="half_wire"))
  exact = np.asarray(x, np.float64).T @ np.asarray(t, np.float64)
  np.testing.assert_array_equal(jax.jit(one)(w, x, t), exact)
  mesh = _mesh("dp")
  with jax.set_mesh(mesh):  # Batch 6 on 4 devices: no all-to-all.
    report = jaxmp.reduction_report(jax.jit(one), w, x[:6], t[:6])
  assert not [r for r in report.rows if r.op == "all-to-all"], str(report)

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P(), P("data"), P("data")),
    out_specs=P(),
  )
  def manual(w, x, t):
    return one(w, x, t)

  jax.jit(manual).lower(w, x, t)  # Lowers: every axis is manual.
  # Manual over fsdp only: the half wire over data, inside the shard_map.
  mesh = _mesh("fsdp")

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P(), P("fsdp"), P("fsdp")),
    out_specs=P(),
    axis_names={"fsdp"},
  )
  def partly_manual(w, x, t):
    return one(w, x, t)

  with jax.set_mesh(mesh):
    report = jaxmp.reduction_report(jax.jit(partly_manual), w, x, t)
    got = np.asarray(jax.jit(partly_manual)(w, x, t), np.float64)
  assert ("all-to-all", "f16") in {(r.op, r.dtype) for r in report.rows}
  parts = np.einsum(
    "fdbi,fdbo->fdio",
    np.asarray(x, np.float64).reshape(2, 2, 8, 8),
    np.asarray(t, np.float64).reshape(2, 2, 8, 4),
  )
  halves = np.abs(parts).sum((0, 1)) + np.abs(parts.sum(1)).sum(0)
  assert np.all(np.abs(got - exact) <= 2.0**-11 * halves), str(report)


def test_gradient_matches_one_device_within_fp32_rounding():
  """The fp32 sum is fp32-exact; native's rounds each device's partial.

  ``loss = sum(y * t)`` with ``y = x16 @ w16``: the weight gradient is
  ``x16.T @ t`` with ``t`` exactly half, its fp64 value the truth. Each
  product of two halves is exact in fp32, so the fp32 route errs by at most
  ``n * eps32 * sum|x||t|`` (n terms summed); native rounds every device's
  partial to fp16 (relative 2**-11) before the sum. A product asked for an
  fp32 output (``preferred_element_type``) keeps the fp32 route's bound.
  """
  rng = np.random.default_rng(1)
  x = rng.normal(size=(64, 8)).astype(np.float16).astype(np.float32)
  t = rng.normal(size=(64, 4)).astype(np.float16).astype(np.float32)
  w = jnp.ones((8, 4), F32)
  truth = x.astype(np.float64).T @ t.astype(np.float64)
  bound = 64 * 2.0**-24 * (np.abs(x).T @ np.abs(t))

  def loss(w, x, t):
    return jnp.sum((x @ w).astype(F32) * t)

  def sharded(g, mesh, set_mesh=False):
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    args = put(w, P()), put(x, P("data")), put(t, P("data"))
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
      return np.asarray(g(*args), np.float64)

  errors, grads = {}, {}
  for mode in ("fp32", "native"):
    g = grads[mode] = jax.jit(jax.grad(jaxmp.autocast(loss, grad_reduce=mode)))
    one = np.asarray(g(w, x, t), np.float64)
    errors[mode] = (
      np.abs(one - truth),
      np.abs(sharded(g, _mesh("dp")) - truth),
    )
  # fp32: one device and four both within fp32 rounding of the truth, on
  # auto axes and on `jax.make_mesh`'s explicit default, with and without
  # a mesh set.
  assert np.all(errors["fp32"][0] <= bound)
  assert np.all(errors["fp32"][1] <= bound)
  explicit = jax.make_mesh((4,), ("data",))
  for mesh, set_mesh in (
    (explicit, False),
    (explicit, True),
    (_mesh("dp"), True),
  ):
    got = sharded(grads["fp32"], mesh, set_mesh)
    assert np.all(np.abs(got - truth) <= bound), (mesh, set_mesh)
  # native: the single device's result is rounded to fp16 once (its output
  # is half), so even one device is off by up to half an fp16 ulp.
  assert np.max(errors["native"][0] - bound) > 0

  # A product of fp16 data asked for an fp32 output: the weight's gradient
  # leaves its backward product in fp32 too, never rounded to half.
  def wide(w, x, t):
    return jnp.sum(jnp.dot(x.astype(F16), w, preferred_element_type=F32) * t)

  g = jax.jit(jax.grad(jaxmp.autocast(wide)))(w, x, t)
  assert np.all(np.abs(np.asarray(g, np.float64) - truth) <= bound)


def test_bad_grad_reduce_is_a_clear_error():
  bad = "fp16"
  calls = [
    lambda: jaxmp.autocast(_mlp, grad_reduce=bad),
    lambda: jaxmp.value_and_grad(_mlp, grad_reduce=bad),
    lambda: jaxmp.initialize(
      {"w": jnp.ones(2)}, optax.sgd(0.1), grad_reduce=bad
    ),
    lambda: jaxmp.pmean_grads({"w": jnp.ones(2)}, "data", grad_reduce=bad),
  ]
  for call in calls:
    with pytest.raises(ValueError, match="'fp32', 'half_wire', 'native'"):
      call()


def test_initialize_o2_forward_sums_in_fp32():
  p, x = _data()
  apply, p, _ = jaxmp.initialize(p, optax.sgd(0.1), "O2", apply_fn=_mlp)
  assert p["w1"].dtype == F16
  mesh, p, x = _place("dp", p, x)
  report = jaxmp.reduction_report(jax.jit(jax.grad(apply)), p, x)
  assert ("all-reduce", "f32") in _weight_sums(report), str(report)
  assert not report.sums("f16"), str(report)


@pytest.mark.parametrize("mode", ["fp32", "half_wire", "native"])
def test_pmean_grads_in_shard_map(mode):
  mesh = _mesh("dp")
  rng = np.random.default_rng(2)
  local = rng.normal(size=(4, 6, 5)).astype(np.float16)
  v = np.asarray(jnp.asarray(rng.normal(size=(4, 3, 5)), BF16))
  grads = {
    "w": jnp.asarray(local),
    "b": jnp.asarray(local[:, 0], F32),
    "v": jnp.asarray(v, BF16),
  }

  @jax.jit
  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P()
  )
  def mean(g):
    g = jax.tree.map(lambda a: a[0], g)
    return jaxmp.pmean_grads(g, "data", grad_reduce=mode)

  report = jaxmp.reduction_report(mean, grads)
  ops = {(r.op, r.dtype, r.shape) for r in report.rows}
  want = {
    "fp32": {("all-reduce", "f32", (6, 5)), ("all-reduce", "f32", (3, 5))},
    "half_wire": {("all-to-all", "f16", (4, 8)), ("all-gather", "f16", (32,))},
    "native": {("all-reduce", "f16", (6, 5)), ("all-reduce", "bf16", (3, 5))},
  }[mode]
  assert want <= ops, str(report)
  # The bf16 leaf as the fp16 one: no half sum but native's, half_wire's
  # partials sent in bf16.
  half_sums = {r.dtype for r in report.sums() if r.dtype in HALF}
  assert half_sums == ({"f16", "bf16"} if mode == "native" else set())
  a2a = {r.dtype for r in report.rows if r.op == "all-to-all"}
  assert a2a == ({"f16", "bf16"} if mode == "half_wire" else set())
  out = mean(grads)
  assert (out["w"].dtype, out["b"].dtype, out["v"].dtype) == (F16, F32, BF16)
  for k, parts, eps in (("w", local, 2.0**-11), ("v", v, 2.0**-8)):
    parts = parts.astype(np.float64)
    exact = parts.mean(0)
    # Rounded once to half after an fp32 sum (half_wire: the chunk sum is
    # rounded to half for the gather, then the mean): within 1.5 ulps.
    tol = 2 * eps * np.abs(exact) + 2.0**-24
    if mode == "native":  # Summed in half: 3 roundings of partial sums.
      tol = 4 * eps * np.abs(parts).sum(0) / 4 + tol
    err = np.abs(np.asarray(out[k], np.float64) - exact)
    assert np.all(err <= tol), k
  np.testing.assert_allclose(
    out["b"], local[:, 0].astype(np.float64).mean(0), rtol=1e-6, atol=1e-7
  )


def test_reduction_report_rows_bytes_and_table():
  mesh = _mesh("dp")

  @jax.jit
  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data"))
  )
  def total(x):
    with jax.named_scope("head"):
      return (
        jax.lax.psum(x[0], "data"),
        jax.lax.psum_scatter(x[0], "data", tiled=True),
      )

  report = jaxmp.reduction_report(total, jnp.ones((4, 8), F32))
  # The report is its rows: iteration, len and indexing.
  assert len(report) == 2 and list(report) == list(report.rows)
  ar, rs = sorted(report, key=lambda r: r.op)
  assert (ar.op, ar.dtype, ar.shape, ar.devices) == (
    "all-reduce",
    "f32",
    (8,),
    4,
  )
  assert (rs.op, rs.dtype, rs.shape, rs.devices) == (
    "reduce-scatter",
    "f32",
    (2,),
    4,
  )
  # A ring all-reduce sends 2 (n - 1) / n of its 32 bytes; a reduce-scatter
  # (n - 1) / n of the 32 it sums (its result is 8 bytes).
  assert ar.bytes_sent == 2 * 3 / 4 * 32
  assert rs.bytes_sent == 3 / 4 * 32
  assert report.bytes_sent == 48 + 24
  for r in report:
    assert (r.kind, r.source) == ("forward sum", "head"), r
  text = str(report)
  assert text.splitlines()[0].split() == [
    "op",
    "dtype",
    "shape",
    "devices",
    "bytes",
    "sent",
    "kind",
    "source",
  ]
  assert "all-reduce      f32" in text and "72 bytes sent per device" in text
  assert "reduce-scatter  f32    [2]" in text and "forward sum  head" in text
  # One device: no collectives.
  one = jaxmp.reduction_report(jnp.sin, jnp.ones(3))
  assert one.rows == () and len(one) == 0 and list(one) == []


_TUPLE_REFS_HLO = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[4], f32[4])) -> (s32[], f32[4], f32[4]) {
  %p = (s32[], f32[4]{0}, f32[4]{0}) parameter(0)
  %ct = f32[4]{0} all-reduce(%p#1), to_apply=%add, metadata={op_name="BWD"}
  %gw = f32[4]{0} all-reduce(%p#2), to_apply=%add, metadata={op_name="BWD"}
  %g = f32[4]{0} add(%p#2, %gw)
  ROOT %t = (s32[], f32[4]{0}, f32[4]{0}) tuple(%p#0, %ct, %g)
}

%cond (q: (s32[], f32[4], f32[4])) -> pred[] {
  %q = (s32[], f32[4]{0}, f32[4]{0}) parameter(0)
  ROOT %lt = pred[] compare(%q#0, %q#0), direction=LT
}

ENTRY %main (a: f32[4], b: f32[4,4]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %i = s32[] constant(0)
  %init = (s32[], f32[4]{0}, f32[4]{0}) tuple(%i, %a, %a)
  %w = (s32[], f32[4]{0}, f32[4]{0}) while(%init), condition=%cond, body=%body
  %d = f32[4]{0} dot(%b, %w#1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/transpose(jvp(Net))/inp/dot_general"}
  ROOT %r = (f32[4]{0}, f32[4]{0}) tuple(%d, %w#2)
}
""".replace(
  "BWD", "jit(f)/transpose(jvp(Net))/while/body/eval_jaxpr/hidden/dot"
)


def test_report_source_strips_transforms_and_control_flow():
  from jaxmp._src.reduction import hlo  # pylint: disable=g-import-not-at-top
  from jaxmp._src.reduction import report as report_lib  # pylint: disable=g-import-not-at-top

  cases = {
    "transpose(jvp(jit(jaxmp_grad_reduce_fp32)))/ResNet/layer2_0/"
    "downsample_conv/cond/branch_0_fun/reduce_sum": (
      "ResNet/layer2_0/downsample_conv"
    ),
    "jit(loss)/transpose(jvp(MLP))/hidden/dot_general": "MLP/hidden",
    "jit(loss)/transpose(jvp(jit(jaxmp_autocast_float16)))/MLP/hidden/"
    "transpose(jvp())/dot_general": "MLP/hidden",
    "jit(step)/transpose(jvp(jit(f)))/LM/embed/jit(_take)/scatter-add": (
      "LM/embed"
    ),
    "jit(step)/ResNet/conv/grc,gro->gco/dot_general": "ResNet/conv",
    "jit(step)/jvp(jit(jaxmp_grad_reduce_fp32))/reduce_sum": "",
    "all_to_all": "",
    # jax's call primitives name the ops they call (closed_call is
    # eval_jaxpr from jax 0.12), under nn.scan and autocast.
    "jit(loss)/jvp(jit(jaxmp_autocast_float16))/Net/while/body/eval_jaxpr/"
    "block/out/dot_general": "Net/block/out",
    "transpose(jvp(Net))/core_call/pjit/remat2/closed_call/dense/add": (
      "Net/dense"
    ),
  }
  for op_name, want in cases.items():
    assert hlo.source(op_name) == want, op_name
  # The running jax's names for them, whatever it calls them.
  from jax.extend.core import primitives  # pylint: disable=g-import-not-at-top

  call = primitives.closed_call_p.name
  assert call in hlo._jax_parts()  # pylint: disable=protected-access
  assert (
    hlo.source(f"Net/{call}/block/{call}/out/dot_general") == "Net/block/out"
  )
  # Tuple elements written ``%t#i`` (XLA with jax 0.12, no
  # get-tuple-element): a loop's carried cotangent (element 1) that only
  # feeds a product after the loop, beside a gradient (element 2) that is
  # the result.
  rows = report_lib._parse(_TUPLE_REFS_HLO, 4)  # pylint: disable=protected-access
  assert [(r.op, r.kind, r.source) for r in rows] == [
    ("all-reduce", "activation-cotangent sum", "Net/hidden"),
    ("all-reduce", "gradient sum", "Net/hidden"),
  ]
  # A recomputed forward (jax.checkpoint) is not the backward pass.
  assert hlo.is_backward("transpose(jvp(Net))/dense/dot_general")
  assert not hlo.is_backward(
    "transpose(jvp(Net))/rematted_computation/dense/dot_general"
  )
  # Mesh groups written with device ids: the named axes' sizes.
  line = (
    "replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=2], "
    "device_ids=([2,2]T(1,0)) {'axis_1'}, use_global_device_ids=true"
  )
  assert report_lib._group_size(line, 4) == 2  # pylint: disable=protected-access


@pytest.mark.parametrize("layout", ["dp", "fsdp", "tp"])
def test_report_names_each_rows_layer_and_kind(layout):
  """Each row's layer and kind: a linen MLP with jaxmp's BatchNorm.

  ``fsdp`` runs ``grad_reduce="half_wire"``: its all-to-alls are sums of
  gradients too. ``tp`` is Megatron's layout, its two layers scanned as a language model's
  blocks are: ``hidden`` column-parallel (its input's cotangent is summed
  over ``model`` in the backward pass, inside the loop, and carried to the
  layer below), ``out`` row-parallel (its product is summed over ``model``
  in the forward).
  """
  nn = pytest.importorskip("flax.linen")
  import jaxmp.nn  # pylint: disable=g-import-not-at-top,redefined-outer-name

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      h = nn.relu(nn.Dense(16, name="hidden")(x))
      return x + nn.Dense(8, name="out")(h), None

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(8, name="inp")(x)
      x = nn.relu(jaxmp.nn.BatchNorm(use_running_average=False, name="bn")(x))
      if layout != "tp":
        return Block(name="block")(x, None)[0]
      scan = nn.scan(
        Block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=2,
      )
      return scan(name="block")(x, None)[0]

  net = Net()
  x = jnp.asarray(np.random.default_rng(3).normal(size=(16, 8)), F32)
  params = net.init(jax.random.key(0), x)
  if layout == "tp":
    mesh = jax.make_mesh(
      (2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2
    )
    batch = P("data")
    spec = {
      "inp": P(),
      "hidden": P(None, None, "model"),
      "out": P(None, "model", None),
    }
    weight = lambda path: (
      spec[path[-2].key] if path[-1].key == "kernel" else P()
    )
  else:
    mesh = _mesh(layout)
    batch, w = _specs(layout)
    weight = lambda path: w if path[-1].key == "kernel" else P()
  place = lambda path, a: jax.device_put(a, NamedSharding(mesh, weight(path)))
  params = jax.tree_util.tree_map_with_path(place, params)
  stats = params.pop("batch_stats")
  x = jax.device_put(x, NamedSharding(mesh, batch))

  def loss(p, x):
    y = net.apply({**p, "batch_stats": stats}, x, mutable=["batch_stats"])[0]
    return jnp.mean(jnp.square(y.astype(F32)))

  # FSDP under half_wire: its all-to-all is part of a gradient's sum.
  mode = "half_wire" if layout == "fsdp" else "fp32"
  with jax.set_mesh(mesh):
    report = jaxmp.reduction_report(
      jax.jit(jax.grad(jaxmp.autocast(loss, grad_reduce=mode))), params, x
    )
  got = {(r.kind, r.source) for r in report}
  layers = {"Net/inp", "Net/block/hidden", "Net/block/out"}
  # BatchNorm sums its batch statistics in the forward pass, and in the
  # backward its scale's and bias's gradients, which its input's cotangent
  # also uses: gradient sums all the same.
  want = {("gradient sum", s) for s in layers | {"Net/bn"}}
  want.add(("forward sum", "Net/bn"))
  if layout == "fsdp":
    want |= {("parameter gather", s) for s in layers}
  if layout == "tp":
    want |= {
      ("forward sum", "Net/block/out"),
      ("activation-cotangent sum", "Net/block/hidden"),
    }
  assert got == want, str(report)
  # Every gradient all-reduce in fp32; the tensor-parallel forward sum
  # stays in the product's dtype, as in Megatron-LM and PyTorch.
  assert {r.dtype for r in report.sums() if r.kind == "gradient sum"} == {"f32"}
  if layout == "fsdp":
    a2a = {(r.dtype, r.kind) for r in report if r.op == "all-to-all"}
    assert a2a == {("f16", "gradient sum")}, str(report)
  if layout == "tp":
    out = [r for r in report if r.kind == "forward sum" and "out" in r.source]
    assert {r.dtype for r in out} == {"f16"}, str(report)


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_app_steps_sum_in_fp32_on_4_devices(make_config, data_dir, policy):
  """The app's step compiled afresh (no persistent cache).

  Two stages on 8x8 images, batch 32: XLA's 3x3 convolutions, and the
  strided 1x1 projection, whose kernel gradient is products batched over
  groups of the batch and summed after (512 rows: 8 groups).
  """
  from cifar_train import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from cifar_train import settings  # pylint: disable=g-import-not-at-top
  from cifar_train import steps  # pylint: disable=g-import-not-at-top

  s = settings.resolve(
    make_config(data_dir, policy=policy, num_devices=4, batch_size=8)
  )
  assert s.precision.grad_reduce == "fp32"
  model = steps.create_model(
    s.model, num_classes=10, num_filters=4, precision=s.precision
  ).clone(stage_sizes=(1, 1))
  optimizer = steps.create_optimizer(s.precision, 0.05, momentum=0.9)
  state = steps.create_train_state(model, optimizer, (8, 8, 3), seed=0)
  mesh = mesh_lib.create_mesh(4, {"batch_size": 8})
  train_step = steps.make_train_step(
    model,
    optimizer,
    compute_dtype=s.precision.compute_dtype,
    grad_reduce=s.precision.grad_reduce,
    mesh=mesh,
  )
  rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  step = jax.jit(train_step, in_shardings=(rep, batch, batch, rep))
  images = jax.ShapeDtypeStruct((32, 8, 8, 3), F32, sharding=batch)
  labels = jax.ShapeDtypeStruct((32,), jnp.int32, sharding=batch)
  report = jaxmp.reduction_report(
    step, state, images, labels, steps.zero_metrics()
  )
  kernel = state.params["conv1"]["kernel"].shape
  sums = {(r.dtype, r.shape) for r in report.sums()}
  assert ("f32", kernel) in sums, str(report)
  assert not [r for r in report.sums() if r.dtype in HALF], str(report)


@pytest.mark.parametrize(
  "policy,mode", [("O1", None), ("O1", "half_wire"), ("O2", "half_wire")]
)
def test_app_steps_sum_as_configured_on_4_devices(
  make_config, data_dir, tiny_data, monkeypatch, policy, mode
):
  """The app's own train call (`loop.compile_steps`), as its config says.

  ``None``: a config without ``grad_reduce`` (an older one) sums in fp32.
  O1's ``grad_reduce`` reaches autocast (through the model's clone to one
  block), O2's ``jaxmp.value_and_grad``; both are traced with the job's
  mesh, over which ``"half_wire"`` splits the batch.
  """
  from _helpers import one_block_models  # pylint: disable=g-import-not-at-top
  from cifar_train import loop  # pylint: disable=g-import-not-at-top
  from cifar_train import settings  # pylint: disable=g-import-not-at-top
  from cifar_train import steps  # pylint: disable=g-import-not-at-top

  one_block_models(monkeypatch)
  config = make_config(
    data_dir,
    policy=policy,
    num_devices=4,
    batch_size=8,
    steps_per_call=1,
    data_on_device=False,  # The step is one jitted program.
  )
  if mode is None:
    del config["grad_reduce"]
  else:
    config.grad_reduce = mode
  s = settings.resolve(config)
  assert s.precision.grad_reduce == (mode or "fp32")
  job = loop.set_up(s, tiny_data)
  source = loop.make_batch_source(job)
  step_fn, _ = loop.compile_steps(job, source)
  like = lambda x: jax.ShapeDtypeStruct(
    x.shape, x.dtype, weak_type=x.weak_type, sharding=job.replicated
  )
  state = jax.tree.map(like, loop.make_init(job).trace().out_info)
  metrics = jax.tree.map(
    like, jax.eval_shape(steps.zero_metrics, state.opt_state)
  )
  report = jaxmp.reduction_report(
    step_fn, state, *source.step_args_like(), metrics
  )
  conv, fc = (state.params[k]["kernel"].shape for k in ("conv1", "fc"))
  sums = {(r.dtype, r.shape) for r in report.sums()}
  assert not [r for r in report.sums() if r.dtype in HALF], str(report)
  a2a = {r.dtype for r in report.rows if r.op == "all-to-all"}
  fc_sums = {("f32", fc), ("f32", fc[::-1])} & sums  # Either layout.
  if mode is None:
    assert ("f32", conv) in sums and fc_sums and not a2a, str(report)
  else:  # The dense kernel's partials sent in half, no sum of its shape.
    assert a2a == {"f16"} and not fc_sums, str(report)


def test_app_config_names_its_mode(make_config, data_dir, tmp_path, capsys):
  from cifar_train import reporting  # pylint: disable=g-import-not-at-top
  from cifar_train import settings  # pylint: disable=g-import-not-at-top
  from cifar_train.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from configs import seed  # pylint: disable=g-import-not-at-top

  assert seed.get_config().grad_reduce == "fp32"
  s = settings.resolve(make_config(data_dir, grad_reduce="half_wire"))
  assert s.precision.grad_reduce == "half_wire"
  with pytest.raises(ConfigError, match="unknown grad_reduce 'bf16'"):
    settings.resolve(make_config(data_dir, grad_reduce="bf16"))
  r = reporting.Reporter(
    str(tmp_path), num_devices=4, total_steps=1, progress_bar=False
  )
  r.log_grad_reduce("half_wire")
  assert capsys.readouterr().out == (
    "Gradients summed across 4 device(s) in half precision on the wire, "
    "added in fp32 (grad_reduce=half_wire)\n"
  )


def _conv_embed_loss(p, x, ids):
  conv = functools.partial(
    jaxmp_nn.conv_general_dilated, dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  h = jax.nn.relu(conv(x, p["k3"], (1, 1), ((1, 1), (1, 1))))
  # A strided 1x1 (9 output pixels): the rule's other kernel gradient.
  h = conv(h, p["k1"], (2, 2), ((0, 0), (0, 0)))
  e = p["table"][ids] @ p["w"]
  return jnp.mean(jnp.square(h.astype(F32))) + jnp.mean(
    jnp.square(e.astype(F32))
  )


def test_half_wire_o2_convs_and_embeddings():
  """jaxmp.nn's convolutions and a gathered table take the half wire too."""
  rng = np.random.default_rng(4)
  shapes = {"k3": (3, 3, 3, 8), "k1": (1, 1, 8, 8), "table": (16, 8)}
  shapes["w"] = (8, 8)
  p = {k: jnp.asarray(rng.normal(size=s) / 3, F16) for k, s in shapes.items()}
  x = jnp.asarray(rng.normal(size=(8, 6, 6, 3)), F16)
  ids = jnp.asarray(rng.integers(0, 16, size=(8, 4)), jnp.int32)
  mesh = _mesh("dp")
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  p = {k: put(v, P()) for k, v in p.items()}
  x, ids = put(x, P("data")), put(ids, P("data"))
  opt = jaxmp.mixed_precision(optax.sgd(0.1), loss_scale=8.0)
  state = opt.init(p)
  reports, grads = {}, {}
  for mode in ("half_wire", "native", "fp32"):
    step = jax.jit(
      lambda p, s, x, i, mode=mode: jaxmp.value_and_grad(
        _conv_embed_loss, grad_reduce=mode
      )(p, s, x, i)[1],
      out_shardings=NamedSharding(mesh, P()),
    )
    if mode != "fp32":
      reports[mode] = jaxmp.reduction_report(step, p, state, x, ids)
    grads[mode] = step(p, state, x, ids)
  wire = reports["half_wire"]
  assert {(r.op, r.dtype) for r in wire.rows} == {
    ("all-to-all", "f16"),
    ("all-gather", "f16"),
  }, str(wire)
  gathered = sorted(r.shape[0] for r in wire.rows if r.op == "all-gather")
  assert gathered == sorted(math.prod(s) for s in shapes.values()), str(wire)
  assert wire.bytes_sent <= 1.1 * reports["native"].bytes_sent
  for k in shapes:  # fp32's, within the partials' and the sum's rounding.
    g = np.asarray(grads["fp32"][k], np.float64)
    np.testing.assert_allclose(
      np.asarray(grads["half_wire"][k], np.float64),
      g,
      rtol=0,
      atol=8 * 2.0**-11 * np.max(np.abs(g)),
    )
