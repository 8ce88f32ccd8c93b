"""What every spmdtask layer shares: weights with split-dims metadata, activation constraints."""
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

SplitDims = tuple


def weight(module: nn.Module, name: str, shape: Sequence[int], split: SplitDims,
           init: Callable) -> jax.Array:
  """A float32 weight whose `nn.Partitioned` box carries its split-dims mapping."""
  return module.param(name, nn.with_partitioning(init, tuple(split)), tuple(shape), jnp.float32)


def constrain(x: jax.Array, split: SplitDims | None) -> jax.Array:
  """Pins an activation's sharding to its split-dims mapping, inside a mesh context.

  A no-op outside one (e.g. a layer applied eagerly in a unit test).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if split is None or mesh.empty:
    return x
  manual = set(mesh.manual_axes)
  if manual:  # inside a shard_map those axes are split by hand: name only the others
    split = [tuple(a for a in e if a not in manual) or None if isinstance(e, tuple) else
             None if e in manual else e for e in split]
  return jax.lax.with_sharding_constraint(x, P(*split))


def manual_row_offset(rows: int) -> jax.Array | int:
  """The global id of this device's first row when `rows` rows per device are split by
  hand over the manual axes of the context (MPMD's per-device gradient accumulation runs
  a stage's part under a shard_map manual over its data axes), in mesh order; 0 outside
  one. Only valid where every manual axis splits the rows."""
  mesh = jax.sharding.get_abstract_mesh()
  index = 0
  for name in () if mesh.empty else mesh.manual_axes:
    index = index * dict(mesh.shape)[name] + jax.lax.axis_index(name)
  return index * rows


def dense_init(in_axis, out_axis) -> Callable:
  """Fan-in scaled truncated normal for an einsum weight with grouped in/out dims."""
  return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                          in_axis=in_axis, out_axis=out_axis)


class RmsNorm(nn.Module):
  """RMSNorm over the last dim, computed in float32."""
  dim: int
  eps: float = 1e-6
  split: SplitDims = (None,)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = weight(self, "scale", (self.dim,), self.split, nn.initializers.ones)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * scale).astype(x.dtype)
