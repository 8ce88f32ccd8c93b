"""The local tier's blocks and peer copies (spmdtask.run.peer_copies): a reshard onto the
mesh rolled by one slice puts each slice's blocks on its counterpart of the next slice;
blocks cover others; a read of own blocks is completed from the peer copy. The copies at
work in a shrunk multi-process job: tests/run/test_elastic.py."""
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from spmdtask.run import peer_copies


def test_peer_copies_put_each_slices_blocks_on_the_next_slices_counterpart():
  # data 4 x fsdp 2 over 2 "slices" (fsdp across DCN): devices 0-3 are slice 0, 4-7 slice 1.
  devices = np.asarray(jax.devices()).reshape(2, 4).T  # [data 4, fsdp 2], fsdp = the slice
  mesh = Mesh(devices, ("data", "fsdp"))
  assert peer_copies.peer_mesh(mesh, {"data": 1, "fsdp": 1}) is None
  rolled = peer_copies.peer_mesh(mesh, {"data": 1, "fsdp": 2})
  x = jax.device_put(np.arange(8 * 3, dtype=np.float32).reshape(8, 3),
                     NamedSharding(mesh, P("fsdp", None)))
  peer = jax.device_put(x, NamedSharding(rolled, P("fsdp", None)))
  for d in jax.devices():  # each device holds the rows its other-slice counterpart holds
    (own,) = [s for s in x.addressable_shards if s.device == d]
    (copy,) = [s for s in peer.addressable_shards if s.device == d]
    assert own.index[0] != copy.index[0]
    np.testing.assert_array_equal(np.asarray(copy.data), np.asarray(x)[copy.index])
  # Blocks: the peer's rows fill what a device's own rows do not cover.
  assert peer_copies.covered([[[0, 8], [0, 3]]], [[[0, 4], [0, 3]], [[4, 8], [0, 3]]])
  assert not peer_copies.covered([[[0, 8], [0, 3]]], [[[0, 4], [0, 3]], [[5, 8], [0, 3]]])
  assert peer_copies.covered([[]], [[]])  # a scalar
  whole = NamedSharding(mesh, P())
  own = jax.device_put(np.where(np.arange(8)[:, None] < 4, np.asarray(x), 0), whole)
  full = jax.device_put(np.asarray(x), whole)
  np.testing.assert_array_equal(np.asarray(peer_copies.filled(own, full, [[[0, 4], [0, 3]]])),
                                np.asarray(x))
