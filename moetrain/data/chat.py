"""Chat records rendered with the model's own chat template, and which of their tokens train.

A chat example ({'messages': [...], 'tools': [...] optional}) is rendered by a Jinja chat template
the way transformers' `apply_chat_template` renders it: the same sandboxed environment
(trim_blocks, lstrip_blocks, loop controls), the same `tojson`, `raise_exception` and
`strftime_now`, the tokenizer's special tokens as variables (`bos_token`, `eos_token`, ...), and
`{% generation %}` blocks. Its tokens are those of the rendered text encoded once, without added
special tokens, so they are the ids `apply_chat_template(..., tokenize=True)` returns.

The trained tokens are the assistant turns' (data.chat_loss: 'all' of them, or the 'last'):
- a template with `{% generation %}` blocks marks them itself (what transformers'
  `return_assistant_tokens_mask` reads);
- otherwise turn i's text is what rendering messages[:i + 1] adds to rendering messages[:i] with
  the generation prompt, less trailing whitespace: the reply and the template's end-of-turn
  marker (`<|im_end|>`, `<|eot_id|>`, `</s>`), not the role header the prompt already gave. This
  holds for templates that render a turn the same whatever follows it; one that does not (Qwen3
  drops the reasoning of turns before the last user message) is an error that says what to do.

A token trains if any character of a trained span falls in it (transformers' char_to_token).
Tokenizers without a template of their own use BUILTIN, with bos before and eos after the text.

A template is code from a file: each rendering is bounded (MAX_RENDER_CHARS of text,
MAX_RENDER_SECONDS, ranges of MAX_RANGE items, repetitions and powers within the text limit), and
whatever it raises is an error naming the template and the example.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

TEMPLATE_FILE = 'chat_template.jinja'  # beside tokenizer.json; wins over tokenizer_config.json's
LOSSES = ('all', 'last')
# The template for tokenizers that have none: <|role|>\n{content}\n per message.
BUILTIN = (
  "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
  "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}{{ '\\n' if messages else '' }}{{ '<|assistant|>\\n' }}{% endif %}"
)
# Special-token variables a template may read (transformers' special_tokens_map).
TOKEN_KEYS = (
  'bos_token',
  'eos_token',
  'unk_token',
  'sep_token',
  'pad_token',
  'cls_token',
  'mask_token',
  'additional_special_tokens',
)
_GENERATION = re.compile(r'\{%-?\s*generation\s*-?%\}')
_tracked = threading.local()  # the render in progress on this thread: chunks, spans, deadline
# Bounds of one rendering (a template's loops could otherwise fill the memory or never end).
MAX_RENDER_CHARS = 2**24
MAX_RENDER_SECONDS = 10.0
MAX_RANGE = 100_000


class _Tracker(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: records where the block's output lands in the
  rendered text (its start is the length of what the renderer has yielded so far). The record
  is per thread: grain's read-ahead threads render with one compiled template at once."""

  tags = {'generation'}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
    call = self.call_method('_track', [])
    return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

  def _track(self, caller) -> str:
    out = caller()
    chunks = getattr(_tracked, 'chunks', None)
    if chunks is not None:
      start = sum(len(c) for c in chunks)
      _tracked.spans.append((start, start + len(out)))
    return out


def _raise(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _limit(message: str):
  raise jinja2.exceptions.TemplateRuntimeError(f'the rendering {message}')


def _in_time() -> None:
  deadline = getattr(_tracked, 'deadline', None)
  if deadline is not None and time.monotonic() > deadline:
    _limit(f'took over {MAX_RENDER_SECONDS:g} s (MAX_RENDER_SECONDS)')


class _Range:
  """range() in a template: at most MAX_RANGE items, its loops held to the rendering's time."""

  def __init__(self, *args):
    self._r = range(*args)
    if len(self._r) > MAX_RANGE:
      _limit(f'asked for a range of {len(self._r):,} items (at most MAX_RANGE, {MAX_RANGE:,})')

  def __len__(self) -> int:
    return len(self._r)

  def __getitem__(self, i):
    return self._r[i]

  def __contains__(self, x) -> bool:
    return x in self._r

  def __iter__(self):
    return _in_time_each(self._r)

  def __reversed__(self):
    return _in_time_each(reversed(self._r))


def _in_time_each(items):
  for i, x in enumerate(items):
    if i % 1024 == 0:
      _in_time()
    yield x


class _Environment(jinja2.sandbox.ImmutableSandboxedEnvironment):
  """transformers' sandbox, with repetition (`'x' * n`) and powers bounded."""

  intercepted_binops = frozenset({'*', '**'})

  def call_binop(self, context, operator, left, right):
    if operator == '*':
      for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
          if len(seq) * n > MAX_RENDER_CHARS:
            _limit(f'repeats {len(seq):,} items {n:,} times (at most MAX_RENDER_CHARS)')
    if operator == '**' and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
      if right * abs(left).bit_length() > 4096:
        _limit(f'raises {left} to the power {right:,}')
    return super().call_binop(context, operator, left, right)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
  return json.dumps(
    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
  """A template compiled once per process."""
  env = _Environment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_Tracker, jinja2.ext.loopcontrols]
  )
  env.filters['tojson'] = _tojson
  env.globals['range'] = _Range
  env.globals['raise_exception'] = _raise
  env.globals['strftime_now'] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(source)


def render(
  source: str,
  messages: Sequence[Mapping],
  *,
  tools: Sequence[Mapping] | None = None,
  add_generation_prompt: bool = False,
  variables: Mapping[str, Any] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
  """The rendered text and the character spans of its `{% generation %}` blocks. A template
  that passes the bounds (MAX_RENDER_CHARS, ...) or fails raises a TemplateError."""
  template = compile_template(source)
  chunks, spans, size = [], [], 0
  _tracked.chunks, _tracked.spans = chunks, spans
  _tracked.deadline = time.monotonic() + MAX_RENDER_SECONDS
  try:
    for chunk in template.generate(
      messages=messages,
      tools=tools,
      documents=None,
      add_generation_prompt=add_generation_prompt,
      **(variables or {}),
    ):
      chunks.append(chunk)
      size += len(chunk)
      if size > MAX_RENDER_CHARS:
        _limit(f'passed {MAX_RENDER_CHARS:,} characters (MAX_RENDER_CHARS)')
      _in_time()
  except jinja2.TemplateError:
    raise
  except Exception as e:  # the template's own failure (a TypeError, a recursion): named
    raise jinja2.exceptions.TemplateRuntimeError(f'{type(e).__name__}: {e}') from e
  finally:
    _tracked.chunks = _tracked.spans = _tracked.deadline = None
  return ''.join(chunks), spans


def template_from_config(config: Mapping, directory: Path | None) -> str | dict[str, str] | None:
  """A tokenizer's chat template as transformers loads it: chat_template.jinja beside it, else
  tokenizer_config.json's `chat_template` (a string, or a list of {name, template})."""
  if directory is not None and (directory / TEMPLATE_FILE).is_file():
    return (directory / TEMPLATE_FILE).read_text(encoding='utf-8')
  value = config.get('chat_template')
  if isinstance(value, list):
    return {t['name']: t['template'] for t in value}
  return value if isinstance(value, str) else None


def token_variables(config: Mapping) -> dict[str, Any]:
  """The special-token variables of tokenizer_config.json (strings; {'content': ...} read)."""
  out = {}
  for key in TOKEN_KEYS:
    value = config.get(key)
    if isinstance(value, Mapping):
      value = value.get('content')
    if isinstance(value, list):
      value = [v.get('content') if isinstance(v, Mapping) else v for v in value]
    if value is not None:
      out[key] = value
  return out


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """How chat examples become text and trained spans (picklable: grain workers get it).

  `template` is one template or {name: template} (a tool-using conversation takes 'tool_use' if
  there is one, else 'default', as transformers does); `builtin` says the text is framed with
  bos/eos by the packer (BUILTIN), where a model's template writes its own special tokens."""

  template: str | Mapping[str, str] = BUILTIN
  variables: tuple[tuple[str, Any], ...] = ()
  loss: str = 'all'
  builtin: bool = True
  name: str = 'the built-in chat template'

  def source(self, tools) -> str:
    if isinstance(self.template, str):
      return self.template
    key = 'tool_use' if tools is not None and 'tool_use' in self.template else 'default'
    if key not in self.template:
      raise ValueError(
        f'{self.name} has several templates ({sorted(self.template)}) and none is named '
        "'default': set data.chat_template to one of them (a .jinja file)"
      )
    return self.template[key]

  def apply(self, example: Mapping) -> tuple[str, list[tuple[int, int]]]:
    """Renders a chat example: (text, character spans of the trained turns)."""
    messages, tools = example['messages'], example.get('tools')
    where = example.get('where', '')
    if self.builtin:
      for i, m in enumerate(messages):
        if not isinstance(m.get('content'), str):
          raise ValueError(
            f'{where}: message {i} has no string content, which is all the built-in chat '
            'template renders (a tokenizer with its own chat template renders tool calls and '
            'content parts: set data.tokenizer, or data.chat_template)'
          )
    assistant = [i for i, m in enumerate(messages) if m.get('role') == 'assistant']
    if self.loss == 'last' and messages[-1].get('role') != 'assistant':
      raise ValueError(
        f'{where}: the last message should be from the assistant (data.chat_loss=last trains '
        f'on it), got role {messages[-1].get("role")!r}'
      )
    if not assistant:
      raise ValueError(f'{where}: the conversation has no assistant message to train on')
    source = self.source(tools)
    kw = dict(tools=tools, variables=dict(self.variables))
    try:
      text, marked = render(source, messages, **kw)
      if _GENERATION.search(source):
        spans = marked
      else:
        turns = assistant[-1:] if self.loss == 'last' else assistant
        spans = [self._turn(source, messages, i, text, kw, where) for i in turns]
    except jinja2.TemplateError as e:
      raise ValueError(f'{where}: {self.name}: {type(e).__name__}: {e}') from e
    spans = [(lo, hi) for lo, hi in spans if hi > lo]
    if self.loss == 'last':
      spans = spans[-1:]
    if not spans:
      raise ValueError(f'{where}: {self.name} gives the assistant turns no text to train on')
    return text, spans

  def prompt(self, messages: Sequence[Mapping], tools=None) -> str:
    """The text a reply continues: the conversation so far rendered as training renders it,
    then the template's generation prompt (the assistant's turn opened)."""
    if not messages or messages[-1].get('role') == 'assistant':
      raise ValueError('a chat prompt ends with a message for the assistant to answer')
    kw = dict(tools=tools, variables=dict(self.variables))
    try:
      return render(self.source(tools), messages, add_generation_prompt=True, **kw)[0]
    except jinja2.TemplateError as e:
      raise ValueError(f'{self.name}: {type(e).__name__}: {e}') from e

  def _turn(self, source, messages, i, text, kw, where) -> tuple[int, int]:
    """Assistant turn i's span: what rendering messages[:i + 1] adds to messages[:i] with the
    generation prompt, when both are prefixes of the whole conversation's text."""
    head, _ = render(source, messages[:i], add_generation_prompt=True, **kw)
    upto = text if i == len(messages) - 1 else render(source, messages[: i + 1], **kw)[0]
    if not (text.startswith(head) and text.startswith(upto) and len(upto) >= len(head)):
      raise ValueError(
        f'{where}: {self.name} renders message {i} (an assistant turn) differently once later '
        'messages follow it (e.g. it drops the reasoning of earlier turns), so its tokens cannot '
        "be found: set data.chat_loss='last' to train on the final turn only, or give "
        'data.chat_template a template that marks the trained text with {% generation %} blocks'
      )
    return len(head), len(upto.rstrip())


def trained_tokens(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list:
  """1.0 for each token (character offsets [start, end)) from the first that holds a span's
  first character to the last that holds its last one; else 0.0."""
  mask = [0.0] * len(offsets)
  for lo, hi in spans:
    inside = [
      t
      for t, (start, end) in enumerate(offsets)
      if end > start and start < hi and end > lo  # tokens with characters in [lo, hi)
    ]
    if inside:
      mask[inside[0] : inside[-1] + 1] = [1.0] * (inside[-1] + 1 - inside[0])
  return mask
