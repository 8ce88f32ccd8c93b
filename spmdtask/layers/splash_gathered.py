"""Splash attention for the all_gather method (`layers.context_attention`): one splash call
per layer on a shard's queries against the whole row's gathered keys.

The mask is the row's causal mask seen from zig-zag order: the query at index i of the row
(as the model orders it, `context_attention.zigzag`) has true position zigzag[i], and the
keys are put back in natural order after the gather (a copy of each chunk), so key j has
position j and query i sees key j iff zigzag[i] >= j. Splash computes such a mask inside
the kernel from a per-query sequence (`q_sequence`) and the key index: `ZigzagCausalMask`
is splash's `CausalMask` whose q_sequence is the zig-zag order. Its mask info (which
blocks are empty, full or partial) is built over the whole (T, T) mask, in q_seq_shards =
cp slices; each shard receives its own slice through the shard_map (`spec`) and skips its
own empty blocks. Without causality the mask is full and the keys stay in gathered order.
Packed rows pass segment ids: this shard's for q, the gathered ones for kv.

Building the mask info walks every (query block, key block) pair in numpy: at T=131072
with 512-token blocks, 26 s for the forward's and as long for the backward's, once per
process (splash caches it by mask).

Backward: splash's own VJP; the whole row's softmax is in one call, so it is exact, and
the gather's transpose (a reduce-scatter) returns each shard its keys' gradients.
"""
import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdtask.core.sharding import shards
from spmdtask.layers import fused_attention


class ZigzagCausalMask(sm.CausalMask):
  """Causal over a (T, T) mask whose query i has position `order[i]` and key j position j."""

  def __init__(self, order: np.ndarray):
    super().__init__((len(order), len(order)))
    self.q_sequence = np.asarray(order, np.int32)  # read by the kernel and the mask info


def kernel(order: np.ndarray, heads: int, mesh, head_axes, seq_axes, causal: bool,
           interpret: bool) -> tuple[sk.SplashAttentionKernel, sk.SplashAttentionKernel]:
  """The splash kernel of a row in token order `order` (zig-zag, [T]), its `heads` query
  heads split over `head_axes` and its queries over `seq_axes` of `mesh`, and its
  shard_map in_spec (each shard: its slice of the mask info)."""
  t, cp = len(order), shards(seq_axes, mesh.shape)
  # splash's separate dq kernel: the fused backward keeps dq partials per block_kv_dkv of
  # the row's keys, [T/1024, heads, t, hd] (Llama31_8B_128k: 8 GiB a chip).
  sizes = fused_attention.splash_block_sizes(t // cp)
  if causal:
    mask, q_shards, q_axes = ZigzagCausalMask(order), cp, seq_axes
  else:  # the same full mask on every shard: built for one (splash's mask info of a full
    # mask split over queries fails: it has no partial blocks to pad).
    mask, q_shards, q_axes = sm.FullMask((t // cp, t)), 1, None
  kern = sk.make_splash_mha(sm.MultiHeadMask([mask] * heads), block_sizes=sizes,
                            head_shards=shards(head_axes, mesh.shape), q_seq_shards=q_shards,
                            interpret=interpret)
  return kern, kern.manual_sharding_spec(NamedSharding(mesh, P(head_axes, q_axes)))


def _natural(x, cp: int):
  """A gathered row [b, T, ...] in zig-zag order (shard i's chunks i, 2cp-1-i) put back in
  token order."""
  chunks = jnp.split(x, 2 * cp, axis=1)  # gathered chunk 2i is chunk i, 2i+1 is 2cp-1-i
  return jnp.concatenate([chunks[2 * c] for c in range(cp)]
                         + [chunks[2 * (2 * cp - 1 - c) + 1] for c in range(cp, 2 * cp)],
                         axis=1)


def attend(q, k, v, q_seg, axes, kern: sk.SplashAttentionKernel, causal: bool):
  """Inside the shard_map: this shard's queries q [b, t, kv, g, hd] against the whole row's
  K/V, gathered from k/v [b, t, kv, hd] (segment ids [b, t] or None) -> [b, kv, g, t, hd]
  float32."""
  cp = shards(axes, dict(jax.sharding.get_abstract_mesh().shape))
  row = lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True)
  if causal:
    row = lambda x, gather=row: _natural(gather(x), cp)
  b, t, kvh, g, hd = q.shape
  # [b, heads, t, hd] (query head kv·g + j reads KV head kv), q scaled: splash does not.
  qh = jnp.transpose(q * jnp.asarray(hd ** -0.5, q.dtype), (0, 2, 3, 1, 4)).reshape(
      b, kvh * g, t, hd)
  kh, vh = (jnp.swapaxes(row(x), 1, 2) for x in (k, v))
  seg = None if q_seg is None else sk.SegmentIds(q_seg, row(q_seg))
  o = jax.vmap(lambda a, b, c, s: kern(a, b, c, segment_ids=s))(qh, kh, vh, seg)
  return o.reshape(b, kvh, g, t, hd).astype(jnp.float32)
