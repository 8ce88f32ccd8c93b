"""tf.data input: exact rows, each process reading only its share, restorable position, trains
in the loop."""
import subprocess
import sys

import numpy as np
import pytest

from spmdtask.errors import ConfigError
from spmdtask.inputs.tfdata import TfRecordLmInput, write_records
from tests import subproc

SEQ = 8


@pytest.fixture()
def records(tmp_path):
  seqs = [[(r * 7 + i) % 256 for i in range(SEQ + 1)] for r in range(40)]
  write_records(str(tmp_path / "a.tfrecord"), seqs[:20])
  write_records(str(tmp_path / "b.tfrecord"), seqs[20:])
  return str(tmp_path / "*.tfrecord"), np.asarray(seqs)


def test_batches_are_the_files_round_robin(records):
  pattern, seqs = records
  inp = TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, process_index=0, process_count=1)
  b0, b1 = next(inp), next(inp)
  np.testing.assert_array_equal(b0["inputs"], seqs[[0, 20, 1, 21], :-1])
  np.testing.assert_array_equal(b1["targets"], seqs[[2, 22, 3, 23], 1:])
  assert b0["weights"].shape == (4, SEQ) and b0["inputs"].dtype == np.int32
  assert inp.records_read == 8


@pytest.mark.parametrize("files,repeat,whole_files,read", [
    ("*", True, True, [6, 6]),      # 2 files, 2 processes: each opens only its own file
    ("a*", True, False, [6, 6]),    # 1 file: every 2nd record, the others' bytes skipped
    ("*", False, False, [11, 12]),  # finite: streams every record, parses its own
])
def test_each_process_feeds_its_rows_of_the_global_batch(records, files, repeat, whole_files,
                                                          read):
  pattern = records[0].replace("*", files)
  whole = TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, repeat=repeat,
                          process_index=0, process_count=1)
  halves = [TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, repeat=repeat,
                            process_index=p, process_count=2) for p in range(2)]
  assert [h.reads_whole_files() for h in halves] == [whole_files] * 2
  for _ in range(3):
    full = next(whole)["inputs"]
    for p, h in enumerate(halves):  # process p feeds global rows p, p+2, ...
      np.testing.assert_array_equal(next(h)["inputs"], full[p::2])
  assert [h.records_read for h in halves] == read and whole.records_read == 12


def test_a_process_never_opens_the_other_processes_files(tmp_path):
  """File sharding with the real reader: process 1's file is not a TFRecord file at all,
  and process 0 of 2 still reads all its batches; process 1 fails on its file."""
  seqs = [[r] * (SEQ + 1) for r in range(12)]
  write_records(str(tmp_path / "a.tfrecord"), seqs)
  (tmp_path / "b.tfrecord").write_bytes(b"not a tfrecord file" * 100)
  pattern = str(tmp_path / "*.tfrecord")
  mine = TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, process_index=0, process_count=2)
  assert [next(mine)["inputs"][:, 0].tolist() for _ in range(7)] == [
      [0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [0, 1]]
  theirs = TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, process_index=1,
                           process_count=2)
  with pytest.raises(Exception, match="corrupted|truncated|DataLoss"):
    next(theirs)


def test_batch_at_the_next_step_is_read_once(records):
  pattern, _ = records
  inp = TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, process_index=0, process_count=1)
  first = inp.batch_at(0)["inputs"]  # what set-up asks for
  np.testing.assert_array_equal(next(inp)["inputs"], first)
  next(inp)
  assert inp.records_read == 8


def test_batch_size_must_divide_over_the_processes(records):
  with pytest.raises(ConfigError, match="batch_size=6 does not divide over the 4 processes"):
    next(TfRecordLmInput(records[0], batch_size=6, seq_len=SEQ, process_index=0,
                         process_count=4))


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


def test_position_of_two_processes_resumes_on_one(records):
  pattern, _ = records
  ref = TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, process_index=0, process_count=1)
  expected = [next(ref)["inputs"] for _ in range(8)]
  two = [TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, process_index=p, process_count=2)
         for p in range(2)]
  for _ in range(5):
    for p in two:
      next(p)
  one = TfRecordLmInput(pattern, batch_size=4, seq_len=SEQ, process_index=0, process_count=1)
  one.set_state(two[0].get_state())
  for want in expected[5:]:
    np.testing.assert_array_equal(next(one)["inputs"], want)


def test_no_files_is_a_config_error(tmp_path):
  with pytest.raises(ConfigError, match="file_pattern=.*matches no file"):
    next(TfRecordLmInput(str(tmp_path / "none*"), batch_size=4, seq_len=SEQ))


def test_trains_from_files(tmp_path):
  import fiddle as fdl  # pylint: disable=g-import-not-at-top
  from spmdtask.run import loop  # pylint: disable=g-import-not-at-top
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


@pytest.mark.slow
def test_two_processes_read_their_files_and_train_like_one(tmp_path):
  """2 processes x 4 devices on 2 files: each reads only its file (the input's own count,
  logged at the last checkpoint) and the losses are those of 1 process x 8 devices."""
  import glob  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  from tests import subproc as h  # pylint: disable=g-import-not-at-top
  from tools import launch_local  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  seqs = [(s + d * np.arange(65)) % 256 for s, d in zip(rng.integers(0, 256, 96),
                                                          rng.integers(1, 8, 96))]
  for k in range(2):  # 2 x 48 records: 6 steps of 16 rows are one epoch
    write_records(str(tmp_path / f"part{k}.tfrecord"), seqs[k::2])
  # The model and settings of tests/run/test_distributed.py's jobs (its STEPS): their
  # programs (1 x 8 and 2 x 4 devices; batches of the same shapes) come from the persistent
  # XLA cache, built once for both files.
  sets = ("task.train.summary_interval_steps=1", "task.train.save_interval_steps=6",
          "task.train.log_interval_steps=2", "task.model.num_layers=1",
          "task.train.num_train_steps=6", "task.train.eval_interval_steps=0",
          f"datasets['train'].file_pattern='{tmp_path}/part*.tfrecord'")
  exp = "tests.registered_exps.TinyLmRecords"
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  r = h.run(h.main_cmd(exp, one, *sets, flags=["--verbosity=0"]))
  assert r.returncode == 0, r.stderr[-3000:]
  python, env = h.python(4)
  results = launch_local.launch(2, 4, h.main_cmd(exp, two, *sets, flags=["--verbosity=0"])[3:],
                                timeout=400, env=env, python=python)
  assert [res.returncode for res in results] == [0, 0], "\n".join(
      f"process {i}: {res.stderr[-3000:]}" for i, res in enumerate(results))
  logs = "".join(open(f).read() for job in (one, two)
                 for f in glob.glob(os.path.join(job, "logs", "*INFO*")))
  read = sorted(set(re.findall(
      r"process (\d) of (\d) at batch 6 has read (\d+) records \(([a-z ]+)\)",
      logs + "".join(res.stderr for res in (r, *results)))))
  print("records read by batch 6 (process, processes, records, how):", read)
  assert read == [("0", "1", "96", "its own files"), ("0", "2", "48", "its own files"),
                  ("1", "2", "48", "its own files")]
  want, got = h.train_losses(one), h.train_losses(two)
  print("losses 1 process", [want[s] for s in range(1, 7)], "2 processes",
        [got[s] for s in range(1, 7)])
  np.testing.assert_allclose([got[s] for s in range(1, 7)], [want[s] for s in range(1, 7)],
                             rtol=1e-5)


def test_tensorflow_is_imported_only_by_a_tf_data_input():
  """The experiments and the binary import no TensorFlow until a tf.data input is built."""
  code = ("import sys, configs.lm, configs.llama, configs.vit, spmdtask.main\n"
          "assert 'tensorflow' not in sys.modules\n"
          "from spmdtask.inputs import tfdata\n"
          "tfdata.write_records(sys.argv[1], [[1, 2, 3]])\n"
          "assert 'tensorflow' in sys.modules\n")
  out = subprocess.run([sys.executable, "-c", code, "/dev/null"], env=subproc.env(1),
                       cwd=subproc.REPO, capture_output=True, text=True, timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
