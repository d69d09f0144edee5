"""Entry point: python -m moetrain.main --config=configs/longcat_lora.py [--workdir=DIR]."""

import os

import jax
from absl import app, flags
from ml_collections import config_flags

from moetrain import runtime

_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'Experiment config file.', lock_config=True
)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory; default runs/<config file stem>.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Build the model abstractly and print its size.')
_NUM_PROCESSES = flags.DEFINE_integer(
  'num_processes', None, 'Multi-process run without cluster auto-detection (e.g. CPU hosts).'
)
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, 0..num_processes-1.')
_COORDINATOR = flags.DEFINE_string(
  'coordinator_address', None, 'host:port of process 0 (default $JAX_COORDINATOR_ADDRESS).'
)


def default_workdir(config_path: str) -> str:
  stem = os.path.splitext(os.path.basename(config_path.split(':')[0]))[0]
  return os.path.join('runs', stem)


def main(argv):
  del argv
  runtime.reexec_with_hugepages()
  runtime.quiet_library_logs()
  if _NUM_PROCESSES.value is not None:  # explicit: CPU or GPU hosts without a cluster manager
    jax.distributed.initialize(
      _COORDINATOR.value, num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value
    )
  elif os.environ.get('MOETRAIN_DISTRIBUTED') or 'TPU_WORKER_HOSTNAMES' in os.environ:
    jax.distributed.initialize()  # TPU VMs, SLURM, ...: JAX detects the cluster
  from moetrain import train
  from moetrain.tools import plan

  config = _CONFIG.value
  if _DRY_RUN.value:
    plan.dry_run(config)
    return
  train.run(config, _WORKDIR.value or default_workdir(flags.FLAGS['config'].config_filename))


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main)
