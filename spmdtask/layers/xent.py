"""Cross entropy without a gather, and over vocabulary tiles.

`cross_entropy(logits, labels)` is optax's `softmax_cross_entropy_with_integer_labels`
written with a one-hot select (`iota == label`) instead of `take_along_axis`: the same value
and gradient, but XLA:TPU no longer keeps the float32 logits alive for the gather's backward
(Llama-3-8B at 8192 tokens per chip: 3.9 GiB).

`tiled_cross_entropy(x, w, labels, tiles)` fuses the LM head with the loss: the logits
`x @ w` [tokens, vocab] are never whole. The vocabulary is cut into `tiles` strided tiles
(tile j holds vocab ids j, j + tiles, j + 2·tiles, ..., so a vocab dim split over a mesh axis
splits every tile evenly); a scan computes each tile's log-sum-exp and label logit, and the
backward scan recomputes each tile's logits (one more head matmul) to give its softmax
gradient. Under FSDP (w split over axes that also split the batch) the loss runs under a
`jax.shard_map` manual over the batch's axes, as `layers.base.project` does: the forward
gathers each tile where it is used (`base.gather`) and keeps it for the backward, so the
head is gathered once per step (its bf16 copy, vocab x d_model x 2 bytes per device, held
from the loss's forward to its backward, which follow each other), and each tile's
gradient leaves reduce-scattered to the weight's own shards (`base.scatter`), never whole
and never all-reduced.

`tiled_scores` is the same forward that also gives each token's argmax id (a scorer's
"was the target the greedy token"): each tile's greatest logit and its first id, then the
first id of the greatest over the tiles, so the logits stay tiled there too.
"""
import functools

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from spmdtask.layers import base
from spmdtask.layers.base import SplitDims, constrain


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-example cross entropy [...] of float `logits` [..., n] and int `labels` [...]."""
  logits = logits.astype(jnp.float32)
  picked = jnp.sum(jnp.where(_one_hot(labels, logits.shape[-1], 0, 1), logits, 0.0), -1)
  return jax.nn.logsumexp(logits, axis=-1) - picked


def _one_hot(labels, n: int, offset, stride) -> jax.Array:
  """[..., n] bool: column c holds vocab id offset + c·stride; True where it is the label."""
  return (offset + stride * jax.lax.broadcasted_iota(jnp.int32, (*labels.shape, n),
                                                     labels.ndim)) == labels[..., None]


def head_tiles(w: jax.Array, tiles: int, split: SplitDims | None = None) -> jax.Array:
  """The head weight w [d, vocab] as [tiles, d, ceil(vocab / tiles)] strided tiles (zero
  columns pad the last ids), each split as w is (`split`, w's mapping): still sharded;
  `tiled_cross_entropy` gathers it once."""
  d, v = w.shape
  cols = -(-v // tiles)
  w = jnp.pad(w, ((0, 0), (0, cols * tiles - v))) if cols * tiles != v else w
  w = w.reshape(d, cols, tiles).transpose(2, 0, 1)
  return w if split is None else constrain(w, (None, *split))


def tiled_cross_entropy(x: jax.Array, w_tiles: jax.Array, labels: jax.Array, vocab: int,
                        scale: float = 1.0, logits_split: SplitDims | None = None,
                        weight_split: SplitDims | None = None) -> jax.Array:
  """Per-token cross entropy [b, t] float32 of the logits `scale · x @ w` without the whole
  logits: x [b, t, d], `w_tiles` = `head_tiles(w, ...)`, labels [b, t] int in [0, vocab).

  Each tile's logits [b, t, cols] are float32 and constrained to `logits_split` (whose dim
  0 entry is x's batch split); with `weight_split` (w's mapping [d, vocab]) under FSDP the
  head is gathered once and its gradient reduce-scattered (module doc).
  """
  return _sharded(False, x, w_tiles, labels, vocab, scale, logits_split, weight_split)


def tiled_scores(x: jax.Array, w_tiles: jax.Array, labels: jax.Array, vocab: int,
                 scale: float = 1.0, logits_split: SplitDims | None = None,
                 weight_split: SplitDims | None = None) -> tuple[jax.Array, jax.Array]:
  """`tiled_cross_entropy`'s per-token cross entropy [b, t] and each token's argmax id
  [b, t] int32: the first id of the greatest logit (as `jnp.argmax` of the whole logits),
  from each tile's greatest logit and its first id. For scoring: no gradient flows
  through the ids."""
  return _sharded(True, x, w_tiles, labels, vocab, scale, logits_split, weight_split)


def _sharded(argmax, x, w_tiles, labels, vocab, scale, logits_split, weight_split):
  """`_tiled` under FSDP's shard_map where the head is split over the batch's axes."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = base.batch_axes(mesh, logits_split, x.shape[0])
  axes = weight_split and base.fsdp_axes(w_tiles.shape[1:], weight_split, manual)
  if not axes:  # GSPMD partitions the plain products
    return _tiled(vocab, scale, logits_split, (), argmax, x, w_tiles, labels)
  rows = P(manual)
  # The head is the same on axes that split only the batch (data): varying there, its
  # gradient is summed over them (pcast's transpose) after the reduce-scatter.
  replicas = tuple(a for a in manual if not any(a in dim_axes for dim_axes in axes))
  local = lambda x, w, labels: _tiled(vocab, scale, logits_split, axes, argmax, x,
                                      jax.lax.pcast(w, replicas, to="varying"), labels)
  w_tiles = w_tiles.astype(base.moved_dtype(x.dtype))  # the dtype its shards move in
  return jax.shard_map(local, in_specs=(rows, P(None, *[a or None for a in axes]), rows),
                       out_specs=(rows, rows) if argmax else rows,
                       axis_names=set(manual))(x, w_tiles, labels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _tiled(vocab, scale, logits_split, axes, argmax, x, w_tiles, labels):
  return _forward(vocab, scale, logits_split, axes, argmax, x, w_tiles, labels)[0]


def _masked_logits(x, w, j, tiles, vocab, scale, logits_split):
  """Tile j's float32 logits [b, t, cols] of a whole tile w; padding ids (>= vocab) at -inf."""
  logits = jnp.einsum("btd,dv->btv", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
  ids = j + tiles * jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
  return constrain(jnp.where(ids < vocab, logits * scale, -jnp.inf), logits_split)


def _forward(vocab, scale, logits_split, axes, argmax, x, w_tiles, labels):
  """Per-token losses (`argmax`: and argmax ids), and the residuals: the gathered tiles
  among them (`axes`: per dim of a tile, the manual axes splitting it; () outside a
  shard_map)."""
  tiles = w_tiles.shape[0]

  def tile(_, jw):
    j, w = jw
    w = base.gather(w, axes) if axes else w
    logits = _masked_logits(x, w, j, tiles, vocab, scale, logits_split)
    picked = jnp.sum(jnp.where(_one_hot(labels, w.shape[-1], j, tiles), logits, 0.0), -1)
    best = (jnp.max(logits, -1), j + tiles * jnp.argmax(logits, -1)) if argmax else ()
    return None, (jax.nn.logsumexp(logits, axis=-1), picked, w, *best)

  _, (lse, picked, whole, *best) = jax.lax.scan(tile, None, (jnp.arange(tiles), w_tiles))
  lse = jax.nn.logsumexp(lse, axis=0)
  loss = lse - jnp.sum(picked, axis=0)
  if argmax:  # the first id of the greatest logit: the least id among the tiles holding it
    tile_max, tile_ids = best
    ids = jnp.min(jnp.where(tile_max == jnp.max(tile_max, 0), tile_ids, vocab), 0)
    loss = (loss, ids.astype(jnp.int32))
  return loss, (x, whole, labels, lse)


def _backward(vocab, scale, logits_split, axes, argmax, res, g):
  g = g[0] if argmax else g  # (the ids have no gradient)
  x, whole, labels, lse = res
  tiles = whole.shape[0]

  def tile(dx, jw):
    j, w = jw
    logits = _masked_logits(x, w, j, tiles, vocab, scale, logits_split)
    # d loss / d logits = softmax - one-hot; padding ids have p = 0 and no label.
    dlogits = ((jnp.exp(logits - lse[..., None])
                - _one_hot(labels, w.shape[-1], j, tiles)) * (g * scale)[..., None])
    dlogits = dlogits.astype(x.dtype)
    dx_j = jnp.einsum("btv,dv->btd", dlogits, w.astype(x.dtype),
                      preferred_element_type=jnp.float32)
    dw = jnp.einsum("btd,btv->dv", x, dlogits, preferred_element_type=w.dtype)
    return dx + dx_j, base.scatter(dw, axes) if axes else dw

  dx, dw = jax.lax.scan(tile, jnp.zeros_like(x, jnp.float32), (jnp.arange(tiles), whole))
  return dx.astype(x.dtype), dw.astype(whole.dtype), None


_tiled.defvjp(_forward, _backward)
