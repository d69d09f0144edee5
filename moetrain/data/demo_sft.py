"""The preference demo's starting model: the LoRA demo's result (configs/longcat_lora.py, the
shipped base with its adapters trained to reverse word lists), merged into one Hugging Face
checkpoint. Made on first use (about 4 minutes on 2 CPU cores) and cached:

  python -m moetrain.data.demo_sft          # makes it now (no-op when cached)

in $MOETRAIN_CACHE/demo_sft (default ~/.cache/moetrain/demo_sft): `run/`, the LoRA run, and
`model/`, its merged export (float32), which configs/dpo.py starts from.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from moetrain.data import demo_base

REPO = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
  root = os.environ.get('MOETRAIN_CACHE') or Path.home() / '.cache' / 'moetrain'
  return Path(root) / 'demo_sft'


def model_dir() -> Path:
  return cache_dir() / 'model'


def _run(*args: str) -> None:
  env = {
    **os.environ,
    'PYTHONPATH': os.pathsep.join(filter(None, [str(REPO), os.environ.get('PYTHONPATH')])),
  }
  subprocess.run([sys.executable, '-m', *args], check=True, env=env, cwd=REPO)


def ensure() -> Path:
  """The merged LoRA demo result's directory, made first if the cache lacks it. The LoRA run
  resumes where an interrupted first use left it; the export is renamed into place whole."""
  out = model_dir()
  if (out / 'config.json').is_file():
    return out
  print(f"Making the preference demo's start, the LoRA demo's result, in {cache_dir()} (once)")
  run = cache_dir() / 'run'
  run.parent.mkdir(parents=True, exist_ok=True)
  _run(
    'moetrain.main',
    '--config=configs/longcat_lora.py',
    f'--workdir={run}',
    f'--config.init.hf_checkpoint={demo_base.DIR}',
  )
  with tempfile.TemporaryDirectory(dir=cache_dir(), prefix='export') as tmp:
    part = Path(tmp) / 'model'
    _run('moetrain.tools.export', f'--workdir={run}', f'--out={part}', '--dtype=float32')
    if out.exists():  # (an export of another process got there first)
      return out
    shutil.move(str(part), str(out))
  return out


if __name__ == '__main__':
  print(ensure())
