"""Command-line tools on a finished run: evaluate and the expert-load heatmap."""

import json
import os

import numpy as np

from moetrain.tools import evaluate, expert_load
from tests.test_train import small_config, uninterrupted  # noqa: F401 (fixture)


def test_evaluate_reproduces_the_final_eval(uninterrupted):  # noqa: F811
  workdir, out = uninterrupted
  ev = evaluate.evaluate_checkpoint(small_config(), workdir, max_batches=1)
  assert ev['step'] == 6
  assert abs(ev['loss'] - out['eval_loss']) < 1e-6
  assert abs(ev['accuracy'] - out['eval_accuracy']) < 1e-9


def test_expert_load_heatmap(uninterrupted, tmp_path):  # noqa: F811
  workdir, _ = uninterrupted
  steps, loads = expert_load.read_loads(workdir)
  assert list(steps) == [1, 2, 3, 4, 5, 6] and loads.shape[1:] == (2, 12)
  out = expert_load.plot(steps, loads, str(tmp_path / 'load.png'), n_routed=8)
  with open(out, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  assert os.path.getsize(out) > 1000


def test_expert_load_after_a_resume(tmp_path):
  """A run resumed from step 2 after logging up to 4 logs 3 and 4 again: the heatmap keeps the
  resumed records, in step order, and draws uneven step intervals."""
  rec = lambda step, v: {'step': step, 'kind': 'train', 'moe/load': [[v, 1.0, 0.0]]}
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    for r in (rec(1, 1), rec(2, 2), rec(3, 3), rec(4, 4), rec(3, 30), rec(4, 40), rec(10, 5)):
      f.write(json.dumps(r) + '\n')
  steps, loads = expert_load.read_loads(str(tmp_path))
  assert list(steps) == [1, 2, 3, 4, 10]
  np.testing.assert_array_equal(loads[:, 0, 0], [1, 2, 30, 40, 5])
  out = expert_load.plot(steps, loads, str(tmp_path / 'load.png'))
  assert os.path.getsize(out) > 1000
