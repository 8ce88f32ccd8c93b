"""mpmd.transfers within one process: which sends keep their layout, and the batched copy."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from spmdtask.pipeline.mpmd import transfers


def mesh(devices, shape):
  return Mesh(np.asarray(devices).reshape(shape), ("data", "model"),
              axis_types=(AxisType.Auto,) * 2)


def test_same_layout_is_the_same_spec_on_a_mesh_of_the_same_shape():
  d = jax.devices()
  a, b, c = mesh(d[:4], (2, 2)), mesh(d[4:], (2, 2)), mesh(d[4:], (4, 1))
  assert transfers.same_layout(NamedSharding(a, P("data")), NamedSharding(b, P("data")))
  assert transfers.same_layout(NamedSharding(a, P()), NamedSharding(c, P()))  # replicated
  assert not transfers.same_layout(NamedSharding(a, P("data")), NamedSharding(b, P("model")))
  assert not transfers.same_layout(NamedSharding(a, P("data")), NamedSharding(c, P("data")))
  assert not transfers.same_layout(NamedSharding(a, P()), NamedSharding(mesh(d[4:6], (2, 1)),
                                                                         P()))


def test_copy_moves_every_shard_exactly_to_the_other_devices():
  d = jax.devices()
  a, b = mesh(d[:4], (2, 2)), mesh(d[4:], (2, 2))
  xs = [jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(a, P("data", "model"))),
        jax.device_put(jnp.arange(6, dtype=jnp.int32), NamedSharding(a, P()))]
  dsts = [NamedSharding(b, x.sharding.spec) for x in xs]
  ys = transfers.copy(xs, dsts)
  for x, y, dst in zip(xs, ys, dsts):
    assert y.sharding == dst and y.dtype == x.dtype
    assert {s.device for s in y.addressable_shards} == set(d[4:])
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_put_within_one_process_lands_on_the_other_stage():
  d = jax.devices()
  cross = transfers.Cross([mesh(d[:4], (2, 2)), mesh(d[4:], (4, 1))])
  x = jax.device_put(jnp.asarray([3.0, 4.0]), NamedSharding(cross.meshes[0], P()))
  y = cross.put(x, jax.ShapeDtypeStruct((2,), jnp.float32), 0, 1)
  assert y.sharding == NamedSharding(cross.meshes[1], P())
  np.testing.assert_array_equal(np.asarray(y), [3.0, 4.0])
