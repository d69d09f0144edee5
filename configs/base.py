"""Every config key of moetrain, with its default. Experiment files import this and override."""

import dataclasses

from ml_collections import config_dict

from moetrain.model.config import PRESETS


def parse_arg(arg: str | None) -> dict:
  """big_vision-style 'variant=flash,foo=bar' -> dict."""
  return dict(kv.split('=', 1) for kv in (arg or '').split(',') if kv)


def variant_of(arg: str | None, path: str) -> str:
  """The model variant an experiment file's argument names ('tiny' when it names none)."""
  args = parse_arg(arg)
  unknown = set(args) - {'variant'}
  if unknown:
    raise ValueError(f'{path}: unknown argument(s) {sorted(unknown)}; use variant=')
  return args.get('variant', 'tiny')


def set_model(config, variant: str) -> None:
  """config.model's shape fields from the preset `variant` ('tiny', 'medium' or 'flash')."""
  if variant not in PRESETS:
    raise ValueError(f'variant={variant!r} is unknown; choose one of {sorted(PRESETS)}')
  for k, v in dataclasses.asdict(PRESETS[variant]).items():
    if k in config.model:
      config.model[k] = v


def set_flash_pod(config, global_batch_size: int, eval_batch_size: int) -> None:
  """The flash variant on a TPU pod: experts over 16 devices, FSDP over the rest; bf16 weights;
  8192-token rows; the tokenizer from the checkpoint (or set data.tokenizer). Batch sizes must
  be multiples of the batch shards (data * fsdp * expert)."""
  config.model.param_dtype = 'bfloat16'
  # A worst-case (ep x) receive buffer per MoE layer does not fit a chip at this batch; twice the
  # local assignments does (moetrain.tools.plan --topology=v5p-128), and overflow is reported
  # as dropped_frac.
  config.model.moe_ep_recv_factor = 2.0
  config.mesh.shape = (1, -1, 16, 1)
  config.data.seq_len = 8192
  config.data.global_batch_size = global_batch_size
  config.data.eval_batch_size = eval_batch_size
  config.data.tokenizer = ''


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.seed = 0  # model init and dropout; the data order has its own data.seed

  # Model (moetrain.model.config.ModelConfig). Names follow the HF LongCat-Flash config.
  m = c.model = config_dict.ConfigDict()
  m.vocab_size = 512  # must be >= the tokenizer's vocabulary
  m.hidden_size = 128  # D
  m.num_layers = 2  # LongCat layers (each has 2 attention + 2 dense MLP + 1 MoE)
  m.num_heads = 4  # N
  m.q_lora_rank = 64  # MLA query low-rank width
  m.kv_lora_rank = 32  # MLA compressed kv latent width (what the KV cache stores)
  m.qk_nope_head_dim = 32  # per-head q/k width without RoPE
  m.qk_rope_head_dim = 16  # RoPE part of q, and the one rope key shared by all heads
  m.v_head_dim = 32  # per-head value width
  m.ffn_hidden_size = 256  # dense SwiGLU hidden width
  m.expert_ffn_hidden_size = 64  # routed expert SwiGLU hidden width
  m.n_routed_experts = 8  # E: FFN experts
  m.zero_expert_num = 4  # Z: zero-computation (identity) experts
  m.moe_topk = 3  # experts per token, zero experts included
  m.routed_scaling_factor = 6.0  # gate multiplier (applies to zero experts too)
  m.rms_norm_eps = 1e-5  # layer norms and final norm
  m.mla_norm_eps = 1e-6  # MLA latent norms (HF default, not rms_norm_eps)
  m.rope_theta = 1e7  # interleaved RoPE base
  m.mla_scale_q_lora = True  # multiply q by sqrt(D / q_lora_rank)
  m.mla_scale_kv_lora = True  # multiply the kv latent by sqrt(D / kv_lora_rank)
  m.max_position_embeddings = 131072  # informational (RoPE needs no table)
  m.init_std = 0.02  # truncated-normal std of random init
  # Compute dtype (router, norms, softmax, loss stay float32): bfloat16, float32, or float16
  # (older GPUs) with a dynamic loss scale, logged as loss_scale.
  m.dtype = 'bfloat16'
  m.param_dtype = 'float32'  # storage dtype of parameters
  m.remat = 'full'  # none | full | save_dots | save_moe | offload
  m.scan_layers = True  # lax.scan over layers; False unrolls them (faster when few, slower compile)
  m.attention_chunk = 128  # query block of causal attention (skips keys past it); 0 = off
  m.attention_recompute = True  # backward recomputes scores from softmax stats (O(T) memory)
  m.loss_chunk = 256  # positions per block of the lm head + loss ([B, T, V] never whole); 0 = off
  m.moe_dispatch = 'dropless'  # dropless | capacity
  m.moe_capacity_factor = 1.25  # capacity dispatch: per-expert buffer = factor * K_e/E of tokens
  m.moe_backend = 'auto'  # auto | ragged_dot | megablox | grouped | blocked | gathered | dense
  m.moe_block_size = 0  # CPU backends' row tile; 0 = auto (grouped: per batch)
  m.moe_expert_parallel = True  # shard_map experts over the 'expert' mesh axis when it is > 1
  m.moe_ep_comm = 'auto'  # auto | fixed | ragged: expert-parallel token exchange
  m.moe_ep_recv_factor = 0.0  # ragged receive buffer / local assignments; 0 = ep (never drops)
  m.moe_expected_ffn_experts = 0.0  # K_e target of balancing; 0 = top_k * E / (E + Z)
  m.moe_balance_groups = 0  # FFN-expert groups (D) of the balance loss; 0 = expert-parallel shards
  m.quant = 'none'  # none | int8 | int4: storage of the frozen base (QLoRA)
  m.quant_group_size = 64  # int4 group along the input dim (one group where it does not divide)

  # LoRA (ModelConfig.lora). rank 0 = full fine-tuning / pretraining.
  lo = c.lora = config_dict.ConfigDict()
  lo.rank = 0  # adapter rank R
  lo.alpha = 16.0  # scale = alpha / rank (or alpha / sqrt(rank) with rslora)
  lo.rslora = False  # rank-stabilised scaling
  lo.dropout = 0.0  # dropout on the adapter input
  # Regex over module paths: 'layers.attn_0.q_a', 'layers.mlp_1.up', 'layers.moe.experts.down',
  # 'lm_head'. Default: every MLA projection, dense MLP, routed expert and the output head.
  lo.targets = (
    r'attn_\d\.(q_a|q_b|kv_a|kv_b|o)$|mlp_\d\.(gate|up|down)$|experts\.(gate|up|down)$|lm_head$'
  )
  lo.train_router = False  # also train the router classifier

  # Data (moetrain.data.pipeline.DataConfig).
  d = c.data = config_dict.ConfigDict()
  d.source = 'demo'  # demo | jsonl | text | tfds
  d.path = ''  # jsonl/text file or glob; '{split}' is replaced by the split name
  d.tfds_name = ''  # tfds dataset name (prepared locally; read via tfds.data_source)
  d.tfds_data_dir = ''  # tfds data_dir
  d.train_split = 'train'  # training split
  d.eval_split = 'eval'  # eval split; '' = no eval
  d.text_key = 'text'  # field holding plain text
  d.prompt_key = 'prompt'  # field holding a prompt (loss off unless loss_on_prompt)
  d.completion_key = 'completion'  # field holding the completion
  d.messages_key = 'messages'  # field holding chat messages [{role, content}]
  d.tokenizer = ''  # .model / tokenizer.json / directory; '' = train sentencepiece into workdir
  d.vocab_size = 512  # vocabulary of a sentencepiece model trained on first use
  d.seq_len = 128  # tokens per packed row
  d.global_batch_size = 16  # rows per step over all hosts
  d.eval_batch_size = 16  # rows per eval batch over all hosts
  d.shuffle = True  # shuffle training examples (reshuffled every epoch)
  d.seed = 0  # data order
  d.loss_on_prompt = False  # also train on prompt tokens
  d.split_long_texts = True  # text longer than seq_len + 1 tokens: split into rows (else cut)
  d.num_epochs = config_dict.placeholder(int)  # None = repeat forever
  d.worker_count = 0  # grain worker processes (0 = in-process)
  d.reslice_on_resume = False  # resume on another host count: restart the data in new slices

  # Initial weights.
  c.init = config_dict.ConfigDict()
  c.init.hf_checkpoint = ''  # Hugging Face LongCat-Flash directory: shapes, weights, tokenizer
  c.init.peft_adapter = ''  # PEFT adapter directory (tools.export --adapter_only) to start from

  # Device mesh: axes (data, fsdp, expert, tensor); one entry may be -1.
  c.mesh = config_dict.ConfigDict()
  c.mesh.shape = (1, -1, 1, 1)  # sizes of (data, fsdp, expert, tensor)
  c.mesh.rules = 'fsdp_ep_tp'  # fsdp | fsdp_ep | fsdp_ep_tp: logical-axis rule preset

  # Optimizer (moetrain.optim.OptimConfig): AdamW.
  o = c.optim = config_dict.ConfigDict()
  o.learning_rate = 3e-3  # peak learning rate
  o.warmup_steps = 20  # linear warmup steps
  o.schedule = 'cosine'  # cosine | constant (after warmup)
  o.min_lr_ratio = 0.1  # cosine floor as a fraction of the peak
  o.b1 = 0.9  # Adam beta1
  o.b2 = 0.95  # Adam beta2
  o.eps = 1e-8  # Adam epsilon (LongCat pretraining used 1e-16)
  o.weight_decay = 0.0  # decoupled weight decay on matrices
  # Regex over parameter paths spared from weight decay, e.g. r'embed|router|lora_' (paths look
  # like 'embed.embedding', 'layers.moe.router', 'layers.attn_0.q_a.lora_a'); '' = none.
  o.weight_decay_exclude = ''
  o.grad_clip = 1.0  # global-norm clip; 0 = off
  o.grad_accum_steps = 1  # micro-batches per step

  # Auxiliary losses and the expert-bias controller (moetrain.train_step.StepConfig).
  c.loss = config_dict.ConfigDict()
  c.loss.router_z_loss = 0.0  # coefficient of mean(logsumexp(router logits)^2)
  c.loss.balance_loss = 0.0  # coefficient of the device-level balance loss
  c.loss.hidden_z_loss = 0.0  # coefficient of LongCat's hidden z-loss
  c.loss.bias_update_rate = 1e-3  # mu of the proportional expert-bias update; 0 = off
  # Cosine-decay mu to 0 over this many steps; 0 = constant, -1 = over train.steps.
  c.loss.bias_update_decay_steps = 0

  # Loop, logging, evaluation and checkpoints.
  t = c.train = config_dict.ConfigDict()
  t.steps = 200  # optimizer steps (the schedule's length)
  t.stop_at_step = 0  # end this invocation after this step, e.g. a time-boxed session; 0 = steps
  t.log_every = 10  # progress line + metrics.jsonl record every N steps
  t.eval_every = 100  # eval every N steps (and always at the end); 0 = only at the end
  t.eval_batches = 8  # eval batches per evaluation (cap); no evals: data.eval_split = ''
  t.checkpoint_every = 50  # save every N steps (and at the end)
  t.keep_checkpoints = 3  # checkpoints kept
  t.async_checkpoint = True  # write checkpoints in the background
  # Write the checksums of every checkpoint's files and check them before a restore (each reads
  # the checkpoint once more: ~1.8 GB/s from disk here, bench/RESULTS.md); False = neither.
  t.verify_checkpoints = True
  t.resume_step = 0  # resume from this checkpoint, moving newer ones aside; 0 = the latest
  # Stop after this many skipped (non-finite) steps in a row; 0 = never. (float16's loss scale
  # halves at most 15 times from its start before it reaches 1.)
  t.max_nonfinite_steps = 20
  # Persistent XLA cache: a directory, '' = off, or 'auto': ~/.cache/moetrain/jax on one
  # process, <workdir>/jax_cache on several (only process 0 writes it: it must be shared).
  t.compilation_cache = 'auto'
  return c
