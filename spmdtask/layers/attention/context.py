"""Attention when the sequence is split over a mesh axis (context parallelism), and the
zig-zag order that balances its causal work.

A `context` axis is no special axis: it is whatever the seq entry of
`activation_split_dims_mapping.heads` names (`seq_axes`). When those axes have more than
one shard, each device holds a slice of every row's tokens, and attention needs every
key: `attend` runs under `jax.shard_map` manual over those axes (the other axes stay
automatic, or manual too for the splash kernel, which has no partitioning rule; axes
already manual, such as the SPMD pipeline's 'stage', stay so) in one of two ways
(`task.model.context_attention`):
  all_gather  K/V (and their positions and segment ids) all-gathered over the axis in the
              compute dtype, one layer at a time; each device attends its queries to the
              whole row.
  ring        K/V blocks passed around the axis with `ppermute`; each step's block is
              attended with an online softmax (running max and sum, merged by
              log-sum-exp), and the next block's send is issued before this block's compute
              so that the link works while the chip does.
The xla kernel's mask comes from each token's true position and segment id, never from its
index, so RoPE, causality and packed rows are right whatever order the tokens sit in;
splash's comes from the zig-zag order (and segment ids), which the model always uses.

Causal load balance (`zigzag`): the row is cut into 2·cp chunks and reordered so that shard
i holds chunks i and 2cp-1-i; every shard then has the same number of visible
(query, key) pairs. `TransformerLm.loss` reorders tokens, targets, weights, positions and
segment ids together (the loss is a sum over tokens, so it needs no reorder back).

Inside a shard, the kernel is chosen once (`choose`, from task.model.attention_impl). The
ring attends each block with `xla_blocks.XlaBlocks` (einsums, masks from positions,
queries in chunks of `score_block`) or `splash_blocks.SplashBlocks` (splash on TPU: the
zig-zag order makes every block pair's mask static in index order; scores stay on chip).
all_gather attends with the same xla kernel, or with one splash call per KV head on the
whole gathered row (`splash_gathered`: the zig-zag causal mask over keys left in the
gather's order, its block map split over the shards; the next head's K/V gathered before
this head's call).
cuDNN cannot serve: JAX's wrapper returns no log-sum-exp, which merging blocks needs.
"""
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdtask.core.sharding import entry_axes, shards
from spmdtask.errors import ConfigError
from spmdtask.layers.attention import fused as fused_attention, splash_blocks, splash_gathered, xla_blocks
from spmdtask.layers.base import SplitDims

FIELD = "task.model.context_attention"
IMPL = "task.model.attention_impl"
METHODS = ("all_gather", "ring")
SCORE_BLOCK = xla_blocks.SCORE_BLOCK


class BlockKernel(Protocol):
  """How the ring attends one K/V block (q [b, t, kv, g, hd], k/v [b, s, kv, hd],
  positions and segment ids (or None) [b, t] / [b, s]). `diagonal`: the block is this
  shard's own (else, in a causal ring, a half block every query of which sees every key
  but for segments)."""

  def forward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, diagonal: bool):
    """A partial softmax (o [b, kv, g, t, hd], m, l [b, kv, g, t]) float32: o and l summed
    over the block's visible keys of exp(score - m)."""

  def grads(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, diagonal: bool, do, o, lse, delta):
    """The block's share of (dq, dk, dv), float32, from the whole row's output cotangent
    `do`, output `o`, log-sum-exp `lse` and delta = rowsum(o·do)."""

def seq_axes(heads_split: SplitDims | None, mesh_shape, manual=()) -> tuple[str, ...]:
  """The mesh axes of size > 1 (and not in `manual`) that split the sequence (the seq entry
  of the heads mapping [batch, seq, heads, head_dim]); () when the sequence is whole on
  each device."""
  if heads_split is None or not mesh_shape:
    return ()
  return tuple(a for a in entry_axes(heads_split[1]) if dict(mesh_shape).get(a, 1) > 1
               and a not in manual)


def check(method: str, impl: str, heads_split: SplitDims | None, mesh_shape) -> None:
  """ConfigError unless `method` is known and, where the sequence is split, `impl` can
  attend across shards (at validation; shapes are checked by `choose`)."""
  if method not in METHODS:
    raise ConfigError(f"{FIELD}={method!r} is not a way to attend across a split sequence: use "
                      f"one of {', '.join(METHODS)}.")
  axes = seq_axes(heads_split, mesh_shape)
  if axes and impl == "cudnn":
    raise ConfigError(
        f"{IMPL}='cudnn' cannot attend a sequence split over {axes} (task.model."
        "activation_split_dims_mapping.heads): merging the K/V blocks of other shards needs "
        "each block's log-sum-exp, which JAX's cuDNN attention does not return. Use "
        "attention_impl='auto' or 'xla', or stop splitting the sequence.")


def choose(method: str, impl: str, backend: str, local_seq: int, num_heads: int,
           heads_split: SplitDims, mesh_shape) -> str:
  """The kernel inside a shard, 'splash' or 'xla', for `local_seq` tokens per shard: 'auto'
  is splash on TPU where the shapes allow, else xla, and explicit 'splash' is checked
  (ConfigError naming the shapes). Call after `check` (which refuses the rest). Pure."""
  # The ring's half blocks, or all_gather's queries, in splash's 128-lane blocks.
  multiple = splash_blocks.LOCAL_MULTIPLE if method == "ring" else fused_attention.SPLASH_LANES
  problem = fused_attention.heads_problem(num_heads, heads_split, mesh_shape)
  if local_seq % multiple:
    problem = (f"each shard holds {local_seq} tokens of a row, and splash's blocks need a "
               f"multiple of {multiple}: make datasets[...].seq_len a multiple of "
               f"{multiple} x the context shards")
  if impl == "auto":
    return "splash" if backend == "tpu" and problem is None else "xla"
  if impl == "splash" and problem is not None:
    raise ConfigError(f"{IMPL}='splash' cannot run with {FIELD}={method!r} here: {problem}; "
                      "or use 'auto' (falls back to xla) or 'xla'.")
  return impl


def check_decode(heads_split: SplitDims, mesh_shape) -> None:
  """ConfigError where the heads mapping would split a decode KV cache over its slots."""
  axes = seq_axes(heads_split, mesh_shape)
  if axes:
    raise ConfigError(
        f"task.model.activation_split_dims_mapping.heads splits the sequence over {axes} "
        f"(sizes {[mesh_shape[a] for a in axes]}), which would split the decode KV cache by "
        "slot: decoding reads one new token at a time and needs no context split. Decode on "
        "a mesh whose context axis has size 1 (set it to 1 in task.ici_mesh_shape and give "
        "its devices to a data axis), or with the seq entries of "
        "activation_split_dims_mapping set to None.")


def zigzag(seq_len: int, cp: int) -> np.ndarray:
  """The token order [seq_len] that gives shard i (of cp, contiguous) chunks i and 2cp-1-i
  of 2cp equal chunks. ConfigError unless 2·cp divides seq_len."""
  if seq_len % (2 * cp):
    raise ConfigError(
        f"The rows hold {seq_len} tokens, which do not cut into 2 x {cp} equal chunks: task."
        f"model.activation_split_dims_mapping splits the sequence over {cp} shards, and causal "
        "load balance gives each shard two chunks (zig-zag). Make datasets[...].seq_len a "
        f"multiple of {2 * cp}, or split the sequence over fewer shards (the mesh's context "
        "axis).")
  chunks = np.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
  order = [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]
  return chunks[order].reshape(-1)


def _merge(a, b):
  """Two partial softmaxes (o, m, l) over disjoint keys as one (log-sum-exp merge)."""
  (oa, ma, la), (ob, mb, lb) = a, b
  m = jnp.maximum(ma, mb)
  sa, sb = jnp.exp(ma - m), jnp.exp(mb - m)
  return oa * sa[..., None] + ob * sb[..., None], m, la * sa + lb * sb


def _normalized(o, l):
  return o / jnp.where(l > 0, l, 1.0)[..., None]


def _local_all_gather(q, k, v, q_pos, q_seg, axes, kernel: xla_blocks.XlaBlocks):
  """This shard's queries against the whole row's K/V, gathered: [b, kv, g, t, hd] f32."""
  gather = lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True)
  kv_pos = gather(q_pos)
  kv_seg = None if q_seg is None else gather(q_seg)
  # Autodiff's backward recomputes each checkpointed chunk: the chunks are a backward's size.
  o, _, l = xla_blocks.block(q, gather(k), gather(v), q_pos, kv_pos, q_seg, kv_seg,
                             kernel.causal, kernel.score_block // 2)
  return _normalized(o, l)


def _halves(x, axis: int):
  n = x.shape[axis] // 2
  return jax.lax.slice_in_dim(x, 0, n, axis=axis), jax.lax.slice_in_dim(x, n, 2 * n, axis=axis)


def _pad_front(x, axis: int, value=0.0):
  """x after as many `value`s along `axis` (the half of the rows a block did not touch)."""
  return jnp.concatenate([jnp.full_like(x, value), x], axis=axis)


def _local_ring(q, k, v, q_pos, q_seg, axes, kernel: BlockKernel):
  """This shard's queries against every shard's K/V block in turn: [b, kv, g, t, hd] f32.

  A custom VJP, as flash attention's: the forward keeps only its output and each query's
  log-sum-exp; the backward passes the K/V blocks around the ring again, has `kernel`
  recompute each block's share of the gradients, and sends each block's K/V gradients on
  with it, so that after cp hops they reach their own shard. Steps run in a loop.

  Causal rows are in zig-zag order (the model orders them so), and a block from another
  shard is half work: from an earlier shard (src < this one) every query sees its first
  chunk and none of its second; from a later one only this shard's second chunk sees it,
  all of it. Only that half is attended (a `cond` on the shard indices).
  """
  causal = kernel.causal
  cp = shards(axes, dict(jax.sharding.get_abstract_mesh().shape))
  perm = [(i, (i + 1) % cp) for i in range(cp)]
  send = lambda x: jax.lax.ppermute(x, axes, perm)
  segs = () if q_seg is None else (q_seg,)
  first = lambda xs: xs[0] if xs else None
  low = jnp.finfo(jnp.float32).min
  lo = lambda x, axis: _halves(x, axis)[0]
  hi = lambda x, axis: _halves(x, axis)[1]

  def forward_part(q, pos, seg, blk, earlier):
    if earlier is None or not causal:  # its own block (the diagonal), or no mask by index
      return kernel.forward(q, blk[0], blk[1], pos, blk[2], first(seg), first(blk[3:]),
                            earlier is None)

    def from_earlier(_):  # every query, the block's first chunk
      kb = [lo(x, 1) for x in blk]
      return kernel.forward(q, kb[0], kb[1], pos, kb[2], first(seg), first(kb[3:]), False)

    def from_later(_):  # this shard's second chunk, the whole block
      o, m, l = kernel.forward(hi(q, 1), blk[0], blk[1], hi(pos, 1), blk[2],
                               first([hi(x, 1) for x in seg]), first(blk[3:]), False)
      return _pad_front(o, 3), _pad_front(m, 3, low), _pad_front(l, 3)
    return jax.lax.cond(earlier, from_earlier, from_later, None)

  def earlier(step):  # whether the block of this step comes from an earlier shard
    me = jax.lax.axis_index(axes)  # traced where used: the backward is a trace of its own
    return (me - step) % cp < me

  def forward(q, k, v, pos, *seg):
    acc = forward_part(q, pos, seg, (k, v, pos, *seg), None)  # its own block: the diagonal

    def hop(carry, step):  # the next block's send goes out before this block's compute
      blk, acc = carry
      return (send(blk), _merge(acc, forward_part(q, pos, seg, blk, earlier(step)))), None
    (blk, acc), _ = jax.lax.scan(hop, (send((k, v, pos, *seg)), acc), jnp.arange(1, cp - 1))
    o, m, l = _merge(acc, forward_part(q, pos, seg, blk, earlier(cp - 1)))
    return _normalized(o, l), m + jnp.log(jnp.where(l > 0, l, 1.0))

  # Checkpointed: where the forward is itself traced for a backward (a remat'd layer in a
  # scan, partially evaluated), it keeps only its inputs, not each step's scores and masks.
  forward = jax.checkpoint(forward)

  @jax.custom_vjp
  def ring(q, k, v, pos, *seg):
    return forward(q, k, v, pos, *seg)[0]

  def ring_fwd(q, k, v, pos, *seg):
    o, lse = forward(q, k, v, pos, *seg)
    return o, (q, k, v, pos, seg, o, lse)

  def ring_bwd(res, do):
    q, k, v, pos, seg, o, lse = res
    delta = jnp.sum(do * o, axis=-1)  # [b, kv, g, t]

    def grads(blk, earlier):
      if earlier is None or not causal:
        return kernel.grads(q, blk[0], blk[1], pos, blk[2], first(seg), first(blk[3:]),
                            earlier is None, do, o, lse, delta)

      def from_earlier(_):
        kb = [lo(x, 1) for x in blk]
        dq, dk, dv = kernel.grads(q, kb[0], kb[1], pos, kb[2], first(seg), first(kb[3:]),
                                  False, do, o, lse, delta)
        pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)
        return dq, pad(dk), pad(dv)

      def from_later(_):
        dq, dk, dv = kernel.grads(hi(q, 1), blk[0], blk[1], hi(pos, 1), blk[2],
                                  first([hi(x, 1) for x in seg]), first(blk[3:]), False,
                                  hi(do, 3), hi(o, 3), hi(lse, 3), hi(delta, 3))
        return _pad_front(dq, 1), dk, dv
      return jax.lax.cond(earlier, from_earlier, from_later, None)

    def step(blk, dkv, dq, earlier):
      dq_b, dk, dv = grads(blk, earlier)
      # This block's gradients travel on with it: after cp hops they are home.
      return send((dkv[0] + dk, dkv[1] + dv)), dq + dq_b

    def hop(carry, step_index):
      blk, dkv, dq = carry
      return (send(blk),) + step(blk, dkv, dq, earlier(step_index)), None
    own = (k, v, pos, *seg)
    zero = lambda x: jnp.zeros(x.shape, jnp.float32)
    dkv, dq = step(own, (zero(k), zero(v)), zero(q), None)
    (blk, dkv, dq), _ = jax.lax.scan(hop, (send(own), dkv, dq), jnp.arange(1, cp - 1))
    dkv, dq = step(blk, dkv, dq, earlier(cp - 1))
    zeros = (None,) * (1 + len(seg))
    return (dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)) + zeros

  ring.defvjp(ring_fwd, ring_bwd)
  return ring(q, k, v, q_pos, *segs)


def attend(method: str, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
           segment_ids: jax.Array | None, causal: bool, heads_split: SplitDims,
           score_block: int = SCORE_BLOCK, impl: str = "xla", backend: str = "cpu"
           ) -> jax.Array:
  """Self-attention of a sequence split over the seq axes of `heads_split` (`method`:
  all_gather or ring; module doc).

  q [b, t, heads, hd], k/v [b, t, kv_heads, hd], positions and segment_ids (or None) [b, t],
  each split over those axes, in zig-zag order (`zigzag`; the ring skips the blocks that
  order puts after a shard's queries, and splash needs that order; all_gather with xla
  takes any)
  -> [b, t, heads, hd] in q's dtype. `impl`: the kernel in a shard, 'xla' or 'splash' (as
  `choose` resolved it; splash in Pallas interpret mode off `backend` 'tpu').
  `score_block`: (query, key) pairs per head in one chunk of the xla kernel's float32
  scores (queries are taken in chunks of about score_block / keys).
  """
  mesh = jax.sharding.get_abstract_mesh()
  axes = seq_axes(heads_split, dict(mesh.shape), mesh.manual_axes)
  # A Pallas call has no partitioning rule: splash runs manual over every free axis (its
  # examples and heads per device, as fused_attention.splash); einsums leave the other axes
  # to the partitioner.
  manual, batch_axes, head_axes = set(axes), None, None
  if impl == "splash":
    manual, batch_axes, head_axes, k, v = fused_attention.splash_layout(
        q, k, v, heads_split, mesh)
  # The local attention, chosen once: extra (and its shard_map specs) is what it needs
  # beside the arrays (all_gather's splash kernel, whose mask info is split like the queries).
  extra, extra_specs = (), ()
  if method == "ring":
    kernel = (xla_blocks.XlaBlocks(causal, score_block) if impl == "xla" else
              splash_blocks.SplashBlocks(causal, backend != "tpu"))
    local = lambda q5, k, v, pos, seg: _local_ring(q5, k, v, pos, seg, axes, kernel)
  elif impl == "xla":
    local = lambda q5, k, v, pos, seg: _local_all_gather(
        q5, k, v, pos, seg, axes, xla_blocks.XlaBlocks(causal, score_block))
  else:  # all_gather with splash: one call per shard (splash_gathered)
    splash, spec = splash_gathered.kernel(zigzag(q.shape[1], shards(axes, mesh.shape)),
                                          q.shape[2] // k.shape[2], mesh, axes, causal,
                                          backend != "tpu")
    extra, extra_specs = (splash,), (spec,)
    local = lambda q5, k, v, pos, seg, splash: splash_gathered.attend(q5, k, v, seg, axes,
                                                                      splash, causal)

  def run(q, k, v, pos, seg, *extra):  # this device's shard: its heads, its KV heads
    b, t, h, hd = q.shape
    q5 = q.reshape(b, t, k.shape[2], h // k.shape[2], hd)
    o = local(q5, k, v, pos, seg, *extra)  # [b, kv, g, t, hd]
    return jnp.einsum("bkgth->btkgh", o).reshape(q.shape).astype(q.dtype)

  act, row = P(batch_axes, axes, head_axes, None), P(batch_axes, axes)
  segs = () if segment_ids is None else (segment_ids,)
  fn = jax.shard_map(
      lambda extra, q, k, v, pos, *seg: run(q, k, v, pos, *(seg or (None,)), *extra),
      in_specs=(extra_specs, act, act, act, row) + (row,) * len(segs), out_specs=act,
      axis_names=manual, check_vma=False)
  return fn(extra, q, k, v, positions, *segs)
