"""The one dimension vocabulary: shape letters and the logical axis names they stand for."""

# Letters used in array-name suffixes and einsum strings (DESIGN.md section 2).
LETTERS = {
  'B': 'batch',
  'T': 'seq',
  'S': 'kv_seq',
  'D': 'embed',
  'V': 'vocab',
  'N': 'heads',
  'H': 'head_dim',
  'F': 'mlp',
  'E': 'experts',
  'Z': 'zero_experts',
  'A': 'topk',
  'C': 'capacity',
  'M': 'tokens',
  'R': 'lora_rank',
  'Q': 'q_lora',
  'K': 'kv_lora',
  'L': 'layers',
}

# Weight-only logical names (never on activations).
EXPERT_MLP = 'expert_mlp'  # F of a routed expert, distinct from the dense MLP's F.
ROUTER = 'router'  # the E+Z output axis of the router classifier.
WEIGHT_NAMES = frozenset(LETTERS.values()) | {EXPERT_MLP, ROUTER}


def names(letters: str) -> tuple[str, ...]:
  """'BTD' -> ('batch', 'seq', 'embed')."""
  return tuple(LETTERS[c] for c in letters)
