"""Where a step's weight gradients are summed across devices, and in what.

Each test reads the program right after XLA's SPMD partitioner
(`jaxmp.reduction_report`): XLA:CPU computes half all-reduces in fp32 in its
later passes, a GPU's NCCL does not. Meshes of the 4 forced CPU devices:
data parallel ``(4,)`` and FSDP ``(2, 2)``, params ``P("fsdp", None)``.
"""

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
@pytest.mark.parametrize("route", ["grad", "value_and_grad"])
def test_o1_sums_weight_gradients_in_fp32_by_default(kind, route):
  p, x = _data()
  mesh, p, x = _place(kind, p, x)
  loss = jaxmp.autocast(_mlp)
  if route == "grad":
    step = jax.jit(jax.grad(loss))
    args = (p, x)
  else:
    opt = jaxmp.mixed_precision(optax.sgd(0.1))

    def step(p, s, x):
      return jaxmp.value_and_grad(loss)(p, s, x)[1]

    step = jax.jit(step)
    args = (p, opt.init(p), x)
  with jax.set_mesh(mesh):
    report = jaxmp.reduction_report(step, *args)
  sums = _weight_sums(report)
  assert ("all-reduce", "f32") in sums, str(report)
  assert not [r for r in report.sums() if r.dtype in HALF], str(report)


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
  # The gradients keep their params' dtype; the step still trains.
  grads = jax.jit(lambda p, s, x: jaxmp.value_and_grad(_mlp)(p, s, x)[1])(
    p, state, x
  )
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(dtype)}
  new, _ = step(p, state, x)
  assert all(bool(jnp.any(new[k] != p[k])) for k in p)


def test_native_leaves_the_sums_half():
  p, x = _data()
  mesh, p, x = _place("dp", p, x)
  step = jax.jit(jax.grad(jaxmp.autocast(_mlp, grad_reduce="native")))
  report = jaxmp.reduction_report(step, p, x)
  assert ("all-reduce", "f16") in _weight_sums(report), str(report)


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
  partial to fp16 (relative 2**-11) before the sum.
  """
  rng = np.random.default_rng(1)
  x = rng.normal(size=(64, 8)).astype(np.float16).astype(np.float32)
  t = rng.normal(size=(64, 4)).astype(np.float16).astype(np.float32)
  w = jnp.ones((8, 4), F32)
  truth = x.astype(np.float64).T @ t.astype(np.float64)
  bound = 64 * 2.0**-24 * (np.abs(x).T @ np.abs(t))

  def loss(w, x, t):
    return jnp.sum((x @ w).astype(F32) * t)

  mesh = _mesh("dp")
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  errors = {}
  for mode in ("fp32", "native"):
    g = jax.jit(jax.grad(jaxmp.autocast(loss, grad_reduce=mode)))
    one = np.asarray(g(w, x, t), np.float64)
    sharded = np.asarray(
      g(put(w, P()), put(x, P("data")), put(t, P("data"))), np.float64
    )
    errors[mode] = (np.abs(one - truth), np.abs(sharded - truth))
  # fp32: one device and four both within fp32 rounding of the truth.
  assert np.all(errors["fp32"][0] <= bound)
  assert np.all(errors["fp32"][1] <= bound)
  # native: the single device's result is rounded to fp16 once (its output
  # is half), so even one device is off by up to half an fp16 ulp.
  assert np.max(errors["native"][0] - bound) > 0


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
  grads = {"w": jnp.asarray(local), "b": jnp.asarray(local[:, 0], F32)}

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
    "fp32": {("all-reduce", "f32", (6, 5))},
    "half_wire": {("all-to-all", "f16", (4, 8)), ("all-gather", "f16", (32,))},
    "native": {("all-reduce", "f16", (6, 5))},
  }[mode]
  assert want <= ops, str(report)
  out = mean(grads)
  assert out["w"].dtype == F16 and out["b"].dtype == F32
  exact = local.astype(np.float64).mean(0)
  # Rounded once to fp16 after an fp32 sum (half_wire: the chunk sum is
  # rounded to fp16 for the gather, then the mean): within 1.5 fp16 ulps.
  tol = 2.0**-10 * np.abs(exact) + 2.0**-24
  if mode == "native":  # Summed in fp16: 3 roundings of partial sums.
    tol = 4 * 2.0**-11 * np.abs(local.astype(np.float64)).sum(0) / 4 + tol
  assert np.all(np.abs(np.asarray(out["w"], np.float64) - exact) <= tol)
  np.testing.assert_allclose(out["b"], exact[0], rtol=1e-6, atol=1e-7)


def test_reduction_report_rows_bytes_and_table():
  mesh = _mesh("dp")

  @jax.jit
  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P()
  )
  def total(x):
    return jax.lax.psum(x[0], "data")

  report = jaxmp.reduction_report(total, jnp.ones((4, 8), F32))
  (row,) = report.rows
  assert (row.op, row.dtype, row.shape, row.devices) == (
    "all-reduce",
    "f32",
    (8,),
    4,
  )
  # A ring all-reduce sends 2 (n - 1) / n of its 32 bytes.
  assert row.bytes_sent == report.bytes_sent == 2 * 3 / 4 * 32
  text = str(report)
  assert text.splitlines()[0].split() == [
    "op",
    "dtype",
    "shape",
    "devices",
    "bytes",
    "sent",
  ]
  assert "all-reduce  f32" in text and "48 bytes sent per device" in text
  # One device: no collectives.
  assert jaxmp.reduction_report(jnp.sin, jnp.ones(3)).rows == ()


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_app_steps_sum_in_fp32_on_4_devices(make_config, data_dir, policy):
  from cifar_train import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from cifar_train import settings  # pylint: disable=g-import-not-at-top
  from cifar_train import steps  # pylint: disable=g-import-not-at-top

  s = settings.resolve(
    make_config(data_dir, policy=policy, num_devices=4, batch_size=8)
  )
  assert s.precision.grad_reduce == "fp32"
  model = steps.create_model(
    s.model, num_classes=10, num_filters=4, precision=s.precision
  ).clone(stage_sizes=(1, 1, 1))
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
