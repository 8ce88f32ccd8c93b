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
  if split is None or jax.sharding.get_abstract_mesh().empty:
    return x
  return jax.lax.with_sharding_constraint(x, P(*split))


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
