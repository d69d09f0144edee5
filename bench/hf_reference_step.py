"""Times one training step of transformers' LongcatFlashForCausalLM on CPU (the baseline moetrain is compared to).

Runs in the separate reference venv (torch 2.13.0+cpu, transformers 4.57.6, peft 0.21.2), never the project one:

  /work/hfvenv/bin/python bench/hf_reference_step.py --mode full --steps 5 --warmup 2 --threads 2
  /work/hfvenv/bin/python bench/hf_reference_step.py --mode lora --steps 5 --warmup 2 --threads 2

A step is forward + causal-LM loss + backward + AdamW update (+ zero_grad), float32, batch 4 x 512 tokens, on
the "medium" config below (about 78M parameters). Prints one JSON line: median step time and tokens/s over
--steps timed steps after --warmup untimed ones, plus the fastest step (min_step_s): on a CPU shared with
other jobs single steps vary by up to 10x (seen: 3.3 s to 35 s for the same LoRA step on 2 busy cores).

LoRA: peft LoraConfig(r=16, alpha=32) on q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, gate_proj,
up_proj, down_proj. peft matches module-name suffixes, and HF 4.57 keeps each routed expert as its own
LongcatFlashMLP of nn.Linear (mlp.experts.{e}.gate_proj, ...), so every routed expert gets its own adapters,
as do the dense mlps.{0,1}; the zero experts (nn.Identity), the router classifier, embeddings and lm_head get
none. Only adapters are trained (peft freezes the rest); the JSON reports how many Linear modules were wrapped.
"""

import argparse
import json
import resource
import statistics
import time

import torch
import transformers
from transformers import LongcatFlashConfig, LongcatFlashForCausalLM

MEDIUM = dict(
  vocab_size=32768,
  hidden_size=512,
  num_layers=4,
  num_attention_heads=8,
  q_lora_rank=256,
  kv_lora_rank=128,
  qk_nope_head_dim=64,
  qk_rope_head_dim=32,
  head_dim=32,  # HF sizes the rotary table from head_dim: it must equal qk_rope_head_dim
  v_head_dim=64,
  ffn_hidden_size=1024,
  expert_ffn_hidden_size=256,
  n_routed_experts=16,
  zero_expert_num=8,
  moe_topk=4,
  routed_scaling_factor=6.0,
  rms_norm_eps=1e-5,
  rope_theta=1e7,
  max_position_embeddings=4096,
  tie_word_embeddings=False,
)
LORA_TARGETS = [
  'q_a_proj',
  'q_b_proj',
  'kv_a_proj_with_mqa',
  'kv_b_proj',
  'o_proj',
  'gate_proj',
  'up_proj',
  'down_proj',
]


def _model(mode, attn):
  torch.manual_seed(0)
  config = LongcatFlashConfig(**MEDIUM)
  model = LongcatFlashForCausalLM._from_config(
    config, attn_implementation=attn, dtype=torch.float32
  )
  info = {}
  if mode == 'lora':
    import peft

    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    model = peft.get_peft_model(model, lora)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    info = {
      'peft': peft.__version__,
      'lora_modules': len(wrapped),
      'lora_expert_modules': sum('.mlp.experts.' in n for n in wrapped),
      'lora_dense_mlp_modules': sum('.mlps.' in n for n in wrapped),
      'lora_attention_modules': sum('.self_attn.' in n for n in wrapped),
    }
  return model.train(), info


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--mode', choices=['full', 'lora'], default='full')
  parser.add_argument('--steps', type=int, default=5, help='timed steps')
  parser.add_argument('--warmup', type=int, default=2, help='untimed steps before timing')
  parser.add_argument('--threads', type=int, default=2, help='torch intra-op threads')
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--seq', type=int, default=512)
  parser.add_argument(
    '--attn', default='sdpa', choices=['sdpa', 'eager'], help='HF attention backend'
  )
  args = parser.parse_args()
  torch.set_num_threads(args.threads)
  torch.set_num_interop_threads(1)

  model, info = _model(args.mode, args.attn)
  trainable = [p for p in model.parameters() if p.requires_grad]
  opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.1)
  gen = torch.Generator().manual_seed(0)
  ids = torch.randint(0, MEDIUM['vocab_size'], (args.batch, args.seq), generator=gen)

  times, losses = [], []
  for i in range(args.warmup + args.steps):
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    losses.append(round(loss.item(), 4))
    if i >= args.warmup:
      times.append(dt)

  median = statistics.median(times)
  print(
    json.dumps(
      {
        'bench': 'hf_reference_step',
        'mode': args.mode,
        'device': 'cpu',
        'dtype': 'float32',
        'attn': args.attn,
        'threads': args.threads,
        'batch': args.batch,
        'seq': args.seq,
        'steps': args.steps,
        'warmup': args.warmup,
        'median_step_s': round(median, 4),
        'min_step_s': round(min(times), 4),
        'tokens_per_s': round(args.batch * args.seq / median, 1),
        'step_times_s': [round(t, 4) for t in times],
        'losses': losses,
        'params_total': sum(p.numel() for p in model.parameters()),
        'params_trainable': sum(p.numel() for p in trainable),
        'peak_rss_gb': round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        'torch': torch.__version__,
        'transformers': transformers.__version__,
        **info,
      }
    )
  )


if __name__ == '__main__':
  main()
