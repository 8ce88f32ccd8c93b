"""Causal multi-head attention with rotary positions and grouped-query KV heads.

For decoding, `Attention` takes an explicit KV cache: it writes the new keys and
values at their positions and attends over the whole fixed-size cache, slots
beyond each query's position masked out, so one compiled step serves every
position.
"""
import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from spmdtask.core import remat
from spmdtask.core.sharding import entry_axes, shards
from spmdtask.errors import ConfigError
from spmdtask.layers import lora as lora_lib, rope
from spmdtask.layers.attention import context as context_attention, fused as fused_attention
from spmdtask.layers.attention import paged as paged_lib, window as window_lib
from spmdtask.layers.base import (Quantizer, RmsNorm, SplitDims, constrain, dense_init,
                                  platform)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
           kv_pos: jax.Array, causal: bool = True, q_seg: jax.Array | None = None,
           kv_seg: jax.Array | None = None, window=None,
           scale: float | None = None) -> jax.Array:
  """Grouped-query attention, causal unless `causal=False` (an encoder), optionally
  within segments (packed rows).

  Args:
    q: [b, t, heads, hd]; k, v: [b, s, kv_heads, hd], heads a multiple of kv_heads.
    q_pos: [b, t] and kv_pos: [b, s] positions; with `causal`, query i sees keys with
      kv_pos <= q_pos[i]; without, every key.
    q_seg: [b, t] and kv_seg: [b, s] segment ids, or None: query i then also sees only
      keys with kv_seg == q_seg[i]. Positions restart per segment, so causality holds
      within each segment.
    window: None, or an int (or traced int scalar): query i then sees only keys with
      kv_pos > q_pos[i] - window (a local layer, layers.attention.window).
    scale: the scores' scale; None: hd**-0.5.
  Returns:
    [b, t, heads, hd].
  """
  b, t, h, hd = q.shape
  kv_heads = k.shape[2]
  if t == 1 and q_seg is None and platform() == "cpu":
    return _attend_one(q, k, v, q_pos, kv_pos, causal, window, scale)
  q = q.reshape(b, t, kv_heads, h // kv_heads, hd)
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = scores * (scale or hd ** -0.5)
  mask = None
  qp, kp = q_pos[:, None, None, :, None], kv_pos[:, None, None, None, :]
  if causal:
    mask = kp <= qp
  if window is not None:
    near = window_lib.visible(qp, kp, window) & (causal or window_lib.visible(kp, qp, window))
    mask = near if mask is None else mask & near
  if q_seg is not None:
    same = kv_seg[:, None, None, None, :] == q_seg[:, None, None, :, None]
    mask = same if mask is None else mask & same
  if mask is not None:
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
  return out.reshape(b, t, h, hd)


def _attend_one(q, k, v, q_pos, kv_pos, causal, window, scale) -> jax.Array:
  """`attend` for one query a row (a decode step) as multiplies and sums: XLA:CPU lowers
  the einsums' batched dots with a transposed copy of each layer's keys and values at every
  step; these fuse and read the cache in place (2x faster here on TinyLm's decode)."""
  b, _, h, hd = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, 1, kv_heads, h // kv_heads, hd).astype(jnp.float32)
  scores = jnp.sum(q * k[:, :, :, None, :].astype(jnp.float32), axis=-1)  # [b, s, kv, g]
  scores = scores * (scale or hd ** -0.5)
  qp, kp = q_pos[:, :, None, None], kv_pos[:, :, None, None]
  mask = kp <= qp if causal else None
  if window is not None:
    near = window_lib.visible(qp, kp, window) & (causal or window_lib.visible(kp, qp, window))
    mask = near if mask is None else mask & near
  if mask is not None:
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=1).astype(v.dtype)
  out = jnp.sum(probs[..., None] * v[:, :, :, None, :], axis=1)  # [b, kv, g, hd]
  return out.reshape(b, 1, h, hd)


class KvCache(NamedTuple):
  """Keys and values (after rope) by slot = position: each [b, max_len, kv_heads, hd].

  In a layer stack the leaves carry a leading [num_layers] dim.
  """
  k: jax.Array
  v: jax.Array


class StackedLayer(NamedTuple):
  """Layer `layer` of a stack's whole cache (KvCache leaves [num_layers, b, max_len, ...]):
  what a one-token decode step's layer stack hands each layer (layers.stack) instead of the
  layer's slice. Scanning the slices out and back copies the whole cache at every step;
  carried whole, a step writes its one token a row in place (`write_stacked`)."""
  stack: KvCache
  layer: jax.Array  # [] int32
  prefix: jax.Array  # [] int32: which of `live_lengths` the step reads (`live_prefix`)


# A decode step reads a layer's cache in blocks of this many positions, up to the block of
# the largest position a row is at: the slots beyond are empty for every row.
LIVE_BLOCK = 32


def write_stacked(cache: jax.Array, new: jax.Array, positions: jax.Array, layer: jax.Array,
                  split_rows: bool) -> jax.Array:
  """The stacked `cache` [L, b, S, ...] with `new` [b, 1, ...] at [layer, row,
  positions[row, 0]] (out of range: dropped), in place. A scatter of one token a row; where
  the rows are split over devices, a select over the layer's slots instead: GSPMD gathers a
  scatter's row indices and tokens to every device (per layer, per step), and a vmapped
  scatter's batching dim makes XLA:CPU transpose the whole cache twice. Measured on one
  device, TinyLm's 64 rows: 4.7 ms a step (scatter), 7.0 (select), 28.8 (vmapped)."""
  if split_rows:
    hit = positions[:, 0][:, None] == jnp.arange(cache.shape[2])[None, :]
    hit = hit.reshape(hit.shape + (1,) * (cache.ndim - 3))
    return cache.at[layer].set(jnp.where(hit, new.astype(cache.dtype), cache[layer]))
  rows = jnp.arange(cache.shape[1])
  return cache.at[layer, rows, positions[:, 0]].set(new[:, 0].astype(cache.dtype), mode="drop")


def live_lengths(max_len: int) -> list[int]:
  """The cache prefixes a decode step may read: multiples of LIVE_BLOCK, then max_len."""
  return list(range(LIVE_BLOCK, max_len, LIVE_BLOCK)) + [max_len]


def live_prefix(positions: jax.Array, max_len: int) -> jax.Array:
  """Which of `live_lengths` a step at `positions` [b, 1] reads: the shortest holding every
  row's position (a max over the rows: found once a step, not in every layer)."""
  return jnp.minimum(jnp.max(positions) // LIVE_BLOCK, len(live_lengths(max_len)) - 1)


def write_cache(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
  """Puts `new` [b, t, ...] into `cache` [b, S, ...] (e.g. [b, S, kv, hd]) at slots
  `positions` [b, t].

  One token (t == 1) is a select over the slots (exact, sharding friendly); a
  longer chunk must hold consecutive positions from `positions[:, 0]` per row.
  """
  new = new.astype(cache.dtype)
  if new.shape[1] == 1:
    hit = positions[:, 0][:, None] == jnp.arange(cache.shape[1])[None, :]
    return jnp.where(hit.reshape(hit.shape + (1,) * (cache.ndim - 2)), new, cache)
  return jax.vmap(lambda c, n, p: jax.lax.dynamic_update_slice_in_dim(c, n, p, axis=0))(
      cache, new, positions[:, 0])


class Attention(nn.Module):
  """Projections q/k/v/o around `attend`.

  Weights: q [d_model, heads, hd], k/v [d_model, kv_heads, hd], o [heads, hd, d_model].
  Rotary positions unless `rope_theta` is None; causal unless `causal=False`. With
  `qk_norm` (Qwen3), q and k are RMS-normalized over head_dim (a [head_dim] scale each,
  shared by the heads, eps `norm_eps`) before the rotary positions.
  `impl` is the kernel of full-sequence attention (`layers.attention.fused`: auto, xla,
  splash, cudnn); with a KV cache (decoding) attention is always `attend` (xla). Where
  `heads_act_split` splits the sequence over mesh axes, `context` says how attention runs
  across the shards (`layers.attention.context`: all_gather or ring; `impl` then picks the
  ring's block kernel, `context_attention.choose`).
  With `lora` (layers.lora) the weights are frozen and its targets among q, k, v, o get
  adapters; `lora_drop` gives their dropout masks' source.
  `window` makes the layer local (layers.attention.window: each query sees its last
  `window` keys), with RoPE base `local_rope_theta` (unscaled) where that is set; called
  with a traced `is_local` flag (a stack mixing local and global layers), the layer is
  local where it is True and global (`rope_theta`, `rope_scaling`, every key) elsewhere.
  `scale` is the scores' scale (None: head_dim**-0.5; Gemma: query_pre_attn_scalar**-0.5);
  `norm_offset` the q/k norms' (1.0: Gemma's 1 + w).
  Called as `(x, positions, segment_ids=None, cache=None, lora_drop=None, is_local=None)
  -> (out, new_cache)`; new_cache is None without a cache. `segment_ids` [b, t] (packed
  rows) keep attention within a segment.
  """
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float | None
  dtype: jnp.dtype
  q_split: SplitDims
  kv_split: SplitDims
  o_split: SplitDims
  heads_act_split: SplitDims | None
  rope_scaling: rope.Scaling | None = None  # rescaled RoPE frequencies (global layers)
  causal: bool = True
  impl: str = "xla"
  qk_norm: bool = False
  norm_eps: float = 1e-6
  context: str = "all_gather"  # across a split sequence (layers.attention.context)
  score_block: int = context_attention.SCORE_BLOCK  # pairs per head in a chunk of scores there
  at_once: tuple[str, ...] = ()  # of 'q', 'kv', 'o': FSDP gathers (lm_splits.WeightSplit)
  lora: lora_lib.LoraConfig | None = None
  window: int | None = None  # a local layer's (layers.attention.window); None: global
  local_rope_theta: float | None = None  # local layers' RoPE base; None: rope_theta
  scale: float | None = None  # the scores' scale; None: head_dim**-0.5
  norm_offset: float = 0.0  # q/k norms: scale = offset + w
  quant: Quantizer | None = None  # quantized projections (layers.quant)

  def _rope(self, x, positions, is_local):
    """x with rotary positions at this layer's base (a local layer's, a global one's, or,
    with a traced `is_local`, the one it selects)."""
    hd = x.shape[-1]
    global_freq = lambda: rope.frequencies(hd, self.rope_theta, self.rope_scaling)
    if self.window is None or self.local_rope_theta is None:
      return rope.apply_frequencies(x, positions, global_freq())
    local_freq = rope.frequencies(hd, self.local_rope_theta)
    freq = local_freq if is_local is None else jnp.where(is_local, local_freq, global_freq())
    return rope.apply_frequencies(x, positions, freq)

  def _attend_live(self, q, cache: StackedLayer, positions, is_local) -> jax.Array:
    """One query a row over its layer's cache up to the live prefix (`live_prefix`): one
    branch a prefix length, each reading only that much of the stacked cache."""
    stack_k, stack_v = cache.stack
    lengths = live_lengths(stack_k.shape[2])

    def prefix(n):
      def attend_prefix(q):
        start = (cache.layer,) + (0,) * (stack_k.ndim - 1)
        cut = (1,) + stack_k.shape[1:2] + (n,) + stack_k.shape[3:]
        k, v = (constrain(jax.lax.dynamic_slice(x, start, cut)[0], self.heads_act_split)
                for x in (stack_k, stack_v))
        kv_pos = jnp.broadcast_to(jnp.arange(n), (k.shape[0], n))
        return self._attend(q, k, v, positions, kv_pos, None, True, is_local)
      return attend_prefix
    return jax.lax.switch(cache.prefix, [prefix(n) for n in lengths], q)

  def _attend_paged(self, q, cache: paged_lib.PagedLayer, positions, is_local) -> jax.Array:
    """One query a slot over its prompt's KV and its first pages (`paged.read`): one branch
    a page count, each reading only that many pages a slot."""
    def pages(n):
      def attend_pages(q):
        (k, v), kv_pos = paged_lib.read(cache, n)
        k, v = (constrain(x, self.heads_act_split) for x in (k, v))
        return self._attend(q, k, v, positions, kv_pos, None, True, is_local)
      return attend_pages
    return jax.lax.switch(cache.prefix, [pages(n + 1) for n in range(cache.stack.table.shape[1])],
                          q)

  def _attend(self, q, k, v, q_pos, kv_pos, segment_ids, decoding: bool,
              is_local=None) -> jax.Array:
    """Full sequences: the kernel `impl` resolves to, or, where the sequence is split over
    mesh axes, `context_attention`; decoding (a KV cache): `attend`."""
    mesh = jax.sharding.get_abstract_mesh()
    seq_axes = () if decoding else context_attention.seq_axes(
        self.heads_act_split, dict(mesh.shape), () if mesh.empty else mesh.manual_axes)
    if seq_axes and self.window is not None:
      raise ConfigError(
          "task.model.sliding_window: local attention over a sequence split across mesh "
          f"axes {seq_axes} (task.model.activation_split_dims_mapping.heads) is not "
          "supported: split batch and heads only, or drop the local layers.")
    if seq_axes:
      backend = platform()
      impl = context_attention.choose(
          self.context, self.impl, backend, q.shape[1] // shards(seq_axes, mesh.shape),
          q.shape[2], self.heads_act_split, dict(mesh.shape))
      return context_attention.attend(self.context, q, k, v, q_pos, segment_ids, self.causal,
                                      self.heads_act_split, self.score_block, impl=impl,
                                      backend=backend)
    if not decoding:
      backend = platform()
      impl = fused_attention.choose(
          self.impl, backend, q.shape[1], q.shape[2], q.shape[3], q.dtype,
          segment_ids is not None, self.heads_act_split,
          dict(jax.sharding.get_abstract_mesh().shape),
          fused_attention.gpu_compute_capability() if backend == "gpu" else (0, 0))
      if impl != "xla":
        return fused_attention.fused(impl, q, k, v, segment_ids, self.causal,
                                     self.heads_act_split, backend, self.window, self.scale,
                                     is_local)
    return attend(q, k, v, q_pos, kv_pos, self.causal, segment_ids, segment_ids,
                  window_lib.effective(self.window, is_local), self.scale)

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
               cache: KvCache | None = None, lora_drop: lora_lib.Dropout | None = None,
               is_local: jax.Array | None = None):
    d, h, kv, hd, lora = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, self.lora
    weight = functools.partial(lora_lib.projection_weight, self, cfg=lora)
    wq = weight("q", (d, h, hd), self.q_split, dense_init(0, (1, 2)))
    wk = weight("k", (d, kv, hd), self.kv_split, dense_init(0, (1, 2)))
    wv = weight("v", (d, kv, hd), self.kv_split, dense_init(0, (1, 2)))
    wo = weight("o", (h, hd, d), self.o_split, dense_init((0, 1), 2))
    dt, heads = self.dtype, self.heads_act_split

    def proj(name, w, split, w_name, field):
      return constrain(lora_lib.project(self, name, "btd,dhk->bthk", x, w, split, heads, dt,
                                        lora, lora_drop, gathered_name=w_name,
                                        at_once=field in self.at_once, quant=self.quant),
                       heads)
    # Named for the remat presets (spmdtask.core.remat): what a backward may keep.
    q = checkpoint_name(proj("q", wq, self.q_split, remat.Q_WEIGHT, "q"), remat.Q_PROJ)
    k = checkpoint_name(proj("k", wk, self.kv_split, remat.K_WEIGHT, "kv"), remat.K_PROJ)
    v = checkpoint_name(proj("v", wv, self.kv_split, remat.V_WEIGHT, "kv"), remat.V_PROJ)
    if self.qk_norm:
      frozen = lora_lib.frozen(lora)
      q = RmsNorm(hd, self.norm_eps, (None,), frozen, self.norm_offset, name="q_norm")(q)
      k = RmsNorm(hd, self.norm_eps, (None,), frozen, self.norm_offset, name="k_norm")(k)
    if self.rope_theta is not None:
      q, k = self._rope(q, positions, is_local), self._rope(k, positions, is_local)
    if cache is None:
      kv_pos = positions
    elif isinstance(cache, StackedLayer):
      # rows split by GSPMD (not by hand: a shard_map's manual axes hold local rows)
      mesh = jax.sharding.get_abstract_mesh()
      manual = () if mesh.empty else mesh.manual_axes
      split = any(dict(mesh.shape).get(a, 1) > 1 and a not in manual
                  for a in entry_axes(self.heads_act_split[0]))
      cache = StackedLayer(KvCache(*(write_stacked(c, x, positions, cache.layer, split)
                                     for c, x in ((cache.stack.k, k), (cache.stack.v, v)))),
                           cache.layer, cache.prefix)
      out = self._attend_live(q, cache, positions, is_local)
    elif isinstance(cache, paged_lib.PagedLayer):  # completions in pages (GRPO's sampler)
      cache = paged_lib.write(cache, KvCache(k, v), positions)
      out = self._attend_paged(q, cache, positions, is_local)
    else:
      k = constrain(write_cache(cache.k, k, positions), self.heads_act_split)
      v = constrain(write_cache(cache.v, v, positions), self.heads_act_split)
      cache = KvCache(k, v)
      kv_pos = jnp.broadcast_to(jnp.arange(k.shape[1]), (k.shape[0], k.shape[1]))
    if cache is not None and segment_ids is not None:
      raise ValueError("segment_ids are for packed training rows, not for a KV cache.")
    if not isinstance(cache, (StackedLayer, paged_lib.PagedLayer)):
      out = self._attend(q, k, v, positions, kv_pos, segment_ids, cache is not None, is_local)
    out = constrain(out, self.heads_act_split)
    out = checkpoint_name(out, remat.ATTN_CONTEXT)
    out = lora_lib.project(self, "o", "bthk,hkd->btd", out, wo, self.o_split, heads, dt, lora,
                           lora_drop, at_once="o" in self.at_once, quant=self.quant)
    return checkpoint_name(out, remat.ATTN_OUT), cache
