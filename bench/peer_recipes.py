"""MaxText's published MoE training runs (AI-Hypercomputer/tpu-recipes, their configs in MaxText's
benchmarks/maxtext_trillium_model_configs.py), each with moetrain's config of the same work, and
the arithmetic that turns one estimator's step times into calibrated predictions.

bench/peer_plans.py --calibrate compiles both sides of each recipe for its slice on this host;
this module holds what is published and the arithmetic, so that it can be checked on recorded
figures without a compile.

The estimate (moetrain.planner.tpu_plan.estimate) is a roofline: compute, HBM and ICI at the
chip's peak rates, overlapping perfectly. A measured step is slower. The calibration assumes the
same factor holds for moetrain's step of the same work on the same slice: measured / estimated
for MaxText's compiled recipe, times moetrain's estimate. The published runs used 2024-2025
libtpu builds; the compiles here use today's, so the factor also absorbs what changed between.
"""

import dataclasses

# XLA options the recipes set (MaxText's benchmarks/xla_flags_library.py), passed to libtpu.
MOE_VMEM_KIB = 81920
_MOE_VMEM = f'--xla_tpu_scoped_vmem_limit_kib={MOE_VMEM_KIB}'
_CF_FOR_ALL_GATHER = (
  '--xla_tpu_enable_async_collective_fusion=true',
  '--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true',
  '--xla_tpu_enable_async_collective_fusion_multiple_steps=true',
  '--xla_tpu_overlap_compute_collective_tc=true',
  '--xla_enable_async_all_gather=true',
)
_DATA_PARALLEL_OVERLAP = (
  '--xla_tpu_enable_data_parallel_all_reduce_opt=true',
  '--xla_tpu_data_parallel_opt_different_sized_ops=true',
)
# The recipes' continuation fusion for all-gathers (_CF_FOR_ALL_GATHER) is refused by libtpu
# 0.0.52 on a v6e ("not supported/recommended on platforms other than TPU v5e"); it schedules,
# and the estimator assumes perfect overlap anyway, so the compiles leave it out.
MOE_FLAGS = ' '.join((_MOE_VMEM, *_DATA_PARALLEL_OVERLAP))

_MAXTEXT_RUN = (
  'compile_topology_num_slices=1',
  'dataset_type=synthetic',
  'enable_checkpointing=false',
  'base_output_directory=/tmp/maxtext_peer',
  'run_name=peer',
  'attention=flash',
  'use_iota_embed=true',
  'sa_block_q=2048',
  'sa_block_q_dkv=2048',
  'sa_block_q_dq=2048',
)
_MOETRAIN_FULL = {
  'lora.rank': 0,
  'engine.remat': 'full',
  'engine.tpu_scoped_vmem_kib': MOE_VMEM_KIB,
}


@dataclasses.dataclass(frozen=True)
class Recipe:
  """One published run and moetrain's plan of the same work."""

  topology: str
  maxtext: tuple  # MaxText key=value overrides of its base.yml
  libtpu_args: str  # the recipe's XLA options
  measured_s: float  # the published step time
  published: str  # what was measured, where, with which build
  config: str  # moetrain's config file and variant
  overrides: dict  # moetrain: the same model, slice, tokens per step, dispatch and remat
  # Settings on top of `overrides` compiled in search of moetrain's best step for the work
  # (dropless allowed, any remat and mesh that fits): {label: overrides}.
  candidates: dict = dataclasses.field(default_factory=dict)

  @property
  def chip(self):
    """The slice's chip (moetrain.planner.topology.CHIPS): its HBM and peak rates."""
    from moetrain.planner import topology

    return topology.parse(self.topology).chip

  @property
  def chips(self) -> int:
    from moetrain.planner import topology

    return topology.parse(self.topology).chips


_DROPLESS = {'engine.moe_dispatch': 'dropless'}
RECIPES = {
  'mixtral_8x7b_dropped': Recipe(
    'v6e-256',
    (
      'compile_topology=v6e-256',
      'model_name=mixtral-8x7b',
      'per_device_batch_size=8',
      'max_target_length=4096',
      'remat_policy=full',
      'ici_fsdp_parallelism=-1',
      'megablox=false',
      'sparse_matmul=false',
      'capacity_factor=1.25',
      *_MAXTEXT_RUN,
    ),
    MOE_FLAGS,
    8.409,
    'tpu-recipes training/trillium/Mixtral-8x7B-MaxText: 8.409 s/step, 3,897 tokens/s/chip '
    '(v6e-256, float32 weights, libtpu of 2024-10)',
    'configs/mixtral_lora.py:variant=mixtral_8x7b',
    _MOETRAIN_FULL
    | {
      'engine.param_dtype': 'float32',
      'engine.moe_dispatch': 'capacity',
      'engine.moe_capacity_factor': 1.25,
      'mesh.shape': (1, -1, 1, 1),
      'data.global_batch_size': 2048,
      'data.eval_batch_size': 256,
      'data.seq_len': 4096,
    },
    # Dropless: the same routing without the 25% of padded expert rows. (save_moe would keep
    # each layer's expert rows, ~4.8 GB per layer at 32,768 tokens per chip: 32 layers are far
    # over a v6e's 31.25 GiB; 'offload' moves them to the host, whose transfers the estimator
    # does not price.)
    {'dropless': _DROPLESS},
  ),
  'mixtral_8x22b_dropped': Recipe(
    'v6e-256',
    (
      'compile_topology=v6e-256',
      'model_name=mixtral-8x22b',
      'per_device_batch_size=8',
      'max_target_length=4096',
      'ici_fsdp_parallelism=64',
      'ici_expert_parallelism=4',
      'remat_policy=custom',
      'decoder_layer_input=offload',
      'out_proj=offload',
      'query_proj=offload',
      'key_proj=offload',
      'value_proj=offload',
      'megablox=false',
      'sparse_matmul=false',
      'capacity_factor=1.25',
      'dtype=bfloat16',
      'weight_dtype=bfloat16',
      'allow_split_physical_axes=true',
      'custom_mesh=hybrid_ring_64x4',
      *_MAXTEXT_RUN,
    ),
    MOE_FLAGS,
    24.706,
    'tpu-recipes training/trillium/Mixtral-8x22B-MaxText: 24.706 s/step, 1,326 tokens/s/chip '
    '(v6e-256, bfloat16 weights, libtpu of 2024-2025)',
    'configs/mixtral_lora.py:variant=mixtral_8x22b',
    _MOETRAIN_FULL
    | {
      'engine.param_dtype': 'bfloat16',
      'engine.moe_dispatch': 'capacity',
      'engine.moe_capacity_factor': 1.25,
      'engine.remat': 'offload',
      'mesh.shape': (1, 64, 4, 1),
      'data.global_batch_size': 2048,
      'data.eval_batch_size': 256,
      'data.seq_len': 4096,
    },
    # At 32,768 tokens per chip the layer inputs alone (56 x 32,768 x 6,144 in bfloat16) are
    # 22.5 GB of a v6e's 31.25 GiB: MaxText offloads them to the host; moetrain splits the rows
    # into micro-batches (the same tokens per step).
    {
      'full remat, 2 micro-batches': {'engine.remat': 'full', 'optim.grad_accum_steps': 2},
      'full remat, 4 micro-batches': {'engine.remat': 'full', 'optim.grad_accum_steps': 4},
      'dropless, full remat, 4 micro-batches': _DROPLESS
      | {'engine.moe_ep_recv_factor': 2.0, 'engine.remat': 'full', 'optim.grad_accum_steps': 4},
    },
  ),
}


def calibrate(measured_s: float, maxtext_est_s: float, moetrain_est_s: float | None,
              best_est_s: float, tokens_per_step: int, chips: int) -> dict:  # fmt: skip
  """The calibrated predictions of one recipe: factor = measured / MaxText's estimate, each
  moetrain estimate times it (None where the same work does not fit), and tokens/s/chip."""
  factor = measured_s / maxtext_est_s
  per_chip = lambda s: None if s is None else tokens_per_step / s / chips  # noqa: E731
  predicted = None if moetrain_est_s is None else moetrain_est_s * factor
  best = best_est_s * factor
  return {
    'factor': factor,
    'moetrain_predicted_s': predicted,
    'moetrain_best_predicted_s': best,
    'maxtext_measured_tokens_per_chip': per_chip(measured_s),
    'moetrain_predicted_tokens_per_chip': per_chip(predicted),
    'moetrain_best_predicted_tokens_per_chip': per_chip(best),
    'best_over_measured': measured_s / best,
  }
