"""A step-0 checkpoint written one slice of one array at a time: an import of a model too
big to hold in host memory (`hf.jobs.imports`: a 70B's weights are 140 GB in bf16).

The checkpoint is the one `checkpoints.Checkpointer` writes (the same items, `meta` and
fingerprints; restores cannot tell them apart); only the writing differs. Each param is a
`Streamed` array, whose slices (one HF tensor each) are read, converted, hashed and
written one after another, and dropped; the fresh optimizer state is streamed the same way,
each slice computed on its own, when the optimizer's init does not read the weights'
values (optax's adamw, adafactor, sgd, lion, ...: zeros and counts). One whose init does
(an average of the weights, say) is built whole on the devices, as a run's first step
builds it.

Host memory holds one HF tensor, its float32 conversion and its stored cast at a time;
the file system's page cache holds what it likes of the HF files (read by mmap).
"""
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend import core as jax_core
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint import future
from orbax.checkpoint._src.serialization import ocdbt_utils, tensorstore_utils, type_handlers

from spmdtask.run import checkpoint_io as io
from spmdtask.run import fingerprints

Blocks = Iterator[tuple[tuple[int, ...], np.ndarray]]
BLOCK_BYTES = 64 << 20  # a computed array's blocks (fewer device calls and writes)


@dataclasses.dataclass(frozen=True)
class Streamed:
  """An array of `shape` and `dtype` given by `blocks()`: (start, block) pairs covering
  it, `start` the block's first index in every dim, each block contiguous in the array
  (whole in every dim after its first) and made when the iteration reaches it. `chunk`:
  the blocks' shape, the stored chunks' (so a block's write never rewrites another's)."""
  shape: tuple[int, ...]
  dtype: np.dtype
  chunk: tuple[int, ...]
  blocks: Callable[[], Blocks]


class _StreamedHandler(type_handlers.NumpyHandler):
  """orbax's numpy array writer, fed one block at a time: the arrays are written in
  turn, each block awaited before the next is made. Its metadata calls it a numpy array
  (`typestr`), so every reader reads it as one."""

  async def serialize(self, values, infos, args=None):
    args = args or [ocp.SaveArgs()] * len(values)
    return [future.CommitFutureAwaitingContractedSignals(
        self._write(values, infos, args), name="spmdtask_streamed")]

  async def _write(self, values, infos, args):
    for value, info, arg in zip(values, infos, args):
      await info.await_path_creation()
      spec = tensorstore_utils.build_array_write_spec(
          info=info, arg=arg, global_shape=value.shape, local_shape=value.chunk,
          dtype=np.dtype(value.dtype), use_ocdbt=info.is_ocdbt_checkpoint,
          process_index=ocdbt_utils.get_process_index_for_subdir(
              use_ocdbt=info.is_ocdbt_checkpoint))
      t = await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
      for start, x in value.blocks():
        await t[tuple(slice(i, i + n) for i, n in zip(start, x.shape))].write(x)


ocp.type_handlers.register_type_handler(Streamed, _StreamedHandler(), override=True)


def cast(x: Streamed, dtype) -> Streamed:
  """`x` with each block cast to `dtype` as it is made."""
  dtype = np.dtype(dtype)
  return Streamed(x.shape, dtype, x.chunk,
                  lambda: ((i, b.astype(dtype)) for i, b in x.blocks()))


def fresh_opt_state(program) -> Any | None:
  """The canonical fresh optimizer state of `program` as `Streamed` arrays (each slice
  along dim 0 computed on its own device program), or None when `program.tx`'s init reads
  the weights' values (then nothing short of the whole weights makes it)."""
  params = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype),
                        program.canonical_targets().params)
  if init_reads_weights(program.tx, params):
    return None

  def init_leaf(i):  # the weights' values unread (checked above): zeros stand in
    zeros = jax.tree.map(lambda p: jax.numpy.zeros(p.shape, p.dtype), params)
    return jax.tree.leaves(program.tx.init(zeros))[i]

  shapes = jax.eval_shape(program.tx.init, params)
  leaves, treedef = jax.tree.flatten(shapes)
  return jax.tree.unflatten(treedef, [_computed(init_leaf, i, x) for i, x in enumerate(leaves)])


def _computed(init_leaf, i: int, like) -> Streamed | np.ndarray:
  row_bytes = like.dtype.itemsize * int(np.prod(like.shape[1:]))
  rows = min(like.shape[0], max(1, BLOCK_BYTES // max(1, row_bytes))) if like.ndim else 0
  if like.ndim == 0:
    return np.asarray(jax.jit(lambda: init_leaf(i))())
  # A block of rows of the leaf, computed alone (XLA folds the slice into its broadcast).
  block = jax.jit(lambda r, n: jax.lax.dynamic_slice_in_dim(init_leaf(i), r, n),
                  static_argnums=1)
  def blocks():
    for r in range(0, like.shape[0], rows):
      n = min(rows, like.shape[0] - r)
      yield (r,) + (0,) * (like.ndim - 1), np.asarray(block(r, n))
  return Streamed(tuple(like.shape), np.dtype(like.dtype), (rows,) + tuple(like.shape[1:]),
                  blocks)


def init_reads_weights(tx, params) -> bool:
  """Whether `tx.init`'s state depends on the values of `params` (ShapeDtypeStructs):
  its jaxpr's equations walked in order, a nested call counted as reading all of its
  operands."""
  jaxpr = jax.make_jaxpr(tx.init)(params).jaxpr
  read = set(jaxpr.invars)
  for eqn in jaxpr.eqns:
    if any(v in read for v in eqn.invars if not isinstance(v, jax_core.Literal)):
      read.update(eqn.outvars)
  return any(v in read for v in jaxpr.outvars if not isinstance(v, jax_core.Literal))


def fingerprint(x) -> str:
  """`fingerprints.of`'s fingerprint of a `Streamed` or numpy array, a slice at a time."""
  if isinstance(x, Streamed):
    return fingerprints.of_blocks(x.shape, x.blocks())
  return fingerprints.of_blocks(np.shape(x), [((0,) * np.ndim(x), np.asarray(x))])


def write(directory: str, arrays: dict, meta: dict) -> None:
  """Step 0 of the checkpoint dir `directory`: `arrays` ({"params": tree, "opt_state":
  tree} of `Streamed` or numpy arrays, canonical and in the stored dtypes) and `meta`
  (which must already hold their fingerprints); empty `inputs`. Returns once committed."""
  mngr = ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(create=True),
      item_handlers={**{k: ocp.PyTreeCheckpointHandler() for k in io.ARRAY_ITEMS},
                     **{k: ocp.JsonCheckpointHandler() for k in io.JSON_ITEMS}})
  try:
    mngr.save(0, args=ocp.args.Composite(
        **{k: ocp.args.PyTreeSave(arrays[k]) for k in io.ARRAY_ITEMS},
        inputs=ocp.args.JsonSave({}), meta=ocp.args.JsonSave(meta)), force=True)
    mngr.wait_until_finished()
  finally:
    mngr.close()


def fingerprinted(arrays: dict) -> dict[str, str]:
  """{"item/array/path": fingerprint} of `write`'s `arrays` (every slice made once)."""
  return {name: fingerprint(x) for name, x in fingerprints.named(
      arrays, is_leaf=lambda x: isinstance(x, Streamed))}
