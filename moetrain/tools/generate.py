"""Text generation (greedy or top-p) over the latent KV cache, and its command line.

  python -m moetrain.tools.generate --hf_checkpoint=DIR --prompt='Hello' --max_new_tokens=32
  python -m moetrain.tools.generate --workdir=runs/longcat_lora \
      --prompt='Hello' --temperature=0.8 --top_p=0.9 --seed=1
  python -m moetrain.tools.generate --config=configs/longcat_lora.py --prompt='Hello'
  python -m moetrain.tools.generate --hf_checkpoint=DIR --chat --prompt='What is MoE?'
  python -m moetrain.tools.generate --workdir=runs/chat --messages=conversations.jsonl

--workdir's latest checkpoint is loaded with the run's own config.json (or --config, which must
match the run); --config alone loads its initial weights (e.g. --config.init.hf_checkpoint=DIR).
Prints the text and prefill + decode tokens/s. --chat (or --messages) renders conversations with
the chat template the run trained with (data.chat_template, else the tokenizer's own, else the
built-in one) and its generation prompt, so a chat fine-tune is asked as it was taught.
"""

import contextlib
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from moetrain.convert.hf import load_model
from moetrain.convert.stacked_io import to_host
from moetrain.core import runtime, storage
from moetrain.data import demo_task, loader, sources
from moetrain.data.tokenizer import load_tokenizer
from moetrain.model.decode import decode_step, prefill
from moetrain.model.sampler import sample_top_p
from moetrain.run import startup
from moetrain.training.train_state import graphdef_of, merge_model


@functools.partial(jax.jit, static_argnames=('graphdef', 'max_new', 'absorb'))
def _generate(graphdef, state, prompt_BT, rng, opts: dict, *, max_new: int, absorb: bool):
  """Prefill, then a lax.while_loop of decode steps that exits once every row has emitted eos.
  opts holds traced scalars: temperature, top_p, eos_id (< 0: none), vocab (ids >= vocab are
  never chosen) and length (the prompt is prompt_BT[:, :length], right-padded to T). Returns
  the ids [B, T + max_new], the new ones from index length on, and the tokens per row."""
  model = nnx.merge(graphdef, state)
  b, padded = prompt_BT.shape
  t = opts['length']
  logits_BV, cache = prefill(model, prompt_BT, padded + max_new, length=t)
  eos_id = opts['eos_id']
  fill = jnp.maximum(eos_id, 0)
  ids_BS = jnp.concatenate([prompt_BT, jnp.full((b, max_new), fill, jnp.int32)], axis=1)

  def emit(i, logits_BV, ids_BS, done_B):
    in_vocab_BV = jnp.arange(logits_BV.shape[-1])[None, :] < opts['vocab']
    logits_BV = jnp.where(in_vocab_BV, logits_BV, -jnp.inf)
    tok_B = jax.lax.cond(
      opts['temperature'] > 0,
      lambda: sample_top_p(
        logits_BV, jax.random.fold_in(rng, i), opts['temperature'], opts['top_p']
      ),
      lambda: jnp.argmax(logits_BV, axis=-1),
    ).astype(jnp.int32)
    tok_B = jnp.where(done_B, fill, tok_B)
    done_B = done_B | (tok_B == eos_id)
    ids_BS = jax.lax.dynamic_update_slice_in_dim(ids_BS, tok_B[:, None], t + i, axis=1)
    return ids_BS, done_B

  def cond(carry):
    i, _, done_B, _ = carry
    return (i < max_new) & ~jnp.all(done_B)

  def body(carry):
    i, ids_BS, done_B, cache = carry
    pos = t + i - 1
    tok_B = jax.lax.dynamic_index_in_dim(ids_BS, pos, axis=1, keepdims=False)
    logits_BV, cache = decode_step(model, cache, tok_B, pos, absorb=absorb)
    ids_BS, done_B = emit(i, logits_BV, ids_BS, done_B)
    return i + 1, ids_BS, done_B, cache

  ids_BS, done_B = emit(0, logits_BV, ids_BS, jnp.zeros((b,), bool))
  steps, ids_BS, _, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), ids_BS, done_B, cache))
  return ids_BS, steps


def _args(
  model,
  prompt_ids,
  max_new_tokens,
  *,
  temperature=0.0,
  top_p=1.0,
  rng=None,
  eos_id=None,
  vocab_size=None,
  absorb=True,
  bucket=False,
):
  graphdef, state = nnx.split(model)
  rng = jax.random.key(0) if rng is None else rng
  prompt = jnp.asarray(prompt_ids, jnp.int32)
  length = prompt.shape[1]
  if bucket:  # right-padded, so that prompts of similar lengths share one compilation
    prompt = jnp.pad(prompt, ((0, 0), (0, bucket_length(length) - length)))
  opts = {
    'temperature': jnp.float32(temperature),
    'top_p': jnp.float32(top_p),
    'eos_id': jnp.int32(-1 if eos_id is None else eos_id),
    'vocab': jnp.int32(model.cfg.vocab_size if vocab_size is None else vocab_size),
    'length': jnp.int32(length),
  }
  args = (graphdef, state, prompt, rng, opts)
  return args, {'max_new': max_new_tokens, 'absorb': absorb}


def bucket_length(n: int) -> int:
  """The padded length of an n-token prompt: the next power of two, at least 32."""
  return max(32, 1 << (n - 1).bit_length())


def _on_model_mesh(state) -> contextlib.AbstractContextManager:
  """jax.set_mesh of the mesh the model's weights are sharded over (load_run's), as evaluate
  runs its step: expert-parallel layers shard_map over the mesh in context, and the activations'
  sharding constraints apply only there. A model on one device (load_hf's) needs none."""
  for x in jax.tree.leaves(state):
    if isinstance(getattr(x, 'sharding', None), jax.sharding.NamedSharding):
      return jax.set_mesh(x.sharding.mesh)
  return contextlib.nullcontext()


def generate(
  model,
  prompt_ids,
  max_new_tokens,
  *,
  temperature=0.0,
  top_p=1.0,
  rng=None,
  eos_id=None,
  vocab_size=None,
  absorb=True,
):
  """Continues every row of prompt_ids [B, T] (no padding: all rows start at position 0) by
  max_new_tokens; returns ids [B, T + max_new_tokens].

  temperature 0 is greedy; otherwise top-p sampling with key `rng` (default key 0). A row that
  emits eos_id is filled with eos_id from then on, and the loop stops once all rows have.
  vocab_size: choose only ids below it (a tokenizer smaller than the model's padded vocabulary).
  absorb: decode attention in the latent space (model/decode.py). One compilation per (model,
  prompt shape, max_new_tokens, absorb); the other arguments are traced.
  """
  if max_new_tokens <= 0:
    return jnp.asarray(prompt_ids, jnp.int32)
  args, static = _args(
    model,
    prompt_ids,
    max_new_tokens,
    temperature=temperature,
    top_p=top_p,
    rng=rng,
    eos_id=eos_id,
    vocab_size=vocab_size,
    absorb=absorb,
  )
  with _on_model_mesh(args[1]):
    return _generate(*args, **static)[0]


def timed_generate(
  model, prompt_ids, max_new_tokens, compiled: dict | None = None, **kw
) -> tuple[jax.Array, dict]:
  """generate() (same keyword arguments) with compilation, ahead of time, timed apart. The ids
  are [B, P + max_new_tokens], the new ones from the prompt's length on (P >= it with bucket).
  compiled: the programs of earlier calls on this model, by shape, reused (compile_s 0, reused True)."""
  args, static = _args(model, prompt_ids, max_new_tokens, **kw)
  compiled = {} if compiled is None else compiled
  key = (args[0], args[2].shape, tuple(sorted(static.items())))
  with _on_model_mesh(args[1]):
    t0 = time.perf_counter()
    reused = key in compiled
    if not reused:
      compiled[key] = _generate.lower(*args, **static).compile()
    t1 = time.perf_counter() if not reused else t0
    ids, steps = jax.block_until_ready(compiled[key](*args[1:]))
    t2 = time.perf_counter()
  new = int(steps) * ids.shape[0]
  return ids, {
    'compile_s': t1 - t0,
    'reused': reused,
    'run_s': t2 - t1,
    'new_tokens': new,
    'tokens_per_s': new / (t2 - t1),
  }


# ---------------------------------------------------------------------------------------------
# Command line


def define_flags():
  flags.DEFINE_string(
    'hf_checkpoint', None, 'Hugging Face directory (config.json, safetensors, tokenizer.json).'
  )
  config_flags.DEFINE_config_file(
    'config', None, "Training config (default: --workdir's own).", lock_config=True
  )
  flags.DEFINE_string(
    'workdir', None, 'Run directory whose latest checkpoint to load (none: the initial weights).'
  )
  flags.DEFINE_string('prompt', '', 'Text to continue.')
  flags.DEFINE_integer('max_new_tokens', 32, 'Tokens to generate.')
  flags.DEFINE_float('temperature', 0.0, '0 = greedy.')
  flags.DEFINE_float('top_p', 1.0, 'Nucleus mass when sampling.')
  flags.DEFINE_integer('seed', 0, 'Sampling seed.')
  flags.DEFINE_bool('add_bos', True, "Prepend the tokenizer's bos token, if it has one.")
  flags.DEFINE_bool(
    'chat', False, "--prompt is a user message, rendered with the model's chat template."
  )
  flags.DEFINE_string('system', '', 'With --chat: a system message before the user message.')
  flags.DEFINE_string(
    'messages',
    '',
    'A JSONL file of conversations ({"messages": [...]} a line, ending with a '
    'user turn): each is rendered with the chat template and answered (implies --chat).',
  )
  runtime.define_process_flags()


def load_hf(path: str):

  return load_model(path, dtype=jnp.float32), load_tokenizer(path)


def load_run(config, workdir: str | None, with_data: bool = False):
  """The model of --workdir's latest checkpoint, or the config's initial weights (its
  init.hf_checkpoint, else random) when there is none; the frozen base of a LoRA run is rebuilt
  from its source, as training does. Returns (model, tokenizer, step), and the run's data
  settings (its chat template) after them if with_data."""

  setup = startup.tool_setup(config, workdir)
  # Decoded or exported by layer index: read in layer order.
  setup = dataclasses.replace(setup, model=startup.without_repeats(setup.model))
  tokenizer = loader.make_tokenizer(setup.data, workdir)
  startup.check_tokenizer_fits(tokenizer, setup)  # before the (slow) load
  mesh = setup.make_mesh()
  with jax.set_mesh(mesh):
    state = startup.load_latest(setup, workdir, mesh)
  model = merge_model(graphdef_of(setup.model), state.params, state.moe_bias, state.frozen)
  return (model, tokenizer, int(state.step)) + ((setup.data,) if with_data else ())


def main(argv):
  runtime.start_command(preemption=False)  # saves nothing: stay killable
  del argv
  f = flags.FLAGS
  if bool(f.hf_checkpoint) == (f.config is not None or f.workdir is not None):
    both = '; not both: --hf_checkpoint loads a checkpoint as is' if f.hf_checkpoint else ''
    raise app.UsageError(f'pass --hf_checkpoint=DIR, or --workdir of a run, or --config{both}')
  if f.max_new_tokens < 1:
    raise app.UsageError(f'--max_new_tokens={f.max_new_tokens} must be at least 1')
  check_sampling(f.temperature, f.top_p)
  conversations = chat_inputs(f.prompt, f.system, f.messages) if f.chat or f.messages else None
  if f.hf_checkpoint:
    (model, tok), data = load_hf(f.hf_checkpoint), loader.DataConfig()
    source = f.hf_checkpoint
  else:
    model, tok, step, data = load_run(f.config, f.workdir, with_data=True)
    source = f'{f.workdir or "initial weights"} at step {step}'
  if conversations is None:
    prompts = [(f.prompt, prompt_ids(tok, f.prompt, f.add_bos))]
  else:
    fmt = loader.chat_format(data, tok)
    texts = [fmt.prompt(c) for c in conversations]  # the builtin template's bos: the packer's
    prompts = [(t, prompt_ids(tok, t, f.add_bos and fmt.builtin)) for t in texts]
  if runtime.is_primary():
    print(f'# {source}')
    if conversations is not None and not f.hf_checkpoint and (note := chat_note(data)):
      print(note)
  compiled = {}  # one program per padded prompt length (bucket_length)
  for text, ids in prompts:
    answer(model, tok, text, ids, f, compiled)


def chat_inputs(prompt: str, system: str, path: str) -> list[list[dict]]:
  """The conversations to answer: --messages' JSONL lines, or --prompt as a user message (after
  --system's)."""
  if not path:
    if not prompt:
      raise app.UsageError('--chat needs --prompt (the user message) or --messages=FILE.jsonl')
    return [
      [{'role': 'system', 'content': system}] * bool(system) + [{'role': 'user', 'content': prompt}]
    ]
  out = []
  for i, line in enumerate(storage.read_text(path).splitlines(), 1):
    if line.strip():
      try:
        messages = json.loads(line)['messages']
      except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
          f'--messages={path}, line {i}: not a {{"messages": [...]}} record ({e})'
        ) from None
      out.append(messages)
  if not out:
    raise ValueError(f'--messages={path} holds no conversation')
  return out


def chat_note(data: loader.DataConfig, sample: int = 64) -> str:
  """A line for --chat on a run whose training data held no chats (the first `sample` records
  of the train split of a JSONL or demo source; a text source holds none): it was never shown
  the chat template's turns. '' when it held some, or when that cannot be told."""
  if data.records != 'examples' or data.source not in ('demo', 'jsonl', 'text'):
    return ''
  try:
    if data.source == 'text' or not data.messages_key:
      chats = False
    else:
      paths = (
        [str(demo_task.DEMO_DIR / f'{data.train_split}.jsonl')]
        if data.source == 'demo'
        else sources.expand_paths(data.path, data.train_split)
      )
      chats = any(data.messages_key in record for record in first_records(paths, sample))
  except (OSError, ValueError):  # the data is not on this host: nothing to say
    return ''
  if chats:
    return ''
  where = 'the demo task' if data.source == 'demo' else f'data.path={data.path!r}'
  return (
    f"# note: this run's training data ({where}) holds no chats: the model was not taught to "
    'answer the chat template; expect a continuation of the rendered text, not a reply'
  )


def first_records(paths: list[str], n: int):
  """The JSON objects of the first n non-blank lines of the files, in order."""
  for path in paths:
    with open(path, 'rb') as f:
      for raw in f:
        if raw.strip():
          record = json.loads(raw)
          yield record if isinstance(record, dict) else {}
          n -= 1
          if n == 0:
            return


def answer(model, tok, text: str, ids: list[int], f, compiled: dict | None = None) -> None:
  """Generates from one prompt and prints it with its continuation (on process 0). compiled:
  the programs of earlier prompts, which one of the same padded length reuses."""
  out, stats = timed_generate(
    model,
    [ids],
    f.max_new_tokens,
    compiled,
    temperature=f.temperature,
    top_p=f.top_p,
    rng=jax.random.key(f.seed),
    eos_id=tok.eos_id,
    vocab_size=tok.vocab_size,
    bucket=True,
  )
  # to_host on every process: a collective
  new = new_tokens(to_host(out), len(ids), tok.eos_id, f.max_new_tokens)
  if not runtime.is_primary():
    return
  print(text + continuation(tok, ids, new))
  ended = ' and eos' if stats['new_tokens'] > len(new) else ''  # the rate counts eos too
  compiled_text = (
    f'compile {stats["compile_s"]:.1f} s' if not stats['reused'] else 'compiled before'
  )
  print(
    f'# {len(new)} new tokens{ended}; {compiled_text}; prefill + decode '
    f'{stats["run_s"]:.3f} s = {stats["tokens_per_s"]:.1f} tokens/s'
  )


def prompt_ids(tok, prompt: str, add_bos: bool) -> list[int]:
  """The prompt's tokens, after the tokenizer's bos token if add_bos and it has one."""
  ids = tok.encode(prompt)
  if add_bos and tok.bos_id is not None:
    ids = [tok.bos_id, *ids]
  if not ids:
    why = 'the tokenizer has no bos token' if add_bos else '--add_bos=false'
    raise app.UsageError(f'the prompt is empty and nothing precedes it ({why})')
  return ids


def check_sampling(temperature: float, top_p: float) -> None:
  """The sampling flags. An infinite temperature would divide -inf logits (ids past the
  tokenizer) into NaNs and draw id 0 every time; a NaN one would run greedy."""
  if not 0 <= temperature < float('inf'):
    raise app.UsageError(f'--temperature={temperature} must be finite and >= 0 (0 = greedy)')
  if not 0 < top_p <= 1:
    raise app.UsageError(f'--top_p={top_p} must be in (0, 1]')


def new_tokens(
  ids_BS, prompt_len: int, eos_id: int | None, max_new: int | None = None
) -> list[int]:
  """Row 0's generated ids (host array), up to the first eos_id (and max_new of them: a padded
  prompt's ids hold more slots)."""
  new = [int(i) for i in ids_BS[0, prompt_len:][:max_new]]
  return new[: new.index(eos_id)] if eos_id in new else new


def continuation(tok, prompt_ids, new_ids) -> str:
  """The text the new tokens add to the prompt's (decoding them alone can drop a leading space)."""
  before, after = tok.decode(prompt_ids), tok.decode([*prompt_ids, *new_ids])
  return after[len(before) :] if after.startswith(before) else tok.decode(new_ids)


if __name__ == '__main__':
  define_flags()
  app.run(runtime.short_errors(main), flags_parser=runtime.parse_flags)
