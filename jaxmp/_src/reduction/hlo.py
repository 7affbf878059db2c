"""HLO text read for `reduction_report`: instructions, op names, data flow.

The report reads the program XLA's SPMD partitioner wrote (the text of an
``after_spmd-partitioning`` dump). This module parses what it needs: each
instruction's result type, opcode, operands and the ``op_name`` that jax
wrote into its metadata (the name stack of the traced program: transforms,
named scopes, Flax modules, the primitive), and which computations call
which (the branches of a ``conditional``, a ``while``'s body, a ``call``).
"""

import collections
import functools
import re
from typing import NamedTuple, Optional

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMMENT = re.compile(r"/\*.*?\*/")
# ``%t#1`` is element 1 of tuple ``t`` (XLA prints no get-tuple-element).
_REF = re.compile(r"%([\w.\-]+(?:#\d+)*)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_WRAPPED = re.compile(r"^([\w\-]+)\((.*)\)$")
# Name-stack parts that jax's lowerings push (control flow, recomputation)
# and jax's higher-order primitives of past releases; `_jax_parts` adds
# those of the running jax's (``closed_call`` is ``eval_jaxpr`` in 0.12).
_STRUCTURE = re.compile(
  r"^(?:cond|switch|while|body|cond_fun|body_fun|branch_\d+_fun|scan|"
  r"checkpoint|remat2?|rematted_computation|shard_map|custom_jvp_call|"
  r"custom_vjp_call|closed_call|core_call|call|eval_jaxpr|pjit|jit)$"
)
# Ops through which a backward value is one of a later matrix product's
# operands (a cotangent flowing on through the network).
PRODUCTS = ("dot", "convolution", "scatter")
# Ops that sum or pick over a value's elements: a gradient reaches the
# program's result without one (an optimizer's update is elementwise).
CONTRACTIONS = PRODUCTS + (
  "reduce",
  "reduce-window",
  "select-and-scatter",
  "gather",
)


class Instr(NamedTuple):
  """One HLO instruction.

  Attributes:
    comp: the computation it is in.
    name: its name (without ``%``).
    type: its result type, as written (``f32[8,16]{1,0}`` or a tuple).
    opcode: ``all-reduce``, ``dot``, ``get-tuple-element``, ...
    operands: the names of its operands.
    args: the text between its parentheses (a parameter's number).
    attrs: the text after its operands.
    op_name: jax's name stack and primitive (``""`` where none).
    root: whether it is its computation's result.
  """

  comp: str
  name: str
  type: str
  opcode: str
  operands: tuple
  args: str
  attrs: str
  op_name: str
  root: bool


def _balanced(text: str, start: int) -> int:
  """The index just past the bracket group opening at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in "([{":
      depth += 1
    elif text[i] in ")]}":
      depth -= 1
      if not depth:
        return i + 1
  return len(text)


def _instr(comp: str, line: str) -> Optional[Instr]:
  m = _INSTR.match(_COMMENT.sub("", line))
  if not m:
    return None
  rest = m.group(3)
  end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
  if end < 0:
    return None
  type_, rest = rest[:end], rest[end:].lstrip()
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  close = _balanced(rest, op.end() - 1)
  args = rest[op.end() : close - 1]
  attrs = rest[close:]
  name = _OP_NAME.search(attrs)
  return Instr(
    comp,
    m.group(2),
    type_,
    op.group(1),
    tuple(_REF.findall(args)),
    args,
    attrs,
    name.group(1) if name else "",
    bool(m.group(1)),
  )


class Module:
  """A parsed HLO module: its instructions and the graph between them."""

  def __init__(self, text: str):
    """Parses ``text``, one HLO module as XLA prints it."""
    self.instrs = {}  # (comp, name) -> Instr
    self.order = []  # every Instr, in text order
    self.users = collections.defaultdict(list)  # (comp, name) -> [Instr]
    self.params = collections.defaultdict(dict)  # comp -> {index: Instr}
    self.roots = {}  # comp -> Instr
    self.callers = collections.defaultdict(list)  # comp -> [(Instr, role)]
    self.entry = comp = None
    for line in text.splitlines():
      header = _HEADER.match(line)
      if header:
        comp = header.group(2)
        self.entry = comp if header.group(1) else self.entry
        continue
      if comp is None or line.strip() == "}":
        continue
      ins = _instr(comp, line)
      if ins is None:
        continue
      self.instrs[(comp, ins.name)] = ins
      self.order.append(ins)
      for o in ins.operands:
        self._element(comp, o)
        self.users[(comp, o)].append(ins)
      if ins.root:
        self.roots[comp] = ins
      if ins.opcode == "parameter":
        number = ins.args.strip()
        self.params[comp][int(number) if number.isdigit() else 0] = ins
      for role, callee in _callees(ins):
        self.callers[callee].append((ins, role))

  def _element(self, comp: str, ref: str) -> None:
    """A ``get-tuple-element`` for a reference ``t#i`` (tuple ``t``'s ``i``).

    XLA since jax 0.12 prints an element's use as ``%t#i`` with no
    instruction of its own; one is added here, so that a value is followed
    element by element through tuples as before.
    """
    if "#" not in ref or (comp, ref) in self.instrs:
      return
    base, index = ref.rsplit("#", 1)
    self._element(comp, base)
    attrs = f"index={index}"
    gte = Instr(
      comp, ref, "", "get-tuple-element", (base,), "", attrs, "", False
    )
    self.instrs[(comp, ref)] = gte
    self.users[(comp, base)].append(gte)

  def producer(self, ins: Instr, operand: str) -> Optional[Instr]:
    """The instruction named ``operand`` in ``ins``'s computation."""
    return self.instrs.get((ins.comp, operand))

  def origin(self, ins: Instr, depth: int = 8) -> str:
    """The op name of ``ins``, its whole name stack, for the report.

    A collective that ``shard_map`` lowers bare (``op_name`` just
    ``all_to_all``) takes the name of its nearest producer that has one
    (what it sends: a product's cotangent); a ``shard_map`` body's names
    start at the body, so the name of the instruction that calls it goes
    in front.
    """
    name = self._named_producer(ins)
    callers = self.callers.get(ins.comp)
    if callers and depth:
      outer = split_name(self.origin(callers[0][0], depth - 1))[:-1]
      prefix = "/".join(outer)
      if outer and not name.startswith(prefix):
        name = prefix + "/" + name
    return name

  def _named_producer(self, ins: Instr, depth: int = 32) -> str:
    seen, frontier = set(), [ins]
    while frontier and depth:
      depth -= 1
      nxt = []
      for i in frontier:
        if "/" in i.op_name:
          return i.op_name
        for o in i.operands:
          p = self.producer(i, o)
          if p is not None and p.name not in seen:
            seen.add(p.name)
            nxt.append(p)
      frontier = nxt
    return ins.op_name

  def feeds_backward_product(self, ins: Instr) -> bool:
    """Whether ``ins``'s value is an operand of a later backward product.

    Follows the value through every op, into called computations and out
    of them, element by element through tuples (a ``while`` carries a
    layer's cotangent and its weight gradient side by side), to a ``dot``,
    ``convolution`` or ``scatter`` whose op name is under
    ``transpose(...)``: the value is a cotangent flowing on through the
    network.
    """
    return self._reaches(
      ins,
      lambda i: i.opcode in PRODUCTS and is_backward(i.op_name),
      lambda i: True,
    )

  def reaches_result(self, ins: Instr) -> bool:
    """Whether ``ins``'s value is in the program's result, uncontracted.

    True where a path of elementwise, layout, tuple and call ops (no
    product, reduction or gather) leads from it to the entry computation's
    root: a gradient, updated by an optimizer or returned as it is.
    """
    return self._reaches(
      ins,
      lambda i: i.root and i.comp == self.entry,
      lambda i: i.opcode not in CONTRACTIONS,
    )

  def _reaches(self, ins: Instr, hit, through, limit: int = 50000) -> bool:
    """Whether a path from ``ins`` through ``through`` nodes finds ``hit``."""
    if hit(ins):
      return True
    seen, stack = {(ins.comp, ins.name, None)}, [(ins, None)]
    while stack and limit:
      limit -= 1
      cur, index = stack.pop()
      for nxt in self._next(cur, index):
        key = (nxt[0].comp, nxt[0].name, nxt[1])
        if key in seen:
          continue
        seen.add(key)
        if hit(nxt[0]):
          return True
        if through(nxt[0]):
          stack.append(nxt)
    return False

  def _next(self, cur: Instr, index: Optional[int]):
    """Where the value ``cur`` (element ``index`` of it) goes next."""
    out = []
    for user in self.users[(cur.comp, cur.name)]:
      if user.opcode == "get-tuple-element":
        at = re.search(r"index=(\d+)", user.attrs)
        if index is None or (at and int(at.group(1)) == index):
          out.append((user, None))
      elif user.opcode == "tuple":
        out += [(user, k) for k, o in enumerate(user.operands) if o == cur.name]
      elif user.opcode in ("while", "conditional", "call"):
        out += self._into(user, cur.name, index)
      else:
        out.append((user, None))
    if cur.root:
      for call, role in self.callers[cur.comp]:
        if role in ("body", "branch", "call"):
          out.append((call, index))
        if role == "body" and 0 in self.params[cur.comp]:
          out.append((self.params[cur.comp][0], index))
    return out

  def _into(self, call: Instr, operand: str, index: Optional[int]):
    """The callee parameters that ``operand`` of ``call`` becomes."""
    at = [k for k, o in enumerate(call.operands) if o == operand]
    if call.opcode == "while":  # One operand, the carry: the body's param.
      targets = [(c, 0) for _, c in _callees(call)]
    elif call.opcode == "conditional":  # Operand k + 1 is branch k's.
      branches = _branches(call)
      targets = [(branches[k - 1], 0) for k in at if 0 < k <= len(branches)]
    else:
      targets = [(c, k) for _, c in _callees(call) for k in at]
    return [
      (self.params[c][k], index) for c, k in targets if k in self.params[c]
    ]


def _branches(call: Instr) -> list:
  m = re.search(r"branch_computations=\{([^}]*)\}", call.attrs)
  if m:
    return _REF.findall(m.group(1))
  return [
    n
    for key in ("true_computation", "false_computation")
    for n in re.findall(key + r"=%([\w.\-]+)", call.attrs)
  ]


def _callees(ins: Instr):
  """``(role, computation)`` of the computations ``ins`` runs as values."""
  if ins.opcode == "while":
    return [("body", c) for c in re.findall(r"body=%([\w.\-]+)", ins.attrs)]
  if ins.opcode == "conditional":
    return [("branch", c) for c in _branches(ins)]
  if ins.opcode == "call":
    return [("call", c) for c in re.findall(r"to_apply=%([\w.\-]+)", ins.attrs)]
  return []


def split_name(op_name: str) -> list:
  """The parts of an op name, split at ``/`` outside parentheses."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(op_name):
    if ch == "(":
      depth += 1
    elif ch == ")":
      depth -= 1
    elif ch == "/" and not depth:
      parts.append(op_name[start:i])
      start = i + 1
  parts.append(op_name[start:])
  return parts


def is_backward(op_name: str) -> bool:
  """Whether jax traced the op transposing a linear map (a backward pass).

  A recomputed forward (``jax.checkpoint``'s rematerialised ops) is not.
  """
  return "transpose(" in op_name and "rematted_computation" not in op_name


def source(op_name: str) -> str:
  """The model's path in an op name: transforms and primitive stripped.

  ``jit(step)/transpose(jvp(jit(f)))/ResNet/layer2_0/conv/cond/branch_0_fun/
  reduce_sum`` is ``ResNet/layer2_0/conv``; ``transpose(jvp(MLP))/hidden/
  dot_general`` is ``MLP/hidden``: a transform's wrapper is dropped, what
  it wraps kept unless it is a jitted function's name (``jit(...)``), and
  jax's own parts go: control flow (``cond``, ``branch_0_fun``, ``while``,
  ``body``), a higher-order primitive's name (``closed_call``, which jax
  0.12 calls ``eval_jaxpr``; ``remat2``, ``custom_vjp_call``) and the
  trailing primitive.
  """
  parts = split_name(op_name)[:-1]
  kept = []
  for part in parts:
    wrappers = []
    m = _WRAPPED.match(part)
    while m:
      wrappers.append(m.group(1))
      part = m.group(2)
      m = _WRAPPED.match(part)
    if not part or (wrappers and wrappers[-1] in ("jit", "pjit")):
      continue
    if _STRUCTURE.match(part) or part in _jax_parts() or "->" in part:
      continue  # ("->": an einsum's spec.)
    kept.append(part)
  return "/".join(kept)


@functools.cache
def _jax_parts() -> frozenset:
  """The names of the running jax's higher-order primitives.

  jax puts a call primitive's name in the name stack of the ops it calls
  (``closed_call``, ``eval_jaxpr`` from jax 0.12): a part of jax, never of
  the model.
  """
  try:
    from jax.extend.core import primitives  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover - jax moved it.
    return frozenset()
  names = (
    "call_p",
    "closed_call_p",
    "core_call_p",
    "jit_p",
    "pjit_p",
    "remat_p",
    "checkpoint_p",
    "custom_jvp_call_p",
    "custom_vjp_call_p",
    "shard_map_p",
    "while_p",
    "cond_p",
    "scan_p",
  )
  prims = (getattr(primitives, n, None) for n in names)
  return frozenset(p.name for p in prims if hasattr(p, "name"))
