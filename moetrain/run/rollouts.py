"""Reinforcement learning's rollouts: prompts -> completions sampled on the training mesh with the
training weights (model/sampler.py) -> rewards -> group advantages -> the old-policy pass ->
the batch the next rl.num_iterations updates train on (training/rl.py). docs/rl.md."""

import dataclasses
import functools
import importlib
import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moetrain.core import multihost, runtime
from moetrain.core.sharding import batch_sharding
from moetrain.data import prompts as prompts_lib
from moetrain.model import sampler
from moetrain.run.evaluation import to_global
from moetrain.training import rl as rl_lib
from moetrain.training.train_state import graphdef_of, merge_model, merge_teacher
from moetrain.training.train_step import needs_reference

SAMPLER_SEED = 0x5A4D  # folded into the run's seed: the sampler's own stream of keys


class Stream:
  """The training loop's data position in an RL run: none to keep (a rollout's prompts follow
  from its index, which follows from the step)."""

  num_truncated = 0

  def get_state(self) -> dict:
    return {'rollouts': True, 'num_truncated': 0}

  def set_state(self, state: dict) -> None:
    del state


@dataclasses.dataclass(frozen=True)
class Reward:
  name: str
  spec: str  # 'module:function'
  weight: float
  fn: Callable


def load_rewards(cfg: rl_lib.RLConfig) -> list[Reward]:
  """The reward functions of rl.rewards, imported now: one that does not import is named."""
  out = []
  for name, spec, weight in cfg.reward_specs:
    module, attr = spec.split(':')
    try:
      fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
      raise runtime.UserError(f'rl.rewards: {spec} does not import: {e}') from None
    if not callable(fn):
      raise runtime.UserError(f'rl.rewards: {spec} is not a function')
    out.append(Reward(name, spec, weight, fn))
  return out


def score(rewards: list[Reward], completions: list[str], records: list[dict]) -> np.ndarray:
  """[B, F] float32: each function's reward(completions, records) -> B numbers. A function that
  raises, or returns the wrong number of values or a non-finite one, is named."""
  out = np.zeros((len(completions), len(rewards)), np.float32)
  for i, r in enumerate(rewards):
    try:
      values = r.fn(list(completions), list(records))
    except Exception as e:  # noqa: BLE001 (the user's function: any error, one line)
      raise runtime.UserError(f'rl.rewards: {r.spec} raised {type(e).__name__}: {e}') from None
    try:
      got = np.asarray(values, np.float64)
    except (TypeError, ValueError):
      what = type(values).__name__
      raise runtime.UserError(f'rl.rewards: {r.spec} returned {what}, not numbers') from None
    if got.shape != (len(completions),):
      raise runtime.UserError(
        f'rl.rewards: {r.spec} returned shape {got.shape} for {len(completions)} completions '
        '(one number each)'
      )
    if not np.isfinite(got).all():
      j = int(np.flatnonzero(~np.isfinite(got))[0])
      raise runtime.UserError(
        f'rl.rewards: {r.spec} returned {got[j]} for completion {j} '
        f'({records[j].get("where", "")}); rewards must be finite'
      )
    out[:, i] = got
  return out


def local_rows(x) -> np.ndarray:
  """This process's rows of a global array sharded over its rows, in order."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  shards = {s.index[0].start or 0: s for s in x.addressable_shards}
  return np.concatenate([np.asarray(shards[k].data) for k in sorted(shards)])


def _old_pass(state, batch, *, graphdef, cfg):
  model = merge_model(graphdef, state.params, state.moe_bias, state.frozen)
  reference = None
  if needs_reference(cfg):
    if cfg.model.lora.enabled:  # the adapters off: their delta exactly 0
      off = jax.tree.map(jnp.zeros_like, state.params)
      reference = merge_model(graphdef, off, state.moe_bias, state.frozen)
    else:
      reference = merge_teacher(cfg.teacher, state.teacher)
  return rl_lib.old_policy_pass(model, reference, batch, cfg.rl)


class Rollouts:
  """Makes the rollout batches of a run: a new one every rl.num_iterations steps, from the
  prompts of that rollout (prompts.order: the seed and its index decide them, so a resumed run
  samples the same prompts, with the same keys)."""

  def __init__(self, setup, tokenizer, chat_format, batch_sharding, writer=None):
    self.setup, self.rl = setup, setup.step.rl
    self.tokenizer, self.chat_format = tokenizer, chat_format
    self.sharding, self.writer = batch_sharding, writer
    self.rewards = load_rewards(self.rl)
    d = setup.data
    self.train_prompts = prompts_lib.open_prompts(d.source, d.path, 'train')
    self.eval_prompts = None
    if d.eval_split:
      self.eval_prompts = prompts_lib.open_prompts(d.source, d.path, d.eval_split)
    self.sample = rl_lib.jit_sampler(self.rl, setup.model)
    self.old_pass = jax.jit(
      functools.partial(_old_pass, graphdef=graphdef_of(setup.model), cfg=setup.step)
    )
    self.fields = rl_lib.batch_fields(self.rl, setup.model, d.seq_len)
    self.rows = d.global_batch_size // jax.process_count()  # this process's
    self.current = (None, None)  # (rollout index, batch)
    self.stops = [s for s in self.rl.stop.split('|') if s]
    self.rounds = 0  # of the hosts' exchange of their shortest prompt

  def batch_for(self, state, step: int) -> dict:
    """The update batch of `step` (1-based): a new rollout at the first step of each round of
    rl.num_iterations updates, and after a resume."""
    index = (step - 1) // self.rl.num_iterations
    if self.current[0] != index:
      self.current = (index, self.rollout(state, index))
    return self.current[1]

  def prompt_rows(self, records: list[dict], group: int):
    """(prompt tokens [rows, S + 1] right-padded, lengths [rows]): each record's prompt
    `group` times."""
    s = self.setup.data.seq_len
    room = s + 1 - self.rl.max_new_tokens
    rows = np.zeros((len(records) * group, s + 1), np.int32)
    lengths = np.zeros((len(records) * group,), np.int32)
    for i, record in enumerate(records):
      ids = prompts_lib.prompt_ids(record, self.tokenizer, self.chat_format)
      if len(ids) > room:
        raise runtime.UserError(
          f'{record.get("where", "a prompt")}: its {len(ids)} tokens leave no room for '
          f'rl.max_new_tokens={self.rl.max_new_tokens} in data.seq_len={s} (prompts of at most '
          f'{room} tokens)'
        )
      rows[i * group : (i + 1) * group, : len(ids)] = ids
      lengths[i * group : (i + 1) * group] = len(ids)
    return rows, lengths

  def generate(self, state, records: list[dict], group: int, key, greedy: bool):
    """Samples `group` completions of each record's prompt. Returns (the sampler's output,
    this process's rows of it on the host: tokens, logp, end, lengths; the completions' texts
    and scored-token ends after stop strings)."""
    rows, lengths = self.prompt_rows(records, group)
    rl, tok = self.rl, self.tokenizer
    opts = sampler.sample_opts(
      0.0 if greedy else rl.temperature, rl.top_p, rl.top_k, tok.eos_id, tok.vocab_size
    )
    g = to_global({'p': rows, 'n': lengths}, self.sharding)
    args = (state.params, state.moe_bias, state.frozen, g['p'], g['n'], key, opts)
    out = self.sample(*args, prefill=self.prefill(int(lengths.min())))
    tokens, logp, end = (local_rows(x) for x in (out.tokens, out.logp, out.end))
    texts, ends = [], []
    for b in range(tokens.shape[0]):
      text, stop = self.completion(tokens[b, lengths[b] : end[b]])
      texts.append(text)
      ends.append(lengths[b] + stop)
    return out, (tokens, logp, np.asarray(ends), lengths), texts

  def prefill(self, shortest: int) -> int:
    """rl.prefill_length of the shortest prompt of every process (they run one program)."""
    if jax.process_count() > 1:
      shortest = min(map(int, multihost.Exchange('rl_prefill')(str(shortest), self.rounds)))
      self.rounds += 1
    return rl_lib.prefill_length(shortest)

  def completion(self, ids) -> tuple[str, int]:
    """(the completion's text, its scored tokens): up to eos, or through the first stop string
    (the text before it)."""
    ids = [int(i) for i in ids]
    n = len(ids)
    if ids and ids[-1] == self.tokenizer.eos_id:
      ids = ids[:-1]
    text = self.tokenizer.decode(ids)
    hits = [(text.find(s), s) for s in self.stops if s in text]
    if not hits:
      return text, n
    at, stop = min(hits)
    k = next(k for k in range(1, len(ids) + 1) if stop in self.tokenizer.decode(ids[:k]))
    return text[:at], k

  def rollout(self, state, index: int) -> dict:
    rl, group = self.rl, self.rl.group_size
    timer = time.perf_counter()
    n_prompts = self.rows // group
    first = (index * jax.process_count() + jax.process_index()) * n_prompts
    picks = prompts_lib.order(len(self.train_prompts), self.setup.seed, first, n_prompts)
    records = [self.train_prompts[i] for i in picks]
    key = jax.random.fold_in(jax.random.key(self.setup.seed ^ SAMPLER_SEED), index)
    out, (tokens, logp, ends, lengths), texts = self.generate(state, records, group, key, False)
    sampled = time.perf_counter()
    rewards = score(self.rewards, texts, [r for r in records for _ in range(group)])
    host = self.rows_of(tokens, logp, ends, lengths, rewards)
    batch = to_global(host, self.sharding)
    batch['sampler_routes'] = jax.device_put(out.routes, batch_sharding(self.sharding.mesh, 4))
    old = jax.block_until_ready(self.old_pass(state, batch))
    batch |= old
    if rl.routing_replay == 'r2':
      batch['routes'] = old['trainer_routes']
    elif rl.routing_replay == 'r3':
      batch['routes'] = batch['sampler_routes']
    keep = {'inputs', 'targets', 'positions', 'segment_ids', 'loss_mask', *self.fields}
    batch = {k: v for k, v in batch.items() if k in keep}
    if self.writer is not None:
      seconds = {
        'rl/time/sampling_s': sampled - timer,
        'rl/time/old_pass_s': time.perf_counter() - sampled,
      }
      self.writer.write(index * rl.num_iterations + 1, seconds, kind='rollout')
    return batch

  def rows_of(self, tokens, logp, ends, lengths, rewards) -> dict:
    """The host's rows of the update batch (before the old-policy pass)."""
    rl, s = self.rl, self.setup.data.seq_len
    weights = np.asarray([r.weight for r in self.rewards], np.float32)
    total = rewards @ weights
    adv = np.asarray(rl_lib.group_advantages(total, rl.group_size, rl.algorithm), np.float32)
    i = np.arange(s)[None, :]
    scored = (i + 1 >= lengths[:, None]) & (i + 1 < ends[:, None])
    if rl.filters_groups:  # the groups whose rewards are all equal teach nothing: dropped
      flat = total.reshape(-1, rl.group_size)
      same = np.repeat(flat.max(1) == flat.min(1), rl.group_size)
      scored &= ~same[:, None]
    return {
      'inputs': tokens[:, :s],
      'targets': tokens[:, 1 : s + 1],
      'positions': np.broadcast_to(i, tokens[:, :s].shape).astype(np.int32),
      'segment_ids': (i < ends[:, None] - 1).astype(np.int32),
      'loss_mask': scored.astype(np.float32),
      'sampler_logp': logp[:, 1 : s + 1].astype(np.float32),
      'rewards': rewards,
      'advantages': adv,
    }

  def evaluate(self, state, step: int) -> dict:
    """The rewards of greedy completions of the eval prompts (data.eval_batch_size a batch, up
    to train.eval_batches batches; one completion each): rl/reward_mean, rl/reward/<function>
    and rl/response_length, over every process's prompts."""
    d, t = self.setup.data, self.setup.train
    rows = d.eval_batch_size // jax.process_count()
    n = len(self.eval_prompts)
    batches = max(1, min(t.eval_batches or n, -(-n // d.eval_batch_size)))
    sums, lengths, count = np.zeros(len(self.rewards)), 0.0, 0
    for b in range(batches):
      start = (b * jax.process_count() + jax.process_index()) * rows
      records = [self.eval_prompts[(start + j) % n] for j in range(rows)]
      _, (_, _, ends, prompt_len), texts = self.generate(state, records, 1, jax.random.key(0), True)
      sums += score(self.rewards, texts, records).sum(0)
      lengths += float((ends - prompt_len).sum())
      count += rows
    if jax.process_count() > 1:
      mine = json.dumps([*sums.tolist(), lengths, count])
      every = np.asarray([json.loads(v) for v in multihost.Exchange('rl_eval')(mine, step)])
      sums, lengths, count = every[:, :-2].sum(0), every[:, -2].sum(), int(every[:, -1].sum())
    means = sums / count
    weights = np.asarray([r.weight for r in self.rewards])
    return {
      'rl/reward_mean': float(means @ weights),
      **{f'rl/reward/{r.name}': float(m) for r, m in zip(self.rewards, means)},
      'rl/response_length': lengths / count,
      'rl/prompts': count,
    }
