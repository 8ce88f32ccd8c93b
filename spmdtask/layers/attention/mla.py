"""Multi-head latent attention (MLA: DeepSeek-V2 / V3), chosen by `TransformerLm.mla`.

Queries come from x directly (`q` [d, heads, qk_head_dim]; V2-Lite) or through a
low-rank latent (`q_down` [d, q_lora_rank], an RMSNorm, `q_up` [q_lora_rank, heads,
qk_head_dim]). Keys and values share one compressed latent: `kv_down` [d, kv_lora_rank +
qk_rope_head_dim] gives the latent (RMS-normalized) and one RoPE key part shared by every
head; `kv_up` [kv_lora_rank, heads, qk_nope_head_dim + v_head_dim] expands the latent into
each head's non-rotary key part and its value. A head's key is [nope, rope], its query
the same; the softmax scale is qk_head_dim^-0.5 times YaRN's mscale² (`rope_scaling`).

KV cache (`MlaCache`): per slot the normalized latent and the rotated RoPE key,
(kv_lora_rank + qk_rope_head_dim) values per token and layer, not 2·heads·head_dim. At
decode the up-projection is absorbed (DeepSeek-V2 §2.1.3): the query's nope part is
mapped into latent space (q·W_uk), scores are taken against the cached latents directly,
and the weighted latents are mapped out by W_uv: per step the work grows with the cache
length times kv_lora_rank, never with heads × head_dim, and no per-head key or value is
ever materialized. Full sequences (training, prefill) expand the latent instead: there
the t × s score matrix dominates and the expanded heads are cheaper (192 vs 512 wide), and
the fused kernels (`impl`: splash on TPU, cuDNN on GPU) run them, v padded to the query's
width.

RoPE: DeepSeek's rotary dims are interleaved pairs (2i, 2i+1) (`rope_interleave`, what
HF's V2 and V3 with rope_interleave do); they are de-interleaved into the rotate-half form
(`layers.rope`) for queries and keys alike, which leaves every q·k unchanged.
"""
import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from spmdtask.core import remat, sharding
from spmdtask.errors import ConfigError
from spmdtask.layers import lora as lora_lib, rope
from spmdtask.layers.attention.mha import write_cache
from spmdtask.layers.attention import fused as fused_attention
from spmdtask.layers.base import RmsNorm, SplitDims, constrain, dense_init, platform

FIELD = "task.model.mla"
LATENT_NORM_EPS = 1e-6  # HF's q_a_layernorm / kv_a_layernorm use the RMSNorm default
# WeightSplit fields of MLA's own weights (the query without a latent uses `q`, the output `o`).
WEIGHTS = ("mla_q_down", "mla_q_up", "mla_kv_down", "mla_kv_up")


@dataclasses.dataclass(frozen=True)
class MlaConfig:
  """The MLA fields of a TransformerLm (`mla`; None = multi-head attention). HF names:
  q_lora_rank (None: a direct q projection), kv_lora_rank, qk_nope_head_dim,
  qk_rope_head_dim, v_head_dim, rope_interleave; `rope_scaling` the YaRN of rope_parameters."""
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  q_lora_rank: int | None = None
  rope_interleave: bool = True
  rope_scaling: rope.YarnScaling | None = None

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def softmax_scale(self) -> float:
    factor = 1.0 if self.rope_scaling is None else self.rope_scaling.softmax_factor
    return self.qk_head_dim ** -0.5 * factor

  def weight_shapes(self, d_model: int, heads: int) -> dict[str, tuple[int, ...]]:
    """WeightSplit field -> the shape of the weight it maps (`q` only without q_lora_rank)."""
    out = dict(mla_kv_down=(d_model, self.kv_lora_rank + self.qk_rope_head_dim),
               mla_kv_up=(self.kv_lora_rank, heads, self.qk_nope_head_dim + self.v_head_dim),
               o=(heads, self.v_head_dim, d_model))
    if self.q_lora_rank:
      out.update(mla_q_down=(d_model, self.q_lora_rank),
                 mla_q_up=(self.q_lora_rank, heads, self.qk_head_dim))
    else:
      out["q"] = (d_model, heads, self.qk_head_dim)
    return out

  def cache_shape(self, lead: tuple[int, ...], dtype) -> "MlaCache":
    """ShapeDtypeStructs of an empty cache: `lead` (e.g. [layers, batch, slots]) + [latent]
    and + [rope dim]."""
    return MlaCache(jax.ShapeDtypeStruct(lead + (self.kv_lora_rank,), dtype),
                    jax.ShapeDtypeStruct(lead + (self.qk_rope_head_dim,), dtype))

  def validate(self, wsplit, mesh_shape: dict[str, int]) -> None:
    """ConfigError naming the field: ranks and dims positive, the RoPE dim even, and each
    latent rank dividing over the mesh axes its weights split it over (an uneven latent
    would be padded, and its RMSNorm would then average over the padding)."""
    dims = dict(kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
    if self.q_lora_rank is not None:
      dims["q_lora_rank"] = self.q_lora_rank
    for name, value in dims.items():
      if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{FIELD}.{name}={value!r} must be a positive int"
                          + (" (or q_lora_rank=None: a direct q projection)."
                             if name == "q_lora_rank" else "."))
    if self.qk_rope_head_dim % 2:
      raise ConfigError(f"{FIELD}.qk_rope_head_dim={self.qk_rope_head_dim} must be even: "
                        "rotary positions rotate pairs of dims.")
    if self.rope_scaling is not None:
      self.rope_scaling.validate(f"{FIELD}.rope_scaling")
    ranks = [("mla_kv_down", 1, self.kv_lora_rank + self.qk_rope_head_dim, "kv_lora_rank + "
              "qk_rope_head_dim"), ("mla_kv_up", 0, self.kv_lora_rank, "kv_lora_rank")]
    if self.q_lora_rank:
      ranks += [("mla_q_down", 1, self.q_lora_rank, "q_lora_rank"),
                ("mla_q_up", 0, self.q_lora_rank, "q_lora_rank")]
    for field, dim, size, what in ranks:
      entry = getattr(wsplit, field)[dim]
      n = sharding.shards(entry, mesh_shape)
      if size % n:
        raise ConfigError(
            f"{FIELD}: {what}={size} does not divide over the {n} shards of "
            f"task.model.weight_split_dims_mapping.{field}[{dim}]={entry!r}: the latent "
            f"is RMS-normalized whole, so each shard must hold an equal part. Split that "
            f"dim over axes whose size divides {size} (or None), or change the rank.")


class MlaCache(NamedTuple):
  """Per slot = position: the normalized KV latent [b, max_len, kv_lora_rank] and the
  rotated RoPE key [b, max_len, qk_rope_head_dim]; a leading [num_layers] dim in a stack."""
  latent: jax.Array
  k_rope: jax.Array


def _deinterleaved(x: jax.Array) -> jax.Array:
  """[..., 2n] pairs (2i, 2i+1) -> the rotate-half layout (i, i + n)."""
  return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _mask(q_pos, kv_pos, q_seg, kv_seg):
  """[b, 1, t, s]: key j visible to query i (causal, within a segment)."""
  mask = kv_pos[:, None, None, :] <= q_pos[:, None, :, None]
  if q_seg is not None:
    mask &= kv_seg[:, None, None, :] == q_seg[:, None, :, None]
  return mask


def _softmax(scores, mask):
  return jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)


def attend(q, k, v, q_pos, kv_pos, scale: float, q_seg=None, kv_seg=None) -> jax.Array:
  """Causal attention of q, k [b, t|s, h, qk] and v [b, s, h, v] with softmax scale
  `scale` (float32 scores) -> [b, t, h, v]."""
  scores = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=jnp.float32) * scale
  probs = _softmax(scores, _mask(q_pos, kv_pos, q_seg, kv_seg)).astype(v.dtype)
  return jnp.einsum("bhts,bshv->bthv", probs, v)


def attend_latent(q_nope, q_rope, latent, k_rope, w_uk, w_uv, q_pos, kv_pos, scale: float
                  ) -> jax.Array:
  """Absorbed attention over the cache: q_nope [b, t, h, n], q_rope [b, t, h, p], latent
  [b, s, r], k_rope [b, s, p], w_uk [r, h, n], w_uv [r, h, v] -> [b, t, h, v]."""
  q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk)
  scores = (jnp.einsum("bthr,bsr->bhts", q_lat, latent, preferred_element_type=jnp.float32)
            + jnp.einsum("bthp,bsp->bhts", q_rope, k_rope, preferred_element_type=jnp.float32))
  probs = _softmax(scores * scale, _mask(q_pos, kv_pos, None, None)).astype(latent.dtype)
  return jnp.einsum("bthr,rhv->bthv", jnp.einsum("bhts,bsr->bthr", probs, latent), w_uv)


class Mla(nn.Module):
  """MLA (module doc). Called as `(x, positions, segment_ids=None, cache=None,
  lora_drop=None) -> (out, new_cache)` like `mha.Attention`; `wsplit` a WeightSplit (its q,
  o and mla_* fields), `heads_split` the [b, t, heads, dim] activations' mapping. With
  `lora` (layers.lora) the weights are frozen and its targets among q (or q_down, q_up),
  kv_down, kv_up and o get adapters; at decode kv_up's effective weight is absorbed."""
  d_model: int
  num_heads: int
  cfg: MlaConfig
  rope_theta: float
  dtype: jnp.dtype
  wsplit: object
  heads_split: SplitDims | None
  impl: str = "xla"  # full sequences' kernel (layers.attention.fused: auto, xla, splash, cudnn)
  lora: lora_lib.LoraConfig | None = None

  def _full(self, q, k, v, positions, segment_ids):
    """Attention over full sequences: `attend`, or the fused kernel `impl` resolves to (q
    rescaled so the kernel's qk_head_dim^-0.5 gives MLA's scale, v zero-padded to
    qk_head_dim and the output cut back to v_head_dim)."""
    backend, c = platform(), self.cfg
    impl = fused_attention.choose(
        self.impl, backend, q.shape[1], q.shape[2], q.shape[3], q.dtype, segment_ids is not None,
        self.heads_split, dict(jax.sharding.get_abstract_mesh().shape),
        fused_attention.gpu_compute_capability() if backend == "gpu" else (0, 0))
    if impl == "xla":
      return attend(q, k, v, positions, positions, c.softmax_scale, segment_ids, segment_ids)
    q = q * jnp.asarray(c.softmax_scale * c.qk_head_dim ** 0.5, q.dtype)
    v = jnp.pad(v, ((0, 0),) * 3 + ((0, c.qk_head_dim - c.v_head_dim),))
    out = fused_attention.fused(impl, q, k, constrain(v, self.heads_split), segment_ids, True,
                                self.heads_split, backend)
    return out[..., :c.v_head_dim]

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
               cache: MlaCache | None = None, lora_drop: lora_lib.Dropout | None = None):
    c, d, h, ws, dt, lora = self.cfg, self.d_model, self.num_heads, self.wsplit, self.dtype, \
        self.lora
    heads = self.heads_split
    rows = None if heads is None else (heads[0], heads[1], None)  # [b, t, latent]
    param = lambda name, shape, split, init: lora_lib.weight(self, name, shape, split, init, lora)
    lin = lambda name, eqn, inp, w, split, out: constrain(lora_lib.project(
        self, name, eqn, inp, w, split, rows, dt, lora, lora_drop), out)
    frozen = lora_lib.frozen(lora)
    if c.q_lora_rank:
      wqa = param("q_down", (d, c.q_lora_rank), ws.mla_q_down, dense_init(0, 1))
      wqb = param("q_up", (c.q_lora_rank, h, c.qk_head_dim), ws.mla_q_up, dense_init(0, (1, 2)))
      q_lat = RmsNorm(c.q_lora_rank, LATENT_NORM_EPS, frozen=frozen, name="q_norm")(
          lin("q_down", "btd,dr->btr", x, wqa, ws.mla_q_down, rows))
      q = lin("q_up", "btr,rhk->bthk", q_lat, wqb, ws.mla_q_up, heads)
    else:
      wq = param("q", (d, h, c.qk_head_dim), ws.q, dense_init(0, (1, 2)))
      q = lin("q", "btd,dhk->bthk", x, wq, ws.q, heads)
    q = checkpoint_name(q, remat.Q_PROJ)
    wkva = param("kv_down", (d, c.kv_lora_rank + c.qk_rope_head_dim), ws.mla_kv_down,
                 dense_init(0, 1))
    wkvb = param("kv_up", (c.kv_lora_rank, h, c.qk_nope_head_dim + c.v_head_dim), ws.mla_kv_up,
                 dense_init(0, (1, 2)))
    wo = param("o", (h, c.v_head_dim, d), ws.o, dense_init((0, 1), 2))
    kv = lin("kv_down", "btd,dr->btr", x, wkva, ws.mla_kv_down, rows)
    latent = RmsNorm(c.kv_lora_rank, LATENT_NORM_EPS, frozen=frozen, name="kv_norm")(
        kv[..., :c.kv_lora_rank])
    latent = checkpoint_name(latent, remat.K_PROJ)
    q_nope, q_rope, k_rope = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:], \
        kv[..., c.kv_lora_rank:][:, :, None, :]
    if c.rope_interleave:
      q_rope, k_rope = _deinterleaved(q_rope), _deinterleaved(k_rope)
    q_rope = rope.apply(q_rope, positions, self.rope_theta, c.rope_scaling)
    k_rope = rope.apply(k_rope, positions, self.rope_theta, c.rope_scaling)[:, :, 0]
    if cache is None:
      kv_up = lin("kv_up", "btr,rhk->bthk", latent, wkvb, ws.mla_kv_up, heads)
      k_nope, v = kv_up[..., :c.qk_nope_head_dim], kv_up[..., c.qk_nope_head_dim:]
      k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], k_nope.shape[:3]
                                                    + (c.qk_rope_head_dim,))], axis=-1)
      q = constrain(jnp.concatenate([q_nope, q_rope], axis=-1), heads)
      out = self._full(q, constrain(k, heads), constrain(v, heads), positions, segment_ids)
    else:
      if segment_ids is not None:
        raise ValueError("segment_ids are for packed training rows, not for a KV cache.")
      cache = MlaCache(constrain(write_cache(cache.latent, latent, positions), rows),
                       constrain(write_cache(cache.k_rope, k_rope, positions), rows))
      s = cache.latent.shape[1]
      kv_pos = jnp.broadcast_to(jnp.arange(s), (x.shape[0], s))
      w_up = lora_lib.effective(self, "kv_up", "btr,rhk->bthk", wkvb, lora).astype(dt)
      out = attend_latent(q_nope, q_rope, cache.latent.astype(dt), cache.k_rope.astype(dt),
                          w_up[..., :c.qk_nope_head_dim], w_up[..., c.qk_nope_head_dim:],
                          positions, kv_pos, c.softmax_scale)
    out = checkpoint_name(constrain(out, heads), remat.ATTN_CONTEXT)
    out = lora_lib.project(self, "o", "bthv,hvd->btd", out, wo, ws.o, heads, dt, lora, lora_drop)
    return checkpoint_name(out, remat.ATTN_OUT), cache
