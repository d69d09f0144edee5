"""The ragged all-to-all of expert parallelism (lax.ragged_all_to_all), its reverse as the
gradient, and an emulation from fixed-size collectives for XLA:CPU, which lacks the op."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moetrain.kernels import Kernel


class Exchange(NamedTuple):
  """One ragged exchange over a mesh axis of size ep, in E slices (one per expert group; E a
  multiple of ep, slice i goes to shard i // (E/ep)): the arguments of lax.ragged_all_to_all
  plus the receive side, so the reverse exchange (the transpose) is this one with the roles
  swapped.

  in_off, send:  where my slice i starts in my operand, and its rows.
  out_off:       where my slice i lands in its receiver's output.
  recv, recv_off, src_off: the slice i I receive (from shard i // (E/ep), its slice number
                 me * E/ep + i % (E/ep)): its rows, where it lands in my output, and where it
                 starts in its sender's operand."""

  in_off: jax.Array
  send: jax.Array
  out_off: jax.Array
  recv: jax.Array
  recv_off: jax.Array
  src_off: jax.Array

  def reverse(self) -> 'Exchange':
    return Exchange(self.recv_off, self.recv, self.src_off, self.send, self.in_off, self.out_off)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _ragged_exchange(x_PD, ex: Exchange, rows: int, axis: str, emulate: bool):
  out = jnp.zeros((rows, *x_PD.shape[1:]), x_PD.dtype)
  if emulate:
    return emulated_ragged_all_to_all(x_PD, out, ex, axis)
  return jax.lax.ragged_all_to_all(
    x_PD, out, ex.in_off, ex.send, ex.out_off, ex.recv, axis_name=axis
  )


_ragged_exchange.defvjp(
  lambda x, ex, rows, axis, emu: (_ragged_exchange(x, ex, rows, axis, emu), (ex, x.shape[0])),
  lambda rows, axis, emu, res, g: (_ragged_exchange(g, res[0].reverse(), res[1], axis, emu), None),
)


def _reference(x_PD, ex: Exchange, rows: int, axis: str, emulate: bool):
  out = jnp.zeros((rows, *x_PD.shape[1:]), x_PD.dtype)
  return emulated_ragged_all_to_all(x_PD, out, ex, axis)


# [rows, ...] output: the received slices written at their offsets, zeros elsewhere, inside a
# shard_map over `axis`. The fast gradient is the reverse exchange; the reference is the
# emulation differentiated by autodiff. emulate: XLA:CPU has no ragged all-to-all
# (UNIMPLEMENTED at compile time), so a CPU target runs emulated_ragged_all_to_all.
ragged_exchange = Kernel('ragged_exchange', _ragged_exchange, _reference)


def emulated_ragged_all_to_all(x_PD, out_PD, ex: Exchange, axis: str):
  """lax.ragged_all_to_all's semantics from fixed-size collectives, for XLA:CPU, which lacks the
  op. Like the real op it writes recv[i] rows at recv_off[i] (the receiver's view); the rows come
  from the sender's operand at src_off[i]. Every shard gathers every operand (ep x the memory:
  this is for tests and CPU meshes, not for speed)."""
  n, m = x_PD.shape[0], out_PD.shape[0]
  ep = jax.lax.axis_size(axis)
  spd = ex.recv.shape[0] // ep
  all_x = jax.lax.all_gather(x_PD, axis).reshape(ep * n, *x_PD.shape[1:])
  o = jnp.arange(m)
  hit_EP = (o[None] >= ex.recv_off[:, None]) & (o[None] < (ex.recv_off + ex.recv)[:, None])
  e_P = jnp.argmax(hit_EP, axis=0)
  src_P = (e_P // spd) * n + ex.src_off[e_P] + o - ex.recv_off[e_P]
  taken = jnp.take(all_x, src_P, axis=0, mode='clip')
  return jnp.where(hit_EP.any(0).reshape(m, *([1] * (x_PD.ndim - 1))), taken, out_PD)
