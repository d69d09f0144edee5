"""The gated delta rule (kernels/delta_rule.py) on tokamax's Pallas TPU kernel for Kimi Delta
Attention, forward and backward (its own custom VJP), sharded by hand.

KDA is the gated delta rule with a decay per key channel: S_t = diag(exp(g_t)) S_{t-1}, the
same correction and read. Gated DeltaNet's scalar decay per head is that decay on every
channel, so the kernel computes `chunked`'s rule exactly, with q, k, v, beta and the log decay
as given (no l2norm or scale of its own, no gate activation, no convolution). It runs head
first ([H, B, T, D]), in chunks of 64 (the only size it takes), key widths up to 256, float32
here as `chunked` computes. Packed rows map to its variable-length form: each segment numbered
1, 2, ... in its row starts from zero (the first from the initial state), and the kernel pads
every segment to whole chunks, so a row of N segments costs up to 63 N positions more.

Within a chunk the kernel factors each pair's decay exp(G_i - G_j) through a reference row of
its 16-row block, exp(G_i - G_r) exp(G_r - G_j), which overflows float32 once a block's decays
sum past ~88: its contract is log decays >= -5 a token (tokamax's lower_bound range). A
device's rows with a larger decay, or with more than max_segments segments, run `chunked`
instead (a lax.cond: the result is exact either way).

A Pallas call is opaque to XLA's sharding propagation: the rule runs in a shard_map, rows over
the batch axes and heads over head_axis where they divide."""

import contextlib
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moetrain.core.sharding import BATCH_AXES, MESH_AXES, full_shape
from moetrain.kernels import Kernel, delta_rule

CHUNK = 64  # the kernel's chunk (tokamax takes no other)
MAX_KEY_DIM = 256
MIN_LOG_DECAY = -5.0  # per token: 15 of them still exp() below float32's overflow


def supports(dk: int) -> bool:
  """Whether the kernel takes key heads of width dk on the TPU being compiled for: tokamax
  installed, dk <= 256, a TPU of the generations tokamax's kernel declares (v6e and later; it
  compiles for v5p too, engine.delta_rule_kernel='tokamax')."""
  import importlib.util

  if importlib.util.find_spec('tokamax') is None or dk > MAX_KEY_DIM:
    return False
  from jax.experimental.pallas import tpu as pltpu

  try:
    return pltpu.get_tpu_info().generation >= 6
  except Exception:  # not tracing for a TPU
    return False


@functools.cache
def _op():
  """tokamax's KDA op and its VJP at the one chunk size (no autotuning lookup), allowed on any
  device: tokamax checks the default device, which is the host's when compiling for a TPU
  topology elsewhere, and declares only v6e+ though the kernel compiles for v5p."""
  from tokamax.ops import tpu as tokamax_tpu

  config = tokamax_tpu.KimiDeltaAttentionConfig(chunk_size=CHUNK)
  op = tokamax_tpu.KimiDeltaAttention(config=config, bypass_device_check=True)
  return op.replace(vjp=op.vjp.replace(config=config))


@contextlib.contextmanager
def _interpreted():
  """tokamax's kernels in Pallas' interpreter (they read PALLAS_INTERPRET while tracing), their
  tiles sized for a v6e (the host's device kind registered as one while it lasts; the TPU info
  that JAX caches is dropped after, so nothing else takes the host for a TPU)."""
  from jax._src import tpu_info

  kind = tpu_info.get_device_kind()
  added = kind not in tpu_info.registry
  if added:
    v6e = tpu_info.ChipVersion.TPU_V6E
    tpu_info.registry[kind] = lambda: tpu_info.get_tpu_info_for_chip(v6e, 1)
  before = os.environ.get('PALLAS_INTERPRET')
  os.environ['PALLAS_INTERPRET'] = '1'
  try:
    yield
  finally:
    if before is None:
      del os.environ['PALLAS_INTERPRET']
    else:
      os.environ['PALLAS_INTERPRET'] = before
    if added:
      del tpu_info.registry[kind]
      tpu_info.get_tpu_info.cache_clear()


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _interpreted_kernel(q, k, v, g, beta, state, ordinal, max_segments: int):
  """_kernel in Pallas' interpreter, its forward and its backward each traced in _interpreted:
  jax traces a backward after the forward, outside any context entered around the call."""
  with _interpreted():
    return _kernel(q, k, v, g, beta, state, ordinal, max_segments)


def _interpreted_fwd(q, k, v, g, beta, state, ordinal, max_segments):
  with _interpreted():
    kernel = functools.partial(_kernel, max_segments=max_segments)
    return jax.vjp(kernel, q, k, v, g, beta, state, ordinal)


def _interpreted_bwd(max_segments, back, ct):
  del max_segments
  with _interpreted():
    return (*back(ct)[:-1], None)


_interpreted_kernel.defvjp(_interpreted_fwd, _interpreted_bwd)


def _rule(q, k, v, g, beta, state, ordinal, max_segments: int):
  """What the kernel computes, as delta_rule.chunked: (outputs, the final state)."""
  del max_segments
  return delta_rule.chunked(q, k, v, g, beta, CHUNK, state, ordinal)


# The kernel in the interpreter (tests, CPU), and the chunked XLA rule as its reference.
interpreted_kernel = Kernel('delta_rule_interpreted', _interpreted_kernel, _rule)


def _ordinals(segment_ids):
  """[B, T] int32: each position's segment numbered 1, 2, ... in order along its row."""
  new = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
  return 1 + jnp.pad(jnp.cumsum(new, axis=1), [(0, 0), (1, 0)])


def _kernel(q, k, v, g, beta, state, ordinal, max_segments: int):
  """The kernel on [B, T, H, D] inputs: (outputs [B, T, H, Dv], the final state)."""
  b, t, h, dk = k.shape
  pad = (-t) % CHUNK
  # Padding at the end is a no-op on the state (k = 0, beta = 0, no decay) in the last segment.
  widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
  q, k, v, g, beta = (jnp.pad(x.astype(jnp.float32), widths(x)) for x in (q, k, v, g, beta))
  first = lambda x: jnp.moveaxis(x, 2, 0)  # [B, T, H, ...] -> [H, B, T, ...]
  gate = jnp.broadcast_to(first(g)[..., None], (h, b, t + pad, dk))
  if ordinal is None:
    init, kw = state[:, None], {}
  else:
    init = jnp.zeros((b, max_segments, *state.shape[1:]), jnp.float32).at[:, 0].set(state)
    kw = {'segment_ids': jnp.pad(ordinal, [(0, 0), (0, pad)], mode='edge')}
  out, final = _op()(
    *map(first, (q, k, v)), gate, first(beta), scale=1.0, initial_state=init,
    output_final_state=True, **kw,
  )  # fmt: skip
  last = 0 if ordinal is None else ordinal[:, -1] - 1  # the state slot of each row's last segment
  return jnp.moveaxis(out, 0, 2)[:, :t], final[jnp.arange(b), last]


def fits(g, ordinal, max_segments: int):
  """Whether a device's rows are the kernel's: log decays g >= -5 and, for packed rows (segment
  ordinals, or None), at most max_segments segments in each."""
  ok = jnp.min(g) >= MIN_LOG_DECAY
  return ok if ordinal is None else ok & (jnp.max(ordinal[:, -1]) <= max_segments)


def _local(q, k, v, g, beta, state, segment_ids, *, chunk, max_segments, interpret):
  """One device's rows: the kernel where its limits hold, else `chunked` (module docstring)."""
  b, _, h, dk = k.shape
  if state is None:
    state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)
  state = state.astype(jnp.float32)
  ordinal = None if segment_ids is None else _ordinals(segment_ids)
  if interpret:
    kernel = lambda *a: interpreted_kernel(*a, max_segments)
  else:
    kernel = functools.partial(_kernel, max_segments=max_segments)

  def fast(q, k, v, g, beta, state, ordinal):
    # A no-op where the cond takes this branch; under vmap (the pipeline's stages) the cond is a
    # select that runs both, and this keeps the unused one finite, its gradient included.
    g = jnp.where(g < MIN_LOG_DECAY, MIN_LOG_DECAY, g)
    return kernel(q, k, v, g, beta, state, ordinal)

  # Recomputed in the backward pass: a cond keeps both branches' residuals, and the fallback's
  # would double the rule's (it is the rare branch).
  @jax.checkpoint
  def slow(q, k, v, g, beta, state, _):
    return delta_rule.chunked(q, k, v, g, beta, chunk, state, segment_ids)

  ok = fits(g, ordinal, max_segments)
  return jax.lax.cond(ok, fast, slow, q, k, v, g, beta, state, ordinal)


def chunked(
  q,
  k,
  v,
  g,
  beta,
  state=None,
  segment_ids=None,
  *,
  chunk: int = 64,
  max_segments: int = 8,
  interpret: bool = False,
  mesh_shape=(),
  head_axis=None,
):
  """delta_rule.chunked's rule and shapes on tokamax's kernel: (outputs [B, T, H, Dv], the final
  state). chunk: `chunked`'s, for rows the kernel cannot take; max_segments: the segments a
  packed row may have on the kernel; interpret: Pallas' interpreter (any platform; what the CPU
  tests check); mesh_shape: the sizes of MESH_AXES of the mesh in context (() = no mesh), over
  which the rule runs in a shard_map; head_axis: the mesh axis the rules shard heads over."""
  local = functools.partial(_local, chunk=chunk, max_segments=max_segments, interpret=interpret)
  if not mesh_shape:
    return local(q, k, v, g, beta, state, segment_ids)
  sizes = dict(zip(MESH_AXES, full_shape(mesh_shape)))
  batch = tuple(a for a in BATCH_AXES if sizes[a] > 1)
  if not batch or k.shape[0] % math.prod(sizes[a] for a in batch):
    batch = None
  h = k.shape[2]
  heads = head_axis if head_axis and h % sizes.get(head_axis, 1) == 0 else None
  x, gb, s = P(batch, None, heads, None), P(batch, None, heads), P(batch, heads, None, None)
  specs = (x, x, x, gb, gb, s, P(batch, None))
  return jax.shard_map(local, in_specs=specs, out_specs=(x, s), check_vma=False)(
    q, k, v, g, beta, state, segment_ids
  )
