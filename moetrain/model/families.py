"""The families' parts and the named model presets (configs pick one by `variant=`).

A family is a choice of the decoder's parts (model/config.py ModelConfig): LongCat-Flash's
shortcut layers with MLA and zero experts; DeepSeek-V3's standard layers with MLA, a sigmoid
router over expert groups with a correction bias and shared experts (DeepSeek-V2's: a softmax
router, groups scored by their best expert); Qwen3-MoE's, Mixtral's, OLMoE's and Qwen2-MoE's
standard layers with grouped-query attention and a softmax router (Qwen2-MoE: a gated shared
expert); GLM-4.5's grouped-query attention with DeepSeek-V3's router. The real models' presets copy
their published config.json; a run from `init.hf_checkpoint` takes the shapes from the
checkpoint's own config.json instead.
"""

from moetrain.model.config import LONGCAT_PRESETS, ModelConfig

# The parts each family's config.json implies without saying (convert/standard.py reads the rest
# from it and refuses to export a config whose parts differ).
# Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE: standard layers, GQA, half-split RoPE, softmax top-k.
_GQA = dict(
  layer_layout='standard',
  attention='gqa',
  rope_interleaved=False,
  router_score='softmax',
  router_bias=False,
  zero_expert_num=0,
  routed_scaling_factor=1.0,
  n_shared_experts=0,
  shared_expert_gate=False,
  n_group=1,
  topk_group=1,
  qk_norm_per_head=True,
  qkv_bias=False,
  o_bias=False,
)
# DeepSeek-V2 and V3: standard layers, MLA, interleaved RoPE.
_MLA = dict(
  layer_layout='standard',
  attention='mla',
  rope_interleaved=True,
  zero_expert_num=0,
  mla_scale_q_lora=False,
  mla_scale_kv_lora=False,
  mla_norm_eps=1e-6,
  shared_expert_gate=False,
  shared_ffn_hidden_size=0,
)
# What the config.json says (the family's reader sets it): not a fixed part.
_BIASES = ('qkv_bias', 'o_bias')
_GLM_READ = ('qkv_bias', 'routed_scaling_factor', 'n_shared_experts', 'n_group', 'topk_group')
PARTS = {
  'longcat_flash': {},  # ModelConfig's defaults
  'deepseek_v3': dict(_MLA, model_type='deepseek_v3', router_score='sigmoid', router_bias=True),
  # Softmax scores, gates scaled but never renormalised, groups scored by their best expert.
  'deepseek_v2': dict(
    _MLA,
    model_type='deepseek_v2',
    router_score='softmax',
    router_bias=False,
    norm_topk_prob=False,
    router_group_score='max',
  ),
  'qwen3_moe': dict(_GQA, model_type='qwen3_moe', qk_norm=True),
  'mixtral': dict(_GQA, model_type='mixtral', qk_norm=False, norm_topk_prob=True),
  # q/k norm over the whole projections; attention_bias puts a bias on q, k, v and o.
  'olmoe': {
    **{k: v for k, v in _GQA.items() if k not in _BIASES},
    'model_type': 'olmoe',
    'qk_norm': True,
    'qk_norm_per_head': False,
  },
  # One shared expert behind a sigmoid gate; biases on q, k, v (qkv_bias), none on o.
  'qwen2_moe': {
    **{k: v for k, v in _GQA.items() if k != 'qkv_bias'},
    'model_type': 'qwen2_moe',
    'qk_norm': False,
    'n_shared_experts': 1,
    'shared_expert_gate': True,
  },
  # GLM-4.5: DeepSeek-V3's router (sigmoid + correction bias, groups by their best two) on GQA
  # layers; one shared expert of n_shared_experts * expert width, dense first layers.
  'glm4_moe': {
    **{k: v for k, v in _GQA.items() if k not in _GLM_READ},
    'model_type': 'glm4_moe',
    'router_score': 'sigmoid',
    'router_bias': True,
    'router_group_score': 'top2',
    'shared_ffn_hidden_size': 0,
  },
  # gpt-oss: GQA with q/k/v/o biases and attention sinks, sliding and full layers, a router with
  # a logit bias choosing top-k before its softmax, experts with biases and a clamped SwiGLU.
  'gpt_oss': {
    **{k: v for k, v in _GQA.items() if k not in _BIASES},
    'model_type': 'gpt_oss',
    'qkv_bias': True,
    'o_bias': True,
    'qk_norm': False,
    'attention_sinks': True,
    'router_score': 'topk_softmax',
    'router_linear_bias': True,
    'norm_topk_prob': False,
    'expert_bias': True,
    'swiglu_limit': 7.0,
  },
  # MiniMax-M2: GQA with q/k norms over the whole projections and RoPE on part of each head,
  # DeepSeek-V3's sigmoid router with its correction bias in one group, gates renormalised,
  # Mixtral's expert names; no shared expert, no dense layer.
  'minimax_m2': {
    **{k: v for k, v in _GQA.items() if k not in _BIASES},
    'model_type': 'minimax_m2',
    'qk_norm': True,
    'qk_norm_per_head': False,
    'router_score': 'sigmoid',
    'router_bias': True,
    'norm_topk_prob': True,
    'qkv_bias': False,
    'o_bias': False,
  },
  # Qwen3-Next: Gated DeltaNet layers mixed with gated GQA attention (per-head q/k norm, RoPE on
  # a quarter of each head) by layer_types; every norm stores its offset from 1; Qwen2-MoE's
  # softmax router (renormalised) with a gated shared expert.
  'qwen3_next': {
    **_GQA,
    'model_type': 'qwen3_next',
    'n_shared_experts': 1,
    'qk_norm': True,
    'attn_output_gate': True,
    'norm_offset': 1.0,
    'shared_expert_gate': True,
  },
  # Qwen3.5-MoE's language model: Qwen3-Next's parts with Gated DeltaNet's input projections
  # apart.
  'qwen3_5_moe_text': {
    **_GQA,
    'model_type': 'qwen3_5_moe_text',
    'n_shared_experts': 1,
    'qk_norm': True,
    'attn_output_gate': True,
    'norm_offset': 1.0,
    'shared_expert_gate': True,
    'linear_split_projections': True,
    'norm_topk_prob': True,  # always renormalised (not a config.json key)
  },
  # DeepSeek-V3.2: DeepSeek-V3's parts with a lightning indexer in every MLA layer (its RoPE on
  # halves); GLM-5: the same with the indexer's RoPE on adjacent pairs.
  'deepseek_v32': dict(
    _MLA,
    model_type='deepseek_v32',
    router_score='sigmoid',
    router_bias=True,
    index_rope_interleaved=False,
  ),
  'glm_moe_dsa': dict(
    _MLA,
    model_type='glm_moe_dsa',
    router_score='sigmoid',
    router_bias=True,
    index_rope_interleaved=True,
  ),
}
# What the presets of a family share beyond its parts (values its config.json carries).
_SHAPE = {
  'deepseek_v3': dict(norm_topk_prob=True, rms_norm_eps=1e-6),
  'qwen3_moe': dict(norm_topk_prob=True, rms_norm_eps=1e-6),
  'mixtral': {},
  'olmoe': dict(rms_norm_eps=1e-5, rope_theta=10000.0),
  'qwen2_moe': dict(qkv_bias=True, rms_norm_eps=1e-6),
  'deepseek_v2': dict(rms_norm_eps=1e-6, rope_theta=10000.0),
  'glm4_moe': dict(qkv_bias=True, norm_topk_prob=True, partial_rotary_factor=0.5, rope_theta=1e6),
  'gpt_oss': dict(rope_theta=150000.0, rms_norm_eps=1e-5, yarn_truncate=False),
  'minimax_m2': dict(rope_theta=5e6, rms_norm_eps=1e-6, partial_rotary_factor=0.5),
  'qwen3_next': dict(norm_topk_prob=True, rms_norm_eps=1e-6, partial_rotary_factor=0.25),
  'qwen3_5_moe_text': dict(rms_norm_eps=1e-6, partial_rotary_factor=0.25),
  'deepseek_v32': dict(norm_topk_prob=True, rms_norm_eps=1e-6),
  'glm_moe_dsa': dict(norm_topk_prob=True, rms_norm_eps=1e-5),
}


def family(model_type: str, **shape) -> ModelConfig:
  return ModelConfig(**{**PARTS[model_type], **_SHAPE[model_type], **shape})


_TINY = dict(vocab_size=512, hidden_size=128, num_heads=4, expert_ffn_hidden_size=64)
# The tiny MLA models' shapes (DeepSeek-V3's layout: a dense layer first, a shared expert).
_MLA_TINY = dict(
  num_layers=3,
  first_k_dense_replace=1,
  q_lora_rank=64,
  kv_lora_rank=32,
  qk_nope_head_dim=32,
  qk_rope_head_dim=16,
  v_head_dim=32,
  ffn_hidden_size=256,
  n_routed_experts=8,
  n_shared_experts=1,
  moe_topk=2,
  routed_scaling_factor=2.5,
  rope_theta=1e4,
)
_INDEXER_TINY = dict(index_n_heads=4, index_head_dim=32, index_topk=8)
# DeepSeek-V2's long-context RoPE (every release): YaRN x40 over 4096 positions.
_V2_YARN = dict(
  max_position_embeddings=163840,
  yarn_factor=40.0,
  yarn_original_max_position=4096,
  yarn_mscale=0.707,
  yarn_mscale_all_dim=0.707,
)


def _hybrid(n: int, interval: int = 4) -> tuple:
  """Qwen3-Next's layer_types: every interval-th layer full attention, the others Gated DeltaNet."""
  return tuple(
    'full_attention' if (i + 1) % interval == 0 else 'linear_attention' for i in range(n)
  )


def _alternating(n: int) -> tuple:
  return tuple('sliding_attention' if i % 2 == 0 else 'full_attention' for i in range(n))


# What gpt-oss-20b and -120b share: 64 query heads of 64 over 8 key/value heads, experts as wide
# as the model, top-4, a 128-token window on every other layer, YaRN x32 over 4096 positions.
_GPT_OSS = dict(
  vocab_size=201088,
  hidden_size=2880,
  num_heads=64,
  num_kv_heads=8,
  head_dim=64,
  ffn_hidden_size=2880,
  expert_ffn_hidden_size=2880,
  moe_topk=4,
  sliding_window=128,
  max_position_embeddings=131072,
  yarn_factor=32.0,
  yarn_original_max_position=4096,
)

# What GLM-4.5 and GLM-4.5-Air share: 96 query heads of 128 over 8 key/value heads, top-8 of the
# routed experts plus one shared, one MTP layer.
_GLM = dict(
  vocab_size=151552,
  num_heads=96,
  num_kv_heads=8,
  head_dim=128,
  n_shared_experts=1,
  moe_topk=8,
  max_position_embeddings=131072,
  num_nextn_predict_layers=1,
)

# deepseek-ai/DeepSeek-V3's shapes (and R1's, V3.2's with an indexer).
_V3 = dict(
  vocab_size=129280,
  hidden_size=7168,
  num_layers=61,
  num_heads=128,
  q_lora_rank=1536,
  kv_lora_rank=512,
  qk_nope_head_dim=128,
  qk_rope_head_dim=64,
  v_head_dim=128,
  ffn_hidden_size=18432,
  expert_ffn_hidden_size=2048,
  n_routed_experts=256,
  n_shared_experts=1,
  moe_topk=8,
  n_group=8,
  topk_group=4,
  first_k_dense_replace=3,
  routed_scaling_factor=2.5,
  rope_theta=10000.0,
  max_position_embeddings=163840,
  yarn_factor=40.0,
  yarn_original_max_position=4096,
  yarn_mscale=1.0,
  yarn_mscale_all_dim=1.0,
)

MODEL_PRESETS = {
  **LONGCAT_PRESETS,
  # Small enough for a 2-core CPU: the demos and tests of each family.
  'deepseek_tiny': family('deepseek_v3', **_TINY, **_MLA_TINY, n_group=4, topk_group=2),
  # DeepSeek Sparse Attention's: each query keeps the 8 best of the keys it sees, fewer than a
  # demo example's tokens, so the demos and tests run the selection, not dense attention.
  'deepseek_v32_tiny': family(
    'deepseek_v32', **_TINY, **_MLA_TINY, **_INDEXER_TINY, n_group=4, topk_group=2
  ),
  # GLM-5's: one expert group, values as wide as the queries' two parts (its 192 + 64 = 256).
  'glm_5_tiny': family('glm_moe_dsa', **_TINY, **{**_MLA_TINY, 'v_head_dim': 48}, **_INDEXER_TINY),
  'qwen3_tiny': family(
    'qwen3_moe',
    **_TINY,
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    ffn_hidden_size=256,
    n_routed_experts=8,
    moe_topk=2,
    rope_theta=1e6,
  ),
  'mixtral_tiny': family(
    'mixtral',
    **_TINY,
    num_layers=2,
    num_kv_heads=2,
    ffn_hidden_size=64,
    n_routed_experts=8,
    moe_topk=2,
    rope_theta=1e6,
  ),
  'olmoe_tiny': family(
    'olmoe',
    **_TINY,
    num_layers=2,
    num_kv_heads=2,
    ffn_hidden_size=64,
    n_routed_experts=8,
    moe_topk=2,
  ),
  'qwen2_moe_tiny': family(
    'qwen2_moe',
    **_TINY,
    num_layers=2,
    num_kv_heads=2,
    ffn_hidden_size=256,
    shared_ffn_hidden_size=128,
    n_routed_experts=8,
    moe_topk=2,
    rope_theta=1e6,
  ),
  'deepseek_v2_tiny': family(
    'deepseek_v2',
    **_TINY,
    num_layers=3,
    first_k_dense_replace=1,
    q_lora_rank=0,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    ffn_hidden_size=256,
    n_routed_experts=8,
    n_shared_experts=2,
    moe_topk=2,
  ),
  'glm4_moe_tiny': family(
    'glm4_moe',
    **_TINY,
    num_layers=3,
    num_kv_heads=2,
    first_k_dense_replace=1,
    ffn_hidden_size=256,
    n_routed_experts=8,
    n_shared_experts=1,
    moe_topk=2,
  ),
  'gpt_oss_tiny': family(
    'gpt_oss',
    **_TINY,
    num_layers=2,
    num_kv_heads=2,
    ffn_hidden_size=64,
    n_routed_experts=8,
    moe_topk=2,
    sliding_window=64,
    layer_types=_alternating(2),
  ),
  'minimax_m2_tiny': family(
    'minimax_m2',
    **_TINY,
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    ffn_hidden_size=64,
    n_routed_experts=8,
    moe_topk=2,
  ),
  # MiniMaxAI/MiniMax-M2 (and M2.1, M2.5: the same shapes): 229B, 10B active; 48 query heads
  # of 128 over 8 key/value heads, RoPE on half of each head, top-8 of 256 experts.
  'minimax_m2': family(
    'minimax_m2',
    vocab_size=200064,
    hidden_size=3072,
    num_layers=62,
    num_heads=48,
    num_kv_heads=8,
    head_dim=128,
    ffn_hidden_size=1536,
    expert_ffn_hidden_size=1536,
    n_routed_experts=256,
    moe_topk=8,
    max_position_embeddings=196608,
  ),
  'qwen3_next_tiny': family(
    'qwen3_next',
    **_TINY,
    num_layers=4,
    num_kv_heads=2,
    head_dim=32,
    ffn_hidden_size=256,
    shared_ffn_hidden_size=64,
    n_routed_experts=8,
    moe_topk=2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    layer_types=_hybrid(4),
  ),
  # Qwen/Qwen3-Next-80B-A3B (-Instruct, -Thinking): 80B, 3B active; three Gated DeltaNet layers
  # (16 key heads, 32 value heads of 128) to each gated attention layer (16 query heads of 256
  # over 2), top-10 of 512 experts plus a shared one.
  'qwen3_next_80b_a3b': family(
    'qwen3_next',
    vocab_size=151936,
    hidden_size=2048,
    num_layers=48,
    num_heads=16,
    num_kv_heads=2,
    head_dim=256,
    ffn_hidden_size=5120,
    expert_ffn_hidden_size=512,
    shared_ffn_hidden_size=512,
    n_routed_experts=512,
    moe_topk=10,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    layer_types=_hybrid(48),
    rope_theta=1e7,
    max_position_embeddings=262144,
  ),
  # Qwen/Qwen3.5-35B-A3B's language model, as transformers 5.24's Qwen3_5MoeTextConfig defaults
  # give it (a run from init.hf_checkpoint takes the release's config.json): Qwen3-Next's layout
  # with 40 layers and top-8 of 256 experts.
  'qwen3_5_35b_a3b': family(
    'qwen3_5_moe_text',
    vocab_size=248320,
    hidden_size=2048,
    num_layers=40,
    num_heads=16,
    num_kv_heads=2,
    head_dim=256,
    ffn_hidden_size=512,
    expert_ffn_hidden_size=512,
    shared_ffn_hidden_size=512,
    n_routed_experts=256,
    moe_topk=8,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    layer_types=_hybrid(40),
    rope_theta=1e4,
    max_position_embeddings=32768,
  ),
  # openai/gpt-oss-20b: 20.9B, 3.6B active.
  'gpt_oss_20b': family(
    'gpt_oss', **_GPT_OSS, num_layers=24, n_routed_experts=32, layer_types=_alternating(24)
  ),
  # openai/gpt-oss-120b: 116.8B, 5.1B active.
  'gpt_oss_120b': family(
    'gpt_oss', **_GPT_OSS, num_layers=36, n_routed_experts=128, layer_types=_alternating(36)
  ),
  # zai-org/GLM-4.5-Air (and -Base): 106B, 12B active.
  'glm4_5_air': family(
    'glm4_moe',
    **_GLM,
    hidden_size=4096,
    num_layers=46,
    ffn_hidden_size=10944,
    expert_ffn_hidden_size=1408,
    n_routed_experts=128,
    first_k_dense_replace=1,
    routed_scaling_factor=1.0,
  ),
  # zai-org/GLM-4.5 (and -Base; GLM-4.6 is these shapes over 202752 positions): 355B, 32B active.
  'glm4_5': family(
    'glm4_moe',
    **_GLM,
    hidden_size=5120,
    num_layers=92,
    ffn_hidden_size=12288,
    expert_ffn_hidden_size=1536,
    n_routed_experts=160,
    first_k_dense_replace=3,
    routed_scaling_factor=2.5,
    qk_norm=True,
  ),
  # allenai/OLMoE-1B-7B-0924 (and -Instruct).
  'olmoe_1b_7b': family(
    'olmoe',
    vocab_size=50304,
    hidden_size=2048,
    num_layers=16,
    num_heads=16,
    num_kv_heads=16,
    ffn_hidden_size=1024,
    expert_ffn_hidden_size=1024,
    n_routed_experts=64,
    moe_topk=8,
    max_position_embeddings=4096,
  ),
  # Qwen/Qwen1.5-MoE-A2.7B (and -Chat).
  'qwen1_5_moe_a2_7b': family(
    'qwen2_moe',
    vocab_size=151936,
    hidden_size=2048,
    num_layers=24,
    num_heads=16,
    num_kv_heads=16,
    ffn_hidden_size=5632,
    expert_ffn_hidden_size=1408,
    shared_ffn_hidden_size=5632,
    n_routed_experts=60,
    moe_topk=4,
    rope_theta=1e6,
    max_position_embeddings=8192,
  ),
  # Qwen/Qwen2-57B-A14B (and -Instruct).
  'qwen2_57b_a14b': family(
    'qwen2_moe',
    vocab_size=151936,
    hidden_size=3584,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    ffn_hidden_size=18944,
    expert_ffn_hidden_size=2560,
    shared_ffn_hidden_size=20480,
    n_routed_experts=64,
    moe_topk=8,
    rope_theta=1e6,
    max_position_embeddings=32768,
  ),
  # deepseek-ai/DeepSeek-V2-Lite (and -Chat): q without low rank, greedy top-6.
  'deepseek_v2_lite': family(
    'deepseek_v2',
    **_V2_YARN,
    vocab_size=102400,
    hidden_size=2048,
    num_layers=27,
    num_heads=16,
    q_lora_rank=0,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    ffn_hidden_size=10944,
    expert_ffn_hidden_size=1408,
    n_routed_experts=64,
    n_shared_experts=2,
    moe_topk=6,
    first_k_dense_replace=1,
    routed_scaling_factor=1.0,
  ),
  # deepseek-ai/DeepSeek-V2 (and -Chat, DeepSeek-Coder-V2's shapes): top-6 in the best 3 of 8
  # groups, gates x 16.
  'deepseek_v2_236b': family(
    'deepseek_v2',
    **_V2_YARN,
    vocab_size=102400,
    hidden_size=5120,
    num_layers=60,
    num_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    ffn_hidden_size=12288,
    expert_ffn_hidden_size=1536,
    n_routed_experts=160,
    n_shared_experts=2,
    moe_topk=6,
    n_group=8,
    topk_group=3,
    first_k_dense_replace=1,
    routed_scaling_factor=16.0,
  ),
  # moonshotai/Moonlight-16B-A3B (DeepSeek-V3 layout, q without low rank, no RoPE scaling).
  'moonlight_16b_a3b': family(
    'deepseek_v3',
    vocab_size=163840,
    hidden_size=2048,
    num_layers=27,
    num_heads=16,
    q_lora_rank=0,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    ffn_hidden_size=11264,
    expert_ffn_hidden_size=1408,
    n_routed_experts=64,
    n_shared_experts=2,
    moe_topk=6,
    first_k_dense_replace=1,
    routed_scaling_factor=2.446,
    rope_theta=50000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
  ),
  # deepseek-ai/DeepSeek-V3 (and R1): 671B, 37B active.
  'deepseek_v3_671b': family('deepseek_v3', **_V3),
  # moonshotai/Kimi-K2.5 (and K2.6): the language model of the multimodal release, Kimi-K2's
  # shapes: DeepSeek-V3's with 64 heads, top-8 of 384 experts in one group, one dense layer,
  # YaRN x64 over 4096 positions.
  'kimi_k2_5': family(
    'deepseek_v3',
    **{
      **_V3,
      'vocab_size': 163840,
      'num_heads': 64,
      'n_routed_experts': 384,
      'n_group': 1,
      'topk_group': 1,
      'first_k_dense_replace': 1,
      'routed_scaling_factor': 2.827,
      'rope_theta': 50000.0,
      'max_position_embeddings': 262144,
      'yarn_factor': 64.0,
      'yarn_beta_fast': 1.0,
      'yarn_beta_slow': 1.0,
    },
  ),
  # deepseek-ai/DeepSeek-V3.2-Exp (and V3.2): DeepSeek-V3's shapes plus a lightning indexer of 64
  # heads of 128 keeping 2048 tokens per query.
  'deepseek_v32_671b': family(
    'deepseek_v32',
    **_V3,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=2048,
  ),
  # zai-org/GLM-5 as transformers 5.24's GlmMoeDsaConfig defaults give it (a run from
  # init.hf_checkpoint takes the release's config.json): 78 MLA layers of 64 heads (values of
  # 256), an indexer of 32 heads of 128 keeping 2048 tokens, top-8 of 256 experts plus a shared
  # one, three dense layers first.
  'glm_5': family(
    'glm_moe_dsa',
    vocab_size=154880,
    hidden_size=6144,
    num_layers=78,
    num_heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    ffn_hidden_size=12288,
    expert_ffn_hidden_size=2048,
    n_routed_experts=256,
    n_shared_experts=1,
    moe_topk=8,
    first_k_dense_replace=3,
    routed_scaling_factor=2.5,
    rope_theta=10000.0,
    max_position_embeddings=202752,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
  ),
  # Qwen/Qwen3-30B-A3B (and Qwen3-Coder-30B-A3B's shapes).
  'qwen3_30b_a3b': family(
    'qwen3_moe',
    vocab_size=151936,
    hidden_size=2048,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    ffn_hidden_size=6144,
    expert_ffn_hidden_size=768,
    n_routed_experts=128,
    moe_topk=8,
    rope_theta=1e6,
    max_position_embeddings=40960,
  ),
  # Qwen/Qwen3-235B-A22B.
  'qwen3_235b_a22b': family(
    'qwen3_moe',
    vocab_size=151936,
    hidden_size=4096,
    num_layers=94,
    num_heads=64,
    num_kv_heads=4,
    head_dim=128,
    ffn_hidden_size=12288,
    expert_ffn_hidden_size=1536,
    n_routed_experts=128,
    moe_topk=8,
    rope_theta=1e6,
    max_position_embeddings=40960,
  ),
  # mistralai/Mixtral-8x7B-v0.1 (and Instruct).
  'mixtral_8x7b': family(
    'mixtral',
    vocab_size=32000,
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    ffn_hidden_size=14336,
    expert_ffn_hidden_size=14336,
    n_routed_experts=8,
    moe_topk=2,
    rope_theta=1e6,
    max_position_embeddings=32768,
  ),
  # mistralai/Mixtral-8x22B-v0.1 (and Instruct).
  'mixtral_8x22b': family(
    'mixtral',
    vocab_size=32768,
    hidden_size=6144,
    num_layers=56,
    num_heads=48,
    num_kv_heads=8,
    ffn_hidden_size=16384,
    expert_ffn_hidden_size=16384,
    n_routed_experts=8,
    moe_topk=2,
    rope_theta=1e6,
    max_position_embeddings=65536,
  ),
}
