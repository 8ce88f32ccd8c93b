"""What host-fed inputs share: this process's rows of a global batch, and a restorable position.

Which rows a process reads is the program's call (`Program.input_share()`): SPMD programs
take each process's 1/N share of the rows (the default); a multi-process MPMD program has
each process read every row of the leaves its own stages consume. `reading(inputs, share)`
gives the input that reads a share: every input is a dataclass with `process_index` and
`process_count` fields (None = jax's), and a share only sets those.
"""
import dataclasses
from typing import Any, Iterator, Protocol, runtime_checkable

import jax
import numpy as np

from spmdtask.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Share:
  """The part of each global batch one process reads.

  process_index, process_count: the contiguous rows `process_slice` gives; None = this
    process's own 1/N share (jax's index and count); (0, 1) = every row.
  leaves: the leaves (`jax.tree_util.keystr(path, simple=True, separator='/')`, e.g.
    'targets') this process's programs take; None = all. An input may skip the others;
    the program drops any others before placing the batch.
  """
  process_index: int | None = None
  process_count: int | None = None
  leaves: tuple[str, ...] | None = None


@runtime_checkable
class PromptInput(Protocol):
  """A decode dataset (`--mode=decode`): prompts, and how their token ids read as text.

  batch_size: the GLOBAL batch size; local_batch_size: this process's rows of it.
  tokenizer: an object with `decode(ids) -> str`, and `encode(text) -> ids` for --prompt
    texts; None when the data has none (decode output then holds token ids only).
  batch_at(i): this process's rows of batch i, `{'prompts': [b, prompt_len] int32
    (left-aligned, 0-padded), 'prompt_lens': [b] int32, 'ids': [b] int32 (example ids)}`;
    iterating gives the batches in order and ends (`StepIndexedInput` gives both).
  """
  batch_size: int
  tokenizer: Any

  @property
  def local_batch_size(self) -> int: ...

  def batch_at(self, step: int) -> dict[str, np.ndarray]: ...

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]: ...


def reading(inputs, share: Share):
  """`inputs` made to read `share`'s rows: itself when it already does (always for the
  default share), else a copy with the share's process_index / process_count (read from
  the start: do this before restoring its position)."""
  if share.process_index is None and share.process_count is None:
    return inputs
  names = {f.name for f in dataclasses.fields(inputs)} if dataclasses.is_dataclass(inputs) else ()
  if not {"process_index", "process_count"} <= set(names):
    raise ConfigError(
        f"datasets[...] is a {type(inputs).__name__}, which this program cannot ask for rows "
        f"{share.process_index} of {share.process_count} (a multi-process MPMD pipeline has "
        "each process read every row of the leaves its stages consume): make the input a "
        "dataclass with `process_index` and `process_count` fields, like "
        "spmdtask.inputs.synthetic.SyntheticLmInput.")
  if (inputs.process_index, inputs.process_count) == (share.process_index,
                                                      share.process_count):
    return inputs
  return dataclasses.replace(inputs, process_index=share.process_index,
                             process_count=share.process_count)


def reading_all(datasets: dict, share: Share) -> dict:
  """Every input of `datasets` reading `share` (`reading`)."""
  return {name: reading(inputs, share) for name, inputs in datasets.items()}


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
  whole = batches_of_examples(inputs)
  if whole is not None:
    counts.append(whole)
  return min(counts) if counts else None


def batches_of_examples(inputs) -> int | None:
  """Batches that one pass over all of an input's examples takes (its `num_examples`
  field, whatever caps how many are read); None where it does not say."""
  if getattr(inputs, "num_examples", None) is None:
    return None
  return -(-int(inputs.num_examples) // int(inputs.batch_size))


def empty(inputs) -> bool:
  """Whether an input has nothing to read (its `empty` attribute; False where it has none):
  --mode=eval then sets its program up with an eval batch instead of the train input's."""
  return bool(getattr(inputs, "empty", False))


def target_masked(inputs) -> bool:
  """Whether a train input's batches weight only target tokens (supervised fine-tuning:
  `weights` 1 on the tokens to learn, e.g. assistant turns, 0 on prompts): its
  `target_mask` attribute (False where it has none). Read once at the start of a run."""
  return bool(getattr(inputs, "target_mask", False))


class StepIndexedInput:
  """An input whose batch number `step` is a pure function `batch_at(step)`.

  Iteration and its checkpointable position (`get_state` / `set_state`) follow from that.
  Subclasses are dataclasses with `batch_size` (global), `process_index`,
  `process_count` and optional `num_examples` (rows in all) / `num_batches`. An input
  whose weights mark target tokens only sets `target_mask` True (`target_masked`).
  """
  _step = 0
  target_mask = False

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
