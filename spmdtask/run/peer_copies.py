"""The local tier's blocks and peer copies: which index blocks of an array a process holds,
whether some blocks cover others, and the copy of each process's blocks kept by its
counterpart on the next slice (`run.local_tier`).

A mesh axis across slices is laid out DCN-major (`core.mesh`): moving every device one
slice on along it (`peer_mesh`) and resharding an array onto that mesh puts on each device
the block its counterpart on the next slice holds, so one lost slice loses no block.
"""
import itertools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from spmdtask.run import fingerprints


def blocks(array_sharding, shape) -> list[list[list[int]]]:
  """The index blocks ([start, stop] per dim) of an array of `shape` that this process's
  devices hold under `array_sharding`, each once, sorted."""
  found = set()
  for index in array_sharding.addressable_devices_indices_map(tuple(shape)).values():
    found.add(tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape)))
  return [[list(d) for d in block] for block in sorted(found)]


def covered(want, have) -> bool:
  """Whether the union of the blocks `have` covers every block of `want` (each [start,
  stop] per dim): checked on the grid their bounds cut each block into."""
  for block in want:
    cuts = [sorted({lo, hi, *(b for h in have for b in h[d] if lo < b < hi)})
            for d, (lo, hi) in enumerate(block)]
    for cell in itertools.product(*(zip(c, c[1:]) for c in cuts)):
      if not any(all(h[d][0] <= lo and hi <= h[d][1] for d, (lo, hi) in enumerate(cell))
                 for h in have):
        return False
  return True


def peer_mesh(mesh: Mesh, dcn: dict[str, int]) -> Mesh | None:
  """`mesh` with each device moved one slice on along its first axis across slices (`dcn`:
  axis name -> its DCN size), to the same ICI place (a mesh axis is laid out DCN-major:
  `core.mesh`): under it a device holds what its counterpart on the next slice holds. None
  for a mesh within one slice."""
  axis = next((i for i, a in enumerate(mesh.axis_names) if dcn.get(a, 1) > 1), None)
  if axis is None:
    return None
  ici = mesh.devices.shape[axis] // dcn[mesh.axis_names[axis]]
  return Mesh(np.roll(mesh.devices, ici, axis=axis), mesh.axis_names,
              axis_types=mesh.axis_types)


def copies(named, rolled: Mesh | None, held: dict) -> dict[str, jax.Array]:
  """{name: the array resharded onto `rolled`} of the arrays of which this process would
  hold there a block it does not hold itself (state sharded across slices)."""
  if rolled is None:
    return {}
  out = {}
  for name, x in named:
    if not isinstance(x.sharding, NamedSharding):
      continue
    there = NamedSharding(rolled, x.sharding.spec)
    if not covered(blocks(there, x.shape), held[name]):
      out[name] = jax.device_put(x, there)
  return out


def filled(own: jax.Array, peer: jax.Array, held) -> jax.Array:
  """`own` (read where this process wrote its blocks `held`; elsewhere unwritten) with every
  element outside `held` taken from `peer` (the peer copy, read onto the same sharding)."""
  shards = []
  for o, p in zip(own.addressable_shards, peer.addressable_shards):
    out, mine = np.array(p.data), np.asarray(o.data)
    starts = [s.indices(n)[0] for s, n in zip(o.index, own.shape)]
    stops = [a + n for a, n in zip(starts, out.shape)]
    for block in held:
      cut = tuple(slice(max(lo, a) - a, min(hi, b) - a)
                  for (lo, hi), a, b in zip(block, starts, stops))
      if all(c.start < c.stop for c in cut):
        out[cut] = mine[cut]
    shards.append(jax.device_put(out, o.device))
  return jax.make_array_from_single_device_arrays(own.shape, own.sharding, shards)


def completed(got: dict, items, peers: dict, held: dict, fill) -> dict:
  """`got` with the arrays of its `items` ({item: tree}) named in `fill` completed from
  `peers` ({name: the peer copy, read onto the same sharding}) outside the blocks this
  process wrote (`held`: {name: blocks})."""
  for k in items:
    leaves, tree = jax.tree_util.tree_flatten(got[k])
    names = [n for n, _ in fingerprints.named({k: got[k]})]
    got = {**got, k: tree.unflatten([filled(x, peers[n], held[n]) if n in fill else x
                                     for n, x in zip(names, leaves)])}
  return got
