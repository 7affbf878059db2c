"""`reduction_report`: a jitted function's collectives, as XLA partitioned it.

The dtype of a cross-device sum is decided where XLA's SPMD partitioner
inserts it, and some backends change it after (XLA:CPU computes half
all-reduces in fp32 in its later passes), so the report reads the program
right after the ``spmd-partitioning`` pass: what a GPU's collectives send.
"""

import contextlib
import glob
import math
import os
import re
import tempfile
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jaxmp._src.reduction import hlo
from jaxmp._src.scaling import diagnostics

try:  # Which persistent cache jax uses is decided once, at its first use.
  from jax._src import compilation_cache as _compilation_cache  # pylint: disable=g-import-not-at-top
except ImportError:  # pragma: no cover - jax moved it.
  _compilation_cache = None

# XLA's collective opcodes (async forms are reported once, by their start).
_OPS = {
  "all-reduce": "all-reduce",
  "all-reduce-start": "all-reduce",
  "reduce-scatter": "reduce-scatter",
  "all-gather": "all-gather",
  "all-gather-start": "all-gather",
  "all-to-all": "all-to-all",
  "collective-permute": "collective-permute",
  "collective-permute-start": "collective-permute",
}
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*(?:e\d+m\d+\w*)?)\[(?P<dims>[\d,]*)\]")


# What each collective does, decided from jax's op names and where its
# value goes (see `reduction_report`).
GRADIENT_SUM = "gradient sum"
FORWARD_SUM = "forward sum"
COTANGENT_SUM = "activation-cotangent sum"
PARAMETER_GATHER = "parameter gather"
RELAYOUT = "re-layout"
KINDS = (GRADIENT_SUM, FORWARD_SUM, COTANGENT_SUM, PARAMETER_GATHER, RELAYOUT)


class Reduction(NamedTuple):
  """One collective of a partitioned program.

  Attributes:
    op: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``,
      ``"all-to-all"`` or ``"collective-permute"``.
    dtype: the element type on the wire (``"f16"``, ``"bf16"``, ``"f32"``).
    shape: the shape of its result on one device.
    devices: the devices in each of its groups.
    bytes_sent: the bytes one device sends, by a ring's schedule: an
      all-reduce ``2 (n - 1) / n`` of its buffer, a reduce-scatter,
      all-gather or all-to-all ``(n - 1) / n`` of the whole (unsharded)
      buffer, a collective-permute its buffer.
    name: its name in the HLO.
    source: the layer it comes from, the model's path in jax's op name
      (``"ResNet/layer2_0/downsample_conv"``, ``"MLP/hidden"``; ``""`` for
      a function without named scopes or modules).
    kind: what it does: ``"gradient sum"``, ``"forward sum"``,
      ``"activation-cotangent sum"``, ``"parameter gather"`` or
      ``"re-layout"`` (see `reduction_report`).
    op_name: jax's whole op name (transforms, scopes and primitive).
  """

  op: str
  dtype: str
  shape: tuple
  devices: int
  bytes_sent: float
  name: str
  source: str = ""
  kind: str = ""
  op_name: str = ""


class ReductionReport(diagnostics.Rows):
  """The collectives of a program, one `Reduction` each, in program order.

  A list: ``for row in report``, ``len(report)``, ``report[0]``; ``str``
  is a table.
  """

  @property
  def bytes_sent(self) -> float:
    """The bytes one device sends in all, by `Reduction.bytes_sent`."""
    return float(sum(r.bytes_sent for r in self))

  def sums(self, dtype: str = None) -> tuple:
    """The all-reduces and reduce-scatters (those of ``dtype`` if given)."""
    return tuple(
      r
      for r in self
      if r.op in ("all-reduce", "reduce-scatter")
      and (dtype is None or r.dtype == dtype)
    )

  def __str__(self) -> str:
    """One line per collective, then the bytes in all."""
    head = ("op", "dtype", "shape", "devices", "bytes sent", "kind", "source")
    body = [
      (
        r.op,
        r.dtype,
        "[" + ",".join(map(str, r.shape)) + "]",
        str(r.devices),
        f"{r.bytes_sent:,.0f}",
        r.kind,
        r.source or "-",
      )
      for r in self
    ]
    lines = diagnostics.columns(head, body)
    lines.append(
      f"{len(self)} collectives, {self.bytes_sent:,.0f} bytes sent per device"
    )
    return "\n".join(lines)


def _itemsize(dtype: str) -> float:
  if dtype == "pred":
    return 1
  bits = re.search(r"(\d+)", dtype)
  return int(bits.group(1)) / 8 if bits else 4


def _group_size(line: str, n_devices: int) -> int:
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
  if m:
    return int(m.group(1).split(",")[-1])
  m = re.search(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\S+)?(?:\s*\{([^}]*)\})?",
    line,
  )
  if m:
    sizes = dict(
      (k.strip("' "), int(v))
      for k, v in (kv.split("=") for kv in m.group(1).split(","))
    )
    if m.group(2):
      axes = [a.strip("' ") for a in m.group(2).split(",")]
    else:
      axes = [next(iter(sizes))]
    return math.prod(sizes[a] for a in axes)
  return n_devices


def _kind(module: hlo.Module, ins: hlo.Instr, op: str, backward: bool) -> str:
  """What the collective ``ins`` does (see `reduction_report`)."""
  if not backward:
    if op in ("all-reduce", "reduce-scatter"):
      return FORWARD_SUM
    return PARAMETER_GATHER if op == "all-gather" else RELAYOUT
  # In the backward pass: a value that reaches the result uncontracted is
  # a gradient (a gather there is part of its sum: the half wire's); one
  # that only flows on into the backward products is an activation's
  # cotangent (or, gathered, a parameter they use). One that does neither
  # is a gradient's too: the half wire's all-to-all, whose chunks are then
  # added (a reduction), or a gradient an optimizer multiplies.
  if module.reaches_result(ins):
    return GRADIENT_SUM
  if module.feeds_backward_product(ins):
    if op in ("all-reduce", "reduce-scatter"):
      return COTANGENT_SUM
    return PARAMETER_GATHER if op == "all-gather" else RELAYOUT
  return GRADIENT_SUM if op != "all-gather" else PARAMETER_GATHER


def _where(module: hlo.Module, ins: hlo.Instr) -> tuple:
  """``(op name, source, backward)`` of the collective ``ins``.

  A sum written after the gradient (``pmean_grads`` in a ``shard_map``
  step) is not under ``transpose`` itself: what it sums is.
  """
  op_name = module.origin(ins)
  inputs = [module.producer(ins, o) for o in ins.operands]
  inputs = [module.origin(i) for i in inputs if i is not None]
  backward = any(map(hlo.is_backward, [op_name] + inputs))
  where = [hlo.source(n) for n in [op_name] + inputs]
  return op_name, next((w for w in where if w), ""), backward


def _parse(text: str, n_devices: int) -> list:
  module = hlo.Module(text)
  rows = []
  for ins in module.order:
    if ins.opcode not in _OPS:
      continue
    op = _OPS[ins.opcode]
    arrays = _ARRAY.findall(ins.type)
    if not arrays:
      continue
    if ins.opcode.endswith("-start") and op != "all-reduce":
      arrays = arrays[-1:]  # (operands, result): the result.
    n = _group_size(ins.attrs, n_devices)
    op_name, where, backward = _where(module, ins)
    kind = _kind(module, ins, op, backward)
    for dtype, dims in arrays:  # A variadic collective: one row each.
      shape = tuple(int(d) for d in dims.split(",") if d)
      size = float(np.prod(shape, dtype=np.float64)) * _itemsize(dtype)
      if op == "all-reduce":
        sent = 2 * (n - 1) / n * size
      elif op == "reduce-scatter":
        sent = (n - 1) * size  # Its result is 1/n of what it sums.
      elif op in ("all-gather", "all-to-all"):
        sent = (n - 1) / n * size
      else:
        sent = size
      rows.append(
        Reduction(op, dtype, shape, n, sent, ins.name, where, kind, op_name)
      )
  return rows


@contextlib.contextmanager
def _no_persistent_cache():
  """Compiles inside skip jax's persistent cache, read and write.

  A program found there is not compiled, so XLA dumps nothing; its key
  leaves the dump options out. jax decides whether it uses the cache once,
  so the decision is reset on the way in and out.
  """
  enabled = jax.config.jax_enable_compilation_cache
  reset = getattr(_compilation_cache, "reset_cache", lambda: None)
  jax.config.update("jax_enable_compilation_cache", False)
  reset()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    reset()


def reduction_report(fn: Callable, *args: Any, **kwargs: Any):
  """The cross-device collectives of ``jax.jit(fn)(*args, **kwargs)``.

  Compiles ``fn`` (a jitted function, or any function, jitted here) for
  ``args`` and reads its program right after XLA's SPMD partitioner has
  placed the collectives, before any backend pass changes their dtypes
  (XLA:CPU computes half all-reduces in fp32 later on; NCCL does not). The
  tool to audit a train step: each row is one collective with its wire
  dtype, shape, group size, the bytes each device sends, the layer it
  comes from and what it does.

  ``source`` is the model's path in the op name jax gave the collective
  (or, for one ``shard_map`` lowers bare, what it sends): Flax modules'
  and ``jax.named_scope`` names, with the transforms (``jit(step)``,
  ``transpose(jvp(...))``), control flow (``cond/branch_0_fun``), jax's
  call primitives (``closed_call``, ``eval_jaxpr``) and the primitive left
  out. ``kind`` is read from the op name and from where the
  collective's value goes:

  * ``"forward sum"``: a sum outside the backward pass: a
    tensor-parallel layer's partial products (Megatron's row-parallel
    all-reduce), a loss or metric over a sharded batch, BatchNorm's batch
    statistics, an optimizer's finite check;
  * ``"gradient sum"``: in the backward pass (under ``transpose(...)``), a
    sum whose value reaches the program's result with no product or
    reduction between: a parameter's gradient, summed over the batch's
    devices (the half wire's all-to-all and gather count here too);
  * ``"activation-cotangent sum"``: in the backward pass, a sum whose
    value only flows on into the backward products (a ``dot``,
    ``convolution`` or ``scatter`` under ``transpose``): an activation's
    cotangent, summed over a tensor-parallel axis (Megatron's
    column-parallel backward all-reduce);
  * ``"parameter gather"``: an all-gather outside the backward pass, or
    one that feeds the backward products (FSDP's gathered weights);
  * ``"re-layout"``: an all-to-all or collective-permute that is neither.

  Forward sums and activation cotangents stay in their dtype under every
  ``grad_reduce`` mode, as in Megatron-LM and PyTorch: only gradient sums
  are widened. The kinds are a heuristic on the partitioned program: a
  backward sum that neither reaches the result uncontracted nor feeds a
  backward product (an optimizer that multiplies gradient matrices) counts
  as a gradient sum, and so does an input's cotangent that ``fn`` returns.

  Args:
    fn: the function, as it is called in training (sharded inputs, under
      ``jax.set_mesh`` where the step uses it).
    *args: its arguments (arrays, or ``jax.ShapeDtypeStruct`` with
      shardings).
    **kwargs: its keyword arguments.

  Returns:
    A `ReductionReport`, a list of `Reduction` rows (``for row in
    report``, ``len(report)``), with ``.sums(dtype)`` (the all-reduces and
    reduce-scatters) and ``.bytes_sent``; ``str`` is a table. A program on
    one device has no rows.

  >>> import jax, jax.numpy as jnp, jaxmp
  >>> report = jaxmp.reduction_report(lambda x: x * 2, jnp.ones(3))
  >>> len(report), report.bytes_sent
  (0, 0.0)
  """
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  lowered = jitted.lower(*args, **kwargs)
  # The module's name: the dump may hold other programs compiled meanwhile.
  found = re.search(r"module @([\w.\-]+)", lowered.as_text())
  name = found.group(1) if found else ""
  with (
    tempfile.TemporaryDirectory(prefix="jaxmp_reduction_") as tmp,
    _no_persistent_cache(),
  ):
    lowered.compile(
      compiler_options={
        "xla_dump_to": tmp,
        "xla_dump_hlo_pass_re": "spmd-partitioning",
        "xla_dump_hlo_module_re": re.escape(name) if name else ".*",
      }
    )
    dumps = sorted(
      glob.glob(os.path.join(tmp, f"*.{name}.*after_spmd-partitioning*.txt"))
    )
    text = ""
    if dumps:
      with open(dumps[-1]) as f:
        text = f.read()
  n = max(1, len(jax.devices()))
  return ReductionReport(_parse(text, n))
