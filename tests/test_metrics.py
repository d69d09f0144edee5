"""The run's metrics files across a resume."""

import dataclasses
import glob
import json
import math
import struct
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from moetrain.core import sharding
from moetrain.model.families import MODEL_PRESETS
from moetrain.run import metrics, train_log


def events(logdir) -> list:
  """Every event in the TensorBoard files under logdir (TFRecord framing: length, its CRC, the
  record, its CRC)."""
  out = []
  for path in sorted(glob.glob(f'{logdir}/events.out.tfevents.*')):
    with open(path, 'rb') as f:
      data = f.read()
    at = 0
    while at < len(data):
      (n,) = struct.unpack('<Q', data[at : at + 8])
      out.append(event_pb2.Event.FromString(data[at + 12 : at + 12 + n]))
      at += 12 + n + 4
  return out


def test_a_resume_marks_where_records_start_over(tmp_path):
  """A run logged steps 1-4, was killed, and resumes from its checkpoint at step 2: metrics.jsonl
  keeps every record and marks the resume; TensorBoard is told to hide the events after step 2."""
  w = metrics.Writer(str(tmp_path))
  for s in (1, 2, 3, 4):
    w.write(s, {'loss': float(s)})
  w.close()
  w = metrics.Writer(str(tmp_path), resume_step=2)
  for s in (3, 4):
    w.write(s, {'loss': 10.0 * s})
  w.close()
  with open(tmp_path / 'metrics.jsonl') as f:
    records = [json.loads(line) for line in f]
  assert [(r['kind'], r['step']) for r in records] == [
    *(('train', s) for s in (1, 2, 3, 4)),
    ('resume', 2),
    ('train', 3),
    ('train', 4),
  ]
  starts = [e.step for e in events(tmp_path / 'tb') if e.HasField('session_log')]
  assert starts == [3]  # SessionLog START at purge_step: TensorBoard drops older events >= 3
  # The resumed run's scalars are all there.
  values = [(e.step, v.simple_value) for e in events(tmp_path / 'tb') for v in e.summary.value]
  assert values[-2:] == [(3, 30.0), (4, 40.0)]


def wandb_history(run_dir) -> tuple[list[str], list[dict]]:
  """(the W&B run ids, the logged rows) of the offline runs under run_dir/wandb: their .wandb
  files are LevelDB-style logs (a 7-byte header, then 32 KiB blocks of records: CRC, length,
  type; FULL or FIRST..LAST pieces) of wandb_internal_pb2.Record messages."""
  from wandb.proto import wandb_internal_pb2 as pb

  ids, rows = [], []
  for path in sorted(glob.glob(f'{run_dir}/wandb/offline-run-*/run-*.wandb')):
    with open(path, 'rb') as f:
      data = f.read()
    assert data[:4] == b':W&B'
    at, piece = 7, b''
    while at + 7 <= len(data):
      if 32768 - at % 32768 < 7:  # a block's padding
        at += 32768 - at % 32768
        continue
      _, n, kind = struct.unpack('<IHB', data[at : at + 7])
      piece, at = piece + data[at + 7 : at + 7 + n], at + 7 + n
      if kind == 0:
        break
      if kind in (1, 4):  # FULL, LAST
        record = pb.Record.FromString(piece)
        piece = b''
        if record.HasField('run'):
          ids.append(record.run.run_id)
        if record.HasField('history'):
          rows.append(
            {i.key or '/'.join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
          )
  return ids, rows


@pytest.mark.parametrize('cut', [2, 40, 'whole_last_line', 'garbage'])
def test_a_resume_after_a_cut_record_drops_it_first(tmp_path, cut):
  """A kill can leave metrics.jsonl's last record cut short (or, after a crash, bytes that are
  no JSON): the resume drops it before its marker, so every line parses and the resumed
  records follow on lines of their own."""
  w = metrics.Writer(str(tmp_path))
  for s in (1, 2, 3):
    w.write(s, {'loss': float(s), 'moe/layer0/entropy': 0.5})
  w.close()
  path = tmp_path / 'metrics.jsonl'
  data = path.read_bytes()
  if cut == 'garbage':
    data += b'\x00\x00\x00\n'
  elif cut == 'whole_last_line':
    data = data[:-1]  # only the newline lost: the record is whole, and kept
  else:
    data = data[:-cut]
  path.write_bytes(data)
  w = metrics.Writer(str(tmp_path), resume_step=2)
  w.write(3, {'loss': 30.0})
  w.close()
  records = [json.loads(line) for line in path.read_text().splitlines()]
  steps = [(r['kind'], r['step']) for r in records]
  kept = 2 if cut in (2, 40) else 3
  assert steps == [*(('train', s) for s in range(1, kept + 1)), ('resume', 2), ('train', 3)]


def test_weights_and_biases_in_offline_mode(tmp_path, monkeypatch):
  """train.wandb_project sends the scalars (eval ones under eval/) to W&B as well; a resumed
  run logs into the same W&B run (its id kept in the run directory)."""
  pytest.importorskip('wandb')
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  wandb = {'project': 'moetrain-test', 'config': {'train': {'steps': 4}}}
  w = metrics.Writer(str(tmp_path), wandb=wandb)
  w.write(1, {'loss': 2.5, 'skipped': 0.0, 'learning_rate': 1e-3})
  w.write(2, {'loss': float('nan')})  # (non-finite: in metrics.jsonl as null, not sent)
  w.write(2, {'loss': 2.0, 'accuracy': 0.5}, kind='eval')
  w.close()
  time.sleep(1.1)  # (W&B names an offline run's directory by the second it started in)
  w = metrics.Writer(str(tmp_path), resume_step=2, wandb=wandb)
  w.write(3, {'loss': 1.5})
  w.close()
  ids, rows = wandb_history(tmp_path)
  assert len(ids) == 2 and ids[0] == ids[1] == (tmp_path / 'wandb_run_id').read_text()
  got = [{k: v for k, v in r.items() if not k.startswith('_')} | {'step': r['_step']} for r in rows]
  assert sorted(got, key=lambda r: r['step']) == [  # (the two runs' files: in either order)
    {'step': 1, 'loss': 2.5, 'skipped': 0.0, 'learning_rate': 1e-3},
    {'step': 2, 'eval/loss': 2.0, 'eval/accuracy': 0.5},
    {'step': 3, 'loss': 1.5},
  ]


def test_a_rerun_without_a_checkpoint_marks_that_it_starts_over(tmp_path):
  """A run killed before its first checkpoint logged steps 1-2; its rerun starts over from step
  0 and logs them again: marked as a resume from step 0, in metrics.jsonl and TensorBoard."""
  for loss in (1.0, 2.0):
    w = metrics.Writer(str(tmp_path))
    for s in (1, 2):
      w.write(s, {'loss': loss * s})
    w.close()
  with open(tmp_path / 'metrics.jsonl') as f:
    records = [(r['kind'], r['step']) for r in map(json.loads, f)]
  assert records == [('train', 1), ('train', 2), ('resume', 0), ('train', 1), ('train', 2)]
  starts = [e.step for e in events(tmp_path / 'tb') if e.HasField('session_log')]
  assert starts == [1]


def test_non_finite_values_are_json_null(tmp_path):
  """metrics.jsonl stays standard JSON (other languages' parsers reject NaN); TensorBoard gets
  the finite scalars only."""
  w = metrics.Writer(str(tmp_path))
  w.write(1, {'loss': math.nan, 'grad_norm': math.inf, 'tokens_per_sec': 5.0})
  w.close()
  line = (tmp_path / 'metrics.jsonl').read_text()
  assert 'NaN' not in line and 'Infinity' not in line
  rec = json.loads(line)
  assert (rec['loss'], rec['grad_norm'], rec['tokens_per_sec']) == (None, None, 5.0)
  tags = {v.tag for e in events(tmp_path / 'tb') for v in e.summary.value}
  assert tags == {'tokens_per_sec'}


def test_throughput_leaves_out_compilation_and_evals(monkeypatch):
  """tokens/s counts the steps' time only; the ETA leaves out the one-off compilation but keeps
  the periodic evals (the rest of the run pays for them too)."""
  clock = [100.0]
  monkeypatch.setattr(metrics.time, 'time', lambda: clock[0])
  meter = metrics.Throughput(start_step=0, total_steps=10)
  with meter.excluded(when=True):  # step 1 compiles for 30 s and runs: all of it left out
    clock[0] += 31
    meter.skip_step()
  clock[0] += 1  # step 2
  meter.add_tokens(100)
  clock[0] += 1  # step 3
  meter.add_tokens(100)
  with meter.excluded(recurring=True):  # an eval
    clock[0] += 5
  tps, eta = meter.mark(3)
  assert tps == 100.0
  assert eta == (2 + 5) / 2 * 7
  # A log point with only the skipped step (log_every=1) has no rate to report.
  meter = metrics.Throughput(start_step=0, total_steps=10)
  with meter.excluded(when=True):
    clock[0] += 31
    meter.skip_step()
  assert math.isnan(meter.mark(1)[0])


def test_a_log_point_is_timed_when_its_step_has_finished(monkeypatch):
  """The host dispatches steps 1-2 at once (async) and marks step 2; the device finishes step 2
  four seconds later, when its metrics are fetched: tokens/s counts those seconds, and the next
  step's tokens (dispatched before the fetch) go to the next log point."""
  from moetrain.run import train_log

  clock = [0.0]
  monkeypatch.setattr(metrics.time, 'time', lambda: clock[0])
  meter = metrics.Throughput(start_step=0, total_steps=4)
  reports = []

  def fetch(m):  # returns once step 2 has run on the device: at t = 4
    clock[0] += 4.0
    return m

  def report(step, m, tps, eta, truncated, window_steps):
    reports.append((step, tps, eta))
    assert window_steps == 2
    return m

  monkeypatch.setattr(train_log.jax, 'device_get', fetch)

  class Window:  # the steps' summed metrics
    last = None  # the last step's metrics: not computed yet when marked
    steps = 2

    def take(self):
      return {'loss': 1.0}

  log = train_log.TrainLog(report, meter, Window())
  meter.add_tokens(100)  # step 1 dispatched
  meter.add_tokens(100)  # step 2 dispatched
  log.mark(2, 0)
  meter.add_tokens(100)  # step 3 dispatched
  log.flush()
  assert reports == [(2, 200 / 4.0, 4.0)] and log.last == {'loss': 1.0}
  assert meter.tokens == 100

  # A backend that runs steps as they are dispatched (several CPU devices): step 4 has finished
  # when it is marked, at t = 6, and is timed then (2 s since the last point at t = 4), not
  # after step 5 has run and its metrics are fetched.
  class Done:
    def is_ready(self):
      return True

  log.window.last = {'loss': Done()}
  clock[0] += 2.0  # step 3 and 4 run
  meter.add_tokens(100)  # step 4 dispatched
  log.mark(4, 0)
  clock[0] += 3.0  # step 5 runs
  log.flush()
  assert reports[-1][:2] == (4, 200 / 2.0)


def test_peak_flops_by_device_kind():
  from types import SimpleNamespace

  from moetrain.run import metrics

  peak = lambda kind: metrics.peak_flops(SimpleNamespace(device_kind=kind))
  assert peak('NVIDIA H100 80GB HBM3') == 989e12
  assert peak('NVIDIA H100 PCIe') == 756e12  # the longer prefix
  assert peak('cpu') is None


class _Cfg:
  n_routed_experts = 4
  moe_layer_indices = (0,)


def _stats() -> dict:
  return {k: [0.0] for k in metrics.ROUTING_STATS if k != 'router_entropy'}


def test_window_reports_the_steps_since_the_last_log():
  """Two steps in one window: loss and accuracy per scored token over both, the learning rate and
  skipped count as of the last, the rest (routing stats, load, each step's imbalance) as means."""

  def step(loss, tokens, lr, load):
    load = jnp.array([load], jnp.float32)  # one layer, 4 FFN experts + 1 zero expert
    return {
      'loss': jnp.float32(loss),
      'total_loss': jnp.float32(loss),
      'accuracy': jnp.float32(loss / 10),
      'tokens': jnp.float32(tokens),
      'grad_norm': jnp.float32(loss),
      'learning_rate': jnp.float32(lr),
      'skipped': jnp.int32(lr > 1),
      'moe': {'load': load, 'router_entropy': jnp.array([loss])},
    }

  w = metrics.Window(n_routed=4, expert_shards=2)
  # Each step has one expert at twice the mean and one shard (of two experts) at 1.5x; the hot
  # ones differ, so the mean load is balanced.
  w.add(step(2.0, 30, 1.0, [8, 4, 0, 4, 0]))
  w.add(step(4.0, 10, 2.0, [0, 4, 8, 4, 0]))
  out = w.take()
  assert w.steps == 0 and w.acc is None
  np.testing.assert_allclose(out['loss'], (2 * 30 + 4 * 10) / 40)
  np.testing.assert_allclose(out['accuracy'], (0.2 * 30 + 0.4 * 10) / 40)
  np.testing.assert_allclose(out['grad_norm'], 3.0)
  np.testing.assert_allclose(out['tokens'], 20.0)
  assert float(out['learning_rate']) == 2.0 and float(out['skipped']) == 1.0
  np.testing.assert_allclose(out['moe']['load'], [[4, 4, 4, 4, 0]])
  np.testing.assert_allclose(out['moe']['router_entropy'], [3.0])
  # The steps' own imbalance, not that of the mean load (1).
  np.testing.assert_allclose(out['moe']['expert_max_over_mean'], [2.0])
  np.testing.assert_allclose(out['moe']['shard_imbalance'], [1.5])
  summary = metrics.routing_summary(jax.device_get(out['moe']) | _stats(), _Cfg, 2)
  assert summary['moe/expert_max_over_mean'] == 2.0 and summary['moe/shard_imbalance'] == 1.5
  w.add(step(1.0, 5, 3.0, [1, 1, 1, 1, 0]))  # a new window starts empty
  np.testing.assert_allclose(w.take()['loss'], 1.0)
  # A skipped (non-finite) step stays out of the means; a window of only such steps shows it.
  w.add(step(1.0, 5, 3.0, [1, 1, 1, 1, 0]))
  w.add({**step(1.0, 5, 4.0, [1, 1, 1, 1, 0]), 'grad_norm': jnp.float32(np.inf)})
  out = w.take()
  assert float(out['grad_norm']) == 1.0 and float(out['learning_rate']) == 4.0
  w.add({**step(2.0, 5, 4.0, [1, 1, 1, 1, 0]), 'grad_norm': jnp.float32(np.inf)})
  out = w.take()
  assert float(out['grad_norm']) == np.inf and float(out['loss']) == 2.0


def test_train_log_splits_loads_by_shard_only_under_expert_parallelism():
  mesh = sharding.make_mesh((1, 1, 2, 1), jax.devices()[:2])
  for parallel, shards in ((True, 2), (False, 1)):
    model = MODEL_PRESETS['tiny'].with_engine(moe_expert_parallel=parallel)
    model = model.laid_out('cpu', mesh)
    setup = types.SimpleNamespace(
      model=model,
      data=types.SimpleNamespace(seq_len=8),
      train=types.SimpleNamespace(max_nonfinite_steps=20),
    )
    log = train_log.TrainLog.create(setup, meter=None, writer=None)
    assert log.report.keywords['expert_shards'] == shards


def test_nonfinite_streak_counts_skipped_steps_in_a_row():
  """A step is skipped when its loss or gradient norm is not finite (as the train step decides);
  the streak counts them in a row, and the longest since the last log point is kept."""
  streak = train_log.Streak()
  nan = jnp.float32(np.nan)

  def step(loss=1.0, grad_norm=1.0):
    streak.add({'total_loss': jnp.float32(loss), 'grad_norm': jnp.float32(grad_norm)})

  assert streak.take() == (0, 0)  # no step yet
  step(nan)
  step(grad_norm=np.inf)
  step(nan)
  assert [int(x) for x in streak.counts] == [3, 3]
  step()
  step(nan)
  assert [int(x) for x in streak.take()] == [1, 3]
  assert [int(x) for x in streak.counts] == [1, 1]  # the longest starts over
  step()
  assert [int(x) for x in streak.take()] == [0, 1]


@pytest.mark.parametrize('preset', ['flash', 'qwen3_30b_a3b', 'deepseek_v3_671b'])
def test_flops_per_token_counts_each_attention_block_once(preset):
  """6 x the matmul weights plus causal attention: per attention block (two per LongCat layer,
  one per standard layer) and head, (d_qk + d_v) x T / 2 multiply-adds, x 6 for training."""

  cfg, t = MODEL_PRESETS[preset], 4096
  blocks = cfg.num_layers * (2 if cfg.layer_layout == 'shortcut' else 1)
  d_v = cfg.gqa_head_dim if cfg.attention == 'gqa' else cfg.v_head_dim
  attn = blocks * cfg.num_heads * (cfg.qk_head_dim + d_v) * t / 2
  want = 6 * (metrics.matmul_params_per_token(cfg, 8) + attn)
  np.testing.assert_allclose(metrics.flops_per_token(cfg, t, 8), want, rtol=1e-12)


@pytest.mark.parametrize('t', [2048, 8192])
def test_sparse_attention_flops_count_the_selected_keys_and_the_indexer(t):
  """DeepSeek-V3.2 (index_topk 2048): position p's queries attend to min(p, 2048) keys, and the
  indexer's 64 heads score (128 + 1) x p / 2 multiply-adds a token, forward only while frozen;
  x 3 with its KL loss training it. At 2048 tokens the attention is dense's (T / 2 keys)."""
  cfg = MODEL_PRESETS['deepseek_v32_671b']
  keys = t / 2 if t <= 2048 else np.minimum(np.arange(1, t + 1), cfg.index_topk).mean()
  attn = cfg.num_layers * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * keys
  index = 2 * cfg.num_layers * 64 * 129 * t / 2
  want = 6 * (metrics.matmul_params_per_token(cfg, 8) + attn) + index
  np.testing.assert_allclose(metrics.flops_per_token(cfg, t, 8), want, rtol=1e-12)
  trained = dataclasses.replace(cfg, train_indexer=True)
  np.testing.assert_allclose(
    metrics.flops_per_token(trained, t, 8) - metrics.flops_per_token(cfg, t, 8), 2 * index
  )


def test_an_error_before_the_first_record_is_not_followed_by_a_traceback(tmp_path):
  """A run that fails after its writer opened and before anything was logged (a checkpoint or
  teacher that does not load) ends on its error alone: TensorBoard's writer starts with the
  first event, so none is left for the exit to clean up ("can't create new thread at
  interpreter shutdown")."""
  import subprocess
  import sys

  from tests.helpers import ROOT

  code = (
    'import sys\n'
    'from moetrain.run import metrics\n'
    f'w = metrics.Writer({str(tmp_path / "run")!r})\n'
    "sys.exit('Error: the teacher does not load')\n"
  )
  done = subprocess.run(
    [sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 1 and done.stderr.endswith('Error: the teacher does not load\n')
  assert 'Traceback' not in done.stderr, done.stderr
