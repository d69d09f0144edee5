"""The decoder of every family: embedding, runs of decoder layers each scanned over depth (LongCat's
shortcut-connected MoE layers, or standard pre-norm layers with an MoE or a dense MLP), final norm
and lm head."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moetrain.core import axes
from moetrain.core.sharding import constrain
from moetrain.kernels import experts as experts_lib
from moetrain.model import context, stages
from moetrain.model.attention import MLA, make_attention
from moetrain.model.config import LayerGroup, ModelConfig
from moetrain.model.layers import MLP, Embed, Linear, RMSNorm
from moetrain.model.linear_attention import GatedDeltaNet
from moetrain.model.moe import Experts, MoE

ACT = axes.names('BTD')


class ShortcutLayer(nnx.Module):
  """LongCat-Flash's ScMoE layer: two attention + dense-MLP sublayers; the MoE reads the first
  post-attention norm and its output joins the residual only at the end of the layer (TR
  section 2, HF DecoderLayer)."""

  def __init__(self, cfg: ModelConfig, p: str, rngs: nnx.Rngs):
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    self.rules = cfg.engine.rules
    self.input_norm_0 = RMSNorm(d, 'D', eps, cfg)
    self.input_norm_1 = RMSNorm(d, 'D', eps, cfg)
    self.post_norm_0 = RMSNorm(d, 'D', eps, cfg)
    self.post_norm_1 = RMSNorm(d, 'D', eps, cfg)
    self.attn_0 = MLA(cfg, f'{p}.attn_0', rngs)
    self.attn_1 = MLA(cfg, f'{p}.attn_1', rngs)
    self.mlp_0 = MLP(cfg, f'{p}.mlp_0', rngs)
    self.mlp_1 = MLP(cfg, f'{p}.mlp_1', rngs)
    self.moe = MoE(cfg, f'{p}.moe', rngs)

  def __call__(self, h_BTD, positions_BT, segment_ids_BT, rng=None, window=0, routes_BTK=None):
    del window  # LongCat has no sliding windows
    rngs = [None] * 5 if rng is None else list(jax.random.split(rng, 5))

    def attend(i, x_BTD):
      mla = (self.attn_0, self.attn_1)[i]
      return mla(x_BTD, positions_BT, segment_ids_BT, rngs[3 * i])

    return self.body(h_BTD, attend, segment_ids_BT > 0, rngs, routes_BTK)

  def body(self, h_BTD, attend, valid_BT, rngs, routes_BTK=None):
    """The ScMoE wiring; attend(i, x_BTD) runs attention block i (full sequence, or against a
    KV cache in model/decode.py). rngs: 5 keys or Nones (attn_0, moe, mlp_0, attn_1, mlp_1).
    routes_BTK: the MoE's forced top-k ids (routing replay; None: its router chooses)."""
    # Named scopes label the HLO ops, so profiles attribute time to sublayers.
    with jax.named_scope('attn_0'):
      h_BTD = h_BTD + attend(0, self.input_norm_0(h_BTD))
    x_BTD = self.post_norm_0(h_BTD)
    with jax.named_scope('moe'):
      m_BTD, stats = self.moe(x_BTD, valid_BT, rngs[1], routes_BTK)
    m_BTD = checkpoint_name(m_BTD, 'moe_out')
    with jax.named_scope('mlp_0'):
      h_BTD = h_BTD + self.mlp_0(x_BTD, rngs[2])
    with jax.named_scope('attn_1'):
      h_BTD = h_BTD + attend(1, self.input_norm_1(h_BTD))
    with jax.named_scope('mlp_1'):
      h_BTD = h_BTD + self.mlp_1(self.post_norm_1(h_BTD), rngs[4]) + m_BTD
    return constrain(h_BTD, ACT, self.rules), stats


class StandardLayer(nnx.Module):
  """Pre-norm attention, then a pre-norm MoE (kind 'moe') or dense SwiGLU MLP ('dense'), each
  added to the residual (DeepSeek, Qwen3-MoE, Mixtral)."""

  def __init__(self, cfg: ModelConfig, kind: str, p: str, rngs: nnx.Rngs, mixer='attention'):
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    self.rules = cfg.engine.rules
    self.input_norm = RMSNorm(d, 'D', eps, cfg)
    self.post_norm = RMSNorm(d, 'D', eps, cfg)
    if mixer == 'linear':  # Gated DeltaNet in attention's place (Qwen3-Next)
      self.attn = GatedDeltaNet(cfg, f'{p}.attn', rngs)
    else:
      self.attn = make_attention(cfg, f'{p}.attn', rngs)
    if kind == 'moe':
      self.moe = MoE(cfg, f'{p}.moe', rngs)
    else:
      self.mlp = MLP(cfg, f'{p}.mlp', rngs)

  def __call__(self, h_BTD, positions_BT, segment_ids_BT, rng=None, window=0, routes_BTK=None):
    """window: this layer's attention window (0: full; traced under the layer scan). Stats: the
    MoE's, plus 'indexer_kl' (the indexer's KL loss summed over the tokens) where it trains."""
    rngs = [None] * 2 if rng is None else list(jax.random.split(rng, 2))
    kl = []  # what the attention's forward gives beside its output

    def attend(i, x_BTD):
      if isinstance(self.attn, MLA):
        out_BTD, loss = self.attn.forward(x_BTD, positions_BT, segment_ids_BT, rngs[0])
        if loss is not None:
          kl.append(loss)
        return out_BTD
      return self.attn(x_BTD, positions_BT, segment_ids_BT, rngs[0], window)

    h_BTD, stats = self.body(h_BTD, attend, segment_ids_BT > 0, rngs, routes_BTK)
    return h_BTD, stats if not kl else {**(stats or {}), 'indexer_kl': kl[0]}

  def body(self, h_BTD, attend, valid_BT, rngs, routes_BTK=None):
    """attend(0, x_BTD) runs the attention (full sequence, or against a KV cache in
    model/decode.py); rngs: 2 keys or Nones (attention, MoE or MLP); routes_BTK: the MoE's
    forced top-k ids (routing replay). Stats: None in a dense layer."""
    with jax.named_scope('attn'):
      h_BTD = h_BTD + attend(0, self.input_norm(h_BTD))
    x_BTD, stats = self.post_norm(h_BTD), None
    if hasattr(self, 'moe'):
      with jax.named_scope('moe'):
        m_BTD, stats = self.moe(x_BTD, valid_BT, rngs[1], routes_BTK)
      m_BTD = checkpoint_name(m_BTD, 'moe_out')
    else:
      with jax.named_scope('mlp'):
        m_BTD = self.mlp(x_BTD, rngs[1])
    return constrain(h_BTD + m_BTD, ACT, self.rules), stats


def make_layer(cfg: ModelConfig, group: LayerGroup, rngs: nnx.Rngs):
  if cfg.layer_layout == 'shortcut':
    return ShortcutLayer(cfg, group.name, rngs)
  return StandardLayer(cfg, group.kind, group.name, rngs, group.mixer)


def make_stack(cfg: ModelConfig, group: LayerGroup, rngs: nnx.Rngs):
  """The group's layers as one module whose variables carry a leading layer axis. Made one
  layer after the other (a scan, not a vmap, over the split keys: the same values), so that a
  random init holds one layer's draw at a time, not every layer's."""

  @nnx.split_rngs(splits=group.count)
  @nnx.scan(in_axes=(0,), out_axes=0, length=group.count)
  def make_layers(rngs):
    return make_layer(cfg, group, rngs)

  stack = make_layers(rngs)
  mark_layer_axes(stack)
  return stack


# What save_moe keeps (offload: moves to host memory) of a layer's forward for its backward: the
# routed experts' input rows and their gate and up projections (kernels/experts.py), which the
# experts' backward reads; and the MoE output, which the layer's own backward reads. Saving only
# the output (as save_moe once did) saved nothing: the experts' backward still needed their
# internals, so the whole MoE was recomputed anyway and the compiled program equalled `full`'s.
MOE_SAVED = (
  'moe_out',
  experts_lib.EXPERT_INPUT,
  experts_lib.EXPERT_GATE,
  experts_lib.EXPERT_UP,
  experts_lib.EXPERT_OUTPUT,
)


def remat_policy(name: str):
  cp = jax.checkpoint_policies
  return {
    'full': cp.nothing_saveable,
    'save_dots': cp.dots_with_no_batch_dims_saveable,
    'save_moe': cp.save_only_these_names(*MOE_SAVED),
    'offload': cp.save_and_offload_only_these_names(
      names_which_can_be_saved=[],
      names_which_can_be_offloaded=list(MOE_SAVED),
      offload_src='device',
      offload_dst='pinned_host',
    ),
  }[name]


def matmul_weights_cast(state, cfg: ModelConfig):
  """A run of layers' stacked state with its matmul weights (Linear kernels, the routed experts'
  matrices: what the layers cast to cfg.dtype where they use them) cast to cfg.dtype here, once
  for the whole stack (engine.cast_weights_once); the rest (norms, router, biases, adapters, a
  quantised base) as it is."""
  dt = jnp.dtype(cfg.engine.dtype)
  if (
    not cfg.engine.cast_weights_once or cfg.lora.enabled or jnp.dtype(cfg.engine.param_dtype) == dt
  ):
    return state

  def cast(path, x):
    keys = [str(getattr(k, 'key', getattr(k, 'name', k))) for k in path]
    keys = keys[:-1] if keys[-1] == 'value' else keys
    expert = len(keys) > 1 and keys[-2] == 'experts' and keys[-1] in Experts.NAMES
    if (keys[-1] == 'kernel' or expert) and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dt)
    return x

  return jax.tree_util.tree_map_with_path(cast, state)


def mark_layer_axes(layers: nnx.Module) -> None:
  """Prepends the scan axis name to the logical axes of every stacked variable."""
  for _, var in nnx.iter_graph(layers):
    if isinstance(var, nnx.Variable) and 'axes' in var.get_metadata():
      var.set_metadata('axes', (*axes.names('L'), *var.axes))


class Transformer(nnx.Module):
  """Runs of layers of one kind (cfg.layer_groups()) are stacked modules, each scanned: 'layers'
  (MoE layers), 'dense_layers', ..."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = Embed(cfg, rngs)
    for group in cfg.layer_groups():
      setattr(self, group.name, make_stack(cfg, group, rngs))
    self.final_norm = RMSNorm(cfg.hidden_size, 'D', cfg.rms_norm_eps, cfg)
    # Not gathered (engine.gather_weights): the chunked loss would hold the whole head through it.
    shape = (cfg.hidden_size, cfg.vocab_size)
    self.lm_head = Linear('BTD,DV->BTV', shape, cfg, 'lm_head', rngs, gather=False)

  def __call__(self, ids_BT, positions_BT=None, segment_ids_BT=None, rng=None):
    """Returns float32 logits [B, T, V] and the aux of `features`."""
    h_BTD, aux = self.features(ids_BT, positions_BT, segment_ids_BT, rng)
    with jax.named_scope('lm_head'):
      logits_BTV = self.lm_head(h_BTD, rng).astype(jnp.float32)
      logits_BTV = constrain(logits_BTV, axes.names('BTV'), self.cfg.engine.rules)
    return logits_BTV, aux

  def features(
    self, ids_BT, positions_BT=None, segment_ids_BT=None, rng=None, routes_BTLK=None, slots=False
  ):
    """The lm head's input (the final-normed hidden states [B, T, D]) and aux: the routing stats
    of the MoE layers stacked on axis 0 (in layer order), the pre-norm last hidden state's
    per-token log-sum-exp (for the hidden z-loss) and 'routes' [B, T, L, K], the top-k ids each
    MoE layer's router chose (before any replay; None under pipeline stages); 'indexer_kl' [L_i],
    each sparse attention indexer's KL loss summed over the tokens (cfg.train_indexer; else
    None). Training takes the loss from here (kernels/cross_entropy.py), never the whole logits.

    routes_BTLK: routing replay, the MoE layers' forced top-k ids (None: the routers choose).

    With a context split's load balance (context.context_reordered) the layers run on the
    rows in dual-chunk order: the inputs are reordered here (each context shard holds whole
    rows at this point, so that moves nothing between devices) and the outputs put back in
    the rows' order. slots: the hidden states stay in the shards' order
    (context.slot_order's), where the loss moves its targets to them instead: a row's
    hidden states then never cross the context shards; the aux stays in the rows' order."""
    b, t = ids_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones((b, t), jnp.int32)
    index = context.slot_order(self.cfg, t)
    ids_BT, positions_BT, segment_ids_BT, routes_BTLK = (
      context.in_slots(x, index) for x in (ids_BT, positions_BT, segment_ids_BT, routes_BTLK)
    )
    h_BTD = constrain(self.embed(ids_BT), ACT, self.cfg.engine.rules)
    h_BTD, stats = self.run_layers(h_BTD, positions_BT, segment_ids_BT, rng, routes_BTLK)
    z_BT = jax.nn.logsumexp(jnp.abs(h_BTD.astype(jnp.float32)), axis=-1)
    kl_L = stats.pop('indexer_kl')
    routes = stats.pop('routes', None)
    routes = None if routes is None else jnp.transpose(routes, (1, 2, 0, 3))
    h_BTD = self.final_norm(h_BTD)
    if index is not None:  # back in the rows' order
      back = functools.partial(context.in_slots, index=index, back=True)
      z_BT, routes = back(z_BT), back(routes)
      h_BTD = h_BTD if slots else constrain(back(h_BTD), ACT, self.cfg.engine.rules)
    return h_BTD, {'moe': stats, 'hidden_lse_BT': z_BT, 'routes': routes, 'indexer_kl': kl_L}

  def run_layers(self, h_BTD, positions_BT, segment_ids_BT, rng, routes_BTLK=None):
    cfg = self.cfg
    rngs_L = None if rng is None else jax.random.split(rng, cfg.num_layers)
    # The MoE layers' forced ids, layer first: group g's are rows moe_start.. of it.
    routes_LBTK = None if routes_BTLK is None else jnp.transpose(routes_BTLK, (2, 0, 1, 3))
    stats, kl, moe_start = [], [], 0
    for group in cfg.layer_groups():
      group_rngs = None if rng is None else rngs_L[group.start : group.start + group.count]
      forced = None
      if group.kind == 'moe' and routes_LBTK is not None:
        forced = routes_LBTK[moe_start : moe_start + group.count]
      args = (h_BTD, positions_BT, segment_ids_BT, group_rngs, forced)
      h_BTD, out = self.run_group(group, *args)
      if out is not None and 'indexer_kl' in out:
        out = dict(out)
        kl.append(out.pop('indexer_kl'))
      if group.kind == 'moe':
        stats.append(out)
        moe_start += group.count
    stats = jax.tree.map(lambda *x: jnp.concatenate(x), *stats)
    return h_BTD, {**stats, 'indexer_kl': jnp.concatenate(kl) if kl else None}

  def run_group(
    self, group: LayerGroup, h_BTD, positions_BT, segment_ids_BT, rngs_L, routes_LBTK=None
  ):
    graphdef, state = nnx.split(getattr(self, group.name))
    windows = self.cfg.layer_windows()[group.start : group.start + group.count]
    pipelined = stages.active(self.cfg, h_BTD.shape[0])
    if pipelined and routes_LBTK is not None:
      raise ValueError('routing replay under pipeline stages (engine.pipeline_stages > 1)')
    if pipelined and self.cfg.train_indexer:
      raise ValueError('the indexer KL loss under pipeline stages (engine.pipeline_stages > 1)')
    # Per layer: its dropout key (or None), its attention window and its forced routes (or None).
    extra_L = (rngs_L, jnp.asarray(windows, jnp.int32), routes_LBTK)

    def layer(h, xs, positions_BT, segment_ids_BT):
      layer_state, (layer_rng, window, routes) = xs
      module = nnx.merge(graphdef, layer_state)
      h, stats = module(h, positions_BT, segment_ids_BT, layer_rng, window, routes)
      if pipelined and stats is not None:  # (the micro-batches' ids are not gathered)
        stats = {k: v for k, v in stats.items() if k != 'routes'}
      return h, stats

    if self.cfg.engine.remat != 'none':
      # Inside a scan of several layers the loop keeps the recompute apart from the forward; a
      # group of one layer (a dense first layer) is a loop XLA unrolls, and unrolled layers
      # have no loop, where CSE could merge the two (JAX's advice: prevent_cse outside scans).
      single = group.count == 1 or not self.cfg.engine.scan_layers
      layer = jax.checkpoint(layer, policy=remat_policy(self.cfg.engine.remat), prevent_cse=single)
    state = matmul_weights_cast(state, self.cfg)
    if pipelined:
      args = (self.cfg, h_BTD, positions_BT, segment_ids_BT)
      return stages.run_group(layer, state, extra_L, *args)
    state = stages.in_layer_order(state, self.cfg)  # (a circular pipeline's stored order)
    body = lambda h, xs: layer(h, xs, positions_BT, segment_ids_BT)
    if self.cfg.engine.scan_layers:
      return jax.lax.scan(body, h_BTD, (state, extra_L))
    outs = []
    for i in range(group.count):
      h_BTD, out = body(h_BTD, jax.tree.map(lambda x, i=i: x[i], (state, extra_L)))
      outs.append(out)
    return h_BTD, jax.tree.map(lambda *x: jnp.stack(x), *outs)
