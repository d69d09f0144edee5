"""Command-line tools on a finished run: evaluate and the expert-load heatmap."""

import os

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
