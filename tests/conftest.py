"""Test setup: 8 emulated CPU devices, strict rank promotion, a shared compilation cache."""

import os

# Tests are dominated by compiling many small programs: skip LLVM's optimisation passes (the
# cold suite of tests/test_lora.py: 130 s -> 84 s). The numerics are the same XLA programs.
os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '')
  + ' --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402

jax.config.update('jax_numpy_rank_promotion', 'raise')
jax.config.update(
  'jax_compilation_cache_dir', os.path.join(os.path.dirname(__file__), '..', '.jax_cache')
)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 1.0)


def pytest_collection_modifyitems(items):
  """The end-to-end subprocess tests (minutes each) first, so that under `-n 2` the two workers
  finish together instead of one starting them last."""
  items.sort(key=lambda item: 0 if item.path.name == 'test_preemption.py' else 1)
