"""Exports a run to Hugging Face: the merged model, or the adapters alone (PEFT layout).

  python -m moetrain.tools.export --config=configs/longcat_lora.py --workdir=runs/longcat_lora \
      --out=exported/ [--adapter_only] [--dtype=bfloat16]
"""

import jax
from absl import app, flags
from ml_collections import config_flags

from moetrain import runtime, sharding, train
from moetrain.convert import hf_longcat
from moetrain.train_state import graphdef_of, merge_model


def define_flags():
  config_flags.DEFINE_config_file('config', None, 'Experiment config file of the run.')
  flags.DEFINE_string('workdir', None, 'Run directory (its latest checkpoint is exported).')
  flags.DEFINE_string('out', None, 'Output directory.')
  flags.DEFINE_bool('adapter_only', False, 'Write adapter_model.safetensors + adapter_config.json.')
  flags.DEFINE_string('dtype', None, 'Weight dtype of the merged export (default param_dtype).')
  runtime.define_process_flags()


def export(config, workdir: str, out: str, adapter_only: bool = False, dtype=None) -> str:
  setup = train.build(config)
  mesh = sharding.make_mesh(setup.mesh_shape)
  with jax.set_mesh(mesh):
    state = train.load_latest(setup, workdir, mesh)
    model = merge_model(graphdef_of(setup.model), state.params, state.moe_bias, state.frozen)
    if adapter_only:
      if not setup.model.lora.enabled:
        raise ValueError('--adapter_only needs a LoRA run (lora.rank > 0)')
      hf_longcat.save_peft_adapter(model, setup.model, out)
    else:
      base = hf_longcat.read_config(setup.hf_checkpoint) if setup.hf_checkpoint else None
      hf_longcat.save_hf(model, setup.model, out, dtype=dtype, base_config=base)
  return out


def main(argv):
  runtime.start_command(preemption=False)  # saves nothing: stay killable
  del argv
  f = flags.FLAGS
  out = export(f.config, f.workdir, f.out, f.adapter_only, f.dtype)
  if runtime.is_primary():
    print(f'wrote {out}')


if __name__ == '__main__':
  define_flags()
  flags.mark_flags_as_required(['config', 'workdir', 'out'])
  app.run(main)
