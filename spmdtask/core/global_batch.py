"""Host-local batches -> global jax.Arrays laid out by the input split-dims mappings."""
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from spmdtask.core import sharding


def global_shapes(local_batch, process_count: int | None = None):
  """ShapeDtypeStructs of the global batch: the local batch dim times the process count."""
  count = jax.process_count() if process_count is None else process_count
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] * count,) + x.shape[1:],
                                                     x.dtype), local_batch)


def specs(local_batch, inputs_split_mapping, batch_axes, mesh: Mesh):
  """PartitionSpecs of the global batch (validated against the mesh)."""
  return sharding.input_split_dims(global_shapes(local_batch), inputs_split_mapping, batch_axes,
                                   dict(mesh.shape))


def to_global(local_batch, batch_specs, mesh: Mesh):
  """Assembles each process's rows into one global array per input."""
  return jax.tree.map(
      lambda x, s, g: jax.make_array_from_process_local_data(NamedSharding(mesh, s),
                                                             np.asarray(x), g.shape),
      local_batch, batch_specs, global_shapes(local_batch))
