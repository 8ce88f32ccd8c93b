"""What each process of a multi-process MPMD job reads and places of a global batch.

A stage needs every microbatch, so a process reads every row of the global batch, but
only of the leaves its own stages' parts read (`Part.batch_leaves`): with stage 0 on
process 0 and the last stage on process 1, process 0 reads e.g. 'inputs', process 1
'targets' and 'weights'. Nothing is gathered between hosts. Inputs make whole rows (every
leaf of a row together), so `select` drops the leaves no stage of this process reads
before anything is placed; `describe` says what was read and what was kept (logged once
per program). A process that owns only middle stages reads nothing its stages use: it
reads its own 1/N share of rows (so its input keeps the job's position) and places
nothing.

  share(pipeline, microbatch, skip)  -> inputs.base.Share for this process
  select(local_batch, share, rows)   -> the batch with unread leaves None
  describe(local_batch, batch, share, rows, stages) -> the log line
"""
from typing import Any, Sequence

import jax
import numpy as np

from spmdtask.core.host_input import Share


def leaf_name(path) -> str:
  """A batch leaf's name: its key path, e.g. 'targets' (or 'images/pixels')."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def share(pipeline, microbatch, skip: Sequence[str] = ()) -> Share:
  """This process's share (module doc): one process, everything; else every row of the
  leaves of `microbatch` (the pipeline's microbatch tree) its stages' parts read, less
  `skip` (leaves the program makes itself, e.g. dropout keys)."""
  cross = pipeline.cross
  if not cross.multiprocess:
    return Share()
  names = [leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(microbatch)[0]]
  read = sorted({j for part in pipeline.parts if cross.local[part.stage]
                 for j in part.batch_leaves})
  leaves = tuple(names[j] for j in read if names[j] not in skip)
  return Share(0, 1, leaves) if leaves else Share(leaves=())


def select(local_batch, feed: Share, rows: int) -> Any:
  """Host arrays of the leaves `feed` names (every row of the global batch: `rows`), the
  other leaves None. ValueError when the input did not read every row."""
  if feed.leaves is None:
    return jax.tree.map(np.asarray, local_batch)
  keep = set(feed.leaves)
  out = jax.tree_util.tree_map_with_path(
      lambda p, x: np.asarray(x) if leaf_name(p) in keep else None, local_batch)
  got = {x.shape[0] for x in jax.tree.leaves(out)}
  if got - {rows}:
    raise ValueError(f"process {jax.process_index()} was given {sorted(got)} rows of the "
                     f"global batch for its stages, which need all {rows}: make the input "
                     "read inputs.base.reading(inputs, program.input_share()).")
  return out


def _rows_leaves(tree) -> tuple[int, int]:
  leaves = jax.tree.leaves(tree)
  return (leaves[0].shape[0] if leaves else 0), len(leaves)


def describe(local_batch, batch, feed: Share, rows: int, stages: Sequence[int]) -> str:
  """What this process read (`local_batch`, from its input) and placed (`batch`)."""
  (r_read, l_read), (r_kept, l_kept) = _rows_leaves(local_batch), _rows_leaves(batch)
  return (f"MPMD feed: process {jax.process_index()} of {jax.process_count()} (stages "
          f"{list(stages)}) reads {r_read} rows x {l_read} leaves of each global batch of "
          f"{rows} rows and places {r_kept} rows x {l_kept} leaves "
          f"({', '.join(feed.leaves or ())}) on its stages: {r_kept * l_kept} row-leaves a "
          "step, no host gather.")
