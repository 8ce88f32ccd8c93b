"""Splash attention for the all_gather method (`layers.attention.context`): one splash call
per KV head and layer on a shard's queries against the whole row's gathered keys.

The mask is the row's causal mask seen from zig-zag order on both sides: the query at
index i of the row (as the model orders it, `context_attention.zigzag`) has true position
zigzag[i], and so has the key at index i, as the gather leaves the keys in the shards'
order (shard s: chunks s, 2cp-1-s). Query i sees key j iff zigzag[i] >= zigzag[j]. Splash
computes such a mask inside the kernel from a per-query sequence (`q_sequence`) and the key
index: `ZigzagCausalMask` is splash's `CausalMask` whose q_sequence is the zig-zag order and
whose mask function maps a key index to its position by shifts (gathered chunk g is chunk
g/2 for even g, 2cp-1-(g-1)/2 for odd g): no copy of the gathered keys into token order, forward or backward (on
Llama31_8B_128k's v5p-128 plan that copy and its transpose were 0.26 s of the step's 0.33 s
HBM-bound time, 32 slices a copy). Where a chunk's length is no power of two the keys are
put back in token order (a copy of each chunk) and the mask is plain causal on the key
index. Its mask info (which blocks are empty, full or partial) is built over the whole
(T, T) mask, in q_seq_shards = cp slices; each shard receives its own slice through the
shard_map (`spec`) and skips its own empty blocks. Without causality the mask is full and
the keys stay in gathered order. Packed rows pass segment ids: this shard's for q, the
gathered ones for kv.

Building the mask info walks every (query block, key block) pair in numpy: at T=131072
with 512-token blocks, 26 s for the forward's and as long for the backward's, once per
process (splash caches it by mask).

Backward: splash's own VJP; the whole row's softmax is in one call, so it is exact, and
the gather's transpose (a reduce-scatter) returns each shard its keys' gradients. Its
fused kernel (dq, dk, dv in one pass: 5 matmuls a block, not 7) keeps dq partials per
DKV_KEYS of the row's keys, [T/DKV_KEYS, heads, t, hd] in q's dtype, summed after the
kernel: for Llama31_8B_128k's 32 heads x 8192 queries x 131072 keys, 8 GiB a chip with
1024-key steps. So the call takes one KV head (and its query heads) at a time, in a loop,
with 4096-key steps: 256 MiB (2-layer proxy temporaries 4.4 GiB with 1024 keys, 3.7 with
2048, 3.2 with 4096; the separate dq kernel 3.5 GiB, at ~1.2x the backward's matmuls).
A 4096-key step spans a whole zig-zag chunk, so the backward skips a little less: 264 of
512 (query, key) blocks a shard (51.6%) against 1032 of 2048 with 1024 keys (50.4%).
"""
import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdtask.core.sharding import shards
from spmdtask.layers.attention import splash_blocks


DKV_KEYS = 4096  # keys a step of the fused backward (module doc)


class ZigzagCausalMask(sm.CausalMask):
  """Causal over a (T, T) mask whose query i has position `order[i]` and key j position j,
  or, with `keys_zigzag`, position `order[j]` too (computed in the kernel by shifts: the
  zig-zag chunks, T / (2·cp) long, must be a power of two)."""

  def __init__(self, order: np.ndarray, cp: int = 1, keys_zigzag: bool = False):
    super().__init__((len(order), len(order)))
    self.q_sequence = np.asarray(order, np.int32)  # read by the kernel and the mask info
    self.key_chunks = 2 * cp if keys_zigzag else 0
    if keys_zigzag:
      bits = (len(order) // (2 * cp)).bit_length() - 1
      last = 2 * cp - 1

      def position(j):  # gathered chunk g = j >> bits is shard g/2's first or second chunk
        g = j >> bits
        i = g >> 1
        return ((i + (g & 1) * (last - 2 * i)) << bits) + (j & ((1 << bits) - 1))
      self.mask_function = lambda q_ids, kv_ids: q_ids >= position(kv_ids)

  def __eq__(self, other: object):
    return super().__eq__(other) and self.key_chunks == getattr(other, "key_chunks", 0)

  def __hash__(self):
    return hash((super().__hash__(), self.key_chunks))


def keys_zigzag(seq_len: int, cp: int) -> bool:
  """Whether the mask can read the gathered keys in zig-zag order: the chunks' length is a
  power of two (the kernel maps a key index to its position by shifts)."""
  chunk = seq_len // (2 * cp)
  return chunk & (chunk - 1) == 0


def kernel(order: np.ndarray, group: int, mesh, seq_axes, causal: bool, interpret: bool
           ) -> tuple[sk.SplashAttentionKernel, sk.SplashAttentionKernel]:
  """The splash kernel of a row in token order `order` (zig-zag, [T]) for the `group`
  query heads of one KV head, its queries split over `seq_axes` of `mesh`, and its
  shard_map in_spec (each shard: its slice of the mask info)."""
  t, cp = len(order), shards(seq_axes, mesh.shape)
  if causal:
    mask = ZigzagCausalMask(order, cp, keys_zigzag(t, cp))
    q_shards, q_axes = cp, seq_axes
  else:  # the same full mask on every shard: built for one (splash's mask info of a full
    # mask split over queries fails: it has no partial blocks to pad).
    mask, q_shards, q_axes = sm.FullMask((t // cp, t)), 1, None
  kern = sk.make_splash_mha(sm.MultiHeadMask([mask] * group),
                            block_sizes=splash_blocks.block_sizes(t // cp, t, DKV_KEYS),
                            head_shards=1,
                            q_seq_shards=q_shards, interpret=interpret)
  # The spec names only free axes; read against the mesh's sizes alone (a NamedSharding on
  # a mesh with manual axes, the SPMD pipeline's 'stage', has no shard shape in JAX 0.10).
  sizes = jax.sharding.AbstractMesh(tuple(mesh.shape.values()), tuple(mesh.shape))
  return kern, kern.manual_sharding_spec(NamedSharding(sizes, P(None, q_axes)))


def _natural(x, cp: int, axis: int):
  """A gathered row (its tokens on `axis`) in zig-zag order (shard i's chunks i, 2cp-1-i)
  put back in token order."""
  chunks = jnp.split(x, 2 * cp, axis=axis)  # gathered chunk 2i is chunk i, 2i+1 is 2cp-1-i
  return jnp.concatenate([chunks[2 * c] for c in range(cp)]
                         + [chunks[2 * (2 * cp - 1 - c) + 1] for c in range(cp, 2 * cp)],
                         axis=axis)


def attend(q, k, v, q_seg, axes, kern: sk.SplashAttentionKernel, causal: bool):
  """Inside the shard_map: this shard's queries q [b, t, kv, g, hd] against the whole row's
  K/V, gathered from k/v [b, t, kv, hd] (segment ids [b, t] or None) -> [b, kv, g, t, hd]
  float32.

  One KV head (and its g query heads) a call, in a loop: the fused backward's dq partials
  are then one KV head's (module doc). Each step gathers the NEXT head's K/V before this
  head's call, so that the link works while the kernel does (the ring's order), and the
  backward's reduce-scatter of a head's K/V gradients runs beside the next head's kernel;
  two heads' gathered K/V are held at a time, not all of them."""
  cp = shards(axes, dict(jax.sharding.get_abstract_mesh().shape))
  row = lambda x, axis: jax.lax.all_gather(x, axes, axis=axis, tiled=True)
  if causal and not keys_zigzag(q.shape[1] * cp, cp):  # the mask reads keys in token order
    row = lambda x, axis, gather=row: _natural(gather(x, axis), cp, axis)
  hd = q.shape[-1]
  qh = jnp.transpose(q * jnp.asarray(hd ** -0.5, q.dtype), (2, 0, 3, 1, 4))  # [kv, b, g, t, hd]
  kh, vh = (jnp.transpose(x, (2, 0, 1, 3))[:, :, None] for x in (k, v))  # [kv, b, 1, t, hd]
  head_row = lambda k, v: (row(k, 2), row(v, 2))  # one KV head's [b, 1, t, hd] -> [b, 1, T, hd]
  seg = None if q_seg is None else sk.SegmentIds(q_seg, row(q_seg, 1))
  call = jax.vmap(lambda a, b, c, s: kern(a, b, c, segment_ids=s))

  def step(kv, x):
    q_i, k_next, v_next = x
    return head_row(k_next, v_next), call(q_i, *kv, seg)
  kv, o = jax.lax.scan(step, head_row(kh[0], vh[0]), (qh[:-1], kh[1:], vh[1:]))
  o = jnp.concatenate([o, call(qh[-1], *kv, seg)[None]])
  return jnp.swapaxes(o, 0, 1).astype(jnp.float32)
