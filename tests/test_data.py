"""Tests for moetrain.data: demo task, tokenizers, sources, packing and the grain pipeline."""

import dataclasses
import json
import os
import pickle

import numpy as np
import pytest

from moetrain.data import chat as chat_lib
from moetrain.data import demo_task, loader, packing, sources
from moetrain.data import tokenizer as tokenizer_lib


class CharTokenizer:
  """One id per character (ord), so expected packed rows can be written out by hand."""

  vocab_size, bos_id, eos_id, pad_id = 128, 1, 2, 0

  def encode(self, text):
    return [ord(c) for c in text]

  def decode(self, ids):
    return ''.join(chr(i) for i in ids if i > 2)


@pytest.fixture(scope='module')
def spm_tokenizer(tmp_path_factory):
  examples = demo_task.generate()['train']
  texts = [t for e in examples for t in sources.example_texts(e)]
  path = tmp_path_factory.mktemp('spm') / 'tokenizer.model'
  return tokenizer_lib.train_sentencepiece(texts, 512, path)


def write_jsonl(path, records):
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))
  return path


def numbered_records(n):
  return [{'prompt': f'item {i} =', 'completion': f'answer {i}'} for i in range(n)]


def segments(row, eos_id=2):
  """The token sequence of each packed example in a row. An example that does not end in eos
  (truncated, at the end of the row) has its last token only in `targets`."""
  out = []
  for s in range(1, row['segment_ids'].max() + 1):
    idx = np.flatnonzero(row['segment_ids'] == s)
    tokens = tuple(int(t) for t in row['inputs'][idx])
    out.append(tokens if tokens[-1] == eos_id else tokens + (int(row['targets'][idx[-1]]),))
  return out


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key], err_msg=key)


# Demo task.


def test_demo_files_regenerate_identically():
  generated = demo_task.generate()
  for split, count in demo_task.SPLITS.items():
    shipped = (demo_task.DEMO_DIR / f'{split}.jsonl').read_bytes()
    assert shipped == demo_task.to_jsonl(generated[split]).encode()
    assert len(generated[split]) == count
  assert sum(p.stat().st_size for p in demo_task.DEMO_DIR.iterdir()) < 500_000
  shuffle = demo_task.generate_shuffle()
  for split in ('train', 'eval'):
    shipped = (demo_task.SHUFFLE_DIR / f'{split}.jsonl').read_bytes()
    assert shipped == demo_task.to_jsonl(shuffle[split]).encode()
    assert len(shuffle[split]) == demo_task.SHUFFLE_SPLITS[split]


def test_shuffled_examples_are_orders_of_their_words_and_the_teacher_sees_other_lists():
  """The distillation demo's task: each completion is the prompt's words in some order (not
  always the prompt's own); the teacher's split shares no prompt with the student's; the
  entropy floor counts n! orders over n words and the end of text."""
  splits = demo_task.generate_shuffle()
  prompts = {k: {e['prompt'] for e in v} for k, v in splits.items()}
  assert not prompts['teacher'] & (prompts['train'] | prompts['eval'])
  assert not prompts['train'] & prompts['eval']
  same = 0
  for e in splits['train']:
    words = _words(e, 'shuffle: ')
    assert sorted(e['completion'].split()) == sorted(words)
    same += e['completion'].split() == words
  assert same < len(splits['train']) / 10
  three = {'prompt': 'shuffle: a b c =', 'completion': ' c a b'}
  assert demo_task.shuffle_entropy([three]) == pytest.approx(np.log(6) / 4)


def _words(example: dict, prefix: str) -> list[str]:
  return example['prompt'].removeprefix(prefix).removesuffix(' =').split()


def test_demo_examples_are_reversals_and_splits_disjoint():
  generated = demo_task.generate()
  prompts = {split: {e['prompt'] for e in examples} for split, examples in generated.items()}
  assert not prompts['train'] & prompts['eval']
  for e in generated['eval']:
    assert e['completion'].split() == _words(e, 'reverse: ')[::-1]


# Tokenizers.


def test_sentencepiece_train_load_roundtrip(spm_tokenizer, tmp_path):
  tok = spm_tokenizer
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert 300 < tok.vocab_size <= 512
  text = 'reverse: red  fox café ☃ =\nnew line'  # unseen characters go through byte fallback
  assert tok.decode(tok.encode(text)) == text
  assert tokenizer_lib.UNK_ID not in tok.encode(text)
  model = tmp_path / 'tokenizer.model'
  model.write_bytes(pickle.loads(pickle.dumps(tok)).__getstate__()['model_proto'])
  for path in (tmp_path, model):  # a directory or the file itself
    loaded = tokenizer_lib.load_tokenizer(path)
    assert loaded.encode(text) == tok.encode(text)
    assert isinstance(loaded, tokenizer_lib.Tokenizer)
  assert tokenizer_lib.load_tokenizer(model, bos='</s>', pad=5).bos_id == 2


def test_sentencepiece_training_is_deterministic(tmp_path):
  texts = ['reverse: red fox cup = cup fox red'] * 50 + ['the quick brown fox'] * 20
  a = tokenizer_lib.train_sentencepiece(texts, 300, tmp_path / 'a.model')
  tokenizer_lib.train_sentencepiece(texts, 300, tmp_path / 'b.model')
  assert (tmp_path / 'a.model').read_bytes() == (tmp_path / 'b.model').read_bytes()
  # No temporary files are left behind.
  assert sorted(p.name for p in tmp_path.iterdir()) == ['a.model', 'b.model']
  assert a.vocab_size <= 300


def test_sentencepiece_learns_from_long_lines(tmp_path):
  """Lines over SentencePiece's max_sentence_length (bytes; ~1,400 CJK characters at its
  default) used to be skipped silently: a corpus of long paragraphs alone failed to train."""
  words = ['红色', '狐狸', '杯子', '蓝色', '铃铛']
  texts = [''.join(words[(i * j) % 5] for j in range(3000)) for i in range(1, 8)]
  assert min(len(t.encode()) for t in texts) > 16_000
  tok = tokenizer_lib.train_sentencepiece(texts, 300, tmp_path / 'a.model')
  text = '狐狸杯子蓝色铃铛'
  assert len(tok.encode(text)) <= len(text.encode()) // 2  # learned pieces, not byte fallback


def test_get_or_train_tokenizer_caches_in_workdir(tmp_path):
  calls = []

  def texts():
    calls.append(1)
    return ['one two three four'] * 30

  first = tokenizer_lib.get_or_train_tokenizer('', tmp_path, texts, 300)
  second = tokenizer_lib.get_or_train_tokenizer('', tmp_path, texts, 300)
  assert len(calls) == 1 and (tmp_path / 'tokenizer.model').is_file()
  assert first.encode('two one') == second.encode('two one')
  given = tokenizer_lib.get_or_train_tokenizer(
    str(tmp_path / 'tokenizer.model'), '/nonexistent', texts, 300
  )
  assert given.vocab_size == first.vocab_size and len(calls) == 1


def make_hf_tokenizer_json(path):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE(unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=['<pad>', '<s>', '</s>', '<unk>'])
  tok.train_from_iterator(['reverse red fox cup blue bell'] * 20, trainer)
  tok.save(str(path))


def test_hf_tokenizer_json(tmp_path, spm_tokenizer):
  make_hf_tokenizer_json(tmp_path / 'tokenizer.json')
  tok = tokenizer_lib.load_tokenizer(tmp_path / 'tokenizer.json')
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)  # found by their usual names
  ids = tok.encode('red fox cup')
  assert tok.decode(ids) == 'red fox cup' and tok.bos_id not in ids
  assert pickle.loads(pickle.dumps(tok)).encode('red fox') == tok.encode('red fox')

  # tokenizer_config.json (as in a Hugging Face checkpoint) wins over the name guesses,
  # explicit overrides win over both.
  config = {'bos_token': {'content': '</s>'}, 'eos_token': '<unk>', 'pad_token': None}
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(config))
  tok = tokenizer_lib.load_tokenizer(tmp_path)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 3, 0)
  assert tokenizer_lib.load_tokenizer(tmp_path, bos='<s>', eos=2).bos_id == 1
  with pytest.raises(ValueError, match='not in the vocabulary'):
    tokenizer_lib.load_tokenizer(tmp_path, eos='<nope>')
  # null declares the token absent (Qwen has no bos): no guess. A named token the vocabulary
  # lacks is an error for bos/eos (every example would change), a guess for pad.
  config = {'bos_token': None, 'eos_token': '</s>', 'pad_token': '<nope>'}
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(config))
  tok = tokenizer_lib.load_tokenizer(tmp_path)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, 2, 0)
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '<|eot_id|>'}))
  with pytest.raises(ValueError, match=r"tokenizer_config\.json gives eos_token '<\|eot_id"):
    tokenizer_lib.load_tokenizer(tmp_path)
  assert tokenizer_lib.load_tokenizer(tmp_path, eos='</s>').eos_id == 2  # an override wins
  (tmp_path / 'tokenizer_config.json').write_text('{"eos_token": "</s>",}')
  with pytest.raises(ValueError, match=r'tokenizer_config\.json is not valid JSON: .*line 1'):
    tokenizer_lib.load_tokenizer(tmp_path)
  (tmp_path / 'tokenizer_config.json').unlink()

  # A checkpoint directory holding both: tokenizer.json is preferred.
  (tmp_path / 'tokenizer.model').write_bytes(spm_tokenizer.__getstate__()['model_proto'])
  assert isinstance(tokenizer_lib.load_tokenizer(tmp_path), tokenizer_lib.HFTokenizer)


def test_load_tokenizer_errors_name_the_path(tmp_path):
  with pytest.raises(FileNotFoundError, match=str(tmp_path)):
    tokenizer_lib.load_tokenizer(tmp_path)
  with pytest.raises(FileNotFoundError, match='missing.model'):
    tokenizer_lib.load_tokenizer(tmp_path / 'missing.model')
  (tmp_path / 'vocab.txt').write_text('a')
  with pytest.raises(ValueError, match='vocab.txt'):
    tokenizer_lib.load_tokenizer(tmp_path / 'vocab.txt')
  # Files of the right name but the wrong content (another JSON file, a Git LFS pointer).
  (tmp_path / 'vocab.json').write_text('{"a": 0, "b": 1}')
  with pytest.raises(ValueError, match=r'vocab\.json is not a readable Hugging Face tokenizer'):
    tokenizer_lib.load_tokenizer(tmp_path / 'vocab.json')
  (tmp_path / 'tokenizer.model').write_text('version https://git-lfs.github.com/spec/v1\n')
  with pytest.raises(ValueError, match=r'tokenizer\.model is not a readable SentencePiece'):
    tokenizer_lib.load_tokenizer(tmp_path / 'tokenizer.model')
  (tmp_path / 'tokenizer.model').write_bytes(b'')  # (SentencePiece would take it: no pieces)
  with pytest.raises(ValueError, match=r'tokenizer\.model is empty: not a SentencePiece model'):
    tokenizer_lib.load_tokenizer(tmp_path / 'tokenizer.model')


# Sources.


def test_jsonl_source_reads_all_record_kinds(tmp_path):
  chat = [
    {'role': 'system', 'content': 'Be brief.'},
    {'role': 'user', 'content': 'Hi'},
    {'role': 'assistant', 'content': 'Hello'},
  ]
  path = tmp_path / 'd.jsonl'
  path.write_text(
    json.dumps({'q': 'a', 'a': 'b'})
    + '\n\n'
    + json.dumps({'body': 'plain'})
    + '\n'
    + json.dumps({'chat': chat})
    + '\n'
  )
  src = sources.JsonlSource([str(path)], sources.Fields('body', 'q', 'a', 'chat'))
  assert len(src) == 3  # the blank line is skipped
  assert src[0] == {'prompt': 'a', 'completion': 'b'}
  assert src[1] == {'text': 'plain'}
  assert src[2] == {'messages': chat, 'where': f'{path}:4'}
  # Rendered with the built-in template (a trained tokenizer has no chat template of its own).
  text, spans = chat_lib.ChatFormat().apply(src[2])
  assert text == '<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello'
  assert [text[lo:hi] for lo, hi in spans] == ['Hello']


def test_chat_in_tfds_columns():
  """tfds.data_source returns a Sequence of {role, content} features as parallel columns."""
  columns = {
    'content': np.array([b'Be brief.', b'Hi', b'Hello'], object),
    'role': np.array([b'system', b'user', b'assistant'], object),
  }
  rows = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}]
  rows.append({'role': 'assistant', 'content': 'Hello'})
  assert sources.chat_example(columns, None, 'r') == sources.chat_example(rows, None, 'r')
  with pytest.raises(ValueError, match='r: messages have 3 roles but 2 contents'):
    sources.chat_example({**columns, 'content': columns['content'][:2]}, None, 'r')


@pytest.mark.parametrize(
  'line, message',
  [
    # The column within the line, not json's 'line 2 column 1' (the newline counted).
    ('{"prompt": "a", "completion": ', 'malformed JSON at column 31: Expecting value'),
    ('{"question": "a"}', 'record has none of the configured fields'),
    ('[1, 2]', 'expected a JSON object'),
    (
      '{"messages": [{"role": "user", "content": "hi"}]}',
      'the conversation has no assistant message to train on',
    ),
    ('{"text": 3}', "field 'text' should be a string"),
    ('{"text": "cut \\ud83d emoji"}', "field 'text' is not valid Unicode"),
  ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
  path = tmp_path / 'bad.jsonl'
  path.write_text('{"text": "ok"}\n\n' + line + '\n')
  with pytest.raises(ValueError, match=f'bad.jsonl:3: {message}'):
    sources.JsonlSource([str(path)])


def test_text_source_splits_paragraphs(tmp_path):
  (tmp_path / 'a.txt').write_text('first doc\nstill first\n\n\nsecond doc\n')
  (tmp_path / 'b.txt').write_text('third doc')
  src = sources.TextSource(sources.expand_paths(str(tmp_path / '*.txt'), 'train'))
  assert [src[i] for i in range(len(src))] == [
    {'text': 'first doc\nstill first'},
    {'text': 'second doc'},
    {'text': 'third doc'},
  ]
  # A byte-order mark goes; indentation inside a paragraph (code, verse) stays.
  (tmp_path / 'd.txt').write_bytes('\ufeffdef f():\n  return 1\n\n  indented\n'.encode())
  src = sources.TextSource([str(tmp_path / 'd.txt')])
  assert [src[0], src[1]] == [{'text': 'def f():\n  return 1'}, {'text': '  indented'}]
  (tmp_path / 'c.txt').write_bytes(b'ok\n\xff\n')
  with pytest.raises(ValueError, match='c.txt:2: not valid UTF-8'):
    sources.TextSource([str(tmp_path / 'c.txt')])
  with pytest.raises(FileNotFoundError, match='nothing-eval.txt'):
    sources.expand_paths(str(tmp_path / 'nothing-{split}.txt'), 'eval')


def test_cuts_fall_before_spaces_or_on_character_boundaries():
  words = ' '.join(f'w{i}' for i in range(400)).encode()
  parts = sources.text_parts(words, 64)
  assert b''.join(words[lo:hi] for lo, hi in parts) == words
  assert all(0 < hi - lo <= 64 for lo, hi in parts)
  assert all(words[lo : lo + 1] == b' ' for lo, _ in parts[1:])  # each cut is before a space
  # No spaces or line breaks (CJK): the cut is at a character boundary, never inside one.
  cjk = ('漢字かな' * 100).encode()
  parts = sources.text_parts(cjk, 64)
  assert ''.join(cjk[lo:hi].decode() for lo, hi in parts) == '漢字かな' * 100
  assert all(hi - lo <= 64 for lo, hi in parts)
  assert sources.text_parts(b'short', 64) == [(0, 5)]


def test_long_texts_are_read_as_parts(tmp_path):
  """A paragraph (or a JSONL text) over max_text_bytes becomes parts marked first / middle /
  last whose texts join back into it; other examples and chat records stay whole."""
  long = ' '.join(f'word{i}' for i in range(100))  # 589 bytes
  (tmp_path / 'a.txt').write_text(f'short one\n\n{long}\n\nlast one\n')
  src = sources.TextSource([str(tmp_path / 'a.txt')], max_text_bytes=100)
  got = [src[i] for i in range(len(src))]
  assert got[0] == {'text': 'short one'} and got[-1] == {'text': 'last one'}
  parts = got[1:-1]
  assert [p[sources.PART_KEY] for p in parts] == ['first'] + ['middle'] * (len(parts) - 2) + [
    'last'
  ]
  assert ''.join(p['text'] for p in parts) == long and len(parts) >= 6
  write_jsonl(
    tmp_path / 'a.jsonl',
    [{'text': long}, {'prompt': long, 'completion': 'x'}, {'text': 'tiny'}],
  )
  src = sources.JsonlSource([str(tmp_path / 'a.jsonl')], max_text_bytes=100)
  got = [src[i] for i in range(len(src))]
  assert ''.join(e['text'] for e in got[: len(parts)]) == long
  assert [e.get(sources.PART_KEY) for e in got[: len(parts)]] == [
    p[sources.PART_KEY] for p in parts
  ]
  assert got[len(parts) :] == [{'prompt': long, 'completion': 'x'}, {'text': 'tiny'}]


def test_parts_of_a_text_get_one_bos_and_one_eos():
  tok = CharTokenizer()
  parts = [
    {'text': t, sources.PART_KEY: k} for t, k in (('ab', 'first'), ('cd', 'middle'), ('ef', 'last'))
  ]
  tokens = [packing._tokens(p, tok, False)[0] for p in parts]
  assert tokens == [[1, 97, 98], [99, 100], [101, 102, 2]]
  # Cut rather than split (data.split_long_texts=False): only the first part gives tokens.
  cut = [len(packing.tokenize(p, tok, max_len=8)['tokens']) for p in parts]
  assert cut == [3, 0, 0]


def test_a_training_file_changed_after_indexing_is_named(tmp_path):
  """Rewritten mid-run, a file would be read at stale offsets and its errors would name wrong
  lines: the read says the file changed instead."""
  path = write_jsonl(tmp_path / 'train.jsonl', numbered_records(3))
  src = sources.JsonlSource([str(path)])
  assert src[1] == numbered_records(3)[1]
  write_jsonl(path, [{'text': 'other'}] + numbered_records(3))
  with pytest.raises(ValueError, match=r'train.jsonl changed after the run indexed it'):
    src[1]


def test_paths_recurse_and_splits_do_not_share_files(tmp_path):
  """'**' reaches every depth; a pattern that gives the eval split training files is refused."""
  for sub in ('train', 'train/sub', 'train/sub/deep', 'eval'):
    (tmp_path / sub).mkdir(parents=True, exist_ok=True)
    (tmp_path / sub / 'a.txt').write_text('doc')
  found = sources.expand_paths(str(tmp_path / '{split}' / '**' / '*.txt'), 'train')
  assert [os.path.relpath(p, tmp_path) for p in found] == [
    'train/a.txt',
    'train/sub/a.txt',
    'train/sub/deep/a.txt',
  ]
  (tmp_path / 'train_small.jsonl').write_text('{"text": "x"}\n')
  (tmp_path / 'train.jsonl').write_text('{"text": "x"}\n')
  cfg = loader.DataConfig(
    source='jsonl', path=str(tmp_path / '{split}*.jsonl'), eval_split='train_small'
  )
  loader.validate(cfg)  # a tool may read such a run's settings
  with pytest.raises(ValueError, match=r'(?s)the same files.*train_small\.jsonl.*trained on'):
    loader.check_training_data(cfg)


@pytest.fixture(scope='module')
def tfds_dir(tmp_path_factory):
  """A tiny TFDS dataset prepared as array_record, written without TensorFlow or network."""
  tfds = pytest.importorskip('tensorflow_datasets')

  class MoetrainTinyText(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version('1.0.0')
    # tfds would look for a checksums file next to this module via importlib_resources, which is
    # not installed; a builder with no download needs no checksums.
    code_path = None

    def _info(self):
      return tfds.core.DatasetInfo(
        builder=self, features=tfds.features.FeaturesDict({'body': tfds.features.Text()})
      )

    def _split_generators(self, dl_manager):
      return {'train': self._generate_examples(12), 'validation': self._generate_examples(5)}

    def _generate_examples(self, n):
      for i in range(n):
        yield i, {'body': f'document {i} ☃'}

  data_dir = tmp_path_factory.mktemp('tfds')
  MoetrainTinyText(data_dir=str(data_dir), file_format='array_record').download_and_prepare()
  return str(data_dir)


def test_tfds_source_and_pipeline(tfds_dir):
  src = sources.TfdsSource('moetrain_tiny_text', 'train', tfds_dir, sources.Fields(text='body'))
  assert len(src) == 12
  assert sorted(src[i]['text'] for i in range(12)) == sorted(f'document {i} ☃' for i in range(12))
  cfg = loader.DataConfig(
    source='tfds',
    tfds_name='moetrain_tiny_text',
    tfds_data_dir=tfds_dir,
    eval_split='validation',
    text_key='body',
    seq_len=16,
    eval_batch_size=4,
  )
  batches = loader.make_eval_batches(cfg, CharTokenizer())
  assert len(batches) == 2 and batches[0]['inputs'].shape == (4, 16)
  with pytest.raises(ValueError, match="tfds 'no_such_dataset'"):
    sources.TfdsSource('no_such_dataset', 'train', tfds_dir)


# Packing.


def test_packing_golden_row():
  examples = [{'prompt': 'ab', 'completion': 'c'}, {'text': 'xy'}]
  (row,) = packing.pack_examples(examples, CharTokenizer(), seq_len=10, num_bins=1)
  a, b, c, x, y = (ord(ch) for ch in 'abcxy')
  np.testing.assert_array_equal(row['inputs'], [1, a, b, c, 2, 1, x, y, 2, 0])
  np.testing.assert_array_equal(row['targets'], [a, b, c, 2, 1, x, y, 2, 0, 0])
  np.testing.assert_array_equal(row['segment_ids'], [1, 1, 1, 1, 1, 2, 2, 2, 2, 0])
  np.testing.assert_array_equal(row['positions'], [0, 1, 2, 3, 4, 0, 1, 2, 3, 0])
  np.testing.assert_array_equal(row['loss_mask'], [0, 0, 1, 1, 0, 1, 1, 1, 0, 0])
  assert row['loss_mask'].dtype == np.float32 and row['inputs'].dtype == np.int32
  (row,) = packing.pack_examples(
    examples, CharTokenizer(), seq_len=10, num_bins=1, loss_on_prompt=True
  )
  np.testing.assert_array_equal(row['loss_mask'], [1, 1, 1, 1, 0, 1, 1, 1, 0, 0])


@pytest.mark.parametrize('style', ['metaspace', 'prepend_normalizer'])
def test_hf_sentencepiece_style_completion_gets_no_extra_space(tmp_path, style):
  """A tokenizer.json that marks every text's start as a word start (Metaspace prepend, or
  Llama 2's Prepend normalizer): a completion encoded apart, where a token spans the boundary,
  is encoded without that marker, so the pair decodes to the text as written."""
  from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE(unk_token='<unk>'))
  if style == 'metaspace':
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme='first')
  else:
    tok.normalizer = normalizers.Sequence([normalizers.Prepend('▁'), normalizers.Replace(' ', '▁')])
    tok.pre_tokenizer = pre_tokenizers.Split('▁', 'merged_with_next')
  tok.decoder = decoders.Metaspace(prepend_scheme='first')
  trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=['<pad>', '<s>', '</s>', '<unk>'])
  tok.train_from_iterator(['say cat red fox cup reverse'] * 20, trainer)
  tok.save(str(tmp_path / 'tokenizer.json'))
  hf = tokenizer_lib.load_tokenizer(tmp_path / 'tokenizer.json')
  assert (
    hf.decode(hf.encode('cat')) == 'cat' and hf.encode('cat')[0] != hf.encode_continuation('cat')[0]
  )
  head, tail = packing.split_encode(hf, 'say ca', 't')
  assert head == hf.encode('say ca') and tail == hf.encode_continuation('t')
  assert hf.decode(head + tail) == 'say cat'
  # Where nothing spans the boundary, the split of the joint text is kept as before.
  head, tail = packing.split_encode(hf, 'say', ' red fox')
  assert hf.decode(head + tail) == 'say red fox'
  assert pickle.loads(pickle.dumps(hf)).encode_continuation('cat') == hf.encode_continuation('cat')


def test_completion_tokens_are_those_of_the_text(spm_tokenizer):
  """A SentencePiece model starts every text it encodes with a space: the completion is split
  from the tokens of prompt + completion, so the model trains on the text as written."""
  tok = spm_tokenizer
  prompt = '<|user|>\nred fox\n<|assistant|>\n'
  for ex in ({'prompt': prompt, 'completion': 'fox red'}, demo_task.generate()['eval'][0]):
    head, tail = packing.split_encode(tok, ex['prompt'], ex['completion'])
    assert head == tok.encode(ex['prompt'])
    assert tok.decode(head + tail) == ex['prompt'] + ex['completion']
  assert tok.decode(tok.encode(prompt) + tok.encode('fox red')).endswith('\n fox red')
  # A token across the boundary ('fox'): each part is encoded by itself, the completion without
  # the space SentencePiece starts a text with.
  head, tail = packing.split_encode(tok, 'reverse: red fo', 'x cup =')
  assert tok.encode('reverse: red fox cup =')[: len(head)] != head  # (the case in question)
  assert head == tok.encode('reverse: red fo')
  assert tok.decode(head + tail) == 'reverse: red fox cup ='
  assert pickle.loads(pickle.dumps(tok)).encode_continuation('x cup =') == tail
  glued = CharTokenizer()
  glued.encode = lambda text: [ord(c) for c in text.replace('ab', 'X')]
  assert packing.split_encode(glued, 'za', 'bc') == ([ord('z'), ord('a')], [ord('b'), ord('c')])


def test_packing_invariants(spm_tokenizer):
  tok, seq_len = spm_tokenizer, 48
  examples = demo_task.generate()['eval'][:60] + [{'text': 'red fox ' * 40}, {'text': ''}]
  rows = packing.pack_examples(examples, tok, seq_len=seq_len, num_bins=4)
  assert sum(int(r[packing.TRUNCATED_KEY]) for r in rows) == 1
  packed, loss_tokens = [], 0
  for row in rows:
    seg, pos, mask = row['segment_ids'], row['positions'], row['loss_mask']
    assert all(row[k].shape == (seq_len,) for k in packing.ROW_KEYS)
    np.testing.assert_array_equal(row['targets'][:-1], row['inputs'][1:])
    real = seg > 0
    assert real[: real.sum()].all()  # padding only at the end
    assert np.all(np.diff(seg[real]) == np.diff(seg[real]).clip(0, 1))  # ids 1, 2, 3, ...
    assert seg[0] == 1
    for s in range(1, seg.max() + 1):
      np.testing.assert_array_equal(pos[seg == s], np.arange((seg == s).sum()))
    assert not mask[~real].any()
    assert not mask[:-1][seg[:-1] != seg[1:]].any()  # no target crosses into the next example
    packed += segments(row)
    loss_tokens += mask.sum()
  full = [packing.tokenize(e, tok, max_len=seq_len + 1) for e in examples]
  # Every example is packed exactly once, and each of its targets keeps its loss weight.
  assert sorted(packed) == sorted(tuple(int(t) for t in f['tokens']) for f in full)
  assert loss_tokens == sum(f['is_target'][1:].sum() for f in full)


def test_packing_without_bos_eos_skips_empty_examples():
  tok = CharTokenizer()
  tok.bos_id = tok.eos_id = None
  (row,) = packing.pack_examples([{'text': ''}, {'text': 'ab'}], tok, seq_len=4)
  np.testing.assert_array_equal(row['segment_ids'], [1, 1, 0, 0])
  np.testing.assert_array_equal(row['loss_mask'], [1, 0, 0, 0])


def test_truncated_example_fills_a_row(spm_tokenizer):
  (row,) = packing.pack_examples([{'text': 'blue cat ' * 100}], spm_tokenizer, seq_len=32)
  assert (row['segment_ids'] == 1).all() and row[packing.TRUNCATED_KEY] == 1
  assert row['loss_mask'].sum() == 32  # every target is text, none is padding or eos


def test_long_text_is_split_into_pieces_each_target_once():
  tok = CharTokenizer()
  text = ''.join(chr(48 + i % 70) for i in range(47))  # bos + 47 + eos = 49 tokens
  full, _ = packing._tokens({'text': text}, tok, False)
  pieces = packing.tokenize_split({'text': text}, tok, max_len=11)
  assert [len(p['tokens']) for p in pieces] == [11, 11, 11, 11, 9]
  assert not any(p['truncated'] for p in pieces)
  for a, b in zip(pieces, pieces[1:]):
    assert a['tokens'][-1] == b['tokens'][0]  # the next piece starts on the last one's token
  # Targets (tokens after each piece's first) are the whole example's after bos, once each.
  np.testing.assert_array_equal(np.concatenate([p['tokens'][1:] for p in pieces]), full[1:])
  # Exactly max_len + 1 tokens: the second piece is the last two (one new target).
  two = packing.tokenize_split({'text': text[:9]}, tok, max_len=10)
  assert [len(p['tokens']) for p in two] == [10, 2]
  # Prompt/completion examples are cut, not split.
  (cut,) = packing.tokenize_split({'prompt': 'q' * 30, 'completion': 'a'}, tok, max_len=11)
  assert len(cut['tokens']) == 11 and cut['truncated'] == 1


def test_split_long_texts_trains_on_every_token(spm_tokenizer):
  tok, seq_len = spm_tokenizer, 32
  examples = [
    {'text': 'blue cat red fox ' * 40},
    {'text': 'a b'},
    {'prompt': 'x', 'completion': ' y'},
  ]
  full = [packing._tokens(e, tok, False) for e in examples]
  rows = packing.pack_examples(examples, tok, seq_len=seq_len, num_bins=4, split_long_texts=True)
  assert sum(int(r[packing.TRUNCATED_KEY]) for r in rows) == 0
  # Every target of every example is scored once: nothing of the long text is lost.
  assert sum(r['loss_mask'].sum() for r in rows) == sum(sum(t[1:]) for _, t in full)
  cut = packing.pack_examples(examples, tok, seq_len=seq_len, num_bins=4)
  assert sum(int(r[packing.TRUNCATED_KEY]) for r in cut) == 1
  assert sum(r['loss_mask'].sum() for r in cut) < sum(r['loss_mask'].sum() for r in rows)


# Pipeline.


def small_cfg(tmp_path, n=120, **overrides):
  write_jsonl(tmp_path / 'train.jsonl', numbered_records(n))
  write_jsonl(tmp_path / 'eval.jsonl', numbered_records(n)[:37])
  # Examples are ~20 tokens: three fit in a row of seq_len + 1 = 65.
  base = dict(
    source='jsonl',
    path=str(tmp_path / '{split}.jsonl'),
    seq_len=64,
    global_batch_size=4,
    eval_batch_size=4,
  )
  return loader.DataConfig(**{**base, **overrides})


def take(it, n):
  return [next(it) for _ in range(n)]


def rows_of(batch):
  return [{k: v[i] for k, v in batch.items()} for i in range(len(batch['inputs']))]


def test_train_iterator_is_deterministic_and_shaped(spm_tokenizer):
  cfg = loader.DataConfig()
  a = take(loader.make_train_iterator(cfg, spm_tokenizer), 3)
  assert_batches_equal(a, take(loader.make_train_iterator(cfg, spm_tokenizer), 3))
  assert set(a[0]) == set(packing.ROW_KEYS)
  assert all(v.shape == (16, 128) for v in a[0].values())
  other = take(loader.make_train_iterator(dataclasses.replace(cfg, seed=1), spm_tokenizer), 1)
  assert not np.array_equal(a[0]['inputs'], other[0]['inputs'])


def test_get_state_set_state_resumes_exactly(tmp_path):
  # 120 examples pack into about 10 batches per epoch: 25 steps cross two epoch boundaries.
  cfg = small_cfg(tmp_path)
  tok = CharTokenizer()
  it = loader.make_train_iterator(cfg, tok)
  states, batches = [], []
  for _ in range(25):
    states.append(json.loads(json.dumps(it.get_state())))  # must survive JSON
    batches.append(next(it))
  for start in (0, 7, 11, 19):
    resumed = loader.make_train_iterator(cfg, tok)
    resumed.set_state(states[start])
    assert_batches_equal(take(resumed, 25 - start), batches[start:])
  it.set_state(states[3])  # rewinding the same iterator works too
  assert_batches_equal(take(it, 2), batches[3:5])


def test_split_pieces_resume_exactly(tmp_path):
  # Documents of ~3-5 rows each: states taken between a document's pieces must resume inside it.
  docs = [{'text': f'doc {i} ' + 'abcdefghij' * (20 + 7 * (i % 3))} for i in range(12)]
  write_jsonl(tmp_path / 'train.jsonl', docs)
  cfg = loader.DataConfig(
    source='jsonl',
    path=str(tmp_path / '{split}.jsonl'),
    eval_split='',
    seq_len=64,
    global_batch_size=2,
  )
  tok = CharTokenizer()
  it = loader.make_train_iterator(cfg, tok)
  states, batches = [], []
  for _ in range(30):
    states.append(json.loads(json.dumps(it.get_state())))
    batches.append(next(it))
  assert sum(b['loss_mask'].sum() for b in batches[:10]) > 0
  for start in (1, 5, 13, 22):
    resumed = loader.make_train_iterator(cfg, tok)
    resumed.set_state(states[start])
    assert_batches_equal(take(resumed, 30 - start), batches[start:])


def test_resume_onto_changed_files_says_so(tmp_path, caplog):
  """A position saved over 120 examples and restored onto files regenerated with 60: the stream
  it points into is not the saved one (or has ended), which must not pass in silence."""
  tok = CharTokenizer()
  states = {}
  for epochs in (None, 1):
    it = loader.make_train_iterator(small_cfg(tmp_path, num_epochs=epochs), tok)
    take(it, 8)
    states[epochs] = json.loads(json.dumps(it.get_state()))
  loader.make_train_iterator(small_cfg(tmp_path), tok).set_state(states[None])
  assert 'warning' not in caplog.text.lower()  # the same files: silent
  cfg = small_cfg(tmp_path, n=60)
  loader.make_train_iterator(cfg, tok).set_state(states[None])
  assert 'this host read 120 examples per epoch, now 60' in caplog.text
  with pytest.raises(ValueError, match=r'past the end of the training data.*120 examples'):
    ended = loader.make_train_iterator(dataclasses.replace(cfg, num_epochs=1), tok)
    ended.set_state(states[1])


def test_num_epochs_and_truncation_count(tmp_path):
  cfg = small_cfg(tmp_path, num_epochs=2, shuffle=False, seq_len=8)
  it = loader.make_train_iterator(cfg, CharTokenizer())
  batches = list(it)
  # Each example (18-22 tokens) is cut to seq_len + 1 = 9 tokens and fills a row alone.
  assert len(batches) == 2 * 120 // 4
  assert it.num_truncated == 240
  epoch1 = np.concatenate([b['inputs'] for b in batches[:30]])
  np.testing.assert_array_equal(epoch1, np.concatenate([b['inputs'] for b in batches[30:]]))


def test_per_host_sharding_is_disjoint(tmp_path):
  cfg = small_cfg(tmp_path, global_batch_size=8, num_epochs=1)
  tok = CharTokenizer()
  seen = []
  for host in range(2):
    batches = list(loader.make_train_iterator(cfg, tok, process_index=host, process_count=2))
    assert batches and all(b['inputs'].shape == (4, 64) for b in batches)
    items = {
      int(tok.decode(s).split()[1]) for b in batches for r in rows_of(b) for s in segments(r)
    }
    assert items and all(i % 2 == host for i in items)  # host h reads examples h, h+2, ...
    seen.append(items)
  assert len(seen[0] | seen[1]) > 0.8 * 120  # only a partial last batch per host is dropped


def test_eval_batches_are_padded_and_split_across_hosts(tmp_path):
  cfg = small_cfg(tmp_path)
  tok = CharTokenizer()
  full = loader.make_eval_batches(cfg, tok)
  assert all(b['inputs'].shape == (4, 64) for b in full)
  last = full[-1]
  assert (last['segment_ids'][-1] == 0).all() and not last['loss_mask'][-1].any()
  packed = sorted(tok.decode(s) for b in full for r in rows_of(b) for s in segments(r))
  assert packed == sorted(f'item {i} =answer {i}' for i in range(37))  # each exactly once
  hosts = [loader.make_eval_batches(cfg, tok, process_index=h, process_count=2) for h in (0, 1)]
  assert len(hosts[0]) == len(hosts[1]) == len(full)
  for i, batch in enumerate(full):
    for key, value in batch.items():
      np.testing.assert_array_equal(np.concatenate([hosts[0][i][key], hosts[1][i][key]]), value)
  assert len(loader.make_eval_batches(cfg, tok, max_batches=1)) == 1
  assert loader.make_eval_batches(dataclasses.replace(cfg, eval_split=''), tok) == []


def test_eval_examples_cut_short_are_reported(tmp_path, caplog):
  cfg = small_cfg(tmp_path, seq_len=12)  # 'item 7 =answer 7' is 16 characters
  loader.make_eval_batches(cfg, CharTokenizer())
  assert '37 eval examples are longer than data.seq_len + 1 = 13 tokens' in caplog.text


def test_make_tokenizer_trains_on_the_train_split(tmp_path):
  cfg = small_cfg(tmp_path, vocab_size=300)
  tok = loader.make_tokenizer(cfg, tmp_path / 'work')
  assert (tmp_path / 'work' / 'tokenizer.model').is_file()
  assert tok.decode(tok.encode('item 7 =')) == 'item 7 ='


@pytest.mark.parametrize(
  'overrides, field',
  [
    (dict(seq_len=0), 'data.seq_len'),
    (dict(global_batch_size=6), 'data.global_batch_size'),
    (dict(eval_batch_size=0), 'data.eval_batch_size'),
    (dict(source='csv'), 'data.source'),
    (dict(source='jsonl'), 'data.path'),
    (dict(source='jsonl', path='/nonexistent/{split}.jsonl'), 'data.path'),
    (dict(source='jsonl', path='/nonexistent/x.jsonl', eval_split='eval'), 'data.eval_split'),
    (dict(source='tfds'), 'data.tfds_name'),
    (dict(train_split='test'), 'data.train_split'),
    (dict(tokenizer='/nonexistent/tokenizer.model'), 'data.tokenizer'),
    (dict(vocab_size=100), 'data.vocab_size'),
    (dict(num_epochs=0), 'data.num_epochs'),
    (dict(worker_count=-1), 'data.worker_count'),
  ],
)
def test_validate_names_the_field(overrides, field):
  with pytest.raises(ValueError, match=field.replace('.', r'\.')):
    loader.validate(loader.DataConfig(**overrides), process_count=4)


@pytest.mark.parametrize(
  'overrides, field',
  [
    (dict(path='/data/{split}.jsonl'), 'data.path'),  # the demo source would ignore it
    (dict(source='tfds', tfds_name='x', tfds_data_dir='/d', path='/p'), 'data.path'),
    (dict(eval_split='train'), 'data.eval_split'),
  ],
)
def test_training_data_checks_name_the_field(overrides, field):
  """Checks only a training run makes (a tool may read an older run's settings)."""
  cfg = loader.DataConfig(**overrides)
  loader.validate(cfg)
  with pytest.raises(ValueError, match=field.replace('.', r'\.')):
    loader.check_training_data(cfg)


def test_default_config_is_valid():
  loader.validate(loader.DataConfig())


@pytest.mark.slow
def test_worker_processes_resume_exactly(tmp_path):
  from absl import flags

  flags.FLAGS.mark_as_parsed()  # grain reads its absl flags in worker processes
  cfg = small_cfg(tmp_path, worker_count=2)
  it = loader.make_train_iterator(cfg, CharTokenizer())
  take(it, 3)
  state = json.loads(json.dumps(it.get_state()))
  expected = take(it, 5)
  it.close()
  resumed = loader.make_train_iterator(cfg, CharTokenizer())
  resumed.set_state(state)
  assert_batches_equal(take(resumed, 5), expected)
  resumed.close()


def test_empty_split_is_an_error_naming_it(tmp_path):
  cfg = small_cfg(tmp_path)
  (tmp_path / 'train.jsonl').write_text('\n  \n')  # blank lines only
  with pytest.raises(ValueError, match=r"split 'train' .*train\.jsonl\) has no examples"):
    loader.make_tokenizer(cfg, tmp_path / 'work')


def test_completions_that_are_all_empty_are_refused(spm_tokenizer, tmp_path, caplog):
  """Only end-of-text would train: refused before any batch, naming the key and the fixes; a
  few empty completions among others are a warning; with loss_on_prompt the prompts train."""
  empty = [{'prompt': f'item {i} =', 'completion': ' '} for i in range(20)]
  cfg = loader.DataConfig(
    source='jsonl',
    path=str(write_jsonl(tmp_path / 'e.jsonl', empty)),
    eval_split='',
    seq_len=32,
    global_batch_size=2,
  )
  with pytest.raises(
    ValueError,
    match="completion of each of the first 20 examples is empty.*data.completion_key='completion'",
  ):
    loader.make_train_iterator(cfg, spm_tokenizer)
  next(loader.make_train_iterator(dataclasses.replace(cfg, loss_on_prompt=True), spm_tokenizer))
  some = numbered_records(18) + empty[:2]
  cfg = dataclasses.replace(cfg, path=str(write_jsonl(tmp_path / 's.jsonl', some)))
  with caplog.at_level('WARNING'):
    next(loader.make_train_iterator(cfg, spm_tokenizer))
  assert '2 of the first 20 prompt/completion examples have an empty completion' in caplog.text
