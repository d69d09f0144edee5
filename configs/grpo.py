"""Reinforcement learning (GRPO) on the CPU demo: from the LoRA demo's result (the shipped base
with its reversal adapters merged in; shipped, moetrain/data/demo_sft.py), new LoRA adapters on
the attention, dense MLPs and routed experts learn from a verifiable reward, the exact reversal
of the prompt's words. The completions are sampled in bfloat16, the trainer runs in float32:
the two disagree on some routes (rl/router_flip_rate), which routing replay removes.

  python -m moetrain.main --config=configs/grpo.py                                  # GRPO
  python -m moetrain.main --config=configs/grpo.py --config.rl.routing_replay=r3 \\
      --workdir=runs/grpo_r3                                     # replay the sampler's routes
  python -m moetrain.main --config=configs/grpo.py --config.rl.algorithm=dapo ...  # gspo, dr_grpo
  python -m moetrain.main --config=configs/grpo.py:start=RUN_OR_HF_DIR ...          # another start

Changes from configs/longcat_lora.py: the `rl` section (GRPO, 8 completions of 8 prompts a step,
temperature 1, up to 12 new tokens, no KL); the rewards (exact match, and the share of words in
the right place); learning rate 3e-4; 300 steps; the trainer in float32; the expert-bias
controller off. docs/rl.md.
"""

from configs import base, longcat_lora


def get_config(arg: str | None = None):
  config = longcat_lora.get_config()
  config.init.hf_checkpoint = base.start_of(arg, 'configs/grpo.py')
  config.rl.algorithm = 'grpo'
  config.rl.group_size = 8
  config.rl.max_new_tokens = 12
  config.rl.temperature = 1.0
  config.rl.sampler_dtype = 'bfloat16'
  config.rl.rewards = (
    'moetrain.data.demo_task:reversal_exact,moetrain.data.demo_task:reversal_positions'
  )
  config.engine.dtype = 'float32'  # the trainer; the sampler in bfloat16
  config.data.seq_len = 48
  config.data.global_batch_size = 64  # 8 prompts x 8 completions
  config.optim.learning_rate = 3e-4
  config.optim.warmup_steps = 5
  config.data.eval_batch_size = 40
  config.loss.bias_update_rate = 0.0
  config.train.steps = 300
  config.train.eval_every = 100
  config.train.eval_batches = 5  # the 200 eval prompts
  config.train.log_every = 5
  return config
