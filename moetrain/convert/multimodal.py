"""Multimodal releases read as their language model: config.json's text_config, and the language
model's weights under the text model's names; the vision tower is skipped (the load names it).

Qwen3.5-MoE (`qwen3_5_moe`, transformers 5.24's Qwen3_5MoeForConditionalGeneration) keeps its
language model as model.language_model.* beside model.visual.*, its head as lm_head.weight.
Kimi-K2.5 and K2.6 (`kimi_k25`, the release's KimiK25ForConditionalGeneration) keep a DeepSeek-V3
model whole under language_model. (language_model.model.*, language_model.lm_head.weight)
beside vision_tower.* and mm_projector.*, its routed experts int4 as Kimi-K2-Thinking's
(compressed_int4.py). Exports write the language model alone, as its text family."""

from moetrain.convert import hybrid, standard


class NestedReader:
  """A checkpoint Reader whose tensors under `inner` read under the text model's names, `outer`
  in place of `inner`; the others (the vision tower's) keep theirs."""

  def __init__(self, reader, inner: str, outer: str):
    self.reader, self.directory = reader, reader.directory
    strip = lambda k: outer + k.removeprefix(inner) if k.startswith(inner) else k
    self.names = {strip(k): k for k in reader.keys()}  # text model's name -> stored name
    files = getattr(reader, 'files', None) or {}
    self.files = {n: files[k] for n, k in self.names.items() if k in files}

  def _stored(self, name: str) -> str:
    return self.names.get(name, name)

  def keys(self) -> list[str]:
    return list(self.names)

  def __contains__(self, name: str) -> bool:
    return name in self.names

  def shape(self, name: str) -> tuple[int, ...]:
    return self.reader.shape(self._stored(name))

  def dtype(self, name: str) -> str:
    return self.reader.dtype(self._stored(name))

  def path(self, name: str) -> str:
    return self.reader.path(self._stored(name))

  def read(self, name: str, index=None):
    return self.reader.read(self._stored(name), index)

  def read_int(self, name: str, index=None):
    return self.reader.read_int(self._stored(name), index)

  def read_stored(self, name: str, index=None):
    return self.reader.read_stored(self._stored(name), index)


class Multimodal:
  """A multimodal `model_type` read as its text_config, whose model_type is one of `text_types`,
  as the `text` family; its checkpoint's tensors under `inner` as the text model's (`outer` in
  place of `inner`). The rest is the text family's: the run's model_type is the text family's."""

  def __init__(self, model_type: str, text, text_types: tuple, inner: str, outer: str):
    self.model_type, self.text, self.text_types = model_type, text, text_types
    self.inner, self.outer = inner, outer

  def __getattr__(self, name):
    return getattr(self.text, name)

  def config_from_hf(self, c: dict) -> dict:
    text = c.get('text_config')
    if c.get('model_type') != self.model_type:
      raise ValueError(
        f'config.json model_type={c.get("model_type")!r}: expected {self.model_type!r}'
      )
    if not isinstance(text, dict) or text.get('model_type') not in self.text_types:
      raise ValueError(
        f'config.json ({self.model_type}) needs a text_config of model_type '
        f'{" or ".join(self.text_types)}'
      )
    return self.text.config_from_hf({**text, 'model_type': self.text.model_type})

  def nested(self, reader):
    """`reader` with the language model's tensors under the text model's names."""
    if not any(k.startswith(self.inner) for k in reader.keys()):
      return reader  # saved as the text model already
    return NestedReader(reader, self.inner, self.outer)


QWEN3_5_MOE = Multimodal(
  'qwen3_5_moe',
  hybrid.QWEN3_5_MOE_TEXT,
  ('qwen3_5_moe_text',),
  'model.language_model.',
  'model.',
)
# moonshotai/Kimi-K2.5 (and K2.6): Kimi-K2's language model (text_config model_type kimi_k2).
KIMI_K25 = Multimodal(
  'kimi_k25', standard.DEEPSEEK_V3, ('kimi_k2', 'deepseek_v3'), 'language_model.', ''
)

FAMILIES = {f.model_type: f for f in (QWEN3_5_MOE, KIMI_K25)}
