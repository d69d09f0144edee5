"""The liveness walk over compiled HLO (moetrain.core.hlo_memory), checked against XLA's TPU compiler's
own temporaries, and what it found: the attention backward kept every block's scores."""

import jax
import jax.numpy as jnp
import pytest

from configs import longcat_lora
from moetrain.core import hlo_memory, sharding
from moetrain.planner import topology, tpu_plan
from moetrain.run.startup import build
from moetrain.training import aot
from tests.helpers import tpu_proxy

pytest.importorskip('libtpu', reason="TPU compiles need libtpu: pip install -e '.[tpu]'")


def _compile_for_tpu(fn, *shapes):
  devices = topology.parse('v5e-1').devices()
  mesh = jax.sharding.Mesh(devices, ('x',))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  args = [jax.ShapeDtypeStruct(s, d, sharding=spec) for s, d in shapes]
  # Compile-only executables cannot be read back from the persistent cache (aot.compile_fn).
  return aot.compile_fn('f', jax.jit(fn), args, analyse=False, cache=False).executable


def test_the_peak_is_the_compilers_temporaries_for_a_scanned_gradient():
  def f(x, w1, w2):
    def body(h, w):
      a = jnp.tanh(h @ w)
      return a, a.sum()

    h, sums = jax.lax.scan(body, x, w1)
    grad = jax.grad(lambda x: (jax.lax.scan(body, x, w2)[0].astype(jnp.float32) ** 2).sum())
    return grad(h), sums

  bf16 = jnp.bfloat16
  # Large enough that the residuals cannot sit in a v5e's 128 MiB of VMEM (libtpu 0.0.52 puts
  # a 64 MiB stack there, and then no HBM temporary is left to compare).
  c = _compile_for_tpu(f, ((8192, 2048), bf16), ((8, 2048, 2048), bf16), ((8, 2048, 2048), bf16))
  reported = c.memory_analysis().temp_size_in_bytes
  p = hlo_memory.peak(c.as_text())
  assert 0.9 * reported <= p.bytes <= reported, (p.bytes, reported)
  # The residuals the gradient's scan keeps: one [8, 8192, 2048] bf16 stack.
  top = hlo_memory.summary(p, top=3)
  assert top and top[0]['bytes'] == 8 * 8192 * 2048 * 2, top


def test_the_layout_padding_and_memory_spaces_are_counted():
  assert hlo_memory._elements('f32[4,512,8]{1,2,0:T(8,128)}') == [4 * 512 * 8 * 4]
  # The minor dimension pads to 128 lanes: 48 is minor in {1,0}, 1024 in {0,1}.
  assert hlo_memory._elements('bf16[1024,48]{1,0:T(8,128)(2,1)}') == [1024 * 128 * 2]
  assert hlo_memory._elements('bf16[1024,48]{0,1:T(8,128)(2,1)}') == [1024 * 48 * 2]
  vmem = '(bf16[32,512,512]{1,2,0:T(8,128)(2,1)}, bf16[32,512,512]{2,1,0:T(8,128)(2,1)S(1)})'
  assert hlo_memory._elements(vmem) == [32 * 512 * 512 * 2, 0]


# Slow (two TPU compiles, ~40 s): the XLA attention is no longer the TPU default (splash is).
@pytest.mark.slow
def test_attention_backward_recomputes_its_scores_in_the_tpu_step():
  """With engine.attention_recompute the backward keeps each query's softmax max and sum and
  recomputes the scores. XLA merged that recomputation with the forward's identical scores
  (CSE) and kept every block's float32 scores alive between the passes, O(T * S) after all:
  8.25 GiB of the flash LoRA step (bench/RESULTS.md, "Recomputed attention scores on TPU"). The training step of a small
  LongCat (4 heads, 1024 tokens in query blocks of 128, one layer, remat=full, the XLA attention
  rather than the TPU default, splash) on a v5e-1, with
  and without keeping the probabilities: recomputing must save most of their bytes."""
  over = tpu_proxy(1)
  config = longcat_lora.get_config('variant=tiny')
  m = config.model
  t, chunk = over['data.seq_len'], m.engine.attention_chunk
  scores = sum(4 * m.num_heads * chunk * min(end, t) for end in range(chunk, t + chunk, chunk))
  devices = topology.parse('v5e-1').devices()
  temps = []
  for recompute in (False, True):
    xla = {'engine.attention_kernel': 'xla', 'engine.attention_recompute': recompute}
    c = tpu_plan.with_overrides(config, over | xla)
    setup = build(c, num_devices=1, process_count=1, platform='tpu')
    mesh = sharding.make_mesh(setup.mesh_shape, devices)
    temps.append(aot.compile_steps(setup, mesh, evaluate=False)['train'].memory['temporaries'])
  assert temps[0] - temps[1] > 0.75 * scores, (temps, scores)
