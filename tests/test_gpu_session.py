"""bench/gpu_session.sh, the one-lease GPU measurement, end to end on small shapes (any machine;
on a CPU it checks the script and the benchmarks' plumbing, not GPU speed)."""

import json
import os
import subprocess

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_the_gpu_session_runs_end_to_end_on_small_shapes(tmp_path):
  import sys

  env = {**os.environ, 'SIZE': 'tiny', 'OUT': str(tmp_path), 'PY': sys.executable}
  done = subprocess.run(
    ['bash', 'bench/gpu_session.sh'], cwd=ROOT, env=env, capture_output=True, text=True
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  log = (tmp_path / 'session.log').read_text()
  assert 'skipped at the deadline' not in log and log.count('== exit 0') == 8, log[-3000:]
  records = [json.loads(ln) for ln in (tmp_path / 'records.jsonl').read_text().splitlines()]
  checks = [r for r in records if r['bench'] == 'gpu_engine_check']
  assert [r['dtype'] for r in checks] == ['bfloat16', 'float32']
  assert all(r['engine'] == 'tokamax' for r in checks)
  assert all(r['worst_gradient_rel_error'] <= r['tolerance'] for r in checks)
  layers = [r for r in records if r['bench'] == 'moe_layer']
  assert [(r['engine'], r['dispatch'], r['mode']) for r in layers[::2]] == [
    ('tokamax', 'dropless', 'lora'),
    (layers[2]['engine'], 'capacity', 'lora'),
    ('ragged_dot', 'dropless', 'lora'),
  ]
  mfu = [(r['dispatch'], r['batch']) for r in records if r['bench'] == 'mfu']
  assert mfu == [('dropless', 2), ('capacity', 2), ('dropless', 1), ('dropless', 4)]
  assert (tmp_path / 'versions.txt').read_text().startswith('{')
