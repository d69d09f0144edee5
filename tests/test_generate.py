"""Generation: cached decoding equals the full forward, the cache is latent-sized, greedy output
equals Hugging Face's on the fixture, and sampling is reproducible."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moetrain.core import sharding
from moetrain.model import decode
from moetrain.model.transformer import Transformer
from moetrain.tools.generate import generate, sample_top_p
from tests.helpers import (
  forward,
  model_and_ids,
  nonzero_bias,
  randomize,
  run_command,
  tiny,
  with_lora,
)

FIXTURE = os.path.join(os.path.dirname(__file__), 'fixtures', 'longcat_two_layer')


@functools.partial(jax.jit, static_argnames=('graphdef', 'max_len'))
def _prefill(graphdef, state, ids_BT, max_len):
  return decode.prefill(nnx.merge(graphdef, state), ids_BT, max_len)


@functools.partial(jax.jit, static_argnames=('graphdef', 'absorb'))
def _step(graphdef, state, cache, token_B, pos, absorb):
  return decode.decode_step(nnx.merge(graphdef, state), cache, token_B, pos, absorb=absorb)


@pytest.fixture(scope='module')
def lora_model():
  """LoRA everywhere with nonzero B and a nonzero router bias, so every path is exercised. The
  adapters are perturbed by 0.1, not helpers' 0.2: at 0.2 the float32 full forward and the cached
  decode each sit up to 1e-5 from a float64 run (2.6e-5 apart), so rounding alone breaks 1e-5."""
  model, ids = model_and_ids(with_lora(tiny()), t=9)
  randomize(model, 3, nnx.LoRAParam, scale=0.1)
  nonzero_bias(model)
  return model, ids


def test_incremental_decode_equals_full_forward(lora_model):
  model, ids = lora_model
  graphdef, state = nnx.split(model)
  full, _ = forward(model, ids)
  t = ids.shape[1]
  logits, cache0 = _prefill(graphdef, state, ids[:, :3], t)
  np.testing.assert_allclose(logits, full[:, 2], atol=1e-5, rtol=1e-5)
  by_variant = {}
  for absorb in (False, True):
    cache, steps = cache0, []
    for pos in range(3, t):
      logits, cache = _step(graphdef, state, cache, ids[:, pos], pos, absorb)
      steps.append(logits)
    by_variant[absorb] = np.stack(steps, 1)
    np.testing.assert_allclose(by_variant[absorb], full[:, 3:], atol=1e-5, rtol=1e-5)
  # The absorbed (latent-space) attention equals expanding the latents with kv_b.
  np.testing.assert_allclose(by_variant[True], by_variant[False], atol=1e-5, rtol=1e-5)


def test_a_model_laid_out_for_expert_parallelism_generates_as_on_one_device(lora_model):
  """A model laid out for a mesh with its experts over 4 shards and its weights on that mesh (as
  load_run gives it) decodes in its weights' mesh, its few tokens a step (fewer than the 8 batch
  shards) padded for the experts' exchange: the greedy ids of the model on one device."""
  model, ids = lora_model
  mesh = sharding.make_mesh((1, 2, 4, 1))
  cfg = model.cfg.with_engine(rules=sharding.Rules.preset('fsdp_ep_tp'))
  graphdef = nnx.graphdef(
    nnx.eval_shape(lambda: Transformer(cfg.laid_out('cpu', mesh), nnx.Rngs(0)))
  )
  state = jax.device_put(nnx.state(model), sharding.replicated(mesh))
  laid_out = nnx.merge(graphdef, state)
  assert laid_out.cfg.engine.expert_shards == 4
  np.testing.assert_array_equal(generate(laid_out, ids[:1, :5], 4), generate(model, ids[:1, :5], 4))


def test_cache_holds_latents_not_heads(lora_model):
  model, ids = lora_model
  cfg = model.cfg
  _, cache = _prefill(*nnx.split(model), ids[:, :3], 9)
  lead = (cfg.num_layers, 2, ids.shape[0], 9)
  assert len(jax.tree.leaves(cache)) == 2
  assert cache.arrays['c'].shape == (*lead, cfg.kv_lora_rank)
  assert cache.arrays['k_pe'].shape == (*lead, cfg.qk_rope_head_dim)
  assert cache.arrays['c'].dtype == jnp.float32
  # Prompt slots are written, the rest still empty.
  assert np.all(np.abs(cache.arrays['c'][:, :, :, :3]).sum(-1) > 0) and np.all(
    cache.arrays['c'][:, :, :, 3:] == 0
  )
  # Positions past the cache are refused by name (the write would clamp onto the last slot).
  from moetrain.model import decode

  with pytest.raises(ValueError, match=r'positions 9\.\.9 do not fit a cache of max_len=9'):
    decode.decode_step(model, cache, ids[:, 0], 9)
  with pytest.raises(ValueError, match='positions 0..3 do not fit a cache of max_len=3'):
    decode.prefill(model, ids[:, :4], 3)


@pytest.fixture(scope='module')
def hf():
  """The HF fixture model and both rows' 5-token prompts. Every generate() call below has the
  same shapes, so they share one compilation; rows are independent, so row 0 is HF's prompt."""
  from moetrain.convert.hf import load_model

  ref = np.load(os.path.join(FIXTURE, 'reference.npz'))
  return load_model(FIXTURE, dtype=jnp.float32), ref['input_ids'][:, :5], ref['greedy_ids']


def test_greedy_matches_hf_generate(hf):
  model, prompt, want = hf  # transformers' greedy generate of prompt[:1], 8 new tokens
  out = generate(model, prompt, 8, eos_id=2)
  np.testing.assert_array_equal(out[:1], want)


def test_prompts_of_one_padded_length_share_one_compilation_and_decode_as_unpadded(hf):
  """The command line pads each prompt to bucket_length, so that conversations of similar
  lengths reuse one program; the new tokens are those of the unpadded prompt."""
  from moetrain.tools.generate import bucket_length, new_tokens, timed_generate

  model, prompt, want = hf
  assert bucket_length(5) == bucket_length(3) == 32 and bucket_length(33) == 64
  compiled = {}
  out, stats = timed_generate(model, prompt[:1], 8, compiled, eos_id=2, bucket=True)
  assert out.shape == (1, 32 + 8) and not stats['reused']
  np.testing.assert_array_equal(np.asarray(out)[:, :13], want)  # transformers' greedy ids
  out, stats = timed_generate(model, prompt[:1, :4], 8, compiled, eos_id=2, bucket=True)
  assert stats['reused'] and stats['compile_s'] == 0 and len(compiled) == 1
  unpadded = np.asarray(generate(model, prompt[:1, :4], 8, eos_id=2))
  assert new_tokens(np.asarray(out), 4, 2, 8) == new_tokens(unpadded, 4, 2)


def test_top_p_zero_is_greedy_and_sampling_is_seeded(hf):
  model, prompt, _ = hf
  greedy = generate(model, prompt, 8)
  nucleus = generate(model, prompt, 8, temperature=1.0, top_p=1e-9, rng=jax.random.key(5))
  np.testing.assert_array_equal(nucleus, greedy)
  sample = functools.partial(generate, model, prompt, 8, temperature=1.0, top_p=0.9)
  a, b = sample(rng=jax.random.key(1)), sample(rng=jax.random.key(1))
  np.testing.assert_array_equal(a, b)
  assert np.any(a != greedy) and np.any(a != sample(rng=jax.random.key(2)))


def test_rows_stop_at_eos(hf):
  model, prompt, _ = hf
  greedy = np.asarray(generate(model, prompt, 8))
  eos = int(greedy[0, 7])  # row 0's third new token
  out = np.asarray(generate(model, prompt, 8, eos_id=eos))
  for r in range(2):
    j = next((j for j in range(5, 13) if greedy[r, j] == eos), 13)
    np.testing.assert_array_equal(out[r, :j], greedy[r, :j])
    assert np.all(out[r, j:] == eos)


def test_vocab_size_limits_choices(hf):
  model, prompt, _ = hf
  out = np.asarray(generate(model, prompt, 8, temperature=1.0, vocab_size=10))
  assert np.all(out[:, 5:] < 10)


def test_top_p_keeps_the_nucleus_only():
  probs = jnp.array([0.5, 0.3, 0.15, 0.05])
  logits_BV = jnp.broadcast_to(jnp.log(probs), (4000, 4))
  draws = np.asarray(sample_top_p(logits_BV, jax.random.key(0), 1.0, 0.6))
  assert set(np.unique(draws)) == {0, 1}  # 0.5 < 0.6 of mass before token 1, 0.8 before token 2
  np.testing.assert_allclose((draws == 0).mean(), 0.5 / 0.8, atol=0.03)


def test_sampling_flags_are_checked():
  from absl import app

  from moetrain.tools.generate import check_sampling

  check_sampling(0.0, 1.0)
  check_sampling(0.7, 0.9)
  for temperature, top_p in ((-1.0, 1.0), (float('inf'), 1.0), (float('nan'), 1.0)):
    with pytest.raises(app.UsageError, match='--temperature=.* must be finite and >= 0'):
      check_sampling(temperature, top_p)
  for top_p in (0.0, 1.5, float('nan')):
    with pytest.raises(app.UsageError, match=r'--top_p=.* must be in \(0, 1\]'):
      check_sampling(1.0, top_p)


def test_prompt_ids_and_the_empty_prompt():
  from types import SimpleNamespace

  from absl import app

  from moetrain.tools.generate import prompt_ids

  tok = SimpleNamespace(encode=lambda text: [5] * len(text), bos_id=1)
  assert prompt_ids(tok, 'ab', True) == [1, 5, 5] and prompt_ids(tok, 'ab', False) == [5, 5]
  assert prompt_ids(tok, '', True) == [1]
  with pytest.raises(app.UsageError, match=r'empty and nothing precedes it \(--add_bos=false\)'):
    prompt_ids(tok, '', False)
  tok.bos_id = None
  with pytest.raises(app.UsageError, match=r'\(the tokenizer has no bos token\)'):
    prompt_ids(tok, '', True)


def test_prefill_attends_in_causal_blocks():
  """A prefill scores its prompt in blocks of engine.attention_chunk queries, as the full forward
  does, not as one [T, T] square: the same logits, and no more temporaries than the forward."""
  cfg = tiny(attention_chunk=4)
  model, ids = model_and_ids(cfg, t=11)
  randomize(model, 3)
  full, _ = forward(model, ids)
  logits, _ = _prefill(*nnx.split(model), ids, 11)
  np.testing.assert_allclose(logits, full[:, -1], atol=1e-5, rtol=1e-5)

  cfg = tiny(attention_chunk=64, num_heads=8)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
  ids = jax.ShapeDtypeStruct((1, 1024), jnp.int32)

  def temp_bytes(fn):
    compiled = jax.jit(fn, static_argnums=0).lower(graphdef, state, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  prefill = temp_bytes(lambda g, s, x: decode.prefill(nnx.merge(g, s), x, 1024))
  full = temp_bytes(lambda g, s, x: nnx.merge(g, s).features(x)[0][:, -1])
  assert prefill <= 1.1 * full, (prefill, full)


def test_hf_checkpoint_with_a_run_is_refused_as_both():
  """--hf_checkpoint together with --workdir/--config: the error says not both (it read as if
  neither had been given)."""
  out = run_command('moetrain.tools.generate', '--hf_checkpoint=ckpt', '--workdir=run')
  assert out.returncode != 0
  assert 'not both' in out.stderr, out.stderr
