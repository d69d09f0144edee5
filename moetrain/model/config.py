"""The network's shape: the `config.model` section (what a checkpoint fixes), and the LongCat
presets (tiny for CPU, medium for benches, flash). How it runs is the `engine` section
(moetrain/core/engine.py), attached to a ModelConfig by start-up."""

import dataclasses
import functools
import math
from typing import NamedTuple

from moetrain.core.engine import EngineConfig, LoraConfig
from moetrain.core.fields import check, field
from moetrain.kernels import delta_rule_tokamax, splash

# The families, by the model_type of their Hugging Face config.json.
MODEL_TYPES = (
  'longcat_flash',
  'deepseek_v3',
  'qwen3_moe',
  'mixtral',
  'olmoe',
  'qwen2_moe',
  'deepseek_v2',
  'glm4_moe',
  'gpt_oss',
  'minimax_m2',
  'qwen3_next',
  'qwen3_5_moe_text',
  'deepseek_v32',
  'glm_moe_dsa',
)

positive = functools.partial(field, check='positive')


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class LayerGroup(NamedTuple):
  """Consecutive decoder layers of one kind, stacked and scanned as one module `name`."""

  name: str  # the Transformer attribute: 'layers' (MoE layers), 'dense_layers', 'layers_1', ...
  kind: str  # 'moe' or 'dense' (an MLP in place of the MoE)
  start: int  # the first layer's index in the checkpoint (model.layers.{l})
  count: int
  # The token mixer: 'attention' (softmax attention), or 'linear' (a Gated DeltaNet layer:
  # Qwen3-Next's 'linear_attention' layer_types).
  mixer: str = 'attention'


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The `config.model` section: the model's hyper-parameters (the names of the HF configs where
  they have them), the parts the decoder is built from (attention, RoPE, router, layer layout:
  one decoder serves every family): everything a checkpoint fixes. How it computes is
  `engine` (the `engine` section, laid out for a platform and mesh by start-up), and its adapters
  `lora`. The defaults are the 'tiny' preset, a small LongCat-Flash."""

  # The family (HF model_type): names the checkpoint layout for import and export. The parts
  # below say what the decoder computes; model/families.py sets them per family.
  model_type: str = field('longcat_flash', choices=MODEL_TYPES)

  vocab_size: int = positive(512)  # must be >= the tokenizer's vocabulary
  hidden_size: int = positive(128)  # D
  # Decoder layers: LongCat's shortcut layers (each 2 attention + 2 dense MLP + 1 MoE), or
  # standard layers (attention + MoE, or attention + dense MLP; HF num_hidden_layers).
  num_layers: int = positive(2)
  num_heads: int = positive(4)  # N
  # Parts. 'shortcut': LongCat's ScMoE layer; 'standard': pre-norm attention then MoE (or MLP).
  layer_layout: str = field('shortcut', choices=('shortcut', 'standard'))
  attention: str = field('mla', choices=('mla', 'gqa'))  # latent (MLA) or grouped-query
  # RoPE on adjacent pairs (2i, 2i+1) (LongCat, DeepSeek) or on halves (i, i + H/2) (Qwen, Mixtral).
  rope_interleaved: bool = True
  # GQA: RoPE on the first partial_rotary_factor of each head's features only (GLM-4.5: 0.5).
  partial_rotary_factor: float = field(1.0, check='positive')
  # GQA: a learned logit per head in each softmax, whose weight goes to no value (gpt-oss).
  attention_sinks: bool = False
  # Layers whose queries see only the last sliding_window positions (themselves included): those
  # layer_types names 'sliding_attention'.
  sliding_window: int = field(0, check='non_negative', zero='0 = none')
  # 'sliding_attention', 'full_attention' or 'linear_attention' (a Gated DeltaNet layer in place
  # of attention: Qwen3-Next) per layer; () = all full.
  layer_types: tuple = ()
  num_kv_heads: int = field(0, check='non_negative', zero='0 = num_heads')  # GQA key/value heads
  head_dim: int = field(0, check='non_negative', zero='0 = hidden_size / num_heads')  # GQA
  qk_norm: bool = False  # GQA: RMSNorm over each query and key head before RoPE (Qwen3)
  # GQA: each query head's projection also yields a gate, its output times sigmoid(gate) before
  # the o projection (Qwen3-Next's gated attention).
  attn_output_gate: bool = False
  # Every RMSNorm of the decoder scales by (norm_offset + weight): Qwen3-Next's norms store the
  # weight's offset from 1 (1.0); the Gated DeltaNet output norm keeps the plain weight.
  norm_offset: float = field(0.0, check='non_negative')
  # Gated DeltaNet layers (layer_types 'linear_attention'): key heads (query and key) and value
  # heads (each key head serves value_heads / key_heads of them), their widths, the short causal
  # convolution's kernel, and the chunk of the chunked delta rule in training.
  linear_num_key_heads: int = field(0, check='non_negative')
  linear_num_value_heads: int = field(0, check='non_negative')
  linear_key_head_dim: int = field(0, check='non_negative')
  linear_value_head_dim: int = field(0, check='non_negative')
  linear_conv_kernel_dim: int = positive(4)
  delta_chunk: int = positive(64)
  # Gated DeltaNet's input projections: one per key head group [q | k | v | z] and one [b | a]
  # (Qwen3-Next), or four apart, q k v of all heads in one (Qwen3.5).
  linear_split_projections: bool = False
  # q/k norm over each head (Qwen3) or over the whole projection, all heads at once (OLMoE).
  qk_norm_per_head: bool = True
  # GQA projection biases: on q, k and v (Qwen2-MoE; OLMoE's attention_bias) and on o (OLMoE's).
  qkv_bias: bool = False
  o_bias: bool = False
  # Router: 'softmax' or 'sigmoid' scores; top-k over score + correction bias (router_bias: a
  # buffer the balancing controller moves), within the topk_group best of n_group expert groups;
  # gates are the chosen scores, renormalised to sum 1 (norm_topk_prob), times
  # routed_scaling_factor.
  router_score: str = field('softmax', choices=('softmax', 'sigmoid', 'topk_softmax'))
  router_bias: bool = True
  # gpt-oss's router: a bias on the logits (a parameter, not the controller's), and top-k over
  # the logits then a softmax over the chosen ones (router_score 'topk_softmax').
  router_linear_bias: bool = False
  expert_bias: bool = False  # routed experts with biases on gate, up and down (gpt-oss)
  # gpt-oss's clamped SwiGLU when > 0: gate clipped above and up on both sides at the limit,
  # gate * sigmoid(1.702 gate) * (up + 1).
  swiglu_limit: float = field(0.0, check='non_negative', zero='0 = silu(gate) * up')
  norm_topk_prob: bool = False
  n_group: int = positive(1)
  topk_group: int = positive(1)
  # A group's score: the sum of its best two choice scores (DeepSeek-V3) or its best (DeepSeek-V2).
  router_group_score: str = field('top2', choices=('top2', 'max'))
  # Shared experts (DeepSeek, Qwen2-MoE): one SwiGLU of width shared_ffn_hidden_size every token
  # goes through beside the routed ones, its output times sigmoid(x @ w) with shared_expert_gate
  # (Qwen2-MoE).
  n_shared_experts: int = field(0, check='non_negative')
  shared_ffn_hidden_size: int = field(
    0, check='non_negative', zero='0 = n_shared_experts * expert_ffn_hidden_size'
  )
  shared_expert_gate: bool = False
  # Standard layers with a dense MLP in place of the MoE: the first first_k_dense_replace
  # (DeepSeek), those in mlp_only_layers, and those l with (l + 1) % decoder_sparse_step != 0
  # (Qwen).
  first_k_dense_replace: int = field(0, check='non_negative')
  mlp_only_layers: tuple = ()
  decoder_sparse_step: int = positive(1)
  q_lora_rank: int = field(64, check='non_negative', zero='0 = a plain q projection')  # MLA
  kv_lora_rank: int = positive(32)  # MLA compressed kv latent width (what the KV cache stores)
  qk_nope_head_dim: int = positive(32)  # per-head q/k width without RoPE
  qk_rope_head_dim: int = positive(16)  # RoPE part of q; the one rope key all heads share
  v_head_dim: int = positive(32)  # per-head value width
  # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5; model/indexer.py): MLA whose queries each
  # attend only to the index_topk past tokens a lightning indexer of index_n_heads heads of
  # index_head_dim scores best, its RoPE on adjacent pairs with index_rope_interleaved (GLM-5) or
  # on halves (DeepSeek-V3.2).
  index_n_heads: int = field(0, check='non_negative', zero='0 = dense attention, no indexer')
  index_head_dim: int = positive(128)
  index_topk: int = positive(2048)
  index_rope_interleaved: bool = False
  ffn_hidden_size: int = positive(256)  # dense SwiGLU hidden width
  expert_ffn_hidden_size: int = positive(64)  # routed expert SwiGLU hidden width
  n_routed_experts: int = positive(8)  # FFN experts
  zero_expert_num: int = field(4, check='non_negative')  # zero-computation (identity) experts
  moe_topk: int = positive(3)  # experts per token, zero experts included
  routed_scaling_factor: float = positive(6.0)  # gate multiplier (zero experts' too)
  rms_norm_eps: float = positive(1e-5)  # layer norms and the final norm
  mla_norm_eps: float = positive(1e-6)  # MLA latent norms (HF's default, not rms_norm_eps)
  rope_theta: float = positive(1e7)  # interleaved RoPE base
  mla_scale_q_lora: bool = True  # multiply q by sqrt(D / q_lora_rank)
  mla_scale_kv_lora: bool = True  # multiply the kv latent by sqrt(D / kv_lora_rank)
  max_position_embeddings: int = 131072  # informational (RoPE needs no table)
  # Checkpoint layers past num_layers that hold a multi-token-prediction head (GLM-4.5's
  # model.layers.{num_layers}.*): skipped on load, as transformers does; copied on export.
  num_nextn_predict_layers: int = field(0, check='non_negative')
  # YaRN RoPE scaling (DeepSeek's rope_scaling), off at factor 0: frequencies interpolated by
  # `yarn_factor` below the correction range of yarn_beta_fast / yarn_beta_slow rotations over
  # yarn_original_max_position, cos/sin scaled by mscale(yarn_mscale) / mscale(
  # yarn_mscale_all_dim), the softmax scale by mscale(yarn_mscale_all_dim)^2.
  yarn_factor: float = field(0.0, check='non_negative', zero='0 = no RoPE scaling')
  yarn_original_max_position: int = field(0, check='non_negative')
  yarn_beta_fast: float = positive(32.0)
  yarn_beta_slow: float = positive(1.0)
  yarn_mscale: float = field(1.0, check='non_negative')
  yarn_mscale_all_dim: float = field(0.0, check='non_negative')
  yarn_truncate: bool = True  # the correction range rounded out to whole dimensions (gpt-oss: not)
  # Derived: set from the `lora` section, and the `engine` section laid out by start-up.
  lora: LoraConfig = field(LoraConfig(), role='derived')
  # Derived: loss.indexer_kl > 0, the sparse attention indexer trained on its KL loss.
  train_indexer: bool = field(False, role='derived')
  engine: EngineConfig = field(EngineConfig(), role='derived')

  def __post_init__(self):  # configs and config.json give lists; the config must stay hashable
    object.__setattr__(self, 'mlp_only_layers', tuple(self.mlp_only_layers))
    object.__setattr__(self, 'layer_types', tuple(self.layer_types))

  @property
  def balance_loss_kind(self) -> str:
    if self.engine.moe_balance_loss != 'auto':
      return self.engine.moe_balance_loss
    sequence = ('deepseek_v3', 'deepseek_v2', 'glm4_moe', 'deepseek_v32', 'glm_moe_dsa')
    if self.model_type in sequence:
      return 'sequence'
    return 'device' if self.model_type == 'longcat_flash' else 'switch'

  @property
  def bias_rule(self) -> str:
    if self.engine.moe_bias_rule != 'auto':
      return self.engine.moe_bias_rule
    sign = ('deepseek_v3', 'glm4_moe', 'deepseek_v32', 'glm_moe_dsa')
    return 'sign' if self.model_type in sign else 'proportional'

  def laid_out(self, platform: str, mesh_shape) -> 'ModelConfig':
    """This config with its engine on `platform` and a mesh (mesh_shape: sizes, or a Mesh)."""
    return dataclasses.replace(self, engine=self.engine.laid_out(platform, mesh_shape))

  def with_engine(self, **changes) -> 'ModelConfig':
    """This network computed another way: `changes` to engine keys."""
    engine = dataclasses.replace(self.engine, **changes)
    return dataclasses.replace(self, engine=engine)

  @property
  def qk_head_dim(self) -> int:
    """Per-head width of queries and keys (the softmax scale's)."""
    if self.attention == 'gqa':
      return self.gqa_head_dim
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  def splash_attention(self, seq_len: int) -> bool:
    """Whether causal self-attention over seq_len positions runs the splash kernel."""
    if self.engine.attention_kernel == 'auto':
      return self.engine.platform == 'tpu' and splash.supports(seq_len)
    return self.engine.attention_kernel == 'splash'

  def delta_rule_tokamax(self) -> bool:
    """Whether Gated DeltaNet's delta rule trains on tokamax's kernel (engine.delta_rule_kernel);
    'auto' asks the TPU being traced for, so call it while tracing."""
    if self.engine.delta_rule_kernel == 'auto':
      tpu = self.engine.platform == 'tpu'
      return tpu and delta_rule_tokamax.supports(self.linear_key_head_dim)
    return self.engine.delta_rule_kernel == 'tokamax'

  @property
  def attention_scale(self) -> float:
    """The softmax's score scale: 1/sqrt(qk_head_dim), times YaRN's mscale^2 when it has one."""
    scale = self.qk_head_dim**-0.5
    if self.yarn_factor > 1 and self.yarn_mscale_all_dim:
      scale *= yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim) ** 2
    return scale

  @property
  def value_head_dim(self) -> int:
    return self.gqa_head_dim if self.attention == 'gqa' else self.v_head_dim

  @property
  def attention_blocks(self) -> int:
    """Attention sublayers of the whole model (two per LongCat shortcut layer)."""
    return self.num_layers * (2 if self.layer_layout == 'shortcut' else 1)

  @property
  def gqa_head_dim(self) -> int:
    return self.head_dim or self.hidden_size // self.num_heads

  @property
  def rotary_dim(self) -> int:
    """GQA's rotated features per head: the first partial_rotary_factor of them."""
    return int(self.gqa_head_dim * self.partial_rotary_factor)

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  def layer_kinds(self) -> tuple[str, ...]:
    """'moe' or 'dense' per decoder layer (a shortcut layer always holds an MoE)."""
    if self.layer_layout == 'shortcut':
      return ('moe',) * self.num_layers
    return tuple(
      'dense'
      if i < self.first_k_dense_replace
      or i in self.mlp_only_layers
      or (i + 1) % self.decoder_sparse_step
      else 'moe'
      for i in range(self.num_layers)
    )

  @property
  def moe_layer_indices(self) -> tuple[int, ...]:
    """The decoder layers that hold an MoE, in order: the rows of per-layer routing statistics
    and expert loads, which are named by these indices (as the checkpoint's layers are)."""
    return tuple(i for i, kind in enumerate(self.layer_kinds()) if kind == 'moe')

  def layer_groups(self) -> tuple[LayerGroup, ...]:
    """The layers as runs of one kind, each stacked and scanned as one module: 'layers' holds
    the (first run of) MoE layers, 'dense_layers' the dense ones; further runs of a kind (layers
    interleaved) are 'layers_1', 'dense_layers_1', ..."""
    groups, seen = [], {}
    for i, (kind, mixer) in enumerate(zip(self.layer_kinds(), self.layer_mixers())):
      if groups and (groups[-1].kind, groups[-1].mixer) == (kind, mixer):
        groups[-1] = groups[-1]._replace(count=groups[-1].count + 1)
        continue
      n = seen[kind, mixer] = seen.get((kind, mixer), -1) + 1
      base = ('linear_' if mixer == 'linear' else '') + (
        'layers' if kind == 'moe' else 'dense_layers'
      )
      groups.append(LayerGroup(base + (f'_{n}' if n else ''), kind, i, 1, mixer))
    return tuple(groups)

  def layer_mixers(self) -> tuple[str, ...]:
    """'attention' or 'linear' (Gated DeltaNet) per decoder layer."""
    types = self.layer_types or ('full_attention',) * self.num_layers
    return tuple('linear' if t == 'linear_attention' else 'attention' for t in types)

  def layer_windows(self) -> tuple[int, ...]:
    """Each layer's attention window (0: full), per-layer data of the layer scan (gpt-oss's
    alternating layers are scanned together; the attention picks its mask by it)."""
    types = self.layer_types or ('full_attention',) * self.num_layers
    return tuple(self.sliding_window if t == 'sliding_attention' else 0 for t in types)

  @property
  def num_moe_layers(self) -> int:
    return self.layer_kinds().count('moe')

  @property
  def shared_width(self) -> int:
    """Hidden width of the shared experts' SwiGLU (0: none)."""
    if not self.n_shared_experts:
      return 0
    return self.shared_ffn_hidden_size or self.n_shared_experts * self.expert_ffn_hidden_size

  @property
  def num_experts_total(self) -> int:
    return self.n_routed_experts + self.zero_expert_num

  @property
  def expected_ffn_experts(self) -> float:
    if self.engine.moe_expected_ffn_experts > 0:
      return self.engine.moe_expected_ffn_experts
    return self.moe_topk * self.n_routed_experts / self.num_experts_total

  def validate(self, prefix: str = 'model') -> None:
    def need(ok, key, msg):  # key: a model key, or an engine key named with its section
      if not ok:
        raise ValueError(f'{key if "." in key else f"{prefix}.{key}"}: {msg}')

    check(self, prefix)
    self.engine.validate()
    self._validate_parts(need)
    self._validate_moe(need)
    quant = self.engine.quant
    if quant == 'int4':  # codes pack in pairs along each kernel's first input dimension
      packed = ('hidden_size', 'q_lora_rank', 'kv_lora_rank', 'num_heads')
      widths = ('ffn_hidden_size', 'expert_ffn_hidden_size', 'shared_ffn_hidden_size')
      for field in (*packed, *widths):
        need(
          getattr(self, field) % 2 == 0,
          field,
          f'{getattr(self, field)} is odd: int4 packs two codes along it; use engine.quant=int8',
        )
    if quant != 'none' and not self.lora.enabled:
      raise ValueError(
        'engine.quant: quantised base weights are frozen: set lora.rank > 0 (QLoRA) or quant="none"'
      )
    self.lora.validate()

  def _validate_layer_types(self, need) -> None:
    types = set(self.layer_types) - {'sliding_attention', 'full_attention', 'linear_attention'}
    need(
      not types,
      'layer_types',
      f'{sorted(types)}: not sliding_attention, full_attention or linear_attention',
    )
    need(
      not self.layer_types or len(self.layer_types) == self.num_layers,
      'layer_types',
      f'{len(self.layer_types)} entries for {self.num_layers} layers',
    )
    if 'linear_attention' in self.layer_types:
      self._validate_linear(need)

  def _validate_linear(self, need) -> None:
    for f in ('linear_num_key_heads', 'linear_num_value_heads', 'linear_key_head_dim'):
      need(getattr(self, f) > 0, f, 'must be positive for linear_attention layers')
    need(self.linear_value_head_dim > 0, 'linear_value_head_dim', 'must be positive')
    need(
      self.linear_num_value_heads % self.linear_num_key_heads == 0,
      'linear_num_value_heads',
      f'{self.linear_num_value_heads} value heads do not split over '
      f'{self.linear_num_key_heads} key heads',
    )
    need(self.layer_layout == 'standard', 'layer_layout', 'linear_attention needs standard layers')

  def _validate_parts(self, need) -> None:
    rope = ('qk_rope_head_dim', self.qk_rope_head_dim)
    if self.attention == 'gqa':
      rope = ('head_dim', self.rotary_dim)  # times partial_rotary_factor
      need(self.partial_rotary_factor <= 1, 'partial_rotary_factor', 'must be in (0, 1]')
      need(
        self.num_heads % self.kv_heads == 0,
        'num_kv_heads',
        f'{self.num_heads} query heads do not split into {self.kv_heads} key/value groups',
      )
      need(
        self.head_dim or self.hidden_size % self.num_heads == 0,
        'head_dim',
        f'0 means hidden_size / num_heads, but {self.hidden_size} / {self.num_heads} is not whole',
      )
    need(rope[1] % 2 == 0, rope[0], f'must be even (RoPE rotates pairs), got {rope[1]}')
    need(
      self.layer_layout == 'standard' or self.attention == 'mla',
      'attention',
      "LongCat's shortcut layer is built on MLA: use attention='mla' or layer_layout='standard'",
    )
    bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
    self._validate_layer_types(need)
    need(
      self.attention == 'gqa' or not (self.attention_sinks or any(self.layer_windows())),
      'attention',
      'attention sinks and sliding windows are GQA parts',
    )
    if self.index_n_heads:
      self._validate_indexer(need)
    need(not bad, 'mlp_only_layers', f'{bad} are not layers 0..{self.num_layers - 1}')
    need(
      'moe' in self.layer_kinds(),
      'first_k_dense_replace',
      'every layer is dense (first_k_dense_replace, mlp_only_layers, decoder_sparse_step): '
      'an MoE model needs at least one MoE layer',
    )
    e, g = self.n_routed_experts, self.n_group
    need(e % g == 0, 'n_group', f'{e} routed experts do not split into {g} groups')
    need(
      g == 1 or e // g >= 2 or self.router_group_score == 'max',
      'n_group',
      "group scores sum each group's best two: >= 2 experts",
    )
    need(self.topk_group <= g, 'topk_group', f'{self.topk_group} exceeds n_group={g}')
    need(
      g == 1 or not self.zero_expert_num,
      'n_group',
      'group-limited routing covers routed experts only: zero_expert_num must be 0',
    )
    need(
      g == 1 or self.topk_group * (e // g) >= self.moe_topk,
      'topk_group',
      f'the {self.topk_group} best groups hold fewer than moe_topk={self.moe_topk} experts',
    )

  def _validate_indexer(self, need) -> None:
    need(
      self.attention == 'mla' and self.layer_layout == 'standard',
      'index_n_heads',
      'the sparse attention indexer is built on MLA in standard layers',
    )
    need(self.q_lora_rank > 0, 'q_lora_rank', 'the indexer reads the q low-rank latent: > 0')
    need(
      self.qk_rope_head_dim <= self.index_head_dim,
      'index_head_dim',
      f'must hold the qk_rope_head_dim={self.qk_rope_head_dim} rotated features',
    )

  def _validate_moe(self, need) -> None:
    need(
      self.moe_topk <= self.num_experts_total,
      'moe_topk',
      f'top-k {self.moe_topk} exceeds the {self.num_experts_total} experts '
      f'(n_routed_experts + zero_expert_num); lower it or add experts',
    )
    need(
      self.n_routed_experts % max(self.engine.moe_balance_groups, 1) == 0,
      'engine.moe_balance_groups',
      f'{self.n_routed_experts} routed experts do not split into '
      f'{self.engine.moe_balance_groups} groups',
    )
    need(
      self.expected_ffn_experts <= self.n_routed_experts,
      'engine.moe_expected_ffn_experts',
      f'{self.expected_ffn_experts} is more FFN experts per token than the '
      f'{self.n_routed_experts} routed experts: the bias controller would chase it forever',
    )
    if self.zero_expert_num:
      need(
        self.expected_ffn_experts < self.moe_topk,
        'engine.moe_expected_ffn_experts',
        'must be below moe_topk when zero experts exist',
      )
    else:  # every selection is an FFN expert
      need(
        self.engine.moe_expected_ffn_experts in (0, self.moe_topk),
        'engine.moe_expected_ffn_experts',
        f'without zero experts every token uses moe_topk={self.moe_topk} FFN experts: use 0',
      )


LONGCAT_PRESETS = {
  # LongCat-shaped and small enough for a 2-core CPU.
  'tiny': ModelConfig(),
  # The shapes of the MoE benchmark (issue: hidden 512, 4 layers, 16 + 8 experts, top-4).
  'medium': ModelConfig(
    vocab_size=32768,
    hidden_size=512,
    num_layers=4,
    num_heads=8,
    q_lora_rank=256,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    ffn_hidden_size=1024,
    expert_ffn_hidden_size=256,
    n_routed_experts=16,
    zero_expert_num=8,
    moe_topk=4,
  ),
  # The released LongCat-Flash (config.json of meituan-longcat/LongCat-Flash-Chat).
  'flash': ModelConfig(
    vocab_size=131072,
    hidden_size=6144,
    num_layers=28,
    num_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    ffn_hidden_size=12288,
    expert_ffn_hidden_size=2048,
    n_routed_experts=512,
    zero_expert_num=256,
    moe_topk=12,
    routed_scaling_factor=6.0,
    rope_theta=1e7,
  ),
}
