"""tf.data input: exact rows, per-process slices, restorable position, trains in the loop."""
import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.inputs.tfdata import TfRecordLmInput, write_records

SEQ = 8


@pytest.fixture()
def records(tmp_path):
  seqs = [[(r * 7 + i) % 256 for i in range(SEQ + 1)] for r in range(40)]
  write_records(str(tmp_path / "a.tfrecord"), seqs[:20])
  write_records(str(tmp_path / "b.tfrecord"), seqs[20:])
  return str(tmp_path / "*.tfrecord"), np.asarray(seqs)


def test_batches_are_records_in_order(records):
  pattern, seqs = records
  inp = TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, process_index=0, process_count=1)
  b0, b1 = next(inp), next(inp)
  np.testing.assert_array_equal(b0["inputs"], seqs[0:4, :-1])
  np.testing.assert_array_equal(b1["targets"], seqs[4:8, 1:])
  assert b0["weights"].shape == (4, SEQ) and b0["inputs"].dtype == np.int32


def test_each_process_feeds_its_rows(records):
  pattern, _ = records
  whole = TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, process_index=0, process_count=1)
  halves = [TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, process_index=p,
                            process_count=2) for p in range(2)]
  for _ in range(3):
    full = next(whole)["inputs"]
    np.testing.assert_array_equal(np.concatenate([next(h)["inputs"] for h in halves]), full)


def test_restored_position_continues_exactly(records):
  pattern, _ = records
  a = TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, process_index=0, process_count=1)
  expected = [next(a)["inputs"] for _ in range(13)]  # wraps around the 40 records
  b = TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, process_index=0, process_count=1)
  for _ in range(5):
    next(b)
  c = TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, process_index=0, process_count=1)
  c.set_state(b.get_state())
  for want in expected[5:]:
    np.testing.assert_array_equal(next(c)["inputs"], want)
  np.testing.assert_array_equal(c.batch_at(12)["inputs"], expected[12])


def test_no_files_is_a_config_error(tmp_path):
  with pytest.raises(ConfigError, match="file_pattern=.*matches no file"):
    next(TfRecordLmInput(str(tmp_path / "none*"), batch_size=4, seq_len=SEQ))


def test_trains_from_files(tmp_path):
  import fiddle as fdl  # pylint: disable=g-import-not-at-top
  from spmdtask import loop  # pylint: disable=g-import-not-at-top
  from tests import util  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  seqs = [(s + 3 * np.arange(65)) % 256 for s in rng.integers(0, 256, 256)]
  write_records(str(tmp_path / "train.tfrecord"), seqs)

  def edit(cfg):
    cfg.datasets["train"] = fdl.Config(TfRecordLmInput, str(tmp_path / "*.tfrecord"),
                                       batch_size=16, seq_len=64)
  run = util.build_run("lm.TinyLm", ["task.model.num_layers=1", "task.train.num_train_steps=12"],
                       edit)
  _, _, losses = loop.train(run)
  assert len(losses) == 12 and losses[-1] < losses[0] - 1.0
