"""A synthetic LM input: deterministic per (seed, step), each process making only its rows."""
import dataclasses

import numpy as np

from spmdtask.core.host_input import StepIndexedInput


@dataclasses.dataclass
class SyntheticLmInput(StepIndexedInput):
  """Learnable token sequences: each row counts up from a random start by a random stride.

  With `target_mask`, each row instead packs conversation-like segments (`segment_ids`,
  `positions` restarting per segment, as packed data has them): a prompt, then an answer
  that counts on; only the answer's tokens are targets (weight 1), the prompt's and the
  padding's weigh 0, so rows hold very different target counts (supervised fine-tuning
  without a data dir).

  Attributes:
    batch_size: the GLOBAL batch size; each process yields its own contiguous
      slice of `batch_size // process_count` rows.
    seq_len: tokens per row.
    vocab_size: tokens are in [0, vocab_size).
    seed: with the step, fixes every row, whatever the process count.
    num_batches: None = endless; else the input ends after this many batches.
    num_examples: None = no limit; else rows (across batches) stop at this many, so
      the last batch may be partial: a process yields only its rows below the limit
      (possibly none). Evaluation pads such a batch and weights the padding 0.
    model: None, or the model fed (share task.model's config): its vocab_size is the rows' (not
      `vocab_size`): an import's model_overrides.txt then sets only the model's.
  """
  batch_size: int = 8
  seq_len: int = 64
  vocab_size: int = 256
  seed: int = 0
  num_batches: int | None = None
  num_examples: int | None = None
  target_mask: bool = False
  model: object | None = None
  process_index: int | None = None
  process_count: int | None = None

  def __post_init__(self):
    if self.model is not None:
      self.vocab_size = self.model.vocab_size

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of global batch number `step`."""
    rows = self.local_rows(step) - step * self.batch_size  # row numbers within the batch
    if self.target_mask:
      return _stack([_conversation_row(np.random.default_rng((self.seed, step, int(r))),
                                       self.seq_len, self.vocab_size) for r in rows],
                     self.seq_len)
    local = len(rows)
    # One generator per (seed, step, row): a row never depends on the process count.
    starts = np.empty(local, np.int64)
    strides = np.empty(local, np.int64)
    for i, row in enumerate(rows):
      g = np.random.default_rng((self.seed, step, int(row)))
      starts[i] = g.integers(0, self.vocab_size)
      strides[i] = g.integers(1, 8)
    pos = np.arange(self.seq_len + 1)
    tokens = (starts[:, None] + strides[:, None] * pos[None, :]) % self.vocab_size
    return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
            "weights": np.ones((local, self.seq_len), np.float32)}


def _conversation_row(g: np.random.Generator, seq_len: int, vocab: int) -> dict[str, np.ndarray]:
  """One row of segments (prompt, answer) until fewer than 4 tokens are left (padding)."""
  row = {k: np.zeros(seq_len, np.int32) for k in ("inputs", "targets", "segment_ids",
                                                   "positions")}
  row["weights"] = np.zeros(seq_len, np.float32)
  at, seg = 0, 1
  while seq_len - at >= 4:
    m = min(int(g.integers(6, max(7, seq_len // 2))), seq_len - at)
    prompt = int(g.integers(1, m - 1))  # tokens of the prompt; at least one answer token
    toks = (g.integers(0, vocab) + g.integers(1, 8) * np.arange(m + 1)) % vocab
    span = slice(at, at + m)
    row["inputs"][span], row["targets"][span] = toks[:-1], toks[1:]
    # Input i predicts token i + 1: a target where that token is the answer's; the
    # segment's last input predicts nothing (as packing's rows have it).
    row["weights"][span] = (np.arange(m) + 1 >= prompt) & (np.arange(m) < m - 1)
    row["segment_ids"][span], row["positions"][span] = seg, np.arange(m)
    at, seg = at + m, seg + 1
  return row


def _stack(rows: list[dict[str, np.ndarray]], seq_len: int) -> dict[str, np.ndarray]:
  keys = ("inputs", "targets", "weights", "segment_ids", "positions")
  return {k: (np.stack([r[k] for r in rows]) if rows else
              np.zeros((0, seq_len), np.float32 if k == "weights" else np.int32)) for k in keys}
