"""Cloud TPU slices as the TPU compiler sees them: names, chips and per-device limits."""

import dataclasses
import math
import os
import re

from jax.experimental import topologies


@dataclasses.dataclass(frozen=True)
class Chip:
  """One JAX device of a TPU generation, as libtpu presents it (a v4 chip is two devices).

  hbm_bytes is what XLA's TPU compiler allows a program (its RESOURCE_EXHAUSTED limit, which
  tests/test_plan.py checks against the compiler); the rates are public peak figures."""

  generation: str  # the topology prefix libtpu takes ('v5p', 'v6e', ...)
  device_kind: str  # jax Device.device_kind
  hbm_bytes: int
  peak_flops: float  # bf16 FLOP/s per device
  hbm_bandwidth: float  # bytes/s per device
  ici_bandwidth: float  # bytes/s per device, all links, one direction
  dims: int  # torus dimensions of its topology names
  devices_per_chip: int = 1
  # bytes/s per device over the data-center network between slices (multislice), one direction
  dcn_bandwidth: float = 50e9 / 8


def _gib(x: float) -> int:
  return int(x * 2**30)


# Per device. Peak rates from Google's Cloud TPU system-architecture pages (bf16; ICI: the
# chip's links together, one way). DCN: v5p's page gives 50 Gbps per chip; v5e's 2 x 100 Gbps
# NICs per 8-chip host are 25 Gbps per chip; the v4, v6e and Ironwood pages read give no
# per-chip figure, so those take v5p's 50 Gbps per chip.
CHIPS = {
  'v4': Chip('v4', 'TPU v4', _gib(15.25), 275e12 / 2, 1.2e12 / 2, 2.7e11 / 2, 3, 2, 50e9 / 16),
  'v5e': Chip('v5e', 'TPU v5 lite', _gib(15.75), 197e12, 8.19e11, 2e11, 2, 1, 25e9 / 8),
  'v5p': Chip('v5p', 'TPU v5', _gib(95.73), 459e12, 2.765e12, 6e11, 3),
  'v6e': Chip('v6e', 'TPU v6 lite', _gib(31.24), 918e12, 1.64e12, 4.5e11, 2),
  # Ironwood: two devices per chip; named in libtpu's form only ('tpu7x:2x2x1').
  'tpu7x': Chip('tpu7x', 'TPU7x', _gib(94.74), 2307e12 / 2, 7.37e12 / 2, 6e11 / 2, 3, 2, 50e9 / 16),
}
# Cloud accelerator-type prefixes that name the same generations.
ALIASES = {'v5litepod': 'v5e', 'v6litepod': 'v6e'}
# Cloud names count TensorCores for v4 and v5p (v5p-128 is 64 chips) and chips for the others.
CORES_PER_CHIP_IN_NAME = {'v4': 2, 'v5p': 2}


@dataclasses.dataclass(frozen=True)
class Topology:
  name: str  # as asked: 'v5p-128' or 'v5p:4x4x4' (or '2xv5p-128': two slices)
  topology_name: str  # libtpu's, of one slice: 'v5p:4x4x4'
  chip: Chip
  chips: int  # over all slices
  slices: int = 1  # multislice: slices joined over the data-center network

  @property
  def num_devices(self) -> int:
    return self.chips * self.chip.devices_per_chip

  @property
  def cloud_name(self) -> str:
    g = self.chip.generation
    one = f'{g}-{self.chips // self.slices * CORES_PER_CHIP_IN_NAME.get(g, 1)}'
    return one if self.slices == 1 else f'{self.slices}x{one}'

  def devices(self):
    return topology_devices(self.topology_name, self.slices)


def _torus(chips: int, dims: int) -> str:
  """Cloud's torus for `chips` chips: sides doubled smallest first, listed ascending
  (v5p-64: 2x4x4, v6e-128: 8x16), except that slices of up to 4 chips list their 1s last
  (v5p-8: 2x2x1, as libtpu's host bounds require)."""
  if chips < 1 or chips & (chips - 1):
    raise ValueError(f'{chips} chips: TPU slices are powers of two')
  sides = [1] * dims
  for _ in range(chips.bit_length() - 1):
    sides[sides.index(min(sides))] *= 2
  return 'x'.join(map(str, sorted(sides, reverse=chips <= 4)))


def parse(name: str) -> Topology:
  """'v5p-128' (Cloud accelerator type), 'v5litepod-16', or libtpu's 'v5p:4x4x4' /
  'v6e:16x16'; 'Nx' before either names N slices of it (multislice: '2xv5p-128').
  Generations this table does not know are refused with the ones it does."""
  name = name.strip()
  multi = re.fullmatch(r'(\d+)x([a-z].*)', name)
  if multi:
    one = parse(multi.group(2))
    n = int(multi.group(1))
    if n < 1:
      raise ValueError(f'--topology={name!r}: the slice count must be >= 1')
    return dataclasses.replace(one, name=name, chips=one.chips * n, slices=n)
  m = re.fullmatch(r'([a-z0-9]+?)(?:-(\d+)|:(\d+(?:x\d+)*))', name)
  gen = m and ALIASES.get(m.group(1), m.group(1))
  if not m or gen not in CHIPS:
    raise ValueError(
      f'--topology={name!r}: use a Cloud TPU type such as v5p-128, v5litepod-16, v6e-64, v4-32 '
      f'or a libtpu topology such as v5p:4x4x4; generations known here: {sorted(CHIPS)}'
    )
  chip = CHIPS[gen]
  if m.group(2) and gen == 'tpu7x':
    raise ValueError(f'--topology={name!r}: name {gen} slices by topology, e.g. {gen}:2x2x1')
  if m.group(2):
    n = int(m.group(2))
    per = CORES_PER_CHIP_IN_NAME.get(gen, 1)
    if n % per:
      raise ValueError(f'--topology={name!r}: {gen} names count TensorCores, a multiple of {per}')
    chips = n // per
    if chips & (chips - 1):
      raise ValueError(f'--topology={name!r}: {chips} chips; Cloud TPU slices are powers of two')
    shape = _torus(chips, chip.dims)
  else:
    shape = m.group(3)
    sides = [int(s) for s in shape.split('x')]
    if len(sides) != chip.dims:
      raise ValueError(f'--topology={name!r}: {gen} topologies have {chip.dims} sides')
    chips = math.prod(sides)
  return Topology(name, f'{gen}:{shape}', chip, chips)


def topology_devices(topology_name: str, slices: int = 1):
  """Compile-only TPU devices of `slices` slices of a topology, from libtpu; no TPU needed."""
  # libtpu takes a lock file per process unless told otherwise; the planner's worker processes
  # each load it.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  try:
    import libtpu  # noqa: F401
  except ImportError:
    raise ValueError(
      'compiling for a TPU needs libtpu, which installs on any Linux x86-64 host: pip install -e '
      "'.[tpu]' (or pip install 'jax[tpu]')"
    ) from None

  kwargs = {'num_slices': slices} if slices > 1 else {}
  if math.prod(int(s) for s in topology_name.split(':')[1].split('x')) < 4:
    kwargs['chips_per_host_bounds'] = (1, 1, 1)  # single-chip hosts (v5e-1, v6e-1)
  return topologies.get_topology_desc(platform='tpu', topology_name=topology_name, **kwargs).devices
