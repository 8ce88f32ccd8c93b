"""What each process of a multi-process MPMD job reads and keeps of a global batch."""
import numpy as np
import pytest

from spmdtask.core.host_input import Share, reading
from spmdtask.errors import ConfigError
from spmdtask.inputs.synthetic import SyntheticLmInput
from spmdtask.pipeline.mpmd import feed


def test_a_share_of_every_row_reads_the_global_batch_and_select_keeps_its_leaves():
  half = SyntheticLmInput(batch_size=8, seq_len=4, seed=5, process_index=1, process_count=2)
  assert reading(half, Share()) is half  # the default share: the input as it is
  share = Share(0, 1, ("targets", "weights"))
  whole = reading(half, share)
  assert (whole.process_index, whole.process_count, whole.local_batch_size) == (0, 1, 8)
  batch = whole.batch_at(2)
  np.testing.assert_array_equal(batch["targets"][4:], half.batch_at(2)["targets"])
  kept = feed.select(batch, share, rows=8)
  assert kept["inputs"] is None and [kept[k].shape for k in share.leaves] == [(8, 4)] * 2
  with pytest.raises(ValueError, match="rows of the global batch"):
    feed.select(half.batch_at(2), share, rows=8)  # only this process's 4 rows
  with pytest.raises(ConfigError, match="process_index"):
    reading(iter([]), share)
