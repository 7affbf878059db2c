"""The autocast rules: the dtype each JAX primitive runs in.

``jaxmp.autocast`` traces a function to a jaxpr and runs it again
(`interpreter`), deciding the dtype of every operation by a rule:

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


The backward pass: ``dot_general`` is bound with half inputs and a half
``preferred_element_type``, so its transposes (the backward products) are half
x half too, as in torch; the casts of fp32 parameters transpose to casts back,
so gradients with respect to fp32 inputs are fp32.
"""

import functools
from typing import Optional

from jax import lax
import jax.numpy as jnp
import numpy as np

F16 = jnp.dtype(jnp.float16)
BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)
CASTABLE = frozenset({F16, BF16, F32})
HALF = frozenset({F16, BF16})

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
INDEPENDENT = frozenset(
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
AS_TRACED = frozenset(
  {
    "bitcast_convert_type",
    "pure_callback",
    "io_callback",
    "debug_callback",
    "ffi_call",
    "custom_call",
  }
)

AUTOCAST_MARK = "jaxmp_autocast"
#: A ``custom_vjp`` whose function name contains this is a normalisation
#: layer: its outputs shaped like its first (activation) input take that
#: input's dtype under autocast (``jaxmp.nn.BatchNorm``), as torch's
#: ``batch_norm`` on cudnn returns its input's dtype.
NORMALIZATION_MARK = "jaxmp_normalization"
NO_AUTOCAST_MARK = "jaxmp_no_autocast"
#: A ``jit`` by this name is `regions.reducing_in_fp32`'s: its body's weight
#: gradients are summed as asked already.
GRAD_REDUCE_MARK = "jaxmp_grad_reduce"


def castable(dtype) -> bool:
  """Whether autocast may cast a value of ``dtype`` (fp16, bf16, fp32)."""
  try:
    return jnp.dtype(dtype) in CASTABLE
  except TypeError:  # PRNG key types and other extended dtypes.
    return False


def is_float(dtype) -> bool:
  """Whether ``dtype`` is floating (fp8 and fp64 too)."""
  return jnp.issubdtype(dtype, jnp.floating)


def cast(x, dtype):
  """``x`` in ``dtype``: numpy stays numpy, no convert where it has it."""
  dtype = jnp.dtype(dtype)
  if isinstance(x, (np.ndarray, np.generic)):
    return np.asarray(x).astype(dtype) if x.dtype != dtype else x
  if x.dtype == dtype:
    return x
  return lax.convert_element_type(x, dtype)


def widest(dtypes) -> Optional[np.dtype]:
  """The promotion of ``dtypes`` (None for none)."""
  dtypes = list(dtypes)
  if not dtypes:
    return None
  return jnp.dtype(functools.reduce(jnp.promote_types, dtypes))


def unify(branch_dtypes):
  """Per output, the widest dtype among branches (castable floats only)."""
  out = []
  for ds in zip(*branch_dtypes):
    if all(castable(d) for d in ds):
      out.append(widest(ds))
    else:
      out.append(ds[0])
  return out
