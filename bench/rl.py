"""Reinforcement learning on the demo task (configs/grpo.py): the eval reward curve per routing
replay mode on the same seed, the sampler's agreement with the trainer (rl/sampler_kl_k3,
rl/router_flip_rate, rl/extreme_token_fraction: means over the run's steps), the step's time
split (sampling, old-policy pass, updates), and the sampler's tokens/s beside the generate
tool's loop on the same rows.

  python -m bench.rl [--replay none,r2,r3] [--steps N] [--set KEY=VALUE ...]
  python -m bench.rl --replay= --sampler_rows 64          # the sampler's speed alone
  python -m bench.rl --replay= --sampler_rows 0 --pass_at 8,64 [--start DIR]  # what RL can reach

--pass_at measures the start's eval prompts by list length: greedy exact match, the sampled
(temperature 1) exact match, and pass@k, the share of prompts with at least one right completion
among k samples: a group of k completions teaches GRPO's exact-match reward something only where
one of them is right.

Each mode runs as its own `python -m moetrain.main` in a fresh directory, from the same start
(the LoRA demo's result, moetrain/data/demo/sft).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import emit, machine


def _records(workdir: str) -> list[dict]:
  return [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]


def run_mode(replay: str, steps: int, sets: list[str], tmp: str) -> dict:
  workdir = os.path.join(tmp, replay)
  args = [
    '--config=configs/grpo.py',
    f'--workdir={workdir}',
    f'--config.rl.routing_replay={replay}',
  ]
  args += ([f'--config.train.steps={steps}'] if steps else []) + [f'--config.{kv}' for kv in sets]
  t = time.perf_counter()
  env = {**os.environ, 'PYTHONPATH': '.'}
  subprocess.run([sys.executable, '-m', 'moetrain.main', *args], check=True, env=env)
  records = _records(workdir)
  evals = [r for r in records if r['kind'] == 'eval']
  train = [r for r in records if r['kind'] == 'train']
  rollouts = [r for r in records if r['kind'] == 'rollout'][1:]  # (the first compiles)
  mean = lambda rows, k: round(statistics.fmean(r[k] for r in rows), 5)
  return {
    'replay': replay,
    'steps': train[-1]['step'],
    'seconds': round(time.perf_counter() - t, 1),
    'eval_reward': [(r['step'], round(r['rl/reward_mean'], 4)) for r in evals],
    'eval_exact': [(r['step'], round(r.get('rl/reward/reversal_exact', -1), 4)) for r in evals],
    'train_reward_first_last': (train[0]['rl/reward_mean'], train[-1]['rl/reward_mean']),
    **{
      k: mean(train, f'rl/{k}')
      for k in ('sampler_kl_k3', 'router_flip_rate', 'extreme_token_fraction', 'clip_fraction')
    },
    'sampling_s': round(statistics.median(r['rl/time/sampling_s'] for r in rollouts), 3),
    'old_pass_s': round(statistics.median(r['rl/time/old_pass_s'] for r in rollouts), 3),
    # The whole RL step's throughput (tokens read per second: the rollout's time is in it).
    'step_tokens_per_s': round(statistics.median(r['tokens_per_sec'] for r in train[1:]), 1),
  }


def sampler_speed(rows: int, new: int, repeats: int) -> dict:
  """The sampler's and the generate tool's tokens/s on `rows` copies of one demo prompt (the
  same length: generate's loop needs that), greedy, max `new` tokens, no eos (both run all)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from moetrain.data import demo_sft, demo_task
  from moetrain.model import sampler
  from moetrain.tools import generate as gen
  from moetrain.training import rl

  model, tok = gen.load_hf(str(demo_sft.DIR))
  prompt = json.loads(open(demo_task.DEMO_DIR / 'eval.jsonl').readline())['prompt']
  ids = gen.prompt_ids(tok, prompt, True)
  graphdef, state = nnx.split(model)
  total = len(ids) + new
  padded = np.zeros((rows, total + 1), np.int32)
  padded[:, : len(ids)] = ids
  lengths = jnp.full((rows,), len(ids), jnp.int32)
  opts = sampler.sample_opts(0.0, vocab=tok.vocab_size)

  def ours():  # (the prompt's first tokens at once, as the rollouts run it)
    return sampler.sample(
      graphdef,
      state,
      jnp.asarray(padded),
      lengths,
      jax.random.key(0),
      opts,
      max_new=new,
      prefill=rl.prefill_length(len(ids)),
    ).tokens

  def theirs():
    return gen.generate(model, [ids] * rows, new)

  fns = {'sampler': ours, 'generate': theirs}
  times = {name: [] for name in fns}
  for fn in fns.values():
    jax.block_until_ready(fn())  # (compiles)
  for _ in range(repeats):  # alternately, so that a loaded machine slows both alike
    for name, fn in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - t)
  out = {f'{k}_tokens_per_s': round(rows * new / statistics.median(v), 1) for k, v in times.items()}
  out['ratio'] = round(out['sampler_tokens_per_s'] / out['generate_tokens_per_s'], 3)
  # The sampler runs the prompt's first power-of-two tokens at once and reads the rest token by
  # token (rows of any lengths share its loop); the generate tool prefills the whole prompt.
  return {
    'what': 'sampler speed',
    'rows': rows,
    'prompt_tokens': len(ids),
    'new_tokens': new,
    **out,
  }


def pass_at(start: str, ks: list[int], temperature: float = 1.0, new: int = 12) -> list[dict]:
  """Per list length of the eval prompts: greedy exact match, then per k the sampled exact
  match and pass@k (k completions per prompt at `temperature`, one batch per k)."""
  import collections

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from moetrain.data import demo_task
  from moetrain.model import sampler
  from moetrain.tools import generate as gen

  model, tok = gen.load_hf(start)
  graphdef, state = nnx.split(model)
  records = [json.loads(line) for line in open(demo_task.DEMO_DIR / 'eval.jsonl')]
  sizes = [len(r['completion'].split()) for r in records]

  def exact(k: int, t: float) -> np.ndarray:  # [prompts, k]
    ids = [gen.prompt_ids(tok, r['prompt'], True) for r in records]
    rows = np.zeros((len(ids) * k, max(map(len, ids)) + new + 1), np.int32)
    for i, x in enumerate(ids):
      rows[i * k : (i + 1) * k, : len(x)] = x
    lengths = np.repeat([len(x) for x in ids], k)
    opts = sampler.sample_opts(t, eos_id=tok.eos_id, vocab=tok.vocab_size)
    out = sampler.sample(
      graphdef,
      state,
      jnp.asarray(rows),
      jnp.asarray(lengths),
      jax.random.key(1),
      opts,
      max_new=new,
    )
    tokens, end = np.asarray(out.tokens), np.asarray(out.end)
    texts = [
      tok.decode([i for i in tokens[b, lengths[b] : end[b]] if i != tok.eos_id])
      for b in range(len(rows))
    ]
    got = demo_task.reversal_exact(texts, [r for r in records for _ in range(k)])
    return np.asarray(got).reshape(len(records), k)

  results = {'greedy': exact(1, 0.0)[:, 0]} | {k: exact(k, temperature) for k in ks}
  by_size = collections.defaultdict(list)
  for i, n in enumerate(sizes):
    by_size[n].append(i)
  out = []
  for n, idx in sorted(by_size.items()) + [('all', list(range(len(records))))]:
    row = {'what': 'pass@k', 'start': start, 'words': n, 'prompts': len(idx)}
    row['greedy_exact'] = round(float(results['greedy'][idx].mean()), 3)
    for k in ks:
      row[f'sampled_exact_T{temperature:g}'] = round(float(results[k][idx].mean()), 3)
      row[f'pass@{k}'] = round(float(results[k][idx].max(axis=1).mean()), 3)
    out.append(row)
  return out


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--replay', default='none,r2,r3')
  p.add_argument('--steps', type=int, default=0, help="0: the config's train.steps")
  p.add_argument('--sampler_rows', type=int, default=64)
  p.add_argument('--set', action='append', default=[], help='KEY=VALUE config overrides')
  p.add_argument('--pass_at', default='', help="k's: the start's pass@k per list length")
  p.add_argument('--start', default='', help='--pass_at: a model directory (the RL demo start)')
  a = p.parse_args()
  with tempfile.TemporaryDirectory(prefix='bench_rl') as tmp:
    for replay in filter(None, a.replay.split(',')):
      emit({'bench': 'rl', **run_mode(replay, a.steps, a.set, tmp)} | machine())
  if a.sampler_rows:
    emit({'bench': 'rl', **sampler_speed(a.sampler_rows, 12, 15)} | machine())
  if a.pass_at:
    from moetrain.data import demo_sft

    ks = [int(k) for k in a.pass_at.split(',')]
    for row in pass_at(a.start or str(demo_sft.DIR), ks):
      emit({'bench': 'rl', **row} | machine())


if __name__ == '__main__':
  main()
