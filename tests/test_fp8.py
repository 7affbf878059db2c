"""jaxmp.autocast(fp8=...): fp8 products against a float64 emulation.

The emulation quantises as the recipe says (per-tensor scale ``fmax / amax``
computed in float32, round to e4m3fn or e5m2 with ml_dtypes) and sums the
dequantised products in float64. What remains is the float32 accumulation
(``K + 2`` roundings of ``2**-24`` of the summed magnitudes, per entry) and
the rounding of the result to the output dtype (``2**-8`` for bfloat16).
A product that skipped the fp8 rounding, or used the wrong format or scale,
is off by ``2**-4``-ish relative errors of its terms: far outside.
"""

import os
import re
import runpy

import jax
import jax.ad_checkpoint
from jax import lax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxmp

BF16, F32 = jnp.bfloat16, jnp.float32
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
P = jax.sharding.PartitionSpec


def quant(x, fmt):
  """(q * inv) in float64: x quantised as the recipe does, dequantised."""
  x32 = np.asarray(x, np.float32)
  amax = np.max(np.abs(x32))
  fmax = np.float32(ml_dtypes.finfo(fmt).max)
  scale = np.float32(1) if amax == 0 else np.float32(fmax / amax)
  q = np.clip(x32 * scale, -fmax, fmax).astype(fmt)
  return q.astype(np.float64) / np.float64(scale)


def check(got, want, terms, k, out_u=2.0**-8):
  """|got - want| <= (k + 2) 2**-24 terms + out_u |want|, per entry."""
  got = np.asarray(got, np.float64)
  tol = 2 * ((k + 2) * 2.0**-24 * terms + out_u * np.abs(want)) + 1e-30
  err = np.abs(got - want)
  assert np.all(err <= tol), (err.max(), (err / tol).max())


def _ab(m=8, k=32, n=16, seed=0):
  ka, kb = jax.random.split(jax.random.key(seed))
  return jax.random.normal(ka, (m, k)), 3.0 * jax.random.normal(kb, (k, n))


def test_forward_and_backward_match_the_emulation():
  a, b = _ab()
  f = jaxmp.autocast(lambda a, b: a @ b, fp8=True)
  out, vjp = jax.vjp(f, a, b)
  assert out.dtype == BF16
  da, db = quant(a, E4M3), quant(b, E4M3)
  check(out, da @ db, np.abs(da) @ np.abs(db), 32)
  ct = jax.random.normal(jax.random.key(3), out.shape, BF16)
  ga, gb = vjp(ct)
  assert ga.dtype == F32 and gb.dtype == F32
  dg = quant(np.asarray(ct, np.float32), E5M2)
  check(ga, dg @ db.T, np.abs(dg) @ np.abs(db.T), 16, 0)
  check(gb, da.T @ dg, np.abs(da.T) @ np.abs(dg), 8, 0)


def test_batched_einsum_and_grads_in_primal_dtypes():
  ka, kb = jax.random.split(jax.random.key(1))
  a = jax.random.normal(ka, (2, 4, 8), BF16)
  b = jax.random.normal(kb, (2, 8, 3))
  f = jaxmp.autocast(
    lambda a, b: jnp.einsum("bij,bjk->bik", a, b), BF16, fp8=True
  )
  out, vjp = jax.vjp(f, a, b)
  da, db = quant(np.asarray(a, np.float32), E4M3), quant(b, E4M3)
  check(out, da @ db, np.abs(da) @ np.abs(db), 8)
  ga, gb = vjp(jnp.ones_like(out))
  assert (ga.dtype, gb.dtype) == (BF16, F32)
  # A cotangent of ones quantises exactly: ga = sum_k db over the columns.
  check(
    ga,
    np.ones((2, 4, 3)) @ db.transpose(0, 2, 1),
    3 * np.abs(db).sum(2)[:, None],
    3,
  )


def test_saved_residuals_are_the_fp8_operands_and_scales(capsys):
  a, b = _ab()
  jax.ad_checkpoint.print_saved_residuals(
    jaxmp.autocast(lambda a, b: a @ b, fp8=True), a, b
  )
  saved = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
  assert sorted(saved) == sorted(
    ["f8_e4m3fn[8,32]", "f32[]", "f8_e4m3fn[32,16]", "f32[]"]
  )


def _instructions(hlo: str) -> dict:
  """Maps names to (result type, opcode, operand names) of every HLO instruction."""
  out = {}
  pat = re.compile(r"^\s*(?:ROOT )?([\w.\-]+) = (\S+) ([\w\-]+)\(([^)]*)\)")
  for line in hlo.splitlines():
    m = pat.match(line)
    if m:
      name, ty, op, rest = m.groups()
      out[name] = (ty, op, re.findall(r"[\w.\-]+", rest))
  return out


def test_lowered_products_are_scaled_fp8_converts():
  """Every dot takes convert(f8) * broadcast(scalar) operands.

  XLA's GPU GEMM rewriter matches that layout: forward e4m3 x e4m3, the two
  backward products e5m2 (the cotangent) x e4m3.
  """
  a, b = _ab()
  f = jaxmp.autocast(lambda a, b: jnp.sum(jnp.tanh(a @ b)), fp8=True)
  hlo = jax.jit(jax.grad(f, (0, 1))).lower(a, b).as_text(dialect="hlo")
  ins = _instructions(hlo)
  formats = []
  for ty, op, args in ins.values():
    if op != "dot":
      continue
    assert ty.startswith("f32[")
    pair = []
    for arg in args:
      _, mop, margs = ins[arg]
      assert mop == "multiply", (arg, mop)
      ops = sorted(ins[x][1] for x in margs)
      assert ops == ["broadcast", "convert"], ops
      (conv,) = [x for x in margs if ins[x][1] == "convert"]
      (bcast,) = [x for x in margs if ins[x][1] == "broadcast"]
      assert ins[ins[bcast][2][0]][0].startswith("f32[]")  # a scalar scale
      pair.append(ins[ins[conv][2][0]][0].split("[")[0])
    formats.append(tuple(sorted(pair)))
  assert formats.count(("f8e4m3fn", "f8e5m2")) == 2, formats
  assert set(formats) <= {("f8e4m3fn", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")}
  assert ("f8e4m3fn", "f8e4m3fn") in formats


def test_non_finite_operand_gives_non_finite_product_and_grads():
  a, b = _ab()
  f = jaxmp.autocast(lambda a, b: jnp.sum(a @ b), fp8=True)
  for bad in (jnp.inf, -jnp.inf, jnp.nan):
    a_bad = a.at[1, 2].set(bad)
    out = jaxmp.autocast(lambda a, b: a @ b, fp8=True)(a_bad, b)
    assert not np.any(np.isfinite(np.asarray(out, np.float32))), bad
    grads = jax.grad(f, (0, 1))(a_bad, b)
    assert not bool(jaxmp.all_finite(grads))


def test_all_zero_operand_gives_zeros():
  a, b = _ab()
  f = jaxmp.autocast(lambda a, b: a @ b, fp8=True)
  z = jnp.zeros_like(a)
  out, vjp = jax.vjp(f, z, b)
  np.testing.assert_array_equal(out, 0)
  ga, gb = vjp(jnp.ones_like(out))
  np.testing.assert_array_equal(gb, 0)
  check(
    ga,
    np.ones((8, 16)) @ quant(b, E4M3).T,
    np.abs(quant(b, E4M3)).sum(1)[None],
    16,
    0,
  )
  _, vjp = jax.vjp(f, a, b)
  ga, gb = vjp(jnp.zeros_like(out))
  np.testing.assert_array_equal(ga, 0)
  np.testing.assert_array_equal(gb, 0)


_BODIES = {
  "jit": lambda a, b: jax.jit(jnp.matmul)(a, b),
  "remat": lambda a, b: jax.checkpoint(jnp.matmul)(a, b),
  "cond": lambda a, b: lax.cond(
    jnp.sum(a) > -1e9, jnp.matmul, lambda a, b: -(a @ b), a, b
  ),
  "scan": lambda a, b: lax.scan(lambda c, _: (c, a @ b), 0.0, None, 1)[1][0],
  "while": lambda a, b: lax.while_loop(
    lambda c: c[0] < 1, lambda c: (c[0] + 1, a @ b), (0, jnp.zeros((8, 16)))
  )[1],
  "custom_jvp": jax.custom_jvp(jnp.matmul),
}
_BODIES["custom_jvp"].defjvp(
  lambda p, t: (p[0] @ p[1], t[0] @ p[1] + p[0] @ t[1])
)


@pytest.mark.parametrize("kind", sorted(_BODIES))
def test_products_inside_bodies_run_in_fp8(kind):
  a, b = _ab()
  out = jaxmp.autocast(_BODIES[kind], fp8=True)(a, b)
  da, db = quant(a, E4M3), quant(b, E4M3)
  check(out, da @ db, np.abs(da) @ np.abs(db), 32)


def test_custom_vjp_rule_still_defines_the_gradient():
  @jax.custom_vjp
  def mm(a, b):
    return a @ b

  def fwd(a, b):
    return a @ b, (a, b)

  def bwd(res, g):
    a, b = res
    return 3.0 * (g @ b.T), a.T @ g

  mm.defvjp(fwd, bwd)
  a, b = _ab()
  f = jaxmp.autocast(mm, fp8=True)
  out, vjp = jax.vjp(f, a, b)
  # The inputs of a rule that only multiplies are cast to bf16 at its
  # boundary (saved in bf16), then quantised.
  a16, b16 = (np.asarray(x.astype(BF16), np.float32) for x in (a, b))
  da, db = quant(a16, E4M3), quant(b16, E4M3)
  check(out, da @ db, np.abs(da) @ np.abs(db), 32)
  ga, _ = vjp(jnp.ones_like(out))
  # The rule's own product g @ b.T runs in fp8 too (its operands: the
  # bf16 cotangent of ones and b, both e4m3, as any product of the rule).
  check(
    ga,
    3.0 * np.ones((8, 16)) @ db.T,
    3.0 * np.abs(db).sum(1)[None],
    16,
    2.0**-7,  # the rule's product is bf16, and so is 3 * it.
  )


@pytest.mark.devices(2)
@pytest.mark.parametrize("axes", [(), ("data",)])
def test_shard_map_amax_per_shard_unless_global(axes):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  a, b = _ab()
  a = a.at[:4].multiply(100.0)  # the shards' amax differ 100x.
  f = jax.shard_map(
    lambda a, b: a @ b,
    mesh=mesh,
    in_specs=(P("data"), P()),
    out_specs=P("data"),
  )
  out = jaxmp.autocast(f, fp8=jaxmp.Fp8Recipe(amax_axes=axes))(a, b)
  db = quant(b, E4M3)
  if axes:
    da = quant(a, E4M3)
  else:
    da = np.concatenate([quant(a[:4], E4M3), quant(a[4:], E4M3)])
  check(out, da @ db, np.abs(da) @ np.abs(db), 32)


def _conv(x, w):
  return lax.conv_general_dilated(
    x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


def test_convolutions_in_fp8_on_cpu_and_in_dtype_when_asked():
  kx, kw = jax.random.split(jax.random.key(2))
  x = jax.random.normal(kx, (2, 5, 5, 3))
  w = jax.random.normal(kw, (3, 3, 3, 4))
  assert jax.default_backend() == "cpu"
  out = jaxmp.autocast(_conv, fp8=True)(x, w)
  assert out.dtype == BF16
  dx, dw = quant(x, E4M3), quant(w, E4M3)
  with jax.enable_x64(True):
    want = np.asarray(_conv(jnp.asarray(dx), jnp.asarray(dw)))
    terms = np.asarray(
      _conv(jnp.abs(jnp.asarray(dx)), jnp.abs(jnp.asarray(dw)))
    )
  check(out, want, terms, 27)
  jp = jax.make_jaxpr(jaxmp.autocast(_conv, fp8=jaxmp.Fp8Recipe(conv=False)))(
    x, w
  )
  body = jp.eqns[0].params["jaxpr"].eqns
  # The bf16 product sits in the custom_vjp that widens its weight's
  # cotangent (grad_reduce="fp32").
  inner = [
    e
    for c in body
    if c.primitive.name == "custom_vjp_call"
    for e in c.params["call_jaxpr"].eqns
  ]
  (e,) = [e for e in body + inner if e.primitive.name == "conv_general_dilated"]
  assert [str(v.aval.dtype) for v in e.invars] == ["bfloat16", "bfloat16"]


def test_recipe_and_arguments():
  assert jaxmp.Fp8Recipe().forward == jnp.float8_e4m3fn
  with pytest.raises(ValueError, match="float8"):
    jaxmp.Fp8Recipe(forward=jnp.bfloat16)
  with pytest.raises(ValueError, match="margin"):
    jaxmp.Fp8Recipe(margin=-1)
  with pytest.raises(TypeError, match="Fp8Recipe"):
    jaxmp.autocast(jnp.matmul, fp8="e4m3")
  a, b = _ab()
  # fp16 results on request; a margin of 1 halves the largest code.
  out = jaxmp.autocast(jnp.matmul, jnp.float16, fp8=jaxmp.Fp8Recipe(margin=1))(
    a, b
  )
  assert out.dtype == jnp.float16
  x32 = np.asarray(a, np.float32)
  s = np.float32(224.0 / np.max(np.abs(x32)))
  da = np.clip(x32 * s, -224, 224).astype(E4M3).astype(np.float64) / np.float64(
    s
  )
  db = quant(b, E4M3)
  check(out, da @ quant(b, E4M3), np.abs(da) @ np.abs(db), 32, 2.0**-11)


def test_quantize_scales():
  from jaxmp._src.autocast import fp8  # pylint: disable=g-import-not-at-top

  recipe = jaxmp.Fp8Recipe()
  q, inv = fp8.quantize(jnp.zeros((3,)), jnp.float8_e4m3fn, recipe)
  assert float(inv) == 1.0 and not np.any(np.asarray(q, np.float32))
  x = jnp.array([0.5, -2.0, 1.0])
  q, inv = fp8.quantize(x, jnp.float8_e5m2, recipe)
  assert float(inv) == np.float32(1) / (np.float32(57344) / np.float32(2))
  np.testing.assert_array_equal(
    np.asarray(q, np.float32), [14336, -57344, 28672]
  )


def test_byte_lm_fp8_example_trains_like_bf16(capsys, tmp_path):
  pytest.importorskip("flax")  # The example's model is a linen module.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  ns = runpy.run_path(
    os.path.join(root, "examples", "byte_lm_fp8.py"), run_name="x"
  )
  # A corpus of its own (the default one, the repository's pages, changes
  # with every edit of the docs): 3000 words drawn from 13, so that 12 steps
  # at a high learning rate learn well below the uniform 5.5 nats.
  words = "the quick brown fox jumps over a lazy dog and then runs far away"
  rng = np.random.default_rng(0)
  corpus = tmp_path / "corpus.txt"
  corpus.write_text(" ".join(rng.choice(words.split(), 3000)))
  args = (
    f"--text {corpus} --steps 12 --batch-size 4 --length 16 --width 32"
    " --depth 1 --heads 2 --learning-rate 1e-2"
  )
  result = ns["main"](args.split())
  b, f = result["curves"]["bf16"], result["curves"]["fp8"]
  assert len(b) == len(f) == 12
  assert np.mean(f[-3:]) < f[0] - 2.0, f  # fp8 trains ...
  assert f[0] != b[0]  # ... computing in fp8 (same params and batch) ...
  assert abs(result["gap"]) <= 0.02 and result["skipped"] == 0  # ... as bf16
  assert "final held-out loss" in capsys.readouterr().out
