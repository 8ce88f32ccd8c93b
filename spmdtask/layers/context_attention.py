"""Attention when the sequence is split over a mesh axis (context parallelism), and the
zig-zag order that balances its causal work.

A `context` axis is no special axis: it is whatever the seq entry of
`activation_split_dims_mapping.heads` names (`seq_axes`). When those axes have more than
one shard, each device holds a slice of every row's tokens, and attention needs every
key: `attend` runs under `jax.shard_map` manual over those axes (the other axes stay
automatic, and axes already manual, such as the SPMD pipeline's 'stage', stay so) in one of
two ways (`task.model.context_attention`):
  all_gather  K/V (and their positions and segment ids) all-gathered over the axis in the
              compute dtype, one layer at a time; each device attends its queries to the
              whole row.
  ring        K/V blocks passed around the axis with `ppermute`; each step's block is
              attended with an online softmax (running max and sum, merged by
              log-sum-exp), and the next block's send is issued before this block's compute
              so that the link works while the chip does.
The mask comes from each token's true position and segment id, never from its index, so
RoPE, causality and packed rows are right whatever order the tokens sit in.

Causal load balance (`zigzag`): the row is cut into 2·cp chunks and reordered so that shard
i holds chunks i and 2cp-1-i; every shard then has the same number of visible
(query, key) pairs. `TransformerLm.loss` reorders tokens, targets, weights, positions and
segment ids together (the loss is a sum over tokens, so it needs no reorder back).

Inside a shard the scores of a block are computed with einsums (the xla kernel): splash
and cuDNN take causality from the token index, not from positions, so they cannot attend
a K/V block from another shard; `check` refuses them by name. A block's queries are taken
in chunks (`score_block`), so that only one chunk's float32 scores live at a time.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from spmdtask.core.sharding import entry_axes, shards
from spmdtask.errors import ConfigError
from spmdtask.layers.base import SplitDims

FIELD = "task.model.context_attention"
METHODS = ("all_gather", "ring")
# (query, key) pairs per head in one chunk of the forward's float32 scores [b, kv, g, t', s];
# the backward, which holds about twice as many such arrays at once (probabilities, dp, ds),
# takes half. Llama-3.1-8B at 128k over context 16 (32 heads, 8192 keys a ring step): 512
# queries a forward chunk (512 MiB), 256 a backward one. Measured on its v5p-128 plan,
# temporaries | HBM bytes per chip per step: whole blocks 20.2 GiB | 24.6 TiB; 512 both
# ways 8.87 | 26.9; 512 and 256 8.03 | 27.8; 256 both 7.97 | 28.6 (each chunk re-reads its
# K/V block and the backward's dk/dv sums: smaller chunks, more traffic).
SCORE_BLOCK = 512 * 8192


def seq_axes(heads_split: SplitDims | None, mesh_shape, manual=()) -> tuple[str, ...]:
  """The mesh axes of size > 1 (and not in `manual`) that split the sequence (the seq entry
  of the heads mapping [batch, seq, heads, head_dim]); () when the sequence is whole on
  each device."""
  if heads_split is None or not mesh_shape:
    return ()
  return tuple(a for a in entry_axes(heads_split[1]) if dict(mesh_shape).get(a, 1) > 1
               and a not in manual)


def check(method: str, impl: str, heads_split: SplitDims | None, mesh_shape) -> None:
  """ConfigError unless `method` is known and, where the sequence is split, the attention
  kernel `impl` can attend a K/V block by positions."""
  if method not in METHODS:
    raise ConfigError(f"{FIELD}={method!r} is not a way to attend across a split sequence: use "
                      f"one of {', '.join(METHODS)}.")
  axes = seq_axes(heads_split, mesh_shape)
  if axes and impl in ("splash", "cudnn"):
    raise ConfigError(
        f"task.model.attention_impl={impl!r} cannot take a K/V block from another shard: the "
        f"{impl} kernel reads causality from token indices, but task.model."
        f"activation_split_dims_mapping.heads splits the sequence over {axes}, so each shard's "
        f"keys ({FIELD}={method!r}) are masked by their true positions. Use "
        "attention_impl='auto' or 'xla', or stop splitting the sequence.")


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


def _scores(q, k, q_pos, kv_pos, q_seg, kv_seg, causal: bool):
  """Masked scores [b, kv, group, t, s] float32 and their mask (None: every key)."""
  hd = q.shape[-1]
  s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * hd ** -0.5
  mask = kv_pos[:, None, None, None, :] <= q_pos[:, None, None, :, None] if causal else None
  if q_seg is not None:
    same = kv_seg[:, None, None, None, :] == q_seg[:, None, None, :, None]
    mask = same if mask is None else mask & same
  return s, mask


def _block_dense(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal: bool):
  """One K/V block, all its queries at once: (unnormalized output [b, kv, g, t, hd], running
  max and sum [b, kv, g, t]), all float32. The max is a constant of the softmax, hence
  stop_gradient: the function is the same, and its gradient needs no argmax."""
  s, mask = _scores(q, k, q_pos, kv_pos, q_seg, kv_seg, causal)
  low = jnp.finfo(jnp.float32).min
  if mask is not None:
    s = jnp.where(mask, s, low)
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1))
  p = jnp.exp(s - m[..., None])
  if mask is not None:  # a row with no visible key: max is `low` and every exp is 1
    p = jnp.where(mask, p, 0.0)
  o = jnp.einsum("bkgts,bskh->bkgth", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return o, m, jnp.sum(p, axis=-1)


def _merge(a, b):
  """Two partial softmaxes (o, m, l) over disjoint keys as one (log-sum-exp merge)."""
  (oa, ma, la), (ob, mb, lb) = a, b
  m = jnp.maximum(ma, mb)
  sa, sb = jnp.exp(ma - m), jnp.exp(mb - m)
  return oa * sa[..., None] + ob * sb[..., None], m, la * sa + lb * sb


def _normalized(o, l):
  return o / jnp.where(l > 0, l, 1.0)[..., None]


def _local_all_gather(q, k, v, q_pos, q_seg, axes, causal, score_block):
  """This shard's queries against the whole row's K/V, gathered: [b, kv, g, t, hd] f32."""
  gather = lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True)
  kv_pos = gather(q_pos)
  kv_seg = None if q_seg is None else gather(q_seg)
  # Autodiff's backward recomputes each checkpointed chunk: the chunks are a backward's size.
  o, _, l = _block(q, gather(k), gather(v), q_pos, kv_pos, q_seg, kv_seg, causal,
                   score_block // 2)
  return _normalized(o, l)


def _grads_dense(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, do, lse, delta):
  """One block's gradients, all its queries at once (dq [b, t, kv, g, hd], dk, dv [b, s, kv,
  hd], float32) from the output's cotangent `do` [b, kv, g, t, hd], the log-sum-exp and
  delta = sum(do · o)."""
  s, mask = _scores(q, k, q_pos, kv_pos, q_seg, kv_seg, causal)
  p = jnp.exp(s - lse[..., None])
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  dv = jnp.einsum("bkgts,bkgth->bskh", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
  dp = jnp.einsum("bkgth,bskh->bkgts", do, v.astype(do.dtype), preferred_element_type=jnp.float32)
  ds = (p * (dp - delta[..., None]) * q.shape[-1] ** -0.5).astype(q.dtype)
  dq = jnp.einsum("bkgts,bskh->btkgh", ds, k, preferred_element_type=jnp.float32)
  dk = jnp.einsum("bkgts,btkgh->bskh", ds, q, preferred_element_type=jnp.float32)
  return dq, dk, dv


def _num_chunks(t: int, s: int, score_block: int) -> int:
  """How many equal chunks `t` queries against `s` keys take: the fewest whose chunk holds
  at most `score_block` (query, key) pairs, or as near as a divisor of t allows."""
  most = max(1, score_block // max(s, 1))
  return t // next(c for c in range(min(most, t), 0, -1) if t % c == 0)


def _chunks(x, n: int, axis: int):
  """x [..., t, ...] as n chunks along a new leading dim: [n, ..., t/n, ...]."""
  shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unchunk(x, axis: int):
  """The inverse of `_chunks`."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _block(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal: bool, score_block: int):
  """`_block_dense` over chunks of queries (each needs the whole K/V block, no other query:
  the chunks' outputs just stack). Each chunk is checkpointed: differentiated (the
  all_gather path), it keeps its inputs, not its scores, and its backward recomputes them."""
  n = _num_chunks(q.shape[1], k.shape[1], score_block)
  if n == 1:
    return _block_dense(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal)
  one = jax.checkpoint(lambda xs: _block_dense(xs[0], k, v, xs[1], kv_pos, xs[2], kv_seg, causal))
  seg = None if q_seg is None else _chunks(q_seg, n, 1)
  o, m, l = jax.lax.map(one, (_chunks(q, n, 1), _chunks(q_pos, n, 1), seg))
  return _unchunk(o, 3), _unchunk(m, 3), _unchunk(l, 3)


def _grads(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, do, lse, delta, score_block: int):
  """`_grads_dense` over chunks of queries, half as long as `_block`'s for the same
  `score_block` (SCORE_BLOCK's note): dq chunk by chunk, dk and dv summed over them."""
  n = _num_chunks(q.shape[1], k.shape[1], score_block // 2)  # twice the live arrays
  if n == 1:
    return _grads_dense(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, do, lse, delta)

  def one(dkv, xs):
    qc, pos, seg, doc, lsec, deltac = xs
    dq, dk, dv = _grads_dense(qc, k, v, pos, kv_pos, seg, kv_seg, causal, doc, lsec, deltac)
    return (dkv[0] + dk, dkv[1] + dv), dq
  zero = jnp.zeros(k.shape, jnp.float32)
  seg = None if q_seg is None else _chunks(q_seg, n, 1)
  (dk, dv), dq = jax.lax.scan(one, (zero, zero), (
      _chunks(q, n, 1), _chunks(q_pos, n, 1), seg, _chunks(do, n, 3), _chunks(lse, n, 3),
      _chunks(delta, n, 3)))
  return _unchunk(dq, 1), dk, dv


def _halves(x, axis: int):
  n = x.shape[axis] // 2
  return jax.lax.slice_in_dim(x, 0, n, axis=axis), jax.lax.slice_in_dim(x, n, 2 * n, axis=axis)


def _pad_front(x, axis: int, value=0.0):
  """x after as many `value`s along `axis` (the half of the rows a block did not touch)."""
  return jnp.concatenate([jnp.full_like(x, value), x], axis=axis)


def _local_ring(q, k, v, q_pos, q_seg, axes, causal, score_block):
  """This shard's queries against every shard's K/V block in turn: [b, kv, g, t, hd] f32.

  A custom VJP, as flash attention's: the forward keeps only its output and each query's
  log-sum-exp; the backward passes the K/V blocks around the ring again, recomputes each
  block's probabilities, and sends each block's K/V gradients on with it, so that after cp
  hops they reach their own shard. Steps run in a loop, each block's queries in chunks
  (`_block`, `_grads`): one chunk of one block's scores lives at a time.

  Causal rows are in zig-zag order (the model orders them so), and a block from another
  shard is half work: from an earlier shard (src < this one) every query sees its first
  chunk and none of its second; from a later one only this shard's second chunk sees it,
  all of it. Only that half is computed (a `cond` on the shard indices); the mask still
  comes from positions and segments.
  """
  cp = shards(axes, dict(jax.sharding.get_abstract_mesh().shape))
  perm = [(i, (i + 1) % cp) for i in range(cp)]
  send = lambda x: jax.lax.ppermute(x, axes, perm)
  segs = () if q_seg is None else (q_seg,)
  first = lambda xs: xs[0] if xs else None
  low = jnp.finfo(jnp.float32).min

  def forward_part(q, pos, seg, blk, earlier):
    whole = lambda: _block(q, blk[0], blk[1], pos, blk[2], first(seg), first(blk[3:]), causal,
                           score_block)
    if earlier is None or not causal:
      return whole()

    def from_earlier(_):  # every query, the block's first chunk
      kb = [_halves(x, 1)[0] for x in blk]
      return _block(q, kb[0], kb[1], pos, kb[2], first(seg), first(kb[3:]), causal,
                    score_block)

    def from_later(_):  # this shard's second chunk, the whole block
      o, m, l = _block(_halves(q, 1)[1], blk[0], blk[1], _halves(pos, 1)[1], blk[2],
                       first([_halves(x, 1)[1] for x in seg]), first(blk[3:]), causal,
                       score_block)
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
      whole = lambda: _grads(q, blk[0], blk[1], pos, blk[2], first(seg), first(blk[3:]),
                             causal, do, lse, delta, score_block)
      if earlier is None or not causal:
        return whole()

      def from_earlier(_):
        kb = [_halves(x, 1)[0] for x in blk]
        dq, dk, dv = _grads(q, kb[0], kb[1], pos, kb[2], first(seg), first(kb[3:]), causal,
                            do, lse, delta, score_block)
        pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)
        return dq, pad(dk), pad(dv)

      def from_later(_):
        hi = lambda x, axis: _halves(x, axis)[1]
        dq, dk, dv = _grads(hi(q, 1), blk[0], blk[1], hi(pos, 1), blk[2],
                            first([hi(x, 1) for x in seg]), first(blk[3:]), causal,
                            hi(do, 3), hi(lse, 3), hi(delta, 3), score_block)
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
           score_block: int = SCORE_BLOCK) -> jax.Array:
  """Self-attention of a sequence split over the seq axes of `heads_split` (`method`:
  all_gather or ring; module doc).

  q [b, t, heads, hd], k/v [b, t, kv_heads, hd], positions and segment_ids (or None) [b, t],
  each split over those axes, in zig-zag order (`zigzag`; the ring skips the blocks that
  order puts after a shard's queries; all_gather takes any order) -> [b, t, heads, hd] in
  q's dtype. `score_block`: (query, key) pairs per head in one chunk of float32 scores
  inside a shard (queries are taken in chunks of about score_block / keys).
  """
  mesh = jax.sharding.get_abstract_mesh()
  axes = seq_axes(heads_split, dict(mesh.shape), mesh.manual_axes)
  h, hd = q.shape[2:]
  kvh = k.shape[2]
  local = {"all_gather": _local_all_gather, "ring": _local_ring}[method]

  def run(q, k, v, pos, seg):
    q5 = q.reshape(q.shape[0], q.shape[1], kvh, h // kvh, hd)
    o = local(q5, k, v, pos, seg, axes, causal, score_block)  # [b, kv, g, t, hd]
    return jnp.einsum("bkgth->btkgh", o).reshape(q.shape).astype(q.dtype)

  act, row = P(None, axes, None, None), P(None, axes)
  segs = () if segment_ids is None else (segment_ids,)
  fn = jax.shard_map(lambda q, k, v, pos, *seg: run(q, k, v, pos, *(seg or (None,))),
                     in_specs=(act, act, act, row) + (row,) * len(segs), out_specs=act,
                     axis_names=set(axes), check_vma=False)
  return fn(q, k, v, positions, *segs)
