"""Process settings for fast host (CPU) execution, applied by the command-line entry points.
(Design: docs/design.md, "moetrain/core/runtime.py".)"""

import atexit
import contextlib
import functools
import logging
import os
import platform
import re
import signal
import sys
import threading
import time

TUNABLE = 'glibc.malloc.hugetlb'
THP_SETTING = '/sys/kernel/mm/transparent_hugepage/enabled'


def _glibc_supports_hugetlb() -> bool:
  lib, version = platform.libc_ver()
  if lib != 'glibc' or not version:
    return False
  return tuple(int(p) for p in version.split('.')[:2]) >= (2, 35)


def _thp_allowed() -> bool:
  """True when the kernel grants huge pages to regions that ask (madvise) or to all."""
  try:
    with open(THP_SETTING) as f:
      setting = f.read()
  except OSError:
    return False
  return '[always]' in setting or '[madvise]' in setting


def hugepage_environment(environ) -> dict | None:
  """`environ` with the huge-page malloc tunable added, or None where it is set already, was
  turned off, or this system cannot use it."""
  if sys.platform != 'linux' or env_flag('MOETRAIN_NO_REEXEC', environ):
    return None
  tunables = environ.get('GLIBC_TUNABLES', '')
  if TUNABLE in tunables or not _glibc_supports_hugetlb() or not _thp_allowed():
    return None
  env = dict(environ)
  env['GLIBC_TUNABLES'] = ':'.join(t for t in (tunables, f'{TUNABLE}=1') if t)
  return env


def reexec_with_hugepages() -> None:
  """Replaces this process with the same command run under the huge-page tunable, when useful.
  Call it first thing in a command's main, before JAX creates its backend."""
  if sys.argv[0] in ('', '-'):
    return  # an interactive session or a script read from stdin cannot be run again
  env = hugepage_environment(os.environ)
  if env is not None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


class _QuietBelowWarning(logging.Filter):
  def __init__(self, package: str):
    super().__init__()
    self.marker = f'{os.sep}{package}{os.sep}'

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or self.marker not in record.pathname


class _NoErrors(_QuietBelowWarning):
  """Drops the errors Orbax logs (with tracebacks, from its background threads) when a save
  fails: the checkpointer raises each one itself, as one `Error:` line naming the checkpoint
  (checkpoint.SaveFailed; a failed restore: DamagedCheckpoint)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return self.marker not in record.pathname or record.levelno < logging.ERROR


def quiet_library_logs(packages=('orbax', 'jax', 'gcsfs')) -> None:
  """Drops the INFO lines of chatty libraries (Orbax: ~250 per demo run, a dozen per checkpoint;
  JAX: "Unable to initialize backend 'tpu'" on every machine without one; gcsfs: one per file
  read from gs://) from absl's log
  output; their warnings and errors still show. `--verbosity=1` keeps them."""
  from absl import flags
  from absl import logging as absl_logging

  if flags.FLAGS.is_parsed() and flags.FLAGS.verbosity > 0:
    return
  handler = absl_logging.get_absl_handler()
  for package in packages:
    handler.addFilter(_QuietBelowWarning(package))
  if not env_flag('MOETRAIN_TRACEBACK'):
    handler.addFilter(_NoErrors('orbax'))


def env_flag(name: str, environ=os.environ) -> bool:
  """A yes/no environment variable: 1, true, yes or on (any case) is yes."""
  return environ.get(name, '').strip().lower() in ('1', 'true', 'yes', 'on')


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (app.run's flags_parser) that names an unknown --config.<key> instead
  of raising from inside ml_collections. Other flag errors (a missing --config, an unknown flag)
  print absl's one-line usage error, as app.run's own parser does, not a traceback."""

  _import_config_packages(argv)
  if argv is sys.argv:  # (a re-executed process then reads the new key, and says nothing)
    sys.argv[:] = engine_keys_moved(argv)
  else:
    argv = engine_keys_moved(argv)
  try:
    return _parse_flags(argv)
  except ImportError as e:  # a config file whose imports fail
    path = next((a.split('=', 1)[1] for a in argv[1:] if a.startswith('--config=')), '?')
    raise SystemExit(f'Error: --config={path}: {e}') from None
  except (AttributeError, KeyError) as e:
    # ml_collections raises AttributeError(KeyError("'name'\nDid you mean ...?")): the first
    # line names the key, the rest (if any) suggests one.
    msg = e
    while isinstance(msg, BaseException) and msg.args:
      msg = msg.args[0]
    name, _, hint = str(msg).partition('\n')
    name = name.strip('"\'')
    keys = [a.split('=', 1)[0] for a in argv[1:] if a.startswith('--config.')]
    key = next((k for k in keys if name in k.split('.')), f'--config.…{name}')
    hint = f' {hint.strip()}' if hint.strip() else ''
    raise SystemExit(
      f'Error: {key}: no such config key ({name!r} is not in its section).{hint} docs/config.md '
      'lists every key with its default'
    ) from None


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing; an error that a config file's get_config raised (`:variant=tiyn`) is its
  one line, not ml_collections' traceback of it inside absl's usage error."""
  from absl import app, flags

  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    head, whilst, _ = str(e).partition(': Error whilst parsing config file')
    cause = e
    while cause.__context__ is not None:
      cause = cause.__context__
    if not whilst or cause is e:
      return app.parse_flags_with_usage(argv)  # absl's usage error, as app.run prints it
    raise SystemExit(f'Error: {head.removeprefix("flag ")}: {cause}') from None


def engine_keys_moved(argv: list[str]) -> list[str]:
  """argv with each --config.model.<key> of a key the `engine` section now holds (dtype, remat,
  moe_backend, ...) read as --config.engine.<key>, and a note naming the new key."""
  from moetrain.core.engine import ENGINE_FIELDS

  out = []
  for arg in argv:
    name, eq, value = arg.partition('=')
    key = name.removeprefix('--config.model.')
    if name.startswith('--config.model.') and key in ENGINE_FIELDS:
      print(f'Note: {name} is now --config.engine.{key}', file=sys.stderr)
      arg = f'--config.engine.{key}{eq}{value}'
    out.append(arg)
  return out


def _import_config_packages(argv: list[str]) -> None:
  """Config files import their neighbours as a package (configs/longcat_lora.py: `from configs
  import base`): the directory above that package goes on sys.path, so a command run from
  outside the repository finds them too."""
  for a in argv[1:]:
    if a.startswith('--config='):
      folder = os.path.dirname(os.path.abspath(a.split('=', 1)[1].split(':')[0]))
      if os.path.exists(os.path.join(folder, '__init__.py')):
        root = os.path.dirname(folder)
        if root not in sys.path:
          sys.path.insert(0, root)


def define_process_flags() -> None:
  """The flags that make a command one process of a multi-process JAX job (idempotent)."""
  from absl import flags

  if 'num_processes' in flags.FLAGS:
    return
  flags.DEFINE_integer(
    'num_processes', None, 'Multi-process job without cluster auto-detection (e.g. CPU hosts).'
  )
  flags.DEFINE_integer('process_id', None, 'This process, 0..num_processes-1.')
  flags.DEFINE_string(
    'coordinator_address', None, 'host:port of process 0 (default $JAX_COORDINATOR_ADDRESS).'
  )
  flags.DEFINE_float(
    'peer_timeout',
    45.0,
    'Seconds a process of a multi-process job waits for the others to join, and then for a '
    'silent one, before it stops with an error naming it.',
  )


def initialize_distributed(preemption: bool = True, resume_step: int | None = None) -> None:
  """Joins the multi-process job: explicitly with --num_processes (CPU or GPU hosts without a
  cluster manager), or through JAX's own detection on TPU VMs (TPU_WORKER_HOSTNAMES) and where
  MOETRAIN_DISTRIBUTED is set (SLURM, ...). One process otherwise.

  preemption: JAX's preemption service, which catches SIGTERM so that training can agree on a
  step to save at. Commands that save nothing turn it off and stay killable by SIGTERM.
  resume_step: the checkpoint step a resumed run goes on from, reported to the service as soon
  as it runs. It stops the job at the step after the highest one any host reported, so a notice
  that came before any report would name step 1, which a resumed run has passed: lost."""
  import jax
  from absl import app, flags
  from absl import logging as absl_logging
  from jax.experimental import multihost_utils

  from moetrain.core import multihost

  f = flags.FLAGS
  explicit = 'num_processes' in f and f.num_processes is not None
  detected = env_flag('MOETRAIN_DISTRIBUTED') or 'TPU_WORKER_HOSTNAMES' in os.environ
  given = lambda name: name in f and f[name].value is not None
  if not explicit and (given('process_id') or given('coordinator_address')):
    raise app.UsageError('--process_id and --coordinator_address need --num_processes')
  if not explicit and not detected:
    return
  jax.config.update('jax_enable_preemption_service', preemption)
  if explicit:
    address = f.coordinator_address or os.environ.get('JAX_COORDINATOR_ADDRESS')
    if f.process_id is None or not address:
      raise app.UsageError(
        '--num_processes needs --process_id and --coordinator_address (or $JAX_COORDINATOR_ADDRESS)'
      )

  timeout = f.peer_timeout if 'peer_timeout' in f else multihost.PEER_TIMEOUT
  where = f'process {f.process_id} of {f.num_processes}' if explicit else 'this process'
  joined = multihost.join_deadline(timeout, where)
  if explicit:
    jax.distributed.initialize(address, num_processes=f.num_processes, process_id=f.process_id)
  else:
    jax.distributed.initialize()
  joined.cancel()
  multihost.watch_peers(timeout)
  if preemption and resume_step:
    multihost_utils.reached_preemption_sync_point(resume_step)
  resuming = f'; the run resumes from step {resume_step}' if resume_step else ''
  absl_logging.info(
    'Process %d of %d joined the job%s.', jax.process_index(), jax.process_count(), resuming
  )


def start_command(preemption: bool = True, resume_step: int | None = None) -> None:
  """First thing in a command's main: huge-page malloc (re-executing once), quiet library logs
  and closed-loop noise, then the multi-process job, if any (see initialize_distributed)."""
  reexec_with_hugepages()
  rocm_grouped_gemm()
  cpu_collective_schedule()
  cpu_without_accelerators()
  quiet_library_logs()
  quiet_closed_loop_errors()
  tolerate_closed_output()
  initialize_distributed(preemption, resume_step)


ROCM_GROUPED_GEMM = '--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true'


def rocm_grouped_gemm() -> None:
  """With JAX's ROCm plugin installed (the rocm extra), XLA's hipBLASLt grouped GEMM for
  ragged_dot (MI300 and newer), which otherwise runs as a dense product over every expert; set
  before JAX starts its backends. An XLA_FLAGS that already names the flag is left alone."""
  from importlib import metadata

  flags = os.environ.get('XLA_FLAGS', '')
  if 'ragged_dot_grouped_gemm' in flags:
    return
  names = (d.metadata['Name'] or '' for d in metadata.distributions())
  if any(n.lower().replace('_', '-').startswith('jax-rocm') for n in names):
    os.environ['XLA_FLAGS'] = f'{flags} {ROCM_GROUPED_GEMM}'.strip()


CPU_ONE_COLLECTIVE_ORDER = '--xla_cpu_enable_concurrency_optimized_scheduler=false'
CPU_COLLECTIVE_PATIENCE = '--xla_cpu_collective_call_terminate_timeout_seconds=900'
CPU_THREADS_PER_DEVICE = 8


def cpu_collective_schedule() -> None:
  """Emulated CPU devices (XLA_FLAGS' --xla_force_host_platform_device_count above 1):

  - with XLA:CPU's concurrency-optimised scheduler the devices entered their collectives in
    different orders and the collective rendezvous aborted the run ("Termination timeout for
    `all gather`"; seen with a pipeline's stages, and with gradient accumulation over an FSDP x
    expert mesh, on 2 of 3 runs); its default scheduler does not;
  - the rendezvous gives up on devices that have not arrived after 40 s by default. The emulated
    devices share the host's cores, so on a small host one can arrive minutes after the others
    (a context-8 step of 8 x 2,048 tokens on 2 cores aborted so); they get 15 minutes;
  - the devices share one pool of worker threads, by default one a device, and a device runs
    its independent collectives at once, each holding a worker while it waits for the other
    devices. When the waiting collectives hold every worker, a device that has not reached them
    gets no thread to run on and the step hangs for good (8 x 512-token LoRA steps over FSDP 8:
    all 8 workers waiting at two all-gathers, devices 6 and 7 at neither). XLA sizes its pools
    from the NPROC variable: they get CPU_THREADS_PER_DEVICE a device. That costs some speed
    (the 8 x 2,048-token demo step over FSDP 8 on 2 cores: 6-15% fewer tokens/s than with 8
    workers, bench/RESULTS.md); a hang costs the run.

  Set before JAX starts its backends; a flag XLA_FLAGS already names, or an NPROC already set,
  is left alone. One device, or real ones, keep the defaults."""
  flags = os.environ.get('XLA_FLAGS', '')
  count = re.search(r'--xla_force_host_platform_device_count=(\d+)', flags)
  if count is None or int(count.group(1)) <= 1:
    return
  for flag in (CPU_ONE_COLLECTIVE_ORDER, CPU_COLLECTIVE_PATIENCE):
    if flag.split('=')[0] not in flags:
      flags = f'{flags} {flag}'.strip()
  os.environ['XLA_FLAGS'] = flags
  os.environ.setdefault('NPROC', str(CPU_THREADS_PER_DEVICE * int(count.group(1))))


def cpu_without_accelerators() -> None:
  """Where libtpu is installed (the `tpu` and `test` extras; the planner needs it) on a host
  with neither a TPU chip nor an NVIDIA GPU, JAX would still start libtpu's plugin at its first
  device query, and libtpu prints six lines of warnings about the missing TPU on every command:
  such a host runs on the CPU. (The planner compiles for TPU topologies all the same.) A
  JAX_PLATFORMS setting is left alone."""
  if os.environ.get('JAX_PLATFORMS'):
    return
  try:  # JAX's own probe (private): TPU chips on the PCI bus, NVIDIA device files
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
      return
    if hardware_utils.has_visible_nvidia_gpu():
      return
  except Exception:  # a JAX without it: leave the platforms to JAX
    return
  import jax

  jax.config.update('jax_platforms', 'cpu')


def quiet_tpu_discovery() -> None:
  """For a command that compiles for TPU topologies on a host without TPUs (the planner):
  libtpu looks for the TPU VM it runs on and prints what it cannot find ("Failed to find host
  bounds", an E0000 line about worker hostnames) as if the plan had failed. Naming a one-host
  slice answers it; the topology compiled for is still the one the planner names. (Not for the
  training commands: JAX's cluster detection would read these as a TPU job's.)"""
  import jax

  cpu_without_accelerators()
  if (jax.config.jax_platforms or os.environ.get('JAX_PLATFORMS', '')) == 'cpu':
    os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
    os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
    os.environ.setdefault('TPU_ACCELERATOR_TYPE', 'v5p-8')


def quiet_closed_loop_errors() -> None:
  """From here on, unraisable 'Event loop is closed' errors are dropped (_unless_loop_closed)."""
  sys.unraisablehook = functools.partial(_unless_loop_closed, sys.unraisablehook)


def _unless_loop_closed(hook, unraisable) -> None:
  """sys.unraisablehook that drops the RuntimeError('Event loop is closed') of a callback into a
  finished asyncio loop and passes anything else to `hook`. A checkpoint read that fails leaves
  Orbax's other reads in flight, whose completions call back into its closed event loop:
  hundreds of such tracebacks when the array files are missing, burying the error itself."""
  e = unraisable.exc_value
  if not (isinstance(e, RuntimeError) and str(e) == 'Event loop is closed'):
    hook(unraisable)


class _ToleratesClosedPipe:
  """A text stream (stdout, stderr) whose reader may go away: `python -m moetrain.main | tee
  train.log` and Ctrl-C, which ends tee with the run. A write then fails with EPIPE, and the
  BrokenPipeError, raised wherever a line was printed (the Ctrl-C handler's own print), ended
  the run before it saved. From the first EPIPE on, what is written goes to /dev/null;
  `closed_output` names the stream, for the run to record."""

  def __init__(self, stream, name: str):
    self._stream, self._name = stream, name

  def write(self, text: str) -> int:
    try:
      return self._stream.write(text)
    except BrokenPipeError:
      self._closed()
      return len(text)

  def writelines(self, lines) -> None:
    for line in lines:
      self.write(line)

  def flush(self) -> None:
    try:
      self._stream.flush()
    except BrokenPipeError:
      self._closed()

  def _closed(self) -> None:
    if self._name not in _CLOSED:
      _CLOSED.append(self._name)
      devnull = os.open(os.devnull, os.O_WRONLY)
      with contextlib.suppress(OSError, ValueError):  # (a stream without a descriptor)
        os.dup2(devnull, self._stream.fileno())
      os.close(devnull)
    with contextlib.suppress(OSError):
      self._stream.flush()  # (what the pipe did not take: nowhere)

  def __getattr__(self, name: str):
    return getattr(self._stream, name)


_CLOSED = []  # the streams found closed, in order


def tolerate_closed_output() -> None:
  """stdout and stderr tolerate a reader that went away (_ToleratesClosedPipe)."""
  for name in ('stdout', 'stderr'):
    stream = getattr(sys, name)
    if not isinstance(stream, _ToleratesClosedPipe) and hasattr(stream, 'fileno'):
      setattr(sys, name, _ToleratesClosedPipe(stream, name))
      atexit.register(getattr(sys, name).flush)  # before the interpreter's own, which would fail


def closed_output() -> tuple[str, ...]:
  """The standard streams whose reader went away ('stdout', 'stderr')."""
  return tuple(_CLOSED)


_STOP = threading.Event()


def handle_stop_signals() -> None:
  """For a training command's main: SIGTERM (a preemption notice) and a first Ctrl-C ask the
  training loop to save at its next step and stop (`stop_requested`); a second Ctrl-C ends the
  process at once.
  On several processes JAX's preemption service owns SIGTERM and all hosts agree on the step to
  stop at: a first Ctrl-C on any of them is passed to it as a SIGTERM to the process itself.
  Library code installs no handler: train.run called from a notebook stops as the notebook
  stops it."""
  import jax
  from absl import logging as absl_logging

  def on_sigterm(signum, frame):
    del signum, frame
    absl_logging.warning('SIGTERM received: saving a checkpoint at the next step, then exiting.')
    _STOP.set()

  def on_sigint(signum, frame):
    del signum, frame
    print(
      'Ctrl-C: saving a checkpoint at the next step, then exiting (Ctrl-C again aborts without '
      'saving).',
      flush=True,
    )
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (a KeyboardInterrupt could be swallowed)
    if several:  # a stop of this host alone would leave the others waiting in the collectives
      os.kill(os.getpid(), signal.SIGTERM)  # to the preemption service's handler
    else:
      _STOP.set()

  several = jax.process_count() > 1
  if not several:
    signal.signal(signal.SIGTERM, on_sigterm)
  signal.signal(signal.SIGINT, on_sigint)


def stop_requested() -> bool:
  """Whether a signal asked the training loop to save and stop (handle_stop_signals)."""
  return _STOP.is_set()


class UserError(Exception):
  """An error in what the user asked for (not a bug): its message says what and how to fix it."""


# What a command reports as one line: moetrain's user errors, and the ValueErrors (bad settings,
# data, names) and OSErrors (missing files, permissions, read-only directories) it raises with
# the field, file or path in their message.
USER_ERRORS = (UserError, ValueError, OSError)


def short_errors(main):
  """main(argv) for absl's app.run, with user errors printed as `Error: <message>` and a
  non-zero exit instead of a traceback. MOETRAIN_TRACEBACK=1 or --verbosity=1 shows tracebacks."""

  @functools.wraps(main)
  def wrapped(argv):
    from absl import flags

    try:
      return main(argv)
    except Exception as e:
      _leave_the_job(e)
      if not isinstance(e, USER_ERRORS):
        raise
      if env_flag('MOETRAIN_TRACEBACK') or flags.FLAGS.verbosity > 0:
        raise
      sys.exit(f'Error: {e}')

  return wrapped


def _leave_the_job(e: Exception) -> None:
  """A process of a job of several (multihost's peer watch runs) ends on an error. A failure
  that is no user error (a collective that lost its peer: "Gloo AllGather failed: Connection
  reset by peer") first gives the watch its time to name a peer that died, which then ends the
  process with that line. Then this process stops beating: others that did not fail with it
  stop after --peer_timeout, naming it; others that did meet it in JAX's shutdown at exit."""

  multihost = sys.modules.get('moetrain.core.multihost')
  if multihost is None or not multihost.watching():
    return
  if not isinstance(e, USER_ERRORS):
    multihost.await_dead_peer()
  multihost.stop_watching(done=False)


def is_primary() -> bool:
  """Process 0, the one that prints a command's results."""
  import jax

  return jax.process_index() == 0


@contextlib.contextmanager
def phase(what: str):
  """A long start-up phase said on process 0's stdout: `what ...` before it and `what: done in
  X s` after; the caller may add to the end line through the yielded dict's 'note'."""
  primary = is_primary()
  if primary:
    print(f'{what} ...', flush=True)
  start, said = time.perf_counter(), {'note': ''}
  yield said
  if primary:
    print(f'{what}: done in {time.perf_counter() - start:.1f} s{said["note"]}', flush=True)
