"""DeepSeek Sparse Attention (model/indexer.py): the indexer's top-k against NumPy, the dense MLA
where the selection keeps every token, packed rows, and the cached decode's selection; the
transformers parity is tests/test_families.py's (deepseek_v32_three_layer,
glm_moe_dsa_three_layer)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moetrain.convert import hf
from moetrain.model import decode
from moetrain.model.indexer import Indexer
from moetrain.training import train_state
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
