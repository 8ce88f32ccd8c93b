"""A decoder-only Transformer LM (Llama-style) whose weights carry split-dims mappings."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from spmdtask.pipeline import spmd as pipeline_lib
from spmdtask import sharding
from spmdtask.errors import ConfigError
from spmdtask.layers.attention import Attention, KvCache
from spmdtask.layers.base import RmsNorm, SplitDims, constrain, dense_init, weight

BATCH = ("data", "fsdp")  # the default data axes of an activation's batch dim


@dataclasses.dataclass(frozen=True)
class WeightSplit:
  """Split-dims mapping of every LM weight (per weight dim, in the order shown)."""
  embedding: SplitDims = ("model", "fsdp")        # [vocab, d_model]
  unembed: SplitDims = ("fsdp", "model")          # [d_model, vocab]
  q: SplitDims = ("fsdp", "model", None)          # [d_model, heads, head_dim]
  kv: SplitDims = ("fsdp", "model", None)         # [d_model, kv_heads, head_dim]
  o: SplitDims = ("model", None, "fsdp")          # [heads, head_dim, d_model]
  mlp_in: SplitDims = ("fsdp", "model")           # [d_model, d_ff]
  mlp_out: SplitDims = ("model", "fsdp")          # [d_ff, d_model]
  norm: SplitDims = (None,)                       # [d_model]


@dataclasses.dataclass(frozen=True)
class ActivationSplit:
  """Split-dims mapping of the main activations."""
  embed: SplitDims = (BATCH, None, None)          # [batch, seq, d_model]
  heads: SplitDims = (BATCH, None, "model", None) # [batch, seq, heads, head_dim]
  ff: SplitDims = (BATCH, None, "model")          # [batch, seq, d_ff]
  logits: SplitDims = (BATCH, None, "model")      # [batch, seq, vocab]


class Mlp(nn.Module):
  """Gated SwiGLU (`swiglu`) or plain GELU (`gelu`) feed-forward."""
  d_model: int
  d_ff: int
  activation: str
  dtype: jnp.dtype
  in_split: SplitDims
  out_split: SplitDims
  ff_act_split: SplitDims | None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dt = self.dtype
    w_in = weight(self, "wi", (self.d_model, self.d_ff), self.in_split, dense_init(0, 1))
    h = constrain(x @ w_in.astype(dt), self.ff_act_split)
    if self.activation == "swiglu":
      w_gate = weight(self, "wg", (self.d_model, self.d_ff), self.in_split, dense_init(0, 1))
      h = jax.nn.silu(constrain(x @ w_gate.astype(dt), self.ff_act_split)) * h
    else:
      h = jax.nn.gelu(h)
    w_out = weight(self, "wo", (self.d_ff, self.d_model), self.out_split, dense_init(0, 1))
    return h @ w_out.astype(dt)


class Block(nn.Module):
  """One pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)).

  Called as `(x, positions, cache=None, segment_ids=None) -> (x, new_cache)` so that
  `nn.scan` can stack it (the per-layer KV cache is scanned over the layer dim).
  """
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  mlp_activation: str
  rope_theta: float
  norm_eps: float
  dropout_rate: float
  dtype: jnp.dtype
  wsplit: WeightSplit
  asplit: ActivationSplit

  def _dropout(self, x: jax.Array) -> jax.Array:
    # Dropout only where the caller passed a 'dropout' rng (the train step does).
    if self.dropout_rate == 0.0 or not self.has_rng("dropout"):
      return x
    return nn.Dropout(self.dropout_rate, deterministic=False)(x)

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, cache: KvCache | None = None,
               segment_ids: jax.Array | None = None):
    w, a = self.wsplit, self.asplit
    h = RmsNorm(self.d_model, self.norm_eps, w.norm, name="attn_norm")(x)
    h, cache = Attention(self.d_model, self.num_heads, self.num_kv_heads, self.head_dim,
                         self.rope_theta, self.dtype, w.q, w.kv, w.o, a.heads,
                         name="attn")(h, positions, cache, segment_ids)
    x = constrain(x + self._dropout(h), a.embed)
    h = RmsNorm(self.d_model, self.norm_eps, w.norm, name="mlp_norm")(x)
    h = Mlp(self.d_model, self.d_ff, self.mlp_activation, self.dtype, w.mlp_in, w.mlp_out, a.ff,
            name="mlp")(h)
    return constrain(x + self._dropout(h), a.embed), cache


class TransformerLm(nn.Module):
  """Decoder-only LM. `loss(batch)` is the training objective; `__call__` gives logits.

  Layers are stacked with `nn.scan` (one compiled layer body whatever the
  depth), rematerialized under `remat_policy` (a `jax.checkpoint_policies` name,
  or None). With `pipeline` set they are instead pipelined over the stage mesh
  axis: weights [S, R, L/(S·R), ...] and `pipeline.pipeline_apply`. Params stay
  float32; compute runs in `fprop_dtype`.
  """
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  max_seq_len: int = 2048
  mlp_activation: str = "swiglu"
  tie_embeddings: bool = False
  scale_tied_logits: bool = True  # tied head times d_model**-0.5; Llama's is unscaled (False)
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  dropout_rate: float = 0.0
  fprop_dtype: str = "float32"
  remat_policy: str | None = "nothing_saveable"
  scan_unroll: int | bool = 1
  weight_split_dims_mapping: WeightSplit = WeightSplit()
  activation_split_dims_mapping: ActivationSplit = ActivationSplit()
  pipeline: pipeline_lib.PipelineConfig | None = None

  def validate(self, mesh, global_batch_size: int) -> None:
    """Checks every split-dims field and the pipeline config; ConfigError names the field."""
    mesh_shape = dict(mesh.shape)
    for where, (split, shape) in self.split_dims_fields().items():
      sharding.validate(split, shape, mesh_shape, where)
    if self.pipeline is not None:
      pipeline_lib.validate(self.pipeline, num_layers=self.num_layers,
                            batch_size=global_batch_size, mesh=mesh)
      if self.dropout_rate:
        raise ConfigError(
            f"task.model.dropout_rate={self.dropout_rate} is not supported with "
            "task.model.pipeline set: set dropout_rate=0.0 or pipeline=None.")

  def split_dims_fields(self) -> dict[str, tuple[SplitDims, tuple[int, ...]]]:
    """Config field -> (split-dims mapping, shape of the tensor it maps), for validation."""
    d, v, h, kv, hd, ff = (self.d_model, self.vocab_size, self.num_heads, self.num_kv_heads,
                           self.head_dim, self.d_ff)
    shapes = dict(embedding=(v, d), unembed=(d, v), q=(d, h, hd), kv=(d, kv, hd), o=(h, hd, d),
                  mlp_in=(d, ff), mlp_out=(ff, d), norm=(d,))
    acts = dict(embed=("b", "t", d), heads=("b", "t", h, hd), ff=("b", "t", ff),
                logits=("b", "t", v))
    out = {f"task.model.weight_split_dims_mapping.{k}":
           (getattr(self.weight_split_dims_mapping, k), s) for k, s in shapes.items()}
    out.update({f"task.model.activation_split_dims_mapping.{k}":
                (getattr(self.activation_split_dims_mapping, k), s) for k, s in acts.items()})
    return out

  def _block_kwargs(self) -> dict:
    return dict(d_model=self.d_model, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, d_ff=self.d_ff, mlp_activation=self.mlp_activation,
                rope_theta=self.rope_theta, norm_eps=self.norm_eps,
                dropout_rate=self.dropout_rate, dtype=jnp.dtype(self.fprop_dtype),
                wsplit=self.weight_split_dims_mapping, asplit=self.activation_split_dims_mapping)

  def _pipelined_layers(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    pp = self.pipeline
    s, r = pp.num_stages, pp.circular_repeat
    # Weights [S, R, Lps, ...]: vmap once per leading dim, the outermost mapped to the stage axis.
    stack = Block
    for length, axis_name in ((self.num_layers // (s * r), None), (r, None), (s, pp.stage_axis)):
      stack = nn.vmap(stack, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(None, None), out_axes=0, axis_size=length,
                      metadata_params={nn.PARTITION_NAME: axis_name})
    stack = stack(**self._block_kwargs(), name="layers")
    if self.is_initializing():
      stack(x, positions)  # creates the stacked weights; init needs no pipelined forward
      return x
    params = nn.unbox(self.variables["params"]["layers"])
    block = Block(**self._block_kwargs())

    def layer_fn(p, h, pos):
      return block.apply({"params": p}, h, pos)[0]

    # Every microbatch shares the positions of row 0 (the default positions are arange(t)).
    return pipeline_lib.pipeline_apply(layer_fn, params, x, mesh=jax.sharding.get_abstract_mesh(),
                                       config=pp, broadcast_args=(positions[:1],))

  def cache_shape(self, batch_size: int, max_len: int) -> KvCache:
    """ShapeDtypeStructs of an empty decode cache: [num_layers, batch, max_len, kv_heads, hd]."""
    shape = (self.num_layers, batch_size, max_len, self.num_kv_heads, self.head_dim)
    leaf = jax.ShapeDtypeStruct(shape, jnp.dtype(self.fprop_dtype))
    return KvCache(leaf, leaf)

  def cache_split_dims(self) -> KvCache:
    """The cache's split-dims mapping: [layers, *activation_split_dims_mapping.heads]."""
    heads = tuple(self.activation_split_dims_mapping.heads)
    return KvCache((None,) + heads, (None,) + heads)

  def _layers(self, x: jax.Array, positions: jax.Array, cache: KvCache | None,
              segment_ids: jax.Array | None = None):
    if self.pipeline is not None:
      if cache is not None:
        raise ValueError("Decode a pipelined LM through decoding.unpipelined(model, params).")
      if segment_ids is not None:
        raise ConfigError("Packed inputs (segment_ids) are not supported with task.model.pipeline "
                          "set: use an unpacked input or set pipeline=None.")
      return self._pipelined_layers(x, positions), None
    if cache is not None:  # decoding: no gradients, so no remat; the cache is scanned over
      stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(nn.broadcast, 0), length=self.num_layers,
                      unroll=self.scan_unroll, metadata_params={nn.PARTITION_NAME: None})
      return stack(**self._block_kwargs(), name="layers")(x, positions, cache)
    block = Block
    if self.remat_policy:
      block = nn.remat(Block, policy=getattr(jax.checkpoint_policies, self.remat_policy),
                       prevent_cse=False)
    stack = nn.scan(block, variable_axes={"params": 0},
                    split_rngs={"params": True, "dropout": True},
                    in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                    length=self.num_layers, unroll=self.scan_unroll,
                    metadata_params={nn.PARTITION_NAME: None})
    x, _ = stack(**self._block_kwargs(), name="layers")(x, positions, None, segment_ids)
    return x, None

  @nn.compact
  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               cache: KvCache | None = None, segment_ids: jax.Array | None = None):
    """tokens [b, t] int -> logits [b, t, vocab] float32.

    With a `cache` (see `cache_shape`), returns `(logits, new_cache)`: the
    tokens' keys/values are written at `positions` and attention reads the cache.
    With `segment_ids` [b, t] (packed rows; `positions` then restart per segment),
    a token attends only to earlier tokens of its own segment.
    """
    w, a = self.weight_split_dims_mapping, self.activation_split_dims_mapping
    dt = jnp.dtype(self.fprop_dtype)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    emb = weight(self, "embedding", (self.vocab_size, self.d_model), w.embedding,
                 nn.initializers.normal(1.0))
    x = constrain(jnp.take(emb, tokens, axis=0).astype(dt), a.embed)
    x, cache = self._layers(x, positions, cache, segment_ids)
    x = RmsNorm(self.d_model, self.norm_eps, w.norm, name="final_norm")(x)
    if self.tie_embeddings:
      logits = jnp.einsum("btd,vd->btv", x, emb.astype(dt))
      if self.scale_tied_logits:
        logits = logits * (self.d_model ** -0.5)
    else:
      unembed = weight(self, "unembed", (self.d_model, self.vocab_size), w.unembed,
                       dense_init(0, 1))
      logits = x @ unembed.astype(dt)
    logits = constrain(logits.astype(jnp.float32), a.logits)
    return logits if cache is None else (logits, cache)

  def loss(self, batch: dict[str, jax.Array]):
    """Weighted mean next-token cross entropy.

    batch: `inputs`, `targets` [b, t] int32 and `weights` [b, t] float (0 = padding);
    packed rows add `segment_ids` and per-segment `positions` [b, t] int32.
    Returns (loss, aux) with aux = {'loss_sum', 'num_tokens'} for exact aggregation.
    """
    logits = self(batch["inputs"], batch.get("positions"), segment_ids=batch.get("segment_ids"))
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    weights = batch["weights"].astype(jnp.float32)
    loss_sum, num_tokens = jnp.sum(xent * weights), jnp.sum(weights)
    return loss_sum / jnp.maximum(num_tokens, 1.0), {"loss_sum": loss_sum,
                                                     "num_tokens": num_tokens}


def num_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def flops_per_token(num_params_: int, num_layers: int, d_model: int, seq_len: int) -> float:
  """Train FLOPs per token: 6·N + 12·L·d·T (causal attention not halved)."""
  return 6.0 * num_params_ + 12.0 * num_layers * d_model * seq_len
