"""A decoder LM's KV cache, whatever its attention: per-head keys and values (`mha.KvCache`)
or multi-head latent attention's latents and RoPE keys (`mla.MlaCache`)."""
import jax
from jax.sharding import PartitionSpec as P

from spmdtask.core import sharding
from spmdtask.layers.attention import context
from spmdtask.layers.attention.mha import KvCache
from spmdtask.layers.attention.mla import MlaCache, MlaConfig


def shapes(num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
           dtype, mla: MlaConfig | None) -> KvCache | MlaCache:
  """ShapeDtypeStructs of an empty cache: [num_layers, batch, max_len, kv_heads, head_dim]
  keys and values; with `mla` latents and RoPE keys (`MlaConfig.cache_shape`)."""
  lead = (num_layers, batch_size, max_len)
  if mla:
    return mla.cache_shape(lead, dtype)
  leaf = jax.ShapeDtypeStruct(lead + (num_kv_heads, head_dim), dtype)
  return KvCache(leaf, leaf)


def specs(heads_split, num_kv_heads: int, mesh_shape, mla: MlaConfig | None
          ) -> KvCache | MlaCache:
  """PartitionSpecs [layers, *heads_split] (the attention activations' split); KV heads
  that do not divide their axes stay whole. ConfigError where the split cuts the sequence:
  decoding needs no context split."""
  heads = list(heads_split)
  context.check_decode(heads, mesh_shape)
  if mla:  # [layers, batch, slots, latent]: one latent per token, split by batch
    return MlaCache(*[P(None, heads[0], None, None)] * 2)
  if num_kv_heads % sharding.shards(heads[2], mesh_shape):
    heads[2] = None
  return KvCache(P(None, *heads), P(None, *heads))
