"""Training LongCat-Flash from random weights (or continuing from a checkpoint): every weight trains.

  python -m moetrain.main --config=configs/longcat_pretrain.py                    # tiny, CPU, demo data
  python -m moetrain.main --config=configs/longcat_pretrain.py:variant=flash ...  # the 560B shapes

Changes from base, after the LongCat-Flash technical report (shared reference, section 6): no
LoRA, so the router and every weight train; AdamW with epsilon 1e-16 (the report's: it must stay
far below the gradient RMS, which shrinks as models grow) and weight decay on matrices but not on
the embedding or the router; the proportional expert-bias controller with mu decaying over the
run; the device-level balance loss (zero experts as their own group) and the hidden z-loss, both
small. The report publishes neither coefficient: 1e-4 and 1e-6 are ours, to be tuned with its
router-gradient ratio (keep the balance loss's share of the router gradient under 0.1).
"""

from configs import base


def get_config(arg: str | None = None):
  variant = base.variant_of(arg, 'configs/longcat_pretrain.py')
  config = base.get_config()
  base.set_model(config, variant)
  config.lora.rank = 0
  o = config.optim
  o.eps = 1e-16
  o.weight_decay = 0.1
  o.weight_decay_exclude = r'^embed\.|router'
  loss = config.loss
  loss.balance_loss = 1e-4
  loss.hidden_z_loss = 1e-6
  loss.bias_update_rate = 1e-3
  # mu decays (cosine) to 0 over the run: -1 = over train.steps, as overridden.
  loss.bias_update_decay_steps = -1
  if variant == 'tiny':
    o.learning_rate = 3e-3
  elif variant == 'medium':
    o.learning_rate = 1e-3
  elif variant == 'flash':
    base.set_flash_pod(config, global_batch_size=1024, eval_batch_size=256)
    config.train.steps = 100_000
    config.train.checkpoint_every = 1000
    config.train.eval_every = 2000
    o.learning_rate = 3e-4
    o.warmup_steps = 2000
  return config
