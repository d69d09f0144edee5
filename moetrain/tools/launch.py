"""A run on GKE: its JobSet manifest (--gke) or the xpk command (--xpk), built from its config
and slice once the planner has checked that it fits.

  python -m moetrain.tools.launch --config=configs/longcat_lora.py:variant=flash \
    --topology=v5p-128 --workdir=gs://bucket/runs/flash --image=IMG --gke [--dry_run]
  python -m moetrain.tools.launch --config=... --topology=v5e-16 --slices=2 \
    --workdir=gs://bucket/runs/x --image=IMG --xpk --cluster=CLUSTER

Every pod runs tpu_scripts/pod_run.sh from the image (`make image`): python -m moetrain.main with
the config, its --config.* overrides and the run directory (docs/multihost.md, "GKE and JobSet").
"""

import contextlib
import dataclasses
import math
import os
import re
import shlex
import sys

from absl import app, flags

from moetrain.core import runtime
from moetrain.planner import topology as topology_lib

JOBSET_API = 'jobset.x-k8s.io/v1alpha2'
REPLICATED_JOB = 'slice'  # pods are <name>-slice-<slice>-<index>.<name> in the headless service
POD_SCRIPT = 'tpu_scripts/pod_run.sh'  # relative to the image's working directory
# JAX's coordinator port on TPU clusters (jax/_src/clusters/cloud_tpu_cluster.py).
JAX_COORDINATOR_PORT = 8482
# The TPU runtime's slice port, the multislice (megascale) port, JAX's coordinator.
PORTS = (8471, 8080, JAX_COORDINATOR_PORT)
# GKE's node label cloud.google.com/gke-tpu-accelerator of each generation's slices.
GKE_ACCELERATORS = {
  'v4': 'tpu-v4-podslice',
  'v5e': 'tpu-v5-lite-podslice',
  'v5p': 'tpu-v5p-slice',
  'v6e': 'tpu-v6e-slice',
  'tpu7x': 'tpu7x',
}
# Single-host slices GKE has (chips): v5e and v6e hosts hold up to 8 chips, the others 4.
SINGLE_HOST_CHIPS = {'v5e': (1, 4, 8), 'v6e': (1, 4, 8), 'v4': (4,), 'v5p': (4,), 'tpu7x': (4,)}
CHIPS_PER_MULTI_HOST = 4

# terminationGracePeriodSeconds: the time a pod gets from its SIGTERM to its end, in which the
# run saves. JAX's preemption service stops every host at the step after the highest one any host
# reported, so up to STEPS_BEFORE_SAVE steps run first, each taken as ESTIMATE_FACTOR x the
# planner's roofline estimate (which assumes perfect overlap); then each host writes its part of
# the checkpoint at WRITE_BYTES_PER_S, an assumed rate for one host writing to Cloud Storage
# (not measured here); MARGIN_S covers the checkpoint's commit and the exit.
STEPS_BEFORE_SAVE = 2
ESTIMATE_FACTOR = 2.0
WRITE_BYTES_PER_S = 100e6
MARGIN_S = 60
# What the JobSet and Job controllers write on each pod.
JOBSET_NAME_KEY = 'jobset.sigs.k8s.io/jobset-name'
JOB_INDEX_KEY = 'jobset.sigs.k8s.io/job-index'  # the slice
COMPLETION_INDEX = 'batch.kubernetes.io/job-completion-index'  # the host in the slice
NAME = re.compile(r'[a-z]([-a-z0-9]{0,38}[a-z0-9])?')  # a DNS label, as xpk's workload names


@dataclasses.dataclass(frozen=True)
class Slices:
  """The TPU slices of a job, as GKE schedules them: `count` node pools of `hosts` nodes each."""

  topology: topology_lib.Topology  # all slices: chips and devices over all of them
  count: int
  hosts: int  # per slice
  chips_per_host: int

  @property
  def processes(self) -> int:
    return self.count * self.hosts

  @property
  def chips_per_slice(self) -> int:
    return self.topology.chips // self.count

  @property
  def shape(self) -> str:
    """GKE's node label cloud.google.com/gke-tpu-topology: '4x4x4'."""
    return self.topology.topology_name.split(':')[1]

  @property
  def accelerator(self) -> str:
    return GKE_ACCELERATORS[self.topology.chip.generation]

  @property
  def xpk_type(self) -> str:
    """xpk's --tpu-type of one slice: v5p-128, v5litepod-16, v6e-16, tpu7x-4x4x4."""
    gen = self.topology.chip.generation
    if gen == 'tpu7x':
      return f'tpu7x-{self.shape}'
    if gen == 'v5e':
      return f'v5litepod-{self.chips_per_slice}'
    return topology_lib.Topology('', '', self.topology.chip, self.chips_per_slice).cloud_name


def slices(name: str, count: int = 1) -> Slices:
  """`count` slices of the topology `name` (v5p-128, v5litepod-16, v5p:4x4x4, or 2xv5e-16)."""
  one = topology_lib.parse(name)
  if one.slices > 1:
    if count not in (1, one.slices):
      raise ValueError(f'--topology={name} names {one.slices} slices, --slices={count}')
    name = name.split('x', 1)[1]
    count, one = one.slices, topology_lib.parse(name)
  if count < 1:
    raise ValueError(f'--slices={count}: at least one')
  gen, chips = one.chip.generation, one.chips
  if chips <= max(SINGLE_HOST_CHIPS[gen]):
    if chips not in SINGLE_HOST_CHIPS[gen]:
      raise ValueError(f'--topology={name}: GKE has no {gen} node of {chips} chips')
    if count > 1:
      raise ValueError(
        f'--topology={name} is one host: GKE joins slices of several hosts only (multislice)'
      )
    per_host = chips
  else:
    per_host = CHIPS_PER_MULTI_HOST
  whole = topology_lib.parse(f'{count}x{name}') if count > 1 else one
  return Slices(whole, count, chips // per_host, per_host)


def _from_field(name: str, annotation: str) -> dict:
  path = f"metadata.annotations['{annotation}']"
  return {'name': name, 'valueFrom': {'fieldRef': {'fieldPath': path}}}


def host(slice_index, index) -> str:
  """A pod's name in the JobSet's headless service (resolved by the pod's environment)."""
  return f'$(JOBSET_NAME)-{REPLICATED_JOB}-{slice_index}-{index}.$(JOBSET_NAME)'


def environment(s: Slices) -> list[dict]:
  """What each pod needs to join the job: JAX's TPU cluster detection (GkeTpuCluster, which
  moetrain's runtime.initialize_distributed starts on TPU_WORKER_HOSTNAMES) and libtpu read
  TPU_WORKER_ID and TPU_WORKER_HOSTNAMES, and across slices the MEGASCALE_ variables. JAX's process
  id is then the completion index plus the slice index times the hosts per slice; its coordinator
  (and the slices' megascale coordinator) is slice 0's pod 0. One process joins nothing: none."""
  if s.processes == 1:
    return []
  env = [
    _from_field('JOBSET_NAME', JOBSET_NAME_KEY),
    _from_field('JOB_INDEX', JOB_INDEX_KEY),
    _from_field('JOB_COMPLETION_INDEX', COMPLETION_INDEX),
    {'name': 'TPU_WORKER_ID', 'value': '$(JOB_COMPLETION_INDEX)'},
    {
      'name': 'TPU_WORKER_HOSTNAMES',
      'value': ','.join(host('$(JOB_INDEX)', i) for i in range(s.hosts)),
    },
  ]
  if s.count > 1:
    env += [
      {'name': 'MEGASCALE_COORDINATOR_ADDRESS', 'value': host(0, 0)},
      {'name': 'MEGASCALE_NUM_SLICES', 'value': str(s.count)},
      {'name': 'MEGASCALE_SLICE_ID', 'value': '$(JOB_INDEX)'},
    ]
  return env


def literal(arg: str) -> str:
  """`arg` as Kubernetes passes it on from a container's args: $(VAR) would be expanded, $$ is
  read as $."""
  return arg.replace('$', '$$')


def pod_spec(s: Slices, image: str, args: list[str], grace: int) -> dict:
  """The pod of one host: the TPU node selectors and chips, host networking (the slices' traffic
  and the pods' names), the run's command, no restarts of its own (the JobSet restarts them all)."""
  return {
    'restartPolicy': 'Never',
    'hostNetwork': True,
    'dnsPolicy': 'ClusterFirstWithHostNet',
    'terminationGracePeriodSeconds': grace,
    'nodeSelector': {
      'cloud.google.com/gke-tpu-accelerator': s.accelerator,
      'cloud.google.com/gke-tpu-topology': s.shape,
    },
    'tolerations': [{'key': 'google.com/tpu', 'operator': 'Exists', 'effect': 'NoSchedule'}],
    'containers': [
      {
        'name': 'moetrain',
        'image': image,
        'command': ['bash', POD_SCRIPT],
        'args': [literal(a) for a in args],
        'env': environment(s),
        'ports': [{'containerPort': p} for p in PORTS],
        'resources': {'limits': {'google.com/tpu': str(s.chips_per_host)}},
      }
    ],
  }


def manifest(
  s: Slices,
  name: str,
  image: str,
  args: list[str],
  grace: int,
  max_restarts: int,
  namespace: str = '',
  queue: str = '',
) -> dict:
  """The JobSet: one replicated Job per slice (Indexed, a pod per host), each slice on a node
  pool of its own; any failed pod fails its Job, and the JobSet then recreates every pod (up to
  `max_restarts` times), which resume from the run directory."""
  labels = {'app.kubernetes.io/name': 'moetrain'}
  meta = {'name': name} | ({'namespace': namespace} if namespace else {})
  job = {
    'spec': {
      'parallelism': s.hosts,
      'completions': s.hosts,
      'completionMode': 'Indexed',
      'backoffLimit': 0,
      'template': {'metadata': {'labels': labels}, 'spec': pod_spec(s, image, args, grace)},
    }
  }
  return {
    'apiVersion': JOBSET_API,
    'kind': 'JobSet',
    'metadata': meta
    | {
      'labels': labels | ({'kueue.x-k8s.io/queue-name': queue} if queue else {}),
      'annotations': {
        'alpha.jobset.sigs.k8s.io/exclusive-topology': 'cloud.google.com/gke-nodepool'
      },
    },
    'spec': {
      'failurePolicy': {'maxRestarts': max_restarts},
      'network': {'enableDNSHostnames': True, 'publishNotReadyAddresses': True},
      'replicatedJobs': [{'name': REPLICATED_JOB, 'replicas': s.count, 'template': job}],
    },
  }


def coordinator(name: str) -> str:
  """JAX's coordinator of the job `name`: slice 0's pod 0, at JAX's port."""
  return f'{host(0, 0).replace("$(JOBSET_NAME)", name)}:{JAX_COORDINATOR_PORT}'


def xpk_command(
  s: Slices,
  name: str,
  cluster: str,
  image: str,
  args: list[str],
  grace: int,
  max_restarts: int,
  where: tuple[str, ...] = (),
) -> list[str]:
  """`xpk workload create` for the same job: xpk writes the JobSet (and GKE gives its TPU pods the
  workers' variables); every failure restarts it, as the manifest's policy does. `where`: xpk's
  --project and --zone flags, if given."""
  return [
    'xpk',
    'workload',
    'create',
    f'--cluster={cluster}',
    f'--workload={name}',
    f'--docker-image={image}',
    f'--tpu-type={s.xpk_type}',
    f'--num-slices={s.count}',
    f'--max-restarts={max_restarts}',
    '--restart-on-user-code-failure',
    f'--termination-grace-period-seconds={grace}',
    *where,
    f'--command={shlex.join(["bash", POD_SCRIPT, *args])}',
  ]


def grace_seconds(step_seconds: float, save_bytes_per_host: float) -> int:
  """terminationGracePeriodSeconds for a run (the constants' comment), in whole half-minutes."""
  need = STEPS_BEFORE_SAVE * ESTIMATE_FACTOR * step_seconds
  need += save_bytes_per_host / WRITE_BYTES_PER_S + MARGIN_S
  return 30 * math.ceil(need / 30)


def checkpoint_bytes(config, s: Slices) -> tuple[int, dict]:
  """Bytes of one checkpoint (what TrainState.saved() holds: the trained weights, the optimizer
  state, the step), from shapes, and the mesh. The config is built for the job's devices and
  processes, so a data section that does not split over its hosts is refused here."""
  import jax

  from moetrain.core import sharding
  from moetrain.run import startup
  from moetrain.training import optim
  from moetrain.training.train_state import init_state

  setup = startup.build(
    config, num_devices=s.topology.num_devices, process_count=s.processes, platform='tpu'
  )
  optimizer = optim.make_optimizer(setup.optim, setup.train.steps)
  state = jax.eval_shape(lambda: init_state(setup.model, optimizer, setup.seed))
  saved = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.saved()))
  return saved, dict(zip(sharding.MESH_AXES, setup.mesh_shape))


def fitting_plan(config, plan_topology: str, cache: str) -> dict:
  """The planner's plan of `config` on `plan_topology` (from its cache, else compiled: minutes
  at flash scale); one that does not fit is refused."""
  from moetrain.planner import tpu_plan

  runtime.quiet_library_logs()
  runtime.quiet_tpu_discovery()
  with contextlib.redirect_stdout(sys.stderr):  # (stdout may be the manifest)
    (r,) = tpu_plan.plan_many(config, [(plan_topology, {})], workers=1, cache=cache)
  return check_fits(r, plan_topology)


def read_plan(path: str, s: Slices) -> dict:
  """A plan that `tools.plan --json=PATH` wrote, of this topology; one that does not fit is
  refused. (That it is of this config is checked against the mesh in main.)"""
  import json

  with open(path) as fh:
    r = json.load(fh)
  if not isinstance(r, dict) or 'topology' not in r:
    raise runtime.UserError(f'--plan={path}: not a plan of tools.plan --json (one topology)')
  if (r['topology'], r.get('devices')) != (s.topology.cloud_name, s.topology.num_devices):
    raise runtime.UserError(
      f'--plan={path} is of {r["topology"]}, not of {s.topology.cloud_name}: plan this topology'
    )
  return check_fits(r, s.topology.name)


def check_fits(r: dict, plan_topology: str) -> dict:
  """The plan `r`, said on stderr, if it fits; else the one-line refusal."""
  if not r.get('fits'):
    need = r.get('need_bytes') or r.get('per_chip_bytes', {}).get('total')
    size = f'{need / 2**30:.1f} GiB per chip, ' if need else ''
    raise runtime.UserError(
      f'{plan_topology}: the run does not fit ({size}{r.get("error", "over the HBM")}); nothing '
      f'was written. python -m moetrain.tools.plan --topology={plan_topology} --search finds '
      'settings that do'
    )
  print(
    f'{plan_topology}: {r["need_bytes"] / 2**30:.1f} of {r["hbm_bytes"] / 2**30:.1f} GiB HBM per '
    f'chip ({100 * r["headroom"]:.0f}% free), est. step {r["est_step_seconds"]:.2f} s',
    file=sys.stderr,
  )
  return r


def config_in_image(path: str) -> str:
  """The --config argument as the image reads it: a file of the repository's configs/."""
  file, sep, arg = path.partition(':')
  folder = os.path.dirname(os.path.abspath(file))
  if os.path.basename(folder) != 'configs' or not os.path.exists(f'{folder}/__init__.py'):
    raise runtime.UserError(
      f"--config={path}: the image holds the repository's configs/ only; put the file there "
      'and rebuild the image (make image)'
    )
  return f'configs/{os.path.basename(file)}{sep}{arg}'


def config_overrides(argv: list[str]) -> list[str]:
  """The --config.KEY=VALUE arguments of a command line (a VALUE after a space joined on)."""
  out = []
  for i, a in enumerate(argv):
    if a.startswith('--config.'):
      out.append(a if '=' in a or i + 1 == len(argv) else f'{a}={argv[i + 1]}')
  return out


def default_name(workdir: str) -> str:
  """A JobSet name from the run directory's last part: lower case, letters, digits, '-'."""
  base = re.sub(r'[^a-z0-9]+', '-', os.path.basename(workdir.rstrip('/')).lower()).strip('-')
  base = base if base[:1].isalpha() else f'run-{base}'.rstrip('-')
  return base[:40].rstrip('-')


def check_flags(f) -> None:
  if not (f.gke or f.xpk):
    raise app.UsageError('say what to write: --gke (a JobSet manifest) and/or --xpk')
  if not f.workdir.startswith('gs://'):
    raise app.UsageError(
      f"--workdir={f.workdir}: a pod's own disk goes with it; give a Cloud Storage URL (gs://...)"
    )
  if f.xpk and not f.cluster:
    raise app.UsageError('--xpk needs --cluster')
  if f.max_restarts < 0:
    raise app.UsageError(f'--max_restarts={f.max_restarts}: 0 or more')


def main(argv):
  del argv
  import yaml

  f = flags.FLAGS
  check_flags(f)
  name = f.name or default_name(f.workdir)
  if not NAME.fullmatch(name):
    raise app.UsageError(f'--name={name}: lower-case letters, digits and -, at most 40')
  s = slices(f.topology, f.slices)
  args = [
    f'--config={config_in_image(f["config"].config_filename)}',
    f'--workdir={f.workdir}',
    *config_overrides(sys.argv[1:]),
  ]
  from moetrain.planner import tpu_plan

  if f.plan:
    plan = read_plan(f.plan, s)
  else:
    plan = fitting_plan(f.config, s.topology.name, tpu_plan.CACHE)
  saved, mesh = checkpoint_bytes(f.config, s)
  # (A plan written before the stage or context axes names neither: both 1.)
  if {'stage': 1, 'context': 1, **plan.get('mesh', mesh)} != mesh:
    raise runtime.UserError(f'--plan={f.plan} is of the mesh {plan["mesh"]}, this config {mesh}')
  grace = grace_seconds(plan['est_step_seconds'], saved / s.hosts)
  pods = (
    f'{s.count} x {s.hosts} pods ({s.accelerator} {s.shape}, {s.chips_per_host} chips each): '
    + (
      f'JAX processes 0-{s.processes - 1}, coordinator {coordinator(name)}'
      if s.processes > 1
      else 'one JAX process'
    )
  )
  why = (
    f'grace {grace} s: {STEPS_BEFORE_SAVE} steps at {ESTIMATE_FACTOR:g}x est. '
    f'{plan["est_step_seconds"]:.2f} s, then {saved / s.hosts / 2**30:.2f} GiB of checkpoint per '
    f'host at {WRITE_BYTES_PER_S / 1e6:.0f} MB/s, + {MARGIN_S} s'
  )
  if f.gke:
    doc = manifest(s, name, f.image, args, grace, f.max_restarts, f.namespace, f.queue)
    text = f'# {name}: {pods}\n# {why}\n' + yaml.safe_dump(doc, sort_keys=False, width=1000)
    if f.dry_run:
      print(text, end='')
    else:
      out = f.out or f'{name}.yaml'
      with open(out, 'w') as fh:
        fh.write(text)
      print(f'wrote {out}: JobSet {name}, {pods}; {why}\nkubectl apply -f {out}')
  if f.xpk:
    where = tuple(f'--{k}={f[k].value}' for k in ('project', 'zone') if f[k].value)
    cmd = xpk_command(s, name, f.cluster, f.image, args, grace, f.max_restarts, where)
    print(shlex.join(cmd))


def define_flags() -> None:
  from ml_collections import config_flags

  config_flags.DEFINE_config_file('config', None, 'Experiment config file.', lock_config=True)
  flags.DEFINE_string('topology', None, 'One slice: v5p-128, v5litepod-16, v6e-64, v5p:4x4x4.')
  flags.DEFINE_integer('slices', 1, 'Slices joined over the data-center network (multislice).')
  flags.DEFINE_string('workdir', None, 'Run directory, a Cloud Storage URL (gs://...).')
  flags.DEFINE_string('image', None, 'Container image built by `make image`, pushed.')
  flags.DEFINE_bool('gke', False, 'Write the JobSet manifest (kubectl apply -f it).')
  flags.DEFINE_bool('xpk', False, 'Print the equivalent `xpk workload create` command.')
  flags.DEFINE_bool('dry_run', False, 'Print the manifest instead of writing it.')
  flags.DEFINE_string(
    'plan', '', 'A plan of this config and topology by tools.plan --json (default: planned here).'
  )
  flags.DEFINE_string('out', '', 'Manifest path (default <name>.yaml).')
  flags.DEFINE_string('name', '', "JobSet / xpk workload name (default: the workdir's last part).")
  flags.DEFINE_string('namespace', '', 'Kubernetes namespace (default: kubectl context).')
  flags.DEFINE_string('queue', '', 'Kueue LocalQueue (label kueue.x-k8s.io/queue-name).')
  flags.DEFINE_string('cluster', '', "xpk's --cluster.")
  flags.DEFINE_string('project', '', "xpk's --project (default: gcloud's).")
  flags.DEFINE_string('zone', '', "xpk's --zone (default: gcloud's).")
  flags.DEFINE_integer('max_restarts', 10, 'JobSet restarts (all pods) after a failure.')
  flags.mark_flags_as_required(['config', 'topology', 'workdir', 'image'])


if __name__ == '__main__':
  define_flags()
  app.run(runtime.short_errors(main), flags_parser=runtime.parse_flags)
