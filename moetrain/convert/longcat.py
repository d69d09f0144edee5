"""LongCat-Flash's Hugging Face layout (transformers 4.57 `longcat_flash`): config.json and the
weight-name table. The loading and saving machinery is hf.py's."""

from moetrain.convert import family
from moetrain.convert.stacked_io import Row
from moetrain.model.config import ModelConfig

MODEL_TYPE = 'longcat_flash'
ROUTER_MODULE = 'router'  # mlp.router: classifier.weight, e_score_correction_bias
# HF key -> ModelConfig field, for keys every LongCat config.json carries.
_REQUIRED = {
  'vocab_size': 'vocab_size',
  'hidden_size': 'hidden_size',
  'num_layers': 'num_layers',
  'num_attention_heads': 'num_heads',
  'q_lora_rank': 'q_lora_rank',
  'kv_lora_rank': 'kv_lora_rank',
  'qk_nope_head_dim': 'qk_nope_head_dim',
  'qk_rope_head_dim': 'qk_rope_head_dim',
  'v_head_dim': 'v_head_dim',
  'ffn_hidden_size': 'ffn_hidden_size',
  'expert_ffn_hidden_size': 'expert_ffn_hidden_size',
  'n_routed_experts': 'n_routed_experts',
  'zero_expert_num': 'zero_expert_num',
  'moe_topk': 'moe_topk',
}
# Optional keys: (ModelConfig field, transformers 4.57 default).
_OPTIONAL = {
  'routed_scaling_factor': ('routed_scaling_factor', 6.0),
  'rms_norm_eps': ('rms_norm_eps', 1e-5),
  'rope_theta': ('rope_theta', 1e7),
  'initializer_range': ('init_std', 0.02),
  'max_position_embeddings': ('max_position_embeddings', 131072),
}
# Keys whose other values would change the maths; moetrain, like transformers 4.57, implements
# only these values (the HF default applies when a key is absent).
_FIXED = {
  'hidden_act': 'silu',
  'attention_bias': False,
  'tie_word_embeddings': False,
  'rope_scaling': None,
  'router_bias': False,
  'norm_topk_prob': False,
  'zero_expert_type': 'identity',
  'attention_method': 'MLA',
  'mla_scale_q_lora': True,
  'mla_scale_kv_lora': True,
}
HF_MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm are built without eps in HF


def config_from_hf(c: dict) -> dict:
  """ModelConfig fields of a LongCat-Flash config.json."""
  if c.get('q_lora_rank') is None and 'q_lora_rank' in c:
    raise ValueError('config.json q_lora_rank=null (a plain q_proj) is unsupported for LongCat')
  kw = family.read_fields(c, MODEL_TYPE, _REQUIRED, _OPTIONAL, _FIXED)
  nope, rope = c['qk_nope_head_dim'], c['qk_rope_head_dim']
  if c.get('head_dim', 64) != rope:  # HF sizes its rotary table from head_dim
    raise ValueError(
      f'config.json head_dim={c.get("head_dim", 64)} must equal qk_rope_head_dim='
      f'{rope} (transformers builds RoPE from head_dim)'
    )
  if c.get('qk_head_dim', nope + rope) != nope + rope:
    raise ValueError(
      f'config.json qk_head_dim={c["qk_head_dim"]} != qk_nope_head_dim + '
      f'qk_rope_head_dim = {nope + rope}'
    )
  return {**kw, 'model_type': MODEL_TYPE, 'mla_norm_eps': HF_MLA_NORM_EPS}


def config_to_hf(cfg: ModelConfig) -> dict:
  """config.json keys for transformers (hf.config_to_hf adds the common ones)."""
  bad = [
    f
    for f, ok in (
      ('mla_scale_q_lora', cfg.mla_scale_q_lora),
      ('mla_scale_kv_lora', cfg.mla_scale_kv_lora),
      ('mla_norm_eps', cfg.mla_norm_eps == HF_MLA_NORM_EPS),
    )
    if not ok
  ]
  if bad:
    raise ValueError(f'model.{bad[0]}: transformers LongCat-Flash cannot express this setting')
  out = {**_FIXED, **family.write_fields(cfg, _REQUIRED, _OPTIONAL)}
  # No num_hidden_layers, as in the release: transformers 4.57 sets it to 2 * num_layers itself,
  # the release's remote code (auto_map, trust_remote_code=True) defines it as a read-only
  # property, so a config.json carrying it fails to load there, and vLLM's FlashConfig would take
  # it for the number of LongCat layers.
  out.update(
    architectures=['LongcatFlashForCausalLM'],
    num_key_value_heads=cfg.num_heads,
    head_dim=cfg.qk_rope_head_dim,
    qk_head_dim=cfg.qk_head_dim,
  )
  return out


_SUBLAYER = (  # s = 0, 1, under model.layers.{l}
  ('input_layernorm.{s}.weight', 'input_norm_{s}.scale', None),
  ('post_attention_layernorm.{s}.weight', 'post_norm_{s}.scale', None),
  ('self_attn.{s}.q_a_proj.weight', 'attn_{s}.q_a.kernel', 1),  # [Q, D] <-> [D, Q]
  ('self_attn.{s}.q_a_layernorm.weight', 'attn_{s}.q_a_norm.scale', None),
  ('self_attn.{s}.q_b_proj.weight', 'attn_{s}.q_b.kernel', 1),  # [N*(P+R), Q] <-> [Q, N, P+R]
  ('self_attn.{s}.kv_a_proj_with_mqa.weight', 'attn_{s}.kv_a.kernel', 1),  # [K+R, D]
  ('self_attn.{s}.kv_a_layernorm.weight', 'attn_{s}.kv_a_norm.scale', None),
  ('self_attn.{s}.kv_b_proj.weight', 'attn_{s}.kv_b.kernel', 1),  # [N*(P+V), K] <-> [K, N, P+V]
  ('self_attn.{s}.o_proj.weight', 'attn_{s}.o.kernel', 2),  # [D, N*V] <-> [N, V, D]
  ('mlps.{s}.gate_proj.weight', 'mlp_{s}.gate.kernel', 1),
  ('mlps.{s}.up_proj.weight', 'mlp_{s}.up.kernel', 1),
  ('mlps.{s}.down_proj.weight', 'mlp_{s}.down.kernel', 1),
)
_LAYER = (
  ('mlp.router.classifier.weight', 'moe.router', 1),  # [E+Z, D] <-> [D, E+Z]
  ('mlp.router.e_score_correction_bias', 'moe.router_bias', None),
)
_EXPERT = (  # e < n_routed_experts: zero experts have no weights
  ('mlp.experts.{e}.gate_proj.weight', 'moe.experts.gate', 1),
  ('mlp.experts.{e}.up_proj.weight', 'moe.experts.up', 1),
  ('mlp.experts.{e}.down_proj.weight', 'moe.experts.down', 1),
)


def table(cfg: ModelConfig) -> list[Row]:
  """Every HF tensor of the checkpoint, grouped by the moetrain variable it fills."""
  (group,) = cfg.layer_groups()
  sub = [(hf.format(s=s), path.format(s=s), n) for s in (0, 1) for hf, path, n in _SUBLAYER]
  rows = family.global_rows() + family.group_rows(group, sub + list(_LAYER))
  return rows + family.group_rows(group, _EXPERT, experts=True)
