"""Training on one's own text: a tokenizer made for other text is named with its fix."""

import json
import os

from moetrain.data import loader
from moetrain.data.tokenizer import get_or_train_tokenizer, load_tokenizer
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
  assert "base checkpoint's own tokenizer" in caplog.text
  caplog.clear()
  texts = lambda: iter([s for s in SENTENCES for _ in range(50)])
  own = get_or_train_tokenizer('', str(tmp_path / 'run'), texts, 1000)
  own_cfg = loader.DataConfig(source='jsonl', path=cfg.path)
  assert loader.warn_if_tokenizer_is_foreign(own_cfg, own) < 2
  assert 'encodes the training text' not in caplog.text
