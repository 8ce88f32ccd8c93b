"""tf.data input over TFRecord files of token sequences; each process reads only its share.

Records are `tf.train.Example`s with one int64 feature `tokens` of length seq_len + 1
(write them with `write_records`). For text corpora see `text.PackedLmInput`.

The global record order is the sorted files taken round robin (one record of each file in
turn; a file that has ended drops out), repeated. Global batch `b` is records
[b·B, (b+1)·B) of that order; process p of N feeds its records b·B + p + N·j (j < B/N),
so every process count trains on the same global batches (rows grouped by process).

What a process reads:
- files: when the input repeats and N divides the number of files, process p opens only
  files p, p+N, p+2N, ... and takes them round robin: exactly its records when the files
  hold equal record counts (as `write_records` shards do); otherwise still each record
  once per epoch per process, but no longer the 1-process order.
- records: otherwise every process opens every file and keeps every N-th record
  (`Dataset.shard`): with one file tf.data skips the others' records without reading their
  bytes; with several, every record is read and only this process's are parsed. A finite pass (`repeat=False`) always uses this mode and ends, on every process,
  after the last full global batch.
`records_read` counts the records this process took off its readers to make the batches
it handed out (read-ahead not yet handed out excluded); a finite pass counts every record
it streamed.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from typing import TYPE_CHECKING, Iterable, Sequence

import jax
import numpy as np
from absl import logging

from spmdtask import fs
from spmdtask.errors import ConfigError

if TYPE_CHECKING:
  import tensorflow as tf


def tensorflow():
  """TensorFlow, imported on first use: only a tf.data input needs it (seconds of start-up
  and its own console output that a synthetic-data run should not pay for).

  Without Keras: spmdtask uses tf.data and TFRecords, never tf.keras, and TensorFlow 2.21's
  import loads Keras 3 (and through it scikit-learn) unless TF_USE_LEGACY_KERAS is set: 9.2 ->
  5.9 s of CPU a process here. So it is set to 1 unless the environment sets it (with
  tf_keras not installed, a later `tf.keras` in the same process then fails: set
  TF_USE_LEGACY_KERAS=0 for that)."""
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top,redefined-outer-name
  return tf


def write_records(path: str, sequences: Iterable[Sequence[int]],
                  masks: Iterable[Sequence[int]] | None = None) -> int:
  """Writes token sequences as TFRecord Examples (with an int64 `mask` feature of the same
  length beside `tokens` when `masks` are given); returns how many."""
  tf, n = tensorflow(), 0
  int64s = lambda v: tf.train.Feature(int64_list=tf.train.Int64List(value=list(v)))
  with tf.io.TFRecordWriter(path) as writer:
    for seq, mask in zip(sequences, itertools.repeat(None) if masks is None else masks):
      feature = {"tokens": int64s(seq)}
      if mask is not None:
        feature["mask"] = int64s(mask)
      writer.write(tf.train.Example(features=tf.train.Features(feature=feature))
                   .SerializeToString())
      n += 1
  return n


def _round_robin(files: list[str]) -> tf.data.Dataset:
  """The files' records, one of each file in turn (a single file is read as is)."""
  tf = tensorflow()
  if len(files) == 1:
    return tf.data.TFRecordDataset(files[0])
  return tf.data.Dataset.from_tensor_slices(files).interleave(
      tf.data.TFRecordDataset, cycle_length=len(files), block_length=1)


@dataclasses.dataclass
class TfRecordLmInput:
  """Next-token batches from TFRecord files (see the module doc for who reads what).

  Attributes:
    file_pattern: glob of TFRecord files.
    batch_size: the GLOBAL batch size; a multiple of the process count.
    seq_len: tokens per row; records hold seq_len + 1 tokens.
    repeat: loop over the files forever; else stop after the last full global batch.
    process_index, process_count: default to jax's.
  """
  file_pattern: str
  batch_size: int = 8
  seq_len: int = 64
  repeat: bool = True
  process_index: int | None = None
  process_count: int | None = None

  def __post_init__(self):
    self._step = 0
    self._it = None
    self._peeked = None  # (step, batch) read by batch_at, handed out by the next `next`
    self.records_read = 0

  def _where(self) -> tuple[int, int, int]:
    """(process index, process count, rows per process)."""
    index = jax.process_index() if self.process_index is None else self.process_index
    count = jax.process_count() if self.process_count is None else self.process_count
    if self.batch_size % count:
      raise ConfigError(f"datasets[...].batch_size={self.batch_size} does not divide over the "
                        f"{count} processes of this job; make it a multiple of {count}.")
    return index, count, self.batch_size // count

  def _files(self) -> list[str]:
    files = sorted(fs.glob(self.file_pattern))  # the bytes: tf.data (TensorFlow's gs:// client)
    if not files:
      raise ConfigError(f"datasets[...].file_pattern={self.file_pattern!r} matches no file. "
                        "Point it at TFRecord files of token sequences.")
    return files

  def reads_whole_files(self) -> bool:
    """Whether this process opens only its own files (else it keeps every N-th record)."""
    _, count, _ = self._where()
    return self.repeat and len(self._files()) % count == 0

  def _dataset(self, skip: int) -> tf.data.Dataset:
    """This process's local batches from global batch `skip` on, as (read counts, tokens)."""
    tf = tensorflow()
    index, count, local = self._where()
    files = self._files()
    # `enumerate` numbers the records as they come off the reader (0-based), so a batch
    # carries how many records this stream had read when it was made.
    if self.reads_whole_files():
      ds = _round_robin(files[index::count]).repeat().enumerate()
    elif self.repeat and len(files) == 1:  # shard on the reader: the others' bytes are skipped
      ds = _round_robin(files).repeat().shard(count, index).enumerate()
    elif self.repeat:  # the interleave reads every record; this process parses its own
      ds = _round_robin(files).repeat().enumerate().shard(count, index)
    else:  # whole global batches only, so every process ends at the same batch
      ds = (_round_robin(files).enumerate().batch(self.batch_size, drop_remainder=True)
            .unbatch().shard(count, index))
    spec = {"tokens": tf.io.FixedLenFeature([self.seq_len + 1], tf.int64)}
    return ds.map(lambda n, r: (n, tf.io.parse_single_example(r, spec)["tokens"])).batch(
        local, drop_remainder=True).skip(skip).prefetch(2)

  def _to_batch(self, numbered_tokens, count: bool = True) -> dict[str, np.ndarray]:
    numbers, tokens = numbered_tokens
    if count:  # the training stream's reads (not those of a look-up of another step)
      self.records_read = int(numbers.max()) + 1
    tokens = tokens.astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": np.ones(tokens[:, 1:].shape, np.float32)}

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of global batch `step`. When `step` is the next batch to be
    iterated, the iterator reads it and hands it out next, so it is read once."""
    if self._it is None and step == self._step:
      self._it = self._dataset(step).as_numpy_iterator()
      self._peeked = (step, self._to_batch(next(self._it)))
      return self._peeked[1]
    return self._to_batch(next(iter(self._dataset(step).take(1).as_numpy_iterator())),
                          count=False)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._peeked is not None and self._peeked[0] == self._step:
      batch = self._peeked[1]
    else:
      if self._it is None:
        self._it = self._dataset(self._step).as_numpy_iterator()
      batch = self._to_batch(next(self._it))
    self._peeked = None
    self._step += 1
    return batch

  def get_state(self) -> dict[str, int]:
    """The iterator position (global batches consumed), for checkpoints."""
    index, count, _ = self._where()
    logging.info("TfRecordLmInput %s: process %d of %d at batch %d has read %d records (%s).",
                 self.file_pattern, index, count, self._step, self.records_read,
                 "its own files" if self.reads_whole_files() else "every N-th record")
    return {"step": self._step}

  def set_state(self, state: dict[str, int]) -> None:
    self._step, self._it, self._peeked = int(state["step"]), None, None
