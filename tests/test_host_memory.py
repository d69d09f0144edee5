"""Host memory: a random base drawn and quantised a slice at a time (kernels/quant.drawn_param), a
Hugging Face import's embedding and head read in chunks, and the CPU planner's peak against the
measured peak RSS of a run."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import deepseek_v3_lora
from moetrain.kernels import quant
from moetrain.model.transformer import Transformer
from moetrain.run.startup import build
from moetrain.training import optim
from moetrain.training.train_state import init_state, state_shardings
from tests.helpers import ROOT, tiny, with_lora


def _flat(model):
  return {'.'.join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize('bits', [pytest.param('int8', marks=pytest.mark.slow), 'int4'])
def test_sliced_draw_stores_what_make_param_stores(bits, monkeypatch):
  """Drawn in slices, a quantised kernel has make_param's shapes and axes, and decodes to the
  float kernel the same keys draw (its codes and scales are joined in the same order)."""
  monkeypatch.setattr(quant, 'SLICE_ELEMENTS', 2**8)
  cfg = tiny(quant=bits, param_dtype='float32')
  sliced = _flat(Transformer(cfg, nnx.Rngs(0)))
  monkeypatch.setattr(quant, 'SLICE_ELEMENTS', 2**40)
  whole = _flat(Transformer(cfg, nnx.Rngs(0)))
  for k, v in whole.items():
    assert sliced[k].get_value().shape == v.get_value().shape, k
    assert sliced[k].get_metadata().get('axes') == v.get_metadata().get('axes'), k
  monkeypatch.setattr(quant, 'SLICE_ELEMENTS', 2**8)
  plain = Transformer(tiny(quant='none', param_dtype='float32'), nnx.Rngs(0))
  model = Transformer(cfg, nnx.Rngs(0))
  step = {'int8': 1 / 127, 'int4': 1 / 7}[bits]
  for name in ('gate', 'down'):
    w = getattr(plain.layers.moe.experts, name)[...]
    q = quant.value(getattr(model.layers.moe.experts, name), jnp.float32)
    bound = step * np.max(np.abs(w)) / 2 + 1e-7
    assert np.max(np.abs(np.asarray(q - w))) <= bound, name
  w, q = plain.lm_head.kernel[...], quant.value(model.lm_head.kernel, jnp.float32)
  assert np.max(np.abs(np.asarray(q - w))) <= step * np.max(np.abs(w)) / 2 + 1e-7


@pytest.mark.parametrize('quant_mode', ['none', 'int8', 'int4'])
def test_an_import_reads_the_embedding_and_head_in_chunks(quant_mode, monkeypatch):
  """The unstacked variables (embedding [V, D] along V, the head [D, V] along V) are read and
  quantised a chunk at a time into their buffers: the same arrays as read whole, on a mesh that
  splits them over fsdp and on one device."""
  from moetrain.convert import hf
  from moetrain.convert import stacked_io as sio
  from moetrain.core import sharding
  from moetrain.data import demo_base

  path = str(demo_base.DIR)
  mesh = sharding.make_mesh((1, 2, 2, 2))
  lora = with_lora(tiny()).lora  # (a quantised base is a frozen one)
  cfg = hf.config_from_hf(hf.read_config(path), quant=quant_mode, quant_group_size=16, lora=lora)
  meshed = cfg.laid_out('cpu', mesh)
  chunks = []
  original = sio._chunks
  monkeypatch.setattr(sio, '_chunks', lambda *a: chunks.append(original(*a)) or chunks[-1])
  for c, m in ((cfg, None), (meshed, mesh)):
    monkeypatch.setattr(sio, 'CHUNK_BYTES', 2**40)
    whole = hf.load_params(path, c, mesh=m)
    monkeypatch.setattr(sio, 'CHUNK_BYTES', 8 * 2**10)
    chunks.clear()
    chunked = hf.load_params(path, c, mesh=m)
    assert sum(len(x) > 2 for x in chunks if x) >= 2  # the embedding and the head, in chunks
    for part in ('params', 'frozen'):
      got = jax.tree.leaves(getattr(chunked, part))
      want = jax.tree.leaves(getattr(whole, part))
      assert len(got) == len(want)
      for g, w in zip(got, want):
        assert g.sharding == w.sharding
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_random_int4_init_holds_no_float32_layer():
  """Moonlight's shapes (two of its layers) with an int4 base: the random init compiled for this
  host, abstractly, keeps its temporaries under a quarter of one MoE layer's routed experts in
  float32, which drawing a layer whole and quantising it after needs several times over (the
  whole model so drawn: 148 GiB of temporaries for the 10 GiB state)."""
  config = deepseek_v3_lora.get_config('variant=moonlight_16b_a3b')
  config.engine.quant = 'int4'
  config.model.num_layers = 2
  config.mesh.shape = (1, -1, 1, 1)
  setup = build(config, num_devices=1, process_count=1, training=False, platform='cpu')
  mesh = setup.make_mesh(jax.devices('cpu')[:1])
  opt = optim.make_optimizer(setup.optim, setup.train.steps)
  init = lambda: init_state(setup.model, opt, setup.seed)
  out = state_shardings(jax.eval_shape(init), mesh, setup.model.engine.rules)
  m = jax.jit(init, out_shardings=out).lower().compile().memory_analysis()
  c = setup.model
  float32_layer = 3 * c.n_routed_experts * c.hidden_size * c.expert_ffn_hidden_size * 4
  assert m.temp_size_in_bytes < float32_layer / 4, (m.temp_size_in_bytes, float32_layer)


# A small DeepSeek-V3 (a dense and an MoE layer) trained whole: 0.4 GiB of state and as much of
# step buffers beside the 0.23 GiB Python/JAX baseline, at a step under a second.
SMALL = (
  '--config=configs/deepseek_v3_lora.py',
  '--config.lora.rank=0',
  '--config.model.num_layers=2',
  '--config.model.hidden_size=512',
  '--config.model.n_routed_experts=32',
  '--config.model.expert_ffn_hidden_size=512',
  '--config.model.vocab_size=8192',
  '--config.data.global_batch_size=2',
  '--config.data.eval_batch_size=2',
  '--config.train.steps=2',
  '--config.optim.warmup_steps=0',
  '--config.train.eval_batches=1',
)


def _start(module: str, *args: str, **env: str) -> subprocess.Popen:
  """`python -m module args` as a user runs it (huge-page malloc included), on one CPU device."""
  skip = ('XLA_FLAGS', 'MOETRAIN_NO_REEXEC', 'GLIBC_TUNABLES')
  env = {k: v for k, v in os.environ.items() if k not in skip} | env
  env |= {'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': ROOT}
  return subprocess.Popen(
    [sys.executable, '-m', module, *args],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _wait(p: subprocess.Popen) -> tuple[str, int]:
  """Its output and peak resident bytes."""
  out = p.stdout.read()
  _, status, usage = os.wait4(p.pid, 0)
  p.returncode = os.waitstatus_to_exitcode(status)
  assert p.returncode == 0, out[-3000:]
  return out, usage.ru_maxrss * 1024


# Slow: alone it passes (plan 1.78 GB, measured within 15%), and so it does beside two busy
# processes and the plan's own compile (1.64 GiB); but inside the two workers of a pytest-xdist
# suite the same run measured 3.34 and 3.41 GB for that plan, not yet explained.
@pytest.mark.slow
def test_cpu_plan_predicts_the_peak_resident_memory_of_a_run(tmp_path):
  """The CPU plan of a small run (its first start: compiled, not read from a compilation cache)
  against the peak resident memory of the run itself, two steps and two evaluations in a
  subprocess: within 15%."""
  plan_json = tmp_path / 'plan.json'
  cache = str(tmp_path / 'plans.json')
  plan = _start(
    'moetrain.tools.plan',
    *SMALL,
    '--topology=cpu',
    f'--json={plan_json}',
    MOETRAIN_PLAN_CACHE=cache,
  )
  run = _start(
    'moetrain.main',
    *SMALL,
    f'--workdir={tmp_path / "run"}',
    '--config.train.compilation_cache=',
  )
  _wait(plan)
  _, measured = _wait(run)
  predicted = json.loads(plan_json.read_text())['per_chip_bytes']['total']
  assert abs(predicted / measured - 1) <= 0.15, (predicted, measured)


def test_cpu_hosts_by_name():
  from moetrain.planner import cpu_plan

  here = cpu_plan.parse('cpu')
  assert here.this_host and here.ram_bytes == cpu_plan.this_ram()
  other = cpu_plan.parse('cpu:64GB:16')
  assert (other.ram_bytes, other.cores, other.this_host) == (64 * 2**30, 16, False)
  assert cpu_plan.parse('cpu::4').ram_bytes == here.ram_bytes
  with pytest.raises(ValueError, match='cpu:64GB:16'):
    cpu_plan.parse('cpu-64')


def test_the_cpu_estimate_counts_what_remat_recomputes():
  """model FLOPs leave remat out; the CPU plan's estimate adds the forward the backward reruns:
  under save_moe all of full's but the routed experts' (2 K_e 3 D F per MoE layer and token)."""
  from moetrain.planner import sizes, tpu_plan

  def again(remat):
    config = deepseek_v3_lora.get_config('')
    config.engine.remat = remat
    return tpu_plan.recompute_flops(build(config, num_devices=1, process_count=1))[0]

  config = deepseek_v3_lora.get_config('')
  setup = build(config, num_devices=1, process_count=1)
  m = setup.model
  tokens = setup.data.global_batch_size * setup.data.seq_len
  routed = 2 * sizes.balance_target(m) * 3 * m.hidden_size * m.expert_ffn_hidden_size
  routed *= m.num_moe_layers * tokens
  full, save_moe, none = again('full'), again('save_moe'), again('none')
  assert none == 0 and full > save_moe > 0
  np.testing.assert_allclose(full - save_moe, routed, rtol=1e-9)
  model, _ = tpu_plan.model_flops(setup)
  assert full < model / 2  # a forward of the layers: under half a LoRA step's 4 N per token


@pytest.mark.slow
def test_real_size_bench_records_a_tiny_run(tmp_path):
  """bench/cpu_real_size.py on the tiny preset: the plan, then the run, one JSON record."""
  out = tmp_path / 'records.jsonl'
  p = _start('bench.cpu_real_size', '--preset=tiny', '--plan', f'--out={out}')
  _wait(p)
  (record,) = [json.loads(ln) for ln in out.read_text().splitlines()]
  assert record['end_eval'] and record['step_s'] > 0 and record['startup_s'] > 0
  assert 0.85 <= record['plan_over_measured'] <= 1.15, record


def test_cpu_search_keeps_the_configured_sequence_and_prints_flags(monkeypatch, capsys, tmp_path):
  """--search on a CPU host, the compiles stubbed: plans that leave 10% free beat those that do
  not; among them the configured sequence length first, then tokens/s; the winner's flags print."""
  from moetrain.planner import cpu_plan, tpu_plan

  def fake(config, jobs, workers, cache, **kw):
    out = []
    for _, o in jobs:
      need = 30 if o.get('engine.quant') == 'none' else 8  # GiB, of 16
      tps = 200 if 'data.seq_len' in o else 100 + 10 * o.get('optim.grad_accum_steps', 0)
      out.append(
        {
          'overrides': o,
          'fits': need < 16,
          'headroom': 1 - need / 16,
          'need_bytes': need * 2**30,
          'est_tokens_per_sec': tps,
          'per_chip_bytes': {'total': need * 2**30},
        }
      )
    return out

  monkeypatch.setattr(tpu_plan, 'plan_many', fake)
  monkeypatch.setattr(cpu_plan, 'print_plan', lambda r: print('PLAN', r['overrides']))
  config = deepseek_v3_lora.get_config()
  config.data.global_batch_size = 4
  cpu_plan.main(config, 'cpu:16GB', True, str(tmp_path / 'p.json'), 1, cache=str(tmp_path / 'c'))
  out = capsys.readouterr().out
  assert "PLAN {'optim.grad_accum_steps': 4}" in out, out
  assert '--config.optim.grad_accum_steps=4' in out


def _drop_key(tree, key: str) -> bool:
  """Removes `key` from the first dict in `tree` that holds it."""
  if isinstance(tree, dict):
    if key in tree:
      del tree[key]
      return True
    return any(_drop_key(v, key) for v in tree.values())
  return False


@pytest.mark.parametrize('stored', ['[]', 'null', '{"cut', 'a plan missing a key'])
def test_a_plan_cache_of_another_shape_is_rebuilt_with_a_note(
  stored, monkeypatch, capsys, tmp_path
):
  """The plan cache holding no JSON object ([], null, cut short) or a plan missing a key: the
  plan is made again, with a note naming the cache, which is rebuilt."""
  from moetrain.planner import cpu_plan

  plans = []
  fake = {'overrides': {}, 'fits': True, 'need_bytes': 2**30}
  monkeypatch.setattr(cpu_plan, 'plan', lambda *a, **k: plans.append(a) or dict(fake))
  monkeypatch.setattr(cpu_plan, 'print_plan', lambda r: print('PLAN', r['fits']))
  config, cache = deepseek_v3_lora.get_config(), tmp_path / 'plans.json'
  run = lambda: cpu_plan.main(config, 'cpu:16GB', False, '', 1, cache=str(cache))  # noqa: E731
  run()
  if stored == 'a plan missing a key':
    saved = json.loads(cache.read_text())
    assert _drop_key(saved, 'fits')
    cache.write_text(json.dumps(saved))
  else:
    cache.write_text(stored)
  capsys.readouterr()
  run()
  out, err = capsys.readouterr()
  assert len(plans) == 2 and 'PLAN True' in out
  assert f'Note: {cache}' in err and ('planned again' in err or 'rebuilt' in err), err
  run()  # the rebuilt cache answers
  out, err = capsys.readouterr()
  assert len(plans) == 2 and 'answered from the plan cache' in out and not err


@pytest.mark.parametrize('stored', ['[]', 'null', 'an entry missing a key'])
def test_a_host_cache_of_another_shape_is_measured_again(stored, monkeypatch, capsys, tmp_path):
  from moetrain.planner import cpu_plan

  monkeypatch.setattr(cpu_plan, 'baseline_rss', lambda: 2**30)
  monkeypatch.setattr(cpu_plan, 'matmul_rate', lambda dtype: 1e11)
  cache = tmp_path / 'host.json'
  if stored == 'an entry missing a key':
    stored = json.dumps({cpu_plan._fingerprint(): {'baseline_rss': 2**30, 'measured': 'then'}})
  cache.write_text(stored)
  measured = cpu_plan.host_measurements(str(cache))
  assert measured['matmul_flops'] == {'float32': 1e11, 'bfloat16': 1e11}
  assert f'Note: {cache}' in capsys.readouterr().err
  assert json.loads(cache.read_text())[cpu_plan._fingerprint()] == measured
  assert cpu_plan.host_measurements(str(cache)) == measured and not capsys.readouterr().err
