"""GKE launches (moetrain/tools/launch.py): the JobSet manifest against the schemas of the fields
it uses (the Kubernetes client's models for the Job and pod, a JSON schema here for the JobSet's
own), each pod's JAX process id and coordinator as JAX derives them from its environment, the
command line's dry run, the pods' command script and the image. No cluster is reached."""

import json
import os
import re
import shlex
import signal
import subprocess
import time
import types

import pytest
import yaml
from absl import app

from configs import longcat_lora
from moetrain.core import runtime, sharding
from moetrain.planner import tpu_plan
from moetrain.tools import launch
from tests.helpers import ROOT, run_command

jsonschema = pytest.importorskip('jsonschema')
kubernetes = pytest.importorskip('kubernetes')

ARGS = ['--config=configs/longcat_lora.py:variant=flash', '--workdir=gs://bucket/runs/flash']
CASES = [('v5p-8', 1), ('v5p-128', 1), ('v5e-16', 2)]

_STR = {'type': 'string'}
_STRINGS = {'type': 'object', 'additionalProperties': _STR}


def _object(required: list[str], **properties) -> dict:
  return {
    'type': 'object',
    'required': required,
    'properties': properties,
    'additionalProperties': False,
  }


# The JobSet fields the manifest uses (jobset.x-k8s.io/v1alpha2, api/jobset/v1alpha2/
# jobset_types.go); each replicated Job's template is a batch/v1 JobTemplateSpec, checked by the
# Kubernetes client's models.
JOBSET_SCHEMA = _object(
  ['apiVersion', 'kind', 'metadata', 'spec'],
  apiVersion={'const': 'jobset.x-k8s.io/v1alpha2'},
  kind={'const': 'JobSet'},
  metadata=_object(
    ['name'],
    name={'type': 'string', 'pattern': r'^[a-z]([-a-z0-9]*[a-z0-9])?$', 'maxLength': 40},
    namespace=_STR,
    labels=_STRINGS,
    annotations=_STRINGS,
  ),
  spec=_object(
    ['replicatedJobs'],
    failurePolicy=_object([], maxRestarts={'type': 'integer', 'minimum': 0}),
    network=_object(
      [], enableDNSHostnames={'type': 'boolean'}, publishNotReadyAddresses={'type': 'boolean'}
    ),
    replicatedJobs={
      'type': 'array',
      'minItems': 1,
      'items': _object(
        ['name', 'template'],
        name=_STR,
        replicas={'type': 'integer', 'minimum': 1},
        template={'type': 'object'},
      ),
    },
  ),
)


def _manifest(topology: str, count: int, args=ARGS) -> dict:
  s = launch.slices(topology, count)
  return launch.manifest(s, 'flash', 'IMG', args, grace=120, max_restarts=10, queue='q')


def _deserialized(data: dict, kind: str):
  api = kubernetes.client.ApiClient()
  return api.deserialize(json.dumps(data), kind, 'application/json')


@pytest.mark.parametrize('topology,count', CASES)
def test_the_manifest_holds_only_fields_of_the_jobset_job_and_pod_schemas(topology, count):
  doc = _manifest(topology, count)
  assert yaml.safe_load(yaml.safe_dump(doc)) == doc
  jsonschema.validate(doc, JOBSET_SCHEMA)
  api = kubernetes.client.ApiClient()
  for rjob in doc['spec']['replicatedJobs']:
    # The client's models drop what they do not know: a round trip that changes nothing holds
    # only fields (and types) of the batch/v1 and core/v1 schemas.
    model = _deserialized(rjob['template'], 'V1JobTemplateSpec')
    assert api.sanitize_for_serialization(model) == rjob['template']
    assert model.spec.completion_mode == 'Indexed' and model.spec.backoff_limit == 0
    pod = model.spec.template.spec
    assert pod.restart_policy == 'Never' and pod.host_network
    assert pod.termination_grace_period_seconds == 120


def test_a_misspelt_field_fails_the_checks():
  doc = _manifest('v5p-128', 1)
  doc['spec']['failurePolicy']['maxRestart'] = 3
  with pytest.raises(jsonschema.ValidationError):
    jsonschema.validate(doc, JOBSET_SCHEMA)
  job = _manifest('v5p-128', 1)['spec']['replicatedJobs'][0]['template']
  job['spec']['template']['spec']['containers'][0]['enviroment'] = []
  api = kubernetes.client.ApiClient()
  assert api.sanitize_for_serialization(_deserialized(job, 'V1JobTemplateSpec')) != job


@pytest.mark.parametrize(
  'topology,count,hosts,chips,accelerator,shape,xpk',
  [
    ('v5p-8', 1, 1, 4, 'tpu-v5p-slice', '2x2x1', 'v5p-8'),
    ('v5p-128', 1, 16, 4, 'tpu-v5p-slice', '4x4x4', 'v5p-128'),
    ('v5e-16', 2, 4, 4, 'tpu-v5-lite-podslice', '4x4', 'v5litepod-16'),
    ('2xv5litepod-16', 1, 4, 4, 'tpu-v5-lite-podslice', '4x4', 'v5litepod-16'),
    ('v6e-8', 1, 1, 8, 'tpu-v6e-slice', '2x4', 'v6e-8'),
    ('tpu7x:4x4x4', 1, 16, 4, 'tpu7x', '4x4x4', 'tpu7x-4x4x4'),
  ],
)
def test_slices_as_gke_schedules_them(topology, count, hosts, chips, accelerator, shape, xpk):
  s = launch.slices(topology, count)
  assert (s.hosts, s.chips_per_host, s.accelerator, s.shape, s.xpk_type) == (
    hosts,
    chips,
    accelerator,
    shape,
    xpk,
  )
  assert s.count * s.hosts * s.chips_per_host == s.topology.chips
  pod = _manifest(topology, count)['spec']['replicatedJobs'][0]['template']['spec']['template']
  assert pod['spec']['nodeSelector'] == {
    'cloud.google.com/gke-tpu-accelerator': accelerator,
    'cloud.google.com/gke-tpu-topology': shape,
  }
  assert pod['spec']['containers'][0]['resources']['limits'] == {'google.com/tpu': str(chips)}


@pytest.mark.parametrize(
  'topology,count,match',
  [
    ('v5p-8', 2, 'one host'),
    ('v5e-2', 1, 'no v5e node of 2 chips'),
    ('2xv5e-16', 3, 'names 2 slices'),
    ('v5p-128', 0, 'at least one'),
  ],
)
def test_slices_gke_cannot_give_are_refused(topology, count, match):
  with pytest.raises(ValueError, match=match):
    launch.slices(topology, count)


def _expand(value: str, env: dict) -> str:
  """Kubernetes' expansion of an env value or argument: $(VAR) of a variable defined before it,
  else left as it is; $$ is $."""
  ref = re.compile(r'\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)')
  return ref.sub(lambda m: '$' if m.group(0) == '$$' else env.get(m.group(1), m.group(0)), value)


def _pod(name: str, rjob: str, job_index: int, index: int) -> dict:
  """What the JobSet and Job controllers give pod `index` of Job `job_index`: its annotations,
  and its DNS name in the JobSet's headless service (hostname.subdomain)."""
  annotations = {
    'jobset.sigs.k8s.io/jobset-name': name,
    'jobset.sigs.k8s.io/replicatedjob-name': rjob,
    'jobset.sigs.k8s.io/job-index': str(job_index),
    'batch.kubernetes.io/job-completion-index': str(index),
  }
  return {'annotations': annotations, 'dns': f'{name}-{rjob}-{job_index}-{index}.{name}'}


def _environment(container: dict, pod: dict) -> dict:
  env = {}
  for e in container.get('env', []):
    if 'valueFrom' in e:
      path = e['valueFrom']['fieldRef']['fieldPath']
      key = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path).group(1)
      env[e['name']] = pod['annotations'][key]
    else:
      env[e['name']] = _expand(e['value'], env)
  return env


def _pods(doc: dict):
  """(pod, its environment) of every pod of the JobSet."""
  name = doc['metadata']['name']
  for rjob in doc['spec']['replicatedJobs']:
    job = rjob['template']['spec']
    container = job['template']['spec']['containers'][0]
    for j in range(rjob['replicas']):
      for i in range(job['completions']):
        pod = _pod(name, rjob['name'], j, i)
        yield pod, _environment(container, pod)


def _jax_view(env: dict, monkeypatch) -> tuple[int, int, str]:
  """(process id, process count, coordinator) as jax.distributed.initialize() finds them on a
  GKE TPU pod with this environment (its GkeTpuCluster), the coordinator's DNS lookup left out."""
  from jax._src.clusters import cloud_tpu_cluster as tpu

  for k in [k for k in os.environ if k.startswith(('TPU_', 'MEGASCALE_'))]:
    monkeypatch.delenv(k)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setattr(tpu.BaseTpuCluster, 'wait_for_coordinator', classmethod(lambda *a: None))
  # A variable the pod lacks (one slice: the MEGASCALE_ ones) JAX asks the TPU VM's metadata
  # for; a node without it answers None.
  monkeypatch.setattr(tpu, 'get_tpu_env_value_from_metadata', lambda key: None)
  c = tpu.GkeTpuCluster
  return c.get_process_id(), c.get_process_count(), c.get_coordinator_address(0, None)


@pytest.mark.parametrize('topology,count', CASES)
def test_every_pod_gets_its_own_process_id_and_the_one_coordinator(topology, count, monkeypatch):
  doc = _manifest(topology, count)
  s = launch.slices(topology, count)
  seen = {}
  for pod, env in _pods(doc):
    if s.processes == 1:  # one process: it joins no job (runtime.initialize_distributed)
      assert 'TPU_WORKER_HOSTNAMES' not in env and 'MOETRAIN_DISTRIBUTED' not in env
      seen[0] = launch.coordinator('flash')
      continue
    a = pod['annotations']
    job, index = int(a['jobset.sigs.k8s.io/job-index']), int(a[launch.COMPLETION_INDEX])
    # The workers of the pod's slice are its Job's pods, in completion-index order.
    assert env['TPU_WORKER_HOSTNAMES'].split(',') == [
      _pod('flash', launch.REPLICATED_JOB, job, i)['dns'] for i in range(s.hosts)
    ]
    process, processes, coordinator = _jax_view(env, monkeypatch)
    assert process == job * s.hosts + index and processes == s.processes
    seen[process] = coordinator
  assert sorted(seen) == list(range(s.processes))
  assert set(seen.values()) == {launch.coordinator('flash')}
  assert launch.coordinator('flash') == f'{_pod("flash", "slice", 0, 0)["dns"]}:8482'


def test_the_coordinator_port_is_jaxs():
  from jax._src.clusters import cloud_tpu_cluster

  assert str(launch.JAX_COORDINATOR_PORT) == cloud_tpu_cluster.coordinator_port


def test_arguments_reach_the_pod_as_given():
  args = [*ARGS, '--config.data.path=gs://b/$(USER)/{split}.jsonl', '--config.x=a$$b c']
  (_, env), *_ = _pods(_manifest('v5p-128', 1, args))
  container = _manifest('v5p-128', 1, args)['spec']['replicatedJobs'][0]['template']['spec']
  got = [_expand(a, env) for a in container['template']['spec']['containers'][0]['args']]
  assert got == args


def test_grace_period_covers_the_steps_and_the_save():
  # Two steps at twice the estimate, 2 GiB a host at 100 MB/s, a minute: in half-minutes.
  assert launch.grace_seconds(5.6, 2 * 2**30) == 120
  assert launch.grace_seconds(0.1, 0) == 90
  assert launch.grace_seconds(30.0, 100e9) == 30 * -(-(120 + 1000 + 60) // 30)


def test_config_files_and_overrides_as_the_image_reads_them(tmp_path):
  assert launch.config_in_image('configs/longcat_lora.py:variant=flash') == ARGS[0].split('=', 1)[1]
  assert launch.config_in_image(f'{ROOT}/configs/base.py') == 'configs/base.py'
  (tmp_path / 'mine.py').write_text('')
  with pytest.raises(runtime.UserError, match='configs/ only'):
    launch.config_in_image(str(tmp_path / 'mine.py'))
  argv = ['--config=c.py', '--config.a=1', '--gke', '--config.b', '2 3', '--config.c=(1,-1)']
  assert launch.config_overrides(argv) == ['--config.a=1', '--config.b=2 3', '--config.c=(1,-1)']
  assert launch.default_name('gs://b/runs/Flash_LoRA/') == 'flash-lora'
  assert launch.default_name('gs://b/7') == 'run-7'


FITS = {'fits': True, 'need_bytes': 62 * 2**30, 'hbm_bytes': 96 * 2**30, 'headroom': 0.35}


def test_a_run_that_does_not_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
  """The plan comes from the planner's cache (keyed here by the topology alone: this test must
  not compile), or from a plan file of tools.plan --json."""
  monkeypatch.setattr(runtime, 'quiet_tpu_discovery', lambda: None)
  monkeypatch.setattr(tpu_plan, '_cache_key', lambda config, topology, *a: topology)
  monkeypatch.setattr(tpu_plan, 'plan', lambda *a: pytest.fail('compiled'))
  config, cache = longcat_lora.get_config(), str(tmp_path / 'plans.json')
  tpu_plan._save_cache({'v5p-8': FITS | {'est_step_seconds': 1.0}}, cache)
  assert launch.fitting_plan(config, 'v5p-8', cache)['fits']
  tpu_plan._save_cache({'v5p-8': {'fits': False, 'need_bytes': 120 * 2**30, 'error': 'HBM'}}, cache)
  with pytest.raises(runtime.UserError, match=r'does not fit \(120.0 GiB per chip.*--search'):
    launch.fitting_plan(config, 'v5p-8', cache)
  plan = tmp_path / 'plan.json'
  plan.write_text(json.dumps({'topology': 'v5p-8', 'devices': 4, 'fits': False}))
  with pytest.raises(runtime.UserError, match='does not fit'):
    launch.read_plan(str(plan), launch.slices('v5p-8'))
  with pytest.raises(runtime.UserError, match='is of v5p-8, not of v5p-128'):
    launch.read_plan(str(plan), launch.slices('v5p-128'))


def test_dry_run_prints_the_flash_jobset_and_the_xpk_command(tmp_path, monkeypatch):
  """The command line on the flagship: a v5p-128's 16 pods, process ids 0-15, one coordinator
  (its plan from a file: compiling it takes minutes)."""
  from moetrain.run import startup

  overrides = ['--config.train.steps=100']
  config = longcat_lora.get_config('variant=flash')
  mesh = startup.build(config, num_devices=64, process_count=16, platform='tpu').mesh_shape
  plan = tmp_path / 'plan.json'
  plan.write_text(
    json.dumps(
      {'topology': 'v5p-128', 'devices': 64, 'mesh': dict(zip(sharding.MESH_AXES, mesh))}
      | FITS
      | {'est_step_seconds': 5.6}
    )
  )
  out = run_command(
    'moetrain.tools.launch',
    *ARGS,
    *overrides,
    '--topology=v5p-128',
    '--image=IMG',
    '--gke',
    '--xpk',
    '--cluster=C',
    '--dry_run',
    f'--plan={plan}',
    '--zone=us-east5-a',
  )
  assert out.returncode == 0, out.stderr
  assert 'v5p-128: 62.0 of 96.0 GiB HBM per chip (35% free)' in out.stderr
  *manifest, xpk = out.stdout.rstrip('\n').split('\n')
  assert manifest[0] == (
    '# flash: 1 x 16 pods (tpu-v5p-slice 4x4x4, 4 chips each): JAX processes 0-15, coordinator '
    'flash-slice-0-0.flash:8482'
  )
  doc = yaml.safe_load('\n'.join(manifest))
  jsonschema.validate(doc, JOBSET_SCHEMA)
  (rjob,) = doc['spec']['replicatedJobs']
  pod = rjob['template']['spec']['template']['spec']
  assert pod['containers'][0]['args'] == [*ARGS, *overrides]
  ids = {}
  for _, env in _pods(doc):
    process, count, coordinator = _jax_view(env, monkeypatch)
    ids[process] = coordinator
  assert sorted(ids) == list(range(16)) and set(ids.values()) == {'flash-slice-0-0.flash:8482'}
  grace = pod['terminationGracePeriodSeconds']
  assert grace >= launch.grace_seconds(5.6, 0)
  *xpk, command = shlex.split(xpk)
  assert xpk == [
    'xpk',
    'workload',
    'create',
    '--cluster=C',
    '--workload=flash',
    '--docker-image=IMG',
    '--tpu-type=v5p-128',
    '--num-slices=1',
    '--max-restarts=10',
    '--restart-on-user-code-failure',
    f'--termination-grace-period-seconds={grace}',
    '--zone=us-east5-a',
  ]
  assert shlex.split(command.removeprefix('--command=')) == [
    'bash',
    launch.POD_SCRIPT,
    *ARGS,
    *overrides,
  ]
  assert not list(tmp_path.glob('*.yaml')) and not os.path.exists(os.path.join(ROOT, 'flash.yaml'))


def test_flags_that_cannot_make_a_launch_are_refused():
  ok = dict(gke=True, xpk=False, workdir='gs://b/r', cluster='', max_restarts=10)
  launch.check_flags(types.SimpleNamespace(**ok))
  for bad, match in [
    ({'gke': False}, '--gke'),
    ({'workdir': 'runs/x'}, 'gs://'),
    ({'xpk': True}, '--xpk needs --cluster'),
    ({'max_restarts': -1}, '0 or more'),
  ]:
    with pytest.raises(app.UsageError, match=match):
      launch.check_flags(types.SimpleNamespace(**ok | bad))


FAKE_PYTHON = """\
#!/usr/bin/env bash
# python -m moetrain.main, as the pod script starts it: says its arguments, then works until
# a SIGTERM, on which it "saves" and exits 0; MODE=exit3 ends at once with status 3.
echo "run: $*"
if [[ "${MODE:-}" == exit3 ]]; then exit 3; fi
trap 'echo saved; exit 0' TERM
touch "$STARTED"
while true; do sleep 0.05; done
"""


def _pod_script(tmp_path, **env) -> subprocess.Popen:
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir(exist_ok=True)
  (bin_dir / 'python').write_text(FAKE_PYTHON)
  (bin_dir / 'python').chmod(0o755)
  return subprocess.Popen(
    ['bash', os.path.join(ROOT, launch.POD_SCRIPT), '--config=c.py', '--workdir=gs://b/r x'],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={'PATH': f'{bin_dir}:{os.environ["PATH"]}', 'STARTED': str(tmp_path / 'started'), **env},
  )


def test_the_pod_script_passes_sigterm_on_and_fails_the_pod_after_the_save(tmp_path):
  p = _pod_script(tmp_path)
  deadline = time.monotonic() + 20
  while not (tmp_path / 'started').exists():
    assert time.monotonic() < deadline and p.poll() is None, p.communicate()
    time.sleep(0.02)
  p.send_signal(signal.SIGTERM)
  out, err = p.communicate(timeout=20)
  assert out.splitlines() == ['run: -m moetrain.main --config=c.py --workdir=gs://b/r x', 'saved']
  assert p.returncode == 143 and 'SIGTERM passed on to the run' in err


def test_the_pod_script_ends_with_the_runs_status(tmp_path):
  p = _pod_script(tmp_path, MODE='exit3')
  out, _ = p.communicate(timeout=20)
  assert p.returncode == 3 and out.startswith('run: -m moetrain.main')


def test_the_image_holds_what_the_pods_run():
  lines = [
    line
    for line in open(os.path.join(ROOT, 'Dockerfile')).read().splitlines()
    if line and not line.startswith('#')
  ]
  assert lines[0].startswith('FROM python:3.12')
  assert "RUN pip install '.[tpu]'" in lines
  assert lines[-1] == 'ENTRYPOINT ["python", "-m", "moetrain.main"]'
  copied = [line.split()[1:-1] for line in lines if line.startswith('COPY ')]
  sources = [src for srcs in copied for src in srcs]
  assert {'configs', launch.POD_SCRIPT} <= set(sources)
  allowed = open(os.path.join(ROOT, '.dockerignore')).read().split()
  for src in sources:  # each is there, and not ignored
    assert os.path.exists(os.path.join(ROOT, src)) and f'!{src}' in allowed, src
  env = {k: v for k, v in os.environ.items() if k not in ('MAKEFLAGS', 'MAKELEVEL', 'MFLAGS')}
  make = subprocess.run(  # (under `make test` a sub-make would print its directory)
    ['make', '-n', '--no-print-directory', 'image', 'IMAGE=x/y:z'],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
  )
  assert make.stdout.strip().splitlines()[-1] == 'docker build -t x/y:z .'
