"""Gated DeltaNet, the linear-attention layer of Qwen3-Next's hybrid stacks (layer_types
'linear_attention'): per token a projection to queries, keys and values (key heads, and value
heads that share them) with an output gate z and the delta rule's beta and decay inputs; a short
causal depthwise convolution (kernel linear_conv_kernel_dim) and SiLU over the queries, keys and
values; L2-normalised queries and keys; the gated delta rule (kernels/delta_rule.py, chunked in
training; on TPU tokamax's Pallas kernel, kernels/delta_rule_tokamax.py); an RMSNorm per value
head gated by SiLU(z); the output projection. Packed rows: the convolution and the rule's state
both stop at segment starts."""

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.kernels import delta_rule, delta_rule_tokamax
from moetrain.model.config import ModelConfig
from moetrain.model.layers import Linear, RMSNorm, dtype_of


class GatedDeltaNet(nnx.Module):
  def __init__(self, cfg: ModelConfig, path: str, rngs: nnx.Rngs):
    self.cfg = cfg
    d = cfg.hidden_size
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if cfg.linear_split_projections:  # Qwen3.5: q k v of all heads [q | k | v], z, b, a apart
      self.in_qkv = Linear('BTD,DO->BTO', (d, 2 * nk * dk + nv * dv), cfg, f'{path}.in_qkv', rngs)
      self.in_z = Linear('BTD,DO->BTO', (d, nv * dv), cfg, f'{path}.in_z', rngs)
      self.in_b = Linear('BTD,DO->BTO', (d, nv), cfg, f'{path}.in_b', rngs)
      self.in_a = Linear('BTD,DO->BTO', (d, nv), cfg, f'{path}.in_a', rngs)
    else:  # Qwen3-Next's rows: per key head [q dk | k dk | v r*dv | z r*dv] (r = nv / nk), [b | a]
      shape = (d, 2 * nk * dk + 2 * nv * dv)
      self.in_qkvz = Linear('BTD,DO->BTO', shape, cfg, f'{path}.in_qkvz', rngs)
      self.in_ba = Linear('BTD,DO->BTO', (d, 2 * nv), cfg, f'{path}.in_ba', rngs)
    pdt = dtype_of(cfg.engine.param_dtype)
    channels = 2 * nk * dk + nv * dv
    # [channels, 1, kernel], as transformers' depthwise Conv1d stores it.
    shape = (channels, 1, cfg.linear_conv_kernel_dim)
    std = cfg.linear_conv_kernel_dim**-0.5
    self.conv = nnx.Param(
      (std * jax.random.normal(rngs.params(), shape)).astype(pdt), axes=(None, None, None)
    )
    self.dt_bias = nnx.Param(jnp.ones((nv,), jnp.float32), axes=(None,))
    a = jax.random.uniform(rngs.params(), (nv,), minval=1.0, maxval=16.0)
    self.A_log = nnx.Param(jnp.log(a).astype(jnp.float32), axes=(None,))
    self.norm = RMSNorm(dv, 'H', cfg.rms_norm_eps, cfg, plain=True)
    self.out = Linear('BTO,OD->BTD', (nv * dv, d), cfg, f'{path}.out', rngs)

  def inputs(self, x_BTD, rng=None):
    """(q k v channels [B, T, C] before the convolution, z [B, T, Nv, Dv], beta and the log
    decay g [B, T, Nv]) from the projections."""
    cfg = self.cfg
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    b, t = x_BTD.shape[:2]
    if cfg.linear_split_projections:
      z = self.in_z(x_BTD, rng).reshape(b, t, nv, dv)
      beta = jax.nn.sigmoid(self.in_b(x_BTD, rng).astype(jnp.float32))
      a = self.in_a(x_BTD, rng).astype(jnp.float32)
      return self.in_qkv(x_BTD, rng), z, beta, self.decay(a)
    qkvz = self.in_qkvz(x_BTD, rng).reshape(b, t, nk, 2 * dk + 2 * r * dv)
    q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
    ba = self.in_ba(x_BTD, rng).reshape(b, t, nk, 2 * r)
    beta = jax.nn.sigmoid(ba[..., :r].reshape(b, t, nv).astype(jnp.float32))
    a = ba[..., r:].reshape(b, t, nv).astype(jnp.float32)
    qkv = jnp.concatenate([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], -1)
    return qkv, z.reshape(b, t, nv, dv), beta, self.decay(a)

  def decay(self, a_BTN):
    """The delta rule's log decay g = -exp(A_log) softplus(a + dt_bias), float32."""
    bias = self.dt_bias[...][None, None]
    return -jnp.exp(self.A_log[...])[None, None] * jax.nn.softplus(a_BTN + bias)

  def convolve(self, qkv_BTC, segment_ids_BT, past_BKC=None, keep_all=False):
    """(SiLU of the causal depthwise convolution over time, within each segment; the inputs
    with the past's before them [B, kernel - 1 + T, C] with keep_all, else their last kernel -
    1); past_BKC: the kernel - 1 inputs before position 0 (decoding), else zeros."""
    w_CK = self.conv[...][:, 0, :].astype(jnp.float32)
    kern = w_CK.shape[1]
    x = qkv_BTC.astype(jnp.float32)
    t = x.shape[1]
    if past_BKC is None:
      past_BKC = jnp.zeros((x.shape[0], kern - 1, x.shape[2]), jnp.float32)
    full = jnp.concatenate([past_BKC.astype(jnp.float32), x], axis=1)
    seg = jnp.pad(segment_ids_BT, [(0, 0), (kern - 1, 0)], mode='edge')
    out = jnp.zeros_like(x)
    for j in range(kern):  # tap j reads position t - (kern - 1 - j)
      same = (seg[:, j : j + t] == segment_ids_BT)[..., None]
      out = out + jnp.where(same, full[:, j : j + t], 0.0) * w_CK[None, None, :, j]
    return jax.nn.silu(out), (full if keep_all else full[:, -(kern - 1) :])

  def heads(self, qkv_BTC):
    """Queries and keys [B, T, Nv, Dk] (L2-normalised, queries scaled by Dk^-1/2; each key head
    repeated for its value heads) and values [B, T, Nv, Dv]."""
    cfg = self.cfg
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    b, t = qkv_BTC.shape[:2]
    q, k, v = jnp.split(qkv_BTC, [nk * dk, 2 * nk * dk], axis=-1)
    q, k = (jnp.repeat(x.reshape(b, t, nk, dk), nv // nk, axis=2) for x in (q, k))
    q = delta_rule.l2norm(q) * dk**-0.5
    return q, delta_rule.l2norm(k), v.reshape(b, t, nv, dv)

  def finish(self, o_BTNV, z_BTNV, dtype, rng=None):
    """The gated norm per value head, then the output projection."""
    y = self.norm(o_BTNV.astype(dtype)).astype(jnp.float32)
    y = (y * jax.nn.silu(z_BTNV.astype(jnp.float32))).astype(dtype)
    return self.out(y.reshape(*y.shape[:2], -1), rng)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, rng=None, window=0):
    del positions_BT, window  # no positions: order lives in the state
    qkv, z, beta, g = self.inputs(x_BTD, rng)
    qkv, _ = self.convolve(qkv, segment_ids_BT)
    q, k, v = self.heads(qkv)
    o, _ = self.rule(q, k, v, g, beta, segment_ids_BT)
    return self.finish(o, z, x_BTD.dtype, rng)

  def rule(self, q, k, v, g, beta, segment_ids_BT):
    """The training delta rule: (outputs [B, T, Nv, Dv], the final state)."""
    cfg = self.cfg
    if not cfg.delta_rule_tokamax():
      return delta_rule.chunked(q, k, v, g, beta, cfg.delta_chunk, None, segment_ids_BT)
    heads = dict(cfg.engine.rules.activations).get('heads')
    return delta_rule_tokamax.chunked(
      q, k, v, g, beta, None, segment_ids_BT,
      chunk=cfg.delta_chunk,
      max_segments=cfg.engine.delta_rule_segments,
      interpret=cfg.engine.platform != 'tpu',
      mesh_shape=cfg.engine.mesh_shape,
      head_axis=heads if isinstance(heads, str) else None,
    )  # fmt: skip
