"""The pre-norm Transformer block (attention + MLP) that LM and ViT stacks are made of.

A block's split-dims mappings come in two objects with these fields (the LM's
`WeightSplit` / `ActivationSplit` and the ViT's have them, with more of their own):
  weights: q, kv, o, mlp_in, mlp_out, norm; activations: embed, heads, ff.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from spmdtask.core import remat, train_state
from spmdtask.errors import ConfigError
from spmdtask.layers import base
from spmdtask.layers.attention import context as context_attention_lib
from spmdtask.layers import lora as lora_lib
from spmdtask.layers.attention.mha import Attention, KvCache
from spmdtask.layers.attention.mla import Mla, MlaConfig
from spmdtask.layers.rope import Scaling
from spmdtask.layers.base import RmsNorm, SplitDims, constrain, dense_init


# Gated MLP activations: name -> the gate's nonlinearity.
GATED = {"swiglu": jax.nn.silu, "geglu": lambda g: jax.nn.gelu(g, approximate=True)}
MLP_ACTIVATIONS = (*GATED, "gelu")

# The weights whose FSDP gather a weight split's `gather_at_once` may ask for at once.
GATHER_AT_ONCE = ("q", "kv", "o", "mlp_in", "mlp_out")


def check_gather_at_once(field: str, names) -> None:
  """ConfigError naming `field` unless `names` is a tuple of GATHER_AT_ONCE's names."""
  if not isinstance(names, (tuple, list)) or not set(names) <= set(GATHER_AT_ONCE):
    raise ConfigError(
        f"{field}={names!r}: name the weights whose FSDP gather runs as one all-gather over "
        f"all the axes that split them, a tuple of {', '.join(GATHER_AT_ONCE)} (() for one "
        "axis at a time, the default); plan the slice to see which XLA keeps as all-gathers.")


class Mlp(nn.Module):
  """Gated SwiGLU (`swiglu`), gated GELU (`geglu`: tanh-approximated GELU of the gate times
  the up projection, Gemma's) or plain GELU (`gelu`) feed-forward; with `lora`
  (layers.lora) its weights frozen and its targets among wi, wg, wo adapted."""
  d_model: int
  d_ff: int
  activation: str
  dtype: jnp.dtype
  in_split: SplitDims
  out_split: SplitDims
  ff_act_split: SplitDims | None
  at_once: tuple[str, ...] = ()  # of 'mlp_in', 'mlp_out': FSDP gathers (WeightSplit)
  lora: lora_lib.LoraConfig | None = None
  quant: base.Quantizer | None = None  # quantized projections (layers.quant)

  @nn.compact
  def __call__(self, x: jax.Array, lora_drop: lora_lib.Dropout | None = None) -> jax.Array:
    dt, batch, lora = self.dtype, self.ff_act_split, self.lora
    w_in = lora_lib.projection_weight(self, "wi", (self.d_model, self.d_ff), self.in_split,
                                      dense_init(0, 1), lora)
    up = lambda name, w: constrain(lora_lib.project(
        self, name, "btd,df->btf", x, w, self.in_split, batch, dt, lora, lora_drop,
        at_once="mlp_in" in self.at_once, quant=self.quant), batch)
    # Named for the remat presets (spmdtask.core.remat): what a backward may keep.
    h = checkpoint_name(up("wi", w_in), remat.MLP_UP)
    if self.activation in GATED:
      w_gate = lora_lib.projection_weight(self, "wg", (self.d_model, self.d_ff),
                                          self.in_split, dense_init(0, 1), lora)
      gate = checkpoint_name(up("wg", w_gate), remat.MLP_GATE)
      h = GATED[self.activation](gate) * h
    else:
      h = jax.nn.gelu(h)
    h = checkpoint_name(h, remat.MLP_HIDDEN)
    w_out = lora_lib.projection_weight(self, "wo", (self.d_ff, self.d_model), self.out_split,
                                       dense_init(0, 1), lora)
    return checkpoint_name(lora_lib.project(self, "wo", "btf,fd->btd", h, w_out, self.out_split,
                                            batch, dt, lora, lora_drop,
                                            at_once="mlp_out" in self.at_once,
                                            quant=self.quant), remat.MLP_OUT)


class Block(nn.Module):
  """One pre-norm layer: x + attn(norm(x)), then + mlp(norm(.)).

  Called as `(x, positions, segment_ids=None, row_ids=None, cache=None, dropout_key=None)
  -> (x, new_cache)` so that a `LayerStack` can scan it (positions, segment ids and row ids
  broadcast to every layer, the per-layer KV cache and dropout key scanned over the layer
  dim). Dropout runs where a `dropout_key` (uint32 key data) is given: row i's mask comes
  from (key, row_ids[i]), so it does not depend on how the batch is split into
  microbatches. `causal=False` makes an encoder block; `rope_theta=None` turns rotary
  positions off; `attention_impl` is the attention kernel (`layers.attention.fused`);
  `qk_norm` RMS-normalizes q and k per head (Qwen3); `lora` (layers.lora) freezes the
  weights and adapts its targets, its dropout drawn the same way (streams 2 + the target's
  index in `lora.TARGETS`). `mla` (layers.attention.mla) makes the attention multi-head
  latent attention (DeepSeek) in place of `Attention`.
  Gemma 3: `sliding_window`, `local_rope_theta`, `attention_scale` (the attention's
  `window`, `local_rope_theta`, `scale`; a stack mixing local and global layers passes each
  layer's `is_local` flag, scanned, after the dropout key), `norm_offset` (every norm's
  `offset + w`), `sandwich_norms` (a norm after each sublayer too, before its residual add:
  `attn_post_norm`, `mlp_post_norm`).
  """
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  mlp_activation: str
  rope_theta: float | None
  norm_eps: float
  dropout_rate: float
  dtype: jnp.dtype
  wsplit: object
  asplit: object
  rope_scaling: Scaling | None = None  # rescaled RoPE frequencies (global layers)
  causal: bool = True
  attention_impl: str = "auto"
  qk_norm: bool = False
  context_attention: str = "all_gather"  # across a split sequence (layers.attention.context)
  context_score_block: int = context_attention_lib.SCORE_BLOCK
  lora: lora_lib.LoraConfig | None = None
  mla: MlaConfig | None = None
  sliding_window: int | None = None
  local_rope_theta: float | None = None
  attention_scale: float | None = None
  norm_offset: float = 0.0
  sandwich_norms: bool = False
  quant: base.Quantizer | None = None  # quantized projections (layers.quant)

  def _norm(self, name: str):
    return RmsNorm(self.d_model, self.norm_eps, self.wsplit.norm, lora_lib.frozen(self.lora),
                   self.norm_offset, name=name)

  def _post_norm(self, h, name: str):
    """h through the sublayer's post norm (sandwich norms), else h itself."""
    return self._norm(name)(h) if self.sandwich_norms else h

  def _dropout(self, x: jax.Array, key, row_ids, which: int) -> jax.Array:
    if self.dropout_rate == 0.0 or key is None:
      return x
    return base.dropout(x, self.dropout_rate, key, row_ids, which)

  def _lora_drop(self, key, row_ids) -> lora_lib.Dropout | None:
    return None if key is None else lora_lib.Dropout(key, row_ids)

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
               row_ids: jax.Array | None = None, cache: KvCache | None = None,
               dropout_key: jax.Array | None = None, is_local: jax.Array | None = None):
    w, a = self.wsplit, self.asplit
    x, cache = self._attention(x, positions, segment_ids, row_ids, cache, dropout_key,
                               is_local)
    h = self._norm("mlp_norm")(x)
    h = Mlp(self.d_model, self.d_ff, self.mlp_activation, self.dtype, w.mlp_in, w.mlp_out, a.ff,
            w.gather_at_once, self.lora, self.quant, name="mlp")(
                h, self._lora_drop(dropout_key, row_ids))
    h = self._post_norm(h, "mlp_post_norm")
    return constrain(x + self._dropout(h, dropout_key, row_ids, 1), a.embed), cache

  def _attention(self, x, positions, segment_ids, row_ids, cache, dropout_key, is_local=None):
    """x + attn(norm(x)) and the new cache (called from a compact `__call__`)."""
    w, a = self.wsplit, self.asplit
    # Every use of the input goes through its name, so an offloading remat preset can move
    # it to the host instead of keeping the raw input (the scan's carry) for the backward.
    x = checkpoint_name(x, remat.LAYER_INPUT)
    h = self._norm("attn_norm")(x)
    if self.mla is not None:
      h, cache = Mla(self.d_model, self.num_heads, self.mla, self.rope_theta, self.dtype, w,
                     a.heads, self.attention_impl, self.lora, name="attn")(
                         h, positions, segment_ids, cache, self._lora_drop(dropout_key, row_ids))
      h = self._post_norm(h, "attn_post_norm")
      return constrain(x + self._dropout(h, dropout_key, row_ids, 0), a.embed), cache
    h, cache = Attention(self.d_model, self.num_heads, self.num_kv_heads, self.head_dim,
                         self.rope_theta, self.dtype, w.q, w.kv, w.o, a.heads,
                         rope_scaling=self.rope_scaling, causal=self.causal,
                         impl=self.attention_impl, qk_norm=self.qk_norm,
                         norm_eps=self.norm_eps, context=self.context_attention,
                         score_block=self.context_score_block, at_once=w.gather_at_once,
                         lora=self.lora, window=self.sliding_window,
                         local_rope_theta=self.local_rope_theta, scale=self.attention_scale,
                         norm_offset=self.norm_offset, quant=self.quant,
                         name="attn")(h, positions, segment_ids, cache,
                                      self._lora_drop(dropout_key, row_ids), is_local)
    h = self._post_norm(h, "attn_post_norm")
    return constrain(x + self._dropout(h, dropout_key, row_ids, 0), a.embed), cache


def attended_pairs(tokens: int, causal: bool, window: int | None = None) -> int:
  """The (query, key) pairs attention computes on one row of `tokens`: causal, query i sees
  min(i + 1, window) keys (window None: i + 1), T·(T+1)/2 in all without a window; not
  causal, every key (T²), or with a window the keys less than `window` away on either side."""
  w = tokens if window is None else min(window, tokens)
  one_side = w * (w + 1) // 2 + (tokens - w) * w  # sum over i of min(i + 1, w)
  if causal:
    return one_side
  return tokens * tokens if window is None else 2 * one_side - tokens


def attention_flops(num_layers: int, width: int, tokens: int, causal: bool,
                    window: int | None = None, local_layers: int = 0) -> float:
  """Train FLOPs of attention's two matmuls (scores, weighted sum; forward and backward) on
  one example: 12·w per pair the mask leaves (`attended_pairs`), w the query width (heads ×
  head_dim); causal, about half of 12·L·w·T². `local_layers` of the `num_layers` attend
  within `window` keys (sliding-window layers: min(i + 1, window) keys at position i), the
  rest over the whole row."""
  pairs = ((num_layers - local_layers) * attended_pairs(tokens, causal)
           + local_layers * attended_pairs(tokens, causal, window))
  return 12.0 * width * pairs


def train_flops(num_params: int, num_layers: int, width: int, tokens: int,
                causal: bool = False) -> float:
  """Train FLOPs of one example of `tokens` tokens: 6·N·T + attention (`attention_flops`),
  N the params a token uses."""
  return 6.0 * num_params * tokens + attention_flops(num_layers, width, tokens, causal)


def param_shapes(model: nn.Module, example):
  """The variables of `model` as ShapeDtypeStructs (boxed), initialised through `loss` on
  one `example` row: nothing is allocated."""
  batch = {k: jax.ShapeDtypeStruct((1,) + tuple(v.shape), v.dtype) for k, v in example.items()}
  return train_state.abstract_variables(model, batch)


def num_params(model: nn.Module, example) -> int:
  """Parameters of `model` (shapes only), initialised through `loss` on one `example` row."""
  return sum(x.size for x in jax.tree.leaves(param_shapes(model, example)))  # boxes: nodes
