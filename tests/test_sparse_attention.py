"""DeepSeek Sparse Attention (model/indexer.py): the indexer's top-k against NumPy, the dense MLA
where the selection keeps every token, packed rows, the cached decode's selection, and the
indexer's KL loss (NumPy, what it trains, off by default); the transformers parity is
tests/test_families.py's (deepseek_v32_three_layer, glm_moe_dsa_three_layer)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moetrain.convert import hf
from moetrain.core.engine import LoraConfig
from moetrain.model import decode
from moetrain.model.attention import head_mean_probs
from moetrain.model.indexer import Indexer, kl_loss
from moetrain.run import sections, startup
from moetrain.training import train_state
from moetrain.training.train_step import StepConfig, loss_fn, token_counts
from tests.helpers import max_err

FIXTURE = os.path.join(os.path.dirname(__file__), 'fixtures', 'deepseek_v32_three_layer')


def fixture_model(**kw):
  """The deepseek_v32 fixture (rows of 12, index_topk 4) in float32, with `kw` changed."""
  cfg = hf.config_from_hf(
    hf.read_config(FIXTURE), dtype='float32', param_dtype='float32', remat='none', **kw
  )
  loaded = hf.load_params(FIXTURE, cfg)
  model = train_state.merge_model(
    train_state.graphdef_of(cfg), loaded.params, loaded.moe_bias, loaded.frozen
  )
  return model, cfg


def ids():
  return np.load(os.path.join(FIXTURE, 'reference.npz'))['input_ids']


def forward(model, ids_BT, positions_BT=None, segment_ids_BT=None):
  run = jax.jit(lambda m, x, p, s: m(x, p, s)[0])
  return np.asarray(run(model, jnp.asarray(ids_BT), positions_BT, segment_ids_BT))


def numpy_rope(x, pos, theta, interleaved):
  """RoPE over the last dimension of x [B, T, N, R] at positions pos [B, T]."""
  r = x.shape[-1]
  ang = pos[..., None, None] * theta ** (-np.arange(0, r, 2) / r)  # [B, T, 1, R/2]
  cos, sin = np.cos(ang), np.sin(ang)
  if interleaved:
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return np.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1).reshape(x.shape)
  x0, x1 = x[..., : r // 2], x[..., r // 2 :]
  return np.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1)


def numpy_selection(p, x, qr, pos, allowed, cfg):
  """The indexer's kept keys [B, T, S], written out: scores, then each query's k best."""
  r, h, n = cfg.qk_rope_head_dim, cfg.index_head_dim, cfg.index_n_heads
  b, t, _ = x.shape

  def rotate(v):
    return np.concatenate(
      [numpy_rope(v[..., :r], pos, cfg.rope_theta, cfg.index_rope_interleaved), v[..., r:]], -1
    )

  q = rotate((qr @ p['wq_b'].reshape(qr.shape[-1], -1)).reshape(b, t, n, h))
  k = x @ p['wk']
  k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
  k = rotate((k * p['scale'] + p['bias'])[:, :, None])[:, :, 0]
  w = (x @ p['weights_proj']) / np.sqrt(n)
  score = np.einsum('btn,btns->bts', w, np.maximum(np.einsum('btnh,bsh->btns', q, k), 0) / h**0.5)
  keep = np.zeros_like(allowed)
  for i in np.ndindex(b, t):
    seen = np.flatnonzero(allowed[i])
    best = seen[np.argsort(-score[i][seen], kind='stable')[: cfg.index_topk]]
    keep[i][best] = True
    if len(seen) > cfg.index_topk:  # no near-tie at the boundary: the test means something
      s = np.sort(score[i][seen])[::-1]
      assert s[cfg.index_topk - 1] - s[cfg.index_topk] > 1e-5
  return keep


@pytest.mark.parametrize('interleaved', [False, True])
def test_indexer_top_k_equals_numpy(interleaved):
  """Random weights and inputs, two packed segments per row: the kept keys equal NumPy's."""
  _, cfg = fixture_model()
  cfg = dataclasses.replace(
    cfg, index_n_heads=8, index_rope_interleaved=interleaved, yarn_factor=0.0
  )  # plain RoPE: numpy_rope's
  indexer = Indexer(cfg, 'layers.attn.indexer', nnx.Rngs(3))
  rng = np.random.default_rng(0)
  b, t = 2, 14
  x = rng.standard_normal((b, t, cfg.hidden_size)).astype(np.float32)
  qr = rng.standard_normal((b, t, cfg.q_lora_rank)).astype(np.float32)
  seg = np.repeat(np.array([[1] * 9 + [2] * 5]), b, 0)
  pos = np.where(seg == 1, np.arange(t), np.arange(t) - 9).astype(np.int32)
  allowed = (seg[:, :, None] == seg[:, None, :]) & (np.arange(t)[None, :] <= np.arange(t)[:, None])
  p = {n: np.asarray(getattr(indexer, n).kernel[...]) for n in ('wq_b', 'wk', 'weights_proj')}
  p.update(scale=np.asarray(indexer.k_norm.scale[...]), bias=np.asarray(indexer.k_norm.bias[...]))
  p['scale'] = p['scale'] + rng.standard_normal(p['scale'].shape).astype(np.float32) * 0.1
  p['bias'] = rng.standard_normal(p['bias'].shape).astype(np.float32) * 0.1
  indexer.k_norm.scale.set_value(jnp.asarray(p['scale']))
  indexer.k_norm.bias.set_value(jnp.asarray(p['bias']))
  got = indexer(*map(jnp.asarray, (x, qr, pos, allowed)))
  want = numpy_selection(p, x, qr, pos, allowed, cfg)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert want.sum(-1).max() == cfg.index_topk and (want <= allowed).all()


def test_index_topk_covering_the_row_is_dense_mla():
  """With index_topk >= the row every query keeps all it sees: the logits are dense MLA's,
  exactly; with the fixture's 4 of 12 they are not. With 11 of 12, the first 11 positions keep
  everything and equal dense MLA too."""
  x = ids()
  dense, _ = fixture_model(index_n_heads=0)
  want = forward(dense, x)
  full, _ = fixture_model(index_topk=x.shape[1])
  np.testing.assert_array_equal(forward(full, x), want)
  sparse, _ = fixture_model()
  assert max_err(forward(sparse, x), want) > 1e-2
  nearly, _ = fixture_model(index_topk=x.shape[1] - 1)
  got = forward(nearly, x)
  np.testing.assert_allclose(got[:, :-1], want[:, :-1], rtol=0, atol=1e-6)
  assert max_err(got[:, -1], want[:, -1]) > 1e-4


def test_packed_rows_select_within_their_segment():
  """Two examples packed in one row (positions restarting, segment ids 1 and 2) give each
  example's logits alone: the indexer never keeps a key of the other segment."""
  model, _ = fixture_model()
  x = ids()
  alone = forward(model, x)
  row = np.concatenate([x[0], x[1]])[None]
  pos = jnp.asarray(np.concatenate([np.arange(12), np.arange(12)])[None], jnp.int32)
  seg = jnp.asarray(np.repeat([1, 2], 12)[None], jnp.int32)
  packed = forward(model, row, pos, seg)[0]
  assert max_err(packed, np.concatenate([alone[0], alone[1]])) < 1e-5


def test_cached_decode_keeps_the_indexers_choice():
  """Decoding token by token from the cache (the indexer's keys cached) gives the full
  forward's logits at every position past index_topk, absorbed or not."""
  model, _ = fixture_model()
  x = jnp.asarray(ids())
  full = forward(model, x)
  logits, cache = decode.prefill(model, x[:, :6], 12)
  np.testing.assert_allclose(logits, full[:, 5], atol=1e-5, rtol=1e-5)
  for pos in range(6, 11):
    logits, cache = decode.decode_step(model, cache, x[:, pos], pos, absorb=pos % 2 == 0)
    np.testing.assert_allclose(logits, full[:, pos], atol=1e-5, rtol=1e-5)


def test_glm5_layers_sharing_an_earlier_selection_are_refused():
  """transformers' "shared" indexer layers (reusing the previous layer's top-k) are not built:
  the import names the layers."""
  c = hf.read_config(FIXTURE)
  c = {**c, 'model_type': 'glm_moe_dsa', 'n_group': 1, 'topk_group': 1}
  assert hf.config_from_hf({**c, 'indexer_types': ['full'] * 3}).index_rope_interleaved
  with pytest.raises(ValueError, match=r'layers \[1\] reuse'):
    hf.config_from_hf({**c, 'indexer_types': ['full', 'shared', 'full']})


def numpy_kl(q, k, score, keep, valid, scale):
  """indexer.kl_loss of head_mean_probs, written out in float64: each head's softmax over the
  kept keys, their mean over heads, and KL(p || softmax(score over the kept keys)) summed over
  the valid queries."""
  s = np.where(keep[:, None], np.einsum('btnh,bsnh->bnts', q, k) * scale, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p = (p / p.sum(-1, keepdims=True)).mean(1)
  z = np.where(keep, score, -np.inf)
  logq = z - z.max(-1, keepdims=True)
  logq = np.where(keep, logq - np.log(np.exp(logq).sum(-1, keepdims=True)), 0)
  terms = np.where(keep & (p > 0), p * (np.log(np.where(p > 0, p, 1)) - logq), 0)
  return (terms.sum(-1) * valid).sum()


def test_indexer_kl_equals_numpy():
  """Random heads and indexer scores over two packed segments and padding, each query keeping
  its 4 best keys: the KL equals the float64 reference, by blocks of 4 queries or whole."""
  rng = np.random.default_rng(1)
  b, t, n, h, scale = 2, 14, 3, 8, 0.3
  q, k = (rng.standard_normal((b, t, n, h)).astype(np.float32) for _ in range(2))
  score = rng.standard_normal((b, t, t)).astype(np.float32) * 2
  seg = np.repeat(np.array([[1] * 8 + [2] * 4 + [0] * 2]), b, 0)
  causal = np.arange(t)[None, :] <= np.arange(t)[:, None]
  allowed = (seg[:, :, None] == seg[:, None, :]) & causal
  keep = np.zeros_like(allowed)
  for i in np.ndindex(b, t):
    seen = np.flatnonzero(allowed[i])
    keep[i][seen[np.argsort(-score[i][seen])[:4]]] = True
  want = numpy_kl(*(x.astype(np.float64) for x in (q, k, score)), keep, seg > 0, scale)
  for chunk in (4, 0):
    p = head_mean_probs(jnp.asarray(q), jnp.asarray(k), jnp.asarray(keep), scale, chunk)
    np.testing.assert_allclose(np.asarray(p).sum(-1), 1, rtol=1e-6)
    got = kl_loss(p, jnp.asarray(score), jnp.asarray(keep), jnp.asarray(seg > 0))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
  assert want > 0.1


def step_grads(model, cfg, weight: float):
  """(loss, stats, gradients) of loss_fn on the fixture's ids with loss.indexer_kl = weight."""
  x = ids()
  batch = {
    'inputs': x,
    'targets': np.roll(x, -1, axis=1),
    'loss_mask': np.ones(x.shape, np.float32),
    'positions': np.broadcast_to(np.arange(x.shape[1], dtype=np.int32), x.shape),
    'segment_ids': np.ones(x.shape, np.int32),
  }
  graphdef, params, moe_bias, frozen = train_state.split_model(model, cfg)
  step = StepConfig(model=cfg, indexer_kl=weight)
  step.validate()
  args = (moe_bias, frozen, graphdef, batch, None, token_counts(batch), step)
  grad = jax.value_and_grad(lambda p: loss_fn(p, *args), has_aux=True)
  (loss, stats), grads = jax.jit(grad)(params)
  return float(loss), stats, dict(nnx.to_flat_state(grads))


@pytest.mark.parametrize('topk', [4, 12])  # the selected top-k; every key (the row's 12)
def test_indexer_kl_trains_the_indexer_alone(topk):
  """loss.indexer_kl > 0 adds its weight times the KL to the loss and gives every indexer
  weight a gradient; every other gradient and the LM loss are those with it off, where the
  indexer gets none."""
  off_model, off_cfg = fixture_model(index_topk=topk)
  on_model, on_cfg = fixture_model(index_topk=topk, train_indexer=True)
  loss_off, stats_off, g_off = step_grads(off_model, off_cfg, 0.0)
  loss_on, stats_on, g_on = step_grads(on_model, on_cfg, 0.5)
  kl = float(stats_on['indexer_kl'])
  assert kl > 1e-3 and float(stats_off['indexer_kl']) == 0
  np.testing.assert_allclose(loss_on, loss_off + 0.5 * kl, rtol=1e-6)
  assert float(stats_on['nll_sum']) == float(stats_off['nll_sum'])
  indexer = [path for path in g_on if 'indexer' in path]
  assert len(indexer) == 10  # wq_b, wk, k_norm scale and bias, weights_proj; dense and MoE
  for path in g_on:
    if path in indexer:
      assert not np.any(np.asarray(g_off[path][...])), path
      # every layer's share of each weight
      layers = np.asarray(g_on[path][...]).reshape(len(g_on[path][...]), -1)
      assert np.all(np.abs(layers).max(-1) > 0), path
    else:
      np.testing.assert_allclose(g_on[path][...], g_off[path][...], rtol=0, atol=1e-7)


def test_indexer_kl_is_off_by_default_and_refused_where_it_cannot_train():
  """The default config trains no indexer; loss.indexer_kl asks for a model with one, outside
  LoRA (which keeps it frozen), and sets the model's train_indexer."""
  config = sections.default_config()
  assert config.loss.indexer_kl == 0 and not startup.model_config(config).train_indexer
  config.loss.indexer_kl = 0.1
  assert startup.model_config(config).train_indexer
  _, cfg = fixture_model(train_indexer=True)
  with pytest.raises(ValueError, match='no sparse attention indexer'):
    StepConfig(model=dataclasses.replace(cfg, index_n_heads=0), indexer_kl=0.1).validate()
  with pytest.raises(ValueError, match='full fine-tuning'):
    StepConfig(model=dataclasses.replace(cfg, lora=LoraConfig(rank=4)), indexer_kl=0.1).validate()
  with pytest.raises(ValueError, match='train_indexer=True'):
    StepConfig(model=cfg).validate()


def test_each_blocks_selection_made_in_the_loop_equals_the_whole_mask():
  """With the indexer frozen and rows in even blocks of queries, each block's top-k is made
  inside the attention's loop (no [T, S] score or mask): logits and gradients equal the
  whole-mask path's (one block), on packed rows."""
  row = np.concatenate([ids()[0], ids()[1]])[None]
  pos = jnp.asarray(np.concatenate([np.arange(12), np.arange(12)])[None], jnp.int32)
  seg = jnp.asarray(np.repeat([1, 2], 12)[None], jnp.int32)
  got = {}
  for chunk in (4, 0):
    model, _ = fixture_model(attention_chunk=chunk)

    def loss(m):
      logits = m(jnp.asarray(row), pos, seg)[0]
      return jnp.mean(jnp.square(logits)), logits

    grads, logits = jax.jit(nnx.grad(loss, has_aux=True))(model)
    got[chunk] = np.asarray(logits), [np.asarray(g) for g in jax.tree.leaves(grads)]
  (blocked, g_blocked), (whole, g_whole) = got[4], got[0]
  np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-5)
  assert len(g_blocked) == len(g_whole)
  for a, b in zip(g_blocked, g_whole):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
