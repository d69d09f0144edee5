"""bench/gpu_session.sh, the one-lease GPU measurement, end to end on small shapes (any machine;
on a CPU it checks the script and the benchmarks' plumbing, not GPU speed)."""

import glob
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
  records = {}
  for path in glob.glob(str(tmp_path / '*.log')):
    lines = [ln for ln in open(path).read().splitlines() if ln.startswith('{')]
    records[os.path.basename(path)] = [json.loads(ln) for ln in lines]
  for dtype in ('float32', 'bfloat16'):
    (check,) = records[f'engine_check_{dtype}.log']
    assert check['engine'] == 'tokamax' and check['worst_gradient_rel_error'] <= check['tolerance']
  for name in ('ragged_dot', 'tokamax', 'grouped'):
    modes = {r['mode']: r for r in records[f'moe_layer_backend_{name}.log']}
    assert set(modes) == {'lora', 'full'} and modes['full']['engine'] == name
  assert [r['batch'] for r in records['mfu_dropless.log']] == [1, 2]
  assert records['mfu_capacity.log'][0]['dispatch'] == 'capacity'
