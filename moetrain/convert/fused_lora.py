"""PEFT LoRA factors of fused expert parameters (LoraConfig.target_parameters): moetrain's
per-expert gate / up / down adapters as gpt-oss's and transformers 5's fused experts take them."""

import dataclasses
import math
import re

import numpy as np

# PEFT's LoRA on a 3-d parameter [E, m, n] (peft >= 0.17: ParamWrapper) has lora_A [R * E, n],
# expert e's [R, n] at rows e*R.., and lora_B [m, R * E], its [m, R] at columns j*E + e; the
# update of expert e is scaling * B_e @ A_e ([m, n]). gate_up_proj takes moetrain's gate and up
# adapters together at rank 2r (A_e their input factors stacked, B_e their output factors
# block-diagonal), down_proj down's at rank r. Two target_parameters on one module wrap it twice:
# gate_up_proj (peft wraps it first, whatever their order) is the inner one, `.base_layer`.
TARGETS = {'gate_up_proj': ('gate', 'up'), 'down_proj': ('down',)}
MLP_PROJECTIONS = ('.gate_proj', '.up_proj', '.down_proj')
_LAYER = re.compile(r'(.*\.layers\.\d+\.)')


@dataclasses.dataclass(frozen=True)
class Layout:
  """A family's fused experts: parameters [E, out, in] (out_first, transformers 5) or
  [E, in, out] (gpt-oss), gate and up along the output axis interleaved (gpt-oss: gate at even
  indices) or concatenated (transformers 5: gate, then up), in the runtime module
  `<block>.experts`. uniform: the whole adapter at rank 2r and scale 1, every module's factors
  padded with zeros and the scale moved into B (gpt-oss's export); else the config's rank and
  alpha, with gate_up_proj's rank and alpha doubled by rank_pattern / alpha_pattern."""

  out_first: bool
  interleaved: bool
  uniform: bool
  block: str = 'mlp'


GPT_OSS = Layout(out_first=False, interleaved=True, uniform=True)
HF5 = Layout(out_first=True, interleaved=False, uniform=False)


def split_row(name: str, path: str, ix: tuple, layout: Layout):
  """(runtime experts prefix, expert, 'gate'|'up'|'down', 'A'|'B') of an expert adapter row's
  tensor `name` (the checkpoint's per-expert name) at index ix; path: the row's moetrain path
  (...experts.gate_lora_a)."""
  piece, ab = path.rsplit('.', 1)[-1].split('_lora_')
  return f'{_LAYER.match(name).group(1)}{layout.block}.experts', ix[-1], piece, ab.upper()


def patterns(rank: int, alpha: float, rslora: bool) -> dict:
  """rank_pattern and alpha_pattern of a non-uniform export: gate_up_proj at rank 2r and the
  alpha that keeps the scale (alpha / r, or alpha / sqrt(r) with rslora)."""
  key = r'.*\.gate_up_proj'
  return {
    'rank_pattern': {key: 2 * rank},
    'alpha_pattern': {key: alpha * (math.sqrt(2) if rslora else 2)},
  }


def _out_slice(i: int, n: int, out: int, layout: Layout) -> slice:
  return slice(i, None, n) if layout.interleaved else slice(i * out, (i + 1) * out)


def fuse(pieces: dict, num_experts: int, rank: int, layout: Layout, scale: float = 1.0):
  """({PEFT tensor name: lora_A [R * E, n] or lora_B [m, R * E]}, target_parameters) of one
  layer's fused experts. pieces: {(prefix, 'gate'|'up'|'down', 'A'|'B'): per-expert list of
  PEFT-style factors (A [rank, in], B [out, rank])}; scale multiplies the B factors."""
  prefixes = {p for p, _, _ in pieces}
  targets = [f for f, names in TARGETS.items() if any(k[1] in names for k in pieces)]
  out = {}
  for prefix in prefixes:
    for fused in targets:
      names = TARGETS[fused]
      got = {n: (pieces.get((prefix, n, 'A')), pieces.get((prefix, n, 'B'))) for n in names}
      d_in = next(a[0].shape[1] for a, _ in got.values() if a is not None)
      d_out = next(b[0].shape[0] for _, b in got.values() if b is not None)
      big = 2 * rank if layout.uniform else rank * len(names)
      m, n = (d_out * len(names), d_in) if layout.out_first else (d_in, d_out * len(names))
      lora_a = np.zeros((num_experts, big, n), np.float32)
      lora_b = np.zeros((m, big, num_experts), np.float32)
      for i, name in enumerate(names):
        a, b = got[name]
        if a is None:
          continue
        rows, cols = slice(i * rank, (i + 1) * rank), _out_slice(i, len(names), d_out, layout)
        for e in range(num_experts):
          if layout.out_first:  # B_e [out, R] holds the output side, A_e [R, in] the input
            lora_a[e, rows] = a[e]
            lora_b[cols, rows, e] = scale * b[e]
          else:
            lora_b[:, rows, e] = a[e].T
            lora_a[e, rows, cols] = scale * b[e].T
      inner = '.base_layer' if fused == 'gate_up_proj' and len(targets) == 2 else ''
      out[f'{prefix}{inner}.lora_A.weight'] = lora_a.reshape(num_experts * big, n)
      out[f'{prefix}{inner}.lora_B.weight'] = lora_b.reshape(m, big * num_experts)
  return out, [f'{layout.block}.experts.{f}' for f in targets]


def unfuse(lora_a, lora_b, e: int, num_experts: int, piece: str, ab: str, rank: int, layout):
  """moetrain's factor of expert e's `piece` ('A': [in, r], 'B': [r, out]) from a fused
  parameter's PEFT factors (fuse's layout, or peft's own at any rank R). At R = r the pieces of
  gate_up_proj share the input factor; at R = 2r each takes its diagonal block, and the
  off-diagonal ones must be zero."""
  fused = next(f for f, names in TARGETS.items() if piece in names)
  names, i = TARGETS[fused], TARGETS[fused].index(piece)
  big = lora_a.shape[0] // num_experts
  a_e = lora_a.reshape(num_experts, big, -1)[e]  # [R, n]
  b_e = lora_b.reshape(lora_b.shape[0], big, num_experts)[:, :, e]  # [m, R]
  f_in, f_out = (a_e, b_e) if layout.out_first else (b_e.T, a_e.T)  # [R, in], [out * k, R]
  f_out = f_out[_out_slice(i, len(names), f_out.shape[0] // len(names), layout)]
  if big == rank:
    return f_in.T if ab == 'A' else f_out.T
  if big != rank * len(names):
    raise ValueError(f'{fused}: rank {big}, expected {rank} or {rank * len(names)}')
  rows = slice(i * rank, (i + 1) * rank)
  if np.any(np.delete(f_out, np.arange(big)[rows], axis=1)):
    raise ValueError(
      f"{fused}: expert {e}'s {piece} uses the other pieces' rank components (the adapter "
      f'is not separate rank-{rank} adapters)'
    )
  return f_in[rows].T if ab == 'A' else f_out[:, rows].T
