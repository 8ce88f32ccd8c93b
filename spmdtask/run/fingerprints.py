"""Fingerprints of a checkpoint's arrays: 64 bits per array of its logical values.

A fingerprint is computed on the devices, in one jitted program over the whole tree, from the
arrays' bits alone: each element's bits (bitcast to an unsigned integer) are mixed with its
global flat index, and the mixed words are summed with wrapping uint32 addition, in two lanes:

    h_i = fmix32(bits_i ^ (i * 0x9E3779B9))      lane 0 = sum h_i,  lane 1 = sum h_i * (2i + 1)

Integer addition mod 2^32 is associative and commutative, so the partial sums of any sharding,
device count, process count or reduction order add up to the same numbers: a checkpoint saved
from 8 devices with FSDP and restored onto 1 device gives equal fingerprints for equal values.
fmix32 (MurmurHash3's finalizer) is a bijection, so a change to any one element always changes
lane 0; each word depends on the element's position too, so values moved elsewhere show; random
damage to many elements goes unseen with a chance of about 2^-64. A check of the bytes, not a
cryptographic hash.

Why not a checksum in the storage format: orbax 0.12 writes zarr3's crc32c only over a
shard's index, not its chunks, and zarr v2 (its default, every existing checkpoint) has none.
A fingerprint of the logical values also survives any re-sharding, and proves what the
devices held, not only what reached the disk.

The checkpoint's `meta` item stores them as {"item/array/path": "<16 hex digits>"}; a restore
recomputes them from the restored arrays and compares (`mismatch`).
"""
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec

from spmdtask.core import mesh as mesh_lib, sharding

KEY = "fingerprints"  # where the `meta` item holds them

_GOLDEN = np.uint32(0x9E3779B9)


def _fmix32(h: jax.Array) -> jax.Array:
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _bits(x: jax.Array) -> jax.Array:
  """The element bits as uint32 (an 8-byte dtype gives a trailing dim of 2 words)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  width = x.dtype.itemsize
  if width == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * width}")).astype(jnp.uint32)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
  """Each element's row-major index in the global array, mod 2^32."""
  index, stride = jnp.zeros(shape, jnp.uint32), 1
  for dim in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride)
    stride = stride * shape[dim] % 2**32
  return index


def _lanes(x: jax.Array, offset=0) -> jax.Array:
  """The two lanes of `x`, whose first word sits at flat word index `offset` of its array
  (a slice of it: the lanes of an array's slices add up to its own)."""
  bits = _bits(x)
  index = _flat_index(bits.shape) + jnp.asarray(offset, jnp.uint32)
  h = _fmix32(bits ^ (index * _GOLDEN))
  return jnp.stack([jnp.sum(h, dtype=jnp.uint32),
                    jnp.sum(h * (index * np.uint32(2) + np.uint32(1)), dtype=jnp.uint32)])


@functools.lru_cache(maxsize=None)
def _program(mesh):
  """One jitted program: every leaf's two lanes, stacked [n, 2], replicated on `mesh`. Each
  leaf is hashed as `mesh_lib.spread` lays it out (the static `spreads`): a replicated array
  is summed in parts by the devices that hold it, not whole by each."""
  def lanes(leaves, spreads):
    return jnp.stack([_lanes(x if s is None else jax.lax.with_sharding_constraint(x, s))
                      for x, s in zip(leaves, spreads)])
  return jax.jit(lanes, static_argnums=1, out_shardings=NamedSharding(mesh, PartitionSpec()))


def named(items: dict, is_leaf=None) -> list[tuple[str, Any]]:
  """("item/array/path", leaf) of every leaf of `items` ({item name: tree}), in flattening
  order: the names checkpoints key their arrays' fingerprints and blocks by."""
  return [(f"{item}/{sharding.path_str(path)}", x) for item, tree in items.items()
          for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]


def of(items: dict, mesh) -> dict[str, str]:
  """{"item/array/path": 16 hex digits} for every array of `items` ({item name: tree of
  global jax.Arrays on `mesh`}). Every process calls it (one program over all devices)."""
  named_arrays = named(items)
  if not named_arrays:
    return {}
  leaves = tuple(x for _, x in named_arrays)
  lanes = np.asarray(_program(mesh)(leaves, tuple(mesh_lib.spread(x) for x in leaves)))
  return {name: f"{int(a):08x}{int(b):08x}" for (name, _), (a, b) in zip(named_arrays, lanes)}


def of_blocks(shape: tuple[int, ...], blocks) -> str:
  """`of`'s fingerprint of an array of `shape` given as `blocks`, (start index, block)
  pairs covering it, each block contiguous in the array and hashed on its own (one in
  memory at a time: a streamed write, `run.streamed_checkpoint`)."""
  total = np.zeros(2, np.uint64)
  for start, x in blocks:
    x = jnp.asarray(x)
    words = 2 if x.dtype.itemsize == 8 else 1  # `_bits`' words per element
    first = int(np.ravel_multi_index(start, shape)) if shape else 0
    lanes = _slice_lanes(x, np.uint32(first * words % 2**32))
    total = (total + np.asarray(lanes, np.uint64)) % 2**32
  return f"{int(total[0]):08x}{int(total[1]):08x}"


_slice_lanes = jax.jit(_lanes)


def mismatch(stored: dict[str, str], restored: dict[str, str]) -> str | None:
  """None when every restored array's fingerprint equals the stored one; else the sentence
  naming the arrays that differ (for the damaged-checkpoint paragraph)."""
  bad = [name for name in sorted(restored) if name in stored and stored[name] != restored[name]]
  if not bad:
    return None
  more = f" (and {len(bad) - 1} more array{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
  logging.info("Fingerprint mismatches (saved, restored): %s",
               {name: (stored[name], restored[name]) for name in bad})
  return (f"the array {bad[0]}{more} does not hold the values it was saved with (its "
          "fingerprint, taken on the devices at the save, differs: its bytes changed after the "
          "save, e.g. on a disk, in a bucket or in a copy)")
