"""A decoder-only Transformer LM (Llama-style) whose weights carry split-dims mappings.

`TransformerLm.loss(batch)` is the training objective; `__call__` gives logits. The layers
are a `LayerStack` (one compiled layer body whatever the depth, rematerialized under
`remat_policy`: a preset of spmdtask.core.remat such as 'minimal' or 'minimal_offloaded', a
`jax.checkpoint_policies` policy name, or None); the framework sets `execution` from
`task.pipeline` to pipeline them. Params stay float32; compute runs in `fprop_dtype`. With
`loss_vocab_tiles` > 1 the loss never holds the whole [tokens, vocab] logits: the head and
the cross entropy run over that many vocabulary tiles (`layers.xent`; one more head matmul
in the backward), the head weight gathered once.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from spmdtask.core import sharding
from spmdtask.errors import ConfigError
from spmdtask.layers.attention import context as context_lib
from spmdtask.layers import costs as costs_lib
from spmdtask.layers import lm_checks, lm_splits
from spmdtask.layers import lora as lora_lib
from spmdtask.layers import quant as quant_lib
from spmdtask.layers import moe as moe_lib
from spmdtask.layers import mtp as mtp_lib
from spmdtask.layers import stack as stack_lib
from spmdtask.layers import xent
from spmdtask.layers.attention import cache as cache_lib
from spmdtask.layers.attention.mha import KvCache
from spmdtask.layers.attention.mla import MlaCache, MlaConfig
from spmdtask.layers.base import RmsNorm, SplitDims, constrain, dense_init
from spmdtask.layers.block import Block
from spmdtask.layers.lm_splits import ActivationSplit, WeightSplit
from spmdtask.layers.attention import window as window_lib
from spmdtask.layers.rope import Scaling
from spmdtask.core.model import Metrics, TokenScores, Weighted, Work
from spmdtask.core.strategy import Strategy


def _delayed(model) -> bool:
  """Whether the model's fp8 scales are delayed (amax histories: layers.quant)."""
  return model.quantization is not None and model.quantization_scaling == "delayed"


_DELAYED_ACCUMULATES = (
    "{} with task.model.quantization_scaling='delayed': a step's amaxes reach the amax "
    "histories through their gradient slots, which microbatches sum (and divide by the "
    "tokens), so a max is lost; train in one microbatch or set "
    "task.model.quantization_scaling='current'.")
# TransformerLm fields a layer (layers.block.Block) has under the same name.
BLOCK_FIELDS = ("d_model", "num_heads", "num_kv_heads", "head_dim", "d_ff", "mlp_activation",
                "rope_theta", "rope_scaling", "norm_eps", "qk_norm", "dropout_rate",
                "attention_impl", "context_attention", "context_score_block", "lora",
                "local_rope_theta", "attention_scale", "norm_offset", "sandwich_norms", "mla")


class TransformerLm(nn.Module, lora_lib.Adaptable):
  """Decoder-only LM (module doc): implements spmdtask.core.model's `Model`, `Decodable`,
  `ScoresTokens`, `Adapted`, `Buffered` and `Stacked`."""
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
  rope_scaling: Scaling | None = None  # Llama 3.1 / 3.2's, or linear (Gemma 3's global)
  norm_eps: float = 1e-6
  qk_norm: bool = False  # q and k RMS-normalized per head before RoPE (Qwen3)
  dropout_rate: float = 0.0
  fprop_dtype: str = "float32"
  attention_impl: str = "auto"  # auto | xla | splash | cudnn (layers.attention.fused)
  context_attention: str = "all_gather"  # all_gather | ring: across a split sequence
  # (query, key) pairs per head in a chunk of scores in a context shard (xla_blocks.SCORE_BLOCK)
  context_score_block: int = context_lib.SCORE_BLOCK
  remat_policy: str | None = "nothing_saveable"
  scan_unroll: int | bool = 1
  loss_vocab_tiles: int = 1  # >1: the loss's logits in that many vocab tiles (layers.xent)
  moe: moe_lib.MoeConfig | None = None  # Mixture of Experts FFN (layers.moe); None: dense
  mla: MlaConfig | None = None  # multi-head latent attention (layers.attention.mla); None: MHA
  lora: lora_lib.LoraConfig | None = None  # LoRA (layers.lora): only adapters train; None: off
  # Local attention (layers.attention.window): layer kinds over the stack, repeated (Gemma 3:
  # ('local',) * 5 + ('global',)); a local layer sees its last `sliding_window` keys.
  attention_pattern: tuple[str, ...] = ("global",)
  sliding_window: int | None = None
  local_rope_theta: float | None = None  # local layers' RoPE θ, unscaled; None: rope_theta
  attention_scale: float | None = None  # the scores' scale; None: head_dim**-0.5
  # Gemma: norms 1 + w (norm_offset 1), post-sublayer norms too, embedding times sqrt(d_model).
  norm_offset: float = 0.0
  sandwich_norms: bool = False
  scale_embedding: bool = False
  # Projections in None (float) | 'int8' | 'fp8', fp8 scaled 'current' | 'delayed' (layers.quant).
  quantization: str | None = None
  quantization_scaling: str = "current"
  quantization_history: int = 16  # delayed scaling's amax history, in steps
  mtp_depth: int = 0  # DeepSeek-V3's multi-token prediction heads (layers.mtp); 0: none
  mtp_loss_weight: float = 0.0  # their loss's weight
  weight_split_dims_mapping: WeightSplit = WeightSplit()
  activation_split_dims_mapping: ActivationSplit = ActivationSplit()
  execution: Strategy | None = None  # set from task.pipeline (Stacked); not a user field

  def validate(self, mesh, global_batch_size: int) -> None:
    """Checks dims, dtypes, remat and every split-dims field, and the pipeline."""
    lm_checks.validate(self, mesh, global_batch_size, _moe_layers(self))

  def check_batch(self, batch) -> None:
    """Rows of <= max_seq_len tokens, ids in [0, vocab_size): else an error (ChecksBatch)."""
    lm_checks.check_batch(self, batch)

  def work_per_example(self, example) -> Work:
    """One example's train FLOPs of the params a token uses (`layers.costs.lm_work`)."""
    return costs_lib.lm_work(self.clone(execution=None), example)

  @nn.nowrap  # builds modules of its own: not a child of this one
  def layer_costs(self, batch_size: int, seq_len: int) -> list[float]:
    """Train FLOPs of [embedding, each layer, head with the loss] (LayerCosts)."""
    return costs_lib.lm_layer_costs(self, batch_size, seq_len)

  def activation_memory(self, rows: float, seq_len: int):
    """The largest activations and this config's fixes (SizesActivations; layers.costs)."""
    return costs_lib.lm_activation_memory(self, rows, seq_len)

  def has_buffers(self) -> bool:
    """Whether the params hold MoE balancing biases or amax histories (Buffered)."""
    return (self.moe is not None and self.moe.score_bias) or _delayed(self)

  def update_buffers(self, params, grads):
    """MoE biases moved by the step's loads, amax histories shifted by its amaxes (Buffered)."""
    if self.moe is not None and self.moe.score_bias:
      params = moe_lib.update_buffers(self.moe, params, grads)
    return quant_lib.update_histories(params, grads) if _delayed(self) else params

  def with_pipeline(self, pipeline):
    if pipeline is not None and _delayed(self):
      raise ConfigError(_DELAYED_ACCUMULATES.format("task.pipeline"))
    return self.clone(execution=pipeline)

  def buffers_accumulate(self) -> bool:
    """Whether a sum over microbatches keeps the buffers' statistics (Buffered): not maxima."""
    return not _delayed(self)

  def layout_maps(self):
    return stack_lib.layout_maps(("layers",), self.execution)

  def split_dims_fields(self) -> dict[str, tuple[SplitDims, tuple[int, ...]]]:
    """Config field -> (split-dims mapping, shape of the tensor it maps), for validation."""
    return lm_checks.split_dims_fields(self)

  def cache_shape(self, batch_size: int, max_len: int) -> KvCache | MlaCache:
    """An empty decode cache's ShapeDtypeStructs (`layers.attention.cache.shapes`)."""
    return cache_lib.shapes(self.num_layers, batch_size, max_len, self.num_kv_heads,
                            self.head_dim, jnp.dtype(self.fprop_dtype), self.mla)

  def cache_split_dims(self, mesh_shape) -> KvCache | MlaCache:
    """The cache's PartitionSpecs (`layers.attention.cache.specs`)."""
    return cache_lib.specs(self.activation_split_dims_mapping.heads, self.num_kv_heads,
                           mesh_shape, self.mla)

  def whole_rows(self, axes: tuple[str, ...], mesh_shape) -> "TransformerLm":
    """Decodable: the LM with rows whole over `axes` (`lm_splits.whole_rows`)."""
    return self.clone(activation_split_dims_mapping=lm_splits.whole_rows(
        self.activation_split_dims_mapping, axes, 0 if self.mla else self.num_kv_heads,
        mesh_shape))

  def block_kwargs(self) -> dict:
    """The fields of one layer (`layers.block.Block`)."""
    return dict({k: getattr(self, k) for k in BLOCK_FIELDS}, dtype=jnp.dtype(self.fprop_dtype),
                wsplit=self.weight_split_dims_mapping,
                asplit=self.activation_split_dims_mapping,
                sliding_window=self.sliding_window if "local" in self.attention_pattern else None,
                quant=quant_lib.from_fields(self.quantization, self.quantization_scaling,
                                           self.quantization_history))

  def _stack(self) -> stack_lib.LayerStack:
    return stack_lib.LayerStack(Block, self.block_kwargs(), self.num_layers, self.remat_policy,
                                self.scan_unroll, self.execution,
                                window_lib.mixed_flags(self.attention_pattern, self.num_layers),
                                name="layers")

  @nn.compact
  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               cache: KvCache | None = None, segment_ids: jax.Array | None = None, *,
               head: bool = True, moe_stats: bool = False, zigzagged: bool = False,
               mtp_tokens: jax.Array | None = None, logits_at: jax.Array | None = None):
    """tokens [b, t] int -> logits [b, t, vocab] float32. `logits_at` [b] int: logits
    [b, 1, vocab] at each row's position `logits_at[b]` only (a prefill's last; `_head`).
    `cache` (`cache_shape`): `(logits, new_cache)`, the tokens' keys/values written at
    `positions`. `segment_ids` [b, t] (packed rows, positions restarting per segment): a
    token attends within its segment. `head=False`: `(x, w, scale)`, the final-norm features
    [b, t, d_model], the head weight [d_model, vocab] float32, logits = scale · x @ w.
    `moe_stats=True` (no cache): `(that, stats)`, an MoE's per-row stats or None. Where the
    sequence is split over mesh axes the layers see rows in zig-zag order
    (layers.attention.context) and outputs come back in row order, unless `zigzagged` (the
    loss's rows are in zig-zag order already). `mtp_tokens` [D, b, t] (`layers.mtp.shifted`):
    the D MTP heads' outputs follow the row's along the sequence."""
    w, a = self.weight_split_dims_mapping, self.activation_split_dims_mapping
    dt = jnp.dtype(self.fprop_dtype)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    order = None if cache is not None or zigzagged else _zigzag_order(self, tokens.shape[1])
    tokens, positions, segment_ids = _reordered(order, a.heads[:2], tokens, positions,
                                                segment_ids)
    emb = lora_lib.weight(self, "embedding", (self.vocab_size, self.d_model), w.embedding,
                          nn.initializers.normal(1.0), self.lora)
    def embed(t):  # cast before the lookup: the rows cross the mesh in the compute dtype;
      x = constrain(jnp.take(emb.astype(dt), t, axis=0), a.embed)  # Gemma: scaled in it, as HF
      return x * jnp.asarray(self.d_model ** 0.5, dt) if self.scale_embedding else x
    x, cache, stats = _layer_stacks(self, embed(tokens), positions, segment_ids, cache)
    x = RmsNorm(self.d_model, self.norm_eps, w.norm, lora_lib.frozen(self.lora),
                self.norm_offset, name="final_norm")(x)
    if mtp_tokens is not None:
      x, stats = mtp_lib.features(self, x, jnp.stack([embed(t) for t in mtp_tokens]),
                                  positions, segment_ids, stats, _moe_layers(self))
    if order is not None:  # back to the row's own order
      x = _reordered(np.argsort(order), a.embed, x)[0]
    if self.tie_embeddings:
      unembed, scale = emb.T, self.d_model ** -0.5 if self.scale_tied_logits else 1.0
    else:
      unembed, scale = lora_lib.weight(self, "unembed", (self.d_model, self.vocab_size),
                                       w.unembed, dense_init(0, 1), self.lora), 1.0
    if not head:
      return ((x, unembed, scale), stats) if moe_stats else (x, unembed, scale)
    logits = _head(self, x, unembed.astype(dt), scale, cache is not None, logits_at)
    logits = constrain(logits.astype(jnp.float32), a.logits)
    return (logits, stats) if moe_stats else logits if cache is None else (logits, cache)

  def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, Metrics]:
    """Weighted mean next-token cross entropy (+ an MoE's router losses: `moe.add_router_losses`;
    + mtp_loss_weight · the MTP loss: `layers.mtp`): (loss, {'loss': Weighted(sum of token
    losses, tokens), MoE and MTP metrics}). batch: `inputs`,
    `targets` [b, t] int32, `weights` [b, t] float (0 = padding); packed rows add
    `segment_ids` and per-segment `positions` [b, t] int32. Where the activations split the
    sequence, the loss runs on the zig-zag order (`_zigzag`): a sum, so the same value."""
    batch = _zigzag(self, batch)
    token_xent, _, stats = _token_xent(self, batch, mtp=True)
    token_xent, mtp_sum, mtp_metrics = mtp_lib.split_loss(self, token_xent, batch)
    weights = batch["weights"].astype(jnp.float32)
    token_xent, metrics = moe_lib.add_router_losses(self.moe, stats, token_xent, weights)
    loss_sum, num_tokens = jnp.sum(token_xent * weights), jnp.sum(weights)
    loss_sum = loss_sum if mtp_sum is None else loss_sum + self.mtp_loss_weight * mtp_sum
    return (loss_sum / jnp.maximum(num_tokens, 1.0),
            {"loss": Weighted(loss_sum, num_tokens), **metrics, **mtp_metrics})

  def token_logprobs(self, batch: dict[str, jax.Array], temperature: float = 1.0) -> jax.Array:
    """log p(target) per token [b, t] float32 in the rows' own order (ScoresTokens): the
    loss's path, without weights or an MoE's router losses; of the logits / `temperature`."""
    return -_row_order(self, _token_xent(self, _zigzag(self, batch), temperature=temperature)[0])

  def token_scores(self, batch: dict[str, jax.Array]) -> TokenScores:
    """ScoresTokens: `token_logprobs` and greedy flags in the rows' own order (`_scores`)."""
    return _scores(self, _zigzag(self, batch))


def _scores(model: TransformerLm, batch: dict[str, jax.Array]) -> TokenScores:
  """(log p(target), target is the argmax) per token of a batch in zig-zag order where the
  sequence is split, back in the rows' own order: the loss's head, whose vocab tiles (where
  `loss_vocab_tiles` > 1) each give their greatest logit and its id (`xent.tiled_scores`)."""
  token_xent, ids, _ = _token_xent(model, batch, argmax=True)
  return TokenScores(-_row_order(model, token_xent), _row_order(model, ids == batch["targets"]))


def _head(model: TransformerLm, x: jax.Array, w: jax.Array, scale: float, decoding: bool,
          at: jax.Array | None = None) -> jax.Array:
  """The logits scale · x @ w of the head's weight w [d_model, vocab]; with `at` [b] int,
  of x's rows at those positions only ([b, 1, vocab]). `decoding` (a cache) where w's
  d_model is split (FSDP): w resharded to split its vocab over those axes too (an
  all-to-all of each device's shard), x's few rows made whole on every device and the
  logits split over the vocab, instead of every device gathering the whole w for its rows
  (Llama 3's: 1 GiB in bf16, the sampler's largest array). Each logit is still one dot
  product over the whole d_model on one device. Where the rows are whole over those axes
  already (`TransformerLm.whole_rows`) w stays as it lies: each device's partial logits
  over its d_model shard are reduce-scattered over the vocab (a few rows' logits cross the
  links, not w). As training's where the vocab does not divide the axes."""
  if at is not None:
    x = jnp.take_along_axis(x, at[:, None, None], axis=1)
  mesh = jax.sharding.get_abstract_mesh()
  ws = model.weight_split_dims_mapping
  split = tuple(reversed(ws.embedding)) if model.tie_embeddings else ws.unembed
  d_axes = () if mesh.empty or mesh.manual_axes or not decoding else tuple(
      a for a in sharding.entry_axes(split[0]) if mesh.shape[a] > 1)
  vocab = sharding.entry_axes(split[1]) + d_axes
  if d_axes and w.shape[1] % sharding.shards(vocab, dict(mesh.shape)) == 0:
    rows = sharding.entry_axes(model.activation_split_dims_mapping.logits[0])
    x = constrain(x, (None,) * x.ndim)
    w = constrain(w, (None, vocab)) if set(rows) & set(d_axes) else w
    logits = constrain(x @ w, (None,) * (x.ndim - 1) + (vocab,))
  else:
    logits = x @ w
  return logits * scale if scale != 1.0 else logits


def _row_order(model: TransformerLm, x: jax.Array) -> jax.Array:
  """Per-token values [b, t] of a batch `_zigzag` ordered, back in the rows' own order."""
  order = _zigzag_order(model, x.shape[1])
  if order is None:
    return x
  return _reordered(np.argsort(order), model.activation_split_dims_mapping.heads[:2], x)[0]


def _token_xent(model: TransformerLm, batch: dict[str, jax.Array], mtp: bool = False,
                temperature: float = 1.0, argmax: bool = False):
  """(per-token cross entropy [b, t] of a batch already in zig-zag order where the sequence
  is split, `argmax`: each token's argmax id [b, t] (else None), the MoE stats or None): the
  head and loss, vocab-tiled or not, of the logits / `temperature`. `mtp` with
  `model.mtp_depth`: [b, (D+1)·t], the MTP heads' after the row's (`layers.mtp.shifted`)."""
  inputs, targets, tiles = batch["inputs"], batch["targets"], model.loss_vocab_tiles
  mtp_tokens = None
  if mtp and model.mtp_depth:
    mtp_tokens, mtp_targets, _ = mtp_lib.shifted(batch, model.mtp_depth)
    targets = jnp.concatenate([targets, mtp_targets], axis=1)
  out, stats = model(inputs, batch.get("positions"), segment_ids=batch.get("segment_ids"),
                     head=tiles == 1, moe_stats=True, zigzagged=True, mtp_tokens=mtp_tokens)
  if tiles > 1:  # logits = scale · x @ w: the temperature divides the scale
    x, w, scale = out
    token_xent, ids = _tiled_loss(model, x, w, scale / temperature, targets, argmax)
  else:
    token_xent = xent.cross_entropy(out / temperature, targets)
    ids = jnp.argmax(out, axis=-1) if argmax else None
  return token_xent, ids, stats


def _moe_layers(model: TransformerLm) -> int:
  """Layers of the stack named `layers` (the one the execution strategy runs)."""
  return model.num_layers - (model.moe.first_moe_layer if model.moe else 0)


def _layer_stacks(model: TransformerLm, x, positions, segment_ids, cache):
  """The layer stacks (called inside `model`'s compact `__call__`): (x, new cache, per-row
  MoE stats averaged over the MoE layers, or None when dense). With `moe.first_moe_layer` =
  k > 0 the first k layers are a dense scanned stack `dense_layers`; the MoE layers are
  `layers` (run by the strategy)."""
  if model.moe is None:
    x, cache = model._stack()(x, positions, segment_ids, cache=cache)  # pylint: disable=protected-access
    return x, cache, None
  k, n = model.moe.first_moe_layer, _moe_layers(model)
  caches = (None, None) if cache is None else (
      jax.tree.map(lambda c: c[:k], cache), jax.tree.map(lambda c: c[k:], cache))
  if k:
    x, dense_cache = stack_lib.LayerStack(
        Block, model.block_kwargs(), k, model.remat_policy, model.scan_unroll, None,
        name="dense_layers")(x, positions, segment_ids, cache=caches[0])
  stats = jnp.zeros((x.shape[0], len(moe_lib.STATS)), jnp.float32)
  (x, stats), moe_cache = stack_lib.LayerStack(
      moe_lib.MoeBlock, {**model.block_kwargs(), "moe": model.moe}, n, model.remat_policy,
      model.scan_unroll, model.execution, name="layers")((x, stats), positions, segment_ids,
                                                         cache=caches[1])
  if cache is not None:
    cache = moe_cache if not k else jax.tree.map(
        lambda a, b: jnp.concatenate([a, b]), dense_cache, moe_cache)
  return x, cache, stats / n


def _zigzag(model: TransformerLm, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """`batch` with each row's tokens in zig-zag order (layers.attention.context.zigzag)
  where the activations split the sequence over mesh axes, positions made explicit (each
  token keeps its true position); else `batch` itself. Runs on the devices: the input
  arrives as the host read it, and the constraint splits it over the sequence axes."""
  rows, seq_len = batch["inputs"].shape
  order = _zigzag_order(model, seq_len)
  if order is None:
    return batch
  if "positions" not in batch:
    batch = dict(batch, positions=jnp.broadcast_to(jnp.arange(seq_len), (rows, seq_len)))
  keys = [k for k in ("inputs", "targets", "weights", "positions", "segment_ids") if k in batch]
  split = model.activation_split_dims_mapping.heads[:2]
  return dict(batch, **dict(zip(keys, _reordered(order, split, *(batch[k] for k in keys)))))


def _reordered(order: np.ndarray | None, split, *arrays):
  """`arrays` (None among them kept) reordered along dim 1 by `order` (None: as they are),
  each constrained to `split`."""
  if order is None:
    return arrays
  return tuple(None if x is None else constrain(jnp.take(x, order, axis=1), split)
               for x in arrays)


def _zigzag_order(model: TransformerLm, seq_len: int) -> np.ndarray | None:
  """The zig-zag token order where the activations split the sequence over mesh axes of
  the context mesh; None where they do not."""
  mesh = jax.sharding.get_abstract_mesh()
  split = model.activation_split_dims_mapping.heads
  axes = () if mesh.empty else context_lib.seq_axes(split, dict(mesh.shape), mesh.manual_axes)
  return context_lib.zigzag(seq_len, sharding.shards(axes, dict(mesh.shape))) if axes else None


def _tiled_loss(model: TransformerLm, x, w, scale, targets, argmax: bool = False):
  """(per-token cross entropy over `model.loss_vocab_tiles` vocab tiles (layers.xent),
  `argmax`: each token's argmax id found per tile, else None)."""
  ws = model.weight_split_dims_mapping
  split = tuple(reversed(ws.embedding)) if model.tie_embeddings else ws.unembed  # [d, vocab]
  w_tiles = xent.head_tiles(w.astype(x.dtype), model.loss_vocab_tiles, split)
  args = (x, w_tiles, targets, model.vocab_size, scale,
          model.activation_split_dims_mapping.logits, split)
  return xent.tiled_scores(*args) if argmax else (xent.tiled_cross_entropy(*args), None)
