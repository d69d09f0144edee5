"""Plan a run: its size (--dry_run), and with --topology its real train and eval steps compiled
ahead of time for a Cloud TPU slice on any host (per-chip memory, fits or not, a roofline
estimate of the step time) or for a CPU host (--topology=cpu: this one; cpu:64GB, cpu:64GB:16:
another RAM and core count; its peak resident memory and a step time at its matmul rate),
--search for settings that fit, --smallest for the slices that do.

python -m moetrain.tools.plan --config=configs/longcat_lora.py:variant=flash
python -m moetrain.tools.plan --config=configs/longcat_lora.py:variant=flash --topology=v5p-128
python -m moetrain.tools.plan --config=configs/deepseek_v3_lora.py --topology=cpu
"""

from absl import app, flags

from moetrain.core import runtime
from moetrain.planner import cpu_plan, tpu_plan
from moetrain.planner.sizes import dry_run


def main(argv):
  del argv

  f = flags.FLAGS
  if f.topology.startswith('cpu'):
    # Compiled under the allocator the run has: what it keeps after compiling is measured.
    runtime.reexec_with_hugepages()
    runtime.cpu_without_accelerators()
  runtime.quiet_library_logs()
  runtime.quiet_tpu_discovery()
  if not f.topology:
    if f.search or f.smallest or f.json or f.remat:
      raise app.UsageError('--search, --smallest, --remat and --json need --topology')
    dry_run(f.config)
    return
  if f.topology.startswith('cpu'):
    if f.smallest or f.remat:
      raise app.UsageError('--smallest and --remat are for TPU slices; a CPU host takes --search')
    cpu_plan.main(f.config, f.topology, f.search, f.json, f.workers)
    return
  tpu_plan.main(f.config, f.topology, f.search, f.smallest, f.json, f.workers, f.remat)


if __name__ == '__main__':
  from absl import flags
  from ml_collections import config_flags

  from moetrain.core import runtime

  config_flags.DEFINE_config_file('config', None, 'Experiment config file.', lock_config=True)
  flags.DEFINE_string(
    'topology',
    '',
    'Compile for a TPU slice (v5p-128, v6e-64, v5p:4x4x4...) or a CPU host (cpu, cpu:64GB:16)',
  )
  flags.DEFINE_bool('search', False, 'Try settings that change memory and speed; print the best.')
  flags.DEFINE_bool('smallest', False, "Each generation's smallest slice per training method.")
  flags.DEFINE_bool('remat', False, 'Compile every remat policy: what each keeps and recomputes.')
  flags.DEFINE_string('json', '', 'Also write the plan as JSON to this path.')
  flags.DEFINE_integer('workers', 2, 'Compile processes for --search and --smallest.')
  flags.mark_flags_as_required(['config'])
  app.run(runtime.short_errors(main), flags_parser=runtime.parse_flags)
