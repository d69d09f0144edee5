"""The routed experts' SwiGLU over dispatched rows, one function per grouped-matmul backend
(engine.moe_backend; dispatch.py places the rows for each and resolve_backend picks one):
ragged_dot (XLA's grouped matmul), megablox (the Pallas TPU kernel), tokamax (its GPU kernels),
dense (every row against its own expert's gathered weights: the reference), and the CPU engines
blocked and gathered (rows in blocks of one expert each). The grouped CPU engine is grouped.py."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from absl import logging
from jax.ad_checkpoint import checkpoint_name

from moetrain.core.engine import EngineConfig, LoraConfig
from moetrain.kernels import Kernel, megablox, quant
from moetrain.kernels.lora import with_lora
from moetrain.kernels.rows import take_experts

# Names for the remat policies (model/transformer.py remat_policy): what the experts' backward
# reads. Saving them spares the backward the forward's routing, exchange and expert matmuls.
EXPERT_INPUT, EXPERT_GATE, EXPERT_UP = 'moe_expert_in', 'moe_expert_gate', 'moe_expert_up'
# The grouped engine's output rows: its forward is one loop over every projection, so without
# them a saving policy still reran it for the gate gradients (combine reads the outputs).
EXPERT_OUTPUT = 'moe_expert_out'


SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid slope in its clamped SwiGLU


class ExpertSpec(NamedTuple):
  """What the expert kernels need of a model: its engine and adapters, and the routed experts'
  count, hidden width, SwiGLU clamp (gpt-oss; 0 = none) and whether they carry biases."""

  engine: EngineConfig
  lora: LoraConfig
  num_experts: int
  hidden: int
  swiglu_limit: float = 0.0
  bias: bool = False


def activation(gate, up, spec: ExpertSpec):
  """float32 silu(gate) * up, or gpt-oss's clamped form (spec.swiglu_limit > 0)."""
  g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
  if not spec.swiglu_limit:
    return jax.nn.silu(g) * u
  g = jnp.minimum(g, spec.swiglu_limit)
  u = jnp.clip(u, -spec.swiglu_limit, spec.swiglu_limit)
  return g * jax.nn.sigmoid(SWIGLU_ALPHA * g) * (u + 1)


def biased(mm, x, name: str, spec: ExpertSpec):
  """mm(x, name) plus, with spec.bias, each row's expert's bias: the bias [E, 1, out] is
  one more expert weight, multiplied by a column of ones, so every backend's grouped matmul
  picks each row's own expert's bias as it picks its weight."""
  y = mm(x, name)
  if spec.bias:
    y = y + mm(jnp.ones_like(x[..., :1]), f'{name}_bias')
  return y


def swiglu(x, mm, spec: ExpertSpec):
  dt = jnp.dtype(spec.engine.dtype)
  x = checkpoint_name(x, EXPERT_INPUT)  # rows in expert order, after any exchange
  g = checkpoint_name(biased(mm, x, 'gate', spec), EXPERT_GATE)
  u = checkpoint_name(biased(mm, x, 'up', spec), EXPERT_UP)
  return biased(mm, activation(g, u, spec).astype(dt), 'down', spec)


def ragged_ffn(x_RD, sizes_E, weights, spec: ExpertSpec, rng):
  """XLA's ragged_dot for the expert weights. On TPU the LoRA adapters' thin products take the
  megablox kernel: XLA lowers the gradient of a ragged_dot's weights as a dense product over
  every local expert (kernels/megablox.py)."""
  dt = jnp.dtype(spec.engine.dtype)

  def mm(x, w):
    return jax.lax.ragged_dot(x, quant.dequant(w, dt), sizes_E, preferred_element_type=dt)

  # (The kernel must run inside a shard_map: under expert parallelism, or on one device. With the
  # experts partitioned by XLA instead, the adapters take ragged_dot too.)
  in_shards = spec.engine.expert_shards > 1 or math.prod(spec.engine.mesh_shape) <= 1
  if spec.engine.platform == 'tpu' and in_shards:
    adapter_mm = _megablox_mm(sizes_E, spec, adapters=True)
  else:
    ref = spec.engine.reference_kernels
    adapter_mm = lambda x, w: ragged_adapter(x, w, sizes_E, dt, reference=ref)  # noqa: E731
  return swiglu(x_RD, with_lora(mm, weights, spec, rng, adapter_mm), spec)


def _ragged_adapter_reference(x_RI, w_EIO, sizes_E, dt):
  return jax.lax.ragged_dot(x_RI, w_EIO.astype(dt), sizes_E, preferred_element_type=dt)


_ragged_adapter = jax.custom_vjp(_ragged_adapter_reference, nondiff_argnums=(3,))


def _ragged_adapter_fwd(x_RI, w_EIO, sizes_E, dt):
  return _ragged_adapter_reference(x_RI, w_EIO, sizes_E, dt), (x_RI, w_EIO, sizes_E)


def _ragged_adapter_bwd(dt, res, g_RO):
  x_RI, w_EIO, sizes_E = res
  g_RO = g_RO.astype(dt)
  w_EOI = jnp.swapaxes(w_EIO, 1, 2).astype(dt)
  dx = jax.lax.ragged_dot(g_RO, w_EOI, sizes_E, preferred_element_type=dt).astype(x_RI.dtype)
  # Per expert over its own rows, x^T g: the rows are the ragged (contracting) dimension.
  dims = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
  )
  dw = jax.lax.ragged_dot_general(
    x_RI.astype(dt), g_RO, sizes_E, dims, preferred_element_type=w_EIO.dtype
  )
  return dx, dw, None


_ragged_adapter.defvjp(_ragged_adapter_fwd, _ragged_adapter_bwd)

# Each expert's rows x [R, I] times its LoRA factor w [E, I, O] as stored (float32 by default),
# cast to dt for the product. The fast path's gradient of w is summed over the expert's rows in
# w's own dtype; autodiff of the cast product (the reference) returns it in dt, bfloat16's
# rounding before the cast back and before a mesh's sum over its devices.
ragged_adapter = Kernel('ragged_adapter', _ragged_adapter, _ragged_adapter_reference)


def tokamax_ffn(x_RD, sizes_E, weights, spec: ExpertSpec, rng):
  """tokamax's grouped matmul for every product, the adapters' too, forward and backward: on a
  GPU its Mosaic GPU kernel (sm90/sm100) or its Triton kernel (sm80+), per product
  (tokamax_mm), whose work follows the group sizes where XLA:GPU's ragged_dot is a dense product
  over every expert (bench/RESULTS.md, "GPU: one H100"). Off a GPU it runs tokamax's XLA form
  (the tests)."""
  dt = jnp.dtype(spec.engine.dtype)

  def mm(x, w):
    return tokamax_mm(x, quant.dequant(w, dt), sizes_E, dt, spec)

  return swiglu(x_RD, with_lora(mm, weights, spec, rng), spec)


# What tokamax_mm chose, by product shape ('x [R, K] @ w [E, K, N] bfloat16' -> implementation,
# or 'xla (why)'): the benchmarks record it beside their timings.
TOKAMAX_CHOICES: dict[str, str] = {}


def tokamax_mm(x, w, sizes_E, dt, spec: ExpertSpec):
  """One grouped product through tokamax. Off a GPU: its XLA form. On a GPU with
  spec.tokamax_implementation='auto': Mosaic GPU, then Triton, whichever first takes this device,
  shape and dtype (tokamax raises NotImplementedError at trace time for what a kernel cannot
  do), and its XLA form (dense on XLA:GPU) last, with a warning naming the product and why."""
  import tokamax  # the gpu extra; imported here: importing it probes for TPUs

  if spec.engine.platform != 'gpu':
    return tokamax.ragged_dot(x, w, sizes_E, preferred_element_type=dt, implementation='xla')
  # Mosaic GPU's bulk copies need the row count a multiple of its tile (on an H200, 12000 routed
  # rows failed to lower): zero rows past every group change no output row and no gradient.
  rows = x.shape[0]
  x = jnp.pad(x, ((0, -rows % GPU_ROW_TILE), (0, 0)))
  # The kernels leave what no group covers unwritten: the output and input-gradient rows past the
  # groups (the zero experts' and the padding's) and the weight gradient of an expert with no
  # rows. An H200's bfloat16 engine check read NaN gradients there; zero them.
  covered = (jnp.arange(x.shape[0]) < jnp.sum(sizes_E))[:, None]
  ref = spec.engine.reference_kernels
  x = zero_grad_where_not(x, covered, reference=ref)
  w = zero_grad_where_not(w, (sizes_E > 0)[:, None, None], reference=ref)
  y = _tokamax_gpu_mm(x, w, sizes_E, dt, spec)
  return jnp.where(covered, y, 0)[:rows]


GPU_ROW_TILE = 256


@jax.custom_vjp
def _zero_grad_fast(v, keep):
  return v


def _zero_grad_fwd(v, keep):
  return v, keep


def _zero_grad_bwd(keep, g):
  return jnp.where(keep, g, jnp.zeros((), g.dtype)), None


_zero_grad_fast.defvjp(_zero_grad_fwd, _zero_grad_bwd)

# v, its cotangent zeroed where `keep` (broadcast to v) is False, whatever it held: the fast path
# costs nothing forward; the reference selects v against its stop_gradient (a pass over v).
zero_grad_where_not = Kernel(
  'zero_grad_where_not',
  _zero_grad_fast,
  lambda v, keep: jnp.where(keep, v, jax.lax.stop_gradient(v)),
)


def _tokamax_gpu_mm(x, w, sizes_E, dt, spec: ExpertSpec):
  import tokamax

  key = f'x {list(x.shape)} @ w {list(w.shape)} {jnp.dtype(x.dtype).name}'
  if spec.engine.tokamax_implementation != 'auto':
    TOKAMAX_CHOICES[key] = spec.engine.tokamax_implementation
    return tokamax.ragged_dot(
      x, w, sizes_E, preferred_element_type=dt, implementation=spec.engine.tokamax_implementation
    )
  why = []
  for impl in ('mosaic', 'triton'):
    try:
      y = tokamax.ragged_dot(
        x, w, sizes_E, preferred_element_type=dt, implementation=[impl], bypass_device_check=False
      )
    # NotImplementedError: this device, shape or dtype is not the kernel's; ValueError: this
    # tokamax has no such kernel (Triton's needs the triton package).
    except (NotImplementedError, ValueError) as e:
      why.append(f'{impl}: {str(e).splitlines()[0] if str(e) else type(e).__name__}')
      continue
    TOKAMAX_CHOICES[key] = impl
    return y
  if key not in TOKAMAX_CHOICES:  # once per product, not per trace
    logging.warning(
      "tokamax has no GPU kernel for the expert product %s (%s): it runs tokamax's XLA form, "
      'which XLA:GPU computes densely over every expert.',
      key,
      '; '.join(why),
    )
  TOKAMAX_CHOICES[key] = f'xla ({"; ".join(why)})'
  return tokamax.ragged_dot(x, w, sizes_E, preferred_element_type=dt, implementation='xla')


def megablox_interpret(spec: ExpertSpec) -> bool:
  """The megablox kernel is Mosaic (TPU) code; elsewhere Pallas interprets it."""
  return spec.engine.platform != 'tpu'


def _megablox_mm(sizes_E, spec: ExpertSpec, adapters: bool = False):
  """mm(x, w): each expert's rows times its w [D_in, D_out]. A LoRA A factor ([E, D, rank]:
  its rank is the last, narrow dimension) runs transposed, so that its copies and gradients keep
  the rank off the TPU's 128 lanes (kernels/megablox.py). adapters: the LoRA factors, passed as
  stored (float32 by default): the kernel casts them and returns their gradients in their own
  dtype."""
  dt = jnp.dtype(spec.engine.dtype)
  interpret, ref = megablox_interpret(spec), spec.engine.reference_kernels

  def mm(x, w):
    x, w = x.astype(dt), (w if adapters else quant.dequant(w, dt))
    thin = w.shape[2] < 128 and w.shape[1] >= 128
    w = jnp.swapaxes(w, 1, 2) if thin else w
    return megablox.grouped_matmul(x, w, sizes_E, thin, interpret, reference=ref)

  return mm


def megablox_ffn(x_RD, sizes_E, weights, spec: ExpertSpec, rng):
  """The Pallas TPU grouped matmul (kernels/megablox.py) for every product, the adapters'
  included. Off TPU the kernel runs in Pallas' interpret mode: slow, but it checks this path on
  CPU. Rows are padded once to a multiple of the row tile (the kernel masks rows past the
  groups: zero-expert assignments, padding)."""
  r = x_RD.shape[0]
  x_PD = jnp.pad(x_RD, ((0, -r % megablox.row_tile(r)), (0, 0)))
  mm, adapter_mm = _megablox_mm(sizes_E, spec), _megablox_mm(sizes_E, spec, adapters=True)
  return swiglu(x_PD, with_lora(mm, weights, spec, rng, adapter_mm), spec)[:r]


def dense_ffn(x_RD, expert_R, weights, spec: ExpertSpec, rng):
  """Reference backend: every row multiplies its own expert's gathered weights."""
  dt = jnp.dtype(spec.engine.dtype)
  e_R = jnp.minimum(expert_R, spec.num_experts - 1)

  def mm(x, w):
    return jnp.einsum('rd,rdf->rf', x, quant.dequant(quant.take(w, e_R), dt))

  return swiglu(x_RD, with_lora(mm, weights, spec, rng), spec)


def blocked_ffn(x_UPD, block_expert_U, used, weights, spec: ExpertSpec, rng):
  """A scan over blocks; blocks past `used` (the padding left by zero-expert assignments) are
  skipped by a cond, so their matmuls never run."""
  n, b, d = x_UPD.shape
  dt = jnp.dtype(spec.engine.dtype)

  def ffn(x_PD, ex, k):
    w = {name: quant.take(v, ex) for name, v in weights.items()}
    key = None if rng is None else jax.random.fold_in(rng, k)
    mm = with_lora(lambda x, wt: x @ quant.dequant(wt, dt), w, spec, key)
    return swiglu(x_PD, mm, spec).astype(dt)

  def body(_, inp):
    x_PD, ex, k = inp
    skip = lambda x, ex, k: jnp.zeros((b, d), dt)
    return None, jax.lax.cond(k < used, ffn, skip, x_PD, ex, k)

  _, y_UPD = jax.lax.scan(body, None, (x_UPD, block_expert_U, jnp.arange(n)))
  return y_UPD.reshape(n * b, d)


def gathered_ffn(x_UPD, block_expert_U, weights, spec: ExpertSpec, rng):
  n, b, d = x_UPD.shape
  dt = jnp.dtype(spec.engine.dtype)
  w_U = {
    name: quant.take(v, block_expert_U)
    if isinstance(v, quant.QTensor)
    else take_experts(v, block_expert_U, reference=spec.engine.reference_kernels)
    for name, v in weights.items()
  }

  def mm(x, w):
    return jnp.einsum('UPD,UDF->UPF', x, quant.dequant(w, dt))

  mm = with_lora(mm, w_U, spec, rng)
  return swiglu(x_UPD, mm, spec).reshape(n * b, d)
