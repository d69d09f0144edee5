"""Draws the per-layer expert load over training as a PNG heatmap from a run directory.

python -m moetrain.tools.expert_load --workdir=runs/longcat_lora [--out=expert_load.png]
"""

import json
import re

import numpy as np
from absl import app, flags

from moetrain.core import runtime, storage


def define_flags():
  flags.DEFINE_string('workdir', None, 'Run directory holding metrics.jsonl.')
  flags.DEFINE_string('out', None, 'PNG path; default <workdir>/expert_load.png.')


LAYER_KEY = re.compile(r'moe/layer(\d+)/')


def read_loads(workdir: str):
  """Steps [S], loads [S, L, E+Z] (token-assignment counts, per step, over the L MoE layers)
  from metrics.jsonl, the step the first record's window starts after (0, or where the run
  resumed), and the decoder index of each MoE layer (from the records' moe/layer{l}/ keys:
  dense layers hold no experts and have no row). A record at
  step s averages the steps since the record before it. A run that resumed from a checkpoint
  older than its last log appends steps again: a step at or below the last one read drops the
  abandoned records from that step on."""
  path = storage.join(workdir, 'metrics.jsonl')
  if not storage.exists(path):
    raise FileNotFoundError(f'{path} not found: is {workdir!r} a moetrain run directory?')
  steps, loads, start, layers = [], [], 0, []
  with storage.open(path) as f:
    for n, line in enumerate(f, 1):
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{path}:{n}: not JSON ({e})') from None
      if rec.get('kind') == 'resume' and not steps:
        start = rec['step']
      if rec.get('kind') == 'train' and 'moe/load' in rec:
        while steps and steps[-1] >= rec['step']:
          steps.pop()
          loads.pop()
        steps.append(rec['step'])
        loads.append(rec['moe/load'])
      if rec.get('kind') == 'train' and 'moe/load' in rec and not layers:
        layers = sorted({int(m.group(1)) for k in rec if (m := LAYER_KEY.match(k))})
  if not steps:
    raise ValueError(f'{path} has no train records with moe/load')
  loads = np.array(loads, np.float64)
  if len(layers) != loads.shape[1]:  # a record without per-layer keys: number the rows
    layers = list(range(loads.shape[1]))
  return np.array(steps), loads, start, layers


def cell_edges(steps, start: int = 0):
  """The heatmap's x edges: a record's cell spans the steps it averages, (the record before it,
  its step], so the axis ends at the last step logged and uneven intervals keep their widths."""
  return np.concatenate([[min(start, steps[0] - 1)], steps]).astype(np.float64)


def plot(steps, loads, out: str, n_routed: int | None = None, start: int = 0, layers=None) -> str:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  n_layers, n_experts = loads.shape[1], loads.shape[2]
  share = loads / np.maximum(loads.sum(-1, keepdims=True), 1)  # fraction of assignments
  fig, axes = plt.subplots(n_layers, 1, figsize=(10, 2.2 * n_layers + 0.6), squeeze=False)
  x_edges = cell_edges(steps, start)
  y_edges = np.arange(n_experts + 1) - 0.5
  layers = range(n_layers) if layers is None else layers
  for row, (layer, ax) in enumerate(zip(layers, axes[:, 0])):
    im = ax.pcolormesh(x_edges, y_edges, share[:, row].T, cmap='viridis', shading='flat')
    if n_routed is not None and n_routed < n_experts:
      ax.axhline(n_routed - 0.5, color='w', lw=0.8, ls='--')
    ax.set_ylabel(f'layer {layer}\nexpert')
    fig.colorbar(im, ax=ax, label='share')
  axes[-1, 0].set_xlabel('step')
  zero = n_routed is not None and n_routed < n_experts
  note = '; above the dashed line: zero experts' if zero else ''
  fig.suptitle(f'Expert load per MoE layer (share of top-k assignments{note})')
  fig.tight_layout()
  with storage.open(out, 'wb') as f:
    fig.savefig(f, format='png', dpi=100)
  plt.close(fig)
  return out


def main(argv):
  del argv
  workdir = flags.FLAGS.workdir
  steps, loads, start, layers = read_loads(workdir)
  n_routed = None
  cfg_path = storage.join(workdir, 'config.json')
  if storage.exists(cfg_path):
    n_routed = json.loads(storage.read_text(cfg_path)).get('model', {}).get('n_routed_experts')
  out = flags.FLAGS.out or storage.join(workdir, 'expert_load.png')
  plot(steps, loads, out, n_routed, start, layers)
  print(f'wrote {out} ({len(steps)} steps, {loads.shape[1]} MoE layers, {loads.shape[2]} experts)')


if __name__ == '__main__':
  define_flags()
  flags.mark_flags_as_required(['workdir'])
  app.run(runtime.short_errors(main), flags_parser=runtime.parse_flags)
