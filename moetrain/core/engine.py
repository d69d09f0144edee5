"""How a model runs: the `config.engine` section (compute and storage dtypes, remat, the MoE
engine and its exchange, kernels, layouts) and the `config.lora` section. A checkpoint fixes the
network's shape (moetrain/model/config.py ModelConfig, the `model` section); these may change
between runs of the same checkpoint. Kernels take an EngineConfig and plain arguments."""

import dataclasses
import re

from moetrain.core.fields import check, field, keys
from moetrain.core.sharding import MESH_AXES, Rules, full_shape

REMAT_POLICIES = ('none', 'full', 'save_dots', 'save_moe', 'offload')
MOE_DISPATCH = ('dropless', 'capacity')
MOE_BACKENDS = (
  'auto',
  'ragged_dot',
  'megablox',
  'tokamax',
  'grouped',
  'blocked',
  'gathered',
  'dense',
)
MOE_EP_COMM = ('auto', 'fixed', 'ragged')
TOKAMAX_IMPLEMENTATIONS = ('auto', 'mosaic', 'triton', 'xla')
QUANT_MODES = ('none', 'int8', 'int4')
# LoRA's default targets: every attention projection (MLA or GQA), dense MLP, shared and routed
# expert, and the output head.
LORA_TARGETS = (
  r'attn(_\d)?\.(q|k|v|o|q_a|q_b|kv_a|kv_b|in_qkvz|in_qkv|in_z|out)$'
  r'|(mlp(_\d)?|shared)\.(gate|up|down)$'
  r'|experts\.(gate|up|down)$|lm_head$'
)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """The `config.lora` section. rank 0 = full fine-tuning / pretraining."""

  rank: int = field(0, check='non_negative', zero='0 = no adapters')  # adapter rank R
  alpha: float = 16.0  # scale = alpha / rank (or alpha / sqrt(rank) with rslora)
  rslora: bool = False  # rank-stabilised scaling
  dropout: float = 0.0  # dropout on the adapter input
  # Regex over module paths: 'layers.attn_0.q_a', 'layers.mlp_1.up', 'layers.moe.experts.down',
  # 'lm_head'.
  targets: str = LORA_TARGETS
  train_router: bool = False  # also train the router classifier
  # Storage of the adapters (and so of their optimizer moments), whatever the frozen base's
  # (engine.param_dtype, engine.quant): bfloat16 adapters and Adam moments lose small updates.
  param_dtype: str = field('float32', choices=('bfloat16', 'float32'))

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
    check(self, 'lora')
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
class EngineConfig:
  """The `config.engine` section: how the model computes and is stored, and (derived, set by
  start-up) the sharding rules, the platform and the mesh it is compiled for."""

  # Std of the normal of random init before truncation at +-2 std (weights: 0.88 init_std).
  init_std: float = field(0.02, check='positive')
  # Compute dtype (router, norms, softmax and loss stay float32): bfloat16, float32, or float16
  # (older GPUs) with a dynamic loss scale, logged as loss_scale.
  dtype: str = field('bfloat16', choices=('bfloat16', 'float32', 'float16'))
  param_dtype: str = field('float32', choices=('bfloat16', 'float32'))  # storage of parameters
  remat: str = field('full', choices=REMAT_POLICIES)  # what the backward pass recomputes
  # Layers as one lax.scan (compile time independent of depth) or unrolled: the scan stacks every
  # layer's saved activations into [L, ...] buffers and slices them back in the backward pass,
  # copies an unrolled stack does not make (~5% of a 4-layer CPU step; bench/RESULTS.md).
  scan_layers: bool = field(True)
  # Pipeline parallelism over mesh.shape's 'stage' axis (docs/pipeline.md): micro-batches per
  # batch flowing through the stages (a multiple of the stage count; 1 = none).
  pipeline_microbatches: int = field(1, check='positive')
  # Runs of layers per stage: > 1 is the circular schedule, each stage holding non-adjacent runs
  # and every micro-batch passing the stages this many times (a smaller bubble).
  pipeline_repeats: int = field(1, check='positive')
  # Query block of causal self-attention: each block of queries scores only the keys up to its
  # last position, skipping the upper triangle block by block; 0 = one block (the full square).
  attention_chunk: int = field(128, check='non_negative', zero='0 = no chunking')
  # Causal self-attention's kernel: 'splash' = JAX's fused Pallas TPU kernel (segment ids, GQA,
  # MLA widths, sliding windows, sinks; the scores never reach HBM), 'xla' = the chunked XLA path below (any platform;
  # decoding always uses it), 'auto' = splash when compiling for TPU and the sequence is a
  # multiple of 128, else xla. Off TPU, 'splash' runs in Pallas' interpreter (slow; for tests).
  attention_kernel: str = field('auto', choices=('auto', 'splash', 'xla'))
  # Gated DeltaNet's delta rule in training: 'tokamax' = tokamax's Pallas TPU kernel (Kimi Delta
  # Attention's, forward and backward; kernels/delta_rule_tokamax.py), 'xla' = the chunked XLA
  # form (any platform; decoding always uses it), 'auto' = tokamax when compiling for a TPU it
  # declares (v6e and later; it compiles for v5p too) with key heads up to 256 wide and tokamax
  # installed, else xla. Off TPU, 'tokamax' runs in Pallas' interpreter (slow; for tests).
  delta_rule_kernel: str = field('auto', choices=('auto', 'tokamax', 'xla'))
  # The segments a packed row may hold on the tokamax delta rule (each padded to the kernel's
  # 64-token chunks: up to 63 positions more per segment). A device's rows with more, or with a
  # log decay below -5 (past the kernel's float32 range), run the XLA form instead, exactly.
  delta_rule_segments: int = field(8, check='positive')
  # Projections (attention, dense MLP) take their FSDP-sharded weights gathered whole: one
  # all-gather, then one matmul. Left to XLA:TPU, it loops over the weight's shards (a windowed
  # einsum) and reads and writes the activations once per trip: Qwen3-30B-A3B full training on
  # a v5p-32 counted 2.94e12 HBM bytes per chip and step that way, 2.33e12 gathered
  # (bench/RESULTS.md, "Peer comparison"). The lm head is not gathered.
  gather_weights: bool = field(True)
  # Full training: each run of layers takes its matmul weights (projection kernels, the routed
  # experts' matrices) cast to engine.dtype once, before its layer loop, not layer by layer
  # inside it. The backward loop then stacks their gradients in engine.dtype and casts them to
  # param_dtype once after it: half of float32's bytes for the largest buffers alive at the
  # step's peak. Each layer's weight gradient is then rounded to engine.dtype, as mixed-precision
  # autocast gives it (TPU's grouped-matmul kernels return the experts' so anyway); per-layer
  # casts let XLA keep some in float32. The loss is the same. Mixtral-8x7B full training on a
  # v5p-32: 56.24 -> 50.84 GiB per chip (bench/RESULTS.md, "Peer comparison"). No effect under
  # LoRA (the base takes no gradient) or when param_dtype is engine.dtype; a distillation
  # teacher (forward only) keeps the per-layer casts.
  cast_weights_once: bool = field(True)
  # What attention keeps for its backward pass: True = each query's softmax max and sum, the
  # scores recomputed in the backward (flash-attention style: O(T) instead of O(T * S) memory per
  # head; as fast as keeping them on this CPU, bench/RESULTS.md); False = the float32 probabilities.
  attention_recompute: bool = field(True)
  # With a 'context' mesh axis: reorder each row's tokens once at the step's input (dual
  # chunks: shard i holds chunks i and 2C - 1 - i of 2C), so every shard has equal causal
  # attention work; the loss's targets and mask move to that order, the hidden states never
  # move back (docs/context.md). The loss and metrics are unchanged by it.
  context_reorder: bool = field(True)
  # With a 'context' mesh axis, how each shard's queries reach the row's keys and values
  # (docs/context.md): 'all_gather' = every shard's at once (MLA: the latent), 'ring' = one
  # shard's block at a time, passed around the axis (O(T / C) keys and values a shard, not O(T)).
  context_attention: str = field('all_gather', choices=('all_gather', 'ring'))
  # Sequence positions per block of the training/eval loss: the lm head and its cross entropy run
  # block by block, so only [B, loss_chunk, V] logits exist at a time; 0 = one block.
  loss_chunk: int = field(256, check='non_negative', zero='0 = no chunking')
  moe_dispatch: str = field('dropless', choices=MOE_DISPATCH)  # or per-expert buffers
  # Capacity dispatch: each expert's buffer holds factor * K_e / E of the tokens, those of each
  # batch shard (GShard's groups; on one device, the whole batch).
  moe_capacity_factor: float = field(1.25, check='positive')
  # The experts' grouped matmul; 'auto' picks per platform (model/dispatch.py resolve_backend).
  moe_backend: str = field('auto', choices=MOE_BACKENDS)
  # tokamax's kernel for moe_backend='tokamax': 'auto' = Mosaic GPU where the device has it
  # (sm90/sm100), else Triton (sm80+), else its XLA form with a warning; a name = that one only.
  tokamax_implementation: str = field('auto', choices=TOKAMAX_IMPLEMENTATIONS)
  # CPU backends' row tile; 0 = auto (grouped: chosen per batch).
  moe_block_size: int = field(0, check='non_negative', zero='0 = chosen per batch')
  moe_expert_parallel: bool = field(True)  # shard_map over the 'expert' mesh axis when it is > 1
  # Token exchange of expert parallelism: 'fixed' all_to_all buffers (any platform), 'ragged'
  # ragged_all_to_all straight into expert-sorted receive buffers (GPU/TPU; emulated on CPU),
  # 'auto' = ragged where the platform has it.
  moe_ep_comm: str = field('auto', choices=MOE_EP_COMM)
  # Receive buffer of the ragged exchange (dropless) in local assignments; 0 = ep times them, the
  # worst case, one exchange. A smaller buffer bounds memory at large ep; what overflows it is
  # handled by engine.moe_ep_overflow.
  moe_ep_recv_factor: float = field(0.0, check='non_negative', zero='0 = worst case')
  # Rows that overflow a bounded receive buffer: 'rounds' exchanges them in further rounds of
  # the same buffer, run only when some shard's rows overflow (dropless stays dropless: each
  # extra round recomputes its forward in the backward); 'drop' drops and reports them
  # (moe/dropped_frac).
  moe_ep_overflow: str = field('rounds', choices=('rounds', 'drop'))
  # K_e, the FFN experts per token that balancing aims at; 0 = uniform, top_k * E / (E + Z).
  moe_expected_ffn_experts: float = field(0.0, check='non_negative', zero='0 = uniform routing')
  # FFN-expert groups of the device-level balance loss; 0 = the expert-parallel shards (the
  # 'expert' mesh axis when engine.moe_expert_parallel, else 1).
  moe_balance_groups: int = field(0, check='non_negative', zero='0 = one group per shard')
  # Balancing, by the family when 'auto': the balance loss (coefficient loss.balance_loss) is
  # 'device' (LongCat's device-level loss), 'switch' (Switch/Mixtral/Qwen3-MoE: E * sum_e f_e
  # P_e over the batch, as transformers' load_balancing_loss_func) or 'sequence' (DeepSeek-V3's
  # sequence-wise loss, per row); the bias controller (loss.bias_update_rate) moves each bias in
  # proportion to its expert's load error ('proportional', LongCat) or by its sign ('sign',
  # DeepSeek-V3's gamma rule).
  moe_balance_loss: str = field('auto', choices=('auto', 'device', 'switch', 'sequence'))
  moe_bias_rule: str = field('auto', choices=('auto', 'proportional', 'sign'))
  # 'reference' runs every kernel (hand-written backward passes, CPU loops, the ragged exchange;
  # moetrain/kernels) as plain autodiff code of the same function: slower, for checking numerics.
  kernels: str = field('fast', choices=('fast', 'reference'))
  quant: str = field('none', choices=QUANT_MODES)  # storage of the frozen base (QLoRA)
  # int4 group along the input dim (one group where it does not divide).
  quant_group_size: int = field(64)
  # Device layouts of the frozen base (LoRA/QLoRA) in the train step: 'compiler' lets XLA choose
  # them (the run moves the base into the compiled step's choice once, at its start), 'default'
  # keeps the standard ones, 'auto' = compiler on TPU with micro-batches (optim.grad_accum_steps
  # > 1), default otherwise. With the defaults XLA:TPU copies the base into its micro-batch
  # loop's layout inside every step (flash QLoRA int4: 82.0 -> 63.2 GiB per chip with compiler
  # layouts); without micro-batches they cost as much or more (bench/RESULTS.md, "The frozen base in layouts the compiler chooses").
  frozen_layout: str = field('auto', choices=('auto', 'compiler', 'default'))
  # XLA:TPU's scoped VMEM limit (a fusion's scratch) for the train and eval steps, in KiB (0: the
  # compiler's own, 16 MiB on a v5e). A fusion that asks more stops the compile with
  # CompileTimeScopedVmemOom, which names this key. It does not help where the compiler sizes a
  # fusion past any limit: XLA's ragged_dot over gpt-oss-20b's 2880-wide int4 experts on a v5e
  # asked 16.94 of 16 MiB, then 32.46 of 32 (engine.moe_backend='megablox' compiles there).
  tpu_scoped_vmem_kib: int = field(0)
  # Derived: set from the `mesh` section and the compile target.
  rules: Rules = field(Rules(), role='derived')  # logical-axis rules (mesh.rules)
  # The MoE engine is chosen once, from these two, by startup.build: the platform the step is
  # compiled for ('cpu', 'gpu', 'tpu'; the planner compiles for a TPU on any host) and the
  # sizes of the mesh axes (MESH_AXES, full_shape) it runs on; () = one device.
  platform: str = field('cpu', role='derived')
  mesh_shape: tuple = field((), role='derived')

  @property
  def reference_kernels(self) -> bool:
    """engine.kernels='reference': every kernel runs its plain-autodiff twin."""
    return self.kernels == 'reference'

  @property
  def expert_shards(self) -> int:
    """How many shards the routed experts are split over: the 'expert' mesh axis when
    engine.moe_expert_parallel is set, else 1."""
    if not self.moe_expert_parallel or not self.mesh_shape:
      return 1
    return dict(zip(MESH_AXES, self.mesh_shape))['expert']

  def axis_size(self, axis) -> int:
    """The devices along mesh axis `axis` of the laid-out mesh (1: no mesh, or axis None)."""
    return dict(zip(MESH_AXES, self.mesh_shape)).get(axis, 1) if self.mesh_shape else 1

  @property
  def context_shards(self) -> int:
    """The 'context' mesh axis each row's tokens are split over (1: whole rows on a device)."""
    return self.axis_size('context')

  @property
  def pipeline_stages(self) -> int:
    """The 'stage' mesh axis the layers are split over (1: no pipeline)."""
    return self.axis_size('stage')

  def laid_out(self, platform: str, mesh_shape) -> 'EngineConfig':
    """This engine on `platform` and a mesh (mesh_shape: sizes, or a Mesh)."""
    if hasattr(mesh_shape, 'axis_sizes'):
      mesh_shape = mesh_shape.axis_sizes
    shape = full_shape(mesh_shape) if mesh_shape else ()
    return dataclasses.replace(self, platform=platform, mesh_shape=shape)

  def validate(self, prefix: str = 'engine') -> None:
    check(self, prefix)
    if self.quant == 'int4' and not (self.quant_group_size > 0 and self.quant_group_size % 2 == 0):
      raise ValueError(
        f'{prefix}.quant_group_size: must be a positive even number for int4, '
        f'got {self.quant_group_size}'
      )


# The engine's keys, which older configs held in the `model` section.
ENGINE_FIELDS = keys(EngineConfig)
# ...and with the derived ones, every field of an EngineConfig.
ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineConfig))


def split_engine_keys(kw: dict) -> tuple[dict, dict]:
  """kw's keys apart: (the others, those of an EngineConfig). Configs written before the engine
  section held its keys in `model`; config.json readers and builders take both kinds at once."""
  engine = {k: v for k, v in kw.items() if k in ENGINE_KEYS}
  return {k: v for k, v in kw.items() if k not in engine}, engine
