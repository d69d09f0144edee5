"""Frozen model configuration and the named presets (tiny for CPU, medium for benches, flash)."""

import dataclasses
import re

from moetrain.sharding import Rules

REMAT_POLICIES = ('none', 'full', 'save_dots', 'save_moe', 'offload')
MOE_DISPATCH = ('dropless', 'capacity')
MOE_BACKENDS = ('auto', 'ragged_dot', 'megablox', 'grouped', 'blocked', 'gathered', 'dense')
MOE_EP_COMM = ('auto', 'fixed', 'ragged')
QUANT_MODES = ('none', 'int8', 'int4')
# The fields that take one of a fixed set of values.
CHOICES = {
  'remat': REMAT_POLICIES,
  'moe_dispatch': MOE_DISPATCH,
  'moe_ep_comm': MOE_EP_COMM,
  'moe_backend': MOE_BACKENDS,
  'quant': QUANT_MODES,
  'dtype': ('bfloat16', 'float32', 'float16'),
  'param_dtype': ('bfloat16', 'float32'),
}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  rank: int = 0  # 0 disables LoRA (full fine-tuning / pretraining).
  alpha: float = 16.0
  rslora: bool = False  # scale alpha / sqrt(rank) instead of alpha / rank.
  dropout: float = 0.0
  targets: str = ''  # regex over module paths such as 'layers.attn_0.q_a', 'layers.moe.experts.up'.
  train_router: bool = False

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    if not self.enabled:
      return 0.0
    return self.alpha / (self.rank**0.5 if self.rslora else self.rank)

  def matches(self, path: str) -> bool:
    return self.enabled and re.search(self.targets, path) is not None

  def validate(self) -> None:
    if self.rank < 0:
      raise ValueError(f'lora.rank={self.rank}: must be >= 0 (0 = no adapters)')
    if not self.enabled:
      return
    if self.alpha <= 0:
      raise ValueError(f'lora.alpha={self.alpha}: must be > 0 (the adapters scale by it)')
    try:
      re.compile(self.targets)
    except re.error as e:
      raise ValueError(f'lora.targets: invalid regex {self.targets!r}: {e}') from None
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f'lora.dropout={self.dropout}: must be in [0, 1)')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """LongCat-Flash hyper-parameters (HF names where they exist) plus engine settings."""

  vocab_size: int = 1024
  hidden_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  q_lora_rank: int = 64
  kv_lora_rank: int = 32
  qk_nope_head_dim: int = 32
  qk_rope_head_dim: int = 16
  v_head_dim: int = 32
  ffn_hidden_size: int = 256
  expert_ffn_hidden_size: int = 64
  n_routed_experts: int = 8
  zero_expert_num: int = 4
  moe_topk: int = 3
  routed_scaling_factor: float = 6.0
  rms_norm_eps: float = 1e-5
  mla_norm_eps: float = 1e-6
  rope_theta: float = 1e7
  mla_scale_q_lora: bool = True
  mla_scale_kv_lora: bool = True
  max_position_embeddings: int = 131072
  init_std: float = 0.02  # of the normal before truncation at +-2 std (weights: 0.88 init_std)
  # Numerics and memory.
  dtype: str = 'bfloat16'  # compute dtype; router, norms, softmax and loss stay float32.
  param_dtype: str = 'float32'
  remat: str = 'full'
  # Layers as one lax.scan (compile time independent of depth) or unrolled: the scan stacks every
  # layer's saved activations into [L, ...] buffers and slices them back in the backward pass,
  # copies an unrolled stack does not make (~5% of a 4-layer CPU step; bench/RESULTS.md).
  scan_layers: bool = True
  # Query block of causal self-attention: each block of queries scores only the keys up to its
  # last position, skipping the upper triangle block by block; 0 = one block (the full square).
  attention_chunk: int = 128
  # What attention keeps for its backward pass: True = each query's softmax max and sum, the
  # scores recomputed in the backward (flash-attention style: O(T) instead of O(T * S) memory per
  # head; as fast as keeping them on this CPU, bench/RESULTS.md); False = the float32 probabilities.
  attention_recompute: bool = True
  # Sequence positions per block of the training/eval loss: the lm head and its cross entropy run
  # block by block, so only [B, loss_chunk, V] logits exist at a time; 0 = one block.
  loss_chunk: int = 256
  # MoE engine.
  moe_dispatch: str = 'dropless'
  moe_capacity_factor: float = 1.25
  moe_backend: str = 'auto'
  moe_block_size: int = 0  # CPU backends' row tile; 0 = auto (grouped: chosen per batch).
  moe_expert_parallel: bool = True  # shard_map over the 'expert' mesh axis when it is > 1.
  # Token exchange of expert parallelism: 'fixed' all_to_all buffers (any platform), 'ragged'
  # ragged_all_to_all straight into expert-sorted receive buffers (GPU/TPU; emulated on CPU),
  # 'auto' = ragged where the platform has it.
  moe_ep_comm: str = 'auto'
  # Receive buffer of the ragged exchange (dropless) in local assignments; 0 = ep times them, the
  # worst case, so nothing can drop. A smaller buffer bounds memory at large ep and drops (and
  # reports) what overflows it.
  moe_ep_recv_factor: float = 0.0
  moe_expected_ffn_experts: float = 0.0  # K_e of the balancing targets; 0 = uniform top_k*E/(E+Z).
  # FFN-expert groups D of the device-level balance loss; 0 = the expert-parallel shards (the
  # 'expert' mesh axis when model.moe_expert_parallel, else 1).
  moe_balance_groups: int = 0
  # Fine-tuning.
  lora: LoraConfig = LoraConfig()
  quant: str = 'none'  # storage of frozen base weights (QLoRA).
  quant_group_size: int = 64
  # Logical-axis rules for activation constraints (set by train.py from the mesh config).
  rules: Rules = Rules()
  # The platform the MoE engine is chosen for ('cpu', 'gpu', 'tpu'): set by train.build from the
  # compile target (the planner compiles for a TPU on any host); '' = the backend this runs on.
  platform: str = ''

  @property
  def target_platform(self) -> str:
    if self.platform:
      return self.platform
    import jax

    return jax.default_backend()

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def num_experts_total(self) -> int:
    return self.n_routed_experts + self.zero_expert_num

  @property
  def expected_ffn_experts(self) -> float:
    if self.moe_expected_ffn_experts > 0:
      return self.moe_expected_ffn_experts
    return self.moe_topk * self.n_routed_experts / self.num_experts_total

  def validate(self, prefix: str = 'model') -> None:
    def need(ok, field, msg):
      if not ok:
        raise ValueError(f'{prefix}.{field}: {msg}')

    for f in POSITIVE_FIELDS:
      need(getattr(self, f) > 0, f, f'must be positive, got {getattr(self, f)}')
    for f, zero in NON_NEGATIVE_FIELDS.items():
      need(getattr(self, f) >= 0, f, f'must be >= 0{zero}, got {getattr(self, f)}')
    for field, choices in CHOICES.items():
      value = getattr(self, field)
      need(value in choices, field, f'{value!r} unknown; use one of {choices}')
    need(
      self.qk_rope_head_dim % 2 == 0,
      'qk_rope_head_dim',
      f'must be a positive even number (interleaved RoPE pairs), got {self.qk_rope_head_dim}',
    )
    self._validate_moe(need)
    need(
      self.quant != 'int4' or (self.quant_group_size > 0 and self.quant_group_size % 2 == 0),
      'quant_group_size',
      f'must be a positive even number for int4, got {self.quant_group_size}',
    )
    if self.quant == 'int4':  # codes pack in pairs along each kernel's first input dimension
      packed = ('hidden_size', 'q_lora_rank', 'kv_lora_rank', 'num_heads')
      for field in (*packed, 'ffn_hidden_size', 'expert_ffn_hidden_size'):
        need(
          getattr(self, field) % 2 == 0,
          field,
          f'{getattr(self, field)} is odd: int4 packs two codes along it; use model.quant=int8',
        )
    need(
      self.quant == 'none' or self.lora.enabled,
      'quant',
      'quantised base weights are frozen: set lora.rank > 0 (QLoRA) or quant="none"',
    )
    self.lora.validate()

  def _validate_moe(self, need) -> None:
    need(
      self.moe_topk <= self.num_experts_total,
      'moe_topk',
      f'top-k {self.moe_topk} exceeds the {self.num_experts_total} experts '
      f'(n_routed_experts + zero_expert_num); lower it or add experts',
    )
    need(
      self.n_routed_experts % max(self.moe_balance_groups, 1) == 0,
      'moe_balance_groups',
      f'{self.n_routed_experts} routed experts do not split into {self.moe_balance_groups} groups',
    )
    need(
      self.expected_ffn_experts <= self.n_routed_experts,
      'moe_expected_ffn_experts',
      f'{self.expected_ffn_experts} is more FFN experts per token than the '
      f'{self.n_routed_experts} routed experts: the bias controller would chase it forever',
    )
    if self.zero_expert_num:
      need(
        self.expected_ffn_experts < self.moe_topk,
        'moe_expected_ffn_experts',
        'must be below moe_topk when zero experts exist',
      )
    else:  # every selection is an FFN expert
      need(
        self.moe_expected_ffn_experts in (0, self.moe_topk),
        'moe_expected_ffn_experts',
        f'without zero experts every token uses moe_topk={self.moe_topk} FFN experts: use 0',
      )


# Sizes and constants that must be > 0.
POSITIVE_FIELDS = (
  'vocab_size',
  'hidden_size',
  'num_layers',
  'num_heads',
  'q_lora_rank',
  'kv_lora_rank',
  'qk_nope_head_dim',
  'qk_rope_head_dim',
  'v_head_dim',
  'ffn_hidden_size',
  'expert_ffn_hidden_size',
  'n_routed_experts',
  'moe_topk',
  'routed_scaling_factor',
  'rms_norm_eps',
  'mla_norm_eps',
  'rope_theta',
  'init_std',
  'moe_capacity_factor',
)
# Fields that must be >= 0, with what 0 means.
NON_NEGATIVE_FIELDS = {
  'zero_expert_num': '',
  'moe_balance_groups': ' (0 = one group)',
  'moe_expected_ffn_experts': ' (0 = uniform routing)',
  'moe_block_size': ' (0 = chosen per batch)',
  'attention_chunk': ' (0 = no chunking)',
  'loss_chunk': ' (0 = no chunking)',
  'moe_ep_recv_factor': ' (0 = worst case)',
}


PRESETS = {
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
