"""Distillation's divergence fused into the chunked lm-head loss: per block of positions the
student's logits [B, T, V] and the teacher's (its head on its hidden states, or its cached top-k)
exist together, never the whole sequence's. (Design: docs/distillation.md.)"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.core.sharding import Rules
from moetrain.kernels import Kernel, vjp
from moetrain.kernels.cross_entropy import _logits_fn

DIVERGENCES = ('forward_kl', 'reverse_kl', 'jsd')


@dataclasses.dataclass(frozen=True)
class Divergence:
  """Per scored token: alpha * T^2 * divergence(teacher_T, student_T) + (1 - alpha) * NLL.

  kind: 'forward_kl' KL(p || q), 'reverse_kl' KL(q || p), or 'jsd': beta KL(p || m) +
  (1 - beta) KL(q || m), m = beta p + (1 - beta) q; p the teacher's and q the student's
  distribution at temperature T. top_k > 0: p is the teacher's k best tokens, renormalised (the
  reverse KL then compares q restricted to them, renormalised: outside them p is 0)."""

  kind: str = 'forward_kl'
  alpha: float = 0.5
  temperature: float = 1.0
  beta: float = 0.5
  top_k: int = 0


def teacher_top(logits_BTV, top_k: int):
  """(ids [B, T, W], their log-probabilities at temperature 1) of the teacher's k best tokens:
  what the offline cache stores."""
  vals_BTW, ids_BTW = jax.lax.top_k(logits_BTV, top_k)
  return ids_BTW, vals_BTW - jax.nn.logsumexp(logits_BTV, axis=-1, keepdims=True)


def teacher_dist(d: Divergence, logits_BTV=None, ids_BTW=None, logp_BTW=None):
  """(ids or None for the whole vocabulary, log p at temperature T) of the teacher: from its
  logits, or from cached top-k log-probabilities (any temperature-1 log-probabilities of the
  same tokens: renormalising over the k removes the difference)."""
  if logits_BTV is not None:
    if not d.top_k:
      return None, jax.nn.log_softmax(logits_BTV / d.temperature, axis=-1)
    ids_BTW, logp_BTW = teacher_top(logits_BTV, d.top_k)
  ids_BTW, logp_BTW = ids_BTW[..., : d.top_k], logp_BTW[..., : d.top_k]
  return ids_BTW, jax.nn.log_softmax(logp_BTW / d.temperature, axis=-1)


def divergence(d: Divergence, ids_BTW, logp_BTW, logq_BTV):
  """The per-position divergence [B, T] between the teacher's log p (over ids, or the whole
  vocabulary when ids is None) and the student's log q over the whole vocabulary."""
  sparse = ids_BTW is not None
  logq_BTW = jnp.take_along_axis(logq_BTV, ids_BTW, axis=-1) if sparse else logq_BTV
  p_BTW = jnp.exp(logp_BTW)
  if d.kind == 'forward_kl':
    return jnp.sum(p_BTW * (logp_BTW - logq_BTW), axis=-1)
  if d.kind == 'reverse_kl':
    if sparse:  # q restricted to the teacher's tokens: elsewhere p = 0 and KL(q || p) = inf
      logq_BTW = logq_BTW - jax.nn.logsumexp(logq_BTW, axis=-1, keepdims=True)
    return jnp.sum(jnp.exp(logq_BTW) * (logq_BTW - logp_BTW), axis=-1)
  b = d.beta
  logm_BTW = jnp.logaddexp(math.log(b) + logp_BTW, math.log(1 - b) + logq_BTW)
  q_BTW = jnp.exp(logq_BTW)
  to_p = jnp.sum(p_BTW * (logp_BTW - logm_BTW), axis=-1)
  to_q = jnp.sum(q_BTW * (logq_BTW - logm_BTW), axis=-1)
  if sparse:  # q's mass outside the teacher's tokens, where m = (1 - beta) q
    to_q = to_q - (1 - jnp.sum(q_BTW, axis=-1)) * math.log(1 - b)
  return b * to_p + (1 - b) * to_q


def block_loss(logits_BTV, targets_BT, mask_BT, teacher, d: Divergence):
  """(the block's objective sum, (NLL sum, divergence sum, correct count)). teacher: (ids or
  None, log p at temperature T), teacher_dist's."""
  lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
  gold_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
  nll = jnp.sum((lse_BT - gold_BT) * mask_BT)
  correct = jnp.sum((gold_BT >= jnp.max(logits_BTV, axis=-1)) * mask_BT)
  logq_BTV = jax.nn.log_softmax(logits_BTV / d.temperature, axis=-1)
  div = jnp.sum(divergence(d, *teacher, logq_BTV) * mask_BT)
  objective = (1 - d.alpha) * nll + d.alpha * d.temperature**2 * div
  return objective, (nll, div, jax.lax.stop_gradient(correct))


def _split(x, c: int):
  """[n, B, c, ...] blocks of x [B, T, ...], padded to a multiple of c (padding is masked)."""
  pad = -x.shape[1] % c
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  return x.reshape(x.shape[0], -1, c, *x.shape[2:]).swapaxes(0, 1)


def _teacher_fn(t_static, d: Divergence):
  """block's teacher input -> teacher_dist: online (the teacher head's leaves, its hidden states
  [B, T, D]) or offline (ids, log-probabilities [B, T, W])."""

  def teacher(t_leaves, t_block):
    if t_static is None:
      return teacher_dist(d, None, *t_block)
    z_BTV = _logits_fn(t_static, None)(t_leaves, t_block, 0)
    return teacher_dist(d, jax.lax.stop_gradient(z_BTV))

  return teacher


def _blocks(h_BTD, targets_BT, mask_BT, t_blocked, chunk: int):
  t = targets_BT.shape[1]
  c = chunk if 0 < chunk < t else t
  split = lambda x: _split(x, c)
  return split(h_BTD), split(targets_BT), split(mask_BT), jax.tree.map(split, t_blocked)


def _primal(leaves, h_BTD, targets_BT, mask_BT, t_leaves, t_blocked, rng, static, chunk, d):
  s_static, t_static = static
  logits, teacher = _logits_fn(s_static, rng), _teacher_fn(t_static, d)
  h_U, t_U, m_U, tb_U = _blocks(h_BTD, targets_BT, mask_BT, t_blocked, chunk)

  def block(_, xs):
    h, t, m, tb, i = xs
    obj, (nll, div, correct) = block_loss(logits(leaves, h, i), t, m, teacher(t_leaves, tb), d)
    return None, (obj, nll, div, correct)

  _, sums = jax.lax.scan(block, None, (h_U, t_U, m_U, tb_U, jnp.arange(h_U.shape[0])))
  obj, nll, div, correct = (x.sum() for x in sums)
  return obj, jax.lax.stop_gradient(nll), jax.lax.stop_gradient(div), correct


_fused = jax.custom_vjp(_primal, nondiff_argnums=(7, 8, 9))


def _fused_fwd(leaves, h_BTD, targets_BT, mask_BT, t_leaves, t_blocked, rng, static, chunk, d):
  trained = [p.perturbed for p in leaves]
  args = (leaves, h_BTD, targets_BT, mask_BT, t_leaves, t_blocked, rng)
  leaves, h_BTD, targets_BT, mask_BT, t_leaves, t_blocked, rng = vjp.values(args)
  need = [v for v, on in zip(leaves, trained) if on]

  def with_need(w):
    it = iter(w)
    return [next(it) if on else v for v, on in zip(leaves, trained)]

  s_static, t_static = static
  logits, teacher = _logits_fn(s_static, rng), _teacher_fn(t_static, d)
  h_U, t_U, m_U, tb_U = _blocks(h_BTD, targets_BT, mask_BT, t_blocked, chunk)
  grad = jax.value_and_grad(block_loss, has_aux=True)

  def block(acc, xs):
    h, t, m, tb, i = xs
    out, pull = jax.vjp(lambda w, x: logits(with_need(w), x, i), need, h)
    (obj, (nll, div, correct)), dlogits = grad(out, t, m, teacher(t_leaves, tb), d)
    dw, dh = pull(dlogits)
    return [a + g.astype(jnp.float32) for a, g in zip(acc, dw)], (obj, nll, div, correct, dh)

  acc = [jnp.zeros(v.shape, jnp.float32) for v in need]
  xs = (h_U, t_U, m_U, tb_U, jnp.arange(h_U.shape[0]))
  dw, (obj, nll, div, correct, dh_U) = jax.lax.scan(block, acc, xs)
  b, t = targets_BT.shape
  dh_BTD = dh_U.swapaxes(0, 1).reshape(b, -1, h_BTD.shape[-1])[:, :t]
  it = iter(dw)
  dw = [next(it).astype(v.dtype) if on else None for v, on in zip(leaves, trained)]
  return (obj.sum(), nll.sum(), div.sum(), correct.sum()), (dh_BTD, dw)


def _fused_bwd(static, chunk, d, res, g):
  dh_BTD, dw = res
  g_obj = vjp.dense(g[0])  # the statistics (NLL, divergence, correct) carry no gradient
  scale = lambda x: None if x is None else (x * g_obj).astype(x.dtype)
  return [scale(w) for w in dw], scale(dh_BTD), None, None, None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)

# The fast path forms each block's weight and input gradients while its logits (the student's
# and the teacher's) exist; the reference is the same scan of blocks under autodiff.
head_distill = Kernel('head_distill', _fused, _primal)


def head_distillation(
  head: nnx.Module,
  h_BTD,
  targets_BT,
  mask_BT,
  teacher,
  d: Divergence,
  chunk: int,
  rng=None,
  rules=None,
  reference=False,
):
  """Masked sums (objective, NLL, divergence, correct) of the student's head(h) against the
  targets and the teacher, in blocks of `chunk` positions (0 = one block). Only the objective
  is differentiable (in h and the head's float weights).

  teacher: ('online', teacher_head, t_h_BTD) (the teacher's head runs per block, no gradient)
  or ('offline', ids_BTW, logp_BTW) (cached top-k log-probabilities at temperature 1)."""
  graphdef, state = nnx.split(head)
  leaves, treedef = jax.tree.flatten(state)
  rules = rules or Rules()
  if teacher[0] == 'online':
    t_graphdef, t_state = nnx.split(teacher[1])
    t_leaves, t_treedef = jax.tree.flatten(jax.lax.stop_gradient(t_state))
    t_static, t_blocked = (t_graphdef, t_treedef, rules), jax.lax.stop_gradient(teacher[2])
  else:
    t_leaves, t_static, t_blocked = [], None, tuple(teacher[1:])
  mask_BT = mask_BT.astype(jnp.float32)
  static = ((graphdef, treedef, rules), t_static)
  args = (leaves, h_BTD, targets_BT, mask_BT, t_leaves, t_blocked, rng, static, chunk, d)
  return head_distill(*args, reference=reference)
