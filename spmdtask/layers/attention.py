"""Causal multi-head attention with rotary positions and grouped-query KV heads."""
import flax.linen as nn
import jax
import jax.numpy as jnp

from spmdtask.layers.base import SplitDims, constrain, dense_init, weight


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding on [batch, seq, heads, head_dim] (rotate-half form)."""
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions.astype(jnp.float32)[..., None] * freq
  sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
           kv_pos: jax.Array) -> jax.Array:
  """Causal grouped-query attention.

  Args:
    q: [b, t, heads, hd]; k, v: [b, s, kv_heads, hd], heads a multiple of kv_heads.
    q_pos: [b, t] and kv_pos: [b, s] positions; query i sees keys with kv_pos <= q_pos[i].
  Returns:
    [b, t, heads, hd].
  """
  b, t, h, hd = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, h // kv_heads, hd)
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = scores * (hd ** -0.5)
  mask = kv_pos[:, None, None, None, :] <= q_pos[:, None, None, :, None]
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
  return out.reshape(b, t, h, hd)


class Attention(nn.Module):
  """Projections q/k/v/o around `attend`.

  Weights: q [d_model, heads, hd], k/v [d_model, kv_heads, hd], o [heads, hd, d_model].
  """
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float
  dtype: jnp.dtype
  q_split: SplitDims
  kv_split: SplitDims
  o_split: SplitDims
  heads_act_split: SplitDims | None

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    d, h, kv, hd = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim
    wq = weight(self, "q", (d, h, hd), self.q_split, dense_init(0, (1, 2)))
    wk = weight(self, "k", (d, kv, hd), self.kv_split, dense_init(0, (1, 2)))
    wv = weight(self, "v", (d, kv, hd), self.kv_split, dense_init(0, (1, 2)))
    wo = weight(self, "o", (h, hd, d), self.o_split, dense_init((0, 1), 2))
    dt = self.dtype
    q = constrain(jnp.einsum("btd,dhk->bthk", x, wq.astype(dt)), self.heads_act_split)
    k = constrain(jnp.einsum("btd,dhk->bthk", x, wk.astype(dt)), self.heads_act_split)
    v = constrain(jnp.einsum("btd,dhk->bthk", x, wv.astype(dt)), self.heads_act_split)
    q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
    out = constrain(attend(q, k, v, positions, positions), self.heads_act_split)
    return jnp.einsum("bthk,hkd->btd", out, wo.astype(dt))
