"""Host-fed inputs: each process's rows of the global batch, partial last batches, position."""
import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.core.host_input import Share, process_slice, reading
from spmdtask.inputs.prompts import SyntheticPromptInput
from spmdtask.inputs.synthetic import SyntheticLmInput


def test_process_slices_tile_the_batch():
  assert [process_slice(16, p, 4) for p in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_processes_together_yield_the_one_process_batch():
  whole = SyntheticLmInput(batch_size=8, seq_len=16, seed=3, process_index=0, process_count=1)
  parts = [SyntheticLmInput(batch_size=8, seq_len=16, seed=3, process_index=p, process_count=2)
           for p in range(2)]
  for step in (0, 5):
    np.testing.assert_array_equal(
        np.concatenate([p.batch_at(step)["inputs"] for p in parts]), whole.batch_at(step)["inputs"])
  assert not np.array_equal(whole.batch_at(0)["inputs"], whole.batch_at(1)["inputs"])


def test_partial_last_batch_and_end_of_input():
  inp = SyntheticLmInput(batch_size=8, seq_len=4, num_examples=20, process_index=1,
                         process_count=2)
  assert [len(b["inputs"]) for b in inp] == [4, 4, 0]  # rows 4-7, 12-15, none of 20-23
  prompts = SyntheticPromptInput(batch_size=8, num_examples=12, process_index=1, process_count=2)
  assert [b["ids"].tolist() for b in prompts] == [[4, 5, 6, 7], []]


def test_position_restores():
  a = SyntheticLmInput(batch_size=4, seq_len=8, process_index=0, process_count=1)
  for _ in range(3):
    next(a)
  b = SyntheticLmInput(batch_size=4, seq_len=8, process_index=0, process_count=1)
  b.set_state(a.get_state())
  assert b.get_state() == {"step": 3}
  np.testing.assert_array_equal(next(b)["inputs"], next(a)["inputs"])
