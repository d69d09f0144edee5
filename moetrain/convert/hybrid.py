"""The Hugging Face layouts of transformers 5's hybrid and sparse-attention families, built
from standard.py's `Family`: `qwen3_next` and `qwen3_5_moe_text` (Gated DeltaNet layers beside
full attention), `deepseek_v32` and `glm_moe_dsa` (MLA with a sparse attention indexer).
Multimodal releases read as their language model: multimodal.py."""

from moetrain.convert import fused_lora
from moetrain.convert.standard import (
  DEEPSEEK_V3,
  QWEN2_MOE,
  Family,
  _gqa_write,
  _qwen2_read,
  _rope_from_hf,
  _yarn_from_hf,
  _yarn_to_hf,
)
from moetrain.model.config import ModelConfig

_LINEAR = ('num_key_heads', 'num_value_heads', 'key_head_dim', 'value_head_dim', 'conv_kernel_dim')


def _qwen3_next_read(c: dict, kw: dict) -> dict:
  types = c.get('layer_types') or [
    'full_attention' if (i + 1) % c.get('full_attention_interval', 4) == 0 else 'linear_attention'
    for i in range(kw['num_layers'])
  ]
  return {
    **_qwen2_read(c, kw),
    'head_dim': kw['head_dim'] or kw['hidden_size'] // kw['num_heads'],
    'layer_types': tuple(types),
    **_rope_from_hf(c, 1e4),
  }


def _qwen3_next_write(cfg: ModelConfig) -> dict:
  rope = {
    'rope_theta': cfg.rope_theta,
    'partial_rotary_factor': cfg.partial_rotary_factor,
    'rope_type': 'default',
  }
  return {
    **_gqa_write(cfg),
    'layer_types': list(cfg.layer_types),
    'mlp_only_layers': list(cfg.mlp_only_layers),
    'rope_parameters': rope,
  }


QWEN3_NEXT = Family(
  'qwen3_next',
  'Qwen3NextForCausalLM',
  required={**QWEN2_MOE.required, **{f'linear_{k}': f'linear_{k}' for k in _LINEAR}},
  optional={
    'head_dim': ('head_dim', 0),
    'norm_topk_prob': ('norm_topk_prob', True),
    'decoder_sparse_step': ('decoder_sparse_step', 1),
    'mlp_only_layers': ('mlp_only_layers', ()),
    'rms_norm_eps': ('rms_norm_eps', 1e-6),
    'initializer_range': ('init_std', 0.02),
    'max_position_embeddings': ('max_position_embeddings', 32768),
  },
  fixed={},
  block='mlp',
  experts=('gate_proj', 'up_proj', 'down_proj'),
  read=_qwen3_next_read,
  write=_qwen3_next_write,
  shared='shared_expert',
  router_module='mlp.gate',  # 'gate' would also name mlp.shared_expert_gate
  fused=fused_lora.HF5,
)


def _rope_parameters_from_hf(c: dict) -> dict:
  """RoPE's theta and YaRN from transformers 5's `rope_parameters` or the released config.json's
  `rope_scaling` beside a top-level `rope_theta` (transformers 5 folds the second into the
  first on load)."""
  rp = dict(c.get('rope_parameters') or c.get('rope_scaling') or {})
  theta = rp.pop('rope_theta', c.get('rope_theta', 10000.0))
  if rp.get('rope_type', rp.get('type', 'default')) == 'default':
    return {'rope_theta': theta}
  return {'rope_theta': theta, **_yarn_from_hf({'rope_scaling': rp})}


def _rope_parameters_to_hf(cfg: ModelConfig) -> dict:
  rs = _yarn_to_hf(cfg)['rope_scaling'] or {'rope_type': 'default'}
  return {'rope_parameters': {'rope_theta': cfg.rope_theta, **rs}}


def _dense_prefix(c: dict, kw: dict) -> int:
  """first_k_dense_replace, or the dense layers transformers 5's mlp_layer_types lists (which
  moetrain runs as a dense prefix only)."""
  types = c.get('mlp_layer_types')
  if types is None:
    return kw['first_k_dense_replace']
  k = types.count('dense')
  if list(types) != ['dense'] * k + ['sparse'] * (len(types) - k):
    raise ValueError(
      f'config.json mlp_layer_types={types!r} is unsupported: moetrain implements dense layers '
      'first, then MoE layers'
    )
  return k


def _dsa_read(c: dict, kw: dict) -> dict:
  return {**_rope_parameters_from_hf(c), 'first_k_dense_replace': _dense_prefix(c, kw)}


def _dsa_write(cfg: ModelConfig) -> dict:
  dense = min(cfg.first_k_dense_replace, cfg.num_layers)
  return {
    **_rope_parameters_to_hf(cfg),
    'head_dim': cfg.qk_rope_head_dim,  # transformers sizes the rotary table from it
    'num_key_value_heads': cfg.num_heads,
    'mlp_layer_types': ['dense'] * dense + ['sparse'] * (cfg.num_layers - dense),
  }


def _indexer_types(c: dict) -> list:
  """GLM-5's per-layer indexer modes as transformers 5.24 derives them: `indexer_types`, else
  `index_topk_pattern` ('F' full, 'S' shared), else `index_topk_freq` and
  `index_skip_topk_offset` (every layer full by default)."""
  if c.get('indexer_types') is not None:
    return list(c['indexer_types'])
  pattern = c.get('index_topk_pattern')
  if isinstance(pattern, str):
    return [{'F': 'full', 'S': 'shared'}[ch] for ch in pattern]
  if pattern is not None:
    return list(pattern)
  freq, offset = max(c.get('index_topk_freq', 1), 1), c.get('index_skip_topk_offset', 2)
  return [
    'full' if max(i - offset + 1, 0) % freq == 0 else 'shared'
    for i in range(c['num_hidden_layers'])
  ]


def _glm_dsa_read(c: dict, kw: dict) -> dict:
  shared = [i for i, t in enumerate(_indexer_types(c)) if t != 'full']
  if shared:
    raise ValueError(
      f'config.json indexer_types: layers {shared} reuse an earlier layer\'s top-k ("shared"), '
      'which moetrain does not implement: every layer runs its own indexer ("full")'
    )
  return _dsa_read(c, kw)


def _glm_dsa_write(cfg: ModelConfig) -> dict:
  return {**_dsa_write(cfg), 'indexer_types': ['full'] * cfg.num_layers}


_DSA_OPTIONAL = {
  k: v for k, v in DEEPSEEK_V3.optional.items() if k not in ('q_lora_rank', 'rope_theta')
}
_INDEXER = {'index_head_dim': ('index_head_dim', 128), 'index_topk': ('index_topk', 2048)}

# DeepSeek-V3.2 (-Exp): DeepSeek-V3 with a lightning indexer in every layer (transformers 5.24
# `deepseek_v32`; the q low rank is required).
DEEPSEEK_V32 = Family(
  'deepseek_v32',
  'DeepseekV32ForCausalLM',
  required={**DEEPSEEK_V3.required, 'q_lora_rank': 'q_lora_rank'},
  optional={**_DSA_OPTIONAL, **_INDEXER, 'index_n_heads': ('index_n_heads', 64)},
  fixed={'scoring_func': 'sigmoid', 'topk_method': 'noaux_tc'},
  block='mlp',
  experts=('gate_proj', 'up_proj', 'down_proj'),
  read=_dsa_read,
  write=_dsa_write,
  fused=fused_lora.HF5,
)

# GLM-5: DeepSeek-V3.2's layout, one expert group by default, RoPE on adjacent pairs in the
# indexer too (transformers 5.24 `glm_moe_dsa`).
GLM_MOE_DSA = Family(
  'glm_moe_dsa',
  'GlmMoeDsaForCausalLM',
  required=DEEPSEEK_V32.required,
  optional={
    **_DSA_OPTIONAL,
    **_INDEXER,
    'index_n_heads': ('index_n_heads', 32),
    'n_group': ('n_group', 1),
    'topk_group': ('topk_group', 1),
    'rms_norm_eps': ('rms_norm_eps', 1e-5),
    'max_position_embeddings': ('max_position_embeddings', 202752),
  },
  fixed={},
  block='mlp',
  experts=('gate_proj', 'up_proj', 'down_proj'),
  read=_glm_dsa_read,
  write=_glm_dsa_write,
  fused=fused_lora.HF5,
)


def _qwen35_read(c: dict, kw: dict) -> dict:
  """Its config.json may leave out intermediate_size (no dense layer needs it)."""
  out = _qwen3_next_read(c, kw)
  return {**out, 'ffn_hidden_size': kw['ffn_hidden_size'] or kw['expert_ffn_hidden_size']}


# Qwen3.5-MoE's language model (a multimodal qwen3_5_moe checkpoint's too: multimodal.py).
QWEN3_5_MOE_TEXT = Family(
  'qwen3_5_moe_text',
  'Qwen3_5MoeForCausalLM',
  required={k: v for k, v in QWEN3_NEXT.required.items() if k != 'intermediate_size'},
  optional={
    **{k: v for k, v in QWEN3_NEXT.optional.items() if k != 'norm_topk_prob'},
    'intermediate_size': ('ffn_hidden_size', 0),
  },
  fixed={},
  block='mlp',
  experts=('gate_proj', 'up_proj', 'down_proj'),
  read=_qwen35_read,
  write=_qwen3_next_write,
  shared='shared_expert',
  router_module='mlp.gate',
  fused=fused_lora.HF5,
)


FAMILIES = {f.model_type: f for f in (QWEN3_NEXT, QWEN3_5_MOE_TEXT, DEEPSEEK_V32, GLM_MOE_DSA)}
