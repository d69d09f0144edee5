"""Where a compiled program's temporaries go: a liveness walk over its scheduled, optimized HLO
(`compiled.as_text()`), which lists the buffers alive at the peak, each with the JAX operation
that made it.

XLA reports one number for a program's temporaries (`memory_analysis().temp_size_in_bytes`);
its buffer assignment is not exported. This module rebuilds an approximation of it from the
schedule: a buffer lives from the instruction that defines it to its last use through any alias
(tuples, get-tuple-element, bitcasts, while loops, async pairs and in-place updates alias; a
loop body's root writes into the loop's state). A loop or branch adds its own peak at the
instruction that runs it. Sizes are the physical ones of the layouts (TPU tiles pad the minor
dimensions; `T(8,128)` pads the last two to multiples of 8 and 128), and only device memory (no
`S(n)` memory space: on-chip VMEM, semaphores, host) counts. XLA's heap packing is not
modelled, nor what the TPU backend adds beyond its buffer assignment, so the peak here is a lower
estimate of the reported temporaries (docs/design.md).
"""

import dataclasses
import math
import re

from moetrain.core import hlo_cost

_ARRAY = re.compile(r'\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\](?:\{([\d,]*)([^}]*)\})?')
_TILE = re.compile(r'T\(([\d,]+)\)')
_SPACE = re.compile(r'S\((\d+)\)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# Ops whose output is a view of, or the same buffer as, their operands.
_ALIASING = {'bitcast', 'get-tuple-element', 'tuple', 'while', 'opt-barrier', 'add-dependency'}
_NO_BUFFER = {'parameter', 'constant', 'after-all', 'partition-id', 'replica-id'}


def _array_bytes(dtype: str, dims: str, layout: str | None, extra: str) -> int:
  """Physical bytes of one array in device memory (0 in another memory space)."""
  space = _SPACE.search(extra or '')
  if space and space.group(1) != '0':
    return 0
  shape = [int(d) for d in dims.split(',') if d]
  item = hlo_cost._DTYPE_BYTES.get(dtype, 4)
  if not shape:
    return math.ceil(item)
  order = [int(x) for x in layout.split(',')] if layout else list(range(len(shape)))[::-1]
  phys = [shape[d] for d in reversed(order)]  # major to minor
  tile = _TILE.search(extra or '')
  if tile:
    t = [int(x) for x in tile.group(1).split(',')]
    for k, size in enumerate(reversed(t)):
      if k < len(phys):
        phys[-1 - k] = -(-phys[-1 - k] // size) * size
  return math.ceil(item * math.prod(phys))


def _elements(type_str: str) -> list[int]:
  """Bytes of each top-level element of an HLO type (one element for an array)."""
  if not type_str.startswith('('):
    return [sum(_array_bytes(*a) for a in _ARRAY.findall(type_str))]
  out, depth, start = [], 0, 1
  for i, c in enumerate(type_str):
    if c in '({[':
      depth += 1
    elif c in ')}]':
      depth -= 1
    if (c == ',' and depth == 1) or (depth == 0 and c == ')'):
      part = type_str[start:i]
      out.append(sum(_array_bytes(*a) for a in _ARRAY.findall(part)))
      start = i + 1
      if depth == 0:
        break
  return out


@dataclasses.dataclass
class _Instr:
  name: str
  op: str
  elements: list  # bytes of each top-level output element
  operands: list
  attrs: str
  root: bool
  label: str = ''  # the JAX operation (metadata op_name; a copy's is its operand's)


def _parse(text: str) -> tuple[dict, str]:
  comps, entry, current, labels = {}, None, None, {}
  for line in hlo_cost.lines(text):
    h = hlo_cost._HEADER.match(line)
    if h:
      current = comps.setdefault(h.group(1), [])
      entry = h.group(1) if line.startswith('ENTRY') else entry
      continue
    if line.rstrip() == '}':
      current = None
      continue
    parts = hlo_cost.split_instr(line) if current is not None else None
    if parts is None:
      continue
    name, type_str, op, inner, attrs = parts
    operands = re.findall(r'%([\w.\-]+)', inner)
    root = line.lstrip().startswith('ROOT ')
    label = _OP_NAME.search(attrs)
    label = label.group(1) if label else ''
    if not label and operands and op.split('-')[0] in ('copy', 'bitcast', 'get'):
      label = labels.get(operands[0], '')
    labels[name] = label
    current.append(_Instr(name, op, _elements(type_str), operands, attrs, root, label))
  return comps, entry


@dataclasses.dataclass
class Live:
  """One entry of the live set at a peak: a buffer, or a loop's or branch's own peak."""

  bytes: int
  name: str
  op: str
  label: str  # the JAX operation (HLO metadata op_name)
  inner: 'Peak | None' = None


@dataclasses.dataclass
class Peak:
  computation: str
  bytes: int
  at: str  # the instruction at the peak
  live: list  # [Live], largest first


def _buffer_name(instr: _Instr, element: int) -> str:
  return f'{instr.name}{{{element}}}' if len(instr.elements) > 1 else instr.name


def _callees(instr: _Instr) -> list[str]:
  """The computations a loop, call or branch runs (their peaks add to the caller's)."""
  if instr.op not in ('while', 'call', 'conditional'):
    return []
  return [name for _, name in hlo_cost.callees(instr)]


class _Walker:
  def __init__(self, comps: dict):
    self.comps = comps
    self.memo = {}

  def peak(self, comp: str, writes_into_caller: bool = True) -> Peak:
    """writes_into_caller: the root's buffers are the caller's, alive already (a loop body's
    state, the program's outputs); a branch's or a call's root is born inside it."""
    key = (comp, writes_into_caller)
    if key not in self.memo:
      self.memo[key] = self._sweep(comp, writes_into_caller)
    return self.memo[key]

  def _sweep(self, comp: str, writes_into_caller: bool) -> Peak:
    """The live set after each instruction, in schedule order; the largest one."""
    instrs = self.comps[comp]
    size, born, last, root = self._buffers(instrs)
    for b in root if writes_into_caller else ():
      size[b] = 0
    births = {}
    for b, i in born.items():
      # A branch's or call's result is counted inside it until it returns.
      births.setdefault(i + (instrs[i].op in ('conditional', 'call')), []).append(b)
    best, live = Peak(comp, 0, '', []), set()
    for i, ins in enumerate(instrs):
      live |= set(births.get(i, ()))
      inner = [self.peak(c, ins.op == 'while') for c in _callees(ins) if c in self.comps]
      inner_peak = max(inner, key=lambda p: p.bytes, default=None)
      total = sum(size[b] for b in live) + (inner_peak.bytes if inner_peak else 0)
      if total > best.bytes:
        owners = ((b, instrs[born[b]]) for b in live if size[b])
        entries = [Live(size[b], _buffer_name(o, b[1]), o.op, o.label) for b, o in owners]
        if inner_peak and inner_peak.bytes:
          entries.append(Live(inner_peak.bytes, ins.name, ins.op, ins.label, inner_peak))
        best = Peak(comp, total, ins.name, sorted(entries, key=lambda e: -e.bytes))
      live -= {b for b in live if last[b] <= i}
    return best

  def _buffers(self, instrs: list) -> tuple[dict, dict, dict, set]:
    """The buffers one computation allocates: {id: bytes}, {id: index of the instruction that
    defines it}, {id: index of its last use through any alias}, and the ids its root returns."""
    value = {}  # name -> [set of buffer ids] per output element
    size, born, last, root = {}, {}, {}, set()
    for i, ins in enumerate(instrs):
      ops = [value.get(o, [set()]) for o in ins.operands]
      everything = set().union(*[set().union(*e) for e in ops]) if ops else set()
      for b in everything:
        last[b] = i
      if ins.op in _NO_BUFFER:
        value[ins.name] = [set() for _ in ins.elements]
      elif ins.op == 'get-tuple-element':
        idx = int(re.search(r'index=(\d+)', ins.attrs).group(1))
        value[ins.name] = [ops[0][idx] if idx < len(ops[0]) else everything]
      elif ins.op == 'tuple':
        value[ins.name] = [set().union(*e) for e in ops]
      elif ins.op in _ALIASING or ins.op.endswith('-done'):
        src = ops[0] if ops else [set()]
        if ins.op.endswith('-done') and len(src) > 1:
          # copy-start is (destination, source, context); the others ((operands), result, ...)
          src = [src[0] if ins.op == 'copy-done' else src[1]]
        value[ins.name] = src if len(src) == len(ins.elements) else [set().union(*src)]
      elif self._in_place(ins):
        value[ins.name] = ops[0] if ops else [set()]
      else:
        aliased = {}
        if ins.op.endswith('-start') and len(ins.elements) > 1:
          aliased = {1: everything} if ins.op == 'copy-start' else {0: everything}
          aliased.update({k: set() for k in range(2, len(ins.elements))})
        elems = []
        for k, nbytes in enumerate(ins.elements):
          if k not in aliased:
            size[ins.name, k], born[ins.name, k], last[ins.name, k] = nbytes, i, i
          elems.append(aliased.get(k, {(ins.name, k)}))
        value[ins.name] = elems
      if ins.root:
        root = set().union(*value[ins.name])
    return size, born, last, root

  def _in_place(self, ins) -> bool:
    """An update of its first operand's buffer: dynamic-update-slice and scatter, alone or as
    a fusion's root."""
    if ins.op in ('dynamic-update-slice', 'scatter'):
      return True
    if ins.op != 'fusion':
      return False
    body = [
      j for kind, c in hlo_cost.callees(ins) if kind == 'calls' for j in self.comps.get(c, [])
    ]
    return any(j.root and j.op in ('dynamic-update-slice', 'scatter') for j in body)


def peak(text: str) -> Peak:
  """The entry computation's peak of temporaries and what is alive there."""
  comps, entry = _parse(text)
  return _Walker(comps).peak(entry)


def summary(p: Peak, top: int = 8, min_bytes: int = 2**20) -> list[dict]:
  """The largest live buffers at the peak, descending into the loop or branch that holds it:
  [{bytes, depth, op, name, label}], JSON-friendly."""
  out = []

  def walk(p: Peak, depth: int) -> None:
    for e in p.live[:top]:
      if e.bytes < min_bytes:
        break
      out.append({'bytes': e.bytes, 'depth': depth, 'op': e.op, 'name': e.name, 'label': e.label})
      if e.inner is not None:
        walk(e.inner, depth + 1)

  walk(p, 0)
  return out


def short_label(label: str, width: int = 100) -> str:
  """A JAX op_name without the jit(...)/ prefix, cut to its last `width` characters."""
  label = re.sub(r'^jit\([^)]*\)/', '', label)
  return label if len(label) <= width else '...' + label[-width + 3 :]
