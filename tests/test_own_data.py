"""Training on one's own text: a tokenizer made for other text is named with its fix."""

import ast
import json
import os
import re

from configs import longcat_lora
from moetrain.data import loader
from moetrain.data.tokenizer import get_or_train_tokenizer, load_tokenizer
from moetrain.run import startup
from tests.helpers import ROOT

SENTENCES = (
  'Warsaw is the capital and largest city of Poland, on the Vistula river.',
  'The museum opens at nine in the morning and closes early on Sundays.',
  'Could you tell me how to get from the station to the old town square?',
  'Photosynthesis turns sunlight, water and carbon dioxide into sugar.',
)


def _chats(path, n=40):
  with open(path, 'w') as f:
    for i in range(n):
      q, a = SENTENCES[i % 4], SENTENCES[(i + 1) % 4]
      msgs = [{'role': 'user', 'content': q}, {'role': 'assistant', 'content': a}]
      f.write(json.dumps({'messages': msgs}) + '\n')


def test_the_demo_tokenizer_on_real_text_is_named_with_the_fix(tmp_path, caplog):
  """The demo base's 474-piece tokenizer spells English out a few letters at a time: the run
  warns with the fix; a tokenizer trained on the same text stays below the bound, silently."""
  _chats(tmp_path / 'train.jsonl')
  demo = os.path.join(ROOT, 'moetrain', 'data', 'demo', 'base', 'tokenizer.model')
  cfg = loader.DataConfig(source='jsonl', path=str(tmp_path / '{split}.jsonl'), tokenizer=demo)
  ratio = loader.warn_if_tokenizer_is_foreign(cfg, load_tokenizer(demo))
  assert ratio > loader.MAX_TOKENS_PER_WORD
  assert f'data.tokenizer={demo!r} encodes the training text' in caplog.text
  assert 'base checkpoint made for such text' in caplog.text
  caplog.clear()
  texts = lambda: iter([s for s in SENTENCES for _ in range(50)])
  own = get_or_train_tokenizer('', str(tmp_path / 'run'), texts, 1000)
  own_cfg = loader.DataConfig(source='jsonl', path=cfg.path)
  assert loader.warn_if_tokenizer_is_foreign(own_cfg, own) < 2
  assert 'encodes the training text' not in caplog.text


def test_the_fix_the_warning_names_makes_the_default_config_train_its_tokenizer(tmp_path, caplog):
  """The default config starts from the demo base, whose tokenizer a run takes when
  data.tokenizer is empty: the warning's fix must leave the base out too."""
  _chats(tmp_path / 'train.jsonl')
  config = longcat_lora.get_config()
  config.data.source, config.data.path = 'jsonl', str(tmp_path / '{split}.jsonl')
  config.data.eval_split = ''
  setup = startup.build(config)
  tokenizer = loader.make_tokenizer(setup.data, str(tmp_path / 'run'))
  assert loader.warn_if_tokenizer_is_foreign(setup.data, tokenizer, setup.hf_checkpoint) > 2
  assert f"init.hf_checkpoint={setup.hf_checkpoint!r}'s tokenizer encodes" in caplog.text
  flags = re.findall(r"--config\.([\w.]+)=('[^']*'|\S+)", caplog.text)
  assert flags and 'a fresh --workdir' in caplog.text
  for key, value in flags:
    section, field = key.split('.')
    config[section][field] = ast.literal_eval(value)
  fixed = startup.build(config)
  assert fixed.data.tokenizer == '' and fixed.hf_checkpoint == ''  # trained on the data
  own = loader.make_tokenizer(fixed.data, str(tmp_path / 'fresh'))
  assert os.path.exists(tmp_path / 'fresh' / 'tokenizer.model')
  assert loader.warn_if_tokenizer_is_foreign(fixed.data, own, fixed.hf_checkpoint) < 2
