"""The Hugging Face layouts of the families built from standard pre-norm layers (transformers
4.57 `deepseek_v3`, `deepseek_v2`, `qwen3_moe`, `mixtral`, `olmoe`, `qwen2_moe`, `glm4_moe`; 5.24
`minimax_m2`; Kimi-K2's `kimi_k2` read as `deepseek_v3`; the hybrid and sparse-attention
families of transformers 5: hybrid.py): config.json and the weight-name table. One table builder serves
them all: attention rows by kind (MLA, GQA; MLA's with its sparse attention indexer), the MoE
block's by family. Multimodal releases read as their language model: multimodal.py."""

from moetrain.convert import family, fused_lora
from moetrain.convert.stacked_io import Row
from moetrain.model.config import ModelConfig
from moetrain.model.families import PARTS

_COMMON_REQUIRED = {
  'vocab_size': 'vocab_size',
  'hidden_size': 'hidden_size',
  'num_hidden_layers': 'num_layers',
  'num_attention_heads': 'num_heads',
  'num_experts_per_tok': 'moe_topk',
}
_COMMON_FIXED = {'hidden_act': 'silu', 'tie_word_embeddings': False, 'attention_bias': False}


class Family:
  """One family's config.json tables (family.read_fields' required / optional / fixed), its
  parts (model/families.py PARTS: what its config.json does not say), where its MoE block's
  weights live (`block`, the expert projections' names for gate / up / down, the shared experts'
  module `shared`), and what its config.json holds beyond the tables (`read(c) -> fields`,
  `write(cfg) -> keys`)."""

  def __init__(
    self,
    model_type,
    architecture,
    required,
    optional,
    fixed,
    block,
    experts,
    read,
    write,
    shared='shared_experts',
    router_module='gate',
    bias_at='gate.',
    fused=None,
  ):
    self.model_type, self.architecture = model_type, architecture
    self.required = {**_COMMON_REQUIRED, **required}
    # A key the family reads (optional) is not fixed (OLMoE's attention_bias).
    self.optional = optional
    self.fixed = {k: v for k, v in {**_COMMON_FIXED, **fixed}.items() if k not in optional}
    self.parts = PARTS[model_type]
    self.block, self.experts, self.read, self.write = block, experts, read, write
    self.shared = shared  # <block>.<shared>: the shared experts' MLP
    # PEFT's modules_to_save name of the router: its module names ending with it are saved whole.
    self.ROUTER_MODULE = router_module
    self.bias_at = bias_at  # <block>.<bias_at>e_score_correction_bias: under the gate, or beside it
    # How transformers fuses the experts (fused_lora.Layout), which a PEFT adapter then reaches
    # as parameters; None: per-expert modules.
    self.PEFT_FUSED = fused

  def config_from_hf(self, c: dict) -> dict:
    kw = family.read_fields(c, self.model_type, self.required, self.optional, self.fixed)
    return {**kw, **self.parts, **self.read(c, kw)}

  def config_to_hf(self, cfg: ModelConfig) -> dict:
    wrong = {k: getattr(cfg, k) for k, v in self.parts.items() if getattr(cfg, k) != v}
    if wrong:
      raise ValueError(f'model: {wrong} cannot be expressed by transformers {self.model_type}')
    out = {**self.fixed, **family.write_fields(cfg, self.required, self.optional)}
    return {**out, 'architectures': [self.architecture], **self.write(cfg)}

  def table(self, cfg: ModelConfig) -> list[Row]:
    rows = family.global_rows()
    for group in cfg.layer_groups():
      entries = [
        ('input_layernorm.weight', 'input_norm.scale', None),
        ('post_attention_layernorm.weight', 'post_norm.scale', None),
        *(linear_entries(cfg) if group.mixer == 'linear' else attention_entries(cfg)),
      ]
      if group.kind == 'dense':
        rows += family.group_rows(group, entries + _mlp_entries('mlp', 'mlp'))
        continue
      rows += family.group_rows(group, entries + self.moe_entries(cfg))
      rows += family.group_rows(group, self.expert_entries(), experts=True)
    return rows

  def moe_entries(self, cfg: ModelConfig) -> list:
    out = [(f'{self.block}.gate.weight', 'moe.router', 1)]  # [E, D] <-> [D, E]
    if cfg.router_bias:
      bias = f'{self.block}.{self.bias_at}e_score_correction_bias'
      out.append((bias, 'moe.router_bias', None))
    if cfg.n_shared_experts:
      out += _mlp_entries(f'{self.block}.{self.shared}', 'moe.shared')
    if cfg.shared_expert_gate:  # [1, D] <-> [D, 1]
      out.append((f'{self.block}.shared_expert_gate.weight', 'moe.shared_gate.kernel', 1))
    return out

  def reader(self, reader, cfg: ModelConfig):
    """The checkpoint reader the table's names are read from (gpt_oss.py's fused experts)."""
    return reader

  def fuse(self, specs, produce):
    """save_hf's tensors as the checkpoint stores them (gpt_oss.py's fused experts)."""
    return specs, produce

  def expert_entries(self) -> list:
    return [
      (f'{self.block}.experts.{{e}}.{hf}.weight', f'moe.experts.{n}', 1)
      for n, hf in zip(('gate', 'up', 'down'), self.experts)
    ]


def _mlp_entries(hf_prefix: str, path: str) -> list:
  return [(f'{hf_prefix}.{n}_proj.weight', f'{path}.{n}.kernel', 1) for n in ('gate', 'up', 'down')]


def linear_entries(cfg: ModelConfig) -> list:
  """linear_attn.* rows of a Gated DeltaNet layer (Qwen3-Next's projections, or Qwen3.5's)."""
  a = 'linear_attn'
  names = ('qkv', 'z', 'b', 'a') if cfg.linear_split_projections else ('qkvz', 'ba')
  return [
    *((f'{a}.in_proj_{n}.weight', f'attn.in_{n}.kernel', 1) for n in names),
    (f'{a}.conv1d.weight', 'attn.conv', None),
    (f'{a}.dt_bias', 'attn.dt_bias', None),
    (f'{a}.A_log', 'attn.A_log', None),
    (f'{a}.norm.weight', 'attn.norm.scale', None),
    (f'{a}.out_proj.weight', 'attn.out.kernel', 1),
  ]


def attention_entries(cfg: ModelConfig) -> list:
  """self_attn.* rows of one layer: GQA's q/k/v/o (+ q/k norms) or MLA's (DeepSeek's names)."""
  a = 'self_attn'
  if cfg.attention == 'gqa':
    out = [(f'{a}.{n}_proj.weight', f'attn.{n}.kernel', 1) for n in 'qkv']
    out.append((f'{a}.o_proj.weight', 'attn.o.kernel', 2))  # [D, N*H] <-> [N, H, D]
    if cfg.qk_norm:
      out += [(f'{a}.{n}_norm.weight', f'attn.{n}_norm.scale', None) for n in 'qk']
    if cfg.qkv_bias:
      out += [(f'{a}.{n}_proj.bias', f'attn.{n}.bias', None) for n in 'qkv']
    if cfg.o_bias:
      out.append((f'{a}.o_proj.bias', 'attn.o.bias', None))
    if cfg.attention_sinks:
      out.append((f'{a}.sinks', 'attn.sinks', None))
    return out
  if cfg.q_lora_rank:
    out = [
      (f'{a}.q_a_proj.weight', 'attn.q_a.kernel', 1),
      (f'{a}.q_a_layernorm.weight', 'attn.q_a_norm.scale', None),
      (f'{a}.q_b_proj.weight', 'attn.q_b.kernel', 1),
    ]
  else:
    out = [(f'{a}.q_proj.weight', 'attn.q.kernel', 1)]
  out += [
    (f'{a}.kv_a_proj_with_mqa.weight', 'attn.kv_a.kernel', 1),
    (f'{a}.kv_a_layernorm.weight', 'attn.kv_a_norm.scale', None),
    (f'{a}.kv_b_proj.weight', 'attn.kv_b.kernel', 1),
    (f'{a}.o_proj.weight', 'attn.o.kernel', 2),
  ]
  return out + (_indexer_entries(f'{a}.indexer') if cfg.index_n_heads else [])


def _indexer_entries(hf: str) -> list:
  """The sparse attention indexer's rows (DeepSeek-V3.2's and GLM-5's names)."""
  out = [(f'{hf}.{n}.weight', f'attn.indexer.{n}.kernel', 1) for n in ('wq_b', 'wk')]
  return out + [
    (f'{hf}.k_norm.weight', 'attn.indexer.k_norm.scale', None),
    (f'{hf}.k_norm.bias', 'attn.indexer.k_norm.bias', None),
    (f'{hf}.weights_proj.weight', 'attn.indexer.weights_proj.kernel', 1),
  ]


_YARN = {  # rope_scaling key -> (ModelConfig field, default)
  'factor': ('yarn_factor', 0.0),
  'original_max_position_embeddings': ('yarn_original_max_position', 0),
  'beta_fast': ('yarn_beta_fast', 32.0),
  'beta_slow': ('yarn_beta_slow', 1.0),
  'mscale': ('yarn_mscale', 1.0),
  'mscale_all_dim': ('yarn_mscale_all_dim', 0.0),
}


def _yarn_from_hf(c: dict) -> dict:
  rs = c.get('rope_scaling')
  if not rs:
    return {}
  kind = rs.get('rope_type', rs.get('type'))
  if kind != 'yarn' or rs.get('attention_factor') is not None:
    raise ValueError(
      f'config.json rope_scaling={rs!r} is unsupported: moetrain implements YaRN (type "yarn", '
      'attention_factor from mscale / mscale_all_dim)'
    )
  out = {'yarn_truncate': bool(rs.get('truncate', True))}
  for key, (field, default) in _YARN.items():
    out[field] = default if rs.get(key) is None else rs[key]
  return out


def _yarn_to_hf(cfg: ModelConfig) -> dict:
  if cfg.yarn_factor <= 1:
    return {'rope_scaling': None}
  rs = {key: getattr(cfg, field) for key, (field, _) in _YARN.items()}
  if not cfg.yarn_truncate:  # written only where it differs from the default (gpt-oss)
    rs['truncate'] = False
  return {'rope_scaling': {'type': 'yarn', 'rope_type': 'yarn', **rs}}


def _gqa_read(c: dict, kw: dict) -> dict:
  """head_dim absent or null means hidden_size / heads (as transformers reads it)."""
  return {'head_dim': kw['head_dim'] or kw['hidden_size'] // kw['num_heads']}


def _gqa_write(cfg: ModelConfig) -> dict:
  return {'head_dim': cfg.gqa_head_dim}


def _qwen3_read(c: dict, kw: dict) -> dict:
  return {**_gqa_read(c, kw), 'mlp_only_layers': tuple(kw['mlp_only_layers'])}


def _qwen3_write(cfg: ModelConfig) -> dict:
  return {**_gqa_write(cfg), 'mlp_only_layers': list(cfg.mlp_only_layers)}


def _mixtral_read(c: dict, kw: dict) -> dict:
  # No dense MLP: ffn_hidden_size only needs a valid value.
  return {**_gqa_read(c, kw), 'ffn_hidden_size': kw['expert_ffn_hidden_size']}


def _deepseek_write(cfg: ModelConfig) -> dict:
  return {
    **_yarn_to_hf(cfg),
    'q_lora_rank': cfg.q_lora_rank or None,
    'head_dim': cfg.qk_rope_head_dim,  # transformers sizes the rotary table from it
    'num_key_value_heads': cfg.num_heads,
  }


def _olmoe_read(c: dict, kw: dict) -> dict:
  # head_dim is hidden_size / heads; one attention_bias for q, k, v and o; no dense MLP.
  kv = kw['num_kv_heads'] or kw['num_heads']
  return {
    'head_dim': 0,
    'num_kv_heads': kv,
    'o_bias': kw['qkv_bias'],
    'ffn_hidden_size': kw['expert_ffn_hidden_size'],
  }


def _check_head_dim(cfg: ModelConfig) -> None:
  if cfg.gqa_head_dim * cfg.num_heads != cfg.hidden_size:
    raise ValueError(
      f'model.head_dim={cfg.gqa_head_dim}: transformers {cfg.model_type} needs hidden_size / '
      f'num_heads = {cfg.hidden_size / cfg.num_heads}'
    )


def _olmoe_write(cfg: ModelConfig) -> dict:
  _check_head_dim(cfg)
  if cfg.qkv_bias != cfg.o_bias:
    raise ValueError(
      f'model.o_bias={cfg.o_bias}: transformers olmoe has one attention_bias for q, k, v and o '
      f'(model.qkv_bias={cfg.qkv_bias})'
    )
  return {'num_key_value_heads': cfg.kv_heads}


def _qwen2_read(c: dict, kw: dict) -> dict:
  return {'head_dim': 0, 'mlp_only_layers': tuple(kw['mlp_only_layers'])}


def _qwen2_write(cfg: ModelConfig) -> dict:
  _check_head_dim(cfg)
  return {
    'mlp_only_layers': list(cfg.mlp_only_layers),
    'shared_expert_intermediate_size': cfg.shared_width,
  }


_TOPK_METHODS = ('greedy', 'group_limited_greedy')


def _deepseek_v2_read(c: dict, kw: dict) -> dict:
  """topk_method 'greedy' ignores n_group / topk_group (transformers does too)."""
  method = c.get('topk_method', 'greedy')
  if method not in _TOPK_METHODS:
    raise ValueError(
      f'config.json topk_method={method!r} is unsupported: deepseek_v2 routes by {_TOPK_METHODS}'
    )
  groups = {'n_group': 1, 'topk_group': 1}
  if method == 'group_limited_greedy':
    groups = {k: c.get(k) for k in groups}
    missing = [k for k, v in groups.items() if type(v) is not int]
    if missing:
      raise ValueError(f'config.json topk_method=group_limited_greedy needs integer {missing}')
  return {**_yarn_from_hf(c), **groups}


def _deepseek_v2_write(cfg: ModelConfig) -> dict:
  method = _TOPK_METHODS[cfg.n_group > 1]
  return {
    **_deepseek_write(cfg),
    'topk_method': method,
    'n_group': cfg.n_group,
    'topk_group': cfg.topk_group,
    'norm_topk_prob': False,
  }


QWEN3_MOE = Family(
  'qwen3_moe',
  'Qwen3MoeForCausalLM',
  required={
    'num_key_value_heads': 'num_kv_heads',
    'intermediate_size': 'ffn_hidden_size',
    'moe_intermediate_size': 'expert_ffn_hidden_size',
    'num_experts': 'n_routed_experts',
  },
  optional={
    'head_dim': ('head_dim', 0),
    'norm_topk_prob': ('norm_topk_prob', False),
    'decoder_sparse_step': ('decoder_sparse_step', 1),
    'mlp_only_layers': ('mlp_only_layers', ()),
    'rms_norm_eps': ('rms_norm_eps', 1e-6),
    'rope_theta': ('rope_theta', 10000.0),
    'initializer_range': ('init_std', 0.02),
    'max_position_embeddings': ('max_position_embeddings', 32768),
  },
  fixed={'use_sliding_window': False, 'rope_scaling': None},
  block='mlp',
  experts=('gate_proj', 'up_proj', 'down_proj'),
  read=_qwen3_read,
  write=_qwen3_write,
)

MIXTRAL = Family(
  'mixtral',
  'MixtralForCausalLM',
  required={
    'num_key_value_heads': 'num_kv_heads',
    'intermediate_size': 'expert_ffn_hidden_size',
    'num_local_experts': 'n_routed_experts',
  },
  optional={
    'head_dim': ('head_dim', 0),
    'rms_norm_eps': ('rms_norm_eps', 1e-5),
    'rope_theta': ('rope_theta', 1e6),
    'initializer_range': ('init_std', 0.02),
    'max_position_embeddings': ('max_position_embeddings', 131072),
  },
  fixed={'sliding_window': None, 'rope_scaling': None},
  block='block_sparse_moe',
  experts=('w1', 'w3', 'w2'),
  read=_mixtral_read,
  write=_gqa_write,
)

DEEPSEEK_V3 = Family(
  'deepseek_v3',
  'DeepseekV3ForCausalLM',
  required={
    'kv_lora_rank': 'kv_lora_rank',
    'qk_nope_head_dim': 'qk_nope_head_dim',
    'qk_rope_head_dim': 'qk_rope_head_dim',
    'v_head_dim': 'v_head_dim',
    'intermediate_size': 'ffn_hidden_size',
    'moe_intermediate_size': 'expert_ffn_hidden_size',
    'n_routed_experts': 'n_routed_experts',
  },
  optional={
    'q_lora_rank': ('q_lora_rank', 0),
    'n_shared_experts': ('n_shared_experts', 1),
    'routed_scaling_factor': ('routed_scaling_factor', 2.5),
    'n_group': ('n_group', 8),
    'topk_group': ('topk_group', 4),
    'norm_topk_prob': ('norm_topk_prob', True),
    'first_k_dense_replace': ('first_k_dense_replace', 3),
    # DeepSeek-V3's release stores its MTP layer as model.layers.61.* (skipped on import, copied
    # by an export from the checkpoint, as GLM-4.5's).
    'num_nextn_predict_layers': ('num_nextn_predict_layers', 0),
    'rms_norm_eps': ('rms_norm_eps', 1e-6),
    'rope_theta': ('rope_theta', 10000.0),
    'initializer_range': ('init_std', 0.02),
    'max_position_embeddings': ('max_position_embeddings', 4096),
  },
  fixed={'rope_interleave': True, 'scoring_func': 'sigmoid', 'topk_method': 'noaux_tc'},
  block='mlp',
  experts=('gate_proj', 'up_proj', 'down_proj'),
  read=lambda c, kw: _yarn_from_hf(c),
  write=_deepseek_write,
)

OLMOE = Family(
  'olmoe',
  'OlmoeForCausalLM',
  required={'intermediate_size': 'expert_ffn_hidden_size', 'num_experts': 'n_routed_experts'},
  optional={
    'num_key_value_heads': ('num_kv_heads', 0),
    'attention_bias': ('qkv_bias', False),
    'norm_topk_prob': ('norm_topk_prob', False),
    'rms_norm_eps': ('rms_norm_eps', 1e-5),
    'rope_theta': ('rope_theta', 10000.0),
    'initializer_range': ('init_std', 0.02),
    'max_position_embeddings': ('max_position_embeddings', 4096),
  },
  fixed={'clip_qkv': None, 'rope_scaling': None},
  block='mlp',
  experts=('gate_proj', 'up_proj', 'down_proj'),
  read=_olmoe_read,
  write=_olmoe_write,
)

QWEN2_MOE = Family(
  'qwen2_moe',
  'Qwen2MoeForCausalLM',
  required={
    'num_key_value_heads': 'num_kv_heads',
    'intermediate_size': 'ffn_hidden_size',
    'moe_intermediate_size': 'expert_ffn_hidden_size',
    'shared_expert_intermediate_size': 'shared_ffn_hidden_size',
    'num_experts': 'n_routed_experts',
  },
  optional={
    'qkv_bias': ('qkv_bias', True),
    'norm_topk_prob': ('norm_topk_prob', False),
    'decoder_sparse_step': ('decoder_sparse_step', 1),
    'mlp_only_layers': ('mlp_only_layers', ()),
    'rms_norm_eps': ('rms_norm_eps', 1e-6),
    'rope_theta': ('rope_theta', 10000.0),
    'initializer_range': ('init_std', 0.02),
    'max_position_embeddings': ('max_position_embeddings', 32768),
  },
  fixed={'use_sliding_window': False, 'rope_scaling': None},
  block='mlp',
  experts=('gate_proj', 'up_proj', 'down_proj'),
  read=_qwen2_read,
  write=_qwen2_write,
  shared='shared_expert',
  router_module='mlp.gate',  # 'gate' would also name mlp.shared_expert_gate
)

DEEPSEEK_V2 = Family(
  'deepseek_v2',
  'DeepseekV2ForCausalLM',
  required=DEEPSEEK_V3.required,
  optional={
    'q_lora_rank': ('q_lora_rank', 0),
    'n_shared_experts': ('n_shared_experts', 2),
    'routed_scaling_factor': ('routed_scaling_factor', 1.0),
    'first_k_dense_replace': ('first_k_dense_replace', 0),
    'rms_norm_eps': ('rms_norm_eps', 1e-6),
    'rope_theta': ('rope_theta', 10000.0),
    'initializer_range': ('init_std', 0.02),
    'max_position_embeddings': ('max_position_embeddings', 2048),
  },
  # transformers ignores norm_topk_prob and moe_layer_freq (DeepSeek's own code renormalises
  # unscaled gates with the first): only the released values are read.
  fixed={
    'scoring_func': 'softmax',
    'norm_topk_prob': False,
    'moe_layer_freq': 1,
    'mlp_bias': False,
  },
  block='mlp',
  experts=('gate_proj', 'up_proj', 'down_proj'),
  read=_deepseek_v2_read,
  write=_deepseek_v2_write,
)

GLM4_MOE = Family(
  'glm4_moe',
  'Glm4MoeForCausalLM',
  required={
    'num_key_value_heads': 'num_kv_heads',
    'intermediate_size': 'ffn_hidden_size',
    'moe_intermediate_size': 'expert_ffn_hidden_size',
    'n_routed_experts': 'n_routed_experts',
  },
  optional={
    'head_dim': ('head_dim', 0),
    'partial_rotary_factor': ('partial_rotary_factor', 0.5),
    'attention_bias': ('qkv_bias', False),  # q, k and v; o never has one
    'use_qk_norm': ('qk_norm', False),
    'n_shared_experts': ('n_shared_experts', 1),
    'routed_scaling_factor': ('routed_scaling_factor', 1.0),
    'n_group': ('n_group', 1),
    'topk_group': ('topk_group', 1),
    'norm_topk_prob': ('norm_topk_prob', True),
    'first_k_dense_replace': ('first_k_dense_replace', 1),
    'num_nextn_predict_layers': ('num_nextn_predict_layers', 0),
    'rms_norm_eps': ('rms_norm_eps', 1e-5),
    'rope_theta': ('rope_theta', 10000.0),
    'initializer_range': ('init_std', 0.02),
    'max_position_embeddings': ('max_position_embeddings', 131072),
  },
  fixed={'rope_scaling': None},
  block='mlp',
  experts=('gate_proj', 'up_proj', 'down_proj'),
  read=_gqa_read,
  write=_gqa_write,
)


def _rope_from_hf(c: dict, theta: float) -> dict:
  """RoPE's theta and rotated share of each head, from transformers 5's `rope_parameters` or
  the released config.json's top-level `rope_theta` with `rotary_dim` (or
  `partial_rotary_factor`). Only unscaled RoPE ('default')."""
  rp = c.get('rope_parameters') or {}
  kind = rp.get('rope_type', 'default')
  if kind != 'default' or c.get('rope_scaling'):
    raise ValueError(f'config.json rope_parameters={rp!r} is unsupported: only unscaled RoPE')
  out = {'rope_theta': rp.get('rope_theta', c.get('rope_theta', theta))}
  head_dim = c.get('head_dim') or c['hidden_size'] // c['num_attention_heads']
  factor = rp.get('partial_rotary_factor', c.get('partial_rotary_factor'))
  if factor is None and c.get('rotary_dim'):
    factor = c['rotary_dim'] / head_dim
  out['partial_rotary_factor'] = 1.0 if factor is None else float(factor)
  return out


def _minimax_m2_read(c: dict, kw: dict) -> dict:
  layers = c.get('attn_type_list')
  if layers is not None and set(layers) != {1}:
    raise ValueError(
      f'config.json attn_type_list has {sorted(set(layers))}: moetrain implements minimax_m2 '
      'with full attention (1) in every layer'
    )
  return {**_mixtral_read(c, kw), **_rope_from_hf(c, 5e6)}


def _minimax_m2_write(cfg: ModelConfig) -> dict:
  rope = {
    'rope_theta': cfg.rope_theta,
    'partial_rotary_factor': cfg.partial_rotary_factor,
    'rope_type': 'default',
  }
  return {**_gqa_write(cfg), 'rope_parameters': rope, 'rotary_dim': cfg.rotary_dim}


MINIMAX_M2 = Family(
  'minimax_m2',
  'MiniMaxM2ForCausalLM',
  required=MIXTRAL.required,
  optional={
    'head_dim': ('head_dim', 0),
    'rms_norm_eps': ('rms_norm_eps', 1e-6),
    'initializer_range': ('init_std', 0.02),
    'max_position_embeddings': ('max_position_embeddings', 196608),
  },
  # The released config.json's own keys (transformers 5 drops them): what they must say.
  fixed={
    'use_qk_norm': True,
    'qk_norm_type': 'per_layer',
    'scoring_func': 'sigmoid',
    'use_routing_bias': True,
    'shared_intermediate_size': 0,
    'sliding_window': None,
  },
  block='block_sparse_moe',
  experts=('w1', 'w3', 'w2'),
  read=_minimax_m2_read,
  write=_minimax_m2_write,
  bias_at='',
  fused=fused_lora.HF5,
)


class Alias:
  """A model_type that names another family's layout under its own name: Kimi-K2's `kimi_k2`
  is DeepSeek-V3's DeepseekV3ForCausalLM (its release notes: set model_type to deepseek_v3 for
  a framework that lacks the name). Read as that family; exports write that family's name."""

  def __init__(self, model_type: str, family: Family):
    self.model_type, self.family = model_type, family

  def __getattr__(self, name):
    return getattr(self.family, name)

  def config_from_hf(self, c: dict) -> dict:
    if c.get('model_type') != self.model_type:
      raise ValueError(
        f'config.json model_type={c.get("model_type")!r}: expected {self.model_type!r}'
      )
    return self.family.config_from_hf({**c, 'model_type': self.family.model_type})


# moonshotai/Kimi-K2-Instruct, -Thinking (int4 experts: compressed_int4.py): DeepSeek-V3 with 384
# experts, one group, YaRN x64.
KIMI_K2 = Alias('kimi_k2', DEEPSEEK_V3)

FAMILIES = {
  'kimi_k2': KIMI_K2,  # read as deepseek_v3
  **{
    f.model_type: f
    for f in (
      QWEN3_MOE,
      MIXTRAL,
      DEEPSEEK_V3,
      OLMOE,
      QWEN2_MOE,
      DEEPSEEK_V2,
      GLM4_MOE,
      MINIMAX_M2,
    )
  },
}
