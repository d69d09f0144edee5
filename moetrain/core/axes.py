"""The one dimension vocabulary: what each shape letter means, and the logical axis name (what
the sharding rules map to mesh axes) of the letters that name one.

Array names end in their shape's letters (x_BTD: batch, sequence, embedding) and einsum strings
use the same letters; each letter means one thing everywhere in moetrain/model and
moetrain/kernels (tests/test_layout.py checks every suffix and einsum against this table).
"""

from typing import NamedTuple


class Letter(NamedTuple):
  meaning: str
  name: str | None = None  # the logical axis name; None: never sharded by name


LETTERS = {
  'A': Letter("a token's top-k assignments"),
  'B': Letter('batch rows', 'batch'),
  'C': Letter("slots of one expert's capacity buffer"),
  'D': Letter('model width (hidden size)', 'embed'),
  'E': Letter(
    'routed (FFN) experts, or the slices of an exchange (one per expert group)', 'experts'
  ),
  'F': Letter('SwiGLU hidden width (dense MLP; a routed expert: EXPERT_MLP on weights)', 'mlp'),
  'G': Letter("shards of the 'expert' mesh axis (expert-parallel groups)"),
  'H': Letter('per-head width', 'head_dim'),
  'I': Letter("a projection's input features, flattened"),
  'J': Letter('LoRA rank', 'lora_rank'),
  'K': Letter('MLA compressed kv latent width', 'kv_lora'),
  'L': Letter('layers', 'layers'),
  'M': Letter('tokens (batch rows x positions, flattened)'),
  'N': Letter('attention heads', 'heads'),
  'O': Letter("a projection's output features, flattened"),
  'P': Letter('slots of a dispatch or exchange buffer (rows in expert order)'),
  'Q': Letter('MLA query low-rank width', 'q_lora'),
  'R': Letter('routed assignments (M x A, token-major, or sorted by expert)'),
  'S': Letter('key positions', 'kv_seq'),
  'T': Letter('query (sequence) positions', 'seq'),
  'U': Letter('blocks: of buffer rows (blocked/gathered engines) or of positions (chunked loss)'),
  'V': Letter('vocabulary', 'vocab'),
  'W': Letter("the teacher's k best tokens at a position (distillation's top-k)"),
  'X': Letter('router outputs: E routed + Z zero experts', 'router'),
  'Y': Letter("pipeline stages (the 'stage' mesh axis)", 'stage'),
  'Z': Letter('zero-computation (identity) experts'),
}

# Weight-only logical name: F of a routed expert, sharded apart from the dense MLP's F.
EXPERT_MLP = 'expert_mlp'
WEIGHT_NAMES = frozenset(v.name for v in LETTERS.values() if v.name) | {EXPERT_MLP}


def names(letters: str, **override: str) -> tuple[str | None, ...]:
  """Logical axis names of a shape: names('BTD') -> ('batch', 'seq', 'embed'); a letter without
  one gives None (not sharded); override renames a letter: names('EDF', F=EXPERT_MLP)."""
  return tuple(override.get(c, LETTERS[c].name) for c in letters)
