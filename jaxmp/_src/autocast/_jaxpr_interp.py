"""Every use of JAX internals by :func:`jaxmp.autocast`, behind a small surface.

``autocast`` traces a function to a jaxpr and evaluates it again, equation by
equation, with casts. Reading a jaxpr and re-binding its equations needs JAX's
internal classes (``Var``, ``Literal``, ``ClosedJaxpr``, the parameters of
``jit``, ``scan``, ``cond``, ``while``, ``remat2``, ``shard_map``,
``custom_jvp_call`` and ``custom_vjp_call``, ``lu.WrappedFun``). They live in
this module only (and the custom-derivative rules' in `_jaxpr_custom`),
each behind one small function, and ``tests/test_autocast.py`` runs every
function here (one test per primitive family), so that a JAX upgrade that
moves them breaks a test and not a user.

The surface:

* :func:`trace` (a function and input types to a ``ClosedJaxpr``),
  :func:`evaluate` (re-runs a jaxpr, handing each equation to a callback),
  :func:`bind` (binds an equation's primitive again);
* :func:`kind` (which higher-order primitive an equation is, if any),
  :func:`call_name` (the ``name`` of a ``jit``, the marker of regions) and
  :func:`rule_name` (the Python name of a ``custom_vjp``/``custom_jvp``
  function, the marker of normalisation rules);
* ``run_*``: re-emit one higher-order equation with its bodies evaluated by
  a callback, through the public ``jax.lax``/``jax.shard_map`` API where it
  exists (``scan``, ``while``, ``cond``, ``remat``, ``shard_map``) and by
  re-binding with swapped bodies where it does not (``jit``; the custom
  rules' ``run_custom_jvp`` and ``run_custom_vjp`` are in `_jaxpr_custom`);
* :func:`describe` (primitive, user source line and name stack of an equation);
* :func:`loop_body` (whether a ``scan``/``while_loop``/``fori_loop`` is
  calling a function as its body, read from the Python stack).

Tested with jax 0.9.2 to 0.12.0.1 (parameters are read by name, unknown ones
are passed through). Up to jax 0.10 a ``ClosedJaxpr`` wraps a ``Jaxpr`` and
its consts; since jax 0.11 a ``Jaxpr`` carries its consts itself (0.11 kept
``ClosedJaxpr`` as an alias, 0.12 dropped it). Only `closed` and `close` know
which; the rest reads ``constvars``, ``invars``, ``eqns``, ``outvars``,
``consts`` and ``debug_info``, which both expose (a ``ClosedJaxpr`` forwards
them to its ``Jaxpr``), and never the ``.jaxpr`` of a closed one.
"""

from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
from jax import lax
import numpy as np

# pylint: disable=g-import-not-at-top
from jax._src import core as _core
from jax._src import source_info_util as _si

from jaxmp._src import frames as _frames

# pylint: enable=g-import-not-at-top

# A closed jaxpr's class: ``ClosedJaxpr`` up to jax 0.10, ``Jaxpr`` since 0.11
# (an alias in 0.11, gone in 0.12).
ClosedJaxpr = getattr(_core, "ClosedJaxpr", _core.Jaxpr)
_WRAPPED = ClosedJaxpr is not _core.Jaxpr  # jax <= 0.10: it wraps a Jaxpr.
Eqn = Any  # jax._src.core.JaxprEqn
Body = Callable[[Any, Sequence[Any]], list]  # (ClosedJaxpr, args) -> outs


# --------------------------------------------------------------------------
# Tracing, evaluating and binding.


def typeof(x) -> Any:
  """The abstract value of ``x`` (``ShapedArray``, with weak type and vma)."""
  return jax.typeof(x)


def trace(fn: Callable[..., Sequence[Any]], avals: Sequence[Any]):
  """``fn`` traced at abstract values ``avals``; returns ``(ClosedJaxpr)``.

  ``fn`` takes and returns flat sequences of arrays.
  """
  return jax.make_jaxpr(lambda *a: list(fn(*a)))(*avals)


def closed(jaxpr) -> ClosedJaxpr:
  """``jaxpr`` as a ``ClosedJaxpr`` (open ones, e.g. ``remat``'s, get no consts)."""
  if isinstance(jaxpr, ClosedJaxpr):
    return jaxpr
  return close(jaxpr, ())


def close(jaxpr, consts) -> ClosedJaxpr:
  """The open ``jaxpr`` with ``consts`` as the values of its constvars."""
  if _WRAPPED:
    return ClosedJaxpr(jaxpr, consts)
  return jaxpr.with_consts(consts)


def in_avals(eqn: Eqn) -> list:
  return [v.aval for v in eqn.invars]


def out_avals(eqn: Eqn) -> list:
  return [v.aval for v in eqn.outvars]


def jaxpr_in_avals(jaxpr) -> list:
  return list(closed(jaxpr).in_avals)


def jaxpr_out_avals(jaxpr) -> list:
  return list(closed(jaxpr).out_avals)


def primitive_name(eqn: Eqn) -> str:
  return eqn.primitive.name


def params(eqn: Eqn) -> dict:
  return dict(eqn.params)


def evaluate(
  jaxpr,
  args: Sequence[Any],
  handle: Callable[[Eqn, list, list], tuple[list, list]],
  weak_args: Optional[Sequence[bool]] = None,
  weak_literal: Callable[[Any], bool] = lambda v: True,
) -> tuple[list, list]:
  """Evaluates ``jaxpr`` on ``args``, each equation through ``handle``.

  Args:
    jaxpr: a ``ClosedJaxpr`` (or an open ``Jaxpr`` without constants).
    args: its inputs (arrays or tracers of the current trace).
    handle: ``handle(eqn, invals, inweak) -> (outvals, outweak)``; it binds
      the equation (or anything equivalent) on the current trace.
    weak_args: per input, whether it is weak (does not decide the dtype of an
      operation). Constants of the jaxpr are strong.
    weak_literal: whether a literal (given its value) is weak.

  Returns:
    ``(outs, outweak)``.
  """
  j = closed(jaxpr)
  env: dict = {}
  weak: dict = {}
  if weak_args is None:
    weak_args = [False] * len(args)
  if len(args) != len(j.invars):
    raise ValueError(f"jaxpr takes {len(j.invars)} inputs, got {len(args)}")
  for v, x in zip(j.constvars, j.consts):
    env[v], weak[v] = x, False
  for v, x, w in zip(j.invars, args, weak_args):
    env[v], weak[v] = x, bool(w)

  def read(v):
    if isinstance(v, _core.Literal):
      return v.val, weak_literal(v.val)
    return env[v], weak[v]

  for eqn in j.eqns:
    pairs = [read(v) for v in eqn.invars]
    invals = [p[0] for p in pairs]
    inweak = [p[1] for p in pairs]
    name_stack = _si.current_name_stack() + eqn.source_info.name_stack
    with (
      _si.user_context(eqn.source_info.traceback, name_stack=name_stack),
      eqn.ctx.manager,
    ):
      outs, outweak = handle(eqn, invals, inweak)
    for v, x, w in zip(eqn.outvars, outs, outweak):
      if not isinstance(v, _core.DropVar):
        env[v], weak[v] = x, w
  results = [read(v) for v in j.outvars]
  return [r[0] for r in results], [r[1] for r in results]


def bind(eqn: Eqn, args: Sequence[Any], **updates) -> list:
  """Binds ``eqn``'s primitive on ``args`` with its params (``updates`` win)."""
  p = dict(eqn.params, **updates)
  prim = eqn.primitive
  bind_params = prim.get_bind_params(p)
  if isinstance(bind_params, tuple):  # jax < 0.7: (subfuns, params).
    subfuns, bind_params = bind_params
    out = prim.bind(*subfuns, *args, **bind_params)
  else:
    out = prim.bind(*args, **bind_params)
  return list(out) if prim.multiple_results else [out]


def has_subjaxprs(eqn: Eqn) -> bool:
  """Whether ``eqn`` carries jaxprs in its params (a higher-order primitive)."""
  for v in eqn.params.values():
    vs = v if isinstance(v, (tuple, list)) else (v,)
    for u in vs:
      if isinstance(u, (ClosedJaxpr, _core.Jaxpr)):
        return True
  return eqn.primitive.name in ("custom_jvp_call", "custom_vjp_call")


# --------------------------------------------------------------------------
# Higher-order primitives.

_KINDS = {
  "jit": "jit",
  "pjit": "jit",
  "closed_call": "call",
  "core_call": "call",
  "remat2": "remat",
  "checkpoint": "remat",
  "cond": "cond",
  "scan": "scan",
  "while": "while",
  "shard_map": "shard_map",
  "custom_jvp_call": "custom_jvp",
  "custom_vjp_call": "custom_vjp",
}


def kind(eqn: Eqn) -> Optional[str]:
  """The family of a higher-order equation (``"jit"``, ``"scan"``...), or None.

  An equation with sub-jaxprs of another family gives ``"other"``.
  """
  k = _KINDS.get(eqn.primitive.name)
  if k is None and has_subjaxprs(eqn):
    return "other"
  return k


def call_name(eqn: Eqn) -> str:
  """The ``name`` param of a ``jit`` equation (``""`` for others)."""
  return str(eqn.params.get("name", "")) if kind(eqn) == "jit" else ""


def rule_name(eqn: Eqn) -> str:
  """The name of the function of a ``custom_vjp``/``custom_jvp`` (else ``""``).

  Read from the debug info of its traced primal (``"_f at file.py:3"`` on
  jax 0.10, ``func_name`` where jax has it).
  """
  if kind(eqn) not in ("custom_vjp", "custom_jvp"):
    return ""
  info = getattr(eqn.params["call_jaxpr"], "debug_info", None)
  if info is None:
    return ""
  name = getattr(info, "func_name", None)
  if not name:
    name = str(getattr(info, "func_src_info", "") or "").split(" ")[0]
  return str(name)


def _cast(x, dtype):
  if dtype is None or x.dtype == dtype:
    return x
  return lax.convert_element_type(x, dtype)


def _casts(xs, dtypes):
  return [_cast(x, d) for x, d in zip(xs, dtypes)]


def run_jit(eqn: Eqn, args, body: Body) -> list:
  """Re-binds a ``jit`` with its body evaluated by ``body`` (same name/shardings)."""
  inner = eqn.params["jaxpr"]
  new = trace(lambda *a: body(inner, a), [typeof(a) for a in args])
  return bind(eqn, args, jaxpr=new)


def run_call(eqn: Eqn, args, body: Body) -> list:
  """Inlines a ``closed_call``/``core_call``."""
  p = eqn.params
  return body(closed(p.get("call_jaxpr", p.get("jaxpr"))), args)


def run_remat(eqn: Eqn, args, body: Body) -> list:
  """Re-emits ``jax.checkpoint`` with its body evaluated by ``body``."""
  p = eqn.params
  inner = closed(p["jaxpr"])
  prevent_cse = p.get("prevent_cse", True)
  if not isinstance(prevent_cse, bool):
    prevent_cse = any(prevent_cse)
  fn = jax.checkpoint(
    lambda *a: list(body(inner, a)),
    prevent_cse=prevent_cse,
    policy=p.get("policy"),
  )
  return list(fn(*args))


def run_cond(eqn: Eqn, args, body: Body, unify: Callable) -> list:
  """Re-emits ``lax.switch``; ``unify(list of out dtype lists) -> dtypes``."""
  branches = eqn.params["branches"]
  index, ops = args[0], list(args[1:])
  avals = [typeof(o) for o in ops]
  out_dtypes = [
    [a.dtype for a in trace(lambda *a, b=b: body(b, a), avals).out_avals]
    for b in branches
  ]
  target = unify(out_dtypes)
  fns = [(lambda *a, b=b: _casts(body(b, a), target)) for b in branches]
  return list(lax.switch(index, fns, *ops))


def run_scan(eqn: Eqn, args, body: Body) -> list:
  """Re-emits ``lax.scan``; carries keep their traced dtypes."""
  p = eqn.params
  nc, nk = _scan_counts(p, len(args))
  consts, init, xs = args[:nc], list(args[nc : nc + nk]), list(args[nc + nk :])
  carry_dtypes = [a.dtype for a in in_avals(eqn)[nc : nc + nk]]
  inner = p["jaxpr"]

  def step(carry, x):
    outs = body(inner, [*consts, *carry, *x])
    return _casts(outs[:nk], carry_dtypes), list(outs[nk:])

  extra = {}
  if p.get("_split_transpose"):
    extra["_split_transpose"] = True
  carry, ys = lax.scan(
    step,
    _casts(init, carry_dtypes),
    xs,
    length=p["length"],
    reverse=p["reverse"],
    unroll=p["unroll"],
    **extra,
  )
  return [*carry, *ys]


def scan_counts(eqn: Eqn) -> tuple[int, int]:
  """(num_consts, num_carry) of a ``scan`` equation."""
  return _scan_counts(eqn.params, len(eqn.invars))


def _scan_counts(p: dict, n: int) -> tuple[int, int]:
  """(num_consts, num_carry) of a scan: params on jax 0.10, ``ft_in`` on 0.11."""
  if "num_consts" in p:
    return p["num_consts"], p["num_carry"]
  consts, carry, _ = p["ft_in"].update(list(range(n))).unpack()
  return len(list(consts)), len(list(carry))


def run_while(eqn: Eqn, args, body: Body) -> list:
  """Re-emits ``lax.while_loop``; carries keep their traced dtypes."""
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts, init = args[:cn], args[cn : cn + bn], args[cn + bn :]
  carry_dtypes = [a.dtype for a in in_avals(eqn)[cn + bn :]]

  def cond_fn(carry):
    return body(p["cond_jaxpr"], [*cconsts, *carry])[0]

  def body_fn(carry):
    return _casts(body(p["body_jaxpr"], [*bconsts, *carry]), carry_dtypes)

  return list(lax.while_loop(cond_fn, body_fn, _casts(init, carry_dtypes)))


def name_stack() -> str:
  """The name path jax traces under now (``jax.named_scope``s, modules)."""
  return str(_si.current_name_stack())


def run_shard_map(eqn: Eqn, args, body: Body) -> list:
  """Re-emits ``jax.shard_map`` with the same mesh, specs and axis names."""
  p = eqn.params
  inner = closed(p["jaxpr"])
  kwargs = {}
  if "newly_manual_axes" in p:
    kwargs["axis_names"] = set(p["newly_manual_axes"])
  elif "manual_axes" in p:
    kwargs["axis_names"] = set(p["manual_axes"])
  elif p.get("auto"):
    kwargs["axis_names"] = set(p["mesh"].axis_names) - set(p["auto"])
  check = p.get("check_vma", p.get("check_rep", True))
  fn = jax.shard_map(
    lambda *a: tuple(body(inner, a)),
    mesh=p["mesh"],
    in_specs=tuple(p["in_specs"]),
    out_specs=tuple(p["out_specs"]),
    check_vma=check,
    **kwargs,
  )
  return list(fn(*args))


def is_literal(v) -> bool:
  """Whether an equation's input ``v`` is a literal (not a variable)."""
  return isinstance(v, _core.Literal)


# --------------------------------------------------------------------------
# Loop bodies: which loop, if any, is tracing a function as its body.

_LOOPS = "jax._src.lax.control_flow.loops"
# fori_loop's wrappers that call the user's ``body(i, carry) -> carry``
# (through scan when the trip count is static, else through while_loop).
_FORI_BODIES = frozenset({"scanned_fun", "while_body_fun"})


def loop_body(frame) -> Optional[str]:
  """Which loop calls the function called from ``frame``, as its body.

  JAX traces a loop's body to a jaxpr and then requires its carry outputs
  to have its carry inputs' types. Read from the Python stack: the first
  frame outside JAX's own tracing machinery (and outside jaxmp's wrappers)
  is a frame of JAX's loops module.

  Args:
    frame: the frame that called the function (``sys._getframe(k)``).

  Returns:
    ``"scan"`` (a ``lax.scan`` body: its output is ``(carry, y)``),
    ``"carry"`` (a ``while_loop`` body or cond, a ``fori_loop`` body: its
    output is the carry), or None (called from user code, or from a loop of
    another kind such as ``lax.map``).
  """

  def outside(f):
    while f is not None:
      mod = f.f_globals.get("__name__", "")
      if mod == _LOOPS or not mod.startswith(("jax._src.", "jaxmp._src.")):
        return f
      f = f.f_back
    return None

  f = outside(frame)
  if f is None or f.f_globals.get("__name__") != _LOOPS:
    return None
  if f.f_code.co_name in _FORI_BODIES:
    return "carry"
  if f.f_code.co_name != "_create_jaxpr":
    return None
  g = outside(f.f_back)
  name = g.f_code.co_name if g is not None else ""
  if g is None or g.f_globals.get("__name__") != _LOOPS:
    return None
  return {"scan": "scan", "while_loop": "carry"}.get(name)


# --------------------------------------------------------------------------
# Reports.


class Described(NamedTuple):
  primitive: str
  source: str
  name_stack: str
  layer: str = ""


def _where(frame) -> str:
  return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def describe(eqn: Eqn) -> Described:
  """The primitive, user source line, name stack and layer of ``eqn``.

  The source line is the first frame outside jax, Flax, Equinox and jaxmp
  (the user's line that called the layer); ``layer`` is the first frame
  outside jax when that is a library's (``flax/.../linear.py``), else "".
  """
  info = eqn.source_info
  frames = list(_si.user_frames(info.traceback))
  user = _frames.first_user_frame(frames)
  first = frames[0] if frames else None
  source = _where(user or first) if (user or first) else "unknown"
  layer = _where(first) if first is not None and first is not user else ""
  return Described(eqn.primitive.name, source, str(info.name_stack), layer)


def literal_value(x) -> np.ndarray:
  """A literal's value as a numpy array."""
  return np.asarray(x)
