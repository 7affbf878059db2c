"""``jaxmp.autocast``: Apex O1 and ``torch.autocast`` for any JAX function.

``autocast(fun)`` traces ``fun`` (the model left as it is, in fp32) to a jaxpr
and runs that jaxpr again, deciding the dtype of every operation by a rule:

=================== ================================ ====================== ======================= ==========================================
jaxmp autocast      JAX primitives                   Apex O1 (CUDA)         torch.autocast (CUDA)   why jaxmp differs
=================== ================================ ====================== ======================= ==========================================
to ``dtype``        ``dot_general``,                 fp16: ``conv*``,       lower precision:        same rule. JAX has one primitive per
(fp16/bf16)         ``conv_general_dilated``,        ``linear``, ``matmul``, ``conv*``, ``linear``,  family: ``einsum``, ``matmul``, ``@``,
                    ``ragged_dot(_general)``         ``mm``, ``bmm``,       ``matmul``, ``bmm``,    ``dense`` and attention scores are all
                                                     ``addmm``, ``prelu``   ``einsum``, ``prelu``,  ``dot_general``. ``prelu`` and RNN cells
                                                                            RNN cells, SDPA         are compositions here: their products are
                                                                                                    half, their pointwise ops follow the
                                                                                                    widest-input row.
fp32: transcendental ``exp``, ``exp2``, ``log``,        fp32: ``exp``,         fp32: ``exp``,          same ops. ``log10``/``log2`` are ``log``
and power ops       ``log1p``, ``expm1``, ``pow``,   ``expm1``, ``log*``,   ``expm1``, ``log*``,    and a division in JAX. ``reciprocal`` is
                    ``integer_pow``, ``square``,     ``pow``, ``rsqrt``,    ``log1p``, ``pow``,     ``div`` (widest input) or
                    ``rsqrt``, ``tan``, ``asin``,    ``reciprocal``,        ``reciprocal``,         ``integer_pow(-1)`` (fp32). ``square`` and
                    ``acos``, ``atan``, ``sinh``,    ``tan``, ``asin``,     ``rsqrt``, ``tan``,     ``integer_pow`` are ``pow``: the square of
                    ``cosh``, ``asinh``, ``acosh``,  ``acos``, ``sinh``,    ``asin``, ``acos``,     an activation of 300 overflows fp16.
                    ``atanh``, ``erf_inv``           ``cosh``, ``erfinv``   ``sinh``, ``cosh``,     ``atan``/``asinh``/``acosh``/``atanh``
                                                                            ``erfinv``, softplus    join their family (torch leaves them
                                                                                                    unlisted). softplus is ``log1p(exp)``
                                                                                                    here, so fp32 through its parts.
fp32: sums and      ``reduce_sum``, ``reduce_prod``, fp32: ``sum``,         fp32 (dtype argument):  same ops. ``mean``/``var``/``std``/norms,
cumulative ops      ``cumsum``, ``cumprod``,         ``prod``, ``cumsum``,  ``sum``, ``prod``,      softmax, ``log_softmax``, ``logsumexp``,
                    ``cumlogsumexp``                 ``cumprod``, ``var``,  ``cumsum``,             layer/group norm and every loss are
                                                     ``std``, ``norm``,     ``cumprod``, softmax,   compositions of these primitives in JAX:
                                                     softmax, layer/group   ``log_softmax``, norms, their ``exp``, ``log``, squares and sums
                                                     norm, every loss       layer/group norm,       run in fp32, so they compute in fp32 as
                                                                            every loss,             in Apex and torch, and their pointwise
                                                                            ``logsumexp``           tails follow (widest input).
input's dtype:      a ``custom_vjp`` whose function  unlisted: cudnn's      unlisted:               same as torch. The rule is fused, so it
normalisation       name holds ``jaxmp_normaliz-     ``batch_norm`` takes a ``batch_norm`` on cudnn sees the whole layer, where the widest-
layers of           ation`` (``jaxmp.nn.Batch-       half input with fp32   returns its input's     input row would see ``half - fp32 mean``
``jaxmp.nn``        Norm`` in train mode): outputs   weights and returns    dtype; its statistics   and return fp32 (and the residual add and
(statistics fp32)   shaped like its input take the   half (Apex: "correctly and weight gradients    ReLU after it would run and be saved in
                    widest dtype of the inputs of    handles fp16 in/out    are fp32                fp32). Flax's ``nn.BatchNorm`` is a
                    that shape (input, residual);    with fp32 weights")                            composition of primitives with no such
                    mean/var stay fp32                                                              marker: it follows the widest-input row
                                                                                                    (fp32 out for fp32 scale/bias). To get
                                                                                                    torch's behaviour, use ``jaxmp.nn.Batch-
                                                                                                    Norm`` (same variables, a drop-in). Its
                                                                                                    residuals shaped like the input are saved
                                                                                                    in that dtype; weight gradients are fp32.
widest input dtype  every other floating op          promote: ``add``,      promote: ``cat``,       the same default as torch ("unlisted ops
(half stays half,   (``add``, ``mul``, ``max``,      ``mul``, ``div``,      ``stack``, ``atan2``,   are numerically stable in fp16"). Apex
half + fp32 is      ``select_n``, ``tanh``,          ``cat``, ``stack``,    ``addcmul``, ``index_   lists ``gelu``, ``softplus`` and
fp32)               ``logistic``, ``erf``, ``max``/  ``atan2``, compares;   put``; unlisted ops run ``interpolate`` as fp32: in JAX their
                    ``min`` reductions, ``concat``,  unlisted ops run in    in the input's dtype.   ``exp``/``pow`` parts are fp32 and the rest
                    gathers, collectives...)         the input's dtype.                             follows. Python scalars never widen an op
                                                                                                    (as in torch and JAX); an fp32 constant
                                                                                                    too large for ``dtype`` does.
left alone          integer, bool, float64 (and      —                      —                       fp64 is an explicit choice in JAX
                    fp8) values; explicit                                                           (``jax_enable_x64``); a user's
                    ``astype``/``convert_element_                                                   ``astype`` is kept as written.
                    type``; bitcasts, callbacks
banned              —                                ``binary_cross_       ``binary_cross_         nothing is banned: JAX's BCE is
                                                     entropy``              entropy``               ``log``/``log1p`` of fp32 values here.
=================== ================================ ====================== ======================= ==========================================

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
``jaxmp.nn.BatchNorm``'s ``custom_vjp`` is a normalisation rule (the row
above): it returns, and saves for its backward pass, activations in its
input's dtype (half after a half convolution), so the residual adds and ReLUs
after it run and are saved in half, as in torch's O1 ResNet; its fp32
``batch_stats`` and the fp32 gradients of its scale and bias are unchanged.
Its eval mode (``use_running_average``) is no ``custom_vjp`` and follows the
widest-input row (fp32 out). Other
primitives with bodies (``reduce`` with a custom computation, ``scatter-add``
and its kin), bitcasts and callbacks run at their traced dtypes.

The backward pass: ``dot_general`` is bound with half inputs and a half
``preferred_element_type``, so its transposes (the backward products) are half
x half too, as in torch; the casts of fp32 parameters transpose to casts back,
so gradients with respect to fp32 inputs are fp32.

Frameworks, with the model left as it is:

* Flax linen: ``jaxmp.autocast(model.apply)(variables, x, train=True,
  mutable=["batch_stats"])`` returns ``(out, updates)`` as ``apply`` does.
* Flax NNX: pass the model and its ``nnx.Rngs`` as they are,
  ``jaxmp.autocast(lambda m, x, r: m(x, rngs=r))(model, x, rngs)`` (or
  ``jaxmp.autocast(model)(x)``). They are split into their state for the
  traced call and what the call changed (BatchNorm statistics, RNG
  counters) is written back with ``nnx.update``, as ``nnx.jit`` does.

* Equinox: pass the module as an argument, ``jaxmp.autocast(lambda m, x:
  m(x))(model, x)``; its non-array fields are static. (``autocast(model)``
  also runs, with the model's arrays closed over.)

Arguments: array leaves (``jax.Array``, numpy) are traced; every other leaf
(Python scalars, strings, callables, ``mutable=[...]``) is static and keys
the cache. A cast to the dtype a value already has when ``fun`` is traced
(e.g. ``logits.astype(jnp.float32)`` in an fp32 model) leaves no trace in the
jaxpr: to force a region to fp32, use :func:`no_autocast`.

Regions: :func:`no_autocast` (Apex's ``amp.float_function``) runs its function
in fp32 and is left alone by an enclosing ``autocast``; a nested ``autocast``
region keeps its own dtype. Both are ``jit`` calls with a marker name, so they
survive being traced anywhere.
"""

import dataclasses
import functools
import logging
import sys
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import _jaxpr_interp as ji
from jaxmp._src import nnx_support
from jaxmp._src import fp8 as _fp8

logger = logging.getLogger("jaxmp")

_F16 = jnp.dtype(jnp.float16)
_BF16 = jnp.dtype(jnp.bfloat16)
_F32 = jnp.dtype(jnp.float32)
_CASTABLE = frozenset({_F16, _BF16, _F32})
_HALF = frozenset({_F16, _BF16})

#: Primitives that run in the autocast dtype.
LOWER_PRECISION = frozenset(
  {"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"}
)
#: Primitives that run in float32.
FLOAT32 = frozenset(
  {
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "pow",
    "integer_pow",
    "square",
    "rsqrt",
    "tan",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
    "erf_inv",
    "reduce_sum",
    "reduce_prod",
    "cumsum",
    "cumprod",
    "cumlogsumexp",
  }
)
# Operands are independent values: each keeps its dtype.
_INDEPENDENT = frozenset(
  {
    "psum",
    "psum_invariant",
    "pmax",
    "pmin",
    "ppermute",
    "pbroadcast",
    "all_gather",
    "all_gather_invariant",
    "all_to_all",
    "reduce_scatter",
    "psum_scatter",
    "optimization_barrier",
    "sort",
    "pvary",
    "pcast",
  }
)
# Run at the traced dtypes: the meaning depends on the bits or on the user.
_AS_TRACED = frozenset(
  {
    "bitcast_convert_type",
    "pure_callback",
    "io_callback",
    "debug_callback",
    "ffi_call",
    "custom_call",
  }
)

_AUTOCAST_MARK = "jaxmp_autocast"
#: A ``custom_vjp`` whose function name contains this is a normalisation
#: layer: its outputs shaped like its first (activation) input take that
#: input's dtype under autocast (``jaxmp.nn.BatchNorm``), as torch's
#: ``batch_norm`` on cudnn returns its input's dtype.
NORMALIZATION_MARK = "jaxmp_normalization"
_NO_AUTOCAST_MARK = "jaxmp_no_autocast"


class AutocastReport(NamedTuple):
  """Where an autocast forward pass first overflowed.

  Attributes:
    primitive: the JAX primitive (e.g. ``"dot_general"``).
    source: the user's source line, ``"file.py:12 (fn)"``.
    name_stack: the Flax/JAX name stack (``jax.named_scope``), or ``""``.
    dtype: the half-precision dtype of the non-finite output.
    layer: where a library layer (Flax, Equinox, jaxmp) ran the operation,
      ``"linear.py:287 (__call__)"``, when ``source`` is the user's line
      that called it; ``""`` when the user's code ran it directly.
  """

  primitive: str
  source: str
  name_stack: str
  dtype: str
  layer: str = ""

  def __str__(self) -> str:
    """One line: the primitive, name stack, source line and layer."""
    where = f" in {self.name_stack}" if self.name_stack else ""
    layer = f" (in the layer at {self.layer})" if self.layer else ""
    return (
      f"autocast: the first non-finite {self.dtype} output from finite "
      f"inputs is {self.primitive}{where} at {self.source}{layer}"
    )


def _castable(dtype) -> bool:
  try:
    return jnp.dtype(dtype) in _CASTABLE
  except TypeError:  # PRNG key types and other extended dtypes.
    return False


def _is_float(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def _cast(x, dtype):
  dtype = jnp.dtype(dtype)
  if isinstance(x, (np.ndarray, np.generic)):
    return np.asarray(x).astype(dtype) if x.dtype != dtype else x
  if x.dtype == dtype:
    return x
  return lax.convert_element_type(x, dtype)


def _widest(dtypes) -> Optional[np.dtype]:
  dtypes = list(dtypes)
  if not dtypes:
    return None
  return jnp.dtype(functools.reduce(jnp.promote_types, dtypes))


@dataclasses.dataclass
class _Sink:
  """Debug flags of one autocast region, in program order."""

  flags: list
  where: list


class _Interpreter:
  """Evaluates jaxprs with the autocast rules, in dtype ``dtype``."""

  def __init__(self, dtype, natural: bool = False, fp8=None):
    self.dtype = jnp.dtype(dtype)
    self.fp8 = fp8  # An Fp8Recipe: products in fp8 (jaxmp/_src/fp8.py).
    self.max = float(jnp.finfo(self.dtype).max)
    # natural: no lists, every op in the widest dtype of its inputs (what
    # plain JAX computes from those dtypes).
    self.natural = natural
    # A jit's rewritten body by (its jaxpr, input types, weak flags): a model
    # calls the same jitted layer many times (ResNet18: 57 calls, 12 distinct
    # bodies), and rewriting each once also lets JAX's own per-jaxpr caches
    # (differentiation, lowering) hit for the repeats.
    self._jits: dict = {}

  # A literal is weak (a Python scalar: never widens an op) unless it does not
  # fit in the autocast dtype (e.g. finfo(float32).min as a mask value).
  def _weak_literal(self, value) -> bool:
    v = np.asarray(value)
    if not _is_float(v.dtype) or v.size != 1:
      return v.size == 1
    f = float(v.reshape(()))
    return not np.isfinite(f) or abs(f) <= self.max

  def run(self, jaxpr, args, weak=None, sink=None):
    def handle(eqn, invals, inweak):
      return self._eqn(eqn, invals, inweak, sink)

    outs, _ = ji.evaluate(
      jaxpr, list(args), handle, weak, weak_literal=self._weak_literal
    )
    return outs

  def _body(self, inweak=None):
    def body(jaxpr, args):
      w = inweak if inweak is not None and len(inweak) == len(args) else None
      return self.run(jaxpr, args, w)

    return body

  def _eqn(self, eqn, invals, inweak, sink):
    k = ji.kind(eqn)
    inlined = False
    if k is None:
      outs = self._first_order(eqn, invals, inweak)
    elif k == "jit":
      name = ji.call_name(eqn)
      if _NO_AUTOCAST_MARK in name or _AUTOCAST_MARK in name:
        outs = _as_traced(eqn, invals)
      elif sink is not None:
        outs = self.run(ji.params(eqn)["jaxpr"], invals, inweak, sink)
        inlined = True
      else:
        outs = self._jit(eqn, invals, inweak)
    elif k == "call":
      outs = self.run(
        ji.closed(
          ji.params(eqn).get("call_jaxpr", ji.params(eqn).get("jaxpr"))
        ),
        invals,
        inweak,
        sink,
      )
      inlined = True
    elif k == "remat":
      outs = ji.run_remat(eqn, invals, self._body(inweak))
    elif k == "cond":
      outs = ji.run_cond(eqn, invals, self._body(inweak[1:]), _unify)
    elif k == "scan":
      # A carry changes from trip to trip: never weak, even from a weak
      # init (jnp.zeros), or an fp32 accumulator would add in half.
      nc, nk = ji.scan_counts(eqn)
      weak = [w and not nc <= i < nc + nk for i, w in enumerate(inweak)]
      outs = ji.run_scan(eqn, invals, self._body(weak))
    elif k == "while":
      outs = ji.run_while(eqn, invals, self._body())
    elif k == "shard_map":
      outs = ji.run_shard_map(eqn, invals, self._body(inweak))
    elif k == "custom_jvp":
      outs = ji.run_custom_jvp(eqn, invals, self._body(inweak), list)
    elif k == "custom_vjp":
      outs = self._custom_vjp(eqn, invals, inweak)
    else:
      outs = _as_traced(eqn, invals)
    if sink is not None and not inlined:
      _check(sink, eqn, invals, outs)
    weak = all(inweak)
    return outs, [weak] * len(outs)

  def _jit(self, eqn, invals, inweak):
    inner = ji.params(eqn)["jaxpr"]
    avals = [ji.typeof(x) for x in invals]
    try:
      key = (inner, tuple(avals), tuple(inweak))
      hash(key)
    except TypeError:  # pragma: no cover - an unhashable type: no reuse.
      return ji.run_jit(eqn, invals, self._body(inweak))
    body = self._jits.get(key)
    if body is None:
      run = self._body(inweak)
      body = self._jits[key] = ji.trace(lambda *a: run(inner, a), avals)
    return ji.bind(eqn, invals, jaxpr=body)

  def _custom_vjp(self, eqn, invals, inweak):
    call = ji.params(eqn)["call_jaxpr"]
    avals = ji.in_avals(eqn)
    args = list(invals)
    if not self.natural:
      # When the float inputs only feed matrix products, they are cast at
      # the boundary, so the rule saves them in half precision as the
      # product itself would. All or none: a rule may insist (lax.conv does)
      # that its operands share a dtype.
      only = ji.inputs_only_multiplied(call, LOWER_PRECISION)
      floats = [i for i, a in enumerate(avals) if _castable(a.dtype)]
      if floats and all(only[i] for i in floats):
        for i in floats:
          args[i] = _cast(args[i], self.dtype)
    out_dtypes_of, res_dtypes_of = list, None
    if not self.natural and NORMALIZATION_MARK in ji.rule_name(eqn):
      nc = ji.params(eqn)["num_consts"]
      out_dtypes_of, res_dtypes_of = _normalization(call, avals[nc:], args[nc:])
    ct_dtypes = None
    if [jnp.dtype(x.dtype) for x in args] != [
      jnp.dtype(a.dtype) for a in avals
    ]:
      # The cotangents the user's bwd rule expects: the output dtypes plain
      # JAX computes from the dtypes the inputs now have (a normalisation
      # layer's output cotangent in its output's dtype).
      natural = _Interpreter(self.dtype, natural=True)
      ct_dtypes = out_dtypes_of(
        [
          a.dtype
          for a in ji.trace(
            lambda *a: natural.run(call, a), [ji.typeof(x) for x in args]
          ).out_avals
        ]
      )
    return ji.run_custom_vjp(
      eqn, args, self._body(inweak), out_dtypes_of, ct_dtypes, res_dtypes_of
    )

  def _first_order(self, eqn, invals, inweak):
    avals = ji.in_avals(eqn)
    name = ji.primitive_name(eqn)
    if name in _AS_TRACED or any(
      _is_float(a.dtype) and not _castable(a.dtype) for a in avals
    ):
      return _as_traced(eqn, invals)
    idx = [i for i, a in enumerate(avals) if _castable(a.dtype)]
    if not idx or name in _INDEPENDENT:
      return ji.bind(eqn, invals)
    updates = {}
    if name in LOWER_PRECISION and not self.natural:
      target = self.dtype
    elif name in FLOAT32 and not self.natural:
      target = _F32
    else:
      strong = [invals[i].dtype for i in idx if not inweak[i]]
      target = _widest(strong or [invals[i].dtype for i in idx])
    if name in LOWER_PRECISION:
      # The traced default (the input dtype) follows the new inputs; a
      # preferred_element_type the user asked for is kept.
      pet = ji.params(eqn).get("preferred_element_type")
      if pet is not None and _castable(pet):
        if all(jnp.dtype(avals[i].dtype) == jnp.dtype(pet) for i in idx):
          updates["preferred_element_type"] = target
    two = name in LOWER_PRECISION and len(idx) == 2 and not self.natural
    if two and self.fp8 is not None:
      out = _fp8_product(
        self.fp8,
        eqn,
        invals,
        updates.get(
          "preferred_element_type", pet if pet is not None else target
        ),
      )
      if out is not None:
        return out
    args = list(invals)
    for i in idx:
      args[i] = _cast(args[i], target)
    return ji.bind(eqn, args, **updates)


def _fp8_product(recipe, eqn, invals, out_dtype):
  """``eqn`` (a product of two castable floats) in fp8, or None."""
  name = ji.primitive_name(eqn)
  if name == "conv_general_dilated":
    if not _fp8.fp8_convolutions(recipe):
      return None
  elif name != "dot_general":
    return None  # ragged_dot runs in dtype.
  if not _castable(out_dtype):
    return None

  def prim(a, b):
    return ji.bind(eqn, [a, b], preferred_element_type=_F32)[0]

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
    return tuple(a.shape) == shape and _castable(a.dtype)

  target = _widest(x.dtype for x, a in zip(args, avals) if act(a))
  out_act = [act(a) for a in ji.jaxpr_out_avals(call)]
  if target is None:
    return list, None

  def out_dtypes_of(dtypes):
    return [
      target if (a and _castable(d)) else d for d, a in zip(dtypes, out_act)
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
    _cast(x, a.dtype) if _castable(a.dtype) else x
    for x, a in zip(invals, ji.in_avals(eqn))
  ]
  return ji.bind(eqn, args)


def _unify(branch_dtypes):
  """Per output, the widest dtype among branches (castable floats only)."""
  out = []
  for ds in zip(*branch_dtypes):
    if all(_castable(d) for d in ds):
      out.append(_widest(ds))
    else:
      out.append(ds[0])
  return out


def _check(sink, eqn, invals, outs):
  """Appends a flag: half output non-finite while float inputs were finite."""
  half = [o for o in outs if hasattr(o, "dtype") and o.dtype in _HALF]
  if not half:
    return
  floats = [
    x
    for x in invals
    if hasattr(x, "dtype")
    and _is_float(x.dtype)
    and not isinstance(x, (np.ndarray, np.generic))
  ]
  finite_in = jnp.bool_(True)
  for x in floats:
    finite_in = finite_in & jnp.all(jnp.isfinite(x))
  bad_out = jnp.bool_(False)
  for o in half:
    bad_out = bad_out | ~jnp.all(jnp.isfinite(o))
  sink.flags.append(finite_in & bad_out)
  d = ji.describe(eqn)
  sink.where.append(
    AutocastReport(
      d.primitive, d.source, d.name_stack, str(half[0].dtype), d.layer
    )
  )


# ---------------------------------------------------------------------------
# Regions: a cached, named jit of a function of arbitrary pytrees.


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


class _Region:
  """``fun`` of any pytrees as a named ``jit`` of its array leaves.

  Non-array leaves (Python scalars, strings, callables, Equinox static
  fields, ``mutable=[...]``) are closed over and key a cache of jitted
  functions; ``jit``'s own cache then keys on shapes and dtypes, so an eager
  call traces ``fun`` once per signature.
  """

  def __init__(
    self, fun, name: str, impl: Callable, keep: Any = False, loops=False
  ):
    self.fun = fun
    self.name = name
    self.impl = impl  # impl(flat_fun, dyn) -> outs, with flat_fun traceable.
    self.keep = keep  # keep_output_dtypes: a bool or a prefix of the output.
    self.loops = loops  # As a loop's body, keep the carry's dtypes.
    self.cache: dict = {}

  def __call__(self, *args, **kwargs):
    # Called by a scan/while_loop/fori_loop as its body (through ``_wrap``)?
    loop = ji.loop_body(sys._getframe(1)) if self.loops else None
    if nnx_support.is_graph_node(self.fun):  # autocast(model): lift it too.
      args = (self.fun,) + args
    lifted = nnx_support.lift((args, kwargs))
    if lifted is None:
      return self._call((args, kwargs), lifted=False, loop=loop)
    out, new_state = self._call(lifted.tree, lifted=True, loop=loop)
    lifted.write_back(new_state)  # As nnx.jit: statistics, RNG counters.
    return out

  def _call(self, tree, lifted: bool, loop: Optional[str] = None):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    mask = tuple(_is_array(x) for x in leaves)
    dyn = [x for x, m in zip(leaves, mask) if m]
    static = tuple(x for x, m in zip(leaves, mask) if not m)
    key = (treedef, mask, static, lifted, loop)
    try:
      entry = self.cache.get(key)
    except TypeError:  # Unhashable static leaves: no cache.
      key, entry = None, None
    if entry is None:
      entry = self._make(treedef, mask, static, lifted, loop)
      if key is not None:
        self.cache[key] = entry
    jitted, outinfo = entry
    outs = jitted(*dyn)
    sig = _signature(dyn)
    out_tree, out_mask, out_static = outinfo.get(sig, outinfo["last"])
    it, st = iter(outs), iter(out_static)
    out_leaves = [next(it) if m else next(st) for m in out_mask]
    return jax.tree_util.tree_unflatten(out_tree, out_leaves)

  def _make(self, treedef, mask, static, lifted, loop=None):
    outinfo: dict = {}
    fun = self.fun
    if nnx_support.is_graph_node(fun):
      fun = lambda module, *a, **k: module(*a, **k)
    if self.keep is not False:
      fun = _keeping_dtypes(fun, self.keep)
    elif loop is not None:
      fun = _keeping_carry(fun, loop)
    caller = "jaxmp." + self.name.split("jaxmp_")[1].rsplit("_float", 1)[0]

    def flat_fun(*dyn):
      it, st = iter(dyn), iter(static)
      leaves = [next(it) if m else next(st) for m in mask]
      tree = jax.tree_util.tree_unflatten(treedef, leaves)
      if lifted:  # NNX objects: merged here, their new state returned.
        out = nnx_support.run(fun, tree, caller)
      else:
        args, kwargs = tree
        out = fun(*args, **kwargs)
        nnx_support.check_no_nodes(out, caller)
      out_leaves, out_tree = jax.tree_util.tree_flatten(out)
      out_mask = tuple(_is_array(x) for x in out_leaves)
      info = (
        out_tree,
        out_mask,
        tuple(x for x, m in zip(out_leaves, out_mask) if not m),
      )
      outinfo[_signature(dyn)] = outinfo["last"] = info
      return [x for x, m in zip(out_leaves, out_mask) if m]

    impl = self.impl

    def region(*dyn):
      return impl(flat_fun, dyn)

    region.__name__ = region.__qualname__ = self.name
    return jax.jit(region), outinfo


# A jit by this name is left as traced by an enclosing autocast region (it
# holds the autocast mark): its float inputs are cast back to the dtypes
# they had when ``fun`` was traced.
_KEEP_MARK = f"{_AUTOCAST_MARK}_keep_output_dtypes"


def _keeping_dtypes(fun, keep):
  """``fun`` whose outputs selected by ``keep`` keep their traced dtypes."""

  def identity(*xs):
    return xs

  identity.__name__ = identity.__qualname__ = _KEEP_MARK
  mark = jax.jit(identity)

  def keep_leaves(flag, sub):
    if flag is True:
      leaves, tree = jax.tree_util.tree_flatten(sub)
      idx = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
      if idx:
        kept = mark(*[leaves[i] for i in idx])
        for i, x in zip(idx, kept):
          leaves[i] = x
      return jax.tree_util.tree_unflatten(tree, leaves)
    if flag is False or flag is None:
      return sub
    raise TypeError(
      "keep_output_dtypes must be a bool or a tree of bools that is a "
      f"prefix of the output, got a {type(flag).__name__} leaf: {flag!r}"
    )

  def kept(*args, **kwargs):
    out = fun(*args, **kwargs)
    try:
      return jax.tree.map(keep_leaves, keep, out, is_leaf=lambda x: x is None)
    except ValueError as e:
      raise ValueError(
        "keep_output_dtypes must be True, False, or a tree of bools that is "
        f"a prefix of the function's output; got {keep!r} for an output of "
        f"structure {jax.tree_util.tree_structure(out)}"
      ) from e

  return kept


def _keeping_carry(fun, loop: str):
  """``fun``, a loop's body, whose carry outputs keep their traced dtypes.

  A loop requires its body's carry out to have the carry in's type: the
  carry's only legal dtype is the traced one, so autocast keeps it by itself
  (as ``keep_output_dtypes=True`` would, for the carry only). A scan body's
  stacked outputs ``y`` keep the dtypes the rules give them.
  """
  keep_all = _keeping_dtypes(fun, True)
  if loop != "scan":
    return keep_all

  def kept(*args, **kwargs):
    out = fun(*args, **kwargs)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
      return out  # Not (carry, y): lax.scan says what it expects.
    carry = _keeping_dtypes(lambda: out[0], True)()
    return [carry, out[1]] if isinstance(out, list) else (carry, out[1])

  return kept


def _signature(dyn) -> tuple:
  return tuple((tuple(x.shape), str(x.dtype)) for x in dyn)


def _report_fn(debug, where):
  def report(flags):
    flags = np.asarray(flags).reshape(-1, len(where))
    hit = np.any(flags, axis=0)
    if not hit.any():
      return
    rep = where[int(np.argmax(hit))]
    logger.warning("%s", rep)
    if callable(debug):
      debug(rep)

  return report


def autocast(
  fun: Callable,
  dtype: Any = None,
  *,
  debug: Union[bool, Callable[[AutocastReport], Any]] = False,
  keep_output_dtypes: Any = False,
  fp8: Union[bool, "_fp8.Fp8Recipe"] = False,
) -> Callable:
  """Runs ``fun`` with Apex O1 / ``torch.autocast`` rules, the model unchanged.

  Matrix products and convolutions run in ``dtype``; exp, log, powers, sums
  and cumulative ops run in float32; every other floating op runs in the
  widest floating dtype of its inputs (the Autocast guide has the rules op
  by op, against Apex O1 and ``torch.autocast``). Integer, bool and float64 values
  are left alone. ``fun`` is traced once per input signature: eager calls
  are jitted and cached.

  Output dtypes change: an output computed by a matrix product (a logit, a
  hidden state) comes back in ``dtype``, not in the dtype ``fun`` returns
  without autocast. Where the caller needs the dtypes unchanged, pass
  ``keep_output_dtypes=True``. A ``fun`` handed to ``lax.scan``,
  ``while_loop`` or ``fori_loop`` as its body keeps its carry's dtype by
  itself (the only dtype the loop accepts); a scan body's stacked outputs
  follow the rules.

  Flax NNX modules and ``nnx.Rngs`` may be passed as arguments (or be
  ``fun`` itself): they are split into their state for the
  traced call and every update the call makes (BatchNorm statistics, the
  RNG counters that draw dropout masks) is written back to them, as
  ``nnx.jit`` does. Flax is not imported unless the program already did.

  Args:
    fun: any JAX function of pytrees (a Flax ``apply``, an Equinox module
      call, an NNX module call, a loss function); non-array leaves and
      keyword arguments such as ``train=True`` or ``mutable=["batch_stats"]``
      are static.
    dtype: the lower precision, ``jnp.float16`` or ``jnp.bfloat16``; by
      default ``float16``, or ``bfloat16`` when ``fp8`` is on.
    debug: off (``False``, the default) costs nothing. ``True`` checks every
      operation with a half-precision output and, when one first produced a
      non-finite value from finite inputs, logs an :class:`AutocastReport`
      (primitive, source line, name stack) as a warning on the ``"jaxmp"``
      logger; a callable is also given the report. The flags are computed on
      the device and reported by one ``jax.debug.callback`` per call.
    keep_output_dtypes: ``False`` (default): outputs take the dtypes the
      rules give them, except a loop body's carry, which keeps its traced
      dtype. ``True``: every floating output is cast back to the dtype
      ``fun`` returns without autocast. Or a tree of bools, a prefix of the
      output's structure, to choose per output: ``(True, True)`` also keeps
      a scan body's stacked outputs ``y``.
    fp8: ``True`` or a :class:`Fp8Recipe`: every floating ``dot_general``
      (and convolution, where the backend runs fp8 convolutions) runs on
      ``float8_e4m3fn`` operands with per-tensor current scaling, its
      output cotangent in ``float8_e5m2``, its result in ``dtype``; the
      other operations follow ``dtype``'s rules (see the fp8 guide).

  Returns:
    A function with ``fun``'s signature.

  >>> import jax, jax.numpy as jnp, jaxmp
  >>> def mlp(w, x):
  ...   return jnp.log(jnp.sum(jnp.exp(jax.nn.relu(x @ w))))
  >>> f = jaxmp.autocast(mlp)
  >>> w, x = jnp.full((3, 2), 0.5), jnp.ones((4, 3))
  >>> print(f(w, x).dtype, jax.grad(f)(w, x).dtype)
  float32 float32
  >>> dots = [e for e in jax.make_jaxpr(f)(w, x).eqns[0].params["jaxpr"].eqns
  ...         if e.primitive.name == "dot_general"]
  >>> [str(v.aval.dtype) for v in dots[0].invars]
  ['float16', 'float16']
  """
  recipe = _fp8.recipe_of(fp8)
  if dtype is None:
    dtype = _F16 if recipe is None else _BF16
  dtype = jnp.dtype(dtype)
  if dtype not in _HALF:
    raise ValueError(
      f"autocast dtype must be float16 or bfloat16, got {dtype.name}"
    )
  interp = _Interpreter(dtype, fp8=recipe)

  def impl(flat_fun, dyn):
    traced = ji.trace(flat_fun, [ji.typeof(x) for x in dyn])
    weak = [ji.typeof(x).weak_type for x in dyn]
    if not debug:
      return interp.run(traced, dyn, weak)
    sink = _Sink([], [])
    outs = interp.run(traced, dyn, weak, sink)
    if sink.flags:
      jax.debug.callback(_report_fn(debug, sink.where), jnp.stack(sink.flags))
    return outs

  name = f"{_AUTOCAST_MARK}_{dtype.name}" + ("_fp8" if recipe else "")
  return _wrap(fun, _Region(fun, name, impl, keep_output_dtypes, loops=True))


def _wrap(fun, region):
  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    return region(*args, **kwargs)

  return wrapped


def no_autocast(fun: Callable) -> Callable:
  """Runs ``fun`` in float32, left alone by an enclosing :func:`autocast`.

  The opt-out of Apex's ``amp.float_function``: half-precision floating
  inputs are cast to float32, and an enclosing ``autocast`` does not touch
  the operations inside (they are a ``jit`` region with a marker name).

  Args:
    fun: any JAX function of pytrees.

  Returns:
    A function with ``fun``'s signature.

  >>> import jax.numpy as jnp, jaxmp
  >>> def f(w, x):
  ...   return jaxmp.no_autocast(lambda a, b: b @ a)(w, x) + x @ w
  >>> w, x = jnp.ones((3, 3)), jnp.ones((2, 3))
  >>> jaxmp.autocast(f)(w, x).dtype  # fp32 + half: fp32
  dtype('float32')
  """

  def impl(flat_fun, dyn):
    return flat_fun(*[_cast(x, _F32) if x.dtype in _HALF else x for x in dyn])

  return _wrap(fun, _Region(fun, _NO_AUTOCAST_MARK, impl))
