"""TensorBoard scalars via `tf.summary`, written by process 0 only.

Train summaries go to `job_log_dir/summaries/train`. TensorFlow is imported only
when a writer is created on process 0, and in a background thread (it takes
seconds; the train step compiles meanwhile); other processes never load it.
"""
import importlib
import os
import threading
from typing import Mapping

import jax


def summary_dir(job_log_dir: str, name: str = "train") -> str:
  return os.path.join(job_log_dir, "summaries", name)


class SummaryWriter:
  """Scalars per step into one TensorBoard run dir; a no-op off process 0 or without a dir.

  Args:
    directory: the run dir, e.g. `summary_dir(job_log_dir, 'train')`; None = no-op.
  """

  def __init__(self, directory: str | None):
    self._writer, self._directory, self._import = None, directory, None
    if directory is not None and jax.process_index() == 0:
      os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
      self._import = threading.Thread(target=importlib.import_module, args=("tensorflow",),
                                      daemon=True)
      self._import.start()

  @property
  def active(self) -> bool:
    return self._import is not None

  def _get(self):
    if self._writer is None and self._import is not None:
      self._import.join()
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
      tf.config.set_visible_devices([], "GPU")  # TF must not take accelerator memory.
      self._tf = tf
      self._writer = tf.summary.create_file_writer(self._directory)
    return self._writer

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    """Writes each `name: value` at `step` (buffered until `flush`)."""
    if self._get() is None:
      return
    with self._writer.as_default(step=int(step)):
      for name, value in values.items():
        self._tf.summary.scalar(name, float(value))

  def flush(self) -> None:
    if self._writer is not None:
      self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
    self._writer, self._import = None, None
