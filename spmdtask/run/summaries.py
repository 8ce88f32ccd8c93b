"""TensorBoard scalars, written by process 0 only, through `spmdtask.fs` (local or gs://).

Train summaries go to `job_log_dir/summaries/train`. Events are TensorBoard's own
protos (`scalar_pb`, `Event`) framed by its `RecordWriter`; TensorFlow is not needed.
An event file is built in memory and written whole on each `flush` (GCS objects cannot
be appended to); past `max_file_bytes` the next flush starts a new file, so a flush
costs at most that much. TensorBoard reads every event file of a run dir in name order.
"""
import io
import itertools
import os
import socket
import time
from typing import Mapping

import jax

from spmdtask import fs

_serial = itertools.count()


def summary_dir(job_log_dir: str, name: str = "train") -> str:
  return fs.join(job_log_dir, "summaries", name)


class SummaryWriter:
  """Scalars per step into one TensorBoard run dir; a no-op off process 0 or without a dir.

  Args:
    directory: the run dir, e.g. `summary_dir(job_log_dir, 'train')`; None = no-op.
    max_file_bytes: an event file's size after which a new one is started.
  """

  def __init__(self, directory: str | None, max_file_bytes: int = 4 << 20):
    self._directory = directory if jax.process_index() == 0 else None
    self._max_bytes = max_file_bytes
    self._buffer = self._writer = self._path = None
    self._dirty = False

  @property
  def active(self) -> bool:
    return self._directory is not None

  def _start_file(self) -> None:
    # pylint: disable=g-import-not-at-top
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer import record_writer
    name = (f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}."
            f"{next(_serial)}.v2")
    self._path = fs.join(self._directory, name)
    self._buffer = io.BytesIO()
    self._writer = record_writer.RecordWriter(self._buffer)
    self._writer.write(event_pb2.Event(wall_time=time.time(),
                                       file_version="brain.Event:2").SerializeToString())

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    """Writes each `name: value` at `step` (buffered until `flush`)."""
    if not self.active:
      return
    # pylint: disable=g-import-not-at-top
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.scalar import summary_v2
    if self._writer is None:
      self._start_file()
    for name, value in values.items():
      event = event_pb2.Event(wall_time=time.time(), step=int(step),
                              summary=summary_v2.scalar_pb(name, float(value)))
      self._writer.write(event.SerializeToString())
    self._dirty = True

  def flush(self) -> None:
    """Writes the current event file (whole) to the run dir."""
    if not self._dirty:
      return
    fs.write_bytes(self._path, self._buffer.getvalue())
    self._dirty = False
    if self._buffer.tell() >= self._max_bytes:
      self._writer = self._buffer = None

  def close(self) -> None:
    self.flush()
    self._directory = self._writer = self._buffer = None
