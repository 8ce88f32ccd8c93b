"""One shard's queries against one K/V block by einsums (the xla block kernel of
`layers.attention.context`): masks from true positions and segment ids, float32 scores,
queries taken in chunks so that only one chunk's scores live at a time."""
import dataclasses

import jax
import jax.numpy as jnp

# (query, key) pairs per head in one chunk of the forward's float32 scores [b, kv, g, t', s];
# the backward, which holds about twice as many such arrays at once (probabilities, dp, ds),
# takes half. Llama-3.1-8B at 128k over context 16 (32 heads, 8192 keys a ring step): 512
# queries a forward chunk (512 MiB), 256 a backward one. Measured on its v5p-128 plan,
# temporaries | HBM bytes per chip per step: whole blocks 20.2 GiB | 24.6 TiB; 512 both
# ways 8.87 | 26.9; 512 and 256 8.03 | 27.8; 256 both 7.97 | 28.6 (each chunk re-reads its
# K/V block and the backward's dk/dv sums: smaller chunks, more traffic).
SCORE_BLOCK = 512 * 8192


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


def block(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal: bool, score_block: int):
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


def grads(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, do, lse, delta, score_block: int):
  """`_grads_dense` over chunks of queries, half as long as `block`'s for the same
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


@dataclasses.dataclass(frozen=True)
class XlaBlocks:
  """The ring's block kernel by einsums (`block`, `grads`): the mask from positions and
  segments (`causal`), whatever the block; queries in chunks of `score_block` (query, key)
  pairs. Arrays as `block` and `grads` take them."""
  causal: bool
  score_block: int = SCORE_BLOCK

  def forward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, diagonal: bool):
    """A block's partial softmax (unnormalized o, running max m, sum l), float32."""
    del diagonal
    return block(q, k, v, q_pos, kv_pos, q_seg, kv_seg, self.causal, self.score_block)

  def grads(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, diagonal: bool, do, o, lse, delta):
    """A block's share of (dq, dk, dv), float32, from the ring's output cotangent `do`,
    log-sum-exp `lse` and delta = rowsum(o·do) (`o` itself is not read)."""
    del diagonal, o
    return grads(q, k, v, q_pos, kv_pos, q_seg, kv_seg, self.causal, do, lse, delta,
                 self.score_block)
