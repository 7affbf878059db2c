"""The autocast interpreter: a jaxpr evaluated again with the `rules`.

Everywhere JAX code goes: ``jit`` bodies are rewritten and re-bound (same name
and shardings); ``scan``, ``while_loop``, ``cond``/``switch``, ``checkpoint``
and ``shard_map`` (same mesh, specs and axis names, collectives inside) are
re-emitted through ``jax.lax``/``jax.shard_map`` with their bodies rewritten;
loop carries keep their traced dtype (so a loop's type is fixed), ``cond``
branches agree on the widest dtype of each output. For ``custom_jvp`` and
``custom_vjp`` the user's rule still defines the derivative (a bwd rule that
clips the cotangent still clips it): the primal, the JVP rule and the fwd rule
are rewritten; the bwd rule is called on the residuals the fwd rule now saves
and on cotangents in the dtype plain JAX would give its outputs, and its
operations are rewritten too (as torch's ``custom_bwd``). A ``custom_vjp``
whose float inputs only feed matrix products (``jaxmp.nn``'s convolution) gets
them cast to ``dtype`` at its boundary, so it saves them in half.
``jaxmp.nn.BatchNorm``'s ``custom_vjp`` is a normalisation rule (its row
in `rules`): it returns, and saves for its backward pass, activations in its
input's dtype (half after a half convolution), so the residual adds and ReLUs
after it run and are saved in half, as in torch's O1 ResNet; its fp32
``batch_stats`` and the fp32 gradients of its scale and bias are unchanged.
Its eval mode (``use_running_average``) is no ``custom_vjp`` and follows the
widest-input row (fp32 out). Other
primitives with bodies (``reduce`` with a custom computation, ``scatter-add``
and its kin), bitcasts and callbacks run at their traced dtypes.
"""

import functools

from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.autocast import _jaxpr_custom as jc
from jaxmp._src.autocast import _jaxpr_interp as ji
from jaxmp._src.autocast import block_recipe as _block
from jaxmp._src.autocast import fp8 as _fp8
from jaxmp._src.autocast import report
from jaxmp._src.autocast import rules
from jaxmp._src.autocast import products
from jaxmp._src.reduction import wire

# Ops that pass a value through unchanged in substance: a product operand
# reached from a function input through them is a weight (or data, whose
# cotangent is never used), whose cotangent is a sum over the batch.
_STRUCTURAL = frozenset(
  {
    "convert_element_type",
    "reshape",
    "transpose",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "copy",
    "copy_p",
    "slice",
    "rev",
    "sharding_constraint",
    "reduce_precision",
    "mesh_cast",
    "reshard",
    "pvary",
    "pcast",
  }
)
# Linear ops whose transposes sum over what they broadcast or gather (a
# bias's or a norm scale's gradient, an embedding's scatter-add).
_SUMMED_BY_TRANSPOSE = frozenset({"broadcast_in_dim", "gather"})
# Elementwise ops that broadcast size-1 dims themselves (their transposes
# sum over them).
_BROADCASTING = frozenset({"add", "sub", "mul", "div", "max", "min"})


class Interpreter:
  """Evaluates jaxprs with the autocast rules, in dtype ``dtype``."""

  def __init__(
    self, dtype, natural: bool = False, fp8=None, grad_reduce="native"
  ):
    self.dtype = jnp.dtype(dtype)
    # "fp32"/"half_wire": the weight cotangents of half products, and the
    # sums of half weights' broadcasts and gathers, leave them in fp32
    # (reduction/products.py); "native": JAX's own dtypes.
    self.grad_reduce = grad_reduce
    # The values reached from the evaluated function's inputs through
    # structural ops only (weights, data), by id: see `_STRUCTURAL`. They
    # are held, so no other value takes their id, until the outermost `run`
    # returns.
    self._from_inputs: dict = {}
    # Block-scaled products need the weights too (block_recipe.py).
    self._track = grad_reduce != "native" or isinstance(fp8, _block.BlockRecipe)
    self._depth = 0
    # In the bwd rule of a custom_vjp whose fp32 inputs were cast to half at
    # its boundary (jaxmp.nn's convolution): products give fp32, rounded to
    # their half dtype after, so that a cross-device sum at their output
    # (GSPMD's place for it) runs in fp32.
    self.widen_products = False
    self.fp8 = fp8  # An Fp8Recipe: products in fp8 (fp8.py).
    self.max = float(jnp.finfo(self.dtype).max)
    # natural: no lists, every op in the widest dtype of its inputs (what
    # plain JAX computes from those dtypes).
    self.natural = natural
    # A jit's rewritten body by (its jaxpr, input types, weak flags): a model
    # calls the same jitted layer many times (ResNet18: 57 calls, 12 distinct
    # bodies), and rewriting each once also lets JAX's own per-jaxpr caches
    # (differentiation, lowering) hit for the repeats.
    self._jits: dict = {}

  def run(self, jaxpr, args, weak=None, sink=None, from_inputs=None):
    """``jaxpr`` evaluated on ``args``, each equation by `_eqn`.

    ``from_inputs``: per argument, whether it counts as a function input
    for ``grad_reduce`` (all of them by default).
    """
    if self._track:
      if from_inputs is None or len(from_inputs) != len(args):
        from_inputs = [True] * len(args)
      self._mark(x for x, f in zip(args, from_inputs) if f)

    def handle(eqn, invals, inweak):
      return self._eqn(eqn, invals, inweak, sink)

    self._depth += 1
    try:
      outs, _ = ji.evaluate(
        jaxpr, list(args), handle, weak, weak_literal=self._weak_literal
      )
    finally:
      self._depth -= 1
      if not self._depth:
        self._from_inputs.clear()
    return outs

  def _mark(self, values):
    self._from_inputs.update((id(x), x) for x in values)

  def _eqn(self, eqn, invals, inweak, sink):
    """One equation: its outputs and their weak-type flags."""
    k = ji.kind(eqn)
    if k is None:
      outs, inlined = self._first_order(eqn, invals, inweak), False
      if (
        self._track
        and ji.primitive_name(eqn) in _STRUCTURAL
        and invals
        and id(invals[0]) in self._from_inputs
      ):
        self._mark(outs)
    else:
      outs, inlined = self._with_bodies(k, eqn, invals, inweak, sink)
    if sink is not None and not inlined:
      report.check(sink, eqn, invals, outs)
    weak = all(inweak)
    return outs, [weak] * len(outs)

  def _first_order(self, eqn, invals, inweak):
    """A primitive without bodies, its inputs cast by the rules."""
    avals = ji.in_avals(eqn)
    name = ji.primitive_name(eqn)
    if self.grad_reduce != "native" and name in _BROADCASTING:
      invals = self._broadcast_weights(eqn, invals)
    if name in rules.AS_TRACED or any(
      rules.is_float(a.dtype) and not rules.castable(a.dtype) for a in avals
    ):
      return _as_traced(eqn, invals)
    idx = [i for i, a in enumerate(avals) if rules.castable(a.dtype)]
    if (
      name in _SUMMED_BY_TRANSPOSE
      and self.grad_reduce != "native"
      and idx == [0]
      and jnp.dtype(invals[0].dtype) in rules.HALF
      and id(invals[0]) in self._from_inputs
      and _sums_when_transposed(eqn)
    ):
      # A half weight broadcast or gathered as it is (its only float
      # operand): the transpose's sum over the batch runs in fp32.
      return [products.summed_in_fp32(eqn, invals, self.grad_reduce)]
    if not idx or name in rules.INDEPENDENT:
      return ji.bind(eqn, invals)
    updates = {}
    target = self._target(
      name, [invals[i] for i in idx], [inweak[i] for i in idx]
    )
    if name in rules.LOWER_PRECISION:
      # The traced default (the input dtype) follows the new inputs; a
      # preferred_element_type the user asked for is kept.
      pet = ji.params(eqn).get("preferred_element_type")
      if pet is not None and rules.castable(pet):
        if all(jnp.dtype(avals[i].dtype) == jnp.dtype(pet) for i in idx):
          updates["preferred_element_type"] = target
    two = name in rules.LOWER_PRECISION and len(idx) == 2 and not self.natural
    if two and self.fp8 is not None:
      out_dtype = updates.get(
        "preferred_element_type", pet if pet is not None else target
      )
      if isinstance(self.fp8, _block.BlockRecipe):
        out = self._block_product(eqn, invals, out_dtype)
      else:
        out = _fp8_product(self.fp8, eqn, invals, out_dtype)
      if out is not None:
        return out
    if (
      self.grad_reduce != "native"
      and name in products.PRODUCTS
      and len(idx) == 2
      and target in rules.HALF
    ):
      # A weight's cotangent (an fp32 operand cast to half, or a value
      # reached from the inputs) leaves the backward product in fp32.
      wide = [
        jnp.dtype(invals[i].dtype) == rules.F32
        or id(invals[i]) in self._from_inputs
        for i in idx
      ]
      if any(wide):
        out = products.product(
          eqn, invals, [target] * 2, wide, self.grad_reduce, updates
        )
        return [out]
    args = list(invals)
    for i in idx:
      args[i] = rules.cast(args[i], target)
    if (
      self.widen_products
      and name in products.PRODUCTS
      and len(idx) == 2
      and target in rules.HALF
      and "preferred_element_type" not in updates
    ):
      out = products.bind_f32(eqn, args, updates)
      # A product that asks for an fp32 output itself (jaxmp.nn's 1x1 kernel
      # gradient, summed over its batch groups after) keeps it.
      asked = ji.params(eqn).get("preferred_element_type")
      if asked is not None and jnp.dtype(asked) == rules.F32:
        return [out]
      return [rules.cast(out, target)]
    return ji.bind(eqn, args, **updates)

  def _block_product(self, eqn, invals, out_dtype):
    """``eqn`` block-scaled (block_recipe.py), or None where it is not."""
    recipe = self.fp8
    if ji.primitive_name(eqn) != "dot_general" or not rules.castable(out_dtype):
      return None  # Convolutions and ragged_dot run in dtype.
    if recipe.keep and recipe.keeps(ji.name_stack()):
      return None
    wide = [
      jnp.dtype(x.dtype) == rules.F32 or id(x) in self._from_inputs
      for x in invals[:2]
    ]
    weight = 1 if wide[1] else (0 if wide[0] else None)

    # The dequantized operands multiplied exactly in float32 (not TF32, a
    # GPU's default), as a block-scaled GEMM multiplies codes and scales.
    highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)

    def prim(a, b):
      return ji.bind(
        eqn, [a, b], preferred_element_type=rules.F32, precision=highest
      )[0]

    dims = ji.params(eqn)["dimension_numbers"]
    return [
      _block.product(
        prim, dims, invals[0], invals[1], recipe, out_dtype, weight
      )
    ]

  def _broadcast_weights(self, eqn, invals):
    """Half weights an elementwise op broadcasts, broadcast beforehand."""
    aval = ji.out_avals(eqn)[0]
    shape = tuple(aval.shape)
    out = list(invals)
    for i, x in enumerate(invals):
      if (
        hasattr(x, "shape")
        and tuple(x.shape) != shape
        and len(x.shape) == len(shape)
        and jnp.dtype(x.dtype) in rules.HALF
        and id(x) in self._from_inputs
      ):
        out[i] = products.broadcast_summed_in_fp32(x, shape, aval)
    return out

  def _target(self, name, floats, weak):
    """The dtype primitive ``name`` runs in, given its castable inputs."""
    if name in rules.LOWER_PRECISION and not self.natural:
      return self.dtype
    if name in rules.FLOAT32 and not self.natural:
      return rules.F32
    strong = [x.dtype for x, w in zip(floats, weak) if not w]
    return rules.widest(strong or [x.dtype for x in floats])

  def _with_bodies(self, k, eqn, invals, inweak, sink):
    """A primitive of kind ``k`` with bodies (``ji.kind``): outs, inlined.

    ``inlined``: the body was evaluated in line, its own equations checked
    for the debug report (so the equation itself is not).
    """
    # (An fp32 input's products are widened by its dtype alone: only half
    # inputs need the mark, and only they key the rewritten bodies.)
    ins = [
      id(x) in self._from_inputs
      and hasattr(x, "dtype")
      and jnp.dtype(x.dtype) in rules.HALF
      for x in invals
    ]
    if k == "jit":
      name = ji.call_name(eqn)
      if rules.NO_AUTOCAST_MARK in name or rules.AUTOCAST_MARK in name:
        return _as_traced(eqn, invals), False
      if self.natural and rules.GRAD_REDUCE_MARK in name:
        return _as_traced(eqn, invals), False  # Rewritten already.
      if sink is not None:
        return (
          self.run(ji.params(eqn)["jaxpr"], invals, inweak, sink, ins),
          True,
        )
      return self._jit(eqn, invals, inweak, ins), False
    if k == "call":
      params = ji.params(eqn)
      call = ji.closed(params.get("call_jaxpr", params.get("jaxpr")))
      return self.run(call, invals, inweak, sink, ins), True
    if k == "remat":
      outs = ji.run_remat(eqn, invals, self._body(inweak, ins))
    elif k == "cond":
      outs = ji.run_cond(
        eqn, invals, self._body(inweak[1:], ins[1:]), rules.unify
      )
    elif k == "scan":
      # A carry changes from trip to trip: never weak, even from a weak
      # init (jnp.zeros), or an fp32 accumulator would add in half.
      nc, nk = ji.scan_counts(eqn)
      weak = [w and not nc <= i < nc + nk for i, w in enumerate(inweak)]
      outs = ji.run_scan(eqn, invals, self._body(weak, ins))
    elif k == "while":
      outs = ji.run_while(eqn, invals, self._body())
    elif k == "shard_map":
      outs = ji.run_shard_map(eqn, invals, self._body(inweak, ins))
    elif k == "custom_jvp":
      outs = jc.run_custom_jvp(eqn, invals, self._body(inweak, ins), list)
    elif k == "custom_vjp":
      outs = self._custom_vjp(eqn, invals, inweak, ins)
    else:
      outs = _as_traced(eqn, invals)
    return outs, False

  def _jit(self, eqn, invals, inweak, ins):
    inner = ji.params(eqn)["jaxpr"]
    avals = [ji.typeof(x) for x in invals]
    try:
      key = (inner, tuple(avals), tuple(inweak), tuple(ins))
      hash(key)
    except TypeError:  # pragma: no cover - an unhashable type: no reuse.
      return ji.run_jit(eqn, invals, self._body(inweak, ins))
    body = self._jits.get(key)
    if body is None:
      run = self._body(inweak, ins)
      body = self._jits[key] = ji.trace(lambda *a: run(inner, a), avals)
    return ji.bind(eqn, invals, jaxpr=body)

  def _custom_vjp(self, eqn, invals, inweak, ins=None):
    call = ji.params(eqn)["call_jaxpr"]
    bwd_body = None
    avals = ji.in_avals(eqn)
    args = list(invals)
    only = inputs_only_multiplied(call, rules.LOWER_PRECISION)
    floats = [i for i, a in enumerate(avals) if rules.castable(a.dtype)]
    multiplied = bool(floats) and all(only[i] for i in floats)
    if multiplied and not self.natural:
      # When the float inputs only feed matrix products, they are cast at
      # the boundary, so the rule saves them in half precision as the
      # product itself would. All or none: a rule may insist (lax.conv does)
      # that its operands share a dtype.
      for i in floats:
        args[i] = rules.cast(args[i], self.dtype)
    bwd_context = None
    if multiplied and self.grad_reduce != "native":
      # Its weight cotangents come from the bwd rule's own products; the
      # rule's `wire.summed_over_batch` sums them as grad_reduce says.
      wide = Interpreter(self.dtype, self.natural, self.fp8)
      wide.widen_products = True
      bwd_body = wide._body()
      bwd_context = functools.partial(wire.reducing, self.grad_reduce)
    out_dtypes_of, res_dtypes_of = list, None
    if not self.natural and rules.NORMALIZATION_MARK in ji.rule_name(eqn):
      nc = ji.params(eqn)["num_consts"]
      out_dtypes_of, res_dtypes_of = _normalization(call, avals[nc:], args[nc:])
    ct_dtypes = None
    if [jnp.dtype(x.dtype) for x in args] != [
      jnp.dtype(a.dtype) for a in avals
    ]:
      # The cotangents the user's bwd rule expects: the output dtypes plain
      # JAX computes from the dtypes the inputs now have (a normalisation
      # layer's output cotangent in its output's dtype).
      natural = Interpreter(self.dtype, natural=True)
      ct_dtypes = out_dtypes_of(
        [
          a.dtype
          for a in ji.trace(
            lambda *a: natural.run(call, a), [ji.typeof(x) for x in args]
          ).out_avals
        ]
      )
    return jc.run_custom_vjp(
      eqn,
      args,
      self._body(inweak, ins),
      out_dtypes_of,
      ct_dtypes,
      res_dtypes_of,
      bwd_body=bwd_body,
      bwd_context=bwd_context,
    )

  def _body(self, inweak=None, inputs=None):
    def body(jaxpr, args):
      w = inweak if inweak is not None and len(inweak) == len(args) else None
      return self.run(jaxpr, args, w, from_inputs=inputs)

    return body

  # A literal is weak (a Python scalar: never widens an op) unless it does not
  # fit in the autocast dtype (e.g. finfo(float32).min as a mask value).
  def _weak_literal(self, value) -> bool:
    v = np.asarray(value)
    if not rules.is_float(v.dtype) or v.size != 1:
      return v.size == 1
    f = float(v.reshape(()))
    return not np.isfinite(f) or abs(f) <= self.max


# Type-only casts inside shard_map (an invariant value marked varying before
# a product): followed to their uses, as the value itself.
_TYPE_CASTS = frozenset({"pvary", "pcast"})


def inputs_only_multiplied(jaxpr, names: frozenset) -> list[bool]:
  """Per input of ``jaxpr``: is every use an operand of a primitive in ``names``?

  Uses inside ``jit`` bodies, and through ``pvary``/``pcast`` (shard_map's
  type casts), are followed; an input that is an output, or is used by
  anything else, is not.
  """
  j = ji.closed(jaxpr)
  ok = {v: True for v in j.invars}
  root: dict = {}  # A cast's output -> the input it casts.

  def of(v):
    if ji.is_literal(v):
      return None
    v = root.get(v, v)
    return v if v in ok else None

  for eqn in j.eqns:
    if eqn.primitive.name in names:
      continue
    if eqn.primitive.name in _TYPE_CASTS:
      for v, out in zip(eqn.invars, eqn.outvars):
        if of(v) is not None:
          root[out] = of(v)
      continue
    if ji.kind(eqn) == "jit":
      inner = inputs_only_multiplied(eqn.params["jaxpr"], names)
      for v, good in zip(eqn.invars, inner):
        if of(v) is not None and not good:
          ok[of(v)] = False
      continue
    for v in eqn.invars:
      if of(v) is not None:
        ok[of(v)] = False
  for v in j.outvars:
    if of(v) is not None:
      ok[of(v)] = False
  return [ok[v] for v in j.invars]


def _sums_when_transposed(eqn) -> bool:
  """A gather, or a broadcast that adds elements (not only size-1 dims)."""
  if ji.primitive_name(eqn) != "broadcast_in_dim":
    return True
  size = lambda a: int(np.prod(a.shape, dtype=np.int64))
  return size(ji.out_avals(eqn)[0]) > size(ji.in_avals(eqn)[0])


def _fp8_product(recipe, eqn, invals, out_dtype):
  """``eqn`` (a product of two castable floats) in fp8, or None."""
  name = ji.primitive_name(eqn)
  if name == "conv_general_dilated":
    if not _fp8.fp8_convolutions(recipe):
      return None
  elif name != "dot_general":
    return None  # ragged_dot runs in dtype.
  if not rules.castable(out_dtype):
    return None

  def prim(a, b):
    return ji.bind(eqn, [a, b], preferred_element_type=rules.F32)[0]

  return [_fp8.product(prim, invals[0], invals[1], recipe, out_dtype)]


def _normalization(call, avals, args):
  """Output and residual dtypes of a normalisation layer's ``custom_vjp``.

  The activation inputs are the float inputs shaped like the first one (the
  input and, for BatchNorm + residual add, the residual); per-channel inputs
  (scale, bias) are not. Outputs shaped like the activation take the widest
  dtype of the activation inputs as they now are (half after a convolution);
  the others (batch statistics) keep the dtype the rule computes (fp32).
  Residuals shaped like the activation are saved in that dtype when the rule
  computed them wider (e.g. BatchNorm+ReLU's output, whose sign is the mask).
  """
  shape = tuple(avals[0].shape)

  def act(a) -> bool:
    return tuple(a.shape) == shape and rules.castable(a.dtype)

  target = rules.widest(x.dtype for x, a in zip(args, avals) if act(a))
  out_act = [act(a) for a in ji.jaxpr_out_avals(call)]
  if target is None:
    return list, None

  def out_dtypes_of(dtypes):
    return [
      target if (a and rules.castable(d)) else d
      for d, a in zip(dtypes, out_act)
    ]

  def res_dtypes_of(res):
    return [
      target
      if act(r) and jnp.promote_types(r.dtype, target) == r.dtype
      else r.dtype
      for r in res
    ]

  return out_dtypes_of, res_dtypes_of


def _as_traced(eqn, invals):
  """Binds ``eqn`` unchanged, its float inputs cast back to the traced dtypes."""
  args = [
    rules.cast(x, a.dtype) if rules.castable(a.dtype) else x
    for x, a in zip(invals, ji.in_avals(eqn))
  ]
  return ji.bind(eqn, args)
