"""Small shared builders for tests."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moetrain.core.engine import LORA_TARGETS, LoraConfig, split_engine_keys
from moetrain.model.config import ModelConfig
from moetrain.model.transformer import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_command(module: str, *args: str, **env: str) -> subprocess.CompletedProcess:
  """`python -m module args` from the repository root, as a user runs it (no huge-page
  re-execution); `env` adds environment variables."""
  return subprocess.run(
    [sys.executable, '-m', module, *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, 'MOETRAIN_NO_REEXEC': '1', 'PYTHONPATH': ROOT, **env},
  )


TINY = ModelConfig(
  vocab_size=64,
  hidden_size=32,
  num_layers=2,
  num_heads=2,
  q_lora_rank=16,
  kv_lora_rank=16,
  qk_nope_head_dim=8,
  qk_rope_head_dim=8,
  v_head_dim=8,
  ffn_hidden_size=48,
  expert_ffn_hidden_size=16,
  n_routed_experts=8,
  zero_expert_num=4,
  moe_topk=3,
).with_engine(dtype='float32', remat='none', init_std=0.2)
ALL_TARGETS = LORA_TARGETS  # every projection of every family


def configured(cfg: ModelConfig, **kw) -> ModelConfig:
  """cfg with model keys and engine keys changed, each in its own config."""
  model, engine = split_engine_keys(kw)
  return dataclasses.replace(cfg, **model).with_engine(**engine)


def tiny(**kw) -> ModelConfig:
  return configured(TINY, **kw)


def tpu_proxy(layers: int) -> dict:
  """Config overrides for TPU compiles of a small LongCat on one v5e chip: the tiny variant with
  32 experts of 512 x 512 over a 512-wide model, bfloat16 weights, one row of 1024 tokens."""
  return {
    'model.hidden_size': 512,
    'model.expert_ffn_hidden_size': 512,
    'model.n_routed_experts': 32,
    'model.zero_expert_num': 0,
    'model.moe_topk': 4,
    'model.num_layers': layers,
    'engine.param_dtype': 'bfloat16',
    'data.seq_len': 1024,
    'data.global_batch_size': 1,
    'data.eval_batch_size': 1,
    'mesh.shape': (1, 1, 1, 1),
  }


def with_lora(cfg: ModelConfig, rank=4, targets=ALL_TARGETS, **kw) -> ModelConfig:
  return dataclasses.replace(cfg, lora=LoraConfig(rank=rank, targets=targets, **kw))


def randomize(model: nnx.Module, seed: int, filt=nnx.Param, scale=0.2) -> None:
  """Non-trivial values for variables that start at constants (norm scales, LoRA B, biases)."""
  state = nnx.state(model, filt)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  new = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  nnx.update(model, jax.tree.unflatten(tree, new))


def model_and_ids(cfg: ModelConfig, seed=0, b=2, t=10):
  model = Transformer(cfg, nnx.Rngs(seed))
  ids = jax.random.randint(jax.random.key(seed + 100), (b, t), 0, cfg.vocab_size)
  return model, ids


def nonzero_bias(model, seed=1, scale=0.05):
  from moetrain.model.moe import RouterBias

  randomize(model, seed, RouterBias, scale)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _apply(fn, graphdef, state, *args):
  return fn(nnx.merge(graphdef, state), *args)


def jit_call(fn, module, *args):
  """fn(module, *args) under jit (eager NNX runs op by op and dominates test time)."""
  graphdef, state = nnx.split(module)
  return _apply(fn, graphdef, state, *args)


def _call(m, *args):
  return m(*args)


def forward(model, *args):
  return jit_call(_call, model, *args)


def expert_weights(key, e: int, d: int, f: int, rank: int = 2, scale: float = 0.3) -> dict:
  """Random routed-expert weights as the MoE engine takes them: 'gate', 'up' [E, D, F], 'down'
  [E, F, D] and each one's per-expert LoRA factors '<name>_lora_a' [E, in, rank] and
  '<name>_lora_b' [E, rank, out]."""
  shapes = dict(gate=(e, d, f), up=(e, d, f), down=(e, f, d))
  keys = iter(jax.random.split(key, 9))
  w = {name: scale * jax.random.normal(next(keys), s) for name, s in shapes.items()}
  for name, (_, i, o) in shapes.items():
    w[f'{name}_lora_a'] = scale * jax.random.normal(next(keys), (e, i, rank))
    w[f'{name}_lora_b'] = scale * jax.random.normal(next(keys), (e, rank, o))
  return w


def perturb_lora(model, seed: int, scale: float = 0.01) -> None:
  """Non-zero adapters (B starts at 0), drawn with numpy so no per-shape kernel is compiled."""
  rng = np.random.default_rng(seed)
  noise = lambda x: jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape), x.dtype)
  nnx.update(model, jax.tree.map(noise, nnx.state(model, nnx.LoRAParam)))


def perturb_router(model, seed: int, scale: float = 0.05) -> None:
  """As training moves them: the expert-bias update the biases, lora.train_router the router."""
  rng = np.random.default_rng(seed)
  noise = lambda x: jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape), x.dtype)
  router = nnx.Any(nnx.PathContains('router'), nnx.PathContains('router_bias'))
  nnx.update(model, jax.tree.map(noise, nnx.state(model, router)))


def hf_loss(logits_BTV, ids_BT):
  """transformers' causal-LM loss: mean cross entropy over the B*(T-1) shifted tokens."""
  logp = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, ids_BT[:, 1:, None], axis=-1))


def hf_loss_f64(logits_BTV, ids_BT) -> float:
  x = np.asarray(logits_BTV, np.float64)[:, :-1]
  logp = x - x.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  return float(-np.take_along_axis(logp, np.asarray(ids_BT)[:, 1:, None], -1).mean())


def assert_same_topk(topk_LMA, want_LMA):
  got = np.sort(np.asarray(topk_LMA), axis=-1)  # the fixtures sort each token's set
  for layer in range(want_LMA.shape[0]):
    np.testing.assert_array_equal(got[layer], want_LMA[layer], err_msg=f'layer {layer} top-k')


def max_err(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def assert_matches_hf(model, cfg, ref: dict, name: str) -> None:
  """Logits, loss, routing choices and every gradient of `model` against a transformers
  fixture's reference.npz (needs the with_topk fixture)."""
  from moetrain.convert import hf

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ids = jnp.asarray(ref['input_ids'])

  def loss_fn(p):
    logits, aux = nnx.merge(graphdef, p, rest)(ids)
    return hf_loss(logits, ids), (logits, aux['moe']['topk_idx'])

  (loss, (logits, topk)), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  # The float32 loss (the one differentiated) carries 1-2 ulp (4.8e-7 each) of summation-order
  # noise, as HF's own does; recomputed in float64 from our logits it measures the model alone.
  err = {
    'logits': max_err(logits, ref['logits']),
    'loss': max_err(loss, ref['loss']),
    'loss64': max_err(hf_loss_f64(logits, ref['input_ids']), ref['loss']),
  }
  assert err['logits'] < 1e-5 and err['loss64'] < 1e-6 and err['loss'] < 2e-6, err
  assert_same_topk(topk, ref['router/topk_idx'])
  # Gradient error relative to the largest |grad| of each HF tensor.
  got = dict(hf.hf_tensors(grads, cfg))
  want = {k.removeprefix('grad/'): v for k, v in ref.items() if k.startswith('grad/')}
  assert set(got) == set(want)
  rel = {k: max_err(got[k], want[k]) / max(np.abs(want[k]).max(), 1e-30) for k in want}
  worst = max(rel, key=rel.get)
  print(
    f'{name}: logits {err["logits"]:.2e} loss {err["loss"]:.2e} (f64 {err["loss64"]:.2e}) '
    f'grad rel {rel[worst]:.2e} ({worst})'
  )
  assert rel[worst] < 1e-4, (worst, rel[worst])


def sharded_forward(path: str, make_config, ids):
  """Logits of the HF checkpoint at `path` loaded onto a (1, 2, 2, 2) mesh (routed experts
  placed over 'expert' by the rules, checked) for ids doubled to 4 rows; make_config(**kw): the
  test's ModelConfig with kw."""
  from moetrain.convert import hf
  from moetrain.core import sharding
  from moetrain.training import train_state

  mesh = sharding.make_mesh((1, 2, 2, 2))
  cfg = make_config(rules=sharding.Rules.preset('fsdp_ep_tp')).laid_out('cpu', mesh)
  loaded = hf.load_params(path, cfg, mesh=mesh)
  spec = loaded.params['layers']['moe']['experts']['gate'].get_value().sharding.spec
  assert spec[1] == 'expert', spec  # placed by the rules, not replicated
  graphdef = train_state.graphdef_of(cfg)
  with jax.set_mesh(mesh):
    ids = jax.device_put(np.concatenate([ids] * 2), sharding.batch_sharding(mesh))
    fwd = jax.jit(lambda p, b, f, x: train_state.merge_model(graphdef, p, b, f)(x)[0])
    return fwd(loaded.params, loaded.moe_bias, loaded.frozen, ids)


def write_checkpoint(directory, config: dict, tensors: dict) -> str:
  """A Hugging Face checkpoint directory: config.json and one model.safetensors of `tensors`
  (any dtype safetensors_io writes: float8 and int tensors of quantised releases too)."""
  from moetrain.convert import safetensors_io as stio

  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(config, f)
  items = sorted(tensors.items())
  specs = [(n, x.shape, x.dtype) for n, x in items]
  stio.write_file(os.path.join(directory, stio.SINGLE), specs, lambda i: items[i][1])
  return str(directory)


def rewrite(src: str, dst, drop=(), config=None, change=None) -> str:
  """A copy of checkpoint `src` in `dst`: its tensors as stored but those in `drop`, `change`
  ({name: array}) replacing or adding tensors, and `config` (default: src's config.json)."""
  from moetrain.convert import hf
  from moetrain.convert import safetensors_io as stio

  reader = stio.Reader(src)
  tensors = {k: reader.read_stored(k) for k in reader.keys() if k not in drop}
  return write_checkpoint(dst, config or hf.read_config(src), {**tensors, **(change or {})})
