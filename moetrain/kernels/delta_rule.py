"""The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5-MoE): per head a state
S [Dk, Dv] that each token decays, corrects and reads,

  S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - k_t^T S_t))^T;  o_t = q_t^T S_t,

in two forms that agree: `recurrent` (token by token: decoding, and the reference) and `chunked`
(training: within a chunk of C tokens the corrections are solved at once, a unit lower
triangular system (the UT transform of DeltaNet's WY form), and the state moves once per chunk,
so the work is matmuls of C x C and C x D blocks). Packed rows reset the state where a segment
starts: the chunked form masks what crosses a segment boundary instead of decaying it to zero,
so every figure stays exact. Shapes: q, k [B, T, H, Dk], v [B, T, H, Dv], g (log decay, <= 0)
and beta [B, T, H], segment_ids [B, T] (None: one segment), state [B, H, Dk, Dv]; everything
computes in float32.
"""

import jax
import jax.numpy as jnp


def l2norm(x, eps: float = 1e-6):
  """x / sqrt(sum x^2 + eps) over the last axis (as the released kernels do)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _starts(segment_ids, b: int, t: int):
  """[B, T] bool: where a new segment begins (never at position 0: an initial state is the
  first segment's)."""
  if segment_ids is None:
    return jnp.zeros((b, t), bool)
  prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
  return segment_ids != prev


def recurrent(q, k, v, g, beta, state=None, segment_ids=None):
  """The rule token by token: (outputs [B, T, H, Dv], the final state)."""
  b, t, h, dk = k.shape
  dv = v.shape[-1]
  f32 = lambda x: x.astype(jnp.float32)
  if state is None:
    state = jnp.zeros((b, h, dk, dv), jnp.float32)
  starts = _starts(segment_ids, b, t)

  def step(s, xs):
    q_t, k_t, v_t, g_t, beta_t, start = xs
    s = jnp.where(start[:, None, None, None], 0.0, s) * jnp.exp(g_t)[..., None, None]
    delta = beta_t[..., None] * (v_t - jnp.einsum('bhk,bhkv->bhv', k_t, s))
    s = s + k_t[..., :, None] * delta[..., None, :]
    return s, jnp.einsum('bhk,bhkv->bhv', q_t, s)

  xs = [jnp.moveaxis(f32(x), 1, 0) for x in (q, k, v, g, beta)] + [starts.T]
  state, out = jax.lax.scan(step, f32(state), xs)
  return jnp.moveaxis(out, 0, 1), state


def _chunks(x, n: int, c: int):
  """[B, T, H, ...] -> [B, H, N, C, ...]."""
  b, _, h = x.shape[:3]
  x = x.reshape(b, n, c, h, *x.shape[3:])
  return jnp.moveaxis(x, 3, 1)


def chunked(q, k, v, g, beta, chunk: int = 64, state=None, segment_ids=None):
  """The rule chunk by chunk: (outputs [B, T, H, Dv], the final state), equal to `recurrent`."""
  b, t, h, dk = k.shape
  dv = v.shape[-1]
  pad = (-t) % chunk
  n = (t + pad) // chunk
  seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  # Padding at the end is a no-op on the state (k = 0, beta = 0, no decay) in the last segment.
  widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
  q, k, v, g, beta = (jnp.pad(x.astype(jnp.float32), widths(x)) for x in (q, k, v, g, beta))
  seg = jnp.pad(seg, [(0, 0), (0, pad)], mode='edge')
  q, k, v = (_chunks(x, n, chunk) for x in (q, k, v))  # [B, H, N, C, D]
  g, beta = (_chunks(x, n, chunk) for x in (g, beta))  # [B, H, N, C]
  seg = seg.reshape(b, 1, n, chunk)
  # The segment the state entering each chunk belongs to (chunk 0: position 0's).
  seg_in = jnp.concatenate([seg[:, :, :1, :1], seg[:, :, :-1, -1:]], axis=2)
  carry = seg == seg_in  # [B, 1, N, C]: whether a position reads the incoming state
  last = seg[..., -1:]
  cum = jnp.cumsum(g, axis=-1)  # log decay from the chunk's start
  # Pairwise decay within a chunk, zero across segments and above the diagonal.
  lower = lambda d: jnp.tril(jnp.ones((chunk, chunk), bool), d)[None, None, None]
  pair = (seg[..., :, None] == seg[..., None, :]) & lower(0)
  diff = jnp.where(pair, cum[..., :, None] - cum[..., None, :], 0.0)
  decay = jnp.where(pair, jnp.exp(diff), 0.0)  # [B, H, N, C, C]
  k_beta, v_beta = k * beta[..., None], v * beta[..., None]
  system = jnp.where(lower(-1), (k_beta @ jnp.swapaxes(k, -1, -2)) * decay, 0.0)
  eye = jnp.eye(chunk, dtype=jnp.float32)[None, None, None]
  solve = lambda rhs: jax.lax.linalg.triangular_solve(
    eye + system, rhs, left_side=True, lower=True, unit_diagonal=True
  )
  grow = jnp.exp(cum)[..., None] * carry[..., None]
  new_values = solve(v_beta)  # the corrections, before the incoming state's part
  k_read = solve(k_beta * grow)  # how much of the incoming state each correction removes
  q_read = q * grow
  intra = (q @ jnp.swapaxes(k, -1, -2)) * decay
  to_end = jnp.where(seg == last, jnp.exp(cum[..., -1:] - cum), 0.0)
  k_write = k * to_end[..., None]
  keep = (jnp.exp(cum[..., -1]) * carry[..., -1])[..., None, None]  # [B, H, N, 1, 1]

  def step(s, xs):
    new_values, k_read, q_read, intra, k_write, keep = xs
    v_new = new_values - k_read @ s
    out = q_read @ s + intra @ v_new
    return s * keep + jnp.swapaxes(k_write, -1, -2) @ v_new, out

  xs = [jnp.moveaxis(x, 2, 0) for x in (new_values, k_read, q_read, intra, k_write, keep)]
  if state is None:
    state = jnp.zeros((b, h, dk, dv), jnp.float32)
  state, out = jax.lax.scan(step, state.astype(jnp.float32), xs)  # out [N, B, H, C, Dv]
  out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
  return jnp.moveaxis(out, 1, 2), state
