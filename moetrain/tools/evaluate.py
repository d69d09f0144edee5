"""Loss, perplexity and token accuracy of a checkpoint on a dataset, sharded like training; of an
RL run's checkpoint, the rewards of greedy completions of the eval prompts (docs/rl.md).

  python -m moetrain.tools.evaluate --workdir=runs/longcat_lora
  python -m moetrain.tools.evaluate --config=configs/longcat_lora.py --config.init.hf_checkpoint=DIR

The latest checkpoint of --workdir is evaluated with the run's own config.json (or --config,
which must match the run); without --workdir, the initial weights of --config. The data section
chooses the dataset (data.eval_split, or --split).
"""

import dataclasses

import jax
from absl import app, flags
from ml_collections import config_flags

from moetrain.core import runtime, sharding
from moetrain.data import loader
from moetrain.run import startup
from moetrain.run.evaluation import evaluate
from moetrain.training import aot


def define_flags():
  config_flags.DEFINE_config_file('config', None, "Experiment config (default: the run's own).")
  flags.DEFINE_string('workdir', None, 'Run directory whose latest checkpoint to load.')
  flags.DEFINE_string('split', None, 'Split to evaluate (default data.eval_split).')
  flags.DEFINE_integer('max_batches', None, 'Cap on eval batches.')
  runtime.define_process_flags()


def evaluate_checkpoint(
  config, workdir: str | None, split: str | None = None, max_batches: int | None = None
) -> dict:
  if max_batches is not None and max_batches <= 0:
    raise ValueError(f'--max_batches={max_batches} must be positive (or left out: all batches)')
  setup = startup.tool_setup(config, workdir)
  if split:
    setup = dataclasses.replace(setup, data=dataclasses.replace(setup.data, eval_split=split))
  mesh = setup.make_mesh()
  tokenizer = loader.make_tokenizer(setup.data, workdir)
  startup.check_tokenizer_fits(tokenizer, setup)
  if setup.step.rl is not None:  # an RL run: the rewards of greedy completions of its prompts
    return rewards_of(setup, workdir, mesh, tokenizer, max_batches)
  batches = loader.make_eval_batches(
    setup.data,
    tokenizer,
    max_batches=max_batches,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
  )
  if not batches:
    raise ValueError('no eval data: set data.eval_split (or --split)')
  with jax.set_mesh(mesh):
    state = startup.load_latest(setup, workdir, mesh)
    eval_fn = aot.eval_step_fn(setup)
    out = evaluate(state, batches, eval_fn, sharding.batch_sharding(mesh))
  return {'step': int(state.step), **out}


def rewards_of(setup, workdir, mesh, tokenizer, max_batches: int | None) -> dict:
  from moetrain.run import rollouts

  if max_batches:
    setup = dataclasses.replace(
      setup, train=dataclasses.replace(setup.train, eval_batches=max_batches)
    )
  if not setup.data.eval_split:
    raise ValueError('no eval prompts: set data.eval_split (or --split)')
  with jax.set_mesh(mesh):
    state = startup.load_latest(setup, workdir, mesh)
    fmt = loader.chat_format(setup.data, tokenizer)
    r = rollouts.Rollouts(setup, tokenizer, fmt, sharding.batch_sharding(mesh))
    return {'step': int(state.step), **r.evaluate(state, 0)}


def main(argv):
  runtime.start_command(preemption=False)  # saves nothing: stay killable
  del argv
  f = flags.FLAGS
  out = evaluate_checkpoint(f.config, f.workdir, f.split, f.max_batches)
  if runtime.is_primary() and 'rl/reward_mean' in out:
    print(f'step {out["step"]}: ' + '  '.join(f'{k} {v:.4f}' for k, v in out.items() if '/' in k))
  elif runtime.is_primary():
    print(
      f'step {out["step"]}: loss {out["loss"]:.6f}  perplexity {out["perplexity"]:.4f}  '
      f'accuracy {out["accuracy"]:.4f}  ({int(out["tokens"])} tokens)'
    )
    if 'pref/accuracy' in out:  # a preference run: its objective's figures too
      print('  ' + '  '.join(f'{k} {v:.4f}' for k, v in out.items() if k.startswith('pref/')))


if __name__ == '__main__':
  define_flags()
  app.run(runtime.short_errors(main), flags_parser=runtime.parse_flags)
