"""FLOPs, HBM bytes and collective bytes of a compiled program, counted from its optimized HLO
with every while loop's trip count (XLA's cost_analysis counts a loop body once: the layer scan,
the loss blocks and gradient accumulation would be counted once each)."""

import dataclasses
import math
import re
import sys

_DTYPE_BYTES = {
  'pred': 1, 's4': 0.5, 'u4': 0.5, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1,
  'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2, 'f32': 4, 's32': 4, 'u32': 4,
  'f64': 8, 's64': 8, 'u64': 8, 'c64': 8, 'c128': 16,
}  # fmt: skip
_ARRAY = re.compile(r'\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]')
_HEADER = re.compile(r'^(?:ENTRY )?%(\S+) .*\{$')
_INSTR = re.compile(r'^\s+(?:ROOT )?%(\S+) = ')
_REFS = re.compile(
  r'\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)'
)
_REF_LISTS = re.compile(r'\b(branch_computations|called_computations)=\{([^}]*)\}')
# Ops that move no data of their own (views, control flow, bookkeeping).
_FREE = {
  'parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast', 'while', 'conditional',
  'call', 'after-all', 'partition-id', 'replica-id', 'add-dependency', 'opt-barrier',
  'copy-start', 'copy-done', 'async-start', 'async-done', 'async-update', 'iota',
}  # fmt: skip
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_COLLECTIVES = (
  'all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'ragged-all-to-all',
  'collective-permute',
)  # fmt: skip


@dataclasses.dataclass
class Instr:
  name: str
  op: str
  shapes: list  # [(dtype, dims)] of its output (several for a tuple)
  operands: list  # operand names
  attrs: str  # the rest of the line

  @property
  def bytes(self) -> float:
    return sum(_DTYPE_BYTES.get(t, 4) * math.prod(d) for t, d in self.shapes)


def _split_type(rest: str) -> tuple[str, str]:
  """'TYPE op(...)...' -> (TYPE, 'op(...)...'); a tuple type is parenthesised."""
  if not rest.startswith('('):
    i = rest.index(' ')
    return rest[:i], rest[i + 1 :]
  depth = 0
  for i, c in enumerate(rest):
    depth += {'(': 1, ')': -1}.get(c, 0)
    if depth == 0:
      return rest[: i + 1], rest[i + 2 :]
  raise ValueError(f'unbalanced HLO type: {rest[:80]}')


def _shapes(type_str: str) -> list:
  type_str = re.sub(r'\{[^{}]*\}', '', re.sub(r'\{[^{}]*\{[^{}]*\}[^{}]*\}', '', type_str))
  return [(t, [int(x) for x in d.split(',') if x]) for t, d in _ARRAY.findall(type_str)]


def split_instr(line: str) -> tuple[str, str, str, str, str] | None:
  """'%name = TYPE op(operands), attrs' -> (name, TYPE, op, operands, attrs); None for a line
  that is no instruction."""
  m = _INSTR.match(line)
  if not m:
    return None
  type_str, rest = _split_type(line[m.end() :])
  op = rest[: rest.index('(')]
  depth, end = 0, len(rest)
  for i in range(len(op), len(rest)):
    depth += {'(': 1, ')': -1}.get(rest[i], 0)
    if depth == 0:
      end = i
      break
  return m.group(1), type_str, op, rest[len(op) + 1 : end], rest[end + 1 :]


def _parse_instr(line: str) -> Instr | None:
  parts = split_instr(line)
  if parts is None:
    return None
  name, type_str, op, inner, attrs = parts
  operands = re.findall(r'%([\w.\-]+)', inner)
  if op == 'constant':
    attrs = f'value={inner} {attrs}'
  elif op == 'parameter':
    attrs = f'number={inner} {attrs}'
  return Instr(name, op, _shapes(type_str), operands, attrs)


def lines(text: str):
  """The HLO text's lines with every instruction on one line. jax 0.12 writes a Pallas kernel's
  metadata over several lines, the last beginning '}}, metadata=': read line by line, that
  would close the computation early and lose the rest of it (the kernels' FLOPs with it)."""
  pending = None
  for line in text.splitlines():
    starts = _INSTR.match(line) or _HEADER.match(line) or line.rstrip() == '}' or not line.strip()
    if pending is not None and not starts:
      pending += line.strip()
      continue
    if pending is not None:
      yield pending
    pending = line if _INSTR.match(line) else None
    if pending is None:
      yield line
  if pending is not None:
    yield pending


def parse_module(text: str) -> tuple[dict, str]:
  """{computation: [Instr]} and the entry computation's name."""
  comps, entry, current = {}, None, None
  for line in lines(text):
    h = _HEADER.match(line)
    if h:
      current = comps.setdefault(h.group(1), [])
      if line.startswith('ENTRY'):
        entry = h.group(1)
      continue
    if line.rstrip() == '}':
      current = None
    elif current is not None:
      instr = _parse_instr(line)
      if instr is not None:
        current.append(instr)
  return comps, entry


def _constant(name: str, table: dict, depth: int = 4) -> int | None:
  """The integer value of `name` when it is a constant, or a copy of one."""
  instr = table.get(name)
  for _ in range(depth):
    if instr is None or instr.op != 'copy' or not instr.operands:
      break
    instr = table.get(instr.operands[0])
  if instr is None or instr.op != 'constant':
    return None
  m = re.match(r'value=(-?\d+) ', instr.attrs)
  return int(m.group(1)) if m else None


def _tuple_index(instr) -> int | None:
  m = re.search(r'\bindex=(\d+)', instr.attrs) if instr.op == 'get-tuple-element' else None
  return int(m.group(1)) if m else None


def _trip_count(loop: Instr, table: dict, comps: dict) -> int | None:
  """A counted loop's condition is `counter < N` (the compare alone, or wrapped in a fusion),
  its body adds a constant step to the counter, and the loop starts it from a constant:
  ceil((N - start) / step), when N is a constant. (Scans step by 1 from 0; XLA's windowed
  einsum loops step by 2, one chunk from each direction per trip.)"""
  refs = dict(callees(loop))
  cond, body = comps.get(refs.get('condition'), []), comps.get(refs.get('body'), [])
  cond_table = {i.name: i for i in cond}
  bound = counter = None
  for i in cond:
    callee = re.search(r'calls=%([\w.\-]+)', i.attrs) if i.op == 'fusion' else None
    fused = comps.get(callee.group(1), []) if callee else []
    is_lt = 'direction=LT' in i.attrs or any('direction=LT' in j.attrs for j in fused)
    if i.op in ('compare', 'fusion') and is_lt:
      for o in i.operands:
        value = _constant(o, cond_table)
        if value is not None and bound is None:
          bound = value
        elif o in cond_table and _tuple_index(cond_table[o]) is not None:
          counter = _tuple_index(cond_table[o])
      if bound is not None:
        break
  if bound is None:
    return None
  step, start = 1, 0
  if counter is not None:
    body_table = {i.name: i for i in body}
    root = next((i for i in reversed(body) if i.op == 'tuple'), None)
    nxt = body_table.get(root.operands[counter]) if root and counter < len(root.operands) else None
    if nxt is not None and nxt.op == 'add':
      steps = [v for o in nxt.operands if (v := _constant(o, body_table)) is not None]
      step = steps[0] if steps and steps[0] > 0 else 1
    init = table.get(loop.operands[0]) if loop.operands else None
    if init is not None and init.op == 'tuple' and counter < len(init.operands):
      start = _constant(init.operands[counter], table) or 0
  return max(0, -(-(bound - start) // step))


def callees(instr) -> list[tuple[str, str]]:
  """[(kind, computation)] an instruction calls: a loop's body and condition, a branch, a
  fusion's or reduction's computation."""
  refs = _REFS.findall(instr.attrs)
  for k, lst in _REF_LISTS.findall(instr.attrs):
    refs += [(k, v.strip().lstrip('%')) for v in lst.split(',') if v.strip()]
  return refs


def _multiplicities(comps: dict, entry: str, unknown_trips: int = 1) -> tuple[dict, dict, list]:
  """How often each computation runs per call of the entry; the fused ones (bodies of fusion
  instructions, whose data movement is the fusion's own); while loops whose trip count was not
  recognised (counted unknown_trips times). A conditional runs one branch: it counts its
  costliest (by FLOPs), an upper bound on each run (each of kernels/ring_splash.py's steps runs
  one of its cases; a skipping branch costs nothing). One with a branch that runs
  tokamax's delta-rule kernel counts that branch: the other is the XLA form for rows past the
  kernel's limits (kernels/delta_rule_tokamax.py), and the estimate is of rows within them."""
  mult, fused, unknown = {entry: 1}, set(), []
  order = [entry]
  tables = {c: {i.name: i for i in instrs} for c, instrs in comps.items()}
  runs_kda = _runs_kda(comps)
  for comp in order:  # breadth-first over the call graph
    for instr in comps.get(comp, []):
      refs = callees(instr)
      if instr.op == 'conditional' and refs:
        refs = [r for r in refs if runs_kda(r[1])] or [_costliest(comps, refs, unknown_trips)]
      trips = 1
      if instr.op == 'while':
        trips = _trip_count(instr, tables[comp], comps)
        if trips is None:
          unknown.append(instr.name)
          trips = unknown_trips
      for kind, callee in refs:
        if callee not in comps:
          continue
        if instr.op == 'fusion' and kind == 'calls':
          fused.add(callee)
        n = mult[comp] * (trips if kind in ('body', 'condition') else 1)
        if callee not in mult:
          order.append(callee)
        mult[callee] = mult.get(callee, 0) + n
  return mult, fused, unknown


def _costliest(comps: dict, branches: list, unknown_trips: int):
  """The (kind, computation) of the branch whose calls, loops counted, have the most FLOPs."""

  def flops(branch):
    mult = _multiplicities(comps, branch[1], unknown_trips)[0]
    return sum(s.flops for s in _matmul_sites(comps, mult))

  return max(branches, key=flops)


def _is_kda(instr: Instr):
  """The name of the tokamax delta-rule kernel `instr` calls, else None."""
  if instr.op != 'custom-call':
    return None
  m = _KDA.search(instr.name) or _KDA.search(instr.attrs)
  return m.group(0) if m else None


def _runs_kda(comps: dict):
  """computation -> whether it, or one it calls, runs a tokamax delta-rule kernel."""
  memo = {}

  def runs(comp: str) -> bool:
    if comp not in memo:
      memo[comp] = False  # (a cycle is no kernel)
      memo[comp] = any(
        _is_kda(i) or any(runs(c) for _, c in callees(i) if c in comps) for i in comps.get(comp, [])
      )
    return memo[comp]

  return runs


def _matmul_flops(instr: Instr, table: dict) -> float:
  ops = [table[o].shapes[0] for o in instr.operands if o in table and table[o].shapes]
  out = instr.shapes[0][1] if instr.shapes else []
  if instr.op == 'dot' and len(ops) >= 2:
    m = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', instr.attrs)
    k = math.prod(ops[0][1][int(d)] for d in m.group(1).split(',') if d) if m else 1
    return 2.0 * math.prod(out) * k
  if instr.op == 'convolution' and len(ops) >= 2:
    return 2.0 * math.prod(out) * _taps(instr, ops[0][1], ops[1][1]) / _ragged_groups(instr)
  if instr.op == 'custom-call' and (kind := _SPLASH.search(instr.name + instr.attrs)):
    return _splash_flops(kind.group(1), ops, full=FULL_MASK_SCOPE in instr.attrs)
  if kind := _is_kda(instr):
    return _kda_flops(kind, [d for _, d in instr.shapes])
  if instr.op == 'custom-call' and ('ragged-dot' in instr.name or 'gmm' in instr.attrs):
    grouped = _grouped(instr)
    return grouped[0] if grouped else 0.0
  return 0.0


def _ragged_groups(instr: Instr) -> int:
  """XLA:TPU writes lax.ragged_dot (forward and both transposes) as a convolution whose output
  carries the G groups as a spatial dim, every row against every group's weights, and skips
  the iterations its group mask leaves empty: each row meets one group, G times fewer FLOPs
  than the convolution's shape. 1 for any other convolution."""
  if 'ragged_dot_general' not in instr.attrs:
    return 1
  labels = re.search(r'->(\w+)', instr.attrs)
  out = instr.shapes[0][1] if instr.shapes else []
  spatial = [out[i] for i, c in enumerate(labels.group(1) if labels else '') if c.isdigit()]
  return spatial[0] if len(spatial) == 1 and len(out) == 3 else 1


_SPLASH = re.compile(r'splash_m[hq]a_(fwd|dq|dkv)')
# The named scope of splash calls whose mask is whole (every block seen): kernels/ring_splash.py's
# blocks from other shards.
FULL_MASK_SCOPE = 'splash_full_mask'
# A splash kernel's matmuls per visited block, as (q/k-width products, v-width products): the
# forward's q k^T and p v; dq recomputes q k^T, forms dO v^T and ds k; dkv recomputes q k^T,
# forms dO v^T, p^T dO and ds^T q.
_SPLASH_PRODUCTS = {'fwd': (1, 1), 'dq': (2, 1), 'dkv': (2, 2)}


def _splash_flops(kind: str, operands: list, full: bool = False) -> float:
  """A splash attention kernel (JAX's Pallas TPU kernel; moetrain's and MaxText's): its operands
  are the block tables (int8 [heads, q blocks, kv blocks]) and then q [..., T, H_qk],
  k [..., S, H_qk], v [..., S, H_v]. Priced as causal (both sides train causal LMs): of an
  n x n block grid, n (n + 1) / 2 blocks are visited; full (a call under FULL_MASK_SCOPE):
  every block."""
  floats = [d for t, d in operands if t in ('bf16', 'f32', 'f16') and len(d) >= 2]
  tables = [d for t, d in operands if t == 's8' and len(d) == 3]
  if len(floats) < 3:
    return 0.0
  q, k, v = floats[:3]
  n = max(tables[0][1:]) if tables else 1
  visited = 1.0 if full else (n + 1) / (2 * n)
  rows = math.prod(q[:-1])  # batch x heads x T
  qk, pv = _SPLASH_PRODUCTS[kind]
  return 2.0 * rows * k[-2] * (qk * q[-1] + pv * v[-1]) * visited


# tokamax's delta-rule kernels (Kimi Delta Attention's, kernels/delta_rule_tokamax.py), by name:
# their matmul FLOPs per token and head in the chunk C and the key and value widths K and V (as
# the kernel pads them), counted from the kernels' bodies (tokamax 0.0.17; 0.18 M a token and
# head forward and 0.43 M backward at C = 64, K = V = 128), and which of their outputs give the
# token-heads and C (an array [..., C, X]), K and V (their last dims).
_KDA = re.compile(
  r'pallas_kda_fwd_intra_fused|chunk_kda_fwd_h_o_varlen|fused_recompute_w_u_vnew_from_h'
  r'|chunk_kda_bwd_dAv|fused_dhu_wy_intra_cumsum'
)
_KDA_KERNELS = {
  'pallas_kda_fwd_intra_fused': ((0, 1, 0), lambda c, k, v: (7 * c - 1) * k + (c - 1) * (v + c)),
  'fused_recompute_w_u_vnew_from_h': ((0, 0, 3), lambda c, k, v: 2 * k * v + 2 * c * (k + v)),
  'chunk_kda_bwd_dAv': ((1, 1, 1), lambda c, k, v: 4 * c * v),
  'fused_dhu_wy_intra_cumsum': (
    (0, 0, 2),
    lambda c, k, v: 12 * k * v + 11 * c * k + 4 * c * v + 4 * c * c,
  ),
}


def _kda_flops(kind: str, outputs: list) -> float:
  """A tokamax delta-rule kernel's FLOPs from its outputs' shapes. The forward's state pass
  (chunk_kda_fwd_h_o_varlen) writes o [H, B, T, V] and states [..., K, V]; its chunk is 64,
  the only one tokamax takes."""
  if kind == 'chunk_kda_fwd_h_o_varlen':
    o, states = outputs[0], [d for d in outputs[1:] if len(d) == 5]
    k = states[0][-2] if states else o[-1]
    return 2.0 * math.prod(o[:-1]) * (3 * k * o[-1] + 64 * o[-1])
  (rows, k, v), per_token = _KDA_KERNELS[kind]
  if len(outputs) <= max(rows, k, v):
    return 0.0
  at = outputs[rows]
  return math.prod(at[:-1]) * per_token(at[-2], outputs[k][-1], outputs[v][-1])


def _taps(instr: Instr, lhs: list, kernel: list) -> int:
  """Multiply-adds per output element of a convolution: the kernel's input features times the
  window positions that meet real input. XLA writes batched matmuls as convolutions whose
  spatial dims are the batch: either the input dilated by the window size (lhs_dilate) or an
  input of size 1 padded by window - 1 on both sides; in both, one position meets input."""
  labels = re.search(r'dim_labels=(\w+)_(\w+)->', instr.attrs)
  x_labels, k_labels = labels.groups() if labels else ('', '')
  i = kernel[k_labels.index('i')] if 'i' in k_labels else 1
  window = re.search(r'window=\{([^}]*)\}', instr.attrs)
  if not window:
    return i * math.prod(kernel[j] for j, c in enumerate(k_labels) if c.isdigit())
  field = lambda key: (
    [int(x) for x in re.search(rf'{key}=([\dx]+)', window.group(1)).group(1).split('x')]
    if key + '=' in window.group(1)
    else None
  )
  size = field('size') or []
  dilate = field('lhs_dilate') or [1] * len(size)
  # The input's spatial sizes, in the order of the window's dims ('0', '1', ...).
  spatial = [lhs[x_labels.index(str(d))] if str(d) in x_labels else s for d, s in enumerate(size)]
  return i * math.prod(min(-(-s // d), n) for s, d, n in zip(size, dilate, spatial))


def _grouped(instr: Instr) -> tuple[float, int] | None:
  """A grouped matmul kernel (XLA's ragged dot, megablox, tokamax): [M,K] x [G,K,N] -> [M,N]
  and its transposes (the weights' gradient [M,K] x [M,N] -> [G,K,N]). Its FLOPs, 2*M*K*N over
  the whole row buffer (an upper bound: rows past the groups are skipped by the kernel), and M,
  the buffer's rows; None for a call that is no grouped matmul."""
  m = re.search(r'operand_layout_constraints=\{(.*?)\}, (?:frontend|metadata|backend)', instr.attrs)
  arrays = (_shapes(m.group(1)) if m else []) + instr.shapes
  arrays = [d for t, d in arrays if t in ('bf16', 'f32', 'f16') and len(d) in (2, 3)]
  threes = [d for d in arrays if len(d) == 3]
  twos = [d for d in arrays if len(d) == 2]
  if len(threes) != 1 or len(twos) < 2:
    return None
  g, *inner = threes[0]
  prod = math.prod(threes[0]) * math.prod(twos[-2]) * math.prod(twos[-1])
  # Each [M, K] array shares one dim with the grouped weights' [K, N]; the other is the rows.
  a = twos[-1]
  rows = a[0] if a[1] in inner else a[1]
  return 2.0 * math.sqrt(prod / g), rows


@dataclasses.dataclass
class Cost:
  flops: float  # every dot/convolution/grouped matmul, loops counted with their trip counts
  hbm_bytes: float  # operands + outputs of every unfused instruction and fusion
  collective_bytes: float  # data each device sends or receives in collectives
  flops_once: float  # the same flops with every loop body counted once (cost_analysis' way)
  loops: dict  # while loop body -> trip count
  unknown_loops: list
  # Multislice: bytes handed to the megascale runtime (the cross-slice collectives), by
  # transfer type; dcn_bytes prices them.
  megascale: dict = dataclasses.field(default_factory=dict)
  # The grouped matmuls, as (FLOPs per call of the program, the rows of their buffer): what
  # routed_rows reprices.
  grouped: list = dataclasses.field(default_factory=list)
  # FLOPs of the grouped matmuls over buffer rows that routing leaves empty (routed_rows; 0 as
  # analysed, where `flops` counts every buffer whole): an upper bound on what padding costs.
  grouped_padding_flops: float = 0.0


@dataclasses.dataclass
class MatmulSite:
  flops: float  # per call of the program: one run's FLOPs times how often it runs
  runs: int  # runs per call of the program (loop trip counts multiplied)
  computation: str
  name: str
  op: str
  shapes: list  # the output's [(dtype, dims)]
  operands: list  # the operands' shapes, where the computation defines them
  rows: int | None = None  # a grouped matmul's row buffer (None for any other matmul)


def _matmul_sites(comps: dict, mult: dict):
  """Every dot, convolution and grouped matmul that runs, as a MatmulSite."""
  for comp, instrs in comps.items():
    if not (runs := mult.get(comp, 0)):
      continue
    table = {i.name: i for i in instrs}
    for instr in instrs:
      if f := _matmul_flops(instr, table):
        ops = [table[o].shapes for o in instr.operands if o in table]
        grouped = _grouped(instr) if instr.op == 'custom-call' else None
        other = _SPLASH.search(instr.name + instr.attrs) or _is_kda(instr)
        rows = grouped[1] if grouped and not other else None
        yield MatmulSite(runs * f, runs, comp, instr.name, instr.op, instr.shapes, ops, rows)


def top_matmuls(text: str, n: int = 20) -> list[MatmulSite]:
  """The n dots, convolutions and grouped matmuls with the most FLOPs per call of the program,
  each with its loop multiplicity: where a compiled step's FLOPs go."""
  comps, entry = parse_module(text)
  sites = _matmul_sites(comps, _multiplicities(comps, entry)[0])
  return sorted(sites, key=lambda s: -s.flops)[:n]


def analyse(text: str, unknown_trips: int = 1) -> Cost:
  """unknown_trips: how often to count a loop whose trip count depends on the data. In moetrain's
  steps those are the overflow rounds of a bounded expert exchange (kernels/rounds.py), which the
  planner counts zero times: its estimate is of a step whose routing fits the buffer."""
  comps, entry = parse_module(text)
  mult, fused, unknown = _multiplicities(comps, entry, unknown_trips)
  sites = list(_matmul_sites(comps, mult))
  flops, once = sum(s.flops for s in sites), sum(s.flops / s.runs for s in sites)
  hbm = coll = 0.0
  loops, megascale = {}, {}
  for comp, instrs in comps.items():
    n = mult.get(comp, 0)
    if not n:
      continue
    table = {i.name: i for i in instrs}
    for instr in instrs:
      if instr.op == 'while':
        body = re.search(r'body=%([\w.\-]+)', instr.attrs)
        if body and body.group(1) in mult:
          loops[body.group(1)] = mult[body.group(1)] // max(n, 1)
      if comp in fused or instr.op in _FREE:
        continue
      kind = _MEGASCALE.search(instr.attrs) if instr.op == 'send' else None
      if kind:  # payload first, then a context and a token
        payload = Instr(instr.name, instr.op, instr.shapes[:1], [], '').bytes
        megascale[kind.group(1)] = megascale.get(kind.group(1), 0.0) + n * payload
      base = instr.op.removesuffix('-start').removesuffix('-done')
      if base in _COLLECTIVES:
        if not instr.op.endswith('-done'):
          factor = 2 if base == 'all-reduce' else 1
          size = instr.bytes if base != 'reduce-scatter' else _operand_bytes(instr, table)
          coll += n * factor * size
        continue
      hbm += n * _traffic(instr, table, comps)
  grouped = [(s.flops, s.rows) for s in sites if s.rows]
  return Cost(flops, hbm, coll, once, loops, unknown, megascale, grouped)


def routed_rows(cost: Cost, rows: float) -> Cost:
  """`cost` with each grouped matmul priced by the rows routing sends it, `rows` per call (a
  balanced routing: the tokens a device holds in one forward pass times the FFN experts per
  token), not by its whole buffer. An expert-parallel exchange's receive buffer holds
  engine.moe_ep_recv_factor times the balanced rows (the worst case without it), and
  `analyse` counts every row of it; the difference is reported apart, in
  grouped_padding_flops, as an upper bound on what an unbalanced routing adds."""
  padding = sum(f * max(0.0, 1 - rows / m) for f, m in cost.grouped)
  return dataclasses.replace(
    cost, flops=cost.flops - padding, grouped_padding_flops=cost.grouped_padding_flops + padding
  )


def dcn_bytes(cost: Cost, slices: int) -> float:
  """Bytes a chip sends over the data-center network per run of a multislice program
  (analyse's count). libtpu compiles one slice's program, in which every collective that crosses
  slices is a host-transfer `send` to the megascale runtime, its payload the chip's share and
  its `_xla_megascale_transfer_type` the collective. Across d = `slices` slices a ring
  all-reduce sends 2 (d - 1) / d of the payload, an all-gather, reduce-scatter or all-to-all
  (d - 1) / d, anything else all of it."""
  share = (slices - 1) / max(slices, 1)

  def factor(kind: str) -> float:
    if kind == 'ALL_REDUCE':
      return 2 * share
    return share if kind in ('ALL_GATHER', 'REDUCE_SCATTER', 'ALL_TO_ALL') else 1.0

  return sum(factor(kind) * payload for kind, payload in cost.megascale.items())


def _operand_bytes(instr: Instr, table: dict) -> float:
  return sum(table[o].bytes for o in instr.operands if o in table)


_SLICES = ('dynamic-slice', 'slice')


def _traffic(instr: Instr, table: dict, comps: dict) -> float:
  """HBM bytes an unfused instruction or fusion reads and writes: its operands and outputs,
  except where it touches part of an array. A slice reads only what it takes; an operand that a
  fusion only slices (one layer of a scan's stacked buffer) counts the slices; a dynamic update
  in place (a scan writing one layer's slot, as the root of a fusion or alone) reads and writes
  only the update. Counted whole, a fusion over a [L, ...] stack weighed L times its real
  traffic in an L-trip loop."""
  if instr.op in _SLICES:
    return 2.0 * instr.bytes
  if instr.op == 'dynamic-update-slice' and len(instr.operands) > 1:
    update = table.get(instr.operands[1])
    return 2.0 * (update.bytes if update else instr.bytes)
  if instr.op != 'fusion':
    return instr.bytes + _operand_bytes(instr, table)
  callee = dict(callees(instr)).get('calls')
  body = comps.get(callee, [])
  params = {
    i.name: int(i.attrs.split()[0].removeprefix('number=')) for i in body if i.op == 'parameter'
  }
  users = {}
  for i in body:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  root = body[-1] if body else None
  out = instr.bytes
  in_place = None
  if root is not None and root.op == 'dynamic-update-slice' and len(root.operands) > 1:
    update = next((i for i in body if i.name == root.operands[1]), None)
    if root.operands[0] in params and update is not None:
      in_place, out = root.operands[0], update.bytes
  total = out
  for name, index in params.items():
    if index >= len(instr.operands) or instr.operands[index] not in table or name == in_place:
      continue
    used = users.get(name, [])
    if used and all(u.op in _SLICES and u.operands[0] == name for u in used):
      total += sum(u.bytes for u in used)
    else:
      total += table[instr.operands[index]].bytes
  return total


def main(argv=None) -> None:
  """python -m moetrain.core.hlo_cost MODULE.txt [N]: the totals and the top N matmul sites of an
  optimized HLO text dump (XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text)."""

  args = sys.argv[1:] if argv is None else argv
  text = open(args[0]).read()
  cost = analyse(text)
  print(
    f'FLOPs {cost.flops:.4g} (loop bodies once: {cost.flops_once:.4g}), HBM bytes '
    f'{cost.hbm_bytes:.4g}, collective bytes {cost.collective_bytes:.4g}'
  )
  for s in top_matmuls(text, int(args[1]) if len(args) > 1 else 20):
    share = s.flops / cost.flops if cost.flops else 0.0
    dims = lambda shapes: 'x'.join(str(list(d)) for _, d in shapes)
    print(
      f'{share:6.1%} {s.flops:.4g} = {s.runs} x {s.op} {s.name} ({s.computation}): '
      f'{" , ".join(dims(o) for o in s.operands)} -> {dims(s.shapes)}'
    )


if __name__ == '__main__':
  main()
