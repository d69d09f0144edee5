"""LongCat-Flash decoder: shortcut-connected MoE layers (ScMoE) scanned over depth."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moetrain import axes
from moetrain.model.attention import MLA
from moetrain.model.config import ModelConfig
from moetrain.model.layers import Embed, Linear, RMSNorm
from moetrain.model.moe import MoE
from moetrain.sharding import constrain

ACT = axes.names('BTD')


class MLP(nnx.Module):
  """Dense SwiGLU."""

  def __init__(self, cfg: ModelConfig, path: str, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.ffn_hidden_size
    self.gate = Linear('BTD,DF->BTF', (d, f), cfg, f'{path}.gate', rngs)
    self.up = Linear('BTD,DF->BTF', (d, f), cfg, f'{path}.up', rngs)
    self.down = Linear('BTF,FD->BTD', (f, d), cfg, f'{path}.down', rngs)
    self.rules = cfg.rules

  def __call__(self, x_BTD, rng=None):
    h_BTF = jax.nn.silu(self.gate(x_BTD, rng).astype(jnp.float32)) * self.up(x_BTD, rng)
    h_BTF = constrain(h_BTF.astype(x_BTD.dtype), axes.names('BTF'), self.rules)
    return self.down(h_BTF, rng)


class DecoderLayer(nnx.Module):
  """Two attention + dense-MLP sublayers; the MoE reads the first post-attention norm and its
  output joins the residual only at the end of the layer (TR section 2, HF DecoderLayer)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, eps, p = cfg.hidden_size, cfg.rms_norm_eps, 'layers'
    self.rules = cfg.rules
    self.input_norm_0 = RMSNorm(d, 'D', eps, cfg)
    self.input_norm_1 = RMSNorm(d, 'D', eps, cfg)
    self.post_norm_0 = RMSNorm(d, 'D', eps, cfg)
    self.post_norm_1 = RMSNorm(d, 'D', eps, cfg)
    self.attn_0 = MLA(cfg, f'{p}.attn_0', rngs)
    self.attn_1 = MLA(cfg, f'{p}.attn_1', rngs)
    self.mlp_0 = MLP(cfg, f'{p}.mlp_0', rngs)
    self.mlp_1 = MLP(cfg, f'{p}.mlp_1', rngs)
    self.moe = MoE(cfg, f'{p}.moe', rngs)

  def __call__(self, h_BTD, positions_BT, segment_ids_BT, rng=None):
    rngs = [None] * 5 if rng is None else list(jax.random.split(rng, 5))

    def attend(i, x_BTD):
      mla = (self.attn_0, self.attn_1)[i]
      return mla(x_BTD, positions_BT, segment_ids_BT, rngs[3 * i])

    return self.body(h_BTD, attend, segment_ids_BT > 0, rngs)

  def body(self, h_BTD, attend, valid_BT, rngs):
    """The ScMoE wiring; attend(i, x_BTD) runs attention block i (full sequence, or against a
    KV cache in model/decode.py). rngs: 5 keys or Nones (attn_0, moe, mlp_0, attn_1, mlp_1)."""
    # Named scopes label the HLO ops, so profiles attribute time to sublayers.
    with jax.named_scope('attn_0'):
      h_BTD = h_BTD + attend(0, self.input_norm_0(h_BTD))
    x_BTD = self.post_norm_0(h_BTD)
    with jax.named_scope('moe'):
      m_BTD, stats = self.moe(x_BTD, valid_BT, rngs[1])
    m_BTD = checkpoint_name(m_BTD, 'moe_out')
    with jax.named_scope('mlp_0'):
      h_BTD = h_BTD + self.mlp_0(x_BTD, rngs[2])
    with jax.named_scope('attn_1'):
      h_BTD = h_BTD + attend(1, self.input_norm_1(h_BTD))
    with jax.named_scope('mlp_1'):
      h_BTD = h_BTD + self.mlp_1(self.post_norm_1(h_BTD), rngs[4]) + m_BTD
    return constrain(h_BTD, ACT, self.rules), stats


def remat_policy(name: str):
  cp = jax.checkpoint_policies
  return {
    'full': cp.nothing_saveable,
    'save_dots': cp.dots_with_no_batch_dims_saveable,
    'save_moe': cp.save_only_these_names('moe_out'),
    'offload': cp.save_and_offload_only_these_names(
      names_which_can_be_saved=[],
      names_which_can_be_offloaded=['moe_out'],
      offload_src='device',
      offload_dst='pinned_host',
    ),
  }[name]


def mark_layer_axes(layers: nnx.Module) -> None:
  """Prepends the scan axis name to the logical axes of every stacked variable."""
  for _, var in nnx.iter_graph(layers):
    if isinstance(var, nnx.Variable) and 'axes' in var.get_metadata():
      var.set_metadata('axes', (*axes.names('L'), *var.axes))


class Transformer(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = Embed(cfg, rngs)

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_layers(rngs):
      return DecoderLayer(cfg, rngs)

    self.layers = make_layers(rngs)
    mark_layer_axes(self.layers)
    self.final_norm = RMSNorm(cfg.hidden_size, 'D', cfg.rms_norm_eps, cfg)
    self.lm_head = Linear('BTD,DV->BTV', (cfg.hidden_size, cfg.vocab_size), cfg, 'lm_head', rngs)

  def __call__(self, ids_BT, positions_BT=None, segment_ids_BT=None, rng=None):
    """Returns float32 logits [B, T, V] and the aux of `features`."""
    h_BTD, aux = self.features(ids_BT, positions_BT, segment_ids_BT, rng)
    with jax.named_scope('lm_head'):
      logits_BTV = self.lm_head(h_BTD, rng).astype(jnp.float32)
      logits_BTV = constrain(logits_BTV, axes.names('BTV'), self.cfg.rules)
    return logits_BTV, aux

  def features(self, ids_BT, positions_BT=None, segment_ids_BT=None, rng=None):
    """The lm head's input (the final-normed hidden states [B, T, D]) and aux: per-layer routing
    stats stacked on axis 0 and the pre-norm last hidden state's per-token log-sum-exp (for the
    hidden z-loss). Training takes the loss from here (kernels/cross_entropy.py), never the whole logits."""
    b, t = ids_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones((b, t), jnp.int32)
    h_BTD = constrain(self.embed(ids_BT), ACT, self.cfg.rules)
    h_BTD, stats = self.run_layers(h_BTD, positions_BT, segment_ids_BT, rng)
    z_BT = jax.nn.logsumexp(jnp.abs(h_BTD.astype(jnp.float32)), axis=-1)
    return self.final_norm(h_BTD), {'moe': stats, 'hidden_lse_BT': z_BT}

  def run_layers(self, h_BTD, positions_BT, segment_ids_BT, rng):
    graphdef, state = nnx.split(self.layers)
    n = self.cfg.num_layers
    rngs_L = None if rng is None else jax.random.split(rng, n)

    def body(h, xs):
      layer_state, layer_rng = xs
      return nnx.merge(graphdef, layer_state)(h, positions_BT, segment_ids_BT, layer_rng)

    if self.cfg.remat != 'none':
      body = jax.checkpoint(body, policy=remat_policy(self.cfg.remat), prevent_cse=False)
    if self.cfg.scan_layers:
      return jax.lax.scan(body, h_BTD, (state, rngs_L))
    outs = []
    for i in range(n):
      h_BTD, out = body(h_BTD, jax.tree.map(lambda x, i=i: x[i], (state, rngs_L)))
      outs.append(out)
    return h_BTD, jax.tree.map(lambda *x: jnp.stack(x), *outs)
