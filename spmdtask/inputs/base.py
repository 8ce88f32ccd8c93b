"""What host-fed inputs share: this process's rows of a global batch, and a restorable position."""
import jax
import numpy as np


def process_slice(batch_size: int, process_index: int | None = None,
                  process_count: int | None = None) -> tuple[int, int]:
  """Rows [lo, hi) of a global batch that this process feeds (contiguous, equal parts)."""
  index = jax.process_index() if process_index is None else process_index
  count = jax.process_count() if process_count is None else process_count
  local = batch_size // count
  return index * local, (index + 1) * local


def num_batches(inputs) -> int | None:
  """Batches in a finite input (its `num_batches` / `num_examples` fields); None if endless."""
  counts = []
  if getattr(inputs, "num_batches", None) is not None:
    counts.append(int(inputs.num_batches))
  if getattr(inputs, "num_examples", None) is not None:
    counts.append(-(-int(inputs.num_examples) // int(inputs.batch_size)))
  return min(counts) if counts else None


class StepIndexedInput:
  """An input whose batch number `step` is a pure function `batch_at(step)`.

  Iteration and its checkpointable position (`get_state` / `set_state`) follow from that.
  Subclasses are dataclasses with `batch_size` (global), `process_index`,
  `process_count` and optional `num_examples` (rows in all) / `num_batches`.
  """
  _step = 0

  def _where(self) -> tuple[int, int]:
    """(this process's index, the process count)."""
    return (jax.process_index() if self.process_index is None else self.process_index,
            jax.process_count() if self.process_count is None else self.process_count)

  @property
  def local_batch_size(self) -> int:
    lo, hi = process_slice(self.batch_size, self.process_index, self.process_count)
    return hi - lo

  def local_rows(self, step: int) -> np.ndarray:
    """Global row numbers of batch `step` fed by this process (fewer in a partial last batch)."""
    rows = step * self.batch_size + np.arange(
        *process_slice(self.batch_size, self.process_index, self.process_count))
    limit = getattr(self, "num_examples", None)
    return rows if limit is None else rows[rows < limit]

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    total = num_batches(self)
    if total is not None and self._step >= total:
      raise StopIteration
    batch = self.batch_at(self._step)
    self._step += 1
    return batch

  def get_state(self) -> dict[str, int]:
    """The iterator position (batches consumed), for checkpoints."""
    return {"step": self._step}

  def set_state(self, state: dict[str, int]) -> None:
    self._step = int(state["step"])
