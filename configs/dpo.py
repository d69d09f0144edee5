"""Preference tuning (DPO) on the CPU demo: from the LoRA demo's result (the shipped base with
its reversal adapters merged in; shipped, moetrain/data/demo_sft.py), new
LoRA adapters learn to prefer the right reversal of a word list over a plausible wrong one (the
copy, or the reversal with two neighbours swapped; moetrain/data/preference.py).

  python -m moetrain.main --config=configs/dpo.py                          # DPO
  python -m moetrain.main --config=configs/dpo.py --config.preference.loss=simpo \\
      --workdir=runs/simpo                                                  # or ipo, hinge, orpo, kto
  python -m moetrain.main --config=configs/dpo.py:start=RUN_OR_HF_DIR ...   # another start

Changes from configs/longcat_lora.py: the `preference` section (sigmoid, beta 0.1, with the
chosen completions' NLL at weight 1; the reference is the start itself: the new adapters off);
preference records of the demo task; 100 steps;
the expert-bias controller off (the reference routes with the start's biases). docs/preference.md.
"""

from configs import base, longcat_lora


def get_config(arg: str | None = None):
  config = longcat_lora.get_config()
  config.init.hf_checkpoint = base.start_of(arg, 'configs/dpo.py')
  config.preference.loss = 'sigmoid'
  config.preference.beta = 0.1
  # The chosen completions' NLL beside the DPO loss (RPO): without it both likelihoods fell and
  # the eval completion accuracy with them (0.8338 -> 0.6133 at step 100, pref/accuracy 0.95);
  # with it 0.8338 -> 0.8604, pref/accuracy 0.95 (bench/RESULTS.md, "Preference tuning on the
  # demo task").
  config.preference.sft_weight = 1.0
  config.loss.bias_update_rate = 0.0
  config.train.steps = 100
  config.train.eval_every = 50
  return config
