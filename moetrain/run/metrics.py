"""Throughput, MFU and MoE routing statistics, and the writers (stdout, JSONL, TensorBoard)."""

import contextlib
import functools
import json
import math
import os
import secrets
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from moetrain.core import runtime, storage
from moetrain.model.config import ModelConfig

# Dense bf16 peak FLOP/s per device, by jax device_kind prefix.
PEAK_FLOPS = {
  'TPU v4': 275e12,
  'TPU v5 lite': 197e12,
  'TPU v5e': 197e12,
  'TPU v5p': 459e12,
  'TPU v5': 459e12,
  'TPU v6 lite': 918e12,
  'TPU v6e': 918e12,
  'NVIDIA H100': 989e12,  # SXM
  'NVIDIA H100 PCIe': 756e12,  # the longest matching prefix wins
  'NVIDIA H200': 989e12,
  'NVIDIA A100': 312e12,
  'NVIDIA L4': 121e12,
}


def peak_flops(device) -> float | None:
  kind = getattr(device, 'device_kind', '')
  for prefix, flops in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
    if kind.startswith(prefix):
      return flops
  return None


def attention_params(cfg: ModelConfig) -> int:
  """Weights of one attention block (MLA or GQA)."""
  d, n = cfg.hidden_size, cfg.num_heads
  if cfg.attention == 'gqa':
    h = cfg.gqa_head_dim
    return d * n * h + 2 * d * cfg.kv_heads * h + n * h * d
  q_rank, qk = cfg.q_lora_rank, cfg.qk_head_dim
  q = d * q_rank + q_rank * n * qk if q_rank else d * n * qk
  return (
    q
    + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    + cfg.kv_lora_rank * n * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    + n * cfg.v_head_dim * d
  )


def matmul_params_per_token(cfg: ModelConfig, ffn_experts: float) -> float:
  """Weights each token multiplies (lm_head included, embedding lookup excluded), with
  ffn_experts routed experts per MoE layer."""
  d = cfg.hidden_size
  attn, mlp = attention_params(cfg), 3 * d * cfg.ffn_hidden_size
  expert = 3 * d * cfg.expert_ffn_hidden_size
  moe = d * cfg.num_experts_total + ffn_experts * expert + 3 * d * cfg.shared_width
  if cfg.layer_layout == 'shortcut':  # 2 attention + 2 dense MLP + 1 MoE
    layers = cfg.num_layers * (2 * attn + 2 * mlp + moe)
  else:
    n_moe = cfg.num_moe_layers
    layers = cfg.num_layers * attn + n_moe * moe + (cfg.num_layers - n_moe) * mlp
  return layers + d * cfg.vocab_size


def flops_per_token(
  cfg: ModelConfig, seq_len: int, ffn_experts: float, train: bool = True
) -> float:
  """6 * params for forward+backward matmuls, plus causal attention scores and values (half the
  T x T square is computed usefully; under DeepSeek Sparse Attention the selected keys), plus
  the sparse attention indexer's scoring (indexer_flops_per_token)."""
  mult = 6 if train else 2
  attention = attention_params_equivalent(cfg, seq_len)
  return mult * (matmul_params_per_token(cfg, ffn_experts) + attention) + indexer_flops_per_token(
    cfg, seq_len, train
  )


def mean_keys(cfg: ModelConfig, seq_len: int) -> float:
  """Keys a query of a causal row of T tokens attends to, on average: T / 2, or under DeepSeek
  Sparse Attention (cfg.index_n_heads) the mean of min(p, index_topk) over positions p = 1..T."""
  t, k = seq_len, cfg.index_topk
  if not cfg.index_n_heads or t <= k:
    return t / 2
  return (k * (k + 1) / 2 + (t - k) * k) / t


def attention_params_equivalent(cfg: ModelConfig, seq_len: int) -> float:
  """Causal attention's scores and values per token, as a count of weights with the same FLOPs
  (2 per multiply-add): each head of each attention block multiplies its (d_qk + d_v) features
  with mean_keys keys (T / 2 dense)."""
  heads = cfg.attention_blocks * cfg.num_heads * (cfg.qk_head_dim + cfg.value_head_dim)
  return heads * mean_keys(cfg, seq_len)


def indexer_flops_per_token(cfg: ModelConfig, seq_len: int, train: bool = True) -> float:
  """The lightning indexer's scoring per token (DeepSeek Sparse Attention; 0 without): each
  block's N_i heads multiply their H_i features with T / 2 keys on average and weigh the heads'
  scores (N_i multiply-adds a key), 2 FLOPs each. Forward only when frozen (its input is
  detached: no backward reaches it); x 3 when loss.indexer_kl trains it. Its projections'
  weights are in matmul_params_per_token."""
  if not cfg.index_n_heads:
    return 0.0
  per_key = cfg.index_n_heads * (cfg.index_head_dim + 1)
  fwd = 2 * cfg.attention_blocks * per_key * seq_len / 2
  return fwd * (3 if train and cfg.train_indexer else 1)


ROUTING_STATS = (
  'ffn_experts_mean',
  'ffn_experts_std',
  'dropped_frac',
  'router_entropy',
  'router_z_loss',
  'balance_loss',
)


def load_imbalance(load, n_routed: int, expert_shards: int) -> dict:
  """Per layer, from expert loads [L, E+Z] (numpy or jax): the busiest FFN expert's load over the
  mean, and the busiest expert shard's over the mean (what expert parallelism waits on)."""
  xp = jnp if isinstance(load, jax.Array) else np
  ffn = load[:, :n_routed]
  shards = ffn.reshape(ffn.shape[0], expert_shards, -1).sum(-1)
  ratio = lambda a: a.max(-1) / xp.maximum(a.mean(-1), 1e-9)
  return {'expert_max_over_mean': ratio(ffn), 'shard_imbalance': ratio(shards)}


def routing_summary(moe: dict, cfg: ModelConfig, expert_shards: int) -> dict:
  """Host-side scalars from the per-layer stats (arrays [L, ...] over the MoE layers): each
  statistic per layer (moe/layer{l}/..., l the decoder layer's index: DeepSeek-V3's first MoE
  layer is layer3) and its mean over layers (moe/...). The load imbalance comes with the stats
  when a Window averaged it over steps; otherwise it is taken from these loads. The load
  histogram itself is written separately (Writer.write's load)."""
  load = np.asarray(moe['load'], np.float64)  # [L, E+Z]
  per_layer = {k: np.asarray(moe[k], np.float64).reshape(-1) for k in ROUTING_STATS}
  for k, v in load_imbalance(load, cfg.n_routed_experts, expert_shards).items():
    per_layer[k] = np.asarray(moe.get(k, v), np.float64).reshape(-1)
  out = {f'moe/{k}': float(np.mean(v)) for k, v in per_layer.items()}
  for k, v in per_layer.items():
    out.update({f'moe/layer{layer}/{k}': float(x) for layer, x in zip(cfg.moe_layer_indices, v)})
  return out


TOKEN_WEIGHTED = ('loss', 'accuracy')  # per scored token over the window
LAST_VALUE = ('learning_rate', 'skipped', 'loss_scale')  # as of the window's last step


class Window:
  """The train metrics of the steps since the last log, accumulated on the device as the steps
  are dispatched (nothing is fetched) and reported as one record of the whole window: loss and
  accuracy per scored token, the learning rate, skipped count and loss scale as of the last step,
  and the rest (gradient norm, auxiliary losses, routing statistics, each step's load imbalance,
  the expert loads) as means per step. A log every N steps says what the N steps did, not only
  what the last one did. Steps whose loss or gradient norm was not finite (skipped updates) are
  left out of the means; a window of only such steps reports the last one as it was."""

  def __init__(self, n_routed: int, expert_shards: int):
    full = functools.partial(_with_imbalance, n_routed=n_routed, expert_shards=expert_shards)
    self._jits = (
      jax.jit(lambda m: _weigh(full(m))),
      jax.jit(lambda acc, m: jax.tree.map(jnp.add, acc, _weigh(full(m)))),
      jax.jit(lambda acc, last: _window_mean(acc, full(last))),
    )
    self._fns = None
    self.acc, self.last, self.steps = None, None, 0

  def add(self, m: dict) -> None:
    if self._fns is None:  # all three compiled at the first step: its time is kept apart
      start, add, mean = self._jits
      acc = jax.eval_shape(start, m)
      self._fns = (
        start.lower(m).compile(),
        add.lower(acc, m).compile(),
        mean.lower(acc, m).compile(),
      )
    start, add, _ = self._fns
    self.acc = start(m) if self.acc is None else add(self.acc, m)
    self.last, self.steps = m, self.steps + 1

  def take(self) -> dict:
    """The window's record (device arrays), and a new window."""
    out = self._fns[2](self.acc, self.last)
    self.acc, self.last, self.steps = None, None, 0
    return out


def _with_imbalance(m: dict, *, n_routed: int, expert_shards: int) -> dict:
  """A step's metrics with its load imbalance (load_imbalance of its expert loads)."""
  moe = m['moe']
  imbalance = load_imbalance(moe['load'].astype(jnp.float32), n_routed, expert_shards)
  return {**m, 'moe': {**moe, **imbalance}}


def finite_step(m: dict) -> jax.Array:
  """Whether a step's update was applied: the train step skips one whose loss (auxiliary losses
  included) or gradient norm is not finite."""
  return jnp.isfinite(m['total_loss']) & jnp.isfinite(m['grad_norm'])


def _weigh(m: dict) -> dict:
  """One step's contribution: its values where it was finite, else zeros; `finite` counts it."""
  finite = finite_step(m)
  w = {**m, **{k: m[k] * m['tokens'] for k in TOKEN_WEIGHTED}}
  w = jax.tree.map(lambda v: jnp.where(finite, v, 0).astype(jnp.float32), w)
  return {**w, 'finite': finite.astype(jnp.float32)}


def _window_mean(acc: dict, last: dict) -> dict:
  acc = dict(acc)
  n = acc.pop('finite')
  out = jax.tree.map(lambda v: v / jnp.maximum(n, 1.0), acc)
  out.update({k: acc[k] / jnp.maximum(acc['tokens'], 1.0) for k in TOKEN_WEIGHTED})
  # No finite step: the last one as it was (its non-finite loss or norm says why).
  out = jax.tree.map(lambda v, x: jnp.where(n > 0, v, x.astype(jnp.float32)), out, last)
  return {**out, **{k: last[k].astype(jnp.float32) for k in LAST_VALUE if k in last}}


def _parses(line: bytes) -> bool:
  try:
    json.loads(line)
    return True
  except ValueError:
    return False


def repair_jsonl(path: str) -> int:
  """Mends what a kill left of metrics.jsonl's end, so that a resumed run's records start on a
  line of their own: a last record that lost only its newline gets it back; one cut short (or
  bytes that are no JSON) is dropped. Returns the bytes dropped. Records are written and
  flushed a line at a time, so only the end can be cut."""
  if not storage.isfile(path):
    return 0
  with storage.open(path, 'rb') as f:
    data = f.read()
  fixed = data
  if fixed and not fixed.endswith(b'\n'):
    start = fixed.rfind(b'\n') + 1
    fixed = fixed + b'\n' if _parses(fixed[start:]) else fixed[:start]
  while fixed and not _parses(fixed[fixed.rfind(b'\n', 0, len(fixed) - 1) + 1 :]):
    fixed = fixed[: fixed.rfind(b'\n', 0, len(fixed) - 1) + 1]
  if fixed == data:
    return 0
  dropped = max(len(data) - len(fixed), 0)
  logging.warning('%s: mended its cut end (%d bytes dropped) before resuming', path, dropped)
  storage.write_atomic(path, fixed)
  return dropped


class Writer:
  """Progress lines, <workdir>/metrics.jsonl and TensorBoard events (tensorboardX, no TF)."""

  def __init__(
    self,
    workdir: str,
    enabled: bool = True,
    resume_step: int | None = None,
    moe_layers: tuple[int, ...] | None = None,
    wandb: dict | None = None,
  ):
    """moe_layers: the decoder index of each row of the expert loads (ModelConfig.
    moe_layer_indices; default 0, 1, ...), which names their histograms.
    resume_step: the checkpoint step a resumed run goes on from. Steps after it that an
    interrupted run logged are redone: TensorBoard hides its events past that step (purge_step),
    and metrics.jsonl, which keeps them, gets a {'kind': 'resume', 'step': S} record that marks
    where the records start over. A rerun of a run killed before its first checkpoint starts
    over from step 0: it is marked the same way.
    wandb: {'project', 'entity', 'config'} to send the scalars to Weights & Biases as well
    (WandbRun)."""
    self.enabled = enabled and jax.process_index() == 0
    self.workdir, self.moe_layers = workdir, moe_layers
    self._jsonl = self._tb = self._wandb = None
    self._step, self._stdout_closed = 0, False
    if self.enabled:
      storage.makedirs(workdir)
      path = storage.join(workdir, 'metrics.jsonl')
      if resume_step is None and storage.isfile(path) and storage.getsize(path):
        resume_step = 0
      if resume_step is not None:
        repair_jsonl(path)
      self._jsonl = storage.AppendLog(path)
      # TensorBoard's writer starts with the first event: a run that fails before it (a
      # checkpoint or teacher that does not load) leaves none behind, whose exit-time cleanup
      # would print a traceback after the error ("can't create new thread at interpreter
      # shutdown").
      self._purge = None if resume_step is None else resume_step + 1
      if resume_step is not None:
        self._record({'step': resume_step, 'kind': 'resume', 'time': time.time()})
      if wandb and wandb.get('project'):
        self._wandb = WandbRun(workdir, **wandb)

  def _board(self):
    if self._tb is None:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(storage.join(self.workdir, 'tb'), purge_step=self._purge)
    return self._tb

  def _record(self, record: dict) -> None:
    # Standard JSON has no NaN or infinity: a non-finite value (a skipped step's loss, the rate
    # of a log point with no timed step) is written as null.
    finite = {
      k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in record.items()
    }
    self._step = record['step']
    self._jsonl.write(json.dumps(finite, allow_nan=False) + '\n')
    self._jsonl.flush()

  def write(self, step: int, scalars: dict, load=None, kind: str = 'train') -> None:
    if not self.enabled:
      return
    record = {'step': step, 'kind': kind, 'time': time.time(), **scalars}
    if load is not None:
      record['moe/load'] = np.asarray(load).round(3).tolist()
    self._record(record)
    prefix = '' if kind == 'train' else f'{kind}/'
    finite = {
      prefix + k: v
      for k, v in scalars.items()
      if isinstance(v, (int, float)) and math.isfinite(v)  # (the JSONL record keeps the rest)
    }
    for k, v in finite.items():
      self._board().add_scalar(k, v, step)
    if self._wandb is not None:
      self._wandb.log(finite, step)
    if load is not None:
      rows = np.asarray(load, np.float64)
      for layer, row in zip(self.moe_layers or range(len(rows)), rows):
        self._add_counts(f'moe/load_layer{layer}', row, step)

  def _add_counts(self, tag: str, counts, step: int) -> None:
    """A histogram over expert ids from their counts (one bucket per expert), without expanding
    every assignment into a sample."""
    ids = np.arange(len(counts), dtype=np.float64)
    used = np.nonzero(counts)[0]
    if not len(used):
      return
    self._board().add_histogram_raw(
      tag,
      min=float(used[0]),
      max=float(used[-1]),
      num=float(counts.sum()),
      sum=float(ids @ counts),
      sum_squares=float((ids * ids) @ counts),
      bucket_limits=(ids + 0.5).tolist(),
      bucket_counts=counts.tolist(),
      global_step=step,
    )

  def save_config(self, text: str) -> None:
    """<workdir>/config.json, replaced atomically (other hosts may be reading the old one)."""
    if self.enabled:
      storage.write_atomic(storage.join(self.workdir, 'config.json'), text)

  def flush(self) -> None:
    """Persists the records so far: metrics.jsonl in a bucket is otherwise rewritten at most
    every 30 s (storage.AppendLog), TensorBoard's events every 2 minutes."""
    if self.enabled:
      self._jsonl.flush(force=True)
      if self._tb is not None:
        self._tb.flush()

  def progress(self, line: str) -> None:
    """A progress line on stdout (once: not also through absl, which writes to stderr). Once
    stdout's reader has gone (`| tee` ended by the Ctrl-C that stops the run), metrics.jsonl
    says so and takes the lines: {'kind': 'stdout_closed'}, then {'kind': 'message', 'text'}."""
    if not self.enabled:
      return
    print(line, flush=True)
    if 'stdout' not in runtime.closed_output():
      return
    if not self._stdout_closed:
      self._stdout_closed = True
      self._record({'step': self._step, 'kind': 'stdout_closed', 'time': time.time()})
    self._record({'step': self._step, 'kind': 'message', 'time': time.time(), 'text': line})

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()
      if self._wandb is not None:
        self._wandb.close()


class WandbRun:
  """The run's scalars in Weights & Biases, one W&B run per run directory: its id is kept in
  <workdir>/wandb_run_id, so a resumed run goes on logging into the same W&B run. (W&B keeps a
  step's first values: steps a resumed run redoes after an interrupted one logged them are
  dropped there, with its warning; metrics.jsonl keeps both.) W&B's own files go into the run
  directory, or ~/.cache/moetrain/wandb for a gs:// one."""

  ID_FILE = 'wandb_run_id'

  def __init__(self, workdir: str, project: str, entity: str = '', config: dict | None = None):
    import wandb

    id_path = storage.join(workdir, self.ID_FILE)
    run_id = storage.read_text(id_path).strip() if storage.exists(id_path) else None
    run_id = run_id or secrets.token_hex(6)
    local = storage.absolute(workdir)
    if storage.is_url(workdir):
      local = os.path.expanduser('~/.cache/moetrain/wandb')
    os.makedirs(local, exist_ok=True)
    self.run = wandb.init(
      project=project,
      entity=entity or None,
      id=run_id,
      resume='allow',
      name=workdir.rstrip('/').rsplit('/', 1)[-1],
      dir=local,
      config=config,
    )
    storage.write_atomic(id_path, run_id)

  def log(self, scalars: dict, step: int) -> None:
    self.run.log(scalars, step=step)

  def close(self) -> None:
    self.run.finish()


class Throughput:
  """Tokens per second between log points and the ETA of the run. A log point is timed when its
  step has finished (its metrics fetched), not when it was dispatched: the host may run several
  steps ahead of the device before the first log."""

  def __init__(self, start_step: int, total_steps: int):
    self.start_step, self.total = start_step, total_steps
    self.t_start = self.t_last = time.time()
    self.tokens = 0.0

  def add_tokens(self, n: float) -> None:
    self.tokens += n

  @contextlib.contextmanager
  def excluded(self, when: bool = True, recurring: bool = False):
    """Keeps the time of the block (compilation, an eval) out of tokens/s; out of the ETA too,
    unless `recurring` (periodic evals: the rest of the run pays for them as well)."""
    t0 = time.time()
    yield
    if when:
      spent = time.time() - t0
      self.t_last += spent
      if not recurring:
        self.t_start += spent

  def skip_step(self) -> None:
    """The step just run (inside `excluded`, its tokens not added) stays out of the ETA's mean
    step time too: the run's first, whose compute overlaps its compilation."""
    self.start_step += 1

  def take_tokens(self) -> float:
    """The tokens since the last call: a log point's, taken when its step is dispatched."""
    tokens, self.tokens = self.tokens, 0.0
    return tokens

  def mark(self, step: int, tokens: float | None = None) -> tuple[float, float]:
    """(tokens/s, ETA) at a log point, called once `step` has finished; `tokens` (default: all
    added since the last mark) are those of the steps up to it."""
    now = time.time()
    tokens = self.take_tokens() if tokens is None else tokens
    tps = tokens / max(now - self.t_last, 1e-9) if tokens else math.nan  # (only skipped steps)
    counted = step - self.start_step
    eta = (now - self.t_start) / counted * (self.total - step) if counted > 0 else math.nan
    self.t_last = now
    return tps, eta


def format_eta(seconds: float) -> str:
  if math.isnan(seconds):  # no step timed yet
    return '-'
  seconds = int(max(seconds, 0))
  return f'{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}'
