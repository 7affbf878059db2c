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
_LINE = re.compile(
  r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
  r"(?P<op>" + "|".join(sorted(_OPS, key=len, reverse=True)) + r")\("
)
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*(?:e\d+m\d+\w*)?)\[(?P<dims>[\d,]*)\]")


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
  """

  op: str
  dtype: str
  shape: tuple
  devices: int
  bytes_sent: float
  name: str


class ReductionReport(NamedTuple):
  """The collectives of a program; ``str`` is a table.

  Attributes:
    rows: one `Reduction` per collective, in program order.
  """

  rows: tuple

  @property
  def bytes_sent(self) -> float:
    """The bytes one device sends in all, by `Reduction.bytes_sent`."""
    return float(sum(r.bytes_sent for r in self.rows))

  def sums(self, dtype: str = None) -> tuple:
    """The all-reduces and reduce-scatters (those of ``dtype`` if given)."""
    return tuple(
      r
      for r in self.rows
      if r.op in ("all-reduce", "reduce-scatter")
      and (dtype is None or r.dtype == dtype)
    )

  def __str__(self) -> str:
    head = ("op", "dtype", "shape", "devices", "bytes sent")
    body = [
      (
        r.op,
        r.dtype,
        "[" + ",".join(map(str, r.shape)) + "]",
        str(r.devices),
        f"{r.bytes_sent:,.0f}",
      )
      for r in self.rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda row: "  ".join(x.ljust(w) for x, w in zip(row, widths))
    lines = [fmt(head), fmt(["-" * w for w in widths])]
    lines += [fmt(row) for row in body]
    lines.append(
      f"{len(self.rows)} collectives, {self.bytes_sent:,.0f} bytes sent "
      "per device"
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


def _parse(text: str, n_devices: int) -> list:
  rows = []
  for line in text.splitlines():
    m = _LINE.match(line)
    if not m:
      continue
    op = _OPS[m.group("op")]
    arrays = _ARRAY.findall(m.group("type"))
    if not arrays:
      continue
    dtype, dims = arrays[-1] if op != "all-reduce" else arrays[0]
    if m.group("op").endswith("-start") and len(arrays) > 1:
      dtype, dims = arrays[-1]
    shape = tuple(int(d) for d in dims.split(",") if d)
    n = _group_size(line, n_devices)
    size = float(np.prod(shape, dtype=np.float64)) * _itemsize(dtype)
    if op == "all-reduce":
      sent = 2 * (n - 1) / n * size
    elif op == "reduce-scatter":
      sent = (n - 1) * size  # Its result is 1/n of what it sums.
    elif op in ("all-gather", "all-to-all"):
      sent = (n - 1) / n * size
    else:
      sent = size
    rows.append(Reduction(op, dtype, shape, n, sent, m.group("name")))
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
  dtype, shape, group size and the bytes each device sends.

  Args:
    fn: the function, as it is called in training (sharded inputs, under
      ``jax.set_mesh`` where the step uses it).
    *args: its arguments (arrays, or ``jax.ShapeDtypeStruct`` with
      shardings).
    **kwargs: its keyword arguments.

  Returns:
    A `ReductionReport`: ``.rows`` (`Reduction` tuples), ``.sums(dtype)``
    (the all-reduces and reduce-scatters), ``.bytes_sent``; ``str`` is a
    table. A program on one device has no rows.

  >>> import jax, jax.numpy as jnp, jaxmp
  >>> report = jaxmp.reduction_report(lambda x: x * 2, jnp.ones(3))
  >>> report.rows, report.bytes_sent
  ((), 0.0)
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
  return ReductionReport(tuple(_parse(text, n)))
