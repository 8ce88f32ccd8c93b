"""Arrays between MPMD stages owned by different processes, through XLA collectives.

With several processes (`--num_processes`), every stage's submesh lies inside one process
and a process runs only the programs of the stages it owns. What one stage makes and
another needs crosses processes with collectives over the devices of both:

  move(x, aval, spec, a, b)   stage a -> stage b. Equal device counts: the "pair mesh"
      stacks b's devices, arranged like a's submesh, under a new axis `_pair` (a = 0,
      b = 1); x's first dim is split over `_pair` too, so each device's block is exactly
      its shard of x. A jitted shard_map `ppermute` 0 -> 1 sends every shard to its mirror
      device. The sender passes x's shards, the receiver zeros; the receiver rebuilds x
      from its blocks, in x's layout on its own devices (like the one-process
      `Pipeline._send`). Cost: each shard crosses once (x's bytes in all).
      Different device counts (e.g. 2 and 6): no device mirrors another, so x goes as a
      sum over a 1-D mesh of the devices of both stages (`_union`), where only a's first
      device holds x and every other device zeros (exact: x + 0 + ...); the result is
      replicated on every device of both, and the receiver keeps it replicated on its
      submesh (its program re-splits it locally). Cost: one all-reduce of the whole of x
      over na + nb devices (about 2·|x| bytes through each device) and a full copy of x
      on each of b's devices, against |x| in all for the equal-count ppermute.
  broadcast(tree, a, shapes)  stage a -> every device: a jitted sum over a 1-D mesh of all
      devices where only a's first device holds the value (exact: x + 0 + ...), replicated
      on every device, so every process can read it (metrics, the step, checkpoints).

Both processes call each collective at the same point of one global order (the
pipeline's linearized schedule, then the train step's fixed sequence); a collective waits
only on values made earlier in that order, so the collectives match and none deadlocks.

Why a collective and not `jax.experimental.transfer`: both are JAX's own machinery and a
TransferServer starts on CPU here, but pulling needs server addresses and transfer ids
exchanged between the processes for every array, while the collective is matched by the
schedule order the processes already share, and runs wherever multi-process collectives
run (gloo on CPU, checked: the ppermute moves the shards bit-exactly).

Within one process (every stage local) `move` is not used: `copy` moves arrays between
submeshes (`put` through it).
"""
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdtask.core import steps
from spmdtask.errors import ConfigError

try:  # the device-to-device copy jax.device_put itself ends in (jax 0.10's array.py)
  from jax._src.lib import xla_client as _xc
  _batched_copy = _xc.batched_copy_array_to_devices_with_sharding
  _REUSE = _xc.ArrayCopySemantics.REUSE_INPUT
except (ImportError, AttributeError):  # another jaxlib: jax.device_put only
  _batched_copy = None

PAIR, ALL = "_pair", "_all"


def same_layout(src, dst: NamedSharding) -> bool:
  """Whether `dst` is `src`'s layout on other devices of this process: the same
  PartitionSpec over a mesh of the same shape and axes (or both replicated), as many
  devices, the same memory kind. Then every shard of an array has its twin on dst."""
  if not (isinstance(src, NamedSharding) and src.num_devices == dst.num_devices and
          src.memory_kind == dst.memory_kind and src.is_fully_addressable and
          dst.is_fully_addressable):
    return False
  if src.is_fully_replicated and dst.is_fully_replicated:
    return True
  return (src.spec == dst.spec and src.mesh.axis_names == dst.mesh.axis_names and
          src.mesh.devices.shape == dst.mesh.devices.shape)


def copy(xs: Sequence[jax.Array], dsts: Sequence[NamedSharding]) -> list[jax.Array]:
  """Each x to dsts[i], which the caller checked is x's layout on other devices
  (`same_layout`, once per pair of shardings): one batched, asynchronous shard-by-shard
  copy. jax.device_put makes the same call after per-array checks and a primitive bind,
  which cost 3-4x the copy's host time on this path (the MPMD runner sends on every action)."""
  if _batched_copy is None:
    return list(jax.device_put(list(xs), list(dsts), may_alias=True))
  return _batched_copy(list(xs), [d._internal_device_list for d in dsts],  # pylint: disable=protected-access
                       list(dsts), [_REUSE] * len(xs))


def owned_stages(meshes: Sequence[Mesh]) -> tuple[bool, ...]:
  """Per stage: whether this process owns it. ConfigError if a submesh spans processes."""
  out = []
  for s, mesh in enumerate(meshes):
    procs = sorted({d.process_index for d in mesh.devices.flat})
    if len(procs) > 1:
      raise ConfigError(
          f"The submesh of MPMD stage {s} spans processes {procs}: with several processes each "
          "stage must lie on the devices of one process. Make task.pipeline.submesh_shapes "
          "follow the process boundaries (e.g. one stage of jax.local_device_count() devices "
          "per process).")
    out.append(procs[0] == jax.process_index())
  return tuple(out)


def _pair_spec(spec: P) -> P:
  first = spec[0] if len(spec) else None
  first = () if first is None else first if isinstance(first, tuple) else (first,)
  return P((PAIR,) + first, *spec[1:])


class Cross:
  """The stages' submeshes, which of them this process owns, and the collectives between
  them (module doc). Programs and zero blocks are cached per layout."""

  def __init__(self, meshes: Sequence[Mesh], compile_only: bool = False):
    self.meshes = tuple(meshes)
    # Compile-only devices (a TPU topology's, planned ahead of time) belong to no process.
    self.local = (False,) * len(self.meshes) if compile_only else owned_stages(self.meshes)
    self.multiprocess = not all(self.local)
    self.all_mesh = Mesh(np.array([d for m in self.meshes for d in m.devices.flat]), (ALL,))
    self._cache = {}

  def _cached(self, key, make):
    if key not in self._cache:
      self._cache[key] = make()
    return self._cache[key]

  # ---- stage -> stage ----------------------------------------------------------------

  def move(self, x, aval, spec: P, a: int, b: int):
    """x (on stage a in NamedSharding(mesh_a, spec); None where a is not local) -> on b's
    devices arranged like a's mesh, same spec (different device counts: replicated on
    b's submesh), on b's process; None elsewhere."""
    local_a, local_b = self.local[a], self.local[b]
    if not (local_a or local_b):
      return None
    src = self.meshes[a]
    if local_a and local_b:
      return jax.device_put(x, NamedSharding(self._mirror(a, b), spec))
    if src.size != self.meshes[b].size:
      y = self._sum_from(x, a, aval, self._union(a, b))
      return self.localize(y, self.meshes[b]) if local_b else None
    shape = tuple(aval.shape) or (1,)
    gshape = (2 * shape[0],) + shape[1:]
    pair = self._cached(("pair", a, b), lambda: Mesh(
        np.stack([src.devices, self._mirror(a, b).devices]), (PAIR,) + src.axis_names))
    gspec = _pair_spec(spec)
    gsharding = NamedSharding(pair, gspec)
    if local_a:
      x = jax.device_put(x, NamedSharding(src, spec))
      blocks = [s.data for s in (x.reshape(shape) if not aval.shape else x).addressable_shards]
    else:
      blocks = self._cached(("zeros", a, b, shape, aval.dtype, gspec), lambda: [
          jnp.zeros(gsharding.shard_shape(gshape), aval.dtype, device=d)
          for d in self._mirror(a, b).devices.flat])
    send = self._cached(("ppermute", a, b, gspec), lambda: steps.partition(
        jax.shard_map(lambda blk: jax.lax.ppermute(blk, PAIR, [(0, 1)]), mesh=pair,
                      in_specs=gspec, out_specs=gspec), pair, gspec, gspec))
    y = send(jax.make_array_from_single_device_arrays(gshape, gsharding, blocks))
    if not local_b:
      return None
    got = {s.device: s.data for s in y.addressable_shards}
    mirror = self._mirror(a, b)
    out = jax.make_array_from_single_device_arrays(
        shape, NamedSharding(mirror, spec), [got[d] for d in mirror.devices.flat])
    return out if aval.shape else out.reshape(())

  def put(self, x, aval, a: int, b: int, spec_a: P = P(), spec_b: P | None = None):
    """x (on stage a as spec_a) -> NamedSharding(mesh_b, spec_b or spec_a) on b's process;
    None elsewhere."""
    dst = self._cached(("put", b, spec_a, spec_b), lambda: NamedSharding(
        self.meshes[b], spec_a if spec_b is None else spec_b))
    if self.local[a] and self.local[b]:
      if self._cached(("same", x.sharding, dst), lambda: same_layout(x.sharding, dst)):
        return copy([x], [dst])[0]
      return jax.device_put(x, dst)
    y = self.move(x, aval, spec_a, a, b)
    return None if y is None else jax.device_put(y, dst)

  def _mirror(self, a: int, b: int) -> Mesh:
    """Stage b's devices arranged as stage a's mesh (same axes)."""
    src, dst = self.meshes[a], self.meshes[b]
    return self._cached(("mirror", a, b), lambda: Mesh(
        dst.devices.reshape(src.devices.shape), src.axis_names, axis_types=src.axis_types))

  # ---- stage -> every process --------------------------------------------------------

  def broadcast(self, tree, a: int, shapes):
    """`tree` (on stage a; None where a is not local) -> the same values replicated on
    every device (`all_mesh`, P()), readable by every process. `shapes`: its avals."""
    return self._sum_from(tree, a, shapes, self.all_mesh)

  def _union(self, a: int, b: int) -> Mesh:
    """A 1-D mesh of stage a's devices, then b's."""
    return self._cached(("union", a, b), lambda: Mesh(np.array(
        [d for s in (a, b) for d in self.meshes[s].devices.flat]), (ALL,)))

  def _sum_from(self, tree, a: int, shapes, mesh: Mesh):
    """`tree` (on stage a; None where a is not local) -> replicated on every device of
    `mesh` (a 1-D mesh over a's devices and others): a jitted sum over `mesh` of blocks
    where only a's first device holds the values and every other device zeros. Every
    process with a device in `mesh` calls it."""
    leaves, treedef = jax.tree.flatten(shapes)
    xs = jax.tree.leaves(tree) if self.local[a] else [None] * len(leaves)
    first = self.meshes[a].devices.flat[0]
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    n = mesh.size
    arrays = []
    for x, aval in zip(xs, leaves):
      blocks = []
      for d in mine:
        if d == first:
          blocks.append(jax.device_put(x, d).reshape((1,) + tuple(aval.shape)))
        else:
          blocks.append(self._cached(("zero1", d, tuple(aval.shape), aval.dtype), lambda: jnp.zeros(
              (1,) + tuple(aval.shape), aval.dtype, device=d)))
      arrays.append(jax.make_array_from_single_device_arrays(
          (n,) + tuple(aval.shape), NamedSharding(mesh, P(ALL)), blocks))
    total = self._cached(("sum", mesh, treedef, tuple((tuple(v.shape), v.dtype) for v in leaves)),
                         lambda: steps.partition(
                             lambda ys: [jnp.sum(y, axis=0, dtype=y.dtype) for y in ys],
                             mesh, P(ALL), P()))
    return jax.tree.unflatten(treedef, total(arrays))

  def replicate(self, tree, mesh: Mesh):
    """Arrays on `mesh` (every device) -> replicated on it (an all-gather all processes
    join), so each process can take what its stages need with `localize`."""
    return self._cached(("replicate", mesh), lambda: jax.jit(
        lambda t: t, out_shardings=NamedSharding(mesh, P())))(tree)

  def localize(self, x: jax.Array, mesh: Mesh) -> jax.Array:
    """A fully replicated array whose devices include `mesh`'s -> replicated on `mesh`,
    from this process's own shards (no communication)."""
    got = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(mesh, P()), [got[d] for d in mesh.devices.flat if d in got])
