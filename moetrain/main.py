"""Entry point: python -m moetrain.main --config=configs/longcat_lora.py [--workdir=DIR]."""

import signal

if __name__ == '__main__':
  # Until the run's own handler takes it over (runtime.handle_stop_signals), Ctrl-C ends the
  # process at once, nothing written (SIGINT's default action: the shell reports 130). Python's
  # handler would raise KeyboardInterrupt wherever the main thread is: a traceback during these
  # imports, and one raised inside a callback (JAX's garbage-collection callback at start-up) is
  # printed and swallowed, so the run went on.
  signal.signal(signal.SIGINT, signal.SIG_DFL)

import os

from absl import app, flags
from ml_collections import config_flags

from moetrain.core import runtime
from moetrain.run import rundir

_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'Experiment config file.', lock_config=True
)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory; default runs/<config file stem>.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Build the model abstractly and print its size.')
runtime.define_process_flags()


def default_workdir(config_path: str) -> str:
  stem = os.path.splitext(os.path.basename(config_path.split(':')[0]))[0]
  return os.path.join('runs', stem)


def main(argv):
  del argv
  workdir = _WORKDIR.value or default_workdir(flags.FLAGS['config'].config_filename)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise runtime.UserError(f'--workdir={workdir} is a file, not a run directory')
  config = _CONFIG.value
  steps = [] if _DRY_RUN.value else rundir.saved_steps(workdir)
  # (train.resume_step: the run goes back to that checkpoint)
  runtime.start_command(resume_step=config.train.resume_step or (steps[-1] if steps else None))
  from moetrain.convert import hf
  from moetrain.planner import sizes
  from moetrain.run import train

  if config.init.hf_checkpoint:  # its config.json decides the shapes: none given on the side
    overrides = flags.FLAGS['config'].override_values
    hf.check_overrides(config.init.hf_checkpoint, overrides)
  if _DRY_RUN.value:
    sizes.dry_run(config)
    return
  runtime.handle_stop_signals()  # SIGTERM and Ctrl-C: save at the next step and stop
  train.run(config, workdir)  # (user errors: one line, runtime.short_errors)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(runtime.short_errors(main), flags_parser=runtime.parse_flags)
