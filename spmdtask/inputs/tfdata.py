"""tf.data input over TFRecord files of token sequences; each process reads only its rows.

Records are `tf.train.Example`s with one int64 feature `tokens` of length seq_len + 1
(write them with `write_records`). For text corpora see `text.PackedLmInput`.
Global batch `b` is records [b·B, (b+1)·B) in file order; process p keeps rows
[p·B/N, (p+1)·B/N) of it, so every process count sees the same global batches.
"""
import dataclasses
from typing import Iterable, Sequence

import numpy as np
import tensorflow as tf

from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.inputs.base import process_slice


def write_records(path: str, sequences: Iterable[Sequence[int]]) -> int:
  """Writes token sequences as TFRecord Examples; returns how many."""
  n = 0
  with tf.io.TFRecordWriter(path) as writer:
    for seq in sequences:
      feature = {"tokens": tf.train.Feature(int64_list=tf.train.Int64List(value=list(seq)))}
      writer.write(tf.train.Example(features=tf.train.Features(feature=feature))
                   .SerializeToString())
      n += 1
  return n


@dataclasses.dataclass
class TfRecordLmInput:
  """Next-token batches from TFRecord files.

  Attributes:
    file_pattern: glob of TFRecord files, read in sorted order.
    batch_size: the GLOBAL batch size.
    seq_len: tokens per row; records hold seq_len + 1 tokens.
    repeat: loop over the files forever; else stop after the last full batch.
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

  def _dataset(self, skip: int) -> tf.data.Dataset:
    files = fs.glob(self.file_pattern)  # the bytes: tf.data (TensorFlow's gs:// client)
    if not files:
      raise ConfigError(f"datasets[...].file_pattern={self.file_pattern!r} matches no file. "
                        "Point it at TFRecord files of token sequences.")
    spec = {"tokens": tf.io.FixedLenFeature([self.seq_len + 1], tf.int64)}
    ds = tf.data.TFRecordDataset(files).map(lambda r: tf.io.parse_single_example(r, spec)["tokens"])
    if self.repeat:
      ds = ds.repeat()
    lo, hi = process_slice(self.batch_size, self.process_index, self.process_count)
    return ds.batch(self.batch_size, drop_remainder=True).skip(skip).map(
        lambda t: t[lo:hi]).prefetch(2)

  def _to_batch(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
    tokens = tokens.astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": np.ones(tokens[:, 1:].shape, np.float32)}

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of global batch `step` (reads from the start; for set-up)."""
    return self._to_batch(next(iter(self._dataset(step).take(1).as_numpy_iterator())))

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._it is None:
      self._it = self._dataset(self._step).as_numpy_iterator()
    batch = self._to_batch(next(self._it))
    self._step += 1
    return batch

  def get_state(self) -> dict[str, int]:
    """The iterator position (global batches consumed), for checkpoints."""
    return {"step": self._step}

  def set_state(self, state: dict[str, int]) -> None:
    self._step, self._it = int(state["step"]), None
