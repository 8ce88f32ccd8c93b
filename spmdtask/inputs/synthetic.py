"""A synthetic LM input: deterministic per (seed, step), each process making only its rows."""
import dataclasses

import numpy as np

from spmdtask.core.host_input import StepIndexedInput


@dataclasses.dataclass
class SyntheticLmInput(StepIndexedInput):
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

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of global batch number `step`."""
    rows = self.local_rows(step) - step * self.batch_size  # row numbers within the batch
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
