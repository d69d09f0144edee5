"""Performance paths behind the model's math: each `Kernel` pairs a fast implementation (a
hand-written backward pass, a loop shaped for XLA:CPU, a collective) with a plain reference that
computes the same function and leaves the gradient to autodiff.

The model calls kernels, never their internals; `engine.kernels='reference'` runs every one of
them on its reference (slower; for checking numerics, or on a platform where a fast path
misbehaves). tests/test_kernels.py checks each fast path's values and gradients against its
reference, and that every custom VJP in moetrain is a Kernel's fast path.

  rows.gather_rows, rows.dispatch_tokens, rows.take_experts  permutations of the MoE's rows
  lora.lora_product                                            a LoRA adapter's two products
  attention.attention_core                                     blocked softmax attention
  ring.ring_attention                                          context shards' attention, a ring
  ring_splash.ring_splash_attention                            the same ring on the splash kernel
  cross_entropy.head_ce (head_cross_entropy calls it)          the lm head's chunked loss
  grouped.expert_ffn                                           the CPU grouped expert engine
  exchange.ragged_exchange                                     expert parallelism's ragged all-to-all
  experts.zero_grad_where_not                                  a cotangent zeroed outside a mask
  experts.ragged_adapter                                       an expert LoRA factor, float32 gradients
  delta_rule_tokamax.interpreted_kernel                        tokamax's delta rule, interpreted
The expert backends that need no backward of their own (ragged_dot, megablox, blocked,
gathered) are in experts.py."""

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One function two ways: `fast` (the one that runs) and `reference` (plain autodiff code of
  the same function). kernel(*args, reference=False) calls one of them."""

  name: str
  fast: Callable
  reference: Callable

  def __call__(self, *args, reference: bool = False):
    return (self.reference if reference else self.fast)(*args)
