"""Chat records rendered with the model's own chat template, compared with transformers'
apply_chat_template (tests/fixtures/make_chat_fixtures.py wrote what it returns)."""

import concurrent.futures
import json
import os
import shutil

import pytest

from moetrain.data import chat, loader, packing, sources
from moetrain.data import tokenizer as tokenizer_lib
from tests.helpers import ROOT, run_command

FIXTURES = os.path.join(ROOT, 'tests', 'fixtures', 'chat')
TOKENIZER = os.path.join(FIXTURES, 'tokenizer')
EXPECTED = json.load(open(os.path.join(FIXTURES, 'expected.json')))


def template_path(name: str) -> str:
  return os.path.join(FIXTURES, 'templates', f'{name}.jinja')


def data_config(**kw) -> loader.DataConfig:
  """The fixture conversations as a JSONL 'conversations' split, read with the fixture tokenizer."""
  return loader.DataConfig(
    source='jsonl',
    path=os.path.join(FIXTURES, '{split}.jsonl'),
    train_split='conversations',
    eval_split='',
    tokenizer=TOKENIZER,
    seq_len=4096,
    **kw,
  )


@pytest.fixture(scope='module')
def conversations():
  cfg = data_config()
  return [loader.open_source(cfg, 'conversations')[i] for i in range(5)]


@pytest.fixture(scope='module')
def tok():
  return tokenizer_lib.load_tokenizer(TOKENIZER)


def tokenized(example, tok, **data):
  cfg = data_config(**data)
  fmt = loader.chat_format(cfg, tok)
  piece = packing.tokenize(example, tok, max_len=cfg.seq_len + 1, chat_format=fmt)
  return [int(i) for i in piece['tokens']], [int(m) for m in piece['is_target']]


def last_run(mask):
  """The mask's last run of ones alone (the final assistant turn)."""
  end = max(i for i, m in enumerate(mask) if m) + 1
  start = end
  while start > 0 and mask[start - 1]:
    start -= 1
  return [int(start <= i < end) for i in range(len(mask))]


@pytest.mark.parametrize('name', ['chatml_tools', 'llama3', 'inst'])
def test_ids_and_trained_tokens_are_transformers(name, conversations, tok):
  """Ids equal apply_chat_template(tokenize=True); the trained tokens, found from the template
  alone, equal the assistant mask transformers reads from a twin template whose {% generation %}
  blocks mark each reply; the twin itself gives the same. Templates that raise (roles must
  alternate) raise here too, naming the record."""
  for example, expected in zip(conversations, EXPECTED[name], strict=True):
    for template in (name, f'{name}_generation'):
      if 'error' in expected:
        with pytest.raises(ValueError, match=rf'conversations\.jsonl:\d+: .*{expected["error"]}'):
          tokenized(example, tok, chat_template=template_path(template))
        continue
      ids, mask = tokenized(example, tok, chat_template=template_path(template))
      assert ids == expected['ids'], template
      assert mask == expected['assistant_masks'], template


def test_the_tokenizers_own_template_is_used(conversations, tok):
  """tokenizer_config.json's chat_template (chatml_tools) with data.chat_template=''; a
  chat_template.jinja beside tokenizer.json wins, as in transformers."""
  assert tok.chat_template == open(template_path('chatml_tools')).read()
  for example, expected in zip(conversations, EXPECTED['chatml_tools']):
    assert tokenized(example, tok) == (expected['ids'], expected['assistant_masks'])
  # 'last': the final assistant turn alone; a conversation ending with the user is an error.
  ids, mask = tokenized(conversations[2], tok, chat_loss='last')
  assert mask == last_run(EXPECTED['chatml_tools'][2]['assistant_masks'])
  with pytest.raises(ValueError, match=r'conversations\.jsonl:4: the last message should be'):
    tokenized(conversations[3], tok, chat_loss='last')


def test_a_chat_template_file_wins_over_the_config(tmp_path, conversations):
  shutil.copytree(TOKENIZER, tmp_path / 'tok')
  shutil.copy(template_path('llama3'), tmp_path / 'tok' / chat.TEMPLATE_FILE)
  tok = tokenizer_lib.load_tokenizer(tmp_path / 'tok')
  assert tok.chat_template == open(template_path('llama3')).read()
  assert tok.template_variables['bos_token'] == '<s>'  # the template's {{ bos_token }}
  ids, _ = tokenized(conversations[0], tok)
  assert ids == EXPECTED['llama3'][0]['ids']


def test_a_template_that_rewrites_earlier_turns(conversations, tok):
  """The thinking template drops the reasoning of turns before the last user message: those
  turns cannot be found from the template alone ('all' is an error saying what to do), the last
  can ('last'), and {% generation %} blocks mark them all."""
  thinking, marked = template_path('thinking'), template_path('thinking_generation')
  for example, expected in zip(conversations, EXPECTED['thinking']):
    ids, mask = tokenized(example, tok, chat_template=marked)
    assert (ids, mask) == (expected['ids'], expected['assistant_masks'])
  example, expected = conversations[4], EXPECTED['thinking'][4]
  with pytest.raises(ValueError, match=r"renders message 1 .* data.chat_loss='last'"):
    tokenized(example, tok, chat_template=thinking)
  ids, mask = tokenized(example, tok, chat_template=thinking, chat_loss='last')
  assert (ids, mask) == (expected['ids'], last_run(expected['assistant_masks']))
  # Without reasoning in the conversation, the turns are found.
  assert (
    tokenized(conversations[1], tok, chat_template=thinking)[1]
    == (EXPECTED['thinking'][1]['assistant_masks'])
  )


def test_generation_spans_are_tracked_per_thread(conversations):
  """grain's read-ahead threads render with one compiled template at once."""
  fmt = chat.ChatFormat(open(template_path('chatml_tools_generation')).read(), builtin=False)
  want = [fmt.apply(example) for example in conversations]
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    got = list(pool.map(fmt.apply, conversations * 50))
  assert got == want * 50


def test_the_builtin_template_trains_every_assistant_turn(tmp_path):
  """A tokenizer without a template (a trained SentencePiece model): <|role|> turns, bos/eos
  around the text, the loss on each reply (or the last), eos trained after the last."""
  example = sources.chat_example(
    [
      {'role': 'user', 'content': 'red fox'},
      {'role': 'assistant', 'content': 'fox red'},
      {'role': 'user', 'content': 'blue cat'},
      {'role': 'assistant', 'content': 'cat blue'},
    ],
    None,
    'x:1',
  )
  text, spans = chat.ChatFormat().apply(example)
  assert (
    text == '<|user|>\nred fox\n<|assistant|>\nfox red\n<|user|>\nblue cat\n<|assistant|>\ncat blue'
  )
  assert [text[a:b] for a, b in spans] == ['fox red', 'cat blue']
  assert [text[a:b] for a, b in chat.ChatFormat(loss='last').apply(example)[1]] == ['cat blue']
  tok = tokenizer_lib.train_sentencepiece([text] * 20, 300, tmp_path / 'tokenizer.model')
  tokens, is_target = packing._tokens(example, tok, False, chat.ChatFormat())
  assert tokens[0] == tok.bos_id and tokens[-1] == tok.eos_id and is_target[-1] == 1.0
  trained = [t for t, m in zip(tokens[1:-1], is_target[1:-1]) if m]
  assert tok.decode(trained) == 'fox redcat blue'
  # Tool calls have no string content: the built-in template says what to do.
  calls = dict(example, messages=[*example['messages'][:3], {'role': 'assistant', 'content': None}])
  with pytest.raises(ValueError, match='x:1: message 3 has no string content'):
    chat.ChatFormat().apply(calls)


def test_preview_data_prints_the_trainers_tokens():
  """`preview_data --json` prints transformers' ids and assistant masks for the fixture chats;
  the text form marks the trained text."""
  args = [
    '--config=configs/longcat_lora.py',
    '--config.data.source=jsonl',
    f'--config.data.path={FIXTURES}/{{split}}.jsonl',
    '--config.data.train_split=conversations',
    '--config.data.eval_split=',
    f'--config.data.tokenizer={TOKENIZER}',
    '--config.data.seq_len=4096',
    '--num=5',
  ]
  out = run_command('moetrain.tools.preview_data', *args, '--json')
  assert out.returncode == 0, out.stderr
  rows = [json.loads(line) for line in out.stdout.splitlines()]
  assert rows == [
    {'ids': e['ids'], 'loss_mask': e['assistant_masks']} for e in EXPECTED['chatml_tools']
  ]
  out = run_command('moetrain.tools.preview_data', *args, '--num=1')
  assert out.returncode == 0, out.stderr
  assert '<|im_start|>assistant\n[[fox red<|im_end|>]]\n' in out.stdout


@pytest.mark.parametrize('template', ['', 'llama3', 'inst'])
def test_a_chat_prompt_is_what_training_renders_before_the_reply(template, conversations, tok):
  """generate --chat asks as training taught: the prompt of a conversation's first turns is
  the training text up to where the trained reply starts (the template's generation prompt
  included), for the tokenizer's own template and others."""
  cfg = data_config(chat_template=template_path(template) if template else '')
  fmt = loader.chat_format(cfg, tok)
  checked = 0
  for example in conversations:
    messages = example['messages']
    ends = [i for i, m in enumerate(messages) if m['role'] == 'assistant']
    try:
      text, spans = fmt.apply(example)
    except ValueError:  # (a conversation this template refuses: tested above)
      continue
    prompt = fmt.prompt(messages[: ends[0]], example.get('tools'))
    assert text.startswith(prompt) and spans[0][0] >= len(prompt) > 0
    checked += 1
  assert checked >= 2
  replied = [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'b'}]
  with pytest.raises(ValueError, match='ends with a message for the assistant to answer'):
    fmt.prompt(replied)


def test_generate_reads_chats_from_the_command_line_or_a_jsonl(tmp_path):
  from absl import app

  from moetrain.tools.generate import chat_inputs

  assert chat_inputs('Hi', '', '') == [[{'role': 'user', 'content': 'Hi'}]]
  assert chat_inputs('Hi', 'Be brief.', '')[0][0] == {'role': 'system', 'content': 'Be brief.'}
  with pytest.raises(app.UsageError, match='--chat needs --prompt'):
    chat_inputs('', '', '')
  path = tmp_path / 'chats.jsonl'
  path.write_text(json.dumps({'messages': [{'role': 'user', 'content': 'a'}]}) + '\n\n{"x": 1}\n')
  with pytest.raises(ValueError, match=r'--messages=.*chats\.jsonl, line 3: not a'):
    chat_inputs('', '', str(path))
  path.write_text(json.dumps({'messages': [{'role': 'user', 'content': 'a'}]}) + '\n')
  assert chat_inputs('ignored', '', str(path)) == [[{'role': 'user', 'content': 'a'}]]


# Loops that write nothing: only the time bound can stop them, however fast the machine (with an
# 'x' a fast one passed the text bound first).
NESTED = '{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}'


@pytest.mark.parametrize(
  'template, says',
  [
    (NESTED, r'took over 0\.5 s \(MAX_RENDER_SECONDS\)'),
    ('{% for i in range(10**9) %}x{% endfor %}', r'range of 1,000,000,000 items'),
    ("{{ 'xy' * 10**9 }}", r'repeats 2 items 1,000,000,000 times'),
    ("{% for i in range(100) %}{{ 'ab' * 10**5 }}{% endfor %}", r'passed 1,048,576 characters'),
    ('{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}', 'RecursionError'),
    ('{{ messages + 1 }}', 'TypeError: can only concatenate list'),
  ],
)
def test_a_template_is_bounded_and_its_failures_name_it(template, says, monkeypatch):
  """A template is code: its rendering is bounded in time and text (a nested loop would fill
  the memory), and what it raises is one error naming the template and the example."""
  monkeypatch.setattr(chat, 'MAX_RENDER_SECONDS', 0.5)
  monkeypatch.setattr(chat, 'MAX_RENDER_CHARS', 2**20)
  fmt = chat.ChatFormat(template=template, builtin=False, name="data.chat_template='t.jinja'")
  example = {'messages': [{'role': 'user', 'content': 'hi'}], 'where': 'train.jsonl:3'}
  example['messages'].append({'role': 'assistant', 'content': 'ok'})
  with pytest.raises(
    ValueError, match=rf"^train\.jsonl:3: data\.chat_template='t\.jinja': .*{says}"
  ):
    fmt.apply(example)


def test_a_templates_unbounded_range_is_one_error_line(tmp_path):
  template = tmp_path / 'big.jinja'
  template.write_text('{% for i in range(10**9) %}{{ i }}{% endfor %}')
  out = run_command(
    'moetrain.tools.preview_data',
    '--config=configs/longcat_lora.py',
    '--config.data.source=jsonl',
    f'--config.data.path={FIXTURES}/{{split}}.jsonl',
    '--config.data.train_split=conversations',
    '--config.data.eval_split=',
    f'--config.data.tokenizer={TOKENIZER}',
    f'--config.data.chat_template={template}',
    '--num=1',
  )
  assert out.returncode == 1 and 'Traceback' not in out.stderr, out.stderr
  (line,) = out.stderr.strip().splitlines()[-1:]
  assert line.startswith('Error: ') and f"data.chat_template='{template}'" in line, out.stderr
  assert 'range of 1,000,000,000 items' in line


def test_chat_on_a_run_whose_data_held_no_chats_says_so(tmp_path):
  from moetrain.tools.generate import chat_note

  assert 'holds no chats' in chat_note(loader.DataConfig())  # the demo task: prompt/completion
  path = tmp_path / 'train.jsonl'
  path.write_text(json.dumps({'text': 'plain words'}) + '\n')
  data = loader.DataConfig(source='jsonl', path=str(tmp_path / '{split}.jsonl'))
  assert chat_note(data).startswith(
    f"# note: this run's training data (data.path={data.path!r}) holds no chats: "
  )
  chat = {'messages': [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'b'}]}
  path.write_text('\n'.join(json.dumps(r) for r in ({'text': 'x'}, chat)) + '\n')
  assert chat_note(data) == ''
  missing = loader.DataConfig(source='jsonl', path=str(tmp_path / 'elsewhere/{split}.jsonl'))
  assert chat_note(missing) == ''  # data not on this host: nothing to say
