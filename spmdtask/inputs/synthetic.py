"""A synthetic LM input: deterministic per (seed, step), each process making only its rows."""
import dataclasses

import jax
import numpy as np


def process_slice(batch_size: int, process_index: int | None = None,
                  process_count: int | None = None) -> tuple[int, int]:
  """Rows [lo, hi) of a global batch that this process feeds (contiguous, equal parts)."""
  index = jax.process_index() if process_index is None else process_index
  count = jax.process_count() if process_count is None else process_count
  local = batch_size // count
  return index * local, (index + 1) * local


@dataclasses.dataclass
class SyntheticLmInput:
  """Learnable token sequences: each row counts up from a random start by a random stride.

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
  """
  batch_size: int = 8
  seq_len: int = 64
  vocab_size: int = 256
  seed: int = 0
  num_batches: int | None = None
  num_examples: int | None = None
  process_index: int | None = None
  process_count: int | None = None

  def __post_init__(self):
    self._step = 0

  @property
  def local_batch_size(self) -> int:
    lo, hi = process_slice(self.batch_size, self.process_index, self.process_count)
    return hi - lo

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of global batch number `step`."""
    rows = np.arange(*process_slice(self.batch_size, self.process_index, self.process_count))
    if self.num_examples is not None:
      rows = rows[rows + step * self.batch_size < self.num_examples]
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

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self.num_batches is not None and self._step >= self.num_batches:
      raise StopIteration
    if self.num_examples is not None and self._step * self.batch_size >= self.num_examples:
      raise StopIteration
    batch = self.batch_at(self._step)
    self._step += 1
    return batch

  def get_state(self) -> dict[str, int]:
    """The iterator position, for checkpoints."""
    return {"step": self._step}

  def set_state(self, state: dict[str, int]) -> None:
    self._step = int(state["step"])
