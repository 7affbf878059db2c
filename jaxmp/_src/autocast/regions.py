"""``jaxmp.autocast`` and ``jaxmp.no_autocast``: regions of a program.

Each is a cached, named ``jit`` of a function of arbitrary pytrees
(`_Region`). In an ``autocast`` region the traced jaxpr runs again through
the `interpreter`, by the `rules`.

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

import functools
import sys
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import nnx_support
from jaxmp._src.autocast import _jaxpr_interp as ji
from jaxmp._src.autocast import fp8 as _fp8
from jaxmp._src.autocast import interpreter
from jaxmp._src.autocast import report
from jaxmp._src.autocast import rules
from jaxmp._src.autocast.report import AutocastReport
from jaxmp._src.reduction import wire


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
    self,
    fun,
    name: str,
    impl: Callable,
    keep: Any = False,
    loops=False,
    caller: Optional[str] = None,
  ):
    self.fun = fun
    self.name = name
    # The public function named in errors about NNX arguments.
    self.caller = caller or (
      "jaxmp." + name.split("jaxmp_")[1].rsplit("_float", 1)[0]
    )
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
    caller = self.caller

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
_KEEP_MARK = f"{rules.AUTOCAST_MARK}_keep_output_dtypes"


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


def autocast(
  fun: Callable,
  dtype: Any = None,
  *,
  debug: Union[bool, Callable[[AutocastReport], Any]] = False,
  keep_output_dtypes: Any = False,
  fp8: Union[bool, str, "_fp8.Fp8Recipe", "_fp8._block.BlockRecipe"] = False,
  grad_reduce: str = "fp32",
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
      non-finite value from finite inputs, logs an :class:`report.AutocastReport`
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
      ``"mxfp8"``, ``"deepseek"``, ``"nvfp4"`` or a :class:`BlockRecipe`:
      block scaling instead, each operand quantized in blocks along each
      product's contraction axis, forward and backward (see the guide
      "Block-scaled fp8 and fp4").
    grad_reduce: the dtype of the weight gradients' cross-device sums.
      ``"fp32"`` (default): the backward product that gives a weight's
      gradient (an fp32 param's, or any input's) outputs fp32, so the sum
      XLA places there runs in fp32 (on one device, the gradient no longer
      passes through half). ``"half_wire"``: half on the wire, fp32 adds
      (an all-to-all of half partials over the mesh of ``jax.set_mesh``, or
      of the inputs' shardings; each device's sum is its shard of the
      gradient, a replicated one gathered in half).
      ``"native"``: JAX's dtypes (the sums in half), and forward-mode
      differentiation (``jax.jvp``) of the products, which the other two do
      not support. See the sharded-training guide.

  Returns:
    A function with ``fun``'s signature.

  >>> import jax, jax.numpy as jnp, jaxmp
  >>> def mlp(w, x):
  ...   return jnp.log(jnp.sum(jnp.exp(jax.nn.relu(x @ w))))
  >>> f = jaxmp.autocast(mlp)
  >>> w, x = jnp.full((3, 2), 0.5), jnp.ones((4, 3))
  >>> print(f(w, x).dtype, jax.grad(f)(w, x).dtype)
  float32 float32
  >>> "f16[4,2] = dot_general" in str(jax.make_jaxpr(f)(w, x))  # x @ w
  True
  """
  grad_reduce = wire.check_mode(grad_reduce, "jaxmp.autocast")
  recipe = _fp8.recipe_of(fp8)
  if dtype is None:
    dtype = rules.F16 if recipe is None else rules.BF16
  dtype = jnp.dtype(dtype)
  if dtype not in rules.HALF:
    raise ValueError(
      f"autocast dtype must be float16 or bfloat16, got {dtype.name}"
    )
  interp = interpreter.Interpreter(dtype, fp8=recipe, grad_reduce=grad_reduce)

  def impl(flat_fun, dyn):
    traced = ji.trace(flat_fun, [ji.typeof(x) for x in dyn])
    weak = [ji.typeof(x).weak_type for x in dyn]
    if not debug:
      return interp.run(traced, dyn, weak)
    sink = report.Sink([], [])
    outs = interp.run(traced, dyn, weak, sink)
    if sink.flags:
      jax.debug.callback(
        report.report_fn(debug, sink.where), jnp.stack(sink.flags)
      )
    return outs

  suffix = getattr(recipe, "name", "fp8") if recipe else ""
  name = f"{rules.AUTOCAST_MARK}_{dtype.name}" + (
    f"_{suffix}" if suffix else ""
  )
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
    return flat_fun(
      *[rules.cast(x, rules.F32) if x.dtype in rules.HALF else x for x in dyn]
    )

  return _wrap(fun, _Region(fun, rules.NO_AUTOCAST_MARK, impl))


def reducing_in_fp32(fun: Callable, grad_reduce: str) -> Callable:
  """``fun`` as it is, but for the dtype of its weight gradients' sums.

  Every operation runs in the dtypes plain JAX gives it (the interpreter's
  natural mode); the matrix products, broadcasts and gathers of half values
  reached from ``fun``'s inputs (half params) get the ``grad_reduce``
  backward of `jaxmp._src.reduction.products`. ``jaxmp.autocast`` regions
  inside ``fun`` keep their own setting. `jaxmp.value_and_grad` wraps the
  loss in this when params hold half leaves.
  """
  interp = interpreter.Interpreter(
    rules.F32, natural=True, grad_reduce=grad_reduce
  )

  def impl(flat_fun, dyn):
    traced = ji.trace(flat_fun, [ji.typeof(x) for x in dyn])
    weak = [ji.typeof(x).weak_type for x in dyn]
    return interp.run(traced, dyn, weak)

  name = f"{rules.GRAD_REDUCE_MARK}_{grad_reduce}"
  return _wrap(fun, _Region(fun, name, impl, caller="jaxmp.value_and_grad"))
