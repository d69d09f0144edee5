"""The base config (every key at its default) and the helpers experiment files build on."""

import dataclasses
from typing import NamedTuple

from ml_collections import config_dict

from moetrain.model.families import MODEL_PRESETS
from moetrain.run import sections


def parse_arg(arg: str | None) -> dict:
  """big_vision-style 'variant=flash,foo=bar' -> dict."""
  return dict(kv.split('=', 1) for kv in (arg or '').split(',') if kv)


def start_of(arg: str | None, path: str) -> str:
  """The checkpoint a post-training file starts from: its 'start=DIR' argument, or the LoRA
  demo's result shipped in moetrain/data/demo/sft."""
  from moetrain.data import demo_sft

  args = parse_arg(arg)
  if set(args) - {'start'}:
    raise ValueError(f'{path}: unknown argument(s) {sorted(set(args) - {"start"})}; use start=')
  return args.get('start') or str(demo_sft.DIR)


def variant_of(arg: str | None, path: str, default: str = 'tiny', choices=None) -> str:
  """The model variant an experiment file's argument names (`default` when it names none), one
  of `choices` (default: the presets of the default's family)."""
  args = parse_arg(arg)
  unknown = set(args) - {'variant'}
  if unknown:
    raise ValueError(f'{path}: unknown argument(s) {sorted(unknown)}; use variant=')
  variant = args.get('variant', default)
  choices = choices or family_variants(default)
  if variant not in choices:
    raise ValueError(f'{path}: variant={variant!r} is unknown; choose one of {", ".join(choices)}')
  return variant


def family_variants(preset: str) -> tuple[str, ...]:
  """The presets of `preset`'s family ('tiny' -> tiny, medium, flash)."""
  family = MODEL_PRESETS[preset].model_type
  return tuple(name for name, m in MODEL_PRESETS.items() if m.model_type == family)


def set_model(config, variant: str) -> None:
  """config.model's fields from the preset `variant` (moetrain/model/families.py MODEL_PRESETS:
  'tiny', 'medium', 'flash', 'qwen3_30b_a3b', ...)."""
  if variant not in MODEL_PRESETS:
    raise ValueError(f'variant={variant!r} is unknown; choose one of {sorted(MODEL_PRESETS)}')
  for k, v in dataclasses.asdict(MODEL_PRESETS[variant]).items():
    if k in config.model:
      config.model[k] = v


def set_pod(config, expert: int, seq_len: int, global_batch_size: int, eval_batch_size: int):
  """A real model on a TPU slice: experts over `expert` devices, FSDP over the rest; bf16
  weights; the tokenizer from the checkpoint (or set data.tokenizer). Batch sizes must be
  multiples of the batch shards (data * fsdp * expert)."""
  config.engine.param_dtype = 'bfloat16'
  config.mesh.shape = (1, -1, expert, 1)
  config.data.seq_len = seq_len
  config.data.global_batch_size = global_batch_size
  config.data.eval_batch_size = eval_batch_size
  config.data.tokenizer = ''


class Pod(NamedTuple):
  """A real model's settings on the TPU slice it is planned for (bench/tpu_plans.py)."""

  slice: str  # the slice it was planned on (documentation: the mesh takes its devices)
  expert: int  # expert axis; FSDP over the rest
  seq_len: int
  rows: int  # rows per step (and per eval batch)
  recv_factor: float = 0.0  # engine.moe_ep_recv_factor (0: dropless's worst case)
  micro_batches: int = 1  # optim.grad_accum_steps


def family_lora(arg, path: str, default: str, pods: dict, choices=None):
  """A family's LoRA config: the `variant` preset (default `default`), LoRA rank 8 (alpha 16)
  on the default targets, and for a variant in `pods` ({variant: Pod}) its TPU slice's mesh,
  batch and exchange; `choices`: the variants allowed (default: the default's family's)."""
  variant = variant_of(arg, path, default=default, choices=choices)
  config = get_config()
  set_model(config, variant)
  config.lora.rank = 8
  config.lora.alpha = 16.0
  if variant in pods:
    pod = pods[variant]
    set_pod(config, pod.expert, pod.seq_len, pod.rows, pod.rows)
    config.engine.moe_ep_recv_factor = float(pod.recv_factor)
    config.optim.grad_accum_steps = pod.micro_batches
  return config, variant


def set_flash_pod(config, global_batch_size: int, eval_batch_size: int) -> None:
  """The flash variant on a TPU pod: experts over 16 devices, FSDP over the rest; 8192-token
  rows (set_pod)."""
  set_pod(config, 16, 8192, global_batch_size, eval_batch_size)
  # A worst-case (ep x) receive buffer per MoE layer does not fit a chip at this batch; twice the
  # local assignments does (moetrain.tools.plan --topology=v5p-128), and what overflows it goes
  # in further rounds of the exchange (engine.moe_ep_overflow): still dropless.
  config.engine.moe_ep_recv_factor = 2.0


def get_config() -> config_dict.ConfigDict:
  """Every key with its default. Each is declared once, as a field of its section's dataclass
  (moetrain.run.sections.SECTIONS: model -> moetrain/model/config.py ModelConfig, data ->
  moetrain/data/loader.py DataConfig, ...), where a comment says what it does."""
  return sections.default_config()
