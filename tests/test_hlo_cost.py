"""FLOPs counted from optimized HLO with loop trip counts (moetrain/core/hlo_cost.py)."""

import os
import re

import jax
import jax.numpy as jnp
import pytest

from moetrain.core import hlo_cost


def _looped_matmul_hlo(trips: int = 7) -> str:
  def f(x, w):
    return jax.lax.fori_loop(0, trips, lambda i, x: jnp.tanh(x @ w), x)

  return jax.jit(f).lower(jnp.ones((16, 32)), jnp.ones((32, 32))).compile().as_text()


def test_top_matmuls_count_each_site_with_its_loop_trips():
  text = _looped_matmul_hlo(7)
  (site,) = hlo_cost.top_matmuls(text, 5)
  assert site.runs == 7 and site.op == 'dot'
  assert site.flops == 7 * 2 * 16 * 32 * 32
  cost = hlo_cost.analyse(text)
  assert cost.flops == pytest.approx(site.flops) and cost.flops_once == pytest.approx(
    site.flops / 7
  )


def test_the_listing_command_prints_the_share_of_each_site(tmp_path, capsys):
  path = tmp_path / 'module.txt'
  path.write_text(_looped_matmul_hlo(3))
  hlo_cost.main([str(path), '3'])
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith('FLOPs 9.83e+04')
  assert (
    out[1].startswith('100.0% 9.83e+04 = 3 x dot') and '[16, 32] , [32, 32] -> [16, 32]' in out[1]
  )


# A batched matmul as XLA's TPU compiler writes it (the o projection's input gradient of the
# flash step): the 64 heads are a spatial dim of window 64 over an input of size 1 padded by 63
# on both sides, so each output position meets one input position, not 64.
PADDED_BATCH_CONV = """HloModule m

ENTRY %main (p0: bf16[8192,512,1], p1: bf16[64,256,512]) -> bf16[8192,64,256] {
  %p0 = bf16[8192,512,1]{2,1,0} parameter(0)
  %p1 = bf16[64,256,512]{2,1,0} parameter(1)
  ROOT %convolution.1 = bf16[8192,64,256]{2,1,0} convolution(%p0, %p1), window={size=64 pad=63_63 rhs_reversal=1}, dim_labels=bf0_0oi->b0f
}
"""


def test_a_batched_matmul_written_as_a_padded_convolution_counts_once_per_batch():
  assert hlo_cost.analyse(PADDED_BATCH_CONV).flops == 2 * 8192 * 64 * 256 * 512


SPLASH_HLO = os.path.join(os.path.dirname(__file__), 'fixtures', 'hlo', 'splash_grad_v5e.txt')


def test_a_jax_0_12_dump_with_pallas_kernels_is_read_whole():
  """jax 0.12 writes a Pallas call's metadata over several lines, one beginning '}}, metadata=';
  read line by line it closed its computation early and the kernels after it were lost."""
  text = open(SPLASH_HLO).read()
  assert '\n}}, metadata=' in text  # the fixture has the multi-line form
  comps, entry = hlo_cost.parse_module(text)
  written = sum(1 for line in text.splitlines() if hlo_cost._INSTR.match(line))
  assert sum(len(v) for v in comps.values()) == written
  names = [i.name for i in comps[entry]]
  assert any(n.startswith('splash_mha_dkv') for n in names), names


def test_splash_kernels_are_priced_as_causal_attention():
  """The fixture: one row, 4 heads, T = S = 1024 in blocks of 512 (3 of 4 visited), q/k width
  192 and v 128: the forward's 2 products, dq's 3 and dkv's 4."""
  sites = {
    s.name.split('_segmented')[0]: s.flops for s in hlo_cost.top_matmuls(open(SPLASH_HLO).read())
  }
  one = lambda h: 2 * 4 * 1024 * 1024 * h * 0.75
  assert sites['splash_mha_fwd'] == one(192) + one(128)
  assert sites['splash_mha_dq'] == 2 * one(192) + one(128)
  assert sites['splash_mha_dkv'] == 2 * one(192) + 2 * one(128)


def test_a_splash_call_under_the_full_mask_scope_is_priced_whole():
  """kernels/ring_splash.py runs its whole-mask calls under FULL_MASK_SCOPE: every block of the
  grid is priced (the fixture's 4 of 4, where a causal one's are 3)."""
  text = open(SPLASH_HLO).read()
  scoped = re.sub(
    r'(op_name="[^"]*)(splash_mha_fwd)', rf'\1{hlo_cost.FULL_MASK_SCOPE}/\2', text, count=0
  )
  assert scoped != text

  def fwd(t):
    sites = hlo_cost.top_matmuls(t)
    return next(s.flops for s in sites if s.name.startswith('splash_mha_fwd'))

  assert fwd(scoped) == pytest.approx(fwd(text) / 0.75)


def test_a_conditional_counts_its_costliest_branch():
  """One branch of a conditional runs: its FLOPs are the larger branch's, not the sum."""

  def f(p, x, w):
    return jax.lax.cond(p, lambda: (x @ w) @ w, lambda: x @ w)

  args = (True, jnp.ones((16, 32)), jnp.ones((32, 32)))
  text = jax.jit(f).lower(*args).compile().as_text()
  assert ' conditional(' in text
  assert hlo_cost.analyse(text).flops == 2 * (2 * 16 * 32 * 32)


def test_a_windowed_einsum_loop_counts_its_stride():
  """XLA:TPU gathers an FSDP-sharded weight chunk by chunk inside a loop that takes two chunks
  per trip (one from each direction around the ring): the counter steps by 2. Read as a step of
  1, the loop ran twice and the matmul's FLOPs doubled."""
  pytest.importorskip('libtpu')
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from moetrain.planner import topology
  from moetrain.training import aot

  mesh = jax.sharding.Mesh(topology.parse('v5p-32').devices(), ('fsdp',))
  shard = NamedSharding(mesh, P('fsdp'))
  x = jax.ShapeDtypeStruct((32, 4096, 4096), jnp.bfloat16, sharding=shard)
  w = jax.ShapeDtypeStruct((4096, 32, 128), jnp.bfloat16, sharding=shard)
  f = jax.jit(lambda x, w: jnp.einsum('btd,dnh->btnh', x, w), out_shardings=shard)
  text = aot.compile_fn('f', f, [x, w], analyse=False, cache=False).executable.as_text()
  assert 'windowed_dot_general' in text
  assert hlo_cost.analyse(text).flops == 2 * 2 * 4096 * 4096 * 4096  # 2 rows per chip


def test_a_scan_over_stacked_weights_reads_one_layer_per_trip():
  """Each trip of a layer scan slices one layer out of the [L, ...] stack: that reads the
  layer, not the stack (counted whole, the stack weighed L times its size per trip)."""
  n, layers = 256, 16

  def f(x, ws):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), h.sum()), x, ws)

  text = jax.jit(f).lower(jnp.ones((n, n)), jnp.ones((layers, n, n))).compile().as_text()
  comps, _ = hlo_cost.parse_module(text)
  layer = n * n * 4
  slices = []
  for instrs in comps.values():
    table = {i.name: i for i in instrs}
    for i in instrs:
      reads_stack = any(
        table[o].shapes == [('f32', [layers, n, n])] for o in i.operands if o in table
      )
      if reads_stack and i.op in ('fusion', 'dynamic-slice'):
        slices.append(hlo_cost._traffic(i, table, comps))
  assert slices and all(t <= 2 * layer + 64 for t in slices), (slices, layer)


def test_cross_slice_collectives_count_their_bytes_over_the_network():
  """On two slices, a sum over the axis that spans them is an all-reduce across the data-center
  network (a megascale host transfer in the slice's program): each of the loop's 3 trips sends
  the chip's [1, 1024] float32 share, 2 (d - 1) / d = 1 times over d = 2 slices."""
  pytest.importorskip('libtpu')
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from moetrain.planner import topology
  from moetrain.training import aot

  devices = topology.parse('2xv5e-4').devices()
  grid = np.array(sorted(devices, key=lambda d: (d.slice_index, d.id))).reshape(2, 4)
  rows = NamedSharding(jax.sharding.Mesh(grid, ('slice', 'chip')), P('slice', None))

  def f(y):
    return jax.lax.fori_loop(0, 3, lambda i, y: jnp.tanh(y) + y.sum(0, keepdims=True), y)

  y = jax.ShapeDtypeStruct((2, 1024), jnp.float32, sharding=rows)
  step = jax.jit(f, out_shardings=rows)
  text = aot.compile_fn('f', step, [y], analyse=False, cache=False).executable.as_text()
  assert hlo_cost.dcn_bytes(hlo_cost.analyse(text), 2) == 3 * 1024 * 4
