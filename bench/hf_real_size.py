"""transformers + PEFT LoRA fine-tuning at a released MoE's shapes on this CPU host: the
baseline beside bench/cpu_real_size.py's moetrain run of the same work.

Runs in the separate reference venv (torch 2.13.0+cpu, transformers 4.57.6, peft 0.21.2), never
the project one:

  /tmp/hfvenv/bin/python bench/hf_real_size.py --out=bench/cpu_real_size.jsonl

The work, as moetrain's `configs/olmoe_lora.py:variant=olmoe_1b_7b` with a bfloat16 base: OLMoE-1B-7B
(16 layers, hidden 2048, 64 experts top-8 of width 1024, vocabulary 50304), weights drawn at
random in bfloat16 (no download), LoRA rank 8 / alpha 16 on q/k/v/o, every routed expert's
gate/up/down and the head (peft matches module-name suffixes; transformers 4.57 keeps each
expert as its own OlmoeMLP of nn.Linear), router and the rest frozen; gradient checkpointing;
one 1024-token row per step; AdamW on the adapters. Prints one JSON record: start-up (the model
drawn and wrapped), the median step of --steps after one untimed step, tokens/s and the process's
peak resident memory.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import time

import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import OlmoeConfig, OlmoeForCausalLM

OLMOE_1B_7B = dict(
  vocab_size=50304,
  hidden_size=2048,
  intermediate_size=1024,
  num_hidden_layers=16,
  num_attention_heads=16,
  num_key_value_heads=16,
  num_experts=64,
  num_experts_per_tok=8,
  max_position_embeddings=4096,
  rope_theta=10000.0,
  clip_qkv=None,
  norm_topk_prob=False,
  tie_word_embeddings=False,
)
TARGETS = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj', 'lm_head']


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--steps', type=int, default=2, help='timed steps (after one untimed)')
  ap.add_argument('--seq-len', type=int, default=1024)
  ap.add_argument('--threads', type=int, default=os.cpu_count())
  ap.add_argument('--layers', type=int, default=0, help='fewer layers (a smoke test)')
  ap.add_argument('--out', default='', help='append the JSON record to this file')
  a = ap.parse_args()
  torch.set_num_threads(a.threads)
  torch.manual_seed(0)
  t0 = time.perf_counter()
  config = OlmoeConfig(**OLMOE_1B_7B | ({'num_hidden_layers': a.layers} if a.layers else {}))
  model = OlmoeForCausalLM._from_config(config, dtype=torch.bfloat16)
  model.gradient_checkpointing_enable()
  model.enable_input_require_grads()
  lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
  model = get_peft_model(model, lora)
  model.train()
  startup = time.perf_counter() - t0
  trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
  opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
  ids = torch.randint(0, config.vocab_size, (1, a.seq_len))
  times, losses = [], []
  for i in range(a.steps + 1):
    t = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if i:
      times.append(time.perf_counter() - t)
    losses.append(float(loss))
  step = statistics.median(times)
  record = {
    'bench': 'hf_real_size',
    'model': 'OLMoE-1B-7B shapes, random bfloat16 base, transformers + PEFT LoRA r8',
    'date': time.strftime('%Y-%m-%d'),
    'host': platform.machine(),
    'threads': a.threads,
    'layers': config.num_hidden_layers,
    'seq_len': a.seq_len,
    'torch': torch.__version__,
    'transformers': transformers.__version__,
    'trainable_params': trainable,
    'startup_s': startup,
    'step_s': step,
    'step_times_s': times,
    'tokens_per_sec': a.seq_len / step,
    'loss': losses,
    'peak_rss_bytes': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
  }
  print(json.dumps(record), flush=True)
  if a.out:
    with open(a.out, 'a') as f:
      f.write(json.dumps(record) + '\n')


if __name__ == '__main__':
  main()
