"""Distillation on the CPU demo: a one-layer student with 4 routed experts, cut from a two-layer,
8-expert teacher (moetrain/data/demo_teacher.py, shipped), learns the shuffling task: the
prompt's words in any order (moetrain/data/demo_task.py). A label holds one order; the teacher
gives each next word's whole distribution, the words not yet written.

  python -m moetrain.main --config=configs/distill.py                       # distilled
  python -m moetrain.main --config=configs/distill.py --config.distill.alpha=0 \\
      --workdir=runs/distill_alone                                           # the student alone

Changes from base: the data (demo/shuffle, JSONL); the `distill` section (the teacher, forward KL
at temperature 1, alpha 0.9; docs/distillation.md); the student is the tiny LongCat shape with
one layer and 4 routed experts, every weight trained (no LoRA), started from the teacher's
embeddings, first layer and 4 of its experts drawn by the seed; the tokenizer is the teacher's.
"""

from configs import base
from moetrain.data import demo_task, demo_teacher


def get_config(arg: str | None = None):
  base.variant_of(arg, 'configs/distill.py')
  config = base.get_config()
  base.set_model(config, 'tiny')
  config.model.num_layers = 1
  config.model.n_routed_experts = 4
  config.lora.rank = 0
  config.data.source = 'jsonl'
  config.data.path = str(demo_task.SHUFFLE_DIR / '{split}.jsonl')
  config.optim.learning_rate = 3e-3
  config.optim.weight_decay_exclude = r'^embed\.|router'
  d = config.distill
  d.teacher = str(demo_teacher.DIR)
  # Pruned, then distilled: the student starts as the teacher cut to one layer and 4 random
  # experts (the student alone too), so the seed moves which experts it keeps and its dropout,
  # not whether it learns at all. Mostly the teacher's distribution at T = 1: at step 200 eval
  # loss 1.23 against 1.37 alone (bench/RESULTS.md, "Distillation on the demo task").
  d.init_from_teacher = 'random'
  d.alpha = 0.9
  d.temperature = 1.0
  return config
