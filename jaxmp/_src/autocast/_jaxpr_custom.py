"""``custom_jvp`` and ``custom_vjp`` re-bound with their rules run by autocast.

The other half of `_jaxpr_interp`'s surface, kept apart for its size: the
JAX internals of custom-derivative rules (their bind parameters, wrapped
rule functions, symbolic zeros) behind two functions, `run_custom_jvp` and
`run_custom_vjp`. ``tests/test_autocast.py`` runs both.
"""

import contextlib
from typing import Any, Callable, Optional, Sequence

import numpy as np

# pylint: disable=g-import-not-at-top
from jax._src import linear_util as _lu

from jaxmp._src.autocast._jaxpr_interp import _cast
from jaxmp._src.autocast._jaxpr_interp import _casts
from jaxmp._src.autocast._jaxpr_interp import Body
from jaxmp._src.autocast._jaxpr_interp import close
from jaxmp._src.autocast._jaxpr_interp import Eqn
from jaxmp._src.autocast._jaxpr_interp import trace
from jaxmp._src.autocast._jaxpr_interp import typeof

try:  # jax >= 0.4.36
  from jax._src.ad_util import Zero as _Zero
except ImportError:  # pragma: no cover
  from jax.interpreters.ad import Zero as _Zero
try:
  from jax._src.custom_derivatives import SymbolicZero as _SymbolicZero
except ImportError:  # pragma: no cover
  _SymbolicZero = ()
# pylint: enable=g-import-not-at-top


def _wrap(fn, like):
  return _lu.wrap_init(fn, debug_info=like.debug_info)


def run_custom_jvp(
  eqn: Eqn, args, body: Body, out_dtypes_of: Callable[[list], list]
) -> list:
  """Re-binds a ``custom_jvp`` whose primal and JVP rule run through ``body``.

  The user's JVP rule (as traced) still defines the derivative; it is
  evaluated by ``body`` at the dtypes the values now have, and its outputs
  are cast to the primal's.

  Args:
    eqn: the ``custom_jvp_call`` equation.
    args: its inputs.
    body: the evaluator of a ``ClosedJaxpr``.
    out_dtypes_of: maps the dtypes the primal produced to the dtypes to give.
  """
  p = eqn.params
  call_jaxpr = p["call_jaxpr"]
  nconsts = p["num_consts"]
  jvp_fun = p["jvp_jaxpr_fun"]
  orig = bind_params_of(eqn)
  fun0, jvp0 = orig["subfuns"]
  box = {}
  primal = _primal(body, call_jaxpr, out_dtypes_of, box)

  def jvp(*xs):
    n = len(xs) // 2
    primals, tangents = xs[nconsts:n], xs[n + nconsts :]
    zeros = [type(t) is _SymbolicZero for t in tangents]
    jaxpr, consts, out_zeros = jvp_fun.call_wrapped(*zeros)
    nz = [t for t in tangents if type(t) is not _SymbolicZero]
    cj = close(jaxpr, consts)
    nz = [
      _cast(t, _tangent_dtype(pr))
      for t, pr in zip(nz, _nonzero(primals, zeros))
    ]
    out = body(cj, [*primals, *nz])
    nout = len(out_zeros)
    out_p, out_t = out[:nout], out[nout:]
    target = box.get("dtypes") or out_dtypes_of([o.dtype for o in out_p])
    out_p = _casts(out_p, target)
    it = iter(_casts(out_t, [d for d, z in zip(target, out_zeros) if not z]))
    out_t = [
      _SymbolicZero(typeof(pr).to_tangent_aval()) if z else next(it)
      for pr, z in zip(out_p, out_zeros)
    ]
    return [*out_p, *out_t]

  rest = {k: v for k, v in orig.items() if k != "subfuns"}
  out = eqn.primitive.bind(
    *args, subfuns=(_wrap(primal, fun0), _wrap(jvp, jvp0)), **rest
  )
  return list(out)


def _primal(body, call_jaxpr, out_dtypes_of, box):
  """The primal through ``body``, cast as ``out_dtypes_of`` says.

  The dtypes it casts to are kept in ``box["dtypes"]`` for the rules.
  """

  def primal(*a):
    outs = body(call_jaxpr, a)
    target = out_dtypes_of([o.dtype for o in outs])
    box["dtypes"] = target
    return _casts(outs, target)

  return primal


def _nonzero(xs, zeros):
  return [x for x, z in zip(xs, zeros) if not z]


def _tangent_dtype(x):
  return typeof(x).to_tangent_aval().dtype


def bind_params_of(eqn: Eqn) -> dict:
  bp = eqn.primitive.get_bind_params(dict(eqn.params))
  if isinstance(bp, tuple):  # pragma: no cover - jax < 0.7
    subfuns, bp = bp
    bp = dict(bp, subfuns=tuple(subfuns))
  return bp


def run_custom_vjp(
  eqn: Eqn,
  args,
  body: Body,
  out_dtypes_of: Callable[[list], list],
  ct_dtypes: Optional[Sequence[Any]] = None,
  res_dtypes_of: Optional[Callable[[list], list]] = None,
  bwd_body: Optional[Body] = None,
  bwd_context: Optional[Callable[[], Any]] = None,
) -> list:
  """Re-binds a ``custom_vjp`` whose primal and rules run through ``body``.

  The primal and the fwd rule (as traced) run through ``body``; the fwd rule
  saves the residuals it now computes (e.g. half-precision activations). The
  user's bwd rule still defines the derivative: it is called (as Python, so
  its own checks see consistent types) on those residuals and on the output
  cotangents cast to ``ct_dtypes`` (by default the traced output dtypes),
  traced, and its operations run through ``body`` too (as ``torch``'s
  ``custom_bwd`` runs a backward under the forward's autocast state). Its
  results are cast to the dtypes of the inputs.

  Args:
    eqn: the ``custom_vjp_call`` equation.
    args: its inputs.
    body: the evaluator of a ``ClosedJaxpr``.
    out_dtypes_of: maps the dtypes the primal produced to the dtypes to give.
    ct_dtypes: the dtypes of the output cotangents the bwd rule expects.
    res_dtypes_of: maps the residuals the fwd rule computed to the dtypes
      to save them in (by default, as computed).
    bwd_body: the evaluator of the bwd rule's operations (``body`` by
      default).
    bwd_context: a context manager factory, entered while the user's bwd
      rule is called (traced).
  """
  bwd_body = body if bwd_body is None else bwd_body
  p = eqn.params
  call_jaxpr = p["call_jaxpr"]
  nconsts = p["num_consts"]
  thunk = p["fwd_jaxpr_thunk"]
  orig = bind_params_of(eqn)
  fun0, fwd0, bwd0 = orig["subfuns"]
  in_tangent_avals = [typeof(a).to_tangent_aval() for a in args]
  nout = len(call_jaxpr.out_avals)
  if ct_dtypes is None:
    ct_dtypes = [a.to_tangent_aval().dtype for a in call_jaxpr.out_avals]
  box = {}
  primal = _primal(body, call_jaxpr, out_dtypes_of, box)

  def fwd(*a):
    vals, nonzeros = a[::2], a[1::2]
    if any(nonzeros[:nconsts]):
      from jax._src.interpreters import ad  # pylint: disable=g-import-not-at-top

      raise ad.CustomVJPException()
    primals = vals[nconsts:]
    jaxpr, consts = thunk.call_wrapped(*nonzeros[nconsts:])
    outs = body(close(jaxpr, consts), primals)
    nres = len(outs) - nout
    res, prim_out = list(outs[:nres]), list(outs[nres:])
    target = box.get("dtypes") or out_dtypes_of([o.dtype for o in prim_out])
    cast_out = _casts(prim_out, target)
    if res_dtypes_of is not None:
      # A residual that is also an output (a ReLU's output saved for its
      # mask) is cast once: the saved value is the returned one.
      same = {
        (id(o), np.dtype(d)): c for o, d, c in zip(prim_out, target, cast_out)
      }
      res = [
        same[id(r), np.dtype(d)]
        if (id(r), np.dtype(d)) in same
        else _cast(r, d)
        for r, d in zip(res, res_dtypes_of(res))
      ]
    return [*res, *cast_out]

  def call_bwd(*a):
    """The user's rule: ``(cotangents, logs, pair)``; logs from jax 0.11."""
    with bwd_context() if bwd_context else contextlib.nullcontext():
      out = bwd0.call_wrapped(*a)
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], list):
      return list(out[0]), out[1], True
    return list(out), None, False

  def finish(cts, logs, pair):
    out = []
    for ct, aval in zip(cts, in_tangent_avals):
      if isinstance(ct, _Zero):
        out.append(_Zero(aval))
      elif isinstance(ct, _SymbolicZero):
        out.append(_SymbolicZero(aval))
      else:
        out.append(_cast(ct, aval.dtype))
    return (out, logs) if pair else out

  def bwd(*a):
    res, cts = list(a[: len(a) - nout]), list(a[len(a) - nout :])
    if any(isinstance(c, (_Zero, _SymbolicZero)) for c in cts):
      return finish(*call_bwd(*res, *cts))
    cts = _casts(cts, ct_dtypes)
    meta = {}

    def traced(*xs):
      out, logs, pair = call_bwd(*xs)
      meta.update(logs=logs, pair=pair)
      meta["zero"] = [isinstance(o, (_Zero, _SymbolicZero)) for o in out]
      return [o for o, z in zip(out, meta["zero"]) if not z]

    jaxpr = trace(traced, [typeof(x) for x in (*res, *cts)])
    if meta["logs"] is not None:  # Logged rules run as written.
      return finish(*call_bwd(*res, *cts))
    it = iter(bwd_body(jaxpr, [*res, *cts]))
    cts_in = [
      _Zero(t) if z else next(it)
      for z, t in zip(meta["zero"], in_tangent_avals)
    ]
    return finish(cts_in, None, meta["pair"])

  rest = {k: v for k, v in orig.items() if k != "subfuns"}
  out = eqn.primitive.bind(
    *args,
    subfuns=(_wrap(primal, fun0), _wrap(fwd, fwd0), _wrap(bwd, bwd0)),
    **rest,
  )
  return list(out)
