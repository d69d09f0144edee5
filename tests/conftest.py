"""Test setup: 8 emulated CPU devices, strict rank promotion, a shared compilation cache (read
here, written by the subprocess tests)."""

import os

# Tests are dominated by compiling many small programs: skip LLVM's optimisation passes (the
# cold suite of tests/test_lora.py: 130 s -> 84 s). The numerics are the same XLA programs.
os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '')
  + ' --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import pytest  # noqa: E402

from moetrain.model import moe as moe_lib  # noqa: E402

jax.config.update('jax_numpy_rank_promotion', 'raise')
jax.config.update(
  'jax_compilation_cache_dir', os.path.join(os.path.dirname(__file__), '..', '.jax_cache')
)
# The test processes read the cache (programs the subprocess tests wrote) but write nothing to
# it: a worker of the two-worker suite crashed in executable.serialize() writing the float16
# train step's entry (test_train_step.py, three fresh-clone runs in a row), a crash a process
# running those tests alone does not show.
jax.config.update('jax_persistent_cache_min_compile_time_secs', 1e9)


def _mappings() -> int | None:
  """The process's memory mappings (Linux's /proc/self/maps), or None where it cannot tell."""
  try:
    with open('/proc/self/maps') as f:
      return sum(1 for _ in f)
  except OSError:
    return None


# XLA:CPU maps every executable's code, and a worker of the two-worker suite that kept them all
# passed Linux's 65,530 mappings a process (vm.max_map_count; 17,700 after three test files) and
# crashed in a later compile (SIGSEGV in backend_compile_and_load). Past half of that, a test's
# compiled programs are dropped after it; below it they are kept, so later tests reuse them (the
# eager ops' programs above all; five test files in one process: 335 s dropping them after each
# file, 287 s with this bound). In a whole suite's run one test added at most 3,704 mappings and
# a worker held at most 33,803.
MAX_MAPPINGS = 32_768


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  """Compiled programs dropped after a test that leaves the process past MAX_MAPPINGS."""
  yield
  if (_mappings() or 0) > MAX_MAPPINGS:
    jax.clear_caches()


@pytest.fixture(autouse=True, scope='module')
def _release_compiled_programs_unmeasured():
  """Where the mappings cannot be counted, each module's compiled programs dropped after it."""
  yield
  if _mappings() is None:
    jax.clear_caches()


def pytest_collection_modifyitems(items):
  """The end-to-end subprocess tests (minutes each) first, so that under `-n 2` the two workers
  finish together instead of one starting them last."""
  items.sort(key=lambda item: 0 if item.path.name == 'test_preemption.py' else 1)


@pytest.fixture
def with_topk(monkeypatch):
  """Test-only: aux['moe']['topk_idx'] [L, M, A], the experts the model's router picked."""
  real = moe_lib.routing_stats

  def stats(logits_MX, probs_MX, idx_MA, *args, **kw):
    return {**real(logits_MX, probs_MX, idx_MA, *args, **kw), 'topk_idx': idx_MA}

  monkeypatch.setattr(moe_lib, 'routing_stats', stats)
